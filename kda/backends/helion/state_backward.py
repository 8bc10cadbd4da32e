"""Backward stage 1: the reverse serial pass over each sequence's chunks.

With ``dS`` the gradient of the state leaving a chunk (``d final_state`` for the last, or 0), from the
forward's ``S' = exp(G_last) S + k_g^T v_new``, ``v_new = u - w S`` and ``o = q_e S + A_qk v_new``::

    for each chunk j of the sequence, last to first:
        dh[j]     = dS                                              [K, V]  (the chunk's dS')
        dv_new[j] = A_qk[j]^T @ do[j] + k_g[j] @ dS                  [C, V]
        dS        = exp(G_last[j])[:, None] * dS + q_e[j]^T @ do[j] - w[j]^T @ dv_new[j]
    d initial_state[n] = dS

with ``q_e = scale q exp(G)`` and ``k_g = k exp(G_last - G)`` made here, as the forward made them, from the
chunk's rows of ``q`` and ``k`` (times their l2norm scales with L2) and ``G``: nothing stores them.
``dh`` and ``dv_new`` are stored chunk-major in fp32 for `chunk_backward`. Grid ``(N, HV, V / BV)``;
``K`` whole, ``dS`` fp32 in registers. Both state layouts, as the forward's `state`.

Training on bf16/fp16 inputs (``HALVES``), every product is on bf16 halves, as in the forward's `state`:
``w`` and ``A_qk`` read as the forward stored them (``[NT, HV, 2, C, ...]``, ``x = hi + lo``), ``q_e``,
``k_g``, ``dS`` and ``dv_new`` split in registers (``hi = bf16(x)``, ``lo = bf16(x - hi)``), each product
``a b`` as ``a_lo b_hi + a_hi b_lo + a_hi b_hi`` with fp32 accumulation. ``do`` is 16-bit already: bf16 is
one half (two products), fp16 two exact ones (its 11 bits as ``hi + lo``; three products).
"""

from __future__ import annotations

import helion.language as hl
import torch

from kda.backends.helion.halves import MIN_BLOCK_V, dot3, split


def state_backward_kernel(
    do: torch.Tensor,  # [tokens, HV, V]
    q: torch.Tensor,  # [tokens, H, K] as given
    k: torch.Tensor,  # [tokens, H, K] as given
    rstd_q: torch.Tensor,  # [tokens, H] fp32 with L2, else a placeholder
    rstd_k: torch.Tensor,  # [tokens, H] fp32 with L2, else a placeholder
    w: torch.Tensor,  # [NT, HV, C, K]; [NT, HV, 2, C, K] bf16 halves with HALVES
    A_qk: torch.Tensor,  # [NT, HV, C, C]; [NT, HV, 2, C, C] bf16 halves with HALVES
    G: torch.Tensor,  # [NT, HV, C, K] fp32
    chunk_starts: torch.Tensor,  # [NT] int32
    chunk_seq_ends: torch.Tensor,  # [NT] int32
    chunk_bounds: torch.Tensor,  # [N + 1] int32
    dht: torch.Tensor,  # [N, HV, K, V] (or [N, HV, V, K]); a placeholder without one
    dh: torch.Tensor,  # [NT, HV, K, V] fp32 out
    dv_new: torch.Tensor,  # [NT, HV, C, V] fp32 out
    dh0: torch.Tensor,  # [N, HV, K, V] (or [N, HV, V, K]) fp32 out; a placeholder without one
    scale: float,
    group: int,  # HV // H
    C: hl.constexpr,
    HAS_DHT: hl.constexpr,
    STORE_DH0: hl.constexpr,
    V_FIRST: hl.constexpr,
    L2: hl.constexpr,
    HALVES: hl.constexpr,  # training on 16-bit inputs: w and A_qk as bf16 halves, every product on halves
) -> None:
    N = chunk_bounds.size(0) - 1
    HV = w.size(1)
    K = hl.specialize(w.size(-1))
    hl.specialize(q.size(2))
    V = dh.size(3)
    # on halves, no fewer value columns a program than MIN_BLOCK_V (`halves.py` says why); a configuration
    # asking fewer is raised to it
    block_v = hl.register_block_size(MIN_BLOCK_V if HALVES else 1, V)
    for tile_n, tile_hv, tile_v in hl.tile([N, HV, V], block_size=[1, 1, block_v]):
        n = tile_n.begin
        hv = tile_hv.begin
        head = hv // group
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
            if HALVES:
                do_j = hl.load(do, [rows, hv, tile_v], extra_mask=valid[:, None])  # [C, BV] 16-bit
                do_hi = do_j.to(torch.bfloat16)  # bf16's do whole; fp16's top 8 bits
                k_j = hl.load(k, [rows, head, hl.arange(K)], extra_mask=valid[:, None]).to(torch.float32)
                if L2:
                    k_j = k_j * hl.load(rstd_k, [rows, head], extra_mask=valid)[:, None]
                G_last = G[j, hv, C - 1, :]  # [K]
                k_g = k_j * torch.exp(G_last[None, :] - G[j, hv, :, :])  # [C, K]
                k_hi, k_lo = split(k_g)
                dS_hi, dS_lo = split(dS)
                A_hi = A_qk[j, hv, 0, :, :].transpose(0, 1)  # [C, C]
                dvn = hl.dot(A_qk[j, hv, 1, :, :].transpose(0, 1), do_hi)  # [C, BV], the smallest terms first
                if do.dtype == torch.float16:  # its low 3 bits, exact in bf16
                    do_lo = (do_j.to(torch.float32) - do_hi.to(torch.float32)).to(torch.bfloat16)
                    dvn = hl.dot(A_hi, do_lo, acc=dvn)
                dvn = hl.dot(A_hi, do_hi, acc=dvn)
                dvn = dot3(k_hi, k_lo, dS_hi, dS_lo, acc=dvn)
                dv_new[j, hv, :, tile_v] = dvn
                dS = dS * torch.exp(G_last)[:, None]
                q_j = hl.load(q, [rows, head, hl.arange(K)], extra_mask=valid[:, None]).to(torch.float32)
                if L2:
                    q_j = q_j * hl.load(rstd_q, [rows, head], extra_mask=valid)[:, None]
                q_e = scale * q_j * torch.exp(G[j, hv, :, :])  # [C, K]
                q_hi, q_lo = split(q_e)
                dS = hl.dot(q_lo.transpose(0, 1), do_hi, acc=dS)
                if do.dtype == torch.float16:
                    dS = hl.dot(q_hi.transpose(0, 1), do_lo, acc=dS)
                dS = hl.dot(q_hi.transpose(0, 1), do_hi, acc=dS)
                dvn_hi, dvn_lo = split(dvn)
                w_hi = w[j, hv, 0, :, :].transpose(0, 1)  # [K, C]
                dS = dS - dot3(w_hi, w[j, hv, 1, :, :].transpose(0, 1), dvn_hi, dvn_lo)
            else:
                do_j = hl.load(do, [rows, hv, tile_v], extra_mask=valid[:, None]).to(torch.float32)  # [C, BV]
                q_j = hl.load(q, [rows, head, hl.arange(K)], extra_mask=valid[:, None]).to(torch.float32)  # [C, K]
                k_j = hl.load(k, [rows, head, hl.arange(K)], extra_mask=valid[:, None]).to(torch.float32)
                if L2:
                    q_j = q_j * hl.load(rstd_q, [rows, head], extra_mask=valid)[:, None]
                    k_j = k_j * hl.load(rstd_k, [rows, head], extra_mask=valid)[:, None]
                G_j = G[j, hv, :, :]  # [C, K]
                G_last = G[j, hv, C - 1, :]  # [K]
                q_e = scale * q_j * torch.exp(G_j)
                k_g = k_j * torch.exp(G_last[None, :] - G_j)
                A = A_qk[j, hv, :, :].to(torch.float32)
                dvn = hl.dot(A.transpose(0, 1), do_j)
                dvn = hl.dot(k_g, dS, acc=dvn)
                dv_new[j, hv, :, tile_v] = dvn
                dS = dS * torch.exp(G_last)[:, None]
                dS = hl.dot(q_e.transpose(0, 1), do_j, acc=dS)
                dS = dS - hl.dot(w[j, hv, :, :].to(torch.float32).transpose(0, 1), dvn)
        if STORE_DH0:
            if V_FIRST:
                dh0[n, hv, tile_v, :] = dS.transpose(0, 1)
            else:
                dh0[n, hv, :, tile_v] = dS
