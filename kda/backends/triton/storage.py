"""How the forward's intermediates are stored between launches, and the one cast every store goes through.

The forward is bound by the bytes its stages hand each other, not by arithmetic, so at inference the
intermediates that cross launches (``w``, ``k_g``, ``u``/``v_new``, ``A_qk``, ``h``) are stored in the
inputs' dtype, as FLA does: bf16 or fp16 halves their traffic. Arithmetic stays fp32 in registers; only
the stored copies are rounded, once each (each store below rounds to nearest, like the GPU's cvt).

fp16 storage has fp16's range (65504), as FLA's does. The stored values are of the size of the inputs
and the output (``u``, ``v_new`` and ``h`` scale with ``v``; ``w``, ``k_g`` with ``k``; ``A_qk``
with ``q . k``), which fp16 limits already; a stored value that overflows becomes inf, never a wrong
finite number, and the verifier fails any non-finite result.

Kept in fp32 whatever the inputs: ``G`` (a chunk's cumulative log decay is exponentiated as
``exp(G_i - G_j)``; bf16 would put an absolute error of ``|G| 2^-9`` in every exponent), ``A_kk``/``T``
(the inverse is solved in place and read back), fp32 inputs, and every intermediate when training (the
backward was written and verified against fp32 intermediates).

Triton's CPU interpreter converts fp32 to bf16 by truncating the mantissa (measured: 3.4e-3 relative
error on random values, against 1.7e-3 for round-to-nearest), which would make interpreted bf16 runs
twice as wrong as compiled ones. `stored` therefore rounds to nearest-even by integer arithmetic first
when ``ROUND`` is set, which the host sets only under the interpreter; a compiled kernel leaves the
conversion to the hardware.

Matrix products (`dot_precisions`, per kernel, each through `dot`): IEEE fp32 for fp32 inputs; TF32
tensor cores for bf16/fp16 inputs at inference, where the state pass and the output (and `intra` if
configured) take half-width operands instead (`operand`: the stored intermediates as they are, fp32
accumulation); for bf16/fp16 training, ``tf32x3`` (three TF32 products that recover fp32's accuracy) in
every kernel whose products reach the gradients, TF32 in the output (the measurements are beside
`TRAINING_INTRA` below). ``TF32_ROUNDED`` (one TF32 product of operands rounded to TF32 first) and
``BF16_HALVES`` (three products of operands split into two bf16 values each) exist only for precision
experiments (`benchmarks/training_precision.py`, `benchmarks/triton_stages.py --train-sweep`);
no kernel ships with either. On the
GPU a TF32 product reads its fp32 operands truncated to 10 mantissa bits, not rounded. That was
reproduced on the CPU by making the interpreter truncate the same way (`tests/tf32.py`): it moved two
bf16 training cases' ``dA_log`` from 2e-5 to 1.17e-2 and 1.27e-2 of the float64 reference, what the H200
had measured to three digits (1.18e-2, 1.28e-2; tolerance 1e-2), while the other gradients stayed near
2e-3. ``dA_log = sum_t a_t da_t`` is a sum whose terms cancel, so it keeps the products' relative error
and shows it. The forward's output takes the truncation well (bf16 ``o`` at 0.47 of its tolerance on the
H200) and never reaches the backward, so it keeps the cheaper products.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from kda.spec import KDASpec

# Two ``input_precision`` settings of our own beside Triton's "ieee", "tf32" and "tf32x3", for experiments
# only (`dot`): TF32 products of operands rounded to TF32 first, and three products of bf16 halves.
TF32_ROUNDED = "tf32_rounded"
BF16_HALVES = "bf16_halves"


@dataclass(frozen=True)
class DotPrecisions:
    """``input_precision`` of the ``tl.dot`` products, kernel by kernel (see the module docstring)."""

    intra: str
    state: str
    output: str
    backward_state: str
    backward_chunk: str


def dot_precisions(spec: KDASpec) -> DotPrecisions:
    """The products of each kernel for this spec."""
    if spec.dtype == torch.float32:
        return DotPrecisions(*["ieee"] * 5)
    if not spec.requires_grad:
        return DotPrecisions(*["tf32"] * 5)
    return DotPrecisions(
        intra=TRAINING_INTRA,
        state=TRAINING_STATE,
        output="tf32",
        backward_state=TRAINING_BACKWARD_STATE,
        backward_chunk=TRAINING_BACKWARD_CHUNK,
    )


# Training, bf16/fp16: the products of each kernel. ``dA_log`` (a sum whose terms cancel) decides; the figures
# are its relative error against the float64 reference (tolerance 1e-2), measured on the CPU with the GPU's
# products emulated (`tests/tf32.py`) over random cases of `benchmarks/training_precision.py` (seeds 11, 12,
# 101, 202), and H200 kernel times from `benchmarks/triton_stages.py --train-sweep` at B4_T2048_H16_D128.
#
# Experiment-only switches: these four are module attributes, read by `dot_precisions` at each call, so that
# `benchmarks/training_precision.py` (its ``MIXES``) and `benchmarks/triton_stages.py --train-sweep` (its
# "precision.<kernel>" variants) can set them with setattr and restore them afterwards. Nothing else sets them;
# the shipped values are the four "tf32x3" below.
# 60 random cases: none fails with TF32x3 (worst 2.5e-4); TF32 here and in the backward state pass fails 3
TRAINING_INTRA = "tf32x3"
# one case in TF32 in this kernel alone: 5.1e-3 (TF32x3 everywhere: 4.7e-5)
TRAINING_STATE = "tf32x3"
# an fp16 softplus varlen case (K = 4, V = 39): 1.2e-4 in TF32x3, 1.0015e-2 in rounded TF32, 6.8e-3 in TF32
TRAINING_BACKWARD_STATE = "tf32x3"
# one case in TF32 in this kernel alone: 4.6e-3; rounded TF32 here and in the state pass: 1 failure in 27
TRAINING_BACKWARD_CHUNK = "tf32x3"


def storage_dtype(spec: KDASpec) -> torch.dtype:
    """The dtype of the forward's cross-launch intermediates (see the module docstring)."""
    if spec.requires_grad or spec.dtype == torch.float32:
        return torch.float32
    return spec.dtype


@triton.jit
def stored(x, ptr, ROUND: tl.constexpr):
    """``x`` (fp32) as ``ptr``'s element type, rounded to nearest-even (see the module docstring)."""
    if ROUND and ptr.dtype.element_ty == tl.bfloat16:
        bits = x.to(tl.uint32, bitcast=True)
        bits = bits + 0x7FFF + ((bits >> 16) & 1)  # carries into the kept half when over halfway (ties: to even)
        x = ((bits >> 16) << 16).to(tl.float32, bitcast=True)  # now exact in bf16: the truncation loses nothing
    return x.to(ptr.dtype.element_ty)


@triton.jit
def operand(x, ROUND: tl.constexpr):
    """A stored (bf16/fp16) value as a ``tl.dot`` operand: as it is on a GPU (half-width tensor cores, fp32
    accumulation). Under the interpreter (``ROUND``) widened to fp32 first, which changes no value (every
    bf16/fp16 number is exact in fp32 and in TF32) but avoids the interpreter's bf16 ``tl.dot``, which
    multiplies the raw 16-bit patterns (Triton 3.9; `tests/tf32.py` fails any test that reaches it)."""
    if ROUND:
        x = x.to(tl.float32)
    return x


@triton.jit
def tf32_rounded(x):
    """``x`` (fp32) rounded to nearest TF32 (10 mantissa bits; ties away from zero, as ``cvt.rna.tf32.f32``),
    kept in fp32, so that a TF32 tensor core reading it drops only zeros. Adding half of the dropped
    range to the bit pattern carries into the kept bits exactly when the dropped part is at least half."""
    if x.dtype == tl.float32:
        bits = x.to(tl.uint32, bitcast=True)
        x = ((bits + 0x1000) & 0xFFFFE000).to(tl.float32, bitcast=True)
    return x


@triton.jit
def bf16_rounded(x):
    """``x`` (fp32) rounded to the nearest bf16 (ties to even), kept in fp32."""
    bits = x.to(tl.uint32, bitcast=True)
    bits = bits + 0x7FFF + ((bits >> 16) & 1)
    return ((bits >> 16) << 16).to(tl.float32, bitcast=True)


@triton.jit
def dot(a, b, PRECISION: tl.constexpr):
    """``tl.dot(a, b)`` at one of ``input_precision``'s settings, or at one of ours:

    - ``TF32_ROUNDED``: one TF32 product of operands rounded to TF32 first. The tensor cores truncate fp32
      operands to TF32, an error of up to 2^-10 of each operand and always toward zero, which sums
      coherently; rounded operands carry at most 2^-11, of either sign, which mostly cancels, for one TF32
      product's cost instead of TF32x3's three.
    - ``BF16_HALVES``: each fp32 operand as two bf16 values, ``hi = bf16(x)`` and ``lo = bf16(x - hi)`` (16
      significant bits together), and the three products above 2^-16 (``lo hi + hi lo + hi hi``), as the
      tilelang backend multiplies fp32 values. Each product of bf16 values is exact in fp32, so they are
      computed here as IEEE products of the halves: the numbers of three bf16 tensor-core products, not
      their speed. A precision experiment: bf16 halves stored by the kernel that writes them are what
      would let a training kernel's products read their operands from shared memory without TF32x3's
      register cost (`docs/design.md`, "The helion backend")."""
    if PRECISION == "tf32_rounded":
        return tl.dot(tf32_rounded(a), tf32_rounded(b), input_precision="tf32")
    elif PRECISION == "bf16_halves":
        a = a.to(tl.float32)
        b = b.to(tl.float32)
        a_hi, b_hi = bf16_rounded(a), bf16_rounded(b)
        a_lo, b_lo = bf16_rounded(a - a_hi), bf16_rounded(b - b_hi)
        out = tl.dot(a_lo, b_hi, input_precision="ieee")
        out = tl.dot(a_hi, b_lo, out, input_precision="ieee")
        return tl.dot(a_hi, b_hi, out, input_precision="ieee")
    else:
        return tl.dot(a, b, input_precision=PRECISION)
