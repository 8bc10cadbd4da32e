"""The forward pass: up to six launches, one per stage (``normalize`` with the in-kernel l2norm, ``gate``,
``scores``, ``solve``, ``state``, ``output``; the math is in each module's docstring).

Inputs are read token-major where the caller put them (``tokens = B*T``, or ``T`` with varlen): q, k
``[tokens, H, K]``, v ``[tokens, HV, V]``, g ``[tokens, HV, K]``, beta ``[tokens, HV]``; o ``[tokens, HV, V]``.
Intermediates are chunk-major (``[NT, HV, C, ...]``, a tail chunk's rows past its sequence zero), so each
later stage reads a chunk as one dense tile: ``G [NT, HV, C, K]``, ``M`` and ``T [NT, HV, C, C]`` in
fp32; ``q_e``, ``w``, ``k_g [NT, HV, C, K]``, ``u``/``v_new [NT, HV, C, V]``, ``A_qk [NT, HV, C, C]`` and
``h [NT, HV, K, V]`` in the storage dtype (the inputs' dtype at inference, fp32 when training or for fp32
inputs).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from kda.backends.base import ForwardResult, KDAInputs, KDAOutputs
from kda.backends.chunks import ChunkLayout, chunk_layout, deliver, output_buffers, per_chunk_states, sequence_bounds
from kda.backends.helion import gate, normalize, output, runtime, scores, solve, state
from kda.backends.helion.configs import ShapeKey
from kda.spec import GateMode, KDASpec

GATES = {GateMode.PREGATED: gate.PREGATED, GateMode.SOFTPLUS: gate.SOFTPLUS, GateMode.SIGMOID: gate.SIGMOID}
GATES[GateMode.SAFE] = gate.SAFE


@dataclass(frozen=True)
class Plan:
    """What every launch of one call shares."""

    layout: ChunkLayout
    key: ShapeKey
    store: torch.dtype  # the storage dtype of the intermediates
    precision: str  # Helion's dot_precision for every product but the output's: "ieee", "tf32x3" or "tf32"
    group: int  # HV // H


def storage_dtype(spec: KDASpec) -> torch.dtype:
    """The inputs' dtype at inference; fp32 for fp32 inputs and whenever the backward will read them."""
    return torch.float32 if spec.requires_grad or spec.dtype == torch.float32 else spec.dtype


def dot_precision(spec: KDASpec) -> str:
    """IEEE fp32 products for fp32 inputs; three TF32 products (fp32's accuracy) when training half inputs,
    whose ``dA_log`` sums cancelling terms; one TF32 product at half-precision inference."""
    if spec.dtype == torch.float32:
        return "ieee"
    return "tf32x3" if spec.requires_grad else "tf32"


def output_precision(precision: str) -> str:
    """The output's products: ``o`` never reaches the backward, so half-precision training takes one TF32
    product there, as inference does. Compiled for sm_90a at B1_T8192_H96_D128 in training, TF32x3 held
    255 registers and 131 KB of shared memory a block (one block an SM) where TF32 holds 148 and 98 KB
    (two); the triton backend's output measured 6.86 ms in TF32x3 against 0.20 in TF32 on the H200."""
    return "tf32" if precision == "tf32x3" else precision


def arch(device: torch.device) -> str:
    if device.type != "cuda":
        return "cpu"
    major, minor = torch.cuda.get_device_capability(device)
    return f"sm{major}{minor}"


def make_plan(inputs: KDAInputs, spec: KDASpec) -> Plan:
    store = storage_dtype(spec)
    key = ShapeKey(arch(spec.device), spec.K, spec.V, spec.chunk_size, store != torch.float32)
    layout = chunk_layout(sequence_bounds(inputs, spec), spec.chunk_size, spec.device)
    return Plan(layout, key, store, dot_precision(spec), spec.HV // spec.H)


def helion_forward(inputs: KDAInputs, spec: KDASpec, out: KDAOutputs | None = None) -> ForwardResult:
    plan = make_plan(inputs, spec)
    layout, store, device = plan.layout, plan.store, spec.device
    B, T, H, HV, K, V, C = spec.B, spec.T, spec.H, spec.HV, spec.K, spec.V, spec.chunk_size
    tokens, NT = B * T, max(plan.layout.num_chunks, 1)
    f32 = torch.float32

    def run(fn, *args) -> None:
        runtime.launch(fn, plan.precision, args, plan.key)

    q = inputs.q.reshape(tokens, H, K)
    k = inputs.k.reshape(tokens, H, K)
    v = inputs.v.reshape(tokens, HV, V)
    rstd_q = rstd_k = None
    if spec.use_qk_l2norm_in_kernel:
        q_in, k_in = q, k
        q, k = (
            torch.empty(tokens, H, K, dtype=store, device=device),
            torch.empty(tokens, H, K, dtype=store, device=device),
        )
        rstd_q, rstd_k = (
            torch.empty(tokens, H, dtype=f32, device=device),
            torch.empty(tokens, H, dtype=f32, device=device),
        )
        if tokens > 0:
            run(normalize.normalize_kernel, q_in, q, rstd_q)
            run(normalize.normalize_kernel, k_in, k, rstd_k)

    G = torch.empty(NT, HV, C, K, dtype=f32, device=device)
    beta = torch.empty(NT, HV, C, dtype=f32, device=device)
    M = torch.empty(NT, HV, C, C, dtype=f32, device=device)
    T_inv = torch.empty(NT, HV, C, C, dtype=f32, device=device) if spec.requires_grad else None
    A_qk = torch.empty(NT, HV, C, C, dtype=store, device=device)
    q_e = torch.empty(NT, HV, C, K, dtype=store, device=device)
    w = torch.empty(NT, HV, C, K, dtype=store, device=device)
    k_g = torch.empty(NT, HV, C, K, dtype=store, device=device)
    u = torch.empty(NT, HV, C, V, dtype=store, device=device)  # u, then v_new (the state pass writes over it)
    h = torch.empty(NT, HV, K, V, dtype=store, device=device)
    o, ht = output_buffers(spec, out)
    h0 = inputs.initial_state
    placeholder = G

    if layout.num_chunks > 0:
        A_log = inputs.A_log if inputs.A_log is not None else torch.zeros(HV, dtype=f32, device=device)
        dt_bias = inputs.dt_bias.reshape(HV, K) if inputs.dt_bias is not None else placeholder
        run(
            gate.gate_kernel,
            inputs.g.reshape(tokens, HV, K),
            inputs.beta.reshape(tokens, HV),
            A_log,
            dt_bias,
            layout.chunk_starts,
            layout.chunk_seq_ends,
            G,
            beta,
            float(spec.lower_bound or 0.0),
            2.0 if spec.allow_neg_eigval else 1.0,
            C,
            GATES[spec.gate_mode],
            inputs.dt_bias is not None,
            spec.use_beta_sigmoid_in_kernel,
        )
        run(
            scores.scores_kernel,
            q,
            k,
            G,
            layout.chunk_starts,
            layout.chunk_seq_ends,
            M,
            A_qk,
            q_e,
            spec.scale,
            plan.group,
            C,
        )
        run(
            solve.solve_kernel,
            k, v, G, beta, layout.chunk_starts, layout.chunk_seq_ends, M, T_inv if T_inv is not None else M, w, u, k_g,
            plan.group, C, C.bit_length() - 1, spec.requires_grad,
        )  # fmt: skip
    run(
        state.state_kernel,
        w, u, k_g, G, layout.chunk_bounds, h,
        h0 if h0 is not None else placeholder,
        ht if ht is not None else placeholder,
        C, h0 is not None, ht is not None, spec.state_v_first,
    )  # fmt: skip
    if layout.num_chunks > 0:
        ends = layout.chunk_seq_ends
        outputs = (q_e, h, A_qk, u, layout.chunk_starts, ends, o.view(tokens, HV, V), C)
        runtime.launch(output.output_kernel, output_precision(plan.precision), outputs, plan.key)

    o, ht = deliver(o, ht, out)
    per_chunk = per_chunk_states(h, layout.num_chunks, B, spec) if spec.return_intermediate_states else None
    saved = None
    if spec.requires_grad:
        saved = dict(
            plan=plan, q=q, k=k, rstd_q=rstd_q, rstd_k=rstd_k, G=G, beta=beta, M=M, T=T_inv, A_qk=A_qk,
            q_e=q_e, w=w, k_g=k_g, v_new=u, h=h,
        )  # fmt: skip
    return ForwardResult(o, ht, saved, per_chunk)
