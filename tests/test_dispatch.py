"""Tests of the dispatcher (`kda.dispatch`) and the registry (`kda.registry`), through the public API.

Every test proves which backend ran twice over: with `kda.trace_routes()`, and with call counters inside
the test backends that tell verification calls (made from `kda/verify/check.py`) from real calls. Inputs
are tiny, random (never zeros) and on the CPU; calls use ``chunk_size=32`` so that lazy verification is
quick.
"""

from __future__ import annotations

import logging
import os
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from kernel_cases import case_class

import kda
from kda import dispatch, registry
from kda.backends.torch import TorchBackend
from kda.verify import cli
from kda.verify.cases import cases_for
from kda.verify.check import is_verifying as in_verification
from kda.verify.records import default_store

# fla, flashkda, triton, helion and tilelang are built in, and unavailable on a machine without their packages or a GPU;
# the tests below are about the other backends, so they leave those out of their lists.
ADAPTERS = {"fla", "flashkda", "triton", "helion", "tilelang"}


# a lazy (quick) check runs each class's realistic and correlated case: two forward calls a class
QUICK_CASES = len(cases_for(case_class(), quick=True))


def own_names() -> list[str]:
    return [b.name for b in kda.registered_backends() if b.name not in ADAPTERS]


# ----------------------------------------------------------------------------------------------- helpers


class SpyBackend(kda.Backend):
    """Wraps the torch backend; `mode` makes it right, wrong, or broken. Counts its calls."""

    name = "spy"
    version = "1"
    priority = 100
    trains = True

    def __init__(self, mode: str = "good", available: Any = None, supports: Any = None):
        self.mode = mode
        self._available = available
        self._supports = supports
        self.torch = TorchBackend()  # a private instance: spying on the registered torch stays exact
        self.calls = 0  # forward calls from the dispatcher (real calls)
        self.verify_calls = 0  # forward calls made by verification
        self.backward_calls = 0

    def available(self) -> kda.Verdict:
        if self._available is None:
            return kda.Verdict.yes()
        return self._available()

    def supports(self, spec: kda.KDASpec) -> kda.Verdict:
        if self._supports is None:
            return kda.Verdict.yes("wraps torch")
        return self._supports(spec)

    def forward(self, inputs, spec, out=None):
        if in_verification():
            self.verify_calls += 1
        else:
            self.calls += 1
        if self.mode == "boom":
            raise RuntimeError("boom")
        result = self.torch.forward(inputs, spec, out)
        if self.mode == "scale":
            result.o = result.o * 1.01
        elif self.mode == "zero_head":
            o = result.o.clone()
            o[:, :, 0] = 0
            result.o = o
        return result

    def backward(self, inputs, spec, saved, do, dfinal_state):
        self.backward_calls += 1
        return self.torch.backward(inputs, spec, saved, do, dfinal_state)


def make_backend(
    name: str, mode: str = "good", *, priority: int = 100, trains: bool = True, register: bool = True, **behaviour: Any
) -> SpyBackend:
    cls = type(f"Spy_{name}", (SpyBackend,), {"name": name, "priority": priority, "trains": trains})
    backend = cls(mode, **behaviour)
    if register:
        kda.register_backend(backend)
    return backend


def inputs(
    T: int = 40, H: int = 1, HV: int | None = None, K: int = 16, V: int = 16, requires_grad: bool = False
) -> dict[str, Any]:
    """Random pregated inputs, contractive delta rule (unit q, k; beta in (0.05, 0.95))."""
    HV = H if HV is None else HV
    tensors = {
        "q": F.normalize(torch.randn(1, T, H, K), dim=-1),
        "k": F.normalize(torch.randn(1, T, H, K), dim=-1),
        "v": torch.randn(1, T, HV, V),
        "g": F.logsigmoid(torch.randn(1, T, HV, K) + 1.0),
        "beta": torch.rand(1, T, HV) * 0.9 + 0.05,
    }
    if requires_grad:
        for t in tensors.values():
            t.requires_grad_(True)
    return {**tensors, "chunk_size": 32}


def case_key(call: dict[str, Any]) -> str:
    spec_args = {n: a for n, a in call.items() if n != "backend"}
    return kda.KDASpec.from_call(**spec_args).case_class.key


def spy_on_registered_torch(monkeypatch) -> dict[str, int]:
    """Count forward calls of the registered torch backend instance (verification calls included)."""
    torch_backend = kda.get_backend("torch")
    original = torch_backend.forward
    count = {"calls": 0}

    def forward(*args, **kwargs):
        count["calls"] += 1
        return original(*args, **kwargs)

    monkeypatch.setattr(torch_backend, "forward", forward)
    return count


def verification_files() -> list[Path]:
    root = Path(os.environ["KDA_CACHE_DIR"]) / "verification"
    return sorted(root.glob("*.json")) if root.exists() else []


# ------------------------------------------------------------------------- wrong, good and broken backends


@pytest.mark.parametrize("mode", ["scale", "zero_head"])
def test_wrong_backend_is_rejected_and_never_used_by_auto(seed, mode):
    wrong = make_backend("wrong", mode)
    call = inputs(H=2)
    key = case_key(call)

    with kda.trace_routes() as routes:
        o, final = kda.chunk_kda(**call)

    assert final is None
    assert [(r.backend, r.phase, r.case_class) for r in routes] == [("torch", "forward", key)]
    assert wrong.verify_calls == QUICK_CASES, "auto must verify the wrong backend (it has the top priority)"
    assert wrong.calls == 0, "the wrong backend ran the real call"
    expected, _ = kda.chunk_kda(**call, backend="torch")
    assert torch.equal(o, expected)

    text = str(kda.explain(**call))
    assert "chosen: torch" in text
    wrong_rows = [row for row in kda.explain(**call).rows() if row[0] == "wrong"]
    assert len(wrong_rows) == 1
    _, outcome, detail = wrong_rows[0]
    assert outcome == "rejected"
    assert "failed verification" in detail and key in detail
    assert wrong.calls == 0


def test_correct_backend_is_verified_lazily_then_chosen(seed):
    good = make_backend("good")
    call = inputs()
    key = case_key(call)
    assert verification_files() == []

    with kda.trace_routes() as routes:
        o, _ = kda.chunk_kda(**call)

    assert [r.backend for r in routes] == ["good"]
    assert (good.verify_calls, good.calls) == (QUICK_CASES, 1)
    files = [p.name for p in verification_files()]
    assert any(name.startswith("good-") for name in files), files
    record = default_store().get(good, "cpu", key)
    assert record is not None and record.passed and record.source == "lazy" and record.quick
    expected, _ = kda.chunk_kda(**call, backend="torch")
    torch.testing.assert_close(o, expected, rtol=0, atol=0)

    # Second call: verified already, no new verification.
    with kda.trace_routes() as routes:
        kda.chunk_kda(**inputs(T=37))
    assert [r.backend for r in routes] == ["good"]
    assert (good.verify_calls, good.calls) == (QUICK_CASES, 2)
    assert "passed" in str(kda.explain(**call)) and "chosen: good" in str(kda.explain(**call))


def test_correct_backend_trains_through_same_backend(seed):
    good = make_backend("good")
    call = inputs(requires_grad=True)
    with kda.trace_routes() as routes:
        o, _ = kda.chunk_kda(**call)
        o.square().sum().backward()
    assert [(r.backend, r.phase) for r in routes] == [("good", "forward"), ("good", "backward")]
    assert good.calls == 1 and good.backward_calls >= 1
    assert all(call[n].grad is not None and torch.isfinite(call[n].grad).all() for n in ("q", "k", "v", "g", "beta"))


def test_backend_that_raises_is_rejected_with_its_error(seed):
    boom = make_backend("boomer", "boom")
    call = inputs()
    with kda.trace_routes() as routes:
        kda.chunk_kda(**call)
    assert [r.backend for r in routes] == ["torch"]
    assert boom.verify_calls == QUICK_CASES and boom.calls == 0

    reasons = kda.explain(**call).decision.reasons()
    assert "boomer" in reasons and "torch" not in reasons
    assert any("failed verification" in r and "boom" in r for r in reasons["boomer"]), reasons
    with pytest.raises(kda.BackendSelectionError, match="boom") as error:
        kda.chunk_kda(**call, backend="boomer")
    assert any("boom" in r for r in error.value.reasons["boomer"])


@pytest.mark.parametrize(
    "available, reason",
    [
        (lambda: kda.Verdict.no("missing package"), "missing package"),
        (lambda: (_ for _ in ()).throw(RuntimeError("no driver found")), "no driver found"),
        (lambda: True, "not a Verdict"),
    ],
    ids=["verdict-no", "raises", "bare-bool"],
)
def test_unavailable_backend_is_shown_with_its_reason(seed, available, reason):
    gone = make_backend("gone", available=available)
    call = inputs()
    with kda.trace_routes() as routes:
        kda.chunk_kda(**call)
    assert [r.backend for r in routes] == ["torch"]
    assert gone.calls == 0 and gone.verify_calls == 0, "an unavailable backend must not even be verified"
    assert "gone" not in kda.available_backends() and "torch" in kda.available_backends()

    row = next(r for r in kda.explain(**call).rows() if r[0] == "gone")
    assert row[1] == "rejected" and "available: no" in row[2] and reason in row[2]
    assert "supports" not in row[2]  # the walk stops at the first no
    with pytest.raises(kda.BackendSelectionError, match=reason):
        kda.chunk_kda(**call, backend="gone")


def test_unsupported_backend_lists_its_reason(seed):
    picky = make_backend("picky", supports=lambda spec: kda.Verdict.no(f"needs K >= 64, got K={spec.K}"))
    call = inputs()
    with kda.trace_routes() as routes:
        kda.chunk_kda(**call)
    assert [r.backend for r in routes] == ["torch"]
    assert picky.calls == 0 and picky.verify_calls == 0

    text = str(kda.explain(**call))
    assert "supports: no: needs K >= 64, got K=16" in text
    with kda.trace_routes() as routes, pytest.raises(kda.BackendSelectionError) as error:
        kda.chunk_kda(**call, backend="picky")
    assert routes == []
    assert "needs K >= 64, got K=16" in str(error.value)
    assert error.value.reasons == {"picky": ["supports: needs K >= 64, got K=16"]}


def test_supports_that_raises_is_a_reason_not_a_crash(seed):
    def explode(spec):
        raise KeyError("gate table")

    make_backend("explodes", supports=explode)
    call = inputs()
    with kda.trace_routes() as routes:
        kda.chunk_kda(**call)
    assert [r.backend for r in routes] == ["torch"]
    with pytest.raises(kda.BackendSelectionError, match="supports\\(\\) raised KeyError"):
        kda.chunk_kda(**call, backend="explodes")


# ----------------------------------------------------------------------------- explicit and scoped requests


def test_explicit_wrong_backend_raises_and_never_falls_back(seed, monkeypatch):
    wrong = make_backend("wrong", "scale")
    torch_calls = spy_on_registered_torch(monkeypatch)
    call = inputs()
    with kda.trace_routes() as routes, pytest.raises(kda.BackendSelectionError) as error:
        kda.chunk_kda(**call, backend="wrong")
    assert routes == []
    assert torch_calls["calls"] == 0, "torch ran although only 'wrong' was requested"
    assert wrong.calls == 0 and wrong.verify_calls == QUICK_CASES
    assert list(error.value.reasons) == ["wrong"]
    assert "failed verification" in str(error.value) and "requested: wrong" in str(error.value)


def test_backend_list_falls_through_in_order(seed):
    wrong = make_backend("wrong", "scale")
    good = make_backend("good", priority=-5)  # low priority: only the list order can pick it
    call = inputs()
    with kda.trace_routes() as routes:
        kda.chunk_kda(**call, backend=["wrong", "torch"])
    assert [r.backend for r in routes] == ["torch"]
    with kda.trace_routes() as routes:
        kda.chunk_kda(**call, backend=["wrong", "good", "torch"])
    assert [r.backend for r in routes] == ["good"]
    assert wrong.calls == 0 and good.calls == 1
    with pytest.raises(ValueError):
        kda.chunk_kda(**call, backend=[])


def test_unknown_backend_name_raises(seed):
    call = inputs()
    with kda.trace_routes() as routes, pytest.raises(kda.BackendSelectionError) as error:
        kda.chunk_kda(**call, backend="no_such_backend")
    assert routes == []
    assert error.value.reasons == {"no_such_backend": ["not registered"]}
    with pytest.raises(kda.BackendSelectionError, match="no_such_backend"):
        kda.chunk_kda(**call, backend=["torch", "no_such_backend"])


def test_use_backends_restricts_auto_and_explicit_argument_wins(seed):
    good = make_backend("good")
    make_backend("wrong", "scale", priority=200)
    call = inputs()
    with kda.use_backends("torch"):
        with kda.trace_routes() as routes:
            kda.chunk_kda(**call)
        assert [r.backend for r in routes] == ["torch"]
        with kda.trace_routes() as routes:
            kda.chunk_kda(**call, backend="good")  # the call's own argument wins over the block
        assert [r.backend for r in routes] == ["good"]
    with kda.trace_routes() as routes:
        kda.chunk_kda(**call)  # outside the block: auto again, over everything
    assert [r.backend for r in routes] == ["good"]
    assert good.calls == 2

    # A block naming only a backend that cannot serve the call raises: no fallback to torch.
    with (
        kda.use_backends(["wrong"]),
        kda.trace_routes() as routes,
        pytest.raises(kda.BackendSelectionError, match="wrong"),
    ):
        kda.chunk_kda(**call)
    assert routes == []


def test_use_backends_with_unknown_name_raises_value_error():
    with pytest.raises(ValueError, match="nope"), kda.use_backends("torch", "nope"):
        pass  # pragma: no cover
    with pytest.raises(ValueError), kda.use_backends():
        pass  # pragma: no cover


# ------------------------------------------------------------------------------------------- forward-only


def test_forward_only_backend_serves_only_calls_without_gradients(seed):
    fwd = make_backend("fwdonly", trains=False)
    with kda.trace_routes() as routes:
        kda.chunk_kda(**inputs())
    assert [r.backend for r in routes] == ["fwdonly"]
    assert fwd.calls == 1

    call = inputs(requires_grad=True)
    with kda.trace_routes() as routes:
        o, _ = kda.chunk_kda(**call)
        o.sum().backward()
    assert [(r.backend, r.phase) for r in routes] == [("torch", "forward"), ("torch", "backward")]
    assert fwd.calls == 1 and fwd.backward_calls == 0
    row = next(r for r in kda.explain(**call).rows() if r[0] == "fwdonly")
    assert row[1] == "rejected" and "forward-only" in row[2]
    with pytest.raises(kda.BackendSelectionError, match="forward-only"):
        kda.chunk_kda(**call, backend="fwdonly")

    # Inputs that require grad, but under no_grad: no gradient is needed, so the forward-only one serves.
    with torch.no_grad(), kda.trace_routes() as routes:
        kda.chunk_kda(**call)
    assert [r.backend for r in routes] == ["fwdonly"]


# ------------------------------------------------------------------------------------------ KDA_VERIFY


def test_strict_requires_a_record_from_kda_verify(seed, monkeypatch, capsys):
    good = make_backend("good")
    call = inputs()
    key = case_key(call)

    # A lazy record (made on first use) does not count in strict mode.
    with kda.trace_routes() as routes:
        kda.chunk_kda(**call)
    assert [r.backend for r in routes] == ["good"]
    assert default_store().get(good, "cpu", key).source == "lazy"
    verify_calls = good.verify_calls

    monkeypatch.setenv("KDA_VERIFY", "strict")
    with kda.trace_routes() as routes, pytest.raises(kda.BackendSelectionError) as error:
        kda.chunk_kda(**call)
    # What the code does: strict rejects every backend without a `kda.verify` record, torch included,
    # so even auto raises.
    assert routes == []
    assert set(error.value.reasons) - ADAPTERS == {"good", "torch"}
    for name, why in error.value.reasons.items():
        if name not in ADAPTERS:  # those two fail earlier here: not installed
            assert any("KDA_VERIFY=strict" in r and key in r for r in why), why
    assert good.verify_calls == verify_calls, "strict must never verify lazily"
    with pytest.raises(kda.BackendSelectionError, match="strict"):
        kda.chunk_kda(**call, backend="torch")

    assert cli.main(["--backend", "good", "--case", key, "--quick", "--device", "cpu"]) == 0
    assert default_store().get(good, "cpu", key).source == "verify"
    with kda.trace_routes() as routes:
        kda.chunk_kda(**call)
    assert [r.backend for r in routes] == ["good"]
    # torch is still unverified in strict mode
    with pytest.raises(kda.BackendSelectionError, match="strict"):
        kda.chunk_kda(**call, backend="torch")
    assert cli.main(["--backend", "torch", "--case", key, "--quick", "--device", "cpu"]) == 0
    with kda.trace_routes() as routes:
        kda.chunk_kda(**call, backend="torch")
    assert [r.backend for r in routes] == ["torch"]
    # A record for another case class does not help.
    other = {**call, "output_final_state": True}
    with pytest.raises(kda.BackendSelectionError, match="strict"):
        kda.chunk_kda(**other)


def test_strict_without_any_record_rejects_a_new_backend(seed, monkeypatch):
    monkeypatch.setenv("KDA_VERIFY", "strict")
    good = make_backend("good")
    call = inputs()
    row = next(r for r in kda.explain(**call).rows() if r[0] == "good")
    assert row[1] == "rejected" and "KDA_VERIFY=strict" in row[2]
    assert good.verify_calls == 0 and verification_files() == []


def test_verify_off_uses_an_unverified_backend_with_a_warning(seed, monkeypatch):
    monkeypatch.setenv("KDA_VERIFY", "off")
    monkeypatch.setattr(dispatch, "_warned_off", False)  # the warning is once per process
    wrong = make_backend("wrong", "scale")
    call = inputs()
    with pytest.warns(RuntimeWarning, match="KDA_VERIFY=off"), kda.trace_routes() as routes:
        o, _ = kda.chunk_kda(**call)
    assert [r.backend for r in routes] == ["wrong"]  # trusted without a check, wrong as it is
    assert wrong.verify_calls == 0 and wrong.calls == 1
    assert verification_files() == []
    torch.testing.assert_close(o, kda.chunk_kda(**call, backend="torch")[0] * 1.01)
    assert "not checked" in str(kda.explain(**call))


@pytest.mark.parametrize("value", ["sometimes", "1", "strictly"])
def test_invalid_verify_mode_raises(seed, monkeypatch, value):
    monkeypatch.setenv("KDA_VERIFY", value)
    call = inputs()
    with kda.trace_routes() as routes, pytest.raises(kda.KDAError, match="KDA_VERIFY"):
        kda.chunk_kda(**call)
    assert routes == []
    with pytest.raises(kda.KDAError, match=value):
        kda.explain(**call)


def test_verify_mode_is_case_insensitive(seed, monkeypatch):
    monkeypatch.setenv("KDA_VERIFY", " LAZY ")
    with kda.trace_routes() as routes:
        kda.chunk_kda(**inputs())
    assert [r.backend for r in routes] == ["torch"]


# ------------------------------------------------------------------------------------ logging and caching


def test_choice_is_logged_once_per_case_class(seed, caplog):
    caplog.set_level(logging.INFO, logger="kda")
    call = inputs()
    kda.chunk_kda(**call)
    kda.chunk_kda(**call)
    kda.chunk_kda(**inputs(T=29))  # same case class, other size
    lines = [r.getMessage() for r in caplog.records if r.name == "kda" and "-> backend" in r.getMessage()]
    assert len(lines) == 1, lines
    assert "'torch'" in lines[0] and case_key(call) in lines[0]
    assert all(r.levelno == logging.INFO for r in caplog.records if "-> backend" in r.getMessage())

    kda.chunk_kda(**{**call, "output_final_state": True})  # a new case class: one more line
    lines = [r.getMessage() for r in caplog.records if "-> backend" in r.getMessage()]
    assert len(lines) == 2 and "ht" in lines[1]


def test_failing_record_is_cached(seed):
    wrong = make_backend("wrong", "scale")
    call = inputs()
    key = case_key(call)
    kda.chunk_kda(**call)
    assert wrong.verify_calls == QUICK_CASES
    record = default_store().get(wrong, "cpu", key)
    assert record is not None and not record.passed and "rel. error" in record.reason

    for T in (40, 33, 51):
        dispatch.clear_cache()  # forget decisions: only the record can spare a new verification
        other = inputs(T=T)
        assert case_key(other) == key
        with kda.trace_routes() as routes:
            kda.chunk_kda(**other)
        assert [r.backend for r in routes] == ["torch"]
    with pytest.raises(kda.BackendSelectionError):
        kda.chunk_kda(**call, backend="wrong")
    assert "failed verification" in str(kda.explain(**call))
    assert wrong.verify_calls == QUICK_CASES and wrong.calls == 0


# ---------------------------------------------------------------------------------------------- registry


def _minimal(backend_name: Any, **attrs: Any) -> type[kda.Backend]:
    body: dict[str, Any] = {
        "supports": lambda self, spec: kda.Verdict.yes(),
        "forward": lambda self, inputs, spec, out=None: TorchBackend().forward(inputs, spec, out),
        **attrs,
    }
    if backend_name is not None:
        body["name"] = backend_name
    return type(f"Minimal_{backend_name}", (kda.Backend,), body)


def test_register_duplicate_name_needs_replace():
    first = _minimal("dup", version="1")
    second = _minimal("dup", version="2")
    kda.register_backend(first)
    with pytest.raises(ValueError, match="already registered"):
        kda.register_backend(second)
    assert kda.get_backend("dup").version == "1"
    kda.register_backend(second, replace=True)
    assert kda.get_backend("dup").version == "2"
    assert [b.name for b in kda.registered_backends()].count("dup") == 1
    with pytest.raises(ValueError, match="already registered"):
        kda.register_backend(_minimal("torch"))
    assert isinstance(kda.get_backend("torch"), TorchBackend)


@pytest.mark.parametrize("name", [None, "", "auto", 7])
def test_register_backend_without_a_usable_name_raises(name):
    cls = _minimal(name)
    before = [b.name for b in kda.registered_backends()]
    with pytest.raises(ValueError, match="name"):
        kda.register_backend(cls)
    assert [b.name for b in kda.registered_backends()] == before


def test_register_rejects_non_backends():
    with pytest.raises(TypeError):
        kda.register_backend(object)  # type: ignore[arg-type]


def test_register_backend_as_class_decorator_and_unregister(seed):
    @kda.register_backend
    class Decorated(SpyBackend):
        name = "decorated"
        priority = 50

    assert isinstance(Decorated, type) and issubclass(Decorated, kda.Backend)  # the class is returned
    assert own_names()[:2] == ["decorated", "torch"]  # by priority
    assert type(kda.get_backend("decorated")) is Decorated
    with kda.trace_routes() as routes:
        kda.chunk_kda(**inputs())
    assert [r.backend for r in routes] == ["decorated"]

    kda.unregister_backend("decorated")
    assert "decorated" not in [b.name for b in kda.registered_backends()]
    with pytest.raises(KeyError):
        kda.get_backend("decorated")
    with kda.trace_routes() as routes:
        kda.chunk_kda(**inputs())  # the cached decision for this call must not outlive the backend
    assert [r.backend for r in routes] == ["torch"]
    with pytest.raises(KeyError):
        kda.unregister_backend("decorated")
    with pytest.raises(kda.BackendSelectionError, match="decorated"):
        kda.chunk_kda(**inputs(), backend="decorated")


def test_registered_backends_order_and_registry_reset():
    make_backend("low", priority=-3)
    make_backend("high", priority=9)
    assert own_names() == ["high", "torch", "low"]
    registry._reset_for_tests()
    assert own_names() == ["torch"]
