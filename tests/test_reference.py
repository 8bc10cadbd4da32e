"""Sanity of the float64 reference (`kda.reference.kda_reference`) against formulations written here.

The reference is the ground truth every backend is verified against, so it is checked against code that
shares nothing with it: an explicit per-token matrix recurrence with ``torch.eye`` (not the reference's
rank-1 einsum update), gates and transforms written from their formulas, and hand-computed numbers.
Every test draws fresh random inputs from the `seed` fixture.
"""

from __future__ import annotations

import math

import pytest
import torch

from kda.reference import beta_transform, kda_reference, l2norm, log_decay, safe_gate, softplus_gate

F64 = torch.float64


def rel_err(x: torch.Tensor, ref: torch.Tensor) -> float:
    return ((x - ref).norm() / ref.norm()).item()


# ----------------------------------------------------------------------------------------------- (a) independent recurrence


def my_l2norm(x: torch.Tensor) -> torch.Tensor:
    return x / torch.sqrt(x.pow(2).sum(-1, keepdim=True) + 1e-6)


def my_sigmoid(x: torch.Tensor) -> torch.Tensor:
    return 1.0 / (1.0 + torch.exp(-x))


def my_softplus(x: torch.Tensor) -> torch.Tensor:
    # log(1 + e^x) written stably without F.softplus: max(x, 0) + log1p(e^-|x|)
    return x.clamp(min=0) + torch.log1p(torch.exp(-x.abs()))


def my_gate(g, mode, A_log, dt_bias, lower_bound):
    """Per-token log decay [B, T, HV, K] from the raw gate input, head by head."""
    if mode == "pregated":
        return g
    HV, K = g.shape[2], g.shape[3]
    out = torch.empty_like(g)
    for h in range(HV):
        x = g[:, :, h, :]
        if dt_bias is not None:
            x = x + dt_bias.flatten()[h * K : (h + 1) * K]
        a = 1.0 if A_log is None else math.exp(float(A_log[h]))
        if mode == "softplus":
            out[:, :, h, :] = -a * my_softplus(x)
        else:
            out[:, :, h, :] = lower_bound * my_sigmoid(a * x)
    return out


def explicit_recurrence(q, k, v, logdecay, beta, scale, h0, bounds):
    """S_t = (I - b k k^T) Diag(exp(g)) S_{t-1} + b k v^T with explicit K x K matrices; o_t = scale S_t^T q_t.

    q, k [T, H, K] (one flattened batch row), v [T, HV, V]; sequences given by `bounds`.
    Returns o [T, HV, V] and final states [N, HV, K, V].
    """
    T, H, K = q.shape
    HV, V = v.shape[1], v.shape[2]
    group = HV // H
    eye = torch.eye(K, dtype=F64)
    o = torch.zeros(T, HV, V, dtype=F64)
    finals = []
    for n in range(len(bounds) - 1):
        states = []
        for hv in range(HV):
            h = hv // group
            S = torch.zeros(K, V, dtype=F64) if h0 is None else h0[n, hv].clone()
            for t in range(bounds[n], bounds[n + 1]):
                kt = k[t, h].reshape(K, 1)
                vt = v[t, hv].reshape(1, V)
                b = beta[t, hv]
                transition = (eye - b * (kt @ kt.T)) @ torch.diag(torch.exp(logdecay[t, hv]))
                S = transition @ S + b * (kt @ vt)
                o[t, hv] = scale * (S.T @ q[t, h])
            states.append(S)
        finals.append(torch.stack(states))
    return o, torch.stack(finals)


def independent_kda(
    q,
    k,
    v,
    g,
    beta,
    *,
    scale=None,
    initial_state=None,
    l2=False,
    mode="pregated",
    A_log=None,
    dt_bias=None,
    lower_bound=None,
    beta_mode="given",
    state_v_first=False,
    cu_seqlens=None,
):
    B, T, _H, K = q.shape
    if l2:
        q, k = my_l2norm(q), my_l2norm(k)
    if beta_mode == "sigmoid":
        beta = my_sigmoid(beta)
    elif beta_mode == "sigmoid2":
        beta = 2 * my_sigmoid(beta)
    logdecay = my_gate(g, mode, A_log, dt_bias, lower_bound)
    scale = 1.0 / math.sqrt(K) if scale is None else scale
    h0 = initial_state
    if h0 is not None and state_v_first:
        h0 = h0.permute(0, 1, 3, 2)
    if cu_seqlens is not None:
        o, S = explicit_recurrence(q[0], k[0], v[0], logdecay[0], beta[0], scale, h0, cu_seqlens.tolist())
        o = o[None]
    else:
        outs, finals = [], []
        for b in range(B):
            o_b, S_b = explicit_recurrence(
                q[b], k[b], v[b], logdecay[b], beta[b], scale, None if h0 is None else h0[b : b + 1], [0, T]
            )
            outs.append(o_b)
            finals.append(S_b)
        o, S = torch.stack(outs), torch.cat(finals)
    if state_v_first:
        S = S.permute(0, 1, 3, 2)
    return o, S


REFERENCE_CASES = {
    # name: (gate mode, l2norm, beta mode, GVA group, varlen, state_v_first, extreme gate)
    "pregated": ("pregated", False, "given", 1, False, False, False),
    "pregated-strong-decay": ("pregated", True, "sigmoid", 2, False, False, True),
    "softplus-gva-l2": ("softplus", True, "sigmoid", 2, False, False, False),
    "softplus-extreme-varlen": ("softplus", False, "sigmoid2", 1, True, True, True),
    "safe-lb5-gva-varlen": ("safe", True, "sigmoid2", 2, True, False, False),
    "safe-nearzero-vk": ("safe-near0", False, "given", 1, False, True, False),
    "safe-no-A_log": ("safe-noA", True, "sigmoid", 2, False, False, True),
}


@pytest.mark.parametrize("name", list(REFERENCE_CASES))
def test_reference_matches_explicit_matrix_recurrence(name, seed):
    mode, l2, beta_mode, group, varlen, vk, extreme = REFERENCE_CASES[name]
    H, K, V = 2, 5, 3
    HV = H * group
    if varlen:
        lens = [7, 0, 1, 12]
        B, T = 1, sum(lens)
        cu = torch.tensor([0, 7, 7, 8, 20])
        N = len(lens)
    else:
        B, T, cu, N = 2, 19, None, 2
    q = torch.randn(B, T, H, K, dtype=F64)
    k = torch.randn(B, T, H, K, dtype=F64)
    if not l2:
        k = k / k.norm(dim=-1, keepdim=True)
    v = torch.randn(B, T, HV, V, dtype=F64)
    beta = torch.randn(B, T, HV, dtype=F64) if beta_mode != "given" else torch.rand(B, T, HV, dtype=F64) * 0.9 + 0.05
    kwargs = {}
    gate_mode = mode.split("-")[0]
    if gate_mode == "pregated":
        g = -(torch.rand(B, T, HV, K, dtype=F64) * 4 + 2) if extreme else -torch.rand(B, T, HV, K, dtype=F64)
    else:
        g = torch.randn(B, T, HV, K, dtype=F64) * (8.0 if extreme else 1.0)
        kwargs["A_log"] = None if mode == "safe-noA" else torch.rand(HV, dtype=F64) * (3.0 if extreme else 1.0)
        kwargs["dt_bias"] = torch.randn(HV, K, dtype=F64) if name.endswith("vk") else torch.randn(HV * K, dtype=F64)
        if gate_mode == "safe":
            kwargs["lower_bound"] = -0.01 if mode == "safe-near0" else -5.0
    state_shape = (N, HV, V, K) if vk else (N, HV, K, V)
    h0 = torch.randn(*state_shape, dtype=F64)

    o_ind, s_ind = independent_kda(
        q,
        k,
        v,
        g,
        beta,
        initial_state=h0,
        l2=l2,
        mode=gate_mode,
        beta_mode=beta_mode,
        state_v_first=vk,
        cu_seqlens=cu,
        **kwargs,
    )
    o_ref, s_ref = kda_reference(
        q,
        k,
        v,
        g,
        beta,
        initial_state=h0,
        output_final_state=True,
        use_qk_l2norm_in_kernel=l2,
        use_gate_in_kernel=gate_mode != "pregated",
        safe_gate=gate_mode == "safe",
        use_beta_sigmoid_in_kernel=beta_mode != "given",
        allow_neg_eigval=beta_mode == "sigmoid2",
        state_v_first=vk,
        cu_seqlens=cu,
        **kwargs,
    )
    assert o_ref.dtype == F64 and s_ref.dtype == F64
    assert o_ref.shape == (B, T, HV, V) and s_ref.shape == state_shape
    assert torch.isfinite(o_ref).all() and torch.isfinite(s_ref).all()
    assert rel_err(o_ref, o_ind) < 1e-12
    assert rel_err(s_ref, s_ind) < 1e-12
    assert (o_ref - o_ind).abs().max() <= 1e-12 * max(1.0, o_ind.abs().max().item())


def test_reference_upcasts_low_precision_inputs(seed):
    """bf16 inputs are upcast first: the result equals the float64 run on the same (rounded) values."""
    B, T, H, K, V = 1, 9, 1, 4, 4
    q, k, v = (torch.randn(B, T, H, d).bfloat16() for d in (K, K, V))
    g = (-torch.rand(B, T, H, K)).bfloat16()
    beta = torch.rand(B, T, H).bfloat16()
    o_low, _ = kda_reference(q, k, v, g, beta)
    o64, _ = independent_kda(*(x.double() for x in (q, k, v, g, beta)))
    assert o_low.dtype == F64
    assert rel_err(o_low, o64) < 1e-12


# ----------------------------------------------------------------------------------------------- (b) GVA mapping


def test_gva_uses_head_hv_div_group(seed):
    B, T, H, group, K, V = 2, 13, 2, 3, 4, 5
    HV = H * group
    q, k = torch.randn(B, T, H, K, dtype=F64), torch.randn(B, T, H, K, dtype=F64)
    v = torch.randn(B, T, HV, V, dtype=F64)
    g = -torch.rand(B, T, HV, K, dtype=F64)
    beta = torch.rand(B, T, HV, dtype=F64)
    h0 = torch.randn(B, HV, K, V, dtype=F64)
    common = dict(initial_state=h0, output_final_state=True, use_qk_l2norm_in_kernel=True)

    o_gva, s_gva = kda_reference(q, k, v, g, beta, **common)
    # MHA with q/k head hv // group copied to value head hv
    idx = torch.arange(HV) // group
    o_mha, s_mha = kda_reference(q[:, :, idx], k[:, :, idx], v, g, beta, **common)
    assert rel_err(o_gva, o_mha) < 1e-13
    assert rel_err(s_gva, s_mha) < 1e-13
    # the other plausible mapping (hv % H, i.e. tiling the heads) gives a different answer
    o_tiled, _ = kda_reference(q.repeat(1, 1, group, 1), k.repeat(1, 1, group, 1), v, g, beta, **common)
    assert rel_err(o_tiled, o_mha) > 1e-3
    # and head by head: value head 4 (group 3) is q/k head 1 alone
    o_one, _ = kda_reference(
        q[:, :, 1:2],
        k[:, :, 1:2],
        v[:, :, 4:5],
        g[:, :, 4:5],
        beta[:, :, 4:5],
        initial_state=h0[:, 4:5],
        use_qk_l2norm_in_kernel=True,
    )
    assert rel_err(o_gva[:, :, 4:5], o_one) < 1e-13


# ----------------------------------------------------------------------------------------------- (c) state layout


def test_state_v_first_transposes_initial_and_final_state(seed):
    B, T, H, K, V = 2, 11, 2, 4, 6  # K != V so a wrong transpose cannot go unnoticed
    q, k = torch.randn(B, T, H, K, dtype=F64), torch.randn(B, T, H, K, dtype=F64)
    v = torch.randn(B, T, H, V, dtype=F64)
    g = -torch.rand(B, T, H, K, dtype=F64)
    beta = torch.rand(B, T, H, dtype=F64)
    h0 = torch.randn(B, H, K, V, dtype=F64)
    common = dict(output_final_state=True, use_qk_l2norm_in_kernel=True)
    o_kv, s_kv = kda_reference(q, k, v, g, beta, initial_state=h0, **common)
    o_vk, s_vk = kda_reference(
        q, k, v, g, beta, initial_state=h0.transpose(-1, -2).contiguous(), state_v_first=True, **common
    )
    assert s_kv.shape == (B, H, K, V) and s_vk.shape == (B, H, V, K)
    assert torch.equal(o_kv, o_vk)
    assert torch.equal(s_vk, s_kv.transpose(-1, -2))
    # the initial state matters (so the layouts were really exercised)
    o_zero, _ = kda_reference(q, k, v, g, beta, **common)
    assert rel_err(o_zero, o_kv) > 1e-3
    # with no tokens' worth of change (k=0, g=0): the final state is the initial one, in the call's layout
    zk = torch.zeros_like(k)
    _, s_id = kda_reference(
        q,
        zk,
        v,
        torch.zeros_like(g),
        beta,
        initial_state=h0.transpose(-1, -2),
        state_v_first=True,
        output_final_state=True,
    )
    assert torch.equal(s_id, h0.transpose(-1, -2))


def test_final_state_none_unless_requested(seed):
    q, k = torch.randn(1, 4, 1, 3), torch.randn(1, 4, 1, 3)
    o, s = kda_reference(q, k, torch.randn(1, 4, 1, 2), -torch.rand(1, 4, 1, 3), torch.rand(1, 4, 1))
    assert s is None and o.shape == (1, 4, 1, 2)


# ----------------------------------------------------------------------------------------------- (d) gates and transforms


def test_softplus_gate_hand_values():
    g = torch.zeros(1, 1, 1, 2, dtype=F64)
    out = softplus_gate(g, torch.zeros(1, dtype=F64), torch.zeros(2, dtype=F64))
    assert torch.allclose(out, torch.full_like(out, -math.log(2.0)), rtol=0, atol=1e-15)
    # A_log = log 2, dt_bias = 1, g = 0: -2 * log(1 + e)
    out = softplus_gate(g, torch.tensor([math.log(2.0)], dtype=F64), torch.ones(2, dtype=F64))
    assert torch.allclose(out, torch.full_like(out, -2.0 * math.log1p(math.e)), rtol=0, atol=1e-14)
    # g = 3, dt_bias = -1, A_log = 0: -log(1 + e^2); no dt_bias: -log(1 + e^3)
    g3 = torch.full((1, 1, 1, 2), 3.0, dtype=F64)
    out = softplus_gate(g3, torch.zeros(1, dtype=F64), -torch.ones(1, 2, dtype=F64))
    assert torch.allclose(out, torch.full_like(out, -math.log1p(math.exp(2.0))), rtol=0, atol=1e-14)
    out = softplus_gate(g3, torch.zeros(1, dtype=F64), None)
    assert torch.allclose(out, torch.full_like(out, -math.log1p(math.exp(3.0))), rtol=0, atol=1e-14)
    # large input: softplus(x) ~ x, no overflow
    big = softplus_gate(torch.full((1, 1, 1, 1), 200.0, dtype=F64), torch.zeros(1, dtype=F64))
    assert big.item() == pytest.approx(-200.0, rel=1e-14)


def test_softplus_gate_is_per_head():
    """A_log[h] and dt_bias[h] apply to value head h (dt_bias [HV*K] is head-major)."""
    HV, K = 3, 2
    g = torch.zeros(1, 1, HV, K, dtype=F64)
    A_log = torch.tensor([0.0, math.log(3.0), math.log(0.5)], dtype=F64)
    dt_bias = torch.tensor([0.0, 0.0, 1.0, 1.0, -2.0, 5.0], dtype=F64)
    out = softplus_gate(g, A_log, dt_bias)[0, 0]
    expected = torch.tensor(
        [
            [-math.log(2.0), -math.log(2.0)],
            [-3 * math.log1p(math.e), -3 * math.log1p(math.e)],
            [-0.5 * math.log1p(math.exp(-2.0)), -0.5 * math.log1p(math.exp(5.0))],
        ],
        dtype=F64,
    )
    assert torch.allclose(out, expected, rtol=0, atol=1e-14)
    out2 = softplus_gate(g, A_log, dt_bias.reshape(HV, K))[0, 0]
    assert torch.equal(out, out2)


def test_safe_gate_hand_values():
    g = torch.zeros(1, 1, 2, 3, dtype=F64)
    for lb in (-5.0, -0.01, -1.5):
        out = safe_gate(g, None, None, lb)
        assert torch.allclose(out, torch.full_like(out, lb / 2), rtol=0, atol=1e-15)
    # A_log = log 3, g = 1, dt_bias = -0.5 (head 0) and 0.5 (head 1): lb * sigmoid(3 * (g + dt_bias))
    A_log = torch.tensor([math.log(3.0), math.log(3.0)], dtype=F64)
    dt_bias = torch.tensor([[-0.5] * 3, [0.5] * 3], dtype=F64)
    out = safe_gate(torch.ones(1, 1, 2, 3, dtype=F64), A_log, dt_bias, -5.0)[0, 0]
    s = lambda x: 1.0 / (1.0 + math.exp(-x))  # noqa: E731
    assert torch.allclose(out[0], torch.full((3,), -5.0 * s(1.5), dtype=F64), rtol=0, atol=1e-14)
    assert torch.allclose(out[1], torch.full((3,), -5.0 * s(4.5), dtype=F64), rtol=0, atol=1e-14)
    # saturation: stays strictly inside (lower_bound, 0] and reaches the ends
    ext = safe_gate(torch.tensor([-100.0, 100.0], dtype=F64).reshape(1, 1, 1, 2), None, None, -5.0)
    assert ext[..., 0].item() == pytest.approx(0.0, abs=1e-40)
    assert ext[..., 1].item() == pytest.approx(-5.0, rel=1e-15)


def test_log_decay_dispatches_gate_modes():
    g = torch.full((1, 1, 1, 2), 0.7, dtype=F64)
    A_log = torch.zeros(1, dtype=F64)
    assert torch.equal(log_decay(g, use_gate_in_kernel=False, A_log=None, dt_bias=None, lower_bound=None), g)
    sp = log_decay(g, use_gate_in_kernel=True, A_log=A_log, dt_bias=None, lower_bound=None)
    assert torch.allclose(sp, torch.full_like(g, -math.log1p(math.exp(0.7))), rtol=0, atol=1e-15)
    sf = log_decay(g, use_gate_in_kernel=True, A_log=A_log, dt_bias=None, lower_bound=-2.0)
    assert torch.allclose(sf, torch.full_like(g, -2.0 / (1 + math.exp(-0.7))), rtol=0, atol=1e-15)


def test_gate_end_to_end_through_recurrence(seed):
    """With k = 0 the update is S_1 = exp(g) * S_0, so o_0 = scale * (exp(g) * S_0)^T q reveals the gate."""
    K, V = 3, 2
    q = torch.randn(1, 1, 1, K, dtype=F64)
    k = torch.zeros(1, 1, 1, K, dtype=F64)
    v = torch.randn(1, 1, 1, V, dtype=F64)
    beta = torch.rand(1, 1, 1, dtype=F64)
    h0 = torch.randn(1, 1, K, V, dtype=F64)
    g = torch.zeros(1, 1, 1, K, dtype=F64)
    scale = 0.3
    cases = [
        (
            dict(use_gate_in_kernel=True, A_log=torch.zeros(1, dtype=F64), dt_bias=torch.zeros(K, dtype=F64)),
            -math.log(2.0),
        ),
        (dict(use_gate_in_kernel=True, safe_gate=True, lower_bound=-5.0), -2.5),
        (dict(use_gate_in_kernel=True, safe_gate=True, lower_bound=-0.01, A_log=torch.zeros(1, dtype=F64)), -0.005),
    ]
    for kwargs, logd in cases:
        o, s = kda_reference(q, k, v, g, beta, scale=scale, initial_state=h0, output_final_state=True, **kwargs)
        expected_state = math.exp(logd) * h0
        assert torch.allclose(s, expected_state, rtol=1e-14, atol=0)
        assert torch.allclose(o[0, 0, 0], scale * expected_state[0, 0].T @ q[0, 0, 0], rtol=1e-13, atol=1e-15)


def test_l2norm_eps():
    x = torch.tensor([3.0, 4.0], dtype=F64)
    assert torch.allclose(l2norm(x), x / math.sqrt(25.0 + 1e-6), rtol=0, atol=1e-16)
    # at |x| ~ 1e-3 the eps of 1e-6 is visible: [1e-3, 0] -> [1/sqrt(2), 0]
    tiny = torch.tensor([1e-3, 0.0], dtype=F64)
    assert torch.allclose(l2norm(tiny), torch.tensor([1 / math.sqrt(2.0), 0.0], dtype=F64), rtol=1e-12, atol=0)
    assert torch.equal(l2norm(torch.zeros(4, dtype=F64)), torch.zeros(4, dtype=F64))  # no NaN at zero
    # over the last dimension only
    m = torch.tensor([[3.0, 4.0], [0.0, 2.0]], dtype=F64)
    expected = torch.tensor([[0.6, 0.8], [0.0, 1.0]], dtype=F64) * torch.tensor(
        [[5 / math.sqrt(25 + 1e-6)], [2 / math.sqrt(4 + 1e-6)]], dtype=F64
    )
    assert torch.allclose(l2norm(m), expected, rtol=1e-15, atol=0)


def test_l2norm_flag_in_reference(seed):
    """use_qk_l2norm_in_kernel equals pre-normalising q and k with eps 1e-6 (tiny q makes eps visible)."""
    B, T, H, K, V = 1, 6, 1, 4, 3
    q = torch.randn(B, T, H, K, dtype=F64) * 1e-3
    k = torch.randn(B, T, H, K, dtype=F64)
    v, g, beta = torch.randn(B, T, H, V, dtype=F64), -torch.rand(B, T, H, K, dtype=F64), torch.rand(B, T, H, dtype=F64)
    o_flag, _ = kda_reference(q, k, v, g, beta, use_qk_l2norm_in_kernel=True)
    o_pre, _ = kda_reference(my_l2norm(q), my_l2norm(k), v, g, beta)
    assert rel_err(o_flag, o_pre) < 1e-13
    unit = lambda x: x / x.norm(dim=-1, keepdim=True)  # noqa: E731  (no eps: visibly different for tiny q)
    o_noeps, _ = kda_reference(unit(q), unit(k), v, g, beta)
    assert rel_err(o_flag, o_noeps) > 1e-4


def test_beta_transform_hand_values():
    b = torch.tensor([0.0, 2.0, -1.0], dtype=F64)
    sig = torch.tensor([0.5, 1 / (1 + math.exp(-2.0)), 1 / (1 + math.e)], dtype=F64)
    assert torch.equal(beta_transform(b, sigmoid=False, allow_neg_eigval=False), b)
    assert torch.allclose(beta_transform(b, sigmoid=True, allow_neg_eigval=False), sig, rtol=0, atol=1e-16)
    assert torch.allclose(beta_transform(b, sigmoid=True, allow_neg_eigval=True), 2 * sig, rtol=0, atol=1e-15)


def test_beta_flags_in_reference(seed):
    """Through the recurrence: t=0 output of a zero state is scale * beta' (q.k) v, beta' transformed."""
    K, V = 4, 3
    q, k, v = torch.randn(1, 1, 1, K, dtype=F64), torch.randn(1, 1, 1, K, dtype=F64), torch.randn(1, 1, 1, V, dtype=F64)
    g = -torch.rand(1, 1, 1, K, dtype=F64)
    raw = torch.tensor([[[0.8]]], dtype=F64)
    qk = (q[0, 0, 0] @ k[0, 0, 0]).item()
    for flags, b in [
        ({}, 0.8),
        ({"use_beta_sigmoid_in_kernel": True}, 1 / (1 + math.exp(-0.8))),
        ({"use_beta_sigmoid_in_kernel": True, "allow_neg_eigval": True}, 2 / (1 + math.exp(-0.8))),
    ]:
        o, _ = kda_reference(q, k, v, g, raw, scale=1.0, **flags)
        assert torch.allclose(o[0, 0, 0], b * qk * v[0, 0, 0], rtol=1e-14, atol=1e-15)


# ----------------------------------------------------------------------------------------------- (e) scale, read after update


@pytest.mark.parametrize("K", [4, 9, 16])
def test_default_scale_and_output_read_after_update(K, seed):
    V = 3
    q, k = torch.randn(1, 3, 1, K, dtype=F64), torch.randn(1, 3, 1, K, dtype=F64)
    v, g = torch.randn(1, 3, 1, V, dtype=F64), -torch.rand(1, 3, 1, K, dtype=F64)
    beta = torch.rand(1, 3, 1, dtype=F64) + 0.1
    o, _ = kda_reference(q, k, v, g, beta)
    expected = K**-0.5 * beta[0, 0, 0] * (q[0, 0, 0] @ k[0, 0, 0]) * v[0, 0, 0]
    assert torch.allclose(o[0, 0, 0], expected, rtol=1e-13, atol=1e-15)
    # an explicit scale replaces the default, linearly
    o2, _ = kda_reference(q, k, v, g, beta, scale=2.5)
    assert torch.allclose(o2, o * (2.5 * K**0.5), rtol=1e-13, atol=1e-15)
    # t = 1 by hand, with the explicit update
    S1 = beta[0, 0, 0] * torch.outer(k[0, 0, 0], v[0, 0, 0])
    k1, b1 = k[0, 1, 0], beta[0, 1, 0]
    S2 = (torch.eye(K, dtype=F64) - b1 * torch.outer(k1, k1)) @ torch.diag(g[0, 1, 0].exp()) @ S1 + b1 * torch.outer(
        k1, v[0, 1, 0]
    )
    assert torch.allclose(o[0, 1, 0], K**-0.5 * S2.T @ q[0, 1, 0], rtol=1e-12, atol=1e-14)


# ----------------------------------------------------------------------------------------------- (f) varlen


@pytest.mark.parametrize("index_dtype", [torch.int32, torch.int64])
def test_varlen_empty_sequence_passes_state_through(index_dtype, seed):
    H, K, V = 2, 4, 3
    lens = [5, 0, 1, 7, 0]
    T = sum(lens)
    bounds = [0]
    for n in lens:
        bounds.append(bounds[-1] + n)
    cu = torch.tensor(bounds, dtype=index_dtype)
    q, k = torch.randn(1, T, H, K, dtype=F64), torch.randn(1, T, H, K, dtype=F64)
    v, g = torch.randn(1, T, H, V, dtype=F64), -torch.rand(1, T, H, K, dtype=F64)
    beta = torch.rand(1, T, H, dtype=F64)
    h0 = torch.randn(len(lens), H, K, V, dtype=F64)
    common = dict(output_final_state=True, use_qk_l2norm_in_kernel=True)
    o, s = kda_reference(q, k, v, g, beta, initial_state=h0, cu_seqlens=cu, **common)
    assert o.shape == (1, T, H, V) and s.shape == (len(lens), H, K, V)
    for n in (1, 4):  # the empty ones
        assert torch.equal(s[n], h0[n])
    for n, length in enumerate(lens):  # the others: each sequence run alone
        if length == 0:
            continue
        span = slice(bounds[n], bounds[n + 1])
        o_n, s_n = kda_reference(
            q[:, span], k[:, span], v[:, span], g[:, span], beta[:, span], initial_state=h0[n : n + 1], **common
        )
        assert torch.equal(o[:, span], o_n)
        assert torch.equal(s[n : n + 1], s_n)
        assert not torch.allclose(s_n[0], h0[n])  # a non-empty sequence does change its state
    # without an initial state, an empty sequence ends at zero
    _, s0 = kda_reference(q, k, v, g, beta, cu_seqlens=cu, **common)
    assert torch.equal(s0[1], torch.zeros(H, K, V, dtype=F64)) and torch.equal(s0[4], torch.zeros(H, K, V, dtype=F64))
    assert s0[0].abs().sum() > 0


# ----------------------------------------------------------------------------------------------- (e) resets


@pytest.mark.parametrize("value", [-math.inf, -1e30, torch.finfo(torch.float32).min], ids=["-inf", "-1e30", "fp32-min"])
def test_a_full_reset_is_exact(value, seed):
    """A log decay of -inf (or far below exp's range) at token t zeroes the state before t's update, exactly:
    exp(-inf) = 0 and nothing forms -inf - -inf. Outputs from t on equal the recurrence restarted at t from a
    zero state, nothing is NaN, and every gradient is finite (the one at the reset itself 0)."""
    B, T, H, K, V, t = 1, 12, 2, 4, 3, 5
    q, k = torch.randn(B, T, H, K, dtype=F64), torch.randn(B, T, H, K, dtype=F64)
    k = k / k.norm(dim=-1, keepdim=True)
    v, beta = torch.randn(B, T, H, V, dtype=F64), torch.rand(B, T, H, dtype=F64)
    g = -torch.rand(B, T, H, K, dtype=F64)
    g[:, t] = value
    h0 = torch.randn(B, H, K, V, dtype=F64)
    leaves = [x.clone().requires_grad_(True) for x in (q, k, v, g, beta, h0)]
    o, s = kda_reference(*leaves[:5], initial_state=leaves[5], output_final_state=True)
    restarted, s_restarted = kda_reference(q[:, t:], k[:, t:], v[:, t:], g[:, t:], beta[:, t:], output_final_state=True)
    assert torch.isfinite(o).all() and torch.isfinite(s).all()
    assert torch.equal(o[:, t:], restarted) and torch.equal(s, s_restarted)
    grads = torch.autograd.grad([o, s], leaves, [torch.randn_like(o), torch.randn_like(s)])
    assert all(torch.isfinite(d).all() for d in grads)
    assert torch.equal(grads[3][:, t], torch.zeros_like(grads[3][:, t]))


def test_a_saturated_softplus_gate_is_a_reset(seed):
    """g + dt_bias = 1e30 makes the softplus gate's log decay -exp(A_log) 1e30: exp of it is 0, a reset, with
    finite gradients for A_log and dt_bias."""
    B, T, H, K, V, t = 1, 9, 1, 4, 3, 4
    q, k, v = torch.randn(B, T, H, K, dtype=F64), torch.randn(B, T, H, K, dtype=F64), torch.randn(B, T, H, V, dtype=F64)
    beta, g = torch.rand(B, T, H, dtype=F64), torch.randn(B, T, H, K, dtype=F64)
    g[:, t] = 1e30
    A_log = torch.rand(H, dtype=F64).requires_grad_(True)
    dt_bias = torch.randn(H * K, dtype=F64).requires_grad_(True)
    o, _ = kda_reference(q, k, v, g, beta, use_gate_in_kernel=True, A_log=A_log, dt_bias=dt_bias)
    restarted, _ = kda_reference(
        q[:, t:], k[:, t:], v[:, t:], g[:, t:], beta[:, t:], use_gate_in_kernel=True, A_log=A_log, dt_bias=dt_bias
    )
    assert torch.isfinite(o).all() and torch.equal(o[:, t:], restarted)
    grads = torch.autograd.grad(o, [A_log, dt_bias], torch.randn_like(o))
    assert all(torch.isfinite(d).all() for d in grads)
