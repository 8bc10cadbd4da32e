"""Stage 0 (with ``use_qk_l2norm_in_kernel``): the l2norm's scale of each row of q and of k.

Per token and q/k head::

    r = 1 / sqrt(sum_c x[c]^2 + eps)        x^ = r x        (eps = kda.reference.L2NORM_EPS)

Only ``r`` is stored (fp32, ``[tokens, H]``): every later stage reads the rows as the caller gave them and
multiplies each by its ``r`` as it loads it, so ``x^`` is never written. A stored ``x^`` would be two
``[tokens, H, K]`` tensors more, in fp32 when training, kept for the backward: at B4_T2048_H16_D128 128 MiB
of a training call's peak (`benchmarks/peak_memory.py`). One launch for both q and k: grid ``(tokens / BT,
H)``, ``K`` whole.
"""

from __future__ import annotations

import helion.language as hl
import torch

from kda.reference import L2NORM_EPS


def normalize_kernel(
    q: torch.Tensor,  # [tokens, H, K]
    k: torch.Tensor,  # [tokens, H, K]
    rstd_q: torch.Tensor,  # [tokens, H] fp32 out
    rstd_k: torch.Tensor,  # [tokens, H] fp32 out
) -> None:
    tokens = q.size(0)
    H = q.size(1)
    hl.specialize(q.size(2))
    hl.specialize(k.size(2))
    for tile_t, tile_h in hl.tile([tokens, H], block_size=[None, 1]):
        q_t = q[tile_t, tile_h.begin, :].to(torch.float32)  # [BT, K]
        rstd_q[tile_t, tile_h.begin] = torch.rsqrt(torch.sum(q_t * q_t, dim=1) + L2NORM_EPS)
        k_t = k[tile_t, tile_h.begin, :].to(torch.float32)
        rstd_k[tile_t, tile_h.begin] = torch.rsqrt(torch.sum(k_t * k_t, dim=1) + L2NORM_EPS)
