"""benchmarks/helion_decode.py's kernel, run by Helion's interpreter on the CPU, against the float64 decode
reference: the outputs, the pool slots it writes, padding rows (slot -1: output 0, no state touched) and
the slots nobody names (untouched)."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import pytest
import torch

from kda.recurrent.reference import fused_recurrent_reference
from kda.verify.check import relative_error

helion = pytest.importorskip("helion", reason="helion is not installed (extra `test`)")

ROOT = Path(__file__).resolve().parents[2]


def _load():
    spec = importlib.util.spec_from_file_location("helion_decode", ROOT / "benchmarks" / "helion_decode.py")
    module = importlib.util.module_from_spec(spec)
    assert spec.loader is not None
    sys.modules["helion_decode"] = module  # Helion's compiler looks the kernel's globals up by module name
    spec.loader.exec_module(module)
    return module


helion_decode = _load()


def _call(N: int, H: int, HV: int, K: int, V: int, slots: list[int], pool_dtype: torch.dtype) -> dict:
    """A decode step's keyword arguments, as `kda.bench.decode.decode_inputs` makes them (T = 1, the
    bounded sigmoid gate, l2norm and beta's sigmoid in kernel), with fp32 token inputs."""
    num_slots = max(slots) + 3
    return {
        "q": torch.randn(N, 1, H, K),
        "k": torch.randn(N, 1, H, K),
        "v": torch.randn(N, 1, HV, V),
        "g": torch.randn(N, 1, HV, K) * 2,
        "beta": torch.randn(N, 1, HV),
        "A_log": torch.rand(HV) * 2,
        "dt_bias": torch.randn(HV * K) * 0.5,
        "lower_bound": -5.0,
        "use_gate_in_kernel": True,
        "use_qk_l2norm_in_kernel": True,
        "use_beta_sigmoid_in_kernel": True,
        "initial_state": (torch.randn(num_slots, HV, K, V) * 0.5).to(pool_dtype),
        "ssm_state_indices": torch.tensor(slots, dtype=torch.int32),
        "inplace_final_state": True,
    }


@pytest.mark.parametrize("pool_dtype", [torch.float32, torch.bfloat16], ids=["fp32-pool", "bf16-pool"])
def test_the_kernel_is_the_decode_step(seed, monkeypatch, pool_dtype):
    monkeypatch.setenv("HELION_INTERPRET", "1")
    slots = [4, -1, 0, 6, 2]  # a padding row among them; slots 1, 3, 5, 7 are nobody's
    call = _call(N=5, H=2, HV=4, K=16, V=8, slots=slots, pool_dtype=pool_dtype)
    before = call["initial_state"].clone()
    ref = fused_recurrent_reference(**call)
    args, o = helion_decode.decode_args(call)
    o.fill_(float("nan"))  # poisoned: an output left unwritten fails
    helion_decode.kernel_for(None)(*args)
    pool = call["initial_state"]
    live = [row for row, slot in enumerate(slots) if slot >= 0]
    tol = 1e-5 if pool_dtype == torch.float32 else 8e-3  # a bf16 pool: one rounding of the stored state
    assert relative_error(o[live], ref.o[live]) < 1e-5
    assert (o[1] == 0).all()  # the padding row
    written = [slot for slot in slots if slot >= 0]
    assert relative_error(pool[written], ref.exact_pool[written]) < tol
    others = [s for s in range(pool.shape[0]) if s not in written]
    assert torch.equal(pool[others], before[others])  # the padding row touched no slot, nor did anyone else


def test_a_wrong_kernel_fails_the_check(seed, monkeypatch):
    """The comparison above can fail: the same kernel without the state's decay is far off."""
    monkeypatch.setenv("HELION_INTERPRET", "1")
    call = _call(N=3, H=1, HV=2, K=16, V=8, slots=[0, 1, 2], pool_dtype=torch.float32)
    ref = fused_recurrent_reference(**call)
    call["lower_bound"] = -1e-9  # no decay: a different function
    args, o = helion_decode.decode_args(call)
    helion_decode.kernel_for(None)(*args)
    assert relative_error(o, ref.o) > 1e-2


@pytest.mark.parametrize("pool_dtype", [torch.float32, torch.bfloat16], ids=["fp32-pool", "bf16-pool"])
def test_every_configuration_lowers_to_triton_without_a_gpu(monkeypatch, pool_dtype):
    """Helion's compiler (not the interpreter) turns the kernel into Triton source at the bench's shape
    (HV = 32, K = V = 128, bf16 token inputs) under every configuration the benchmark times, each block of
    value columns a loop-free tile of the state."""
    monkeypatch.setenv("HELION_INTERPRET", "0")
    call = _call(N=4, H=32, HV=32, K=128, V=128, slots=[3, -1, 0, 5], pool_dtype=pool_dtype)
    for name in ("q", "k", "v", "g", "beta"):
        call[name] = call[name].to(torch.bfloat16)
    args, _ = helion_decode.decode_args(call)
    for config in helion_decode.CONFIGS:
        kernel = helion_decode.kernel_for(config)
        bound = kernel.bind(args)
        block_v, warps = (int(part) for part in config.split("x"))
        source = bound.to_triton_code(helion.Config(block_sizes=[block_v], num_warps=warps))
        assert "@triton.jit" in source and "tl.sum" in source, config
