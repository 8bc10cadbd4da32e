"""The tilelang backend's compile costs on the GPU, per head size (GPU only).

    python benchmarks/tilelang_compile.py [--head-dims 64,128,256] [--mode fwd | train_safe]

For each head size, in a new process with an empty TileLang cache directory: the first call (the cold
compile through nvcc of the forward's three kernels, or with ``--mode train_safe`` of all eight a training
step runs, plus the call), then a call at a new length, batch
and head count (no compile: those are dynamic in every kernel); then, in another new process on the same
cache directory, the first call again (the kernels loaded from TileLang's disk cache). Prints one JSON
line per head size. Verification is off (``KDA_VERIFY=off``) so that only the call's own compiles count.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time


def one_call(shape: str, mode: str) -> float:
    """Seconds for one call of the bench's `mode` at `shape` on the tilelang backend (a training mode: the
    forward and the backward), synced."""
    import torch

    from kda.bench.runner import call_for
    from kda.bench.shapes import MODES, BenchShape, make_inputs

    inputs = make_inputs(BenchShape.parse(shape), MODES[mode], "cuda", seed=0)
    call, why = call_for("tilelang", inputs, MODES[mode])
    if call is None:
        raise SystemExit(f"tilelang_compile: no call: {why}")
    torch.cuda.synchronize()
    started = time.perf_counter()
    call()
    torch.cuda.synchronize()
    return time.perf_counter() - started


def child(mode: str, shapes: list[str]) -> None:
    print(json.dumps([round(one_call(shape, mode), 3) for shape in shapes]), flush=True)


def run_child(mode: str, shapes: list[str], cache: str) -> list[float]:
    env = {**os.environ, "TILELANG_CACHE_DIR": cache, "KDA_VERIFY": "off"}
    done = subprocess.run(
        [sys.executable, __file__, "--mode", mode, "--child", *shapes],
        env=env,
        capture_output=True,
        text=True,
        timeout=900,
    )
    if done.returncode != 0:
        raise SystemExit(f"tilelang_compile: child failed ({done.returncode}): {done.stderr.strip()[-2000:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--head-dims", default="64,128,256")
    parser.add_argument("--mode", default="fwd", choices=["fwd", "train_safe"])
    parser.add_argument("--child", nargs="*", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.child is not None:
        child(args.mode, args.child)
        return 0
    for dim in (int(d) for d in args.head_dims.split(",")):
        first, other = f"B1_T1024_H4_D{dim}", f"B2_T3000_H16_D{dim}"
        with tempfile.TemporaryDirectory(prefix="tilelang-cache-") as cache:
            cold, new_shape = run_child(args.mode, [first, other], cache)
            (cached,) = run_child(args.mode, [first], cache)
        print(json.dumps({"head_dim": dim, "mode": args.mode, "cold_first_call_s": cold, "new_shape_s": new_shape,
                          "cached_new_process_s": cached}), flush=True)  # fmt: skip
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
