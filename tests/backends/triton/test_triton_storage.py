"""How the triton forward stores its intermediates: the policy (`storage_dtype`), and the one cast every
store goes through (`stored`), which must round to nearest-even in the interpreter as a GPU does."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("triton", reason="Triton is not installed (extra `triton`)")

import triton
import triton.language as tl
from test_triton_backend import interpreter  # noqa: F401  (the fixture)

import kda
from kda.backends.triton import storage


@triton.jit
def _store_kernel(x, out, N: tl.constexpr, ROUND: tl.constexpr):
    offsets = tl.arange(0, N)
    tl.store(out + offsets, storage.stored(tl.load(x + offsets), out, ROUND))


def _spec(dtype: torch.dtype, training: bool) -> kda.KDASpec:
    B, T, H, K = 1, 8, 2, 16
    q = torch.randn(B, T, H, K, dtype=dtype)
    return kda.KDASpec.from_call(
        q=q,
        k=q,
        v=q,
        g=-torch.rand(B, T, H, K, dtype=dtype),
        beta=torch.rand(B, T, H, dtype=dtype),
        requires_grad=training,
    )


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
@pytest.mark.parametrize("training", [False, True])
def test_intermediates_take_the_input_dtype_at_inference_and_fp32_when_training(dtype, training):
    expected = torch.float32 if training else dtype
    assert storage.storage_dtype(_spec(dtype, training)) == expected


@pytest.mark.parametrize("round_by_hand", [True, False])
def test_bf16_stores_round_to_nearest_in_the_interpreter(seed, interpreter, round_by_hand):  # noqa: F811
    generator = torch.Generator().manual_seed(seed)
    n = 4096
    x = torch.randn(n, generator=generator) * torch.exp2(torch.randint(-20, 20, (n,), generator=generator).float())
    out = torch.full((n,), float("nan"), dtype=torch.bfloat16)
    _store_kernel[(1,)](x, out, N=n, ROUND=round_by_hand)
    expected = x.to(torch.bfloat16)  # torch rounds to nearest-even, as the GPU's conversion does
    if round_by_hand:
        assert torch.equal(out, expected)
    else:  # what the interpreter does on its own: truncation, wrong for about half the values
        assert (out != expected).float().mean() > 0.3
