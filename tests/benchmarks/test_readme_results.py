"""README.md's measured section is generated from the results snapshots, never typed by hand."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
from benchmark_scripts import load

ROOT = Path(__file__).resolve().parents[2]


readme_results = load("readme_results")
snapshot = load("snapshot")


def _row(shape: str, backend: str, ms: float, fla_ms: float, mode: str = "fwd", chose: str | None = None) -> dict:
    kind = "baseline" if backend.startswith("baseline:") else "auto" if backend == "auto" else "kda"
    return {
        "shape": shape,
        "mode": mode,
        "backend": backend,
        "kind": kind,
        "status": "ok",
        "reason": None,
        "median_ms": ms,
        "fla_median_ms": fla_ms,
        "pct_fla": 100 * fla_ms / ms,
        "peak_bytes": 1 << 20,
        "cold_start_s": None,
        "cold_process_s": None,
        "cold_new_cache_files": None,
        "chose": chose,
    }


def _payload(rows: list[dict], date: str) -> dict:
    return {
        "kda": "9.9.9",
        "date": date,
        "gpu": {"name": "Test GPU", "capability": "9.0"},
        "versions": {"kda": "9.9.9", "torch": "2.13.0", "triton": "3.9.0"},
        "settings": {"rounds": 3},
        "rows": rows,
    }


def test_readme_matches_the_snapshots():
    assert readme_results.main(["--check"]) == 0, "run: python benchmarks/readme_results.py"


def test_the_check_fails_when_a_figure_is_edited_by_hand(tmp_path):
    readme = tmp_path / "README.md"
    shutil.copyfile(ROOT / "README.md", readme)
    text = readme.read_text()
    begin = text.index(readme_results.BEGIN)
    cell = text.index(" ms (", begin)  # the first figure of the section's first table
    readme.write_text(text[:cell] + " ms(" + text[cell + 4 :])
    assert readme_results.main(["--check", "--readme", str(readme)]) == 1


def test_each_figure_comes_from_its_row_with_the_same_process_ratio(tmp_path):
    results = tmp_path / "results"
    raw = tmp_path / "raw"
    raw.mkdir()
    old = _payload(
        [_row("B1_T64_H1_D64", "baseline:fla", 2.0, 2.0), _row("B1_T64_H1_D64", "triton", 4.0, 2.0)], "2026-01-01"
    )
    new = _payload(
        [
            _row("B1_T64_H1_D64", "baseline:fla", 3.0, 3.0),
            _row("B1_T64_H1_D64", "triton", 1.5, 3.0),
            _row("B1_T64_H1_D64", "auto", 1.6, 3.0, chose="triton"),
        ],
        "2026-02-01",
    )
    (raw / "old.json").write_text(json.dumps(old))
    (raw / "new.json").write_text(json.dumps(new))
    out = results / "test-gpu" / "9.9.9"
    pytest.importorskip("rich")
    assert snapshot.main(["--out", str(out), "--bench", str(raw / "old.json"), str(raw / "new.json")]) == 0
    block = readme_results.render(results)
    # the re-measured backends replaced their old rows: FLA 3.00, triton 1.50 at 2.00x, auto chose triton
    assert "| B1_T64_H1_D64 | 3.00 | 1.50 (2.00x) | 1.60 (1.88x) → triton | 2026-02-01 |" in block
    assert "4.00" not in block and "0.50x" not in block


def test_a_run_of_one_new_backend_keeps_the_others_each_against_its_own_fla(tmp_path):
    raw = tmp_path / "raw"
    raw.mkdir()
    old = _payload(
        [_row("B1_T64_H1_D64", "baseline:fla", 2.0, 2.0), _row("B1_T64_H1_D64", "triton", 4.0, 2.0)], "2026-01-01"
    )
    new = _payload(
        [_row("B1_T64_H1_D64", "baseline:fla", 3.0, 3.0), _row("B1_T64_H1_D64", "tilelang", 1.0, 3.0)], "2026-02-01"
    )
    (raw / "old.json").write_text(json.dumps(old))
    (raw / "new.json").write_text(json.dumps(new))
    merged = snapshot.merge_bench([raw / "old.json", raw / "new.json"])
    by_backend = {row["backend"]: row for row in merged["rows"]}
    assert set(by_backend) == {"baseline:fla", "triton", "tilelang"}
    # triton keeps its ratio to the FLA of its own run (2.0 / 4.0), tilelang has its own (3.0 / 1.0)
    assert by_backend["triton"]["fla_median_ms"] == 2.0 and by_backend["triton"]["measured"] == "2026-01-01"
    assert by_backend["tilelang"]["fla_median_ms"] == 3.0 and by_backend["baseline:fla"]["median_ms"] == 3.0
    results = tmp_path / "results"
    pytest.importorskip("rich")
    assert (
        snapshot.main(
            ["--out", str(results / "gpu" / "9.9.9"), "--bench", str(raw / "old.json"), str(raw / "new.json")]
        )
        == 0
    )
    block = readme_results.render(results)
    assert "| B1_T64_H1_D64 | 3.00 | 4.00 (0.50x) | 1.00 (3.00x) | 2026-01-01, 2026-02-01 |" in block


def test_a_snapshot_refuses_a_row_without_fla_in_its_own_run(tmp_path):
    alone = _payload([_row("B1_T64_H1_D64", "tilelang", 1.0, 3.0)], "2026-02-01")
    (tmp_path / "alone.json").write_text(json.dumps(alone))
    with pytest.raises(SystemExit, match="without baseline:fla"):
        snapshot.merge_bench([tmp_path / "alone.json"])


def test_a_snapshot_refuses_runs_of_other_versions(tmp_path):
    first = _payload([_row("B1_T64_H1_D64", "baseline:fla", 2.0, 2.0)], "2026-01-01")
    other = _payload([_row("B1_T64_H1_D64", "baseline:fla", 3.0, 3.0)], "2026-02-01")
    other["versions"] = {**other["versions"], "triton": "3.6.0"}
    (tmp_path / "a.json").write_text(json.dumps(first))
    (tmp_path / "b.json").write_text(json.dumps(other))
    with pytest.raises(SystemExit, match="other versions"):
        snapshot.main(["--out", str(tmp_path / "out"), "--bench", str(tmp_path / "a.json"), str(tmp_path / "b.json")])


def _decode_row(shape: str, backend: str, ms: float, graph_ms: float | None, floor_ms: float, **extra) -> dict:
    kind = "baseline" if backend.startswith("baseline:") else "auto" if backend == "auto" else "kda"
    return {
        "shape": shape, "backend": backend, "kind": kind, "status": "ok", "reason": None, "median_ms": ms,
        "floor_ms": floor_ms, "pct_floor": 100 * floor_ms / ms, "floor_bytes": 1, "chose": None, "round_ms": [ms],
        "graph_ms": graph_ms, "graph_pct_floor": None if graph_ms is None else 100 * floor_ms / graph_ms,
        "graph_round_ms": [], **extra,
    }  # fmt: skip


def test_the_decode_table_and_every_verify_file_come_from_the_snapshot(tmp_path):
    """decode.json: eager and graph figures with FLA's same-mode ratio and the share of the copy bandwidth; the
    reference backend's rows stay in the file; every verify*.json gets its lines, with the backend versions."""
    shutil.copytree(ROOT / "benchmarks" / "results" / "nvidia-h200" / "0.1.0", tmp_path / "gpu" / "0.1.0")
    snap = tmp_path / "gpu" / "0.1.0"
    decode = {
        "copy_bandwidth_bytes_per_s": 4.0e12,
        "rows": [
            _decode_row("N8_T1_HV2_D16_fp32", "baseline:fla", 0.4, 0.2, 0.1),
            _decode_row("N8_T1_HV2_D16_fp32", "triton", 0.8, 0.1, 0.1),
            _decode_row("N8_T1_HV2_D16_fp32", "torch", 9.0, 8.0, 0.1),
            _decode_row("N8_T1_HV2_D16_fp32", "auto", 0.8, 0.1, 0.1, chose="triton"),
            {**_decode_row("N8_T1_HV2_D16_fp32", "fla", 1, None, 0.1), "status": "skipped", "reason": "fla: supports: no"},
        ],
    }  # fmt: skip
    (snap / "decode.json").write_text(json.dumps(decode))
    extra = json.loads((snap / "verify-decode.json").read_text())
    (snap / "verify-extra.json").write_text(json.dumps(extra))
    block = readme_results.render(tmp_path)
    assert "4000 GB/s measured in the same run" in block
    assert "| N8_T1_HV2_D16_fp32 | 0.400 (25%) | 0.800 (0.50x, 12%) | 0.800 (0.50x, 12%) → triton |" in block
    assert "0.200 (50%) | 0.100 (2.00x, 100%) | 0.100 (2.00x, 100%) → triton |" in block
    assert "9.00" not in block and "`torch` graph" not in block  # the reference's rows stay in decode.json
    assert "/verify-extra.json`; triton v22" in block and "/verify-decode.json`; triton v22" in block


def _verify_file(path: Path, versions: dict[str, str], results: list[tuple[str, str, str]]) -> Path:
    """A `kda.verify --json` file: a fingerprint per backend (its id follows its version) and the results."""
    path.write_text(
        json.dumps(
            {
                "kda": "0.1.0",
                "device": "cuda",
                "fingerprints": {b: {"backend_version": v, "id": f"{b}-v{v}"} for b, v in versions.items()},
                "results": [
                    {"backend": b, "case_class": key, "status": status, "worst_ratio": 0.5, "reason": None, "cases": []}
                    for b, key, status in results
                ],
            }
        )
    )
    return path


def test_a_new_backend_version_replaces_what_was_verified_of_the_old_one_and_a_stopped_run_erases_nothing(tmp_path):
    old = _verify_file(
        tmp_path / "old.json",
        {"helion": "2", "triton": "9"},
        [("helion", "a", "pass"), ("helion", "b", "fail"), ("triton", "a", "pass"), ("triton", "b", "pass")],
    )
    new = _verify_file(
        tmp_path / "new.json",
        {"helion": "3", "triton": "9"},
        [("helion", "a", "pass"), ("helion", "b", "not run"), ("triton", "a", "fail"), ("triton", "b", "not run")],
    )
    merged = snapshot.merge_verify([old, new])
    status = {(r["backend"], r["case_class"]): r["status"] for r in merged["results"]}
    # helion v3: only what its own run said (v2's failure at b is not about it); triton, the same version in
    # both: its later result at a wins, and the stopped run's "not run" at b does not erase the pass
    assert status == {
        ("helion", "a"): "pass",
        ("helion", "b"): "not run",
        ("triton", "a"): "fail",
        ("triton", "b"): "pass",
    }
    assert merged["fingerprints"]["helion"]["backend_version"] == "3" and merged["passed"] is False
    lines = readme_results.verify_lines(merged)
    assert lines[0].startswith("- `helion`: 1 case classes passed, 0 failed, 1 not run (the run was stopped before")
    assert lines[1].startswith("- `triton`: 1 case classes passed, 1 failed, at most")
    assert "1 not run" in snapshot.verify_summary(merged)


def test_a_snapshot_of_verification_alone_shows_its_gpu_and_verdicts(tmp_path):
    """A GPU where nothing was timed beside FLA still shows what was verified there, and nothing timed."""
    folder = tmp_path / "results" / "some-gpu" / "0.1.0"
    folder.mkdir(parents=True)
    fingerprint = {"backend_version": "4", "device": "Some GPU", "packages": {"torch": "2.11", "helion": "1.5.0"}}
    results = [
        {"backend": "helion", "case_class": f"class{n}", "status": status, "worst_ratio": 0.25, "cases": [{}, {}]}
        for n, status in enumerate(["pass", "pass", "fail", "unsupported"])
    ]
    report = {"kda": "0.1.0", "device": "cuda", "fingerprints": {"helion": fingerprint}, "results": results}
    (tmp_path / "verify.json").write_text(json.dumps(report))
    assert snapshot.main(["--out", str(folder), "--verify", str(tmp_path / "verify.json")]) == 0
    assert not (folder / "results.json").exists()
    text = readme_results.render(tmp_path / "results")
    assert "### Some GPU, kda 0.1.0" in text and "verification only" in text
    assert "- `helion`: 2 case classes passed, 1 failed" in text
    assert " ms" not in text  # no timing


def test_a_training_table_says_what_fla_ran_and_flags_runs_that_did_not_record_it():
    recorded = {"modes": ["train_safe"], "backends": ["baseline:fla", "triton"], "fla_paths": {"baseline:fla": "X"}}
    unrecorded = {"modes": ["train_safe"], "backends": ["baseline:fla", "tilelang"]}
    inference = {"modes": ["fwd"], "backends": ["baseline:fla"]}
    assert readme_results.fla_path_line([recorded], "train_safe") == ["", "FLA's path in these rows: X."]
    line = readme_results.fla_path_line([recorded, unrecorded, inference], "train_safe")[1]
    assert line.startswith("FLA's path in these rows: X; in other runs, not recorded (")
    assert "TileLang backward stage" in line
    assert readme_results.fla_path_line([inference], "fwd") == []  # one path forward: nothing to say
    assert readme_results.fla_path_line([inference], "train_safe") == []  # no run timed FLA in training


def test_a_figure_whose_rounds_spread_is_marked_and_a_steady_one_is_not(tmp_path):
    unsteady = {**_row("B1_T64_H1_D64", "baseline:fla", 1.2, 1.2), "round_ms": [1.0, 1.2, 1.45]}
    steady = {**_row("B1_T64_H1_D64", "triton", 0.5, 1.2), "round_ms": [0.5, 0.501, 0.505]}
    lines = readme_results.mode_table([unsteady, steady], "fwd")
    row = next(line for line in lines if line.startswith("| B1_T64_H1_D64"))
    assert row.startswith("| B1_T64_H1_D64 | 1.20~ | 0.500 (2.40x) |")
    assert any(
        line.startswith("~: the run's 3 rounds spread by more than 10% (at most 45%: baseline:fla") for line in lines
    )
    steady_only = readme_results.mode_table([{**unsteady, "round_ms": [1.19, 1.2, 1.21]}, steady], "fwd")
    assert not any("~" in line for line in steady_only)


def test_a_backend_the_run_never_reached_is_not_called_a_quick_verification():
    report = {"results": [{"backend": "b", "case_class": "k", "status": "not run", "worst_ratio": None, "cases": []}]}
    (line,) = readme_results.verify_lines(report)
    assert "1 not run" in line and "quick" not in line
    reached = {"backend": "b", "case_class": "j", "status": "pass", "worst_ratio": 0.5, "cases": [{}]}
    (line,) = readme_results.verify_lines({"results": [*report["results"], reached]})
    assert "quick verification" in line


@pytest.mark.parametrize(
    ("reason", "cell"),
    [
        ("FlashKDA is an inference forward with the safe gate only", "n/a"),
        ("FlashKDA needs CUDA and K = V = 128", "n/a"),
        ("tilelang failed verification of this class", "unverified"),
        ("flash_kda does not import (ImportError: no module)", "skipped"),
    ],
)
def test_a_row_that_did_not_run_says_why_in_one_word(reason, cell):
    row = {**_row("B1_T8_H1_D128", "baseline:flashkda", 1.0, 1.0), "status": "skipped", "reason": reason}
    assert readme_results._cell(row) == cell


def test_a_backward_only_version_keeps_what_was_verified_of_the_inference_classes(tmp_path):
    """`Backend.forward_version`: tilelang v17 runs v16's forward, so v16's inference results stand and its
    training results go; a report written before forward ids existed has one id for both."""
    fwd, train = "safe/l2/sig/bf16/dense/mha/h0+ht/c64/d128/fwd", "safe/l2/sig/bf16/dense/mha/h0+ht/c64/d128/train"
    old = _verify_file(
        tmp_path / "old.json", {"tilelang": "16"}, [("tilelang", fwd, "pass"), ("tilelang", train, "pass")]
    )
    new = tmp_path / "new.json"
    report = json.loads(old.read_text())
    report["fingerprints"]["tilelang"] = {
        "backend_version": "17",
        "id": "tilelang-v17",
        "forward_version": "16",
        "forward_id": "tilelang-v16",
    }
    report["results"] = [{"backend": "tilelang", "case_class": "other/train", "status": "pass", "worst_ratio": 0.5}]
    new.write_text(json.dumps(report))

    status = {r["case_class"]: r["status"] for r in snapshot.merge_verify([old, new])["results"]}
    assert status == {fwd: "pass", "other/train": "pass"}  # v16's training result is gone
    merged = snapshot.merge_verify([old, new])
    assert readme_results._version_label(merged["fingerprints"]["tilelang"]) == "v17 (forward v16)"
    assert readme_results._version_label({"backend_version": "16", "id": "tilelang-v16"}) == "v16"

    report["fingerprints"]["tilelang"]["forward_id"] = "tilelang-v17"  # the forward moved too
    new.write_text(json.dumps(report))
    assert {r["case_class"] for r in snapshot.merge_verify([old, new])["results"]} == {"other/train"}
