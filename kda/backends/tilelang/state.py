"""Stage 3: the serial pass over each sequence's chunks: the state entering each chunk, and its new values;
with `with_output`, stage 4's output too.

Per sequence ``n``, value head ``hv`` and block of ``BV`` value columns, ``S`` starting at the initial
state (or 0)::

    for each chunk j of the sequence, in order:
        h[j]     = S                                          [K, BV]  (the output stage reads it)
        v_new[j] = u[j] - w[j] @ S                            [C, BV]  (written over u)
        o[j]     = q_e[j] @ h[j] + A_qk[j] @ v_new[j]         [C, BV]  (with_output: the output stage's math)
        S        = exp(G_last[j])[:, None] * S + k_g[j]^T @ v_new[j]
    final_state[n] = S

``G_last [NT, HV, K]`` is each chunk's last row of ``G`` (stage 2 writes it). Only this loop is serial. ``S`` stays in registers in fp32 (``[K, BV]``); both products are ``wgmma`` on
one warpgroup per 64 value columns, ``[C, K] x [K, BV]`` and ``[K, C] x [C, BV]`` (``k_g`` read transposed from shared
memory), with ``S`` rounded to the inputs' dtype as their operand. The chunk's tiles (``w``, ``k_g``,
``u``, ``G_last``; with the output ``q_e`` and ``A_qk``) are loaded a chunk ahead (`T.Pipelined`), so the copies of chunk ``j + 1``
overlap the products of chunk ``j``. A tail chunk's rows past the end are zero in ``w``, ``u`` and
``k_g``, so they change nothing, and ``G_last`` is the last token's value.

**The output in the pass** (`with_output`, `kernels.state_plan` decides): the chunk's output
takes the operands the pass already holds, ``S`` rounded (``h[j]``) and ``v_new`` rounded, so ``h`` and
``v_new`` never go to memory and back at inference (`store_h`: written only for a caller's intermediate
states or the backward; `store_v_new`: only for the backward), and the output stage's launch goes. Its
values are the output stage's exactly: the same operands, products and order. Only rows inside the
chunk's sequence are stored, token-major into ``o [tokens, HV, V]``.

Training (`train`): ``u`` arrives and ``v_new`` leaves in fp32, and the state update takes ``v_new`` as two
halves in the inputs' dtype (``hi = dtype(x)``, ``lo = dtype(x - hi)``, two products): the backward's
``dA_log`` sums terms of both signs over every token and kept the bf16 rounding of ``v_new`` (the CPU
replay, ``benchmarks/tilelang_backward_precision.py``).

Both state layouts: ``[N, HV, K, V]``, or ``[N, HV, V, K]`` with ``v_first`` (read and written
transposed). Grid ``(N, HV, V / BV)`` with ``threads = 128 BV / 64``; ``NT``, ``N``, ``HV`` and ``tokens`` are symbolic.
"""

# No `from __future__ import annotations` here: TileLang evaluates a kernel's annotations, and they name
# the builder's locals (the compile-time sizes and the dynamic lengths).
import functools

import tilelang.language as T

STAGES = 2


def threads_for(BV: int) -> int:
    """One warpgroup per 64 value columns: each takes a 64-column slice of every product."""
    return 128 * max(BV // 64, 1)


@functools.cache
def build(
    C: int,
    K: int,
    V: int,
    BV: int,
    dtype: str,
    has_h0: bool,
    store_ht: bool,
    v_first: bool,
    train: bool = False,
    with_output: bool = False,
    store_h: bool = True,
):
    NT, N, HV, tokens = T.dynamic("NT"), T.dynamic("N"), T.dynamic("HV"), T.dynamic("tokens")
    f32 = "float32"
    state_shape = (N, HV, V, K) if v_first else (N, HV, K, V)
    u_dtype = f32 if train else dtype  # training: u and v_new in fp32 (the backward's dA_log needs them)
    store_v_new = train or not with_output  # the backward or the output stage reads it
    store_h = store_h or not with_output
    out_shape = (tokens, HV, V) if with_output else (1,)

    @T.prim_func
    def state_kernel(
        w: T.Tensor((NT, HV, C, K), dtype),
        u: T.Tensor((NT, HV, C, V), u_dtype),  # in: u; out: v_new (when stored)
        k_g: T.Tensor((NT, HV, C, K), dtype),
        G_last: T.Tensor((NT, HV, K), f32),  # each chunk's last row of G
        chunk_first: T.Tensor((N,), "int32"),  # sequence n owns chunks [chunk_first[n], chunk_end[n])
        chunk_end: T.Tensor((N,), "int32"),
        h: T.Tensor((NT, HV, K, V) if store_h else (1,), dtype),  # out
        h0: T.Tensor(state_shape if has_h0 else (1,), f32),
        ht: T.Tensor(state_shape if store_ht else (1,), f32),  # out
        q_e: T.Tensor((NT, HV, C, K) if with_output else (1,), dtype),
        A_qk: T.Tensor((NT, HV, C, C) if with_output else (1,), dtype),
        chunk_starts: T.Tensor((NT,) if with_output else (1,), "int32"),  # chunk j's rows are tokens
        chunk_seq_ends: T.Tensor((NT,) if with_output else (1,), "int32"),  # [start, min(start + C, end))
        o: T.Tensor(out_shape, dtype),  # out
    ):
        with T.Kernel(N, HV, T.ceildiv(V, BV), threads=threads_for(BV)) as (n, hv, vb):
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
            if with_output:
                qe_s = T.alloc_shared((C, K), dtype)
                a_s = T.alloc_shared((C, C), dtype)
                acc = T.alloc_fragment((C, BV), f32)
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
                if with_output:
                    T.copy(q_e[j, hv, 0, 0], qe_s)
                    T.copy(A_qk[j, hv, 0, 0], a_s)
                T.copy(S, S_op)
                if store_h:
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
                    if store_v_new:
                        T.copy(vn_s, u[j, hv, 0, v0])
                if with_output:
                    # the output stage's products, in its order, on the operands it would read back
                    T.gemm(qe_s, S_op, acc, clear_accum=True)
                    T.gemm(a_s, vn_s, acc)
                    start = chunk_starts[j]
                    end = chunk_seq_ends[j]
                    for i, jj in T.Parallel(C, BV):
                        if start + i < end:
                            o[start + i, hv, v0 + jj] = T.cast(acc[i, jj], dtype)
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
