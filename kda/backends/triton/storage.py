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
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kda.spec import KDASpec


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
