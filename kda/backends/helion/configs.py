"""Pretuned launch configurations for the helion backend's kernels, per GPU architecture.

Nothing is autotuned at call time. Each kernel's configuration comes from a table shipped in the package
(``tuned_<arch>.json``, e.g. ``tuned_sm90.json``, measured on an H200) or from the file named by
``KDA_HELION_CONFIGS`` (same format; `kda.bench --tune-kernels helion` writes one), keyed by what changes
the best configuration: the head dims ``K`` and ``V``, the chunk size, and the storage: intermediates in
bf16/fp16 (``half``: inference on half inputs), in fp32 (fp32 inputs), or fp32 with ``w`` and ``A_qk`` as
bf16 halves (``halves``: training on half inputs, whose serial passes multiply on halves). An unseen shape
takes the nearest entry of the same head dims and storage (a differing chunk size is allowed); a kernel with no such entry, or whose entry Helion
rejects, runs Helion's default configuration, with one warning per kernel and architecture. Entries are
not carried across head dims: block sizes and stages are sized for them, and on the H200 a class at d256
that passed with the default configurations failed with the entries tuned at 128. Nor across storage:
the fp32 variant of a kernel is another program (fp32 operands, three TF32 products each), and
`state`'s inference entry compiled for training takes 229 KB of shared memory and spills 2.5 KB a thread
where Helion's own H200 default takes 147 KB and spills 2.0 KB, on twice the blocks
(``benchmarks/helion_resources.py``).

An fp32 call's serial passes multiply fp32
operands (IEEE), a half-input training call's bf16 halves: an entry for one is not used by the other.

Table format: ``{"kernel name": [{"K": 128, "V": 128, "C": 64, "half": true, "config": {...}}, ...]}``,
``config`` being `helion.Config`'s keyword arguments; ``"halves": true`` marks an entry for training on half
inputs (absent: false).
"""

from __future__ import annotations

import functools
import hashlib
import json
import os
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import Any

TABLE_ENV = "KDA_HELION_CONFIGS"


@dataclass(frozen=True)
class ShapeKey:
    """What a kernel's best configuration depends on."""

    arch: str  # "sm90", "sm100", ...; "cpu" under the interpreter
    K: int
    V: int
    C: int
    half: bool  # intermediates stored in bf16/fp16 (inference on half inputs)
    halves: bool = False  # training on half inputs: w and A_qk as bf16 halves (`forward.training_halves`)


def shipped_table_path(arch: str) -> Path:
    return Path(__file__).with_name(f"tuned_{arch}.json")


@functools.lru_cache(maxsize=16)
def _read_table(path: str, mtime: float) -> dict[str, list[dict[str, Any]]]:
    del mtime  # part of the cache key: a rewritten file is read again
    try:
        data = json.loads(Path(path).read_text())
    except (OSError, ValueError) as error:
        warnings.warn(f"kda: ignoring the helion config table {path}: {error}", stacklevel=3)
        return {}
    if not isinstance(data, dict):
        warnings.warn(f"kda: ignoring the helion config table {path}: not a JSON object", stacklevel=3)
        return {}
    table: dict[str, list[dict[str, Any]]] = {}
    for name, entries in data.items():
        if isinstance(entries, list):
            table[name] = [e for e in entries if _well_formed(e)]
    return table


def _well_formed(entry: object) -> bool:
    if not isinstance(entry, dict) or not isinstance(entry.get("config"), dict):
        return False
    dims = [entry.get(key) for key in ("K", "V", "C")]
    storage = isinstance(entry.get("half"), bool) and isinstance(entry.get("halves", False), bool)
    return all(isinstance(d, int) and d > 0 for d in dims) and storage


def table(arch: str) -> dict[str, list[dict[str, Any]]]:
    """The user's table (``KDA_HELION_CONFIGS``) over the shipped one, kernel by kernel."""
    merged: dict[str, list[dict[str, Any]]] = {}
    for path in (shipped_table_path(arch), os.environ.get(TABLE_ENV)):
        if path and Path(path).is_file():
            merged.update(_read_table(str(path), Path(path).stat().st_mtime))
    return merged


def fingerprint() -> str:
    """A digest of the tables that can configure a kernel here (every shipped one, and ``KDA_HELION_CONFIGS``'s
    file): another table compiles other code, so verification records made under one do not serve another."""
    paths = sorted(Path(__file__).parent.glob("tuned_*.json"))
    user = os.environ.get(TABLE_ENV)
    if user and Path(user).is_file():  # as `table` reads it: a name without a file configures nothing
        paths.append(Path(user))
    return _digest(tuple((str(path), _mtime(path)) for path in paths))


def _mtime(path: Path) -> float:
    try:
        return path.stat().st_mtime
    except OSError:
        return -1.0


@functools.lru_cache(maxsize=16)
def _digest(files: tuple[tuple[str, float], ...]) -> str:
    digest = hashlib.sha256()
    for name, _ in files:  # the mtime is part of the cache key only: a rewritten file is read again
        path = Path(name)
        digest.update(path.name.encode())
        try:
            digest.update(path.read_bytes())
        except OSError as error:  # absent or unreadable: the table reader ignores it, and so does this
            digest.update(f"({type(error).__name__})".encode())
    return digest.hexdigest()[:12]


def entry_key(key: ShapeKey) -> dict[str, Any]:
    """What a table entry records of `key` (``halves`` only where true, as the tables written before it)."""
    return {"K": key.K, "V": key.V, "C": key.C, "half": key.half} | ({"halves": True} if key.halves else {})


def matches(entry: dict[str, Any], key: ShapeKey, *, chunk: bool = False) -> bool:
    """Whether table entry `entry` is for `key`'s head dims and storage (and its chunk size, with `chunk`)."""
    storage = (entry["half"], entry.get("halves", False)) == (key.half, key.halves)
    return (entry["K"], entry["V"]) == (key.K, key.V) and storage and (not chunk or entry["C"] == key.C)


def nearest(name: str, key: ShapeKey) -> dict[str, Any] | None:
    """The configuration of the entry for kernel `name` at `key`'s head dims and storage, its own chunk size
    first, or None without one."""
    entries = [entry for entry in table(key.arch).get(name, []) if matches(entry, key)]
    if not entries:
        return None
    return min(entries, key=lambda entry: entry["C"] != key.C)["config"]


_WARNED: set[tuple[str, str]] = set()
DEFAULTED: dict[tuple[str, ShapeKey], str] = {}  # (kernel, key) -> why it runs Helion's default configuration


def fall_back(name: str, key: ShapeKey, why: str) -> None:
    """Note that kernel `name` at `key` runs Helion's default configuration, and why; warn once per kernel and
    architecture (the code cache keeps `why` with the kernel's code and says it again on load)."""
    DEFAULTED[(name, key)] = why
    warn_default(name, key.arch, why)


def warn_default(name: str, arch: str, why: str) -> None:
    if (name, arch) in _WARNED:
        return
    _WARNED.add((name, arch))
    warnings.warn(
        f"kda: helion kernel {name} runs Helion's default configuration on {arch} ({why}); "
        "`python -m kda.bench --tune-kernels helion` measures one",
        stacklevel=5,
    )


PORTABLE_SETTINGS = ("block_sizes", "num_warps", "num_stages", "pid_type", "l2_groupings", "loop_orders")


def choose(name: str, key: ShapeKey, bound: Any) -> Any:
    """The `helion.Config` for kernel `name` bound at `key`: the nearest table entry, else the default."""
    import helion

    config = nearest(name, key)
    if config is not None:
        # Settings listed per memory access or per loop fit only the kernel variant they were tuned on (a
        # flag that adds a store adds an access); the block sizes, warps and stages fit every variant.
        for candidate in (config, {k: v for k, v in config.items() if k in PORTABLE_SETTINGS}):
            try:
                chosen = helion.Config(**candidate)
                bound._normalize_config(chosen)  # raises on a config this specialization cannot take
                bound.to_triton_code(chosen)  # and so does a setting that does not match its accesses
                return chosen
            except Exception as error:
                problem = f"{type(error).__name__}: {error}"
        fall_back(name, key, f"its table entry does not fit: {problem}")
    else:
        width = "16-bit" if key.half else "fp32, w and A_qk as bf16 halves," if key.halves else "fp32"
        fall_back(name, key, f"no table entry at K={key.K}, V={key.V} with {width} intermediates")
    return bound.config_spec.default_config()
