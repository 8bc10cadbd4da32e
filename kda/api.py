"""The public entry point: `chunk_kda`, argument-compatible with `fla.ops.kda.chunk_kda` 0.6.

A call goes: arguments -> `KDASpec` (validation, before any kernel) -> dispatcher (which backend) ->
the backend's forward, inside one `autograd.Function` when gradients are needed so that backward goes
to the same backend. Nothing the caller passed is modified.
"""

from __future__ import annotations

import dataclasses
import inspect
import warnings
from typing import TYPE_CHECKING, Any

import torch

from kda import dispatch, library
from kda.backends.base import Backend, KDAInputs
from kda.errors import KDAInputError
from kda.options import KDAArguments, normalised
from kda.routes import Route, note
from kda.routes import current as _current_routes
from kda.spec import KDASpec

if TYPE_CHECKING:
    from kda.report import Explanation


class _KDAFunction(torch.autograd.Function):
    """Routes forward and backward of one call to the same backend."""

    @staticmethod
    def forward(
        ctx: Any,
        backend: Backend,
        spec: KDASpec,
        cu_seqlens: torch.Tensor | None,
        cu_seqlens_cpu: torch.Tensor | None,
        routes: list[Route] | None,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        g: torch.Tensor,
        beta: torch.Tensor,
        A_log: torch.Tensor | None,
        dt_bias: torch.Tensor | None,
        initial_state: torch.Tensor | None,
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        inputs = KDAInputs(q, k, v, g, beta, A_log, dt_bias, initial_state, cu_seqlens, cu_seqlens_cpu)
        result = backend.forward(inputs, spec)
        note(backend, "forward", spec, routes)
        ctx.backend, ctx.spec, ctx.saved, ctx.routes = backend, spec, result.saved, routes
        ctx.cu = (cu_seqlens, cu_seqlens_cpu)
        ctx.save_for_backward(q, k, v, g, beta, A_log, dt_bias, initial_state)
        return result.o, result.final_state

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx: Any, do: torch.Tensor, dfinal_state: torch.Tensor | None) -> tuple[torch.Tensor | None, ...]:
        q, k, v, g, beta, A_log, dt_bias, initial_state = ctx.saved_tensors
        inputs = KDAInputs(q, k, v, g, beta, A_log, dt_bias, initial_state, *ctx.cu)
        grads = ctx.backend.backward(inputs, ctx.spec, ctx.saved, do, dfinal_state)
        note(ctx.backend, "backward", ctx.spec, ctx.routes)
        wanted = ctx.needs_input_grad[5:]
        return (None,) * 5 + tuple(grad if need else None for grad, need in zip(grads.as_tuple(), wanted))


_warned_unknown: set[frozenset[str]] = set()


def _take_extra_keywords(args: KDAArguments, extra: dict[str, Any]) -> KDAArguments:
    """FLA 0.6 takes any keyword through ``**kwargs``: the deprecated ``transpose_state_layout`` (its old
    name of state_v_first), ``head_first`` (gone: every layout is time-major) and, ignored, anything else.
    kda does the same, but refuses ``head_first=True`` (FLA would read head-first tensors as time-major)
    and warns once about the keywords it ignores."""
    extra = dict(extra)
    if "transpose_state_layout" in extra:
        old = extra.pop("transpose_state_layout")
        if args.state_v_first and old is not None:
            raise KDAInputError("transpose_state_layout", "is the deprecated name of state_v_first; pass only one")
        args = dataclasses.replace(args, state_v_first=bool(old))
    if "head_first" in extra:
        head_first = extra.pop("head_first")
        if head_first is not False and head_first is not None:
            raise KDAInputError(
                "head_first",
                "must be False: q, k, v are time-major [B, T, H, K] (FLA 0.6 ignores it and would read "
                "head-first tensors as time-major); transpose them first",
                repr(head_first),
            )
    if extra:
        names = frozenset(extra)
        if names not in _warned_unknown:
            _warned_unknown.add(names)
            warnings.warn(
                f"kda.chunk_kda ignores keyword arguments it does not know, as FLA does: {', '.join(sorted(names))}",
                UserWarning,
                stacklevel=4,
            )
    return args


def _prepare(args: KDAArguments, extra: dict[str, Any]) -> tuple[KDASpec, KDAArguments]:
    """Take FLA's extra keywords, make FLA's looser inputs exact, then build the spec (which refuses the
    FLA options kda does not implement, then checks every rule)."""
    if extra:
        args = _take_extra_keywords(args, extra)
    args = normalised(args)
    return KDASpec.from_args(args), args


def _run(
    spec: KDASpec, args: KDAArguments, backend_request: dispatch.Request, v_dtype: torch.dtype
) -> tuple[torch.Tensor, ...]:
    backend = dispatch.select(spec, backend_request)
    routes = _current_routes()
    tensors = (args.q, args.k, args.v, args.g, args.beta, args.A_log, args.dt_bias, args.initial_state)
    per_chunk = None
    if spec.requires_grad:
        o, final_state = _KDAFunction.apply(backend, spec, args.cu_seqlens, args.cu_seqlens_cpu, routes, *tensors)
    else:
        inputs = KDAInputs(*tensors, args.cu_seqlens, args.cu_seqlens_cpu)
        result = backend.forward(inputs, spec)
        note(backend, "forward", spec, routes)
        o, final_state, per_chunk = result.o, result.final_state, result.intermediate_states
    if o.dtype != v_dtype:  # v was promoted to q's wider dtype (see `kda.options.normalised`)
        o = o.to(v_dtype)
    final_state = final_state if spec.output_final_state else None
    if spec.return_intermediate_states:
        return o, final_state, per_chunk  # type: ignore[return-value]  # final_state may be None, as documented
    return o, final_state  # type: ignore[return-value]


def chunk_kda(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    scale: float | None = None,
    initial_state: torch.Tensor | None = None,
    output_final_state: bool = False,
    use_qk_l2norm_in_kernel: bool = False,
    use_gate_in_kernel: bool = False,
    use_beta_sigmoid_in_kernel: bool = False,
    allow_neg_eigval: bool = False,
    safe_gate: bool = False,
    lower_bound: float | None = None,
    disable_recompute: bool = False,
    return_intermediate_states: bool = False,
    state_v_first: bool = False,
    cu_seqlens: torch.Tensor | None = None,
    cu_seqlens_cpu: torch.Tensor | None = None,
    cp_context: Any = None,
    use_graph: bool = False,
    max_num_seqs: int | None = None,
    *,
    backend: dispatch.Request = "auto",
    A_log: torch.Tensor | None = None,
    dt_bias: torch.Tensor | None = None,
    chunk_size: int = 64,
    **kwargs: Any,
) -> tuple[torch.Tensor, ...]:
    """Kimi Delta Attention, chunked, through the fastest verified backend (or the one you name).

    Shapes (time-major, as in flash-linear-attention): q, k ``[B, T, H, K]``; v ``[B, T, HV, V]``;
    g ``[B, T, HV, K]``; beta ``[B, T, HV]``; initial_state ``[N, HV, K, V]`` fp32 (``[N, HV, V, K]`` with
    ``state_v_first``); variable length: ``B == 1`` and ``cu_seqlens [N+1]``. Per value head::

        S_t = (I - beta_t k_t k_t^T) Diag(exp(g_t)) S_{t-1} + beta_t k_t v_t^T,    o_t = scale * S_t^T q_t

    The arguments are those of `fla.ops.kda.chunk_kda` 0.6, in its order and with its defaults (declared
    once, in `kda.options.KDAArguments`), then kda's keyword-only ``backend``, ``A_log``, ``dt_bias`` and
    ``chunk_size``. Nothing passed is modified.

    Non-finite inputs: a NaN or inf in one token's q, k, v, g or beta makes that token's output and, for k,
    v, g and beta, its sequence's later outputs and final state non-finite (as the recurrence does), never
    another sequence's or head's. On the torch backend nothing earlier changes; on the triton backend the
    earlier rows of the token's chunk turn NaN too, and fla and flashkda should be expected to do the same
    (docs/design.md, "Non-finite inputs").

    Args:
        q: queries ``[B, T, H, K]``, bfloat16, float16 or float32; K <= 256. float64 too, served by the torch
            backend in float64 with float64 states (so ``torch.autograd.gradcheck`` runs through this call).
        k: keys, q's shape and dtype.
        v: values ``[B, T, HV, V]``; HV a multiple of H (grouped value attention), V <= 256. In another float
            dtype than q's, q, k and v are computed in the wider of the two, and ``o`` comes back in v's
            dtype (as FLA's does).
        g: ``[B, T, HV, K]``: the per-token log decay (<= 0), or with ``use_gate_in_kernel`` the raw gate
            input. A log decay below -32 (``kda.reference.LOG_DECAY_FLOOR``; -inf too) is computed as -32,
            a reset (exp(-32) ~ 1.3e-14), with gradient 0.
        beta: ``[B, T, HV]``: the delta-rule step size, or with ``use_beta_sigmoid_in_kernel`` its logits.
        scale: the output scale; None means ``K ** -0.5``.
        initial_state: ``S_0`` per sequence, ``[N, HV, K, V]`` fp32 (``[N, HV, V, K]`` with
            ``state_v_first``); None means zero.
        output_final_state: return ``S_T`` per sequence as the second result (else None).
        use_qk_l2norm_in_kernel: L2-normalise q and k over the head dimension first.
        use_gate_in_kernel: compute the log decay from g, in float32, as FLA 0.6 does:
            ``-exp(A_log) * softplus(g + dt_bias)`` when ``lower_bound`` is None, else
            ``lower_bound * sigmoid(exp(A_log) * (g + dt_bias))`` (``exp(A_log)`` is 1 without A_log).
        use_beta_sigmoid_in_kernel: take beta as logits: ``sigmoid(beta)``.
        allow_neg_eigval: with ``use_beta_sigmoid_in_kernel``, ``2 * sigmoid(beta)`` (eigenvalues of the
            transition down to -1).
        safe_gate: promises ``-5 <= lower_bound < 0`` for the sigmoid gate (requires ``use_gate_in_kernel``
            and ``lower_bound``), which lets backends use their anchored fast numerics.
        lower_bound: the sigmoid gate's bound, ``<= 0`` (``-5 <= lower_bound < 0`` with ``safe_gate``); only
            with ``use_gate_in_kernel`` (FLA would ignore it otherwise).
        disable_recompute: a memory/speed hint for training backends (keep intermediates rather than
            recompute them in backward); backends may ignore it, and it never changes the numbers.
        return_intermediate_states: also return the state entering every chunk, ``[B, NT, HV, K, V]``
            (``[..., V, K]`` with ``state_v_first``) in q's dtype, NT the chunks of each batch row (B == 1
            and all sequences' chunks in turn with ``cu_seqlens``), as a third result: what prefix caching
            stores. Only for calls without gradients (FLA requires ``torch.inference_mode``).
        state_v_first: states are ``[N, HV, V, K]`` rather than ``[N, HV, K, V]``.
        cu_seqlens: variable length: ``[N+1]`` int32/int64 sequence boundaries in the flattened time axis
            (0, non-decreasing, ending at T), on q's device; q etc. then have ``B == 1``.
        cu_seqlens_cpu: an optional host copy of ``cu_seqlens`` (saves backends a device sync).
        cp_context: context parallelism: a `kda.distributed.CPContext` (`kda.distributed.build_cp_context`);
            q etc. are then this rank's slice of the tokens and ``o`` its slice of the output. With it,
            ``initial_state`` and ``final_state`` are every sequence's, on every rank (FLA takes neither).
            Eager only: under ``torch.compile`` it is a `KDAInputError`.
        use_graph: the call will be captured in a CUDA graph: with ``cu_seqlens``, a backend must not read its
            values on the host (FLA's meaning; pad cu_seqlens with empty sequences to ``max_num_seqs + 1``
            entries). Backends that would decline, with the reason.
        max_num_seqs: with ``use_graph``, the static number of sequences; must match cu_seqlens.
        backend: ``"auto"`` (fastest verified backend; inside `kda.use_backends` only those), a backend
            name, or a list of names tried in order. A named backend that cannot serve the call raises
            `BackendSelectionError` with the reasons; it never silently falls back.
        A_log: HV values (``[HV]``, or ``[1, 1, HV, 1]`` as transformers stores it), any float dtype: the
            per-head decay rate of the in-kernel gates (``exp(A_log)``); required by the softplus gate,
            optional (1) for the sigmoid gates; only with ``use_gate_in_kernel``.
        dt_bias: HV*K values (``[HV*K]`` or ``[HV, K]``), any float dtype, added to g by the in-kernel gates;
            None means zero; only with ``use_gate_in_kernel``.
        chunk_size: 32 or 64, the chunk length of the chunked algorithm (changes the route through it,
            not the result).
        **kwargs: ``transpose_state_layout``, FLA's deprecated name of ``state_v_first`` (pass only one);
            ``head_first=False`` (``True`` raises: kda, like FLA 0.6, is time-major); any other keyword is
            ignored, as FLA ignores it, with one warning naming it.

    Returns:
        ``(o [B, T, HV, V] in v's dtype, final_state fp32 or None)``, and with
        ``return_intermediate_states`` the per-chunk states as a third element.

    Raises:
        KDAInputError: the call broke a rule of the contract (before any kernel ran).
        BackendSelectionError: no requested backend can serve the call.
    """
    args = KDAArguments(
        q=q,
        k=k,
        v=v,
        g=g,
        beta=beta,
        scale=scale,
        initial_state=initial_state,
        output_final_state=output_final_state,
        use_qk_l2norm_in_kernel=use_qk_l2norm_in_kernel,
        use_gate_in_kernel=use_gate_in_kernel,
        use_beta_sigmoid_in_kernel=use_beta_sigmoid_in_kernel,
        allow_neg_eigval=allow_neg_eigval,
        safe_gate=safe_gate,
        lower_bound=lower_bound,
        disable_recompute=disable_recompute,
        return_intermediate_states=return_intermediate_states,
        state_v_first=state_v_first,
        cu_seqlens=cu_seqlens,
        cu_seqlens_cpu=cu_seqlens_cpu,
        cp_context=cp_context,
        use_graph=use_graph,
        max_num_seqs=max_num_seqs,
        A_log=A_log,
        dt_bias=dt_bias,
        chunk_size=chunk_size,
    )
    if torch.compiler.is_compiling():  # one custom op in the graph: kda.library (~0.15 us here when eager)
        return library.chunk_kda_call(args, kwargs, backend)  # (which refuses cp_context: eager only)
    if cp_context is not None:  # kda.distributed splits the call over the group; each rank's part comes back here
        from kda import distributed

        return distributed.chunk_kda_cp(args, kwargs, backend, local=chunk_kda)
    v_dtype = v.dtype if isinstance(v, torch.Tensor) else None
    spec, args = _prepare(args, kwargs)
    return _run(spec, args, backend, v_dtype if v_dtype is not None else spec.dtype)


_CHUNK_KDA = inspect.signature(chunk_kda)


def explain(*args: Any, **kwargs: Any) -> Explanation:
    """What `chunk_kda` would do with these same arguments: every registered backend, whether it was
    chosen, and why or why not. Returns a printable `Explanation` (``print(kda.explain(...))``).

    Takes exactly `chunk_kda`'s arguments (its signature is `chunk_kda`'s). Like the call itself, it
    verifies a backend lazily for this case class when no record exists.
    """
    from kda import registry
    from kda.report import Explanation

    bound = _CHUNK_KDA.bind(*args, **kwargs)
    bound.apply_defaults()
    given = dict(bound.arguments)
    request = given.pop("backend")
    extra = given.pop("kwargs")
    spec, _ = _prepare(KDAArguments(**given), extra)
    requested = dispatch._requested(request)
    names = None if requested is None else set(requested)
    decision = dispatch.decide(spec, request)
    others = [b.name for b in registry.registered_backends() if names is not None and b.name not in names]
    return Explanation(decision, not_requested=others)


explain.__signature__ = _CHUNK_KDA.replace(return_annotation="Explanation")  # type: ignore[attr-defined]
