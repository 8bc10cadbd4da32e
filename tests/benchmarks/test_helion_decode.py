"""benchmarks/helion_decode.py's kernel, run by Helion's interpreter on the CPU, against the float64 decode
reference: the outputs, the pool slots it writes, padding rows (slot -1: output 0, no state touched) and
the slots nobody names (untouched)."""

from __future__ import annotations

import pytest
import torch
from benchmark_scripts import load

from kda.recurrent.reference import fused_recurrent_reference
from kda.verify.check import relative_error

helion = pytest.importorskip("helion", reason="helion is not installed (extra `test`)")


helion_decode = load("helion_decode")


def _call(N: int, H: int, HV: int, K: int, V: int, slots: list, pool_dtype: torch.dtype, T: int = 1) -> dict:
    """A decode step's keyword arguments, as `kda.bench.decode.decode_inputs` makes them (the bounded sigmoid
    gate, l2norm and beta's sigmoid in kernel), with fp32 token inputs; `slots` a list (one a sequence) or a
    list of lists (one a token)."""
    indices = torch.tensor(slots, dtype=torch.int32)
    return {
        "q": torch.randn(N, T, H, K),
        "k": torch.randn(N, T, H, K),
        "v": torch.randn(N, T, HV, V),
        "g": torch.randn(N, T, HV, K) * 2,
        "beta": torch.randn(N, T, HV),
        "A_log": torch.rand(HV) * 2,
        "dt_bias": torch.randn(HV * K) * 0.5,
        "lower_bound": -5.0,
        "use_gate_in_kernel": True,
        "use_qk_l2norm_in_kernel": True,
        "use_beta_sigmoid_in_kernel": True,
        "initial_state": (torch.randn(int(indices.max()) + 3, HV, K, V) * 0.5).to(pool_dtype),
        "ssm_state_indices": indices,
        "inplace_final_state": True,
    }


def _check(call: dict, padding_rows: list[int], pool_dtype: torch.dtype, config: str | None = None) -> None:
    """Run the kernel (Helion's interpreter, or `config` compiled) on `call`, outputs poisoned first,
    against the float64 reference."""
    before = call["initial_state"].clone()
    ref = fused_recurrent_reference(**call)
    args, o = helion_decode.decode_args(call)
    o.fill_(float("nan"))  # poisoned: an output left unwritten fails
    helion_decode.kernel_for(config)(*args)
    pool = call["initial_state"]
    live = [row for row in range(o.shape[0]) if row not in padding_rows]
    tol = 1e-5 if pool_dtype == torch.float32 else 8e-3  # a bf16 pool: one rounding of the stored state
    assert relative_error(o[live], ref.o[live]) < 1e-5
    assert (o[padding_rows] == 0).all()
    assert sorted(ref.written) and relative_error(pool[ref.written], ref.exact_pool[ref.written]) < tol
    others = [s for s in range(pool.shape[0]) if s not in ref.written]
    assert torch.equal(pool[others], before[others])  # padding touched no slot, nor did anyone else


@pytest.mark.parametrize("pool_dtype", [torch.float32, torch.bfloat16], ids=["fp32-pool", "bf16-pool"])
def test_the_kernel_is_the_decode_step(seed, monkeypatch, pool_dtype):
    monkeypatch.setenv("HELION_INTERPRET", "1")
    call = _call(N=5, H=2, HV=4, K=16, V=8, slots=[4, -1, 0, 6, 2], pool_dtype=pool_dtype, T=2)
    _check(call, padding_rows=[1], pool_dtype=pool_dtype)


@pytest.mark.parametrize("pool_dtype", [torch.float32, torch.bfloat16], ids=["fp32-pool", "bf16-pool"])
def test_the_kernel_is_the_speculative_decode_step(seed, monkeypatch, pool_dtype):
    """Per-token slots: the state read from column ``accepted - 1``, written after every token into that
    token's column; a row whose read slot is negative is padding, a negative write slot is skipped."""
    monkeypatch.setenv("HELION_INTERPRET", "1")
    slots = [[3, 7, 8], [-1, -1, -1], [0, 9, 10], [11, 12, -1]]
    call = _call(N=4, H=1, HV=2, K=16, V=8, slots=slots, pool_dtype=pool_dtype, T=3)
    call["num_accepted_tokens"] = torch.tensor([1, 1, 3, 2], dtype=torch.int32)
    _check(call, padding_rows=[1], pool_dtype=pool_dtype)


@pytest.mark.parametrize("config", ["16x2", "64x4"])
@pytest.mark.parametrize("per_token", [False, True], ids=["slot-per-sequence", "slot-per-token"])
def test_the_compiled_configurations_stay_in_the_pool(seed, monkeypatch, checked_kernel_addresses, config, per_token):
    """The Triton code Helion generates for a configuration the benchmark times, run by Triton's
    interpreter (`tests/helion_compiled.py`) with every lane address-checked: slots are loaded scalars that
    index the pool, and a padding row must neither read nor write through its -1."""
    if torch.cuda.is_available():
        pytest.skip("runs Triton's CPU interpreter, on a machine without a GPU")
    from helion_compiled import interpreter_bridges

    monkeypatch.setenv("HELION_INTERPRET", "0")
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    slots = [[3, 7, 8], [-1, -1, -1], [0, 9, 10], [11, 12, -1]] if per_token else [4, -1, 0, 6]
    call = _call(N=4, H=1, HV=2, K=16, V=32, slots=slots, pool_dtype=torch.float32, T=3 if per_token else 1)
    if per_token:
        call["num_accepted_tokens"] = torch.tensor([1, 1, 3, 2], dtype=torch.int32)
    with interpreter_bridges():
        _check(call, padding_rows=[1], pool_dtype=torch.float32, config=config)
    assert checked_kernel_addresses.launches == {"_helion_decode_kernel": 1}


def test_a_wrong_kernel_fails_the_check(seed, monkeypatch):
    """The comparison above can fail: the same kernel without the state's decay is far off."""
    monkeypatch.setenv("HELION_INTERPRET", "1")
    call = _call(N=3, H=1, HV=2, K=16, V=8, slots=[0, 1, 2], pool_dtype=torch.float32)
    ref = fused_recurrent_reference(**call)
    call["lower_bound"] = -1e-9  # no decay: a different function
    args, o = helion_decode.decode_args(call)
    helion_decode.kernel_for(None)(*args)
    assert relative_error(o, ref.o) > 1e-2


@pytest.mark.parametrize(
    ("pool_dtype", "T", "configs"),
    [
        (torch.float32, 1, helion_decode.CONFIGS),
        (torch.bfloat16, 1, helion_decode.CONFIGS[:2]),
        (torch.float32, 4, helion_decode.CONFIGS[:2]),
    ],
    ids=["fp32-pool", "bf16-pool", "per-token-slots"],
)
def test_the_configurations_lower_to_triton_without_a_gpu(monkeypatch, pool_dtype, T, configs):
    """Helion's compiler (not the interpreter) turns the kernel into Triton source at the bench's shape
    (HV = 32, K = V = 128, bf16 token inputs), with the state's loads marked evict-first and q, k, g's
    evict-last: under every configuration the benchmark times, and for the other pool dtype and per-token
    slots under two."""
    monkeypatch.setenv("HELION_INTERPRET", "0")
    slots = [3, -1, 0, 5] if T == 1 else [[3, 6, 7, 8], [-1] * 4, [0, 9, 10, 11], [5, 12, -1, 13]]
    call = _call(N=4, H=32, HV=32, K=128, V=128, slots=slots, pool_dtype=pool_dtype, T=T)
    for name in ("q", "k", "v", "g", "beta"):
        call[name] = call[name].to(torch.bfloat16)
    if T > 1:
        call["num_accepted_tokens"] = torch.tensor([1, 1, 4, 2], dtype=torch.int32)
    args, _ = helion_decode.decode_args(call)
    for config in configs:
        bound = helion_decode.kernel_for(config).bind(args)
        block_v, warps = (int(part) for part in config.split("x"))
        source = bound.to_triton_code(helion.Config(block_sizes=[block_v], num_warps=warps))
        assert "@triton.jit" in source and "tl.sum" in source, config
        assert "evict_first" in source and "evict_last" in source, config  # the triton kernel's cache hints


def test_the_default_configuration_is_never_autotuned():
    """Given no configuration, Helion 1.5 autotunes at the first call (minutes on the GPU, past a device
    run's limit): the default kernel must ask for Helion's default configuration instead."""
    assert helion_decode.kernel_for(None).settings.autotune_effort == "none"
    assert helion_decode.kernel_for("64x4").configs  # a named configuration is given, not searched for
