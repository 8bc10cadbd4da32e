"""Calls FLA 0.6's `chunk_kda` accepts, through `kda.chunk_kda`: each gives FLA's result (the float64
reference of FLA's semantics, docs/design.md "Where kda is stricter than FLA") or, where FLA would compute
something else than asked, a `KDAInputError` saying why."""

from __future__ import annotations

import warnings

import pytest
import torch

import kda
from kda.reference import kda_reference
from kda.verify.check import relative_error
from kda.verify.policy import tolerance


def _inputs(seed, B=1, T=45, H=2, HV=2, K=16, V=16, dtype=torch.float32):
    gen = torch.Generator().manual_seed(seed)

    def rand(*shape):
        return torch.randn(*shape, generator=gen)

    q = torch.nn.functional.normalize(rand(B, T, H, K), dim=-1).to(dtype)
    k = torch.nn.functional.normalize(rand(B, T, H, K), dim=-1).to(dtype)
    v = rand(B, T, HV, V).to(dtype)
    g = torch.nn.functional.logsigmoid(rand(B, T, HV, K) + 1.0).to(dtype)  # a log decay; a raw gate input too
    beta = torch.rand(B, T, HV, generator=gen).to(dtype)
    return dict(q=q, k=k, v=v, g=g, beta=beta)


def _close(got, ref, name="o", dtype="float32"):
    err = relative_error(got, ref)
    assert err <= tolerance(name, dtype), f"{name}: {err:.2e}"


@pytest.mark.parametrize("with_a_log", [False, True])
@pytest.mark.parametrize("lower_bound", [-1.0, -12.0])
def test_lower_bound_without_safe_gate_is_flas_sigmoid_gate(seed, with_a_log, lower_bound):
    x = _inputs(seed)
    extra = {"A_log": torch.rand(2) - 0.5} if with_a_log else {}
    call = dict(x, use_gate_in_kernel=True, lower_bound=lower_bound, dt_bias=torch.randn(2 * 16) * 0.3, **extra)
    with kda.trace_routes() as routes:
        o, _ = kda.chunk_kda(**call, backend="torch")
    assert routes[0].case_class.startswith("sigmoid/")
    ref, _ = kda_reference(**call)
    _close(o, ref)
    # the same numbers as the safe gate where the bound is in the safe range: one formula, FLA's
    if lower_bound >= -5:
        safe, _ = kda.chunk_kda(**call, safe_gate=True, backend="torch")
        torch.testing.assert_close(o, safe, rtol=0, atol=1e-6)
    else:  # and below it, a reference decay of lower_bound * sigmoid(...) (far below -5 per token)
        g = kda.reference.log_decay(
            call["g"].double(),
            use_gate_in_kernel=True,
            A_log=extra.get("A_log"),
            dt_bias=call["dt_bias"].double(),
            lower_bound=lower_bound,
        )
        assert g.min() < -5


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_a_log_as_models_store_it(seed, dtype):
    """transformers keeps A_log as [1, 1, HV, 1] and may cast it with the model: the same gate, computed
    in float32 from the values as given."""
    x = _inputs(seed, HV=4)
    A_log = (torch.rand(4) * 2 - 1).to(dtype)
    dt_bias = (torch.randn(4, 16) * 0.3).to(dtype)
    flat = kda.chunk_kda(**x, use_gate_in_kernel=True, A_log=A_log.float(), dt_bias=dt_bias.float(), backend="torch")
    stored = kda.chunk_kda(
        **x, use_gate_in_kernel=True, A_log=A_log.reshape(1, 1, 4, 1), dt_bias=dt_bias, backend="torch"
    )
    torch.testing.assert_close(stored[0], flat[0], rtol=0, atol=0)


def test_a_log_gradient_comes_back_in_its_shape_and_dtype(seed):
    x = _inputs(seed)
    A_log = torch.zeros(1, 1, 2, 1, dtype=torch.bfloat16, requires_grad=True)
    dt_bias = torch.zeros(2, 16, dtype=torch.bfloat16, requires_grad=True)
    o, _ = kda.chunk_kda(**x, use_gate_in_kernel=True, A_log=A_log, dt_bias=dt_bias, backend="torch")
    o.square().sum().backward()
    assert A_log.grad.shape == A_log.shape and A_log.grad.dtype == torch.bfloat16
    assert dt_bias.grad.shape == dt_bias.shape and A_log.grad.abs().sum() > 0


@pytest.mark.parametrize("v_dtype", [torch.float32, torch.float16])
def test_v_in_another_dtype(seed, v_dtype):
    x = _inputs(seed, dtype=torch.bfloat16)
    x["v"] = x["v"].to(v_dtype)
    before = x["v"].clone()
    o, _ = kda.chunk_kda(**x, backend="torch")
    assert o.dtype == v_dtype  # FLA's output is in v's dtype
    ref, _ = kda_reference(**x)
    _close(o, ref, dtype="bfloat16")
    assert torch.equal(x["v"], before)


def test_float64_through_the_public_call_is_exact_enough_for_gradcheck(seed):
    x = {n: t.double() for n, t in _inputs(seed, T=9, K=4, V=3, H=1, HV=1).items()}
    h0 = torch.randn(1, 1, 4, 3, dtype=torch.float64)
    leaves = [x["q"], x["k"], x["v"], x["g"], x["beta"], h0]
    for t in leaves:
        t.requires_grad_(True)

    def fn(q, k, v, g, beta, initial_state):
        o, s = kda.chunk_kda(
            q,
            k,
            v,
            g,
            beta,
            initial_state=initial_state,
            output_final_state=True,
            use_gate_in_kernel=True,
            lower_bound=-2.0,
            chunk_size=32,
        )
        return o, s

    with kda.trace_routes() as routes:
        o, s = fn(*leaves)
    assert o.dtype == torch.float64 and s.dtype == torch.float64
    assert {r.backend for r in routes} == {"torch"}  # auto: the only backend that takes float64
    assert torch.autograd.gradcheck(fn, tuple(leaves), eps=1e-6, atol=1e-7)


def test_head_first_false_is_accepted_and_true_is_refused(seed):
    x = _inputs(seed)
    o, _ = kda.chunk_kda(**x, head_first=False, backend="torch")
    torch.testing.assert_close(o, kda.chunk_kda(**x, backend="torch")[0], rtol=0, atol=0)
    with pytest.raises(kda.KDAInputError) as info:
        kda.chunk_kda(**x, head_first=True, backend="torch")
    assert info.value.argument == "head_first" and "time-major" in info.value.rule


def test_unknown_keywords_warn_once_naming_them(seed):
    x = _inputs(seed)
    with pytest.warns(UserWarning, match="an_option_of_tomorrow"):
        kda.chunk_kda(**x, an_option_of_tomorrow=3, backend="torch")
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        kda.chunk_kda(**x, an_option_of_tomorrow=3, backend="torch")  # once per set of names
    with pytest.raises(kda.KDAInputError):  # an argument kda implements but the value breaks a rule: raises
        kda.chunk_kda(**x, an_option_of_tomorrow=3, chunk_size=48, backend="torch")


@pytest.mark.parametrize("varlen", [False, True])
@pytest.mark.parametrize("state_v_first", [False, True])
def test_intermediate_states_are_the_states_entering_each_chunk(seed, varlen, state_v_first):
    x = _inputs(seed, B=1 if varlen else 2, T=77, K=16, V=8)
    call = dict(x, chunk_size=32, state_v_first=state_v_first, output_final_state=True)
    N = 3 if varlen else 2
    if varlen:
        call["cu_seqlens"] = torch.tensor([0, 33, 33, 77])
    shape = (N, 2, 8, 16) if state_v_first else (N, 2, 16, 8)
    call["initial_state"] = torch.randn(shape)
    with torch.no_grad():
        o, _, per_chunk = kda.chunk_kda(**call, return_intermediate_states=True, backend="torch")
    ref_o, _, ref_chunks = kda_reference(**call, return_intermediate_states=True)
    nt = (2 + 0 + 2) if varlen else 3
    assert per_chunk.shape[:2] == ((1, nt) if varlen else (2, nt)) and per_chunk.dtype == torch.float32
    _close(per_chunk, ref_chunks, "intermediate_states")
    _close(o, ref_o)
    # the first chunk of each sequence starts from its initial state
    first = per_chunk[0, 0] if varlen else per_chunk[:, 0]
    torch.testing.assert_close(first, call["initial_state"][0] if varlen else call["initial_state"])
    with pytest.raises(kda.KDAInputError, match="without gradients"):
        x["q"].requires_grad_(True)
        kda.chunk_kda(**call, return_intermediate_states=True, backend="torch")


def test_use_graph_is_accepted_where_the_backend_can_honour_it(seed):
    x = _inputs(seed, T=40)
    cu = torch.tensor([0, 17, 40, 40])  # padded with an empty sequence, as FLA's graph mode asks
    o, _ = kda.chunk_kda(**x, cu_seqlens=cu, use_graph=True, max_num_seqs=3, backend="torch")
    torch.testing.assert_close(o, kda.chunk_kda(**x, cu_seqlens=cu, backend="torch")[0], rtol=0, atol=0)


def test_cu_seqlens_cpu_alone_is_refused_with_what_fla_would_do(seed):
    with pytest.raises(kda.KDAInputError) as info:
        kda.chunk_kda(**_inputs(seed), cu_seqlens_cpu=torch.tensor([0, 20, 45]), backend="torch")
    assert info.value.argument == "cu_seqlens_cpu" and "dense" in info.value.rule
