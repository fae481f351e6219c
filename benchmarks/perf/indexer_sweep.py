"""Launch-configuration sweep for the indexer logits (evidence for ops/indexer/heuristics.py).

    python benchmarks/perf/indexer_sweep.py [--wide] [--out DIR]

Each configuration is checked against the reference (sampled rows) before it is timed; the
heuristic's own choice is marked ``*``. Prints the table last; with ``--out DIR`` also writes
DIR/indexer_sweep.json and DIR/indexer_sweep.txt.
"""

from __future__ import annotations

import argparse
import dataclasses
import itertools
import json
import sys
from pathlib import Path

import torch

from triton_mla_sparse import bench_indexer as bi
from triton_mla_sparse.cli.common import num, table
from triton_mla_sparse.indexer import IndexerConfig
from triton_mla_sparse.ops.indexer.heuristics import (
    arch_of,
    block_h_for,
    choose_mqa_config,
    choose_paged_config,
)
from triton_mla_sparse.testing import measure_ceilings

DECODE_SHAPES = [
    (1, 1, 64, 32768),
    (64, 1, 32, 32768),
    (64, 1, 64, 32768),
    (64, 2, 64, 32768),
    (128, 2, 32, 131072),
]
PREFILL_SHAPES = [(32768, 64), (32768, 32)]


def decode_configs(batch, next_n, heads, quick):
    bh = block_h_for(heads)
    rows = min(max(1, 128 // bh), 1 << (next_n - 1).bit_length())
    chunks = (128, 256, 512) if batch == 1 else (1024, 2048, 4096)
    for bn, chunk, nw, ns in itertools.product(
        (64, 128), chunks, (4,) if quick else (4, 8), (2, 3) if quick else (2, 3, 4)
    ):
        yield IndexerConfig(rows, bn, max(chunk, bn), nw, ns)
    if next_n > 1:
        yield IndexerConfig(1, 64, chunks[1], 4, 3)  # rows of a request in separate programs
    yield IndexerConfig(rows, 64, chunks[1], 4, 3, fp8_mma=False)  # fp16 MMA after decode


def prefill_configs(heads, quick):
    bh = block_h_for(heads)
    for rows, bn, nw in itertools.product((1, 2, 4), (64, 128), (4, 8)):
        if rows * bh > 256 or (quick and nw == 4):
            continue
        yield IndexerConfig(rows, bn, 4096, nw, 3)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--wide", action="store_true", help="also 8 warps and 4 stages (~3x longer)")
    ap.add_argument(
        "--out", metavar="DIR", type=Path, default=None, help="directory for the table and JSON"
    )
    a = ap.parse_args()
    a.quick = not a.wide
    device = torch.device("cuda")
    arch = arch_of(device)
    ceil = measure_ceilings(device)
    print(
        f"copy {ceil.copy_gbps:.0f} GB/s, bf16 matmul {ceil.matmul_tflops:.0f} TFLOP/s", flush=True
    )
    results = []
    for batch, next_n, heads, ctx in DECODE_SHAPES:
        chosen = choose_paged_config(batch, next_n, heads, torch.float8_e4m3fn, arch)
        cfgs = list(dict.fromkeys([chosen, *decode_configs(batch, next_n, heads, a.quick)]))
        for cfg in cfgs:
            r = bi.bench_decode(batch, next_n, heads, ctx, True, device, ceil, config=cfg)
            r.config += " *" if cfg == chosen else ""
            results.append(r)
            print(
                f"  {r.case:34s} {r.config:28s} {num(r.us, '.1f')} us x{num(r.ratio, '.2f')}",
                flush=True,
            )
        torch.cuda.empty_cache()
    for ctx, heads in PREFILL_SHAPES:
        chosen = choose_mqa_config(bi.PREFILL_ROWS, ctx, heads, torch.float8_e4m3fn, arch)
        for cfg in dict.fromkeys([chosen, *prefill_configs(heads, a.quick)]):
            r = bi.bench_prefill(ctx, heads, True, device, ceil, config=cfg)
            r.config += " *" if cfg == chosen else ""
            results.append(r)
            print(
                f"  {r.case:34s} {r.config:28s} {num(r.us, '.1f')} us {num(r.tflops, '.0f')} TFLOP/s",
                flush=True,
            )
    header = ["kind", "case", "config", "err", "us", "GB/s", "TFLOP/s", "x floor", "% mm"]
    rows = [
        [
            r.kind,
            r.case,
            r.config,
            num(r.err, ".1e") + ("" if r.passed else " FAIL"),
            num(r.us, ".1f"),
            num(r.gbps, ".0f"),
            num(r.tflops, ".1f"),
            num(r.ratio, ".2f"),
            num(r.pct_matmul, ".0f"),
        ]
        for r in results
    ]
    text = table(rows, header)
    if a.out is not None:
        a.out.mkdir(parents=True, exist_ok=True)
        (a.out / "indexer_sweep.txt").write_text(text + "\n")
        (a.out / "indexer_sweep.json").write_text(
            json.dumps([dataclasses.asdict(r) for r in results], indent=1)
        )
    print()
    print(text)
    return 0 if all(r.passed for r in results) else 1


if __name__ == "__main__":
    sys.exit(main())
