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
    measured: bool = False


# sm90 (Hopper): not yet measured; 4 warps hold a [128, 32] fp32 state in registers comfortably.
_TABLE: dict[int, dict[str, LaunchConfig]] = {
    9: {"small": LaunchConfig(32, 4, 4), "large": LaunchConfig(32, 8, 8)},
}
_DEFAULT = {"small": LaunchConfig(32, 4, 4), "large": LaunchConfig(32, 8, 8)}


def launch_config(capability_major: int | None, K: int, V: int) -> LaunchConfig:
    size = "large" if max(K, V) > 128 else "small"
    return _TABLE.get(capability_major or 0, _DEFAULT)[size]
