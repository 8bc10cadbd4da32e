"""The triton backend's kernels, run in Triton's CPU interpreter (TRITON_INTERPRET=1) on tiny shapes.

Each test checks the kernels against the float64 reference through the verifier's own `run_case` (NaN
poisoned output buffers, inputs checked for modification, every gradient when training) on fresh random
inputs: every gate mode with
realistic and extreme gates, l2norm and beta variants, varlen with empty and one-token sequences, GVA,
both state layouts, chunk 32 and 64, K != V, T not a multiple of the chunk, bf16/fp16/fp32, forward and
backward. Route tests prove the triton backend is the one that ran. Without Triton these tests skip.
"""

from __future__ import annotations

import importlib
import itertools
import math
import os

import nonfinite
import pytest
import torch
from kernel_cases import (
    CORRELATED_VARIANTS,
    TRAINING_VARIANTS,
    case_class,
    expected_gradients,
    small_case,
    training_class,
    training_heads,
    variant_id,
)
from tf32 import emulate_gpu_dots

import kda
from kda.spec import CaseClass, GateMode
from kda.verify.cases import VerificationCase
from kda.verify.check import run_case

triton = pytest.importorskip("triton", reason="Triton is not installed (extra `triton`)")
import triton.language as tl  # noqa: E402

from kda.backends.triton import storage as triton_storage  # noqa: E402


@pytest.fixture
def interpreter(monkeypatch):
    """The triton backend, ready to run here: on the GPU when there is one, else on CPU tensors in Triton's
    interpreter (TRITON_INTERPRET=1, which conftest.py switched on before Triton was imported), with the
    kernel modules rebuilt as interpreted functions if an earlier test imported them compiled, and with
    tensor-core products computed as a GPU computes them (TF32 operands truncated; `tests/tf32.py`)."""
    if torch.cuda.is_available():
        pytest.skip("these tiny interpreter cases are for the CPU; on a GPU `kda.verify --backend triton` runs")
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    from triton.runtime.interpreter import InterpretedFunction

    from kda.backends.triton import (
        backward,
        chunk_backward,
        diagonal_backward,
        forward,
        gate,
        intra,
        output,
        state,
        state_backward,
        storage,
        tails,
        tiles,
    )

    kernels = (
        intra.intra_chunk_kernel,
        state.state_pass_kernel,
        output.output_kernel,
        chunk_backward.bwd_chunk_kernel,
        state_backward.bwd_state_kernel,
        tails.qk_tail_kernel,
    )
    if not all(isinstance(kernel, InterpretedFunction) for kernel in kernels):
        # helpers, kernels, then what imports them
        modules = (storage, tiles, gate, intra, state, output, tails, diagonal_backward, chunk_backward, state_backward)
        for module in (*modules, backward, forward):
            importlib.reload(module)
    assert isinstance(forward.output_kernel, InterpretedFunction)
    emulate_gpu_dots(monkeypatch)  # tensor-core products as the GPU computes them (tests/tf32.py)
    kda.registry._reset_for_tests()
    return kda.get_backend("triton")


@pytest.mark.parametrize(
    "variant",
    TRAINING_VARIANTS,
    ids=variant_id,
)
@pytest.mark.parametrize("regime", ["realistic", "extreme"])
def test_backward_gives_every_gradient(seed, interpreter, variant, regime):
    cc = training_class(variant, regime)
    result = run_case(interpreter, small_case(cc, regime, seed=seed), "cpu")
    assert result.passed, (cc.key, result.reason, result.errors)
    assert expected_gradients(cc) <= set(result.errors)


VARIANTS = [
    dict(),
    dict(gate=GateMode.PREGATED, qk_l2norm=False, beta="given"),
    dict(gate=GateMode.SOFTPLUS, beta="sigmoid2", chunk_size=64),
    dict(varlen=True, gva=True, state_v_first=True),
    dict(dtype="bfloat16", varlen=True, initial_state=False),
    dict(dtype="float16", gva=True, final_state=False, chunk_size=64),
    dict(gate=GateMode.PREGATED, dtype="bfloat16", state_v_first=True, chunk_size=64),
    dict(gate=GateMode.SIGMOID, dtype="bfloat16", gva=True),
    dict(intermediate_states=True, varlen=True, state_v_first=True),  # return_intermediate_states
    dict(intermediate_states=True, dtype="bfloat16", chunk_size=64),
]


@pytest.mark.parametrize("variant", VARIANTS, ids=variant_id)
@pytest.mark.parametrize("regime", ["realistic", "extreme"])
def test_forward_matches_the_reference(seed, interpreter, variant, regime):
    cc = case_class(**variant)
    if regime == "extreme" and cc.gate is GateMode.SAFE:
        regime = "near_zero_bound" if cc.dtype == "float32" else "extreme"
    result = run_case(interpreter, small_case(cc, regime, seed=seed), "cpu")
    assert result.passed, (cc.key, result.reason, result.errors)


@pytest.mark.parametrize("variant", CORRELATED_VARIANTS, ids=variant_id)
@pytest.mark.parametrize("training", [False, True], ids=["forward", "training"])
def test_correlated_keys_in_a_remembering_head(seed, interpreter, variant, training):
    """The verifier's correlated regime (`kda.verify.cases`), where an inverse summed as a Neumann series
    over the chunk cancels to garbage: this backend's diagonal blocks (products, then a Newton step) and
    their merge hold."""
    cc = case_class(**variant, training=training)
    result = run_case(interpreter, small_case(cc, "correlated", seed=seed), "cpu")
    assert result.passed, (cc.key, result.reason, result.errors)


@pytest.mark.parametrize("K, V", [(8, 24), (40, 16), (64, 64)])
def test_head_dims_that_are_not_powers_of_two(seed, interpreter, K, V):
    cc = case_class(head_dim=64)
    result = run_case(interpreter, small_case(cc, "realistic", K=K, V=V, seed=seed), "cpu")
    assert result.passed, result.reason


def test_the_triton_backend_is_what_ran(seed, interpreter):
    B, T, H, K = 1, 45, 2, 16
    call = {
        "q": torch.randn(B, T, H, K),
        "k": torch.randn(B, T, H, K),
        "v": torch.randn(B, T, H, K),
        "g": torch.randn(B, T, H, K),
        "beta": torch.randn(B, T, H),
        "A_log": torch.rand(H),
        "dt_bias": torch.randn(H * K),
        "use_gate_in_kernel": True,
        "safe_gate": True,
        "lower_bound": -4.0,
        "use_qk_l2norm_in_kernel": True,
        "use_beta_sigmoid_in_kernel": True,
        "output_final_state": True,
    }
    with kda.trace_routes() as routes:
        o, state = kda.chunk_kda(**call, backend="triton")
        o_auto, _ = kda.chunk_kda(**call)  # auto: triton ranks above torch when both are verified
    assert [r.backend for r in routes] == ["triton", "triton"]
    o_ref, state_ref = kda.kda_reference(
        **{n: (t.double() if isinstance(t, torch.Tensor) else t) for n, t in call.items()}
    )
    assert torch.allclose(o.double(), o_ref, atol=1e-5, rtol=1e-4)
    assert torch.allclose(state.double(), state_ref, atol=1e-5, rtol=1e-4)
    assert torch.equal(o, o_auto)

    training = {**call, "q": call["q"].clone().requires_grad_(True)}
    with kda.trace_routes() as routes:
        o_train, _ = kda.chunk_kda(**training, backend="triton")
        (dq,) = torch.autograd.grad(o_train.sum(), [training["q"]])
    assert [(r.backend, r.phase) for r in routes] == [("triton", "forward"), ("triton", "backward")]
    q64 = call["q"].double().requires_grad_(True)
    o64, _ = kda.kda_reference(
        **{**{n: (t.double() if isinstance(t, torch.Tensor) else t) for n, t in call.items()}, "q": q64}
    )
    (dq_ref,) = torch.autograd.grad(o64.sum(), [q64])
    assert torch.allclose(dq.double(), dq_ref, atol=1e-5, rtol=1e-4)


def test_availability_follows_the_interpreter_switch(monkeypatch, interpreter):
    from kda.backends.triton import TritonBackend

    backend = TritonBackend()
    assert backend.available() and "interpreter" in str(backend.available())
    spec = kda.KDASpec.from_call(
        torch.randn(1, 4, 1, 8),
        torch.randn(1, 4, 1, 8),
        torch.randn(1, 4, 1, 8),
        -torch.rand(1, 4, 1, 8),
        torch.rand(1, 4, 1),
    )
    assert backend.supports(spec)
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    if not torch.cuda.is_available():
        assert "needs a CUDA GPU" in str(backend.available())
    assert "TRITON_INTERPRET=1" in str(backend.supports(spec))
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)  # a GPU machine: forward and training
    monkeypatch.delenv("KDA_TRITON_EXPERIMENTAL", raising=False)  # opt-in until version 16: no longer read
    assert backend.available() and "training" in str(backend.available())
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (9, 0))
    on_gpu = spec.model_copy(update={"q": spec.q.model_copy(update={"device": "cuda:0"})})
    assert backend.supports(on_gpu)
    assert backend.supports(on_gpu.model_copy(update={"requires_grad": True}))  # K = 8
    wide = kda.KDASpec.from_call(
        torch.randn(1, 4, 1, 256),
        torch.randn(1, 4, 1, 256),
        torch.randn(1, 4, 1, 8),
        -torch.rand(1, 4, 1, 256),
        torch.rand(1, 4, 1),
    )
    wide = wide.model_copy(update={"q": wide.q.model_copy(update={"device": "cuda:0"}), "requires_grad": True})
    # K = 256: offered since version 14 (its backward takes K in blocks; before, it needed 248 KB of shared
    # memory on the H200 and was refused)
    assert backend.supports(wide) and backend.supports(wide.model_copy(update={"requires_grad": False}))
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (7, 5))
    assert "compute capability >= 8.0" in str(backend.supports(on_gpu))


def test_chunk_layout_covers_every_token_once():
    from kda.backends.chunks import chunk_layout

    layout = chunk_layout((0, 70, 70, 71, 135), 32, torch.device("cpu"))
    starts = layout.chunk_starts.tolist()
    assert starts == [0, 32, 64, 70, 71, 103]
    assert layout.chunk_seq_ends.tolist() == [70, 70, 70, 71, 135, 135]
    assert layout.chunk_offsets.tolist() == [0, 3, 3, 4] and layout.num_chunks == 6
    covered = sorted(
        itertools.chain.from_iterable(range(s, min(s + 32, e)) for s, e in zip(starts, layout.chunk_seq_ends.tolist()))
    )
    assert covered == list(range(135))


# ------------------------------------------------------------------------------------ random calls

from hypothesis import HealthCheck, given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402


@st.composite
def random_cases(draw) -> VerificationCase:
    """Any combination of the contract's features, at small random sizes (K, V not powers of two,
    sequence lengths around and across chunk boundaries, empty sequences)."""
    chunk = draw(st.sampled_from([32, 64]))
    varlen = draw(st.booleans())
    gva = draw(st.booleans())
    training = draw(st.booleans())
    cc = case_class(
        gate=draw(st.sampled_from(list(GateMode))),
        qk_l2norm=draw(st.booleans()),
        beta=draw(st.sampled_from(["given", "sigmoid", "sigmoid2"])),
        # bf16 is left to the fixed cases: with the intermediates stored in bf16, tiny random outputs come close
        # to the 5e-3 tolerance (160 drawn alike offline, with the GPU's products: all passed, worst error 0.95
        # of the tolerance, median 0.59; 0.92 with exact products), too close for a test that must not flake.
        dtype=draw(st.sampled_from(["float32", "float16"])),
        varlen=varlen,
        gva=gva,
        initial_state=draw(st.booleans()),
        final_state=draw(st.booleans()),
        state_v_first=draw(st.booleans()),
        chunk_size=chunk,
        training=training,
    )
    lengths = st.integers(min_value=0, max_value=2 * chunk + 3)
    seq_lens = tuple(draw(st.lists(lengths, min_size=1, max_size=3))) if varlen else (draw(lengths.filter(bool)),)
    if sum(seq_lens) == 0:
        seq_lens = (*seq_lens, 1)
    group = draw(st.sampled_from([2, 3])) if gva else 1
    K, V = draw(st.integers(4, 40)), draw(st.integers(4, 40))
    # Every regime, except extreme gates for fp32 softplus training: there dA_log meets the fp32 decay limit
    # (test_dA_log_past_the_fp32_decay_limit, a strict xfail). 240 such cases drawn offline all passed
    # (worst 5.9e-4 of the 1e-3 tolerance), so they were drawn again; a CI run then drew one at 3.2e-3, and 150 more drawn offline failed 3 times (1.3e-3, 2.5e-3, 8.1e-3; median 1.6e-5): about one
    # CI run in 50 would fail on it. With version 21 (the floor, the reset once a sequence) 1 of 312 failed
    # (median 1.1e-5, p90 7.5e-5): rarer, not gone. The sigmoid gate's extreme regime (a bound of -40, past the
    # floor) meets the same limit: a CI run drew test_dA_log_of_a_sigmoid_gate_past_the_fp32_decay_limit's case
    # (1.65e-3), and 120 drawn offline failed once (5.1e-3; median 7e-6). Realistic fp32 training of both gates,
    # and extreme gates elsewhere, stay in.
    extreme_allowed = not (training and cc.dtype == "float32" and cc.gate in (GateMode.SOFTPLUS, GateMode.SIGMOID))
    regime = draw(st.sampled_from(["realistic", "extreme"] if extreme_allowed else ["realistic"]))
    B = 1 if varlen else draw(st.integers(1, 2))
    if not varlen:
        seq_lens = seq_lens * B
    # Training takes the gate input in fp32 with fp16 (as models commonly pass it): dg comes back in g's dtype,
    # and a saturated gate's dg lies in fp16's subnormals, where rounding the float64 reference itself to
    # fp16 is 2.4e-2 off (tolerance 2e-2) for a one-token sequence (safe gate, seed 37), whatever the backend.
    g_dtype = "float32" if training and cc.dtype == "float16" else cc.dtype
    H = training_heads(cc)  # dA_log is one number per head: see tests/kernel_cases.py
    seed = draw(st.integers(0, 2**31 - 1))
    return VerificationCase(cc, regime, B, H, H * group, K, V, seq_lens, g_dtype, seed=seed)


@settings(
    max_examples=int(os.environ.get("KDA_RANDOM_CASES", "25")),
    deadline=None,
    suppress_health_check=[HealthCheck.function_scoped_fixture],
)
@given(case=random_cases())
def test_random_calls_match_the_reference(interpreter, case):
    result = run_case(interpreter, case, "cpu")
    assert result.passed, (case.case_class.key, case.describe(), result.reason, result.errors)


def test_dA_log_with_saturated_softplus_gates_in_fp32(interpreter):
    """Found by the random training cases: dA_log was 1.56e-3 off (fp32 tolerance 1e-3) here, every other
    gradient within 4e-5. The per-token log decay's gradient was the reverse cumsum of dG, whose O(1) terms
    cancel to ~1e-8 residuals at tokens with a log decay of -50 to -500, and dA_log = sum a da multiplied
    them by a (see kda/backends/triton/chunk_backward.py). Now about 2e-5."""
    cc = case_class(
        gate=GateMode.SOFTPLUS,
        qk_l2norm=True,
        beta="given",
        dtype="float32",
        varlen=True,
        gva=True,
        initial_state=False,
        final_state=False,
        chunk_size=64,
        training=True,
    )
    case = VerificationCase(cc, "extreme", 1, 1, 2, 23, 4, (78, 59, 83), "float32", seed=124821)
    result = run_case(interpreter, case, "cpu")
    assert result.passed, (result.reason, result.errors)
    assert result.errors["dA_log"] < 1e-4, result.errors


def test_dA_log_at_the_fp32_decay_limit(interpreter):
    """A saturated softplus gate takes a chunk's cumulative decay G to -950 in fp32 (ulp 6e-5), so the
    exponents G_i - G_j of nearby tokens after a large drop carry that error, and dA_log (one value here,
    HV = 1, 1200 times smaller than sum |a da|) is where it shows. It was 6.5e-3 off (a strict xfail) while
    the gate kernel formed G by one scan over the chunk; formed per 16-row sub-chunk on a carried sum
    (backend version 6, `gate`) it is 2.2e-4 against the 1e-3 tolerance. The limit itself remains (a G that
    keeps its low bits, float64 or two fp32 parts, would lift it: the same math with a float64 G is 8e-6
    off), so this case stays in the suite as the one closest to it. Since version 21 its saturated decays
    are floored at -32 and the extreme regime resets once a sequence: other inputs, 5.8e-4 (the floored
    inputs without the reset came out at 2.9e-3, the limit showing again; 34 cases of this class drawn alike
    without the reset: median 9e-6, worst 9.4e-5, against 2.5e-5 and 3.2e-4 without the floor)."""
    cc = case_class(
        gate=GateMode.SOFTPLUS, qk_l2norm=False, beta="sigmoid", dtype="float32", chunk_size=64, training=True
    )
    case = VerificationCase(cc, "extreme", 1, 1, 1, 5, 31, (123,), "float32", seed=1308272535)
    result = run_case(interpreter, case, "cpu")
    assert result.passed, (result.reason, result.errors)


@pytest.mark.xfail(strict=True, reason="the fp32 decay limit: dA_log 2.6e-2 against the 1e-3 tolerance")
def test_dA_log_past_the_fp32_decay_limit(interpreter):
    """Extreme softplus gates, fp32 training, one value head, so dA_log is one number summed over two
    sequences of saturated decays. First drawn by a CI run (seed 49465691: 3.4e-3 off in versions 9 to 20,
    whichever path the backward's diagonal blocks take, every other gradient within 2.4e-5; 150 such cases
    drawn offline failed 3 times, up to 8.1e-3). Since version 21 (the floor, and the extreme regime's reset
    once a sequence) that seed passes at 1.2e-4 and 312 cases of the class drawn offline failed once: this
    one (seed 311), 2.6e-2 off, every other gradient within 2.9e-5. Its dA_log is 14000 times smaller than
    sum |a da| (the torch backend, with a float64 G, is 9.8e-4 off; the floor's own answer in float64 is
    2.5e-10 off the exact one): the limit of an fp32 `G` that test_dA_log_at_the_fp32_decay_limit stays
    inside. Strict: a fix (a `G` that keeps its low bits) makes it pass, and the random cases should then
    draw this regime again."""
    case = VerificationCase(
        CaseClass.from_key("softplus/qk/sig2/fp32/varlen/mha/nostate:vk/c64/d64/train"),
        "extreme",
        1,
        1,
        1,
        4,
        37,
        (130, 130),
        "float32",
        seed=311,
    )
    result = run_case(interpreter, case, "cpu")
    assert result.passed, (result.reason, result.errors)


@pytest.mark.xfail(strict=True, reason="the fp32 decay limit: dA_log 1.65e-3 against the 1e-3 tolerance")
def test_dA_log_of_a_sigmoid_gate_past_the_fp32_decay_limit(interpreter):
    """The sigmoid gate's extreme regime (lower_bound = -40, exp(A_log) = 13: most decays floored at -32, so a
    chunk's G falls to about -1000, ulp 6e-5), fp32 training, one value head. Drawn by a CI run: dA_log 1.65e-3
    off, every other gradient within 1.9e-5. dA_log (0.0165 here) is a sum of dg z whose terms cancel; one
    token's dg, 3e-5 off, carries most of the error. Not the gate's own derivative (computed as s(x) s(-x)
    instead of s (1 - s) it stays 1.64e-3): the exponents of an fp32 G. The torch backend, whose G is float64,
    is 8.9e-6 off. Strict, like test_dA_log_past_the_fp32_decay_limit: a G that keeps its low bits makes it
    pass, and the random cases should then draw this regime again."""
    case = VerificationCase(
        CaseClass.from_key("sigmoid/l2/sig/fp32/varlen/mha/ht/c64/d64/train"),
        "extreme",
        1,
        1,
        1,
        12,
        40,
        (56, 56, 24),
        "float32",
        seed=24052301,
    )
    result = run_case(interpreter, case, "cpu")
    assert result.passed, (result.reason, result.errors)


def test_log_decay_gradient_is_zero_where_the_decay_underflows(seed, interpreter):
    """A token whose log decay is far below exp's range (here -150 to -400, a saturated gate) has a true
    gradient ~e^(a) and must get exactly 0 in fp32: every term of the kernel's da_t carries the decay across
    t. The reverse cumsum of dG left the residual of O(1) terms that cancel there (~1e-8), which the gate's
    A_log gradient multiplies by a. Chunk 64, so that pairs of sub-chunks also span whole sub-chunks."""
    B, T, H, K, V, C = 1, 2 * 64 + 7, 1, 12, 8, 64
    q, k, v = torch.randn(B, T, H, K), torch.randn(B, T, H, K), torch.randn(B, T, H, V)
    saturated = torch.rand(B, T, H, K) < 0.15
    g = torch.where(saturated, -150 - 250 * torch.rand(B, T, H, K), -2 * torch.rand(B, T, H, K))
    call = {
        "q": q,
        "k": k,
        "v": v,
        "beta": torch.randn(B, T, H),
        "initial_state": torch.randn(B, H, K, V),
        "use_qk_l2norm_in_kernel": True,
        "use_beta_sigmoid_in_kernel": True,
        "output_final_state": True,
    }
    do, dht = torch.randn(B, T, H, V), torch.randn(B, H, K, V)
    g32 = g.clone().requires_grad_(True)
    o, ht = kda.chunk_kda(**call, g=g32, chunk_size=C, backend="triton")
    (dg,) = torch.autograd.grad([o, ht], [g32], [do, dht])
    g64 = g.double().requires_grad_(True)
    o64, ht64 = kda.kda_reference(
        **{n: (t.double() if isinstance(t, torch.Tensor) else t) for n, t in call.items()}, g=g64
    )
    (dg_ref,) = torch.autograd.grad([o64, ht64], [g64], [do.double(), dht.double()])
    assert dg_ref[saturated].abs().max() < 1e-40
    assert torch.equal(dg[saturated], torch.zeros_like(dg[saturated]))
    assert ((dg.double() - dg_ref).norm() / dg_ref.norm()).item() < 1e-4


@pytest.mark.parametrize("step_limit", [8.0, -1.0], ids=["products", "elementwise"])
def test_diagonal_blocks_at_the_products_limits(step_limit, interpreter, monkeypatch):
    """The backward's diagonal blocks go by products (`diagonal_backward.diagonal_by_products`) while a block's decay
    span is at most DOT_SPAN (80) and its largest single log decay at most DIFFERENCE_STEP (8), else element
    by element. Softplus gates with a log decay near -5.2 a step put 16-row blocks just under both (spans
    near 78, where the anchored factors reach e^78, and the decays that multiply the products' da residual
    in dA_log); fp32, every gradient against the float64 reference. With the step limit at -1 every block
    takes the element-wise path, which must agree as well."""
    from kda.backends.triton import chunk_backward

    monkeypatch.setattr(chunk_backward, "DIFFERENCE_STEP", tl.constexpr(step_limit))
    B, T, H, K, V, C = 1, 64 + 37, 2, 16, 8, 64
    gen = torch.Generator().manual_seed(int(torch.randint(0, 2**31 - 1, ())))
    q, k, v = (torch.randn(B, T, H, D, generator=gen) for D in (K, K, V))
    g = 5.19 + 0.01 * torch.randn(B, T, H, K, generator=gen)  # softplus(5.19) = 5.2: spans of 78 a block
    call = {
        "q": q,
        "k": k,
        "v": v,
        "beta": torch.randn(B, T, H, generator=gen),
        "use_gate_in_kernel": True,
        "use_qk_l2norm_in_kernel": True,
        "use_beta_sigmoid_in_kernel": True,
    }
    leaves = {
        "g": g,
        "A_log": 0.001 * torch.randn(H, generator=gen),
        "dt_bias": 0.001 * torch.randn(H * K, generator=gen),
    }
    do = torch.randn(B, T, H, V, generator=gen)
    # Each block's span: the log decays of its rows after the first, summed (the blocks start every 16 rows).
    a = -leaves["A_log"].exp().view(1, 1, H, 1) * torch.nn.functional.softplus(g + leaves["dt_bias"].view(1, 1, H, K))
    spans = [a[:, start + 1 : start + 16].sum(1).abs().max().item() for start in range(0, T, 16)]
    assert 70 < max(spans[:-1]) < 80 and a.abs().max() < 8, (spans, a.abs().max())  # under both limits
    ours = {n: t.clone().requires_grad_(True) for n, t in leaves.items()}
    (o,) = kda.chunk_kda(**call, **ours, chunk_size=C, backend="triton")[:1]
    grads = torch.autograd.grad(o, list(ours.values()), do)
    ref = {n: t.double().requires_grad_(True) for n, t in leaves.items()}
    (o64,) = kda.kda_reference(
        **{n: (t.double() if isinstance(t, torch.Tensor) else t) for n, t in call.items()}, **ref
    )[:1]
    expected = torch.autograd.grad(o64, list(ref.values()), do.double())
    for name, got, want in zip(ours, grads, expected):
        error = ((got.double() - want).norm() / want.norm()).item()
        assert error < 1e-4, (name, error)


@pytest.mark.parametrize("late_channels", ["span", "step"])
def test_backward_in_several_k_blocks(late_channels, interpreter, monkeypatch):
    """The backward's per-chunk kernel takes K in blocks of `backward_block_k` columns (two blocks of 8
    here), and a diagonal block's path is chosen from every column: here only the upper K block has large
    decays. "span": log decays of 6.5 a step (under DIFFERENCE_STEP), spans near 97 (past DOT_SPAN, e^97
    overflows fp32): taken by products on the lower block's evidence alone, every gradient would be NaN.
    "step": log decays of 9 (past DIFFERENCE_STEP) in a few rows. V in blocks of 8 too; GVA and varlen
    (a ragged boundary inside a chunk). fp32, every gradient against the float64 reference."""
    import dataclasses

    from kda.backends.triton import forward

    shipped = forward.launch_config
    monkeypatch.setattr(
        forward,
        "launch_config",
        lambda *args: dataclasses.replace(shipped(*args), backward_block_k=8, backward_block_v=8),
    )
    T, H, HV, K, V, C = 2 * 64 + 21, 1, 2, 16, 16, 64
    gen = torch.Generator().manual_seed(int(torch.randint(0, 2**31 - 1, ())))
    q, k = (torch.randn(1, T, H, K, generator=gen) for _ in range(2))
    v = torch.randn(1, T, HV, V, generator=gen)
    g = -0.5 * torch.rand(1, T, HV, K, generator=gen)  # pre-gated log decays
    if late_channels == "span":
        g[..., 8:] = -6.5 + 0.01 * torch.randn(1, T, HV, 8, generator=gen)
    else:
        g[:, 5::16, :, 8:] = -9.0
    cu_seqlens = torch.tensor([0, 64 + 29, T], dtype=torch.long)
    call = {
        "q": q,
        "k": k,
        "v": v,
        "beta": torch.rand(1, T, HV, generator=gen),
        "cu_seqlens": cu_seqlens,
        "use_qk_l2norm_in_kernel": True,
        "initial_state": torch.randn(2, HV, K, V, generator=gen),
        "output_final_state": True,
    }
    do, dht = torch.randn(1, T, HV, V, generator=gen), torch.randn(2, HV, K, V, generator=gen)
    names = ["q", "k", "v", "g", "beta", "initial_state"]
    ours = {n: (g if n == "g" else call[n]).clone().requires_grad_(True) for n in names}
    o, ht = kda.chunk_kda(**{**call, **ours}, chunk_size=C, backend="triton")
    grads = torch.autograd.grad([o, ht], list(ours.values()), [do, dht])
    ref = {n: t.detach().double().requires_grad_(True) for n, t in ours.items()}
    rest = {
        n: (t.double() if isinstance(t, torch.Tensor) and t.is_floating_point() else t)
        for n, t in call.items()
        if n not in ref
    }
    o64, ht64 = kda.kda_reference(**rest, **ref)
    expected = torch.autograd.grad([o64, ht64], list(ref.values()), [do.double(), dht.double()])
    for name, got, want in zip(ours, grads, expected):
        error = ((got.double() - want).norm() / want.norm()).item()
        assert error < 1e-4, (name, error)


@triton.jit
def _dot_kernel(a, b, out, PRECISION: tl.constexpr):
    r = tl.arange(0, 16)
    offsets = r[:, None] * 16 + r[None, :]
    tl.store(out + offsets, tl.dot(tl.load(a + offsets), tl.load(b + offsets), input_precision=PRECISION))


@pytest.mark.parametrize("precision", ["tf32", "tf32x3", "ieee"])
def test_interpreter_products_are_the_gpus(seed, interpreter, precision):
    """Under the `interpreter` fixture a TF32 product reads its operands truncated to 10 mantissa bits
    (exactly what the GPU computes), TF32x3 is within fp32 rounding of the exact product, and IEEE is
    the exact product; the plain interpreter would give the exact product for all three."""
    import numpy as np
    from tf32 import truncate_to_tf32

    a, b = torch.randn(16, 16), torch.randn(16, 16)
    out = torch.empty(16, 16)
    _dot_kernel[(1,)](a, b, out, PRECISION=precision)
    exact = a.double() @ b.double()
    if precision == "tf32":
        truncated = (
            torch.from_numpy(truncate_to_tf32(a.numpy())).double()
            @ torch.from_numpy(truncate_to_tf32(b.numpy())).double()
        )
        assert torch.allclose(out.double(), truncated, rtol=1e-6, atol=1e-6)
        assert ((out.double() - exact).norm() / exact.norm()).item() > 1e-4  # what the emulation changes
        assert not np.array_equal(truncate_to_tf32(a.numpy()), a.numpy())
    else:
        assert ((out.double() - exact).norm() / exact.norm()).item() < 1e-6


@triton.jit
def _storage_dot_kernel(a, b, out, PRECISION: tl.constexpr):
    r = tl.arange(0, 16)
    offsets = r[:, None] * 16 + r[None, :]
    # looked up at the call: the `interpreter` fixture may have reloaded `storage` as interpreted functions
    tl.store(out + offsets, triton_storage.dot(tl.load(a + offsets), tl.load(b + offsets), PRECISION))


def test_rounded_tf32_products(seed, interpreter):
    """`storage.dot` at TF32_ROUNDED rounds each operand to nearest TF32 (ties away, as cvt.rna.tf32.f32)
    before the tensor cores' TF32 product (emulated: it truncates, which then drops only zeros): exactly
    the product of the rounded operands, and closer to the exact product than the truncated TF32 product,
    whose every term errs toward zero."""
    from tf32 import round_to_tf32, truncate_to_tf32

    a, b = torch.randn(16, 16), torch.randn(16, 16)
    out = torch.empty(16, 16)
    _storage_dot_kernel[(1,)](a, b, out, PRECISION="tf32_rounded")
    exact = a.double() @ b.double()

    def product(operand):
        return torch.from_numpy(operand(a.numpy())).double() @ torch.from_numpy(operand(b.numpy())).double()

    assert torch.allclose(out.double(), product(round_to_tf32), rtol=1e-6, atol=1e-6)
    rounded, truncated = ((x - exact).norm() / exact.norm() for x in (out.double(), product(truncate_to_tf32)))
    assert 1e-5 < rounded < truncated, (rounded, truncated)


def test_bf16_halves_products(seed, interpreter):
    """`storage.dot` at BF16_HALVES: each operand split as ``hi = bf16(x)``, ``lo = bf16(x - hi)`` (rounded to
    nearest even) and the three products ``lo hi + hi lo + hi hi``: within fp32 rounding of that sum, about
    2^-16 of the exact product, far closer than one TF32 product and short of TF32x3."""
    a, b = torch.randn(16, 16), torch.randn(16, 16)
    out = torch.empty(16, 16)
    _storage_dot_kernel[(1,)](a, b, out, PRECISION="bf16_halves")
    exact = a.double() @ b.double()

    def halves(x):
        hi = x.to(torch.bfloat16).double()
        return hi, (x.double() - hi).to(torch.bfloat16).double()

    (a_hi, a_lo), (b_hi, b_lo) = halves(a), halves(b)
    expected = a_lo @ b_hi + a_hi @ b_lo + a_hi @ b_hi
    assert torch.allclose(out.double(), expected, rtol=1e-6, atol=1e-6)
    error = ((out.double() - exact).norm() / exact.norm()).item()
    without_lo = ((a_hi @ b_hi - exact).norm() / exact.norm()).item()
    assert 1e-7 < error < 2**-14 < without_lo, (error, without_lo)


def _passes_then_fails_on_dA_log(interpreter, monkeypatch, case, bound: float, settings: dict[str, str]):
    """``case`` passes as shipped, with ``dA_log`` under ``bound``, and fails on ``dA_log`` once the
    `storage` training products ``settings`` names (``{"INTRA": "tf32", ...}``) are forced."""
    from kda.backends.triton import storage

    result = run_case(interpreter, case, "cpu")
    assert result.passed, (result.reason, result.errors)
    assert result.errors["dA_log"] < bound, result.errors
    for kernel, precision in settings.items():
        monkeypatch.setattr(storage, f"TRAINING_{kernel}", precision)
    kda.registry._reset_for_tests()
    result = run_case(kda.get_backend("triton"), case, "cpu")
    assert not result.passed and "dA_log" in result.reason, (result.reason, result.errors)


def test_bf16_training_dA_log_survives_the_gpus_products(interpreter, monkeypatch):
    """A case the H200 failed in version 8 (bf16 training, dA_log 1.28e-2 > 1e-2 with every product in TF32;
    the interpreter with truncated TF32 gives 1.27e-2). Every kernel but the output now multiplies in
    TF32x3 when training (`storage`): dA_log 4.7e-5. Forced back to TF32 everywhere, the same case fails on
    dA_log alone."""
    case = VerificationCase(
        CaseClass.from_key("safe/l2/sig/bf16/dense/mha/h0+ht/c32/d128/train"),
        "realistic",
        2,
        2,
        2,
        128,
        128,
        (77, 77),
        "bfloat16",
        seed=1548069176,
    )
    _passes_then_fails_on_dA_log(
        interpreter,
        monkeypatch,
        case,
        3e-4,
        dict.fromkeys(("INTRA", "STATE", "BACKWARD_STATE", "BACKWARD_CHUNK"), "tf32"),
    )


def test_half_training_dA_log_with_tf32_in_intra(interpreter, monkeypatch):
    """Drawn by the random training cases (fp16 training, softplus gate, realistic regime): with intra and
    the backward state pass in TF32 (versions 12 to 15) dA_log came out 1.85e-2 off (tolerance 1e-2), every
    other gradient within 9e-4; 3 of 60 random bf16/fp16 training cases drawn alike failed the same way.
    With every kernel but the output in TF32x3 (versions 16 and 19) it is 4e-5 off (2.3e-3 in versions 17
    and 18, with the backward state pass in rounded TF32)."""
    cc = case_class(
        gate=GateMode.SOFTPLUS,
        qk_l2norm=False,
        beta="given",
        dtype="float16",
        initial_state=False,
        final_state=True,
        state_v_first=True,
        chunk_size=32,
        training=True,
    )
    case = VerificationCase(cc, "realistic", 1, 1, 1, 4, 4, (14,), "float32", seed=1)
    _passes_then_fails_on_dA_log(interpreter, monkeypatch, case, 1e-3, {"INTRA": "tf32", "BACKWARD_STATE": "tf32"})


def test_bf16_training_dA_log_with_tf32_in_the_backward_state_pass(interpreter, monkeypatch):
    """Drawn by the random training cases (a short varlen batch, extreme gates): with the backward's
    serial pass in TF32, whose operands the tensor cores truncate, dA_log fails (1.24e-2 off the float64
    reference, tolerance 1e-2); in TF32x3, as shipped, 4e-5."""
    case = VerificationCase(
        CaseClass.from_key("safe/qk/sig2/bf16/varlen/mha/h0+ht/c64/d64/train"),
        "extreme",
        1,
        1,
        1,
        25,
        8,
        (36, 6),
        "bfloat16",
        seed=1338461651,
    )
    _passes_then_fails_on_dA_log(interpreter, monkeypatch, case, 1e-3, {"BACKWARD_STATE": "tf32"})


def test_half_training_dA_log_with_rounded_tf32_in_the_backward_state_pass(interpreter, monkeypatch):
    """Drawn by CI's random cases against version 18 (fp16 training, softplus gate, varlen, K = 4): with the
    backward's serial pass in rounded TF32 (`storage.TF32_ROUNDED`: operands rounded to TF32, then one TF32
    product; versions 17 and 18 shipped it) dA_log came out 1.0015e-2 off (tolerance 1e-2); in truncated
    TF32 6.8e-3. Rounding made the operands' error unbiased, not small enough. In TF32x3, as shipped again
    since version 19, 1.2e-4."""
    cc = case_class(
        gate=GateMode.SOFTPLUS,
        qk_l2norm=False,
        beta="given",
        dtype="float16",
        varlen=True,
        initial_state=False,
        final_state=False,
        chunk_size=32,
        training=True,
    )
    case = VerificationCase(cc, "realistic", 1, 1, 1, 4, 39, (56, 52), "float32", seed=306)
    _passes_then_fails_on_dA_log(interpreter, monkeypatch, case, 1e-3, {"BACKWARD_STATE": triton_storage.TF32_ROUNDED})


# ------------------------------------------------------------------------------------ extreme decays, non-finite inputs


def _direct(backend, call: dict, upstream: dict | None = None) -> dict:
    """The backend's forward (and, given upstream gradients, backward) on `call`, called directly (no dispatch,
    so no lazy verification), as a dict of outputs and gradients named like the verifier's."""
    from kda.backends.base import KDAInputs

    spec = kda.KDASpec.from_call(**call, requires_grad=upstream is not None)
    inputs = KDAInputs(**{n: call.get(n) for n in KDAInputs.__dataclass_fields__ if n in call})
    fwd = backend.forward(inputs, spec)
    got = {"o": fwd.o, "final_state": fwd.final_state}
    if upstream is not None:
        grads = backend.backward(inputs, spec, fwd.saved, upstream["do"], upstream.get("dfinal_state"))
        names = ("dq", "dk", "dv", "dg", "dbeta", "dA_log", "ddt_bias", "dinitial_state")
        got.update({n: t for n, t in zip(names, grads.as_tuple()) if t is not None})
    return got


def _reference_of(call: dict, upstream: dict | None = None) -> dict:
    floats = {
        n: (
            t.detach().double().requires_grad_(upstream is not None)
            if torch.is_tensor(t) and t.is_floating_point()
            else t
        )
        for n, t in call.items()
        if n != "chunk_size"
    }
    o, state = kda.kda_reference(**floats)
    ref = {"o": o.detach(), "final_state": state.detach()}
    if upstream is not None:
        leaves = {n: t for n, t in floats.items() if torch.is_tensor(t) and t.requires_grad}
        found = torch.autograd.grad(
            [o, state], list(leaves.values()), [upstream["do"].double(), upstream["dfinal_state"].double()]
        )
        ref.update({("dinitial_state" if n == "initial_state" else "d" + n): d for n, d in zip(leaves, found)})
    return ref


# (gate, value): the pre-gated log decay itself, or the softplus gate's input g (so g + dt_bias is huge)
EXTREME_DECAYS = [("pregated", -1e6), ("pregated", -1e30), ("pregated", -math.inf), ("softplus", 1e30)]


@pytest.mark.parametrize("training", [False, True], ids=["forward", "training"])
@pytest.mark.parametrize("gate, value", EXTREME_DECAYS, ids=[f"{g}={v:g}" for g, v in EXTREME_DECAYS])
def test_extreme_log_decays_match_the_reference(seed, interpreter, gate, value, training):
    """A per-token log decay past LOG_DECAY_FLOOR (-32) is computed as the floor, in the gate stage (and its
    derivative is 0 there in the backward's tail). Before: 1.2e-2 off at -1e6 (G, an fp32 cumulative sum,
    lost the other tokens' decays: its ulp at 1e6 is 0.06), 0.57 at -1e30, NaN at -inf. fp32, chunk 32, two
    sequences; the extreme token inside a chunk, and a partial one (every other channel) in another."""
    T, H, K, V = 32 + 20, 1, 16, 8
    call = {
        "q": torch.randn(1, T, H, K),
        "k": torch.randn(1, T, H, K),
        "v": torch.randn(1, T, H, V),
        "beta": torch.rand(1, T, H),
        "initial_state": torch.randn(2, H, K, V),
        "output_final_state": True,
        "use_qk_l2norm_in_kernel": True,
        "cu_seqlens": torch.tensor([0, 32 + 11, T], dtype=torch.int32),
        "chunk_size": 32,
    }
    if gate == "pregated":
        g = -torch.rand(1, T, H, K)
    else:
        g = torch.randn(1, T, H, K)
        call.update(use_gate_in_kernel=True, A_log=torch.rand(H), dt_bias=torch.randn(H * K))
    g[:, 32 + 5] = value
    g[:, 9, :, ::2] = value
    if value == -1e30:
        g[:, 46, :, ::2], g[:, 46, :, 1::2] = -1e30, -math.inf
    call["g"] = g
    upstream = {"do": torch.randn(1, T, H, V), "dfinal_state": torch.randn(2, H, K, V)} if training else None
    got, ref = _direct(interpreter, call, upstream), _reference_of(call, upstream)
    assert set(got) == set(ref)
    for name in ref:
        assert torch.isfinite(got[name]).all(), name
        error = ((got[name].double() - ref[name]).norm() / ref[name].norm()).item()
        assert error < 1e-3, (name, error)
    if training:
        assert torch.equal(got["dg"][:, 32 + 5], torch.zeros_like(got["dg"][:, 32 + 5]))


NAN_REGIMES = {
    # mild decays, fp32: every diagonal block by products
    "mild-fp32": dict(dtype=torch.float32, strong_decay=False, l2=False),
    # log decays of -5 to -9 (diagonal blocks element by element), bf16 storage, l2norm in kernel
    "strong-bf16-l2": dict(dtype=torch.bfloat16, strong_decay=True, l2=True),
}


@pytest.mark.parametrize("regime", list(NAN_REGIMES))
@pytest.mark.parametrize("name", nonfinite.INPUTS)
def test_a_nan_stays_in_its_chunk(seed, interpreter, name, regime):
    """A NaN in one input at one token reaches everything the recurrence reaches, and beyond that only the
    earlier rows of its own chunk (`tests/nonfinite.py` with ``leak_from`` at the chunk's start): the products
    with the in-chunk triangular matrices multiply the zeros above their diagonal by the token's row, and
    keeping them causal measured 8.5-11% of the forward on the H200 (`intra`'s docstring). Earlier chunks,
    the other head and the other sequence are exactly as without it; a NaN in q stays in its own row."""
    call, token = nonfinite.two_sequence_call(chunk=32, **NAN_REGIMES[regime])

    def run(c: dict) -> tuple[torch.Tensor, torch.Tensor]:
        got = _direct(interpreter, c)
        return got["o"], got["final_state"]

    chunk_start = token // 32 * 32  # sequence 0 starts at token 0
    nonfinite.check_nan_stays_causal(
        run, call, name, token, bitwise_before=True, leak_from=token if name == "q" else chunk_start
    )


@pytest.mark.parametrize("split_k", [False, True], ids=["whole-k", "k-steps"])
def test_score_blocks_stay_causal_with_a_nan(seed, interpreter, monkeypatch, split_k):
    """The in-chunk scores themselves keep a NaN causal: with a NaN in one key, the entries above the
    diagonal of A_qk and A_kk stay exact zeros, on the element-by-element diagonal path too (where the row
    norms were applied after the mask: 0 times the key's NaN norm), with the products in K steps as well
    (`_score_row_block_split`)."""
    import dataclasses

    from kda.backends.base import KDAInputs
    from kda.backends.triton import forward

    if split_k:
        shipped = forward.launch_config
        monkeypatch.setattr(
            forward, "launch_config", lambda *args: dataclasses.replace(shipped(*args), intra_block_k=8)
        )
    call, token = nonfinite.two_sequence_call(chunk=32, dtype=torch.float32, strong_decay=True, l2=True)
    bad, _ = nonfinite.with_nan(call, "k", token)
    spec = kda.KDASpec.from_call(**bad)
    inputs = KDAInputs(**{n: bad.get(n) for n in KDAInputs.__dataclass_fields__ if n in bad})
    scores = {}

    def keep(*args, **kwargs):
        scores.update(A_kk=args[5].clone(), A_qk=args[6].clone())

    # intra writes T over A_kk: run only its scores (its timing-only PARTS=1) to read A_kk as they left it
    monkeypatch.setattr(forward, "intra_chunk_kernel", _Parts(forward.intra_chunk_kernel, 1, keep))
    stages, _ = forward.plan_forward(inputs, spec)
    for stage, launch in stages:
        if stage in ("gate", "intra"):
            launch()
    assert set(scores) == {"A_kk", "A_qk"}
    upper = torch.ones(32, 32, dtype=torch.bool).triu(1)
    for name, a in scores.items():
        assert torch.equal(a[:, :, upper], torch.zeros_like(a[:, :, upper])), name


class _Parts:
    """`intra_chunk_kernel` launched with ``PARTS`` set (its timing-only switch), then ``after(*args)``."""

    def __init__(self, kernel, parts: int, after):
        self.kernel, self.parts, self.after = kernel, parts, after

    def __getitem__(self, grid):
        def launch(*args, **kwargs):
            self.kernel[grid](*args, **kwargs, PARTS=self.parts)
            self.after(*args, **kwargs)

        return launch
