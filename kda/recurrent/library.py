"""`fused_recurrent_kda` under ``torch.compile``: the call as one custom op, ``torch.ops.kda.fused_recurrent_kda``.

The same design as `chunk_kda`'s op (`kda.library`, docs/design.md "torch.compile and CUDA graphs"): the
traced wrapper only encodes the call's values; the contract (`RecurrentSpec`) and the backend choice run in
the op's fake implementation while tracing, outside the graph, where lazy verification can happen; the
real implementation validates again (the spec memo) and raises kda's own errors when the compiled code runs.

What is particular to the decode op:

- **It mutates its arguments.** A state pool updated in place (``inplace_final_state=True``) and an
  ``out=`` buffer are written by the op, so both are declared in ``mutates_args``: the compiler orders the
  op against every other use of them, and a compiled caller sees the writes. A custom op may not return
  what it mutates, so the op returns a 0-element placeholder in their place and the wrapper hands back
  ``out`` (as ``o``) and the pool (as ``final_state``) themselves, as the eager call does.
- **Forward only**, as eagerly: a traced call whose inputs require grad becomes a refusal that the op
  raises (`KDAInputError` naming the tensor) when it runs.
- Unknown keywords are ignored (eager kda also warns once; traced code cannot); FLA's deprecated
  ``transpose_state_layout`` is taken as ``state_v_first``.
"""

from __future__ import annotations

import dataclasses
import warnings
from dataclasses import dataclass
from typing import Any

import torch

from kda import dispatch
from kda.backends.base import RecurrentInputs
from kda.errors import KDAError
from kda.library import (
    SEPARATOR,
    OpParameter,
    concrete,
    decode_arguments,
    decode_request,
    define_op,
    encode_arguments,
    encode_request,
    owned,
    placeholder,
    raise_refusal,
)
from kda.recurrent.spec import RecurrentSpec
from kda.routes import current, note

# `fused_recurrent_kda`'s arguments in its order (the positional ones, then the serving keywords).
ARGUMENTS: tuple[OpParameter, ...] = (
    OpParameter("q", "tensor"),
    OpParameter("k", "tensor"),
    OpParameter("v", "tensor"),
    OpParameter("g", "tensor"),
    OpParameter("beta", "tensor"),
    OpParameter("A_log", "tensor?"),
    OpParameter("dt_bias", "tensor?"),
    OpParameter("scale", "float?"),
    OpParameter("initial_state", "tensor?"),
    OpParameter("output_final_state", "bool", False),
    OpParameter("use_qk_l2norm_in_kernel", "bool", False),
    OpParameter("use_gate_in_kernel", "bool", False),
    OpParameter("use_beta_sigmoid_in_kernel", "bool", False),
    OpParameter("allow_neg_eigval", "bool", False),
    OpParameter("lower_bound", "float?"),
    OpParameter("state_v_first", "bool", False),
    OpParameter("cu_seqlens", "tensor?"),
    OpParameter("ssm_state_indices", "tensor?"),
    OpParameter("num_accepted_tokens", "tensor?"),
    OpParameter("inplace_final_state", "bool", False),
    OpParameter("out", "tensor?"),
)
PARAMETERS: tuple[OpParameter, ...] = (
    *ARGUMENTS,
    OpParameter("backend", "str", "auto"),
    OpParameter("backend_is_list", "bool", False),
    OpParameter("refused", "str", ""),
)
_NAMES = tuple(p.name for p in ARGUMENTS)
_GRADIENT_INPUTS = ("q", "k", "v", "g", "beta", "A_log", "dt_bias", "initial_state")  # as the eager rule names them


@dataclass
class _DecodeCall:
    """One decode call as the op receives it."""

    given: dict[str, Any]
    request: dispatch.Request
    refused: str

    @classmethod
    def of(cls, values: tuple[Any, ...]) -> _DecodeCall:
        given = decode_arguments(ARGUMENTS, values[: len(ARGUMENTS)])
        names, is_list, refused = values[len(ARGUMENTS) :]
        return cls(given, decode_request(names, is_list), refused)

    def spec(self, *, read_host_values: bool = True) -> RecurrentSpec:
        raise_refusal(self.refused)
        return RecurrentSpec.from_call(**self.given, read_host_values=read_host_values)

    def inputs(self) -> RecurrentInputs:
        a = self.given
        return RecurrentInputs(
            a["q"], a["k"], a["v"], a["g"], a["beta"], a["A_log"], a["dt_bias"], a["initial_state"],
            a["cu_seqlens"], a["ssm_state_indices"], a["num_accepted_tokens"], a["out"],
        )  # fmt: skip


def fused_recurrent_kda_call(given: dict[str, Any], extra: dict[str, Any], request: Any) -> tuple[Any, Any]:
    """`kda.fused_recurrent_kda` under ``torch.compile``: the call as one op node (see the module docstring).
    `given` holds the call's arguments by name, `extra` its unknown keywords. Traced by Dynamo."""
    refused = ""
    values = [given[name] for name in _NAMES]
    old = extra.get("transpose_state_layout")
    if old is not None:
        if given["state_v_first"]:
            rule = "is the deprecated name of state_v_first; pass only one"
            refused = SEPARATOR.join(("transpose_state_layout", rule, type(old).__name__))
        values[_NAMES.index("state_v_first")] = bool(old)
    if torch.is_grad_enabled():
        for name in _GRADIENT_INPUTS:
            tensor = given[name]
            if isinstance(tensor, torch.Tensor) and tensor.requires_grad and not refused:
                rule = (
                    "fused_recurrent_kda is forward-only (as FLA's): call it under torch.no_grad() or "
                    "torch.inference_mode(), or use kda.chunk_kda, which trains"
                )
                refused = SEPARATOR.join((name, rule, "a tensor that requires grad"))
    encoded, bad_value = encode_arguments(ARGUMENTS, values)
    names, is_list, bad_request = encode_request(request)
    o, final_state = torch.ops.kda.fused_recurrent_kda(*encoded, names, is_list, refused or bad_value or bad_request)
    out, pool = given["out"], given["initial_state"]
    if isinstance(out, torch.Tensor):
        o = out  # written by the op (a mutated argument)
    if given["inplace_final_state"] is True:
        return o, pool  # the pool, updated in place by the op
    return o, (final_state if given["output_final_state"] is True else None)


def _decode_forward(*values: Any) -> tuple[torch.Tensor, torch.Tensor]:
    """The op's real implementation: eager kda's path, from the op's values."""
    call = _DecodeCall.of(values)
    spec = call.spec()
    backend = dispatch.select(spec, call.request)
    inputs = call.inputs()
    result = backend.recurrent_forward(inputs, spec)
    note(backend, "forward", spec, current())  # type: ignore[arg-type]
    unowned = [t for t in (inputs.q, inputs.k, inputs.v, inputs.g, inputs.beta) if t is not None]
    o = placeholder(inputs.q) if inputs.out is not None else owned(result.o, unowned)
    if spec.inplace_final_state or not spec.output_final_state or result.final_state is None:
        return o, placeholder(inputs.q)
    return o, owned(result.final_state, [*unowned, inputs.initial_state])


def _check_while_tracing(call: _DecodeCall) -> None:
    """Validate and choose the backend now, outside the graph (lazy verification runs on real tensors, out of
    the fake mode). A kda error is warned, not raised: the real op raises it when it runs."""
    stand_ins: dict[str, Any] = {}
    for name, value in call.given.items():
        if isinstance(value, torch.Tensor):
            stand_in = concrete(value)
            if stand_in is None:
                return  # an unbacked size: the real op checks the call when it runs
            stand_ins[name] = stand_in
    traced = dataclasses.replace(call, given={**call.given, **stand_ins})
    try:
        spec = traced.spec(read_host_values=False)  # fake tensors have no values to read
        with torch._subclasses.fake_tensor.unset_fake_temporarily():
            dispatch.select(spec, traced.request)
    except KDAError as error:
        warnings.warn(
            f"kda.fused_recurrent_kda under torch.compile: this call raises {type(error).__name__} when it runs: "
            f"{error}",
            RuntimeWarning,
            stacklevel=2,
        )


def _decode_fake(*values: Any) -> tuple[torch.Tensor, torch.Tensor]:
    """The op's shapes while tracing: ``o`` (v's shape, q's dtype; a placeholder when ``out`` takes it) and
    a new fp32 ``[N, HV, K, V]`` state with ``output_final_state`` and no pool written in place."""
    call = _DecodeCall.of(values)
    _check_while_tracing(call)
    g = call.given
    q, v = g["q"], g["v"]
    o = placeholder(q) if g["out"] is not None else v.new_empty(v.shape, dtype=q.dtype)
    if g["inplace_final_state"] or not g["output_final_state"] or q.dim() != 4 or v.dim() != 4:
        return o, placeholder(q)
    cu_seqlens = g["cu_seqlens"]
    N = cu_seqlens.shape[0] - 1 if cu_seqlens is not None and cu_seqlens.dim() == 1 else q.shape[0]
    K, HV, V = q.shape[3], v.shape[2], v.shape[3]
    return o, q.new_empty((N, HV, V, K) if g["state_v_first"] else (N, HV, K, V), dtype=torch.float32)


_decode_op = define_op(
    "fused_recurrent_kda",
    PARAMETERS,
    tuple[torch.Tensor, torch.Tensor],
    _decode_forward,
    _decode_fake,
    mutates_args=("initial_state", "out"),
)
