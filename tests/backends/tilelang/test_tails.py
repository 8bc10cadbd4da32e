"""The tilelang backward's elementwise tails (`kda.backends.tilelang.tails`): float64 torch references of
`gate_tail` and `qk_tail`, proven on the CPU against autograd (from the forward's own math) and against the
helion kernels in Helion's interpreter; every kernel specialization lowered to CUDA source for sm_90a; and,
on a Hopper GPU, both compiled kernels against the references with NaN-poisoned outputs (`qk_tail` reading
q or k as given with its scales, `rows.inputs_and_scales`; the reference the rows ``x r``).
"""

from __future__ import annotations

import concurrent.futures
import functools
import itertools
import math
import os
import re

import pytest
import torch
import torch.nn.functional as F
from rows import inputs_and_scales

from kda.backends.chunks import ChunkLayout, chunk_layout
from kda.reference import L2NORM_EPS, LOG_DECAY_FLOOR

pytest.importorskip("tilelang", reason="TileLang is not installed (extra `tilelang`)")

from kda.backends.tilelang import runtime, tails
from kda.backends.tilelang.gate import PREGATED, SAFE, SIGMOID, SOFTPLUS

GATES = {"pregated": PREGATED, "softplus": SOFTPLUS, "sigmoid": SIGMOID, "safe": SAFE}
F64 = torch.float64


# --- the float64 references ---------------------------------------------------------------------------------


def chunk_rows(layout: ChunkLayout, C: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Each chunk row's token ``[NT, C]`` (0 past the end) and whether it is inside its sequence."""
    NT = layout.num_chunks
    rows = layout.chunk_starts[:NT].long()[:, None] + torch.arange(C, device=layout.chunk_starts.device)
    valid = rows < layout.chunk_seq_ends[:NT].long()[:, None]
    return torch.where(valid, rows, 0), valid


def to_chunks(x: torch.Tensor, layout: ChunkLayout, C: int) -> torch.Tensor:
    """Token-major ``x [tokens, heads, ...]`` as chunk-major ``[NT, heads, C, ...]``, 0 past the end."""
    rows, valid = chunk_rows(layout, C)
    chunked = x[rows] * valid.view(*valid.shape, *([1] * (x.dim() - 1))).to(x.dtype)
    return chunked.transpose(1, 2)


def from_chunks(x_c: torch.Tensor, layout: ChunkLayout, C: int, tokens: int) -> torch.Tensor:
    """Chunk-major ``[NT, heads, C, ...]`` back to token-major, valid rows only (0 elsewhere)."""
    rows, valid = chunk_rows(layout, C)
    out = torch.zeros(tokens, *x_c.shape[1:2], *x_c.shape[3:], dtype=x_c.dtype, device=x_c.device)
    out[rows[valid]] = x_c.transpose(1, 2)[valid]
    return out


def log_decay(z: torch.Tensor, A: torch.Tensor, gate: int, lower_bound: float) -> torch.Tensor:
    """``a`` before the floor (softplus with torch's threshold 20, as the kernels)."""
    if gate == SOFTPLUS:
        return -A * F.softplus(z)
    return lower_bound * torch.sigmoid(A * z)


def gate_tail_reference(g, beta, A_log, dt_bias, dG_c, dbeta_c, layout, C, gate, beta_sigmoid, lower_bound, scale):
    """``(dg [tokens, HV, K], dbeta [tokens, HV], dA_rows [NT, HV, C], ddt_parts [NT, HV, K])`` in float64
    (``ddt_parts``: each chunk's valid rows of ``dg`` summed). Where the floor applies is decided on fp32
    values, as the kernels decide it (the values themselves are float64)."""
    tokens = g.shape[0]
    _, valid = chunk_rows(layout, C)
    keep = valid[:, None, :].to(F64)  # [NT, 1, C]
    da = dG_c.to(F64).flip(2).cumsum(2).flip(2)  # over all C rows: a tail row's G is the last token's
    live = torch.ones_like(da, dtype=torch.bool)
    part = torch.zeros_like(da)
    if gate == PREGATED:
        live = ~(to_chunks(g.float(), layout, C) < LOG_DECAY_FLOOR)
        dz = da
    else:
        z64, z32 = (to_chunks(g.to(dtype), layout, C) for dtype in (F64, torch.float32))
        if dt_bias is not None:
            z64, z32 = z64 + dt_bias.to(F64)[None, :, None], z32 + dt_bias.float()[None, :, None]
        A64, A32 = (A_log.to(dtype).exp()[None, :, None, None] for dtype in (F64, torch.float32))
        a = log_decay(z64, A64, gate, lower_bound)
        if gate != SAFE:
            live = ~(log_decay(z32, A32, gate, lower_bound) < LOG_DECAY_FLOOR)
        if gate == SOFTPLUS:
            dz = da * (-A64 * torch.sigmoid(z64))
            part = da * a
        else:
            s = torch.sigmoid(A64 * z64)
            dz = da * (lower_bound * A64 * s * (1 - s))
            part = dz * z64
    dz = torch.where(live, dz, 0.0)
    ddt_parts = (dz * keep[..., None]).sum(2)
    dA_rows = torch.where(live, part, 0.0).sum(-1) * keep
    db = dbeta_c.to(F64)
    if beta_sigmoid:
        s = torch.sigmoid(to_chunks(beta.to(F64), layout, C))
        db = db * (scale * s * (1 - s))
    dbeta = from_chunks(db[..., None], layout, C, tokens)[..., 0]
    return from_chunks(dz, layout, C, tokens), dbeta, dA_rows, ddt_parts


def qk_tail_reference(x_hat, rstd, dx_c, layout, C, l2norm):
    """``dx [tokens, H, K]`` in float64: the group's value heads summed, then the l2norm's backward."""
    tokens, H, K = x_hat.shape
    NT, HV = dx_c.shape[:2]
    total = dx_c.to(F64).view(NT, H, HV // H, C, K).sum(2)
    if l2norm:
        xh = to_chunks(x_hat.to(F64), layout, C)
        r = to_chunks(rstd.to(F64), layout, C)[..., None]
        total = r * (total - xh * (xh * total).sum(-1, keepdim=True))
    return from_chunks(total, layout, C, tokens)


# --- random inputs ------------------------------------------------------------------------------------------

LAYOUTS = {
    "dense": lambda C: (0, 2 * C + 9, 4 * C + 18),  # two sequences with ragged tails
    "varlen": lambda C: (0, C - 3, C - 3, C - 2, 3 * C + 5),  # an empty and a one-token sequence
}


def gate_inputs(C, K, HV, bounds, gate, has_dt_bias, dtypes=(torch.float32, torch.float32), device="cpu"):
    """Inputs of `gate_tail` where every branch is reached: softplus past its threshold 20, gates below the
    floor in every floored mode (the sigmoid gate with a bound below it), the safe gate within [-5, 0)."""
    layout = chunk_layout(bounds, C, torch.device(device))
    tokens, NT = bounds[-1], layout.num_chunks
    A_log = torch.randn(HV) * 0.5 + 0.5
    if gate == PREGATED:
        g = torch.where(
            torch.rand(tokens, HV, K) < 0.2, -40 * torch.rand(tokens, HV, K), F.logsigmoid(torch.randn(tokens, HV, K))
        )
    elif gate == SOFTPLUS:
        # a tenth of the inputs past the threshold 20, a tenth past the floor: A * softplus(x) > 32 needs x > 32 / A,
        # which a fixed offset misses for every head when the heads' A are all small (seed 1874668530: none floored)
        r, A = torch.rand(tokens, HV, K), A_log.exp()[None, :, None]
        g = torch.randn(tokens, HV, K) * 4 + torch.where(r < 0.1, 16.0, torch.where(r < 0.2, 16.0 + 32.0 / A, 0.0))
    else:
        g = torch.randn(tokens, HV, K) * 2
    lower_bound = {SIGMOID: -40.0, SAFE: -5.0}.get(gate, 0.0)
    dt_bias = torch.randn(HV, K) if has_dt_bias else None
    beta = torch.randn(tokens, HV)
    dG_c = torch.randn(NT, HV, C, K)
    dbeta_c = torch.randn(NT, HV, C)
    g_dtype, beta_dtype = dtypes
    return dict(
        g=g.to(g_dtype).to(device), beta=beta.to(beta_dtype).to(device), A_log=A_log.to(device),
        dt_bias=None if dt_bias is None else dt_bias.to(device), dG_c=dG_c.to(device), dbeta_c=dbeta_c.to(device),
        layout=layout, lower_bound=lower_bound,
    )  # fmt: skip


def qk_inputs(C, K, H, group, bounds, l2norm):
    """fp32 inputs of `qk_tail` on the CPU, for the references: x, its rows' r and x r (x without the l2norm)."""
    layout = chunk_layout(bounds, C, torch.device("cpu"))
    tokens, NT = bounds[-1], layout.num_chunks
    x = torch.randn(tokens, H, K) * 3
    rstd = torch.rsqrt((x * x).sum(-1) + L2NORM_EPS)
    x_hat = (x * rstd[..., None]) if l2norm else x
    dx_c = torch.randn(NT, H * group, C, K)
    return dict(x=x, x_hat=x_hat, rstd=rstd if l2norm else None, dx_c=dx_c, layout=layout)


def relative(got: torch.Tensor, want: torch.Tensor) -> float:
    assert not got.isnan().any(), "a NaN: an output left unwritten, or computed as one"
    return float((got.to(F64) - want.to(F64)).norm() / want.to(F64).norm().clamp_min(1e-30))


GATE_CASES = [
    (name, has_dt_bias, beta_sigmoid, scale)
    for name in GATES
    for has_dt_bias, beta_sigmoid in itertools.product((False, True), repeat=2)
    for scale in ((1.0, 2.0) if beta_sigmoid else (1.0,))
]


def gate_id(case) -> str:
    name, has_dt_bias, beta_sigmoid, scale = case
    return f"{name}{'-bias' if has_dt_bias else ''}{f'-sigmoid{scale:g}' if beta_sigmoid else ''}"


# --- the references from first principles -----------------------------------------------------------------


@pytest.mark.parametrize("gate_name", list(GATES))
@pytest.mark.parametrize("layout_name", list(LAYOUTS))
def test_the_gate_reference_is_the_gradient_of_the_forward(seed, gate_name, layout_name):
    """Autograd through the forward's gate (activation, floor, in-chunk cumulative sum with tail rows held at
    the last token's value, beta's sigmoid) gives what `gate_tail_reference` gives."""
    C, K, HV, gate = 16, 8, 2, GATES[gate_name]
    x = gate_inputs(C, K, HV, LAYOUTS[layout_name](C), gate, has_dt_bias=True)
    layout, lb, scale = x["layout"], x["lower_bound"], 2.0
    g, beta, A_log, dt_bias = (x[name].to(F64).requires_grad_() for name in ("g", "beta", "A_log", "dt_bias"))
    if gate == PREGATED:
        a = g
    else:
        a = log_decay(g + dt_bias, A_log.exp()[None, :, None], gate, lb)
    if gate != SAFE:
        a = torch.where(a < LOG_DECAY_FLOOR, LOG_DECAY_FLOOR, a)
    G = to_chunks(a, layout, C).cumsum(2)  # 0 past the end: G stays at the last token's value
    b = to_chunks(scale * torch.sigmoid(beta), layout, C)
    loss = (G * x["dG_c"].to(F64)).sum() + (b * x["dbeta_c"].to(F64)).sum()
    loss.backward()

    dg, dbeta, dA_rows, ddt_parts = gate_tail_reference(
        x["g"], x["beta"], x["A_log"], x["dt_bias"], x["dG_c"], x["dbeta_c"], layout, C, gate, True, lb, scale
    )
    # softplus' derivative past its threshold 20 is 1 in autograd, sigmoid(z) (1 - 2e-9 at 20) in the kernels
    torch.testing.assert_close(dg, g.grad, rtol=1e-7, atol=1e-10)
    torch.testing.assert_close(dbeta, beta.grad, rtol=1e-10, atol=1e-10)
    if gate == PREGATED:  # neither A_log nor dt_bias takes part
        assert (dA_rows == 0).all()
    else:
        # sums over tokens of terms of both signs, each within 1e-7 of autograd's (the softplus threshold
        # above): a sum is within 1e-7 of the size of its terms, not of itself (at seed 1302676806 a dt_bias
        # sum was 5.6e-11 of its terms' size off, and 1.08e-7 of itself: its terms cancelled)
        for sums, terms, want in (
            (dA_rows.sum((0, 2)), dA_rows.abs().sum((0, 2)), A_log.grad),
            (dg.sum(0), dg.abs().sum(0), dt_bias.grad),
            (ddt_parts.sum(0), dg.abs().sum(0), dt_bias.grad),
        ):
            assert ((sums - want).abs() <= 1e-7 * terms + 1e-10).all(), (sums, want)
    if gate != SAFE:  # the inputs reach the floor, where the gradient is 0
        assert (dg == 0).any() and (dg != 0).any()


@pytest.mark.parametrize("layout_name", list(LAYOUTS))
def test_the_qk_reference_is_the_gradient_of_the_l2norm(seed, layout_name):
    C, K, H, group = 16, 8, 2, 2
    bounds = LAYOUTS[layout_name](C)
    layout = chunk_layout(bounds, C, torch.device("cpu"))
    x = (torch.randn(bounds[-1], H, K, dtype=F64) * 3).requires_grad_()
    rstd = torch.rsqrt((x * x).sum(-1) + L2NORM_EPS)
    x_hat = x * rstd[..., None]
    dx_c = torch.randn(layout.num_chunks, H * group, C, K, dtype=F64)
    (to_chunks(x_hat, layout, C).repeat_interleave(group, dim=1) * dx_c).sum().backward()
    dx = qk_tail_reference(x_hat.detach(), rstd.detach(), dx_c, layout, C, l2norm=True)
    torch.testing.assert_close(dx, x.grad, rtol=1e-10, atol=1e-10)


# --- the references against the helion kernels, in Helion's interpreter ---------------------------------------


@pytest.fixture
def helion_interpreter(monkeypatch):
    """Helion's tails on CPU tensors in its interpreter (Helion reads the switch when a kernel object is made;
    `runtime` keeps kernel objects per setting)."""
    pytest.importorskip("helion", reason="Helion is not installed")
    from kda.backends.helion import runtime as helion_runtime

    if helion_runtime.helion_problem() is not None:
        pytest.skip(str(helion_runtime.helion_problem()))
    monkeypatch.setenv("HELION_INTERPRET", "1")

    def launch(fn, *args) -> None:
        helion_runtime.launch(fn, "ieee", args, None)  # type: ignore[arg-type]  # the interpreter needs no key

    return launch


@pytest.mark.parametrize("case", GATE_CASES, ids=gate_id)
@pytest.mark.parametrize("layout_name", list(LAYOUTS))
def test_the_gate_reference_matches_helion(seed, helion_interpreter, case, layout_name):
    from kda.backends.helion.tails import gate_tail_kernel

    name, has_dt_bias, beta_sigmoid, scale = case
    C, K, HV, gate = 16, 16, 2, GATES[name]
    x = gate_inputs(C, K, HV, LAYOUTS[layout_name](C), gate, has_dt_bias)
    layout, lb = x["layout"], x["lower_bound"]
    tokens, NT = x["g"].shape[0], layout.num_chunks
    dg = torch.full((tokens, HV, K), math.nan)
    dbeta = torch.full((tokens, HV), math.nan)
    dA_rows = torch.full((NT, HV, C), math.nan)
    helion_interpreter(
        gate_tail_kernel, x["g"], x["beta"], x["A_log"], x["dt_bias"] if has_dt_bias else x["dG_c"],
        x["dG_c"], x["dbeta_c"], layout.chunk_starts, layout.chunk_seq_ends, dg, dbeta, dA_rows,
        lb, scale, C, gate, has_dt_bias, beta_sigmoid,
    )  # fmt: skip
    want = gate_tail_reference(
        x["g"], x["beta"], x["A_log"], x["dt_bias"], x["dG_c"], x["dbeta_c"], layout, C, gate, beta_sigmoid, lb, scale
    )
    for what, got, reference in zip(("dg", "dbeta", "dA_rows"), (dg, dbeta, dA_rows), want[:3], strict=True):
        assert relative(got, reference) <= 1e-5, what


@pytest.mark.parametrize("l2norm", [True, False])
@pytest.mark.parametrize("group", [1, 2])
@pytest.mark.parametrize("layout_name", list(LAYOUTS))
def test_the_qk_reference_matches_helion(seed, helion_interpreter, l2norm, group, layout_name):
    from kda.backends.helion.tails import qk_tail_kernel

    C, K, H = 16, 16, 2
    x = qk_inputs(C, K, H, group, LAYOUTS[layout_name](C), l2norm)
    layout = x["layout"]
    dx = torch.full(x["x_hat"].shape, math.nan)
    rstd = x["rstd"] if l2norm else x["dx_c"]
    # the helion tail takes the rows as given and their scales (it normalizes them itself)
    helion_interpreter(
        qk_tail_kernel, x["x"], rstd, x["dx_c"], layout.chunk_starts, layout.chunk_seq_ends, dx, group, C, l2norm
    )
    assert relative(dx, qk_tail_reference(x["x_hat"], x["rstd"], x["dx_c"], layout, C, l2norm)) <= 1e-5


# --- lowering on the CPU --------------------------------------------------------------------------------------

CHUNKS, HEAD_DIMS = (32, 64), (64, 128, 256)
DTYPES = ("bfloat16", "float16", "float32")
SHARED_LIMIT = 110 * 1024  # room for two blocks an H200 SM


def gate_params(C, K, case, n: int) -> tuple:
    name, has_dt_bias, beta_sigmoid, scale = case
    lower_bound = {SIGMOID: -3.0, SAFE: -5.0}.get(GATES[name], 0.0)
    g_dtype, beta_dtype = DTYPES[n % 3], DTYPES[(n + 1) % 3]  # the dtypes vary across the cases
    return (C, K, GATES[name], has_dt_bias, beta_sigmoid, g_dtype, beta_dtype, lower_bound, scale)


@functools.cache
def _lower(builder, params) -> tuple[str, int] | BaseException:
    try:
        artifact = runtime.lower(builder(*params))
    except Exception as error:  # reported by `check_lowered`, with the specialization
        return error
    return artifact.kernel_source, runtime.shared_memory_bytes(artifact)


def lower_all(jobs: list[tuple]) -> list[tuple[str, int]]:
    """Each ``(builder, params)`` lowered for sm_90a, side by side on the cores (lowering runs outside the
    GIL), and checked: it lowered, has no atomics (a fixed summation order), fits the shared memory budget,
    and launches `tails.threads_for` threads."""
    with concurrent.futures.ThreadPoolExecutor(os.cpu_count() or 1) as pool:
        results = list(pool.map(lambda job: _lower(*job), jobs))
    for (builder, params), result in zip(jobs, results, strict=True):
        if isinstance(result, BaseException):
            raise AssertionError(f"{builder.__name__}{params} did not lower") from result
        source, shared = result
        assert "__global__" in source and "atomic" not in source, params
        assert shared <= SHARED_LIMIT, (params, shared)
        found = re.search(r"__launch_bounds__\((\d+)", source)
        assert found and int(found.group(1)) == tails.threads_for(*params[:2]), params
    return results  # type: ignore[return-value]


SHAPES = list(itertools.product(CHUNKS, HEAD_DIMS))


def test_every_gate_mode_and_flag_lowers():
    """Every gate mode and flag combination at C = 64, K = 128; every C and K with one of them each."""
    jobs = [(tails.build_gate_tail, gate_params(64, 128, case, n)) for n, case in enumerate(GATE_CASES)]
    jobs += [(tails.build_gate_tail, gate_params(C, K, GATE_CASES[3 * n], n)) for n, (C, K) in enumerate(SHAPES)]
    lower_all(jobs)


def test_every_qk_tail_shape_lowers():
    jobs = [
        (tails.build_qk_tail, (C, K, ("bfloat16", "float16")[n % 2], n % 3 != 1)) for n, (C, K) in enumerate(SHAPES)
    ]
    jobs += [(tails.build_qk_tail, (64, 128, "bfloat16", l2norm)) for l2norm in (True, False)]
    lower_all(jobs)


@pytest.mark.slow
@pytest.mark.parametrize("C, K", SHAPES)
def test_every_specialization_lowers(C, K):
    """The whole cross product: every gate mode and flag combination and every qk_tail at each C and K
    (about a minute a shape on 2 cores)."""
    jobs = [(tails.build_gate_tail, gate_params(C, K, case, n)) for n, case in enumerate(GATE_CASES)]
    jobs += [
        (tails.build_qk_tail, (C, K, dtype, l2norm)) for dtype in ("bfloat16", "float16") for l2norm in (True, False)
    ]
    lower_all(jobs)


@pytest.mark.parametrize("K", HEAD_DIMS)
def test_the_reverse_sum_gives_each_key_column_one_thread(K):
    """The reverse sum runs in place down each column of dG in shared memory, so a column must belong to one
    thread: a column shared by two threads (an index ``threadIdx.x & (K - 1)``) races with itself."""
    ((source, _),) = lower_all([(tails.build_gate_tail, gate_params(64, K, GATE_CASES[0], 0))])
    stores = [
        line for line in source.splitlines() if line.lstrip().startswith("da_s[") and "= (carry[0] + block[0]);" in line
    ]
    assert stores, "the in-place reverse sum was not found in the lowered source"
    for line in stores:
        assert "threadIdx.x) &" not in line, line.strip()
        assert "- (r * " in line, line.strip()  # bottom up: the row falls as r rises


# --- the compiled kernels on a Hopper GPU ------------------------------------------------------------------------


def dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


@pytest.mark.gpu
@pytest.mark.parametrize("case", GATE_CASES, ids=gate_id)
@pytest.mark.parametrize("C, K", [(64, 128), (32, 64), (64, 256), (32, 256), (64, 64)])
@pytest.mark.parametrize("layout_name", list(LAYOUTS))
@pytest.mark.usefixtures("hopper")
def test_the_gate_tail_on_the_gpu(seed, case, C, K, layout_name):
    name, has_dt_bias, beta_sigmoid, scale = case
    HV, gate = 3, GATES[name]
    dtypes = (torch.bfloat16, torch.float16) if C == 64 else (torch.float32, torch.bfloat16)
    x = gate_inputs(C, K, HV, LAYOUTS[layout_name](C), gate, has_dt_bias, dtypes, device="cuda")
    layout, lb = x["layout"], x["lower_bound"]
    tokens, NT = x["g"].shape[0], layout.num_chunks
    params = (C, K, gate, has_dt_bias, beta_sigmoid, dtype_name(dtypes[0]), dtype_name(dtypes[1]), lb, scale)
    (kernel,) = runtime.compile_all([(tails.build_gate_tail, params)])
    dg = torch.full((tokens, HV, K), math.nan, dtype=dtypes[0], device="cuda")  # in g's dtype
    dbeta = torch.full((tokens, HV), math.nan, dtype=dtypes[1], device="cuda")
    dA_rows = torch.full((NT, HV, C), math.nan, device="cuda")
    placeholder = torch.zeros(1, device="cuda")
    parts = has_dt_bias and gate != PREGATED  # dt_bias is an in-kernel gate's
    ddt_parts = torch.full((NT, HV, K), math.nan, device="cuda") if parts else placeholder
    kernel(
        x["g"], x["beta"], x["A_log"], x["dt_bias"] if has_dt_bias else placeholder, x["dG_c"], x["dbeta_c"],
        layout.chunk_starts, layout.chunk_seq_ends, dg, dbeta, dA_rows, ddt_parts,
    )  # fmt: skip
    torch.cuda.synchronize()
    want = gate_tail_reference(
        x["g"], x["beta"], x["A_log"], x["dt_bias"], x["dG_c"], x["dbeta_c"], layout, C, gate, beta_sigmoid, lb, scale
    )
    rounded = {torch.float32: 1e-6, torch.float16: 1e-3, torch.bfloat16: 1e-2}  # the output's own rounding
    limits = {"dg": max(1e-5, rounded[dtypes[0]]), "dbeta": rounded[dtypes[1]], "dA_rows": 1e-5, "ddt_parts": 1e-5}
    names, got = ["dg", "dbeta", "dA_rows"], [dg, dbeta, dA_rows]
    if parts:
        names, got = [*names, "ddt_parts"], [*got, ddt_parts]
    for what, value, reference in zip(names, got, want, strict=False):
        assert relative(value, reference) <= limits[what], (what, relative(value, reference))


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("l2norm", [True, False])
@pytest.mark.parametrize("group", [1, 2])
@pytest.mark.parametrize("C, K", [(64, 128), (32, 64), (64, 256), (32, 256), (64, 64)])
@pytest.mark.parametrize("layout_name", list(LAYOUTS))
@pytest.mark.usefixtures("hopper")
def test_the_qk_tail_on_the_gpu(seed, dtype, l2norm, group, C, K, layout_name):
    H = 2
    bounds = LAYOUTS[layout_name](C)
    layout = chunk_layout(bounds, C, torch.device("cuda"))
    given, rstd, rows = inputs_and_scales((bounds[-1], H, K), dtype, l2norm)  # x as given, r, and x r
    dx_c = torch.randn(layout.num_chunks, H * group, C, K, device="cuda")
    (kernel,) = runtime.compile_all([(tails.build_qk_tail, (C, K, dtype_name(dtype), l2norm))])
    dx = torch.full(given.shape, math.nan, dtype=dtype, device="cuda")
    kernel(given.cuda(), rstd.cuda(), dx_c, layout.chunk_starts, layout.chunk_seq_ends, dx)
    torch.cuda.synchronize()
    want = qk_tail_reference(rows.cuda(), rstd.cuda() if l2norm else None, dx_c, layout, C, l2norm)
    assert relative(dx, want) <= 1e-2
