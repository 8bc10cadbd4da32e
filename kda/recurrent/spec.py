"""`RecurrentSpec`: the one validated description of a `fused_recurrent_kda` call (the decode op).

The decode op runs the KDA recurrence token by token (docs/design.md, "The decode op"), optionally over a
*state pool*: ``initial_state`` holds ``num_slots`` states, and ``ssm_state_indices`` says which slot each
sequence reads (and, with ``inplace_final_state=True``, writes). Every rule of that contract is stated here
once, in `RecurrentSpec._check_contract`, in the style of `kda.spec.KDASpec` (whose helpers it reuses):
an error names the argument, the rule and the value it got.

The spec reads no tensor data except index tensors that are already on the host (``cu_seqlens``,
``ssm_state_indices``, ``num_accepted_tokens`` of a CPU call): device-resident indices are never read, so
that a call stays free of host syncs (and capturable in a CUDA graph). Their values are then the caller's
promise: slots ``< num_slots``, ``1 <= num_accepted_tokens <= T_max``, no slot written by two sequences.
"""

from __future__ import annotations

import functools
import math
from enum import Enum
from typing import Any, Literal, cast

import torch
from pydantic import BaseModel, ConfigDict, ValidationError, model_validator

from kda.errors import KDAInputError
from kda.spec import (
    FLOAT_DTYPES,
    INDEX_DTYPES,
    DtypeName,
    HeadDim,
    TensorInfo,
    _as_input_error,
    _combined,
    _fmt_shape,
    cu_seqlens_violation,
    head_dim_bucket,
    main_shape_rules,
)
from kda.tensor_info import CallShapes

OP = "fused_recurrent_kda"
KEY_PREFIX = "recurrent"

_DTYPE_SHORT: dict[str, str] = {"bfloat16": "bf16", "float16": "fp16", "float32": "fp32"}
_DTYPE_LONG: dict[str, DtypeName] = {"bf16": "bfloat16", "fp16": "float16", "fp32": "float32"}
_BETA_SHORT = {"given": "beta", "sigmoid": "sig", "sigmoid2": "sig2"}
_BETA_LONG: dict[str, Literal["given", "sigmoid", "sigmoid2"]] = {"beta": "given", "sig": "sigmoid", "sig2": "sigmoid2"}


class RecurrentGate(str, Enum):
    """How `g` becomes the per-token log decay in the decode op."""

    PREGATED = "pregated"  # use_gate_in_kernel=False: g is the log decay
    SOFTPLUS = "softplus"  # -exp(A_log) * softplus(g + dt_bias)
    SIGMOID = "sigmoid"  # lower_bound * sigmoid(exp(A_log) * (g + dt_bias)), whenever lower_bound is set


PoolKind = Literal["none", "slots", "tokens"]


class RecurrentCaseClass(BaseModel):
    """The class of decode calls one verification record covers (keys start with ``recurrent/``).

    ``pool``: ``none`` (``initial_state`` is one fp32 state per sequence), ``slots`` (a pool read through
    one slot per sequence, ``ssm_state_indices [N]``; also ``inplace_final_state`` without indices, slot n
    for sequence n) or ``tokens`` (speculative decoding, ``ssm_state_indices [N, T_max]``).
    """

    model_config = ConfigDict(frozen=True)

    gate: RecurrentGate
    qk_l2norm: bool
    beta: Literal["given", "sigmoid", "sigmoid2"]
    dtype: DtypeName
    varlen: bool
    gva: bool
    pool: PoolKind
    initial_state: bool  # always True with a pool
    final_state: bool  # a state comes back: output_final_state, or the pool with inplace_final_state
    inplace: bool  # the pool is written (inplace_final_state=True)
    state_dtype: DtypeName  # the initial state's (the pool's) dtype; float32 without one
    state_v_first: bool  # normalised to False when the call has no state at all
    head_dim: HeadDim

    @property
    def op(self) -> str:
        return OP

    @property
    def training(self) -> bool:
        return False  # the decode op is forward-only

    @property
    def key(self) -> str:
        """E.g. ``recurrent/sigmoid/l2/sig/bf16/varlen/gva/tokens+inplace:bf16:vk/d128``."""
        if self.pool == "none":
            states = "+".join(s for s, on in (("h0", self.initial_state), ("ht", self.final_state)) if on) or "nostate"
        else:
            states = self.pool + ("+inplace" if self.inplace else "+ht" if self.final_state else "")
        if self.initial_state and self.state_dtype != "float32":
            states += ":" + _DTYPE_SHORT[self.state_dtype]
        if self.state_v_first:
            states += ":vk"
        parts = [
            KEY_PREFIX,
            self.gate.value,
            "l2" if self.qk_l2norm else "qk",
            _BETA_SHORT[self.beta],
            _DTYPE_SHORT[self.dtype],
            "varlen" if self.varlen else "dense",
            "gva" if self.gva else "mha",
            states,
            f"d{self.head_dim}",
        ]
        return "/".join(parts)

    @classmethod
    def from_key(cls, key: str) -> RecurrentCaseClass:
        """Inverse of `key`; ValueError for anything else."""
        try:
            prefix, gate, qk, beta, dtype, layout, heads, states, dim = key.split("/")
            if prefix != KEY_PREFIX:
                raise ValueError(key)
            main, *suffixes = states.split(":")
            state_v_first = "vk" in suffixes
            state_dtype = next((_DTYPE_LONG[s] for s in suffixes if s != "vk"), "float32")
            head, *flags = main.split("+")
            if head in ("slots", "tokens"):
                pool = cast(PoolKind, head)
                inplace = "inplace" in flags
                initial, final = True, inplace or "ht" in flags
            else:
                pool, inplace = "none", False
                present = {head, *flags}
                initial, final = "h0" in present, "ht" in present
            return cls(
                gate=RecurrentGate(gate),
                qk_l2norm=qk == "l2",
                beta=_BETA_LONG[beta],
                dtype=_DTYPE_LONG[dtype],
                varlen=layout == "varlen",
                gva=heads == "gva",
                pool=pool,
                initial_state=initial,
                final_state=final,
                inplace=inplace,
                state_dtype=cast(DtypeName, state_dtype),
                state_v_first=state_v_first,
                head_dim=cast(HeadDim, int(dim.removeprefix("d"))),
            )
        except (ValueError, KeyError, StopIteration) as error:
            raise ValueError(f"not a recurrent case-class key: {key!r}") from error


def is_recurrent_key(key: str) -> bool:
    return key.startswith(KEY_PREFIX + "/")


def _host_ints(t: torch.Tensor | None) -> tuple[int, ...] | None:
    """The values of a host-resident index tensor (flattened), or None when reading them needs a sync."""
    if t is None or t.device.type != "cpu" or str(t.dtype).removeprefix("torch.") not in INDEX_DTYPES:
        return None
    return tuple(int(x) for x in t.reshape(-1).tolist())


class RecurrentSpec(CallShapes, BaseModel):
    """A validated, immutable description of one `fused_recurrent_kda` call. Build it with `from_call`."""

    model_config = ConfigDict(frozen=True)

    q: TensorInfo
    k: TensorInfo
    v: TensorInfo
    g: TensorInfo
    beta: TensorInfo
    A_log: TensorInfo | None = None
    dt_bias: TensorInfo | None = None
    initial_state: TensorInfo | None = None
    cu_seqlens: TensorInfo | None = None
    ssm_state_indices: TensorInfo | None = None
    num_accepted_tokens: TensorInfo | None = None
    out: TensorInfo | None = None
    # host values of the index tensors, when they were on the host already (never read from a device)
    cu_seqlens_values: tuple[int, ...] | None = None
    indices_values: tuple[int, ...] | None = None  # ssm_state_indices, flattened
    accepted_values: tuple[int, ...] | None = None

    scale: float
    output_final_state: bool = False
    use_qk_l2norm_in_kernel: bool = False
    use_gate_in_kernel: bool = False
    use_beta_sigmoid_in_kernel: bool = False
    allow_neg_eigval: bool = False
    lower_bound: float | None = None
    state_v_first: bool = False
    inplace_final_state: bool = False

    def __init__(self, **data: Any):
        try:
            super().__init__(**data)
        except ValidationError as error:
            raise _as_input_error(error) from None

    # ------------------------------------------------------------------ building from a call
    @classmethod
    def from_call(
        cls,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        g: torch.Tensor,
        beta: torch.Tensor,
        A_log: torch.Tensor | None = None,
        dt_bias: torch.Tensor | None = None,
        scale: float | None = None,
        initial_state: torch.Tensor | None = None,
        output_final_state: bool = False,
        use_qk_l2norm_in_kernel: bool = False,
        use_gate_in_kernel: bool = False,
        use_beta_sigmoid_in_kernel: bool = False,
        allow_neg_eigval: bool = False,
        lower_bound: float | None = None,
        state_v_first: bool = False,
        cu_seqlens: torch.Tensor | None = None,
        *,
        ssm_state_indices: torch.Tensor | None = None,
        num_accepted_tokens: torch.Tensor | None = None,
        inplace_final_state: bool = False,
        out: torch.Tensor | None = None,
        read_host_values: bool = True,
    ) -> RecurrentSpec:
        """Describe a call (`fused_recurrent_kda`'s arguments). Raises `KDAInputError` on any broken rule,
        and when the call needs gradients (the op is forward-only). ``read_host_values=False`` reads no
        index tensor's values even on the host (tracing under torch.compile: fake tensors have none)."""
        tensors = {
            "q": q,
            "k": k,
            "v": v,
            "g": g,
            "beta": beta,
            "A_log": A_log,
            "dt_bias": dt_bias,
            "initial_state": initial_state,
            "cu_seqlens": cu_seqlens,
            "ssm_state_indices": ssm_state_indices,
            "num_accepted_tokens": num_accepted_tokens,
            "out": out,
        }
        for name, tensor in tensors.items():
            if tensor is None and name in ("q", "k", "v", "g", "beta"):
                raise KDAInputError(name, "is required: a torch.Tensor", "None")
            if tensor is not None and not isinstance(tensor, torch.Tensor):
                raise KDAInputError(name, "must be a torch.Tensor", type(tensor).__name__)
        flags = {
            "output_final_state": output_final_state,
            "use_qk_l2norm_in_kernel": use_qk_l2norm_in_kernel,
            "use_gate_in_kernel": use_gate_in_kernel,
            "use_beta_sigmoid_in_kernel": use_beta_sigmoid_in_kernel,
            "allow_neg_eigval": allow_neg_eigval,
            "state_v_first": state_v_first,
            "inplace_final_state": inplace_final_state,
        }
        for name, flag in flags.items():
            if not isinstance(flag, bool):
                raise KDAInputError(name, "must be a bool", repr(flag))
        for name, number in (("scale", scale), ("lower_bound", lower_bound)):
            if number is not None and (isinstance(number, bool) or not isinstance(number, (int, float))):
                raise KDAInputError(name, "must be a real number (int or float) or None", repr(number))
        if torch.is_grad_enabled():
            for name in ("q", "k", "v", "g", "beta", "A_log", "dt_bias", "initial_state"):
                tensor = tensors[name]
                if tensor is not None and tensor.requires_grad:
                    raise KDAInputError(
                        name,
                        "fused_recurrent_kda is forward-only (as FLA's): call it under torch.no_grad() or "
                        "torch.inference_mode(), or use kda.chunk_kda, which trains",
                        "a tensor that requires grad",
                    )
        if scale is None:
            scale = q.shape[-1] ** -0.5 if q.dim() == 4 and q.shape[-1] > 0 else 1.0
        # A call shaped like an earlier valid one gets that call's spec back without re-running the rules,
        # which depend only on this key, unless an index tensor is on the host: its values are then checked
        # on every call. (A decode step is short: the checks cost about as much as a small batch's kernel.)
        host_indices = not read_host_values or any(
            t is not None and t.device.type == "cpu" for t in (cu_seqlens, ssm_state_indices, num_accepted_tokens)
        )
        memo_key = None
        if not host_indices:
            memo_key = (
                tuple(None if t is None else (t.shape, t.dtype, t.device) for t in tensors.values()),
                tuple(flags.values()),
                float(scale),
                lower_bound,
            )
            cached = _memo.get(memo_key)
            if cached is not None:
                return cached

        def host(t: torch.Tensor | None) -> tuple[int, ...] | None:
            return _host_ints(t) if read_host_values else None

        spec = cls(
            **{name: (None if t is None else TensorInfo.of(t)) for name, t in tensors.items()},
            cu_seqlens_values=host(cu_seqlens) if cu_seqlens is not None and cu_seqlens.dim() == 1 else None,
            indices_values=host(ssm_state_indices),
            accepted_values=host(num_accepted_tokens),
            scale=float(scale),
            lower_bound=None if lower_bound is None else float(lower_bound),
            **flags,
        )
        if memo_key is not None:
            if len(_memo) >= _MEMO_LIMIT:
                _memo.clear()
            _memo[memo_key] = spec
        return spec

    # ------------------------------------------------------------------ the rules
    @model_validator(mode="after")
    def _check_contract(self) -> RecurrentSpec:
        errors: list[KDAInputError] = []

        def rule(argument: str, text: str, got: Any = None) -> None:
            errors.append(KDAInputError(argument, text, got))

        q, k, v, g, beta = self.q, self.k, self.v, self.g, self.beta
        shapes = main_shape_rules(q, k, v, g, beta, rule)
        if shapes is None:
            raise _combined(errors)
        B, T, _, K, HV, V = shapes

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
        for name in ("k", "v", "g", "beta", "A_log", "dt_bias", "initial_state", "cu_seqlens", "out"):
            info = getattr(self, name)
            if info is not None and info.device != q.device:
                rule(name, f"must be on q's device ({q.device})", info.device)
        for name in ("ssm_state_indices", "num_accepted_tokens"):
            info = getattr(self, name)
            if info is not None and info.device != q.device:
                rule(name, f"must be on q's device ({q.device}): kda never copies indices (no host sync)", info.device)

        # Gates.
        if not math.isfinite(self.scale):
            rule("scale", "must be a finite number", self.scale)
        if self.use_gate_in_kernel:
            if self.lower_bound is None and self.A_log is None:
                rule("A_log", "the softplus gate (use_gate_in_kernel=True, lower_bound=None) requires A_log", "None")
            if self.lower_bound is not None and not (math.isfinite(self.lower_bound) and self.lower_bound < 0):
                rule("lower_bound", "the sigmoid gate needs a finite lower_bound < 0", self.lower_bound)
            if self.A_log is not None:
                if math.prod(self.A_log.shape) != HV:
                    rule(
                        "A_log",
                        f"must hold HV = {HV} values (e.g. [HV] or [1, 1, HV, 1])",
                        _fmt_shape(self.A_log.shape),
                    )
                if self.A_log.dtype not in FLOAT_DTYPES:
                    rule("A_log", f"dtype must be one of {', '.join(FLOAT_DTYPES)}", self.A_log.dtype)
            if self.dt_bias is not None:
                if self.dt_bias.shape not in ((HV * K,), (HV, K)):
                    rule(
                        "dt_bias",
                        f"must have shape [HV*K] = [{HV * K}] or [HV, K] = [{HV}, {K}]",
                        _fmt_shape(self.dt_bias.shape),
                    )
                if self.dt_bias.dtype not in FLOAT_DTYPES:
                    rule("dt_bias", f"dtype must be one of {', '.join(FLOAT_DTYPES)}", self.dt_bias.dtype)
        else:
            for name in ("A_log", "dt_bias", "lower_bound"):
                if getattr(self, name) is not None:
                    rule(
                        name, "is used only with use_gate_in_kernel=True (g is taken as the log decay as given)", "set"
                    )
        if self.allow_neg_eigval and not self.use_beta_sigmoid_in_kernel:
            rule(
                "allow_neg_eigval",
                "allow_neg_eigval=True requires use_beta_sigmoid_in_kernel=True",
                "use_beta_sigmoid_in_kernel=False",
            )

        # Variable length.
        N = B
        if self.cu_seqlens is not None:
            cu = self.cu_seqlens
            if B != 1:
                rule("cu_seqlens", "variable-length input must be flattened to B == 1", f"B={B}")
            if cu.dtype not in INDEX_DTYPES:
                rule("cu_seqlens", "dtype must be int32 or int64", cu.dtype)
            if len(cu.shape) != 1 or cu.shape[0] < 2:
                rule("cu_seqlens", "must be 1-D [N+1] with N >= 1 sequences", _fmt_shape(cu.shape))
            else:
                N = cu.shape[0] - 1
            if self.cu_seqlens_values is not None:
                broken = cu_seqlens_violation(self.cu_seqlens_values, T)
                if broken is not None:
                    rule("cu_seqlens", broken)

        # States and the pool.
        pooled = self.ssm_state_indices is not None or self.inplace_final_state
        layout = "[.., HV, V, K] (state_v_first=True)" if self.state_v_first else "[.., HV, K, V]"
        inner = (HV, V, K) if self.state_v_first else (HV, K, V)
        h0 = self.initial_state
        if self.inplace_final_state and h0 is None:
            rule("inplace_final_state", "writes the states back into initial_state: pass the state pool", "None")
        if self.ssm_state_indices is not None and h0 is None:
            rule("ssm_state_indices", "selects slots of initial_state (the state pool): pass it", "initial_state=None")
        if h0 is not None:
            if pooled:
                if len(h0.shape) != 4 or tuple(h0.shape[1:]) != inner or h0.shape[0] < 1:
                    rule(
                        "initial_state",
                        f"a state pool must be [num_slots, HV, K, V] {layout} = [num_slots, {', '.join(map(str, inner))}]",
                        _fmt_shape(h0.shape),
                    )
                if h0.dtype not in FLOAT_DTYPES:
                    rule("initial_state", f"a state pool's dtype must be one of {', '.join(FLOAT_DTYPES)}", h0.dtype)
                if self.ssm_state_indices is None and h0.shape[0] != N:
                    rule(
                        "initial_state",
                        f"with inplace_final_state and no ssm_state_indices, slot n is sequence n: needs N = {N} slots",
                        _fmt_shape(h0.shape),
                    )
            else:
                expected = (N, *inner)
                if h0.shape != expected:
                    rule(
                        "initial_state",
                        f"must be [N, HV, K, V] {layout} = {_fmt_shape(expected)} with N = {N} sequences "
                        "(or a state pool, with ssm_state_indices)",
                        _fmt_shape(h0.shape),
                    )
                if h0.dtype != "float32":
                    rule(
                        "initial_state",
                        "dtype must be float32 (bf16/fp16 states are for state pools, with ssm_state_indices)",
                        h0.dtype,
                    )
        idx = self.ssm_state_indices
        if idx is not None:
            if idx.dtype not in INDEX_DTYPES:
                rule("ssm_state_indices", "dtype must be int32 or int64", idx.dtype)
            if len(idx.shape) not in (1, 2) or idx.shape[0] != N:
                rule("ssm_state_indices", f"must be [N] or [N, T_max] with N = {N} sequences", _fmt_shape(idx.shape))
            elif len(idx.shape) == 2:
                if idx.shape[1] < 1:
                    rule("ssm_state_indices", "[N, T_max] needs T_max >= 1", _fmt_shape(idx.shape))
                if self.cu_seqlens is None and idx.shape[1] < T:
                    rule(
                        "ssm_state_indices",
                        f"[N, T_max] needs a slot per token: T_max >= T = {T}",
                        _fmt_shape(idx.shape),
                    )
        acc = self.num_accepted_tokens
        if acc is not None:
            if idx is None or len(idx.shape) != 2:
                rule(
                    "num_accepted_tokens",
                    "is for speculative decoding: it needs per-token ssm_state_indices [N, T_max]",
                    "ssm_state_indices=None" if idx is None else _fmt_shape(idx.shape),
                )
            if acc.dtype not in INDEX_DTYPES:
                rule("num_accepted_tokens", "dtype must be int32 or int64", acc.dtype)
            if acc.shape != (N,):
                rule("num_accepted_tokens", f"must be [N] = [{N}]", _fmt_shape(acc.shape))
        if self.out is not None:
            if self.out.shape != v.shape:
                rule("out", f"must have v's shape {_fmt_shape(v.shape)}", _fmt_shape(self.out.shape))
            if self.out.dtype != q.dtype:
                rule("out", f"dtype must be q's ({q.dtype})", self.out.dtype)
        if errors:
            raise _combined(errors)
        self._check_index_values(rule, N, T)
        if errors:
            raise _combined(errors)
        return self

    def _check_index_values(self, rule: Any, N: int, T: int) -> None:
        """The rules on index values, where the values were on the host (a CPU call)."""
        idx, values = self.ssm_state_indices, self.indices_values
        if idx is None or values is None or self.initial_state is None:
            return
        slots = self.initial_state.shape[0]
        too_big = [s for s in values if s >= slots]
        if too_big:
            rule("ssm_state_indices", f"slots must be < num_slots = {slots} (negative marks a padding row)", too_big[0])
        width = idx.shape[1] if len(idx.shape) == 2 else 1
        lengths = self._host_lengths(N, T)
        accepted = self.accepted_values
        if accepted is not None and len(idx.shape) == 2:
            bad = [a for a in accepted if not 1 <= a <= width]
            if bad:
                rule("num_accepted_tokens", f"must lie in [1, T_max] = [1, {width}]", bad[0])
                return
        if lengths is not None and len(idx.shape) == 2 and max(lengths, default=0) > width:
            rule("ssm_state_indices", f"[N, T_max] needs T_max >= the longest sequence ({max(lengths)})", width)
            return
        if too_big or not self.inplace_final_state or lengths is None:
            return
        owner: dict[int, int] = {}
        for n in range(N):
            row = values[n * width : (n + 1) * width]
            read = row[0] if width == 1 else row[(accepted[n] if accepted is not None else 1) - 1]
            if read < 0 or lengths[n] == 0:
                continue  # a padding row, or an empty sequence: nothing is written
            written = [row[0]] if width == 1 else [s for s in row[: lengths[n]] if s >= 0]
            for slot in written:
                if owner.setdefault(slot, n) != n:
                    rule(
                        "ssm_state_indices", "two sequences write the same slot (their order would be undefined)", slot
                    )
                    return

    def _host_lengths(self, N: int, T: int) -> list[int] | None:
        if self.cu_seqlens is None:
            return [T] * N
        values = self.cu_seqlens_values
        return None if values is None else [values[n + 1] - values[n] for n in range(N)]

    # ------------------------------------------------------------------ derived facts
    @property
    def op(self) -> str:
        return OP

    @property
    def requires_grad(self) -> bool:
        return False  # refused in from_call: the op is forward-only

    @functools.cached_property
    def routing_key(self) -> tuple:
        """Everything that can change which backend serves the call, as plain values (host index values
        vary call to call and change no backend's answer, so they are left out)."""
        return (OP, *self._routing_parts(("cu_seqlens_values", "indices_values", "accepted_values")))

    @property
    def pool_kind(self) -> PoolKind:
        if self.ssm_state_indices is not None:
            return "tokens" if len(self.ssm_state_indices.shape) == 2 else "slots"
        return "slots" if self.inplace_final_state else "none"

    @property
    def num_slots(self) -> int | None:
        """Slots of the pool (None without a pool)."""
        return None if self.pool_kind == "none" or self.initial_state is None else self.initial_state.shape[0]

    @property
    def tokens_per_seq(self) -> int:
        """T_max of per-token indices (1 for one slot per sequence)."""
        idx = self.ssm_state_indices
        return idx.shape[1] if idx is not None and len(idx.shape) == 2 else 1

    @property
    def returns_state(self) -> bool:
        return self.output_final_state or self.inplace_final_state

    @property
    def gate_mode(self) -> RecurrentGate:
        if not self.use_gate_in_kernel:
            return RecurrentGate.PREGATED
        return RecurrentGate.SOFTPLUS if self.lower_bound is None else RecurrentGate.SIGMOID

    @property
    def device(self) -> torch.device:
        return torch.device(self.q.device)

    @property
    def dtype(self) -> torch.dtype:
        return getattr(torch, self.q.dtype)

    @property
    def state_dtype(self) -> torch.dtype:
        return torch.float32 if self.initial_state is None else getattr(torch, self.initial_state.dtype)

    @property
    def state_shape(self) -> tuple[int, int, int, int]:
        """Shape of one state per sequence (a new final state) in the call's layout."""
        if self.state_v_first:
            return (self.num_seqs, self.HV, self.V, self.K)
        return (self.num_seqs, self.HV, self.K, self.V)

    @property
    def case_class(self) -> RecurrentCaseClass:
        has_state = self.initial_state is not None or self.output_final_state
        return RecurrentCaseClass(
            gate=self.gate_mode,
            qk_l2norm=self.use_qk_l2norm_in_kernel,
            beta=("sigmoid2" if self.allow_neg_eigval else "sigmoid") if self.use_beta_sigmoid_in_kernel else "given",
            dtype=cast(DtypeName, self.q.dtype),
            varlen=self.is_varlen,
            gva=self.is_gva,
            pool=self.pool_kind,
            initial_state=self.initial_state is not None,
            final_state=self.returns_state,
            inplace=self.inplace_final_state,
            state_dtype=cast(DtypeName, self.initial_state.dtype if self.initial_state is not None else "float32"),
            state_v_first=self.state_v_first and has_state,
            head_dim=head_dim_bucket(max(self.K, self.V)),
        )

    def summary(self) -> str:
        shape = f"B{self.B} T{self.T} H{self.H} HV{self.HV} K{self.K} V{self.V}"
        if self.is_varlen:
            shape += f" N{self.num_seqs}"
        if self.num_slots is not None:
            shape += f" slots{self.num_slots}"
        return f"{OP} {shape} {self.q.device} :: {self.case_class.key}"


_memo: dict[tuple, RecurrentSpec] = {}
_MEMO_LIMIT = 1024
