"""The verifier's extreme regime puts a full reset in every sequence of a pre-gated or softplus case: one token
(not a sequence's first, not a chunk's first) whose log decay is -inf / -1e30 (pre-gated) or whose softplus
gate input is 1e30. The float64 reference stays finite on them, gradients included."""

from __future__ import annotations

import itertools

import pytest
import torch

from kda.reference import kda_reference
from kda.spec import CaseClass, GateMode
from kda.verify.cases import VerificationCase, cases_for, make_inputs


def _case(gate: GateMode, varlen: bool, g_dtype: str, seed: int) -> VerificationCase:
    cc = CaseClass(
        gate=gate,
        qk_l2norm=True,
        beta="sigmoid",
        dtype="bfloat16",
        varlen=varlen,
        gva=False,
        initial_state=True,
        final_state=True,
        state_v_first=False,
        chunk_size=32,
        head_dim=64,
        training=True,
    )
    extreme = next(c for c in cases_for(cc, quick=False) if c.regime == "extreme")
    return VerificationCase(cc, "extreme", extreme.B, extreme.H, extreme.HV, 8, 8, extreme.seq_lens, g_dtype, seed=seed)


@pytest.mark.parametrize("g_dtype", ["float32", "float16"])
@pytest.mark.parametrize("varlen", [False, True], ids=["dense", "varlen"])
@pytest.mark.parametrize("gate", [GateMode.PREGATED, GateMode.SOFTPLUS, GateMode.SAFE], ids=lambda g: g.value)
def test_extreme_cases_reset_once_a_sequence(seed, gate, varlen, g_dtype):
    case = _case(gate, varlen, g_dtype, seed)
    kwargs, upstream = make_inputs(case, "cpu")
    g = kwargs["g"].float()
    if gate is GateMode.PREGATED:
        reset = g < -1e29  # -1e30, or -inf (which -1e30 is in fp16)
        assert torch.isinf(g).any() and (g == -1e30).any() == (g_dtype == "float32")
    else:
        reset = g > 6e4  # 1e30, fp16's largest in fp16
    tokens = reset.any(-1).any(-1)  # [B, T]
    if gate is GateMode.SAFE:  # bounded: nothing to reset
        assert not tokens.any()
        return
    bounds = list(itertools.accumulate(case.seq_lens, initial=0))
    C = case.case_class.chunk_size
    for n, length in enumerate(case.seq_lens):
        b, start = (0, bounds[n]) if varlen else (n, 0)
        found = tokens[b, start : start + length].nonzero().flatten().tolist()
        if length < 2:
            assert found == []
            continue
        assert len(found) == 1, (n, found)
        assert found[0] % C != 0  # not at a sequence's or a chunk's start
        assert reset[b, start + found[0]].all() or gate is GateMode.PREGATED
    ref = {
        n: (t.double().requires_grad_(True) if torch.is_tensor(t) and t.is_floating_point() else t)
        for n, t in kwargs.items()
        if n not in ("chunk_size", "cu_seqlens_cpu")
    }
    o, state = kda_reference(**ref)
    leaves = [t for t in ref.values() if torch.is_tensor(t) and t.requires_grad]
    grads = torch.autograd.grad([o, state], leaves, [upstream["do"].double(), upstream["dfinal_state"].double()])
    assert torch.isfinite(o).all() and torch.isfinite(state).all()
    assert all(torch.isfinite(d).all() for d in grads)
