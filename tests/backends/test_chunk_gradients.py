"""`kda.backends.chunks.gradients`: a chunked backward's parts as the gradients of the inputs as passed.

A backward hands over ``dg`` either in fp32 (the host sums it over tokens for ``ddt_bias``, then rounds it to
g's dtype: the helion backend) or already in g's dtype with its own ``ddt_bias`` (the tilelang backend's
`gate_tail`, which sums each chunk's rows in fp32).
"""

from __future__ import annotations

import pytest
import torch

from kda.backends.base import KDAInputs
from kda.backends.chunks import gradients

B, T, H, HV, K, V, NT, C = 1, 12, 2, 4, 8, 8, 3, 4


def inputs(g_dtype: torch.dtype, dt_bias_shape: tuple[int, ...] | None = (HV, K)) -> KDAInputs:
    def random(*shape, dtype=torch.bfloat16):
        return torch.randn(*shape, dtype=dtype)

    return KDAInputs(
        q=random(B, T, H, K), k=random(B, T, H, K), v=random(B, T, HV, V), g=random(B, T, HV, K, dtype=g_dtype),
        beta=random(B, T, HV), A_log=random(HV, dtype=torch.float32),
        dt_bias=None if dt_bias_shape is None else random(*dt_bias_shape, dtype=torch.float32),
    )  # fmt: skip


def parts(x: KDAInputs, dg: torch.Tensor, ddt_bias: torch.Tensor | None = None):
    tokens = B * T
    return gradients(
        x, torch.randn(tokens, H, K).to(x.q.dtype), torch.randn(tokens, H, K).to(x.k.dtype),
        torch.randn(tokens, HV, V).to(x.v.dtype), dg, torch.randn(tokens, HV).to(x.beta.dtype),
        torch.randn(NT, HV, C), None, ddt_bias=ddt_bias,
    )  # fmt: skip


@pytest.mark.parametrize("dt_bias_shape", [(HV, K), (HV * K,)])
def test_an_fp32_dg_is_summed_over_tokens_then_rounded(seed, dt_bias_shape):
    x = inputs(torch.bfloat16, dt_bias_shape)
    dg32 = torch.randn(B * T, HV, K)
    got = parts(x, dg32)
    assert got.ddt_bias is not None and got.ddt_bias.shape == x.dt_bias.shape
    torch.testing.assert_close(got.ddt_bias.reshape(HV, K), dg32.sum(0), rtol=0, atol=0)
    assert got.dg.dtype == torch.bfloat16 and got.dg.shape == x.g.shape
    assert torch.equal(got.dg.reshape(B * T, HV, K), dg32.to(torch.bfloat16))


def test_a_backwards_own_ddt_bias_is_taken_and_its_dg_kept(seed):
    x = inputs(torch.bfloat16)
    dg = torch.randn(B * T, HV, K).to(torch.bfloat16)
    own = torch.randn(NT, HV, K).sum(0)
    got = parts(x, dg, own)
    torch.testing.assert_close(got.ddt_bias, own, rtol=0, atol=0)
    assert got.dg.data_ptr() == dg.data_ptr()  # already in g's dtype: a view, not a copy


def test_a_16_bit_dg_without_a_ddt_bias_is_refused(seed):
    # summed from bf16 values, ddt_bias would carry dg's rounding into every token's term
    x = inputs(torch.bfloat16)
    with pytest.raises(AssertionError, match="fp32 dg"):
        parts(x, torch.randn(B * T, HV, K).to(torch.bfloat16))


def test_without_a_dt_bias_there_is_no_ddt_bias(seed):
    x = inputs(torch.float32, dt_bias_shape=None)
    got = parts(x, torch.randn(B * T, HV, K))
    assert got.ddt_bias is None and got.dg.dtype == torch.float32
