"""The triton backend's kernels, forward (at inference and as training runs it) and backward, compile for
Hopper (sm90) at the shipped configurations and fit its shared memory, checked on a CPU with Triton's real compiler (in a fresh
process: the other tests keep Triton in interpreter mode). What this cannot check without the GPU is
speed."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("triton", reason="Triton is not installed (extra `triton`)")


@pytest.mark.slow
def test_kernels_compile_for_sm90_within_shared_memory():
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["PYTHONPATH"] = os.pathsep.join([str(Path(__file__).resolve().parents[3]), env.get("PYTHONPATH", "")])
    done = subprocess.run(
        [sys.executable, "-m", "kda.backends.triton.aot", "--capability", "9", "--dims", "64x32,128x64,256x64"],
        capture_output=True,
        text=True,
        env=env,
        timeout=1200,
    )
    lines = [line for line in done.stdout.splitlines() if line.startswith("{")]
    if not lines and ("ptxas" in done.stderr or "No such file" in done.stderr):
        pytest.skip(f"Triton cannot compile for CUDA here: {done.stderr.strip().splitlines()[-1]}")
    assert lines, done.stderr[-2000:]
    report = json.loads(lines[-1])
    assert report["over"] == [], report
    assert done.returncode == 0
    for dims, needs in report["shared_bytes"].items():
        # the forward at inference and as training runs it, the backward and its tails (training is offered
        # at every K since version 14)
        kernels = {
            "gate",
            "intra",
            "state",
            "output",
            "intra_train",
            "state_train",
            "bwd_chunk",
            "bwd_state",
            "qk_tail",
            "gate_beta_tail",
        }
        assert set(needs) == kernels, dims
        registers = report["registers"][dims]
        assert set(registers) == kernels and set(report["spill_bytes"][dims]) == kernels, dims
        # where Triton ships cuobjdump, every kernel's registers are read (sm90 allows at most 255)
        assert all(n is None or 0 < n <= 255 for n in registers.values()), registers
