"""The backward pass: seven launches (`state_backward`, `chunk_backward`, `score_backward`, `score_diagonal`,
`gate_tail`, `qk_tail` for q and for k), six where the gate bounds every strip's decays (the sigmoid and safe
gates: `score_backward.within_limits`) and `score_diagonal` would only read `G` and stop; from q and k as
given (with each row's l2norm scale) and the forward's saved chunk-major intermediates (all fp32 when
training).

Scratch, chunk-major fp32: ``dh [NT, HV, K, V]``, ``dv_new [NT, HV, C, V]``, ``dq``/``dk``/``dG`` per value
head ``[NT, HV, C, K]``, ``dP_qk``/``dP_kk [NT, HV, C, C]``, ``dbeta [NT, HV, C]``. The sums over tokens
(``ddt_bias``, ``dA_log``) are torch reductions of per-token and per-row parts.
"""

from __future__ import annotations

import torch

from kda.backends import chunks
from kda.backends.base import KDAGradients, KDAInputs
from kda.backends.helion import (
    chunk_backward,
    forward,
    runtime,
    score_backward,
    score_diagonal,
    state_backward,
    tails,
)
from kda.spec import KDASpec

# `chunk_backward`'s products on bf16 halves in training on half inputs (its ``HALVES`` form), as the two
# serial passes take theirs: on an H100 at B4_T2048_H16_D128, 1.113 ms against the TF32x3 form's 2.287 at
# its tuned setting (`docs/design.md`, "The helion backend"; `benchmarks/helion_halves.py` compares the two
# on one training call's arguments)
CHUNK_BACKWARD_ON_HALVES = True


def helion_backward(
    inputs: KDAInputs, spec: KDASpec, saved: dict, do: torch.Tensor, dfinal_state: torch.Tensor | None
) -> KDAGradients:
    plan: forward.Plan = saved["plan"]
    layout = plan.layout
    device, f32 = spec.device, torch.float32
    B, T, H, HV, K, V, C = spec.B, spec.T, spec.H, spec.HV, spec.K, spec.V, spec.chunk_size
    tokens, NT = B * T, max(layout.num_chunks, 1)

    def run(fn, *args) -> None:
        runtime.launch(fn, plan.precision, args, plan.key)

    G = saved["G"]
    placeholder = G
    L2 = spec.use_qk_l2norm_in_kernel
    # as given (autograd's saved inputs): each kernel scales a row by its l2norm's r (`rstd_*`) with L2
    q, k = inputs.q.reshape(tokens, H, K), inputs.k.reshape(tokens, H, K)
    rstd_q = saved["rstd_q"] if L2 else saved["beta"]  # without the l2norm, a placeholder no kernel reads
    rstd_k = saved["rstd_k"] if L2 else saved["beta"]
    do = do.reshape(tokens, HV, V)
    dh = torch.empty(NT, HV, K, V, dtype=f32, device=device)
    dv_new = torch.empty(NT, HV, C, V, dtype=f32, device=device)
    dh0 = torch.empty(spec.state_shape, dtype=f32, device=device) if inputs.initial_state is not None else None
    run(
        state_backward.state_backward_kernel,
        do, q, k, rstd_q, rstd_k, saved["w"], saved["A_qk"], G,
        layout.chunk_starts, layout.chunk_seq_ends, layout.chunk_bounds,
        dfinal_state if dfinal_state is not None else placeholder,
        dh, dv_new, dh0 if dh0 is not None else placeholder,
        spec.scale, plan.group, C, dfinal_state is not None, dh0 is not None, spec.state_v_first, L2, plan.halves,
    )  # fmt: skip

    # Each buffer is made when its stage comes and dropped once read: the gradients of the inputs after
    # `chunk_backward`, whose working set (every saved tensor, dh and dv_new, its five outputs) is the
    # backward's peak (`benchmarks/peak_memory.py`)
    dv = torch.empty(tokens, HV, V, dtype=inputs.v.dtype, device=device)
    dA_rows = torch.zeros(NT, HV, C, dtype=f32, device=device)
    if layout.num_chunks > 0:
        dq_c, dk_c, dG_c = (torch.empty(NT, HV, C, K, dtype=f32, device=device) for _ in range(3))
        dP_qk, dP_kk = (torch.empty(NT, HV, C, C, dtype=f32, device=device) for _ in range(2))
        dbeta_c = torch.empty(NT, HV, C, dtype=f32, device=device)
        run(
            chunk_backward.chunk_backward_kernel,
            do, inputs.v.reshape(tokens, HV, V), q, k, rstd_q, rstd_k, G, saved["beta"], saved["T"], saved["M"],
            saved["h"], dh, saved["v_new"], dv_new, layout.chunk_starts, layout.chunk_seq_ends,
            dv, dq_c, dk_c, dG_c, dP_qk, dP_kk, dbeta_c, spec.scale, plan.group, C, L2,
            plan.halves and CHUNK_BACKWARD_ON_HALVES,
        )  # fmt: skip
        del dh, dv_new
        score_kernels = [score_backward.score_backward_kernel]
        if not score_backward.within_limits(forward.GATES[spec.gate_mode], spec.lower_bound or 0.0):
            score_kernels.append(score_diagonal.score_diagonal_kernel)  # steep strips possible: their blocks
        for fn in score_kernels:
            run(
                fn,
                q, k, rstd_q, rstd_k, G, dP_qk, dP_kk, layout.chunk_starts, layout.chunk_seq_ends, dq_c, dk_c, dG_c,
                plan.group, C, L2,
            )  # fmt: skip
        del dP_qk, dP_kk
        dg32 = torch.empty(tokens, HV, K, dtype=f32, device=device)
        dbeta = torch.empty(tokens, HV, dtype=inputs.beta.dtype, device=device)
        A_log = inputs.A_log if inputs.A_log is not None else torch.zeros(HV, dtype=f32, device=device)
        dt_bias = inputs.dt_bias.reshape(HV, K) if inputs.dt_bias is not None else placeholder
        run(
            tails.gate_tail_kernel,
            inputs.g.reshape(tokens, HV, K), inputs.beta.reshape(tokens, HV), A_log, dt_bias, dG_c, dbeta_c,
            layout.chunk_starts, layout.chunk_seq_ends, dg32, dbeta, dA_rows,
            float(spec.lower_bound or 0.0), 2.0 if spec.allow_neg_eigval else 1.0,
            C, forward.GATES[spec.gate_mode], inputs.dt_bias is not None, spec.use_beta_sigmoid_in_kernel,
        )  # fmt: skip
        del dG_c, dbeta_c
        dq = torch.empty(tokens, H, K, dtype=inputs.q.dtype, device=device)
        dk = torch.empty(tokens, H, K, dtype=inputs.k.dtype, device=device)
        for x, rstd, dx_c, dx in ((q, rstd_q, dq_c, dq), (k, rstd_k, dk_c, dk)):
            run(
                tails.qk_tail_kernel,
                x, rstd, dx_c, layout.chunk_starts, layout.chunk_seq_ends, dx, plan.group, C, L2,
            )  # fmt: skip
    else:  # every sequence empty: nothing but the state's own gradient
        dg32 = torch.zeros(tokens, HV, K, dtype=f32, device=device)
        dbeta = torch.zeros(tokens, HV, dtype=inputs.beta.dtype, device=device)
        dq = torch.zeros(tokens, H, K, dtype=inputs.q.dtype, device=device)
        dk = torch.zeros(tokens, H, K, dtype=inputs.k.dtype, device=device)
        dv.zero_()

    return chunks.gradients(inputs, dq, dk, dv, dg32, dbeta, dA_rows, dh0)
