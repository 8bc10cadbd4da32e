"""The triton backend serves the decode op through `recurrent.recurrent_forward` (in Triton's CPU
interpreter here): verified like any backend, chosen when asked, and declining what it does not implement."""

from __future__ import annotations

import importlib

import pytest
import torch

import kda
from kda.backends.triton import TritonBackend
from kda.recurrent.reference import fused_recurrent_reference
from kda.recurrent.spec import RecurrentSpec
from kda.verify import relative_error
from kda.verify.recurrent import recurrent_grid, verify_recurrent_class
from tests.recurrent.helpers import decode_call

pytest.importorskip("triton")


@pytest.fixture
def interpreted(monkeypatch):
    if torch.cuda.is_available():
        pytest.skip("interpreter cases are for the CPU; on a GPU `kda.verify --with-recurrent` runs")
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    from triton.runtime.interpreter import InterpretedFunction

    from kda.backends.triton import gate, recurrent, storage, tiles

    # A module imported while TRITON_INTERPRET was 0 (an earlier test's dispatch imports the backend) holds
    # compiled functions: the kernel and every helper it calls must be interpreted.
    if not all(isinstance(f, InterpretedFunction) for f in (storage.stored, recurrent.recurrent_kernel)):
        for module in (storage, tiles, gate, recurrent):  # helpers first, then the kernel that calls them
            importlib.reload(module)
    assert isinstance(recurrent.recurrent_kernel, InterpretedFunction) and isinstance(
        storage.stored, InterpretedFunction
    )
    kda.registry._reset_for_tests()


@pytest.mark.parametrize("index", [0, 11, 17])  # the typical pool class, per-token slots, no pool
def test_triton_passes_decode_classes(interpreted, index):
    cc = recurrent_grid()[index]
    result = verify_recurrent_class(TritonBackend(), cc, "cpu", quick=True)
    assert result.passed, (cc.key, result.reason)


def test_triton_is_the_route_when_named(interpreted, seed):
    call = decode_call(pool="tokens", pool_dtype=torch.bfloat16, seed=seed)
    ref = fused_recurrent_reference(**call)
    with kda.trace_routes() as routes:
        o, pool = kda.fused_recurrent_kda(**call, backend="triton")
    assert [r.backend for r in routes] == ["triton"] and pool is call["initial_state"]
    assert relative_error(o, ref.o) <= 1e-3


def test_triton_declines_a_read_only_pool_returning_new_states(interpreted):
    spec = RecurrentSpec.from_call(**decode_call(inplace=False), output_final_state=True)
    verdict = TritonBackend().supports_recurrent(spec)
    assert not verdict and "read-only state pool" in verdict.reasons[0]
