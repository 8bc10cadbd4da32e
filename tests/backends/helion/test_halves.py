"""`kda.backends.helion.halves.split`: an fp32 tensor as bf16 halves whose sum is it to 2^-16, at any
magnitude fp32 holds (the device helper the serial passes, `solve` and `scores` share)."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("helion")

from kda.backends.helion.halves import split


@pytest.mark.parametrize("seed", [torch.seed() % 2**31, 1 + torch.seed() % 2**31])
def test_the_halves_sum_to_the_value_within_2_to_the_minus_16(seed):
    gen = torch.Generator().manual_seed(seed)
    magnitudes = torch.logspace(-30, 37, 64, dtype=torch.float64).to(torch.float32)
    x = torch.randn(64, 64, generator=gen).clamp(-8, 8) * magnitudes[:, None]  # within fp32's range
    assert torch.isfinite(x).all() and (x != 0).all()
    hi, lo = split(x)
    assert hi.dtype == lo.dtype == torch.bfloat16
    assert torch.equal(hi, x.to(torch.bfloat16))
    assert torch.isfinite(hi).all() and torch.isfinite(lo).all()
    error = (hi.double() + lo.double() - x.double()).abs()
    assert (error <= 2.0**-16 * x.double().abs()).all(), f"seed {seed}: {(error / x.double().abs()).max():.3e}"


def test_the_low_half_carries_what_the_high_half_drops():
    x = torch.tensor([1 + 2.0**-9, -(1 + 2.0**-12), 3.0e38, 2.0**-100 * (1 + 2.0**-10)])
    hi, lo = split(x)
    assert (lo != 0).all()
    assert (hi.double() + lo.double() - x.double()).abs().max() <= 2.0**-16 * x.double().abs().max()
