"""q and k as the tilelang backward's stages take them, and as their references take them.

With the l2norm the training forward stores no normalized rows: it keeps each row's reciprocal norm
``r = 1 / sqrt(|x|^2 + eps)`` (fp32, `intra`), and `chunk_backward`, `score_backward` and `qk_tail` read the
rows as the call gave them (the inputs' dtype) with ``r``, forming the rows the forward used, ``x r``, in
fp32. The references take those rows: ``x`` in fp32 times ``r``, the value the kernels form.
"""

from __future__ import annotations

import torch

from kda.reference import L2NORM_EPS


def inputs_and_scales(
    shape: tuple[int, ...], dtype: torch.dtype, l2norm: bool, generator: torch.Generator | None = None
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Random rows ``[tokens, H, K]`` on the CPU: ``(x, r, rows)``.

    ``x`` is what the kernel reads, in `dtype`: with the l2norm rows of any size (3 times a standard normal,
    so that ``r`` is far from 1 and a kernel that left it out is far off); without it rows of norm about 1,
    as l2-normalized keys would be, so that the chunk's inverse stays well conditioned. ``r [tokens, H]`` is
    fp32, as `intra` forms it (without the l2norm a ``[1]`` placeholder the kernels do not read). ``rows``
    is fp32, what the reference takes: ``x r`` formed as the kernels form it, or ``x`` itself."""
    raw = torch.randn(*shape, generator=generator)
    if not l2norm:
        x = (raw / raw.norm(dim=-1, keepdim=True)).to(dtype)
        return x, torch.zeros(1), x.float()
    x = (3.0 * raw).to(dtype)
    x32 = x.float()
    r = torch.rsqrt((x32 * x32).sum(-1) + L2NORM_EPS)
    return x, r, x32 * r[..., None]
