"""A NaN in one input at one token: what the recurrence lets it reach, checked for any backend.

The recurrence reads token t's inputs at step t only, so a NaN there can reach outputs at t and later of
its own sequence and value head, never earlier tokens, other sequences or other heads. A chunked kernel
multiplies the structural zeros of its triangular in-chunk matrices by every row of the chunk, and
``0 * NaN = NaN``: that would turn the chunk's earlier rows NaN too. `check_nan_stays_causal` runs one call
clean and once with a NaN in one element of ``q``, ``k``, ``v``, ``g`` or ``beta`` of sequence 0, value
head 0, at a token inside the second chunk (not at its start), and asserts:

- every output before that token (before ``leak_from``: the token, or the start of its chunk for a backend
  whose in-chunk products are not kept causal, see docs/design.md) is finite and matches the float64
  reference (the recurrence's rows before it are those of the clean call);
- the other value head and the other sequence (outputs and final state) equal the clean call's, bitwise;
- every element that the reference makes non-finite is non-finite here too (NaN where the recurrence
  reaches it, never finite garbage); with the NaN in ``q`` (which never enters the state) that is only the
  token's own row, and every later output stays finite and right.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F

from kda.reference import kda_reference
from kda.verify.check import relative_error, tolerance

INPUTS = ("q", "k", "v", "g", "beta")

Run = Callable[[dict[str, Any]], tuple[torch.Tensor, torch.Tensor]]


def two_sequence_call(
    *, chunk: int, dtype: torch.dtype, strong_decay: bool, l2: bool, K: int = 16, V: int = 16
) -> tuple[dict[str, Any], int]:
    """A varlen call of two sequences (``2 * chunk + 9`` and ``chunk + 5`` tokens), two value heads (MHA),
    pre-gated, from the global (seeded) RNG; and the token to poison (inside sequence 0's second chunk).
    ``strong_decay``: log decays of -5 to -9 a token, so that a 16-row block's decay span passes 80 (the
    triton kernels' element-by-element diagonal path)."""
    lengths = (2 * chunk + 9, chunk + 5)
    T, H = sum(lengths), 2
    q, k = torch.randn(1, T, H, K), torch.randn(1, T, H, K)
    if not l2:
        q, k = F.normalize(q, dim=-1), F.normalize(k, dim=-1)
    if strong_decay:
        g = -(torch.rand(1, T, H, K) * 4 + 5)
    else:
        g = F.logsigmoid(torch.randn(1, T, H, K) * 1.5 + 1)
    call = {
        "q": q.to(dtype),
        "k": k.to(dtype),
        "v": torch.randn(1, T, H, V).to(dtype),
        "g": g.to(dtype),
        "beta": (torch.rand(1, T, H) * 0.9 + 0.05).to(dtype),
        "initial_state": torch.randn(2, H, K, V) * 0.5,
        "output_final_state": True,
        "use_qk_l2norm_in_kernel": l2,
        "cu_seqlens": torch.tensor([0, lengths[0], T], dtype=torch.int32),
        "chunk_size": chunk,
    }
    token = chunk + 1 + int(torch.randint(0, chunk - 1, ()))  # in chunk 1 of sequence 0, never its first row
    return call, token


def with_nan(call: dict[str, Any], name: str, token: int) -> tuple[dict[str, Any], int | None]:
    """A copy of ``call`` with one element of ``name`` at ``token``, head 0, set to NaN (a random channel
    for ``q``, ``k``, ``v``, ``g``); the caller's tensors are not touched. Returns the channel too."""
    poisoned = call[name].clone()
    channel = None
    if name == "beta":
        poisoned[0, token, 0] = float("nan")
    else:
        channel = int(torch.randint(0, poisoned.shape[-1], ()))
        poisoned[0, token, 0, channel] = float("nan")
    return {**call, name: poisoned}, channel


def reference_of(call: dict[str, Any]) -> tuple[torch.Tensor, torch.Tensor]:
    ref = {
        n: (t.double() if isinstance(t, torch.Tensor) and t.is_floating_point() else t)
        for n, t in call.items()
        if n != "chunk_size"
    }
    o, state = kda_reference(**ref)
    assert state is not None
    return o, state


def check_nan_stays_causal(
    run: Run, call: dict[str, Any], name: str, token: int, *, bitwise_before: bool, leak_from: int | None = None
) -> None:
    """The assertions of the module docstring, for `run` (a backend's call) on `call` with a NaN in `name`.
    ``bitwise_before``: the outputs before ``leak_from`` (default: the token) must also equal the clean call's
    bit for bit."""
    leak_from = token if leak_from is None else leak_from
    dtype_name = str(call["q"].dtype).removeprefix("torch.")
    tol = tolerance("o", dtype_name)
    bounds = call["cu_seqlens"].tolist()
    o_clean, s_clean = run(call)
    bad, channel = with_nan(call, name, token)
    o, s = run(bad)
    o_ref, s_ref = reference_of(bad)
    where = f"NaN in {name}[0, {token}, 0{'' if channel is None else f', {channel}'}]"

    # the reference: the token's row is NaN, nothing before it is
    assert torch.isnan(o_ref[0, token, 0]).any() and torch.isfinite(o_ref[0, :token]).all()

    before = o[0, :leak_from]
    assert torch.isfinite(before).all(), (
        f"{where}: outputs before token {leak_from} are non-finite at tokens "
        f"{sorted(set((~torch.isfinite(before)).nonzero()[:, 0].tolist()))}"
    )
    assert relative_error(before, o_ref[0, :leak_from]) <= tol, where
    if bitwise_before:
        assert torch.equal(before, o_clean[0, :leak_from]), where

    # the other value head, the other sequence and its final state: exactly as without the NaN
    assert torch.equal(o[0, :, 1], o_clean[0, :, 1]), f"{where}: value head 1 changed"
    assert torch.equal(o[0, bounds[1] :], o_clean[0, bounds[1] :]), f"{where}: sequence 1 changed"
    assert torch.equal(s[1], s_clean[1]) and torch.equal(s[0, 1], s_clean[0, 1]), f"{where}: a final state changed"

    # NaN wherever the recurrence takes it
    for label, got, ref in (("o", o, o_ref), ("final_state", s, s_ref)):
        reached = ~torch.isfinite(ref)
        assert (~torch.isfinite(got))[reached].all(), f"{where}: finite {label} where the recurrence has NaN"
    if name == "q":  # q never enters the state: every other output is finite and right
        rest = torch.ones(o.shape[1], dtype=torch.bool)
        rest[token] = False
        assert torch.isfinite(o[0, rest]).all() and torch.isfinite(s).all(), where
        assert relative_error(o[0, rest], o_ref[0, rest]) <= tol, where
    else:  # k, v, g and beta enter the state: every later row of sequence 0's head 0 is reached
        assert (~torch.isfinite(o_ref[0, token : bounds[1], 0])).any(-1).all(), where
