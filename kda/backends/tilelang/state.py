"""Stage 3: the serial pass over each sequence's chunks: the state entering each chunk, and its new values.

Per sequence ``n``, value head ``hv`` and block of ``BV`` value columns, ``S`` starting at the initial
state (or 0)::

    for each chunk j of the sequence, in order:
        h[j]     = S                                          [K, BV]  (the output stage reads it)
        v_new[j] = u[j] - w[j] @ S                            [C, BV]  (written over u)
        S        = exp(G_last[j])[:, None] * S + k_g[j]^T @ v_new[j]
    final_state[n] = S

``G_last [NT, HV, K]`` is each chunk's last row of ``G`` (stage 2 writes it). Only this loop is serial. ``S`` stays in registers in fp32 (``[K, BV]``); both products are ``wgmma`` on
one warpgroup, ``[C, K] x [K, BV]`` and ``[K, C] x [C, BV]`` (``k_g`` read transposed from shared
memory), with ``S`` rounded to the inputs' dtype as their operand. The chunk's tiles (``w``, ``k_g``,
``u``, ``G_last``) are loaded a chunk ahead (`T.Pipelined`), so the copies of chunk ``j + 1``
overlap the products of chunk ``j``. A tail chunk's rows past the end are zero in ``w``, ``u`` and
``k_g``, so they change nothing, and ``G_last`` is the last token's value.

Training (`train`): ``u`` arrives and ``v_new`` leaves in fp32, and the state update takes ``v_new`` as two
halves in the inputs' dtype (``hi = dtype(x)``, ``lo = dtype(x - hi)``, two products): the backward's
``dA_log`` sums terms of both signs over every token and kept the bf16 rounding of ``v_new`` (the CPU
replay, ``benchmarks/tilelang_backward_precision.py``).

Both state layouts: ``[N, HV, K, V]``, or ``[N, HV, V, K]`` with ``v_first`` (read and written
transposed). Grid ``(N, HV, V / BV)``; ``NT``, ``N`` and ``HV`` are symbolic.
"""

# No `from __future__ import annotations` here: TileLang evaluates a kernel's annotations, and they name
# the builder's locals (the compile-time sizes and the dynamic lengths).
import functools

import tilelang.language as T

THREADS = 128
STAGES = 2


@functools.cache
def build(
    C: int, K: int, V: int, BV: int, dtype: str, has_h0: bool, store_ht: bool, v_first: bool, train: bool = False
):
    NT, N, HV = T.dynamic("NT"), T.dynamic("N"), T.dynamic("HV")
    f32 = "float32"
    state_shape = (N, HV, V, K) if v_first else (N, HV, K, V)
    u_dtype = f32 if train else dtype  # training: u and v_new in fp32 (the backward's dA_log needs them)

    @T.prim_func
    def state_kernel(
        w: T.Tensor((NT, HV, C, K), dtype),
        u: T.Tensor((NT, HV, C, V), u_dtype),  # in: u; out: v_new
        k_g: T.Tensor((NT, HV, C, K), dtype),
        G_last: T.Tensor((NT, HV, K), f32),  # each chunk's last row of G
        chunk_first: T.Tensor((N,), "int32"),  # sequence n owns chunks [chunk_first[n], chunk_end[n])
        chunk_end: T.Tensor((N,), "int32"),
        h: T.Tensor((NT, HV, K, V), dtype),  # out
        h0: T.Tensor(state_shape if has_h0 else (1,), f32),
        ht: T.Tensor(state_shape if store_ht else (1,), f32),  # out
    ):
        with T.Kernel(N, HV, T.ceildiv(V, BV), threads=THREADS) as (n, hv, vb):
            v0 = vb * BV
            S = T.alloc_fragment((K, BV), f32)
            S_op = T.alloc_shared((K, BV), dtype)
            w_s = T.alloc_shared((C, K), dtype)
            kg_s = T.alloc_shared((C, K), dtype)
            u_s = T.alloc_shared((C, BV), u_dtype)
            decay = T.alloc_shared((K,), f32)
            v_new = T.alloc_fragment((C, BV), f32)
            vn_s = T.alloc_shared((C, BV), dtype)
            if train:
                vn_lo = T.alloc_shared((C, BV), dtype)  # what vn_s drops: the state update takes both halves
            if has_h0:
                for i, j in T.Parallel(K, BV):
                    if v_first:
                        S[i, j] = h0[n, hv, v0 + j, i]
                    else:
                        S[i, j] = h0[n, hv, i, v0 + j]
            else:
                T.clear(S)
            first = chunk_first[n]
            for jc in T.Pipelined(chunk_end[n] - first, num_stages=STAGES):
                j = first + jc
                T.copy(w[j, hv, 0, 0], w_s)
                T.copy(k_g[j, hv, 0, 0], kg_s)
                T.copy(u[j, hv, 0, v0], u_s)
                T.copy(G_last[j, hv, 0], decay)
                T.copy(S, S_op)
                T.copy(S_op, h[j, hv, 0, v0])
                T.gemm(w_s, S_op, v_new, clear_accum=True)
                for i, jj in T.Parallel(C, BV):
                    v_new[i, jj] = T.cast(u_s[i, jj], f32) - v_new[i, jj]
                if train:
                    # stored from the registers (a `T.copy` of a fragment may go to the producer warps,
                    # which never see its values)
                    for i, jj in T.Parallel(C, BV):
                        u[j, hv, i, v0 + jj] = v_new[i, jj]
                        vn_s[i, jj] = T.cast(v_new[i, jj], dtype)
                        vn_lo[i, jj] = T.cast(v_new[i, jj] - T.cast(T.cast(v_new[i, jj], dtype), f32), dtype)
                else:
                    T.copy(v_new, vn_s)
                    T.copy(vn_s, u[j, hv, 0, v0])
                for i, jj in T.Parallel(K, BV):
                    S[i, jj] = S[i, jj] * T.exp(decay[i])
                T.gemm(kg_s, vn_s, S, transpose_A=True)
                if train:
                    T.gemm(kg_s, vn_lo, S, transpose_A=True)
            if store_ht:
                for i, j in T.Parallel(K, BV):
                    if v_first:
                        ht[n, hv, v0 + j, i] = S[i, j]
                    else:
                        ht[n, hv, i, v0 + j] = S[i, j]

    return state_kernel
