"""What `python -m kda.bench` measures: the shapes, the modes, and the inputs for each (see `kda.workloads`,
which defines them for both the bench and the verifier)."""

from kda.workloads import (
    DEFAULT_SHAPES,
    DENSE_SHAPES,
    MODES,
    VARLEN_SHAPES,
    BenchInputs,
    BenchShape,
    Mode,
    case_class_keys,
    make_inputs,
)

__all__ = [
    "DEFAULT_SHAPES",
    "DENSE_SHAPES",
    "MODES",
    "VARLEN_SHAPES",
    "BenchInputs",
    "BenchShape",
    "Mode",
    "case_class_keys",
    "make_inputs",
]
