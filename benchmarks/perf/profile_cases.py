"""Run a few checked cases once each, for a profiler (Nsight Compute) to record.

    ncu --clock-control none --kernel-name regex:sparse_mla --section SpeedOfLight \
        --section MemoryWorkloadAnalysis --section WarpStateStats --section Occupancy \
        python benchmarks/perf/profile_cases.py [--arch sm80|sm86|sm89 [--target-smem]] [NAME_SUBSTRING ...]

Each case runs once with the configuration the call would choose by default (or the one
named) after a check against the reference; nothing else launches a kernel whose name starts with ``sparse_mla``.
``--arch``: that target's path by PTX JIT (its heuristics and code, as ``bench --arch``);
``--target-smem``: at the target's programs per multiprocessor (``bench --target-smem``: each
launch's shared memory padded; Nsight Compute's "Dynamic Shared Memory Per Block" and "Block
Limit Shared Mem" show it).
"""

from __future__ import annotations

import argparse

import torch

from triton_mla_sparse import KernelConfig, sparse_mla, sparse_mla_plan
from triton_mla_sparse.bench import check_rows, config_label, prepare
from triton_mla_sparse.testing import rel_err
from triton_mla_sparse.workloads import Case

CASES = [
    (Case("bf16 decode T=128 H=16", 128, 16), None),
    (Case("bf16 decode T=128 H=16, one 64-row buffer", 128, 16), KernelConfig(16, 64, 4, 2, 2)),
    (Case("bf16 decode T=128 H=128", 128, 128), None),
    (Case("fp8_ds_mla decode T=128 H=128", 128, 128, kv_format="fp8_ds_mla"), None),
    (Case("fp8_ds_mla decode T=128 H=16", 128, 16, kv_format="fp8_ds_mla"), None),
    (Case("fp8 decode T=128 H=16", 128, 16, kv_format="fp8"), None),
    (Case("bf16 decode T=1 H=16", 1, 16), None),
    (Case("bf16 prefill T=4096 H=16", 4096, 16, rows=65536), None),
    (Case("bf16 prefill T=4096 H=64", 4096, 64, rows=65536), None),
    # sm90: the default is the pipelined Gluon kernel (Triton 3.8); beside it the
    # warp-specialized one
    (Case("fp8_ds_mla decode T=128 H=64", 128, 64, kv_format="fp8_ds_mla"), None),
    (
        Case("fp8_ds_mla decode T=128 H=64, warp-specialized", 128, 64, kv_format="fp8_ds_mla"),
        KernelConfig(64, 64, 8, 1, 1, stage_dequant=True, fp16_fold=True, gluon="specialized"),
    ),
]


def main() -> None:
    from triton_mla_sparse.cli.bench import ARCH_CHOICES, start_emulation

    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--arch", choices=sorted(ARCH_CHOICES), help="a target's path by PTX JIT")
    ap.add_argument(
        "--target-smem",
        action="store_true",
        help="with --arch: the target's programs per multiprocessor (padded launches)",
    )
    ap.add_argument(
        "--host-sms",
        action="store_true",
        help="with --arch: the grids (split counts) sized for this GPU's multiprocessors",
    )
    ap.add_argument("names", nargs="*", help="substrings of the case names to run (default all)")
    args = ap.parse_args()
    if args.target_smem and args.arch is None:
        ap.error("--target-smem applies to a target's path: give --arch too")
    if args.host_sms and args.arch is None:
        ap.error("--host-sms applies to a target's path: give --arch too")
    want = args.names
    dev = torch.device("cuda")
    if args.arch is not None:
        emu = start_emulation(
            ARCH_CHOICES[args.arch], dev, target_smem=args.target_smem, host_sms=args.host_sms
        )
        if emu is None:
            raise SystemExit(2)  # it says why
    for case, cfg in CASES:
        if want and not any(w in case.name for w in want):
            continue
        inp, ref = prepare(case, dev)
        args = (inp.q, inp.kv_cache, inp.indices, inp.scale)
        # cfg None: what the call runs by default (the heuristics, Gluon kernels included)
        ran = sparse_mla_plan(*args, config=cfg, **inp.kwargs).config
        out = sparse_mla(*args, config=cfg, **inp.kwargs)
        torch.cuda.synchronize()
        rows = check_rows(case)  # a long prefill is checked on a sample of its tokens
        err = rel_err(out if rows is None else out[rows.to(dev)], ref)
        print(f"{case.name}: {config_label(ran)} rel err {err:.1e}", flush=True)


if __name__ == "__main__":
    main()
