"""Verification records: which backend passed which case class, on what exactly.

A record is kept per (backend, case class) under a *fingerprint* of everything that can change the
numbers: backend name and version (plus its own extras), kda version, the versions of torch, triton,
helion, tilelang, flash_kda and fla, and the device (GPU name and compute capability, or the CPU). A new
fingerprint has no records, so after any upgrade every backend starts unverified.

A backend's training classes are kept under its `version`, its inference and decode classes under
`Backend.version_for(training=False)`: where a change moved the backward alone (`Backend.forward_version`),
the inference classes' fingerprint is the earlier version's, and their records stand.

Storage: one JSON file per (backend, fingerprint) under ``<KDA_CACHE_DIR>/verification/``. Writers take
an exclusive lock on a side file, re-read, merge and replace the file atomically, so concurrent
processes never lose or corrupt each other's records (the lock, the atomic write and the tolerant read
are `kda.store`'s). A file that cannot be read or parsed (or is no regular file) counts as no records at
all: it never breaks a call, and the next write replaces it. A write that fails (an unwritable cache)
keeps the records in memory for the process, with one warning.
"""

from __future__ import annotations

import hashlib
import json
import threading
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Literal

import torch

from kda import store as disk
from kda._version import __version__
from kda.backends.base import Backend
from kda.case_class import trains
from kda.store import TRACKED_PACKAGES, device_identity, package_versions
from kda.verify.judge import assess
from kda.verify.policy import Assessment

__all__ = [
    "RECORD_FORMAT",
    "TRACKED_PACKAGES",
    "Record",
    "RecordStore",
    "default_store",
    "device_identity",
    "fingerprint",
    "fingerprint_id",
    "package_versions",
]

Source = Literal["verify", "lazy"]


def fingerprint(backend: Backend, device: torch.device | str, *, training: bool = True) -> dict[str, Any]:
    """What `backend`'s records of training classes (`training`) or of inference and decode classes are
    kept under on `device`. The two are one where the backend has no `forward_version` of its own."""
    return {
        "backend": backend.name,
        "backend_version": backend.version_for(training),
        "backend_extras": dict(sorted(backend.fingerprint_extras().items())),
        "kda": __version__,
        "packages": package_versions(),
        **device_identity(device),
    }


def fingerprint_id(fp: dict[str, Any]) -> str:
    return hashlib.sha256(json.dumps(fp, sort_keys=True).encode()).hexdigest()[:16]


# Bumped whenever what a record holds changes meaning; a record of another format counts as absent.
# 3: every chunk class holds a correlated case (`kda.verify.cases`); a record made before it is verified again.
RECORD_FORMAT = 3


@dataclass
class Record:
    """What verifying one backend on one case class measured: each case's sizes, seed and per-tensor
    errors. Whether that passes is decided when the record is read, under the tolerances in force
    (`kda.verify.judge.assess`), never taken from the file's word."""

    case_class: str
    source: Source  # "verify" (the CLI) or "lazy" (the dispatcher, on first use)
    quick: bool
    device_type: str  # torch's device type ("cuda", "cpu"): on CUDA the policy also asks for the long case
    cases: list[dict[str, Any]] = field(default_factory=list)  # per concrete case: seed, sizes, errors
    when: float = field(default_factory=time.time)
    format: int = RECORD_FORMAT

    def assessment(self) -> Assessment:
        """The record judged under the policy in force (re-read each time: the scale can change)."""
        return assess(self.case_class, self.cases, on_cuda=self.device_type == "cuda")

    @property
    def passed(self) -> bool:
        return self.assessment().passed

    @property
    def worst_ratio(self) -> float:
        return self.assessment().worst_ratio

    @property
    def reason(self) -> str | None:
        return self.assessment().reason

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> Record:
        """Parse one stored record; raises ValueError on anything malformed (the caller then treats the
        record as absent: a hand-edited or foreign file must never make a backend count as verified)."""
        if not isinstance(data, dict) or data.get("format") != RECORD_FORMAT:
            raise ValueError("not a verification record of this format")
        record = cls(**{k: data[k] for k in cls.__dataclass_fields__ if k in data})
        if not (
            isinstance(record.case_class, str)
            and type(record.quick) is bool
            and record.source in ("verify", "lazy")
            and isinstance(record.device_type, str)
            and isinstance(record.cases, list)
            and all(isinstance(case, dict) for case in record.cases)
            and isinstance(record.when, (int, float))
        ):
            raise ValueError(f"malformed verification record: {data!r}")
        return record

    def as_json(self) -> dict[str, Any]:
        return asdict(self)


class RecordStore:
    """Records under one directory; `kda.verify.records.default_store()` uses ``KDA_CACHE_DIR``."""

    def __init__(self, root: Path):
        self.root = Path(root)
        self._memo: dict[Path, tuple[int, dict[str, Record]]] = {}
        self._paths: dict[tuple, Path] = {}
        self._expected: dict[Path, Any] = {}  # path -> the fingerprint its file must hold, as JSON reads it
        self._unsaved: dict[Path, dict[str, Record]] = {}  # records a failed write kept in memory
        self._lock = threading.Lock()
        self.generation = 0  # bumped on every write by this process

    def path_for(self, backend: Backend, device: torch.device | str, *, training: bool = True) -> Path:
        """The file of `backend`'s training classes (`training`) or of its inference and decode classes."""
        # Memoised on what the fingerprint is made of (not on object identity), so a backend whose
        # version or extras change gets a new file.
        extras = tuple(sorted((str(k), str(v)) for k, v in backend.fingerprint_extras().items()))
        memo_key = (backend.name, backend.version_for(training), extras, str(device))
        path = self._paths.get(memo_key)
        if path is None:
            fp = fingerprint(backend, device, training=training)
            safe_name = "".join(c if c.isalnum() or c in "-_." else "_" for c in backend.name)
            path = self._paths[memo_key] = self.root / "verification" / f"{safe_name}-{fingerprint_id(fp)}.json"
            self._expected[path] = json.loads(json.dumps(fp, default=_json_default))
        return path

    def load(self, backend: Backend, device: torch.device | str) -> dict[str, Record]:
        """Every record of `backend` on `device` that its versions stand behind: the training classes' from
        the file of its `version`, the others' from the file of its forward version (a file that both
        share holds both; where they differ, a training record in the forward's file is an earlier
        backward's, and is not this backend's)."""
        training = self._read(self.path_for(backend, device, training=True))
        forward_path = self.path_for(backend, device, training=False)
        if forward_path == self.path_for(backend, device, training=True):
            return training
        found = {key: r for key, r in self._read(forward_path).items() if not trains(key)}
        found.update((key, r) for key, r in training.items() if trains(key))
        return found

    def get(self, backend: Backend, device: torch.device | str, case_key: str) -> Record | None:
        return self._read(self.path_for(backend, device, training=trains(case_key))).get(case_key)

    def put(self, backend: Backend, device: torch.device | str, records: list[Record]) -> None:
        """Store `records` (merged with those on disk), each in the file of its class's kind (`path_for`).
        When a file cannot be written (an unwritable cache, a directory or FIFO in the way), its records
        are kept in memory for this process instead, with one warning: the caller goes on, and does not
        verify the same class again."""
        by_file: dict[Path, tuple[bool, list[Record]]] = {}  # one write a file, where both kinds share one
        for record in records:
            training = trains(record.case_class)
            by_file.setdefault(self.path_for(backend, device, training=training), (training, []))[1].append(record)
        for training, mine in by_file.values():
            self._put(backend, device, mine, training)

    def _put(self, backend: Backend, device: torch.device | str, records: list[Record], training: bool) -> None:
        path = self.path_for(backend, device, training=training)
        with self._lock:
            try:
                path.parent.mkdir(parents=True, exist_ok=True)
                with disk.file_lock(path.with_suffix(".lock")):
                    current = self._read(path, use_memo=False)
                    for record in records:
                        current[record.case_class] = record
                    payload = {
                        "fingerprint": fingerprint(backend, device, training=training),
                        "records": {key: rec.as_json() for key, rec in sorted(current.items())},
                    }
                    disk.write_json_atomic(path, payload, default=_json_default)
                self._unsaved.pop(path, None)  # written, with any kept in memory before
            except OSError as error:
                self._unsaved[path] = {**self._unsaved.get(path, {}), **{r.case_class: r for r in records}}
                disk.warn_unsaved("verification records", path, error)
            self._memo.pop(path, None)
            self.generation += 1

    def unsaved(self) -> list[Path]:
        """The record files whose records this process keeps in memory only (their writes failed)."""
        return sorted(self._unsaved)

    def _read(self, path: Path, use_memo: bool = True) -> dict[str, Record]:
        records = self._read_file(path, use_memo)
        unsaved = self._unsaved.get(path)
        if unsaved:
            records.update(unsaved)  # this process's newer records, which the file could not take
        return records

    def _read_file(self, path: Path, use_memo: bool) -> dict[str, Record]:
        try:
            stamp = path.stat().st_mtime_ns
        except OSError:
            return {}
        if use_memo:
            memo = self._memo.get(path)
            if memo is not None and memo[0] == stamp:
                return dict(memo[1])
        stored = disk.read_json(path)
        try:
            # A file whose fingerprint is not the one its name stands for was not written by kda for this
            # backend here (copied, hand-edited or foreign): it holds no records.
            if stored["fingerprint"] != self._expected.get(path):
                raise KeyError("fingerprint")
            entries = stored["records"].items()
        except (KeyError, TypeError, AttributeError):
            entries = []  # corrupt or foreign: no records, never a crash
        records = {}
        for key, value in entries:
            try:
                record = Record.from_json(value)
            except (ValueError, KeyError, TypeError, AttributeError):
                continue  # one malformed record is absent; the others stand
            if record.case_class == key:
                records[key] = record
        self._memo[path] = (stamp, records)
        return dict(records)


def _json_default(value: Any) -> Any:
    return str(value)


_stores: dict[Path, RecordStore] = {}


def default_store() -> RecordStore:
    """The store under the current ``KDA_CACHE_DIR`` (re-read each call, so the variable can change)."""
    root = disk.cache_root()
    store = _stores.get(root)
    if store is None:
        store = _stores[root] = RecordStore(root)
    return store
