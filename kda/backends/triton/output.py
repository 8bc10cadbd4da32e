"""Stage 4: the output, in parallel over chunks.

Per chunk of value head ``hv``, with ``h`` the state entering the chunk and ``v_new`` its deltas (stage
3), ``A_qk`` the in-chunk scores (stage 2) and ``G`` the in-chunk cumulative log decay (stage 1)::

    o = scale * ((q * exp(G)) @ h + A_qk @ v_new)            [C, BV]      (exp(G) <= 1)

With intermediates stored in bf16/fp16 (inference), both products run on the half-width tensor cores with
fp32 accumulation, as the stored operands are (``q exp(G)`` is rounded once to their dtype).

Grid ``(NT, HV, V / BV)``.
"""

from __future__ import annotations

import triton
import triton.language as tl

from kda.backends.triton.storage import dot, operand, stored
from kda.backends.triton.tiles import inv_norm


@triton.jit
def output_kernel(
    q,  # [tokens, H, K]
    G,  # [tokens, HV, K] fp32
    h,  # [NT, HV, K, V] (storage dtype, as the next two)
    v_new,  # [tokens, HV, V]
    A_qk,  # [NT, HV, BT, BT]
    o,  # [tokens, HV, V] out, in q's dtype
    chunk_starts,
    chunk_seq_ends,  # [NT] int32
    scale,
    H: tl.constexpr,
    HV: tl.constexpr,
    K: tl.constexpr,
    V: tl.constexpr,
    L2: tl.constexpr,
    BT: tl.constexpr,
    BK: tl.constexpr,
    BV: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
    ROUND: tl.constexpr,
    STORED_OPERANDS: tl.constexpr,  # products take h, v_new, A_qk as stored (bf16/fp16; see `storage`)
):
    i_c, i_hv, i_v = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    i_h = i_hv // (HV // H)
    start = tl.load(chunk_starts + i_c)
    end = tl.minimum(tl.load(chunk_seq_ends + i_c), start + BT)
    r = tl.arange(0, BT)
    rows = start + r
    valid = rows < end
    kcols = tl.arange(0, BK)
    vcols = i_v * BV + tl.arange(0, BV)
    m_k = valid[:, None] & (kcols[None, :] < K)
    m_v = valid[:, None] & (vcols[None, :] < V)

    q_c = tl.load(q + rows[:, None].to(tl.int64) * (H * K) + i_h * K + kcols[None, :], mask=m_k, other=0.0).to(
        tl.float32
    )
    g_c = tl.load(G + rows[:, None].to(tl.int64) * (HV * K) + i_hv * K + kcols[None, :], mask=m_k, other=0.0)
    q_c = q_c * inv_norm(q_c, L2)[:, None] * tl.exp(g_c)
    h_c = tl.load(
        h + (i_c.to(tl.int64) * HV + i_hv) * K * V + kcols[:, None] * V + vcols[None, :],
        mask=(kcols[:, None] < K) & (vcols[None, :] < V),
        other=0.0,
    )
    v_off = rows[:, None].to(tl.int64) * (HV * V) + i_hv * V + vcols[None, :]
    d_c = tl.load(v_new + v_off, mask=m_v, other=0.0)
    a_qk = tl.load(A_qk + (i_c.to(tl.int64) * HV + i_hv) * BT * BT + r[:, None] * BT + r[None, :])
    if STORED_OPERANDS:  # half-width tensor cores; only q e^G is rounded here, the rest was rounded when stored
        q_c = operand(stored(q_c, h, ROUND), ROUND)
        h_c, d_c, a_qk = operand(h_c, ROUND), operand(d_c, ROUND), operand(a_qk, ROUND)
    else:
        h_c, d_c, a_qk = h_c.to(tl.float32), d_c.to(tl.float32), a_qk.to(tl.float32)
    out = dot(q_c, h_c, DOT_PRECISION) + dot(a_qk, d_c, DOT_PRECISION)
    tl.store(o + v_off, stored(out * scale, o, ROUND), mask=m_v)
