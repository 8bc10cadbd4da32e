"""Compile the kernels for a GPU architecture without a GPU, and report what each needs.

    python -m kda.backends.triton.aot            # sm90, the shipped configurations, a few head dims

Triton's compiler (through ptxas) runs on any machine; what it cannot check without the GPU is speed.
What it does check: that every kernel compiles for the target at the configurations `configs` ships, and
how much shared memory each needs, against the per-block limit (227 KB on Hopper). It also reports each
kernel's registers per thread and spill stack (from `cuobjdump --dump-resource-usage` on the cubin):
on the H200 every forward kernel was found limited by registers (12.5% occupancy), so this is the
number a launch setting changes that can be read without a GPU. The tests run this in a fresh process
(Triton must not be in interpreter mode).

Its figures are this machine's Triton's, which need not be the GPU's: version 13's backward at K = 256
came to 213 KB here (Triton 3.9) and asked for 248 KB on the H200 (Triton 3.6), where it did not launch.
Keep a margin below the limit. The register counts are no closer: Triton 3.9 and 3.6 both report 255 a
thread for the forward's kernels here, where Nsight Compute read 186 for the state pass on the H200.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import tempfile

SHARED_LIMIT = {9: 232448, 8: 166912}  # bytes per block: sm90, sm80


def kernel_requirements(capability: int, K: int, V: int, C: int) -> dict[str, dict[str, int | None]]:
    """Per kernel compiled for ``sm{capability}0`` at these sizes: ``shared`` memory (bytes), ``registers``
    per thread and ``spill_bytes`` (the stack a thread spills to; None where cuobjdump is missing)."""
    if os.environ.get("TRITON_INTERPRET", "0") == "1":
        raise RuntimeError("compiling needs Triton out of interpreter mode: unset TRITON_INTERPRET")
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource, compile

    from kda.backends.triton.backward import bwd_chunk_kernel, bwd_state_kernel
    from kda.backends.triton.configs import intra_block_k, intra_block_w, launch_config
    from kda.backends.triton.gate import SAFE, gate_cumsum_kernel
    from kda.backends.triton.intra import SUB_CHUNK, intra_chunk_kernel
    from kda.backends.triton.output import output_kernel
    from kda.backends.triton.state import state_pass_kernel
    from kda.backends.triton.storage import (
        TRAINING_BACKWARD_CHUNK,
        TRAINING_BACKWARD_STATE,
        TRAINING_INTRA,
        TRAINING_STATE,
    )
    from kda.backends.triton.tails import ROWS, gate_beta_tail_kernel, qk_tail_kernel
    from kda.backends.triton.tiles import padded_dim

    target = GPUTarget("cuda", capability * 10, 32)
    config = launch_config(capability, K, V)
    BK, BV_all = padded_dim(K), padded_dim(V)
    f32, bf16, i32 = "*fp32", "*bf16", "*i32"
    heads = {"H": 4, "HV": 8, "K": K, "V": V}

    def shared(fn, signature, constants, warps, stages=3) -> dict[str, int | None]:
        source = ASTSource(
            fn=fn, signature={**signature, **dict.fromkeys(constants, "constexpr")}, constexprs=constants
        )
        kernel = compile(source, target=target, options={"num_warps": warps, "num_stages": stages})
        return {"shared": kernel.metadata.shared, **_registers(kernel.asm["cubin"])}

    needs = {
        "gate": shared(
            gate_cumsum_kernel,
            {
                "g": bf16,
                "A_log": f32,
                "dt_bias": f32,
                "G": f32,
                "chunk_starts": i32,
                "chunk_seq_ends": i32,
                "lower_bound": "fp32",
            },
            {
                "HV": 8,
                "K": K,
                "GATE": SAFE,
                "HAS_A_LOG": True,
                "HAS_DT_BIAS": True,
                "BT": C,
                "BK": min(config.gate_block_k, BK),
                "BC": SUB_CHUNK,
            },
            config.gate_warps,
        ),
        "intra": shared(
            intra_chunk_kernel,
            {
                "q": bf16,
                "k": bf16,
                "v": bf16,
                "beta": bf16,
                "G": f32,
                "A_kk": f32,
                "A_qk": bf16,
                "M_out": f32,
                "w": bf16,
                "u": bf16,
                "k_g": bf16,
                "chunk_starts": i32,
                "chunk_seq_ends": i32,
            },
            {
                **heads,
                "L2": True,
                "SIGMOID": True,
                "TWO": False,
                "BT": C,
                "BK": BK,
                "BV": BV_all,
                "BKC": min(BK, 32),
                "BC": SUB_CHUNK,
                "BW": intra_block_w(config, BK, BV_all),
                "BKS": intra_block_k(config, BK),
                "DOT_PRECISION": "tf32",
                "SAVE": False,
                "ROUND": False,
                "STORED_OPERANDS": config.intra_half_products,
                "PARTS": 3,
            },
            config.intra_warps,
            config.intra_stages,
        ),
        "state": shared(
            state_pass_kernel,
            {
                "k_g": bf16,
                "w": bf16,
                "u": bf16,
                "G": f32,
                "h": bf16,
                "h0": f32,
                "ht": f32,
                "bounds": i32,
                "chunk_offsets": i32,
            },
            {
                "HV": 8,
                "K": K,
                "V": V,
                "HAS_H0": True,
                "STORE_HT": True,
                "V_FIRST": False,
                "BT": C,
                "BK": BK,
                "BV": min(config.state_block_v, BV_all),
                "DOT_PRECISION": "tf32",
                "ROUND": False,
                "STORED_OPERANDS": True,
            },
            config.state_warps,
            config.state_stages,
        ),
        "output": shared(
            output_kernel,
            {
                "q": bf16,
                "G": f32,
                "h": bf16,
                "v_new": bf16,
                "A_qk": bf16,
                "o": bf16,
                "chunk_starts": i32,
                "chunk_seq_ends": i32,
                "scale": "fp32",
            },
            {
                **heads,
                "L2": True,
                "BT": C,
                "BK": BK,
                "BV": min(config.output_block_v, BV_all),
                "DOT_PRECISION": "tf32",
                "ROUND": False,
                "STORED_OPERANDS": True,
            },
            config.output_warps,
        ),
    }
    # The training forward's two kernels with training's products (fp32 intermediates), then the backward, as
    # bf16 training runs them (`storage.dot_precisions`).
    needs["intra_train"] = shared(
        intra_chunk_kernel,
        {
            "q": bf16,
            "k": bf16,
            "v": bf16,
            "beta": bf16,
            "G": f32,
            "A_kk": f32,
            "A_qk": f32,
            "M_out": f32,
            "w": f32,
            "u": f32,
            "k_g": f32,
            "chunk_starts": i32,
            "chunk_seq_ends": i32,
        },
        {
            **heads,
            "L2": True,
            "SIGMOID": True,
            "TWO": False,
            "BT": C,
            "BK": BK,
            "BV": BV_all,
            "BKC": min(BK, 32),
            "BC": SUB_CHUNK,
            "BW": intra_block_w(config, BK, BV_all, training=True),
            "BKS": intra_block_k(config, BK, training=True),
            "DOT_PRECISION": TRAINING_INTRA,
            "SAVE": True,
            "ROUND": False,
            "STORED_OPERANDS": False,
            "PARTS": 3,
        },
        config.intra_warps,
        config.intra_stages,
    )
    needs["state_train"] = shared(
        state_pass_kernel,
        {"k_g": f32, "w": f32, "u": f32, "G": f32, "h": f32, "h0": f32, "ht": f32, "bounds": i32, "chunk_offsets": i32},
        {
            "HV": 8,
            "K": K,
            "V": V,
            "HAS_H0": True,
            "STORE_HT": True,
            "V_FIRST": False,
            "BT": C,
            "BK": BK,
            "BV": min(config.state_block_v, BV_all),
            "DOT_PRECISION": TRAINING_STATE,
            "ROUND": False,
            "STORED_OPERANDS": False,
        },
        config.state_warps,
        config.state_stages,
    )
    needs["bwd_chunk"] = shared(
        bwd_chunk_kernel,
        {
            "q": bf16,
            "k": bf16,
            "v": bf16,
            "beta": bf16,
            "G": f32,
            "h": f32,
            "dh": f32,
            "v_new": f32,
            "dd": f32,
            "do": bf16,
            "T_inv": f32,
            "A_qk": f32,
            "M": f32,
            "norms": f32,
            "dq": f32,
            "dk": f32,
            "da": f32,
            "dv": bf16,
            "dbeta": f32,
            "chunk_starts": i32,
            "chunk_seq_ends": i32,
            "scale": "fp32",
        },
        {
            **heads,
            "L2": True,
            "SIGMOID": True,
            "TWO": False,
            "BT": C,
            "BK": BK,
            "BV": min(config.backward_block_v, BV_all),
            "BKB": min(config.backward_block_k, BK),
            "BKC": min(BK, config.backward_block_k, 16),
            "BC": SUB_CHUNK,
            "DOT_PRECISION": TRAINING_BACKWARD_CHUNK,
            "ROUND": False,
            "PAIRS": 2,
        },
        config.backward_warps,
        config.backward_stages,
    )
    needs["bwd_state"] = shared(
        bwd_state_kernel,
        {
            "q": bf16,
            "k": bf16,
            "G": f32,
            "w": f32,
            "A_qk": f32,
            "do": bf16,
            "dd": f32,
            "dh": f32,
            "dht": f32,
            "dh0": f32,
            "bounds": i32,
            "chunk_offsets": i32,
            "scale": "fp32",
        },
        {
            **heads,
            "L2": True,
            "HAS_DHT": True,
            "STORE_DH0": True,
            "V_FIRST": False,
            "BT": C,
            "BK": BK,
            "BV": min(config.backward_state_block_v, BV_all),
            "DOT_PRECISION": TRAINING_BACKWARD_STATE,
        },
        config.backward_state_warps,
        1,
    )
    needs["qk_tail"] = shared(
        qk_tail_kernel,
        {"x": bf16, "dx_heads": f32, "dx": bf16, "tokens": "i32"},
        {"H": 4, "HV": 8, "K": K, "L2": True, "BR": ROWS, "BK": BK},
        4,
    )
    needs["gate_beta_tail"] = shared(
        gate_beta_tail_kernel,
        {
            "g": bf16,
            "da": f32,
            "A_log": f32,
            "dt_bias": f32,
            "dg": bf16,
            "dA_log_parts": f32,
            "ddt_parts": f32,
            "beta": bf16,
            "dbeta_heads": f32,
            "dbeta": bf16,
            "tokens": "i32",
            "lower_bound": "fp32",
        },
        {
            "HV": 8,
            "K": K,
            "GATE": SAFE,
            "HAS_A_LOG": True,
            "HAS_DT_BIAS": True,
            "SIGMOID": True,
            "TWO": False,
            "BR": ROWS,
            "BK": BK,
        },
        4,
    )
    return needs


def _registers(cubin: bytes) -> dict[str, int | None]:
    import triton

    tool = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "cuobjdump")
    if not os.path.exists(tool):
        return {"registers": None, "spill_bytes": None}
    with tempfile.TemporaryDirectory() as scratch:
        path = os.path.join(scratch, "kernel.cubin")
        with open(path, "wb") as f:
            f.write(cubin)
        usage = subprocess.run([tool, "--dump-resource-usage", path], capture_output=True, text=True).stdout
    registers, stack = re.search(r"REG:(\d+)", usage), re.search(r"STACK:(\d+)", usage)
    return {
        "registers": int(registers.group(1)) if registers else None,
        "spill_bytes": int(stack.group(1)) if stack else None,
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m kda.backends.triton.aot", description=__doc__.split("\n\n")[0])
    parser.add_argument("--capability", type=int, default=9, help="major compute capability (9: Hopper)")
    parser.add_argument("--dims", default="64x32,128x64,256x64", help="KxC list (K = V), comma-separated")
    args = parser.parse_args(argv)
    limit = SHARED_LIMIT.get(args.capability, SHARED_LIMIT[8])
    fields = {"shared_bytes": "shared", "registers": "registers", "spill_bytes": "spill_bytes"}  # report: need
    report: dict[str, dict[str, dict[str, int | None]]] = {name: {} for name in fields}
    over = []
    for item in args.dims.split(","):
        K, C = (int(x) for x in item.split("x"))
        needs = kernel_requirements(args.capability, K, K, C)
        for name, field in fields.items():
            report[name][f"K{K}_C{C}"] = {kernel: need[field] for kernel, need in needs.items()}
        over += [
            f"{name} at K={K}, C={C}: {need['shared']} B > {limit} B"
            for name, need in needs.items()
            if (need["shared"] or 0) > limit
        ]
    print(json.dumps({"capability": args.capability, "shared_limit": limit, **report, "over": over}))
    return 1 if over else 0


if __name__ == "__main__":
    sys.exit(main())
