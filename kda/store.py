"""The on-disk store: where kda keeps what it learns about this machine, and how it reads and writes it.

Everything kda persists lives under one cache root, ``KDA_CACHE_DIR`` (see `kda.config`):
verification records under ``verification/`` (`kda.verify.records`) and tuned timings under
``timings/`` (`kda.timings`). Both use this module for:

- the machine and package fingerprint pieces: `package_versions` (installed versions of the packages that
  can change a backend's numbers, read from metadata once) and `device_identity` (GPU name and compute
  capability, or the CPU);
- `file_lock`: an exclusive advisory lock on a side file, held around read-merge-write;
- `write_json_atomic`: write to a temporary file in the same directory, then replace the target, so that
  a reader never sees half a file;
- `read_json`: a tolerant read, where a missing, unreadable or unparsable file counts as absent (None),
  never as an error.
"""

from __future__ import annotations

import contextlib
import functools
import importlib.metadata
import json
import os
import platform
import tempfile
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import torch

from kda import config

try:  # POSIX advisory locks; elsewhere the atomic replace alone keeps files whole
    import fcntl
except ImportError:  # pragma: no cover - Windows
    fcntl = None  # type: ignore[assignment]

# Distributions whose versions enter the fingerprints (import name: distribution names to try).
TRACKED_PACKAGES: dict[str, tuple[str, ...]] = {
    "torch": ("torch",),
    "triton": ("triton", "pytorch-triton"),
    "helion": ("helion",),
    "tilelang": ("tilelang",),
    "flash_kda": ("tokenspeed-flashkda", "flash-kda", "flash_kda"),
    "fla": ("fla-core", "flash-linear-attention"),
}


def cache_root() -> Path:
    """The directory everything is stored under (``KDA_CACHE_DIR``, re-read on each call)."""
    return config.cache_dir()


@functools.lru_cache(maxsize=1)
def package_versions() -> dict[str, str | None]:
    """Installed versions of the tracked packages, read from metadata once (nothing is imported)."""
    found: dict[str, str | None] = {}
    for name, dists in TRACKED_PACKAGES.items():
        found[name] = None
        for dist in dists:
            try:
                found[name] = importlib.metadata.version(dist)
                break
            except importlib.metadata.PackageNotFoundError:
                continue
    found["torch"] = torch.__version__  # the one actually imported
    return found


def device_identity(device: torch.device | str) -> dict[str, str | None]:
    """What identifies a device for stored results: GPU name and compute capability, or the CPU."""
    device = torch.device(device)
    if device.type == "cuda":
        index = device.index if device.index is not None else torch.cuda.current_device()
        major, minor = torch.cuda.get_device_capability(index)
        return {"device": torch.cuda.get_device_name(index), "capability": f"{major}.{minor}"}
    return {"device": f"{device.type}:{platform.machine()}", "capability": None}


@contextlib.contextmanager
def file_lock(path: Path) -> Iterator[None]:
    """Hold an exclusive advisory lock on `path` (created if absent) for the block."""
    if fcntl is None:  # pragma: no cover
        yield
        return
    with open(path, "a+") as handle:
        fcntl.flock(handle.fileno(), fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(handle.fileno(), fcntl.LOCK_UN)


def write_json_atomic(path: Path, payload: Any, default: Callable[[Any], Any] | None = None) -> None:
    """Write `payload` as JSON to `path` through a temporary file and an atomic replace."""
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=path.name, suffix=".tmp")
    try:
        with os.fdopen(fd, "w") as handle:
            json.dump(payload, handle, indent=1, default=default)
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise


def read_json(path: Path) -> Any:
    """The parsed contents of `path`, or None when it is missing, unreadable or not JSON."""
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError, TypeError):
        return None
