"""The intra kernel's ``[16, 16]`` unit lower inverse (`intra.unit_lower_inverse`: a product of
``I + n^(2^i)`` factors, then one Newton step), run in Triton's interpreter against a float64 inverse,
on the matrices where the product alone cancels badly: correlated keys with beta near 2."""

from __future__ import annotations

import numpy as np
import pytest
import torch

pytest.importorskip("triton", reason="Triton is not installed (extra `triton`)")

import triton
import triton.language as tl
from test_triton_backend import interpreter  # noqa: F401  (the fixture)

from kda.backends.triton import intra

BC = 16
BOUND = 2e-5  # relative to the inverse's largest entry; forward substitution in fp32 gets ~5e-7 here


@triton.jit
def _inverse_kernel(a, out, BC: tl.constexpr):
    r = tl.arange(0, BC)
    offsets = r[:, None] * BC + r[None, :]
    tl.store(out + offsets, intra.unit_lower_inverse(tl.load(a + offsets), BC))


def _block(generator: torch.Generator, cosine: float, beta: float, K: int = 64) -> torch.Tensor:
    """A strictly lower ``beta k_i . k_j`` block for unit keys at about this cosine to a shared direction."""
    shared = torch.randn(K, generator=generator, dtype=torch.float64)
    own = torch.randn(BC, K, generator=generator, dtype=torch.float64) / K**0.5
    keys = cosine * shared / shared.norm() + (1 - cosine**2) ** 0.5 * own
    keys = keys / keys.norm(dim=1, keepdim=True)
    return torch.tril(beta * keys @ keys.T, diagonal=-1)


def _error(x: np.ndarray | torch.Tensor, a: torch.Tensor) -> float:
    exact = torch.linalg.inv(torch.eye(BC, dtype=torch.float64) + a)
    return float((torch.as_tensor(x, dtype=torch.float64) - exact).abs().max() / exact.abs().max())


@pytest.mark.parametrize("cosine, beta", [(0.1, 0.5), (0.9, 1.0), (0.95, 1.9), (0.99, 1.99)])
def test_unit_lower_inverse_is_accurate_for_correlated_keys(seed, interpreter, cosine, beta):  # noqa: F811
    a = _block(torch.Generator().manual_seed(seed), cosine, beta)
    out = torch.full((BC, BC), float("nan"))
    _inverse_kernel[(1,)](a.float().contiguous(), out, BC=BC)
    assert _error(out, a) < BOUND


def test_the_products_alone_would_fail_that_bound(seed):
    """Why the Newton step is there: the same products in fp32 without it miss the bound above."""
    a = _block(torch.Generator().manual_seed(seed), 0.99, 1.99).float().numpy()
    n, x = -a, np.eye(BC, dtype=np.float32) - a
    power = n
    for _ in range(3):
        power = power @ power
        x = x + x @ power
    assert _error(x, torch.from_numpy(a).double()) > BOUND
