"""The helion backend's compiled kernels on a CPU: the Triton code Helion generates for a configuration, run
by Triton's interpreter (``TRITON_INTERPRET=1``), instead of Helion's own eager interpreter.

Helion's interpreter (``HELION_INTERPRET=1``) runs each kernel's Python body as PyTorch: it checks the math,
not the code that runs on a GPU. This runs that code: the block sizes, masks, index arithmetic and loop
bounds of a given configuration, each load and store checked by `addresses.checked_addresses`.

Helion's generated code meets five gaps of Triton 3.9's interpreter, bridged here while the block runs:

- ``libdevice.exp``, ``log1p``, ``rsqrt`` and their kin are extern calls the interpreter leaves unpatched
  (they return None); they are computed in numpy on the interpreter's data.
- a comparison's result is typed like its operands (an fp32 comparison gives float data), so
  ``scalar_mask | vector_mask`` fails in numpy; comparisons are made to give int1 booleans, as compiled.
- ``x[:, None]`` on a scalar (a loop index Helion treats as a one-element tile): compiled Triton gives a
  ``[1]`` block (each ``None`` adds a dim, ``:`` is not checked against the rank); the interpreter raises.
  Scalars take the compiled rule.
- a cast from fp32 to bf16 truncates (the GPU rounds to nearest even): through the bf16 intermediates of
  an inference call the bias adds up past the tolerance. It rounds here.
- ``tl.dot`` of bf16 operands multiplies the interpreter's raw 16-bit integers; they are widened to fp32
  first (exactly), as the tensor cores read them.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import numpy as np

UNARY = {
    "exp": np.exp,
    "exp2": np.exp2,
    "expm1": np.expm1,
    "log": np.log,
    "log2": np.log2,
    "log1p": np.log1p,
    "sqrt": np.sqrt,
    "rsqrt": lambda x: 1 / np.sqrt(x),
    "tanh": np.tanh,
    "abs": np.abs,
}


def _apply(x, elementwise):
    """A libdevice function of one tensor, elementwise in numpy on the interpreter's data."""
    import triton.language as tl
    from triton.runtime import interpreter

    data = x.handle.data
    with np.errstate(over="ignore", divide="ignore", invalid="ignore"):  # inf and NaN, as the GPU gives them
        result = elementwise(data).astype(data.dtype)
    return tl.core.tensor(interpreter.TensorHandle(result, x.handle.dtype.scalar), x.type)


def _as_bool(compare):
    """A comparison of the interpreter's that gives int1 booleans whatever its operands' type."""
    import triton.language as tl
    from triton.runtime import interpreter

    def compared(self, lhs, rhs):
        result = compare(self, lhs, rhs)
        return interpreter.TensorHandle(np.asarray(result.data).astype(np.bool_), tl.int1)

    return compared


def _widened(handle):
    """A bf16 operand (held by the interpreter as its 16 raw bits) as fp32 values: exact."""
    import triton.language as tl
    from triton.runtime import interpreter

    wide = interpreter._convert_float(handle.data, tl.bfloat16, tl.float32, None).view(np.float32)
    return interpreter.TensorHandle(wide, tl.float32)


def _bf16_bits(values: np.ndarray) -> np.ndarray:
    """fp32 values rounded to the nearest bf16, ties to even (NaN kept NaN): the GPU's conversion."""
    bits = np.ascontiguousarray(values, dtype=np.float32).view(np.uint32)
    rounded = (bits + np.uint32(0x7FFF) + ((bits >> np.uint32(16)) & np.uint32(1))) >> np.uint32(16)
    nan = np.isnan(values)
    rounded[nan] = (bits[nan] >> np.uint32(16)) | np.uint32(0x40)  # a quiet NaN of the same sign
    return rounded.astype(np.uint16)


@contextlib.contextmanager
def interpreter_bridges() -> Iterator[None]:
    """Inside the block, Triton's interpreter runs Helion's generated code as a GPU would (the module
    docstring lists what changes); everything is restored after it."""
    import triton.language as tl
    from triton.language.extra import libdevice
    from triton.runtime import interpreter

    restore: list[tuple[object, str, object]] = []

    def replace(owner: object, name: str, value: object) -> None:
        restore.append((owner, name, getattr(owner, name)))
        setattr(owner, name, value)

    for name, elementwise in UNARY.items():
        if hasattr(libdevice, name):
            replace(libdevice, name, lambda x, _f=elementwise: _apply(x, _f))

    builder = interpreter.InterpreterBuilder
    for name in dir(builder):
        if name.startswith(("create_fcmp", "create_icmp")):
            replace(builder, name, _as_bool(getattr(builder, name)))

    dot = builder.create_dot

    def dot_of_bf16(self, a, b, d, input_precision, max_num_imprecise_acc):
        a, b = (_widened(x) if x.dtype == tl.bfloat16 else x for x in (a, b))
        return dot(self, a, b, d, input_precision, max_num_imprecise_acc)

    replace(builder, "create_dot", dot_of_bf16)

    cast = builder.cast_impl

    def cast_rounding_to_bf16(self, src, dst_type):
        if src.dtype.scalar == tl.float32 and dst_type.scalar == tl.bfloat16:
            return interpreter.TensorHandle(_bf16_bits(src.data), tl.bfloat16)
        return cast(self, src, dst_type)

    replace(builder, "cast_impl", cast_rounding_to_bf16)

    indexing = tl.core.tensor.__getitem__

    def getitem(self, slices, _semantic=None):
        if len(self.shape):
            return indexing(self, slices, _semantic=_semantic)
        parts = slices.values if isinstance(slices, tl.core.tuple) else slices
        parts = parts if isinstance(parts, (list, tuple)) else [parts]
        expanded = self
        for axis in range(sum(tl.core._unwrap_if_constexpr(part) is None for part in parts)):
            expanded = _semantic.expand_dims(expanded, axis)
        return expanded

    replace(tl.core.tensor, "__getitem__", tl.core.builtin(getitem))
    try:
        yield
    finally:
        for owner, name, value in reversed(restore):
            setattr(owner, name, value)


def as_on_an_h200(monkeypatch) -> None:
    """Helion's launch choices made as on an H200 though the tensors are on the CPU: its default configuration
    comes from heuristics registered per architecture and sized by the SM count, so a kernel without a table
    entry compiles here as it does there (`benchmarks/helion_resources.py`). Undone after the test."""
    from benchmark_scripts import load

    load("helion_resources").as_if_on_an_h200(monkeypatch.setattr)
