"""The helion backend's kernels, run on CPU tensors in Helion's interpreter (HELION_INTERPRET=1), and
compiled to Triton source without a GPU.

Each interpreter test checks the kernels against the float64 reference through the verifier's own
`run_case` (NaN-poisoned output buffers, inputs checked for modification, every gradient when training) on
fresh random inputs: every gate mode with realistic and extreme gates, l2norm and beta variants, varlen with
empty and one-token sequences, GVA, both state layouts, chunk 32 and 64, K != V, T not a multiple of the
chunk, bf16/fp16/fp32, forward and backward. A route test proves the helion kernels are what ran. Without
Helion these tests skip.
"""

from __future__ import annotations

import json
import os
import warnings

import pytest
import torch
from kernel_cases import (
    CORRELATED_VARIANTS,
    TRAINING_VARIANTS,
    case_class,
    expected_gradients,
    small_case,
    training_class,
    variant_id,
)

import kda
from kda.spec import GateMode
from kda.verify.check import relative_error, run_case
from kda.verify.policy import tolerance

pytest.importorskip("helion", reason="Helion is not installed (extra `helion`)")

from kda.backends.helion import configs, runtime


@pytest.fixture
def interpreter(monkeypatch):
    """The helion backend on CPU tensors in Helion's interpreter (Helion reads the switch when a kernel object
    is made; `runtime` keeps kernel objects per setting)."""
    if torch.cuda.is_available():
        pytest.skip("these tiny interpreter cases are for the CPU; on a GPU `kda.verify --backend helion` runs")
    monkeypatch.setenv("HELION_INTERPRET", "1")
    kda.registry._reset_for_tests()
    return kda.get_backend("helion")


VARIANTS = [
    dict(),
    dict(gate=GateMode.PREGATED, qk_l2norm=False, beta="given"),
    dict(gate=GateMode.SOFTPLUS, beta="sigmoid2", chunk_size=64),
    dict(varlen=True, gva=True, state_v_first=True),
    dict(dtype="bfloat16", varlen=True, initial_state=False),
    dict(dtype="float16", gva=True, final_state=False, chunk_size=64),
    dict(gate=GateMode.SIGMOID, varlen=True),
]


@pytest.mark.parametrize("variant", VARIANTS, ids=variant_id)
@pytest.mark.parametrize("regime", ["realistic", "extreme"])
def test_forward_matches_the_reference(seed, interpreter, variant, regime):
    cc = case_class(**variant)
    result = run_case(interpreter, small_case(cc, regime, seed=seed), "cpu")
    assert result.passed, (cc.key, result.reason, result.errors)
    assert "o" in result.errors


@pytest.mark.parametrize("variant", TRAINING_VARIANTS, ids=variant_id)
@pytest.mark.parametrize("regime", ["realistic", "extreme"])
def test_backward_gives_every_gradient(seed, interpreter, variant, regime):
    cc = training_class(variant, regime)
    result = run_case(interpreter, small_case(cc, regime, seed=seed), "cpu")
    assert result.passed, (cc.key, result.reason, result.errors)
    assert expected_gradients(cc) <= set(result.errors)


@pytest.mark.parametrize("variant", CORRELATED_VARIANTS, ids=variant_id)
@pytest.mark.parametrize("training", [False, True], ids=["forward", "training"])
def test_correlated_keys_in_a_remembering_head(seed, interpreter, variant, training):
    """The verifier's correlated regime (`kda.verify.cases`). `solve` summed the inverse as a Neumann series
    over the chunk until it met this regime: o came out 7e16 times its size, or inf. It now sums the series
    only inside 16-row diagonal blocks, with a Newton step, and joins the blocks by substitution."""
    cc = case_class(**variant, training=training)
    result = run_case(interpreter, small_case(cc, "correlated", seed=seed), "cpu")
    assert result.passed, (cc.key, result.reason, result.errors)


@pytest.mark.slow
@pytest.mark.parametrize("training", [False, True])
def test_head_dims_of_256(seed, interpreter, training):
    cc = case_class(dtype="float16", varlen=True, gva=True, qk_l2norm=False, chunk_size=64, training=training)
    result = run_case(interpreter, small_case(cc, "realistic", K=256, V=128, seed=seed), "cpu")
    assert result.passed, (cc.key, result.reason, result.errors)


@pytest.mark.parametrize("training", [False, True])
def test_strips_past_the_product_span_take_the_exact_diagonal(seed, interpreter, training, monkeypatch):
    """Strips of 16 tokens alternate between a gentle decay (span 0.8: the diagonal block by product) and a
    steep one (span 240 > 80: by product it would overflow to inf), so both paths run in one call."""
    torch.manual_seed(seed)
    B, T, H, K, V, C = 1, 2 * 32 + 13, 2, 16, 16, 32
    steep = ((torch.arange(T) // 16) % 2 == 1).view(1, T, 1, 1)
    g = torch.where(steep, -16.0, -0.05) * (0.5 + torch.rand(B, T, H, K))
    q, k, v = torch.randn(B, T, H, K), torch.randn(B, T, H, K), torch.randn(B, T, H, V)
    beta = torch.rand(B, T, H)
    leaves = [x.requires_grad_(training) for x in (q, k, v, g, beta)]
    monkeypatch.setenv("KDA_VERIFY", "off")  # the kernels themselves, against the float64 reference below
    o, _ = kda.chunk_kda(*leaves, backend="helion", chunk_size=C)
    wide = [x.detach().double().requires_grad_(training) for x in leaves]
    reference, _ = kda.chunk_kda(*wide, backend="torch", chunk_size=C)
    assert torch.isfinite(o).all()
    assert relative_error(o.double(), reference) <= tolerance("o", "float32")
    if training:
        do = torch.randn_like(o)
        grads = torch.autograd.grad(o, leaves, do)
        expected = torch.autograd.grad(reference, wide, do.double())
        for name, grad, want in zip(("dq", "dk", "dv", "dg", "dbeta"), grads, expected):
            assert relative_error(grad.double(), want) <= tolerance(name, "float32"), name


@pytest.mark.parametrize(
    ("dtype", "training", "output", "others"),
    [
        (torch.bfloat16, True, "tf32", "tf32x3"),  # o never reaches the backward: one TF32 product suffices
        (torch.bfloat16, False, "tf32", "tf32"),
        (torch.float32, True, "ieee", "ieee"),
    ],
    ids=["bf16-training", "bf16-inference", "fp32-training"],
)
def test_each_kernel_multiplies_at_its_precision(seed, interpreter, monkeypatch, dtype, training, output, others):
    launched: dict[str, set[str]] = {}
    real = runtime.launch

    def recording(fn, precision, args, key):
        launched.setdefault(fn.__name__.removesuffix("_kernel"), set()).add(precision)
        real(fn, precision, args, key)

    monkeypatch.setattr(runtime, "launch", recording)
    B, T, H, K, V = 1, 40, 2, 16, 16
    q, k, v = (torch.randn(B, T, H, D, dtype=dtype).requires_grad_(training) for D in (K, K, V))
    g = torch.nn.functional.logsigmoid(torch.randn(B, T, H, K)).to(dtype).requires_grad_(training)
    beta = torch.rand(B, T, H, dtype=dtype).requires_grad_(training)
    monkeypatch.setenv("KDA_VERIFY", "off")  # the route, not the verifier's own calls
    o, _ = kda.chunk_kda(q, k, v, g, beta, backend="helion", chunk_size=32)
    if training:
        o.sum().backward()
    assert launched.pop("output") == {output}
    # the inverse's products are never single TF32: a 16-block's Neumann sum reaches ~3432 times the
    # inverse on correlated keys, past what its Newton step repairs from TF32's error
    assert launched.pop("solve") == {"tf32x3" if others == "tf32" else others}
    assert len(launched) == (9 if training else 3), sorted(launched)
    assert all(used == {others} for used in launched.values()), launched


def _small_call(dtype: torch.dtype, training: bool):
    """A two-head call of three chunks (C = 32, the last ragged), safe gate, l2norm in kernel, both states:
    its inputs and spec, for the host functions of `forward` and `backward` directly."""
    from kda.backends.base import KDAInputs
    from kda.spec import KDASpec

    B, T, H, K, V = 1, 83, 2, 16, 16
    q, k, v, g = (torch.randn(B, T, H, D).to(dtype) for D in (K, K, V, K))
    beta = torch.randn(B, T, H).to(dtype)
    A_log, dt_bias, h0 = torch.randn(H), torch.randn(H * K), torch.randn(B, H, K, V)
    flags = dict(use_qk_l2norm_in_kernel=True, use_beta_sigmoid_in_kernel=True, use_gate_in_kernel=True, safe_gate=True)
    spec = KDASpec.from_call(
        q, k, v, g, beta, A_log=A_log, dt_bias=dt_bias, initial_state=h0, output_final_state=True,
        lower_bound=-5.0, chunk_size=32, requires_grad=training, **flags,
    )  # fmt: skip
    return KDAInputs(q, k, v, g, beta, A_log, dt_bias, h0), spec


def _record_launches(monkeypatch) -> dict[str, tuple]:
    """Every kernel launch from here on, by kernel name: its arguments and table key (the last launch of each)."""
    launched: dict[str, tuple] = {}
    real = runtime.launch

    def recording(fn, precision, args, key):
        launched[fn.__name__] = (args, key)
        real(fn, precision, args, key)

    monkeypatch.setattr(runtime, "launch", recording)
    return launched


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_training_on_half_inputs_keeps_w_and_A_qk_as_bf16_halves(seed, interpreter, monkeypatch, dtype):
    """What the two serial passes multiply, ``w`` and ``A_qk``, is kept for the backward as bf16 halves
    ``[NT, HV, 2, C, D]`` (fp16 inputs too: fp16 halves could overflow) whose sum is the fp32 value the same
    kernels give with fp32 storage, to 2^-16 of it (``hi`` its nearest bf16, ``lo`` the rest's); the training
    gradients on them are `test_the_training_serial_passes_multiply_halves`'s."""
    from kda.backends.helion import forward

    inputs, spec = _small_call(dtype, training=True)
    saved = forward.helion_forward(inputs, spec).saved
    NT, C = 3, spec.chunk_size
    for name, D in (("w", spec.K), ("A_qk", C)):
        halves = saved[name]
        assert halves.shape == (NT, spec.HV, 2, C, D) and halves.dtype == torch.bfloat16, (name, halves.shape)
    monkeypatch.setattr(forward, "training_halves", lambda spec: False)  # the same kernels, fp32 storage
    fp32 = forward.helion_forward(inputs, spec).saved
    for name in ("w", "A_qk"):
        halves, exact = saved[name], fp32[name]
        assert exact.dtype == torch.float32 and exact.shape == halves[:, :, 0].shape
        hi, lo = halves[:, :, 0].float(), halves[:, :, 1].float()
        assert torch.equal(hi, exact.to(torch.bfloat16).float()), name
        # 2^-16 relative; below bf16's normal range (2^-126: decays of e^-87) lo keeps fewer bits
        assert (hi + lo - exact).abs().le(2.0**-16 * exact.abs() + 2.0**-133).all(), name
        assert lo.abs().gt(0).any() and (hi + lo - exact).abs().lt((hi - exact).abs()).any(), name  # lo counts


@pytest.mark.parametrize(
    ("dtype", "training"),
    [(torch.float32, True), (torch.float32, False), (torch.bfloat16, False), (torch.float16, False)],
    ids=["fp32-training", "fp32-inference", "bf16-inference", "fp16-inference"],
)
def test_fp32_calls_and_inference_keep_their_storage(seed, interpreter, monkeypatch, dtype, training):
    """Only training on half inputs takes halves. fp32 calls keep ``w`` and ``A_qk`` in fp32 and their IEEE
    products (halves' 16 bits measured a ``dA_log`` past fp32's 1e-3 tolerance on the triton backend's
    kernels); inference keeps them in its storage dtype, every kernel in its ``HALVES``-off variant."""
    from kda.backends.helion import forward

    launched = _record_launches(monkeypatch)
    inputs, spec = _small_call(dtype, training=training)
    saved = forward.helion_forward(inputs, spec).saved
    store = forward.storage_dtype(spec)
    for name in ("scores_kernel", "solve_kernel", "state_kernel", "output_kernel"):
        args, key = launched.pop(name)
        assert args[-1] is False and not key.halves, name  # HALVES off
    if training:
        w, A_qk = saved["w"], saved["A_qk"]
        assert w.shape == (3, spec.HV, spec.chunk_size, spec.K) and w.dtype == torch.float32
        assert A_qk.shape == (3, spec.HV, spec.chunk_size, spec.chunk_size) and A_qk.dtype == torch.float32
        assert not saved["plan"].halves
    else:
        assert saved is None and store == dtype


@pytest.mark.parametrize(
    "chunk_backward_on_halves", [False, True], ids=["chunk-backward-fp32", "chunk-backward-halves"]
)
@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
def test_the_training_serial_passes_multiply_halves(seed, interpreter, monkeypatch, dtype, chunk_backward_on_halves):
    """A half-input training case against the float64 reference (every gradient at the policy's tolerance),
    with both serial passes shown to have run on the halves: the ``HALVES`` variant, ``w`` bf16 ``[NT, HV,
    2, C, K]``, and the table key that selects their launch settings; `chunk_backward` in the form its switch
    asks (shipped on, `backward.CHUNK_BACKWARD_ON_HALVES`), both forms held to the reference."""
    from kda.backends.helion import backward, forward

    monkeypatch.setattr(forward, "TRAINING_ON_HALVES", True)
    monkeypatch.setattr(backward, "CHUNK_BACKWARD_ON_HALVES", chunk_backward_on_halves)
    launched = _record_launches(monkeypatch)
    cc = case_class(dtype=dtype, varlen=True, gva=True, training=True)
    result = run_case(interpreter, small_case(cc, "realistic", seed=seed), "cpu")
    assert result.passed, (cc.key, result.reason, result.errors)
    assert expected_gradients(cc) <= set(result.errors)
    names = ("state_kernel", "state_backward_kernel", "chunk_backward_kernel")
    passes = {name: launched[name] for name in names}
    assert passes.pop("chunk_backward_kernel")[0][-1] is chunk_backward_on_halves  # its HALVES
    for name, (args, key) in passes.items():
        w = args[0] if name == "state_kernel" else args[5]
        assert args[-1] is True and key.halves and not key.half, name  # HALVES
        assert w.dtype == torch.bfloat16 and w.dim() == 5 and w.shape[2] == 2, (name, w.shape)


@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
def test_shipped_training_on_half_inputs_multiplies_on_halves(seed, interpreter, monkeypatch, dtype):
    """As shipped (`forward.TRAINING_ON_HALVES`, `backward.CHUNK_BACKWARD_ON_HALVES`), a half-input training
    case runs the ``HALVES`` forms of both serial passes and of `chunk_backward` on bf16 ``w``, under the
    table key with ``halves``, and passes the float64 reference on every gradient; the switches themselves
    are read, not patched, so turning either off fails here."""
    from kda.backends.helion import backward, forward

    assert forward.TRAINING_ON_HALVES and backward.CHUNK_BACKWARD_ON_HALVES
    launched = _record_launches(monkeypatch)  # records; patches no switch
    cc = case_class(dtype=dtype, varlen=True, gva=False, training=True)
    result = run_case(interpreter, small_case(cc, "realistic", seed=seed), "cpu")
    assert result.passed, (cc.key, result.reason, result.errors)
    assert expected_gradients(cc) <= set(result.errors)
    for name in ("state_kernel", "state_backward_kernel", "chunk_backward_kernel"):
        args, key = launched[name]
        assert args[-1] is True and key.halves and not key.half, name
    w = launched["state_kernel"][0][0]
    assert w.dtype == torch.bfloat16 and w.dim() == 5 and w.shape[2] == 2, w.shape


def test_the_helion_kernels_are_what_ran(seed, interpreter, monkeypatch):
    launched: list[str] = []
    real = runtime.launch

    def counting(fn, precision, args, key):
        launched.append(fn.__name__)
        real(fn, precision, args, key)

    monkeypatch.setattr(runtime, "launch", counting)
    B, T, H, K, V = 1, 40, 2, 16, 16
    q, k = torch.randn(B, T, H, K), torch.randn(B, T, H, K)
    v, g = torch.randn(B, T, H, V), torch.nn.functional.logsigmoid(torch.randn(B, T, H, K))
    beta = torch.rand(B, T, H)
    monkeypatch.setenv("KDA_VERIFY", "off")  # the route, not the verifier's own calls
    o, _ = kda.chunk_kda(q, k, v, g, beta, backend="helion", chunk_size=32)
    assert launched == ["gate_kernel", "scores_kernel", "solve_kernel", "state_kernel", "output_kernel"]
    reference, _ = kda.chunk_kda(q.double(), k.double(), v.double(), g.double(), beta.double(), backend="torch")
    assert relative_error(o.double(), reference) <= tolerance("o", "float32")


def test_availability_follows_the_interpreter_switch(monkeypatch):
    backend = kda.get_backend("helion")
    monkeypatch.setenv("HELION_INTERPRET", "0")
    verdict = backend.available()
    if not torch.cuda.is_available():
        assert not verdict and "HELION_INTERPRET=1" in str(verdict)
    monkeypatch.setenv("HELION_INTERPRET", "1")
    assert backend.available()


def _entry(K: int, V: int, C: int, half: bool, warps: int) -> dict:
    return {"K": K, "V": V, "C": C, "half": half, "config": {"num_warps": warps}}


def test_an_entry_serves_its_own_head_dims_and_storage_width_any_chunk(tmp_path, monkeypatch):
    table = tmp_path / "table.json"
    entries = [_entry(128, 128, 64, True, 4), _entry(128, 128, 32, True, 8), _entry(128, 128, 32, False, 2)]
    table.write_text(json.dumps({"k": entries}))
    monkeypatch.setenv(configs.TABLE_ENV, str(table))
    assert configs.nearest("k", configs.ShapeKey("cpu", 128, 128, 64, True)) == {"num_warps": 4}
    assert configs.nearest("k", configs.ShapeKey("cpu", 128, 128, 32, True)) == {"num_warps": 8}
    assert configs.nearest("k", configs.ShapeKey("cpu", 128, 128, 32, False)) == {"num_warps": 2}
    assert configs.nearest("k", configs.ShapeKey("cpu", 128, 128, 64, False)) == {"num_warps": 2}  # other chunk
    assert configs.nearest("k", configs.ShapeKey("cpu", 256, 128, 64, True)) is None  # not across head dims
    assert configs.nearest("other", configs.ShapeKey("cpu", 128, 128, 64, True)) is None


def test_another_config_table_is_another_fingerprint(tmp_path, monkeypatch):
    """Verification records are kept per fingerprint: a table that compiles other code must not reuse them."""
    backend = kda.get_backend("helion")
    monkeypatch.delenv(configs.TABLE_ENV, raising=False)
    shipped = backend.fingerprint_extras()["configs"]
    table = tmp_path / "table.json"
    table.write_text(json.dumps({"k": [_entry(128, 128, 64, True, 4)]}))
    monkeypatch.setenv(configs.TABLE_ENV, str(table))
    first = backend.fingerprint_extras()["configs"]
    assert first != shipped
    table.write_text(json.dumps({"k": [_entry(128, 128, 64, True, 8)]}))
    os.utime(table, (1, 1))  # a rewrite in the same second must count too: the mtime changes here
    assert backend.fingerprint_extras()["configs"] not in (first, shipped)
    monkeypatch.setenv(configs.TABLE_ENV, str(tmp_path / "absent.json"))
    assert backend.fingerprint_extras()["configs"] == shipped  # named but absent: the shipped tables alone


def test_the_fingerprint_reads_the_package_metadata_once(monkeypatch):
    """The verification store asks for the backend's fingerprint on every call; the installed helion's
    version in it is read from the package metadata once (0.6 ms a read on a CPU), not per call."""
    import importlib.metadata

    from kda.backends.helion import runtime

    reads = []
    real = importlib.metadata.version
    monkeypatch.setattr(importlib.metadata, "version", lambda name: reads.append(name) or real(name))
    runtime.helion_version.cache_clear()
    backend = kda.get_backend("helion")
    first = backend.fingerprint_extras()
    for _ in range(5):
        assert backend.fingerprint_extras() == first
    assert reads == ["helion"]


def test_an_entry_is_not_carried_across_storage_widths(tmp_path, monkeypatch):
    """A 16-bit (inference) entry does not configure the fp32 variant of its kernel, nor the reverse."""
    table = tmp_path / "table.json"
    table.write_text(json.dumps({"k": [_entry(128, 128, 64, True, 8)], "j": [_entry(64, 64, 64, False, 4)]}))
    monkeypatch.setenv(configs.TABLE_ENV, str(table))
    assert configs.nearest("k", configs.ShapeKey("cpu", 128, 128, 64, False)) is None
    assert configs.nearest("j", configs.ShapeKey("cpu", 64, 64, 64, True)) is None


def test_a_halves_entry_serves_half_input_training_alone(tmp_path, monkeypatch):
    """Training on half inputs (``w`` and ``A_qk`` as bf16 halves) and fp32 calls both keep fp32
    intermediates but run other programs: an entry marked ``halves`` configures only the first, one
    without the mark only the second."""
    table = tmp_path / "table.json"
    halves = dict(_entry(128, 128, 64, False, 4), halves=True)
    table.write_text(json.dumps({"k": [halves], "j": [_entry(128, 128, 64, False, 8)]}))
    monkeypatch.setenv(configs.TABLE_ENV, str(table))
    training = configs.ShapeKey("cpu", 128, 128, 64, False, halves=True)
    fp32 = configs.ShapeKey("cpu", 128, 128, 64, False)
    assert configs.nearest("k", training) == {"num_warps": 4}
    assert configs.nearest("k", fp32) is None
    assert configs.nearest("j", fp32) == {"num_warps": 8}
    assert configs.nearest("j", training) is None
    assert configs.entry_key(training) == {"K": 128, "V": 128, "C": 64, "half": False, "halves": True}
    assert "halves" not in configs.entry_key(fp32)


def test_the_shipped_halves_training_entries_are_the_settings_measured_on_an_h100():
    """The settings that ran on an H100 for half-input training (B4_T2048_H16_D128): the serial passes at 64
    value columns and 4 warps (no narrower than `halves.MIN_BLOCK_V`, below which `state` faulted there),
    `chunk_backward`'s halves form at Helion's default blocks, 4 warps and 3 stages (the fastest of five)."""
    from kda.backends.helion.halves import MIN_BLOCK_V

    key = configs.ShapeKey("sm90", 128, 128, 64, False, halves=True)
    for name in ("state_kernel", "state_backward_kernel"):
        config = configs.nearest(name, key)
        assert config is not None and (config["block_sizes"], config["num_warps"]) == ([64], 4), name
        assert config["block_sizes"][0] >= MIN_BLOCK_V
    config = configs.nearest("chunk_backward_kernel", key)
    assert config is not None and (config["block_sizes"], config["num_warps"], config["num_stages"]) == (
        [16, 16, 16],
        4,
        3,
    )


@pytest.mark.parametrize("text", ["{not json", "[1, 2]", json.dumps({"k": [{"K": "x"}, 5]})])
def test_a_broken_table_is_ignored_with_a_warning_or_its_bad_entries_dropped(tmp_path, monkeypatch, text):
    table = tmp_path / "table.json"
    table.write_text(text)
    monkeypatch.setenv(configs.TABLE_ENV, str(table))
    with warnings.catch_warnings(record=True):
        warnings.simplefilter("always")
        assert configs.nearest("k", configs.ShapeKey("cpu", 128, 128, 64, True)) is None


def test_the_default_configuration_warns_once_per_kernel(monkeypatch):
    monkeypatch.setattr(configs, "_WARNED", set())
    with pytest.warns(UserWarning, match="default configuration"):
        configs.warn_default("scores_kernel", "sm90", "no table entry")
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        configs.warn_default("scores_kernel", "sm90", "no table entry")


def test_the_shipped_table_is_well_formed():
    shipped = configs.shipped_table_path("sm90")
    data = json.loads(shipped.read_text())
    assert data and all(configs._well_formed(e) for entries in data.values() for e in entries)


@pytest.mark.parametrize("training, safe_gate", [(False, True), (True, True), (True, False)])
def test_every_kernel_lowers_to_triton_without_a_gpu(monkeypatch, training, safe_gate):
    """Helion's compiler (not the interpreter) turns each kernel into Triton source at a realistic shape
    (K = V = 128, chunk 64, bf16), the configuration being Helion's default: what a GPU would compile. The
    softplus gate bounds no strip's decays, so its training call lowers `score_diagonal` too."""
    monkeypatch.setenv("HELION_INTERPRET", "0")
    from kda.backends.base import KDAInputs
    from kda.backends.helion import backward, forward
    from kda.spec import KDASpec

    lowered: dict[str, int] = {}

    def lower(fn, precision, args, key):
        bound = runtime._kernel(fn, precision, False).bind(args)
        lowered[fn.__name__] = len(bound.to_triton_code(bound.config_spec.default_config()))

    monkeypatch.setattr(runtime, "launch", lower)
    B, T, H, D = 1, 100, 2, 128
    bf16 = torch.bfloat16
    q, k, v, g = (torch.randn(B, T, H, D, dtype=bf16) for _ in range(4))
    beta = torch.randn(B, T, H, dtype=bf16)
    A_log, dt_bias, h0 = torch.randn(H), torch.randn(H * D), torch.randn(B, H, D, D)
    flags = dict(use_qk_l2norm_in_kernel=True, use_beta_sigmoid_in_kernel=True, use_gate_in_kernel=True)
    spec = KDASpec.from_call(
        q, k, v, g, beta, A_log=A_log, dt_bias=dt_bias, initial_state=h0, output_final_state=True,
        safe_gate=safe_gate, lower_bound=-5.0 if safe_gate else None, chunk_size=64, requires_grad=training, **flags,
    )  # fmt: skip
    inputs = KDAInputs(q, k, v, g, beta, A_log, dt_bias, h0)
    result = forward.helion_forward(inputs, spec)
    expected = {"normalize_kernel", "gate_kernel", "scores_kernel", "solve_kernel", "state_kernel", "output_kernel"}
    if training:
        backward.helion_backward(inputs, spec, result.saved, torch.randn(B, T, H, D, dtype=bf16), torch.randn_like(h0))
        expected |= {"state_backward_kernel", "chunk_backward_kernel", "score_backward_kernel"}
        expected |= {"gate_tail_kernel", "qk_tail_kernel"} | (set() if safe_gate else {"score_diagonal_kernel"})
    assert set(lowered) == expected and all(size > 1000 for size in lowered.values())


@pytest.mark.parametrize(
    "gate_mode, lower_bound, bounded",
    [
        (GateMode.SAFE, -5.0, True),  # 15 steps of at most 5: a span of 75
        (GateMode.SAFE, -0.01, True),
        (GateMode.SIGMOID, -5.3, True),  # 79.5
        (GateMode.SIGMOID, -5.4, False),  # 81: a strip may pass 80
        (GateMode.SIGMOID, -8.0, False),  # the verifier's sigmoid classes
        (GateMode.SOFTPLUS, 0.0, False),  # nothing bounds a softplus or pre-gated step but the floor
        (GateMode.PREGATED, 0.0, False),
    ],
)
def test_the_backward_leaves_out_score_diagonal_only_where_the_gate_bounds_every_strip(gate_mode, lower_bound, bounded):
    """`score_backward.within_limits` decides on the host that no strip can be steep; where it says so, the
    strip with the steepest decays that gate allows (every step at the bound, rows past it at the floor's
    side) must go through the anchors by `by_product`, the decision the GPU takes, so that leaving the
    exact kernel out changes nothing; where it does not, some strip of that gate is steep."""
    from kda.backends.helion import forward, score_backward

    gate = forward.GATES[gate_mode]
    assert score_backward.within_limits(gate, lower_bound) is bounded
    step = abs(lower_bound) if gate_mode in (GateMode.SAFE, GateMode.SIGMOID) else 9.0  # a softplus step of 9
    G = -step * torch.arange(1, 17, dtype=torch.float32)[:, None].expand(16, 4)  # [16, K]: every step the largest
    previous = torch.cat([G[:1], G[:-1]])
    joined = bool(score_backward.by_product(G, previous, G[:1], G[-1:]))
    assert joined is bounded
