"""benchmarks/tilelang_stages.py's ``--intra-variant NAME=PATH``: a changed `intra` loaded from a file, or a
clear message saying why not (the timing itself needs a GPU)."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
from benchmark_scripts import load

pytest.importorskip("tilelang")

ROOT = Path(__file__).resolve().parents[2]
stages = load("tilelang_stages")


def test_a_variant_is_the_build_function_of_its_file(tmp_path):
    path = tmp_path / "intra_halves.py"
    path.write_text("def build(*params):\n    return ('built', params)\n")
    name, build = stages.load_variant(f"halves={path}")
    assert name == "halves" and build(64, 128) == ("built", (64, 128))


def test_a_copy_of_the_shipped_module_loads_as_a_variant():
    name, build = stages.load_variant(f"copy={ROOT / 'kda' / 'backends' / 'tilelang' / 'intra.py'}")
    assert name == "copy" and callable(build) and build is not stages.intra.build


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("halves", "expected NAME=PATH"),
        ("=x.py", "expected NAME=PATH"),
        ("halves=", "expected NAME=PATH"),
        ("shipped={good}", "the shipped kernel's"),
        ("halves={missing}", "no file"),
        ("halves={broken}", "does not import (ZeroDivisionError"),
        ("halves={no_build}", "defines no build() function"),
    ],
)
def test_a_variant_that_cannot_be_used_says_why(tmp_path, text, message):
    files = {"good": "def build(): pass\n", "broken": "1 / 0\n", "no_build": "build = 3\n"}
    paths = {key: tmp_path / f"{key}.py" for key in files}
    for key, source in files.items():
        paths[key].write_text(source)
    with pytest.raises(stages.VariantError, match=message.replace("(", r"\(").replace(")", r"\)")):
        stages.load_variant(text.format(missing=tmp_path / "absent.py", **paths))


def test_a_bad_variant_ends_the_command_with_its_message_before_any_gpu_work(tmp_path, monkeypatch, capsys):
    monkeypatch.setattr(sys, "argv", ["tilelang_stages.py", "--mode", "fwd", "--intra-variant", "v", "B1_T64_H1_D64"])
    monkeypatch.setattr(stages, "make_inputs", lambda *a, **k: pytest.fail("inputs made for a bad command line"))
    assert stages.main() == 2
    assert "expected NAME=PATH" in capsys.readouterr().err
