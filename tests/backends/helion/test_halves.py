"""`kda.backends.helion.halves`: `split`, an fp32 tensor as bf16 halves whose sum is it to 2^-16, at any
magnitude fp32 holds (the device helper the serial passes, `solve` and `scores` share), and the serial
passes' floor on value columns in their halves form (`MIN_BLOCK_V`)."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("helion")

from kda.backends.helion.halves import split


@pytest.mark.parametrize("seed", [torch.seed() % 2**31, 1 + torch.seed() % 2**31])
def test_the_halves_sum_to_the_value_within_2_to_the_minus_16(seed):
    gen = torch.Generator().manual_seed(seed)
    magnitudes = torch.logspace(-30, 37, 64, dtype=torch.float64).to(torch.float32)
    x = torch.randn(64, 64, generator=gen).clamp(-8, 8) * magnitudes[:, None]  # within fp32's range
    assert torch.isfinite(x).all() and (x != 0).all()
    hi, lo = split(x)
    assert hi.dtype == lo.dtype == torch.bfloat16
    assert torch.equal(hi, x.to(torch.bfloat16))
    assert torch.isfinite(hi).all() and torch.isfinite(lo).all()
    error = (hi.double() + lo.double() - x.double()).abs()
    assert (error <= 2.0**-16 * x.double().abs()).all(), f"seed {seed}: {(error / x.double().abs()).max():.3e}"


def test_the_low_half_carries_what_the_high_half_drops():
    x = torch.tensor([1 + 2.0**-9, -(1 + 2.0**-12), 3.0e38, 2.0**-100 * (1 + 2.0**-10)])
    hi, lo = split(x)
    assert (lo != 0).all()
    assert (hi.double() + lo.double() - x.double()).abs().max() <= 2.0**-16 * x.double().abs().max()


@pytest.mark.parametrize("kernel", ["state_kernel", "state_backward_kernel"])
def test_the_serial_passes_on_halves_take_at_least_min_block_v_columns(kernel, monkeypatch):
    """A launch setting asking fewer value columns than `MIN_BLOCK_V` (the width at which `state`'s halves
    form read shared memory out of bounds on an H100) is raised to it in the code Helion generates for the
    ``HALVES`` form; the fp32 form keeps what it is asked. Read from the generated Triton source, so it holds
    for table entries, Helion's default and the tuner's candidates alike."""
    import helion

    from kda.backends import helion as helion_backend
    from kda.backends.helion import runtime
    from kda.backends.helion.halves import MIN_BLOCK_V
    from kda.spec import CaseClass
    from kda.verify.cases import cases_for
    from kda.verify.check import run_case

    launched: dict[str, tuple] = {}
    real = runtime.launch

    def recording(fn, precision, args, key):
        launched[fn.__name__] = (fn, precision, args)
        real(fn, precision, args, key)

    monkeypatch.setattr(runtime, "launch", recording)
    asked = MIN_BLOCK_V // 2
    for dtype, halves, expected in (("bf16", True, MIN_BLOCK_V), ("fp32", False, asked)):
        monkeypatch.setenv("HELION_INTERPRET", "1")  # run on the CPU, its launch recorded
        cc = CaseClass.from_key(f"safe/l2/sig/{dtype}/dense/mha/h0+ht/c32/d64/train")
        assert run_case(helion_backend.HelionBackend(), cases_for(cc, quick=True, long=False)[0], "cpu").passed
        fn, precision, args = launched[kernel]
        assert args[-1] is halves  # the form that ran
        monkeypatch.delenv("HELION_INTERPRET")  # then generate its code for the GPU at a narrow setting
        bound = runtime._kernel(fn, precision, False).bind(args)
        code = bound.to_triton_code(helion.Config(block_sizes=[asked], num_warps=4, num_stages=1))
        widths = {
            int(line.split("(")[1].rstrip(")")) for line in code.splitlines() if "_BLOCK_SIZE_0 = tl.constexpr(" in line
        }
        assert widths == {expected}, (kernel, dtype, widths)
