"""Where a small decode call's time goes: per-kernel GPU time (profiler) vs graph time per call.

    python benchmarks/perf/breakdown.py

Prints one line per case; writes nothing.
"""

from __future__ import annotations

import torch
from torch.profiler import ProfilerActivity, profile

from triton_mla_sparse import sparse_mla
from triton_mla_sparse.bench import prepare
from triton_mla_sparse.ops.sparse_mla.heuristics import arch_of, choose_config
from triton_mla_sparse.testing import time_graph
from triton_mla_sparse.workloads import Case

CASES = [
    Case("decode T=1 H=16", 1, 16),
    Case("decode T=1 H=128", 1, 128),
    Case("decode T=1 H=16", 1, 16, kv_format="fp8_ds_mla"),
    Case("decode T=16 H=64", 16, 64),
    Case("decode T=128 H=16", 128, 16),
]


def main() -> None:
    dev = torch.device("cuda")
    for case in CASES:
        inp, _ = prepare(case, dev)
        cfg = choose_config(case.tokens, case.heads, 2048, case.dtype, case.kv_format, arch_of(dev))

        def fn(inp=inp, cfg=cfg):
            return sparse_mla(inp.q, inp.kv_cache, inp.indices, inp.scale, config=cfg, **inp.kwargs)

        per_call = time_graph(fn)
        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            for _ in range(20):
                fn()
            torch.cuda.synchronize()
        kernels = {}
        for ev in prof.key_averages():
            if ev.device_type.name == "CUDA" and ev.count:
                t = getattr(ev, "device_time", None) or getattr(ev, "cuda_time", 0)
                kernels[ev.key[:40]] = t
        desc = ", ".join(f"{k}: {v:.1f}" for k, v in kernels.items())
        print(f"{case.kv_format:10s} {case.name:20s} {cfg} graph {per_call:.1f} us/call | {desc}")


if __name__ == "__main__":
    main()
