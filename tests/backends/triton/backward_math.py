"""The chunked backward of KDA, written out in torch (float64-capable): the derivation the Triton backward
kernels implement, checked against autograd of the reference (tests/backends/triton/test_backward_math.py).

One sequence, one value head, per chunk (rows ``R``), with the forward's quantities::

    G = in-chunk cumsum of the log decay a;      E_ij[c] = exp(G_i[c] - G_j[c])
    M_ij = sum_c k_i k_j E_ij  (j < i);          A = beta_i M_ij;   T = (I + A)^-1
    Q_ij = sum_c q_i k_j E_ij  (j <= i)
    W = T (beta k e^G),  U = T (beta v),  d = U - W S0
    o = scale (q e^G S0 + Q d),   S_C = e^(G_C) S0 + (k e^(G_C - G))^T d

The log decay's gradient is ``da_t = sum_{s >= t} dG_s`` (G = cumsum(a)), but it is formed as a sum of
terms that each carry the decay across token t (see `chunk_backward`): the reverse cumsum of ``dG`` sums
O(1) terms that cancel to ~0 where ``a_t`` is very negative, and ``dA_log = sum_t a_t da_t`` multiplies
that fp32 residual by ``a_t``.
"""

from __future__ import annotations

import torch


def chunk_forward(q, k, v, beta, a, scale, S0, C):
    """Forward over one sequence: q, k [T, K] (already normalised), v [T, V], beta [T] (activated),
    a [T, K] log decay, S0 [K, V]. Returns o [T, V], S_T, and the per-chunk saved quantities."""
    T = q.shape[0]
    saved = []
    outs = []
    S = S0
    for start in range(0, T, C):
        r = slice(start, min(start + C, T))
        qc, kc, vc, bc, ac = q[r], k[r], v[r], beta[r], a[r]
        n = qc.shape[0]
        G = ac.cumsum(0)
        diff = G[:, None, :] - G[None, :, :]
        lower = torch.tril(torch.ones(n, n, dtype=torch.bool), -1)
        causal = torch.tril(torch.ones(n, n, dtype=torch.bool), 0)
        E_kk = torch.where(lower[:, :, None], diff, torch.full_like(diff, -torch.inf)).exp()
        E_qk = torch.where(causal[:, :, None], diff, torch.full_like(diff, -torch.inf)).exp()
        M = torch.einsum("ic,jc,ijc->ij", kc, kc, E_kk)
        Q = torch.einsum("ic,jc,ijc->ij", qc, kc, E_qk)
        A = bc[:, None] * M
        Tm = torch.linalg.inv(torch.eye(n, dtype=q.dtype) + A)
        X = bc[:, None] * kc * G.exp()
        Y = bc[:, None] * vc
        W, U = Tm @ X, Tm @ Y
        d = U - W @ S
        outs.append(scale * ((qc * G.exp()) @ S + Q @ d))
        kt = kc * (G[-1][None, :] - G).exp()
        saved.append(
            dict(
                r=r, q=qc, k=kc, v=vc, b=bc, G=G, E_kk=E_kk, E_qk=E_qk, M=M, Q=Q, T=Tm, X=X, Y=Y, W=W, d=d, S0=S, kt=kt
            )
        )
        S = G[-1].exp()[:, None] * S + kt.T @ d
    return torch.cat(outs), S, saved


def chunk_backward(saved, do, dS_T, scale):
    """Gradients with respect to q, k, v, beta (activated), a (log decay) and S0 of one sequence.

    Per chunk, with ``dG`` the gradient of the cumulative decay, ``da_t = sum_{s >= t} dG_s`` is::

        da_t = sum_{s >= t} up_s + sum_{s < t} kt_s + e^(G_C) sum_v (S0 dS) + sum_{i >= t > j} P_ij
        up_s = dq~_s q_s e^(G_s) + beta_s k_s e^(G_s) dX_s      (dG through e^G)
        kt_s = dk~_s k_s e^(G_C - G_s)                           (dG through e^(G_C - G): -kt_s at s, +sum at C)
        P_ij = (dM_ij k_i + dQ_ij q_i) k_j E_ij  (j < i)         (dG through E_ij: +P_ij at i, -P_ij at j)

    (the pairs and the kt terms with both ends on one side of t cancel). Every term then has ``e^(a_t)`` as
    a factor: a token whose decay underflows gets ``da_t = 0`` exactly, where the reverse cumsum of ``dG``
    leaves an fp32 residual of the O(1) terms that cancel."""
    dq = torch.zeros(do.shape[0], saved[0]["q"].shape[1], dtype=do.dtype)
    dk, da = torch.zeros_like(dq), torch.zeros_like(dq)
    dv = torch.zeros_like(do)
    dbeta = torch.zeros(do.shape[0], dtype=do.dtype)
    dS = dS_T
    for c in reversed(saved):
        r, q, k, v, b, G = c["r"], c["q"], c["k"], c["v"], c["b"], c["G"]
        S0, d, Q, Tm, W, kt = c["S0"], c["d"], c["Q"], c["T"], c["W"], c["kt"]
        do_c = do[r]
        n = do_c.shape[0]
        eG = G.exp()
        # serial part: the deltas' gradient and the state's gradient one chunk back
        dd = scale * Q.T @ do_c + kt @ dS
        dS0 = G[-1].exp()[:, None] * dS + scale * (q * eG).T @ do_c - W.T @ dd
        # output and state terms
        dqt = scale * do_c @ S0.T
        dQ = torch.tril(scale * do_c @ d.T)
        dW, dU = -dd @ S0.T, dd
        dkt = d @ dS.T
        dqc = dqt * eG
        dkc = dkt * (G[-1][None, :] - G).exp()
        # through W = T X, U = T Y
        dT = dW @ c["X"].T + dU @ c["Y"].T
        dX, dY = Tm.T @ dW, Tm.T @ dU
        dvc = b[:, None] * dY
        db = (v * dY).sum(1) + (k * eG * dX).sum(1)
        dkc = dkc + b[:, None] * eG * dX
        dA = torch.tril(-(Tm.T @ dT @ Tm.T), -1)
        db = db + (dA * c["M"]).sum(1)
        dM = b[:, None] * dA
        # through M_ij = sum_c k_i k_j E_ij and Q_ij = sum_c q_i k_j E_ij
        PM = dM[:, :, None] * c["E_kk"]  # [i, j, c]
        PQ = dQ[:, :, None] * c["E_qk"]
        dkc = (
            dkc
            + torch.einsum("ijc,jc->ic", PM, k)
            + torch.einsum("ijc,ic->jc", PM, k)
            + torch.einsum("ijc,ic->jc", PQ, q)
        )
        dqc = dqc + torch.einsum("ijc,jc->ic", PQ, k)
        P = PM * k[:, None, :] * k[None, :, :] + PQ * q[:, None, :] * k[None, :, :]  # [i, j, c]
        # G = cumsum(a), so da_t = sum_{s >= t} dG_s, in the form of the docstring
        up = (dqt * q + b[:, None] * k * dX) * eG
        kt_terms = dkt * kt
        kt_before = torch.cat([torch.zeros_like(kt_terms[:1]), kt_terms[:-1].cumsum(0)])  # sum_{s < t}, no subtraction
        before = torch.ones(n, n, dtype=torch.bool).tril(-1)  # [t, j]: j < t
        pairs = (_reverse_cumsum(P) * before[:, :, None]).sum(1)  # [t, c]: sum_{i >= t} sum_{j < t} P_ij
        da[r] = _reverse_cumsum(up) + kt_before + G[-1].exp() * (S0 * dS).sum(1) + pairs
        dq[r], dk[r], dv[r], dbeta[r] = dqc, dkc, dvc, db
        dS = dS0
    return dq, dk, dv, dbeta, da, dS


def _reverse_cumsum(x):
    """``y_t = sum_{s >= t} x_s`` along dim 0."""
    return x.flip(0).cumsum(0).flip(0)
