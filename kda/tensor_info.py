"""What the contract knows of a tensor (shape, dtype name, device), and the `cu_seqlens` rule.

Shared by the contracts of both ops (`kda.spec` for `chunk_kda`, `kda.recurrent` for the decode op): a
spec holds these descriptions, never tensors, so that it is small, immutable and hashable.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

import torch
from pydantic import BaseModel, ConfigDict

FLOAT_DTYPES = ("bfloat16", "float16", "float32")
INDEX_DTYPES = ("int32", "int64")


class TensorInfo(BaseModel):
    """What the contract needs to know of one tensor: shape, dtype name and device."""

    model_config = ConfigDict(frozen=True)

    shape: tuple[int, ...]
    dtype: str
    device: str

    @classmethod
    def of(cls, tensor: torch.Tensor) -> TensorInfo:
        return cls(shape=tuple(tensor.shape), dtype=str(tensor.dtype).removeprefix("torch."), device=str(tensor.device))


def fmt_shape(shape: Sequence[int | str]) -> str:
    return "[" + ", ".join(str(s) for s in shape) + "]"


def cu_seqlens_violation(values: Sequence[int], total_tokens: int) -> str | None:
    """The broken `cu_seqlens` rule for these host values, or None when they are well formed.

    `cu_seqlens` marks sequence boundaries in the flattened time axis: it starts at 0, never
    decreases, and ends at T. Backends that copy `cu_seqlens` to the host anyway call this too, so
    that a device-resident `cu_seqlens` (which the spec cannot read without a sync) is still checked.
    """
    if len(values) < 2:
        return f"must hold N+1 >= 2 boundaries; got {list(values)}"
    if values[0] != 0:
        return f"must start at 0; got {values[0]}"
    for i in range(1, len(values)):
        if values[i] < values[i - 1]:
            return f"must be non-decreasing; got {values[i - 1]} then {values[i]} at position {i}"
    if values[-1] != total_tokens:
        return f"must end at T = {total_tokens}; got {values[-1]}"
    return None


class CallShapes:
    """The sizes of a KDA call (either op), read from its q, v and cu_seqlens descriptions: mixed into
    both ops' specs. q is ``[B, T, H, K]``, v ``[B, T, HV, V]``, cu_seqlens ``[N+1]`` or None."""

    if TYPE_CHECKING:
        q: TensorInfo
        v: TensorInfo
        cu_seqlens: TensorInfo | None
        model_fields: dict[str, Any]

    def _routing_parts(self, host_values: tuple[str, ...]) -> list[Any]:
        """The spec's fields as plain values (tensors as shape, dtype, device), less `host_values`: the
        values read on the host, which vary call to call but change no backend's answer."""
        parts: list[Any] = []
        for name in type(self).model_fields:
            if name in host_values:
                continue
            value = getattr(self, name)
            parts.append((value.shape, value.dtype, value.device) if isinstance(value, TensorInfo) else value)
        return parts

    @property
    def B(self) -> int:
        return self.q.shape[0]

    @property
    def T(self) -> int:
        return self.q.shape[1]

    @property
    def H(self) -> int:
        return self.q.shape[2]

    @property
    def K(self) -> int:
        return self.q.shape[3]

    @property
    def HV(self) -> int:
        return self.v.shape[2]

    @property
    def V(self) -> int:
        return self.v.shape[3]

    @property
    def num_seqs(self) -> int:
        """N: the number of sequences (B, or len(cu_seqlens) - 1 for variable length)."""
        return self.cu_seqlens.shape[0] - 1 if self.cu_seqlens is not None else self.B

    @property
    def is_varlen(self) -> bool:
        return self.cu_seqlens is not None

    @property
    def is_gva(self) -> bool:
        return self.HV > self.H
