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
    intra_stages: int = 3  # software pipelining of the intra kernel's loops (Triton's default)
    backward_warps: int = 8  # the backward's per-chunk kernel (not yet measured anywhere)
    # Its V loop pipelined 2 deep, not Triton's default 3: compiled for sm90, 213 KB of shared memory at
    # K = 256 (3 stages: 287 KB, over Hopper's 227 KB; 1 stage: 233 KB) and 115 KB at K = 128 (156 KB).
    backward_stages: int = 2


# sm90, K <= 128: measured on an H200 on 2026-11-29 (`benchmarks/triton_stages.py --sweep`, forward at
# B1_T8192_H96_D128; benchmarks/results/nvidia-h200/2026-11-29/session3/sweep.txt). Per stage, ms:
#   shipped (BV 32, 8 warps, 2 stages; output BV 64, 8 warps; intra 8 warps): intra 4.96, state 2.02, output 1.04
#   intra 4 warps: intra 2.87 (kept)            state 4 warps: 2.05      state BV 16, 4 warps: 3.87
#   state BV 64, 1 stage: 2.05                  state 1 stage: 2.65      output 4 warps: 1.04
#   output BV 128: 1.33                         output BV 32, 4 warps: 1.59
# Not yet swept: intra_block_w = 64 with intra_stages = 1 (32 KB of shared memory at K = 128 instead of
# 48 KB, so more programs per SM for a latency-bound kernel; `--sweep` times it). K > 128 keeps reasoned
# values (not swept). Shared memory, from compiling for sm90 on a CPU
# (tests/test_triton_compile.py): the state pass at C = 64 needs 57 KB with 1 pipeline stage, 148 KB with
# 2, 222 KB with 3 at K = 128, and 106 / 280 / 420 KB at K = 256, against 227 KB per block on Hopper:
# 2 stages up to K = 128, 1 above.
_TABLE: dict[int, dict[str, LaunchConfig]] = {
    9: {"small": LaunchConfig(32, 8, 4, 64, 8, 2, measured=True), "large": LaunchConfig(32, 8, 8, 32, 8, 1)},
}
# Other architectures: sm90's choices, unmeasured there (at K > 128 the intra kernel keeps 8 warps: its
# [C, K] fp32 tiles would need ~128 registers a thread with 4).
_DEFAULT = {"small": LaunchConfig(32, 8, 4, 64, 8, 2), "large": LaunchConfig(32, 8, 8, 32, 8, 1)}


def launch_config(capability_major: int | None, K: int, V: int) -> LaunchConfig:
    size = "large" if max(K, V) > 128 else "small"
    return _TABLE.get(capability_major or 0, _DEFAULT)[size]


def intra_block_w(config: LaunchConfig, BK: int, BV: int) -> int:
    """The intra kernel's BW: a power of two dividing both padded head dims."""
    full = min(BK, BV)
    return full if config.intra_block_w <= 0 else min(full, config.intra_block_w)
