"""The decode op in plain PyTorch: a token loop in fp32 over all sequences at once, with the state pool.

Readable statement of what the decode kernels do (docs/design.md, "The decode op"), written so that it
never reads an index on the host: sequence lengths, slots and padding are device tensors, and every
choice that depends on them is a mask (`torch.where`), a gather (`index_select`) or a scatter
(`index_add_`, `index_copy_`). So a call with indices on the GPU costs no host sync.

Shapes: N sequences, each a span ``[start_n, start_n + len_n)`` of the flattened token axis (B*T tokens);
``S [N, HV, K, V]`` fp32 (the kernel-side layout; ``state_v_first`` pools are transposed on the way in and
out). Step t of the loop advances every sequence with ``t < len_n`` by its token ``start_n + t``::

    S <- S * exp(g_t)                      (per key channel)
    S <- S + k_t (beta_t (v_t - S^T k_t))^T   = (I - beta k k^T) S + beta k v^T
    o_t = scale * S^T q_t

The loop runs ``L`` steps: T for a dense batch; for varlen the longest sequence when ``cu_seqlens`` is on
the host, else ``T_max`` of per-token indices, else every token (B*T: the bound known without a sync).
"""

from __future__ import annotations

import torch

from kda.backends.base import RecurrentInputs, RecurrentResult
from kda.recurrent.spec import RecurrentSpec
from kda.reference import LOG_DECAY_FLOOR, beta_transform, l2norm, log_decay


def torch_recurrent(inputs: RecurrentInputs, spec: RecurrentSpec) -> RecurrentResult:
    """The decode op for one validated call (forward only; see the module docstring)."""
    with torch.no_grad(), torch.autocast(spec.device.type, enabled=False):
        return _torch_recurrent(inputs, spec)


def _torch_recurrent(inputs: RecurrentInputs, spec: RecurrentSpec) -> RecurrentResult:
    device, f32 = spec.device, torch.float32
    N, HV, K, V = spec.num_seqs, spec.HV, spec.K, spec.V
    tokens = spec.B * spec.T
    group = HV // spec.H

    # Inputs in fp32, flattened to the token axis: [tokens, HV, D].
    q, k = (x.to(f32).reshape(tokens, spec.H, K) for x in (inputs.q, inputs.k))
    if spec.use_qk_l2norm_in_kernel:
        q, k = l2norm(q), l2norm(k)
    q, k = q.repeat_interleave(group, dim=1), k.repeat_interleave(group, dim=1)  # value head hv reads hv // group
    v = inputs.v.to(f32).reshape(tokens, HV, V)
    beta = beta_transform(
        inputs.beta.to(f32).reshape(tokens, HV),
        sigmoid=spec.use_beta_sigmoid_in_kernel,
        allow_neg_eigval=spec.allow_neg_eigval,
    )
    g = log_decay(
        inputs.g.to(f32).reshape(tokens, HV, K),
        use_gate_in_kernel=spec.use_gate_in_kernel,
        safe_gate_on=spec.lower_bound is not None,
        A_log=None if inputs.A_log is None else inputs.A_log.to(f32).reshape(-1),
        dt_bias=None if inputs.dt_bias is None else inputs.dt_bias.to(f32),
        lower_bound=spec.lower_bound,
    ).clamp(min=LOG_DECAY_FLOOR)  # the floor every backend computes with (kda.reference.LOG_DECAY_FLOOR)

    # Where each sequence's tokens are: [N] device tensors.
    if inputs.cu_seqlens is None:
        starts = torch.arange(N, device=device) * spec.T
        lengths = torch.full((N,), spec.T, device=device)
        steps = spec.T
    else:
        cu = inputs.cu_seqlens.long()
        starts, lengths = cu[:-1], cu[1:] - cu[:-1]
        if spec.cu_seqlens_values is not None:
            steps = max(b - a for a, b in zip(spec.cu_seqlens_values[:-1], spec.cu_seqlens_values[1:]))
        elif spec.pool_kind == "tokens":
            steps = min(tokens, spec.tokens_per_seq)
        else:
            steps = tokens

    # The starting state of each sequence, and which rows are padding.
    pool = inputs.initial_state
    read, real = _read_slots(inputs, spec)  # [N] slot per sequence (clamped to >= 0), [N] bool
    if pool is None:
        S = torch.zeros(N, HV, K, V, dtype=f32, device=device)
    else:
        chosen = pool if read is None else pool.index_select(0, read)
        S = _to_kv(chosen, spec).to(f32)
        S = torch.where(real[:, None, None, None], S, torch.zeros((), dtype=f32, device=device))

    write_tokens = spec.inplace_final_state and spec.pool_kind == "tokens"
    indices = inputs.ssm_state_indices
    o = torch.zeros(tokens, HV, V, dtype=f32, device=device)
    for t in range(steps):
        active = real & (t < lengths)  # [N]
        pos = (starts + t).clamp(max=tokens - 1)  # [N]; an inactive row's pos is ignored (masked below)
        q_t, k_t, v_t, g_t, b_t = (x.index_select(0, pos) for x in (q, k, v, g, beta))
        decayed = S * g_t.exp()[..., None]
        delta = b_t[..., None] * (v_t - torch.einsum("nhkv,nhk->nhv", decayed, k_t))
        updated = decayed + k_t[..., None] * delta[:, :, None, :]
        S = torch.where(active[:, None, None, None], updated, S)
        o_t = spec.scale * torch.einsum("nhkv,nhk->nhv", S, q_t)
        # Each token belongs to one sequence and one step, so adding the active rows' outputs (and exact
        # zeros for the others, whose pos may be another sequence's token) writes every token once.
        o.index_add_(0, pos, torch.where(active[:, None, None], o_t, torch.zeros((), dtype=f32, device=device)))
        if write_tokens and t < spec.tokens_per_seq:
            assert indices is not None and pool is not None
            slot = indices[:, t].long()
            _write_slots(pool, slot, _from_kv(S, spec), active & (slot >= 0))

    if spec.inplace_final_state and spec.pool_kind == "slots":
        assert pool is not None
        slots = read if read is not None else torch.arange(N, device=device)
        _write_slots(pool, slots, _from_kv(S, spec), real & (lengths > 0))

    o_out = o.reshape(spec.B, spec.T, HV, V).to(spec.dtype)
    if inputs.out is not None:
        inputs.out.copy_(o_out)
        o_out = inputs.out
    if spec.inplace_final_state:
        return RecurrentResult(o_out, pool)
    if spec.output_final_state:
        return RecurrentResult(o_out, _from_kv(S, spec).contiguous())
    return RecurrentResult(o_out, None)


def _read_slots(inputs: RecurrentInputs, spec: RecurrentSpec) -> tuple[torch.Tensor | None, torch.Tensor]:
    """The slot each sequence starts from (clamped to a valid slot; None: slot n, no gather needed) and
    which rows are real (a negative slot marks padding). [N] each, on the device, no host read."""
    N, device = spec.num_seqs, spec.device
    indices = inputs.ssm_state_indices
    if indices is None:
        return None, torch.ones(N, dtype=torch.bool, device=device)
    if indices.dim() == 1:
        slot = indices.long()
    else:
        accepted = inputs.num_accepted_tokens
        column = (
            torch.zeros(N, dtype=torch.long, device=device) if accepted is None else accepted.long() - 1
        )  # the last accepted token's state is the one to continue from
        slot = indices.long().gather(1, column[:, None])[:, 0]
    return slot.clamp(min=0), slot >= 0


def _write_slots(pool: torch.Tensor, slots: torch.Tensor, states: torch.Tensor, mask: torch.Tensor) -> None:
    """``pool[slots[n]] = states[n]`` for the rows where `mask`, without reading the mask on the host.

    Rows not to be written must still go somewhere in one `index_copy_`: each is sent to the first
    writing row's slot with that row's value, so duplicates carry equal values and the result does not
    depend on their order. When no row writes, every row rewrites slot 0 with its own current value (the
    same bits). Shapes: pool ``[S, ...]``, slots ``[N]`` (>= 0 where `mask`), states ``[N, ...]`` fp32.
    """
    first = mask.to(torch.int8).argmax()  # the first writing row (row 0 when none writes)
    anyone = mask.any()
    target = torch.where(mask, slots, torch.where(anyone, slots[first], torch.zeros_like(slots)))
    wide = (-1,) + (1,) * (states.dim() - 1)
    value = torch.where(mask.view(wide), states, states[first].unsqueeze(0)).to(pool.dtype)
    value = torch.where(anyone, value, pool[0].unsqueeze(0).expand_as(value))
    pool.index_copy_(0, target, value)


def _to_kv(states: torch.Tensor, spec: RecurrentSpec) -> torch.Tensor:
    return states.transpose(-1, -2) if spec.state_v_first else states


def _from_kv(states: torch.Tensor, spec: RecurrentSpec) -> torch.Tensor:
    return states.transpose(-1, -2) if spec.state_v_first else states
