"""kda as a drop-in under FLA 0.6's own layer, `fla.layers.kda.KimiDeltaAttention`, on a CPU.

The layer calls ``chunk_kda`` (training, and prefill longer than 64 tokens) and ``fused_recurrent_kda``
(inference on up to 64 tokens: decode) through the names `fla.layers.kda` imported from `fla.ops.kda`;
the swap replaces those two names. It computes no gate of its own: it passes the raw gate input with
``A_log [HV]`` and ``dt_bias [HV*K]`` (fp32 parameters) and ``use_gate_in_kernel=True``, raw beta logits
with ``use_beta_sigmoid_in_kernel=True``, ``use_qk_l2norm_in_kernel=True``, ``state_v_first=True``,
``lower_bound`` with or without ``safe_gate`` (``fused_recurrent_kda`` gets ``lower_bound`` only), and
``cu_seqlens`` when an attention mask pads the batch (docs/design.md, "Real callers").

The reference is FLA's own PyTorch code for the same call: its gates (`naive_kda_gate`,
`naive_kda_lowerbound_gate`), its token-by-token recurrence (`naive_recurrent_kda`), beta's sigmoid and
q/k's L2 norm as FLA's kernels define them, per sequence for varlen. FLA's Triton kernels cannot be the
reference here: its ``chunk_kda`` fails in Triton's interpreter (docs/design.md, "Real callers"). The
layer's other Triton kernels (`ShortConvolution`, `FusedRMSNormGated`) run in the interpreter, with every
FLA autotuner pinned to one configuration (the interpreter cannot benchmark candidates); they run
identically in both runs, so the comparison sees kda's error alone, bounded by the fp32 policy (1e-3).
"""

from __future__ import annotations

import math
import sys

import pytest
import torch

import kda
from kda.verify.check import relative_error
from kda.verify.policy import tolerance

pytest.importorskip("einops", reason="einops is not installed (extra `test`)")
pytest.importorskip("triton", reason="Triton is not installed (FLA's layer is built on Triton kernels)")
fla_layer = pytest.importorskip("fla.layers.kda", reason="flash-linear-attention is not installed (extra `test`)")
fla_gate = pytest.importorskip("fla.ops.kda.gate")
fla_naive = pytest.importorskip("fla.ops.kda.naive")
fla_cache = pytest.importorskip("fla.models.cache_utils")

HIDDEN, HEAD_DIM, HEADS, V_HEADS = 32, 16, 2, 4  # grouped value attention, as FLA's layer supports

GATES = {
    # FLA's KDAConfig default: the softplus gate.
    "softplus": dict(safe_gate=False, lower_bound=None),
    # The bounded sigmoid gate with safe_gate's promise.
    "safe": dict(safe_gate=True, lower_bound=-5.0),
    # What the layer passes with lower_bound alone (and what fused_recurrent_kda always gets).
    "bounded": dict(safe_gate=False, lower_bound=-5.0),
}


@pytest.fixture
def layer_on_cpu(monkeypatch):
    """FLA's Triton kernels in Triton's interpreter (conftest.py switched it on before Triton loaded), each
    FLA autotuner pinned to its largest tile (fewest programs for the interpreter to run; tiling never
    changes FLA's math), and kda on its torch backend."""
    if torch.cuda.is_available():
        pytest.skip("these interpreter cases are for the CPU")
    from triton.runtime.autotuner import Autotuner
    from triton.runtime.interpreter import InterpretedFunction

    monkeypatch.setenv("TRITON_INTERPRET", "1")
    kernels = []
    for name, module in list(sys.modules.items()):
        if not name.startswith("fla.") or module is None:
            continue
        for value in list(vars(module).values()):
            for _ in range(4):  # Heuristics(Autotuner(JITFunction)): follow .fn
                if isinstance(value, Autotuner) and len(value.configs) > 1:
                    monkeypatch.setattr(value, "configs", [max(value.configs, key=tile_size)])
                if isinstance(value, InterpretedFunction):
                    kernels.append(value)
                value = getattr(value, "fn", None)
                if value is None:
                    break
    if not kernels:
        pytest.skip("FLA's kernels were loaded compiled (TRITON_INTERPRET was off when Triton was imported)")
    with kda.use_backends("torch"):
        yield


def tile_size(config) -> int:
    return math.prod(v for v in config.kwargs.values() if isinstance(v, int))


def fla_l2norm(x: torch.Tensor) -> torch.Tensor:
    """FLA's qk L2 norm in kernel: ``x / sqrt(sum(x^2) + 1e-6)`` in fp32."""
    x32 = x.float()
    return (x32 * torch.rsqrt((x32 * x32).sum(-1, keepdim=True) + 1e-6)).to(x.dtype)


def fla_torch_kda(
    q,
    k,
    v,
    g,
    beta,
    A_log=None,
    dt_bias=None,
    scale=None,
    initial_state=None,
    output_final_state=False,
    use_qk_l2norm_in_kernel=False,
    use_gate_in_kernel=False,
    use_beta_sigmoid_in_kernel=False,
    allow_neg_eigval=False,
    safe_gate=False,
    lower_bound=None,
    state_v_first=False,
    cu_seqlens=None,
    **kwargs,
):
    """FLA's own PyTorch reference for the call the layer makes (either op: they compute the same)."""
    assert not kwargs, kwargs
    if use_gate_in_kernel:
        if lower_bound is not None:
            g = fla_gate.naive_kda_lowerbound_gate(g, A_log, dt_bias, lower_bound)
        else:
            g = fla_gate.naive_kda_gate(g, A_log, dt_bias)
    if use_qk_l2norm_in_kernel:
        q, k = fla_l2norm(q), fla_l2norm(k)
    if use_beta_sigmoid_in_kernel:
        beta = beta.float().sigmoid() * (2.0 if allow_neg_eigval else 1.0)
    if initial_state is not None and state_v_first:
        initial_state = initial_state.transpose(-1, -2)
    bounds = [(0, q.shape[1])] if cu_seqlens is None else list(zip(cu_seqlens[:-1].tolist(), cu_seqlens[1:].tolist()))
    outputs, states = [], []
    for n, (bos, eos) in enumerate(bounds):
        sl = slice(bos, eos)
        h0 = None if initial_state is None else initial_state[n : n + 1] if cu_seqlens is not None else initial_state
        o, s = fla_naive.naive_recurrent_kda(
            q[:, sl], k[:, sl], v[:, sl], g[:, sl], beta[:, sl], scale, h0, output_final_state
        )
        outputs.append(o)
        states.append(s)
    o = torch.cat(outputs, dim=1)
    state = torch.cat(states) if output_final_state else None
    if state is not None and state_v_first:
        state = state.transpose(-1, -2).contiguous()
    return o, state


def use_reference(monkeypatch) -> None:
    monkeypatch.setattr(fla_layer, "chunk_kda", fla_torch_kda)
    monkeypatch.setattr(fla_layer, "fused_recurrent_kda", fla_torch_kda)


def use_kda(monkeypatch) -> None:
    """The swap as a user writes it (README, "Under FLA's layers")."""
    monkeypatch.setattr(fla_layer, "chunk_kda", kda.chunk_kda)
    if hasattr(kda, "fused_recurrent_kda"):
        monkeypatch.setattr(fla_layer, "fused_recurrent_kda", kda.fused_recurrent_kda)


def op_of(route: kda.Route) -> str:
    """Which op a route ran (the decode op's case classes are named ``recurrent/...``)."""
    return "fused_recurrent" if route.case_class.startswith("recurrent/") else "chunk"


def make_layer(gate: str, allow_neg_eigval: bool = False) -> torch.nn.Module:
    layer = fla_layer.KimiDeltaAttention(
        hidden_size=HIDDEN,
        head_dim=HEAD_DIM,
        num_heads=HEADS,
        num_v_heads=V_HEADS,
        allow_neg_eigval=allow_neg_eigval,
        layer_idx=0,
        **GATES[gate],
    )
    with torch.no_grad():
        # Gate inputs that vary from token to token, decays from mild to strong (FLA's init keeps them tiny).
        layer.f_proj[1].weight.mul_(20.0)
        layer.A_log.uniform_(-1.0, 1.5)
    return layer


def gate_params(*names: str):
    return list(names)


def run_training_step(layer, x, mask):
    layer.zero_grad(set_to_none=True)
    x = x.clone().requires_grad_()
    o, _, _ = layer(x, attention_mask=mask)
    weights = torch.randn(o.shape, generator=torch.Generator().manual_seed(7))
    (o * weights).sum().backward()
    grads = {"x": x.grad, **{n: p.grad.clone() for n, p in layer.named_parameters()}}
    return o.detach(), grads


TRAINING_CASES = [  # varlen with the bounded gates only: the padding path does not depend on the gate
    pytest.param(gate, padded, id=f"{'varlen' if padded else 'dense'}-{gate}")
    for gate, padded in (("softplus", False), ("safe", False), ("bounded", False), ("safe", True), ("bounded", True))
]


@pytest.mark.parametrize(("gate", "padded"), TRAINING_CASES)
def test_training_forward_and_backward_match_flas_torch_reference(seed, layer_on_cpu, monkeypatch, gate, padded):
    """Training mode (``chunk_kda``): output and every gradient (input, A_log, dt_bias, the projections and
    convolutions). With a padding mask the layer unpads the batch and passes ``cu_seqlens``."""
    layer = make_layer(gate, allow_neg_eigval=padded).train()
    x = torch.randn(2, 75, HIDDEN)  # 75 > 64: two chunks, the second ragged
    mask = None
    if padded:
        mask = torch.ones(2, 75, dtype=torch.long)
        mask[1, :30] = 0  # left padding: sequences of 75 and 45 tokens

    use_reference(monkeypatch)
    o_ref, grads_ref = run_training_step(layer, x, mask)

    use_kda(monkeypatch)
    with kda.trace_routes() as routes:
        o, grads = run_training_step(layer, x, mask)

    assert [(r.backend, r.phase) for r in routes] == [("torch", "forward"), ("torch", "backward")]
    assert ("varlen" in routes[0].case_class) == padded
    tol = tolerance("o", "float32")
    assert relative_error(o, o_ref.double()) <= tol
    assert grads.keys() == grads_ref.keys()
    errors = {name: relative_error(grads[name], grads_ref[name].double()) for name in grads_ref}
    worst = max(errors, key=errors.__getitem__)
    assert errors[worst] <= tolerance("dq", "float32"), f"{worst}: {errors[worst]:.3g}"
    assert grads["A_log"].abs().sum() > 0 and grads["dt_bias"].abs().sum() > 0


@pytest.mark.parametrize("gate", gate_params("softplus", "safe", "bounded"))
def test_prefill_then_decode_with_cache_matches_flas_torch_reference(seed, layer_on_cpu, monkeypatch, gate):
    """Inference with FLA's cache: a 70-token prefill (``chunk_kda``, state V-first), then four one-token
    steps (``fused_recurrent_kda`` with ``lower_bound`` alone, from the cached state)."""
    layer = make_layer(gate).eval()
    x = torch.randn(2, 74, HIDDEN)

    def generate() -> list[torch.Tensor]:
        cache = fla_cache.Cache()
        outputs = []
        with torch.no_grad():
            o, _, cache = layer(x[:, :70], past_key_values=cache, use_cache=True)
            outputs.append(o)
            for t in range(70, 74):
                o, _, cache = layer(x[:, t : t + 1], past_key_values=cache, use_cache=True)
                outputs.append(o)
        return outputs

    use_reference(monkeypatch)
    expected = generate()
    use_kda(monkeypatch)
    with kda.trace_routes() as routes:
        got = generate()

    assert [op_of(r) for r in routes] == ["chunk"] + ["fused_recurrent"] * 4
    assert {r.backend for r in routes} == {"torch"}
    for step, (a, b) in enumerate(zip(got, expected)):
        assert relative_error(a, b.double()) <= tolerance("o", "float32"), f"step {step}"


def use_kda_checked(monkeypatch, errors: list[tuple[str, str, float]]) -> None:
    """The swap, with every call also run through FLA's reference on the same arguments in fp32: each
    op's output and final state against it, on exactly the inputs the layer passed."""

    def checked(name, fn):
        def call(**kwargs):
            o, state = fn(**kwargs)
            upcast = {k: v.float() if torch.is_tensor(v) and v.is_floating_point() else v for k, v in kwargs.items()}
            o_ref, state_ref = fla_torch_kda(**upcast)
            errors.append((name, "o", relative_error(o, o_ref.double())))
            if state_ref is not None:
                errors.append((name, "final_state", relative_error(state, state_ref.double())))
            assert o.dtype == kwargs["q"].dtype
            return o, state

        return call

    monkeypatch.setattr(fla_layer, "chunk_kda", checked("chunk", kda.chunk_kda))
    monkeypatch.setattr(fla_layer, "fused_recurrent_kda", checked("fused_recurrent", kda.fused_recurrent_kda))


@pytest.mark.parametrize("gate", ["softplus", "bounded"])
def test_bf16_layer_prefill_then_decode_matches_flas_torch_reference(seed, layer_on_cpu, monkeypatch, gate):
    """The layer cast to bf16 as a whole (``layer.to(torch.bfloat16)``, as inference code does): q, k, v,
    the gate input and beta logits in bf16, and A_log and dt_bias bf16 too. Prefill of 70 tokens
    (``chunk_kda``), then two decode steps (``fused_recurrent_kda``) from FLA's cache. Each kda call is
    checked against FLA's reference on the arguments the layer passed it, at the bf16 policy (the
    layer's output is not compared: its bf16 norm and projection after KDA round differences in the
    last bit of KDA's output into errors of their own, 4e-3 to 5e-3 measured, that are not kda's)."""
    layer = make_layer(gate).to(torch.bfloat16).eval()
    assert layer.A_log.dtype == layer.dt_bias.dtype == torch.bfloat16
    x = torch.randn(2, 72, HIDDEN, dtype=torch.bfloat16)
    errors: list[tuple[str, str, float]] = []
    use_kda_checked(monkeypatch, errors)

    cache = fla_cache.Cache()
    with torch.no_grad(), kda.trace_routes() as routes:
        o, _, cache = layer(x[:, :70], past_key_values=cache, use_cache=True)
        outputs = [o]
        for t in (70, 71):
            o, _, cache = layer(x[:, t : t + 1], past_key_values=cache, use_cache=True)
            outputs.append(o)

    assert [op_of(r) for r in routes] == ["chunk", "fused_recurrent", "fused_recurrent"]
    assert [(op, tensor) for op, tensor, _ in errors] == [("chunk", "o"), ("chunk", "final_state")] + [
        ("fused_recurrent", "o"),
        ("fused_recurrent", "final_state"),
    ] * 2
    for op, tensor, error in errors:
        assert error <= tolerance(tensor, "bfloat16"), f"{op} {tensor}: {error:.3g}"
    assert all(o.dtype == torch.bfloat16 and torch.isfinite(o).all() for o in outputs)


@pytest.fixture
def triton_interpreted(layer_on_cpu, monkeypatch):
    """kda's triton backend in the interpreter: its kernel modules imported afresh with
    TRITON_INTERPRET=1 (the old ones come back after the test), kda's own verification off (this test
    is the check: every call is compared with FLA's reference)."""
    for name in [n for n in sys.modules if n.startswith("kda.backends.triton.")]:
        monkeypatch.delitem(sys.modules, name)
    monkeypatch.setenv("KDA_VERIFY", "off")
    kda.registry._reset_for_tests()
    with kda.use_backends("triton"):
        yield


@pytest.mark.slow
@pytest.mark.filterwarnings("ignore:KDA_VERIFY=off")  # the dispatcher says so, once
def test_layer_through_kdas_triton_backend_matches_flas_torch_reference(seed, triton_interpreted, monkeypatch):
    """kda's triton kernels under the layer (safe gate, GVA, V-first state, varlen from a padding mask):
    a training step's output and gradients, then a cached prefill and decode step, each kda call checked
    against FLA's reference on the arguments the layer passed."""
    from triton.runtime.interpreter import InterpretedFunction

    from kda.backends.triton import forward

    assert isinstance(forward.output_kernel, InterpretedFunction)
    layer = make_layer("safe").train()
    x = torch.randn(2, 70, HIDDEN)
    mask = torch.ones(2, 70, dtype=torch.long)
    mask[0, :25] = 0

    use_reference(monkeypatch)
    o_ref, grads_ref = run_training_step(layer, x, mask)
    use_kda(monkeypatch)
    with kda.trace_routes() as routes:
        o, grads = run_training_step(layer, x, mask)
    assert [(r.backend, r.phase) for r in routes] == [("triton", "forward"), ("triton", "backward")]
    assert relative_error(o, o_ref.double()) <= tolerance("o", "float32")
    errors = {name: relative_error(grads[name], grads_ref[name].double()) for name in grads_ref}
    worst = max(errors, key=errors.__getitem__)
    assert errors[worst] <= tolerance("dq", "float32"), f"{worst}: {errors[worst]:.3g}"

    layer.eval()
    checked: list[tuple[str, str, float]] = []
    use_kda_checked(monkeypatch, checked)
    cache = fla_cache.Cache()
    with torch.no_grad(), kda.trace_routes() as routes:
        layer(x[:, :66], past_key_values=cache, use_cache=True)
        layer(x[:, 66:67], past_key_values=cache, use_cache=True)
    assert [(op_of(r), r.backend) for r in routes] == [("chunk", "triton"), ("fused_recurrent", "triton")]
    assert len(checked) == 4
    for op, tensor, error in checked:
        assert error <= tolerance(tensor, "float32"), f"{op} {tensor}: {error:.3g}"
