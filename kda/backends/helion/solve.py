"""Stage 3: the WY transform of each chunk: the inverse ``T`` and the rows the state pass needs.

With ``M`` from stage 2 (strictly lower) and ``A_kk = diag(beta) M``::

    T   = (I + A_kk)^-1                         [C, C]   unit lower triangular
    w   = T @ (beta * k * exp(G))               [C, K]
    u   = T @ (beta * v)                        [C, V]

so that the chunk's new values are ``u - w @ S`` for the state ``S`` entering it (stage 4). ``k`` is the
row as given, times its l2norm's ``r`` with L2. At inference (``STORED``) it also stores the state
update's operand::

    k_g = k * exp(G_last - G)                   [C, K]   (G_last: the chunk's last row; exponents <= 0)

which in training the state pass and the backward make from ``k`` and ``G`` themselves
(`kda/backends/helion/forward.py` says why).

The inverse is the Neumann series of the nilpotent ``N = -A_kk`` (``N^C = 0``), summed by doubling::

    T_1 = I + N,   P_1 = N;    P_{m+1} = P_m @ P_m,   T_{m+1} = T_m + P_{m+1} @ T_m
    T_m = sum_{n < 2^m} N^n,   so T_{log2 C} = T

``log2(C) - 1`` rounds of two ``[C, C]`` products: tensor-core work, no serial row-by-row substitution.
``T`` is stored (fp32) when training: the backward needs it.

Grid ``(NT, HV)``; ``K`` and ``V`` in config-sized blocks. Outputs chunk-major in the storage dtype; rows
past the sequence's end are zero (``beta = 0`` there, and ``k``, ``v`` load as zeros).
"""

from __future__ import annotations

import helion.language as hl
import torch


def solve_kernel(
    k: torch.Tensor,  # [tokens, H, K] as given
    rstd_k: torch.Tensor,  # [tokens, H] fp32 with L2, else a placeholder
    v: torch.Tensor,  # [tokens, HV, V]
    G: torch.Tensor,  # [NT, HV, C, K] fp32
    beta: torch.Tensor,  # [NT, HV, C] fp32
    chunk_starts: torch.Tensor,  # [NT] int32
    chunk_seq_ends: torch.Tensor,  # [NT] int32
    M: torch.Tensor,  # [NT, HV, C, C] fp32
    T_out: torch.Tensor,  # [NT, HV, C, C] fp32 out when SAVE_T (else a placeholder)
    w: torch.Tensor,  # [NT, HV, C, K] out
    u: torch.Tensor,  # [NT, HV, C, V] out
    k_g: torch.Tensor,  # [NT, HV, C, K] out with STORED (else a placeholder)
    group: int,
    C: hl.constexpr,
    LOG2_C: hl.constexpr,
    SAVE_T: hl.constexpr,
    L2: hl.constexpr,
    STORED: hl.constexpr,  # k_g stored (inference)
) -> None:
    NT = G.size(0)
    HV = G.size(1)
    K = G.size(3)
    V = v.size(2)
    for tile_c, tile_hv in hl.tile([NT, HV], block_size=[1, 1]):
        c = tile_c.begin
        hv = tile_hv.begin
        h = hv // group
        start = chunk_starts[c]
        idx = hl.arange(C)
        rows = start + idx
        valid = rows < chunk_seq_ends[c]
        b = beta[c, hv, :]  # [C]
        N = -(b[:, None] * M[c, hv, :, :])  # [C, C]
        eye = (idx[:, None] == idx[None, :]).to(torch.float32)
        T = eye + N
        P = N
        for _ in hl.static_range(LOG2_C - 1):
            P = hl.dot(P, P)
            T = hl.dot(P, T, acc=T)
        if SAVE_T:
            T_out[c, hv, :, :] = T
        if L2:
            r = hl.load(rstd_k, [rows, h], extra_mask=valid)  # [C] the l2norm's scale of each row of k
        for tile_k in hl.tile(K):
            k_i = hl.load(k, [rows, h, tile_k], extra_mask=valid[:, None]).to(torch.float32)
            if L2:
                k_i = k_i * r[:, None]
            G_i = G[c, hv, :, tile_k]  # [C, BK]
            w[c, hv, :, tile_k] = hl.dot(T, b[:, None] * k_i * torch.exp(G_i)).to(w.dtype)
            if STORED:
                G_last = G[c, hv, C - 1, tile_k]  # [BK]
                k_g[c, hv, :, tile_k] = (k_i * torch.exp(G_last[None, :] - G_i)).to(k_g.dtype)
        for tile_v in hl.tile(V):
            v_i = hl.load(v, [rows, hv, tile_v], extra_mask=valid[:, None]).to(torch.float32)
            u[c, hv, :, tile_v] = hl.dot(T, b[:, None] * v_i).to(u.dtype)
