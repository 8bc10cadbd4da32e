"""Context parallel over several GPUs: equal to the one-GPU call, and how forward+backward scales.

    torchrun --nproc-per-node W benchmarks/cp_scaling.py [--tokens 32768 131072 262144] [--heads 32]
        [--modes sequence head] [--backend triton] [--check] [--steps 10] [--out cp.jsonl]
    python benchmarks/cp_scaling.py --report cp.jsonl

One training step of one KDA layer (Kimi-Linear's: the safe gate with A_log and dt_bias, l2norm and beta's
sigmoid in the kernel, bf16, K = V = 128, H = HV): one sequence of ``--tokens`` tokens (B = 1, given as a
varlen batch), split over the W ranks of the group in equal slices, forward and backward of
``sum(o * do)``. With W = 1 the plain call (no context) is timed: the baseline every speedup divides.

Times (CUDA events; ``time.perf_counter`` on a CPU): per step the slowest rank's forward+backward, after a
barrier, median over ``--steps`` after two untimed steps; and per step the time a rank's stream waits in
torch.distributed's collectives (each call bracketed, an asynchronous one from its start to its wait; the
slowest rank's sum), which is the communication a step exposes, overlapped transfers not counted.

``--check`` first compares both modes with the one-GPU call on every rank at the first ``--tokens``, on a
batch whose sequences cross rank boundaries (four of lengths 3/8, 1/4, 1/8 and 1/4 of the tokens): each
rank's slices of ``o`` and of the gradients of q, k, v, g and beta, the final states, and the gradients of
A_log, dt_bias and the initial state summed over the ranks, against the verification tolerances.

Rank 0 prints one JSON line per measurement; ``--report`` reads them (every W, as torchrun was run once per
W) and prints speedup ``t_1 / t_W`` and parallel efficiency ``t_1 / (W t_W)`` per mode and size.
"""

from __future__ import annotations

import argparse
import datetime
import gc
import json
import os
import statistics
import sys
import time
from collections import defaultdict
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import torch
import torch.distributed as dist

GRADS = ("q", "k", "v", "g", "beta")
SHARED = ("initial_state", "A_log", "dt_bias")
_COLLECTIVES = ("all_gather", "all_reduce", "reduce_scatter_tensor", "all_to_all", "batch_isend_irecv")


class Clock:
    """Intervals on the current CUDA stream (events), or on the host where there is no GPU."""

    def __init__(self, cuda: bool) -> None:
        self.cuda = cuda

    def mark(self) -> Any:
        if self.cuda:
            event = torch.cuda.Event(enable_timing=True)
            event.record()
            return event
        return time.perf_counter()

    def ms(self, start: Any, end: Any) -> float:
        if self.cuda:
            end.synchronize()
            return float(start.elapsed_time(end))
        return (end - start) * 1e3


class CommTimer:
    """Brackets every torch.distributed collective that kda.distributed calls (they are looked up on the
    module at call time): a blocking call from its start to its return, an asynchronous one (or a batch of
    point-to-point operations) from its start to its wait."""

    def __init__(self, clock: Clock) -> None:
        self.clock = clock
        self.intervals: list[tuple[Any, Any]] = []
        self.on = False

    def install(self) -> None:
        for name in _COLLECTIVES:
            setattr(dist, name, self._wrap(getattr(dist, name)))

    def _wrap(self, collective: Callable[..., Any]) -> Callable[..., Any]:
        timer = self

        def bracketed(*args: Any, **kwargs: Any) -> Any:
            if not timer.on:
                return collective(*args, **kwargs)
            start = timer.clock.mark()
            result = collective(*args, **kwargs)
            if result is None:  # blocking
                timer.intervals.append((start, timer.clock.mark()))
                return result
            works = result if isinstance(result, list) else [result]
            batch = _Batch(start, len(works))  # a batch of point-to-point operations is one interval
            wrapped = [_TimedWork(work, batch, timer) for work in works]
            return wrapped if isinstance(result, list) else wrapped[0]

        return bracketed

    def take_ms(self) -> float:
        total = sum(self.clock.ms(start, end) for start, end in self.intervals)
        self.intervals.clear()
        return total


class _Batch:
    def __init__(self, start: Any, works: int) -> None:
        self.start, self.left = start, works


class _TimedWork:
    """A collective in flight; the last wait of its batch closes the interval opened when it started."""

    def __init__(self, work: Any, batch: _Batch, timer: CommTimer) -> None:
        self.work, self.batch, self.timer = work, batch, timer

    def wait(self, *args: Any, **kwargs: Any) -> Any:
        done = self.work.wait(*args, **kwargs)
        self.batch.left -= 1
        if self.batch.left == 0:
            self.timer.intervals.append((self.batch.start, self.timer.clock.mark()))
        return done

    def __getattr__(self, name: str) -> Any:
        return getattr(self.work, name)


def global_batch(tokens: int, heads: int, dim: int, lengths: list[int], device: torch.device, seed: int) -> dict:
    """The whole batch, the same on every rank (drawn from `seed` on the device: the same numbers on every
    GPU of one kind, and no minutes of host time at 256K tokens)."""
    gen = torch.Generator(device=device).manual_seed(seed)
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32

    def randn(*shape: int, scale: float = 1.0, as_dtype: torch.dtype | None = None) -> torch.Tensor:
        return (torch.randn(*shape, generator=gen, device=device) * scale).to(as_dtype or dtype)

    cu = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int32, device=device)
    N = len(lengths)
    return {
        "tensors": {
            "q": randn(1, tokens, heads, dim),
            "k": randn(1, tokens, heads, dim),
            "v": randn(1, tokens, heads, dim),
            "g": randn(1, tokens, heads, dim),
            "beta": randn(1, tokens, heads),
        },
        "shared": {
            "A_log": randn(heads, scale=0.5, as_dtype=torch.float32),
            "dt_bias": randn(heads * dim, scale=0.5, as_dtype=torch.float32),
            "initial_state": randn(N, heads, dim, dim, scale=0.1, as_dtype=torch.float32),
        },
        "cu_seqlens": cu,
        "do": randn(1, tokens, heads, dim),
        "dfinal": randn(N, heads, dim, dim, as_dtype=torch.float32),
    }


OPTIONS: dict[str, Any] = dict(
    use_qk_l2norm_in_kernel=True,
    use_beta_sigmoid_in_kernel=True,
    use_gate_in_kernel=True,
    safe_gate=True,
    lower_bound=-5.0,
    output_final_state=True,
)


def step(batch: dict, ctx: Any, backend: str, rank: int) -> dict[str, Any]:
    """Forward and backward of one rank's part (the whole batch without a context); returns the leaves."""
    import kda

    if ctx is None:
        lo, hi = 0, batch["do"].shape[1]
    else:
        lo, hi = ctx.offsets[rank], ctx.offsets[rank + 1]
    mine = {n: t[:, lo:hi].detach().clone().requires_grad_() for n, t in batch["tensors"].items()}
    shared = {n: t.detach().clone().requires_grad_() for n, t in batch["shared"].items()}
    extra = {"cp_context": ctx} if ctx is not None else {"cu_seqlens": batch["cu_seqlens"]}
    o, final = kda.chunk_kda(**mine, **shared, **OPTIONS, backend=backend, **extra)
    loss = (o.float() * batch["do"][:, lo:hi].float()).sum()
    if rank == 0 or ctx is None:  # the final state is the same on every rank: one rank's loss takes it
        loss = loss + (final * batch["dfinal"]).sum()
    loss.backward()
    return {"o": o.detach(), "final": final.detach(), **mine, **shared}


def check(batch: dict, mode: str, backend: str, rank: int, world: int) -> dict[str, float]:
    """Relative errors of the context-parallel step against the one-GPU call, every tensor."""
    from kda.distributed import build_cp_context
    from kda.verify.check import relative_error

    whole = step(batch, None, backend, 0)
    ctx = build_cp_context(dist.group.WORLD, batch["cu_seqlens"], mode=mode)
    part = step(batch, ctx, backend, rank)
    lo, hi = ctx.offsets[rank], ctx.offsets[rank + 1]
    errors = {"o": relative_error(part["o"].float(), whole["o"][:, lo:hi].float())}
    errors["final_state"] = relative_error(part["final"], whole["final"])
    for name in GRADS:
        errors[f"d{name}"] = relative_error(part[name].grad.float(), whole[name].grad[:, lo:hi].float())
    for name in SHARED:
        total = part[name].grad.clone()
        dist.all_reduce(total)  # each rank holds its share of a whole tensor's gradient
        errors[f"d{name}"] = relative_error(total, whole[name].grad)
    worst = torch.tensor([errors[name] for name in errors], dtype=torch.float64, device=part["o"].device)
    dist.all_reduce(worst, op=dist.ReduceOp.MAX)
    return dict(zip(errors, worst.tolist(), strict=True))


def timed(batch: dict, mode: str | None, backend: str, steps: int, clock: Clock, comm: CommTimer) -> dict:
    """Median over `steps` of the slowest rank's step and of its exposed communication."""
    from kda.distributed import build_cp_context

    rank, world = dist.get_rank(), dist.get_world_size()
    ctx = None if world == 1 else build_cp_context(dist.group.WORLD, batch["cu_seqlens"], mode=mode or "sequence")
    step_ms, comm_ms = [], []
    for i in range(steps + 2):  # two untimed: compilation, autotuning, verification
        dist.barrier()
        comm.on = True
        start = clock.mark()
        step(batch, ctx, backend, rank)
        end = clock.mark()
        comm.on = False
        both = torch.tensor([clock.ms(start, end), comm.take_ms()], dtype=torch.float64, device=batch["do"].device)
        dist.all_reduce(both, op=dist.ReduceOp.MAX)
        if i >= 2:
            step_ms.append(float(both[0]))
            comm_ms.append(float(both[1]))
    return {"step_ms": statistics.median(step_ms), "comm_ms": statistics.median(comm_ms), "steps_ms": step_ms}


@contextmanager
def process_group() -> Iterator[tuple[int, int, torch.device]]:
    cuda = torch.cuda.is_available()
    if cuda:
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", 0)))
    os.environ.setdefault("NCCL_NVLS_ENABLE", "0")  # NVLink multicast off (the device documentation's rule)
    dist.init_process_group("nccl" if cuda else "gloo", timeout=datetime.timedelta(minutes=5))
    device = torch.device("cuda", torch.cuda.current_device()) if cuda else torch.device("cpu")
    try:
        yield dist.get_rank(), dist.get_world_size(), device
    finally:
        # leave together, holding nothing of the group (the autograd graphs of the steps kept it alive; a
        # gloo group alive at interpreter shutdown aborted a rank now and then): see examples/context_parallel.py
        gc.collect()
        dist.barrier()
        dist.destroy_process_group()


def run(args: argparse.Namespace) -> None:
    with process_group() as (rank, world, device):
        measure(args, rank, world, device)  # its frame, and every step's graph with it, ends before teardown


def measure(args: argparse.Namespace, rank: int, world: int, device: torch.device) -> None:
    """The equality check (with `--check`) and the timings of this rank, rank 0 printing each record."""
    from kda.verify.policy import tolerance

    clock = Clock(device.type == "cuda")
    comm = CommTimer(clock)
    comm.install()
    dtype_name = "bfloat16" if device.type == "cuda" else "float32"

    def emit(record: dict) -> None:
        if rank == 0:
            line = json.dumps({"world": world, "backend": args.backend, "K": args.head_dim, **record})
            print(line, flush=True)
            if args.out:
                with open(args.out, "a") as sink:
                    sink.write(line + "\n")

    if args.check and world > 1:
        tokens = args.tokens[0]
        quarter, eighth = tokens // 4, tokens // 8
        lengths = [3 * eighth, quarter, eighth, tokens - 3 * eighth - quarter - eighth]
        batch = global_batch(tokens, args.heads[0], args.head_dim, lengths, device, seed=args.seed)
        for mode in args.modes:
            errors = check(batch, mode, args.backend, rank, world)
            limits = {name: tolerance(name, dtype_name) for name in errors}
            passed = all(errors[name] <= limits[name] for name in errors)
            emit({"kind": "check", "mode": mode, "tokens": tokens, "HV": args.heads[0], "lengths": lengths,
                  "passed": passed, "errors": errors, "tolerances": limits})  # fmt: skip
        del batch
    for tokens in args.tokens:
        for heads in args.heads:
            batch = global_batch(tokens, heads, args.head_dim, [tokens], device, seed=args.seed)
            for mode in args.modes if world > 1 else [None]:
                result = timed(batch, mode, args.backend, args.steps, clock, comm)
                emit({"kind": "time", "mode": mode, "tokens": tokens, "HV": heads, **result})
            del batch
            if device.type == "cuda":
                torch.cuda.empty_cache()


def report(paths: list[str]) -> int:
    """Speedup and parallel efficiency per mode and size, from the JSON lines of every W's run."""
    rows = []
    for path in paths:
        with open(path) as lines:
            rows += [json.loads(line) for line in lines if line.strip()]
    checks = [r for r in rows if r.get("kind") == "check"]
    for r in checks:
        worst = max(r["errors"], key=lambda name: r["errors"][name] / r["tolerances"][name])
        print(
            f"check {r['mode']:8s} W={r['world']} {r['backend']} T={r['tokens']} HV={r['HV']}: "
            f"{'pass' if r['passed'] else 'FAIL'} (worst {worst} {r['errors'][worst]:.2e}, "
            f"tolerance {r['tolerances'][worst]:.0e})"
        )
    base = {(r["backend"], r["tokens"], r["HV"]): r for r in rows if r.get("kind") == "time" and r["world"] == 1}
    table: dict[tuple, list[dict]] = defaultdict(list)
    for r in rows:
        if r.get("kind") == "time" and r["world"] > 1:
            table[(r["mode"], r["backend"], r["tokens"], r["HV"])].append(r)
    print("mode      backend  tokens   HV  W  step ms   comm ms  speedup  efficiency")
    for (mode, backend, tokens, heads), found in sorted(table.items()):
        one = base.get((backend, tokens, heads))
        if one is not None:
            print(f"{'-':8s}  {backend:7s}  {tokens:6d}  {heads:3d}  1  {one['step_ms']:8.2f}  {0.0:8.2f}")
        for r in sorted(found, key=lambda r: r["world"]):
            speedup = one["step_ms"] / r["step_ms"] if one else float("nan")
            efficiency = speedup / r["world"]
            print(
                f"{mode:8s}  {backend:7s}  {tokens:6d}  {heads:3d}  {r['world']}  {r['step_ms']:8.2f}  "
                f"{r['comm_ms']:8.2f}  {speedup:7.2f}  {100 * efficiency:9.1f}%"
            )
    return 0 if all(r["passed"] for r in checks) else 1


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokens", type=int, nargs="+", default=[32768, 131072, 262144])
    parser.add_argument("--heads", type=int, nargs="+", default=[32], help="H = HV")
    parser.add_argument("--head-dim", type=int, default=128)
    parser.add_argument("--modes", nargs="+", default=["sequence", "head"], choices=["sequence", "head"])
    parser.add_argument("--backend", default="triton")
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--check", action="store_true", help="compare both modes with the one-GPU call first")
    parser.add_argument("--out", default=None, help="also append the JSON lines (rank 0) to this file")
    parser.add_argument("--report", nargs="+", metavar="JSONL", help="print speedups from earlier runs' lines")
    args = parser.parse_args(argv)
    if args.report:
        return report(args.report)
    if "RANK" not in os.environ:
        print("cp_scaling.py: run it under torchrun (torchrun --nproc-per-node W ...), or give --report")
        return 2
    run(args)
    return 0


if __name__ == "__main__":
    sys.exit(main())
