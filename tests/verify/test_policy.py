"""The accuracy policy (`kda.verify.policy`) and the holes a verifier must not have.

Each test here stands for a way a backend, or a record file, could fool the verifier: a backend wrong only
past its first chunks, an error that grows with T, a final state of the wrong dtype or shape, an input
written and put back, an upstream gradient modified by backward, a record that claims to pass. Every one
is a backend or a file that the verifier must reject, next to the honest one it must accept.
"""

from __future__ import annotations

import dataclasses
import json
import math
import re
from typing import Any

import pytest
import torch
import torch.nn.functional as F

import kda
from kda.backends.torch import TorchBackend
from kda.spec import CaseClass, GateMode
from kda.verify.cases import cases_for
from kda.verify.check import ClassResult, is_verifying, run_case, verify_class
from kda.verify.judge import assess
from kda.verify.policy import LONG_T, LOW_PRECISION_TOLERANCE, required_tensors, tolerance
from kda.verify.records import RECORD_FORMAT, default_store, fingerprint

# A cheap forward class with a final state, at chunk 32 (the chunk of the report: cases 77, 91, 29 long).
FWD = CaseClass(
    gate=GateMode.PREGATED, qk_l2norm=False, beta="given", dtype="float32", varlen=False, gva=False,
    initial_state=False, final_state=True, state_v_first=False, chunk_size=32, head_dim=64, training=False,
)  # fmt: skip
TRAIN = FWD.model_copy(update={"training": True, "dtype": "bfloat16"})
SMALL = {"K": 16, "V": 16}


class Tampering(kda.Backend):
    """The torch backend with one defect, chosen by `defect`; with no defect it is right."""

    name = "tampering"
    version = "1"
    priority = 100
    trains = True
    defect: str | None = None

    def __init__(self) -> None:
        self.torch = TorchBackend()
        self.calls = 0

    def supports(self, spec):
        return kda.Verdict.yes()

    def forward(self, inputs, spec, out=None):
        self.calls += 1
        result = self.torch.forward(inputs, spec, out)
        if self.defect == "wrong_past_100":
            result.o = result.o.clone()
            result.o[:, 100:] *= 1.5
        elif self.defect == "error_grows_with_T":  # like a state kept in low precision: drift along T
            t = torch.arange(spec.T, device=result.o.device, dtype=torch.float32)
            result.o = result.o * (1 + 2e-6 * t).to(result.o.dtype)[None, :, None, None]
        elif self.defect == "final_state_fp64" and result.final_state is not None:
            result.final_state = result.final_state.double()
        elif self.defect == "final_state_shape" and result.final_state is not None:
            result.final_state = result.final_state.transpose(-1, -2).contiguous()
        elif self.defect == "write_and_restore":
            with torch.no_grad():
                saved = inputs.k.clone()
                inputs.k.mul_(2.0)
                inputs.k.copy_(saved)
        return result

    def backward(self, inputs, spec, saved, do, dfinal_state):
        grads = self.torch.backward(inputs, spec, saved, do, dfinal_state)
        if self.defect == "modifies_do":
            do.mul_(0.5)
        elif self.defect == "modifies_dfinal_state" and dfinal_state is not None:
            dfinal_state.zero_()
        return grads


def tampering(defect: str | None) -> Tampering:
    backend = Tampering()
    backend.defect = defect
    return backend


def like(case_class: CaseClass, T: int = 64) -> kda.KDASpec:
    """A call of the class with small heads, so that the cases stay cheap on a CPU."""
    q = torch.randn(1, T, 2, SMALL["K"])
    v = torch.randn(1, T, 2, SMALL["V"])
    return kda.KDASpec.from_call(
        q=q, k=q, v=v, g=torch.randn(1, T, 2, SMALL["K"]), beta=torch.rand(1, T, 2),
        output_final_state=case_class.final_state, chunk_size=case_class.chunk_size,
    )  # fmt: skip


# ------------------------------------------------------------------------------------------ the policy


def test_tolerances_are_the_stated_policy():
    assert LOW_PRECISION_TOLERANCE["o"] == LOW_PRECISION_TOLERANCE["final_state"] == 8e-3
    assert tolerance("dq", "bfloat16") == 8e-3 and tolerance("dg", "float16") == 2e-2
    assert tolerance("dA_log", "bfloat16") == 1e-2 and tolerance("o", "float32") == 1e-3


@pytest.mark.parametrize("value", ["0.5", "1", " 0.25 ", "1e-1"])
def test_tolerance_scale_tightens_every_tolerance(monkeypatch, value):
    monkeypatch.setenv("KDA_TOLERANCE_SCALE", value)
    scale = float(value)
    for tensor, base in LOW_PRECISION_TOLERANCE.items():
        assert tolerance(tensor, "bfloat16") == pytest.approx(base * scale)
    assert tolerance("o", "float32") == pytest.approx(1e-3 * scale)


@pytest.mark.parametrize("value", ["2", "1.0001", "0", "-0.5", "nan", "inf", "abc", "1/2"])
def test_tolerance_scale_that_would_loosen_or_is_not_a_number_is_a_clear_error(seed, monkeypatch, value):
    monkeypatch.setenv("KDA_TOLERANCE_SCALE", value)
    q = F.normalize(torch.randn(1, 40, 1, 16), dim=-1)
    with pytest.raises(
        kda.KDAError, match=r"KDA_TOLERANCE_SCALE must be a number with 0 < s <= 1.*" + repr(value)[1:-1]
    ):
        kda.chunk_kda(q, q, torch.randn(1, 40, 1, 16), -torch.rand(1, 40, 1, 16), torch.rand(1, 40, 1))


def test_policy_change_needs_no_reverification(seed, monkeypatch):
    """A record keeps errors; a tighter scale turns a pass into a failure without running the backend."""
    key = FWD.key
    case = {"T": 141, "seq_lens": [141, 141], "unsupported": False, "problems": []}
    case["errors"] = {"o": 0.6e-3, "final_state": 0.2e-3}  # 0.6 of fp32's 1e-3
    cases = [case, {**case, "regime": "correlated"}]
    assert assess(key, cases, on_cuda=False).passed
    assert assess(key, cases, on_cuda=False).worst_ratio == pytest.approx(0.6)
    monkeypatch.setenv("KDA_TOLERANCE_SCALE", "0.5")
    judged = assess(key, cases, on_cuda=False)
    assert not judged.passed and judged.worst_ratio == pytest.approx(1.2) and "o rel. error" in judged.reason


def test_dispatcher_applies_the_scale_in_force_to_stored_errors(seed, monkeypatch):
    backend = tampering(None)
    kda.register_backend(backend)
    T = 40
    call = {
        "q": F.normalize(torch.randn(1, T, 1, 16), dim=-1), "k": F.normalize(torch.randn(1, T, 1, 16), dim=-1),
        "v": torch.randn(1, T, 1, 16), "g": F.logsigmoid(torch.randn(1, T, 1, 16) + 1), "beta": torch.rand(1, T, 1),
    }  # fmt: skip
    with kda.trace_routes() as routes:
        kda.chunk_kda(**call, backend="tampering")
    assert [r.backend for r in routes] == ["tampering"]
    record = default_store().get(backend, "cpu", kda.KDASpec.from_call(**call).case_class.key)
    ratio = record.worst_ratio
    assert 0 < ratio < 1
    verified_calls = backend.calls
    # A scale just below what the record measured rejects it, with no new verification.
    monkeypatch.setenv("KDA_TOLERANCE_SCALE", repr(ratio * 0.99))
    with pytest.raises(kda.BackendSelectionError, match=r"rel\. error"):
        kda.chunk_kda(**call, backend="tampering")
    assert backend.calls == verified_calls
    monkeypatch.setenv("KDA_TOLERANCE_SCALE", repr(min(1.0, ratio * 1.5)))
    kda.chunk_kda(**call, backend="tampering")
    assert backend.calls == verified_calls + 1


def test_explain_prints_each_verified_backends_worst_ratio(seed, monkeypatch):
    T = 40
    q = F.normalize(torch.randn(1, T, 1, 16), dim=-1)
    args = (q, q, torch.randn(1, T, 1, 16), F.logsigmoid(torch.randn(1, T, 1, 16)), torch.rand(1, T, 1))
    text = str(kda.explain(*args))
    record = default_store().get(kda.get_backend("torch"), "cpu", kda.KDASpec.from_call(*args).case_class.key)
    assert f"worst error {record.worst_ratio:.2f} of the tolerance in force (KDA_TOLERANCE_SCALE=1)" in text
    monkeypatch.setenv("KDA_TOLERANCE_SCALE", "0.5")
    assert f"worst error {record.worst_ratio * 2:.2f} of the tolerance in force (KDA_TOLERANCE_SCALE=0.5)" in str(
        kda.explain(*args)
    )


# ------------------------------------------------------------------------------------- cases too short


@pytest.mark.parametrize("quick", [True, False])
def test_every_class_has_a_case_over_four_chunks_with_a_ragged_tail(quick):
    for cc in (FWD, TRAIN, FWD.model_copy(update={"varlen": True, "chunk_size": 64})):
        lengths = [n for case in cases_for(cc, quick=quick) for n in case.seq_lens]
        assert any(n > 4 * cc.chunk_size and n % cc.chunk_size for n in lengths), (cc.key, lengths)


@pytest.mark.parametrize("quick", [True, False])
def test_backend_wrong_only_past_token_100_fails(seed, quick):
    result = verify_class(tampering("wrong_past_100"), FWD, "cpu", quick=quick, like=like(FWD))
    assert not result.passed and "o rel. error" in result.reason
    assert verify_class(tampering(None), FWD, "cpu", quick=quick, like=like(FWD)).passed


def test_record_without_a_case_over_four_chunks_is_not_accepted():
    short = {"T": 91, "seq_lens": [91, 91], "unsupported": False, "problems": [], "errors": {"o": 0, "final_state": 0}}
    judged = assess(FWD.key, [short], on_cuda=False)
    assert not judged.passed and "spans 4 chunks" in judged.reason


# ----------------------------------------------------------------------------------------- error growth


def test_long_case_is_added_on_cuda_for_forward_classes_only():
    long_cases = [c for c in cases_for(FWD, quick=True, long=True) if c.T >= LONG_T]
    assert len(long_cases) == 1 and long_cases[0].T % FWD.chunk_size and long_cases[0].regime == "realistic"
    assert all(c.T < LONG_T for c in cases_for(FWD, quick=False))


def test_error_that_grows_with_T_fails_the_long_case(seed):
    """On a CPU the long case is run by hand here, as verify_class does on CUDA."""
    backend = tampering("error_grows_with_T")
    results = [run_case(backend, case, "cpu") for case in cases_for(FWD, quick=True, like=like(FWD), long=True)]
    *short, long = results  # the realistic and the correlated case, then the long one
    assert all(r.passed for r in short), [r.reason for r in short]  # 2e-6 x 141 tokens: inside fp32's 1e-3
    assert not long.passed and long.case.T >= LONG_T and "o rel. error" in long.reason
    assert not ClassResult("tampering", FWD, results, "cuda").passed


def test_cuda_record_of_a_forward_class_needs_its_long_case():
    T = 4 * 32 + 13
    case = {"T": T, "seq_lens": [T, T], "unsupported": False, "problems": [], "errors": {"o": 0, "final_state": 0}}
    correlated = {**case, "regime": "correlated"}
    assert assess(FWD.key, [case, correlated], on_cuda=False).passed
    judged = assess(FWD.key, [case, correlated], on_cuda=True)
    assert not judged.passed and "no long case" in judged.reason
    long = {**case, "T": LONG_T + 27, "seq_lens": [LONG_T + 27]}
    assert assess(FWD.key, [case, correlated, long], on_cuda=True).passed
    training = {**correlated, "errors": dict.fromkeys(required_tensors(TRAIN), 0)}
    assert assess(TRAIN.key, [training], on_cuda=True).passed  # a training class needs no long case


def test_record_without_a_correlated_case_is_not_accepted():
    """A record that holds only random cases (a forged one, or one a later format would not make): the
    correlated case is where an inverse from the powers of ``A_kk`` fails, so it must be there."""
    T = 4 * 32 + 13
    case = {"T": T, "seq_lens": [T, T], "unsupported": False, "problems": [], "errors": {"o": 0, "final_state": 0}}
    judged = assess(FWD.key, [case, {**case, "regime": "extreme"}], on_cuda=False)
    assert not judged.passed and "no correlated case" in judged.reason
    assert assess(FWD.key, [case, {**case, "regime": "correlated"}], on_cuda=False).passed


# ------------------------------------------------------------------------------------ unchecked outputs


@pytest.mark.parametrize(
    ("defect", "message"),
    [
        ("final_state_fp64", "final_state is .* torch.float64"),
        ("final_state_shape", "final_state is"),
        ("write_and_restore", "version counter moved\\): k"),
    ],
)
def test_forward_defects_fail(seed, defect, message):
    case = dataclasses.replace(cases_for(FWD, quick=True, like=like(FWD))[0], V=8)  # K != V: a transposed
    result = run_case(tampering(defect), case, "cpu")  # state has the wrong shape
    assert not result.passed and result.problems, result.reason
    assert any(re.search(message, p) for p in result.problems), result.problems
    assert run_case(tampering(None), case, "cpu").passed


@pytest.mark.parametrize("defect", ["modifies_do", "modifies_dfinal_state"])
def test_backward_that_modifies_the_upstream_gradient_fails(seed, defect):
    case = cases_for(TRAIN, quick=True, like=like(TRAIN))[0]
    result = run_case(tampering(defect), case, "cpu")
    upstream = "do" if defect == "modifies_do" else "dfinal_state"
    assert not result.passed and f"modified what it was handed: {upstream}" in result.reason
    assert run_case(tampering(None), case, "cpu").passed


# ------------------------------------------------------------------------------ records on their word


def _plant(backend: kda.Backend, payload: dict[str, Any]) -> None:
    path = default_store().path_for(backend, torch.device("cpu"))
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(payload))


def _wrong_call() -> dict[str, Any]:
    T = 40
    return {
        "q": F.normalize(torch.randn(1, T, 1, 16), dim=-1), "k": F.normalize(torch.randn(1, T, 1, 16), dim=-1),
        "v": torch.randn(1, T, 1, 16), "g": F.logsigmoid(torch.randn(1, T, 1, 16) + 1), "beta": torch.rand(1, T, 1),
    }  # fmt: skip


def _good_case(key: str, regime: str = "realistic") -> dict[str, Any]:
    cc = CaseClass.from_key(key)
    T = 4 * cc.chunk_size + 13
    return {"regime": regime, "T": T, "seq_lens": [T], "unsupported": False, "problems": [], "errors": {"o": 1e-5}}


@pytest.mark.parametrize(
    "forgery",
    ["fingerprint_of_version_999", "passed_without_cases", "errors_above_tolerance", "no_fingerprint"],
)
def test_forged_record_does_not_verify_a_wrong_backend(seed, forgery):
    wrong = Scaled()
    kda.register_backend(wrong)
    call = _wrong_call()
    key = kda.KDASpec.from_call(**call).case_class.key
    fp = fingerprint(wrong, "cpu")
    entry = {"case_class": key, "source": "verify", "quick": False, "device_type": "cpu", "format": RECORD_FORMAT}
    entry["cases"] = [_good_case(key)]
    if forgery == "fingerprint_of_version_999":
        fp = {**fp, "backend_version": "999"}
    elif forgery == "passed_without_cases":
        entry = {**entry, "cases": [], "passed": True, "worst_ratio": 1e9}
    elif forgery == "errors_above_tolerance":
        entry["cases"] = [{**_good_case(key), "errors": {"o": 1e9}, "passed": True}]
    payload: dict[str, Any] = {"records": {key: entry}}
    if forgery != "no_fingerprint":
        payload["fingerprint"] = fp
    _plant(wrong, payload)
    with kda.trace_routes() as routes:
        kda.chunk_kda(**call)
    assert [r.backend for r in routes] == ["torch"], f"{forgery}: the forged record verified a wrong backend"
    assert wrong.served == 0


class Scaled(Tampering):
    """The torch backend's output times 1.01 (ten times fp32's tolerance); counts the calls it served."""

    def __init__(self) -> None:
        super().__init__()
        self.served = 0

    def forward(self, inputs, spec, out=None):
        if not is_verifying():
            self.served += 1
        result = self.torch.forward(inputs, spec, out)
        result.o = result.o * 1.01
        return result


def test_honest_record_of_the_same_shape_is_accepted(seed):
    """The control of the forgeries: a record that meets the policy, under the right fingerprint."""
    honest = tampering(None)
    kda.register_backend(honest)
    call = _wrong_call()
    key = kda.KDASpec.from_call(**call).case_class.key
    entry = {"case_class": key, "source": "verify", "quick": False, "device_type": "cpu", "format": RECORD_FORMAT}
    cases = [_good_case(key), _good_case(key, "correlated")]
    _plant(honest, {"fingerprint": fingerprint(honest, "cpu"), "records": {key: {**entry, "cases": cases}}})
    with kda.trace_routes() as routes:
        kda.chunk_kda(**call, backend="tampering")
    assert [r.backend for r in routes] == ["tampering"] and honest.calls == 1  # no verification ran: trusted
    assert math.isclose(default_store().get(honest, "cpu", key).worst_ratio, 1e-2)


class Exiting(Tampering):
    """A plugin's kernel that ends the process (``sys.exit``) from forward or from backward."""

    where = "forward"

    def forward(self, inputs, spec, out=None):
        if self.where == "forward":
            raise SystemExit("the kernel library gave up")
        return super().forward(inputs, spec, out)

    def backward(self, inputs, spec, saved, do, dfinal_state):
        raise SystemExit("the kernel library gave up")


@pytest.mark.parametrize("where", ["forward", "backward"])
def test_backend_that_exits_fails_its_case_and_does_not_end_the_caller(seed, where):
    backend = Exiting()
    backend.where = where
    case = cases_for(TRAIN, quick=True, like=like(TRAIN))[0]
    result = run_case(backend, case, "cpu")
    assert not result.passed and "SystemExit: the kernel library gave up" in result.reason


def test_keyboard_interrupt_in_a_backend_still_interrupts_the_verifier(seed):
    class Interrupted(Tampering):
        def forward(self, inputs, spec, out=None):
            raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        run_case(Interrupted(), cases_for(FWD, quick=True, like=like(FWD))[0], "cpu")
