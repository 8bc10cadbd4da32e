"""Stage 1: the gate activation and the beta activation, with the in-chunk cumulative sum of the gate.

Per value head ``hv`` and chunk, with ``x = g + dt_bias[hv]`` and ``A = exp(A_log[hv])`` (1 without ``A_log``)::

    pregated   a_t = g_t                                   (already a log decay)
    softplus   a_t = -A softplus(x_t)
    sigmoid    a_t = lower_bound sigmoid(A x_t)           (the safe gate too: it only promises -5 <= bound < 0)
    G_t = sum_{s <= t, s in chunk} max(a_s, LOG_DECAY_FLOOR)          fp32, non-increasing in t
    beta_t = beta_t, sigmoid(beta_t) or 2 sigmoid(beta_t)              fp32

The floor (`kda.reference.LOG_DECAY_FLOOR`; not on the safe gate, which stays above -5) is a ``where``, so a
NaN stays NaN. The sum runs 16 rows at a time, each block's scan added to the sum carried from the block
before: the partial sums inside a block stay small and only the carry rounds at the magnitude of ``G``
(a whole-chunk scan rounds at that magnitude at every level of its tree; ``dA_log`` shows the difference
with saturated softplus gates).

Both outputs are chunk-major, ``G [NT, HV, C, K]`` and ``beta [NT, HV, C]``, so that every later stage
reads a chunk as one dense tile. Rows past the sequence's end hold ``G`` flat at the last token's value and
``beta = 0``: a tail row then adds nothing anywhere downstream.
"""

from __future__ import annotations

import helion.language as hl
import torch

from kda.reference import LOG_DECAY_FLOOR

# Values of GATE. Kernels compare GATE with literals: a module constant would reach the generated code as a
# runtime argument, and the branches on it would be compiled in, not out.
PREGATED, SOFTPLUS, SIGMOID, SAFE = 0, 1, 2, 3
ROWS = 16  # rows per scan block


def gate_kernel(
    g: torch.Tensor,  # [tokens, HV, K] raw gate input, any float dtype
    beta: torch.Tensor,  # [tokens, HV] beta as given
    A_log: torch.Tensor,  # [HV] (zeros without one: exp(0) = 1)
    dt_bias: torch.Tensor,  # [HV, K] (a placeholder without one)
    chunk_starts: torch.Tensor,  # [NT] int32 first token of each chunk
    chunk_seq_ends: torch.Tensor,  # [NT] int32 end of the chunk's sequence
    G: torch.Tensor,  # [NT, HV, C, K] fp32 out
    beta_out: torch.Tensor,  # [NT, HV, C] fp32 out
    lower_bound: float,
    beta_scale: float,  # 2 with allow_neg_eigval, else 1
    C: hl.constexpr,
    GATE: hl.constexpr,
    HAS_DT_BIAS: hl.constexpr,
    BETA_SIGMOID: hl.constexpr,
) -> None:
    NT = G.size(0)
    HV = G.size(1)
    K = G.size(3)
    for tile_c, tile_hv in hl.tile([NT, HV], block_size=[1, 1]):
        start = chunk_starts[tile_c.begin]
        end = chunk_seq_ends[tile_c.begin]
        rows = start + hl.arange(C)
        valid = rows < end
        b = hl.load(beta, [rows, tile_hv.begin], extra_mask=valid).to(torch.float32)
        if BETA_SIGMOID:
            b = torch.sigmoid(b) * beta_scale
        beta_out[tile_c.begin, tile_hv.begin, :] = torch.where(valid, b, 0.0)
        A = torch.exp(A_log[tile_hv.begin].to(torch.float32))  # the host passes zeros without A_log
        for tile_k in hl.tile(K):
            carry = hl.zeros([tile_k], dtype=torch.float32)  # G at the row before the block
            for tile_r in hl.tile(C, block_size=ROWS):
                rows_r = start + tile_r.index
                valid_r = rows_r < end
                x = hl.load(g, [rows_r, tile_hv.begin, tile_k], extra_mask=valid_r[:, None]).to(torch.float32)
                if GATE != 0:  # not pre-gated
                    if HAS_DT_BIAS:
                        x = x + dt_bias[tile_hv.begin, tile_k].to(torch.float32)[None, :]
                    if GATE == 1:  # softplus
                        # softplus(x) = log(1 + e^x), without overflow for large x (torch's threshold, 20)
                        x = -A * torch.where(x > 20.0, x, torch.log1p(torch.exp(torch.clamp(x, max=20.0))))
                    else:
                        x = lower_bound * torch.sigmoid(A * x)
                if GATE != 3:  # not safe
                    x = torch.where(x < LOG_DECAY_FLOOR, LOG_DECAY_FLOOR, x)
                x = torch.where(valid_r[:, None], x, 0.0)
                G[tile_c.begin, tile_hv.begin, tile_r, tile_k] = carry[None, :] + torch.cumsum(x, dim=0)
                carry = carry + torch.sum(x, dim=0)
