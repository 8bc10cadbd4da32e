"""`CPContext`: how one long sequence batch is split over the ranks of a process group, and
`build_cp_context`, which makes it (the counterpart of FLA's ``build_cp_context``).

The global token axis (``T`` tokens: the ``cu_seqlens`` batch, or each row of a dense ``[B, T]`` batch) is
cut into one contiguous slice per rank, ``splits[r]`` tokens for rank ``r`` (equal by default, the
remainder to the first ranks; any split, empty slices included). Rank ``r`` passes its slice of q, k, v, g
and beta to `kda.chunk_kda(..., cp_context=ctx)` and gets its slice of ``o``.

Sequences may cross rank boundaries: a rank may hold the end of one sequence, several whole ones and the
start of another, or a middle part of one. A *piece* is a sequence's part on one rank; pieces are what each
rank computes on. Everything here is derived from ``cu_seqlens`` and ``splits`` alone, identically on every
rank, so no rank needs to ask another where anything is.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass, field
from typing import Any

import torch

from kda.errors import KDAInputError

MODES = ("sequence", "head")


@dataclass(frozen=True)
class Piece:
    """One sequence's tokens on one rank: ``[start, end)`` in that rank's local token axis."""

    seq: int  # the global sequence (a ``cu_seqlens`` index, or the batch row when dense)
    row: int  # the batch row it is in locally (0 with ``cu_seqlens``)
    start: int
    end: int
    begins: bool  # the sequence starts in this piece (no earlier rank holds any of it)
    ends: bool  # the sequence ends in this piece


@dataclass(frozen=True)
class CPContext:
    """The split of a batch over a process group (see the module docstring). Build it with
    `build_cp_context`; hand it to `kda.chunk_kda` as ``cp_context``."""

    group: Any  # a torch.distributed ProcessGroup (None: the default group)
    rank: int
    world: int
    mode: str  # "sequence" (chunkwise: each rank a slice of the tokens) or "head" (each rank a slice of heads)
    bounds: tuple[int, ...] | None  # the global cu_seqlens; None for a dense batch
    splits: tuple[int, ...]  # tokens per rank along the global token axis
    cu_seqlens: torch.Tensor | None = field(default=None, compare=False)  # this rank's local boundaries (FLA's)
    cu_seqlens_cpu: torch.Tensor | None = field(default=None, compare=False)

    @property
    def offsets(self) -> tuple[int, ...]:
        return tuple(itertools.accumulate(self.splits, initial=0))

    @property
    def total_tokens(self) -> int:
        return self.offsets[-1]

    @property
    def local_tokens(self) -> int:
        return self.splits[self.rank]

    @property
    def num_seqs(self) -> int | None:
        return None if self.bounds is None else len(self.bounds) - 1

    def pieces(self, rank: int, batch: int = 1) -> list[Piece]:
        """Rank `rank`'s pieces, in local order (`batch`: the dense batch size; 1 with ``cu_seqlens``)."""
        a, b = self.offsets[rank], self.offsets[rank + 1]
        if a == b:
            return []
        if self.bounds is None:
            return [Piece(row, row, 0, b - a, a == 0, b == self.total_tokens) for row in range(batch)]
        found = []
        for seq, (s, e) in enumerate(itertools.pairwise(self.bounds)):
            lo, hi = max(s, a), min(e, b)
            if lo < hi:
                found.append(Piece(seq, 0, lo - a, hi - a, s >= a, e <= b))
        return found

    def open_pieces(self, rank: int, batch: int = 1) -> list[Piece]:
        """Rank `rank`'s pieces whose sequence goes on past its slice: their transitions are exchanged."""
        return [p for p in self.pieces(rank, batch) if not p.ends]


def _local_cu_seqlens(ctx: CPContext, device: torch.device) -> tuple[torch.Tensor | None, torch.Tensor | None]:
    if ctx.bounds is None:
        return None, None
    pieces = ctx.pieces(ctx.rank)
    local = [0] + [p.end for p in pieces]
    host = torch.tensor(local, dtype=torch.int64)
    return host.to(device), host


def build_cp_context(
    group: Any = None,
    cu_seqlens: torch.Tensor | None = None,
    *,
    cu_seqlens_cpu: torch.Tensor | None = None,
    total_tokens: int | None = None,
    splits: list[int] | tuple[int, ...] | None = None,
    mode: str = "sequence",
    device: torch.device | str | None = None,
) -> CPContext:
    """The context of `group` (a torch.distributed ProcessGroup, None for the default one) for a batch.

    Args:
        group: the ranks that share the batch. FLA's order, ``build_cp_context(cu_seqlens, group)``, works too.
        cu_seqlens: the global sequence boundaries ``[N+1]`` (variable length, ``B == 1``); None for a dense
            batch, whose rows are all split the same way along T (then give `total_tokens` or `splits`).
        cu_seqlens_cpu: a host copy of `cu_seqlens` (the boundaries are read once, here).
        total_tokens: the global T of a dense batch.
        splits: tokens per rank, in rank order (default: equal, the remainder to the first ranks).
        mode: ``"sequence"`` (chunkwise: each rank computes its slice of tokens, states chained across ranks)
            or ``"head"`` (all-to-all: each rank computes whole sequences for ``HV / world`` heads).
        device: where the local ``cu_seqlens`` lives (default: `cu_seqlens`' device, else the CPU).

    Raises:
        KDAInputError: an argument breaks a rule (named, with the rule and the value).
    """
    import torch.distributed as dist

    if isinstance(group, torch.Tensor) and (cu_seqlens is None or not isinstance(cu_seqlens, torch.Tensor)):
        group, cu_seqlens = cu_seqlens, group  # FLA's argument order
    if mode not in MODES:
        raise KDAInputError("mode", f"is one of {', '.join(MODES)}", repr(mode))
    if not dist.is_available() or not dist.is_initialized():
        raise KDAInputError("group", "needs torch.distributed initialized (init_process_group)", "not initialized")
    rank, world = dist.get_rank(group), dist.get_world_size(group)
    bounds: tuple[int, ...] | None = None
    if cu_seqlens is not None or cu_seqlens_cpu is not None:
        source = cu_seqlens_cpu if cu_seqlens_cpu is not None else cu_seqlens
        assert source is not None
        values = [int(x) for x in source.tolist()]
        if not values or values[0] != 0 or any(b < a for a, b in itertools.pairwise(values)):
            raise KDAInputError("cu_seqlens", "starts at 0 and never decreases", str(values[:8]))
        bounds = tuple(values)
        if total_tokens is not None and total_tokens != bounds[-1]:
            raise KDAInputError("total_tokens", f"equals cu_seqlens[-1] ({bounds[-1]})", str(total_tokens))
        total_tokens = bounds[-1]
    if splits is None:
        if total_tokens is None:
            raise KDAInputError("total_tokens", "is required for a dense batch without splits", "None")
        base, extra = divmod(total_tokens, world)
        splits = [base + (1 if r < extra else 0) for r in range(world)]
    splits = tuple(int(s) for s in splits)
    if len(splits) != world or any(s < 0 for s in splits):
        raise KDAInputError("splits", f"has one count >= 0 per rank ({world} ranks)", str(list(splits)))
    if total_tokens is not None and sum(splits) != total_tokens:
        raise KDAInputError("splits", f"sums to the tokens of the batch ({total_tokens})", str(list(splits)))
    ctx = CPContext(group, rank, world, mode, bounds, splits)
    where = torch.device(device) if device is not None else (cu_seqlens.device if cu_seqlens is not None else None)
    local, local_cpu = _local_cu_seqlens(ctx, where or torch.device("cpu"))
    return CPContext(group, rank, world, mode, bounds, splits, local, local_cpu)
