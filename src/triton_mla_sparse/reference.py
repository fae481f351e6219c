"""PyTorch reference for sparse MLA attention: the one tests, ``verify`` and ``bench`` share.

Computes in float32 (default) or float64, a chunk of tokens at a time, decoding only the cache
rows (pages, for the V4 record) that chunk's entries reach: a long prefill, a wide top-k or a
large cache never materialise ``T x W x D`` or the whole decoded cache at once. Same signature
and semantics as :func:`triton_mla_sparse.sparse_mla` (``config`` is accepted and ignored, so
the two calls are interchangeable), plus two keyword-only arguments of its own:
``compute_dtype`` and ``token_chunk``. Valid on any cache: rows no valid index selects are never
part of the result, whatever they hold (NaN, inf, garbage bytes).
"""

from __future__ import annotations

import math

import torch

from .kv_format import REFERENCE_KV_FORMATS, dequantize_cache, ds_mla_v4_pages
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


# What one chunk's gathered rows may take (float64 at D = 576: ~58 tokens of a 2048-wide top-k)
CHUNK_BYTES = 1 << 29


class _RowSource:
    """One cache, decoded where entries reach it: ``gather`` turns flat row numbers ``[c, W]``
    into float32 rows ``[c, W, d]``, decoding only those rows (or, for the V4 record, whose
    scales live apart from the data, only the pages that hold them)."""

    def __init__(
        self,
        cache: torch.Tensor,
        kv_format: str,
        k_scale: float | torch.Tensor | None,
        d: int,
    ) -> None:
        if isinstance(k_scale, torch.Tensor):  # read once, not once per chunk
            k_scale = k_scale.float().cpu().item()
        self.kv_format, self.k_scale, self.d = kv_format, k_scale, d
        if kv_format == "fp8_ds_mla_v4":
            self.pages = ds_mla_v4_pages(cache)  # validates; [num_pages, page, 584], a view
            self.page = self.pages.shape[1]
            self.num_rows = self.pages.shape[0] * self.page
        else:
            self.cache = cache
            self.num_rows = math.prod(cache.shape[:-1])

    def gather(self, rows: torch.Tensor) -> torch.Tensor:
        flat = rows.reshape(-1)
        if flat.numel() == 0 or self.num_rows == 0:  # nothing to read (every entry invalid)
            return torch.zeros(*rows.shape, self.d, device=rows.device)
        if self.kv_format == "fp8_ds_mla_v4":
            used, where = torch.unique(flat // self.page, return_inverse=True)
            decoded = dequantize_cache(self.pages[used], self.kv_format)
            picked = decoded.reshape(-1, decoded.shape[-1])[where * self.page + flat % self.page]
        else:
            raw = self.cache[torch.unravel_index(flat, self.cache.shape[:-1])]
            picked = dequantize_cache(raw, self.kv_format, self.k_scale)
        return picked[:, : self.d].reshape(*rows.shape, self.d)


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
    attn_sink: torch.Tensor | None = None,
    extra_kv_cache: torch.Tensor | None = None,
    extra_indices: torch.Tensor | None = None,
    extra_valid_counts: torch.Tensor | None = None,
    extra_block_table: torch.Tensor | None = None,
    extra_block_size: int | None = None,
    out: torch.Tensor | None = None,
    return_lse: bool = False,
    config: KernelConfig | None = None,
    compute_dtype: torch.dtype = torch.float32,
    token_chunk: int | None = None,
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """Reference sparse MLA forward. Returns ``out`` in q's dtype (and the natural-log LSE).

    The arguments of :func:`triton_mla_sparse.sparse_mla`, with the same meaning (``config``
    is ignored: there is no launch). ``kv_format`` may be ``"fp8_ds_mla_v4"``, a
    ``[num_pages, page, 584]`` uint8 cache whose flat row ``page_index * page + slot`` holds 512
    values (NoPE: ``q`` is ``[T, H, 512]``, ``kv_lora_rank=512``). Two arguments of its own:

    - ``compute_dtype``: float32 (default) or float64, the precision of every step.
    - ``token_chunk``: tokens gathered at once (bounds the ``chunk x W x D`` temporary); None
      takes as many as keep it near :data:`CHUNK_BYTES`.

    An extra set (``extra_kv_cache``, ``extra_indices`` ...) is gathered like the main one, in
    the same format, and its entries are appended to each token's list: one softmax over both.
    """
    if isinstance(q, tuple):
        q_full = torch.cat([q[0], q[1]], dim=-1) if q[1].shape[-1] else q[0]
    else:
        q_full = q
    t, h, d = q_full.shape
    if softmax_scale is None:
        softmax_scale = 1.0 / math.sqrt(d)
    if kv_format not in REFERENCE_KV_FORMATS:
        raise ValueError(f"kv_format must be one of {REFERENCE_KV_FORMATS}, got {kv_format!r}")
    sets = [_RowSource(kv_cache, kv_format, k_scale, d)]
    ridx, valid = physical_rows(
        indices, sets[0].num_rows, valid_counts, block_table, req_ids, block_size
    )
    entries = [(ridx, valid)]
    if extra_kv_cache is not None:
        # both sets as one list: the extra set's entries after the main entries, each gathered
        # from its own cache (no row of one set can reach the other cache)
        sets.append(_RowSource(extra_kv_cache, kv_format, k_scale, d))
        entries.append(
            physical_rows(
                extra_indices,
                sets[1].num_rows,
                extra_valid_counts,
                extra_block_table,
                req_ids,
                extra_block_size,
            )
        )
        valid = torch.cat([valid, entries[1][1]], dim=1)
    width = valid.shape[1]
    if token_chunk is None:
        per_token = max(width * d * torch.empty((), dtype=compute_dtype).element_size(), 1)
        token_chunk = max(1, CHUNK_BYTES // per_token)
    res = torch.zeros(t, h, kv_lora_rank, dtype=compute_dtype, device=q_full.device)
    lse = torch.full((t, h), float("-inf"), dtype=compute_dtype, device=q_full.device)
    qc = q_full.to(compute_dtype)
    for t0 in range(0, t, token_chunk):
        sl = slice(t0, min(t, t0 + token_chunk))
        k = torch.cat([src.gather(r[sl]) for src, (r, _) in zip(sets, entries)], dim=1)
        # invalid entries point at row 0: zero them here, since 0 * NaN in the product would
        # carry a NaN (or inf) of a row nobody selected into the result
        k = torch.where(valid[sl][..., None], k.to(compute_dtype), 0.0)  # [c, W, D]
        s = torch.einsum("chd,cwd->chw", qc[sl], k) * softmax_scale
        s = s.masked_fill(~valid[sl][:, None, :], float("-inf"))
        m = s.amax(dim=-1, keepdim=True)
        m = torch.where(torch.isfinite(m), m, torch.zeros_like(m))
        p = torch.exp(s - m)
        den = p.sum(dim=-1, keepdim=True)
        o = torch.einsum("chw,cwd->chd", p, k[..., :kv_lora_rank])
        norm = den
        if attn_sink is not None:  # one more term, no value row; not part of the LSE
            norm = den + torch.exp(attn_sink.to(compute_dtype)[None, :, None] - m)
        res[sl] = torch.where(norm > 0, o / norm.clamp_min(1e-300), torch.zeros_like(o))
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


# --- DSA lightning indexer logits ------------------------------------------------------------
# logit[r, s] = kscale[s] * sum_h weights[r, h] * ReLU(q[r, h] . k[s]). The references return the
# whole [rows, width] float32 tensor with every column the kernel does not write set to -inf; with
# ``out`` they write only the columns the kernel writes and return ``out``.


def _as_float(x: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """e4m3 bytes (uint8 / float8_e4m3fn) or a float tensor -> ``dtype``."""
    if x.dtype == torch.uint8:
        x = x.view(torch.float8_e4m3fn)
    return x.to(dtype)


def indexer_row_lengths(
    context_lens: torch.Tensor, next_n: int, max_model_len: int
) -> torch.Tensor:
    """Length of each logits row ``[B * next_n]`` (int64): ``context_lens[b] - next_n + j + 1`` for
    a ``[B]`` tensor, ``context_lens[b, j]`` for ``[B, next_n]``; clamped to ``[0, max_model_len]``."""
    cl = context_lens.long()
    if cl.dim() == 1:
        j = torch.arange(next_n, device=cl.device)
        lens = cl[:, None] - next_n + j[None, :] + 1
    else:
        lens = cl
    return lens.reshape(-1).clamp(0, max_model_len)


def _finish(logits: torch.Tensor, written: torch.Tensor, out: torch.Tensor | None) -> torch.Tensor:
    if out is None:
        return logits.float().masked_fill(~written, float("-inf"))
    out[written] = logits.float()[written]
    return out


def paged_mqa_logits_reference(
    q: torch.Tensor,
    kv_cache: torch.Tensor,
    weights: torch.Tensor,
    context_lens: torch.Tensor,
    block_table: torch.Tensor,
    max_model_len: int,
    *,
    out: torch.Tensor | None = None,
    compute_dtype: torch.dtype = torch.float32,
    rows: torch.Tensor | None = None,
) -> torch.Tensor:
    """Reference of :func:`triton_mla_sparse.indexer.paged_mqa_logits` (float32 result).

    Row ``b * next_n + j`` covers positions ``p < len`` (:func:`indexer_row_lengths`); position
    ``p`` is slot ``p % block_size`` of block ``block_table[b, p // block_size]``. Positions past the
    length, past the table, or whose table entry lies outside ``[0, num_blocks)`` are not written
    (-inf without ``out``). ``rows`` (optional int64 ``[n]``) restricts the computation to those
    logits rows and returns ``[n, max_model_len]`` (bench samples of big shapes).
    """
    from .kv_format import indexer_cache_blocks

    B, next_n, H, D = q.shape
    nb = kv_cache.shape[0]
    block_size = kv_cache.shape[1] if kv_cache.dim() == 4 else kv_cache.shape[1] // (D + 4)
    blocks = indexer_cache_blocks(kv_cache.view(torch.uint8))  # [nb, block_size * (D + 4)]
    lens = indexer_row_lengths(context_lens, next_n, max_model_len)
    row_ids = torch.arange(B * next_n, device=q.device) if rows is None else rows.to(q.device)
    qf = _as_float(q, compute_dtype).reshape(B * next_n, H, D)
    w = weights.to(compute_dtype)
    res = torch.zeros(len(row_ids), max_model_len, dtype=compute_dtype, device=q.device)
    written = torch.zeros(len(row_ids), max_model_len, dtype=torch.bool, device=q.device)
    pos = torch.arange(max_model_len, device=q.device)
    max_blocks = block_table.shape[1]
    for i, r in enumerate(row_ids.tolist()):
        n = int(lens[r])
        if n == 0:
            continue
        p = pos[:n]
        page = p // block_size
        ok = page < max_blocks
        phys = torch.full_like(p, -1)
        phys[ok] = block_table[r // next_n, page[ok]].long()
        ok &= (phys >= 0) & (phys < nb)
        phys, slot = phys[ok], (p % block_size)[ok]
        # decode only the blocks this row reads (a long-context cache would not fit as floats)
        used, inv = torch.unique(phys, return_inverse=True)
        raw = blocks[used]
        vals = raw[:, : block_size * D].reshape(-1, block_size, D).contiguous()
        vals = vals.view(torch.float8_e4m3fn).to(compute_dtype)
        scl = raw[:, block_size * D : block_size * (D + 4)].contiguous().view(torch.float32)
        k = vals[inv, slot]  # [n_ok, D]
        s = torch.relu(k @ qf[r].T)  # [n_ok, H]
        res[i, p[ok]] = (s @ w[r]) * scl[inv, slot].to(compute_dtype)
        written[i, p[ok]] = True
    return _finish(res, written, out)


def mqa_logits_reference(
    q: torch.Tensor,
    k: torch.Tensor,
    k_scale: torch.Tensor,
    weights: torch.Tensor,
    cu_seqlen_ks: torch.Tensor,
    cu_seqlen_ke: torch.Tensor,
    max_seqlen_k: int,
    *,
    out: torch.Tensor | None = None,
    compute_dtype: torch.dtype = torch.float32,
    rows: torch.Tensor | None = None,
) -> torch.Tensor:
    """Reference of :func:`triton_mla_sparse.indexer.mqa_logits` (float32, compressed columns).

    Row ``m``, column ``j`` is K row ``cu_seqlen_ks[m] + j`` for ``j < min(ke - ks, max_seqlen_k)``;
    columns past that, or whose K row lies outside ``[0, N)``, are not written (-inf without
    ``out``). ``rows`` restricts the computation to those rows (returns ``[n, max_seqlen_k]``).
    """
    M, H, D = q.shape
    N = k.shape[0]
    kf = _as_float(k, compute_dtype)
    sc = k_scale.view(torch.float32).reshape(N).to(compute_dtype)
    qf = _as_float(q, compute_dtype)
    w = weights.to(compute_dtype)
    ks, ke = cu_seqlen_ks.long(), cu_seqlen_ke.long()
    row_ids = torch.arange(M, device=q.device) if rows is None else rows.to(q.device)
    res = torch.zeros(len(row_ids), max_seqlen_k, dtype=compute_dtype, device=q.device)
    written = torch.zeros(len(row_ids), max_seqlen_k, dtype=torch.bool, device=q.device)
    col = torch.arange(max_seqlen_k, device=q.device)
    for i, m in enumerate(row_ids.tolist()):
        n = int((ke[m] - ks[m]).clamp(0, max_seqlen_k))
        kr = ks[m] + col[:n]
        ok = (kr >= 0) & (kr < N)
        kk = kr[ok]
        s = torch.relu(kf[kk] @ qf[m].T)  # [n_ok, H]
        res[i, col[:n][ok]] = (s @ w[m]) * sc[kk]
        written[i, col[:n][ok]] = True
    return _finish(res, written, out)


def rope_reference(
    x: torch.Tensor, cos_sin_cache: torch.Tensor, positions: torch.Tensor, interleave: bool
) -> torch.Tensor:
    """float64 RoPE of the first ``rot = cos_sin_cache.shape[1]`` dims of ``x [T, H, D]`` (the rest
    unchanged), as vLLM applies it: ``cos_sin_cache [max_pos, rot]`` holds ``rot / 2`` cosines then
    ``rot / 2`` sines per position; ``interleave`` rotates pairs (2i, 2i+1) (the MLA rope), else
    the halves (i, i + rot/2) (NeoX, the index q's default)."""
    x = x.double().clone()
    rot = cos_sin_cache.shape[1]
    half = rot // 2
    cs = cos_sin_cache[positions.long()].double()
    cos, sin = cs[:, None, :half], cs[:, None, half:]
    if interleave:
        a, b = x[..., 0:rot:2].clone(), x[..., 1:rot:2].clone()
        x[..., 0:rot:2], x[..., 1:rot:2] = a * cos - b * sin, b * cos + a * sin
    else:
        a, b = x[..., :half].clone(), x[..., half:rot].clone()
        x[..., :half], x[..., half:rot] = a * cos - b * sin, b * cos + a * sin
    return x
