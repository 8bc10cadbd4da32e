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

The inverse, with ``N = -A_kk`` (strictly lower), split into its ``[16, 16]`` diagonal blocks ``N_d`` and
the rest ``N_o`` (``I - N = (I - N_d) - N_o``), by products only, and never from large powers:

    X = (I - N_d)^-1         per diagonal block: the Neumann series of the nilpotent block (``N_d^16 = 0``)
                             summed by doubling, ``X = (I + N_d)(I + N_d^2)(I + N_d^4)(I + N_d^8)``, then
                             one Newton step ``X + X (I - (I - N_d) X)``
    T = X;  for each block row I = 1, 2, ...:   T[I] += X[I] (N_o T)[I]      block forward substitution

The substitution's products involve only ``T``-sized values. A Neumann series over the whole chunk
(``sum_{m < C} N^m`` by doubling, which this stage computed before) does not: where the keys of a head
share a direction and its gate barely decays (``A_kk`` near ``beta`` below its whole diagonal), the powers
reach ``beta^m C(C - 2, m - 1)``, about 1e17 at C = 64, and their sum cancels to nothing in fp32 (the
verifier's ``correlated`` regime: o 7e16 times its size, or inf). Inside a 16-block the powers reach
``C(14, 7) beta^8`` (3432 at beta = 1) and the Newton step takes the error of their sum back to that of
one fp32 product; this is the triton backend's diagonal-block inverse. So that the sum's error starts at
fp32's and not TF32's (whose 3432 x 2^-11 is past what a Newton step repairs), this stage's products
are never single TF32 (`forward.solve_precision`). Eight products for the diagonal blocks (on ``[C, C]``,
the blocks off the diagonal zero), two per block row after the first: 14 at C = 64, 10 at C = 32.
``T`` is stored (fp32) when training: the backward needs it.

Grid ``(NT, HV)``; ``K`` and ``V`` in config-sized blocks. Outputs chunk-major in the storage dtype; rows
past the sequence's end are zero (``beta = 0`` there, and ``k``, ``v`` load as zeros). Training on 16-bit
inputs (``HALVES``) ``w`` is stored as bf16 halves ``[NT, HV, 2, C, K]`` (``hi = bf16(w)``, ``lo = bf16(w -
hi)``), the operands of both serial passes' products (`state`, `state_backward`).
"""

from __future__ import annotations

import helion.language as hl
import torch

from kda.backends.helion.halves import split

SUB = 16  # rows of a diagonal block


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
    w: torch.Tensor,  # [NT, HV, C, K] out; [NT, HV, 2, C, K] bf16 with HALVES
    u: torch.Tensor,  # [NT, HV, C, V] out
    k_g: torch.Tensor,  # [NT, HV, C, K] out with STORED (else a placeholder)
    group: int,
    C: hl.constexpr,
    BLOCKS: hl.constexpr,  # C // SUB
    SAVE_T: hl.constexpr,
    L2: hl.constexpr,
    STORED: hl.constexpr,  # k_g stored (inference)
    HALVES: hl.constexpr,  # w stored as bf16 halves (training on 16-bit inputs)
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
        N = -(b[:, None] * M[c, hv, :, :])  # [C, C] strictly lower
        eye = (idx[:, None] == idx[None, :]).to(torch.float32)
        block_of = idx // SUB
        N_d = torch.where(block_of[:, None] == block_of[None, :], N, 0.0)  # [C, C] its diagonal blocks
        N_o = N - N_d
        X = eye + N_d  # (I - N_d)^-1, block by block
        P = N_d
        for _ in hl.static_range(3):  # N_d^2, N_d^4, N_d^8 (N_d^16 = 0); a literal: Helion wants a constant
            P = hl.dot(P, P)
            X = hl.dot(P, X, acc=X)
        residual = eye - X + hl.dot(N_d, X)  # I - (I - N_d) X
        X = hl.dot(X, residual, acc=X)
        T = X
        for block in hl.static_range(1, BLOCKS):  # block row `block` from the rows above it, final by now
            carried = torch.where((block_of == block)[:, None], hl.dot(N_o, T), 0.0)
            T = hl.dot(X, carried, acc=T)
        if SAVE_T:
            T_out[c, hv, :, :] = T
        if L2:
            r = hl.load(rstd_k, [rows, h], extra_mask=valid)  # [C] the l2norm's scale of each row of k
        for tile_k in hl.tile(K):
            k_i = hl.load(k, [rows, h, tile_k], extra_mask=valid[:, None]).to(torch.float32)
            if L2:
                k_i = k_i * r[:, None]
            G_i = G[c, hv, :, tile_k]  # [C, BK]
            if HALVES:
                w_k = hl.dot(T, b[:, None] * k_i * torch.exp(G_i))  # [C, BK]
                w_hi, w_lo = split(w_k)
                w[c, hv, 0, :, tile_k] = w_hi
                w[c, hv, 1, :, tile_k] = w_lo
            else:
                w[c, hv, :, tile_k] = hl.dot(T, b[:, None] * k_i * torch.exp(G_i)).to(w.dtype)
            if STORED:
                G_last = G[c, hv, C - 1, tile_k]  # [BK]
                k_g[c, hv, :, tile_k] = (k_i * torch.exp(G_last[None, :] - G_i)).to(k_g.dtype)
        for tile_v in hl.tile(V):
            v_i = hl.load(v, [rows, hv, tile_v], extra_mask=valid[:, None]).to(torch.float32)
            u[c, hv, :, tile_v] = hl.dot(T, b[:, None] * v_i).to(u.dtype)
