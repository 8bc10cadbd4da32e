"""Verification cases: which case classes to check, and concrete random inputs for each.

A *case* is a case class plus a concrete small size, a gate regime and a fresh seed. Inputs are random
and never zero, scaled so that gates and decays are realistic, and include the extremes that break fast
kernels: ``lower_bound=-5`` with a saturated sigmoid, a bound near 0, large ``|g + dt_bias|`` with a
large ``exp(A_log)``, long cumulative decay inside one chunk (far past what ``exp`` of a chunk-wide
cumsum survives in fp32), T and sequence boundaries that are not multiples of the chunk, an empty and a
one-token sequence in a variable-length batch, and keys that nearly repeat in a head that barely decays
(the ``correlated`` regime, below).

`full_grid()` is the set of case classes `python -m kda.verify --all` checks: every dtype x gate mode x
forward/training combination, with the remaining features rotated through them, plus one-feature
variations of a typical training configuration. Classes met at run time outside the grid are verified
lazily by the dispatcher (`cases_for(..., like=spec)` then sizes the case after the call).
"""

from __future__ import annotations

import itertools
import math
import secrets
from dataclasses import dataclass, field, replace
from typing import Any, Literal

import torch
import torch.nn.functional as F

from kda.spec import CaseClass, GateMode, KDASpec
from kda.verify.policy import LONG_T, MIN_CHUNKS_SPANNED

Regime = Literal["realistic", "extreme", "near_zero_bound", "correlated"]

# The correlated regime: text that keeps to one topic, or repeats a token, in a head that remembers. Every
# key of a head lies at this cosine to one direction, beta is large (about 0.75) and the decay slow, so
# ``A_kk`` is large below its whole diagonal. Its inverse ``(I + A_kk)^-1`` stays small, but the powers of
# ``A_kk`` grow like ``(1 + a)^C`` for entries near ``a``: an inverse summed from them (a Neumann series
# over the chunk) cancels to garbage. In the tilelang backend's rounding replay
# (`benchmarks/tilelang_precision.py`, bf16, C = 64, K = 128) such an inverse gave o 2.6e8 to 1.9e9 times
# its size here; substitution 5.1e-3 to 5.8e-3 against the 8e-3 tolerance (4.0e-3 to 4.5e-3 in the
# realistic regime). Random keys (cosine ~ K^-1/2, random signs) never show it. The cosine and beta are
# where such an inverse fails by orders of magnitude while a right kernel on bf16 intermediates keeps its
# margin: at cosine 0.6 and beta near 0.95, FLA's o reached 7.3e-3 (sigmoid2 beta near 1.9) on an H100.
CORRELATED_COSINE = 0.75

# Heads in a verification case: 2 q/k heads, each shared by 2 value heads under GVA.
_H = 2
_GVA_GROUP = 2


@dataclass(frozen=True)
class VerificationCase:
    case_class: CaseClass
    regime: Regime
    B: int
    H: int
    HV: int
    K: int
    V: int
    seq_lens: tuple[int, ...]  # one per sequence; dense batches have B equal lengths
    g_dtype: str  # the gate input may be fp32 even when q is bf16 (common in models)
    dt_bias_2d: bool = False  # dt_bias as [HV, K] rather than [HV*K]
    safe_without_A_log: bool = False  # the safe gate accepts A_log=None
    seed: int = field(default_factory=lambda: secrets.randbits(31))

    @property
    def T(self) -> int:
        return sum(self.seq_lens) if self.case_class.varlen else self.seq_lens[0]

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
            "g_dtype": self.g_dtype,
            "seed": self.seed,
        }


def cases_for(
    case_class: CaseClass, *, quick: bool, like: KDASpec | None = None, long: bool = False
) -> list[VerificationCase]:
    """Concrete cases for a class: a realistic and a correlated case when `quick`, else four (those, an
    extreme one, and a shape/regime variant); with `long`, also one realistic case of more than `LONG_T`
    tokens. With `like`, head dims and the GVA group follow that call.

    The realistic and correlated cases always span more than four chunks and end in a partial one (4C + 13
    tokens in one sequence), so that a backend wrong only past its first chunks, or only on a ragged tail, fails in
    quick verification too. The long case (several dozen chunks) is where an error that grows with T,
    such as a state kept in low precision, shows.
    """
    C = case_class.chunk_size
    if like is not None:
        K, V, group = like.K, like.V, like.HV // like.H
    else:
        K = V = case_class.head_dim
        group = _GVA_GROUP if case_class.gva else 1
    H = _H

    def sized(
        regime: Regime, lengths: tuple[int, ...], batch: int = 2, heads: int = H, **extra: Any
    ) -> VerificationCase:
        if case_class.varlen:
            B, seq_lens = 1, lengths
        else:
            B, seq_lens = batch, (lengths[0],) * batch
        HV = heads * group
        return VerificationCase(case_class, regime, B, heads, HV, K, V, seq_lens, case_class.dtype, **extra)

    spanning = MIN_CHUNKS_SPANNED * C + 13
    lengths = (spanning, C - 5, 17) if case_class.varlen else (spanning,)
    # quick verification (the dispatcher's, on first use) takes the correlated case too: a backend whose
    # inverse cancels there returns inf or garbage for real inputs while passing every random one
    cases = [sized("realistic", lengths), sized("correlated", lengths)]
    if not quick:
        extreme = sized("extreme", (3 * C - 5, 1, 0, C + 1) if case_class.varlen else (3 * C - 5,))
        variant_regime: Regime = "near_zero_bound" if case_class.gate.bounded_sigmoid else "realistic"
        variant = sized(
            variant_regime,
            (C - 3, 0, 2 * C, 5) if case_class.varlen else (C - 3,),
            dt_bias_2d=True,
            safe_without_A_log=case_class.gate.bounded_sigmoid,
        )
        # The variant also takes the gate input in fp32 and uses K != V (so the two state layouts differ).
        wide = "float64" if case_class.dtype == "float64" else "float32"
        variant = replace(variant, g_dtype=wide, V=max(1, V // 2) if like is None else V)
        cases += [extreme, variant]
    if long:
        long_T = LONG_T + 27  # a ragged tail at either chunk size
        cases.append(sized("realistic", (long_T, C + 7) if case_class.varlen else (long_T,), batch=1, heads=1))
    return cases


def make_inputs(case: VerificationCase, device: torch.device | str) -> tuple[dict[str, Any], dict[str, torch.Tensor]]:
    """Random inputs for `chunk_kda(**kwargs)` and the upstream gradients ``do`` / ``dfinal_state``.

    Everything is drawn on the CPU from the case's seed (reproducible on any device) and then moved.
    """
    cc = case.case_class
    gen = torch.Generator().manual_seed(case.seed)
    dtype = getattr(torch, cc.dtype)
    g_dtype = getattr(torch, case.g_dtype)
    B, T, H, HV, K, V = case.B, case.T, case.H, case.HV, case.K, case.V

    def randn(*shape: int, scale: float = 1.0, shift: float = 0.0) -> torch.Tensor:
        return torch.randn(*shape, generator=gen, dtype=torch.float64) * scale + shift

    def uniform(low: float, high: float, *shape: int) -> torch.Tensor:
        return torch.rand(*shape, generator=gen, dtype=torch.float64) * (high - low) + low

    q, k = randn(B, T, H, K), randn(B, T, H, K)
    correlated = case.regime == "correlated"
    if correlated:  # every key of a head near one direction (CORRELATED_COSINE), lengths kept random
        shared = F.normalize(randn(B, 1, H, K), dim=-1)
        spread = math.sqrt(1.0 - CORRELATED_COSINE**2)
        k = (CORRELATED_COSINE * shared + spread * F.normalize(k, dim=-1)) * k.norm(dim=-1, keepdim=True)
    if not cc.qk_l2norm:  # the model normalised q, k itself: keep the delta rule contractive
        q, k = F.normalize(q, dim=-1), F.normalize(k, dim=-1)
    v = randn(B, T, HV, V)
    if correlated:  # beta large: about 0.75 (1.5 with sigmoid2)
        beta = uniform(0.6, 0.9, B, T, HV) if cc.beta == "given" else randn(B, T, HV, scale=0.5, shift=1.0)
    else:
        beta = uniform(0.05, 0.95, B, T, HV) if cc.beta == "given" else randn(B, T, HV, scale=1.5)

    kwargs: dict[str, Any] = {}
    extreme = case.regime == "extreme"
    if cc.gate is GateMode.PREGATED:
        if extreme:  # long cumulative decay: a 64-token chunk decays by ~250 in log space
            g = -uniform(2.0, 6.0, B, T, HV, K)
        elif correlated:  # a head that remembers: about -1e-2 a token in log space
            g = -uniform(0.0, 0.03, B, T, HV, K)
        else:
            g = F.logsigmoid(randn(B, T, HV, K, scale=1.5, shift=1.0))
    else:
        kwargs["use_gate_in_kernel"] = True
        if extreme:  # large |g + dt_bias| and a large exp(A_log): saturates sigmoid and softplus
            g = randn(B, T, HV, K, scale=8.0)
            A_log = uniform(1.0, 3.0, HV)
        elif correlated:
            A_log = uniform(0.0, math.log(16.0), HV)
        else:
            g = randn(B, T, HV, K)
            A_log = uniform(0.0, math.log(16.0), HV)
        dt_bias = uniform(-5.0, -2.0, HV, K) if cc.gate is GateMode.SOFTPLUS else randn(HV, K, scale=0.5)
        if correlated:
            # the activation's argument near -6 (A (g + dt_bias) for the sigmoid gates, g + dt_bias for
            # softplus): a log decay of about -1e-2 a token, and a derivative (~2e-3) that fp32 holds (an
            # argument near -14 gave derivatives below fp32's range, which no fp32 kernel can return)
            argument = randn(B, T, HV, K, scale=0.5, shift=-6.0)
            if cc.gate.bounded_sigmoid:
                gain = 1.0 if case.safe_without_A_log else A_log.exp()[:, None]
                argument = argument / gain
            g = argument - dt_bias
        parameter_dtype = torch.float64 if dtype == torch.float64 else torch.float32  # the model's weights
        kwargs["dt_bias"] = (dt_bias if case.dt_bias_2d else dt_bias.reshape(-1)).to(parameter_dtype)
        if not case.safe_without_A_log:
            kwargs["A_log"] = A_log.to(parameter_dtype)
        if cc.gate is GateMode.SAFE:
            kwargs["safe_gate"] = True
            kwargs["lower_bound"] = -0.01 if case.regime == "near_zero_bound" else -5.0
        elif cc.gate is GateMode.SIGMOID:  # any bound: past the safe range, and past the floor when extreme
            by_regime = {"near_zero_bound": -0.01, "extreme": -40.0}
            kwargs["lower_bound"] = by_regime.get(case.regime, -8.0)
    if extreme and not cc.gate.bounded_sigmoid:
        # A full reset at one token of each sequence, inside a chunk (never at a chunk's start, nor at the
        # sequence's): pre-gated -inf and -1e30 (alternate channels), softplus g = 1e30 (fp16: its largest).
        # Backends compute it as kda.reference.LOG_DECAY_FLOOR; the reference exactly (exp(-inf) = 0).
        # Placed by the lengths alone, so that every other input of a seed stays as it was.
        seq_starts = itertools.accumulate(case.seq_lens, initial=0) if cc.varlen else itertools.repeat(0)
        for n, (length, seq_start) in enumerate(zip(case.seq_lens, seq_starts)):
            t = length // 2
            if t % cc.chunk_size == 0:
                t += 1
            if t >= length:  # an empty or one-token sequence: no token past its first
                continue
            b, t = (0, seq_start + t) if cc.varlen else (n, t)
            if cc.gate is GateMode.PREGATED:
                g[b, t, :, 0::2], g[b, t, :, 1::2] = -math.inf, -1e30
            else:
                g[b, t] = min(1e30, torch.finfo(g_dtype).max)

    kwargs.update(
        q=q.to(dtype),
        k=k.to(dtype),
        v=v.to(dtype),
        g=g.to(g_dtype),
        beta=beta.to(dtype),
        use_qk_l2norm_in_kernel=cc.qk_l2norm,
        use_beta_sigmoid_in_kernel=cc.beta != "given",
        allow_neg_eigval=cc.beta == "sigmoid2",
        output_final_state=cc.final_state,
        state_v_first=cc.state_v_first,
        chunk_size=cc.chunk_size,
    )
    if cc.intermediate_states:
        kwargs["return_intermediate_states"] = True
    if cc.graph:
        kwargs["use_graph"] = True
    N = len(case.seq_lens) if cc.varlen else B
    state_shape = (N, HV, V, K) if cc.state_v_first else (N, HV, K, V)
    if cc.varlen:
        bounds = [0]
        for length in case.seq_lens:
            bounds.append(bounds[-1] + length)
        kwargs["cu_seqlens"] = torch.tensor(bounds, dtype=torch.int32 if case.seed % 2 else torch.int64)
    state_dtype = torch.float64 if dtype == torch.float64 else torch.float32
    if cc.initial_state:
        kwargs["initial_state"] = randn(*state_shape, scale=0.5).to(state_dtype)

    upstream = {"do": randn(B, T, HV, V).to(dtype)}
    if cc.final_state:
        upstream["dfinal_state"] = randn(*state_shape).to(state_dtype)

    moved = {name: (value.to(device) if isinstance(value, torch.Tensor) else value) for name, value in kwargs.items()}
    if cc.varlen:
        moved["cu_seqlens_cpu"] = kwargs["cu_seqlens"]  # the host copy is the CPU tensor itself
    return moved, {name: t.to(device) for name, t in upstream.items()}


def full_grid() -> list[CaseClass]:
    """The case classes `python -m kda.verify --all` checks (about 40)."""
    classes: list[CaseClass] = []
    states = [(False, False, False), (True, True, False), (True, False, False), (False, True, True), (True, True, True)]
    betas: list[Literal["given", "sigmoid", "sigmoid2"]] = ["given", "sigmoid", "sigmoid2"]
    dims: list[Literal[64, 128, 256]] = [64, 128, 256]
    i = 0
    for dtype in ("bfloat16", "float16", "float32"):
        for gate in (GateMode.PREGATED, GateMode.SOFTPLUS, GateMode.SAFE):  # the sigmoid gate: variations below
            for training in (False, True):
                h0, ht, vk = states[i % len(states)]
                classes.append(
                    CaseClass(
                        gate=gate,
                        qk_l2norm=i % 2 == 0,
                        beta=betas[i % 3],
                        dtype=dtype,
                        varlen=(i // 2) % 2 == 1,
                        gva=(i // 3) % 2 == 1,
                        initial_state=h0,
                        final_state=ht,
                        state_v_first=vk,
                        chunk_size=(64, 32)[(i // 4) % 2],
                        head_dim=dims[(i // 5) % 3],
                        training=training,
                    )
                )
                i += 1
    typical = CaseClass(
        gate=GateMode.SAFE,
        qk_l2norm=True,
        beta="sigmoid",
        dtype="bfloat16",
        varlen=False,
        gva=False,
        initial_state=True,
        final_state=True,
        state_v_first=False,
        chunk_size=64,
        head_dim=128,
        training=True,
    )
    variations: list[dict[str, Any]] = [
        {},
        {"gate": GateMode.PREGATED},
        {"gate": GateMode.SOFTPLUS},
        {"qk_l2norm": False},
        {"beta": "given"},
        {"beta": "sigmoid2"},
        {"dtype": "float16"},
        {"dtype": "float32"},
        {"varlen": True},
        {"gva": True},
        {"initial_state": False, "final_state": False},
        {"final_state": False},
        {"initial_state": False},
        {"state_v_first": True},
        {"chunk_size": 32},
        {"head_dim": 64},
        {"head_dim": 256},
        {"training": False},
        {"varlen": True, "gva": True, "training": False},
        {"gate": GateMode.SIGMOID},
        {"gate": GateMode.SIGMOID, "dtype": "float32", "varlen": True},
        {"gate": GateMode.SIGMOID, "training": False, "varlen": True, "gva": True},
        {"dtype": "float64", "head_dim": 64},
        {"dtype": "float64", "head_dim": 64, "training": False, "varlen": True},
        {"training": False, "intermediate_states": True},
        {"training": False, "varlen": True, "intermediate_states": True, "state_v_first": True},
        {"training": False, "varlen": True, "graph": True},
    ]
    for change in variations:
        classes.append(typical.model_copy(update=change))
    unique: dict[str, CaseClass] = {}
    for cc in classes:
        unique.setdefault(cc.key, cc)
    return list(unique.values())
