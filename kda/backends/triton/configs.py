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


# Reasoned, not yet measured. The state pass holds S [K, 32] and a chunk's w, k [64, K] in fp32; the
# intra kernel A_kk and its inverse [64, 64] and w's input [64, K]: 8 warps keep either near 128
# registers a thread at K = 128. Shared memory, from compiling for sm90 on a CPU (tests/test_triton_
# compile.py): the state pass at C = 64 needs 57 KB with 1 pipeline stage, 148 KB with 2, 222 KB with 3
# at K = 128, and 106 / 280 / 420 KB at K = 256, against 227 KB per block on Hopper: 2 stages up to
# K = 128, 1 above.
_TABLE: dict[int, dict[str, LaunchConfig]] = {
    9: {"small": LaunchConfig(32, 8, 8, 64, 8, 2), "large": LaunchConfig(32, 8, 8, 32, 8, 1)},
}
_DEFAULT = {"small": LaunchConfig(32, 8, 8, 64, 8, 2), "large": LaunchConfig(32, 8, 8, 32, 8, 1)}


def launch_config(capability_major: int | None, K: int, V: int) -> LaunchConfig:
    size = "large" if max(K, V) > 128 else "small"
    return _TABLE.get(capability_major or 0, _DEFAULT)[size]
