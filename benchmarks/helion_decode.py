"""A Helion decode step, timed against the triton backend's and FLA's: does Helion earn the decode op?

    python benchmarks/helion_decode.py [--shape N256_T1_HV32_D128_fp32 ...] [--configs 16x1 32x2 ...]

The helion backend declines `fused_recurrent_kda` until a Helion kernel is measured to beat the triton
backend's decode step (which runs at 59-82 % of the copy bandwidth on the H200). This script is that
measurement. Its kernel is the serving step the decode bench times at T = 1: one token per sequence, the
state read from and written back to a pool slot (``ssm_state_indices [N]``, a negative slot a padding row
whose output is 0 and whose state nothing touches), the bounded sigmoid gate, the l2norm and beta's
sigmoid in the kernel. Per sequence ``n`` and value head ``hv``, in fp32::

    q, k  <- q / sqrt(sum q^2 + 1e-6) * scale,  k / sqrt(sum k^2 + 1e-6)
    a     =  max(lower_bound * sigmoid(exp(A_log[hv]) * (g + dt_bias[hv])), -32)           [K]
    S     <- exp(a)[:, None] * S                                                            [K, BV]
    S     <- S + k (sigmoid(beta) (v - S^T k))^T
    o     =  S^T q

One program per (sequence, value head, block of BV value columns), all K rows of the state in registers:
the grid the triton backend uses. Each configuration ``BVxW`` (value columns, warps) is compiled and timed,
and the best is reported beside the triton backend (`kda.fused_recurrent_kda(..., backend="triton")`) and
FLA's ``fused_recurrent_kda_fwd`` on the same inputs, each as a CUDA-graph replay (a serving engine's
decode step; the eager calls are host bound at small N) and as a fraction of the memory floor with the copy
bandwidth measured in the same run. Before timing, every configuration's output and pool are checked
against the triton backend's on the same inputs (relative error within the decode op's tolerance).

On a CPU (``HELION_INTERPRET=1``) the kernel runs eagerly; tests/benchmarks/test_helion_decode.py checks it
there against the float64 reference.
"""

from __future__ import annotations

import argparse
import functools
import statistics
from collections.abc import Callable
from typing import Any

import helion.language as hl
import torch

from kda.reference import LOG_DECAY_FLOOR

SHAPES = [f"N{n}_T1_HV32_D128_{pool}" for pool in ("fp32", "bf16") for n in (1, 64, 256)]
CONFIGS = ["16x1", "16x2", "32x1", "32x2", "32x4", "64x2", "64x4", "64x8", "128x4", "128x8"]


def decode_kernel(
    q: torch.Tensor,  # [N, H, K]
    k: torch.Tensor,  # [N, H, K]
    v: torch.Tensor,  # [N, HV, V]
    g: torch.Tensor,  # [N, HV, K] the gate's input
    beta: torch.Tensor,  # [N, HV] beta's logits
    A_log: torch.Tensor,  # [HV] fp32
    dt_bias: torch.Tensor,  # [HV, K] fp32
    pool: torch.Tensor,  # [slots, HV, K, V], read and written in place
    slots: torch.Tensor,  # [N] int32; negative: a padding row
    o: torch.Tensor,  # [N, HV, V] out
    scale: float,
    lower_bound: float,
) -> None:
    N = v.size(0)
    HV = v.size(1)
    V = v.size(2)
    group = HV // q.size(1)
    hl.specialize(q.size(2))  # K: the state's rows are one static tile
    for tile_n, tile_hv, tile_v in hl.tile([N, HV, V], block_size=[1, 1, None]):
        n = tile_n.begin
        hv = tile_hv.begin
        h = hv // group
        slot = slots[n]
        o[n, hv, tile_v] = hl.zeros([tile_v], dtype=o.dtype)  # a padding row's output
        # The slot as a loop of one step, or of none for a padding row: its state is neither read nor
        # written, with no masked store (whose address would still have to be a slot of the pool).
        for tile_s in hl.tile(torch.where(slot >= 0, slot, 0), torch.where(slot >= 0, slot + 1, 0), block_size=1):
            s = tile_s.begin
            S = pool[s, hv, :, tile_v].to(torch.float32)  # [K, BV]
            q_n = q[n, h, :].to(torch.float32)  # [K]
            k_n = k[n, h, :].to(torch.float32)
            q_n = q_n * torch.rsqrt(torch.sum(q_n * q_n) + 1e-6) * scale
            k_n = k_n * torch.rsqrt(torch.sum(k_n * k_n) + 1e-6)
            x = g[n, hv, :].to(torch.float32) + dt_bias[hv, :]
            a = lower_bound * torch.sigmoid(torch.exp(A_log[hv]) * x)
            a = torch.where(a < LOG_DECAY_FLOOR, LOG_DECAY_FLOOR, a)
            b = torch.sigmoid(beta[n, hv].to(torch.float32))
            S = S * torch.exp(a)[:, None]
            delta = b * (v[n, hv, tile_v].to(torch.float32) - torch.sum(S * k_n[:, None], dim=0))  # [BV]
            S = S + k_n[:, None] * delta[None, :]
            o[n, hv, tile_v] = torch.sum(S * q_n[:, None], dim=0).to(o.dtype)
            pool[s, hv, :, tile_v] = S.to(pool.dtype)


@functools.cache
def kernel_for(config: str | None) -> Any:
    """The Helion kernel with the configuration ``BVxW`` (None: the interpreter, or Helion's default); one
    object per configuration, so that each compiles once per pool dtype whatever the shape."""
    import helion

    if config is None:
        return helion.kernel(decode_kernel, static_shapes=False)
    block_v, warps = (int(part) for part in config.split("x"))
    return helion.kernel(
        decode_kernel, static_shapes=False, config=helion.Config(block_sizes=[block_v], num_warps=warps)
    )


def decode_args(kwargs: dict[str, Any]) -> tuple[tuple[Any, ...], torch.Tensor]:
    """The kernel's arguments for a decode bench call at T = 1 (`kda.bench.decode.decode_inputs`), and the
    output buffer ``[N, 1, HV, V]`` they write."""
    q, k, v, g, beta = (kwargs[name][:, 0] for name in ("q", "k", "v", "g", "beta"))
    if q.shape[0] != kwargs["q"].shape[0] or kwargs["q"].shape[1] != 1:
        raise ValueError("the Helion decode kernel takes one token per sequence")
    HV, K = v.shape[1], q.shape[2]
    o = torch.empty(v.shape[0], 1, HV, v.shape[2], dtype=v.dtype, device=v.device)
    scale = kwargs.get("scale") or K**-0.5
    args = (
        q.contiguous(),
        k.contiguous(),
        v.contiguous(),
        g.contiguous(),
        beta.contiguous(),
        kwargs["A_log"].float().reshape(HV).contiguous(),
        kwargs["dt_bias"].float().reshape(HV, K).contiguous(),
        kwargs["initial_state"],
        kwargs["ssm_state_indices"],
        o[:, 0],
        float(scale),
        float(kwargs["lower_bound"]),
    )
    return args, o


def _relative(got: torch.Tensor, want: torch.Tensor) -> float:
    if not torch.isfinite(got).all():
        return float("inf")
    return float((got.double() - want.double()).norm() / want.double().norm().clamp_min(1e-30))


def _graph_ms(run: Callable[[], Any], replays: int = 200) -> float:
    """Median time of one replay of `run` captured in a CUDA graph (ten replays timed at a time)."""
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for _ in range(3):
            run()
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        run()
    for _ in range(10):
        graph.replay()
    times = []
    for _ in range(replays // 10):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(10):
            graph.replay()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) / 10)
    return statistics.median(times)


def measure(shape_name: str, configs: list[str], bandwidth: float) -> None:
    import kda
    from kda.bench.decode import DecodeShape, decode_inputs, fla_direct

    shape = DecodeShape.parse(shape_name)
    if shape.T != 1:
        raise SystemExit(f"{shape_name}: the Helion decode kernel takes T = 1")
    device = torch.device("cuda")
    kwargs = decode_inputs(shape, device, seed=0)
    pool0 = kwargs["initial_state"].clone()
    floor_ms = shape.floor_bytes() / bandwidth * 1e3

    # what the triton backend computes on these inputs: the check for every configuration
    kwargs["initial_state"] = pool0.clone()
    want_o, returned = kda.fused_recurrent_kda(**kwargs, backend="triton")
    assert returned is not None  # the pool, updated in place
    want_o, want_pool = want_o.clone(), returned.clone()
    tol = 1e-3 if shape.pool == "fp32" else 8e-3

    results: dict[str, float] = {}
    for config in configs:
        kernel = kernel_for(config)
        kwargs["initial_state"] = pool0.clone()
        args, o = decode_args(kwargs)
        try:
            kernel(*args)
            torch.cuda.synchronize()
        except Exception as error:
            print(f"  {shape_name} helion {config}: does not run ({type(error).__name__}: {str(error)[:120]})")
            continue
        errors = (_relative(o, want_o), _relative(args[7], want_pool))
        if max(errors) > tol:
            print(f"  {shape_name} helion {config}: WRONG (o {errors[0]:.1e}, pool {errors[1]:.1e}, tol {tol:.0e})")
            continue
        results[config] = _graph_ms(functools.partial(kernel, *args))
    kwargs["initial_state"] = pool0.clone()
    triton_ms = _graph_ms(lambda: kda.fused_recurrent_kda(**kwargs, backend="triton"))
    fla = fla_direct(kwargs)
    fla_ms = _graph_ms(fla) if callable(fla) else None
    if not results:
        print(f"{shape_name}: no Helion configuration ran right; triton {triton_ms:.4f} ms")
        return
    best = min(results, key=lambda c: results[c])
    listing = ", ".join(f"{c} {ms:.4f}" for c, ms in sorted(results.items(), key=lambda kv: kv[1]))
    fla_text = f"{fla_ms:.4f} ms ({100 * floor_ms / fla_ms:.0f}% of floor)" if fla_ms else f"n/a ({fla})"
    print(
        f"{shape_name}: helion {best} {results[best]:.4f} ms ({100 * floor_ms / results[best]:.0f}% of floor), "
        f"triton {triton_ms:.4f} ms ({100 * floor_ms / triton_ms:.0f}%), FLA {fla_text}; "
        f"helion/triton time {results[best] / triton_ms:.2f}; floor {floor_ms:.4f} ms\n    helion configs: {listing}",
        flush=True,
    )


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shape", action="append", default=None, help="decode shapes with T = 1")
    parser.add_argument("--configs", nargs="+", default=CONFIGS, help="BVxW: value columns x warps")
    args = parser.parse_args()
    if not torch.cuda.is_available():
        print("helion_decode.py: needs a CUDA GPU (the CPU check is tests/benchmarks/test_helion_decode.py)")
        return 2
    from kda.bench.decode import copy_bandwidth

    bandwidth = copy_bandwidth(torch.device("cuda"), 1 << 30, warmup_ms=50, rep_ms=300)
    print(f"copy bandwidth {bandwidth / 1e12:.2f} TB/s; times are CUDA-graph replays (median)", flush=True)
    for shape in args.shape or SHAPES:
        measure(shape, args.configs, bandwidth)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
