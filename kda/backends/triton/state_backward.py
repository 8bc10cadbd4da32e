"""The backward's serial pass over chunks, in reverse: the gradient of the state leaving each chunk.

One program per (sequence, value head, block of BV value columns) walks its sequence's chunks from the
last to the first, holding ``dS [K, BV]`` (fp32) in registers; it starts from ``dht`` (the final state's
gradient) or zero::

    dh[c] = dS;  dd = scale A_qk^T do + k~ dS;  dS <- e^(G_C) dS + scale q~^T do - w^T dd

(``k~ = k e^(G_C - G)``, ``q~ = q e^G``); the last ``dS`` is ``dh0``. ``dd`` is the gradient of the chunk's
``v_new``, read by the per-chunk kernel (`chunk_backward`).

Shapes: q, k ``[tokens, H, K]``; G, w ``[tokens, HV, K]`` fp32; A_qk ``[NT, HV, C, C]`` fp32; do ``[tokens,
HV, V]``; out: dd ``[tokens, HV, V]`` and dh ``[NT, HV, K, V]`` fp32, dh0 ``[N, HV, K, V]`` (or V-first).
Grid ``(N, HV, V / BV)``.
"""

from __future__ import annotations

import triton
import triton.language as tl

from kda.backends.triton.storage import dot
from kda.backends.triton.tiles import inv_norm, state_tile


@triton.jit
def bwd_state_kernel(
    q,
    k,  # [tokens, H, K]
    G,
    w,  # [tokens, HV, K] fp32
    A_qk,  # [NT, HV, BT, BT] fp32
    do,  # [tokens, HV, V]
    dd,  # [tokens, HV, V] fp32 out: gradient of v_new
    dh,  # [NT, HV, K, V] fp32 out: gradient of the state leaving each chunk
    dht,
    dh0,  # [N, HV, K, V] (or V-first) fp32, or dummies
    bounds,
    chunk_offsets,
    scale,
    H: tl.constexpr,
    HV: tl.constexpr,
    K: tl.constexpr,
    V: tl.constexpr,
    L2: tl.constexpr,
    HAS_DHT: tl.constexpr,
    STORE_DH0: tl.constexpr,
    V_FIRST: tl.constexpr,
    BT: tl.constexpr,
    BK: tl.constexpr,
    BV: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
):
    i_n, i_hv, i_v = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    i_h = i_hv // (HV // H)
    bos = tl.load(bounds + i_n)
    eos = tl.load(bounds + i_n + 1)
    first_chunk = tl.load(chunk_offsets + i_n)
    kcols = tl.arange(0, BK)
    vcols = i_v * BV + tl.arange(0, BV)
    state_off, state_mask = state_tile(i_n, i_hv, kcols, vcols, HV, K, V, V_FIRST)
    if HAS_DHT:
        dS = tl.load(dht + state_off, mask=state_mask, other=0.0).to(tl.float32)
    else:
        dS = tl.zeros([BK, BV], dtype=tl.float32)
    r = tl.arange(0, BT)
    num_chunks = tl.cdiv(eos - bos, BT)
    for i in range(num_chunks):
        c = num_chunks - 1 - i
        start = bos + c * BT
        rows = start + r
        valid = rows < eos
        m_k = valid[:, None] & (kcols[None, :] < K)
        m_v = valid[:, None] & (vcols[None, :] < V)
        k_off = rows[:, None].to(tl.int64) * (HV * K) + i_hv * K + kcols[None, :]
        v_off = rows[:, None].to(tl.int64) * (HV * V) + i_hv * V + vcols[None, :]
        qk_off = rows[:, None].to(tl.int64) * (H * K) + i_h * K + kcols[None, :]
        chunk = (first_chunk + c).to(tl.int64) * HV + i_hv
        tl.store(dh + chunk * K * V + kcols[:, None] * V + vcols[None, :], dS, mask=state_mask)

        g_c = tl.load(G + k_off, mask=m_k, other=0.0)
        last = tl.minimum(start + BT, eos) - 1
        g_last = tl.load(G + last.to(tl.int64) * (HV * K) + i_hv * K + kcols, mask=kcols < K, other=0.0)
        q_c = tl.load(q + qk_off, mask=m_k, other=0.0).to(tl.float32)
        q_c = q_c * inv_norm(q_c, L2)[:, None] * tl.exp(g_c)
        k_c = tl.load(k + qk_off, mask=m_k, other=0.0).to(tl.float32)
        k_c = k_c * inv_norm(k_c, L2)[:, None]
        k_c = k_c * tl.where(m_k, tl.exp(tl.where(m_k, g_last[None, :] - g_c, 0.0)), 0.0)
        do_c = tl.load(do + v_off, mask=m_v, other=0.0).to(tl.float32)
        a_qk = tl.load(A_qk + chunk * BT * BT + r[:, None] * BT + r[None, :])
        dd_c = scale * dot(tl.trans(a_qk), do_c, DOT_PRECISION) + dot(k_c, dS, DOT_PRECISION)
        tl.store(dd + v_off, dd_c, mask=m_v)
        w_c = tl.load(w + k_off, mask=m_k, other=0.0)
        dS = (
            dS * tl.exp(g_last)[:, None]
            + scale * dot(tl.trans(q_c), do_c, DOT_PRECISION)
            - dot(tl.trans(w_c), dd_c, DOT_PRECISION)
        )
    if STORE_DH0:
        tl.store(dh0 + state_off, dS, mask=state_mask)
