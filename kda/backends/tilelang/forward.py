"""The forward pass: two launches (``intra``, with the ``gate`` macro inside it, then ``state`` with the output
in its serial pass), or three where `kernels.state_plan` keeps ``output`` apart (K = 256); the math is in
each module.

Inputs are read token-major where the caller put them (``tokens = B*T``, or ``T`` with varlen): q, k
``[tokens, H, K]``, v ``[tokens, HV, V]``, g ``[tokens, HV, K]``, beta ``[tokens, HV]``; o ``[tokens, HV, V]``.
Intermediates are chunk-major (``[NT, HV, C, ...]``): ``G_last [NT, HV, K]`` in fp32 (``G`` itself never
leaves the intra kernel's shared memory); ``q_e``, ``k_g``, ``w [NT, HV, C, K]``, ``u``/``v_new [NT, HV, C, V]``, ``A_qk [NT, HV, C, C]`` and
``h [NT, HV, K, V]`` in the inputs' dtype (``h`` and ``v_new`` only where something reads them back: the
output stage, the backward, or the caller's intermediate states). When the call trains, `intra` also writes what the backward reads
and nothing else computes: ``G [NT, HV, C, K]``, ``beta [NT, HV, C]``, ``M = A_kk / beta`` and
``T = (I + A_kk)^-1 [NT, HV, C, C]``, all fp32, and with the l2norm the reciprocal norms ``r`` of q's and k's
rows, ``[tokens, H]`` fp32 (the backward forms the normalized rows ``x r`` from the inputs, autograd's saved
tensors, and ``r``: storing them in fp32 cost 8 bytes a token, head and key column); these, the
intermediates above and the layout go to `backward` as ``saved``. Training also keeps ``u``/``v_new`` in
fp32 (and `intra` forms ``w`` and ``u`` from halves of their fp32 operands): the backward's ``dA_log`` needs
them exact (`intra`'s docstring); ``q_e``, ``k_g``, ``w``, ``A_qk`` and ``h`` stay in the inputs' dtype, the
values the forward multiplied by.

The kernels and their compile-time parameters are `kernels.specializations`'s.
"""

from __future__ import annotations

import torch

from kda.backends.base import ForwardResult, KDAInputs, KDAOutputs
from kda.backends.chunks import chunk_layout, deliver, output_buffers, per_chunk_states, sequence_bounds
from kda.backends.tilelang import kernels
from kda.spec import KDASpec


def tilelang_forward(inputs: KDAInputs, spec: KDASpec, out: KDAOutputs | None = None) -> ForwardResult:
    compiled = kernels.compile_all(spec)
    device, f32 = spec.device, torch.float32
    B, T, H, HV, K, V, C = spec.B, spec.T, spec.H, spec.HV, spec.K, spec.V, spec.chunk_size
    tokens = B * T
    layout = chunk_layout(sequence_bounds(inputs, spec), C, device)
    NT = max(layout.num_chunks, 1)
    dtype = spec.dtype

    q = inputs.q.reshape(tokens, H, K).contiguous()
    k = inputs.k.reshape(tokens, H, K).contiguous()
    v = inputs.v.reshape(tokens, HV, V).contiguous()
    G_last = torch.empty(NT, HV, K, dtype=f32, device=device)
    q_e = torch.empty(NT, HV, C, K, dtype=dtype, device=device)
    k_g = torch.empty_like(q_e)
    w = torch.empty_like(q_e)
    train = spec.requires_grad
    # u, then v_new (the state pass writes over it); fp32 in training, for the backward's dA_log
    u = torch.empty(NT, HV, C, V, dtype=f32 if train else dtype, device=device)
    A_qk = torch.empty(NT, HV, C, C, dtype=dtype, device=device)
    placeholder = torch.zeros(1, dtype=f32, device=device)
    fused = "output" not in compiled
    keep_h = not fused or train or spec.return_intermediate_states
    unused = torch.empty(1, dtype=dtype, device=device)  # a parameter the compiled kernel does not read
    h = torch.empty(NT, HV, K, V, dtype=dtype, device=device) if keep_h else unused
    o, ht = output_buffers(spec, out)
    h0 = inputs.initial_state.contiguous() if inputs.initial_state is not None else None

    if train:
        G = torch.empty(NT, HV, C, K, dtype=f32, device=device)
        beta = torch.empty(NT, HV, C, dtype=f32, device=device)
        M = torch.empty(NT, HV, C, C, dtype=f32, device=device)
        T_inv = torch.empty(NT, HV, C, C, dtype=f32, device=device)
    else:
        G = beta = M = T_inv = placeholder
    norms = train and spec.use_qk_l2norm_in_kernel
    rstd_q = torch.empty(tokens, H, dtype=f32, device=device) if norms else placeholder
    rstd_k = torch.empty(tokens, H, dtype=f32, device=device) if norms else placeholder

    if layout.num_chunks > 0:
        A_log = (
            inputs.A_log.float().contiguous() if inputs.A_log is not None else torch.zeros(HV, dtype=f32, device=device)
        )
        dt_bias = inputs.dt_bias.reshape(HV, K).float().contiguous() if inputs.dt_bias is not None else placeholder
        g = inputs.g.reshape(tokens, HV, K).contiguous()
        b = inputs.beta.reshape(tokens, HV).contiguous()
        starts, ends = layout.chunk_starts, layout.chunk_seq_ends
        compiled["intra"](
            q, k, v, g, b, A_log, dt_bias, starts, ends, G_last, q_e, k_g, w, u, A_qk,
            G, beta, M, T_inv, rstd_q, rstd_k,
        )  # fmt: skip
    o_tokens = o.view(tokens, HV, V) if tokens > 0 else torch.empty(1, HV, V, dtype=dtype, device=device)
    if layout.num_seqs > 0:
        # each sequence's first and end chunk as buffers of their own: a view one element in starts 4 bytes
        # past an aligned address, which a kernel's argument checks may refuse
        index = layout.chunk_starts[:1]  # `starts` is never empty: one int32 element to stand in
        output_args = (q_e, A_qk, layout.chunk_starts, layout.chunk_seq_ends, o_tokens) if fused else (
            unused, unused, index, index, unused,
        )  # fmt: skip
        compiled["state"](
            w, u, k_g, G_last, layout.chunk_bounds[:-1].clone(), layout.chunk_bounds[1:].clone(), h,
            h0 if h0 is not None else placeholder, ht if ht is not None else placeholder, *output_args,
        )  # fmt: skip
    if layout.num_chunks > 0 and not fused:
        compiled["output"](q_e, h, A_qk, u, layout.chunk_starts, layout.chunk_seq_ends, o_tokens)

    o, ht = deliver(o, ht, out)
    per_chunk = per_chunk_states(h, layout.num_chunks, B, spec) if spec.return_intermediate_states else None
    saved = None
    if train:
        saved = dict(
            layout=layout, rstd_q=rstd_q if norms else None, rstd_k=rstd_k if norms else None,
            G=G, G_last=G_last, beta=beta, M=M, T=T_inv, A_qk=A_qk, q_e=q_e, w=w, k_g=k_g, v_new=u, h=h,
        )  # fmt: skip
    return ForwardResult(o, ht, saved, per_chunk)
