"""Stage 3: the pass over chunks (the only serial part).

One program per (sequence, value head, block of V columns) walks its sequence's chunks in order,
holding the state ``S [K, BV]`` in registers (fp32). For each chunk, with ``w, u, k_g = k exp(G_C - G)``
from stage 2 and ``G_C`` the last row of stage 1's ``G`` (the only row of ``G`` it reads)::

    h[chunk] = S                                                  the state entering the chunk
    v_new    = u - w @ S                                          [C, BV]   the chunk's deltas (over u)
    S        = exp(G_C)[:, None] * S + k_g^T @ v_new                           (every exponent <= 0)

``w``, ``k_g``, ``u`` arrive and ``h``, ``v_new`` leave in the storage dtype (`storage`); ``S`` and
``v_new`` stay fp32 in registers, so the recurrence itself never reads back a rounded value. With bf16/fp16
storage (inference) the two products run on half-width tensor cores (fp32 accumulation): their operands
are ``w`` and ``k_g`` as stored and ``S`` and ``v_new`` rounded to the storage dtype, which is what ``h`` and
``v_new`` are stored as anyway. Only the products' copies are rounded; the carried ``S`` is not.

``S`` starts from the initial state (either layout) or zero and ends as the final state. The output
needs ``h`` and ``v_new`` and no order between chunks, so it is computed in stage 4 (`output`), in
parallel over chunks, instead of on this serial path.
"""

from __future__ import annotations

import triton
import triton.language as tl

from kda.backends.triton.storage import dot, operand, stored
from kda.backends.triton.tiles import state_tile


@triton.jit
def _factor(x, STORED_OPERANDS: tl.constexpr, ROUND: tl.constexpr, like=None):
    """``x`` as a product's operand: in the storage dtype with ``STORED_OPERANDS`` (an fp32 ``x`` rounded to
    ``like``'s element type first; a loaded one is in it already), else in fp32."""
    if STORED_OPERANDS:
        if like is not None:
            x = stored(x, like, ROUND)
        x = operand(x, ROUND)
    else:
        x = x.to(tl.float32)
    return x


@triton.jit
def state_pass_kernel(
    k_g,  # [tokens, HV, K] (stage 2): k exp(G_C - G)
    w,  # [tokens, HV, K] (stage 2)
    u,  # [tokens, HV, V] (stage 2) in, v_new out (in place)
    G,  # [tokens, HV, K] fp32 (stage 1): only each chunk's last row is read
    h,  # [NT, HV, K, V] out: the state entering each chunk
    h0,
    ht,  # [N, HV, K, V] (or [N, HV, V, K] with V_FIRST) fp32, or dummies
    bounds,  # [N+1] int32 sequence boundaries on the token axis
    chunk_offsets,  # [N] int32 first chunk of each sequence
    HV: tl.constexpr,
    K: tl.constexpr,
    V: tl.constexpr,
    HAS_H0: tl.constexpr,
    STORE_HT: tl.constexpr,
    V_FIRST: tl.constexpr,
    BT: tl.constexpr,
    BK: tl.constexpr,
    BV: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
    ROUND: tl.constexpr,
    STORED_OPERANDS: tl.constexpr,  # products in the storage dtype (bf16/fp16; see the module docstring)
):
    i_n, i_hv, i_v = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    bos = tl.load(bounds + i_n)
    eos = tl.load(bounds + i_n + 1)
    first_chunk = tl.load(chunk_offsets + i_n)
    kcols = tl.arange(0, BK)
    vcols = i_v * BV + tl.arange(0, BV)
    state_off, state_mask = state_tile(i_n, i_hv, kcols, vcols, HV, K, V, V_FIRST)
    if HAS_H0:
        S = tl.load(h0 + state_off, mask=state_mask, other=0.0).to(tl.float32)
    else:
        S = tl.zeros([BK, BV], dtype=tl.float32)

    r = tl.arange(0, BT)
    num_chunks = tl.cdiv(eos - bos, BT)
    for c in range(num_chunks):
        start = bos + c * BT
        rows = start + r
        valid = rows < eos
        m_k = valid[:, None] & (kcols[None, :] < K)
        m_v = valid[:, None] & (vcols[None, :] < V)
        k_off = rows[:, None].to(tl.int64) * (HV * K) + i_hv * K + kcols[None, :]
        v_off = rows[:, None].to(tl.int64) * (HV * V) + i_hv * V + vcols[None, :]

        h_off = ((first_chunk + c).to(tl.int64) * HV + i_hv) * K * V + kcols[:, None] * V + vcols[None, :]
        tl.store(h + h_off, stored(S, h, ROUND), mask=state_mask)

        w_c = tl.load(w + k_off, mask=m_k, other=0.0)
        last = tl.minimum(start + BT, eos) - 1
        g_last = tl.load(G + last.to(tl.int64) * (HV * K) + i_hv * K + kcols, mask=kcols < K, other=0.0)
        k_c = tl.load(k_g + k_off, mask=m_k, other=0.0)
        v_new = tl.load(u + v_off, mask=m_v, other=0.0).to(tl.float32) - dot(
            _factor(w_c, STORED_OPERANDS, ROUND), _factor(S, STORED_OPERANDS, ROUND, w), DOT_PRECISION
        )
        tl.store(u + v_off, stored(v_new, u, ROUND), mask=m_v)
        product = dot(
            tl.trans(_factor(k_c, STORED_OPERANDS, ROUND)), _factor(v_new, STORED_OPERANDS, ROUND, u), DOT_PRECISION
        )
        S = S * tl.exp(g_last)[:, None] + product

    if STORE_HT:
        tl.store(ht + state_off, S, mask=state_mask)
