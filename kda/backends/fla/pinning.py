"""Pin FLA's Triton autotuners to one configuration while the verifier runs FLA.

FLA autotunes every kernel for each new set of compile-time constants (heads, head dims, flags), which
costs minutes per set (about 250 s at one shape on an H200, almost all of it compiling candidate
configurations). Verification runs FLA on dozens of tiny, differently shaped cases, where autotuning
buys nothing: a configuration picked at T = 141 says nothing about the one picked at T = 8192, and the
configurations differ only in tiling, never in the math. So while `kda.verify` (or a lazy first-use
check) runs FLA, every FLA autotuner is given its first configuration only, which Triton then uses
without benchmarking; the full lists are put back as soon as the case ends. If the pinned configuration
cannot run a case (say, it does not fit), the case is run again unpinned.
"""

from __future__ import annotations

import contextlib
import sys
import threading
from collections.abc import Iterator
from typing import Any

_lock = threading.Lock()


def _autotuners() -> list[Any]:
    """Every Triton `Autotuner` reachable from the loaded `fla.ops` modules (through heuristics wrappers)."""
    try:
        from triton.runtime.autotuner import Autotuner
    except Exception:
        return []
    found: dict[int, Any] = {}
    for name, module in list(sys.modules.items()):
        if not name.startswith("fla.ops") or module is None:
            continue
        for value in list(vars(module).values()):
            seen = 0
            while value is not None and seen < 4:  # Heuristics(Autotuner(JITFunction)): follow .fn
                if isinstance(value, Autotuner):
                    found[id(value)] = value
                value = getattr(value, "fn", None)
                seen += 1
    return list(found.values())


@contextlib.contextmanager
def pinned_autotune() -> Iterator[None]:
    """Within the block, each FLA autotuner has only its first configuration."""
    with _lock:
        saved = []
        for tuner in _autotuners():
            configs = getattr(tuner, "configs", None)
            if isinstance(configs, list) and len(configs) > 1:
                saved.append((tuner, configs))
                tuner.configs = configs[:1]
        try:
            yield
        finally:
            for tuner, configs in saved:
                tuner.configs = configs
