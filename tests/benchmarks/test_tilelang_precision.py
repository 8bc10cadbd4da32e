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
# block products' sums cancel about tenfold at beta near 2 (measured 9e-5 at cosine 0.99, beta 1.9; 2e-6 at
# 0.75, 0.75). `w` and `u` then take T rounded to the inputs' dtype (bf16: 2^-9).
BOUND = 2e-4


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
