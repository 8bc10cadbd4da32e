"""benchmarks/device/keep_autotune.sh keeps a device run's autotune results, and only those, in git."""

from __future__ import annotations

import shutil
import subprocess
import tarfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "benchmarks" / "device" / "keep_autotune.sh"

pytestmark = pytest.mark.skipif(shutil.which("bash") is None or shutil.which("tar") is None, reason="needs bash, tar")


def _state(tmp_path: Path, files: dict[str, str]) -> Path:
    """A state.tgz as measure.sh packs it, holding `files` (path -> text)."""
    root = tmp_path / "state"
    for name, text in files.items():
        (root / name).parent.mkdir(parents=True, exist_ok=True)
        (root / name).write_text(text)
    archive = tmp_path / "state.tgz"
    with tarfile.open(archive, "w:gz") as tar:
        for name in files:
            tar.add(root / name, arcname=name)
    return archive


GPU = "NVIDIA H100 80GB HBM3"
KEPT = Path("autotune") / "nvidia-h100-80gb-hbm3.tgz"  # the card's archive, beside the script


def _run(folder: Path, state: Path, *gpu: str) -> subprocess.CompletedProcess:
    script = folder / "keep_autotune.sh"  # writes autotune/<gpu>.tgz beside itself
    shutil.copy(SCRIPT, script)
    args = gpu or (GPU,)
    return subprocess.run(["bash", str(script), str(state), *args], capture_output=True, text=True, timeout=60)


def test_it_keeps_the_autotune_results_alone_and_packs_them_the_same_each_time(tmp_path):
    state = _state(
        tmp_path,
        {
            "triton-cache/h1/chunk_fwd.autotune.json": '{"configs_timings": [1]}',
            "triton-cache/h2/solve.autotune.json": '{"configs_timings": [2]}',
            "triton-cache/h1/chunk_fwd.cubin": "compiled code: not kept",
            "kda-cache/verification/record.json": "a machine's record: not kept",
        },
    )
    folder = tmp_path / "repo"
    folder.mkdir()
    result = _run(folder, state)
    assert result.returncode == 0, result.stderr
    assert "2 autotune results" in result.stdout
    with tarfile.open(folder / KEPT) as tar:
        kept = sorted(member.name for member in tar.getmembers() if member.isfile())
        assert all(member.mtime == 0 and member.uid == 0 for member in tar.getmembers())
    assert kept == ["triton-cache/h1/chunk_fwd.autotune.json", "triton-cache/h2/solve.autotune.json"]
    first = (folder / KEPT).read_bytes()
    assert _run(folder, state, "nvidia-h100-80gb-hbm3").returncode == 0  # the folder's name for the card
    assert (folder / KEPT).read_bytes() == first  # an unchanged set: an unchanged file


def test_each_card_keeps_its_own_archive(tmp_path):
    """Triton keys its results by architecture, so an H100's choices must not land where an H200 looks."""
    state = _state(tmp_path, {"triton-cache/h1/chunk_fwd.autotune.json": '{"configs_timings": [1]}'})
    folder = tmp_path / "repo"
    folder.mkdir()
    assert _run(folder, state, "NVIDIA H200").returncode == 0
    assert _run(folder, state).returncode == 0
    assert sorted(p.name for p in (folder / "autotune").iterdir()) == ["nvidia-h100-80gb-hbm3.tgz", "nvidia-h200.tgz"]


def test_no_card_named_is_a_usage_error(tmp_path):
    state = _state(tmp_path, {"triton-cache/h1/chunk_fwd.autotune.json": "{}"})
    folder = tmp_path / "repo"
    folder.mkdir()
    shutil.copy(SCRIPT, folder / "keep_autotune.sh")
    result = subprocess.run(["bash", str(folder / "keep_autotune.sh"), str(state)], capture_output=True, text=True)
    assert result.returncode != 0 and "usage" in result.stderr
    assert not (folder / "autotune").exists()


@pytest.mark.parametrize("kind", ["missing", "no-autotune-results"])
def test_a_missing_or_empty_state_is_refused_and_the_kept_file_stays(tmp_path, kind):
    folder = tmp_path / "repo"
    folder.mkdir()
    (folder / "autotune").mkdir()
    (folder / KEPT).write_bytes(b"the kept results")
    if kind == "missing":
        state, status = tmp_path / "absent.tgz", 2
    else:
        state, status = _state(tmp_path, {"kda-cache/record.json": "{}"}), 1
    result = _run(folder, state)
    assert result.returncode == status
    assert len(result.stderr.strip().splitlines()) == 1 and "keep_autotune.sh" in result.stderr
    assert (folder / KEPT).read_bytes() == b"the kept results"
