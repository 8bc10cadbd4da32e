"""The helion backend's training state pass with its products on bf16 halves, against the shipped one: does
storing fp32 intermediates as halves pay on the GPU?

    python benchmarks/helion_halves.py B4_T2048_H16_D128 B1_T8192_H96_D128      # GPU: check, then time both
    python benchmarks/helion_halves.py --resources B4_T2048_H16_D128            # CPU: their sm_90a code

When training, the helion backend stores ``w`` and ``k_g`` in fp32 and its state pass multiplies them in
TF32x3, which Triton lowers with three operand copies in registers: compiled for sm_90a, the shipped kernel
spills 580 B to 2.5 KB a thread under every launch setting (`docs/design.md`, "The helion backend"). The
variant here reads them as the forward would store them instead, bf16 halves ``[NT, HV, 2, C, K]`` (``hi =
bf16(x)``, ``lo = bf16(x - hi)``: the bytes of fp32), splits ``S`` and ``v_new`` the same way in registers,
and sums the three products above 2^-16 on bf16 tensor cores, so its operands can come from shared memory.
Per sequence ``n`` and value head ``hv``, the shipped kernel's math (`kda/backends/helion/state.py`)::

    for each chunk j of the sequence, in order:
        h[j]     = S                                                  [K, V]
        v_new[j] = u[j] - (w_lo S_hi + w_hi S_lo + w_hi S_hi)        [C, V]  (written over u)
        S        = exp(G_last[j])[:, None] * S + (k_lo^T v_hi + k_hi^T v_lo + k_hi^T v_hi)

Only the state pass is here (no initial or final state: the benchmark's calls have neither); halves in the
backend would change what the training forward stores and what every backward kernel reads. Their
precision was measured on the triton backend's kernels (`storage.BF16_HALVES`, "Precision and storage").

On a GPU, both kernels run on the same inputs (the halves made from the fp32 tensors); ``v_new`` and ``h``
are compared, then each is timed (median of `kda.bench.timing.median_ms`, the two interleaved) at the
shipped kernel's configuration and at the variant's candidates. With ``--resources`` (any machine) both are
compiled for sm_90a as an H200's Helion would configure them (`helion_resources.py`): registers, spills,
shared memory.
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path
from typing import Any

if "--resources" in sys.argv:
    os.environ["TRITON_INTERPRET"] = "1"  # before Triton is imported: launches are caught, never run
sys.path.insert(0, str(Path(__file__).resolve().parent))

import helion.language as hl
import torch

CANDIDATES = [(16, 4), (32, 4), (32, 8), (64, 8)]  # (value columns, warps): spill-free for sm_90a at K = 128


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


def halves(x: torch.Tensor) -> torch.Tensor:
    """``[..., C, K]`` fp32 as ``[..., 2, C, K]`` bf16: ``hi = bf16(x)``, ``lo = bf16(x - hi)``."""
    hi = x.to(torch.bfloat16)
    return torch.stack([hi, (x - hi.float()).to(torch.bfloat16)], dim=-3)


def inputs(B: int, T: int, HV: int, K: int, V: int, C: int, device: Any, seed: int) -> dict[str, torch.Tensor]:
    """A training state pass's inputs at realistic sizes: rows of ``w`` and ``k_g`` about unit length, the
    safe gate's in-chunk decay sums (``G`` <= 0, falling along the chunk), ``u`` of unit scale."""
    generator = torch.Generator(device="cpu").manual_seed(seed)
    NT = B * -(-T // C)

    def normal(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=generator).to(device)

    decay = torch.rand(NT, HV, C, K, generator=generator).to(device) * 0.1
    return dict(
        w=normal(NT, HV, C, K) / K**0.5,
        k_g=normal(NT, HV, C, K) / K**0.5,
        u=normal(NT, HV, C, V),
        G=-decay.cumsum(dim=2),
        chunk_bounds=torch.arange(0, NT + 1, NT // B, dtype=torch.int32, device=device),
    )


def shipped_args(x: dict[str, torch.Tensor], u: torch.Tensor, h: torch.Tensor, C: int) -> tuple:
    """The shipped state kernel's arguments (`kda/backends/helion/state.py`), no initial or final state."""
    return (x["w"], u, x["k_g"], x["G"], x["chunk_bounds"], h, x["G"], x["G"], C, False, False, False)


def halves_args(x: dict[str, torch.Tensor], u: torch.Tensor, h: torch.Tensor, C: int) -> tuple:
    return (halves(x["w"]), u, halves(x["k_g"]), x["G"], x["chunk_bounds"], h, C)


def _shape(name: str) -> tuple[int, int, int, int]:
    from kda.workloads import BenchShape

    shape = BenchShape.parse(name)
    return shape.B, shape.T, shape.H, shape.D


def resources(shapes: list[str], triton_path: str | None) -> None:
    """Both kernels compiled for sm_90a (no GPU needed), as an H200's Helion configures them."""
    import helion_resources

    from kda.backends.helion import state

    caught = helion_resources.catch_launches()
    C, records = 64, []
    for name in shapes:
        B, T, HV, D = _shape(name)
        x = inputs(B, T, HV, D, D, C, "cpu", seed=0)
        u, h = torch.empty_like(x["u"]), torch.empty(x["w"].shape[0], HV, D, D)
        shipped = shipped_args(x, u, h, C)
        default = helion_resources.default_config(state.state_kernel, "tf32x3", shipped)
        records += helion_resources.code_for(
            f"state {name}", state.state_kernel, "tf32x3", shipped, [("shipped, TF32x3", default)], caught
        )
        variant = halves_args(x, u, h, C)
        candidates = [
            ("halves, Helion's default", helion_resources.default_config(state_halves_kernel, "tf32", variant))
        ]
        candidates += [(f"halves, {bv} columns x {w}", dict(block_sizes=[bv], num_warps=w)) for bv, w in CANDIDATES]
        records += helion_resources.code_for(f"state {name}", state_halves_kernel, "tf32", variant, candidates, caught)
    records, version = helion_resources.compiled(records, triton_path)
    print(helion_resources.report(records, version))


def relative(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a.double() - b.double()).norm() / b.double().norm().clamp_min(1e-30)).item()


def measure(name: str) -> None:
    """On the GPU: the two kernels' results compared, then each timed on the same inputs."""
    import helion

    from kda.backends.helion import configs, forward, runtime, state
    from kda.bench.timing import median_ms

    device = torch.device("cuda")
    B, T, HV, D = _shape(name)
    C = 64
    x = inputs(B, T, HV, D, D, C, device, seed=0)
    h_shipped, h_halves = (torch.empty(x["w"].shape[0], HV, D, D, device=device) for _ in range(2))
    u_shipped, u_halves = x["u"].clone(), x["u"].clone()
    key = configs.ShapeKey(forward.arch(device), D, D, C, False)
    run_shipped = lambda: runtime.launch(state.state_kernel, "tf32x3", shipped_args(x, u_shipped, h_shipped, C), key)  # noqa: E731
    run_shipped()
    variant = halves_args(x, u_halves, h_halves, C)
    print(f"{name}: shipped state pass (TF32x3, its table or default configuration) against halves", flush=True)
    kernels = {"default": helion.kernel(state_halves_kernel, static_shapes=False)}
    kernels |= {
        f"{bv}x{w}": helion.kernel(
            state_halves_kernel, static_shapes=False, config=helion.Config(block_sizes=[bv], num_warps=w)
        )
        for bv, w in CANDIDATES
    }
    for label, kernel in kernels.items():
        u_halves.copy_(x["u"])
        try:
            kernel(*variant)
        except Exception as error:
            print(f"  halves {label}: failed ({type(error).__name__}: {str(error)[:200]})", flush=True)
            continue
        torch.cuda.synchronize()
        print(f"  halves {label}: v_new {relative(u_halves, u_shipped):.1e} and h {relative(h_halves, h_shipped):.1e} "
              "from the shipped kernel's", flush=True)  # fmt: skip
    times: dict[str, list[float]] = {"shipped": []} | {label: [] for label in kernels}
    for _ in range(3):  # interleaved rounds, so both see the same clocks
        times["shipped"].append(median_ms(run_shipped, device, warmup_ms=20, rep_ms=100))
        for label, kernel in kernels.items():
            times[label].append(median_ms(lambda k=kernel: k(*variant), device, warmup_ms=20, rep_ms=100))
    base = sorted(times["shipped"])[1]
    for label, ms in times.items():
        middle = sorted(ms)[1]
        print(f"  {label:10s} {middle:8.3f} ms  ({base / middle:.2f}x the shipped pass)", flush=True)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("shapes", nargs="+", help="bench shapes, e.g. B4_T2048_H16_D128")
    parser.add_argument("--resources", action="store_true", help="compile both for sm_90a instead (no GPU needed)")
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
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
