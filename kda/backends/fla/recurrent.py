"""The `fla` backend's decode op: FLA 0.6's `fused_recurrent_kda_fwd` (its Triton kernel), without a pool.

What is offered, and why no state pool: FLA's kernel addresses ``initial_state + slot * stride`` for every
sequence, so a padding row (slot -1) reads, and with ``inplace_final_state`` writes, one state *before*
the pool: memory that is not the pool's. Telling padding rows apart needs their index values, which kda
never reads on the host for a device call (it would cost a sync and break CUDA-graph capture), and every
safe remapping on the device (sending padding to a real slot) races with that slot's own sequence. FLA
0.6 also writes per-token states to ``final_state[bos + t]`` of an N-row buffer when the pool is not
written in place (out of bounds past the first token), and with 1-D indices stores token t's state at
``ssm_state_indices[n + t]``. So pool calls are declined, with that reason, and go to the backends that
implement the pool contract (torch, triton); FLA's pool kernel is still timed, directly, as the decode
bench's ``baseline:fla``.

Without a pool the adapter calls FLA's function with contiguous inputs, ``cu_seqlens`` as int64, ``A_log``
and ``dt_bias`` flat, and the gate input floored as for `chunk_kda` (`floored_gate_input`: a log decay
below -32 is computed as -32), on FLA's Triton path only (`route.triton_path_only`).
"""

from __future__ import annotations

import importlib
import inspect
from types import SimpleNamespace
from typing import Any

import torch

from kda.backends.base import RecurrentInputs, RecurrentResult
from kda.backends.fla.route import triton_path_only
from kda.recurrent.spec import RecurrentSpec
from kda.reference import LOG_DECAY_FLOOR

_MODULE = "fla.ops.kda.fused_recurrent"

POOL_REASON = (
    "state pools are not offered: FLA 0.6's kernel reads (and in place writes) slot -1 outside the pool for "
    "padding rows, which kda cannot rule out without reading the indices on the host (a sync)"
)


def fla_fused_recurrent_fwd() -> Any:
    """FLA's `fused_recurrent_kda_fwd`, its backend dispatch peeled off (LookupError if it is not FLA's own)."""
    module = importlib.import_module(_MODULE)
    function = inspect.unwrap(module.fused_recurrent_kda_fwd)
    code = getattr(function, "__code__", None)
    if code is None or function.__module__ != _MODULE or code.co_name != "fused_recurrent_kda_fwd":
        raise LookupError(f"{_MODULE}.fused_recurrent_kda_fwd does not unwrap to FLA's own (found {function!r})")
    return function


def unsupported_reasons(spec: RecurrentSpec) -> list[str]:
    broken = [POOL_REASON] if spec.pool_kind != "none" else []
    if spec.lower_bound is not None and spec.lower_bound < LOG_DECAY_FLOOR:
        broken.append(f"a lower_bound below {LOG_DECAY_FLOOR} (the log-decay floor) cannot be floored in FLA's gate")
    return broken


def fla_recurrent(inputs: RecurrentInputs, spec: RecurrentSpec) -> RecurrentResult:
    run = fla_fused_recurrent_fwd()
    q, k, v, beta = (t.contiguous() for t in (inputs.q, inputs.k, inputs.v, inputs.beta))
    g = inputs.g
    if not spec.use_gate_in_kernel:
        g = g.clamp(min=LOG_DECAY_FLOOR)
    elif spec.lower_bound is None:
        from kda.backends.fla import floored_gate_input

        softplus = SimpleNamespace(use_gate_in_kernel=True, safe_gate=False)  # the two fields it reads
        g = floored_gate_input(g, softplus, inputs.A_log, inputs.dt_bias)  # type: ignore[arg-type]
    # the sigmoid gate stays above lower_bound >= LOG_DECAY_FLOOR (see unsupported_reasons): nothing to floor
    out = inputs.out if inputs.out is not None and inputs.out.is_contiguous() else None
    cu = None if inputs.cu_seqlens is None else inputs.cu_seqlens.long()
    A_log = None if inputs.A_log is None else inputs.A_log.reshape(-1).contiguous()
    dt_bias = None if inputs.dt_bias is None else inputs.dt_bias.reshape(-1).contiguous()
    with triton_path_only(), torch.no_grad():
        o, final_state = run(
            q=q,
            k=k,
            v=v,
            g=g.contiguous(),
            beta=beta,
            A_log=A_log,
            dt_bias=dt_bias,
            initial_state=None if inputs.initial_state is None else inputs.initial_state.contiguous(),
            scale=spec.scale,
            output_final_state=spec.output_final_state,
            inplace_final_state=False,
            state_v_first=spec.state_v_first,
            cu_seqlens=cu,
            use_qk_l2norm_in_kernel=spec.use_qk_l2norm_in_kernel,
            use_gate_in_kernel=spec.use_gate_in_kernel,
            use_beta_sigmoid_in_kernel=spec.use_beta_sigmoid_in_kernel,
            allow_neg_eigval=spec.allow_neg_eigval,
            lower_bound=spec.lower_bound,
            out=out,
        )
    if inputs.out is not None and o is not inputs.out:
        inputs.out.copy_(o)
        o = inputs.out
    return RecurrentResult(o, final_state if spec.output_final_state else None)
