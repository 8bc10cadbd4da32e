"""The `triton` backend: kda's own chunked KDA kernels in Triton, forward and backward.

Stages, one module and one launch each (the math is in each module's docstring):

1. `gate`   : the gate activation (pre-gated, softplus or safe) fused with the in-chunk cumulative sum;
2. `intra`  : per chunk, the causal scores ``A_kk`` / ``A_qk`` exponentiated against a local anchor,
              the WY transform ``T = (I + A_kk)^-1`` and ``w, u``;
3. `state`  : the serial pass over chunks: each chunk's entering state ``h`` and its deltas ``v_new``;
4. `output` : ``o`` from ``h``, ``v_new`` and ``A_qk``, in parallel over chunks.

It covers the whole contract (gate modes, l2norm and beta sigmoid in kernel, ``allow_neg_eigval``,
varlen, GVA, both state layouts, chunk 32 and 64, K and V up to 256, any T, bf16/fp16/fp32). Launch
configurations are shipped per architecture (`configs`); nothing is tuned at call time.

With ``TRITON_INTERPRET=1`` the backend accepts CPU tensors and runs in Triton's interpreter: slow, but
it is how CI checks the kernels and how a user without a GPU can step through them.

The backward (`backward`, the host wrapper: a reverse serial pass, `state_backward`; a per-chunk gradient
kernel taking K in blocks, `chunk_backward`, with its diagonal blocks in `diagonal_backward`; and the
elementwise tails fused in two launches, `tails`) gives every gradient and matches the float64 reference
in the interpreter. The jit helpers the kernel modules share are in `tiles`.

On CUDA the forward and training are offered at every K and V up to 256, and verified before use like
every backend (the whole grid, training included, passes on the H200). For bf16/fp16 training the
products are chosen per kernel for ``dA_log``'s sake (`storage.dot_precisions`): a GPU truncates fp32
operands to TF32, and ``dA_log`` sums terms that cancel.
Verification catches wrong numbers, not a kernel that faults and takes the caller's CUDA context down with
it; none has faulted over the grid on the H200.
"""

from __future__ import annotations

import torch

from kda.backends.base import (
    Backend,
    ForwardResult,
    KDAGradients,
    KDAInputs,
    KDAOutputs,
    RecurrentInputs,
    RecurrentResult,
    Verdict,
)
from kda.recurrent.spec import RecurrentSpec
from kda.spec import KDASpec

MIN_CAPABILITY = (8, 0)


def _interpreting() -> bool:
    from kda.backends.triton.forward import interpreting

    return interpreting()


class TritonBackend(Backend):
    """kda's own Triton kernels: forward and training, on CUDA or in Triton's CPU interpreter."""

    name = "triton"
    version = "22"  # bump whenever a kernel changes: verification records are kept per version
    priority = 5  # below fla until measured faster: `kda.bench --tune` decides where it is
    trains = True
    writes_into_outputs = True
    description = "kda's own chunked Triton kernels, forward and backward; CUDA, or CPU through TRITON_INTERPRET=1"

    def available(self) -> Verdict:
        try:
            import triton  # noqa: F401

            from kda.backends.triton import forward  # noqa: F401
        except Exception as error:
            return Verdict.no(f"triton does not import ({type(error).__name__}: {error}); install the `triton` extra")
        if _interpreting():
            return Verdict.yes("TRITON_INTERPRET=1: runs on CPU tensors in Triton's interpreter")
        if not torch.cuda.is_available():
            return Verdict.no("needs a CUDA GPU (or TRITON_INTERPRET=1 to run CPU tensors in the interpreter)")
        return Verdict.yes("CUDA: forward and training")

    def fingerprint_extras(self) -> dict[str, str]:
        return {"interpreter": "on" if _interpreting() else "off"}

    def supports(self, spec: KDASpec) -> Verdict:
        broken = []
        if spec.device.type == "cuda":
            if torch.cuda.get_device_capability(spec.device) < MIN_CAPABILITY:
                broken.append("needs compute capability >= 8.0")
        elif not (spec.device.type == "cpu" and _interpreting()):
            broken.append(f"runs on CUDA, or on the CPU with TRITON_INTERPRET=1; the call is on {spec.device}")
        if spec.dtype == torch.float64:
            broken.append("no float64 (the torch backend serves float64)")
        if spec.use_graph and spec.is_varlen and spec.device.type == "cuda":
            broken.append("use_graph with cu_seqlens: lays out its chunks from cu_seqlens' values on the host")
        return Verdict.unless(broken)

    def supports_recurrent(self, spec: RecurrentSpec) -> Verdict:
        """The decode op: `recurrent.recurrent_forward` (one launch, no host sync), via `recurrent_adapter`."""
        from kda.backends.triton.recurrent_adapter import unsupported_reasons

        broken = []
        if spec.device.type == "cuda":
            if torch.cuda.get_device_capability(spec.device) < MIN_CAPABILITY:
                broken.append("needs compute capability >= 8.0")
        elif not (spec.device.type == "cpu" and _interpreting()):
            broken.append(f"runs on CUDA, or on the CPU with TRITON_INTERPRET=1; the call is on {spec.device}")
        return Verdict.unless(broken + unsupported_reasons(spec))

    def recurrent_forward(self, inputs: RecurrentInputs, spec: RecurrentSpec) -> RecurrentResult:
        from kda.backends.triton.recurrent_adapter import triton_recurrent

        return triton_recurrent(inputs, spec)

    def forward(self, inputs: KDAInputs, spec: KDASpec, out: KDAOutputs | None = None) -> ForwardResult:
        from kda.backends.triton.forward import triton_forward

        return triton_forward(inputs, spec, out)

    def backward(
        self, inputs: KDAInputs, spec: KDASpec, saved, do: torch.Tensor, dfinal_state: torch.Tensor | None
    ) -> KDAGradients:
        from kda.backends.triton.backward import triton_backward

        return triton_backward(inputs, spec, saved, do, dfinal_state)
