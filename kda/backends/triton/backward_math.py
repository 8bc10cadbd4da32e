"""The chunked backward of KDA, written out in torch (float64-capable): the derivation the Triton backward
kernels will implement, checked against autograd of the reference (WORK IN PROGRESS, not used yet).

One sequence, one value head, per chunk (rows ``R``), with the forward's quantities::

    G = in-chunk cumsum of the log decay a;      E_ij[c] = exp(G_i[c] - G_j[c])
    M_ij = sum_c k_i k_j E_ij  (j < i);          A = beta_i M_ij;   T = (I + A)^-1
    Q_ij = sum_c q_i k_j E_ij  (j <= i)
    W = T (beta k e^G),  U = T (beta v),  d = U - W S0
    o = scale (q e^G S0 + Q d),   S_C = e^(G_C) S0 + (k e^(G_C - G))^T d
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
        saved.append(dict(r=r, q=qc, k=kc, v=vc, b=bc, G=G, E_kk=E_kk, E_qk=E_qk, M=M, Q=Q, T=Tm, X=X, Y=Y,
                          W=W, d=d, S0=S, kt=kt))
        S = G[-1].exp()[:, None] * S + kt.T @ d
    return torch.cat(outs), S, saved


def chunk_backward(saved, do, dS_T, scale):
    """Gradients with respect to q, k, v, beta (activated), a (log decay) and S0 of one sequence."""
    dq = torch.zeros(do.shape[0], saved[0]["q"].shape[1], dtype=do.dtype)
    dk, da = torch.zeros_like(dq), torch.zeros_like(dq)
    dv = torch.zeros_like(do)
    dbeta = torch.zeros(do.shape[0], dtype=do.dtype)
    dS = dS_T
    for c in reversed(saved):
        r, q, k, v, b, G = c["r"], c["q"], c["k"], c["v"], c["b"], c["G"]
        S0, d, Q, Tm, W, kt = c["S0"], c["d"], c["Q"], c["T"], c["W"], c["kt"]
        do_c = do[r]
        eG = G.exp()
        # serial part: the deltas' gradient and the state's gradient one chunk back
        dd = scale * Q.T @ do_c + kt @ dS
        dS0 = G[-1].exp()[:, None] * dS + scale * (q * eG).T @ do_c - W.T @ dd
        # output and state terms
        dqt = scale * do_c @ S0.T
        dQ = torch.tril(scale * do_c @ d.T)
        dW, dU = -dd @ S0.T, dd
        dkt = d @ dS.T
        dG = dqt * q * eG - dkt * kt
        dG_C = (dkt * kt).sum(0) + G[-1].exp() * (S0 * dS).sum(1)
        dqc = dqt * eG
        dkc = dkt * (G[-1][None, :] - G).exp()
        # through W = T X, U = T Y
        dT = dW @ c["X"].T + dU @ c["Y"].T
        dX, dY = Tm.T @ dW, Tm.T @ dU
        dvc = b[:, None] * dY
        db = (v * dY).sum(1) + (k * eG * dX).sum(1)
        dkc = dkc + b[:, None] * eG * dX
        dG = dG + b[:, None] * k * eG * dX
        dA = torch.tril(-(Tm.T @ dT @ Tm.T), -1)
        db = db + (dA * c["M"]).sum(1)
        dM = b[:, None] * dA
        # through M_ij = sum_c k_i k_j E_ij and Q_ij = sum_c q_i k_j E_ij
        PM = dM[:, :, None] * c["E_kk"]  # [i, j, c]
        PQ = dQ[:, :, None] * c["E_qk"]
        dkc = dkc + torch.einsum("ijc,jc->ic", PM, k) + torch.einsum("ijc,ic->jc", PM, k) \
            + torch.einsum("ijc,ic->jc", PQ, q)
        dqc = dqc + torch.einsum("ijc,jc->ic", PQ, k)
        term = PM * k[:, None, :] * k[None, :, :] + PQ * q[:, None, :] * k[None, :, :]
        dG = dG + term.sum(1) - term.sum(0)
        dG[-1] = dG[-1] + dG_C
        # G = cumsum(a): a's gradient is the reverse cumsum of G's
        da[r] = dG.flip(0).cumsum(0).flip(0)
        dq[r], dk[r], dv[r], dbeta[r] = dqc, dkc, dvc, db
        dS = dS0
    return dq, dk, dv, dbeta, da, dS
