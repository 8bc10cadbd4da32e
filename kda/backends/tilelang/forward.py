"""The forward pass: three launches (``intra``, with the ``gate`` macro inside it, ``state``, ``output``; the
math is in each module).

Inputs are read token-major where the caller put them (``tokens = B*T``, or ``T`` with varlen): q, k
``[tokens, H, K]``, v ``[tokens, HV, V]``, g ``[tokens, HV, K]``, beta ``[tokens, HV]``; o ``[tokens, HV, V]``.
Intermediates are chunk-major (``[NT, HV, C, ...]``): ``G_last [NT, HV, K]`` in fp32 (``G`` itself never
leaves the intra kernel's shared memory); ``q_e``, ``k_g``, ``w [NT, HV, C, K]``, ``u``/``v_new [NT, HV, C, V]``, ``A_qk [NT, HV, C, C]`` and
``h [NT, HV, K, V]`` in the inputs' dtype. When the call trains, `intra` also writes what the backward reads
and nothing else computes: ``G [NT, HV, C, K]``, ``beta [NT, HV, C]``, ``M = A_kk / beta`` and
``T = (I + A_kk)^-1 [NT, HV, C, C]``, all fp32, and with the l2norm the normalized ``q``, ``k``
``[tokens, H, K]`` in fp32 and their reciprocal norms ``[tokens, H]``; these, the intermediates above and the
layout go to `backward` as ``saved``. Training also keeps ``u``/``v_new`` in fp32 (and `intra` forms ``w`` and
``u`` from halves of their fp32 operands): the backward's ``dA_log`` needs them exact (`intra`'s docstring);
``q_e``, ``k_g``, ``w``, ``A_qk`` and ``h`` stay in the inputs' dtype, the values the forward multiplied by.

`specializations` lists every kernel a call needs with its compile-time parameters: the backend compiles
them all before it says yes to a call (`TileLangBackend.supports`), and CI lowers the same list for every
shape class the backend claims.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, NamedTuple

import torch

from kda.backends.base import ForwardResult, KDAInputs, KDAOutputs
from kda.backends.chunks import chunk_layout, deliver, output_buffers, per_chunk_states, sequence_bounds
from kda.backends.tilelang import gate, intra, output, runtime, state
from kda.spec import GateMode, KDASpec

GATES = {GateMode.PREGATED: gate.PREGATED, GateMode.SOFTPLUS: gate.SOFTPLUS}
GATES |= {GateMode.SIGMOID: gate.SIGMOID, GateMode.SAFE: gate.SAFE}
BV = 64  # value columns per program of the state and output stages


class Kernel(NamedTuple):
    name: str
    builder: Callable[..., Any]
    params: tuple[Any, ...]


def _dtype_name(dtype: torch.dtype | str) -> str:
    return str(dtype).removeprefix("torch.")


def rows_dtype(spec: KDASpec, dtype: str) -> str:
    """The dtype of the q, k rows a training forward saves for the backward: the l2-normalized rows in fp32
    (`intra` keeps them exact for ``dA_log``), or the inputs themselves (`dtype`)."""
    return "float32" if spec.use_qk_l2norm_in_kernel else dtype


def specializations(spec: KDASpec) -> list[Kernel]:
    """The kernels of `spec`: the forward's three, and the backward's five when the call trains."""
    C, K, V = spec.chunk_size, spec.K, spec.V
    dtype = _dtype_name(spec.dtype)
    bv = min(BV, V)
    has_h0 = spec.initial_state is not None
    gate_params = (
        GATES[spec.gate_mode],
        spec.dt_bias is not None,
        spec.use_beta_sigmoid_in_kernel,
        spec.g.dtype,
        spec.beta.dtype,
        float(spec.lower_bound or 0.0),
        2.0 if spec.allow_neg_eigval else 1.0,
    )
    train = spec.requires_grad
    l2norm = spec.use_qk_l2norm_in_kernel
    state_flags = (has_h0, spec.output_final_state, spec.state_v_first)
    kernels = [
        Kernel("intra", intra.build, (C, K, V, dtype, float(spec.scale), l2norm, *gate_params, train)),
        Kernel("state", state.build, (C, K, V, bv, dtype, *state_flags, train)),
        Kernel("output", output.build, (C, K, V, bv, dtype, "float32" if train else dtype)),
    ]
    if train:
        from kda.backends.tilelang.backward import specializations as backward_specializations

        kernels += [Kernel(*kernel) for kernel in backward_specializations(spec, dtype, gate_params)]
    return kernels


def compile_all(spec: KDASpec) -> dict[str, Any]:
    """The compiled kernels of `spec`, by stage name (raises `runtime.CompileFailure`)."""
    kernels = specializations(spec)
    built = runtime.compile_all([(kernel.builder, kernel.params) for kernel in kernels])
    return {kernel.name: compiled for kernel, compiled in zip(kernels, built, strict=True)}


def tilelang_forward(inputs: KDAInputs, spec: KDASpec, out: KDAOutputs | None = None) -> ForwardResult:
    kernels = compile_all(spec)
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
    h = torch.empty(NT, HV, K, V, dtype=dtype, device=device)
    o, ht = output_buffers(spec, out)
    placeholder = torch.zeros(1, dtype=f32, device=device)
    h0 = inputs.initial_state.contiguous() if inputs.initial_state is not None else None

    if train:
        G = torch.empty(NT, HV, C, K, dtype=f32, device=device)
        beta = torch.empty(NT, HV, C, dtype=f32, device=device)
        M = torch.empty(NT, HV, C, C, dtype=f32, device=device)
        T_inv = torch.empty(NT, HV, C, C, dtype=f32, device=device)
    else:
        G = beta = M = T_inv = placeholder
    norms = train and spec.use_qk_l2norm_in_kernel
    rows_placeholder = torch.zeros(1, dtype=dtype, device=device)  # a placeholder in the rows' own dtype
    rows = getattr(torch, rows_dtype(spec, _dtype_name(dtype)))
    q_n = torch.empty(tokens, H, K, dtype=rows, device=device) if norms else rows_placeholder
    k_n = torch.empty(tokens, H, K, dtype=rows, device=device) if norms else rows_placeholder
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
        kernels["intra"](
            q, k, v, g, b, A_log, dt_bias, starts, ends, G_last, q_e, k_g, w, u, A_qk,
            G, beta, M, T_inv, q_n, k_n, rstd_q, rstd_k,
        )  # fmt: skip
    if layout.num_seqs > 0:
        # each sequence's first and end chunk as buffers of their own: a view one element in starts 4 bytes
        # past an aligned address, which a kernel's argument checks may refuse
        kernels["state"](
            w, u, k_g, G_last, layout.chunk_bounds[:-1].clone(), layout.chunk_bounds[1:].clone(), h,
            h0 if h0 is not None else placeholder, ht if ht is not None else placeholder,
        )  # fmt: skip
    if layout.num_chunks > 0:
        kernels["output"](q_e, h, A_qk, u, layout.chunk_starts, layout.chunk_seq_ends, o.view(tokens, HV, V))

    o, ht = deliver(o, ht, out)
    per_chunk = per_chunk_states(h, layout.num_chunks, B, spec) if spec.return_intermediate_states else None
    saved = None
    if train:
        saved = dict(
            layout=layout, q=q_n if norms else q, k=k_n if norms else k,
            rstd_q=rstd_q if norms else None, rstd_k=rstd_k if norms else None,
            G=G, G_last=G_last, beta=beta, M=M, T=T_inv, A_qk=A_qk, q_e=q_e, w=w, k_g=k_g, v_new=u, h=h,
        )  # fmt: skip
    return ForwardResult(o, ht, saved, per_chunk)
