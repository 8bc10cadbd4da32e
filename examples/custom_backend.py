"""Add your own backend: a class with a name, a capability check with reasons, and a forward.

This one computes KDA with the plain per-token recurrence in float32 (forward only). kda verifies it
against the float64 reference before first use and, since it claims a higher priority than the torch
backend, `auto` then picks it for calls that need no gradient.

    python examples/custom_backend.py
"""

import torch
import torch.nn.functional as F

import kda
from kda.reference import kda_reference


class RecurrentFP32(kda.Backend):
    """The naive recurrence in float32: slow, simple, forward-only."""

    name = "recurrent-fp32"
    version = "1"  # bump whenever its numbers can change: that invalidates its verification records
    priority = 10  # above torch (0), so auto prefers it once verified
    trains = False  # no backward: used only when no gradient is needed
    description = "per-token recurrence in float32 (example backend)"

    def supports(self, spec: kda.KDASpec) -> kda.Verdict:
        reasons = []
        if spec.T > 4096:
            reasons.append(f"one Python step per token: T={spec.T} > 4096 would be too slow")
        return kda.Verdict.unless(reasons)

    def forward(self, inputs: kda.KDAInputs, spec: kda.KDASpec, out=None) -> kda.ForwardResult:
        o, state = kda_reference(
            inputs.q,
            inputs.k,
            inputs.v,
            inputs.g,
            inputs.beta,
            scale=spec.scale,
            initial_state=inputs.initial_state,
            output_final_state=spec.output_final_state,
            use_qk_l2norm_in_kernel=spec.use_qk_l2norm_in_kernel,
            use_gate_in_kernel=spec.use_gate_in_kernel,
            use_beta_sigmoid_in_kernel=spec.use_beta_sigmoid_in_kernel,
            allow_neg_eigval=spec.allow_neg_eigval,
            safe_gate=spec.safe_gate,
            lower_bound=spec.lower_bound,
            state_v_first=spec.state_v_first,
            cu_seqlens=inputs.cu_seqlens,
            A_log=inputs.A_log,
            dt_bias=inputs.dt_bias,
            compute_dtype=torch.float32,
        )
        return kda.ForwardResult(o.to(spec.dtype), state)


kda.register_backend(RecurrentFP32)

B, T, H, K, V = 1, 100, 2, 32, 32
q, k = torch.randn(B, T, H, K), F.normalize(torch.randn(B, T, H, K), dim=-1)
v, beta = torch.randn(B, T, H, V), torch.rand(B, T, H)
g = F.logsigmoid(torch.randn(B, T, H, K))

with kda.trace_routes() as routes:
    o, _ = kda.chunk_kda(q, k, v, g, beta)  # inference: the new backend, once verified
print("inference ran on:", routes[0].backend)
print(kda.explain(q, k, v, g, beta))

q.requires_grad_(True)
with kda.trace_routes() as routes:
    o, _ = kda.chunk_kda(q, k, v, g, beta)  # training: forward-only backends are skipped
print("training ran on:", routes[0].backend)
