"""The benchmark workloads: the shapes, the modes, and the inputs for each.

`python -m kda.bench` measures them (`kda.bench.shapes` re-exports this module) and
`python -m kda.verify --with-bench-classes` verifies their case classes up front, so they live here, below
both, which never import each other.

Shapes are named so that the name is the shape:

- dense ``B{batch}_T{tokens}_H{heads}_D{head dim}``, e.g. ``B1_T8192_H96_D128``;
- varlen ``varlen_H{heads}_D{head dim}_L{lengths}``, lengths joined by ``-`` with ``{len}x{count}`` for
  repeats, e.g. ``varlen_H96_D128_L1024x8`` (B = 1, T = the sum of the lengths).

K = V = D and HV = H (no GVA) in every bench shape. Modes (all bf16, l2norm and beta sigmoid in kernel):

- ``fwd``: inference forward with the safe in-kernel gate (``lower_bound=-5``, ``A_log``, ``dt_bias``),
  an initial state and the final state returned, no gradient (what a serving prefill does);
- ``fwd_pregated``: the same with a pre-gated log decay ``g`` (a model that applies the gate itself);
- ``train_pregated``: forward + backward with a pre-gated log decay ``g``, no states;
- ``train_safe``: forward + backward with the safe in-kernel gate, no states; gradients for every input.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F

from kda.spec import KDASpec


@dataclass(frozen=True)
class BenchShape:
    name: str
    B: int
    T: int
    H: int
    D: int
    seq_lens: tuple[int, ...] | None = None  # varlen: one length per sequence, B == 1

    @property
    def varlen(self) -> bool:
        return self.seq_lens is not None

    @property
    def num_seqs(self) -> int:
        return len(self.seq_lens) if self.seq_lens is not None else self.B

    @classmethod
    def parse(cls, name: str) -> BenchShape:
        """A shape from its name (see the module docstring); ValueError when the name is not one."""
        dense = re.fullmatch(r"B(\d+)_T(\d+)_H(\d+)_D(\d+)", name)
        if dense:
            B, T, H, D = map(int, dense.groups())
            return cls(name, B, T, H, D)
        varlen = re.fullmatch(r"varlen_H(\d+)_D(\d+)_L([0-9x-]+)", name)
        if varlen:
            H, D = int(varlen.group(1)), int(varlen.group(2))
            lengths: list[int] = []
            for item in varlen.group(3).split("-"):
                length, _, count = item.partition("x")
                if not length.isdigit() or (count and not count.isdigit()):
                    raise ValueError(f"bad length {item!r} in shape {name!r}")
                lengths += [int(length)] * (int(count) if count else 1)
            return cls(name, 1, sum(lengths), H, D, tuple(lengths))
        raise ValueError(f"not a bench shape name: {name!r} (e.g. B1_T8192_H96_D128 or varlen_H96_D128_L1024x8)")


DENSE_SHAPES = [
    "B1_T8192_H96_D128",
    "B2_T16384_H16_D128",
    "B4_T2048_H16_D128",
    "B4_T4096_H64_D128",
    "B8_T2048_H32_D256",
    "B8_T1024_H8_D64",
]
VARLEN_SHAPES = [
    f"varlen_H{H}_D128_L{lengths}" for H in (96, 64) for lengths in ("8192", "1300-547-2048-963-271-3063", "1024x8")
]
DEFAULT_SHAPES = DENSE_SHAPES + VARLEN_SHAPES


@dataclass(frozen=True)
class Mode:
    name: str
    training: bool
    gate: str  # "safe" or "pregated"
    states: bool  # initial state in, final state out


MODES = {
    "fwd": Mode("fwd", training=False, gate="safe", states=True),
    "fwd_pregated": Mode("fwd_pregated", training=False, gate="pregated", states=True),
    "train_pregated": Mode("train_pregated", training=True, gate="pregated", states=False),
    "train_safe": Mode("train_safe", training=True, gate="safe", states=False),
}


@dataclass
class BenchInputs:
    kwargs: dict[str, Any]  # for kda.chunk_kda(**kwargs) (and FLA's chunk_kda, which takes the same)
    leaves: dict[str, torch.Tensor]  # inputs that need gradients (training modes)
    do: torch.Tensor | None  # dL/do for the backward (training modes)


def make_inputs(shape: BenchShape, mode: Mode, device: torch.device | str, seed: int) -> BenchInputs:
    """Random, realistic inputs (never zeros): unit-scale q/k/v, beta logits, gates of a trained model."""
    device = torch.device(device)
    gen = torch.Generator(device=device).manual_seed(seed)
    B, T, H, D = shape.B, shape.T, shape.H, shape.D
    bf16 = torch.bfloat16

    def randn(*size: int, dtype: torch.dtype = bf16, scale: float = 1.0, shift: float = 0.0) -> torch.Tensor:
        return (torch.randn(*size, generator=gen, device=device, dtype=torch.float32) * scale + shift).to(dtype)

    kwargs: dict[str, Any] = {
        "q": randn(B, T, H, D),
        "k": randn(B, T, H, D),
        "v": randn(B, T, H, D),
        "beta": randn(B, T, H),
        "use_qk_l2norm_in_kernel": True,
        "use_beta_sigmoid_in_kernel": True,
    }
    if mode.gate == "safe":
        kwargs["g"] = randn(B, T, H, D)
        kwargs["A_log"] = torch.rand(H, generator=gen, device=device) * math.log(16.0)
        kwargs["dt_bias"] = randn(H * D, dtype=torch.float32, scale=0.5)
        kwargs.update(use_gate_in_kernel=True, safe_gate=True, lower_bound=-5.0)
    else:
        kwargs["g"] = F.logsigmoid(randn(B, T, H, D, dtype=torch.float32, scale=1.5, shift=3.0)).to(bf16)
    if shape.varlen:
        bounds = [0]
        for length in shape.seq_lens or ():
            bounds.append(bounds[-1] + length)
        kwargs["cu_seqlens"] = torch.tensor(bounds, dtype=torch.int64, device=device)
        kwargs["cu_seqlens_cpu"] = torch.tensor(bounds, dtype=torch.int64)
    if mode.states:
        kwargs["initial_state"] = randn(shape.num_seqs, H, D, D, dtype=torch.float32, scale=0.1)
        kwargs["output_final_state"] = True

    leaves: dict[str, torch.Tensor] = {}
    do = None
    if mode.training:
        for name in ("q", "k", "v", "g", "beta", "A_log", "dt_bias"):
            if name in kwargs:
                kwargs[name].requires_grad_(True)
                leaves[name] = kwargs[name]
        do = randn(B, T, H, D)
    return BenchInputs(kwargs, leaves, do)


def case_class_keys(shapes: list[str], modes: list[str]) -> list[str]:
    """The verification case classes that the bench's calls fall in (so they can be verified up front)."""
    keys: dict[str, None] = {}
    for name in shapes:
        shape = BenchShape.parse(name)
        small = BenchShape(
            name, 1 if shape.varlen else min(shape.B, 2), 8, 1, shape.D, (4, 4) if shape.varlen else None
        )
        for mode_name in modes:
            inputs = make_inputs(small, MODES[mode_name], "cpu", seed=0)
            spec = KDASpec.from_call(**inputs.kwargs, requires_grad=MODES[mode_name].training)
            keys[spec.case_class.key] = None
    return list(keys)
