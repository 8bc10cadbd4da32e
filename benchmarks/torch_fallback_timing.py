"""What the torch fallback costs on a GPU: median ms of `chunk_kda(..., backend="torch")`.

Not a comparison (the baselines come with `python -m kda.bench`, issue 3): a figure for users who land on
the fallback. bf16, safe gate with l2norm and beta sigmoid in kernel, random inputs (never zeros).

    python benchmarks/torch_fallback_timing.py [--json PATH]
"""

from __future__ import annotations

import argparse
import json

import torch
import triton.testing

import kda

SHAPES = {"B4_T2048_H16_D128": (4, 2048, 16, 128), "B1_T8192_H96_D128": (1, 8192, 96, 128)}


def inputs(B: int, T: int, H: int, D: int, training: bool) -> dict:
    dev, bf16 = "cuda", torch.bfloat16
    t = {
        "q": torch.randn(B, T, H, D, device=dev, dtype=bf16),
        "k": torch.randn(B, T, H, D, device=dev, dtype=bf16),
        "v": torch.randn(B, T, H, D, device=dev, dtype=bf16),
        "g": torch.randn(B, T, H, D, device=dev, dtype=bf16),
        "beta": torch.randn(B, T, H, device=dev, dtype=bf16),
    }
    for x in t.values():
        x.requires_grad_(training)
    return dict(
        **t,
        A_log=torch.rand(H, device=dev) * 2,
        dt_bias=torch.randn(H * D, device=dev),
        use_gate_in_kernel=True,
        safe_gate=True,
        lower_bound=-5.0,
        use_qk_l2norm_in_kernel=True,
        use_beta_sigmoid_in_kernel=True,
        backend="torch",
    )


def forward_step(call: dict):
    def step():
        with torch.no_grad():
            kda.chunk_kda(**call)

    return step


def training_step(call: dict, do: torch.Tensor):
    def step():
        o, _ = kda.chunk_kda(**call)
        o.backward(do)

    return step


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--json")
    args = parser.parse_args()
    rows = []
    for name, shape in SHAPES.items():
        for mode in ("fwd", "fwd+bwd"):
            call = inputs(*shape, training=mode != "fwd")
            step = forward_step(call) if mode == "fwd" else training_step(call, torch.randn_like(call["v"]))
            try:
                step()  # verification (first use) and warm-up outside the timing
                torch.cuda.reset_peak_memory_stats()
                ms = triton.testing.do_bench(step, warmup=50, rep=500, return_mode="median")
            except torch.cuda.OutOfMemoryError as error:  # the fallback's [C, C, K] intermediates, kept for backward
                rows.append({"shape": name, "mode": mode, "backend": "torch", "error": f"out of memory: {error}"[:200]})
                print(f"{name:<20} {mode:<8} torch  out of memory", flush=True)
                torch.cuda.empty_cache()
                continue
            peak = torch.cuda.max_memory_allocated() / 2**30
            rows.append({"shape": name, "mode": mode, "backend": "torch", "median_ms": ms, "peak_gib": peak})
            print(f"{name:<20} {mode:<8} torch {ms:9.2f} ms   peak {peak:6.1f} GiB", flush=True)
            del call, step
            torch.cuda.empty_cache()
    if args.json:
        with open(args.json, "w") as handle:
            json.dump(
                {"gpu": torch.cuda.get_device_name(), "torch": torch.__version__, "kda": kda.__version__, "rows": rows},
                handle,
                indent=1,
            )


if __name__ == "__main__":
    main()
