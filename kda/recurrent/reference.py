"""The decode op's reference: the recurrence token by token, sequence by sequence, with the state pool.

Plain Python loops over sequences and tokens, in float64 by default: the ground truth the decode op's
backends are verified against (the torch backend included). It reads every index on the host (it is
never in a hot path) and shares with the backends only the input transforms of `kda.reference`.

Per value head, with the state ``S in R^{K x V}`` (docs/design.md section 1)::

    S_t = (I - beta_t k_t k_t^T) Diag(exp(g_t)) S_{t-1} + beta_t k_t v_t^T,    o_t = scale * S_t^T q_t

The pool (docs/design.md, "The decode op"): sequence n starts from slot ``r_n`` of ``initial_state``:
``ssm_state_indices[n]``, or ``ssm_state_indices[n, num_accepted_tokens[n] - 1]`` with per-token indices
(``num_accepted_tokens`` None counts as 1), or n itself with ``inplace_final_state`` and no indices. A
negative ``r_n`` marks a padding row: its outputs are zero, and nothing is read or written for it. With
``inplace_final_state`` the state after the last token goes to slot ``r_n`` (one slot per sequence), or
the state after token t to slot ``ssm_state_indices[n, t]`` when that is not negative (per token).
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass

import torch

from kda.reference import beta_transform, l2norm, log_decay, naive_recurrence


@dataclass
class RecurrentReference:
    """What the reference computed, in `compute_dtype`.

    ``pool`` is the pool after the call (a copy: the caller's is never written) with the states written
    rounded to the pool's dtype, as a kernel storing them must; ``written`` the slots written.
    """

    o: torch.Tensor  # [B, T, HV, V]
    final_state: torch.Tensor | None  # [N, HV, K, V] (call's layout): output_final_state without inplace
    pool: torch.Tensor | None  # [num_slots, HV, K, V] (call's layout), in the pool's own dtype
    written: list[int]
    exact_pool: torch.Tensor | None  # the same pool with the written states unrounded (compute_dtype)


def fused_recurrent_reference(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    A_log: torch.Tensor | None = None,
    dt_bias: torch.Tensor | None = None,
    scale: float | None = None,
    initial_state: torch.Tensor | None = None,
    output_final_state: bool = False,
    use_qk_l2norm_in_kernel: bool = False,
    use_gate_in_kernel: bool = False,
    use_beta_sigmoid_in_kernel: bool = False,
    allow_neg_eigval: bool = False,
    lower_bound: float | None = None,
    state_v_first: bool = False,
    cu_seqlens: torch.Tensor | None = None,
    *,
    ssm_state_indices: torch.Tensor | None = None,
    num_accepted_tokens: torch.Tensor | None = None,
    inplace_final_state: bool = False,
    compute_dtype: torch.dtype = torch.float64,
) -> RecurrentReference:
    """The decode op with `fused_recurrent_kda`'s arguments, exact in `compute_dtype` (no LOG_DECAY_FLOOR:
    exp of a log decay of -inf is 0 here). Checks no rule: validate with `RecurrentSpec` first."""

    def cast(t: torch.Tensor) -> torch.Tensor:
        return t.detach().to("cpu", compute_dtype)

    q, k, v, g, beta = (cast(t) for t in (q, k, v, g, beta))
    A = None if A_log is None else cast(A_log).reshape(-1)
    bias = None if dt_bias is None else cast(dt_bias)
    B, T, _, K = q.shape
    HV, V = v.shape[2], v.shape[3]
    scale = K**-0.5 if scale is None else scale
    if use_qk_l2norm_in_kernel:
        q, k = l2norm(q), l2norm(k)
    beta = beta_transform(beta, sigmoid=use_beta_sigmoid_in_kernel, allow_neg_eigval=allow_neg_eigval)
    g = log_decay(
        g,
        use_gate_in_kernel=use_gate_in_kernel,
        safe_gate_on=lower_bound is not None,
        A_log=A,
        dt_bias=bias,
        lower_bound=lower_bound,
    )

    # Token spans per sequence, in the flattened token axis.
    if cu_seqlens is None:
        spans = [(n, n * T, (n + 1) * T) for n in range(B)]
    else:
        bounds = [int(x) for x in cu_seqlens.tolist()]
        spans = [(n, a, b) for n, (a, b) in enumerate(itertools.pairwise(bounds))]
    N = len(spans)
    flat = [x.reshape(B * T, *x.shape[2:]) for x in (q, k, v, g, beta)]

    def kv(state: torch.Tensor) -> torch.Tensor:  # call's layout -> [.., K, V]
        return state.transpose(-1, -2) if state_v_first else state

    pooled = ssm_state_indices is not None or inplace_final_state
    indices = (
        None
        if ssm_state_indices is None
        else [[int(x) for x in row] for row in ssm_state_indices.reshape(N, -1).tolist()]
    )
    accepted = None if num_accepted_tokens is None else [int(x) for x in num_accepted_tokens.tolist()]
    pool = None if not pooled or initial_state is None else initial_state.detach().to("cpu").clone()
    exact_pool = None if pool is None else pool.to(compute_dtype)
    written: list[int] = []

    o = torch.zeros(B * T, HV, V, dtype=compute_dtype)
    finals = torch.zeros(N, HV, K, V, dtype=compute_dtype)
    for n, start, end in spans:
        if pooled:
            row = indices[n] if indices is not None else [n]
            read = row[accepted[n] - 1 if accepted is not None else 0]
            if read < 0:  # a padding row: zero output, nothing read or written
                continue
            assert initial_state is not None
            S = kv(initial_state[read].to("cpu", compute_dtype))[None]
        elif initial_state is not None:
            S = kv(initial_state[n].to("cpu", compute_dtype))[None]
        else:
            S = torch.zeros(1, HV, K, V, dtype=compute_dtype)
        for t, p in enumerate(range(start, end)):
            q_t, k_t, v_t, g_t, b_t = (x[p : p + 1][None] for x in flat)  # [1, 1, ...]
            o_t, S = naive_recurrence(q_t, k_t, v_t, g_t, b_t, scale, S)
            o[p] = o_t[0, 0]
            if inplace_final_state and indices is not None and len(indices[n]) > 1 and indices[n][t] >= 0:
                _store(pool, exact_pool, indices[n][t], kv(S[0]), written)
        finals[n] = S[0]
        if inplace_final_state and (indices is None or len(indices[n]) == 1) and end > start:
            _store(pool, exact_pool, read, kv(S[0]), written)

    final_state = None
    if output_final_state and not inplace_final_state:
        final_state = finals.transpose(-1, -2) if state_v_first else finals
    return RecurrentReference(o.reshape(B, T, HV, V), final_state, pool, written, exact_pool)


def _store(
    pool: torch.Tensor | None, exact: torch.Tensor | None, slot: int, state: torch.Tensor, written: list[int]
) -> None:
    assert pool is not None and exact is not None
    pool[slot] = state.to(pool.dtype)
    exact[slot] = state
    written.append(slot)
