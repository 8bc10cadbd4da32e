"""`python -m kda.bench` on the CPU: shapes, inputs, the result schema, the pct_fla arithmetic (on a fake
timer, so that the numbers are known), --tune's effect on auto, merging, and the CLI end to end."""

from __future__ import annotations

import json
import logging
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
import torch

import kda
from kda import timings
from kda.backends.torch import TorchBackend
from kda.bench import cli, results, runner
from kda.bench.runner import BenchConfig, pct_fla
from kda.bench.shapes import DEFAULT_SHAPES, MODES, BenchShape, case_class_keys, make_inputs

REQUIRED_ROW_FIELDS = {
    "shape",
    "mode",
    "backend",
    "median_ms",
    "fla_median_ms",
    "pct_fla",
    "peak_bytes",
    "cold_start_s",
}
REQUIRED_VERSIONS = {"kda", "torch", "triton", "helion", "tilelang", "flash_kda", "fla", "driver"}


class Quick(TorchBackend):
    name = "quick"
    priority = -5
    version = "7"


def test_the_issue_shapes_parse_and_name_themselves():
    assert DEFAULT_SHAPES[:6] == [
        "B1_T8192_H96_D128",
        "B2_T16384_H16_D128",
        "B4_T2048_H16_D128",
        "B4_T4096_H64_D128",
        "B8_T2048_H32_D256",
        "B8_T1024_H8_D64",
    ]
    mixed = BenchShape.parse("varlen_H96_D128_L1300-547-2048-963-271-3063")
    assert mixed.varlen and mixed.B == 1 and mixed.T == 8192 and mixed.num_seqs == 6
    repeated = BenchShape.parse("varlen_H64_D128_L1024x8")
    assert repeated.seq_lens == (1024,) * 8 and repeated.T == 8192
    dense = BenchShape.parse("B8_T2048_H32_D256")
    assert (dense.B, dense.T, dense.H, dense.D, dense.varlen) == (8, 2048, 32, 256, False)
    varlen = [BenchShape.parse(s) for s in DEFAULT_SHAPES[6:]]
    assert {(s.H, s.D, s.T) for s in varlen} == {(96, 128, 8192), (64, 128, 8192)}
    for bad in ("B1_T8192_H96", "varlen_H96_D128_Lx", "varlen_H96_D128_L12ax2", "nonsense"):
        with pytest.raises(ValueError):
            BenchShape.parse(bad)


@pytest.mark.parametrize("mode", sorted(MODES))
def test_inputs_are_random_realistic_and_valid(mode):
    shape = BenchShape.parse("varlen_H2_D16_L5-0-11")
    inputs = make_inputs(shape, MODES[mode], "cpu", seed=3)
    kwargs = inputs.kwargs
    spec = kda.KDASpec.from_call(**kwargs, requires_grad=MODES[mode].training)  # a valid call
    assert spec.T == 16 and spec.num_seqs == 3 and kwargs["cu_seqlens"].tolist() == [0, 5, 5, 16]
    for name in ("q", "k", "v", "g", "beta"):
        assert (kwargs[name] != 0).float().mean() > 0.9, f"{name} is mostly zeros"
        assert kwargs[name].dtype == torch.bfloat16
    if MODES[mode].gate == "pregated":
        assert (kwargs["g"].float() <= 0).all()
    else:
        assert kwargs["lower_bound"] == -5.0 and kwargs["safe_gate"]
    assert ("initial_state" in kwargs) == MODES[mode].states
    assert bool(inputs.leaves) == MODES[mode].training
    other = make_inputs(shape, MODES[mode], "cpu", seed=4).kwargs
    assert not torch.equal(kwargs["q"], other["q"])


def test_case_classes_of_the_bench_cover_every_shape_and_mode():
    keys = case_class_keys(DEFAULT_SHAPES, list(MODES))
    assert "safe/l2/sig/bf16/dense/mha/h0+ht/c64/d128/fwd" in keys
    assert "pregated/l2/sig/bf16/varlen/mha/nostate/c64/d128/train" in keys
    assert {k.split("/")[8] for k in keys} == {"d64", "d128", "d256"}


def test_pct_fla_arithmetic():
    assert pct_fla(2.0, 1.0) == 200.0
    assert pct_fla(1.5, 3.0) == 50.0
    assert pct_fla(None, 1.0) is None and pct_fla(1.0, None) is None and pct_fla(1.0, 0.0) is None


def fake_measurements(monkeypatch, ms: dict[str, float]) -> list[str]:
    """Every backend and baseline 'runs' instantly; the timer answers `ms[name]`. Returns the cold log."""
    real_call_for = runner.call_for

    def call_for(name, inputs, mode):
        if name == "baseline:flashkda" and mode.training:
            return None, "FlashKDA is an inference forward with the safe gate only"
        if name.startswith("baseline:"):
            fake = lambda: None  # noqa: E731
        else:
            fake, why = real_call_for(name, inputs, mode)
            if fake is None:
                return None, why
        fake.backend = name  # type: ignore[attr-defined]
        return fake, None

    cold_log: list[str] = []

    def cold(backend, shape, mode, device):
        cold_log.append(f"{backend}@{shape}/{mode}")
        return {"first_call_s": 1.25, "process_s": 4.5, "new_cache_files": 3}

    monkeypatch.setattr(runner, "call_for", call_for)
    monkeypatch.setattr(runner.timing, "cold_start", cold)
    monkeypatch.setattr(runner.timing, "median_ms", lambda fn, device, **kw: ms[fn.backend])
    monkeypatch.setattr(runner.timing, "peak_bytes", lambda fn, device: 1024)
    return cold_log


def test_rows_hold_same_run_ratios_and_the_schema(seed, monkeypatch, tmp_path):
    kda.register_backend(Quick)
    ms = {"baseline:fla": 3.0, "baseline:flashkda": 1.5, "torch": 6.0, "quick": 2.0, "auto": 2.0}
    cold_log = fake_measurements(monkeypatch, ms)
    config = BenchConfig(
        ["B1_T24_H2_D16", "varlen_H2_D16_L9-15"],
        ["fwd", "train_safe"],
        ["baseline:fla", "baseline:flashkda", "torch", "quick", "flashkda", "auto"],
        torch.device("cpu"),
        cold_start="first",
        tune=True,
    )
    seen: list[str] = []
    rows = runner.run(
        config,
        on_row=lambda row: seen.append(row.backend),
        timer=runner.timing.median_ms,
        memory=runner.timing.peak_bytes,
        cold=runner.timing.cold_start,
    )
    assert len(rows) == len(seen) == 2 * 2 * 6
    by = {(r.shape, r.mode, r.backend): r for r in rows}

    for (shape, mode, backend), row in by.items():
        assert row.fla_median_ms == 3.0
        if row.status == "ok":
            assert row.median_ms == ms[backend]
            assert row.pct_fla == pytest.approx(100 * 3.0 / ms[backend])
            assert row.peak_bytes == 1024
        cold_expected = shape == "B1_T24_H2_D16" and row.status == "ok"
        assert (row.cold_start_s == 1.25) == cold_expected, (shape, mode, backend)

    assert by[("B1_T24_H2_D16", "fwd", "quick")].pct_fla == 150.0
    assert by[("B1_T24_H2_D16", "fwd", "torch")].pct_fla == 50.0
    skipped = by[("B1_T24_H2_D16", "fwd", "flashkda")]
    assert skipped.status == "skipped" and "flash_kda does not import" in skipped.reason
    assert by[("B1_T24_H2_D16", "train_safe", "baseline:flashkda")].status == "skipped"
    assert "auto@B1_T24_H2_D16/fwd" in cold_log and not any("varlen" in c for c in cold_log)

    # --tune recorded quick (2 ms) as faster than torch (6 ms), so auto chose it despite its priority.
    for mode in ("fwd", "train_safe"):
        assert by[("B1_T24_H2_D16", mode, "auto")].chose == "quick"
    table = timings.load("cpu")
    assert table is not None and len(table.entries) == 4
    assert all(set(e.timings) == {"torch", "quick"} for e in table.entries)  # kda backends only

    data = results.payload(rows, torch.device("cpu"), {"note": "test"})
    assert set(data["versions"]) >= REQUIRED_VERSIONS and data["gpu"]["name"].startswith("cpu")
    for row in data["rows"]:
        assert set(row) >= REQUIRED_ROW_FIELDS
    paths = results.write(data, tmp_path / "out")
    assert json.loads(paths["json"].read_text()) == json.loads(json.dumps(data))
    markdown = paths["md"].read_text()
    assert "| B1_T24_H2_D16 | fwd | quick | 2.000 | 3.000 | 150% |" in markdown
    assert ("pct_fla.png" in markdown) == ("png" in paths)


def test_cli_end_to_end_on_the_cpu(seed, tmp_path, capsys):
    out = tmp_path / "bench"
    code = cli.main(
        [
            "--shape",
            "B1_T20_H1_D8",
            "--mode",
            "fwd",
            "--mode",
            "train_pregated",
            "--backend",
            "torch",
            "--backend",
            "auto",
            "--cold-start",
            "none",
            "--rep-ms",
            "5",
            "--warmup-ms",
            "1",
            "--out",
            str(out),
        ]
    )
    assert code == 0
    data = json.loads((out / "results.json").read_text())
    assert [(r["mode"], r["backend"]) for r in data["rows"]] == [
        ("fwd", "torch"),
        ("fwd", "auto"),
        ("train_pregated", "torch"),
        ("train_pregated", "auto"),
    ]
    assert all(r["status"] == "ok" and r["median_ms"] > 0 and r["pct_fla"] is None for r in data["rows"])
    assert data["rows"][1]["chose"] == "torch"
    captured = capsys.readouterr()
    assert "bench on cpu" in captured.out and "results.json" in captured.out
    assert "B1_T20_H1_D8 fwd: " in captured.err and "first timing" in captured.err  # where the time went

    assert cli.main(["--backend", "nope", "--out", str(out)]) == 2
    assert cli.main(["--shape", "B1_T20", "--out", str(out)]) == 2


def test_rows_are_on_disk_as_each_finishes(seed, tmp_path, monkeypatch):
    """A bench killed where no handler runs (SIGKILL, or SIGTERM while it compiles: on the H200 a forward
    bench cut off by its deadline lost every row that way) leaves the rows it finished: results.json and
    results.md are rewritten after each row, marked partial; the final write drops the mark."""
    out = tmp_path / "bench"
    on_disk: list[int] = []
    real_run = cli.run

    def watched_run(config, on_row):
        def spy(row):
            on_row(row)
            data = json.loads((out / "results.json").read_text())
            on_disk.append(len(data["rows"]))
            assert data["settings"]["partial"] == f"{len(data['rows'])} of 4 rows"
            assert "Partial:" in (out / "results.md").read_text()

        return real_run(config, on_row=spy)

    monkeypatch.setattr(cli, "run", watched_run)
    code = cli.main(
        [
            "--shape",
            "B1_T20_H1_D8",
            "--mode",
            "fwd",
            "--mode",
            "train_pregated",
            "--backend",
            "torch",
            "--backend",
            "auto",
            "--cold-start",
            "none",
            "--rep-ms",
            "5",
            "--warmup-ms",
            "1",
            "--rounds",
            "1",
            "--out",
            str(out),
        ]
    )
    assert code == 0 and on_disk == [1, 2, 3, 4]
    final = json.loads((out / "results.json").read_text())
    assert len(final["rows"]) == 4 and "partial" not in final["settings"]
    assert "Partial:" not in (out / "results.md").read_text() and not list(out.glob("*.part"))


def test_tune_names_the_backends_it_leaves_untimed(seed, tmp_path, capsys):
    """`auto` ranks by speed only the backends timed together; a --tune run that leaves an available backend
    out says so (on the H200, timing `baseline:fla` without the kda `fla` backend left auto on triton at
    0.67x FLA)."""
    kda.register_backend(Quick)
    args = [
        "--shape",
        "B1_T20_H1_D8",
        "--mode",
        "fwd",
        "--backend",
        "torch",
        "--backend",
        "auto",
        "--tune",
        "--cold-start",
        "none",
        "--rep-ms",
        "5",
        "--warmup-ms",
        "1",
        "--rounds",
        "1",
    ]
    assert cli.main([*args, "--out", str(tmp_path / "a")]) == 0
    assert "not timed in this run, though `auto` can choose them here: quick." in capsys.readouterr().err
    assert cli.main([*args, "--backend", "quick", "--out", str(tmp_path / "b")]) == 0
    assert "not timed" not in capsys.readouterr().err


def test_merge_joins_runs_of_one_gpu_and_refuses_others(tmp_path):
    def part(name: str, versions: dict[str, Any]) -> Path:
        data = {
            "kda": "x",
            "date": "d",
            "gpu": {"name": "G"},
            "versions": versions,
            "settings": {},
            "rows": [
                {
                    "shape": name,
                    "mode": "fwd",
                    "backend": "fla",
                    "kind": "kda",
                    "status": "ok",
                    "reason": None,
                    "median_ms": 1.0,
                    "fla_median_ms": 1.0,
                    "pct_fla": 100.0,
                    "peak_bytes": 1,
                    "cold_start_s": None,
                    "cold_process_s": None,
                    "cold_new_cache_files": None,
                    "chose": None,
                }
            ],
        }
        path = tmp_path / name / "results.json"
        path.parent.mkdir()
        path.write_text(json.dumps(data))
        return path

    a, b, c = part("a", {"torch": "1"}), part("b", {"torch": "1"}), part("c", {"torch": "2"})
    assert cli.main(["--merge", str(a), str(b), "--out", str(tmp_path / "m")]) == 0
    merged = json.loads((tmp_path / "m" / "results.json").read_text())
    assert [r["shape"] for r in merged["rows"]] == ["a", "b"]
    assert cli.main(["--merge", str(a), str(c), "--out", str(tmp_path / "n")]) == 2


def _a_file(tmp_path: Path, text: str = "not a directory") -> Path:
    path = tmp_path / "a-file"
    path.write_text(text)
    return path


def _unwritable_cache(tmp_path: Path, monkeypatch) -> list[str]:
    monkeypatch.setenv("KDA_CACHE_DIR", str(_a_file(tmp_path) / "kda-cache"))
    return ["--tune"]


BAD_USAGE = {
    "chart-missing": lambda tmp, mp: ["--chart", str(tmp / "missing" / "results.json")],
    "chart-is-a-directory": lambda tmp, mp: ["--chart", str(tmp)],
    "chart-not-json": lambda tmp, mp: ["--chart", str(_a_file(tmp, "{not json"))],
    "merge-missing": lambda tmp, mp: ["--merge", str(tmp / "missing.json")],
    "merge-is-a-directory": lambda tmp, mp: ["--merge", str(tmp)],
    "out-is-a-file": lambda tmp, mp: ["--out", str(_a_file(tmp))],
    "out-under-a-file": lambda tmp, mp: ["--out", str(_a_file(tmp) / "bench")],
    "device-bogus": lambda tmp, mp: ["--device", "bogus"],
    "device-malformed-index": lambda tmp, mp: ["--device", "cuda:x"],
    "device-cuda-index-beyond-count": lambda tmp, mp: ["--device", f"cuda:{torch.cuda.device_count()}"],
    "tune-with-an-unwritable-cache": _unwritable_cache,
    "jobs-zero": lambda tmp, mp: ["--jobs", "0"],
    "rounds-zero": lambda tmp, mp: ["--rounds", "0"],
    "rep-ms-negative": lambda tmp, mp: ["--rep-ms", "-5"],
    "rep-ms-zero": lambda tmp, mp: ["--rep-ms", "0"],
    "warmup-ms-nan": lambda tmp, mp: ["--warmup-ms", "nan"],
    "warmup-ms-negative": lambda tmp, mp: ["--warmup-ms", "-1"],
    "tune-budget-inf": lambda tmp, mp: ["--tune-budget-s", "inf"],
}


def _refuse_work(monkeypatch) -> None:
    def refuse(*args, **kwargs):
        raise AssertionError("work started despite bad usage")

    for name in ("run", "_run_jobs", "_merge"):
        monkeypatch.setattr(cli, name, refuse)
    monkeypatch.setattr(cli.results, "write", refuse)
    monkeypatch.setattr(cli.results, "write_so_far", refuse)


def check_usage_error(code: int, err: str) -> None:
    lines = [line for line in err.splitlines() if line.strip()]
    assert code == 2
    assert len(lines) == 1 and lines[0].startswith("python -m kda.bench: error: "), err
    assert "Traceback" not in err


@pytest.mark.parametrize("kind", sorted(BAD_USAGE))
def test_bad_paths_devices_and_caches_are_usage_errors_before_any_work(kind, tmp_path, capsys, monkeypatch):
    """Regression: a missing --chart file, an --out that is a file, a --device torch cannot parse or that is
    not here, or --tune with a cache that cannot be written printed a traceback and exited 1 (some only
    after benchmarking). Now: exit 2, one line on stderr, nothing run or written."""
    _refuse_work(monkeypatch)
    args = BAD_USAGE[kind](tmp_path, monkeypatch)
    if "--out" not in args:
        args += ["--out", str(tmp_path / "bench")]
    base = ["--shape", "B1_T20_H1_D8", "--mode", "fwd", "--backend", "torch", "--cold-start", "none"]
    code = cli.main([*base, "--rounds", "1", "--rep-ms", "5", "--warmup-ms", "1", *args])
    check_usage_error(code, capsys.readouterr().err)
    assert not (tmp_path / "bench").exists()


@pytest.mark.skipif(torch.cuda.is_available(), reason="CUDA is available here")
def test_cuda_without_cuda_is_a_usage_error(tmp_path, capsys, monkeypatch):
    _refuse_work(monkeypatch)
    code = cli.main(["--shape", "B1_T20_H1_D8", "--device", "cuda", "--out", str(tmp_path / "bench")])
    err = capsys.readouterr().err
    check_usage_error(code, err)
    assert "CUDA" in err


def test_jobs_keep_compile_groups_together_and_balance_them():
    shares = cli.compile_groups(DEFAULT_SHAPES, 4)
    assert len(shares) == 4 and sorted(s for share in shares for s in share) == sorted(DEFAULT_SHAPES)
    assert shares[0][0] == DEFAULT_SHAPES[0]
    for share in shares:  # a (heads, head dim, layout) group is never split
        for other in shares:
            if other is not share:
                keys = {(BenchShape.parse(s).H, BenchShape.parse(s).D, BenchShape.parse(s).varlen) for s in share}
                assert not keys & {
                    (BenchShape.parse(s).H, BenchShape.parse(s).D, BenchShape.parse(s).varlen) for s in other
                }
    assert cli.compile_groups(["B1_T8_H2_D8"], 3) == [["B1_T8_H2_D8"]]


def test_rows_are_timed_in_rotated_rounds_and_report_the_median(seed, monkeypatch):
    fake_measurements(monkeypatch, {})
    answers = {"baseline:fla": iter([9.0, 3.0, 6.0]), "torch": iter([4.0, 8.0, 2.0])}
    order: list[str] = []

    def timer(fn, device, **kw):
        order.append(fn.backend)
        return next(answers[fn.backend])

    monkeypatch.setattr(runner.timing, "median_ms", timer)
    config = BenchConfig(
        ["B1_T24_H2_D16"], ["fwd"], ["baseline:fla", "torch"], torch.device("cpu"), cold_start="none", rounds=3
    )
    rows = runner.run(
        config, timer=runner.timing.median_ms, memory=runner.timing.peak_bytes, cold=runner.timing.cold_start
    )
    assert order == ["baseline:fla", "torch", "torch", "baseline:fla", "baseline:fla", "torch"]
    by = {r.backend: r for r in rows}
    assert by["baseline:fla"].median_ms == 6.0 and by["torch"].median_ms == 4.0
    assert by["baseline:fla"].round_ms == [9.0, 3.0, 6.0] and by["torch"].round_ms == [4.0, 8.0, 2.0]
    assert by["torch"].pct_fla == 150.0


def test_each_shape_logs_where_its_time_went(seed, monkeypatch, caplog):
    """A bench run is planned against a device's time limit, and most of a shape's minutes go before its
    rounds: one log line a shape splits its wall time into phases, each with the backends that took it."""
    fake_measurements(monkeypatch, {})
    clock = [0.0]
    monkeypatch.setattr(runner, "time", SimpleNamespace(perf_counter=lambda: clock[0]))
    first_costs = {"baseline:fla": 70.0, "torch": 5.0}  # compilation and autotuning happen on a first call
    timed: set[str] = set()

    def timer(fn, device, **kw):
        clock[0] += 1.0 if fn.backend in timed else first_costs[fn.backend]
        timed.add(fn.backend)
        return 2.0

    monkeypatch.setattr(runner.timing, "median_ms", timer)
    config = BenchConfig(
        ["B1_T24_H2_D16"], ["fwd"], ["baseline:fla", "torch"], torch.device("cpu"), cold_start="none", rounds=3
    )
    with caplog.at_level(logging.INFO, logger="kda.bench"):
        runner.run(
            config, timer=runner.timing.median_ms, memory=runner.timing.peak_bytes, cold=runner.timing.cold_start
        )
    lines = [record.getMessage() for record in caplog.records if record.name == "kda.bench"]
    assert len(lines) == 1, lines
    assert lines[0].startswith("B1_T24_H2_D16 fwd: 79 s: "), lines[0]
    assert "first timing 75 s (baseline:fla 70, torch 5)" in lines[0]
    rounds = lines[0].split("rounds 4 s (")[1].split(")")[0]
    assert sorted(rounds.split(", ")) == ["baseline:fla 2", "torch 2"], lines[0]


def test_tune_times_the_kda_backend_of_each_baseline_named():
    """The kda backend of a named baseline joins a --tune run when it is available and not named already."""
    assert cli.with_kda_twins(["baseline:fla", "tilelang", "auto"], ["fla", "tilelang"]) == (
        ["baseline:fla", "tilelang", "auto", "fla"],
        ["fla"],
    )
    assert cli.with_kda_twins(["baseline:fla", "baseline:fla-tilelang", "fla"], ["fla"]) == (
        ["baseline:fla", "baseline:fla-tilelang", "fla"],
        [],
    )
    assert cli.with_kda_twins(["baseline:flashkda", "triton"], ["triton", "torch"]) == (
        ["baseline:flashkda", "triton"],
        [],
    )


def test_a_tune_run_times_the_twin_and_a_plain_run_does_not(seed, tmp_path, capsys, monkeypatch):
    kda.register_backend(Quick)
    monkeypatch.setattr(cli, "KDA_TWINS", {"baseline:fla": "quick"})  # FLA's own backend needs CUDA
    args = ["--shape", "B1_T20_H1_D8", "--mode", "fwd", "--backend", "baseline:fla", "--backend", "torch"]
    args += ["--cold-start", "none", "--rep-ms", "5", "--warmup-ms", "1", "--rounds", "1"]
    assert cli.main([*args, "--tune", "--out", str(tmp_path / "a")]) == 0
    assert "--tune: timing quick too" in capsys.readouterr().err
    timed = {r["backend"]: r["status"] for r in json.loads((tmp_path / "a" / "results.json").read_text())["rows"]}
    assert timed.get("quick") == "ok"
    assert cli.main([*args, "--out", str(tmp_path / "b")]) == 0
    rows = json.loads((tmp_path / "b" / "results.json").read_text())["rows"]
    assert "quick" not in {r["backend"] for r in rows}
