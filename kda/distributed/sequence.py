"""Sequence (chunkwise) context parallelism: each rank computes its slice of the tokens.

Over one piece of a sequence the recurrence is affine in the state it starts from, per value head::

    S_end = M S_start + S_ext,      M = A_T ... A_1,   A_t = (I - beta_t k_t k_t^T) Diag(exp(g_t))   [K, K]

with ``S_ext`` the piece's end state from a zero start. Each rank:

1. computes ``(S_ext, M)`` for its *open* pieces (those whose sequence goes on past its slice) with the
   backend itself, in one call: the values widened to ``[v | 0]`` and the start state ``[0 | I]``, so the
   final state is ``[S_ext | M]`` (``[K, V + K]``; two calls when ``V + K > 256``). No kernel of its own: any
   verified backend computes the transition, verified as it is;
2. all-gathers them (``[world, P, HV, K, V + K]`` fp32, ``P`` the most open pieces any rank has);
3. while the exchange is in flight, runs its pieces that begin on this rank (they need no other rank);
4. chains, in fp32, the earlier ranks' pairs of the sequence each of its *continuing* pieces belongs to,
   from the sequence's initial state: ``S = M_r S + S_ext_r`` in rank order, the true start state, and
   runs those pieces from it (with ``B = 1`` only the first piece of a slice continues);
5. with ``output_final_state``, sums the final states of the sequences ending on each rank over the group.

The backward is autograd through these steps: the gradient of a piece's start state flows to the earlier
ranks' ``S_ext`` and ``M`` (through ``M^T``) and from them into their own backend calls. `comm.join` keeps
every rank's backward entering every collective.
"""

from __future__ import annotations

import torch

from kda.distributed import comm
from kda.distributed.context import CPContext, Piece

HEAD_DIM_LIMIT = 256  # the widest value dim the backends take, for the widened call of step 1


def _rows(x: torch.Tensor, pieces: list[Piece]) -> torch.Tensor:
    """The pieces' tokens of `x` ``[B, T_local, ...]`` as one varlen row ``[1, sum, ...]``."""
    return torch.cat([x[p.row : p.row + 1, p.start : p.end] for p in pieces], dim=1)


def _bounds(pieces: list[Piece], device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    lengths = [p.end - p.start for p in pieces]
    host = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int64)
    return host.to(device), host


def _transitions(call, tensors: dict[str, torch.Tensor], pieces: list[Piece]) -> torch.Tensor:
    """``[P, HV, K, V + K]`` fp32: each open piece's ``[S_ext | M]`` (step 1)."""
    q, v = tensors["q"], tensors["v"]
    HV, V, K = v.shape[2], v.shape[3], q.shape[3]
    device = q.device
    P = len(pieces)
    inputs = {name: _rows(t, pieces) for name, t in tensors.items()}
    cu, cu_cpu = _bounds(pieces, device)
    eye = torch.eye(K, dtype=torch.float32, device=device).expand(P, HV, K, K)
    zero_state = torch.zeros(P, HV, K, V, dtype=torch.float32, device=device)
    if V + K <= HEAD_DIM_LIMIT:
        wide = dict(inputs, v=torch.cat([inputs["v"], inputs["v"].new_zeros(*inputs["v"].shape[:3], K)], dim=-1))
        _, final = call(wide, torch.cat([zero_state, eye], dim=-1), cu, cu_cpu)
        return final
    _, s_ext = call(inputs, zero_state, cu, cu_cpu)
    _, m = call(dict(inputs, v=inputs["v"].new_zeros(*inputs["v"].shape[:3], K)), eye.contiguous(), cu, cu_cpu)
    return torch.cat([s_ext, m], dim=-1)


def sequence_parallel(
    call, tensors: dict[str, torch.Tensor], initial_state: torch.Tensor | None, want_final: bool, ctx: CPContext
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """This rank's ``o`` and (with `want_final`) every sequence's final state ``[N, HV, K, V]`` fp32.

    `call(inputs, initial_state, cu_seqlens, cu_seqlens_cpu)` runs the backend on a varlen batch and returns
    ``(o, final_state)``; `tensors` holds this rank's q, k, v, g, beta ``[B, T_local, ...]``; `initial_state`
    is every sequence's (``[N, HV, K, V]``, the layout already ``[K, V]``), the same on every rank."""
    q, v = tensors["q"], tensors["v"]
    B, T_local, HV, V = v.shape
    K = q.shape[3]
    device = q.device
    N = ctx.num_seqs if ctx.num_seqs is not None else B
    mine = ctx.pieces(ctx.rank, B)
    open_by_rank = [ctx.open_pieces(r, B) for r in range(ctx.world)]
    widest = max(len(p) for p in open_by_rank)

    def start_of(seq: int) -> torch.Tensor:
        if initial_state is not None:
            return initial_state[seq].to(torch.float32)
        return torch.zeros(HV, K, V, dtype=torch.float32, device=device)

    # Every rank's collectives must have a backward, also where its own share does not depend on any input
    # (a rank with no open piece sends zeros): else that rank would skip a collective the others enter.
    grads = torch.is_grad_enabled() and any(t.requires_grad for t in tensors.values())
    collectives: list[torch.Tensor] = []
    pending = None
    if widest > 0:
        pairs = torch.zeros(widest, HV, K, V + K, dtype=torch.float32, device=device, requires_grad=grads)
        if open_by_rank[ctx.rank]:
            found = _transitions(call, tensors, open_by_rank[ctx.rank])
            pairs = torch.cat([found, pairs[len(found) :]]) if len(found) < widest else found
        in_flight, pending = comm.all_gather_start(pairs, ctx.group)  # [world, widest, HV, K, V + K]

    outputs: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}  # piece index -> (o rows, final state)

    def run(indices: list[int], starts: list[torch.Tensor]) -> None:
        if not indices:
            return
        chosen = [mine[i] for i in indices]
        h0 = torch.stack(starts)
        if ctx.bounds is None:  # dense: each piece is a whole row, and the call stays dense
            rows = [p.row for p in chosen]
            o_part, final_part = call({n: t[rows] for n, t in tensors.items()}, h0, None, None)
            pieces_o = list(o_part.unbind(0))
        else:
            cu, cu_cpu = _bounds(chosen, device)
            o_part, final_part = call({n: _rows(t, chosen) for n, t in tensors.items()}, h0, cu, cu_cpu)
            pieces_o = list(o_part[0].split([p.end - p.start for p in chosen]))
        for slot, i in enumerate(indices):
            outputs[i] = (pieces_o[slot], final_part[slot])

    begin_here = [i for i, p in enumerate(mine) if p.begins]
    run(begin_here, [start_of(mine[i].seq) for i in begin_here])  # overlaps the exchange
    if pending is not None:
        gathered = comm.all_gather_wait(in_flight, pending)
        collectives.append(gathered)
        continuing = [i for i, p in enumerate(mine) if not p.begins]
        starts = []
        for i in continuing:
            S = start_of(mine[i].seq)
            for r in range(ctx.rank):
                for slot, other in enumerate(open_by_rank[r]):
                    if other.seq == mine[i].seq:
                        S_ext, M = gathered[r, slot, ..., :V], gathered[r, slot, ..., V:]
                        S = torch.einsum("hij,hjv->hiv", M, S) + S_ext
            starts.append(S)
        run(continuing, starts)

    if mine:
        ordered = [outputs[i][0] for i in range(len(mine))]
        o = torch.stack(ordered) if ctx.bounds is None else torch.cat(ordered).unsqueeze(0)
    else:
        o = v.new_zeros(B, T_local, HV, V)

    final = None
    if want_final:
        ends = torch.zeros(N, HV, K, V, dtype=torch.float32, device=device, requires_grad=grads)
        contributions = [(p.seq, outputs[i][1]) for i, p in enumerate(mine) if p.ends]
        if contributions:
            index = torch.tensor([seq for seq, _ in contributions], device=device)
            ends = ends.index_put((index,), torch.stack([s for _, s in contributions]))
        # The all-reduce's backward must come before the all-gather's on every rank (the order of two
        # collectives may not differ between ranks): making the sum depend on the gathered pairs does that.
        final = comm.all_reduce_sum(comm.join(ends, *collectives), ctx.group)
        collectives.append(final)
        if ctx.bounds is not None:  # an empty sequence's final state is its initial state, on every rank
            empty = [n for n in range(N) if ctx.bounds[n] == ctx.bounds[n + 1]]
            if empty:
                index = torch.tensor(empty, device=device)
                final = final.index_put((index,), torch.stack([start_of(n) for n in empty]))
    return comm.join(o, *collectives), final
