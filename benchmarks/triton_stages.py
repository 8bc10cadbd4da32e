"""Time each stage of the triton backend's forward on its own, at one bench shape (GPU only).

    KDA_TRITON_EXPERIMENTAL=1 python benchmarks/triton_stages.py B1_T8192_H96_D128 [more shapes]

Prints, per stage, the median ms (`triton.testing.do_bench`), the bytes it must move at least (reads
and writes of its inputs, intermediates and outputs) and the bandwidth that implies, against the H200's
~4.3 TB/s. The stage functions come from `plan_forward`, so this times exactly what the backend runs.
The state stage writes v_new over u, so repeated runs see drifting values: fine for timing only.
"""

from __future__ import annotations

import sys

import torch
from triton.testing import do_bench

import kda
from kda.backends.base import KDAInputs
from kda.backends.triton.forward import plan_forward
from kda.bench.shapes import MODES, BenchShape, make_inputs


def stage_bytes(spec: kda.KDASpec, name: str) -> int:
    tokens, HV, H, K, V, C = spec.B * spec.T, spec.HV, spec.H, spec.K, spec.V, spec.chunk_size
    chunks = -(-tokens // C)
    io = spec.dtype.itemsize
    G = w = tokens * HV * K * 4
    u = tokens * HV * V * 4
    A = chunks * HV * C * C * 4
    h = chunks * HV * K * V * 4
    return {
        "gate": tokens * HV * K * io + G,
        "intra": 2 * tokens * H * K * io + tokens * HV * V * io + G + 2 * 2 * A + w + u,
        "state": tokens * H * K * io + w + 2 * u + G + h,
        "output": tokens * H * K * io + G + h + u + A + tokens * HV * V * io,
    }[name]


def main(names: list[str]) -> None:
    for name in names or ["B1_T8192_H96_D128"]:
        inputs = make_inputs(BenchShape.parse(name), MODES["fwd"], "cuda", seed=0)
        spec = kda.KDASpec.from_call(**inputs.kwargs)
        call = KDAInputs(**{n: inputs.kwargs.get(n) for n in KDAInputs.__dataclass_fields__ if n in inputs.kwargs})
        stages, _ = plan_forward(call, spec)
        total = 0.0
        for stage, launch in stages:
            ms = do_bench(launch, warmup=25, rep=200, return_mode="median")
            total += ms
            moved = stage_bytes(spec, stage)
            print(f"{name} {stage:7s} {ms:8.3f} ms  {moved / 1e9:7.3f} GB  {moved / ms / 1e9:6.2f} TB/s")
        print(f"{name} {'total':7s} {total:8.3f} ms")
        torch.cuda.empty_cache()


if __name__ == "__main__":
    main(sys.argv[1:])
