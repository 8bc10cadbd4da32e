"""Checks of command-line arguments that ``python -m kda.verify`` and ``python -m kda.bench`` share.

Each check returns what is wrong, in words, or None; the command line then stops before any work with
`usage_error`: one line on stderr, ``<prog>: error: <what>``, and exit status 2, as argparse does for an
unknown flag (without the usage text, so that the error stays one line).
"""

from __future__ import annotations

import math
import os
import sys
from pathlib import Path

import torch

from kda import config
from kda.errors import KDAError


def usage_error(prog: str, problem: str) -> int:
    """Print `problem` as one line on stderr and return the exit status of bad usage (2)."""
    print(f"{prog}: error: {' '.join(problem.split())}", file=sys.stderr)
    return 2


def settings_problem() -> str | None:
    """What is wrong with the environment's settings (``KDA_VERIFY``, ``KDA_TOLERANCE_SCALE``), or None."""
    try:
        config.verify_mode()
        config.tolerance_scale()
    except KDAError as error:
        return str(error)
    return None


def device_problem(text: str) -> str | None:
    """What is wrong with ``--device text``: torch cannot parse it, or the device is not on this machine."""
    try:
        device = torch.device(text)
    except (RuntimeError, ValueError, TypeError) as error:
        return f"--device {text!r}: {error}"
    if device.type == "cuda":
        if not torch.cuda.is_available():
            return f"--device {text}: CUDA is not available on this machine"
        count = torch.cuda.device_count()
        if device.index is not None and device.index >= count:
            return f"--device {text}: this machine has {count} CUDA device(s), cuda:0 to cuda:{count - 1}"
    elif device.type != "cpu":
        is_available = getattr(getattr(torch, device.type, None), "is_available", None)
        if callable(is_available) and not is_available():
            return f"--device {text}: {device.type} is not available on this machine"
    return None


def number_problem(
    option: str, value: float, *, at_least: float | None = None, above: float | None = None
) -> str | None:
    """What is wrong with a number given to `option`: not finite, below `at_least`, or not above `above`.
    (argparse checks only that it parses: ``--jobs 0`` or ``--rep-ms nan`` would otherwise run, clamped
    or failing row by row.)"""
    if not math.isfinite(value):
        return f"{option} {value}: must be a finite number"
    if at_least is not None and value < at_least:
        return f"{option} {value}: must be >= {at_least:g}"
    if above is not None and value <= above:
        return f"{option} {value}: must be > {above:g}"
    return None


def input_file_problem(option: str, path: Path) -> str | None:
    """What is wrong with a file to read: missing, not a regular file, or unreadable."""
    if not path.exists():
        return f"{option} {path}: no such file"
    if not path.is_file():
        return f"{option} {path}: not a regular file"
    if not os.access(path, os.R_OK):
        return f"{option} {path}: cannot be read"
    return None


def output_file_problem(option: str, path: Path) -> str | None:
    """What is wrong with a file to write: a directory, or in a folder that is missing or unwritable."""
    if path.is_dir():
        return f"{option} {path}: is a directory"
    folder = path.parent
    if not folder.is_dir():
        return f"{option} {path}: folder {folder} does not exist"
    if not os.access(folder, os.W_OK | os.X_OK):
        return f"{option} {path}: folder {folder} cannot be written"
    return None


def output_dir_problem(option: str, path: Path) -> str | None:
    """What is wrong with a folder to write into (made if absent): it, or the nearest existing folder
    above it, is not a directory or cannot be written."""
    existing = next(p for p in (path, *path.parents) if p.exists() or p == Path(p.anchor or "."))
    if not existing.is_dir():
        return f"{option} {path}: {existing} is not a directory"
    if not os.access(existing, os.W_OK | os.X_OK):
        return f"{option} {path}: {existing} cannot be written"
    return None
