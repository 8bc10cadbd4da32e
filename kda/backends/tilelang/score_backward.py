"""Backward: the gradients through the two score matrices, by 16-row strips (the helion backend's
`score_backward`, the same math and the same per-strip choice of the diagonal block).

Both scores are ``P[i, j] = sum_c a_i[c] b_j[c] exp(G_i[c] - G_j[c])`` (``P_qk``: ``a = q, b = k``,
``j <= i``; ``P_kk = M``: ``a = b = k``, ``j < i``), with ``dP`` from the chunk stage::

    da_i = sum_j dP[i, j] b_j exp(G_i - G_j)        db_j = sum_i dP[i, j] a_i exp(G_i - G_j)

and per row ``i`` of the chunk, added to what the chunk stage wrote::

    dq += da (P_qk)        dk += da (P_kk) + db (P_qk) + db (P_kk)
    dG += q da (P_qk) + k da (P_kk) - k (db (P_qk) + db (P_kk))

Anchors. The strip ``S = [a, a + 16)`` is taken as rows (its ``da``) and as columns (its ``db``). As rows,
``exp(G_i - G_j) = exp(G_i - G_a) exp(G_a - G_j)`` for the columns ``j < a``; as columns,
``exp(G_i - G_j) = exp(G_i - G_e) exp(G_e - G_j)`` with ``e = a + 15`` for the rows ``i > e``: every factor
is <= 1, and each side is one matrix product over the chunk. The diagonal block joins those products
(its factors then reach ``e^span``) when the strip's span ``max |G_i - G_a|, |G_i - G_e|`` is at most 80
and its largest single log-decay step ``max |G_t - G_(t-1)|`` at most 8 (`SPAN_LIMIT`, `STEP_LIMIT`:
``da`` and ``db`` meet in ``dG`` as a difference whose residual grows with the factors, and ``dA_log``
later multiplies it by the log decays). Otherwise, decided per strip at run time, the block is exact:
one step per column (or row) of the block, ``exp`` of each ``G_i - G_j <= 0`` in fp32.

Every term is elementwise in the key dimension (the products contract over the chunk, never over ``K``),
so the key dimension is cut into blocks of `KEY_BLOCK` columns, one program each, and the choice of a
strip's diagonal block is made per key block: the span and step bounds hold column by column, so a block
within them is as safe as a whole row within them.

Products. Per strip, transposed so that the key block is the long side, ``M = 64`` rows of a ``wgmma``
(at chunk 32 too)::

    da_q^T = (k_j exp(G_a - G_j))^T  [BK, C]  x  dP_qk[S, :]^T  [C, 16]          (and da_k with dP_kk)
    db^T   = [q_i; k_i] exp(G_i - G_e))^T  [BK, 2C]  x  [dP_qk[:, S]; dP_kk[:, S]]  [2C, 16]

(``db`` of the two scores is only ever needed summed, so its two products are one over ``2C``.) ``dP`` is
fp32 and its products must not round it to TF32 or to a single bf16, so every operand is split into two
bf16 halves, ``x = high + low`` to 16 significant bits (`intra.high`, `intra.low`), and each product is
the three terms ``A_hi B_hi + A_hi B_lo + A_lo B_hi`` accumulated in fp32. The key-side operands are
split too (rather than rounded to the inputs' dtype): bf16's range holds ``|x| e^80`` where fp16's would
overflow at a span of 11, and the split gives them 16 bits, more than either input dtype.

``a`` and ``b`` are the rows the forward used: with the l2norm ``x r``, the inputs ``x`` times each row's
reciprocal norm ``r`` in fp32, formed where they are read (`used`) from the inputs and ``r`` as `intra`
formed that product (the same fp32 value: a rounding of the rows here would be one the forward did not
make, which the CPU replay put at 2.3 times ``dA_log``'s tolerance); else the inputs.

Arguments (``tokens``, ``NT``, ``H``, ``HV`` symbolic; ``group = HV // H``, value head ``hv`` reads q/k head
``hv // group``):

    q, k                [tokens, H, K]    dtype    as the call gave them
    rstd_q, rstd_k      [tokens, H]       fp32     each row's r = 1 / |x| (with the l2norm; else [1], unread)
    G                   [NT, HV, C, K]    fp32     in-chunk cumulative log decay (flat past the end)
    dP_qk, dP_kk        [NT, HV, C, C]    fp32     (only the causal triangles are read: j <= i, j < i)
    chunk_starts        [NT]              int32
    chunk_seq_ends      [NT]              int32
    dq_c, dk_c, dG_c    [NT, HV, C, K]    fp32     added to (read, add, write)

Rows past the sequence's end load ``q``, ``k`` as zeros. Grid ``(NT, HV, K / BK)``, 256 threads (two
warpgroups; see `THREADS`): a program owns its chunk's rows of its key block, so the read-add-writes never
race, and it loads its chunk's ``q``, ``k``, ``G`` once for all its strips (a program a strip would load
them C / 16 times). Shared memory is the same at every K: with the l2norm 112640 bytes at chunk 64 (two
blocks an H200 SM) and 63488 at chunk 32 (three). The exact block's 16 steps are a loop, not unrolled:
unrolled they took the kernel to 233 registers (one warpgroup).

Loads. A strip's global reads (its ``dP`` rows and columns, and its rows of ``dq_c``, ``dk_c``, ``dG_c``) go
out together at the strip's start into registers, before its operands are built, and are used after: the
exponentials and halves of the operands run while they arrive. Read where they were used, the dP loads
and the read-add-write were each a memory latency between barriers, at two blocks an SM. nvcc gives 74
registers a thread with the safe gate and 108 with the span measured (K = 128, chunk 64, bf16, l2norm,
nvcc 13.0; `benchmarks/tilelang_ptx.py`), no spills: two blocks an SM still, as shared memory allows.
"""

# (the kernel's tensors are annotations that are calls, `T.Tensor((NT, K), dtype)`, which TileLang evaluates)
# No `from __future__ import annotations` here: TileLang evaluates a kernel's annotations, and they name
# the builder's locals (the compile-time sizes and the dynamic lengths).
import functools

import tilelang.language as T

from kda.backends.strips import SPAN_LIMIT, STEP_LIMIT, bound_keeps_strips_within_limits
from kda.backends.tilelang import gate
from kda.backends.tilelang.intra import SPLIT, STRIP, high, low

KEY_BLOCK = 64  # key columns a program: wgmma's M, and the work of a chunk spread over K / 64 programs
# Two warpgroups: every product has the key block's 64 columns as M, and the two split its 16 strip columns
# (`wgmma` of N = 8 each), while every elementwise loop (the exponentials and halves of the operands, most of
# the kernel's work) halves per thread. The precedent is `intra`'s strips (4.73 to 2.13 ms at
# B1_T8192_H96_D128, `intra.threads_for`); with one warpgroup this kernel was 47% of a training step on an
# H100 (version 6: one block, 4 warps, an SM). Chunk 32 splits the same way: its products' M is the key block.
THREADS = 256


def within_limits(gate_mode: int, lower_bound: float) -> bool:
    """Whether the gate keeps every strip within `SPAN_LIMIT` and `STEP_LIMIT`, so that no strip measures its
    span: the sigmoid and safe gates give ``|a_t| <= |lower_bound|``, a step of at most that and a span of
    at most 15 times it (75 and 5 for the safe gate's -5)."""
    return gate_mode in (gate.SIGMOID, gate.SAFE) and bound_keeps_strips_within_limits(lower_bound)


@functools.cache
def build(C: int, K: int, dtype: str, l2norm: bool, bounded: bool = False):
    """The kernel for chunk `C` (32 or 64), key head dim `K` (a multiple of 64) and input dtype `dtype`
    ("bfloat16" or "float16"); with `l2norm` the rows are ``x r`` (`used`), formed in fp32 from the inputs
    and their scales, and every operand is formed from them in fp32 and split into halves. `bounded`
    (`within_limits`): no strip measures its span, and the exact diagonal block is not compiled."""
    tokens, NT = T.dynamic("tokens"), T.dynamic("NT")
    H, HV = T.dynamic("H"), T.dynamic("HV")
    f32 = "float32"
    BK = KEY_BLOCK
    assert C in (32, 64) and K % BK == 0, (C, K)
    group = HV // H
    strips = C // STRIP
    # span <= 80 and step <= 8 as one maximum: the step is weighed 10 times
    step_weight = SPAN_LIMIT / STEP_LIMIT
    scales = (tokens, H) if l2norm else (1,)

    def used(x_s, r_s, i, d):
        """Row ``i``, column ``d`` of q or k as the forward used it, in fp32: ``x r`` with the l2norm, else ``x``."""
        x = T.cast(x_s[i, d], f32)
        return x * r_s[i] if l2norm else x

    @T.prim_func
    def score_backward_kernel(
        q: T.Tensor((tokens, H, K), dtype),  # as given
        k: T.Tensor((tokens, H, K), dtype),
        rstd_q: T.Tensor(scales, f32),  # with the l2norm: each row's r
        rstd_k: T.Tensor(scales, f32),
        G: T.Tensor((NT, HV, C, K), f32),
        dP_qk: T.Tensor((NT, HV, C, C), f32),
        dP_kk: T.Tensor((NT, HV, C, C), f32),
        chunk_starts: T.Tensor((NT,), "int32"),
        chunk_seq_ends: T.Tensor((NT,), "int32"),
        dq_c: T.Tensor((NT, HV, C, K), f32),  # added to
        dk_c: T.Tensor((NT, HV, C, K), f32),  # added to
        dG_c: T.Tensor((NT, HV, C, K), f32),  # added to
    ):
        with T.Kernel(NT, HV, K // BK, threads=THREADS) as (c, hv, kb):
            h = T.alloc_var("int32", init=hv // group)  # once: as an expression it became 64-bit divisions
            start = chunk_starts[c]
            end = chunk_seq_ends[c]
            k0 = kb * BK
            G_s = T.alloc_shared((C, BK), f32)
            q_s = T.alloc_shared((C, BK), dtype)  # as given: `used` forms the rows in fp32
            k_s = T.alloc_shared((C, BK), dtype)
            # the chunk's rows' r (0 past the end); without the l2norm nothing reads them, nothing is allocated
            r_q = T.alloc_shared((C,), f32)
            r_k = T.alloc_shared((C,), f32)
            # the key-side operands, transposed ([key, contraction]), as bf16 halves
            rows_hi = T.alloc_shared((BK, C), SPLIT)  # k_j exp(G_a - G_j): the strip as rows
            rows_lo = T.alloc_shared((BK, C), SPLIT)
            cols_hi = T.alloc_shared((BK, 2 * C), SPLIT)  # [q_i; k_i] exp(G_i - G_e): the strip as columns
            cols_lo = T.alloc_shared((BK, 2 * C), SPLIT)
            # the dP side, [strip, contraction], as bf16 halves
            pq_hi = T.alloc_shared((STRIP, C), SPLIT)  # dP_qk[S, :]
            pq_lo = T.alloc_shared((STRIP, C), SPLIT)
            pk_hi = T.alloc_shared((STRIP, C), SPLIT)  # dP_kk[S, :]
            pk_lo = T.alloc_shared((STRIP, C), SPLIT)
            pc_hi = T.alloc_shared((STRIP, 2 * C), SPLIT)  # [dP_qk[:, S]; dP_kk[:, S]]^T
            pc_lo = T.alloc_shared((STRIP, 2 * C), SPLIT)
            # the strip's contributions, [row, key], for coalesced read-add-writes
            out_q = T.alloc_shared((STRIP, BK), f32)
            out_k = T.alloc_shared((STRIP, BK), f32)
            out_G = T.alloc_shared((STRIP, BK), f32)
            acc_q = T.alloc_fragment((BK, STRIP), f32)  # da (P_qk)^T, before exp(G_i - G_a)
            acc_k = T.alloc_fragment((BK, STRIP), f32)  # da (P_kk)^T
            acc_c = T.alloc_fragment((BK, STRIP), f32)  # db (P_qk + P_kk)^T, before exp(G_e - G_j)
            # A strip's global reads, in registers: issued at the strip's start and used after its operands
            # are built, so their latency runs under the exponentials and halves (read where they were used,
            # each was a wait between barriers; version 14, 3.42 to 3.08 ms at B1_T8192_H96_D128 on an H100,
            # the same bits). dP cut to its causal triangles (what lies above them is not this stage's to
            # read), as rows and as columns
            dp_q = T.alloc_fragment((STRIP, C), f32)
            dp_k = T.alloc_fragment((STRIP, C), f32)
            dp_c = T.alloc_fragment((2 * C, STRIP), f32)
            # and the strip's rows of dq_c, dk_c, dG_c as the chunk stage wrote them, added to at the end
            old_q = T.alloc_fragment((STRIP, BK), f32)
            old_k = T.alloc_fragment((STRIP, BK), f32)
            old_G = T.alloc_fragment((STRIP, BK), f32)
            gaps = T.alloc_fragment((STRIP, BK), f32)
            row_span = T.alloc_fragment((STRIP,), f32)
            span = T.alloc_fragment((1,), f32)
            cut_rows = T.alloc_var("int32")
            cut_cols = T.alloc_var("int32")

            T.copy(G[c, hv, 0, k0], G_s)
            for i, d in T.Parallel(C, BK):
                ok = start + i < end
                q_s[i, d] = T.if_then_else(ok, q[start + i, h, k0 + d], T.cast(0, dtype))
                k_s[i, d] = T.if_then_else(ok, k[start + i, h, k0 + d], T.cast(0, dtype))
            if l2norm:
                for i in T.Parallel(C):
                    ok = start + i < end
                    r_q[i] = T.if_then_else(ok, rstd_q[start + i, h], 0.0)
                    r_k[i] = T.if_then_else(ok, rstd_k[start + i, h], 0.0)

            # the rows operand past the strip's last row is never built (below); it meets only dP's zeros
            # there, and a zero times shared memory's first contents could be NaN
            T.clear(rows_hi)
            T.clear(rows_lo)

            for s in T.serial(strips):
                a = s * STRIP
                e = a + STRIP - 1
                for i, d in T.Parallel(STRIP, BK):
                    old_q[i, d] = dq_c[c, hv, a + i, k0 + d]
                    old_k[i, d] = dk_c[c, hv, a + i, k0 + d]
                    old_G[i, d] = dG_c[c, hv, a + i, k0 + d]
                for n, j in T.Parallel(STRIP, C):
                    dp_q[n, j] = T.if_then_else(j <= a + n, dP_qk[c, hv, a + n, j], 0.0)
                    dp_k[n, j] = T.if_then_else(j < a + n, dP_kk[c, hv, a + n, j], 0.0)
                for j, n in T.Parallel(2 * C, STRIP):
                    i = j % C
                    dp_c[j, n] = T.if_then_else(
                        j < C,
                        T.if_then_else(i >= a + n, dP_qk[c, hv, i, a + n], 0.0),
                        T.if_then_else(i > a + n, dP_kk[c, hv, i, a + n], 0.0),
                    )
                if bounded:  # the gate keeps every strip within both limits (`within_limits`)
                    cut_rows = a + STRIP
                    cut_cols = a
                else:
                    for i, d in T.Parallel(STRIP, BK):
                        previous = T.max(a + i - 1, a)  # the strip's first row: its own, a step of 0
                        step = T.abs(G_s[a + i, d] - G_s[previous, d])
                        reach = T.max(T.abs(G_s[a + i, d] - G_s[a, d]), T.abs(G_s[a + i, d] - G_s[e, d]))
                        gaps[i, d] = T.max(reach, step_weight * step)
                    T.reduce_max(gaps, row_span, dim=1)
                    T.reduce_max(row_span, span, dim=0)
                    # the products' reach: as rows the columns before the cut, as columns the rows from it
                    cut_rows = T.if_then_else(span[0] <= SPAN_LIMIT, a + STRIP, a)
                    cut_cols = T.if_then_else(span[0] <= SPAN_LIMIT, a, a + STRIP)

                # operands outside their reach are 0 by a select: exp there may be inf, never multiplied. Only
                # the 16-row blocks a product can reach are built: as rows the strip's and those above it (the
                # rest stay 0 from the clear: dP_qk[S, :] and dP_kk[S, :] are 0 past the strip); as columns
                # the strip's and those below it (the blocks above keep the last strip's finite values, which
                # meet dP's zeros: the columns' dP is 0 above the strip). Built whole, 62.5% of each strip's
                # exponentials were thrown away. The loops run along the key block, so that neighbouring
                # threads read neighbouring words
                for block in T.serial(s + 1):
                    for i, d in T.Parallel(STRIP, BK):
                        j = block * STRIP + i
                        x = T.if_then_else(j < cut_rows, used(k_s, r_k, j, d) * T.exp(G_s[a, d] - G_s[j, d]), 0.0)
                        rows_hi[d, j] = high(x)
                        rows_lo[d, j] = low(x)
                for block in T.serial(strips - s):
                    for n, d in T.Parallel(STRIP, BK):
                        i = a + block * STRIP + n
                        decay = T.if_then_else(i >= cut_cols, T.exp(G_s[i, d] - G_s[e, d]), 0.0)
                        x_q = used(q_s, r_q, i, d) * decay
                        x_k = used(k_s, r_k, i, d) * decay
                        cols_hi[d, i] = high(x_q)
                        cols_lo[d, i] = low(x_q)
                        cols_hi[d, C + i] = high(x_k)
                        cols_lo[d, C + i] = low(x_k)
                # dP's halves, from the registers loaded at the strip's start
                for n, j in T.Parallel(STRIP, C):
                    pq_hi[n, j] = high(dp_q[n, j])
                    pq_lo[n, j] = low(dp_q[n, j])
                    pk_hi[n, j] = high(dp_k[n, j])
                    pk_lo[n, j] = low(dp_k[n, j])
                for j, n in T.Parallel(2 * C, STRIP):  # along the strip's columns: 16 neighbouring words
                    pc_hi[n, j] = high(dp_c[j, n])
                    pc_lo[n, j] = low(dp_c[j, n])

                # the three terms above 2^-16 of each product, issued together and waited on once
                T.wgmma_gemm(rows_hi, pq_hi, acc_q, transpose_B=True, clear_accum=True)
                T.wgmma_gemm(rows_hi, pq_lo, acc_q, transpose_B=True)
                T.wgmma_gemm(rows_lo, pq_hi, acc_q, transpose_B=True)
                T.wgmma_gemm(rows_hi, pk_hi, acc_k, transpose_B=True, clear_accum=True)
                T.wgmma_gemm(rows_hi, pk_lo, acc_k, transpose_B=True)
                T.wgmma_gemm(rows_lo, pk_hi, acc_k, transpose_B=True)
                T.wgmma_gemm(cols_hi, pc_hi, acc_c, transpose_B=True, clear_accum=True)
                T.wgmma_gemm(cols_hi, pc_lo, acc_c, transpose_B=True)
                T.wgmma_gemm(cols_lo, pc_hi, acc_c, transpose_B=True)
                T.wait_wgmma(0)

                for d, i in T.Parallel(BK, STRIP):
                    row = a + i
                    da_q = T.exp(G_s[row, d] - G_s[a, d]) * acc_q[d, i]
                    da_k = T.exp(G_s[row, d] - G_s[a, d]) * acc_k[d, i]
                    db = T.exp(G_s[e, d] - G_s[row, d]) * acc_c[d, i]
                    out_q[i, d] = da_q
                    out_k[i, d] = da_k + db
                    out_G[i, d] = used(q_s, r_q, row, d) * da_q + used(k_s, r_k, row, d) * (da_k - db)

                if not bounded and span[0] > SPAN_LIMIT:  # the diagonal block exactly: a + jj as column and row
                    for i, d in T.Parallel(STRIP, BK):
                        row = a + i
                        G_i = G_s[row, d]
                        ex_q = T.alloc_var(f32)
                        ex_k = T.alloc_var(f32)
                        ex_c = T.alloc_var(f32)
                        ex_q = 0.0
                        ex_k = 0.0
                        ex_c = 0.0
                        for jj in T.serial(STRIP):
                            other = a + jj
                            k_o = used(k_s, r_k, other, d)
                            q_o = used(q_s, r_q, other, d)
                            # the selects drop exp's inf above the diagonal; dP's own triangles as above
                            into = T.if_then_else(other <= row, T.exp(G_i - G_s[other, d]), 0.0)
                            out_of = T.if_then_else(other >= row, T.exp(G_s[other, d] - G_i), 0.0)
                            ex_q += T.if_then_else(other <= row, dP_qk[c, hv, row, other], 0.0) * k_o * into
                            ex_k += T.if_then_else(other < row, dP_kk[c, hv, row, other], 0.0) * k_o * into
                            ex_c += T.if_then_else(other >= row, dP_qk[c, hv, other, row], 0.0) * q_o * out_of
                            ex_c += T.if_then_else(other > row, dP_kk[c, hv, other, row], 0.0) * k_o * out_of
                        out_q[i, d] += ex_q
                        out_k[i, d] += ex_k + ex_c
                        out_G[i, d] += used(q_s, r_q, row, d) * ex_q + used(k_s, r_k, row, d) * (ex_k - ex_c)

                for i, d in T.Parallel(STRIP, BK):
                    dq_c[c, hv, a + i, k0 + d] = old_q[i, d] + out_q[i, d]
                    dk_c[c, hv, a + i, k0 + d] = old_k[i, d] + out_k[i, d]
                    dG_c[c, hv, a + i, k0 + d] = old_G[i, d] + out_G[i, d]

    return score_backward_kernel
