"""Measured timings that rank verified backends for `auto` (see docs/design.md).

`python -m kda.bench --tune` times every verified backend at each bench shape and stores the medians
here, per GPU, beside the verification records (``<KDA_CACHE_DIR>/timings/<gpu>.json``). The dispatcher
then orders the usable backends of an ``auto`` call by the timings measured at the *nearest* tuned shape:

- a shape is a point: whether gradients are needed, the gate mode, the dtype, K and V, varlen or not,
  and three sizes: tokens (B*T), value heads (HV) and the mean sequence length (T, or T/N with varlen);
- calls and points must agree on gradients, dtype and the head-dimension buckets of K and V; the
  distance is then ``|log2 tokens ratio| + |log2 heads ratio| + |log2 length ratio|`` plus 0.5 each when
  the gate mode or varlen differ; the nearest point within distance 3 decides, else no timing does;
- at that point, measured backends come first, fastest first; any usable backend without a measurement
  there follows, by static priority. Without a table, or far from every point, static priority decides.

A table records the kda, torch, triton, fla and flash_kda versions and the GPU it was measured with; one
made under other versions is ignored (re-run ``--tune``). A timing for a backend whose version has since
changed is ignored too. An unreadable or malformed table (or no regular file) counts as no table: it
never breaks a call. A table that cannot be written (an unwritable cache) is kept in memory for the
process, with one warning.
"""

from __future__ import annotations

import functools
import itertools
import math
import threading
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import torch

from kda import store as disk
from kda._version import __version__
from kda.recurrent.spec import RecurrentSpec
from kda.spec import KDASpec, head_dim_bucket

MAX_DISTANCE = 3.0
_SOFT_PENALTY = 0.5
# Versions that change what a timing means; a table made under other ones is stale.
_TIMING_PACKAGES = ("torch", "triton", "fla", "flash_kda")


@dataclass(frozen=True)
class ShapePoint:
    """Where a timing was measured (or where a call sits), in the terms the ranking compares."""

    training: bool
    gate: str
    dtype: str
    K: int
    V: int
    varlen: bool
    tokens: int
    heads: int
    mean_len: float
    op: str = "chunk_kda"  # or "fused_recurrent_kda": timings of one op never rank the other's backends
    pool: str = "none"  # the decode op's state pool kind and dtype, e.g. "slots:bfloat16"

    @classmethod
    def of(cls, spec: KDASpec | RecurrentSpec) -> ShapePoint:
        tokens = spec.B * spec.T
        extra = {}
        if isinstance(spec, RecurrentSpec):
            extra = {
                "op": spec.op,
                "pool": f"{spec.pool_kind}:{spec.initial_state.dtype if spec.initial_state else '-'}",
            }
        return cls(
            training=spec.requires_grad,
            gate=spec.gate_mode.value,
            dtype=spec.q.dtype,
            K=spec.K,
            V=spec.V,
            varlen=spec.is_varlen,
            tokens=tokens,
            heads=spec.HV,
            mean_len=tokens / max(1, spec.num_seqs),
            **extra,
        )

    def distance(self, other: ShapePoint) -> float:
        """How far apart two shapes are for ranking purposes; inf when they cannot be compared."""
        if (self.training, self.dtype, self.op, self.pool) != (other.training, other.dtype, other.op, other.pool):
            return math.inf
        if (head_dim_bucket(self.K), head_dim_bucket(self.V)) != (head_dim_bucket(other.K), head_dim_bucket(other.V)):
            return math.inf

        def log_ratio(a: float, b: float) -> float:
            return abs(math.log2(max(a, 1.0) / max(b, 1.0)))

        d = (
            log_ratio(self.tokens, other.tokens)
            + log_ratio(self.heads, other.heads)
            + log_ratio(self.mean_len, other.mean_len)
        )
        d += _SOFT_PENALTY * ((self.gate != other.gate) + (self.varlen != other.varlen))
        return d


@dataclass
class Measurement:
    ms: float
    backend_version: str


@dataclass
class TimingEntry:
    """The medians measured at one bench shape."""

    shape: str  # the bench's name for it, e.g. "B1_T8192_H96_D128 / fwd"
    point: ShapePoint
    timings: dict[str, Measurement] = field(default_factory=dict)

    def as_json(self) -> dict[str, Any]:
        return {
            "shape": self.shape,
            "point": asdict(self.point),
            "timings": {name: asdict(m) for name, m in self.timings.items()},
        }

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> TimingEntry:
        point = ShapePoint(**data["point"])
        timings = {}
        for name, m in data["timings"].items():
            measurement = Measurement(float(m["ms"]), str(m["backend_version"]))
            if not (isinstance(name, str) and math.isfinite(measurement.ms) and measurement.ms > 0):
                raise ValueError(f"bad timing for {name!r}: {m!r}")
            timings[name] = measurement
        if not isinstance(data["shape"], str):
            raise ValueError("bad shape name")
        return cls(data["shape"], point, timings)


@dataclass
class Ranking:
    """What the table said for one call: the entry used, its distance, and the timings (ms) in it."""

    shape: str
    distance: float
    timings: dict[str, float]

    def describe(self) -> str:
        shown = ", ".join(f"{name} {ms:.3g} ms" for name, ms in sorted(self.timings.items(), key=lambda kv: kv[1]))
        near = "measured at this shape" if self.distance == 0 else f"nearest tuned shape, distance {self.distance:.2f}"
        return f"ranked by timings at {self.shape} ({near}): {shown}"


def device_key(device: torch.device) -> dict[str, str | None]:
    return disk.device_identity(device)


def table_fingerprint(device: torch.device) -> dict[str, Any]:
    versions = disk.package_versions()
    return {"kda": __version__, **device_key(device), "packages": {p: versions.get(p) for p in _TIMING_PACKAGES}}


class TimingTable:
    """The tuned timings for one device, read from and written to one JSON file."""

    def __init__(self, path: Path, fingerprint: dict[str, Any], entries: list[TimingEntry] | None = None):
        self.path = path
        self.fingerprint = fingerprint
        self.entries = entries or []

    def nearest(self, point: ShapePoint) -> tuple[TimingEntry, float] | None:
        best: tuple[TimingEntry, float] | None = None
        for entry in self.entries:
            d = point.distance(entry.point)
            if d <= MAX_DISTANCE and (best is None or d < best[1]):
                best = (entry, d)
        return best

    def record(self, shape: str, point: ShapePoint, timings: dict[str, Measurement]) -> None:
        """Set the timings measured at `point` (replacing any earlier measurement of the same backends)."""
        for entry in self.entries:
            if entry.point == point:
                entry.timings.update(timings)
                entry.shape = shape
                return
        self.entries.append(TimingEntry(shape, point, dict(timings)))

    def as_json(self) -> dict[str, Any]:
        return {"fingerprint": self.fingerprint, "entries": [e.as_json() for e in self.entries]}


def _path_for(device: torch.device) -> Path:
    return _path_in(disk.cache_root(), str(device))


@functools.lru_cache(maxsize=64)
def _path_in(root: Path, device: str) -> Path:
    # Memoised: asking CUDA for the device name costs ~100 us, and `auto` looks the path up on every call.
    ident = device_key(torch.device(device))
    name = "".join(c if c.isalnum() else "_" for c in f"{ident['device']}_{ident['capability']}")
    return root / "timings" / f"{name}.json"


def _parse(path: Path, expected: dict[str, Any]) -> TimingTable | None:
    data = disk.read_json(path)
    try:
        if data["fingerprint"] != expected:
            return None  # made with other versions or on another GPU: stale
        entries = [TimingEntry.from_json(e) for e in data["entries"]]
    except (ValueError, KeyError, TypeError, AttributeError):
        return None
    return TimingTable(path, expected, entries)


_memo: dict[Path, tuple[int, TimingTable | None]] = {}
_memo_lock = threading.Lock()
# Tables that `record` could not write (an unwritable cache), kept for this process, with a stamp each.
_unsaved: dict[Path, tuple[int, TimingTable]] = {}
_unsaved_stamps = itertools.count(1)


def load(device: torch.device | str) -> TimingTable | None:
    """The current, valid table for `device`, or None (no file, stale, or unreadable). Re-read only
    when the file changes."""
    device = torch.device(device)
    if device.type == "cuda" and device.index is None:
        device = torch.device("cuda", torch.cuda.current_device())
    path = _path_for(device)
    kept = _unsaved.get(path)
    if kept is not None:
        return kept[1]
    try:
        stamp = path.stat().st_mtime_ns
    except OSError:
        return None
    with _memo_lock:
        memo = _memo.get(path)
        if memo is not None and memo[0] == stamp:
            return memo[1]
    table = _parse(path, table_fingerprint(device))
    with _memo_lock:
        _memo[path] = (stamp, table)
    return table


def stamp(device: torch.device | str, root: Path | None = None) -> int | None:
    """Changes whenever the table for `device` changes (part of the dispatcher's cache key). `root`: the
    cache directory when the caller has just read it (`auto` does on every call; reading the environment
    again costs a few microseconds)."""
    path = _path_in(root if root is not None else disk.cache_root(), str(device))
    if _unsaved:
        kept = _unsaved.get(path)
        if kept is not None:
            return -kept[0]  # never an mtime
    try:
        return path.stat().st_mtime_ns
    except OSError:
        return None


def record(device: torch.device | str, shape: str, point: ShapePoint, timings: dict[str, Measurement]) -> Path:
    """Merge timings measured at one shape into the table for `device` (made fresh if stale or absent).
    Safe against concurrent writers (lock file, re-read, atomic replace). When the table cannot be written
    (an unwritable cache), it is kept in memory for this process, where `load` and `auto` use it, with
    one warning."""
    device = torch.device(device)
    if device.type == "cuda" and device.index is None:
        device = torch.device("cuda", torch.cuda.current_device())
    path = _path_for(device)
    expected = table_fingerprint(device)
    with _memo_lock:
        kept = _unsaved.get(path)
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        with disk.file_lock(path.with_suffix(".lock")):
            table = _parse(path, expected) or TimingTable(path, expected)
            for entry in kept[1].entries if kept is not None else []:  # measured here, not saved before
                table.record(entry.shape, entry.point, entry.timings)
            table.record(shape, point, timings)
            disk.write_json_atomic(path, table.as_json())
        with _memo_lock:
            _unsaved.pop(path, None)
    except OSError as error:
        table = kept[1] if kept is not None else _parse(path, expected) or TimingTable(path, expected)
        table.record(shape, point, timings)
        with _memo_lock:
            _unsaved[path] = (next(_unsaved_stamps), table)
        disk.warn_unsaved("timing table", path, error)
    return path


def rank(spec: KDASpec | RecurrentSpec, usable: list[tuple[str, str, int]]) -> tuple[list[str], Ranking | None]:
    """Order usable backends ``(name, version, priority)`` for an auto call. Priority gives the places; the
    backends measured at the nearest tuned shape swap among their own places, fastest first, and an
    unmeasured backend keeps its place: a measurement compares only what it measured, so a backend timed
    alone never passes an untimed one of higher priority. Returns the order and what the table said."""
    by_priority = [name for name, _, _ in sorted(usable, key=lambda u: -u[2])]
    table = load(spec.device)
    if table is None:
        return by_priority, None
    found = table.nearest(ShapePoint.of(spec))
    if found is None:
        return by_priority, None
    entry, distance = found
    versions = {name: version for name, version, _ in usable}
    timed = {
        name: m.ms for name, m in entry.timings.items() if name in versions and m.backend_version == versions[name]
    }
    if not timed:
        return by_priority, None
    fastest_first = iter(sorted(timed, key=timed.__getitem__))
    order = [next(fastest_first) if name in timed else name for name in by_priority]
    return order, Ranking(entry.shape, distance, timed)
