"""Backward, the elementwise tails: from the chunked math's gradients back to the inputs as the call gave them.

`build_gate_tail`, per chunk ``c`` and value head ``hv`` (``dG`` of the in-chunk cumulative log decay, ``a``
the activated per-token log decay of `gate.activation`, ``z = g + dt_bias[hv]``, ``A = exp(A_log[hv])``)::

    da_t = sum_{s >= t in chunk} dG_s                         (the reverse cumulative sum, all C rows)
    sigmoid / safe   a = lb sigmoid(A z):    da/dz = lb A s'(A z),   da/dA_log = z da/dz
    softplus         a = -A softplus(z):     da/dz = -A sigmoid(z),  da/dA_log = a
    pre-gated        a = g:                  da/dg = 1
    (all but safe: 0 where a < LOG_DECAY_FLOOR, where the forward used the floor, a constant)
    dg_t        = da_t da/dz                                 [tokens, HV, K] in g's dtype
    ddt_parts   = sum_{t in chunk} dg_t                       [NT, HV, K] fp32 (with dt_bias)
    dA_rows[t]  = sum_k da_t da/dA_log                        [NT, HV, C] fp32 (0 past the end, and pre-gated)
    dbeta_t     = dbeta^_t, or dbeta^_t scale s (1 - s)       (s = sigmoid(beta_t), scale 2 with allow_neg_eigval)

The sum runs over all ``C`` rows, past the end too: there the forward's ``a`` was 0 and ``G`` held the last
token's value, so a tail row's ``dG`` belongs to every valid row above it. The host sums ``ddt_parts`` over
chunks for ``ddt_bias`` and ``dA_rows`` for ``dA_log`` (torch sums: a fixed order, no atomics). ``dg`` leaves
in g's dtype, rounded from the same fp32 value the host rounded before, and ``ddt_bias``'s sum over a chunk's
rows is made here from the fp32 values. Written in fp32 for the host to sum and round, ``dg`` took 12 of the
20 bytes a token, head and key column that this stage and the host moved (now 8 in all; at B1_T8192_H96_D128
the fp32 ``dg`` was 400 MB written, read twice, and written again in bf16).

`build_qk_tail`, per chunk ``c`` and q/k head: the ``group = HV // H`` value heads' ``dx_c`` summed, then
with the l2norm (``x`` the rows as given, ``r`` their ``1 / |x|`` as `intra` formed it, ``x^ = x r`` the
normalized rows the forward used, formed here in fp32 as `intra` formed them)::

    dx = r (dx^ - x^ (x^ . dx^))

Shapes (``tokens`` rows of the flattened batch, ``NT`` chunks of ``C`` rows; all sizes but ``C`` and ``K``
symbolic): ``g [tokens, HV, K]``, ``beta [tokens, HV]``, ``A_log [HV]``, ``dt_bias [HV, K]``,
``dG_c [NT, HV, C, K]``, ``dbeta_c [NT, HV, C]``, ``ddt_parts [NT, HV, K]`` (with dt_bias and an in-kernel
gate; else ``[1]``, unwritten), ``x [tokens, H, K]`` (the inputs' dtype), ``rstd [tokens, H]``,
``dx_c [NT, HV, C, K]``, ``chunk_starts`` / ``chunk_seq_ends [NT]`` int32. Grids ``(NT, HV)`` and ``(NT, H)``.

The gate's reverse sum runs down each key column of ``dG`` in shared memory, one thread a column, 16 rows at
a time from the bottom with a carry (as `gate.scan` does forward): only the carry rounds at the magnitude of
the sum. Everything else is elementwise over the ``[C, K]`` tile in registers, with one row reduction each.
"""

# No `from __future__ import annotations` here: TileLang evaluates a kernel's annotations, and they name
# the builder's locals (the compile-time sizes and the dynamic lengths).
import functools

import tilelang.language as T

from kda.backends.tilelang.gate import PREGATED, ROWS, SAFE, SIGMOID, SOFTPLUS, log_decay
from kda.reference import LOG_DECAY_FLOOR

F32 = "float32"


def threads_for(C: int, K: int) -> int:
    """Threads of a block: 32 elements of the ``[C, K]`` tile a thread (128 to 512 threads). A memory-bound
    kernel wants many warps in flight: at 64 elements a thread `qk_tail` took 149 registers, 78 at 32 (121
    now that the rows wait in registers: still two blocks of 256 an SM)."""
    return max(128, min(512, C * K // 32))


@functools.cache
def build_gate_tail(
    C: int,
    K: int,
    gate_mode: int,
    has_dt_bias: bool,
    beta_sigmoid: bool,
    g_dtype: str,
    beta_dtype: str,
    lower_bound: float,
    beta_scale: float,
):
    tokens, NT, HV = T.dynamic("tokens"), T.dynamic("NT"), T.dynamic("HV")
    threads = threads_for(C, K)
    bias_shape = (HV, K) if has_dt_bias else (1,)
    # dt_bias is an in-kernel gate's (`KDASpec` refuses it pre-gated), and so is its gradient
    parts_shape = (NT, HV, K) if has_dt_bias and gate_mode != PREGATED else (1,)
    blocks = C // ROWS

    @T.prim_func
    def gate_tail_kernel(
        g: T.Tensor((tokens, HV, K), g_dtype),  # the raw gate input
        beta: T.Tensor((tokens, HV), beta_dtype),  # beta as given (before the in-kernel sigmoid)
        A_log: T.Tensor((HV,), F32),  # zeros without A_log: exp(0) = 1
        dt_bias: T.Tensor(bias_shape, F32),
        dG_c: T.Tensor((NT, HV, C, K), F32),
        dbeta_c: T.Tensor((NT, HV, C), F32),  # of the activated beta
        chunk_starts: T.Tensor((NT,), "int32"),
        chunk_seq_ends: T.Tensor((NT,), "int32"),
        dg: T.Tensor((tokens, HV, K), g_dtype),  # out: valid rows
        dbeta: T.Tensor((tokens, HV), beta_dtype),  # out: valid rows
        dA_rows: T.Tensor((NT, HV, C), F32),  # out: every row, 0 past the end
        ddt_parts: T.Tensor(parts_shape, F32),  # out, with dt_bias: the chunk's valid rows of dg summed
    ):
        with T.Kernel(NT, HV, threads=threads) as (c, hv):
            start = chunk_starts[c]
            end = chunk_seq_ends[c]
            da_s = T.alloc_shared((C, K), F32)
            T.copy(dG_c[c, hv, 0, 0], da_s)

            # the reverse sum down each key column, in place. A column belongs to exactly one thread, named
            # by its index: a parallel loop over K < threads would give a column to two threads that race
            thread = T.get_thread_binding()
            carry = T.alloc_local((1,), F32)  # the sum of the rows below the block
            block = T.alloc_local((1,), F32)  # the running sum inside the block, bottom up
            for turn in T.serial((K + threads - 1) // threads):
                col = thread + turn * threads
                if col < K:
                    carry[0] = 0.0
                    for b in T.serial(blocks):
                        block[0] = 0.0
                        for r in T.unroll(ROWS):
                            row = C - 1 - b * ROWS - r
                            block[0] += da_s[row, col]
                            da_s[row, col] = carry[0] + block[0]
                        carry[0] += block[0]

            for i in T.Parallel(C):
                if start + i < end:
                    db = dbeta_c[c, hv, i]
                    if beta_sigmoid:
                        s = T.sigmoid(T.cast(beta[start + i, hv], F32))
                        db = db * (beta_scale * s * (1.0 - s))
                    dbeta[start + i, hv] = T.cast(db, beta_dtype)

            if gate_mode == PREGATED:  # a = g: no A_log, and its rows' part is 0
                for i, j in T.Parallel(C, K):
                    if start + i < end:
                        x = T.cast(g[start + i, hv, j], F32)
                        dg[start + i, hv, j] = T.cast(T.if_then_else(x < LOG_DECAY_FLOOR, 0.0, da_s[i, j]), g_dtype)
                for i in T.Parallel(C):
                    dA_rows[c, hv, i] = 0.0
            else:
                A = T.exp(A_log[hv])
                part = T.alloc_fragment((C, K), F32)  # da da/dA_log, summed over k below
                row_sum = T.alloc_fragment((C,), F32)
                for i, j in T.Parallel(C, K):
                    ok = start + i < end
                    z = T.if_then_else(ok, T.cast(g[start + i, hv, j], F32), 0.0)
                    if has_dt_bias:
                        z = z + dt_bias[hv, j]
                    a = log_decay(z, None, A, gate_mode, lower_bound)  # z has its bias already
                    da = da_s[i, j]
                    if gate_mode == SOFTPLUS:
                        dz = T.if_then_else(a < LOG_DECAY_FLOOR, 0.0, da * (-A * T.sigmoid(z)))
                        part[i, j] = T.if_then_else(a < LOG_DECAY_FLOOR, 0.0, da * a)
                    else:
                        s = T.sigmoid(A * z)
                        dadz = lower_bound * A * s * (1.0 - s)
                        if gate_mode == SIGMOID:  # the safe gate stays above -5: never floored
                            dadz = T.if_then_else(a < LOG_DECAY_FLOOR, 0.0, dadz)
                        dz = da * dadz
                        part[i, j] = dz * z
                    if has_dt_bias:  # da is read: its place keeps the valid rows' dz for the column sums
                        da_s[i, j] = T.if_then_else(ok, dz, 0.0)
                    if ok:
                        dg[start + i, hv, j] = T.cast(dz, g_dtype)
                T.reduce_sum(part, row_sum, dim=1)
                for i in T.Parallel(C):
                    dA_rows[c, hv, i] = T.if_then_else(start + i < end, row_sum[i], 0.0)
                if has_dt_bias:
                    # down each key column, one thread a column in row order (a fragment's sum over rows
                    # would cross all the block's warps: 28 barriers where this takes one)
                    for turn in T.serial((K + threads - 1) // threads):
                        col = thread + turn * threads
                        if col < K:
                            carry[0] = 0.0
                            for r in T.unroll(C):
                                carry[0] += da_s[r, col]
                            ddt_parts[c, hv, col] = carry[0]

    assert gate_mode in (PREGATED, SOFTPLUS, SIGMOID, SAFE), gate_mode
    return gate_tail_kernel


@functools.cache
def build_qk_tail(C: int, K: int, dtype: str, l2norm: bool):
    tokens, NT = T.dynamic("tokens"), T.dynamic("NT")
    H, HV = T.dynamic("H"), T.dynamic("HV")
    group = HV // H
    threads = threads_for(C, K)

    @T.prim_func
    def qk_tail_kernel(
        x: T.Tensor((tokens, H, K), dtype),  # q or k as given (read with the l2norm only)
        rstd: T.Tensor((tokens, H) if l2norm else (1,), F32),
        dx_c: T.Tensor((NT, HV, C, K), F32),  # per value head
        chunk_starts: T.Tensor((NT,), "int32"),
        chunk_seq_ends: T.Tensor((NT,), "int32"),
        dx: T.Tensor((tokens, H, K), dtype),  # out: valid rows
    ):
        with T.Kernel(NT, H, threads=threads) as (c, head):
            start = chunk_starts[c]
            end = chunk_seq_ends[c]
            total = T.alloc_fragment((C, K), F32)
            if l2norm:
                # x^ = x r in registers, in the layout of the sum: its loads go out with dx_c's, no barrier
                # between them (through shared memory the two loads were two memory latencies a block apart)
                rows = T.alloc_fragment((C, K), F32)
                product = T.alloc_fragment((C, K), F32)
                dot = T.alloc_fragment((C,), F32)
                for i, j in T.Parallel(C, K):
                    ok = start + i < end
                    r = T.if_then_else(ok, rstd[start + i, head], 0.0)
                    rows[i, j] = T.if_then_else(ok, T.cast(x[start + i, head, j], F32), 0.0) * r
            T.clear(total)
            for member in T.serial(group):
                for i, j in T.Parallel(C, K):
                    total[i, j] += dx_c[c, head * group + member, i, j]
            if l2norm:
                for i, j in T.Parallel(C, K):
                    product[i, j] = rows[i, j] * total[i, j]
                T.reduce_sum(product, dot, dim=1)
                for i, j in T.Parallel(C, K):
                    ok = start + i < end
                    r = T.if_then_else(ok, rstd[start + i, head], 0.0)
                    total[i, j] = r * (total[i, j] - rows[i, j] * dot[i])
            for i, j in T.Parallel(C, K):
                if start + i < end:
                    dx[start + i, head, j] = T.cast(total[i, j], dtype)

    return qk_tail_kernel
