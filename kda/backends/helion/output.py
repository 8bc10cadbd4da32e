"""Stage 5: the output, in parallel over chunks.

For chunk ``j`` of value head ``hv`` (q/k head ``hv // group``), with ``A_qk`` (scaled, causal) from stage
2, ``h[j]`` the state entering the chunk and ``v_new`` from stage 4::

    q_e = scale q exp(G)                          [C, K]   (q times its l2norm scale r with L2)
    o   = q_e @ h[j] + A_qk @ v_new               [C, V]

``q_e`` is read as `scores` stored it at inference (``STORED``); in training it is made here from ``q``
and ``G`` and rounded to the storage dtype (`kda/backends/helion/forward.py` says why). Training on 16-bit
inputs (``HALVES``) ``A_qk`` is read as the bf16 halves `scores` stored and taken as ``hi + lo`` in fp32
(``A_qk`` to 16 significant bits; the product is one TF32 either way). ``o`` is stored
token-major in the inputs' dtype, rows past the sequence's end left alone. Grid ``(NT, HV, V / BV)``.
"""

from __future__ import annotations

import helion.language as hl
import torch


def output_kernel(
    q_e: torch.Tensor,  # [NT, HV, C, K] storage dtype with STORED (else a placeholder)
    q: torch.Tensor,  # [tokens, H, K] as given
    rstd_q: torch.Tensor,  # [tokens, H] fp32 with L2, else a placeholder
    G: torch.Tensor,  # [NT, HV, C, K] fp32
    h: torch.Tensor,  # [NT, HV, K, V] storage dtype
    A_qk: torch.Tensor,  # [NT, HV, C, C] storage dtype; [NT, HV, 2, C, C] bf16 halves with HALVES
    v_new: torch.Tensor,  # [NT, HV, C, V] storage dtype
    chunk_starts: torch.Tensor,  # [NT] int32
    chunk_seq_ends: torch.Tensor,  # [NT] int32
    o: torch.Tensor,  # [tokens, HV, V] out
    scale: float,
    group: int,  # HV // H
    C: hl.constexpr,
    L2: hl.constexpr,
    STORED: hl.constexpr,  # q_e read as stored (inference), else made from q and G
    HALVES: hl.constexpr,  # A_qk read as bf16 halves (training on 16-bit inputs)
) -> None:
    NT = G.size(0)
    HV = G.size(1)
    K = hl.specialize(q.size(2))
    V = v_new.size(3)
    for tile_c, tile_hv, tile_v in hl.tile([NT, HV, V], block_size=[1, 1, None]):
        c = tile_c.begin
        hv = tile_hv.begin
        head = hv // group
        rows = chunk_starts[c] + hl.arange(C)
        valid = rows < chunk_seq_ends[c]
        if STORED:
            q_c = q_e[c, hv, :, :]  # [C, K]
        else:
            q_c = hl.load(q, [rows, head, hl.arange(K)], extra_mask=valid[:, None]).to(torch.float32)
            if L2:
                q_c = q_c * hl.load(rstd_q, [rows, head], extra_mask=valid)[:, None]
            q_c = (scale * q_c * torch.exp(G[c, hv, :, :])).to(h.dtype)
        acc = hl.dot(q_c, h[c, hv, :, tile_v])
        if HALVES:
            A_c = A_qk[c, hv, 0, :, :].to(torch.float32) + A_qk[c, hv, 1, :, :].to(torch.float32)
            acc = hl.dot(A_c, v_new[c, hv, :, tile_v], acc=acc)
        else:
            acc = hl.dot(A_qk[c, hv, :, :], v_new[c, hv, :, tile_v], acc=acc)
        hl.store(o, [rows, hv, tile_v], acc.to(o.dtype), extra_mask=valid[:, None])
