"""Backward stage 2: per chunk, the gradients of the state products and of the WY transform.

The math is the helion backend's (`kda.backends.helion.chunk_backward`). With ``dh`` (of the state leaving
the chunk) and ``dv_new`` from the state backward, ``h`` the state entering the chunk, ``X = beta k exp(G)``
and ``Y = beta v`` (so ``w = T X``, ``u = T Y``)::

    dq_e = do h^T       dw = -dv_new h^T       dk_g = v_new dh^T                   [C, K]
    dA_qk = do v_new^T (causal)                dT = dw X^T + dv_new Y^T            [C, C]
    dX = T^T dw         dY = T^T dv_new        dA_kk = -T^T dT T^T (strictly lower)
    dv = beta dY                                                   (final: v enters nowhere else)
    dbeta = sum_v dY v + sum_c dX k exp(G) + sum_j dA_kk M         (M = A_kk / beta, kept by the forward)

then, on the rows the forward used (``q``, ``k``; with the l2norm ``x r``, below) and the cumulative log
decay, everything but the score matrices' part::

    dq  = scale exp(G) dq_e
    dk  = beta exp(G) dX + exp(G_last - G) dk_g
    dG  = dX X + q_e dq_e - k_g dk_g,  and on the last row also  sum_i k_g dk_g + exp(G_last) sum_v dh h

with ``q_e = scale q exp(G)`` and ``k_g = k exp(G_last - G)`` formed here in fp32 from the rows and ``G``
(the forward's bf16 copies, read in ``dG``'s terms, cost ``dA_log`` its tolerance),

and the score matrices' gradients for the score backward: ``dP_qk = scale dA_qk`` (``j <= i``) and
``dP_kk = diag(beta) dA_kk``. ``G_last`` is ``G``'s last row (rows past the end hold the last token's value).

Tensors (``tokens``, ``NT``, ``H``, ``HV`` symbolic; value head ``hv`` reads q/k head ``hv // (HV // H)``):
``do``, ``v`` ``[tokens, HV, V]`` and ``q``, ``k`` ``[tokens, H, K]`` as the call gave them, in the inputs'
dtype; with the l2norm ``rstd_q``, ``rstd_k [tokens, H]`` fp32, each row's ``r = 1 / |x|`` as `intra` formed
it (else one-element placeholders, never read); chunk-major ``G``
``[NT, HV, C, K]``, ``beta`` ``[NT, HV, C]``, ``T``, ``M`` ``[NT, HV, C, C]``, ``dh`` ``[NT, HV, K, V]``,
``v_new`` and ``dv_new`` ``[NT, HV, C, V]`` in fp32; ``h`` ``[NT, HV, K, V]`` in the inputs' dtype. Out: ``dv [tokens, HV, V]`` (inputs' dtype, the sequence's rows
only), fp32 ``dq_c``, ``dk_c``, ``dG_c`` ``[NT, HV, C, K]``, ``dP_qk``, ``dP_kk`` ``[NT, HV, C, C]``,
``dbeta_c [NT, HV, C]`` (every row; past the end they are what zero ``do``, ``v``, ``k`` give).

Precision. Every product accumulates in fp32 on the tensor cores, whose operands are 16-bit in shared
memory (``wgmma`` at C = 64; fp32 operands would be TF32, 10 significant bits). The training check on
``dA_log`` sums cancelling ``dG`` terms over every token, so no fp32 operand is rounded once to 16 bits.
An fp32 ``x`` is split into halves in the inputs' dtype, ``hi = round(x)``, ``lo = round(x - hi)``
(`high`, `low`: 16 significant bits in bf16, 22 in fp16), and

- a product with a 16-bit operand takes two terms, ``hi B + lo B``: ``dv_new v^T``, ``dv_new h^T``
  (``dw``), ``do v_new^T`` (``dA_qk``);
- a product of two fp32 operands takes three, ``A_hi B_hi + A_hi B_lo + A_lo B_hi`` (the dropped
  ``A_lo B_lo`` is below 2^-16 relative): ``v_new dh^T`` (``dk_g``), ``T^T dv_new`` (``dY``),
  ``dw (k exp(G))^T``, ``T^T dw`` (``dX``), ``T^T dT`` and ``(T^T dT) T^T``;
- ``do h^T`` (``dq_e``) is an exact product of 16-bit operands.

``beta`` is taken out of the products: ``dT[i, j] = beta_j (dv_new v^T + dw (k exp(G))^T)[i, j]``, so ``v``
enters as it is (exact) and ``beta`` multiplies the fp32 sum once. In fp16 a half past 65504 overflows; the
gradients and ``T`` of real inputs stay far below it (and below 6e-5 a half loses bits, absolute error
3e-8). ``sum_v dh h`` reads ``dh`` in fp32. On an H200 the fp32 outputs came within 5e-6 (bf16) and 1.6e-6
(fp16) of the float64 reference, relative to their norm; one bf16 rounding of an fp32 operand gives ~1e-3.

Order. The value side first, all of ``V`` at once (``do``, ``v``, and ``v_new``'s and ``dv_new``'s halves stay
in shared memory for the whole chunk): ``dA_qk``, ``dY`` (then ``dv`` and the first part of ``dbeta``) and
``dT``'s first term. Then ``K`` in blocks of `key_block` columns (``h``, ``dh`` ``[BK, V]`` tiles): ``dq_e``,
``dw``, ``dk_g``, ``dX``, the outputs on those columns and ``dT``'s second term (``dT`` needs every key
column before ``dA_kk``). Last ``dA_kk`` from ``dT``, with the ``M`` part of ``dbeta``.

Key blocks a block ahead. The key loop is `T.Pipelined` with two stages: a key block's tiles (``h``, ``dh``
in fp32, ``G``, ``q``, ``k``, copied as they are stored) go to shared memory by ``cp.async`` while the block
before it computes, two buffers each. One block an SM leaves nothing else to run while a block's loads
arrive, and each of the four key blocks began with them. ``dh``'s halves and the row sums ``sum_v dh h``
are then formed from the fp32 tile in shared memory (``dh`` was read from memory twice), and ``dG``'s
rows but the last go straight to memory (the last waits for the column sums), which frees the
``[C, BK]`` fp32 tile that held them for the second stage's buffers. ``q`` and ``k`` arrive raw: rows past
the sequence's end (the next sequence's, in a varlen batch) are zeroed where `used` reads them, by ``r = 0``
with the l2norm and by the row's index without it; rows past the tensor arrive as zeros (``cp.async``'s
zero fill). TileLang's warp-specialized form of the pipeline would add a producer warpgroup, over which
the 64-row products cannot be split (12 warps), so the builder asks for the plain one
(``tl.disable_warp_specialized``, `runtime.pass_configs`).

Waits. At C = 64 the products are `T.wgmma_gemm` (asynchronous), and the products of a step that read none
of each other's results are issued together and waited on once: the value side's seven (``dA_qk``, ``dT``'s
first term, ``dY``); in each key block the six state products (``dq_e``, ``dw``, ``dk_g``), then the six of
``dw``'s halves (``dT``'s term, ``dX``); then ``U = T^T dT`` and ``U T^T``, which depend on each other: 11
waits a chunk at K = 128, where a wait after each of its 61 products (`T.gemm`) made 61. A step's
products start after the barrier that publishes their operands and are waited on before the next one, so
no shared tile is written while a product reads it. Chunk 32 is below wgmma's M = 64: `T.gemm`'s
``mma.sync``.

Rows. With the l2norm the forward stores no normalized rows: ``q`` and ``k`` come as the call gave them, a
``[C, BK]`` tile each in shared memory in the inputs' dtype, with the chunk's ``r`` in fp32 ``[C]`` buffers,
and `used` forms ``x r`` in fp32 at each use (``X``'s halves, ``k exp(G)``, ``q_e``, ``k_g``): the fp32 value
`intra` formed, so the numbers are those of fp32 rows read from memory.

Grid ``(NT, HV)``, `threads_for` ``C`` threads; ``tokens``, ``NT``, ``H`` and ``HV`` are symbolic. Shared
memory does not grow with ``K`` (blocked): 226304 bytes a block at C = 64, K = V = 128 (177152 with one
buffer a tile), so one block an SM, where nvcc gives 255 registers a thread (256 threads: the whole register
file) and spills 60 bytes; 25 products written (the key loop's twelve once), 61 a chunk at K = 128, all
``wgmma``. K = 256 fits; V = 256 does not at C = 64 (``V`` is not tiled).
"""

# (the kernel's tensors are annotations that are calls, `T.Tensor((NT, K), dtype)`, which mypy cannot read)
# No `from __future__ import annotations` here: TileLang evaluates a kernel's annotations, and they name
# the builder's locals (the compile-time sizes and the dynamic lengths).
import functools

import tilelang.language as T


def threads_for(C: int) -> int:
    """Two warpgroups at chunk 64 (the [64, N] products split their N between them, and the elementwise
    work and fp32 fragments halve per thread); one at chunk 32, whose 32-row products are mma.sync."""
    return 256 if C == 64 else 128


def key_block(K: int) -> int:
    """Key columns a step of the K loop takes: 32 keeps the chunk's value-side tiles and one [BK, V] tile of
    ``h`` and of ``dh``'s halves under the H200's shared memory at V = 128."""
    return min(K, 32)


@functools.cache
def build(C: int, K: int, V: int, dtype: str, scale: float, l2norm: bool):
    """The kernel for chunk `C`, head dims `K`, `V`, inputs of `dtype` and the call's `scale`; with `l2norm`
    it reads each row's ``r`` and uses ``x r`` where the rows enter (`used`)."""
    tokens, NT = T.dynamic("tokens"), T.dynamic("NT")
    H, HV = T.dynamic("H"), T.dynamic("HV")
    f32 = "float32"
    group = HV // H
    BK = key_block(K)
    blocks = K // BK
    threads = threads_for(C)
    scales = (tokens, H) if l2norm else (1,)
    # M = C = 64 reaches wgmma's 64 rows: the independent products of a step are issued together and waited
    # on once (`T.wgmma_gemm` fails to compile where wgmma cannot serve; chunk 32 takes `T.gemm`'s mma.sync,
    # which waits on each product itself)
    wgmma = C == 64
    gemm = T.wgmma_gemm if wgmma else T.gemm

    def high(x):
        """``x`` (fp32) rounded to the inputs' dtype: the high half of ``x = high + low``."""
        return T.cast(x, dtype)

    def low(x):
        """What `high` drops, rounded to the inputs' dtype."""
        return T.cast(x - T.cast(T.cast(x, dtype), f32), dtype)

    def used(x_s, r_s, i, d, start, end):
        """Row ``i``, column ``d`` of q or k as the forward used it, in fp32: ``x r`` with the l2norm (`intra`'s
        product, so the same fp32 value; ``r`` is 0 past the sequence's end), else ``x``, and 0 past the end
        (the tiles arrive raw: those rows are the next sequence's)."""
        x = T.cast(x_s[i, d], f32)
        return x * r_s[i] if l2norm else T.if_then_else(start + i < end, x, 0.0)

    @T.prim_func
    def chunk_backward_kernel(
        do: T.Tensor((tokens, HV, V), dtype),
        v: T.Tensor((tokens, HV, V), dtype),
        q: T.Tensor((tokens, H, K), dtype),  # as given
        k: T.Tensor((tokens, H, K), dtype),
        rstd_q: T.Tensor(scales, f32),  # with the l2norm: each row's r = 1 / |q|
        rstd_k: T.Tensor(scales, f32),
        G: T.Tensor((NT, HV, C, K), f32),
        beta: T.Tensor((NT, HV, C), f32),
        T_inv: T.Tensor((NT, HV, C, C), f32),  # T = (I + A_kk)^-1 (`T` names TileLang's language here)
        M: T.Tensor((NT, HV, C, C), f32),
        h: T.Tensor((NT, HV, K, V), dtype),
        dh: T.Tensor((NT, HV, K, V), f32),
        v_new: T.Tensor((NT, HV, C, V), f32),
        dv_new: T.Tensor((NT, HV, C, V), f32),
        chunk_starts: T.Tensor((NT,), "int32"),
        chunk_seq_ends: T.Tensor((NT,), "int32"),
        dv: T.Tensor((tokens, HV, V), dtype),  # out
        dq_c: T.Tensor((NT, HV, C, K), f32),  # out
        dk_c: T.Tensor((NT, HV, C, K), f32),  # out
        dG_c: T.Tensor((NT, HV, C, K), f32),  # out
        dP_qk: T.Tensor((NT, HV, C, C), f32),  # out
        dP_kk: T.Tensor((NT, HV, C, C), f32),  # out
        dbeta_c: T.Tensor((NT, HV, C), f32),  # out
    ):
        with T.Kernel(NT, HV, threads=threads) as (c, hv):
            # computed once: as an expression it was inlined into every index, as 64-bit divisions
            head = T.alloc_var("int32", init=hv // group)
            start = chunk_starts[c]
            end = chunk_seq_ends[c]
            # the value side, for the whole chunk
            do_s = T.alloc_shared((C, V), dtype)
            v_s = T.alloc_shared((C, V), dtype)
            vn_hi = T.alloc_shared((C, V), dtype)  # v_new (fp32) as two halves
            vn_lo = T.alloc_shared((C, V), dtype)
            dvn_hi = T.alloc_shared((C, V), dtype)
            dvn_lo = T.alloc_shared((C, V), dtype)
            T_hi = T.alloc_shared((C, C), dtype)
            T_lo = T.alloc_shared((C, C), dtype)
            b_s = T.alloc_shared((C,), f32)
            # the chunk's rows' r, for every key block (0 past the end, which zeroes those rows where `used`
            # reads them); without the l2norm nothing reads them and TileLang allocates nothing
            r_q = T.alloc_shared((C,), f32)
            r_k = T.alloc_shared((C,), f32)
            # dbeta's parts, one row each: the value side's, then each key block's. A loop over fewer
            # elements than threads gives an element to several threads, so shared memory is only ever
            # written with values (all threads write the same), never read-modified-written
            db_parts = T.alloc_shared((blocks + 1, C), f32)
            dA = T.alloc_fragment((C, C), f32)  # do v_new^T
            dT = T.alloc_fragment((C, C), f32)  # dT / beta_j, until every key column is in
            dY = T.alloc_fragment((C, V), f32)
            row_sum = T.alloc_fragment((C,), f32)
            # a block of key columns
            h_s = T.alloc_shared((BK, V), dtype)
            dh_s = T.alloc_shared((BK, V), f32)  # as stored: the halves and the row sums read it here
            dh_hi = T.alloc_shared((BK, V), dtype)
            dh_lo = T.alloc_shared((BK, V), dtype)
            G_s = T.alloc_shared((C, BK), f32)
            k_s = T.alloc_shared((C, BK), dtype)  # as given: `used` forms the rows in fp32
            q_s = T.alloc_shared((C, BK), dtype)
            x_hi = T.alloc_shared((C, BK), dtype)  # k exp(G): X without beta
            x_lo = T.alloc_shared((C, BK), dtype)
            dw_hi = T.alloc_shared((C, BK), dtype)
            dw_lo = T.alloc_shared((C, BK), dtype)
            dG_last = T.alloc_shared((BK,), f32)  # dG's last row, finished by the column sums
            kg_dkg = T.alloc_shared((C, BK), f32)
            dgl_s = T.alloc_shared((BK,), f32)
            dqe = T.alloc_fragment((C, BK), f32)
            dw = T.alloc_fragment((C, BK), f32)  # dv_new h^T = -dw
            dkg = T.alloc_fragment((C, BK), f32)
            dX = T.alloc_fragment((C, BK), f32)
            db_part = T.alloc_fragment((C, BK), f32)
            dh_h = T.alloc_fragment((BK, V), f32)
            dgl = T.alloc_fragment((BK,), f32)
            # the inverse's gradient
            dT_hi = T.alloc_shared((C, C), dtype)
            dT_lo = T.alloc_shared((C, C), dtype)
            U_hi = T.alloc_shared((C, C), dtype)
            U_lo = T.alloc_shared((C, C), dtype)
            U = T.alloc_fragment((C, C), f32)  # T^T dT
            R = T.alloc_fragment((C, C), f32)  # T^T dT T^T = -dA_kk
            dbm = T.alloc_fragment((C, C), f32)

            for i, j in T.Parallel(C, V):
                ok = start + i < end
                do_s[i, j] = T.if_then_else(ok, do[start + i, hv, j], T.cast(0, dtype))
                v_s[i, j] = T.if_then_else(ok, v[start + i, hv, j], T.cast(0, dtype))
                x = dv_new[c, hv, i, j]
                dvn_hi[i, j] = high(x)
                dvn_lo[i, j] = low(x)
                y = v_new[c, hv, i, j]
                vn_hi[i, j] = high(y)
                vn_lo[i, j] = low(y)
            for i, j in T.Parallel(C, C):
                t = T_inv[c, hv, i, j]
                T_hi[i, j] = high(t)
                T_lo[i, j] = low(t)
            for i in T.Parallel(C):
                b_s[i] = beta[c, hv, i]
            if l2norm:
                for i in T.Parallel(C):
                    ok = start + i < end
                    r_q[i] = T.if_then_else(ok, rstd_q[start + i, head], 0.0)
                    r_k[i] = T.if_then_else(ok, rstd_k[start + i, head], 0.0)

            # the value side's seven products read only the chunk's tiles: one wait
            gemm(do_s, vn_hi, dA, transpose_B=True, clear_accum=True)
            gemm(do_s, vn_lo, dA, transpose_B=True)
            gemm(dvn_hi, v_s, dT, transpose_B=True, clear_accum=True)
            gemm(dvn_lo, v_s, dT, transpose_B=True)
            gemm(T_hi, dvn_hi, dY, transpose_A=True, clear_accum=True)  # dY = T^T dv_new
            gemm(T_hi, dvn_lo, dY, transpose_A=True)
            gemm(T_lo, dvn_hi, dY, transpose_A=True)
            if wgmma:
                T.wait_wgmma(0)
            for i, j in T.Parallel(C, C):  # stored at once: dA's registers are free for the key loop
                dP_qk[c, hv, i, j] = T.if_then_else(j <= i, scale * dA[i, j], 0.0)
            for i, j in T.Parallel(C, V):
                if start + i < end:
                    dv[start + i, hv, j] = T.cast(b_s[i] * dY[i, j], dtype)
                dY[i, j] = dY[i, j] * T.cast(v_s[i, j], f32)
            T.reduce_sum(dY, row_sum, dim=1)
            for i in T.Parallel(C):
                db_parts[0, i] = row_sum[i]

            for kb in T.Pipelined(blocks, num_stages=2):
                k0 = kb * BK
                T.copy(h[c, hv, k0 : k0 + BK, 0:V], h_s)
                T.copy(G[c, hv, 0:C, k0 : k0 + BK], G_s)
                T.copy(dh[c, hv, k0 : k0 + BK, 0:V], dh_s)
                T.copy(k[start : start + C, head, k0 : k0 + BK], k_s)
                T.copy(q[start : start + C, head, k0 : k0 + BK], q_s)
                for i, j in T.Parallel(BK, V):
                    x = dh_s[i, j]
                    dh_hi[i, j] = high(x)
                    dh_lo[i, j] = low(x)
                # the block's state products, on the value side's tiles and h's, dh's: one wait
                gemm(do_s, h_s, dqe, transpose_B=True, clear_accum=True)
                gemm(dvn_hi, h_s, dw, transpose_B=True, clear_accum=True)
                gemm(dvn_lo, h_s, dw, transpose_B=True)
                gemm(vn_hi, dh_hi, dkg, transpose_B=True, clear_accum=True)
                gemm(vn_hi, dh_lo, dkg, transpose_B=True)
                gemm(vn_lo, dh_hi, dkg, transpose_B=True)
                if wgmma:
                    T.wait_wgmma(0)
                for i, j in T.Parallel(BK, V):
                    dh_h[i, j] = dh_s[i, j] * T.cast(h_s[i, j], f32)
                T.reduce_sum(dh_h, dgl, dim=1)
                for j in T.Parallel(BK):
                    dgl_s[j] = T.exp(G_s[C - 1, j]) * dgl[j]
                for i, j in T.Parallel(C, BK):
                    x = used(k_s, r_k, i, j, start, end) * T.exp(G_s[i, j])
                    x_hi[i, j] = high(x)
                    x_lo[i, j] = low(x)
                    dw_hi[i, j] = high(-dw[i, j])
                    dw_lo[i, j] = low(-dw[i, j])
                # then the two products of dw's halves: dT's term and dX, one wait
                gemm(dw_hi, x_hi, dT, transpose_B=True)
                gemm(dw_hi, x_lo, dT, transpose_B=True)
                gemm(dw_lo, x_hi, dT, transpose_B=True)
                gemm(T_hi, dw_hi, dX, transpose_A=True, clear_accum=True)  # dX = T^T dw
                gemm(T_hi, dw_lo, dX, transpose_A=True)
                gemm(T_lo, dw_hi, dX, transpose_A=True)
                if wgmma:
                    T.wait_wgmma(0)
                for i, j in T.Parallel(C, BK):
                    e_G = T.exp(G_s[i, j])
                    k_eG = used(k_s, r_k, i, j, start, end) * e_G
                    e_tail = T.exp(G_s[C - 1, j] - G_s[i, j])
                    # q_e and k_g in fp32, from the rows and G (their bf16 copies cost dA_log its tolerance)
                    kg_dk = used(k_s, r_k, i, j, start, end) * e_tail * dkg[i, j]
                    q_e_dq = scale * used(q_s, r_q, i, j, start, end) * e_G * dqe[i, j]
                    dq_c[c, hv, i, k0 + j] = scale * e_G * dqe[i, j]
                    dk_c[c, hv, i, k0 + j] = b_s[i] * e_G * dX[i, j] + e_tail * dkg[i, j]
                    dG = dX[i, j] * b_s[i] * k_eG + q_e_dq - kg_dk
                    if i < C - 1:
                        dG_c[c, hv, i, k0 + j] = dG
                    else:
                        dG_last[j] = dG
                    kg_dkg[i, j] = kg_dk
                    db_part[i, j] = dX[i, j] * k_eG
                T.reduce_sum(db_part, row_sum, dim=1)
                for i in T.Parallel(C):
                    db_parts[kb + 1, i] = row_sum[i]
                # G_last is the sum of every row's log decay: the last row takes the column sums (one
                # thread a column, down the chunk in shared memory)
                for j in T.Parallel(BK):
                    total = T.alloc_var(f32)
                    total = dgl_s[j]
                    for i in T.serial(C):
                        total += kg_dkg[i, j]
                    dG_c[c, hv, C - 1, k0 + j] = dG_last[j] + total

            for i, j in T.Parallel(C, C):
                x = dT[i, j] * b_s[j]
                dT_hi[i, j] = high(x)
                dT_lo[i, j] = low(x)
            # dA_kk's two products depend on each other: a wait each
            gemm(T_hi, dT_hi, U, transpose_A=True, clear_accum=True)  # U = T^T dT
            gemm(T_hi, dT_lo, U, transpose_A=True)
            gemm(T_lo, dT_hi, U, transpose_A=True)
            if wgmma:
                T.wait_wgmma(0)
            for i, j in T.Parallel(C, C):
                U_hi[i, j] = high(U[i, j])
                U_lo[i, j] = low(U[i, j])
            gemm(U_hi, T_hi, R, transpose_B=True, clear_accum=True)  # R = U T^T
            gemm(U_hi, T_lo, R, transpose_B=True)
            gemm(U_lo, T_hi, R, transpose_B=True)
            if wgmma:
                T.wait_wgmma(0)
            for i, j in T.Parallel(C, C):
                dA_kk = T.if_then_else(j < i, -R[i, j], 0.0)
                dP_kk[c, hv, i, j] = b_s[i] * dA_kk
                dbm[i, j] = dA_kk * M[c, hv, i, j]
            T.reduce_sum(dbm, row_sum, dim=1)
            # the parts in a fixed order, by a loop in the kernel (a Python helper that wrote the sum out as
            # one expression failed intermittently inside TileLang's builder: "missing 2 required arguments")
            for i in T.Parallel(C):
                total = T.alloc_var(f32)
                total = row_sum[i]
                for part in T.unroll(blocks + 1):
                    total += db_parts[part, i]
                dbeta_c[c, hv, i] = total

    return chunk_backward_kernel


# the key blocks' tiles arrive a block ahead by cp.async (`T.Pipelined`); TileLang's warp-specialized
# form would add a producer warpgroup, which the 64-row products cannot be split over (12 warps)
build.pass_configs = {"tl.disable_warp_specialized": True}  # type: ignore[attr-defined]
