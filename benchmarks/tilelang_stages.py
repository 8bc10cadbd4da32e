"""The tilelang backend's GPU time per kernel, at bench shapes (GPU only).

    KDA_VERIFY=off python benchmarks/tilelang_stages.py --mode fwd --mode fwd_pregated B1_T8192_H96_D128

Runs the bench's own callable (`kda.bench.runner.call_for`, so exactly what the bench times) with each of
the forward's three kernels wrapped in CUDA events, and prints each kernel's median GPU milliseconds per
call, its share, and the bytes it must move at least (its inputs read once, its outputs written once)
over that time, against the H200's ~4.3 TB/s copy rate measured here.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from collections import defaultdict

import torch

from kda.backends.tilelang import forward
from kda.bench.runner import call_for
from kda.bench.shapes import MODES, BenchShape, make_inputs


def _nbytes(args: tuple) -> int:
    return sum(x.numel() * x.element_size() for x in args if isinstance(x, torch.Tensor))


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("shapes", nargs="+")
    parser.add_argument("--mode", action="append", required=True, choices=["fwd", "fwd_pregated"])
    parser.add_argument("--steps", type=int, default=20)
    args = parser.parse_args()
    pending: list[tuple[str, int, torch.cuda.Event, torch.cuda.Event]] = []
    real = forward.compile_all

    def timed(spec):
        def wrap(name, kernel):
            def run(*call_args):
                start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                start.record()
                kernel(*call_args)
                end.record()
                pending.append((name, _nbytes(call_args), start, end))

            return run

        return {name: wrap(name, kernel) for name, kernel in real(spec).items()}

    forward.compile_all = timed  # type: ignore[assignment]
    for shape_name in args.shapes:
        for mode_name in args.mode:
            inputs = make_inputs(BenchShape.parse(shape_name), MODES[mode_name], "cuda", seed=0)
            run, why = call_for("tilelang", inputs, MODES[mode_name])
            if run is None:
                print(f"{shape_name} {mode_name}: not run ({why})")
                continue
            began = time.perf_counter()
            run()
            torch.cuda.synchronize()
            print(f"\n{shape_name} {mode_name}: first call {time.perf_counter() - began:.1f} s", flush=True)
            times: dict[str, list[float]] = defaultdict(list)
            moved: dict[str, int] = {}
            for _ in range(args.steps):
                pending.clear()
                run()
                torch.cuda.synchronize()
                for name, nbytes, start, end in pending:
                    times[name].append(start.elapsed_time(end))
                    moved[name] = nbytes
            medians = {name: statistics.median(ms) for name, ms in times.items()}
            total = sum(medians.values())
            for name, ms in sorted(medians.items(), key=lambda item: -item[1]):
                rate = moved[name] / (ms * 1e-3) / 1e12
                print(
                    f"  {name:8s} {ms:8.3f} ms  {100 * ms / total:5.1f}%  {moved[name] / 1e6:9.1f} MB  {rate:5.2f} TB/s"
                )
            print(f"  {'sum':8s} {total:8.3f} ms", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
