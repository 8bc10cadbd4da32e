"""benchmarks/tilelang_stages.py's ``--variant KERNEL:NAME=PATH``: a changed kernel loaded from a file, or a
clear message saying why not (the timing itself needs a GPU)."""

from __future__ import annotations

import re
import sys
from pathlib import Path

import pytest
from benchmark_scripts import load

pytest.importorskip("tilelang")

ROOT = Path(__file__).resolve().parents[2]
TILELANG = ROOT / "kda" / "backends" / "tilelang"
stages = load("tilelang_stages")


def test_a_variant_is_the_builder_of_its_file(tmp_path):
    path = tmp_path / "intra_halves.py"
    path.write_text("def build(*params):\n    return ('built', params)\n")
    variant = stages.load_variant(f"intra:halves={path}")
    assert (variant.kernel, variant.name) == ("intra", "halves")
    assert variant.build(64, 128) == ("built", (64, 128))


def test_a_tail_variant_is_its_own_builder(tmp_path):
    path = tmp_path / "tails.py"
    path.write_text("def build_gate_tail(): return 'gate'\ndef build_qk_tail(): return 'qk'\n")
    assert stages.load_variant(f"qk_tail:v={path}").build() == "qk"
    assert stages.load_variant(f"gate_tail:v={path}").build() == "gate"


@pytest.mark.parametrize("kernel", ["intra", "score_backward", "chunk_backward"])
def test_a_copy_of_a_shipped_module_loads_as_a_variant(kernel):
    variant = stages.load_variant(f"{kernel}:copy={TILELANG / f'{kernel}.py'}")
    shipped = getattr(*stages.BUILDERS[kernel])
    assert variant.name == "copy" and callable(variant.build) and variant.build is not shipped


def test_every_kernel_the_backend_lists_can_be_varied_by_the_builder_it_calls():
    """The variant table and `kernels.specializations` name the same kernels and the same builders."""
    listed = re.findall(r'Kernel\("(\w+)", (\w+)\.(\w+),', (TILELANG / "kernels.py").read_text())
    table = {
        kernel: (module.__name__.rsplit(".", 1)[1], attribute)
        for kernel, (module, attribute) in stages.BUILDERS.items()
    }
    assert len(listed) == 8 and {kernel: (module, attribute) for kernel, module, attribute in listed} == table


def test_use_puts_one_variant_in_and_then_restores_the_shipped_builders(tmp_path):
    path = tmp_path / "sb.py"
    path.write_text("def build(*params): return 'variant'\n")
    variant = stages.load_variant(f"score_backward:v={path}")
    shipped = {kernel: getattr(module, attribute) for kernel, (module, attribute) in stages.BUILDERS.items()}
    try:
        stages.use(variant)
        assert stages.score_backward.build is variant.build
        assert stages.intra.build is shipped["intra"]
        stages.use(None)
        assert {kernel: getattr(m, a) for kernel, (m, a) in stages.BUILDERS.items()} == shipped
    finally:
        stages.use(None)


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("halves", "expected KERNEL:NAME=PATH"),
        ("intra:halves", "expected KERNEL:NAME=PATH"),
        ("halves={good}", "expected KERNEL:NAME=PATH"),
        ("intra:={good}", "expected KERNEL:NAME=PATH"),
        (":v={good}", "expected KERNEL:NAME=PATH"),
        ("intra:halves=", "expected KERNEL:NAME=PATH"),
        ("nosuch:v={good}", "no kernel 'nosuch'"),
        ("intra:shipped={good}", "the shipped kernels'"),
        ("intra:halves={missing}", "no file"),
        ("intra:halves={broken}", "does not import (ZeroDivisionError"),
        ("intra:halves={no_build}", "defines no build() function"),
        ("qk_tail:v={good}", "defines no build_qk_tail() function"),
    ],
)
def test_a_variant_that_cannot_be_used_says_why(tmp_path, text, message):
    files = {"good": "def build(): pass\n", "broken": "1 / 0\n", "no_build": "build = 3\n"}
    paths = {key: tmp_path / f"{key}.py" for key in files}
    for key, source in files.items():
        paths[key].write_text(source)
    with pytest.raises(stages.VariantError, match=message.replace("(", r"\(").replace(")", r"\)")):
        stages.load_variant(text.format(missing=tmp_path / "absent.py", **paths))


def test_two_variants_of_one_name_are_refused(tmp_path):
    path = tmp_path / "v.py"
    path.write_text("def build(): pass\n")
    with pytest.raises(stages.VariantError, match="the name 'a' is given twice"):
        stages.load_variants([f"intra:a={path}", f"score_backward:a={path}"])


def test_a_bad_variant_ends_the_command_with_its_message_before_any_gpu_work(monkeypatch, capsys):
    monkeypatch.setattr(sys, "argv", ["tilelang_stages.py", "--mode", "fwd", "--variant", "v", "B1_T64_H1_D64"])
    monkeypatch.setattr(stages, "make_inputs", lambda *a, **k: pytest.fail("inputs made for a bad command line"))
    assert stages.main() == 2
    assert "expected KERNEL:NAME=PATH" in capsys.readouterr().err


def test_a_variant_is_compared_with_the_shipped_call_output_by_output():
    import torch

    shipped = (torch.tensor([1.0, -4.0]), torch.tensor([[2.0, 0.5]]))
    assert stages.difference((torch.tensor([1.0, -3.0]), shipped[1].clone()), shipped, ["o", "final_state"]) == (
        "o 2.50e-01, final_state 0.00e+00"
    )
    assert "o NaN" in stages.difference((torch.tensor([float("nan"), -4.0]), shipped[1]), shipped, ["o", "s"])
    assert "final_state missing" in stages.difference(shipped[:1], shipped, ["o", "final_state"])
    assert stages.difference([shipped[0] * 2], [shipped[0]], []) == "0 1.00e+00"  # unnamed outputs by index


def test_a_plan_is_forced_while_it_runs_and_released_after():
    """``--plan``: the forward's serial pass planned as named (`kernels.FORCED_PLAN`) for that run alone;
    `use(None)` or a kernel variant puts the shipped rule back."""
    split, wide = stages.load_plan("split"), stages.load_plan("fused:128")
    assert (split.name, split.plan) == ("plan-split", stages.kernels.StatePlan(False, 64))
    assert (wide.name, wide.plan) == ("plan-fused-128", stages.kernels.StatePlan(True, 128))
    try:
        stages.use(wide)
        assert wide.plan == stages.kernels.FORCED_PLAN
        stages.use(None)
        assert stages.kernels.FORCED_PLAN is None
    finally:
        stages.use(None)


@pytest.mark.parametrize("text", ["fused", "fused:32", "split:64", "both"])
def test_a_plan_that_does_not_exist_says_which_do(text, monkeypatch, capsys):
    with pytest.raises(stages.VariantError, match="expected split, fused:64 or fused:128"):
        stages.load_plan(text)
    monkeypatch.setattr(sys, "argv", ["tilelang_stages.py", "--mode", "fwd", "--plan", text, "B1_T64_H1_D64"])
    monkeypatch.setattr(stages, "make_inputs", lambda *a, **k: pytest.fail("inputs made for a bad command line"))
    assert stages.main() == 2
    assert "expected split" in capsys.readouterr().err
