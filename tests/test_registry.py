"""Tests of backends registered through the ``kda.backends`` entry-point group.

Each test writes a fake installed distribution (a ``*.dist-info`` folder with METADATA and
entry_points.txt) plus its module into a temporary folder, puts that folder on sys.path, and resets the
registry so that kda loads entry points again. Module names are unique per test, so no import from an
earlier test is reused.
"""

from __future__ import annotations

import importlib
import itertools
import logging
import os
import sys
import textwrap
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.nn.functional as F

import kda
from kda import dispatch, registry
from kda.backends.torch import TorchBackend
from kda.verify import cli
from kda.verify.cases import cases_for
from kda.verify.check import is_verifying as in_verification
from kda.verify.records import default_store

# fla, flashkda, triton, helion and tilelang are built in, and unavailable on a machine without their packages or a GPU;
# the registry tests below are about the other backends, so they leave those out of their lists.
ADAPTERS = {"fla", "flashkda", "triton", "helion", "tilelang"}


def own_names() -> list[str]:
    return [b.name for b in kda.registered_backends() if b.name not in ADAPTERS]


_counter = itertools.count()


PLUGIN_SOURCE = """
import os, sys
import kda
from kda.backends.torch import TorchBackend

CALLS = {"forward": 0, "verify": 0, "backward": 0}

from kda.verify.check import is_verifying as _in_verification

class PluginBackend(kda.Backend):
    name = "plugin"
    version = "0.1"
    priority = 50
    trains = True
    description = "a third-party backend from an entry point (wraps torch)"

    def __init__(self):
        self._torch = TorchBackend()

    def supports(self, spec):
        return kda.Verdict.yes("wraps torch")

    def forward(self, inputs, spec, out=None):
        CALLS["verify" if _in_verification() else "forward"] += 1
        return self._torch.forward(inputs, spec, out)

    def backward(self, inputs, spec, saved, do, dfinal_state):
        CALLS["backward"] += 1
        return self._torch.backward(inputs, spec, saved, do, dfinal_state)

class SecondBackend(PluginBackend):
    name = "plugin_instance"
    priority = -1

INSTANCE = SecondBackend()
NOT_A_BACKEND = object()
"""


@pytest.fixture
def plugin_dir(tmp_path, monkeypatch):
    """A folder on sys.path to install fake distributions into; forgets their modules afterwards."""
    root = tmp_path / "site"
    root.mkdir()
    monkeypatch.syspath_prepend(str(root))
    modules: list[str] = []
    yield root, modules
    for name in modules:
        sys.modules.pop(name, None)
    importlib.invalidate_caches()


def install(
    site: tuple[Path, list[str]], entry_points: dict[str, str], modules: dict[str, str], dist: str | None = None
) -> str:
    """Write a fake distribution: ``entry_points`` maps entry name -> "module_key:attr" where module_key
    is a key of ``modules`` (module sources); returns the distribution name."""
    root, loaded = site
    n = next(_counter)
    dist = dist or f"fake_kda_plugin_{n}"
    real_names = {key: f"{key}_{os.getpid()}_{n}" for key in modules}
    for key, source in modules.items():
        (root / f"{real_names[key]}.py").write_text(textwrap.dedent(source))
        loaded.append(real_names[key])
    info = root / f"{dist}-0.1.dist-info"
    info.mkdir()
    (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {dist}\nVersion: 0.1\n")
    lines = ["[kda.backends]"]
    for entry, target in entry_points.items():
        module_key, attr = target.split(":")
        lines.append(f"{entry} = {real_names[module_key]}:{attr}")
    (info / "entry_points.txt").write_text("\n".join(lines) + "\n")
    (info / "RECORD").write_text("")
    importlib.invalidate_caches()
    registry._reset_for_tests()
    dispatch.clear_cache()
    return dist


def inputs(T: int = 40, H: int = 1, K: int = 16, V: int = 16, requires_grad: bool = False) -> dict[str, Any]:
    tensors = {
        "q": F.normalize(torch.randn(1, T, H, K), dim=-1),
        "k": F.normalize(torch.randn(1, T, H, K), dim=-1),
        "v": torch.randn(1, T, H, V),
        "g": F.logsigmoid(torch.randn(1, T, H, K) + 1.0),
        "beta": torch.rand(1, T, H) * 0.9 + 0.05,
    }
    if requires_grad:
        for t in tensors.values():
            t.requires_grad_(True)
    return {**tensors, "chunk_size": 32}


def plugin_module(backend: kda.Backend):
    return sys.modules[type(backend).__module__]


# ---------------------------------------------------------------------------------------------- tests


def test_entry_point_backend_is_registered_verified_and_used(seed, plugin_dir):
    install(plugin_dir, {"plugin": "mod:PluginBackend"}, {"mod": PLUGIN_SOURCE})

    names = own_names()
    assert names == ["plugin", "torch"]  # by priority: 50, then torch's 0
    backend = kda.get_backend("plugin")
    assert type(backend).__name__ == "PluginBackend" and backend.version == "0.1"
    assert "plugin" in kda.available_backends()
    calls = plugin_module(backend).CALLS

    call = inputs()
    key = kda.KDASpec.from_call(**call).case_class.key
    with kda.trace_routes() as routes:
        o, _ = kda.chunk_kda(**call)
    assert [(r.backend, r.phase) for r in routes] == [("plugin", "forward")]
    quick = len(cases_for(kda.KDASpec.from_call(**call).case_class, quick=True))  # realistic, correlated
    assert calls == {"forward": 1, "verify": quick, "backward": 0}  # verified lazily, then used
    record = default_store().get(backend, "cpu", key)
    assert record is not None and record.passed and record.source == "lazy"
    torch.testing.assert_close(o, kda.chunk_kda(**call, backend="torch")[0], rtol=0, atol=0)
    assert "chosen: plugin" in str(kda.explain(**call))

    # Training goes forward and backward through the plugin too.
    train = inputs(requires_grad=True)
    with kda.trace_routes() as routes:
        out, _ = kda.chunk_kda(**train)
        out.sum().backward()
    assert [(r.backend, r.phase) for r in routes] == [("plugin", "forward"), ("plugin", "backward")]
    assert calls["backward"] >= 1 and train["q"].grad is not None


def test_entry_point_backend_verifies_with_the_cli(seed, plugin_dir, monkeypatch, capsys):
    install(plugin_dir, {"plugin": "mod:PluginBackend"}, {"mod": PLUGIN_SOURCE})
    call = inputs()
    key = kda.KDASpec.from_call(**call).case_class.key
    assert cli.main(["--backend", "plugin", "--case", key, "--quick", "--device", "cpu"]) == 0
    assert "plugin" in capsys.readouterr().out
    backend = kda.get_backend("plugin")
    assert default_store().get(backend, "cpu", key).source == "verify"

    monkeypatch.setenv("KDA_VERIFY", "strict")
    with kda.trace_routes() as routes:
        kda.chunk_kda(**call, backend="plugin")
    assert [r.backend for r in routes] == ["plugin"]
    assert plugin_module(backend).CALLS["forward"] == 1


def test_entry_point_may_name_an_instance(seed, plugin_dir):
    install(plugin_dir, {"plugin_instance": "mod:INSTANCE"}, {"mod": PLUGIN_SOURCE})
    backend = kda.get_backend("plugin_instance")
    assert backend is plugin_module(backend).INSTANCE
    with kda.trace_routes() as routes:
        kda.chunk_kda(**inputs(), backend="plugin_instance")
    assert [r.backend for r in routes] == ["plugin_instance"]


BROKEN = {
    "import-error": (
        'raise ImportError("needs libfancykernels.so.3")\n',
        "Backend",
        "ImportError: needs libfancykernels.so.3",
    ),
    "missing-attribute": ("X = 1\n", "Backend", "AttributeError"),
    "not-a-backend": (PLUGIN_SOURCE, "NOT_A_BACKEND", "is not a kda Backend"),
    "constructor-raises": (
        PLUGIN_SOURCE
        + textwrap.dedent("""
        class Fussy(PluginBackend):
            name = "fussy"
            def __init__(self):
                raise RuntimeError("CUDA driver too old")
        """),
        "Fussy",
        "RuntimeError: CUDA driver too old",
    ),
    # Regression: anything but an Exception (sys.exit at import, a BaseException of the plugin's own) went
    # through the registry and ended the caller's process on its first chunk_kda.
    "sys-exit-at-import": ("import sys\nsys.exit(3)\n", "Backend", "SystemExit: 3"),
    "generator-exit-at-import": ('raise GeneratorExit("closed early")\n', "Backend", "GeneratorExit: closed early"),
    "own-base-exception-at-import": (
        'class LicenceAbort(BaseException):\n    pass\nraise LicenceAbort("no licence")\n',
        "Backend",
        "LicenceAbort: no licence",
    ),
    "constructor-exits": (
        PLUGIN_SOURCE
        + textwrap.dedent("""
        class Quitter(PluginBackend):
            name = "quitter"
            def __init__(self):
                sys.exit("no GPU, giving up")
        """),
        "Quitter",
        "SystemExit: no GPU, giving up",
    ),
}


@pytest.mark.parametrize("kind", sorted(BROKEN))
def test_broken_entry_point_is_reported_not_fatal(seed, plugin_dir, caplog, kind):
    source, attr, reason = BROKEN[kind]
    caplog.set_level(logging.WARNING, logger="kda")
    install(
        plugin_dir, {"broken": f"bad:{attr}", "plugin": "good:PluginBackend"}, {"bad": source, "good": PLUGIN_SOURCE}
    )

    names = own_names()
    assert set(names) == {"broken", "plugin", "torch"}  # the good entry point after it still loads
    broken = kda.get_backend("broken")
    verdict = registry.availability(broken)
    assert not verdict and any(reason in r and "failed to load" in r for r in verdict.reasons), verdict
    assert "broken" not in kda.available_backends()
    assert any(
        "broken" in r.getMessage() and "failed to load" in r.getMessage()
        for r in caplog.records
        if r.levelno == logging.WARNING
    )

    call = inputs()
    with kda.trace_routes() as routes:
        kda.chunk_kda(**call)
    assert [r.backend for r in routes] == ["plugin"]
    with kda.trace_routes() as routes:
        kda.chunk_kda(**call, backend=["broken", "torch"])
    assert [r.backend for r in routes] == ["torch"]

    row = next(r for r in kda.explain(**call).rows() if r[0] == "broken")
    assert row[1] == "rejected" and "available: no" in row[2] and reason in row[2]
    with kda.trace_routes() as routes, pytest.raises(kda.BackendSelectionError) as error:
        kda.chunk_kda(**call, backend="broken")
    assert routes == []
    assert reason in str(error.value)


def test_keyboard_interrupt_in_a_plugin_still_interrupts(plugin_dir):
    """Ctrl-C while a plugin imports is the user's, not the plugin's: it reaches the caller."""
    install(plugin_dir, {"slow": "mod:Backend"}, {"mod": "raise KeyboardInterrupt\n"})
    with pytest.raises(KeyboardInterrupt):
        kda.registered_backends()


class LicenceAbort(BaseException):
    """What a plugin might raise that is no Exception."""


class ExitsInAvailable(TorchBackend):
    name = "exits_in_available"
    priority = 60

    def available(self):
        sys.exit(4)


class AbortsInSupports(TorchBackend):
    name = "aborts_in_supports"
    priority = 70

    def supports(self, spec):
        raise LicenceAbort("no licence")


class InterruptedInAvailable(TorchBackend):
    name = "interrupted"
    priority = 80

    def available(self):
        raise KeyboardInterrupt


def test_available_or_supports_that_exit_are_a_no_not_the_end(seed):
    """Regression: a backend whose available() called sys.exit, or whose supports() raised a BaseException,
    ended the process on the first auto call (dispatch and the registry caught only Exception). Now each is a
    "no" with the exception as the reason; KeyboardInterrupt still propagates."""
    kda.register_backend(ExitsInAvailable)
    kda.register_backend(AbortsInSupports)
    call = inputs()
    with kda.trace_routes() as routes:
        kda.chunk_kda(**call)
    assert [r.backend for r in routes] == ["torch"]
    assert "exits_in_available" not in kda.available_backends()
    reasons = kda.explain(**call).decision.reasons()
    assert any("available() raised SystemExit: 4" in r for r in reasons["exits_in_available"]), reasons
    assert any("supports() raised LicenceAbort: no licence" in r for r in reasons["aborts_in_supports"]), reasons

    kda.register_backend(InterruptedInAvailable)
    with pytest.raises(KeyboardInterrupt):
        kda.chunk_kda(**call)


class ExitsWhenGraded(TorchBackend):
    """Supports every call, but its supports() exits (or raises) for the verifier's own cases."""

    name = "exits_when_graded"
    priority = 60
    error: BaseException = SystemExit(5)

    def supports(self, spec):
        if in_verification():
            raise self.error
        return kda.Verdict.yes()


@pytest.mark.parametrize("error", [SystemExit(5), RuntimeError("no such case")], ids=["exit", "exception"])
def test_supports_that_raises_inside_verification_fails_the_check_not_the_call(seed, error):
    """Regression: the verifier asks supports() again for each case it runs; there a raise (sys.exit, or
    any exception) went through the lazy check and ended the call. Now the case fails with the exception as
    the reason, the backend is unverified for the class, and the call runs on torch."""
    backend = ExitsWhenGraded()
    backend.error = error
    kda.register_backend(backend)
    call = inputs()
    with kda.trace_routes() as routes:
        kda.chunk_kda(**call)
    assert [r.backend for r in routes] == ["torch"]
    record = default_store().get(backend, "cpu", kda.KDASpec.from_call(**call).case_class.key)
    assert record is not None and not record.passed
    assert f"supports() raised {type(error).__name__}" in record.reason


def test_broken_entry_point_alone_leaves_torch_working(seed, plugin_dir):
    install(plugin_dir, {"broken": "bad:Backend"}, {"bad": 'raise ImportError("no such wheel")\n'})
    assert own_names() == ["torch", "broken"]
    call = inputs(requires_grad=True)
    with kda.trace_routes() as routes:
        o, _ = kda.chunk_kda(**call)
        o.sum().backward()
    assert [r.backend for r in routes] == ["torch", "torch"]
    # The CLI does not verify (or fail on) a backend it cannot load unless it is named ...
    key = kda.KDASpec.from_call(**inputs()).case_class.key
    assert cli.main(["--backend", "torch", "--case", key, "--quick", "--device", "cpu"]) == 0
    # ... and reports it as unavailable (exit 1) when it is.
    assert cli.main(["--backend", "broken", "--case", key, "--quick", "--device", "cpu"]) == 1


def test_entry_points_disappear_with_their_distribution(seed, plugin_dir, monkeypatch):
    install(plugin_dir, {"plugin": "mod:PluginBackend"}, {"mod": PLUGIN_SOURCE})
    assert "plugin" in [b.name for b in kda.registered_backends()]
    sys.path.remove(str(plugin_dir[0]))
    importlib.invalidate_caches()
    registry._reset_for_tests()
    assert own_names() == ["torch"]


def test_entry_point_with_a_taken_name_does_not_break_kda(seed, plugin_dir, caplog):
    """Regression (bug found while writing these tests, fixed since): an entry point named like a
    registered backend made the registry raise ValueError on first use, and skipped later entry points."""
    caplog.set_level(logging.WARNING, logger="kda")
    clash = PLUGIN_SOURCE + textwrap.dedent("""
        class Clash(PluginBackend):
            name = "torch"
        """)
    install(
        plugin_dir, {"torch": "clash:Clash", "plugin": "good:PluginBackend"}, {"clash": clash, "good": PLUGIN_SOURCE}
    )
    with kda.trace_routes() as routes:
        kda.chunk_kda(**inputs(), backend="torch")
    assert [r.backend for r in routes] == ["torch"]
    assert type(kda.get_backend("torch")).__module__ == "kda.backends.torch"  # the built-in stays
    names = [b.name for b in kda.registered_backends()]
    assert "plugin" in names  # the entry point after the clash still loaded
    # The clash is reported, as an unavailable stand-in whose reason names the taken name.
    stand_ins = [b for b in kda.registered_backends() if b.name not in ("torch", "plugin", *ADAPTERS)]
    assert len(stand_ins) == 1 and "torch" in stand_ins[0].name
    verdict = registry.availability(stand_ins[0])
    assert not verdict and "torch" in "; ".join(verdict.reasons)
    assert any("failed to load" in r.getMessage() for r in caplog.records)
