"""How the helion backend builds and launches its kernels.

- `helion_problem`: why the installed Helion cannot run here (None when it can).
- `interpreting`: ``HELION_INTERPRET=1`` runs every kernel as eager PyTorch on the tensors' device (CPU
  included): Helion's reference mode, how CI checks the kernels and how a user without a GPU steps through
  them. Helion reads the switch when a kernel object is made, so kernel objects are kept per setting.
- `launch`: one Helion kernel object per (function, dot precision, interpreter setting); on a GPU each
  bound specialization gets the configuration `configs.choose` picks before its first run, so nothing is
  ever autotuned at call time. After the first run the compiled host function is called directly, found
  by `launch_key`: Helion's own dispatch (binding the arguments, its specialization key, its guards) took
  about 150 us of host time a launch on the H200 machine, against ~20 us of GPU time for the small
  stages, so a forward of six launches at B4_T2048_H16_D128 was bound by the host. A launch new to the
  process first looks for the module another process generated for it (`code_cache`), which skips Helion's
  compiler (about 0.8 s a kernel); what it compiles, it keeps there.
- `register_cpu_matmul`: the interpreter computes ``hl.dot`` of half-precision operands with an fp32 result
  as ``aten::mm.dtype``, which has no CPU kernel in torch; this registers one (an fp32 product, then the
  cast), once, only when a kernel is interpreted on CPU tensors.
"""

from __future__ import annotations

import contextlib
import functools
import os
from collections.abc import Callable, Hashable
from pathlib import Path
from typing import Any

import torch

from kda.backends.helion import code_cache, configs


def interpreting() -> bool:
    return os.environ.get("HELION_INTERPRET", "0") == "1"


@functools.lru_cache(maxsize=1)
def helion_problem() -> str | None:
    """Why Helion cannot run here, or None. (Helion 1.5.1 does not import on torch 2.11; 1.5.0 does.)"""
    try:
        import helion
        import helion.language  # noqa: F401
    except Exception as error:
        return f"helion does not import ({type(error).__name__}: {error}); install helion 1.5.x for this torch"
    return None


@functools.lru_cache(maxsize=1)
def helion_version() -> str:
    """The installed helion's version, read once: the verification store asks for it on every call (it is
    part of the backend's fingerprint), and reading the package metadata took 0.6 ms a read on a CPU."""
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("helion")
    except PackageNotFoundError:
        return "unknown"


_CPU_MATMUL: Any = None


def register_cpu_matmul() -> None:
    """A CPU ``aten::mm.dtype`` (see the module docstring); a no-op once done or if torch already has one."""
    global _CPU_MATMUL
    if _CPU_MATMUL is not None:
        return
    library = torch.library.Library("aten", "IMPL")

    def mm_dtype(a: torch.Tensor, b: torch.Tensor, out_dtype: torch.dtype) -> torch.Tensor:
        return torch.mm(a.to(torch.float32), b.to(torch.float32)).to(out_dtype)

    with contextlib.suppress(RuntimeError):  # raised when torch has a CPU kernel for it already
        library.impl("mm.dtype", mm_dtype, "CPU")
    _CPU_MATMUL = library  # kept alive: the registration lasts as long as the Library object


@functools.cache
def _kernel(fn: Callable[..., Any], dot_precision: str, interpret: bool) -> Any:
    import helion

    del interpret  # part of the cache key: Helion reads HELION_INTERPRET when the kernel object is made
    return helion.kernel(fn, static_shapes=False, dot_precision=dot_precision)


def launch_key(fn: Callable[..., Any], dot_precision: str, args: tuple[Any, ...], key: configs.ShapeKey) -> tuple:
    """What decides the compiled code of one launch, at least as finely as Helion's dynamic-shape
    specialization does: per tensor its dtype, device, rank, which sizes are 0 or 1, and whether its
    elements need 64-bit indices; every other argument by type and value; and the table key, which decides
    the configuration. (Sizes, strides and data pointers are read by the host function on each call.)"""
    parts: list[Hashable] = [fn, dot_precision, key]
    for arg in args:
        if isinstance(arg, torch.Tensor):
            small = tuple(size if size < 2 else 2 for size in arg.shape)
            parts.append((arg.dtype, arg.device, small, arg.numel() > _INT32_LIMIT))
        else:
            parts.append((type(arg), arg))
    return tuple(parts)


_INT32_LIMIT = 2**31 - 1
_COMPILED: dict[tuple, Callable[..., Any]] = {}


def launch(fn: Callable[..., Any], dot_precision: str, args: tuple[Any, ...], key: configs.ShapeKey) -> None:
    """Run the Helion kernel `fn` on `args` with the pretuned configuration for `key` (never autotuning)."""
    if interpreting():
        register_cpu_matmul()
        _kernel(fn, dot_precision, True)(*args)
        return
    found = launch_key(fn, dot_precision, args, key)
    run = _COMPILED.get(found)
    if run is not None:
        run(*args)
        return
    kept_as = _entry_key(found, args)  # None where the code cache is off
    run = _kept(kept_as, found, fn.__name__, key) if kept_as is not None else None
    if run is not None:
        run(*args)
        return
    configs.DEFAULTED.pop((fn.__name__, key), None)  # what this launch's compile notes, `_keep` keeps
    bound = _kernel(fn, dot_precision, False).bind(args)
    if getattr(bound, "_config", None) is None:
        try:
            bound.set_config(configs.choose(fn.__name__, key, bound))
        except Exception as error:  # a table entry Helion accepted but could not compile
            configs.fall_back(fn.__name__, key, f"its table entry failed: {type(error).__name__}: {error}")
            bound.set_config(bound.config_spec.default_config())
    bound(*args)
    compiled = getattr(bound, "_run", None)
    if callable(compiled):  # Helion's compiled host function for this specialization and configuration
        _COMPILED[found] = compiled
        if kept_as is not None:
            _keep(kept_as, fn.__name__, key, compiled)


def _entry_key(found: tuple, args: tuple[Any, ...]) -> str | None:
    """The launch's name in the code cache, or None where the cache is off (not CUDA, or switched off)."""
    device = _device_of(args)
    if device is None or not code_cache.enabled(device):
        return None
    return code_cache.entry_key(found, configs.fingerprint(), device)


def _kept(kept_as: str, found: tuple, name: str, key: configs.ShapeKey) -> Callable[..., Any] | None:
    """The host function another process compiled for this launch (`code_cache`), or None."""
    kept = code_cache.load(kept_as, name)
    if kept is None:
        return None
    run, default = kept
    if default is not None:  # compiled on Helion's default configuration: say so, as the compiling process did
        configs.fall_back(name, key, default)
    _COMPILED[found] = run
    return run


def _keep(kept_as: str, name: str, key: configs.ShapeKey, compiled: Any) -> None:
    """Save the module Helion generated for this launch (`compiled` is its host function) for later
    processes (`code_cache`)."""
    try:
        code = Path(compiled.__globals__["__file__"]).read_text()
    except (AttributeError, KeyError, TypeError, OSError):  # nothing to keep: later processes compile, as this one
        return
    code_cache.save(kept_as, name, code, configs.DEFAULTED.get((name, key)))


def _device_of(args: tuple[Any, ...]) -> torch.device | None:
    return next((arg.device for arg in args if isinstance(arg, torch.Tensor)), None)
