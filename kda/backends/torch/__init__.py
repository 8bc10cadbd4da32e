"""The `torch` backend: KDA's chunked algorithm in plain PyTorch.

Always available, on any device, for every feature of the contract; trains through autograd. It is the
fallback that `auto` can always use, the CPU path, and the readable statement of the algorithm that the
fast kernels implement (stages: `intra` for the in-chunk scores and WY transform, `chunked` for the pass
over chunks). It computes in float32 whatever the input dtype, and casts the output to q's dtype.

Backward recomputes the forward under autograd and differentiates it (no activations are kept between
forward and backward), so training costs one extra forward.
"""

from __future__ import annotations

import itertools
from typing import Any

import torch

from kda.backends.base import (
    Backend,
    ForwardResult,
    KDAGradients,
    KDAInputs,
    KDAOutputs,
    RecurrentInputs,
    RecurrentResult,
    Verdict,
)
from kda.backends.torch.chunked import chunked_delta_rule
from kda.errors import KDAInputError
from kda.recurrent.spec import RecurrentSpec
from kda.reference import beta_transform, l2norm, log_decay
from kda.spec import KDASpec, cu_seqlens_violation


def torch_kda(
    inputs: KDAInputs, spec: KDASpec, compute_dtype: torch.dtype = torch.float32
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """KDA for one validated call, differentiable through torch ops.

    Returns ``o [B, T, HV, V]`` in `compute_dtype` and the final state in the call's layout (or None).
    `compute_dtype=torch.float64` with float64 inputs is what the gradcheck test uses. A caller's autocast
    is switched off inside: the backend computes in `compute_dtype`, as verified, whatever the context.
    """
    with torch.autocast(spec.device.type, enabled=False):
        return _torch_kda(inputs, spec, compute_dtype)


def _torch_kda(
    inputs: KDAInputs, spec: KDASpec, compute_dtype: torch.dtype
) -> tuple[torch.Tensor, torch.Tensor | None]:
    def cast(t: torch.Tensor) -> torch.Tensor:
        return t.to(compute_dtype)

    def cast_optional(t: torch.Tensor | None) -> torch.Tensor | None:
        return None if t is None else t.to(compute_dtype)

    q, k, v, g, beta = (cast(t) for t in (inputs.q, inputs.k, inputs.v, inputs.g, inputs.beta))
    A_log, dt_bias, h0 = (cast_optional(t) for t in (inputs.A_log, inputs.dt_bias, inputs.initial_state))

    if spec.use_qk_l2norm_in_kernel:
        q, k = l2norm(q), l2norm(k)
    beta = beta_transform(beta, sigmoid=spec.use_beta_sigmoid_in_kernel, allow_neg_eigval=spec.allow_neg_eigval)
    g = log_decay(
        g,
        use_gate_in_kernel=spec.use_gate_in_kernel,
        safe_gate_on=spec.safe_gate,
        A_log=A_log,
        dt_bias=dt_bias,
        lower_bound=spec.lower_bound,
    )

    group = spec.HV // spec.H
    # [B, T, heads, D] -> [B, HV, T, D]: value head hv reads q/k head hv // group
    q, k = (x.repeat_interleave(group, dim=2).transpose(1, 2) for x in (q, k))
    v, g = v.transpose(1, 2), g.transpose(1, 2)
    beta = beta.transpose(1, 2)
    if h0 is not None and spec.state_v_first:
        h0 = h0.transpose(-1, -2)  # the kernel-side layout is [N, HV, K, V]

    if not spec.is_varlen:
        o, state = chunked_delta_rule(q, k, v, g, beta, spec.scale, h0, spec.chunk_size)
    else:
        bounds = inputs.host_cu_seqlens()
        assert bounds is not None
        broken = cu_seqlens_violation(bounds, spec.T)
        if broken is not None:  # the spec could not read a device-resident cu_seqlens without a sync
            raise KDAInputError("cu_seqlens", broken)
        outs, states = [], []
        for n, (start, end) in enumerate(itertools.pairwise(bounds)):
            h0_n = None if h0 is None else h0[n : n + 1]
            span = slice(start, end)
            if end == start:  # an empty sequence: no output rows, the state passes through
                states.append(h0_n if h0_n is not None else q.new_zeros(1, spec.HV, spec.K, spec.V))
                continue
            o_n, s_n = chunked_delta_rule(
                q[:, :, span],
                k[:, :, span],
                v[:, :, span],
                g[:, :, span],
                beta[:, :, span],
                spec.scale,
                h0_n,
                spec.chunk_size,
            )
            outs.append(o_n)
            states.append(s_n)
        o, state = torch.cat(outs, dim=2), torch.cat(states, dim=0)

    o = o.transpose(1, 2)  # [B, T, HV, V]
    if not spec.output_final_state:
        return o, None
    return o, (state.transpose(-1, -2) if spec.state_v_first else state)


class TorchBackend(Backend):
    """Plain PyTorch, every feature, any device: the fallback and the readable algorithm."""

    name = "torch"
    version = "3"  # 2: the chunk's cumulative log decay in float64 (saturated gates' dA_log); 3: LOG_DECAY_FLOOR
    priority = 0
    trains = True
    writes_into_outputs = True
    description = "chunked algorithm in plain PyTorch (fp32 compute); any device; autograd backward"

    def supports(self, spec: KDASpec) -> Verdict:
        return Verdict.yes("implements the whole contract on any device")

    def forward(self, inputs: KDAInputs, spec: KDASpec, out: KDAOutputs | None = None) -> ForwardResult:
        with torch.no_grad():
            o, state = torch_kda(inputs, spec)
        o = o.to(spec.dtype)
        state = None if state is None else state.to(torch.float32)
        if out is not None:
            out.o.copy_(o)
            o = out.o
            if state is not None and out.final_state is not None:
                out.final_state.copy_(state)
                state = out.final_state
        return ForwardResult(o, state)

    def supports_recurrent(self, spec: RecurrentSpec) -> Verdict:
        return Verdict.yes("the decode op as a token loop in fp32 on any device, pools and padding included")

    def recurrent_forward(self, inputs: RecurrentInputs, spec: RecurrentSpec) -> RecurrentResult:
        from kda.backends.torch.recurrent import torch_recurrent

        return torch_recurrent(inputs, spec)

    def backward(
        self, inputs: KDAInputs, spec: KDASpec, saved: Any, do: torch.Tensor, dfinal_state: torch.Tensor | None
    ) -> KDAGradients:
        def leaf(t: torch.Tensor) -> torch.Tensor:
            return t.detach().requires_grad_(True)

        def leaf_optional(t: torch.Tensor | None) -> torch.Tensor | None:
            return None if t is None else leaf(t)

        replay = KDAInputs(
            q=leaf(inputs.q),
            k=leaf(inputs.k),
            v=leaf(inputs.v),
            g=leaf(inputs.g),
            beta=leaf(inputs.beta),
            A_log=leaf_optional(inputs.A_log),
            dt_bias=leaf_optional(inputs.dt_bias),
            initial_state=leaf_optional(inputs.initial_state),
            cu_seqlens=inputs.cu_seqlens,
            cu_seqlens_cpu=inputs.cu_seqlens_cpu,
        )
        leaves = replay.differentiable()
        with torch.enable_grad():
            o, state = torch_kda(replay, spec)
        outputs, upstream = [o], [do.to(o.dtype)]
        if state is not None and dfinal_state is not None:
            outputs.append(state)
            upstream.append(dfinal_state.to(state.dtype))
        wanted = [t for t in leaves.values() if t is not None]
        grads = iter(torch.autograd.grad(outputs, wanted, upstream, allow_unused=True))
        result: dict[str, torch.Tensor | None] = {}
        for name, input_leaf in leaves.items():
            if input_leaf is None:
                result[name] = None
                continue
            grad = next(grads)
            if grad is None:
                grad = torch.zeros_like(input_leaf)  # e.g. dinitial_state of an empty sequence path
            result[name] = grad.to(input_leaf.dtype)
        return KDAGradients(
            dq=result["q"],
            dk=result["k"],
            dv=result["v"],
            dg=result["g"],
            dbeta=result["beta"],
            dA_log=result["A_log"],
            ddt_bias=result["dt_bias"],
            dinitial_state=result["initial_state"],
        )
