"""The registry of backends: the built-in ones, entry points, and any the user registers.

Third-party packages add backends through the ``kda.backends`` entry-point group::

    [project.entry-points."kda.backends"]
    mykernels = "mypkg.kda_backend:MyBackend"

Entry points are loaded once, on the first look at the registry. One that fails to load does not break
`kda`: it shows up as a backend that is unavailable, with the import error as its reason. That holds
for any exception, SystemExit (a plugin that calls ``sys.exit``) and other BaseExceptions included; only
KeyboardInterrupt goes through, since it is the user's.
"""

from __future__ import annotations

import importlib.metadata
import logging
import threading
from typing import TypeVar

from kda.backends.base import Backend, ForwardResult, KDAInputs, KDAOutputs, Verdict
from kda.spec import KDASpec

logger = logging.getLogger("kda")

ENTRY_POINT_GROUP = "kda.backends"

_lock = threading.RLock()
_backends: dict[str, Backend] = {}
_availability: dict[str, Verdict] = {}
_loaded_defaults = False
_generation = 0  # bumped on every change, so that cached dispatch decisions expire

B = TypeVar("B", bound=type[Backend])


class _BrokenEntryPoint(Backend):
    """Stands for an entry point that failed to load, so that the failure is reported, not hidden."""

    version = "0"
    priority = -1000

    def __init__(self, name: str, error: BaseException):
        self.name = name  # type: ignore[misc]
        self.error = f"{type(error).__name__}: {error}"

    def available(self) -> Verdict:
        return Verdict.no(f"entry point failed to load: {self.error}")

    def supports(self, spec: KDASpec) -> Verdict:
        return Verdict.no(f"entry point failed to load: {self.error}")

    def forward(  # pragma: no cover - never dispatched
        self, inputs: KDAInputs, spec: KDASpec, out: KDAOutputs | None = None
    ) -> ForwardResult:
        raise RuntimeError(self.error)


def _ensure_defaults() -> None:
    global _loaded_defaults
    with _lock:
        if _loaded_defaults:
            return
        _loaded_defaults = True
        from kda.backends.fla import FLABackend
        from kda.backends.flashkda import FlashKDABackend
        from kda.backends.helion import HelionBackend
        from kda.backends.tilelang import TileLangBackend
        from kda.backends.torch import TorchBackend
        from kda.backends.triton import TritonBackend

        builtins = (
            TorchBackend(),
            TritonBackend(),
            HelionBackend(),
            TileLangBackend(),
            FLABackend(),
            FlashKDABackend(),
        )
        for builtin in builtins:
            _add(builtin, replace=False)
        for entry in importlib.metadata.entry_points(group=ENTRY_POINT_GROUP):
            try:
                loaded = entry.load()
                backend = loaded() if isinstance(loaded, type) else loaded
                if not isinstance(backend, Backend):
                    raise TypeError(f"{entry.value} is not a kda Backend class or instance")
                if getattr(backend, "name", None) in _backends:
                    raise ValueError(f"{entry.value} takes the name {backend.name!r} of a registered backend")
                _add(backend, replace=False)
            except KeyboardInterrupt:
                raise
            except BaseException as error:  # a broken plugin (even one that exits) must not break kda: reported
                logger.warning("kda: backend entry point %r failed to load: %s", entry.name, error)
                stand_in = entry.name if entry.name not in _backends else f"{entry.name} (entry point)"
                if stand_in not in _backends:
                    _add(_BrokenEntryPoint(stand_in, error), replace=False)


def _add(backend: Backend, *, replace: bool) -> None:
    global _generation
    name = getattr(backend, "name", None)
    if not isinstance(name, str) or not name or name == "auto":
        raise ValueError(
            f"a backend needs a class attribute `name` (a non-empty string other than 'auto'); got {name!r}"
        )
    forward = getattr(backend, "forward_version", None)
    if forward is not None and (isinstance(forward, bool) or not isinstance(forward, (str, int)) or str(forward) == ""):
        raise ValueError(
            f"backend {name!r}: `forward_version` is None or the version its inference calls run (a non-empty "
            f"string); got {forward!r}"
        )
    if name in _backends and not replace:
        raise ValueError(f"a backend named {name!r} is already registered ({_backends[name]!r}); pass replace=True")
    _backends[name] = backend
    _availability.pop(name, None)
    _generation += 1


def register_backend(backend: type[Backend] | Backend, *, replace: bool = False) -> type[Backend] | Backend:
    """Register a backend class (instantiated with no arguments) or instance; returns what it was given,
    so that it also works as a class decorator. Raises if the name is taken, unless ``replace=True``."""
    _ensure_defaults()
    instance = backend() if isinstance(backend, type) else backend
    if not isinstance(instance, Backend):
        raise TypeError(f"expected a kda.Backend subclass or instance, got {backend!r}")
    with _lock:
        _add(instance, replace=replace)
    return backend


def unregister_backend(name: str) -> None:
    """Remove a backend by name (KeyError when there is none)."""
    global _generation
    _ensure_defaults()
    with _lock:
        del _backends[name]
        _availability.pop(name, None)
        _generation += 1


def get_backend(name: str) -> Backend:
    _ensure_defaults()
    try:
        return _backends[name]
    except KeyError:
        raise KeyError(f"no backend named {name!r}; registered: {', '.join(sorted(_backends))}") from None


def registered_backends() -> list[Backend]:
    """Every registered backend, available or not, highest static priority first."""
    _ensure_defaults()
    with _lock:
        return sorted(_backends.values(), key=lambda b: (-b.priority, b.name))


def availability(backend: Backend) -> Verdict:
    """`backend.available()`, computed once per registration (imports can be slow); an exception inside
    `available()` (SystemExit too; KeyboardInterrupt propagates) counts as unavailable, with the exception
    as the reason."""
    with _lock:
        cached = _availability.get(backend.name)
        if cached is not None and _backends.get(backend.name) is backend:
            return cached
    try:
        verdict = backend.available()
        if not isinstance(verdict, Verdict):
            verdict = Verdict.no(f"available() returned {type(verdict).__name__}, not a Verdict")
    except KeyboardInterrupt:
        raise
    except BaseException as error:  # sys.exit in a plugin included: a "no", never the caller's end
        verdict = Verdict.no(f"available() raised {type(error).__name__}: {error}")
    with _lock:
        if _backends.get(backend.name) is backend:
            _availability[backend.name] = verdict
    return verdict


def available_backends() -> list[str]:
    """Names of the registered backends that can run on this machine, highest priority first."""
    return [b.name for b in registered_backends() if availability(b)]


def generation() -> int:
    return _generation


def _reset_for_tests() -> None:
    """Forget every registration (tests only)."""
    global _loaded_defaults, _generation
    with _lock:
        _backends.clear()
        _availability.clear()
        _loaded_defaults = False
        _generation += 1
