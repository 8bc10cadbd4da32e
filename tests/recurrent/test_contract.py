"""The decode op's contract: FLA's signature, and every broken rule raising KDAInputError(argument, rule, got)."""

from __future__ import annotations

import ast
import importlib.util
import inspect
import warnings
from pathlib import Path

import pytest
import torch

import kda
from kda.recurrent.spec import RecurrentCaseClass, RecurrentSpec
from kda.verify.recurrent import recurrent_grid
from tests.recurrent.helpers import decode_call


def fla_public_signature() -> list[tuple[str, object]]:
    """FLA 0.6's `fused_recurrent_kda` positional parameters and defaults, read from its source (importing
    FLA on a CPU-only machine pulls Triton's Gluon in under whatever TRITON_INTERPRET says, which breaks
    the interpreter for later tests)."""
    found = importlib.util.find_spec("fla")
    if found is None or not found.submodule_search_locations:
        pytest.skip("FLA is not installed")
    source = Path(next(iter(found.submodule_search_locations))) / "ops" / "kda" / "fused_recurrent.py"
    tree = ast.parse(source.read_text())
    (function,) = [n for n in tree.body if isinstance(n, ast.FunctionDef) and n.name == "fused_recurrent_kda"]
    names = [a.arg for a in function.args.args]
    defaults = [ast.literal_eval(d) for d in function.args.defaults]
    padded = [inspect.Parameter.empty] * (len(names) - len(defaults)) + defaults
    return list(zip(names, padded))


def test_signature_is_fla_public_one_then_the_serving_keywords():
    ours = list(inspect.signature(kda.fused_recurrent_kda).parameters.values())
    positional = [p for p in ours if p.kind is p.POSITIONAL_OR_KEYWORD]
    assert [(p.name, p.default) for p in positional] == fla_public_signature()
    keyword = {p.name: p.default for p in ours if p.kind is p.KEYWORD_ONLY}
    assert keyword == {
        "ssm_state_indices": None,
        "num_accepted_tokens": None,
        "inplace_final_state": False,
        "out": None,
        "backend": "auto",
    }
    assert ours[-1].kind is inspect.Parameter.VAR_KEYWORD
    assert (
        inspect.signature(kda.explain_recurrent).parameters.keys()
        == inspect.signature(kda.fused_recurrent_kda).parameters.keys()
    )


def broken(**change):
    call = decode_call()
    call.update(change)
    for name, value in list(call.items()):
        if value is None:
            del call[name]
    return call


@pytest.mark.parametrize(
    ("change", "argument", "words"),
    [
        ({"ssm_state_indices": torch.tensor([0, 1, 2])}, "ssm_state_indices", "[N] or [N, T_max]"),
        ({"ssm_state_indices": torch.tensor([0, 1, 2, 99])}, "ssm_state_indices", "num_slots"),
        ({"ssm_state_indices": torch.tensor([0, 1, 2, 0])}, "ssm_state_indices", "same slot"),
        ({"ssm_state_indices": torch.tensor([0.0, 1, 2, 3])}, "ssm_state_indices", "int32 or int64"),
        ({"num_accepted_tokens": torch.tensor([1, 1, 1, 1])}, "num_accepted_tokens", "per-token"),
        (
            {"inplace_final_state": True, "initial_state": None, "ssm_state_indices": None},
            "inplace_final_state",
            "pool",
        ),
        ({"ssm_state_indices": None, "inplace_final_state": False}, "initial_state", "[N, HV, K, V]"),
        ({"out": torch.empty(1, 6, 2, 12, dtype=torch.bfloat16)}, "out", "q's"),
        ({"out": torch.empty(1, 6, 2, 13)}, "out", "v's shape"),
        ({"lower_bound": 0.5}, "lower_bound", "< 0"),
        ({"lower_bound": None, "A_log": None}, "A_log", "softplus"),
        ({"A_log": torch.rand(3)}, "A_log", "HV = 2"),
        ({"dt_bias": torch.rand(5)}, "dt_bias", "[HV*K]"),
        ({"use_gate_in_kernel": False}, "A_log", "only with use_gate_in_kernel"),
        ({"cu_seqlens": torch.tensor([0, 1, 4, 4, 7])}, "cu_seqlens", "end at T"),
    ],
)
def test_broken_rules_name_argument_rule_and_value(change, argument, words):
    with pytest.raises(kda.KDAInputError) as raised:
        kda.fused_recurrent_kda(**broken(**change))
    error = raised.value
    assert error.argument == argument or argument in [e.argument for e in error.more], str(error)
    assert words in str(error)


def test_per_token_rules():
    call = decode_call(pool="tokens")
    bad = dict(call, num_accepted_tokens=torch.tensor([1, 9, 1, 1]))
    with pytest.raises(kda.KDAInputError, match=r"num_accepted_tokens.*1, T_max"):
        kda.fused_recurrent_kda(**bad)
    narrow = dict(call, ssm_state_indices=call["ssm_state_indices"][:, :2], num_accepted_tokens=None)
    with pytest.raises(kda.KDAInputError, match="longest sequence"):
        kda.fused_recurrent_kda(**narrow)


def test_bf16_state_needs_a_pool_and_a_pool_may_be_bf16():
    call = decode_call(pool="none")
    with pytest.raises(kda.KDAInputError, match="float32"):
        kda.fused_recurrent_kda(**dict(call, initial_state=call["initial_state"].bfloat16()))
    kda.fused_recurrent_kda(**decode_call(pool_dtype=torch.bfloat16))


def test_gradients_are_refused_with_a_clear_error():
    call = decode_call(pool="none")
    call["q"].requires_grad_(True)
    with pytest.raises(kda.KDAInputError, match="forward-only") as raised:
        kda.fused_recurrent_kda(**call)
    assert raised.value.argument == "q"
    with torch.no_grad():
        kda.fused_recurrent_kda(**call)


def test_unknown_keywords_warn_once_and_the_old_layout_name_is_taken():
    call = decode_call(pool="none", state_v_first=True)
    with pytest.warns(UserWarning, match="some_vllm_option"):
        kda.fused_recurrent_kda(**call, some_vllm_option=3)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        kda.fused_recurrent_kda(**call, some_vllm_option=3)  # once per name
    as_old = dict(call, state_v_first=False)
    o_new, s_new = kda.fused_recurrent_kda(**call)
    o_old, s_old = kda.fused_recurrent_kda(**as_old, transpose_state_layout=True)
    assert torch.equal(o_new, o_old) and torch.equal(s_new, s_old)


def test_case_class_keys_round_trip_and_name_the_op():
    for cc in recurrent_grid():
        assert cc.key.startswith("recurrent/")
        assert RecurrentCaseClass.from_key(cc.key) == cc
    with pytest.raises(ValueError):
        RecurrentCaseClass.from_key("safe/l2/sig/bf16/dense/mha/nostate/c64/d128/fwd")
    spec = RecurrentSpec.from_call(**decode_call(pool="tokens", pool_dtype=torch.bfloat16, state_v_first=True))
    assert spec.case_class.key == "recurrent/sigmoid/qk/sig/fp32/varlen/gva/tokens+inplace:bf16:vk/d64"


def test_specs_are_reused_unless_index_values_must_be_checked():
    call = decode_call(pool="none", varlen=False, lengths=(1, 1, 1))  # dense: no index tensor at all
    assert RecurrentSpec.from_call(**call) is RecurrentSpec.from_call(**call)
    pooled = decode_call()
    first = RecurrentSpec.from_call(**pooled)
    assert RecurrentSpec.from_call(**pooled) is not first  # host indices: their values are checked each call
    with pytest.raises(kda.KDAInputError, match="num_slots"):
        RecurrentSpec.from_call(**dict(pooled, ssm_state_indices=torch.tensor([0, 1, 2, 99])))
