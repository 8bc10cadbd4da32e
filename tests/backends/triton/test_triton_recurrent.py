"""The decode kernel (`kda.backends.triton.recurrent`) in Triton's CPU interpreter, against a float64 token loop.

The loop below is written here, token by token, with the transforms of `kda.reference` (which applies no
log-decay floor: exp(-inf) = 0 there): it is the contract of `recurrent_forward` spelled out, state pools
and padding included. Every call gets NaN-filled outputs, and pool slots the call must not read are NaN
too, so an unwritten output or a read of the wrong slot fails; slots it must not write are compared bit for
bit. Tolerances are the policy's (`kda.verify.policy.tolerance`). Shapes are tiny (the interpreter runs
each program in numpy): N <= 5, heads 1-4, K and V 16..80, T <= 8, plus one case at K = V = 256.
"""

from __future__ import annotations

import importlib
import itertools
import json
import math
import os
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import torch

from kda.errors import KDAInputError
from kda.reference import beta_transform, l2norm, log_decay
from kda.verify.policy import tolerance

triton = pytest.importorskip("triton")


@pytest.fixture
def recurrent(monkeypatch):
    """The kernel module, its kernel an interpreted function (conftest.py switched the interpreter on before
    Triton was imported; a module imported while it was off is rebuilt)."""
    if torch.cuda.is_available():
        pytest.skip("these tiny interpreter cases are for the CPU")
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    from triton.runtime.interpreter import InterpretedFunction

    from kda.backends.triton import gate, recurrent, storage

    if not isinstance(recurrent.recurrent_kernel, InterpretedFunction):
        for module in (storage, gate, recurrent):
            importlib.reload(module)
    assert isinstance(recurrent.recurrent_kernel, InterpretedFunction)
    return recurrent


# ----------------------------------------------------------------------------------------------------------
# Inputs


@dataclass
class Case:
    """One call's sizes and options (the inputs are drawn by `make_call`)."""

    lengths: tuple[int, ...] = (5, 5)  # tokens per sequence
    varlen: bool = False
    H: int = 1
    group: int = 1  # HV // H
    K: int = 32
    V: int = 48
    dtype: torch.dtype = torch.float32  # q, k, v, beta (g stays fp32 half of the time: any float dtypes)
    gate: str = "pregated"  # "pregated", "softplus", "safe"
    lower_bound: float | None = None
    with_A_log: bool = True
    with_dt_bias: bool = True
    dt_bias_2d: bool = False
    l2: bool = True
    beta: str = "sigmoid"  # "given", "sigmoid", "sigmoid2"
    v_first: bool = False
    extreme: bool = False  # gates at and past the floor, -inf, saturated activations
    initial: bool = True
    final: bool = True
    pool: str | None = None  # None, "one" (1-D indices), "per_token" (2-D indices)
    pool_dtype: torch.dtype = torch.float32
    accepted: bool = True  # 2-D indices: pass num_accepted_tokens
    padding: tuple[int, ...] = ()  # sequences whose start slot is negative
    bad_accepted: tuple[int, ...] = ()  # 2-D indices: sequences whose accepted count is 0 or past T_max (padding)


def _gates(case: Case, shape: tuple[int, ...]) -> torch.Tensor:
    if case.gate == "pregated":
        g = torch.nn.functional.logsigmoid(torch.randn(shape) * 2 + 2)  # realistic decays, -0.02 .. -5
        if case.extreme:
            pick = torch.rand(shape)
            g = torch.where(pick < 0.1, torch.full(shape, -math.inf), g)
            g = torch.where((pick >= 0.1) & (pick < 0.2), torch.full(shape, -1e30), g)
            g = torch.where((pick >= 0.2) & (pick < 0.3), -32.0 - 20 * torch.rand(shape), g)  # past the floor
            g = torch.where((pick >= 0.3) & (pick < 0.4), -31.0 - torch.rand(shape), g)  # just above it
            g = torch.where((pick >= 0.4) & (pick < 0.5), torch.zeros(shape), g)  # no decay
        return g
    x = torch.randn(shape)
    return x * 30 if case.extreme else x  # saturates softplus / sigmoid both ways


GUARD_SLOTS = 8  # more than the most negative slot `make_call` writes into indices (-7)


def make_call(case: Case, seed: int) -> dict[str, Any]:
    """The keyword arguments of `recurrent_forward` for `case`, on CPU, outputs NaN-filled; with a pool, also
    ``guard``: the NaN slots just before it in memory (take it out before the call)."""
    torch.manual_seed(seed)
    H, HV, K, V = case.H, case.H * case.group, case.K, case.V
    N = len(case.lengths)
    if case.varlen:
        B, T = 1, sum(case.lengths)
    else:
        assert len(set(case.lengths)) == 1
        B, T = N, case.lengths[0]
    q = torch.randn(B, T, H, K)
    k = torch.randn(B, T, H, K)
    if not case.l2:
        q, k = q / math.sqrt(K), torch.nn.functional.normalize(k, dim=-1)  # a stable delta rule without l2norm
    v = torch.randn(B, T, HV, V)
    g = _gates(case, (B, T, HV, K))
    beta = torch.randn(B, T, HV) if case.beta != "given" else torch.rand(B, T, HV) * 0.9 + 0.05
    dtype = case.dtype
    call: dict[str, Any] = dict(
        q=q.to(dtype),
        k=k.to(dtype),
        v=v.to(dtype),
        g=g if seed % 2 else g.to(dtype),  # fp32 or the inputs' dtype
        beta=beta.to(dtype),
        scale=K**-0.5,
        use_gate_in_kernel=case.gate != "pregated",
        lower_bound=case.lower_bound if case.gate == "safe" else None,
        use_qk_l2norm_in_kernel=case.l2,
        use_beta_sigmoid_in_kernel=case.beta != "given",
        allow_neg_eigval=case.beta == "sigmoid2",
        state_v_first=case.v_first,
        out=torch.full((B, T, HV, V), math.nan, dtype=dtype),
    )
    if case.gate != "pregated":
        if case.with_A_log:
            A_log = torch.randn(HV) * (2.0 if case.extreme else 0.5)
            call["A_log"] = A_log.reshape(1, 1, HV, 1).to(torch.bfloat16 if seed % 3 == 0 else torch.float32)
        if case.with_dt_bias:
            dt_bias = torch.randn(HV, K) * (10.0 if case.extreme else 1.0)
            call["dt_bias"] = dt_bias if case.dt_bias_2d else dt_bias.reshape(-1)
    if case.varlen:
        call["cu_seqlens"] = torch.tensor([0, *torch.tensor(case.lengths).cumsum(0).tolist()], dtype=torch.int32)
    per_head = (V, K) if case.v_first else (K, V)
    if case.pool is None:
        if case.initial:
            call["initial_state"] = torch.randn(N, HV, *per_head)
        if case.final:
            call["final_state"] = torch.full((N, HV, *per_head), math.nan)
        return call

    # A pool with spare slots, the sequences' slots a random permutation; slots no sequence reads are NaN.
    T_max = max(case.lengths) if case.pool == "per_token" else 1
    slots = 3 * N * T_max + 2
    order = torch.randperm(slots)
    # The pool is a view past GUARD_SLOTS NaN slots of its buffer, where a negative slot's read or write would land.
    buffer = torch.full((GUARD_SLOTS + slots, HV, *per_head), math.nan).to(case.pool_dtype)
    pool = buffer[GUARD_SLOTS:]
    call["guard"] = buffer[:GUARD_SLOTS]
    if case.pool == "one":
        indices = order[:N].to(torch.int64 if seed % 2 else torch.int32)
        for n in case.padding:
            indices[n] = -1 - n  # any negative value
        for n in range(N):
            if indices[n] >= 0:
                pool[indices[n]] = torch.randn(HV, *per_head).to(case.pool_dtype)
    else:
        indices = order[: N * T_max].reshape(N, T_max).to(torch.int32 if seed % 2 else torch.int64)
        accepted = torch.randint(1, T_max + 1, (N,))
        column = accepted - 1 if case.accepted else torch.zeros(N, dtype=torch.int64)
        for n in range(N):
            if n in case.padding:
                indices[n, column[n]] = -1
            elif case.lengths[n] > 2:
                later = case.lengths[n] - 2 if case.lengths[n] - 2 != column[n] else case.lengths[n] - 1
                indices[n, later] = -7  # a token whose state is not kept
            if indices[n, column[n]] >= 0:
                pool[indices[n, column[n]]] = torch.randn(HV, *per_head).to(case.pool_dtype)
        for i, n in enumerate(case.bad_accepted):
            accepted[n] = 0 if i % 2 == 0 else T_max + 1
        if case.accepted:
            call["num_accepted_tokens"] = accepted.to(torch.int32)
    call["ssm_state_indices"] = indices
    for n in (*case.padding, *case.bad_accepted):  # a padding sequence's tokens are NaN: it must read none
        b, start, end = _sequence_rows(call)[n]
        for name in ("q", "k", "v", "g", "beta"):
            call[name][b, start:end] = math.nan
    if case.initial:
        call["initial_state"] = pool
    if case.final:
        call["final_state"] = pool  # updated in place
    return call


# ----------------------------------------------------------------------------------------------------------
# The float64 token loop


def expected(call: dict[str, Any]) -> tuple[torch.Tensor, torch.Tensor | None]:
    """``out`` and ``final_state`` as the contract says they are after the call, in float64 (a pool's slots
    that no write reaches keep their values, NaN included)."""
    f64 = torch.float64
    q, k, v, g, beta = (call[name].to(f64) for name in ("q", "k", "v", "g", "beta"))
    B, T, H, K = q.shape
    HV, V = v.shape[2], v.shape[3]
    group = HV // H
    if call["use_qk_l2norm_in_kernel"]:
        q, k = l2norm(q), l2norm(k)
    q = q * call["scale"]
    A_log, dt_bias = call.get("A_log"), call.get("dt_bias")
    g = log_decay(
        g,
        use_gate_in_kernel=call["use_gate_in_kernel"],
        A_log=None if A_log is None else A_log.to(f64).reshape(-1),
        dt_bias=None if dt_bias is None else dt_bias.to(f64),
        lower_bound=call["lower_bound"],
    )
    beta = beta_transform(beta, sigmoid=call["use_beta_sigmoid_in_kernel"], allow_neg_eigval=call["allow_neg_eigval"])
    v_first = call["state_v_first"]

    def as_kv(state: torch.Tensor) -> torch.Tensor:  # [HV, K, V]
        state = state.to(f64)
        return state.transpose(-1, -2) if v_first else state

    def as_stored(S: torch.Tensor) -> torch.Tensor:
        return S.transpose(-1, -2) if v_first else S

    initial, final, indices = call.get("initial_state"), call.get("final_state"), call.get("ssm_state_indices")
    o = torch.zeros(B, T, HV, V, dtype=f64)
    out_state = None if final is None else final.to(f64).clone()
    for n, (b, start, end) in enumerate(_sequence_rows(call)):
        slot = _start_slot(call, n)
        if slot < 0:
            continue  # padding: outputs 0, no state read or written
        S = as_kv(initial[slot]) if initial is not None else torch.zeros(HV, K, V, dtype=f64)
        for t in range(start, end):
            q_t = q[b, t].repeat_interleave(group, 0)  # [HV, K]
            k_t = k[b, t].repeat_interleave(group, 0)
            S = S * g[b, t].exp()[..., None]
            delta = beta[b, t, :, None] * (v[b, t] - torch.einsum("hkv,hk->hv", S, k_t))
            S = S + k_t[..., None] * delta[:, None, :]
            o[b, t] = torch.einsum("hkv,hk->hv", S, q_t)
            if out_state is not None and indices is not None and indices.dim() == 2:
                written = int(indices[n, t - start])
                if written >= 0:
                    out_state[written] = as_stored(S)
        if out_state is not None and (indices is None or (indices.dim() == 1 and end > start)):
            out_state[slot] = as_stored(S)
    return o, out_state


# ----------------------------------------------------------------------------------------------------------
# Checks


def _dtype_name(*dtypes: torch.dtype) -> str:
    return "float32" if all(d == torch.float32 for d in dtypes) else "bfloat16"


def assert_close(name: str, got: torch.Tensor, want: torch.Tensor, dtype: str) -> None:
    """Finite everywhere and within the policy's relative L2 tolerance."""
    assert torch.isfinite(got).all(), f"{name}: non-finite values ({(~torch.isfinite(got)).sum()} of {got.numel()})"
    if want.numel() == 0:
        return
    got, want = got.to(torch.float64), want.to(torch.float64)
    error = (torch.linalg.vector_norm(got - want) / torch.linalg.vector_norm(want)).item()
    limit = tolerance("o" if name == "o" else "final_state", dtype)
    assert error <= limit, f"{name}: relative L2 error {error:.3e} > {limit:.1e}"


def run_and_check(recurrent, call: dict[str, Any]) -> None:
    """Run the kernel on `call` and check everything it wrote (and everything it must not have)."""
    guard = call.pop("guard", None)
    guard_before = None if guard is None else guard.clone()
    pool_before = call["final_state"].clone() if call.get("final_state") is not None else None
    inputs_before = {name: call[name].clone() for name in ("q", "k", "v", "g", "beta")}
    want_o, want_state = expected(call)
    assert recurrent.recurrent_forward(**call) is None
    if guard is not None:
        assert _bits(guard).equal(_bits(guard_before)), "a negative slot was written"
    dtype = _dtype_name(call["q"].dtype)
    assert_close("o", call["out"], want_o, dtype)
    for name, before in inputs_before.items():
        assert torch.equal(call[name].view(torch.uint8), before.view(torch.uint8)), f"{name} was modified"
    indices = call.get("ssm_state_indices")
    padded = _padding_rows(call)
    out = call["out"]
    for b, t0, t1 in padded:
        assert (out[b, t0:t1] == 0).all(), "a padding sequence's outputs must be exactly 0"
    final = call.get("final_state")
    if final is None:
        return
    assert want_state is not None and pool_before is not None
    if indices is None:
        assert_close("final_state", final, want_state, _dtype_name(call["q"].dtype, final.dtype))
        return
    written = _written_slots(call)
    untouched = torch.ones(final.shape[0], dtype=torch.bool)
    untouched[written] = False
    assert _bits(final[untouched]).equal(_bits(pool_before[untouched])), "a slot no write reaches has changed"
    if written:
        assert_close("final_state", final[written], want_state[written], _dtype_name(call["q"].dtype, final.dtype))


def _bits(x: torch.Tensor) -> torch.Tensor:
    return x.view(torch.int16 if x.element_size() == 2 else torch.int32)


def _sequence_rows(call: dict[str, Any]) -> list[tuple[int, int, int]]:
    """(batch row, first token, end) of each sequence."""
    cu = call.get("cu_seqlens")
    if cu is not None:
        return [(0, int(a), int(b)) for a, b in itertools.pairwise(cu.tolist())]
    B, T = call["q"].shape[:2]
    return [(b, 0, T) for b in range(B)]


def _start_slot(call: dict[str, Any], n: int) -> int:
    indices, accepted = call.get("ssm_state_indices"), call.get("num_accepted_tokens")
    if indices is None:
        return n
    if indices.dim() == 1:
        return int(indices[n])
    column = int(accepted[n]) - 1 if accepted is not None else 0
    return int(indices[n, column]) if 0 <= column < indices.shape[1] else -1  # outside: padding


def _padding_rows(call: dict[str, Any]) -> list[tuple[int, int, int]]:
    return [rows for n, rows in enumerate(_sequence_rows(call)) if _start_slot(call, n) < 0]


def _written_slots(call: dict[str, Any]) -> list[int]:
    """The pool slots the call must write (non-padding sequences' end slots, or each token's slot)."""
    indices = call["ssm_state_indices"]
    slots: list[int] = []
    for n, (_, start, end) in enumerate(_sequence_rows(call)):
        if _start_slot(call, n) < 0 or end == start:
            continue
        if indices.dim() == 1:
            slots.append(int(indices[n]))
        else:
            slots += [int(s) for s in indices[n, : end - start] if s >= 0]
    return slots


# ----------------------------------------------------------------------------------------------------------
# Tests

DENSE_AND_VARLEN = {
    "pregated-plain": Case(l2=False, beta="given"),
    "softplus-gva-vfirst-varlen": Case(
        gate="softplus", varlen=True, lengths=(3, 0, 1, 6), H=2, group=2, K=16, V=80, v_first=True
    ),
    "safe5-sigmoid2-gva-bf16": Case(gate="safe", lower_bound=-5.0, beta="sigmoid2", group=3, dtype=torch.bfloat16),
    "safe-near0-noAlog-dt2d-varlen-bf16": Case(
        gate="safe",
        lower_bound=-0.1,
        with_A_log=False,
        dt_bias_2d=True,
        varlen=True,
        lengths=(7, 2, 0),
        v_first=True,
        dtype=torch.bfloat16,
        initial=False,
    ),
    "softplus-nobias-fp16-no-final": Case(
        gate="softplus", with_dt_bias=False, dtype=torch.float16, final=False, lengths=(4, 4, 4)
    ),
    "pregated-extreme-varlen": Case(extreme=True, varlen=True, lengths=(8, 1, 0, 5), H=2, l2=False),
    "softplus-extreme-vfirst": Case(gate="softplus", extreme=True, v_first=True, group=2, lengths=(6,)),
    "safe-extreme-varlen-bf16": Case(
        gate="safe", lower_bound=-5.0, extreme=True, varlen=True, lengths=(2, 6), dtype=torch.bfloat16
    ),
    "odd-dims": Case(K=24, V=40, lengths=(3, 3), beta="given"),
}


@pytest.mark.parametrize("repeat", range(2))
@pytest.mark.parametrize("name", DENSE_AND_VARLEN)
def test_matches_float64_loop(recurrent, seed, name, repeat):
    run_and_check(recurrent, make_call(DENSE_AND_VARLEN[name], seed + 1000 * repeat))


POOLS = {
    "one-fp32": Case(pool="one", lengths=(1, 1, 1, 1, 1), padding=(2,), group=2),
    "one-bf16-vfirst": Case(pool="one", pool_dtype=torch.bfloat16, v_first=True, lengths=(1, 1, 1), padding=(0,)),
    "one-bf16-varlen-empty": Case(
        pool="one",
        pool_dtype=torch.bfloat16,
        varlen=True,
        lengths=(2, 0, 1, 3),
        padding=(3,),
        gate="safe",
        lower_bound=-5.0,
        dtype=torch.bfloat16,
    ),
    "one-fp16-pool-softplus": Case(pool="one", pool_dtype=torch.float16, gate="softplus", lengths=(2, 2)),
    "per-token-fp32": Case(pool="per_token", lengths=(4, 4, 4), padding=(1,), group=2),
    "per-token-bf16-varlen": Case(
        pool="per_token",
        pool_dtype=torch.bfloat16,
        varlen=True,
        lengths=(3, 1, 0, 4),
        padding=(1,),
        v_first=True,
        dtype=torch.bfloat16,
    ),
    "per-token-bad-accepted": Case(pool="per_token", lengths=(2, 3, 1), varlen=True, bad_accepted=(0, 2)),
    "per-token-column0": Case(pool="per_token", accepted=False, lengths=(3, 3), gate="softplus"),
    "per-token-no-read": Case(pool="per_token", initial=False, lengths=(2, 2)),
}


@pytest.mark.parametrize("repeat", range(2))
@pytest.mark.parametrize("name", POOLS)
def test_state_pool(recurrent, seed, name, repeat):
    run_and_check(recurrent, make_call(POOLS[name], seed + 1000 * repeat))


def test_empty_sequences_pass_the_start_state_on(recurrent, seed):
    call = make_call(Case(varlen=True, lengths=(0, 3, 0)), seed)
    start = call["initial_state"].clone()
    run_and_check(recurrent, call)
    assert torch.equal(call["final_state"][[0, 2]], start[[0, 2]])
    without = make_call(Case(varlen=True, lengths=(0, 2), initial=False), seed)
    run_and_check(recurrent, without)
    assert (without["final_state"][0] == 0).all()


def test_no_tokens_at_all(recurrent, seed):
    call = make_call(Case(lengths=(0, 0)), seed)
    run_and_check(recurrent, call)
    assert torch.equal(call["final_state"], call["initial_state"])


@pytest.mark.parametrize("pool_dtype", [torch.float32, torch.bfloat16])
def test_pool_slot_of_an_empty_sequence_is_not_touched(recurrent, seed, pool_dtype):
    """Read from one pool, written to another: a write of the start state back would show."""
    call = make_call(Case(pool="one", pool_dtype=pool_dtype, varlen=True, lengths=(0, 2, 0)), seed)
    call["initial_state"] = call["final_state"].clone()
    for n in (0, 2):
        call["final_state"][call["ssm_state_indices"][n]] = 7.0
    run_and_check(recurrent, call)
    assert (call["final_state"][call["ssm_state_indices"][[0, 2]]] == 7.0).all()


@pytest.mark.parametrize("g", [-math.inf, -1e30, -40.0, -32.0])
def test_log_decay_is_floored(recurrent, seed, g):
    """A log decay at or below -32 (`kda.reference.LOG_DECAY_FLOOR`) decays by exactly exp(-32), as the chunked
    kernels do: with beta = 0 one token leaves ``exp(-32) S_0``."""
    call = make_call(Case(lengths=(1,), l2=False, beta="given", v_first=g == -40.0), seed)
    call["g"].fill_(g)
    call["beta"].zero_()
    start = call["initial_state"].clone()
    recurrent.recurrent_forward(**call)
    torch.testing.assert_close(call["final_state"], start * math.exp(-32.0), rtol=1e-5, atol=0.0)


def test_log_decay_of_minus_inf_resets_the_state(recurrent, seed):
    """A token with log decay -inf (every K column) forgets the state before it: the output from there on is
    the one a zero start state gives, to fp32's resolution."""
    call = make_call(Case(lengths=(4,), l2=False, beta="given"), seed)
    call["g"][:, 1] = -math.inf
    other = {**call, "initial_state": call["initial_state"] * 1000, "out": call["out"].clone()}
    other["final_state"] = call["final_state"].clone()
    run_and_check(recurrent, call)
    recurrent.recurrent_forward(**other)
    assert torch.allclose(call["out"][:, 1:], other["out"][:, 1:], rtol=1e-5, atol=1e-6)
    assert torch.isfinite(other["out"]).all()


@pytest.mark.parametrize(("K", "V"), [(256, 256), (128, 64), (64, 256)])
def test_large_head_dims(recurrent, seed, K, V):
    run_and_check(recurrent, make_call(Case(K=K, V=V, lengths=(2,), gate="softplus", v_first=K == 128), seed))


def test_launch_configs_bound_registers(recurrent):
    for K in (16, 32, 64, 100, 128, 200, 256):
        for V in (16, 48, 64, 128, 256):
            config = recurrent.recurrent_config(K, V)
            BK = triton.next_power_of_2(K)
            assert config.block_v <= max(16, triton.next_power_of_2(V))
            assert BK * config.block_v // (32 * config.num_warps) <= 32, (K, V, config)
            if V >= 32:
                assert config.block_v == 32  # a whole 128-byte line of an fp32 state row
    assert recurrent.recurrent_config(128, 128) == recurrent.RecurrentConfig(block_v=32, num_warps=4)
    assert recurrent.recurrent_config(256, 256) == recurrent.RecurrentConfig(block_v=32, num_warps=8)


def test_sm90_takes_the_measured_launch_per_state_dtype(recurrent):
    """On sm90 the launch comes from the table measured on the H200 (`configs._DECODE_TABLE`), per state element
    size, at head dims padded to 128; elsewhere (other architectures, other head dims) from the rule."""
    from kda.backends.triton import configs

    config = recurrent.recurrent_config
    assert config(128, 128, 4, 9) == recurrent.RecurrentConfig(block_v=64, num_warps=4)
    assert config(128, 128, 2, 9) == recurrent.RecurrentConfig(block_v=32, num_warps=2)
    assert config(128, 16, 4, 9).block_v == 16  # never wider than the padded V
    assert config(64, 64, 4, 9) == config(64, 64)  # head dims it was not measured at: the rule
    assert config(256, 256, 4, 9) == config(256, 256) == recurrent.RecurrentConfig(block_v=32, num_warps=8)
    assert config(128, 128, 4, 8) == config(128, 128, 4, None) == recurrent.RecurrentConfig(block_v=32, num_warps=4)
    for entry in configs._DECODE_TABLE[9].values():  # within the sweep's bound: at most 64 fp32 values a thread
        assert 128 * entry.block_v // (32 * entry.num_warps) <= 64


def test_an_experiment_override_applies_and_is_exact(recurrent, seed, monkeypatch):
    """`benchmarks/decode_sweep.py` times candidates through `configs.DECODE_OVERRIDE`: it takes precedence, and
    another launch computes the same function (here 8 value columns at 1 warp against the reference)."""
    from kda.backends.triton import configs

    monkeypatch.setitem(configs.DECODE_OVERRIDE, 4, configs.DecodeLaunch(block_v=8, num_warps=1))
    assert recurrent.recurrent_config(128, 128, 4, None) == recurrent.RecurrentConfig(block_v=8, num_warps=1)
    run_and_check(recurrent, make_call(Case(K=12, V=20, lengths=(3, 0, 2), varlen=True), seed))


def test_rejects_what_it_cannot_serve(recurrent, seed):
    call = make_call(Case(lengths=(2,)), seed)
    with pytest.raises(KDAInputError, match="num_accepted_tokens"):
        recurrent.recurrent_forward(**{**call, "num_accepted_tokens": torch.ones(1, dtype=torch.int32)})
    with pytest.raises(KDAInputError, match="`q`"):
        recurrent.recurrent_forward(**{**call, "q": torch.cat([call["q"], call["q"]], -1)[..., :32]})
    with pytest.raises(KDAInputError, match="`out`"):
        recurrent.recurrent_forward(**{**call, "out": call["out"].to(torch.float64)})
    with pytest.raises(KDAInputError, match="`initial_state`"):
        recurrent.recurrent_forward(**{**call, "initial_state": call["initial_state"].transpose(-1, -2)})
    assert torch.isnan(call["out"]).all()  # nothing ran


# Compiles the kernel for sm90 with Triton's real compiler (ptxas included) in a fresh process (the tests here
# keep Triton in interpreter mode) and prints one JSON line: registers and spill bytes per configuration.
_COMPILE = """
import json, triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource, compile
from kda.backends.triton.aot import _registers
from kda.backends.triton.recurrent import ONE_SLOT, SLOT_PER_TOKEN, recurrent_config, recurrent_kernel

found = {}
for K, state, mode, v_first in [(64, "*fp32", ONE_SLOT, False), (128, "*bf16", SLOT_PER_TOKEN, True),
                                (128, "*fp32", ONE_SLOT, False), (256, "*fp32", ONE_SLOT, True),
                                (256, "*bf16", SLOT_PER_TOKEN, False)]:
    config = recurrent_config(K, K, 4 if state == "*fp32" else 2, 9)  # sm90's table where it has an entry
    pointers = ["q", "k", "v", "g", "beta", "o", "A_log", "dt_bias", "h0", "ht", "cu_seqlens", "indices", "num_accepted"]
    types = ["*bf16"] * 6 + ["*fp32", "*fp32", state, state] + ["*i32"] * 3
    signature = dict(zip(pointers, types))
    signature.update(scale="fp32", lower_bound="fp32", T="i32", T_MAX="i32", stride_h0="i64", stride_ht="i64",
                     stride_idx_n="i32", stride_idx_t="i32")
    constants = dict(H=16, HV=32, K=K, V=K, BK=K, BV=config.block_v, GATE=1, HAS_A_LOG=True, HAS_DT_BIAS=True,
                     L2=True, SIGMOID=True, TWO=False, V_FIRST=v_first, HAS_H0=True, HAS_HT=True, VARLEN=True,
                     INDICES=mode, HAS_ACCEPTED=mode == SLOT_PER_TOKEN, ROUND=False)
    source = ASTSource(fn=recurrent_kernel, signature={**signature, **dict.fromkeys(constants, "constexpr")},
                       constexprs=constants)
    kernel = compile(source, target=GPUTarget("cuda", 90, 32), options={"num_warps": config.num_warps})
    found[f"{K}-{state}-{mode}-{v_first}"] = _registers(kernel.asm["cubin"])
print(json.dumps(found))
"""


@pytest.mark.slow
def test_compiles_for_sm90_without_spills():
    env = {key: value for key, value in os.environ.items() if key != "TRITON_INTERPRET"}
    env["PYTHONPATH"] = os.pathsep.join([str(Path(__file__).resolve().parents[3]), env.get("PYTHONPATH", "")])
    done = subprocess.run([sys.executable, "-c", _COMPILE], capture_output=True, text=True, env=env, timeout=1200)
    lines = [line for line in done.stdout.splitlines() if line.startswith("{")]
    if not lines and ("ptxas" in done.stderr or "No such file" in done.stderr):
        pytest.skip(f"Triton cannot compile for CUDA here: {done.stderr.strip().splitlines()[-1]}")
    assert lines, done.stderr[-2000:]
    found = json.loads(lines[-1])
    print(found)
    for name, usage in found.items():  # None where Triton ships no cuobjdump
        assert usage["spill_bytes"] in (None, 0), (name, usage)
        assert usage["registers"] is None or 0 < usage["registers"] <= 255, (name, usage)
