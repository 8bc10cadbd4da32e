"""The backward's elementwise tails, fused: the per-chunk kernel's gradients taken back through the
transforms the forward applies before its chunked math (`kda.reference`: l2norm, the beta activation, the
gate), and the value heads of a GVA group summed into their q/k head.

Per token and q/k head ``h`` (``dq^``, ``dk^``: the per-chunk kernel's gradients with respect to the
normalized rows, summed over the value heads of ``h``'s group)::

    dq = r (dq^ - q^ (q^ . dq^))        r = 1 / sqrt(|q|^2 + eps), q^ = r q         (l2norm in kernel)
    dq = dq^                                                                         (otherwise)

and ``dk`` likewise. Per token and value head ``hv``, with ``z = g + dt_bias[hv]`` and ``A = exp(A_log[hv])``
(1 without ``A_log``)::

    dbeta = dbeta^ s (1 - s), times 2 with allow_neg_eigval      s = sigmoid(beta)   (beta sigmoid in kernel)
    safe gate      a = lb sigmoid(A z):   da/dz = lb A s'(A z),     da/dA_log = z da/dz
    softplus gate  a = -A softplus(z):    da/dz = -A sigmoid(z),    da/dA_log = a
    pre-gated      dg = da
    (softplus and pre-gated: both derivatives 0 where a < LOG_DECAY_FLOOR, which the forward's `gate` computes
    as the floor)
    dg = da da/dz,   ddt_bias[hv, c] = sum_t dg[t, hv, c],   dA_log[hv] = sum_{t, c} da da/dA_log

(``s'(x) = s(x) (1 - s(x))``.) Until now these ran as autograd over `kda.reference`'s definitions: some
forty torch kernels, 1.8 ms of a 12.2 ms training step at B4_T2048_H16_D128 on the H200. The two sums
over tokens are written as per-block partial sums and added in torch: a fixed order, no atomics.

Grids ``(token blocks, H)`` for q/k and ``(token blocks, HV)`` for the rest.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kda.backends.triton.gate import FLOOR, PREGATED, SAFE, SIGMOID, SOFTPLUS
from kda.backends.triton.tiles import padded_dim
from kda.spec import GateMode

_SAFE = tl.constexpr(SAFE)
_SOFTPLUS = tl.constexpr(SOFTPLUS)
_SIGMOID = tl.constexpr(SIGMOID)
ROWS = 32  # tokens per program


@triton.jit
def qk_tail_kernel(
    x,  # [tokens, H, K] q or k as given
    dx_heads,  # [tokens, HV, K] fp32: the gradient of the normalized rows, per value head
    dx,  # [tokens, H, K] out, in x's dtype
    tokens,
    H: tl.constexpr,
    HV: tl.constexpr,
    K: tl.constexpr,
    L2: tl.constexpr,
    BR: tl.constexpr,
    BK: tl.constexpr,
):
    i_t, i_h = tl.program_id(0), tl.program_id(1)
    group: tl.constexpr = HV // H
    rows = i_t * BR + tl.arange(0, BR)
    cols = tl.arange(0, BK)
    mask = (rows[:, None] < tokens) & (cols[None, :] < K)
    dy = tl.zeros([BR, BK], dtype=tl.float32)
    for j in tl.static_range(group):  # the group's value heads, summed into their q/k head
        dy += tl.load(
            dx_heads + rows[:, None].to(tl.int64) * (HV * K) + (i_h * group + j) * K + cols[None, :],
            mask=mask,
            other=0.0,
        )
    offsets = rows[:, None].to(tl.int64) * (H * K) + i_h * K + cols[None, :]
    if L2:
        xr = tl.load(x + offsets, mask=mask, other=0.0).to(tl.float32)
        r = tl.rsqrt(tl.sum(xr * xr, axis=1) + 1e-6)  # eps as kda.reference.l2norm
        x_hat = xr * r[:, None]
        dy = r[:, None] * (dy - x_hat * tl.sum(x_hat * dy, axis=1)[:, None])
    tl.store(dx + offsets, dy.to(dx.dtype.element_ty), mask=mask)


@triton.jit
def gate_beta_tail_kernel(
    g,  # [tokens, HV, K] the gate input as given
    da,  # [tokens, HV, K] fp32: the gradient of the per-token log decay
    A_log,
    dt_bias,  # [HV], [HV * K] fp32 (or dummies)
    dg,  # [tokens, HV, K] out, in g's dtype
    dA_log_parts,  # [blocks, HV] fp32 out: this block's share of dA_log
    ddt_parts,  # [blocks, HV, K] fp32 out: this block's share of ddt_bias
    beta,
    dbeta_heads,
    dbeta,  # [tokens, HV]: as given, the gradient after the activation (fp32), out
    tokens,
    lower_bound,
    HV: tl.constexpr,
    K: tl.constexpr,
    GATE: tl.constexpr,
    HAS_A_LOG: tl.constexpr,
    HAS_DT_BIAS: tl.constexpr,
    SIGMOID: tl.constexpr,
    TWO: tl.constexpr,
    BR: tl.constexpr,
    BK: tl.constexpr,
):
    i_t, i_hv = tl.program_id(0), tl.program_id(1)
    rows = i_t * BR + tl.arange(0, BR)
    cols = tl.arange(0, BK)
    valid = rows < tokens
    mask = valid[:, None] & (cols[None, :] < K)
    offsets = rows[:, None].to(tl.int64) * (HV * K) + i_hv * K + cols[None, :]
    d = tl.load(da + offsets, mask=mask, other=0.0)
    # Triton's compiler takes no `in` (UnsupportedLanguageConstruct); the interpreter does, so only aot sees it
    if GATE == _SAFE or GATE == _SOFTPLUS or GATE == _SIGMOID:
        z = tl.load(g + offsets, mask=mask, other=0.0).to(tl.float32)
        if HAS_DT_BIAS:
            z += tl.load(dt_bias + i_hv * K + cols, mask=cols < K, other=0.0)[None, :]
        A = 1.0
        if HAS_A_LOG:
            A = tl.exp(tl.load(A_log + i_hv))
        if GATE == _SAFE or GATE == _SIGMOID:
            s = tl.sigmoid(A * z)
            slope = lower_bound * A * s * (1.0 - s)  # da/dz
            per_A_log = z * slope  # da/dA_log = A z lb s'(A z)
            if GATE == _SIGMOID:  # a bound below the floor: the forward computed the floor there, a constant
                floored = lower_bound * s < FLOOR
                slope = tl.where(floored, 0.0, slope)
                per_A_log = tl.where(floored, 0.0, per_A_log)
        else:
            a = -A * tl.where(z > 20.0, z, tl.log(1.0 + tl.exp(tl.minimum(z, 20.0))))
            floored = a < FLOOR  # the forward computed the floor: a constant
            slope = tl.where(floored, 0.0, -A * tl.sigmoid(z))
            per_A_log = tl.where(floored, 0.0, a)  # a itself
        d_z = tl.where(mask, d * slope, 0.0)
        tl.store(dg + offsets, d_z.to(dg.dtype.element_ty), mask=mask)
        if HAS_DT_BIAS:
            tl.store(ddt_parts + (i_t * HV + i_hv) * K + cols, tl.sum(d_z, axis=0), mask=cols < K)
        if HAS_A_LOG:
            tl.store(dA_log_parts + i_t * HV + i_hv, tl.sum(tl.sum(tl.where(mask, d * per_A_log, 0.0), axis=1), axis=0))
    else:  # pre-gated: the log decay as given, 0 below the floor (as the forward's `gate` computed it)
        a = tl.load(g + offsets, mask=mask, other=0.0).to(tl.float32)
        tl.store(dg + offsets, tl.where(a < FLOOR, 0.0, d).to(dg.dtype.element_ty), mask=mask)
    b_off = rows.to(tl.int64) * HV + i_hv
    db = tl.load(dbeta_heads + b_off, mask=valid, other=0.0)
    if SIGMOID:
        s_b = tl.sigmoid(tl.load(beta + b_off, mask=valid, other=0.0).to(tl.float32))
        db = db * s_b * (1.0 - s_b)
        if TWO:
            db = 2.0 * db
    tl.store(dbeta + b_off, db.to(dbeta.dtype.element_ty), mask=valid)


def fused_tails(inputs, spec, dq_heads, dk_heads, da, dbeta_heads):
    """``(dq, dk, dg, dbeta, dA_log, ddt_bias)`` for the inputs as given (see the module docstring); ``None``
    for an input that is absent."""
    B, T, H, HV, K = spec.B, spec.T, spec.H, spec.HV, spec.K
    tokens = B * T
    blocks = triton.cdiv(tokens, ROWS)
    BK = padded_dim(K)
    q, k, g, beta = (t.contiguous() for t in (inputs.q, inputs.k, inputs.g, inputs.beta))
    dq, dk = torch.empty_like(q), torch.empty_like(k)
    L2 = spec.use_qk_l2norm_in_kernel
    for x, heads, out in ((q, dq_heads, dq), (k, dk_heads, dk)):
        qk_tail_kernel[(blocks, H)](x, heads, out, tokens, H=H, HV=HV, K=K, L2=L2, BR=ROWS, BK=BK)
    gate = {GateMode.PREGATED: PREGATED, GateMode.SOFTPLUS: SOFTPLUS, GateMode.SIGMOID: SIGMOID, GateMode.SAFE: SAFE}[
        spec.gate_mode
    ]
    A_log, dt_bias = inputs.A_log, inputs.dt_bias
    has_a, has_dt = gate != PREGATED and A_log is not None, gate != PREGATED and dt_bias is not None
    dg, dbeta = torch.empty_like(g), torch.empty_like(beta)
    f32 = torch.float32
    dA_log_parts = torch.empty(blocks, HV, dtype=f32, device=q.device) if has_a else da
    ddt_parts = torch.empty(blocks, HV, K, dtype=f32, device=q.device) if has_dt else da
    gate_beta_tail_kernel[(blocks, HV)](
        g,
        da,
        A_log.contiguous().to(f32) if has_a else da,
        dt_bias.reshape(-1).contiguous().to(f32) if has_dt else da,
        dg,
        dA_log_parts,
        ddt_parts,
        beta,
        dbeta_heads,
        dbeta,
        tokens,
        float(spec.lower_bound or 0.0),
        HV=HV,
        K=K,
        GATE=gate,
        HAS_A_LOG=has_a,
        HAS_DT_BIAS=has_dt,
        SIGMOID=spec.use_beta_sigmoid_in_kernel,
        TWO=spec.allow_neg_eigval,
        BR=ROWS,
        BK=BK,
    )
    dA_log = dA_log_parts.sum(0).to(A_log.dtype) if has_a else None
    ddt_bias = ddt_parts.sum(0).reshape(dt_bias.shape).to(dt_bias.dtype) if has_dt else None
    return dq, dk, dg, dbeta, dA_log, ddt_bias
