"""Stage 0 (with ``use_qk_l2norm_in_kernel``): q and k normalized once, for every later stage to read.

Per token and q/k head::

    r = 1 / sqrt(sum_c x[c]^2 + eps)        x^ = r x        (eps = kda.reference.L2NORM_EPS)

``x^`` is stored in the storage dtype and ``r`` in fp32 (the backward's tail needs it). Normalizing here
rather than inside the score and WY stages costs one read and one write of q and k, and spares those
stages a first pass over ``K`` for the norm. Grid ``(tokens / BT, H)``, ``K`` whole.
"""

from __future__ import annotations

import helion.language as hl
import torch

from kda.reference import L2NORM_EPS


def normalize_kernel(
    x: torch.Tensor,  # [tokens, H, K]
    x_hat: torch.Tensor,  # [tokens, H, K] out
    rstd: torch.Tensor,  # [tokens, H] fp32 out
) -> None:
    tokens = x.size(0)
    H = x.size(1)
    hl.specialize(x.size(2))
    for tile_t, tile_h in hl.tile([tokens, H], block_size=[None, 1]):
        x_t = x[tile_t, tile_h.begin, :].to(torch.float32)  # [BT, K]
        r = torch.rsqrt(torch.sum(x_t * x_t, dim=1) + L2NORM_EPS)
        x_hat[tile_t, tile_h.begin, :] = (x_t * r[:, None]).to(x_hat.dtype)
        rstd[tile_t, tile_h.begin] = r
