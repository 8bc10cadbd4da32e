"""A lowered TileLang kernel built with this machine's nvcc for sm_90a, and ptxas's report of it."""

from __future__ import annotations

import os
import re
import subprocess
from pathlib import Path

import pytest


def ptxas_report(source: str, folder: Path, name: str) -> str:
    """Build `source` (a kernel lowered for sm_90a) as ``folder/name.o`` with TileLang's headers and ``-Xptxas
    -v``, and return what ptxas printed (registers, spills); skips the test where the machine has no nvcc."""
    import tilelang

    from kda.backends.tilelang import runtime

    nvcc = runtime.find_nvcc()
    if nvcc is None:
        pytest.skip("no nvcc on this machine")
    root = os.path.dirname(tilelang.__file__)
    path = folder / f"{name}.cu"
    path.write_text(source)
    done = subprocess.run(
        [nvcc, "-gencode=arch=compute_90a,code=sm_90a", "-std=c++17", "-O3",
         f"-I{os.path.join(root, 'src')}", f"-I{os.path.join(root, '3rdparty', 'cutlass', 'include')}",
         "-DENABLE_BF16", "-w", "-Xptxas", "-v", "-c", str(path), "-o", str(folder / f"{name}.o")],
        capture_output=True, text=True, timeout=900,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr[-2000:]
    return done.stderr


def registers(report: str) -> int:
    """The registers a thread of the (last) kernel in a ptxas report."""
    found = re.findall(r"Used (\d+) registers", report)
    assert found, report[-2000:]
    return int(found[-1])
