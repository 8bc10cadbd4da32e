"""Stage 1: the gate activation fused with the in-chunk cumulative sum.

Per value head ``hv`` and chunk, with ``x = g + dt_bias[hv]``::

    pregated   a_t = g_t                                       (already a log decay)
    softplus   a_t = -exp(A_log[hv]) * softplus(x_t)
    sigmoid    a_t = lower_bound * sigmoid(exp(A_log[hv]) * x_t)   (exp(A_log) = 1 without A_log; any bound <= 0)
    safe       the same, with -5 <= lower_bound < 0 promised

    G_t = sum_{s <= t, s in chunk} max(a_s, LOG_DECAY_FLOOR)     (fp32; non-increasing in t, G <= 0)

The floor (`kda.reference.LOG_DECAY_FLOOR`, -32; all but the safe gate, which stays above -5)
makes a log decay of -1e30 or -inf a reset to within fp32's resolution (exp(-32) ~ 1.3e-14) and keeps ``G``
within 64 * 32: an fp32 ``G`` at -1e6 (ulp 0.06) lost the other tokens' decays (1.2e-2 off the float64
reference), one at -inf made ``G_i - G_j`` NaN. It is a ``where``, not a ``max``, so that a NaN stays NaN.

Grid ``(NT, HV, K / BK)``: the sum runs down each column on its own, so a program takes ``BK`` columns
(a whole ``[C, K]`` tile took 196 registers a thread at K = 128, which left one program per SM scheduler),
loads the chunk's gate inputs once and writes ``G`` once.

The sum is formed 16 rows at a time, each sub-chunk's scan added to the carried sum before it (``G`` at
the sub-chunk's row before). One scan over the whole chunk rounds at the magnitude of ``G`` at every level
of the scan tree; here the in-sub-chunk partial sums stay small and only the carry's addition rounds at
that magnitude. With a saturated softplus gate (``G`` down to -950 in a chunk of 64, ulp 6e-5) that took
``dA_log`` from 6.5e-3 to 2.2e-4 of the float64 reference (fp32 tolerance 1e-3; `tests/backends/triton/test_triton_backend.py`).
"""

from __future__ import annotations

import triton
import triton.language as tl

from kda.reference import LOG_DECAY_FLOOR

PREGATED, SOFTPLUS, SAFE, SIGMOID = 0, 1, 2, 3  # values of GATE (host side)
_PREGATED = tl.constexpr(PREGATED)  # the same, readable inside kernels
_SOFTPLUS = tl.constexpr(SOFTPLUS)
_SAFE = tl.constexpr(SAFE)
FLOOR = tl.constexpr(LOG_DECAY_FLOOR)  # the floor, readable inside kernels (`tails` uses it too)


@triton.jit
def gate_cumsum_kernel(
    g,  # [tokens, HV, K] raw gate input (any float dtype)
    A_log,  # [HV] fp32 (or a dummy pointer)
    dt_bias,  # [HV * K] fp32 (or a dummy pointer)
    G,  # [tokens, HV, K] fp32 out: in-chunk cumulative log decay
    chunk_starts,  # [NT] int32
    chunk_seq_ends,  # [NT] int32
    lower_bound,
    HV: tl.constexpr,
    K: tl.constexpr,
    GATE: tl.constexpr,
    HAS_A_LOG: tl.constexpr,
    HAS_DT_BIAS: tl.constexpr,
    BT: tl.constexpr,
    BK: tl.constexpr,
    BC: tl.constexpr,  # rows per scan (16): the chunk's sum is carried from one to the next
):
    i_c, i_hv, i_k = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    start = tl.load(chunk_starts + i_c)
    end = tl.minimum(tl.load(chunk_seq_ends + i_c), start + BT)
    cols = i_k * BK + tl.arange(0, BK)
    sub = tl.arange(0, BC)
    carry = tl.zeros([BK], dtype=tl.float32)  # G at the row before the sub-chunk
    bias = tl.zeros([BK], dtype=tl.float32)
    if HAS_DT_BIAS:
        bias = tl.load(dt_bias + i_hv * K + cols, mask=cols < K, other=0.0)
    a = 1.0
    if HAS_A_LOG:
        a = tl.exp(tl.load(A_log + i_hv))
    for I in tl.static_range(BT // BC):
        rows = start + I * BC + sub
        mask = (rows[:, None] < end) & (cols[None, :] < K)
        offsets = rows[:, None].to(tl.int64) * (HV * K) + i_hv * K + cols[None, :]
        x = tl.load(g + offsets, mask=mask, other=0.0).to(tl.float32)
        if GATE != _PREGATED:
            if HAS_DT_BIAS:
                x += bias[None, :]
            if GATE == _SOFTPLUS:
                # softplus(x) = log(1 + e^x), computed without overflow for large x
                x = -a * tl.where(x > 20.0, x, tl.log(1.0 + tl.exp(tl.minimum(x, 20.0))))
            else:  # the sigmoid and safe gates
                x = lower_bound * tl.sigmoid(a * x)
        if GATE != _SAFE:
            x = tl.where(x < FLOOR, FLOOR, x)  # see the module docstring
        G_sub = carry[None, :] + tl.cumsum(tl.where(mask, x, 0.0), axis=0)
        tl.store(G + offsets, G_sub, mask=mask)
        carry = tl.sum(tl.where((sub == BC - 1)[:, None], G_sub, 0.0), axis=0)  # the last row (flat past the end)
