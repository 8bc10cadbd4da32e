"""Tests of the verification records (`kda.verify.records`): fingerprints, corrupt files, concurrent writers.

A record is only as good as its fingerprint: a new backend version or a new package version must leave
every backend unverified. A broken record file must count as no record (never break a call), and
writers in several processes must never lose each other's records.
"""

from __future__ import annotations

import contextlib
import importlib.metadata
import itertools
import json
import math
import multiprocessing
import os
import warnings
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.nn.functional as F

import kda
from kda import dispatch
from kda.backends.torch import TorchBackend
from kda.spec import CaseClass, GateMode
from kda.verify import cli
from kda.verify import records as records_module
from kda.verify.cases import cases_for
from kda.verify.check import is_verifying as in_verification
from kda.verify.policy import required_tensors, tolerance
from kda.verify.records import (
    RECORD_FORMAT,
    Record,
    RecordStore,
    default_store,
    fingerprint,
    fingerprint_id,
    package_versions,
)
from kda.verify.recurrent import recurrent_grid

# ----------------------------------------------------------------------------------------------- helpers


class Wrapped(kda.Backend):
    """The torch backend under another name; `scale` != 1 makes it wrong. Counts its calls."""

    name = "wrapped"
    version = "1"
    priority = 100
    trains = True
    scale = 1.0

    def __init__(self):
        self.torch = TorchBackend()
        self.calls = 0
        self.verify_calls = 0

    def supports(self, spec):
        return kda.Verdict.yes()

    def forward(self, inputs, spec, out=None):
        if in_verification():
            self.verify_calls += 1
        else:
            self.calls += 1
        result = self.torch.forward(inputs, spec, out)
        if self.scale != 1.0:
            result.o = result.o * self.scale
        return result

    def backward(self, inputs, spec, saved, do, dfinal_state):
        return self.torch.backward(inputs, spec, saved, do, dfinal_state)


class WrappedV2(Wrapped):
    version = "2"


class WrongWrapped(Wrapped):
    name = "wrong"
    scale = 1.01


def inputs(T: int = 40, H: int = 1, K: int = 16, V: int = 16) -> dict[str, Any]:
    return {
        "q": F.normalize(torch.randn(1, T, H, K), dim=-1),
        "k": F.normalize(torch.randn(1, T, H, K), dim=-1),
        "v": torch.randn(1, T, H, V),
        "g": F.logsigmoid(torch.randn(1, T, H, K) + 1.0),
        "beta": torch.rand(1, T, H) * 0.9 + 0.05,
        "chunk_size": 32,
    }


def case_key(call: dict[str, Any]) -> str:
    return kda.KDASpec.from_call(**call).case_class.key


def measured_case(key: str, worst_ratio: float, seed: int = 7) -> dict[str, Any]:
    """A case as the verifier stores it: one sequence over four chunks and a ragged tail, and each tensor the
    class requires measured at `worst_ratio` times its tolerance."""
    cc = CaseClass.from_key(key)
    T = 4 * cc.chunk_size + 13
    errors = {name: worst_ratio * tolerance(name, cc.dtype) for name in sorted(required_tensors(cc))}
    return {"seed": seed, "T": T, "seq_lens": [T], "unsupported": False, "errors": errors, "problems": []}


def record(key: str, worst_ratio: float = 0.25, *, source: Any = "verify", seed: int = 7) -> Record:
    """A quick record (its realistic and correlated case, measured alike); it passes exactly when
    `worst_ratio` <= 1."""
    realistic = {**measured_case(key, worst_ratio, seed), "regime": "realistic"}
    return Record(key, source, True, "cpu", cases=[realistic, {**realistic, "regime": "correlated"}])


# Distinct real case-class keys (forward, so that a CPU record needs no long case).
KEYS = [
    CaseClass(
        gate=gate,
        qk_l2norm=l2,
        beta=beta,
        dtype=dtype,
        varlen=varlen,
        gva=False,
        initial_state=False,
        final_state=False,
        state_v_first=False,
        chunk_size=32,
        head_dim=64,
        training=False,
    ).key
    for gate, l2, beta, dtype, varlen in itertools.product(
        GateMode, (True, False), ("given", "sigmoid", "sigmoid2"), ("bfloat16", "float16", "float32"), (False, True)
    )
]


@pytest.fixture
def fresh_package_versions():
    """package_versions() is cached per process; clear it around a test that fakes package versions."""
    package_versions.cache_clear()
    yield
    package_versions.cache_clear()


# ------------------------------------------------------------------------------------------ fingerprints


def test_backend_version_changes_the_fingerprint_and_hides_old_records(tmp_path):
    store = RecordStore(tmp_path)
    v1, v2 = Wrapped(), WrappedV2()
    key = "pregated/qk/beta/fp32/dense/mha/nostate/c32/d64/fwd"
    store.put(v1, "cpu", [record(key)])

    assert fingerprint(v1, "cpu")["backend_version"] == "1"
    assert fingerprint(v1, "cpu") != fingerprint(v2, "cpu")
    assert fingerprint_id(fingerprint(v1, "cpu")) != fingerprint_id(fingerprint(v2, "cpu"))
    assert store.get(v1, "cpu", key) is not None
    assert store.get(Wrapped(), "cpu", key) is not None  # another instance, same name and version
    assert store.get(v2, "cpu", key) is None
    assert RecordStore(tmp_path).get(v2, "cpu", key) is None


class BackwardChanged(Wrapped):
    """`Wrapped` after a change to its backward alone: version 2, its inference calls still version 1's."""

    version = "2"
    forward_version = "1"


FORWARD_KEY = "pregated/qk/beta/fp32/dense/mha/nostate/c32/d64/fwd"
TRAINING_KEY = "pregated/qk/beta/fp32/dense/mha/nostate/c32/d64/train"
DECODE_KEY = recurrent_grid()[0].key  # the decode op's classes are inference ones


def decode_record(key: str) -> Record:
    """A record of a decode class (its cases do not matter here: only where the store keeps it)."""
    return Record(key, "verify", True, "cpu", cases=[])


def test_a_backward_only_change_keeps_inference_records_and_drops_training_ones(tmp_path):
    store = RecordStore(tmp_path)
    store.put(Wrapped(), "cpu", [record(FORWARD_KEY), record(TRAINING_KEY), decode_record(DECODE_KEY)])
    changed = BackwardChanged()

    assert store.get(changed, "cpu", FORWARD_KEY) is not None
    assert store.get(changed, "cpu", DECODE_KEY) is not None
    assert store.get(changed, "cpu", TRAINING_KEY) is None  # the backward it ran is not this one
    assert set(store.load(changed, "cpu")) == {FORWARD_KEY, DECODE_KEY}
    assert set(RecordStore(tmp_path).load(changed, "cpu")) == {FORWARD_KEY, DECODE_KEY}  # a fresh store too
    # the inference classes' fingerprint is version 1's, the training classes' version 2's
    assert fingerprint(changed, "cpu", training=False) == fingerprint(Wrapped(), "cpu")
    assert fingerprint(changed, "cpu")["backend_version"] == "2"


def test_training_records_go_under_the_version_and_inference_ones_under_the_forward_version(tmp_path):
    store = RecordStore(tmp_path)
    changed = BackwardChanged()
    store.put(changed, "cpu", [record(TRAINING_KEY, 0.5), record(FORWARD_KEY, 0.75)])

    training_file = store.path_for(changed, "cpu", training=True)
    forward_file = store.path_for(changed, "cpu", training=False)
    assert training_file != forward_file
    assert set(json.loads(training_file.read_text())["records"]) == {TRAINING_KEY}
    assert set(json.loads(forward_file.read_text())["records"]) == {FORWARD_KEY}
    assert json.loads(forward_file.read_text())["fingerprint"]["backend_version"] == "1"
    assert store.get(changed, "cpu", TRAINING_KEY).worst_ratio == pytest.approx(0.5)
    assert store.get(changed, "cpu", FORWARD_KEY).worst_ratio == pytest.approx(0.75)
    # version 1 finds the inference record (the same forward) and not the training one
    assert store.get(Wrapped(), "cpu", FORWARD_KEY) is not None
    assert store.get(Wrapped(), "cpu", TRAINING_KEY) is None

    # and a later version that moves the forward too (no forward_version) finds neither
    class ForwardChangedToo(Wrapped):
        version = "3"

    assert store.get(ForwardChangedToo(), "cpu", FORWARD_KEY) is None
    assert store.get(ForwardChangedToo(), "cpu", TRAINING_KEY) is None


def test_without_a_forward_version_both_kinds_share_one_file(tmp_path):
    store = RecordStore(tmp_path)
    plain = Wrapped()
    assert store.path_for(plain, "cpu", training=True) == store.path_for(plain, "cpu", training=False)
    store.put(plain, "cpu", [record(TRAINING_KEY), record(FORWARD_KEY)])
    assert set(store.load(plain, "cpu")) == {TRAINING_KEY, FORWARD_KEY}
    assert len(list((tmp_path / "verification").glob("*.json"))) == 1


def test_version_label_names_the_forward_where_it_stands_apart():
    assert Wrapped().version_label() == "v1"
    assert BackwardChanged().version_label() == "v2 (forward v1)"
    assert BackwardChanged().version_for(training=True) == "2"
    assert BackwardChanged().version_for(training=False) == "1"
    assert "forward v1" in repr(BackwardChanged())
    assert BackwardChanged().info().forward_version == "1"


@pytest.mark.parametrize("bad", ["", 1.5, True, ["1"]])
def test_a_backend_with_a_malformed_forward_version_is_refused_with_its_name(bad):
    class Malformed(Wrapped):
        name = "malformed-forward-version"
        forward_version = bad

    with pytest.raises(ValueError, match=r"malformed-forward-version.*forward_version"):
        kda.register_backend(Malformed)
    assert "malformed-forward-version" not in [b.name for b in kda.registered_backends()]


def test_fingerprint_extras_and_name_enter_the_fingerprint(tmp_path):
    class Extras(Wrapped):
        def fingerprint_extras(self):
            return {"cutlass": "3.9"}

    class Renamed(Wrapped):
        name = "renamed"

    key = "safe/l2/sig/bf16/dense/mha/h0+ht/c64/d128/train"
    # Every instance stays alive, so that no id is reused (see the next test).
    plain, extras, renamed, plain_again = Wrapped(), Extras(), Renamed(), Wrapped()
    store = RecordStore(tmp_path)
    store.put(plain, "cpu", [record(key)])
    assert fingerprint(extras, "cpu")["backend_extras"] == {"cutlass": "3.9"}
    assert fingerprint_id(fingerprint(extras, "cpu")) != fingerprint_id(fingerprint(plain, "cpu"))
    assert store.get(extras, "cpu", key) is None
    assert store.get(renamed, "cpu", key) is None
    assert store.get(plain_again, "cpu", key) is not None


def test_store_follows_fingerprint_extras_not_object_identity(tmp_path):
    """Regression (bug found while writing these tests, fixed in records.py since): the store memoised
    the record file per (id(backend), name, version, device), so a backend whose fingerprint_extras
    changed, or a new instance that reused a freed instance's id, read the old fingerprint's records."""

    class Configurable(Wrapped):
        build = "1"

        def fingerprint_extras(self):
            return {"build": self.build}

    class OtherBuild(Configurable):
        build = "2"

    key = "pregated/qk/beta/fp32/dense/mha/nostate/c32/d64/fwd"
    backend = Configurable()
    store = RecordStore(tmp_path)
    store.put(backend, "cpu", [record(key)])
    assert store.get(backend, "cpu", key) is not None
    backend.build = "2"
    assert RecordStore(tmp_path).get(backend, "cpu", key) is None  # a fresh store
    assert store.get(backend, "cpu", key) is None  # the same store, after the extras changed
    backend.build = "1"
    assert store.get(backend, "cpu", key) is not None

    # A new instance with other extras, created right after the first is freed (CPython then usually
    # hands it the same id).
    first = Configurable()
    store.put(first, "cpu", [record(KEYS[1])])
    del first
    second = OtherBuild()
    assert store.get(second, "cpu", KEYS[1]) is None


def test_new_backend_version_is_unverified_end_to_end(seed, monkeypatch):
    call = inputs()
    key = case_key(call)
    v1 = Wrapped()
    kda.register_backend(v1)
    assert cli.main(["--backend", "wrapped", "--case", key, "--quick", "--device", "cpu"]) == 0

    monkeypatch.setenv("KDA_VERIFY", "strict")
    with kda.trace_routes() as routes:
        kda.chunk_kda(**call, backend="wrapped")
    assert [r.backend for r in routes] == ["wrapped"]

    v2 = WrappedV2()
    kda.register_backend(v2, replace=True)
    with kda.trace_routes() as routes, pytest.raises(kda.BackendSelectionError, match="KDA_VERIFY=strict"):
        kda.chunk_kda(**call, backend="wrapped")
    assert routes == [] and v2.calls == 0

    monkeypatch.setenv("KDA_VERIFY", "lazy")
    with kda.trace_routes() as routes:
        kda.chunk_kda(**call, backend="wrapped")
    assert [r.backend for r in routes] == ["wrapped"]
    quick_cases = len(cases_for(CaseClass.from_key(key), quick=True))  # realistic and correlated
    assert v2.verify_calls == quick_cases == 2, "the new version must be verified anew"
    files = sorted(p.name for p in (Path(os.environ["KDA_CACHE_DIR"]) / "verification").glob("wrapped-*.json"))
    assert len(files) == 2, files  # one per fingerprint


def test_package_version_changes_the_fingerprint(seed, tmp_path, monkeypatch, fresh_package_versions):
    backend = Wrapped()
    key = "pregated/qk/beta/fp32/dense/mha/nostate/c32/d64/fwd"
    before = fingerprint(backend, "cpu")
    assert before["packages"]["torch"] == torch.__version__
    RecordStore(tmp_path).put(backend, "cpu", [record(key)])
    assert RecordStore(tmp_path).get(backend, "cpu", key) is not None

    real_version = importlib.metadata.version

    def fake_version(dist: str) -> str:
        if dist == "triton":
            return "99.1.0"
        if dist == "torch":
            return real_version(dist)
        raise importlib.metadata.PackageNotFoundError(dist)

    package_versions.cache_clear()
    monkeypatch.setattr(importlib.metadata, "version", fake_version)
    after = fingerprint(backend, "cpu")
    assert after["packages"]["triton"] == "99.1.0"
    assert before["packages"]["triton"] != "99.1.0"
    assert fingerprint_id(before) != fingerprint_id(after)
    # A fresh store (as in a new process after the upgrade) finds no record.
    assert RecordStore(tmp_path).get(backend, "cpu", key) is None

    # The same through the dispatcher: a new process would verify torch again for this case class.
    call = inputs()
    monkeypatch.setattr(records_module, "_stores", {})
    kda.chunk_kda(**call)
    cache = Path(os.environ["KDA_CACHE_DIR"]) / "verification"
    assert len(list(cache.glob("torch-*.json"))) == 1
    torch_file = next(cache.glob("torch-*.json"))
    assert json.loads(torch_file.read_text())["fingerprint"]["packages"]["triton"] == "99.1.0"

    package_versions.cache_clear()
    monkeypatch.setattr(importlib.metadata, "version", real_version)
    monkeypatch.setattr(records_module, "_stores", {})
    torch_backend = kda.get_backend("torch")
    assert default_store().get(torch_backend, "cpu", case_key(call)) is None  # that record is for 99.1.0


def test_package_versions_reads_distribution_names(monkeypatch, fresh_package_versions):
    seen: list[str] = []

    def fake_version(dist: str) -> str:
        seen.append(dist)
        if dist == "flash-kda":
            return "0.3"
        raise importlib.metadata.PackageNotFoundError(dist)

    monkeypatch.setattr(importlib.metadata, "version", fake_version)
    found = package_versions()
    assert found["flash_kda"] == "0.3" and found["triton"] is None and found["fla"] is None
    assert found["torch"] == torch.__version__  # the imported torch, not the metadata
    assert "tokenspeed-flashkda" in seen and "pytorch-triton" in seen


# ------------------------------------------------------------------------------------------ corrupt files


def _torch_record_path(call: dict[str, Any]) -> Path:
    return default_store().path_for(kda.get_backend("torch"), torch.device("cpu"))


def _valid_failing_payload(key: str) -> str:
    """A well-formed file whose only record says torch *failed* this class (so the truncated file must not
    be half-read)."""
    backend = kda.get_backend("torch")
    return json.dumps(
        {
            "fingerprint": fingerprint(backend, "cpu"),
            "records": {key: record(key, worst_ratio=3.0).as_json()},
        },
        indent=1,
    )


CORRUPT = {
    "garbage-bytes": lambda key: b"\x00\xff\xfe garbage \x89PNG\r\n\x1a\n" + os.urandom(64),
    "truncated-json": lambda key: _valid_failing_payload(key)[: len(_valid_failing_payload(key)) // 2].encode(),
    "empty-file": lambda key: b"",
    "json-list": lambda key: b"[1, 2, 3]",
    "json-null": lambda key: b"null",
    "json-string": lambda key: b'"records"',
    "records-is-list": lambda key: json.dumps({"records": [key]}).encode(),
    "record-is-number": lambda key: json.dumps({"records": {key: 5}}).encode(),
    "record-missing-fields": lambda key: json.dumps({"records": {key: {"passed": True}}}).encode(),
    "no-records-key": lambda key: json.dumps({"fingerprint": {}, "recs": {}}).encode(),
}


@pytest.mark.parametrize("kind", sorted(CORRUPT))
def test_corrupt_record_file_counts_as_no_record(seed, kind):
    call = inputs()
    key = case_key(call)
    path = _torch_record_path(call)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(CORRUPT[kind](key))

    torch_backend = kda.get_backend("torch")
    assert default_store().get(torch_backend, "cpu", key) is None
    assert default_store().load(torch_backend, "cpu") == {}

    with kda.trace_routes() as routes:
        o, _ = kda.chunk_kda(**call)
    assert [r.backend for r in routes] == ["torch"]
    assert torch.isfinite(o).all()

    # The lazy verification replaced the file with a valid one.
    data = json.loads(path.read_text())
    assert set(data) == {"fingerprint", "records"}
    assert data["fingerprint"]["backend"] == "torch"
    assert data["records"][key]["source"] == "lazy"
    assert RecordStore(default_store().root).get(torch_backend, "cpu", key).passed


def _fields(key: str, **changes: Any) -> dict[str, Any]:
    good = record(key, 0.5, source="lazy").as_json()
    return {**good, **changes}


WRONGLY_TYPED = {
    "format-old": {"format": 1},
    "format-missing": {"format": None},
    "quick-string": {"quick": "true"},
    "source-unknown": {"source": "hand-edited"},
    "device-number": {"device_type": 3},
    "cases-not-list": {"cases": "none"},
    "case-not-object": {"cases": [5]},
    "when-string": {"when": "today"},
    "key-mismatch": {"case_class": "safe/l2/sig/bf16/dense/mha/h0+ht/c64/d128/train"},
}


@pytest.mark.parametrize("kind", sorted(WRONGLY_TYPED))
def test_record_with_wrongly_typed_field_is_no_record(seed, kind):
    """Regression (bug found while writing these tests, fixed since): a record whose fields had the wrong
    types (e.g. worst_ratio null) was loaded as is; chunk_kda then raised TypeError while formatting it."""
    call = inputs()
    key = case_key(call)
    path = _torch_record_path(call)
    path.parent.mkdir(parents=True, exist_ok=True)
    other_key = "softplus/l2/sig/fp32/dense/gva/h0+ht/c32/d64/fwd"
    path.write_text(
        json.dumps(
            {
                "fingerprint": fingerprint(kda.get_backend("torch"), "cpu"),
                "records": {key: _fields(key, **WRONGLY_TYPED[kind]), other_key: _fields(other_key, source="verify")},
            }
        )
    )
    torch_backend = kda.get_backend("torch")
    assert default_store().get(torch_backend, "cpu", key) is None
    assert default_store().get(torch_backend, "cpu", other_key) is not None  # the good record stands

    with kda.trace_routes() as routes:
        kda.chunk_kda(**call)
    assert [r.backend for r in routes] == ["torch"]
    data = json.loads(path.read_text())
    assert data["records"][key]["source"] == "lazy" and data["records"][key]["format"] == RECORD_FORMAT
    assert default_store().get(torch_backend, "cpu", key).passed
    assert data["records"][other_key]["source"] == "verify"  # merged, not dropped


def test_record_with_string_passed_does_not_verify_a_wrong_backend(seed):
    """Regression (bug found while writing these tests, fixed since): passed="false" is a truthy string,
    and a wrong backend with such a hand-edited record counted as verified."""
    wrong = WrongWrapped()
    kda.register_backend(wrong)
    call = inputs()
    key = case_key(call)
    path = default_store().path_for(wrong, torch.device("cpu"))
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(
        json.dumps(
            {
                "records": {
                    key: {"case_class": key, "passed": "false", "worst_ratio": 2.0, "source": "lazy", "quick": True}
                }
            }
        )
    )

    with kda.trace_routes() as routes:
        kda.chunk_kda(**call)
    assert wrong.calls == 0, "a backend whose record says passed='false' ran the call"
    assert [r.backend for r in routes] == ["torch"]


def test_corrupt_file_is_overwritten_by_the_next_put(tmp_path):
    store = RecordStore(tmp_path)
    backend = Wrapped()
    path = store.path_for(backend, "cpu")
    path.parent.mkdir(parents=True)
    path.write_bytes(b'{"records": {"a": ')
    assert store.load(backend, "cpu") == {}
    store.put(backend, "cpu", [record(KEYS[0])])
    data = json.loads(path.read_text())
    assert list(data["records"]) == [KEYS[0]]
    assert store.get(backend, "cpu", KEYS[0]).passed
    assert not list(path.parent.glob("*.tmp"))


# ------------------------------------------------------------------- hostile cache contents, unwritable cache


def _make_fifo(path: Path) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    os.mkfifo(path)


def _nested(path: Path, text: str) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)


DEEP = "[" * 100_000 + "]" * 100_000

# What is planted at (or beside) torch's record file, and whether kda can still write the file afterwards.
HOSTILE = {
    "record-is-a-directory": (lambda path: path.mkdir(parents=True), False),
    "record-is-a-fifo": (_make_fifo, True),  # reading it would block forever; the write replaces it
    "lock-is-a-directory": (lambda path: path.with_suffix(".lock").mkdir(parents=True), False),
    "lock-is-a-fifo": (lambda path: _make_fifo(path.with_suffix(".lock")), False),
    "deeply-nested-json": (lambda path: _nested(path, DEEP), True),
    "deeply-nested-record": (lambda path: _nested(path, '{"records": {"k": ' + DEEP + "}}"), True),
}


def _torch_on_a_clean_cache(call: dict[str, Any], monkeypatch, tmp_path: Path) -> torch.Tensor:
    monkeypatch.setenv("KDA_CACHE_DIR", str(tmp_path / "clean-cache"))
    o, _ = kda.chunk_kda(**call, backend="torch")
    monkeypatch.setenv("KDA_CACHE_DIR", str(tmp_path / "hostile-cache"))
    dispatch.clear_cache()
    return o


def _count_verifications(monkeypatch) -> list[str]:
    """The case classes the dispatcher verifies lazily from now on, in order."""
    seen: list[str] = []
    real = dispatch.verify_class

    def counted(backend, case_class, device, **kwargs):
        seen.append(f"{backend.name} {case_class.key}")
        return real(backend, case_class, device, **kwargs)

    monkeypatch.setattr(dispatch, "verify_class", counted)
    return seen


def _free_fifo_readers(*paths: Path) -> None:
    """Open each FIFO's write end and close it, so that a reader blocked on it sees end of file."""
    for path in paths:
        with contextlib.suppress(OSError):
            os.close(os.open(path, os.O_WRONLY | os.O_NONBLOCK))


def _unsaved_warnings(caught: list[warnings.WarningMessage]) -> list[str]:
    return [str(w.message) for w in caught if issubclass(w.category, RuntimeWarning) and "not saved" in str(w.message)]


@pytest.mark.parametrize("kind", sorted(HOSTILE))
def test_hostile_record_file_never_breaks_or_hangs_a_call(seed, kind, monkeypatch, tmp_path, returns_within):
    """Regression: a directory or a FIFO at a record's path, or at its lock's, failed every call (or hung
    it: opening a FIFO to read blocks until a writer comes), and a deeply nested JSON file ended the call
    with RecursionError. Now such a file counts as no records; the record is written when the path allows
    it, and otherwise kept in memory for the process (one RuntimeWarning), so the backend is verified once."""
    call = inputs()
    key = case_key(call)
    expected = _torch_on_a_clean_cache(call, monkeypatch, tmp_path)
    path = _torch_record_path(call)
    plant, writable = HOSTILE[kind]
    plant(path)
    verifications = _count_verifications(monkeypatch)

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        o = returns_within(
            lambda: kda.chunk_kda(**call, backend="torch")[0],
            unblock=lambda: _free_fifo_readers(path, path.with_suffix(".lock")),
        )
        dispatch.clear_cache()  # the next decision reads the store again
        again = returns_within(lambda: kda.chunk_kda(**call, backend="torch")[0])
    torch.testing.assert_close(o, expected, rtol=0, atol=0)
    torch.testing.assert_close(again, expected, rtol=0, atol=0)
    assert verifications == [f"torch {key}"], "verified once; then the record stands (on disk or in memory)"

    unsaved = _unsaved_warnings(caught)
    torch_backend = kda.get_backend("torch")
    if writable:
        assert unsaved == []
        assert json.loads(path.read_text())["records"][key]["source"] == "lazy"  # the file is replaced
        assert RecordStore(default_store().root).get(torch_backend, "cpu", key).passed
    else:
        assert len(unsaved) == 1, unsaved
        assert str(path) in unsaved[0]
        assert RecordStore(default_store().root).get(torch_backend, "cpu", key) is None  # not on disk
        assert default_store().get(torch_backend, "cpu", key).passed  # in this process's memory


def _cache_under_a_file(tmp_path: Path) -> Path:
    blocker = tmp_path / "a-file"
    blocker.write_text("not a directory")
    return blocker / "kda-cache"


def _read_only_cache(tmp_path: Path) -> Path:
    if os.geteuid() == 0:
        pytest.skip("runs as root, whom a read-only directory does not stop")
    root = tmp_path / "read-only-cache"
    root.mkdir()
    root.chmod(0o500)
    return root


UNWRITABLE = {"parent-is-a-file": _cache_under_a_file, "read-only-directory": _read_only_cache}


@pytest.mark.parametrize("kind", sorted(UNWRITABLE))
def test_unwritable_cache_keeps_records_in_memory_and_warns_once(seed, kind, monkeypatch, tmp_path):
    """Regression: with a KDA_CACHE_DIR that cannot be written, every lazily verified call raised OSError.
    Now the records live in memory for the process: each backend is verified once, the decision stands
    (a failing backend stays unused), and one RuntimeWarning names the path and the error."""
    call = inputs()
    key = case_key(call)
    expected = _torch_on_a_clean_cache(call, monkeypatch, tmp_path)
    root = UNWRITABLE[kind](tmp_path)
    monkeypatch.setenv("KDA_CACHE_DIR", str(root))
    try:
        wrong = WrongWrapped()  # priority 100: auto verifies it (it fails) and torch
        kda.register_backend(wrong)
        verifications = _count_verifications(monkeypatch)
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            with kda.trace_routes() as routes:
                o, _ = kda.chunk_kda(**call)
                dispatch.clear_cache()
                again, _ = kda.chunk_kda(**call)
                explicit, _ = kda.chunk_kda(**call, backend="torch")
    finally:
        if root.exists():
            root.chmod(0o700)  # so that tmp_path can be removed
    assert [r.backend for r in routes] == ["torch", "torch", "torch"]
    for out in (o, again, explicit):
        torch.testing.assert_close(out, expected, rtol=0, atol=0)
    assert sorted(verifications) == [f"torch {key}", f"wrong {key}"], "each backend verified once"
    assert wrong.calls == 0
    unsaved = _unsaved_warnings(caught)
    assert len(unsaved) == 1, unsaved
    assert str(root) in unsaved[0] and "Error" in unsaved[0]  # the path and the OS error
    assert not default_store().get(wrong, "cpu", key).passed
    assert not (root / "verification").exists()


# ------------------------------------------------------------------------------------ concurrent writers


class StoreOnlyBackend(kda.Backend):
    name = "concurrent"
    version = "3"

    def supports(self, spec):  # pragma: no cover - never dispatched
        return kda.Verdict.yes()

    def forward(self, inputs, spec, out=None):  # pragma: no cover - never dispatched
        raise NotImplementedError


def _writer(root: str, worker: int, barrier) -> None:
    store = RecordStore(Path(root))
    backend = StoreOnlyBackend()
    barrier.wait(timeout=60)
    for i in range(20):
        store.put(
            backend,
            "cpu",
            [record(KEYS[1 + worker * 20 + i], worst_ratio=worker + i / 100, seed=worker * 1000 + i)],
        )


def test_concurrent_writers_lose_nothing(tmp_path):
    methods = multiprocessing.get_all_start_methods()
    ctx = multiprocessing.get_context("fork" if "fork" in methods else "spawn")
    parent = RecordStore(tmp_path)
    backend = StoreOnlyBackend()
    parent.put(backend, "cpu", [record(KEYS[0], 0.5, source="lazy")])
    assert set(parent.load(backend, "cpu")) == {KEYS[0]}

    barrier = ctx.Barrier(4)
    workers = [ctx.Process(target=_writer, args=(str(tmp_path), w, barrier)) for w in range(4)]
    for p in workers:
        p.start()
    for p in workers:
        p.join(timeout=120)
    assert [p.exitcode for p in workers] == [0, 0, 0, 0]

    folder = tmp_path / "verification"
    json_files = sorted(folder.glob("*.json"))
    assert json_files == [parent.path_for(backend, "cpu")]
    assert not list(folder.glob("*.tmp")), "a temporary file was left behind"
    data = json.loads(json_files[0].read_text())
    assert data["fingerprint"]["backend"] == "concurrent"
    expected = set(KEYS[:81])
    assert set(data["records"]) == expected

    for store in (parent, RecordStore(tmp_path)):  # the parent's memo must notice the other writers
        loaded = store.load(backend, "cpu")
        assert set(loaded) == expected
        for w in range(4):
            for i in range(20):
                rec = loaded[KEYS[1 + w * 20 + i]]
                assert rec.passed == (w + i / 100 <= 1)
                assert rec.worst_ratio == pytest.approx(w + i / 100)
                assert rec.cases[0]["seed"] == w * 1000 + i


# ----------------------------------------------------------------------------------------------- records


def test_record_round_trips_through_json_with_infinite_error(tmp_path):
    key = "softplus/l2/sig2/fp16/varlen/gva/h0:vk/c32/d256/train"
    case = {**measured_case(key, 0.5), "errors": {**measured_case(key, 0.5)["errors"], "dq": math.inf}}
    original = Record(key, "lazy", False, "cpu", cases=[case], when=1234.5)
    text = json.dumps(original.as_json())
    again = Record.from_json(json.loads(text))
    assert again == original
    assert math.isinf(again.worst_ratio) and not again.passed and "dq rel. error inf" in again.reason

    backend = Wrapped()
    RecordStore(tmp_path).put(backend, "cpu", [original, record(KEYS[2], worst_ratio=0.125)])
    loaded = RecordStore(tmp_path).load(backend, "cpu")
    assert loaded[original.case_class] == original
    assert loaded[KEYS[2]].worst_ratio == pytest.approx(0.125) and loaded[KEYS[2]].passed


def test_record_from_json_ignores_unknown_fields():
    data = {**record(KEYS[0]).as_json(), "added_in_a_later_version": 1, "when": 42.0}
    assert Record.from_json(data) == Record(KEYS[0], "verify", True, "cpu", cases=record(KEYS[0]).cases, when=42.0)


def test_put_merges_with_records_already_on_disk(tmp_path):
    backend = Wrapped()
    first, second = RecordStore(tmp_path), RecordStore(tmp_path)
    a, b = KEYS[3], KEYS[4]
    first.put(backend, "cpu", [record(a, worst_ratio=0.1)])
    second.put(backend, "cpu", [record(b, worst_ratio=0.2)])
    first.put(backend, "cpu", [record(a, worst_ratio=7.0)])
    loaded = RecordStore(tmp_path).load(backend, "cpu")
    assert set(loaded) == {a, b}
    assert not loaded[a].passed and loaded[a].worst_ratio == pytest.approx(7.0)
    assert loaded[b].worst_ratio == pytest.approx(0.2)
