"""Verification of the decode op catches wrong backends, and the dispatcher, explain and trace_routes use it."""

from __future__ import annotations

import pytest
import torch

import kda
from kda.backends.base import RecurrentResult
from kda.backends.torch import TorchBackend
from kda.backends.torch.recurrent import torch_recurrent
from kda.recurrent.spec import RecurrentCaseClass
from kda.verify.judge import assess
from kda.verify.recurrent import recurrent_grid, verify_recurrent_class
from tests.recurrent.helpers import decode_call

TYPICAL = recurrent_grid()[0]  # sigmoid gate, bf16, varlen, GVA, a bf16 pool written in place


class NoNegEigval(TorchBackend):
    """Forgets the factor 2 of allow_neg_eigval: wrong only in that class."""

    name = "no-neg-eigval"
    priority = 50

    def recurrent_forward(self, inputs, spec):
        return torch_recurrent(inputs, spec.model_copy(update={"allow_neg_eigval": False}))


class WritesPaddingSlot(TorchBackend):
    """Right numbers, but also writes a slot the call does not own (as a kernel that sends a padding row
    to some slot would)."""

    name = "writes-padding"
    priority = 50

    def recurrent_forward(self, inputs, spec):
        pool = inputs.initial_state
        before = None if pool is None else pool.clone()
        result = torch_recurrent(inputs, spec)
        if pool is not None and spec.inplace_final_state:
            same = [s for s in range(pool.shape[0]) if torch.equal(pool[s].nan_to_num(7.0), before[s].nan_to_num(7.0))]
            pool[same[0]] = 0.5  # one the call left alone
        return result


class SkipsOut(TorchBackend):
    """Returns a fresh tensor and leaves `out=` unwritten."""

    name = "skips-out"
    priority = 50

    def recurrent_forward(self, inputs, spec):
        result = torch_recurrent(inputs, spec)
        fresh = result.o.clone()
        if inputs.out is not None:
            inputs.out.fill_(float("nan"))
        return RecurrentResult(fresh, result.final_state)


def test_the_torch_backend_passes_the_typical_class_with_every_case():
    result = verify_recurrent_class(TorchBackend(), TYPICAL, "cpu", quick=False)
    assert result.passed, result.reason
    assert len(result.cases) == 3 and all(c.case.describe()["padding_rows"] == 1 for c in result.cases)


def test_a_wrong_factor_fails_verification():
    cc = TYPICAL.model_copy(update={"beta": "sigmoid2"})
    result = verify_recurrent_class(NoNegEigval(), cc, "cpu", quick=True)
    assert not result.passed and "o rel. error" in (result.reason or "")
    assert verify_recurrent_class(NoNegEigval(), TYPICAL, "cpu", quick=True).passed  # right elsewhere


def test_writing_a_slot_the_call_does_not_own_fails():
    result = verify_recurrent_class(WritesPaddingSlot(), TYPICAL, "cpu", quick=True)
    assert not result.passed and "pool slot the call does not write changed" in (result.reason or "")


def test_an_unwritten_out_fails():
    result = verify_recurrent_class(SkipsOut(), TYPICAL, "cpu", quick=True)
    assert not result.passed and "out= was given" in (result.reason or "")


def test_auto_skips_a_backend_that_fails_and_explain_says_why():
    kda.register_backend(NoNegEigval)
    call = decode_call(pool="tokens")
    call["allow_neg_eigval"] = True
    with kda.trace_routes() as routes:
        kda.fused_recurrent_kda(**call)
    assert [r.backend for r in routes] == ["torch"]
    explanation = kda.explain_recurrent(**call)
    assert explanation.chosen == "torch"
    assert "failed verification of recurrent/" in str(explanation)
    with pytest.raises(kda.BackendSelectionError, match="failed verification"):
        kda.fused_recurrent_kda(**call, backend="no-neg-eigval")
    call["allow_neg_eigval"] = False
    with kda.trace_routes() as routes:
        kda.fused_recurrent_kda(**call)  # verified and right for this class: chosen by priority
    assert [r.backend for r in routes] == ["no-neg-eigval"]


def test_backends_without_the_op_decline_with_a_reason():
    class ChunkOnly(TorchBackend):
        name = "chunk-only"
        supports_recurrent = kda.Backend.supports_recurrent  # the base class default

    kda.register_backend(ChunkOnly)
    explanation = kda.explain_recurrent(**decode_call(), backend="chunk-only")
    assert explanation.chosen is None
    assert "does not implement the decode op" in str(explanation)


def test_a_record_without_a_padding_case_does_not_pass():
    result = verify_recurrent_class(TorchBackend(), TYPICAL, "cpu", quick=True)
    cases = [c.as_json() for c in result.cases]
    assert assess(TYPICAL.key, cases, on_cuda=False).passed
    for case in cases:
        case["padding_rows"] = 0
    judged = assess(TYPICAL.key, cases, on_cuda=False)
    assert not judged.passed and "padding row" in (judged.reason or "")


def test_fla_declines_pools_with_the_reason():
    from kda.backends.fla import FLABackend
    from kda.recurrent.spec import RecurrentSpec

    verdict = FLABackend().supports_recurrent(RecurrentSpec.from_call(**decode_call()))
    assert not verdict and any("slot -1" in r for r in verdict.reasons)


def test_every_grid_class_round_trips():
    keys = [cc.key for cc in recurrent_grid()]
    assert len(set(keys)) == len(keys) >= 25
    assert all(RecurrentCaseClass.from_key(k).key == k for k in keys)
    assert {RecurrentCaseClass.from_key(k).pool for k in keys} == {"none", "slots", "tokens"}
    assert {RecurrentCaseClass.from_key(k).state_dtype for k in keys} >= {"bfloat16", "float32"}


def test_the_verify_command_line_takes_decode_classes(capsys):
    from kda.verify import cli
    from kda.verify.records import default_store

    assert cli.main(["--list-cases", "--with-recurrent"]) == 0
    listed = capsys.readouterr().out.split()
    assert TYPICAL.key in listed and any(not k.startswith("recurrent/") for k in listed)
    assert cli.main(["--backend", "torch", "--case", TYPICAL.key, "--quick"]) == 0
    record = default_store().get(kda.get_backend("torch"), torch.device("cpu"), TYPICAL.key)
    assert record is not None and record.source == "verify" and record.passed
    assert cli.main(["--backend", "torch", "--case", "recurrent/nonsense"]) == 2
