"""Products on bf16 halves: fp32 operands as two bf16 tensors, multiplied on bf16 tensor cores.

An fp32 ``x`` splits as ``hi = bf16(x)`` and ``lo = bf16(x - hi)``. ``hi + lo`` holds 16 of fp32's 24
significand bits, so it matches ``x`` to within ``2^-16 |x|`` (bf16 keeps fp32's exponent range, so
neither half overflows where ``x`` did not). A product ``a b`` is then::

    a b  ~  a_lo b_hi + a_hi b_lo + a_hi b_hi        (fp32 accumulation; a_lo b_lo < 2^-16 |a||b| dropped)

summed smallest first, so the small terms are not lost against the large one. This is TF32x3's accuracy
(three TF32 products of fp32 operands), but its operands are 16-bit: they can stay in shared memory and
feed wgmma, where TF32x3 holds three fp32 copies of each operand in registers and spills
(`docs/design.md`, "The helion backend").

These are plain functions of tensors: Helion inlines them into the kernel that calls them, so the form is
written here once and compiles as if written in place (the Triton code differs from the inline form's
only in the order of independent loads and stores; compiled for sm_90a, every kernel keeps its registers,
spills and shared memory to the byte).
"""

from __future__ import annotations

import helion.language as hl
import torch

# The fewest value columns a serial pass's program takes on halves. `state`'s bf16 product with a
# transposed register tile as its left operand (``k_g^T v_new``) reads shared memory out of bounds on an
# H100 (Triton 3.6, compute-sanitizer: "Invalid __shared__ read of size 1024 bytes") at 16 and 32 columns,
# with 4 or 8 warps; at 64 and 128 it ran and matched the fp32 form to 5e-6, and with Hopper's wgmma
# switched off (``DISABLE_MMA_V3=1``) it ran at 32 too: Triton's wgmma lowering of that operand at a narrow
# N, not the kernel's indexing. `state_backward`'s ``q_e^T do`` and ``w^T dv_new`` have the same form and
# take the same floor (`docs/design.md`, "The helion backend").
MIN_BLOCK_V = 64


def split(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``x`` (fp32, any shape) as its bf16 halves ``(hi, lo)``: ``hi + lo = x`` to within ``2^-16 |x|``."""
    hi = x.to(torch.bfloat16)
    return hi, (x - hi.to(torch.float32)).to(torch.bfloat16)


def split_input(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | None]:
    """A 16-bit input (``do``, ``v``) as bf16 halves, exactly: bf16 is one half (``lo`` None: no term),
    fp16's 11 significant bits are ``hi`` (its top 8) plus ``lo`` (the other 3), both exact in bf16."""
    if x.dtype == torch.bfloat16:
        return x, None
    return split(x.to(torch.float32))


def dot3(
    a_hi: torch.Tensor,  # [M, R] bf16
    a_lo: torch.Tensor | None,  # [M, R] bf16, or None where a is bf16 exactly
    b_hi: torch.Tensor,  # [R, N] bf16
    b_lo: torch.Tensor | None,  # [R, N] bf16, or None where b is bf16 exactly
    acc: torch.Tensor | None = None,  # [M, N] fp32, added to
) -> torch.Tensor:
    """``acc + a b`` ([M, N] fp32) from the halves of ``a`` and ``b``: the bf16 products ``a_lo b_hi``,
    ``a_hi b_lo``, ``a_hi b_hi``, smallest first; a missing ``lo`` drops its term (it is zero)."""
    terms = [(a_lo, b_hi)] if a_lo is not None else []
    terms += [(a_hi, b_lo)] if b_lo is not None else []
    for a, b in terms:
        acc = hl.dot(a, b) if acc is None else hl.dot(a, b, acc=acc)
    return hl.dot(a_hi, b_hi) if acc is None else hl.dot(a_hi, b_hi, acc=acc)
