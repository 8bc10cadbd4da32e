"""The collectives context parallelism uses, each an autograd function (torch.distributed only: NCCL on
GPUs, gloo on CPUs; no transport of kda's own).

- `all_gather`: every rank's tensor (same shape), stacked ``[world, ...]``. Backward: each rank's gradient
  of the stack is summed over ranks and every rank keeps its own slot (a reduce-scatter, done as an
  all-reduce of the whole stack where the backend has no reduce-scatter: gloo).
- `all_gather_start` / `all_gather_wait`: the same, split so that work can run while the exchange is in
  flight (the gathered buffer must not be read before `all_gather_wait`).
- `all_reduce_sum`: the sum over ranks. Backward: the sum over ranks of the gradients.
- `all_to_all`: rank ``r`` sends ``chunks[r']`` to rank ``r'`` and receives one tensor from every rank.
  Backward: the same exchange, reversed.
- `join`: returns its first argument and makes the others part of its graph, with zero gradients: every
  rank's backward then reaches every collective, in the same order on every rank, even where the rank's
  own result does not depend on one (rank 0 chains no earlier rank's state); a collective some ranks enter
  and others skip would hang.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist


def _reduce_scatter_supported(group: Any) -> bool:
    return dist.get_backend(group) != "gloo"


class _AllGather(torch.autograd.Function):
    @staticmethod
    def forward(ctx, tensor: torch.Tensor, group: Any) -> torch.Tensor:
        ctx.group = group
        world = dist.get_world_size(group)
        parts = [torch.empty_like(tensor) for _ in range(world)]
        dist.all_gather(parts, tensor.contiguous(), group=group)
        return torch.stack(parts)

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        group = ctx.group
        rank = dist.get_rank(group)
        grad = grad.contiguous()
        if _reduce_scatter_supported(group):
            mine = torch.empty_like(grad[0])
            dist.reduce_scatter_tensor(mine, grad, group=group)  # the stack [world, ...] is a valid input
            return mine, None
        dist.all_reduce(grad, group=group)
        return grad[rank].clone(), None


class Pending:
    """An all-gather in flight: its handle, waited on by `all_gather_wait`."""

    work: Any = None


class _AllGatherStart(torch.autograd.Function):
    @staticmethod
    def forward(ctx, tensor: torch.Tensor, group: Any, pending: Pending) -> torch.Tensor:
        ctx.group = group
        world = dist.get_world_size(group)
        out = tensor.new_empty(world, *tensor.shape)
        pending.work = dist.all_gather(list(out.unbind(0)), tensor.contiguous(), group=group, async_op=True)
        return out

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> tuple[torch.Tensor, None, None]:
        mine, _ = _AllGather.backward(ctx, grad)
        return mine, None, None


class _AllGatherWait(torch.autograd.Function):
    @staticmethod
    def forward(ctx, out: torch.Tensor, pending: Pending) -> torch.Tensor:
        pending.work.wait()
        pending.work = None  # a finished handle holds its buffers and the group's worker: let them go now
        return out.view_as(out)

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        return grad, None


class _AllReduceSum(torch.autograd.Function):
    @staticmethod
    def forward(ctx, tensor: torch.Tensor, group: Any) -> torch.Tensor:
        ctx.group = group
        total = tensor.contiguous().clone()
        dist.all_reduce(total, group=group)
        return total

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        total = grad.contiguous().clone()
        dist.all_reduce(total, group=ctx.group)
        return total, None


def _exchange(received: list[torch.Tensor], sent: list[torch.Tensor], group: Any) -> None:
    """``sent[r]`` to rank r, ``received[r]`` from rank r. One all-to-all where every rank's tensors have one
    shape (gloo takes no other); else point-to-point sends and receives, batched (uneven splits)."""
    if len({t.shape for t in sent} | {t.shape for t in received}) == 1:
        dist.all_to_all(received, sent, group=group)
        return
    rank = dist.get_rank(group)
    ops = []
    for r in range(dist.get_world_size(group)):
        peer = dist.get_global_rank(group, r) if group is not None else r
        if r == rank:
            received[r].copy_(sent[r])
            continue
        if sent[r].numel():
            ops.append(dist.P2POp(dist.isend, sent[r], peer, group))
        if received[r].numel():
            ops.append(dist.P2POp(dist.irecv, received[r], peer, group))
    if ops:
        for work in dist.batch_isend_irecv(ops):
            work.wait()


class _AllToAll(torch.autograd.Function):
    @staticmethod
    def forward(ctx, group: Any, out_shapes: list[torch.Size], *chunks: torch.Tensor) -> tuple[torch.Tensor, ...]:
        ctx.group = group
        ctx.in_shapes = [c.shape for c in chunks]
        received = [chunks[0].new_empty(shape) for shape in out_shapes]
        _exchange(received, [c.contiguous() for c in chunks], group)
        return tuple(received)

    @staticmethod
    def backward(ctx, *grads: torch.Tensor) -> tuple[Any, ...]:
        back = [g.new_empty(shape) for g, shape in zip(grads, ctx.in_shapes)]
        _exchange(back, [g.contiguous() for g in grads], ctx.group)
        return (None, None, *back)


class _Join(torch.autograd.Function):
    @staticmethod
    def forward(ctx, result: torch.Tensor, *others: torch.Tensor) -> torch.Tensor:
        ctx.shapes = [(o.shape, o.dtype, o.device) for o in others]
        return result.view_as(result)

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> tuple[torch.Tensor, ...]:
        zeros = tuple(torch.zeros(shape, dtype=dtype, device=device) for shape, dtype, device in ctx.shapes)
        return (grad, *zeros)


def all_gather(tensor: torch.Tensor, group: Any) -> torch.Tensor:
    return _AllGather.apply(tensor, group)


def all_gather_start(tensor: torch.Tensor, group: Any) -> tuple[torch.Tensor, Pending]:
    pending = Pending()
    return _AllGatherStart.apply(tensor, group, pending), pending


def all_gather_wait(out: torch.Tensor, pending: Pending) -> torch.Tensor:
    return _AllGatherWait.apply(out, pending)


def all_reduce_sum(tensor: torch.Tensor, group: Any) -> torch.Tensor:
    return _AllReduceSum.apply(tensor, group)


def all_to_all(chunks: list[torch.Tensor], out_shapes: list[torch.Size], group: Any) -> list[torch.Tensor]:
    """`chunks[r]` goes to rank r; returns what each rank sent here (shapes `out_shapes`, in rank order)."""
    return list(_AllToAll.apply(group, out_shapes, *chunks))


def join(result: torch.Tensor, *others: torch.Tensor) -> torch.Tensor:
    differentiable = [o for o in others if o.requires_grad]
    if not differentiable or not torch.is_grad_enabled():
        return result
    return _Join.apply(result, *differentiable)
