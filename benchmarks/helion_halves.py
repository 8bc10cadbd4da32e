"""The helion backend's training kernels on bf16 halves (the two serial passes, as the backend runs them
and as variants that read every operand stored, and `chunk_backward`) against the fp32 form: which pays
on the GPU?

    python benchmarks/helion_halves.py B4_T2048_H16_D128 B1_T8192_H96_D128      # GPU: check, then time
    python benchmarks/helion_halves.py --resources B4_T2048_H16_D128            # CPU: their sm_90a code

Training on 16-bit inputs, the helion backend keeps ``w`` and ``A_qk`` as bf16 halves ``[NT, HV, 2, C,
...]`` (``hi = bf16(x)``, ``lo = bf16(x - hi)``: the bytes of fp32), makes ``k_g`` and ``q_e`` from q, k and
``G`` in the passes and splits them in registers the same way, as it splits the fp32 values the passes make
(``S``, ``v_new``, ``dS``, ``dv_new``), and sums the products above 2^-16 on bf16 tensor cores (the
``HALVES`` variant of `kda/backends/helion/state.py` and `state_backward.py`). Three forms of each pass:

- ``fp32``: the backend's kernels with ``HALVES`` off, fp32 ``w`` and ``A_qk`` multiplied in TF32x3 (fp32
  calls' form, in IEEE; the training form before halves), which Triton lowers with three operand copies in
  registers: compiled for sm_90a it spills 1.6 to 3.4 KB a thread (`docs/design.md`, "The helion backend");
- ``backend``: the backend's kernels with ``HALVES`` on, at the table's launch settings (``tuned_sm90.json``);
- ``halves``: the variants below, which read ``k_g`` and ``q_e`` as stored halves too (where the backend
  would keep two more ``[tokens, HV, K]`` fp32-sized tensors for the backward), so their operands can
  come from shared memory without passing through registers (``do`` is 16-bit already: one half).

Per sequence ``n`` and value head ``hv``, the math (each product ``a b`` as ``a_lo b_hi + a_hi b_lo + a_hi
b_hi``)::

    state, chunk j in order:             h[j] = S;  v_new[j] = u[j] - w S
                                         S = exp(G_last[j])[:, None] S + k_g^T v_new
    state_backward, chunk j in reverse:  dh[j] = dS;  dv_new[j] = A_qk^T do + k_g dS
                                         dS = exp(G_last[j])[:, None] dS + q_e^T do - w^T dv_new

Only the two passes are here, without initial or final states (the benchmark's calls have neither). Their
precision was measured on the triton backend's kernels (`storage.BF16_HALVES`, "Precision and storage").

Then `chunk_backward` (per chunk: the state products' and the WY step's gradients, eleven products) in
its two forms, ``HALVES`` off (TF32x3 on fp32 operands, what training runs while
`kda.backends.helion.backward.CHUNK_BACKWARD_ON_HALVES` is off) and on (every product on halves), on one
training call's own arguments, at the table's settings and the halves form at each of
`CHUNK_BACKWARD_CANDIDATES` (`chunk_backward_forms`).

On a GPU, each form runs on the same inputs (the halves made from the fp32 tensors); the outputs of
``backend`` and ``halves`` are compared with the fp32 form's, then each is timed (median of
`kda.bench.timing.median_ms`, interleaved): ``fp32`` and ``backend`` at their table's (or Helion's default)
configuration, ``halves`` at Helion's default and at each of `CANDIDATES`. With ``--resources`` (any
machine) all are compiled for sm_90a as an H200's Helion would configure them (`helion_resources.py`):
registers, spills, shared memory.
"""

from __future__ import annotations

import argparse
import importlib
import os
import sys
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

if "--resources" in sys.argv:
    os.environ["TRITON_INTERPRET"] = "1"  # before Triton is imported: launches are caught, never run
sys.path.insert(0, str(Path(__file__).resolve().parent))

import helion.language as hl
import torch

# (value columns, warps): for sm_90a at K = 128 the state pass does not spill at these, the reverse pass least
CANDIDATES = [(16, 4), (32, 4), (32, 8), (64, 8)]


def state_halves_kernel(
    w_halves: torch.Tensor,  # [NT, HV, 2, C, K] bf16: w = hi + lo
    u: torch.Tensor,  # [NT, HV, C, V] fp32 in: u; out: v_new
    k_halves: torch.Tensor,  # [NT, HV, 2, C, K] bf16: k_g = hi + lo
    G: torch.Tensor,  # [NT, HV, C, K] fp32
    chunk_bounds: torch.Tensor,  # [N + 1] int32: sequence n owns chunks [chunk_bounds[n], chunk_bounds[n+1])
    h: torch.Tensor,  # [NT, HV, K, V] fp32 out
    C: hl.constexpr,
) -> None:
    N = chunk_bounds.size(0) - 1
    HV = w_halves.size(1)
    K = hl.specialize(w_halves.size(4))
    V = u.size(3)
    for tile_n, tile_hv, tile_v in hl.tile([N, HV, V], block_size=[1, 1, None]):
        n = tile_n.begin
        hv = tile_hv.begin
        S = hl.zeros([K, tile_v], dtype=torch.float32)
        for tile_j in hl.tile(chunk_bounds[n], chunk_bounds[n + 1], block_size=1):
            j = tile_j.begin
            h[j, hv, :, tile_v] = S
            S_hi = S.to(torch.bfloat16)
            S_lo = (S - S_hi.to(torch.float32)).to(torch.bfloat16)
            w_hi = w_halves[j, hv, 0, :, :]  # [C, K]
            w_lo = w_halves[j, hv, 1, :, :]
            products = hl.dot(w_lo, S_hi)  # the smallest term first, as TF32x3 sums them
            products = hl.dot(w_hi, S_lo, acc=products)
            products = hl.dot(w_hi, S_hi, acc=products)
            v_new = u[j, hv, :, tile_v] - products  # [C, BV]
            u[j, hv, :, tile_v] = v_new
            v_hi = v_new.to(torch.bfloat16)
            v_lo = (v_new - v_hi.to(torch.float32)).to(torch.bfloat16)
            k_hi = k_halves[j, hv, 0, :, :].transpose(0, 1)  # [K, C]
            k_lo = k_halves[j, hv, 1, :, :].transpose(0, 1)
            S = S * torch.exp(G[j, hv, C - 1, :])[:, None]
            S = hl.dot(k_lo, v_hi, acc=S)
            S = hl.dot(k_hi, v_lo, acc=S)
            S = hl.dot(k_hi, v_hi, acc=S)


def state_backward_halves_kernel(
    do: torch.Tensor,  # [tokens, HV, V] bf16 or fp16: one half already
    q_halves: torch.Tensor,  # [NT, HV, 2, C, K] bf16: q_e = hi + lo
    w_halves: torch.Tensor,  # [NT, HV, 2, C, K] bf16
    k_halves: torch.Tensor,  # [NT, HV, 2, C, K] bf16
    A_halves: torch.Tensor,  # [NT, HV, 2, C, C] bf16: A_qk = hi + lo
    G: torch.Tensor,  # [NT, HV, C, K] fp32
    chunk_starts: torch.Tensor,  # [NT] int32
    chunk_seq_ends: torch.Tensor,  # [NT] int32
    chunk_bounds: torch.Tensor,  # [N + 1] int32
    dh: torch.Tensor,  # [NT, HV, K, V] fp32 out
    dv_new: torch.Tensor,  # [NT, HV, C, V] fp32 out
    C: hl.constexpr,
) -> None:
    N = chunk_bounds.size(0) - 1
    HV = w_halves.size(1)
    K = hl.specialize(w_halves.size(4))
    V = dh.size(3)
    for tile_n, tile_hv, tile_v in hl.tile([N, HV, V], block_size=[1, 1, None]):
        n = tile_n.begin
        hv = tile_hv.begin
        dS = hl.zeros([K, tile_v], dtype=torch.float32)
        first = chunk_bounds[n]
        last = chunk_bounds[n + 1] - 1
        for tile_t in hl.tile(first, last + 1, block_size=1):
            j = last - (tile_t.begin - first)  # the chunks in reverse
            dh[j, hv, :, tile_v] = dS
            rows = chunk_starts[j] + hl.arange(C)
            valid = rows < chunk_seq_ends[j]
            do_j = hl.load(do, [rows, hv, tile_v], extra_mask=valid[:, None])  # [C, BV], exact in 16 bits
            dS_hi = dS.to(torch.bfloat16)
            dS_lo = (dS - dS_hi.to(torch.float32)).to(torch.bfloat16)
            k_hi = k_halves[j, hv, 0, :, :]  # [C, K]
            dvn = hl.dot(A_halves[j, hv, 1, :, :].transpose(0, 1), do_j)  # [C, BV]
            dvn = hl.dot(A_halves[j, hv, 0, :, :].transpose(0, 1), do_j, acc=dvn)
            dvn = hl.dot(k_halves[j, hv, 1, :, :], dS_hi, acc=dvn)
            dvn = hl.dot(k_hi, dS_lo, acc=dvn)
            dvn = hl.dot(k_hi, dS_hi, acc=dvn)
            dv_new[j, hv, :, tile_v] = dvn
            dS = dS * torch.exp(G[j, hv, C - 1, :])[:, None]
            dS = hl.dot(q_halves[j, hv, 1, :, :].transpose(0, 1), do_j, acc=dS)
            dS = hl.dot(q_halves[j, hv, 0, :, :].transpose(0, 1), do_j, acc=dS)
            dvn_hi = dvn.to(torch.bfloat16)
            dvn_lo = (dvn - dvn_hi.to(torch.float32)).to(torch.bfloat16)
            w_hi = w_halves[j, hv, 0, :, :].transpose(0, 1)  # [K, C]
            products = hl.dot(w_halves[j, hv, 1, :, :].transpose(0, 1), dvn_hi)
            products = hl.dot(w_hi, dvn_lo, acc=products)
            products = hl.dot(w_hi, dvn_hi, acc=products)
            dS = dS - products


def halves_of(x: torch.Tensor) -> torch.Tensor:
    """``[..., C, K]`` fp32 as ``[..., 2, C, K]`` bf16: ``hi = bf16(x)``, ``lo = bf16(x - hi)``."""
    hi = x.to(torch.bfloat16)
    return torch.stack([hi, (x - hi.float()).to(torch.bfloat16)], dim=-3)


def by_chunk(x: torch.Tensor, starts: torch.Tensor, ends: torch.Tensor, C: int) -> torch.Tensor:
    """Token-major rows ``[tokens, HV, D]`` as chunk-major fp32 ``[NT, HV, C, D]``, rows past a sequence's end
    zero (the backend's layout)."""
    rows = starts[:, None].long() + torch.arange(C, device=x.device)  # [NT, C]
    valid = rows < ends[:, None]
    picked = x[rows.clamp(max=x.shape[0] - 1)].float() * valid[:, :, None, None]  # [NT, C, HV, D]
    return picked.transpose(1, 2).contiguous()


def inputs(B: int, T: int, HV: int, K: int, V: int, C: int, device: Any, seed: int) -> dict[str, torch.Tensor]:
    """Both training passes' inputs at realistic sizes: rows of ``w``, ``q`` and ``k`` about unit length (q
    and k token-major in bf16, as a call gives them; no l2norm, one value head a q/k head), a causal
    ``A_qk``, the safe gate's in-chunk decay sums (``G`` <= 0, falling along the chunk), ``u`` and ``do`` of
    unit scale, and the chunk table of ``B`` sequences of ``T`` tokens. ``q_e = q exp(G)`` and ``k_g = k
    exp(G_last - G)``, which the backend's passes make from ``q``, ``k`` and ``G``, are here in fp32 for the
    variants (as halves) and the tests' recurrences."""
    generator = torch.Generator(device="cpu").manual_seed(seed)
    NT = B * -(-T // C)

    def normal(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=generator).to(device)

    decay = torch.rand(NT, HV, C, K, generator=generator).to(device) * 0.1
    causal = torch.ones(C, C, dtype=torch.bool, device=device).tril()
    per_sequence = NT // B
    chunk = torch.arange(NT, device=device)
    x = dict(
        w=normal(NT, HV, C, K) / K**0.5,
        q=(normal(B * T, HV, K) / K**0.5).to(torch.bfloat16),
        k=(normal(B * T, HV, K) / K**0.5).to(torch.bfloat16),
        A_qk=torch.where(causal, normal(NT, HV, C, C) / C**0.5, 0.0),
        u=normal(NT, HV, C, V),
        do=normal(B * T, HV, V).to(torch.bfloat16),
        G=-decay.cumsum(dim=2),
        chunk_bounds=torch.arange(0, NT + 1, per_sequence, dtype=torch.int32, device=device),
        chunk_starts=((chunk // per_sequence) * T + (chunk % per_sequence) * C).to(torch.int32),
        chunk_seq_ends=((chunk // per_sequence + 1) * T).to(torch.int32),
    )
    G = x["G"]
    x["q_e"] = by_chunk(x["q"], x["chunk_starts"], x["chunk_seq_ends"], C) * G.exp()
    x["k_g"] = by_chunk(x["k"], x["chunk_starts"], x["chunk_seq_ends"], C) * (G[:, :, -1:] - G).exp()
    return x


def fp32_args(x: dict[str, torch.Tensor], u: torch.Tensor, h: torch.Tensor, C: int, halves: bool = False) -> tuple:
    """The backend's state kernel's arguments (`kda/backends/helion/state.py`) as a training call gives them
    (``k_g`` made from k and ``G``), no initial or final state: fp32 ``w``, or with `halves` its halves."""
    w = halves_of(x["w"]) if halves else x["w"]
    return (
        w, u, x["G"], x["k"], x["G"], x["G"], x["chunk_starts"], x["chunk_seq_ends"], x["chunk_bounds"], h,
        x["G"], x["G"], 1, C, False, False, False, False, False, halves,
    )  # fmt: skip


def backend_args(x: dict[str, torch.Tensor], u: torch.Tensor, h: torch.Tensor, C: int) -> tuple:
    return fp32_args(x, u, h, C, halves=True)


def halves_args(x: dict[str, torch.Tensor], u: torch.Tensor, h: torch.Tensor, C: int) -> tuple:
    return (halves_of(x["w"]), u, halves_of(x["k_g"]), x["G"], x["chunk_bounds"], h, C)


def fp32_backward_args(
    x: dict[str, torch.Tensor], dh: torch.Tensor, dv_new: torch.Tensor, C: int, halves: bool = False
) -> tuple:
    """The backend's reverse pass's arguments (`kda/backends/helion/state_backward.py`), no state gradients,
    scale 1: fp32 ``w`` and ``A_qk``, or with `halves` their halves."""
    w, A_qk = (halves_of(x[name]) if halves else x[name] for name in ("w", "A_qk"))
    return (
        x["do"], x["q"], x["k"], x["G"], x["G"], w, A_qk, x["G"], x["chunk_starts"], x["chunk_seq_ends"],
        x["chunk_bounds"], x["G"], dh, dv_new, x["G"], 1.0, 1, C, False, False, False, False, halves,
    )  # fmt: skip


def backend_backward_args(x: dict[str, torch.Tensor], dh: torch.Tensor, dv_new: torch.Tensor, C: int) -> tuple:
    return fp32_backward_args(x, dh, dv_new, C, halves=True)


def halves_backward_args(x: dict[str, torch.Tensor], dh: torch.Tensor, dv_new: torch.Tensor, C: int) -> tuple:
    return (
        x["do"], halves_of(x["q_e"]), halves_of(x["w"]), halves_of(x["k_g"]), halves_of(x["A_qk"]), x["G"],
        x["chunk_starts"], x["chunk_seq_ends"], x["chunk_bounds"], dh, dv_new, C,
    )  # fmt: skip


def _shape(name: str) -> tuple[int, int, int, int]:
    from kda.workloads import BenchShape

    shape = BenchShape.parse(name)
    return shape.B, shape.T, shape.H, shape.D


@dataclass(frozen=True)
class Pass:
    """One serial pass: the backend's kernel (``kda.backends.helion.<name>.<name>_kernel``, imported on use)
    with its arguments in the fp32 and the backend's halves form, the variant that reads every operand as
    stored halves with its arguments, two output buffers, and those buffers fresh."""

    name: str
    variant: Callable[..., None]
    fp32_args: Callable[..., tuple]
    backend_args: Callable[..., tuple]
    variant_args: Callable[..., tuple]
    buffers: Callable[[dict[str, torch.Tensor], int, int], tuple[torch.Tensor, torch.Tensor]]
    outputs: tuple[str, str]

    def backend(self) -> Callable[..., None]:
        return getattr(importlib.import_module(f"kda.backends.helion.{self.name}"), f"{self.name}_kernel")


PASSES = [
    Pass(
        "state", state_halves_kernel, fp32_args, backend_args, halves_args,
        lambda x, K, V: (x["u"].clone(), x["u"].new_empty(x["u"].shape[0], x["u"].shape[1], K, V)),
        ("v_new", "h"),
    ),
    Pass(
        "state_backward", state_backward_halves_kernel, fp32_backward_args, backend_backward_args,
        halves_backward_args,
        lambda x, K, V: (x["u"].new_empty(x["u"].shape[0], x["u"].shape[1], K, V), torch.empty_like(x["u"])),
        ("dh", "dv_new"),
    ),
]  # fmt: skip


def resources(shapes: list[str], triton_path: str | None) -> None:
    """Both passes in their three forms compiled for sm_90a (no GPU needed) as an H200's Helion configures
    them: the backend's at the table's configuration (else Helion's default), the stored-halves variant at
    Helion's default and at each of `CANDIDATES`."""
    import helion_resources

    from kda.backends.helion import configs

    caught = helion_resources.catch_launches()
    C, records = 64, []
    for name in shapes:
        B, T, HV, D = _shape(name)
        x = inputs(B, T, HV, D, D, C, "cpu", seed=0)
        for stage in PASSES:
            label = f"{stage.name} {name}"
            for form, make_args, halves in (("fp32, TF32x3", stage.fp32_args, False), ("backend, halves", stage.backend_args, True)):  # fmt: skip
                launch_args = make_args(x, *stage.buffers(x, D, D), C)
                config = configs.nearest(f"{stage.name}_kernel", configs.ShapeKey("sm90", D, D, C, False, halves))
                config = config or helion_resources.default_config(stage.backend(), "tf32x3", launch_args)
                records += helion_resources.code_for(
                    label, stage.backend(), "tf32x3", launch_args, [(form, config)], caught
                )
            variant = stage.variant_args(x, *stage.buffers(x, D, D), C)
            candidates = [("halves, Helion's default", helion_resources.default_config(stage.variant, "tf32", variant))]
            candidates += [(f"halves, {bv} columns x {w}", dict(block_sizes=[bv], num_warps=w)) for bv, w in CANDIDATES]
            records += helion_resources.code_for(label, stage.variant, "tf32", variant, candidates, caught)
    records, version = helion_resources.compiled(records, triton_path)
    print(helion_resources.report(records, version))


def relative(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a.double() - b.double()).norm() / b.double().norm().clamp_min(1e-30)).item()


def measure(name: str) -> None:
    """On the GPU, for each pass: the backend's halves and the stored-halves variant against the fp32 form,
    then each timed on the same inputs, interleaved."""
    from kda.backends.helion import configs, forward, runtime
    from kda.bench.timing import median_ms

    device = torch.device("cuda")
    B, T, HV, D = _shape(name)
    C = 64
    x = inputs(B, T, HV, D, D, C, device, seed=0)
    for stage in PASSES:
        print(f"{name} {stage.name}: the fp32 form (TF32x3) against the backend's halves and stored halves", flush=True)
        kernel_of_backend = stage.backend()
        runs: dict[str, Callable[[], None]] = {}
        results: dict[str, tuple[torch.Tensor, ...]] = {}
        for form, make_args, halves in (("fp32", stage.fp32_args, False), ("backend", stage.backend_args, True)):
            key = configs.ShapeKey(forward.arch(device), D, D, C, False, halves)
            buffers = stage.buffers(x, D, D)
            launch_args = make_args(x, *buffers, C)
            runs[form] = lambda a=launch_args, k=key, f=kernel_of_backend: runtime.launch(f, "tf32x3", a, k)
            runs[form]()
            results[form] = buffers
        reference = results["fp32"]
        errors = ", ".join(
            f"{out} {relative(a, b):.1e}" for out, a, b in zip(stage.outputs, results["backend"], reference)
        )
        print(f"  backend's halves: {errors} from the fp32 form's", flush=True)
        theirs = stage.buffers(x, D, D)
        variant = stage.variant_args(x, *theirs, C)
        fresh = [buffer.clone() for buffer in theirs]  # the state pass writes v_new over u
        for label, kernel in variant_kernels(stage.variant).items():
            for buffer, start in zip(theirs, fresh):
                buffer.copy_(start)
            try:
                kernel(*variant)
            except Exception as error:
                print(f"  halves {label}: failed ({type(error).__name__}: {str(error)[:200]})", flush=True)
                continue
            torch.cuda.synchronize()
            errors = ", ".join(f"{out} {relative(a, b):.1e}" for out, a, b in zip(stage.outputs, theirs, reference))
            print(f"  halves {label}: {errors} from the fp32 form's", flush=True)
            runs[f"halves {label}"] = lambda k=kernel, a=variant: k(*a)
        times: dict[str, list[float]] = {label: [] for label in runs}
        for _ in range(3):  # interleaved rounds, so all see the same clocks
            for label, run in runs.items():
                times[label].append(median_ms(run, device, warmup_ms=20, rep_ms=100))
        base = sorted(times["fp32"])[1]
        for label, ms in times.items():
            middle = sorted(ms)[1]
            print(f"  {label:18s} {middle:8.3f} ms  ({base / middle:.2f}x the fp32 form)", flush=True)


CHUNK_BACKWARD_OUTPUTS = ("dv", "dq_c", "dk_c", "dG_c", "dP_qk", "dP_kk", "dbeta_c")
# (V blocks of the first loop, K blocks, V blocks of the K loop), warps: compiled for sm_90a at
# B4_T2048_H16_D128 the halves form spills 160 B a thread at (64, 32, 32) x 8, 814 B at x 4, and 4962 B at
# the table's (128, 64, 32) x 4, tuned on the fp32 form
CHUNK_BACKWARD_CANDIDATES = [((64, 32, 32), 4), ((64, 32, 32), 8), ((128, 32, 32), 8), ((128, 32, 16), 8)]


def chunk_backward_forms(name: str) -> None:
    """On the GPU: `chunk_backward` with ``HALVES`` off (TF32x3 on fp32 operands) and on (every product on
    bf16 halves) on one bf16 training call's own arguments (the bench's callable, its launch caught), at the
    table's launch settings for both: each form's outputs against the other's, then both timed, interleaved."""
    import helion

    from kda.backends.helion import runtime
    from kda.bench.runner import call_for
    from kda.bench.shapes import MODES, BenchShape, make_inputs
    from kda.bench.timing import median_ms

    device = torch.device("cuda")
    caught: dict[str, tuple] = {}
    plain = runtime.launch

    def catching(fn, precision, args, key) -> None:
        if fn.__name__ == "chunk_backward_kernel":
            caught["launch"] = (fn, precision, args, key)
        plain(fn, precision, args, key)

    runtime.launch = catching  # type: ignore[assignment]
    try:
        inputs = make_inputs(BenchShape.parse(name), MODES["train_safe"], device, seed=0)
        run, why = call_for("helion", inputs, MODES["train_safe"])
        if run is None:
            print(f"{name} chunk_backward: not run ({why})", flush=True)
            return
        run()
        torch.cuda.synchronize()
    finally:
        runtime.launch = plain  # type: ignore[assignment]
    fn, precision, args, key = caught["launch"]
    print(f"{name} chunk_backward: TF32x3 on fp32 operands against products on bf16 halves ({key})", flush=True)
    outputs_at = len(args) - 12  # dv .. dbeta_c, then scale, group, C, L2, HALVES
    forms = {"fp32": (*args[:-1], False), "halves": (*args[:-1], True)}
    results = {}
    for form, form_args in forms.items():
        plain(fn, precision, form_args, key)
        torch.cuda.synchronize()
        results[form] = [x.clone() for x in form_args[outputs_at : outputs_at + 7]]
    errors = ", ".join(
        f"{out} {relative(a, b):.1e}"
        for out, a, b in zip(CHUNK_BACKWARD_OUTPUTS, results["halves"], results["fp32"], strict=True)
    )
    print(f"  halves: {errors} from the fp32 form's", flush=True)
    runs = {form: (lambda a=form_args: plain(fn, precision, a, key)) for form, form_args in forms.items()}
    for blocks, warps in CHUNK_BACKWARD_CANDIDATES:  # the halves form at other launch settings
        label = f"halves {'x'.join(map(str, blocks))} w{warps}"
        config = helion.Config(block_sizes=list(blocks), num_warps=warps, num_stages=1)
        kernel = helion.kernel(fn, static_shapes=False, dot_precision=precision, config=config)  # its own object
        try:
            kernel(*forms["halves"])
            torch.cuda.synchronize()
        except Exception as error:
            print(f"  {label}: failed ({type(error).__name__}: {str(error)[:200]})", flush=True)
            continue
        runs[label] = lambda k=kernel, a=forms["halves"]: k(*a)
    times: dict[str, list[float]] = {label: [] for label in runs}
    for _ in range(3):  # interleaved rounds
        for label, run_form in runs.items():
            times[label].append(median_ms(run_form, device, warmup_ms=20, rep_ms=100))
    base = sorted(times["fp32"])[1]
    for form, ms in times.items():
        middle = sorted(ms)[1]
        print(f"  {form:18s} {middle:8.3f} ms  ({base / middle:.2f}x the fp32 form)", flush=True)


def variant_kernels(variant: Any) -> dict[str, Any]:
    """The halves pass as Helion kernels: at Helion's default configuration, never autotuned (given none,
    Helion 1.5 autotunes at the first call: minutes for these kernels, past a device run's time limit),
    and at each of `CANDIDATES` (``BVxW``)."""
    import helion

    kernels = {"default": helion.kernel(variant, static_shapes=False, autotune_effort="none")}
    kernels |= {
        f"{bv}x{w}": helion.kernel(variant, static_shapes=False, config=helion.Config(block_sizes=[bv], num_warps=w))
        for bv, w in CANDIDATES
    }
    return kernels


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("shapes", nargs="+", help="bench shapes, e.g. B4_T2048_H16_D128")
    parser.add_argument("--resources", action="store_true", help="compile them for sm_90a instead (no GPU needed)")
    parser.add_argument("--triton-path", help="with --resources: compile with the Triton found here")
    args = parser.parse_args()
    if args.resources:
        resources(args.shapes, args.triton_path)
        return 0
    if not torch.cuda.is_available():
        print("helion_halves.py: timing needs a CUDA GPU (--resources compiles without one)")
        return 2
    for name in args.shapes:
        measure(name)
        chunk_backward_forms(name)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
