"""``python -m kda.verify``: cross-check backends against the float64 reference on this machine.

    python -m kda.verify --all                 # every registered backend over the whole grid
    python -m kda.verify --backend torch --quick
    python -m kda.verify --all --json out.json

Each (backend, case class) outcome is stored as a verification record (source "verify"), which the
dispatcher then trusts. Exit status: 0 when every available backend passed every case class it
supports; 1 when one failed, or a backend named with --backend is unavailable; 2 on bad usage.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import time
from typing import Any

import torch
from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn
from rich.table import Table

from kda import __version__, registry
from kda.spec import CaseClass
from kda.verify.cases import full_grid
from kda.verify.check import ClassResult, verify_class
from kda.verify.records import default_store, fingerprint, fingerprint_id


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m kda.verify", description=__doc__.split("\n\n")[0])
    parser.add_argument("--all", action="store_true", help="verify every registered backend (the default)")
    parser.add_argument("--backend", action="append", default=[], metavar="NAME", help="verify this backend (repeatable)")
    parser.add_argument("--quick", action="store_true", help="one case per class instead of three")
    parser.add_argument("--json", metavar="PATH", help="also write the results as JSON to PATH")
    parser.add_argument("--device", default=None, help="device to verify on (default: cuda if present, else cpu)")
    parser.add_argument("--case", action="append", default=[], metavar="KEY", help="only this case class (repeatable)")
    parser.add_argument("--list-cases", action="store_true", help="print the grid's case-class keys and exit")
    return parser


def _cell(result: ClassResult) -> str:
    if result.unsupported:
        return "[dim]-[/dim]"
    ratio = result.worst_ratio
    shown = "inf" if math.isinf(ratio) else f"{ratio:.2g}"
    return f"[green]pass {shown}[/green]" if result.passed else f"[bold red]FAIL {shown}[/bold red]"


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    out = Console(soft_wrap=True)
    err = Console(stderr=True)
    if args.list_cases:
        for cc in full_grid():
            out.print(cc.key)
        return 0
    try:
        classes = [CaseClass.from_key(key) for key in args.case] if args.case else full_grid()
    except ValueError as error:
        err.print(f"[red]{error}[/red]")
        return 2
    device = torch.device(args.device or ("cuda" if torch.cuda.is_available() else "cpu"))

    known = {b.name: b for b in registry.registered_backends()}
    unknown = [name for name in args.backend if name not in known]
    if unknown:
        err.print(f"[red]unknown backend(s): {', '.join(unknown)}; registered: {', '.join(known)}[/red]")
        return 2
    chosen = [known[name] for name in args.backend] if args.backend else list(known.values())

    unavailable = {b.name: registry.availability(b) for b in chosen if not registry.availability(b)}
    runnable = [b for b in chosen if b.name not in unavailable]
    store = default_store()
    results: dict[str, list[ClassResult]] = {b.name: [] for b in runnable}
    started = time.perf_counter()
    with Progress(TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(),
                  console=err, transient=False) as progress:
        task = progress.add_task("verifying", total=len(runnable) * len(classes))
        for backend in runnable:
            for cc in classes:
                progress.update(task, description=f"{backend.name} {cc.key}")
                result = verify_class(backend, cc, device, quick=args.quick)
                results[backend.name].append(result)
                if not result.unsupported:
                    store.put(backend, device, [result.to_record(source="verify", quick=args.quick)])
                progress.advance(task)
    elapsed = time.perf_counter() - started

    table = Table(title=f"kda {__version__} verification on {device} ({'quick' if args.quick else 'full'}; "
                        "cell = worst error / tolerance)")
    table.add_column("case class")
    for backend in runnable:
        table.add_column(f"{backend.name} v{backend.version}")
    for i, cc in enumerate(classes):
        table.add_row(cc.key, *[_cell(results[b.name][i]) for b in runnable])
    out.print(table)
    for name, verdict in unavailable.items():
        out.print(f"[yellow]{name}: unavailable[/yellow] - {'; '.join(verdict.reasons)}")

    failures = [(name, r) for name, rs in results.items() for r in rs if not r.unsupported and not r.passed]
    for name, result in failures:
        out.print(f"[red]FAIL[/red] {name} {result.case_class.key}: {result.reason}")
        for case in result.cases:
            if not case.passed and not case.unsupported:
                out.print(f"     case {case.case.describe()}")
    checked = sum(1 for rs in results.values() for r in rs if not r.unsupported)
    named_unavailable = [n for n in unavailable if n in args.backend]
    ok = not failures and not named_unavailable
    out.print(f"{checked - len(failures)} passed, {len(failures)} failed "
              f"({len(runnable)} backend(s), {len(classes)} case classes, {elapsed:.1f}s); "
              f"records in {store.root / 'verification'}")
    if named_unavailable:
        out.print(f"[red]requested backend(s) unavailable: {', '.join(named_unavailable)}[/red]")

    if args.json:
        payload: dict[str, Any] = {
            "kda": __version__,
            "device": str(device),
            "quick": args.quick,
            "passed": ok,
            "fingerprints": {b.name: {**fingerprint(b, device), "id": fingerprint_id(fingerprint(b, device))}
                             for b in runnable},
            "unavailable": {name: list(v.reasons) for name, v in unavailable.items()},
            "results": [
                {
                    "backend": name,
                    "case_class": r.case_class.key,
                    "status": "unsupported" if r.unsupported else ("pass" if r.passed else "fail"),
                    "worst_ratio": None if math.isinf(r.worst_ratio) else r.worst_ratio,
                    "reason": r.reason,
                    "cases": [c.as_json() for c in r.cases],
                }
                for name, rs in results.items() for r in rs
            ],
        }
        with open(args.json, "w") as handle:
            json.dump(payload, handle, indent=1, default=lambda x: None if isinstance(x, float) else str(x))
    return 0 if ok else 1


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
