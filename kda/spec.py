"""`KDASpec`: the one validated description of a `chunk_kda` call.

Every rule of the call contract (what `chunk_kda` accepts: shapes, dtypes, devices, gate modes and
their parameters, variable length, the state layout; see "The contract" in `docs/design.md`) is stated
here once, as a check in
`KDASpec._check_contract`. A backend receives a spec that passed, and never re-validates what it
guarantees. The spec holds no tensors: only their shapes, dtypes and devices, the flags, and (when they
are on the host already) the values of `cu_seqlens`, so it is small, immutable and hashable.

Bad input raises `kda.KDAInputError` naming the argument, the rule and the value it got; when several
rules are broken, the first is raised and the others are listed in its message (`error.more`).
"""

from __future__ import annotations

import functools
import math
import operator
from collections.abc import Callable, Sequence
from typing import Any

import torch
from pydantic import BaseModel, ConfigDict, ValidationError, model_validator

from kda.case_class import CaseClass, DtypeName, GateMode, HeadDim, head_dim_bucket
from kda.errors import KDAInputError
from kda.options import (
    COUNTS,
    DIFFERENTIABLE,
    FLAGS,
    NUMBERS,
    OPTIONS,
    REQUIRED,
    TENSORS,
    KDAArguments,
    flags_of,
    options_of,
    tensors_of,
)
from kda.tensor_info import FLOAT_DTYPES, INDEX_DTYPES, CallShapes, TensorInfo, cu_seqlens_violation
from kda.tensor_info import fmt_shape as _fmt_shape

__all__ = [  # the case-class and tensor names are re-exported: `kda.spec` is where callers look for them
    "CHUNK_SIZES",
    "FLOAT_DTYPES",
    "INDEX_DTYPES",
    "MAX_HEAD_DIM",
    "CaseClass",
    "DtypeName",
    "GateMode",
    "HeadDim",
    "KDASpec",
    "TensorInfo",
    "cu_seqlens_violation",
    "head_dim_bucket",
]

# float64 is served by the torch backend alone (exact enough for torch.autograd.gradcheck)
COMPUTE_DTYPES = (*FLOAT_DTYPES, "float64")
CHUNK_SIZES = (32, 64)
MAX_HEAD_DIM = 256
SAFE_LOWER_BOUND_MIN = -5.0
_SPEC_MEMO_LIMIT = 1024


class KDASpec(CallShapes, BaseModel):
    """A validated, immutable description of one `chunk_kda` call.

    Build it from the call's tensors with `KDASpec.from_call(...)` (what `kda.chunk_kda` does), or
    from `TensorInfo`s directly. Construction raises `KDAInputError` on any broken rule.
    """

    model_config = ConfigDict(frozen=True, arbitrary_types_allowed=False)

    q: TensorInfo
    k: TensorInfo
    v: TensorInfo
    g: TensorInfo
    beta: TensorInfo
    A_log: TensorInfo | None = None
    dt_bias: TensorInfo | None = None
    initial_state: TensorInfo | None = None
    cu_seqlens: TensorInfo | None = None
    cu_seqlens_cpu: TensorInfo | None = None
    cu_seqlens_values: tuple[int, ...] | None = None  # host copy when one was available without a sync
    cu_seqlens_values_device: tuple[int, ...] | None = None  # cu_seqlens' own values when it is on the host too

    scale: float
    output_final_state: bool = False
    use_qk_l2norm_in_kernel: bool = False
    use_gate_in_kernel: bool = False
    use_beta_sigmoid_in_kernel: bool = False
    allow_neg_eigval: bool = False
    safe_gate: bool = False
    lower_bound: float | None = None
    state_v_first: bool = False
    chunk_size: int = 64
    requires_grad: bool = False
    disable_recompute: bool = False  # a memory/speed hint for backends; does not change the numbers
    return_intermediate_states: bool = False  # also return the state at the start of every chunk
    use_graph: bool = False  # capturable in a CUDA graph: cu_seqlens' values are read on the device only
    max_num_seqs: int | None = None  # with use_graph: the static number of (padded) sequences

    def __init__(self, **data: Any):
        try:
            super().__init__(**data)
        except ValidationError as error:
            raise _as_input_error(error) from None

    # ------------------------------------------------------------------ building from a call
    @classmethod
    def from_call(cls, *args: Any, requires_grad: bool | None = None, **kwargs: Any) -> KDASpec:
        """Describe a call from `chunk_kda`'s arguments (the fields of `kda.options.KDAArguments`, by
        position or by name; ``backend`` is not one). See `from_args`."""
        return cls.from_args(KDAArguments(*args, **kwargs), requires_grad=requires_grad)

    @classmethod
    def from_args(
        cls, args: KDAArguments, requires_grad: bool | None = None, *, read_host_values: bool = True
    ) -> KDASpec:
        """Describe a call. Reads no tensor data except a host-resident `cu_seqlens` (no device sync).

        `requires_grad` None means: gradients are needed when autograd is on and any differentiable input
        requires them. `read_host_values=False` reads no values at all, as for a device-resident
        `cu_seqlens` (`kda.library` describes calls while `torch.compile` traces them, when tensors have no
        values yet). Raises `KDAInputError` on any broken rule, FLA options kda does not implement first.
        """
        args.check_fla_only()
        tensors: tuple[torch.Tensor | None, ...] = tensors_of(args)
        for name, tensor in zip(TENSORS, tensors):
            if tensor is None and name in REQUIRED:
                raise KDAInputError(name, "is required: a torch.Tensor", "None")
            if tensor is not None and not isinstance(tensor, torch.Tensor):
                raise KDAInputError(name, "must be a torch.Tensor", type(tensor).__name__)
        for name, flag in zip(FLAGS, flags_of(args)):
            if not isinstance(flag, bool):
                raise KDAInputError(name, "must be a bool", repr(flag))
        chunk_size = args.chunk_size
        if isinstance(chunk_size, bool) or not isinstance(chunk_size, int):
            raise KDAInputError("chunk_size", "must be an int, 32 or 64", repr(chunk_size))
        for name in NUMBERS:
            number = getattr(args, name)
            if number is None:
                continue
            if isinstance(number, bool) or not isinstance(number, (int, float)):
                raise KDAInputError(name, "must be a real number (int or float) or None", repr(number))
            try:
                float(number)
            except OverflowError:
                raise KDAInputError(name, "must be a finite number", repr(number)) from None
        for name in COUNTS:
            count = getattr(args, name)
            if count is not None and (isinstance(count, bool) or not isinstance(count, int) or count < 1):
                raise KDAInputError(name, "must be a positive int or None", repr(count))

        # Host values of cu_seqlens, read only when that costs no device sync. When both copies are on
        # the host they must agree (checked in the rules below through `cu_seqlens_values_device`).
        q, cu_seqlens, cu_seqlens_cpu = args.q, args.cu_seqlens, args.cu_seqlens_cpu
        values = other = None
        if read_host_values:
            values = _host_values(cu_seqlens_cpu) if cu_seqlens_cpu is not None else _host_values(cu_seqlens)
            other = _host_values(cu_seqlens) if cu_seqlens_cpu is not None else None

        if requires_grad is None:
            requires_grad = torch.is_grad_enabled() and any(
                t is not None and t.requires_grad for t in _differentiable_of(args)
            )
        requires_grad = bool(requires_grad)
        scale = args.scale
        if scale is None:
            scale = q.shape[-1] ** -0.5 if q.dim() == 4 and q.shape[-1] > 0 else 1.0
        scale = float(scale)

        # A call shaped like an earlier valid one gets that call's spec back without re-running the
        # checks: every rule depends only on what this key holds (the options as given, and the scale
        # they resolve to). Saves ~40 us of the ~100 us per call.
        chosen: tuple[Any, ...] = options_of(args)
        memo_key = (
            tuple(None if t is None else (t.shape, t.dtype, t.device) for t in tensors),
            values,
            other,
            requires_grad,
            scale,
            chosen,
        )
        cached = _spec_memo.get(memo_key)
        if cached is not None:
            return cached
        spec = cls._build(
            dict(zip(TENSORS, tensors)), values, other, {**dict(zip(OPTIONS, chosen)), "scale": scale}, requires_grad
        )
        if len(_spec_memo) >= _SPEC_MEMO_LIMIT:
            _spec_memo.clear()
        _spec_memo[memo_key] = spec
        return spec

    @classmethod
    def _build(
        cls,
        tensors: dict[str, torch.Tensor | None],
        values: tuple[int, ...] | None,
        other: tuple[int, ...] | None,
        options: dict[str, Any],
        requires_grad: bool,
    ) -> KDASpec:
        lower_bound = options["lower_bound"]
        return cls(
            **{name: (None if t is None else TensorInfo.of(t)) for name, t in tensors.items()},
            cu_seqlens_values=values,
            cu_seqlens_values_device=other,
            **{**options, "lower_bound": None if lower_bound is None else float(lower_bound)},
            requires_grad=requires_grad,
        )

    # ------------------------------------------------------------------ the rules
    @model_validator(mode="after")
    def _check_contract(self) -> KDASpec:
        errors: list[KDAInputError] = []

        def rule(argument: str, text: str, got: Any = None) -> None:
            errors.append(KDAInputError(argument, text, got))

        q, k, v, g, beta = self.q, self.k, self.v, self.g, self.beta
        # Shapes of the main tensors; stop early when q or v is not 4-D: every other rule reads them.
        shapes = main_shape_rules(q, k, v, g, beta, rule)
        if shapes is None:
            raise _combined(errors)
        B, T, _, K, HV, V = shapes

        # Dtypes and devices.
        if torch.device(q.device).type == "meta":
            rule("q", "must hold values: kda computes KDA, and a meta tensor has none", q.device)
        if q.dtype not in COMPUTE_DTYPES:
            rule("q", f"dtype must be one of {', '.join(COMPUTE_DTYPES)}", q.dtype)
        for name, info in (("k", k), ("v", v)):
            if info.dtype != q.dtype:  # kda.chunk_kda promotes a v of another float dtype first
                rule(name, f"dtype must match q's ({q.dtype})", info.dtype)
        for name, info in (("g", g), ("beta", beta)):
            if info.dtype not in COMPUTE_DTYPES:
                rule(name, f"dtype must be one of {', '.join(COMPUTE_DTYPES)}", info.dtype)
        for name in ("k", "v", "g", "beta", "A_log", "dt_bias", "initial_state", "cu_seqlens"):
            info = getattr(self, name)
            if info is not None and info.device != q.device:
                rule(name, f"must be on q's device ({q.device})", info.device)

        # Gate modes and their parameters, as FLA 0.6 computes them (see `GateMode`).
        if self.safe_gate and not self.use_gate_in_kernel:
            rule("safe_gate", "safe_gate=True requires use_gate_in_kernel=True", "use_gate_in_kernel=False")
        if self.safe_gate and self.lower_bound is None:
            rule("lower_bound", "safe_gate=True requires a lower_bound with -5 <= lower_bound < 0", "None")
        if self.lower_bound is not None:
            lb = self.lower_bound
            if self.safe_gate and not (SAFE_LOWER_BOUND_MIN <= lb < 0):
                rule("lower_bound", "the safe gate requires -5 <= lower_bound < 0", lb)
            elif not self.use_gate_in_kernel and not self.safe_gate:  # safe_gate's own rule says it then
                rule(
                    "lower_bound",
                    "bounds the in-kernel gate only: pass use_gate_in_kernel=True, or leave it None when g is "
                    "the log decay already (FLA would ignore it)",
                    lb,
                )
            elif lb > 0:
                rule(
                    "lower_bound",
                    "must be <= 0: the gate lower_bound * sigmoid(...) is a log decay, and a positive one "
                    "grows the state without bound",
                    lb,
                )
        if self.use_gate_in_kernel:
            if not self.safe_gate and self.lower_bound is None and self.A_log is None:
                rule(
                    "A_log",
                    "the softplus gate (use_gate_in_kernel=True, lower_bound=None) requires A_log",
                    "None",
                )
            if self.A_log is not None:
                if math.prod(self.A_log.shape) != HV:
                    rule(
                        "A_log",
                        f"must hold HV = {HV} values (shape [HV], or [1, 1, HV, 1] as models store it)",
                        _fmt_shape(self.A_log.shape),
                    )
                if self.A_log.dtype not in COMPUTE_DTYPES:
                    rule("A_log", f"dtype must be one of {', '.join(COMPUTE_DTYPES)}", self.A_log.dtype)
            if self.dt_bias is not None:
                if math.prod(self.dt_bias.shape) != HV * K:
                    rule(
                        "dt_bias",
                        f"must hold HV*K = {HV * K} values ([HV*K] or [HV, K] = [{HV}, {K}])",
                        _fmt_shape(self.dt_bias.shape),
                    )
                if self.dt_bias.dtype not in COMPUTE_DTYPES:
                    rule("dt_bias", f"dtype must be one of {', '.join(COMPUTE_DTYPES)}", self.dt_bias.dtype)
        else:
            for name in ("A_log", "dt_bias"):
                if getattr(self, name) is not None:
                    rule(
                        name,
                        "is used only with use_gate_in_kernel=True (g is taken as the log decay as given; "
                        "FLA would ignore it)",
                        "a tensor",
                    )

        if self.allow_neg_eigval and not self.use_beta_sigmoid_in_kernel:
            rule(
                "allow_neg_eigval",
                "allow_neg_eigval=True requires use_beta_sigmoid_in_kernel=True",
                "use_beta_sigmoid_in_kernel=False",
            )
        if self.chunk_size not in CHUNK_SIZES:
            rule("chunk_size", "must be 32 or 64", self.chunk_size)
        if not math.isfinite(self.scale):
            rule("scale", "must be a finite number", self.scale)

        # Variable length.
        num_seqs = B
        if self.cu_seqlens_cpu is not None and self.cu_seqlens is None:
            rule(
                "cu_seqlens_cpu",
                "is a host copy of cu_seqlens; pass cu_seqlens too (FLA would ignore the boundaries and "
                "compute one dense sequence per batch row)",
                "cu_seqlens=None",
            )
        if self.cu_seqlens is not None:
            cu = self.cu_seqlens
            if B != 1:
                rule("cu_seqlens", "variable-length input must be flattened to B == 1", f"B={B}")
            if cu.dtype not in INDEX_DTYPES:
                rule("cu_seqlens", "dtype must be int32 or int64", cu.dtype)
            if len(cu.shape) != 1 or cu.shape[0] < 2:
                rule("cu_seqlens", "must be 1-D [N+1] with N >= 1 sequences", _fmt_shape(cu.shape))
            else:
                num_seqs = cu.shape[0] - 1
            if self.cu_seqlens_cpu is not None:
                if self.cu_seqlens_cpu.dtype not in INDEX_DTYPES:
                    rule("cu_seqlens_cpu", "dtype must be int32 or int64", self.cu_seqlens_cpu.dtype)
                if self.cu_seqlens_cpu.device != "cpu":
                    rule("cu_seqlens_cpu", "must be on the CPU", self.cu_seqlens_cpu.device)
                if self.cu_seqlens_cpu.shape != cu.shape:
                    rule(
                        "cu_seqlens_cpu",
                        f"must have cu_seqlens' shape {_fmt_shape(cu.shape)}",
                        _fmt_shape(self.cu_seqlens_cpu.shape),
                    )
            if self.cu_seqlens_values is not None and len(cu.shape) == 1:
                broken = cu_seqlens_violation(self.cu_seqlens_values, T)
                if broken is not None:
                    rule("cu_seqlens_cpu" if self.cu_seqlens_cpu is not None else "cu_seqlens", broken)
                elif (
                    self.cu_seqlens_values_device is not None
                    and self.cu_seqlens_values_device != self.cu_seqlens_values
                ):
                    rule(
                        "cu_seqlens_cpu",
                        "must hold the same values as cu_seqlens",
                        f"{list(self.cu_seqlens_values)} vs {list(self.cu_seqlens_values_device)}",
                    )

        # Recurrent state.
        if self.initial_state is not None:
            h0 = self.initial_state
            expected = (num_seqs, HV, V, K) if self.state_v_first else (num_seqs, HV, K, V)
            layout = "[N, HV, V, K] (state_v_first=True)" if self.state_v_first else "[N, HV, K, V]"
            if h0.shape != expected:
                rule(
                    "initial_state",
                    f"must be {layout} = {_fmt_shape(expected)} with N = {num_seqs} sequences",
                    _fmt_shape(h0.shape),
                )
            wanted = "float64" if q.dtype == "float64" else "float32"
            if h0.dtype != wanted:
                rule("initial_state", f"dtype must be {wanted} (the state's precision for {q.dtype} inputs)", h0.dtype)

        # Outputs and modes beyond (o, final_state).
        if self.return_intermediate_states and self.requires_grad:
            rule(
                "return_intermediate_states",
                "returns states outside autograd: call it without gradients (torch.no_grad or "
                "torch.inference_mode, as FLA requires)",
                "a call that needs gradients",
            )
        if self.return_intermediate_states and self.disable_recompute:
            rule("disable_recompute", "must be False with return_intermediate_states (as in FLA)", True)
        if self.max_num_seqs is not None and not self.use_graph:
            rule("max_num_seqs", "is the static sequence count of use_graph=True", self.max_num_seqs)
        if self.use_graph:
            if self.disable_recompute:
                rule("disable_recompute", "must be False with use_graph (as in FLA)", True)
            if self.cu_seqlens is not None and self.max_num_seqs is not None and num_seqs != self.max_num_seqs:
                rule(
                    "max_num_seqs",
                    "must equal the number of sequences in cu_seqlens (pad it with empty sequences)",
                    f"{self.max_num_seqs} for N = {num_seqs}",
                )

        if errors:
            raise _combined(errors)
        return self

    # ------------------------------------------------------------------ derived facts
    @functools.cached_property
    def routing_key(self) -> tuple:
        """Everything that can change which backend serves the call, as plain values (cheap to hash):
        the spec without the host values of `cu_seqlens`, which vary batch to batch but change no
        backend's answer. Computed once per spec."""
        return tuple(self._routing_parts(("cu_seqlens_values", "cu_seqlens_values_device")))

    @property
    def gate_mode(self) -> GateMode:
        if not self.use_gate_in_kernel:
            return GateMode.PREGATED
        if self.safe_gate:
            return GateMode.SAFE
        return GateMode.SOFTPLUS if self.lower_bound is None else GateMode.SIGMOID

    @property
    def state_dtype(self) -> torch.dtype:
        """The dtype of initial_state and final_state: float32 (float64 for float64 inputs)."""
        return torch.float64 if self.q.dtype == "float64" else torch.float32

    def intermediate_states_shape(self, bounds: Sequence[int] | None = None) -> tuple[int, int, int, int, int]:
        """``[B, NT, HV, K, V]`` (``[..., V, K]`` with state_v_first) of return_intermediate_states: NT chunks
        per batch row, or in all of a variable-length batch's sequences (B == 1, `bounds` or the host
        values of cu_seqlens giving them)."""
        C = self.chunk_size
        if self.cu_seqlens is None:
            NT = -(-self.T // C)
        else:
            bounds = bounds if bounds is not None else self.cu_seqlens_values
            assert bounds is not None, "the chunk count of a varlen call needs its boundaries"
            NT = sum(-(-(bounds[i + 1] - bounds[i]) // C) for i in range(len(bounds) - 1))
        tail = (self.V, self.K) if self.state_v_first else (self.K, self.V)
        return (self.B, NT, self.HV, *tail)

    @property
    def device(self) -> torch.device:
        return torch.device(self.q.device)

    @property
    def dtype(self) -> torch.dtype:
        return getattr(torch, self.q.dtype)

    @property
    def state_shape(self) -> tuple[int, int, int, int]:
        """Shape of initial_state / final_state in the call's layout."""
        if self.state_v_first:
            return (self.num_seqs, self.HV, self.V, self.K)
        return (self.num_seqs, self.HV, self.K, self.V)

    @property
    def case_class(self) -> CaseClass:
        has_state = self.initial_state is not None or self.output_final_state
        return CaseClass(
            gate=self.gate_mode,
            qk_l2norm=self.use_qk_l2norm_in_kernel,
            beta=("sigmoid2" if self.allow_neg_eigval else "sigmoid") if self.use_beta_sigmoid_in_kernel else "given",
            dtype=self.q.dtype,  # type: ignore[arg-type]
            varlen=self.is_varlen,
            gva=self.is_gva,
            initial_state=self.initial_state is not None,
            final_state=self.output_final_state,
            state_v_first=self.state_v_first and has_state,
            chunk_size=self.chunk_size,  # type: ignore[arg-type]
            head_dim=head_dim_bucket(max(self.K, self.V)),
            training=self.requires_grad,
            intermediate_states=self.return_intermediate_states,
            graph=self.use_graph and self.is_varlen,
        )

    def summary(self) -> str:
        """One line for logs and reports."""
        shape = f"B{self.B} T{self.T} H{self.H} HV{self.HV} K{self.K} V{self.V}"
        if self.is_varlen:
            shape += f" N{self.num_seqs}"
        return f"{shape} {self.q.device} :: {self.case_class.key}"


def main_shape_rules(
    q: TensorInfo, k: TensorInfo, v: TensorInfo, g: TensorInfo, beta: TensorInfo, rule: Callable[..., None]
) -> tuple[int, int, int, int, int, int] | None:
    """The shape rules of the five main tensors, which both ops share, reported through `rule`. Returns
    ``(B, T, H, K, HV, V)``, or None when q or v is not 4-D (the caller stops there: every other rule reads
    their sizes)."""
    if len(q.shape) != 4:
        rule("q", "must be 4-D [B, T, H, K]", _fmt_shape(q.shape))
    if len(v.shape) != 4:
        rule("v", "must be 4-D [B, T, HV, V]", _fmt_shape(v.shape))
    if len(q.shape) != 4 or len(v.shape) != 4:
        return None
    B, T, H, K = q.shape
    HV, V = v.shape[2], v.shape[3]
    for name, size in (("B", B), ("T", T), ("H", H), ("K", K)):
        if size < 1:
            rule("q", f"{name} (dimension of [B, T, H, K]) must be >= 1", _fmt_shape(q.shape))
    if HV < 1 or V < 1:
        rule("v", "HV and V must be >= 1", _fmt_shape(v.shape))
    if k.shape != q.shape:
        rule("k", f"must have q's shape {_fmt_shape(q.shape)}", _fmt_shape(k.shape))
    if v.shape[:2] != (B, T):
        rule("v", f"must be [B, T, HV, V] with q's B={B}, T={T}", _fmt_shape(v.shape))
    if HV >= 1 and H >= 1 and HV % H != 0:
        rule("v", f"HV must be a multiple of H (grouped value attention); H={H}", f"HV={HV}")
    if K > MAX_HEAD_DIM:
        rule("q", f"head dim K must be <= {MAX_HEAD_DIM}", f"K={K}")
    if V > MAX_HEAD_DIM:
        rule("v", f"head dim V must be <= {MAX_HEAD_DIM}", f"V={V}")
    if g.shape != (B, T, HV, K):
        rule("g", f"must be [B, T, HV, K] = {_fmt_shape((B, T, HV, K))}", _fmt_shape(g.shape))
    if beta.shape != (B, T, HV):
        rule("beta", f"must be [B, T, HV] = {_fmt_shape((B, T, HV))}", _fmt_shape(beta.shape))
    return B, T, H, K, HV, V


def _host_values(t: torch.Tensor | None) -> tuple[int, ...] | None:
    """The values of a host-resident 1-D index tensor, or None when reading them would need a sync."""
    if t is None or t.device.type != "cpu" or t.dim() != 1 or str(t.dtype).removeprefix("torch.") not in INDEX_DTYPES:
        return None
    return tuple(int(x) for x in t.tolist())


def _combined(errors: list[KDAInputError]) -> KDAInputError:
    first, rest = errors[0], errors[1:]
    return KDAInputError(first.argument, first.rule, first.got, more=rest)


def _as_input_error(error: ValidationError) -> KDAInputError:
    """Unwrap the `KDAInputError` pydantic wrapped, or translate a field-type error into one."""
    found: list[KDAInputError] = []
    for item in error.errors():
        inner = (item.get("ctx") or {}).get("error")
        if isinstance(inner, KDAInputError):
            found.append(inner)
            found.extend(inner.more)
        else:
            where = ".".join(str(p) for p in item.get("loc", ())) or "spec"
            found.append(KDAInputError(where, item.get("msg", "invalid"), repr(item.get("input"))))
    return _combined(found)


_spec_memo: dict[tuple, KDASpec] = {}
_differentiable_of = operator.attrgetter(*DIFFERENTIABLE)
