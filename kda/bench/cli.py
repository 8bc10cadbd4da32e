"""``python -m kda.bench``: every available backend side by side, with FLA and FlashKDA as baselines.

    python -m kda.bench                                   # every shape, mode and available backend
    python -m kda.bench --shape B1_T8192_H96_D128 --mode fwd --backend flashkda --backend auto
    python -m kda.bench --tune                            # also record the timing table `auto` ranks by
    python -m kda.bench --jobs 4                          # shapes spread over 4 processes, one GPU each
    python -m kda.bench --chart benchmarks/results/nvidia-h200/0.1.0/results.json
    python -m kda.bench --merge part1/results.json part2/results.json --out merged/

Writes ``results.json``, ``results.md`` and ``pct_fla.png`` under ``benchmarks/raw/<gpu>/<date>/``
(or ``--out``) and prints a table. Exit status 0 when every row that ran succeeded, 1 when a row failed
or the run was interrupted (SIGTERM or Ctrl-C: the rows finished so far are still written, marked so).
``results.json`` and ``results.md`` are also rewritten as each row finishes, so that a run killed where
no handler runs (SIGKILL, or SIGTERM during a long compile) leaves its finished rows.

``--jobs N`` keeps shapes that share compile-time constants (heads, head dim, varlen) in one process, so
that a JIT backend compiles and tunes each set once, and balances those groups over the processes.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import signal
import subprocess
import sys
import tempfile
import threading
from collections.abc import Callable
from pathlib import Path

import torch
from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

from kda import cliargs, registry, store
from kda.bench import results
from kda.bench.runner import BASELINES, BenchConfig, Row, fla_paths, logger, run
from kda.bench.shapes import DEFAULT_SHAPES, MODES, BenchShape
from kda.workloads import DENSE_SHAPES

PROG = "python -m kda.bench"


class _ConsoleHandler(logging.Handler):
    """The bench's own log lines on its stderr console, beside the progress bar."""

    def __init__(self, console: Console) -> None:
        super().__init__(logging.INFO)
        self.console = console

    def emit(self, record: logging.LogRecord) -> None:
        self.console.print(record.getMessage(), highlight=False, markup=False)


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog=PROG,
        description=__doc__.split("\n\n")[0],
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument(
        "--backend",
        action="append",
        default=[],
        metavar="NAME",
        help="a kda backend, 'auto', 'baseline:fla', 'baseline:flashkda' or 'baseline:fla-tilelang' (FLA with "
        "its TileLang stage as installed; named only) (repeatable; default: every available backend, auto, and "
        "the first two baselines where installed)",
    )
    parser.add_argument(
        "--shape",
        action="append",
        default=[],
        metavar="NAME",
        help="B{b}_T{t}_H{h}_D{d} or varlen_H{h}_D{d}_L{lengths} (repeatable; default: the 12 bench shapes)",
    )
    parser.add_argument(
        "--mode",
        action="append",
        default=[],
        choices=[*sorted(MODES), "decode"],
        help="fwd, fwd_pregated, train_pregated or train_safe (repeatable; default: all four); or decode "
        "alone: the decode op (fused_recurrent_kda) against the memory floor, shapes N{n}_T{t}_HV{h}_D{d}_{fp32|bf16}",
    )
    parser.add_argument("--device", default=None, help="default: cuda if present, else cpu")
    parser.add_argument(
        "--out",
        type=Path,
        default=None,
        help="default: benchmarks/raw/<gpu>/<date> (not tracked; benchmarks/snapshot.py curates)",
    )
    parser.add_argument(
        "--cold-start",
        choices=("none", "first", "all"),
        default="first",
        help="time the first call in a fresh process: at the first shape (default), every shape, or never",
    )
    parser.add_argument(
        "--tune", action="store_true", help="record the kda backends' timings in this GPU's timing table (used by auto)"
    )
    parser.add_argument(
        "--jobs", type=int, default=1, help="processes to spread shapes over, one GPU each (round robin)"
    )
    parser.add_argument("--warmup-ms", type=float, default=50)
    parser.add_argument("--rep-ms", type=float, default=300)
    parser.add_argument(
        "--rounds", type=int, default=3, help="time every row this many times, in rotated orders, and report the median"
    )
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument(
        "--chart",
        type=Path,
        metavar="RESULTS_JSON",
        help="only redraw results.md and pct_fla.png from an existing results.json",
    )
    parser.add_argument(
        "--merge",
        type=Path,
        nargs="+",
        metavar="RESULTS_JSON",
        help="combine the rows of several results.json files (same GPU and versions) into --out",
    )
    parser.add_argument(
        "--graph",
        action="store_true",
        help="--mode decode: also time every row as CUDA-graph replays, as a serving engine runs its decode step",
    )
    parser.add_argument("--list-shapes", action="store_true", help="print the default shapes and exit")
    parser.add_argument(
        "--tune-kernels",
        choices=["helion"],
        default=None,
        help="measure launch configurations for a backend's kernels at --shape (default: the six dense shapes) "
        "in --mode (default: fwd and train_safe) within --tune-budget-s, and write the table to --table",
    )
    parser.add_argument("--tune-budget-s", type=float, default=600.0, help="--tune-kernels: time budget (s)")
    parser.add_argument(
        "--table",
        type=Path,
        default=None,
        help="--tune-kernels: the table to write (default: the one shipped in the package for this GPU); "
        "point KDA_HELION_CONFIGS at any other",
    )
    # Internal: a worker of --jobs runs its share and streams rows to stdout as JSON lines.
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--first-shape", default=None, help=argparse.SUPPRESS)
    return parser


def _default_backends() -> list[str]:
    names = [*registry.available_backends(), "auto"]
    for baseline, module in (("baseline:fla", "fla"), ("baseline:flashkda", "flash_kda")):
        try:
            __import__(module)
            names.append(baseline)
        except Exception:
            pass
    return names


# Each baseline's kda backend: the same library's kernels called through `kda.chunk_kda`. `auto` ranks by speed
# only the backends timed together, and one left untimed keeps its priority place (`kda.timings.rank`), so a
# `--tune` run that times a baseline times its kda backend beside it (an H100 run that timed `baseline:fla`
# without `fla` left `fla`, untimed, in its place above a verified tilelang backend 1.7 times as fast).
KDA_TWINS = {"baseline:fla": "fla", "baseline:fla-tilelang": "fla", "baseline:flashkda": "flashkda"}


def with_kda_twins(backends: list[str], available: list[str]) -> tuple[list[str], list[str]]:
    """``backends`` and, after them, the available kda backend of each baseline named that is not named
    itself; and those added."""
    added = [twin for name in backends if (twin := KDA_TWINS.get(name)) in available and twin not in backends]
    added = list(dict.fromkeys(added))
    return [*backends, *added], added


def _check_names(args: argparse.Namespace, err: Console) -> bool:
    known = {b.name for b in registry.registered_backends()} | {"auto", *BASELINES}
    bad = [b for b in args.backend if b not in known]
    if bad:
        err.print(f"[red]unknown backend(s) {bad}; known: {', '.join(sorted(known))}[/red]")
        return False
    for name in args.shape:
        try:
            BenchShape.parse(name)
        except ValueError as error:
            err.print(f"[red]{error}[/red]")
            return False
    return True


def _usage_problem(args: argparse.Namespace) -> str | None:
    """What makes these arguments unusable (checked before any work), or None."""
    if problem := cliargs.settings_problem():
        return problem
    numbers = [
        ("--jobs", args.jobs, 1, None),
        ("--rounds", args.rounds, 1, None),
        ("--warmup-ms", args.warmup_ms, 0, None),
        ("--rep-ms", args.rep_ms, None, 0),
        ("--tune-budget-s", args.tune_budget_s, None, 0),
    ]
    for option, value, at_least, above in numbers:
        if problem := cliargs.number_problem(option, value, at_least=at_least, above=above):
            return problem
    reads = [("--chart", args.chart)] if args.chart is not None else []
    reads += [("--merge", path) for path in args.merge or []]
    for option, path in reads:
        problem = cliargs.input_file_problem(option, path)
        if problem:
            return problem
    if args.device is not None and (problem := cliargs.device_problem(args.device)):
        return problem
    if args.out is not None and (problem := cliargs.output_dir_problem("--out", args.out)):
        return problem
    if args.tune and not (args.chart or args.merge or args.list_shapes):
        folder = store.cache_root() / "timings"
        try:
            store.probe_writable(folder)
        except OSError as error:
            why = f"{type(error).__name__}: {error}"
            return f"--tune: cannot write the timing table in {folder} ({why}); set KDA_CACHE_DIR to a writable folder"
    return None


def _read_results(option: str, path: Path) -> dict | str:
    """A results.json file's contents, or what is wrong with it."""
    try:
        data = json.loads(path.read_text())
    except (OSError, ValueError, RecursionError) as error:
        return f"{option} {path}: not a results.json ({type(error).__name__}: {error})"
    return data if isinstance(data, dict) else f"{option} {path}: not a results.json (no JSON object)"


def _tune_kernels(args: argparse.Namespace, out: Console, err: Console) -> int:
    """`--tune-kernels helion` (`kda.bench.helion_tuning`)."""
    from kda.bench import helion_tuning

    problem = helion_tuning.problem()
    if problem is not None:
        return cliargs.usage_error(PROG, f"--tune-kernels helion: {problem}")
    shapes = args.shape or DENSE_SHAPES
    modes = args.mode or ["fwd", "train_safe"]
    log = lambda line: err.print(line, markup=False)  # noqa: E731
    written = helion_tuning.tune(shapes, modes, args.tune_budget_s, args.table, log)
    out.print(f"wrote {written}")
    return 0


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    problem = _usage_problem(args)
    if problem:
        return cliargs.usage_error(PROG, problem)
    out = Console(soft_wrap=True)
    err = Console(stderr=True)
    if args.tune_kernels:
        return _tune_kernels(args, out, err)
    if args.list_shapes:
        for name in DEFAULT_SHAPES:
            out.print(name)
        return 0
    if args.chart is not None:
        data = _read_results("--chart", args.chart)
        if isinstance(data, str):
            return cliargs.usage_error(PROG, data)
        paths = results.write(data, args.chart.parent)
        out.print(f"wrote {', '.join(str(p) for p in paths.values())}")
        return 0
    if args.merge:
        parts = [_read_results("--merge", path) for path in args.merge]
        bad = next((part for part in parts if isinstance(part, str)), None)
        if bad is not None:
            return cliargs.usage_error(PROG, bad)
        return _merge(args.merge, parts, args.out, out, err)  # type: ignore[arg-type]
    if args.graph and "decode" not in args.mode:
        return cliargs.usage_error(PROG, "--graph times the decode op's rows: it needs --mode decode")
    if "decode" in args.mode:  # the decode op: its own shapes, rows and floor (kda.bench.decode)
        if len(set(args.mode)) > 1:
            return cliargs.usage_error(PROG, "--mode decode runs on its own (its shapes are decode shapes)")
        from kda.bench.decode import main_decode

        return main_decode(args, out, err)
    if not _check_names(args, err):
        return 2
    device = torch.device(args.device or ("cuda" if torch.cuda.is_available() else "cpu"))
    shapes = args.shape or list(DEFAULT_SHAPES)
    modes = args.mode or list(MODES)
    backends = args.backend or _default_backends()
    if args.tune and not args.worker:
        backends, twins = with_kda_twins(backends, registry.available_backends())
        if twins:
            err.print(
                f"--tune: timing {', '.join(twins)} too, the kda backend of a baseline named: `auto` ranks by "
                "speed only what is timed together",
                soft_wrap=True,
            )
    settings = {
        "shapes": shapes,
        "modes": modes,
        "backends": backends,
        "cold_start": args.cold_start,
        "tune": args.tune,
        "warmup_ms": args.warmup_ms,
        "rep_ms": args.rep_ms,
        "rounds": args.rounds,
        "seed": args.seed,
        "jobs": args.jobs,
        "KDA_VERIFY": os.environ.get("KDA_VERIFY", "lazy"),
        "fla_paths": fla_paths(),
    }
    config = BenchConfig(
        shapes,
        modes,
        backends,
        device,
        cold_start=args.cold_start,
        first_shape=args.first_shape or shapes[0],
        tune=args.tune,
        warmup_ms=args.warmup_ms,
        rep_ms=args.rep_ms,
        rounds=args.rounds,
        seed=args.seed,
    )

    if args.worker:  # stream rows to the parent; the log lines go to the worker's log file (stderr)
        logger.addHandler(_ConsoleHandler(err))
        logger.setLevel(logging.INFO)
        run(config, on_row=lambda row: print("ROW " + json.dumps(row.as_json()), flush=True))
        return 0
    if args.tune:
        untimed = [name for name in registry.available_backends() if name not in backends]
        if untimed:  # `auto` ranks by speed only what was timed together (kda.timings.rank)
            err.print(
                f"[yellow]--tune: not timed in this run, though `auto` can choose them here: {', '.join(untimed)}. "
                "Without a timing a backend keeps its priority place (add it with --backend to rank it by "
                "speed).[/yellow]",
                soft_wrap=True,
            )

    signal.signal(signal.SIGTERM, _interrupt)
    total = len(shapes) * len(modes)
    rows: list[Row] = []
    out_dir = args.out or results.default_out_dir(device)
    header = results.payload([], device, settings)
    expected_rows = total * len(backends)

    def save_so_far() -> None:  # after every row: what a kill from outside leaves (see results.write_so_far)
        finished = sorted(rows, key=_row_order(config))
        results.write_so_far({**header, "rows": [r.as_json() for r in finished]}, out_dir, expected_rows)

    spent_log = _ConsoleHandler(err)  # where each shape's time went (`runner._Spent`), one line a shape
    logger.addHandler(spent_log)
    logger.setLevel(logging.INFO)
    with Progress(
        TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(), console=err
    ) as progress:
        task = progress.add_task("bench", total=total)
        try:
            if args.jobs > 1:
                _run_jobs(args, config, progress, task, rows, save_so_far)
            else:
                done: set[tuple[str, str]] = set()

                def on_row(row: Row) -> None:
                    rows.append(row)
                    save_so_far()
                    if not err.is_terminal:  # no live bar in a log: one line per row instead
                        err.print(
                            f"{row.shape} {row.mode} {row.backend}: {row.status} {row.median_ms} ms "
                            f"cold={row.cold_start_s} {(row.reason or '')[:160]}",
                            highlight=False,
                        )
                    if (row.shape, row.mode) not in done:
                        done.add((row.shape, row.mode))
                        progress.update(task, advance=1, description=f"{row.shape} {row.mode}")

                run(config, on_row=on_row)
        except KeyboardInterrupt:
            settings["interrupted"] = True
            err.print(f"[yellow]interrupted: writing the {len(rows)} rows finished so far[/yellow]")
        finally:
            logger.removeHandler(spent_log)
        rows.sort(key=_row_order(config))

    data = results.payload(rows, device, settings)
    paths = results.write(data, out_dir)
    out.print(results.terminal_table(data))
    out.print(f"wrote {', '.join(str(p) for p in paths.values())}")
    failed = [r for r in rows if r.status == "error"]
    for row in failed:
        out.print(f"[red]error[/red] {row.shape} {row.mode} {row.backend}: {row.reason}")
    return 1 if failed or settings.get("interrupted") else 0


def _interrupt(signum, frame) -> None:
    raise KeyboardInterrupt


def _row_order(config: BenchConfig):
    order = {(s, m): n for n, (s, m) in enumerate((s, m) for s in config.shapes for m in config.modes)}
    backend_order = {b: n for n, b in enumerate(config.backends)}
    return lambda r: (
        order.get((r.shape, r.mode), 1 << 30),
        r.kind == "auto",
        r.kind != "baseline",
        backend_order.get(r.backend, 1 << 30),
    )


COMPILE_WEIGHT = 4  # FLA at a new set of constants: minutes of compiling and tuning, vs seconds a shape


def compile_groups(shapes: list[str], jobs: int) -> list[list[str]]:
    """Split shapes over `jobs` processes: shapes with the same heads, head dim and layout (the constants
    a JIT backend compiles and tunes for) stay together; groups go to the least loaded process, costliest
    first, a group costing one compile (weighted as COMPILE_WEIGHT shapes) plus its shapes; the first
    shape's group goes to process 0. Order within a process follows `shapes`."""
    groups: dict[tuple[int, int, bool], list[str]] = {}
    for name in shapes:
        shape = BenchShape.parse(name)
        groups.setdefault((shape.H, shape.D, shape.varlen), []).append(name)
    ordered = list(groups.values())
    first, rest = ordered[0], sorted(ordered[1:], key=len, reverse=True)
    shares: list[list[str]] = [[] for _ in range(max(1, jobs))]
    shares[0] += first
    load = [COMPILE_WEIGHT + len(first)] + [0] * (len(shares) - 1)
    for group in rest:
        i = min(range(len(shares)), key=lambda j: (load[j], j))
        shares[i] += group
        load[i] += COMPILE_WEIGHT + len(group)
    position = {name: n for n, name in enumerate(shapes)}
    return [sorted(share, key=position.__getitem__) for share in shares if share]


def _merge(paths: list[Path], parts: list[dict], out_dir: Path | None, out: Console, err: Console) -> int:
    first = parts[0]
    mixed = results.mixed_runs(parts)
    if mixed is not None:
        err.print(f"[red]{paths[mixed]} was measured on another GPU or with other versions; not merging[/red]")
        return 2
    data = {
        **first,
        "settings": {"merged_from": [str(p) for p in paths], "runs": [p["settings"] for p in parts]},
        "rows": [row for part in parts for row in part["rows"]],
    }
    target = out_dir or paths[0].parent.parent
    written = results.write(data, target)
    out.print(results.terminal_table(data))
    out.print(f"wrote {', '.join(str(p) for p in written.values())}")
    return 0


def _run_jobs(
    args: argparse.Namespace,
    config: BenchConfig,
    progress: Progress,
    task,
    rows: list[Row],
    save_so_far: Callable[[], None],
) -> None:
    """Spread shapes over `args.jobs` worker processes, each on its own GPU (round robin); rows arrive
    in `rows` as the workers finish them (and `save_so_far` writes them)."""
    gpus = torch.cuda.device_count() if config.device.type == "cuda" else 0
    shares = compile_groups(config.shapes, args.jobs)
    lock = threading.Lock()
    workers = []
    logs = Path(tempfile.mkdtemp(prefix="kda-bench-"))
    for i, share in enumerate(s for s in shares if s):
        command = [
            sys.executable,
            "-m",
            "kda.bench",
            "--worker",
            "--first-shape",
            config.shapes[0],
            "--cold-start",
            args.cold_start,
            "--warmup-ms",
            str(args.warmup_ms),
            "--rep-ms",
            str(args.rep_ms),
            "--rounds",
            str(args.rounds),
            "--seed",
            str(args.seed),
            "--device",
            "cuda" if gpus else str(config.device),
        ]
        command += [f"--backend={b}" for b in config.backends] + [f"--mode={m}" for m in config.modes]
        command += [f"--shape={s}" for s in share] + (["--tune"] if args.tune else [])
        env = os.environ.copy()
        if gpus:
            env["CUDA_VISIBLE_DEVICES"] = str(i % gpus)
        log = open(logs / f"worker-{i}.log", "w")  # noqa: SIM115 - closed when its worker is collected
        workers.append((subprocess.Popen(command, stdout=subprocess.PIPE, stderr=log, text=True, env=env), log))

    def collect(proc: subprocess.Popen) -> None:
        seen: set[tuple[str, str]] = set()
        for line in proc.stdout:  # type: ignore[union-attr]
            if line.startswith("ROW "):
                row = Row(**json.loads(line[4:]))
                with lock:
                    rows.append(row)
                    save_so_far()
                    if (row.shape, row.mode) not in seen:
                        seen.add((row.shape, row.mode))
                        progress.update(task, advance=1, description=f"{row.shape} {row.mode}")

    threads = [threading.Thread(target=collect, args=(proc,), daemon=True) for proc, _ in workers]
    for thread in threads:
        thread.start()
    try:
        for thread in threads:
            while thread.is_alive():
                thread.join(timeout=0.5)  # short waits, so that SIGTERM reaches the main thread
    except KeyboardInterrupt:
        for proc, _ in workers:
            proc.terminate()
        raise
    for i, (proc, log) in enumerate(workers):
        proc.wait()
        log.close()
        if proc.returncode != 0:
            tail = (logs / f"worker-{i}.log").read_text().strip().splitlines()[-3:]
            progress.console.print(f"[red]bench worker {i} exited {proc.returncode}[/red]: {' | '.join(tail)}")
