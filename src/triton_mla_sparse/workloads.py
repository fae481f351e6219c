"""Synthetic DSA workloads shared by ``verify``, ``bench`` (``--indexer`` too) and the tuning
scripts.

sparse_mla: a cache of latent rows (paged, 64-row blocks), per-token top-k lists of distinct
random rows, and queries (:class:`Case`, :func:`make_inputs`). Shapes follow DeepSeek-V3.2 /
GLM-5: 512 latent + 64 rope. A case may add a second index set into a second cache in the same
softmax (``extra_topk``), and take its main set as each token's sliding window (``window``):
DeepSeek-V4's decode, with its 584-byte record (``kv_format="fp8_ds_mla_v4"``, rope 0: q and
value 512 wide), is :func:`deepseek_v4_case`. The DSA indexer: a scrambled paged e4m3 K cache
with e4m3 q (:func:`indexer_paged_inputs`, decode), one prompt's chunk
(:func:`indexer_prefill_inputs`), and the attention inputs of one DSA decode layer
(:func:`dsa_layer_inputs`).
"""

from __future__ import annotations

import dataclasses
import functools

import torch

from .kv_format import (
    INDEXER_BLOCK_SIZE,
    INDEXER_HEAD_DIM,
    INDEXER_ROW_BYTES,
    pack_fp8_ds_mla,
    pack_fp8_ds_mla_v4,
    quantize_fp8,
)

# vLLM's KV-cache block size for the DSA models: the MLA cache and the indexer's K cache share
# it (kv_format.INDEXER_BLOCK_SIZE), so the synthetic caches are paged the same way.
PAGE = INDEXER_BLOCK_SIZE
# DeepSeek-V3.2's softmax scale: 1/sqrt of its qk head dim (128 NoPE + 64 RoPE), not of the
# 576-wide latent q the kernel sees.
DSV32_SOFTMAX_SCALE = 192**-0.5


@dataclasses.dataclass(frozen=True)
class Case:
    name: str
    tokens: int
    heads: int
    topk: int = 2048
    rows: int = 131072
    kv_format: str = "auto"
    dtype: torch.dtype = torch.bfloat16
    rope: int = 64
    holes: bool = False  # -1 padding: a leading run on token 0, tail padding elsewhere
    counts: bool = False  # pass valid_counts (garbage past the count)
    sink: bool = False  # a per-head attention sink (HY V4, DeepSeek-V4)
    # a second index set of this width into a second cache of extra_rows rows (its own paged
    # cache, in kv_format), in the same softmax; 0: none
    extra_topk: int = 0
    extra_rows: int = 0
    window: bool = False  # the main set is each token's sliding window (DeepSeek-V4's SWA set)

    @property
    def decode(self) -> bool:
        return self.tokens <= 128


@dataclasses.dataclass
class Inputs:
    q: torch.Tensor
    kv_cache: torch.Tensor
    indices: torch.Tensor
    kwargs: dict
    scale: float


def distinct_topk(tokens: int, rows: int, topk: int, device: torch.device, gen: torch.Generator):
    """[tokens, topk] int32: per token, topk distinct rows drawn uniformly from [0, rows)."""
    out = torch.empty(tokens, topk, dtype=torch.int32, device=device)
    chunk = max(1, (1 << 24) // rows)
    for t0 in range(0, tokens, chunk):
        n = min(chunk, tokens - t0)
        keys = torch.rand(n, rows, device=device, generator=gen)
        out[t0 : t0 + n] = keys.topk(topk, dim=1).indices.to(torch.int32)
    return out


def make_inputs(case: Case, device: torch.device, seed: int = 0) -> Inputs:
    gen = torch.Generator(device=device).manual_seed(seed)
    width = 512 + case.rope
    rows = -(-case.rows // PAGE) * PAGE
    q = torch.randn(case.tokens, case.heads, width, device=device, generator=gen).to(case.dtype)
    base = torch.randn(rows, width, device=device, generator=gen)
    kwargs: dict = {"kv_format": case.kv_format}
    kv = _cache(case, base, kwargs)
    if case.window:
        idx = sliding_windows(case.tokens, rows, case.topk, device, gen, short_first=case.holes)
    else:
        idx = distinct_topk(case.tokens, rows, min(case.topk, rows), device, gen)
    if case.holes and not case.window:  # (a window's holes: its first token's short window)
        idx[0, : min(case.topk, 300)] = -1  # a leading run longer than several gather steps
        idx[1:, -37:] = -1
        idx[-1, 5] = rows + 7  # past the cache: skipped
    if case.counts and case.window:
        # the window's length (DeepSeek-V4 passes it as the SWA set's topk_length)
        kwargs["valid_counts"] = (idx >= 0).sum(dim=1, dtype=torch.int32)
    elif case.counts:
        counts = torch.randint(
            0, case.topk + 1, (case.tokens,), device=device, generator=gen, dtype=torch.int32
        )
        counts[0] = case.topk
        kwargs["valid_counts"] = counts
    if case.sink:
        # around the logits' own scale (|s| of a few units), so that it moves the output
        kwargs["attn_sink"] = torch.randn(case.heads, device=device, generator=gen) * 2.0
    if case.extra_topk:
        kwargs.update(_extra_set(case, width, device, gen, kwargs))
    return Inputs(q, kv, idx, kwargs, scale=width**-0.5)


EXTRA_TAIL_HOLES = 37  # -1 entries closing each extra list after the first with holes


def _extra_set(
    case: Case, width: int, device: torch.device, gen: torch.Generator, main_kwargs: dict
) -> dict:
    """The extra set's keyword arguments: a cache of ``extra_rows`` rows (``PAGE``-row pages, the
    case's format, the main cache's k_scale), per token ``extra_topk`` distinct rows. With
    holes, token 0 has none (-1) and the others end in a run of -1. With counts, a window case
    (DeepSeek-V4) passes each list's valid entries as its count, as vLLM does; otherwise counts
    stop short of the lists, whose entries past them are valid rows that must not be read."""
    rows = -(-(case.extra_rows or case.rows) // PAGE) * PAGE
    topk = min(case.extra_topk, rows)
    base = torch.randn(rows, width, device=device, generator=gen)
    cache = _cache(case, base, dict(main_kwargs))
    idx = distinct_topk(case.tokens, rows, topk, device, gen)
    if case.holes:
        idx[0] = -1
        idx[1:, -min(EXTRA_TAIL_HOLES, topk - 1) :] = -1
    kw = {"extra_kv_cache": cache, "extra_indices": idx}
    if case.counts and case.window:
        kw["extra_valid_counts"] = (idx >= 0).sum(dim=1, dtype=torch.int32)
    elif case.counts:
        kw["extra_valid_counts"] = torch.randint(
            1, topk + 1, (case.tokens,), device=device, generator=gen, dtype=torch.int32
        )
    return kw


def deepseek_v4_case(
    tokens: int,
    heads: int = 64,
    *,
    window: int = 128,
    topk: int = 512,
    rows: int = 131072,
    dtype: torch.dtype = torch.bfloat16,
    holes: bool = False,
    name: str | None = None,
) -> Case:
    """DeepSeek-V4's decode as vLLM 0.33 makes it: both caches in the 584-byte record (64-token
    pages), the sliding-window set (``window`` rows up to the token's position, the window's
    length as its count) as the main set, the compressed cache's top-k (``topk`` distinct rows,
    the number of valid entries as its count) as the extra set, and the attention sink; q and
    the output 512 wide, ``heads`` query heads."""
    return Case(
        name or f"DeepSeek-V4 decode T={tokens} H={heads}",
        tokens,
        heads,
        topk=window,
        rows=rows,
        kv_format="fp8_ds_mla_v4",
        dtype=dtype,
        rope=0,
        holes=holes,
        counts=True,
        sink=True,
        extra_topk=topk,
        extra_rows=rows,
        window=True,
    )


def _cache(case: Case, base: torch.Tensor, kwargs: dict) -> torch.Tensor:
    """``base`` rows [rows, width] as a paged cache of ``PAGE``-row pages in the case's format (a
    per-tensor fp8 cache's k_scale goes into ``kwargs``)."""
    if case.kv_format == "fp8_ds_mla_v4":
        return pack_fp8_ds_mla_v4(base, PAGE)  # vLLM's pages, padded page stride
    if case.kv_format == "fp8_ds_mla":
        full = base if case.rope else torch.cat([base, torch.zeros_like(base[:, :64])], dim=1)
        kv = pack_fp8_ds_mla(full, "fp32")
    elif case.kv_format == "fp8":
        kv, k_scale = quantize_fp8(base, kwargs.get("k_scale"))  # one scale for both caches
        kwargs["k_scale"] = k_scale
    else:
        kv = base.to(case.dtype)
    return kv.view(-1, PAGE, kv.shape[-1])


def sliding_windows(
    tokens: int,
    rows: int,
    window: int,
    device: torch.device,
    gen: torch.Generator,
    *,
    short_first: bool = False,
) -> torch.Tensor:
    """[tokens, window] int32: per token at a random position p, the rows p - window + 1 .. p in
    order, -1 in place of those below 0 (valid entries first: DeepSeek-V4's SWA indices).
    Positions are drawn from [window - 1, rows) (full windows), except with ``short_first`` the
    first token's, which is window // 3 (a window that has not filled yet)."""
    if rows < window:
        raise ValueError(f"a window of {window} rows needs a cache of at least as many, got {rows}")
    pos = torch.randint(window - 1, rows, (tokens, 1), device=device, generator=gen)
    if short_first:
        pos[0] = window // 3
    rows_ = (pos - window + 1).clamp_min(0) + torch.arange(window, device=device)[None, :]
    return torch.where(rows_ <= pos, rows_, -1).to(torch.int32)


def verify_cases(on_gpu: bool) -> list[Case]:
    """The embedded default workload of ``triton-mla-sparse verify``."""
    if on_gpu:
        return [
            Case("GLM-5 decode, 8 heads", 64, 8, holes=True),
            Case("DeepSeek-V3.2 decode, 16 heads", 128, 16, holes=True, counts=True),
            Case("DeepSeek-V3.2 decode, 128 heads", 32, 128, holes=True),
            Case("prefill chunk, 64 heads", 1024, 64, rows=65536, holes=True),
            Case("GLM-5 decode, fp8_ds_mla", 64, 8, kv_format="fp8_ds_mla", holes=True),
            Case("DSV3.2 decode, fp8_ds_mla", 64, 128, kv_format="fp8_ds_mla", holes=True),
            Case("decode, fp8 per-tensor", 64, 16, kv_format="fp8", holes=True),
            Case("NoPE decode, 16 heads", 32, 16, rope=0, holes=True),
            Case("decode with attention sink, 16 heads", 64, 16, holes=True, sink=True),
            Case(
                "decode with an extra index set, 16 heads",
                64,
                16,
                holes=True,
                counts=True,
                extra_topk=512,
                extra_rows=65536,
            ),
            deepseek_v4_case(64, 64, holes=True, name="DeepSeek-V4 decode, V4 record + sink"),
        ]
    small = dict(topk=400, rows=4096, dtype=torch.float16)
    return [
        Case("GLM-5 decode, 8 heads (reduced)", 2, 8, holes=True, **small),
        Case("DeepSeek-V3.2 decode, 16 heads (reduced)", 3, 16, holes=True, counts=True, **small),
        Case("prefill chunk, 64 heads (reduced)", 4, 64, holes=True, **small),
        Case("fp8_ds_mla decode (reduced)", 2, 16, kv_format="fp8_ds_mla", holes=True, **small),
        Case("fp8 per-tensor decode (reduced)", 2, 8, kv_format="fp8", holes=True, **small),
        Case("decode with attention sink (reduced)", 2, 16, holes=True, sink=True, **small),
        Case(
            "decode with an extra index set (reduced)",
            2,
            16,
            holes=True,
            counts=True,
            extra_topk=100,
            extra_rows=2048,
            **small,
        ),
        # DeepSeek-V4's widths and heads (128-row window + compressed top-k 512, 64 heads) on a
        # small cache: the interpreter's cost is in the heads and widths, not the cache
        deepseek_v4_case(
            2,
            64,
            rows=small["rows"],
            dtype=small["dtype"],
            holes=True,
            name="DeepSeek-V4 decode, V4 record + sink (reduced)",
        ),
    ]


# --- the DSA indexer --------------------------------------------------------------------------

E4M3_NAN_MASK = 0x7F  # (byte & 0x7F) == 0x7F is an e4m3 NaN


def random_e4m3(shape: tuple[int, ...], device: torch.device, gen: torch.Generator) -> torch.Tensor:
    """Random e4m3 bytes over the whole finite range (NaN codes replaced by 0)."""
    b = torch.randint(0, 256, shape, dtype=torch.uint8, device=device, generator=gen)
    return torch.where((b & E4M3_NAN_MASK) == E4M3_NAN_MASK, torch.zeros_like(b), b)


@functools.lru_cache(maxsize=1)  # configuration sweeps reuse one shape's inputs (never modified)
def indexer_paged_inputs(
    batch: int, next_n: int, heads: int, ctx: int, device: torch.device, seed: int = 0
) -> tuple:
    """``paged_mqa_logits``' arguments ``(q, kv_cache, weights, context_lens, block_table,
    max_model_len)``: a scrambled paged indexer cache holding ``ctx`` tokens per request, e4m3
    q, weights with q's scale folded in, context_lens ``[B]`` (every request at ``ctx``)."""
    page, d = INDEXER_BLOCK_SIZE, INDEXER_HEAD_DIM
    gen = torch.Generator(device=device).manual_seed(seed)
    pages = -(-ctx // page)
    nb = batch * pages
    cache = torch.empty(nb, page * INDEXER_ROW_BYTES, dtype=torch.uint8, device=device)
    for b0 in range(0, nb, 4096):  # bounded temporaries
        blk = cache[b0 : b0 + 4096]
        blk[:, : page * d] = random_e4m3((blk.shape[0], page * d), device, gen)
        sc = torch.exp2(torch.randint(-12, -6, (blk.shape[0], page), device=device, generator=gen))
        blk[:, page * d :] = sc.float().view(torch.uint8)
    perm = torch.randperm(nb, device=device, generator=gen).to(torch.int32)
    block_table = perm.view(batch, pages)
    q = random_e4m3((batch, next_n, heads, d), device, gen).view(torch.float8_e4m3fn)
    weights = torch.randn(batch * next_n, heads, device=device, generator=gen) * 2.0**-10
    context_lens = torch.full((batch,), ctx, dtype=torch.int32, device=device)
    return q, cache.view(nb, page, 1, INDEXER_ROW_BYTES), weights, context_lens, block_table, ctx


@functools.lru_cache(maxsize=1)
def indexer_prefill_inputs(
    rows: int, ctx: int, heads: int, device: torch.device, seed: int = 0
) -> tuple:
    """``mqa_logits``' arguments ``(q, k, k_scale, weights, ks, ke, max_seqlen_k)``: one
    request's chunk, the last ``rows`` tokens of a ``ctx``-token prompt (causal ks/ke)."""
    d = INDEXER_HEAD_DIM
    gen = torch.Generator(device=device).manual_seed(seed)
    k = random_e4m3((ctx, d), device, gen).view(torch.float8_e4m3fn)
    k_scale = torch.exp2(torch.randint(-12, -6, (ctx,), device=device, generator=gen)).float()
    q = random_e4m3((rows, heads, d), device, gen).view(torch.float8_e4m3fn)
    weights = torch.randn(rows, heads, device=device, generator=gen) * 2.0**-10
    ks = torch.zeros(rows, dtype=torch.int32, device=device)
    ke = (ctx - rows + 1 + torch.arange(rows, device=device)).to(torch.int32)
    return q, k, k_scale, weights, ks, ke, ctx


# Per-tensor scale of a DSA layer's fp8 cache: randn rows reach |x| ~6, inside 448 * 2^-6 = 7.
DSA_LAYER_FP8_SCALE = 2.0**-6


def dsa_layer_inputs(
    kv_format: str,
    num_blocks: int,
    batch: int,
    heads: int,
    dtype: torch.dtype,
    device: torch.device,
    seed: int = 2,
) -> tuple[torch.Tensor, torch.Tensor, dict]:
    """The attention side of one DSA decode layer: ``(q [batch, heads, 576], paged MLA cache
    [num_blocks, PAGE, C] in ``kv_format``, the format's sparse_mla keyword arguments)``."""
    width = 512 + 64
    gen = torch.Generator(device=device).manual_seed(seed)
    kw: dict = {"kv_format": kv_format}
    if kv_format == "fp8_ds_mla":
        kv = torch.empty(num_blocks, PAGE, 656, dtype=torch.uint8, device=device)
        for b0 in range(0, num_blocks, 2048):  # bounded temporaries
            n = min(2048, num_blocks - b0)
            rows = torch.randn(n, PAGE, width, device=device, generator=gen)
            kv[b0 : b0 + n] = pack_fp8_ds_mla(rows)
    elif kv_format == "fp8":
        kv = torch.empty(num_blocks, PAGE, width, dtype=torch.uint8, device=device)
        for b0 in range(0, num_blocks, 2048):
            n = min(2048, num_blocks - b0)
            rows = torch.randn(n, PAGE, width, device=device, generator=gen)
            kv[b0 : b0 + n] = quantize_fp8(rows, DSA_LAYER_FP8_SCALE)[0].view(torch.uint8)
        kw["k_scale"] = DSA_LAYER_FP8_SCALE
    elif kv_format == "auto":
        kv = torch.randn(num_blocks, PAGE, width, device=device, generator=gen).to(dtype)
    else:
        raise ValueError(f"kv_format must be auto, fp8 or fp8_ds_mla, got {kv_format!r}")
    q = torch.randn(batch, heads, width, device=device, generator=gen).to(dtype)
    return q, kv, kw
