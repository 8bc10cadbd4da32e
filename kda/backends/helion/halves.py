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


def split(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``x`` (fp32, any shape) as its bf16 halves ``(hi, lo)``: ``hi + lo = x`` to within ``2^-16 |x|``."""
    hi = x.to(torch.bfloat16)
    return hi, (x - hi.to(torch.float32)).to(torch.bfloat16)


def dot3(
    a_hi: torch.Tensor,  # [M, R] bf16
    a_lo: torch.Tensor,  # [M, R] bf16
    b_hi: torch.Tensor,  # [R, N] bf16
    b_lo: torch.Tensor,  # [R, N] bf16
    acc: torch.Tensor | None = None,  # [M, N] fp32, added to
) -> torch.Tensor:
    """``acc + a b`` ([M, N] fp32) from the halves of ``a`` and ``b``: three bf16 products, smallest first."""
    if acc is None:
        acc = hl.dot(a_lo, b_hi)
    else:
        acc = hl.dot(a_lo, b_hi, acc=acc)
    acc = hl.dot(a_hi, b_lo, acc=acc)
    return hl.dot(a_hi, b_hi, acc=acc)
