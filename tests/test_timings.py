"""The timing table that orders verified backends for `auto` (kda.timings), and its effect on dispatch."""

from __future__ import annotations

import contextlib
import json
import math
import os
import warnings
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.nn.functional as F

import kda
from kda import timings
from kda.backends.torch import TorchBackend
from kda.timings import Measurement, ShapePoint

TORCH_VERSION = TorchBackend.version  # timings count only for the version they were measured with


class Faster(TorchBackend):
    """The torch backend's numbers under another name and a lower priority (so priority alone ranks it last)."""

    name = "faster"
    priority = -5
    version = "3"


def call(T: int = 40, H: int = 2, K: int = 16) -> dict[str, Any]:
    return {
        "q": F.normalize(torch.randn(1, T, H, K), dim=-1),
        "k": F.normalize(torch.randn(1, T, H, K), dim=-1),
        "v": torch.randn(1, T, H, K),
        "g": F.logsigmoid(torch.randn(1, T, H, K) + 1.0),
        "beta": torch.rand(1, T, H) * 0.9 + 0.05,
    }


def point(**changes: Any) -> ShapePoint:
    base = dict(
        training=False, gate="pregated", dtype="float32", K=16, V=16, varlen=False, tokens=40, heads=2, mean_len=40.0
    )
    return ShapePoint(**{**base, **changes})


def test_distance_compares_only_comparable_shapes():
    here = point()
    assert here.distance(here) == 0
    assert here.distance(point(tokens=80)) == pytest.approx(1.0)  # one doubling
    assert here.distance(point(tokens=160, heads=4)) == pytest.approx(3.0)
    assert here.distance(point(gate="safe")) == pytest.approx(0.5)
    assert here.distance(point(varlen=True)) == pytest.approx(0.5)
    for far in (point(training=True), point(dtype="bfloat16"), point(K=128), point(V=256)):
        assert math.isinf(here.distance(far))
    assert here.distance(point(K=32)) == 0  # same head-dimension bucket (64)


def test_point_of_a_spec_uses_tokens_heads_and_mean_length():
    spec = kda.KDASpec.from_call(**call(T=40, H=2))
    assert ShapePoint.of(spec) == point()
    varlen = {**call(T=40), "cu_seqlens": torch.tensor([0, 10, 40])}
    assert ShapePoint.of(kda.KDASpec.from_call(**varlen)).mean_len == 20.0


def test_without_a_table_priority_decides():
    kda.register_backend(Faster)
    spec = kda.KDASpec.from_call(**call())
    order, ranking = timings.rank(spec, [("torch", TORCH_VERSION, 0), ("faster", "3", -5)])
    assert order == ["torch", "faster"] and ranking is None
    explanation = kda.explain(**call())
    assert explanation.chosen == "torch" and "static priority" in str(explanation)


def test_the_table_makes_auto_use_the_fastest_verified_backend(seed):
    kda.register_backend(Faster)
    spec = kda.KDASpec.from_call(**call())
    timings.record(
        "cpu",
        "tiny / fwd",
        ShapePoint.of(spec),
        {"torch": Measurement(2.0, TORCH_VERSION), "faster": Measurement(1.0, "3")},
    )
    with kda.trace_routes() as routes:
        kda.chunk_kda(**call())
    assert [r.backend for r in routes] == ["faster"]
    text = str(kda.explain(**call()))
    assert "ranked by timings at tiny / fwd" in text and "faster 1 ms" in text and "torch 2 ms" in text

    # Nearby shapes use the same measurement; an explicit list keeps its own order.
    with kda.trace_routes() as routes:
        kda.chunk_kda(**call(T=70))
        kda.chunk_kda(**call(), backend=["torch", "faster"])
    assert [r.backend for r in routes] == ["faster", "torch"]

    # Far from every tuned shape (here: another head-dimension bucket), priority decides again.
    with kda.trace_routes() as routes:
        kda.chunk_kda(**call(K=128))
    assert [r.backend for r in routes] == ["torch"]


def test_a_backward_only_change_keeps_inference_timings_and_drops_training_ones(seed):
    """`forward_version`: inference calls run version 3's kernels still, so version 3's inference timing
    ranks them; a training timing of version 3 measured another backward, and counts for nothing."""

    class BackwardChanged(Faster):
        version = "4"
        forward_version = "3"

    kda.register_backend(BackwardChanged)
    inference = kda.KDASpec.from_call(**call())
    training_call = {name: x.requires_grad_() if name in ("q", "v") else x for name, x in call().items()}
    training = kda.KDASpec.from_call(**training_call)
    assert training.requires_grad and not inference.requires_grad
    for spec, label in ((inference, "tiny / fwd"), (training, "tiny / train")):
        timings.record(
            "cpu",
            label,
            ShapePoint.of(spec),
            {"torch": Measurement(2.0, TORCH_VERSION), "faster": Measurement(1.0, "3")},
        )
    with kda.trace_routes() as routes:
        kda.chunk_kda(**call())
    assert [r.backend for r in routes] == ["faster"]
    with kda.trace_routes() as routes:
        kda.chunk_kda(**training_call)[0].sum().backward()
    assert {r.backend for r in routes} == {"torch"}  # the forward and its backward


def test_a_timing_never_makes_an_unverified_backend_usable(seed):
    class Wrong(Faster):
        name = "wrong"

        def forward(self, inputs, spec, out=None):
            result = super().forward(inputs, spec, out)
            result.o.mul_(1.5)
            return result

    kda.register_backend(Wrong)
    spec = kda.KDASpec.from_call(**call())
    timings.record(
        "cpu",
        "tiny / fwd",
        ShapePoint.of(spec),
        {"wrong": Measurement(0.1, "3"), "torch": Measurement(2.0, TORCH_VERSION)},
    )
    with kda.trace_routes() as routes:
        kda.chunk_kda(**call())
    assert [r.backend for r in routes] == ["torch"]


def test_stale_or_corrupt_tables_fall_back_to_priority(seed):
    kda.register_backend(Faster)
    spec = kda.KDASpec.from_call(**call())
    path = timings.record("cpu", "tiny / fwd", ShapePoint.of(spec), {"faster": Measurement(1.0, "2")})
    # A timing for another version of the backend is ignored:
    assert timings.rank(spec, [("torch", TORCH_VERSION, 0), ("faster", "3", -5)]) == (["torch", "faster"], None)

    timings.record("cpu", "tiny / fwd", ShapePoint.of(spec), {"faster": Measurement(1.0, "3")})
    # Timed alone it does not pass torch, untimed and of higher priority (the H200's fwd_pregated rows, where
    # only triton had been timed, sent auto to triton at 0.67x FLA); timed together, the faster goes first.
    assert timings.rank(spec, [("torch", TORCH_VERSION, 0), ("faster", "3", -5)])[0] == ["torch", "faster"]
    timings.record("cpu", "tiny / fwd", ShapePoint.of(spec), {"torch": Measurement(2.0, TORCH_VERSION)})
    assert timings.rank(spec, [("torch", TORCH_VERSION, 0), ("faster", "3", -5)])[0] == ["faster", "torch"]

    good = path.read_text()
    for broken in (
        "{not json",
        json.dumps({"fingerprint": {}, "entries": []}),
        good.replace('"ms": 1.0', '"ms": "fast"'),
        good.replace('"ms": 1.0', '"ms": -1.0'),
        json.dumps({"entries": []}),
    ):
        path.write_text(broken)
        assert timings.load("cpu") is None, broken
        with kda.trace_routes() as routes:
            kda.chunk_kda(**call())
        assert [r.backend for r in routes] == ["torch"]
    path.unlink()
    assert timings.load("cpu") is None


def test_record_merges_measurements_at_the_same_point():
    spec = kda.KDASpec.from_call(**call())
    timings.record("cpu", "a", ShapePoint.of(spec), {"torch": Measurement(2.0, TORCH_VERSION)})
    timings.record("cpu", "a", ShapePoint.of(spec), {"faster": Measurement(1.0, "3")})
    timings.record("cpu", "b", point(tokens=4096), {"torch": Measurement(9.0, TORCH_VERSION)})
    table = timings.load("cpu")
    assert table is not None and len(table.entries) == 2
    assert set(table.entries[0].timings) == {"torch", "faster"}


# ------------------------------------------------------------------- hostile cache contents, unwritable cache


def _table_path() -> Path:
    return timings._path_for(torch.device("cpu"))


def _free_fifo_reader(path: Path) -> None:
    with contextlib.suppress(OSError):
        os.close(os.open(path, os.O_WRONLY | os.O_NONBLOCK))


@pytest.mark.parametrize("kind", ["fifo", "deeply-nested-json"])
def test_hostile_table_file_never_breaks_or_hangs_an_auto_call(seed, kind, returns_within):
    """Regression: an `auto` call with two usable backends reads the timing table; a FIFO there blocked the
    call for good, and a deeply nested JSON file ended it with RecursionError. Either counts as no table."""
    kda.register_backend(Faster)
    path = _table_path()
    path.parent.mkdir(parents=True, exist_ok=True)
    if kind == "fifo":
        os.mkfifo(path)
    else:
        path.write_text("[" * 100_000 + "]" * 100_000)
    inputs = call()

    def auto_call():
        with kda.trace_routes() as routes:  # routes are traced per thread
            o, _ = kda.chunk_kda(**inputs)
        return o, routes

    o, routes = returns_within(auto_call, unblock=lambda: _free_fifo_reader(path))
    assert [r.backend for r in routes] == ["torch"]  # no table: priority decides
    torch.testing.assert_close(o, kda.chunk_kda(**inputs, backend="torch")[0], rtol=0, atol=0)
    assert timings.load("cpu") is None


def test_unwritable_cache_keeps_the_table_in_memory_and_warns_once(seed, tmp_path, monkeypatch):
    """Regression: `timings.record` (what `python -m kda.bench --tune` writes with) raised OSError when the
    cache could not be written. Now the table lives in memory for the process, `auto` ranks by it, and one
    RuntimeWarning names the path."""
    blocker = tmp_path / "a-file"
    blocker.write_text("not a directory")
    monkeypatch.setenv("KDA_CACHE_DIR", str(blocker / "kda-cache"))
    kda.register_backend(Faster)
    spec = kda.KDASpec.from_call(**call())
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        timings.record("cpu", "tiny / fwd", ShapePoint.of(spec), {"torch": Measurement(2.0, TORCH_VERSION)})
        with kda.trace_routes() as routes:
            kda.chunk_kda(**call())
        timings.record("cpu", "tiny / fwd", ShapePoint.of(spec), {"faster": Measurement(1.0, "3")})
        with kda.trace_routes() as later:
            kda.chunk_kda(**call())
    unsaved = [str(w.message) for w in caught if "timing table not saved" in str(w.message)]
    assert all(issubclass(w.category, RuntimeWarning) for w in caught)
    assert len(unsaved) == 1 and str(_table_path()) in unsaved[0], unsaved
    assert [r.backend for r in routes] == ["torch"]
    assert [r.backend for r in later] == ["faster"]  # the table in memory, merged, ranks the call
    table = timings.load("cpu")
    assert table is not None and set(table.entries[0].timings) == {"torch", "faster"}
    assert not _table_path().parent.exists()
