"""One rank of a context-parallel test: run by `test_context_parallel.py` in gloo processes it spawns.

Builds the global batch from the scenario's seed (the same on every rank), passes its own slice of the
tokens to `kda.chunk_kda(..., cp_context=...)`, takes the backward of ``sum(o * do)`` (plus, on rank 0
only, ``sum(final_state * dfinal)``: the final state is the same tensor on every rank), and saves what it
got for the test process to compare with the single-process call.
"""

from __future__ import annotations

import datetime
import os
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F

import kda
from kda.distributed import build_cp_context

GRADS = ("q", "k", "v", "g", "beta")
SHARED = ("initial_state", "A_log", "dt_bias")


def global_batch(s: dict[str, Any]) -> dict[str, Any]:
    """The whole batch of scenario `s`: inputs, call options, and the upstream gradients."""
    gen = torch.Generator().manual_seed(s["seed"])
    B, T, H, HV, K, V = s["B"], s["T"], s["H"], s["HV"], s["K"], s["V"]
    dtype = getattr(torch, s["dtype"])

    def randn(*shape: int, scale: float = 1.0) -> torch.Tensor:
        return torch.randn(*shape, generator=gen) * scale

    tensors = {
        "q": randn(B, T, H, K).to(dtype),
        "k": randn(B, T, H, K).to(dtype),
        "v": randn(B, T, HV, V).to(dtype),
        "g": randn(B, T, HV, K).to(dtype),
        "beta": randn(B, T, HV).to(dtype),
    }
    N = len(s["lengths"]) if s["lengths"] else B
    options: dict[str, Any] = dict(
        use_qk_l2norm_in_kernel=True, use_beta_sigmoid_in_kernel=True, use_gate_in_kernel=True, chunk_size=32
    )
    shared: dict[str, torch.Tensor] = {"A_log": randn(HV, scale=0.5), "dt_bias": randn(HV * K, scale=0.5)}
    if s["gate"] == "safe":
        options.update(safe_gate=True, lower_bound=-5.0)
    if s["initial_state"]:
        shared["initial_state"] = randn(N, HV, V, K, scale=0.1) if s["v_first"] else randn(N, HV, K, V, scale=0.1)
    options.update(output_final_state=s["final_state"], state_v_first=s["v_first"])
    cu = None
    if s["lengths"]:
        cu = torch.tensor([0, *torch.tensor(s["lengths"]).cumsum(0).tolist()], dtype=torch.int64)
    upstream = {"do": randn(B, T, HV, V), "dfinal": randn(N, HV, K, V) if not s["v_first"] else randn(N, HV, V, K)}
    return {"tensors": tensors, "shared": shared, "options": options, "cu_seqlens": cu, "upstream": upstream}


def loss_of(
    o: torch.Tensor, final: torch.Tensor | None, upstream: dict[str, torch.Tensor], with_final: bool
) -> torch.Tensor:
    loss = (o.float() * upstream["do"]).sum()
    if final is not None and with_final:
        loss = loss + (final * upstream["dfinal"]).sum()
    return loss


def single_process(s: dict[str, Any]) -> dict[str, torch.Tensor]:
    """The reference: the same batch in one call, with the same backward."""
    batch = global_batch(s)
    leaves = {n: t.clone().requires_grad_(s["training"]) for n, t in {**batch["tensors"], **batch["shared"]}.items()}
    extra = {} if batch["cu_seqlens"] is None else {"cu_seqlens": batch["cu_seqlens"]}
    o, final = kda.chunk_kda(**leaves, **batch["options"], **extra, backend=s["backend"])
    result = {"o": o.detach()}
    if final is not None:
        result["final_state"] = final.detach()
    if s["training"]:
        loss_of(o, final, batch["upstream"], True).backward()
        result.update({f"d{n}": t.grad for n, t in leaves.items()})
    return result


def run_rank(rank: int, world: int, init_file: str, s: dict[str, Any], out_dir: str) -> None:
    dist.init_process_group(
        "gloo",
        init_method=f"file://{init_file}",
        rank=rank,
        world_size=world,
        timeout=datetime.timedelta(seconds=s.get("timeout_s", 60)),
    )
    try:
        torch.set_num_threads(1)
        if s.get("raise_on_rank") == rank:
            raise RuntimeError(f"rank {rank} fails before its call, as a scenario of the test")
        batch = global_batch(s)
        ctx = build_cp_context(None, batch["cu_seqlens"], total_tokens=s["T"], splits=s.get("splits"), mode=s["mode"])
        lo, hi = ctx.offsets[rank], ctx.offsets[rank + 1]
        mine = {n: t[:, lo:hi].clone().requires_grad_(s["training"]) for n, t in batch["tensors"].items()}
        shared = {n: t.clone().requires_grad_(s["training"]) for n, t in batch["shared"].items()}
        o, final = kda.chunk_kda(**mine, **shared, **batch["options"], cp_context=ctx, backend=s["backend"])
        result: dict[str, Any] = {"o": o.detach(), "final_state": None if final is None else final.detach()}
        if s["training"]:
            upstream = {"do": batch["upstream"]["do"][:, lo:hi], "dfinal": batch["upstream"]["dfinal"]}
            loss_of(o, final, upstream, rank == 0).backward()
            result.update({f"d{n}": t.grad for n, t in {**mine, **shared}.items()})
        torch.save(result, os.path.join(out_dir, f"rank{rank}.pt"))
    finally:
        dist.destroy_process_group()


__all__ = ["GRADS", "SHARED", "F", "run_rank", "single_process"]
