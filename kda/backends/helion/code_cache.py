"""Helion's generated Triton code for each launch, kept on disk so that a later process skips Helion's compiler.

A first launch of a Helion kernel at a new specialization costs two compilers: Helion's front end (tracing
the kernel, propagating types, lowering to device IR and generating Triton source; about 0.8 s a kernel on
a CI core, 11 s for the 26 launches of one training step) and Triton's (to PTX and a cubin, which Triton
already keeps on disk in ``TRITON_CACHE_DIR``). This module keeps the first one's output: the generated
module's source, keyed by everything that decides it, so that a later process loads the module (Helion's
own loader, ``PyCodeCache``) and calls its host function directly, exactly as Helion would after
compiling. Nothing else changes: the code is byte for byte what Helion generated.

The key (`entry_key`) is a digest of

- the versions of helion, triton and torch, and this backend's own sources (every ``.py`` file of
  ``kda/backends/helion``: a changed kernel is another key);
- the configuration tables' fingerprint (`configs.fingerprint`: the configuration a launch gets) and the
  ``HELION_*`` environment variables (Helion's settings come from them);
- the device (name, compute capability, SM count: Helion's defaults and code read them);
- the launch: the kernel, its dot precision, the table key (head dims, chunk size, storage width) and
  `runtime.launch_key`'s description of each argument (per tensor its dtype, rank, which sizes are 0 or 1,
  64-bit indexing; every other argument's type and value), which is at least as fine as Helion's own
  dynamic-shape specialization: a new sequence length or batch is the same key, as in one process.

An entry is a JSON file ``<key>.json`` under ``$TORCHINDUCTOR_CACHE_DIR/kda-helion/`` (beside the modules
Helion's loader writes): the kernel's name, the source, its SHA-256, and the warning Helion's default
configuration gave when it was compiled (repeated on load: a defaulted kernel still says so). A missing
entry is compiled and saved; an entry that cannot be read, is not a regular file, is too large, does not
parse, or whose source does not match its digest is ignored with one warning naming the file and why, and
replaced. ``KDA_HELION_CODE_CACHE=0`` switches the cache off (every process compiles). Only CUDA launches
use it: the interpreters run on the CPU, where tests switch it on explicitly (`enabled`).
"""

from __future__ import annotations

import functools
import hashlib
import json
import os
import stat
import tempfile
import warnings
from collections.abc import Callable, Hashable
from pathlib import Path
from typing import Any

import torch

FORMAT = 1
SWITCH_ENV = "KDA_HELION_CODE_CACHE"
MAX_ENTRY_BYTES = 8 * 1024 * 1024  # a generated module is tens of KB; anything far larger is not ours
_NO_BLOCK = getattr(os, "O_NONBLOCK", 0) | getattr(os, "O_CLOEXEC", 0)


def enabled(device: torch.device) -> bool:
    """Whether launches on `device` read and write the cache: CUDA, unless ``KDA_HELION_CODE_CACHE=0``."""
    return device.type == "cuda" and os.environ.get(SWITCH_ENV, "1").strip() != "0"


def directory() -> Path:
    """``kda-helion/`` in the directory where Helion's loader keeps generated modules (torch inductor's)."""
    from torch._inductor.runtime.runtime_utils import cache_dir

    return Path(cache_dir()) / "kda-helion"


@functools.lru_cache(maxsize=1)
def _sources_digest() -> str:
    digest = hashlib.sha256()
    for path in sorted(Path(__file__).parent.glob("*.py")):
        digest.update(path.name.encode())
        digest.update(path.read_bytes())
    return digest.hexdigest()


@functools.lru_cache(maxsize=8)
def _device_identity(device: torch.device) -> str:
    if device.type != "cuda":
        return device.type
    properties = torch.cuda.get_device_properties(device)
    return f"{properties.name}|{properties.major}.{properties.minor}|{properties.multi_processor_count}"


@functools.lru_cache(maxsize=1)
def _versions() -> str:
    from importlib.metadata import PackageNotFoundError, version

    import triton

    try:
        helion = version("helion")
    except PackageNotFoundError:  # imported from a source tree: its files stand for its version
        import helion as package

        helion = f"source {Path(package.__file__).parent}"
    return f"helion {helion}|triton {triton.__version__}|torch {torch.__version__}"


def _describe(part: Hashable) -> str:
    """A launch-key part as stable text: functions by module and name (their `repr` holds an address)."""
    if callable(part) and hasattr(part, "__qualname__"):
        return f"{part.__module__}.{part.__qualname__}"
    if isinstance(part, tuple):
        return "(" + ",".join(_describe(item) for item in part) + ")"
    return repr(part)


def entry_key(launch_key: tuple, tables: str, device: torch.device) -> str:
    """The digest naming one launch's entry (see the module docstring for what enters it)."""
    helion_env = sorted((name, value) for name, value in os.environ.items() if name.startswith("HELION_"))
    text = "\n".join(
        [
            f"format {FORMAT}",
            _versions(),
            f"sources {_sources_digest()}",
            f"tables {tables}",
            f"env {helion_env!r}",
            f"device {_device_identity(device)}",
            f"launch {_describe(launch_key)}",
        ]
    )
    return hashlib.sha256(text.encode()).hexdigest()


_WARNED: set[Path] = set()


def _ignore(path: Path, why: str) -> None:
    if path not in _WARNED:
        _WARNED.add(path)
        warnings.warn(f"kda: ignoring the helion code cache entry {path} ({why}); compiling again", stacklevel=4)


def _read(path: Path) -> dict[str, Any] | None:
    """The entry at `path` if it is whole and ours, else None (absent silently; anything else with a warning)."""
    try:
        fd = os.open(path, os.O_RDONLY | _NO_BLOCK)
    except (FileNotFoundError, NotADirectoryError):  # no entry (or no cache folder): a miss
        return None
    except OSError as error:
        _ignore(path, f"cannot open it: {error}")
        return None
    try:
        info = os.fstat(fd)
        if not stat.S_ISREG(info.st_mode):
            _ignore(path, "not a regular file")
            return None
        if info.st_size > MAX_ENTRY_BYTES:
            _ignore(path, f"{info.st_size} bytes, more than {MAX_ENTRY_BYTES}")
            return None
        with os.fdopen(fd, "rb", closefd=False) as handle:
            raw = handle.read(MAX_ENTRY_BYTES + 1)
    except OSError as error:
        _ignore(path, f"cannot read it: {error}")
        return None
    finally:
        os.close(fd)
    try:
        entry = json.loads(raw)
    except (ValueError, RecursionError) as error:
        _ignore(path, f"not JSON: {type(error).__name__}")
        return None
    fields = {"format": int, "kernel": str, "code": str, "sha256": str}
    if not isinstance(entry, dict) or any(not isinstance(entry.get(k), t) for k, t in fields.items()):
        _ignore(path, "not a code cache entry")
        return None
    if entry["format"] != FORMAT or not isinstance(entry.get("default"), (str, type(None))):
        _ignore(path, f"format {entry['format']!r}, expected {FORMAT}")
        return None
    if hashlib.sha256(entry["code"].encode()).hexdigest() != entry["sha256"]:
        _ignore(path, "its source does not match its digest")
        return None
    return entry


def load(key: str, kernel: str) -> tuple[Callable[..., Any], str | None] | None:
    """The host function kept under `key` for the Helion kernel named `kernel` and the default-configuration
    warning it was compiled with, or None on a miss (then compile, and `save`)."""
    path = directory() / f"{key}.json"
    entry = _read(path)
    if entry is None:
        return None
    if entry["kernel"] != kernel:
        _ignore(path, f"it holds kernel {entry['kernel']!r}, not {kernel!r}")
        return None
    from torch._inductor.codecache import PyCodeCache

    try:
        module = PyCodeCache.load(entry["code"])
        run = getattr(module, kernel)
    except Exception as error:  # a module that no longer imports (a changed Triton, say): compile again
        _ignore(path, f"its module does not load: {type(error).__name__}: {error}")
        return None
    return run, entry["default"]


def save(key: str, kernel: str, code: str, default: str | None) -> None:
    """Keep `code` (the generated module of `kernel`) under `key`; a cache that cannot be written is skipped
    (the process keeps its compiled kernels in memory either way)."""
    folder = directory()
    entry = {
        "format": FORMAT,
        "kernel": kernel,
        "default": default,
        "sha256": hashlib.sha256(code.encode()).hexdigest(),
        "code": code,
    }
    try:
        folder.mkdir(parents=True, exist_ok=True)
        handle, temporary = tempfile.mkstemp(dir=folder, prefix=".entry-", suffix=".tmp")
        try:
            with os.fdopen(handle, "w") as stream:
                json.dump(entry, stream)
            os.replace(temporary, folder / f"{key}.json")  # readers see the old entry or the whole new one
        except BaseException:
            Path(temporary).unlink(missing_ok=True)
            raise
    except OSError as error:
        if folder not in _WARNED:
            _WARNED.add(folder)
            warnings.warn(f"kda: the helion code cache {folder} cannot be written ({error})", stacklevel=3)
