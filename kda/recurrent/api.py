"""The decode op's public functions: `fused_recurrent_kda` (FLA 0.6's `fused_recurrent_kda`, argument for
argument, plus the serving keywords of its `fused_recurrent_kda_fwd`) and `explain_recurrent`.

A call goes: arguments -> `RecurrentSpec` (every rule, before any kernel) -> the dispatcher (the same one as
`chunk_kda`'s: available -> supports -> verified for this decode case class -> ranked) -> the backend's
`recurrent_forward`. Forward only. Nothing the caller passed is modified, except ``out`` (which receives
``o``) and, with ``inplace_final_state=True``, the state pool ``initial_state`` at the slots the call writes.
"""

from __future__ import annotations

import inspect
import warnings
from typing import TYPE_CHECKING, Any

import torch

from kda import dispatch
from kda.backends.base import RecurrentInputs
from kda.errors import KDAInputError
from kda.recurrent.spec import RecurrentSpec
from kda.routes import current, note

if TYPE_CHECKING:
    from kda.report import Explanation

_warned: set[str] = set()


def _take_kwargs(state_v_first: bool, kwargs: dict[str, Any]) -> bool:
    """FLA's deprecated ``transpose_state_layout`` (the old name of ``state_v_first``); any other unknown
    keyword is ignored with one warning naming it (FLA ignores them silently)."""
    extra = dict(kwargs)
    if "transpose_state_layout" in extra:
        old = extra.pop("transpose_state_layout")
        if state_v_first and old is not None:
            raise KDAInputError("transpose_state_layout", "is the deprecated name of state_v_first; pass only one")
        state_v_first = bool(old)
    unknown = sorted(name for name in extra if name not in _warned)
    if unknown:
        _warned.update(unknown)
        warnings.warn(
            f"kda.fused_recurrent_kda ignores unknown keyword argument(s): {', '.join(unknown)}",
            UserWarning,
            stacklevel=3,
        )
    return state_v_first


def fused_recurrent_kda(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    A_log: torch.Tensor | None = None,
    dt_bias: torch.Tensor | None = None,
    scale: float | None = None,
    initial_state: torch.Tensor | None = None,
    output_final_state: bool = False,
    use_qk_l2norm_in_kernel: bool = False,
    use_gate_in_kernel: bool = False,
    use_beta_sigmoid_in_kernel: bool = False,
    allow_neg_eigval: bool = False,
    lower_bound: float | None = None,
    state_v_first: bool = False,
    cu_seqlens: torch.Tensor | None = None,
    *,
    ssm_state_indices: torch.Tensor | None = None,
    num_accepted_tokens: torch.Tensor | None = None,
    inplace_final_state: bool = False,
    out: torch.Tensor | None = None,
    backend: dispatch.Request = "auto",
    **kwargs: Any,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """KDA decoding: the recurrence token by token, optionally over a state pool (docs/design.md, "The decode op").

    Shapes: q, k ``[B, T, H, K]``; v ``[B, T, HV, V]``; g ``[B, T, HV, K]``; beta ``[B, T, HV]``; variable
    length: ``B == 1`` and ``cu_seqlens [N+1]``. Per value head (``o_t`` read after the update)::

        S_t = (I - beta_t k_t k_t^T) Diag(exp(g_t)) S_{t-1} + beta_t k_t v_t^T,    o_t = scale * S_t^T q_t

    The positional arguments are FLA 0.6's `fused_recurrent_kda`'s, in its order with its defaults; the
    keyword-only ones are the serving arguments of FLA's `fused_recurrent_kda_fwd` (``inplace_final_state``
    defaults to False here, as FLA's public function passes it) and ``backend``.

    Gates (``use_gate_in_kernel=True``; computed in fp32): softplus ``-exp(A_log) * softplus(g + dt_bias)``,
    or, whenever ``lower_bound`` is set, sigmoid ``lower_bound * sigmoid(exp(A_log) * (g + dt_bias))``
    (``A_log=None``: factor 1). A log decay below -32 is computed as -32 (`kda.reference.LOG_DECAY_FLOOR`).

    State pool (continuous batching): ``initial_state`` ``[num_slots, HV, K, V]`` (``[.., V, K]`` with
    ``state_v_first``), fp32, bf16 or fp16; ``ssm_state_indices [N]`` gives each sequence's slot. With
    ``inplace_final_state=True`` each sequence's state after its last token is written back to its slot,
    and the pool itself is returned as ``final_state``. Speculative decoding: ``ssm_state_indices [N,
    T_max]`` (a slot per token) and ``num_accepted_tokens [N]``: the start state is slot
    ``ssm_state_indices[n, num_accepted_tokens[n] - 1]`` (None: column 0), and with ``inplace_final_state``
    the state after token t goes to slot ``ssm_state_indices[n, t]``. A negative slot marks a padding row
    (its state is neither read nor written, its output is zero); a negative entry at token t > the read
    column means: do not keep that token's state. ``inplace_final_state=True`` without indices: slot n is
    sequence n. With a pool and ``inplace_final_state=False``, the pool is only read, and
    ``output_final_state=True`` returns a new fp32 ``[N, HV, K, V]`` (zeros for padding rows).
    Without a pool, ``initial_state`` is ``[N, HV, K, V]`` fp32 and ``output_final_state`` returns a new one.

    Index tensors on the device are never read on the host (no sync; capturable in a CUDA graph): their
    values are then the caller's promise (slots < num_slots, ``1 <= num_accepted_tokens <= T_max``, no slot
    written by two sequences); on the CPU they are checked.

    Forward only, like FLA's: a call that would need gradients raises `KDAInputError` (FLA returns outputs
    without a gradient instead); use `kda.chunk_kda` to train.

    Args:
        out: ``[B, T, HV, V]`` in q's dtype: ``o`` is written into it and it is returned.
        backend: ``"auto"`` (fastest verified backend for this decode class), a name, or a list of names.
        **kwargs: ``transpose_state_layout`` (FLA's deprecated name of ``state_v_first``); any other keyword
            is ignored, with one warning naming it.

    Returns:
        ``(o, final_state)``: ``final_state`` is the pool (``inplace_final_state``), a new fp32 state
        (``output_final_state``), or None.

    Raises:
        KDAInputError: the call broke a rule of the contract (before any kernel ran).
        BackendSelectionError: no requested backend can serve the call.
    """
    if torch.compiler.is_compiling():  # one custom op in the graph (kda.recurrent.library)
        from kda.recurrent.library import fused_recurrent_kda_call

        given = {
            "q": q, "k": k, "v": v, "g": g, "beta": beta, "A_log": A_log, "dt_bias": dt_bias, "scale": scale,
            "initial_state": initial_state, "output_final_state": output_final_state,
            "use_qk_l2norm_in_kernel": use_qk_l2norm_in_kernel, "use_gate_in_kernel": use_gate_in_kernel,
            "use_beta_sigmoid_in_kernel": use_beta_sigmoid_in_kernel, "allow_neg_eigval": allow_neg_eigval,
            "lower_bound": lower_bound, "state_v_first": state_v_first, "cu_seqlens": cu_seqlens,
            "ssm_state_indices": ssm_state_indices, "num_accepted_tokens": num_accepted_tokens,
            "inplace_final_state": inplace_final_state, "out": out,
        }  # fmt: skip
        return fused_recurrent_kda_call(given, kwargs, backend)
    if kwargs:
        state_v_first = _take_kwargs(state_v_first, kwargs)
    spec = RecurrentSpec.from_call(
        q,
        k,
        v,
        g,
        beta,
        A_log,
        dt_bias,
        scale,
        initial_state,
        output_final_state,
        use_qk_l2norm_in_kernel,
        use_gate_in_kernel,
        use_beta_sigmoid_in_kernel,
        allow_neg_eigval,
        lower_bound,
        state_v_first,
        cu_seqlens,
        ssm_state_indices=ssm_state_indices,
        num_accepted_tokens=num_accepted_tokens,
        inplace_final_state=inplace_final_state,
        out=out,
    )
    chosen = dispatch.select(spec, backend)
    inputs = RecurrentInputs(
        q, k, v, g, beta, A_log, dt_bias, initial_state, cu_seqlens, ssm_state_indices, num_accepted_tokens, out
    )
    result = chosen.recurrent_forward(inputs, spec)
    note(chosen, "forward", spec, current())  # type: ignore[arg-type]
    return result.o, result.final_state


_SIGNATURE = inspect.signature(fused_recurrent_kda)


def explain_recurrent(*args: Any, **kwargs: Any) -> Explanation:
    """What `fused_recurrent_kda` would do with these same arguments: every registered backend, whether
    it was chosen, and why or why not (``print(kda.explain_recurrent(...))``). Takes exactly
    `fused_recurrent_kda`'s arguments; like the call, it verifies a backend lazily when no record exists."""
    from kda import registry
    from kda.report import Explanation

    bound = _SIGNATURE.bind(*args, **kwargs)
    bound.apply_defaults()
    given = dict(bound.arguments)
    request = given.pop("backend")
    extra = given.pop("kwargs")
    if extra:
        given["state_v_first"] = _take_kwargs(given["state_v_first"], extra)
    spec = RecurrentSpec.from_call(**given)
    requested = dispatch._requested(request)
    names = None if requested is None else set(requested)
    decision = dispatch.decide(spec, request)
    others = [b.name for b in registry.registered_backends() if names is not None and b.name not in names]
    return Explanation(decision, not_requested=others)


explain_recurrent.__signature__ = _SIGNATURE.replace(return_annotation="Explanation")  # type: ignore[attr-defined]
