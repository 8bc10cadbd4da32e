"""Per-kernel GPU time of one bench row, from the PyTorch profiler (GPU only).

    python benchmarks/profile_kernels.py --backend baseline:fla --mode fwd B1_T8192_H96_D128
    KDA_VERIFY=off python benchmarks/profile_kernels.py --backend triton --mode train_safe B4_T2048_H16_D128

Runs the bench's own callable (`kda.bench.runner.call_for`: forward, plus backward in the training modes)
a few times to warm up, then profiles ``--steps`` calls and prints each kernel's GPU microseconds per call,
largest first, with their sum. It answers "which kernel holds the time", for our stages and for FLA's, in
one process; the bench (`python -m kda.bench`) remains the source of the times we report.

Beside the kernels' sum it prints the call's own time, unprofiled: GPU time from the first launch to the
last (events) and the host's time to issue a call (no synchronize in between). Kernels summing to much
less than the call's time mean the GPU waits: on the host (issue time near the call's) or on a synchronize.
"""

from __future__ import annotations

import argparse
import time
from collections import defaultdict

import torch
from torch.profiler import ProfilerActivity, profile

from kda.bench.runner import call_for
from kda.bench.shapes import MODES, BenchShape, make_inputs


def kernel_table(run, steps: int) -> list[tuple[str, int, float]]:
    """``(kernel name, launches per call, GPU µs per call)`` over `steps` profiled calls, largest first."""
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(steps):
            run()
        torch.cuda.synchronize()
    total_us: dict[str, float] = defaultdict(float)
    launches: dict[str, int] = defaultdict(int)
    for event in prof.events():
        if event.device_type == torch.autograd.DeviceType.CUDA:
            total_us[event.name] += event.device_time
            launches[event.name] += 1
    rows = [(name, launches[name] // steps, us / steps) for name, us in total_us.items()]
    return sorted(rows, key=lambda row: -row[2])


def call_times(run, steps: int) -> tuple[float, float]:
    """``(GPU ms a call by events, host ms to issue a call)`` over `steps` back-to-back calls."""
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    issued = time.perf_counter()
    start.record()
    for _ in range(steps):
        run()
    end.record()
    issued = time.perf_counter() - issued
    torch.cuda.synchronize()
    return start.elapsed_time(end) / steps, issued * 1e3 / steps


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("shapes", nargs="+")
    parser.add_argument("--backend", action="append", required=True)
    parser.add_argument("--mode", action="append", required=True, choices=sorted(MODES))
    parser.add_argument("--steps", type=int, default=10)
    args = parser.parse_args()
    for shape_name in args.shapes:
        for mode_name in args.mode:
            inputs = make_inputs(BenchShape.parse(shape_name), MODES[mode_name], "cuda", seed=0)
            for backend in args.backend:
                run, why = call_for(backend, inputs, MODES[mode_name])
                if run is None:
                    print(f"{shape_name} {mode_name} {backend}: not run ({why})")
                    continue
                for _ in range(3):  # compile and warm up
                    run()
                torch.cuda.synchronize()
                rows = kernel_table(run, args.steps)
                gpu_ms, host_ms = call_times(run, args.steps)
                print(
                    f"\n{shape_name} {mode_name} {backend}: {sum(us for _, _, us in rows) / 1e3:.3f} ms of kernels a call;"
                    f" the call {gpu_ms:.3f} ms (events), issued in {host_ms:.3f} ms of host time"
                )
                for name, count, us in rows[:30]:
                    print(f"  {us:9.1f} us  x{count:<3d} {name[:110]}")
            del inputs
            torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
