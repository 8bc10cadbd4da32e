"""Context parallelism: one batch of long sequences split over the ranks of a process group.

    torchrun --nproc-per-node 2 examples/context_parallel.py          # CPU (gloo) or GPUs (NCCL)

Every rank builds the same global batch (here from one seed; in training, each rank loads only its slice),
takes its slice of the tokens, and calls `kda.chunk_kda` with the context; the backward needs nothing more.
Both modes run: "sequence" (each rank its slice of tokens, states chained across ranks) and "head" (an
all-to-all, each rank whole sequences for a slice of the heads). Rank 0 then checks the pieces against the
single-process call.
"""

from __future__ import annotations

import gc
import os

import torch
import torch.distributed as dist
import torch.nn.functional as F

import kda
from kda.distributed import build_cp_context
from kda.verify.check import relative_error


def global_batch(device: torch.device) -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(0)
    T, H, D = 300, 4, 32
    lengths = [120, 50, 130]  # the first and last sequences cross rank boundaries

    def randn(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=gen).to(device)

    return {
        "q": randn(1, T, H, D),
        "k": randn(1, T, H, D),
        "v": randn(1, T, H, D),
        "g": F.logsigmoid(randn(1, T, H, D) + 3.0),
        "beta": torch.sigmoid(randn(1, T, H)),
        "cu_seqlens": torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], device=device),
    }


def run_mode(mode: str, batch: dict[str, torch.Tensor], rank: int, world: int, device: torch.device) -> None:
    names = ("q", "k", "v", "g", "beta")
    options = dict(use_qk_l2norm_in_kernel=True, output_final_state=True)  # the delta rule wants unit keys
    ctx = build_cp_context(dist.group.WORLD, batch["cu_seqlens"], mode=mode)
    lo, hi = ctx.offsets[rank], ctx.offsets[rank + 1]
    mine = {n: batch[n][:, lo:hi].clone().requires_grad_() for n in names}
    o, final = kda.chunk_kda(**mine, **options, cp_context=ctx)
    o.sum().backward()  # this rank's part of the loss; autograd runs the exchanges backwards too

    pieces = [torch.empty(1, ctx.splits[r], *o.shape[2:], dtype=o.dtype, device=device) for r in range(world)]
    dist.all_gather(pieces, o.detach().contiguous())  # only to check the result here
    grads = [torch.empty_like(p) for p in pieces]
    dist.all_gather(grads, mine["v"].grad.contiguous())
    if rank == 0:
        whole = {n: batch[n].clone().requires_grad_() for n in names}
        o_ref, final_ref = kda.chunk_kda(**whole, **options, cu_seqlens=batch["cu_seqlens"])
        o_ref.sum().backward()
        errors = {
            "o": relative_error(torch.cat(pieces, dim=1), o_ref.detach()),
            "final_state": relative_error(final.detach(), final_ref.detach()),
            "dv": relative_error(torch.cat(grads, dim=1), whole["v"].grad),
        }
        report = ", ".join(f"{name} {error:.1e}" for name, error in errors.items())
        print(f"{mode} parallel over {world} ranks, splits {list(ctx.splits)}: relative error vs one call: {report}")


def main() -> None:
    cuda = torch.cuda.is_available()
    dist.init_process_group("nccl" if cuda else "gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", 0))) if cuda else torch.device("cpu")
    batch = global_batch(device)
    for mode in ("sequence", "head"):
        run_mode(mode, batch, rank, world, device)
    # Leave together, holding nothing of the group: the autograd graph of a context-parallel output keeps the
    # group alive, and a gloo group still alive when the interpreter shuts down aborted a rank now and then
    # ("terminate called without an active exception"), so the outputs go (with run_mode's frame) first.
    gc.collect()
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
