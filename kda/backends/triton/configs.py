"""Launch configurations, chosen per GPU architecture and shipped with the package (no call-time tuning).

A configuration is picked from the compute capability's major version and the head dimensions; the
table is data, so that a tuning command can rewrite it. Entries marked ``measured=False`` are reasoned
defaults that no benchmark has confirmed yet.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class LaunchConfig:
    state_block_v: int  # BV of the serial state pass: V columns per program
    state_warps: int
    intra_warps: int
    output_block_v: int
    output_warps: int
    state_stages: int  # software pipelining of the state pass's loads (shared memory grows with it)
    measured: bool = False
    intra_block_w: int = 0  # columns of w and u per product in the intra kernel (0: all in one)
    # the same when training (0: as at inference). Training's intra multiplies in TF32x3 (`storage`), three
    # products for one, and narrower steps paid there (session 8, B4_T2048_H16_D128: 16 columns 0.76 ms
    # against 0.88 at 32, when inference is fastest at 32)
    training_intra_block_w: int = 0
    intra_stages: int = 3  # software pipelining of the intra kernel's loops (Triton's default)
    backward_warps: int = 4  # the backward's per-chunk kernel (session 7: 3.52 ms at 4 warps, 5.39 at 8)
    # Its V loops pipelined 2 deep, not Triton's default 3 (chosen when the kernel held whole [C, K] tiles and
    # shared memory was short; by blocks of K it needs 40-48 KB at 1 or 2 stages, compiled for sm90).
    backward_stages: int = 2
    gate_block_k: int = 32  # K columns per program of the gate cumsum
    # K columns per step of the intra kernel's score products (0: the whole head dim in one): [16, K/steps]
    # tiles instead of [16, K]. Slower at inference wherever measured (session 5 at K = 128, session 9 at
    # K = 256; `benchmarks/triton_stages.py --sweep` times 64 and 32).
    intra_block_k: int = 0
    # the same when training (0: as at inference). In TF32x3 whole [16, 256] score tiles cost three times the
    # registers' worth of splits; at K = 256 steps of 64 paid (session 9, B8_T2048_H32_D256: training's intra
    # 6.13 ms against 15.62 in one step; 128: 6.67)
    training_intra_block_k: int = 0
    gate_warps: int = 4
    # w and u from half-width products at inference (T and the rows rounded to bf16/fp16 first, as FLA's
    # recompute_w_u): measured offline on 60 random bf16 cases, error at median 0.69 of the tolerance
    # against 0.63 with TF32 products, p90 0.80 against 0.71. Off unless the H200 shows it pays.
    intra_half_products: bool = False
    backward_block_v: int = 32  # V columns per step of the backward's per-chunk kernel
    backward_block_k: int = 32  # K columns per block of the backward's per-chunk kernel (see `backward`)
    backward_state_block_v: int = 64  # BV of the backward's serial pass over chunks
    backward_state_warps: int = 4


# sm90, K <= 128: measured on an H200 (`benchmarks/triton_stages.py --sweep`, forward at B1_T8192_H96_D128,
# ms per stage; benchmarks/results/nvidia-h200/2026-11-29/).
# Session 4 (intermediates in the inputs' dtype; session4/sweep.txt), from the settings then shipped
# (state BV 32, 8 warps, 2 stages; output BV 64, 8 warps; intra 4 warps, whole rows, 3 stages):
#   shipped: intra 3.14, state 1.35, output 1.21
#   state BV 64, 4 warps, 2 stages: 0.72 (kept)   state BV 64, 8 warps: 1.03   state 4 warps: 1.10
#   state BV 128, 1 stage: 1.03                    state BV 16, 4 warps: 1.46    state 1 stage: 1.54
#   output 4 warps: 0.83 (kept)                    output BV 128: 1.20           output BV 32, 4 warps: 1.37
#   intra column blocks of 64, 1 stage: 2.75          of 64, 2 stages: 2.87      intra 8 warps: 4.79
# Then with the product inverse (session4/call2/sweep.txt), from state BV 64 / 4 warps, output 4 warps,
# intra column blocks of 64 with 1 stage, gate 32 columns: intra 2.24, state 0.73, output 0.83, gate 0.22
#   intra column blocks of 32: 2.20 (kept)  of 128: 2.56   intra 2 stages: 2.37   intra 8 warps: 3.97
#   intra 2 warps: 2.30 (taken in session 5) state 2 warps: 22.9 (spills)    state BV 128, 1 stage: 1.10
#   state BV 32, 4 warps: 1.10               output 2 warps: 0.78 (kept)     output BV 128: 1.18
#   gate 64 columns: 0.18 (kept)             gate 16 columns, 2 warps: 0.40
# Nsight Compute on session 4's first run: every kernel at 12.5% occupancy, held by registers (intra 255 a thread,
# state 186, output 141 at 8 warps), so fewer warps or narrower tiles win. Session 3 (fp32
# intermediates): intra 4 warps 2.87 against 8 warps 4.96. K > 128: sm90's K <= 128 choices carried over
# (reasoned, not swept: the previous 8-warp, whole-row intra setting took 12.96 ms at B8_T2048_H32_D256
# against FLA's 3.93), with the state pass at 1 stage for shared memory.
# Session 5 (session5/call2-v6/sweep.txt, from the settings below but intra at 4 warps): intra 2 warps
# 1.82 against 2.20 (kept); intra_block_k 32: 3.63, 64: 3.25, 32 with intra_block_w 16 (168 registers, no
# spill): 3.75; intra 8 warps 4.14; the state and output variants as before. K > 128 (call3-v7/sweep.txt,
# B8_T2048_H32_D256): intra 2 warps 2.64 against 2.80 at 4 (kept), 8 warps 4.22.
# Session 6 (session6/call2-v10/sweep.txt; the state pass and the output now multiply bf16 operands at
# inference): state 0.430 (BV 64, 4 warps, 2 stages, kept; BV 128 at 8 warps 0.477, at 4 warps 0.606; 3
# stages 0.623; BV 32 0.661); output BV 128 at 4 warps 0.460 (taken) against 0.569 for BV 64 at 2 warps
# (BV 128 at 2 warps 0.519, 8 warps 0.591); intra with half-width w/u products 1.765 against 1.834 (not
# taken: see `intra_half_products`). Training (B4_T2048_H16_D128, call3-v11/train-sweep.txt): the
# backward at 4 warps 8.81 ms against 8.67 at 8; its state pass at 8 warps 0.94 against 1.06 (BV 32: 1.48).
# Session 7 (training at B4_T2048_H16_D128, session7/call2-v14/train-sweep.txt; the backward's per-chunk
# kernel now by blocks of K): that kernel at 4 warps 3.52 ms against 5.39 at 8 (taken); K blocks of 64 at 4
# warps 3.60, at 8 warps 4.66; V blocks of 64 at 8 warps 7.00.
# Shared memory, from compiling for sm90 on a CPU (`python -m kda.backends.triton.aot`) against 227 KB per
# block on Hopper: every kernel fits at K = 128 and 256 with these settings there (Triton 3.9 and 3.6).
# Version 13's per-chunk kernel asked 248 KB at K = 256 on the H200 (it came to 213 KB here) and did not
# launch; taken by blocks of K (version 14) it needs 48 KB there, and ran on the H200. The backward's state
# pass holds whole [K, C] operands: in TF32x3 (version 16) it needs 288 KB at K = 256 with 64 V columns a
# program, 208 KB with 32 and 168 KB with 16 (Triton 3.6 and 3.9 alike, compiled here), so K > 128 took 16,
# which ran 117 ms at B8_T2048_H32_D256 on the H200 (32 columns: 68.7; session 8, call2-v16-sweep). In
# rounded TF32 (version 17) it needs 144 KB at 64 columns (Triton 3.6), as version 15 ran it in TF32: 15.0 ms.
# Session 8 (version 16, TF32x3, B4_T2048_H16_D128, call2-v16-sweep): the backward state pass at 8 warps
# 0.93 ms against 1.02 at 4, 16 columns 2.17, 32 columns 1.42 (at 8 warps 1.17); intra at 4 warps 0.84
# against 0.88, 8 warps 1.50, w/u columns by 16 0.76, by 64 1.41, 2 stages 1.13; the state pass at 8 warps
# 0.63 against 0.57. Version 17 (session8/call3-v17; the backward state pass in rounded TF32) swept again:
# that pass at 8 warps 0.40 ms against 0.59 at 4 (taken in version 18), 32 V columns 0.59; at K = 256
# (B8_T2048_H32_D256) 32 V columns 17.7 ms against 21.5 at 64 (taken in version 18; 8 warps not yet tried
# there); training's intra by 32 w/u columns 0.87 against 0.76 at 16, at 4 warps 0.88. Version 19 is back to
# TF32x3 in that pass (`storage`) and keeps both settings, which its TF32x3 sweep above also favoured: 8
# warps 0.93 ms against 1.02, and at K = 256 32 V columns 68.7 ms against 117 at 16 (64 does not fit;
# 32 needs 208 KB, compiled here with Triton 3.6, and ran on the H200 in that sweep).
# Session 9 (version 19 on the H200, session9/call1-v19/train-sweep-d256.txt, B8_T2048_H32_D256, 131.5 ms of
# kernels): the backward state pass at 8 warps 20.9 ms against 66.9 at 4 (TF32x3, 32 V columns), training's
# intra with the score products in K steps of 64 6.13 against 15.62 (128: 6.67), w/u by 16 columns 15.24.
# Version 20 takes both at K > 128, for training only; then (session9/call2-v20): 76.6 ms in all; inference's
# intra at K = 256 in steps of 64 3.55 ms against 2.62 in one (sweep.txt), training's at K = 128 in steps
# of 64 0.758 against 0.761 and of 32 0.812 (train-sweep.txt): neither taken.
_TABLE: dict[int, dict[str, LaunchConfig]] = {
    9: {
        "small": LaunchConfig(
            64,
            4,
            2,
            128,
            4,
            2,
            measured=True,
            intra_block_w=32,
            intra_stages=1,
            gate_block_k=64,
            training_intra_block_w=16,
            backward_state_warps=8,
        ),
        "large": LaunchConfig(
            64,
            4,
            2,
            64,
            4,
            1,
            measured=True,
            intra_block_w=32,
            intra_stages=1,
            gate_block_k=64,
            backward_state_block_v=32,
            backward_state_warps=8,
            training_intra_block_k=64,
        ),
    },
}
# Other architectures: sm90's choices, unmeasured there.
_DEFAULT = {
    "small": LaunchConfig(64, 4, 2, 128, 4, 2, intra_block_w=32, intra_stages=1, gate_block_k=64),
    "large": LaunchConfig(64, 4, 2, 64, 4, 1, intra_block_w=32, intra_stages=1, gate_block_k=64),
}


def launch_config(capability_major: int | None, K: int, V: int) -> LaunchConfig:
    size = "large" if max(K, V) > 128 else "small"
    return _TABLE.get(capability_major or 0, _DEFAULT)[size]


def _intra_columns(config: LaunchConfig, name: str, full: int, training: bool) -> int:
    """``config.<name>`` (or, when training, ``config.training_<name>`` where set), capped at ``full``;
    ``full`` where unset (0)."""
    chosen = getattr(config, "training_" + name) if training else 0
    chosen = chosen if chosen > 0 else getattr(config, name)
    return full if chosen <= 0 else min(full, chosen)


def intra_block_w(config: LaunchConfig, BK: int, BV: int, training: bool = False) -> int:
    """The intra kernel's BW: a power of two dividing both padded head dims."""
    return _intra_columns(config, "intra_block_w", min(BK, BV), training)


def intra_block_k(config: LaunchConfig, BK: int, training: bool = False) -> int:
    """The intra kernel's BKS: K columns per step of its score products (the whole padded K if unset)."""
    return _intra_columns(config, "intra_block_k", BK, training)
