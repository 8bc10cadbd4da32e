"""Backward stage 4: the elementwise tails, from the chunked math's gradients back to the inputs as given.

`gate_tail_kernel`, per chunk and value head (``dG`` of the cumulative log decay, ``a`` the activated
per-token log decay, ``z = g + dt_bias[hv]``, ``A = exp(A_log[hv])``)::

    da_t = sum_{s >= t in chunk} dG_s                       (the reverse cumulative sum)
    safe / sigmoid   a = lb sigmoid(A z):    da/dz = lb A s'(A z),   da/dA_log = z da/dz
    softplus         a = -A softplus(z):     da/dz = -A sigmoid(z),  da/dA_log = a
    pre-gated        dg = da
    (all but safe: 0 where a < LOG_DECAY_FLOOR, which the forward computed as the floor)
    dg = da da/dz          dA_log's per-row part = sum_c da da/dA_log
    dbeta = dbeta^ s (1 - s), times 2 with allow_neg_eigval   (s = sigmoid(beta); the in-kernel sigmoid)

``dg`` is written in fp32; the host sums it over tokens for ``ddt_bias`` and the per-row parts for
``dA_log`` (torch sums: a fixed order, no atomics).

`qk_tail_kernel`, per chunk and q/k head: the value heads of the GVA group summed, then with the
in-kernel l2norm (``r = 1 / sqrt(|x|^2 + eps)`` from the forward's stage 0, ``x^ = r x``)::

    dx = r (dx^ - x^ (x^ . dx^))

Grids ``(NT, HV)`` and ``(NT, H)``.
"""

from __future__ import annotations

import helion.language as hl
import torch

from kda.reference import LOG_DECAY_FLOOR


def gate_tail_kernel(
    g: torch.Tensor,  # [tokens, HV, K] raw gate input
    beta: torch.Tensor,  # [tokens, HV] beta as given
    A_log: torch.Tensor,  # [HV] (zeros without one)
    dt_bias: torch.Tensor,  # [HV, K] (a placeholder without one)
    dG_c: torch.Tensor,  # [NT, HV, C, K] fp32
    dbeta_c: torch.Tensor,  # [NT, HV, C] fp32 (of the activated beta)
    chunk_starts: torch.Tensor,  # [NT] int32
    chunk_seq_ends: torch.Tensor,  # [NT] int32
    dg: torch.Tensor,  # [tokens, HV, K] fp32 out
    dbeta: torch.Tensor,  # [tokens, HV] out
    dA_rows: torch.Tensor,  # [NT, HV, C] fp32 out
    lower_bound: float,
    beta_scale: float,
    C: hl.constexpr,
    GATE: hl.constexpr,  # gate.PREGATED, SOFTPLUS, SIGMOID, SAFE: 0, 1, 2, 3
    HAS_DT_BIAS: hl.constexpr,
    BETA_SIGMOID: hl.constexpr,
) -> None:
    NT = dG_c.size(0)
    HV = dG_c.size(1)
    K = dG_c.size(3)
    for tile_c, tile_hv in hl.tile([NT, HV], block_size=[1, 1]):
        c = tile_c.begin
        hv = tile_hv.begin
        rows = chunk_starts[c] + hl.arange(C)
        valid = rows < chunk_seq_ends[c]
        db = dbeta_c[c, hv, :]
        if BETA_SIGMOID:
            s = torch.sigmoid(hl.load(beta, [rows, hv], extra_mask=valid).to(torch.float32))
            db = db * (beta_scale * s * (1.0 - s))
        hl.store(dbeta, [rows, hv], db.to(dbeta.dtype), extra_mask=valid)
        A = torch.exp(A_log[hv].to(torch.float32))
        dA = hl.zeros([C], dtype=torch.float32)
        for tile_k in hl.tile(K):
            da = hl.cumsum(dG_c[c, hv, :, tile_k], 0, reverse=True)  # [C, BK]
            x = hl.load(g, [rows, hv, tile_k], extra_mask=valid[:, None]).to(torch.float32)
            if GATE == 0:  # pre-gated: a = g
                dz = torch.where(x < LOG_DECAY_FLOOR, 0.0, da)
            else:
                if HAS_DT_BIAS:
                    x = x + dt_bias[hv, tile_k].to(torch.float32)[None, :]
                if GATE == 1:  # softplus
                    a = -A * torch.where(x > 20.0, x, torch.log1p(torch.exp(torch.clamp(x, max=20.0))))
                    dz = torch.where(a < LOG_DECAY_FLOOR, 0.0, da * (-A * torch.sigmoid(x)))
                    dA = dA + torch.sum(torch.where(a < LOG_DECAY_FLOOR, 0.0, da * a), dim=1)
                else:
                    sg = torch.sigmoid(A * x)
                    a = lower_bound * sg
                    dadz = lower_bound * A * sg * (1.0 - sg)
                    if GATE == 2:  # sigmoid (not safe): floored like the others
                        dadz = torch.where(a < LOG_DECAY_FLOOR, 0.0, dadz)
                    dz = da * dadz
                    dA = dA + torch.sum(dz * x, dim=1)
            hl.store(dg, [rows, hv, tile_k], dz, extra_mask=valid[:, None])
        dA_rows[c, hv, :] = torch.where(valid, dA, 0.0)


def qk_tail_kernel(
    x: torch.Tensor,  # [tokens, H, K] as given
    rstd: torch.Tensor,  # [tokens, H] fp32 (a placeholder without L2)
    dx_c: torch.Tensor,  # [NT, HV, C, K] fp32 per value head
    chunk_starts: torch.Tensor,  # [NT] int32
    chunk_seq_ends: torch.Tensor,  # [NT] int32
    dx: torch.Tensor,  # [tokens, H, K] out
    group: int,
    C: hl.constexpr,
    L2: hl.constexpr,
) -> None:
    NT = dx_c.size(0)
    H = x.size(1)
    K = hl.specialize(x.size(2))
    for tile_c, tile_h in hl.tile([NT, H], block_size=[1, 1]):
        c = tile_c.begin
        head = tile_h.begin
        rows = chunk_starts[c] + hl.arange(C)
        valid = rows < chunk_seq_ends[c]
        total = hl.zeros([C, K], dtype=torch.float32)
        for member in hl.grid(group):
            total = total + dx_c[c, head * group + member, :, :]
        if L2:
            r = hl.load(rstd, [rows, head], extra_mask=valid)
            xh = r[:, None] * hl.load(x, [rows, head, hl.arange(K)], extra_mask=valid[:, None]).to(torch.float32)
            total = r[:, None] * (total - xh * torch.sum(xh * total, dim=1)[:, None])
        hl.store(dx, [rows, head, hl.arange(K)], total.to(dx.dtype), extra_mask=valid[:, None])
