"""Stage 2: inside each chunk, the scores and the WY transform.

For one chunk of ``C`` tokens of value head ``hv`` (q/k head ``h = hv // group``), with ``G`` the
in-chunk cumulative log decay of stage 1 and ``beta`` after its activation::

    A_kk[i, j] = beta_i * sum_c k_i[c] k_j[c] exp(G_i[c] - G_j[c])      j < i
    A_qk[i, j] =          sum_c q_i[c] k_j[c] exp(G_i[c] - G_j[c])      j <= i
    T = (I + A_kk)^-1                                 (unit lower triangular)
    w = T @ (beta * k * exp(G))        [C, K]
    u = T @ (beta * v)                 [C, V]
    k_g = k * exp(G_C - G)             [C, K]      (G_C: the chunk's last row; every exponent <= 0)

so that the chunk's new values are ``u - w @ S0`` for the state ``S0`` before the chunk, and its
contribution to the next state is ``k_g^T @ v_new`` (stage 3, which then reads no ``k`` and no ``G`` rows).

Overflow. ``G`` falls without bound inside a chunk (pre-gated and softplus gates have no floor), so
``exp(G_i - G_j)`` is never split as ``exp(G_i) * exp(-G_j)`` over the whole chunk. The chunk is cut
into sub-chunks of 16 rows; for a block of rows ``I`` against an earlier block of columns ``J`` the
anchor is the first row ``a`` of ``I`` (``j < a <= i``)::

    exp(G_i - G_j) = exp(G_i - G_a) * exp(G_a - G_j)        both factors <= 1

and the block is one matrix product. A diagonal block (``i, j`` in the same sub-chunk) uses the same
anchor when the sub-chunk's decay span ``max_{i,c} |G_i[c] - G_a[c]|`` is at most `DOT_SPAN`: then
``exp(G_a - G_j) <= exp(DOT_SPAN)`` stays finite in fp32 and every kept product ``i >= j`` is <= 1 (the
entries above the diagonal, which may overflow, are discarded with ``where``, never multiplied by 0).
The safe gate (``lower_bound >= -5``) always qualifies: 15 steps of at most 5. A sub-chunk with a larger
span (unbounded pre-gated or softplus gates) takes the exact element-by-element path instead, with the
exponent masked to -inf above the diagonal before ``exp``.

The inverse works on 16-row blocks too: each diagonal block ``D_I = (I + A_II)^-1`` by products on
``[16, 16]`` tiles (`unit_lower_inverse`), then the blocks below the diagonal from the block recurrence

    T_IJ = -D_I  sum_{J <= m < I} A_Im T_mJ                    (J < I, in increasing J)

with matrix products. ``T`` is written over ``A_kk`` in place (row block by row block, increasing ``J``:
every ``A_Im`` still needed is still there) and then read back whole for ``w`` and ``u``.

Non-finite inputs. The recurrence lets a NaN at token j reach rows ``i >= j`` only. The scores keep that
(their upper triangles are cut with ``where`` after the norms are applied, never multiplied by 0), but the
products with a triangular matrix (inside `unit_lower_inverse`, ``D_I (...)``, ``w = T (...)``, ``u = T
(...)``, and the output's ``A_qk v_new``) multiply the zeros above its diagonal by row j, and ``0 * NaN =
NaN``: the chunk's rows before j turn NaN too (earlier chunks, other sequences and other heads do not).
Keeping those products causal needs a check of each one's operand for non-finite entries (a reduction
across the tile, then a branch to a product of the sanitized tile plus a NaN carried down the rows). On
the H200 that took intra from 1.82 to 2.07 ms and the output from 0.459 to 0.463 (B1_T8192_H96_D128; at
B4_T2048_H16_D128 0.305 to 0.354 and 0.086 to 0.093): the forward 8.5% and 10.8% slower; the carried NaN
without the check, 19%. So it is not done here (docs/design.md, "Non-finite inputs").

With bf16/fp16 storage (inference) the ``w`` and ``u`` products run on half-width tensor cores: ``T`` and
the scaled rows are rounded to the storage dtype first, as FLA's ``recompute_w_u`` does (the results are
rounded to it anyway when stored).

Timing-only switch: ``PARTS`` (a constexpr, 3 as shipped: every part runs) exists only for
`benchmarks/triton_stages.py --sweep`, which launches the kernel with 1 (stop after the scores) or 2 (stop
after the inverse) to see where its time goes; the results are wrong then. The backend's launch leaves it at 3.

Grid ``(NT, HV)``. A_kk (then T) blocks go through an ``[NT, HV, C, C]`` fp32 buffer (T and M are kept
for the backward). A_qk (kept for stage 4), ``w``, ``u`` and ``k_g`` are stored in the dtype `storage`
chooses: the inputs' dtype at inference, fp32 when training.
"""

from __future__ import annotations

import triton
import triton.language as tl

from kda.backends.triton.storage import dot, operand, stored
from kda.backends.triton.tiles import beta_activation, head_rows, inv_norm

SUB_CHUNK = 16  # rows per sub-chunk (the kernels' BC): the smallest tile tl.dot takes
DOT_SPAN = tl.constexpr(80.0)  # largest decay span a diagonal block takes by product: e^80 = 5.5e34 < fp32 max


@triton.jit
def _rows_l2(x, L2: tl.constexpr):
    if L2:
        x = x * tl.rsqrt(tl.sum(x * x, axis=1) + 1e-6)[:, None]  # eps as kda.reference.l2norm
    return x


@triton.jit
def _row_betas(beta, rows, valid, i_hv, HV: tl.constexpr, SIGMOID: tl.constexpr, TWO: tl.constexpr):
    """``beta`` of value head ``i_hv`` at ``rows`` after its activation, 0 past the sequence's end."""
    b = tl.load(beta + rows.to(tl.int64) * HV + i_hv, mask=valid, other=0.0).to(tl.float32)
    return tl.where(valid, beta_activation(b, SIGMOID, TWO), 0.0)


@triton.jit
def intra_chunk_kernel(
    q,
    k,
    v,
    beta,  # [tokens, H, K], [tokens, H, K], [tokens, HV, V], [tokens, HV]
    G,  # [tokens, HV, K] fp32 (stage 1)
    A_kk,  # [NT, HV, BT, BT] fp32 out: T = (I + A_kk)^-1 (written over A_kk)
    A_qk,  # [NT, HV, BT, BT] out (storage dtype)
    M_out,  # [NT, HV, BT, BT] fp32 out for training: A_kk without beta (or a dummy)
    w,
    u,
    k_g,  # [tokens, HV, K], [tokens, HV, V], [tokens, HV, K] out (storage dtype)
    chunk_starts,
    chunk_seq_ends,  # [NT] int32
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
    BKC: tl.constexpr,
    BC: tl.constexpr,
    BW: tl.constexpr,  # columns of w and u per product (a power of 2 dividing BK and BV)
    BKS: tl.constexpr,  # K columns per step of the score products (BK: all at once)
    DOT_PRECISION: tl.constexpr,
    SAVE: tl.constexpr,
    ROUND: tl.constexpr,  # round bf16 stores by hand (the interpreter truncates; see `storage`)
    STORED_OPERANDS: tl.constexpr,  # w and u from half-width products (bf16/fp16 storage; see below)
    # Timing-only switch (see the module docstring): 3 as shipped; 1 stops after the scores, 2 after the inverse.
    PARTS: tl.constexpr = 3,
):
    i_c, i_hv = tl.program_id(0), tl.program_id(1)
    i_h = i_hv // (HV // H)
    start = tl.load(chunk_starts + i_c)
    end = tl.minimum(tl.load(chunk_seq_ends + i_c), start + BT)
    a_base = (i_c.to(tl.int64) * HV + i_hv) * BT * BT
    sub = tl.arange(0, BC)

    # ---- the A_kk and A_qk blocks, 16 rows at a time --------------------------------------------
    for I in range(BT // BC):  # runtime loops here and below: unrolled, the kernel took 29 s to compile
        out_rows = (I * BC + sub)[:, None] * BT
        if start + I * BC < end:
            if BKS < BK:
                _score_row_block_split(
                    q,
                    k,
                    beta,
                    G,
                    A_kk,
                    A_qk,
                    M_out,
                    a_base,
                    out_rows,
                    start,
                    end,
                    i_h,
                    i_hv,
                    I,
                    H,
                    HV,
                    K,
                    L2,
                    SIGMOID,
                    TWO,
                    BT,
                    BK,
                    BKC,
                    BKS,
                    BC,
                    DOT_PRECISION,
                    SAVE,
                    ROUND,
                )
            else:
                _score_row_block(
                    q,
                    k,
                    beta,
                    G,
                    A_kk,
                    A_qk,
                    M_out,
                    a_base,
                    out_rows,
                    start,
                    end,
                    i_h,
                    i_hv,
                    I,
                    H,
                    HV,
                    K,
                    L2,
                    SIGMOID,
                    TWO,
                    BT,
                    BK,
                    BKC,
                    BC,
                    DOT_PRECISION,
                    SAVE,
                    ROUND,
                )
        else:  # the sub-chunk lies past the sequence's end: zero rows
            for J in range(BT // BC):
                _store_zero_scores(a_base + out_rows + (J * BC + sub)[None, :], A_kk, A_qk, M_out, BC, SAVE)
    tl.debug_barrier()

    if PARTS < 2:  # timing only
        return

    # ---- T = (I + A_kk)^-1, 16-row blocks, written over A_kk ---------------------------------------
    for I in range(BT // BC):
        d_inv = unit_lower_inverse(tl.load(A_kk + a_base + _block_offsets(I, I, BT, BC)), BC)
        for J in range(I):
            acc = tl.zeros([BC, BC], dtype=tl.float32)
            for m in range(J, I):  # A_Im (not yet overwritten: m > J) times T_mJ (an earlier row block)
                acc += dot(
                    tl.load(A_kk + a_base + _block_offsets(I, m, BT, BC)),
                    tl.load(A_kk + a_base + _block_offsets(m, J, BT, BC)),
                    DOT_PRECISION,
                )
            tl.store(A_kk + a_base + _block_offsets(I, J, BT, BC), -dot(d_inv, acc, DOT_PRECISION))
        tl.store(A_kk + a_base + _block_offsets(I, I, BT, BC), d_inv)
        tl.debug_barrier()  # row block I of T is read by the later ones
    if PARTS < 3:  # timing only
        return
    r = tl.arange(0, BT)
    t_inv = tl.load(A_kk + a_base + r[:, None] * BT + r[None, :])  # blocks above the diagonal hold zeros
    if STORED_OPERANDS:  # w and u are stored in bf16/fp16: their products take T and the rows in that dtype
        t_inv = operand(stored(t_inv, w, ROUND), ROUND)

    # ---- w = T (beta k exp(G)),  u = T (beta v),  k_g = k exp(G_C - G), BW columns at a time ----------
    # Column blocks keep each product's operands small: the kernel is latency-bound (a program's steps wait
    # on each other), so shared memory per program decides how many programs share an SM.
    rows = start + r
    valid = rows < end
    b_all = _row_betas(beta, rows, valid, i_hv, HV, SIGMOID, TWO)
    k_rows = rows[:, None].to(tl.int64) * (H * K) + i_h * K
    if L2 and BW < BK:  # rows span several column blocks: their norms over the whole head dimension first
        squares = tl.zeros([BT], dtype=tl.float32)
        for c0 in range(0, BK, BW):
            wcols = c0 + tl.arange(0, BW)
            k_blk = tl.load(k + k_rows + wcols[None, :], mask=valid[:, None] & (wcols[None, :] < K), other=0.0)
            k_blk = k_blk.to(tl.float32)
            squares += tl.sum(k_blk * k_blk, axis=1)
        k_norm = tl.rsqrt(squares + 1e-6)  # eps as kda.reference.l2norm
    else:  # no l2norm, or rows normalized as loaded below
        k_norm = tl.full([BT], 1.0, tl.float32)
    g_last_row = G + (end - 1).to(tl.int64) * (HV * K) + i_hv * K  # G_C: the chunk's last token
    for c0 in range(0, BK, BW):
        wcols = c0 + tl.arange(0, BW)
        m_w = valid[:, None] & (wcols[None, :] < K)
        k_blk = tl.load(k + k_rows + wcols[None, :], mask=m_w, other=0.0).to(tl.float32)
        if BW >= BK:  # one block holds whole rows (the shipped setting): normalize as loaded, no extra pass
            k_blk = _rows_l2(k_blk, L2)
        else:
            k_blk = k_blk * k_norm[:, None]
        g_off = rows[:, None].to(tl.int64) * (HV * K) + i_hv * K + wcols[None, :]
        g_blk = tl.load(G + g_off, mask=m_w, other=0.0)
        w_in = k_blk * tl.exp(g_blk) * b_all[:, None]  # exp(G) <= 1
        if STORED_OPERANDS:
            w_in = operand(stored(w_in, w, ROUND), ROUND)
        tl.store(w + g_off, stored(dot(t_inv, w_in, DOT_PRECISION), w, ROUND), mask=m_w)
        g_last = tl.load(g_last_row + wcols, mask=wcols < K, other=0.0)
        k_late = k_blk * tl.exp(tl.where(m_w, g_last[None, :] - g_blk, 0.0))  # exp(G_C - G) <= 1
        tl.store(k_g + g_off, stored(k_late, k_g, ROUND), mask=m_w)
    for c0 in range(0, BV, BW):
        vcols = c0 + tl.arange(0, BW)
        m_v = valid[:, None] & (vcols[None, :] < V)
        v_off = rows[:, None].to(tl.int64) * (HV * V) + i_hv * V + vcols[None, :]
        v_in = tl.load(v + v_off, mask=m_v, other=0.0).to(tl.float32) * b_all[:, None]
        if STORED_OPERANDS:
            v_in = operand(stored(v_in, u, ROUND), ROUND)
        tl.store(u + v_off, stored(dot(t_inv, v_in, DOT_PRECISION), u, ROUND), mask=m_v)


@triton.jit
def _block_offsets(I, J, BT: tl.constexpr, BC: tl.constexpr):
    """Offsets of the ``[BC, BC]`` block ``(I, J)`` inside a row-major ``[BT, BT]`` matrix."""
    sub = tl.arange(0, BC)
    return (I * BC + sub)[:, None] * BT + (J * BC + sub)[None, :]


@triton.jit
def unit_lower_inverse(a, BC: tl.constexpr):
    """``(I + a)^-1`` for a strictly lower triangular ``a [BC, BC]`` (BC = 16), by products, not by a
    16-step substitution.

    ``n = -a`` is nilpotent (``n^16 = 0``), so ``(I + a)^-1 = sum_{k<16} n^k = (I + n)(I + n^2)(I + n^4)
    (I + n^8)``: three squarings and three products. The powers can be larger than the inverse itself
    (correlated keys: entries of ``n^8`` up to ``C(14, 7) |a|^8``) and the sum then cancels, so one Newton
    step follows, ``X + X (I - (I + a) X)``, whose products involve only ``X``-sized values: it brings the
    error back to that of forming ``(I + a) X`` in fp32. Every product is exact fp32 (``ieee``): on
    ``[16, 16]`` tiles that is 32 multiply-adds a thread, where the substitution's 15 dependent steps, each a
    reduction across warps, dominated the kernel (measured on the H200: 8 warps made it 1.5x slower)."""
    r = tl.arange(0, BC)
    eye = (r[:, None] == r[None, :]).to(tl.float32)
    n = -a
    x = eye + n
    power = n
    for _ in tl.static_range(3):  # n^2, n^4, n^8 (BC = 16)
        power = tl.dot(power, power, input_precision="ieee")
        x = x + tl.dot(x, power, input_precision="ieee")
    residual = eye - x - tl.dot(a, x, input_precision="ieee")  # I - (I + a) X
    return x + tl.dot(x, residual, input_precision="ieee")


@triton.jit
def _score_row_block(
    q,
    k,
    beta,
    G,
    A_kk,
    A_qk,
    M_out,
    a_base,
    out_rows,
    start,
    end,
    i_h,
    i_hv,
    I,
    H: tl.constexpr,
    HV: tl.constexpr,
    K: tl.constexpr,
    L2: tl.constexpr,
    SIGMOID: tl.constexpr,
    TWO: tl.constexpr,
    BT: tl.constexpr,
    BK: tl.constexpr,
    BKC: tl.constexpr,
    BC: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
    SAVE: tl.constexpr,
    ROUND: tl.constexpr,
):
    """Rows ``I*16 .. I*16+15`` of A_kk and A_qk (the first of them inside the sequence)."""
    cols = tl.arange(0, BK)
    sub = tl.arange(0, BC)
    rows_i = start + I * BC + sub
    valid_i = rows_i < end
    m_i = valid_i[:, None] & (cols[None, :] < K)
    k_i = tl.load(head_rows(k, rows_i, i_h, cols, H, K), mask=m_i, other=0.0).to(tl.float32)
    q_i = tl.load(head_rows(q, rows_i, i_h, cols, H, K), mask=m_i, other=0.0).to(tl.float32)
    k_norm = inv_norm(k_i, L2)  # [BC]: 1 / ||k_i|| with l2norm in kernel, else 1
    q_norm = inv_norm(q_i, L2)
    k_i = k_i * k_norm[:, None]
    q_i = q_i * q_norm[:, None]
    anchor = tl.load(G + (start + I * BC).to(tl.int64) * (HV * K) + i_hv * K + cols, mask=cols < K, other=0.0)
    g_i = tl.load(head_rows(G, rows_i, i_hv, cols, HV, K), mask=m_i, other=0.0)
    g_i = tl.where(m_i, g_i, anchor[None, :])  # rows past the end: exp(0) times a zero key
    b_i = _row_betas(beta, rows_i, valid_i, i_hv, HV, SIGMOID, TWO)
    k_i_late = k_i * tl.exp(g_i - anchor[None, :])  # exp(G_i - G_a) <= 1
    q_i_late = q_i * tl.exp(g_i - anchor[None, :])
    for J in range(BT // BC):
        out_off = a_base + out_rows + (J * BC + sub)[None, :]
        if J < I:
            rows_j = start + J * BC + sub  # all before the anchor, all inside the sequence
            m_j = (cols[None, :] < K) & (rows_j[:, None] < end)
            k_j = _rows_l2(tl.load(head_rows(k, rows_j, i_h, cols, H, K), mask=m_j, other=0.0).to(tl.float32), L2)
            g_j = tl.load(head_rows(G, rows_j, i_hv, cols, HV, K), mask=m_j, other=0.0)
            k_j_early = k_j * tl.exp(anchor[None, :] - g_j)  # exp(G_a - G_j) <= 1
            kk = dot(k_i_late, tl.trans(k_j_early), DOT_PRECISION)
            qk = dot(q_i_late, tl.trans(k_j_early), DOT_PRECISION)
            _store_scores(kk, qk, b_i, out_off, A_kk, A_qk, M_out, SAVE, ROUND)
        elif J == I:
            causal = sub[:, None] >= sub[None, :]
            strict = sub[:, None] > sub[None, :]
            # The span every factor below sees: |G_i - G_a| over the sub-chunk's rows (rows past the end hold
            # G_a). With a decreasing G that is G_a - G_last; taken over every row, it stays a bound for any G.
            span = tl.max(tl.max(tl.abs(g_i - anchor[None, :]), axis=1), axis=0)
            if span <= DOT_SPAN:
                # One product against the anchor (see the module docstring); k_i, q_i are normalized already.
                k_i_early = k_i * tl.exp(tl.where(m_i, anchor[None, :] - g_i, 0.0))  # <= exp(DOT_SPAN)
                kk = dot(k_i_late, tl.trans(k_i_early), DOT_PRECISION)
                qk = dot(q_i_late, tl.trans(k_i_early), DOT_PRECISION)
            else:
                kk, qk = _diagonal_elementwise(q, k, G, rows_i, valid_i, i_h, i_hv, H, HV, K, BK, BKC, BC)
                # The slices were raw: apply the norms of the whole head dimension to the sums.
                kk = kk * k_norm[:, None] * k_norm[None, :]
                qk = qk * q_norm[:, None] * k_norm[None, :]
            # Above the diagonal: overflowed products, or 0 times a later row's NaN: discarded, never multiplied.
            kk = tl.where(strict, kk, 0.0)
            qk = tl.where(causal & valid_i[:, None], qk, 0.0)
            _store_scores(kk, qk, b_i, out_off, A_kk, A_qk, M_out, SAVE, ROUND)
        else:  # above the diagonal
            _store_zero_scores(out_off, A_kk, A_qk, M_out, BC, SAVE)


@triton.jit
def _score_row_block_split(
    q,
    k,
    beta,
    G,
    A_kk,
    A_qk,
    M_out,
    a_base,
    out_rows,
    start,
    end,
    i_h,
    i_hv,
    I,
    H: tl.constexpr,
    HV: tl.constexpr,
    K: tl.constexpr,
    L2: tl.constexpr,
    SIGMOID: tl.constexpr,
    TWO: tl.constexpr,
    BT: tl.constexpr,
    BK: tl.constexpr,
    BKC: tl.constexpr,
    BKS: tl.constexpr,
    BC: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
    SAVE: tl.constexpr,
    ROUND: tl.constexpr,
):
    """`_score_row_block` with each product summed over ``BKS``-column steps of K, so that a step holds
    ``[16, BKS]`` tiles instead of ``[16, K]`` ones (registers decide how many programs share an SM).

    The products are of raw rows; l2norm is applied to the sums (``(k_i / |k_i|) . (k_j / |k_j|)`` is
    ``k_i . k_j / (|k_i| |k_j|)``), with the norms summed over the same steps. The i rows' norms and the
    diagonal block's decay span come from a first pass over the steps."""
    sub = tl.arange(0, BC)
    rows_i = start + I * BC + sub
    valid_i = rows_i < end
    a_row = G + (start + I * BC).to(tl.int64) * (HV * K) + i_hv * K  # the anchor: the block's first row
    b_i = _row_betas(beta, rows_i, valid_i, i_hv, HV, SIGMOID, TWO)
    k_squares = tl.zeros([BC], dtype=tl.float32)
    q_squares = tl.zeros([BC], dtype=tl.float32)
    span = 0.0
    for c0 in range(0, BK, BKS):
        cs = c0 + tl.arange(0, BKS)
        m_i = valid_i[:, None] & (cs[None, :] < K)
        k_c = tl.load(head_rows(k, rows_i, i_h, cs, H, K), mask=m_i, other=0.0).to(tl.float32)
        q_c = tl.load(head_rows(q, rows_i, i_h, cs, H, K), mask=m_i, other=0.0).to(tl.float32)
        k_squares += tl.sum(k_c * k_c, axis=1)
        q_squares += tl.sum(q_c * q_c, axis=1)
        anchor = tl.load(a_row + cs, mask=cs < K, other=0.0)
        g_c = tl.where(m_i, tl.load(head_rows(G, rows_i, i_hv, cs, HV, K), mask=m_i, other=0.0), anchor[None, :])
        span = tl.maximum(span, tl.max(tl.max(tl.abs(g_c - anchor[None, :]), axis=1), axis=0))
    if L2:
        k_norm = tl.rsqrt(k_squares + 1e-6)  # eps as kda.reference.l2norm
        q_norm = tl.rsqrt(q_squares + 1e-6)
    else:
        k_norm = tl.full([BC], 1.0, tl.float32)
        q_norm = tl.full([BC], 1.0, tl.float32)
    causal = sub[:, None] >= sub[None, :]
    strict = sub[:, None] > sub[None, :]
    for J in range(BT // BC):
        out_off = a_base + out_rows + (J * BC + sub)[None, :]
        if J <= I:
            rows_j = start + J * BC + sub
            valid_j = rows_j < end
            if J == I and span > DOT_SPAN:  # the exact element-wise path (see the module docstring)
                kk, qk = _diagonal_elementwise(q, k, G, rows_i, valid_i, i_h, i_hv, H, HV, K, BK, BKC, BC)
                kk = kk * k_norm[:, None] * k_norm[None, :]
                qk = qk * q_norm[:, None] * k_norm[None, :]
                kk = tl.where(strict, kk, 0.0)  # 0 times a later row's NaN norm: discarded
                qk = tl.where(causal & valid_i[:, None], qk, 0.0)
            else:
                kk = tl.zeros([BC, BC], dtype=tl.float32)
                qk = tl.zeros([BC, BC], dtype=tl.float32)
                j_squares = tl.zeros([BC], dtype=tl.float32)
                for c0 in range(0, BK, BKS):
                    cs = c0 + tl.arange(0, BKS)
                    m_i = valid_i[:, None] & (cs[None, :] < K)
                    m_j = valid_j[:, None] & (cs[None, :] < K)
                    anchor = tl.load(a_row + cs, mask=cs < K, other=0.0)
                    g_i = tl.where(
                        m_i, tl.load(head_rows(G, rows_i, i_hv, cs, HV, K), mask=m_i, other=0.0), anchor[None, :]
                    )
                    late = tl.exp(g_i - anchor[None, :])  # exp(G_i - G_a) <= 1
                    k_i = tl.load(head_rows(k, rows_i, i_h, cs, H, K), mask=m_i, other=0.0).to(tl.float32)
                    q_i = tl.load(head_rows(q, rows_i, i_h, cs, H, K), mask=m_i, other=0.0).to(tl.float32)
                    k_j = tl.load(head_rows(k, rows_j, i_h, cs, H, K), mask=m_j, other=0.0).to(tl.float32)
                    g_j = tl.load(head_rows(G, rows_j, i_hv, cs, HV, K), mask=m_j, other=0.0)
                    # exp(G_a - G_j): <= 1 for earlier blocks, <= exp(DOT_SPAN) on the diagonal
                    k_j_early = k_j * tl.exp(tl.where(m_j, anchor[None, :] - g_j, 0.0))
                    j_squares += tl.sum(k_j * k_j, axis=1)
                    kk += dot(k_i * late, tl.trans(k_j_early), DOT_PRECISION)
                    qk += dot(q_i * late, tl.trans(k_j_early), DOT_PRECISION)
                j_norm = tl.rsqrt(j_squares + 1e-6) if L2 else tl.full([BC], 1.0, tl.float32)
                kk = kk * k_norm[:, None] * j_norm[None, :]
                qk = qk * q_norm[:, None] * j_norm[None, :]
                if J == I:  # entries above the diagonal may have overflowed: discarded, never multiplied
                    kk = tl.where(strict, kk, 0.0)
                    qk = tl.where(causal & valid_i[:, None], qk, 0.0)
            _store_scores(kk, qk, b_i, out_off, A_kk, A_qk, M_out, SAVE, ROUND)
        else:  # above the diagonal
            _store_zero_scores(out_off, A_kk, A_qk, M_out, BC, SAVE)


@triton.jit
def _store_scores(kk, qk, b_i, out_off, A_kk, A_qk, M_out, SAVE: tl.constexpr, ROUND: tl.constexpr):
    """One ``[16, 16]`` block: ``A_kk = beta_i M`` (fp32), ``A_qk`` (storage dtype), and ``M`` itself when
    training."""
    if SAVE:
        tl.store(M_out + out_off, kk)
    tl.store(A_kk + out_off, kk * b_i[:, None])
    tl.store(A_qk + out_off, stored(qk, A_qk, ROUND))


@triton.jit
def _store_zero_scores(out_off, A_kk, A_qk, M_out, BC: tl.constexpr, SAVE: tl.constexpr):
    """One ``[16, 16]`` block of zeros (above the diagonal, or past the sequence's end) in each buffer:
    exact zeros, never a product, since the inverse and ``w``/``u`` read whole rows of them."""
    zero = tl.zeros([BC, BC], dtype=tl.float32)
    tl.store(A_kk + out_off, zero)
    tl.store(A_qk + out_off, zero)
    if SAVE:
        tl.store(M_out + out_off, zero)


@triton.jit
def _diagonal_elementwise(
    q,
    k,
    G,
    rows_i,
    valid_i,
    i_h,
    i_hv,
    H: tl.constexpr,
    HV: tl.constexpr,
    K: tl.constexpr,
    BK: tl.constexpr,
    BKC: tl.constexpr,
    BC: tl.constexpr,
):
    """A diagonal block's raw (un-normalized) ``k k^T`` (strictly lower) and ``q k^T`` (lower) sums, element
    by element over K slices, each exponent masked to -inf above the diagonal before ``exp``."""
    sub = tl.arange(0, BC)
    causal = sub[:, None] >= sub[None, :]
    strict = sub[:, None] > sub[None, :]
    kk = tl.zeros([BC, BC], dtype=tl.float32)
    qk = tl.zeros([BC, BC], dtype=tl.float32)
    for c0 in range(0, BK, BKC):
        cs = c0 + tl.arange(0, BKC)
        m_c = valid_i[:, None] & (cs[None, :] < K)
        g_c = tl.load(head_rows(G, rows_i, i_hv, cs, HV, K), mask=m_c, other=0.0)
        k_c = tl.load(head_rows(k, rows_i, i_h, cs, H, K), mask=m_c, other=0.0).to(tl.float32)
        q_c = tl.load(head_rows(q, rows_i, i_h, cs, H, K), mask=m_c, other=0.0).to(tl.float32)
        diff = g_c[:, None, :] - g_c[None, :, :]  # [i, j, c]
        keep = causal & valid_i[:, None]  # rows past the end hold no score (and no overflow)
        decay = tl.exp(tl.where(keep[:, :, None], diff, float("-inf")))
        kj = k_c[None, :, :] * decay
        qk += tl.sum(q_c[:, None, :] * kj, axis=2)
        kk += tl.sum(tl.where(strict[:, :, None], k_c[:, None, :] * kj, 0.0), axis=2)
    return kk, qk
