"""The tilelang backward's score stage (`kda.backends.tilelang.score_backward`).

- `reference_score_backward`: the stage's math as direct float64 sums over the causal triangles, no anchors
  and no strips, proven on the CPU against the helion backend's kernel (run in Helion's interpreter) on
  varlen batches with ragged tails, GVA, and mild (every strip's diagonal block by product) and extreme
  (log decays of about -20 a step: the exact diagonal block) gates;
- every claimed shape (chunk 32 and 64, K of 64, 128 and 256, bf16 and fp16) lowers to CUDA for sm_90a,
  with ``wgmma`` products and shared memory that fits the H200, and each strip's global reads issued at the
  strip's start, before its operands are built;
- on a Hopper GPU (``gpu`` marker, skipped elsewhere with the reason): the compiled kernel against the
  reference, its outputs pre-filled with random values that it must add to; the kernel reads q and k as
  given with their scales (`rows.inputs_and_scales`), the reference the rows ``x r``.
"""

from __future__ import annotations

import functools
import re

import pytest
import torch
from nvcc import ptxas_report, registers
from rows import inputs_and_scales

from kda.backends.chunks import chunk_layout

pytest.importorskip("tilelang", reason="TileLang is not installed (extra `tilelang`)")

from kda.backends.tilelang import runtime, score_backward

H200_SHARED_MEMORY = 232448  # bytes of dynamic shared memory one block may ask for (227 KB)
CLAIMED = [(C, K, dtype) for C in (32, 64) for K in (64, 128, 256) for dtype in ("bfloat16", "float16")]


def score_terms(q, k, G, dP_qk, dP_kk, chunk_starts, chunk_seq_ends, group):
    """``da`` of each score and ``db`` of the two summed, with the chunk's ``q`` and ``k``, ``[NT, HV, C, K]``
    float64, by direct sums::

        da_i = sum_j dP[i, j] b_j exp(G_i - G_j)        db_j = sum_i dP[i, j] a_i exp(G_i - G_j)

    over ``j <= i`` (``dP_qk``) and ``j < i`` (``dP_kk``), whatever lies above those triangles; ``q`` and
    ``k`` of rows past their sequence's end are zeros."""
    HV, C = G.shape[1], G.shape[2]
    rows = chunk_starts.long()[:, None] + torch.arange(C)  # [NT, C]
    valid = rows < chunk_seq_ends.long()[:, None]
    heads = torch.arange(HV) // group

    def chunked(x):  # [tokens, H, K] -> [NT, HV, C, K], zeros past the end
        x = x.double()[rows.clamp(max=x.shape[0] - 1)][:, :, heads]  # [NT, C, HV, K]
        return torch.where(valid[:, :, None, None], x, 0.0).transpose(1, 2)

    q_c, k_c, G64 = chunked(q), chunked(k), G.double()
    diff = G64[:, :, :, None, :] - G64[:, :, None, :, :]  # [NT, HV, i, j, K]: G_i - G_j
    i, j = torch.arange(C)[:, None], torch.arange(C)[None, :]
    decay = torch.exp(torch.where((j <= i)[:, :, None], diff, -torch.inf))
    Pq = torch.where(j <= i, dP_qk.double(), 0.0)[..., None] * decay  # [NT, HV, i, j, K]
    Pk = torch.where(j < i, dP_kk.double(), 0.0)[..., None] * decay
    da_q = (Pq * k_c[:, :, None]).sum(3)
    da_k = (Pk * k_c[:, :, None]).sum(3)
    db = (Pq * q_c[:, :, :, None]).sum(2) + (Pk * k_c[:, :, :, None]).sum(2)
    return da_q, da_k, db, q_c, k_c


def reference_score_backward(q, k, G, dP_qk, dP_kk, chunk_starts, chunk_seq_ends, group):
    """The stage's contributions to ``dq``, ``dk``, ``dG`` ``[NT, HV, C, K]`` in float64 (`score_terms`)::

    dq = da (P_qk)      dk = da (P_kk) + db      dG = q da (P_qk) + k (da (P_kk) - db)
    """
    da_q, da_k, db, q_c, k_c = score_terms(q, k, G, dP_qk, dP_kk, chunk_starts, chunk_seq_ends, group)
    return da_q, da_k + db, q_c * da_q + k_c * (da_k - db)


def errors(outputs, before, inputs, group) -> dict[str, float]:
    """Each output's added part against the reference, ``||x - ref|| / ||ref||``; for ``dG`` the norm of its
    terms' sizes ``|q da| + |k da| + |k db|`` is the denominator: a difference whose terms cancel (at
    steep gates ``dG`` is almost only ``q_i dP_ii k_i - k_i dP_ii q_i = 0``) is known to their rounding."""
    q, k, G, dP_qk, dP_kk, starts, ends = inputs
    da_q, da_k, db, q_c, k_c = score_terms(q, k, G, dP_qk, dP_kk, starts, ends, group)
    expected = (da_q, da_k + db, q_c * da_q + k_c * (da_k - db))
    sizes = (da_q.abs(), da_k.abs() + db.abs(), (q_c * da_q).abs() + (k_c * da_k).abs() + (k_c * db).abs())
    found = {}
    for name, out, old, ref, size in zip(("dq", "dk", "dG"), outputs, before, expected, sizes, strict=True):
        added = out.detach().cpu().double() - old.detach().cpu().double()
        found[name] = (added - ref).norm().item() / size.norm().item() if torch.isfinite(added).all() else torch.inf
    return found


def make_inputs(lengths, C, H, group, K, gate, dtype=torch.float32, device="cpu"):
    """Random stage inputs: q, k (l2-normalized), chunk-major ``G`` (per-chunk cumulative sums of log decays,
    flat past the end), ``dP_qk``, ``dP_kk`` with random values above their triangles too, the layout."""
    bounds = torch.tensor([0, *lengths]).cumsum(0).tolist()
    layout = chunk_layout(tuple(bounds), C, torch.device("cpu"))
    tokens, NT, HV = bounds[-1], layout.num_chunks, H * group
    q = torch.nn.functional.normalize(torch.randn(tokens, H, K), dim=-1)
    k = torch.nn.functional.normalize(torch.randn(tokens, H, K), dim=-1)
    if gate == "mild":  # a strip's span at most 15 * 0.5 and steps of at most 0.5: by product
        steps = -0.5 * torch.rand(NT, HV, C, K)
    elif gate == "safe":  # the safe gate's bound: steps of at most 5, a strip's span at most 75
        steps = -5.0 * torch.rand(NT, HV, C, K)
    elif gate == "extreme":  # steps of -20 +- 5: past the step limit, the exact diagonal block
        steps = -20.0 * (0.75 + 0.5 * torch.rand(NT, HV, C, K))
    else:  # "mixed": strips alternate between the two
        steep = ((torch.arange(C) // 16) % 2 == 1)[:, None]
        steps = torch.where(steep, -20.0, -0.5) * torch.rand(NT, HV, C, K)
    inside = layout.chunk_starts.long()[:, None] + torch.arange(C) < layout.chunk_seq_ends.long()[:, None]
    G = torch.where(inside[:, None, :, None], steps, 0.0).cumsum(2)
    dP_qk, dP_kk = torch.randn(NT, HV, C, C), torch.randn(NT, HV, C, C)
    q, k = q.to(dtype), k.to(dtype)
    moved = [x.to(device) for x in (q, k, G, dP_qk, dP_kk, layout.chunk_starts, layout.chunk_seq_ends)]
    return moved, layout


@pytest.mark.parametrize("C", [32, 64])
@pytest.mark.parametrize("gate", ["mild", "extreme"])
def test_reference_matches_the_helion_kernel(seed, monkeypatch, C, gate):
    pytest.importorskip("helion", reason="Helion is not installed (extra `helion`)")
    if torch.cuda.is_available():
        pytest.skip("Helion's interpreter runs on the CPU here; on a GPU the tilelang kernel is checked instead")
    import helion

    from kda.backends.helion import runtime as helion_runtime
    from kda.backends.helion.score_backward import score_backward_kernel
    from kda.backends.helion.score_diagonal import score_diagonal_kernel

    monkeypatch.setenv("HELION_INTERPRET", "1")  # read when the kernel object is made, below
    helion_runtime.register_cpu_matmul()
    H, group, K = 1, 2, 16
    (q, k, G, dP_qk, dP_kk, starts, ends), _ = make_inputs((C + 13, 2 * C, 5), C, H, group, K, gate)
    # the helion kernel reads dP as the chunk stage leaves it: zero above the triangles
    i, j = torch.arange(C)[:, None], torch.arange(C)[None, :]
    dP_qk, dP_kk = torch.where(j <= i, dP_qk, 0.0), torch.where(j < i, dP_kk, 0.0)
    before = [torch.randn_like(G) for _ in range(3)]
    outputs = [x.clone() for x in before]
    for fn in (score_backward_kernel, score_diagonal_kernel):  # the products, then the exact diagonal blocks
        kernel = helion.kernel(fn, static_shapes=False, dot_precision="ieee")
        kernel(q, k, G, G, G, dP_qk, dP_kk, starts, ends, *outputs, group, C, False)  # rows as given: no l2 scales
    found = errors(outputs, before, (q, k, G, dP_qk, dP_kk, starts, ends), group)
    assert max(found.values()) <= 1e-5, found


def test_reference_sees_the_gates_and_the_triangles(seed):
    """The reference is not blind to what it must check: changing G, a dP entry in a triangle or a key
    changes it; a dP entry above the triangles does not, nor does the next sequence's key change a chunk
    whose rows past its end would reach that token."""
    (q, k, G, dP_qk, dP_kk, starts, ends), layout = make_inputs((45, 10), 32, 1, 1, 16, "mild")
    base = reference_score_backward(q, k, G, dP_qk, dP_kk, starts, ends, 1)

    def changed(chunk: int, **swap) -> bool:
        args = dict(q=q, k=k, G=G, dP_qk=dP_qk, dP_kk=dP_kk) | swap
        out = reference_score_backward(**args, chunk_starts=starts, chunk_seq_ends=ends, group=1)
        return any(not torch.equal(a[chunk], b[chunk]) for a, b in zip(out, base, strict=True))

    assert layout.num_chunks == 3
    assert changed(0, G=G * 1.5)
    above, inside = dP_kk.clone(), dP_kk.clone()
    above[0, 0, 3, 3] += 1.0  # the diagonal of dP_kk lies above its triangle
    inside[0, 0, 3, 2] += 1.0
    assert not changed(0, dP_kk=above) and changed(0, dP_kk=inside)
    upper = dP_qk.clone()
    upper[0, 0, 2, 3] += 1.0
    assert not changed(0, dP_qk=upper)
    later = k.clone()
    later[50] += 1.0  # the second sequence's token 5: row 18 of chunk 1 would reach it, past that chunk's end
    assert changed(2, k=later) and not changed(1, k=later)


# the kernel's body is the same at every K (only the grid's key blocks and the tensors' shapes change) and
# at both dtypes (only the loads' type): one chunk-64 and one chunk-32 claim lower in the quick run, the
# rest under the `slow` marker (a lowering takes 15 to 90 s on 2 loaded cores)
QUICK = [(64, 128, "bfloat16"), (32, 256, "float16")]


@functools.cache
def lower(claim: tuple[int, int, str]) -> tuple[str, int]:
    """The claim's kernel lowered to CUDA for sm_90a, with the l2norm's scales in bf16 and without them in
    fp16: its source and dynamic shared memory bytes."""
    artifact = runtime.lower(score_backward.build(*claim, claim[2] == "bfloat16"))
    return artifact.kernel_source, runtime.shared_memory_bytes(artifact)


@pytest.mark.parametrize(
    "claim",
    [claim if claim in QUICK else pytest.param(claim, marks=pytest.mark.slow) for claim in CLAIMED],
    ids=lambda claim: "-".join(map(str, claim)),
)
def test_every_claimed_shape_lowers_to_wgmma(claim):
    source, shared = lower(claim)
    assert "__global__" in source
    # every product has the 64 key columns of a block as wgmma's M, at chunk 32 too
    assert set(re.findall(r"wgmma_ss|wgmma_rs|mma_sync", source)) == {"wgmma_ss"}
    # two warpgroups, each taking 8 of a strip's 16 columns (one warpgroup's products were N = 16)
    assert "__launch_bounds__(256" in source
    assert set(re.findall(r"wgmma_ss<[^>]*?, 64, (\d+), 16,", source)) == {"8"}
    assert "tf32" not in source.lower()  # dP is never rounded to TF32
    assert shared <= H200_SHARED_MEMORY, shared
    if claim[0] == 64:  # two blocks an SM (233472 bytes an SM, 1 KB reserved a block)
        assert 2 * (shared + 1024) <= 233472, shared


@pytest.mark.slow
def test_it_builds_with_nvcc_two_blocks_an_sm_without_spills(tmp_path):
    """The chunk-64 kernel builds with this machine's nvcc for sm_90a, without spills, in registers that let
    two blocks of 256 threads share an SM (65536 registers), as its shared memory does."""
    report = ptxas_report(lower(QUICK[0])[0], tmp_path, "score_backward")
    assert 2 * 256 * registers(report) <= 65536, report[-2000:]
    assert re.findall(r"(\d+) bytes spill stores", report) == ["0"], report[-2000:]


def test_a_bounded_gate_measures_no_span():
    """Where the gate bounds every strip (the sigmoid and safe gates at a lower bound of at most 5 in size:
    steps of at most 5, spans of at most 75), the kernel is compiled without the span's two reductions a
    strip and without the exact diagonal block; elsewhere both stay."""
    from kda.backends.tilelang import gate

    assert score_backward.within_limits(gate.SAFE, -5.0) and score_backward.within_limits(gate.SIGMOID, -1.0)
    assert not score_backward.within_limits(gate.SAFE, -5.4)  # 15 x 5.4 = 81: past the span limit
    assert not score_backward.within_limits(gate.SOFTPLUS, -5.0) and not score_backward.within_limits(gate.PREGATED, 0)
    bounded = runtime.lower(score_backward.build(*QUICK[0], True, True)).kernel_source
    measuring = lower(QUICK[0])[0]
    assert "row_span" in measuring and "AllReduce" in measuring
    assert "row_span" not in bounded and "AllReduce" not in bounded
    assert bounded.count("__syncthreads") < measuring.count("__syncthreads")


# a read of a strip's memory in the lowered source: dP's elements, or the old rows of the read-add-write
STRIP_READ = re.compile(r"dP_(qk|kk)\[|=\s*(\*\(float4\*\)\()?(dq_c|dk_c|dG_c)\s*[+\[]")


def _strip_reads(text: str) -> set[str]:
    """The tensors of a strip's memory that `text` reads."""
    return {f"dP_{m.group(1)}" if m.group(1) else m.group(3) for m in STRIP_READ.finditer(text)}


def test_a_strip_reads_its_memory_before_it_builds_its_operands():
    """Each strip's global reads (its dP rows and columns, its rows of dq_c, dk_c, dG_c) are issued at the
    strip's start, before its first exponential and its first barrier, so that their latency runs under the
    operands' exponentials and halves; with a bounded gate nothing reads them later in the strip (the
    measuring kernel's exact diagonal block reads dP again, in its own branch)."""
    bounded = runtime.lower(score_backward.build(*QUICK[0], True, True)).kernel_source
    for source in (bounded, lower(QUICK[0])[0]):
        strip = source[source.index("for (int s = 0;") :]
        first_wait = min(strip.index("expf("), strip.index("__syncthreads"))
        assert _strip_reads(strip[:first_wait]) == {"dP_qk", "dP_kk", "dq_c", "dk_c", "dG_c"}
    strip = bounded[bounded.index("for (int s = 0;") :]
    assert _strip_reads(strip[strip.index("expf(") :]) == set()


def test_the_product_operands_are_bf16_halves():
    """Every product reads bf16 halves (`intra.high`, `intra.low`) from shared memory: dP is fp32 and must
    not be rounded to one 16-bit value, and both halves of each operand reach a wgmma."""
    source, _ = lower(QUICK[0])
    descriptors = "\n".join(line for line in source.splitlines() if "initialize_wgmma_descriptor" in line)
    for operand in ("rows_hi", "rows_lo", "cols_hi", "cols_lo", "pq_hi", "pq_lo", "pk_hi", "pk_lo", "pc_hi", "pc_lo"):
        assert f"(bfloat16_t*){operand})[0]" in descriptors, operand


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
@pytest.mark.parametrize("C", [32, 64])
@pytest.mark.parametrize("gate", ["mild", "extreme", "mixed"])
@pytest.mark.parametrize("K", [64, 128, 256])
@pytest.mark.usefixtures("hopper")
def test_kernel_matches_the_reference_on_the_gpu(seed, dtype, C, gate, K):
    if K != 128 and (C, gate) != (64, "mixed"):
        pytest.skip("K of 64 and 256 are checked at chunk 64 with the mixed gate")
    H, group = 2, 2
    lengths = (5 * C + 13, 1, 0, C - 3, 2 * C)
    inputs, _ = make_inputs(lengths, C, H, group, K, gate, device="cuda")
    _, _, G, dP_qk, dP_kk, starts, ends = inputs
    # bf16 with the l2norm (q and k as given, and their scales), fp16 without (the rows are the inputs)
    l2norm = dtype == "bfloat16"
    tokens = sum(lengths)
    (q, r_q, q_rows), (k, r_k, k_rows) = (
        inputs_and_scales((tokens, H, K), getattr(torch, dtype), l2norm) for _ in "qk"
    )
    (kernel,) = runtime.compile_all([(score_backward.build, (C, K, dtype, l2norm))])
    before = [torch.randn_like(G) for _ in range(3)]
    outputs = [x.clone() for x in before]
    kernel(q.cuda(), k.cuda(), r_q.cuda(), r_k.cuda(), G, dP_qk, dP_kk, starts, ends, *outputs)
    torch.cuda.synchronize()
    found = errors(outputs, before, [q_rows, k_rows, *(x.cpu() for x in inputs[2:])], group)
    assert max(found.values()) <= 1e-4, found


@pytest.mark.gpu
@pytest.mark.parametrize("C", [32, 64])
@pytest.mark.usefixtures("hopper")
def test_the_bounded_kernel_matches_the_reference_and_the_measuring_one(seed, C):
    """Under the safe gate's bound the kernel compiled `bounded` (no span measured, only the operand blocks a
    product reaches built) matches the reference, and the kernel that measures the spans bit for bit: the
    products see the same nonzero operands."""
    H, group, K, dtype = 2, 2, 128, "bfloat16"
    lengths = (5 * C + 13, 1, 0, C - 3, 2 * C)
    inputs, _ = make_inputs(lengths, C, H, group, K, "safe", device="cuda")
    _, _, G, dP_qk, dP_kk, starts, ends = inputs
    tokens = sum(lengths)
    (q, r_q, q_rows), (k, r_k, k_rows) = (inputs_and_scales((tokens, H, K), torch.bfloat16, True) for _ in "qk")
    before = [torch.randn_like(G) for _ in range(3)]
    results = []
    for bounded in (True, False):
        (kernel,) = runtime.compile_all([(score_backward.build, (C, K, dtype, True, bounded))])
        outputs = [x.clone() for x in before]
        kernel(q.cuda(), k.cuda(), r_q.cuda(), r_k.cuda(), G, dP_qk, dP_kk, starts, ends, *outputs)
        torch.cuda.synchronize()
        results.append(outputs)
    found = errors(results[0], before, [q_rows, k_rows, *(x.cpu() for x in inputs[2:])], group)
    assert max(found.values()) <= 1e-4, found
    for ours, theirs in zip(*results, strict=True):
        assert torch.equal(ours, theirs)
