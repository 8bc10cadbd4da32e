"""How one call is timed: median latency, peak memory, and the first call in a fresh process.

- Median: on CUDA, `triton.testing.do_bench(fn, warmup, rep, return_mode="median")`: warm-up runs are
  excluded, and the L2 cache is flushed before every timed run (CUDA events around each). Without CUDA
  (the tests, a CPU user), a wall-clock median over the same warm-up/repeat budget.
- CUDA-graph replay (`capture_graph`): the call captured once in a CUDA graph, then its replay timed as
  above. What a serving engine that captures its decode step pays: the GPU's time, without the host's
  per-call Python and launch work, which at a small batch is most of an eager call.
- Peak memory: the most bytes allocated at once during one call, above what was allocated before it
  (inputs excluded, outputs and workspaces included), from the CUDA caching allocator's statistics.
- Cold start: the wall time of the first call in a new Python process (`kda.bench.cold`), with the
  process's imports timed separately; compilation, autotuning and lazy verification, whatever the
  backend does on a first call, are included. The child shares this process's Triton cache directory;
  it reports how many kernels it added there, so that a cold start on a warm cache is visible as such.
"""

from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch


def median_ms(fn: Callable[[], Any], device: torch.device, *, warmup_ms: float = 50, rep_ms: float = 300) -> float:
    """Median milliseconds per call of `fn`, warm-up excluded."""
    if device.type == "cuda":
        from triton.testing import do_bench

        return float(do_bench(fn, warmup=int(warmup_ms), rep=int(rep_ms), return_mode="median"))
    fn()  # first call: compilation, lazy verification; never timed
    started = time.perf_counter()
    fn()
    estimate = max(time.perf_counter() - started, 1e-6)
    for _ in range(max(0, int(warmup_ms / 1e3 / estimate))):
        fn()
    samples = []
    for _ in range(max(3, min(1000, int(rep_ms / 1e3 / estimate)))):
        begin = time.perf_counter()
        fn()
        samples.append((time.perf_counter() - begin) * 1e3)
    return statistics.median(samples)


def capture_graph(fn: Callable[[], Any], device: torch.device) -> Callable[[], None]:
    """`fn` captured in a CUDA graph; returns the replay (CUDA only). `fn` is warmed up on a side stream
    first, as capture requires, and must be capturable (a kda call: verified before capture)."""
    if device.type != "cuda":
        raise RuntimeError("CUDA graphs need a CUDA device")
    side = torch.cuda.Stream(device)
    side.wait_stream(torch.cuda.current_stream(device))
    with torch.cuda.stream(side):
        for _ in range(3):
            fn()
    torch.cuda.current_stream(device).wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fn()
    torch.cuda.synchronize(device)
    return graph.replay


def peak_bytes(fn: Callable[[], Any], device: torch.device) -> int | None:
    """Peak bytes allocated during one call beyond what was allocated before it (CUDA only)."""
    if device.type != "cuda":
        return None
    torch.cuda.synchronize(device)
    torch.cuda.reset_peak_memory_stats(device)
    before = torch.cuda.memory_allocated(device)
    result = fn()
    torch.cuda.synchronize(device)
    peak = torch.cuda.max_memory_allocated(device) - before
    del result
    return int(peak)


def triton_cache_dir() -> Path:
    return Path(os.environ.get("TRITON_CACHE_DIR") or Path.home() / ".triton" / "cache")


def _count_files(root: Path) -> int:
    try:
        return sum(len(files) for _, _, files in os.walk(root))
    except OSError:
        return 0


def cold_start(backend: str, shape: str, mode: str, device: torch.device, *, timeout_s: float = 900) -> dict[str, Any]:
    """First-call time of `backend` at `shape`/`mode` in a fresh process (see the module docstring).

    Returns ``{"first_call_s", "process_s", "new_cache_files"}`` or ``{"error": ...}``; ``process_s`` is
    the child's whole life (interpreter, imports, inputs, the call), timed from here.
    """
    cache = triton_cache_dir()
    before = _count_files(cache)
    started = time.perf_counter()
    command = [
        sys.executable,
        "-m",
        "kda.bench.cold",
        "--backend",
        backend,
        "--shape",
        shape,
        "--mode",
        mode,
        "--device",
        str(device),
    ]
    try:
        done = subprocess.run(command, capture_output=True, text=True, timeout=timeout_s, env=os.environ.copy())
    except subprocess.TimeoutExpired:
        return {"error": f"no first call within {timeout_s:.0f} s"}
    lines = [line for line in done.stdout.splitlines() if line.startswith("{")]
    if done.returncode != 0 or not lines:
        tail = (done.stderr or done.stdout).strip().splitlines()[-1:] or ["(no output)"]
        return {"error": f"exit {done.returncode}: {tail[0][:300]}"}
    found = json.loads(lines[-1])
    found["process_s"] = time.perf_counter() - started
    found["new_cache_files"] = max(0, _count_files(cache) - before)
    return found
