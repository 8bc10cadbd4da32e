"""benchmarks/peak_memory.py: a call's peak memory counted from what its host code allocates, and the helion
forward's peak at inference (each intermediate freed once no later stage reads it)."""

from __future__ import annotations

import pytest
import torch
from benchmark_scripts import load

peak_memory = load("peak_memory")


def test_the_counter_follows_allocations_and_frees():
    kept = torch.randn(1000)  # made before: never counted

    def call() -> torch.Tensor:
        a = torch.empty(1000, dtype=torch.float32)  # 4000 bytes
        b = torch.empty(2000, dtype=torch.float32)  # 8000: 12000 live
        del a  # 8000
        c = b.view(2, 1000) + kept  # a view costs nothing; the sum is new: 16000 live, the peak
        del b
        return c  # the result counts until the caller drops it

    assert peak_memory.peak_bytes(call, [kept]) == 16000


def test_the_breakdown_lists_what_is_alive_at_the_peak():
    def call() -> torch.Tensor:
        big = torch.empty(3000, dtype=torch.float32)  # 12000 bytes
        small = torch.empty(500, dtype=torch.float64)  # 4000: 16000 live, the peak
        del big
        later = torch.empty(3000, dtype=torch.int32)  # 12000: 16000 live again, not above the peak
        del later
        return small

    counter = peak_memory.count(call, [], describe=True)
    assert counter.peak == 16000
    assert [(made.size, made.shape, made.dtype) for made in sorted(counter.at_peak, key=lambda m: -m.size)] == [
        (12000, (3000,), "float32"),
        (4000, (500,), "float64"),
    ]
    lines = peak_memory.breakdown(counter.at_peak).splitlines()
    assert len(lines) == 2 and "3000" in lines[0] and "float32" in lines[0] and "float64" in lines[1]


def test_inputs_written_in_place_do_not_count():
    buffer = torch.zeros(4096)
    assert peak_memory.peak_bytes(lambda: buffer.add_(1.0), [buffer]) == 0


def test_the_script_refuses_to_count_without_tritons_interpreter(monkeypatch, capsys):
    """Triton's kernels take CPU tensors only when interpreted, which must be chosen before Triton is
    imported: as a module (here) nothing switches it on, and `main` says so rather than count wrongly."""
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    with pytest.raises(SystemExit) as stopped:
        peak_memory.main(["B1_T64_H1_D64"])
    assert stopped.value.code == 2
    assert "Triton's interpreter must be on" in capsys.readouterr().err


@pytest.mark.parametrize("l2norm", [True, False])
def test_the_helion_forward_at_inference_holds_one_stage_at_a_time(monkeypatch, l2norm):
    """The peak is the larger of the solve's and the state pass's working sets, nothing more (the output's
    is smaller than the state pass's): allocating every intermediate up front, as the training forward
    must keep them, would hold ``M`` and ``h`` at once."""
    pytest.importorskip("helion", reason="helion is not installed (extra `helion`)")
    import kda

    monkeypatch.setenv("HELION_INTERPRET", "1")
    monkeypatch.setenv("KDA_VERIFY", "off")
    B, T, H, K, V, C = 1, 4 * 64 + 13, 2, 128, 128, 64
    NT = -(-T // C)
    generator = torch.Generator().manual_seed(int(torch.randint(0, 2**31, ())))
    q, k, v = (torch.randn(B, T, H, D, generator=generator, dtype=torch.bfloat16) for D in (K, K, V))
    g = -torch.rand(B, T, H, K, generator=generator).to(torch.bfloat16)
    beta = torch.rand(B, T, H, generator=generator).to(torch.bfloat16)

    def call():
        return kda.chunk_kda(
            q, k, v, g, beta, backend="helion", chunk_size=C, use_qk_l2norm_in_kernel=l2norm,
            output_final_state=True,
        )  # fmt: skip

    peak = peak_memory.peak_bytes(call, [q, k, v, g, beta])
    bf16, fp32 = 2, 4
    per_key = NT * H * C * K  # elements of one chunk-major [NT, HV, C, K] tensor
    ht = B * H * K * V * fp32
    # G, A_qk, q_e, w, k_g and u: held by the solve and the state pass alike
    common = fp32 * per_key + bf16 * NT * H * C * C + bf16 * 3 * per_key + bf16 * NT * H * C * V
    # the solve also holds M, beta and k's l2norm scales; the state pass h and the final state
    solve = common + fp32 * NT * H * C * C + fp32 * NT * H * C + (fp32 * B * T * H if l2norm else 0)
    state = common + bf16 * NT * H * K * V + ht
    small = 256  # the chunk tables, A_log's zeros
    assert max(solve, state) <= peak <= max(solve, state) + small, (peak, solve, state)


@pytest.mark.parametrize("l2norm", [True, False])
def test_the_helion_training_peak_is_chunk_backwards_working_set(monkeypatch, l2norm):
    """What the training forward keeps (fp32, chunk-major) and what `chunk_backward` reads and writes, nothing
    more: the normalized rows, ``q_e`` and ``k_g`` are made again where they are read, never stored."""
    pytest.importorskip("helion", reason="helion is not installed (extra `helion`)")
    import kda

    monkeypatch.setenv("HELION_INTERPRET", "1")
    monkeypatch.setenv("KDA_VERIFY", "off")
    K, V, C = 128, 64, 64
    leaves, do, _ = _training_inputs(K, V)
    B, T, H, _ = leaves[0].shape
    NT = -(-T // C)

    def call():
        o, _ = kda.chunk_kda(*leaves, backend="helion", chunk_size=C, use_qk_l2norm_in_kernel=l2norm)
        return torch.autograd.grad(o, leaves, do)

    peak = peak_memory.peak_bytes(call, [*leaves, do])
    bf16, fp32 = 2, 4
    by_key, by_value, scores, rows = NT * H * C * K, NT * H * C * V, NT * H * C * C, NT * H * C
    # kept by the forward: G, w; v_new; M, A_qk, T; h; beta; the l2norm's scales; and the output o
    saved = fp32 * (2 * by_key + by_value + 3 * scores + NT * H * K * V + rows) + bf16 * B * T * H * V
    saved += 2 * fp32 * B * T * H if l2norm else 0
    # chunk_backward's: dh and dv_new in; dq, dk, dG (per value head), dP_qk, dP_kk, dbeta and dv out; dA_log's rows
    backward = fp32 * (NT * H * K * V + by_value + 3 * by_key + 2 * scores + 2 * rows) + bf16 * B * T * H * V
    small = 256  # the chunk tables, A_log's zeros
    assert saved + backward <= peak <= saved + backward + small, (peak, saved, backward)


@pytest.mark.parametrize("backend", ["helion", "tilelang"])
def test_the_training_peak_is_at_most_flas_at_a_bench_shape(monkeypatch, backend):
    """The bar of the helion backend and of the tilelang backend's version 7, which stores no normalized rows
    (no more memory than FLA 0.6), counted for the bench's own training call."""
    monkeypatch.setenv("TRITON_INTERPRET", "1")  # FLA's kernels take CPU tensors (none runs: launches skipped)
    monkeypatch.setenv("FLA_TILELANG", "0")  # FLA's Triton path, as the bench runs it (its TileLang path wants a GPU)
    monkeypatch.setenv("HELION_INTERPRET", "1")
    monkeypatch.setenv("KDA_VERIFY", "off")
    pytest.importorskip(backend, reason=f"{backend} is not installed (extra `{backend}`)")
    pytest.importorskip("fla", reason="fla-core is not installed (extra `fla`)")
    from torch.utils._pytree import tree_flatten

    from kda.bench.shapes import MODES, BenchShape, make_inputs

    mode = MODES["train_safe"]
    inputs = make_inputs(BenchShape.parse("B4_T2048_H16_D128"), mode, "cpu", seed=int(torch.randint(0, 2**31, ())))
    existing = [x for x in tree_flatten(inputs.kwargs)[0] if isinstance(x, torch.Tensor)] + [inputs.do]
    peaks = {}
    for name in (backend, "baseline:fla"):
        call, why = peak_memory.call_of(name, inputs, mode)
        assert call is not None, why
        peaks[name] = peak_memory.peak_bytes(call, existing)
    assert peaks[backend] <= peaks["baseline:fla"], peaks


def _training_inputs(K: int, V: int):
    """A ragged training call (269 tokens: its chunk-major buffers differ in size from its token-major ones),
    K != V and raw rows, so that an input gradient's size is its own among the call's buffers."""
    generator = torch.Generator().manual_seed(int(torch.randint(0, 2**31, ())))
    B, T, H = 1, 4 * 64 + 13, 2
    q, k, v = (torch.randn(B, T, H, D, generator=generator, dtype=torch.bfloat16) for D in (K, K, V))
    g = -torch.rand(B, T, H, K, generator=generator).to(torch.bfloat16)
    beta = torch.rand(B, T, H, generator=generator).to(torch.bfloat16)
    leaves = [x.requires_grad_() for x in (q, k, v, g, beta)]
    do = torch.randn(B, T, H, V, generator=generator, dtype=torch.bfloat16)
    gradient_bytes = {"dg": B * T * H * K * 4, "dq": B * T * H * K * 2}  # fp32 dg; dq and dk in q's dtype
    return leaves, do, gradient_bytes


@pytest.mark.parametrize("backend", ["helion", "tilelang"])
def test_the_backward_makes_the_input_gradients_after_chunk_backward(monkeypatch, backend):
    """``chunk_backward``'s working set is the backward's peak; the input gradients are made after it, so
    none of their buffers is alive while it runs (they were made up front before)."""
    pytest.importorskip(backend, reason=f"{backend} is not installed (extra `{backend}`)")
    import kda

    monkeypatch.setenv("HELION_INTERPRET", "1")
    monkeypatch.setenv("KDA_VERIFY", "off")
    K, V = 128, 64
    leaves, do, gradient_bytes = _training_inputs(K, V)
    counter = peak_memory.LiveStorages()
    counter.existing([*leaves, do])
    alive_then: list[set[int]] = []

    def note_chunk_backward() -> None:
        alive_then.append(set(counter.sizes.values()))

    with peak_memory.launches_skipped():  # which puts back what it replaces, these two replacements included
        if backend == "helion":
            from kda.backends.helion import runtime

            def launch(fn, *args):
                if fn.__name__ == "chunk_backward_kernel":
                    note_chunk_backward()

            runtime.launch = launch
        else:
            import collections

            from kda.backends.tilelang import kernels

            def compiled(spec):
                stages = collections.defaultdict(lambda: lambda *args: None)
                stages["chunk_backward"] = lambda *args: note_chunk_backward()
                return stages

            kernels.compile_all = compiled
        with counter:
            o, _ = kda.chunk_kda(*leaves, backend=backend, chunk_size=64)
            grads = torch.autograd.grad(o, leaves, do)
            del o, grads
    assert len(alive_then) == 1
    assert not alive_then[0] & set(gradient_bytes.values()), (alive_then[0], gradient_bytes)
