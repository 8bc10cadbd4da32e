"""The `flashkda` backend: MoonshotAI's FlashKDA CUTLASS forward (`flash_kda.fwd`), inference only.

FlashKDA fuses the whole forward (q/k l2norm, the beta sigmoid, the safe gate and the chunked delta rule)
into one Hopper kernel. It computes exactly one configuration of the contract, and this adapter accepts
exactly that and names every other requirement a call breaks:

- forward only (no gradients), on CUDA with compute capability 9.0 or newer;
- bf16 ``q, k, v, g, beta``; ``K = V = 128``; one value head per q/k head (``HV == H``, no GVA);
- the safe in-kernel gate ``g <- lower_bound * sigmoid(exp(A_log) * (g + dt_bias))``;
- ``use_qk_l2norm_in_kernel=True`` and ``use_beta_sigmoid_in_kernel=True`` without ``allow_neg_eigval``.

What the adapter converts rather than rejects, because the numbers do not change:

- the state layout: FlashKDA keeps states as ``[N, H, V, K]`` (``state_v_first``); a call in the default
  ``[N, H, K, V]`` layout gets its initial state transposed in and its final state transposed out;
- ``cu_seqlens`` as int32 (FlashKDA wants int64), ``dt_bias`` as ``[H*K]`` (it wants ``[H, K]``), and a
  missing ``A_log`` / ``dt_bias`` (zeros: ``exp(0) = 1`` and no bias, which is what None means);
- ``chunk_size``: FlashKDA chunks internally; the chunk size does not change the exact result.

Importing `flash_kda` proves nothing: a wheel built for another torch imports fine and then fails every
call (seen on the H200 machine with post20260810). That is why this backend, like every other, is used
only where `kda.verify` (or the dispatcher's first-use check) has seen it match the float64 reference.
"""

from __future__ import annotations

import importlib
from typing import Any

import torch

from kda.backends.base import Backend, ForwardResult, KDAInputs, KDAOutputs, Verdict
from kda.spec import GateMode, KDASpec

MIN_CAPABILITY = (9, 0)
HEAD_DIM = 128


def _flash_kda() -> Any:
    return importlib.import_module("flash_kda")


class FlashKDABackend(Backend):
    """FlashKDA's fused CUTLASS forward for Hopper and newer (inference only)."""

    name = "flashkda"
    version = "1"
    priority = 20
    trains = False
    writes_into_outputs = True
    description = "FlashKDA (flash_kda.fwd): fused CUTLASS forward, sm90+, bf16, K=V=128, safe gate, inference"

    def imports(self) -> Verdict:
        """Does `flash_kda` import and have a `fwd`? (Necessary, and far from sufficient.)"""
        try:
            module = _flash_kda()
        except Exception as error:  # not installed, or a broken build: either way it cannot run here
            return Verdict.no(
                f"flash_kda does not import ({type(error).__name__}: {error}); "
                "install the `flashkda` extra (PyPI tokenspeed-flashkda)"
            )
        if not callable(getattr(module, "fwd", None)):
            return Verdict.no("flash_kda has no callable `fwd`")
        return Verdict.yes()

    def available(self) -> Verdict:
        imported = self.imports()
        if not imported:
            return imported
        if not torch.cuda.is_available():
            return Verdict.no("needs a CUDA GPU; none is visible")
        found = [torch.cuda.get_device_capability(i) for i in range(torch.cuda.device_count())]
        if not any(cap >= MIN_CAPABILITY for cap in found):
            return Verdict.no(f"needs compute capability >= 9.0; found {', '.join(f'{a}.{b}' for a, b in found)}")
        return Verdict.yes("flash_kda imports (which proves nothing until verified)")

    def supports(self, spec: KDASpec) -> Verdict:
        broken = []
        if spec.device.type != "cuda":
            broken.append(f"runs on CUDA only; the call is on {spec.device}")
        elif torch.cuda.get_device_capability(spec.device) < MIN_CAPABILITY:
            major, minor = torch.cuda.get_device_capability(spec.device)
            broken.append(f"needs compute capability >= 9.0; {spec.device} has {major}.{minor}")
        for name in ("q", "k", "v", "g", "beta"):
            if getattr(spec, name).dtype != "bfloat16":
                broken.append(f"{name} must be bfloat16 (got {getattr(spec, name).dtype})")
        if spec.K != HEAD_DIM or spec.V != HEAD_DIM:
            broken.append(f"needs K = V = 128 (got K={spec.K}, V={spec.V})")
        if spec.HV != spec.H:
            broken.append(f"no GVA: needs HV == H (got H={spec.H}, HV={spec.HV})")
        if spec.gate_mode is not GateMode.SAFE:
            broken.append(
                f"needs the safe in-kernel gate (use_gate_in_kernel=True, safe_gate=True); got {spec.gate_mode.value}"
            )
        if not spec.use_qk_l2norm_in_kernel:
            broken.append("needs use_qk_l2norm_in_kernel=True (its l2norm is fused)")
        if not spec.use_beta_sigmoid_in_kernel:
            broken.append("needs use_beta_sigmoid_in_kernel=True (its beta sigmoid is fused)")
        if spec.allow_neg_eigval:
            broken.append("no allow_neg_eigval (its beta is sigmoid(beta), not 2*sigmoid(beta))")
        if spec.return_intermediate_states:
            broken.append("no return_intermediate_states (its fused forward keeps the per-chunk states on chip)")
        if spec.use_graph and spec.is_varlen:
            broken.append("use_graph with cu_seqlens: not known to run without reading cu_seqlens on the host")
        return Verdict.unless(broken)

    def forward(self, inputs: KDAInputs, spec: KDASpec, out: KDAOutputs | None = None) -> ForwardResult:
        fwd = _flash_kda().fwd
        lower_bound = spec.lower_bound
        assert lower_bound is not None  # supports() admits the safe gate only, which has one
        H, K = spec.H, spec.K
        device = spec.device
        # q, k, v, g: [B, T, H, 128] bf16; beta: [B, T, H] bf16 logits
        q, k, v, g, beta = (t.contiguous() for t in (inputs.q, inputs.k, inputs.v, inputs.g, inputs.beta))
        A_log = inputs.A_log if inputs.A_log is not None else torch.zeros(H, dtype=torch.float32, device=device)
        dt_bias = (
            inputs.dt_bias.reshape(H, K)
            if inputs.dt_bias is not None
            else torch.zeros(H, K, dtype=torch.float32, device=device)
        )  # [H, K] fp32

        o = out.o if out is not None and out.o.is_contiguous() else torch.empty_like(v)  # [B, T, H, V]

        # FlashKDA's states are [N, H, V, K] fp32 ("v first"): transpose a [N, H, K, V] call in and out.
        h0 = inputs.initial_state
        if h0 is not None:
            h0 = h0.contiguous() if spec.state_v_first else h0.transpose(-1, -2).contiguous()
        final_v_first = None
        if spec.output_final_state:
            given = None if out is None else out.final_state
            if given is not None and spec.state_v_first and given.is_contiguous():
                final_v_first = given
            else:
                final_v_first = torch.empty(spec.num_seqs, H, spec.V, K, dtype=torch.float32, device=device)

        cu_seqlens = inputs.cu_seqlens
        if cu_seqlens is not None and cu_seqlens.dtype != torch.int64:
            cu_seqlens = cu_seqlens.to(torch.int64)

        fwd(
            q,
            k,
            v,
            g,
            beta,
            spec.scale,
            o,
            A_log=A_log.contiguous(),
            dt_bias=dt_bias.contiguous(),
            lower_bound=float(lower_bound),
            initial_state=h0,
            final_state=final_v_first,
            cu_seqlens=cu_seqlens,
        )

        if out is not None and o is not out.o:
            out.o.copy_(o)
            o = out.o
        final_state = None
        if final_v_first is not None:
            final_state = final_v_first if spec.state_v_first else final_v_first.transpose(-1, -2)  # call's layout
            if out is not None and out.final_state is not None:
                if final_state is not out.final_state:
                    out.final_state.copy_(final_state)
                    final_state = out.final_state
            elif not spec.state_v_first:
                final_state = final_state.contiguous()  # [N, H, K, V]
        return ForwardResult(o, final_state)
