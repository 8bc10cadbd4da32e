"""Launch settings change how the triton kernels tile the work, never the numbers: every variant that
`benchmarks/triton_stages.py --sweep` may time is run here, in Triton's interpreter, against the float64
reference (column blocks of w and u narrower than the head dims, narrow state and output V blocks, the gate
cumsum split over column blocks)."""

from __future__ import annotations

import dataclasses

import pytest

pytest.importorskip("triton", reason="Triton is not installed (extra `triton`)")

from test_triton_backend import case_class, interpreter, small_case  # noqa: E402, F401  (the fixture too)

from kda.spec import GateMode  # noqa: E402
from kda.verify.check import run_case  # noqa: E402

VARIANTS = [
    {"intra_block_w": 16, "intra_stages": 1, "gate_block_k": 16},
    {"intra_block_w": 16, "state_block_v": 16, "output_block_v": 16, "gate_block_k": 8},
]


@pytest.mark.parametrize("change", VARIANTS, ids=lambda c: "-".join(f"{k}={v}" for k, v in c.items()))
def test_launch_settings_leave_the_numbers_alone(seed, interpreter, monkeypatch, change):  # noqa: F811
    from kda.backends.triton import configs, forward

    chosen = []

    def patched(capability_major, K, V):
        config = dataclasses.replace(configs.launch_config(capability_major, K, V), **change)
        chosen.append(config)
        return config

    monkeypatch.setattr(forward, "launch_config", patched)
    cc = case_class(gate=GateMode.SOFTPLUS, beta="sigmoid2", varlen=True, gva=True, chunk_size=32)
    # K = 32, V = 48 (padded to 64): BW = 16 splits both into several column blocks, the last one ragged.
    result = run_case(interpreter, small_case(cc, "extreme", K=32, V=48, seed=seed), "cpu")
    assert result.passed, (change, result.reason, result.errors)
    assert chosen and all(configs.intra_block_w(c, 32, 64) == 16 for c in chosen)
