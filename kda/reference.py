"""The reference: KDA as the naive per-token recurrence, plus the input transforms.

Run in float64 (`kda_reference(..., compute_dtype=torch.float64)`, the default) this is the ground
truth every backend is verified against, the torch backend included. It is deliberately the slowest,
plainest form: one Python-level step per token, no chunking, nothing clever that could share a bug
with a fast kernel.

Per value head, with the state ``S in R^{K x V}``::

    S_t = (I - beta_t k_t k_t^T) Diag(exp(g_t)) S_{t-1} + beta_t k_t v_t^T
    o_t = scale * S_t^T q_t                    (read after the update)

Value head ``hv`` uses q/k head ``hv // (HV // H)`` (grouped value attention). ``S_0`` is the initial
state or zero; the final state is ``S_T``, per sequence of a variable-length batch.

The transforms (``l2norm``, ``beta_transform``, the gates) are written for any dtype and are also used
by the torch backend: they are short enough that sharing them cannot hide a bug the recurrence would
not catch.
"""

from __future__ import annotations

import itertools
from typing import Any

import torch
import torch.nn.functional as F

from kda import options
from kda.options import KDAArguments

L2NORM_EPS = 1e-6

# The smallest per-token log decay the backends compute with: one below it (-1e30, -inf: a full reset) is
# computed as the floor. exp(-32) ~ 1.3e-14 is a reset to far within fp32's resolution of 1, and the floor
# keeps a chunk's cumulative decay within 64 * 32 = 2048, where fp32's ulp (2.4e-4) leaves the in-chunk
# differences exact enough; without it an fp32 cumulative sum at -1e6 (ulp 0.06) loses every other token's
# decay, and -inf - -inf is NaN. Its gradient below the floor is 0 (the true one is ~exp(g), as good as 0).
# The reference itself applies no floor: it is exact (exp(-1e30) = exp(-inf) = 0 there).
LOG_DECAY_FLOOR = -32.0


def l2norm(x: torch.Tensor, eps: float = L2NORM_EPS) -> torch.Tensor:
    """``x / sqrt(sum(x^2) + eps)`` over the last (head) dimension."""
    return x * torch.rsqrt((x * x).sum(dim=-1, keepdim=True) + eps)


def beta_transform(beta: torch.Tensor, *, sigmoid: bool, allow_neg_eigval: bool) -> torch.Tensor:
    """``sigmoid(beta)``, or ``2 * sigmoid(beta)`` with ``allow_neg_eigval``, or beta as given."""
    if not sigmoid:
        return beta
    return 2.0 * torch.sigmoid(beta) if allow_neg_eigval else torch.sigmoid(beta)


def _gate_input(g: torch.Tensor, dt_bias: torch.Tensor | None) -> torch.Tensor:
    """``g + dt_bias[h]`` with dt_bias given as [HV*K] or [HV, K]; g is [B, T, HV, K]."""
    if dt_bias is None:
        return g
    HV, K = g.shape[-2:]
    return g + dt_bias.reshape(HV, K).to(g.dtype)


def softplus_gate(g: torch.Tensor, A_log: torch.Tensor, dt_bias: torch.Tensor | None = None) -> torch.Tensor:
    """The softplus gate: ``-exp(A_log[h]) * softplus(g + dt_bias[h])``, a log decay in (-inf, 0)."""
    A = A_log.to(g.dtype).exp().reshape(-1, 1)  # [HV, 1]
    return -A * F.softplus(_gate_input(g, dt_bias))


def safe_gate(
    g: torch.Tensor, A_log: torch.Tensor | None, dt_bias: torch.Tensor | None, lower_bound: float
) -> torch.Tensor:
    """The safe gate: ``lower_bound * sigmoid(exp(A_log[h]) * (g + dt_bias[h]))``, in (lower_bound, 0).

    With ``A_log=None`` the factor ``exp(A_log)`` is 1. Because ``lower_bound >= -5``, 16 tokens decay by at
    most 80 in log space: what lets fast kernels exponentiate per 16-token sub-chunk without overflow.
    """
    x = _gate_input(g, dt_bias)
    if A_log is not None:
        x = A_log.to(g.dtype).exp().reshape(-1, 1) * x
    return lower_bound * torch.sigmoid(x)


def log_decay(
    g: torch.Tensor,
    *,
    use_gate_in_kernel: bool,
    A_log: torch.Tensor | None,
    dt_bias: torch.Tensor | None,
    lower_bound: float | None,
) -> torch.Tensor:
    """The per-token log decay the recurrence uses, for every gate mode, as FLA 0.6 computes it: g as
    given (pre-gated); ``lower_bound * sigmoid(...)`` whenever `lower_bound` is set (the sigmoid and safe
    gates; `safe_gate` only promises the bound's range); else the softplus gate."""
    if not use_gate_in_kernel:
        return g
    if lower_bound is not None:
        return safe_gate(g, A_log, dt_bias, lower_bound)
    assert A_log is not None
    return softplus_gate(g, A_log, dt_bias)


def naive_recurrence(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    scale: float,
    initial_state: torch.Tensor | None = None,
    chunk_states: list[torch.Tensor] | None = None,
    chunk_size: int = 64,
) -> tuple[torch.Tensor, torch.Tensor]:
    """One sequence batch, token by token, in the dtype of its inputs.

    Shapes: q, k ``[B, T, H, K]``; v ``[B, T, HV, V]``; g ``[B, T, HV, K]`` (log decay); beta ``[B, T, HV]``;
    initial_state ``[B, HV, K, V]`` or None. Returns ``o [B, T, HV, V]`` and ``S_T [B, HV, K, V]``. With
    `chunk_states` a list, the state before tokens 0, C, 2C, ... (``[B, HV, K, V]`` each) is appended to it:
    what ``return_intermediate_states`` returns.
    """
    B, T, H, K = q.shape
    HV, V = v.shape[2], v.shape[3]
    group = HV // H
    q = q.repeat_interleave(group, dim=2)  # [B, T, HV, K]: value head hv reads q/k head hv // group
    k = k.repeat_interleave(group, dim=2)
    S = q.new_zeros(B, HV, K, V) if initial_state is None else initial_state.to(q.dtype)
    outputs = []
    for t in range(T):
        if chunk_states is not None and t % chunk_size == 0:
            chunk_states.append(S)
        k_t, b_t = k[:, t], beta[:, t, :, None]  # [B, HV, K], [B, HV, 1]
        S = S * g[:, t].exp()[..., None]  # Diag(exp(g_t)) S
        # (I - b k k^T) S + b k v^T  =  S + k (b (v - S^T k))^T
        delta = b_t * (v[:, t] - torch.einsum("bhkv,bhk->bhv", S, k_t))
        S = S + k_t[..., None] * delta[:, :, None, :]
        outputs.append(scale * torch.einsum("bhkv,bhk->bhv", S, q[:, t]))
    if not outputs:  # an empty sequence of a variable-length batch
        return v.new_zeros(B, 0, HV, V), S
    return torch.stack(outputs, dim=1), S


def kda_reference(*args: Any, compute_dtype: torch.dtype = torch.float64, **kwargs: Any) -> tuple[Any, ...]:
    """KDA with `chunk_kda`'s arguments, computed by the naive recurrence in `compute_dtype`.

    Takes the fields of `kda.options.KDAArguments` (FLA 0.6's arguments in its order, then ``A_log``,
    ``dt_bias``, ``chunk_size`` by keyword; ``backend`` is not one), plus ``compute_dtype``. The
    recurrence has no chunks and reads ``cu_seqlens`` only, so ``chunk_size``, ``disable_recompute`` and
    ``cu_seqlens_cpu`` do not change its result.

    Every input is upcast to `compute_dtype` first (float64 by default), so the result is the exact
    function of the given (possibly bf16) inputs. Differentiable: gradients of the float64 result are
    the reference gradients. Returns ``(o, final_state)`` in `compute_dtype`, and with
    ``return_intermediate_states`` also the state at the start of every chunk,
    ``[B, NT, HV, K, V]`` (``[..., V, K]`` with ``state_v_first``), as `chunk_kda` does. It checks no rule of the
    contract (the caller validated through `KDASpec`) beyond refusing the FLA options kda does not
    implement.
    """
    return reference_of(KDAArguments(*args, **kwargs), compute_dtype)


kda_reference.__signature__ = options.signature(  # type: ignore[attr-defined]
    extra={"compute_dtype": torch.float64}, return_annotation="tuple[torch.Tensor, ...]"
)


def reference_of(args: KDAArguments, compute_dtype: torch.dtype = torch.float64) -> tuple[Any, ...]:
    """`kda_reference` of arguments already gathered in a `KDAArguments`."""
    args.check_fla_only()

    def cast(t: torch.Tensor) -> torch.Tensor:
        return t.to(compute_dtype)

    def cast_optional(t: torch.Tensor | None) -> torch.Tensor | None:
        return None if t is None else t.to(compute_dtype)

    q, k, v, g, beta = (cast(t) for t in (args.q, args.k, args.v, args.g, args.beta))
    A_log, dt_bias, initial_state = (cast_optional(t) for t in (args.A_log, args.dt_bias, args.initial_state))
    K = q.shape[-1]
    scale = K**-0.5 if args.scale is None else args.scale
    if args.use_qk_l2norm_in_kernel:
        q, k = l2norm(q), l2norm(k)
    beta = beta_transform(beta, sigmoid=args.use_beta_sigmoid_in_kernel, allow_neg_eigval=args.allow_neg_eigval)
    g = log_decay(
        g,
        use_gate_in_kernel=args.use_gate_in_kernel,
        A_log=A_log,
        dt_bias=dt_bias,
        lower_bound=args.lower_bound,
    )
    if initial_state is not None and args.state_v_first:
        initial_state = initial_state.transpose(-1, -2)

    C = args.chunk_size
    per_chunk: list[torch.Tensor] | None = [] if args.return_intermediate_states else None
    if args.cu_seqlens is None:
        o, S = naive_recurrence(q, k, v, g, beta, scale, initial_state, per_chunk, C)
    else:
        bounds = [int(x) for x in args.cu_seqlens.tolist()]
        outs, states = [], []
        for n, (start, end) in enumerate(itertools.pairwise(bounds)):
            h0 = None if initial_state is None else initial_state[n : n + 1]
            piece = slice(start, end)
            o_n, S_n = naive_recurrence(
                q[:, piece], k[:, piece], v[:, piece], g[:, piece], beta[:, piece], scale, h0, per_chunk, C
            )
            outs.append(o_n)
            states.append(S_n)
        o, S = torch.cat(outs, dim=1), torch.cat(states, dim=0)

    final = (S.transpose(-1, -2) if args.state_v_first else S) if args.output_final_state else None
    if per_chunk is None:
        return o, final
    B, HV, K, V = q.shape[0], v.shape[2], q.shape[3], v.shape[3]
    h = torch.stack(per_chunk, dim=1) if per_chunk else q.new_zeros(B, 0, HV, K, V)  # [B, NT, HV, K, V]
    return o, final, (h.transpose(-1, -2) if args.state_v_first else h)
