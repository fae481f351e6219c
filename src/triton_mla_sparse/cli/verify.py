"""``triton-mla-sparse verify``: the kernel against the reference on the default workload."""

from __future__ import annotations

import argparse
import time

from .common import environment, environment_line, gpu_device, num, table, use_interpreter


def add_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--no-time", action="store_true", help="check only, do not time")


def main(args: argparse.Namespace) -> int:
    import torch

    device = gpu_device()
    if device is None:
        print("No GPU found: running Triton's interpreter on CPU at reduced sizes (fp16).")
        use_interpreter()
        device = torch.device("cpu")
    from ..bench import run_case
    from ..workloads import verify_cases

    print(environment_line(environment()))
    rows, failed = [], 0
    for case in verify_cases(device.type == "cuda"):
        t0 = time.perf_counter()
        res = run_case(case, device, time_it=not args.no_time)
        wall = time.perf_counter() - t0
        failed += not res.passed
        when = f"{res.us:.1f} us" if res.us is not None else f"{wall:.1f} s wall"
        rows.append(
            [
                res.case,
                res.kv_format,
                res.dtype,
                f"{res.tokens}x{res.heads}",
                res.topk,
                num(res.err, ".2e"),
                "pass" if res.passed else "FAIL",
                when,
            ]
        )
    print(table(rows, ["case", "kv", "dtype", "TxH", "topk", "rel err", "result", "time"]))
    print(f"{len(rows) - failed} passed, {failed} failed")
    return 1 if failed else 0
