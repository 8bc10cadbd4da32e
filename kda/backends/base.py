"""What a backend is: a class with a name, a version, a capability check that gives reasons, and kernels.

A backend never validates its inputs: it receives a `KDASpec` that already passed every rule of the
contract, and it answers two questions with a `Verdict` (never a bare bool), so that `kda.explain` and
error messages can say why it was or was not used:

- `available()`: can it run on this machine at all (packages import, device and architecture fit)?
- `supports(spec)`: does it implement this particular call (gate mode, dtypes, head dims, ...)?

Then `forward` computes ``(o, final_state)`` and, for backends that train, `backward` computes every
gradient from what `forward` saved. Bump `version` whenever the numbers a backend produces can
change: it is part of the verification fingerprint, so a new version starts unverified. A change to the
backward alone may keep inference calls' records (`forward_version`).

A backend never knows who calls it, with one hook: the verifier (`kda.verify.check`) runs every case of a
backend inside `verification_scope()`, a context manager that does nothing by default. A backend may
override it to change how it runs, never what it computes, while being verified (the `fla` backend pins
FLA's autotuners there, since autotuning dozens of tiny verification shapes costs minutes and buys nothing).
"""

from __future__ import annotations

import abc
import contextlib
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field
from typing import Any, ClassVar

import torch

from kda.recurrent.spec import RecurrentSpec
from kda.spec import KDASpec


@dataclass(frozen=True)
class Verdict:
    """A yes or no with the reasons behind it. Truthy when `ok`."""

    ok: bool
    reasons: tuple[str, ...] = ()

    @classmethod
    def yes(cls, *notes: str) -> Verdict:
        return cls(True, tuple(notes))

    @classmethod
    def no(cls, *reasons: str) -> Verdict:
        if not reasons:
            raise ValueError("a negative verdict needs at least one reason")
        return cls(False, tuple(reasons))

    @classmethod
    def unless(cls, reasons: Iterable[str]) -> Verdict:
        """Yes when `reasons` (the broken requirements) is empty, else no with them."""
        found = tuple(reasons)
        return cls(not found, found)

    def __bool__(self) -> bool:
        return self.ok

    def __str__(self) -> str:
        head = "yes" if self.ok else "no"
        return head + (": " + "; ".join(self.reasons) if self.reasons else "")


@dataclass
class KDAInputs:
    """The tensors of one call, as the caller passed them (never modified by a backend)."""

    q: torch.Tensor  # [B, T, H, K]
    k: torch.Tensor  # [B, T, H, K]
    v: torch.Tensor  # [B, T, HV, V]
    g: torch.Tensor  # [B, T, HV, K]: log decay, or the raw gate input with use_gate_in_kernel
    beta: torch.Tensor  # [B, T, HV]
    A_log: torch.Tensor | None = None  # [HV] fp32
    dt_bias: torch.Tensor | None = None  # [HV*K] or [HV, K] fp32
    initial_state: torch.Tensor | None = None  # [N, HV, K, V] fp32 ([N, HV, V, K] with state_v_first)
    cu_seqlens: torch.Tensor | None = None  # [N+1] int32/int64, on q's device
    cu_seqlens_cpu: torch.Tensor | None = None  # host copy of cu_seqlens, when the caller has one

    DIFFERENTIABLE: ClassVar[tuple[str, ...]] = ("q", "k", "v", "g", "beta", "A_log", "dt_bias", "initial_state")

    def differentiable(self) -> dict[str, torch.Tensor | None]:
        return {name: getattr(self, name) for name in self.DIFFERENTIABLE}

    def host_cu_seqlens(self) -> list[int] | None:
        """The sequence boundaries as Python ints (a device sync when only a device copy exists)."""
        source = self.cu_seqlens_cpu if self.cu_seqlens_cpu is not None else self.cu_seqlens
        return None if source is None else [int(x) for x in source.tolist()]


@dataclass
class KDAOutputs:
    """Output buffers a backend may be asked to write into (see `Backend.writes_into_outputs`)."""

    o: torch.Tensor  # [B, T, HV, V] in q's dtype
    final_state: torch.Tensor | None = None  # the state shape of the spec, fp32


@dataclass
class ForwardResult:
    o: torch.Tensor  # [B, T, HV, V] in q's dtype
    final_state: torch.Tensor | None  # [N, HV, K, V] (or [N, HV, V, K]) fp32, when asked for
    saved: Any = None  # whatever backward needs beyond the inputs (kept on the autograd context)
    # with spec.return_intermediate_states: the state entering each chunk, [B, NT, HV, K, V] (or [..., V, K])
    # in q's dtype (`KDASpec.intermediate_states_shape`)
    intermediate_states: torch.Tensor | None = None


@dataclass
class KDAGradients:
    """Gradients with respect to the inputs as passed: dg is for the raw gate input when the gate is
    applied in kernel, dbeta for the raw logits with the in-kernel sigmoid. None where not computed."""

    dq: torch.Tensor | None = None
    dk: torch.Tensor | None = None
    dv: torch.Tensor | None = None
    dg: torch.Tensor | None = None
    dbeta: torch.Tensor | None = None
    dA_log: torch.Tensor | None = None
    ddt_bias: torch.Tensor | None = None
    dinitial_state: torch.Tensor | None = None

    def as_tuple(self) -> tuple[torch.Tensor | None, ...]:
        return (self.dq, self.dk, self.dv, self.dg, self.dbeta, self.dA_log, self.ddt_bias, self.dinitial_state)


@dataclass
class RecurrentInputs:
    """The tensors of one `fused_recurrent_kda` call (the decode op), as the caller passed them.

    A backend never modifies them, with the documented exceptions: ``initial_state`` (the pool) is written
    at the slots the call names when ``spec.inplace_final_state``, and ``out`` receives ``o``.
    """

    q: torch.Tensor  # [B, T, H, K]
    k: torch.Tensor  # [B, T, H, K]
    v: torch.Tensor  # [B, T, HV, V]
    g: torch.Tensor  # [B, T, HV, K]
    beta: torch.Tensor  # [B, T, HV]
    A_log: torch.Tensor | None = None  # HV values, any shape; fp32/bf16/fp16
    dt_bias: torch.Tensor | None = None  # [HV*K] or [HV, K]
    initial_state: torch.Tensor | None = None  # [N, HV, K, V] fp32, or a pool [num_slots, HV, K, V] (or .., V, K)
    cu_seqlens: torch.Tensor | None = None  # [N+1]
    ssm_state_indices: torch.Tensor | None = None  # [N] or [N, T_max]; negative: a padding row / no write
    num_accepted_tokens: torch.Tensor | None = None  # [N], with [N, T_max] indices
    out: torch.Tensor | None = None  # [B, T, HV, V] in q's dtype: o is written here


@dataclass
class RecurrentResult:
    o: torch.Tensor  # [B, T, HV, V] in q's dtype (the `out` tensor when one was given)
    final_state: torch.Tensor | None  # the pool with inplace_final_state, a new fp32 state, or None


@dataclass
class BackendInfo:
    """Static facts shown by `kda.explain` and the verifier."""

    name: str
    version: str
    priority: int
    trains: bool
    description: str = ""
    extras: dict[str, str] = field(default_factory=dict)
    forward_version: str | None = None  # where it stands apart from `version` (`Backend.forward_version`)


class Backend(abc.ABC):
    """Base class of every KDA backend. Subclass it, then `kda.register_backend(MyBackend)`.

    Class attributes:
        name: unique registry name (``backend="name"`` selects it).
        version: bump when the numbers can change; part of the verification fingerprint.
        forward_version: the version of what an inference call runs (the forward without gradients, and
            the decode op), where a change moved the backward alone: set it to the version before the
            change, and inference calls keep their verification records and timings, while training calls
            (which run the forward too) are verified again under `version`. None (the default): `version`
            covers both. When the forward's numbers can change, bump `version` and set this back to None.
        priority: static rank for ``auto`` when no timing decides (higher first). torch is 0.
        trains: whether `backward` is implemented; forward-only backends serve only calls that need no
            gradient.
        writes_into_outputs: whether `forward` honours ``out=`` buffers; the verifier then passes NaN-filled
            buffers, so that an element the kernel forgets to write fails verification.
        saves_for_backward: whether `backward` reads what `forward` saved. Under ``torch.compile`` the
            backward runs in an op of its own that cannot receive it, and re-runs `forward` to get it back
            (`kda.library`); a backend whose `backward` ignores ``saved`` sets False and spares that.
    """

    name: ClassVar[str]
    version: ClassVar[str] = "0"
    forward_version: ClassVar[str | None] = None
    priority: ClassVar[int] = 0
    trains: ClassVar[bool] = False
    writes_into_outputs: ClassVar[bool] = False
    saves_for_backward: ClassVar[bool] = True
    description: ClassVar[str] = ""

    def available(self) -> Verdict:
        """Can this backend run here at all? Called once per process and cached by the registry."""
        return Verdict.yes()

    @abc.abstractmethod
    def supports(self, spec: KDASpec) -> Verdict:
        """Does this backend implement this call? List every requirement the spec breaks."""

    @abc.abstractmethod
    def forward(self, inputs: KDAInputs, spec: KDASpec, out: KDAOutputs | None = None) -> ForwardResult:
        """Compute ``o`` and, when ``spec.output_final_state``, the final state."""

    def backward(
        self,
        inputs: KDAInputs,
        spec: KDASpec,
        saved: Any,
        do: torch.Tensor,
        dfinal_state: torch.Tensor | None,
    ) -> KDAGradients:
        """Every gradient, given ``do = dL/do`` and ``dfinal_state = dL/dS_T`` (None when unused)."""
        raise NotImplementedError(f"backend {self.name!r} is forward-only")

    # ------------------------------------------------------------------ the decode op (fused_recurrent_kda)
    def supports_recurrent(self, spec: RecurrentSpec) -> Verdict:
        """Does this backend implement this decode call? By default no: a backend written before the op
        existed keeps working for `chunk_kda` and is simply not offered the decode op."""
        return Verdict.no("does not implement the decode op (fused_recurrent_kda)")

    def recurrent_forward(self, inputs: RecurrentInputs, spec: RecurrentSpec) -> RecurrentResult:
        """Compute the decode op: ``o`` (into ``inputs.out`` when given) and the state as the spec asks
        (docs/design.md, "The decode op"). Only called where `supports_recurrent` said yes."""
        raise NotImplementedError(f"backend {self.name!r} does not implement the decode op")

    def version_for(self, training: bool) -> str:
        """The version that a call's verification records and timings are kept under: `version` for a
        training call, `forward_version` (when set) for an inference or decode call."""
        if training or self.forward_version is None:
            return str(self.version)
        return str(self.forward_version)

    def fingerprint_extras(self) -> dict[str, str]:
        """Anything beyond the standard fingerprint that can change this backend's numbers."""
        return {}

    @contextlib.contextmanager
    def verification_scope(self) -> Iterator[None]:
        """Entered by the verifier around each case it runs on this backend; does nothing by default.

        Override it to run differently while verified (say, skip autotuning); the numbers must not change.
        """
        yield

    def info(self) -> BackendInfo:
        return BackendInfo(
            self.name,
            self.version,
            self.priority,
            self.trains,
            self.description,
            self.fingerprint_extras(),
            self.forward_version,
        )

    def version_label(self) -> str:
        """``v17``, or ``v17 (forward v16)`` where inference runs an earlier version's kernels."""
        forward = self.version_for(training=False)
        return f"v{self.version}" + (f" (forward v{forward})" if forward != str(self.version) else "")

    def __repr__(self) -> str:
        return f"<{type(self).__name__} {self.name!r} {self.version_label()}>"
