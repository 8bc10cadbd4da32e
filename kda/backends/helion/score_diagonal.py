"""Backward stage 3b: the diagonal blocks `score_backward` leaves out, exactly, one 16-row strip per program.

Where a strip's decays are too steep for its diagonal block to go through the anchors
(`score_backward.by_product` false: a decay span past 80 against either anchor, or a single log decay
past 8), the block's terms are summed here token by token, each exponent masked to -inf outside the causal
triangle before ``exp`` (so every factor is <= 1). For the strip ``S = [s, s + 16)`` and each token
``j = s + jj`` of it::

    da_i += dP[i, j] b_j exp(G_i - G_j)     (i >= j: the strip as rows)
    db_i += dP[j, i] a_j exp(G_j - G_i)     (i <= j: the strip as columns)

for both score matrices (``P_qk``: ``a = q, b = k``, the diagonal included; ``P_kk``: ``a = b = k``, the
diagonal excluded, as `chunk_backward` left ``dP_kk`` zero there), then, per row of the strip::

    dq += da (P_qk)        dk += da (P_kk) + db (P_qk) + db (P_kk)
    dG += q da (P_qk) + k da (P_kk) - k (db (P_qk) + db (P_kk))

added to what `score_backward` wrote: its terms are linear in ``da`` and ``db``, so the block's share adds
apart from the rest. A strip whose block went through the anchors does nothing here but read its own
``G`` rows and decide. The decision, the masks and the rows (times their l2norm scales with L2) are
`score_backward`'s. Grid ``(NT, HV, C / 16)``, ``K`` in config-sized blocks.
"""

from __future__ import annotations

import helion.language as hl
import torch

from kda.backends.helion.score_backward import by_product


def score_diagonal_kernel(
    q: torch.Tensor,  # [tokens, H, K] as given
    k: torch.Tensor,  # [tokens, H, K] as given
    rstd_q: torch.Tensor,  # [tokens, H] fp32 with L2, else a placeholder
    rstd_k: torch.Tensor,  # [tokens, H] fp32 with L2, else a placeholder
    G: torch.Tensor,  # [NT, HV, C, K] fp32
    dP_qk: torch.Tensor,  # [NT, HV, C, C] fp32
    dP_kk: torch.Tensor,  # [NT, HV, C, C] fp32
    chunk_starts: torch.Tensor,  # [NT] int32
    chunk_seq_ends: torch.Tensor,  # [NT] int32
    dq_c: torch.Tensor,  # [NT, HV, C, K] fp32, added to
    dk_c: torch.Tensor,  # [NT, HV, C, K] fp32, added to
    dG_c: torch.Tensor,  # [NT, HV, C, K] fp32, added to
    group: int,
    C: hl.constexpr,
    L2: hl.constexpr,
) -> None:
    NT = G.size(0)
    HV = G.size(1)
    K = G.size(3)
    # key blocks of 16 or 32 columns: the 16 unrolled steps hold four [16, BK] sums and each step's rows;
    # compiled for sm_90a at B4_T2048_H16_D128 training with 4 warps they spill 808 B a thread at 16
    # columns, 880 at 32, 1676 at 64 and 3104 at 128 (Helion's default there, K whole)
    block_k = hl.register_block_size(16, 32)
    for tile_c, tile_hv, tile_s in hl.tile([NT, HV, C], block_size=[1, 1, 16]):
        c = tile_c.begin
        hv = tile_hv.begin
        head = hv // group
        start = chunk_starts[c]
        end = chunk_seq_ends[c]
        s = tile_s.begin
        rows = start + tile_s.index
        row_ok = rows < end
        G_strip = G[c, hv, tile_s, :]  # [16, K]
        previous = torch.where(tile_s.index > s, tile_s.index - 1, s)
        G_prev = hl.load(G, [c, hv, previous, slice(None)])  # [16, K]
        if not by_product(G_strip, G_prev, G[c, hv, s, :][None, :], G[c, hv, s + 15, :][None, :]):
            if L2:
                rq_s = hl.load(rstd_q, [rows, head], extra_mask=row_ok)  # [16]
                rk_s = hl.load(rstd_k, [rows, head], extra_mask=row_ok)
            for tile_k in hl.tile(K, block_size=block_k):
                G_s = G[c, hv, tile_s, tile_k]  # [16, BK]
                q_s = hl.load(q, [rows, head, tile_k], extra_mask=row_ok[:, None]).to(torch.float32)
                k_s = hl.load(k, [rows, head, tile_k], extra_mask=row_ok[:, None]).to(torch.float32)
                if L2:
                    q_s = q_s * rq_s[:, None]
                    k_s = k_s * rk_s[:, None]
                da_q = hl.zeros([tile_s, tile_k], dtype=torch.float32)
                da_k = hl.zeros([tile_s, tile_k], dtype=torch.float32)
                db_q = hl.zeros([tile_s, tile_k], dtype=torch.float32)
                db_k = hl.zeros([tile_s, tile_k], dtype=torch.float32)
                for jj in hl.static_range(16):  # token j = s + jj as a column (da) and as a row (db)
                    j = s + jj
                    j_ok = start + j < end
                    k_j = torch.where(j_ok, hl.load(k, [start + j, head, tile_k], extra_mask=j_ok), 0.0).to(
                        torch.float32
                    )
                    q_j = torch.where(j_ok, hl.load(q, [start + j, head, tile_k], extra_mask=j_ok), 0.0).to(
                        torch.float32
                    )
                    if L2:
                        k_j = k_j * hl.load(rstd_k, [start + j, head], extra_mask=j_ok)
                        q_j = q_j * hl.load(rstd_q, [start + j, head], extra_mask=j_ok)
                    G_j = G[c, hv, j, tile_k]
                    e_col = torch.exp(torch.where((tile_s.index >= j)[:, None], G_s - G_j[None, :], float("-inf")))
                    da_q = da_q + dP_qk[c, hv, tile_s, j][:, None] * k_j[None, :] * e_col
                    da_k = da_k + dP_kk[c, hv, tile_s, j][:, None] * k_j[None, :] * e_col
                    e_row = torch.exp(torch.where((tile_s.index <= j)[:, None], G_j[None, :] - G_s, float("-inf")))
                    db_q = db_q + dP_qk[c, hv, j, tile_s][:, None] * q_j[None, :] * e_row
                    db_k = db_k + dP_kk[c, hv, j, tile_s][:, None] * k_j[None, :] * e_row
                dq_c[c, hv, tile_s, tile_k] = dq_c[c, hv, tile_s, tile_k] + da_q
                dk_c[c, hv, tile_s, tile_k] = dk_c[c, hv, tile_s, tile_k] + da_k + db_q + db_k
                dG_c[c, hv, tile_s, tile_k] = dG_c[c, hv, tile_s, tile_k] + q_s * da_q + k_s * (da_k - db_q - db_k)
