"""Shared test setup: an isolated record store per test, fresh seeds, and a clean dispatcher."""

from __future__ import annotations

import os
import secrets
import threading

import pytest
import torch

# Triton decides when it is imported whether its own library runs compiled or in its CPU interpreter, so
# on a machine without a GPU the interpreter is switched on here, before anything imports Triton. Each
# test then sees it off (the triton backend unavailable, as on any CPU) unless it asks for it through
# the `interpreter` fixture of tests/backends/triton/test_triton_backend.py.
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

import kda
from kda import dispatch, registry


@pytest.fixture(autouse=True)
def isolated_kda(tmp_path, monkeypatch):
    """Each test gets its own KDA_CACHE_DIR, lazy verification, and a registry with only the built-ins."""
    monkeypatch.setenv("KDA_CACHE_DIR", str(tmp_path / "kda-cache"))
    monkeypatch.setenv("KDA_VERIFY", "lazy")
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    registry._reset_for_tests()
    dispatch.clear_cache()
    yield
    registry._reset_for_tests()
    dispatch.clear_cache()


@pytest.fixture(autouse=True)
def checked_kernel_addresses():
    """Without a GPU every Triton kernel a test runs goes through Triton's interpreter: check that each of
    its loads, stores and atomics stays inside the tensors it was given (`tests/addresses.py`), which on a
    GPU would be a silent overrun or an illegal-address fault naming no kernel."""
    if torch.cuda.is_available():
        yield
        return
    try:
        import triton.runtime.interpreter  # noqa: F401
    except ImportError:  # no Triton: no kernel can run
        yield
        return
    from addresses import checked_addresses

    with checked_addresses() as log:
        yield log


@pytest.fixture
def seed(request) -> int:
    """A fresh seed per test run (never one fixed seed); KDA_TEST_SEED reproduces a failure."""
    value = int(os.environ.get("KDA_TEST_SEED", secrets.randbits(31)))
    torch.manual_seed(value)
    print(f"seed={value} (rerun with KDA_TEST_SEED={value})")
    return value


def pytest_collection_modifyitems(config, items):
    """Tests marked `gpu` skip, with the reason, where no CUDA GPU is visible."""
    if torch.cuda.is_available():
        return
    needs_gpu = pytest.mark.skip(reason="needs a CUDA GPU")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(needs_gpu)


def pytest_report_header(config):
    return f"kda {kda.__version__}, torch {torch.__version__}"


@pytest.fixture(autouse=True)
def one_torch_thread():
    """Tiny shapes gain nothing from threads, and on a busy 2-core machine OpenMP spinning makes every
    call many times slower; restore the caller's setting afterwards."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@pytest.fixture
def returns_within():
    """``returns_within(fn, seconds, unblock=None)``: run `fn` in a thread and return what it returns; when
    it has not returned after `seconds`, call `unblock` (to free the thread) a while, and fail, so that a
    call that hangs fails its test instead of hanging the suite."""

    def run(fn, seconds: float = 30.0, unblock=None):
        outcome: dict = {}

        def target():
            try:
                outcome["value"] = fn()
            except BaseException as error:  # re-raised in the test's thread
                outcome["error"] = error

        thread = threading.Thread(target=target, daemon=True)
        thread.start()
        thread.join(seconds)
        if thread.is_alive():
            for _ in range(100):  # free the thread (it may block more than once), so that it holds no lock
                if unblock is not None:
                    unblock()
                thread.join(0.1)
            pytest.fail(f"did not return within {seconds:g} s")
        if "error" in outcome:
            raise outcome["error"]
        return outcome["value"]

    return run
