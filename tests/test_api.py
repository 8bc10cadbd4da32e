"""Tests of the public entry point `kda.chunk_kda` and `kda.explain`: FLA 0.6 argument compatibility,
the options kda refuses, and that bad input is rejected before any backend runs."""

from __future__ import annotations

import inspect
import os
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.nn.functional as F

import kda
from kda import api, options
from kda.backends.torch import TorchBackend
from kda.verify import relative_error
from kda.verify.check import is_verifying as in_verification

# fla, flashkda, triton, helion and tilelang are built in, and unavailable on a machine without their packages or a GPU;
# the tests below are about the other backends, so they leave those out of their lists.
ADAPTERS = {"fla", "flashkda", "triton", "helion", "tilelang"}


def own_names() -> list[str]:
    return [b.name for b in kda.registered_backends() if b.name not in ADAPTERS]


_EMPTY = inspect.Parameter.empty

# fla.ops.kda.chunk_kda 0.6: positional parameters, in order, with defaults.
FLA_POSITIONAL = [
    ("q", _EMPTY),
    ("k", _EMPTY),
    ("v", _EMPTY),
    ("g", _EMPTY),
    ("beta", _EMPTY),
    ("scale", None),
    ("initial_state", None),
    ("output_final_state", False),
    ("use_qk_l2norm_in_kernel", False),
    ("use_gate_in_kernel", False),
    ("use_beta_sigmoid_in_kernel", False),
    ("allow_neg_eigval", False),
    ("safe_gate", False),
    ("lower_bound", None),
    ("disable_recompute", False),
    ("return_intermediate_states", False),
    ("state_v_first", False),
    ("cu_seqlens", None),
    ("cu_seqlens_cpu", None),
    ("cp_context", None),
    ("use_graph", False),
    ("max_num_seqs", None),
]


class SpyBackend(TorchBackend):
    """The torch numbers under another name and the top priority; counts every forward call."""

    name = "spy"
    version = "1"
    priority = 100

    def __init__(self):
        self.calls = 0
        self.verify_calls = 0

    def forward(self, inputs, spec, out=None):
        if in_verification():
            self.verify_calls += 1
        else:
            self.calls += 1
        return super().forward(inputs, spec, out)


class UnavailableBackend(TorchBackend):
    name = "unavailable"
    priority = 200

    def available(self):
        return kda.Verdict.no("needs an sm_90 GPU")


class ForwardOnlyBackend(TorchBackend):
    name = "fwd_only"
    priority = 300
    trains = False


def inputs(
    T: int = 40, H: int = 1, HV: int | None = None, K: int = 16, V: int = 16, dtype: torch.dtype = torch.float32
) -> dict[str, Any]:
    HV = H if HV is None else HV
    return {
        "q": F.normalize(torch.randn(1, T, H, K), dim=-1).to(dtype),
        "k": F.normalize(torch.randn(1, T, H, K), dim=-1).to(dtype),
        "v": torch.randn(1, T, HV, V).to(dtype),
        "g": F.logsigmoid(torch.randn(1, T, HV, K) + 1.0),
        "beta": (torch.rand(1, T, HV) * 0.9 + 0.05).to(dtype),
    }


def reference(call: dict[str, Any]) -> tuple[torch.Tensor, torch.Tensor | None]:
    ref_args = {n: a for n, a in call.items() if n not in ("chunk_size", "backend", "cu_seqlens_cpu")}
    return kda.kda_reference(**ref_args)


def verification_dir() -> Path:
    return Path(os.environ["KDA_CACHE_DIR"]) / "verification"


# ------------------------------------------------------------------------------------------- signature


def test_signature_is_fla_compatible():
    params = list(inspect.signature(kda.chunk_kda).parameters.values())
    positional = [p for p in params if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)]
    assert [p.name for p in positional] == [name for name, _ in FLA_POSITIONAL]
    for p, (name, default) in zip(positional, FLA_POSITIONAL):
        assert p.kind is p.POSITIONAL_OR_KEYWORD, name  # callable by position and by keyword
        assert p.default is default or (type(p.default) is type(default) and p.default == default), (
            f"{name}: default {p.default!r}, FLA has {default!r}"
        )
    keyword_only = {p.name: p.default for p in params if p.kind is p.KEYWORD_ONLY}
    assert {"backend", "A_log", "dt_bias", "chunk_size"} <= set(keyword_only)
    assert keyword_only["backend"] == "auto" and keyword_only["A_log"] is None and keyword_only["dt_bias"] is None
    assert keyword_only["chunk_size"] == 64


def test_signature_agrees_with_the_one_declaration():
    """chunk_kda restates the argument list of `kda.options.KDAArguments` explicitly (for IDEs and help());
    this holds the two together: same names, order, kinds and defaults, plus ``backend`` and ``**kwargs``."""
    params = inspect.signature(kda.chunk_kda).parameters
    declared = inspect.signature(options.KDAArguments).parameters
    own = {name: p for name, p in params.items() if name not in ("backend", "kwargs")}
    assert list(own) == list(declared) == list(options.NAMES)
    for name, p in own.items():
        d = declared[name]
        assert p.kind is d.kind, name
        assert p.default is d.default or (type(p.default) is type(d.default) and p.default == d.default), name
        assert p.annotation == d.annotation, name
    assert params["backend"].kind is inspect.Parameter.KEYWORD_ONLY and params["backend"].default == "auto"
    assert params["kwargs"].kind is inspect.Parameter.VAR_KEYWORD
    assert [name for name, _ in FLA_POSITIONAL] == [n for n in options.NAMES if n not in options.KEYWORD_ONLY]
    # every parameter is documented
    doc = inspect.getdoc(kda.chunk_kda) or ""
    args_section = doc.split("Args:", 1)[1].split("Returns:", 1)[0]
    for name in params:
        label = "**kwargs" if name == "kwargs" else name
        assert f"\n    {label}: " in args_section, f"{name} is not documented"


def test_explain_and_the_reference_take_the_same_arguments():
    assert inspect.signature(kda.explain).parameters == inspect.signature(kda.chunk_kda).parameters
    reference = inspect.signature(kda.kda_reference).parameters
    assert list(reference) == [*options.NAMES, "compute_dtype"]
    assert all(reference[n].default == options.DEFAULTS.get(n, _EMPTY) for n in options.NAMES)


def test_every_argument_is_passed_on(monkeypatch):
    """Each of chunk_kda's parameters (by position, or by keyword for the keyword-only ones) arrives in
    the `KDAArguments` it hands on, under its own name."""
    seen: list[options.KDAArguments] = []

    class Stop(Exception):
        pass

    def capture(args, extra):
        seen.append(args)
        raise Stop

    def capture_cp(args, extra, backend, local):  # a call with cp_context goes to kda.distributed instead
        return capture(args, extra)

    from kda import distributed

    monkeypatch.setattr(api, "_prepare", capture)
    monkeypatch.setattr(distributed, "chunk_kda_cp", capture_cp)
    sentinels = {name: object() for name in options.NAMES}
    positional = [sentinels[n] for n in options.NAMES if n not in options.KEYWORD_ONLY]
    keyword = {n: sentinels[n] for n in options.KEYWORD_ONLY}
    for function in (kda.chunk_kda, kda.explain):
        seen.clear()
        with pytest.raises(Stop):
            function(*positional, **keyword)
        assert {n: getattr(seen[0], n) for n in options.NAMES} == sentinels


def test_all_fla_arguments_by_position(seed):
    call = inputs(K=16, V=8)
    h0 = torch.randn(1, 1, 16, 8)
    # q, k, v, g, beta, scale, initial_state, output_final_state, l2norm, gate, beta_sigmoid, neg_eig,
    # safe_gate, lower_bound, disable_recompute, return_intermediate_states, state_v_first, cu_seqlens,
    # cu_seqlens_cpu, cp_context, use_graph, max_num_seqs
    by_position = kda.chunk_kda(
        call["q"],
        call["k"],
        call["v"],
        call["g"],
        call["beta"],
        0.3,
        h0,
        True,
        True,
        False,
        True,
        True,
        False,
        None,
        True,
        False,
        False,
        None,
        None,
        None,
        False,
        None,
    )
    by_keyword = kda.chunk_kda(
        **call,
        scale=0.3,
        initial_state=h0,
        output_final_state=True,
        use_qk_l2norm_in_kernel=True,
        use_beta_sigmoid_in_kernel=True,
        allow_neg_eigval=True,
        disable_recompute=True,
    )
    torch.testing.assert_close(by_position[0], by_keyword[0], rtol=0, atol=0)
    torch.testing.assert_close(by_position[1], by_keyword[1], rtol=0, atol=0)
    ref_o, ref_state = reference(
        {
            **call,
            "scale": 0.3,
            "initial_state": h0,
            "output_final_state": True,
            "use_qk_l2norm_in_kernel": True,
            "use_beta_sigmoid_in_kernel": True,
            "allow_neg_eigval": True,
        }
    )
    assert relative_error(by_position[0], ref_o) < 1e-3
    assert relative_error(by_position[1], ref_state) < 1e-3


@pytest.mark.parametrize("safe", [False, True], ids=["softplus", "safe"])
def test_gate_parameters_as_keywords(seed, safe):
    call = inputs(H=1, HV=2)
    call["g"] = torch.randn(1, 40, 2, 16)  # the raw gate input
    extra: dict[str, Any] = {
        "use_gate_in_kernel": True,
        "A_log": torch.rand(2) * 2,
        "dt_bias": torch.randn(2, 16),
        "chunk_size": 32,
    }
    if safe:
        extra.update(safe_gate=True, lower_bound=-5.0)
    o, final = kda.chunk_kda(**call, **extra)
    assert final is None and o.shape == (1, 40, 2, 16)
    ref, _ = reference({**call, **extra})
    assert relative_error(o, ref) < 1e-3
    # chunk_size changes the route through the algorithm, not the result
    o64, _ = kda.chunk_kda(**call, **{**extra, "chunk_size": 64})
    assert relative_error(o64, ref) < 1e-3
    with pytest.raises(kda.KDAInputError) as error:
        kda.chunk_kda(**call, **{**extra, "chunk_size": 48})
    assert error.value.argument == "chunk_size"


def test_transpose_state_layout_is_an_alias_of_state_v_first(seed):
    K, V = 16, 8  # K != V, so the two layouts differ in shape
    call = inputs(K=K, V=V)
    h0_vk = torch.randn(1, 1, V, K)
    o_alias, s_alias = kda.chunk_kda(**call, initial_state=h0_vk, output_final_state=True, transpose_state_layout=True)
    o_new, s_new = kda.chunk_kda(**call, initial_state=h0_vk, output_final_state=True, state_v_first=True)
    assert s_alias.shape == (1, 1, V, K)
    torch.testing.assert_close(o_alias, o_new, rtol=0, atol=0)
    torch.testing.assert_close(s_alias, s_new, rtol=0, atol=0)
    o_kv, s_kv = kda.chunk_kda(**call, initial_state=h0_vk.transpose(-1, -2).contiguous(), output_final_state=True)
    torch.testing.assert_close(o_kv, o_alias, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(s_kv.transpose(-1, -2), s_alias, rtol=1e-5, atol=1e-6)

    with pytest.raises(kda.KDAInputError) as error:  # the alias really switched the layout
        kda.chunk_kda(**call, initial_state=h0_vk.transpose(-1, -2).contiguous(), transpose_state_layout=True)
    assert error.value.argument == "initial_state"
    with pytest.raises(kda.KDAInputError) as error:
        kda.chunk_kda(**call, initial_state=h0_vk, state_v_first=True, transpose_state_layout=True)
    assert error.value.argument == "transpose_state_layout"


def test_head_first_true_raises_input_error_before_any_work(seed):
    call = inputs()
    with kda.trace_routes() as routes, pytest.raises(kda.KDAInputError) as error:
        kda.chunk_kda(**call, head_first=True)
    assert routes == []
    assert error.value.argument == "head_first" and "head_first" in str(error.value)
    with pytest.raises(kda.KDAInputError) as error:
        kda.explain(**call, head_first=True)
    assert error.value.argument == "head_first"
    print(kda.explain(**call, head_first=False))  # FLA's default: accepted


@pytest.mark.parametrize(
    "name, value",
    [
        ("cp_context", object()),
        ("max_num_seqs", 4),  # without use_graph
    ],
)
def test_unsupported_fla_options_raise(seed, name, value):
    spy = SpyBackend()
    kda.register_backend(spy)
    call = inputs()
    with kda.trace_routes() as routes, pytest.raises(kda.KDAInputError) as error:
        kda.chunk_kda(**call, **{name: value})
    assert error.value.argument == name and name in str(error.value)
    assert routes == [] and spy.calls == 0 and spy.verify_calls == 0
    with pytest.raises(kda.KDAInputError):
        kda.explain(**call, **{name: value})
    # Passing the default explicitly is fine.
    default = dict(FLA_POSITIONAL)[name]
    o, _ = kda.chunk_kda(**call, **{name: default})
    assert o.shape == call["v"].shape


def test_returns_output_and_none_without_final_state(seed):
    call = inputs(H=2, HV=4)
    result = kda.chunk_kda(**call)
    assert isinstance(result, tuple) and len(result) == 2
    o, final = result
    assert final is None
    assert o.shape == (1, 40, 4, 16) and o.dtype == torch.float32
    ref, _ = reference(call)
    assert relative_error(o, ref) < 1e-3

    o2, final2 = kda.chunk_kda(**call, output_final_state=True)
    assert final2 is not None and final2.shape == (1, 4, 16, 16) and final2.dtype == torch.float32
    torch.testing.assert_close(o2, o, rtol=0, atol=0)


class ChattyBackend(TorchBackend):
    """Always returns a final state, asked for or not (a backend may; the API must not pass it on)."""

    name = "chatty"
    priority = 100

    def forward(self, inputs, spec, out=None):
        return super().forward(inputs, spec.model_copy(update={"output_final_state": True}), None)


def test_final_state_is_none_unless_asked_whatever_the_backend_returns(seed):
    kda.register_backend(ChattyBackend)
    call = {**inputs(), "chunk_size": 32}
    with kda.trace_routes() as routes:
        _o, final = kda.chunk_kda(**call)
    assert [r.backend for r in routes] == ["chatty"]
    assert final is None
    with kda.trace_routes() as routes:
        _o2, final2 = kda.chunk_kda(**call, output_final_state=True)
    assert [r.backend for r in routes] == ["chatty"] and final2 is not None


def test_output_in_q_dtype(seed):
    call = inputs(dtype=torch.bfloat16)
    o, final = kda.chunk_kda(**call, output_final_state=True)
    assert o.dtype == torch.bfloat16 and final.dtype == torch.float32


def _bad_inputs() -> dict[str, Any]:
    def with_(**changes: Any):
        return lambda call: {**call, **changes}

    return {
        "g-shape": (lambda c: {**c, "g": c["g"][:, :, :, :8]}, "g"),
        "k-shape": (lambda c: {**c, "k": c["k"][:, :-1]}, "k"),
        "beta-int": (lambda c: {**c, "beta": torch.randint(1, 5, c["beta"].shape)}, "beta"),
        "q-3d": (lambda c: {**c, "q": c["q"][0]}, "q"),
        "lower_bound-without-safe_gate": (with_(lower_bound=-1.0), "lower_bound"),
        "safe_gate-without-gate": (with_(safe_gate=True, lower_bound=-1.0), "safe_gate"),
        "softplus-without-A_log": (with_(use_gate_in_kernel=True), "A_log"),
        "chunk_size": (with_(chunk_size=16), "chunk_size"),
        "initial_state-shape": (lambda c: {**c, "initial_state": torch.randn(2, 1, 16, 16)}, "initial_state"),
        "cu_seqlens-end": (with_(cu_seqlens=torch.tensor([0, 10, 39])), "cu_seqlens"),
        "flag-not-bool": (with_(output_final_state="yes"), "output_final_state"),
        "q-none": (with_(q=None), "q"),
        "beta-none": (with_(beta=None), "beta"),
        "g-none": (with_(g=None), "g"),
        "meta-device": (lambda c: {n: t.to("meta") if isinstance(t, torch.Tensor) else t for n, t in c.items()}, "q"),
        "backend-none": (with_(backend=None), "backend"),
        "backend-int": (with_(backend=3), "backend"),
        "backend-empty-list": (with_(backend=[]), "backend"),
        "backend-list-of-int": (with_(backend=["torch", 3]), "backend"),
        "backend-dict": (with_(backend={"torch": 1}), "backend"),
    }


@pytest.mark.parametrize("kind", sorted(_bad_inputs()))
@pytest.mark.parametrize("requires_grad", [False, True], ids=["fwd", "train"])
def test_bad_input_is_rejected_before_any_backend_runs(seed, monkeypatch, kind, requires_grad):
    spy = SpyBackend()
    kda.register_backend(spy)
    torch_backend = kda.get_backend("torch")
    torch_calls = []
    original = torch_backend.forward
    monkeypatch.setattr(torch_backend, "forward", lambda *a, **kw: torch_calls.append(1) or original(*a, **kw))

    mutate, argument = _bad_inputs()[kind]
    call = mutate(inputs())
    if requires_grad:
        for name in ("q", "k", "v"):
            if call[name] is not None:
                call[name] = call[name].detach().requires_grad_(True)
    before = {n: t.detach().clone() for n, t in call.items() if isinstance(t, torch.Tensor)}

    with kda.trace_routes() as routes, pytest.raises(kda.KDAInputError) as error:
        kda.chunk_kda(**call)
    assert error.value.argument == argument, str(error.value)
    assert routes == []
    assert spy.calls == 0 and spy.verify_calls == 0 and torch_calls == []
    assert not verification_dir().exists(), "verification ran for an invalid call"
    for name, t in before.items():
        assert t.is_meta or torch.equal(call[name].detach(), t), f"{name} was modified"
        assert call[name].grad is None
    with pytest.raises(kda.KDAInputError):
        kda.explain(**call)


@pytest.mark.parametrize("device_type", ["cpu", "cuda"])
def test_meta_tensors_inside_autocast_are_an_input_error(seed, device_type):
    """Regression: under autocast the lazy verification failed inside torch with "unsupported scalarType"."""
    call = {n: t.to("meta") if isinstance(t, torch.Tensor) else t for n, t in inputs().items()}
    with torch.autocast(device_type, enabled=device_type == "cpu"), pytest.raises(kda.KDAInputError) as error:
        kda.chunk_kda(**call)
    assert error.value.argument == "q" and "meta" in str(error.value)
    assert not verification_dir().exists()


def test_valid_call_leaves_inputs_unmodified(seed):
    call = inputs(H=1, HV=2)
    call["initial_state"] = torch.randn(1, 2, 16, 16)
    for name in ("q", "k", "v", "g", "beta", "initial_state"):
        call[name].requires_grad_(True)
    before = {n: t.detach().clone() for n, t in call.items()}
    o, final = kda.chunk_kda(**call, output_final_state=True, use_beta_sigmoid_in_kernel=True, chunk_size=32)
    (o.square().sum() + final.sum()).backward()
    for name, t in before.items():
        assert t.is_meta or torch.equal(call[name].detach(), t), f"{name} was modified"
        assert call[name].grad is not None and call[name].grad.shape == t.shape


# --------------------------------------------------------------------------------------------- explain


def test_explain_names_the_chosen_backend_and_every_registered_one(seed):
    spy = SpyBackend()
    for backend in (spy, UnavailableBackend, ForwardOnlyBackend):
        kda.register_backend(backend)
    call = {**inputs(), "chunk_size": 32}
    for name in ("q", "k", "v"):
        call[name].requires_grad_(True)

    explanation = kda.explain(**call)
    text = str(explanation)
    assert isinstance(text, str) and isinstance(explanation, kda.Explanation)
    assert explanation.chosen == "spy"
    assert "chosen: spy" in text
    assert sorted(own_names()) == ["fwd_only", "spy", "torch", "unavailable"]
    registered = [b.name for b in kda.registered_backends()]
    assert [row[0] for row in explanation.rows()] == registered  # every backend, in priority order
    for name in registered:
        assert f"  {name}" in text
    assert "needs an sm_90 GPU" in text and "forward-only" in text
    assert repr(explanation) == text

    # explain and the call agree on the route
    with kda.trace_routes() as routes:
        kda.chunk_kda(**call)
    assert [r.backend for r in routes] == [explanation.chosen]
    assert spy.calls == 1

    narrowed = kda.explain(**call, backend="torch")
    assert narrowed.chosen == "torch" and "chosen: torch" in str(narrowed)
    not_requested = {row[0] for row in narrowed.rows() if row[1] == "not requested"}
    assert not_requested - ADAPTERS == {"spy", "unavailable", "fwd_only"}


def test_explain_when_nothing_can_serve(seed):
    kda.register_backend(UnavailableBackend)
    explanation = kda.explain(**inputs(), backend="unavailable")
    assert explanation.chosen is None
    assert "none" in str(explanation) and "needs an sm_90 GPU" in str(explanation)
