"""The helion backend's peak memory in one bench call, counted on any machine from what its host code
allocates (its kernels are not run).

    python benchmarks/peak_memory.py B1_T8192_H96_D128 B4_T2048_H16_D128 --mode fwd --mode train_safe

The bench reports a call's peak as ``torch.cuda.max_memory_allocated`` beyond what was allocated before the
call (`kda.bench.timing.peak_bytes`). A kernel allocates nothing on the GPU, so that peak is decided by the
host code alone: which tensors it allocates, in what order, and when the last reference to each goes. Here
the same call (`kda.bench.runner.call_for`: the public `chunk_kda`, and in a training mode its backward)
runs on the CPU with every launch of the backend (`runtime.launch`) replaced by nothing, and each storage
any operation creates is counted from its creation until it is freed (a `TorchDispatchMode` sees every
operation, factories included; a finalizer on the storage sees it go). Storages that exist before the call
(the inputs) do not count, as in the bench. The CUDA allocator rounds a block up to 512 bytes, which moves
a bench shape's figure by well under 1 MiB.

The count is checked against the H200: for the forward at B1_T8192_H96_D128 and B4_T2048_H16_D128 it
gives what `kda.bench` measured there for the same code (`docs/design.md`, "The helion backend").
"""

from __future__ import annotations

import argparse
import os
import sys
import weakref
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

from kda.backends.helion import runtime
from kda.bench.runner import call_for
from kda.bench.shapes import MODES, BenchShape, make_inputs

MiB = 2**20


class LiveStorages(TorchDispatchMode):
    """Counts the bytes of the storages created while it is active and still alive; keeps the peak."""

    def __init__(self) -> None:
        super().__init__()
        self.live = 0
        self.peak = 0
        self.seen: set[int] = set()  # data pointers of counted storages (and of the ones that existed before)

    def existing(self, tensors: list[torch.Tensor]) -> None:
        """Storages made before the call: never counted."""
        for tensor in tensors:
            self.seen.add(tensor.untyped_storage().data_ptr())

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        result = func(*args, **(kwargs or {}))
        for value in tree_flatten(result)[0]:
            if isinstance(value, torch.Tensor):
                self._count(value.untyped_storage())
        return result

    def _count(self, storage: torch.UntypedStorage) -> None:
        pointer, size = storage.data_ptr(), storage.nbytes()
        if pointer in self.seen or size == 0:
            return
        self.seen.add(pointer)
        self.live += size
        self.peak = max(self.peak, self.live)
        weakref.finalize(storage, self._freed, pointer, size)

    def _freed(self, pointer: int, size: int) -> None:
        self.live -= size
        self.seen.discard(pointer)


@contextmanager
def launches_skipped() -> Iterator[None]:
    """Every helion kernel launch does nothing: the tensors it would write keep what they held."""
    launch = runtime.launch
    runtime.launch = lambda *args, **kwargs: None  # type: ignore[assignment]
    try:
        yield
    finally:
        runtime.launch = launch  # type: ignore[assignment]


def peak_bytes(call: Callable[[], Any], existing: list[torch.Tensor]) -> int:
    """The peak of the bytes `call` holds at once, beyond `existing`'s storages; its result is counted until
    it is dropped, as in the bench."""
    counter = LiveStorages()
    counter.existing(existing)
    with launches_skipped(), counter:
        result = call()
        del result
    return counter.peak


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("shapes", nargs="+", help="bench shapes, e.g. B1_T8192_H96_D128")
    parser.add_argument("--mode", action="append", choices=sorted(MODES), help="bench modes (default: fwd)")
    args = parser.parse_args(argv)
    os.environ["HELION_INTERPRET"] = "1"  # the backend takes CPU tensors only with its interpreter on
    os.environ["KDA_VERIFY"] = "off"  # no verification before the call: the verifier's memory is not the call's
    for shape_name in args.shapes:
        for mode_name in args.mode or ["fwd"]:
            mode = MODES[mode_name]
            inputs = make_inputs(BenchShape.parse(shape_name), mode, "cpu", seed=0)
            call, why = call_for("helion", inputs, mode)
            if call is None:
                print(f"{shape_name} {mode_name}: not run ({why})")
                continue
            existing = [value for value in tree_flatten(inputs.kwargs)[0] if isinstance(value, torch.Tensor)]
            if inputs.do is not None:
                existing.append(inputs.do)
            peak = peak_bytes(call, existing)
            print(f"{shape_name} {mode_name}: helion peak {peak / MiB:.0f} MiB ({peak} bytes)", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
