"""The forward pass: up to six launches, one per stage (``normalize`` with the in-kernel l2norm, ``gate``,
``scores``, ``solve``, ``state``, ``output``; the math is in each module's docstring).

Inputs are read token-major where the caller put them (``tokens = B*T``, or ``T`` with varlen): q, k
``[tokens, H, K]``, v ``[tokens, HV, V]``, g ``[tokens, HV, K]``, beta ``[tokens, HV]``; o ``[tokens, HV, V]``.
Intermediates are chunk-major (``[NT, HV, C, ...]``, a tail chunk's rows past its sequence zero), so each
later stage reads a chunk as one dense tile: ``G [NT, HV, C, K]``, ``M`` and ``T [NT, HV, C, C]`` in
fp32; ``w [NT, HV, C, K]``, ``u``/``v_new [NT, HV, C, V]``, ``A_qk [NT, HV, C, C]`` and ``h [NT, HV, K,
V]`` in the storage dtype (the inputs' dtype at inference, fp32 when training or for fp32 inputs); with
the l2norm, each row's scale ``r`` (``rstd_q``, ``rstd_k [tokens, H]`` fp32). Training on bf16/fp16 inputs
keeps ``w`` and ``A_qk``, what the two serial passes multiply, as bf16 halves ``[NT, HV, 2, C, ...]``
instead (`training_halves`: fp32's bytes). The normalized rows (``r x``) are never stored: each stage
scales the rows it loads. ``q_e = scale q exp(G)`` and ``k_g = k exp(G_last - G)`` (``[NT, HV, C, K]``)
are stored at inference only, where they are 16-bit and freed once read; in training, where they would be
fp32-sized and kept for the backward (two ``[tokens, HV, K]`` fp32 tensors of the call's peak, past FLA's
at B4_T2048_H16_D128), each kernel that multiplies by them makes them from q, k and ``G`` (the serial
passes on halves split them in registers). At inference the state pass reads ``k_g`` rather than make it:
made there, its ``[C, K]`` rows of ``k`` and ``G`` spill 232 bytes a thread at the H200's configuration
(compiled for sm_90a, `benchmarks/helion_resources.py`), where the pass reading it spills none.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from kda.backends.base import ForwardResult, KDAInputs, KDAOutputs
from kda.backends.chunks import (
    ChunkLayout,
    chunk_layout,
    deliver,
    final_state_buffer,
    output_buffer,
    per_chunk_states,
    sequence_bounds,
)
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
    halves: bool  # training on 16-bit inputs: w and A_qk stored as bf16 halves (`training_halves`)
    precision: str  # Helion's dot_precision for every product but the output's: "ieee", "tf32x3" or "tf32"
    group: int  # HV // H


def storage_dtype(spec: KDASpec) -> torch.dtype:
    """The inputs' dtype at inference; fp32 for fp32 inputs and whenever the backward will read them."""
    return torch.float32 if spec.requires_grad or spec.dtype == torch.float32 else spec.dtype


# Training on halves (below) is on. The serial passes' halves forms take at least `halves.MIN_BLOCK_V`
# value columns a program: narrower, `state`'s product ``k_g^T v_new`` read shared memory out of bounds on
# an H100 (Triton 3.6), an illegal access that ends the CUDA context. On an H100 at B4_T2048_H16_D128 they
# took `state` from 0.776 to 0.405 ms and `state_backward` from 1.860 to 0.728 (`docs/design.md`, "The
# helion backend")
TRAINING_ON_HALVES = True


def training_halves(spec: KDASpec) -> bool:
    """Training on bf16/fp16 inputs stores ``w`` and ``A_qk`` as bf16 halves ``[NT, HV, 2, C, ...]`` (``hi =
    bf16(x)``, ``lo = bf16(x - hi)``: fp32's bytes, fp32's range, 16 significant bits), and both serial
    passes multiply on halves (`state`, `state_backward`), where `TRAINING_ON_HALVES` allows it. Always
    bf16: fp16 halves could overflow. fp32 calls keep fp32 and IEEE products: halves' worst ``dA_log``
    measured on the triton backend's kernels (1.75e-3 with halves in the backward alone) is past fp32's
    tolerance of 1e-3."""
    return TRAINING_ON_HALVES and spec.requires_grad and spec.dtype != torch.float32


def dot_precision(spec: KDASpec) -> str:
    """IEEE fp32 products for fp32 inputs; three TF32 products (fp32's accuracy) when training half inputs,
    whose ``dA_log`` sums cancelling terms; one TF32 product at half-precision inference."""
    if spec.dtype == torch.float32:
        return "ieee"
    return "tf32x3" if spec.requires_grad else "tf32"


def solve_precision(precision: str) -> str:
    """The inverse's products: a 16-block's Neumann sum reaches about 3432 times the inverse's size on
    correlated keys, so its products start at fp32's error (``tf32x3``), never TF32's, which the Newton
    step after it cannot repair (`solve` says why)."""
    return "tf32x3" if precision == "tf32" else precision


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
    halves = training_halves(spec)
    key = ShapeKey(arch(spec.device), spec.K, spec.V, spec.chunk_size, store != torch.float32, halves)
    layout = chunk_layout(sequence_bounds(inputs, spec), spec.chunk_size, spec.device)
    return Plan(layout, key, store, halves, dot_precision(spec), spec.HV // spec.H)


def helion_forward(inputs: KDAInputs, spec: KDASpec, out: KDAOutputs | None = None) -> ForwardResult:
    """The six stages in order. Training keeps every intermediate for the backward. Inference lets each
    go as soon as no later stage reads it and allocates ``w``, ``k_g``, ``h`` and ``o`` only when their
    stage comes, so its peak is the state pass's working set (``G``, ``A_qk``, ``q_e``, ``w``, ``k_g``,
    ``u``, ``h``; counted by ``benchmarks/peak_memory.py``)."""
    plan = make_plan(inputs, spec)
    layout, store, device = plan.layout, plan.store, spec.device
    B, T, H, HV, K, V, C = spec.B, spec.T, spec.H, spec.HV, spec.K, spec.V, spec.chunk_size
    tokens, NT = B * T, max(plan.layout.num_chunks, 1)
    f32 = torch.float32
    training = spec.requires_grad
    chunks = layout.num_chunks > 0

    def run(fn, *args) -> None:
        runtime.launch(fn, plan.precision, args, plan.key)

    def empty(*shape: int, dtype: torch.dtype = store) -> torch.Tensor:
        return torch.empty(*shape, dtype=dtype, device=device)

    def operand(*shape: int) -> torch.Tensor:
        """``w`` or ``A_qk`` (``[NT, HV, C, D]``): in the storage dtype, or as bf16 halves ``[NT, HV, 2, C, D]``."""
        if plan.halves:
            return empty(*shape[:2], 2, *shape[2:], dtype=torch.bfloat16)
        return empty(*shape)

    # The intermediates by name. Stages read them from here (no other reference is kept), so that at
    # inference `release` frees them; training hands them all to the backward.
    q, k = inputs.q.reshape(tokens, H, K), inputs.k.reshape(tokens, H, K)
    L2 = spec.use_qk_l2norm_in_kernel
    kept: dict[str, torch.Tensor | None] = dict(rstd_q=None, rstd_k=None)

    def release(*names: str) -> None:
        if not training:
            for name in names:
                del kept[name]

    if L2:
        kept.update(rstd_q=empty(tokens, H, dtype=f32), rstd_k=empty(tokens, H, dtype=f32))
        if tokens > 0:
            run(normalize.normalize_kernel, q, k, kept["rstd_q"], kept["rstd_k"])

    kept.update(G=empty(NT, HV, C, K, dtype=f32), beta=empty(NT, HV, C, dtype=f32))
    kept.update(M=empty(NT, HV, C, C, dtype=f32), A_qk=operand(NT, HV, C, C))
    G = kept["G"]  # read by every stage; also the placeholder of absent optional tensors
    stored = not training  # q_e and k_g stored (inference), else made where they are read
    q_e = empty(NT, HV, C, K) if stored else G

    def row_scales(name: str) -> torch.Tensor:
        """The l2norm's scales `name` where a stage reads them; else a placeholder it does not read (A_qk,
        which lives to the end: a placeholder keeps its tensor alive)."""
        scales = kept.get(name)
        scales = scales if scales is not None else kept["A_qk"]
        assert scales is not None
        return scales

    if chunks:
        A_log = inputs.A_log if inputs.A_log is not None else torch.zeros(HV, dtype=f32, device=device)
        run(
            gate.gate_kernel,
            inputs.g.reshape(tokens, HV, K), inputs.beta.reshape(tokens, HV), A_log,
            inputs.dt_bias.reshape(HV, K) if inputs.dt_bias is not None else G,
            layout.chunk_starts, layout.chunk_seq_ends, G, kept["beta"],
            float(spec.lower_bound or 0.0), 2.0 if spec.allow_neg_eigval else 1.0,
            C, GATES[spec.gate_mode], inputs.dt_bias is not None, spec.use_beta_sigmoid_in_kernel,
        )  # fmt: skip
        run(
            scores.scores_kernel,
            q, k, row_scales("rstd_q"), row_scales("rstd_k"), G, layout.chunk_starts, layout.chunk_seq_ends,
            kept["M"], kept["A_qk"], q_e, spec.scale, plan.group, C, L2, stored, plan.halves,
        )  # fmt: skip
    release("rstd_q")  # at inference the output reads the stored q_e; so does the state pass k_g, below

    kept.update(T=empty(NT, HV, C, C, dtype=f32) if training else None, w=operand(NT, HV, C, K))
    k_g = empty(NT, HV, C, K) if stored else G
    u = empty(NT, HV, C, V)  # u, then v_new (the state pass writes over it)
    if chunks:
        # its own precision (`solve_precision`); the arguments inline, so that no name outlives `release`
        runtime.launch(
            solve.solve_kernel,
            solve_precision(plan.precision),
            (
                k, row_scales("rstd_k"), inputs.v.reshape(tokens, HV, V), G, kept["beta"], layout.chunk_starts,
                layout.chunk_seq_ends, kept["M"], kept["T"] if training else kept["M"], kept["w"], u, k_g,
                plan.group, C, C // solve.SUB, training, L2, stored, plan.halves,
            ),
            plan.key,
        )  # fmt: skip
    release("beta", "M", "T", "rstd_k")

    h = empty(NT, HV, K, V)
    ht = final_state_buffer(spec, out)
    h0 = inputs.initial_state
    run(
        state.state_kernel,
        kept["w"], u, k_g, k, row_scales("rstd_k"), G, layout.chunk_starts, layout.chunk_seq_ends,
        layout.chunk_bounds, h,
        h0 if h0 is not None else G,
        ht if ht is not None else G,
        plan.group, C, h0 is not None, ht is not None, spec.state_v_first, L2, stored, plan.halves,
    )  # fmt: skip
    del k_g
    G_out = q_e if stored else G  # the output reads G only to make q_e (a placeholder when q_e is stored)
    del G
    release("w", "G")

    o = output_buffer(spec, out)
    if chunks:
        outputs = (
            q_e, q, row_scales("rstd_q"), G_out, h, kept["A_qk"], u, layout.chunk_starts, layout.chunk_seq_ends,
            o.view(tokens, HV, V), spec.scale, plan.group, C, L2, stored, plan.halves,
        )  # fmt: skip
        runtime.launch(output.output_kernel, output_precision(plan.precision), outputs, plan.key)

    o, ht = deliver(o, ht, out)
    per_chunk = per_chunk_states(h, layout.num_chunks, B, spec) if spec.return_intermediate_states else None
    saved = dict(kept, plan=plan, v_new=u, h=h) if training else None
    return ForwardResult(o, ht, saved, per_chunk)
