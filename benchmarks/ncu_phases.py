"""Where one kernel's time goes, by phase, from Nsight Compute's per-instruction SASS table.

    ncu -i kernels.ncu-rep --page source --print-source sass --csv > sass.csv
    python benchmarks/ncu_phases.py sass.csv

A kernel that does a chunk's whole work in one block runs as phases separated by barriers, so the SASS is
cut at every ``BAR`` instruction and each piece is printed with its share of the warp-stall samples (where
the warps spent their time), of the shared-memory wavefronts and of the instructions executed, the most
frequent opcodes (which say what the phase is: ``HGMMA``/``HMMA`` products, ``MUFU`` exponentials,
``LDS``/``STS`` shared memory, ``LDG``/``STG`` global memory) and its leading stall reasons. Pieces below
``--min-share`` of the samples are left out. Nothing here needs a GPU: the table comes back from the
device script's `tilelang-ncu` target.
"""

from __future__ import annotations

import argparse
import collections
import csv
import re
import sys

SAMPLES = "Warp Stall Sampling (All Samples)"
WAVEFRONTS = "L1 Wavefronts Shared"
EXECUTED = "Instructions Executed"
STALLS = ("barrier", "long_sb", "short_sb", "mio", "wait", "math", "lg", "selected", "not_selected")


def _number(text: str) -> float:
    try:
        return float(text.replace(",", ""))
    except ValueError:
        return 0.0


def _opcode(instruction: str) -> str:
    text = re.sub(r"^@!?U?P\w+\s+", "", instruction.strip())  # a predicate guard is not the opcode
    return re.split(r"[ .]", text, maxsplit=1)[0]


def phases(rows: list[dict[str, str]]) -> list[list[dict[str, str]]]:
    """The SASS rows cut after every barrier instruction."""
    pieces: list[list[dict[str, str]]] = [[]]
    for row in rows:
        pieces[-1].append(row)
        if _opcode(row["Source"]) == "BAR":
            pieces.append([])
    return [piece for piece in pieces if piece]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("sass_csv")
    parser.add_argument("--min-share", type=float, default=0.005, help="smallest share of samples shown")
    args = parser.parse_args()
    try:
        with open(args.sass_csv, newline="") as handle:
            lines = list(csv.reader(handle))
    except OSError as error:
        print(f"ncu_phases: cannot read {args.sass_csv}: {error.strerror}", file=sys.stderr)
        return 2
    header_at = next((n for n, line in enumerate(lines) if "Source" in line and SAMPLES in line), None)
    if header_at is None:
        print(f"ncu_phases: {args.sass_csv} is not ncu's SASS source table (no '{SAMPLES}' column)", file=sys.stderr)
        return 2
    header = lines[header_at]
    rows = [dict(zip(header, line, strict=False)) for line in lines[header_at + 1 :] if len(line) == len(header)]
    totals = {key: sum(_number(row.get(key, "0")) for row in rows) or 1.0 for key in (SAMPLES, WAVEFRONTS, EXECUTED)}
    print(f"{len(rows)} instructions; {totals[SAMPLES]:.0f} stall samples; {totals[WAVEFRONTS]:.0f} shared wavefronts")
    print(" lines        samples  shared  inst.  | opcodes | stalls (% of the phase's samples)")
    for piece in phases(rows):
        share = {key: sum(_number(row.get(key, "0")) for row in piece) / totals[key] for key in totals}
        if share[SAMPLES] < args.min_share:
            continue
        opcodes = collections.Counter(_opcode(row["Source"]) for row in piece)
        samples = sum(_number(row.get(SAMPLES, "0")) for row in piece) or 1.0
        stalls = collections.Counter({s: sum(_number(row.get(f"stall_{s}", "0")) for row in piece) for s in STALLS})
        first, last = rows.index(piece[0]), rows.index(piece[-1])
        print(
            f"{first:5d}-{last:5d}  {100 * share[SAMPLES]:5.1f}%  {100 * share[WAVEFRONTS]:5.1f}%  "
            f"{100 * share[EXECUTED]:5.1f}% | "
            + ", ".join(f"{op} {count}" for op, count in opcodes.most_common(6))
            + " | "
            + ", ".join(f"{s} {100 * n / samples:.0f}" for s, n in stalls.most_common(3))
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
