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
from collections.abc import Sequence
from enum import Enum
from typing import Any, Literal, cast

import torch
from pydantic import BaseModel, ConfigDict, ValidationError, model_validator

from kda.errors import KDAInputError
from kda.options import (
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

FLOAT_DTYPES = ("bfloat16", "float16", "float32")
INDEX_DTYPES = ("int32", "int64")
CHUNK_SIZES = (32, 64)
MAX_HEAD_DIM = 256
SAFE_LOWER_BOUND_MIN = -5.0
_SPEC_MEMO_LIMIT = 1024


class GateMode(str, Enum):
    """How `g` becomes the per-token log decay (chosen by `use_gate_in_kernel` and `safe_gate`)."""

    PREGATED = "pregated"  # use_gate_in_kernel=False: g is already the log decay (<= 0)
    SOFTPLUS = "softplus"  # g <- -exp(A_log[h]) * softplus(g + dt_bias[h])
    SAFE = "safe"  # g <- lower_bound * sigmoid(exp(A_log[h]) * (g + dt_bias[h])), -5 <= lower_bound < 0


class TensorInfo(BaseModel):
    """What the contract needs to know of one tensor: shape, dtype name and device."""

    model_config = ConfigDict(frozen=True)

    shape: tuple[int, ...]
    dtype: str
    device: str

    @classmethod
    def of(cls, tensor: torch.Tensor) -> TensorInfo:
        return cls(shape=tuple(tensor.shape), dtype=str(tensor.dtype).removeprefix("torch."), device=str(tensor.device))


def _fmt_shape(shape: Sequence[int | str]) -> str:
    return "[" + ", ".join(str(s) for s in shape) + "]"


def cu_seqlens_violation(values: Sequence[int], total_tokens: int) -> str | None:
    """The broken `cu_seqlens` rule for these host values, or None when they are well formed.

    `cu_seqlens` marks sequence boundaries in the flattened time axis: it starts at 0, never
    decreases, and ends at T. Backends that copy `cu_seqlens` to the host anyway call this too, so
    that a device-resident `cu_seqlens` (which the spec cannot read without a sync) is still checked.
    """
    if len(values) < 2:
        return f"must hold N+1 >= 2 boundaries; got {list(values)}"
    if values[0] != 0:
        return f"must start at 0; got {values[0]}"
    for i in range(1, len(values)):
        if values[i] < values[i - 1]:
            return f"must be non-decreasing; got {values[i - 1]} then {values[i]} at position {i}"
    if values[-1] != total_tokens:
        return f"must end at T = {total_tokens}; got {values[-1]}"
    return None


BetaMode = Literal["given", "sigmoid", "sigmoid2"]
DtypeName = Literal["bfloat16", "float16", "float32"]
ChunkSize = Literal[32, 64]
HeadDim = Literal[64, 128, 256]
_BETA_OF_KEY: dict[str, BetaMode] = {"beta": "given", "sig": "sigmoid", "sig2": "sigmoid2"}
_DTYPE_OF_KEY: dict[str, DtypeName] = {"bf16": "bfloat16", "fp16": "float16", "fp32": "float32"}


class CaseClass(BaseModel):
    """The class of calls that one verification record covers ("Case classes" in `docs/design.md`).

    Two calls in the same class exercise the same code paths of any backend: same gate mode, in-kernel
    flags, dtype, layout features, chunk size, head-dimension bucket and need for gradients. Sizes
    (B, T, H, the exact K and V up to the bucket) vary within a class.
    """

    model_config = ConfigDict(frozen=True)

    gate: GateMode
    qk_l2norm: bool
    beta: BetaMode
    dtype: DtypeName
    varlen: bool
    gva: bool
    initial_state: bool
    final_state: bool
    state_v_first: bool  # normalised to False when the call has no state at all
    chunk_size: ChunkSize
    head_dim: HeadDim  # bucket of max(K, V)
    training: bool

    @property
    def key(self) -> str:
        """A short stable name, e.g. ``safe/l2/sig/bf16/varlen/gva/h0+ht:vk/c64/d128/train``."""
        states = "+".join(s for s, on in (("h0", self.initial_state), ("ht", self.final_state)) if on) or "nostate"
        if self.state_v_first:
            states += ":vk"
        beta = {"given": "beta", "sigmoid": "sig", "sigmoid2": "sig2"}[self.beta]
        dtype = {"bfloat16": "bf16", "float16": "fp16", "float32": "fp32"}[self.dtype]
        parts = [
            self.gate.value,
            "l2" if self.qk_l2norm else "qk",
            beta,
            dtype,
            "varlen" if self.varlen else "dense",
            "gva" if self.gva else "mha",
            states,
            f"c{self.chunk_size}",
            f"d{self.head_dim}",
            "train" if self.training else "fwd",
        ]
        return "/".join(parts)

    @classmethod
    def from_key(cls, key: str) -> CaseClass:
        """Inverse of `key`."""
        try:
            gate, qk, beta, dtype, layout, heads, states, chunk, dim, mode = key.split("/")
            state_v_first = states.endswith(":vk")
            states = states.removesuffix(":vk")
            return cls(
                gate=GateMode(gate),
                qk_l2norm=qk == "l2",
                beta=_BETA_OF_KEY[beta],
                dtype=_DTYPE_OF_KEY[dtype],
                varlen=layout == "varlen",
                gva=heads == "gva",
                initial_state="h0" in states,
                final_state="ht" in states,
                state_v_first=state_v_first,
                # pydantic checks these are one of the allowed sizes (a ValueError if not)
                chunk_size=cast(ChunkSize, int(chunk.removeprefix("c"))),
                head_dim=cast(HeadDim, int(dim.removeprefix("d"))),
                training=mode == "train",
            )
        except (ValueError, KeyError) as error:
            raise ValueError(f"not a case-class key: {key!r}") from error


def head_dim_bucket(dim: int) -> HeadDim:
    """The smallest of 64, 128, 256 that holds `dim` (kernels tile head dimensions by these)."""
    return 64 if dim <= 64 else 128 if dim <= 128 else 256


class KDASpec(BaseModel):
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
        # Shapes of the main tensors. Stop early when q or v is not 4-D: every other rule reads them.
        if len(q.shape) != 4:
            rule("q", "must be 4-D [B, T, H, K]", _fmt_shape(q.shape))
        if len(v.shape) != 4:
            rule("v", "must be 4-D [B, T, HV, V]", _fmt_shape(v.shape))
        if errors:
            raise _combined(errors)
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

        # Dtypes and devices.
        if torch.device(q.device).type == "meta":
            rule("q", "must hold values: kda computes KDA, and a meta tensor has none", q.device)
        if q.dtype not in FLOAT_DTYPES:
            rule("q", f"dtype must be one of {', '.join(FLOAT_DTYPES)}", q.dtype)
        for name, info in (("k", k), ("v", v)):
            if info.dtype != q.dtype:
                rule(name, f"dtype must match q's ({q.dtype})", info.dtype)
        for name, info in (("g", g), ("beta", beta)):
            if info.dtype not in FLOAT_DTYPES:
                rule(name, f"dtype must be one of {', '.join(FLOAT_DTYPES)}", info.dtype)
        for name in ("k", "v", "g", "beta", "A_log", "dt_bias", "initial_state", "cu_seqlens"):
            info = getattr(self, name)
            if info is not None and info.device != q.device:
                rule(name, f"must be on q's device ({q.device})", info.device)

        # Gate modes and their parameters.
        if self.safe_gate and not self.use_gate_in_kernel:
            rule("safe_gate", "safe_gate=True requires use_gate_in_kernel=True", "use_gate_in_kernel=False")
        if self.safe_gate and self.lower_bound is None:
            rule("lower_bound", "safe_gate=True requires a lower_bound with -5 <= lower_bound < 0", "None")
        if self.lower_bound is not None:
            lb = self.lower_bound
            if self.safe_gate and not (SAFE_LOWER_BOUND_MIN <= lb < 0):
                rule("lower_bound", "the safe gate requires -5 <= lower_bound < 0", lb)
            if not self.safe_gate:
                rule(
                    "lower_bound",
                    "is used only by the safe gate: pass safe_gate=True (and use_gate_in_kernel=True), "
                    "or leave lower_bound=None for the softplus gate",
                    lb,
                )
        if self.use_gate_in_kernel:
            if not self.safe_gate and self.A_log is None:
                rule("A_log", "the softplus gate (use_gate_in_kernel=True, safe_gate=False) requires A_log", "None")
            if self.A_log is not None:
                if self.A_log.shape != (HV,):
                    rule("A_log", f"must have shape [HV] = [{HV}]", _fmt_shape(self.A_log.shape))
                if self.A_log.dtype != "float32":
                    rule("A_log", "dtype must be float32", self.A_log.dtype)
            if self.dt_bias is not None:
                if self.dt_bias.shape not in ((HV * K,), (HV, K)):
                    rule(
                        "dt_bias",
                        f"must have shape [HV*K] = [{HV * K}] or [HV, K] = [{HV}, {K}]",
                        _fmt_shape(self.dt_bias.shape),
                    )
                if self.dt_bias.dtype != "float32":
                    rule("dt_bias", "dtype must be float32", self.dt_bias.dtype)
        else:
            for name in ("A_log", "dt_bias"):
                if getattr(self, name) is not None:
                    rule(
                        name,
                        "is used only with use_gate_in_kernel=True (g is taken as the log decay as given)",
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
            rule("cu_seqlens_cpu", "is a host copy of cu_seqlens; pass cu_seqlens too", "cu_seqlens=None")
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
            if h0.dtype != "float32":
                rule("initial_state", "dtype must be float32", h0.dtype)

        if errors:
            raise _combined(errors)
        return self

    # ------------------------------------------------------------------ derived facts
    @functools.cached_property
    def routing_key(self) -> tuple:
        """Everything that can change which backend serves the call, as plain values (cheap to hash):
        the spec without the host values of `cu_seqlens`, which vary batch to batch but change no
        backend's answer. Computed once per spec."""
        parts = []
        for name in type(self).model_fields:
            if name in ("cu_seqlens_values", "cu_seqlens_values_device"):
                continue
            value = getattr(self, name)
            parts.append((value.shape, value.dtype, value.device) if isinstance(value, TensorInfo) else value)
        return tuple(parts)

    @property
    def B(self) -> int:
        return self.q.shape[0]

    @property
    def T(self) -> int:
        return self.q.shape[1]

    @property
    def H(self) -> int:
        return self.q.shape[2]

    @property
    def K(self) -> int:
        return self.q.shape[3]

    @property
    def HV(self) -> int:
        return self.v.shape[2]

    @property
    def V(self) -> int:
        return self.v.shape[3]

    @property
    def num_seqs(self) -> int:
        """N: the number of sequences (B, or len(cu_seqlens) - 1 for variable length)."""
        return self.cu_seqlens.shape[0] - 1 if self.cu_seqlens is not None else self.B

    @property
    def is_varlen(self) -> bool:
        return self.cu_seqlens is not None

    @property
    def is_gva(self) -> bool:
        return self.HV > self.H

    @property
    def gate_mode(self) -> GateMode:
        if not self.use_gate_in_kernel:
            return GateMode.PREGATED
        return GateMode.SAFE if self.safe_gate else GateMode.SOFTPLUS

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
        )

    def summary(self) -> str:
        """One line for logs and reports."""
        shape = f"B{self.B} T{self.T} H{self.H} HV{self.HV} K{self.K} V{self.V}"
        if self.is_varlen:
            shape += f" N{self.num_seqs}"
        return f"{shape} {self.q.device} :: {self.case_class.key}"


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
