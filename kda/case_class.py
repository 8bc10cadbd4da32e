"""Case classes: the kinds of `chunk_kda` call that one verification record covers.

Two calls in the same class exercise the same code paths of any backend ("Case classes" in
`docs/design.md`); sizes vary within a class. The class of a call is `KDASpec.case_class`; its `key` is
the stable name records, timings and `kda.explain` use.
"""

from __future__ import annotations

from enum import Enum
from typing import Literal, cast

from pydantic import BaseModel, ConfigDict


class GateMode(str, Enum):
    """How `g` becomes the per-token log decay, as FLA 0.6 computes it (chosen by `use_gate_in_kernel`,
    `lower_bound` and `safe_gate`). ``exp(A_log[h])`` is 1 where A_log is None (the sigmoid gates)."""

    PREGATED = "pregated"  # use_gate_in_kernel=False: g is already the log decay (<= 0)
    SOFTPLUS = "softplus"  # lower_bound None: g <- -exp(A_log[h]) * softplus(g + dt_bias[h])
    # lower_bound set, safe_gate=False: g <- lower_bound * sigmoid(exp(A_log[h]) * (g + dt_bias[h])), any bound <= 0
    SIGMOID = "sigmoid"
    # the same with safe_gate=True, which promises -5 <= lower_bound < 0: the anchored fast numerics
    SAFE = "safe"

    @property
    def bounded_sigmoid(self) -> bool:
        """Whether the log decay is ``lower_bound * sigmoid(...)`` (the sigmoid and safe gates)."""
        return self in (GateMode.SIGMOID, GateMode.SAFE)


BetaMode = Literal["given", "sigmoid", "sigmoid2"]
DtypeName = Literal["bfloat16", "float16", "float32", "float64"]
ChunkSize = Literal[32, 64]
HeadDim = Literal[64, 128, 256]
_BETA_OF_KEY: dict[str, BetaMode] = {"beta": "given", "sig": "sigmoid", "sig2": "sigmoid2"}
_DTYPE_OF_KEY: dict[str, DtypeName] = {"bf16": "bfloat16", "fp16": "float16", "fp32": "float32", "fp64": "float64"}
_KEY_OF_DTYPE: dict[str, str] = {name: key for key, name in _DTYPE_OF_KEY.items()}


class CaseClass(BaseModel):
    """The class of calls that one verification record covers ("Case classes" in `docs/design.md`).

    Two calls in the same class exercise the same code paths of any backend: same gate mode, in-kernel
    flags, dtype, layout features, chunk size, head-dimension bucket and need for gradients. Sizes
    (B, T, H, the exact K and V up to the bucket) vary within a class.
    """

    model_config = ConfigDict(frozen=True)

    gate: GateMode
    qk_l2norm: bool
    beta: BetaMode
    dtype: DtypeName
    varlen: bool
    gva: bool
    initial_state: bool
    final_state: bool
    state_v_first: bool  # normalised to False when the call has no state at all
    chunk_size: ChunkSize
    head_dim: HeadDim  # bucket of max(K, V)
    training: bool
    intermediate_states: bool = False  # return_intermediate_states: the per-chunk states are an output too
    graph: bool = False  # use_graph with variable length: cu_seqlens may be read on the device only

    @property
    def key(self) -> str:
        """A short stable name, e.g. ``safe/l2/sig/bf16/varlen/gva/h0+ht:vk/c64/d128/train``.

        The per-chunk states add ``hc`` to the states part (``h0+ht+hc``); use_graph's variable length is
        ``varlen:graph``."""
        parts_of_states = (("h0", self.initial_state), ("ht", self.final_state), ("hc", self.intermediate_states))
        states = "+".join(s for s, on in parts_of_states if on) or "nostate"
        if self.state_v_first:
            states += ":vk"
        beta = {"given": "beta", "sigmoid": "sig", "sigmoid2": "sig2"}[self.beta]
        dtype = _KEY_OF_DTYPE[self.dtype]
        parts = [
            self.gate.value,
            "l2" if self.qk_l2norm else "qk",
            beta,
            dtype,
            ("varlen:graph" if self.graph else "varlen") if self.varlen else "dense",
            "gva" if self.gva else "mha",
            states,
            f"c{self.chunk_size}",
            f"d{self.head_dim}",
            "train" if self.training else "fwd",
        ]
        return "/".join(parts)

    @classmethod
    def from_key(cls, key: str) -> CaseClass:
        """Inverse of `key`."""
        try:
            gate, qk, beta, dtype, layout, heads, states, chunk, dim, mode = key.split("/")
            state_v_first = states.endswith(":vk")
            held = states.removesuffix(":vk").split("+")
            return cls(
                gate=GateMode(gate),
                qk_l2norm=qk == "l2",
                beta=_BETA_OF_KEY[beta],
                dtype=_DTYPE_OF_KEY[dtype],
                varlen=layout in ("varlen", "varlen:graph"),
                graph=layout == "varlen:graph",
                gva=heads == "gva",
                initial_state="h0" in held,
                final_state="ht" in held,
                intermediate_states="hc" in held,
                state_v_first=state_v_first,
                # pydantic checks these are one of the allowed sizes (a ValueError if not)
                chunk_size=cast(ChunkSize, int(chunk.removeprefix("c"))),
                head_dim=cast(HeadDim, int(dim.removeprefix("d"))),
                training=mode == "train",
            )
        except (ValueError, KeyError) as error:
            raise ValueError(f"not a case-class key: {key!r}") from error


def trains(key: str) -> bool:
    """Whether the case class named `key` is a training one (its calls run the backward): ``.../train``.
    Inference classes (``.../fwd``) and the decode op's (``recurrent/...``) are not."""
    return key.endswith("/train")


def head_dim_bucket(dim: int) -> HeadDim:
    """The smallest of 64, 128, 256 that holds `dim` (kernels tile head dimensions by these)."""
    return 64 if dim <= 64 else 128 if dim <= 128 else 256
