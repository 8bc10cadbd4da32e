"""The `fla` adapter, against stand-in `fla.ops.kda.chunk` modules built like FLA 0.6's (no GPU needed).

FLA wraps `chunk_kda` in its own backend dispatcher, which sends inference calls to FlashKDA. The stand-in
reproduces that: its public `chunk_kda` is a dispatching wrapper (functools.wraps) around the real
function, and the wrapper counts every call it routes elsewhere. The tests prove that kda's `fla` backend
reaches the inner function and never the wrapper, forward and backward, with the right gradients.
"""

from __future__ import annotations

import math
import os
import sys
import textwrap
import types
from typing import Any

import pytest
import torch
import torch.nn.functional as F

import kda
from kda.backends.base import KDAInputs, Verdict
from kda.backends.fla import FLABackend, fla_triton_chunk_kda, route
from kda.reference import LOG_DECAY_FLOOR, kda_reference
from kda.spec import KDASpec
from kda.verify.check import relative_error

STANDIN = textwrap.dedent("""
    import functools
    import torch
    from kda.reference import LOG_DECAY_FLOOR, kda_reference

    CALLS = {"inner": 0, "routed_elsewhere": 0}
    SCALE_OUTPUT = 1.0
    RECEIVED = {}  # the gate's tensors of the last call, as FLA got them

    def chunk_kda(q, k, v, g, beta, scale=None, initial_state=None, output_final_state=False,
                  use_qk_l2norm_in_kernel=False, use_gate_in_kernel=False, use_beta_sigmoid_in_kernel=False,
                  allow_neg_eigval=False, safe_gate=False, lower_bound=None, disable_recompute=False,
                  return_intermediate_states=False, state_v_first=False, cu_seqlens=None, cu_seqlens_cpu=None,
                  cp_context=None, use_graph=False, max_num_seqs=None, **kwargs):
        CALLS["inner"] += 1
        RECEIVED.update(g=g, A_log=kwargs.get("A_log"), dt_bias=kwargs.get("dt_bias"))
        assert cu_seqlens is None or cu_seqlens.dtype == torch.int64
        assert kwargs.pop("chunk_size") in (32, 64)
        o, state = kda_reference(
            q, k, v, g, beta, scale=scale, initial_state=initial_state, output_final_state=output_final_state,
            use_qk_l2norm_in_kernel=use_qk_l2norm_in_kernel, use_gate_in_kernel=use_gate_in_kernel,
            use_beta_sigmoid_in_kernel=use_beta_sigmoid_in_kernel, allow_neg_eigval=allow_neg_eigval,
            safe_gate=safe_gate, lower_bound=lower_bound, state_v_first=state_v_first, cu_seqlens=cu_seqlens,
            compute_dtype=torch.float32, **kwargs)
        return (o * SCALE_OUTPUT).to(q.dtype), state

    def _dispatch(function):
        @functools.wraps(function)
        def wrapper(*args, **kwargs):
            CALLS["routed_elsewhere"] += 1  # FLA would hand inference calls to FlashKDA here
            return function(*args, **kwargs)
        return wrapper

    chunk_kda = _dispatch(_dispatch(chunk_kda))  # FLA stacks compiler.disable over its dispatcher
""")

DISPATCHER_ONLY = textwrap.dedent("""
    def dispatch(*args, **kwargs):
        raise RuntimeError("routed")

    def chunk_kda(*args, **kwargs):
        return dispatch(*args, **kwargs)
""")


def install(monkeypatch, source: str = STANDIN) -> types.ModuleType:
    module = types.ModuleType("fla.ops.kda.chunk")
    exec(compile(source, "<fla.ops.kda.chunk stand-in>", "exec"), module.__dict__)
    for name in ("fla", "fla.ops", "fla.ops.kda"):
        monkeypatch.setitem(sys.modules, name, types.ModuleType(name))
    monkeypatch.setitem(sys.modules, "fla.ops.kda.chunk", module)
    return module


class CPUFLA(FLABackend):
    """The real adapter, allowed on the CPU so that it can be dispatched and verified here."""

    def available(self) -> Verdict:
        fla_triton_chunk_kda()
        return Verdict.yes()

    def supports(self, spec: KDASpec) -> Verdict:
        return Verdict.yes()


def safe_call(*, varlen: bool = False, requires_grad: bool = False, state_v_first: bool = False) -> dict[str, Any]:
    B, T, H, HV, K, V = (1, 45, 1, 2, 16, 8) if varlen else (2, 21, 1, 2, 16, 8)
    call: dict[str, Any] = {
        "q": torch.randn(B, T, H, K),
        "k": torch.randn(B, T, H, K),
        "v": torch.randn(B, T, HV, V),
        "g": torch.randn(B, T, HV, K),
        "beta": torch.randn(B, T, HV),
        "A_log": torch.rand(HV),
        "dt_bias": torch.randn(HV * K) * 0.5,
        "use_gate_in_kernel": True,
        "safe_gate": True,
        "lower_bound": -5.0,
        "use_qk_l2norm_in_kernel": True,
        "use_beta_sigmoid_in_kernel": True,
        "output_final_state": True,
        "state_v_first": state_v_first,
        "chunk_size": 32,
    }
    N = 3 if varlen else B
    if varlen:
        call["cu_seqlens"] = torch.tensor([0, 13, 13, T], dtype=torch.int32)
    call["initial_state"] = torch.randn(N, HV, V, K) if state_v_first else torch.randn(N, HV, K, V)
    if requires_grad:
        for name in ("q", "k", "v", "g", "beta", "A_log", "dt_bias", "initial_state"):
            call[name].requires_grad_(True)
    return call


def reference(call: dict[str, Any]):
    ref = {
        n: (
            t.detach().double().requires_grad_(t.requires_grad)
            if isinstance(t, torch.Tensor) and t.is_floating_point()
            else t
        )
        for n, t in call.items()
        if n != "chunk_size"
    }
    o, state = kda_reference(**ref)
    return ref, o, state


def test_unwraps_to_flas_own_function_not_its_dispatcher(monkeypatch):
    module = install(monkeypatch)
    inner = fla_triton_chunk_kda()
    assert inner is not module.chunk_kda and inner.__code__.co_name == "chunk_kda"
    assert inner.__module__ == "fla.ops.kda.chunk"


@pytest.mark.parametrize("varlen", [False, True], ids=["dense", "varlen"])
def test_forward_runs_the_inner_function_only(seed, monkeypatch, varlen):
    module = install(monkeypatch)
    call = safe_call(varlen=varlen)
    spec = KDASpec.from_call(**call)
    inputs = KDAInputs(**{n: call.get(n) for n in KDAInputs.__dataclass_fields__ if n in call})
    result = FLABackend().forward(inputs, spec)
    assert module.CALLS == {"inner": 1, "routed_elsewhere": 0}
    assert module.RECEIVED["g"] is call["g"]  # the safe gate is bounded: its input goes to FLA as it is
    _, o_ref, state_ref = reference(call)
    assert relative_error(result.o, o_ref) < 1e-5
    assert relative_error(result.final_state, state_ref) < 1e-5


@pytest.mark.parametrize("state_v_first", [False, True], ids=["kv", "vk"])
def test_training_gives_every_gradient_through_flas_graph(seed, monkeypatch, state_v_first):
    module = install(monkeypatch)
    kda.register_backend(CPUFLA, replace=True)
    call = safe_call(varlen=True, requires_grad=True, state_v_first=state_v_first)
    with kda.trace_routes() as routes:
        o, state = kda.chunk_kda(**call, backend="fla")
        do, dstate = torch.randn_like(o), torch.randn_like(state)
        grads = torch.autograd.grad(
            [o, state],
            [call[n] for n in ("q", "k", "v", "g", "beta", "A_log", "dt_bias", "initial_state")],
            [do, dstate],
        )
    assert [(r.backend, r.phase) for r in routes] == [("fla", "forward"), ("fla", "backward")]
    assert module.CALLS["routed_elsewhere"] == 0 and module.CALLS["inner"] >= 1

    ref, o_ref, state_ref = reference(call)
    names = ("q", "k", "v", "g", "beta", "A_log", "dt_bias", "initial_state")
    ref_grads = torch.autograd.grad([o_ref, state_ref], [ref[n] for n in names], [do.double(), dstate.double()])
    for name, got, want in zip(names, grads, ref_grads):
        assert relative_error(got, want) < 1e-4, name


def test_a_wrong_fla_fails_verification_and_is_not_used(seed, monkeypatch):
    module = install(monkeypatch)
    module.SCALE_OUTPUT = 1.02  # 2% off
    kda.register_backend(CPUFLA, replace=True)
    call = safe_call()
    with pytest.raises(kda.BackendSelectionError, match=r"rel\. error"):
        kda.chunk_kda(**call, backend="fla")
    with kda.trace_routes() as routes:
        kda.chunk_kda(**call)
    assert [r.backend for r in routes] == ["torch"]


def test_unavailable_with_reasons(monkeypatch):
    monkeypatch.setitem(sys.modules, "fla.ops.kda.chunk", None)
    assert "does not load" in str(FLABackend().available())
    install(monkeypatch, DISPATCHER_ONLY)
    verdict = FLABackend().available()
    assert not verdict and "dispatcher" in str(verdict)
    install(monkeypatch)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert "need a GPU" in str(FLABackend().available())
    cpu_spec = KDASpec.from_call(**dict(safe_call().items()))
    assert "CUDA only" in str(FLABackend().supports(cpu_spec))


def test_tilelang_route_is_part_of_the_fingerprint(monkeypatch):
    monkeypatch.setenv("FLA_TILELANG", "0")
    assert FLABackend().fingerprint_extras() == {"fla_tilelang_route": "off"}
    monkeypatch.delenv("FLA_TILELANG")
    monkeypatch.setattr(route, "tilelang_installed", lambda: True)
    install_registry(monkeypatch)
    assert FLABackend().fingerprint_extras() == {"fla_tilelang_route": "bypassed"}
    monkeypatch.setitem(sys.modules, "fla.backends", types.ModuleType("fla.backends"))  # a later FLA's layout
    assert FLABackend().fingerprint_extras() == {"fla_tilelang_route": "not bypassed"}


class FakeRegistry:
    """FLA 0.6's `BackendRegistry` as far as the adapter sees it: a dict of backends by type."""

    def __init__(self) -> None:
        self._backends: dict[str, object] = {"tilelang": object()}


def install_registry(monkeypatch, where: str = "_operation_registries") -> FakeRegistry:
    """A stand-in `fla.backends` whose `kda` registry offers TileLang, as FLA 0.6's does with tilelang."""
    registry = FakeRegistry()
    backends = types.ModuleType("fla.backends")
    setattr(backends, where, {"kda": registry})
    monkeypatch.setitem(sys.modules, "fla.backends", backends)
    return registry


# A dispatched stage as FLA 0.6 runs it: TileLang whenever the `kda` registry offers it. Here the
# "TileLang" result is 5% off, so that a run which took it cannot pass verification.
ROUTED_STAGES = STANDIN.replace(
    'CALLS = {"inner": 0, "routed_elsewhere": 0}',
    'CALLS = {"inner": 0, "routed_elsewhere": 0, "tilelang": 0}',
).replace(
    "    return (o * SCALE_OUTPUT).to(q.dtype), state",
    textwrap.indent(
        textwrap.dedent("""
            import sys
            def stage_scale():
                registries = getattr(sys.modules.get("fla.backends"), "_operation_registries", None)
                registries = registries or getattr(sys.modules.get("fla.backends"), "registries_moved", {})
                if registries.get("kda") is not None and registries["kda"]._backends:
                    CALLS["tilelang"] += 1
                    return 1.05
                return 1.0
            o = o * stage_scale()  # a forward stage
            if o.requires_grad:  # and a backward one, run while autograd walks the graph
                o.register_hook(lambda grad: grad * stage_scale())
            return (o * SCALE_OUTPUT).to(q.dtype), state
        """),
        "    ",
    ),
)
assert "stage_scale" in ROUTED_STAGES


def test_fla_runs_its_triton_path_with_tilelang_installed_and_leaves_fla_as_it_was(seed, monkeypatch):
    """FLA hands dispatched stages to TileLang when its registry offers it; the adapter's calls must not,
    forward or backward, and FLA's registry and the environment are as before once the call returns."""
    module = install(monkeypatch, ROUTED_STAGES)
    registry = install_registry(monkeypatch)
    offered, environment = registry._backends, dict(os.environ)
    kda.register_backend(CPUFLA, replace=True)
    call = safe_call(requires_grad=True)
    with kda.trace_routes() as routes:
        o, state = kda.chunk_kda(**call, backend="fla")
        grads = torch.autograd.grad([o, state], [call["q"], call["g"]], [torch.randn_like(o), torch.randn_like(state)])
    assert [(r.backend, r.phase) for r in routes] == [("fla", "forward"), ("fla", "backward")]
    assert module.CALLS["tilelang"] == 0 and module.CALLS["inner"] >= 2  # verification, then the call
    assert registry._backends is offered and set(offered) == {"tilelang"}
    assert dict(os.environ) == environment
    _, o_ref, _ = reference(call)
    assert relative_error(o, o_ref) < 1e-5 and all(torch.isfinite(g).all() for g in grads)
    # Outside the adapter FLA is untouched: its own call takes the offered route.
    inner = fla_triton_chunk_kda()
    inner(**{n: (t.detach() if isinstance(t, torch.Tensor) else t) for n, t in call.items()})
    assert module.CALLS["tilelang"] == 1


def test_verifier_catches_a_later_fla_whose_registry_the_adapter_cannot_find(seed, monkeypatch):
    module = install(monkeypatch, ROUTED_STAGES)
    install_registry(monkeypatch, where="registries_moved")
    kda.register_backend(CPUFLA, replace=True)
    with pytest.raises(kda.BackendSelectionError, match=r"rel\. error"):
        kda.chunk_kda(**safe_call(), backend="fla")
    assert module.CALLS["tilelang"] >= 1


def test_pinning_gives_each_autotuner_one_config_and_puts_them_back(monkeypatch):
    triton = pytest.importorskip("triton", reason="Triton is not installed (the pinning acts on its autotuners)")
    from kda.backends.fla.pinning import _autotuners, pinned_autotune

    @triton.jit
    def kernel(x, BLOCK: triton.language.constexpr):
        pass

    configs = [triton.Config({"BLOCK": b}) for b in (16, 32, 64)]
    tuner = triton.autotune(configs=configs, key=[])(kernel)
    fake = types.ModuleType("fla.ops.fake_kernels")
    fake.tuned = tuner
    fake.wrapped = triton.heuristics({"BLOCK": lambda args: 16})(triton.autotune(configs=configs, key=[])(kernel))
    monkeypatch.setitem(sys.modules, "fla.ops.fake_kernels", fake)
    found = _autotuners()
    assert tuner in found and fake.wrapped.fn in found
    with pinned_autotune():
        assert tuner.configs == configs[:1] and len(fake.wrapped.fn.configs) == 1
    assert tuner.configs == configs and len(fake.wrapped.fn.configs) == 3
    with pytest.raises(ValueError), pinned_autotune():
        raise ValueError("restored even on error")
    assert tuner.configs == configs
    _ = F  # (keeps the import used when triton is absent)


# FLA 0.6's backward returns dt_bias's gradient flat, [HV * K], whatever shape dt_bias came in.
FLAT_DT_BIAS_GRADIENT = STANDIN.replace(
    '    CALLS["inner"] += 1\n',
    textwrap.indent(
        textwrap.dedent("""
            CALLS["inner"] += 1

            class _FlatGradient(torch.autograd.Function):
                @staticmethod
                def forward(ctx, x):
                    return x.clone()

                @staticmethod
                def backward(ctx, grad):
                    return grad.reshape(-1)

            if kwargs.get("dt_bias") is not None:
                kwargs["dt_bias"] = _FlatGradient.apply(kwargs["dt_bias"])
        """),
        "    ",
    ),
)
assert "_FlatGradient" in FLAT_DT_BIAS_GRADIENT


def test_two_dimensional_dt_bias_trains_through_flas_flat_gradient(seed, monkeypatch):
    """Regression (seen on the H200): with dt_bias [HV, K], FLA's backward returned a [HV * K] gradient and
    autograd raised "returned an invalid gradient at index 5"; the adapter hands FLA a flat view."""
    install(monkeypatch, FLAT_DT_BIAS_GRADIENT)
    kda.register_backend(CPUFLA, replace=True)
    call = safe_call(requires_grad=True)
    HV, K = call["g"].shape[-2:]
    call["dt_bias"] = (torch.randn(HV, K) * 0.5).requires_grad_(True)
    o, state = kda.chunk_kda(**call, backend="fla")
    do, dstate = torch.randn_like(o), torch.randn_like(state)
    (ddt_bias,) = torch.autograd.grad([o, state], [call["dt_bias"]], [do, dstate])
    ref, o_ref, state_ref = reference(call)
    (want,) = torch.autograd.grad([o_ref, state_ref], [ref["dt_bias"]], [do.double(), dstate.double()])
    assert ddt_bias.shape == (HV, K) and relative_error(ddt_bias, want) < 1e-4


# ------------------------------------------------------------------------------------------ extreme decays


def extreme_call(gate: str, dtype: torch.dtype, dt_layout: str = "flat", requires_grad: bool = False) -> dict[str, Any]:
    """A call whose per-token log decays go far below LOG_DECAY_FLOOR at a few tokens, in `gate` mode."""
    B, T, H, HV, K, V = 1, 40, 1, 3, 8, 8
    call: dict[str, Any] = {
        "q": torch.randn(B, T, H, K, dtype=dtype),
        "k": F.normalize(torch.randn(B, T, H, K), dim=-1).to(dtype),
        "v": torch.randn(B, T, HV, V, dtype=dtype),
        "beta": torch.rand(B, T, HV, dtype=dtype),
        "initial_state": torch.randn(B, HV, K, V),
        "output_final_state": True,
        "chunk_size": 32,
    }
    if gate == "pregated":
        g = -torch.rand(B, T, HV, K) * 2
        g[:, 5], g[:, 17, :, ::2], g[:, 17, :, 1::2], g[:, 30] = -40.0, -1e30, -math.inf, -1e6
    else:
        g = torch.randn(B, T, HV, K) * 3
        g[:, 5], g[:, 17, :, ::2], g[:, 30] = 1e30, 80.0, torch.finfo(torch.float32).max
        # exp(A_log) from e^-4 (the bound on g is then far above 32) to e^4 (below 1)
        call.update(use_gate_in_kernel=True, A_log=torch.tensor([-4.0, 0.3, 4.0]))
        if dt_layout != "none":
            dt_bias = torch.randn(HV, K)
            call["dt_bias"] = dt_bias if dt_layout == "2d" else dt_bias.reshape(-1)
    call["g"] = g.to(dtype)
    if requires_grad:
        for name in ("q", "k", "v", "g", "beta", "A_log", "dt_bias", "initial_state"):
            if name in call:
                call[name].requires_grad_(True)
    return call


def received_log_decay(module: types.ModuleType, call: dict[str, Any]) -> torch.Tensor:
    """The per-token log decay FLA computes from the gate input it received (in fp32, as FLA does)."""
    g = module.RECEIVED["g"].detach().float()
    if not call.get("use_gate_in_kernel"):
        return g
    HV, K = g.shape[-2:]
    dt = module.RECEIVED["dt_bias"]
    x = g if dt is None else g + dt.detach().float().reshape(HV, K)
    return -module.RECEIVED["A_log"].detach().float().exp().reshape(HV, 1) * F.softplus(x)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize(
    "gate, dt_layout",
    [("pregated", ""), ("softplus", "flat"), ("softplus", "2d"), ("softplus", "none")],
    ids=["pregated", "softplus", "softplus-dt2d", "softplus-no-dt"],
)
def test_extreme_log_decays_reach_fla_at_the_floor(seed, monkeypatch, gate, dt_layout, dtype):
    """FLA computes decays past the floor wrongly, like kda's own kernels did; the adapter hands it inputs that
    give the floor's answer: pre-gated ``g.clamp(min=LOG_DECAY_FLOOR)``; softplus, g clamped from above where
    ``exp(A_log) softplus(g + dt_bias)`` would pass 32. Everything else reaches FLA bit for bit, and the
    caller's tensors are never modified."""
    module = install(monkeypatch)
    call = extreme_call(gate, dtype, dt_layout)
    before = {n: t.clone() for n, t in call.items() if isinstance(t, torch.Tensor)}
    spec = KDASpec.from_call(**call)
    inputs = KDAInputs(**{n: call.get(n) for n in KDAInputs.__dataclass_fields__ if n in call})
    result = FLABackend().forward(inputs, spec)
    for name, value in before.items():
        assert torch.equal(call[name], value), f"{name} was modified"
    received = module.RECEIVED["g"]
    assert received.dtype == call["g"].dtype and received.shape == call["g"].shape
    decay = received_log_decay(module, call)
    assert torch.isfinite(decay).all()
    # rounding the bound to g's dtype moves the decay by at most one of its ulps
    slack = 1e-5 if dtype == torch.float32 else 2**-7
    assert decay.min() >= LOG_DECAY_FLOOR * (1 + slack), decay.min()
    if gate == "pregated":
        assert torch.equal(received, call["g"].clamp(min=LOG_DECAY_FLOOR))
    else:
        x = call["g"].float() + (0 if "dt_bias" not in call else call["dt_bias"].reshape(3, 8))
        within = (-call["A_log"].exp().reshape(3, 1) * F.softplus(x)) > LOG_DECAY_FLOOR * (1 - slack)
        assert torch.equal(received[within], call["g"][within])  # only decays past the floor change
        assert (decay[~within] <= LOG_DECAY_FLOOR * (1 - slack)).all()
        assert module.RECEIVED["A_log"] is call["A_log"]
    _, o_ref, state_ref = reference(call)
    tol = 1e-4 if dtype == torch.float32 else 8e-3
    assert relative_error(result.o, o_ref) < tol and relative_error(result.final_state, state_ref) < 1e-4


@pytest.mark.parametrize("gate", ["pregated", "softplus"])
def test_training_through_the_floor(seed, monkeypatch, gate):
    """Gradients flow through the adapter's clamp to the caller's tensors: every one matches the float64
    reference, and dg is 0 where the floor applies."""
    install(monkeypatch)
    kda.register_backend(CPUFLA, replace=True)
    call = extreme_call(gate, torch.float32, requires_grad=True)
    names = [n for n in ("q", "k", "v", "g", "beta", "A_log", "dt_bias", "initial_state") if n in call]
    o, state = kda.chunk_kda(**call, backend="fla")
    do, dstate = torch.randn_like(o), torch.randn_like(state)
    grads = torch.autograd.grad([o, state], [call[n] for n in names], [do, dstate])
    ref, o_ref, state_ref = reference(call)
    ref_grads = torch.autograd.grad([o_ref, state_ref], [ref[n] for n in names], [do.double(), dstate.double()])
    for name, got, want in zip(names, grads, ref_grads):
        assert torch.isfinite(got).all(), name
        assert relative_error(got, want) < 1e-4, name
    dg = dict(zip(names, grads))["g"]
    assert torch.equal(dg[:, 5], torch.zeros_like(dg[:, 5])) and torch.equal(dg[:, 30], torch.zeros_like(dg[:, 30]))
