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


def log_decay(x, bias, A, gate: int, lower_bound: float):
    """``a_t`` of one raw gate element ``x`` before the floor (fp32; ``bias`` its ``dt_bias`` or None,
    ``A = exp(A_log[hv])``), as an expression. The backward's `tails` evaluates the same expression, so that
    its floor comparison decides exactly as the forward's did."""
    if gate == PREGATED:
        return x
    if bias is not None:
        x = x + bias
    if gate == SOFTPLUS:  # log(1 + e^x) without overflow (torch's threshold, 20)
        return -A * T.if_then_else(x > 20.0, x, T.log1p(T.exp(T.min(x, 20.0))))
    return lower_bound * T.sigmoid(A * x)


def activation(x, bias, A, gate: int, lower_bound: float):
    """``a_t`` of one raw gate element ``x``: `log_decay` with the floor, as an expression. The caller's load
    loop evaluates it as each element arrives, before the block's first barrier, so that the gate's loads
    are in flight together with the chunk's other loads."""
    x = log_decay(x, bias, A, gate, lower_bound)
    if gate != SAFE:
        x = T.if_then_else(x < LOG_DECAY_FLOOR, LOG_DECAY_FLOOR, x)
    return x


def scan(C: int, K: int, threads: int, beta_sigmoid: bool, beta_scale: float):
    """The macro that turns ``G_s [C, K]`` (fp32, shared; ``a_t`` on entry, `activation`) into its in-chunk
    cumulative sum, and fills ``b_s [C]`` (fp32, shared) for chunk ``c`` of head ``hv``."""
    f32 = "float32"

    @T.macro
    def scan_and_beta(beta, hv, start, end, G_s, b_s):
        # the sum down each key column, in place in shared memory, ROWS rows a block. Each column belongs to
        # exactly one thread, named by its index: a parallel loop over K < threads gave a column to two
        # threads, and a column's read-modify-write then raced with itself
        thread = T.get_thread_binding()
        carry = T.alloc_local((1,), f32)  # G at the row before the block
        block = T.alloc_local((1,), f32)  # the running sum inside the block
        for turn in T.serial((K + threads - 1) // threads):
            col = thread + turn * threads
            if col < K:
                carry[0] = 0.0
                for b in T.serial(C // ROWS):
                    block[0] = 0.0
                    for r in T.unroll(ROWS):
                        block[0] += G_s[b * ROWS + r, col]
                        G_s[b * ROWS + r, col] = carry[0] + block[0]
                    carry[0] += block[0]
        for i in T.Parallel(C):
            ok = start + i < end
            b_i = T.if_then_else(ok, T.cast(beta[start + i, hv], f32), 0.0)
            if beta_sigmoid:
                b_i = T.if_then_else(ok, T.sigmoid(b_i) * beta_scale, 0.0)
            b_s[i] = b_i

    return scan_and_beta
