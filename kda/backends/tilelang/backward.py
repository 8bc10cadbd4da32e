"""The backward pass: six launches (`state_backward`, `chunk_backward`, `score_backward`, `gate_tail`, and
`qk_tail` for q and for k; the math is in each module), from what the training forward saved.

Saved by the forward (`forward.tilelang_forward`): ``q_e``, ``k_g``, ``w [NT, HV, C, K]``,
``A_qk [NT, HV, C, C]`` and ``h [NT, HV, K, V]`` in the inputs' dtype (the values the forward multiplied by;
the state backward reads them); ``v_new [NT, HV, C, V]``, ``G [NT, HV, C, K]``, ``G_last [NT, HV, K]``,
``beta [NT, HV, C]``, ``M`` and ``T [NT, HV, C, C]`` in fp32; with the l2norm the reciprocal norms ``r`` of q's
and k's rows ``[tokens, H]`` in fp32. ``q`` and ``k`` are read as the call gave them (autograd's saved inputs,
``[tokens, H, K]``): `chunk_backward`, `score_backward` and `qk_tail` form the rows the forward used, ``x r``
in fp32, where they read them.

Scratch, chunk-major fp32: ``dh [NT, HV, K, V]`` (of the state leaving each chunk), ``dv_new [NT, HV, C, V]``,
``dq``/``dk``/``dG`` per value head ``[NT, HV, C, K]`` (`chunk_backward` writes them, `score_backward`
adds to them), ``dP_qk``/``dP_kk [NT, HV, C, C]``, ``dbeta [NT, HV, C]``. The sums over tokens
(``ddt_bias``, ``dA_log``) are torch sums of per-token and per-row parts: a fixed order, no atomics.

One specialization serves a call whether or not the caller's loss reaches the final state: without its
gradient the state pass starts from zeros.
"""

from __future__ import annotations

import torch

from kda.backends import chunks
from kda.backends.base import KDAGradients, KDAInputs
from kda.backends.tilelang import kernels
from kda.spec import KDASpec


def tilelang_backward(
    inputs: KDAInputs, spec: KDASpec, saved: dict, do: torch.Tensor, dfinal_state: torch.Tensor | None
) -> KDAGradients:
    compiled = kernels.compile_all(spec)
    layout = saved["layout"]
    device, f32 = spec.device, torch.float32
    B, T, H, HV, K, V, C = spec.B, spec.T, spec.H, spec.HV, spec.K, spec.V, spec.chunk_size
    tokens, NT = B * T, max(layout.num_chunks, 1)
    placeholder = torch.zeros(1, dtype=f32, device=device)
    starts, ends = layout.chunk_starts, layout.chunk_seq_ends

    do = do.reshape(tokens, HV, V).to(spec.dtype).contiguous()
    # Each buffer is made when its stage comes and dropped once read: the gradients of the inputs after
    # `chunk_backward`, whose working set (every saved tensor, dh and dv_new, its outputs) is the backward's
    # peak (`benchmarks/peak_memory.py`)
    dv = torch.empty(tokens, HV, V, dtype=inputs.v.dtype, device=device)
    dA_rows = torch.zeros(NT, HV, C, dtype=f32, device=device)
    dh0 = torch.empty(spec.state_shape, dtype=f32, device=device) if inputs.initial_state is not None else None

    if layout.num_chunks > 0:
        dh = torch.empty(NT, HV, K, V, dtype=f32, device=device)
        dv_new = torch.empty(NT, HV, C, V, dtype=f32, device=device)
        dht = placeholder
        if spec.output_final_state:  # compiled to read one: zeros when the loss does not reach the state
            dht = (
                dfinal_state.float().contiguous()
                if dfinal_state is not None
                else torch.zeros(spec.state_shape, dtype=f32, device=device)
            )
        compiled["state_backward"](
            do, saved["q_e"], saved["w"], saved["k_g"], saved["A_qk"], saved["G_last"], starts, ends,
            layout.chunk_bounds[:-1].clone(), layout.chunk_bounds[1:].clone(), dht, dh, dv_new,
            dh0 if dh0 is not None else placeholder,
        )  # fmt: skip
        dq_c, dk_c, dG_c = (torch.empty(NT, HV, C, K, dtype=f32, device=device) for _ in range(3))
        dP_qk, dP_kk = (torch.empty(NT, HV, C, C, dtype=f32, device=device) for _ in range(2))
        dbeta_c = torch.empty(NT, HV, C, dtype=f32, device=device)
        q, k = inputs.q.reshape(tokens, H, K).contiguous(), inputs.k.reshape(tokens, H, K).contiguous()
        # without the l2norm the kernels are compiled without scales: a placeholder none reads
        rstd_q = saved["rstd_q"] if saved["rstd_q"] is not None else placeholder
        rstd_k = saved["rstd_k"] if saved["rstd_k"] is not None else placeholder
        compiled["chunk_backward"](
            do, inputs.v.reshape(tokens, HV, V).contiguous(), q, k, rstd_q, rstd_k, saved["G"], saved["beta"],
            saved["T"], saved["M"], saved["h"], dh, saved["v_new"], dv_new, starts, ends,
            dv, dq_c, dk_c, dG_c, dP_qk, dP_kk, dbeta_c,
        )  # fmt: skip
        del dh, dv_new
        compiled["score_backward"](q, k, rstd_q, rstd_k, saved["G"], dP_qk, dP_kk, starts, ends, dq_c, dk_c, dG_c)
        del dP_qk, dP_kk
        dg = torch.empty(tokens, HV, K, dtype=inputs.g.dtype, device=device)
        ddt_parts = torch.empty(NT, HV, K, dtype=f32, device=device) if inputs.dt_bias is not None else placeholder
        dbeta = torch.empty(tokens, HV, dtype=inputs.beta.dtype, device=device)
        A_log = (
            inputs.A_log.float().contiguous() if inputs.A_log is not None else torch.zeros(HV, dtype=f32, device=device)
        )
        dt_bias = inputs.dt_bias.reshape(HV, K).float().contiguous() if inputs.dt_bias is not None else placeholder
        compiled["gate_tail"](
            inputs.g.reshape(tokens, HV, K).contiguous(), inputs.beta.reshape(tokens, HV).contiguous(), A_log,
            dt_bias, dG_c, dbeta_c, starts, ends, dg, dbeta, dA_rows, ddt_parts,
        )  # fmt: skip
        del dG_c, dbeta_c
        dq = torch.empty(tokens, H, K, dtype=inputs.q.dtype, device=device)
        dk = torch.empty(tokens, H, K, dtype=inputs.k.dtype, device=device)
        for x, rstd, dx_c, dx in ((q, rstd_q, dq_c, dq), (k, rstd_k, dk_c, dk)):
            compiled["qk_tail"](x, rstd, dx_c, starts, ends, dx)
    else:  # every sequence empty: nothing but the state's own gradient
        dg = torch.zeros(tokens, HV, K, dtype=inputs.g.dtype, device=device)
        ddt_parts = torch.zeros(1, HV, K, dtype=f32, device=device) if inputs.dt_bias is not None else placeholder
        dbeta = torch.zeros(tokens, HV, dtype=inputs.beta.dtype, device=device)
        dq = torch.zeros(tokens, H, K, dtype=inputs.q.dtype, device=device)
        dk = torch.zeros(tokens, H, K, dtype=inputs.k.dtype, device=device)
        dv.zero_()
        if dh0 is not None:
            dh0.copy_(dfinal_state if dfinal_state is not None else torch.zeros_like(dh0))

    ddt_bias = ddt_parts.sum(dim=0) if inputs.dt_bias is not None else None
    return chunks.gradients(inputs, dq, dk, dv, dg, dbeta, dA_rows, dh0, ddt_bias=ddt_bias)
