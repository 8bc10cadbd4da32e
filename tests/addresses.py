"""An address check for Triton kernels run by Triton's CPU interpreter (``TRITON_INTERPRET=1``).

On a GPU an unmasked load or store past a tensor's end reads or writes a neighbour's memory in silence,
or, far enough out, faults the whole context ("illegal memory access") with no kernel named. Under the
interpreter every load and store is a numpy array of addresses and a mask, so each active address can be
checked against the memory the launch was given: the storages of its tensor arguments. `checked_addresses`
installs that check; an access outside every argument's storage raises `AddressFault`, naming the kernel,
the operation, how many lanes strayed, and the nearest argument and how far past it the first one fell.

The check is at storage granularity (a view's neighbour inside its own storage is not caught), which is
what the GPU's fault sees, and stricter: the GPU's caching allocator hides small overruns.
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Iterator
from dataclasses import dataclass, field

import numpy as np
import torch


class AddressFault(AssertionError):
    """A kernel touched memory outside every tensor it was given."""


@dataclass
class _Launch:
    kernel: str
    starts: np.ndarray  # [n] uint64, sorted
    ends: np.ndarray  # [n] uint64, exclusive
    names: list[str] = field(default_factory=list)


@dataclass
class AddressLog:
    """What the check saw: launches per kernel name, and elements checked."""

    launches: dict[str, int] = field(default_factory=dict)
    checked: int = 0


def _storages(args: list, names: list[str]) -> tuple[np.ndarray, np.ndarray, list[str]]:
    spans: dict[int, tuple[int, str]] = {}
    for name, arg in zip(names, args, strict=False):
        if isinstance(arg, torch.Tensor):
            storage = arg.untyped_storage()
            spans.setdefault(storage.data_ptr(), (storage.nbytes(), name))
    order = sorted(spans)
    starts = np.array(order, dtype=np.uint64)
    ends = np.array([start + spans[start][0] for start in order], dtype=np.uint64)
    return starts, ends, [spans[start][1] for start in order]


def _stray(launch: _Launch, addresses: np.ndarray, itemsize: int) -> np.ndarray:
    """The addresses whose element does not lie whole inside one argument's storage."""
    at = np.searchsorted(launch.starts, addresses, side="right").astype(np.int64) - 1
    inside = at >= 0
    slot = np.clip(at, 0, None)
    inside &= addresses + np.uint64(itemsize) <= launch.ends[slot]
    return addresses[~inside]


def _describe(launch: _Launch, op: str, stray: np.ndarray, total: int) -> str:
    first = int(stray.min())
    gaps = []
    for start, end, name in zip(launch.starts.tolist(), launch.ends.tolist(), launch.names, strict=True):
        if first >= end:
            gaps.append((first - end, f"{first - end} bytes past the end of `{name}`"))
        elif first < start:
            gaps.append((start - first, f"{start - first} bytes before `{name}`"))
    where = min(gaps)[1] if gaps else "no tensor argument at all"
    return f"{launch.kernel}: {op} of {stray.size} of {total} active lanes outside every argument; lowest: {where}"


@contextlib.contextmanager
def checked_addresses() -> Iterator[AddressLog]:
    """Check every load, store and atomic of every Triton kernel interpreted inside the block."""
    from triton.runtime import interpreter

    log = AddressLog()
    local = threading.local()  # each thread's launches in flight (innermost last)

    def launches() -> list[_Launch]:
        if not hasattr(local, "stack"):
            local.stack = []
        return local.stack

    executor = interpreter.GridExecutor
    builder = interpreter.InterpreterBuilder
    original_args = executor._init_args_hst
    original_call = executor.__call__
    original_load = builder.create_masked_load
    original_store = builder.create_masked_store
    original_rmw = builder.create_atomic_rmw
    original_cas = builder.create_atomic_cas

    def init_args(self, args_dev, kwargs):
        args_hst, kwargs_hst = original_args(self, args_dev, kwargs)
        names = list(self.arg_names)
        values = list(args_hst) + list(kwargs_hst.values())
        starts, ends, tensor_names = _storages(values, names + list(kwargs_hst))
        kernel = getattr(self.fn, "__name__", "kernel")
        launches().append(_Launch(kernel, starts, ends, tensor_names))
        log.launches[kernel] = log.launches.get(kernel, 0) + 1
        return args_hst, kwargs_hst

    def call(self, *args, **kwargs):
        try:
            return original_call(self, *args, **kwargs)
        finally:
            if launches():
                launches().pop()

    def check(op: str, ptrs, mask) -> None:
        stack = launches()
        if not stack:
            return
        addresses = np.asarray(ptrs.data, dtype=np.uint64)
        active = np.ones(addresses.shape, dtype=bool) if mask is None else np.broadcast_to(mask.data, addresses.shape)
        chosen = addresses[active.astype(bool)]
        log.checked += chosen.size
        if chosen.size == 0:
            return
        itemsize = interpreter._get_np_dtype(ptrs.get_element_ty()).itemsize
        stray = _stray(stack[-1], chosen, itemsize)
        if stray.size:
            raise AddressFault(_describe(stack[-1], op, stray, chosen.size))

    def load(self, ptrs, mask, other, cache_policy, is_volatile):
        check("load", ptrs, mask)
        return original_load(self, ptrs, mask, other, cache_policy, is_volatile)

    def store(self, ptrs, value, mask, cache_policy):
        check("store", ptrs, mask)
        return original_store(self, ptrs, value, mask, cache_policy)

    def rmw(self, rmw_op, ptr, val, mask, sem, scope):
        check("atomic", ptr, mask)
        return original_rmw(self, rmw_op, ptr, val, mask, sem, scope)

    def cas(self, ptr, cmp, val, sem, scope):
        check("atomic", ptr, None)
        return original_cas(self, ptr, cmp, val, sem, scope)

    patched = {
        (executor, "_init_args_hst"): init_args,
        (executor, "__call__"): call,
        (builder, "create_masked_load"): load,
        (builder, "create_masked_store"): store,
        (builder, "create_atomic_rmw"): rmw,
        (builder, "create_atomic_cas"): cas,
    }
    saved = [(owner, name, getattr(owner, name)) for owner, name in patched]
    for (owner, name), replacement in patched.items():
        setattr(owner, name, replacement)
    try:
        yield log
    finally:
        for owner, name, original in saved:
            setattr(owner, name, original)
