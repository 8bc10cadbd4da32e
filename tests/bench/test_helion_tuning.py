"""`python -m kda.bench --tune-kernels helion`'s schedule, on the CPU with the GPU parts faked: the kernels
are searched slowest first, an already tabled (kernel, K, V, chunk, storage) is not searched again, the
budget stops the search, and the log says where the time went and what was left untuned."""

from __future__ import annotations

import json

import pytest

pytest.importorskip("helion")

from kda.backends.helion.configs import ShapeKey
from kda.bench import helion_tuning


def _launch(name: str, K: int = 128):
    def kernel():
        pass

    kernel.__name__ = name
    return (kernel, "tf32", (), ShapeKey("sm90", K, K, 64, False))


@pytest.fixture
def faked(monkeypatch):
    """Three recorded launches (default ms: scores 3, solve 1, state 2) and a search that halves a time."""
    launches = [_launch("scores_kernel"), _launch("solve_kernel"), _launch("state_kernel")]
    defaults = {"scores_kernel": 3.0, "solve_kernel": 1.0, "state_kernel": 2.0}
    searched: list[str] = []
    monkeypatch.setattr(helion_tuning, "record_launches", lambda shape, mode, device: list(launches))
    monkeypatch.setattr(
        helion_tuning, "default_of", lambda launch, device: ({"num_warps": 4}, defaults[launch[0].__name__])
    )

    def search(launch, start, device, deadline):
        searched.append(launch[0].__name__)
        return {"num_warps": 8}, start[1] / 2

    monkeypatch.setattr(helion_tuning, "tune_launch", search)
    return searched


def test_the_slowest_kernel_is_searched_first_and_every_one_is_logged(faked, tmp_path):
    lines: list[str] = []
    out = helion_tuning.tune(["B1_T64_H1_D128"], ["fwd"], 100.0, tmp_path / "table.json", lines.append)
    assert faked == ["scores_kernel", "state_kernel", "solve_kernel"]
    table = json.loads(out.read_text())
    assert table["scores_kernel"][0]["ms"] == 1.5 and table["scores_kernel"][0]["default_ms"] == 3.0
    assert any(line.startswith("recorded 3 launches at B1_T64_H1_D128 fwd") for line in lines), lines
    ranking = next(line for line in lines if line.startswith("defaults timed"))
    assert ranking.index("scores_kernel 3.000") < ranking.index("state_kernel 2.000") < ranking.index("solve")


def test_a_tabled_kernel_is_not_searched_again(faked, tmp_path):
    table = tmp_path / "table.json"
    table.write_text(json.dumps({"scores_kernel": [{"K": 128, "V": 128, "C": 64, "half": False, "config": {}}]}))
    helion_tuning.tune(["B1_T64_H1_D128"], ["fwd"], 100.0, table, lambda line: None)
    assert faked == ["state_kernel", "solve_kernel"]


def test_a_spent_budget_stops_the_search_and_names_what_was_left(faked, tmp_path):
    lines: list[str] = []
    helion_tuning.tune(["B1_T64_H1_D128"], ["fwd"], -1.0, tmp_path / "table.json", lines.append)
    assert faked == []
    assert lines[-1] == "budget of -1 s spent; not tuned: scores_kernel, state_kernel, solve_kernel"
