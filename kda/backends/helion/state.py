"""Stage 4: the serial pass over each sequence's chunks: the state entering each chunk, and its new values.

Per sequence ``n`` and value head ``hv``, ``S`` starting at the initial state (or 0)::

    for each chunk j of the sequence, in order:
        h[j]     = S                                          [K, V]  (kept for the output and backward)
        v_new[j] = u[j] - w[j] @ S                            [C, V]  (written over u)
        S        = exp(G_last[j])[:, None] * S + k_g[j]^T @ v_new[j]
    final_state[n] = S

Only this loop is serial; a program holds ``S`` for a block of ``V`` columns (``[K, BV]`` fp32 in
registers) and every read is a whole chunk-major tile. A tail chunk's rows past the end are zero in ``w``,
``u`` and ``k_g``, so they change nothing, and ``G_last`` (the chunk's last row) is the last token's value.
The products take operands in the storage dtype (fp32 accumulation), as the intermediates are stored.

Both state layouts: ``[N, HV, K, V]``, or ``[N, HV, V, K]`` with ``V_FIRST`` (read and written transposed).
Grid ``(N, HV, V / BV)``.
"""

from __future__ import annotations

import helion.language as hl
import torch


def state_kernel(
    w: torch.Tensor,  # [NT, HV, C, K]
    u: torch.Tensor,  # [NT, HV, C, V] in: u; out: v_new
    k_g: torch.Tensor,  # [NT, HV, C, K]
    G: torch.Tensor,  # [NT, HV, C, K] fp32
    chunk_bounds: torch.Tensor,  # [N + 1] int32: sequence n owns chunks [chunk_bounds[n], chunk_bounds[n+1])
    h: torch.Tensor,  # [NT, HV, K, V] out, storage dtype
    h0: torch.Tensor,  # [N, HV, K, V] (or [N, HV, V, K]); a placeholder without one
    ht: torch.Tensor,  # [N, HV, K, V] (or [N, HV, V, K]) fp32 out; a placeholder without one
    C: hl.constexpr,
    HAS_H0: hl.constexpr,
    STORE_HT: hl.constexpr,
    V_FIRST: hl.constexpr,
) -> None:
    N = chunk_bounds.size(0) - 1
    HV = w.size(1)
    K = hl.specialize(w.size(3))
    V = u.size(3)
    for tile_n, tile_hv, tile_v in hl.tile([N, HV, V], block_size=[1, 1, None]):
        n = tile_n.begin
        hv = tile_hv.begin
        if HAS_H0:
            if V_FIRST:
                S = h0[n, hv, tile_v, :].to(torch.float32).transpose(0, 1)
            else:
                S = h0[n, hv, :, tile_v].to(torch.float32)
        else:
            S = hl.zeros([K, tile_v], dtype=torch.float32)
        for tile_j in hl.tile(chunk_bounds[n], chunk_bounds[n + 1], block_size=1):
            j = tile_j.begin
            h[j, hv, :, tile_v] = S.to(h.dtype)
            w_j = w[j, hv, :, :]  # [C, K]
            v_new = u[j, hv, :, tile_v].to(torch.float32) - hl.dot(w_j, S.to(w_j.dtype))
            u[j, hv, :, tile_v] = v_new.to(u.dtype)
            G_last = G[j, hv, C - 1, :]  # [K]
            k_j = k_g[j, hv, :, :]  # [C, K]
            S = hl.dot(k_j.transpose(0, 1), v_new.to(k_j.dtype), acc=S * torch.exp(G_last)[:, None])
        if STORE_HT:
            if V_FIRST:
                ht[n, hv, tile_v, :] = S.transpose(0, 1)
            else:
                ht[n, hv, :, tile_v] = S
