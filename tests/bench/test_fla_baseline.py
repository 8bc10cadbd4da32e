"""The bench's FLA baselines, against a stand-in FLA 0.6 that dispatches its stages at every call (no GPU).

FLA 0.6 hands a backward stage to its TileLang kernel whenever tilelang is installed; `baseline:fla` must
time FLA's Triton kernels whatever the machine has installed (as the `fla` backend runs them), forward and
backward, and leave FLA's registry as it found it; `baseline:fla-tilelang` times FLA as installed.
"""

from __future__ import annotations

import sys
import textwrap
import types

import pytest
import torch

from kda.bench import runner
from kda.bench.shapes import MODES, BenchShape, make_inputs

# FLA's module as the bench reaches it: a dispatching wrapper over its own `chunk_kda`, whose stages ask
# the `kda` registry at every call (a forward stage now, a backward one when autograd reaches the output)
STANDIN = textwrap.dedent("""
    import functools
    import sys

    seen = []  # (phase, route) of each dispatched stage

    def _route():
        registry = sys.modules["fla.backends"]._operation_registries["kda"]
        return "tilelang" if registry._backends else "triton"

    def chunk_kda(q, k, v, g, beta, **kwargs):
        seen.append(("forward", _route()))
        used = [t for t in (q, k, g, beta, *kwargs.values()) if getattr(t, "requires_grad", False)]
        o = v.float() + 0 * sum(t.float().sum() for t in used)
        if o.requires_grad:
            o.register_hook(lambda grad: seen.append(("backward", _route())))
        return o.to(v.dtype), None

    def _dispatch(function):
        @functools.wraps(function)
        def wrapper(*args, **kwargs):
            raise AssertionError("the baseline went through FLA's dispatcher")
        return wrapper

    chunk_kda = _dispatch(chunk_kda)
""")


class Registry:
    def __init__(self) -> None:
        self._backends: dict[str, object] = {"tilelang": object()}


@pytest.fixture
def fla(monkeypatch):
    """The stand-in FLA, with tilelang installed (as far as FLA and kda can tell)."""
    module = types.ModuleType("fla.ops.kda.chunk")
    exec(compile(STANDIN, "<fla.ops.kda.chunk stand-in>", "exec"), module.__dict__)
    for name in ("fla", "fla.ops", "fla.ops.kda"):
        monkeypatch.setitem(sys.modules, name, types.ModuleType(name))
    monkeypatch.setitem(sys.modules, "fla.ops.kda.chunk", module)
    backends = types.ModuleType("fla.backends")
    backends._operation_registries = {"kda": Registry()}  # type: ignore[attr-defined]
    monkeypatch.setitem(sys.modules, "fla.backends", backends)
    monkeypatch.setattr(runner.route, "tilelang_installed", lambda: True)
    monkeypatch.delenv("FLA_TILELANG", raising=False)
    return module, backends._operation_registries["kda"]  # type: ignore[attr-defined]


def inputs_for(mode: str, seed: int):
    return make_inputs(BenchShape.parse("B1_T70_H2_D16"), MODES[mode], "cpu", seed=seed)


@pytest.mark.parametrize("mode", ["train_safe", "fwd"])
def test_the_fla_baseline_runs_flas_triton_kernels_forward_and_backward(fla, mode, seed):
    module, registry = fla
    offered = registry._backends
    runner.fla_step(inputs_for(mode, seed), MODES[mode], triton_only=True)()
    backward = [("backward", "triton")] if MODES[mode].training else []
    assert module.seen == [("forward", "triton"), *backward]
    assert registry._backends is offered and set(offered) == {"tilelang"}  # FLA as it was


def test_the_tilelang_baseline_runs_fla_as_installed(fla, seed):
    module, _ = fla
    runner.fla_step(inputs_for("train_safe", seed), MODES["train_safe"], triton_only=False)()
    assert module.seen == [("forward", "tilelang"), ("backward", "tilelang")]


def test_the_tilelang_baseline_is_skipped_with_the_reason_where_fla_would_not_take_it(fla, monkeypatch, seed):
    monkeypatch.setattr(runner.route, "tilelang_installed", lambda: False)
    run, why = runner.call_for("baseline:fla-tilelang", inputs_for("fwd", seed), MODES["fwd"])
    assert run is None and "only with tilelang installed" in str(why)


@pytest.mark.parametrize("name", ["baseline:fla", "baseline:fla-tilelang"])
def test_fla_baselines_need_cuda(fla, name, seed):
    run, why = runner.call_for(name, inputs_for("fwd", seed), MODES["fwd"])
    assert run is None and why == "FLA runs on CUDA only"


def test_the_results_say_which_path_each_fla_baseline_ran(monkeypatch):
    monkeypatch.setattr(runner.route, "route_state", lambda: "bypassed")
    paths = runner.fla_paths()
    assert paths["baseline:fla"] == "FLA's Triton kernels (its TileLang backward stage, installed, bypassed)"
    assert "as installed" in paths["baseline:fla-tilelang"]
    monkeypatch.setattr(runner.route, "route_state", lambda: "not bypassed")
    assert "could not be bypassed" in runner.fla_paths()["baseline:fla"]
    monkeypatch.setattr(runner.route, "route_state", lambda: "off")
    assert runner.fla_paths() == {"baseline:fla": "FLA's Triton kernels (no other route installed)"}


def test_the_recorded_path_is_the_one_the_registry_allows(fla):
    """With the stand-in's registry found, FLA's TileLang stage is reported bypassed, as the step runs."""
    assert runner.fla_paths()["baseline:fla"].endswith("bypassed)")


def test_every_gradient_leaf_is_reached_through_the_stand_in(fla, seed):
    """The stand-in's output depends on every leaf, so the training step's gradients exist (else autograd
    raises and the route tests above would prove nothing about the backward)."""
    inputs = inputs_for("train_safe", seed)
    grads = runner.fla_step(inputs, MODES["train_safe"], triton_only=True)()
    assert len(grads) == len(inputs.leaves) and all(torch.isfinite(g).all() for g in grads)


def test_the_route_is_found_when_fla_makes_its_registry_with_its_kda_stages(tmp_path, monkeypatch):
    """FLA 0.6 makes its ``kda`` registry when its KDA stages are imported (`dispatch("kda")`), not with
    `fla.backends`: asked before any FLA call (as the bench's settings ask), the route's state must import
    them first. (On an H100 it did not, and both FLA rows said "registry not found".)"""
    package = tmp_path / "fla"
    (package / "ops" / "kda").mkdir(parents=True)
    (package / "__init__.py").write_text("")
    (package / "backends.py").write_text("_operation_registries = {}\n")
    (package / "ops" / "__init__.py").write_text("")
    (package / "ops" / "kda" / "__init__.py").write_text(
        "from fla.backends import _operation_registries\n\n"
        "class Registry:\n    _backends = {'tilelang': object()}\n\n"
        "_operation_registries['kda'] = Registry()\n"
    )
    for name in [name for name in sys.modules if name == "fla" or name.startswith("fla.")]:
        monkeypatch.delitem(sys.modules, name)
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.setattr(runner.route, "tilelang_installed", lambda: True)
    assert "fla.ops.kda" not in sys.modules
    assert runner.route.route_state() == "bypassed"
    assert runner.fla_paths()["baseline:fla"].startswith("FLA's Triton kernels")
