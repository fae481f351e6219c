"""Measurement of the DSA lightning-indexer logits (``triton-mla-sparse bench --indexer``).

Paged decode logits, prefill logits (a 4096-row chunk) and one DSA decode layer
(logits -> ``torch.topk`` -> sparse_mla). Each shape is checked against the reference first (on a
sample of rows for big shapes), then timed: decode from CUDA-graph replays, prefill with events.
Inputs come from :mod:`.workloads`, pass/fail and timing from :mod:`.testing`; the command
itself (options, table, JSON, CSV) is cli/bench_indexer.py.

Costs: bytes = 132 per context token read (once per request) + 4 per logit written; FLOPs =
2 * H * 128 per (row, position). The floor is bytes / measured copy bandwidth; prefill also
reports the fraction of a bf16 matmul ceiling measured in the same run.
"""

from __future__ import annotations

import dataclasses

import torch

from .kv_format import INDEXER_HEAD_DIM, INDEXER_ROW_BYTES
from .ops.indexer.heuristics import IndexerConfig
from .testing import (
    Ceilings,
    compare_sparse_mla,
    indexer_logits_tolerance,
    logits_row_error,
    reference_dtype,
    time_events,
    time_graph,
)
from .workloads import (
    DSV32_SOFTMAX_SCALE,
    PAGE,
    dsa_layer_inputs,
    indexer_paged_inputs,
    indexer_prefill_inputs,
)

D = INDEXER_HEAD_DIM
CHECK_ROWS = 8  # rows checked against the reference per shape (all rows when fewer)

DEFAULT_DECODE = dict(rows=(1, 32, 128), ctx=(8192, 32768, 131072), heads=(32, 64), next_n=(1, 2))
FULL_DECODE = dict(
    rows=(1, 2, 4, 8, 16, 32, 64, 128),
    ctx=(8192, 16384, 32768, 65536, 131072),
    heads=(32, 64),
    next_n=(1, 2),
)
PREFILL_ROWS = 4096
PREFILL_HEADS = (32, 64)
DEFAULT_PREFILL_CTX = (8192, 32768)
FULL_PREFILL_CTX = (4096, 8192, 16384, 32768)
# The DSA decode layer of DeepSeek-V3.2 at TP8: 64 index heads choose the top 2048 of the
# context for 16 attention heads.
LAYER_INDEX_HEADS, LAYER_HEADS, LAYER_TOPK = 64, 16, 2048
LAYER_FORMATS = ("auto", "fp8", "fp8_ds_mla")


@dataclasses.dataclass
class IndexerResult:
    kind: str  # "decode", "prefill", "layer"
    case: str
    decode: str  # "native" / "integer" e4m3 decode, or the layer's cache format
    config: str
    err: float | None
    passed: bool
    us: float | None = None
    gbps: float | None = None
    tflops: float | None = None
    floor_us: float | None = None
    ratio: float | None = None
    pct_matmul: float | None = None


def sample_rows(n: int) -> torch.Tensor:
    """The rows checked against the reference: all of ``n``, or CHECK_ROWS evenly spread."""
    if n <= CHECK_ROWS:
        return torch.arange(n)
    return torch.linspace(0, n - 1, CHECK_ROWS).round().long()


def label(cfg: IndexerConfig) -> str:
    """``r2 n64 c512 w4 s3``: rows, K tokens per step, chunk, warps, stages; ``+int`` the
    integer e4m3 decode, ``-f8mma`` fp16 MMAs instead of e4m3 ones."""
    s = f"r{cfg.rows} n{cfg.block_n} c{cfg.chunk} w{cfg.num_warps} s{cfg.num_stages}"
    return (
        s
        + (" +int" if cfg.fp8_native is False else "")
        + (" -f8mma" if cfg.fp8_mma is False else "")
    )


def _cost(rows_total: int, heads: int, positions: int, read_tokens: int) -> tuple[float, float]:
    """(bytes, FLOPs): ``positions`` logits over ``rows_total`` rows' worth of (row, position)."""
    return float(INDEXER_ROW_BYTES) * read_tokens + 4.0 * positions, 2.0 * heads * D * positions


def bench_decode(
    batch: int,
    next_n: int,
    heads: int,
    ctx: int,
    native: bool,
    device: torch.device,
    ceil: Ceilings | None,
    config: IndexerConfig | None = None,
) -> IndexerResult:
    """Paged decode logits of ``batch`` requests x ``next_n`` rows over ``ctx`` tokens: checked,
    then (on a GPU, if it passed) timed from CUDA-graph replays; ``native`` False forces the
    integer e4m3 decode."""
    from .indexer import paged_mqa_logits
    from .ops.indexer.heuristics import arch_of, choose_paged_config
    from .reference import paged_mqa_logits_reference

    args = indexer_paged_inputs(batch, next_n, heads, ctx, device)
    q = args[0]
    cfg = config or choose_paged_config(batch, next_n, heads, q.dtype, arch_of(device))
    if not native:
        cfg = dataclasses.replace(cfg, fp8_native=False)
    out = torch.full((batch * next_n, ctx), float("nan"), device=device)
    paged_mqa_logits(*args, out=out, config=cfg)
    rows = sample_rows(batch * next_n)
    ref = paged_mqa_logits_reference(*args, rows=rows)
    err = logits_row_error(out[rows.to(device)], ref)
    name = f"B={batch} ctx={ctx // 1024}K H={heads} next_n={next_n}"
    passed = err <= indexer_logits_tolerance(device)
    res = IndexerResult("decode", name, "native" if native else "integer", label(cfg), err, passed)
    if not res.passed or device.type != "cuda":
        return res
    res.us = time_graph(lambda: paged_mqa_logits(*args, out=out, config=cfg))
    nbytes, flops = _cost(batch * next_n, heads, batch * next_n * ctx, batch * ctx)
    _rates(res, nbytes, flops, ceil)
    return res


def bench_prefill(
    ctx: int,
    heads: int,
    native: bool,
    device: torch.device,
    ceil: Ceilings | None,
    config: IndexerConfig | None = None,
) -> IndexerResult:
    """Prefill logits of the last PREFILL_ROWS tokens (at most ``ctx``) of a ``ctx``-token
    prompt: checked, then (on a GPU, if it passed) timed with device events."""
    from .indexer import mqa_logits
    from .ops.indexer.heuristics import arch_of, choose_mqa_config
    from .reference import mqa_logits_reference

    rows_n = min(PREFILL_ROWS, ctx)
    args = indexer_prefill_inputs(rows_n, ctx, heads, device)
    q = args[0]
    cfg = config or choose_mqa_config(rows_n, ctx, heads, q.dtype, arch_of(device))
    if not native:
        cfg = dataclasses.replace(cfg, fp8_native=False)
    out = torch.full((rows_n, ctx), float("nan"), device=device)
    mqa_logits(*args, out=out, config=cfg)
    rows = sample_rows(rows_n)
    ref = mqa_logits_reference(*args, rows=rows)
    err = logits_row_error(out[rows.to(device)], ref)
    name = f"M={rows_n} ctx={ctx // 1024}K H={heads}"
    passed = err <= indexer_logits_tolerance(device)
    res = IndexerResult("prefill", name, "native" if native else "integer", label(cfg), err, passed)
    if not res.passed or device.type != "cuda":
        return res
    res.us = time_events(lambda: mqa_logits(*args, out=out, config=cfg))
    positions = int((args[5] - args[4]).sum().item())
    nbytes, flops = _cost(rows_n, heads, positions, ctx)
    _rates(res, nbytes, flops, ceil)
    if ceil is not None:
        res.pct_matmul = 100.0 * res.tflops / ceil.matmul_tflops
    return res


def _rates(res: IndexerResult, nbytes: float, flops: float, ceil: Ceilings | None) -> None:
    res.gbps = nbytes / res.us / 1e3
    res.tflops = flops / res.us / 1e6
    if ceil is not None:
        res.floor_us = nbytes / ceil.copy_gbps / 1e3
        res.ratio = res.us / res.floor_us


def bench_layer(
    kv_format: str,
    device: torch.device,
    ceil: Ceilings | None,
    batch: int = 64,
    ctx: int = 32768,
    topk: int = LAYER_TOPK,
    dtype: torch.dtype = torch.bfloat16,
) -> list[IndexerResult]:
    """One DSA decode layer: 64 index heads -> top-2048 -> sparse_mla over 16 attention heads,
    the attention cache in ``kv_format`` (one of :data:`LAYER_FORMATS`)."""
    from . import sparse_mla
    from .indexer import paged_mqa_logits
    from .kv_format import bytes_per_row
    from .reference import paged_mqa_logits_reference, sparse_mla_reference

    heads, index_heads, width = LAYER_HEADS, LAYER_INDEX_HEADS, 576
    args = indexer_paged_inputs(batch, 1, index_heads, ctx, device, seed=1)
    block_table = args[4]
    q, kv, fmt_kw = dsa_layer_inputs(kv_format, block_table.numel(), batch, heads, dtype, device)
    req_ids = torch.arange(batch, dtype=torch.int32, device=device)
    logits = torch.empty(batch, ctx, device=device)
    out = torch.empty(batch, heads, 512, dtype=dtype, device=device)
    idx = torch.empty(batch, topk, dtype=torch.int32, device=device)
    mla_kw = dict(block_table=block_table, req_ids=req_ids, block_size=PAGE, **fmt_kw)
    scale = DSV32_SOFTMAX_SCALE

    def f_logits():
        paged_mqa_logits(*args, out=logits)

    def f_topk():
        idx.copy_(torch.topk(logits, topk, dim=-1).indices)

    def f_mla():
        sparse_mla(q, kv, idx, scale, out=out, **mla_kw)

    def f_layer():
        f_logits()
        f_topk()
        f_mla()

    f_layer()
    rows = sample_rows(batch)
    l_err = logits_row_error(logits[rows.to(device)], paged_mqa_logits_reference(*args, rows=rows))
    ref = sparse_mla_reference(q, kv, idx, scale, compute_dtype=reference_dtype(dtype), **mla_kw)
    check = compare_sparse_mla(out, ref)
    err = check.err
    passed = check.passed and l_err <= indexer_logits_tolerance(device)
    res = []
    row = bytes_per_row(kv_format, width, dtype)
    costs = {
        "logits": _cost(batch, index_heads, batch * ctx, batch * ctx),
        # read the logits, write int64 indices and values, then the int32 copy
        "topk": (4.0 * batch * ctx + (8 + 4 + 8 + 4) * batch * topk, 0.0),
        "sparse_mla": (
            batch * topk * row + 2 * batch * heads * (width + 512),
            2.0 * heads * batch * topk * (width + 512),
        ),
    }
    costs["layer"] = tuple(sum(c[i] for c in costs.values()) for i in range(2))
    parts = (("logits", f_logits), ("topk", f_topk), ("sparse_mla", f_mla), ("layer", f_layer))
    for part, fn in parts:
        # "layer": all three in one graph, its floor the sum of the parts' floors
        name = f"{part} B={batch} ctx={ctx // 1024}K" + (" (all 3)" if part == "layer" else "")
        # logits: their error (sampled rows); the others: sparse_mla's on the chosen indices
        r = IndexerResult("layer", name, kv_format, "-", l_err if part == "logits" else err, passed)
        if passed and device.type == "cuda":
            r.us = time_graph(fn)
            _rates(r, *costs[part], ceil)
        res.append(r)
    return res
