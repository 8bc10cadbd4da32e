"""Regenerate README.md's "Measured" section from the newest results snapshot of each GPU.

    python benchmarks/readme_results.py           # rewrite the section between its markers
    python benchmarks/readme_results.py --check   # exit 1 when README.md differs from the snapshots

A snapshot is ``benchmarks/results/<gpu>/<kda version>/`` (see ``benchmarks/snapshot.py``); the newest
version of each GPU is shown. Per mode, one table: a row per shape, FLA's median and, for every other
backend, its median and its speed relative to FLA timed in the same process (``FLA ms / backend ms``:
above 1 is faster than FLA). The decode step (``decode.json``, `python -m kda.bench --mode decode`): a row per
shape, eager and as CUDA-graph replays, each with its share of the copy bandwidth measured in the same
run. Then every ``verify*.json`` of the snapshot. Every figure in the section comes from those files;
nothing in it is typed by hand.
"""

from __future__ import annotations

import argparse
import json
import re
import sys
from pathlib import Path
from typing import Any

from kda.verify.cli import NOT_RUN
from kda.workloads import DEFAULT_SHAPES

ROOT = Path(__file__).resolve().parent.parent
BEGIN = "<!-- measured:begin (python benchmarks/readme_results.py) -->"
END = "<!-- measured:end -->"
MODE_TITLES = {
    "fwd": "Inference forward (`fwd`: safe gate, l2norm and beta sigmoid in kernel, initial and final state)",
    "fwd_pregated": "Inference forward, pre-gated `g` (`fwd_pregated`)",
    "train_safe": "Training, forward + backward (`train_safe`)",
    "train_pregated": "Training, forward + backward, pre-gated `g` (`train_pregated`)",
}
BACKEND_ORDER = ("baseline:flashkda", "triton", "flashkda", "fla", "torch", "auto")
# A figure whose rounds (each a median of many runs) spread wider than this is marked: its time moved with
# something other than the kernels, on the device machines the host's pace at launching a step's many small
# kernels (docs/design.md, "The bench"), and its ratio holds for that machine's CPU, not for the GPU alone.
UNSTEADY_SPREAD = 0.10
UNSTEADY_MARK = "~"


def _version_key(name: str) -> tuple[int, ...]:
    return tuple(int(part) for part in re.findall(r"\d+", name))


def newest_snapshots(results: Path) -> list[Path]:
    """The newest version folder of each GPU under ``results`` (folders holding a results.json, or only a
    verification: a GPU where nothing was timed against FLA)."""
    found = []
    for gpu in sorted(p for p in results.iterdir() if p.is_dir()):
        versions = [p for p in gpu.iterdir() if (p / "results.json").is_file() or any(p.glob("verify*.json"))]
        if versions:
            found.append(max(versions, key=lambda p: _version_key(p.name)))
    return found


def _ms(value: float | None) -> str:
    return "-" if value is None else f"{value:.2f}" if value >= 1 else f"{value:.3f}"


def _ratio(row: dict[str, Any]) -> str:
    if row.get("median_ms") is None or row.get("fla_median_ms") is None:
        return ""
    return f" ({row['fla_median_ms'] / row['median_ms']:.2f}x)"


def spread(row: dict[str, Any] | None) -> float:
    """``(slowest - fastest) / fastest`` of a row's rounds (0 with fewer than two)."""
    rounds = [ms for ms in (row or {}).get("round_ms") or [] if ms]
    return max(rounds) / min(rounds) - 1 if len(rounds) > 1 else 0.0


def _unsteady(row: dict[str, Any] | None) -> str:
    return UNSTEADY_MARK if spread(row) > UNSTEADY_SPREAD else ""


def _cell(row: dict[str, Any] | None) -> str:
    if row is None:
        return ""
    if row["status"] != "ok":
        reason = row.get("reason") or ""
        if "failed verification" in reason:
            return "unverified"  # kda refuses it: it did not meet the tolerance (see verify.json)
        if any(word in reason for word in ("needs", "supports", " only")):
            return "n/a"  # the backend does not take this shape or mode (FlashKDA: "the safe gate only")
        return row["status"]
    text = _ms(row["median_ms"]) + _unsteady(row) + _ratio(row)
    if row["kind"] == "auto" and row.get("chose"):
        text += f" → {row['chose']}"
    return text


def mode_table(rows: list[dict[str, Any]], mode: str) -> list[str]:
    mine = [r for r in rows if r["mode"] == mode]
    seen = list(dict.fromkeys(r["shape"] for r in mine))
    order = {shape: i for i, shape in enumerate(DEFAULT_SHAPES)}  # the bench's own order: dense, then varlen
    shapes = sorted(seen, key=lambda shape: order.get(shape, len(order) + seen.index(shape)))
    present = {r["backend"] for r in mine}
    backends = [b for b in BACKEND_ORDER if b in present] + sorted(present - set(BACKEND_ORDER) - {"baseline:fla"})
    lines = [
        f"**{MODE_TITLES.get(mode, mode)}**, ms (speed relative to FLA; n/a: the backend does not take "
        "the shape; unverified: kda refuses it there):",
        "",
        "| shape | FLA | " + " | ".join(f"`{b}`" for b in backends) + " | measured |",
        "|---|---|" + "---|" * len(backends) + "---|",
    ]
    for shape in shapes:
        cells = {r["backend"]: r for r in mine if r["shape"] == shape}
        fla = cells.get("baseline:fla")
        fla_ms = fla["median_ms"] if fla else next((r["fla_median_ms"] for r in cells.values()), None)
        dates = sorted({r.get("measured", "") for r in cells.values()} - {""})
        lines.append(
            f"| {shape} | {_ms(fla_ms)}{_unsteady(fla)} | "
            + " | ".join(_cell(cells.get(b)) for b in backends)
            + f" | {', '.join(dates)} |"
        )
    unsteady = [r for r in mine if r["status"] == "ok" and _unsteady(r)]
    if unsteady:
        widest = max(unsteady, key=spread)
        lines += [
            "",
            f"{UNSTEADY_MARK}: the run's {len(widest['round_ms'])} rounds spread by more than "
            f"{100 * UNSTEADY_SPREAD:.0f}% (at most {100 * spread(widest):.0f}%: {widest['backend']} at "
            f"{widest['shape']}, {_ms(min(widest['round_ms']))} to {_ms(max(widest['round_ms']))} ms). Such a time "
            "moved with the host launching the step's kernels, so its ratio holds for that machine's CPU as much as "
            'for its GPU (`docs/design.md`, "The bench").',
        ]
    gap = auto_gap(mine)
    if gap is not None:
        worst, shape = gap
        lines += [
            "",
            f"`auto` against the fastest verified kda backend at each shape: at most {100 * worst:+.1f}% ({shape}).",
        ]
    return lines


def auto_gap(rows: list[dict[str, Any]]) -> tuple[float, str] | None:
    """The largest relative excess of `auto`'s time over the fastest kda backend (not a baseline) that ran
    at the same shape, and where: how close kda's choice came to the best it could have made."""
    worst: tuple[float, str] | None = None
    for shape in dict.fromkeys(r["shape"] for r in rows):
        here = [r for r in rows if r["shape"] == shape and r["status"] == "ok" and r.get("median_ms")]
        auto = next((r for r in here if r["kind"] == "auto"), None)
        chosen = [r["median_ms"] for r in here if r["kind"] == "kda"]
        if auto is None or not chosen:
            continue
        excess = auto["median_ms"] / min(chosen) - 1
        if worst is None or excess > worst[0]:
            worst = (excess, shape)
    return worst


def _decode_cell(row: dict[str, Any] | None, fla: dict[str, Any] | None, graph: bool) -> str:
    """``ms (FLA ms / ms, share of the copy bandwidth)`` of one decode row, eager or as graph replays."""
    if row is None:
        return ""
    if row["status"] != "ok":
        return "n/a" if "supports" in (row.get("reason") or "") else row["status"]
    ms, pct = (row.get("graph_ms"), row.get("graph_pct_floor")) if graph else (row["median_ms"], row["pct_floor"])
    if ms is None:
        return "-"
    fla_ms = None if fla is None else (fla.get("graph_ms") if graph else fla["median_ms"])
    ratio = f"{fla_ms / ms:.2f}x, " if fla_ms and row is not fla else ""
    text = f"{_ms(ms)} ({ratio}{pct:.0f}%)"
    if row["kind"] == "auto" and row.get("chose"):
        text += f" → {row['chose']}"
    return text


def decode_table(data: dict[str, Any]) -> list[str]:
    rows = data["rows"]
    present = {r["backend"] for r in rows if r["status"] == "ok"} - {"torch"}  # the reference: in decode.json
    backends = ["baseline:fla", *(b for b in BACKEND_ORDER if b in present)]
    graphs = any(r.get("graph_ms") is not None for r in rows)
    header = [f"`{b}`" for b in backends] + [f"`{b}` graph" for b in backends if graphs]
    lines = [
        f"**Decode step (`fused_recurrent_kda`, `decode.json`)**: ms (FLA's time over this one, share of the copy "
        f"bandwidth, {data['copy_bandwidth_bytes_per_s'] / 1e9:.0f} GB/s measured in the same run); N sequences of "
        "T tokens (T = 4: speculative decoding, a slot per token), HV = 32, K = V = 128, a state pool of that dtype "
        "updated in place. Eager calls, and"
        + (" (graph) the same call captured in a CUDA graph and replayed, as serving engines run it" if graphs else "")
        + " (the torch backend's rows, the readable reference at 1 to 15 ms, are in the file):",
        "",
        "| shape | " + " | ".join(header) + " |",
        "|---|" + "---|" * len(header),
    ]
    for shape in dict.fromkeys(r["shape"] for r in rows):
        cells = {r["backend"]: r for r in rows if r["shape"] == shape}
        fla = cells.get("baseline:fla")
        eager = [_decode_cell(cells.get(b), fla, False) for b in backends]
        replay = [_decode_cell(cells.get(b), fla, True) for b in backends] if graphs else []
        lines.append(f"| {shape} | " + " | ".join(eager + replay) + " |")
    return lines


def verify_lines(report: dict[str, Any]) -> list[str]:
    lines = []
    for backend in sorted({r["backend"] for r in report["results"]}):
        mine = [r for r in report["results"] if r["backend"] == backend]
        passed = sum(r["status"] == "pass" for r in mine)
        failed = sum(r["status"] == "fail" for r in mine)
        not_run = sum(r["status"] == NOT_RUN for r in mine)
        ratios = [r["worst_ratio"] for r in mine if r["status"] == "pass" and r.get("worst_ratio") is not None]
        worst = f", at most {max(ratios):.2f} of the tolerance" if ratios else ""
        reached = [r for r in mine if r["status"] != NOT_RUN]
        quick = report.get("quick") is True or (bool(reached) and all(len(r.get("cases") or []) <= 1 for r in reached))
        cut = f", {not_run} not run (the run was stopped before them)" if not_run else ""
        text = f"- `{backend}`: {passed} case classes passed, {failed} failed{cut}{worst}"
        text += " (quick verification: the bench's classes)" if quick else ""
        failures = [r for r in mine if r["status"] == "fail"]
        if failures:
            text += f" (for example {failures[0]['case_class']}: {(failures[0].get('reason') or '')[:120]})"
        lines.append(text + ".")
    return lines


UNRECORDED_FLA = (
    "not recorded (before `baseline:fla` was held to FLA's Triton kernels, FLA 0.6 ran its TileLang backward "
    "stage wherever tilelang was installed, as on the device machine, unless `FLA_TILELANG` was 0)"
)


def fla_path_line(runs: list[dict[str, Any]], mode: str) -> list[str]:
    """What `baseline:fla` ran in the runs that timed `mode`, from their settings (`fla_paths`); training
    only, where FLA's route differs."""
    if not mode.startswith("train"):
        return []
    timed = [run for run in runs if mode in run.get("modes", []) and "baseline:fla" in run.get("backends", [])]
    paths = list(dict.fromkeys(run.get("fla_paths", {}).get("baseline:fla", UNRECORDED_FLA) for run in timed))
    if not paths:
        return []
    return ["", "FLA's path in these rows: " + "; in other runs, ".join(paths) + "."]


def section(snapshot: Path) -> list[str]:
    where = (snapshot.relative_to(ROOT) if snapshot.is_relative_to(ROOT) else snapshot).as_posix()
    if not (snapshot / "results.json").is_file():
        return verification_section(snapshot, where)
    data = json.loads((snapshot / "results.json").read_text())
    versions = data["versions"]
    shown = ("torch", "triton", "fla", "flash_kda", "helion", "tilelang")
    lines = [
        f"### {data['gpu']['name']}, kda {data['kda']} (`{where}/`)",
        "",
        "Versions: " + ", ".join(f"{k} {versions[k]}" for k in shown if versions.get(k)) + ". "
        "Median of `triton.testing.do_bench` over 3 rounds, warm-up excluded, bf16; each speed is against FLA "
        "re-measured in the same process as that figure (the FLA column is its latest run; a shape's cells may "
        "come from runs on several dates). `auto` is kda's choice among the verified backends (after `--tune`). "
        f"Details, peak memory and cold starts: `{where}/results.md`.",
        "",
    ]
    modes = list(dict.fromkeys(r["mode"] for r in data["rows"]))
    for mode in sorted(modes, key=lambda m: list(MODE_TITLES).index(m) if m in MODE_TITLES else 99):
        runs = data.get("settings", {}).get("runs", [])
        lines += [*mode_table(data["rows"], mode), *fla_path_line(runs, mode), ""]
    decode = snapshot / "decode.json"
    if decode.is_file():
        lines += [*decode_table(json.loads(decode.read_text())), ""]
    return lines + verifications(snapshot, where)


def _version_label(print_: dict[str, Any]) -> str:
    """``v17``, or ``v17 (forward v16)`` where the backend's inference classes were verified under an
    earlier forward (`Backend.forward_version`)."""
    version, forward = print_["backend_version"], print_.get("forward_version", print_["backend_version"])
    return f"v{version}" + (f" (forward v{forward})" if forward != version else "")


def verifications(snapshot: Path, where: str) -> list[str]:
    lines = []
    for verify in sorted(snapshot.glob("verify*.json")):
        report = json.loads(verify.read_text())
        backends = ", ".join(f"{n} {_version_label(f)}" for n, f in sorted(report.get("fingerprints", {}).items()))
        lines += [f"Verification on that machine (`{where}/{verify.name}`; {backends}):", ""]
        lines += [*verify_lines(report), ""]
    return lines


def verification_section(snapshot: Path, where: str) -> list[str]:
    """A snapshot with no bench rows: the GPU (from a verification's fingerprint) and what was verified."""
    reports = [json.loads(path.read_text()) for path in sorted(snapshot.glob("verify*.json"))]
    devices = {f["device"] for report in reports for f in report.get("fingerprints", {}).values()}
    versions = {
        k: v for report in reports for f in report.get("fingerprints", {}).values() for k, v in f["packages"].items()
    }
    gpu = ", ".join(sorted(devices)) or snapshot.parent.name
    shown = ", ".join(f"{k} {versions[k]}" for k in ("torch", "triton", "helion") if versions.get(k))
    lines = [f"### {gpu}, kda {snapshot.name} (`{where}/`): verification only", ""]
    lines += [f"Versions: {shown}. Nothing on this GPU is timed here: a bench row needs FLA beside it.", ""]
    return lines + verifications(snapshot, where)


def render(results: Path) -> str:
    lines = [BEGIN, ""]
    # GPUs with timings first; a verification-only snapshot after them
    for snapshot in sorted(newest_snapshots(results), key=lambda p: not (p / "results.json").is_file()):
        lines += section(snapshot)
    return "\n".join([*lines, END])


def updated(readme: str, block: str) -> str:
    start, end = readme.find(BEGIN), readme.find(END)
    if start < 0 or end < start:
        raise SystemExit(f"readme_results: README.md has no '{BEGIN}' ... '{END}' block")
    return readme[:start] + block + readme[end + len(END) :]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--check", action="store_true", help="exit 1 when README.md is not what the snapshots say")
    parser.add_argument("--readme", type=Path, default=ROOT / "README.md")
    parser.add_argument("--results", type=Path, default=ROOT / "benchmarks" / "results")
    args = parser.parse_args(argv)
    readme = args.readme.read_text()
    new = updated(readme, render(args.results))
    if args.check:
        if new != readme:
            print("README.md's measured section differs from the snapshots: run python benchmarks/readme_results.py")
            return 1
        return 0
    args.readme.write_text(new)
    return 0


if __name__ == "__main__":
    sys.exit(main())
