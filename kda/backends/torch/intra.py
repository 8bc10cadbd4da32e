"""Stage 1 of the torch backend: everything inside one chunk that does not depend on the state.

For a chunk of C tokens (rows i, columns j) with the within-chunk cumulative log decay
``Gamma = cumsum(g)`` (``[..., C, K]``)::

    decay[i, j, d] = exp(Gamma[i, d] - Gamma[j, d])              for j <= i, else 0
    A_qk[i, j]     = sum_d q[i, d] k[j, d] decay[i, j, d]         (j <= i)
    A_kk[i, j]     = beta[i] sum_d k[i, d] k[j, d] decay[i, j, d] (j <  i)
    W = (I + A_kk)^-1 (beta * (exp(Gamma) * K))                    the WY transform
    U = (I + A_kk)^-1 (beta * V)

The decay is formed from the pairwise difference of cumulative decays and masked *before* the
exponential, so every exponent is <= 0: nothing overflows however long the chunk's cumulative decay
(unlike ``exp(Gamma_i) * exp(-Gamma_j)``, which overflows fp32 once the chunk decays past ~88). The price
is a ``[..., C, C, K]`` intermediate: this backend favours being obviously right over memory.

Non-finite inputs. The recurrence reads token j's inputs at step j only, so a NaN there reaches rows
``i >= j`` of its chunk and never the rows before it. A chunked product with a triangular matrix would also
multiply the zeros above its diagonal by row j, and ``0 * NaN = NaN``. So the upper triangles are cut with
``tril`` (a mask, not a product), and products whose right-hand side may carry a NaN row (``A_qk @ V_new``)
go through `causal_product`. The solve for the WY transform is forward substitution, which never reads a
later row.
"""

from __future__ import annotations

import torch


def rounded_exp(exponent: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """``exp`` of a float64 exponent, rounded once to ``dtype`` first (see `chunked`'s docstring)."""
    return exponent.to(dtype).exp()


def causal_decay(gamma: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """``[..., C, K] -> [..., C, C, K]``: ``exp(gamma_i - gamma_j)`` on and below the diagonal, 0 above,
    in ``dtype`` (the difference is taken in gamma's float64)."""
    C = gamma.shape[-2]
    diff = gamma[..., :, None, :] - gamma[..., None, :, :]
    above = torch.ones(C, C, dtype=torch.bool, device=gamma.device).triu(1)
    return diff.to(dtype).masked_fill(above[:, :, None], float("-inf")).exp()


def chunk_scores(
    q: torch.Tensor, k: torch.Tensor, beta: torch.Tensor, gamma: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """Decay-weighted causal scores of one chunk.

    q, k: ``[..., C, K]``; gamma: ``[..., C, K]`` float64; beta: ``[..., C]``. Returns ``A_qk [..., C, C]``
    (lower triangle with the diagonal) and ``A_kk [..., C, C]`` (strictly lower, already scaled by beta of
    the row), in q's dtype.
    """
    decay = causal_decay(gamma, q.dtype)
    k_decayed = decay * k[..., None, :, :]  # [..., i, j, d] = k[j, d] exp(gamma_i - gamma_j)
    A_qk = (q[..., :, None, :] * k_decayed).sum(-1).tril()  # above the diagonal: 0 * k_j, NaN for a NaN k_j
    A_kk = (k[..., :, None, :] * k_decayed).sum(-1).tril(-1) * beta[..., :, None]
    return A_qk, A_kk


def wy_transform(
    A_kk: torch.Tensor, k: torch.Tensor, v: torch.Tensor, beta: torch.Tensor, gamma: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """``W [..., C, K]`` and ``U [..., C, V]``: one unit-lower-triangular solve with ``I + A_kk``.

    They turn the sequential delta rule inside a chunk into matrix products: the corrected values of the
    chunk are ``V_new = U - W S`` for the state S at the start of the chunk.
    """
    C = A_kk.shape[-1]
    system = A_kk + torch.eye(C, dtype=A_kk.dtype, device=A_kk.device)
    rhs = torch.cat([beta[..., None] * rounded_exp(gamma, k.dtype) * k, beta[..., None] * v], dim=-1)
    solved = torch.linalg.solve_triangular(system, rhs, upper=False, unitriangular=True)
    return solved[..., : k.shape[-1]], solved[..., k.shape[-1] :]


def causal_product(lower: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    """``lower @ x`` for a lower triangular ``lower [..., C, C]`` and ``x [..., C, D]``, in which a non-finite
    ``x[j]`` reaches rows ``i >= j`` only, as in the recurrence (see the module docstring).

    The product takes ``x`` with its non-finite entries as 0, and ``(x * 0).cumsum`` down the rows, which is 0
    until a column's first non-finite entry and NaN from there on, puts the NaN back where it belongs. Simpler
    than a token-by-token path for non-finite calls (which would need a check and a sync on every call), and
    for finite ``x`` it is the plain product.
    """
    finite = torch.where(x.isfinite(), x, 0.0)
    return lower @ finite + (x * 0.0).cumsum(dim=-2)
