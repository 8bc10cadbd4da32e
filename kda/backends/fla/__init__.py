"""The `fla` backend: flash-linear-attention's `chunk_kda` on its Triton path, forward and backward.

This is the field's standard implementation, offered as a verified option and used as the benchmark
baseline. FLA 0.6 wraps `fla.ops.kda.chunk_kda` in its own backend dispatcher, which sends inference calls
to FlashKDA when `flash_kda` is installed. Here we want FLA's own kernels and nothing else (FlashKDA is
the separate `flashkda` backend), so the adapter calls the undecorated function under that wrapper: the
one that validates and runs FLA's Triton `ChunkKDAFunction`. If FLA's layout ever changes so that the
undecorated function cannot be found, the backend reports itself unavailable rather than guess.

FLA's inner stages are dispatched too: FLA 0.6 routes some backward pieces to TileLang when `tilelang`
is installed and ``FLA_TILELANG`` is not ``0``. The adapter keeps every stage on FLA's Triton path for
the length of each call (`route.triton_path_only`), without touching the environment; whether
TileLang is installed, and whether the bypass found FLA's registry, is part of this backend's
verification fingerprint.

Verification: FLA autotunes each new set of compile-time shapes for minutes; inside the verifier's
`verification_scope()`, FLA's autotuners are pinned to one configuration (`pinning`), which changes the
tiling, not the math.

Training: the forward runs FLA under autograd on detached leaves that share the caller's storage, and
keeps FLA's graph; the backward asks that graph for every gradient (FLA's own backward kernels).

Extreme decays: FLA computes a per-token log decay of -1e30 or -inf wrongly (its fp32 in-chunk cumulative
sums lose the other tokens' decays, and -inf - -inf is NaN), as kda's own kernels did. kda computes a log
decay below `kda.reference.LOG_DECAY_FLOOR` as the floor, so the adapter hands FLA a gate input that gives
the floor's answer (`floored_gate_input`): one elementwise pass over ``g`` in the pre-gated and softplus
modes, always (whether a call needs it is not known without reading its data); the safe gate is bounded
above -5 and goes to FLA as it is.
"""

from __future__ import annotations

import contextlib
import contextvars
import importlib
import inspect
from collections.abc import Iterator
from typing import Any

import torch

from kda.backends.base import (
    Backend,
    ForwardResult,
    KDAGradients,
    KDAInputs,
    KDAOutputs,
    RecurrentInputs,
    RecurrentResult,
    Verdict,
)
from kda.backends.fla.pinning import pinned_autotune
from kda.backends.fla.route import route_state, triton_path_only
from kda.recurrent.spec import RecurrentSpec
from kda.reference import LOG_DECAY_FLOOR
from kda.spec import KDASpec

_FLA_MODULE = "fla.ops.kda.chunk"

# True inside `FLABackend.verification_scope()`: the steps then run with FLA's autotuners pinned.
_pinning: contextvars.ContextVar[bool] = contextvars.ContextVar("kda_fla_pinning", default=False)


def fla_triton_chunk_kda() -> Any:
    """FLA's `chunk_kda` with FLA's backend dispatch peeled off: its Triton path.

    `fla.ops.kda.chunk.chunk_kda` is ``compiler.disable(dispatch(chunk_kda))``; each wrapper keeps the one
    below as ``__wrapped__``. Raises LookupError when the innermost function is not FLA's own.
    """
    module = importlib.import_module(_FLA_MODULE)
    function = inspect.unwrap(module.chunk_kda)
    code = getattr(function, "__code__", None)
    if code is None or function.__module__ != _FLA_MODULE or code.co_name != "chunk_kda":
        raise LookupError(f"{_FLA_MODULE}.chunk_kda does not unwrap to FLA's own chunk_kda (found {function!r})")
    if "dispatch" in code.co_names or "get_active" in code.co_names:
        raise LookupError(f"{_FLA_MODULE}.chunk_kda unwraps to a dispatcher, not to the Triton path")
    return function


def floored_gate_input(
    g: torch.Tensor, spec: KDASpec, A_log: torch.Tensor | None, dt_bias: torch.Tensor | None
) -> torch.Tensor:
    """The gate input that makes FLA compute a log decay below LOG_DECAY_FLOOR as the floor: a new tensor
    (the caller's ``g`` is never modified), differentiable in ``g`` (0 where it is clamped).

    Pre-gated, ``g`` is the log decay: ``max(g, floor)``. Softplus, the log decay is
    ``-exp(A_log) softplus(g + dt_bias)``, at or above the floor exactly when ``softplus(g + dt_bias) <= y``
    with ``y = -floor / exp(A_log)``, that is ``g <= softplus^-1(y) - dt_bias`` where
    ``softplus^-1(y) = log(e^y - 1) = y + log(1 - e^-y)``, written ``y + log(-expm1(-y))`` (exact for a tiny
    ``y``, a huge ``exp(A_log)``, and ``y`` itself for a large one). That bound, per value head and channel,
    is computed in fp32 without gradient and rounded to ``g``'s dtype, so the decay FLA forms stops at the
    floor to within one rounding of ``g``. The safe gate (above ``lower_bound >= -5``) is returned as is.
    """
    if not spec.use_gate_in_kernel:
        return g.clamp(min=LOG_DECAY_FLOOR)
    if spec.safe_gate:
        return g
    HV, K = g.shape[-2:]
    with torch.no_grad():
        a_log = torch.zeros(HV, 1, device=g.device) if A_log is None else A_log.float().reshape(HV, 1)
        y = -LOG_DECAY_FLOOR * torch.exp(-a_log)  # [HV, 1]: the largest softplus(g + dt_bias) kept
        bound = y + torch.log(-torch.expm1(-y))  # softplus^-1(y)
        if dt_bias is not None:
            bound = bound - dt_bias.float().reshape(HV, K)
        bound = bound.expand(HV, K).to(g.dtype)
    return g.clamp(max=bound)


class FLABackend(Backend):
    """flash-linear-attention's Triton `chunk_kda` (FLA >= 0.6), forward and backward."""

    name = "fla"
    version = "2"  # 2: the gate input clamped so that FLA computes LOG_DECAY_FLOOR's answer
    priority = 10
    trains = True
    writes_into_outputs = False
    description = "flash-linear-attention chunk_kda, Triton path (FLA's FlashKDA dispatch bypassed); trains"

    def available(self) -> Verdict:
        try:
            fla_triton_chunk_kda()
        except Exception as error:
            return Verdict.no(
                f"fla.ops.kda does not load ({type(error).__name__}: {error}); install the `fla` extra (PyPI fla-core)"
            )
        if not torch.cuda.is_available():
            return Verdict.no("FLA's Triton kernels need a GPU; none is visible")
        return Verdict.yes()

    def fingerprint_extras(self) -> dict[str, str]:
        return {"fla_tilelang_route": route_state()}

    @contextlib.contextmanager
    def verification_scope(self) -> Iterator[None]:
        """While verified, each forward and backward runs with FLA's autotuners pinned (see `pinning`)."""
        token = _pinning.set(True)
        try:
            yield
        finally:
            _pinning.reset(token)

    def supports(self, spec: KDASpec) -> Verdict:
        if spec.device.type != "cuda":
            return Verdict.no(f"runs on CUDA only; the call is on {spec.device}")
        return Verdict.yes("FLA implements the whole contract on CUDA")

    def supports_recurrent(self, spec: RecurrentSpec) -> Verdict:
        """FLA's `fused_recurrent_kda_fwd` without a state pool (`recurrent` says why not with one)."""
        from kda.backends.fla.recurrent import fla_fused_recurrent_fwd, unsupported_reasons

        broken = [] if spec.device.type == "cuda" else [f"runs on CUDA only; the call is on {spec.device}"]
        try:
            fla_fused_recurrent_fwd()
        except Exception as error:
            broken.append(f"FLA's fused_recurrent_kda_fwd is not usable ({type(error).__name__}: {error})")
        return Verdict.unless(broken + unsupported_reasons(spec))

    def recurrent_forward(self, inputs: RecurrentInputs, spec: RecurrentSpec) -> RecurrentResult:
        from kda.backends.fla.recurrent import fla_recurrent

        return fla_recurrent(inputs, spec)

    def forward(self, inputs: KDAInputs, spec: KDASpec, out: KDAOutputs | None = None) -> ForwardResult:
        with triton_path_only():
            return _pinned_when_verified(self._forward, inputs, spec)

    def backward(
        self, inputs: KDAInputs, spec: KDASpec, saved: Any, do: torch.Tensor, dfinal_state: torch.Tensor | None
    ) -> KDAGradients:
        with triton_path_only():
            return _pinned_when_verified(self._backward, inputs, spec, saved, do, dfinal_state)

    def _forward(self, inputs: KDAInputs, spec: KDASpec) -> ForwardResult:
        run = fla_triton_chunk_kda()
        tensors = {name: t for name, t in inputs.differentiable().items() if t is not None}
        leaves: dict[str, torch.Tensor] = {}
        if spec.requires_grad:
            leaves = {name: t.detach().requires_grad_(True) for name, t in tensors.items()}
            tensors = dict(leaves)
        cu_seqlens, cu_seqlens_cpu = inputs.cu_seqlens, inputs.cu_seqlens_cpu
        if cu_seqlens is not None:  # FLA's index helpers are written for int64 (LongTensor)
            cu_seqlens = cu_seqlens.long()
            cu_seqlens_cpu = None if cu_seqlens_cpu is None else cu_seqlens_cpu.long()
        with torch.set_grad_enabled(spec.requires_grad):
            g = floored_gate_input(tensors["g"], spec, tensors.get("A_log"), tensors.get("dt_bias"))
            o, final_state = run(
                tensors["q"],
                tensors["k"],
                tensors["v"],
                g,
                tensors["beta"],
                scale=spec.scale,
                initial_state=tensors.get("initial_state"),
                output_final_state=spec.output_final_state,
                use_qk_l2norm_in_kernel=spec.use_qk_l2norm_in_kernel,
                use_gate_in_kernel=spec.use_gate_in_kernel,
                use_beta_sigmoid_in_kernel=spec.use_beta_sigmoid_in_kernel,
                allow_neg_eigval=spec.allow_neg_eigval,
                safe_gate=spec.safe_gate,
                lower_bound=spec.lower_bound,
                disable_recompute=spec.disable_recompute,
                state_v_first=spec.state_v_first,
                cu_seqlens=cu_seqlens,
                cu_seqlens_cpu=cu_seqlens_cpu,
                A_log=tensors.get("A_log"),
                dt_bias=_flat(tensors.get("dt_bias")),
                chunk_size=spec.chunk_size,
            )
        saved = (o, final_state, leaves) if spec.requires_grad else None
        return ForwardResult(o.detach(), None if final_state is None else final_state.detach(), saved)

    def _backward(
        self, inputs: KDAInputs, spec: KDASpec, saved: Any, do: torch.Tensor, dfinal_state: torch.Tensor | None
    ) -> KDAGradients:
        o, final_state, leaves = saved
        outputs, upstream = [o], [do.contiguous()]
        if final_state is not None and dfinal_state is not None:
            outputs.append(final_state)
            upstream.append(dfinal_state.contiguous())
        # Under the verifier the graph is kept, so that an unpinned retry (see below) can run it again.
        found = torch.autograd.grad(
            outputs, list(leaves.values()), upstream, allow_unused=True, retain_graph=_pinning.get()
        )
        grads = {
            name: (torch.zeros_like(leaf) if grad is None else grad)
            for (name, leaf), grad in zip(leaves.items(), found)
        }
        return KDAGradients(
            dq=grads.get("q"),
            dk=grads.get("k"),
            dv=grads.get("v"),
            dg=grads.get("g"),
            dbeta=grads.get("beta"),
            dA_log=grads.get("A_log"),
            ddt_bias=grads.get("dt_bias"),
            dinitial_state=grads.get("initial_state"),
        )


def _flat(dt_bias: torch.Tensor | None) -> torch.Tensor | None:
    """``dt_bias`` as ``[HV * K]``: FLA 0.6 takes ``[HV, K]`` forward, but its backward returns the gradient
    flat, which autograd refuses ("returned an invalid gradient at index 5 - got [256] but expected shape
    compatible with [2, 128]", seen on the H200). A flat view is the same numbers; autograd maps its
    gradient back to the caller's shape."""
    return None if dt_bias is None else dt_bias.reshape(-1)


def _pinned_when_verified(step: Any, *args: Any) -> Any:
    """Run `step`; inside `verification_scope()`, with FLA's autotuners pinned (retrying unpinned if that
    fails)."""
    if not _pinning.get():
        return step(*args)
    fla_triton_chunk_kda()  # import FLA's kernel modules first, so that pinning finds their autotuners
    try:
        with pinned_autotune():
            return step(*args)
    except Exception:  # the pinned configuration may not fit this case: let FLA tune as usual
        return step(*args)
