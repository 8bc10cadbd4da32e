"""``python -m kda.bench.cold``: one first call in this fresh process, timed; prints one JSON line.

Package imports happen before the clock starts, for baselines and kda backends alike (they are a cost of
the process, not of the shape); the timed call includes everything else a first call does: kda's spec
check and first dispatch (with a first-use verification if no record exists), compilation and tuning.

Run by `kda.bench.timing.cold_start`; not meant to be run by hand (but it can be).
"""

from __future__ import annotations

import argparse
import json
import time


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m kda.bench.cold")
    parser.add_argument("--backend", required=True)
    parser.add_argument("--shape", required=True)
    parser.add_argument("--mode", required=True)
    parser.add_argument("--device", default="cuda")
    args = parser.parse_args(argv)

    import torch

    from kda.bench.runner import call_for, synchronize
    from kda.bench.shapes import MODES, BenchShape, make_inputs

    device = torch.device(args.device)
    torch.zeros(1, device=device)  # bring up the device before timing (not part of any backend's cost)
    shape, mode = BenchShape.parse(args.shape), MODES[args.mode]
    inputs = make_inputs(shape, mode, device, seed=1234)
    call, why_not = call_for(args.backend, inputs, mode)  # imports a baseline's package
    from kda import registry

    registry.available_backends()  # imports every kda backend's package: imports are not a shape's cost
    if call is None:
        raise SystemExit(f"{args.backend} cannot run {args.shape}/{args.mode}: {why_not}")
    synchronize(device)
    started = time.perf_counter()
    call()
    synchronize(device)
    first = time.perf_counter() - started
    print(json.dumps({"first_call_s": first}))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
