"""Backward stage 3: the gradients through the two score matrices, one 16-row strip per program.

Both are ``P[i, j] = sum_c a_i[c] b_j[c] exp(G_i[c] - G_j[c])`` (``P_qk``: ``a = q, b = k``, ``j <= i``;
``P_kk = M``: ``a = b = k``, ``j < i``), with ``dP`` from `chunk_backward`::

    da_i = sum_j dP[i, j] b_j exp(G_i - G_j)        db_j = sum_i dP[i, j] a_i exp(G_i - G_j)
    dG_i += a_i da_i                                 dG_j -= b_j db_j

A program takes the strip ``S = [s, s + 16)`` twice: as rows (its ``da``) and as columns (its ``db``).
Off the diagonal block the exponentials are split through an anchor between the two index sets, so both
factors are <= 1 (`scores` explains why): as rows, the strip's first row ``s`` against the columns
``j < s``; as columns, the strip's last row ``s + 15`` against the rows after it. Each is one product over
the chunk. The diagonal block is exact: one unrolled step per row (or column) of the block, the exponent
set to -inf outside the causal triangle before ``exp``.

Then, per row of the strip::

    dq += da (P_qk)        dk += da (P_kk) + db (P_qk) + db (P_kk)
    dG += q da (P_qk) + k da (P_kk) - k (db (P_qk) + db (P_kk))

added to what `chunk_backward` wrote (a strip's rows belong to this program alone). Grid
``(NT, HV, C / 16)``, ``K`` in config-sized blocks.
"""

from __future__ import annotations

import helion.language as hl
import torch


def score_backward_kernel(
    q: torch.Tensor,  # [tokens, H, K] (normalized when the call asks for it)
    k: torch.Tensor,  # [tokens, H, K]
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
) -> None:
    NT = G.size(0)
    HV = G.size(1)
    K = G.size(3)
    for tile_c, tile_hv, tile_s in hl.tile([NT, HV, C], block_size=[1, 1, 16]):
        c = tile_c.begin
        hv = tile_hv.begin
        head = hv // group
        start = chunk_starts[c]
        end = chunk_seq_ends[c]
        s = tile_s.begin
        rows = start + tile_s.index
        row_ok = rows < end
        cols = hl.arange(C)
        col_ok = start + cols < end
        before = (cols < s) & col_ok  # the rows' off-diagonal columns
        after = (cols >= s + 16) & col_ok  # the columns' off-diagonal rows
        dPq_rows = dP_qk[c, hv, tile_s, :]  # [16, C]
        dPk_rows = dP_kk[c, hv, tile_s, :]
        dPq_cols = dP_qk[c, hv, :, tile_s]  # [C, 16]
        dPk_cols = dP_kk[c, hv, :, tile_s]
        for tile_k in hl.tile(K):
            G_s = G[c, hv, tile_s, tile_k]  # [16, BK]
            G_first = G[c, hv, s, tile_k]  # [BK]
            G_end = G[c, hv, s + 15, tile_k]
            G_all = hl.load(G, [c, hv, cols, tile_k])  # [C, BK]
            q_s = hl.load(q, [rows, head, tile_k], extra_mask=row_ok[:, None]).to(torch.float32)
            k_s = hl.load(k, [rows, head, tile_k], extra_mask=row_ok[:, None]).to(torch.float32)
            q_all = hl.load(q, [start + cols, head, tile_k], extra_mask=col_ok[:, None]).to(torch.float32)
            k_all = hl.load(k, [start + cols, head, tile_k], extra_mask=col_ok[:, None]).to(torch.float32)
            # off the diagonal block, through the anchors
            k_before = k_all * torch.exp(torch.where(before[:, None], G_first[None, :] - G_all, float("-inf")))
            into_rows = torch.exp(G_s - G_first[None, :])
            da_q = into_rows * hl.dot(dPq_rows, k_before)
            da_k = into_rows * hl.dot(dPk_rows, k_before)
            decay_after = torch.exp(torch.where(after[:, None], G_all - G_end[None, :], float("-inf")))
            into_cols = torch.exp(G_end[None, :] - G_s)
            db_q = into_cols * hl.dot(dPq_cols.transpose(0, 1), q_all * decay_after)
            db_k = into_cols * hl.dot(dPk_cols.transpose(0, 1), k_all * decay_after)
            # the diagonal block, exactly: token j = s + jj as a column (for da) and as a row (for db)
            for jj in hl.static_range(16):
                j = s + jj
                j_ok = start + j < end
                k_j = torch.where(j_ok, hl.load(k, [start + j, head, tile_k], extra_mask=j_ok), 0.0).to(torch.float32)
                q_j = torch.where(j_ok, hl.load(q, [start + j, head, tile_k], extra_mask=j_ok), 0.0).to(torch.float32)
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
