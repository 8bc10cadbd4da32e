"""The tilelang backward's per-chunk stage (`kda.backends.tilelang.chunk_backward`).

- `reference_chunk_backward`: the stage in float64 torch, chunk by chunk, from the math of the helion
  stage's docstring; proven here against the helion kernel run in Helion's interpreter on the same
  random inputs (varlen with ragged tails, GVA, realistic gates and inverse).
- Lowering on the CPU for Hopper: each claimed (C, K, V, dtype) lowers, its products are ``wgmma`` at chunk
  64, and its shared memory fits an H200 block; one specialization builds with nvcc within the registers
  of one block an SM.
- On an H200 (marked ``gpu``): the compiled kernel against the reference, outputs poisoned with NaN first;
  the kernel reads q and k as given with their scales (`rows.inputs_and_scales`), the reference the rows
  ``x r``.
"""

from __future__ import annotations

import concurrent.futures
import math
import re

import pytest
import torch
from nvcc import ptxas_report, registers
from rows import inputs_and_scales

from kda.backends.chunks import ChunkLayout, chunk_layout
from kda.verify.check import relative_error

H200_SHARED_MEMORY = 232448  # bytes of dynamic shared memory one block may ask for (227 KB)
OUTPUTS = ("dv", "dq_c", "dk_c", "dG_c", "dP_qk", "dP_kk", "dbeta_c")
CLAIMED = [
    (C, K, V, dtype) for C in (32, 64) for K in (64, 128) for V in (64, 128) for dtype in ("bfloat16", "float16")
]


def make_inputs(
    lengths: tuple[int, ...],
    C: int,
    H: int,
    group: int,
    K: int,
    V: int,
    dtype: torch.dtype,
    seed: int,
    l2norm: bool = True,
) -> tuple[dict[str, torch.Tensor], ChunkLayout]:
    """Random inputs of the stage on the CPU, fp32; the ones the kernel reads in the inputs' dtype hold
    values of that dtype. ``q`` and ``k`` are the rows the forward used, ``x r`` in fp32 with the l2norm
    (`rows.inputs_and_scales`), which the reference takes; the kernel takes ``q_in``, ``k_in`` (the
    inputs' dtype) and ``rstd_q``, ``rstd_k``. ``G`` is a cumulative sum of negative log decays (rows past
    the end hold the last token's), ``M`` the keys' decayed products (strictly lower), ``T`` the inverse of
    ``I + diag(beta) M``; ``q_e = scale q e^G`` and ``k_g = k e^(G_last - G)`` (the scale of ``K**-0.5``),
    which both stages form from the rows and G, for the reference's checks."""
    gen = torch.Generator().manual_seed(seed)
    bounds = (0, *torch.tensor(lengths).cumsum(0).tolist())
    layout = chunk_layout(bounds, C, torch.device("cpu"))
    tokens, NT, HV = bounds[-1], layout.num_chunks, H * group

    def randn(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=gen)

    def rounded(x: torch.Tensor) -> torch.Tensor:
        return x.to(dtype).float()

    k_in, rstd_k, k = inputs_and_scales((tokens, H, K), dtype, l2norm, gen)
    q_in, rstd_q, q = inputs_and_scales((tokens, H, K), dtype, l2norm, gen)
    valid = torch.arange(C)[None, :] < (layout.chunk_seq_ends - layout.chunk_starts)[:, None]  # [NT, C]
    rows = (layout.chunk_starts[:, None] + torch.arange(C)[None, :]).clamp(max=max(tokens - 1, 0)).long()
    log_decay = torch.nn.functional.logsigmoid(randn(NT, HV, C, K) + 3.0) * valid[:, None, :, None]
    G = log_decay.cumsum(dim=2)  # rows past the end add 0: they hold the last token's value
    beta = torch.sigmoid(randn(NT, HV, C)) * valid[:, None, :]
    k_c = (k[rows][:, :, torch.arange(HV) // group] * valid[:, :, None, None]).transpose(1, 2)  # [NT, HV, C, K]
    gaps = (G[:, :, :, None, :] - G[:, :, None, :, :]).clamp(max=0.0)  # only j < i is kept
    decayed = (k_c[:, :, :, None, :] * k_c[:, :, None, :, :] * gaps.exp()).sum(-1)
    M = decayed.tril(-1)
    eye = torch.eye(C)
    T = torch.linalg.inv(eye + beta[..., None] * M).tril()
    q_c = (q[rows][:, :, torch.arange(HV) // group] * valid[:, :, None, None]).transpose(1, 2)
    scale = K**-0.5
    inputs = dict(
        do=rounded(randn(tokens, HV, V)),
        v=rounded(randn(tokens, HV, V)),
        q=q,
        k=k,
        q_in=q_in,
        k_in=k_in,
        rstd_q=rstd_q,
        rstd_k=rstd_k,
        G=G,
        beta=beta,
        T=T,
        M=M,
        h=rounded(randn(NT, HV, K, V)),
        dh=randn(NT, HV, K, V),
        v_new=randn(NT, HV, C, V) * valid[:, None, :, None],
        dv_new=randn(NT, HV, C, V),
        # what both stages form from the rows and G, in fp32
        q_e=scale * q_c * G.exp(),
        k_g=k_c * (G[:, :, -1:] - G).exp(),
    )
    return inputs, layout


def reference_chunk_backward(
    inputs: dict[str, torch.Tensor], layout: ChunkLayout, C: int, scale: float, group: int
) -> dict[str, torch.Tensor]:
    """The stage in float64, one chunk and value head at a time (rows past the sequence's end read zero
    ``do``, ``v``, ``q``, ``k``; ``dv`` has only the sequences' rows), with ``q_e = scale q e^G`` and
    ``k_g = k e^(G_last - G)`` formed from the rows."""
    x = {name: t.double() for name, t in inputs.items()}
    NT, HV, _, K = x["G"].shape
    V = x["v"].shape[-1]
    tokens = x["v"].shape[0]
    out = dict(
        dv=torch.zeros(tokens, HV, V, dtype=torch.float64),
        dq_c=torch.zeros(NT, HV, C, K, dtype=torch.float64),
        dk_c=torch.zeros(NT, HV, C, K, dtype=torch.float64),
        dG_c=torch.zeros(NT, HV, C, K, dtype=torch.float64),
        dP_qk=torch.zeros(NT, HV, C, C, dtype=torch.float64),
        dP_kk=torch.zeros(NT, HV, C, C, dtype=torch.float64),
        dbeta_c=torch.zeros(NT, HV, C, dtype=torch.float64),
    )
    causal = torch.ones(C, C, dtype=torch.bool).tril()
    strict = torch.ones(C, C, dtype=torch.bool).tril(-1)
    for c in range(NT):
        start, end = int(layout.chunk_starts[c]), int(layout.chunk_seq_ends[c])
        n = min(C, end - start)

        def rows(t: torch.Tensor, head: int, n: int = n, start: int = start) -> torch.Tensor:
            padded = torch.zeros(C, t.shape[-1], dtype=torch.float64)
            padded[:n] = t[start : start + n, head]
            return padded

        for hv in range(HV):
            do, v = rows(x["do"], hv), rows(x["v"], hv)
            q, k = rows(x["q"], hv // group), rows(x["k"], hv // group)
            G, b, T, M = x["G"][c, hv], x["beta"][c, hv], x["T"][c, hv], x["M"][c, hv]
            h, dh, v_new, dv_new = x["h"][c, hv], x["dh"][c, hv], x["v_new"][c, hv], x["dv_new"][c, hv]
            e_G = G.exp()
            q_e, k_g = scale * q * e_G, k * (G[-1] - G).exp()
            X = b[:, None] * k * e_G
            Y = b[:, None] * v
            dq_e, dw, dk_g = do @ h.T, -dv_new @ h.T, v_new @ dh.T
            dA_qk = (do @ v_new.T).where(causal, 0.0)
            dT = dw @ X.T + dv_new @ Y.T
            dX, dY = T.T @ dw, T.T @ dv_new
            dA_kk = (-T.T @ dT @ T.T).where(strict, 0.0)
            out["dv"][start : start + n, hv] = (b[:, None] * dY)[:n]
            out["dbeta_c"][c, hv] = (dY * v).sum(1) + (dX * k * e_G).sum(1) + (dA_kk * M).sum(1)
            out["dq_c"][c, hv] = scale * e_G * dq_e
            out["dk_c"][c, hv] = b[:, None] * e_G * dX + (G[-1] - G).exp() * dk_g
            dG = dX * X + q_e * dq_e - k_g * dk_g
            dG[-1] += (k_g * dk_g).sum(0) + G[-1].exp() * (dh * h).sum(1)
            out["dG_c"][c, hv] = dG
            out["dP_qk"][c, hv] = scale * dA_qk
            out["dP_kk"][c, hv] = b[:, None] * dA_kk
    return out


def empty_outputs(inputs: dict[str, torch.Tensor], C: int, dv_dtype: torch.dtype) -> dict[str, torch.Tensor]:
    """The stage's output buffers, poisoned with NaN (every entry the kernel owns must be written)."""
    NT, HV, _, K = inputs["G"].shape
    device = inputs["G"].device

    def nans(*shape: int, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        return torch.full(shape, math.nan, dtype=dtype, device=device)

    return dict(
        dv=nans(*inputs["v"].shape, dtype=dv_dtype),
        dq_c=nans(NT, HV, C, K),
        dk_c=nans(NT, HV, C, K),
        dG_c=nans(NT, HV, C, K),
        dP_qk=nans(NT, HV, C, C),
        dP_kk=nans(NT, HV, C, C),
        dbeta_c=nans(NT, HV, C),
    )


HELION_ORDER = ("do", "v", "q", "k", "G", "G", "G", "beta", "T", "M", "h", "dh", "v_new", "dv_new")  # G: no l2 scales
TILELANG_ORDER = ("do", "v", "q_in", "k_in", "rstd_q", "rstd_k", "G", "beta", "T", "M", "h", "dh", "v_new", "dv_new")


def test_the_reference_matches_the_helion_kernel(monkeypatch):
    """Varlen with ragged tails (a one-token sequence, a partial last chunk), GVA (HV = 2 H), K != V."""
    pytest.importorskip("helion", reason="Helion is not installed (extra `helion`)")
    if torch.cuda.is_available():
        pytest.skip("Helion's interpreter case is for the CPU; the GPU test checks the tilelang kernel instead")
    monkeypatch.setenv("HELION_INTERPRET", "1")  # read when the kernel object is made, below
    import helion

    from kda.backends.helion import runtime
    from kda.backends.helion.chunk_backward import chunk_backward_kernel

    runtime.register_cpu_matmul()
    C, H, group, K, V = 16, 1, 2, 32, 16
    scale = K**-0.5
    inputs, layout = make_inputs((37, 1, 16, 9), C, H, group, K, V, torch.bfloat16, seed=3)
    outputs = empty_outputs(inputs, C, torch.float32)
    kernel = helion.kernel(chunk_backward_kernel, static_shapes=False, dot_precision="ieee")
    kernel(
        *(inputs[name] for name in HELION_ORDER), layout.chunk_starts, layout.chunk_seq_ends,
        *(outputs[name] for name in OUTPUTS), scale, group, C, False, False,
    )  # fmt: skip
    expected = reference_chunk_backward(inputs, layout, C, scale, group)
    for name in OUTPUTS:
        assert relative_error(outputs[name], expected[name]) < 1e-5, name
    # the check can fail: a reference that forgot the last row's column sums is far off
    broken = expected["dG_c"].clone()
    broken[:, :, -1] -= (inputs["k_g"].double() * 0.1).sum(2)
    assert relative_error(outputs["dG_c"], broken) > 1e-3


def test_the_reference_takes_the_sequences_rows_only():
    """Rows past a sequence's end read zeros: a past-the-end ``do`` or ``v`` changes nothing."""
    C, K, V = 16, 16, 16
    inputs, layout = make_inputs((5, 16), C, 1, 1, K, V, torch.bfloat16, seed=1)
    base = reference_chunk_backward(inputs, layout, C, 0.25, 1)
    assert torch.equal(base["dP_qk"][0, :, 5:], torch.zeros_like(base["dP_qk"][0, :, 5:]))
    changed = dict(inputs, do=inputs["do"].clone())
    changed["do"][5:] += 1.0  # the second sequence: its own chunk sees it, the first chunk does not
    other = reference_chunk_backward(changed, layout, C, 0.25, 1)
    assert torch.equal(other["dq_c"][0], base["dq_c"][0])
    assert not torch.equal(other["dq_c"][1], base["dq_c"][1])


# Lowering for Hopper on the CPU (TileLang, no GPU, no nvcc).


def _lower(claim: tuple[int, int, int, str]) -> tuple[str, int]:
    from kda.backends.tilelang import chunk_backward, runtime

    C, K, V, dtype = claim
    l2norm = dtype == "bfloat16"  # both kinds of rows: with the l2norm's scales and without
    artifact = runtime.lower(
        chunk_backward.build(C, K, V, dtype, K**-0.5, l2norm), configs=runtime.pass_configs(chunk_backward.build)
    )
    return artifact.kernel_source, runtime.shared_memory_bytes(artifact)


def _check_lowered(claim: tuple[int, int, int, str], source: str, shared: int) -> None:
    assert "__global__" in source, claim
    assert shared <= H200_SHARED_MEMORY, (claim, shared)
    found = set(re.findall(r"wgmma_ss|wgmma_rs|mma_sync", source))
    # chunk 64: every product has the chunk's 64 rows, one wgmma's M; chunk 32 is below it (mma.sync)
    assert found == ({"wgmma_ss"} if claim[0] == 64 else {"mma_sync"}), (claim, found)


@pytest.fixture(scope="module")
def lowered_main() -> dict:
    pytest.importorskip("tilelang", reason="TileLang is not installed (extra `tilelang`)")
    claims = [(64, 128, 128, "bfloat16"), (32, 64, 64, "float16")]
    with concurrent.futures.ThreadPoolExecutor(len(claims)) as pool:  # TVM's passes run outside the GIL
        return dict(zip(claims, pool.map(_lower, claims), strict=True))


def test_the_main_shapes_lower_to_tensor_core_products(lowered_main):
    for claim, (source, shared) in lowered_main.items():
        _check_lowered(claim, source, shared)
    # every fp32 operand goes in as two 16-bit halves: 2 + 3 (dY) + 2 (dA_qk) at the chunk, 1 + 2 + 3 + 3
    # + 3 in each of the four key blocks, 3 + 3 for dA_kk: 61 products a chunk, none of them TF32
    source = lowered_main[(64, 128, 128, "bfloat16")][0]
    assert "tf32" not in source.lower()
    assert a_chunk(source, r"wgmma_ss<")[1] == 7 + 4 * 12 + 6


WAITS = r"tl::wait_wgmma<0>\(\);|tl::warpgroup_wait<0>\(\);"


def a_chunk(source: str, pattern: str) -> tuple[int, int]:
    """How often `pattern` occurs in a lowered chunk_backward: written in the source, and run for one chunk
    (the key loop's, ``for (int kb = 0; kb < N; ...)``, N times; the pipelined loop's first and last key
    blocks are written out around it)."""
    written = len(re.findall(pattern, source))
    loop = re.search(r"for \(int kb = 0; kb < (\d+); \+\+kb\) \{", source)
    if loop is None:  # two key blocks (K = 64): the pipeline writes both out
        return written, written
    depth, end = 1, loop.end()
    while depth:  # the loop's closing brace
        depth += {"{": 1, "}": -1}.get(source[end], 0)
        end += 1
    inside = len(re.findall(pattern, source[loop.end() : end]))
    return written, written - inside + inside * int(loop.group(1))


def test_a_steps_independent_products_are_waited_on_once(lowered_main):
    """At chunk 64 the products go by `T.wgmma_gemm`, and the products of a step that read none of each other's
    results are issued together and waited on once: the value side's seven (dA_qk, dT's first term, dY); in
    each key block the six state products (dq_e, dw, dk_g), then the six of dw's halves (dT's term, dX);
    then dA_kk's two steps (U = T^T dT, then U T^T). 11 waits a chunk at K = 128 (four key blocks), where a
    wait after each of the 61 products took 61."""
    source = lowered_main[(64, 128, 128, "bfloat16")][0]
    assert a_chunk(source, r"wgmma_ss<")[1] == 61 and "warpgroup_wait" not in source
    assert a_chunk(source, WAITS)[1] == 11
    # chunk 32 is below wgmma's 64 rows: mma.sync, which has nothing to wait on
    assert a_chunk(lowered_main[(32, 64, 64, "float16")][0], WAITS) == (0, 0)


def test_a_key_blocks_tiles_arrive_while_the_block_before_it_computes(lowered_main):
    """The key loop is pipelined: its tiles (h, dh, G, q, k) are copied by cp.async, each into two buffers,
    a later block's issued while the current block computes, by the kernel's own 256 threads (TileLang's
    warp-specialized form would add a producer warpgroup, which the 64-row products cannot be split over);
    dh is read from memory once, into shared memory, where version 15 read it twice."""
    for claim, (source, shared) in lowered_main.items():
        assert "cp_async_gs" in source and "cp_async_wait" in source, claim
        assert "tma_load" not in source and "warpgroup_reg" not in source, claim  # no producer warpgroup
        assert re.search(r"__launch_bounds__\((256|128)", source), claim
        assert shared <= H200_SHARED_MEMORY, (claim, shared)
    source = lowered_main[(64, 128, 128, "bfloat16")][0]
    loop = source[source.index("for (int kb = 0;") :]
    # a block starts by waiting for tiles copied earlier, and issues a later block's copies among its products
    assert loop.index("cp_async_wait") < loop.index("cp_async_gs") < loop.rindex("wait_wgmma")
    # dh: copies into shared memory, and no thread reads it from global memory
    assert re.search(r"cp_async_gs<16>\(\(&\(\(\(float\*\)dh_s\)", source)
    reads = [line for line in source.splitlines() if re.search(r"\bdh\s*[\[+]", line)]
    assert reads and all("cp_async_gs" in line for line in reads), reads


@pytest.mark.slow
@pytest.mark.parametrize("claim", CLAIMED, ids=lambda claim: "-".join(map(str, claim)))
def test_every_claimed_shape_lowers(claim):
    pytest.importorskip("tilelang", reason="TileLang is not installed (extra `tilelang`)")
    _check_lowered(claim, *_lower(claim))


@pytest.mark.slow
@pytest.mark.parametrize("claim", [(64, 256, 128, "bfloat16"), (32, 256, 64, "float16")], ids=str)
def test_key_dims_of_256_lower_too(claim):
    """``K`` is taken in blocks, so its shared memory is the same at K = 256."""
    pytest.importorskip("tilelang", reason="TileLang is not installed (extra `tilelang`)")
    _check_lowered(claim, *_lower(claim))


@pytest.mark.slow
def test_value_dims_of_256_do_not_fit():
    """``V`` is not tiled: at chunk 64 and V = 256 the chunk's value-side tiles pass the H200's shared memory."""
    pytest.importorskip("tilelang", reason="TileLang is not installed (extra `tilelang`)")
    assert _lower((64, 128, 256, "bfloat16"))[1] > H200_SHARED_MEMORY


@pytest.mark.slow
def test_it_builds_with_nvcc_in_one_blocks_registers(lowered_main, tmp_path):
    """The sm_90a source builds with this machine's nvcc, and a block of 256 threads fits the register file
    (65536 registers an SM: at most 255 a thread, which is also the hardware's most)."""
    report = ptxas_report(lowered_main[(64, 128, 128, "bfloat16")][0], tmp_path, "chunk_backward")
    assert 256 * registers(report) <= 65536, report[-2000:]


# On the GPU.


GPU_CASES = [
    (torch.bfloat16, 64, 128, 128, (3 * 64 + 13, 1, 64, 40)),
    (torch.float16, 32, 64, 64, (3 * 32 + 7, 1, 32, 20)),
]


@pytest.mark.gpu
@pytest.mark.parametrize("case", GPU_CASES, ids=lambda case: f"{str(case[0])[6:]}-C{case[1]}-K{case[2]}")
@pytest.mark.usefixtures("hopper")
def test_the_kernel_matches_the_reference_on_the_gpu(case):
    """Varlen with ragged tails and a one-token sequence, GVA (HV = 2 H); outputs poisoned with NaN."""
    from kda.backends.tilelang import chunk_backward, runtime

    dtype, C, K, V, lengths = case
    H, group, scale = 2, 2, K**-0.5
    l2norm = dtype == torch.bfloat16  # rows with the l2norm's scales, and raw rows
    inputs, layout = make_inputs(lengths, C, H, group, K, V, dtype, seed=7, l2norm=l2norm)
    name = str(dtype).removeprefix("torch.")
    expected = reference_chunk_backward(inputs, layout, C, scale, group)
    (kernel,) = runtime.compile_all([(chunk_backward.build, (C, K, V, name, scale, l2norm))])
    given = {"do", "v", "q_in", "k_in", "h"}  # in the inputs' dtype; the rest fp32
    device = {n: t.to("cuda", dtype if n in given else torch.float32).contiguous() for n, t in inputs.items()}
    outputs = empty_outputs(device, C, dtype)
    kernel(
        *(device[n] for n in TILELANG_ORDER), layout.chunk_starts.cuda(), layout.chunk_seq_ends.cuda(),
        *(outputs[n] for n in OUTPUTS),
    )  # fmt: skip
    torch.cuda.synchronize()
    for n in OUTPUTS:
        # dv is rounded once to the inputs' dtype. The fp32 outputs' products take 16-bit halves of their fp32
        # operands (seen on the H200: at most 5e-6 in bf16, 1.6e-6 in fp16); one bf16 rounding gives ~1e-3
        limit = (1e-2 if dtype == torch.bfloat16 else 2e-3) if n == "dv" else 2e-5
        assert relative_error(outputs[n].cpu(), expected[n]) < limit, (n, relative_error(outputs[n].cpu(), expected[n]))


def test_only_the_pipelined_kernel_asks_for_the_plain_pipeline():
    """`runtime.pass_configs` gives a builder's own TileLang pass settings, which compiling and lowering
    apply: chunk_backward's turns warp specialization off (its 64-row products cannot be split over a
    producer warpgroup's 12 warps); a builder that names none gets none."""
    pytest.importorskip("tilelang", reason="TileLang is not installed (extra `tilelang`)")
    from kda.backends.tilelang import chunk_backward, runtime, score_backward

    assert runtime.pass_configs(chunk_backward.build) == {"tl.disable_warp_specialized": True}
    assert runtime.pass_configs(score_backward.build) == {}
