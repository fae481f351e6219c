"""``triton-mla-sparse verify``: the kernel against the reference on the default workload."""

from __future__ import annotations

import argparse
import time

from ..ops.host import use_interpreter
from .common import environment, environment_line, gpu_device, num, table

DESCRIPTION = (
    "Check the kernel against the PyTorch reference on the default workload (GLM-5 and "
    "DeepSeek-V3.2 decode, a prefill chunk, fp8 caches, -1 padding, a paged cache, an attention "
    "sink, a second index set in the same softmax, and DeepSeek-V4's decode: its 584-byte "
    "record, sliding window + compressed top-k, sink, 64 heads). A case "
    "passes when the output's relative Frobenius error is within the tolerance of its dtype. "
    "Without a GPU, Triton's interpreter runs reduced sizes in fp16. Exit status 1 if a case "
    "fails."
)


def add_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--no-time", action="store_true", help="check only, do not time")


def main(args: argparse.Namespace) -> int:
    import torch

    device = gpu_device()
    if device is None:
        print("No GPU found: running Triton's interpreter on CPU at reduced sizes (fp16).")
        use_interpreter()
        device = torch.device("cpu")
    from ..bench import LABEL_LEGEND, run_case
    from ..testing import sparse_mla_tolerance
    from ..workloads import verify_cases

    print(environment_line(environment()))
    cases = verify_cases(device.type == "cuda")
    tols = ", ".join(
        f"{str(dt).replace('torch.', '')} {sparse_mla_tolerance(dt).out_rtol:.1e}"
        for dt in sorted({c.dtype for c in cases}, key=str)
    )
    print(f"pass: relative Frobenius error of the output vs the reference <= {tols}")
    rows, failed = [], 0
    for i, case in enumerate(cases, 1):
        t0 = time.perf_counter()
        res = run_case(case, device, time_it=not args.no_time)
        wall = time.perf_counter() - t0
        failed += not res.passed
        tol = sparse_mla_tolerance(case.dtype).out_rtol
        when = f"{res.us:.1f} us" if res.us is not None else f"{wall:.1f} s wall"
        verdict = "pass" if res.passed else "FAIL"
        print(
            f"[{i}/{len(cases)}] {res.case}: rel err {num(res.err, '.2e')} "
            f"(tol {tol:.1e}) {verdict}, {when}",
            flush=True,
        )
        rows.append(
            [
                res.case,
                res.kv_format,
                res.dtype,
                f"{res.tokens}x{res.heads}",
                res.topk,
                res.config,
                num(res.err, ".2e"),
                f"{tol:.1e}",
                verdict,
                when,
            ]
        )
    print()
    header = ["case", "kv", "dtype", "TxH", "topk", "kernel", "rel err", "tol", "result", "time"]
    print(table(rows, header))
    print(LABEL_LEGEND)
    print(f"{len(rows) - failed} passed, {failed} failed")
    return 1 if failed else 0
