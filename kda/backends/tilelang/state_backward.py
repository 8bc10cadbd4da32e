"""Backward stage 1: the reverse serial pass over each sequence's chunks.

The forward's state pass is ``S' = exp(G_last) S + k_g^T v_new``, ``v_new = u - w S`` and its output
``o = q_e S + A_qk v_new``. With ``dS`` the gradient of the state LEAVING a chunk (``d final_state`` for a
sequence's last chunk, or 0), per sequence ``n``, value head ``hv`` and block of ``BV`` value columns::

    for each chunk j of the sequence, last to first:
        dh[j]     = dS                                                        [K, BV]
        dv_new[j] = A_qk[j]^T @ do[j] + k_g[j] @ dS                           [C, BV]
        dS        = exp(G_last[j])[:, None] * dS + q_e[j]^T @ do[j] - w[j]^T @ dv_new[j]
    d initial_state[n] = dS

Shapes: ``do [tokens, HV, V]`` token-major in the inputs' dtype (chunk ``j``'s rows are the tokens
``chunk_starts[j] + i``, read as zeros from ``chunk_seq_ends[j]`` on, so a tail chunk's missing rows add
nothing); ``q_e``, ``w``, ``k_g [NT, HV, C, K]`` and ``A_qk [NT, HV, C, C]`` chunk-major in the inputs'
dtype, as the training forward saved them; ``G_last [NT, HV, K]`` fp32. Outputs, fp32 and written whole:
``dh [NT, HV, K, V]``, ``dv_new [NT, HV, C, V]`` (for `chunk_backward`), and ``dh0`` in the state's layout
(``[N, HV, K, V]``, or ``[N, HV, V, K]`` with ``v_first``, read and written transposed like ``dht``).

Precision. ``dS`` and ``dv_new`` are fp32 sums over the whole rest of the sequence; as an operand rounded
once to bf16 (8 significant bits) or taken as TF32 (11) they would carry that error into every earlier
chunk. Each is therefore split into two halves of the inputs' dtype, ``hi = dtype(x)``, ``lo = dtype(x -
hi)`` (16 significant bits with bf16, 22 with fp16), and multiplied as ``x_op @ hi + x_op @ lo`` with fp32
accumulation. The other operand (``k_g``, ``w``) is already exact in the inputs' dtype, so its low half is 0
and two products suffice (the three-term product of `intra` is for two split operands). 16-bit halves are
what ``wgmma`` reads from shared memory. With fp16 the halves share fp16's range: ``|dS|`` past 65504
overflows, as the forward's state operand would (and ``lo`` of values below ~1e-3 loses bits to
subnormals, which only matters relative to the larger entries of the same sum).

Products, one consumer warpgroup (128 threads; TileLang adds a producer warpgroup that issues the copies,
so a block has 256): ``[C, C]^T x [C, BV]`` and ``[C, K] x [K, BV]`` for ``dv_new``
(``wgmma`` at C = 64; at C = 32 its 32 rows are below wgmma's 64 and become ``mma.sync``), and ``[C, K]^T x
[C, BV]`` for ``dS`` (M = K: ``wgmma`` at both chunks); ``w``'s product takes ``-dv_new``'s halves so that
it accumulates onto ``dS``. ``dS [K, BV]`` stays in fp32 registers. The chunk's tiles (``q_e``, ``w``,
``k_g``, ``A_qk``, ``G_last``, ``do``) are loaded a chunk ahead (`T.Pipelined` over the chunks in reverse,
the index an expression of the loop variable) when two stages fit the shared memory (`stages_for`).
At C = 64, K = V = 128: 181248 bytes of shared memory and 168 registers a thread, one block an SM; at
K = 256 (one stage) 197632 bytes and 255 registers, without spills.

Grid ``(N, HV, V / BV)``; ``tokens``, ``NT``, ``N`` and ``HV`` are symbolic. `block_v` is the ``BV`` chosen.
"""

# (the tensor annotations are calls, `T.Tensor((NT, K), dtype)`, which TileLang evaluates and mypy cannot
# read as types; pyproject.toml's override for the other kernel modules says the same)
# No `from __future__ import annotations` here: TileLang evaluates a kernel's annotations, and they name
# the builder's locals (the compile-time sizes and the dynamic lengths).
import functools

import tilelang.language as T

THREADS = 128  # one warpgroup: every product here has M = C or M = K >= 32 and N = BV
SHARED_BUDGET = 200 * 1024  # bytes of shared memory a block may take, under the H200's 227 KB with room
BV_MAX = 64


def block_v(K: int, V: int) -> int:
    """The value columns a program takes: 64 (``dS`` is ``K * 64 / 128`` fp32 registers a thread: 128 at
    K = 256), fewer only when V is."""
    return min(BV_MAX, V)


def shared_bytes(C: int, K: int, BV: int, stages: int) -> int:
    """The shared memory the kernel's buffers take (16-bit tiles; ``G_last`` fp32), for `stages_for`."""
    per_chunk = 2 * (3 * C * K + C * C + C * BV) + 4 * K  # q_e, w, k_g, A_qk, do, G_last
    halves = 2 * 2 * (K * BV + C * BV)  # dS's and -dv_new's hi and lo
    return stages * per_chunk + halves


def stages_for(C: int, K: int, BV: int) -> int:
    """Two stages (the next chunk's tiles loaded during this chunk's products) when they fit, else one
    (K = 256 at chunk 64: its three [64, 256] key tiles take 96 KB a stage)."""
    return 2 if shared_bytes(C, K, BV, 2) <= SHARED_BUDGET else 1


@functools.cache
def build(C: int, K: int, V: int, BV: int, dtype: str, has_dht: bool, store_dh0: bool, v_first: bool):
    tokens, NT = T.dynamic("tokens"), T.dynamic("NT")
    N, HV = T.dynamic("N"), T.dynamic("HV")
    f32 = "float32"
    state_shape = (N, HV, V, K) if v_first else (N, HV, K, V)
    stages = stages_for(C, K, BV)

    @T.prim_func
    def state_backward_kernel(
        do: T.Tensor((tokens, HV, V), dtype),
        q_e: T.Tensor((NT, HV, C, K), dtype),
        w: T.Tensor((NT, HV, C, K), dtype),
        k_g: T.Tensor((NT, HV, C, K), dtype),
        A_qk: T.Tensor((NT, HV, C, C), dtype),
        G_last: T.Tensor((NT, HV, K), f32),  # each chunk's last row of G
        chunk_starts: T.Tensor((NT,), "int32"),
        chunk_seq_ends: T.Tensor((NT,), "int32"),
        chunk_first: T.Tensor((N,), "int32"),  # sequence n owns chunks [chunk_first[n], chunk_end[n])
        chunk_end: T.Tensor((N,), "int32"),
        dht: T.Tensor(state_shape if has_dht else (1,), f32),
        dh: T.Tensor((NT, HV, K, V), f32),  # out
        dv_new: T.Tensor((NT, HV, C, V), f32),  # out
        dh0: T.Tensor(state_shape if store_dh0 else (1,), f32),  # out
    ):
        with T.Kernel(N, HV, T.ceildiv(V, BV), threads=THREADS) as (n, hv, vb):
            v0 = vb * BV
            dS = T.alloc_fragment((K, BV), f32)
            dS_hi = T.alloc_shared((K, BV), dtype)
            dS_lo = T.alloc_shared((K, BV), dtype)
            q_s = T.alloc_shared((C, K), dtype)
            w_s = T.alloc_shared((C, K), dtype)
            kg_s = T.alloc_shared((C, K), dtype)
            A_s = T.alloc_shared((C, C), dtype)
            do_s = T.alloc_shared((C, BV), dtype)
            decay = T.alloc_shared((K,), f32)
            dvn = T.alloc_fragment((C, BV), f32)
            ndv_hi = T.alloc_shared((C, BV), dtype)  # -dv_new's halves: w's product then adds onto dS
            ndv_lo = T.alloc_shared((C, BV), dtype)
            if has_dht:
                for i, jj in T.Parallel(K, BV):
                    if v_first:
                        dS[i, jj] = dht[n, hv, v0 + jj, i]
                    else:
                        dS[i, jj] = dht[n, hv, i, v0 + jj]
            else:
                T.clear(dS)
            last = chunk_end[n] - 1
            for jc in T.Pipelined(chunk_end[n] - chunk_first[n], num_stages=stages):
                j = last - jc  # the chunks in reverse
                start = chunk_starts[j]
                end = chunk_seq_ends[j]
                T.copy(q_e[j, hv, 0, 0], q_s)
                T.copy(w[j, hv, 0, 0], w_s)
                T.copy(k_g[j, hv, 0, 0], kg_s)
                T.copy(A_qk[j, hv, 0, 0], A_s)
                T.copy(G_last[j, hv, 0], decay)
                for i, jj in T.Parallel(C, BV):
                    do_s[i, jj] = T.if_then_else(start + i < end, do[start + i, hv, v0 + jj], T.cast(0, dtype))
                # stored from the consumers' registers in this loop: a `T.copy(dS, dh[...])` was given to the
                # producer warps with a private, never-updated copy of dS (a 32 KB stack frame a thread)
                for i, jj in T.Parallel(K, BV):
                    dh[j, hv, i, v0 + jj] = dS[i, jj]
                    dS_hi[i, jj] = T.cast(dS[i, jj], dtype)
                    dS_lo[i, jj] = T.cast(dS[i, jj] - T.cast(T.cast(dS[i, jj], dtype), f32), dtype)
                T.gemm(A_s, do_s, dvn, transpose_A=True, clear_accum=True)  # A_qk^T do
                T.gemm(kg_s, dS_hi, dvn)  # + k_g dS, in two halves
                T.gemm(kg_s, dS_lo, dvn)
                T.copy(dvn, dv_new[j, hv, 0, v0])
                for i, jj in T.Parallel(C, BV):
                    ndv_hi[i, jj] = T.cast(-dvn[i, jj], dtype)
                    ndv_lo[i, jj] = T.cast(-dvn[i, jj] - T.cast(T.cast(-dvn[i, jj], dtype), f32), dtype)
                for i, jj in T.Parallel(K, BV):
                    dS[i, jj] = dS[i, jj] * T.exp(decay[i])
                T.gemm(q_s, do_s, dS, transpose_A=True)  # + q_e^T do
                T.gemm(w_s, ndv_hi, dS, transpose_A=True)  # - w^T dv_new, in two halves
                T.gemm(w_s, ndv_lo, dS, transpose_A=True)
            if store_dh0:
                for i, jj in T.Parallel(K, BV):
                    if v_first:
                        dh0[n, hv, v0 + jj, i] = dS[i, jj]
                    else:
                        dh0[n, hv, i, v0 + jj] = dS[i, jj]

    return state_backward_kernel
