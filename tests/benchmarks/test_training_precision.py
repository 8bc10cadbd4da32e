"""benchmarks/training_precision.py's cases at the helion backend's head dims (``--helion``)."""

from __future__ import annotations

import dataclasses
import random

from benchmark_scripts import load

training_precision = load("training_precision")


def test_the_helion_comparison_rounds_only_the_head_dims_up_to_sixteens():
    rng = random.Random(int.from_bytes(random.randbytes(4), "little"))
    for _ in range(20):
        case = training_precision.draw(rng)
        rounded = training_precision.at_helions_head_dims(case)
        assert rounded.K % 16 == 0 and rounded.V % 16 == 0
        assert case.K <= rounded.K < case.K + 16 and case.V <= rounded.V < case.V + 16
        assert dataclasses.replace(rounded, K=case.K, V=case.V) == case
