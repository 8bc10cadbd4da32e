"""Which policy judges a class's cases: the decode op's (`recurrent_policy`, keys ``recurrent/...``) or
`chunk_kda`'s (`policy`). Records (`kda.verify.records`) and fresh results (`kda.verify.check.ClassResult`)
are both judged here, under the tolerances in force when they are read."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from kda.verify.policy import Assessment, assess_chunk
from kda.verify.recurrent_policy import assess_recurrent


def assess(case_class_key: str, cases: Sequence[Mapping[str, Any]], *, on_cuda: bool) -> Assessment:
    """Judge the cases one record holds (each as its case result's ``as_json`` wrote it)."""
    if case_class_key.startswith("recurrent/"):
        return assess_recurrent(case_class_key, cases)
    return assess_chunk(case_class_key, cases, on_cuda=on_cuda)
