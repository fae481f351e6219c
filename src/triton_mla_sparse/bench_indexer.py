"""``triton-mla-sparse bench --indexer``: check, then time the DSA lightning-indexer logits.

Paged decode logits, prefill logits (a 4096-row chunk) and one DSA decode layer
(logits -> ``torch.topk`` -> sparse_mla). Each shape is checked against the reference first (on a
sample of rows for big shapes), then timed: decode from CUDA-graph replays, prefill with events.

Costs: bytes = 132 per context token read (once per request) + 4 per logit written; FLOPs =
2 * H * 128 per (row, position). The floor is bytes / measured copy bandwidth; prefill also
reports the fraction of a bf16 matmul ceiling measured in the same run.
"""

from __future__ import annotations

import dataclasses
import functools
import itertools

import torch

from .kv_format import INDEXER_BLOCK_SIZE, INDEXER_HEAD_DIM, INDEXER_ROW_BYTES
from .testing import (
    Ceilings,
    compare_sparse_mla,
    indexer_logits_tolerance,
    logits_row_error,
    measure_ceilings,
    reference_dtype,
    time_events,
    time_graph,
)

PAGE, D = INDEXER_BLOCK_SIZE, INDEXER_HEAD_DIM
E4M3_NAN_MASK = 0x7F  # (byte & 0x7F) == 0x7F is an e4m3 NaN
CHECK_ROWS = 8  # rows checked against the reference per shape (all rows when fewer)

DEFAULT_DECODE = dict(rows=(1, 32, 128), ctx=(8192, 32768, 131072), heads=(32, 64), next_n=(1, 2))
FULL_DECODE = dict(
    rows=(1, 2, 4, 8, 16, 32, 64, 128),
    ctx=(8192, 16384, 32768, 65536, 131072),
    heads=(32, 64),
    next_n=(1, 2),
)
PREFILL_ROWS = 4096
LAYER: dict = {}  # bench_layer keyword overrides (a CPU dry run shrinks it)
DEFAULT_PREFILL_CTX = (8192, 32768)
FULL_PREFILL_CTX = (4096, 8192, 16384, 32768)


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


def random_e4m3(shape, device, gen) -> torch.Tensor:
    """Random e4m3 bytes over the whole finite range (NaN codes replaced by 0)."""
    b = torch.randint(0, 256, shape, dtype=torch.uint8, device=device, generator=gen)
    return torch.where((b & E4M3_NAN_MASK) == E4M3_NAN_MASK, torch.zeros_like(b), b)


@functools.lru_cache(maxsize=1)  # configuration sweeps reuse one shape's inputs (never modified)
def make_paged(batch: int, next_n: int, heads: int, ctx: int, device, seed: int = 0):
    """A scrambled paged indexer cache holding ``ctx`` tokens per request, e4m3 q, weights with
    q's scale folded in, context_lens ``[B]`` (every request at ``ctx``)."""
    gen = torch.Generator(device=device).manual_seed(seed)
    pages = -(-ctx // PAGE)
    nb = batch * pages
    cache = torch.empty(nb, PAGE * INDEXER_ROW_BYTES, dtype=torch.uint8, device=device)
    for b0 in range(0, nb, 4096):  # bounded temporaries
        blk = cache[b0 : b0 + 4096]
        blk[:, : PAGE * D] = random_e4m3((blk.shape[0], PAGE * D), device, gen)
        sc = torch.exp2(torch.randint(-12, -6, (blk.shape[0], PAGE), device=device, generator=gen))
        blk[:, PAGE * D :] = sc.float().view(torch.uint8)
    perm = torch.randperm(nb, device=device, generator=gen).to(torch.int32)
    block_table = perm.view(batch, pages)
    q = random_e4m3((batch, next_n, heads, D), device, gen).view(torch.float8_e4m3fn)
    weights = torch.randn(batch * next_n, heads, device=device, generator=gen) * 2.0**-10
    context_lens = torch.full((batch,), ctx, dtype=torch.int32, device=device)
    return q, cache.view(nb, PAGE, 1, INDEXER_ROW_BYTES), weights, context_lens, block_table, ctx


@functools.lru_cache(maxsize=1)
def make_prefill(rows: int, ctx: int, heads: int, device, seed: int = 0):
    """One request's chunk: the last ``rows`` tokens of a ``ctx``-token prompt (causal ks/ke)."""
    gen = torch.Generator(device=device).manual_seed(seed)
    k = random_e4m3((ctx, D), device, gen).view(torch.float8_e4m3fn)
    k_scale = torch.exp2(torch.randint(-12, -6, (ctx,), device=device, generator=gen)).float()
    q = random_e4m3((rows, heads, D), device, gen).view(torch.float8_e4m3fn)
    weights = torch.randn(rows, heads, device=device, generator=gen) * 2.0**-10
    ks = torch.zeros(rows, dtype=torch.int32, device=device)
    ke = (ctx - rows + 1 + torch.arange(rows, device=device)).to(torch.int32)
    return q, k, k_scale, weights, ks, ke, ctx


def sample_rows(n: int) -> torch.Tensor:
    if n <= CHECK_ROWS:
        return torch.arange(n)
    return torch.linspace(0, n - 1, CHECK_ROWS).round().long()


def label(cfg) -> str:
    s = f"r{cfg.rows} n{cfg.block_n} c{cfg.chunk} w{cfg.num_warps} s{cfg.num_stages}"
    return (
        s
        + (" +int" if cfg.fp8_native is False else "")
        + (" -f8mma" if cfg.fp8_mma is False else "")
    )


def _cost(rows_total: int, heads: int, positions: int, read_tokens: int) -> tuple[float, float]:
    """(bytes, FLOPs): ``positions`` logits over ``rows_total`` rows' worth of (row, position)."""
    return 132.0 * read_tokens + 4.0 * positions, 2.0 * heads * D * positions


def bench_decode(batch, next_n, heads, ctx, native, device, ceil: Ceilings | None, config=None):
    from .indexer import paged_mqa_logits
    from .ops.indexer.heuristics import arch_of, choose_paged_config
    from .reference import paged_mqa_logits_reference

    args = make_paged(batch, next_n, heads, ctx, device)
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


def bench_prefill(ctx, heads, native, device, ceil: Ceilings | None, config=None):
    from .indexer import mqa_logits
    from .ops.indexer.heuristics import arch_of, choose_mqa_config
    from .reference import mqa_logits_reference

    rows_n = min(PREFILL_ROWS, ctx)
    args = make_prefill(rows_n, ctx, heads, device)
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
    device,
    ceil: Ceilings | None,
    batch: int = 64,
    ctx: int = 32768,
    topk: int = 2048,
    dtype: torch.dtype = torch.bfloat16,
):
    """One DSA decode layer: 64 index heads -> top-2048 -> sparse_mla over 16 attention heads."""
    from . import sparse_mla
    from .indexer import paged_mqa_logits
    from .kv_format import bytes_per_row, pack_fp8_ds_mla
    from .reference import sparse_mla_reference

    heads, index_heads, width = 16, 64, 576
    args = make_paged(batch, 1, index_heads, ctx, device, seed=1)
    block_table = args[4]
    nb = block_table.numel()
    gen = torch.Generator(device=device).manual_seed(2)
    if kv_format == "fp8_ds_mla":
        kv = torch.empty(nb, PAGE, 656, dtype=torch.uint8, device=device)
        for b0 in range(0, nb, 2048):
            n = min(2048, nb - b0)
            rows = torch.randn(n, PAGE, width, device=device, generator=gen)
            kv[b0 : b0 + n] = pack_fp8_ds_mla(rows)
    else:
        kv = torch.randn(nb, PAGE, width, device=device, generator=gen).to(dtype)
    q = torch.randn(batch, heads, width, device=device, generator=gen).to(dtype)
    req_ids = torch.arange(batch, dtype=torch.int32, device=device)
    logits = torch.empty(batch, ctx, device=device)
    out = torch.empty(batch, heads, 512, dtype=dtype, device=device)
    idx = torch.empty(batch, topk, dtype=torch.int32, device=device)
    mla_kw = dict(block_table=block_table, req_ids=req_ids, block_size=PAGE, kv_format=kv_format)

    def f_logits():
        paged_mqa_logits(*args, out=logits)

    def f_topk():
        idx.copy_(torch.topk(logits, topk, dim=-1).indices)

    def f_mla():
        sparse_mla(q, kv, idx, 192**-0.5, out=out, **mla_kw)

    def f_layer():
        f_logits()
        f_topk()
        f_mla()

    f_layer()
    from .reference import paged_mqa_logits_reference

    rows = sample_rows(batch)
    l_err = logits_row_error(logits[rows.to(device)], paged_mqa_logits_reference(*args, rows=rows))
    ref = sparse_mla_reference(
        q, kv, idx, 192**-0.5, compute_dtype=reference_dtype(dtype), **mla_kw
    )
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


def run(args, device: torch.device | None = None) -> int:
    """Entry point of ``bench --indexer`` (args: ``full``, ``json``, ``no_prefill``). A CPU
    ``device`` (interpreter) runs the checks only (a dry run of this code)."""
    import json

    from .cli.common import environment, environment_line, num, table

    device = device or torch.device("cuda")
    env = environment()
    ceil = None
    print(environment_line(env))
    if device.type == "cuda":
        ceil = measure_ceilings(device)
        env["copy_gbps"] = round(ceil.copy_gbps, 1)
        env["matmul_tflops"] = round(ceil.matmul_tflops, 1)
        print(
            f"ceilings measured now: copy {ceil.copy_gbps:.0f} GB/s, "
            f"bf16 matmul {ceil.matmul_tflops:.0f} TFLOP/s"
        )
    grid = FULL_DECODE if getattr(args, "full", False) else DEFAULT_DECODE
    results: list[IndexerResult] = []

    def log(r: IndexerResult) -> None:
        results.append(r)
        print(
            f"  {r.kind:7s} {r.decode:10s} {r.case:36s} err {num(r.err, '.1e')} "
            f"{'pass' if r.passed else 'FAIL'} {num(r.us, '.1f')} us x{num(r.ratio, '.2f')}",
            flush=True,
        )

    for heads, next_n, ctx, batch in itertools.product(
        grid["heads"], grid["next_n"], grid["ctx"], grid["rows"]
    ):
        for native in (True, False):
            log(bench_decode(batch, next_n, heads, ctx, native, device, ceil))
            if device.type == "cuda":
                torch.cuda.empty_cache()
    if not getattr(args, "no_prefill", False):
        ctxs = FULL_PREFILL_CTX if getattr(args, "full", False) else DEFAULT_PREFILL_CTX
        for heads, ctx in itertools.product((32, 64), ctxs):
            for native in (True, False):
                log(bench_prefill(ctx, heads, native, device, ceil))
    for fmt in ("auto", "fp8_ds_mla"):
        for r in bench_layer(fmt, device, ceil, **LAYER):
            log(r)
        if device.type == "cuda":
            torch.cuda.empty_cache()
    header = [
        "kind",
        "e4m3/kv",
        "case",
        "config",
        "err",
        "us",
        "GB/s",
        "TFLOP/s",
        "floor us",
        "x floor",
        "% mm",
    ]
    rows = [
        [
            r.kind,
            r.decode,
            r.case,
            r.config,
            num(r.err, ".1e") + ("" if r.passed else " FAIL"),
            num(r.us, ".1f"),
            num(r.gbps, ".0f"),
            num(r.tflops, ".1f"),
            num(r.floor_us, ".1f"),
            num(r.ratio, ".2f"),
            num(r.pct_matmul, ".0f"),
        ]
        for r in results
    ]
    print()
    print(table(rows, header))
    if getattr(args, "json", None):
        with open(args.json, "w") as f:
            json.dump(
                {"environment": env, "results": [dataclasses.asdict(r) for r in results]},
                f,
                indent=1,
            )
    return 1 if any(not r.passed for r in results) else 0
