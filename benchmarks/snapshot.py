"""Curate a results snapshot: ``benchmarks/results/<gpu>/<kda version>/``.

A snapshot is what the repository shows of one kda version on one GPU: the bench rows (``results.json``,
``results.md``, ``pct_fla.png``), the verification behind them (``verify.json``) and the machine's
versions (``env.txt``). It is made from the raw output of ``benchmarks/device/measure.sh`` (or of
``python -m kda.bench`` / ``python -m kda.verify --json`` run by hand), which stays out of git::

    python benchmarks/snapshot.py --out benchmarks/results/nvidia-h200/0.1.0 \\
        --bench raw/bench/results.json raw/train-bench/results.json \\
        --verify raw/verify/verify.json --env raw/env.txt

A snapshot may hold verification alone (``--verify`` without ``--bench``: a GPU where nothing was timed
against FLA). Bench rows are merged by (shape, mode, backend): the last file that measured a backend at a shape in a
mode supplies its row, so a run that times only some backends (a new one beside FLA, say) adds or replaces
those rows and keeps the others. Every row carries its own FLA time (``fla_median_ms``, FLA timed in the
row's own process) and its ``pct_fla`` against it, so a ratio never mixes processes; a row without FLA
beside it in its run is refused. Each row keeps the date of the run that measured it. Verification results are merged by (backend, case class)
the same way. README.md's "Measured" section is then regenerated with ``python benchmarks/readme_results.py``.
"""

from __future__ import annotations

import argparse
import json
import shutil
import sys
from pathlib import Path
from typing import Any

from kda.bench import results
from kda.case_class import trains
from kda.verify.cli import NOT_RUN


def _read(path: Path) -> dict[str, Any]:
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError) as error:
        raise SystemExit(f"snapshot: cannot read {path}: {error}") from None


def merge_bench(paths: list[Path]) -> dict[str, Any]:
    """One bench payload from several runs. A (shape, mode, backend) row comes from the last run that measured
    it; each row's ratio is to FLA timed in that row's own run (a run without FLA at that shape is refused)."""
    parts = [_read(p) for p in paths]
    if not parts:
        raise SystemExit("snapshot: give at least one --bench results.json")
    mixed = results.mixed_runs(parts)
    if mixed is not None:  # a snapshot states one GPU and one set of versions for all its rows
        raise SystemExit(f"snapshot: {paths[mixed]} was measured on another GPU or with other versions than {paths[0]}")
    merged: dict[tuple[str, str, str], dict[str, Any]] = {}
    for path, part in zip(paths, parts, strict=True):
        with_fla = {(r["shape"], r["mode"]) for r in part["rows"] if r["backend"] == "baseline:fla"}
        for row in part["rows"]:
            if (row["shape"], row["mode"]) not in with_fla:
                raise SystemExit(f"snapshot: {path} times {row['shape']} {row['mode']} without baseline:fla beside it")
            merged[(row["shape"], row["mode"], row["backend"])] = {**row, "measured": row.get("measured", part["date"])}
    order: dict[tuple[str, str], int] = {}
    for shape, mode, _ in merged:
        order.setdefault((shape, mode), len(order))
    last = parts[-1]
    runs: list[dict[str, Any]] = []
    for part in parts:  # a snapshot given as an input keeps the settings of the runs it was merged from
        settings = part["settings"]
        runs += [run for run in settings.get("runs", [settings]) if run]
    return {
        "kda": last["kda"],
        "date": max(p["date"] for p in parts),
        "gpu": last["gpu"],
        "versions": last["versions"],
        "settings": {"runs": runs},
        # a shape's rows together, in the order shapes, modes and backends first appeared
        "rows": sorted(merged.values(), key=lambda r: order[(r["shape"], r["mode"])]),
    }


def _forward_id(print_: dict[str, Any]) -> Any:
    """The fingerprint id a backend's inference and decode classes were verified under (a report written
    before `Backend.forward_version` existed has one id for both)."""
    return print_.get("forward_id", print_.get("id"))


def merge_verify(paths: list[Path]) -> dict[str, Any]:
    """One verification report from several ``kda.verify --json`` files, later files winning per class. A
    backend whose fingerprint changed (another version, packages or GPU) keeps only the later files' classes:
    what was said of the old one is not about it. Training classes and the others go by their own
    fingerprints (`Backend.forward_version`): a change to the backward alone keeps the inference classes'
    results. A class a stopped run did not reach ("not run") does not replace an earlier result under the
    same fingerprint."""
    parts = [_read(p) for p in paths]
    found: dict[tuple[str, str], dict[str, Any]] = {}
    fingerprints: dict[str, Any] = {}
    unavailable: dict[str, Any] = {}
    for part in parts:
        for backend, print_ in part.get("fingerprints", {}).items():
            earlier = fingerprints.get(backend)
            if earlier is not None:
                stale_training = earlier.get("id") != print_.get("id")
                stale_forward = _forward_id(earlier) != _forward_id(print_)
                found = {
                    key: result
                    for key, result in found.items()
                    if key[0] != backend or not (stale_training if trains(key[1]) else stale_forward)
                }
            fingerprints[backend] = print_
        unavailable.update(part.get("unavailable", {}))
        for result in part["results"]:
            key = (result["backend"], result["case_class"])
            if result["status"] != NOT_RUN or key not in found:
                found[key] = result
    merged = list(found.values())
    return {
        "kda": parts[-1]["kda"] if parts else None,
        "device": parts[-1]["device"] if parts else None,
        "passed": all(r["status"] not in ("fail", NOT_RUN) for r in merged),
        "fingerprints": fingerprints,
        "unavailable": unavailable,
        "results": merged,
    }


def verify_summary(report: dict[str, Any]) -> str:
    """Per backend: classes passed / failed / not run / refused, and the worst ratio to the tolerance."""
    lines = []
    for backend in sorted({r["backend"] for r in report["results"]}):
        mine = [r for r in report["results"] if r["backend"] == backend]
        counts = {s: sum(r["status"] == s for r in mine) for s in ("pass", "fail", NOT_RUN)}
        refused = len(mine) - sum(counts.values())
        ratios = [r["worst_ratio"] for r in mine if r["status"] == "pass" and r.get("worst_ratio") is not None]
        worst = f", worst {max(ratios):.2f} of the tolerance" if ratios else ""
        cut = f", {counts[NOT_RUN]} not run" if counts[NOT_RUN] else ""
        lines.append(
            f"- `{backend}`: {counts['pass']} passed, {counts['fail']} failed{cut}, {refused} not supported{worst}"
        )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, required=True, help="benchmarks/results/<gpu>/<kda version>")
    parser.add_argument(
        "--bench", type=Path, nargs="+", default=[], help="results.json files, oldest first (none: verification only)"
    )
    parser.add_argument("--verify", type=Path, nargs="*", default=[], help="kda.verify --json files")
    parser.add_argument("--env", type=Path, help="the machine's versions (env.txt)")
    args = parser.parse_args(argv)
    if not args.bench and not args.verify:
        parser.error("give --bench, --verify or both")

    args.out.mkdir(parents=True, exist_ok=True)
    written = results.write(merge_bench(args.bench), args.out) if args.bench else True
    if args.verify:
        report = merge_verify(args.verify)
        (args.out / "verify.json").write_text(json.dumps(report, indent=1) + "\n")
        print(verify_summary(report))
    if args.env is not None:
        shutil.copyfile(args.env, args.out / "env.txt")
    for path in sorted(args.out.iterdir()):
        print(path)
    return 0 if written else 1


if __name__ == "__main__":
    sys.exit(main())
