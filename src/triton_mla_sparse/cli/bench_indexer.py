"""``triton-mla-sparse bench --indexer``: the DSA indexer logits checked, then timed.

The measurement is the library's (bench_indexer.py); this module runs the grid the options ask
for and prints and writes the results. Options that do not apply to the indexer are refused by
``cli.bench.check_args`` before anything runs.
"""

from __future__ import annotations

import argparse
import dataclasses
import itertools
import json

import torch

from ..bench_indexer import (
    DEFAULT_DECODE,
    DEFAULT_PREFILL_CTX,
    FULL_DECODE,
    FULL_PREFILL_CTX,
    PREFILL_HEADS,
    IndexerResult,
    bench_decode,
    bench_layer,
    bench_prefill,
)
from ..testing import measure_ceilings
from .common import environment, environment_line, num, table, write_csv

HEADER = [
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


def run(args: argparse.Namespace, device: torch.device, layer: dict | None = None) -> int:
    """Decode grid (``--full``: the wide one), prefill unless ``--no-prefill``, then the DSA
    decode layer for each of ``--formats``; ``--json`` / ``--csv`` write the results. A CPU
    ``device`` (Triton's interpreter) runs the checks only; ``layer`` overrides bench_layer's
    sizes (such a dry run shrinks them). Exit status 1 if a check failed."""
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
    grid = FULL_DECODE if args.full else DEFAULT_DECODE
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
    if not args.no_prefill:
        ctxs = FULL_PREFILL_CTX if args.full else DEFAULT_PREFILL_CTX
        for heads, ctx in itertools.product(PREFILL_HEADS, ctxs):
            for native in (True, False):
                log(bench_prefill(ctx, heads, native, device, ceil))
    for fmt in args.formats:
        for r in bench_layer(fmt, device, ceil, **(layer or {})):
            log(r)
        if device.type == "cuda":
            torch.cuda.empty_cache()
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
    print(table(rows, HEADER))
    dicts = [dataclasses.asdict(r) for r in results]
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"environment": env, "results": dicts}, f, indent=1)
    if args.csv:
        write_csv(args.csv, dicts)
    return 1 if any(not r.passed for r in results) else 0
