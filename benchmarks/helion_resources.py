"""The helion backend's kernels as a Hopper GPU would hold them, found without one: registers, spills, shared
memory and occupancy of each kernel's sm_90a code, per launch configuration.

    python benchmarks/helion_resources.py B4_T2048_H16_D128 --mode train_safe
    python benchmarks/helion_resources.py B4_T2048_H16_D128 --mode train_safe --kernel state --sweep
    python benchmarks/helion_resources.py --case safe/qk/sig2/fp16/varlen/gva/h0+ht/c64/d256/train
    python benchmarks/helion_resources.py B1_T8192_H96_D128 --mode train_safe --triton-path /opt/triton-3.6

Two steps. First, one call of the helion backend runs on CPU tensors with Triton's interpreter switched on
and every Triton launch caught before it runs: Helion generates each kernel's Triton code for the
configuration the backend would choose on an H200 (``tuned_sm90.json``'s entry, else Helion's default),
for Helion's default (``--default``), and for candidates around the chosen one (``--sweep``: each block size
over 16 to 128, 4 and 8 warps, 1 to 3 stages), and the launch's arguments are kept. Second, each kernel is
compiled by Triton for ``sm_90a`` (a stand-in driver names the target; Triton's own ``ptxas`` makes the
code and reports on it), in a child process whose ``PYTHONPATH`` starts with ``--triton-path`` if given, so that the Triton of
the GPU machine (3.6 on the H200's stack) can compile what this machine's Helion generated.

For each kernel and configuration it prints the grid, warps and stages, registers a thread, spill bytes a
thread (``ptxas -v``), shared memory a block, and what those allow on an H200 SM (65536 registers,
233472 bytes of shared memory less 1 KB a block, 64 warps, 32 blocks): blocks and warps an SM, and the
waves the grid takes over 132 SMs. No time is measured; a spill or a single warp group an SM is where to
look, the GPU decides.
"""

from __future__ import annotations

import argparse
import importlib.util
import itertools
import json
import os
import re
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

H200_SMS = 132
SM_REGISTERS = 65536
SM_SHARED = 233472
BLOCK_SHARED_RESERVED = 1024
SM_WARPS = 64
SM_BLOCKS = 32
SWEEP_BLOCKS = (16, 32, 64, 128)
PORTABLE = ("block_sizes", "num_warps", "num_stages", "pid_type", "l2_groupings", "loop_orders")


# --- step 1: Helion's code and each launch's arguments, without running anything -------------------------


def _describe(arg: Any) -> list[Any]:
    import torch

    if isinstance(arg, torch.Tensor):
        dtype = str(arg.dtype).removeprefix("torch.")
        return ["tensor", dtype, list(arg.shape), list(arg.stride()), arg.storage_offset(), arg.data_ptr() % 16]
    return ["value", arg]


def _candidates(chosen: dict[str, Any], default: dict[str, Any], sweep: bool, with_default: bool) -> list[tuple]:
    found = [("chosen", chosen)]
    if with_default and default != chosen:
        found.append(("default", default))
    if not sweep:
        return found
    base = {key: value for key, value in chosen.items() if key in PORTABLE}
    slots = len(base.get("block_sizes", []))
    for blocks in itertools.product(SWEEP_BLOCKS, repeat=slots):
        for warps, stages in itertools.product((4, 8), (1, 2, 3)):
            trial = dict(base, block_sizes=list(blocks), num_warps=warps, num_stages=stages)
            found.append((f"blocks {list(blocks)} w{warps} s{stages}", trial))
    return found


def catch_launches() -> list[dict[str, Any]]:
    """Switch Triton's interpreter on (before Triton is imported) and keep each launch instead of running it:
    the list returned fills with (function, arguments, grid, options). Helion's choices are made as on an
    H200 from then on."""
    os.environ["TRITON_INTERPRET"] = "1"
    os.environ.pop("HELION_INTERPRET", None)
    from triton.runtime import interpreter

    caught: list[dict[str, Any]] = []

    def catch(self, *launch_args, grid, warmup, **options):  # InterpretedFunction.run: keep, do not run
        del warmup
        caught.append(dict(fn=self.fn, args=launch_args, grid=grid, options=options))

    interpreter.InterpretedFunction.run = catch  # type: ignore[method-assign]
    as_if_on_an_h200()
    return caught


def code_for(
    name: str, fn: Callable[..., Any], precision: str, launch_args: tuple, candidates: list[tuple], caught: list
) -> list[dict[str, Any]]:
    """One record per (label, config) candidate: the Triton code Helion generates for kernel `fn` on
    `launch_args` and the arguments of its launch (`catch_launches` must be in force)."""
    import helion

    records: list[dict[str, Any]] = []
    for label, config in candidates:
        caught.clear()
        started = time.perf_counter()
        try:
            kernel = helion.kernel(fn, config=helion.Config(**config), static_shapes=False, dot_precision=precision)
            kernel(*launch_args)
        except Exception as error:
            records.append(dict(kernel=name, label=label, config=config, error=f"{type(error).__name__}: {error}"))
            continue
        launch = caught[-1]
        records.append(
            dict(
                kernel=name,
                label=label,
                config={key: config[key] for key in PORTABLE if key in config},
                file=launch["fn"].__code__.co_filename,
                function=launch["fn"].__name__,
                args=[_describe(arg) for arg in launch["args"]],
                grid=list(launch["grid"]),
                num_warps=launch["options"].get("num_warps", 4),
                num_stages=launch["options"].get("num_stages", 1),
                generate_s=time.perf_counter() - started,  # Helion's tracing and code generation
            )
        )
    return records


def default_config(fn: Callable[..., Any], precision: str, launch_args: tuple) -> dict[str, Any]:
    """Helion's default configuration for `fn` on `launch_args` (as on an H200 under `catch_launches`)."""
    import helion

    bound = helion.kernel(fn, static_shapes=False, dot_precision=precision).bind(launch_args)
    return json.loads(bound.config_spec.default_config().to_json())


def generate(args: argparse.Namespace) -> list[dict[str, Any]]:
    """Every kernel launch of one call, per configuration: Triton source file, function, arguments, options."""
    caught = catch_launches()
    os.environ["KDA_VERIFY"] = "off"  # nothing runs, so nothing could be verified
    import warnings

    import torch

    from kda.backends import helion as helion_backend
    from kda.backends.base import Verdict
    from kda.backends.helion import configs, forward, runtime

    helion_backend.HelionBackend.available = lambda self: Verdict.yes("compiled for sm_90a, not run")
    helion_backend.HelionBackend.supports = lambda self, spec: Verdict.yes("compiled for sm_90a, not run")
    helion_backend.TRAINING_HEAD_DIM_LIMIT = helion_backend.HEAD_DIM_LIMIT
    forward.arch = lambda device: "sm90"  # the table the H200 reads

    launches: list[tuple] = []
    plain = runtime.launch

    def recording(fn, precision, launch_args, key) -> None:
        launches.append((fn, precision, launch_args, key))
        plain(fn, precision, launch_args, key)

    runtime.launch = recording  # type: ignore[assignment]
    warnings.filterwarnings("ignore")
    _one_call(args, torch)
    runtime.launch = plain  # type: ignore[assignment]

    records: list[dict[str, Any]] = []
    seen: set[str] = set()
    for fn, precision, launch_args, key in launches:
        name = fn.__name__.removesuffix("_kernel")
        if name in seen or (args.kernel and name not in args.kernel):
            continue
        seen.add(name)
        bound = runtime._kernel(fn, precision, False).bind(launch_args)
        default = json.loads(bound.config_spec.default_config().to_json())
        chosen = json.loads(configs.choose(fn.__name__, key, bound).to_json())
        candidates = _candidates(chosen, default, args.sweep, args.default)
        records += code_for(name, fn, precision, launch_args, candidates, caught)
    return records


def as_if_on_an_h200(patch: Callable[[Any, str, Any], None] = setattr) -> None:
    """Helion's choices that read the GPU (its default configuration comes from heuristics registered per
    architecture, sized by the SM count) made as on an H200, though the tensors are on the CPU. `patch` is
    how each function is replaced (a test passes `monkeypatch.setattr`, which undoes it)."""
    import helion._hardware
    import helion.autotuner.config_spec
    import helion.runtime

    h200 = helion._hardware.HardwareInfo("cuda", "NVIDIA H200", "13.0", "sm90")
    patch(helion._hardware, "get_hardware_info", lambda device=None: h200)
    patch(helion.runtime, "get_num_sm", lambda device, reserved_sms=0: H200_SMS - reserved_sms)
    patch(helion.autotuner.config_spec, "device_num_sm", lambda device=None: H200_SMS)


def _one_call(args: argparse.Namespace, torch: Any) -> None:
    """The call whose launches are caught: a bench shape and mode, or a verification class's cases."""
    if args.case:
        from kda.backends import helion as helion_backend
        from kda.spec import CaseClass
        from kda.verify.cases import cases_for
        from kda.verify.check import run_case

        for case in cases_for(CaseClass.from_key(args.case), quick=False, long=True):
            run_case(helion_backend.HelionBackend(), case, "cpu")  # nothing ran, so its verdict means nothing
        return
    from kda.bench.runner import call_for
    from kda.workloads import MODES, BenchShape, make_inputs

    inputs = make_inputs(BenchShape.parse(args.shape), MODES[args.mode], torch.device("cpu"), seed=0)
    run, why = call_for("helion", inputs, MODES[args.mode])
    if run is None:
        raise SystemExit(f"{args.shape} {args.mode}: {why}")
    run()


# --- step 2: each kernel compiled for sm_90a, its resources read ----------------------------------------


class _Hopper:
    """A stand-in for Triton's active driver that names an sm_90a target, so `warmup` compiles without a GPU."""

    def __init__(self) -> None:
        from triton.backends.compiler import GPUTarget

        self.target = GPUTarget("cuda", 90, 32)  # sm_90, 32 threads a warp

    def get_current_device(self) -> int:
        return 0

    def get_current_stream(self, device: int | None = None) -> int:
        return 0

    def get_current_target(self) -> Any:
        return self.target

    def get_active_torch_device(self) -> Any:
        import torch

        return torch.device("cpu")

    def is_active(self) -> bool:
        return True


def _tensor(dtype: str, shape: list[int], stride: list[int], offset: int, misalignment: int) -> Any:
    """A tensor of that layout whose data pointer has the recorded alignment (Triton specializes on it)."""
    import torch

    span = 1 + sum((size - 1) * step for size, step in zip(shape, stride)) if all(shape) else 0
    base = torch.empty(span + offset + 16, dtype=getattr(torch, dtype))
    shift = next(s for s in range(16) if (base.data_ptr() + (offset + s) * base.element_size()) % 16 == misalignment)
    return base.as_strided(shape, stride, offset + shift)


def resources(record: dict[str, Any]) -> dict[str, Any]:
    """Registers, spill bytes (stores, loads), stack and shared memory of one record's sm_90a code, from the
    ``ptxas -v`` log of Triton's own assembler run (its flags, its ptxas)."""
    import contextlib
    import io

    import triton

    spec = importlib.util.spec_from_file_location(f"_helion_{abs(hash(record['file']))}", record["file"])
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    launch_args = [_tensor(*arg[1:]) if arg[0] == "tensor" else arg[1] for arg in record["args"]]
    log = io.StringIO()
    triton.knobs.nvidia.dump_ptxas_log = True  # Triton prints ptxas's log after assembling
    started = time.perf_counter()
    with contextlib.redirect_stdout(log):
        kernel = getattr(module, record["function"]).warmup(
            *launch_args, grid=tuple(record["grid"]), num_warps=record["num_warps"], num_stages=record["num_stages"]
        )
    compile_s = time.perf_counter() - started  # Triton's passes, ptxas and the module's load
    text = log.getvalue()
    used = re.search(r"Used (\d+) registers(?:.*?(\d+) bytes smem)?", text)
    frame = re.search(r"(\d+) bytes stack frame, (\d+) bytes spill stores, (\d+) bytes spill loads", text)
    if used is None or frame is None:
        raise RuntimeError(f"no ptxas report in Triton's log: {text[-400:]!r}")
    return dict(
        registers=int(used.group(1)),
        stack=int(frame.group(1)),
        shared=int(kernel.metadata.shared) + int(used.group(2) or 0),
        spill_stores=int(frame.group(2)),
        spill_loads=int(frame.group(3)),
        compile_s=compile_s,
    )


def compile_all(path: str) -> None:
    """The child step: compile every record in the JSON file `path` and write each one's resources into it."""
    scratch = tempfile.mkdtemp(prefix="helion-resources-")
    os.environ["TRITON_CACHE_DIR"] = scratch  # an empty cache: every kernel is assembled, so ptxas reports it
    from triton.runtime import driver

    driver.set_active(_Hopper())
    records = json.loads(Path(path).read_text())
    found: dict[str, dict[str, Any]] = {}  # the same code compiles once: Triton's cache would answer silently
    for record in records:
        if "error" in record:
            continue
        same = json.dumps([Path(record["file"]).read_text(), record["args"], record["num_warps"], record["num_stages"]])
        try:
            if same not in found:
                found[same] = resources(record)
            record.update(found[same])
        except Exception as error:
            record["error"] = f"{type(error).__name__}: {str(error)[:300]}"
        Path(path).write_text(json.dumps(records))  # after each: a kernel that kills the compiler keeps the rest


# --- the report --------------------------------------------------------------------------------------------


def occupancy(registers: int, shared: int, warps: int) -> tuple[int, int]:
    """(blocks, warps) an H200 SM holds of a kernel: registers are given out a warp at a time in 256s."""
    per_warp = -(-max(registers, 1) * 32 // 256) * 256
    by_registers = SM_REGISTERS // (per_warp * warps)
    by_shared = SM_SHARED // (shared + BLOCK_SHARED_RESERVED)
    blocks = max(0, min(by_registers, by_shared, SM_WARPS // warps, SM_BLOCKS))
    return blocks, blocks * warps


def report(records: list[dict[str, Any]], triton_version: str) -> str:
    lines = [
        f"sm_90a code, Triton {triton_version}; occupancy for an H200 ({H200_SMS} SMs)",
        "",
        "| kernel | configuration | blocks | grid | warps | stages | registers | spilled (st/ld, bytes) "
        "| shared (bytes) | blocks/SM | warps/SM | waves | Helion s | Triton s |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for record in records:
        config = record.get("config", {})
        if "error" in record:
            failed = f"failed: {record['error'][:140]}"
            lines.append(f"| {record['kernel']} | {record['label']} | {config.get('block_sizes')} | {failed} |||||||||")
            continue
        grid = 1
        for size in record["grid"]:
            grid *= size
        blocks, warps = occupancy(record["registers"], record["shared"], record["num_warps"])
        waves = f"{grid / (blocks * H200_SMS):.1f}" if blocks else "does not fit"
        spilled = f"{record['spill_stores']}/{record['spill_loads']}" if record["spill_stores"] is not None else "?"
        lines.append(
            f"| {record['kernel']} | {record['label']} | {config.get('block_sizes')} | {grid} | {record['num_warps']} "
            f"| {record['num_stages']} | {record['registers']} | {spilled} | {record['shared']} | {blocks} | {warps} "
            f"| {waves} | {record['generate_s']:.2f} | {record['compile_s']:.2f} |"
        )
    chosen = [r for r in records if r.get("label") == "chosen" and "error" not in r]
    helion_s = sum(r["generate_s"] for r in chosen)
    triton_s = sum(r["compile_s"] for r in chosen)
    lines += [
        "",
        f"A first call's compile work, one kernel after another on this CPU: {helion_s:.1f} s generating the "
        f"{len(chosen)} kernels' code (Helion) and {triton_s:.1f} s compiling it for sm_90a (Triton, ptxas).",
    ]
    return "\n".join(lines)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("shape", nargs="?", help="a bench shape, e.g. B4_T2048_H16_D128")
    parser.add_argument("--mode", default="train_safe", help="a bench mode (default train_safe)")
    parser.add_argument("--case", help="a verification class key: its cases' launches instead of a shape's")
    parser.add_argument("--kernel", action="append", default=[], help="only this kernel (repeatable)")
    parser.add_argument("--default", action="store_true", help="also Helion's default configuration")
    parser.add_argument("--sweep", action="store_true", help="also candidates around the chosen configuration")
    parser.add_argument("--triton-path", help="compile with the Triton found here (prepended to PYTHONPATH)")
    parser.add_argument("--json", help="write the records, resources included, to this file")
    parser.add_argument("--compile-records", help=argparse.SUPPRESS)  # the child step
    args = parser.parse_args()
    if args.compile_records:
        compile_all(args.compile_records)
        return 0
    if not args.case and not args.shape:
        parser.error("give a bench shape or --case KEY")
    records, version = compiled(generate(args), args.triton_path)
    if args.json:
        Path(args.json).write_text(json.dumps(records, indent=1))
    print(report(records, version))
    return 0


def compiled(records: list[dict[str, Any]], triton_path: str | None) -> tuple[list[dict[str, Any]], str]:
    """The records with their resources, compiled in a child process (with `triton_path`'s Triton first on
    its path if given), and that Triton's version."""
    with tempfile.TemporaryDirectory() as scratch:
        path = Path(scratch, "records.json")
        path.write_text(json.dumps(records))
        env = dict(os.environ)
        env.pop("TRITON_INTERPRET", None)
        if triton_path:
            env["PYTHONPATH"] = os.pathsep.join(p for p in (triton_path, env.get("PYTHONPATH")) if p)
        child = subprocess.run([sys.executable, __file__, "--compile-records", str(path)], env=env)
        if child.returncode != 0:
            print(f"the compile step exited with {child.returncode}; the records it finished follow", file=sys.stderr)
        version = subprocess.run(
            [sys.executable, "-c", "import triton; print(triton.__version__)"], env=env, capture_output=True, text=True
        ).stdout.strip()
        return json.loads(path.read_text()), version or "?"


if __name__ == "__main__":
    sys.exit(main())
