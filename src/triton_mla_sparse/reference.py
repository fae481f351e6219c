"""PyTorch reference for sparse MLA attention: the one tests, ``verify`` and ``bench`` share.

Computes in float32 (default) or float64, a chunk of tokens at a time so that a long prefill does
not materialise ``T x W x D`` at once. Same signature and semantics as
:func:`triton_mla_sparse.sparse_mla` (``config`` is accepted and ignored, so the two calls are
interchangeable), plus two keyword-only arguments of its own: ``compute_dtype`` and
``token_chunk``. Valid on any cache: rows no valid index selects are never part of the result,
whatever they hold (NaN, inf, garbage bytes).
"""

from __future__ import annotations

import math

import torch

from .kv_format import dequantize_cache
from .ops.sparse_mla.heuristics import KernelConfig


def physical_rows(
    indices: torch.Tensor,
    num_rows: int,
    valid_counts: torch.Tensor | None = None,
    block_table: torch.Tensor | None = None,
    req_ids: torch.Tensor | None = None,
    block_size: int | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Map indices to flat cache rows; returns ``(rows int64 [T, W], valid bool [T, W])``.

    An entry is valid when it is inside ``valid_counts``, non-negative, (with a block table) maps
    through a non-negative table entry inside the table, and lands in ``[0, num_rows)``.
    """
    idx = indices.long()
    t, w = idx.shape
    valid = idx >= 0
    if valid_counts is not None:
        valid &= torch.arange(w, device=idx.device)[None, :] < valid_counts.long()[:, None]
    if block_table is not None:
        assert req_ids is not None and block_size is not None
        max_blocks = block_table.shape[1]
        blk = torch.where(valid, idx // block_size, 0)
        valid &= blk < max_blocks
        blk = torch.where(valid, blk, 0)
        phys = block_table.long()[req_ids.long()[:, None], blk]
        valid &= phys >= 0
        idx = phys * block_size + idx % block_size
    valid &= idx < num_rows
    return torch.where(valid, idx, 0), valid


def sparse_mla_reference(
    q: torch.Tensor | tuple[torch.Tensor, torch.Tensor],
    kv_cache: torch.Tensor,
    indices: torch.Tensor,
    softmax_scale: float | None = None,
    *,
    kv_lora_rank: int = 512,
    valid_counts: torch.Tensor | None = None,
    block_table: torch.Tensor | None = None,
    req_ids: torch.Tensor | None = None,
    block_size: int | None = None,
    kv_format: str = "auto",
    k_scale: float | torch.Tensor | None = None,
    out: torch.Tensor | None = None,
    return_lse: bool = False,
    config: KernelConfig | None = None,
    compute_dtype: torch.dtype = torch.float32,
    token_chunk: int = 64,
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """Reference sparse MLA forward. Returns ``out`` in q's dtype (and the natural-log LSE).

    The arguments of :func:`triton_mla_sparse.sparse_mla`, with the same meaning (``config``
    is ignored: there is no launch), and two of its own:

    - ``compute_dtype``: float32 (default) or float64, the precision of every step.
    - ``token_chunk``: tokens gathered at once (bounds the ``chunk x W x D`` temporary).
    """
    if isinstance(q, tuple):
        q_full = torch.cat([q[0], q[1]], dim=-1) if q[1].shape[-1] else q[0]
    else:
        q_full = q
    t, h, d = q_full.shape
    if softmax_scale is None:
        softmax_scale = 1.0 / math.sqrt(d)
    rows = dequantize_cache(kv_cache, kv_format, k_scale)
    rows = rows.reshape(-1, rows.shape[-1])[:, :d].to(compute_dtype)  # [N, D]
    ridx, valid = physical_rows(
        indices, rows.shape[0], valid_counts, block_table, req_ids, block_size
    )
    res = torch.zeros(t, h, kv_lora_rank, dtype=compute_dtype, device=q_full.device)
    lse = torch.full((t, h), float("-inf"), dtype=compute_dtype, device=q_full.device)
    qc = q_full.to(compute_dtype)
    for t0 in range(0, t, token_chunk):
        sl = slice(t0, min(t, t0 + token_chunk))
        # invalid entries point at row 0: zero them here, since 0 * NaN in the product would
        # carry a NaN (or inf) of a row nobody selected into the result
        k = torch.where(valid[sl][..., None], rows[ridx[sl]], 0.0)  # [c, W, D]
        s = torch.einsum("chd,cwd->chw", qc[sl], k) * softmax_scale
        s = s.masked_fill(~valid[sl][:, None, :], float("-inf"))
        m = s.amax(dim=-1, keepdim=True)
        m = torch.where(torch.isfinite(m), m, torch.zeros_like(m))
        p = torch.exp(s - m)
        den = p.sum(dim=-1, keepdim=True)
        o = torch.einsum("chw,cwd->chd", p, k[..., :kv_lora_rank])
        res[sl] = torch.where(den > 0, o / den.clamp_min(1e-300), torch.zeros_like(o))
        lse[sl] = torch.where(
            den[..., 0] > 0,
            m[..., 0] + torch.log(den[..., 0]),
            torch.full_like(m[..., 0], float("-inf")),
        )
    result = res.to(q_full.dtype)
    if out is not None:
        out.copy_(result)
        result = out
    if return_lse:
        return result, lse.float()
    return result
