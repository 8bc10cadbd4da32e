"""The tilelang backend's GPU time per kernel, at bench shapes (GPU only).

    KDA_VERIFY=off python benchmarks/tilelang_stages.py --mode fwd --mode fwd_pregated B1_T8192_H96_D128
    KDA_VERIFY=off python benchmarks/tilelang_stages.py --mode train_safe B1_T8192_H96_D128
    KDA_VERIFY=off python benchmarks/tilelang_stages.py --mode fwd --variant intra:halves=/tmp/intra.py B1_T8192_H96_D128
    KDA_VERIFY=off python benchmarks/tilelang_stages.py --mode train_safe --variant score_backward:bk32=/tmp/sb.py B4_T2048_H16_D128
    KDA_VERIFY=off python benchmarks/tilelang_stages.py --mode fwd --plan split --plan fused:64 B2_T16384_H16_D128

Runs the bench's own callable (`kda.bench.runner.call_for`, so exactly what the bench times) with each of
the backend's kernels wrapped in CUDA events (the forward's three; in a training mode, ``train_safe`` or
``train_pregated``, the backward's five too), and prints each kernel's median GPU milliseconds per call
(summed over its launches in the call: ``qk_tail`` runs for q and for k), its share, and the bytes it must
move at least (its inputs read once, its outputs written once) over that time, against the H200's
~4.3 TB/s copy rate measured here.

``--variant KERNEL:NAME=PATH`` (repeatable) also times the kernel KERNEL (a stage name: ``intra``,
``score_backward``, ...) built by the builder of the Python file PATH, a changed copy of that kernel's module
(its ``build`` function; ``build_gate_tail`` or ``build_qk_tail`` for the tails), in the same process: each
step runs the call once as shipped and once per variant, rotated, with every other kernel as shipped, so a
change is measured against the kernel it would replace on the same GPU, clocks and inputs. Each variant's
untimed first step is also compared with the shipped kernels' on the same inputs: per output (``o`` and the final
state, or each gradient), ``max |variant - shipped| / max |shipped|``, and whether a NaN appeared. That is
a smoke test (a broken variant shows near 1 or NaN, a rounding change near the outputs' precision), not
verification: a variant's numbers are checked by `kda.verify` once it replaces the shipped file.

``--plan split`` or ``--plan fused:BV`` (repeatable) also times the forward's serial pass planned that way
(`kernels.state_plan`: the output a launch of its own, or in the pass with BV value columns a program), the
same way, against the shipped rule's plan: the per-kernel lines show where the time moved, ``sum`` the call.
"""

from __future__ import annotations

import argparse
import importlib.util
import statistics
import sys
import time
from collections import defaultdict
from collections.abc import Callable
from pathlib import Path
from typing import Any, NamedTuple

import torch

from kda.backends.tilelang import (
    chunk_backward,
    intra,
    kernels,
    output,
    score_backward,
    state,
    state_backward,
    tails,
)
from kda.bench.runner import call_for
from kda.bench.shapes import MODES, BenchShape, make_inputs

SHIPPED = "shipped"


class VariantError(ValueError):
    """A ``--variant`` that cannot be used, with what is wrong."""


# Where `kernels.specializations` finds each kernel's builder (it looks it up at every call)
BUILDERS: dict[str, tuple[Any, str]] = {
    "intra": (intra, "build"),
    "state": (state, "build"),
    "output": (output, "build"),
    "state_backward": (state_backward, "build"),
    "chunk_backward": (chunk_backward, "build"),
    "score_backward": (score_backward, "build"),
    "gate_tail": (tails, "build_gate_tail"),
    "qk_tail": (tails, "build_qk_tail"),
}
# the shipped builders, which `use` puts back
SHIPPED_BUILDS = {kernel: getattr(module, attribute) for kernel, (module, attribute) in BUILDERS.items()}


class Variant(NamedTuple):
    kernel: str  # a key of BUILDERS
    name: str
    build: Callable[..., Any]


class Plan(NamedTuple):
    name: str
    plan: kernels.StatePlan


def load_variant(text: str) -> Variant:
    """``KERNEL:NAME=PATH`` -> the builder of kernel KERNEL in the file PATH, under NAME."""
    kernel, colon, rest = text.partition(":")
    name, sep, path = rest.partition("=")
    if not colon or not sep or not kernel or not name or not path:
        raise VariantError(f"--variant {text!r}: expected KERNEL:NAME=PATH")
    if kernel not in BUILDERS:
        raise VariantError(f"--variant {text!r}: no kernel {kernel!r} (one of {', '.join(BUILDERS)})")
    if name == SHIPPED:
        raise VariantError(f"--variant {text!r}: the name {SHIPPED!r} is the shipped kernels'")
    if not Path(path).is_file():
        raise VariantError(f"--variant {text!r}: no file {path}")
    spec = importlib.util.spec_from_file_location(f"{kernel}_variant_{name}", path)
    if spec is None or spec.loader is None:
        raise VariantError(f"--variant {text!r}: {path} is not a Python file")
    module = importlib.util.module_from_spec(spec)
    try:
        spec.loader.exec_module(module)
    except Exception as error:  # a variant is work in progress: any failure is a message, not a traceback
        raise VariantError(f"--variant {text!r}: {path} does not import ({type(error).__name__}: {error})") from error
    attribute = BUILDERS[kernel][1]
    build = getattr(module, attribute, None)
    if not callable(build):
        raise VariantError(f"--variant {text!r}: {path} defines no {attribute}() function")
    return Variant(kernel, name, build)


def load_variants(texts: list[str]) -> list[Variant]:
    variants = [load_variant(text) for text in texts]
    names = [variant.name for variant in variants]
    repeated = sorted({name for name in names if names.count(name) > 1})
    if repeated:
        raise VariantError(f"--variant: the name {repeated[0]!r} is given twice")
    return variants


def load_plan(text: str) -> Plan:
    """``split`` or ``fused:BV`` -> that state plan, named ``plan-split`` or ``plan-fused-BV``."""
    if text == "split":
        return Plan("plan-split", kernels.StatePlan(False, kernels.BV))
    kind, _, columns = text.partition(":")
    if kind == "fused" and columns in ("64", "128"):
        return Plan(f"plan-fused-{columns}", kernels.StatePlan(True, int(columns)))
    raise VariantError(f"--plan {text!r}: expected split, fused:64 or fused:128")


def use(variant: Variant | Plan | None) -> None:
    """Every kernel as shipped, but `variant`'s, or the forward planned as `variant` says (None: all
    shipped)."""
    for kernel, (module, attribute) in BUILDERS.items():
        setattr(module, attribute, SHIPPED_BUILDS[kernel])
    kernels.FORCED_PLAN = variant.plan if isinstance(variant, Plan) else None
    if isinstance(variant, Variant):
        module, attribute = BUILDERS[variant.kernel]
        setattr(module, attribute, variant.build)


def _nbytes(args: tuple) -> int:
    return sum(x.numel() * x.element_size() for x in args if isinstance(x, torch.Tensor))


def _tensors(result: Any) -> list[torch.Tensor]:
    if isinstance(result, torch.Tensor):
        return [result]
    if isinstance(result, (tuple, list)):
        return [tensor for item in result for tensor in _tensors(item)]
    return []


def difference(result: Any, shipped: Any, names: list[str]) -> str:
    """``name rel`` for each output: ``max |result - shipped| / max |shipped|`` ("NaN" where either has one
    the other has not, "missing" where the variant returned fewer outputs)."""
    ours, theirs = _tensors(result), _tensors(shipped)
    parts = []
    for index, reference in enumerate(theirs):
        name = names[index] if index < len(names) else str(index)
        if index >= len(ours):
            parts.append(f"{name} missing")
            continue
        x, y = ours[index].double(), reference.double()
        if bool(torch.isnan(x).ne(torch.isnan(y)).any()):
            parts.append(f"{name} NaN")
            continue
        finite = torch.isfinite(y)
        scale = y[finite].abs().max().item() if bool(finite.any()) else 0.0
        gap = (x - y)[finite].abs().max().item() if bool(finite.any()) else 0.0
        parts.append(f"{name} {gap / scale if scale else gap:.2e}")
    return ", ".join(parts)


def _report(times: dict[str, list[float]], moved: dict[str, int]) -> None:
    medians = {name: statistics.median(ms) for name, ms in times.items()}
    total = sum(medians.values())
    for name, ms in sorted(medians.items(), key=lambda item: -item[1]):
        rate = moved[name] / (ms * 1e-3) / 1e12
        print(f"  {name:14s} {ms:8.3f} ms  {100 * ms / total:5.1f}%  {moved[name] / 1e6:9.1f} MB  {rate:5.2f} TB/s")
    print(f"  {'sum':14s} {total:8.3f} ms", flush=True)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("shapes", nargs="+")
    parser.add_argument(
        "--mode", action="append", required=True, choices=["fwd", "fwd_pregated", "train_safe", "train_pregated"]
    )
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--variant", action="append", default=[], metavar="KERNEL:NAME=PATH")
    parser.add_argument("--plan", action="append", default=[], metavar="split|fused:BV")
    args = parser.parse_args()
    try:
        variants = load_variants(args.variant)
        plans = [load_plan(text) for text in dict.fromkeys(args.plan)]
    except VariantError as error:
        print(f"tilelang_stages: {error}", file=sys.stderr)
        return 2
    runs: dict[str, Variant | Plan | None] = {SHIPPED: None} | {variant.name: variant for variant in variants}
    runs |= {plan.name: plan for plan in plans}
    pending: list[tuple[str, int, torch.cuda.Event, torch.cuda.Event]] = []
    real = kernels.compile_all

    def timed(spec):
        def wrap(name, kernel):
            def run(*call_args):
                start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                start.record()
                kernel(*call_args)
                end.record()
                pending.append((name, _nbytes(call_args), start, end))

            return run

        return {name: wrap(name, kernel) for name, kernel in real(spec).items()}

    kernels.compile_all = timed  # type: ignore[assignment]
    for shape_name in args.shapes:
        for mode_name in args.mode:
            inputs = make_inputs(BenchShape.parse(shape_name), MODES[mode_name], "cuda", seed=0)
            run, why = call_for("tilelang", inputs, MODES[mode_name])
            if run is None:
                print(f"{shape_name} {mode_name}: not run ({why})")
                continue
            firsts: dict[str, Any] = {}
            for label, variant in runs.items():  # first calls (compilation) are not timed
                use(variant)
                began = time.perf_counter()
                firsts[label] = run()
                torch.cuda.synchronize()
                print(f"\n{shape_name} {mode_name} {label}: first call {time.perf_counter() - began:.1f} s", flush=True)
            names = list(inputs.leaves) if MODES[mode_name].training else ["o", "final_state"]
            for label in list(runs)[1:]:
                compared = difference(firsts[label], firsts[SHIPPED], names)
                print(f"  {label} against {SHIPPED}: {compared}", flush=True)
            firsts.clear()
            times: dict[str, dict[str, list[float]]] = {label: defaultdict(list) for label in runs}
            moved: dict[str, dict[str, int]] = {label: {} for label in runs}  # a plan changes what a kernel moves
            for step in range(args.steps):
                labels = list(runs)
                for label in labels[step % len(labels) :] + labels[: step % len(labels)]:  # rotated each step
                    use(runs[label])
                    pending.clear()
                    run()
                    torch.cuda.synchronize()
                    per_call: dict[str, float] = defaultdict(float)  # a kernel launched twice (qk_tail) adds up
                    bytes_per_call: dict[str, int] = defaultdict(int)
                    for name, nbytes, start, end in pending:
                        per_call[name] += start.elapsed_time(end)
                        bytes_per_call[name] += nbytes
                    for name, ms in per_call.items():
                        times[label][name].append(ms)
                    moved[label].update(bytes_per_call)
            use(None)
            for label in runs:
                print(f"\n{shape_name} {mode_name} {label}:")
                _report(times[label], moved[label])
            for variant in variants:
                if variant.kernel not in times[SHIPPED]:
                    print(f"  {variant.kernel} {variant.name}: not launched in {mode_name}")
                    continue
                ms = statistics.median(times[variant.name][variant.kernel])
                shipped = statistics.median(times[SHIPPED][variant.kernel])
                print(
                    f"  {variant.kernel} {variant.name}: {ms:.3f} ms against {shipped:.3f} shipped ({ms / shipped:.3f}x)"
                )
            for plan in plans:
                ms = sum(statistics.median(kernel_ms) for kernel_ms in times[plan.name].values())
                shipped = sum(statistics.median(kernel_ms) for kernel_ms in times[SHIPPED].values())
                print(f"  {plan.name}: {ms:.3f} ms of kernels against {shipped:.3f} shipped ({ms / shipped:.3f}x)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
