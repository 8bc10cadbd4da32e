"""The public entry point: `chunk_kda`, argument-compatible with `fla.ops.kda.chunk_kda` 0.6.

A call goes: arguments -> `KDASpec` (validation, before any kernel) -> dispatcher (which backend) ->
the backend's forward, inside one `autograd.Function` when gradients are needed so that backward goes
to the same backend. Nothing the caller passed is modified.
"""

from __future__ import annotations

import contextlib
import contextvars
from collections.abc import Iterator
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch

from kda import dispatch
from kda.backends.base import Backend, KDAInputs
from kda.errors import KDAInputError
from kda.spec import KDASpec

if TYPE_CHECKING:
    from kda.report import Explanation

# FLA 0.6 options kda does not implement; passing them with a non-default value is an error, not a no-op.
_UNSUPPORTED = {
    "return_intermediate_states": False,
    "cp_context": None,
    "use_graph": False,
    "max_num_seqs": None,
}


@dataclass(frozen=True)
class Route:
    """One backend invocation: which backend ran which phase of which kind of call."""

    backend: str
    phase: str  # "forward" or "backward"
    case_class: str


_routes: contextvars.ContextVar[list[Route] | None] = contextvars.ContextVar("kda_routes", default=None)


@contextlib.contextmanager
def trace_routes() -> Iterator[list[Route]]:
    """Collect a `Route` for every backend forward and backward run inside the block.

    with kda.trace_routes() as routes:
        o, _ = kda.chunk_kda(q, k, v, g, beta)
    assert routes[0].backend == "torch"
    """
    routes: list[Route] = []
    token = _routes.set(routes)
    try:
        yield routes
    finally:
        _routes.reset(token)


def _note(backend: Backend, phase: str, spec: KDASpec, routes: list[Route] | None) -> None:
    if routes is not None:
        routes.append(Route(backend.name, phase, spec.case_class.key))


class _KDAFunction(torch.autograd.Function):
    """Routes forward and backward of one call to the same backend."""

    @staticmethod
    def forward(
        ctx,
        backend: Backend,
        spec: KDASpec,
        cu_seqlens,
        cu_seqlens_cpu,
        routes,
        q,
        k,
        v,
        g,
        beta,
        A_log,
        dt_bias,
        initial_state,
    ):
        inputs = KDAInputs(q, k, v, g, beta, A_log, dt_bias, initial_state, cu_seqlens, cu_seqlens_cpu)
        result = backend.forward(inputs, spec)
        _note(backend, "forward", spec, routes)
        ctx.backend, ctx.spec, ctx.saved, ctx.routes = backend, spec, result.saved, routes
        ctx.cu = (cu_seqlens, cu_seqlens_cpu)
        ctx.save_for_backward(q, k, v, g, beta, A_log, dt_bias, initial_state)
        return result.o, result.final_state

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, do, dfinal_state):
        q, k, v, g, beta, A_log, dt_bias, initial_state = ctx.saved_tensors
        inputs = KDAInputs(q, k, v, g, beta, A_log, dt_bias, initial_state, *ctx.cu)
        grads = ctx.backend.backward(inputs, ctx.spec, ctx.saved, do, dfinal_state)
        _note(ctx.backend, "backward", ctx.spec, ctx.routes)
        wanted = ctx.needs_input_grad[5:]
        return (None,) * 5 + tuple(grad if need else None for grad, need in zip(grads.as_tuple(), wanted))


def _prepare(args: dict[str, Any], kwargs: dict[str, Any]) -> tuple[KDASpec, dict[str, Any]]:
    """Check the FLA-only options and unknown keywords, then build the spec."""
    if "transpose_state_layout" in kwargs:  # FLA's deprecated name for state_v_first
        old = kwargs.pop("transpose_state_layout")
        if args["state_v_first"] and old is not None:
            raise KDAInputError("transpose_state_layout", "is the deprecated name of state_v_first; pass only one")
        args["state_v_first"] = bool(old)
    if kwargs:
        raise KDAInputError(next(iter(kwargs)), "is not an argument of chunk_kda", ", ".join(sorted(kwargs)))
    for name, default in _UNSUPPORTED.items():
        if args[name] is not default and args[name] != default:
            raise KDAInputError(name, f"is not supported by kda (only the default {default!r} is)", repr(args[name]))
    spec_args = {n: a for n, a in args.items() if n not in _UNSUPPORTED and n != "backend"}
    return KDASpec.from_call(**spec_args), spec_args


def _run(spec: KDASpec, call: dict[str, Any], backend_request: dispatch.Request):
    backend = dispatch.select(spec, backend_request)
    routes = _routes.get()
    tensors = (
        call["q"],
        call["k"],
        call["v"],
        call["g"],
        call["beta"],
        call["A_log"],
        call["dt_bias"],
        call["initial_state"],
    )
    if spec.requires_grad:
        o, final_state = _KDAFunction.apply(backend, spec, call["cu_seqlens"], call["cu_seqlens_cpu"], routes, *tensors)
    else:
        inputs = KDAInputs(*tensors, call["cu_seqlens"], call["cu_seqlens_cpu"])
        result = backend.forward(inputs, spec)
        _note(backend, "forward", spec, routes)
        o, final_state = result.o, result.final_state
    return o, (final_state if spec.output_final_state else None)


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
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Kimi Delta Attention, chunked, through the fastest verified backend (or the one you name).

    Shapes (time-major, as in flash-linear-attention): q, k ``[B, T, H, K]``; v ``[B, T, HV, V]``;
    g ``[B, T, HV, K]``; beta ``[B, T, HV]``; initial_state ``[N, HV, K, V]`` fp32 (``[N, HV, V, K]`` with
    ``state_v_first``); variable length: ``B == 1`` and ``cu_seqlens [N+1]``. Per value head::

        S_t = (I - beta_t k_t k_t^T) Diag(exp(g_t)) S_{t-1} + beta_t k_t v_t^T,    o_t = scale * S_t^T q_t

    Gate modes: ``use_gate_in_kernel=False`` takes g as the log decay; ``True`` applies
    ``-exp(A_log) * softplus(g + dt_bias)``, or with ``safe_gate=True`` and ``-5 <= lower_bound < 0``,
    ``lower_bound * sigmoid(exp(A_log) * (g + dt_bias))``. ``use_qk_l2norm_in_kernel`` normalises q and k;
    ``use_beta_sigmoid_in_kernel`` takes beta as logits (``2 * sigmoid`` with ``allow_neg_eigval``).

    Args beyond FLA's:
        backend: ``"auto"`` (fastest verified backend; inside `kda.use_backends` only those), a backend
            name, or a list of names tried in order. A named backend that cannot serve the call raises
            `BackendSelectionError` with the reasons; it never silently falls back.

    Not supported (raise `KDAInputError` when set): ``return_intermediate_states``, ``cp_context``,
    ``use_graph``, ``max_num_seqs``. ``disable_recompute`` is a hint backends may ignore.

    Returns:
        ``(o [B, T, HV, V] in q's dtype, final_state fp32 or None)``.

    Raises:
        KDAInputError: the call broke a rule of the contract (before any kernel ran).
        BackendSelectionError: no requested backend can serve the call.
    """
    args = dict(locals())
    kwargs = args.pop("kwargs")
    backend_request = args["backend"]
    spec, call = _prepare(args, kwargs)
    return _run(spec, call, backend_request)


def explain(*args: Any, **kwargs: Any) -> Explanation:
    """What `chunk_kda` would do with these same arguments: every registered backend, whether it was
    chosen, and why or why not. Returns a printable `Explanation` (``print(kda.explain(...))``).

    Like the call itself, it verifies a backend lazily for this case class when no record exists.
    """
    from kda.report import Explanation

    bound = _bind(*args, **kwargs)
    request = bound.pop("backend")
    extra = bound.pop("kwargs")
    spec, _ = _prepare({**bound, "backend": request}, extra)
    requested = dispatch._requested(request)
    names = None if requested is None else set(requested)
    decision = dispatch.decide(spec, request)
    from kda import registry

    others = [b.name for b in registry.registered_backends() if names is not None and b.name not in names]
    return Explanation(decision, not_requested=others)


def _bind(*args: Any, **kwargs: Any) -> dict[str, Any]:
    import inspect

    bound = inspect.signature(chunk_kda).bind(*args, **kwargs)
    bound.apply_defaults()
    return dict(bound.arguments)
