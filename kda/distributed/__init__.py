"""Context parallelism: one long batch split over the ranks of a torch.distributed process group, any
verified backend computing each rank's part.

    ctx = kda.distributed.build_cp_context(group, cu_seqlens)          # mode="sequence" (default) or "head"
    o, final = kda.chunk_kda(q_mine, k_mine, v_mine, g_mine, beta_mine, cp_context=ctx, ...)

Each rank passes its slice of the token axis (``ctx.splits[rank]`` tokens, ``B == 1`` with ``cu_seqlens``,
any ``B`` dense) and gets its slice of ``o``; the backward runs under autograd with no extra call. Two modes
(`sequence`: the chunkwise state chain; `heads`: all-to-all over heads); the communication is
torch.distributed's (NCCL, gloo). Beyond FLA's ``cp_context``, kda takes ``initial_state`` (every
sequence's, the same on every rank) and ``output_final_state`` (every sequence's final state, on every
rank). Gradients of the inputs every rank holds whole (``initial_state``, ``A_log``, ``dt_bias``) are each
rank's share: sum them over the group, as data parallelism does for parameters.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from kda.distributed.context import CPContext, build_cp_context
from kda.errors import KDAInputError
from kda.options import KDAArguments

__all__ = ["CPContext", "build_cp_context", "chunk_kda_cp"]

_OWN = {"q", "k", "v", "g", "beta", "initial_state", "output_final_state", "state_v_first"}
_OWN |= {"cu_seqlens", "cu_seqlens_cpu", "cp_context", "A_log", "dt_bias"}


def chunk_kda_cp(
    args: KDAArguments, kwargs: dict[str, Any], backend: Any, *, local: Callable[..., tuple[Any, ...]]
) -> tuple[Any, ...]:
    """`kda.chunk_kda` with ``cp_context``: this rank's ``(o, final_state or None)``. `local` is
    `kda.chunk_kda` itself, handed down by the API, which computes each rank's part without the context:
    the arrows run one way (api -> distributed), and this package never imports the API above it."""
    from kda.distributed.heads import head_parallel
    from kda.distributed.sequence import sequence_parallel

    ctx = args.cp_context
    if not isinstance(ctx, CPContext):
        raise KDAInputError(
            "cp_context", "is a kda.distributed.CPContext (kda.distributed.build_cp_context)", type(ctx).__name__
        )
    for name in ("return_intermediate_states", "use_graph"):
        if getattr(args, name):
            raise KDAInputError(name, "is not available with cp_context", "True")
    q = args.q
    if not isinstance(q, torch.Tensor) or q.dim() != 4:
        raise KDAInputError(
            "q",
            "is a [B, T, H, K] tensor",
            type(q).__name__ if not isinstance(q, torch.Tensor) else str(tuple(q.shape)),
        )
    if q.shape[1] != ctx.local_tokens:
        raise KDAInputError("q", f"holds this rank's {ctx.local_tokens} tokens of cp_context (dim 1)", str(q.shape[1]))
    if ctx.bounds is not None and q.shape[0] != 1:
        raise KDAInputError("q", "has B == 1 with the cp_context's cu_seqlens", str(q.shape[0]))
    tensors = {name: getattr(args, name) for name in ("q", "k", "v", "g", "beta")}
    common = {f: getattr(args, f) for f in args.__dataclass_fields__ if f not in _OWN}
    h0 = args.initial_state
    if h0 is not None and args.state_v_first:
        h0 = h0.transpose(-1, -2)  # computed as [N, HV, K, V] inside

    def run(inputs, initial_state, cu, cu_cpu, A_log, dt_bias):
        o, final = local(
            **inputs, initial_state=initial_state, output_final_state=True, cu_seqlens=cu, cu_seqlens_cpu=cu_cpu,
            A_log=A_log, dt_bias=dt_bias, backend=backend, **common, **kwargs,
        )  # fmt: skip
        return o, final

    if ctx.mode == "sequence":

        def call(inputs, initial_state, cu, cu_cpu):
            return run(inputs, initial_state, cu, cu_cpu, args.A_log, args.dt_bias)

        o, final = sequence_parallel(call, tensors, h0, args.output_final_state, ctx)
    else:
        HV, K = tensors["v"].shape[2], tensors["q"].shape[3]
        dt = None if args.dt_bias is None else args.dt_bias.reshape(HV, K)
        A_log = None if args.A_log is None else args.A_log.reshape(HV)

        def call_heads(inputs, sliced):
            bias = sliced["dt_bias"]
            bounds = None if ctx.bounds is None else torch.tensor(ctx.bounds, dtype=torch.int64)
            cu = None if bounds is None else bounds.to(inputs["q"].device)
            return run(
                inputs, sliced["initial_state"], cu, bounds, sliced["A_log"], None if bias is None else bias.reshape(-1)
            )

        o, final = head_parallel(
            call_heads, tensors, {"initial_state": h0, "A_log": A_log, "dt_bias": dt}, args.output_final_state, ctx
        )
    if final is not None and args.state_v_first:
        final = final.transpose(-1, -2)
    return o, final if args.output_final_state else None
