"""The tilelang backward's reverse state pass (`kda.backends.tilelang.state_backward`).

- `reference_state_backward`, a float64 torch loop over sequences and chunks, is proven twice on the CPU:
  against autograd through the forward's state pass, and against the helion backend's kernel of the same
  stage run in Helion's interpreter, on a varlen layout with ragged tails, an empty and a one-token sequence.
- Every claimed specialization lowers to CUDA for sm_90a on the CPU, with ``wgmma`` products (``mma.sync``
  only for the 32-row products at chunk 32), the split halves as ``wgmma`` operands, no TF32, and the shared
  memory under the H200's limit; one compiles with nvcc without spilling.
- On a Hopper GPU (marked `gpu`) the compiled kernel matches the reference with NaN-poisoned outputs, at
  a tolerance that a single 16-bit rounding of ``dS`` or ``dv_new`` would miss.
"""

from __future__ import annotations

import concurrent.futures
import os
import re

import pytest
import torch
from nvcc import ptxas_report, registers

from kda.backends.chunks import chunk_layout
from kda.verify.check import relative_error

H200_SHARED_MEMORY = 232448  # bytes of dynamic shared memory one block may ask for (227 KB)


def ragged_bounds(C: int, whole: int) -> tuple[int, ...]:
    """Varlen with ragged tails: ``whole`` chunks and a 3-token tail, an empty sequence, a one-token one, and
    one chunk and a half (``whole + 3`` chunks in all)."""
    bounds = [0]
    for length in (whole * C + 3, 0, 1, C + C // 2):
        bounds.append(bounds[-1] + length)
    return tuple(bounds)


def reference_state_backward(
    do: torch.Tensor,  # [tokens, HV, V]
    q_e: torch.Tensor,  # [NT, HV, C, K]
    w: torch.Tensor,  # [NT, HV, C, K]
    k_g: torch.Tensor,  # [NT, HV, C, K]
    A_qk: torch.Tensor,  # [NT, HV, C, C]
    G_last: torch.Tensor,  # [NT, HV, K]
    chunk_starts: torch.Tensor,  # [NT]
    chunk_seq_ends: torch.Tensor,  # [NT]
    chunk_bounds: torch.Tensor,  # [N + 1]
    dht: torch.Tensor | None,  # state layout, or None
    v_first: bool,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``dh [NT, HV, K, V]``, ``dv_new [NT, HV, C, V]`` and ``dh0`` (state layout), float64: the stage's
    math (`kda.backends.helion.state_backward`'s docstring) one sequence and one chunk at a time."""
    f64 = torch.float64
    NT, HV, C, K = q_e.shape
    V = do.shape[-1]
    bounds = chunk_bounds.tolist()
    N = len(bounds) - 1
    dh = torch.zeros(NT, HV, K, V, dtype=f64)
    dv_new = torch.zeros(NT, HV, C, V, dtype=f64)
    dh0 = torch.zeros(N, HV, K, V, dtype=f64)
    for n in range(N):
        if dht is None:
            dS = torch.zeros(HV, K, V, dtype=f64)
        else:
            dS = (dht[n].transpose(-1, -2) if v_first else dht[n]).to(f64)
        for j in reversed(range(bounds[n], bounds[n + 1])):
            start, end = int(chunk_starts[j]), int(chunk_seq_ends[j])
            rows = min(C, end - start)
            do_j = torch.zeros(HV, C, V, dtype=f64)
            do_j[:, :rows] = do[start : start + rows].to(f64).transpose(0, 1)
            dh[j] = dS
            dvn = A_qk[j].to(f64).transpose(-1, -2) @ do_j + k_g[j].to(f64) @ dS
            dv_new[j] = dvn
            decay = torch.exp(G_last[j].to(f64))[..., None]
            dS = decay * dS + q_e[j].to(f64).transpose(-1, -2) @ do_j - w[j].to(f64).transpose(-1, -2) @ dvn
        dh0[n] = dS
    return dh, dv_new, dh0.transpose(-1, -2) if v_first else dh0


def random_stage_inputs(
    bounds: tuple[int, ...], C: int, HV: int, K: int, V: int, dtype: torch.dtype, device: str, v_first: bool
) -> dict:
    """The stage's inputs at realistic sizes: unit-norm-like keys scaled by decays <= 1, ``A_qk`` lower
    triangular, ``G_last`` a chunk's worth of log decays (each in (-C/8, 0))."""
    layout = chunk_layout(bounds, C, torch.device(device))
    NT, N, tokens = max(layout.num_chunks, 1), layout.num_seqs, bounds[-1]
    scale = K**-0.5

    def rand(*shape, s=1.0):
        return (torch.randn(*shape) * s).to(dtype).to(device)

    state = (N, HV, V, K) if v_first else (N, HV, K, V)
    return dict(
        do=rand(tokens, HV, V),
        q_e=rand(NT, HV, C, K, s=scale),
        w=rand(NT, HV, C, K, s=scale),
        k_g=rand(NT, HV, C, K, s=scale),
        A_qk=(torch.randn(NT, HV, C, C) * scale).tril().to(dtype).to(device),
        G_last=(-torch.rand(NT, HV, K) * C / 8).to(device),
        layout=layout,
        dht=torch.randn(*state, device=device),
    )


def test_the_reference_is_autograd_through_the_forward_state_pass(seed):
    """``dv_new`` is the gradient of ``u`` (``v_new = u - w S``), ``dh0`` that of the initial state and
    ``dh[j]`` that of the state leaving chunk j, for the loss ``<o, do> + <final_state, dht>`` of the forward
    ``o = q_e S + A_qk v_new``, ``S' = exp(G_last) S + k_g^T v_new`` (one sequence of three chunks)."""
    C, HV, K, V = 8, 2, 16, 12
    x = random_stage_inputs((0, 3 * C), C, HV, K, V, torch.float64, "cpu", v_first=False)
    layout = x["layout"]
    u = torch.randn(3, HV, C, V, dtype=torch.float64, requires_grad=True)
    S0 = torch.randn(HV, K, V, dtype=torch.float64, requires_grad=True)
    S, leaving, outputs = S0, [], []
    for j in range(3):
        v_new = u[j] - x["w"][j] @ S
        outputs.append(x["q_e"][j] @ S + x["A_qk"][j] @ v_new)
        # the decay in float64, as the reference takes it (in fp32 it was 1e-7 off, past float64's tolerance)
        S = torch.exp(x["G_last"][j].double())[..., None] * S + x["k_g"][j].transpose(-1, -2) @ v_new
        S.retain_grad()
        leaving.append(S)
    o = torch.stack(outputs)  # [NT, HV, C, V]
    loss = (o * x["do"].view(3, C, HV, V).transpose(1, 2)).sum() + (S * x["dht"][0]).sum()
    loss.backward()
    dh, dv_new, dh0 = reference_state_backward(
        x["do"], x["q_e"], x["w"], x["k_g"], x["A_qk"], x["G_last"],
        layout.chunk_starts, layout.chunk_seq_ends, layout.chunk_bounds, x["dht"], False,
    )  # fmt: skip
    torch.testing.assert_close(dv_new, u.grad)
    torch.testing.assert_close(dh0[0], S0.grad)
    for j in range(3):
        torch.testing.assert_close(dh[j], leaving[j].grad)


@pytest.mark.parametrize("v_first", [False, True])
@pytest.mark.parametrize("has_dht", [False, True])
def test_the_reference_matches_helions_kernel_in_its_interpreter(seed, monkeypatch, v_first, has_dht):
    """The same math as the helion backend's tested stage, on its fp32 inputs. Helion reads q and k
    token-major and the full ``G``, and forms ``q_e = scale q e^G`` and ``k_g = k e^(G_last - G)`` itself;
    the reference takes those, formed here in float64 from the same rows (zero past a sequence's end)."""
    pytest.importorskip("helion", reason="Helion is not installed (extra `helion`)")
    if torch.cuda.is_available():
        pytest.skip("Helion's interpreter case is for the CPU; on a GPU the tilelang kernel itself is tested")
    import helion

    from kda.backends.helion import runtime
    from kda.backends.helion.state_backward import state_backward_kernel

    C, HV, K, V = 8, 2, 16, 12
    x = random_stage_inputs(ragged_bounds(C, 2), C, HV, K, V, torch.float32, "cpu", v_first)
    layout = x["layout"]
    NT, N = layout.num_chunks, layout.num_seqs
    G = -torch.rand(NT, HV, C, K) * C / 8
    G[:, :, C - 1] = x["G_last"]
    tokens, scale = x["do"].shape[0], K**-0.5
    q, k = torch.randn(tokens, HV, K) * scale, torch.randn(tokens, HV, K) * scale
    rows = (layout.chunk_starts[:, None] + torch.arange(C)).long()  # [NT, C]
    valid = (rows < layout.chunk_seq_ends[:, None])[:, None, :, None]  # [NT, 1, C, 1]

    def by_chunk(t: torch.Tensor) -> torch.Tensor:  # [tokens, HV, K] -> [NT, HV, C, K] float64, zero past ends
        return torch.where(valid, t[rows.clamp(max=tokens - 1)].transpose(1, 2).double(), 0.0)

    q_e = scale * by_chunk(q) * G.double().exp()
    k_g = by_chunk(k) * (G.double()[:, :, C - 1 :] - G.double()).exp()
    dht = x["dht"] if has_dht else None
    placeholder = torch.zeros(1)
    dh = torch.full((NT, HV, K, V), float("nan"))
    dv_new = torch.full((NT, HV, C, V), float("nan"))
    dh0 = torch.full(x["dht"].shape, float("nan"))
    monkeypatch.setenv("HELION_INTERPRET", "1")  # read when the kernel object is made
    runtime.register_cpu_matmul()
    kernel = helion.kernel(state_backward_kernel, static_shapes=False, dot_precision="ieee")
    kernel(
        x["do"], q, k, G, G, x["w"], x["A_qk"], G,
        layout.chunk_starts, layout.chunk_seq_ends, layout.chunk_bounds,
        dht if dht is not None else placeholder, dh, dv_new, dh0, scale, 1, C, has_dht, True, v_first, False, False,
    )  # fmt: skip
    expected = reference_state_backward(
        x["do"], q_e, x["w"], k_g, x["A_qk"], x["G_last"],
        layout.chunk_starts, layout.chunk_seq_ends, layout.chunk_bounds, dht, v_first,
    )  # fmt: skip
    assert N == 4 and NT == 6
    for name, got, want in zip(("dh", "dv_new", "dh0"), (dh, dv_new, dh0), expected, strict=True):
        assert torch.allclose(got.double(), want, rtol=1e-4, atol=1e-4), (name, (got.double() - want).abs().max())
    # the empty sequence (index 1) passes its gradient straight through
    torch.testing.assert_close(dh0[1], x["dht"][1] if has_dht else torch.zeros_like(dh0[1]))


# ----------------------------------------------------------------------------------------------- lowering

# (C, K, V, dtype, has_dht, store_dh0, v_first): every chunk and head dim, each flag and both dtypes at least
# once, K != V both ways
LOWERED = [
    (64, 64, 64, "bfloat16", True, True, False),
    (64, 128, 128, "bfloat16", True, True, False),
    (64, 256, 256, "bfloat16", True, False, True),
    (64, 128, 64, "float16", False, False, False),
    (32, 64, 64, "float16", False, True, True),
    (32, 128, 128, "bfloat16", True, False, True),
    (32, 256, 256, "float16", True, True, False),
    (32, 64, 256, "bfloat16", False, True, False),
]


def _lower(params: tuple) -> tuple[str, int]:
    from kda.backends.tilelang import runtime, state_backward

    C, K, V = params[:3]
    artifact = runtime.lower(state_backward.build(C, K, V, state_backward.block_v(K, V), *params[3:]))
    return artifact.kernel_source, runtime.shared_memory_bytes(artifact)


@pytest.fixture(scope="module")
def lowered() -> dict:
    """`LOWERED`'s kernels as CUDA source for sm_90a with their shared memory bytes (or the exception);
    TVM's passes run outside the GIL, so a thread per core lowers them side by side."""
    pytest.importorskip("tilelang", reason="TileLang is not installed (extra `tilelang`)")
    with concurrent.futures.ThreadPoolExecutor(os.cpu_count() or 1) as pool:
        futures = {params: pool.submit(_lower, params) for params in LOWERED}
    return {params: future.exception() or future.result() for params, future in futures.items()}


def lowered_source(lowered: dict, params: tuple) -> tuple[str, int]:
    result = lowered[params]
    if isinstance(result, BaseException):
        raise AssertionError(f"{params} did not lower") from result
    return result


def products(source: str) -> set[str]:
    return set(re.findall(r"wgmma_ss|wgmma_rs|mma_sync", source))


@pytest.mark.parametrize("params", LOWERED, ids=lambda p: "-".join(map(str, p)))
def test_every_claimed_specialization_lowers_to_tensor_core_products(lowered, params):
    source, shared = lowered_source(lowered, params)
    assert "__global__" in source
    assert shared <= H200_SHARED_MEMORY, shared
    assert "tf32" not in source.lower()  # fp32 operands would have become TF32
    assert "tma_load" in source  # the chunk-major tiles come by the bulk tensor copy engine
    # dS's products have M = K >= 64: wgmma at both chunks; dv_new's have M = C: below wgmma's 64 at chunk 32
    assert products(source) == ({"wgmma_ss"} if params[0] == 64 else {"wgmma_ss", "mma_sync"}), products(source)


@pytest.mark.parametrize("params", LOWERED[:2] + LOWERED[4:5], ids=lambda p: "-".join(map(str, p)))
def test_the_state_gradient_stays_in_the_consumer_warps(lowered, params):
    """TileLang's warp specialization moved a ``T.copy`` of the ``dS`` fragment to global memory into the
    producer warps, with a private copy of ``dS`` there (``dS_producer_ws``, a 32 KB stack frame a thread)
    that the products never updated: every ``dh`` after the first chunk was stale. ``dS`` must live in the
    consumer warps alone."""
    source = lowered_source(lowered, params)[0]
    assert "_producer_ws" not in source


@pytest.mark.parametrize("params", [LOWERED[1], LOWERED[3]], ids=lambda p: "-".join(map(str, p)))
def test_the_fp32_operands_are_multiplied_as_split_halves(lowered, params):
    """``dS`` and ``-dv_new`` reach ``wgmma`` as their hi and lo halves in the inputs' dtype, from shared memory."""
    source = lowered_source(lowered, params)[0]
    element = {"bfloat16": "bfloat16_t", "float16": "half_t"}[params[3]]
    descriptors = [line for line in source.splitlines() if "initialize_wgmma_descriptor" in line]
    for operand in ("dS_hi", "dS_lo", "ndv_hi", "ndv_lo"):
        assert any(f"({element}*){operand})[0]" in line for line in descriptors), operand


def test_two_stages_where_they_fit():
    pytest.importorskip("tilelang", reason="TileLang is not installed (extra `tilelang`)")
    from kda.backends.tilelang import state_backward

    for C in (32, 64):
        for K in (64, 128, 256):
            stages = state_backward.stages_for(C, K, 64)
            assert stages == (1 if (C, K) == (64, 256) else 2), (C, K, stages)
            assert state_backward.shared_bytes(C, K, 64, stages) <= H200_SHARED_MEMORY


@pytest.mark.slow
def test_every_head_dim_pair_and_dtype_lowers():
    """The whole claim: C in (32, 64), K and V in (64, 128, 256), bf16 and fp16 (36 kernels, minutes)."""
    pytest.importorskip("tilelang", reason="TileLang is not installed (extra `tilelang`)")
    claims = [
        (C, K, V, dtype, True, True, False)
        for C in (32, 64)
        for K in (64, 128, 256)
        for V in (64, 128, 256)
        for dtype in ("bfloat16", "float16")
    ]
    with concurrent.futures.ThreadPoolExecutor(os.cpu_count() or 1) as pool:
        results = list(pool.map(_lower, claims))
    for params, (source, shared) in zip(claims, results, strict=True):
        assert "wgmma_ss" in source and shared <= H200_SHARED_MEMORY, (params, shared)


def test_one_specialization_compiles_with_nvcc_without_spilling(lowered, tmp_path):
    """Chunk 64, K = V = 128: nvcc builds it, and ``dS`` and ``dv_new`` stay in registers (no stack frame)."""
    report = ptxas_report(lowered_source(lowered, LOWERED[1])[0], tmp_path, "state_backward")
    assert "0 bytes stack frame, 0 bytes spill stores, 0 bytes spill loads" in report, report[-2000:]
    assert registers(report) <= 255, report[-2000:]


# ---------------------------------------------------------------------------------------------------- GPU


@pytest.mark.gpu
@pytest.mark.parametrize("v_first", [False, True])
@pytest.mark.parametrize("shape", [(64, 128, 128, "bfloat16"), (32, 64, 64, "float16")], ids=str)
@pytest.mark.usefixtures("hopper")
def test_the_kernel_matches_the_reference_on_hopper(seed, shape, v_first):
    """Varlen with ragged tails, an empty and a one-token sequence, two value heads, a final-state gradient in
    and an initial-state gradient out; outputs NaN-poisoned, so an element never written fails. The fp32
    operands' split halves keep the error near fp32's: 2e-4 is past one bf16 rounding of ``dS`` (2^-9)."""
    pytest.importorskip("tilelang", reason="TileLang is not installed (extra `tilelang`)")
    from kda.backends.tilelang import runtime, state_backward

    C, K, V, dtype_name = shape
    dtype = getattr(torch, dtype_name)
    HV = 2
    x = random_stage_inputs(ragged_bounds(C, 6), C, HV, K, V, dtype, "cuda", v_first)
    layout = x["layout"]
    NT = layout.num_chunks
    params = (C, K, V, state_backward.block_v(K, V), dtype_name, True, True, v_first)
    kernel = runtime.compile_all([(state_backward.build, params)])[0]
    nan = float("nan")
    dh = torch.full((NT, HV, K, V), nan, device="cuda")
    dv_new = torch.full((NT, HV, C, V), nan, device="cuda")
    dh0 = torch.full(x["dht"].shape, nan, device="cuda")
    inputs = [x[name] for name in ("do", "q_e", "w", "k_g", "A_qk", "G_last")]
    copies = [t.clone() for t in inputs]
    bounds_t = layout.chunk_bounds
    kernel(
        *inputs, layout.chunk_starts, layout.chunk_seq_ends, bounds_t[:-1].clone(), bounds_t[1:].clone(),
        x["dht"], dh, dv_new, dh0,
    )  # fmt: skip
    torch.cuda.synchronize()
    for given, copy in zip(inputs, copies, strict=True):
        assert torch.equal(given, copy), "an input was modified"
    do, q_e, w, k_g, A_qk, G_last = (t.cpu() for t in inputs)
    expected = reference_state_backward(
        do, q_e, w, k_g, A_qk, G_last,
        layout.chunk_starts.cpu(), layout.chunk_seq_ends.cpu(), bounds_t.cpu(), x["dht"].cpu(), v_first,
    )  # fmt: skip
    for name, got, want in zip(("dh", "dv_new", "dh0"), (dh, dv_new, dh0), expected, strict=True):
        got = got.cpu()
        assert not got.isnan().any(), f"{name}: elements left unwritten"
        assert relative_error(got, want) <= 2e-4, (name, relative_error(got, want))
