"""Bisect the kv_format="fp8" 64-head split-tile hazard (docs/RELIABILITY.md has the findings).

Seen before: under ``compute-sanitizer --tool memcheck`` the tile h64 n64 w8 s3 with split-K
returns non-finite output for heads 24 and up; without the sanitizer the output is correct.

For each variant this prints whether the final output and the split pass's fp32 partials are
finite (the merge kernel is wrapped to keep its inputs), the heads that went bad, and the error
against the float32 reference. ``--poison`` fills every float32 workspace the launcher allocates
with NaN first, so a partial row the split pass fails to write shows up without any sanitizer.

    python benchmarks/reliability/fp8_hazard.py [--poison] [--only NAME ...] [--repeat N] [--out DIR]
    compute-sanitizer --tool memcheck python benchmarks/reliability/fp8_hazard.py [--out DIR]
    python benchmarks/reliability/fp8_hazard.py --time [--out DIR]   # fp16 vs bf16 MMAs, timed

With ``--out DIR`` the results also go to DIR/fp8_hazard.json (``--time``: DIR/fp8_mma_dtype.json).
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import json
import os
import sys
from pathlib import Path

import torch

from triton_mla_sparse import KernelConfig, sparse_mla
from triton_mla_sparse.kv_format import quantize_fp8
from triton_mla_sparse.ops.sparse_mla import launch
from triton_mla_sparse.ops.sparse_mla.heuristics import arch_of, choose_config
from triton_mla_sparse.reference import sparse_mla_reference

L, R, W = 512, 64, 2048
# name -> (kv_format, q dtype, T, H, config or None for the heuristics' choice)
VARIANTS: dict[str, tuple] = {
    "default-t1": ("fp8", torch.bfloat16, 1, 64, None),
    "default-t4-h128": ("fp8", torch.bfloat16, 4, 128, None),
    "default-t64": ("fp8", torch.bfloat16, 64, 64, None),
    "s3-split2": ("fp8", torch.bfloat16, 1, 64, KernelConfig(64, 64, 8, 3, 2, fp16_mma=True)),
    "s3-split1": ("fp8", torch.bfloat16, 1, 64, KernelConfig(64, 64, 8, 3, 1, fp16_mma=True)),
    "s2-split16": ("fp8", torch.bfloat16, 1, 64, KernelConfig(64, 64, 8, 2, 16, fp16_mma=True)),
    "n32-s3-split16": ("fp8", torch.bfloat16, 1, 64, KernelConfig(64, 32, 8, 3, 16, fp16_mma=True)),
    "h32-split16": ("fp8", torch.bfloat16, 1, 64, KernelConfig(32, 64, 4, 2, 16, fp16_mma=True)),
    "intdecode": (
        "fp8",
        torch.bfloat16,
        1,
        64,
        KernelConfig(64, 64, 8, 3, 16, fp8_native=False, fp16_mma=True),
    ),
    "nopdl": (
        "fp8",
        torch.bfloat16,
        1,
        64,
        KernelConfig(64, 64, 8, 3, 16, pdl=False, fp16_mma=True),
    ),
    "fp16q": ("fp8", torch.float16, 1, 64, KernelConfig(64, 64, 8, 3, 16)),
    "bf16cache": ("auto", torch.bfloat16, 1, 64, KernelConfig(64, 64, 8, 3, 16)),
    "dsmla-default": ("fp8_ds_mla", torch.bfloat16, 1, 64, None),
    # the pre-fix choice (q converted to fp16 for the MMAs) beside the fixed default above
    "fp16mma-t1": ("fp8", torch.bfloat16, 1, 64, KernelConfig(64, 64, 8, 3, 32, fp16_mma=True)),
    "fp16mma-t4-h128": (
        "fp8",
        torch.bfloat16,
        4,
        128,
        KernelConfig(64, 64, 8, 3, 32, fp16_mma=True),
    ),
    "bf16mma-h16": ("fp8", torch.bfloat16, 16, 16, None),
    "bf16mma-h128-t64": ("fp8", torch.bfloat16, 64, 128, None),
}


class _KeepMergeInputs:
    """Stands in for the merge kernel: runs it and keeps its (o_part, lse_part) arguments."""

    def __init__(self, kernel):
        self.kernel = kernel
        self.kept: list[tuple[torch.Tensor, torch.Tensor]] = []

    def __getitem__(self, grid):
        def call(*args, **kwargs):
            self.kept.append((args[0], args[1]))
            return self.kernel[grid](*args, **kwargs)

        return call


@contextlib.contextmanager
def poisoned_workspaces(enabled: bool):
    """Make torch.empty return NaN-filled float32 tensors (the launcher's split workspaces)."""
    if not enabled:
        yield
        return
    real_empty = torch.empty

    def empty(*args, **kwargs):
        x = real_empty(*args, **kwargs)
        if x.dtype == torch.float32:
            x.fill_(float("nan"))
        return x

    launch.torch.empty = empty
    try:
        yield
    finally:
        launch.torch.empty = real_empty


def bad_heads(x: torch.Tensor, head_dim: int) -> list[int]:
    """Heads (dimension ``head_dim``) holding any non-finite value."""
    dims = [d for d in range(x.dim()) if d != head_dim]
    finite = torch.isfinite(x).all(dim=dims[-1])
    for d in reversed(dims[:-1]):
        finite = finite.all(dim=d)
    return [int(h) for h in torch.nonzero(~finite).flatten()]


def run_variant(name: str, spec: tuple, seed: int, poison: bool) -> dict:
    fmt, dtype, T, H, cfg = spec
    g = torch.Generator(device="cpu").manual_seed(seed)
    N = 4096
    q = torch.randn(T, H, L + R, generator=g).to(dtype).cuda()
    rows = torch.randn(N, L + R, generator=g).cuda()
    if fmt == "fp8":
        cache, _ = quantize_fp8(rows, k_scale=1.0)
        kw = {"kv_format": "fp8", "k_scale": 1.0}
    elif fmt == "fp8_ds_mla":
        from triton_mla_sparse import pack_fp8_ds_mla

        cache = pack_fp8_ds_mla(rows)
        kw = {"kv_format": "fp8_ds_mla"}
    else:
        cache = rows.to(dtype)
        kw = {}
    idx = torch.stack([torch.randperm(N, generator=g)[:W] for _ in range(T)]).int().cuda()
    chosen = cfg or choose_config(T, H, W, dtype, fmt, arch_of(q.device))
    keep = _KeepMergeInputs(launch.sparse_mla_merge_kernel)
    launch.sparse_mla_merge_kernel = keep
    try:
        with poisoned_workspaces(poison):
            out = torch.full((T, H, L), float("nan"), dtype=dtype, device="cuda")
            sparse_mla(q, cache, idx, 0.07, out=out, config=cfg, **kw)
            torch.cuda.synchronize()
    finally:
        launch.sparse_mla_merge_kernel = keep.kernel
    ref = sparse_mla_reference(q, cache, idx, 0.07, **kw)
    res = {
        "variant": name,
        "format": fmt,
        "q": str(dtype).replace("torch.", ""),
        "T": T,
        "H": H,
        "config": repr(chosen),
        "out_bad_heads": bad_heads(out.float(), 1),
    }
    if keep.kept:
        o_part, lse_part = keep.kept[0]
        res["part_bad_heads"] = bad_heads(o_part, 2)
        res["lse_part_bad_heads"] = bad_heads(lse_part, 2)
    fin = torch.isfinite(out)
    err = (out.float() - ref.float())[fin].norm() / ref.float()[fin].norm().clamp_min(1e-30)
    res["rel_err_finite_part"] = float(err)
    res["ok"] = not res["out_bad_heads"] and res["rel_err_finite_part"] < 2e-2
    return res


def time_mma_choice(json_path: Path | None) -> None:
    """CUDA-graph medians of the fp8 (per-tensor) cache with bf16 q: fp16 vs bf16 MMAs."""
    import dataclasses

    import triton

    N = 131072
    g = torch.Generator(device="cpu").manual_seed(0)
    rows = torch.randn(N, L + R, generator=g).cuda()
    cache, _ = quantize_fp8(rows, k_scale=1.0)
    table = []
    for T in (1, 4, 16, 64, 128):
        for H in (8, 16, 64, 128):
            q = torch.randn(T, H, L + R, generator=g).to(torch.bfloat16).cuda()
            idx = torch.stack([torch.randperm(N, generator=g)[:W] for _ in range(T)])
            idx = idx.int().cuda()
            ref = sparse_mla_reference(q, cache, idx, 0.07, kv_format="fp8", k_scale=1.0)
            base = choose_config(T, H, W, torch.bfloat16, "fp8", arch_of(q.device))
            row = {"T": T, "H": H, "config": repr(base)}
            for label, fp16 in (("fp16_mma", True), ("bf16_mma", False)):
                cfg = dataclasses.replace(base, fp16_mma=fp16)
                out = torch.empty(T, H, L, dtype=torch.bfloat16, device="cuda")
                call = functools.partial(
                    sparse_mla,
                    q,
                    cache,
                    idx,
                    0.07,
                    kv_format="fp8",
                    k_scale=1.0,
                    out=out,
                    config=cfg,
                )
                call()
                err = float((out.float() - ref.float()).norm() / ref.float().norm())
                assert err < 1e-2, (T, H, label, err)
                row[label] = triton.testing.do_bench_cudagraph(call, rep=200)
                row[label + "_err"] = err
            table.append(row)
            print(
                f"T={T:4d} H={H:4d}  fp16 MMA {row['fp16_mma'] * 1e3:8.1f} us  "
                f"bf16 MMA {row['bf16_mma'] * 1e3:8.1f} us  ratio "
                f"{row['bf16_mma'] / row['fp16_mma']:.3f}  err {row['bf16_mma_err']:.1e}",
                flush=True,
            )
    if json_path:
        with open(json_path, "w") as f:
            json.dump(table, f, indent=1)


def _heads(h: list[int]) -> str:
    return "-" if not h else (f"{h[0]}..{h[-1]} ({len(h)})" if len(h) > 3 else str(h))


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--only", nargs="*", default=None, help="variant names (default: all)")
    ap.add_argument("--poison", action="store_true", help="NaN-fill the split workspaces")
    ap.add_argument("--repeat", type=int, default=1, help="runs per variant (fresh inputs)")
    ap.add_argument(
        "--out", metavar="DIR", type=Path, default=None, help="directory for the JSON results"
    )
    ap.add_argument("--time", action="store_true", help="time fp16 vs bf16 MMAs instead")
    args = ap.parse_args()
    if args.out is not None:
        args.out.mkdir(parents=True, exist_ok=True)
    if args.time:
        time_mma_choice(None if args.out is None else args.out / "fp8_mma_dtype.json")
        return 0
    names = args.only or list(VARIANTS)
    results = []
    for name in names:
        for r in range(args.repeat):
            res = run_variant(name, VARIANTS[name], seed=r, poison=args.poison)
            results.append(res)
            print(
                f"{name:16s} rep {r}: ok={res['ok']!s:5s} out bad heads {_heads(res['out_bad_heads'])}"
                f"  partial bad heads {_heads(res.get('part_bad_heads', []))}"
                f"  err {res['rel_err_finite_part']:.2e}  {res['config']}",
                flush=True,
            )
    if args.out is not None:
        with open(args.out / "fp8_hazard.json", "w") as f:
            json.dump(results, f, indent=1)
    bad = [r["variant"] for r in results if not r["ok"]]
    print(
        f"sanitizer={os.environ.get('CUDA_INJECTION64_PATH', '') != ''} failing: {sorted(set(bad))}"
    )
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
