"""``python -m kda.bench --mode decode``: the decode op (`fused_recurrent_kda`) against the memory floor.

    python -m kda.bench --mode decode                                   # the 12 decode shapes
    python -m kda.bench --mode decode --shape N256_T4_HV32_D128_bf16 --backend triton --backend baseline:fla

A decode shape ``N{sequences}_T{tokens}_HV{heads}_D{head dim}_{pool dtype}`` is one serving step: N
sequences of T tokens (T > 1: speculative decoding, per-token slots ``[N, T]`` and ``num_accepted_tokens``
drawn in 1..T), states in a pool of fp32 or bf16 slots in a random permutation, updated in place
(``inplace_final_state=True``); bf16 q/k/v/g/beta with the sigmoid gate (``lower_bound=-5``), l2norm and
beta sigmoid in kernel, H = HV (no GVA). The defaults: N in 1, 64, 256, T in 1, 4, both pool dtypes,
HV = 32, D = 128. No padding rows: FLA's kernel cannot skip them (see `kda.backends.fla.recurrent`).

Rows: every kda backend (`kda.fused_recurrent_kda(..., backend=name)`, spec check and dispatch included),
``auto``, and ``baseline:fla``: FLA's ``fused_recurrent_kda_fwd`` called directly with the same pool,
indices and ``inplace_final_state=True``, no kda code in the timed region.

With ``--graph`` (CUDA), every row is also timed as a serving engine runs its decode step: captured once
in a CUDA graph, the replay timed (``graph_ms``): the GPU's time without the host's per-call work
(Python, argument checks, dispatch, the kernel launch), which at one sequence is most of an eager call.

Each row is reported as a fraction of the memory floor: the bytes one step must move, over the device's
copy bandwidth measured in the same run (``dst.copy_(src)`` of a large tensor, 2 bytes moved per byte
copied). Bytes: the state read once and written once per kept state (once per sequence, T times with
per-token slots), ``N * HV * K * V * s`` each (``s`` the pool's element size), plus q, k, v, g, beta
read and o written once in bf16.
"""

from __future__ import annotations

import json
import math
import re
import statistics
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import torch
from rich.console import Console
from rich.table import Table

import kda
from kda import registry, timings
from kda.bench import results, timing
from kda.recurrent.spec import RecurrentSpec

DECODE_SHAPES = [f"N{n}_T{t}_HV32_D128_{pool}" for pool in ("fp32", "bf16") for t in (1, 4) for n in (1, 64, 256)]
_POOL_DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}


@dataclass(frozen=True)
class DecodeShape:
    name: str
    N: int
    T: int
    HV: int
    D: int
    pool: str  # "fp32" or "bf16"

    @classmethod
    def parse(cls, name: str) -> DecodeShape:
        found = re.fullmatch(r"N(\d+)_T(\d+)_HV(\d+)_D(\d+)_(fp32|bf16)", name)
        if not found:
            raise ValueError(f"not a decode shape name: {name!r} (e.g. N256_T4_HV32_D128_bf16)")
        N, T, HV, D = map(int, found.groups()[:4])
        if min(N, T, HV, D) < 1:
            raise ValueError(f"decode shape {name!r}: every size must be >= 1")
        return cls(name, N, T, HV, D, found.group(5))

    @property
    def pool_dtype(self) -> torch.dtype:
        return _POOL_DTYPES[self.pool]

    def floor_bytes(self) -> int:
        """The bytes one step must move (see the module docstring)."""
        state = self.N * self.HV * self.D * self.D * self.pool_dtype.itemsize
        kept = self.T if self.T > 1 else 1
        tokens = self.N * self.T
        token_bytes = tokens * self.HV * (4 * self.D + 1) * 2 + tokens * self.HV * self.D * 2  # q k v g beta, o
        return state * (1 + kept) + token_bytes


def decode_inputs(shape: DecodeShape, device: torch.device, seed: int) -> dict[str, Any]:
    """`fused_recurrent_kda` keyword arguments for one decode step (random, never zero)."""
    gen = torch.Generator(device=device).manual_seed(seed)
    N, T, H, D = shape.N, shape.T, shape.HV, shape.D

    def randn(*size: int, dtype: torch.dtype = torch.bfloat16, scale: float = 1.0) -> torch.Tensor:
        return (torch.randn(*size, generator=gen, device=device) * scale).to(dtype)

    slots = N * T + 16
    order = torch.randperm(slots, generator=gen, device=device)
    kwargs: dict[str, Any] = {
        "q": randn(N, T, H, D),
        "k": randn(N, T, H, D),
        "v": randn(N, T, H, D),
        "g": randn(N, T, H, D),
        "beta": randn(N, T, H),
        "A_log": torch.rand(H, generator=gen, device=device) * math.log(16.0),
        "dt_bias": randn(H * D, dtype=torch.float32, scale=0.5),
        "lower_bound": -5.0,
        "use_gate_in_kernel": True,
        "use_qk_l2norm_in_kernel": True,
        "use_beta_sigmoid_in_kernel": True,
        "initial_state": randn(slots, H, D, D, dtype=shape.pool_dtype, scale=0.1),
        "inplace_final_state": True,
    }
    if T > 1:
        kwargs["ssm_state_indices"] = order[: N * T].reshape(N, T).to(torch.int32)
        kwargs["num_accepted_tokens"] = torch.randint(1, T + 1, (N,), generator=gen, device=device).to(torch.int32)
    else:
        kwargs["ssm_state_indices"] = order[:N].to(torch.int32)
    return kwargs


def copy_bandwidth(
    device: torch.device, nbytes: int, warmup_ms: float, rep_ms: float, timer: Callable[..., float] = timing.median_ms
) -> float:
    """Bytes per second a ``dst.copy_(src)`` of `nbytes` moves (read plus write)."""
    src = torch.empty(nbytes // 4, dtype=torch.float32, device=device).uniform_()
    dst = torch.empty_like(src)
    ms = timer(lambda: dst.copy_(src), device, warmup_ms=warmup_ms, rep_ms=rep_ms)
    return 2 * src.numel() * 4 / (ms * 1e-3)


def fla_direct(kwargs: dict[str, Any]) -> Callable[[], Any] | str:
    """FLA's `fused_recurrent_kda_fwd` with the same pool, called as a serving engine calls it."""
    try:
        from kda.backends.fla.recurrent import fla_fused_recurrent_fwd

        run = fla_fused_recurrent_fwd()
    except Exception as error:
        return f"FLA not usable here ({type(error).__name__}: {error})"
    if kwargs["q"].device.type != "cuda":
        return "FLA runs on CUDA only"
    args = {n: v for n, v in kwargs.items() if n not in ("inplace_final_state",)}
    return lambda: run(**args, inplace_final_state=True)


@dataclass
class DecodeRow:
    shape: str
    backend: str
    kind: str  # "baseline", "kda" or "auto"
    status: str = "ok"
    reason: str | None = None
    median_ms: float | None = None
    floor_ms: float | None = None
    pct_floor: float | None = None  # 100 * floor_ms / median_ms
    floor_bytes: int | None = None
    chose: str | None = None
    round_ms: list[float] = field(default_factory=list)
    graph_ms: float | None = None  # median of graph replays (--graph)
    graph_pct_floor: float | None = None
    graph_round_ms: list[float] = field(default_factory=list)


def _call_for(name: str, kwargs: dict[str, Any]) -> tuple[Callable[[], Any] | None, str | None, str | None]:
    """(the timed callable, why there is none, the backend auto chose)."""
    if name == "baseline:fla":
        made = fla_direct(kwargs)
        return (None, made, None) if isinstance(made, str) else (made, None, None)
    explanation = kda.explain_recurrent(**kwargs, backend=name)
    if explanation.chosen is None:
        reasons = explanation.decision.reasons()
        return None, "; ".join(f"{b}: {', '.join(r)}" for b, r in reasons.items()) or "no backend", None
    return (lambda: kda.fused_recurrent_kda(**kwargs, backend=name)), None, explanation.chosen


def run_decode(
    shapes: list[str],
    backends: list[str],
    device: torch.device,
    *,
    warmup_ms: float = 50,
    rep_ms: float = 300,
    rounds: int = 3,
    seed: int = 0,
    copy_bytes: int = 1 << 30,
    tune: bool = False,
    graph: bool = False,
    timer: Callable[..., float] = timing.median_ms,
) -> dict[str, Any]:
    """Time every (shape, backend) and the copy bandwidth, eager and (`graph`) as CUDA-graph replays;
    returns the results payload."""
    bandwidth = copy_bandwidth(device, copy_bytes, warmup_ms, rep_ms, timer)
    rows: list[DecodeRow] = []
    for name in shapes:
        shape = DecodeShape.parse(name)
        kwargs = decode_inputs(shape, device, seed)
        floor_ms = shape.floor_bytes() / bandwidth * 1e3
        calls: dict[str, Callable[[], Any]] = {}
        group = []
        for backend in backends:
            kind = "baseline" if backend.startswith("baseline:") else "auto" if backend == "auto" else "kda"
            row = DecodeRow(name, backend, kind, floor_ms=floor_ms, floor_bytes=shape.floor_bytes())
            group.append(row)
            call, why, chose = _call_for(backend, kwargs)
            if call is None:
                row.status, row.reason = "skipped", why
                continue
            row.chose = chose if kind == "auto" else None
            calls[backend] = call
        timed = [row for row in group if row.backend in calls]
        for round_index in range(max(1, rounds)):
            shift = round_index % max(1, len(timed))
            for row in timed[shift:] + timed[:shift]:
                if row.status != "ok":
                    continue
                try:
                    row.round_ms.append(timer(calls[row.backend], device, warmup_ms=warmup_ms, rep_ms=rep_ms))
                except Exception as error:
                    row.status, row.reason = "error", f"{type(error).__name__}: {str(error)[:300]}"
        if graph:
            _time_graphs(timed, calls, device, rounds, warmup_ms, rep_ms, timer)
        for row in timed:
            if row.status == "ok" and row.round_ms:
                row.median_ms = statistics.median(row.round_ms)
                row.pct_floor = 100.0 * floor_ms / row.median_ms if row.median_ms > 0 else None
            if row.status == "ok" and row.graph_round_ms:
                row.graph_ms = statistics.median(row.graph_round_ms)
                row.graph_pct_floor = 100.0 * floor_ms / row.graph_ms if row.graph_ms > 0 else None
        if tune:
            measured = {
                r.backend: timings.Measurement(r.median_ms, kda.get_backend(r.backend).version_for(training=False))
                for r in group
                if r.kind == "kda" and r.status == "ok" and r.median_ms is not None
            }
            if measured:
                spec = RecurrentSpec.from_call(**kwargs)
                timings.record(device, f"{name} / decode", timings.ShapePoint.of(spec), measured)
        rows.extend(group)
    return {
        "kda": kda.__version__,
        "mode": "decode",
        "gpu": results.gpu_info(device),
        "versions": results.versions(),
        "copy_bandwidth_bytes_per_s": bandwidth,
        "copy_bytes": copy_bytes,
        "rows": [asdict(r) for r in rows],
    }


def _time_graphs(
    rows: list[DecodeRow],
    calls: dict[str, Callable[[], Any]],
    device: torch.device,
    rounds: int,
    warmup_ms: float,
    rep_ms: float,
    timer: Callable[..., float],
) -> None:
    """Each row's call captured once in a CUDA graph (after its eager timing: kda's calls are verified by
    then), then the replays timed in rotated rounds like the eager calls. A row whose call cannot be
    captured keeps its eager figures and says why in `reason`."""
    replays: dict[str, Callable[[], Any]] = {}
    for row in rows:
        if row.status != "ok":
            continue
        try:
            replays[row.backend] = timing.capture_graph(calls[row.backend], device)
        except Exception as error:
            row.reason = f"not capturable: {type(error).__name__}: {str(error)[:200]}"
    captured = [row for row in rows if row.backend in replays]
    for round_index in range(max(1, rounds)):
        shift = round_index % max(1, len(captured))
        for row in captured[shift:] + captured[:shift]:
            row.graph_round_ms.append(timer(replays[row.backend], device, warmup_ms=warmup_ms, rep_ms=rep_ms))


def table(data: dict[str, Any]) -> Table:
    gbps = data["copy_bandwidth_bytes_per_s"] / 1e9
    out = Table(title=f"decode step vs the memory floor (copy bandwidth {gbps:.0f} GB/s, measured in this run)")
    graphs = any(row.get("graph_ms") is not None for row in data["rows"])  # columns only for --graph runs
    for column in ("shape", "backend", "ms", "floor ms", "% of floor", *(("graph ms", "graph %") * graphs), "note"):
        out.add_column(column)

    def figure(value: float | None, form: str) -> str:
        return "-" if value is None else format(value, form)

    for row in data["rows"]:
        note = row["reason"] or (f"chose {row['chose']}" if row["chose"] else "")
        graph_cells = (figure(row.get("graph_ms"), ".4g"), figure(row.get("graph_pct_floor"), ".0f") + "%")
        out.add_row(
            row["shape"],
            row["backend"],
            figure(row["median_ms"], ".4g"),
            f"{row['floor_ms']:.4g}",
            figure(row["pct_floor"], ".0f") + "%",
            *(graph_cells if graphs else ()),
            (note or "")[:80],
        )
    return out


def default_backends() -> list[str]:
    names = [*registry.available_backends(), "auto"]
    try:
        __import__("fla")
        names.append("baseline:fla")
    except Exception:
        pass
    return names


def main_decode(args: Any, out: Console, err: Console) -> int:
    """The ``--mode decode`` run of `kda.bench.cli` (its parsed arguments)."""
    shapes = args.shape or list(DECODE_SHAPES)
    try:
        for name in shapes:
            DecodeShape.parse(name)
    except ValueError as error:
        err.print(f"[red]{error}[/red]")
        return 2
    known = {b.name for b in registry.registered_backends()} | {"auto", "baseline:fla"}
    bad = [b for b in args.backend if b not in known]
    if bad:
        err.print(f"[red]unknown backend(s) {bad} for --mode decode; known: {', '.join(sorted(known))}[/red]")
        return 2
    device = torch.device(args.device or ("cuda" if torch.cuda.is_available() else "cpu"))
    if args.graph and device.type != "cuda":
        err.print("[red]--graph needs a CUDA device[/red]")
        return 2
    data = run_decode(
        shapes,
        args.backend or default_backends(),
        device,
        warmup_ms=args.warmup_ms,
        rep_ms=args.rep_ms,
        rounds=args.rounds,
        seed=args.seed,
        copy_bytes=(1 << 30) if device.type == "cuda" else (1 << 24),
        tune=args.tune,
        graph=args.graph,
    )
    out_dir: Path = args.out or results.default_out_dir(device)
    out_dir.mkdir(parents=True, exist_ok=True)
    path = out_dir / "decode.json"
    path.write_text(json.dumps(data, indent=1))
    out.print(table(data))
    out.print(f"wrote {path}")
    return 1 if any(r["status"] == "error" for r in data["rows"]) else 0
