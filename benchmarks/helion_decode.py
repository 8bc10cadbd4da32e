"""A Helion decode step, timed against the triton backend's and FLA's: does Helion earn the decode op?

    python benchmarks/helion_decode.py [--shape N256_T1_HV32_D128_fp32 ...] [--configs 16x1 32x2 ...]

The helion backend declines `fused_recurrent_kda` until a Helion kernel is measured to beat the triton
backend's decode step (which runs at 59-82 % of the copy bandwidth on the H200). This script is that
measurement. Its kernel is the serving step the decode bench times: T tokens per sequence, the state read
from a pool slot and written back (``ssm_state_indices [N]``; a negative slot a padding row whose outputs
are 0 and whose state nothing touches), or with speculative decoding (``[N, T]``, one slot per token)
read from column ``num_accepted_tokens[n] - 1`` and written after every token into that token's column
(a negative one skipped); the bounded sigmoid gate, the l2norm and beta's sigmoid in the kernel. Per
sequence ``n`` and value head ``hv``, token after token, in fp32::

    q, k  <- q / sqrt(sum q^2 + 1e-6) * scale,  k / sqrt(sum k^2 + 1e-6)
    a     =  max(lower_bound * sigmoid(exp(A_log[hv]) * (g + dt_bias[hv])), -32)           [K]
    S     <- exp(a)[:, None] * S                                                            [K, BV]
    S     <- S + k (sigmoid(beta) (v - S^T k))^T
    o     =  S^T q

One program per (sequence, value head, block of BV value columns), all K rows of the state in registers,
the state's loads evict-first and q, k, g's evict-last: the triton backend's grid and cache hints. Each configuration ``BVxW`` (value columns, warps) is compiled and timed,
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
from collections.abc import Callable
from typing import Any

import helion.language as hl
import torch

from kda.reference import LOG_DECAY_FLOOR

SHAPES = [f"N{n}_T{t}_HV32_D128_{pool}" for pool in ("fp32", "bf16") for t in (1, 4) for n in (1, 64, 256)]
# value columns x warps: 32 or 64 fp32 state values a thread at K = 128 (the triton kernel's rule is about 32)
CONFIGS = ["16x2", "32x2", "32x4", "64x4", "64x8", "128x8"]


def decode_kernel(
    q: torch.Tensor,  # [N, T, H, K]
    k: torch.Tensor,  # [N, T, H, K]
    v: torch.Tensor,  # [N, T, HV, V]
    g: torch.Tensor,  # [N, T, HV, K] the gate's input
    beta: torch.Tensor,  # [N, T, HV] beta's logits
    A_log: torch.Tensor,  # [HV] fp32
    dt_bias: torch.Tensor,  # [HV, K] fp32
    pool: torch.Tensor,  # [slots, HV, K, V], read and written in place
    slots: torch.Tensor,  # [N, 1] int32 (one slot a sequence) or [N, T] (one a token); negative: none
    accepted: torch.Tensor,  # [N] int32: the state is read from column accepted[n] - 1 (ones without)
    o: torch.Tensor,  # [N, T, HV, V] out
    scale: float,
    lower_bound: float,
    PER_TOKEN: hl.constexpr,
) -> None:
    N = v.size(0)
    T = v.size(1)
    HV = v.size(2)
    V = v.size(3)
    group = HV // q.size(2)
    hl.specialize(q.size(3))  # K: the state's rows are one static tile
    for tile_n, tile_hv, tile_v in hl.tile([N, HV, V], block_size=[1, 1, None]):
        n = tile_n.begin
        hv = tile_hv.begin
        h = hv // group
        read = slots[n, accepted[n] - 1]
        for tile_t in hl.tile(T, block_size=1):  # a padding row's outputs
            o[n, tile_t.begin, hv, tile_v] = hl.zeros([tile_v], dtype=o.dtype)
        # A slot as a loop of one step, or of none for a padding row: its state is neither read nor written,
        # with no masked store (whose address would still have to be a slot of the pool)
        for tile_s in hl.tile(torch.where(read >= 0, read, 0), torch.where(read >= 0, read + 1, 0), block_size=1):
            # the state is read once and written once (evict first); q, k and g are read again by the head's
            # other value blocks (evict last): the triton kernel's hints
            S = hl.load(pool, [tile_s.begin, hv, slice(None), tile_v], eviction_policy="evict_first").to(
                torch.float32
            )  # [K, BV]
            for tile_t in hl.tile(T, block_size=1):  # the tokens, in order
                t = tile_t.begin
                q_t = hl.load(q, [n, t, h, slice(None)], eviction_policy="evict_last").to(torch.float32)  # [K]
                k_t = hl.load(k, [n, t, h, slice(None)], eviction_policy="evict_last").to(torch.float32)
                q_t = q_t * torch.rsqrt(torch.sum(q_t * q_t) + 1e-6) * scale
                k_t = k_t * torch.rsqrt(torch.sum(k_t * k_t) + 1e-6)
                x = hl.load(g, [n, t, hv, slice(None)], eviction_policy="evict_last").to(torch.float32) + dt_bias[hv, :]
                a = lower_bound * torch.sigmoid(torch.exp(A_log[hv]) * x)
                a = torch.where(a < LOG_DECAY_FLOOR, LOG_DECAY_FLOOR, a)
                b = torch.sigmoid(beta[n, t, hv].to(torch.float32))
                S = S * torch.exp(a)[:, None]
                delta = b * (v[n, t, hv, tile_v].to(torch.float32) - torch.sum(S * k_t[:, None], dim=0))  # [BV]
                S = S + k_t[:, None] * delta[None, :]
                o[n, t, hv, tile_v] = torch.sum(S * q_t[:, None], dim=0).to(o.dtype)
                if PER_TOKEN:
                    write = slots[n, t]
                    for tile_w in hl.tile(
                        torch.where(write >= 0, write, 0), torch.where(write >= 0, write + 1, 0), block_size=1
                    ):
                        pool[tile_w.begin, hv, :, tile_v] = S.to(pool.dtype)
            if not PER_TOKEN:
                pool[tile_s.begin, hv, :, tile_v] = S.to(pool.dtype)


@functools.cache
def kernel_for(config: str | None) -> Any:
    """The Helion kernel with the configuration ``BVxW`` (None: the interpreter, or Helion's default); one
    object per configuration, so that each compiles once per pool dtype whatever the shape."""
    import helion

    if config is None:  # the default configuration, never autotuned (Helion 1.5 autotunes a kernel given none)
        return helion.kernel(decode_kernel, static_shapes=False, autotune_effort="none")
    block_v, warps = (int(part) for part in config.split("x"))
    return helion.kernel(
        decode_kernel, static_shapes=False, config=helion.Config(block_sizes=[block_v], num_warps=warps)
    )


def decode_args(kwargs: dict[str, Any]) -> tuple[tuple[Any, ...], torch.Tensor]:
    """The kernel's arguments for a decode bench call (`kda.bench.decode.decode_inputs`: a pool,
    ``ssm_state_indices`` ``[N]`` or ``[N, T]`` with ``num_accepted_tokens``), and the output ``[N, T, HV, V]``
    they write."""
    q, k, v, g, beta = (kwargs[name].contiguous() for name in ("q", "k", "v", "g", "beta"))
    N, T, HV, V = v.shape
    K = q.shape[3]
    slots = kwargs["ssm_state_indices"]
    per_token = slots.dim() == 2
    accepted = kwargs.get("num_accepted_tokens")
    if accepted is None:
        accepted = torch.ones(N, dtype=torch.int32, device=q.device)
    o = torch.empty(N, T, HV, V, dtype=v.dtype, device=v.device)
    scale = kwargs.get("scale") or K**-0.5
    args = (
        q,
        k,
        v,
        g,
        beta,
        kwargs["A_log"].float().reshape(HV).contiguous(),
        kwargs["dt_bias"].float().reshape(HV, K).contiguous(),
        kwargs["initial_state"],
        (slots if per_token else slots.reshape(N, 1)).contiguous(),
        accepted.to(torch.int32).contiguous(),
        o,
        float(scale),
        float(kwargs["lower_bound"]),
        per_token,
    )
    return args, o


def _relative(got: torch.Tensor, want: torch.Tensor) -> float:
    if not torch.isfinite(got).all():
        return float("inf")
    return float((got.double() - want.double()).norm() / want.double().norm().clamp_min(1e-30))


def _time_ms(run: Callable[[], Any], how: list[str]) -> float:
    """The median time of `run` captured in a CUDA graph and replayed (the decode bench's `--graph` timing),
    or, where `run` cannot be captured, of the eager call (noted in `how`, so that the report says which)."""
    from kda.bench.timing import capture_graph, median_ms

    device = torch.device("cuda")
    try:
        replay = capture_graph(run, device)
    except Exception as error:  # a host step that a capture refuses: time the eager call instead
        torch.cuda.synchronize()
        how.append(f"eager ({type(error).__name__})")
        return median_ms(run, device)
    return median_ms(replay, device)


def measure(shape_name: str, configs: list[str], bandwidth: float) -> None:
    import kda
    from kda.bench.decode import DecodeShape, decode_inputs, fla_direct

    shape = DecodeShape.parse(shape_name)
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
        how: list[str] = []
        results[config] = _time_ms(functools.partial(kernel, *args), how)
        if how:
            print(f"  {shape_name} helion {config}: timed {how[0]}, not as a graph replay")
    kwargs["initial_state"] = pool0.clone()
    how = []
    triton_ms = _time_ms(lambda: kda.fused_recurrent_kda(**kwargs, backend="triton"), how)
    fla = fla_direct(kwargs)
    fla_ms = _time_ms(fla, how) if callable(fla) else None
    if how:
        print(f"  {shape_name}: triton or FLA timed {how}, not as graph replays")
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
    parser.add_argument(
        "--shape", action="append", default=None, help="decode shapes (default: the decode bench's twelve)"
    )
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
