"""`kda.fused_recurrent_kda` under `torch.compile` (`kda.recurrent.library`): one custom op that writes the
state pool and `out` in place, validated and verified while tracing from an empty verification cache, and a
small model calling both ops, forward and backward. The compiled results equal eager kda's bit for bit (the
same backend), which the decode op's own tests hold to the float64 reference; routes prove what ran."""

from __future__ import annotations

from typing import Any

import pytest
import torch
import torch.nn.functional as F
from graphs import GraphRecorder

import kda
from kda.recurrent import library as recurrent_library


@pytest.fixture(autouse=True)
def fresh_dynamo():
    torch._dynamo.reset()
    yield
    torch._dynamo.reset()


def kda_ops(gm: torch.fx.GraphModule) -> list[str]:
    """The kda ops a graph calls, in order (a mutating op appears functionalized: named by the op it wraps)."""
    found = []
    for node in gm.graph.nodes:
        target = str(node.args[0]) if "auto_functionalized" in str(node.target) else str(node.target)
        if node.op == "call_function" and target.startswith("kda."):
            found.append(target)
    return found


def decode_step(N: int = 3, HV: int = 2, K: int = 16, V: int = 12, T: int = 1) -> dict[str, Any]:
    """A decode step over a pool with more slots than sequences in a random order, a padding row (-1),
    the sigmoid gate, l2norm and beta sigmoid in kernel; fresh random inputs, never zeros."""
    slots = N + 4
    order = torch.randperm(slots)[:N].to(torch.int32)
    order[1] = -1  # a padding row: nothing read or written, output 0
    return {
        "q": torch.randn(N, T, HV, K),
        "k": torch.randn(N, T, HV, K),
        "v": torch.randn(N, T, HV, V),
        "g": torch.randn(N, T, HV, K),
        "beta": torch.randn(N, T, HV),
        "A_log": torch.rand(HV),
        "dt_bias": torch.randn(HV * K) * 0.5,
        "use_gate_in_kernel": True,
        "lower_bound": -5.0,
        "use_qk_l2norm_in_kernel": True,
        "use_beta_sigmoid_in_kernel": True,
        "initial_state": torch.randn(slots, HV, K, V) * 0.5,
        "ssm_state_indices": order,
        "inplace_final_state": True,
    }


def copy_of(call: dict[str, Any]) -> dict[str, Any]:
    return {n: (a.clone() if isinstance(a, torch.Tensor) else a) for n, a in call.items()}


def test_one_op_writes_the_pool_and_out_as_eager_does():
    call = decode_step()
    eager = copy_of(call)
    o_eager, pool_eager = kda.fused_recurrent_kda(**eager)
    recorder = GraphRecorder()
    compiled = torch.compile(lambda c: kda.fused_recurrent_kda(**c), fullgraph=True, backend=recorder.backend)
    out = torch.full_like(call["v"], float("nan"))
    with kda.trace_routes() as routes, torch.no_grad():
        o, pool = compiled({**call, "out": out})
    assert o is out and pool is call["initial_state"]  # the caller's own buffers, written in place
    assert torch.equal(o, o_eager) and torch.equal(pool, pool_eager)
    assert (o[1] == 0).all()  # the padding row
    assert kda_ops(recorder.forward[0]) == ["kda.fused_recurrent_kda.default"]
    assert [(r.backend, r.phase) for r in routes] == [("torch", "forward")]


def test_a_new_final_state_without_a_pool_and_dynamic_shapes():
    call = decode_step(T=3)
    for name in ("ssm_state_indices", "inplace_final_state"):
        del call[name]
    call["initial_state"] = torch.randn(3, 2, 16, 12) * 0.5
    call["output_final_state"] = True
    o_eager, state_eager = kda.fused_recurrent_kda(**copy_of(call))
    compiled = torch.compile(lambda c: kda.fused_recurrent_kda(**c), fullgraph=True, backend="eager", dynamic=True)
    o, state = compiled(call)
    assert torch.equal(o, o_eager) and torch.equal(state, state_eager)
    bigger = decode_step(N=5, T=3)
    for name in ("ssm_state_indices", "inplace_final_state"):
        del bigger[name]
    bigger.update(initial_state=torch.randn(5, 2, 16, 12), output_final_state=True)
    o, state = compiled(bigger)
    assert o.shape == (5, 3, 2, 12) and state.shape == (5, 2, 16, 12)
    assert torch.equal(state, kda.fused_recurrent_kda(**copy_of(bigger))[1])


@pytest.mark.parametrize(
    ("change", "argument"),
    [
        ({"lower_bound": 1.0}, "lower_bound"),  # a rule of the contract: a growing state
        ({"output_final_state": 1}, "output_final_state"),  # a value the schema cannot take
        ({"backend": None}, "backend"),
    ],
)
def test_bad_call_raises_kda_input_error_when_it_runs(change, argument):
    call = {**decode_step(), **change}
    compiled = torch.compile(lambda c: kda.fused_recurrent_kda(**c), fullgraph=True, backend="eager")
    pool = call["initial_state"].clone()
    with (
        kda.trace_routes() as routes,
        pytest.warns(RuntimeWarning, match="raises KDAInputError"),
        pytest.raises(kda.KDAInputError) as error,
    ):
        compiled(call)
    assert error.value.argument == argument and routes == []
    assert torch.equal(call["initial_state"], pool)  # nothing ran


def test_a_call_needing_gradients_is_refused_as_eagerly():
    call = decode_step()
    call["q"].requires_grad_(True)
    compiled = torch.compile(lambda c: kda.fused_recurrent_kda(**c), fullgraph=True, backend="eager")
    with (
        pytest.warns(RuntimeWarning, match="forward-only"),
        pytest.raises(kda.KDAInputError, match="forward-only") as error,
    ):
        compiled(call)
    assert error.value.argument == "q"


def test_eager_calls_never_reach_the_op(monkeypatch):
    def fail(*args, **kwargs):
        raise AssertionError("the eager path went through the custom op")

    monkeypatch.setattr(recurrent_library, "fused_recurrent_kda_call", fail)
    o, _ = kda.fused_recurrent_kda(**decode_step())
    assert torch.isfinite(o).all()


class PrefillThenDecode(torch.nn.Module):
    """A layer that prefills with `chunk_kda` (differentiable) and then decodes one token from the prompt's
    final state with `fused_recurrent_kda` (forward only: the state is detached, as a cache is)."""

    def __init__(self, K: int = 16, V: int = 16):
        super().__init__()
        self.q = torch.nn.Linear(8, K, bias=False)
        self.k = torch.nn.Linear(8, K, bias=False)
        self.v = torch.nn.Linear(8, V, bias=False)

    def forward(self, prompt: torch.Tensor, token: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        def heads(x: torch.Tensor) -> tuple[torch.Tensor, ...]:
            q, k = F.normalize(self.q(x), dim=-1), F.normalize(self.k(x), dim=-1)
            g = -0.1 * torch.sigmoid(self.q(x))
            beta = torch.sigmoid(x[..., :1])
            return q.unsqueeze(2), k.unsqueeze(2), self.v(x).unsqueeze(2), g.unsqueeze(2), beta

        o, state = kda.chunk_kda(*heads(prompt), output_final_state=True, chunk_size=32)
        q, k, v, g, beta = (t.detach() for t in heads(token))
        o_next, _ = kda.fused_recurrent_kda(q, k, v, g, beta, initial_state=state.detach())
        return o, o_next


def test_a_model_calling_both_ops_forward_and_backward(seed):
    model = PrefillThenDecode()
    prompt, token = torch.randn(1, 70, 8), torch.randn(1, 1, 8)
    o_eager, next_eager = model(prompt, token)
    o_eager.square().sum().backward()
    eager_grads = [p.grad.clone() for p in model.parameters()]
    model.zero_grad()
    recorder = GraphRecorder()
    compiled = torch.compile(model, fullgraph=True, backend=recorder.backend)
    with kda.trace_routes() as routes:
        o, o_next = compiled(prompt, token)
        o.square().sum().backward()
    assert torch.equal(o, o_eager) and torch.equal(o_next, next_eager)
    for grad, expected in zip((p.grad for p in model.parameters()), eager_grads):
        assert torch.equal(grad, expected)
    assert kda_ops(recorder.forward[0]) == ["kda.chunk_kda.default", "kda.fused_recurrent_kda.default"]
    assert kda_ops(recorder.backward[0]) == ["kda.chunk_kda_backward.default"]
    assert {(r.backend, r.phase) for r in routes} == {("torch", "forward"), ("torch", "backward")}


@pytest.mark.gpu
@pytest.mark.parametrize("backend", ["triton", "auto"])
def test_compiled_decode_step_with_cuda_graphs_on_the_gpu(backend):
    """A serving step compiled as serving engines compile it (inductor, `mode="reduce-overhead"`: CUDA graphs
    where inductor allows them) on the GPU, a bf16 pool updated in place over several steps: every step's o and
    pool equal eager kda's bit for bit, and the backend asked for is the one that ran."""
    call = {n: (t.cuda() if isinstance(t, torch.Tensor) else t) for n, t in decode_step(N=4, K=128, V=128).items()}
    call["initial_state"] = call["initial_state"].to(torch.bfloat16)
    call["q"], call["k"], call["v"] = (call[n].to(torch.bfloat16) for n in ("q", "k", "v"))
    eager_pool = call["initial_state"].clone()

    def step(c: dict[str, Any]) -> torch.Tensor:
        return kda.fused_recurrent_kda(**c, backend=backend)[0]

    compiled = torch.compile(step, fullgraph=True, mode="reduce-overhead")
    with torch.no_grad(), kda.trace_routes() as routes:
        for _ in range(4):  # the first calls record, the later ones replay the graph
            for name in ("q", "k", "v", "g", "beta"):
                call[name].copy_(torch.randn_like(call[name], dtype=torch.float32).to(call[name].dtype))
            o = compiled(call).clone()
            expected = kda.fused_recurrent_kda(**{**call, "initial_state": eager_pool}, backend=backend)[0]
            assert torch.equal(o, expected) and torch.equal(call["initial_state"], eager_pool)
    assert {r.backend for r in routes} == {"triton"}
