"""The tilelang backward's roundings, replayed in torch on the CPU, against the float64 reference gradients.

    python benchmarks/tilelang_backward_precision.py [--draws 4] [--regime realistic extreme]
        [--class KEY ...] [--config NAME ...] [--seed N ...] [--check]

The tilelang training path is checked on a GPU only, where ``dA_log`` missed its tolerance on bf16 classes
with the l2norm (version 5, every intermediate in the inputs' dtype). This script says, without a GPU,
which rounding makes it miss: it computes the training forward's saved intermediates chunk by chunk as
`kda/backends/tilelang` does (`forward.py`, `intra.py`), then the backward's math (`state_backward`,
`chunk_backward`, `score_backward`, `tails`: the formulas of their docstrings) from those saved tensors,
in float64 arithmetic, with each rounding a switch (`ROUNDINGS`; `SHIPPED` is the current version's,
`VERSION_5` all of them). For each configuration (as shipped; version 5; each shipped rounding kept exact
in turn; a few combinations; none) it prints ``dA_log``'s relative error against the float64 reference
(autograd through `kda.reference`), beside the tolerance, and the worst of the other gradients.

It takes dense and varlen calls (``cu_seqlens``: each sequence chunked from its own start, its last chunk
ragged, its own initial and final state) and GVA (value head ``hv`` reads q/k head ``hv // group``, and
``dq``, ``dk`` sum over the group's value heads), with or without the l2norm, any beta, chunk 32 or 64.

With no rounding the replay is the exact chain rule of the chunked algorithm, so it must equal the
reference to ~1e-12 (``--check`` asserts it on the realistic draws, and on the same seeds' draws of each
class's varlen and GVA twins; the tests in tests/benchmarks/ do too): what proves the replay. Where a gate
meets the log-decay floor (the extreme sigmoid, softplus and pre-gated draws) the replay follows the
backends (a zero gradient there), so its unrounded error is the floor's, not zero.

The draws are the verifier's own cases (`kda.verify.cases.cases_for`), fresh random seeds each run: by default
the realistic case (4C + 13 tokens, B = 2, two heads; varlen: sequences of 4C + 13, C - 5 and 17 tokens in
one row) and the extreme one (3C - 5 tokens); `--regime` also takes the correlated case and the variant (one
partial chunk of C - 3 tokens, V = K / 2), where a sequence's first ``h`` is its initial state and its
rounding (``h_first``) is most of ``dA_log``'s error.
"""

from __future__ import annotations

import argparse
import math
import random
import statistics
import sys
from collections.abc import Iterable
from dataclasses import replace
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))  # the forward replay's helpers, beside this file

from tilelang_precision import STRIP, chunk_rows, sequences, span_limit, unit_lower_inverse

from kda.reference import L2NORM_EPS, LOG_DECAY_FLOOR, beta_transform, kda_reference, log_decay
from kda.spec import CaseClass
from kda.verify.cases import cases_for, make_inputs
from kda.verify.check import GRADIENT_OF, relative_error
from kda.verify.policy import tolerance

F64 = torch.float64
SCORE_SPAN_LIMIT = 80.0  # kda/backends/tilelang/score_backward.py: SPAN_LIMIT, STEP_LIMIT, KEY_BLOCK
SCORE_STEP_LIMIT = 8.0
KEY_BLOCK = 64

# Every rounding of the shipped training path (forward and backward), by name.
ROUNDINGS: dict[str, str] = {
    "rows": "the l2-normalized q, k rows in the inputs' dtype as the forward's score operands",
    "saved_rows": "the l2-normalized rows in the inputs' dtype everywhere else: q_e, k_g, beta k e^G, the backward",
    "scores": "the forward's score products on operands in the inputs' dtype, by strips (A_qk, M = A_kk / beta)",
    "inverse": "T as `intra` computes it: 16-row diagonal blocks by fp32 substitution, joined by products on bf16 halves",
    "T_wu": "T rounded to the inputs' dtype as the operand of w and u",
    "XY": "beta k exp(G) and beta v rounded to the inputs' dtype as the operands of w and u",
    "w": "w stored in the inputs' dtype",
    "u": "u stored in the inputs' dtype",
    "q_e": "q_e stored in the inputs' dtype (the state backward's operand)",
    "k_g": "k_g stored in the inputs' dtype (the forward's state update and the state backward read it)",
    "dG_reads": "q_e and k_g as chunk_backward's dG terms read them, in the inputs' dtype",
    "A_qk": "A_qk stored in the inputs' dtype",
    "state_op": "the state rounded each chunk as the forward's operand (v_new = u - w h, o = q_e h + ...)",
    "h": "h (the state entering each chunk after a sequence's first) saved in the inputs' dtype for the backward",
    "h_first": "a sequence's first h (its initial state) saved in the inputs' dtype for the backward",
    "v_new": "v_new stored in the inputs' dtype (the forward's state update and the backward read it)",
    "bwd_split": "the backward's fp32 product operands as two halves (hi + lo: 16 bits with bf16, 22 fp16)",
    "outputs": "dq, dk, dv, dbeta returned in the inputs' dtype, dg in g's dtype (dA_log is not rounded)",
}
VERSION_5 = frozenset(ROUNDINGS)  # every intermediate in the inputs' dtype
# version 6 keeps in fp32 (or as two halves) what dA_log needs: the rows outside the scores, the operands of
# w and u, u and v_new, and q_e, k_g where dG reads them
SHIPPED = VERSION_5 - {"saved_rows", "XY", "u", "v_new", "dG_reads"}
# Kept exact together: candidate fixes (what the backward reads, stored in fp32 or recomputed), and the
# forward's own operand roundings (what any bf16 forward makes) as one group.
STORED = ("w", "q_e", "k_g", "A_qk", "h")
FORWARD = ("rows", "scores", "inverse", "T_wu", "state_op")
COMBINATIONS = (("q_e", "k_g"), STORED, FORWARD, (*FORWARD, *STORED))

DEFAULT_CLASSES = (
    "safe/l2/sig/bf16/dense/mha/h0+ht/c64/d128/train",
    "safe/l2/sig/bf16/dense/mha/ht/c64/d128/train",
    "sigmoid/l2/sig/bf16/dense/mha/h0+ht/c64/d128/train",
    "safe/l2/sig/bf16/dense/mha/nostate/c64/d64/train",
    "softplus/l2/sig/bf16/dense/mha/h0+ht/c64/d128/train",
    "pregated/l2/sig/bf16/dense/mha/h0+ht/c64/d128/train",
    "safe/qk/sig/bf16/dense/mha/h0+ht/c64/d128/train",
    "safe/l2/sig/fp16/dense/mha/h0+ht/c64/d128/train",
)


def configurations(names: Iterable[str] | None = None) -> list[tuple[str, frozenset[str]]]:
    """(label, roundings on): as shipped, each of `names` (default: every rounding) exact in turn (a name
    ``a+b+...`` keeps those roundings exact together), the `COMBINATIONS` exact together, and nothing
    rounded."""
    names = [name for name in ROUNDINGS if name in SHIPPED] if names is None else list(names)
    configs = [("shipped", SHIPPED), ("version 5", VERSION_5)]
    configs += [(f"exact {name}", SHIPPED - set(name.split("+"))) for name in names]
    configs += [(f"exact {'+'.join(combo)}", SHIPPED - set(combo)) for combo in COMBINATIONS]
    configs.append(("all exact", frozenset()))
    return configs


def rnd(x: torch.Tensor, dtype: torch.dtype, on: bool) -> torch.Tensor:
    """`x` rounded to `dtype` (and back to float64) when `on`."""
    return x.to(dtype).to(F64) if on else x


def split(x: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """``hi + lo`` with ``hi = dtype(x)``, ``lo = dtype(x - hi)``: an fp32 operand as the kernels split it."""
    hi = x.to(dtype).to(F64)
    return hi + (x - hi).to(dtype).to(F64)


def decays(G: torch.Tensor, strict: bool) -> torch.Tensor:
    """``exp(G_i - G_j)`` ``[C, C, K]`` on the causal triangle (``j < i`` when `strict`), 0 elsewhere."""
    C = G.shape[0]
    keep = torch.ones(C, C, dtype=torch.bool).tril(-1 if strict else 0)
    diff = G[:, None, :] - G[None, :, :]
    return torch.where(keep[:, :, None], diff, -math.inf).exp()


def strip_scores(
    q: torch.Tensor, k: torch.Tensor, G: torch.Tensor, n: int, scale: float, dtype: torch.dtype, limit: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """``A_qk`` and ``M`` as `intra` computes them: strips of 16 rows anchored at their first, operands in
    the inputs' dtype, the diagonal block exact past the span limit (`tilelang_precision.chunk_forward`)."""
    C = q.shape[0]
    A_qk, M = torch.zeros(C, C, dtype=F64), torch.zeros(C, C, dtype=F64)
    index = torch.arange(C)
    for a0 in range(0, C, STRIP):
        Gs = G[a0 : a0 + STRIP]
        by_product = (Gs - G[a0]).abs().max().item() <= limit
        decay = (Gs - G[a0]).exp()
        q_r, k_r = rnd(q[a0 : a0 + STRIP] * decay, dtype, True), rnd(k[a0 : a0 + STRIP] * decay, dtype, True)
        keep = ((index < a0) | ((index < a0 + STRIP) & by_product)) & (index < n)
        cols = torch.where(keep[:, None], rnd(k * (G[a0] - G).clamp(max=700).exp(), dtype, True), 0.0)
        acc_q, acc_k = cols @ q_r.T, cols @ k_r.T  # [C, 16]
        for i in range(STRIP):
            row = a0 + i
            A_qk[row] = torch.where(index <= row, scale * acc_q[:, i], 0.0)
            M[row] = torch.where(index < row, acc_k[:, i], 0.0)
        if not by_product:
            for i in range(STRIP):
                row = a0 + i
                for col in range(a0, row + 1):
                    kd = k[col] * (G[row] - G[col]).exp()
                    A_qk[row, col] = scale * (q[row] * kd).sum()
                    M[row, col] = (k[row] * kd).sum() if col < row else 0.0
    return A_qk, M


def block_inverse(A_kk: torch.Tensor) -> torch.Tensor:
    """``(I + A_kk)^-1`` as `intra` computes it: ``N = -A_kk`` in fp32, the diagonal blocks by substitution
    in fp32 and the block rows joined by products on bf16 halves (the forward replay's
    `unit_lower_inverse`)."""
    return unit_lower_inverse(-A_kk.float()).to(F64)


def score_gradients(
    a: torch.Tensor, b: torch.Tensor, G: torch.Tensor, D: torch.Tensor, dP: torch.Tensor, op: Any
) -> tuple[torch.Tensor, torch.Tensor]:
    """``da_i = sum_j dP[i, j] b_j exp(G_i - G_j)`` and ``db_j = sum_i dP[i, j] a_i exp(G_i - G_j)`` (``dP``
    already zero off its triangle; ``D = decays(G, strict=False)``). Exact when `op` is None; else as `score_backward` takes them: strips
    anchored at their first row (``da``) and last (``db``), every operand through `op` (the bf16 halves),
    the diagonal block in the products unless its span or step passes the limits (decided per key block)."""
    C, K = a.shape
    if op is None:
        return torch.einsum("ij,jc,ijc->ic", dP, b, D), torch.einsum("ij,ic,ijc->jc", dP, a, D)
    da, db = torch.zeros(C, K, dtype=F64), torch.zeros(C, K, dtype=F64)
    for a0 in range(0, C, STRIP):
        S, e = slice(a0, a0 + STRIP), a0 + STRIP - 1
        Gs = G[S]
        span = torch.maximum((Gs - G[a0]).abs(), (Gs - G[e]).abs()).amax(0)  # [K]
        step = torch.cat([torch.zeros(1, K, dtype=F64), (Gs[1:] - Gs[:-1]).abs()]).amax(0)
        ok = torch.stack([
            (span[j : j + KEY_BLOCK].max() <= SCORE_SPAN_LIMIT) & (step[j : j + KEY_BLOCK].max() <= SCORE_STEP_LIMIT)
            for j in range(0, K, KEY_BLOCK)
        ]).repeat_interleave(KEY_BLOCK)[:K]  # fmt: skip
        # rows S: columns before the strip, then the diagonal block by the product or exactly
        before = op(b[:a0] * (G[a0] - G[:a0]).exp())
        da_before = (G[S] - G[a0]).exp() * (op(dP[S, :a0]) @ before) if a0 else 0.0
        diag_prod = (G[S] - G[a0]).exp() * (op(dP[S, S]) @ op(b[S] * (G[a0] - G[S]).exp()))
        diag_exact = torch.einsum("ij,jc,ijc->ic", dP[S, S], b[S], D[S, S])
        da[S] = da_before + torch.where(ok, diag_prod, diag_exact)
        # columns S: rows after the strip, then the diagonal block
        after = slice(e + 1, C)
        db_after = 0.0
        if e + 1 < C:
            db_after = (G[e] - G[S]).exp() * (op(dP[after, S]).T @ op(a[after] * (G[after] - G[e]).exp()))
        diag_prod = (G[e] - G[S]).exp() * (op(dP[S, S]).T @ op(a[S] * (G[S] - G[e]).exp()))
        diag_exact = torch.einsum("ij,ic,ijc->jc", dP[S, S], a[S], D[S, S])
        db[S] = db_after + torch.where(ok, diag_prod, diag_exact)
    return da, db


def reference_gradients(kwargs: dict[str, Any], upstream: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """The float64 reference's gradients (autograd through `kda_reference`), by gradient name."""
    leaves, args = {}, {}
    for name, value in kwargs.items():
        if name == "cu_seqlens_cpu":
            continue
        if isinstance(value, torch.Tensor) and name != "cu_seqlens":
            value = value.detach().to(F64).requires_grad_(True)
            leaves[name] = value
        args[name] = value
    with torch.enable_grad():
        o, state = kda_reference(**args)[:2]
        targets, seeds = [o], [upstream["do"].to(F64)]
        if state is not None:
            targets.append(state)
            seeds.append(upstream["dfinal_state"].to(F64))
        found = torch.autograd.grad(targets, list(leaves.values()), seeds, allow_unused=True)
    by_input = dict(zip(leaves, found, strict=True))
    return {
        grad: (torch.zeros_like(leaves[name]) if by_input[name] is None else by_input[name])
        for grad, name in GRADIENT_OF.items()
        if name in by_input
    }


def replay(kwargs: dict[str, Any], upstream: dict[str, torch.Tensor], on: frozenset[str]) -> dict[str, torch.Tensor]:
    """The tilelang backward's gradients of a call (dense or varlen, GVA), with the roundings `on` (names of
    `ROUNDINGS`) and every other operation exact (float64). Each sequence (a batch row, or a span of
    ``cu_seqlens`` in row 0) is chunked from its own start, its last chunk ragged, and has its own state per
    value head; value head ``hv`` reads q/k head ``hv // group``, whose ``dq``, ``dk`` sum over the group."""
    unknown = on - VERSION_5
    assert not unknown, f"unknown roundings {sorted(unknown)}"
    dtype = kwargs["q"].dtype
    q_in, k_in, v = (kwargs[name].to(F64) for name in ("q", "k", "v"))
    B, T, H, K = q_in.shape
    HV, V = v.shape[2], v.shape[3]
    group = HV // H
    C = kwargs.get("chunk_size", 64)
    scale = kwargs["scale"] if kwargs.get("scale") is not None else K**-0.5
    l2 = bool(kwargs.get("use_qk_l2norm_in_kernel"))
    if l2:
        rstd_q = torch.rsqrt((q_in * q_in).sum(-1, keepdim=True) + L2NORM_EPS)
        rstd_k = torch.rsqrt((k_in * k_in).sum(-1, keepdim=True) + L2NORM_EPS)
        q_exact, k_exact = q_in * rstd_q, k_in * rstd_k
        q_hat, k_hat = rnd(q_exact, dtype, "saved_rows" in on), rnd(k_exact, dtype, "saved_rows" in on)
        q_sc, k_sc = rnd(q_exact, dtype, "rows" in on), rnd(k_exact, dtype, "rows" in on)  # the scores' rows
    else:
        q_hat, k_hat = q_in, k_in
        q_sc, k_sc = q_in, k_in

    # the gate and beta, and their derivatives (`gate.activation`, `tails.build_gate_tail`)
    g = kwargs["g"].to(F64)
    gated = bool(kwargs.get("use_gate_in_kernel"))
    A_log = kwargs.get("A_log")
    A_log = A_log.to(F64) if A_log is not None else None
    dt_bias = kwargs.get("dt_bias")
    dt_bias = dt_bias.to(F64).reshape(HV, K) if dt_bias is not None else None
    lower_bound = kwargs.get("lower_bound")
    a = log_decay(g, use_gate_in_kernel=gated, A_log=A_log, dt_bias=dt_bias, lower_bound=lower_bound)
    floored = torch.zeros_like(a, dtype=torch.bool)
    if not kwargs.get("safe_gate"):
        floored = a < LOG_DECAY_FLOOR
        a = torch.where(floored, LOG_DECAY_FLOOR, a)
    z = g + dt_bias if dt_bias is not None else g
    A = A_log.exp()[:, None] if A_log is not None else torch.ones(HV, 1, dtype=F64)
    if not gated:
        da_dz, da_dA_log = torch.ones_like(a), None
    elif lower_bound is not None:
        sig = torch.sigmoid(A * z)
        da_dz = lower_bound * A * sig * (1 - sig)
        da_dA_log = z * da_dz
    else:
        da_dz, da_dA_log = -A * torch.sigmoid(z), a
    da_dz = torch.where(floored, 0.0, da_dz)
    if da_dA_log is not None:
        da_dA_log = torch.where(floored, 0.0, da_dA_log)
    beta_raw = kwargs["beta"].to(F64)
    sigmoid_beta, neg = bool(kwargs.get("use_beta_sigmoid_in_kernel")), bool(kwargs.get("allow_neg_eigval"))
    beta = beta_transform(beta_raw, sigmoid=sigmoid_beta, allow_neg_eigval=neg)

    h0 = kwargs.get("initial_state")
    if h0 is not None:
        h0 = h0.to(F64)
        if kwargs.get("state_v_first"):
            h0 = h0.transpose(-1, -2)
    do = upstream["do"].to(F64)
    dht = upstream.get("dfinal_state") if kwargs.get("output_final_state") else None
    if dht is not None:
        dht = dht.to(F64)
        if kwargs.get("state_v_first"):
            dht = dht.transpose(-1, -2)

    limit = span_limit(dtype, l2)
    op = (lambda x: split(x, dtype)) if "bwd_split" in on else (lambda x: x)
    score_op = (lambda x: split(x, torch.bfloat16)) if "bwd_split" in on else None
    eye = torch.eye(C, dtype=F64)
    causal = torch.ones(C, C, dtype=torch.bool).tril()
    strict = torch.ones(C, C, dtype=torch.bool).tril(-1)

    dq_hat, dk_hat = torch.zeros(B, T, H, K, dtype=F64), torch.zeros(B, T, H, K, dtype=F64)
    dv, dbeta_hat = torch.zeros(B, T, HV, V, dtype=F64), torch.zeros(B, T, HV, dtype=F64)
    da = torch.zeros(B, T, HV, K, dtype=F64)
    spans = sequences(kwargs)
    dh0 = torch.zeros(len(spans), HV, K, V, dtype=F64)
    for seq, (b, bos, eos) in enumerate(spans):
        for hv in range(HV):
            hk = hv // group
            # the training forward: what `intra` and `state` save, chunk by chunk from the sequence's start
            # (rows past its end read as zeros)
            saved = []
            S = h0[seq, hv].clone() if h0 is not None else torch.zeros(K, V, dtype=F64)
            for start in range(bos, eos, C):
                n = min(C, eos - start)
                qc, kc = chunk_rows(q_hat[b, :eos, hk], start, C), chunk_rows(k_hat[b, :eos, hk], start, C)
                vc, ac = chunk_rows(v[b, :eos, hv], start, C), chunk_rows(a[b, :eos, hv], start, C)
                bc = chunk_rows(beta[b, :eos, hv, None], start, C)[:, 0]
                G = torch.cumsum(ac, dim=0)  # flat past the end
                D = decays(G, strict=False)
                q_s, k_s = chunk_rows(q_sc[b, :eos, hk], start, C), chunk_rows(k_sc[b, :eos, hk], start, C)
                if "scores" in on:
                    A_qk_f, M = strip_scores(q_s, k_s, G, n, scale, dtype, limit)
                else:
                    A_qk_f = scale * torch.einsum("ic,jc,ijc->ij", q_s, k_s, D)
                    M = torch.where(strict, torch.einsum("ic,jc,ijc->ij", k_s, k_s, D), 0.0)
                A_kk = bc[:, None] * M
                if "inverse" in on:
                    T_inv = block_inverse(A_kk)
                else:
                    T_inv = torch.linalg.solve_triangular(eye + A_kk, eye, upper=False, unitriangular=True)
                T_h = rnd(T_inv, dtype, "T_wu" in on)
                X, Y = bc[:, None] * kc * G.exp(), bc[:, None] * vc
                w = rnd(T_h @ rnd(X, dtype, "XY" in on), dtype, "w" in on)
                u = rnd(T_h @ rnd(Y, dtype, "XY" in on), dtype, "u" in on)
                q_e_f, k_g_f = scale * qc * G.exp(), kc * (G[-1] - G).exp()
                q_e, k_g = rnd(q_e_f, dtype, "q_e" in on), rnd(k_g_f, dtype, "k_g" in on)
                # a sequence's first h is its initial state (fp32, or zero), which the backward can read as given
                h_rounded = "h" in on if start > bos else "h_first" in on
                h_op, h_saved = rnd(S, dtype, "state_op" in on), rnd(S, dtype, h_rounded)
                v_new = rnd(u - w @ h_op, dtype, "v_new" in on)
                S = S * G[-1].exp()[:, None] + k_g.T @ v_new
                saved.append(
                    dict(
                        start=start,
                        n=n,
                        q=qc,
                        k=kc,
                        v=vc,
                        do=chunk_rows(do[b, :eos, hv], start, C),
                        G=G,
                        D=D,
                        beta=bc,
                        M=M,
                        T=T_inv,
                        A_qk=rnd(A_qk_f, dtype, "A_qk" in on),
                        q_e=q_e,
                        k_g=k_g,
                        q_e_dG=rnd(q_e_f, dtype, "dG_reads" in on),
                        k_g_dG=rnd(k_g_f, dtype, "dG_reads" in on),
                        w=w,
                        v_new=v_new,
                        h=h_saved,
                    )
                )
            # state_backward: the reverse pass
            dS = dht[seq, hv].clone() if dht is not None else torch.zeros(K, V, dtype=F64)
            for s in reversed(saved):
                s["dh"] = dS
                s["dv_new"] = op(s["A_qk"]).T @ s["do"] + op(s["k_g"]) @ op(dS)
                dS = s["G"][-1].exp()[:, None] * dS + op(s["q_e"]).T @ s["do"] - op(s["w"]).T @ op(s["dv_new"])
            dh0[seq, hv] = dS
            for s in saved:
                G, bc, qc, kc, vc, Tm, h = s["G"], s["beta"], s["q"], s["k"], s["v"], s["T"], s["h"]
                dvn, dh, q_e, k_g = s["dv_new"], s["dh"], s["q_e_dG"], s["k_g_dG"]
                E = G.exp()
                Xk = kc * E  # k exp(G): X = beta Xk
                # chunk_backward
                dq_e = s["do"] @ op(h).T
                dw = -(op(dvn) @ op(h).T)
                dk_g = op(s["v_new"]) @ op(dh).T
                dA_qk = torch.where(causal, s["do"] @ op(s["v_new"]).T, 0.0)
                dT = (op(dvn) @ vc.T + op(dw) @ op(Xk).T) * bc[None, :]
                dX, dY = op(Tm).T @ op(dw), op(Tm).T @ op(dvn)
                dA_kk = torch.where(strict, -(op(op(Tm).T @ op(dT)) @ op(Tm).T), 0.0)
                dbeta_c = (dY * vc).sum(-1) + (dX * Xk).sum(-1) + (dA_kk * s["M"]).sum(-1)
                dq_c = scale * E * dq_e
                dk_c = bc[:, None] * E * dX + (G[-1] - G).exp() * dk_g
                dG = dX * bc[:, None] * Xk + q_e * dq_e - k_g * dk_g
                dG[-1] += (k_g * dk_g).sum(0) + G[-1].exp() * (dh * h).sum(-1)
                dP_qk = scale * dA_qk
                dP_kk = bc[:, None] * dA_kk
                # score_backward
                da_qk, db_qk = score_gradients(qc, kc, G, s["D"], dP_qk, score_op)
                da_kk, db_kk = score_gradients(kc, kc, G, s["D"], dP_kk, score_op)
                dq_c = dq_c + da_qk
                dk_c = dk_c + da_kk + db_qk + db_kk
                dG = dG + qc * da_qk + kc * da_kk - kc * (db_qk + db_kk)
                # tails: the gate's reverse sum over all C rows, then the rows of the sequence
                da_c = dG.flip(0).cumsum(0).flip(0)
                rows = slice(s["start"], s["start"] + s["n"])
                da[b, rows, hv] = da_c[: s["n"]]
                dv[b, rows, hv] = (bc[:, None] * dY)[: s["n"]]
                dbeta_hat[b, rows, hv] = dbeta_c[: s["n"]]
                dq_hat[b, rows, hk] += dq_c[: s["n"]]
                dk_hat[b, rows, hk] += dk_c[: s["n"]]

    grads: dict[str, torch.Tensor] = {}
    if l2:
        grads["dq"] = rstd_q * (dq_hat - q_hat * (q_hat * dq_hat).sum(-1, keepdim=True))
        grads["dk"] = rstd_k * (dk_hat - k_hat * (k_hat * dk_hat).sum(-1, keepdim=True))
    else:
        grads["dq"], grads["dk"] = dq_hat, dk_hat
    grads["dv"] = dv
    grads["dg"] = da * da_dz
    if sigmoid_beta:
        sb = torch.sigmoid(beta_raw)
        grads["dbeta"] = dbeta_hat * sb * (1 - sb) * (2.0 if neg else 1.0)
    else:
        grads["dbeta"] = dbeta_hat
    if "outputs" in on:
        for name in ("dq", "dk", "dv", "dbeta"):
            grads[name] = rnd(grads[name], dtype, True)
        grads["dg"] = rnd(grads["dg"], kwargs["g"].dtype, True)
    if kwargs.get("A_log") is not None:
        assert da_dA_log is not None
        grads["dA_log"] = (da * da_dA_log).sum(dim=(0, 1, 3))
    if kwargs.get("dt_bias") is not None:
        grads["ddt_bias"] = (da * da_dz).sum(dim=(0, 1)).reshape(kwargs["dt_bias"].shape)
    if h0 is not None:
        grads["dinitial_state"] = dh0.transpose(-1, -2) if kwargs.get("state_v_first") else dh0
    return grads


def twins(key: str) -> list[str]:
    """`key`'s class with varlen calls and with GVA (where it has neither): what ``--check`` also asserts."""
    case_class = CaseClass.from_key(key)
    keys = [case_class.model_copy(update={"varlen": True}).key, case_class.model_copy(update={"gva": True}).key]
    return [twin for twin in keys if twin != key]


def errors_of(grads: dict[str, torch.Tensor], ref: dict[str, torch.Tensor]) -> dict[str, float]:
    return {name: relative_error(grads[name], ref[name]) for name in ref}


REGIMES = ("realistic", "correlated", "extreme", "variant")  # the verifier's four cases of a class, in its order


def draw(key: str, regime: str, seed: int) -> tuple[dict[str, Any], dict[str, torch.Tensor]]:
    """The verifier's inputs for `key`'s case of that name (`kda.verify.cases.cases_for`, B = 2, H = 2): the
    realistic and correlated ones (4C + 13 tokens), the extreme one (3C - 5) and the variant (C - 3 tokens, a
    single partial chunk, V = K / 2, ``g`` in fp32, a per-column ``dt_bias``). A varlen class packs its
    sequences in one row (B = 1, ``cu_seqlens``; the cases' lengths), a GVA class has two value heads a q/k
    head."""
    cases = cases_for(CaseClass.from_key(key), quick=False)
    return make_inputs(replace(cases[REGIMES.index(regime)], seed=seed), "cpu")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--draws", type=int, default=4, help="random seeds per class and regime")
    parser.add_argument("--regime", nargs="+", default=["realistic", "extreme"], choices=REGIMES)
    parser.add_argument("--class", dest="classes", nargs="+", default=list(DEFAULT_CLASSES))
    parser.add_argument(
        "--config", nargs="+", default=None, help="roundings to keep exact in turn, a+b together (default each one)"
    )
    parser.add_argument("--seed", type=int, nargs="+", default=None, help="these seeds rather than random ones")
    parser.add_argument(
        "--check",
        action="store_true",
        help="assert the unrounded replay is exact (realistic; also the class's varlen and GVA twins, same seed)",
    )
    args = parser.parse_args()
    unknown = [part for name in args.config or () for part in name.split("+") if part not in ROUNDINGS]
    if unknown:
        parser.error(f"--config: no rounding {unknown[0]!r} (the roundings: {', '.join(ROUNDINGS)})")
    configs = configurations(args.config)
    for key in args.classes:
        dtype = CaseClass.from_key(key).dtype
        for regime in args.regime:
            errors: dict[str, list[dict[str, float]]] = {label: [] for label, _ in configs}
            seeds = args.seed or [random.randrange(2**31) for _ in range(args.draws)]
            for seed in seeds:
                kwargs, upstream = draw(key, regime, seed)
                ref = reference_gradients(kwargs, upstream)
                for label, on in configs:
                    errors[label].append(errors_of(replay(kwargs, upstream, on), ref))
                exact = errors["all exact"][-1]
                if args.check and regime == "realistic":
                    assert max(exact.values()) < 1e-10, (key, seed, exact)
                    for twin in twins(key):
                        twin_kwargs, twin_upstream = draw(twin, regime, seed)
                        twin_exact = errors_of(
                            replay(twin_kwargs, twin_upstream, frozenset()),
                            reference_gradients(twin_kwargs, twin_upstream),
                        )
                        assert max(twin_exact.values()) < 1e-10, (twin, seed, twin_exact)
                        print(f"  checked {twin} seed {seed}: unrounded {max(twin_exact.values()):.1e}", flush=True)
            print(f"\n{key} {regime} seeds {seeds}", flush=True)
            for label, _ in configs:
                per_draw = errors[label]
                line = ""
                if "dA_log" in per_draw[0]:
                    dA = [e["dA_log"] for e in per_draw]
                    limit = tolerance("dA_log", dtype)
                    line = f"dA_log median {statistics.median(dA):.2e} worst {max(dA):.2e} "
                    line += f"(tol {limit:.0e}, past it {sum(error > limit for error in dA)} of {len(dA)})  "
                others = {
                    name: max(e[name] for e in per_draw) / tolerance(name, dtype)
                    for name in per_draw[0]
                    if name != "dA_log"
                }
                worst = max(others, key=lambda name: others[name])
                line += f"others worst {worst} {others[worst] * tolerance(worst, dtype):.2e} ({others[worst]:.2f} tol)"
                print(f"  {label:34s} {line}", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
