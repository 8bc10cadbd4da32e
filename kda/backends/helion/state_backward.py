"""Backward stage 1: the reverse serial pass over each sequence's chunks.

With ``dS`` the gradient of the state leaving a chunk (``d final_state`` for the last, or 0), from the
forward's ``S' = exp(G_last) S + k_g^T v_new``, ``v_new = u - w S`` and ``o = q_e S + A_qk v_new``::

    for each chunk j of the sequence, last to first:
        dh[j]     = dS                                              [K, V]  (the chunk's dS')
        dv_new[j] = A_qk[j]^T @ do[j] + k_g[j] @ dS                  [C, V]
        dS        = exp(G_last[j])[:, None] * dS + q_e[j]^T @ do[j] - w[j]^T @ dv_new[j]
    d initial_state[n] = dS

``dh`` and ``dv_new`` are stored chunk-major in fp32 for `chunk_backward`. Grid ``(N, HV, V / BV)``;
``K`` whole, ``dS`` fp32 in registers. Both state layouts, as the forward's `state`.
"""

from __future__ import annotations

import helion.language as hl
import torch


def state_backward_kernel(
    do: torch.Tensor,  # [tokens, HV, V]
    q_e: torch.Tensor,  # [NT, HV, C, K]
    w: torch.Tensor,  # [NT, HV, C, K]
    k_g: torch.Tensor,  # [NT, HV, C, K]
    A_qk: torch.Tensor,  # [NT, HV, C, C]
    G: torch.Tensor,  # [NT, HV, C, K] fp32
    chunk_starts: torch.Tensor,  # [NT] int32
    chunk_seq_ends: torch.Tensor,  # [NT] int32
    chunk_bounds: torch.Tensor,  # [N + 1] int32
    dht: torch.Tensor,  # [N, HV, K, V] (or [N, HV, V, K]); a placeholder without one
    dh: torch.Tensor,  # [NT, HV, K, V] fp32 out
    dv_new: torch.Tensor,  # [NT, HV, C, V] fp32 out
    dh0: torch.Tensor,  # [N, HV, K, V] (or [N, HV, V, K]) fp32 out; a placeholder without one
    C: hl.constexpr,
    HAS_DHT: hl.constexpr,
    STORE_DH0: hl.constexpr,
    V_FIRST: hl.constexpr,
) -> None:
    N = chunk_bounds.size(0) - 1
    HV = w.size(1)
    K = hl.specialize(w.size(3))
    V = dh.size(3)
    for tile_n, tile_hv, tile_v in hl.tile([N, HV, V], block_size=[1, 1, None]):
        n = tile_n.begin
        hv = tile_hv.begin
        if HAS_DHT:
            if V_FIRST:
                dS = dht[n, hv, tile_v, :].to(torch.float32).transpose(0, 1)
            else:
                dS = dht[n, hv, :, tile_v].to(torch.float32)
        else:
            dS = hl.zeros([K, tile_v], dtype=torch.float32)
        first = chunk_bounds[n]
        last = chunk_bounds[n + 1] - 1
        for tile_t in hl.tile(first, last + 1, block_size=1):
            j = last - (tile_t.begin - first)  # the chunks in reverse
            dh[j, hv, :, tile_v] = dS
            rows = chunk_starts[j] + hl.arange(C)
            valid = rows < chunk_seq_ends[j]
            do_j = hl.load(do, [rows, hv, tile_v], extra_mask=valid[:, None]).to(torch.float32)  # [C, BV]
            A = A_qk[j, hv, :, :].to(torch.float32)
            k_j = k_g[j, hv, :, :].to(torch.float32)
            dvn = hl.dot(A.transpose(0, 1), do_j)
            dvn = hl.dot(k_j, dS, acc=dvn)
            dv_new[j, hv, :, tile_v] = dvn
            G_last = G[j, hv, C - 1, :]  # [K]
            dS = dS * torch.exp(G_last)[:, None]
            dS = hl.dot(q_e[j, hv, :, :].to(torch.float32).transpose(0, 1), do_j, acc=dS)
            dS = dS - hl.dot(w[j, hv, :, :].to(torch.float32).transpose(0, 1), dvn)
        if STORE_DH0:
            if V_FIRST:
                dh0[n, hv, tile_v, :] = dS.transpose(0, 1)
            else:
                dh0[n, hv, :, tile_v] = dS
