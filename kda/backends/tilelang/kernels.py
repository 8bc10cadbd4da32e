"""The kernels a call needs, with their compile-time parameters, and compiling them.

`specializations` lists every kernel of a call: the forward's (`intra`, `state`, and `output` where
`state_plan` leaves it a launch of its own) and, when
the call trains, the backward's five (`state_backward`, `chunk_backward`, `score_backward`, `gate_tail`,
`qk_tail`). The backend compiles them all before it says yes to a call (`TileLangBackend.supports`), the
forward and backward launch what `compile_all` returns, and CI lowers the same list for every shape class
the backend claims. Sequence length, batch and the varlen layout are not parameters: they are dynamic in
every kernel.
"""

from __future__ import annotations

import functools
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
BV = 64  # value columns per program of the output stage, and of the state pass when it is alone


class Kernel(NamedTuple):
    name: str
    builder: Callable[..., Any]
    params: tuple[Any, ...]


class StatePlan(NamedTuple):
    """How the forward's serial pass runs: with the output in it or not, and its value columns a program."""

    with_output: bool
    block_v: int


# A plan forced for every call (`benchmarks/tilelang_stages.py --plan` times them side by side); None: the rule
FORCED_PLAN: StatePlan | None = None


def state_plan(spec: KDASpec) -> StatePlan:
    """The output in the serial pass (`state`'s docstring) wherever its tiles fit a block's shared memory
    (K <= 128: at K = 256 the six tiles of a 64-column pass, two stages deep, take 256 KB). 64 value
    columns a program in training (``u`` is fp32 there: 128 columns would take 240 KB) and wherever the
    64-column programs fit one wave of the GPU; past that, 128 columns a program (two warpgroups share the
    chunk's ``w``, ``k_g``, ``q_e`` and ``A_qk`` tiles, and a second wave is avoided). On an H100, the forward's
    kernels at B1_T8192_H96_D128 (192 programs of 64 columns): 1.95 ms at 128 columns, 2.12 at 64, 2.58
    split; at B2_T16384_H16_D128 (64 programs): 1.52 at 64, 1.94 at 128, 1.77 split. Every plan gives the
    same bits (`benchmarks/tilelang_stages.py --plan`)."""
    if FORCED_PLAN is not None:
        return StatePlan(FORCED_PLAN.with_output and spec.K <= 128, min(FORCED_PLAN.block_v, spec.V))
    if spec.K > 128:
        return StatePlan(False, min(BV, spec.V))
    narrow = min(BV, spec.V)
    programs = sequences(spec) * spec.HV * -(-spec.V // narrow)
    if spec.requires_grad or programs <= multiprocessors(spec):
        return StatePlan(True, narrow)
    return StatePlan(True, min(2 * BV, spec.V))


def sequences(spec: KDASpec) -> int:
    """The call's number of sequences: the batch, or cu_seqlens' length less one."""
    return spec.cu_seqlens.shape[0] - 1 if spec.cu_seqlens is not None else spec.B


def multiprocessors(spec: KDASpec) -> int:
    """The SMs of the call's GPU (132 on an H100 or H200, and where there is none: CI's lowering)."""
    device = spec.device
    if device.type == "cuda" and torch.cuda.is_available():
        return _multiprocessors(str(device))
    return HOPPER_SMS


HOPPER_SMS = 132


@functools.cache
def _multiprocessors(device: str) -> int:
    return torch.cuda.get_device_properties(torch.device(device)).multi_processor_count


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
    plan = state_plan(spec)
    store_h = train or spec.return_intermediate_states  # the backward or the caller reads each chunk's state
    kernels = [
        Kernel("intra", intra.build, (C, K, V, dtype, float(spec.scale), l2norm, *gate_params, train)),
        Kernel("state", state.build, (C, K, V, plan.block_v, dtype, *state_flags, train, plan.with_output, store_h)),
    ]
    if not plan.with_output:
        kernels.append(Kernel("output", output.build, (C, K, V, bv, dtype, "float32" if train else dtype)))
    if train:
        kernels += _backward(spec, dtype, gate_params)
    return kernels


def _backward(spec: KDASpec, dtype: str, gate_params: tuple[Any, ...]) -> list[Kernel]:
    """The backward's kernels (``dtype`` the inputs' dtype name, ``gate_params`` as `intra` takes them: gate
    mode, dt_bias, beta sigmoid, the gate's and beta's dtypes, lower bound, beta scale)."""
    C, K, V = spec.chunk_size, spec.K, spec.V
    l2norm = spec.use_qk_l2norm_in_kernel  # the stages read q, k as given, and with the l2norm their scales
    state_flags = (spec.output_final_state, spec.initial_state is not None, spec.state_v_first)
    bounded = score_backward.within_limits(gate_params[0], gate_params[5])
    return [
        Kernel("state_backward", state_backward.build, (C, K, V, state_backward.block_v(K, V), dtype, *state_flags)),
        Kernel("chunk_backward", chunk_backward.build, (C, K, V, dtype, float(spec.scale), l2norm)),
        Kernel("score_backward", score_backward.build, (C, K, dtype, l2norm, bounded)),
        Kernel("gate_tail", tails.build_gate_tail, (C, K, *gate_params)),
        Kernel("qk_tail", tails.build_qk_tail, (C, K, dtype, l2norm)),
    ]


def compile_all(spec: KDASpec) -> dict[str, Any]:
    """The compiled kernels of `spec`, by stage name (raises `runtime.CompileFailure`)."""
    kernels = specializations(spec)
    built = runtime.compile_all([(kernel.builder, kernel.params) for kernel in kernels])
    return {kernel.name: compiled for kernel, compiled in zip(kernels, built, strict=True)}
