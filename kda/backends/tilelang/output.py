"""Stage 4: the output, in parallel over chunks.

Per chunk ``j`` of value head ``hv`` and block of ``BV`` value columns, with ``q_e``, ``A_qk`` from stage 2
and ``h[j]``, ``v_new[j]`` from stage 3::

    o[j] = q_e[j] @ h[j] + A_qk[j] @ v_new[j]          [C, K] x [K, BV]  +  [C, C] x [C, BV]

both products accumulated in one fp32 fragment (``wgmma`` at chunk 64). Only the chunk's rows inside its
sequence are stored, token-major into ``o [tokens, HV, V]``.

Grid ``(NT, HV, V / BV)``; ``tokens``, ``NT`` and ``HV`` are symbolic.
"""

# No `from __future__ import annotations` here: TileLang evaluates a kernel's annotations, and they name
# the builder's locals (the compile-time sizes and the dynamic lengths).
import functools

import tilelang.language as T

THREADS = 128


@functools.cache
def build(C: int, K: int, V: int, BV: int, dtype: str, vn_dtype: str | None = None):
    vn_dtype = vn_dtype or dtype  # fp32 in training (the state pass keeps v_new for the backward)
    NT, tokens, HV = T.dynamic("NT"), T.dynamic("tokens"), T.dynamic("HV")
    f32 = "float32"

    @T.prim_func
    def output_kernel(
        q_e: T.Tensor((NT, HV, C, K), dtype),
        h: T.Tensor((NT, HV, K, V), dtype),
        A_qk: T.Tensor((NT, HV, C, C), dtype),
        v_new: T.Tensor((NT, HV, C, V), vn_dtype),
        chunk_starts: T.Tensor((NT,), "int32"),
        chunk_seq_ends: T.Tensor((NT,), "int32"),
        o: T.Tensor((tokens, HV, V), dtype),  # out
    ):
        with T.Kernel(NT, HV, T.ceildiv(V, BV), threads=THREADS) as (c, hv, vb):
            start = chunk_starts[c]
            end = chunk_seq_ends[c]
            v0 = vb * BV
            qe_s = T.alloc_shared((C, K), dtype)
            h_s = T.alloc_shared((K, BV), dtype)
            a_s = T.alloc_shared((C, C), dtype)
            vn_s = T.alloc_shared((C, BV), dtype)
            acc = T.alloc_fragment((C, BV), f32)
            T.copy(q_e[c, hv, 0, 0], qe_s)
            T.copy(h[c, hv, 0, v0], h_s)
            T.copy(A_qk[c, hv, 0, 0], a_s)
            if vn_dtype == dtype:
                T.copy(v_new[c, hv, 0, v0], vn_s)
            else:  # rounded to the product's operand dtype on the way in
                for i, j in T.Parallel(C, BV):
                    vn_s[i, j] = T.cast(v_new[c, hv, i, v0 + j], dtype)
            T.gemm(qe_s, h_s, acc, clear_accum=True)
            T.gemm(a_s, vn_s, acc)
            for i, j in T.Parallel(C, BV):
                if start + i < end:
                    o[start + i, hv, v0 + j] = T.cast(acc[i, j], dtype)

    return output_kernel
