"""Host-side chunk bookkeeping: which tokens each chunk covers, for dense and variable-length batches.

Every kernel works on the flattened token axis (``B*T`` tokens for a dense batch, ``T`` for varlen). A
sequence ``n`` spans tokens ``[bounds[n], bounds[n+1])``; its chunks start every ``C`` tokens from
``bounds[n]`` and the last one may be partial. Chunks never straddle two sequences. Shared by the backends
whose kernels walk chunks (triton, helion, tilelang), with the outputs' delivery and the gradients'
assembly; plain torch, no kernel code.
"""

from __future__ import annotations

import functools
import itertools
from dataclasses import dataclass

import torch

from kda.backends.base import KDAGradients, KDAInputs, KDAOutputs
from kda.errors import KDAInputError
from kda.spec import KDASpec, cu_seqlens_violation


@dataclass(frozen=True)
class ChunkLayout:
    bounds: torch.Tensor  # [N+1] int32: sequence boundaries on the token axis
    chunk_starts: torch.Tensor  # [NT] int32: first token of each chunk
    chunk_seq_ends: torch.Tensor  # [NT] int32: end (exclusive) of the chunk's sequence
    chunk_offsets: torch.Tensor  # [N] int32: index of each sequence's first chunk
    chunk_bounds: torch.Tensor  # [N+1] int32: sequence n owns chunks [chunk_bounds[n], chunk_bounds[n+1])
    num_seqs: int
    num_chunks: int


def chunk_layout(bounds: tuple[int, ...], chunk_size: int, device: torch.device) -> ChunkLayout:
    return _layout(tuple(int(b) for b in bounds), chunk_size, str(device))


@functools.lru_cache(maxsize=256)
def _layout(bounds: tuple[int, ...], chunk_size: int, device: str) -> ChunkLayout:
    starts: list[int] = []
    seq_ends: list[int] = []
    offsets: list[int] = []
    for bos, eos in itertools.pairwise(bounds):
        offsets.append(len(starts))
        for start in range(bos, eos, chunk_size):
            starts.append(start)
            seq_ends.append(eos)

    def as_tensor(values: list[int] | tuple[int, ...]) -> torch.Tensor:
        return torch.tensor(values if values else [0], dtype=torch.int32, device=device)

    return ChunkLayout(
        as_tensor(bounds),
        as_tensor(starts),
        as_tensor(seq_ends),
        as_tensor(offsets),
        as_tensor([*offsets, len(starts)]),
        len(bounds) - 1,
        len(starts),
    )


def sequence_bounds(inputs: KDAInputs, spec: KDASpec) -> tuple[int, ...]:
    """The sequences' token boundaries: ``b * T`` for a dense batch, cu_seqlens' values with varlen."""
    if not spec.is_varlen:
        return tuple(b * spec.T for b in range(spec.B + 1))
    bounds = inputs.host_cu_seqlens()  # a device sync when the caller gave no host copy
    assert bounds is not None
    broken = cu_seqlens_violation(bounds, spec.T)
    if broken is not None:  # the spec could not read a device-resident cu_seqlens without a sync
        raise KDAInputError("cu_seqlens", broken)
    return tuple(bounds)


def output_buffers(spec: KDASpec, out: KDAOutputs | None) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Where the kernels write ``o [B, T, HV, V]`` (the call's dtype) and the final state (fp32, None when
    not asked for): the caller's ``out`` buffers when contiguous, new tensors otherwise (`deliver` then
    copies into the caller's)."""
    return output_buffer(spec, out), final_state_buffer(spec, out)


def output_buffer(spec: KDASpec, out: KDAOutputs | None) -> torch.Tensor:
    """`output_buffers`' ``o`` alone (a backend that allocates it later than the final state)."""
    if out is not None and out.o.is_contiguous():
        return out.o
    return torch.empty(spec.B, spec.T, spec.HV, spec.V, dtype=spec.dtype, device=spec.device)


def final_state_buffer(spec: KDASpec, out: KDAOutputs | None) -> torch.Tensor | None:
    """`output_buffers`' final state alone."""
    if not spec.output_final_state:
        return None
    given = None if out is None else out.final_state
    reuse = given is not None and given.is_contiguous()
    return given if reuse else torch.empty(spec.state_shape, dtype=torch.float32, device=spec.device)


def deliver(
    o: torch.Tensor, final_state: torch.Tensor | None, out: KDAOutputs | None
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """``o`` and the final state where the caller asked for them: copied into ``out``'s buffers when the
    kernels could not write there directly (a buffer that is not contiguous), returned as given otherwise."""
    if out is not None and o is not out.o:
        out.o.copy_(o)
        o = out.o
    given = None if out is None else out.final_state
    if final_state is not None and given is not None and final_state is not given:
        given.copy_(final_state)
        final_state = given
    return o, final_state


def per_chunk_states(h: torch.Tensor, num_chunks: int, B: int, spec: KDASpec) -> torch.Tensor:
    """``return_intermediate_states``' tensor from the state pass's ``h [NT, HV, K, V]`` (each sequence's
    chunks in turn): ``[B, NT / B, HV, K, V]``, or ``[..., V, K]`` in the ``state_v_first`` layout, in the
    call's dtype."""
    per_chunk = h[:num_chunks].reshape(B, num_chunks // B, *h.shape[1:])
    if spec.state_v_first:
        per_chunk = per_chunk.transpose(-1, -2)
    return per_chunk.to(spec.dtype).contiguous()


def gradients(
    inputs: KDAInputs,
    dq: torch.Tensor,
    dk: torch.Tensor,
    dv: torch.Tensor,
    dg: torch.Tensor,
    dbeta: torch.Tensor,
    dA_rows: torch.Tensor,
    dh0: torch.Tensor | None,
    ddt_bias: torch.Tensor | None = None,
) -> KDAGradients:
    """The gradients in the shapes and dtypes of the inputs as passed, from a backward's token-major parts
    (``dq``, ``dk``, ``dv``, ``dbeta``; ``dg [tokens, HV, K]``, fp32 or already in g's dtype) and its per-row
    parts of ``dA_log`` (``dA_rows [NT, HV, C]`` fp32). ``ddt_bias`` (``[HV, K]`` fp32), where the backward
    summed it itself; else it is the sum of an fp32 ``dg`` over tokens. The sums over tokens are torch sums:
    a fixed order, no atomics."""
    dA_log = dinitial_state = None
    if inputs.A_log is not None:
        dA_log = dA_rows.sum(dim=(0, 2)).to(inputs.A_log.dtype)
    if inputs.dt_bias is not None:
        if ddt_bias is None:
            assert dg.dtype == torch.float32, "ddt_bias is summed from an fp32 dg"
            ddt_bias = dg.sum(dim=0)
        ddt_bias = ddt_bias.reshape(inputs.dt_bias.shape).to(inputs.dt_bias.dtype)
    if inputs.initial_state is not None:
        assert dh0 is not None
        dinitial_state = dh0.to(inputs.initial_state.dtype)
    return KDAGradients(
        dq=dq.view_as(inputs.q),
        dk=dk.view_as(inputs.k),
        dv=dv.view_as(inputs.v),
        dg=dg.to(inputs.g.dtype).view_as(inputs.g),
        dbeta=dbeta.view_as(inputs.beta),
        dA_log=dA_log,
        ddt_bias=ddt_bias,
        dinitial_state=dinitial_state,
    )
