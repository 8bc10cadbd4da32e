"""Keep FLA on its own Triton kernels for the length of one adapter call.

FLA 0.6 decorates several inner KDA stages with ``@dispatch('kda')``: at every call, the stage asks
the ``kda`` registry of `fla.backends` for an available, enabled backend, and runs FLA's own Triton
function only when none accepts. With `tilelang` installed (as ``pip install kda[all]`` does), the
TileLang backend accepts part of the backward; on the H200 those kernels failed to compile at small
shapes ("Get different layout for s_dv_pre" at K = 16; "No valid warp partition for T.gemm: M=32,
N=16"), 40 to 80 s a failure, which kept `fla` out of training there.

The `fla` backend is FLA's Triton path, whatever else is installed: `triton_path_only()` hands the
``kda`` registry an empty set of backends for the block, so every dispatched stage falls through to
FLA's own function, and puts the set back afterwards. Nothing outlives the call: no environment
variable is set, and FLA's objects are as they were once the block ends. The swap is under a lock, so
two adapter calls on two threads never restore each other's state; another thread calling FLA directly
during the block also sees FLA's Triton path.

If a later FLA moves its registry, `triton_path_only()` cannot find it and does nothing; the adapter
then says so in its fingerprint (``fla_tilelang_route: "not bypassed"``), and the verifier judges
whatever path FLA takes, as it judges any backend.
"""

from __future__ import annotations

import contextlib
import importlib
import importlib.util
import os
import sys
import threading
from collections.abc import Iterator
from typing import Any

_lock = threading.RLock()


def kda_registry() -> Any | None:
    """FLA's ``kda`` operation registry (`fla.backends.BackendRegistry`), or None when FLA has none.

    Looked up only once `fla.backends` is imported (the adapter's own import of FLA's KDA does that), so
    asking never imports FLA."""
    backends = sys.modules.get("fla.backends")
    registries = getattr(backends, "_operation_registries", None)
    registry = registries.get("kda") if isinstance(registries, dict) else None
    return registry if isinstance(getattr(registry, "_backends", None), dict) else None


def tilelang_installed() -> bool:
    """Whether FLA would consider its TileLang kernels in this process (before any bypass)."""
    if os.environ.get("FLA_DISABLE_BACKEND_DISPATCH") == "1" or os.environ.get("FLA_TILELANG", "1") == "0":
        return False
    return importlib.util.find_spec("tilelang") is not None


def route_state() -> str:
    """For the fingerprint: "off" (no other path is installed), "bypassed" (installed, and the adapter
    keeps FLA off it) or "not bypassed" (installed, and this FLA's registry was not found)."""
    if not tilelang_installed():
        return "off"
    with contextlib.suppress(Exception):
        # FLA makes the ``kda`` registry when its KDA stages are imported (`dispatch("kda")`), not with
        # `fla.backends`: asked before any FLA call, the registry is found only once they are
        importlib.import_module("fla.ops.kda")
    return "bypassed" if kda_registry() is not None else "not bypassed"


@contextlib.contextmanager
def triton_path_only() -> Iterator[None]:
    """Within the block, no FLA backend is offered to FLA's dispatched KDA stages (see the module text)."""
    registry = kda_registry()
    if registry is None:
        yield
        return
    with _lock:
        offered = registry._backends
        registry._backends = {}
        try:
            yield
        finally:
            registry._backends = offered
