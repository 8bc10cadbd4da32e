"""The `flashkda` adapter, against stand-in `flash_kda` modules (no GPU needed).

What is proven here: its support rules (each requirement named when broken), the conversions it makes
(state layout in and out, int32 cu_seqlens, flat dt_bias, missing A_log / dt_bias), that it writes every
element of the output buffers it is given, and, the reason the verifier exists, that a `flash_kda` which
imports but computes garbage or raises (as wheels built for another torch do) is caught by verification
and never used, while a correct one is used.
"""

from __future__ import annotations

import sys
import types
from typing import Any

import pytest
import torch

import kda
from kda.backends.base import KDAInputs, KDAOutputs, Verdict
from kda.backends.flashkda import FlashKDABackend
from kda.reference import kda_reference
from kda.spec import CaseClass, GateMode, KDASpec, TensorInfo
from kda.verify.check import relative_error, verify_class

# ----------------------------------------------------------------------------------------- stand-ins


def reference_fwd(
    q, k, v, g, beta, scale, out, A_log, dt_bias, lower_bound, initial_state=None, final_state=None, cu_seqlens=None
):
    """What FlashKDA computes, in float64, with its calling convention: states [N, H, V, K], dt_bias
    [H, K], int64 cu_seqlens, `out` written in place."""
    assert cu_seqlens is None or cu_seqlens.dtype == torch.int64, "FlashKDA takes int64 cu_seqlens"
    assert dt_bias.shape == (q.shape[2], q.shape[3]), "FlashKDA takes dt_bias as [H, K]"
    assert A_log.shape == (q.shape[2],) and A_log.dtype == torch.float32
    for t in (q, k, v, g, beta, out):
        assert t.dtype == torch.bfloat16 and t.is_contiguous()
    h0 = None if initial_state is None else initial_state.double()
    o, state = kda_reference(
        q.double(),
        k.double(),
        v.double(),
        g.double(),
        beta.double(),
        scale=scale,
        initial_state=h0,
        output_final_state=final_state is not None,
        use_qk_l2norm_in_kernel=True,
        use_gate_in_kernel=True,
        use_beta_sigmoid_in_kernel=True,
        safe_gate=True,
        lower_bound=lower_bound,
        A_log=A_log.double(),
        dt_bias=dt_bias.double(),
        cu_seqlens=cu_seqlens,
        state_v_first=True,
    )
    out.copy_(o)
    if final_state is not None:
        final_state.copy_(state)


def install(monkeypatch, fwd) -> dict[str, int]:
    """Put a stand-in `flash_kda` module in sys.modules; returns a call counter."""
    calls = {"n": 0}

    def counting(*args: Any, **kwargs: Any):
        calls["n"] += 1
        return fwd(*args, **kwargs)

    monkeypatch.setitem(sys.modules, "flash_kda", types.SimpleNamespace(fwd=counting))
    return calls


class CPUFlashKDA(FlashKDABackend):
    """The real adapter, allowed on the CPU so that its logic runs here; every other rule is kept."""

    def available(self) -> Verdict:
        return self.imports()

    def supports(self, spec: KDASpec) -> Verdict:
        if spec.device.type == "cpu":
            return super().supports(spec.model_copy(update={"q": spec.q.model_copy(update={"device": "cuda:0"})}))
        return super().supports(spec)


@pytest.fixture
def on_cpu(monkeypatch):
    """Register the CPU-allowed adapter under the name `flashkda` and pretend the GPU check passes."""
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (9, 0))
    kda.register_backend(CPUFlashKDA, replace=True)


def inference_call(
    *,
    B: int = 2,
    T: int = 37,
    H: int = 2,
    K: int = 128,
    varlen: bool = False,
    state_v_first: bool = False,
    int32: bool = False,
    flat_dt_bias: bool = True,
    with_A_log: bool = True,
) -> dict[str, Any]:
    bf16 = torch.bfloat16
    if varlen:
        B = 1
    call: dict[str, Any] = {
        "q": torch.randn(B, T, H, K, dtype=bf16),
        "k": torch.randn(B, T, H, K, dtype=bf16),
        "v": torch.randn(B, T, H, K, dtype=bf16),
        "g": (torch.randn(B, T, H, K) * 2).to(bf16),
        "beta": torch.randn(B, T, H, dtype=bf16),
        "use_qk_l2norm_in_kernel": True,
        "use_gate_in_kernel": True,
        "use_beta_sigmoid_in_kernel": True,
        "safe_gate": True,
        "lower_bound": -5.0,
        "output_final_state": True,
        "state_v_first": state_v_first,
        "dt_bias": torch.randn(H * K) * 0.5 if flat_dt_bias else torch.randn(H, K) * 0.5,
    }
    if with_A_log:
        call["A_log"] = torch.rand(H) * 2
    N = 3 if varlen else B
    if varlen:
        call["cu_seqlens"] = torch.tensor([0, 11, 11, T], dtype=torch.int32 if int32 else torch.int64)
    call["initial_state"] = torch.randn(N, H, K, K) * 0.3
    return call


def spec_with(**changes: Any) -> KDASpec:
    """A valid inference spec on cuda:0, built from TensorInfos (no tensors, no GPU), with changes."""
    B, T, H, HV, K, V = 1, 64, 2, 2, 128, 128
    dtype = changes.pop("dtype", "bfloat16")
    HV = changes.pop("HV", HV)
    K = changes.pop("K", K)
    V = changes.pop("V", V)
    device = changes.pop("device", "cuda:0")

    def info(*shape: int, dt: str = dtype) -> TensorInfo:
        return TensorInfo(shape=shape, dtype=dt, device=device)

    fields: dict[str, Any] = dict(
        q=info(B, T, H, K),
        k=info(B, T, H, K),
        v=info(B, T, HV, V),
        g=info(B, T, HV, K),
        beta=info(B, T, HV),
        A_log=info(HV, dt="float32"),
        dt_bias=info(HV * K, dt="float32"),
        scale=K**-0.5,
        use_qk_l2norm_in_kernel=True,
        use_gate_in_kernel=True,
        use_beta_sigmoid_in_kernel=True,
        safe_gate=True,
        lower_bound=-5.0,
    )
    fields.update(changes)
    return KDASpec(**fields)


# ------------------------------------------------------------------------------------ support rules


def test_supports_exactly_the_fused_configuration(monkeypatch):
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (9, 0))
    backend = FlashKDABackend()
    assert backend.supports(spec_with())
    assert backend.supports(spec_with(state_v_first=True, chunk_size=32))  # converted / not relevant

    broken = {
        "dtype": (spec_with(dtype="float16"), "must be bfloat16"),
        "K": (spec_with(K=64, dt_bias=TensorInfo(shape=(2 * 64,), dtype="float32", device="cuda:0")), "K = V = 128"),
        "V": (spec_with(V=64), "K = V = 128"),
        "gva": (
            spec_with(
                HV=4,
                A_log=TensorInfo(shape=(4,), dtype="float32", device="cuda:0"),
                dt_bias=TensorInfo(shape=(4 * 128,), dtype="float32", device="cuda:0"),
            ),
            "HV == H",
        ),
        "pregated": (
            spec_with(use_gate_in_kernel=False, safe_gate=False, lower_bound=None, A_log=None, dt_bias=None),
            "safe in-kernel gate",
        ),
        "softplus": (spec_with(safe_gate=False, lower_bound=None), "safe in-kernel gate"),
        "no l2norm": (spec_with(use_qk_l2norm_in_kernel=False), "use_qk_l2norm_in_kernel=True"),
        "given beta": (spec_with(use_beta_sigmoid_in_kernel=False), "use_beta_sigmoid_in_kernel=True"),
        "2 sigmoid": (spec_with(allow_neg_eigval=True), "allow_neg_eigval"),
        "cpu": (spec_with(device="cpu"), "CUDA only"),
    }
    for name, (spec, words) in broken.items():
        verdict = backend.supports(spec)
        assert not verdict, name
        assert any(words in reason for reason in verdict.reasons), (name, verdict.reasons)

    g_fp32 = spec_with(g=TensorInfo(shape=(1, 64, 2, 128), dtype="float32", device="cuda:0"))
    assert not backend.supports(g_fp32) and "g must be bfloat16" in str(backend.supports(g_fp32))
    everything = spec_with(dtype="float16", use_qk_l2norm_in_kernel=False, allow_neg_eigval=True)
    assert len(backend.supports(everything).reasons) >= 6  # every broken rule is listed, not just the first

    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (8, 0))
    assert "compute capability >= 9.0" in str(backend.supports(spec_with()))


def test_available_says_why_not(monkeypatch):
    monkeypatch.setitem(sys.modules, "flash_kda", None)  # import fails
    verdict = FlashKDABackend().available()
    assert not verdict and "does not import" in str(verdict) and "tokenspeed-flashkda" in str(verdict)

    monkeypatch.setitem(sys.modules, "flash_kda", types.SimpleNamespace())
    assert "no callable `fwd`" in str(FlashKDABackend().available())

    install(monkeypatch, reference_fwd)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert "needs a CUDA GPU" in str(FlashKDABackend().available())

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (8, 9))
    assert "compute capability >= 9.0" in str(FlashKDABackend().available())
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (9, 0))
    verdict = FlashKDABackend().available()
    assert verdict and "proves nothing" in str(verdict)


# ------------------------------------------------------------------------------------- conversions


@pytest.mark.parametrize("varlen", [False, True], ids=["dense", "varlen"])
@pytest.mark.parametrize("state_v_first", [False, True], ids=["kv", "vk"])
def test_forward_converts_layouts_and_writes_every_output(seed, monkeypatch, varlen, state_v_first):
    calls = install(monkeypatch, reference_fwd)
    call = inference_call(
        varlen=varlen, state_v_first=state_v_first, int32=varlen, flat_dt_bias=not varlen, with_A_log=not varlen
    )
    spec = KDASpec.from_call(**call)
    inputs = KDAInputs(**{n: call.get(n) for n in KDAInputs.__dataclass_fields__ if n in call})
    before = {n: t.clone() for n, t in call.items() if isinstance(t, torch.Tensor)}
    out = KDAOutputs(
        o=torch.full((spec.B, spec.T, spec.HV, spec.V), float("nan"), dtype=torch.bfloat16),
        final_state=torch.full(spec.state_shape, float("nan")),
    )
    result = FlashKDABackend().forward(inputs, spec, out)
    assert calls["n"] == 1
    assert result.o is out.o and result.final_state is out.final_state

    ref_call = {
        n: (t.double() if isinstance(t, torch.Tensor) and t.is_floating_point() else t) for n, t in call.items()
    }
    o_ref, state_ref = kda_reference(**ref_call)
    assert relative_error(result.o, o_ref) < 5e-3  # bf16 output rounding only
    assert relative_error(result.final_state, state_ref) < 1e-6  # the state is fp32: layout errors show
    for name, tensor in before.items():
        assert torch.equal(tensor, call[name]), f"{name} was modified"

    # Without output buffers, the state comes back in the call's layout, contiguous.
    fresh = FlashKDABackend().forward(inputs, spec)
    assert fresh.final_state.shape == spec.state_shape and fresh.final_state.is_contiguous()
    assert relative_error(fresh.final_state, state_ref) < 1e-6


# ------------------------------------------------------------------------------------ verification

INFERENCE = CaseClass(
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
    head_dim=128,
    training=False,
)


def test_a_flash_kda_that_imports_then_raises_is_caught(seed, monkeypatch, on_cpu):
    """The H200 machine's post20260810 wheel: imports under torch 2.11, then every call raises."""

    def broken_build(*args, **kwargs):
        raise RuntimeError("all tensors must be on CUDA")

    calls = install(monkeypatch, broken_build)
    backend = kda.get_backend("flashkda")
    assert kda.registry.availability(backend)  # importing proves nothing ...
    result = verify_class(backend, INFERENCE, "cpu", quick=False)
    assert not result.passed and not result.unsupported  # ... verification catches it
    assert "all tensors must be on CUDA" in result.reason
    assert calls["n"] >= 1

    call = inference_call()
    with pytest.raises(kda.BackendSelectionError) as error:
        kda.chunk_kda(**call, backend="flashkda")
    assert any("all tensors must be on CUDA" in r for r in error.value.reasons["flashkda"])
    with kda.trace_routes() as routes:
        kda.chunk_kda(**call)  # auto: never the broken backend
    assert [r.backend for r in routes] == ["torch"]


@pytest.mark.parametrize("fault", ["garbage", "writes_nothing", "drops_initial_state"])
def test_a_wrong_flash_kda_fails_verification(seed, monkeypatch, on_cpu, fault):
    def faulty(
        q, k, v, g, beta, scale, out, A_log, dt_bias, lower_bound, initial_state=None, final_state=None, cu_seqlens=None
    ):
        if fault == "writes_nothing":
            return
        if fault == "garbage":
            reference_fwd(
                q, k, v, g, beta, scale, out, A_log, dt_bias, lower_bound, initial_state, final_state, cu_seqlens
            )
            out.mul_(1.05)  # 5% off: far above the 5e-3 tolerance, still plausible-looking numbers
            return
        reference_fwd(q, k, v, g, beta, scale, out, A_log, dt_bias, lower_bound, None, final_state, cu_seqlens)

    install(monkeypatch, faulty)
    result = verify_class(kda.get_backend("flashkda"), INFERENCE, "cpu", quick=False)
    assert not result.passed
    assert "rel. error" in result.reason


def test_a_correct_flash_kda_passes_and_auto_uses_it(seed, monkeypatch, on_cpu):
    calls = install(monkeypatch, reference_fwd)
    result = verify_class(kda.get_backend("flashkda"), INFERENCE, "cpu", quick=False)
    assert result.passed, result.reason
    with kda.trace_routes() as routes:
        kda.chunk_kda(**inference_call())  # flashkda's priority (20) is above torch's (0)
    assert [r.backend for r in routes] == ["flashkda"]
    assert calls["n"] > 0

    training = inference_call()
    training["q"].requires_grad_(True)
    with kda.trace_routes() as routes:
        _o, _ = kda.chunk_kda(**training)
    assert [r.backend for r in routes] == ["torch"]  # forward-only: never for a call that needs gradients


def test_verifier_treats_training_classes_as_unsupported_for_forward_only(seed, monkeypatch, on_cpu):
    install(monkeypatch, reference_fwd)
    result = verify_class(
        kda.get_backend("flashkda"), INFERENCE.model_copy(update={"training": True}), "cpu", quick=True
    )
    assert result.unsupported and "forward-only" in result.reason
