"""The address check of tests/addresses.py: it must catch a stray lane, name the kernel, and let through
what a GPU allows (masked-off lanes anywhere, every element of a view's storage)."""

from __future__ import annotations

import os

import pytest
import torch

triton = pytest.importorskip("triton")
if os.environ.get("TRITON_INTERPRET") != "1" or torch.cuda.is_available():
    pytest.skip("the check runs kernels in Triton's CPU interpreter", allow_module_level=True)

import triton.language as tl  # noqa: E402
from addresses import AddressFault, checked_addresses  # noqa: E402


@triton.jit
def copy_kernel(src, dst, n, extra, MASKED: tl.constexpr, BLOCK: tl.constexpr):
    """dst[i] = src[i + extra] for i < BLOCK (masked: i + extra < n)."""
    offsets = tl.arange(0, BLOCK)
    if MASKED:
        values = tl.load(src + offsets + extra, mask=offsets + extra < n, other=0.0)
    else:
        values = tl.load(src + offsets + extra)
    tl.store(dst + offsets, values)


@triton.jit
def add_kernel(dst, value, n, BLOCK: tl.constexpr):
    offsets = tl.arange(0, BLOCK)
    tl.atomic_add(dst + offsets, value, mask=offsets < n)


@pytest.fixture
def interpreter(monkeypatch):
    monkeypatch.setenv("TRITON_INTERPRET", "1")


def test_a_load_past_the_end_fails_naming_the_kernel_and_the_tensor(interpreter, seed):
    src, dst = torch.randn(16), torch.full((16,), float("nan"))
    with checked_addresses(), pytest.raises(Exception) as caught:
        copy_kernel[(1,)](src, dst, 16, 3, MASKED=False, BLOCK=16)
    message = str(caught.value)  # the interpreter re-raises what a kernel raised as its repr
    assert AddressFault.__name__ in message, message
    assert "copy_kernel" in message and "load of 3 of 16" in message, message
    assert "`src`" in message or "`dst`" in message, message


def test_a_masked_load_and_every_lane_inside_pass(interpreter, seed):
    src, dst = torch.randn(16), torch.full((16,), float("nan"))
    with checked_addresses() as log:
        copy_kernel[(1,)](src, dst, 16, 3, MASKED=True, BLOCK=16)
        copy_kernel[(1,)](src, dst, 16, 0, MASKED=False, BLOCK=16)
    assert log.launches == {"copy_kernel": 2}
    assert log.checked == 16 + 13 + 16 + 16  # both stores whole, the loads' active lanes only
    torch.testing.assert_close(dst, src)


def test_a_view_may_read_its_storage_but_not_past_it(interpreter, seed):
    storage = torch.randn(32)
    view, dst = storage[8:16], torch.empty(16)
    with checked_addresses():
        copy_kernel[(1,)](view, dst, 16, 0, MASKED=False, BLOCK=16)  # the storage's elements 8..23
    torch.testing.assert_close(dst, storage[8:24])
    with checked_addresses(), pytest.raises(Exception, match="copy_kernel: load of 8 of 16"):
        copy_kernel[(1,)](storage[24:], dst, 16, 0, MASKED=False, BLOCK=16)


def test_atomics_are_checked(interpreter, seed):
    dst = torch.zeros(8)
    with checked_addresses():
        add_kernel[(1,)](dst, 1.5, 8, BLOCK=16)
    assert dst.tolist() == [1.5] * 8
    with checked_addresses(), pytest.raises(Exception, match="add_kernel: atomic of 8 of 16"):
        add_kernel[(1,)](dst, 1.5, 16, BLOCK=16)


def test_the_suite_checks_every_kernel_it_runs(interpreter, seed):
    """conftest.py's autouse fixture has the check installed already, inside every test."""
    src, dst = torch.randn(16), torch.empty(16)
    with pytest.raises(Exception, match="copy_kernel"):
        copy_kernel[(1,)](src, dst, 16, 5, MASKED=False, BLOCK=16)
