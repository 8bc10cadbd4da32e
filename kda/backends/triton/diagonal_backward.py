"""The diagonal blocks of the backward's pairwise terms: the pairs ``j < i`` inside one 16-row sub-chunk.

For rows ``i`` and columns ``j`` of the same sub-chunk (`chunk_backward`'s ``_pairwise_row_block`` takes
the blocks below the diagonal), with ``P_ij = (dM_ij k_i + dQ_ij q_i) k_j E_ij`` and ``E_ij = e^(G_i -
G_j)``, the block adds to ``dk`` (``sum_j dM_ij k_j E_ij`` and ``sum_i (dM_ij k_i + dQ_ij q_i) E_ij``),
to ``dq`` (``sum_j dQ_ij k_j E_ij``) and to ``da_t`` (``sum_{i >= t} sum_{j < t} P_ij``), by one of two
paths, chosen per block by `chunk_backward`:

- `diagonal_by_products`: ``[16, 16] x [16, K]`` products against the block's first row, while the
  block's decay span is at most `intra.DOT_SPAN` and its largest single log decay at most
  `chunk_backward.DIFFERENCE_STEP`;
- `diagonal_elementwise_grad`: element by element, each exponent masked to -inf above the diagonal before
  ``exp``: exact whatever the decays.

Both read and write the chunk's rows of ``dq``, ``dk``, ``da`` (``[tokens, HV, K]`` fp32) in global
memory; the caller's program (grid ``(NT, HV)``) runs them, no launch of their own.
"""

from __future__ import annotations

import triton
import triton.language as tl

from kda.backends.triton.storage import dot
from kda.backends.triton.tiles import head_rows


@triton.jit
def diagonal_elementwise_grad(
    q,
    k,
    G,
    dM_ii,
    dQ_ii,
    q_norm,
    k_norm,
    dq,
    dk,
    da,
    rows_i,
    valid_i,
    i_h,
    i_hv,
    c0,
    H: tl.constexpr,
    HV: tl.constexpr,
    K: tl.constexpr,
    BKB: tl.constexpr,
    BKC: tl.constexpr,
    BC: tl.constexpr,
):
    """The diagonal block's terms of `_pairwise_row_block` for columns ``c0 .. c0 + BKB``, element by element
    over BKC-column slices, each exponent masked to -inf above the diagonal before ``exp``: exact whatever
    the decays (every term of ``da_t`` carries the decay across t)."""
    sub = tl.arange(0, BC)
    keep = (sub[:, None] >= sub[None, :]) & valid_i[:, None]
    before = sub[:, None] > sub[None, :]  # [t, j]: j < t
    for s0 in range(0, BKB, BKC):
        cs = c0 + s0 + tl.arange(0, BKC)
        m_s = valid_i[:, None] & (cs[None, :] < K)
        ks = tl.load(head_rows(k, rows_i, i_h, cs, H, K), mask=m_s, other=0.0).to(tl.float32) * k_norm[:, None]
        qs = tl.load(head_rows(q, rows_i, i_h, cs, H, K), mask=m_s, other=0.0).to(tl.float32) * q_norm[:, None]
        gs = tl.load(head_rows(G, rows_i, i_hv, cs, HV, K), mask=m_s, other=0.0)
        E = tl.exp(tl.where(keep[:, :, None], gs[:, None, :] - gs[None, :, :], float("-inf")))
        PM = dM_ii[:, :, None] * E
        PQ = dQ_ii[:, :, None] * E
        rk_s = tl.sum(PM * ks[None, :, :], axis=1)
        rq_s = tl.sum(PQ * ks[None, :, :], axis=1)
        ck_s = tl.sum(PM * ks[:, None, :] + PQ * qs[:, None, :], axis=0)
        # sum_{i >= t} sum_{j < t} P_ij: reverse cumsum over i, read at row t, summed over j < t
        P = (PM * ks[:, None, :] + PQ * qs[:, None, :]) * ks[None, :, :]
        da_s = tl.sum(tl.where(before[:, :, None], tl.cumsum(P, axis=0, reverse=True), 0.0), axis=1)
        p_dk = head_rows(dk, rows_i, i_hv, cs, HV, K)
        p_dq = head_rows(dq, rows_i, i_hv, cs, HV, K)
        p_da = head_rows(da, rows_i, i_hv, cs, HV, K)
        tl.store(p_dk, tl.load(p_dk, mask=m_s, other=0.0) + rk_s + ck_s, mask=m_s)
        tl.store(p_dq, tl.load(p_dq, mask=m_s, other=0.0) + rq_s, mask=m_s)
        tl.store(p_da, tl.load(p_da, mask=m_s, other=0.0) + da_s, mask=m_s)
        tl.debug_barrier()


@triton.jit
def diagonal_by_products(
    k_i, q_i, g_i, anchor, late, dM_ii, dQ_ii, dq_i, dk_i, da_i, m_i, BC: tl.constexpr, DOT_PRECISION: tl.constexpr
):
    """The diagonal block's terms of `_pairwise_row_block` by ``[16, 16] x [16, K]`` products, with
    ``E_ij = late_i early_j`` against the block's first row ``a`` (``late = e^(G_i - G_a) <= 1``, ``early =
    e^(G_a - G_j) <= e^span``; dM is strictly lower, dQ lower, so no kept product exceeds 1)::

        rk_i = late_i sum_{j<i} dM_ij k_j early_j     rq_i = late_i sum_{j<i} dQ_ij k_j early_j + dQ_ii k_i
        ck_j = early_j sum_{i>j} (dM_ij k_i + dQ_ij q_i) late_i + dQ_jj q_j
        da_t += sum_{s >= t} (R_s - C_s),   R_i = sum_{j<i} P_ij = k_i rk_i + q_i (rq_i - dQ_ii k_i),
                                            C_j = sum_{i>j} P_ij = k_j (ck_j - dQ_jj q_j)

    since ``[j < t <= i] = [t <= i] - [t <= j]`` for ``j < i``. That difference is what the element-wise
    path avoids (its every term carries the decay across t): here a token's da keeps an absolute error of
    fp32's epsilon times the block's O(1) terms, which ``dA_log = sum a da`` multiplies by the log decays
    (at most `DIFFERENCE_STEP` each)."""
    sub = tl.arange(0, BC)
    strict = sub[:, None] > sub[None, :]
    diag = tl.sum(tl.where(sub[:, None] == sub[None, :], dQ_ii, 0.0), axis=1)  # dQ_ii
    dQ_strict = tl.where(strict, dQ_ii, 0.0)
    early = tl.exp(tl.where(m_i, anchor[None, :] - g_i, 0.0))
    k_early = k_i * early
    rk = dot(dM_ii, k_early, DOT_PRECISION) * late
    rq = dot(dQ_strict, k_early, DOT_PRECISION) * late
    cols = (
        dot(tl.trans(dM_ii), k_i * late, DOT_PRECISION) + dot(tl.trans(dQ_strict), q_i * late, DOT_PRECISION)
    ) * early
    tl.store(dk_i, tl.load(dk_i, mask=m_i, other=0.0) + rk + cols + diag[:, None] * q_i, mask=m_i)
    tl.store(dq_i, tl.load(dq_i, mask=m_i, other=0.0) + rq + diag[:, None] * k_i, mask=m_i)
    pairs = k_i * rk + q_i * rq - k_i * cols  # R - C
    tl.store(da_i, tl.load(da_i, mask=m_i, other=0.0) + tl.cumsum(pairs, axis=0, reverse=True), mask=m_i)
    tl.debug_barrier()
