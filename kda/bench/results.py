"""What a bench run leaves behind: ``results.json``, ``results.md``, ``pct_fla.png`` and a terminal table.

``results.json``::

    {"kda": ..., "date": "YYYY-MM-DD", "gpu": {...}, "versions": {kda, torch, triton, helion, tilelang,
     flash_kda, fla, driver, cuda, python}, "settings": {...}, "rows": [Row.as_json(), ...]}
"""

from __future__ import annotations

import datetime
import json
import platform
import re
import subprocess
from collections.abc import Iterable
from pathlib import Path
from typing import Any

import torch
from rich.table import Table

from kda._version import __version__
from kda.bench.runner import Row
from kda.store import package_versions


def gpu_info(device: torch.device) -> dict[str, Any]:
    if device.type != "cuda":
        return {"name": f"cpu ({platform.machine()})", "capability": None}
    props = torch.cuda.get_device_properties(device)
    return {
        "name": props.name,
        "capability": f"{props.major}.{props.minor}",
        "sms": props.multi_processor_count,
        "memory_bytes": props.total_memory,
    }


def driver_version() -> str | None:
    try:
        done = subprocess.run(
            ["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"],
            capture_output=True,
            text=True,
            timeout=30,
        )
    except (OSError, subprocess.SubprocessError):
        return None
    lines = done.stdout.strip().splitlines()
    return lines[0].strip() if done.returncode == 0 and lines else None


def versions() -> dict[str, str | None]:
    found = dict(package_versions())
    return {
        "kda": __version__,
        **found,
        "driver": driver_version(),
        "cuda": torch.version.cuda,
        "python": platform.python_version(),
    }


def gpu_slug(name: str) -> str:
    """``NVIDIA H200`` -> ``nvidia-h200`` (the results folder name)."""
    return re.sub(r"[^a-z0-9]+", "-", name.lower()).strip("-") or "unknown"


def default_out_dir(device: torch.device, root: Path = Path("benchmarks/raw")) -> Path:
    name = gpu_info(device)["name"] if device.type == "cuda" else "cpu"
    return root / gpu_slug(name) / datetime.date.today().isoformat()


def payload(rows: Iterable[Row], device: torch.device, settings: dict[str, Any]) -> dict[str, Any]:
    return {
        "kda": __version__,
        "date": datetime.date.today().isoformat(),
        "gpu": gpu_info(device),
        "versions": versions(),
        "settings": settings,
        "rows": [r.as_json() for r in rows],
    }


def mixed_runs(parts: list[dict[str, Any]]) -> int | None:
    """The index of the first run measured on another GPU or with other package versions than the first,
    or None when every run can share one table (its GPU and versions are stated once)."""
    for i, part in enumerate(parts[1:], start=1):
        if part["gpu"] != parts[0]["gpu"] or part["versions"] != parts[0]["versions"]:
            return i
    return None


def _ms(value: float | None) -> str:
    return "-" if value is None else f"{value:.3f}"


def _pct(value: float | None) -> str:
    return "-" if value is None else f"{value:.0f}%"


def _mib(value: int | None) -> str:
    return "-" if value is None else f"{value / 2**20:.0f}"


def _cold(row: dict[str, Any]) -> str:
    if row.get("cold_start_s") is None:
        return "-"
    files = row.get("cold_new_cache_files")
    return f"{row['cold_start_s']:.1f}" + (f" ({files} new)" if files else "")


def _status(row: dict[str, Any]) -> str:
    if row["status"] == "ok":
        return f"-> {row['chose']}" if row.get("chose") and row["kind"] == "auto" else ""
    return f"{row['status']}: {(row.get('reason') or '')[:160]}"


COLUMNS = ("shape", "mode", "backend", "median ms", "FLA ms", "pct_fla", "peak MiB", "cold start s", "note")


def _cells(row: dict[str, Any]) -> list[str]:
    return [
        row["shape"],
        row["mode"],
        row["backend"],
        _ms(row["median_ms"]),
        _ms(row["fla_median_ms"]),
        _pct(row["pct_fla"]),
        _mib(row["peak_bytes"]),
        _cold(row),
        _status(row),
    ]


def terminal_table(data: dict[str, Any]) -> Table:
    table = Table(
        title=f"kda {data['kda']} bench on {data['gpu']['name']} ({data['date']}); "
        "pct_fla = 100 x FLA ms / backend ms, same process"
    )
    for column in COLUMNS:
        table.add_column(column, overflow="fold")
    for row in data["rows"]:
        table.add_row(*_cells(row))
    return table


def markdown(data: dict[str, Any]) -> str:
    v = data["versions"]
    lines = [
        f"# kda bench: {data['gpu']['name']}, {data['date']}",
        "",
        "Versions: " + ", ".join(f"{k} {v[k]}" for k in v if v[k] is not None) + ".",
        "",
        (
            ("Median of `triton.testing.do_bench` (warm-up excluded, L2 flushed between runs), bf16. ")
            if data["gpu"].get("capability")
            else "Wall-clock median on the CPU (warm-up excluded), bf16. "
        )
        + "`pct_fla = 100 * FLA ms / backend ms` with FLA re-measured in the same process "
        "(above 100% is faster than FLA). Peak memory is beyond the inputs. Cold start is the first call "
        "in a fresh process (the call alone; `cold_process_s` in results.json adds interpreter start, "
        'imports and inputs); "(n new)" counts the Triton cache files it wrote (compilation, tuning).',
        "",
        "Settings: " + ", ".join(f"{k}={v}" for k, v in data["settings"].items()) + ".",
        "",
        "| " + " | ".join(COLUMNS) + " |",
        "|" + "---|" * len(COLUMNS),
    ]
    for row in data["rows"]:
        lines.append("| " + " | ".join(c.replace("|", "/") for c in _cells(row)) + " |")
    return "\n".join(lines) + "\n"


def chart(data: dict[str, Any], path: Path) -> str | None:
    """Bar chart of pct_fla by shape and backend, one panel per mode. Returns why not, when it cannot."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except Exception as error:
        return (
            f"matplotlib unavailable ({type(error).__name__}); "
            "render later with `python -m kda.bench --chart results.json`"
        )
    rows = [r for r in data["rows"] if r["pct_fla"] is not None and r["backend"] != "baseline:fla"]
    modes = list(dict.fromkeys(r["mode"] for r in rows))
    if not modes:
        return "no row has a pct_fla (was FLA measured?)"
    fig, axes = plt.subplots(len(modes), 1, figsize=(14, 4.2 * len(modes)), squeeze=False)
    for ax, mode in zip(axes[:, 0], modes):
        these = [r for r in rows if r["mode"] == mode]
        shapes = list(dict.fromkeys(r["shape"] for r in these))
        backends = list(dict.fromkeys(r["backend"] for r in these))
        width = 0.8 / max(1, len(backends))
        for i, backend in enumerate(backends):
            values = {r["shape"]: r["pct_fla"] for r in these if r["backend"] == backend}
            xs = [j + i * width for j, s in enumerate(shapes) if s in values]
            ax.bar(xs, [values[s] for s in shapes if s in values], width, label=backend)
        ax.axhline(100, color="black", linewidth=0.8, linestyle="--")
        ax.set_xticks([j + 0.4 - width / 2 for j in range(len(shapes))])
        ax.set_xticklabels(shapes, rotation=20, ha="right", fontsize=8)
        ax.set_ylabel("% of FLA speed")
        ax.set_title(f"{mode}: 100 x FLA ms / backend ms ({data['gpu']['name']}, {data['date']})")
        ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return None


def write_so_far(data: dict[str, Any], out_dir: Path, expected_rows: int) -> dict[str, Path]:
    """``results.json`` and ``results.md`` with the rows finished so far, rewritten as each row finishes
    (no chart: that is drawn once, by `write`, when the run ends). A run killed from outside, where no
    handler gets to run (SIGKILL, or SIGTERM while the process sits in a long compile), leaves these.
    Each file is written beside its place and renamed into it, so a kill leaves the old file or the new
    one, never half of one."""
    out_dir.mkdir(parents=True, exist_ok=True)
    data = {**data, "settings": {**data["settings"], "partial": f"{len(data['rows'])} of {expected_rows} rows"}}
    paths = {"json": out_dir / "results.json", "md": out_dir / "results.md"}
    texts = {
        "json": json.dumps(data, indent=1) + "\n",
        "md": markdown(data) + f"\nPartial: {len(data['rows'])} of {expected_rows} rows; the run did not "
        "finish (or is still running).\n",
    }
    for kind, path in paths.items():
        scratch = path.with_name(path.name + ".part")
        scratch.write_text(texts[kind])
        scratch.replace(path)
    return paths


def write(data: dict[str, Any], out_dir: Path) -> dict[str, Path]:
    out_dir.mkdir(parents=True, exist_ok=True)
    paths = {"json": out_dir / "results.json", "md": out_dir / "results.md", "png": out_dir / "pct_fla.png"}
    paths["json"].write_text(json.dumps(data, indent=1) + "\n")
    why_not = chart(data, paths["png"])
    text = markdown(data)
    if why_not:
        text += f"\nChart: not drawn: {why_not}\n"
        paths.pop("png")
    else:
        text += "\n![pct_fla by shape and backend](pct_fla.png)\n"
    paths["md"].write_text(text)
    return paths
