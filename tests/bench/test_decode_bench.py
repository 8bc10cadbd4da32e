"""`python -m kda.bench --mode decode` on the CPU: shape names, the floor's arithmetic, inputs, the CLI end to end."""

from __future__ import annotations

import json

import pytest
import torch

import kda
from kda.bench import cli
from kda.bench.decode import DECODE_SHAPES, DecodeShape, decode_inputs, run_decode
from kda.recurrent.spec import RecurrentSpec


def test_the_default_decode_shapes():
    parsed = [DecodeShape.parse(name) for name in DECODE_SHAPES]
    assert {(s.N, s.T, s.pool) for s in parsed} == {
        (n, t, p) for n in (1, 64, 256) for t in (1, 4) for p in ("fp32", "bf16")
    }
    assert all(s.HV == 32 and s.D == 128 for s in parsed)
    for bad in ("N0_T1_HV32_D128_fp32", "N1_T1_HV32_D128_fp8", "B1_T8192_H96_D128"):
        with pytest.raises(ValueError):
            DecodeShape.parse(bad)


def test_the_floor_counts_the_state_both_ways_and_every_kept_state():
    one = DecodeShape.parse("N256_T1_HV32_D128_fp32")
    state = 256 * 32 * 128 * 128 * 4
    tokens = 256 * 32 * (4 * 128 + 1) * 2 + 256 * 32 * 128 * 2
    assert one.floor_bytes() == 2 * state + tokens  # 0.54 GB each way, as docs/design.md says
    spec = DecodeShape.parse("N256_T4_HV32_D128_bf16")
    assert spec.floor_bytes() == 5 * (state // 2) + 4 * tokens  # read once, written after each of 4 tokens


@pytest.mark.parametrize("name", ["N3_T1_HV2_D16_bf16", "N3_T4_HV2_D16_fp32"])
def test_decode_inputs_are_a_valid_pool_call(name):
    shape = DecodeShape.parse(name)
    kwargs = decode_inputs(shape, torch.device("cpu"), seed=1)
    spec = RecurrentSpec.from_call(**kwargs)
    assert spec.inplace_final_state and spec.pool_kind == ("tokens" if shape.T > 1 else "slots")
    assert kwargs["initial_state"].dtype == shape.pool_dtype
    assert (kwargs["ssm_state_indices"] >= 0).all()  # no padding: FLA's kernel cannot skip it
    assert (kwargs["q"] != 0).float().mean() > 0.9


def test_run_decode_times_against_the_measured_copy_bandwidth():
    calls = []

    def fake_timer(fn, device, **_):
        calls.append(fn)
        return 2.0

    data = run_decode(
        ["N2_T1_HV2_D16_fp32"],
        ["torch", "auto", "baseline:fla"],
        torch.device("cpu"),
        rounds=2,
        copy_bytes=1 << 16,
        timer=fake_timer,
    )
    rows = {r["backend"]: r for r in data["rows"]}
    assert rows["torch"]["median_ms"] == 2.0 and rows["auto"]["chose"] == "torch"
    assert rows["baseline:fla"]["status"] == "skipped"
    floor = DecodeShape.parse("N2_T1_HV2_D16_fp32").floor_bytes() / data["copy_bandwidth_bytes_per_s"] * 1e3
    assert rows["torch"]["floor_ms"] == pytest.approx(floor)
    assert rows["torch"]["pct_floor"] == pytest.approx(100 * floor / 2.0)
    assert len(calls) == 1 + 2 * 2  # the copy, then 2 rows x 2 rounds


def test_the_cli_runs_decode_tiny_on_the_cpu(tmp_path, capsys):
    code = cli.main(
        ["--mode", "decode", "--shape", "N2_T4_HV2_D16_bf16", "--backend", "torch", "--warmup-ms", "1",
         "--rep-ms", "2", "--rounds", "1", "--out", str(tmp_path)]
    )  # fmt: skip
    assert code == 0
    data = json.loads((tmp_path / "decode.json").read_text())
    assert data["mode"] == "decode" and data["copy_bandwidth_bytes_per_s"] > 0
    (row,) = data["rows"]
    assert row["backend"] == "torch" and row["status"] == "ok" and row["median_ms"] > 0
    assert "% of floor" in capsys.readouterr().out
    assert cli.main(["--mode", "decode", "--mode", "fwd"]) == 2
    assert cli.main(["--mode", "decode", "--shape", "B1_T8192_H96_D128"]) == 2
    assert kda.get_backend("torch")  # the registry is untouched


def test_graph_rows_time_the_captured_replay(monkeypatch):
    """--graph: each row's call is captured once, its replay timed every round; a row that cannot be captured
    keeps its eager figures and says why."""
    captured = []

    def fake_capture(fn, device):
        captured.append(fn)
        if len(captured) == 2:
            raise RuntimeError("operation not permitted when stream is capturing")
        return lambda: "replay"

    timed = []

    def fake_timer(fn, device, **_):
        timed.append(fn)
        return 0.5 if getattr(fn, "__name__", "") == "<lambda>" and fn() == "replay" else 2.0

    monkeypatch.setattr("kda.bench.timing.capture_graph", fake_capture)
    data = run_decode(
        ["N2_T1_HV2_D16_fp32"], ["torch", "auto"], torch.device("cpu"), rounds=2, copy_bytes=1 << 16,
        timer=fake_timer, graph=True,
    )  # fmt: skip
    first, second = data["rows"]
    assert first["median_ms"] == 2.0 and first["graph_ms"] == 0.5 and first["graph_round_ms"] == [0.5, 0.5]
    assert first["graph_pct_floor"] == pytest.approx(4 * first["pct_floor"])
    assert second["graph_ms"] is None and "not capturable" in second["reason"] and second["median_ms"] == 2.0
    assert len(captured) == 2 and len(timed) == 1 + 2 * 2 + 2  # copy, eager rows x rounds, one graph x rounds


def test_graph_needs_decode_and_cuda(capsys):
    assert cli.main(["--graph", "--mode", "fwd"]) == 2
    assert "needs --mode decode" in capsys.readouterr().err
    if not torch.cuda.is_available():
        assert cli.main(["--mode", "decode", "--graph", "--device", "cpu", "--shape", "N2_T1_HV2_D16_fp32"]) == 2
        assert "--graph needs a CUDA device" in capsys.readouterr().err
