"""benchmarks/ncu_phases.py: a kernel's SASS cut at its barriers, each piece's share of the stall samples."""

from __future__ import annotations

import csv
import re
from pathlib import Path

from benchmark_scripts import load

ncu_phases = load("ncu_phases")

HEADER = ["Address", "Source", ncu_phases.SAMPLES, ncu_phases.WAVEFRONTS, ncu_phases.EXECUTED, "stall_mio"]


def _table(path: Path, rows: list[tuple[str, int, int, int, int]]) -> Path:
    with path.open("w", newline="") as handle:
        writer = csv.writer(handle)
        writer.writerow(["Kernel Name", "k"])
        writer.writerow(HEADER)
        for n, (source, samples, wavefronts, executed, mio) in enumerate(rows):
            writer.writerow([hex(n * 16), source, f"{samples:,}", wavefronts, executed, mio])
    return path


def _shares(line: str) -> list[str]:
    return re.findall(r"(\d+\.\d)%", line)


def test_the_pieces_are_cut_after_each_barrier_and_carry_their_shares(tmp_path, capsys, monkeypatch):
    table = _table(
        tmp_path / "sass.csv",
        [
            ("LDG.E R2, desc[UR4][R2.64]", 30, 0, 10, 0),
            ("BAR.SYNC.DEFER_BLOCKING 0x0", 10, 0, 10, 0),
            ("@!P0 LDS R4, [R5]", 50, 900, 10, 40),
            ("HMMA.1688.F32.TF32 R8, R4, R6, R8", 10, 100, 10, 5),
        ],
    )
    monkeypatch.setattr("sys.argv", ["ncu_phases", str(table), "--min-share", "0"])
    assert ncu_phases.main() == 0
    lines = capsys.readouterr().out.splitlines()
    pieces = [line for line in lines if "|" in line and not line.startswith(" lines")]
    assert len(pieces) == 2
    assert _shares(pieces[0]) == ["40.0", "0.0", "50.0"] and "LDG 1" in pieces[0] and "BAR 1" in pieces[0]
    assert _shares(pieces[1]) == ["60.0", "100.0", "50.0"] and "LDS 1" in pieces[1] and "mio 75" in pieces[1]


def test_a_file_that_is_not_the_sass_table_is_a_message(tmp_path, capsys, monkeypatch):
    other = tmp_path / "other.csv"
    other.write_text("a,b\n1,2\n")
    monkeypatch.setattr("sys.argv", ["ncu_phases", str(other)])
    assert ncu_phases.main() == 2
    assert "not ncu's SASS source table" in capsys.readouterr().err
