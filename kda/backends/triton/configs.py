"""Launch configurations, chosen per GPU architecture and shipped with the package (nothing is tuned at run time).

A configuration is picked from the compute capability's major version and the head dimensions; the
table is data, so that a tuning command can rewrite it. Entries marked ``measured=False`` are reasoned
defaults that no benchmark has confirmed yet.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True, kw_only=True)
class LaunchConfig:
    """One launch configuration of every kernel (keyword arguments only). Fields without a default are set
    in every table entry; the defaults are what an entry that leaves a field out gets."""

    state_block_v: int  # BV of the serial state pass: V columns per program
    state_warps: int
    state_stages: int  # software pipelining of the state pass's loads (shared memory grows with it)
    intra_warps: int
    output_block_v: int  # BV of the output: V columns per program
    output_warps: int
    measured: bool = False  # whether a benchmark on this architecture confirmed the entry
    intra_block_w: int = 0  # columns of w and u per product in the intra kernel (0: all in one)
    training_intra_block_w: int = 0  # the same when training (0: as at inference)
    intra_stages: int = 3  # software pipelining of the intra kernel's loops (Triton's default)
    # K columns per step of the intra kernel's score products (0: the whole head dim in one): [16, K/steps]
    # tiles instead of [16, K]
    intra_block_k: int = 0
    training_intra_block_k: int = 0  # the same when training (0: as at inference)
    # w and u from half-width products at inference (T and the rows rounded to bf16/fp16 first, as FLA's
    # recompute_w_u)
    intra_half_products: bool = False
    gate_block_k: int = 32  # K columns per program of the gate cumsum
    gate_warps: int = 4
    backward_warps: int = 4  # the backward's per-chunk kernel (`chunk_backward`)
    backward_stages: int = 2  # software pipelining of its V loops
    backward_block_v: int = 32  # V columns per step of the backward's per-chunk kernel
    backward_block_k: int = 32  # K columns per block of the backward's per-chunk kernel
    backward_state_block_v: int = 64  # BV of the backward's serial pass over chunks (`state_backward`)
    backward_state_warps: int = 4


# The evidence for each setting: H200 figures in ms, from `benchmarks/triton_stages.py --sweep` (inference,
# per stage, median of `do_bench`) or `--train-sweep` (training, GPU time per kernel from torch.profiler),
# at the bench shape named; "`aot`": shared memory from `python -m kda.backends.triton.aot` (compiled for sm90
# on a CPU, against 227 KB per block). The sweeps are rerun with `bash benchmarks/device/measure.sh sweep`.
_TABLE: dict[int, dict[str, LaunchConfig]] = {
    9: {
        # K and V <= 128
        "small": LaunchConfig(
            # H200, B1_T8192_H96_D128, --sweep: state 0.430 ms at 64 columns, 0.477 at 128 (8 warps), 0.661 at 32
            state_block_v=64,
            # H200, B1_T8192_H96_D128, --sweep: state 0.72 ms at 4 warps, 1.03 at 8, 22.9 at 2 (spills)
            state_warps=4,
            # H200, B1_T8192_H96_D128, --sweep: state 0.430 ms at 2 stages, 0.623 at 3 (1 stage: 1.54 against 0.72)
            state_stages=2,
            # H200, B1_T8192_H96_D128, --sweep: intra 1.82 ms at 2 warps, 2.20 at 4, 4.14 at 8
            intra_warps=2,
            # H200, B1_T8192_H96_D128, --sweep: output 0.460 ms at 128 columns (4 warps), 0.569 at 64 (2 warps)
            output_block_v=128,
            # H200, B1_T8192_H96_D128, --sweep: output (128 columns) 0.460 ms at 4 warps, 0.519 at 2, 0.591 at 8
            output_warps=4,
            # every setting here was measured on the H200 (the lines above and below)
            measured=True,
            # H200, B1_T8192_H96_D128, --sweep: intra 2.20 ms by 32 w/u columns, 2.24 by 64, 2.56 by 128
            intra_block_w=32,
            # H200, B4_T2048_H16_D128, --train-sweep: training's intra 0.76 ms by 16 columns, 0.87 by 32, 1.41 by 64
            training_intra_block_w=16,
            # H200, B1_T8192_H96_D128, --sweep: intra 2.24 ms at 1 stage, 2.37 at 2
            intra_stages=1,
            # H200, B1_T8192_H96_D128, --sweep (4 warps): intra 2.20 ms in one step, 3.25 in steps of 64, 3.63 of 32
            intra_block_k=0,
            # H200, B4_T2048_H16_D128, --train-sweep: training's intra 0.761 ms in one step, 0.758 of 64, 0.812 of 32
            training_intra_block_k=0,
            # H200, B1_T8192_H96_D128, --sweep: intra 1.765 ms against 1.834, but bf16 error at median 0.69 of
            # the tolerance against 0.63 (p90 0.80 against 0.71; 60 random cases on the CPU): off
            intra_half_products=False,
            # H200, B1_T8192_H96_D128, --sweep: gate 0.18 ms at 64 columns, 0.22 at 32
            gate_block_k=64,
            # Triton's default, not swept alone (H200, B1_T8192_H96_D128, --sweep: 16 columns at 2 warps 0.40 ms, 0.22)
            gate_warps=4,
            # H200, B4_T2048_H16_D128, --train-sweep: backward per-chunk kernel 3.52 ms at 4 warps, 5.39 at 8
            backward_warps=4,
            # `aot`, sm90: the per-chunk kernel needs 40-48 KB at 1 or 2 stages (2 chosen when shared memory was short)
            backward_stages=2,
            # H200, B4_T2048_H16_D128, --train-sweep (8 warps): per-chunk kernel 5.39 ms by 32 V columns, 7.00 by 64
            backward_block_v=32,
            # H200, B4_T2048_H16_D128, --train-sweep: per-chunk kernel 3.52 ms by 32 K columns, 3.60 by 64
            backward_block_k=32,
            # H200, B4_T2048_H16_D128, --train-sweep: backward state pass 1.02 ms at 64 columns, 1.42 at 32, 2.17 at 16
            backward_state_block_v=64,
            # H200, B4_T2048_H16_D128, --train-sweep: backward state pass (TF32x3) 0.93 ms at 8 warps, 1.02 at 4
            backward_state_warps=8,
        ),
        # K or V > 128
        "large": LaunchConfig(
            # carried over from K <= 128 (reasoned, not swept at K = 256)
            state_block_v=64,
            # carried over from K <= 128 (reasoned, not swept at K = 256)
            state_warps=4,
            # reasoned for shared memory (the state pass holds whole [K, BV] tiles at K = 256), not swept
            state_stages=1,
            # H200, B8_T2048_H32_D256, --sweep: intra 2.64 ms at 2 warps, 2.80 at 4, 4.22 at 8
            intra_warps=2,
            # carried over from K <= 128 before the output took 128 columns there (not swept at K = 256)
            output_block_v=64,
            # carried over from K <= 128 (reasoned, not swept at K = 256)
            output_warps=4,
            # intra's warps, the backward state pass and training's intra steps were measured on the H200
            measured=True,
            # carried over from K <= 128 (reasoned, not swept at K = 256)
            intra_block_w=32,
            # H200, B8_T2048_H32_D256, --train-sweep, one K step: training intra 15.62 ms by 32 w/u columns, 15.24 by 16
            training_intra_block_w=0,
            # carried over from K <= 128 (reasoned, not swept at K = 256)
            intra_stages=1,
            # H200, B8_T2048_H32_D256, --sweep: intra 2.62 ms in one step, 3.55 in steps of 64
            intra_block_k=0,
            # H200, B8_T2048_H32_D256, --train-sweep: training's intra 6.13 ms in steps of 64, 6.67 of 128, 15.62 in one
            training_intra_block_k=64,
            # as at K <= 128 (see there): off
            intra_half_products=False,
            # carried over from K <= 128 (reasoned, not swept at K = 256)
            gate_block_k=64,
            # carried over from K <= 128 (reasoned, not swept at K = 256)
            gate_warps=4,
            # carried over from K <= 128 (reasoned, not swept at K = 256)
            backward_warps=4,
            # `aot`, sm90: the per-chunk kernel needs 48 KB at K = 256, and ran on the H200
            backward_stages=2,
            # carried over from K <= 128 (reasoned, not swept at K = 256)
            backward_block_v=32,
            # carried over from K <= 128 (reasoned, not swept at K = 256)
            backward_block_k=32,
            # H200, B8_T2048_H32_D256, --train-sweep: backward state pass (TF32x3) 68.7 ms at 32 columns, 117 at
            # 16; 64 columns need 288 KB of shared memory (`aot`), past sm90's 227 KB
            backward_state_block_v=32,
            # H200, B8_T2048_H32_D256, --train-sweep: backward state pass 20.9 ms at 8 warps, 66.9 at 4
            backward_state_warps=8,
        ),
    },
}
# Other architectures: sm90's inference settings, unmeasured there (every other setting at its default).
_DEFAULT = {
    "small": LaunchConfig(
        state_block_v=64,
        state_warps=4,
        state_stages=2,
        intra_warps=2,
        output_block_v=128,
        output_warps=4,
        intra_block_w=32,
        intra_stages=1,
        gate_block_k=64,
    ),
    "large": LaunchConfig(
        state_block_v=64,
        state_warps=4,
        state_stages=1,
        intra_warps=2,
        output_block_v=64,
        output_warps=4,
        intra_block_w=32,
        intra_stages=1,
        gate_block_k=64,
    ),
}


@dataclass(frozen=True)
class DecodeLaunch:
    """The decode kernel's launch (`recurrent`): ``block_v`` value columns per program, its warps."""

    block_v: int
    num_warps: int


# The decode kernel, per architecture and state element size (4: fp32 states, 2: a bf16/fp16 pool), at head
# dims padded to 128 (where it was measured); elsewhere `recurrent.recurrent_config`'s rule. The evidence:
# H200, `benchmarks/decode_sweep.py` (every candidate timed on the same inputs, kernel alone, geometric mean
# over N = 64 and 256 sequences of 1 and 4 tokens, HV = 32, K = V = 128; `measure.sh decode-tune`).
_DECODE_TABLE: dict[int, dict[int, DecodeLaunch]] = {
    9: {
        # H200, fp32 pool: geometric mean 0.258 ms at 64 columns (4 warps), 0.280 at the rule's 32 (4 warps), 0.270
        # at 32 (2 warps), 0.29-0.32 at 16 columns, 0.37-0.50 at 8 warps (the reductions over K cross more warps);
        # N = 256, T = 1: 0.312 ms (82% of the copy bandwidth) against the rule's 0.344 (75%)
        4: DecodeLaunch(block_v=64, num_warps=4),
        # H200, bf16 pool: geometric mean 0.186 ms at 32 columns (2 warps), 0.227 at the rule's 4 warps, 0.197 at 16
        # columns (1 warp), 0.208 at 64 (4 warps: 0.217 at N = 256, T = 1, but 0.087 at N = 64 against 0.062);
        # N = 256, T = 1: 0.220 ms (59%) against the rule's 0.256 (51%)
        2: DecodeLaunch(block_v=32, num_warps=2),
    },
}
# Experiment-only: `benchmarks/decode_sweep.py` sets entries (state element size -> launch) to time candidates,
# and clears them afterwards. Nothing else sets it.
DECODE_OVERRIDE: dict[int, DecodeLaunch] = {}


def decode_launch(capability_major: int | None, K: int, V: int, state_bytes: int) -> DecodeLaunch | None:
    """The shipped (or, in an experiment, overridden) decode launch for this call, or None for the rule."""
    if state_bytes in DECODE_OVERRIDE:
        return DECODE_OVERRIDE[state_bytes]
    if not 64 < max(K, V) <= 128:  # measured at 128 only (K = 64 at 64 columns took 252 registers for sm90)
        return None
    return _DECODE_TABLE.get(capability_major or 0, {}).get(state_bytes)


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
