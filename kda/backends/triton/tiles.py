"""The small pieces every kernel module shares: pointer tiles of the flattened tensors, the row norms and
the beta activation as the kernels apply them, and the padded block size of a head dimension.

Tensors are flattened on the token axis (``tokens = B*T``, or ``T`` with varlen): q and k are ``[tokens,
H, K]``, per value head tensors ``[tokens, HV, K]`` or ``[tokens, HV, V]``, and a recurrent state ``[N, HV,
K, V]`` (or ``[N, HV, V, K]`` with ``V_FIRST``). The jit helpers are inlined into each kernel that calls
them; none is launched on its own.
"""

from __future__ import annotations

import triton
import triton.language as tl


def padded_dim(n: int) -> int:
    """A head dimension's block size in the kernels: the next power of two, at least 16 (tl.dot's
    smallest tile)."""
    return max(16, triton.next_power_of_2(n))


@triton.jit
def head_rows(ptr, rows, head, cols, HEADS: tl.constexpr, DIM: tl.constexpr):
    """Pointers to ``[rows, cols]`` of head ``head`` in a ``[tokens, HEADS, DIM]`` tensor."""
    return ptr + rows[:, None].to(tl.int64) * (HEADS * DIM) + head * DIM + cols[None, :]


@triton.jit
def inv_norm(x, L2: tl.constexpr):
    """Per row of ``x [rows, K]``: ``1 / sqrt(sum x^2 + eps)`` with l2norm in kernel, else 1."""
    if L2:
        return tl.rsqrt(tl.sum(x * x, axis=1) + 1e-6)  # eps as kda.reference.l2norm
    return tl.full([x.shape[0]], 1.0, tl.float32)


@triton.jit
def beta_activation(b, SIGMOID: tl.constexpr, TWO: tl.constexpr):
    """``beta`` after its activation: ``sigmoid(b)`` with beta sigmoid in kernel (times 2 with
    ``allow_neg_eigval``), else ``b`` as given."""
    if SIGMOID:
        b = tl.sigmoid(b)
        if TWO:
            b = 2.0 * b
    return b


@triton.jit
def state_tile(i_n, i_hv, kcols, vcols, HV: tl.constexpr, K: tl.constexpr, V: tl.constexpr, V_FIRST: tl.constexpr):
    """Offsets and mask of the ``[BK, BV]`` tile (rows ``kcols``, columns ``vcols``) of sequence ``i_n``'s state
    for value head ``i_hv``, in a ``[N, HV, K, V]`` tensor, or ``[N, HV, V, K]`` with ``V_FIRST``."""
    state_mask = (kcols[:, None] < K) & (vcols[None, :] < V)
    state_base = (i_n.to(tl.int64) * HV + i_hv) * K * V
    if V_FIRST:
        return state_base + vcols[None, :] * K + kcols[:, None], state_mask
    return state_base + kcols[:, None] * V + vcols[None, :], state_mask
