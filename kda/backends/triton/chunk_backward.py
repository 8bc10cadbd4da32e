"""The backward's per-chunk kernel: every per-token gradient of one chunk (q, k, v, beta and the per-token
log decay a), in parallel over chunks.

Per (chunk, value head), from the forward's saved ``h`` (the state entering the chunk), ``v_new``, ``T``,
``M`` and the reverse pass's ``dh`` and ``dd`` (`state_backward`). The pairwise E-weighted terms go
through 16-row blocks (see ``da`` below; the diagonal blocks in `diagonal_backward`), K taken in blocks of
BKB columns: every term is per column of K but for two sums over it (``dT`` and ``dbeta``), so no ``[C,
K]`` tile is ever held whole.

The log decay's gradient. ``G`` is the in-chunk cumsum of ``a``, so ``da_t = sum_{s >= t} dG_s``; the
kernel forms each ``da_t`` directly as a sum of terms that all carry the decay across token t::

    da_t = sum_{s >= t} up_s + sum_{s < t} kt_s + e^(G_C) sum_v (S0 dS) + sum_{i >= t > j} P_ij
    up_s = dq~_s q_s e^(G_s) + beta_s k_s e^(G_s) dX_s      (through e^G)
    kt_s = dk~_s k_s e^(G_C - G_s)                           (through e^(G_C - G))
    P_ij = (dM_ij k_i + dQ_ij q_i) k_j E_ij,   j < i         (through E_ij = e^(G_i - G_j))

Why not the reverse cumsum of ``dG``: there ``da_t`` is a sum of O(1) terms that cancel where ``a_t`` is
large and negative (a pair's ``P_ij`` enters row i and, negated, row j; ``kt_s`` enters row s and, summed,
the last row), and the fp32 residual, ~1e-8 where the true ``da_t`` is ~0, is multiplied by ``a_t`` (in
the hundreds with a saturated softplus gate) in ``dA_log = sum_t a_t da_t``: 1.6e-3 relative off. Here
every term of ``da_t`` has ``e^(a_t)`` as a factor, so such a token's ``da_t`` rounds to its own size.

Shapes: q, k ``[tokens, H, K]``, v ``[tokens, HV, V]``, beta ``[tokens, HV]``; G ``[tokens, HV, K]`` fp32;
h, dh ``[NT, HV, K, V]`` fp32; v_new, dd, do ``[tokens, HV, V]``; T, A_qk, M ``[NT, HV, C, C]`` fp32 (M and
A_qk are overwritten by dM and dQ); out: dq, dk, da ``[tokens, HV, K]`` fp32 (per value head: the tails sum
a GVA group), dv ``[tokens, HV, V]`` in v's dtype, dbeta ``[tokens, HV]`` fp32. Grid ``(NT, HV)``.

Timing-only switch: ``PAIRS`` (a constexpr, 2 as shipped) exists only for `benchmarks/triton_stages.py
--train-sweep`, which launches the kernel with 0 (the pairwise terms left out) or 1 (their diagonal blocks
left out) to see what they cost; the gradients are wrong then. The backward's launch leaves it at 2.
"""

from __future__ import annotations

import triton
import triton.language as tl

from kda.backends.triton.diagonal_backward import diagonal_by_products, diagonal_elementwise_grad
from kda.backends.triton.intra import DOT_SPAN
from kda.backends.triton.storage import dot, stored
from kda.backends.triton.tiles import beta_activation, head_rows

# A 16-row diagonal block goes by products (`diagonal_by_products`) when its decay span (max |G_i - G_a|
# over its rows and K) is at most the forward's DOT_SPAN (80: e^80 stays finite in fp32), and its largest
# single log decay (max |G_t - G_(t-1)| over its rows after the first) is at most DIFFERENCE_STEP: their
# da is a difference of O(1) sums, whose fp32 residual dA_log multiplies by the log decays, so it is the
# decays that must stay small, not the span. The safe gate's are below 5 whatever the span; larger ones
# (saturated softplus or pre-gated gates) take the exact element-wise path.
DIFFERENCE_STEP = tl.constexpr(8.0)


@triton.jit
def bwd_chunk_kernel(
    q,
    k,
    v,
    beta,  # [tokens, H, K], [tokens, H, K], [tokens, HV, V], [tokens, HV]
    G,  # [tokens, HV, K] fp32
    h,
    dh,  # [NT, HV, K, V] fp32: state entering each chunk, gradient of the state leaving it
    v_new,
    dd,
    do,  # [tokens, HV, V]
    T_inv,
    A_qk,
    M,  # [NT, HV, BT, BT] fp32 (M and A_qk are overwritten by dM and dQ)
    norms,  # [NT, HV, 2, BT] fp32 scratch: 1 / |q| and 1 / |k| per row, for the pairwise blocks
    dq,
    dk,
    da,  # out, fp32: [tokens, HV, K] each (da: of the log decay a)
    dv,  # out: [tokens, HV, V] in v's dtype (its only store: rounded once here rather than cast after)
    dbeta,  # out, fp32: [tokens, HV]
    chunk_starts,
    chunk_seq_ends,
    scale,
    H: tl.constexpr,
    HV: tl.constexpr,
    K: tl.constexpr,
    V: tl.constexpr,
    L2: tl.constexpr,
    SIGMOID: tl.constexpr,
    TWO: tl.constexpr,
    BT: tl.constexpr,
    BK: tl.constexpr,
    BV: tl.constexpr,
    BKB: tl.constexpr,  # K columns per block (every [C, K] quantity is taken BKB columns at a time)
    BKC: tl.constexpr,
    BC: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
    ROUND: tl.constexpr,
    # Timing-only switch (see the module docstring): 2 as shipped; 0 leaves out the pairwise terms, 1 their
    # diagonal blocks.
    PAIRS: tl.constexpr = 2,
):
    i_c, i_hv = tl.program_id(0), tl.program_id(1)
    i_h = i_hv // (HV // H)
    start = tl.load(chunk_starts + i_c)
    end = tl.minimum(tl.load(chunk_seq_ends + i_c), start + BT)
    r = tl.arange(0, BT)
    rows = start + r
    valid = rows < end
    chunk = i_c.to(tl.int64) * HV + i_hv
    sq = chunk * BT * BT + r[:, None] * BT + r[None, :]
    causal = r[:, None] >= r[None, :]
    strict = r[:, None] > r[None, :]

    b_c = beta_activation(
        tl.load(beta + rows.to(tl.int64) * HV + i_hv, mask=valid, other=0.0).to(tl.float32), SIGMOID, TWO
    )
    b_c = tl.where(valid, b_c, 0.0)
    t_inv = tl.load(T_inv + sq)

    # Registers decide this kernel's speed (version 13 held every [C, K] quantity whole: 255 registers and
    # 3.6 KB of spill a thread at K = 128, one program an SM). So it runs in three parts, none holding more
    # than a few [C, BKB] and [C, C] tiles:
    #   1. what needs no K: dQ = scale do d^T, dT = dd (beta v)^T, dY = T^T dd, dv = beta dY, dbeta's v part;
    #   2. per block of BKB columns of K, a pass over V (dq~ = scale do S0^T, dk~ = d dS^T, dW = -dd S0^T,
    #      sum_v S0 dS) and then every per-token gradient of those columns, with dT += dW X^T;
    #   3. dA from dT, then the pairwise E-weighted terms (16-row blocks, BKB columns at a time).
    dQ = tl.zeros([BT, BT], dtype=tl.float32)
    dT = tl.zeros([BT, BT], dtype=tl.float32)
    db_c = tl.zeros([BT], dtype=tl.float32)
    for i_v in range(tl.cdiv(V, BV)):
        v_off, m_v = _v_rows(i_v, rows, valid, i_hv, HV, V, BV)
        d_b = tl.load(v_new + v_off, mask=m_v, other=0.0)
        do_b = tl.load(do + v_off, mask=m_v, other=0.0).to(tl.float32)
        dd_b = tl.load(dd + v_off, mask=m_v, other=0.0)
        v_b = tl.load(v + v_off, mask=m_v, other=0.0).to(tl.float32)
        dQ += dot(do_b, tl.trans(d_b), DOT_PRECISION)
        dT += dot(dd_b, tl.trans(b_c[:, None] * v_b), DOT_PRECISION)
        dY = dot(tl.trans(t_inv), dd_b, DOT_PRECISION)
        tl.store(dv + v_off, stored(b_c[:, None] * dY, dv, ROUND), mask=m_v)
        db_c += tl.sum(v_b * dY, axis=1)
    # dQ is whole: into this chunk's A_qk scratch now (this kernel reads no forward A_qk), out of registers.
    tl.store(A_qk + sq, tl.where(causal, scale * dQ, 0.0))

    q_norm = _inv_norms(q, rows, valid, i_h, H, K, BK, BKB, L2)
    k_norm = _inv_norms(k, rows, valid, i_h, H, K, BK, BKB, L2)
    tl.store(norms + chunk * 2 * BT + r, q_norm)
    tl.store(norms + chunk * 2 * BT + BT + r, k_norm)
    g_last_row = G + (end - 1).to(tl.int64) * (HV * K) + i_hv * K  # G_C: the chunk's last token
    for c0 in range(0, BK, BKB):
        kcols = c0 + tl.arange(0, BKB)
        dqt = tl.zeros([BT, BKB], dtype=tl.float32)
        dkt = tl.zeros([BT, BKB], dtype=tl.float32)
        dW = tl.zeros([BT, BKB], dtype=tl.float32)
        s0_ds = tl.zeros([BKB], dtype=tl.float32)
        for i_v in range(tl.cdiv(V, BV)):
            v_off, m_v = _v_rows(i_v, rows, valid, i_hv, HV, V, BV)
            vcols = i_v * BV + tl.arange(0, BV)
            st = chunk * K * V + kcols[:, None] * V + vcols[None, :]
            st_mask = (kcols[:, None] < K) & (vcols[None, :] < V)
            S0 = tl.load(h + st, mask=st_mask, other=0.0)
            dS = tl.load(dh + st, mask=st_mask, other=0.0)
            do_b = tl.load(do + v_off, mask=m_v, other=0.0).to(tl.float32)
            d_b = tl.load(v_new + v_off, mask=m_v, other=0.0)
            dd_b = tl.load(dd + v_off, mask=m_v, other=0.0)
            dqt += dot(do_b, tl.trans(S0), DOT_PRECISION)
            dkt += dot(d_b, tl.trans(dS), DOT_PRECISION)
            dW -= dot(dd_b, tl.trans(S0), DOT_PRECISION)
            s0_ds += tl.sum(S0 * dS, axis=1)
        dqt = scale * dqt

        m_k = valid[:, None] & (kcols[None, :] < K)
        k_off = rows[:, None].to(tl.int64) * (HV * K) + i_hv * K + kcols[None, :]
        g_c = tl.load(G + k_off, mask=m_k, other=0.0)
        g_last = tl.load(g_last_row + kcols, mask=kcols < K, other=0.0)
        e_g = tl.where(m_k, tl.exp(g_c), 0.0)
        e_gc = tl.where(m_k, tl.exp(tl.where(m_k, g_last[None, :] - g_c, 0.0)), 0.0)
        q_c = tl.load(head_rows(q, rows, i_h, kcols, H, K), mask=m_k, other=0.0).to(tl.float32) * q_norm[:, None]
        up_q = dqt * q_c  # dq~ q, the q part of up below
        tl.store(dq + k_off, dqt * e_g, mask=m_k)
        k_c = tl.load(head_rows(k, rows, i_h, kcols, H, K), mask=m_k, other=0.0).to(tl.float32) * k_norm[:, None]
        before = _sum_before(dkt * (k_c * e_gc))  # sum_{s < t} kt_s
        # through W = T X (X = beta k e^G); U = T (beta v) was handled in part 1
        X = b_c[:, None] * k_c * e_g
        dT += dot(dW, tl.trans(X), DOT_PRECISION)
        dX = dot(tl.trans(t_inv), dW, DOT_PRECISION)
        db_c += tl.sum(k_c * e_g * dX, axis=1)
        tl.store(dk + k_off, dkt * e_gc + b_c[:, None] * e_g * dX, mask=m_k)
        # da_t without the pairwise terms: sum_{s >= t} up_s + sum_{s < t} kt_s + e^(G_C) sum_v S0 dS
        up = (up_q + b_c[:, None] * k_c * dX) * e_g
        da_c = tl.cumsum(up, axis=0, reverse=True) + before + (tl.exp(g_last) * s0_ds)[None, :]
        tl.store(da + k_off, da_c, mask=m_k)

    dA = dot(dot(tl.trans(t_inv), dT, DOT_PRECISION), tl.trans(t_inv), DOT_PRECISION)
    dA = tl.where(strict, -dA, 0.0)
    m_kk = tl.load(M + sq)
    db_c += tl.sum(dA * m_kk, axis=1)
    tl.store(dbeta + rows.to(tl.int64) * HV + i_hv, db_c, mask=valid)
    tl.debug_barrier()  # every thread has read M before it is overwritten

    # The pairwise terms through M_ij = sum_c k_i k_j E_ij and Q_ij = sum_c q_i k_j E_ij, 16 rows at a time
    # with the forward's causal local anchors (both factors of E <= 1, one tl.dot per block); dM and dQ
    # go through this chunk's own M / A_qk scratch so that their 16x16 blocks can be read back.
    tl.store(M + sq, b_c[:, None] * dA)
    tl.debug_barrier()
    for I in range(BT // BC):  # run-time loops here and below: unrolled, this kernel took 53 s to compile
        if start + I * BC < end and PAIRS > 0:
            _pairwise_row_block(
                q,
                k,
                G,
                M,
                A_qk,
                norms,
                dq,
                dk,
                da,
                chunk,
                start,
                end,
                i_h,
                i_hv,
                I,
                H,
                HV,
                K,
                BT,
                BK,
                BKB,
                BKC,
                BC,
                DOT_PRECISION,
                PAIRS > 1,
            )


@triton.jit
def _v_rows(i_v, rows, valid, i_hv, HV: tl.constexpr, V: tl.constexpr, BV: tl.constexpr):
    """Block ``i_v`` of BV value columns: offsets and mask of the chunk's ``[C, BV]`` rows in a ``[tokens, HV,
    V]`` tensor."""
    vcols = i_v * BV + tl.arange(0, BV)
    return rows[:, None].to(tl.int64) * (HV * V) + i_hv * V + vcols[None, :], valid[:, None] & (vcols[None, :] < V)


@triton.jit
def _inv_norms(
    x, rows, valid, head, HEADS: tl.constexpr, K: tl.constexpr, BK: tl.constexpr, BKB: tl.constexpr, L2: tl.constexpr
):
    """Per row of ``x [tokens, HEADS, K]`` at ``rows``: ``1 / sqrt(sum_c x^2 + eps)`` over the whole head
    dimension, summed BKB columns at a time, with l2norm in kernel; else 1."""
    inv = tl.full([rows.shape[0]], 1.0, tl.float32)
    if L2:
        squares = tl.zeros([rows.shape[0]], dtype=tl.float32)
        for c0 in range(0, BK, BKB):
            cols = c0 + tl.arange(0, BKB)
            x_b = tl.load(
                head_rows(x, rows, head, cols, HEADS, K), mask=valid[:, None] & (cols[None, :] < K), other=0.0
            ).to(tl.float32)
            squares += tl.sum(x_b * x_b, axis=1)
        inv = tl.rsqrt(squares + 1e-6)  # eps as kda.reference.l2norm
    return inv


@triton.jit
def _sum_before_combine(before_1, last_1, before_2, last_2):
    return before_1 + last_1 + before_2, last_2


@triton.jit
def _sum_before(x):
    """``y_t = sum_{s < t} x_s`` along axis 0 (an exclusive prefix sum) as a scan of (sum before the last
    element, last element) pairs: only the x themselves are ever added, where ``cumsum(x) - x`` would cancel
    (x_t need not carry the decay that every earlier term carries)."""
    before, _ = tl.associative_scan((tl.zeros_like(x), x), 0, _sum_before_combine)
    return before


@triton.jit
def _pairwise_row_block(
    q,
    k,
    G,
    dM,
    dQ,
    norms,
    dq,
    dk,
    da,
    chunk,
    start,
    end,
    i_h,
    i_hv,
    I,
    H: tl.constexpr,
    HV: tl.constexpr,
    K: tl.constexpr,
    BT: tl.constexpr,
    BK: tl.constexpr,
    BKB: tl.constexpr,
    BKC: tl.constexpr,
    BC: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
    DIAGONAL: tl.constexpr,
):
    """For rows ``i`` of sub-chunk I: ``rk_i = sum_j dM_ij k_j E_ij``, ``rq_i = sum_j dQ_ij k_j E_ij``, and for
    every earlier column ``j``: ``ck_j += sum_i (dM_ij k_i + dQ_ij q_i) E_ij``; then ``dk += rk + ck``,
    ``dq += rq``, and ``da_t += sum_{i >= t > j} P_ij`` over the pairs with i in sub-chunk I
    (``P_ij = (dM_ij k_i + dQ_ij q_i) k_j E_ij``), by where t falls (read-modify-write of this chunk's rows in
    global memory)::

        j in J < I:  t in J, t > j:  sum_{j < t} k_j ck_j         (J's columns, exclusive prefix)
                     t between J and I: sum_j k_j ck_j            (every pair of the two blocks)
                     t in I, t <= i: sum_{i >= t} (k rk + q rq)_i  (I's rows, reverse cumsum)
        j in I:      sum_{i >= t} sum_{j < t} P_ij                (the diagonal block: `diagonal_by_products`,
                                                                   or element by element)

    Every term is per column of K, so the block runs BKB columns at a time; only the diagonal block's path
    depends on all of them (its decay span and largest log decay, found first)."""
    sub = tl.arange(0, BC)
    rows_i = start + I * BC + sub
    valid_i = rows_i < end
    a_base = chunk * BT * BT
    norm_base = norms + chunk * 2 * BT
    q_norm = tl.load(norm_base + I * BC + sub)
    k_norm = tl.load(norm_base + BT + I * BC + sub)
    a_row = G + (start + I * BC).to(tl.int64) * (HV * K) + i_hv * K  # the anchor: the block's first row

    # The diagonal block's path: by products against the anchor where its decay span (max |G_i - G_a|,
    # rows past the end hold G_a) is at most DOT_SPAN and its largest single log decay (max |G_t - G_(t-1)|
    # over its rows after the first) at most DIFFERENCE_STEP; else element by element.
    after_first = valid_i & (sub >= 1)
    span = 0.0
    step = 0.0
    for c0 in range(0, BK, BKB):
        cols = c0 + tl.arange(0, BKB)
        m_i = valid_i[:, None] & (cols[None, :] < K)
        anchor = tl.load(a_row + cols, mask=cols < K, other=0.0)
        g_i = tl.where(m_i, tl.load(head_rows(G, rows_i, i_hv, cols, HV, K), mask=m_i, other=0.0), anchor[None, :])
        m_b = after_first[:, None] & (cols[None, :] < K)
        g_before = tl.load(head_rows(G, rows_i - 1, i_hv, cols, HV, K), mask=m_b, other=0.0)
        span = tl.maximum(span, tl.max(tl.max(tl.abs(g_i - anchor[None, :]), axis=1), axis=0))
        step = tl.maximum(step, tl.max(tl.max(tl.where(m_b, tl.abs(g_i - g_before), 0.0), axis=1), axis=0))
    by_products = (span <= DOT_SPAN) & (step <= DIFFERENCE_STEP)
    blk_ii = a_base + (I * BC + sub)[:, None] * BT + (I * BC + sub)[None, :]
    dM_ii = tl.load(dM + blk_ii)
    dQ_ii = tl.load(dQ + blk_ii)

    for c0 in range(0, BK, BKB):
        cols = c0 + tl.arange(0, BKB)
        m_i = valid_i[:, None] & (cols[None, :] < K)
        k_i = tl.load(head_rows(k, rows_i, i_h, cols, H, K), mask=m_i, other=0.0).to(tl.float32) * k_norm[:, None]
        q_i = tl.load(head_rows(q, rows_i, i_h, cols, H, K), mask=m_i, other=0.0).to(tl.float32) * q_norm[:, None]
        anchor = tl.load(a_row + cols, mask=cols < K, other=0.0)
        g_i = tl.where(m_i, tl.load(head_rows(G, rows_i, i_hv, cols, HV, K), mask=m_i, other=0.0), anchor[None, :])
        late = tl.exp(g_i - anchor[None, :])  # exp(G_i - G_a) <= 1
        rk = tl.zeros([BC, BKB], dtype=tl.float32)
        rq = tl.zeros([BC, BKB], dtype=tl.float32)
        for J in range(I):
            rows_j = start + J * BC + sub  # before the anchor, inside the sequence
            m_j = (rows_j[:, None] < end) & (cols[None, :] < K)
            k_j = tl.load(head_rows(k, rows_j, i_h, cols, H, K), mask=m_j, other=0.0).to(tl.float32)
            k_j = k_j * tl.load(norm_base + BT + J * BC + sub)[:, None]
            early = tl.exp(anchor[None, :] - tl.load(head_rows(G, rows_j, i_hv, cols, HV, K), mask=m_j, other=0.0))
            blk = a_base + (I * BC + sub)[:, None] * BT + (J * BC + sub)[None, :]
            dM_ij = tl.load(dM + blk)
            dQ_ij = tl.load(dQ + blk)
            rk += dot(dM_ij, k_j * early, DOT_PRECISION)
            rq += dot(dQ_ij, k_j * early, DOT_PRECISION)
            ck = (
                dot(tl.trans(dM_ij), k_i * late, DOT_PRECISION) + dot(tl.trans(dQ_ij), q_i * late, DOT_PRECISION)
            ) * early
            dk_j = head_rows(dk, rows_j, i_hv, cols, HV, K)
            da_j = head_rows(da, rows_j, i_hv, cols, HV, K)
            col = k_j * ck  # [BC, BKB]: sum_i P_ij over this block's rows, per column j
            tl.store(dk_j, tl.load(dk_j, mask=m_j, other=0.0) + ck, mask=m_j)
            tl.store(da_j, tl.load(da_j, mask=m_j, other=0.0) + _sum_before(col), mask=m_j)
            tl.debug_barrier()
            across = tl.sum(col, axis=0)  # [BKB]: every pair of blocks I and J, for the tokens between them
            for Mid in range(J + 1, I):
                m_b = ((start + Mid * BC + sub)[:, None] < end) & (cols[None, :] < K)
                da_b = head_rows(da, start + Mid * BC + sub, i_hv, cols, HV, K)
                tl.store(da_b, tl.load(da_b, mask=m_b, other=0.0) + across[None, :], mask=m_b)
                tl.debug_barrier()
        rk = rk * late
        rq = rq * late
        dk_i = head_rows(dk, rows_i, i_hv, cols, HV, K)
        dq_i = head_rows(dq, rows_i, i_hv, cols, HV, K)
        da_i = head_rows(da, rows_i, i_hv, cols, HV, K)
        tl.store(dk_i, tl.load(dk_i, mask=m_i, other=0.0) + rk, mask=m_i)
        tl.store(dq_i, tl.load(dq_i, mask=m_i, other=0.0) + rq, mask=m_i)
        row = k_i * rk + q_i * rq  # [BC, BKB]: sum_j P_ij over the earlier blocks, per row i
        tl.store(da_i, tl.load(da_i, mask=m_i, other=0.0) + tl.cumsum(row, axis=0, reverse=True), mask=m_i)
        tl.debug_barrier()

        if DIAGONAL:  # (False for timing only: see PAIRS)
            if by_products:
                diagonal_by_products(
                    k_i, q_i, g_i, anchor, late, dM_ii, dQ_ii, dq_i, dk_i, da_i, m_i, BC, DOT_PRECISION
                )
            else:
                diagonal_elementwise_grad(
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
                    H,
                    HV,
                    K,
                    BKB,
                    BKC,
                    BC,
                )
