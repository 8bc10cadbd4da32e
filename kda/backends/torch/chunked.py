"""Stage 2 of the torch backend: the pass over chunks that carries the state, and the output.

Dense layout, one value head per row of the batch: q, k, g ``[B, HV, T, K]``, v ``[B, HV, T, V]``,
beta ``[B, HV, T]``, state ``[B, HV, K, V]``. For each chunk (``Gamma`` its cumulative decay, ``S`` the
state entering it, see `intra` for ``A_qk``, ``W``, ``U``)::

    V_new = U - W S
    O     = scale * ((Q * exp(Gamma)) S + A_qk V_new)             (A_qk V_new: `intra.causal_product`)
    S    <- exp(Gamma_last)[:, None] * S + (exp(Gamma_last - Gamma) * K)^T V_new

T is padded up to a multiple of the chunk with tokens that change nothing (k = v = q = 0, beta = 0,
g = 0: no decay, no update), so a ragged tail needs no special case.

``Gamma`` is summed in float64, and every exponent is formed from it in float64 and rounded once to the
compute dtype just before ``exp``. Two reasons, both about saturated gates (log decays of -50 to -500 a
token, so ``Gamma`` reaches about -1000 inside a chunk): in fp32 such a ``Gamma`` has an ulp of 6e-5, so
``Gamma_i - Gamma_j`` for nearby tokens would carry an absolute error of that size; and autograd's
gradient of the per-token log decay is a reverse cumsum of O(1) terms that cancel where the decay is
tiny, which in fp32 leaves ~1e-8 residuals that ``dA_log = sum a da`` multiplies by ``a`` (in the
hundreds). In float64 both errors vanish, at the cost of a transient float64 ``[C, C, K]`` difference.

A per-token log decay below ``kda.reference.LOG_DECAY_FLOOR`` (-32) is computed as the floor: one of -1e30
would leave ``Gamma_i - Gamma_j`` of the chunk's other tokens at float64's resolution of 1e30 (1e14), and
-inf would make it -inf - -inf = NaN, where exp(-32) is already a reset to far within fp32's resolution.
Below the floor the gradient with respect to the log decay is 0 (the true one is ~exp(g)).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from kda.backends.torch.intra import causal_product, chunk_scores, rounded_exp, wy_transform
from kda.reference import LOG_DECAY_FLOOR


def chunked_delta_rule(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    scale: float,
    initial_state: torch.Tensor | None,
    chunk_size: int,
    chunk_states: list[torch.Tensor] | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The chunked gated delta rule. Returns ``o [B, HV, T, V]`` and the final state ``[B, HV, K, V]``,
    in the dtype of the inputs (which must all share one floating dtype). With `chunk_states` a list, the
    state entering each chunk (``[B, HV, K, V]``) is appended to it."""
    B, HV, T, K = q.shape
    V = v.shape[-1]
    C = chunk_size
    g = g.clamp(min=LOG_DECAY_FLOOR)  # a reset, not -inf (see the module docstring); NaN stays NaN
    pad = (-T) % C
    if pad:
        q, k, g = (F.pad(x, (0, 0, 0, pad)) for x in (q, k, g))
        v = F.pad(v, (0, 0, 0, pad))
        beta = F.pad(beta, (0, pad))
    num_chunks = (T + pad) // C

    S = q.new_zeros(B, HV, K, V) if initial_state is None else initial_state
    outputs = []
    for c in range(num_chunks):
        if chunk_states is not None:
            chunk_states.append(S)
        span = slice(c * C, (c + 1) * C)
        q_c, k_c, v_c, b_c = q[:, :, span], k[:, :, span], v[:, :, span], beta[:, :, span]
        # [B, HV, C, K] float64, <= 0 and non-increasing along C (see the module docstring)
        gamma = g[:, :, span].to(torch.float64).cumsum(dim=-2)
        A_qk, A_kk = chunk_scores(q_c, k_c, b_c, gamma)
        W, U = wy_transform(A_kk, k_c, v_c, b_c, gamma)
        v_new = U - W @ S  # [B, HV, C, V]
        outputs.append(scale * ((q_c * rounded_exp(gamma, q.dtype)) @ S + causal_product(A_qk, v_new)))
        last = gamma[:, :, -1:, :]  # [B, HV, 1, K]
        k_late = rounded_exp(last - gamma, q.dtype) * k_c  # exp(Gamma_last - Gamma) K
        S = rounded_exp(last.transpose(-1, -2), q.dtype) * S + k_late.transpose(-1, -2) @ v_new
    o = torch.cat(outputs, dim=2)[:, :, :T]
    return o, S
