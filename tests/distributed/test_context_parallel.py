"""Context parallelism on CPU processes: 2 and 4 gloo ranks, spawned here, against the single-process call.

Each scenario runs the same global batch both ways (forward, final state, and every gradient of
``sum(o * do) + sum(final_state * dfinal)``); every rank's slice of ``o`` and of the gradients of q, k, v, g
and beta must match the single call's within the verification tolerance, and the gradients of the inputs
every rank holds whole (initial_state, A_log, dt_bias) summed over the ranks likewise. Sequences cross rank
boundaries, one rank holds an empty slice, a rank holds a middle part of one sequence, splits are uneven.
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.multiprocessing as mp

dist = pytest.importorskip("torch.distributed")
if not dist.is_available():
    pytest.skip("torch.distributed is not available in this build", allow_module_level=True)

import cp_worker  # noqa: E402

from kda.verify.check import relative_error  # noqa: E402
from kda.verify.policy import tolerance  # noqa: E402

BASE: dict[str, Any] = dict(
    backend="torch",
    B=1,
    T=100,
    H=2,
    HV=4,
    K=16,
    V=16,
    dtype="float32",
    gate="safe",
    lengths=None,
    initial_state=True,
    final_state=True,
    v_first=False,
    training=True,
    mode="sequence",
)

SCENARIOS = {
    # one sequence over 2 ranks, equal halves
    "seq-2-one-sequence": dict(lengths=[100]),
    # varlen over 4 uneven ranks: one empty, a sequence crossing three ranks, an empty sequence
    "seq-4-varlen-uneven": dict(lengths=[7, 60, 0, 21, 12], splits=[30, 0, 45, 25], gate="softplus"),
    # dense B = 2 over 4 ranks, state layout [V, K], no initial state
    "seq-4-dense": dict(B=2, T=64, initial_state=False, v_first=True, splits=[10, 20, 16, 18]),
    # bf16 inputs over 2 ranks, varlen
    "seq-2-bf16": dict(dtype="bfloat16", lengths=[33, 67]),
    # head parallel: 2 and 4 ranks, varlen and dense
    "head-2-varlen": dict(mode="head", lengths=[40, 0, 60], splits=[64, 36]),
    "head-4-dense": dict(mode="head", B=2, T=48, H=4, HV=8, v_first=True),
    "head-2-bf16-gva": dict(mode="head", dtype="bfloat16", H=2, HV=4, lengths=[70, 30]),
    # inference only: no autograd machinery
    "seq-2-inference": dict(training=False, lengths=[50, 50], splits=[70, 30]),
}
WORLD = {"seq-2-one-sequence": 2, "seq-4-varlen-uneven": 4, "seq-4-dense": 4, "seq-2-bf16": 2}
WORLD |= {"head-2-varlen": 2, "head-4-dense": 4, "head-2-bf16-gva": 2, "seq-2-inference": 2}


def spawn(world: int, scenario: dict[str, Any], out: Path) -> None:
    init_file = out / "init"
    mp.start_processes(
        cp_worker.run_rank,
        args=(world, str(init_file), scenario, str(out)),
        nprocs=world,
        join=True,
        start_method="spawn",
    )


@pytest.mark.parametrize("name", list(SCENARIOS))
def test_context_parallel_equals_the_single_call(name, seed, tmp_path):
    scenario = {**BASE, **SCENARIOS[name], "seed": seed}
    world = WORLD[name]
    spawn(world, scenario, tmp_path)
    ranks = [torch.load(tmp_path / f"rank{r}.pt") for r in range(world)]
    expected = cp_worker.single_process(scenario)
    dtype = scenario["dtype"]

    def check(tensor_name: str, got: torch.Tensor, want: torch.Tensor) -> None:
        assert got.shape == want.shape, (tensor_name, got.shape, want.shape)
        assert torch.isfinite(got).all(), tensor_name
        error = relative_error(got.double(), want.double())
        assert error <= tolerance(tensor_name, dtype), (tensor_name, error)

    check("o", torch.cat([r["o"] for r in ranks], dim=1), expected["o"])
    if scenario["final_state"]:
        for r in ranks:
            check("final_state", r["final_state"], expected["final_state"])
    if scenario["training"]:
        for n in cp_worker.GRADS:
            # a rank with an empty slice has no gradient to give (None), and only such a rank
            parts = [r[f"d{n}"] for r in ranks]
            assert all(p is not None or r["o"].shape[1] == 0 for p, r in zip(parts, ranks)), n
            check(f"d{n}", torch.cat([p for p in parts if p is not None], dim=1), expected[f"d{n}"])
        for n in cp_worker.SHARED:
            if f"d{n}" in expected:  # each rank's share (None: a rank that did not use it), summed
                want = expected[f"d{n}"]
                shares = [r[f"d{n}"] if r[f"d{n}"] is not None else torch.zeros_like(want) for r in ranks]
                check(f"d{n}", torch.stack(shares).sum(0), want)


def test_a_rank_that_raises_does_not_hang_the_others(tmp_path):
    scenario = {**BASE, "lengths": [100], "seed": 1, "raise_on_rank": 1, "timeout_s": 10}
    started = time.monotonic()
    with pytest.raises(mp.ProcessRaisedException, match="fails before its call"):
        spawn(2, scenario, tmp_path)
    assert time.monotonic() - started < 120


def test_the_context_is_checked_before_any_work(monkeypatch):
    import kda
    from kda.errors import KDAInputError

    q = torch.randn(1, 8, 1, 16)
    with pytest.raises(KDAInputError, match="cp_context"):
        kda.chunk_kda(q, q, q, q, torch.rand(1, 8, 1), cp_context=object())


def test_building_a_context_needs_an_initialized_group():
    from kda.distributed import build_cp_context
    from kda.errors import KDAInputError

    if dist.is_initialized():
        pytest.skip("a process group is initialized in this process")
    with pytest.raises(KDAInputError, match="init_process_group"):
        build_cp_context(None, torch.tensor([0, 10]))


def test_pieces_cover_every_token_once():
    from kda.distributed.context import CPContext

    ctx = CPContext(None, 0, 4, "sequence", (0, 7, 67, 67, 88, 100), (30, 0, 45, 25))
    covered = []
    for r in range(4):
        for p in ctx.pieces(r):
            covered += [ctx.offsets[r] + t for t in range(p.start, p.end)]
    assert covered == list(range(100))
    assert [p.seq for p in ctx.open_pieces(0)] == [1] and ctx.pieces(1) == []
    middle = ctx.pieces(2)
    assert [(p.seq, p.begins, p.ends) for p in middle] == [(1, False, True), (3, True, False)]
