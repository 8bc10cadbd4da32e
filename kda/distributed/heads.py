"""Head parallelism: an all-to-all in, whole sequences for a slice of the heads on each rank, an all-to-all
out. For when the heads outnumber the ranks (``H`` and ``HV`` multiples of the world size).

Rank ``r`` holds tokens ``[offsets[r], offsets[r+1])`` of every head. The first exchange sends each rank's
tokens of heads ``[r' H / W, (r' + 1) H / W)`` to rank ``r'``, which then holds every token of its heads
and runs one ordinary backend call over the whole batch (``cu_seqlens`` global, initial states of its
heads); the second exchange returns each rank its tokens of every head. Final states are all-gathered
along the heads. The backward is the same exchanges reversed (`comm.all_to_all`'s autograd).

Bytes sent per rank: ``(W - 1) / W`` of its q, k, v, g, beta slice in, and of its ``o`` slice out.
"""

from __future__ import annotations

import torch

from kda.distributed import comm
from kda.distributed.context import CPContext
from kda.errors import KDAInputError


def _scatter_heads(x: torch.Tensor, ctx: CPContext) -> torch.Tensor:
    """``[B, T_local, X, ...]`` of every head -> ``[B, T, X / W, ...]``: every token of this rank's heads."""
    chunks = list(x.chunk(ctx.world, dim=2))
    shapes = [torch.Size((x.shape[0], ctx.splits[r], *chunks[0].shape[2:])) for r in range(ctx.world)]
    return torch.cat(comm.all_to_all(chunks, shapes, ctx.group), dim=1)


def _gather_heads(x: torch.Tensor, ctx: CPContext) -> torch.Tensor:
    """The inverse: ``[B, T, X / W, ...]`` of this rank's heads -> ``[B, T_local, X, ...]``."""
    chunks = list(x.split(list(ctx.splits), dim=1))
    shape = torch.Size((x.shape[0], ctx.local_tokens, *x.shape[2:]))
    return torch.cat(comm.all_to_all(chunks, [shape] * ctx.world, ctx.group), dim=2)


def head_parallel(
    call, tensors: dict[str, torch.Tensor], per_head: dict[str, torch.Tensor | None], want_final: bool, ctx: CPContext
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """This rank's ``o`` and (with `want_final`) the final states ``[N, HV, K, V]`` of every head.

    `call(inputs, initial_state, per_head)` runs the backend on the whole batch of this rank's heads;
    `per_head` holds ``initial_state [N, HV, K, V]``, ``A_log [HV]``, ``dt_bias [HV, K]`` (or None), sliced
    here to this rank's heads."""
    H, HV = tensors["q"].shape[2], tensors["v"].shape[2]
    if H % ctx.world or HV % ctx.world:
        raise KDAInputError(
            "cp_context", f"head mode needs H and HV multiples of the {ctx.world} ranks", f"H={H}, HV={HV}"
        )
    lo, hi = ctx.rank * HV // ctx.world, (ctx.rank + 1) * HV // ctx.world
    mine = {name: _scatter_heads(t, ctx) for name, t in tensors.items()}
    sliced = {
        name: (None if t is None else t[:, lo:hi] if name == "initial_state" else t[lo:hi])
        for name, t in per_head.items()
    }
    o_heads, final_heads = call(mine, sliced)
    o = _gather_heads(o_heads, ctx)
    final = None
    if want_final:
        assert final_heads is not None
        gathered = comm.all_gather(final_heads.contiguous(), ctx.group)  # [W, N, HV / W, K, V]
        final = torch.cat(list(gathered.unbind(0)), dim=1)
        o = comm.join(o, gathered)
    return o, final
