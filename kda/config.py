"""Settings read from the environment, in one place.

- ``KDA_VERIFY``: ``lazy`` (default) verifies a backend for a case class on first use when no record
  exists; ``strict`` uses a backend only where ``python -m kda.verify`` left a passing record; ``off``
  skips verification (with a warning): for debugging a backend, never for production.
- ``KDA_CACHE_DIR``: where verification records live (default: ``$XDG_CACHE_HOME/kda`` or ``~/.cache/kda``).
- ``KDA_TOLERANCE_SCALE``: a number ``0 < s <= 1`` (default 1) that multiplies every verification tolerance:
  it tightens the accuracy policy, never loosens it (`kda.verify.policy`).
"""

from __future__ import annotations

import functools
import math
import os
from pathlib import Path
from typing import Literal

from kda.errors import KDAError

VerifyMode = Literal["lazy", "strict", "off"]
VERIFY_MODES: tuple[VerifyMode, ...] = ("lazy", "strict", "off")


def verify_mode() -> VerifyMode:
    value = os.environ.get("KDA_VERIFY", "lazy").strip().lower() or "lazy"
    if value not in VERIFY_MODES:
        raise KDAError(f"KDA_VERIFY must be one of {', '.join(VERIFY_MODES)}; got {value!r}")
    return value


def cache_dir() -> Path:
    env = os.environ
    return _cache_dir(env.get("KDA_CACHE_DIR"), env.get("XDG_CACHE_HOME"), env.get("HOME"))


@functools.lru_cache(maxsize=16)
def _cache_dir(explicit: str | None, xdg: str | None, home: str | None) -> Path:
    # Memoised on the variables it reads: every call looks the records up, and Path work is slow.
    if explicit:
        return Path(explicit).expanduser()
    base = xdg or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "kda"


def tolerance_scale() -> float:
    """``KDA_TOLERANCE_SCALE`` as a number in ``(0, 1]``; anything else is a `KDAError` naming the value."""
    return _tolerance_scale(os.environ.get("KDA_TOLERANCE_SCALE"))


@functools.lru_cache(maxsize=16)
def _tolerance_scale(value: str | None) -> float:
    if value is None or not value.strip():
        return 1.0
    try:
        scale = float(value)
    except ValueError:
        scale = math.nan
    if not (0.0 < scale <= 1.0):  # also refuses NaN
        raise KDAError(
            "KDA_TOLERANCE_SCALE must be a number with 0 < s <= 1 (it tightens the verification tolerances and "
            f"cannot loosen them); got {value!r}"
        )
    return scale
