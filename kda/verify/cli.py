"""``python -m kda.verify``: cross-check backends against the float64 reference on this machine.

    python -m kda.verify --all                 # every registered backend over the whole grid
    python -m kda.verify --backend torch --quick
    python -m kda.verify --all --json out.json

Each (backend, case class) outcome is stored as a verification record (source "verify"), which the
dispatcher then trusts. Exit status: 0 when every available backend passed every case class it
supports; 1 when one failed, a backend named with --backend is unavailable, or the run was stopped
(SIGTERM, as `timeout` sends, or Ctrl-C) before every class had a result; 2 on bad usage. A stopped run
still prints and writes its report: the classes verified so far (its workers' too), and the rest as
"not run", which is not a failure and leaves no record.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import signal
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

import torch
from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn
from rich.table import Table

from kda import cliargs, registry
from kda._version import __version__
from kda.recurrent.spec import RecurrentCaseClass, is_recurrent_key
from kda.spec import CaseClass
from kda.verify.cases import full_grid
from kda.verify.check import ClassResult, verify_class
from kda.verify.records import Record, default_store, fingerprint, fingerprint_id
from kda.verify.recurrent import RecurrentClassResult, recurrent_grid, verify_recurrent_class
from kda.workloads import DEFAULT_SHAPES, MODES, case_class_keys

PROG = "python -m kda.verify"


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog=PROG, description=__doc__.split("\n\n")[0])
    parser.add_argument("--all", action="store_true", help="verify every registered backend (the default)")
    parser.add_argument(
        "--backend", action="append", default=[], metavar="NAME", help="verify this backend (repeatable)"
    )
    parser.add_argument(
        "--quick",
        action="store_true",
        help="a realistic and a correlated case per class instead of four (one decode case instead of three)",
    )
    parser.add_argument("--json", metavar="PATH", help="also write the results as JSON to PATH")
    parser.add_argument("--device", default=None, help="device to verify on (default: cuda if present, else cpu)")
    parser.add_argument("--case", action="append", default=[], metavar="KEY", help="only this case class (repeatable)")
    parser.add_argument(
        "--jobs",
        type=int,
        default=1,
        help="spread the case classes over N processes, one GPU each, round robin (slow-compiling backends)",
    )
    parser.add_argument(
        "--with-bench-classes",
        action="store_true",
        help="also verify the case classes of `python -m kda.bench`'s shapes and modes",
    )
    parser.add_argument(
        "--work-dir",
        type=Path,
        default=None,
        help="with --jobs: where the workers' logs and partial results go (default: a temp dir)",
    )
    parser.add_argument(
        "--with-recurrent",
        action="store_true",
        help="also verify the decode op's (fused_recurrent_kda) case classes (keys recurrent/...)",
    )
    parser.add_argument(
        "--progress",
        type=Path,
        default=None,
        metavar="PATH",
        help="append each class's result to PATH as one JSON line when it is known (how --jobs keeps what a "
        "worker that dies had verified)",
    )
    parser.add_argument(
        "--missing",
        action="store_true",
        help="verify only the (backend, class) pairs this machine holds no record of (a full one; with --quick, "
        "any), and report the others as recorded: how a run that a deadline cut is continued",
    )
    parser.add_argument("--list-cases", action="store_true", help="print the grid's case-class keys and exit")
    return parser


def _class_of(key: str) -> Any:
    """A case class of either op from its key (decode classes start with ``recurrent/``)."""
    return RecurrentCaseClass.from_key(key) if is_recurrent_key(key) else CaseClass.from_key(key)


NOT_RUN = "not run"


class _Stopped(KeyboardInterrupt):
    """Raised in the main thread by SIGTERM: the run stops and reports what it has. An interrupt, not an
    error: the verifier fails a case for any error its backend raises, and a library catches `Exception`,
    but both let a KeyboardInterrupt through, so a stop never becomes a failing class."""


_STOP: list[str] = []  # the signal that stopped this run, once one has (see `_raise_if_stopped`)


def _stop_on_signal(signum: int, frame: Any) -> None:
    signal.signal(signum, signal.SIG_IGN)  # once: a second signal must not cut the report short
    _STOP.append(signal.Signals(signum).name)
    raise _Stopped(_STOP[-1])


def _raise_if_stopped() -> None:
    """Raises `_Stopped` when a signal has stopped the run: code that catches everything (a tracer that
    wraps whatever its traced function raised) can turn the stop into a case's error, and that class's
    result is then the stop's, not the backend's; it must be neither reported nor recorded."""
    if _STOP:
        raise _Stopped(_STOP[0])


def _cell(entry: dict[str, Any]) -> str:
    if entry["status"] == "unsupported":
        return "[dim]-[/dim]"
    if entry["status"] == NOT_RUN:
        return "[dim]not run[/dim]"
    ratio = entry["worst_ratio"]
    shown = "inf" if ratio is None else f"{ratio:.2g}"
    kept = " [dim](recorded)[/dim]" if entry.get("recorded") is not None else ""  # --missing: not run again
    return (
        f"[green]pass {shown}[/green]" if entry["status"] == "pass" else f"[bold red]FAIL {shown}[/bold red]"
    ) + kept


def _entry(name: str, r: ClassResult | RecurrentClassResult) -> dict[str, Any]:
    return {
        "backend": name,
        "case_class": r.case_class.key,
        "status": "unsupported" if r.unsupported else ("pass" if r.passed else "fail"),
        "worst_ratio": None if math.isinf(r.worst_ratio) else r.worst_ratio,
        "reason": r.reason,
        "cases": [c.as_json() for c in r.cases],
    }


def _usage_problem(args: argparse.Namespace) -> str | None:
    """What makes these arguments unusable (checked before any work), or None."""
    if problem := cliargs.settings_problem():
        return problem
    if problem := cliargs.number_problem("--jobs", args.jobs, at_least=1):
        return problem
    if args.device is not None and (problem := cliargs.device_problem(args.device)):
        return problem
    if args.json is not None and (problem := cliargs.output_file_problem("--json", Path(args.json))):
        return problem
    if args.work_dir is not None and (problem := cliargs.output_dir_problem("--work-dir", args.work_dir)):
        return problem
    if args.progress is not None and (problem := cliargs.output_file_problem("--progress", args.progress)):
        return problem
    return None


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    problem = _usage_problem(args)
    if problem:
        return cliargs.usage_error(PROG, problem)
    out = Console(soft_wrap=True)
    err = Console(stderr=True)
    if args.list_cases:
        listed: list[Any] = [*full_grid(), *(recurrent_grid() if args.with_recurrent else [])]
        for cc in listed:
            out.print(cc.key)
        return 0
    try:
        classes: list[Any] = [_class_of(key) for key in args.case] if args.case else full_grid()
    except ValueError as error:
        err.print(f"[red]{error}[/red]")
        return 2
    if args.with_bench_classes:
        have = {cc.key for cc in classes}
        classes += [CaseClass.from_key(k) for k in case_class_keys(DEFAULT_SHAPES, list(MODES)) if k not in have]
    if args.with_recurrent:
        have = {cc.key for cc in classes}
        classes += [cc for cc in recurrent_grid() if cc.key not in have]
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
    recorded = _recorded(store, runnable, classes, device, quick=args.quick) if args.missing else {}
    started = time.perf_counter()
    stopped: str | None = None
    _STOP.clear()
    in_main_thread = threading.current_thread() is threading.main_thread()  # where Python delivers signals
    previous = signal.signal(signal.SIGTERM, _stop_on_signal) if in_main_thread else None
    try:
        with Progress(
            TextColumn("{task.description}"),
            BarColumn(),
            MofNCompleteColumn(),
            TimeElapsedColumn(),
            console=err,
            transient=False,
        ) as progress:
            task = progress.add_task("verifying", total=len(runnable) * len(classes) - len(recorded))
            workers = _Workers(args, runnable, device, progress, task, store, skip=set(recorded))
            try:
                if args.jobs > 1 and runnable:
                    workers.spread(classes)
                else:
                    _run_here(args, runnable, classes, device, progress, task, store, err, workers)
            except (_Stopped, KeyboardInterrupt) as why:
                stopped = str(why) or "SIGINT"
                workers.stop()
    finally:
        if in_main_thread:
            signal.signal(signal.SIGTERM, previous)
    entries = [*recorded.values(), *workers.entries]
    elapsed = time.perf_counter() - started
    by_key = {(e["backend"], e["case_class"]): e for e in entries}
    table = Table(
        title=f"kda {__version__} verification on {device} ({'quick' if args.quick else 'full'}; "
        "cell = worst error / tolerance)"
    )
    table.add_column("case class")
    for backend in runnable:
        table.add_column(f"{backend.name} {backend.version_label()}")
    missing: dict[str, Any] = {
        "status": "fail",
        "worst_ratio": None,
        "reason": "no result (worker failed)",
        "cases": [],
    }
    if stopped is not None:  # not reached before the signal: neither verified nor failed
        missing = {**missing, "status": NOT_RUN, "reason": f"not run: the run was stopped ({stopped}) first"}
    for b in runnable:  # a class whose worker died is a failure in the report too, never a missing row
        for cc in classes:
            if (b.name, cc.key) not in by_key:
                entry = {"backend": b.name, "case_class": cc.key, **missing}
                entries.append(entry)
                by_key[(b.name, cc.key)] = entry
    for cc in classes:
        table.add_row(cc.key, *[_cell(by_key[(b.name, cc.key)]) for b in runnable])
    out.print(table)
    for name, verdict in unavailable.items():
        out.print(f"[yellow]{name}: unavailable[/yellow] - {'; '.join(verdict.reasons)}")

    failures = [
        (b.name, cc.key, by_key.get((b.name, cc.key), missing))
        for b in runnable
        for cc in classes
        if by_key.get((b.name, cc.key), missing)["status"] == "fail"
    ]
    for name, key, entry in failures:
        out.print(f"[red]FAIL[/red] {name} {key}: {entry['reason']}")
        for case in entry["cases"]:
            if not case.get("passed") and not case.get("unsupported"):
                out.print(f"     case {case}")
    checked = sum(1 for e in entries if e["status"] not in ("unsupported", NOT_RUN))
    not_run = sum(1 for e in entries if e["status"] == NOT_RUN)
    named_unavailable = [n for n in unavailable if n in args.backend]
    ok = not failures and not named_unavailable and stopped is None
    folder = store.root / "verification"
    where = f"records NOT saved ({folder} cannot be written)" if store.unsaved() else f"records in {folder}"
    cut = f", {not_run} not run (stopped by {stopped})" if stopped is not None else ""
    kept = f", {len(recorded)} of them as recorded before this run" if recorded else ""
    out.print(
        f"{checked - len(failures)} passed, {len(failures)} failed{cut}{kept} "
        f"({len(runnable)} backend(s), {len(classes)} case classes, {elapsed:.1f}s); {where}"
    )
    if named_unavailable:
        out.print(f"[red]requested backend(s) unavailable: {', '.join(named_unavailable)}[/red]")

    if args.json:
        payload: dict[str, Any] = {
            "kda": __version__,
            "device": str(device),
            "quick": args.quick,
            "passed": ok,
            "seconds": round(elapsed, 1),
            **({"stopped": stopped} if stopped is not None else {}),
            "fingerprints": {b.name: _fingerprint_entry(b, device) for b in runnable},
            "unavailable": {name: list(v.reasons) for name, v in unavailable.items()},
            "results": entries,
        }
        with open(args.json, "w") as handle:
            json.dump(payload, handle, indent=1, default=_json_default)
    return 0 if ok else 1


def _fingerprint_entry(backend, device: torch.device) -> dict[str, Any]:
    """The report's word on what `backend`'s results were made under: its training classes' fingerprint
    with its ``id``, and the id its inference and decode classes are kept under (``forward_id``; another
    one where `Backend.forward_version` keeps an earlier forward's records)."""
    training = fingerprint(backend, device)
    return {
        **training,
        "id": fingerprint_id(training),
        "forward_version": backend.version_for(training=False),
        "forward_id": fingerprint_id(fingerprint(backend, device, training=False)),
    }


def _json_default(value: Any) -> Any:
    return None if isinstance(value, float) else str(value)


Pair = tuple[str, str]  # (backend name, case-class key), in the order they are verified


def _recorded(store, runnable, classes, device: torch.device, *, quick: bool) -> dict[Pair, dict[str, Any]]:
    """The pairs `store` already holds a record of on this machine, as report entries judged under the
    tolerances in force (`Record.assessment`): a full record, or any with `quick` (a full one covers a
    quick check). A declined class leaves no record, so it is asked again (it costs a `supports` call)."""
    found: dict[Pair, dict[str, Any]] = {}
    for backend in runnable:
        for cc in classes:
            record = store.get(backend, device, cc.key)
            if record is None or (record.quick and not quick):
                continue
            verdict = record.assessment()
            found[(backend.name, cc.key)] = {
                "backend": backend.name,
                "case_class": cc.key,
                "status": "pass" if verdict.passed else "fail",
                "worst_ratio": None if math.isinf(verdict.worst_ratio) else verdict.worst_ratio,
                "reason": verdict.reason,
                "cases": record.cases,
                "recorded": record.when,
            }
    return found


def _run_here(args, runnable, classes, device, progress, task, store, err, workers) -> None:
    """Verify every (backend, class) pair in this process, one after another. On CUDA the context is
    checked after each class: a kernel that faults (an illegal address) leaves it unusable, and every later
    class would fail for that reason alone. The class it was lost in fails, with a record saying so, and
    the pairs not yet verified go to fresh worker processes (`_Workers.run`)."""
    pairs = [(backend, cc) for backend in runnable for cc in classes if (backend.name, cc.key) not in workers.skip]
    entries = workers.entries  # as each class ends: a stopped run reports what it had
    for done, (backend, cc) in enumerate(pairs, start=1):
        progress.update(task, description=f"{backend.name} {cc.key}")
        class_started = time.perf_counter()
        result = (
            verify_recurrent_class(backend, cc, device, quick=args.quick)
            if isinstance(cc, RecurrentCaseClass)
            else verify_class(backend, cc, device, quick=args.quick)
        )
        _raise_if_stopped()  # a class the stop landed in has no result of its own
        entry = _entry(backend.name, result)
        lost = _context_lost(device)
        if lost is not None:
            entry = _died(backend, cc.key, f"the CUDA context was lost verifying this class: {lost}", workers)
        elif not result.unsupported:
            store.put(backend, device, [result.to_record(source="verify", quick=args.quick)])
        entries.append(entry)
        if args.progress is not None:
            with open(args.progress, "a") as handle:  # one line a class, flushed on close
                handle.write(json.dumps(entry, default=_json_default) + "\n")
        if not err.is_terminal:  # no live bar in a log: one line per class, with its seconds
            err.print(
                f"{done}/{len(pairs)} {backend.name} {cc.key}: {entry['status']} {entry['worst_ratio']} "
                f"({time.perf_counter() - class_started:.1f} s) {(entry['reason'] or '')[:200]}",
                highlight=False,
            )
        progress.advance(task)
        if lost is not None:
            workers.run(device.index or 0, [(b.name, c.key) for b, c in pairs[done:]], "rest")
            return


def _context_lost(device: torch.device) -> str | None:
    """Why `device`'s CUDA context can no longer run anything (a sticky error), or None."""
    if device.type != "cuda":
        return None
    try:
        torch.cuda.synchronize(device)
    except RuntimeError as error:
        return str(error).splitlines()[0]
    return None


class _Workers:
    """Child processes that verify pairs (`python -m kda.verify` with `--progress`), and what to do when
    one dies.

    A worker that dies (a GPU fault can end its process, and leaves its CUDA context unusable) loses
    nothing it finished: each class's result is a line of its progress file as soon as it is known. The
    first pair it had not finished is the one it died on: that class fails for that backend, with a record
    saying so (so that the dispatcher does not verify it again in a user's process, where it would fault
    again). What it had not reached runs in a fresh worker, and so on until every pair has a result.
    Records go to the shared store, whose writes are locked and atomic. `entries` fills as results come
    in; `stop` (a stopped run) ends the live workers and adds what they had written."""

    def __init__(self, args, runnable, device: torch.device, progress, task, store, skip: set[Pair]) -> None:
        self.args, self.device, self.progress, self.task, self.store = args, device, progress, task, store
        self.skip = skip  # pairs already recorded (--missing): neither run nor handed to a worker
        self.backends = {b.name: b for b in runnable}
        self.gpus = torch.cuda.device_count() if device.type == "cuda" else 0
        self._scratch: Path | None = args.work_dir
        self.entries: list[dict[str, Any]] = []
        self.live: dict[subprocess.Popen, str] = {}  # running workers and their output names

    @property
    def scratch(self) -> Path:
        if self._scratch is None:
            self._scratch = Path(tempfile.mkdtemp(prefix="kda-verify-"))
        self._scratch.mkdir(parents=True, exist_ok=True)
        return self._scratch

    def spread(self, classes: list[Any]) -> None:
        """The classes spread over `--jobs` workers at once, round robin (each verifies every backend on its
        share, on one GPU), then each worker's leftovers, if it died, in fresh ones."""
        jobs = self.args.jobs
        shares = [
            (i, [(b, cc.key) for b in self.backends for cc in classes[i::jobs] if (b, cc.key) not in self.skip])
            for i in range(jobs)
        ]
        children = [(i, pairs, self.launch(i, pairs, f"part-{i}")) for i, pairs in shares if pairs]
        for i, pairs, child in children:
            found, left = self.collect(child, pairs, f"part-{i}")
            self.entries += found
            if left:
                self.entries.append(self.dead(i, child, left[0], f"part-{i}"))
                self.run(i, left[1:], f"part-{i}-rest")
            self.progress.update(self.task, description=f"worker {i} done")

    def run(self, slot: int, pairs: list[Pair], tag: str) -> None:
        """Verify `pairs` in workers on GPU `slot`, one after another: a worker for the first backend's
        classes (what is left need not be every backend on every class), a fresh one after any death."""
        for n in range(len(pairs)):
            if not pairs:
                break
            batch = [pair for pair in pairs if pair[0] == pairs[0][0]]
            name = f"{tag}-{n}"
            child = self.launch(slot, batch, name)
            found, left = self.collect(child, batch, name)
            self.entries += found
            if left:
                self.entries.append(self.dead(slot, child, left[0], name))
                left = left[1:]
            pairs = left + [pair for pair in pairs if pair[0] != batch[0][0]]

    def stop(self) -> None:
        """End the live workers (the signal that stopped this run may have reached them too) and add what
        they had written; a worker that does not end within ten seconds is killed."""
        for child in self.live:
            if child.poll() is None:
                child.terminate()
        for child, name in list(self.live.items()):
            try:
                child.wait(timeout=10)
            except subprocess.TimeoutExpired:
                child.kill()
                child.wait()
            self.entries += _read_results(self.scratch / f"{name}.json", self.scratch / f"{name}.jsonl")
        self.live.clear()

    def launch(self, slot: int, pairs: list[Pair], name: str) -> subprocess.Popen:
        args, scratch = self.args, self.scratch
        for stale in (scratch / f"{name}.json", scratch / f"{name}.jsonl"):
            stale.unlink(missing_ok=True)
        command = [sys.executable, "-m", "kda.verify", "--json", str(scratch / f"{name}.json")]
        command += ["--progress", str(scratch / f"{name}.jsonl"), "--device", "cuda" if self.gpus else str(self.device)]
        command += [f"--backend={b}" for b in dict.fromkeys(b for b, _ in pairs)]
        command += [f"--case={key}" for key in dict.fromkeys(key for _, key in pairs)]
        command += ["--quick"] if args.quick else []
        command += ["--missing"] if args.missing else []  # its share's recorded pairs are the parent's skip
        env = os.environ.copy()
        if self.gpus:
            env["CUDA_VISIBLE_DEVICES"] = str(slot % self.gpus)
        # The workers' CPU work (the float64 reference, compiles) shares the machine: without a cap each
        # one's torch would start a thread per core, args.jobs times over.
        env.setdefault("OMP_NUM_THREADS", str(max(1, (os.cpu_count() or 1) // max(args.jobs, 1))))
        with open(scratch / f"{name}.log", "w") as log:  # the child holds its own descriptor
            child = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT, env=env)
        self.live[child] = name
        return child

    def collect(self, child: subprocess.Popen, pairs: list[Pair], name: str) -> tuple[list[dict[str, Any]], list[Pair]]:
        """What the child verified, and the pairs it left without a result (in its order)."""
        child.wait()
        del self.live[child]
        found = _read_results(self.scratch / f"{name}.json", self.scratch / f"{name}.jsonl")
        self.progress.update(self.task, advance=len(found))
        done = {(e["backend"], e["case_class"]) for e in found}
        return found, [pair for pair in pairs if pair not in done]

    def dead(self, slot: int, child: subprocess.Popen, pair: Pair, name: str) -> dict[str, Any]:
        """The failure of the pair a worker died on."""
        lines = (self.scratch / f"{name}.log").read_text(errors="replace").strip().splitlines()
        reason = f"the verify worker died (exit {child.returncode}) verifying this class: {' | '.join(lines[-3:])}"
        self.progress.console.print(f"[red]verify worker {slot}: {pair[0]} {pair[1]}: {reason}[/red]")
        self.progress.update(self.task, advance=1)
        return _died(self.backends[pair[0]], pair[1], reason, self)


def _read_results(final: Path, lines: Path) -> list[dict[str, Any]]:
    """A worker's results: its JSON report when it finished, else the lines it wrote as it went (a line cut
    short by its death is skipped). A stopped worker's classes "not run" are not results."""
    if final.exists():
        try:
            return [e for e in json.loads(final.read_text())["results"] if e["status"] != NOT_RUN]
        except (ValueError, KeyError, TypeError):
            pass
    found = []
    if lines.exists():
        for line in lines.read_text(errors="replace").splitlines():
            try:
                entry = json.loads(line)
            except ValueError:
                continue
            if isinstance(entry, dict) and {"backend", "case_class", "status"} <= set(entry):
                found.append(entry)
    return found


def _died(backend, key: str, reason: str, workers: _Workers) -> dict[str, Any]:
    """The report entry, and the stored failing record, of a class whose verification ended its process or
    its CUDA context."""
    case = {"passed": False, "unsupported": False, "errors": {}, "problems": [reason], "reason": reason}
    device, quick = workers.device, workers.args.quick
    workers.store.put(
        backend, device, [Record(case_class=key, source="verify", quick=quick, device_type=device.type, cases=[case])]
    )
    return {
        "backend": backend.name,
        "case_class": key,
        "status": "fail",
        "worst_ratio": None,
        "reason": reason,
        "cases": [case],
    }


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
