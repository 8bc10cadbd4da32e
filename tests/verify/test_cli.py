"""Tests of ``python -m kda.verify`` (`kda.verify.cli.main`), in process and as one subprocess.

Only a few cheap case classes are run (fp32, forward, chunk 32, head dim bucket 64, ``--quick``): the full
grid takes over a minute and is not a unit test.
"""

from __future__ import annotations

import json
import math
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
import torch

import kda
from kda.backends.torch import TorchBackend
from kda.verify import cli
from kda.verify.cases import full_grid
from kda.verify.records import RecordStore, default_store, fingerprint, fingerprint_id

REPO_ROOT = Path(__file__).resolve().parents[2]
CHEAP = "pregated/qk/beta/fp32/dense/mha/nostate/c32/d64/fwd"
CHEAP_2 = "softplus/l2/sig/fp32/dense/gva/h0+ht/c32/d64/fwd"
JSON_KEYS = {"kda", "device", "quick", "passed", "fingerprints", "unavailable", "results"}
RESULT_KEYS = {"backend", "case_class", "status", "worst_ratio", "cases"}


class WrongBackend(TorchBackend):
    """The torch backend with every output 1% too large."""

    name = "wrong"
    version = "1"
    priority = 100

    def forward(self, inputs, spec, out=None):
        result = super().forward(inputs, spec, None)
        result.o = result.o * 1.01
        return result


class MissingBackend(TorchBackend):
    name = "missing"

    def available(self):
        return kda.Verdict.no("package fancy_kernels is not installed")


class PickyBackend(TorchBackend):
    name = "picky"

    def supports(self, spec):
        return kda.Verdict.no("only does the safe gate")


def read_json(path: Path) -> dict:
    return json.loads(path.read_text())


def check_payload(payload: dict, backends: list[str], keys: list[str], *, passed: bool) -> None:
    assert set(payload) >= JSON_KEYS, set(payload) ^ JSON_KEYS
    assert payload["kda"] == kda.__version__
    assert payload["device"] == "cpu"
    assert payload["quick"] is True
    assert payload["passed"] is passed
    assert set(payload["fingerprints"]) == set(backends)
    results = payload["results"]
    assert [(r["backend"], r["case_class"]) for r in results] == [(b, k) for b in backends for k in keys]
    for r in results:
        assert set(r) >= RESULT_KEYS, r.keys()
        assert r["status"] in {"pass", "fail", "unsupported"}
        assert [c["regime"] for c in r["cases"]] == ["realistic", "correlated"]  # --quick
        case = r["cases"][0]
        assert {"seed", "passed", "errors", "T", "B"} <= set(case)


# ------------------------------------------------------------------------------------------- in process


def test_cli_passes_torch_and_writes_json_and_records(tmp_path, capsys):
    out_json = tmp_path / "report.json"
    code = cli.main(
        [
            "--backend",
            "torch",
            "--quick",
            "--device",
            "cpu",
            "--case",
            CHEAP,
            "--case",
            CHEAP_2,
            "--json",
            str(out_json),
        ]
    )
    assert code == 0
    out = capsys.readouterr().out
    assert CHEAP in out and CHEAP_2 in out and "2 passed, 0 failed" in out

    payload = read_json(out_json)
    check_payload(payload, ["torch"], [CHEAP, CHEAP_2], passed=True)
    assert payload["unavailable"] == {}
    torch_backend = kda.get_backend("torch")
    fp = payload["fingerprints"]["torch"]
    fp_id, forward_version, forward_id = fp.pop("id"), fp.pop("forward_version"), fp.pop("forward_id")
    assert fp == json.loads(json.dumps(fingerprint(torch_backend, "cpu")))
    assert fp_id == fingerprint_id(fingerprint(torch_backend, "cpu"))
    # one version for both kinds of class: the inference classes' id is the same one
    assert (forward_version, forward_id) == (torch_backend.version, fp_id)
    for r in payload["results"]:
        assert r["status"] == "pass"
        assert 0 < r["worst_ratio"] <= 1
        assert r["cases"][0]["errors"]["o"] < 1e-3
    assert "final_state" in payload["results"][1]["cases"][0]["errors"]  # CHEAP_2 has h0+ht

    # Records: one file per fingerprint, named by the same id; source "verify".
    record_file = Path(os.environ["KDA_CACHE_DIR"]) / "verification" / f"torch-{fp_id}.json"
    assert record_file.exists()
    for key in (CHEAP, CHEAP_2):
        record = default_store().get(torch_backend, "cpu", key)
        assert record is not None and record.passed and record.source == "verify" and record.quick
        assert record.cases and record.cases[0]["passed"] is True
    assert set(read_json(record_file)["records"]) == {CHEAP, CHEAP_2}


def test_cli_exit_1_when_a_backend_fails(tmp_path, capsys):
    kda.register_backend(WrongBackend)
    out_json = tmp_path / "report.json"
    code = cli.main(["--backend", "wrong", "--case", CHEAP, "--quick", "--device", "cpu", "--json", str(out_json)])
    assert code == 1
    out = capsys.readouterr().out
    assert "FAIL" in out and "wrong" in out and "0 passed, 1 failed" in out

    payload = read_json(out_json)
    check_payload(payload, ["wrong"], [CHEAP], passed=False)
    result = payload["results"][0]
    assert result["status"] == "fail"
    assert result["worst_ratio"] > 1 and math.isfinite(result["worst_ratio"])
    assert "rel. error" in result["reason"]
    record = default_store().get(kda.get_backend("wrong"), "cpu", CHEAP)
    assert record is not None and not record.passed and record.source == "verify"

    # torch and wrong together: torch passes, the run still fails.
    code = cli.main(["--backend", "torch", "--backend", "wrong", "--case", CHEAP, "--quick", "--device", "cpu"])
    assert code == 1


class BoomBackend(TorchBackend):
    name = "boom"

    def forward(self, inputs, spec, out=None):
        raise RuntimeError("boom")


def test_cli_backend_that_raises_fails_with_null_ratio_in_json(tmp_path, capsys):
    kda.register_backend(BoomBackend)
    out_json = tmp_path / "report.json"
    assert cli.main(["--backend", "boom", "--case", CHEAP, "--quick", "--device", "cpu", "--json", str(out_json)]) == 1
    assert "FAIL inf" in capsys.readouterr().out
    result = read_json(out_json)["results"][0]
    assert result["status"] == "fail" and result["worst_ratio"] is None  # inf is written as null
    assert "RuntimeError: boom" in result["reason"]
    record = default_store().get(kda.get_backend("boom"), "cpu", CHEAP)
    assert record is not None and math.isinf(record.worst_ratio) and not record.passed


def test_cli_exit_1_for_a_named_unavailable_backend(tmp_path, capsys):
    kda.register_backend(MissingBackend)
    out_json = tmp_path / "report.json"
    code = cli.main(["--backend", "missing", "--case", CHEAP, "--quick", "--device", "cpu", "--json", str(out_json)])
    assert code == 1
    assert "fancy_kernels" in capsys.readouterr().out
    payload = read_json(out_json)
    assert payload["unavailable"] == {"missing": ["package fancy_kernels is not installed"]}
    assert payload["results"] == [] and payload["passed"] is False
    assert not (Path(os.environ["KDA_CACHE_DIR"]) / "verification").exists() or not list(
        (Path(os.environ["KDA_CACHE_DIR"]) / "verification").glob("missing-*.json")
    )


def test_cli_unsupported_class_is_not_a_failure_and_not_recorded(tmp_path, capsys):
    kda.register_backend(PickyBackend)
    out_json = tmp_path / "report.json"
    assert cli.main(["--backend", "picky", "--case", CHEAP, "--quick", "--device", "cpu", "--json", str(out_json)]) == 0
    result = read_json(out_json)["results"][0]
    assert result["status"] == "unsupported"
    assert default_store().get(kda.get_backend("picky"), "cpu", CHEAP) is None


def test_cli_exit_2_for_unknown_backend(capsys):
    assert cli.main(["--backend", "no_such_backend", "--case", CHEAP, "--quick", "--device", "cpu"]) == 2
    err = capsys.readouterr().err
    assert "no_such_backend" in err and "torch" in err  # names the registered ones
    assert not (Path(os.environ["KDA_CACHE_DIR"]) / "verification").exists()


@pytest.mark.parametrize(
    "key",
    [
        "not-a-key",
        "pregated/qk/beta/fp32/dense/mha/nostate/c32/d64",  # one part short
        "pregated/qk/beta/fp32/dense/mha/nostate/c48/d64/fwd",  # chunk 48
        "pregated/qk/beta/fp8/dense/mha/nostate/c32/d64/fwd",  # unknown dtype
        "tanh/qk/beta/fp32/dense/mha/nostate/c32/d64/fwd",  # unknown gate
        "pregated/qk/beta/fp32/dense/mha/nostate/cXX/d64/fwd",
    ],
)
def test_cli_exit_2_for_malformed_case_key(capsys, key):
    assert cli.main(["--backend", "torch", "--case", CHEAP, "--case", key, "--quick", "--device", "cpu"]) == 2
    assert "not a case-class key" in capsys.readouterr().err
    assert not (Path(os.environ["KDA_CACHE_DIR"]) / "verification").exists()  # nothing ran


def test_cli_bad_flag_is_usage_error(capsys):
    with pytest.raises(SystemExit) as exit_info:
        cli.main(["--no-such-flag"])
    assert exit_info.value.code == 2


def _refuse_work(monkeypatch) -> None:
    def refuse(*args, **kwargs):
        raise AssertionError("verification started despite bad usage")

    monkeypatch.setattr(cli, "verify_class", refuse)
    monkeypatch.setattr(cli._Workers, "spread", refuse)


def _a_file(tmp_path: Path) -> Path:
    path = tmp_path / "a-file"
    path.write_text("not a directory")
    return path


BAD_USAGE = {
    "json-in-a-missing-folder": lambda tmp: ["--json", str(tmp / "missing" / "x.json")],
    "json-is-a-directory": lambda tmp: ["--json", str(tmp)],
    "json-under-a-file": lambda tmp: ["--json", str(_a_file(tmp) / "x.json")],
    "work-dir-under-a-file": lambda tmp: ["--jobs", "2", "--work-dir", str(_a_file(tmp) / "work")],
    "device-bogus": lambda tmp: ["--device", "bogus"],
    "device-malformed-index": lambda tmp: ["--device", "cuda:x"],
    "device-cuda-index-beyond-count": lambda tmp: ["--device", f"cuda:{torch.cuda.device_count()}"],
    "jobs-zero": lambda tmp: ["--jobs", "0"],
    "jobs-negative": lambda tmp: ["--jobs", "-3"],
}


def check_usage_error(code: int, err: str, prog: str) -> None:
    lines = [line for line in err.splitlines() if line.strip()]
    assert code == 2
    assert len(lines) == 1 and lines[0].startswith(f"{prog}: error: "), err
    assert "Traceback" not in err


@pytest.mark.parametrize("kind", sorted(BAD_USAGE))
def test_cli_bad_paths_and_devices_are_usage_errors_before_any_work(kind, tmp_path, capsys, monkeypatch):
    """Regression: a --json path in a missing folder or naming a directory, or a --device torch cannot parse
    or that is not here, printed a traceback and exited 1 (some only after verifying). Now: exit 2, one
    line on stderr, nothing verified."""
    _refuse_work(monkeypatch)
    code = cli.main(["--backend", "torch", "--case", CHEAP, "--quick", *BAD_USAGE[kind](tmp_path)])
    check_usage_error(code, capsys.readouterr().err, "python -m kda.verify")
    assert not (Path(os.environ["KDA_CACHE_DIR"]) / "verification").exists()


@pytest.mark.skipif(torch.cuda.is_available(), reason="CUDA is available here")
def test_cli_cuda_without_cuda_is_a_usage_error(capsys, monkeypatch):
    _refuse_work(monkeypatch)
    code = cli.main(["--backend", "torch", "--case", CHEAP, "--quick", "--device", "cuda"])
    err = capsys.readouterr().err
    check_usage_error(code, err, "python -m kda.verify")
    assert "CUDA" in err


def test_cli_with_an_unwritable_cache_verifies_and_says_the_records_are_not_saved(tmp_path, capsys, monkeypatch):
    """Regression: the first record write raised NotADirectoryError, a traceback after the first class. Now
    the run completes (one warning), and its summary says where the records could not go."""
    blocker = tmp_path / "a-file"
    blocker.write_text("not a directory")
    monkeypatch.setenv("KDA_CACHE_DIR", str(blocker / "kda-cache"))
    with pytest.warns(RuntimeWarning, match="verification records not saved"):
        code = cli.main(["--backend", "torch", "--case", CHEAP, "--case", CHEAP_2, "--quick", "--device", "cpu"])
    assert code == 0
    out = capsys.readouterr().out
    assert "2 passed, 0 failed" in out and "records NOT saved" in out
    assert default_store().get(kda.get_backend("torch"), "cpu", CHEAP).source == "verify"  # in memory


def test_list_cases_round_trips(capsys):
    assert cli.main(["--list-cases"]) == 0
    lines = [line for line in capsys.readouterr().out.splitlines() if line.strip()]
    expected = [cc.key for cc in full_grid()]
    assert lines == expected
    assert len(lines) == len(set(lines)) > 20
    for line in lines:
        case_class = kda.CaseClass.from_key(line)
        assert case_class.key == line
    assert not (Path(os.environ["KDA_CACHE_DIR"]) / "verification").exists()


# ------------------------------------------------------------------------------------------- subprocess


def test_cli_as_subprocess(tmp_path):
    cache = tmp_path / "cache"
    out_json = tmp_path / "report.json"
    # Keep whatever PYTHONPATH already holds (a machine may carry packages such as pydantic that way).
    python_path = os.pathsep.join(p for p in (str(REPO_ROOT), os.environ.get("PYTHONPATH", "")) if p)
    env = {
        **os.environ,
        "PYTHONPATH": python_path,
        "KDA_CACHE_DIR": str(cache),
        "KDA_VERIFY": "lazy",
        "OMP_NUM_THREADS": "1",
    }
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "kda.verify",
            "--backend",
            "torch",
            "--quick",
            "--device",
            "cpu",
            "--case",
            CHEAP,
            "--case",
            CHEAP_2,
            "--json",
            str(out_json),
        ],
        env=env,
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=180,
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "2 passed, 0 failed" in proc.stdout

    payload = read_json(out_json)
    check_payload(payload, ["torch"], [CHEAP, CHEAP_2], passed=True)
    assert payload["fingerprints"]["torch"]["packages"]["torch"] == torch.__version__

    # The subprocess's records are this process's records: same fingerprint, source "verify".
    store = RecordStore(cache)
    for key in (CHEAP, CHEAP_2):
        record = store.get(kda.get_backend("torch"), "cpu", key)
        assert record is not None and record.passed and record.source == "verify"
    files = sorted(p.name for p in (cache / "verification").glob("*.json"))
    assert files == [f"torch-{payload['fingerprints']['torch']['id']}.json"]


def test_cli_jobs_spread_classes_over_processes_and_merge(tmp_path, capsys, monkeypatch):
    """--jobs runs the classes in child processes (records land in the shared store) and reports them all."""
    monkeypatch.setenv(
        "PYTHONPATH", os.pathsep.join([str(Path(__file__).resolve().parents[2]), os.environ.get("PYTHONPATH", "")])
    )
    out_json = tmp_path / "report.json"
    code = cli.main(
        [
            "--backend",
            "torch",
            "--quick",
            "--device",
            "cpu",
            "--case",
            CHEAP,
            "--case",
            CHEAP_2,
            "--jobs",
            "2",
            "--work-dir",
            str(tmp_path / "work"),
            "--json",
            str(out_json),
        ]
    )
    assert code == 0
    assert "2 passed, 0 failed" in capsys.readouterr().out
    payload = read_json(out_json)
    check_payload(payload, ["torch"], [CHEAP, CHEAP_2], passed=True)
    assert sorted(p.name for p in (tmp_path / "work").glob("part-*.json")) == ["part-0.json", "part-1.json"]
    for key in (CHEAP, CHEAP_2):
        record = default_store().get(kda.get_backend("torch"), "cpu", key)
        assert record is not None and record.passed and record.source == "verify"


def test_cli_jobs_report_a_dead_workers_classes_as_failed(tmp_path, capsys, monkeypatch):
    """A worker that dies (a GPU fault kills its process) leaves no part file: its classes are failures in
    the table, the count and the JSON report, not missing rows."""
    monkeypatch.setenv(
        "PYTHONPATH", os.pathsep.join([str(Path(__file__).resolve().parents[2]), os.environ.get("PYTHONPATH", "")])
    )
    real_popen = cli.subprocess.Popen

    def dying_second_worker(command, **kwargs):
        if any(part.endswith("part-1.json") for part in command):
            command = [sys.executable, "-c", "import sys; sys.exit(134)"]
        return real_popen(command, **kwargs)

    monkeypatch.setattr(cli.subprocess, "Popen", dying_second_worker)
    out_json = tmp_path / "report.json"
    argv = ["--backend", "torch", "--quick", "--device", "cpu", "--case", CHEAP, "--case", CHEAP_2]
    code = cli.main([*argv, "--jobs", "2", "--work-dir", str(tmp_path / "work"), "--json", str(out_json)])
    assert code == 1
    assert "1 passed, 1 failed" in capsys.readouterr().out
    payload = read_json(out_json)
    assert payload["passed"] is False
    status = {r["case_class"]: (r["status"], r["reason"]) for r in payload["results"]}
    assert status[CHEAP] == ("pass", None)
    assert status[CHEAP_2][0] == "fail" and "worker died (exit 134) verifying this class" in status[CHEAP_2][1]
    record = default_store().get(kda.get_backend("torch"), "cpu", CHEAP_2)  # not verified again on first use
    assert record is not None and not record.passed and "worker died" in record.reason


# A worker that runs `python -m kda.verify` with its arguments, but dies (as a GPU fault ends a process) when it
# reaches the class named by KDA_TEST_DIE_AT.
DYING_WORKER = """
import os, sys
from kda.verify import check, cli
verify_class = check.verify_class
def dying(backend, cc, *args, **kwargs):
    if cc.key == os.environ["KDA_TEST_DIE_AT"]:
        os._exit(134)
    return verify_class(backend, cc, *args, **kwargs)
cli.verify_class = dying
sys.exit(cli.main(sys.argv[1:]))
"""


def test_cli_jobs_keep_what_a_dying_worker_finished_and_run_what_it_did_not_reach(tmp_path, capsys, monkeypatch):
    """Worker 0 has three classes and dies at its second: the first keeps its result (from the progress
    file), the second fails naming the death, and the third runs in a fresh worker and passes."""
    third, fourth, fifth = (
        "pregated/qk/beta/fp32/dense/mha/nostate/c64/d64/fwd",
        "softplus/l2/sig/fp32/dense/mha/nostate/c32/d64/fwd",
        "safe/l2/sig/fp32/dense/gva/h0+ht/c64/d64/fwd",
    )
    monkeypatch.setenv(
        "PYTHONPATH", os.pathsep.join([str(Path(__file__).resolve().parents[2]), os.environ.get("PYTHONPATH", "")])
    )
    monkeypatch.setenv("KDA_TEST_DIE_AT", third)
    real_popen = cli.subprocess.Popen
    launched = []

    def first_worker_dies(command, **kwargs):
        launched.append([part.removeprefix("--case=") for part in command if part.startswith("--case=")])
        if len(launched) == 1:
            command = [sys.executable, "-c", DYING_WORKER, *command[3:]]  # its arguments, after "-m kda.verify"
        return real_popen(command, **kwargs)

    monkeypatch.setattr(cli.subprocess, "Popen", first_worker_dies)
    out_json = tmp_path / "report.json"
    keys = [CHEAP, CHEAP_2, third, fourth, fifth]
    argv = ["--backend", "torch", "--quick", "--device", "cpu", *(f"--case={key}" for key in keys)]
    code = cli.main([*argv, "--jobs", "2", "--work-dir", str(tmp_path / "work"), "--json", str(out_json)])
    assert launched == [[CHEAP, third, fifth], [CHEAP_2, fourth], [fifth]]
    assert code == 1
    assert "4 passed, 1 failed" in capsys.readouterr().out
    results = {r["case_class"]: r for r in read_json(out_json)["results"]}
    assert sorted(results) == sorted(keys)
    assert {key: r["status"] for key, r in results.items() if key != third} == dict.fromkeys(
        [CHEAP, CHEAP_2, fourth, fifth], "pass"
    )
    assert results[third]["status"] == "fail" and "worker died (exit 134)" in results[third]["reason"]
    store = default_store()
    for key in keys:
        record = store.get(kda.get_backend("torch"), "cpu", key)
        assert record is not None and record.passed == (key != third), key


def test_cli_stopped_by_sigterm_reports_what_it_verified_and_the_rest_as_not_run(tmp_path, capsys, monkeypatch):
    """`timeout` ends a run with SIGTERM: the report (table, count, JSON) still comes out, with the classes
    verified before it and the others "not run" (not failures, and without records); the handler the
    caller had is back afterwards."""
    third = "pregated/qk/beta/fp32/dense/mha/nostate/c64/d64/fwd"
    real_verify = cli.verify_class
    seen = []

    def verify_class(backend, cc, *args, **kwargs):
        seen.append(cc.key)
        if len(seen) == 2:  # the signal lands while the second class runs
            os.kill(os.getpid(), signal.SIGTERM)
        return real_verify(backend, cc, *args, **kwargs)

    monkeypatch.setattr(cli, "verify_class", verify_class)
    before = signal.getsignal(signal.SIGTERM)
    out_json = tmp_path / "report.json"
    argv = ["--backend", "torch", "--quick", "--device", "cpu", "--case", CHEAP, "--case", CHEAP_2, "--case", third]
    code = cli.main([*argv, "--json", str(out_json)])
    assert code == 1
    assert "1 passed, 0 failed, 2 not run (stopped by SIGTERM)" in capsys.readouterr().out
    payload = read_json(out_json)
    assert payload["stopped"] == "SIGTERM" and payload["passed"] is False
    status = {r["case_class"]: r["status"] for r in payload["results"]}
    assert status == {CHEAP: "pass", CHEAP_2: cli.NOT_RUN, third: cli.NOT_RUN}
    store = default_store()
    assert store.get(kda.get_backend("torch"), "cpu", CHEAP) is not None
    assert store.get(kda.get_backend("torch"), "cpu", CHEAP_2) is None  # not run: nothing recorded
    assert signal.getsignal(signal.SIGTERM) is before


@pytest.mark.parametrize("wrapped", [False, True], ids=["raised", "wrapped-by-a-library"])
def test_cli_stopped_inside_a_backends_call_neither_fails_nor_records_that_class(
    tmp_path, capsys, monkeypatch, wrapped
):
    """The signal lands while a backend computes (where the verifier fails a case for any error), or in a
    library that catches everything and raises its own error (as a tracer does): the class is "not run",
    never "fail", and no record says it failed; the class before it keeps its pass."""
    backend = kda.get_backend("torch")
    real_forward = type(backend).forward
    calls = []

    def forward(self, *args, **kwargs):
        calls.append(1)
        if len(calls) == 3:  # the second class's first case (a quick class has two: realistic, correlated)
            if not wrapped:
                os.kill(os.getpid(), signal.SIGTERM)
            try:
                os.kill(os.getpid(), signal.SIGTERM)
            except BaseException as error:  # a library's own handler
                raise RuntimeError(f"traced call failed: {error!r}") from error
        return real_forward(self, *args, **kwargs)

    monkeypatch.setattr(type(backend), "forward", forward)
    out_json = tmp_path / "report.json"
    argv = ["--backend", "torch", "--quick", "--device", "cpu", "--case", CHEAP, "--case", CHEAP_2]
    assert cli.main([*argv, "--json", str(out_json)]) == 1
    assert "1 passed, 0 failed, 1 not run (stopped by SIGTERM)" in capsys.readouterr().out
    status = {r["case_class"]: r["status"] for r in read_json(out_json)["results"]}
    assert status == {CHEAP: "pass", CHEAP_2: cli.NOT_RUN}
    assert default_store().get(backend, "cpu", CHEAP_2) is None


def test_cli_jobs_stopped_by_sigterm_end_their_workers_and_keep_what_they_finished(tmp_path, capsys, monkeypatch):
    """With --jobs, a stop while a worker still runs: that worker is ended (not left running), the classes
    the others finished are in the report, and the hung worker's class is "not run"."""
    monkeypatch.setenv(
        "PYTHONPATH", os.pathsep.join([str(Path(__file__).resolve().parents[2]), os.environ.get("PYTHONPATH", "")])
    )
    real_popen = cli.subprocess.Popen
    children = []

    def second_worker_hangs(command, **kwargs):
        if any(part.endswith("part-1.json") for part in command):
            command = [sys.executable, "-c", "import time; time.sleep(600)"]
        children.append(real_popen(command, **kwargs))
        return children[-1]

    monkeypatch.setattr(cli.subprocess, "Popen", second_worker_hangs)
    work = tmp_path / "work"

    def stop_once_the_first_worker_is_done():
        deadline = time.monotonic() + 300
        while not (work / "part-0.json").exists() and time.monotonic() < deadline:
            time.sleep(0.1)
        os.kill(os.getpid(), signal.SIGTERM)

    threading.Thread(target=stop_once_the_first_worker_is_done, daemon=True).start()
    out_json = tmp_path / "report.json"
    argv = ["--backend", "torch", "--quick", "--device", "cpu", "--case", CHEAP, "--case", CHEAP_2]
    started = time.monotonic()
    code = cli.main([*argv, "--jobs", "2", "--work-dir", str(work), "--json", str(out_json)])
    assert code == 1 and time.monotonic() - started < 120
    assert "1 passed, 0 failed, 1 not run (stopped by SIGTERM)" in capsys.readouterr().out
    assert all(child.poll() is not None for child in children)  # no worker left running
    status = {r["case_class"]: r["status"] for r in read_json(out_json)["results"]}
    assert status == {CHEAP: "pass", CHEAP_2: cli.NOT_RUN}


def test_cli_hands_what_is_left_to_a_fresh_process_when_the_cuda_context_is_lost(tmp_path, capsys, monkeypatch):
    """In one process, a class whose kernels fault leaves the CUDA context unusable: that class fails (with a
    record saying so), and the classes not yet verified run in a fresh worker instead of failing for it."""
    monkeypatch.setenv(
        "PYTHONPATH", os.pathsep.join([str(Path(__file__).resolve().parents[2]), os.environ.get("PYTHONPATH", "")])
    )
    third = "pregated/qk/beta/fp32/dense/mha/nostate/c64/d64/fwd"
    verified = []
    real_verify = cli.verify_class

    def verify_class(backend, cc, *args, **kwargs):
        verified.append(cc.key)
        return real_verify(backend, cc, *args, **kwargs)

    monkeypatch.setattr(cli, "verify_class", verify_class)
    monkeypatch.setattr(
        cli, "_context_lost", lambda device: "CUDA error: an illegal memory access" if verified[-1] == CHEAP_2 else None
    )
    real_popen = cli.subprocess.Popen
    launched = []

    def popen(command, **kwargs):
        launched.append([part.removeprefix("--case=") for part in command if part.startswith("--case=")])
        return real_popen(command, **kwargs)

    monkeypatch.setattr(cli.subprocess, "Popen", popen)
    out_json = tmp_path / "report.json"
    argv = ["--backend", "torch", "--quick", "--device", "cpu", "--case", CHEAP, "--case", CHEAP_2, "--case", third]
    code = cli.main([*argv, "--work-dir", str(tmp_path / "work"), "--json", str(out_json)])
    assert verified == [CHEAP, CHEAP_2] and launched == [[third]]
    assert code == 1
    assert "2 passed, 1 failed" in capsys.readouterr().out
    results = {r["case_class"]: r for r in read_json(out_json)["results"]}
    assert (results[CHEAP]["status"], results[third]["status"]) == ("pass", "pass")
    assert results[CHEAP_2]["status"] == "fail" and "CUDA context was lost" in results[CHEAP_2]["reason"]
    record = default_store().get(kda.get_backend("torch"), "cpu", CHEAP_2)
    assert record is not None and not record.passed and "illegal memory access" in record.reason


def test_cli_can_add_the_bench_classes(tmp_path, capsys, monkeypatch):
    from kda.verify.check import ClassResult

    seen = []

    def record_only(backend, cc, device, quick):
        seen.append(cc.key)
        return ClassResult(backend.name, cc, [])

    monkeypatch.setattr(cli, "verify_class", record_only)
    cli.main(["--backend", "torch", "--quick", "--device", "cpu", "--case", CHEAP, "--with-bench-classes"])
    from kda.bench.shapes import DEFAULT_SHAPES, MODES, case_class_keys

    assert seen[0] == CHEAP and set(case_class_keys(DEFAULT_SHAPES, list(MODES))) <= set(seen)


@pytest.mark.parametrize(
    ("variable", "value"), [("KDA_TOLERANCE_SCALE", "2"), ("KDA_TOLERANCE_SCALE", "x"), ("KDA_VERIFY", "sometimes")]
)
def test_cli_bad_settings_are_usage_errors_before_any_work(variable, value, capsys, monkeypatch):
    """Regression: a KDA_TOLERANCE_SCALE above 1 ended the run with a traceback after the first backend ran."""
    _refuse_work(monkeypatch)
    monkeypatch.setenv(variable, value)
    code = cli.main(["--backend", "torch", "--case", CHEAP, "--quick", "--device", "cpu"])
    err = capsys.readouterr().err
    check_usage_error(code, err, "python -m kda.verify")
    assert variable in err


def test_missing_verifies_only_what_this_machine_has_no_record_of(tmp_path, capsys):
    """--missing continues a cut run: a recorded pair is reported from its record and not run again (the
    progress file, a line per class verified, proves which ran); a quick record does not stand in for a
    full verification."""
    base = ["--backend", "torch", "--device", "cpu", "--quick"]
    assert cli.main([*base, "--case", CHEAP]) == 0
    capsys.readouterr()
    progress, report = tmp_path / "progress.jsonl", tmp_path / "report.json"
    args = [*base, "--missing", "--case", CHEAP, "--case", CHEAP_2, "--progress", str(progress), "--json", str(report)]
    assert cli.main(args) == 0
    assert "2 passed, 0 failed, 1 of them as recorded before this run" in capsys.readouterr().out
    assert [json.loads(line)["case_class"] for line in progress.read_text().splitlines()] == [CHEAP_2]
    results = {r["case_class"]: r for r in read_json(report)["results"]}
    assert set(results) == {CHEAP, CHEAP_2}
    assert results[CHEAP]["status"] == "pass" and results[CHEAP]["recorded"] is not None
    assert [c["regime"] for c in results[CHEAP]["cases"]] == ["realistic", "correlated"]
    assert "recorded" not in results[CHEAP_2]

    progress.unlink()
    assert cli.main(args) == 0  # everything recorded now: nothing runs
    assert "2 passed, 0 failed, 2 of them as recorded" in capsys.readouterr().out and not progress.exists()


def test_missing_reports_a_recorded_failure_as_a_failure(tmp_path, capsys):
    kda.register_backend(WrongBackend)
    base = ["--backend", "wrong", "--device", "cpu", "--quick", "--case", CHEAP]
    assert cli.main(base) == 1
    capsys.readouterr()
    progress = tmp_path / "progress.jsonl"
    assert cli.main([*base, "--missing", "--progress", str(progress)]) == 1
    out = capsys.readouterr().out
    assert "0 passed, 1 failed, 1 of them as recorded" in out and "FAIL wrong" in out and not progress.exists()


def test_missing_runs_a_full_check_where_only_a_quick_record_is_kept(tmp_path, capsys):
    assert cli.main(["--backend", "torch", "--device", "cpu", "--quick", "--case", CHEAP]) == 0
    capsys.readouterr()
    report = tmp_path / "report.json"
    assert cli.main(["--backend", "torch", "--device", "cpu", "--missing", "--case", CHEAP, "--json", str(report)]) == 0
    (result,) = read_json(report)["results"]
    assert "recorded" not in result and len(result["cases"]) == 4


def test_missing_with_jobs_hands_the_workers_only_what_is_missing(tmp_path, capsys, monkeypatch):
    monkeypatch.setenv(
        "PYTHONPATH", os.pathsep.join([str(Path(__file__).resolve().parents[2]), os.environ.get("PYTHONPATH", "")])
    )
    assert cli.main(["--backend", "torch", "--device", "cpu", "--quick", "--case", CHEAP]) == 0
    capsys.readouterr()
    work = tmp_path / "work"
    args = ["--backend", "torch", "--device", "cpu", "--quick", "--missing", "--case", CHEAP, "--case", CHEAP_2]
    assert cli.main([*args, "--jobs", "2", "--work-dir", str(work), "--json", str(tmp_path / "r.json")]) == 0
    assert "2 passed, 0 failed, 1 of them as recorded" in capsys.readouterr().out
    ran = [
        json.loads(line)["case_class"] for part in work.glob("part-*.jsonl") for line in part.read_text().splitlines()
    ]
    assert ran == [CHEAP_2]
