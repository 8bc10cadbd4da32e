"""The backward pass: the host wrapper (see `tests/backends/triton/backward_math.py` for the formulas, checked against
autograd in float64).

Two launches and the tails:

1. `state_backward.bwd_state_kernel`: serial per (sequence, value head, V block), walking chunks in
   reverse: the gradient ``dh`` of the state leaving each chunk, ``dd`` (of ``v_new``) and ``dh0``;
2. `chunk_backward.bwd_chunk_kernel`: per (chunk, value head), every per-token gradient of the chunk (q,
   k, v, beta and the per-token log decay a), the pairwise terms' diagonal blocks in `diagonal_backward`;
3. the tails (`tails`, two launches): the value heads of a GVA group summed into their q/k head, and the
   elementwise transforms (l2norm, beta activation, gate) differentiated, with the sums over tokens of
   ``dA_log`` and ``ddt_bias`` as per-block partials added in torch.

The forward's saved intermediates (`forward`): ``G``, ``w``, ``v_new``, ``h``, ``A_qk``, ``M``, ``T`` and
the chunk layout, configuration and products it ran with. The two kernels are launched through this
module's names, which `benchmarks/triton_stages.py --train-sweep` replaces to set `chunk_backward`'s
timing-only ``PAIRS`` switch.
"""

from __future__ import annotations

import torch
import triton

from kda.backends.triton.chunk_backward import bwd_chunk_kernel
from kda.backends.triton.intra import SUB_CHUNK
from kda.backends.triton.state_backward import bwd_state_kernel


def triton_backward(inputs, spec, saved: dict, do: torch.Tensor, dfinal_state: torch.Tensor | None):
    """Every gradient of the forward that saved ``saved``, given ``do`` and the final state's gradient."""
    from kda.backends.base import KDAGradients
    from kda.backends.triton.forward import interpreting
    from kda.backends.triton.tails import fused_tails

    device = spec.device
    B, T, H, HV, K, V, C = spec.B, spec.T, spec.H, spec.HV, spec.K, spec.V, spec.chunk_size
    tokens = B * T
    layout, config = saved["layout"], saved["config"]
    NT, N = layout.num_chunks, layout.num_seqs
    BK, BV_all, precision = saved["BK"], saved["BV_all"], saved["precision"]
    f32 = torch.float32
    q, k, v, beta = (t.contiguous() for t in (inputs.q, inputs.k, inputs.v, inputs.beta))
    do = do.contiguous()
    dd = torch.zeros(tokens, HV, V, dtype=f32, device=device)
    dh = torch.empty(max(NT, 1), HV, K, V, dtype=f32, device=device)
    dh0 = torch.empty(spec.state_shape, dtype=f32, device=device) if inputs.initial_state is not None else None
    dht = None if dfinal_state is None else dfinal_state.contiguous().to(f32)
    BV = min(config.backward_state_block_v, BV_all)
    L2 = spec.use_qk_l2norm_in_kernel
    bwd_state_kernel[(N, HV, triton.cdiv(V, BV))](
        q,
        k,
        saved["G"],
        saved["w"],
        saved["A_qk"],
        do,
        dd,
        dh,
        dht if dht is not None else dd,
        dh0 if dh0 is not None else dd,
        layout.bounds,
        layout.chunk_offsets,
        spec.scale,
        H=H,
        HV=HV,
        K=K,
        V=V,
        L2=L2,
        HAS_DHT=dht is not None,
        STORE_DH0=dh0 is not None,
        V_FIRST=spec.state_v_first,
        BT=C,
        BK=BK,
        BV=BV,
        DOT_PRECISION=precision.backward_state,
        num_warps=config.backward_state_warps,
        num_stages=1,
    )
    dq_h = torch.zeros(tokens, HV, K, dtype=f32, device=device)
    dk_h, da = torch.zeros_like(dq_h), torch.zeros_like(dq_h)
    # dv in v's dtype: 48 MiB less at the backward's peak at B4_T2048_H16_D128 (bf16), and no cast after
    dv = torch.zeros(tokens, HV, V, dtype=inputs.v.dtype, device=device)
    dbeta_h = torch.zeros(tokens, HV, dtype=f32, device=device)
    if NT > 0:
        bwd_chunk_kernel[(NT, HV)](
            q,
            k,
            v,
            beta,
            saved["G"],
            saved["h"],
            dh,
            saved["v_new"],
            dd,
            do,
            saved["T"],
            saved["A_qk"],
            saved["M"],
            torch.empty(NT, HV, 2, C, dtype=f32, device=device),
            dq_h,
            dk_h,
            da,
            dv,
            dbeta_h,
            layout.chunk_starts,
            layout.chunk_seq_ends,
            spec.scale,
            H=H,
            HV=HV,
            K=K,
            V=V,
            L2=L2,
            SIGMOID=spec.use_beta_sigmoid_in_kernel,
            TWO=spec.allow_neg_eigval,
            BT=C,
            BK=BK,
            BV=min(config.backward_block_v, BV_all),
            BKB=min(config.backward_block_k, BK),
            BKC=min(BK, config.backward_block_k, 16),
            BC=SUB_CHUNK,
            DOT_PRECISION=precision.backward_chunk,
            ROUND=interpreting(),
            num_warps=config.backward_warps,
            num_stages=config.backward_stages,
        )
    dq, dk, dg, dbeta, dA_log, ddt_bias = fused_tails(inputs, spec, dq_h, dk_h, da, dbeta_h)

    def like(grad, ref):
        if ref is None:
            return None
        return torch.zeros_like(ref) if grad is None else grad.to(ref.dtype)

    return KDAGradients(
        dq=dq,
        dk=dk,
        dv=like(dv.view(B, T, HV, V), inputs.v),
        dg=dg.view_as(inputs.g),
        dbeta=dbeta.view_as(inputs.beta),
        dA_log=like(dA_log, inputs.A_log),
        ddt_bias=like(ddt_bias, inputs.dt_bias),
        dinitial_state=like(dh0, inputs.initial_state),
    )
