"""Stage 2: the causal score matrices of each chunk, one strip of 16 rows per program.

For one chunk of value head ``hv`` (q/k head ``h = hv // group``), with ``G`` from stage 1, ``q``, ``k``
after the optional l2norm (each row scaled by its ``r`` from stage 0 as it is loaded), and ``beta`` after
its activation::

    M[i, j]    =        sum_c k_i[c] k_j[c] exp(G_i[c] - G_j[c])             j < i  (A_kk = beta_i M)
    A_qk[i, j] = scale  sum_c q_i[c] k_j[c] exp(G_i[c] - G_j[c])             j <= i

Overflow. ``G`` falls without bound inside a chunk (pre-gated and softplus gates have no floor but
LOG_DECAY_FLOOR per token), so ``exp(G_i - G_j)`` is never split over the whole chunk. For the strip of rows
``I = [a, a + 16)`` against the columns before it (``j < a <= i``) the anchor is the strip's first row::

    exp(G_i - G_j) = exp(G_i - G_a) exp(G_a - G_j)          both factors <= 1

and the strip is one matrix product over ``K``. The diagonal block (``i, j`` both in ``I``) takes the same
anchored product when the strip's decay span ``max_{i,c} |G_i[c] - G_a[c]|`` is at most `DOT_SPAN` (80):
then ``exp(G_a - G_j) <= e^80`` is finite in fp32, every kept entry ``i >= j`` is <= 1, and the entries
above the diagonal (which may overflow) are discarded with ``where``, never multiplied by 0. The safe
gate (``lower_bound >= -5``: 15 steps of at most 5) always qualifies, and so do realistic pre-gated gates.
A strip with a larger span (an unbounded gate at its extremes) computes its diagonal block exactly
instead, element by element on ``[16, 16, BK]`` tiles, with the exponent set to -inf above the diagonal
before ``exp``. The choice is made per strip at run time (a branch on one scalar); on the H200 the exact
block for every strip cost 70% of the forward.

``M`` is stored in fp32 (stage 3 solves the inverse from it; the backward reads it for ``dbeta``), ``A_qk``
in the storage dtype, or, training on 16-bit inputs (``HALVES``), as bf16 halves ``[NT, HV, 2, C, C]``
(``hi = bf16(A)``, ``lo = bf16(A - hi)``: ``hi + lo`` is ``A`` to 16 significant bits, the operands of the
backward's serial pass, `state_backward`). At inference (``STORED``) so is ``q_e = scale q exp(G)``
(every exponent <= 0), for the output; in training it is not: the output and the backward make it from
``q`` and ``G`` as they load them (`kda/backends/helion/forward.py` says why).
Each strip writes its 16 rows whole: the columns before ``a`` from the product, the diagonal block, and
zeros after it, so the buffers need no clearing. Rows past the sequence's end read zeros and store zeros.

Grid ``(NT, HV, C / 16)``; the loop over ``K`` takes ``BK`` columns at a time (a config block size).
"""

from __future__ import annotations

import helion.language as hl
import torch

from kda.backends.helion.halves import split


def scores_kernel(
    q: torch.Tensor,  # [tokens, H, K] as given
    k: torch.Tensor,  # [tokens, H, K] as given
    rstd_q: torch.Tensor,  # [tokens, H] fp32 with L2 (stage 0's), else a placeholder
    rstd_k: torch.Tensor,  # [tokens, H] fp32 with L2, else a placeholder
    G: torch.Tensor,  # [NT, HV, C, K] fp32
    chunk_starts: torch.Tensor,  # [NT] int32
    chunk_seq_ends: torch.Tensor,  # [NT] int32
    M: torch.Tensor,  # [NT, HV, C, C] fp32 out (strictly lower)
    A_qk: torch.Tensor,  # [NT, HV, C, C] out, storage dtype (lower, scaled); [NT, HV, 2, C, C] bf16 with HALVES
    q_e: torch.Tensor,  # [NT, HV, C, K] out, storage dtype, with STORED (else a placeholder)
    scale: float,
    group: int,  # HV // H
    C: hl.constexpr,
    L2: hl.constexpr,  # rows scaled by their l2norm's r as they are loaded
    STORED: hl.constexpr,  # q_e stored (inference)
    HALVES: hl.constexpr,  # A_qk stored as bf16 halves (training on 16-bit inputs)
) -> None:
    NT = G.size(0)
    HV = G.size(1)
    K = G.size(3)
    for tile_c, tile_hv, tile_i in hl.tile([NT, HV, C], block_size=[1, 1, 16]):
        c = tile_c.begin
        hv = tile_hv.begin
        h = hv // group
        start = chunk_starts[c]
        end = chunk_seq_ends[c]
        a = tile_i.begin  # the strip's first row: the anchor
        rows = start + tile_i.index  # [16] tokens of the strip
        row_ok = rows < end
        # the strip's decay span over the whole head dim (rows past the end hold G flat: they add nothing)
        G_strip = G[c, hv, tile_i, :]  # [16, K]
        span = torch.amax(torch.amax(torch.abs(G_strip - G[c, hv, a, :][None, :]), dim=1), dim=0)
        by_product = span <= 80.0  # DOT_SPAN: e^80 = 5.5e34, finite in fp32
        limit = torch.where(by_product, a + 16, a)  # the product's columns: before the strip, and its own
        cols = hl.arange(C)  # [C] the chunk's rows, as columns
        col_ok = (start + cols < end) & (cols < limit)
        diag = a + hl.arange(16)  # [16] the diagonal block's columns
        diag_ok = start + diag < end
        causal = tile_i.index[:, None] >= diag[None, :]  # [16, 16] i >= j
        if L2:  # the rows' l2norm scales, loaded once for every block of K
            rq_i = hl.load(rstd_q, [rows, h], extra_mask=row_ok)  # [16]
            rk_i = hl.load(rstd_k, [rows, h], extra_mask=row_ok)
            rk_j = hl.load(rstd_k, [start + cols, h], extra_mask=col_ok)  # [C]
            rk_d = hl.load(rstd_k, [start + diag, h], extra_mask=diag_ok)  # [16]
        off_kk = hl.zeros([tile_i, C], dtype=torch.float32)
        off_qk = hl.zeros([tile_i, C], dtype=torch.float32)
        blk_kk = hl.zeros([tile_i, 16], dtype=torch.float32)
        blk_qk = hl.zeros([tile_i, 16], dtype=torch.float32)
        for tile_k in hl.tile(K):
            G_i = G[c, hv, tile_i, tile_k]  # [16, BK]
            G_a = G[c, hv, a, tile_k]  # [BK]
            q_i = hl.load(q, [rows, h, tile_k], extra_mask=row_ok[:, None]).to(torch.float32)
            k_i = hl.load(k, [rows, h, tile_k], extra_mask=row_ok[:, None]).to(torch.float32)
            # the strip against the columns before it (and, by product, its own), through the anchor
            G_j = hl.load(G, [c, hv, cols, tile_k])  # [C, BK]
            k_j = hl.load(k, [start + cols, h, tile_k], extra_mask=col_ok[:, None]).to(torch.float32)
            if L2:
                q_i = q_i * rq_i[:, None]
                k_i = k_i * rk_i[:, None]
                k_j = k_j * rk_j[:, None]
            if STORED:
                q_e[c, hv, tile_i, tile_k] = (scale * q_i * torch.exp(G_i)).to(q_e.dtype)
            k_j = k_j * torch.exp(torch.where(col_ok[:, None], G_a[None, :] - G_j, float("-inf")))
            decay_i = torch.exp(G_i - G_a[None, :])
            off_kk = hl.dot(k_i * decay_i, k_j.transpose(0, 1), acc=off_kk)
            off_qk = hl.dot(q_i * decay_i, k_j.transpose(0, 1), acc=off_qk)
            if not by_product:  # the diagonal block, exactly
                G_d = hl.load(G, [c, hv, diag, tile_k])  # [16, BK]
                k_d = hl.load(k, [start + diag, h, tile_k], extra_mask=diag_ok[:, None]).to(torch.float32)
                if L2:
                    k_d = k_d * rk_d[:, None]
                exponent = torch.where(causal[:, :, None], G_i[:, None, :] - G_d[None, :, :], float("-inf"))
                kd_e = k_d[None, :, :] * torch.exp(exponent)  # [16, 16, BK]
                blk_kk = blk_kk + torch.sum(k_i[:, None, :] * kd_e, dim=2)
                blk_qk = blk_qk + torch.sum(q_i[:, None, :] * kd_e, dim=2)
        # every column but the diagonal block's comes from the product (zeros after the strip); the block
        # too when it went by product: keep j < i (A_kk) and j <= i (A_qk)
        from_product = (cols < a) | (cols >= a + 16) | by_product  # [C]
        M_strip = torch.where((tile_i.index[:, None] > cols[None, :]) & (cols < limit)[None, :], off_kk, 0.0)
        hl.store(M, [c, hv, tile_i, cols], M_strip, extra_mask=from_product[None, :])
        A = torch.where((tile_i.index[:, None] >= cols[None, :]) & (cols < limit)[None, :], scale * off_qk, 0.0)
        if HALVES:
            A_hi, A_lo = split(A)
            hl.store(A_qk, [c, hv, 0, tile_i, cols], A_hi, extra_mask=from_product[None, :])
            hl.store(A_qk, [c, hv, 1, tile_i, cols], A_lo, extra_mask=from_product[None, :])
        else:
            hl.store(A_qk, [c, hv, tile_i, cols], A.to(A_qk.dtype), extra_mask=from_product[None, :])
        if not by_product:
            strict = tile_i.index[:, None] > diag[None, :]
            hl.store(M, [c, hv, tile_i, diag], torch.where(strict, blk_kk, 0.0))
            if HALVES:
                A_diag = torch.where(causal, scale * blk_qk, 0.0)
                diag_hi, diag_lo = split(A_diag)
                hl.store(A_qk, [c, hv, 0, tile_i, diag], diag_hi)
                hl.store(A_qk, [c, hv, 1, tile_i, diag], diag_lo)
            else:
                hl.store(A_qk, [c, hv, tile_i, diag], torch.where(causal, scale * blk_qk, 0.0).to(A_qk.dtype))
