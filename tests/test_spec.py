"""Tests of `kda.spec.KDASpec.from_call`: the call contract of `chunk_kda`.

Every rejection test asserts both the argument the error names and a fragment of the rule's text, so a
test fails when the wrong rule fires. Tensors are tiny, random (never all zeros) and on the CPU.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import pydantic
import pytest
import torch
from hypothesis import HealthCheck, assume, given, settings
from hypothesis import strategies as st

from kda import options
from kda import spec as spec_module
from kda.errors import KDAInputError
from kda.spec import CaseClass, GateMode, KDASpec, head_dim_bucket

# ----------------------------------------------------------------------------------------------- helpers


def rnd(*shape: int, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """Fresh random data (randn in fp32, then cast, so every dtype works on the CPU)."""
    return torch.randn(*shape).to(dtype)


def log_decay(*shape: int, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """A plausible pregated g: strictly negative, random."""
    return (-torch.rand(*shape) - 0.01).to(dtype)


def make(
    B: int = 2,
    T: int = 5,
    H: int = 2,
    HV: int | None = None,
    K: int = 4,
    V: int = 6,
    dtype: torch.dtype = torch.float32,
) -> dict[str, torch.Tensor]:
    HV = H if HV is None else HV
    return {
        "q": rnd(B, T, H, K, dtype=dtype),
        "k": rnd(B, T, H, K, dtype=dtype),
        "v": rnd(B, T, HV, V, dtype=dtype),
        "g": log_decay(B, T, HV, K, dtype=dtype),
        "beta": torch.rand(B, T, HV).add(0.05).to(dtype),
    }


def softplus_params(HV: int, K: int, dt_2d: bool = False) -> dict[str, torch.Tensor]:
    return {"A_log": rnd(HV), "dt_bias": rnd(HV, K) if dt_2d else rnd(HV * K)}


def call(args: dict[str, Any], **kw: Any) -> KDASpec:
    return KDASpec.from_call(**{**args, **kw})


def rejects(args: dict[str, Any], argument: str, fragment: str, **kw: Any) -> KDAInputError:
    """Assert from_call raises KDAInputError naming `argument`, with `fragment` in its (first) rule."""
    with pytest.raises(KDAInputError) as info:
        call(args, **kw)
    err = info.value
    assert err.argument == argument, f"wrong argument named: {err}"
    assert fragment in err.rule, f"wrong rule fired: {err}"
    assert f"`{argument}`" in str(err)
    return err


# ----------------------------------------------------------------------------------------------- valid calls


def test_kda_input_error_is_value_error():
    assert issubclass(KDAInputError, ValueError)
    with pytest.raises(ValueError):
        call(make(), chunk_size=16)


def test_pregated_baseline():
    a = make(B=2, T=5, H=2, K=4, V=6)
    s = call(a)
    assert s.gate_mode is GateMode.PREGATED
    assert s.num_seqs == 2
    assert not s.is_gva
    assert not s.is_varlen
    assert s.scale == pytest.approx(4**-0.5)
    assert (s.B, s.T, s.H, s.HV, s.K, s.V) == (2, 5, 2, 2, 4, 6)
    assert s.state_shape == (2, 2, 4, 6)
    assert s.requires_grad is False
    cc = s.case_class
    assert cc.gate is GateMode.PREGATED and cc.dtype == "float32" and cc.head_dim == 64
    assert CaseClass.from_key(cc.key) == cc


@pytest.mark.parametrize("dt_2d", [False, True], ids=["dt_bias_flat", "dt_bias_2d"])
def test_softplus_baseline(dt_2d):
    a = make(B=1, T=4, H=2, HV=4, K=3, V=5)
    s = call(a, use_gate_in_kernel=True, **softplus_params(4, 3, dt_2d))
    assert s.gate_mode is GateMode.SOFTPLUS
    assert s.is_gva
    assert s.num_seqs == 1
    assert s.case_class.gate is GateMode.SOFTPLUS
    assert s.case_class.gva is True
    assert CaseClass.from_key(s.case_class.key) == s.case_class


def test_softplus_without_dt_bias_ok():
    a = make()
    s = call(a, use_gate_in_kernel=True, A_log=rnd(2))
    assert s.gate_mode is GateMode.SOFTPLUS


@pytest.mark.parametrize("with_a_log", [False, True])
@pytest.mark.parametrize("lb", [-5.0, -1.0, -1e-9])
def test_safe_baseline(with_a_log, lb):
    a = make(H=2, K=4)
    extra = softplus_params(2, 4) if with_a_log else {}
    s = call(a, use_gate_in_kernel=True, safe_gate=True, lower_bound=lb, **extra)
    assert s.gate_mode is GateMode.SAFE
    assert s.lower_bound == lb
    assert s.case_class.gate is GateMode.SAFE
    assert CaseClass.from_key(s.case_class.key) == s.case_class


def test_scale_default_and_explicit():
    assert call(make(K=7)).scale == pytest.approx(7**-0.5)
    assert call(make(K=7), scale=0.25).scale == 0.25


@pytest.mark.parametrize("scale", [float("nan"), float("inf"), float("-inf")])
def test_scale_non_finite_rejected(scale):
    rejects(make(), "scale", "finite", scale=scale)


def test_requires_grad_detection():
    a = make()
    assert call(a).requires_grad is False
    a["q"].requires_grad_(True)
    s = call(a)
    assert s.requires_grad is True
    assert s.case_class.training is True
    assert s.case_class.key.endswith("/train")
    with torch.no_grad():
        s = call(a)
    assert s.requires_grad is False
    assert s.case_class.key.endswith("/fwd")


@pytest.mark.parametrize("name", ["k", "v", "g", "beta", "A_log", "dt_bias", "initial_state"])
def test_requires_grad_from_other_tensors(name):
    kw: dict[str, Any] = {**make(B=1, H=1, K=3, V=4), "initial_state": rnd(1, 1, 3, 4)}
    kw.update(use_gate_in_kernel=True, A_log=rnd(1), dt_bias=rnd(3))
    assert call(kw).requires_grad is False
    kw[name].requires_grad_(True)
    assert call(kw).requires_grad is True
    with torch.no_grad():
        assert call(kw).requires_grad is False


def test_requires_grad_override():
    assert call(make(), requires_grad=True).requires_grad is True
    a = make()
    a["q"].requires_grad_(True)
    assert call(a, requires_grad=False).requires_grad is False


@pytest.mark.parametrize(
    "dtype,name", [(torch.bfloat16, "bfloat16"), (torch.float16, "float16"), (torch.float32, "float32")]
)
def test_dtypes_accepted(dtype, name):
    s = call(make(dtype=dtype))
    assert s.case_class.dtype == name
    assert s.dtype is dtype


def test_g_and_beta_may_differ_from_q_dtype():
    a = make(dtype=torch.bfloat16)
    a["g"] = a["g"].float()
    a["beta"] = a["beta"].float()
    call(a)


def test_case_class_key_round_trips_full():
    a = make(B=1, T=8, H=1, HV=2, K=3, V=130, dtype=torch.bfloat16)
    a["q"].requires_grad_(True)
    s = call(
        a,
        use_qk_l2norm_in_kernel=True,
        use_beta_sigmoid_in_kernel=True,
        allow_neg_eigval=True,
        use_gate_in_kernel=True,
        safe_gate=True,
        lower_bound=-2.0,
        initial_state=rnd(3, 2, 130, 3),
        state_v_first=True,
        output_final_state=True,
        cu_seqlens=torch.tensor([0, 2, 2, 8]),
        chunk_size=32,
    )
    assert s.case_class.key == "safe/l2/sig2/bf16/varlen/gva/h0+ht:vk/c32/d256/train"
    assert CaseClass.from_key(s.case_class.key) == s.case_class


def test_state_v_first_normalised_without_state():
    s = call(make(), state_v_first=True)
    assert s.case_class.state_v_first is False
    assert ":vk" not in s.case_class.key


def test_from_key_rejects_garbage():
    with pytest.raises(ValueError):
        CaseClass.from_key("not/a/key")


def test_head_dim_bucket():
    assert [head_dim_bucket(d) for d in (1, 64, 65, 128, 129, 256)] == [64, 64, 128, 128, 256, 256]


# ----------------------------------------------------------------------------------------------- safe gate


def test_safe_gate_without_gate_in_kernel():
    rejects(make(), "safe_gate", "requires use_gate_in_kernel=True", safe_gate=True, lower_bound=-1.0)


def test_safe_gate_without_lower_bound():
    rejects(make(), "lower_bound", "requires a lower_bound", use_gate_in_kernel=True, safe_gate=True)


@pytest.mark.parametrize("lb", [-5.0001, 0.0, -0.0, 0.3, float("nan"), float("-inf"), -100.0])
def test_safe_lower_bound_out_of_range(lb):
    err = rejects(
        make(), "lower_bound", "-5 <= lower_bound < 0", use_gate_in_kernel=True, safe_gate=True, lower_bound=lb
    )
    assert err.more == []


@pytest.mark.parametrize("lb", [-5, -5.0, -4.99, -1e-9])
def test_safe_lower_bound_in_range(lb):
    call(make(), use_gate_in_kernel=True, safe_gate=True, lower_bound=lb)


@pytest.mark.parametrize("with_a_log", [False, True])
@pytest.mark.parametrize("lb", [-1.0, -5.0, -12.0, 0.0])
def test_lower_bound_without_safe_gate_is_the_sigmoid_gate(with_a_log, lb):
    """FLA 0.6 computes lower_bound * sigmoid(...) whenever lower_bound is set (its own layer passes it
    without safe_gate); any bound <= 0, with or without A_log."""
    extra = {"A_log": rnd(2)} if with_a_log else {}
    spec = call(make(), use_gate_in_kernel=True, lower_bound=lb, **extra)
    assert spec.gate_mode is GateMode.SIGMOID and spec.case_class.key.startswith("sigmoid/")


def test_lower_bound_without_the_in_kernel_gate():
    rejects(make(), "lower_bound", "in-kernel gate only", lower_bound=-1.0)


def test_positive_lower_bound():
    rejects(make(), "lower_bound", "must be <= 0", use_gate_in_kernel=True, lower_bound=0.5)


# ----------------------------------------------------------------------------------------------- softplus params


def test_softplus_without_a_log():
    rejects(make(), "A_log", "requires A_log", use_gate_in_kernel=True)


@pytest.mark.parametrize("shape", [(3,), (2, 2), (), (1,)])
def test_a_log_wrong_shape(shape):
    rejects(make(H=2), "A_log", "must hold HV = 2 values", use_gate_in_kernel=True, A_log=torch.randn(shape))


@pytest.mark.parametrize("shape", [(2,), (1, 1, 2, 1), (2, 1), (1, 2)])
def test_a_log_any_shape_with_hv_values(shape):
    call(make(H=2), use_gate_in_kernel=True, A_log=torch.randn(shape))


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float64])
def test_a_log_and_dt_bias_in_any_float_dtype(dtype):
    call(make(H=2, K=4), use_gate_in_kernel=True, A_log=rnd(2, dtype=dtype), dt_bias=rnd(8, dtype=dtype))


@pytest.mark.parametrize("dtype", [torch.int32, torch.bool])
def test_a_log_wrong_dtype(dtype):
    rejects(make(H=2), "A_log", "dtype must be one of", use_gate_in_kernel=True, A_log=torch.ones(2, dtype=dtype))


def test_a_log_wrong_shape_in_safe_mode():
    rejects(
        make(H=2),
        "A_log",
        "must hold HV = 2 values",
        use_gate_in_kernel=True,
        safe_gate=True,
        lower_bound=-1.0,
        A_log=rnd(3),
    )


@pytest.mark.parametrize("shape", [(2 * 4 + 1,), (4, 3), (2, 4, 2), (4,), (2,)])
def test_dt_bias_wrong_shape(shape):
    rejects(
        make(H=2, K=4),
        "dt_bias",
        "must hold HV*K = 8 values ([HV*K] or [HV, K] = [2, 4])",
        use_gate_in_kernel=True,
        A_log=rnd(2),
        dt_bias=torch.randn(shape),
    )


@pytest.mark.parametrize("dtype", [torch.int64, torch.bool])
def test_dt_bias_wrong_dtype(dtype):
    rejects(
        make(H=2, K=4),
        "dt_bias",
        "dtype must be one of",
        use_gate_in_kernel=True,
        A_log=rnd(2),
        dt_bias=torch.ones(8, dtype=dtype),
    )


@pytest.mark.parametrize("name", ["A_log", "dt_bias"])
def test_gate_params_without_gate_in_kernel(name):
    tensor = rnd(2) if name == "A_log" else rnd(2 * 4)
    rejects(make(H=2, K=4), name, "only with use_gate_in_kernel=True", **{name: tensor})


# ----------------------------------------------------------------------------------------------- beta


def test_allow_neg_eigval_requires_sigmoid():
    rejects(make(), "allow_neg_eigval", "requires use_beta_sigmoid_in_kernel=True", allow_neg_eigval=True)
    s = call(make(), allow_neg_eigval=True, use_beta_sigmoid_in_kernel=True)
    assert s.case_class.beta == "sigmoid2"
    assert call(make(), use_beta_sigmoid_in_kernel=True).case_class.beta == "sigmoid"


# ----------------------------------------------------------------------------------------------- shapes


def test_q_not_4d():
    a = make()
    a["q"] = a["q"][0]
    rejects(a, "q", "must be 4-D")
    a = make()
    a["q"] = a["q"].unsqueeze(0)
    rejects(a, "q", "must be 4-D")


def test_v_not_4d():
    a = make()
    a["v"] = a["v"][0]
    rejects(a, "v", "must be 4-D")


def test_k_shape_mismatch():
    a = make(K=4)
    a["k"] = rnd(2, 5, 2, 5)
    rejects(a, "k", "must have q's shape [2, 5, 2, 4]")


@pytest.mark.parametrize("shape", [(2, 4, 2, 6), (1, 5, 2, 6)])
def test_v_batch_or_time_mismatch(shape):
    a = make(B=2, T=5, H=2, V=6)
    a["v"] = rnd(*shape)
    rejects(a, "v", "with q's B=2, T=5")


@pytest.mark.parametrize("H,HV", [(2, 3), (2, 1), (3, 4)])
def test_hv_not_multiple_of_h(H, HV):
    a = make(H=H, HV=HV)
    rejects(a, "v", "HV must be a multiple of H")


def test_gva_accepted():
    s = call(make(H=2, HV=6))
    assert s.is_gva and s.HV == 6 and s.case_class.gva


def test_k_over_256():
    a = make(B=1, T=1, H=1, K=257, V=4)
    rejects(a, "q", "head dim K must be <= 256")


def test_v_over_256():
    a = make(B=1, T=1, H=1, K=4, V=257)
    rejects(a, "v", "head dim V must be <= 256")


def test_head_dim_256_ok():
    s = call(make(B=1, T=1, H=1, K=256, V=256))
    assert s.case_class.head_dim == 256


@pytest.mark.parametrize("shape", [(2, 5, 2, 3), (2, 5, 1, 4), (2, 5, 2)])
def test_g_shape(shape):
    a = make(B=2, T=5, H=2, K=4)
    a["g"] = log_decay(*shape)
    rejects(a, "g", "must be [B, T, HV, K] = [2, 5, 2, 4]")


def test_g_shape_follows_hv_not_h():
    a = make(B=1, T=3, H=1, HV=2, K=4)
    a["g"] = log_decay(1, 3, 1, 4)
    rejects(a, "g", "[B, T, HV, K] = [1, 3, 2, 4]")


@pytest.mark.parametrize("shape", [(2, 5, 3), (2, 5, 2, 1), (2, 5)])
def test_beta_shape(shape):
    a = make(B=2, T=5, H=2)
    a["beta"] = torch.rand(*shape)
    rejects(a, "beta", "must be [B, T, HV] = [2, 5, 2]")


# ----------------------------------------------------------------------------------------------- dtypes & types


@pytest.mark.parametrize("dtype", [torch.int32, torch.int64, torch.bool])
def test_q_dtype_rejected(dtype):
    a = make()
    for n in ("q", "k", "v"):
        a[n] = (a[n] * 10).to(dtype)
    err = rejects(a, "q", "dtype must be one of bfloat16, float16, float32, float64")
    assert err.more == []


def test_float64_calls_keep_float64_states():
    a = {n: t.double() for n, t in make().items()}
    spec = call(a, output_final_state=True)
    assert spec.state_dtype == torch.float64 and spec.case_class.dtype == "float64"
    a["initial_state"] = torch.randn(spec.state_shape, dtype=torch.float64)
    call(a)
    a["initial_state"] = a["initial_state"].float()
    rejects(a, "initial_state", "dtype must be float64")


@pytest.mark.parametrize("name", ["k", "v"])
def test_k_v_dtype_must_match_q(name):
    a = make()
    a[name] = a[name].to(torch.bfloat16)
    rejects(a, name, "dtype must match q's (float32)")


@pytest.mark.parametrize("name", ["g", "beta"])
@pytest.mark.parametrize("dtype", [torch.int32, torch.bool, torch.int64])
def test_g_beta_non_float_rejected(name, dtype):
    a = make()
    a[name] = (a[name] * 10).to(dtype)
    rejects(a, name, "dtype must be one of bfloat16, float16, float32, float64")


@pytest.mark.parametrize("cs", [16, 128, 0, 48])
def test_chunk_size_rejected(cs):
    rejects(make(), "chunk_size", "must be 32 or 64", chunk_size=cs)


@pytest.mark.parametrize("cs", [32, 64])
def test_chunk_size_ok(cs):
    assert call(make(), chunk_size=cs).case_class.chunk_size == cs


@pytest.mark.parametrize("cs", [64.0, True, "64"])
def test_chunk_size_non_int_rejected(cs):
    rejects(make(), "chunk_size", "must be an int", chunk_size=cs)


@pytest.mark.parametrize(
    "flag",
    [
        "output_final_state",
        "use_qk_l2norm_in_kernel",
        "use_gate_in_kernel",
        "use_beta_sigmoid_in_kernel",
        "allow_neg_eigval",
        "safe_gate",
        "state_v_first",
    ],
)
@pytest.mark.parametrize("value", [1, 0, "yes", None])
def test_non_bool_flag_rejected(flag, value):
    rejects(make(), flag, "must be a bool", **{flag: value})


@pytest.mark.parametrize("name", ["q", "k", "v", "g", "beta"])
def test_non_tensor_rejected(name):
    a = make()
    a[name] = a[name].tolist()
    err = rejects(a, name, "must be a torch.Tensor")
    assert err.got == "list"


@pytest.mark.parametrize("name", ["initial_state", "cu_seqlens", "A_log"])
def test_non_tensor_optional_rejected(name):
    rejects(make(), name, "must be a torch.Tensor", **{name: [0, 1]})


# ----------------------------------------------------------------------------------------------- initial state


def test_initial_state_ok():
    s = call(make(B=2, H=2, K=4, V=6), initial_state=rnd(2, 2, 4, 6), output_final_state=True)
    assert s.case_class.initial_state and s.case_class.final_state
    assert s.state_shape == (2, 2, 4, 6)


@pytest.mark.parametrize("shape", [(1, 2, 4, 6), (2, 1, 4, 6), (2, 2, 4, 5), (2, 2, 4), (2, 2, 6, 4)])
def test_initial_state_wrong_shape(shape):
    rejects(
        make(B=2, H=2, K=4, V=6), "initial_state", "must be [N, HV, K, V] = [2, 2, 4, 6]", initial_state=rnd(*shape)
    )


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float64])
def test_initial_state_wrong_dtype(dtype):
    rejects(
        make(B=2, H=2, K=4, V=6), "initial_state", "dtype must be float32", initial_state=rnd(2, 2, 4, 6, dtype=dtype)
    )


def test_initial_state_v_first():
    a = make(B=2, H=2, K=4, V=6)
    h0 = rnd(2, 2, 6, 4)
    s = call(a, initial_state=h0, state_v_first=True)
    assert s.state_shape == (2, 2, 6, 4)
    assert s.case_class.state_v_first is True
    rejects(a, "initial_state", "[N, HV, K, V] = [2, 2, 4, 6]", initial_state=h0)
    rejects(
        a,
        "initial_state",
        "[N, HV, V, K] (state_v_first=True) = [2, 2, 6, 4]",
        initial_state=rnd(2, 2, 4, 6),
        state_v_first=True,
    )


def test_initial_state_follows_hv():
    a = make(B=1, H=1, HV=3, K=2, V=5)
    call(a, initial_state=rnd(1, 3, 2, 5))
    rejects(a, "initial_state", "= [1, 3, 2, 5]", initial_state=rnd(1, 1, 2, 5))


# ----------------------------------------------------------------------------------------------- cu_seqlens


def varlen(T: int = 8, **kw: Any) -> dict[str, torch.Tensor]:
    return make(B=1, T=T, **kw)


@pytest.mark.parametrize("dtype", [torch.int32, torch.int64])
def test_cu_seqlens_ok(dtype):
    cu = torch.tensor([0, 3, 8], dtype=dtype)
    s = call(varlen(), cu_seqlens=cu)
    assert s.is_varlen and s.num_seqs == 2
    assert s.cu_seqlens_values == (0, 3, 8)
    assert s.case_class.varlen
    assert s.state_shape[0] == 2


def test_cu_seqlens_with_cpu_copy_ok():
    cu = torch.tensor([0, 3, 8], dtype=torch.int32)
    s = call(varlen(), cu_seqlens=cu, cu_seqlens_cpu=cu.clone().long())
    assert s.num_seqs == 2 and s.cu_seqlens_values == (0, 3, 8)


def test_zero_length_sequences_allowed():
    s = call(varlen(), cu_seqlens=torch.tensor([0, 3, 3, 8]))
    assert s.num_seqs == 3
    s = call(varlen(), cu_seqlens=torch.tensor([0, 0, 8, 8]))
    assert s.num_seqs == 3


def test_cu_seqlens_requires_batch_one():
    rejects(make(B=2, T=8), "cu_seqlens", "flattened to B == 1", cu_seqlens=torch.tensor([0, 8]))


def test_cu_seqlens_float_rejected():
    rejects(varlen(), "cu_seqlens", "dtype must be int32 or int64", cu_seqlens=torch.tensor([0.0, 3.0, 8.0]))


@pytest.mark.parametrize("dtype", [torch.int16, torch.uint8, torch.bool])
def test_cu_seqlens_other_int_dtype_rejected(dtype):
    rejects(varlen(T=1), "cu_seqlens", "dtype must be int32 or int64", cu_seqlens=torch.tensor([0, 1]).to(dtype))


def test_cu_seqlens_2d_rejected():
    rejects(varlen(), "cu_seqlens", "must be 1-D [N+1]", cu_seqlens=torch.tensor([[0, 3, 8]]))


@pytest.mark.parametrize("values", [[0], []])
def test_cu_seqlens_too_short(values):
    rejects(varlen(), "cu_seqlens", "must be 1-D [N+1] with N >= 1", cu_seqlens=torch.tensor(values, dtype=torch.int64))


def test_cu_seqlens_not_starting_at_zero():
    rejects(varlen(), "cu_seqlens", "must start at 0", cu_seqlens=torch.tensor([1, 3, 8]))


def test_cu_seqlens_decreasing():
    rejects(varlen(), "cu_seqlens", "non-decreasing", cu_seqlens=torch.tensor([0, 5, 3, 8]))


@pytest.mark.parametrize("last", [7, 9])
def test_cu_seqlens_not_ending_at_t(last):
    rejects(varlen(), "cu_seqlens", "must end at T = 8", cu_seqlens=torch.tensor([0, 3, last]))


def test_cu_seqlens_values_checked_from_cpu_copy():
    cu = torch.tensor([0, 3, 8])
    rejects(varlen(), "cu_seqlens_cpu", "must end at T = 8", cu_seqlens=cu, cu_seqlens_cpu=torch.tensor([0, 3, 7]))


def test_cu_seqlens_cpu_shape_must_match():
    rejects(
        varlen(),
        "cu_seqlens_cpu",
        "must have cu_seqlens' shape [3]",
        cu_seqlens=torch.tensor([0, 3, 8]),
        cu_seqlens_cpu=torch.tensor([0, 1, 3, 8]),
    )


def test_cu_seqlens_cpu_without_cu_seqlens():
    rejects(varlen(), "cu_seqlens_cpu", "pass cu_seqlens too", cu_seqlens_cpu=torch.tensor([0, 3, 8]))


def test_initial_state_n_follows_cu_seqlens():
    a = varlen(H=2, K=4, V=6)
    cu = torch.tensor([0, 3, 3, 8])
    s = call(a, cu_seqlens=cu, initial_state=rnd(3, 2, 4, 6))
    assert s.num_seqs == 3
    rejects(a, "initial_state", "with N = 3 sequences", cu_seqlens=cu, initial_state=rnd(1, 2, 4, 6))
    rejects(a, "initial_state", "with N = 3 sequences", cu_seqlens=cu, initial_state=rnd(4, 2, 4, 6))


# Host copies and scalar arguments of the wrong kind.


@pytest.mark.parametrize("cpu", [torch.tensor([0.5, 9.0, -1.0]), torch.tensor([0, 3, 8], dtype=torch.int16)])
def test_cu_seqlens_cpu_dtype_checked(cpu):
    rejects(
        varlen(),
        "cu_seqlens_cpu",
        "dtype must be int32 or int64",
        cu_seqlens=torch.tensor([0, 3, 8]),
        cu_seqlens_cpu=cpu,
    )


def test_cu_seqlens_cpu_must_agree_with_a_host_cu_seqlens():
    rejects(
        varlen(),
        "cu_seqlens_cpu",
        "same values as cu_seqlens",
        cu_seqlens=torch.tensor([0, 3, 8]),
        cu_seqlens_cpu=torch.tensor([0, 5, 8]),
    )


def test_disable_recompute_must_be_bool():
    rejects(make(), "disable_recompute", "must be a bool", disable_recompute="no")


@pytest.mark.parametrize(
    "kw",
    [
        {"scale": "abc"},
        {"scale": [0.5]},
        {"scale": 10**400},
        {"use_gate_in_kernel": True, "safe_gate": True, "lower_bound": "abc"},
        {"use_gate_in_kernel": True, "safe_gate": True, "lower_bound": [-1.0]},
    ],
    ids=["scale-str", "scale-list", "scale-huge-int", "lb-str", "lb-list"],
)
def test_non_numeric_scale_or_lower_bound_is_input_error(kw):
    name = "scale" if "scale" in kw else "lower_bound"
    rejects(make(), name, "must be a", **kw)


# ----------------------------------------------------------------------------------------------- several at once


def test_several_rules_broken_at_once():
    with pytest.raises(KDAInputError) as info:
        call(make(), allow_neg_eigval=True, chunk_size=16, scale=float("nan"))
    err = info.value
    assert err.argument == "allow_neg_eigval"
    assert [e.argument for e in err.more] == ["chunk_size", "scale"]
    msg = str(err)
    assert msg.startswith("`allow_neg_eigval`: allow_neg_eigval=True requires use_beta_sigmoid_in_kernel=True")
    assert "also `chunk_size`: must be 32 or 64; got 16" in msg
    assert "also `scale`: must be a finite number" in msg


def test_several_shape_rules_broken_at_once():
    a = make(B=2, T=5, H=2, K=4)
    a["k"] = rnd(2, 5, 2, 3)
    a["g"] = log_decay(2, 5, 2, 3)
    a["beta"] = torch.rand(2, 5)
    err = rejects(a, "k", "must have q's shape")
    assert [e.argument for e in err.more] == ["g", "beta"]
    assert "also `g`" in str(err) and "also `beta`" in str(err)


def test_single_rule_has_no_more():
    err = rejects(make(), "chunk_size", "must be 32 or 64", chunk_size=128)
    assert err.more == []
    assert "also" not in str(err)
    assert err.got == 128


# ----------------------------------------------------------------------------------------------- no mutation


def _snapshot(kw: dict[str, Any]) -> dict[str, tuple[torch.Tensor, bool]]:
    return {n: (t.detach().clone(), t.requires_grad) for n, t in kw.items() if isinstance(t, torch.Tensor)}


def _assert_unchanged(kw: dict[str, Any], snap: dict[str, tuple[torch.Tensor, bool]]) -> None:
    for n, (before, rg) in snap.items():
        after = kw[n]
        assert after.dtype == before.dtype and after.shape == before.shape, n
        assert torch.equal(after.detach(), before), n
        assert after.requires_grad == rg, n


def test_inputs_not_modified():
    a = varlen(T=8, H=2, HV=4, K=4, V=6)
    a["q"].requires_grad_(True)
    good = {
        **a,
        "use_gate_in_kernel": True,
        "A_log": rnd(4),
        "dt_bias": rnd(4, 4),
        "initial_state": rnd(2, 4, 4, 6),
        "cu_seqlens": torch.tensor([0, 3, 8], dtype=torch.int32),
        "cu_seqlens_cpu": torch.tensor([0, 3, 8], dtype=torch.int64),
    }
    snap = _snapshot(good)
    KDASpec.from_call(**good)
    _assert_unchanged(good, snap)

    bad = {
        **good,
        "cu_seqlens": torch.tensor([0, 5, 3]),
        "cu_seqlens_cpu": None,
        "dt_bias": rnd(3, dtype=torch.float16),
    }
    snap = _snapshot(bad)
    with pytest.raises(KDAInputError):
        KDASpec.from_call(**bad)
    _assert_unchanged(bad, snap)


def test_spec_is_frozen_and_hashable():
    s = call(make())
    with pytest.raises(pydantic.ValidationError):
        s.chunk_size = 32  # type: ignore[misc]
    assert hash(s) == hash(call(make()))


# ----------------------------------------------------------------------------------------------- hypothesis

DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}
HEAD_DIMS = st.one_of(st.integers(1, 8), st.sampled_from([64, 65, 128, 129, 256]))


@dataclass(frozen=True)
class Case:
    B: int
    T: int
    H: int
    group: int
    K: int
    V: int
    dtype: str
    gate: str
    dt_bias: str  # "none" | "flat" | "2d"
    a_log_in_safe: bool
    lower_bound: float | None
    l2: bool
    beta_sigmoid: bool
    neg_eig: bool
    cu: tuple[int, ...] | None
    cu_dtype: str
    cu_cpu: bool
    h0: bool
    ht: bool
    v_first: bool
    chunk: int
    training: bool

    @property
    def HV(self) -> int:
        return self.H * self.group

    @property
    def N(self) -> int:
        return len(self.cu) - 1 if self.cu is not None else self.B


@st.composite
def cases(draw: st.DrawFn) -> Case:
    is_varlen = draw(st.booleans())
    T = draw(st.integers(1, 8))
    B = 1 if is_varlen else draw(st.integers(1, 3))
    cu = None
    if is_varlen:
        inner = draw(st.lists(st.integers(0, T), min_size=0, max_size=4))
        cu = (0, *sorted(inner), T)
    gate = draw(st.sampled_from(["pregated", "softplus", "safe"]))
    beta_sigmoid = draw(st.booleans())
    K, V = draw(HEAD_DIMS), draw(HEAD_DIMS)
    big = max(K, V) > 8
    return Case(
        B=B,
        T=T,
        H=draw(st.integers(1, 2 if big else 3)),
        group=draw(st.integers(1, 1 if big else 3)),
        K=K,
        V=V,
        dtype=draw(st.sampled_from(sorted(DTYPES))),
        gate=gate,
        dt_bias=draw(st.sampled_from(["none", "flat", "2d"])) if gate != "pregated" else "none",
        a_log_in_safe=draw(st.booleans()),
        lower_bound=draw(st.floats(-5.0, 0.0, exclude_max=True)) if gate == "safe" else None,
        l2=draw(st.booleans()),
        beta_sigmoid=beta_sigmoid,
        neg_eig=draw(st.booleans()) if beta_sigmoid else False,
        cu=cu,
        cu_dtype=draw(st.sampled_from(["int32", "int64"])),
        cu_cpu=draw(st.booleans()) if is_varlen else False,
        h0=draw(st.booleans()),
        ht=draw(st.booleans()),
        v_first=draw(st.booleans()),
        chunk=draw(st.sampled_from([32, 64])),
        training=draw(st.booleans()),
    )


def build(c: Case) -> dict[str, Any]:
    dt = DTYPES[c.dtype]
    kw: dict[str, Any] = make(B=c.B, T=c.T, H=c.H, HV=c.HV, K=c.K, V=c.V, dtype=dt)
    if c.training:
        kw["q"].requires_grad_(True)
    kw.update(
        use_qk_l2norm_in_kernel=c.l2,
        use_beta_sigmoid_in_kernel=c.beta_sigmoid,
        allow_neg_eigval=c.neg_eig,
        output_final_state=c.ht,
        state_v_first=c.v_first,
        chunk_size=c.chunk,
    )
    if c.gate != "pregated":
        kw["use_gate_in_kernel"] = True
        if c.gate == "softplus" or c.a_log_in_safe:
            kw["A_log"] = rnd(c.HV)
        if c.dt_bias == "flat":
            kw["dt_bias"] = rnd(c.HV * c.K)
        elif c.dt_bias == "2d":
            kw["dt_bias"] = rnd(c.HV, c.K)
    if c.gate == "safe":
        kw["safe_gate"] = True
        kw["lower_bound"] = c.lower_bound
    if c.cu is not None:
        cu = torch.tensor(c.cu, dtype=getattr(torch, c.cu_dtype))
        kw["cu_seqlens"] = cu
        if c.cu_cpu:
            kw["cu_seqlens_cpu"] = cu.clone()
    if c.h0:
        shape = (c.N, c.HV, c.V, c.K) if c.v_first else (c.N, c.HV, c.K, c.V)
        kw["initial_state"] = rnd(*shape)
    return kw


@settings(max_examples=60, deadline=None, database=None)
@given(cases())
def test_hypothesis_valid_calls_pass(c: Case):
    kw = build(c)
    snap = _snapshot(kw)
    s = KDASpec.from_call(**kw)
    _assert_unchanged(kw, snap)
    cc = s.case_class
    assert cc.gate is GateMode(c.gate)
    assert s.gate_mode is GateMode(c.gate)
    assert cc.dtype == c.dtype
    assert cc.varlen is (c.cu is not None)
    assert cc.gva is (c.group > 1) is s.is_gva
    assert cc.chunk_size == c.chunk
    m = max(c.K, c.V)
    assert cc.head_dim == (64 if m <= 64 else 128 if m <= 128 else 256)
    assert cc.qk_l2norm is c.l2
    assert cc.beta == ("given" if not c.beta_sigmoid else "sigmoid2" if c.neg_eig else "sigmoid")
    assert cc.initial_state is c.h0 and cc.final_state is c.ht
    assert cc.state_v_first is (c.v_first and (c.h0 or c.ht))
    assert cc.training is c.training
    assert s.num_seqs == c.N
    assert s.state_shape == ((c.N, c.HV, c.V, c.K) if c.v_first else (c.N, c.HV, c.K, c.V))
    assert s.scale == pytest.approx(c.K**-0.5)
    assert CaseClass.from_key(cc.key) == cc
    if c.cu is not None:
        assert s.cu_seqlens_values == c.cu


# Each mutation breaks exactly one rule of a valid call; it returns the expected argument and a fragment
# of the rule (or None when the drawn case cannot host it; such draws are discarded).
Mutation = Callable[[Case, dict[str, Any]], "tuple[str, str] | None"]


def _softplus(c: Case, kw: dict[str, Any], **params: Any) -> None:
    kw.update(use_gate_in_kernel=True, safe_gate=False, lower_bound=None, A_log=rnd(c.HV), dt_bias=None)
    kw.update(params)


def m_q_3d(c, kw):
    kw["q"] = kw["q"].detach()[0]
    return "q", "must be 4-D"


def m_v_5d(c, kw):
    kw["v"] = kw["v"].unsqueeze(0)
    return "v", "must be 4-D"


def m_k_shape(c, kw):
    kw["k"] = rnd(c.B, c.T, c.H, c.K + 1, dtype=DTYPES[c.dtype])
    return "k", "must have q's shape"


def m_v_time(c, kw):
    kw["v"] = rnd(c.B, c.T + 1, c.HV, c.V, dtype=DTYPES[c.dtype])
    return "v", "with q's B="


def m_g_shape(c, kw):
    kw["g"] = log_decay(c.B, c.T, c.HV, c.K + 1)
    return "g", "must be [B, T, HV, K]"


def m_beta_shape(c, kw):
    kw["beta"] = torch.rand(c.B, c.T, c.HV + 1)
    return "beta", "must be [B, T, HV]"


def m_q_int(c, kw):
    for n in ("q", "k", "v"):
        kw[n] = (kw[n].detach() * 10).to(torch.int32)
    return "q", "dtype must be one of"


def m_k_dtype(c, kw):
    other = "float32" if c.dtype != "float32" else "bfloat16"
    kw["k"] = kw["k"].to(DTYPES[other])
    return "k", "dtype must match q's"


def m_g_int(c, kw):
    kw["g"] = (kw["g"] * 10).to(torch.int32)
    return "g", "dtype must be one of"


def m_beta_bool(c, kw):
    kw["beta"] = kw["beta"] > 0.5
    return "beta", "dtype must be one of"


def m_chunk(c, kw):
    kw["chunk_size"] = 128 if c.chunk == 64 else 16
    return "chunk_size", "must be 32 or 64"


def m_scale(c, kw):
    kw["scale"] = math.inf if c.T % 2 else math.nan
    return "scale", "must be a finite number"


def m_flag(c, kw):
    kw["output_final_state"] = int(c.ht)
    return "output_final_state", "must be a bool"


def m_not_tensor(c, kw):
    kw["beta"] = kw["beta"].tolist()
    return "beta", "must be a torch.Tensor"


def m_neg_eig(c, kw):
    kw.update(use_beta_sigmoid_in_kernel=False, allow_neg_eigval=True)
    return "allow_neg_eigval", "requires use_beta_sigmoid_in_kernel=True"


def m_safe_without_gate(c, kw):
    kw.update(use_gate_in_kernel=False, safe_gate=True, lower_bound=-1.0, A_log=None, dt_bias=None)
    return "safe_gate", "requires use_gate_in_kernel=True"


def m_safe_no_lb(c, kw):
    kw.update(use_gate_in_kernel=True, safe_gate=True, lower_bound=None)
    return "lower_bound", "requires a lower_bound"


def m_safe_lb_range(c, kw):
    kw.update(use_gate_in_kernel=True, safe_gate=True, lower_bound=[-5.0001, 0.0, 0.3, math.nan][c.T % 4])
    return "lower_bound", "-5 <= lower_bound < 0"


def m_lb_without_safe(c, kw):
    kw.update(use_gate_in_kernel=False, safe_gate=False, lower_bound=-1.0, A_log=None, dt_bias=None)
    return "lower_bound", "in-kernel gate only"


def m_softplus_no_a_log(c, kw):
    _softplus(c, kw, A_log=None)
    return "A_log", "requires A_log"


def m_a_log_shape(c, kw):
    _softplus(c, kw, A_log=rnd(c.HV + 1))
    return "A_log", "must hold HV"


def m_a_log_dtype(c, kw):
    _softplus(c, kw, A_log=torch.ones(c.HV, dtype=torch.int32))
    return "A_log", "dtype must be one of"


def m_dt_bias_shape(c, kw):
    _softplus(c, kw, dt_bias=rnd(c.HV * c.K + 1))
    return "dt_bias", "must hold HV*K"


def m_dt_bias_dtype(c, kw):
    _softplus(c, kw, dt_bias=torch.ones(c.HV, c.K, dtype=torch.int64))
    return "dt_bias", "dtype must be one of"


def m_a_log_pregated(c, kw):
    kw.update(use_gate_in_kernel=False, safe_gate=False, lower_bound=None, A_log=rnd(c.HV), dt_bias=None)
    return "A_log", "only with use_gate_in_kernel=True"


def m_dt_bias_pregated(c, kw):
    kw.update(use_gate_in_kernel=False, safe_gate=False, lower_bound=None, A_log=None, dt_bias=rnd(c.HV * c.K))
    return "dt_bias", "only with use_gate_in_kernel=True"


def m_h0_dtype(c, kw):
    shape = (c.N, c.HV, c.V, c.K) if c.v_first else (c.N, c.HV, c.K, c.V)
    kw["initial_state"] = rnd(*shape, dtype=torch.bfloat16)
    return "initial_state", "dtype must be float"


def m_h0_n(c, kw):
    shape = (c.N + 1, c.HV, c.V, c.K) if c.v_first else (c.N + 1, c.HV, c.K, c.V)
    kw["initial_state"] = rnd(*shape)
    return "initial_state", f"with N = {c.N} sequences"


def m_h0_layout(c, kw):
    if c.K == c.V:
        return None
    kw["initial_state"] = rnd(c.N, c.HV, c.V, c.K) if not c.v_first else rnd(c.N, c.HV, c.K, c.V)
    return "initial_state", "[N, HV, V, K]" if c.v_first else "[N, HV, K, V] ="


def m_cu_batch(c, kw):
    if c.cu is not None or c.B == 1:
        return None
    kw["cu_seqlens"] = torch.tensor([0, c.T])
    kw["initial_state"] = None
    return "cu_seqlens", "flattened to B == 1"


def m_cu_cpu_alone(c, kw):
    if c.cu is not None:
        return None
    kw["cu_seqlens_cpu"] = torch.tensor([0, c.T])
    return "cu_seqlens_cpu", "pass cu_seqlens too"


def _cu_values(c: Case, kw: dict[str, Any], values: list[int]) -> str:
    kw["cu_seqlens"] = torch.tensor(values, dtype=getattr(torch, c.cu_dtype))
    if c.cu_cpu:
        kw["cu_seqlens_cpu"] = kw["cu_seqlens"].clone()
        return "cu_seqlens_cpu"
    return "cu_seqlens"


def m_cu_end(c, kw):
    if c.cu is None:
        return None
    return _cu_values(c, kw, [*c.cu[:-1], c.T + 1]), f"must end at T = {c.T}"


def m_cu_start(c, kw):
    if c.cu is None:
        return None
    return _cu_values(c, kw, [1, *c.cu[1:]]), "must start at 0"


def m_cu_decreasing(c, kw):
    if c.cu is None:
        return None
    arg = _cu_values(c, kw, [0, c.T, c.T - 1, c.T])  # N becomes 3: keep initial_state consistent with it
    if c.h0:
        kw["initial_state"] = rnd(3, c.HV, c.V, c.K) if c.v_first else rnd(3, c.HV, c.K, c.V)
    return arg, "must be non-decreasing"


MUTATIONS: dict[str, Mutation] = {
    f.__name__: f
    for f in (
        m_q_3d,
        m_v_5d,
        m_k_shape,
        m_v_time,
        m_g_shape,
        m_beta_shape,
        m_q_int,
        m_k_dtype,
        m_g_int,
        m_beta_bool,
        m_chunk,
        m_scale,
        m_flag,
        m_not_tensor,
        m_neg_eig,
        m_safe_without_gate,
        m_safe_no_lb,
        m_safe_lb_range,
        m_lb_without_safe,
        m_softplus_no_a_log,
        m_a_log_shape,
        m_a_log_dtype,
        m_dt_bias_shape,
        m_dt_bias_dtype,
        m_a_log_pregated,
        m_dt_bias_pregated,
        m_h0_dtype,
        m_h0_n,
        m_h0_layout,
        m_cu_batch,
        m_cu_cpu_alone,
        m_cu_end,
        m_cu_start,
        m_cu_decreasing,
    )
}


@settings(max_examples=60, deadline=None, database=None, suppress_health_check=[HealthCheck.filter_too_much])
@given(cases(), st.sampled_from(sorted(MUTATIONS)))
def test_hypothesis_one_broken_rule(c: Case, mutation: str):
    kw = build(c)
    expected = MUTATIONS[mutation](c, kw)
    assume(expected is not None)
    argument, fragment = expected
    with pytest.raises(KDAInputError) as info:
        KDASpec.from_call(**kw)
    err = info.value
    assert err.argument == argument, f"{mutation}: {err}"
    assert fragment in err.rule, f"{mutation}: {err}"
    assert err.more == [], f"{mutation} broke more than one rule: {err}"


def test_a_repeated_call_reuses_its_validated_spec_and_bad_calls_always_raise():
    import torch as _torch

    import kda as _kda

    def call(**changes):
        base = {
            "q": _torch.randn(1, 8, 1, 4),
            "k": _torch.randn(1, 8, 1, 4),
            "v": _torch.randn(1, 8, 1, 4),
            "g": -_torch.rand(1, 8, 1, 4),
            "beta": _torch.rand(1, 8, 1),
        }
        return {**base, **changes}

    first = _kda.KDASpec.from_call(**call())
    assert _kda.KDASpec.from_call(**call()) is first  # same shapes, dtypes, devices and flags
    assert _kda.KDASpec.from_call(**call(output_final_state=True)) is not first
    assert _kda.KDASpec.from_call(**call(scale=0.3)).scale == 0.3
    for _ in range(2):  # a failure is never remembered as a pass
        with pytest.raises(_kda.KDAInputError, match="beta"):
            _kda.KDASpec.from_call(**call(beta=_torch.rand(1, 8, 2)))
    varlen = call(cu_seqlens=_torch.tensor([0, 3, 8]))
    spec = _kda.KDASpec.from_call(**varlen)
    assert spec.cu_seqlens_values == (0, 3, 8)
    other_batch = _kda.KDASpec.from_call(**call(cu_seqlens=_torch.tensor([0, 5, 8])))
    assert other_batch.cu_seqlens_values == (0, 5, 8) and other_batch.routing_key == spec.routing_key
    with pytest.raises(_kda.KDAInputError, match="cu_seqlens"):
        _kda.KDASpec.from_call(**call(cu_seqlens=_torch.tensor([0, 9, 8])))


def test_every_option_reaches_the_spec_and_its_memo_key():
    """Each option of the declaration, set to a valid non-default value, gives the spec a fresh build
    would: none is left out of the memo key (which would hand back an earlier call's spec)."""
    HV, K = 2, 4
    base = make(B=1, T=6, H=1, HV=HV, K=K, V=K)
    gate = {"use_gate_in_kernel": True, "A_log": rnd(HV)}
    safe = {"use_gate_in_kernel": True, "safe_gate": True, "lower_bound": -1.0}
    variants: list[dict[str, Any]] = [
        {},
        {"scale": 0.3},
        {"output_final_state": True},
        {"use_qk_l2norm_in_kernel": True},
        gate,
        {**gate, "dt_bias": rnd(HV * K)},
        {"use_beta_sigmoid_in_kernel": True},
        {"use_beta_sigmoid_in_kernel": True, "allow_neg_eigval": True},
        safe,
        {**safe, "lower_bound": -2.0},
        {"disable_recompute": True},
        {"state_v_first": True, "output_final_state": True},
        {"chunk_size": 32},
        {"initial_state": torch.randn(1, HV, K, K)},
        {"cu_seqlens": torch.tensor([0, 2, 6])},
        {"cu_seqlens": torch.tensor([0, 4, 6]), "cu_seqlens_cpu": torch.tensor([0, 4, 6])},
        {"return_intermediate_states": True},
        {"use_graph": True},
        {"use_graph": True, "max_num_seqs": 2, "cu_seqlens": torch.tensor([0, 6, 6])},
    ]
    covered = {name for variant in variants for name in variant}
    assert set(options.OPTIONS) <= covered, "a new option needs a variant here"
    assert set(options.TENSORS) - {"q", "k", "v", "g", "beta"} <= covered

    spec_module._spec_memo.clear()
    warm = [KDASpec.from_call(**base, **variant) for variant in variants]
    assert len({s.model_dump_json() for s in warm}) == len(variants)  # all different
    for variant, first in zip(variants, warm):
        assert KDASpec.from_call(**base, **variant) is first  # the memo served it
        for name, value in variant.items():
            if name in options.OPTIONS:
                assert getattr(first, name) == value, name
    for variant, first in zip(variants, warm):
        spec_module._spec_memo.clear()
        assert KDASpec.from_call(**base, **variant) == first  # what a fresh build gives
    # from_call takes the declaration's arguments, by name and by position
    args = options.KDAArguments(**base, scale=0.5)
    assert KDASpec.from_args(args) == KDASpec.from_call(*(getattr(args, n) for n in options.NAMES[:6]))
    assert dataclasses.replace(args, chunk_size=32) != args


def test_spec_defaults_agree_with_the_declaration():
    for name in options.OPTIONS:
        field = KDASpec.model_fields[name]
        if name == "scale":  # the spec holds the resolved scale: K ** -0.5 when the call passed None
            assert field.is_required()
            continue
        assert field.default == options.DEFAULTS[name], name
    for name in options.TENSORS:
        assert KDASpec.model_fields[name].is_required() is (name in options.REQUIRED), name


@pytest.mark.parametrize("name, value", [("cp_context", object())])
def test_from_call_refuses_the_fla_only_options(name, value):
    with pytest.raises(KDAInputError) as info:
        KDASpec.from_call(**make(), **{name: value})
    assert info.value.argument == name and "not supported" in info.value.rule
    KDASpec.from_call(**make(), **{name: options.FLA_ONLY[name]})  # the default is accepted


# ----------------------------------------------------------------------------------------------- FLA's extra modes


def test_intermediate_states_need_a_call_without_gradients():
    a = make()
    a["q"].requires_grad_(True)
    rejects(a, "return_intermediate_states", "without gradients", return_intermediate_states=True)
    with torch.no_grad():
        spec = call(a, return_intermediate_states=True)
    states = spec.case_class.key.split("/")[6].split(":")[0].split("+")
    assert spec.case_class.intermediate_states and "hc" in states
    rejects(
        make(),
        "disable_recompute",
        "return_intermediate_states",
        return_intermediate_states=True,
        disable_recompute=True,
    )


def test_intermediate_states_shape_counts_each_sequences_chunks():
    a = make(B=1, T=70)
    spec = call(a, return_intermediate_states=True, chunk_size=32, cu_seqlens=torch.tensor([0, 33, 33, 70]))
    assert spec.intermediate_states_shape() == (1, 2 + 0 + 2, spec.HV, spec.K, spec.V)
    dense = call(make(B=2, T=70), return_intermediate_states=True, chunk_size=64, state_v_first=True)
    assert dense.intermediate_states_shape() == (2, 2, dense.HV, dense.V, dense.K)


def test_graph_mode_rules():
    call(make(), use_graph=True)
    rejects(make(), "max_num_seqs", "use_graph=True", max_num_seqs=2)
    rejects(
        make(B=1, T=6),
        "max_num_seqs",
        "must equal the number of sequences",
        use_graph=True,
        max_num_seqs=3,
        cu_seqlens=torch.tensor([0, 6, 6]),
    )
    rejects(make(), "max_num_seqs", "positive int", use_graph=True, max_num_seqs=0)
    spec = call(make(B=1, T=6), use_graph=True, cu_seqlens=torch.tensor([0, 2, 6]))
    assert spec.case_class.graph and "/varlen:graph/" in spec.case_class.key
    assert CaseClass.from_key(spec.case_class.key) == spec.case_class


def test_cu_seqlens_cpu_alone_says_what_fla_would_do():
    err = rejects(make(B=1, T=6), "cu_seqlens_cpu", "pass cu_seqlens too", cu_seqlens_cpu=torch.tensor([0, 2, 6]))
    assert "dense" in err.rule
