"""Tensor-core products in Triton's CPU interpreter, as an NVIDIA GPU computes them.

The interpreter computes every ``tl.dot`` as an exact fp32 matrix product, whatever ``input_precision``
the kernel asked for. A GPU does not: with ``"tf32"`` the tensor cores read each fp32 operand with its
mantissa truncated to TF32's 10 bits (not rounded: measured, see below), and ``"tf32x3"`` splits each
operand into its TF32 rounding and the rest and sums three TF32 products of the parts (Triton's F32DotTC
pass), which recovers about fp32's accuracy. `emulate_gpu_dots` makes the interpreter do the same, so that CPU tests see the
numbers the kernels give on a GPU.

How it was pinned down: two bf16 training cases failed on the H200 with ``dA_log`` 1.18e-2
and 1.28e-2 off the float64 reference (other gradients near 2e-3), and passed in the plain interpreter at
2e-5. Rounding the operands to TF32 gave 4.0e-3 and 2.9e-4; truncating them gave 1.17e-2 and 1.27e-2,
and ``o`` 2.33e-3 and 2.29e-3 where the GPU had measured 2.32e-3 and 2.29e-3.
"""

from __future__ import annotations

import numpy as np

TF32_DROPPED_BITS = 13  # fp32 keeps 23 mantissa bits, TF32 10
_KEPT = np.uint32((0xFFFFFFFF << TF32_DROPPED_BITS) & 0xFFFFFFFF)  # sign, exponent and TF32's mantissa


def truncate_to_tf32(x: np.ndarray) -> np.ndarray:
    """What a tensor core reads of an fp32 array: the low 13 mantissa bits dropped."""
    if x.dtype != np.float32:
        return x
    return (x.view(np.uint32) & _KEPT).view(np.float32)


def round_to_tf32(x: np.ndarray) -> np.ndarray:
    """fp32 to TF32, round to nearest (ties away, as ``cvt.rna.tf32.f32``), kept in fp32."""
    if x.dtype != np.float32:
        return x
    bits = x.view(np.uint32).astype(np.uint64) + (1 << (TF32_DROPPED_BITS - 1))
    return (bits.astype(np.uint32) & _KEPT).view(np.float32)


def emulate_gpu_dots(monkeypatch) -> None:
    """Patch the interpreter's ``tl.dot`` for the rest of the test (see the module docstring)."""
    from triton._C.libtriton import ir
    from triton.runtime import interpreter

    exact = interpreter.InterpreterBuilder.create_dot

    def handle(data, like):
        return interpreter.TensorHandle(data, like.dtype.scalar)

    def create_dot(self, a, b, d, input_precision, max_num_imprecise_acc):
        # The interpreter stores bf16 as uint16 and its dot multiplies those bit patterns: the kernels widen
        # bf16 operands to fp32 under the interpreter (`storage.operand`); reaching this is a kernel bug.
        assert a.data.dtype != np.uint16 and b.data.dtype != np.uint16, "bf16 tl.dot in the interpreter"
        if a.data.dtype != np.float32 or b.data.dtype != np.float32:
            return exact(self, a, b, d, input_precision, max_num_imprecise_acc)
        if input_precision == ir.INPUT_PRECISION.TF32:
            return exact(
                self,
                handle(truncate_to_tf32(a.data), a),
                handle(truncate_to_tf32(b.data), b),
                d,
                input_precision,
                max_num_imprecise_acc,
            )
        if input_precision == ir.INPUT_PRECISION.TF32x3:
            # Triton's F32DotTC pass: big = cvt.rna(x), small = x - big in fp32, then three TF32 products
            # (small * big, big * small, big * big, accumulated in that order), whose operands the tensor
            # cores truncate: the big parts are TF32 already, the small parts lose their low bits.
            a_big, b_big = round_to_tf32(a.data), round_to_tf32(b.data)
            a_small, b_small = truncate_to_tf32(a.data - a_big), truncate_to_tf32(b.data - b_big)
            out = exact(self, handle(a_small, a), handle(b_big, b), d, input_precision, max_num_imprecise_acc)
            out = exact(self, handle(a_big, a), handle(b_small, b), out, input_precision, max_num_imprecise_acc)
            return exact(self, handle(a_big, a), handle(b_big, b), out, input_precision, max_num_imprecise_acc)
        return exact(self, a, b, d, input_precision, max_num_imprecise_acc)

    monkeypatch.setattr(interpreter.InterpreterBuilder, "create_dot", create_dot)
