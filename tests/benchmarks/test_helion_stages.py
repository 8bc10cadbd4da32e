"""benchmarks/helion_stages.py: the bytes a launch moves (each storage of its tensor arguments once), and each
kernel of a recorded call replayed alone on its own arguments."""

from __future__ import annotations

import pytest
import torch
from benchmark_scripts import load

pytest.importorskip("helion", reason="helion is not installed (extra `helion`)")

helion_stages = load("helion_stages")


def test_a_launch_moves_each_storage_of_its_arguments_once():
    G = torch.empty(4, 8, dtype=torch.float32)  # 128 bytes, passed again as a placeholder
    q = torch.empty(2, 3, 8, dtype=torch.bfloat16)  # 96 bytes, passed as a view too
    args = (G, q.view(6, 8), q, 1.5, G, "name", torch.empty(5, dtype=torch.int32))
    assert helion_stages.argument_bytes(args) == 128 + 96 + 20


def test_each_launch_is_replayed_alone_on_its_own_arguments_and_summed_per_kernel():
    """`replay_alone` times every recorded launch by itself (a kernel launched twice a call, as ``qk_tail``,
    counts both), with the arguments and table key that launch had, not another launch's."""
    ran: list[tuple] = []

    def launch(fn, precision, args, key) -> None:
        ran.append((fn, precision, args, key))

    def time_ms(call) -> float:
        before = len(ran)
        call()
        assert len(ran) == before + 1  # the timer gets one launch, not the call
        fn, _, args, _ = ran[-1]
        return {"a": 1.0, "b": 0.25}[fn.__name__] * args[0]

    def a():
        pass

    def b():
        pass

    recorded = [("a", a, "tf32", (2.0,), "key-a"), ("b", b, "ieee", (4.0,), "key-b"), ("b", b, "ieee", (8.0,), "key-c")]
    alone = helion_stages.replay_alone(recorded, launch, time_ms)
    assert alone == {"a": 2.0, "b": 0.25 * 4.0 + 0.25 * 8.0}
    assert ran == [(a, "tf32", (2.0,), "key-a"), (b, "ieee", (4.0,), "key-b"), (b, "ieee", (8.0,), "key-c")]
