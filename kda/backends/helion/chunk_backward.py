"""Backward stage 2: per chunk, the gradients of the state products and of the WY transform.

With ``dh`` (of the state leaving the chunk) and ``dv_new`` from `state_backward`, ``h`` the state
entering the chunk, ``X = beta k exp(G)`` and ``Y = beta v`` (so ``w = T X``, ``u = T Y``)::

    dq_e = do h^T       dw = -dv_new h^T       dk_g = v_new dh^T                   [C, K]
    dA_qk = do v_new^T (causal)                dT = dw X^T + dv_new Y^T            [C, C]
    dX = T^T dw         dY = T^T dv_new        dA_kk = -T^T dT T^T (strictly lower)
    dv = beta dY                                                   (final: v enters nowhere else)
    dbeta = sum_v dY v + sum_c dX k exp(G) + sum_j dA_kk M         (M = A_kk / beta, kept by the forward)

then, on the normalized rows and the cumulative log decay, everything but the score matrices' part::

    dq  = scale exp(G) dq_e
    dk  = beta exp(G) dX + exp(G_last - G) dk_g
    dG  = dX X + q_e dq_e - k_g dk_g,  and on the last row also  sum_i k_g dk_g + exp(G_last) sum_v dh h

(``G_last`` is the sum of every row's log decay, so its gradient reaches them all through the reverse
cumulative sum of the tails.) The score matrices' gradients go to `score_backward` as
``dP_qk = scale dA_qk`` and ``dP_kk = diag(beta) dA_kk``, the gradients of the unscaled sums
``P[i, j] = sum_c a_i b_j exp(G_i - G_j)``. ``q_e`` and ``k_g`` are made here from the rows of ``q`` and
``k`` (times their l2norm scales with L2) and ``G``, as the forward made them. ``dq``, ``dk``, ``dG`` (fp32, chunk-major, per value head) are
written here and added to there.

With ``HALVES`` (training on 16-bit inputs, where `backward.CHUNK_BACKWARD_ON_HALVES` asks for it) every
product is on bf16 halves, as in the serial passes (`kda/backends/helion/halves.py`): ``T^T`` split once
per program, the fp32 operands (``h``, ``dh``, ``v_new``, ``dv_new``, ``beta v``, ``X``, ``dw``, ``dT``,
``T^T dT``) split where they are read or made, ``do`` one half in bf16 and two exact ones in fp16; three
bf16 products each (two with ``do`` in bf16) where TF32x3 takes three TF32 products of fp32 operands held
in registers. Without it, every product is TF32x3 (or IEEE for fp32 calls) on fp32 operands.

Grid ``(NT, HV)``; ``K`` and ``V`` in config-sized blocks (``dw`` for all of ``K`` is needed for ``dT``
before ``dA_kk``, so the ``K`` loop accumulates ``dT`` and the inverse's gradient follows it).
"""

from __future__ import annotations

import helion.language as hl
import torch

from kda.backends.helion.halves import dot3, split, split_input


def chunk_backward_kernel(
    do: torch.Tensor,  # [tokens, HV, V]
    v: torch.Tensor,  # [tokens, HV, V]
    q: torch.Tensor,  # [tokens, H, K] as given
    k: torch.Tensor,  # [tokens, H, K] as given
    rstd_q: torch.Tensor,  # [tokens, H] fp32 with L2, else a placeholder
    rstd_k: torch.Tensor,  # [tokens, H] fp32 with L2, else a placeholder
    G: torch.Tensor,  # [NT, HV, C, K] fp32
    beta: torch.Tensor,  # [NT, HV, C] fp32
    T: torch.Tensor,  # [NT, HV, C, C] fp32
    M: torch.Tensor,  # [NT, HV, C, C] fp32
    h: torch.Tensor,  # [NT, HV, K, V]
    dh: torch.Tensor,  # [NT, HV, K, V] fp32
    v_new: torch.Tensor,  # [NT, HV, C, V]
    dv_new: torch.Tensor,  # [NT, HV, C, V] fp32
    chunk_starts: torch.Tensor,  # [NT] int32
    chunk_seq_ends: torch.Tensor,  # [NT] int32
    dv: torch.Tensor,  # [tokens, HV, V] out
    dq_c: torch.Tensor,  # [NT, HV, C, K] fp32 out
    dk_c: torch.Tensor,  # [NT, HV, C, K] fp32 out
    dG_c: torch.Tensor,  # [NT, HV, C, K] fp32 out
    dP_qk: torch.Tensor,  # [NT, HV, C, C] fp32 out
    dP_kk: torch.Tensor,  # [NT, HV, C, C] fp32 out
    dbeta_c: torch.Tensor,  # [NT, HV, C] fp32 out
    scale: float,
    group: int,
    C: hl.constexpr,
    L2: hl.constexpr,
    HALVES: hl.constexpr,  # training on 16-bit inputs: every product on bf16 halves
) -> None:
    NT = G.size(0)
    HV = G.size(1)
    K = G.size(3)
    V = v.size(2)
    for tile_c, tile_hv in hl.tile([NT, HV], block_size=[1, 1]):
        c = tile_c.begin
        hv = tile_hv.begin
        head = hv // group
        idx = hl.arange(C)
        rows = chunk_starts[c] + idx
        valid = rows < chunk_seq_ends[c]
        T_c = T[c, hv, :, :]
        if HALVES:
            T_hi, T_lo = split(T_c.transpose(0, 1))  # T^T, the left operand of every product it enters
        b = beta[c, hv, :]
        if L2:  # the rows' l2norm scales
            r_q = hl.load(rstd_q, [rows, head], extra_mask=valid)  # [C]
            r_k = hl.load(rstd_k, [rows, head], extra_mask=valid)
        dA = hl.zeros([C, C], dtype=torch.float32)
        dT = hl.zeros([C, C], dtype=torch.float32)
        db = hl.zeros([C], dtype=torch.float32)
        for tile_v in hl.tile(V):
            if HALVES:
                v_v = hl.load(v, [rows, hv, tile_v], extra_mask=valid[:, None]).to(torch.float32)
                do_hi, do_lo = split_input(hl.load(do, [rows, hv, tile_v], extra_mask=valid[:, None]))
                vn_hi, vn_lo = split(v_new[c, hv, :, tile_v].transpose(0, 1))
                dvn_hi, dvn_lo = split(dv_new[c, hv, :, tile_v])
                Y_hi, Y_lo = split((b[:, None] * v_v).transpose(0, 1))
                dA = dot3(do_hi, do_lo, vn_hi, vn_lo, acc=dA)
                dT = dot3(dvn_hi, dvn_lo, Y_hi, Y_lo, acc=dT)
                dY = dot3(T_hi, T_lo, dvn_hi, dvn_lo)
            else:
                do_v = hl.load(do, [rows, hv, tile_v], extra_mask=valid[:, None]).to(torch.float32)
                v_v = hl.load(v, [rows, hv, tile_v], extra_mask=valid[:, None]).to(torch.float32)
                vn = v_new[c, hv, :, tile_v].to(torch.float32)
                dvn = dv_new[c, hv, :, tile_v]
                dA = hl.dot(do_v, vn.transpose(0, 1), acc=dA)
                dT = hl.dot(dvn, (b[:, None] * v_v).transpose(0, 1), acc=dT)
                dY = hl.dot(T_c.transpose(0, 1), dvn)
            hl.store(dv, [rows, hv, tile_v], (b[:, None] * dY).to(dv.dtype), extra_mask=valid[:, None])
            db = db + torch.sum(dY * v_v, dim=1)
        for tile_k in hl.tile(K):
            dqe = hl.zeros([C, tile_k], dtype=torch.float32)
            dw = hl.zeros([C, tile_k], dtype=torch.float32)
            dkg = hl.zeros([C, tile_k], dtype=torch.float32)
            dgl = hl.zeros([tile_k], dtype=torch.float32)
            for tile_v in hl.tile(V):
                if HALVES:
                    h_kv = h[c, hv, tile_k, tile_v].to(torch.float32)
                    dh_kv = dh[c, hv, tile_k, tile_v]
                    do_hi, do_lo = split_input(hl.load(do, [rows, hv, tile_v], extra_mask=valid[:, None]))
                    vn_hi, vn_lo = split(v_new[c, hv, :, tile_v])
                    dvn_hi, dvn_lo = split(dv_new[c, hv, :, tile_v])
                    h_hi, h_lo = split(h_kv.transpose(0, 1))
                    dh_hi, dh_lo = split(dh_kv.transpose(0, 1))
                    dqe = dot3(do_hi, do_lo, h_hi, h_lo, acc=dqe)
                    dw = dot3(dvn_hi, dvn_lo, h_hi, h_lo, acc=dw)
                    dkg = dot3(vn_hi, vn_lo, dh_hi, dh_lo, acc=dkg)
                else:
                    do_v = hl.load(do, [rows, hv, tile_v], extra_mask=valid[:, None]).to(torch.float32)
                    vn = v_new[c, hv, :, tile_v].to(torch.float32)
                    dvn = dv_new[c, hv, :, tile_v]
                    h_kv = h[c, hv, tile_k, tile_v].to(torch.float32)
                    dh_kv = dh[c, hv, tile_k, tile_v]
                    dqe = hl.dot(do_v, h_kv.transpose(0, 1), acc=dqe)
                    dw = hl.dot(dvn, h_kv.transpose(0, 1), acc=dw)
                    dkg = hl.dot(vn, dh_kv.transpose(0, 1), acc=dkg)
                dgl = dgl + torch.sum(dh_kv * h_kv, dim=1)
            dw = -dw
            q_i = hl.load(q, [rows, head, tile_k], extra_mask=valid[:, None]).to(torch.float32)
            k_i = hl.load(k, [rows, head, tile_k], extra_mask=valid[:, None]).to(torch.float32)
            if L2:
                q_i = q_i * r_q[:, None]
                k_i = k_i * r_k[:, None]
            G_i = G[c, hv, :, tile_k]
            G_last = G[c, hv, C - 1, tile_k]
            e_G = torch.exp(G_i)
            to_last = torch.exp(G_last[None, :] - G_i)
            X = b[:, None] * k_i * e_G
            if HALVES:
                dw_hi, dw_lo = split(dw)
                X_hi, X_lo = split(X.transpose(0, 1))
                dT = dot3(dw_hi, dw_lo, X_hi, X_lo, acc=dT)
                dX = dot3(T_hi, T_lo, dw_hi, dw_lo)
            else:
                dT = hl.dot(dw, X.transpose(0, 1), acc=dT)
                dX = hl.dot(T_c.transpose(0, 1), dw)
            qe = scale * q_i * e_G
            kg = k_i * to_last
            dq_c[c, hv, :, tile_k] = scale * e_G * dqe
            dk_c[c, hv, :, tile_k] = b[:, None] * e_G * dX + to_last * dkg
            last = torch.sum(kg * dkg, dim=0) + torch.exp(G_last) * dgl  # [BK]
            dG = dX * X + qe * dqe - kg * dkg
            dG_c[c, hv, :, tile_k] = dG + torch.where((idx == C - 1)[:, None], last[None, :], 0.0)
            db = db + torch.sum(dX * k_i * e_G, dim=1)
        if HALVES:
            dT_hi, dT_lo = split(dT)
            TdT_hi, TdT_lo = split(dot3(T_hi, T_lo, dT_hi, dT_lo))
            dA_kk = -dot3(TdT_hi, TdT_lo, T_hi, T_lo)
        else:
            dA_kk = -hl.dot(hl.dot(T_c.transpose(0, 1), dT), T_c.transpose(0, 1))
        strict = idx[:, None] > idx[None, :]
        dA_kk = torch.where(strict, dA_kk, 0.0)
        db = db + torch.sum(dA_kk * M[c, hv, :, :], dim=1)
        dP_kk[c, hv, :, :] = b[:, None] * dA_kk
        dP_qk[c, hv, :, :] = torch.where(idx[:, None] >= idx[None, :], scale * dA, 0.0)
        dbeta_c[c, hv, :] = db
