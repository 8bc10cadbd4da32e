"""The `torch` backend against the float64 reference: forward and every gradient, over the whole contract.

Every call goes through `kda.chunk_kda(..., backend="torch")` inside `kda.trace_routes()`, and each test
asserts the routes name "torch" for forward (and backward when training): a test must prove which backend
ran. Around every call: outputs must be finite (NaN never passes), ``o`` has q's dtype and the final
state is float32, inputs are unmodified, and ``.grad`` is set exactly on the tensors that require grad.
Errors are relative L2 against `kda_reference` in float64, with `kda.verify.check.tolerance` (never
widened). Inputs are drawn by hand (`draw`) or through `kda.verify.cases.make_inputs`, from the `seed`
fixture (a fresh seed per run).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, fields
from typing import Any

import nonfinite
import pytest
import torch
import torch.nn.functional as F

import kda
from kda.backends.base import KDAInputs, KDAOutputs
from kda.backends.torch import TorchBackend, torch_kda
from kda.reference import kda_reference
from kda.spec import CaseClass, GateMode, KDASpec
from kda.verify.cases import VerificationCase, make_inputs
from kda.verify.check import relative_error, tolerance

DIFFERENTIABLE = ("q", "k", "v", "g", "beta", "A_log", "dt_bias", "initial_state")
GRAD_NAME = {
    "q": "dq",
    "k": "dk",
    "v": "dv",
    "g": "dg",
    "beta": "dbeta",
    "A_log": "dA_log",
    "dt_bias": "ddt_bias",
    "initial_state": "dinitial_state",
}
DTYPE_NAME = {torch.bfloat16: "bfloat16", torch.float16: "float16", torch.float32: "float32"}


# ----------------------------------------------------------------------------------------------- inputs by hand


@dataclass(frozen=True)
class Cfg:
    """One hand-built call. Defaults: fp32, pregated, l2norm in kernel, beta given, MHA, both states."""

    dtype: torch.dtype = torch.float32
    g_dtype: torch.dtype | None = None  # None: q's dtype
    gate: str = "pregated"  # pregated | softplus | safe
    regime: str = "realistic"  # realistic | extreme
    lower_bound: float | None = None  # safe gate only
    no_A_log: bool = False  # safe gate with A_log=None
    dt_2d: bool = False  # dt_bias as [HV, K]
    l2: bool = True
    beta: str = "given"  # given | sigmoid | sigmoid2
    B: int = 2
    T: int = 45
    H: int = 2
    group: int = 1  # HV = H * group
    K: int = 16
    V: int = 8
    seq_lens: tuple[int, ...] | None = None  # varlen when set (B = 1)
    cu_dtype: torch.dtype = torch.int32
    cu_cpu: bool = False  # also pass cu_seqlens_cpu
    h0: bool = True
    ht: bool = True
    vk: bool = False  # state_v_first
    chunk: int = 32
    scale: float | None = None
    frozen: tuple[str, ...] = ()  # differentiable inputs passed without requires_grad

    @property
    def HV(self) -> int:
        return self.H * self.group


def draw(cfg: Cfg, training: bool = True) -> tuple[dict[str, Any], dict[str, torch.Tensor]]:
    """Random inputs for `chunk_kda(**kwargs)` and upstream gradients, from the global (seeded) RNG."""
    varlen = cfg.seq_lens is not None
    B, T = (1, sum(cfg.seq_lens)) if varlen else (cfg.B, cfg.T)
    H, HV, K, V = cfg.H, cfg.HV, cfg.K, cfg.V
    extreme = cfg.regime == "extreme"
    q, k = torch.randn(B, T, H, K), torch.randn(B, T, H, K)
    if not cfg.l2:  # keep the recurrence contractive: the model normalised k itself
        q, k = F.normalize(q, dim=-1), F.normalize(k, dim=-1)
    v = torch.randn(B, T, HV, V)
    beta = torch.rand(B, T, HV) * 0.9 + 0.05 if cfg.beta == "given" else torch.randn(B, T, HV) * 1.5
    kw: dict[str, Any] = {}
    if cfg.gate == "pregated":
        # extreme: -2..-6 per step, so a 32-token chunk decays by ~130 and a 64-token one by ~250
        g = -(torch.rand(B, T, HV, K) * 4 + 2) if extreme else F.logsigmoid(torch.randn(B, T, HV, K) * 1.5 + 1)
    else:
        kw["use_gate_in_kernel"] = True
        g = torch.randn(B, T, HV, K) * (8.0 if extreme else 1.0)  # extreme: large |g + dt_bias|
        A_log = torch.rand(HV) * 2 + 1 if extreme else torch.rand(HV) * math.log(8.0)
        if cfg.gate == "softplus":
            dt_bias = torch.rand(HV, K) * 3 - 5 if not extreme else torch.randn(HV, K) * 4
        else:
            dt_bias = torch.randn(HV, K) * 0.5
            kw["safe_gate"] = True
            kw["lower_bound"] = -5.0 if cfg.lower_bound is None else cfg.lower_bound
        kw["dt_bias"] = dt_bias if cfg.dt_2d else dt_bias.reshape(-1)
        if not cfg.no_A_log:
            kw["A_log"] = A_log
    kw.update(
        q=q.to(cfg.dtype),
        k=k.to(cfg.dtype),
        v=v.to(cfg.dtype),
        g=g.to(cfg.g_dtype or cfg.dtype),
        beta=beta.to(cfg.dtype),
        use_qk_l2norm_in_kernel=cfg.l2,
        use_beta_sigmoid_in_kernel=cfg.beta != "given",
        allow_neg_eigval=cfg.beta == "sigmoid2",
        output_final_state=cfg.ht,
        state_v_first=cfg.vk,
        chunk_size=cfg.chunk,
    )
    if cfg.scale is not None:
        kw["scale"] = cfg.scale
    N = len(cfg.seq_lens) if varlen else B
    state_shape = (N, HV, V, K) if cfg.vk else (N, HV, K, V)
    if varlen:
        bounds = [0]
        for n in cfg.seq_lens:
            bounds.append(bounds[-1] + n)
        kw["cu_seqlens"] = torch.tensor(bounds, dtype=cfg.cu_dtype)
        if cfg.cu_cpu:
            kw["cu_seqlens_cpu"] = torch.tensor(bounds, dtype=cfg.cu_dtype)
    if cfg.h0:
        kw["initial_state"] = torch.randn(*state_shape) * 0.5
    if training:
        for name in DIFFERENTIABLE:
            if name in kw and name not in cfg.frozen:
                kw[name].requires_grad_(True)
    upstream = {"do": torch.randn(B, T, HV, V).to(cfg.dtype)}
    if cfg.ht:
        upstream["dfinal_state"] = torch.randn(*state_shape)
    return kw, upstream


# ----------------------------------------------------------------------------------------------- the check


def reference(kwargs: dict[str, Any], upstream: dict[str, torch.Tensor], wanted: list[str]):
    """float64 outputs and gradients (for the inputs named in `wanted`) of the naive recurrence."""
    ref_kw, leaves = {}, {}
    for name, value in kwargs.items():
        if name in ("chunk_size", "cu_seqlens_cpu"):
            continue
        if isinstance(value, torch.Tensor) and name != "cu_seqlens":
            value = value.detach().double().requires_grad_(name in wanted)
            if name in wanted:
                leaves[name] = value
        ref_kw[name] = value
    with torch.enable_grad():
        o, state = kda_reference(**ref_kw)
    result = {"o": o.detach(), "final_state": None if state is None else state.detach()}
    if leaves:
        outs, seeds = [o], [upstream["do"].double()]
        if state is not None:
            outs.append(state)
            seeds.append(upstream["dfinal_state"].double())
        grads = torch.autograd.grad(outs, list(leaves.values()), seeds, allow_unused=True)
        for name, grad in zip(leaves, grads):
            result[GRAD_NAME[name]] = torch.zeros_like(leaves[name]) if grad is None else grad
    return result


def run_torch(kwargs: dict[str, Any], upstream: dict[str, torch.Tensor] | None):
    """`chunk_kda(backend="torch")` with every structural assertion; returns outputs and `.grad`s."""
    training = upstream is not None and any(
        isinstance(kwargs.get(n), torch.Tensor) and kwargs[n].requires_grad for n in DIFFERENTIABLE
    )
    snapshot = {n: t.detach().clone() for n, t in kwargs.items() if isinstance(t, torch.Tensor)}
    q = kwargs["q"]
    with kda.trace_routes() as routes:
        o, state = kda.chunk_kda(**kwargs, backend="torch")
        if training:
            outs, seeds = [o], [upstream["do"]]
            if state is not None:
                outs.append(state)
                seeds.append(upstream["dfinal_state"])
            torch.autograd.backward(outs, seeds)
    # the torch backend ran, forward and (when training) backward, for a training case class
    phases = [(r.backend, r.phase) for r in routes]
    assert phases == ([("torch", "forward"), ("torch", "backward")] if training else [("torch", "forward")]), routes
    assert all(r.case_class.endswith("/train" if training else "/fwd") for r in routes), routes
    # dtypes, shapes, NaN never passes
    B, T, HV, V = q.shape[0], q.shape[1], kwargs["v"].shape[2], kwargs["v"].shape[3]
    assert o.dtype == q.dtype and o.shape == (B, T, HV, V)
    assert torch.isfinite(o).all(), "o has NaN/inf"
    if kwargs.get("output_final_state"):
        assert state is not None and state.dtype == torch.float32
        assert torch.isfinite(state).all(), "final_state has NaN/inf"
    else:
        assert state is None
    # nothing the caller passed was modified
    for name, before in snapshot.items():
        assert torch.equal(before, kwargs[name].detach()), f"{name} was modified by the call"
    got = {"o": o.detach(), "final_state": None if state is None else state.detach()}
    # .grad exactly on the tensors that require grad
    for name in DIFFERENTIABLE:
        t = kwargs.get(name)
        if t is None:
            continue
        if training and t.requires_grad:
            assert t.grad is not None, f"{name}.grad missing"
            assert t.grad.dtype == t.dtype and t.grad.shape == t.shape, name
            assert torch.isfinite(t.grad).all(), f"d{name} has NaN/inf"
            got[GRAD_NAME[name]] = t.grad
        else:
            assert t.grad is None, f"{name} does not require grad but got .grad"
    for name in ("cu_seqlens", "cu_seqlens_cpu"):
        if kwargs.get(name) is not None:
            assert kwargs[name].grad is None
    return got


def check(kwargs: dict[str, Any], upstream: dict[str, torch.Tensor] | None, dtype_name: str | None = None):
    """Run the torch backend and the reference and compare every output and gradient."""
    dtype_name = dtype_name or DTYPE_NAME[kwargs["q"].dtype]
    wanted = (
        []
        if upstream is None
        else [n for n in DIFFERENTIABLE if isinstance(kwargs.get(n), torch.Tensor) and kwargs[n].requires_grad]
    )
    got = run_torch(kwargs, upstream)
    ref = reference(kwargs, upstream or {}, wanted)
    compared = []
    for name, r in ref.items():
        if r is None:
            continue
        assert name in got, f"{name} missing from the torch backend's results"
        err = relative_error(got[name], r)
        tol = tolerance(name, dtype_name)
        assert err <= tol, f"{name}: relative error {err:.3e} > tol {tol:.0e}"
        compared.append(name)
    expected = {"o"} | ({"final_state"} if kwargs.get("output_final_state") else set()) | {GRAD_NAME[n] for n in wanted}
    assert set(compared) == expected
    return got, ref


# ----------------------------------------------------------------------------------------------- the contract, feature by feature

GATES = {
    "pregated": Cfg(gate="pregated"),
    "pregated-strong-decay": Cfg(gate="pregated", regime="extreme", T=100),
    "pregated-strong-decay-c64-bf16": Cfg(gate="pregated", regime="extreme", T=130, chunk=64, dtype=torch.bfloat16),
    "softplus": Cfg(gate="softplus", dtype=torch.bfloat16),
    "softplus-extreme": Cfg(gate="softplus", regime="extreme", T=70),
    "softplus-extreme-fp16-2d": Cfg(gate="softplus", regime="extreme", dtype=torch.float16, dt_2d=True, chunk=64, T=70),
    "safe-lb-5": Cfg(gate="safe", lower_bound=-5.0, dtype=torch.bfloat16),
    "safe-lb-5-extreme": Cfg(gate="safe", lower_bound=-5.0, regime="extreme", T=70),
    "safe-lb-near-0": Cfg(gate="safe", lower_bound=-0.01, dtype=torch.float16),
    "safe-lb-near-0-extreme": Cfg(gate="safe", lower_bound=-0.01, regime="extreme"),
    "safe-no-A_log": Cfg(gate="safe", lower_bound=-5.0, no_A_log=True, dt_2d=True),
    "safe-no-A_log-bf16-extreme": Cfg(
        gate="safe", lower_bound=-2.0, no_A_log=True, regime="extreme", dtype=torch.bfloat16
    ),
}


@pytest.mark.parametrize("name", list(GATES))
def test_gate_modes(name, seed):
    check(*draw(GATES[name]))


FLAGS = [(l2, beta) for l2 in (True, False) for beta in ("given", "sigmoid", "sigmoid2")]


@pytest.mark.parametrize("l2,beta", FLAGS, ids=[f"{'l2' if a else 'nol2'}-{b}" for a, b in FLAGS])
def test_qk_l2norm_and_beta_modes(l2, beta, seed):
    gate = "safe" if beta == "sigmoid" else "softplus" if beta == "sigmoid2" else "pregated"
    dtype = torch.bfloat16 if l2 else torch.float32
    check(*draw(Cfg(l2=l2, beta=beta, gate=gate, dtype=dtype)))


def test_l2norm_flag_is_applied(seed):
    """Unnormalised q, k with l2norm off give a different answer than with it on (so the flag is real),
    and each matches the reference."""
    kw, _up = draw(Cfg(l2=True, h0=False, ht=True), training=False)
    q, k = kw["q"] * 3, kw["k"] * 0.5
    on, _ = check({**kw, "q": q, "k": k}, None)
    off_kw = {**kw, "q": F.normalize(q, dim=-1), "k": F.normalize(k, dim=-1), "use_qk_l2norm_in_kernel": False}
    off, _ = check(off_kw, None)
    assert relative_error(on["o"], off["o"].double()) < 1e-4  # normalising first is the same function
    raw, _ = check({**kw, "q": q, "k": F.normalize(k, dim=-1), "use_qk_l2norm_in_kernel": False}, None)
    assert relative_error(raw["o"], on["o"].double()) > 0.1


VARLEN = {
    "int32": Cfg(seq_lens=(37, 1, 0, 33, 20), cu_dtype=torch.int32, B=1),
    "int64-cpu-copy": Cfg(seq_lens=(37, 1, 0, 33, 20), cu_dtype=torch.int64, cu_cpu=True, B=1),
    "int32-cpu-copy-gva-vk": Cfg(
        seq_lens=(0, 45, 1, 19),
        cu_dtype=torch.int32,
        cu_cpu=True,
        group=2,
        vk=True,
        dtype=torch.bfloat16,
        gate="safe",
        lower_bound=-5.0,
        beta="sigmoid",
    ),
    "int64-c64-softplus": Cfg(
        seq_lens=(70, 0, 1, 29),
        cu_dtype=torch.int64,
        chunk=64,
        gate="softplus",
        dtype=torch.float16,
        beta="sigmoid2",
        l2=False,
    ),
    "int32-no-state": Cfg(seq_lens=(5, 0, 40), h0=False, ht=False, cu_dtype=torch.int32, regime="extreme"),
    # no initial state: the empty sequences end at a zero state
    "int64-final-state-only": Cfg(seq_lens=(0, 40, 1, 0, 7), h0=False, ht=True, group=2, cu_dtype=torch.int64),
}


@pytest.mark.parametrize("name", list(VARLEN))
def test_varlen(name, seed):
    check(*draw(VARLEN[name]))


STATES = [
    (True, True, False),
    (True, True, True),
    (True, False, True),
    (False, True, True),
    (False, True, False),
    (False, False, False),
    (True, False, False),
]


@pytest.mark.parametrize("h0,ht,vk", STATES, ids=[f"h0={a}-ht={b}-vk={c}" for a, b, c in STATES])
def test_state_layouts(h0, ht, vk, seed):
    cfg = Cfg(h0=h0, ht=ht, vk=vk, K=16, V=8, group=2, gate="safe", lower_bound=-5.0, T=40)
    check(*draw(cfg))


def test_state_layouts_agree(seed):
    """The same call in both layouts: final states are transposes of each other, outputs are equal."""
    kw, _up = draw(Cfg(K=16, V=8, vk=False), training=False)
    kv, _ = check(kw, None)
    vk_kw = {**kw, "state_v_first": True, "initial_state": kw["initial_state"].transpose(-1, -2).contiguous()}
    vk, _ = check(vk_kw, None)
    assert vk["final_state"].shape == kv["final_state"].transpose(-1, -2).shape
    assert torch.allclose(vk["final_state"], kv["final_state"].transpose(-1, -2), rtol=1e-5, atol=1e-6)
    assert torch.allclose(vk["o"], kv["o"], rtol=1e-5, atol=1e-6)


SHAPES = [(32, 1), (32, 31), (32, 33), (32, 96), (64, 63), (64, 65), (64, 150)]


@pytest.mark.parametrize("chunk,T", SHAPES, ids=[f"c{c}-T{t}" for c, t in SHAPES])
def test_chunk_size_and_ragged_T(chunk, T, seed):
    check(*draw(Cfg(chunk=chunk, T=T, gate="softplus", beta="sigmoid", B=1 if T > 100 else 2)))


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32], ids=DTYPE_NAME.get)
@pytest.mark.parametrize("group", [1, 2], ids=["mha", "gva"])
def test_dtypes_and_heads(dtype, group, seed):
    check(*draw(Cfg(dtype=dtype, group=group, gate="safe", lower_bound=-5.0, beta="sigmoid", vk=group == 2)))


@pytest.mark.parametrize("g_dtype", [torch.float32, torch.float16])
def test_gate_input_dtype_differs_from_q(g_dtype, seed):
    kw, up = draw(Cfg(dtype=torch.bfloat16, g_dtype=g_dtype, gate="softplus", group=2))
    assert kw["g"].dtype == g_dtype and kw["q"].dtype == torch.bfloat16
    got, _ = check(kw, up)
    assert got["o"].dtype == torch.bfloat16 and got["dg"].dtype == g_dtype


def test_beta_dtype_differs_from_q(seed):
    """beta may come in fp32 with bf16 q (its gradient keeps beta's dtype)."""
    kw, up = draw(Cfg(dtype=torch.bfloat16, beta="sigmoid", gate="safe", lower_bound=-5.0))
    kw["beta"] = kw["beta"].detach().float().requires_grad_(True)
    got, _ = check(kw, up)
    assert got["dbeta"].dtype == torch.float32 and got["o"].dtype == torch.bfloat16


def test_head_dim_64(seed):
    check(
        *draw(Cfg(K=64, V=64, B=1, T=80, chunk=64, gate="safe", lower_bound=-5.0, beta="sigmoid", dtype=torch.bfloat16))
    )


def test_explicit_scale(seed):
    kw, up = draw(Cfg(scale=0.37))
    got, _ = check(kw, up)
    default, _ = check(
        {**{n: t.detach() if isinstance(t, torch.Tensor) else t for n, t in kw.items()}, "scale": None}, None
    )
    assert relative_error(got["o"], default["o"].double()) > 0.1  # 0.37 != 16 ** -0.5


FROZEN = [("v", "g", "beta", "k", "initial_state"), ("q", "k", "v", "g", "beta"), ("A_log",), ("dt_bias", "q")]


@pytest.mark.parametrize("frozen", FROZEN, ids=["-".join(f) for f in FROZEN])
def test_grad_only_for_tensors_that_require_it(frozen, seed):
    """Only some inputs require grad: exactly those get `.grad`, and their values are right."""
    cfg = Cfg(frozen=frozen, gate="softplus", T=40)
    kw, up = draw(cfg)
    assert any(kw[n].requires_grad for n in DIFFERENTIABLE if n in kw)
    check(kw, up)


def test_forward_only_under_no_grad(seed):
    """Inputs requiring grad under torch.no_grad(): a forward-only call, one forward route, no graph."""
    kw, _ = draw(Cfg(gate="safe", lower_bound=-1.0))
    with torch.no_grad(), kda.trace_routes() as routes:
        o, s = kda.chunk_kda(**kw, backend="torch")
    assert [(r.backend, r.phase) for r in routes] == [("torch", "forward")]
    assert routes[0].case_class.endswith("/fwd")
    assert o.grad_fn is None and not o.requires_grad and s.dtype == torch.float32
    ref = reference(kw, {}, [])
    assert relative_error(o, ref["o"]) <= tolerance("o", "float32")
    assert relative_error(s, ref["final_state"]) <= tolerance("final_state", "float32")


def test_forward_only_inputs(seed):
    """No input requires grad: forward route only, compared to the reference (bf16, varlen, GVA)."""
    kw, _ = draw(Cfg(dtype=torch.bfloat16, seq_lens=(50, 0, 1, 13), group=2, vk=True, gate="softplus"), training=False)
    check(kw, None)


# ----------------------------------------------------------------------------------------------- inputs from kda.verify.cases

CASES = [
    # (gate, qk_l2norm, beta, dtype, varlen, gva, h0, ht, vk, chunk, regime, K, V, seq_lens, g_dtype, 2d, noA)
    (
        "pregated",
        False,
        "given",
        "float32",
        False,
        True,
        True,
        True,
        False,
        32,
        "extreme",
        16,
        8,
        (93,),
        "float32",
        False,
        False,
    ),
    (
        "softplus",
        True,
        "sigmoid",
        "bfloat16",
        True,
        False,
        True,
        True,
        True,
        32,
        "extreme",
        16,
        8,
        (91, 1, 0, 33),
        "float32",
        True,
        False,
    ),
    (
        "safe",
        True,
        "sigmoid2",
        "float16",
        False,
        False,
        True,
        True,
        False,
        64,
        "extreme",
        8,
        16,
        (70,),
        "float16",
        False,
        False,
    ),
    (
        "safe",
        False,
        "sigmoid",
        "bfloat16",
        True,
        True,
        True,
        True,
        True,
        32,
        "near_zero_bound",
        16,
        8,
        (29, 0, 64, 5),
        "float32",
        True,
        True,
    ),
]


@pytest.mark.parametrize("case", CASES, ids=[f"{c[0]}-{c[10]}-{c[3]}" for c in CASES])
def test_verification_case_inputs(case, seed):
    gate, l2, beta, dtype, varlen, gva, h0, ht, vk, chunk, regime, K, V, lens, g_dtype, dt2d, noA = case
    cc = CaseClass(
        gate=GateMode(gate),
        qk_l2norm=l2,
        beta=beta,
        dtype=dtype,
        varlen=varlen,
        gva=gva,
        initial_state=h0,
        final_state=ht,
        state_v_first=vk,
        chunk_size=chunk,
        head_dim=64,
        training=True,
    )
    H = 2
    HV = 2 * H if gva else H
    B = 1 if varlen else 2
    seq_lens = lens if varlen else (lens[0],) * B
    vc = VerificationCase(
        cc, regime, B, H, HV, K, V, seq_lens, g_dtype, dt_bias_2d=dt2d, safe_without_A_log=noA, seed=seed
    )
    kw, up = make_inputs(vc, "cpu")
    if regime == "near_zero_bound":
        assert kw["lower_bound"] == -0.01
    for name in DIFFERENTIABLE:
        if name in kw:
            kw[name].requires_grad_(True)
    check(kw, up, dtype)


# ----------------------------------------------------------------------------------------------- poison


def test_writes_every_element_of_nan_poisoned_outputs(seed):
    """Given NaN-filled output buffers, the backend writes all of them (and returns those buffers)."""
    kw, _ = draw(Cfg(seq_lens=(37, 0, 1, 20), vk=True, group=2, dtype=torch.bfloat16), training=False)
    spec = KDASpec.from_call(**kw)
    inputs = KDAInputs(**{f.name: kw.get(f.name) for f in fields(KDAInputs)})
    out = KDAOutputs(
        o=torch.full((1, 58, 4, 8), float("nan"), dtype=torch.bfloat16),
        final_state=torch.full(spec.state_shape, float("nan")),
    )
    result = TorchBackend().forward(inputs, spec, out)
    assert result.o.data_ptr() == out.o.data_ptr()
    assert result.final_state.data_ptr() == out.final_state.data_ptr()
    assert torch.isfinite(out.o).all() and torch.isfinite(out.final_state).all()
    ref = reference(kw, {}, [])
    assert relative_error(out.o, ref["o"]) <= tolerance("o", "bfloat16")
    assert relative_error(out.final_state, ref["final_state"]) <= tolerance("final_state", "bfloat16")


@pytest.mark.parametrize("varlen", [False, True], ids=["dense", "varlen"])
def test_nan_in_one_sequence_stays_there(varlen, seed):
    """A NaN in one sequence's values reaches only that sequence's outputs and final state (so sequences
    and batch rows never mix through chunk padding), and the others are unchanged."""
    cfg = Cfg(seq_lens=(37, 20, 0, 9) if varlen else None, B=3, T=37, chunk=32)
    kw, _ = draw(cfg, training=False)
    clean = run_torch(kw, None)
    v = kw["v"].clone()
    if varlen:
        v[0, 40] = float("nan")  # token 3 of sequence 1 (rows 37..56)
    else:
        v[1, 5] = float("nan")  # batch row 1
    with kda.trace_routes() as routes:
        o, s = kda.chunk_kda(**{**kw, "v": v}, backend="torch")
    assert [r.backend for r in routes] == ["torch"]
    if varlen:
        for rows in (slice(0, 37), slice(57, 66)):
            assert torch.equal(o[:, rows], clean["o"][:, rows])
        assert torch.isnan(o[:, 40:57]).any()
        for n in (0, 2, 3):
            assert torch.equal(s[n], clean["final_state"][n])
        assert torch.isnan(s[1]).any()
    else:
        for b in (0, 2):
            assert torch.equal(o[b], clean["o"][b]) and torch.equal(s[b], clean["final_state"][b])
        assert torch.isnan(o[1, 5:]).any()
        assert torch.isnan(s[1]).any()


# ----------------------------------------------------------------------------------------------- structural identities


def test_chunk_size_does_not_change_the_result(seed):
    """Chunk 32 and chunk 64 compute the same function: outputs and gradients agree to fp32 precision."""
    kw, up = draw(Cfg(T=150, B=1, group=2, gate="safe", lower_bound=-5.0, beta="sigmoid", chunk=32))
    r32 = run_torch(kw, up)
    kw64 = {
        n: (t.detach().clone().requires_grad_(t.requires_grad) if isinstance(t, torch.Tensor) else t)
        for n, t in kw.items()
    }
    kw64["chunk_size"] = 64
    r64 = run_torch(kw64, up)
    assert (
        set(r32)
        == set(r64)
        == {"o", "final_state", "dq", "dk", "dv", "dg", "dbeta", "dA_log", "ddt_bias", "dinitial_state"}
    )
    for name in r32:
        err = relative_error(r32[name], r64[name].double())
        assert err < 2e-5, f"{name}: chunk 32 vs 64 differ by {err:.2e}"


def test_varlen_equals_separate_sequences(seed):
    """A varlen batch equals running each sequence as its own B=1 call (outputs, states and gradients);
    an empty sequence passes its initial state through, with d(initial_state) = d(final_state)."""
    lens = (45, 0, 1, 33)
    kw, up = draw(Cfg(seq_lens=lens, group=2, vk=True, gate="softplus", beta="sigmoid2", chunk=32))
    packed = run_torch(kw, up)
    bounds = [0, 45, 45, 46, 79]
    for n, length in enumerate(lens):
        if length == 0:
            assert torch.equal(packed["final_state"][n], kw["initial_state"][n].detach())
            assert torch.equal(packed["dinitial_state"][n], up["dfinal_state"][n])
            continue
        span = slice(bounds[n], bounds[n + 1])
        piece = {}
        for name, t in kw.items():
            if name in ("cu_seqlens", "cu_seqlens_cpu"):
                continue
            if name in ("q", "k", "v", "g", "beta"):
                t = t.detach()[:, span].clone().requires_grad_(True)
            elif name == "initial_state":
                t = t.detach()[n : n + 1].clone().requires_grad_(True)
            elif isinstance(t, torch.Tensor):
                t = t.detach().clone().requires_grad_(True)
            piece[name] = t
        alone = run_torch(piece, {"do": up["do"][:, span], "dfinal_state": up["dfinal_state"][n : n + 1]})
        pairs = {"o": packed["o"][:, span], "final_state": packed["final_state"][n : n + 1]}
        for name in ("dq", "dk", "dv", "dg", "dbeta"):
            pairs[name] = packed[name][:, span]
        pairs["dinitial_state"] = packed["dinitial_state"][n : n + 1]
        for name, value in pairs.items():
            err = relative_error(value, alone[name].double())
            assert err < 1e-5, f"sequence {n}, {name}: packed vs alone differ by {err:.2e}"


# ----------------------------------------------------------------------------------------------- gradcheck in float64


GRADCHECK = {
    "pregated": dict(gate="pregated"),
    "softplus": dict(gate="softplus"),
    "safe": dict(gate="safe"),
    "safe-no-A_log-vk": dict(gate="safe", no_A_log=True, vk=True),
    "softplus-varlen-gva": dict(gate="softplus", varlen=True, group=2),
}


@pytest.mark.parametrize("name", list(GRADCHECK))
def test_gradcheck_float64(name, seed):
    opts = GRADCHECK[name]
    gate, varlen, group, vk = opts["gate"], opts.get("varlen", False), opts.get("group", 1), opts.get("vk", False)
    H, K, V = 2 if group == 1 else 1, 4, 4
    HV = H * group
    B, T = (1, 11) if varlen else (1, 10)
    d = torch.float64
    leaves: dict[str, torch.Tensor] = {
        "q": torch.randn(B, T, H, K, dtype=d),
        "k": torch.randn(B, T, H, K, dtype=d),
        "v": torch.randn(B, T, HV, V, dtype=d),
        "beta": torch.randn(B, T, HV, dtype=d),
    }
    flags: dict[str, Any] = dict(
        use_qk_l2norm_in_kernel=True,
        use_beta_sigmoid_in_kernel=True,
        output_final_state=True,
        state_v_first=vk,
        chunk_size=32,
    )
    if gate == "pregated":
        leaves["g"] = -torch.rand(B, T, HV, K, dtype=d) * 0.5 - 0.05
    else:
        leaves["g"] = torch.randn(B, T, HV, K, dtype=d)
        flags["use_gate_in_kernel"] = True
        leaves["dt_bias"] = torch.randn(HV * K, dtype=d) * 0.5
        if not opts.get("no_A_log"):
            leaves["A_log"] = torch.rand(HV, dtype=d) * 0.5
        if gate == "safe":
            flags.update(safe_gate=True, lower_bound=-2.0)
    cu = torch.tensor([0, 4, 4, 5, 11], dtype=torch.int64) if varlen else None
    N = 4 if varlen else B
    leaves["initial_state"] = torch.randn(*((N, HV, V, K) if vk else (N, HV, K, V)), dtype=d) * 0.5
    spec = KDASpec.from_call(**{n: t.float() for n, t in leaves.items()}, cu_seqlens=cu, **flags)
    names = list(leaves)

    def fn(*tensors):
        inputs = KDAInputs(**dict(zip(names, tensors)), cu_seqlens=cu)
        o, state, _ = torch_kda(inputs, spec, compute_dtype=torch.float64)
        return o, state

    args = tuple(leaves[n].requires_grad_(True) for n in names)
    o, state = fn(*args)
    assert o.dtype == torch.float64 and state.shape == spec.state_shape
    # the function is the reference's, in float64 (so gradcheck checks gradients of the right function)
    ref_o, ref_s = kda_reference(
        **{n: t.detach() for n, t in leaves.items()},
        cu_seqlens=cu,
        **{f: v for f, v in flags.items() if f != "chunk_size"},
    )
    assert relative_error(o, ref_o) < 1e-10 and relative_error(state, ref_s) < 1e-10
    assert torch.autograd.gradcheck(fn, args, eps=1e-6, atol=1e-6, rtol=1e-4)


def test_autocast_around_the_call_changes_nothing(seed):
    """The torch backend computes in fp32 even inside a caller's autocast (and lazy verification too)."""
    B, T, H, K, V = 1, 40, 2, 16, 16
    q = torch.randn(B, T, H, K)
    k = F.normalize(torch.randn(B, T, H, K), dim=-1)
    v, beta = torch.randn(B, T, H, V), torch.rand(B, T, H)
    g = F.logsigmoid(torch.randn(B, T, H, K))
    plain, _ = kda.chunk_kda(q, k, v, g, beta, backend="torch")
    with torch.autocast("cpu", dtype=torch.bfloat16), kda.trace_routes() as routes:
        under_autocast, _ = kda.chunk_kda(q, k, v, g, beta, backend="torch")
    assert [r.backend for r in routes] == ["torch"]
    assert under_autocast.dtype == torch.float32
    assert torch.equal(plain, under_autocast)


@pytest.mark.parametrize("pinned", [True, False], ids=["found", "random"])
def test_saturated_softplus_gates_in_fp32_training(seed, pinned):
    """Log decays of -50 to -500 a token (a saturated softplus gate) push a chunk's cumulative decay to about
    -1000. Summed in fp32, its exponent differences and the reverse cumsum that autograd makes of the log
    decay's gradient lost enough that dA_log came out 1.97e-2 off on the first case (tolerance 1e-3; found by
    the triton backend's random cases); with Gamma in float64 it is ~1e-5."""
    from kda.verify.check import run_case

    cc = CaseClass(
        gate=GateMode.SOFTPLUS,
        qk_l2norm=False,
        beta="sigmoid",
        dtype="float32",
        varlen=False,
        gva=False,
        initial_state=True,
        final_state=True,
        state_v_first=False,
        chunk_size=64,
        head_dim=64,
        training=True,
    )
    case_seed = 1308272535 if pinned else seed
    case = VerificationCase(cc, "extreme", 1, 1, 1, 5, 31, (123,), "float32", seed=case_seed)
    result = run_case(TorchBackend(), case, "cpu")
    assert result.passed, (case_seed, result.reason, result.errors)
    assert result.errors["dA_log"] < 1e-4, (case_seed, result.errors)


# ----------------------------------------------------------------------------------------------- extreme decays

# One token whose log decay is far past exp's range, or -inf (a full reset). The pre-gated value itself; for the
# softplus gate, the gate input g (so g + dt_bias is huge and -exp(A_log) softplus(g + dt_bias) with it).
EXTREME_DECAYS = [
    ("pregated", -1e6),
    ("pregated", -1e30),
    ("pregated", torch.finfo(torch.float32).min),
    ("pregated", -math.inf),
    ("softplus", 1e30),
    ("softplus", torch.finfo(torch.float32).max),
]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=DTYPE_NAME.get)
@pytest.mark.parametrize("gate, value", EXTREME_DECAYS, ids=[f"{g}={v:g}" for g, v in EXTREME_DECAYS])
def test_extreme_log_decays_match_the_reference(gate, value, dtype, seed):
    """A per-token log decay below LOG_DECAY_FLOOR (-32) is computed as the floor: exp(-32) ~ 1.3e-14 is a
    reset to far within fp32's resolution, and the floor keeps a chunk's cumulative decay within 64 x 32, where
    the in-chunk differences stay exact. The float64 reference is exact (exp(-1e30) = exp(-inf) = 0); outputs
    and every gradient must match it. Before the floor: 1.19 off at -1e30, NaN everywhere at -inf."""
    kw, up = draw(Cfg(gate=gate, dtype=dtype, T=45, chunk=32, B=2))
    g = kw["g"].detach().clone()
    if gate == "softplus":  # a finite input (+inf is a non-finite one: its A_log gradient is 0 * inf = NaN)
        value = min(value, torch.finfo(g.dtype).max)
    g[:, 40] = value  # inside the second chunk, every head and channel
    g[0, 7, :, ::2] = value  # a partial reset (every other channel) in the first chunk of batch row 0
    if value == -1e30:  # and -inf at the other channels of a token of batch row 1 (a reset as the verifier makes it)
        g[1, 20, :, ::2], g[1, 20, :, 1::2] = -1e30, -math.inf
    kw["g"] = g.requires_grad_(True)
    got, _ = check(kw, up)
    assert torch.equal(got["dg"][:, 40], torch.zeros_like(got["dg"][:, 40]))  # the floor's gradient is 0


def test_a_log_decay_below_the_floor_is_the_floor(seed):
    """Below LOG_DECAY_FLOOR the backend computes the floor itself: -40 and -32 give the same bits."""
    from kda.reference import LOG_DECAY_FLOOR

    assert LOG_DECAY_FLOOR == -32.0
    kw, _ = draw(Cfg(gate="pregated", T=45), training=False)
    below, floor = kw["g"].clone(), kw["g"].clone()
    below[:, 3::5, :, ::3] = -40.0
    floor[:, 3::5, :, ::3] = LOG_DECAY_FLOOR
    o_below, s_below = kda.chunk_kda(**{**kw, "g": below}, backend="torch")
    o_floor, s_floor = kda.chunk_kda(**{**kw, "g": floor}, backend="torch")
    assert torch.equal(o_below, o_floor) and torch.equal(s_below, s_floor)
    check({**kw, "g": below}, None)  # and e^-40 against e^-32 is invisible against the reference


# ----------------------------------------------------------------------------------------------- non-finite inputs


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=DTYPE_NAME.get)
@pytest.mark.parametrize("name", nonfinite.INPUTS)
def test_a_nan_reaches_only_what_the_recurrence_reaches(name, dtype, seed):
    """A NaN in one input at one token inside a chunk: outputs before it, the other head and the other
    sequence are exactly as without it; everything the recurrence makes NaN is NaN (`tests/nonfinite.py`).
    Before: the chunk's earlier rows turned NaN too (0 * NaN in the in-chunk products)."""
    call, token = nonfinite.two_sequence_call(chunk=32, dtype=dtype, strong_decay=False, l2=True)

    def run(c: dict[str, Any]) -> tuple[torch.Tensor, torch.Tensor]:
        with kda.trace_routes() as routes:
            o, state = kda.chunk_kda(**c, backend="torch")
        assert [r.backend for r in routes] == ["torch"]
        return o, state

    nonfinite.check_nan_stays_causal(run, call, name, token, bitwise_before=True)
