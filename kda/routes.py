"""`trace_routes`: which backend ran which phase of each call, for tests and debugging.

Both of kda's entry paths note their runs here: the eager one (`kda.api`) and the custom ops that
`torch.compile` sees (`kda.library`), whose real implementations run outside the compiled graph, so that a
compiled model's calls are traced too.
"""

from __future__ import annotations

import contextlib
import contextvars
from collections.abc import Callable, Iterator
from dataclasses import dataclass

from kda.backends.base import Backend
from kda.spec import KDASpec


@dataclass(frozen=True)
class Route:
    """One backend invocation: which backend ran which phase of which kind of call."""

    backend: str
    phase: str  # "forward" or "backward"
    case_class: str


_routes: contextvars.ContextVar[list[Route] | None] = contextvars.ContextVar("kda_routes", default=None)


@contextlib.contextmanager
def trace_routes() -> Iterator[list[Route]]:
    """Collect a `Route` for every backend forward and backward run inside the block.

    with kda.trace_routes() as routes:
        o, _ = kda.chunk_kda(q, k, v, g, beta)
    assert routes[0].backend == "torch"
    """
    routes: list[Route] = []
    token = _routes.set(routes)
    try:
        yield routes
    finally:
        _routes.reset(token)


# The list the innermost `trace_routes` block collects into, or None outside any (the bound method: one
# lookup on every call, as cheap as reading the variable in place).
current: Callable[[], list[Route] | None] = _routes.get


def note(backend: Backend, phase: str, spec: KDASpec, routes: list[Route] | None) -> None:
    if routes is not None:
        routes.append(Route(backend.name, phase, spec.case_class.key))
