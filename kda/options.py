"""`KDAArguments`: the argument list of a `chunk_kda` call, declared once.

The names, order and defaults of `fla.ops.kda.chunk_kda` 0.6's arguments, followed by kda's keyword-only
additions (``A_log``, ``dt_bias``, ``chunk_size``), are the fields of one dataclass. Everything
that takes a call's arguments reads them from here: `KDASpec.from_call` (its keywords, its memo key and
the spec it builds), `kda.reference.kda_reference`, and the test that holds `kda.chunk_kda`'s explicit
signature to this one. ``backend`` is not a field: it chooses who computes a call, not what is computed.

Each field's ``metadata["role"]`` says what kind of argument it is:

- ``"tensor"``: a tensor (or None for the optional ones), described in the spec by shape, dtype, device;
- ``"flag"``: a bool;
- ``"number"``: a real number or None (``scale``, ``lower_bound``);
- ``"int"``: an int (``chunk_size``);
- ``"count"``: a positive int or None (``max_num_seqs``);
- ``"fla_only"``: an FLA option kda does not implement: only its default is accepted.

and ``metadata["differentiable"]`` whether gradients flow to it (the tensors but ``cu_seqlens*``).
"""

from __future__ import annotations

import dataclasses
import inspect
import operator
from dataclasses import dataclass, field
from typing import Any, Literal

import torch

from kda.errors import KDAInputError

Role = Literal["tensor", "flag", "number", "int", "count", "fla_only"]


def _role(role: Role, *, differentiable: bool = False) -> dict[str, Any]:
    return {"role": role, "differentiable": differentiable}


_GRAD_TENSOR = _role("tensor", differentiable=True)  # a tensor gradients flow to
_INDEX_TENSOR = _role("tensor")
_FLAG = _role("flag")
_NUMBER = _role("number")
_FLA_ONLY = _role("fla_only")


@dataclass(slots=True)
class KDAArguments:
    """The arguments of one `chunk_kda` call: FLA 0.6's, in its order with its defaults, then kda's own.

    Shapes and meanings are documented on `kda.chunk_kda`. Building one checks nothing beyond Python's
    own argument binding; `KDASpec.from_args` validates. Treat it as immutable (`dataclasses.replace`
    makes a changed copy); it is not declared frozen because a frozen dataclass's ``__init__`` costs
    about 4 us more per call, and one is built on every call.
    """

    q: torch.Tensor = field(metadata=_GRAD_TENSOR)
    k: torch.Tensor = field(metadata=_GRAD_TENSOR)
    v: torch.Tensor = field(metadata=_GRAD_TENSOR)
    g: torch.Tensor = field(metadata=_GRAD_TENSOR)
    beta: torch.Tensor = field(metadata=_GRAD_TENSOR)
    scale: float | None = field(default=None, metadata=_NUMBER)
    initial_state: torch.Tensor | None = field(default=None, metadata=_GRAD_TENSOR)
    output_final_state: bool = field(default=False, metadata=_FLAG)
    use_qk_l2norm_in_kernel: bool = field(default=False, metadata=_FLAG)
    use_gate_in_kernel: bool = field(default=False, metadata=_FLAG)
    use_beta_sigmoid_in_kernel: bool = field(default=False, metadata=_FLAG)
    allow_neg_eigval: bool = field(default=False, metadata=_FLAG)
    safe_gate: bool = field(default=False, metadata=_FLAG)
    lower_bound: float | None = field(default=None, metadata=_NUMBER)
    disable_recompute: bool = field(default=False, metadata=_FLAG)  # a hint for backends; same numbers
    return_intermediate_states: bool = field(default=False, metadata=_FLAG)  # adds the per-chunk states
    state_v_first: bool = field(default=False, metadata=_FLAG)
    cu_seqlens: torch.Tensor | None = field(default=None, metadata=_INDEX_TENSOR)
    cu_seqlens_cpu: torch.Tensor | None = field(default=None, metadata=_INDEX_TENSOR)
    cp_context: Any = field(default=None, metadata=_FLA_ONLY)
    use_graph: bool = field(default=False, metadata=_FLAG)  # the call must be CUDA-graph capturable
    max_num_seqs: int | None = field(default=None, metadata=_role("count"))
    # kda's additions, keyword-only (FLA 0.6 takes them through **kwargs)
    A_log: torch.Tensor | None = field(default=None, kw_only=True, metadata=_GRAD_TENSOR)
    dt_bias: torch.Tensor | None = field(default=None, kw_only=True, metadata=_GRAD_TENSOR)
    chunk_size: int = field(default=64, kw_only=True, metadata=_role("int"))

    def check_fla_only(self) -> None:
        """Raise `KDAInputError` when an FLA option kda does not implement is set to other than its default."""
        given = _fla_only_of(self)
        if given == _FLA_ONLY_DEFAULTS:  # the usual case: each value is its default (an identity check)
            return
        for (name, default), value in zip(FLA_ONLY.items(), given):
            if value is not default and value != default:
                raise KDAInputError(name, f"is not supported by kda (only the default {default!r} is)", repr(value))

    def tensors(self) -> dict[str, torch.Tensor | None]:
        """The tensor arguments by name, in declaration order."""
        return dict(zip(TENSORS, tensors_of(self)))


FIELDS: tuple[dataclasses.Field[Any], ...] = dataclasses.fields(KDAArguments)
NAMES: tuple[str, ...] = tuple(f.name for f in FIELDS)
REQUIRED: tuple[str, ...] = tuple(f.name for f in FIELDS if f.default is dataclasses.MISSING)
DEFAULTS: dict[str, Any] = {f.name: f.default for f in FIELDS if f.default is not dataclasses.MISSING}
KEYWORD_ONLY: tuple[str, ...] = tuple(f.name for f in FIELDS if f.kw_only)


def _with_role(*roles: Role) -> tuple[str, ...]:
    return tuple(f.name for f in FIELDS if f.metadata["role"] in roles)


TENSORS: tuple[str, ...] = _with_role("tensor")
DIFFERENTIABLE: tuple[str, ...] = tuple(f.name for f in FIELDS if f.metadata["differentiable"])
FLAGS: tuple[str, ...] = _with_role("flag")
NUMBERS: tuple[str, ...] = _with_role("number")
COUNTS: tuple[str, ...] = _with_role("count")
FLA_ONLY: dict[str, Any] = {name: DEFAULTS[name] for name in _with_role("fla_only")}
# Everything but the tensors and the FLA-only options: what a spec records of the call's choices.
OPTIONS: tuple[str, ...] = _with_role("flag", "number", "int", "count")

# Fast readers for the per-call path: each returns a tuple of the named values, in the order above.
tensors_of = operator.attrgetter(*TENSORS)
flags_of = operator.attrgetter(*FLAGS)
options_of = operator.attrgetter(*OPTIONS)
_fla_only_one = operator.attrgetter(*FLA_ONLY)  # one name: attrgetter returns the value itself


def _fla_only_of(args: KDAArguments) -> tuple[Any, ...]:
    value = _fla_only_one(args)
    return value if len(FLA_ONLY) > 1 else (value,)


_FLA_ONLY_DEFAULTS = tuple(FLA_ONLY.values())


def signature(
    *, extra: dict[str, Any] | None = None, return_annotation: Any = inspect.Signature.empty
) -> inspect.Signature:
    """`KDAArguments`' parameters as a function signature (for `help()` on functions that take them
    through ``*args, **kwargs``), with `extra` keyword-only parameters (name -> default) appended."""
    params = list(inspect.signature(KDAArguments).parameters.values())
    for name, default in (extra or {}).items():
        params.append(inspect.Parameter(name, inspect.Parameter.KEYWORD_ONLY, default=default))
    return inspect.Signature(params, return_annotation=return_annotation)


def normalised(args: KDAArguments) -> KDAArguments:
    """The call as the backends receive it, with FLA's looser inputs made exact (new tensors, never a
    change to the caller's): a v of another float dtype than q's promotes both to the wider one (the
    output comes back in v's dtype, as FLA's does); the in-kernel gate's ``A_log`` (any shape with HV
    values, such as transformers' ``[1, 1, HV, 1]``) becomes ``[HV]`` and, with ``dt_bias``, float32 (float64
    for float64 calls), since the gate is computed in float32. Anything malformed is left as it is, for
    `KDASpec` to name."""
    q, k, v = args.q, args.k, args.v
    tensors = all(isinstance(t, torch.Tensor) for t in (q, k, v))
    if tensors and v.dtype != q.dtype and v.is_floating_point() and q.is_floating_point() and k.dtype == q.dtype:
        wide = torch.promote_types(q.dtype, v.dtype)
        args = dataclasses.replace(args, q=q.to(wide), k=k.to(wide), v=v.to(wide))
    if not (args.use_gate_in_kernel is True and tensors and v.dim() == 4):
        return args
    HV, K = v.shape[2], q.shape[-1]
    A_log, dt_bias = args.A_log, args.dt_bias
    wanted = torch.float64 if args.q.dtype == torch.float64 else torch.float32  # the gate's precision
    if (
        isinstance(A_log, torch.Tensor)
        and A_log.is_floating_point()
        and A_log.numel() == HV
        and (A_log.dim() != 1 or A_log.dtype != wanted)
    ):
        args = dataclasses.replace(args, A_log=A_log.reshape(HV).to(wanted))
    if (
        isinstance(dt_bias, torch.Tensor)
        and dt_bias.is_floating_point()
        and dt_bias.numel() == HV * K
        and (dt_bias.dtype != wanted or tuple(dt_bias.shape) not in ((HV * K,), (HV, K)))
    ):
        args = dataclasses.replace(args, dt_bias=dt_bias.reshape(HV * K).to(wanted))
    return args
