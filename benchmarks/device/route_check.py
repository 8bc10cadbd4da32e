"""On a GPU with fla and flash_kda installed: prove which kernels each path runs.

1. FLA's public `fla.ops.kda.chunk_kda` sends an inference call to FlashKDA (its own dispatch);
2. kda's `fla` backend does not (it is FLA's Triton path), and kda's `flashkda` backend does;
3. both agree with the float64 reference at a mid-size shape.
Prints one JSON line per finding; exits 1 if a finding is not as stated.
"""

from __future__ import annotations

import json
import sys

import torch

import kda
from kda.bench.shapes import MODES, BenchShape, make_inputs
from kda.verify.check import relative_error


def main() -> int:
    import fla.ops.kda as fla_kda
    import flash_kda

    calls = {"n": 0}
    real = flash_kda.fwd

    def counting(*args, **kwargs):
        calls["n"] += 1
        return real(*args, **kwargs)

    flash_kda.fwd = counting
    inputs = make_inputs(BenchShape.parse("B1_T1024_H4_D128"), MODES["fwd"], "cuda", seed=7)
    kwargs = inputs.kwargs
    kwargs["state_v_first"] = True  # FLA's own FlashKDA dispatch takes only this layout
    ok = True

    def finding(name: str, value, expected) -> None:
        nonlocal ok
        good = value == expected
        ok &= good
        print(json.dumps({"finding": name, "value": value, "expected": expected, "ok": good}), flush=True)

    with torch.no_grad():
        before = calls["n"]
        fla_kda.chunk_kda(**kwargs)
        finding("fla public chunk_kda calls flash_kda.fwd (FLA's own dispatch)", calls["n"] > before, True)
        before = calls["n"]
        with kda.trace_routes() as routes:
            o_fla, s_fla = kda.chunk_kda(**kwargs, backend="fla")
        finding("kda backend=fla calls flash_kda.fwd", calls["n"] > before, False)
        finding("kda backend=fla route", [r.backend for r in routes], ["fla"])
        before = calls["n"]
        with kda.trace_routes() as routes:
            o_fk, s_fk = kda.chunk_kda(**kwargs, backend="flashkda")
        finding("kda backend=flashkda calls flash_kda.fwd", calls["n"] > before, True)

    ref_kwargs = {
        k: (
            v.detach().cpu().double()
            if isinstance(v, torch.Tensor) and k not in ("cu_seqlens", "cu_seqlens_cpu")
            else v
        )
        for k, v in kwargs.items()
        if k != "cu_seqlens_cpu"
    }
    o_ref, s_ref = kda.kda_reference(**ref_kwargs)
    for name, o, s in (("fla", o_fla, s_fla), ("flashkda", o_fk, s_fk)):
        print(
            json.dumps(
                {"backend": name, "o_rel_err": relative_error(o, o_ref), "state_rel_err": relative_error(s, s_ref)}
            ),
            flush=True,
        )
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
