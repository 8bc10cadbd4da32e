"""What the tilelang tests share: the skip of GPU tests where the backend cannot run."""

from __future__ import annotations

import pytest


@pytest.fixture
def hopper() -> None:
    """Skips the test, with the backend's own reason, where the tilelang backend cannot run here (no
    tilelang, no Hopper GPU, no usable nvcc); the ``gpu`` mark already skips it on a machine without CUDA."""
    pytest.importorskip("tilelang", reason="TileLang is not installed (extra `tilelang`)")
    import kda

    verdict = kda.get_backend("tilelang").available()
    if not verdict:
        pytest.skip(str(verdict))
