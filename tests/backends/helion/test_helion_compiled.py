"""The helion backend's compiled kernels on the CPU: the Triton code Helion generates for a configuration,
run by Triton's interpreter with every load and store address-checked (`tests/helion_compiled.py`,
`tests/addresses.py`), against the float64 reference through the verifier's `run_case`.

`test_helion_backend.py` checks the kernels' math in Helion's eager interpreter; these check the code a GPU
runs, with the products a GPU computes (TF32 for half inference, TF32x3 for training: `tests/tf32.py`) and
the launch configurations an H200 gets: Helion's default there (its sm90 heuristics, not the CPU's) at
small head dims, and the configurations shipped for the H200 (`tuned_sm90.json`) at the head dims they
were tuned for, with the default for kernels the table has no entry for. Every kernel of the forward and
the backward must have run compiled, and none may touch memory outside its tensors.
"""

from __future__ import annotations

import json
import os
import warnings

import pytest
import torch
from kernel_cases import case_class, expected_gradients, small_case

from kda.backends.base import Verdict
from kda.spec import GateMode
from kda.verify.check import run_case

pytest.importorskip("helion", reason="Helion is not installed (extra `helion`)")
if torch.cuda.is_available() or os.environ.get("TRITON_INTERPRET") != "1":
    pytest.skip("runs Triton's CPU interpreter, on a machine without a GPU", allow_module_level=True)

from helion_compiled import as_on_an_h200, interpreter_bridges
from tf32 import emulate_gpu_dots

from kda.backends import helion as helion_backend
from kda.backends.helion import configs, forward

FORWARD_KERNELS = {"gate", "scores", "solve", "state", "output"}
BACKWARD_KERNELS = {"state_backward", "chunk_backward", "score_backward", "score_diagonal", "gate_tail", "qk_tail"}


@pytest.fixture
def compiled(monkeypatch):
    """The helion backend launching its compiled kernels on CPU tensors (Helion's interpreter off), its
    products computed as the GPU's tensor cores compute them (`tests/tf32.py`), its launch configurations
    the ones Helion picks on an H200."""
    emulate_gpu_dots(monkeypatch)  # before the bridges, which widen bf16 operands on the way to it
    as_on_an_h200(monkeypatch)
    monkeypatch.delenv("HELION_INTERPRET", raising=False)
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    monkeypatch.setattr(
        helion_backend.HelionBackend, "supports", lambda self, spec: Verdict.yes("compiled, in Triton's interpreter")
    )
    with interpreter_bridges(), warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="kda: helion kernel .* default configuration")
        yield helion_backend.HelionBackend()


def kernels_run(log) -> set[str]:
    return {name.removeprefix("_helion_").removesuffix("_kernel") for name in log.launches}


def kernels_of(cc) -> set[str]:
    """Every kernel a call of class `cc` launches: no `score_diagonal` under the safe gate (steps of at most
    5 keep every strip's span within 80; the sigmoid gate's depends on the case's bound, and no test here
    uses it)."""
    assert cc.gate is not GateMode.SIGMOID, "kernels_of does not know a sigmoid case's bound"
    normalize = {"normalize"} if cc.qk_l2norm else set()
    backward = BACKWARD_KERNELS - ({"score_diagonal"} if cc.gate is GateMode.SAFE else set())
    return FORWARD_KERNELS | normalize | (backward if cc.training else set())


@pytest.mark.parametrize(
    "variant",
    [
        # fp16 with raw keys, varlen, GVA, both states: the class whose d256 training faulted on the H200
        dict(dtype="float16", qk_l2norm=False, beta="sigmoid2", varlen=True, gva=True, chunk_size=64),
        dict(gate=GateMode.SOFTPLUS, dtype="bfloat16", state_v_first=True),
    ],
    ids=["fp16-raw-keys-varlen-gva", "softplus-bf16-v-first"],
)
@pytest.mark.parametrize("regime", ["realistic", "extreme"])
def test_default_configurations_train_within_bounds(seed, compiled, checked_kernel_addresses, variant, regime):
    cc = case_class(**variant, training=True)
    result = run_case(compiled, small_case(cc, regime, seed=seed), "cpu")
    assert result.passed, (cc.key, result.reason, result.errors)
    assert expected_gradients(cc) <= set(result.errors)
    assert kernels_run(checked_kernel_addresses) == kernels_of(cc)


@pytest.mark.parametrize("training", [False, True], ids=["inference-bf16", "training-bf16"])
def test_the_shipped_h200_configurations_within_bounds(seed, compiled, checked_kernel_addresses, monkeypatch, training):
    """K = V = 128, the head dims `tuned_sm90.json` holds: each kernel with an entry at the call's storage
    (16-bit at inference; fp32 in training, ``w`` and ``A_qk`` as bf16 halves where `forward.TRAINING_ON_HALVES`
    is on) must have compiled with
    it (an entry Helion refuses falls back to the default, and says so through `configs.warn_default`);
    exactly the kernels without one run the default."""
    monkeypatch.setattr(forward, "arch", lambda device: "sm90")
    defaulted: list[tuple[str, str]] = []
    monkeypatch.setattr(configs, "warn_default", lambda name, arch, why: defaulted.append((name, why)))
    cc = case_class(varlen=True, gva=True, chunk_size=64, training=training, head_dim=128, dtype="bfloat16")
    result = run_case(compiled, small_case(cc, "realistic", K=128, V=128, seed=seed), "cpu")
    assert result.passed, (cc.key, result.reason, result.errors)
    assert kernels_run(checked_kernel_addresses) == kernels_of(cc)
    shipped = json.loads(configs.shipped_table_path("sm90").read_text())
    key = configs.ShapeKey("sm90", 128, 128, 64, not training, halves=training and forward.TRAINING_ON_HALVES)
    with_entry = {
        name.removesuffix("_kernel")
        for name, entries in shipped.items()
        if any(configs.matches(e, key) for e in entries)
    }
    assert with_entry, "the shipped table has no entry at this storage width"
    assert all("no table entry" in why for _, why in defaulted), defaulted  # no entry was refused
    assert {name.removesuffix("_kernel") for name, _ in defaulted} == kernels_of(cc) - with_entry


def test_a_later_process_runs_the_kept_code_without_helions_compiler(
    seed, compiled, checked_kernel_addresses, monkeypatch, tmp_path
):
    """`code_cache` (switched on for CPU tensors here; it serves CUDA launches): a first process compiles
    and keeps each launch's module; a later one (nothing compiled in memory) must run every kernel from
    those modules, with Helion's compiler unused, and compute exactly what the compiled code computed."""
    import helion

    from kda.backends.helion import code_cache, runtime

    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path))
    monkeypatch.setattr(code_cache, "enabled", lambda device: True)
    monkeypatch.setattr(runtime, "_COMPILED", {})
    cc = case_class(dtype="bfloat16", varlen=True, gva=True)
    case = small_case(cc, "realistic", seed=seed)
    first = run_case(compiled, case, "cpu")
    assert first.passed, (cc.key, first.reason, first.errors)
    kept = sorted((tmp_path / "kda-helion").glob("*.json"))
    assert len(kept) == len(runtime._COMPILED) > 0  # one entry a launch specialization

    loaded: list[str] = []
    plain_load = code_cache.load
    monkeypatch.setattr(code_cache, "load", lambda key, kernel: loaded.append(kernel) or plain_load(key, kernel))
    monkeypatch.setattr(runtime, "_COMPILED", {})  # the later process

    def no_compiler(self, args):
        raise AssertionError(f"Helion's compiler ran for {self.name} though its code was kept")

    monkeypatch.setattr(helion.Kernel, "bind", no_compiler)
    checked_kernel_addresses.launches.clear()
    again = run_case(compiled, case, "cpu")
    assert again.passed, (cc.key, again.reason, again.errors)
    assert again.errors == first.errors  # the same code on the same inputs
    assert {name.removesuffix("_kernel") for name in loaded} == kernels_of(cc) == kernels_run(checked_kernel_addresses)
