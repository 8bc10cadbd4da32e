"""Time each stage of the triton backend's forward on its own, at one bench shape (GPU only).

    python benchmarks/triton_stages.py B1_T8192_H96_D128 [more shapes]
    python benchmarks/triton_stages.py --sweep B1_T8192_H96_D128        # launch-setting variants
    ncu ... python benchmarks/triton_stages.py --once B1_T8192_H96_D128 # each stage launched once, for a profiler
    python benchmarks/triton_stages.py --train-sweep B4_T2048_H16_D128  # training: kernels per variant

Prints, per stage, the first call's seconds (compilation included, on a cold Triton cache), the median
ms (`triton.testing.do_bench`), the bytes it must move at least (reads and writes of its inputs,
intermediates and outputs) and the bandwidth that implies, against the H200's ~4.3 TB/s. The stage functions come from `plan_forward`, so this times exactly what the backend runs.
The state stage writes v_new over u, so repeated runs see drifting values: fine for timing only.
"""

from __future__ import annotations

import dataclasses
import os
import sys
import time

import torch
from triton.testing import do_bench

import kda
from kda.backends.base import KDAInputs
from kda.backends.triton import forward as triton_forward_module
from kda.backends.triton.configs import launch_config
from kda.backends.triton.forward import plan_forward
from kda.backends.triton.storage import storage_dtype
from kda.bench.shapes import MODES, BenchShape, make_inputs


def stage_bytes(spec: kda.KDASpec, name: str) -> int:
    """Bytes a stage must read and write at least (each tensor once; the fp32 A_kk/T scratch that the intra
    kernel writes and reads back twice is counted, since it does not stay in one program's registers)."""
    tokens, HV, H, K, V, C = spec.B * spec.T, spec.HV, spec.H, spec.K, spec.V, spec.chunk_size
    chunks = -(-tokens // C)
    io = spec.dtype.itemsize
    store = storage_dtype(spec).itemsize
    G = tokens * HV * K * 4
    w = k_g = tokens * HV * K * store
    u = tokens * HV * V * store
    A_kk, A_qk = chunks * HV * C * C * 4, chunks * HV * C * C * store
    h = chunks * HV * K * V * store
    G_last = chunks * HV * K * 4
    return {
        "gate": tokens * HV * K * io + G,
        "intra": 2 * tokens * H * K * io + tokens * HV * V * io + G + 3 * A_kk + A_qk + w + k_g + u,
        "state": w + k_g + G_last + 2 * u + h,
        "output": tokens * H * K * io + G + h + u + A_qk + tokens * HV * V * io,
    }[name]


def forward_call(name: str) -> tuple[kda.KDASpec, KDAInputs]:
    """The bench's `fwd` inputs at this shape, as the backend receives them."""
    inputs = make_inputs(BenchShape.parse(name), MODES["fwd"], "cuda", seed=0)
    spec = kda.KDASpec.from_call(**inputs.kwargs)
    return spec, KDAInputs(**{n: inputs.kwargs.get(n) for n in KDAInputs.__dataclass_fields__ if n in inputs.kwargs})


def main(names: list[str]) -> None:
    for name in names or ["B1_T8192_H96_D128"]:
        spec, call = forward_call(name)
        stages, _ = plan_forward(call, spec)
        total = 0.0
        for stage, launch in stages:
            began = time.perf_counter()
            launch()
            torch.cuda.synchronize()
            print(f"{name} {stage:7s} first call {time.perf_counter() - began:6.2f} s")
            ms = do_bench(launch, warmup=25, rep=200, return_mode="median")
            total += ms
            moved = stage_bytes(spec, stage)
            print(f"{name} {stage:7s} {ms:8.3f} ms  {moved / 1e9:7.3f} GB  {moved / ms / 1e9:6.2f} TB/s")
        print(f"{name} {'total':7s} {total:8.3f} ms")
        torch.cuda.empty_cache()


# Launch-config variants for `--sweep` (the serial state pass and the output are the config-sensitive stages).
SWEEP = [
    {},
    {"intra_block_w": 32},
    {"intra_block_w": 128},
    {"intra_stages": 2},
    {"intra_warps": 8},
    {"intra_warps": 2},
    {"state_warps": 2},
    {"state_block_v": 128, "state_warps": 4, "state_stages": 1},
    {"state_block_v": 32, "state_warps": 4},
    {"output_block_v": 128},
    {"output_block_v": 32},
    {"output_warps": 2},
    {"gate_block_k": 64},
    {"gate_block_k": 16, "gate_warps": 2},
    {"intra_block_k": 64},
    {"intra_block_k": 32},
    {"intra_block_k": 64, "intra_warps": 8},
    {"intra_block_k": 32, "intra_block_w": 16},
    # the state pass and the output on half-width tensor cores (operands half the registers)
    {"state_block_v": 128, "state_warps": 8, "state_stages": 2},
    {"state_block_v": 128, "state_warps": 4, "state_stages": 2},
    {"state_stages": 3},
    {"output_block_v": 128, "output_warps": 4},
    {"output_warps": 4},
    {"output_warps": 8},
    {"intra_half_products": True},
    # the intra kernel's PARTS timing switch (`intra`): where its time goes (scores; scores and inverse)
    {"intra_parts": 1},
    {"intra_parts": 2},
]


def sweep(names: list[str]) -> None:
    """Time the stages under each variant of the shipped launch configuration (an explicit tuning run:
    nothing is tuned at call time; a winner is written into `configs` by hand, marked measured)."""
    for name in names or ["B1_T8192_H96_D128"]:
        spec, call = forward_call(name)
        shipped = launch_config(torch.cuda.get_device_capability()[0], spec.K, spec.V)
        only = os.environ.get("SWEEP_ONLY")  # e.g. "intra_warps|output": the variants whose text contains one
        for change in [c for c in SWEEP if not only or not c or any(part in str(c) for part in only.split("|"))]:
            config = dataclasses.replace(
                shipped, **{key: value for key, value in change.items() if key != "intra_parts"}
            )
            triton_forward_module.launch_config = lambda *_, config=config: config
            intra_kernel = triton_forward_module.intra_chunk_kernel
            if "intra_parts" in change:
                triton_forward_module.intra_chunk_kernel = _WithConstant(intra_kernel, "PARTS", change["intra_parts"])
            try:
                stages, _ = plan_forward(call, spec)
                times = {stage: do_bench(launch, warmup=25, rep=100, return_mode="median") for stage, launch in stages}
                shown = " ".join(f"{stage}={ms:.3f}" for stage, ms in times.items())
                print(f"{name} {change or 'shipped'} total={sum(times.values()):.3f} ms  {shown}")
            except Exception as error:  # e.g. out of shared memory: report and go on
                print(f"{name} {change}: {type(error).__name__}: {str(error)[:200]}")
            triton_forward_module.intra_chunk_kernel = intra_kernel
        triton_forward_module.launch_config = launch_config
        torch.cuda.empty_cache()


# Variants for `--train-sweep`: launch settings of the backward, which kernels multiply in TF32x3 (keys
# "precision.<kernel>" set the experiment-only `storage.TRAINING_<KERNEL>`), and "pairs" (the timing-only
# PAIRS switch of `chunk_backward`: 0 leaves out its pairwise terms, 1 their diagonal blocks).
# {"backward_block_v": 16} is left out: on the H200 (Triton 3.6, version 11) it ended in an illegal memory
# access that took every later variant of the process. SWEEP_INDEX runs one variant a process, by its index
# in this list (keep the order: recorded results name variants by index).
TRAIN_SWEEP = [
    {},
    {"pairs": 0},
    {"pairs": 1},
    {"backward_warps": 4},
    {"backward_block_k": 64},
    {"backward_block_k": 64, "backward_warps": 4},
    {"backward_block_v": 64},
    {"backward_stages": 1},
    {"precision.backward_chunk": "tf32"},
    {"backward_state_warps": 8},
    {"backward_state_block_v": 32},
    {"precision.backward_state": "tf32"},
    {"precision.state": "tf32"},
    {"precision.intra": "tf32"},
    # for K = 256 (B8_T2048_H32_D256 on the H200: the serial passes took 14.2 and 15.0 ms of 67.9 in training)
    {"state_block_v": 32},
    {"state_block_v": 16},
    {"backward_state_block_v": 32},
    {"backward_state_block_v": 8},
    # the launch settings of the kernels TF32x3 made slower (version 16, B4_T2048_H16_D128: intra
    # 0.87 ms against 0.38 in TF32, backward state pass 1.04 against 0.54), chosen when they ran in TF32
    {"intra_warps": 4},
    {"intra_warps": 8},
    {"intra_block_w": 64},
    {"intra_block_w": 16},
    {"intra_stages": 2},
    {"backward_state_block_v": 16},
    {"backward_state_block_v": 32, "backward_state_warps": 8},
    {"state_warps": 8},
    {"state_block_v": 32, "state_warps": 8},
    # version 17 (the backward state pass in rounded TF32, training's intra by 16 columns of w/u): what
    # TF32x3 costs in the other kernels, version 16's products, and intra by 32 columns, in one process
    {"precision.state": "tf32_rounded"},
    {"precision.backward_chunk": "tf32_rounded"},
    {"precision.intra": "tf32x3", "precision.backward_state": "tf32x3"},
    {"training_intra_block_w": 32},
    # for K = 256 (version 18 at B8_T2048_H32_D256: intra in TF32x3 15.8 ms, 3.1 in TF32): narrower w/u
    # columns, and the score products over K in steps (intra_block_k, shared with inference)
    {"training_intra_block_w": 16},
    {"intra_block_k": 64},
    {"intra_block_k": 128},
    # version 20 (training's intra in K steps of 64 above K = 128, `training_intra_block_k`): the steps at
    # K = 256 against one whole step, and the same setting at K = 128 (B4_T2048_H16_D128)
    {"training_intra_block_k": 256},
    {"training_intra_block_k": 64},
    {"training_intra_block_k": 32},
]


class _WithConstant:
    """A kernel launched with one of its timing-only switches (a constexpr: intra's PARTS, the backward
    per-chunk kernel's PAIRS) set, in place of the module attribute the host code launches."""

    def __init__(self, kernel, name: str, value: int) -> None:
        self.kernel, self.name, self.value = kernel, name, value

    def __getitem__(self, grid):
        launch = self.kernel[grid]
        return lambda *args, **kwargs: launch(*args, **{self.name: self.value}, **kwargs)


def train_sweep(names: list[str]) -> None:
    """Forward (saving for the backward) and backward of the bench's `train_safe` inputs, GPU time per
    kernel under each `TRAIN_SWEEP` variant (torch.profiler; the backward's elementwise tail in torch is
    summed as "torch")."""
    from profile_kernels import kernel_table

    from kda.backends.triton import backward, storage

    for name in names or ["B4_T2048_H16_D128"]:
        inputs = make_inputs(BenchShape.parse(name), MODES["train_safe"], "cuda", seed=0)
        spec = kda.KDASpec.from_call(**inputs.kwargs, requires_grad=True)
        call = KDAInputs(**{n: inputs.kwargs.get(n) for n in KDAInputs.__dataclass_fields__ if n in inputs.kwargs})
        shipped = launch_config(torch.cuda.get_device_capability()[0], spec.K, spec.V)
        defaults = {attr: getattr(storage, attr) for attr in dir(storage) if attr.startswith("TRAINING_")}
        only = os.environ.get("SWEEP_ONLY")
        index = os.environ.get("SWEEP_INDEX")  # one variant per process: a crash takes no other variant
        chosen = [TRAIN_SWEEP[int(index)]] if index else TRAIN_SWEEP
        for change in [c for c in chosen if not only or not c or any(part in str(c) for part in only.split("|"))]:
            launch = {
                key: value for key, value in change.items() if not key.startswith("precision.") and key != "pairs"
            }
            config = dataclasses.replace(shipped, **launch)
            triton_forward_module.launch_config = lambda *_, config=config: config
            for key, value in change.items():
                if key.startswith("precision."):
                    setattr(storage, "TRAINING_" + key.split(".", 1)[1].upper(), value)
            chunk_kernel = backward.bwd_chunk_kernel
            if "pairs" in change:
                backward.bwd_chunk_kernel = _WithConstant(chunk_kernel, "PAIRS", change["pairs"])

            def step(call=call, spec=spec, inputs=inputs) -> None:
                stages, finish = plan_forward(call, spec)
                for _, run in stages:
                    run()
                backward.triton_backward(call, spec, finish().saved, inputs.do, None)

            try:
                for _ in range(2):
                    step()
                rows = kernel_table(step, 5)
                kernels = {kernel: us for kernel, _, us in rows if not kernel.startswith(("void", "Memset"))}
                torch_us = sum(us for kernel, _, us in rows if kernel.startswith(("void", "Memset")))
                shown = " ".join(f"{kernel.replace('_kernel', '')}={us / 1e3:.3f}" for kernel, us in kernels.items())
                total = (sum(kernels.values()) + torch_us) / 1e3
                print(
                    f"{name} {change or 'shipped'} total={total:.3f} ms  {shown} torch={torch_us / 1e3:.3f}", flush=True
                )
            except Exception as error:  # e.g. out of shared memory: report and go on
                print(f"{name} {change}: {type(error).__name__}: {str(error)[:200]}", flush=True)
            for attr, value in defaults.items():
                setattr(storage, attr, value)
            backward.bwd_chunk_kernel = chunk_kernel
        triton_forward_module.launch_config = launch_config
        torch.cuda.empty_cache()


def once(names: list[str]) -> None:
    """Each stage launched once, nothing timed: the run a profiler (ncu) attaches to."""
    for name in names or ["B1_T8192_H96_D128"]:
        spec, call = forward_call(name)
        stages, _ = plan_forward(call, spec)
        for _, launch in stages:
            launch()
        torch.cuda.synchronize()


if __name__ == "__main__":
    if sys.argv[1:2] == ["--sweep"]:
        sweep(sys.argv[2:])
    elif sys.argv[1:2] == ["--train-sweep"]:
        train_sweep(sys.argv[2:])
    elif sys.argv[1:2] == ["--once"]:
        once(sys.argv[2:])
    else:
        main(sys.argv[1:])
