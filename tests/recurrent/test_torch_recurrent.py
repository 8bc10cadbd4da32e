"""The torch backend's decode op against the float64 reference: ragged varlen (an empty sequence), GVA,
both layouts, fp32 and bf16 pools, per-token speculative indices, padding rows, `out=`, in-place semantics."""

from __future__ import annotations

import pytest
import torch

import kda
from kda.recurrent.reference import fused_recurrent_reference
from kda.verify import relative_error
from kda.verify.recurrent_policy import POOL_ROUNDING_TOLERANCE
from tests.recurrent.helpers import decode_call


def reference_of(call):
    return fused_recurrent_reference(**{n: v for n, v in call.items() if n != "out"})


@pytest.mark.parametrize("pool", ["slots", "tokens"])
@pytest.mark.parametrize("pool_dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("state_v_first", [False, True])
@pytest.mark.parametrize("varlen", [True, False])
def test_pool_in_place_matches_the_reference_and_leaves_other_slots_alone(
    seed, pool, pool_dtype, state_v_first, varlen
):
    lengths = (1, 3, 0, 2, 1) if varlen else (2, 2, 2)
    gate = ("sigmoid", "softplus", "pregated")[seed % 3]
    call = decode_call(
        lengths=lengths,
        varlen=varlen,
        pool=pool,
        pool_dtype=pool_dtype,
        state_v_first=state_v_first,
        gate=gate,
        seed=seed,
    )
    ref = reference_of(call)
    pool_before = call["initial_state"].clone()
    call["out"] = torch.full_like(call["v"], float("nan"))
    with kda.trace_routes() as routes:
        o, final = kda.fused_recurrent_kda(**call)
    assert [r.backend for r in routes] == ["torch"] and routes[0].case_class.startswith(f"recurrent/{gate}/")
    assert o is call["out"] and final is call["initial_state"]  # written in place, returned as given
    assert relative_error(o, ref.o) <= 1e-4
    written = sorted(set(ref.written))
    assert written, "the case must write something"
    floor = POOL_ROUNDING_TOLERANCE["bfloat16"] if pool_dtype == torch.bfloat16 else 1e-4
    assert relative_error(final[written], ref.exact_pool[written]) <= floor
    untouched = [s for s in range(final.shape[0]) if s not in written]
    assert torch.equal(final[untouched].isnan(), pool_before[untouched].isnan())
    same = ~pool_before[untouched].isnan()
    assert torch.equal(final[untouched][same], pool_before[untouched][same])  # bit for bit


def test_padding_rows_output_zero_and_touch_nothing(seed):
    call = decode_call(lengths=(2, 2, 2), varlen=False, pool="slots", padding=1, seed=seed)
    before = call["initial_state"].clone()
    call["out"] = torch.full_like(call["v"], float("nan"))
    o, pool = kda.fused_recurrent_kda(**call)
    assert (o[1] == 0).all() and torch.isfinite(o).all()
    slots = call["ssm_state_indices"]
    for n in (0, 2):
        assert not torch.equal(pool[slots[n]], before[slots[n]])


def test_a_read_only_pool_is_not_modified_and_output_final_state_is_new(seed):
    call = decode_call(pool="slots", inplace=False, pool_dtype=torch.bfloat16, seed=seed)
    call["output_final_state"] = True
    before = call["initial_state"].clone()
    version = call["initial_state"]._version
    o, final = kda.fused_recurrent_kda(**call)
    ref = reference_of(call)
    assert call["initial_state"]._version == version
    assert torch.equal(call["initial_state"].isnan(), before.isnan())
    assert final.dtype == torch.float32 and final.shape == (4, 2, 16, 12)
    assert relative_error(o, ref.o) <= 1e-4 and relative_error(final, ref.final_state) <= 1e-4
    assert (final[1] == 0).all()  # the padding row
    o2, none = kda.fused_recurrent_kda(**dict(call, output_final_state=False))
    assert none is None and torch.equal(o, o2)


def test_inplace_without_indices_is_slot_per_sequence(seed):
    call = decode_call(pool="none", seed=seed)
    call["output_final_state"] = False
    ref = reference_of(dict(call, output_final_state=True))
    pool = call["initial_state"].clone()
    o, final = kda.fused_recurrent_kda(**dict(call, initial_state=pool, inplace_final_state=True))
    assert final is pool and relative_error(o, ref.o) <= 1e-4
    assert relative_error(pool[[0, 1, 3]], ref.final_state[[0, 1, 3]]) <= 1e-4
    assert torch.equal(pool[2], call["initial_state"][2])  # the empty sequence: not written


@pytest.mark.parametrize("state_v_first", [False, True])
def test_without_a_pool_it_agrees_with_chunk_kda(seed, state_v_first):
    call = decode_call(lengths=(5, 0, 9, 1), pool="none", state_v_first=state_v_first, seed=seed, gate="softplus")
    o, final = kda.fused_recurrent_kda(**call)
    A_log, dt_bias = call.pop("A_log"), call.pop("dt_bias")
    o_chunk, final_chunk = kda.chunk_kda(**call, A_log=A_log, dt_bias=dt_bias)
    assert relative_error(o, o_chunk.double()) <= 1e-5
    assert relative_error(final, final_chunk.double()) <= 1e-5


def test_bf16_inputs_and_pool_within_the_policy(seed):
    call = decode_call(dtype=torch.bfloat16, pool="tokens", pool_dtype=torch.bfloat16, seed=seed)
    ref = reference_of(call)
    o, pool = kda.fused_recurrent_kda(**call)
    assert o.dtype == torch.bfloat16
    assert relative_error(o, ref.o) <= 8e-3
    written = sorted(set(ref.written))
    assert relative_error(pool[written], ref.exact_pool[written]) <= 8e-3


def test_kda_gate_is_fla_fused_kda_gate(seed):
    g, A_log, dt_bias = torch.randn(2, 3, 4, 8, dtype=torch.bfloat16), torch.randn(1, 1, 4, 1), torch.randn(32)
    x = g.float() + dt_bias.view(4, 8)
    softplus = -A_log.view(4, 1).exp() * torch.nn.functional.softplus(x)
    assert torch.allclose(kda.kda_gate(g, A_log, dt_bias), softplus)
    sigmoid = -5.0 * torch.sigmoid(A_log.view(4, 1).exp() * x)
    assert torch.allclose(kda.kda_gate(g, A_log, dt_bias, lower_bound=-5.0), sigmoid)
    assert torch.allclose(kda.kda_gate(g, None, dt_bias, lower_bound=-5.0), -5.0 * torch.sigmoid(x))
    assert kda.kda_gate(g, A_log, output_dtype=torch.bfloat16).dtype == torch.bfloat16
    A = A_log.clone().requires_grad_(True)
    kda.kda_gate(g, A, dt_bias).sum().backward()
    assert A.grad is not None and torch.isfinite(A.grad).all()
    with pytest.raises(kda.KDAInputError, match="A_log"):
        kda.kda_gate(g, None)


@pytest.mark.gpu
@pytest.mark.parametrize("pool", ["slots", "tokens"])
def test_no_host_sync_with_indices_on_the_gpu(pool):
    """With every index on the GPU, the spec, dispatch and the torch backend read none on the host."""
    call = {n: (t.cuda() if isinstance(t, torch.Tensor) else t) for n, t in decode_call(pool=pool).items()}
    kda.fused_recurrent_kda(**call, backend="torch")  # first call: lazy verification (it may sync)
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        kda.fused_recurrent_kda(**call, backend="torch")
    finally:
        torch.cuda.set_sync_debug_mode("default")


@pytest.mark.gpu
@pytest.mark.parametrize("backend", ["triton", "torch", "auto"])
def test_decode_step_captured_in_a_cuda_graph(backend):
    """One serving step (a pool, padding rows, 1 token a sequence), warmed up, captured in a CUDA graph,
    replayed on new inputs written into the same buffers: the pool and o equal an eager step's."""
    call = decode_call(lengths=(1, 1, 1, 1), varlen=False, pool="slots", K=64, V=64, dtype=torch.bfloat16)
    call = {n: (t.cuda() if isinstance(t, torch.Tensor) else t) for n, t in call.items()}
    out = torch.empty_like(call["v"])
    pool = call["initial_state"]
    kda.fused_recurrent_kda(**{**call, "initial_state": pool.clone()}, out=torch.empty_like(out), backend=backend)
    torch.cuda.synchronize()  # warmed up: verified, compiled
    graph = torch.cuda.CUDAGraph()
    stream = torch.cuda.Stream()
    with torch.cuda.stream(stream):
        before = pool.clone()
        with torch.cuda.graph(graph, stream=stream):
            kda.fused_recurrent_kda(**call, out=out, backend=backend)
    pool.copy_(before)
    fresh = {n: torch.randn_like(call[n]) for n in ("q", "v", "g", "beta")}
    for name, t in fresh.items():
        call[name].copy_(t)
    graph.replay()
    torch.cuda.synchronize()
    expected_pool = before.clone()
    expected_o = torch.empty_like(out)
    kda.fused_recurrent_kda(**{**call, "initial_state": expected_pool}, out=expected_o, backend=backend)
    torch.testing.assert_close(out, expected_o, rtol=0, atol=0, equal_nan=True)
    torch.testing.assert_close(pool, expected_pool, rtol=0, atol=0, equal_nan=True)
