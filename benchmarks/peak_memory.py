"""A bench call's peak memory, counted on any machine from what the host code allocates (no kernel runs).

    python benchmarks/peak_memory.py B1_T8192_H96_D128 --mode fwd --mode train_safe \
        --backend helion --backend triton --backend baseline:fla
    python benchmarks/peak_memory.py B4_T2048_H16_D128 --mode train_safe --backend helion --breakdown

The bench reports a call's peak as ``torch.cuda.max_memory_allocated`` beyond what was allocated before the
call (`kda.bench.timing.peak_bytes`). A kernel allocates nothing on the GPU, so that peak is decided by the
host code alone: which tensors it allocates, in what order, and when the last reference to each goes. Here
the bench's own call (`kda.bench.runner.call_for`: the public `chunk_kda`, FLA's for ``baseline:fla``, and
in a training mode the backward) runs on the CPU with every kernel launch replaced by nothing (the helion
backend's `runtime.launch`; every Triton kernel, FLA's and the triton backend's, run through Triton's
interpreter so that CPU tensors are taken; the tilelang backend's compiled kernels, and its checks for a
Hopper GPU), and each storage any operation creates is counted from its
creation until it is freed (a `TorchDispatchMode` sees every operation, factories included; a finalizer
on the storage sees it go). Storages that exist before the call (the inputs) do not count, as in the
bench. The CUDA allocator rounds a block up to 512 bytes, well under 1 MiB at a bench shape.

Checked against the H200's bench figures (`benchmarks/results/nvidia-h200/`): FLA's forward and training,
the triton backend's, the tilelang backend's forward and its training at two shapes, and the helion
forward as it allocated every intermediate up front come out to the MiB (`docs/design.md`, "The helion
backend"). Run it as a script: it switches Triton's interpreter on before Triton is imported.

``--breakdown`` lists what is alive at the peak: each storage's size, shape and dtype, and the line of
kda's (or FLA's) code that made it, largest first.
"""

from __future__ import annotations

import os

if __name__ == "__main__":  # before Triton is imported: its kernels become interpreted ones, which take CPU tensors
    os.environ["TRITON_INTERPRET"] = "1"
    os.environ["HELION_INTERPRET"] = "1"  # the helion backend takes CPU tensors only with its interpreter on
    os.environ["FLA_TILELANG"] = "0"  # FLA's TileLang pieces look for a GPU; its Triton path is the bench's
    os.environ["KDA_VERIFY"] = "off"  # no verification before the call: the verifier's memory is not the call's

import argparse
import collections
import sys
import traceback
import weakref
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

from kda.backends.base import Verdict
from kda.backends.helion import runtime
from kda.bench import runner
from kda.bench.runner import call_for
from kda.bench.shapes import MODES, BenchShape, make_inputs

MiB = 2**20
BACKENDS = ["helion", "triton", "tilelang", "baseline:fla"]  # those whose every launch `launches_skipped` catches


class LiveStorages(TorchDispatchMode):
    """Counts the bytes of the storages created while it is active and still alive; keeps the peak. With
    `describe`, also what each live storage is (`Made`) and which were alive at the peak (`at_peak`)."""

    def __init__(self, describe: bool = False) -> None:
        super().__init__()
        self.live = 0
        self.peak = 0
        self.before: set[int] = set()  # data pointers of the storages made before the call
        self.sizes: dict[int, int] = {}  # the live counted storages' bytes, by data pointer
        self.describe = describe
        self.made: dict[int, Made] = {}  # with `describe`: what each live counted storage is
        self.at_peak: list[Made] = []  # with `describe`: the storages alive when the peak was reached

    def existing(self, tensors: list[torch.Tensor]) -> None:
        """Storages made before the call: never counted."""
        self.before.update(tensor.untyped_storage().data_ptr() for tensor in tensors)

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        result = func(*args, **(kwargs or {}))
        for value in tree_flatten(result)[0]:
            if isinstance(value, torch.Tensor):
                self._count(value.untyped_storage(), value)
        return result

    def _count(self, storage: torch.UntypedStorage, tensor: torch.Tensor) -> None:
        pointer, size = storage.data_ptr(), storage.nbytes()
        if pointer in self.sizes or pointer in self.before or size == 0:
            return
        self.sizes[pointer] = size
        self.live += size
        if self.describe:
            self.made[pointer] = Made(size, tuple(tensor.shape), str(tensor.dtype).removeprefix("torch."), _maker())
        if self.live > self.peak:
            self.peak = self.live
            if self.describe:
                self.at_peak = list(self.made.values())
        weakref.finalize(storage, self._freed, pointer, size)

    def _freed(self, pointer: int, size: int) -> None:
        self.live -= size
        self.sizes.pop(pointer, None)
        self.made.pop(pointer, None)


@dataclass(frozen=True)
class Made:
    """One counted storage: its bytes, the shape and dtype of the tensor that made it, and where."""

    size: int
    shape: tuple[int, ...]
    dtype: str
    where: str  # "file.py:line function" of the two innermost frames in kda's or FLA's code, or "?"


def _maker() -> str:
    """The two innermost frames of the call stack in kda's or FLA's own code (not torch's, not this file's),
    the caller first: a small allocating helper alone would not say what the storage is for."""
    frames = []
    for frame in reversed(traceback.extract_stack()):
        path = frame.filename.replace("\\", "/")
        if ("/kda/" in path or "/fla/" in path) and "/torch/" not in path:
            frames.append(f"{path.rsplit('/', 1)[-1]}:{frame.lineno} {frame.name}")
            if len(frames) == 2:
                break
    return " > ".join(reversed(frames)) or "?"


def breakdown(at_peak: list[Made]) -> str:
    """The storages alive at the peak, largest first, as lines of MiB, shape, dtype and maker."""
    lines = []
    for made in sorted(at_peak, key=lambda made: -made.size):
        shape = "x".join(map(str, made.shape)) or "scalar"
        lines.append(f"  {made.size / MiB:10.2f} MiB  {shape:>22} {made.dtype:9s} {made.where}")
    return "\n".join(lines)


def tilelang_usable() -> bool:
    """Whether the tilelang backend's modules import here (TileLang installed), so its calls can be counted."""
    try:
        import kda.backends.tilelang.kernels  # noqa: F401
    except ImportError:
        return False
    return True


@contextmanager
def launches_skipped() -> Iterator[None]:
    """Every kernel launch does nothing (the tensors it would write keep what they held): the helion
    backend's, and Triton's, by ``kernel[grid](...)`` (JIT functions, autotuners, heuristics alike) or by
    an interpreted kernel's ``run``."""
    from triton.runtime import interpreter, jit

    def nothing(*args: Any, **kwargs: Any) -> None:
        return None

    saved = [(runtime, "launch"), (jit.KernelInterface, "__getitem__"), (interpreter.InterpretedFunction, "run")]
    originals = [getattr(owner, name) for owner, name in saved]
    runtime.launch = nothing  # type: ignore[assignment]
    jit.KernelInterface.__getitem__ = lambda self, grid: nothing  # type: ignore[method-assign]
    interpreter.InterpretedFunction.run = nothing  # type: ignore[method-assign]
    if tilelang_usable():  # its kernels compiled for nothing: each stage's kernel does nothing
        from kda.backends import tilelang as tilelang_backend
        from kda.backends.tilelang import kernels

        def stubs(spec: Any) -> dict[str, Any]:
            return collections.defaultdict(lambda: nothing)

        def yes(*args: Any) -> Verdict:
            return Verdict.yes("counting its host code's memory; no kernel runs")

        backend_class = tilelang_backend.TileLangBackend
        saved += [(kernels, "compile_all"), (backend_class, "available"), (backend_class, "supports")]
        originals += [kernels.compile_all, backend_class.available, backend_class.supports]
        kernels.compile_all = stubs  # type: ignore[assignment]
        backend_class.available = yes  # type: ignore[method-assign]
        backend_class.supports = yes  # type: ignore[method-assign]
    try:
        yield
    finally:
        for (owner, name), original in zip(saved, originals, strict=True):
            setattr(owner, name, original)


def count(call: Callable[[], Any], existing: list[torch.Tensor], describe: bool = False) -> LiveStorages:
    """`call` run with its storages counted beyond `existing`'s; its result is counted until it is dropped,
    as in the bench."""
    counter = LiveStorages(describe)
    counter.existing(existing)
    with launches_skipped(), counter:
        result = call()
        del result
    return counter


def peak_bytes(call: Callable[[], Any], existing: list[torch.Tensor]) -> int:
    """The peak of the bytes `call` holds at once, beyond `existing`'s storages."""
    return count(call, existing).peak


def call_of(backend: str, inputs: Any, mode: Any) -> tuple[Callable[[], Any] | None, str | None]:
    """The bench's call (`call_for`), FLA's included: the bench calls FLA on CUDA only, where its kernels
    can run; here none runs, and its host code takes CPU tensors."""
    if backend != "baseline:fla":
        return call_for(backend, inputs, mode)
    from kda.backends.fla import fla_triton_chunk_kda

    run = fla_triton_chunk_kda()

    def forward() -> Any:
        return run(**inputs.kwargs)

    return (runner.with_backward(forward, inputs) if mode.training else forward), None


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("shapes", nargs="+", help="bench shapes, e.g. B1_T8192_H96_D128")
    parser.add_argument("--mode", action="append", choices=sorted(MODES), help="bench modes (default: fwd)")
    parser.add_argument(
        "--backend", action="append", choices=BACKENDS, help="what to count (default: helion); repeatable"
    )
    parser.add_argument("--breakdown", action="store_true", help="list what is alive at the peak, and who made it")
    args = parser.parse_args(argv)
    if os.environ.get("TRITON_INTERPRET") != "1":
        parser.error("run it as a script (python benchmarks/peak_memory.py): Triton's interpreter must be on")
    for shape_name in args.shapes:
        for mode_name in args.mode or ["fwd"]:
            mode = MODES[mode_name]
            inputs = make_inputs(BenchShape.parse(shape_name), mode, "cpu", seed=0)
            existing = [value for value in tree_flatten(inputs.kwargs)[0] if isinstance(value, torch.Tensor)]
            existing += [inputs.do] if inputs.do is not None else []
            for backend in args.backend or ["helion"]:
                call, why = call_of(backend, inputs, mode)
                if call is None:
                    print(f"{shape_name} {mode_name} {backend}: not counted ({why})")
                    continue
                counter = count(call, existing, describe=args.breakdown)
                peak = counter.peak
                print(f"{shape_name} {mode_name} {backend}: peak {peak / MiB:.0f} MiB ({peak} bytes)", flush=True)
                if args.breakdown:
                    print(breakdown(counter.at_peak), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
