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
  never as an error. It opens only regular files, without blocking (a FIFO planted at a path would
  otherwise block the reader until a writer came), and a file nested too deeply to parse is unparsable.

The lock and the write raise OSError when the cache cannot be written (a read-only or missing cache root,
a directory or FIFO where a file goes); their callers keep what they meant to write in memory for the
process and warn once (`warn_unsaved`), so that an unusable cache never breaks a call.
"""

from __future__ import annotations

import contextlib
import functools
import importlib.metadata
import json
import logging
import os
import platform
import stat
import tempfile
import threading
import warnings
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import torch

from kda import config

try:  # POSIX advisory locks; elsewhere the atomic replace alone keeps files whole
    import fcntl
except ImportError:  # pragma: no cover - Windows
    fcntl = None  # type: ignore[assignment]

# Opens that never wait: a FIFO planted at a path must not block its reader (or the lock's opener).
_NO_BLOCK = getattr(os, "O_NONBLOCK", 0) | getattr(os, "O_CLOEXEC", 0)

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
    """Hold an exclusive advisory lock on `path` (created if absent) for the block; OSError when `path`
    cannot be opened or is not a regular file."""
    if fcntl is None:  # pragma: no cover
        yield
        return
    fd = os.open(path, os.O_RDWR | os.O_CREAT | _NO_BLOCK, 0o644)
    try:
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            raise OSError(f"lock file {path} is not a regular file")
        fcntl.flock(fd, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(fd, fcntl.LOCK_UN)
    finally:
        os.close(fd)


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


def probe_writable(directory: Path) -> None:
    """Make `directory` if absent and write and remove a scratch file in it; OSError when that fails (for
    a command whose job is to write there, to stop before its work rather than lose it)."""
    directory.mkdir(parents=True, exist_ok=True)
    fd, scratch = tempfile.mkstemp(dir=directory, prefix=".probe-", suffix=".tmp")
    os.close(fd)
    os.unlink(scratch)


def read_json(path: Path) -> Any:
    """The parsed contents of `path`, or None when it is missing, unreadable, not a regular file, or not
    JSON (nested too deeply included). Never blocks: the open does not wait for a FIFO's writer."""
    try:
        fd = os.open(path, os.O_RDONLY | _NO_BLOCK)
    except OSError:
        return None
    try:
        with os.fdopen(fd, "rb") as handle:
            if not stat.S_ISREG(os.fstat(handle.fileno()).st_mode):
                return None
            data = handle.read()
        return json.loads(data)
    except (OSError, ValueError, TypeError, RecursionError):
        return None


_warned: set[tuple[str, Path]] = set()
_warned_lock = threading.Lock()


def warn_unsaved(what: str, path: Path, error: OSError) -> None:
    """Warn that `path` could not be written and that `what` it was to hold stays in memory: once per
    kind and folder in this process (so once per cache for records, once for timings); later failures
    are logged at DEBUG on the ``kda`` logger."""
    with _warned_lock:
        first = (what, path.parent) not in _warned
        _warned.add((what, path.parent))
    message = f"kda: {what} not saved to {path} ({type(error).__name__}: {error}); kept in memory for this process"
    if first:
        warnings.warn(message + " (set KDA_CACHE_DIR to a writable directory)", RuntimeWarning, stacklevel=3)
    else:
        logging.getLogger("kda").debug(message)
