"""Check one backend against the float64 reference on one case, and a whole case class.

Pass rule (docs/design.md): for every output and gradient, ``||x - ref||_2 / ||ref||_2 <= tol`` and
``x`` is finite everywhere. The backend is called directly (never through the dispatcher), so a record
always says what that backend computed. Around the call:

- outputs are poisoned: backends that take output buffers get NaN-filled ones, and on CUDA the caching
  allocator is first handed a NaN-filled block, so an element a kernel never writes stays NaN and fails;
- inputs are snapshotted and compared afterwards: a backend that modifies its inputs fails;
- any exception fails the case, with the exception as the reason.
"""

from __future__ import annotations

import contextvars
import math
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Protocol

import torch

from kda.backends.base import Backend, KDAGradients, KDAInputs, KDAOutputs
from kda.reference import kda_reference
from kda.spec import CaseClass, KDASpec
from kda.verify.cases import VerificationCase, cases_for, make_inputs
from kda.verify.judge import assess
from kda.verify.policy import FP32_TOLERANCE, LONG_T, LOW_PRECISION_TOLERANCE, Assessment, tolerance
from kda.verify.records import Record, Source

if TYPE_CHECKING:
    from kda.recurrent.spec import RecurrentCaseClass

__all__ = [
    "FP32_TOLERANCE",
    "LOW_PRECISION_TOLERANCE",
    "CaseResult",
    "ClassResult",
    "is_verifying",
    "relative_error",
    "run_case",
    "tolerance",
    "verify_class",
]

GRADIENT_OF = {
    "dq": "q",
    "dk": "k",
    "dv": "v",
    "dg": "g",
    "dbeta": "beta",
    "dA_log": "A_log",
    "ddt_bias": "dt_bias",
    "dinitial_state": "initial_state",
}


_verifying: contextvars.ContextVar[bool] = contextvars.ContextVar("kda_verifying", default=False)


def is_verifying() -> bool:
    """True while a verification case runs: lets a test's spy tell the verifier's calls from real ones
    (backends never ask: they get `Backend.verification_scope` instead)."""
    return _verifying.get()


def relative_error(x: torch.Tensor, ref: torch.Tensor) -> float:
    """``||x - ref|| / ||ref||`` in float64; inf when x has a NaN or inf (NaN never passes)."""
    x64 = x.detach().to(ref.device, torch.float64)
    if x64.shape != ref.shape:
        return math.inf
    if not torch.isfinite(x64).all():
        return math.inf
    denom = ref.norm().item()
    num = (x64 - ref).norm().item()
    return num / denom if denom > 0 else num


@dataclass
class CaseResult:
    case: VerificationCase
    passed: bool
    errors: dict[str, float] = field(default_factory=dict)  # tensor -> relative L2 error
    ratios: dict[str, float] = field(default_factory=dict)  # tensor -> error / tolerance
    reason: str | None = None
    seconds: float = 0.0
    unsupported: bool = False
    problems: list[str] = field(default_factory=list)  # failures other than accuracy (raised, wrong dtype, ...)

    @property
    def worst_ratio(self) -> float:
        """Largest error / tolerance; inf when the backend raised before producing anything."""
        if not self.ratios:
            return 0.0 if self.passed or self.unsupported else math.inf
        return max(self.ratios.values())

    def as_json(self) -> dict[str, Any]:
        return {
            **self.case.describe(),
            "passed": self.passed,
            "unsupported": self.unsupported,
            "errors": self.errors,
            "problems": self.problems,
            "reason": self.reason,
            "seconds": round(self.seconds, 4),
        }


def _reference(
    kwargs: dict[str, Any], upstream: dict[str, torch.Tensor], training: bool, where: torch.device | str = "cpu"
):
    """float64 outputs and (when training) gradients of the reference, on `where` (the CPU, but for the
    long case on CUDA: its token-by-token float64 recurrence takes minutes on a CPU, well under a second
    on a GPU, and stays the same plain float64 arithmetic)."""
    leaves = {}
    ref_kwargs = {}
    for name, value in kwargs.items():
        if name in ("cu_seqlens_cpu", "use_graph"):  # the recurrence reads cu_seqlens only
            continue
        if isinstance(value, torch.Tensor) and name != "cu_seqlens":
            value = value.detach().to(where, torch.float64)
            if training:
                value.requires_grad_(True)
                leaves[name] = value
        elif isinstance(value, torch.Tensor):
            value = value.to(where)
        ref_kwargs[name] = value
    with torch.enable_grad():
        o, state, *per_chunk = kda_reference(**ref_kwargs)
    outputs = {"o": o.detach(), "final_state": None if state is None else state.detach()}
    if per_chunk:
        outputs["intermediate_states"] = per_chunk[0].detach()
    grads: dict[str, torch.Tensor] = {}
    if training:
        targets, seeds = [o], [upstream["do"].to(where, torch.float64)]
        if state is not None:
            targets.append(state)
            seeds.append(upstream["dfinal_state"].to(where, torch.float64))
        found = torch.autograd.grad(targets, list(leaves.values()), seeds, allow_unused=True)
        by_input = dict(zip(leaves.keys(), found))
        for grad_name, input_name in GRADIENT_OF.items():
            if input_name in by_input:
                grad = by_input[input_name]
                grads[grad_name] = torch.zeros_like(leaves[input_name]) if grad is None else grad
    return outputs, grads


def _poison_allocator(device: torch.device, sizes: list[int]) -> None:
    """Leave NaN-filled blocks of the outputs' sizes (in bytes) in CUDA's caching allocator, so that an
    output a kernel allocates with `torch.empty` starts as NaN rather than as whatever an earlier tensor
    left there (the allocator hands a freed block of the right size back first)."""
    if device.type != "cuda":
        return
    blocks = [
        torch.full((max(1, n // 4),), float("nan"), dtype=torch.float32, device=device) for n in sizes for _ in range(2)
    ]
    del blocks


def run_case(backend: Backend, case: VerificationCase, device: torch.device | str) -> CaseResult:
    """Verify `backend` on one case (see the module docstring for what passing means)."""
    device = torch.device(device)
    token = _verifying.set(True)
    try:
        # The verdict must not depend on the caller's context (a lazy check can run inside their autocast).
        with torch.autocast(device.type, enabled=False), backend.verification_scope():
            return _run_case(backend, case, device)
    finally:
        _verifying.reset(token)


def _run_case(backend: Backend, case: VerificationCase, device: torch.device) -> CaseResult:
    started = time.perf_counter()
    cc = case.case_class
    kwargs, upstream = make_inputs(case, device)
    spec = KDASpec.from_call(**kwargs, requires_grad=cc.training)
    if cc.training and not backend.trains:  # the dispatcher never gives it such a call: nothing to verify
        return CaseResult(
            case, passed=False, unsupported=True, reason="forward-only backend; the class needs gradients"
        )
    try:
        verdict = backend.supports(spec)
    except KeyboardInterrupt:
        raise
    except BaseException as error:  # sys.exit in a plugin included: the case fails, the caller goes on
        reason = f"supports() raised {type(error).__name__}: {error}"
        return CaseResult(case, passed=False, reason=reason, problems=[reason])
    if not verdict:
        return CaseResult(case, passed=False, unsupported=True, reason="; ".join(verdict.reasons))

    long = case.T >= LONG_T and device.type == "cuda"
    ref_out, ref_grads = _reference(kwargs, upstream, cc.training, device if long else "cpu")
    fields: dict[str, Any] = {n: kwargs.get(n) for n in KDAInputs.__dataclass_fields__ if n in kwargs}
    inputs = KDAInputs(**fields)
    # What the backend is handed and must leave alone: the inputs, and the upstream gradients of backward.
    handed = {**{n: t for n, t in kwargs.items() if isinstance(t, torch.Tensor)}, **upstream}
    snapshot = {name: (t.clone(), t._version) for name, t in handed.items()}
    result = CaseResult(case, passed=False)
    try:
        out = None
        if backend.writes_into_outputs:
            out = KDAOutputs(
                o=torch.full((spec.B, spec.T, spec.HV, spec.V), float("nan"), dtype=spec.dtype, device=device),
                final_state=(
                    torch.full(spec.state_shape, float("nan"), dtype=spec.state_dtype, device=device)
                    if spec.output_final_state
                    else None
                ),
            )
        tokens = spec.B * spec.T
        state_bytes = 4 * spec.num_seqs * spec.HV * spec.K * spec.V
        o_bytes = tokens * spec.HV * spec.V * spec.dtype.itemsize
        _poison_allocator(device, [o_bytes, state_bytes])
        with torch.no_grad():
            fwd = backend.forward(inputs, spec, out)
        got = {"o": fwd.o, "final_state": fwd.final_state, "intermediate_states": fwd.intermediate_states}
        result.problems += _output_problems(fwd.o, fwd.final_state, spec)
        if spec.return_intermediate_states:
            result.problems += _intermediate_problems(fwd.intermediate_states, spec, inputs)
        if cc.training:
            _poison_allocator(device, [t.numel() * t.element_size() for t, _ in snapshot.values()])
            grads: KDAGradients = backend.backward(
                inputs, spec, fwd.saved, upstream["do"], upstream.get("dfinal_state")
            )
            for grad_name in ref_grads:
                got[grad_name] = getattr(grads, grad_name)
        if device.type == "cuda":
            torch.cuda.synchronize(device)
    except KeyboardInterrupt:
        raise
    except BaseException as error:  # a backend that raises, or exits, fails verification with it as the reason
        result.reason = f"{type(error).__name__}: {error}"
        result.problems.append(result.reason)
        result.seconds = time.perf_counter() - started
        return result

    expected = {**ref_out, **ref_grads}
    for name, ref in expected.items():
        if ref is None:
            continue
        value = got.get(name)
        err = math.inf if not isinstance(value, torch.Tensor) else relative_error(value, ref)
        result.errors[name] = err
        result.ratios[name] = err / tolerance(name, cc.dtype)
    failing = [
        f"{name} rel. error {result.errors[name]:.2e} > tol {tolerance(name, cc.dtype):.1e}"
        for name, ratio in result.ratios.items()
        if not ratio <= 1.0
    ]
    # Compared bit for bit, and by version counter: writing a tensor and restoring it is still a write
    # (autograd and CUDA graphs of the caller see the bumped counter).
    changed = [n for n, (before, _) in snapshot.items() if not _same_bits(before, handed[n])]
    touched = [n for n, (_, version) in snapshot.items() if handed[n]._version != version and n not in changed]
    if changed:
        result.problems.append("modified what it was handed: " + ", ".join(changed))
    if touched:
        result.problems.append("wrote to what it was handed (its version counter moved): " + ", ".join(touched))
    failing += result.problems
    result.passed = not failing
    result.reason = "; ".join(failing) or None
    result.seconds = time.perf_counter() - started
    return result


def _same_bits(before: torch.Tensor, after: torch.Tensor) -> bool:
    """Equal element for element, where a NaN held before and after counts as equal."""
    if before.shape != after.shape or before.dtype != after.dtype:
        return False
    if not before.is_floating_point():
        return bool(torch.equal(before, after))
    nan_before, nan_after = before.isnan(), after.isnan()
    return bool(torch.equal(nan_before, nan_after) and torch.equal(before[~nan_before], after[~nan_after]))


def _output_problems(o: Any, final_state: Any, spec: KDASpec) -> list[str]:
    """Dtype, shape and device of what forward returned (the values are the accuracy check's)."""
    problems = []
    o_shape = (spec.B, spec.T, spec.HV, spec.V)
    if not isinstance(o, torch.Tensor):
        return [f"o is {type(o).__name__}, not a tensor"]
    if o.dtype != spec.dtype or tuple(o.shape) != o_shape or o.device != spec.device:
        problems.append(
            f"o is {tuple(o.shape)} {o.dtype} on {o.device}; expected {o_shape} {spec.dtype} on {spec.device}"
        )
    if spec.output_final_state:
        if not isinstance(final_state, torch.Tensor):
            problems.append("final_state was requested but not returned")
        elif (
            final_state.dtype != spec.state_dtype
            or tuple(final_state.shape) != tuple(spec.state_shape)
            or final_state.device != spec.device
        ):
            problems.append(
                f"final_state is {tuple(final_state.shape)} {final_state.dtype} on {final_state.device}; "
                f"expected {tuple(spec.state_shape)} {spec.state_dtype} on {spec.device}"
            )
    return problems


def _intermediate_problems(per_chunk: Any, spec: KDASpec, inputs: KDAInputs) -> list[str]:
    """Dtype, shape and device of return_intermediate_states' per-chunk states: q's dtype, as FLA's."""
    if not isinstance(per_chunk, torch.Tensor):
        return ["return_intermediate_states was requested but no per-chunk states were returned"]
    shape = spec.intermediate_states_shape(inputs.host_cu_seqlens())
    if per_chunk.dtype != spec.dtype or tuple(per_chunk.shape) != shape or per_chunk.device != spec.device:
        return [
            f"the per-chunk states are {tuple(per_chunk.shape)} {per_chunk.dtype} on {per_chunk.device}; "
            f"expected {shape} {spec.dtype} on {spec.device}"
        ]
    return []


class CaseOutcome(Protocol):
    """What `ClassResult` reads of one case's result: `CaseResult` (a `chunk_kda` case) or the decode op's
    `kda.verify.recurrent.RecurrentCaseResult`."""

    unsupported: bool
    reason: str | None

    @property
    def worst_ratio(self) -> float: ...

    def as_json(self) -> dict[str, Any]: ...


@dataclass
class ClassResult:
    """Every case of one class on one backend, judged as its record will be (`kda.verify.judge.assess`,
    which hands a decode class to its own policy): a `chunk_kda` class, or the decode op's."""

    backend: str
    case_class: CaseClass | RecurrentCaseClass
    cases: Sequence[CaseOutcome]
    device_type: str = "cpu"

    @property
    def unsupported(self) -> bool:
        return all(c.unsupported for c in self.cases)

    def assessment(self) -> Assessment:
        return assess(self.case_class.key, [c.as_json() for c in self.cases], on_cuda=self.device_type == "cuda")

    @property
    def passed(self) -> bool:
        """At least one case ran, every case the backend supports passed, and the cases were enough."""
        return self.assessment().passed

    @property
    def worst_ratio(self) -> float:
        return max((c.worst_ratio for c in self.cases if not c.unsupported), default=0.0)

    @property
    def reason(self) -> str | None:
        if self.unsupported:
            return "unsupported: " + (self.cases[0].reason or "") if self.cases else "no cases"
        return self.assessment().reason

    def to_record(self, source: Source, quick: bool) -> Record:
        return Record(
            case_class=self.case_class.key,
            source=source,
            quick=quick,
            device_type=self.device_type,
            cases=[c.as_json() for c in self.cases],
        )


def verify_class(
    backend: Backend, case_class: CaseClass, device: torch.device | str, *, quick: bool, like: KDASpec | None = None
) -> ClassResult:
    """Run every case of a class. Cases whose concrete sizes the backend does not support are skipped
    (the class is unsupported when all are). On CUDA a forward class also gets its long case."""
    device = torch.device(device)
    long = device.type == "cuda" and not case_class.training
    cases = cases_for(case_class, quick=quick, like=like, long=long)
    results = [run_case(backend, case, device) for case in cases]
    return ClassResult(backend.name, case_class, results, device.type)
