"""Stage 1, inside `intra`: the gate and beta activations, with the in-chunk cumulative sum of the gate.

Per value head ``hv`` and chunk, with ``x = g + dt_bias[hv]`` and ``A = exp(A_log[hv])`` (1 without ``A_log``)::

    pregated   a_t = g_t                                   (already a log decay)
    softplus   a_t = -A softplus(x_t)
    sigmoid    a_t = lower_bound sigmoid(A x_t)           (the safe gate too: it only promises -5 <= bound < 0)
    G_t = sum_{s <= t, s in chunk} max(a_s, LOG_DECAY_FLOOR)          fp32, non-increasing in t
    beta_t = beta_t, sigmoid(beta_t) or 2 sigmoid(beta_t)              fp32

Expanded at the start of the `intra` kernel: ``G`` and ``beta`` go to its shared memory and never to
global memory (as a kernel of its own, writing ``G [NT, HV, C, K]`` in fp32 and reading it back
moved 64 KB per chunk and head at K = 128, a quarter of the forward's bytes). Only ``G``'s last row leaves,
for the state pass.

The floor (`kda.reference.LOG_DECAY_FLOOR`; not on the safe gate, which stays above -5) keeps a NaN a NaN:
it is a comparison that keeps ``a`` unless ``a < floor`` (CUDA's ``max`` returns the other operand of a NaN).

Two passes. The activation (`activation`) is elementwise, so it runs in parallel over the whole ``[C, K]``
tile as ``g`` arrives, beside the loads of the chunk's ``q``, ``k`` and ``v`` (every load of the block is
issued before its first barrier), into ``G_s``. The sum (`scan`) then runs down each key column in shared memory: each thread
owns one column and walks the chunk's rows in order (a walk that loaded each row from global memory in turn
waited out one memory latency per row). The sum runs 16 rows at a time, each
block's running sum added to the carry from the blocks before, so only the carry rounds at the magnitude of
``G`` (a single running sum would round there at every row; ``dA_log`` of saturated softplus gates showed
the difference in the other backends). Rows past the sequence's end hold ``G`` flat at the last token's
value and ``beta = 0``, so a tail row adds nothing downstream.
"""

# No `from __future__ import annotations` here: TileLang evaluates a kernel's annotations, and they name
# the builder's locals (the compile-time sizes and the dynamic lengths).
import tilelang.language as T

from kda.reference import LOG_DECAY_FLOOR

PREGATED, SOFTPLUS, SIGMOID, SAFE = 0, 1, 2, 3  # values of `gate`
ROWS = 16  # rows per summation block
LOG2_E = 1.4426950408889634


def exp(x):
    """``e^x`` in fp32 as ``2^(x log2 e)``: one ``ex2.approx`` of the special-function unit, as Triton's
    ``tl.exp`` computes it (relative error about ``|x| 2^-23``; CUDA's accurate ``expf`` took ten
    instructions more, and the fast ``__expf`` intrinsic cost the loops their vector width)."""
    return T.exp2(x * LOG2_E)


def sigmoid(x):
    """``1 / (1 + e^-x)`` with `exp` (0 and 1 at the extremes, NaN stays NaN). The division stays IEEE:
    TileLang's approximate reciprocal is scalar-only, and it cost the gate's loads their vector width."""
    return 1.0 / (1.0 + exp(-x))


def log_decay(x, bias, A, gate: int, lower_bound: float):
    """``a_t`` of one raw gate element ``x`` before the floor (fp32; ``bias`` its ``dt_bias`` or None,
    ``A = exp(A_log[hv])``), as an expression. The backward's `tails` evaluates the same expression, so that
    its floor comparison decides exactly as the forward's did."""
    if gate == PREGATED:
        return x
    if bias is not None:
        x = x + bias
    if gate == SOFTPLUS:  # log(1 + e^x) without overflow (torch's threshold, 20)
        return -A * T.if_then_else(x > 20.0, x, T.log1p(exp(T.min(x, 20.0))))
    return lower_bound * sigmoid(A * x)


def activation(x, bias, A, gate: int, lower_bound: float):
    """``a_t`` of one raw gate element ``x``: `log_decay` with the floor, as an expression. The caller's load
    loop evaluates it as each element arrives, before the block's first barrier, so that the gate's loads
    are in flight together with the chunk's other loads."""
    x = log_decay(x, bias, A, gate, lower_bound)
    if gate != SAFE:
        x = T.if_then_else(x < LOG_DECAY_FLOOR, LOG_DECAY_FLOOR, x)
    return x


def scan(C: int, K: int, threads: int, beta_sigmoid: bool, beta_scale: float, limit: float | None = None):
    """The macro that turns ``G_s [C, K]`` (fp32, shared; ``a_t`` on entry, `activation`) into its in-chunk
    cumulative sum, and fills ``b_s [C]`` (fp32, shared) for chunk ``c`` of head ``hv``.

    With a `limit` it also flags each block of ROWS rows whose span, ``max |G_i - G_first|`` over its rows
    and the key columns, passes it: ``wide [C / ROWS]`` (int32, shared, zeroed by the caller before the
    block's first barrier) gets a 1 there. `intra`'s strips are these blocks, and a flagged strip takes its
    diagonal block exactly. The column's thread sees each ``G`` as it writes it, so the span costs a
    subtraction and a max a row instead of a reduction over the block's threads with its barriers."""
    f32 = "float32"

    @T.macro
    def scan_and_beta(beta, hv, start, end, G_s, b_s, wide):
        # the sum down each key column, in place in shared memory, ROWS rows a block. Each column belongs to
        # exactly one thread, named by its index: a parallel loop over K < threads gave a column to two
        # threads, and a column's read-modify-write then raced with itself
        thread = T.get_thread_binding()
        carry = T.alloc_local((1,), f32)  # G at the row before the block
        block = T.alloc_local((1,), f32)  # the running sum inside the block
        first = T.alloc_local((1,), f32)  # G at the block's first row
        gap = T.alloc_local((1,), f32)  # the block's largest |G_i - G_first| in this column so far
        for turn in T.serial((K + threads - 1) // threads):
            col = thread + turn * threads
            if col < K:
                carry[0] = 0.0
                for b in T.serial(C // ROWS):
                    block[0] = 0.0
                    if limit is not None:
                        first[0] = carry[0] + G_s[b * ROWS, col]
                        gap[0] = 0.0
                    for r in T.unroll(ROWS):
                        block[0] += G_s[b * ROWS + r, col]
                        G_s[b * ROWS + r, col] = carry[0] + block[0]
                        if limit is not None:
                            gap[0] = T.max(gap[0], T.abs(carry[0] + block[0] - first[0]))
                    if limit is not None:  # noqa: SIM102 (a compile-time switch around a run-time test)
                        if gap[0] > limit:  # every writer writes the same 1: their order does not matter
                            wide[b] = 1
                    carry[0] += block[0]
        for i in T.Parallel(C):
            ok = start + i < end
            b_i = T.if_then_else(ok, T.cast(beta[start + i, hv], f32), 0.0)
            if beta_sigmoid:
                b_i = T.if_then_else(ok, T.sigmoid(b_i) * beta_scale, 0.0)
            b_s[i] = b_i

    return scan_and_beta
