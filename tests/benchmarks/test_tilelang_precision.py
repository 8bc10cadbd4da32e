"""benchmarks/tilelang_precision.py's inverse: the tilelang `intra` kernel's ``(I + A_kk)^-1`` (its 16-row
diagonal blocks by substitution in fp32, then block rows joined by products on bf16 halves), replayed in
torch. The kernel's numbers are checked on a GPU only; this is where CI checks its algorithm, on the
matrices that broke the Neumann series over the chunk it replaced: keys of a chunk near one direction,
large beta, no decay."""

from __future__ import annotations

import pytest
import torch
from benchmark_scripts import load

precision = load("tilelang_precision")
# relative to the inverse's largest entry. The halves carry 16 significant bits (2^-17 = 7.6e-6), and the
# block products' sums cancel about tenfold at beta near 2: over 5000 draws at C = 64, cosine 0.99, beta 1.9
# the error's median is 1.1e-4, its 99.9th percentile 2.5e-4 and its largest 2.8e-4 (1.3% of draws passed
# 2e-4, the bound this once was, set from one draw); at C = 32 the largest of 300 is 1.2e-4, at cosine 0.95,
# beta 1.0 1.9e-5. `w` and `u` then take T rounded to the inputs' dtype (bf16: 2^-9 = 2e-3, five times this
# bound), while the Neumann series this replaced is 1.2e2 off or more at cosine 0.75, beta 0.75 (50 draws).
BOUND = 4e-4


def _A_kk(generator: torch.Generator, C: int, cosine: float, beta: float, K: int = 128) -> torch.Tensor:
    """A strictly lower ``beta k_i . k_j`` for unit keys at about this cosine to a shared direction, as the
    kernel holds it (``N = -A_kk`` as two bf16 halves)."""
    shared = torch.randn(K, generator=generator, dtype=torch.float64)
    own = torch.randn(C, K, generator=generator, dtype=torch.float64)
    keys = cosine * shared / shared.norm() + (1 - cosine**2) ** 0.5 * own / own.norm(dim=1, keepdim=True)
    keys = keys / keys.norm(dim=1, keepdim=True)
    A_kk = torch.tril(beta * keys @ keys.T, diagonal=-1).float()
    return -sum(precision.halves(-A_kk))


def _error(T: torch.Tensor, A_kk: torch.Tensor) -> float:
    exact = torch.linalg.inv(torch.eye(A_kk.shape[0], dtype=torch.float64) + A_kk.double())
    return float((T.double() - exact).abs().max() / exact.abs().max())


@pytest.mark.parametrize("C", [32, 64])
@pytest.mark.parametrize("cosine, beta", [(0.1, 0.5), (0.75, 0.75), (0.95, 1.0), (0.99, 1.9)])
def test_the_inverse_holds_for_correlated_keys(seed, C, cosine, beta):
    A_kk = _A_kk(torch.Generator().manual_seed(seed), C, cosine, beta)
    T = precision.unit_lower_inverse(-A_kk)
    assert torch.isfinite(T).all()
    assert _error(T, A_kk) < BOUND


def test_a_neumann_series_over_the_chunk_fails_that_bound(seed):
    """What `intra` computed before, on the same operands (bf16 halves, fp32 sums): the powers of ``N``
    outgrow the inverse and their sum cancels."""
    A_kk = _A_kk(torch.Generator().manual_seed(seed), 64, 0.75, 0.75)
    P = -A_kk
    T = P + torch.eye(64)
    for _ in range(5):
        P = sum(precision.halves(precision.split_product(P, P)))
        T = T + precision.split_product(P, T)
    assert not _error(T, A_kk) < BOUND


# The forward's roundings (`chunk_forward`), on the verifier's own cases.

NEGATIVE_EIGENVALUES = "softplus/l2/sig2/bf16/varlen/mha/h0/c64/d64/fwd"  # beta in (0, 2)
RECORDED_SEED = 569467207  # the correlated case version 14 missed on an H100: o 8.25e-3 against 8e-3


def _correlated_case(seed: int) -> tuple[dict, torch.Tensor]:
    from dataclasses import replace

    from kda.reference import kda_reference
    from kda.spec import CaseClass
    from kda.verify.cases import cases_for, make_inputs

    (case,) = [c for c in cases_for(CaseClass.from_key(NEGATIVE_EIGENVALUES), quick=False) if c.regime == "correlated"]
    kwargs = make_inputs(replace(case, seed=seed), "cpu")[0]
    return kwargs, kda_reference(**kwargs)[0]


def _o_error(kwargs: dict, reference: torch.Tensor, roundings) -> float:
    from kda.verify.check import relative_error

    return relative_error(precision.chunk_forward(kwargs, 64, roundings)[0], reference)


def test_the_replay_gives_what_the_gpu_gave_on_the_recorded_case():
    """Version 14's roundings replay the H100's miss to 0.2%: the replay models the kernels' numbers."""
    assert abs(_o_error(*_correlated_case(RECORDED_SEED), precision.VERSION_14) - 8.25e-3) < 0.05 * 8.25e-3


def test_without_two_roundings_the_negative_eigenvalue_correlated_case_passes(seed):
    """With beta up to 2 the correlated case sat at the tolerance under version 14's roundings (about 40% of
    fresh draws past it in the replay), no one rounding dominating; without the rounding of the normalized
    rows before use and with ``T`` as two halves in ``w`` and ``u``, the replay passes the recorded case and
    fresh ones with a margin (at most 0.89 of the tolerance over 60 draws)."""
    from kda.verify.policy import tolerance as tolerance_of

    tolerance = tolerance_of("o", "bfloat16")
    recorded = _correlated_case(RECORDED_SEED)
    assert _o_error(*recorded, precision.VERSION_14) > tolerance
    assert _o_error(*recorded, precision.SHIPPED) < 0.9 * tolerance
    generator = torch.Generator().manual_seed(seed)
    for _ in range(3):
        fresh = _correlated_case(int(torch.randint(2**31 - 1, (1,), generator=generator)))
        assert _o_error(*fresh, precision.SHIPPED) < tolerance
