"""kda as a drop-in under transformers' Kimi-Linear: the model run with kda in place of FLA's KDA functions
must give what the model gives through its own PyTorch path.

transformers 5.24's `modeling_kimi_linear` resolves ``fla.ops.kda.chunk_kda`` and ``fused_recurrent_kda``
once, when the module is imported, into two module-level names that `KimiLinearDeltaAttention.forward`
looks up on every call: ``chunk_kimi_delta_attention`` (prefill and training) and
``recurrent_kimi_delta_attention`` (one-token decode with a cache). Without FLA both are the module's
own PyTorch functions. A user swaps kda in by assigning kda's functions to those two names (README,
"Under transformers"); the reference here is the PyTorch function behind each name (`inspect.unwrap`),
whether FLA is installed or not.

What the model passes (docs/design.md, "Real callers"): q, k, v ``[B, T, H, K]`` in the model's dtype,
the log decay ``g`` already computed (fp32), ``beta`` after its sigmoid (model dtype), the cache's fp32
state ``[B, H, K, V]`` as ``initial_state``, ``output_final_state=True`` whenever a cache exists (a
plain forward too), and ``use_qk_l2norm_in_kernel=True``.

Tolerances: everything outside KDA is the same torch code on the same weights in both runs, so what the
comparison sees is kda's error against the model's fp32 PyTorch KDA, carried through the layers. The
policy's figure for the dtype of q (kda.verify.policy) bounds it: 1e-3 in fp32, 8e-3 for bf16 outputs.
Greedy tokens must be identical (the tiny model's logits are far apart next to those errors).
"""

from __future__ import annotations

import inspect

import pytest
import torch

import kda
from kda.verify.check import relative_error
from kda.verify.policy import tolerance

transformers = pytest.importorskip("transformers", reason="transformers is not installed (extra `test`)")
modeling = pytest.importorskip(
    "transformers.models.kimi_linear.modeling_kimi_linear", reason="this transformers has no Kimi-Linear (>= 5.x)"
)

# The model's own PyTorch functions, behind the names the modeling module may have bound to FLA's.
TORCH_CHUNK = inspect.unwrap(modeling.chunk_kimi_delta_attention)
TORCH_RECURRENT = inspect.unwrap(modeling.recurrent_kimi_delta_attention)

VOCAB = 96
PROMPT = 70  # two chunks of 64 for the prefill, the second ragged
NEW_TOKENS = 10


def tiny_config() -> transformers.KimiLinearConfig:
    """Three layers: KDA, MLA full attention (the cache then holds both kinds), KDA; a dense MLP and a
    small mixture of experts; two KDA heads of 16 (K = V = 16). No download."""
    return transformers.KimiLinearConfig(
        vocab_size=VOCAB,
        hidden_size=64,
        intermediate_size=96,
        moe_intermediate_size=32,
        num_hidden_layers=3,
        layer_types=["linear_attention", "full_attention", "linear_attention"],
        mlp_layer_types=["dense", "sparse", "dense"],
        num_attention_heads=2,
        num_key_value_heads=2,
        kv_lora_rank=16,
        q_lora_rank=None,
        qk_rope_head_dim=8,
        qk_nope_head_dim=16,
        v_head_dim=16,
        num_experts=4,
        num_experts_per_token=2,
        num_shared_experts=1,
        linear_head_dim=16,
        linear_num_heads=2,
        pad_token_id=0,
        bos_token_id=1,
        eos_token_id=2,
    )


def tiny_model(dtype: torch.dtype) -> torch.nn.Module:
    """Random weights (the test's seed), with gate projections scaled so that the log decay varies from
    token to token (as a trained model's does) rather than sitting at its initial near-constant value."""
    model = transformers.KimiLinearForCausalLM(tiny_config())
    with torch.no_grad():
        for attn in kda_layers(model):
            attn.forget_gate.f_b_proj.weight.mul_(30.0)
            attn.forget_gate.A_log.uniform_(-1.0, 1.5)
    return model.to(dtype).eval()


def kda_layers(model: torch.nn.Module) -> list[torch.nn.Module]:
    return [m for m in model.modules() if isinstance(m, modeling.KimiLinearDeltaAttention)]


def use_torch_path(monkeypatch) -> None:
    monkeypatch.setattr(modeling, "chunk_kimi_delta_attention", TORCH_CHUNK)
    monkeypatch.setattr(modeling, "recurrent_kimi_delta_attention", TORCH_RECURRENT)


def use_kda(monkeypatch) -> None:
    """The swap as a user writes it (README, "Under transformers")."""
    monkeypatch.setattr(modeling, "chunk_kimi_delta_attention", kda.chunk_kda)
    if hasattr(kda, "fused_recurrent_kda"):
        monkeypatch.setattr(modeling, "recurrent_kimi_delta_attention", kda.fused_recurrent_kda)


def op_of(route: kda.Route) -> str:
    """Which op a route ran: ``Route.op`` where kda records it, else read from the case class."""
    op = getattr(route, "op", None)
    if op is not None:
        return str(op)
    return "fused_recurrent" if "recurrent" in route.case_class else "chunk"


def ran(routes: list[kda.Route]) -> set[tuple[str, str, str]]:
    return {(op_of(r), r.backend, r.phase) for r in routes}


def prompt_ids(batch: int, length: int) -> torch.Tensor:
    return torch.randint(3, VOCAB, (batch, length))  # never pad, bos or eos


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_forward_logits_match_the_models_torch_path(seed, monkeypatch, dtype):
    model = tiny_model(dtype)
    assert len(kda_layers(model)) == 2
    ids = prompt_ids(2, PROMPT)

    use_torch_path(monkeypatch)
    with torch.no_grad():
        expected = model(ids).logits.float()

    use_kda(monkeypatch)
    with torch.no_grad(), kda.trace_routes() as routes:
        got = model(ids).logits.float()

    assert ran(routes) == {("chunk", "torch", "forward")}
    assert len(routes) == 2  # one call per KDA layer
    assert torch.isfinite(got).all()
    dtype_name = str(dtype).removeprefix("torch.")
    assert relative_error(got, expected.double()) <= tolerance("o", dtype_name)


def test_backward_gradients_match_the_models_torch_path(seed, monkeypatch):
    model = tiny_model(torch.float32).train()
    ids = prompt_ids(2, PROMPT)

    def gradients() -> dict[str, torch.Tensor]:
        model.zero_grad(set_to_none=True)
        loss = model(ids, labels=ids).loss
        loss.backward()
        return {n: p.grad.detach().clone() for n, p in model.named_parameters() if p.grad is not None}

    use_torch_path(monkeypatch)
    expected = gradients()

    use_kda(monkeypatch)
    with kda.trace_routes() as routes:
        got = gradients()

    assert ran(routes) == {("chunk", "torch", "forward"), ("chunk", "torch", "backward")}
    assert got.keys() == expected.keys()
    # The KDA layers' parameters get their gradients through kda's backward (the gate's, A_log and
    # dt_bias, through its dg).
    for layer in (0, 2):
        for name in ("q_proj.weight", "conv1d.weight", "b_proj.weight", "forget_gate.A_log", "forget_gate.dt_bias"):
            assert got[f"model.layers.{layer}.self_attn.{name}"].abs().sum() > 0
    tol = tolerance("dq", "float32")
    errors = {name: relative_error(got[name], expected[name].double()) for name in expected}
    worst = max(errors, key=errors.__getitem__)
    assert errors[worst] <= tol, f"{worst}: {errors[worst]:.3g} > {tol:g}"


def test_generate_greedy_with_cache_matches_the_models_torch_path(seed, monkeypatch):
    """Prefill (70 tokens) through chunk_kda, then one-token decode steps through fused_recurrent_kda
    from the cache's fp32 state; the same greedy tokens as the model's torch path."""
    model = tiny_model(torch.float32)
    ids = prompt_ids(2, PROMPT)
    settings = dict(max_new_tokens=NEW_TOKENS, min_new_tokens=NEW_TOKENS, do_sample=False, use_cache=True)

    use_torch_path(monkeypatch)
    with torch.no_grad():
        expected = model.generate(ids, **settings, output_logits=True, return_dict_in_generate=True)

    use_kda(monkeypatch)
    with torch.no_grad(), kda.trace_routes() as routes:
        got = model.generate(ids, **settings, output_logits=True, return_dict_in_generate=True)

    assert ran(routes) == {("chunk", "torch", "forward"), ("fused_recurrent", "torch", "forward")}
    decode_steps = [r for r in routes if op_of(r) == "fused_recurrent"]
    assert len(decode_steps) == 2 * (NEW_TOKENS - 1)  # two KDA layers, every step after the prefill
    assert got.sequences.shape == (2, PROMPT + NEW_TOKENS)
    assert torch.equal(got.sequences, expected.sequences)
    tol = tolerance("o", "float32")
    for step, (a, b) in enumerate(zip(got.logits, expected.logits)):
        assert relative_error(a, b.double()) <= tol, f"step {step}"


def test_bf16_generate_each_call_matches_the_models_torch_function(seed, monkeypatch):
    """The model in bf16 (q, k, v and beta bf16, g fp32, the cache's state fp32): every kda call of a
    greedy `generate` is checked against the model's own PyTorch function run in fp32 on the same
    arguments, at the bf16 policy. (Whole-model logits in bf16 are compared in the forward test; here
    the decode path's dtype mix is what is checked, call by call.)"""
    model = tiny_model(torch.bfloat16)
    ids = prompt_ids(2, PROMPT)
    errors: list[tuple[str, str, float]] = []
    dtypes: set[tuple[str, ...]] = set()

    def checked(op, fn, reference):
        def call(query, key, value, **kwargs):
            o, state = fn(query, key, value, **kwargs)
            args = [t.float() for t in (query, key, value)]
            upcast = {k: v.float() if torch.is_tensor(v) else v for k, v in kwargs.items()}
            o_ref, state_ref = reference(*args, **upcast)
            dtypes.add((op, *(str(t.dtype) for t in (query, kwargs["g"], kwargs["beta"]))))
            assert o.dtype == query.dtype and state.dtype == torch.float32
            errors.append((op, "o", relative_error(o, o_ref.double())))
            errors.append((op, "final_state", relative_error(state, state_ref.double())))
            return o, state

        return call

    monkeypatch.setattr(modeling, "chunk_kimi_delta_attention", checked("chunk", kda.chunk_kda, TORCH_CHUNK))
    monkeypatch.setattr(
        modeling,
        "recurrent_kimi_delta_attention",
        checked("fused_recurrent", kda.fused_recurrent_kda, TORCH_RECURRENT),
    )
    with torch.no_grad():
        out = model.generate(ids, max_new_tokens=4, min_new_tokens=4, do_sample=False, use_cache=True)

    assert out.shape == (2, PROMPT + 4)
    assert dtypes == {
        ("chunk", "torch.bfloat16", "torch.float32", "torch.bfloat16"),
        ("fused_recurrent", "torch.bfloat16", "torch.float32", "torch.bfloat16"),
    }
    assert len(errors) == 2 * 2 * 4  # two KDA layers, o and state, one prefill and three decode steps
    for op, tensor, error in errors:
        assert error <= tolerance(tensor, "bfloat16"), f"{op} {tensor}: {error:.3g}"
