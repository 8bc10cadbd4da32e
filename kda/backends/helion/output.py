"""Stage 5: the output, in parallel over chunks.

For chunk ``j`` of value head ``hv``, with ``q_e = scale q exp(G)`` and ``A_qk`` (scaled, causal) from stage
2, ``h[j]`` the state entering the chunk and ``v_new`` from stage 4::

    o = q_e @ h[j] + A_qk @ v_new                 [C, V]

stored token-major in the inputs' dtype, rows past the sequence's end left alone. Grid ``(NT, HV, V / BV)``.
"""

from __future__ import annotations

import helion.language as hl
import torch


def output_kernel(
    q_e: torch.Tensor,  # [NT, HV, C, K] storage dtype
    h: torch.Tensor,  # [NT, HV, K, V] storage dtype
    A_qk: torch.Tensor,  # [NT, HV, C, C] storage dtype
    v_new: torch.Tensor,  # [NT, HV, C, V] storage dtype
    chunk_starts: torch.Tensor,  # [NT] int32
    chunk_seq_ends: torch.Tensor,  # [NT] int32
    o: torch.Tensor,  # [tokens, HV, V] out
    C: hl.constexpr,
) -> None:
    NT = q_e.size(0)
    HV = q_e.size(1)
    V = v_new.size(3)
    for tile_c, tile_hv, tile_v in hl.tile([NT, HV, V], block_size=[1, 1, None]):
        c = tile_c.begin
        hv = tile_hv.begin
        rows = chunk_starts[c] + hl.arange(C)
        valid = rows < chunk_seq_ends[c]
        acc = hl.dot(q_e[c, hv, :, :], h[c, hv, :, tile_v])
        acc = hl.dot(A_qk[c, hv, :, :], v_new[c, hv, :, tile_v], acc=acc)
        hl.store(o, [rows, hv, tile_v], acc.to(o.dtype), extra_mask=valid[:, None])
