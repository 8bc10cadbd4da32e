"""benchmarks/cp_scaling.py on CPU processes (gloo, the torch backend, tiny sizes): its equality check runs
both modes against the one-process call and passes, every rank enters its timing steps, and `--report`
turns the lines of a one-rank and a two-rank run into speedups."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "benchmarks" / "cp_scaling.py"

dist = pytest.importorskip("torch.distributed")
if not dist.is_available():
    pytest.skip("torch.distributed is not available in this build", allow_module_level=True)


def _free_port() -> int:
    with socket.socket() as probe:  # the workers' store must know its port: torchrun's port 0 is not passed on
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def _torchrun(world: int, out: Path, *extra: str) -> subprocess.CompletedProcess:
    command = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", str(world)]
    command += ["--master-addr", "127.0.0.1", "--master-port", str(_free_port())]
    command += [str(SCRIPT), "--tokens", "150", "--heads", "2", "--head-dim", "16", "--backend", "torch"]
    command += ["--steps", "2", "--out", str(out), *extra]
    env = {**os.environ, "CUDA_VISIBLE_DEVICES": "", "OMP_NUM_THREADS": "1"}
    return subprocess.run(command, capture_output=True, text=True, timeout=300, env=env, cwd=ROOT)


@pytest.mark.slow
def test_it_checks_times_and_reports_over_two_ranks(tmp_path):
    out = tmp_path / "cp.jsonl"
    done = _torchrun(2, out, "--check")
    assert done.returncode == 0, done.stderr[-3000:]
    rows = [json.loads(line) for line in out.read_text().splitlines()]
    checks = [r for r in rows if r["kind"] == "check"]
    assert {r["mode"] for r in checks} == {"sequence", "head"}
    assert all(r["passed"] and r["world"] == 2 for r in checks), checks
    assert all(set(r["errors"]) >= {"o", "final_state", "dq", "dA_log", "dinitial_state"} for r in checks)
    times = [r for r in rows if r["kind"] == "time"]
    assert {r["mode"] for r in times} == {"sequence", "head"}
    assert all(r["step_ms"] > 0 and r["comm_ms"] > 0 and len(r["steps_ms"]) == 2 for r in times), times

    done = _torchrun(1, out)  # the baseline: the plain call, no context
    assert done.returncode == 0, done.stderr[-3000:]
    report = subprocess.run(
        [sys.executable, str(SCRIPT), "--report", str(out)], capture_output=True, text=True, timeout=60, cwd=ROOT
    )
    assert report.returncode == 0, report.stdout + report.stderr
    lines = report.stdout.splitlines()
    assert sum("check" in line and "pass" in line for line in lines) == 2
    speedups = [line for line in lines if line.startswith(("sequence", "head"))]
    assert len(speedups) == 2 and all(line.rstrip().endswith("%") for line in speedups), report.stdout


def test_it_needs_torchrun_or_a_report(tmp_path):
    done = subprocess.run([sys.executable, str(SCRIPT)], capture_output=True, text=True, timeout=60, cwd=ROOT)
    assert done.returncode == 2 and "torchrun" in done.stdout
