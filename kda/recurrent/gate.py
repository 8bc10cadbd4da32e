"""`kda_gate`: KDA's gate activation on its own, as FLA 0.6's `fla.ops.kda.gate.fused_kda_gate` computes it.

For models that apply the gate outside the attention call (then pass its result as a pre-gated ``g``).
Plain torch ops, computed in fp32 whatever the input dtypes, differentiable through autograd.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F

from kda.errors import KDAInputError


def kda_gate(
    g: torch.Tensor,
    A_log: torch.Tensor | None,
    dt_bias: torch.Tensor | None = None,
    lower_bound: float | None = None,
    output_dtype: torch.dtype = torch.float32,
) -> torch.Tensor:
    """The KDA log decay from the raw gate input, in fp32, returned in `output_dtype`.

    ``g`` is ``[..., H, K]``; ``A_log`` holds H values (any shape, e.g. ``[H]`` or ``[1, 1, H, 1]``);
    ``dt_bias`` H*K values (``[H*K]`` or ``[H, K]``)::

        lower_bound None:  -exp(A_log[h]) * softplus(g + dt_bias[h])          (A_log required)
        lower_bound set:   lower_bound * sigmoid(exp(A_log[h]) * (g + dt_bias[h]))
                           lower_bound * sigmoid(g + dt_bias[h])              (A_log None)

    No floor is applied here (the attention ops floor the log decay at -32 themselves). Raises
    `KDAInputError` naming the argument when a shape does not fit.
    """
    if not isinstance(g, torch.Tensor) or g.dim() < 2:
        raise KDAInputError(
            "g", "must be a tensor [..., H, K]", None if not isinstance(g, torch.Tensor) else list(g.shape)
        )
    H, K = g.shape[-2:]
    if A_log is None and lower_bound is None:
        raise KDAInputError("A_log", "the softplus gate (lower_bound=None) requires A_log", "None")
    if A_log is not None and A_log.numel() != H:
        raise KDAInputError("A_log", f"must hold H = {H} values", list(A_log.shape))
    if dt_bias is not None and dt_bias.numel() != H * K:
        raise KDAInputError("dt_bias", f"must hold H*K = {H * K} values ([H*K] or [H, K])", list(dt_bias.shape))
    if lower_bound is not None and (isinstance(lower_bound, bool) or not math.isfinite(float(lower_bound))):
        raise KDAInputError("lower_bound", "must be a finite number or None", repr(lower_bound))
    x = g.float()
    if dt_bias is not None:
        x = x + dt_bias.float().reshape(H, K)
    A = None if A_log is None else A_log.float().reshape(H, 1).exp()
    if lower_bound is None:
        assert A is not None
        y = -A * F.softplus(x)
    else:
        y = float(lower_bound) * torch.sigmoid(x if A is None else A * x)
    return y.to(output_dtype)
