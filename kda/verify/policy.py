"""The accuracy policy: the tolerances in force, and whether a stored record meets them.

A case passes when every output and gradient satisfies ``||x - ref||_2 / ||ref||_2 <= tol`` and is finite
everywhere (docs/design.md, "Accuracy policy"). Tolerances, relative L2, for bf16/fp16 inputs:

    o, final_state          8e-3      dg, dbeta            2e-2
    dq, dk, dv, dh0         8e-3      dA_log, ddt_bias     1e-2

and 1e-3 for everything with fp32 inputs, 1e-10 with float64 inputs (served by the torch backend in float64,
measured at 1e-15 to 1e-14; see docs/design.md). The per-chunk states of ``return_intermediate_states``
are held to the figure of ``final_state``. ``KDA_TOLERANCE_SCALE`` (0 < s <= 1, default 1) multiplies every
one of them: a user may tighten the policy, never loosen it.

Records keep the errors each case measured, not a verdict (`kda.verify.records`), so `assess_chunk` decides
under the tolerances in force when the record is read: a change of policy, or of the scale, takes
effect without verifying anything again. A record is accepted only when the errors it holds show that
the backend met the policy on cases that could have caught it:

- at least one case ran, and every case that ran has a finite error for each tensor the reference
  produced (the output, the final state when the class returns one, the gradients when it trains);
- one case spans at least four chunks of one sequence with a ragged tail (a backend wrong only past its
  first few chunks, or only on a partial last chunk, fails there);
- one case is of the correlated regime (`kda.verify.cases`), where an inverse summed from the powers of
  ``A_kk`` cancels to garbage though every random case passes;
- on CUDA, a forward class also has its long case (T >= `LONG_T`), where an error that grows with T shows;
- no case recorded a problem other than accuracy (an exception, modified inputs, a wrong dtype or shape).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from kda import config
from kda.spec import CaseClass

LOW_PRECISION_TOLERANCE: dict[str, float] = {
    "o": 8e-3,
    "final_state": 8e-3,
    "intermediate_states": 8e-3,  # the states entering each chunk, returned in q's dtype as FLA does
    "dq": 8e-3,
    "dk": 8e-3,
    "dv": 8e-3,
    "dinitial_state": 8e-3,
    "dg": 2e-2,
    "dbeta": 2e-2,
    "dA_log": 1e-2,
    "ddt_bias": 1e-2,
}
FP32_TOLERANCE = 1e-3
FP64_TOLERANCE = 1e-10

# A class's cases must include one sequence of at least this many chunks, ending in a partial chunk.
MIN_CHUNKS_SPANNED = 4
# On CUDA, each forward class is also checked at one case of at least this many tokens.
LONG_T = 4096

_TRAINING_GRADIENTS = ("dq", "dk", "dv", "dg", "dbeta")


def tolerance(tensor: str, dtype: str) -> float:
    """The tolerance in force for `tensor` (``"o"``, ``"dq"``, ...) with inputs of `dtype` (a torch dtype
    name such as ``"bfloat16"``): the table's figure times ``KDA_TOLERANCE_SCALE``."""
    if dtype == "float64":
        base = FP64_TOLERANCE
    else:
        base = FP32_TOLERANCE if dtype == "float32" else LOW_PRECISION_TOLERANCE[tensor]
    return base * config.tolerance_scale()


def required_tensors(case_class: CaseClass) -> set[str]:
    """What every case of the class must have measured (others, such as ``dA_log``, depend on the case)."""
    needed = {"o"}
    if case_class.final_state:
        needed.add("final_state")
    if case_class.intermediate_states:
        needed.add("intermediate_states")
    if case_class.training:
        needed.update(_TRAINING_GRADIENTS)
    return needed


def spans_enough_chunks(seq_lens: Iterable[int], chunk_size: int) -> bool:
    """Does one sequence cover at least `MIN_CHUNKS_SPANNED` chunks and end in a partial chunk?"""
    return any(n > MIN_CHUNKS_SPANNED * chunk_size and n % chunk_size for n in seq_lens)


@dataclass(frozen=True)
class Assessment:
    """A record judged under the policy in force."""

    passed: bool
    worst_ratio: float  # max over cases and tensors of error / tolerance in force; inf when unknown
    reason: str | None = None  # why it does not pass, in words

    @classmethod
    def fail(cls, reason: str, worst_ratio: float = math.inf) -> Assessment:
        return cls(False, worst_ratio, reason)


def _number(value: Any) -> float | None:
    """A stored error as a float (JSON keeps inf as Infinity), or None when it is not a number."""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return None
    return float(value)


def cases_that_ran(cases: Sequence[Any]) -> list[Mapping[str, Any]] | Assessment:
    """The cases a record holds that the backend ran, or the failed assessment when none did."""
    ran = [case for case in cases if isinstance(case, Mapping) and not case.get("unsupported")]
    if not ran:
        reasons = [c.get("reason") for c in cases if isinstance(c, Mapping) and c.get("reason")]
        return Assessment.fail("no case ran" + (f" ({reasons[0]})" if reasons else ""))
    return ran


def judge_errors(
    ran: Sequence[Mapping[str, Any]], needed: set[str], limit_of: Callable[[str], float | None]
) -> tuple[float, list[str]] | Assessment:
    """Each case's measured errors against ``limit_of(tensor)`` (None: a tensor the policy does not know):
    the worst error / tolerance and every broken requirement, or the failed assessment of a record that
    holds no errors at all. Shared by both ops' policies."""
    worst, problems = 0.0, []
    for case in ran:
        errors = case.get("errors")
        if not isinstance(errors, Mapping):
            return Assessment.fail("a case holds no measured errors")
        missing = sorted(needed - set(errors))
        if missing:  # it raised before producing them, or the record is incomplete
            worst = math.inf
            problems.append(f"no measured error for {', '.join(missing)}")
        for tensor, value in errors.items():
            error = _number(value)
            limit = limit_of(tensor)
            if limit is None or error is None or math.isnan(error):
                problems.append(f"unreadable error for {tensor!r}: {value!r}")
                continue
            worst = max(worst, error / limit)
            if not error <= limit:
                problems.append(f"{tensor} rel. error {error:.2e} > tol {limit:.1e}")
        extra = case.get("problems")
        if not isinstance(extra, list):
            problems.append("a case does not say whether it met problems")
        else:
            problems += [str(p) for p in extra]
    return worst, problems


def assess_chunk(case_class_key: str, cases: Sequence[Mapping[str, Any]], *, on_cuda: bool) -> Assessment:
    """Judge the cases one record of a `chunk_kda` class holds (each as `kda.verify.check.CaseResult.as_json`
    wrote it). The decode op's classes have a policy of their own; `kda.verify.judge.assess` takes either."""
    try:
        case_class = CaseClass.from_key(case_class_key)
    except (ValueError, TypeError):
        return Assessment.fail(f"unknown case class {case_class_key!r}")
    ran = cases_that_ran(cases)
    if isinstance(ran, Assessment):
        return ran

    def limit_of(tensor: str) -> float | None:
        return tolerance(tensor, case_class.dtype) if tensor in LOW_PRECISION_TOLERANCE else None

    judged = judge_errors(ran, required_tensors(case_class), limit_of)
    if isinstance(judged, Assessment):
        return judged
    worst, problems = judged
    lengths = [tuple(c.get("seq_lens") or ()) for c in ran]
    if not any(_is_lengths(s) and spans_enough_chunks(s, case_class.chunk_size) for s in lengths):
        problems.append(f"no case spans {MIN_CHUNKS_SPANNED} chunks of {case_class.chunk_size} with a ragged tail")
    if not any(c.get("regime") == "correlated" for c in ran):
        problems.append("no correlated case (`kda.verify.cases`: keys near one direction, slow decay)")
    if on_cuda and not case_class.training and not any(_number(c.get("T")) and c["T"] >= LONG_T for c in ran):
        problems.append(f"no long case (T >= {LONG_T}) for this forward class on CUDA")
    if problems:
        return Assessment.fail("; ".join(dict.fromkeys(problems)), worst)
    return Assessment(True, worst)


def _is_lengths(value: tuple[Any, ...]) -> bool:
    return all(isinstance(n, int) and not isinstance(n, bool) for n in value)
