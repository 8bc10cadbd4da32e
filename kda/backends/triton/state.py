"""Stage 3: the pass over chunks (the only serial part), fused with the output.

One program per (sequence, value head, block of V columns) walks its sequence's chunks in order,
holding the state ``S [K, BV]`` in registers (fp32). For each chunk, with ``w, u, A_qk`` from stage 2 and
``G`` from stage 1 (``G_C`` = the chunk's last row)::

    v_new = u - w @ S                                            [C, BV]   the chunk's deltas
    o     = scale * ((q * exp(G)) @ S + A_qk @ v_new)            [C, BV]
    S     = exp(G_C)[:, None] * S + (k * exp(G_C - G))^T @ v_new          (every exponent <= 0)

``S`` starts from the initial state (either layout) or zero and is stored as the final state.
"""

from __future__ import annotations

import triton
import triton.language as tl

from kda.backends.triton.intra import _inv_norm


@triton.jit
def state_output_kernel(
    q, k,  # [tokens, H, K]
    w, u,  # [tokens, HV, K], [tokens, HV, V] fp32 (stage 2)
    G,  # [tokens, HV, K] fp32 (stage 1)
    A_qk,  # [NT, HV, BT, BT] fp32 (stage 2)
    o,  # [tokens, HV, V] out, in q's dtype
    h0, ht,  # [N, HV, K, V] (or [N, HV, V, K] with V_FIRST) fp32, or dummies
    bounds,  # [N+1] int32 sequence boundaries on the token axis
    chunk_offsets,  # [N] int32 first chunk of each sequence
    scale,
    H: tl.constexpr, HV: tl.constexpr, K: tl.constexpr, V: tl.constexpr,
    L2: tl.constexpr, HAS_H0: tl.constexpr, STORE_HT: tl.constexpr, V_FIRST: tl.constexpr,
    BT: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
):
    i_n, i_hv, i_v = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    i_h = i_hv // (HV // H)
    bos = tl.load(bounds + i_n)
    eos = tl.load(bounds + i_n + 1)
    first_chunk = tl.load(chunk_offsets + i_n)
    kcols = tl.arange(0, BK)
    vcols = i_v * BV + tl.arange(0, BV)
    state_mask = (kcols[:, None] < K) & (vcols[None, :] < V)
    state_base = (i_n.to(tl.int64) * HV + i_hv) * K * V
    if V_FIRST:
        state_off = state_base + vcols[None, :] * K + kcols[:, None]
    else:
        state_off = state_base + kcols[:, None] * V + vcols[None, :]
    if HAS_H0:
        S = tl.load(h0 + state_off, mask=state_mask, other=0.0).to(tl.float32)
    else:
        S = tl.zeros([BK, BV], dtype=tl.float32)

    r = tl.arange(0, BT)
    num_chunks = tl.cdiv(eos - bos, BT)
    for c in range(0, num_chunks):
        start = bos + c * BT
        rows = start + r
        valid = rows < eos
        m_k = valid[:, None] & (kcols[None, :] < K)
        m_v = valid[:, None] & (vcols[None, :] < V)
        k_off = rows[:, None].to(tl.int64) * (HV * K) + i_hv * K + kcols[None, :]
        v_off = rows[:, None].to(tl.int64) * (HV * V) + i_hv * V + vcols[None, :]
        qk_off = rows[:, None].to(tl.int64) * (H * K) + i_h * K + kcols[None, :]

        w_c = tl.load(w + k_off, mask=m_k, other=0.0)
        v_new = tl.load(u + v_off, mask=m_v, other=0.0) - tl.dot(w_c, S, input_precision=DOT_PRECISION)

        g_c = tl.load(G + k_off, mask=m_k, other=0.0)
        q_c = tl.load(q + qk_off, mask=m_k, other=0.0).to(tl.float32)
        q_c = q_c * _inv_norm(q_c, L2)[:, None] * tl.exp(g_c)
        a_off = ((first_chunk + c).to(tl.int64) * HV + i_hv) * BT * BT
        a_qk = tl.load(A_qk + a_off + r[:, None] * BT + r[None, :])
        out = tl.dot(q_c, S, input_precision=DOT_PRECISION) + tl.dot(a_qk, v_new, input_precision=DOT_PRECISION)
        tl.store(o + v_off, (out * scale).to(o.dtype.element_ty), mask=m_v)

        last = tl.minimum(start + BT, eos) - 1
        g_last = tl.load(G + last.to(tl.int64) * (HV * K) + i_hv * K + kcols, mask=kcols < K, other=0.0)
        k_c = tl.load(k + qk_off, mask=m_k, other=0.0).to(tl.float32)
        k_c = k_c * _inv_norm(k_c, L2)[:, None]
        k_c = k_c * tl.where(m_k, tl.exp(tl.where(m_k, g_last[None, :] - g_c, 0.0)), 0.0)
        S = S * tl.exp(g_last)[:, None] + tl.dot(tl.trans(k_c), v_new, input_precision=DOT_PRECISION)

    if STORE_HT:
        tl.store(ht + state_off, S, mask=state_mask)
