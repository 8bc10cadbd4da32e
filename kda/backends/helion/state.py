"""Stage 4: the serial pass over each sequence's chunks: the state entering each chunk, and its new values.

Per sequence ``n`` and value head ``hv``, ``S`` starting at the initial state (or 0)::

    for each chunk j of the sequence, in order:
        h[j]     = S                                          [K, V]  (kept for the output and backward)
        v_new[j] = u[j] - w[j] @ S                            [C, V]  (written over u)
        S        = exp(G_last[j])[:, None] * S + k_g[j]^T @ v_new[j]
    final_state[n] = S

with ``k_g[j] = k exp(G_last - G)`` (every exponent <= 0) read as `solve` stored it at inference
(``STORED``), and in training made here from the chunk's rows of ``k`` (times their l2norm scale ``r``
with L2) and ``G`` (`kda/backends/helion/forward.py` says why). Only this loop is serial; a program holds ``S`` for a block of ``V`` columns (``[K, BV]`` fp32 in
registers). A tail chunk's rows past the end are zero in ``w``, ``u`` and ``k`` (masked loads), so they
change nothing, and ``G_last`` (the chunk's last row) is the last token's value. The products take
operands in the storage dtype (fp32 accumulation), as the intermediates are stored.

Training on bf16/fp16 inputs (``HALVES``): ``w`` is read as the bf16 halves `solve` stored (``[NT, HV, 2,
C, K]``, ``w = hi + lo``), ``k_g``, ``S`` and ``v_new`` are split the same way in registers (``hi =
bf16(x)``, ``lo = bf16(x - hi)``), and each product ``a b`` is ``a_lo b_hi + a_hi b_lo + a_hi b_hi`` on
bf16 tensor cores with fp32 accumulation: the terms above 2^-16 of fp32's product, whose operands can come
from shared memory, where TF32x3 (Triton's three TF32 products of fp32 operands) holds three copies of each
in registers and spills (`docs/design.md`, "The helion backend").

Both state layouts: ``[N, HV, K, V]``, or ``[N, HV, V, K]`` with ``V_FIRST`` (read and written transposed).
Grid ``(N, HV, V / BV)``.
"""

from __future__ import annotations

import helion.language as hl
import torch

from kda.backends.helion.halves import MIN_BLOCK_V, dot3, split


def state_kernel(
    w: torch.Tensor,  # [NT, HV, C, K]; [NT, HV, 2, C, K] bf16 halves with HALVES
    u: torch.Tensor,  # [NT, HV, C, V] in: u; out: v_new
    k_g: torch.Tensor,  # [NT, HV, C, K] with STORED (else a placeholder)
    k: torch.Tensor,  # [tokens, H, K] as given
    rstd_k: torch.Tensor,  # [tokens, H] fp32 with L2, else a placeholder
    G: torch.Tensor,  # [NT, HV, C, K] fp32
    chunk_starts: torch.Tensor,  # [NT] int32
    chunk_seq_ends: torch.Tensor,  # [NT] int32
    chunk_bounds: torch.Tensor,  # [N + 1] int32: sequence n owns chunks [chunk_bounds[n], chunk_bounds[n+1])
    h: torch.Tensor,  # [NT, HV, K, V] out, storage dtype
    h0: torch.Tensor,  # [N, HV, K, V] (or [N, HV, V, K]); a placeholder without one
    ht: torch.Tensor,  # [N, HV, K, V] (or [N, HV, V, K]) fp32 out; a placeholder without one
    group: int,  # HV // H
    C: hl.constexpr,
    HAS_H0: hl.constexpr,
    STORE_HT: hl.constexpr,
    V_FIRST: hl.constexpr,
    L2: hl.constexpr,
    STORED: hl.constexpr,  # k_g read as stored (inference), else made from k and G
    HALVES: hl.constexpr,  # training on 16-bit inputs: w as bf16 halves, every product on halves
) -> None:
    N = chunk_bounds.size(0) - 1
    HV = w.size(1)
    K = hl.specialize(w.size(-1))
    hl.specialize(k.size(2))
    V = u.size(3)
    # on halves, no fewer value columns a program than MIN_BLOCK_V (`halves.py` says why); a configuration
    # asking fewer is raised to it
    block_v = hl.register_block_size(MIN_BLOCK_V if HALVES else 1, V)
    for tile_n, tile_hv, tile_v in hl.tile([N, HV, V], block_size=[1, 1, block_v]):
        n = tile_n.begin
        hv = tile_hv.begin
        head = hv // group
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
            if HALVES:
                S_hi, S_lo = split(S)
                products = dot3(w[j, hv, 0, :, :], w[j, hv, 1, :, :], S_hi, S_lo)  # [C, BV]
                v_new = u[j, hv, :, tile_v] - products
            else:
                w_j = w[j, hv, :, :]  # [C, K]
                v_new = u[j, hv, :, tile_v].to(torch.float32) - hl.dot(w_j, S.to(w_j.dtype))
            u[j, hv, :, tile_v] = v_new.to(u.dtype)
            G_last = G[j, hv, C - 1, :]  # [K]
            if STORED:
                k_j = k_g[j, hv, :, :]  # [C, K]
            else:
                rows = chunk_starts[j] + hl.arange(C)
                valid = rows < chunk_seq_ends[j]
                k_j = hl.load(k, [rows, head, hl.arange(K)], extra_mask=valid[:, None]).to(torch.float32)
                if L2:
                    k_j = k_j * hl.load(rstd_k, [rows, head], extra_mask=valid)[:, None]
                k_j = k_j * torch.exp(G_last[None, :] - G[j, hv, :, :])  # fp32, as w is when not HALVES
            if HALVES:
                S = S * torch.exp(G_last)[:, None]
                k_hi, k_lo = split(k_j)
                v_hi, v_lo = split(v_new)
                S = dot3(k_hi.transpose(0, 1), k_lo.transpose(0, 1), v_hi, v_lo, acc=S)
            else:
                S = hl.dot(k_j.transpose(0, 1), v_new.to(k_j.dtype), acc=S * torch.exp(G_last)[:, None])
        if STORE_HT:
            if V_FIRST:
                ht[n, hv, tile_v, :] = S.transpose(0, 1)
            else:
                ht[n, hv, :, tile_v] = S
