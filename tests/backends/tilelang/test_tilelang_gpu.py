"""The tilelang backend on a Hopper GPU: its kernels against the float64 reference through the verifier's own
`run_case` (NaN-poisoned outputs, inputs checked for modification), over the variants it claims, forward
and backward (every gradient), with realistic and extreme gates, several chunks and ragged tails; and route
tests that prove its kernels are what ran. Every test here is marked `gpu` and skips with the reason on a machine without one (CI); there
the lowering tests (`test_tilelang_backend.py`) run instead.
"""

from __future__ import annotations

import pytest
import torch
from kernel_cases import case_class, expected_gradients, training_class, variant_id

import kda
from kda.spec import GateMode
from kda.verify.cases import VerificationCase
from kda.verify.check import relative_error, run_case
from kda.verify.policy import tolerance

pytest.importorskip("tilelang", reason="TileLang is not installed (extra `tilelang`)")

from kda.backends.tilelang import kernels, runtime

pytestmark = pytest.mark.gpu

VARIANTS = [
    dict(),
    dict(gate=GateMode.PREGATED, qk_l2norm=False, beta="given"),
    dict(gate=GateMode.SOFTPLUS, beta="sigmoid2", chunk_size=32),
    dict(varlen=True, gva=True, state_v_first=True),
    dict(dtype="float16", gva=True, final_state=False),
    dict(dtype="float16", qk_l2norm=False, initial_state=False),
    dict(gate=GateMode.SIGMOID, varlen=True),
]


@pytest.mark.parametrize("head_dim", [64, 128, 256])
@pytest.mark.parametrize("variant", VARIANTS, ids=variant_id)
@pytest.mark.parametrize("regime", ["realistic", "extreme"])
@pytest.mark.usefixtures("hopper")
def test_forward_matches_the_reference(seed, variant, regime, head_dim):
    cc = case_class(**{"dtype": "bfloat16", "chunk_size": 64, **variant}, head_dim=head_dim)
    C = cc.chunk_size
    group = 2 if cc.gva else 1
    lengths = (5 * C + 13, 0, 1, C - 3) if cc.varlen else (5 * C + 13,) * 2
    B = 1 if cc.varlen else 2
    case = VerificationCase(cc, regime, B, 2, 2 * group, head_dim, head_dim, lengths, cc.dtype, seed=seed)
    result = run_case(kda.get_backend("tilelang"), case, "cuda")
    assert result.passed, (cc.key, result.reason, result.errors)


TRAINING_VARIANTS = [
    dict(),
    dict(gate=GateMode.PREGATED, qk_l2norm=False, beta="given"),
    dict(gate=GateMode.SOFTPLUS, beta="sigmoid2", chunk_size=32, varlen=True, gva=True, state_v_first=True),
    dict(dtype="float16", gva=True, final_state=False, chunk_size=32),
    dict(gate=GateMode.SIGMOID, varlen=True, initial_state=False),
]


@pytest.mark.parametrize("head_dim", [64, 128])
@pytest.mark.parametrize("variant", TRAINING_VARIANTS, ids=variant_id)
@pytest.mark.parametrize("regime", ["realistic", "extreme"])
@pytest.mark.usefixtures("hopper")
def test_backward_gives_every_gradient(seed, variant, regime, head_dim):
    cc = training_class({"dtype": "bfloat16", "chunk_size": 64, **variant, "head_dim": head_dim}, regime)
    C = cc.chunk_size
    group = 2 if cc.gva else 1
    lengths = (3 * C + 13, 0, 1, C - 3) if cc.varlen else (3 * C + 13,) * 2
    B = 1 if cc.varlen else 2
    case = VerificationCase(cc, regime, B, 2, 2 * group, head_dim, head_dim, lengths, cc.dtype, seed=seed)
    result = run_case(kda.get_backend("tilelang"), case, "cuda")
    assert result.passed, (cc.key, result.reason, result.errors)
    assert expected_gradients(cc) <= set(result.errors), result.errors


@pytest.mark.usefixtures("hopper")
def test_the_tilelang_kernels_are_what_ran(monkeypatch):
    launched: list[str] = []
    real = kernels.compile_all

    def spying(spec):
        built = real(spec)
        return {name: _Counted(name, kernel, launched) for name, kernel in built.items()}

    monkeypatch.setattr(kernels, "compile_all", spying)
    monkeypatch.setenv("KDA_VERIFY", "off")  # the route, not the verifier's own calls
    B, T, H, K, V = 1, 200, 2, 64, 64
    device, bf16 = "cuda", torch.bfloat16
    q, k = torch.randn(B, T, H, K, device=device, dtype=bf16), torch.randn(B, T, H, K, device=device, dtype=bf16)
    v = torch.randn(B, T, H, V, device=device, dtype=bf16)
    g = torch.nn.functional.logsigmoid(torch.randn(B, T, H, K, device=device)).to(bf16)
    beta = torch.rand(B, T, H, device=device, dtype=bf16)
    o, _ = kda.chunk_kda(q, k, v, g, beta, backend="tilelang", use_qk_l2norm_in_kernel=True)
    assert launched == ["intra", "state"]  # the output in the serial pass (K <= 128)
    as64 = [x.double() for x in (q, k, v, g, beta)]
    reference, _ = kda.chunk_kda(*as64, backend="torch", use_qk_l2norm_in_kernel=True)
    assert relative_error(o.double(), reference) <= tolerance("o", "bfloat16")
    assert runtime.tilelang_problem() is None


@pytest.mark.usefixtures("hopper")
def test_training_runs_the_tilelang_backward(monkeypatch):
    launched: list[str] = []
    real = kernels.compile_all
    monkeypatch.setattr(
        kernels, "compile_all", lambda spec: {n: _Counted(n, k, launched) for n, k in real(spec).items()}
    )
    monkeypatch.setenv("KDA_VERIFY", "off")
    B, T, H, K, V = 1, 150, 2, 64, 64
    device, bf16 = "cuda", torch.bfloat16
    leaves = [
        torch.randn(B, T, H, K, device=device, dtype=bf16),
        torch.randn(B, T, H, K, device=device, dtype=bf16),
        torch.randn(B, T, H, V, device=device, dtype=bf16),
        torch.nn.functional.logsigmoid(torch.randn(B, T, H, K, device=device)).to(bf16),
        torch.rand(B, T, H, device=device, dtype=bf16),
    ]
    inputs = [x.clone().requires_grad_() for x in leaves]
    o, _ = kda.chunk_kda(*inputs, backend="tilelang", use_qk_l2norm_in_kernel=True)
    do = torch.randn_like(o)
    o.backward(do)
    assert launched[:2] == ["intra", "state"]
    assert launched[2:] == ["state_backward", "chunk_backward", "score_backward", "gate_tail", "qk_tail", "qk_tail"]
    as64 = [x.double().requires_grad_() for x in leaves]
    reference, _ = kda.chunk_kda(*as64, backend="torch", use_qk_l2norm_in_kernel=True)
    reference.backward(do.double())
    for name, got, want in zip(("dq", "dk", "dv", "dg", "dbeta"), inputs, as64, strict=True):
        assert got.grad is not None and want.grad is not None
        assert relative_error(got.grad.double(), want.grad) <= tolerance(name, "bfloat16"), name


class _Counted:
    def __init__(self, name, kernel, launched):
        self.name, self.kernel, self.launched = name, kernel, launched

    def __call__(self, *args):
        self.launched.append(self.name)
        return self.kernel(*args)


PLANS = [kernels.StatePlan(False, 64), kernels.StatePlan(True, 64), kernels.StatePlan(True, 128)]


@pytest.mark.parametrize("training", [False, True])
@pytest.mark.usefixtures("hopper")
def test_every_state_plan_gives_the_same_bits(seed, monkeypatch, training):
    """The output inside the serial pass, 64 or 128 value columns a program, or a launch of its own
    (`kernels.state_plan` picks by shape, so the verifier's small cases run only the 64-column plan): the
    same products on the same operands in the same order, hence the same bits, in ``o``, the final state and
    every gradient, on a varlen batch with GVA, ragged tails, an empty and a one-token sequence, and both
    states. Training has no 128-column plan (its fp32 ``u`` tiles do not fit)."""
    monkeypatch.setenv("KDA_VERIFY", "off")
    lengths = [3 * 64 + 13, 0, 1, 61]
    cu_seqlens = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], device="cuda", dtype=torch.int32)
    T, H, HV, K, V, bf16 = sum(lengths), 2, 4, 64, 128, torch.bfloat16
    leaves = [
        torch.randn(1, T, H, K, device="cuda", dtype=bf16),
        torch.randn(1, T, H, K, device="cuda", dtype=bf16),
        torch.randn(1, T, HV, V, device="cuda", dtype=bf16),
        torch.nn.functional.logsigmoid(torch.randn(1, T, HV, K, device="cuda")).to(bf16),
        torch.rand(1, T, HV, device="cuda", dtype=bf16),
    ]
    h0 = torch.randn(len(lengths), HV, K, V, device="cuda")
    do, dht = torch.randn(1, T, HV, V, device="cuda", dtype=bf16), torch.randn_like(h0)
    found = []
    for plan in PLANS[:2] if training else PLANS:
        monkeypatch.setattr(kernels, "FORCED_PLAN", plan)
        inputs = [x.clone().requires_grad_(training) for x in leaves]
        o, ht = kda.chunk_kda(
            *inputs, initial_state=h0, output_final_state=True, cu_seqlens=cu_seqlens,
            use_qk_l2norm_in_kernel=True, backend="tilelang",
        )  # fmt: skip
        outputs = [o, ht]
        if training:
            torch.autograd.backward([o, ht], [do, dht])
            outputs += [x.grad for x in inputs]
        assert not any(bool(x.isnan().any()) for x in outputs), plan
        found.append([x.detach() for x in outputs])
    for plan, outputs in zip(PLANS[1:], found[1:], strict=False):
        for index, (ours, split) in enumerate(zip(outputs, found[0], strict=True)):
            assert torch.equal(ours, split), (plan, index)
