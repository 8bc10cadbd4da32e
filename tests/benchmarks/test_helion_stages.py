"""benchmarks/helion_stages.py's bytes a launch moves: each storage of its tensor arguments once."""

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
