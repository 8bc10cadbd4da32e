"""Verification of the decode op (`fused_recurrent_kda`): cases, one case's check, a class's check, the grid.

A case is a decode case class plus concrete sizes, a gate regime and a fresh seed. Its inputs are random
and never zero (`kda.verify.cases`' regimes: realistic gates, saturated ones with a large ``exp(A_log)``,
a full reset ``g = -inf``, a bound near 0). A pool case has a pool of more slots than sequences, in a
random permutation, with a padding row (negative slot); per-token cases also skip some writes (negative
entries) and draw ``num_accepted_tokens`` at random. Varlen cases include an empty sequence.

What a case checks, against `kda.recurrent.reference` in float64 (the backend called directly, never
through the dispatcher):

- ``o`` (relative L2, `kda.verify.recurrent_policy`), written into a NaN-filled ``out`` in most cases, and
  the ``out`` tensor itself returned; padding rows' outputs exactly zero;
- the returned state: a new final state, or the pool's written slots (against the exact states);
- every slot the call does not write (poisoned: NaN or random) bit for bit unchanged, and every other
  input unchanged bit for bit, with its version counter (the pool's counter may move with
  ``inplace_final_state``, ``out``'s always may).
"""

from __future__ import annotations

import math
import secrets
import time
from dataclasses import dataclass, field
from typing import Any, Literal

import torch
import torch.nn.functional as F

from kda.backends.base import Backend, RecurrentInputs
from kda.recurrent.reference import fused_recurrent_reference
from kda.recurrent.spec import RecurrentCaseClass, RecurrentGate, RecurrentSpec
from kda.verify.check import ClassResult, _same_bits, _verifying, relative_error
from kda.verify.recurrent_policy import recurrent_tolerance

Regime = Literal["realistic", "extreme", "near_zero_bound"]


@dataclass(frozen=True)
class RecurrentCase:
    case_class: RecurrentCaseClass
    regime: Regime
    B: int
    H: int
    HV: int
    K: int
    V: int
    seq_lens: tuple[int, ...]
    with_out: bool = True  # pass a NaN-filled `out`
    param_dtype: str = "float32"  # A_log and dt_bias
    g_dtype: str | None = None  # None: q's dtype
    seed: int = field(default_factory=lambda: secrets.randbits(31))

    @property
    def T(self) -> int:
        return sum(self.seq_lens) if self.case_class.varlen else self.seq_lens[0]

    @property
    def N(self) -> int:
        return len(self.seq_lens)

    @property
    def tokens_per_seq(self) -> int:
        return max(self.seq_lens) + 1  # T_max of per-token indices, one spare column

    def describe(self) -> dict[str, Any]:
        return {
            "regime": self.regime,
            "B": self.B,
            "T": self.T,
            "H": self.H,
            "HV": self.HV,
            "K": self.K,
            "V": self.V,
            "seq_lens": list(self.seq_lens),
            "with_out": self.with_out,
            "seed": self.seed,
            "padding_rows": 1 if self.case_class.pool != "none" else 0,
        }


def recurrent_cases(
    case_class: RecurrentCaseClass, *, quick: bool, like: RecurrentSpec | None = None
) -> list[RecurrentCase]:
    """One realistic case when `quick`, else three (realistic, extreme, and a variant with longer
    sequences, A_log as [1, 1, HV, 1] in bf16, g in fp32 and no `out`). With `like`, head dims and the GVA
    group follow that call."""
    if like is not None:
        K, V, group = like.K, like.V, like.HV // like.H
    else:
        # Inside the class's head-dim bucket, not a power of two (masked tails): 40, 72 or 136.
        K = V = case_class.head_dim // 2 + 8
        group = 2 if case_class.gva else 1
    H = 2

    def sized(regime: Regime, lengths: tuple[int, ...], dense_batch: tuple[int, int], **extra: Any) -> RecurrentCase:
        if case_class.varlen:
            return RecurrentCase(case_class, regime, 1, H, H * group, K, V, lengths, **extra)
        B, T = dense_batch
        return RecurrentCase(case_class, regime, B, H, H * group, K, V, (T,) * B, **extra)

    cases = [sized("realistic", (1, 3, 0, 2, 1), (4, 2))]
    if not quick:
        cases.append(sized("extreme", (4, 1, 0, 1), (3, 1)))
        regime: Regime = "near_zero_bound" if case_class.gate is RecurrentGate.SIGMOID else "realistic"
        cases.append(sized(regime, (17, 5), (2, 9), with_out=False, param_dtype="bfloat16", g_dtype="float32"))
    return cases


def make_recurrent_inputs(case: RecurrentCase, device: torch.device | str) -> dict[str, Any]:
    """Random inputs for `fused_recurrent_kda(**kwargs)`, drawn on the CPU from the case's seed, then moved."""
    cc = case.case_class
    gen = torch.Generator().manual_seed(case.seed)
    dtype = getattr(torch, cc.dtype)
    g_dtype = getattr(torch, case.g_dtype or cc.dtype)
    B, T, H, HV, K, V, N = case.B, case.T, case.H, case.HV, case.K, case.V, case.N

    def randn(*shape: int, scale: float = 1.0, shift: float = 0.0) -> torch.Tensor:
        return torch.randn(*shape, generator=gen, dtype=torch.float64) * scale + shift

    def uniform(low: float, high: float, *shape: int) -> torch.Tensor:
        return torch.rand(*shape, generator=gen, dtype=torch.float64) * (high - low) + low

    q, k = randn(B, T, H, K), randn(B, T, H, K)
    if not cc.qk_l2norm:
        q, k = F.normalize(q, dim=-1), F.normalize(k, dim=-1)
    v = randn(B, T, HV, V)
    beta = uniform(0.05, 0.95, B, T, HV) if cc.beta == "given" else randn(B, T, HV, scale=1.5)
    kwargs: dict[str, Any] = {}
    extreme = case.regime == "extreme"
    param = getattr(torch, case.param_dtype)
    if cc.gate is RecurrentGate.PREGATED:
        g = -uniform(2.0, 6.0, B, T, HV, K) if extreme else F.logsigmoid(randn(B, T, HV, K, scale=1.5, shift=1.0))
        if extreme:  # a full reset at one token: exp(-inf) = 0 (backends compute the floor, exp(-32))
            g.reshape(-1, HV, K)[T * B // 2, :, 0::2] = -math.inf
    else:
        kwargs["use_gate_in_kernel"] = True
        g = randn(B, T, HV, K, scale=8.0) if extreme else randn(B, T, HV, K)
        A_log = uniform(1.0, 3.0, HV) if extreme else uniform(0.0, math.log(16.0), HV)
        dt_bias = uniform(-5.0, -2.0, HV, K) if cc.gate is RecurrentGate.SOFTPLUS else randn(HV, K, scale=0.5)
        variant = case.param_dtype != "float32"
        kwargs["A_log"] = (A_log.reshape(1, 1, HV, 1) if variant else A_log).to(param)
        kwargs["dt_bias"] = (dt_bias if variant else dt_bias.reshape(-1)).to(param)
        if cc.gate is RecurrentGate.SIGMOID:
            kwargs["lower_bound"] = -0.01 if case.regime == "near_zero_bound" else -5.0
            if variant:
                kwargs.pop("A_log")  # the sigmoid gate takes A_log=None: lower_bound * sigmoid(g + dt_bias)
    kwargs.update(
        q=q.to(dtype),
        k=k.to(dtype),
        v=v.to(dtype),
        g=g.to(g_dtype),
        beta=beta.to(dtype),
        use_qk_l2norm_in_kernel=cc.qk_l2norm,
        use_beta_sigmoid_in_kernel=cc.beta != "given",
        allow_neg_eigval=cc.beta == "sigmoid2",
        state_v_first=cc.state_v_first,
        output_final_state=cc.final_state and not cc.inplace,
        inplace_final_state=cc.inplace,
    )
    if cc.varlen:
        bounds = [0]
        for length in case.seq_lens:
            bounds.append(bounds[-1] + length)
        kwargs["cu_seqlens"] = torch.tensor(bounds, dtype=torch.int32 if case.seed % 2 else torch.int64)
    inner = (HV, V, K) if cc.state_v_first else (HV, K, V)
    state_dtype = getattr(torch, cc.state_dtype)
    index_dtype = torch.int64 if case.seed % 3 else torch.int32
    if cc.pool == "none":
        if cc.initial_state:
            kwargs["initial_state"] = randn(N, *inner, scale=0.5).float()
    else:
        width = case.tokens_per_seq if cc.pool == "tokens" else 1
        slots = N * width + 3
        order = torch.randperm(slots, generator=gen)
        table = order[: N * width].reshape(N, width).clone()
        pad = int(torch.randint(N, (1,), generator=gen))
        table[pad] = -1  # the padding row: never read nor written
        if cc.pool == "tokens":
            accepted = torch.randint(1, width + 1, (N,), generator=gen)
            skip = torch.rand(N, width, generator=gen) < 0.25  # some tokens' states are not kept
            keep = torch.zeros(N, width, dtype=torch.bool)
            keep[torch.arange(N), accepted - 1] = True  # ... but the slot read from is a real one
            table = torch.where(skip & ~keep, torch.full_like(table, -1), table)
            table[pad] = -1
            kwargs["num_accepted_tokens"] = accepted.to(index_dtype)
            kwargs["ssm_state_indices"] = table.to(index_dtype)
        else:
            kwargs["ssm_state_indices"] = table[:, 0].to(index_dtype)
        pool = randn(slots, *inner, scale=0.5).to(state_dtype)
        unused = torch.ones(slots, dtype=torch.bool)
        unused[table[table >= 0]] = False
        pool[unused.nonzero()[::2, 0]] = float("nan")  # poisoned: must stay exactly as they are
        kwargs["initial_state"] = pool
    if case.with_out:
        kwargs["out"] = torch.full((B, T, HV, V), float("nan"), dtype=dtype)
    return {name: (value.to(device) if isinstance(value, torch.Tensor) else value) for name, value in kwargs.items()}


@dataclass
class RecurrentCaseResult:
    case: RecurrentCase
    passed: bool
    errors: dict[str, float] = field(default_factory=dict)
    ratios: dict[str, float] = field(default_factory=dict)
    reason: str | None = None
    seconds: float = 0.0
    unsupported: bool = False
    problems: list[str] = field(default_factory=list)

    @property
    def worst_ratio(self) -> float:
        if not self.ratios:
            return 0.0 if self.passed or self.unsupported else math.inf
        return max(self.ratios.values())

    def as_json(self) -> dict[str, Any]:
        return {
            **self.case.describe(),
            "passed": self.passed,
            "unsupported": self.unsupported,
            "errors": self.errors,
            "problems": self.problems,
            "reason": self.reason,
            "seconds": round(self.seconds, 4),
        }


def run_recurrent_case(backend: Backend, case: RecurrentCase, device: torch.device | str) -> RecurrentCaseResult:
    """Verify `backend`'s decode op on one case (see the module docstring)."""
    device = torch.device(device)
    token = _verifying.set(True)
    try:
        with torch.autocast(device.type, enabled=False), backend.verification_scope(), torch.no_grad():
            return _run(backend, case, device)
    finally:
        _verifying.reset(token)


def _run(backend: Backend, case: RecurrentCase, device: torch.device) -> RecurrentCaseResult:
    started = time.perf_counter()
    cc = case.case_class
    kwargs = make_recurrent_inputs(case, device)
    spec = RecurrentSpec.from_call(**kwargs)
    try:
        verdict = backend.supports_recurrent(spec)
    except KeyboardInterrupt:
        raise
    except BaseException as error:
        reason = f"supports_recurrent() raised {type(error).__name__}: {error}"
        return RecurrentCaseResult(case, passed=False, reason=reason, problems=[reason])
    if not verdict:
        return RecurrentCaseResult(case, passed=False, unsupported=True, reason="; ".join(verdict.reasons))

    ref = fused_recurrent_reference(**{n: v for n, v in kwargs.items() if n != "out"})
    handed = {n: t for n, t in kwargs.items() if isinstance(t, torch.Tensor)}
    snapshot = {n: (t.clone(), t._version) for n, t in handed.items()}
    inputs = RecurrentInputs(**{n: kwargs.get(n) for n in RecurrentInputs.__dataclass_fields__})  # type: ignore[arg-type]
    result = RecurrentCaseResult(case, passed=False)
    try:
        got = backend.recurrent_forward(inputs, spec)
        if device.type == "cuda":
            torch.cuda.synchronize(device)
    except KeyboardInterrupt:
        raise
    except BaseException as error:
        result.reason = f"{type(error).__name__}: {error}"
        result.problems.append(result.reason)
        result.seconds = time.perf_counter() - started
        return result

    problems = result.problems
    o = got.o
    if not isinstance(o, torch.Tensor) or o.dtype != spec.dtype or tuple(o.shape) != tuple(spec.v.shape):
        problems.append(f"o is not a {spec.dtype} tensor of v's shape")
    else:
        result.errors["o"] = relative_error(o, ref.o)
        if inputs.out is not None and o is not inputs.out:
            problems.append("out= was given but o is another tensor")
        padding = _padding_tokens(kwargs, case)
        if padding.any() and not bool((o.detach().cpu().float().reshape(-1, *o.shape[2:])[padding] == 0).all()):
            problems.append("a padding row's output is not zero")
    pool: torch.Tensor | None = inputs.initial_state
    if spec.inplace_final_state:
        assert pool is not None and ref.pool is not None and ref.exact_pool is not None
        if got.final_state is not pool:
            problems.append("inplace_final_state: the pool itself was not returned as final_state")
        written = sorted(set(ref.written))
        if written:
            result.errors["final_state"] = relative_error(pool[written], ref.exact_pool[written])
        else:
            result.errors["final_state"] = 0.0
        untouched = [s for s in range(pool.shape[0]) if s not in set(written)]
        before = snapshot["initial_state"][0]
        if untouched and not _same_bits(before[untouched], pool[untouched]):
            problems.append("a pool slot the call does not write changed")
    elif spec.output_final_state:
        state = got.final_state
        if (
            not isinstance(state, torch.Tensor)
            or state.dtype != torch.float32
            or tuple(state.shape) != spec.state_shape
        ):
            problems.append(f"final_state is not a float32 tensor of shape {spec.state_shape}")
        else:
            assert ref.final_state is not None
            result.errors["final_state"] = relative_error(state, ref.final_state)
    elif got.final_state is not None:
        problems.append("final_state returned though not asked for")

    allowed = {"out"} | ({"initial_state"} if spec.inplace_final_state else set())
    changed = [n for n, (t, _) in snapshot.items() if n not in allowed and not _same_bits(t, handed[n])]
    touched = [
        n for n, (_, ver) in snapshot.items() if n not in allowed and n not in changed and handed[n]._version != ver
    ]
    if changed:
        problems.append("modified what it was handed: " + ", ".join(changed))
    if touched:
        problems.append("wrote to what it was handed (its version counter moved): " + ", ".join(touched))
    for name, measured in result.errors.items():
        result.ratios[name] = measured / recurrent_tolerance(name, cc)
    failing = [
        f"{n} rel. error {result.errors[n]:.2e} > tol {recurrent_tolerance(n, cc):.1e}"
        for n, r in result.ratios.items()
        if not r <= 1.0
    ]
    failing += problems
    result.passed = not failing
    result.reason = "; ".join(failing) or None
    result.seconds = time.perf_counter() - started
    return result


def _padding_tokens(kwargs: dict[str, Any], case: RecurrentCase) -> torch.Tensor:
    """[B*T] bool: the tokens of padding rows (their output must be exactly zero)."""
    indices = kwargs.get("ssm_state_indices")
    mask = torch.zeros(case.B * case.T, dtype=torch.bool)
    if indices is None:
        return mask
    table = indices.cpu().reshape(case.N, -1)
    accepted = kwargs.get("num_accepted_tokens")
    column = torch.zeros(case.N, dtype=torch.long) if accepted is None else accepted.cpu().long() - 1
    read = table.long().gather(1, column[:, None])[:, 0]
    start = 0
    for n, length in enumerate(case.seq_lens):
        if read[n] < 0:
            mask[start : start + length] = True
        start += length
    return mask


# A decode class's results: the same holder as chunk_kda's (`assess` judges either by its key).
RecurrentClassResult = ClassResult


def verify_recurrent_class(
    backend: Backend,
    case_class: RecurrentCaseClass,
    device: torch.device | str,
    *,
    quick: bool,
    like: RecurrentSpec | None = None,
) -> RecurrentClassResult:
    device = torch.device(device)
    cases = recurrent_cases(case_class, quick=quick, like=like)
    return RecurrentClassResult(
        backend.name, case_class, [run_recurrent_case(backend, c, device) for c in cases], device.type
    )


def recurrent_grid() -> list[RecurrentCaseClass]:
    """The decode classes `python -m kda.verify --with-recurrent` checks: a typical serving class (sigmoid
    gate, l2norm and beta sigmoid in kernel, bf16, a bf16 pool written in place) and its one-feature
    variations, plus every gate x dtype x pool kind with the other features rotated."""
    typical = RecurrentCaseClass(
        gate=RecurrentGate.SIGMOID,
        qk_l2norm=True,
        beta="sigmoid",
        dtype="bfloat16",
        varlen=True,
        gva=True,
        pool="slots",
        initial_state=True,
        final_state=True,
        inplace=True,
        state_dtype="bfloat16",
        state_v_first=False,
        head_dim=128,
    )
    no_pool = {"pool": "none", "inplace": False, "state_dtype": "float32"}
    variations: list[dict[str, Any]] = [
        {},
        {"gate": RecurrentGate.PREGATED},
        {"gate": RecurrentGate.SOFTPLUS},
        {"qk_l2norm": False, "beta": "given"},
        {"beta": "sigmoid2"},
        {"dtype": "float16", "state_dtype": "float16"},
        {"dtype": "float32", "state_dtype": "float32"},
        {"state_dtype": "float32"},
        {"varlen": False},
        {"gva": False},
        {"state_v_first": True},
        {"pool": "tokens"},
        {"pool": "tokens", "state_v_first": True, "state_dtype": "float32"},
        {"inplace": False, "final_state": False},
        {"inplace": False, "final_state": True},
        {"head_dim": 64},
        {"head_dim": 256},
        {**no_pool, "initial_state": True, "final_state": True},
        {**no_pool, "initial_state": False, "final_state": True, "varlen": False},
        {**no_pool, "initial_state": True, "final_state": False, "state_v_first": True},
        {**no_pool, "initial_state": False, "final_state": False},
    ]
    classes = [typical.model_copy(update=change) for change in variations]
    pools: list[dict[str, Any]] = [{"pool": "slots"}, {"pool": "tokens"}, no_pool]
    i = 0
    for dtype in ("bfloat16", "float16", "float32"):
        for gate in RecurrentGate:
            change = {**pools[i % 3], "gate": gate, "dtype": dtype, "varlen": i % 2 == 0, "gva": i % 4 < 2}
            if change["pool"] != "none":
                change["state_dtype"] = ("bfloat16", "float32")[i % 2]
            classes.append(typical.model_copy(update=change))
            i += 1
    unique: dict[str, RecurrentCaseClass] = {}
    for cc in classes:
        unique.setdefault(cc.key, cc)
    return list(unique.values())
