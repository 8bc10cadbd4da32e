"""benchmarks/tilelang_backward_precision.py's replay of the tilelang backward: with no rounding it is the exact
chain rule of the chunked algorithm, so it must equal the float64 reference's gradients (what makes its
per-rounding figures worth reading), dense or varlen, MHA or GVA; with the shipped roundings it must differ at
the inputs' precision, and on a case an H100 recorded it gives the GPU's errors."""

from __future__ import annotations

import random
import statistics

import pytest
import torch
from benchmark_scripts import load

from kda.spec import CaseClass
from kda.verify.cases import VerificationCase, make_inputs
from kda.verify.policy import tolerance

precision = load("tilelang_backward_precision")


def tiny(key: str, seed: int, T: int = 45):
    """A verifier draw of `key` at K = 16, V = 8: two chunks of 32 and a ragged one (T = 45 at c32). Varlen
    packs sequences of T, 13, 0 and 33 tokens in one row (each ragged, one empty); GVA gives each of the two
    q/k heads two value heads."""
    case_class = CaseClass.from_key(key)
    B, lengths = (1, (T, 13, 0, 33)) if case_class.varlen else (2, (T, T))
    HV = 4 if case_class.gva else 2
    case = VerificationCase(case_class, "realistic", B, 2, HV, 16, 8, lengths, "bfloat16", seed=seed)
    return make_inputs(case, "cpu")


@pytest.mark.parametrize(
    "key",
    [
        "safe/l2/sig/bf16/dense/mha/h0+ht/c32/d64/train",
        "softplus/l2/sig/bf16/dense/mha/ht/c32/d64/train",
        "pregated/qk/sig/bf16/dense/mha/h0/c32/d64/train",
        "sigmoid/l2/beta/bf16/dense/mha/nostate/c32/d64/train",
        "safe/l2/sig/bf16/varlen/mha/h0+ht/c32/d64/train",
        "safe/qk/sig2/bf16/dense/gva/nostate/c32/d64/train",
        "softplus/l2/sig2/bf16/varlen/gva/h0+ht:vk/c32/d64/train",
    ],
)
def test_the_unrounded_replay_is_the_reference(key):
    """Dense and varlen calls (each sequence chunked from its own start, its own state), MHA and GVA (value
    head ``hv`` on q/k head ``hv // group``, ``dq`` and ``dk`` summed over the group), with and without the
    l2norm, beta up to 2, either state layout: with no rounding the replay is the reference's chain rule."""
    kwargs, upstream = tiny(key, seed=7)
    ref = precision.reference_gradients(kwargs, upstream)
    grads = precision.replay(kwargs, upstream, frozenset())
    errors = precision.errors_of(grads, ref)
    assert set(errors) >= {"dq", "dk", "dv", "dg", "dbeta"}
    assert max(errors.values()) < 1e-12, errors


def test_the_shipped_roundings_show_at_bf16_precision():
    kwargs, upstream = tiny("safe/l2/sig/bf16/dense/mha/h0+ht/c32/d64/train", seed=8)
    ref = precision.reference_gradients(kwargs, upstream)
    shipped = precision.errors_of(precision.replay(kwargs, upstream, precision.SHIPPED), ref)
    assert "dA_log" in shipped and all(1e-5 < e < 5e-2 for e in shipped.values()), shipped
    # the backward's own split operands alone are near fp32: far below one bf16 rounding
    split = precision.errors_of(precision.replay(kwargs, upstream, frozenset({"bwd_split"})), ref)
    assert max(split.values()) < 1e-4, split


def test_the_configurations_keep_each_rounding_exact_in_turn():
    configs = dict(precision.configurations(["h", "q_e", "rows+h+q_e"]))
    assert configs["shipped"] == precision.SHIPPED and configs["all exact"] == frozenset()
    assert configs["exact h"] == precision.SHIPPED - {"h"}
    assert configs["exact rows+h+q_e"] == precision.SHIPPED - {"rows", "h", "q_e"}  # kept exact together


def test_an_unknown_rounding_is_a_message_before_any_draw(monkeypatch, capsys):
    monkeypatch.setattr("sys.argv", ["tilelang_backward_precision.py", "--config", "rows+nonsense"])
    monkeypatch.setattr(precision, "draw", lambda *a: pytest.fail("drew inputs for a bad command line"))
    with pytest.raises(SystemExit) as stopped:
        precision.main()
    assert stopped.value.code == 2 and "no rounding 'nonsense'" in capsys.readouterr().err


@pytest.mark.parametrize(
    "key", ["safe/l2/sig/bf16/dense/mha/h0+ht/c32/d64/train", "sigmoid/l2/sig/bf16/dense/mha/ht/c32/d64/train"]
)
def test_the_shipped_roundings_lower_dA_logs_error_against_version_5s(seed, key):
    """Version 6 keeps in fp32 what ``dA_log`` needs most; over fresh draws its median error is below
    version 5's (every intermediate in bf16) and a small part of the tolerance. It does not make every draw
    pass: at this shape (K = 16) 2 of 40 sigmoid draws still missed, against 4 of 40 for version 5. (Over 80
    draws a class the medians were 0.066 and 0.048 of the tolerance against version 5's 0.38 and 0.36; no
    resampled set of 15 broke either assertion.)"""
    draw = random.Random(seed)  # the test's seed (KDA_TEST_SEED) reproduces the fifteen draws
    seeds = [draw.randrange(2**31) for _ in range(15)]
    shipped, version_5 = [], []
    for seed in seeds:
        kwargs, upstream = tiny(key, seed=seed)
        ref = precision.reference_gradients(kwargs, upstream)
        shipped.append(precision.errors_of(precision.replay(kwargs, upstream, precision.SHIPPED), ref)["dA_log"])
        version_5.append(precision.errors_of(precision.replay(kwargs, upstream, precision.VERSION_5), ref)["dA_log"])
    assert statistics.median(shipped) < statistics.median(version_5), (seeds, shipped, version_5)
    assert statistics.median(shipped) <= 0.3 * tolerance("dA_log", torch.bfloat16), (seeds, shipped)


def test_the_first_h_is_its_own_switch(seed):
    """The variant (one partial chunk) has no h but the initial state's: rounding ``h`` past the first chunk
    changes nothing there, rounding the first ``h`` does; without an initial state it is zero, exact."""
    key = "softplus/l2/sig/bf16/dense/mha/h0+ht/c32/d64/train"
    kwargs, upstream = precision.draw(key, "variant", seed)
    ref = precision.reference_gradients(kwargs, upstream)
    later = precision.errors_of(precision.replay(kwargs, upstream, frozenset({"h"})), ref)
    first = precision.errors_of(precision.replay(kwargs, upstream, frozenset({"h_first"})), ref)
    assert max(later.values()) < 1e-12, later
    assert first["dA_log"] > 1e-7 and first["dq"] > 1e-7, first
    kwargs, upstream = precision.draw(key.replace("h0+ht", "ht"), "variant", seed)
    ref = precision.reference_gradients(kwargs, upstream)
    no_h0 = precision.errors_of(precision.replay(kwargs, upstream, frozenset({"h_first"})), ref)
    assert max(no_h0.values()) < 1e-12, no_h0


def test_the_replayed_inverse_is_the_kernels_and_holds_on_the_correlated_case(seed):
    """`intra`'s inverse by blocks (version 8), replayed: on the correlated case (keys of a chunk near one
    direction) its roundings alone cost the gradients under 1e-3 (2e-5 at most over 12 draws), where the
    whole-chunk Neumann series it replaced cost 3.6e-3 to 2.2e-2 here (at C = 64: 1e7 and more), and with
    every shipped rounding the gradients meet their tolerances (``dA_log``'s rare miss aside: see
    docs/design.md)."""
    kwargs, upstream = precision.draw("safe/l2/sig/bf16/dense/mha/h0+ht/c32/d64/train", "correlated", seed)
    ref = precision.reference_gradients(kwargs, upstream)
    inverse = precision.errors_of(precision.replay(kwargs, upstream, frozenset({"inverse"})), ref)
    assert max(inverse.values()) < 1e-3, inverse
    shipped = precision.errors_of(precision.replay(kwargs, upstream, precision.SHIPPED), ref)
    assert all(e < tolerance(name, torch.bfloat16) for name, e in shipped.items() if name != "dA_log"), shipped


def test_check_asserts_the_varlen_and_gva_twins(monkeypatch, capsys):
    """``--check`` asserts the unrounded replay on a class's varlen and GVA twins too (the same seed): it
    reports each, and a replay that ignores ``cu_seqlens`` fails it on the varlen twin, not the dense class."""
    key = "safe/l2/sig/bf16/dense/mha/h0+ht/c32/d64/train"
    varlen, gva = key.replace("dense", "varlen"), key.replace("mha", "gva")
    assert precision.twins(key) == [varlen, gva]
    argv = ["tilelang_backward_precision.py", "--check", "--regime", "realistic", "--class", key, "--seed", "7"]
    monkeypatch.setattr("sys.argv", [*argv, "--config", "h"])
    monkeypatch.setattr(precision, "draw", lambda key, regime, seed: tiny(key, seed))
    assert precision.main() == 0
    out = capsys.readouterr().out
    assert f"checked {varlen} seed 7" in out and f"checked {gva} seed 7" in out, out
    replay = precision.replay
    monkeypatch.setattr(
        precision, "replay", lambda kwargs, upstream, on: replay({**kwargs, "cu_seqlens": None}, upstream, on)
    )
    with pytest.raises(AssertionError) as failed:
        precision.main()
    assert failed.value.args[0][0] == varlen


# The first of the two bf16 training classes version 15 missed on dA_log on an H100 (correlated case), and
# the GPU's relative errors there (`python -m kda.verify --backend tilelang`)
RECORDED = "safe/l2/sig/bf16/varlen/mha/h0+ht/c64/d128/train"
RECORDED_SEED = 269860459
RECORDED_ERRORS = {
    "dA_log": 1.945e-2, "dq": 2.62e-3, "dk": 2.20e-3, "dv": 3.14e-3, "dg": 2.60e-3, "dbeta": 3.18e-3,
    "ddt_bias": 2.13e-3, "dinitial_state": 6.87e-4,
}  # fmt: skip


def test_the_replay_gives_what_the_gpu_gave_on_the_recorded_case():
    """The shipped roundings replay the H100's miss on a varlen call (sequences of 269, 59 and 17 tokens,
    each with its own state): ``dA_log`` to 4% (1.87e-2 against 1.945e-2), every other gradient to 1%. The
    other gradients sit at the sum of many roundings and match closely; ``dA_log``'s error depends on which
    way single roundings fall (the replay's float64 arithmetic in fp32 moves it 7%), so 5% is its margin."""
    kwargs, upstream = precision.draw(RECORDED, "correlated", RECORDED_SEED)
    assert kwargs["cu_seqlens"].tolist() == [0, 269, 328, 345] and kwargs["initial_state"].shape[0] == 3
    ref = precision.reference_gradients(kwargs, upstream)
    shipped = precision.errors_of(precision.replay(kwargs, upstream, precision.SHIPPED), ref)
    for name, gpu in RECORDED_ERRORS.items():
        assert abs(shipped[name] - gpu) < (0.05 if name == "dA_log" else 0.01) * gpu, (name, shipped)
