"""`kda.chunk_kda` under `torch.compile` and CUDA-graph capture (`kda.library`, docs/design.md "torch.compile
and CUDA graphs").

Each test starts from an empty verification cache (tests/conftest.py), so tracing itself must verify the
backend. Most tests compile with the "eager" or "aot_eager" Dynamo backends (seconds on 2 cores); one uses
the default inductor backend, forward and backward. Every compiled test proves which backend ran through
`kda.trace_routes()`, whose routes the op's real implementation records.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from graphs import GraphRecorder

import kda
from kda import dispatch, library
from kda.backends.torch import TorchBackend
from kda.verify import relative_error
from kda.verify.policy import tolerance

GRADIENT_NAMES = ("dq", "dk", "dv", "dg", "dbeta", "dA_log", "ddt_bias", "dinitial_state")
INPUT_NAMES = ("q", "k", "v", "g", "beta", "A_log", "dt_bias", "initial_state")


@pytest.fixture(autouse=True)
def fresh_dynamo():
    """Each test traces anew: Dynamo's caches would otherwise let one test reuse another's graph."""
    torch._dynamo.reset()
    yield
    torch._dynamo.reset()


def records() -> list[Path]:
    root = Path(os.environ["KDA_CACHE_DIR"]) / "verification"
    return sorted(p for p in root.rglob("*") if p.is_file()) if root.exists() else []


def make_call(kind: str, dtype: torch.dtype = torch.float32) -> dict[str, Any]:
    """Fresh random inputs (never zeros) for a small call of one of three kinds, leaves requiring grad.

    dense: pre-gated realistic gates, an initial state, the final state. varlen: ragged lengths (one
    over four chunks of 32 with a ragged tail), grouped value heads, the safe gate with A_log and dt_bias,
    beta as logits, q/k l2norm, state_v_first. extreme: pre-gated gates of -2..-6 per token.
    """
    H, K, V = 1, 16, 16
    if kind == "varlen":
        lengths, HV = (141, 3, 0, 9), 2
    else:
        lengths, HV = (77,), 1
    T = sum(lengths)
    call: dict[str, Any] = {
        "q": torch.randn(1, T, H, K).to(dtype),
        "k": torch.randn(1, T, H, K).to(dtype),
        "v": torch.randn(1, T, HV, V).to(dtype),
        "beta": torch.rand(1, T, HV).to(dtype) * 0.9 + 0.05,
    }
    N = len(lengths)
    if kind == "varlen":
        bounds = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int32)
        call.update(
            g=torch.randn(1, T, HV, K),
            beta=torch.randn(1, T, HV),
            A_log=torch.rand(HV) * 2 - 1,
            dt_bias=torch.randn(HV * K) * 0.5,
            initial_state=torch.randn(N, HV, V, K) * 0.5,
            cu_seqlens=bounds,
            use_gate_in_kernel=True,
            safe_gate=True,
            lower_bound=-5.0,
            use_beta_sigmoid_in_kernel=True,
            use_qk_l2norm_in_kernel=True,
            state_v_first=True,
            output_final_state=True,
            chunk_size=32,
        )
    else:
        call["q"] = F.normalize(call["q"].float(), dim=-1).to(dtype)
        call["k"] = F.normalize(call["k"].float(), dim=-1).to(dtype)
        low, high = (-6.0, -2.0) if kind == "extreme" else (-0.5, -0.01)
        call["g"] = torch.rand(1, T, HV, K) * (high - low) + low
        call.update(initial_state=torch.randn(N, HV, K, V) * 0.5, output_final_state=True)
    for name in INPUT_NAMES:
        if name in call:
            call[name] = call[name].detach().requires_grad_(True)
    return call


def fresh_leaves(call: dict[str, Any]) -> dict[str, Any]:
    return {
        n: (a.detach().clone().requires_grad_(True) if n in INPUT_NAMES else a.clone() if torch.is_tensor(a) else a)
        for n, a in call.items()
    }


def run_kda(call: dict[str, Any]) -> tuple[torch.Tensor, torch.Tensor | None]:
    return kda.chunk_kda(**call, backend="torch")


def loss_and_grads(o: torch.Tensor, final_state: torch.Tensor | None, call: dict[str, Any], seed: int):
    """A loss that weighs every output element differently, and the gradients of the call's leaves."""
    weights = torch.Generator().manual_seed(seed)
    loss = (o.float() * torch.randn(o.shape, generator=weights)).sum()
    if final_state is not None:
        loss = loss + (final_state * torch.randn(final_state.shape, generator=weights)).sum()
    leaves = [call[n] for n in INPUT_NAMES if n in call]
    grads = torch.autograd.grad(loss, leaves)
    return dict(zip([n for n in INPUT_NAMES if n in call], grads))


def compare_with_eager_and_reference(call, o, final_state, grads, seed):
    """Compiled results equal eager kda's (the same backend, bit for bit), and meet the policy against the
    float64 reference."""
    eager_call = fresh_leaves(call)
    eager_o, eager_state = run_kda(eager_call)
    eager_grads = loss_and_grads(eager_o, eager_state, eager_call, seed)
    torch.testing.assert_close(o, eager_o, rtol=0, atol=0)
    torch.testing.assert_close(final_state, eager_state, rtol=0, atol=0)
    for name, grad in grads.items():
        torch.testing.assert_close(grad, eager_grads[name], rtol=0, atol=0, msg=f"d{name} differs from eager")

    ref_call = fresh_leaves(call)
    ref_o, ref_state = kda.kda_reference(**{n: a for n, a in ref_call.items() if n != "chunk_size"})
    ref_grads = loss_and_grads(ref_o, ref_state, ref_call, seed)
    dtype = str(call["q"].dtype).removeprefix("torch.")
    assert relative_error(o, ref_o) <= tolerance("o", dtype)
    assert relative_error(final_state, ref_state) <= tolerance("final_state", dtype)
    for name, grad in grads.items():
        gradient = "dinitial_state" if name == "initial_state" else f"d{name}"
        error = relative_error(grad, ref_grads[name])
        assert error <= tolerance(gradient, dtype), f"{gradient}: {error:.2e} from the float64 reference"


def nan_poisoned(tensor: torch.Tensor) -> torch.Tensor:
    return torch.full_like(tensor, float("nan"))


# ---------------------------------------------------------------------------------------- one node


def kda_nodes(gm: torch.fx.GraphModule) -> list[str]:
    """The calls in a graph that are kda's or that compute (every call_function but getitem and views)."""
    names = []
    for node in gm.graph.nodes:
        if node.op == "call_function" and "getitem" not in str(node.target):
            target = str(node.target)
            if "auto_functionalized" in target:  # a mutating op, functionalized: name the op it wraps
                target += f"({node.args[0]})"
            names.append(target)
    return names


def test_one_kda_node_forward_and_backward(seed):
    """fullgraph=True holds the call as one op node in the forward graph and one in the backward graph,
    and nothing else (no kda Python in the graph, no graph break)."""
    recorder = GraphRecorder()
    call = make_call("dense")
    compiled = torch.compile(run_kda, fullgraph=True, backend=recorder.backend)
    with kda.trace_routes() as routes:
        o, final_state = compiled(call)
        loss_and_grads(o, final_state, call, seed)
    assert len(recorder.forward) == 1 and len(recorder.backward) == 1
    assert kda_nodes(recorder.forward[0]) == ["kda.chunk_kda.default"]
    assert kda_nodes(recorder.backward[0]) == ["kda.chunk_kda_backward.default"]
    assert [(r.backend, r.phase) for r in routes] == [("torch", "forward"), ("torch", "backward")]


def test_dynamo_sees_one_graph_without_breaks():
    call = make_call("dense")
    explanation = torch._dynamo.explain(run_kda)(call)
    assert explanation.graph_count == 1 and explanation.graph_break_count == 0
    ops = [str(n.target) for g in explanation.graphs for n in g.graph.nodes if n.op == "call_function"]
    assert [op for op in ops if "getitem" not in op] == ["kda.chunk_kda"]


# ------------------------------------------------------------------------------ outputs and gradients


def test_inductor_fullgraph_forward_backward_from_an_empty_cache(seed):
    """The default backend (inductor), fullgraph, forward and backward, with no verification record: the
    trace verifies the backend (a record appears), and results equal eager kda's and the reference's."""
    assert records() == []
    call = make_call("dense")
    compiled = torch.compile(run_kda, fullgraph=True)
    with kda.trace_routes() as routes:
        o, final_state = compiled(call)
        grads = loss_and_grads(o, final_state, call, seed)
    assert records(), "tracing verified no backend"
    assert [(r.backend, r.phase) for r in routes] == [("torch", "forward"), ("torch", "backward")]
    assert routes[0].case_class.endswith("/train")
    compare_with_eager_and_reference(call, o, final_state, grads, seed)


@pytest.mark.parametrize("kind", ["varlen", "extreme"])
def test_compiled_results_equal_eager(kind, seed):
    call = make_call(kind)
    compiled = torch.compile(run_kda, fullgraph=True, backend="aot_eager")
    with kda.trace_routes() as routes:
        o, final_state = compiled(call)
        grads = loss_and_grads(o, final_state, call, seed)
    assert [r.backend for r in routes] == ["torch", "torch"]
    compare_with_eager_and_reference(call, o, final_state, grads, seed)


class SavingBackend(TorchBackend):
    """The torch backend, but its forward saves something its backward requires (as triton's and fla's do)."""

    name = "saving"
    saves_for_backward = True

    def forward(self, inputs, spec, out=None):
        result = super().forward(inputs, spec, out)
        if spec.requires_grad:
            result.saved = ("from forward", result.o.detach().clone())
        return result

    def backward(self, inputs, spec, saved, do, dfinal_state):
        assert saved is not None and saved[0] == "from forward", "backward did not get what forward saved"
        expected = super().forward(inputs, spec).o
        torch.testing.assert_close(saved[1], expected, rtol=0, atol=0)
        return super().backward(inputs, spec, saved, do, dfinal_state)


def test_backward_gets_what_the_forward_saved(seed):
    """A backend whose backward reads `saved` gets it from its own forward run again in the backward op."""
    kda.register_backend(SavingBackend)
    call = make_call("dense")
    compiled = torch.compile(lambda c: kda.chunk_kda(**c, backend="saving"), fullgraph=True, backend="aot_eager")
    with kda.trace_routes() as routes:
        o, final_state = compiled(call)
        grads = loss_and_grads(o, final_state, call, seed)
    assert [(r.backend, r.phase) for r in routes] == [("saving", "forward"), ("saving", "backward")]
    compare_with_eager_and_reference(call, o, final_state, grads, seed)


def test_only_the_gradients_asked_for():
    """Inputs that need no gradient get none, as eagerly (the op's autograd drops them)."""
    call = make_call("dense")
    call["q"] = call["q"].detach()
    call["initial_state"] = call["initial_state"].detach()
    o, _ = torch.compile(run_kda, fullgraph=True, backend="aot_eager")(call)
    o.sum().backward()
    assert call["q"].grad is None and call["initial_state"].grad is None
    assert all(torch.isfinite(call[n].grad).all() for n in ("k", "v", "g", "beta"))


def test_inference_call_and_dynamic_shapes():
    """Without gradients the forward class is verified; with dynamic shapes the contract is checked at the
    sizes' hints while tracing, and each call is right at its own size."""
    call = make_call("dense")
    plain = {n: (a.detach() if torch.is_tensor(a) else a) for n, a in call.items()}
    compiled = torch.compile(run_kda, fullgraph=True, backend="aot_eager", dynamic=True)
    for T in (77, 40):
        sliced = {n: (a[:, :T] if n in ("q", "k", "v", "g", "beta") else a) for n, a in plain.items()}
        with torch.no_grad(), kda.trace_routes() as routes:
            o, final_state = compiled(sliced)
        assert [r.case_class.endswith("/fwd") for r in routes] == [True]
        eager_o, eager_state = run_kda(sliced)
        torch.testing.assert_close(o, eager_o, rtol=0, atol=0)
        torch.testing.assert_close(final_state, eager_state, rtol=0, atol=0)


def test_no_final_state_returns_none():
    call = make_call("dense")
    call["output_final_state"] = False
    o, final_state = torch.compile(run_kda, fullgraph=True, backend="eager")(call)
    assert final_state is None and o.shape == call["v"].shape


# --------------------------------------------------------------------------------------------- errors


@pytest.mark.parametrize(
    ("change", "argument"),
    [
        ({"chunk_size": 16}, "chunk_size"),  # a rule of the contract
        ({"lower_bound": -1.0}, "lower_bound"),  # lower_bound without the in-kernel gate
        ({"head_first": True}, "head_first"),  # FLA would read head-first tensors as time-major
        ({"return_intermediate_states": True}, "return_intermediate_states"),  # eager only
        ({"output_final_state": 1}, "output_final_state"),  # a value the schema cannot take
        ({"cp_context": object()}, "cp_context"),  # context parallelism is eager only
        ({"backend": None}, "backend"),
    ],
)
@pytest.mark.parametrize("dynamic", [False, True])
def test_bad_call_raises_kda_input_error(change, argument, dynamic):
    """Found while tracing (a warning names it), raised when the compiled code runs, before any backend."""
    call = {**make_call("dense"), "backend": "torch", **change}
    compiled = torch.compile(lambda c: kda.chunk_kda(**c), fullgraph=True, backend="eager", dynamic=dynamic)
    with (
        kda.trace_routes() as routes,
        pytest.warns(RuntimeWarning, match="raises KDAInputError"),
        pytest.raises(kda.KDAInputError) as error,
    ):
        compiled(call)
    assert error.value.argument == argument
    assert routes == []


def test_unservable_backend_raises_backend_selection_error():
    call = make_call("dense")
    compiled = torch.compile(lambda c: kda.chunk_kda(**c, backend="no-such-backend"), fullgraph=True, backend="eager")
    with pytest.warns(RuntimeWarning), pytest.raises(kda.BackendSelectionError):
        compiled(call)


def test_eager_calls_never_reach_the_op(monkeypatch):
    def fail(*args, **kwargs):
        raise AssertionError("the eager path went through the custom op")

    monkeypatch.setattr(library, "chunk_kda_call", fail)
    call = make_call("dense")
    o, _ = run_kda(call)
    assert torch.isfinite(o).all()


# ---------------------------------------------------------------------------------- CUDA-graph capture


def test_capture_refuses_lazy_verification(monkeypatch):
    """Inside capture, a call that would verify raises GraphCaptureError before any work; a warmed-up call,
    or one whose record exists but whose decision is not cached, goes through."""
    call = {n: (a.detach() if torch.is_tensor(a) else a) for n, a in make_call("dense").items()}
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: True)
    with kda.trace_routes() as routes, pytest.raises(kda.GraphCaptureError, match="warm-up"):
        run_kda(call)
    assert routes == [] and records() == []

    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: False)
    expected, _ = run_kda(call)  # the warm-up: verifies, outside capture
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: True)
    for forget in (False, True):
        if forget:
            dispatch.clear_cache()  # the record stays on disk: no verification is needed
        o, _ = run_kda(call)
        torch.testing.assert_close(o, expected, rtol=0, atol=0)


@pytest.mark.gpu
@pytest.mark.parametrize("backend", ["torch", "auto"])
def test_cuda_graph_capture_and_replay(backend, seed):
    """A fixed-shape forward captured in a CUDA graph (after a warm-up) and replayed on new inputs equals
    eager kda on those inputs."""
    device = torch.device("cuda")

    def inputs() -> dict[str, Any]:
        call = make_call("dense", torch.bfloat16)
        return {n: (a.detach().to(device) if torch.is_tensor(a) else a) for n, a in call.items()}

    static = inputs()
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):  # the warm-up: verification and the first launches happen here
        kda.chunk_kda(**static, backend=backend)
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        o, final_state = kda.chunk_kda(**static, backend=backend)
    for _ in range(2):
        fresh = inputs()
        for name in ("q", "k", "v", "g", "beta", "initial_state"):
            static[name].copy_(fresh[name])
        o.copy_(nan_poisoned(o))  # a replay that writes nothing fails
        graph.replay()
        torch.cuda.synchronize()
        expected_o, expected_state = kda.chunk_kda(**fresh, backend=backend)
        torch.testing.assert_close(o, expected_o, rtol=0, atol=0)
        torch.testing.assert_close(final_state, expected_state, rtol=0, atol=0)


@pytest.mark.gpu
def test_compiled_with_cuda_graphs_equals_eager(seed):
    """mode="reduce-overhead" (inductor's CUDA graphs) over the op, forward, fullgraph."""
    device = torch.device("cuda")
    call = {
        n: (a.detach().to(device) if torch.is_tensor(a) else a) for n, a in make_call("dense", torch.bfloat16).items()
    }
    compiled = torch.compile(lambda c: kda.chunk_kda(**c), fullgraph=True, mode="reduce-overhead")
    for _ in range(3):  # warm-up, record, replay
        with torch.no_grad():
            o, final_state = compiled(call)
        o, final_state = o.clone(), final_state.clone()
    expected_o, expected_state = kda.chunk_kda(**call)
    torch.testing.assert_close(o, expected_o, rtol=0, atol=0)
    torch.testing.assert_close(final_state, expected_state, rtol=0, atol=0)


# -------------------------------------------------------------------------------- the define_op hook


def _add_into(out: torch.Tensor, x: torch.Tensor, times: int) -> None:
    out.add_(x * times)


def _add_into_fake(out: torch.Tensor, x: torch.Tensor, times: int) -> None:
    return None


_add_into_op = library.define_op(
    "test_add_into",
    (library.OpParameter("out", "tensor"), library.OpParameter("x", "tensor"), library.OpParameter("times", "int")),
    None,
    _add_into,
    _add_into_fake,
    mutates_args=("out",),
)


def test_define_op_registers_a_mutating_op():
    """The hook other kda ops (the decode op's in-place state pool) register through: a compiled caller
    sees the mutation, and the graph holds the op once."""
    assert "Tensor(a0!) out" in str(torch.ops.kda.test_add_into.default._schema)
    recorder = GraphRecorder()

    def step(out: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        torch.ops.kda.test_add_into(out, x, 3)
        return out * 1

    out, x = torch.randn(4), torch.randn(4)
    expected = out + 3 * x
    result = torch.compile(step, fullgraph=True, backend=recorder.backend)(out, x)
    torch.testing.assert_close(out, expected)
    torch.testing.assert_close(result, expected)
    assert sum("test_add_into" in op for op in kda_nodes(recorder.forward[0])) == 1
