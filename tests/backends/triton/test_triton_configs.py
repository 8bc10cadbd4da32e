"""Launch settings change how the triton kernels tile the work, never the numbers: every variant that
`benchmarks/triton_stages.py --sweep` may time is run here, in Triton's interpreter, against the float64
reference (column blocks of w and u narrower than the head dims, narrow state and output V blocks, the gate
cumsum split over column blocks)."""

from __future__ import annotations

import dataclasses

import pytest

pytest.importorskip("triton", reason="Triton is not installed (extra `triton`)")

from test_triton_backend import case_class, interpreter, small_case  # noqa: F401  (the fixture too)

from kda.spec import GateMode
from kda.verify.check import run_case

VARIANTS = [
    {"intra_block_w": 16, "intra_stages": 1, "gate_block_k": 16},
    {"intra_block_w": 16, "state_block_v": 16, "output_block_v": 16, "gate_block_k": 8},
    {"intra_block_k": 8},
]
# The score products summed over K steps (intra_block_k) have their own l2norm handling: also run without.
CASES = {
    "softplus-l2-varlen-gva": dict(gate=GateMode.SOFTPLUS, beta="sigmoid2", varlen=True, gva=True),
    "pregated-no-l2": dict(gate=GateMode.PREGATED, qk_l2norm=False, beta="given"),
}


def _launch_with(monkeypatch, change: dict) -> list:
    """Make the forward (and the backward, which takes the forward's) launch with the shipped configuration
    so changed; returns the list of the configurations it chose, filled as calls are made."""
    from kda.backends.triton import configs, forward

    chosen = []

    def patched(capability_major, K, V):
        config = dataclasses.replace(configs.launch_config(capability_major, K, V), **change)
        chosen.append(config)
        return config

    monkeypatch.setattr(forward, "launch_config", patched)
    return chosen


@pytest.mark.parametrize(
    "change, case",
    [(c, "softplus-l2-varlen-gva") for c in VARIANTS] + [({"intra_block_k": 8}, "pregated-no-l2")],
    ids=lambda x: "-".join(f"{k}={v}" for k, v in x.items()) if isinstance(x, dict) else x,
)
def test_launch_settings_leave_the_numbers_alone(seed, interpreter, monkeypatch, change, case):  # noqa: F811
    from kda.backends.triton import configs

    chosen = _launch_with(monkeypatch, change)
    cc = case_class(**CASES[case], chunk_size=32)
    # K = 32, V = 48 (padded to 64): BW = 16 splits both into several column blocks, the last one ragged;
    # intra_block_k = 8 sums the score products over 4 steps.
    result = run_case(interpreter, small_case(cc, "extreme", K=32, V=48, seed=seed), "cpu")
    assert result.passed, (change, result.reason, result.errors)
    assert chosen and all(getattr(c, name) == value for c in chosen for name, value in change.items())
    if "intra_block_w" in change:
        assert all(configs.intra_block_w(c, 32, 64) == 16 for c in chosen)


def test_training_launch_settings_leave_the_gradients_alone(seed, interpreter, monkeypatch):  # noqa: F811
    """Training's own intra settings (w/u by 16 columns, as shipped for sm90 since version 17, where the CPU's
    default configuration keeps 32; the score products in K steps, as shipped above K = 128 since version 20)
    and the backward state pass by 16 V columns, on a training case: every gradient against the float64
    reference."""
    from kda.backends.triton import configs

    change = {"training_intra_block_w": 16, "training_intra_block_k": 8, "backward_state_block_v": 16}
    chosen = _launch_with(monkeypatch, change)
    cc = case_class(**CASES["softplus-l2-varlen-gva"], chunk_size=32, training=True)
    result = run_case(interpreter, small_case(cc, "extreme", K=32, V=48, seed=seed), "cpu")
    assert result.passed, (result.reason, result.errors)
    assert chosen and all(configs.intra_block_w(c, 32, 64, training=True) == 16 for c in chosen)
    assert all(configs.intra_block_k(c, 32, training=True) == 8 and configs.intra_block_k(c, 32) == 32 for c in chosen)


def test_training_takes_its_own_intra_columns_on_sm90():
    """The shipped sm90 table: training's intra by 16 w/u columns (TF32x3 products paid for narrower steps
    on the H200), inference by 32; where no training setting is given, training follows inference."""
    from kda.backends.triton import configs

    sm90 = configs.launch_config(9, 128, 128)
    assert configs.intra_block_w(sm90, 128, 128, training=True) == 16
    assert configs.intra_block_w(sm90, 128, 128) == 32
    other = configs.launch_config(None, 128, 128)
    assert configs.intra_block_w(other, 128, 128, training=True) == configs.intra_block_w(other, 128, 128) == 32


def test_training_steps_over_k_above_128_on_sm90():
    """The shipped sm90 table: above K = 128 training's intra sums its score products in K steps of 64 (its
    TF32x3 tiles, measured on the H200 at B8_T2048_H32_D256), inference in one step; at K <= 128 both in one step."""
    from kda.backends.triton import configs

    large, small = configs.launch_config(9, 256, 256), configs.launch_config(9, 128, 128)
    assert configs.intra_block_k(large, 256, training=True) == 64
    assert configs.intra_block_k(large, 256) == 256
    assert configs.intra_block_k(small, 128, training=True) == configs.intra_block_k(small, 128) == 128
    assert large.backward_state_warps == 8
