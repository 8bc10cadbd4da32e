"""Outputs are poisoned before verification, so an element a backend never writes fails it.

On the CPU this is proven through `writes_into_outputs` buffers; on CUDA also through the caching
allocator (a backend that returns `torch.empty` memory it never wrote). The CUDA tests skip on a CPU.
"""

from __future__ import annotations

import pytest
import torch

import kda
from kda.backends.torch import TorchBackend
from kda.spec import CaseClass, GateMode
from kda.verify import verify_class

CASE = CaseClass(
    gate=GateMode.SAFE,
    qk_l2norm=True,
    beta="sigmoid",
    dtype="bfloat16",
    varlen=False,
    gva=False,
    initial_state=True,
    final_state=True,
    state_v_first=False,
    chunk_size=64,
    head_dim=64,
    training=False,
)


class SkipsLastTokenIntoBuffer(TorchBackend):
    """Correct everywhere except that it never writes the last token of the output buffer it was given."""

    name = "skips-last-token"

    def forward(self, inputs, spec, out=None):
        result = super().forward(inputs, spec)
        if out is not None:
            out.o[:, :-1].copy_(result.o[:, :-1])
            if out.final_state is not None:
                out.final_state.copy_(result.final_state)
            return kda.ForwardResult(out.o, out.final_state)
        return result


class ReturnsUnwrittenMemory(TorchBackend):
    """Computes the right values, then hands back a fresh `torch.empty` output with only the first head filled."""

    name = "unwritten-memory"
    writes_into_outputs = False

    def forward(self, inputs, spec, out=None):
        result = super().forward(inputs, spec)
        o = torch.empty_like(result.o)
        o[:, :, :1].copy_(result.o[:, :, :1])
        return kda.ForwardResult(o, result.final_state)


def test_unwritten_buffer_element_fails_verification():
    result = verify_class(SkipsLastTokenIntoBuffer(), CASE, "cpu", quick=True)
    assert not result.passed
    assert "o rel. error inf" in result.reason


def test_the_same_backend_writing_everything_passes():
    result = verify_class(TorchBackend(), CASE, "cpu", quick=True)
    assert result.passed, result.reason


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU: allocator poisoning is CUDA-only")
def test_unwritten_cuda_memory_fails_verification():
    result = verify_class(ReturnsUnwrittenMemory(), CASE, "cuda", quick=True)
    assert not result.passed
    assert "o rel. error" in result.reason  # inf when the poisoned block came back, else just large


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("training", [False, True])
def test_torch_backend_verifies_on_cuda(training):
    cc = CASE.model_copy(update={"training": training, "varlen": True, "gva": True})
    result = verify_class(TorchBackend(), cc, "cuda", quick=False)
    assert result.passed, result.reason
