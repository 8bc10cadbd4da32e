"""The tilelang backend without a GPU: every kernel of every shape class it claims lowered to CUDA source for
Hopper (sm_90a), with the matrix products checked to be tensor-core instructions (``wgmma`` where the tile
allows it), the shared memory checked against the H200's limit, and, where this machine has nvcc, one
specialization compiled to machine code. Its numbers are checked on the GPU by `kda.verify --backend
tilelang`; here the backend must say it cannot run, and why, and decline what it does not cover.

Without tilelang these tests skip.
"""

from __future__ import annotations

import concurrent.futures
import os
import re
import subprocess

import pytest
import torch
from kernel_cases import case_class

import kda
from kda.spec import GateMode, KDASpec
from kda.verify.cases import VerificationCase, make_inputs

pytest.importorskip("tilelang", reason="TileLang is not installed (extra `tilelang`)")

from kda.backends.tilelang import CHUNKS, HEAD_DIMS, TileLangBackend, kernels, runtime

H200_SHARED_MEMORY = 232448  # bytes of dynamic shared memory one block may ask for (227 KB)


def spec_of(*, K: int, V: int, T: int = 100, training: bool = False, **changes) -> KDASpec:
    """The spec of a call of `case_class(**changes)` at head dims K, V (CPU tensors: only its shape matters)."""
    cc = case_class(**{"dtype": "bfloat16", **changes})
    group = 2 if cc.gva else 1
    lengths = (T, 0, 7) if cc.varlen else (T,)
    case = VerificationCase(cc, "realistic", 1, 2, 2 * group, K, V, lengths, cc.dtype, seed=1)
    kwargs, _ = make_inputs(case, "cpu")
    return KDASpec.from_call(**kwargs, requires_grad=training)


VARIANTS = {
    "pregated": dict(gate=GateMode.PREGATED, qk_l2norm=False, beta="given"),
    "softplus-sigmoid2-vfirst": dict(gate=GateMode.SOFTPLUS, beta="sigmoid2", state_v_first=True),
    "sigmoid-varlen-gva-nostate": dict(
        gate=GateMode.SIGMOID, varlen=True, gva=True, initial_state=False, final_state=False
    ),
    "fp16-raw-keys": dict(dtype="float16", qk_l2norm=False, initial_state=False),
}
CLAIMED = [(chunk, dim, dtype) for chunk in CHUNKS for dim in HEAD_DIMS for dtype in ("bfloat16", "float16")]


def _lower(kernel: kernels.Kernel) -> tuple[str, int]:
    artifact = runtime.lower(kernel.builder(*kernel.params), configs=runtime.pass_configs(kernel.builder))
    return artifact.kernel_source, runtime.shared_memory_bytes(artifact)


@pytest.fixture(scope="module")
def lowered() -> dict:
    """Every kernel of every claimed shape class and of each call variant (K = 128, V = 64), lowered to CUDA
    source for sm_90a: ``{(what, kernel name): (source, shared memory bytes) or the exception}``. Lowering
    runs in TVM's C++ passes, outside the GIL, so a thread per core lowers them side by side."""
    specs: dict = {claim: spec_of(K=claim[1], V=claim[1], chunk_size=claim[0], dtype=claim[2]) for claim in CLAIMED}
    specs |= {name: spec_of(K=128, V=64, chunk_size=64, **changes) for name, changes in VARIANTS.items()}
    specs["training"] = spec_of(K=128, V=128, chunk_size=64, training=True)
    jobs = {(what, kernel.name): kernel for what, spec in specs.items() for kernel in kernels.specializations(spec)}
    with concurrent.futures.ThreadPoolExecutor(os.cpu_count() or 1) as pool:
        futures = {job: pool.submit(_lower, kernel) for job, kernel in jobs.items()}
    return {job: future.exception() or future.result() for job, future in futures.items()}


def kernels_of(lowered: dict, what) -> dict[str, tuple[str, int]]:
    found = {name: result for (key, name), result in lowered.items() if key == what}
    for name, result in found.items():
        if isinstance(result, BaseException):
            raise AssertionError(f"{what} {name} did not lower") from result
    return found


def products(source: str) -> set[str]:
    return set(re.findall(r"wgmma_ss|wgmma_rs|mma_sync", source))


def forward_kernels(dim: int) -> set[str]:
    """The forward's launches at K = dim: the output is in the serial pass up to K = 128."""
    return {"intra", "state"} if dim <= 128 else {"intra", "state", "output"}


@pytest.mark.parametrize("claim", CLAIMED, ids=lambda claim: "-".join(map(str, claim)))
def test_every_claimed_shape_lowers_to_tensor_core_products(lowered, claim):
    chunk = claim[0]
    kernels = kernels_of(lowered, claim)
    assert set(kernels) == forward_kernels(claim[1])
    for name, (source, shared) in kernels.items():
        assert shared <= H200_SHARED_MEMORY, (name, shared)
        assert "__global__" in source, name
    # chunk 64 gives the score, state and output products a 64-row side: one warpgroup's wgmma. At chunk 32
    # the 32-row products are below wgmma's M = 64 and use mma.sync; the state's [K, C] x [C, BV] keeps wgmma.
    for name in kernels:
        found = products(kernels[name][0])
        assert found, (name, "no tensor-core product")
        if chunk == 64 or name == "state":
            assert "wgmma_ss" in found, (name, found)
    assert "tma_load" in kernels["state"][0]  # the next chunk's tiles come by the bulk tensor copy engine


@pytest.mark.parametrize("dim", HEAD_DIMS)
def test_the_gate_sum_gives_each_key_column_one_thread(lowered, dim):
    """The gate's cumulative sum runs in place down each key column of G in shared memory, so a column must
    belong to exactly one thread. A parallel loop over K < 128 threads gave each column to two threads
    (its index was ``threadIdx.x & 63`` at K = 64), whose reads and writes raced: on the H200 that put
    ``o`` 4 to 75 times past the tolerance in half the K = 64 classes."""
    from kda.backends.tilelang.intra import threads_for

    source = kernels_of(lowered, (64, dim, "bfloat16"))["intra"][0]
    lines = source.splitlines()
    stores = [n for n, line in enumerate(lines) if "= (carry[0] + block[0]);" in line]
    assert stores, "the gate's in-place sum was not found in the lowered source"
    for n in stores:
        assert "threadIdx.x) &" not in lines[n], lines[n].strip()  # no column shared by two threads
    if dim < threads_for(64):  # the threads past the last column sit the sum out
        guards = [line for line in lines[: stores[0]] if line.strip().startswith("if (")]
        assert guards and f"threadIdx.x) < {dim})" in guards[-1], guards[-1:]


@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
def test_the_inverse_multiplies_bf16_halves_on_wgmma(lowered, dtype):
    """The Neumann inverse's operands are fp32 values; as fp32 tiles TileLang gave their products TF32
    ``mma.sync`` fed by scalar shared loads (56% of `intra`'s shared-memory wavefronts on the H200). Held as
    bf16 halves, every operand of its products is read by ``wgmma`` from shared memory at chunk 64."""
    source = kernels_of(lowered, (64, 128, dtype))["intra"][0]
    assert "tf32" not in source.lower()
    descriptors = [line for line in source.splitlines() if "initialize_wgmma_descriptor" in line]
    for operand in ("P_hi", "P_lo", "T_hi", "T_lo"):
        assert any(f"(bfloat16_t*){operand})[0]" in line for line in descriptors), operand


def test_inference_keeps_the_normalized_rows_and_T_in_fp32_where_bf16_would_miss(lowered):
    """Where beta reaches 2, version 14's bf16 forward sat at its tolerance (`docs/design.md`, "Where beta
    reaches 2"): at inference `intra` now scales each raw row by its fp32 reciprocal norm where it uses the
    row, instead of rounding the normalized row once on load, and gives ``T`` to ``w`` and ``u`` as two bf16
    halves (two more products than fp16's, whose single rounding of ``T`` is eight times finer)."""
    bf16 = kernels_of(lowered, (64, 128, "bfloat16"))["intra"][0]
    fp16 = kernels_of(lowered, (64, 128, "float16"))["intra"][0]
    wgmma = r"tl::wgmma_ss<"
    assert len(re.findall(wgmma, bf16)) == len(re.findall(wgmma, fp16)) + 2
    for source in (bf16, fp16):
        reads = [line for line in source.splitlines() if "n_k)[" in line and "rsqrtf" not in line]
        assert len(reads) >= 3, "the keys' reciprocal norms are read once: the rows were normalized on load"


@pytest.mark.parametrize("what", [(64, 128, "bfloat16"), "sigmoid-varlen-gva-nostate"])
def test_the_key_head_is_computed_once(lowered, what):
    """``h = hv // (HV / H)`` with symbolic head counts: written as an expression, TileLang inlined it into
    every q and k index as 64-bit divisions (16 of them in `intra`); a variable computes it once."""
    source = kernels_of(lowered, what)["intra"][0]
    assert "(int64_t)HV) / ((int64_t)H)" not in source
    assert "int h = " in source


def test_intra_fits_two_blocks_an_sm_at_head_dim_128(lowered):
    """The design's occupancy: at chunk 64 and K = V = 128 two `intra` blocks share an H200 SM (233472 bytes
    of shared memory an SM, 1 KB of it reserved per block): `intra` is bound by latency, not bytes, and
    needs the second block's warps (docs/design.md, "The tilelang backend")."""
    shared = kernels_of(lowered, (64, 128, "bfloat16"))["intra"][1]
    assert 2 * (shared + 1024) <= 233472, shared


def test_the_exponentials_take_the_special_function_unit(lowered):
    """Every exponential of a row or a decay is ``2^(x log2 e)`` (``exp2f``: one ``ex2.approx``, as Triton's
    ``tl.exp``); CUDA's accurate ``expf`` took about ten instructions more each, and 240 of them a thread
    were a quarter of `intra`'s instructions. ``A = exp(A_log)`` (once a block) and beta's sigmoid (once a
    row) stay ``expf``."""
    source = kernels_of(lowered, (64, 128, "bfloat16"))["intra"][0]
    accurate = [line for line in source.splitlines() if re.search(r"\bexpf\(", line)]
    assert len(accurate) == 2 and "expf(A_log[" in accurate[0] and "b_i" in accurate[1], accurate
    assert source.count("exp2f(") >= 6  # the gate's sigmoid, q_e, k_g, the strips' rows and columns, beta k e^G


def test_the_strips_exact_path_is_chosen_where_the_gate_allows(lowered):
    """The safe gate's steps are at most 5, so a strip's span (75) never passes bf16's 80: no span is
    measured and no exact path is compiled. A gate without that bound (pre-gated) has each strip flagged by
    the gate's sum, one write by any column past the limit, in place of a reduction and its barriers (seven
    a strip); raw fp16 keys take every diagonal block exactly, unconditionally."""
    from kda.backends.tilelang import gate
    from kda.backends.tilelang.intra import ALWAYS, FLAGGED, NEVER, diagonal_path, span_limit

    assert diagonal_path(span_limit("bfloat16", True), gate.SAFE, -5.0) == NEVER
    assert diagonal_path(span_limit("bfloat16", False), gate.SIGMOID, -5.0) == NEVER
    assert diagonal_path(span_limit("bfloat16", True), gate.SIGMOID, -6.0) == FLAGGED  # 90 > 80
    for mode in (gate.PREGATED, gate.SOFTPLUS):
        assert diagonal_path(span_limit("bfloat16", True), mode, 0.0) == FLAGGED
    assert diagonal_path(span_limit("float16", True), gate.SAFE, -5.0) == FLAGGED  # 75 > 10
    assert diagonal_path(span_limit("float16", False), gate.SAFE, -5.0) == ALWAYS

    safe = kernels_of(lowered, (64, 128, "bfloat16"))["intra"][0]
    flagged = kernels_of(lowered, "pregated")["intra"][0]
    raw = kernels_of(lowered, "fp16-raw-keys")["intra"][0]
    assert "wide" not in safe and "for (int d = 0; d < 128; ++d)" not in safe  # neither flags nor exact path
    assert "wide)[b] = 1;" in flagged and "wide)[s] == 0" in flagged
    assert "wide" not in raw and "for (int d = 0; d < 128; ++d)" in raw
    for source in (safe, flagged, raw):  # the span is no longer a reduction over the block
        assert "gaps" not in source and "row_span" not in source


def test_the_diagonal_blocks_are_solved_from_fp32_values(lowered):
    """The inverse's 16x16 diagonal blocks are solved from ``N``'s fp32 values, kept apart as ``N_d
    [block, column, row]``, by columns: the loads a step needs are contiguous, and the bf16 halves are left
    to the products (the substitution from the halves was 1300 instructions on 64 threads while the other
    192 waited)."""
    source = kernels_of(lowered, (64, 128, "bfloat16"))["intra"][0]
    assert "((float*)N_d)[" in source
    step = source.index("* x_col[")  # the substitution's update, in the block its 64 threads run
    solve = source[source.rindex("if (((int)threadIdx.x) < 64)", 0, step) :]
    solve = solve[: solve.index("__syncthreads")]
    assert "P_hi" not in solve and "P_lo" not in solve and "N_d" in solve


@pytest.mark.parametrize("variant", list(VARIANTS))
def test_call_variants_lower(lowered, variant):
    """The compile-time flags each give kernels that lower: every gate mode, the beta and l2norm options,
    the state layouts and their absence, GVA, and K != V."""
    kernels = kernels_of(lowered, variant)
    assert set(kernels) == {"intra", "state"}
    assert "wgmma_ss" in products(kernels["intra"][0])


def _state_source(spec: KDASpec) -> tuple[str, str]:
    """The lowered `state` kernel of `spec`: its signature line and its whole source."""
    (kernel,) = [kernel for kernel in kernels.specializations(spec) if kernel.name == "state"]
    source, _ = _lower(kernel)
    (signature,) = [line for line in source.splitlines() if "__launch_bounds__" in line]
    return signature, source


def test_the_output_is_in_the_serial_pass_and_h_stays_on_chip(monkeypatch):
    """Up to K = 128 the forward is two launches: `state` computes each chunk's output from the state and
    ``v_new`` it holds (two more products: four ``wgmma`` sites), so at inference neither ``h`` nor ``v_new``
    goes to memory (no parameter for ``h``, no tensor store) and ``o`` is written; with 128 value columns
    two warpgroups share a program. A caller's intermediate states keep ``h``; training keeps ``h`` and
    ``v_new`` for the backward. At K = 256 the output stays a launch."""
    inference = spec_of(K=128, V=128, chunk_size=64)
    for columns, threads in ((64, 256), (128, 384)):  # the computing warpgroups and TileLang's producer warps
        monkeypatch.setattr(kernels, "FORCED_PLAN", kernels.StatePlan(True, columns))
        signature, source = _state_source(inference)
        assert "bfloat16_t* __restrict__ o" in signature and "h_desc" not in signature and " h," not in signature
        assert "tma_store" not in source and source.count("wgmma_ss<") == 4
        assert f"__launch_bounds__({threads}, 1)" in signature
    monkeypatch.setattr(kernels, "FORCED_PLAN", None)

    kept = inference.model_copy(update={"return_intermediate_states": True})
    signature, source = _state_source(kept)
    assert "tma_store(h_desc" in source and "tma_store(u_desc" not in source

    training = spec_of(K=128, V=128, chunk_size=64, training=True)
    signature, source = _state_source(training)
    assert "tma_store(h_desc" in source and "float* __restrict__ u" in signature
    assert "bfloat16_t* __restrict__ o" in signature

    wide = spec_of(K=256, V=256)
    assert kernels.state_plan(wide) == kernels.StatePlan(False, 64)
    assert [kernel.name for kernel in kernels.specializations(wide)] == ["intra", "state", "output"]


def _plan_for(*, sequences: int, HV: int, V: int = 128, K: int = 128, training: bool = False, varlen: bool = False):
    """`kernels.state_plan` of a call of that size (only the fields the rule reads)."""
    from types import SimpleNamespace

    cu_seqlens = SimpleNamespace(shape=(sequences + 1,)) if varlen else None
    spec = SimpleNamespace(
        K=K, V=V, HV=HV, B=1 if varlen else sequences, cu_seqlens=cu_seqlens, requires_grad=training,
        device=torch.device("cpu"),
    )  # fmt: skip
    return kernels.state_plan(spec)


def test_the_pass_takes_128_value_columns_only_past_one_wave():
    """64 value columns a program while those programs fit the GPU's SMs (132 on an H100 or H200, and on a
    machine without one), 128 past that (on an H100: 1.95 against 2.12 ms at B1_T8192_H96_D128, 192
    programs; 1.52 against 1.94 the other way at B2_T16384_H16_D128, 64); training always 64 (fp32 ``u``
    tiles); varlen counts its sequences."""
    assert _plan_for(sequences=1, HV=96) == kernels.StatePlan(True, 128)  # 192 programs of 64 columns
    assert _plan_for(sequences=2, HV=16) == kernels.StatePlan(True, 64)  # 64
    assert _plan_for(sequences=4, HV=16) == kernels.StatePlan(True, 64)  # 128
    assert _plan_for(sequences=66, HV=1) == kernels.StatePlan(True, 64)  # 132: one full wave
    assert _plan_for(sequences=67, HV=1) == kernels.StatePlan(True, 128)
    assert _plan_for(sequences=67, HV=1, varlen=True) == kernels.StatePlan(True, 128)
    assert _plan_for(sequences=1, HV=96, training=True) == kernels.StatePlan(True, 64)
    assert _plan_for(sequences=8, HV=64, V=64) == kernels.StatePlan(True, 64)  # V = 64: one block of columns
    assert _plan_for(sequences=1, HV=96, K=256, V=256) == kernels.StatePlan(False, 64)


def test_a_forced_plan_is_what_specializations_gives(monkeypatch):
    """`benchmarks/tilelang_stages.py --plan` times the plans side by side through `FORCED_PLAN`; a plan
    that cannot fit (the output in the pass at K = 256) falls back to the split one."""
    monkeypatch.setattr(kernels, "FORCED_PLAN", kernels.StatePlan(False, 64))
    assert [kernel.name for kernel in kernels.specializations(spec_of(K=128, V=128, chunk_size=64))] == [
        "intra",
        "state",
        "output",
    ]
    monkeypatch.setattr(kernels, "FORCED_PLAN", kernels.StatePlan(True, 128))
    assert kernels.state_plan(spec_of(K=128, V=64, chunk_size=64)) == kernels.StatePlan(True, 64)
    assert kernels.state_plan(spec_of(K=256, V=256)).with_output is False


BACKWARD = ["state_backward", "chunk_backward", "score_backward", "gate_tail", "qk_tail"]


def test_training_adds_the_backward_and_the_forward_saves_for_it():
    """A training call's kernels are the forward's, `intra` compiled to save what the backward reads (its
    last parameter), and the backward's five; an inference call's `intra` saves nothing."""
    inference, training = spec_of(K=64, V=64), spec_of(K=64, V=64, training=True)
    assert [kernel.name for kernel in kernels.specializations(inference)] == ["intra", "state"]
    trained = kernels.specializations(training)
    assert [kernel.name for kernel in trained] == ["intra", "state", *BACKWARD]
    assert trained[0].params[-1] is True and kernels.specializations(inference)[0].params[-1] is False
    assert trained[0].params[:-1] == kernels.specializations(inference)[0].params[:-1]


def test_the_training_kernels_lower_and_intra_keeps_its_occupancy(lowered):
    """At chunk 64, K = V = 128 every training kernel lowers for sm_90a with tensor-core products, `intra`'s
    stores for the backward and its fp32 halves cost no shared memory, its launch asks nvcc for two blocks
    an SM (128 registers a thread; left alone nvcc took 135, and one block an SM made training's `intra`
    1.4 times slower on an H100), and the saved tensors are written: G, beta, M, T and the rows' reciprocal
    norms (the normalized rows are not stored)."""
    kernels = kernels_of(lowered, "training")
    assert set(kernels) == {"intra", "state", *BACKWARD}
    for name, (_source, shared) in kernels.items():
        assert shared <= H200_SHARED_MEMORY, (name, shared)
    for name in ("intra", "state", "state_backward", "chunk_backward", "score_backward"):
        assert "wgmma_ss" in products(kernels[name][0]), name
    saving, plain = kernels["intra"], kernels_of(lowered, (64, 128, "bfloat16"))["intra"]
    assert saving[1] == plain[1]
    assert "__launch_bounds__(256, 2)" in saving[0] and "__launch_bounds__(256, 1)" in plain[0]
    for stored in ("G_out", "beta_out", "M_out", "T_out", "rstd_q", "rstd_k"):
        # named in both signatures (a placeholder at inference); used in the saving kernel's body alone
        uses = [len(re.findall(rf"\b{stored}\b", source)) for source in (saving[0], plain[0])]
        assert uses[0] > uses[1], (stored, uses)


def _dtypes(kernel: kernels.Kernel) -> dict[str, str]:
    """The dtype of each tensor parameter of `kernel`'s prim_func, by name."""
    func = kernel.builder(*kernel.params)
    return {buffer.name: str(buffer.dtype) for buffer in func.buffer_map.values()}


@pytest.mark.parametrize("l2norm", [True, False])
def test_training_keeps_what_dA_log_needs_in_fp32(l2norm):
    """``dA_log`` sums over every token terms of both signs; the CPU replay of the training path
    (benchmarks/tilelang_backward_precision.py) put it past its tolerance with bf16 normalized rows, ``u`` or
    ``v_new``, and within 0.03 of it with those in fp32. Training passes ``u`` and ``v_new`` in fp32 from
    stage to stage, and the rows as the inputs with their fp32 reciprocal norms (each stage forms ``x r`` in
    fp32); inference keeps the inputs' dtype (the bytes are the forward's cost)."""
    training = {
        k.name: _dtypes(k) for k in kernels.specializations(spec_of(K=64, V=64, training=True, qk_l2norm=l2norm))
    }
    inference = {k.name: _dtypes(k) for k in kernels.specializations(spec_of(K=64, V=64, qk_l2norm=l2norm))}
    assert training["intra"]["u"] == training["state"]["u"] == training["chunk_backward"]["v_new"] == "float32"
    assert "q_n" not in training["intra"] and "k_n" not in training["intra"]  # no normalized rows stored
    assert training["intra"]["rstd_q"] == training["intra"]["rstd_k"] == "float32"
    for stage in ("chunk_backward", "score_backward"):
        assert training[stage]["q"] == training[stage]["k"] == "bfloat16", stage  # as the call gave them
        assert training[stage]["rstd_q"] == training[stage]["rstd_k"] == "float32", stage
    assert training["qk_tail"]["x"] == "bfloat16" and training["qk_tail"]["rstd"] == "float32"
    # what the state passes multiply by stays in the inputs' dtype, and inference is untouched
    assert {training["state_backward"][name] for name in ("q_e", "w", "k_g", "A_qk")} == {"bfloat16"}
    assert inference["intra"]["u"] == inference["state"]["u"] == "bfloat16"


def _shared_buffers(kernel: kernels.Kernel) -> dict[str, str]:
    """The dtype of each shared-memory buffer `kernel` allocates, by name, from its TIR (the names are lost
    once TileLang merges the buffers into one dynamic allocation)."""
    from tvm import tirx

    found: dict[str, str] = {}

    def visit(node) -> None:
        for buffer in getattr(node, "alloc_buffers", None) or ():
            if buffer.scope().startswith("shared"):
                found[buffer.name] = str(buffer.dtype)

    tirx.stmt_functor.post_order_visit(kernel.builder(*kernel.params).body, visit)
    return found


def _parameters(source: str) -> dict[str, str]:
    """The C type of each pointer parameter of the lowered kernel's entry, by name."""
    signature = source[source.index("__global__") :].split("{", 1)[0]
    return {name: ctype for ctype, name in re.findall(r"(\w+)\* __restrict__ (\w+)", signature)}


@pytest.mark.parametrize("l2norm", [True, False])
def test_the_backward_keeps_q_and_k_in_the_inputs_dtype_and_r_in_fp32(lowered, l2norm):
    """The training forward stores no normalized rows: `chunk_backward` and `score_backward` read q and k as
    given and hold their tiles in shared memory in the inputs' dtype, with the chunk's rows' ``r`` in fp32
    beside them (``x r`` is formed in fp32 where it is read: half the tile bytes of fp32 rows). Checked in
    the TIR of each stage and in the lowered CUDA's parameters."""
    spec = spec_of(K=128, V=128, chunk_size=64, training=True, qk_l2norm=l2norm)
    trained = {kernel.name: kernel for kernel in kernels.specializations(spec)}
    for stage in ("chunk_backward", "score_backward"):
        shared = _shared_buffers(trained[stage])
        assert shared["q_s"] == shared["k_s"] == "bfloat16", (stage, shared)
        assert shared["r_q"] == shared["r_k"] == "float32", (stage, shared)  # unread without the l2norm
    if l2norm:  # the lowered training kernels (chunk 64, K = V = 128, bf16, with the l2norm)
        sources = kernels_of(lowered, "training")
        for stage in ("chunk_backward", "score_backward"):
            parameters = _parameters(sources[stage][0])
            assert parameters["q"] == parameters["k"] == "bfloat16_t", (stage, parameters)
            assert parameters["rstd_q"] == parameters["rstd_k"] == "float", (stage, parameters)
        parameters = _parameters(sources["qk_tail"][0])
        assert parameters["x"] == "bfloat16_t" and parameters["rstd"] == "float", parameters
        assert not {"q_n", "k_n"} & set(_parameters(sources["intra"][0]))


def test_sequence_length_batch_and_heads_are_not_compiled_in():
    """Calls that differ only in length, batch layout or head counts share every kernel specialization."""
    assert kernels.specializations(spec_of(K=64, V=64, T=33)) == kernels.specializations(spec_of(K=64, V=64, T=900))
    assert kernels.specializations(spec_of(K=64, V=64)) == kernels.specializations(spec_of(K=64, V=64, gva=True))
    a = kernels.specializations(spec_of(K=64, V=64, varlen=True, T=70))
    b = kernels.specializations(spec_of(K=64, V=64, varlen=True, T=400))
    assert a == b


@pytest.mark.skipif(runtime.find_nvcc() is None, reason="no nvcc on this machine")
def test_one_shape_class_compiles_with_nvcc(lowered, tmp_path):
    """The CUDA source TileLang lowers for sm_90a builds with this machine's nvcc (chunk 64, K = V = 128),
    and `intra`, for inference and for training, leaves room for its second block an SM in the register
    file too (65536 registers an SM: at 256 threads a block, at most 128 a thread), without spilling."""
    import tilelang

    from kda.backends.tilelang.intra import threads_for

    root = os.path.dirname(tilelang.__file__)
    includes = [f"-I{os.path.join(root, 'src')}", f"-I{os.path.join(root, '3rdparty', 'cutlass', 'include')}"]

    def build(name: str, source: str) -> subprocess.CompletedProcess:
        path = tmp_path / f"{name}.cu"
        path.write_text(source)
        return subprocess.run(
            [runtime.find_nvcc() or "nvcc", "-gencode=arch=compute_90a,code=sm_90a", "-std=c++17", "-O3", *includes,
             "-DENABLE_BF16", "-w", "-Xptxas", "-v", "-c", str(path), "-o", str(tmp_path / f"{name}.o")],
            capture_output=True, text=True, timeout=600,
        )  # fmt: skip

    kernels = kernels_of(lowered, (64, 128, "bfloat16"))
    kernels["training intra"] = kernels_of(lowered, "training")["intra"]
    with concurrent.futures.ThreadPoolExecutor(len(kernels)) as pool:  # nvcc: a process each
        done = {name: pool.submit(build, name.replace(" ", "_"), source) for name, (source, _) in kernels.items()}
    for name, future in done.items():
        assert future.result().returncode == 0, (name, future.result().stderr[-2000:])
    for name in ("intra", "training intra"):  # the training kernel holds 128 registers without spilling
        report = done[name].result().stderr
        registers = re.findall(r"Used (\d+) registers", report)
        assert registers and 2 * threads_for(64) * int(registers[-1]) <= 65536, (name, registers)
        assert re.findall(r"(\d+) bytes spill stores", report)[-1] == "0", (name, report[-600:])


def test_the_backend_says_why_it_cannot_run_here(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    verdict = TileLangBackend().available()
    assert not verdict
    assert "CUDA GPU" in str(verdict) or "nvcc" in str(verdict)


def test_a_missing_compiler_is_a_reason(monkeypatch):
    monkeypatch.setattr(runtime, "find_nvcc", lambda: None)
    runtime.tilelang_problem.cache_clear()
    try:
        verdict = TileLangBackend().available()
        assert not verdict and "nvcc" in str(verdict)
    finally:
        runtime.tilelang_problem.cache_clear()


def test_it_declines_what_it_does_not_cover():
    cc = case_class(dtype="float32", training=True, head_dim=64)
    case = VerificationCase(cc, "realistic", 1, 1, 1, 96, 64, (40,), "float32", seed=3)
    kwargs, _ = make_inputs(case, "cpu")
    verdict = TileLangBackend().supports(KDASpec.from_call(**kwargs, requires_grad=True))
    text = str(verdict)
    assert not verdict
    for reason in ("CUDA GPU", "dtype torch.float32", "head dim K=96"):
        assert reason in text, (reason, text)
    verdict = TileLangBackend().supports(spec_of(K=256, V=64, training=True))
    assert not verdict and "training at head dims above 128 (K=256, V=64)" in str(verdict)


def test_a_kernel_that_does_not_compile_is_a_no_with_the_reason(monkeypatch):
    """`supports` compiles before it says yes: a compile failure routes the call elsewhere, never a crash."""
    spec = spec_of(K=64, V=64)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda *a: (9, 0))
    monkeypatch.setattr(type(spec), "device", property(lambda self: torch.device("cuda")))

    def refuse(specializations):
        raise runtime.CompileFailure(f"{specializations[1][0].__name__}: No valid warp partition for T.gemm")

    monkeypatch.setattr(runtime, "compile_all", refuse)
    verdict = TileLangBackend().supports(spec)
    assert not verdict and "No valid warp partition" in str(verdict)


def test_the_backend_is_registered():
    assert "tilelang" in [backend.name for backend in kda.registry.registered_backends()]
