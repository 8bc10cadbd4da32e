"""Quickstart: one KDA layer's attention on the CPU, forward and backward, and why that backend ran.

python examples/quickstart.py
"""

import logging

import torch

import kda

logging.basicConfig(level=logging.INFO, format="%(message)s")  # kda logs its choice once per case class

B, T, H, K, V = 2, 200, 4, 64, 64
q = torch.randn(B, T, H, K, requires_grad=True)
k = torch.randn(B, T, H, K, requires_grad=True)
v = torch.randn(B, T, H, V, requires_grad=True)
g = torch.randn(B, T, H, K, requires_grad=True)  # raw gate input: the safe gate is applied in kernel
beta = torch.randn(B, T, H, requires_grad=True)  # logits: sigmoid applied in kernel
A_log = torch.log(torch.empty(H).uniform_(1, 16)).requires_grad_()
dt_bias = torch.randn(H * K, requires_grad=True)

call = dict(
    A_log=A_log,
    dt_bias=dt_bias,
    use_gate_in_kernel=True,
    safe_gate=True,
    lower_bound=-5.0,
    use_qk_l2norm_in_kernel=True,
    use_beta_sigmoid_in_kernel=True,
    output_final_state=True,
)

with kda.trace_routes() as routes:
    o, final_state = kda.chunk_kda(q, k, v, g, beta, **call)  # backend="auto"
    (o.square().mean() + final_state.square().mean()).backward()

print(f"o {tuple(o.shape)} {o.dtype}, final_state {tuple(final_state.shape)} {final_state.dtype}")
print("ran:", [(r.backend, r.phase) for r in routes])
print(kda.explain(q, k, v, g, beta, **call))

# The same call against the float64 reference, the ground truth every backend is verified against.
o_ref, _ = kda.kda_reference(
    q.detach(),
    k.detach(),
    v.detach(),
    g.detach(),
    beta.detach(),
    **{n: (x.detach() if torch.is_tensor(x) else x) for n, x in call.items()},
)
print(f"relative L2 error vs float64 reference: {(o.double() - o_ref).norm() / o_ref.norm():.2e}")

# Bad input fails before any kernel runs, naming the rule.
try:
    kda.chunk_kda(q, k, v, g, beta, **{**call, "lower_bound": -8.0})
except kda.KDAInputError as error:
    print("KDAInputError:", error)
