"""benchmarks/helion_halves.py's state pass on bf16 halves, run by Helion's interpreter on the CPU against
the float64 recurrence and beside the shipped state kernel: every ``h`` and ``v_new`` written, within the
2^-16 the halves carry, and not the shipped kernel's numbers (so the halves' products are what ran)."""

from __future__ import annotations

import itertools

import pytest
import torch
from benchmark_scripts import load

from kda.verify.check import relative_error

helion = pytest.importorskip("helion", reason="helion is not installed (extra `test`)")


helion_halves = load("helion_halves")


def _recurrence(x: dict[str, torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
    """(v_new, h) in float64, chunk after chunk of each sequence."""
    w, k_g, u, G = (x[name].double() for name in ("w", "k_g", "u", "G"))
    NT, HV, C, K = w.shape
    v_new, h = torch.empty_like(u), torch.empty(NT, HV, K, u.shape[-1], dtype=torch.float64)
    bounds = x["chunk_bounds"].tolist()
    for start, end in itertools.pairwise(bounds):
        S = torch.zeros(HV, K, u.shape[-1], dtype=torch.float64)
        for j in range(start, end):
            h[j] = S
            v_new[j] = u[j] - w[j] @ S
            S = G[j, :, C - 1].exp()[..., None] * S + k_g[j].transpose(-1, -2) @ v_new[j]
    return v_new, h


def test_the_halves_state_pass_against_the_recurrence_and_the_shipped_kernel(seed, monkeypatch):
    from kda.backends.helion import runtime, state

    monkeypatch.setenv("HELION_INTERPRET", "1")
    runtime.register_cpu_matmul()
    B, T, HV, K, V, C = 2, 40, 3, 32, 16, 16
    x = helion_halves.inputs(B, T, HV, K, V, C, "cpu", seed=seed)
    NT = x["w"].shape[0]
    want_v, want_h = _recurrence(x)

    results = {}
    for name, kernel, make_args in (
        ("shipped", state.state_kernel, helion_halves.shipped_args),
        ("halves", helion_halves.state_halves_kernel, helion_halves.halves_args),
    ):
        u, h = x["u"].clone(), torch.full((NT, HV, K, V), float("nan"))  # NaN: an h not written fails
        precision = {"dot_precision": "ieee"} if name == "shipped" else {}
        helion.kernel(kernel, static_shapes=False, **precision)(*make_args(x, u, h, C))
        assert torch.isfinite(u).all() and torch.isfinite(h).all(), name
        results[name] = (relative_error(u.double(), want_v), relative_error(h.double(), want_h))

    assert max(results["shipped"]) < 1e-6, results  # fp32 products, exact up to fp32 rounding
    assert max(results["halves"]) < 2**-13, results  # 16 significant bits an operand, summed over chunks
    assert results["halves"][0] > 2 * results["shipped"][0], results  # the halves' products ran
