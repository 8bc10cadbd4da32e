"""The limits of the anchored 16-row strips, shared by the backends whose score backward goes through
anchors (helion, tilelang; the triton backend's `DIFFERENCE_STEP` is the step limit).

A strip's diagonal block joins the anchored products when its decay span against either anchor is at most
`SPAN_LIMIT` (``e^80 = 5.5e34``: finite in fp32 and bf16, with room for ``|x|`` up to about 6e3) and its largest
single log decay at most `STEP_LIMIT` (``da`` and ``db`` meet in ``dG`` as a difference whose residual grows
with the factors' exponents, and ``dA_log`` multiplies it by the log decays). Otherwise the block is summed
exactly. Plain Python: the host decides with it; each backend's kernels compare against the same numbers.
"""

from __future__ import annotations

SPAN_LIMIT = 80.0
STEP_LIMIT = 8.0
STRIP = 16  # rows a strip


def bound_keeps_strips_within_limits(lower_bound: float) -> bool:
    """Whether log decays of at most ``|lower_bound|`` a step (the sigmoid and safe gates) keep every strip
    within both limits: a step of at most that, and a span over a strip's 15 steps of at most 15 times it
    (5 and 75 at the safe gate's -5)."""
    bound = abs(lower_bound)
    return (STRIP - 1) * bound <= SPAN_LIMIT and bound <= STEP_LIMIT
