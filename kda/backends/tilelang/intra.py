"""Stage 2: everything inside one chunk: the gate, the causal scores, the WY step, and the rows the later
stages read.

For one chunk of value head ``hv`` (q/k head ``h = hv // group``), with ``G`` and ``beta`` from stage 1 (the
`gate` macro, expanded first: both stay in shared memory; ``G``'s last row goes out as ``G_last``) and
``q``, ``k`` l2-normalized when the call asks (``x r`` with ``r = 1 / sqrt(sum x^2 + eps)``, formed in fp32
where each row is used, below)::

    A_kk[i, j] = beta_i sum_c k_i[c] k_j[c] exp(G_i[c] - G_j[c])           j < i
    A_qk[i, j] = scale  sum_c q_i[c] k_j[c] exp(G_i[c] - G_j[c])           j <= i
    T          = (I + A_kk)^-1                                              unit lower triangular
    w          = T @ (beta * k * exp(G))          u = T @ (beta * v)
    q_e        = scale * q * exp(G)               k_g = k * exp(G_last - G)  (every exponent <= 0)

Scores by strips. ``exp(G_i - G_j)`` is never split over the whole chunk (``G`` falls without bound in
it). For the strip of rows ``I = [a, a + 16)`` and the columns before it the anchor is the strip's first
row, ``exp(G_i - G_j) = exp(G_i - G_a) exp(G_a - G_j)``, both factors <= 1, and the strip is one matrix
product over ``K``, taken transposed so that its long side is the chunk: ``[C, K] x [K, 16] -> [C, 16]``,
a ``wgmma`` of M = C = 64, each of the two warpgroups taking 8 of the 16 columns (M = 32 at chunk 32 is
below wgmma's 64 and becomes ``mma.sync``, on one warpgroup). Only the rows up to the strip's last are
built. The strip's own 16x16 diagonal block takes the same product when its decay span
``max |G_i - G_a|`` is at most `span_limit` (then ``exp(G_a - G_j)`` is finite in the operand dtype and
every kept entry ``i >= j`` is <= 1; the entries above the diagonal are discarded, never multiplied by 0).
The safe gate (15 steps of at most 5) always qualifies in bf16 (limit 80, e^80 = 5.5e34 < bf16's 3.4e38);
fp16 (largest 65504) allows a span of 10 for l2-normalized keys (``|k| <= 1``) and none for raw keys, whose
size nothing bounds. A strip past its limit (an unbounded gate at its extremes)
computes its diagonal block exactly, element by element, ``exp`` of each ``G_i - G_j <= 0`` in fp32. Which
strips do is fixed at compile time where the gate bounds the span (`diagonal_path`) and otherwise read per
strip from the flags `gate.scan` sets as it sums.

Every other exponential is `gate.exp`, ``2^(x log2 e)``: one ``ex2.approx``, as Triton's ``tl.exp``.

The inverse, with ``N = -A_kk`` split into its ``[16, 16]`` diagonal blocks ``N_d`` and the rest ``N_o``::

    X = (I - N_d)^-1           each diagonal block by substitution, in fp32: a thread a column of a block,
                               reading N_d's fp32 values by columns (x_r += N[r, s] x_s once x_s is final)
    T = X;  for I = 1, 2, ...:   T[I] += X[I] (N_o T)[I]              block forward substitution

Each step is two ``[C, C]`` products: ``N_o T``, then ``T Z`` for ``Z`` that product's block row ``I``
(zero elsewhere), since ``T``'s block column ``I`` is ``X_I`` on the diagonal and still zero below it.
Every product involves ``T``-sized values only. A Neumann series over the chunk (the powers of ``N``,
summed by doubling, as this kernel did before) reaches ``(1 + a)^C`` times the inverse where the chunk's
keys share a direction and the gate barely decays (the verifier's ``correlated`` case), and cancels to
garbage. ``N``, ``T`` and ``Z`` are fp32 values held in shared memory as two bf16 halves each (`high`,
`low`: ``x = high + low`` to 16 significant bits) and each product is the three terms above 2^-16,
``A_hi B_hi + A_hi B_lo + A_lo B_hi``, accumulated in fp32: 16-bit operands are what ``wgmma`` reads
from shared memory, where fp32 operands became TF32 ``mma.sync`` fed by scalar shared loads (10
significant bits). ``T`` accumulates in fp32 registers across the steps. ``w`` and ``u`` are then products
of ``T`` with the scaled keys and values: in bf16, ``T``'s halves (two products each, from the buffers the
last step writes); in fp16, ``T`` rounded once (its rounding is eight times finer than bf16's).

The rows at inference. With the l2norm, ``q_s`` and ``k_s`` keep the rows as the call gave them and each use
(``q_e``, ``k_g``, the strips' rows and columns, ``beta k exp(G)``) multiplies by the row's fp32 ``r``, so
no normalized row is rounded to 16 bits before it is used. Where ``beta`` reaches 2 (``allow_neg_eigval``)
the verifier's correlated case sat at its tolerance with the rows rounded on load and ``T`` rounded once
(version 14: ``o`` 8.25e-3 against 8e-3 on an H100), no one of the forward's dozen roundings dominating;
dropping these two brings the CPU replay of that case to 0.86 of the tolerance
(`benchmarks/tilelang_precision.py`, `Roundings`).

Operands of the score products are the inputs' dtype (bf16 or fp16) with fp32 accumulation; ``G`` stays
fp32 in shared memory, ``A_kk`` and ``T`` as the bf16 halves above (``A_qk`` is rounded once, a
strip at a time). Outputs are chunk-major in the inputs' dtype; rows past the sequence's end load as
zeros and store zeros.

With ``save`` (a training call) the kernel also writes what the backward reads and nothing else computes,
from buffers it already holds: ``G`` and ``beta`` (fp32, ``[NT, HV, C, K]`` and ``[NT, HV, C]``),
``M = A_kk / beta`` (the strip products before beta scales them) and ``T`` (from its fp32 registers),
``[NT, HV, C, C]`` fp32, and with the l2norm the reciprocal norms ``r`` of q's and k's rows (``[tokens, H]``
fp32, by the first value head of each group). The normalized rows themselves are not stored: the backward
forms ``x r`` in fp32 from the inputs and ``r``, the value this kernel forms. It also keeps what the
backward's ``dA_log`` needs exact (a sum over every token of terms of both signs, which the bf16 roundings
of an inference forward put past its tolerance; `benchmarks/tilelang_backward_precision.py`): ``q_e``,
``k_g`` and ``beta k exp(G)`` are formed from the fp32 normalized rows ``x r``, ``w`` and ``u`` multiply
``T`` by ``beta k exp(G)`` and ``beta v`` as two halves each (``hi = dtype(x)``, ``lo = dtype(x - hi)``; two
products), and ``u`` leaves in fp32. Without ``save`` those parameters are one-element placeholders and
the kernel's body is unchanged.

Shared memory and registers decide how many chunks an SM works on at once: at C = 64, K = V = 128 the
kernel asks for 113664 bytes and 128 registers a thread, so two blocks of 256 threads share an H200 SM
(228 KB, 1 KB reserved a block; 65536 registers, all of them). With ``save`` the shared memory is the same
(``beta k exp(G)``'s low half reuses the strips' column buffer, and TileLang's planner places ``beta v``'s in
buffers no longer live) and the launch asks for two blocks an SM, which nvcc meets at 128 registers without
spilling (left alone it took 135: one block an SM, 1.4 times slower). For the shared memory, ``A_qk`` leaves a
strip at a time from a ``[16, C]`` buffer in the inputs' dtype, ``T`` goes straight from its registers into
the operand of ``w`` and ``u``, and the planner places ``Z``'s halves in buffers dead by the inverse.

Grid ``(NT, HV)``, `threads_for` ``C`` threads; ``tokens``, ``NT``, ``H`` and ``HV`` are symbolic.
"""

# No `from __future__ import annotations` here: TileLang evaluates a kernel's annotations, and they name
# the builder's locals (the compile-time sizes and the dynamic lengths).
import functools

import tilelang.language as T

from kda.backends.tilelang import gate
from kda.reference import L2NORM_EPS

STRIP = 16
SUB = 16  # rows of the inverse's diagonal blocks
SPLIT = "bfloat16"  # the halves of the inverse's fp32 operands
# one set of 16-row blocks: strip s writes the inverse's diagonal block s (`N_d`), and the gate's sum flags
# its summation block s for strip s's exact path
assert STRIP == SUB == gate.ROWS


def high(x):
    """``x`` (fp32) rounded to bf16: the high half of the split ``x = high + low``."""
    return T.cast(x, SPLIT)


def low(x):
    """What `high` drops, rounded to bf16: ``high + low`` carries 16 of fp32's 24 significant bits."""
    return T.cast(x - T.cast(T.cast(x, SPLIT), "float32"), SPLIT)


def threads_for(C: int) -> int:
    """Two warpgroups at chunk 64 (each takes 8 of a strip's 16 columns, and the elementwise work halves per
    thread); one at chunk 32, whose ``[32, 16]`` strip product cannot be split over 8 warps (16 rows, 8
    columns at least a warp)."""
    return 256 if C == 64 else 128


def span_limit(dtype: str, l2norm: bool) -> float:
    """The largest strip span whose diagonal block goes by product: ``|k| e^span`` must stay finite in
    the operand dtype (negative: never)."""
    if dtype == "bfloat16":
        return 80.0
    return 10.0 if l2norm else -1.0


NEVER, ALWAYS, FLAGGED = "never", "always", "flagged"  # which strips take their diagonal block exactly


def diagonal_path(limit: float, gate_mode: int, lower_bound: float) -> str:
    """Which strips compute their diagonal block exactly, decided at compile time where the gate bounds the
    span: the sigmoid and safe gates give ``|a_t| <= |lower_bound|``, so a strip's 15 steps span at most
    ``15 |lower_bound|`` (75 for the safe gate's -5, under bf16's 80: `NEVER`); a negative limit (raw fp16
    keys) is `ALWAYS`; otherwise `FLAGGED`, per strip at run time from the gate's sum (`gate.scan`)."""
    if limit < 0:
        return ALWAYS
    if gate_mode in (gate.SIGMOID, gate.SAFE) and (STRIP - 1) * abs(lower_bound) <= limit:
        return NEVER
    return FLAGGED


@functools.cache
def build(
    C: int,
    K: int,
    V: int,
    dtype: str,
    scale: float,
    l2norm: bool,
    gate_mode: int,
    has_dt_bias: bool,
    beta_sigmoid: bool,
    g_dtype: str,
    beta_dtype: str,
    lower_bound: float,
    beta_scale: float,
    save: bool = False,
):
    tokens, NT = T.dynamic("tokens"), T.dynamic("NT")
    H, HV = T.dynamic("H"), T.dynamic("HV")  # head counts: no compile per model either
    f32 = "float32"
    group = HV // H
    limit = span_limit(dtype, l2norm)
    exact = diagonal_path(limit, gate_mode, lower_bound)
    threads = threads_for(C)
    # M = C = 64 reaches wgmma's 64 rows: the products of a step are issued together and waited on once
    # (`T.wgmma_gemm` fails to compile where wgmma cannot serve; chunk 32 takes `T.gemm`'s mma.sync)
    wgmma = C == 64
    gemm = T.wgmma_gemm if wgmma else T.gemm
    scan_and_beta = gate.scan(C, K, threads, beta_sigmoid, beta_scale, limit if exact == FLAGGED else None)
    bias_shape = (HV, K) if has_dt_bias else (1,)

    # what training keeps for the backward, a placeholder at inference. Shapes, not a helper called in the
    # signature: a helper's `return` once reached TileLang's builder while kernels lowered on two threads
    saved_rows = (NT, HV, C, K) if save else (1,)
    saved_beta = (NT, HV, C) if save else (1,)
    saved_square = (NT, HV, C, C) if save else (1,)

    norms = save and l2norm  # the rows' reciprocal norms
    # training keeps what dA_log needs in fp32 (docs/design.md, "Where dA_log's error comes from"): the
    # normalized rows, and u; the products of w and u take beta k e^G and beta v as two halves each
    exact_rows = norms
    u_dtype = f32 if save else dtype
    # at inference with the l2norm q_s and k_s keep the rows as given and every use scales them by their
    # fp32 r (no rounding of the normalized row before its use); bf16 T goes into w and u as two halves
    raw_rows = l2norm and not save
    halves_T = dtype == SPLIT and not save

    def as_used(x_s, n_s, i, j):
        """Row ``i``, column ``j`` of q or k (`x_s`) as the scores use it, in fp32: with `raw_rows` the row as
        given times its reciprocal norm (`n_s`), else as `x_s` holds it."""
        x = T.cast(x_s[i, j], f32)
        return x * n_s[i] if raw_rows else x

    @T.prim_func
    def intra_kernel(
        q: T.Tensor((tokens, H, K), dtype),
        k: T.Tensor((tokens, H, K), dtype),
        v: T.Tensor((tokens, HV, V), dtype),
        g: T.Tensor((tokens, HV, K), g_dtype),  # the raw gate input (a log decay when pre-gated)
        beta: T.Tensor((tokens, HV), beta_dtype),  # as given
        A_log: T.Tensor((HV,), f32),  # zeros without A_log: exp(0) = 1
        dt_bias: T.Tensor(bias_shape, f32),
        chunk_starts: T.Tensor((NT,), "int32"),
        chunk_seq_ends: T.Tensor((NT,), "int32"),
        G_last: T.Tensor((NT, HV, K), f32),  # out: the chunk's last row of G, for the state pass
        q_e: T.Tensor((NT, HV, C, K), dtype),  # out
        k_g: T.Tensor((NT, HV, C, K), dtype),  # out
        w: T.Tensor((NT, HV, C, K), dtype),  # out
        u: T.Tensor((NT, HV, C, V), u_dtype),  # out (fp32 when training)
        A_qk: T.Tensor((NT, HV, C, C), dtype),  # out
        G_out: T.Tensor(saved_rows, f32),  # out when training: G
        beta_out: T.Tensor(saved_beta, f32),  # out when training: beta as activated (0 past the end)
        M_out: T.Tensor(saved_square, f32),  # out when training: A_kk / beta, strictly lower
        T_out: T.Tensor(saved_square, f32),  # out when training: (I + A_kk)^-1
        rstd_q: T.Tensor((tokens, H) if norms else (1,), f32),  # out when training with the l2norm: r
        rstd_k: T.Tensor((tokens, H) if norms else (1,), f32),
    ):
        with T.Kernel(NT, HV, threads=threads) as (c, hv):
            if save and threads == 256:  # two blocks an SM: nvcc fits training in 128 registers, no spills
                T.annotate_min_blocks_per_sm(2)
            # computed once: as an expression it was inlined into every index, as 64-bit divisions
            h = T.alloc_var("int32", init=hv // group)
            start = chunk_starts[c]
            end = chunk_seq_ends[c]
            A = T.exp(A_log[hv])  # the host passes zeros without A_log
            G_s = T.alloc_shared((C, K), f32)
            q_s = T.alloc_shared((C, K), dtype)
            k_s = T.alloc_shared((C, K), dtype)
            b_s = T.alloc_shared((C,), f32)
            cols = T.alloc_shared((C, K), dtype)  # k_j exp(G_a - G_j): the strip's columns
            q_r = T.alloc_shared((STRIP, K), dtype)  # q_i exp(G_i - G_a): the strip's rows
            k_r = T.alloc_shared((STRIP, K), dtype)  # k_i exp(G_i - G_a)
            Aqk_s = T.alloc_shared((STRIP, C), dtype)  # the strip's rows of A_qk, stored after each strip
            # N = -A_kk, then its powers, and T, each as two bf16 halves (`high`, `low`): wgmma operands
            P_hi = T.alloc_shared((C, C), SPLIT)
            P_lo = T.alloc_shared((C, C), SPLIT)
            T_hi = T.alloc_shared((C, C), SPLIT)
            T_lo = T.alloc_shared((C, C), SPLIT)
            acc_q = T.alloc_fragment((C, STRIP), f32)
            acc_k = T.alloc_fragment((C, STRIP), f32)
            wide = T.alloc_shared((C // STRIP,), "int32")  # 1 where a strip's span passes the limit
            N_d = T.alloc_shared((C // SUB, SUB, SUB), f32)  # N's diagonal blocks, [block, column, row]
            acc_cc = T.alloc_fragment((C, C), f32)
            acc_T = T.alloc_fragment((C, C), f32)
            v_f = T.alloc_fragment((C, V), dtype)  # v, held in registers from the first loads to `u`

            # every load of the chunk before the first barrier, so that they are all in flight at once; the
            # gate is activated as it arrives (`gate.activation`), v waits in registers until `u` needs it
            for i, j in T.Parallel(C, K):
                ok = start + i < end
                x = T.if_then_else(ok, T.cast(g[start + i, hv, j], f32), 0.0)
                a = gate.activation(x, dt_bias[hv, j] if has_dt_bias else None, A, gate_mode, lower_bound)
                G_s[i, j] = T.if_then_else(ok, a, 0.0)
            for i, j in T.Parallel(C, K):
                ok = start + i < end
                q_s[i, j] = T.if_then_else(ok, q[start + i, h, j], T.cast(0, dtype))
                k_s[i, j] = T.if_then_else(ok, k[start + i, h, j], T.cast(0, dtype))
            for i, j in T.Parallel(C, V):
                v_f[i, j] = T.if_then_else(start + i < end, v[start + i, hv, j], T.cast(0, dtype))
            if exact == FLAGGED:
                for s in T.Parallel(C // STRIP):
                    wide[s] = 0
            scan_and_beta(beta, hv, start, end, G_s, b_s, wide)
            for j in T.Parallel(K):
                G_last[c, hv, j] = G_s[C - 1, j]
            if save:
                T.copy(G_s, G_out[c, hv, 0, 0])
                for i in T.Parallel(C):
                    beta_out[c, hv, i] = b_s[i]
            n_q = n_k = None
            if l2norm:
                squares = T.alloc_fragment((C, K), f32)
                r_q = T.alloc_fragment((C,), f32)
                r_k = T.alloc_fragment((C,), f32)
                # the reciprocal norms go through shared memory: a loop that read them from the reduction's
                # fragment took that fragment's layout, one row to 16 threads, and ran on 8 threads of 128
                n_q = T.alloc_shared((C,), f32)
                n_k = T.alloc_shared((C,), f32)
                for i, j in T.Parallel(C, K):
                    squares[i, j] = T.cast(q_s[i, j], f32) * T.cast(q_s[i, j], f32)
                T.reduce_sum(squares, r_q, dim=1)
                for i, j in T.Parallel(C, K):
                    squares[i, j] = T.cast(k_s[i, j], f32) * T.cast(k_s[i, j], f32)
                T.reduce_sum(squares, r_k, dim=1)
                for i in T.Parallel(C):
                    n_q[i] = T.rsqrt(r_q[i] + L2NORM_EPS)
                    n_k[i] = T.rsqrt(r_k[i] + L2NORM_EPS)
                if exact_rows:  # q_e, k_g from the fp32 rows (q_s, k_s still hold the raw inputs here)
                    for i, j in T.Parallel(C, K):
                        q_hat = T.cast(q_s[i, j], f32) * n_q[i]
                        k_hat = T.cast(k_s[i, j], f32) * n_k[i]
                        q_e[c, hv, i, j] = T.cast(scale * q_hat * gate.exp(G_s[i, j]), dtype)
                        k_g[c, hv, i, j] = T.cast(k_hat * gate.exp(G_s[C - 1, j] - G_s[i, j]), dtype)
                    for i in T.Parallel(C):
                        if h * group == hv and start + i < end:  # a q/k head's rows once, by its first value head
                            rstd_q[start + i, h] = n_q[i]
                            rstd_k[start + i, h] = n_k[i]
                if not raw_rows:
                    for i, j in T.Parallel(C, K):
                        q_s[i, j] = T.cast(T.cast(q_s[i, j], f32) * n_q[i], dtype)
                        k_s[i, j] = T.cast(T.cast(k_s[i, j], f32) * n_k[i], dtype)

            if not exact_rows:
                for i, j in T.Parallel(C, K):
                    q_e[c, hv, i, j] = T.cast(scale * as_used(q_s, n_q, i, j) * gate.exp(G_s[i, j]), dtype)
                    k_g[c, hv, i, j] = T.cast(as_used(k_s, n_k, i, j) * gate.exp(G_s[C - 1, j] - G_s[i, j]), dtype)

            for s in T.unroll(C // STRIP):
                a = s * STRIP
                for i, j in T.Parallel(STRIP, K):
                    decay = gate.exp(G_s[a + i, j] - G_s[a, j])
                    q_r[i, j] = T.cast(as_used(q_s, n_q, a + i, j) * decay, dtype)
                    k_r[i, j] = T.cast(as_used(k_s, n_k, a + i, j) * decay, dtype)
                # the columns up to the strip's last row. The rows of `cols` after it are not written: a
                # column's product row depends on that row alone, and the rows with j > i are discarded below
                # (a select, so what stale rows hold never reaches a kept entry). On the strip's own rows
                # exp(G_a - G_j) >= 1 may overflow when its span is past the limit; the exact path then
                # overwrites the whole diagonal block
                for block in T.serial(s + 1):
                    for i, j in T.Parallel(STRIP, K):
                        row = block * STRIP + i
                        cols[row, j] = T.cast(as_used(k_s, n_k, row, j) * gate.exp(G_s[a, j] - G_s[row, j]), dtype)
                gemm(cols, q_r, acc_q, transpose_B=True, clear_accum=True)  # [C, 16]: column j, strip row i
                gemm(cols, k_r, acc_k, transpose_B=True, clear_accum=True)
                if wgmma:
                    T.wait_wgmma(0)
                for j, i in T.Parallel(C, STRIP):
                    row = a + i
                    Aqk_s[i, j] = T.cast(T.if_then_else(j <= row, scale * acc_q[j, i], 0.0), dtype)
                    n = T.if_then_else(j < row, -b_s[row] * acc_k[j, i], 0.0)
                    P_hi[row, j] = high(T.if_then_else(j < a, n, 0.0))  # N_o: the block is N_d's
                    P_lo[row, j] = low(T.if_then_else(j < a, n, 0.0))
                    if j >= a and j < a + STRIP:
                        N_d[s, j - a, i] = n
                    if save:
                        # the exact path below writes the diagonal block of a strip past its limit
                        if exact == FLAGGED:
                            if j < a or j >= a + STRIP or wide[s] == 0:
                                M_out[c, hv, row, j] = T.if_then_else(j < row, acc_k[j, i], 0.0)
                        elif exact == NEVER or j < a or j >= a + STRIP:
                            M_out[c, hv, row, j] = T.if_then_else(j < row, acc_k[j, i], 0.0)
                if exact == FLAGGED:
                    by_product = wide[s] == 0
                else:
                    by_product = exact == NEVER
                if not by_product:  # the diagonal block exactly
                    for i, jj in T.Parallel(STRIP, STRIP):
                        row = a + i
                        col = a + jj
                        s_q = T.alloc_var(f32)
                        s_k = T.alloc_var(f32)
                        s_q = 0.0
                        s_k = 0.0
                        for d in T.serial(K):
                            kd = as_used(k_s, n_k, col, d) * T.if_then_else(
                                col <= row, T.exp(G_s[row, d] - G_s[col, d]), 0.0
                            )
                            s_q += as_used(q_s, n_q, row, d) * kd
                            s_k += as_used(k_s, n_k, row, d) * kd
                        Aqk_s[i, col] = T.cast(T.if_then_else(col <= row, scale * s_q, 0.0), dtype)
                        N_d[s, jj, i] = T.if_then_else(col < row, -b_s[row] * s_k, 0.0)
                        if save:
                            M_out[c, hv, row, col] = T.if_then_else(col < row, s_k, 0.0)

                T.copy(Aqk_s, A_qk[c, hv, a, 0])

            # the inverse (see the module docstring): the diagonal blocks by substitution, a thread a column
            # of one block, in fp32 registers; X's halves go to T's buffers, zero off the diagonal blocks
            for i, j in T.Parallel(C, C):
                T_hi[i, j] = T.cast(0, SPLIT)
                T_lo[i, j] = T.cast(0, SPLIT)
            column = T.get_thread_binding()
            x_col = T.alloc_local((SUB,), f32)  # the thread's column of X in its block, rows in order
            if column < C:
                block_of = column // SUB
                me = column % SUB
                for r in T.unroll(SUB):
                    x_col[r] = T.if_then_else(r == me, 1.0, 0.0)
                # x = e_me + N_d x by columns: once x_s is final every row below takes N[r, s] x_s, so each
                # row's sum adds its terms in the order s = 0, 1, ... as a row-by-row substitution would
                for s_ in T.unroll(SUB - 1):
                    for r in T.unroll(SUB):
                        if r > s_:
                            x_col[r] += N_d[block_of, s_, r] * x_col[s_]
                for r in T.unroll(SUB):
                    T_hi[block_of * SUB + r, column] = high(x_col[r])
                    T_lo[block_of * SUB + r, column] = low(x_col[r])
            for i, j in T.Parallel(C, C):
                acc_T[i, j] = T.cast(T_hi[i, j], f32) + T.cast(T_lo[i, j], f32)
            # block forward substitution: block row I takes X_I (N_o T)_I, the rows above it final by then;
            # T itself stands in for X (row block I of T Z is X_I Z_I when Z is zero outside row block I)
            Z_hi = T.alloc_shared((C, C), SPLIT)
            Z_lo = T.alloc_shared((C, C), SPLIT)
            for step in T.unroll(C // SUB - 1):
                gemm(P_hi, T_hi, acc_cc, clear_accum=True)  # N_o T, the three terms above 2^-16
                gemm(P_hi, T_lo, acc_cc)
                gemm(P_lo, T_hi, acc_cc)
                if wgmma:
                    T.wait_wgmma(0)
                for i, j in T.Parallel(C, C):
                    mine = i // SUB == step + 1
                    Z_hi[i, j] = T.if_then_else(mine, high(acc_cc[i, j]), T.cast(0, SPLIT))
                    Z_lo[i, j] = T.if_then_else(mine, low(acc_cc[i, j]), T.cast(0, SPLIT))
                gemm(T_hi, Z_hi, acc_T)  # T + X_I Z_I, accumulated onto T in registers (fp32)
                gemm(T_hi, Z_lo, acc_T)
                gemm(T_lo, Z_hi, acc_T)
                if wgmma:
                    T.wait_wgmma(0)
                # T's halves for the next step; with `halves_T` the last step's too, w's and u's operand
                if halves_T or step < C // SUB - 2:
                    for i, j in T.Parallel(C, C):
                        T_hi[i, j] = high(acc_T[i, j])
                        T_lo[i, j] = low(acc_T[i, j])
            if not halves_T:
                T_h = T.alloc_shared((C, C), dtype)  # T in the inputs' dtype, the operand of w and u
                T.copy(acc_T, T_h)
            if save:
                T.copy(acc_T, T_out[c, hv, 0, 0])

            k_b = T.alloc_shared((C, K), dtype)  # beta k exp(G)
            v_b = T.alloc_shared((C, V), dtype)  # beta v
            acc_w = T.alloc_fragment((C, K), f32)
            acc_u = T.alloc_fragment((C, V), f32)
            if save:  # as high + low halves (two products each; `cols` is free after the strips)
                v_lo = T.alloc_shared((C, V), dtype)
                for i, j in T.Parallel(C, K):
                    if exact_rows:  # the fp32 row, from the input and its reciprocal norm (k_s holds it rounded)
                        x = (
                            b_s[i]
                            * T.if_then_else(start + i < end, T.cast(k[start + i, h, j], f32) * n_k[i], 0.0)  # type: ignore[index]
                            * gate.exp(G_s[i, j])
                        )
                        k_b[i, j] = T.cast(x, dtype)
                        cols[i, j] = T.cast(x - T.cast(T.cast(x, dtype), f32), dtype)
                    else:
                        x = b_s[i] * T.cast(k_s[i, j], f32) * gate.exp(G_s[i, j])
                        k_b[i, j] = T.cast(x, dtype)
                        cols[i, j] = T.cast(x - T.cast(T.cast(x, dtype), f32), dtype)
                for i, j in T.Parallel(C, V):
                    y = b_s[i] * T.cast(v_f[i, j], f32)
                    v_b[i, j] = T.cast(y, dtype)
                    v_lo[i, j] = T.cast(y - T.cast(T.cast(y, dtype), f32), dtype)
                gemm(T_h, k_b, acc_w, clear_accum=True)
                gemm(T_h, cols, acc_w)
                gemm(T_h, v_b, acc_u, clear_accum=True)
                gemm(T_h, v_lo, acc_u)
            else:
                for i, j in T.Parallel(C, K):
                    k_b[i, j] = T.cast(b_s[i] * as_used(k_s, n_k, i, j) * gate.exp(G_s[i, j]), dtype)
                for i, j in T.Parallel(C, V):
                    v_b[i, j] = T.cast(b_s[i] * T.cast(v_f[i, j], f32), dtype)  # beta = 0 past the end
                if halves_T:
                    gemm(T_hi, k_b, acc_w, clear_accum=True)
                    gemm(T_lo, k_b, acc_w)
                    gemm(T_hi, v_b, acc_u, clear_accum=True)
                    gemm(T_lo, v_b, acc_u)
                else:
                    gemm(T_h, k_b, acc_w, clear_accum=True)
                    gemm(T_h, v_b, acc_u, clear_accum=True)
            if wgmma:
                T.wait_wgmma(0)
            T.copy(acc_w, w[c, hv, 0, 0])
            T.copy(acc_u, u[c, hv, 0, 0])

    return intra_kernel
