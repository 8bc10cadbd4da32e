"""The chunked backward derivation (kda/backends/triton/backward_math.py) against autograd of the naive
recurrence, in float64: the formulas the Triton backward kernels will implement."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from kda.backends.triton.backward_math import chunk_backward, chunk_forward
from kda.reference import naive_recurrence


@pytest.mark.parametrize("T, C", [(70, 32), (64, 64), (5, 32), (130, 64)])
def test_chunked_backward_matches_autograd(seed, T, C):
    dt = torch.float64
    K, V = 12, 9
    q = F.normalize(torch.randn(T, K, dtype=dt), dim=-1).requires_grad_()
    k = F.normalize(torch.randn(T, K, dtype=dt), dim=-1).requires_grad_()
    v = torch.randn(T, V, dtype=dt, requires_grad=True)
    beta = (torch.rand(T, dtype=dt) * 0.9 + 0.05).requires_grad_()
    a = (-torch.rand(T, K, dtype=dt) * 3).requires_grad_()
    S0 = torch.randn(K, V, dtype=dt, requires_grad=True)
    o_ref, S_ref = naive_recurrence(q[None, :, None], k[None, :, None], v[None, :, None], a[None, :, None],
                                    beta[None, :, None], 0.7, S0[None, None])
    do, dS_T = torch.randn(T, V, dtype=dt), torch.randn(K, V, dtype=dt)
    want = torch.autograd.grad([o_ref[0, :, 0], S_ref[0, 0]], [q, k, v, beta, a, S0], [do, dS_T])
    with torch.no_grad():
        o, S, saved = chunk_forward(q, k, v, beta, a, 0.7, S0, C)
        got = chunk_backward(saved, do, dS_T, 0.7)
    assert torch.allclose(o, o_ref[0, :, 0], atol=1e-12) and torch.allclose(S, S_ref[0, 0], atol=1e-12)
    for name, g, m in zip(("dq", "dk", "dv", "dbeta", "da", "dS0"), want, got):
        assert ((g - m).norm() / g.norm()).item() < 1e-12, name
