"""The triton backend's decode op: `fused_recurrent_kda` calls mapped onto `recurrent.recurrent_forward`.

`recurrent_forward` writes states only into the ``final_state`` tensor it is given (a pool is updated in
place by passing it as both ``initial_state`` and ``final_state``) and needs contiguous token inputs,
a contiguous ``out`` and contiguous rows in its state tensors. This module does the mapping, and makes
copies where the caller's tensors are not laid out that way (views of contiguous tensors cost nothing;
strided ones a copy, no host sync):

- no pool: ``final_state`` is a new fp32 ``[N, HV, K, V]`` when ``output_final_state``;
- a pool written in place: the pool is passed twice (a pool whose rows are strided is updated through
  a contiguous copy, copied back whole: the same bits where nothing was written);
- a pool only read (``inplace_final_state=False``): no ``final_state``. Returning a new per-sequence state
  from a read-only pool is not offered (the kernel writes states at slot positions): `supports` says so.
"""

from __future__ import annotations

import torch

from kda.backends.base import RecurrentInputs, RecurrentResult
from kda.recurrent.spec import RecurrentSpec


def unsupported_reasons(spec: RecurrentSpec) -> list[str]:
    """What of this decode call the kernel does not implement (beyond device checks)."""
    if spec.pool_kind != "none" and not spec.inplace_final_state and spec.output_final_state:
        return ["a read-only state pool with output_final_state=True (a new per-sequence state) is not implemented"]
    return []


def triton_recurrent(inputs: RecurrentInputs, spec: RecurrentSpec) -> RecurrentResult:
    from kda.backends.triton.recurrent import recurrent_forward

    q, k, v, g, beta = (t.contiguous() for t in (inputs.q, inputs.k, inputs.v, inputs.g, inputs.beta))
    out = inputs.out
    target = out if out is not None and out.is_contiguous() else torch.empty_like(v, dtype=spec.dtype)
    pool = inputs.initial_state
    initial, final = pool, None
    if spec.inplace_final_state:
        assert pool is not None
        initial = pool if _rows_contiguous(pool) else pool.contiguous()
        final = initial
    elif pool is not None and not _rows_contiguous(pool):
        initial = pool.contiguous()
    if spec.pool_kind == "none" and spec.output_final_state:
        final = torch.empty(spec.state_shape, dtype=torch.float32, device=spec.device)
    recurrent_forward(
        q,
        k,
        v,
        g,
        beta,
        scale=spec.scale,
        A_log=inputs.A_log,
        dt_bias=inputs.dt_bias,
        use_gate_in_kernel=spec.use_gate_in_kernel,
        lower_bound=spec.lower_bound,
        use_qk_l2norm_in_kernel=spec.use_qk_l2norm_in_kernel,
        use_beta_sigmoid_in_kernel=spec.use_beta_sigmoid_in_kernel,
        allow_neg_eigval=spec.allow_neg_eigval,
        state_v_first=spec.state_v_first,
        initial_state=initial,
        ssm_state_indices=inputs.ssm_state_indices,
        num_accepted_tokens=inputs.num_accepted_tokens,
        cu_seqlens=inputs.cu_seqlens,
        final_state=final,
        out=target,
    )
    if out is not None and target is not out:
        out.copy_(target)
        target = out
    if spec.inplace_final_state:
        assert pool is not None and final is not None
        if final is not pool:
            pool.copy_(final)
        return RecurrentResult(target, pool)
    return RecurrentResult(target, final if spec.output_final_state else None)


def _rows_contiguous(state: torch.Tensor) -> bool:
    """Each state (row of the leading dimension) contiguous, as the kernel addresses it."""
    a, b = state.shape[-2:]
    return state.stride()[1:] == (a * b, b, 1)
