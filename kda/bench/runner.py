"""The bench loop: for each shape and mode, every selected backend and baseline, timed in this process.

Rows are of three kinds:

- ``baseline:fla`` and ``baseline:flashkda``: the libraries called directly, exactly as their users
  call them (FLA's `chunk_kda` on its Triton kernels, forward and backward: its FlashKDA dispatch and, where
  tilelang is installed, its TileLang backward stage bypassed, as the `fla` backend runs it; `flash_kda.fwd`
  in its own state layout), with no kda code in the timed region. ``pct_fla`` of every row is measured
  against ``baseline:fla`` of the same shape and mode, in the same process. ``baseline:fla-tilelang``
  (named only) is FLA with its stages dispatched as installed: with tilelang, its TileLang backward stage.
- kda backends (``torch``, ``fla``, ``flashkda``, ...): `kda.chunk_kda(..., backend=name)`, so the spec
  check and dispatch are part of the time, as they are for a user. A backend that is not verified for
  the call, or does not support it, gets a row with the reason and no time.
- ``auto``: `kda.chunk_kda(..., backend="auto")`, with the backend it chose.

Every row is timed in ``rounds`` rounds (3 by default), each round in a rotated order, and reports the
median of its rounds, so that drift in clocks or temperature lands on all rows alike rather than on
whichever was timed last. With ``tune``, a short first pass records the kda backends in the timing
table (`kda.timings`) so that ``auto``'s choice is fixed before the rounds; the rounds' medians then
replace those entries.
"""

from __future__ import annotations

import gc
import logging
import math
import statistics
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from typing import Any

import torch

import kda
from kda import timings
from kda.backends.fla import route
from kda.bench import timing
from kda.bench.shapes import MODES, BenchInputs, BenchShape, Mode, make_inputs
from kda.spec import KDASpec

logger = logging.getLogger("kda.bench")

BASELINES = ("baseline:fla", "baseline:fla-tilelang", "baseline:flashkda")


@dataclass
class Row:
    shape: str
    mode: str
    backend: str
    kind: str  # "baseline", "kda" or "auto"
    status: str = "ok"  # "ok", "skipped" or "error"
    reason: str | None = None
    median_ms: float | None = None
    fla_median_ms: float | None = None
    pct_fla: float | None = None  # 100 * fla_median_ms / median_ms
    peak_bytes: int | None = None
    cold_start_s: float | None = None
    cold_process_s: float | None = None  # the fresh process's whole life: interpreter, imports, first call
    cold_new_cache_files: int | None = None
    chose: str | None = None  # auto: the backend it ran
    round_ms: list[float] = field(default_factory=list)  # each round's median, in round order (spread, outliers)

    def as_json(self) -> dict[str, Any]:
        return asdict(self)


@dataclass
class BenchConfig:
    shapes: list[str]
    modes: list[str]
    backends: list[str]  # kda backend names, "auto", and baselines
    device: torch.device
    cold_start: str = "first"  # "none", "first" (the first shape of the whole run, each mode) or "all"
    first_shape: str | None = None  # the whole run's first shape, when this process runs a share of it
    tune: bool = False
    warmup_ms: float = 50
    rep_ms: float = 300
    rounds: int = 3  # each row timed this many times, in rotated orders; its figure is the median
    seed: int = 0
    extra: dict[str, Any] = field(default_factory=dict)


def synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def with_backward(forward: Callable[[], Any], inputs: BenchInputs) -> Callable[[], Any]:
    """A training row's step: `forward`, then the gradients of its output against `inputs.do`."""
    leaves = list(inputs.leaves.values())

    def step() -> Any:
        o = forward()[0]
        return torch.autograd.grad(o, leaves, inputs.do)

    return step


def call_for(name: str, inputs: BenchInputs, mode: Mode) -> tuple[Callable[[], Any] | None, str | None]:
    """The callable that one row times (forward, plus backward in training modes), or why there is none."""
    kwargs = inputs.kwargs
    if name in ("baseline:fla", "baseline:fla-tilelang"):
        triton_only = name == "baseline:fla"
        if not triton_only and not route.tilelang_installed():
            return None, "FLA takes its TileLang stage only with tilelang installed and FLA_TILELANG not 0"
        try:
            step = fla_step(inputs, mode, triton_only=triton_only)
        except Exception as error:
            return None, f"FLA not usable here ({type(error).__name__}: {error})"
        if kwargs["q"].device.type != "cuda":
            return None, "FLA runs on CUDA only"
        return step, None
    if name == "baseline:flashkda":
        made = _flashkda_direct(kwargs, mode)
        if isinstance(made, str):
            return None, made
        forward = made
    else:
        forward = lambda: kda.chunk_kda(**kwargs, backend=name)  # noqa: E731
    return (with_backward(forward, inputs) if mode.training else forward), None


def fla_step(inputs: BenchInputs, mode: Mode, *, triton_only: bool) -> Callable[[], Any]:
    """FLA's own `chunk_kda` (its FlashKDA dispatcher peeled off), forward and in a training mode backward.

    FLA 0.6 also dispatches inner stages at every call, backward ones included: with tilelang installed
    (and ``FLA_TILELANG`` not 0) its TileLang `chunk_kda_bwd_wy_dqkg_fused` runs. With `triton_only` the
    whole step runs inside `route.triton_path_only()`, so every stage is FLA's Triton kernel, as in the
    `fla` backend; without, FLA routes as installed. The bench's FLA figure is thus one path whatever the
    machine has installed; the results' settings say which (`fla_paths`)."""
    from kda.backends.fla import fla_triton_chunk_kda

    run = fla_triton_chunk_kda()
    kwargs = inputs.kwargs
    forward = lambda: run(**kwargs)  # noqa: E731
    step = with_backward(forward, inputs) if mode.training else forward
    if not triton_only:
        return step

    def on_triton() -> Any:
        with route.triton_path_only():
            return step()

    return on_triton


def fla_paths() -> dict[str, str]:
    """What the FLA baselines run on this machine, for the results' settings (`route.route_state`)."""
    state = route.route_state()
    if state == "off":
        return {"baseline:fla": "FLA's Triton kernels (no other route installed)"}
    triton = (
        "FLA's Triton kernels (its TileLang backward stage, installed, bypassed)"
        if state == "bypassed"
        else "FLA as installed: its stage registry was not found, so its TileLang stage could not be bypassed"
    )
    return {
        "baseline:fla": triton,
        "baseline:fla-tilelang": "FLA as installed: its TileLang backward stage where FLA takes it",
    }


def _flashkda_direct(kwargs: dict[str, Any], mode: Mode) -> Callable[[], Any] | str:
    """`flash_kda.fwd` called the way its own users call it (states in its [N, H, V, K] layout)."""
    try:
        import flash_kda
    except Exception as error:
        return f"flash_kda does not import ({type(error).__name__}: {error})"
    q, v = kwargs["q"], kwargs["v"]
    if mode.training or mode.gate != "safe":
        return "FlashKDA is an inference forward with the safe gate only"
    if q.device.type != "cuda" or q.shape[-1] != 128:
        return "FlashKDA needs CUDA and K = V = 128"
    H, K = q.shape[2], q.shape[3]
    dt_bias = kwargs["dt_bias"].view(H, K)
    h0 = kwargs.get("initial_state")
    h0_vk = None if h0 is None else h0.transpose(-1, -2).contiguous()  # its layout; converted once, untimed
    cu = kwargs.get("cu_seqlens")
    N = q.shape[0] if cu is None else cu.numel() - 1
    scale = K**-0.5

    def forward() -> Any:
        out = torch.empty_like(v)
        final = torch.empty(N, H, v.shape[-1], K, dtype=torch.float32, device=q.device)
        flash_kda.fwd(
            q,
            kwargs["k"],
            v,
            kwargs["g"],
            kwargs["beta"],
            scale,
            out,
            A_log=kwargs["A_log"],
            dt_bias=dt_bias,
            lower_bound=kwargs["lower_bound"],
            initial_state=h0_vk,
            final_state=final,
            cu_seqlens=cu,
        )
        return out, final

    return forward


def _serving_backend(name: str, kwargs: dict[str, Any]) -> tuple[str | None, str | None]:
    """Which backend kda would run for this request (``name`` or auto), or why none."""
    explanation = kda.explain(**kwargs, backend=name)
    if explanation.chosen is not None:
        return explanation.chosen, None
    reasons = explanation.decision.reasons()
    why = "; ".join(f"{b}: {', '.join(r)}" for b, r in reasons.items()) or "no backend can serve the call"
    return None, why


def run(
    config: BenchConfig,
    on_row: Callable[[Row], None] = lambda row: None,
    *,
    timer: Callable[..., float] = timing.median_ms,
    memory: Callable[..., int | None] = timing.peak_bytes,
    cold: Callable[..., dict[str, Any]] = timing.cold_start,
) -> list[Row]:
    """Measure every (shape, mode, backend) of `config`; `on_row` sees each row as it is finished."""
    rows: list[Row] = []
    first_shape = config.first_shape or (config.shapes[0] if config.shapes else None)
    for shape_name in config.shapes:
        shape = BenchShape.parse(shape_name)
        for mode_name in config.modes:
            mode = MODES[mode_name]
            group = _measure(
                config,
                shape,
                mode,
                timer,
                memory,
                cold,
                measure_cold=config.cold_start == "all" or (config.cold_start == "first" and shape_name == first_shape),
                on_row=on_row,
            )
            rows.extend(group)
    return rows


class _Spent:
    """Where a shape's wall time went, for the log: a bench run is planned against a device's time limit,
    and most of a shape's minutes are spent before its timed rounds (verification, compilation, autotuning,
    cold-start processes)."""

    def __init__(self) -> None:
        self.began = time.perf_counter()
        self.phases: dict[str, float] = {}
        self.per_backend: dict[str, dict[str, float]] = {}

    def add(self, phase: str, seconds: float, backend: str | None = None) -> None:
        self.phases[phase] = self.phases.get(phase, 0.0) + seconds
        if backend is not None:
            by = self.per_backend.setdefault(phase, {})
            by[backend] = by.get(backend, 0.0) + seconds

    def summary(self, shape: str, mode: str) -> str:
        parts = []
        for phase, seconds in self.phases.items():
            by = sorted(self.per_backend.get(phase, {}).items(), key=lambda item: -item[1])
            named = ", ".join(f"{backend} {s:.0f}" for backend, s in by if s >= 1.0)
            parts.append(f"{phase} {seconds:.0f} s" + (f" ({named})" if named else ""))
        return f"{shape} {mode}: {time.perf_counter() - self.began:.0f} s: " + "; ".join(parts)


def _prepare(
    name: str, kind: str, inputs: BenchInputs, mode: Mode
) -> tuple[Callable[[], Any] | None, str | None, str | None]:
    """(the call that times `name` on `inputs`, or None; why not; the backend `auto` chose, for auto)."""
    chose = None
    if kind != "baseline":
        served, why = _serving_backend(name, inputs.kwargs)
        if served is None:
            return None, why, None
        chose = served if kind == "auto" else None
    call, why = call_for(name, inputs, mode)
    return call, why, chose


def _measure(config, shape, mode, timer, memory, cold, *, measure_cold: bool, on_row) -> list[Row]:
    device = config.device
    spent = _Spent()
    inputs = make_inputs(shape, mode, device, seed=config.seed)
    kwargs = inputs.kwargs
    ordered = (
        [b for b in config.backends if b in BASELINES]
        + [b for b in config.backends if b not in BASELINES and b != "auto"]
        + [b for b in config.backends if b == "auto"]
    )
    rows: list[Row] = []
    calls: dict[str, Callable[[], Any]] = {}
    for name in ordered:
        kind = "baseline" if name in BASELINES else "auto" if name == "auto" else "kda"
        row = Row(shape.name, mode.name, name, kind)
        rows.append(row)
        began = time.perf_counter()
        call, why, row.chose = _prepare(name, kind, inputs, mode)
        spent.add("choosing", time.perf_counter() - began, name)  # dispatch: verification happens here
        if call is None:
            row.status, row.reason = "skipped", why
            continue
        calls[name] = call

    if measure_cold:  # before anything runs here, so that the first process to touch a shape is cold
        for row in rows:
            if row.backend in calls:
                began = time.perf_counter()
                found = cold(row.backend, shape.name, mode.name, device)
                spent.add("cold starts", time.perf_counter() - began, row.backend)
                if "error" in found:
                    row.reason = f"cold start failed: {found['error']}"
                else:
                    row.cold_start_s = found["first_call_s"]
                    row.cold_process_s = found.get("process_s")
                    row.cold_new_cache_files = found.get("new_cache_files")

    spec = KDASpec.from_call(**kwargs, requires_grad=mode.training)
    timed = [row for row in rows if row.backend in calls]
    first: set[str] = set()

    def once(row: Row, call: Callable[[], Any], rep_ms: float) -> bool:
        began = time.perf_counter()
        measured = _measure_once(row, call, timer, device, config.warmup_ms, rep_ms)
        # a backend's first timing holds its compilation and autotuning at this shape
        spent.add("rounds" if row.backend in first else "first timing", time.perf_counter() - began, row.backend)
        first.add(row.backend)
        return measured

    auto = next((row for row in timed if row.kind == "auto"), None)
    if config.tune and auto is not None:
        # A short first pass fills the timing table, so that auto's choice is fixed before the rounds.
        for row in timed:
            if row.kind == "kda":
                once(row, calls[row.backend], max(20.0, config.rep_ms / 5))
        _record_timings(config, shape, mode, spec, rows)
    if auto is not None:
        auto.chose, _ = _serving_backend("auto", kwargs)  # the table may have changed the choice

    # Rounds, each in a rotated order, so that clock and thermal drift fall on every row alike; the
    # row's figure is the median of its rounds' medians.
    samples: dict[str, list[float]] = {row.backend: [] for row in timed}
    for round_index in range(max(1, config.rounds)):
        shift = round_index % max(1, len(timed))
        for row in timed[shift:] + timed[:shift]:
            if row.status != "ok":
                continue
            measured = once(row, calls[row.backend], config.rep_ms)
            if measured and row.median_ms is not None:
                samples[row.backend].append(row.median_ms)
    for row in timed:
        if row.status == "ok" and samples[row.backend]:
            row.round_ms = list(samples[row.backend])
            row.median_ms = statistics.median(samples[row.backend])
            began = time.perf_counter()
            try:
                row.peak_bytes = memory(calls[row.backend], device)
            except Exception as error:
                row.reason = f"peak memory not measured: {type(error).__name__}: {str(error)[:200]}"
            spent.add("peak memory", time.perf_counter() - began)
    if config.tune:
        _record_timings(config, shape, mode, spec, rows)

    fla = next((r.median_ms for r in rows if r.backend == "baseline:fla" and r.status == "ok"), None)
    logger.info(spent.summary(shape.name, mode.name))
    for row in rows:
        row.fla_median_ms = fla
        row.pct_fla = pct_fla(fla, row.median_ms)
        on_row(row)
    del inputs, kwargs, calls
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()
    return rows


def _measure_once(row: Row, call: Callable[[], Any], timer, device, warmup_ms: float, rep_ms: float) -> bool:
    """One median into ``row.median_ms``; a failure marks the row (one failing backend never ends a run)."""
    try:
        row.median_ms = timer(call, device, warmup_ms=warmup_ms, rep_ms=rep_ms)
        return True
    except Exception as error:
        row.status, row.reason = "error", f"{type(error).__name__}: {str(error)[:300]}"
        row.median_ms = row.peak_bytes = None
        gc.collect()
        if device.type == "cuda":
            torch.cuda.empty_cache()
        return False


def pct_fla(fla_ms: float | None, backend_ms: float | None) -> float | None:
    """``100 * fla_ms / backend_ms``: above 100 means faster than FLA."""
    if fla_ms is None or backend_ms is None or not backend_ms > 0 or not math.isfinite(backend_ms):
        return None
    return 100.0 * fla_ms / backend_ms


def _record_timings(config: BenchConfig, shape: BenchShape, mode: Mode, spec: KDASpec, rows: list[Row]) -> None:
    measured = {}
    for row in rows:
        if row.kind == "kda" and row.status == "ok" and row.median_ms is not None:
            backend = kda.get_backend(row.backend)
            measured[row.backend] = timings.Measurement(row.median_ms, backend.version_for(spec.requires_grad))
    if measured:
        timings.record(config.device, f"{shape.name} / {mode.name}", timings.ShapePoint.of(spec), measured)
