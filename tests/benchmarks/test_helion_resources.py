"""benchmarks/helion_resources.py: the helion backend's kernels compiled for sm_90a without a GPU, their
registers, spills and shared memory read from the code, and the occupancy an H200 SM gives them."""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from benchmark_scripts import load

ROOT = Path(__file__).resolve().parents[2]
helion_resources = load("helion_resources")


@pytest.mark.parametrize(
    ("registers", "shared", "warps", "expected"),
    [
        (128, 110592, 8, (2, 16)),  # the tilelang `intra` at K = V = 128: two blocks of 256 threads fill an SM
        (142, 110592, 8, (1, 8)),  # ... and 142 registers halve it
        (255, 33792, 4, (2, 8)),  # registers bind: 256 a thread, 4 warps, 32768 a block
        (56, 5120, 4, (9, 36)),  # 56 registers round up to 1792 a warp
        (32, 1152, 4, (16, 64)),  # the warp limit
        (16, 0, 1, (32, 32)),  # the block limit
        (64, 232448, 4, (1, 4)),  # a block's whole shared memory
        (64, 232449, 4, (0, 0)),  # one byte more does not fit
    ],
)
def test_occupancy_of_an_h200_sm(registers, shared, warps, expected):
    assert helion_resources.occupancy(registers, shared, warps) == expected


def test_a_report_row_names_what_failed_and_what_does_not_fit():
    records = [
        dict(kernel="state", label="chosen", config={"block_sizes": [32]}, error="OutOfResources: shared memory"),
        dict(
            kernel="output",
            label="chosen",
            config={"block_sizes": [128]},
            grid=[4, 2],
            num_warps=4,
            num_stages=1,
            registers=64,
            shared=300000,
            spill_stores=0,
            spill_loads=0,
            generate_s=0.5,
            compile_s=1.25,
        ),
    ]
    table = helion_resources.report(records, "3.6.0")
    assert "| state | chosen | [32] | failed: OutOfResources: shared memory" in table
    assert "| output | chosen | [128] | 8 | 4 | 1 | 64 | 0/0 | 300000 | 0 | 0 | does not fit | 0.50 | 1.25 |" in table
    assert "0.5 s generating the 1 kernels' code (Helion) and 1.2 s compiling it" in table  # failed ones not counted


@pytest.mark.skipif(importlib.util.find_spec("helion") is None, reason="Helion is not installed (extra `helion`)")
def test_a_training_call_compiles_for_sm90_and_reports_its_kernels(tmp_path):
    """A small training call, two kernels: each compiled to sm_90a code whose resources were read."""
    out = tmp_path / "records.json"
    env = {key: value for key, value in os.environ.items() if key not in ("TRITON_INTERPRET", "HELION_INTERPRET")}
    command = [sys.executable, str(ROOT / "benchmarks" / "helion_resources.py"), "B1_T200_H2_D64", "--mode",
               "train_safe", "--kernel", "state", "--kernel", "gate_tail", "--default", "--json", str(out)]  # fmt: skip
    done = subprocess.run(command, env=env, capture_output=True, text=True, timeout=600, cwd=ROOT)
    assert done.returncode == 0, done.stderr[-3000:]
    records = json.loads(out.read_text())
    assert {record["kernel"] for record in records} == {"state", "gate_tail"}
    for record in records:
        assert "error" not in record, record
        assert 0 < record["registers"] <= 255, record
        assert record["spill_stores"] is not None and record["shared"] > 0, record
        assert record["grid"][0] > 0 and record["num_warps"] in (1, 2, 4, 8, 16, 32)
        assert record["generate_s"] > 0 and record["compile_s"] > 0, record
    assert "| state | chosen |" in done.stdout and "sm_90a code, Triton" in done.stdout
