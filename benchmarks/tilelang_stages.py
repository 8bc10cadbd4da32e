"""The tilelang backend's GPU time per kernel, at bench shapes (GPU only).

    KDA_VERIFY=off python benchmarks/tilelang_stages.py --mode fwd --mode fwd_pregated B1_T8192_H96_D128
    KDA_VERIFY=off python benchmarks/tilelang_stages.py --mode train_safe B1_T8192_H96_D128
    KDA_VERIFY=off python benchmarks/tilelang_stages.py --mode fwd --intra-variant halves=/tmp/intra.py B1_T8192_H96_D128

Runs the bench's own callable (`kda.bench.runner.call_for`, so exactly what the bench times) with each of
the backend's kernels wrapped in CUDA events (the forward's three; in a training mode, ``train_safe`` or
``train_pregated``, the backward's five too), and prints each kernel's median GPU milliseconds per call
(summed over its launches in the call: ``qk_tail`` runs for q and for k), its share, and the bytes it must
move at least (its inputs read once, its outputs written once) over that time, against the H200's
~4.3 TB/s copy rate measured here.

``--intra-variant NAME=PATH`` (repeatable) also times an `intra` kernel built by the ``build`` function of
the Python file PATH (a changed copy of ``kda/backends/tilelang/intra.py``), in the same process, its calls
interleaved step by step with the shipped kernel's, so that a change to `intra` is measured against the
kernel it would replace on the same GPU, clocks and inputs. Nothing here verifies a variant: its numbers
are checked by `kda.verify` once it replaces the shipped file.
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
from typing import Any

import torch

from kda.backends.tilelang import intra, kernels
from kda.bench.runner import call_for
from kda.bench.shapes import MODES, BenchShape, make_inputs

SHIPPED = "shipped"


class VariantError(ValueError):
    """An ``--intra-variant`` that cannot be used, with what is wrong."""


def load_variant(text: str) -> tuple[str, Callable[..., Any]]:
    """``NAME=PATH`` -> (NAME, the ``build`` function of the file PATH)."""
    name, sep, path = text.partition("=")
    if not sep or not name or not path:
        raise VariantError(f"--intra-variant {text!r}: expected NAME=PATH")
    if name == SHIPPED:
        raise VariantError(f"--intra-variant {text!r}: the name {SHIPPED!r} is the shipped kernel's")
    if not Path(path).is_file():
        raise VariantError(f"--intra-variant {text!r}: no file {path}")
    spec = importlib.util.spec_from_file_location(f"intra_variant_{name}", path)
    if spec is None or spec.loader is None:
        raise VariantError(f"--intra-variant {text!r}: {path} is not a Python file")
    module = importlib.util.module_from_spec(spec)
    try:
        spec.loader.exec_module(module)
    except Exception as error:  # a variant is work in progress: any failure is a message, not a traceback
        raise VariantError(
            f"--intra-variant {text!r}: {path} does not import ({type(error).__name__}: {error})"
        ) from error
    build = getattr(module, "build", None)
    if not callable(build):
        raise VariantError(f"--intra-variant {text!r}: {path} defines no build() function")
    return name, build


def _nbytes(args: tuple) -> int:
    return sum(x.numel() * x.element_size() for x in args if isinstance(x, torch.Tensor))


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
    parser.add_argument("--intra-variant", action="append", default=[], metavar="NAME=PATH")
    args = parser.parse_args()
    try:
        builds = dict([(SHIPPED, intra.build)] + [load_variant(text) for text in args.intra_variant])
    except VariantError as error:
        print(f"tilelang_stages: {error}", file=sys.stderr)
        return 2
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
            for variant, build in builds.items():  # first calls (compilation) are not timed
                intra.build = build  # `kernels.specializations` looks it up at every call
                began = time.perf_counter()
                run()
                torch.cuda.synchronize()
                print(
                    f"\n{shape_name} {mode_name} {variant}: first call {time.perf_counter() - began:.1f} s", flush=True
                )
            times: dict[str, dict[str, list[float]]] = {variant: defaultdict(list) for variant in builds}
            moved: dict[str, int] = {}
            for step in range(args.steps):
                names = list(builds)
                for variant in names[step % len(names) :] + names[: step % len(names)]:  # rotated each step
                    intra.build = builds[variant]
                    pending.clear()
                    run()
                    torch.cuda.synchronize()
                    per_call: dict[str, float] = defaultdict(float)  # a kernel launched twice (qk_tail) adds up
                    bytes_per_call: dict[str, int] = defaultdict(int)
                    for name, nbytes, start, end in pending:
                        per_call[name] += start.elapsed_time(end)
                        bytes_per_call[name] += nbytes
                    for name, ms in per_call.items():
                        times[variant][name].append(ms)
                    moved.update(bytes_per_call)
            intra.build = builds[SHIPPED]
            for variant in builds:
                print(f"\n{shape_name} {mode_name} {variant}:")
                _report(times[variant], moved)
            if len(builds) > 1:
                shipped = statistics.median(times[SHIPPED]["intra"])
                for variant in list(builds)[1:]:
                    ms = statistics.median(times[variant]["intra"])
                    print(f"  intra {variant}: {ms:.3f} ms against {shipped:.3f} shipped ({ms / shipped:.3f}x)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
