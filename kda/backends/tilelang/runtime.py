"""How the tilelang backend builds its kernels: availability, compilation with a cache, and lowering.

- `tilelang_problem`: why TileLang cannot build kernels here (None when it can): it must import, and its
  compiler driver, CUDA's ``nvcc``, must run. FLA's own TileLang path crashed on a machine with tilelang
  installed and no nvcc, so importable is not enough.
- `compile_all`: one compiled kernel per specialization (a builder and its compile-time parameters), kept
  in memory for the process, the missing ones of a call compiled in parallel; TileLang also keeps each compiled kernel on disk (``~/.tilelang/cache``,
  ``TILELANG_CACHE_DIR``), keyed by the kernel's source, so a new process at a known specialization loads
  it instead of running nvcc again. Sequence length, batch, the number of chunks and the head counts are
  symbolic in every kernel: they never cause a compile.
- `lower`: the CUDA source of a kernel for an explicit target (``sm_90a`` by default), without a GPU or a
  compiler. CI lowers every kernel of every shape class the backend claims this way, and checks that the
  matrix products became Hopper's ``wgmma``.

A compile failure is never a crash: `CompileFailure` carries the kernel and the compiler's last words, and
the backend's `supports` turns it into a "no" with that reason, so the dispatcher routes the call to
another backend (FLA 0.6's TileLang backward pieces failed to compile at small shapes on the H200).
"""

from __future__ import annotations

import concurrent.futures
import functools
import os
import shutil
import subprocess
import threading
from collections.abc import Callable
from typing import Any

HOPPER = "sm_90a"  # wgmma and the bulk tensor copies need the arch-specific target


class CompileFailure(RuntimeError):
    """A kernel did not lower or compile; the message names the kernel and TileLang's or nvcc's reason."""


@functools.lru_cache(maxsize=1)
def tilelang_problem() -> str | None:
    """Why TileLang cannot build kernels here, or None."""
    try:
        import tilelang
        import tilelang.language  # noqa: F401
    except Exception as error:  # a broken install must be a reason, not a traceback
        return f"tilelang does not import ({type(error).__name__}: {error}); install tilelang 0.1.15"
    nvcc = find_nvcc()
    if nvcc is None:
        return "no nvcc found (CUDA_HOME/bin, PATH): TileLang compiles every kernel through CUDA's nvcc"
    try:
        done = subprocess.run([nvcc, "--version"], capture_output=True, text=True, timeout=30)
    except (OSError, subprocess.TimeoutExpired) as error:
        return f"nvcc at {nvcc} does not run ({type(error).__name__}: {error})"
    if done.returncode != 0:
        return f"nvcc at {nvcc} does not run (exit {done.returncode}: {done.stderr.strip()[-200:]})"
    return None


def find_nvcc() -> str | None:
    for home in (os.environ.get("CUDA_HOME"), os.environ.get("CUDA_PATH"), "/usr/local/cuda"):
        if home and os.access(os.path.join(home, "bin", "nvcc"), os.X_OK):
            return os.path.join(home, "bin", "nvcc")
    return shutil.which("nvcc")


@functools.lru_cache(maxsize=1)
def tilelang_version() -> str:
    """The installed tilelang's version, read once: it is part of the backend's fingerprint, which the
    verification store reads on every call (reading package metadata costs a fraction of a millisecond)."""
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("tilelang")
    except PackageNotFoundError:
        return "unknown"


def _reason(error: BaseException) -> str:
    lines = [line.strip() for line in str(error).strip().splitlines() if line.strip()]
    return f"{type(error).__name__}: {lines[-1] if lines else ''}"[:400]


Specialization = tuple[Callable[..., Any], tuple[Any, ...]]  # a kernel builder and its compile-time arguments


def pass_configs(builder: Callable[..., Any]) -> dict[str, Any]:
    """TileLang pass settings a kernel builder asks for (its ``pass_configs`` attribute; none by default),
    used wherever its kernels are compiled or lowered, so that CI lowers what the GPU runs."""
    return dict(getattr(builder, "pass_configs", {}))


_compiled: dict[Specialization, Any] = {}
_failed: dict[Specialization, CompileFailure] = {}
_lock = threading.Lock()


def target() -> dict[str, str]:
    """The TileLang target of the current GPU: the arch-specific one on Hopper (``sm_90a``: wgmma, TMA)."""
    import torch

    major, minor = torch.cuda.get_device_capability()
    return {"kind": "cuda", "arch": f"sm_{major}{minor}{'a' if major == 9 else ''}"}


def _failure(key: Specialization, error: BaseException) -> CompileFailure:
    builder, params = key
    return CompileFailure(f"{builder.__module__}.{builder.__name__}{params}: {_reason(error)}")


def compile_all(specializations: list[Specialization]) -> list[Any]:
    """The compiled kernels of `specializations`, each built once per process; the ones not yet built are
    compiled in parallel (nvcc runs one process a kernel). Raises `CompileFailure` for the first that does
    not compile, then every time it is asked for again, without retrying."""
    with _lock:
        for key in specializations:
            if key in _failed:
                raise _failed[key]
        missing = list(dict.fromkeys(key for key in specializations if key not in _compiled))
        if missing:
            import tilelang

            where = target()

            def build(key: Specialization) -> Any:
                return tilelang.compile(key[0](*key[1]), target=where, pass_configs=pass_configs(key[0]) or None)

            # lowering releases the GIL and nvcc is a process of its own, so threads compile in parallel
            with concurrent.futures.ThreadPoolExecutor(len(missing), "kda-tilelang") as pool:
                futures = [pool.submit(build, key) for key in missing]
            for key, future in zip(missing, futures, strict=True):
                error = future.exception()
                if error is not None:
                    _failed[key] = _failure(key, error)
                else:
                    _compiled[key] = future.result()
            for key in missing:
                if key in _failed:
                    raise _failed[key]
        return [_compiled[key] for key in specializations]


def lower(prim_func: Any, arch: str = HOPPER, configs: dict[str, Any] | None = None) -> Any:
    """TileLang's lowered artifact of a kernel for ``arch``: ``.kernel_source`` is its CUDA source.
    `configs`: TileLang pass settings, as the kernel's builder asks for them (`pass_configs`).

    Needs neither a GPU nor nvcc (CI runs it on a CPU)."""
    import tilelang
    from tilelang.transform import PassContext
    from tvm.target import Target

    with Target({"kind": "cuda", "arch": arch}), PassContext(config=configs or {}):
        return tilelang.lower(prim_func)


def shared_memory_bytes(artifact: Any) -> int:
    """The dynamic shared memory a lowered kernel asks for per block (0 when none)."""
    for _, function in artifact.device_mod.functions.items():
        attrs = function.attrs or {}
        if "dyn_shared_memory_buf" in attrs:
            return int(attrs["dyn_shared_memory_buf"])
    return 0
