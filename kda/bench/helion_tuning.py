"""`python -m kda.bench --tune-kernels helion`: measure launch configurations for the helion backend's
kernels on this GPU and write them as a table `kda.backends.helion.configs` reads.

For each shape and mode, one call of the helion backend is recorded: every kernel launch with its
arguments. Each kernel's default configuration is timed first, and the kernels are then tuned slowest
first (a training step's time sits in three of its thirteen launches, so a short budget goes there), each on
its own recorded arguments by a coordinate search from Helion's default configuration: one setting at a
time (each block size over 32, 64 and 128, ``num_warps`` over 4 and 8, ``num_stages`` over 1 and 2: each
candidate is a compilation of seconds), keeping the fastest (median of CUDA-event timings, warm-up
excluded) before the next setting. A candidate that does not compile or fails is skipped. The search stops
at the time budget and writes what it has; entries are keyed like the table (``K``, ``V``, chunk size, half
storage).

It reaches into the helion backend (its kernel launcher and table), the one part of the bench that does:
tuning a backend's kernels is knowing them (`tests/test_layers.py` lists the exception).

Kernels that write into their inputs (the state pass writes ``v_new`` over ``u``; the score backward adds
into its gradients) are timed on the recorded buffers as they are: their values change from run to run,
the work does not.
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

import kda
from kda.backends.helion import configs, forward, runtime
from kda.bench.timing import median_ms
from kda.workloads import MODES, BenchShape, make_inputs

Launch = tuple[Callable[..., Any], str, tuple[Any, ...], configs.ShapeKey]


def record_launches(shape: str, mode: str, device: torch.device) -> list[Launch]:
    """Every kernel launch of one helion call (forward, and backward for a training mode), run for real."""
    recorded: list[Launch] = []
    real_launch = runtime.launch

    def recording(fn, precision, args, key) -> None:
        recorded.append((fn, precision, args, key))
        real_launch(fn, precision, args, key)

    bench = make_inputs(BenchShape.parse(shape), MODES[mode], device, seed=0)

    def call() -> None:
        o, *_ = kda.chunk_kda(**bench.kwargs, backend="helion")
        if bench.do is not None:
            o.backward(bench.do)
        torch.cuda.synchronize(device)

    call()  # first: verification of the case class (its own small launches) and compilation, not recorded
    runtime.launch = recording  # type: ignore[assignment]
    try:
        call()
    finally:
        runtime.launch = real_launch
    return recorded


def _time(fn, precision: str, args: tuple[Any, ...], config: Any, device: torch.device) -> float | None:
    import helion

    try:
        kernel = helion.kernel(fn, config=config, static_shapes=False, dot_precision=precision)
        kernel(*args)
        torch.cuda.synchronize(device)
        return median_ms(lambda: kernel(*args), device, warmup_ms=10, rep_ms=60)
    except Exception:
        return None


def _axes(config: dict[str, Any]) -> list[tuple[str, int | None, list[int]]]:
    axes: list[tuple[str, int | None, list[int]]] = []
    for slot in range(len(config.get("block_sizes", []))):
        axes.append(("block_sizes", slot, [32, 64, 128]))
    axes.append(("num_warps", None, [4, 8]))
    axes.append(("num_stages", None, [1, 2]))
    return axes


def default_of(launch: Launch, device: torch.device) -> tuple[dict[str, Any], float]:
    """Helion's default configuration for one recorded launch, and its ms (inf where it fails)."""
    import helion

    fn, precision, args, _ = launch
    bound = runtime._kernel(fn, precision, False).bind(args)
    config = json.loads(bound.config_spec.default_config().to_json())
    return config, _time(fn, precision, args, helion.Config(**config), device) or float("inf")


def tune_launch(
    launch: Launch, start: tuple[dict[str, Any], float], device: torch.device, deadline: float
) -> tuple[dict[str, Any], float]:
    """(best config, its ms) for one recorded launch, by coordinate search from `start` (config, ms)."""
    import helion

    fn, precision, args, _ = launch
    best, best_ms = start
    for name, slot, values in _axes(best):
        for value in values:
            if time.monotonic() > deadline:
                return best, best_ms
            trial = json.loads(json.dumps(best))
            if slot is None:
                if trial.get(name) == value:
                    continue
                trial[name] = value
            else:
                if trial[name][slot] == value:
                    continue
                trial[name][slot] = value
            ms = _time(fn, precision, args, helion.Config(**trial), device)
            if ms is not None and ms < best_ms:
                best, best_ms = trial, ms
    return best, best_ms


def problem() -> str | None:
    """Why the kernels cannot be tuned here, or None."""
    if not torch.cuda.is_available():
        return "needs a CUDA GPU"
    return runtime.helion_problem()


def tune(shapes: list[str], modes: list[str], budget_s: float, out: Path | None, log: Callable[[str], None]) -> Path:
    """Tune every kernel at each (shape, mode) until the budget is spent; write the table to `out` (default:
    the table shipped in the package for this GPU)."""
    device = torch.device("cuda")
    out = out or configs.shipped_table_path(forward.arch(device))
    deadline = time.monotonic() + budget_s
    table: dict[str, list[dict[str, Any]]] = {}
    if out.is_file():
        try:
            table = json.loads(out.read_text())
        except ValueError:
            table = {}
    pending: list[tuple[Launch, str, str, dict[str, Any]]] = []  # launch, shape, mode, entry key
    began = time.monotonic()
    for shape in shapes:
        for mode in modes:
            recorded = record_launches(shape, mode, device)
            log(f"recorded {len(recorded)} launches at {shape} {mode} ({time.monotonic() - began:.0f} s so far)")
            for launch in recorded:
                fn, _, _, key = launch
                entry_key = configs.entry_key(key)
                known = table.get(fn.__name__, []) + [e for (f, *_), _s, _m, e in pending if f.__name__ == fn.__name__]
                if not any(configs.matches(e, key, chunk=True) for e in known):
                    pending.append((launch, shape, mode, entry_key))  # not tuned yet, nor twice in one call
    defaults = [default_of(launch, device) for launch, *_ in pending]
    order = sorted(range(len(pending)), key=lambda i: -defaults[i][1])  # the slowest first
    # what the next run's budget needs: where this one's time went before the search, and in what order
    ranking = ", ".join(f"{pending[i][0][0].__name__} {defaults[i][1]:.3f} ms" for i in order)
    log(f"defaults timed ({time.monotonic() - began:.0f} s so far), slowest first: {ranking}")
    for position, index in enumerate(order):
        if time.monotonic() > deadline:
            left = ", ".join(pending[i][0][0].__name__ for i in order[position:])
            log(f"budget of {budget_s:.0f} s spent; not tuned: {left}")
            break
        launch, shape, mode, entry_key = pending[index]
        name = launch[0].__name__
        searched = time.monotonic()
        config, ms = tune_launch(launch, defaults[index], device, deadline)
        default_ms = defaults[index][1]
        if ms == float("inf"):  # nothing compiled and ran: no entry
            log(f"{name:24s} {shape} {mode}: no configuration ran")
            continue
        entry = {**entry_key, "shape": shape, "ms": round(ms, 4), "default_ms": round(default_ms, 4), "config": config}
        table.setdefault(name, []).append(entry)
        log(f"{name:24s} {shape} {mode}: {default_ms:.3f} -> {ms:.3f} ms ({time.monotonic() - searched:.0f} s)")
    out.write_text(json.dumps(table, indent=1, sort_keys=True) + "\n")
    return out
