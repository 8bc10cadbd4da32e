"""The kernels a call needs, with their compile-time parameters, and compiling them.

`specializations` lists every kernel of a call: the forward's three (`intra`, `state`, `output`) and, when
the call trains, the backward's five (`state_backward`, `chunk_backward`, `score_backward`, `gate_tail`,
`qk_tail`). The backend compiles them all before it says yes to a call (`TileLangBackend.supports`), the
forward and backward launch what `compile_all` returns, and CI lowers the same list for every shape class
the backend claims. Sequence length, batch and the varlen layout are not parameters: they are dynamic in
every kernel.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, NamedTuple

import torch

from kda.backends.tilelang import (
    chunk_backward,
    gate,
    intra,
    output,
    runtime,
    score_backward,
    state,
    state_backward,
    tails,
)
from kda.spec import GateMode, KDASpec

GATES = {GateMode.PREGATED: gate.PREGATED, GateMode.SOFTPLUS: gate.SOFTPLUS}
GATES |= {GateMode.SIGMOID: gate.SIGMOID, GateMode.SAFE: gate.SAFE}
BV = 64  # value columns per program of the state and output stages


class Kernel(NamedTuple):
    name: str
    builder: Callable[..., Any]
    params: tuple[Any, ...]


def dtype_name(dtype: torch.dtype | str) -> str:
    return str(dtype).removeprefix("torch.")


def specializations(spec: KDASpec) -> list[Kernel]:
    """The kernels of `spec`: the forward's three, and the backward's five when the call trains."""
    C, K, V = spec.chunk_size, spec.K, spec.V
    dtype = dtype_name(spec.dtype)
    bv = min(BV, V)
    has_h0 = spec.initial_state is not None
    gate_params = (
        GATES[spec.gate_mode],
        spec.dt_bias is not None,
        spec.use_beta_sigmoid_in_kernel,
        spec.g.dtype,
        spec.beta.dtype,
        float(spec.lower_bound or 0.0),
        2.0 if spec.allow_neg_eigval else 1.0,
    )
    train = spec.requires_grad
    l2norm = spec.use_qk_l2norm_in_kernel
    state_flags = (has_h0, spec.output_final_state, spec.state_v_first)
    kernels = [
        Kernel("intra", intra.build, (C, K, V, dtype, float(spec.scale), l2norm, *gate_params, train)),
        Kernel("state", state.build, (C, K, V, bv, dtype, *state_flags, train)),
        Kernel("output", output.build, (C, K, V, bv, dtype, "float32" if train else dtype)),
    ]
    if train:
        kernels += _backward(spec, dtype, gate_params)
    return kernels


def _backward(spec: KDASpec, dtype: str, gate_params: tuple[Any, ...]) -> list[Kernel]:
    """The backward's kernels (``dtype`` the inputs' dtype name, ``gate_params`` as `intra` takes them: gate
    mode, dt_bias, beta sigmoid, the gate's and beta's dtypes, lower bound, beta scale)."""
    C, K, V = spec.chunk_size, spec.K, spec.V
    l2norm = spec.use_qk_l2norm_in_kernel  # the stages read q, k as given, and with the l2norm their scales
    state_flags = (spec.output_final_state, spec.initial_state is not None, spec.state_v_first)
    return [
        Kernel("state_backward", state_backward.build, (C, K, V, state_backward.block_v(K, V), dtype, *state_flags)),
        Kernel("chunk_backward", chunk_backward.build, (C, K, V, dtype, float(spec.scale), l2norm)),
        Kernel("score_backward", score_backward.build, (C, K, dtype, l2norm)),
        Kernel("gate_tail", tails.build_gate_tail, (C, K, *gate_params)),
        Kernel("qk_tail", tails.build_qk_tail, (C, K, dtype, l2norm)),
    ]


def compile_all(spec: KDASpec) -> dict[str, Any]:
    """The compiled kernels of `spec`, by stage name (raises `runtime.CompileFailure`)."""
    kernels = specializations(spec)
    built = runtime.compile_all([(kernel.builder, kernel.params) for kernel in kernels])
    return {kernel.name: compiled for kernel, compiled in zip(kernels, built, strict=True)}
