"""How accurate the triton backend's half-precision training is under each choice of matrix products.

    python benchmarks/training_precision.py SEED COUNT [--mix NAME ...] [--skip N] [--only I,J,...]
    python benchmarks/training_precision.py 12 56 --only 14,25,31,55 --gpu --backend triton --backend fla

Runs on a CPU, in Triton's interpreter, with ``tl.dot`` computed as an NVIDIA GPU computes it
(`tests/tf32.py`: TF32 operands truncated, TF32x3 split in three products). Draws COUNT random bf16/fp16
training cases from SEED (gate mode, l2norm, beta activation, varlen, GVA, states, layouts, chunk size,
K and V from 4 to 40, realistic or extreme gates), runs each against the float64 reference under every
mix asked for (`MIXES`: the ``storage.TRAINING_*`` setting of each kernel), and prints one JSON line a
case: per mix, whether it passed, its worst error / tolerance, the tensor that was worst, and ``dA_log``'s
relative error (the gradient the products' error shows in: a sum whose terms cancel). A summary per mix
goes to stderr at the end.

The draws are the ones `storage`'s settings were chosen on (seeds 11, 12, 101, 202; `docs/design.md`,
"Precision and storage"). A case takes about 3 s a mix. The four hardest for
version 18 are seed 12's cases 14, 25, 31 and 55.

With ``--gpu`` the same cases run on CUDA instead, through the named backends as shipped (no mixes, no
emulation): how FLA's `chunk_kda`, which keeps ``h`` and ``dh`` in bf16 and multiplies bf16 operands,
fares on them beside ours.

With ``--helion`` (CPU) each case runs through the triton backend as shipped and through the helion
backend's compiled kernels (the Triton code Helion generates for the launch configurations an H200 gets,
in Triton's interpreter, products emulated as above), with K and V rounded up to multiples of 16, the
helion backend's head dims: whether its training is as accurate as the triton backend's on the same cases.
Each helion case compiles its own kernels (tens of seconds on a CPU).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import random
import sys
import warnings
from pathlib import Path

GPU = "--gpu" in sys.argv
if not GPU:
    os.environ["TRITON_INTERPRET"] = "1"  # before Triton is imported
ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT), str(ROOT / "tests")]

import pytest  # noqa: E402
from tf32 import emulate_gpu_dots  # noqa: E402

import kda  # noqa: E402
from kda.backends.triton import TritonBackend, storage  # noqa: E402
from kda.spec import CaseClass, GateMode  # noqa: E402
from kda.verify.cases import VerificationCase  # noqa: E402
from kda.verify.check import run_case  # noqa: E402

X3, TF32, ROUNDED, HALVES = "tf32x3", "tf32", storage.TF32_ROUNDED, storage.BF16_HALVES


def _mix(intra: str, state: str, backward_state: str, backward_chunk: str) -> dict[str, str]:
    return {
        "TRAINING_INTRA": intra,
        "TRAINING_STATE": state,
        "TRAINING_BACKWARD_STATE": backward_state,
        "TRAINING_BACKWARD_CHUNK": backward_chunk,
    }


# Named mixes (each sets the experiment-only `storage.TRAINING_*` attributes; the shipped values are
# "v16"'s, restored after the run): version 16 (all TF32x3, shipped again in version 19), version 17 (the
# backward state pass rounded; versions 17 and 18, until CI drew a case it fails), and the other mixes tried
# then; "truncated_12" is versions 12 to 15 (TF32 in intra and the backward state pass); "halves" and
# "halves_backward" multiply fp32 operands as bf16 halves (`storage.dot`), everywhere or in the backward.
MIXES = {
    "v16": _mix(X3, X3, X3, X3),
    "v17": _mix(X3, X3, ROUNDED, X3),
    "truncated_12": _mix(TF32, X3, TF32, X3),
    "truncated_backward_state": _mix(X3, X3, TF32, X3),
    "rounded_intra_too": _mix(ROUNDED, X3, ROUNDED, X3),
    "rounded_chunk_too": _mix(X3, X3, ROUNDED, ROUNDED),
    "rounded_all_but_intra": _mix(X3, ROUNDED, ROUNDED, ROUNDED),
    "halves": _mix(HALVES, HALVES, HALVES, HALVES),
    "halves_backward": _mix(X3, X3, HALVES, HALVES),
}


def draw(rng: random.Random) -> VerificationCase:
    """One random half-precision training case (the order of the draws is fixed: seeds reproduce)."""
    chunk = rng.choice([32, 64])
    varlen, gva = rng.random() < 0.5, rng.random() < 0.5
    dtype = rng.choice(["float16", "bfloat16"])
    case_class = CaseClass(
        gate=rng.choice(list(GateMode)),
        qk_l2norm=rng.random() < 0.5,
        beta=rng.choice(["given", "sigmoid", "sigmoid2"]),
        dtype=dtype,
        varlen=varlen,
        gva=gva,
        initial_state=rng.random() < 0.5,
        final_state=rng.random() < 0.5,
        state_v_first=rng.random() < 0.5,
        chunk_size=chunk,
        head_dim=64,
        training=True,
    )
    if varlen:
        seq_lens = tuple(rng.randint(0, 2 * chunk + 3) for _ in range(rng.randint(1, 3)))
        seq_lens = seq_lens if sum(seq_lens) else (*seq_lens, 1)
        batch = 1
    else:
        batch = rng.randint(1, 2)
        seq_lens = (rng.randint(1, 2 * chunk + 3),) * batch
    group = rng.choice([2, 3]) if gva else 1
    K, V = rng.randint(4, 40), rng.randint(4, 40)
    regime = rng.choice(["realistic", "extreme"])
    g_dtype = "float32" if dtype == "float16" else dtype
    return VerificationCase(
        case_class, regime, batch, 1, group, K, V, seq_lens, g_dtype, seed=rng.randint(0, 2**31 - 1)
    )


def _case_row(index: int, case: VerificationCase) -> dict:
    """The start of a case's JSON line: what the case is."""
    return {"index": index, "key": case.case_class.key, "regime": case.regime, "K": case.K, "V": case.V,
            "seq_lens": case.seq_lens, "seed": case.seed}  # fmt: skip


def _outcome(result) -> list:
    """Passed, worst error / tolerance, the worst tensor, and ``dA_log``'s relative error."""
    tensor = max(result.ratios, key=result.ratios.get) if result.ratios else None
    return [result.passed, round(result.worst_ratio, 4), tensor, result.errors.get("dA_log")]


def _print_summary(worst: dict[str, list[float]], failures: dict[str, int]) -> None:
    """One line per mix or backend on stderr: failures, worst and median error / tolerance."""
    for name, found in worst.items():
        ratios = sorted(found)
        if ratios:
            print(
                f"{name}: {failures[name]} failed of {len(ratios)}, worst error / tolerance {ratios[-1]:.3f}, "
                f"median {ratios[len(ratios) // 2]:.3f}",
                file=sys.stderr,
            )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("seed", type=int)
    parser.add_argument("count", type=int)
    parser.add_argument("--mix", action="append", choices=list(MIXES), help="default: v16 and v17")
    parser.add_argument("--skip", type=int, default=0, help="draw but do not run the first N cases")
    parser.add_argument("--only", help="comma-separated case indices to run (the others are drawn, not run)")
    parser.add_argument("--gpu", action="store_true", help="run on CUDA through --backend, as shipped")
    parser.add_argument("--backend", action="append", help="with --gpu: the backends (default: triton, fla)")
    parser.add_argument("--helion", action="store_true", help="the helion backend's compiled kernels beside triton")
    args = parser.parse_args()
    only = None if args.only is None else {int(i) for i in args.only.split(",")}
    if args.gpu:
        _on_the_gpu(args.seed, args.count, args.skip, only, args.backend or ["triton", "fla"])
        return
    if args.helion:
        _helion_beside_triton(args.seed, args.count, args.skip, only)
        return
    mixes = args.mix or ["v16", "v17"]

    patch = pytest.MonkeyPatch()
    emulate_gpu_dots(patch)
    shipped = {name: getattr(storage, name) for name in MIXES["v16"]}
    rng = random.Random(args.seed)
    worst: dict[str, list[float]] = {mix: [] for mix in mixes}
    failures = dict.fromkeys(mixes, 0)
    try:
        for index in range(args.count):
            case = draw(rng)
            if index < args.skip or (only is not None and index not in only):
                continue
            row = _case_row(index, case)
            for mix in mixes:
                for name, value in MIXES[mix].items():
                    setattr(storage, name, value)
                result = run_case(TritonBackend(), case, "cpu")
                row[mix] = _outcome(result)
                worst[mix].append(result.worst_ratio)
                failures[mix] += not result.passed
            print(json.dumps(row), flush=True)
    finally:
        for name, value in shipped.items():
            setattr(storage, name, value)
        patch.undo()
    _print_summary(worst, failures)


def _on_the_gpu(seed: int, count: int, skip: int, only: set[int] | None, backends: list[str]) -> None:
    """The drawn cases on CUDA through each backend as shipped: one JSON line a case."""
    rng = random.Random(seed)
    for index in range(count):
        case = draw(rng)
        if index < skip or (only is not None and index not in only):
            continue
        row = _case_row(index, case)
        for name in backends:
            result = run_case(kda.get_backend(name), case, "cuda")
            row[name] = [*_outcome(result), (result.reason or "")[:120]]
        print(json.dumps(row), flush=True)


def at_helions_head_dims(case: VerificationCase) -> VerificationCase:
    """The case with K and V rounded up to multiples of 16 (the helion backend's head dims)."""
    return dataclasses.replace(case, K=-(-case.K // 16) * 16, V=-(-case.V // 16) * 16)


def _helion_beside_triton(seed: int, count: int, skip: int, only: set[int] | None) -> None:
    """The drawn cases at the helion backend's head dims on the CPU, through the triton backend as shipped
    and the helion backend's compiled kernels, products emulated as a GPU computes them: one JSON line a
    case, a summary per backend on stderr."""
    from helion_compiled import as_on_an_h200, interpreter_bridges

    from kda.backends import helion as helion_backend
    from kda.backends.base import Verdict

    patch = pytest.MonkeyPatch()
    emulate_gpu_dots(patch)  # before the bridges, which widen bf16 operands on the way to it
    as_on_an_h200(patch)
    patch.delenv("HELION_INTERPRET", raising=False)
    patch.setattr(helion_backend.HelionBackend, "supports", lambda self, spec: Verdict.yes("compiled, interpreted"))
    backends = {"triton": TritonBackend(), "helion": helion_backend.HelionBackend()}
    worst: dict[str, list[float]] = {name: [] for name in backends}
    failures = dict.fromkeys(backends, 0)
    rng = random.Random(seed)
    try:
        with interpreter_bridges(), warnings.catch_warnings():
            warnings.filterwarnings("ignore", message="kda: helion kernel .* default configuration")
            for index in range(count):
                case = at_helions_head_dims(draw(rng))
                if index < skip or (only is not None and index not in only):
                    continue
                row = _case_row(index, case)
                for name, backend in backends.items():
                    result = run_case(backend, case, "cpu")
                    row[name] = _outcome(result)
                    worst[name].append(result.worst_ratio)
                    failures[name] += not result.passed
                print(json.dumps(row), flush=True)
    finally:
        patch.undo()
    _print_summary(worst, failures)


if __name__ == "__main__":
    main()
