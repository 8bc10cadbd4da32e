"""The dispatcher: which backend runs a call, and why.

For a validated spec it walks the requested backends (all registered ones for ``auto``) and asks each,
in this order, stopping at the first no:

1. **available**: can it run on this machine at all (cached per process);
2. **supports**: does it implement this call;
3. **gradients**: a forward-only backend serves only calls that need no gradient;
4. **verified**: has it passed verification for this case class on this machine (see docs/design.md)?
   With ``KDA_VERIFY=lazy`` (default) a missing record triggers a quick verification, once; ``strict``
   requires a record made by ``python -m kda.verify``; ``off`` trusts every backend, with a warning.
   A record holds measured errors; it passes when they meet the tolerances in force
   (`kda.verify.policy`, ``KDA_TOLERANCE_SCALE``), judged when it is read.

Usable backends are ranked: an explicit list keeps its order; ``auto`` ranks by the timings
`python -m kda.bench --tune` measured on this GPU at the nearest tuned shape (`kda.timings`), and by static
priority (higher first) where there are none. An explicit request that nothing can serve raises `BackendSelectionError` listing every
reason; it never falls back to a backend that was not asked for. ``auto`` fails only when not even the
torch backend can serve the call.

Decisions are cached per (call shape and flags, request, registry state, records state, verify mode),
so the walk above runs once per kind of call, not on every call. The choice is logged once per case
class at INFO on the ``kda`` logger.
"""

from __future__ import annotations

import contextlib
import contextvars
import logging
import threading
import warnings
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from kda import config, registry, timings
from kda.backends.base import Backend, Verdict
from kda.errors import BackendSelectionError, GraphCaptureError, KDAInputError
from kda.recurrent.spec import RecurrentSpec
from kda.spec import KDASpec
from kda.verify.check import verify_class
from kda.verify.records import default_store

logger = logging.getLogger("kda")

Request = str | Sequence[str]
# A call of either op: `chunk_kda` (KDASpec) or the decode op `fused_recurrent_kda` (RecurrentSpec). The op is
# part of the case class key, so records and timings of the two never mix.
AnySpec = KDASpec | RecurrentSpec

_scoped: contextvars.ContextVar[tuple[str, ...] | None] = contextvars.ContextVar("kda_backends", default=None)


@contextlib.contextmanager
def use_backends(*names: str) -> Iterator[None]:
    """Restrict `backend="auto"` calls in this block to these backends, tried in this order.

    Like an explicit ``backend=[...]``: if none of them can serve a call, that call raises with the
    reasons. A call's own explicit ``backend=`` argument still wins over the block.

        with kda.use_backends("triton", "torch"):
            o, _ = kda.chunk_kda(q, k, v, g, beta)
    """
    if len(names) == 1 and not isinstance(names[0], str):
        names = tuple(names[0])  # use_backends(["a", "b"]) also works
    known = {b.name for b in registry.registered_backends()}
    unknown = [n for n in names if n not in known]
    if not names or unknown:
        raise ValueError(
            f"use_backends needs registered backend names; unknown: {unknown or '(none given)'}; "
            f"registered: {', '.join(sorted(known))}"
        )
    token = _scoped.set(tuple(names))
    try:
        yield
    finally:
        _scoped.reset(token)


@dataclass
class Consideration:
    """How one backend fared for one call."""

    backend: str
    checks: dict[str, Verdict] = field(default_factory=dict)  # in the order they were asked
    rank: int | None = None

    @property
    def usable(self) -> bool:
        return bool(self.checks) and all(self.checks.values())

    @property
    def reasons(self) -> list[str]:
        failed = [(name, v) for name, v in self.checks.items() if not v]
        return [f"{name}: {'; '.join(v.reasons)}" for name, v in failed]


@dataclass
class Decision:
    """The outcome of dispatch for one call: what was asked, what each backend said, what was chosen."""

    spec: AnySpec
    requested: tuple[str, ...] | None  # None means auto over every registered backend
    considered: list[Consideration]
    chosen: Backend | None
    verify_mode: str
    ranking: timings.Ranking | None = None  # the measured timings that ordered an auto call, if any
    logged: bool = False

    def reasons(self) -> dict[str, list[str]]:
        return {c.backend: c.reasons for c in self.considered if not c.usable}


def _requested(request: Request) -> tuple[str, ...] | None:
    """The backend names a request stands for (None: every registered one); `KDAInputError` naming
    ``backend`` for anything that is not "auto", a name, or a non-empty list of names."""
    if isinstance(request, str):
        if request == "auto":
            return _scoped.get()
        return (request,)
    names = tuple(request) if isinstance(request, (list, tuple)) else None
    if not names or not all(isinstance(n, str) for n in names):
        raise KDAInputError(
            "backend", "must be 'auto', a backend name, or a non-empty list or tuple of names", repr(request)
        )
    return names


_warned_off = False
_verify_locks: dict[tuple[str, str, str], threading.Lock] = {}
_verify_locks_guard = threading.Lock()


def capturing() -> bool:
    """Is a CUDA graph being captured on the current stream? (False on a build without CUDA.)"""
    try:
        return bool(torch.cuda.is_current_stream_capturing())
    except (RuntimeError, AssertionError):  # torch built without CUDA: nothing can be capturing
        return False


def _refuse_during_capture(backend: Backend, spec: AnySpec) -> None:
    """Lazy verification launches kernels, synchronises and allocates as it goes: none of that may happen
    while a CUDA graph is captured (the capture would fail, or record the verifier's work), so a call
    that would verify there raises instead. Asked only when a record is missing: no cost per call."""
    if capturing():
        raise GraphCaptureError(
            f"kda would verify backend {backend.name!r} for {spec.case_class.key} on first use, inside CUDA-graph "
            "capture, where kernels must not launch, synchronise or allocate outside the graph: run the call "
            "once before capturing (a warm-up), or verify first with `python -m kda.verify`"
        )


def verification_verdict(backend: Backend, spec: AnySpec, mode: str) -> Verdict:
    """Has `backend` passed verification for this call's case class on this device?"""
    global _warned_off
    key = spec.case_class.key
    if mode == "off":
        if not _warned_off:
            _warned_off = True
            warnings.warn("KDA_VERIFY=off: backends are used without verification", RuntimeWarning, stacklevel=4)
        return Verdict.yes("not checked (KDA_VERIFY=off)")
    store = default_store()
    record = store.get(backend, spec.device, key)
    if mode == "strict":
        if record is None or record.source != "verify":
            return Verdict.no(f"no record from `python -m kda.verify` for {key} on this machine (KDA_VERIFY=strict)")
    elif record is None:
        lock_key = (backend.name, str(spec.device), key)
        with _verify_locks_guard:
            lock = _verify_locks.setdefault(lock_key, threading.Lock())
        with lock:
            record = store.get(backend, spec.device, key)
            if record is None:
                _refuse_during_capture(backend, spec)
                logger.info("kda: verifying backend %r for %s on %s (first use)", backend.name, key, spec.device)
                result = _verify_lazily(backend, spec)
                record = result.to_record(source="lazy", quick=True)
                store.put(backend, spec.device, [record])
    judged = record.assessment()  # under the tolerances in force, from the errors the record holds
    if judged.passed:
        how = "by kda.verify" if record.source == "verify" else "on first use"
        return Verdict.yes(
            f"passed {key} {how}; worst error {judged.worst_ratio:.2f} of the tolerance in force"
            f" (KDA_TOLERANCE_SCALE={config.tolerance_scale():g})"
        )
    return Verdict.no(f"failed verification of {key}: {judged.reason}")


def _verify_lazily(backend: Backend, spec: AnySpec) -> Any:
    """Quick verification of the call's case class, for its op."""
    if isinstance(spec, RecurrentSpec):
        from kda.verify.recurrent import verify_recurrent_class

        return verify_recurrent_class(backend, spec.case_class, spec.device, quick=True, like=spec)
    return verify_class(backend, spec.case_class, spec.device, quick=True, like=spec)


def _supports(backend: Backend, spec: AnySpec) -> Verdict:
    if isinstance(spec, RecurrentSpec):
        return backend.supports_recurrent(spec)
    return backend.supports(spec)


def _consider(backend: Backend, spec: AnySpec, mode: str) -> Consideration:
    seen = Consideration(backend.name)
    checks = seen.checks
    checks["available"] = registry.availability(backend)
    if not checks["available"]:
        return seen
    try:
        supports = _supports(backend, spec)
        if not isinstance(supports, Verdict):
            supports = Verdict.no(f"supports() returned {type(supports).__name__}, not a Verdict")
    except KeyboardInterrupt:
        raise
    except BaseException as error:  # sys.exit in a plugin included: a "no", never the caller's end
        supports = Verdict.no(f"supports() raised {type(error).__name__}: {error}")
    checks["supports"] = supports
    if not supports:
        return seen
    if spec.requires_grad and not backend.trains:
        checks["gradients"] = Verdict.no("forward-only, and this call needs gradients")
        return seen
    checks["verified"] = verification_verdict(backend, spec, mode)
    return seen


def decide(spec: AnySpec, request: Request = "auto") -> Decision:
    """Walk the candidates for `spec` and pick one (no exception when none fits: see `select`)."""
    names = _requested(request)
    mode = config.verify_mode()
    if names is None:
        candidates = registry.registered_backends()  # highest priority first
    else:
        candidates = []
        for name in names:
            try:
                candidates.append(registry.get_backend(name))
            except KeyError as error:
                raise BackendSelectionError(str(error.args[0]), {name: ["not registered"]}) from None
    considered = [_consider(b, spec, mode) for b in candidates]
    usable = [(b, seen) for b, seen in zip(candidates, considered) if seen.usable]
    ranking = None
    if names is None and len(usable) > 1:  # auto: measured speed first, then priority
        order, ranking = timings.rank(
            spec, [(b.name, b.version_for(spec.requires_grad), b.priority) for b, _ in usable]
        )
        usable.sort(key=lambda pair: order.index(pair[0].name))
    for rank, (_, seen) in enumerate(usable):
        seen.rank = rank
    chosen = usable[0][0] if usable else None
    return Decision(spec, names, considered, chosen, mode, ranking)


_cache: dict[tuple, Decision] = {}
_cache_lock = threading.Lock()
_logged: set[tuple[str, str, str]] = set()
_CACHE_LIMIT = 4096


def _cache_key(spec: AnySpec, request: Request) -> tuple:
    names = _requested(request)
    store = default_store()
    return (
        spec.routing_key,
        names,
        registry.generation(),
        id(store),
        store.generation,
        config.verify_mode(),
        config.tolerance_scale(),
        timings.stamp(spec.device, store.root) if names is None else None,
    )


def select(spec: AnySpec, request: Request = "auto") -> Backend:
    """The backend that will run `spec`; raises `BackendSelectionError` (with every reason) when none can."""
    key = _cache_key(spec, request)
    decision = _cache.get(key)
    if decision is None:
        decision = decide(spec, request)
        if decision.chosen is not None:  # failures are not cached: the error is what the caller sees
            with _cache_lock:
                if len(_cache) >= _CACHE_LIMIT:
                    _cache.clear()
                _cache[_cache_key(spec, request)] = decision
    if decision.chosen is None:
        what = "auto" if decision.requested is None else ", ".join(decision.requested)
        raise BackendSelectionError(
            f"no backend can serve this call (requested: {what}; {spec.summary()})", decision.reasons()
        )
    chosen = decision.chosen
    if not decision.logged:  # once per decision, and once per (case class, backend, device) in the log
        decision.logged = True
        log_key = (spec.case_class.key, chosen.name, str(spec.device))
        if log_key not in _logged:
            _logged.add(log_key)
            logger.info("kda: %s -> backend %r", spec.summary(), chosen.name)
    return chosen


def clear_cache() -> None:
    """Forget cached decisions (they also expire on any registry or record change)."""
    with _cache_lock:
        _cache.clear()
    _logged.clear()
