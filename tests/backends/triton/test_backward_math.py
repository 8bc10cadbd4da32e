"""The chunked backward derivation (tests/backends/triton/backward_math.py) against autograd of the naive
recurrence, in float64: the formulas the Triton backward kernels implement; and the log decay's gradient
in fp32 with saturated gates, where the form of the sum decides the accuracy of dA_log."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from backward_math import chunk_backward, chunk_forward

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
    o_ref, S_ref = naive_recurrence(
        q[None, :, None], k[None, :, None], v[None, :, None], a[None, :, None], beta[None, :, None], 0.7, S0[None, None]
    )
    do, dS_T = torch.randn(T, V, dtype=dt), torch.randn(K, V, dtype=dt)
    want = torch.autograd.grad([o_ref[0, :, 0], S_ref[0, 0]], [q, k, v, beta, a, S0], [do, dS_T])
    with torch.no_grad():
        o, S, saved = chunk_forward(q, k, v, beta, a, 0.7, S0, C)
        got = chunk_backward(saved, do, dS_T, 0.7)
    assert torch.allclose(o, o_ref[0, :, 0], atol=1e-12) and torch.allclose(S, S_ref[0, 0], atol=1e-12)
    for name, g, m in zip(("dq", "dk", "dv", "dbeta", "da", "dS0"), want, got):
        assert ((g - m).norm() / g.norm()).item() < 1e-12, name


def test_log_decay_gradient_in_fp32_where_the_decay_underflows(seed):
    """A saturated gate (softplus with a large exp(A_log)) gives tokens with a log decay in the hundreds below
    zero: their true ``da`` is ~e^(a), and ``dA_log = sum a da`` multiplies whatever fp32 leaves there by a.
    The chunked form must give such a token exactly 0 (every term carries its decay), not the residual of
    O(1) terms that cancel (the reverse cumsum of dG: ~1e-8, times a ~ -300, put dA_log 1.6e-3 off)."""
    T, C, K, V = 100, 32, 12, 9
    dt = torch.float64
    q = F.normalize(torch.randn(T, K, dtype=dt), dim=-1)
    k = F.normalize(torch.randn(T, K, dtype=dt), dim=-1)
    v = torch.randn(T, V, dtype=dt)
    beta = torch.rand(T, dtype=dt) * 0.9 + 0.05
    a = -torch.rand(T, K, dtype=dt) * 3
    saturated = torch.rand(T, K) < 0.15
    a = torch.where(saturated, -150 - 250 * torch.rand(T, K, dtype=dt), a).requires_grad_()
    S0 = torch.randn(K, V, dtype=dt)
    o_ref, S_ref = naive_recurrence(
        q[None, :, None], k[None, :, None], v[None, :, None], a[None, :, None], beta[None, :, None], 0.7, S0[None, None]
    )
    do, dS_T = torch.randn(T, V, dtype=dt), torch.randn(K, V, dtype=dt)
    (da_ref,) = torch.autograd.grad([o_ref[0, :, 0], S_ref[0, 0]], [a], [do, dS_T])
    f32 = [x.detach().float() for x in (q, k, v, beta, a, S0)]
    with torch.no_grad():
        _, _, saved = chunk_forward(*f32[:5], 0.7, f32[5], C)
        da = chunk_backward(saved, do.float(), dS_T.float(), 0.7)[4].double()
    assert da_ref[saturated].abs().max() < 1e-40
    assert torch.equal(da[saturated], torch.zeros_like(da[saturated]))
    assert ((da - da_ref).norm() / da_ref.norm()).item() < 1e-4
