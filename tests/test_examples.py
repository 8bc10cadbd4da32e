"""The examples run as a user would run them, and say what they claim."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[1]


def run_example(name: str, tmp_path: Path) -> str:
    python_path = os.pathsep.join(p for p in (str(REPO_ROOT), os.environ.get("PYTHONPATH", "")) if p)
    env = {**os.environ, "PYTHONPATH": python_path, "KDA_CACHE_DIR": str(tmp_path / "cache"), "KDA_VERIFY": "lazy"}
    proc = subprocess.run(
        [sys.executable, str(REPO_ROOT / "examples" / name)],
        env=env,
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    return proc.stdout


def test_quickstart_runs_on_cpu_and_matches_the_reference(tmp_path):
    out = run_example("quickstart.py", tmp_path)
    assert "ran: [('torch', 'forward'), ('torch', 'backward')]" in out
    error = float(out.split("relative L2 error vs float64 reference:")[1].split()[0])
    assert error < 1e-3  # fp32 inputs
    assert "KDAInputError: `lower_bound`: the safe gate requires -5 <= lower_bound < 0; got -8.0" in out


def test_custom_backend_is_verified_chosen_for_inference_and_skipped_for_training(tmp_path):
    out = run_example("custom_backend.py", tmp_path)
    assert "inference ran on: recurrent-fp32" in out
    assert "chosen: recurrent-fp32" in out
    assert "training ran on: torch" in out
    assert (tmp_path / "cache" / "verification").is_dir()


def test_serving_decode_runs_pools_padding_and_speculative_decoding_on_cpu(tmp_path):
    out = run_example("serving_decode.py", tmp_path)
    assert "continuous batching: ran on ['torch']" in out
    pooled = float(out.split("request 0's pooled state vs chunk_kda:")[1].split()[0])
    assert pooled < 8e-3  # a bf16 pool, re-read every step: a few bf16 roundings, decayed
    assert "padding row output zero: True" in out
    accepted = float(out.split("accepted states vs one token at a time:")[1].split()[0])
    assert accepted < 8e-3  # one bf16 rounding (kda.verify.recurrent_policy.POOL_ROUNDING_TOLERANCE)


def test_context_parallel_runs_under_torchrun_on_two_cpu_processes(tmp_path):
    python_path = os.pathsep.join(p for p in (str(REPO_ROOT), os.environ.get("PYTHONPATH", "")) if p)
    env = {**os.environ, "PYTHONPATH": python_path, "KDA_CACHE_DIR": str(tmp_path / "cache"), "OMP_NUM_THREADS": "1"}
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2"]
    proc = subprocess.run(
        [*command, str(REPO_ROOT / "examples" / "context_parallel.py")],
        env=env,
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    lines = [line for line in proc.stdout.splitlines() if "parallel over 2 ranks" in line]
    assert [line.split()[0] for line in lines] == ["sequence", "head"], proc.stdout
    for line in lines:
        errors = line.split("relative error vs one call:")[1].split(",")
        assert all(float(part.split()[1]) < 1e-3 for part in errors), line  # fp32 inputs
