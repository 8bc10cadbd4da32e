"""kda's calls as `torch.library` custom ops: what ``torch.compile`` (and so a CUDA graph) sees of kda.

Dynamo cannot trace kda's eager path (pydantic validation, the dispatcher's context variables, the records
on disk, a Python `autograd.Function` holding a backend object). Under ``torch.compile``, `kda.chunk_kda`
calls instead one custom op, ``torch.ops.kda.chunk_kda``, which the compiled graph holds as one opaque node
(docs/design.md, "torch.compile and CUDA graphs"):

- **The schema is declared once.** The op's parameters are `kda.options.KDAArguments`' fields in their
  order (`op_parameters`: a tensor field is a ``Tensor``/``Tensor?``, a flag a ``bool``, a number a
  ``float?``; a field of a type no schema carries, such as ``cp_context``, travels as a bool "was it set"),
  then `CALL_PARAMETERS`: the backend request, whether gradients are needed, and a refusal found while
  tracing. Its results are `CHUNK_OUTPUTS`. A new field of `KDAArguments` becomes a new parameter.
- **The fake implementation runs while tracing**, as plain Python (outside Dynamo's bytecode tracing,
  where pydantic runs): it validates the call and chooses the backend, so that lazy verification happens
  then, outside the graph and before any CUDA-graph capture, and returns results of the right shapes and
  dtypes. A call it finds invalid is not refused there (Dynamo turns any exception raised while tracing
  into one of its own): it warns, and the real implementation raises.
- **The real implementation runs when the compiled code runs**: it builds the spec again (a memo hit),
  selects (a cached decision) and runs the backend, as eager does. So every error eager raises, a compiled
  call raises too, with its type (`KDAInputError`, `BackendSelectionError`), before any kernel runs.
- **Autograd**: the op's registered backward is a second op, ``torch.ops.kda.chunk_kda_backward``, taking
  the same parameters. It cannot receive what the backend's forward saved (Python objects), so it selects
  again (the same cached decision, so the same backend as the forward) and, for a backend whose backward
  reads ``saved`` (`Backend.saves_for_backward`), runs that forward again: one extra forward per
  backward, as the torch backend's own backward already costs.

`define_op` is the same mechanism for other kda ops (`fused_recurrent_kda`, whose in-place state update is
a mutating op): a dataclass of arguments becomes a schema, `encode_arguments` turns a call into the op's
values inside traced code, `decode_arguments` turns them back in the implementations.
"""

from __future__ import annotations

import contextlib
import dataclasses
import inspect
import warnings
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any, Optional

import torch

from kda import dispatch, options
from kda.backends.base import Backend, KDAInputs
from kda.errors import KDAError, KDAInputError
from kda.options import KDAArguments
from kda.routes import current as current_routes
from kda.routes import note
from kda.spec import KDASpec

NAMESPACE = "kda"

# How a declared annotation (a string: the options module uses `from __future__ import annotations`)
# travels through a schema: its kind, then the annotation torch.library infers the schema type from
# (Optional[...] rather than `X | None`: every torch from 2.4 reads it).
_KINDS: dict[str, str] = {
    "torch.Tensor": "tensor",
    "torch.Tensor | None": "tensor?",
    "bool": "bool",
    "int": "int",
    "int | None": "int?",
    "float": "float",
    "float | None": "float?",
    "str": "str",
}
_ANNOTATIONS: dict[str, Any] = {
    "tensor": torch.Tensor,
    "tensor?": Optional[torch.Tensor],  # noqa: UP045
    "bool": bool,
    "int": int,
    "int?": Optional[int],  # noqa: UP045
    "float": float,
    "float?": Optional[float],  # noqa: UP045
    "str": str,
}
SEPARATOR = "\x00"  # joins the names of a backend list and the parts of a refusal into one schema string


@dataclass(frozen=True)
class OpParameter:
    """One parameter of a kda op's schema, made from one field of an arguments dataclass.

    ``kind`` is what the schema carries (a key of `_ANNOTATIONS`: "tensor", "tensor?", "bool", "int",
    "int?", "float", "float?", "str"). ``set_only`` marks a field of a type no schema carries: its value
    travels as a bool, "was it set to other than its default" (only the default is accepted there).
    """

    name: str
    kind: str
    default: Any = None
    set_only: bool = False

    @property
    def annotation(self) -> Any:
        return _ANNOTATIONS[self.kind]

    def fits(self, value: Any) -> str | None:
        """What `value` must be to travel as this parameter, when it cannot (else None). Plain Python that
        Dynamo traces (strings and isinstance): the contract's own rules run later, in `KDASpec`."""
        kind = self.kind
        if self.set_only or (value is None and kind.endswith("?")):
            return None
        if kind.startswith("tensor"):
            if value is None:
                return "is required: a torch.Tensor"
            return None if isinstance(value, torch.Tensor) else "must be a torch.Tensor"
        if kind == "bool":
            return None if isinstance(value, bool) else "must be a bool"
        if kind.startswith("int"):
            return None if isinstance(value, int) and not isinstance(value, bool) else "must be an int"
        if kind.startswith("float"):
            ok = isinstance(value, (int, float)) and not isinstance(value, bool)
            return None if ok else "must be a real number (int or float) or None"
        return None if isinstance(value, str) else "must be a str"

    def encode(self, value: Any) -> Any:
        return (value is not self.default) if self.set_only else value

    def decode(self, value: Any) -> Any:
        if self.set_only:
            return _SetUnderCompile(self.name) if value else self.default
        return value


class _SetUnderCompile:
    """Stands for a value set on a parameter that travels as "was it set" (its real value stayed in the
    traced program), so that the rule refusing it can name it."""

    def __init__(self, name: str):
        self.name = name

    def __repr__(self) -> str:
        return f"<a value for {self.name} (given under torch.compile)>"


def op_parameters(arguments: type) -> tuple[OpParameter, ...]:
    """The schema parameters of an arguments dataclass (such as `KDAArguments`), one per field, in order."""
    found = []
    for f in dataclasses.fields(arguments):
        kind = _KINDS.get(str(f.type))
        default = None if f.default is dataclasses.MISSING else f.default
        found.append(OpParameter(f.name, kind or "bool", default, set_only=kind is None))
    return tuple(found)


def define_op(
    name: str,
    parameters: Sequence[OpParameter],
    returns: Any,
    impl: Callable[..., Any],
    fake: Callable[..., Any],
    *,
    mutates_args: Sequence[str] = (),
) -> Any:
    """Register ``torch.ops.kda.<name>``: a custom op whose schema is `parameters` (all positional, in
    order) returning `returns` (an annotation: ``torch.Tensor`` or a tuple of them). `impl` runs the op,
    `fake` gives its results' shapes while tracing; both are called with the values in parameter order.
    `mutates_args` names the parameters the op writes in place (a state pool, an ``out=`` buffer): the
    compiler then orders the op against every other use of them, and the op returns nothing it mutated.

    Returns the op (a `torch.library.CustomOpDef`; ``op.register_autograd`` adds a backward).
    """
    signature = inspect.Signature(
        [
            inspect.Parameter(p.name, inspect.Parameter.POSITIONAL_OR_KEYWORD, annotation=p.annotation)
            for p in parameters
        ],
        return_annotation=returns,
    )

    def run(*values: Any) -> Any:
        return impl(*values)

    def run_fake(*values: Any) -> Any:
        return fake(*values)

    run.__signature__ = signature  # type: ignore[attr-defined]  # what torch.library infers the schema from
    run.__name__ = name
    op = torch.library.custom_op(f"{NAMESPACE}::{name}", run, mutates_args=tuple(mutates_args))
    op.register_fake(run_fake)
    return op


def encode_arguments(parameters: Sequence[OpParameter], values: Sequence[Any]) -> tuple[list[Any], str]:
    """A call's argument values as the op takes them, and the first refusal (``""`` when none): the
    parameter a value cannot travel as, the rule, and the value's type, joined. Traced by Dynamo."""
    encoded, refused = [], ""
    for parameter, value in zip(parameters, values):
        problem = parameter.fits(value)
        if problem is not None:
            if not refused:
                refused = SEPARATOR.join((parameter.name, problem, type(value).__name__))
            value = parameter.default
        encoded.append(parameter.encode(value))
    return encoded, refused


def decode_arguments(parameters: Sequence[OpParameter], values: Sequence[Any]) -> dict[str, Any]:
    """The op's values back as the call's arguments, by name."""
    return {p.name: p.decode(v) for p, v in zip(parameters, values)}


def raise_refusal(refused: str) -> None:
    """Raise the `KDAInputError` that `encode_arguments` (or a traced check) found, if any."""
    if refused:
        argument, rule, got = refused.split(SEPARATOR)
        raise KDAInputError(argument, rule, got)


def encode_request(request: Any) -> tuple[str, bool, str]:
    """A backend request as the op takes it: (names joined, whether it was a list, a refusal)."""
    if isinstance(request, str):
        return request, False, ""
    if isinstance(request, (list, tuple)) and request and all(isinstance(n, str) for n in request):
        return SEPARATOR.join(request), True, ""
    rule = "must be 'auto', a backend name, or a non-empty list or tuple of names"
    return "auto", False, SEPARATOR.join(("backend", rule, type(request).__name__))


def decode_request(names: str, is_list: bool) -> dispatch.Request:
    return list(names.split(SEPARATOR)) if is_list else names


@contextlib.contextmanager
def autograd_inside_op() -> Iterator[None]:
    """Let autograd record inside a custom op's implementation.

    torch runs a custom op's implementation below the autograd dispatch keys (they are excluded there), so
    a backend that differentiates its own recomputation (torch) or keeps an autograd graph between its
    forward and backward (fla) would get tensors without history. Eager kda runs backends above them; this
    restores that, and leaves every other key (autocast's among them) as the op found it.
    """
    key = torch._C.DispatchKey
    include = torch._C._dispatch_tls_local_include_set()
    exclude = torch._C._dispatch_tls_local_exclude_set()
    for autograd_key in (key.AutogradFunctionality, key.AutogradOther, key.AutogradNestedTensor):
        exclude = exclude.remove(autograd_key)
    with torch._C._ForceDispatchKeyGuard(include, exclude):
        yield


# ---------------------------------------------------------------------------------------------- chunk_kda
ARGUMENTS: tuple[OpParameter, ...] = op_parameters(KDAArguments)
# After the arguments: the backend request (names, whether a list), whether gradients are needed (the case
# class differs, and the fake cannot see `requires_grad` through the op), and a refusal found while tracing.
CALL_PARAMETERS: tuple[OpParameter, ...] = (
    OpParameter("backend", "str", "auto"),
    OpParameter("backend_is_list", "bool", False),
    OpParameter("requires_grad", "bool", False),
    OpParameter("refused", "str", ""),
)
CHUNK_PARAMETERS = ARGUMENTS + CALL_PARAMETERS
# The op's results, in order. final_state is a 0-element fp32 placeholder when the call asks for none (a
# custom op returns tensors, not None). An option that adds a result adds a name here and a tensor to
# `_chunk_results` and `_chunk_fake`.
CHUNK_OUTPUTS: tuple[str, ...] = ("o", "final_state")
_DIFFERENTIABLE = frozenset(options.DIFFERENTIABLE)
_GRADIENT_INPUTS: tuple[str, ...] = KDAInputs.DIFFERENTIABLE  # KDAGradients.as_tuple()'s order


@dataclass
class _ChunkCall:
    """One `chunk_kda` call as the ops receive it: the arguments, the request, and what was found."""

    args: KDAArguments
    request: dispatch.Request
    requires_grad: bool
    refused: str

    @classmethod
    def of(cls, values: Sequence[Any]) -> _ChunkCall:
        given = decode_arguments(ARGUMENTS, values[: len(ARGUMENTS)])
        names, is_list, requires_grad, refused = values[len(ARGUMENTS) : len(CHUNK_PARAMETERS)]
        return cls(KDAArguments(**given), decode_request(names, is_list), requires_grad, refused)

    def spec(self, *, read_host_values: bool = True) -> KDASpec:
        raise_refusal(self.refused)
        return KDASpec.from_args(self.args, self.requires_grad, read_host_values=read_host_values)

    def inputs(self) -> KDAInputs:
        a = self.args
        tensors = (a.q, a.k, a.v, a.g, a.beta, a.A_log, a.dt_bias, a.initial_state)
        return KDAInputs(*tensors, a.cu_seqlens, a.cu_seqlens_cpu)


def chunk_kda_call(args: KDAArguments, extra: dict[str, Any], request: Any) -> tuple[torch.Tensor, Any]:
    """`kda.chunk_kda` under ``torch.compile``: the call as one ``torch.ops.kda.chunk_kda`` node.

    Traced by Dynamo, so plain Python only: it encodes the arguments, takes FLA's deprecated
    ``transpose_state_layout`` as eager does, and leaves every rule to the op (see the module docstring).
    """
    v_dtype = args.v.dtype if isinstance(args.v, torch.Tensor) else None
    args = options.normalised(args)  # plain tensor ops (a promoted v, A_log as [HV] float32): traced
    values = [getattr(args, p.name) for p in ARGUMENTS]
    refused = ""
    if args.return_intermediate_states:
        rule = "is not available under torch.compile (the op returns o and final_state); call it eagerly"
        refused = SEPARATOR.join(("return_intermediate_states", rule, "True"))
    if extra:
        extra = dict(extra)
        old = extra.pop("transpose_state_layout", None)
        if old is not None:
            if args.state_v_first:
                rule = "is the deprecated name of state_v_first; pass only one"
                refused = SEPARATOR.join(("transpose_state_layout", rule, type(old).__name__))
            values[_STATE_V_FIRST] = bool(old)
        head_first = extra.pop("head_first", None)
        if head_first is not None and head_first is not False and not refused:
            rule = "must be False: q, k, v are time-major [B, T, H, K]"
            refused = SEPARATOR.join(("head_first", rule, type(head_first).__name__))
        # any other keyword is ignored, as FLA ignores it (eager kda also warns once; traced code cannot)
    encoded, bad_value = encode_arguments(ARGUMENTS, values)
    names, is_list, bad_request = encode_request(request)
    requires_grad = torch.is_grad_enabled() and any(
        isinstance(t, torch.Tensor) and t.requires_grad for t, p in zip(values, ARGUMENTS) if p.name in _DIFFERENTIABLE
    )
    refused = refused or bad_value or bad_request
    o, final_state = torch.ops.kda.chunk_kda(*encoded, names, is_list, requires_grad, refused)
    if v_dtype is not None and o.dtype != v_dtype:  # v was promoted (see `kda.options.normalised`)
        o = o.to(v_dtype)
    return o, (final_state if args.output_final_state else None)


_STATE_V_FIRST = next(i for i, p in enumerate(ARGUMENTS) if p.name == "state_v_first")


def placeholder(like: torch.Tensor) -> torch.Tensor:
    return like.new_empty((0,), dtype=torch.float32)


def owned(result: torch.Tensor, inputs: Sequence[torch.Tensor | None]) -> torch.Tensor:
    """`result` contiguous (the layout the fake promised) and sharing no memory with an input (a custom
    op's results may not alias its arguments)."""
    result = result.contiguous()
    storage = result.untyped_storage().data_ptr()
    if any(t is not None and t.untyped_storage().data_ptr() == storage for t in inputs):
        result = result.clone()
    return result


def _chunk_results(spec: KDASpec, o: torch.Tensor, final_state: torch.Tensor | None, inputs: KDAInputs):
    tensors = list(inputs.differentiable().values())
    if spec.output_final_state and final_state is not None:
        final = owned(final_state, tensors)
    else:
        final = placeholder(o)
    return owned(o, tensors), final


def _chunk_forward(*values: Any) -> tuple[torch.Tensor, torch.Tensor]:
    """The op's real implementation: eager kda's path, from the op's values."""
    call = _ChunkCall.of(values)
    spec = call.spec()
    backend = dispatch.select(spec, call.request)
    inputs = call.inputs()
    if spec.requires_grad:  # as eager's autograd.Function runs it: grad mode off, autograd recording
        with autograd_inside_op(), torch.no_grad():
            result = backend.forward(inputs, spec)
    else:
        result = backend.forward(inputs, spec)
    note(backend, "forward", spec, current_routes())
    return _chunk_results(spec, result.o, result.final_state, inputs)


def concrete(tensor: torch.Tensor | None) -> torch.Tensor | None:
    """A stand-in for `tensor` with plain int sizes (each symbolic size at its hint), so that the contract
    can be checked while tracing with dynamic shapes; None when a size has no hint (unbacked)."""
    if tensor is None or all(isinstance(s, int) for s in tensor.shape):
        return tensor
    sizes = []
    for size in tensor.shape:
        hint = size if isinstance(size, int) else getattr(size.node, "hint", None)
        if hint is None:
            return None
        sizes.append(int(hint))
    return tensor.new_empty(sizes)


def _check_while_tracing(call: _ChunkCall) -> None:
    """Validate and choose the backend now, as plain Python outside the graph: lazy verification (real
    tensors, so outside the fake mode) happens here, before the compiled code first runs. A kda error is
    not raised here (Dynamo would turn it into one of its own) but warned: the real op raises it."""
    stand_ins: dict[str, Any] = {}
    for name in options.TENSORS:
        tensor = getattr(call.args, name)
        stand_in = concrete(tensor)
        if tensor is not None and stand_in is None:
            return  # an unbacked size: the real op checks the call when it runs
        stand_ins[name] = stand_in
    traced = _ChunkCall(dataclasses.replace(call.args, **stand_ins), call.request, call.requires_grad, call.refused)
    try:
        spec = traced.spec(read_host_values=False)  # fake tensors have no values to read
        # Verification computes on real tensors, and differentiates for a training class: out of the fake
        # mode, and with autograd recording as eagerly (the fake runs below autograd too).
        with torch._subclasses.fake_tensor.unset_fake_temporarily(), autograd_inside_op(), torch.enable_grad():
            dispatch.select(spec, traced.request)
    except KDAError as error:
        warnings.warn(
            f"kda.chunk_kda under torch.compile: this call raises {type(error).__name__} when it runs: {error}",
            RuntimeWarning,
            stacklevel=2,
        )


def _chunk_fake(*values: Any) -> tuple[torch.Tensor, torch.Tensor]:
    """The op's shapes while tracing: ``o [B, T, HV, V]`` (v's shape) in q's dtype, and the final state
    ``[N, HV, K, V]`` (``[N, HV, V, K]`` with ``state_v_first``) fp32, or the placeholder."""
    call = _ChunkCall.of(values)
    _check_while_tracing(call)
    a = call.args
    q, v = a.q, a.v
    o = v.new_empty(v.shape, dtype=q.dtype)
    if not a.output_final_state or q.dim() != 4 or v.dim() != 4:
        return o, placeholder(q)
    N = a.cu_seqlens.shape[0] - 1 if a.cu_seqlens is not None and a.cu_seqlens.dim() == 1 else q.shape[0]
    K, HV, V = q.shape[3], v.shape[2], v.shape[3]
    shape = (N, HV, V, K) if a.state_v_first else (N, HV, K, V)
    return o, q.new_empty(shape, dtype=torch.float32)


# ------------------------------------------------------------------------------------- chunk_kda backward
def _chunk_backward(*values: Any) -> tuple[torch.Tensor, ...]:
    """The backward op's real implementation: the gradient of every differentiable input, in
    `KDAGradients.as_tuple()` order (a 0-element placeholder for an input that is None)."""
    do, dfinal_state = values[len(CHUNK_PARAMETERS) :]
    call = _ChunkCall.of(values)
    spec = call.spec()
    backend = _backward_backend(spec, call.request)
    inputs = call.inputs()
    with autograd_inside_op(), torch.no_grad():
        saved = backend.forward(inputs, spec).saved if backend.saves_for_backward else None
        grads = backend.backward(inputs, spec, saved, do, dfinal_state)
    note(backend, "backward", spec, current_routes())
    tensors = list(inputs.differentiable().values())
    return tuple(
        placeholder(do) if t is None else owned(grad if grad is not None else torch.zeros_like(t), tensors)
        for t, grad in zip(tensors, grads.as_tuple())
    )


def _backward_backend(spec: KDASpec, request: dispatch.Request) -> Backend:
    """The backend the forward ran on: the same spec and request give the same cached decision, unless
    the registry or the records changed in between (then the newly chosen one, verified for this
    training class, computes both the recomputed forward and the backward)."""
    return dispatch.select(spec, request)


def _chunk_backward_fake(*values: Any) -> tuple[torch.Tensor, ...]:
    call = _ChunkCall.of(values)
    do = values[len(CHUNK_PARAMETERS)]
    return tuple(
        placeholder(do) if t is None else t.new_empty(t.shape) for t in call.inputs().differentiable().values()
    )


def _setup_context(ctx: Any, inputs: tuple[Any, ...], output: Any) -> None:
    positions = [i for i, value in enumerate(inputs) if isinstance(value, torch.Tensor)]
    ctx.positions = positions
    ctx.values = [None if i in positions else value for i, value in enumerate(inputs)]
    ctx.save_for_backward(*(inputs[i] for i in positions))


def _chunk_autograd(ctx: Any, do: torch.Tensor, dfinal_state: torch.Tensor | None) -> tuple[Any, ...]:
    values = list(ctx.values)
    for i, tensor in zip(ctx.positions, ctx.saved_tensors):
        values[i] = tensor
    call = decode_arguments(ARGUMENTS, values[: len(ARGUMENTS)])
    if not call["output_final_state"]:
        dfinal_state = None
    grads = dict(zip(_GRADIENT_INPUTS, torch.ops.kda.chunk_kda_backward(*values, do, dfinal_state)))
    wanted = getattr(ctx, "needs_input_grad", None) or (True,) * len(values)
    return tuple(
        grads[p.name] if p.name in grads and values[i] is not None and wanted[i] else None
        for i, p in enumerate(CHUNK_PARAMETERS)
    )


_chunk_op = define_op(
    "chunk_kda",
    CHUNK_PARAMETERS,
    tuple[torch.Tensor, torch.Tensor],
    _chunk_forward,
    _chunk_fake,
)
_chunk_backward_op = define_op(
    "chunk_kda_backward",
    (*CHUNK_PARAMETERS, OpParameter("do", "tensor"), OpParameter("dfinal_state", "tensor?")),
    tuple[(torch.Tensor,) * len(_GRADIENT_INPUTS)],  # type: ignore[misc]
    _chunk_backward,
    _chunk_backward_fake,
)
_chunk_op.register_autograd(_chunk_autograd, setup_context=_setup_context)
