"""The verifier's correlated regime: keys of a head near one direction, slow decay, large beta. Its inputs
are what they claim, and it fails a chunked forward whose inverse ``(I + A_kk)^-1`` is a Neumann series
over the chunk (what the helion and tilelang backends computed before, which passed every random case)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from kernel_cases import case_class

import kda
from kda.backends.torch import chunked
from kda.backends.torch.intra import rounded_exp
from kda.reference import log_decay
from kda.spec import CaseClass, GateMode
from kda.verify.cases import CORRELATED_COSINE, VerificationCase, cases_for, make_inputs
from kda.verify.check import run_case

GATES = [GateMode.PREGATED, GateMode.SOFTPLUS, GateMode.SIGMOID, GateMode.SAFE]


def _class(gate: GateMode, **changes) -> CaseClass:
    """fp32 at chunk 64: the test's own errors are then the backend's arithmetic, not bf16 storage."""
    given = gate is GateMode.PREGATED
    return case_class(gate=gate, qk_l2norm=not given, beta="given" if given else "sigmoid", chunk_size=64, **changes)


def _inputs(cc: CaseClass, regime: str, seed: int, K: int = 64) -> dict:
    case = VerificationCase(cc, regime, 2, 2, 2, K, 16, (4 * cc.chunk_size + 13,), cc.dtype, seed=seed)
    return make_inputs(case, "cpu")[0]


def _mean_cosine(k: torch.Tensor) -> float:
    """The mean cosine between distinct keys of a head, over heads and sequences."""
    unit = F.normalize(k.double(), dim=-1).transpose(1, 2)  # [B, H, T, K]
    cosines = unit @ unit.transpose(-1, -2)
    T = cosines.shape[-1]
    return float((cosines.sum((-1, -2)) - T).mean() / (T * (T - 1)))


@pytest.mark.parametrize("gate", GATES, ids=lambda g: g.value)
def test_correlated_inputs_are_what_the_regime_says(seed, gate):
    cc = _class(gate)
    correlated, realistic = _inputs(cc, "correlated", seed), _inputs(cc, "realistic", seed)
    assert _mean_cosine(correlated["k"]) > 0.8 * CORRELATED_COSINE**2  # 0.56 at 0.75: one direction
    assert abs(_mean_cosine(realistic["k"])) < 0.1
    a = log_decay(
        correlated["g"].double(),
        use_gate_in_kernel=correlated.get("use_gate_in_kernel", False),
        A_log=correlated.get("A_log"),
        dt_bias=correlated.get("dt_bias"),
        lower_bound=correlated.get("lower_bound"),
    )
    assert bool((a < 0).all()) and float(a.mean()) > -0.05  # slow decay: a chunk keeps most of its state
    assert float(a.mean()) < -1e-3  # but decays: the gate's derivative stays inside fp32
    beta = correlated["beta"].double()
    beta = beta if cc.beta == "given" else torch.sigmoid(beta)
    assert float(beta.mean()) > 0.6


def test_quick_verification_takes_the_correlated_case():
    for cc in (_class(GateMode.SAFE), _class(GateMode.SAFE, varlen=True, training=True)):
        assert [c.regime for c in cases_for(cc, quick=True)] == ["realistic", "correlated"]
        assert "correlated" in [c.regime for c in cases_for(cc, quick=False)]


def _neumann_wy_transform(A_kk, k, v, beta, gamma):
    """`chunked.wy_transform` with ``(I + A_kk)^-1`` summed as a Neumann series by doubling, in the inputs'
    precision: ``T = (I + N)(I + N^2)(I + N^4)...`` for ``N = -A_kk``."""
    C = A_kk.shape[-1]
    eye = torch.eye(C, dtype=A_kk.dtype)
    inverse, power = eye - A_kk, -A_kk
    for _ in range(C.bit_length() - 2):
        power = power @ power
        inverse = inverse + power @ inverse
    rhs = torch.cat([beta[..., None] * rounded_exp(gamma, k.dtype) * k, beta[..., None] * v], dim=-1)
    solved = inverse @ rhs
    return solved[..., : k.shape[-1]], solved[..., k.shape[-1] :]


@pytest.mark.parametrize("gate", [GateMode.PREGATED, GateMode.SAFE], ids=lambda g: g.value)
def test_a_neumann_inverse_passes_random_keys_and_fails_correlated_ones(seed, monkeypatch, gate):
    """fp32, C = 64: the series over the chunk cancels past fp32's 1e-3 only on correlated keys."""
    cc = _class(gate)
    backend = kda.get_backend("torch")
    monkeypatch.setattr(chunked, "wy_transform", _neumann_wy_transform)

    def case(regime: str) -> VerificationCase:
        return VerificationCase(cc, regime, 2, 2, 2, 64, 16, (4 * 64 + 13,), cc.dtype, seed=seed)

    realistic = run_case(backend, case("realistic"), "cpu")
    assert realistic.passed, realistic.reason
    correlated = run_case(backend, case("correlated"), "cpu")
    assert not correlated.passed
    assert not correlated.errors or correlated.errors["o"] > 1.0  # not a near miss: garbage or inf


def test_the_torch_backend_passes_the_correlated_regime(seed):
    """Substitution (``solve_triangular``), the same inputs: well inside fp32's tolerance."""
    cc = _class(GateMode.SAFE, training=True)
    case = VerificationCase(cc, "correlated", 2, 2, 2, 64, 16, (4 * 64 + 13,), cc.dtype, seed=seed)
    result = run_case(kda.get_backend("torch"), case, "cpu")
    assert result.passed, result.reason
    assert max(result.errors.values()) < 1e-4
