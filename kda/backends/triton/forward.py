"""The forward pass: four launches, one per stage (see `gate`, `intra`, `state`, `output`).

Shapes on the flattened token axis (``tokens = B*T``, or ``T`` with varlen): q, k ``[tokens, H, K]``,
v ``[tokens, HV, V]``, g ``[tokens, HV, K]``, beta ``[tokens, HV]``; o ``[tokens, HV, V]``.
Intermediates: ``G [tokens, HV, K]`` and ``A_kk`` (then ``T``) ``[NT, HV, C, C]`` in fp32; in the storage
dtype (`storage.storage_dtype`: the inputs' dtype at inference, fp32 when training) ``w``, ``k_g
[tokens, HV, K]``, ``u [tokens, HV, V]`` (then ``v_new``, in place), ``A_qk [NT, HV, C, C]`` and ``h [NT,
HV, K, V]`` (the state entering each chunk).
"""

from __future__ import annotations

import os
from collections.abc import Callable

import torch
import triton

from kda.backends.base import ForwardResult, KDAInputs, KDAOutputs
from kda.backends.chunks import chunk_layout, deliver, output_buffers, per_chunk_states, sequence_bounds
from kda.backends.triton.configs import intra_block_k, intra_block_w, launch_config
from kda.backends.triton.gate import PREGATED, SAFE, SIGMOID, SOFTPLUS, gate_cumsum_kernel
from kda.backends.triton.intra import SUB_CHUNK, intra_chunk_kernel
from kda.backends.triton.output import output_kernel
from kda.backends.triton.state import state_pass_kernel
from kda.backends.triton.storage import dot_precisions, storage_dtype
from kda.backends.triton.tiles import padded_dim
from kda.spec import GateMode, KDASpec


def interpreting() -> bool:
    return os.environ.get("TRITON_INTERPRET", "0") == "1"


def triton_forward(inputs: KDAInputs, spec: KDASpec, out: KDAOutputs | None = None) -> ForwardResult:
    stages, finish = plan_forward(inputs, spec, out)
    for _, launch in stages:
        launch()
    return finish()


def plan_forward(
    inputs: KDAInputs, spec: KDASpec, out: KDAOutputs | None = None
) -> tuple[list[tuple[str, Callable[[], None]]], Callable[[], ForwardResult]]:
    """The forward as named launches, in order, and the function that collects the result afterwards
    (separate so that `benchmarks/triton_stages.py` can time each stage on its own)."""
    device = spec.device
    B, T, H, HV, K, V, C = spec.B, spec.T, spec.H, spec.HV, spec.K, spec.V, spec.chunk_size
    tokens = B * T
    layout = chunk_layout(sequence_bounds(inputs, spec), C, device)
    NT, N = layout.num_chunks, layout.num_seqs
    BK, BV_all = padded_dim(K), padded_dim(V)
    major = None if device.type != "cuda" else torch.cuda.get_device_capability(device)[0]
    config = launch_config(major, K, V)
    precision = dot_precisions(spec)

    q, k, v, g, beta = (t.contiguous() for t in (inputs.q, inputs.k, inputs.v, inputs.g, inputs.beta))
    A_log = None if inputs.A_log is None else inputs.A_log.contiguous()
    dt_bias = None if inputs.dt_bias is None else inputs.dt_bias.reshape(-1).contiguous()
    f32, store = torch.float32, storage_dtype(spec)
    G = torch.empty(tokens, HV, K, dtype=f32, device=device)
    w = torch.empty(tokens, HV, K, dtype=store, device=device)
    k_g = torch.empty(tokens, HV, K, dtype=store, device=device)
    u = torch.empty(tokens, HV, V, dtype=store, device=device)  # u, then v_new (stage 3 writes over it)
    A_kk = torch.empty(max(NT, 1), HV, C, C, dtype=f32, device=device)
    A_qk = torch.empty(max(NT, 1), HV, C, C, dtype=store, device=device)
    h = torch.empty(max(NT, 1), HV, K, V, dtype=store, device=device)
    ROUND = interpreting()  # bf16 stores round by hand under the interpreter (see `storage`)
    save = spec.requires_grad  # training keeps M (A_kk without beta) and T (written over A_kk) for the backward
    M = torch.empty_like(A_kk) if save else None
    o, ht = output_buffers(spec, out)
    h0 = None if inputs.initial_state is None else inputs.initial_state.contiguous()
    gate = {GateMode.PREGATED: PREGATED, GateMode.SOFTPLUS: SOFTPLUS, GateMode.SIGMOID: SIGMOID, GateMode.SAFE: SAFE}[
        spec.gate_mode
    ]
    BV = min(config.state_block_v, BV_all)
    BVo = min(config.output_block_v, BV_all)
    BKg = min(config.gate_block_k, BK)
    L2 = spec.use_qk_l2norm_in_kernel

    def gate_stage() -> None:
        gate_cumsum_kernel[(NT, HV, triton.cdiv(K, BKg))](
            g,
            A_log if A_log is not None else G,
            dt_bias if dt_bias is not None else G,
            G,
            layout.chunk_starts,
            layout.chunk_seq_ends,
            float(spec.lower_bound or 0.0),
            HV=HV,
            K=K,
            GATE=gate,
            HAS_A_LOG=A_log is not None,
            HAS_DT_BIAS=dt_bias is not None,
            BT=C,
            BK=BKg,
            BC=SUB_CHUNK,
            num_warps=config.gate_warps,
        )

    def intra_stage() -> None:
        intra_chunk_kernel[(NT, HV)](
            q,
            k,
            v,
            beta,
            G,
            A_kk,
            A_qk,
            M if save else G,
            w,
            u,
            k_g,
            layout.chunk_starts,
            layout.chunk_seq_ends,
            H=H,
            HV=HV,
            K=K,
            V=V,
            L2=L2,
            SIGMOID=spec.use_beta_sigmoid_in_kernel,
            TWO=spec.allow_neg_eigval,
            BT=C,
            BK=BK,
            BV=BV_all,
            BKC=min(BK, 32),
            BC=SUB_CHUNK,
            BW=intra_block_w(config, BK, BV_all, save),
            BKS=intra_block_k(config, BK, save),
            DOT_PRECISION=precision.intra,
            SAVE=save,
            ROUND=ROUND,
            STORED_OPERANDS=store != f32 and config.intra_half_products,
            num_warps=config.intra_warps,
            num_stages=config.intra_stages,
        )

    def state_stage() -> None:
        state_pass_kernel[(N, HV, triton.cdiv(V, BV))](
            k_g,
            w,
            u,
            G,
            h,
            h0 if h0 is not None else G,
            ht if ht is not None else G,
            layout.bounds,
            layout.chunk_offsets,
            HV=HV,
            K=K,
            V=V,
            HAS_H0=h0 is not None,
            STORE_HT=ht is not None,
            V_FIRST=spec.state_v_first,
            BT=C,
            BK=BK,
            BV=BV,
            DOT_PRECISION=precision.state,
            ROUND=ROUND,
            STORED_OPERANDS=store != f32,
            num_warps=config.state_warps,
            num_stages=config.state_stages,
        )

    def output_stage() -> None:
        output_kernel[(NT, HV, triton.cdiv(V, BVo))](
            q,
            G,
            h,
            u,
            A_qk,
            o,
            layout.chunk_starts,
            layout.chunk_seq_ends,
            spec.scale,
            H=H,
            HV=HV,
            K=K,
            V=V,
            L2=L2,
            BT=C,
            BK=BK,
            BV=BVo,
            DOT_PRECISION=precision.output,
            ROUND=ROUND,
            STORED_OPERANDS=store != f32,
            num_warps=config.output_warps,
        )

    # With no chunk at all (every sequence empty) only the state pass runs: it hands h0 to ht.
    stages = [("gate", gate_stage), ("intra", intra_stage)] if NT > 0 else []
    stages.append(("state", state_stage))
    if NT > 0:
        stages.append(("output", output_stage))

    def finish() -> ForwardResult:
        result_o, result_ht = deliver(o, ht, out)
        per_chunk = per_chunk_states(h, NT, B, spec) if spec.return_intermediate_states else None
        saved = None
        if save:
            saved = {
                "G": G,
                "w": w,
                "v_new": u,
                "h": h,
                "A_qk": A_qk,
                "M": M,
                "T": A_kk,
                "layout": layout,
                "config": config,
                "BK": BK,
                "BV_all": BV_all,
                "precision": precision,
            }
        return ForwardResult(result_o, result_ht, saved, per_chunk)

    return stages, finish
