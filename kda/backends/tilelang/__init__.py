"""The `tilelang` backend: kda's own chunked KDA forward written in TileLang, for Hopper's own instructions.

Stages, one module each (the math is in each module's docstring), three kernels:

1. `gate`   : the gate and beta activations, with the in-chunk cumulative sum of the gate: a TileLang
              macro expanded at the start of `intra`, so ``G`` stays in shared memory;
2. `intra`  : per chunk, the causal scores by 16-row strips (``wgmma``), ``T = (I + A_kk)^-1`` by 16-row
              blocks (substitution on the diagonal, ``wgmma`` on bf16 halves between them), and ``w``,
              ``u``, ``q_e``, ``k_g``;
3. `state`  : the serial pass over each sequence's chunks (``wgmma``, the next chunk's tiles loaded
              ahead by the bulk copy engine);
4. `output` : ``o`` in parallel over chunks.

The backward (`backward`, six launches): `state_backward` (the reverse serial pass), `chunk_backward` (the
state products and the WY transform per chunk), `score_backward` (the two score matrices by strips), and
`tails` (the gate and beta activations, the GVA sums and the l2norm), from what the training forward saved.

What it covers: every gate mode, l2norm and beta sigmoid in kernel, ``allow_neg_eigval``, varlen, GVA,
initial and final state in both layouts, chunk 32 and 64, K and V of 64, 128 and 256, any T, bf16 and
fp16 inputs, on a Hopper GPU (compute capability 9.x) with CUDA's nvcc; training at head dims up to
`TRAINING_HEAD_DIM_LIMIT`. What it declines, with the reason: training at larger head dims, fp32 inputs (TileLang's fp32 products are TF32, and fp32 calls are
verified to 1e-3), other head dims, and ``use_graph`` with varlen (the chunk layout is built on the host).

Kernels are compiled on first use per specialization (dtype, chunk, head dims, gate flags; never
sequence length, batch or head counts) and kept on disk by TileLang; `supports` compiles them before it says
yes, so a kernel that does not compile is a "no" with the compiler's reason and the call goes elsewhere.
"""

from __future__ import annotations

import torch

from kda.backends.base import Backend, ForwardResult, KDAGradients, KDAInputs, KDAOutputs, Verdict
from kda.backends.tilelang import runtime
from kda.spec import KDASpec

HEAD_DIMS = (64, 128, 256)
TRAINING_HEAD_DIM_LIMIT = 128
CHUNKS = (32, 64)
DTYPES = (torch.bfloat16, torch.float16)


class TileLangBackend(Backend):
    """kda's own TileLang kernels, forward and backward, on Hopper GPUs."""

    name = "tilelang"
    version = "16"  # bump whenever a kernel changes: verification records are kept per version
    priority = 3  # below triton, helion and fla until measured faster: `kda.bench --tune` decides
    trains = True
    writes_into_outputs = True
    description = "kda's own chunked TileLang kernels (wgmma, bulk copies), forward and backward; Hopper GPUs with nvcc"

    def available(self) -> Verdict:
        problem = runtime.tilelang_problem()
        if problem is not None:
            return Verdict.no(problem)
        if not torch.cuda.is_available():
            return Verdict.no("needs a CUDA GPU (CI lowers the kernels to CUDA source on the CPU instead)")
        major, minor = torch.cuda.get_device_capability()
        if major != 9:
            return Verdict.no(f"written for Hopper (compute capability 9.x: wgmma); this GPU is {major}.{minor}")
        return Verdict.yes(f"Hopper GPU, nvcc at {runtime.find_nvcc()} (tilelang {runtime.tilelang_version()})")

    def fingerprint_extras(self) -> dict[str, str]:
        return {"tilelang": runtime.tilelang_version()}

    def supports(self, spec: KDASpec) -> Verdict:
        broken = []
        if spec.device.type != "cuda":
            broken.append(f"runs on a CUDA GPU; the call is on {spec.device}")
        elif torch.cuda.get_device_capability(spec.device)[0] != 9:
            broken.append("written for Hopper (compute capability 9.x)")
        if spec.requires_grad and max(spec.K, spec.V) > TRAINING_HEAD_DIM_LIMIT:
            broken.append(
                f"training at head dims above {TRAINING_HEAD_DIM_LIMIT} (K={spec.K}, V={spec.V}): the backward's "
                "tiles are sized for them"
            )
        if spec.dtype not in DTYPES:
            broken.append(
                f"dtype {spec.dtype}: takes bf16 and fp16 (TileLang's fp32 products are TF32, short of the "
                "1e-3 that fp32 calls are verified to)"
            )
        for dim, value in (("K", spec.K), ("V", spec.V)):
            if value not in HEAD_DIMS:
                broken.append(f"head dim {dim}={value}: takes {' and '.join(map(str, HEAD_DIMS))}")
        if spec.chunk_size not in CHUNKS:
            broken.append(f"chunk_size={spec.chunk_size}: takes 32 and 64")
        if spec.use_graph and spec.is_varlen:
            broken.append("use_graph with cu_seqlens: lays out its chunks from cu_seqlens' values on the host")
        if broken:
            return Verdict.unless(broken)
        from kda.backends.tilelang import kernels

        try:
            kernels.compile_all(spec)
        except runtime.CompileFailure as failure:
            return Verdict.no(f"a kernel did not compile: {failure}")
        return Verdict.yes()

    def forward(self, inputs: KDAInputs, spec: KDASpec, out: KDAOutputs | None = None) -> ForwardResult:
        from kda.backends.tilelang.forward import tilelang_forward

        return tilelang_forward(inputs, spec, out)

    def backward(
        self, inputs: KDAInputs, spec: KDASpec, saved, do: torch.Tensor, dfinal_state: torch.Tensor | None
    ) -> KDAGradients:
        from kda.backends.tilelang.backward import tilelang_backward

        return tilelang_backward(inputs, spec, saved, do, dfinal_state)
