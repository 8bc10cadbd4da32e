"""Serving with a state pool: prefill, continuous batching with padding rows, and speculative decoding.

python examples/serving_decode.py

A serving engine keeps every live request's KDA state in one pool tensor and gives each request a slot.
Each decode step runs `kda.fused_recurrent_kda` on a fixed-size batch (the size a CUDA graph was captured
for): real rows name their slot, padding rows slot -1 (their output is zero and no state is touched).
Speculative decoding runs several draft tokens at once, keeps each token's state in a slot of its own,
and continues the next step from the state of the last accepted token (``num_accepted_tokens``).
"""

import torch

import kda

torch.manual_seed(0)
H, K, V = 2, 32, 32  # heads (q/k and value), head dims
SLOTS, BATCH = 12, 4  # pool slots; the decode batch size (padded)
pool = torch.full((SLOTS, H, K, V), float("nan"), dtype=torch.bfloat16)  # free slots hold garbage (NaN here)
A_log, dt_bias = torch.rand(H), torch.randn(H * K) * 0.5
gate = dict(A_log=A_log, dt_bias=dt_bias, use_gate_in_kernel=True, lower_bound=-5.0)
# chunk_kda (the prefill) takes the same bounded sigmoid gate with safe_gate=True (-5 <= lower_bound < 0).
prefill_gate = dict(gate, safe_gate=True)
flags = dict(use_qk_l2norm_in_kernel=True, use_beta_sigmoid_in_kernel=True)


def token_inputs(n: int, T: int = 1) -> dict:
    """Random projections for `n` sequences of `T` tokens (what a model's linear layers would give)."""
    return dict(
        q=torch.randn(n, T, H, K),
        k=torch.randn(n, T, H, K),
        v=torch.randn(n, T, H, V),
        g=torch.randn(n, T, H, K),
        beta=torch.randn(n, T, H),
    )


history: dict[int, list[dict]] = {}  # request -> its inputs so far (to check against chunk_kda at the end)


def prefill(request: int, slot: int, length: int) -> None:
    """Run the prompt with chunk_kda and store the request's state in its slot."""
    x = token_inputs(1, length)
    _, state = kda.chunk_kda(**x, **flags, **prefill_gate, output_final_state=True)
    pool[slot] = state[0].to(pool.dtype)
    history[request] = [x]


# Three requests arrive; each gets a free slot.
slot_of = {0: 7, 1: 2, 2: 10}
for request, slot in slot_of.items():
    prefill(request, slot, length=5 + 3 * request)

routes_seen = set()
for step in range(6):
    if step == 3:  # request 1 finishes; request 3 arrives and takes its slot
        del slot_of[1]
        slot_of[3] = 2
        prefill(3, 2, length=4)
    live = list(slot_of.items())
    rows = live + [(None, -1)] * (BATCH - len(live))  # padding rows up to the captured batch size
    slots = torch.tensor([slot for _, slot in rows], dtype=torch.int32)
    x = token_inputs(BATCH)
    before = pool.clone()
    with kda.trace_routes() as routes:
        o, returned = kda.fused_recurrent_kda(
            **x, **gate, **flags, initial_state=pool, ssm_state_indices=slots, inplace_final_state=True
        )
    routes_seen.update(r.backend for r in routes)
    assert returned is pool  # updated in place
    for row, (request, _) in enumerate(rows):
        if request is not None:
            history[request].append({name: t[row : row + 1] for name, t in x.items()})
        else:
            assert (o[row] == 0).all()  # padding rows: zero output
    free = [s for s in range(SLOTS) if s not in slots.tolist()]
    assert torch.equal(pool[free].isnan(), before[free].isnan())  # slots nobody owns: untouched

# Request 0's decoded state equals chunk_kda over its whole history (prompt + 6 decode tokens).
whole = {name: torch.cat([piece[name] for piece in history[0]], dim=1) for name in history[0][0]}
_, exact = kda.chunk_kda(**whole, **flags, **prefill_gate, output_final_state=True)
error = ((pool[slot_of[0]].double() - exact[0].double()).norm() / exact[0].double().norm()).item()
print(f"continuous batching: ran on {sorted(routes_seen)}; request 0's pooled state vs chunk_kda: {error:.2e}")

# Speculative decoding: 3 draft tokens for each live request, every token's state kept in a fresh slot.
live = list(slot_of.items())
drafts = 3
scratch = [s for s in range(SLOTS) if s not in slot_of.values()]
table = torch.full((BATCH, drafts), -1, dtype=torch.int32)
for row, (_, slot) in enumerate(live):
    table[row, 0] = slot  # column 0: the request's current state (read), then the first token's state
    table[row, 1:] = torch.tensor([scratch.pop(), scratch.pop()])
x = token_inputs(BATCH, drafts)
old = {row: pool[slot].clone() for row, (_, slot) in enumerate(live)}  # to check against, below
kda.fused_recurrent_kda(**x, **gate, **flags, initial_state=pool, ssm_state_indices=table, inplace_final_state=True)

# The verifier accepts 1..3 tokens per request; the next step continues from the last accepted token's slot.
accepted = torch.tensor([2, 3, 1, 1], dtype=torch.int32)
after = {row: pool[table[row, accepted[row] - 1]].clone() for row in range(len(live))}
reference = {}
for row in range(len(live)):  # the same accepted tokens run one at a time from the request's old state
    state = None
    for t in range(int(accepted[row])):
        one = {name: tensor[row : row + 1, t : t + 1] for name, tensor in x.items()}
        start = old[row] if state is None else state
        _, state = kda.fused_recurrent_kda(
            **one, **gate, **flags, initial_state=start[None].float(), output_final_state=True
        )
        state = state[0]
    reference[row] = state
next_step = token_inputs(BATCH)
o, _ = kda.fused_recurrent_kda(
    **next_step,
    **gate,
    **flags,
    initial_state=pool,
    ssm_state_indices=table,
    num_accepted_tokens=accepted,
    inplace_final_state=True,
)
print(
    f"speculative decoding: accepted {accepted.tolist()[: len(live)]} of {drafts} drafts; padding row output zero: {bool((o[-1] == 0).all())}"
)
worst = max(((after[r].double() - reference[r].double()).norm() / reference[r].double().norm()).item() for r in after)
print(f"accepted states vs one token at a time: {worst:.2e} (a bf16 pool: one bf16 rounding)")
