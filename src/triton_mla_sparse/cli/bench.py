"""``triton-mla-sparse bench``: check then time the kernel over DSA decode and prefill shapes."""

from __future__ import annotations

import argparse
import csv
import dataclasses
import json

from .common import environment, environment_line, gpu_device, num, table


def add_args(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--formats",
        default="auto,fp8_ds_mla",
        help="kv formats, comma separated (auto,fp8,fp8_ds_mla)",
    )
    p.add_argument("--decode", default="1,4,16,64,128", help="decode token counts")
    p.add_argument("--heads", default="8,16,64,128", help="decode head counts")
    p.add_argument("--prefill-heads", default="16,64,128", help="prefill head counts (T=4096)")
    p.add_argument("--no-prefill", action="store_true")
    p.add_argument("--reference", action="store_true", help="also time the PyTorch reference")
    p.add_argument("--json", metavar="PATH", help="write results and environment as JSON")
    p.add_argument("--csv", metavar="PATH", help="write results as CSV")
    p.add_argument("--plot", metavar="PATH", help="write a PNG of µs against tokens per head count")
    p.add_argument(
        "--indexer",
        action="store_true",
        help="bench the DSA indexer logits instead (decode, prefill, one DSA decode layer)",
    )
    p.add_argument("--full", action="store_true", help="with --indexer: the full decode grid")


def _ints(s: str) -> list[int]:
    return [int(x) for x in s.split(",") if x]


def main(args: argparse.Namespace) -> int:
    device = gpu_device()
    if device is None:
        print("No GPU found: bench times CUDA/ROCm kernels only. `triton-mla-sparse verify` runs")
        print("the correctness checks on CPU through Triton's interpreter.")
        return 0
    if args.indexer:
        from ..bench_indexer import run

        return run(args)
    from ..bench import measure_ceilings, run_case
    from ..workloads import Case

    env = environment()
    ceil = measure_ceilings(device)
    env["copy_gbps"], env["matmul_tflops"] = round(ceil.copy_gbps, 1), round(ceil.matmul_tflops, 1)
    print(environment_line(env))
    print(
        f"ceilings measured now: copy {ceil.copy_gbps:.0f} GB/s, bf16 matmul {ceil.matmul_tflops:.0f} TFLOP/s"
    )
    cases = []
    for fmt in args.formats.split(","):
        for h in _ints(args.heads):
            for t in _ints(args.decode):
                cases.append(Case(f"decode T={t} H={h}", t, h, kv_format=fmt))
        if not args.no_prefill:
            for h in _ints(args.prefill_heads):
                cases.append(Case(f"prefill T=4096 H={h}", 4096, h, rows=65536, kv_format=fmt))
    results, failed = [], 0
    for case in cases:
        res = run_case(case, device, ceil, time_reference=args.reference)
        failed += not res.passed
        results.append(res)
        print(
            f"  {res.kv_format:10s} {res.case:24s} err {res.err:.1e} "
            f"{'pass' if res.passed else 'FAIL'} {num(res.us, '.1f')} us",
            flush=True,
        )
    header = [
        "kv",
        "case",
        "config",
        "err",
        "us",
        "GB/s",
        "TFLOP/s",
        "floor us",
        "x floor",
        "bound",
    ]
    if args.reference:
        header.append("ref us")
    rows = []
    for r in results:
        row = [
            r.kv_format,
            r.case,
            r.config,
            f"{r.err:.1e}" + ("" if r.passed else " FAIL"),
            num(r.us, ".1f"),
            num(r.gbps, ".0f"),
            num(r.tflops, ".1f"),
            num(r.floor_us, ".1f"),
            num(r.ratio, ".2f"),
            r.bound or "-",
        ]
        if args.reference:
            row.append(num(r.ref_us, ".0f"))
        rows.append(row)
    print()
    print(table(rows, header))
    dicts = [dataclasses.asdict(r) for r in results]
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"environment": env, "results": dicts}, f, indent=1)
    if args.csv and dicts:
        with open(args.csv, "w", newline="") as f:
            w = csv.DictWriter(f, fieldnames=list(dicts[0]))
            w.writeheader()
            w.writerows(dicts)
    if args.plot:
        _plot(results, args.plot, env)
    return 1 if failed else 0


def _plot(results, path: str, env: dict) -> None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("--plot needs matplotlib (pip install 'triton-mla-sparse[plot]')")
        return
    fig, axes = plt.subplots(1, 2, figsize=(11, 4.2), sharey=True)
    for ax, fmt in zip(axes, ("auto", "fp8_ds_mla")):
        for h in sorted({r.heads for r in results}):
            pts = [
                (r.tokens, r.us)
                for r in results
                if r.kv_format == fmt and r.heads == h and r.us and r.case.startswith("decode")
            ]
            if pts:
                ax.plot(*zip(*sorted(pts)), marker="o", label=f"H={h}")
        ax.set_xscale("log", base=2)
        ax.set_yscale("log")
        ax.set_xlabel("decode tokens (top-k 2048)")
        ax.set_title(f"kv {fmt}")
        ax.grid(True, alpha=0.3)
        ax.legend()
    axes[0].set_ylabel("µs per call (CUDA graph)")
    fig.suptitle(environment_line(env), fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
