"""Inputs for the decode op's tests: random, never zero, with a state pool in a random slot permutation."""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F


def decode_call(
    *,
    lengths: tuple[int, ...] = (1, 3, 0, 2),
    varlen: bool = True,
    H: int = 1,
    group: int = 2,
    K: int = 16,
    V: int = 12,
    dtype: torch.dtype = torch.float32,
    pool: str = "slots",  # "none", "slots" or "tokens"
    pool_dtype: torch.dtype = torch.float32,
    state_v_first: bool = False,
    inplace: bool = True,
    padding: int | None = 1,  # which sequence is a padding row (pools only)
    gate: str = "sigmoid",  # "pregated", "softplus" or "sigmoid"
    seed: int = 0,
) -> dict[str, Any]:
    """`fused_recurrent_kda` keyword arguments; unused pool slots hold NaN or random values."""
    gen = torch.Generator().manual_seed(seed)
    N = len(lengths)
    B, T = (1, sum(lengths)) if varlen else (N, lengths[0])
    HV = H * group

    def randn(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=gen)

    call: dict[str, Any] = {
        "q": randn(B, T, H, K).to(dtype),
        "k": F.normalize(randn(B, T, H, K), dim=-1).to(dtype),
        "v": randn(B, T, HV, V).to(dtype),
        "beta": randn(B, T, HV).to(dtype),
        "use_beta_sigmoid_in_kernel": True,
        "state_v_first": state_v_first,
    }
    if gate == "pregated":
        call["g"] = F.logsigmoid(randn(B, T, HV, K) + 1).to(dtype)
    else:
        call.update(g=randn(B, T, HV, K).to(dtype), use_gate_in_kernel=True, A_log=torch.rand(HV, generator=gen))
        call["dt_bias"] = randn(HV * K) * 0.5
        if gate == "sigmoid":
            call["lower_bound"] = -5.0
    if varlen:
        bounds = [0]
        for n in lengths:
            bounds.append(bounds[-1] + n)
        call["cu_seqlens"] = torch.tensor(bounds)
    inner = (HV, V, K) if state_v_first else (HV, K, V)
    if pool == "none":
        call["initial_state"] = randn(N, *inner)
        call["output_final_state"] = True
        return call
    width = 1 if pool == "slots" else max(lengths) + 1
    slots = N * width + 3
    table = torch.randperm(slots, generator=gen)[: N * width].reshape(N, width)
    if pool == "tokens":
        accepted = torch.randint(1, width + 1, (N,), generator=gen)
        call["num_accepted_tokens"] = accepted
        drop = torch.rand(N, width, generator=gen) < 0.3
        drop[torch.arange(N), accepted - 1] = False
        # one token's state is always written somewhere: with every written slot dropped (about 1% of draws),
        # a test of the pool would check nothing
        writer = next((n for n, length in enumerate(lengths) if length > 0 and n != padding), None)
        if writer is not None:
            drop[writer, 0] = False
        table = torch.where(drop, -1, table)
    if padding is not None:
        table[padding] = -1
    call["ssm_state_indices"] = table if pool == "tokens" else table[:, 0].clone()
    state = randn(slots, *inner).to(pool_dtype)
    used = table[table >= 0]
    unused = torch.ones(slots, dtype=torch.bool)
    unused[used] = False
    state[unused.nonzero()[::2, 0]] = float("nan")
    call["initial_state"] = state
    call["inplace_final_state"] = inplace
    return call
