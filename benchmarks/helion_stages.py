"""The helion backend's GPU time per kernel, at bench shapes and modes (GPU only).

    KDA_VERIFY=off python benchmarks/helion_stages.py --mode fwd --mode train_safe B4_T2048_H16_D128
    KDA_VERIFY=off python benchmarks/helion_stages.py --sync-each --mode train_safe B1_T1024_H4_D256
    python benchmarks/helion_stages.py --sync-each --case safe/qk/sig2/fp16/varlen/gva/h0+ht/c64/d256/train

Runs the bench's own callable (`kda.bench.runner.call_for`, so exactly what the bench times) with every
Helion launch wrapped in CUDA events, and prints each kernel's median GPU milliseconds per call, its share
of the call, and the bytes of its tensor arguments (each storage once, summed over its launches in the
call) over that time: what it moves if it reads and writes each argument once, against the H200's ~4.3
TB/s copy rate. An upper bound where a kernel reads part of a tensor (the state pass reads ``G``'s last
row of each chunk) or gets a placeholder, a lower one where it reads a tile again (``scores`` reads each
chunk's columns once per strip). Then the whole call: by an event pair around it, and as the bench times it
(`kda.bench.timing.median_ms`), so that time outside the launches shows beside their sum in one process
(on an H100 a training call at B4_T2048_H16_D128 was its launches: 7.82 ms, their sum 8.22).
Each kernel is also replayed alone (``alone``): every launch of one recorded call timed back to back on its
own arguments, as `kda.bench --tune-kernels helion` times a candidate. An event pair around a launch in the
call also holds whatever the GPU waited for the host to issue it: where the host paces the call, the first
kernel after a wait takes the wait (on an H100 at B4_T2048_H16_D128 training, `output` 1.241 ms in the
call against 0.206 alone, `normalize` 0.250 against 0.034), so the column to read for a kernel's own time
is ``alone``, and the in-call column's excess over it is host time. Rates are over the ``alone`` time.
``--sync-each`` prints each kernel's name before it runs and synchronizes after it, so that an illegal
memory access names the kernel that made it. ``--case KEY`` runs a verification class's own
cases instead (`kda.verify.check.run_case`: its inputs, sizes and seeds, printed first), with the backend's
head-dim limit for training lifted: how a class the backend declines because a kernel faulted there is
brought back to the fault.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from collections import defaultdict
from collections.abc import Callable
from typing import Any

import torch

from kda.backends.helion import runtime
from kda.bench.runner import call_for
from kda.bench.shapes import MODES, BenchShape, make_inputs
from kda.bench.timing import median_ms


def argument_bytes(args: tuple) -> int:
    """The bytes of a launch's tensor arguments, each storage once (a placeholder is often a tensor the
    launch also reads)."""
    storages = {
        x.untyped_storage().data_ptr(): x.untyped_storage().nbytes() for x in args if isinstance(x, torch.Tensor)
    }
    return sum(storages.values())


Launch = tuple[str, Callable[..., Any], str, tuple, Any]  # kernel name, function, dot precision, args, table key


def replay_alone(
    recorded: list[Launch], launch: Callable[..., None], time_ms: Callable[..., float]
) -> dict[str, float]:
    """Per kernel, the milliseconds of its launches in one recorded call, each launch replayed alone on its own
    arguments (`time_ms(fn)`: median of back-to-back calls) and summed over the kernel's launches (``qk_tail``
    runs twice a call). Kernels that add into an argument change its values from run to run, not the work."""
    alone: dict[str, float] = defaultdict(float)
    for name, fn, precision, args, key in recorded:
        alone[name] += time_ms(lambda fn=fn, precision=precision, args=args, key=key: launch(fn, precision, args, key))
    return dict(alone)


def time_alone(fn: Callable[[], None]) -> float:
    """A launch's median ms, back to back (`median_ms`, shorter than the bench's: a call has a dozen)."""
    return median_ms(fn, torch.device("cuda"), rep_ms=100)


def instrument(times: dict[str, list[float]], sync_each: bool, moved: dict[str, int] | None = None) -> None:
    """Wrap `runtime.launch` so that each launch is timed by CUDA events (read after the call); with `moved`,
    each kernel's argument bytes in one call are kept there too. While `instrument.recording` is a list, each
    launch is also appended to it (`Launch`), for `replay_alone`."""
    plain = runtime.launch
    instrument.plain = plain  # type: ignore[attr-defined]
    instrument.recording = None  # type: ignore[attr-defined]
    pending: list[tuple[str, torch.cuda.Event, torch.cuda.Event]] = []
    per_call_bytes: dict[str, int] = defaultdict(int)

    def timed(fn, dot_precision, args, key) -> None:
        name = fn.__name__.removesuffix("_kernel")
        if sync_each:
            print(f"  launching {name}", flush=True)
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        plain(fn, dot_precision, args, key)
        end.record()
        pending.append((name, start, end))
        per_call_bytes[name] += argument_bytes(args)
        if instrument.recording is not None:  # type: ignore[attr-defined]
            instrument.recording.append((name, fn, dot_precision, args, key))  # type: ignore[attr-defined]
        if sync_each:
            torch.cuda.synchronize()

    def collect() -> None:
        torch.cuda.synchronize()
        per_call: dict[str, float] = defaultdict(float)
        for name, start, end in pending:
            per_call[name] += start.elapsed_time(end)
        for name, ms in per_call.items():
            times[name].append(ms)
        if moved is not None:
            moved.update(per_call_bytes)
        pending.clear()
        per_call_bytes.clear()

    runtime.launch = timed  # type: ignore[assignment]
    instrument.collect = collect  # type: ignore[attr-defined]


def run_class(key: str) -> None:
    """Every case of verification class `key` on the helion backend, its head-dim limits lifted."""
    import kda.backends.helion as helion_backend
    from kda.spec import CaseClass
    from kda.verify.cases import cases_for
    from kda.verify.check import run_case

    helion_backend.TRAINING_HEAD_DIM_LIMIT = helion_backend.HEAD_DIM_LIMIT  # `supports` reads it per call
    backend = helion_backend.HelionBackend()
    for case in cases_for(CaseClass.from_key(key), quick=False, long=True):
        print(f"case {case.describe()}", flush=True)
        result = run_case(backend, case, "cuda")
        verdict = "pass" if result.passed else f"FAIL {result.reason}"
        print(f"  {verdict}; errors {result.errors}; problems {result.problems}", flush=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("shapes", nargs="*")
    parser.add_argument("--mode", action="append", default=[], choices=sorted(MODES))
    parser.add_argument("--case", default=None, help="a verification class key: run its cases instead")
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--sync-each", action="store_true")
    args = parser.parse_args()
    if args.case is None and not (args.shapes and args.mode):
        parser.error("give shapes and --mode, or --case KEY")
    times: dict[str, list[float]] = defaultdict(list)
    moved: dict[str, int] = {}
    instrument(times, args.sync_each, moved)
    if args.case is not None:
        run_class(args.case)
        return
    for shape_name in args.shapes:
        for mode_name in args.mode:
            inputs = make_inputs(BenchShape.parse(shape_name), MODES[mode_name], "cuda", seed=0)
            run, why = call_for("helion", inputs, MODES[mode_name])
            if run is None:
                print(f"{shape_name} {mode_name}: not run ({why})")
                continue
            began = time.perf_counter()
            run()
            torch.cuda.synchronize()
            print(f"\n{shape_name} {mode_name}: first call {time.perf_counter() - began:.1f} s", flush=True)
            times.clear()
            instrument.collect()  # type: ignore[attr-defined]
            times.clear()
            calls: list[float] = []  # the whole call, by an event pair around it
            for _ in range(args.steps if not args.sync_each else 1):
                start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                start.record()
                run()
                end.record()
                instrument.collect()  # type: ignore[attr-defined]  (synchronizes)
                calls.append(start.elapsed_time(end))
            medians = {name: statistics.median(ms) for name, ms in times.items()}
            total = sum(medians.values())
            alone: dict[str, float] = {}
            if not args.sync_each:  # one more call recorded, each of its launches replayed alone
                recorded: list[Launch] = []
                instrument.recording = recorded  # type: ignore[attr-defined]
                run()
                instrument.recording = None  # type: ignore[attr-defined]
                instrument.collect()  # type: ignore[attr-defined]
                times.clear()
                alone = replay_alone(recorded, instrument.plain, time_alone)  # type: ignore[attr-defined]
            print(f"  {'kernel':16s} {'in call':>8s}     {'alone':>8s}     share  {'moved':>9s}     rate (alone)")
            whole = sum(alone.values()) if alone else total  # the share is of the kernels' own time
            for name, ms in sorted(medians.items(), key=lambda item: -alone.get(item[0], item[1])):
                own = alone.get(name, ms)
                rate = moved.get(name, 0) / (own * 1e-3) / 1e12 if own > 0 else 0.0
                megabytes = moved.get(name, 0) / 1e6
                shown = f"{alone[name]:8.3f} ms" if name in alone else f"{'':11s}"
                print(
                    f"  {name:16s} {ms:8.3f} ms  {shown}  {100 * own / whole:5.1f}%"
                    f"  {megabytes:9.1f} MB  {rate:5.2f} TB/s"
                )
            sum_alone = f"  {sum(alone.values()):8.3f} ms" if alone else ""
            print(f"  {'sum':16s} {total:8.3f} ms{sum_alone}", flush=True)
            # the call itself, as events see it and as the bench times it (do_bench: back to back, L2 flushed),
            # so that time outside the launches shows here, in one process
            print(f"  {'call (events)':16s} {statistics.median(calls):8.3f} ms", flush=True)
            if not args.sync_each:
                print(f"  {'call (bench)':16s} {median_ms(run, torch.device('cuda')):8.3f} ms", flush=True)
            times.clear()


if __name__ == "__main__":
    sys.exit(main())
