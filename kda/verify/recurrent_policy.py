"""The accuracy policy of the decode op (`fused_recurrent_kda`): tolerances, and whether a record meets them.

Outputs ``o`` use the table of `kda.verify.policy` (8e-3 relative L2 for bf16/fp16 inputs, 1e-3 for fp32).
A returned state (``final_state``: a new state, or the slots a pool call wrote) uses the larger of that
figure and the pool's rounding figure: a kernel stores the state in the pool's dtype, so a bf16 pool
is one bf16 rounding away from the exact state however exact the kernel is.

``POOL_ROUNDING_TOLERANCE`` (relative L2 of the written slots, against the exact float64 states):

- bf16: 8e-3. Measured on the torch backend (which rounds once, at the store) with fp32 inputs on the CPU:
  1.6e-3 to 1.7e-3 over the verification cases (docs/design.md, "The decode op"), which is the rounding
  of a bf16 store itself (unit roundoff 2^-8; the exact answer rounded to bf16 is 1.66e-3 from itself,
  the figure section 4 of DESIGN.md gives for bf16 outputs). 8e-3 is the same five-fold margin over that
  floor as the forward outputs' tolerance; a kernel that also kept the state in bf16 between tokens would
  add one rounding per token and fail at a few dozen tokens.
- fp16: 1e-3 (unit roundoff 2^-11: a floor of ~2e-4, times five).
- fp32: no floor of its own (the input dtype's tolerance applies).

A record passes when, besides the errors: every case that ran measured ``o`` (and ``final_state`` where
the class returns one) with no other problem (untouched slots changed, an ``out`` not written, inputs
modified, an exception), and, for a pool class, some case had a padding row (negative slot): a backend
that mishandles padding would otherwise pass unseen.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from kda import config
from kda.recurrent.spec import RecurrentCaseClass
from kda.verify.policy import Assessment, _number, cases_that_ran, judge_errors, tolerance

POOL_ROUNDING_TOLERANCE: dict[str, float] = {"bfloat16": 8e-3, "float16": 1e-3, "float32": 0.0}


def recurrent_tolerance(tensor: str, case_class: RecurrentCaseClass) -> float:
    """The tolerance in force for ``"o"`` or ``"final_state"`` of a decode class (``KDA_TOLERANCE_SCALE``
    included, through `kda.verify.policy.tolerance`)."""
    base = tolerance(tensor, case_class.dtype)
    if tensor == "final_state":
        base = max(base, POOL_ROUNDING_TOLERANCE[case_class.state_dtype] * config.tolerance_scale())
    return base


def required_tensors(case_class: RecurrentCaseClass) -> set[str]:
    return {"o", "final_state"} if case_class.final_state else {"o"}


def assess_recurrent(case_class_key: str, cases: Sequence[Mapping[str, Any]]) -> Assessment:
    """Judge a decode class's stored cases (as `kda.verify.recurrent.RecurrentCaseResult.as_json` wrote them)."""
    try:
        case_class = RecurrentCaseClass.from_key(case_class_key)
    except (ValueError, TypeError):
        return Assessment.fail(f"unknown case class {case_class_key!r}")
    ran = cases_that_ran(cases)
    if isinstance(ran, Assessment):
        return ran

    def limit_of(tensor: str) -> float | None:
        return recurrent_tolerance(tensor, case_class) if tensor in ("o", "final_state") else None

    judged = judge_errors(ran, required_tensors(case_class), limit_of)
    if isinstance(judged, Assessment):
        return judged
    worst, problems = judged
    if case_class.pool != "none" and not any((_number(c.get("padding_rows")) or 0) > 0 for c in ran):
        problems.append("no case of this pool class had a padding row")
    if problems:
        return Assessment.fail("; ".join(dict.fromkeys(problems)), worst)
    return Assessment(True, worst)
