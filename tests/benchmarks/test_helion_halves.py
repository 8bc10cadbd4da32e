"""benchmarks/helion_halves.py's serial passes (the forward state pass and the backward's reverse pass) in
its three forms, run by Helion's interpreter on the CPU against their float64 recurrences: the backend's
kernels with fp32 operands, the same kernels on halves (``HALVES``, ``k_g`` and ``q_e`` made and split in
registers) and the variants reading stored halves. Every output element written, the halves' forms within
the 2^-16 they carry, and not the fp32 form's numbers (so the halves' products are what ran)."""

from __future__ import annotations

import itertools

import pytest
import torch
from benchmark_scripts import load

from kda.verify.check import relative_error

helion = pytest.importorskip("helion", reason="helion is not installed (extra `test`)")


helion_halves = load("helion_halves")


def _forward(x: dict[str, torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
    """(v_new, h) in float64, chunk after chunk of each sequence."""
    w, k_g, u, G = (x[name].double() for name in ("w", "k_g", "u", "G"))
    NT, HV, C, K = w.shape
    v_new, h = torch.empty_like(u), torch.empty(NT, HV, K, u.shape[-1], dtype=torch.float64)
    for start, end in itertools.pairwise(x["chunk_bounds"].tolist()):
        S = torch.zeros(HV, K, u.shape[-1], dtype=torch.float64)
        for j in range(start, end):
            h[j] = S
            v_new[j] = u[j] - w[j] @ S
            S = G[j, :, C - 1].exp()[..., None] * S + k_g[j].transpose(-1, -2) @ v_new[j]
    return v_new, h


def _backward(x: dict[str, torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
    """(dh, dv_new) in float64, chunk after chunk of each sequence from its last; ``do`` past a sequence's end
    is none of its chunk's."""
    w, k_g, q_e, A, G = (x[name].double() for name in ("w", "k_g", "q_e", "A_qk", "G"))
    NT, HV, C, K = w.shape
    V = x["do"].shape[-1]
    do = torch.zeros(NT, HV, C, V, dtype=torch.float64)
    for j, (begin, end) in enumerate(zip(x["chunk_starts"].tolist(), x["chunk_seq_ends"].tolist())):
        rows = min(C, end - begin)
        do[j, :, :rows] = x["do"][begin : begin + rows].double().transpose(0, 1)
    dh, dv_new = torch.empty(NT, HV, K, V, dtype=torch.float64), torch.empty(NT, HV, C, V, dtype=torch.float64)
    for start, end in itertools.pairwise(x["chunk_bounds"].tolist()):
        dS = torch.zeros(HV, K, V, dtype=torch.float64)
        for j in reversed(range(start, end)):
            dh[j] = dS
            dv_new[j] = A[j].transpose(-1, -2) @ do[j] + k_g[j] @ dS
            dS = G[j, :, C - 1].exp()[..., None] * dS + q_e[j].transpose(-1, -2) @ do[j]
            dS = dS - w[j].transpose(-1, -2) @ dv_new[j]
    return dh, dv_new


REFERENCES = {"state": _forward, "state_backward": _backward}


@pytest.mark.parametrize("stage", helion_halves.PASSES, ids=lambda stage: stage.name)
def test_a_serial_pass_on_halves_against_the_recurrence_and_the_shipped_kernel(seed, monkeypatch, stage):
    from kda.backends.helion import runtime

    monkeypatch.setenv("HELION_INTERPRET", "1")
    runtime.register_cpu_matmul()
    B, T, HV, K, V, C = 2, 40, 3, 32, 16, 16  # chunks of 16, 16 and 8 tokens a sequence
    x = helion_halves.inputs(B, T, HV, K, V, C, "cpu", seed=seed)
    wanted = REFERENCES[stage.name](x)

    results = {}
    for name, kernel, make_args in (
        ("fp32", stage.backend(), stage.fp32_args),
        ("backend", stage.backend(), stage.backend_args),
        ("halves", stage.variant, stage.variant_args),
    ):
        buffers = stage.buffers(x, K, V)
        for out, buffer in zip(stage.outputs, buffers):
            if out != "v_new" or stage.name != "state":  # v_new is written over u, the rest are outputs only
                buffer.fill_(float("nan"))  # an element not written fails
        precision = {"dot_precision": "ieee"} if name == "fp32" else {}
        helion.kernel(kernel, static_shapes=False, **precision)(*make_args(x, *buffers, C))
        assert all(torch.isfinite(buffer).all() for buffer in buffers), name
        results[name] = [relative_error(got.double(), want) for got, want in zip(buffers, wanted)]

    assert max(results["fp32"]) < 1e-6, results  # fp32 products, exact up to fp32 rounding
    for form in ("backend", "halves"):
        assert max(results[form]) < 2**-13, results  # 16 significant bits an operand, summed over chunks
        assert max(results[form]) > 2 * max(results["fp32"]), results  # the halves' products ran


@pytest.mark.parametrize("stage", helion_halves.PASSES, ids=lambda stage: stage.name)
def test_the_timed_kernels_are_never_autotuned(stage):
    """Given no configuration, Helion 1.5 autotunes at the first call (it took a whole device run): the
    default kernel asks for Helion's default configuration, and each candidate names its own."""
    kernels = helion_halves.variant_kernels(stage.variant)
    assert kernels["default"].settings.autotune_effort == "none"
    assert all(kernel.configs for label, kernel in kernels.items() if label != "default")
