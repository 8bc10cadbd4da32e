"""The decode kernel's launch, measured on this GPU: every candidate (value columns, warps) timed alone, the
winner per state dtype verified and benchmarked, and where an eager call's host time goes.

    python benchmarks/decode_sweep.py --out DIR          (CUDA; `bash benchmarks/device/measure.sh decode-tune`)

1. Sweep: for fp32 and bf16 state pools, every candidate of `CANDIDATES` runs the kernel (the triton backend's
   decode adapter, no dispatch) at N = 64 and 256 sequences of 1 and 4 tokens (HV = 32, K = V = 128, the
   bench's inputs), timed with `do_bench` (median); each candidate's outputs and pool are first compared
   with the rule's launch on the same inputs (a launch that computes something else is never chosen). The
   winner per dtype has the least geometric mean. Written to ``sweep.json``.
2. With the winners in force (`configs.DECODE_OVERRIDE`, in this process only): ``python -m kda.verify
   --backend triton`` over the decode case classes (``verify.json``), then the decode bench, eager and as
   CUDA-graph replays, FLA's kernel in the same process (``decode.json``).
3. Host time of one eager call at N = 1: kda through `auto` and by name, the adapter alone, the kernel's
   wrapper alone, FLA's kernel (``host.txt``, with a cProfile of kda's call).

The winners are then written into `kda/backends/triton/configs.py`'s ``_DECODE_TABLE`` by hand, with these
figures as their evidence, so that what ships is what was measured.
"""

from __future__ import annotations

import argparse
import cProfile
import io
import json
import math
import pstats
import sys
from pathlib import Path
from typing import Any

import torch

import kda
from kda.backends.base import RecurrentInputs
from kda.backends.triton import configs
from kda.backends.triton.recurrent_adapter import triton_recurrent
from kda.bench import timing
from kda.bench.decode import DECODE_SHAPES, DecodeShape, copy_bandwidth, decode_inputs, fla_direct, run_decode
from kda.recurrent.spec import RecurrentSpec

# (value columns, warps) at K = 128: 16 to 64 fp32 state values a thread (BK * BV / (32 * warps))
CANDIDATES = [(16, 1), (16, 2), (16, 4), (32, 2), (32, 4), (32, 8), (64, 4), (64, 8), (128, 8)]
SWEEP_SHAPES = ["N64_T1", "N256_T1", "N64_T4", "N256_T4"]
STATE_BYTES = {"fp32": 4, "bf16": 2}


def adapter_call(kwargs: dict[str, Any]) -> Any:
    """The triton backend's decode adapter on these arguments (spec built once; no dispatch)."""
    spec = RecurrentSpec.from_call(**kwargs)
    names = ("q", "k", "v", "g", "beta", "A_log", "dt_bias", "initial_state", "cu_seqlens")
    inputs = RecurrentInputs(
        *(kwargs.get(n) for n in names), kwargs.get("ssm_state_indices"), kwargs.get("num_accepted_tokens"), None
    )
    return lambda: triton_recurrent(inputs, spec)


def outputs_match(kwargs: dict[str, Any], launch: configs.DecodeLaunch, state_bytes: int) -> float:
    """Largest relative difference of o and the pool between this launch and the rule's, on copies."""
    results = []
    for override in (None, launch):
        configs.DECODE_OVERRIDE.clear()
        if override is not None:
            configs.DECODE_OVERRIDE[state_bytes] = override
        fresh = {**kwargs, "initial_state": kwargs["initial_state"].clone()}
        o = adapter_call(fresh)().o
        results.append((o.float(), fresh["initial_state"].float()))
    configs.DECODE_OVERRIDE.clear()
    (o_a, s_a), (o_b, s_b) = results
    return max(((o_a - o_b).norm() / o_a.norm()).item(), ((s_a - s_b).norm() / s_a.norm()).item())


def sweep(device: torch.device, bandwidth: float) -> dict[str, Any]:
    """Every candidate at every sweep shape, per pool dtype, and the winners (see the module docstring)."""
    found: dict[str, Any] = {
        "copy_bandwidth": bandwidth, "candidates": CANDIDATES, "shapes": SWEEP_SHAPES, "rows": [], "winners": {}
    }  # fmt: skip
    for pool, state_bytes in STATE_BYTES.items():
        scores = {}
        for block_v, warps in CANDIDATES:
            launch = configs.DecodeLaunch(block_v, warps)
            times = []
            for short in SWEEP_SHAPES:
                shape = DecodeShape.parse(f"{short}_HV32_D128_{pool}")
                kwargs = decode_inputs(shape, device, seed=0)
                try:
                    diff = outputs_match(kwargs, launch, state_bytes)
                    configs.DECODE_OVERRIDE[state_bytes] = launch
                    ms = timing.median_ms(adapter_call(kwargs), device, warmup_ms=25, rep_ms=100)
                except Exception as error:  # a launch that does not compile or run: out of the running
                    diff, ms = math.inf, math.inf
                    print(f"{pool} {launch}: {type(error).__name__}: {str(error)[:200]}", flush=True)
                finally:
                    configs.DECODE_OVERRIDE.clear()
                pct = 100 * shape.floor_bytes() / (ms * 1e-3) / bandwidth if ms < math.inf else 0
                row = {"pool": pool, "block_v": block_v, "warps": warps, "shape": shape.name, "ms": ms,
                       "pct_copy": pct, "diff": diff}  # fmt: skip
                found["rows"].append(row)
                print(json.dumps(row), flush=True)
                times.append(ms if diff < 1e-3 else math.inf)  # a gross error only: the verifier judges the winner
            scores[(block_v, warps)] = math.exp(sum(math.log(t) for t in times) / len(times))
        best = min(scores, key=scores.__getitem__)
        found["winners"][pool] = {"block_v": best[0], "num_warps": best[1], "geomean_ms": scores[best]}
    return found


def host_time(device: torch.device, out: Path) -> None:
    """Where one eager call's time goes at N = 1 (host-bound: do_bench's median is then the host's time)."""
    shape = DecodeShape.parse("N1_T1_HV32_D128_fp32")
    kwargs = decode_inputs(shape, device, seed=0)
    from kda.backends.triton.recurrent import recurrent_forward

    spec = RecurrentSpec.from_call(**kwargs)
    direct = {
        "q": kwargs["q"], "k": kwargs["k"], "v": kwargs["v"], "g": kwargs["g"], "beta": kwargs["beta"],
        "scale": spec.scale, "A_log": kwargs["A_log"], "dt_bias": kwargs["dt_bias"], "use_gate_in_kernel": True,
        "lower_bound": -5.0, "use_qk_l2norm_in_kernel": True, "use_beta_sigmoid_in_kernel": True,
        "allow_neg_eigval": False, "state_v_first": False, "initial_state": kwargs["initial_state"],
        "ssm_state_indices": kwargs["ssm_state_indices"], "final_state": kwargs["initial_state"],
        "out": torch.empty_like(kwargs["v"]),
    }  # fmt: skip
    calls = {
        "kda auto": lambda: kda.fused_recurrent_kda(**kwargs),
        "kda backend=triton": lambda: kda.fused_recurrent_kda(**kwargs, backend="triton"),
        "triton adapter (no spec, no dispatch)": adapter_call(kwargs),
        "recurrent_forward (the kernel's wrapper)": lambda: recurrent_forward(**direct),
    }
    fla = fla_direct(kwargs)
    if not isinstance(fla, str):
        calls["FLA fused_recurrent_kda_fwd"] = fla
    lines = []
    for name, call in calls.items():
        ms = timing.median_ms(call, device, warmup_ms=50, rep_ms=300)
        lines.append(f"{name}: {ms * 1e3:.1f} us a call")
    profiler = cProfile.Profile()
    call = calls["kda backend=triton"]
    profiler.enable()
    for _ in range(2000):
        call()
    profiler.disable()
    torch.cuda.synchronize(device)
    text = io.StringIO()
    pstats.Stats(profiler, stream=text).sort_stats("tottime").print_stats(30)
    (out / "host.txt").write_text("\n".join(lines) + "\n\ncProfile of 2000 calls (backend=triton):\n" + text.getvalue())
    print("\n".join(lines), flush=True)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, required=True)
    args = parser.parse_args(argv)
    if not torch.cuda.is_available():
        print("decode_sweep.py needs a CUDA GPU", file=sys.stderr)
        return 2
    device = torch.device("cuda")
    args.out.mkdir(parents=True, exist_ok=True)
    found = sweep(device, copy_bandwidth(device, 1 << 30, 50, 300))
    (args.out / "sweep.json").write_text(json.dumps(found, indent=1))
    print(json.dumps(found["winners"]), flush=True)
    for pool, winner in found["winners"].items():  # the winners, for the rest of this process
        configs.DECODE_OVERRIDE[STATE_BYTES[pool]] = configs.DecodeLaunch(winner["block_v"], winner["num_warps"])
    from kda.verify import cli as verify_cli
    from kda.verify.recurrent import recurrent_grid

    keys = [cc.key for cc in recurrent_grid()]
    verified = verify_cli.main(["--backend", "triton", *[a for k in keys for a in ("--case", k)], "--json",
                                str(args.out / "verify.json")])  # fmt: skip
    print(f"verify: exit {verified}", flush=True)
    data = run_decode(
        list(DECODE_SHAPES), ["baseline:fla", "triton", "fla", "torch", "auto"], device, graph=True, tune=True
    )
    (args.out / "decode.json").write_text(json.dumps(data, indent=1))
    for row in data["rows"]:
        print(
            f"{row['shape']:24s} {row['backend']:13s} {row['status']:7s} eager {row['median_ms'] or 0:.4f} ms "
            f"({row['pct_floor'] or 0:.0f}%) graph {row['graph_ms'] or 0:.4f} ms ({row['graph_pct_floor'] or 0:.0f}%)"
            f" {row['chose'] or ''} {(row['reason'] or '')[:80]}",
            flush=True,
        )
    host_time(device, args.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
