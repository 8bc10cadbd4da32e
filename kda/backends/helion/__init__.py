"""The `helion` backend: kda's own chunked KDA kernels written in Helion, forward and backward.

Stages, one module and one Helion kernel each (the math is in each module's docstring):

0. `normalize` : q and k l2-normalized, with ``use_qk_l2norm_in_kernel``;
1. `gate`      : the gate and beta activations, with the in-chunk cumulative sum of the gate;
2. `scores`    : per 16-row strip of a chunk, the causal scores ``A_kk``, ``A_qk`` (anchored products off
                 the diagonal, exact elementwise on it) and ``q_e``;
3. `solve`     : per chunk, ``T = (I + A_kk)^-1`` by 16-row blocks, then ``w``, ``u``, ``k_g``;
4. `state`     : the serial pass over each sequence's chunks: ``h`` and ``v_new``;
5. `output`    : ``o`` in parallel over chunks.

The backward (`backward`, the host wrapper) mirrors them: a reverse serial pass (`state_backward`), the
per-chunk gradients of the state products and of the WY transform (`chunk_backward`), of the score
matrices (`score_backward`, with the exact diagonal blocks of steep strips in `score_diagonal`), and the
elementwise tails through the gate, beta and l2norm (`tails`).

It covers the whole contract: the gate modes, l2norm and beta sigmoid in kernel, ``allow_neg_eigval``,
varlen, GVA, both state layouts, chunk 32 and 64, K and V of 64, 128 and 256 (any multiple of 16 up to
256), any T, bf16/fp16/fp32. Launch configurations are shipped per architecture (`configs`); nothing is
autotuned at call time.

With ``HELION_INTERPRET=1`` the backend accepts CPU tensors and runs every kernel as eager PyTorch
(Helion's reference mode, `runtime`): how CI checks the kernels, and how a user steps through them.
"""

from __future__ import annotations

import torch

from kda.backends.base import Backend, ForwardResult, KDAGradients, KDAInputs, KDAOutputs, Verdict
from kda.backends.helion import configs, runtime
from kda.recurrent.spec import RecurrentSpec
from kda.spec import KDASpec

MIN_CAPABILITY = (8, 0)
HEAD_DIM_LIMIT = 256
TRAINING_HEAD_DIM_LIMIT = 128  # on CUDA; see `supports`


class HelionBackend(Backend):
    """kda's own Helion kernels: forward and training, on CUDA or in Helion's CPU interpreter."""

    name = "helion"
    version = "9"  # bump whenever a kernel changes: verification records are kept per version
    priority = 4  # below triton and fla until measured faster: `kda.bench --tune` decides where it is
    trains = True
    writes_into_outputs = True
    description = "kda's own chunked Helion kernels, forward and backward; CUDA, or CPU through HELION_INTERPRET=1"

    def available(self) -> Verdict:
        problem = runtime.helion_problem()
        if problem is not None:
            return Verdict.no(problem)
        if runtime.interpreting():
            return Verdict.yes(
                f"HELION_INTERPRET=1: runs on CPU tensors as eager PyTorch (helion {runtime.helion_version()})"
            )
        if not torch.cuda.is_available():
            return Verdict.no("needs a CUDA GPU (or HELION_INTERPRET=1 to run CPU tensors in Helion's interpreter)")
        return Verdict.yes(f"CUDA: forward and training (helion {runtime.helion_version()})")

    def fingerprint_extras(self) -> dict[str, str]:
        return {
            "interpreter": "on" if runtime.interpreting() else "off",
            "helion": runtime.helion_version(),
            "configs": configs.fingerprint(),
        }

    def supports(self, spec: KDASpec) -> Verdict:
        broken = []
        if spec.device.type == "cuda":
            if torch.cuda.get_device_capability(spec.device) < MIN_CAPABILITY:
                broken.append("needs compute capability >= 8.0")
        elif not (spec.device.type == "cpu" and runtime.interpreting()):
            broken.append(f"runs on CUDA, or on the CPU with HELION_INTERPRET=1; the call is on {spec.device}")
        if spec.dtype == torch.float64:
            broken.append("no float64 (the torch backend serves float64)")
        for dim, value in (("K", spec.K), ("V", spec.V)):
            if value % 16 or value > HEAD_DIM_LIMIT:
                broken.append(
                    f"head dim {dim}={value}: takes multiples of 16 up to {HEAD_DIM_LIMIT} (tensor-core tiles)"
                )
        if spec.requires_grad and spec.device.type == "cuda" and max(spec.K, spec.V) > TRAINING_HEAD_DIM_LIMIT:
            broken.append(
                f"training at head dims above {TRAINING_HEAD_DIM_LIMIT} (K={spec.K}, V={spec.V}): on the H200 and "
                "H100 the compiled `state_backward` faults at 256 in some classes (illegal memory access in fp16 "
                "varlen GVA training, found by `kda.verify`; three other d256 training classes pass and the "
                "interpreter computes every one right), so it is not offered there"
            )
        if spec.use_graph and spec.is_varlen and spec.device.type == "cuda":
            broken.append("use_graph with cu_seqlens: lays out its chunks from cu_seqlens' values on the host")
        return Verdict.unless(broken)

    def supports_recurrent(self, spec: RecurrentSpec) -> Verdict:
        return Verdict.no(
            "no Helion decode kernel in this backend: the triton backend's decode step runs at 59-82% of the "
            "copy bandwidth on the H200, and a Helion one (benchmarks/helion_decode.py) has not been measured "
            "against it on a GPU yet"
        )

    def forward(self, inputs: KDAInputs, spec: KDASpec, out: KDAOutputs | None = None) -> ForwardResult:
        from kda.backends.helion.forward import helion_forward

        return helion_forward(inputs, spec, out)

    def backward(
        self, inputs: KDAInputs, spec: KDASpec, saved, do: torch.Tensor, dfinal_state: torch.Tensor | None
    ) -> KDAGradients:
        from kda.backends.helion.backward import helion_backward

        return helion_backward(inputs, spec, saved, do, dfinal_state)
