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


def instrument(times: dict[str, list[float]], sync_each: bool, moved: dict[str, int] | None = None) -> None:
    """Wrap `runtime.launch` so that each launch is timed by CUDA events (read after the call); with `moved`,
    each kernel's argument bytes in one call are kept there too."""
    plain = runtime.launch
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
            for name, ms in sorted(medians.items(), key=lambda item: -item[1]):
                rate = moved.get(name, 0) / (ms * 1e-3) / 1e12 if ms > 0 else 0.0
                megabytes = moved.get(name, 0) / 1e6
                print(f"  {name:16s} {ms:8.3f} ms  {100 * ms / total:5.1f}%  {megabytes:9.1f} MB  {rate:5.2f} TB/s")
            print(f"  {'sum':16s} {total:8.3f} ms", flush=True)
            # the call itself, as events see it and as the bench times it (do_bench: back to back, L2 flushed),
            # so that time outside the launches shows here, in one process
            print(f"  {'call (events)':16s} {statistics.median(calls):8.3f} ms", flush=True)
            if not args.sync_each:
                print(f"  {'call (bench)':16s} {median_ms(run, torch.device('cuda')):8.3f} ms", flush=True)
            times.clear()


if __name__ == "__main__":
    sys.exit(main())
