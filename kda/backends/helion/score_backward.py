"""Backward stage 3: the gradients through the two score matrices, one 16-row strip per program.

Both are ``P[i, j] = sum_c a_i[c] b_j[c] exp(G_i[c] - G_j[c])`` (``P_qk``: ``a = q, b = k``, ``j <= i``;
``P_kk = M``: ``a = b = k``, ``j < i``), with ``dP`` from `chunk_backward`::

    da_i = sum_j dP[i, j] b_j exp(G_i - G_j)        db_j = sum_i dP[i, j] a_i exp(G_i - G_j)
    dG_i += a_i da_i                                 dG_j -= b_j db_j

A program takes the strip ``S = [s, s + 16)`` twice: as rows (its ``da``) and as columns (its ``db``).
Off the diagonal block the exponentials are split through an anchor between the two index sets, so both
factors are <= 1 (`scores` explains why): as rows, the strip's first row ``s`` against the columns
``j < s``; as columns, the strip's last row ``s + 15`` against the rows after it. Each is one product over
the chunk. The diagonal block joins those products (``dP`` cut to its causal triangle first) when the
strip's decay span against either anchor is at most 80 (``e^80`` is finite in fp32, as in `scores`) and
its largest single log decay ``max |G_t - G_(t-1)|`` at most 8: ``da`` and ``db`` meet in ``dG`` as a
difference, whose fp32 residual grows with the factors' exponents, and ``dA_log`` multiplies it by the log
decays (the triton backend's rule, `DIFFERENCE_STEP`; `by_product`). Otherwise, decided per strip at run
time, the block is left out here and `score_diagonal` adds it exactly, one step per row (or column). Kept
out of this kernel, its 16 unrolled steps no longer take this kernel's registers: compiled for sm_90a at
B4_T2048_H16_D128 training, 196 B spilled a thread at Helion's default setting instead of 2304, none at
16-wide key blocks and 4 warps (`benchmarks/helion_resources.py`; `docs/design.md`, "The helion backend").

Then, per row of the strip::

    dq += da (P_qk)        dk += da (P_kk) + db (P_qk) + db (P_kk)
    dG += q da (P_qk) + k da (P_kk) - k (db (P_qk) + db (P_kk))

added to what `chunk_backward` wrote (a strip's rows belong to this program alone). Grid
``(NT, HV, C / 16)``, ``K`` in config-sized blocks.
"""

from __future__ import annotations

import helion.language as hl
import torch

from kda.backends.helion.gate import SAFE, SIGMOID
from kda.backends.strips import bound_keeps_strips_within_limits


def within_limits(gate: int, lower_bound: float) -> bool:
    """Whether the gate keeps every strip's diagonal block within the limits (`kda.backends.strips`), so that
    `by_product` is true for every strip and `score_diagonal` has nothing to add (the backward then does not
    launch it). The sigmoid and safe gates give log decays ``|a_t| <= |lower_bound|`` (`gate`); the pre-gated
    and softplus gates bound nothing but the floor, so their strips decide on the GPU."""
    return gate in (SIGMOID, SAFE) and bound_keeps_strips_within_limits(lower_bound)


def by_product(
    G_strip: torch.Tensor,  # [16, K] the strip's rows of G
    G_prev: torch.Tensor,  # [16, K] the row before each (the strip's first: itself)
    G_first: torch.Tensor,  # [1, K] the strip's first row
    G_end: torch.Tensor,  # [1, K] its last
) -> torch.Tensor:
    """Whether the strip's diagonal block joins the products through the anchors (a 0-d bool): its decay
    span against either anchor at most 80 and its largest single log decay at most 8. `score_backward` and
    `score_diagonal` decide alike from it (Helion inlines it into both)."""
    from_first = torch.abs(G_strip - G_first)
    from_end = torch.abs(G_strip - G_end)
    span = torch.amax(torch.amax(torch.maximum(from_first, from_end), dim=1), dim=0)
    step = torch.amax(torch.amax(torch.abs(G_strip - G_prev), dim=1), dim=0)
    # `strips.SPAN_LIMIT` and `STEP_LIMIT` as literals: a module constant would reach Helion's generated code
    # as a runtime argument
    return (span <= 80.0) & (step <= 8.0)


def score_backward_kernel(
    q: torch.Tensor,  # [tokens, H, K] as given
    k: torch.Tensor,  # [tokens, H, K] as given
    rstd_q: torch.Tensor,  # [tokens, H] fp32 with L2 (each row is used times its r), else a placeholder
    rstd_k: torch.Tensor,  # [tokens, H] fp32 with L2, else a placeholder
    G: torch.Tensor,  # [NT, HV, C, K] fp32
    dP_qk: torch.Tensor,  # [NT, HV, C, C] fp32
    dP_kk: torch.Tensor,  # [NT, HV, C, C] fp32
    chunk_starts: torch.Tensor,  # [NT] int32
    chunk_seq_ends: torch.Tensor,  # [NT] int32
    dq_c: torch.Tensor,  # [NT, HV, C, K] fp32, added to
    dk_c: torch.Tensor,  # [NT, HV, C, K] fp32, added to
    dG_c: torch.Tensor,  # [NT, HV, C, K] fp32, added to
    group: int,
    C: hl.constexpr,
    L2: hl.constexpr,
) -> None:
    NT = G.size(0)
    HV = G.size(1)
    K = G.size(3)
    for tile_c, tile_hv, tile_s in hl.tile([NT, HV, C], block_size=[1, 1, 16]):
        c = tile_c.begin
        hv = tile_hv.begin
        head = hv // group
        start = chunk_starts[c]
        end = chunk_seq_ends[c]
        s = tile_s.begin
        rows = start + tile_s.index
        row_ok = rows < end
        # which way the diagonal block goes (rows past the end hold G flat: they add nothing)
        G_strip = G[c, hv, tile_s, :]  # [16, K]
        previous = torch.where(tile_s.index > s, tile_s.index - 1, s)
        G_prev = hl.load(G, [c, hv, previous, slice(None)])  # [16, K] the row before each (the first: itself)
        joined = by_product(G_strip, G_prev, G[c, hv, s, :][None, :], G[c, hv, s + 15, :][None, :])
        cols = hl.arange(C)
        col_ok = start + cols < end
        before = (cols < torch.where(joined, s + 16, s)) & col_ok  # the rows' product columns
        after = (cols >= torch.where(joined, s, s + 16)) & col_ok  # the columns' product rows
        rows_causal = cols[None, :] <= tile_s.index[:, None]  # [16, C] j <= i, the strip as rows
        cols_causal = cols[:, None] >= tile_s.index[None, :]  # [C, 16] i >= j, the strip as columns
        dPq_rows = torch.where(rows_causal, dP_qk[c, hv, tile_s, :], 0.0)  # [16, C]
        dPk_rows = torch.where(rows_causal & (cols[None, :] != tile_s.index[:, None]), dP_kk[c, hv, tile_s, :], 0.0)
        dPq_cols = torch.where(cols_causal, dP_qk[c, hv, :, tile_s], 0.0)  # [C, 16]
        dPk_cols = torch.where(cols_causal & (cols[:, None] != tile_s.index[None, :]), dP_kk[c, hv, :, tile_s], 0.0)
        if L2:  # the rows' l2norm scales: the strip's, and the chunk's
            rq_s = hl.load(rstd_q, [rows, head], extra_mask=row_ok)  # [16]
            rk_s = hl.load(rstd_k, [rows, head], extra_mask=row_ok)
            rq_all = hl.load(rstd_q, [start + cols, head], extra_mask=col_ok)  # [C]
            rk_all = hl.load(rstd_k, [start + cols, head], extra_mask=col_ok)
        for tile_k in hl.tile(K):
            G_s = G[c, hv, tile_s, tile_k]  # [16, BK]
            G_first = G[c, hv, s, tile_k]  # [BK]
            G_end = G[c, hv, s + 15, tile_k]
            G_all = hl.load(G, [c, hv, cols, tile_k])  # [C, BK]
            q_s = hl.load(q, [rows, head, tile_k], extra_mask=row_ok[:, None]).to(torch.float32)
            k_s = hl.load(k, [rows, head, tile_k], extra_mask=row_ok[:, None]).to(torch.float32)
            q_all = hl.load(q, [start + cols, head, tile_k], extra_mask=col_ok[:, None]).to(torch.float32)
            k_all = hl.load(k, [start + cols, head, tile_k], extra_mask=col_ok[:, None]).to(torch.float32)
            if L2:
                q_s = q_s * rq_s[:, None]
                k_s = k_s * rk_s[:, None]
                q_all = q_all * rq_all[:, None]
                k_all = k_all * rk_all[:, None]
            # through the anchors: off the diagonal block, and on it when by product
            k_before = k_all * torch.exp(torch.where(before[:, None], G_first[None, :] - G_all, float("-inf")))
            into_rows = torch.exp(G_s - G_first[None, :])
            da_q = into_rows * hl.dot(dPq_rows, k_before)
            da_k = into_rows * hl.dot(dPk_rows, k_before)
            decay_after = torch.exp(torch.where(after[:, None], G_all - G_end[None, :], float("-inf")))
            into_cols = torch.exp(G_end[None, :] - G_s)
            db_q = into_cols * hl.dot(dPq_cols.transpose(0, 1), q_all * decay_after)
            db_k = into_cols * hl.dot(dPk_cols.transpose(0, 1), k_all * decay_after)
            dq_c[c, hv, tile_s, tile_k] = dq_c[c, hv, tile_s, tile_k] + da_q
            dk_c[c, hv, tile_s, tile_k] = dk_c[c, hv, tile_s, tile_k] + da_k + db_q + db_k
            dG_c[c, hv, tile_s, tile_k] = dG_c[c, hv, tile_s, tile_k] + q_s * da_q + k_s * (da_k - db_q - db_k)
