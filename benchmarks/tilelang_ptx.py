"""A tilelang kernel's instructions without a GPU: lowered for sm_90a, built by this machine's nvcc, counted.

    python benchmarks/tilelang_ptx.py intra [--mode fwd] [--dim 128] [--variant PATH]
    python benchmarks/tilelang_ptx.py score_backward --mode train_safe

Builds the kernel KERNEL (a stage name: ``intra``, ``state``, ``score_backward``, ...) of the bench's call in
MODE (its gate and flags; sequence length and batch are not compiled in), at chunk 64 and K = V = DIM,
from the shipped module or from ``--variant PATH`` (a changed copy of its module, as
`tilelang_stages.py --variant` takes it). It prints what ptxas reports (shared memory, registers a thread,
spilled bytes) and the PTX: instructions a thread and barriers, then the pieces between barriers, each
with its count and its most frequent opcodes.

A kernel that does a chunk's whole work in one block, as these do, runs as pieces separated by barriers, and
when neither its bytes nor its tensor work hold it, its time is its instructions and the waits between the
pieces. The counts are static (each instruction once, as written): a loop the source unrolls counts every
turn, a loop it keeps counts one. `intra`'s, which unrolls its loops, said where version 8's time went
(9224 instructions a thread, 68 barriers; version 9: 5183 and 36) before any GPU timed a change.
`ncu_phases.py` gives the same pieces their measured stall samples on a GPU.
"""

from __future__ import annotations

import argparse
import collections
import os
import re
import subprocess
import sys
import tempfile
from pathlib import Path

from tilelang_stages import BUILDERS, VariantError, load_variant

from kda.bench.shapes import MODES, BenchShape, make_inputs

BARRIERS = ("bar.sync", "barrier.sync", "bar.arrive", "barrier.arrive")


def opcodes(ptx: str) -> list[str]:
    """The opcode of each instruction of `ptx`, in order (a predicate guard is not the opcode; directives,
    labels, declarations, braces and comments are not instructions)."""
    found = []
    for line in ptx.splitlines():
        text = line.split("//", 1)[0].strip()
        if not text or text[0] in ".{}()$" or text.endswith(":"):
            continue
        text = re.sub(r"^@!?%\w+\s+", "", text)
        found.append(text.split()[0].rstrip(";"))
    return found


def pieces(found: list[str]) -> list[list[str]]:
    """`found` cut after every barrier."""
    cut: list[list[str]] = [[]]
    for opcode in found:
        cut[-1].append(opcode)
        if opcode.startswith(BARRIERS):
            cut.append([])
    return [piece for piece in cut if piece]


def family(opcode: str) -> str:
    """An opcode's first two parts (``ld.shared``, ``ex2.approx``, ``wgmma.fence``): what it does, not its types."""
    return ".".join(opcode.split(".")[:2])


def report(ptx: str, ptxas: str) -> str:
    """What `main` prints for a kernel's PTX and ptxas's ``-v`` output."""
    found = opcodes(ptx)
    registers = re.findall(r"Used (\d+) registers", ptxas)
    spills = re.findall(r"(\d+) bytes spill stores", ptxas)
    barriers = sum(opcode.startswith(BARRIERS) for opcode in found)
    lines = [
        f"registers {registers[-1] if registers else '?'} a thread, spill stores {spills[-1] if spills else '?'} "
        f"bytes; {len(found)} PTX instructions a thread, {barriers} barriers"
    ]
    for n, piece in enumerate(pieces(found)):
        common = collections.Counter(family(opcode) for opcode in piece).most_common(6)
        lines.append(f"  {n:3d} {len(piece):6d}  " + " ".join(f"{name}:{count}" for name, count in common))
    return "\n".join(lines)


def lowered(kernel: str, mode: str, dim: int, variant: str | None) -> tuple[str, int]:
    """The CUDA source and shared memory bytes of `kernel` for the bench's call in `mode` at head dim `dim`."""
    from kda.backends.tilelang import kernels, runtime
    from kda.spec import KDASpec

    inputs = make_inputs(BenchShape.parse(f"B1_T128_H2_D{dim}"), MODES[mode], "cpu", seed=0)
    spec = KDASpec.from_call(**inputs.kwargs, requires_grad=MODES[mode].training)
    chosen = [k for k in kernels.specializations(spec) if k.name == kernel]
    if not chosen:
        raise VariantError(f"{mode} launches no {kernel} (training modes add the backward's kernels)")
    builder = chosen[0].builder if variant is None else load_variant(f"{kernel}:variant={variant}").build
    artifact = runtime.lower(builder(*chosen[0].params), configs=runtime.pass_configs(builder))
    return artifact.kernel_source, runtime.shared_memory_bytes(artifact)


def built(source: str) -> tuple[str, str]:
    """`source` through nvcc for sm_90a: its PTX, and what ptxas says of the machine code (``-v``)."""
    import tilelang

    from kda.backends.tilelang import runtime

    nvcc = runtime.find_nvcc()
    if nvcc is None:
        raise OSError("no nvcc on this machine (CUDA's compiler builds the PTX)")
    root = os.path.dirname(tilelang.__file__)
    flags = ["-gencode=arch=compute_90a,code=sm_90a", "-std=c++17", "-O3", f"-I{os.path.join(root, 'src')}",
             f"-I{os.path.join(root, '3rdparty', 'cutlass', 'include')}", "-DENABLE_BF16", "-w"]  # fmt: skip
    with tempfile.TemporaryDirectory() as folder:
        path = Path(folder) / "kernel.cu"
        path.write_text(source)
        ptx = subprocess.run([nvcc, *flags, "-ptx", str(path), "-o", str(path.with_suffix(".ptx"))],
                             capture_output=True, text=True, timeout=900)  # fmt: skip
        if ptx.returncode != 0:
            raise OSError(f"nvcc: {ptx.stderr.strip()[-600:]}")
        machine = subprocess.run([nvcc, *flags, "-Xptxas", "-v", "-cubin", str(path), "-o", str(path.with_suffix(".o"))],
                                 capture_output=True, text=True, timeout=900)  # fmt: skip
        if machine.returncode != 0:
            raise OSError(f"nvcc: {machine.stderr.strip()[-600:]}")
        return path.with_suffix(".ptx").read_text(), machine.stderr


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("kernel", choices=list(BUILDERS))
    parser.add_argument("--mode", default="fwd", choices=list(MODES))
    parser.add_argument("--dim", type=int, default=128, choices=[64, 128, 256], help="K = V")
    parser.add_argument("--variant", metavar="PATH", help="a changed copy of the kernel's module")
    args = parser.parse_args()
    try:
        source, shared = lowered(args.kernel, args.mode, args.dim, args.variant)
        ptx, ptxas = built(source)
    except (VariantError, OSError) as error:
        print(f"tilelang_ptx: {error}", file=sys.stderr)
        return 2
    print(f"{args.kernel} ({args.mode}, K = V = {args.dim}, chunk 64): shared memory {shared} bytes a block")
    print(report(ptx, ptxas))
    return 0


if __name__ == "__main__":
    sys.exit(main())
