"""The decode step: KDA in its recurrent form, one token after another, in one launch.

Per sequence ``n`` and value head ``hv`` (q/k head ``hv // (HV // H)``), all arithmetic in fp32, the state
``S [K, V]`` held in registers from the first token to the last::

    q_t, k_t <- l2norm(q_t), l2norm(k_t)          with l2norm in kernel (x / sqrt(sum x^2 + 1e-6))
    q_t      <- scale * q_t
    a_t      =  g_t                                         pre-gated
                -exp(A_log[hv]) * softplus(g_t + dt_bias[hv])     softplus gate
                lower_bound * sigmoid(exp(A_log[hv]) * (g_t + dt_bias[hv]))   bounded gate (factor 1 without A_log)
    a_t      <- max(a_t, LOG_DECAY_FLOOR)                    (-32; -inf too; a NaN stays NaN)
    b_t      =  sigmoid(beta_t) (2 sigmoid with allow_neg_eigval) with beta sigmoid in kernel, else beta_t
    S        <- exp(a_t)[:, None] * S
    S        <- S + k_t (b_t (v_t - S^T k_t))^T
    o_t      =  S^T q_t

Where the state comes from and goes to (``recurrent_forward``'s docstring has the whole contract): a
dense ``initial_state[n]`` / ``final_state[n]``, or slots of a state pool picked by ``ssm_state_indices``
(1-D: one slot per sequence, read at the start and written at the end; 2-D: speculative decoding, read
from column ``num_accepted_tokens[n] - 1`` and written after every token into that token's column). A
negative slot is padding: the sequence reads and writes no state and its outputs are 0.

Grid: one program per (value tile, sequence, value head), flattened to one axis with the value tile
fastest (``pid = (n * HV + hv) * NV + i_v``): a second grid axis is limited to 65535, which ``N * HV``
passes at N = 2048, HV = 32, and neighbouring programs then take neighbouring tiles of the same head's
state. A program holds all ``K`` rows of its ``BV`` columns (the products ``S^T k`` and ``S^T q`` sum
over K) and walks its sequence's tokens in order. Nothing is read on the host: sequence bounds, slots
and accepted counts are loaded inside the kernel, so a call can be captured in a CUDA graph.

Bytes, and what limits them. The op is memory bound: a decode step reads and writes the whole state,
``2 * N * HV * K * V * s`` bytes (``s`` = 4 for fp32 states, 2 for a bf16/fp16 pool), against about
``6 * K * V`` flops per token and head; the token inputs add ``N * T * ((2 H + HV) K + 2 HV V) * e``
bytes (``e`` their element size; q, k and g are re-read by the ``NV`` programs of a head, from L2).
At N = 256, HV = 32, K = V = 128 in fp32 that is 0.54 GB of state each way, about 0.22 ms at 4.8 TB/s
(H200); T > 1 adds no state traffic (the state stays in registers), except with 2-D indices, which
write one state per token. So the kernel is limited by DRAM bandwidth at large batches, and at small
ones (``N * HV * NV`` programs short of filling the GPU) by the latency of one token's load, reduce,
store chain. What keeps it at the bandwidth:

- coalesced state access: a ``[BK, BV]`` tile's pointers are contiguous along V (``[K, V]`` layout:
  ``BV * s`` bytes per row, a whole 128-byte line at BV = 32 in fp32) or along K (``[V, K]`` layout:
  ``BV`` whole rows, one contiguous block); Triton's coalescing follows the pointers' contiguity, so one
  register tile serves both layouts;
- eviction hints: the state is read once and written once per call and not read again before other
  layers have passed through L2, so its loads and stores are ``evict_first``; ``q, k, g`` are re-read
  by the other value tiles of the head (and by the GVA group), so they are ``evict_last``; ``v`` and
  ``beta`` are read by one program, ``evict_first``. ``o`` keeps the default: the next kernel reads it.
- launch configuration (`recurrent_config`): a table measured per architecture and state dtype
  (`configs.decode_launch`), else 32 value columns and about 32 fp32 state values a thread, which compiles
  without spills to at most 128 registers and leaves several programs per SM to keep loads in flight.

64-bit offsets: a pool of a few thousand slots of ``HV * K * V`` fp32 states passes 2^31 elements, so
slot and token offsets are computed in int64.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from kda.backends.triton.configs import decode_launch
from kda.backends.triton.gate import FLOOR, PREGATED, SAFE, SOFTPLUS
from kda.backends.triton.storage import stored
from kda.errors import KDAInputError

MAX_HEAD_DIM = 256
NO_INDICES, ONE_SLOT, SLOT_PER_TOKEN = 0, 1, 2  # values of INDICES: no pool, 1-D indices, 2-D indices
_ONE_SLOT = tl.constexpr(ONE_SLOT)  # the same, readable inside kernels
_SLOT_PER_TOKEN = tl.constexpr(SLOT_PER_TOKEN)
_PREGATED = tl.constexpr(PREGATED)
_SOFTPLUS = tl.constexpr(SOFTPLUS)
_STATE_VALUES_PER_THREAD = 32


@dataclass(frozen=True)
class RecurrentConfig:
    """The decode kernel's launch: ``BV`` value columns per program and its warps."""

    block_v: int
    num_warps: int


def recurrent_config(K: int, V: int, state_bytes: int = 4, capability_major: int | None = None) -> RecurrentConfig:
    """The launch for head dims ``K`` and ``V``, states of ``state_bytes`` per element, on this architecture:
    the measured table of `configs.decode_launch` where it has an entry, else this rule.

    The rule (other architectures; head dims other than 65 to 128 on sm90): ``BV = 32`` (fewer when ``V`` is
    smaller): a whole 128-byte line of an fp32 ``[K, V]`` state row, the narrowest tile whose loads are whole
    lines, and as many programs as a narrow tile gives, which a small decode batch needs to fill the GPU.
    Warps: ``BK * BV / (32 * 32)``, i.e. about `_STATE_VALUES_PER_THREAD` fp32 state values a thread, between
    1 and 8 (K = 64: 2 warps, 128: 4, 256: 8).
    Compiled for sm90 on the CPU (Triton 3.9; bf16 inputs, 1-D and 2-D pools, both layouts): 106 to 128
    registers a thread at K = V = 64, 128 and 256, no spills, at most 1 KB of shared memory (the
    reductions' scratch), so 2 to 4 programs (16 warps) an SM and 32 to 64 KB of state loads in flight
    per SM. A 64-column tile at the same state values per thread took 168 to 252 registers (K = 64 and
    128), halving the programs an SM holds, and 8 warps at K = 128 took 228.
    """
    BK = triton.next_power_of_2(K)
    measured = decode_launch(capability_major, K, V, state_bytes)
    if measured is not None:
        return RecurrentConfig(block_v=min(measured.block_v, triton.next_power_of_2(V)), num_warps=measured.num_warps)
    BV = min(triton.next_power_of_2(V), 32)
    warps = BK * BV // (32 * _STATE_VALUES_PER_THREAD)
    return RecurrentConfig(block_v=BV, num_warps=max(1, min(8, warps)))


@functools.lru_cache(maxsize=16)
def _capability_major(device: torch.device) -> int | None:
    """The compute capability's major version of a CUDA device (None elsewhere), looked up once per device:
    the decode step is short, and its host time counts at small batches."""
    return torch.cuda.get_device_capability(device)[0] if device.type == "cuda" else None


@triton.jit
def _log_decay(x, a, bias, lower_bound, GATE: tl.constexpr):
    """Per K column, the log decay of the gate input ``x [BK]`` (fp32), floored (see the module docstring).
    ``a`` is ``exp(A_log[hv])`` (1 without A_log), ``bias`` dt_bias[hv] (0 without it)."""
    if GATE != _PREGATED:
        x = x + bias
        if GATE == _SOFTPLUS:
            # softplus(x) = log(1 + e^x), without overflow for large x
            x = -a * tl.where(x > 20.0, x, tl.log(1.0 + tl.exp(tl.minimum(x, 20.0))))
        else:
            x = lower_bound * tl.sigmoid(a * x)
    return tl.where(x < FLOOR, FLOOR, x)  # a `where`, not a `max`: a NaN stays NaN


@triton.jit(do_not_specialize=["T", "T_MAX"])
def recurrent_kernel(
    q,  # [B, T, H, K] (contiguous)
    k,  # [B, T, H, K]
    v,  # [B, T, HV, V]
    g,  # [B, T, HV, K]: log decay, or the gate's input with GATE != PREGATED
    beta,  # [B, T, HV]
    o,  # [B, T, HV, V] out (q's dtype)
    A_log,  # [HV] (any float dtype), or a dummy
    dt_bias,  # [HV * K] (any float dtype), or a dummy
    h0,  # start states: [N, HV, K, V] (or [N, HV, V, K] with V_FIRST), or a pool [slots, HV, ...]; or a dummy
    ht,  # where states go: the same shapes as h0; or a dummy
    cu_seqlens,  # [N + 1] int32/int64, or a dummy
    indices,  # [N] or [N, T_MAX] int32/int64 slots, or a dummy
    num_accepted,  # [N] int32/int64, or a dummy
    scale,
    lower_bound,
    T,  # tokens per sequence without cu_seqlens
    T_MAX,  # columns of 2-D indices
    stride_h0,  # elements from one state (sequence or slot) of h0 to the next
    stride_ht,
    stride_idx_n,  # elements between rows of indices
    stride_idx_t,  # and between columns of 2-D indices
    H: tl.constexpr,
    HV: tl.constexpr,
    K: tl.constexpr,
    V: tl.constexpr,
    BK: tl.constexpr,
    BV: tl.constexpr,
    GATE: tl.constexpr,
    HAS_A_LOG: tl.constexpr,
    HAS_DT_BIAS: tl.constexpr,
    L2: tl.constexpr,
    SIGMOID: tl.constexpr,
    TWO: tl.constexpr,
    V_FIRST: tl.constexpr,
    HAS_H0: tl.constexpr,
    HAS_HT: tl.constexpr,
    VARLEN: tl.constexpr,
    INDICES: tl.constexpr,  # NO_INDICES, ONE_SLOT or SLOT_PER_TOKEN
    HAS_ACCEPTED: tl.constexpr,
    ROUND: tl.constexpr,  # round to nearest when storing bf16 (the interpreter truncates; `storage`)
):
    NV: tl.constexpr = (V + BV - 1) // BV
    pid = tl.program_id(0)
    i_v = pid % NV
    i_nh = pid // NV
    i_n = i_nh // HV
    i_hv = i_nh % HV
    i_h = i_hv // (HV // H)
    if VARLEN:
        bos = tl.load(cu_seqlens + i_n).to(tl.int64)
        eos = tl.load(cu_seqlens + i_n + 1).to(tl.int64)
    else:
        bos = i_n.to(tl.int64) * T
        eos = bos + T

    kcols = tl.arange(0, BK)
    vcols = i_v * BV + tl.arange(0, BV)
    mask_k = kcols < K
    mask_v = vcols < V
    if V_FIRST:  # [V, K] per head: K contiguous
        tile = i_hv * (K * V) + vcols[None, :] * K + kcols[:, None]
    else:  # [K, V] per head: V contiguous
        tile = i_hv * (K * V) + kcols[:, None] * V + vcols[None, :]
    mask_s = mask_k[:, None] & mask_v[None, :]

    # The state's first slot (or sequence); `live` is false for a padding sequence.
    row = i_n.to(tl.int64)
    live = i_n >= 0  # true, as a scalar that the slot checks below narrow
    if INDICES == _ONE_SLOT:
        row = tl.load(indices + i_n.to(tl.int64) * stride_idx_n).to(tl.int64)
        live = row >= 0
    if INDICES == _SLOT_PER_TOKEN:
        column = tl.full([], 0, tl.int64)
        if HAS_ACCEPTED:
            column = tl.load(num_accepted + i_n).to(tl.int64) - 1
        inside = (column >= 0) & (column < T_MAX)  # an accepted count outside 1..T_MAX reads no slot
        row = tl.load(indices + i_n.to(tl.int64) * stride_idx_n + column * stride_idx_t, mask=inside, other=-1)
        row = row.to(tl.int64)
        live = row >= 0
    # Masks that also hold `live` compare against a row count that is 0 for padding: the interpreter cannot
    # `&` a scalar condition with a block one.
    k_live = tl.where(live, K, 0)
    mask_qk = kcols < k_live  # a padding sequence reads none of its tokens
    mask_vv = vcols < tl.where(live, V, 0)
    if HAS_H0:
        read = (kcols[:, None] < k_live) & mask_v[None, :]
        S = tl.load(h0 + row * stride_h0 + tile, mask=read, other=0.0, eviction_policy="evict_first")
        S = S.to(tl.float32)
    else:
        S = tl.zeros([BK, BV], dtype=tl.float32)

    a = 1.0
    if HAS_A_LOG:
        a = tl.exp(tl.load(A_log + i_hv).to(tl.float32))
    bias = tl.zeros([BK], dtype=tl.float32)
    if HAS_DT_BIAS:
        bias = tl.load(dt_bias + i_hv * K + kcols, mask=mask_k, other=0.0).to(tl.float32)

    for t in range(eos - bos):
        token = bos + t
        qk_off = (token * H + i_h) * K + kcols
        head = token * HV + i_hv
        q_t = tl.load(q + qk_off, mask=mask_qk, other=0.0, eviction_policy="evict_last").to(tl.float32)
        k_t = tl.load(k + qk_off, mask=mask_qk, other=0.0, eviction_policy="evict_last").to(tl.float32)
        g_t = tl.load(g + head * K + kcols, mask=mask_qk, other=0.0, eviction_policy="evict_last").to(tl.float32)
        v_t = tl.load(v + head * V + vcols, mask=mask_vv, other=0.0, eviction_policy="evict_first").to(tl.float32)
        b_t = tl.load(beta + head, mask=live, other=0.0, eviction_policy="evict_first").to(tl.float32)
        if L2:
            q_t = q_t * tl.rsqrt(tl.sum(q_t * q_t) + 1e-6)  # eps as kda.reference.l2norm
            k_t = k_t * tl.rsqrt(tl.sum(k_t * k_t) + 1e-6)
        q_t = q_t * scale
        if SIGMOID:
            b_t = tl.sigmoid(b_t)
            if TWO:
                b_t = 2.0 * b_t

        S = S * tl.exp(_log_decay(g_t, a, bias, lower_bound, GATE))[:, None]
        delta = b_t * (v_t - tl.sum(S * k_t[:, None], axis=0))  # [BV]
        S = S + k_t[:, None] * delta[None, :]
        o_t = tl.sum(S * q_t[:, None], axis=0)
        tl.store(o + head * V + vcols, stored(o_t, o, ROUND), mask=mask_v)  # 0 for padding: all it read was 0

        if HAS_HT and INDICES == _SLOT_PER_TOKEN:  # this token's state into its own slot (none if negative)
            slot = tl.load(indices + i_n.to(tl.int64) * stride_idx_n + t * stride_idx_t, mask=t < T_MAX, other=-1)
            slot = slot.to(tl.int64)
            keep = (kcols[:, None] < tl.where(live & (slot >= 0), K, 0)) & mask_v[None, :]
            tl.store(ht + slot * stride_ht + tile, stored(S, ht, ROUND), mask=keep, eviction_policy="evict_first")

    if HAS_HT and INDICES != _SLOT_PER_TOKEN:
        keep = mask_s
        if INDICES == _ONE_SLOT:  # an empty sequence leaves its slot as it was
            keep = (kcols[:, None] < tl.where(live & (eos > bos), K, 0)) & mask_v[None, :]
        tl.store(ht + row * stride_ht + tile, stored(S, ht, ROUND), mask=keep, eviction_policy="evict_first")


def _gate_mode(use_gate_in_kernel: bool, lower_bound: float | None) -> int:
    if not use_gate_in_kernel:
        return PREGATED
    return SOFTPLUS if lower_bound is None else SAFE


def _check_state(name: str, state: torch.Tensor, per_head: tuple[int, int], HV: int) -> None:
    """A state tensor (dense or pool): ``[rows, HV, *per_head]``, each row contiguous (rows may be strided)."""
    if state.dim() != 4 or tuple(state.shape[1:]) != (HV, *per_head):
        raise KDAInputError(name, f"must be [rows, {HV}, {per_head[0]}, {per_head[1]}]", tuple(state.shape))
    if state.stride()[1:] != (per_head[0] * per_head[1], per_head[1], 1):
        raise KDAInputError(name, "each state (row) must be contiguous", state.stride())


def _check(
    q: torch.Tensor,
    v: torch.Tensor,
    tensors: dict[str, torch.Tensor],
    out: torch.Tensor,
    ssm_state_indices: torch.Tensor | None,
    num_accepted_tokens: torch.Tensor | None,
) -> None:
    """The rules this function relies on beyond what `KDASpec` checks (cheap: shapes and strides only)."""
    K, V = q.shape[-1], v.shape[-1]
    if K > MAX_HEAD_DIM or V > MAX_HEAD_DIM:
        raise KDAInputError("q", f"K and V must be at most {MAX_HEAD_DIM}", (K, V))
    for name, tensor in tensors.items():
        if not tensor.is_contiguous():
            raise KDAInputError(name, "must be contiguous", tensor.stride())
    if out.shape != v.shape or out.dtype != q.dtype or not out.is_contiguous():
        raise KDAInputError("out", "must be a contiguous buffer of v's shape in q's dtype", (out.shape, out.dtype))
    if ssm_state_indices is not None and ssm_state_indices.dim() not in (1, 2):
        raise KDAInputError("ssm_state_indices", "must be [N] or [N, T_max]", tuple(ssm_state_indices.shape))
    if num_accepted_tokens is not None and (ssm_state_indices is None or ssm_state_indices.dim() != 2):
        raise KDAInputError("num_accepted_tokens", "needs 2-D ssm_state_indices", None)


def recurrent_forward(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    *,
    scale: float,
    A_log: torch.Tensor | None = None,
    dt_bias: torch.Tensor | None = None,
    use_gate_in_kernel: bool,
    lower_bound: float | None,
    use_qk_l2norm_in_kernel: bool,
    use_beta_sigmoid_in_kernel: bool,
    allow_neg_eigval: bool,
    state_v_first: bool,
    initial_state: torch.Tensor | None = None,
    ssm_state_indices: torch.Tensor | None = None,
    num_accepted_tokens: torch.Tensor | None = None,
    cu_seqlens: torch.Tensor | None = None,
    final_state: torch.Tensor | None = None,
    out: torch.Tensor,
) -> None:
    """KDA's recurrent form (the math is in the module docstring) into ``out``, in one launch.

    Shapes: q, k ``[B, T, H, K]`` (one dtype); v ``[B, T, HV, V]``; g ``[B, T, HV, K]``; beta ``[B, T, HV]``
    (any float dtypes, contiguous); ``A_log`` HV elements, ``dt_bias`` ``[HV * K]`` or ``[HV, K]``, any float
    dtype (read as flat vectors: a contiguous tensor is viewed, not copied). ``out [B, T, HV, V]`` in q's
    dtype is written whole (padding sequences' outputs are 0). States are ``[.., HV, K, V]``, or
    ``[.., HV, V, K]`` with `state_v_first`; each state contiguous, the leading (sequence or slot)
    dimension may be strided.

    Sequences: ``B`` of ``T`` tokens, or with `cu_seqlens` (``[N + 1]`` int32/int64 on the device, B = 1)
    the ``N`` pieces it bounds; empty ones are allowed. Where sequence ``n``'s state starts and ends:

    - no indices: it starts at ``initial_state[n]`` (``[N, HV, K, V]``, any float dtype; zero when None)
      and ``S_T`` is written to ``final_state[n]`` when given (the start state for an empty sequence);
    - 1-D `ssm_state_indices` ``[N]``: ``initial_state`` and ``final_state`` are pools ``[slots, HV, K, V]``
      (fp32, bf16 or fp16; usually one tensor, updated in place). It starts at ``initial_state[idx[n]]``
      (zero when None) and ``final_state[idx[n]] = S_T`` (rounded to the pool's dtype) when given and the
      sequence is not empty;
    - 2-D `ssm_state_indices` ``[N, T_max]`` (speculative decoding): it starts at ``initial_state[idx[n, c]]``
      with ``c = num_accepted_tokens[n] - 1`` (0 without `num_accepted_tokens`), and after each token t
      ``final_state[idx[n, t]] = S_t`` when `final_state` is given.

    A negative slot is padding: a negative start slot (or an accepted count outside ``1..T_max``) makes the
    whole sequence padding (no state read or written, outputs 0); with 2-D indices a negative
    ``idx[n, t]`` for a later token only skips that token's write. States are only ever written to
    `final_state`: with a pool, pass the pool as both `initial_state` and `final_state` to update it in place.

    Nothing is read on the host and nothing is allocated (`A_log` and `dt_bias` are viewed flat): the
    call can be captured in a CUDA graph.
    """
    B, T, H, K = q.shape
    HV, V = v.shape[2], v.shape[3]
    varlen = cu_seqlens is not None
    N = cu_seqlens.shape[0] - 1 if cu_seqlens is not None else B
    _check(q, v, {"q": q, "k": k, "v": v, "g": g, "beta": beta}, out, ssm_state_indices, num_accepted_tokens)
    per_head = (V, K) if state_v_first else (K, V)
    for name, state in (("initial_state", initial_state), ("final_state", final_state)):
        if state is not None:
            _check_state(name, state, per_head, HV)
    if N <= 0:
        return  # no sequence: nothing to read or write (with T = 0 the launch still passes the start states on)

    state = initial_state if initial_state is not None else final_state
    state_bytes = state.element_size() if state is not None else 4
    config = recurrent_config(K, V, state_bytes, _capability_major(q.device))
    BK, BV = triton.next_power_of_2(K), config.block_v
    indices = ssm_state_indices
    mode = NO_INDICES if indices is None else (ONE_SLOT if indices.dim() == 1 else SLOT_PER_TOKEN)
    stride_idx = (1, 1) if indices is None else (indices.stride(0), indices.stride(1) if indices.dim() == 2 else 1)
    dummy = out
    grid = (triton.cdiv(V, BV) * N * HV,)
    recurrent_kernel[grid](
        q,
        k,
        v,
        g,
        beta,
        out,
        A_log.reshape(-1) if A_log is not None else dummy,
        dt_bias.reshape(-1) if dt_bias is not None else dummy,
        initial_state if initial_state is not None else dummy,
        final_state if final_state is not None else dummy,
        cu_seqlens if cu_seqlens is not None else dummy,
        indices if indices is not None else dummy,
        num_accepted_tokens if num_accepted_tokens is not None else dummy,
        float(scale),
        float(lower_bound if lower_bound is not None else 0.0),
        T,
        indices.shape[1] if indices is not None and indices.dim() == 2 else 1,
        initial_state.stride(0) if initial_state is not None else 0,
        final_state.stride(0) if final_state is not None else 0,
        *stride_idx,
        H=H,
        HV=HV,
        K=K,
        V=V,
        BK=BK,
        BV=BV,
        GATE=_gate_mode(use_gate_in_kernel, lower_bound),
        HAS_A_LOG=use_gate_in_kernel and A_log is not None,
        HAS_DT_BIAS=use_gate_in_kernel and dt_bias is not None,
        L2=use_qk_l2norm_in_kernel,
        SIGMOID=use_beta_sigmoid_in_kernel,
        TWO=allow_neg_eigval,
        V_FIRST=state_v_first,
        HAS_H0=initial_state is not None,
        HAS_HT=final_state is not None,
        VARLEN=varlen,
        INDICES=mode,
        HAS_ACCEPTED=num_accepted_tokens is not None,
        ROUND=q.device.type == "cpu",  # only the interpreter runs CPU tensors
        num_warps=config.num_warps,
    )
