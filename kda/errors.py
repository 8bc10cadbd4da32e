"""The exceptions `kda` raises: each names what was wrong and why."""

from __future__ import annotations

from typing import Any


class KDAError(Exception):
    """Base class of every error `kda` raises on purpose."""


class KDAInputError(KDAError, ValueError):
    """A call broke a rule of the contract (see docs/design.md).

    Raised before any kernel runs. ``argument`` is the offending argument, ``rule`` the rule it broke
    and ``got`` the value it had, so that programs can react and people can read the message.
    """

    def __init__(self, argument: str, rule: str, got: Any = None, *, more: list[KDAInputError] | None = None):
        self.argument = argument
        self.rule = rule
        self.got = got
        self.more = list(more or [])
        message = f"`{argument}`: {rule}"
        if got is not None:
            message += f"; got {got}"
        for other in self.more:
            message += f"\n  also `{other.argument}`: {other.rule}" + (
                f"; got {other.got}" if other.got is not None else ""
            )
        super().__init__(message)


class BackendSelectionError(KDAError, RuntimeError):
    """No backend in the requested set can serve the call; ``reasons`` maps each backend to why not."""

    def __init__(self, message: str, reasons: dict[str, list[str]]):
        self.reasons = reasons
        lines = [message]
        for name, why in reasons.items():
            lines.append(f"  {name}: " + "; ".join(why))
        super().__init__("\n".join(lines))


class GraphCaptureError(KDAError, RuntimeError):
    """A call inside CUDA-graph capture needed work that capture forbids: verifying a backend on first use
    (which launches, synchronises and allocates freely). Run the call once before capture (a warm-up), or
    run ``python -m kda.verify`` for its case class first."""
