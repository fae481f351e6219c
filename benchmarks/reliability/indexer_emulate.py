"""Run the indexer kernels as compiled for sm80/86/89 on an sm90 GPU (PTX JIT), and check them.

An sm_8x cubin cannot load on an sm_90 device, but PTX can: the driver JIT-compiles
``.target sm_80`` PTX. So each target runs in its own process where, before the first launch,
Triton's current target reports the emulated one, ``make_cubin`` returns the PTX itself, the
project's architecture lookup reports the emulated target (its tiles, its integer e4m3 decode
below sm89), and the Triton cache is separate. This proves the instruction streams and tiles of
those targets on real hardware; timings here say nothing about an A100 or L40S, so none are taken.

    python benchmarks/reliability/indexer_emulate.py [--out DIR]   # sm80, sm86, sm89 in turn
    python benchmarks/reliability/indexer_emulate.py --cc 80       # one target (a child)

Prints one line per check and the PTX targets that ran; with ``--out DIR`` also writes
DIR/emulate_sm<cc>.txt.
"""

from __future__ import annotations

import argparse
import os
import re
import subprocess
import sys
import tempfile
from pathlib import Path


def child(cc: int, out_dir: Path | None) -> int:
    os.environ["TRITON_CACHE_DIR"] = tempfile.mkdtemp(prefix=f"triton-sm{cc}-")
    import torch
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.backends.nvidia.compiler import CUDABackend

    targets: set[str] = set()

    def ptx_as_cubin(self, src, metadata, *args, **kwargs):
        m = re.search(r"^\.target\s+(\S+)", src, re.M)
        targets.add(m.group(1) if m else "?")
        return src.encode() + b"\0"

    triton.runtime.driver.active.get_current_target = lambda: GPUTarget("cuda", cc, 32)
    CUDABackend.make_cubin = ptx_as_cubin

    from triton_mla_sparse.ops import target

    target._cuda_arch = lambda index: target.Arch(
        "cuda", cc, torch.cuda.get_device_properties(0).multi_processor_count
    )

    from triton_mla_sparse import bench_indexer as bi
    from triton_mla_sparse.indexer import mqa_logits, paged_mqa_logits
    from triton_mla_sparse.ops.indexer.heuristics import (
        arch_of,
        choose_mqa_config,
        choose_paged_config,
    )
    from triton_mla_sparse.reference import mqa_logits_reference, paged_mqa_logits_reference
    from triton_mla_sparse.testing import indexer_logits_tolerance, logits_row_error
    from triton_mla_sparse.workloads import indexer_paged_inputs, indexer_prefill_inputs

    device = torch.device("cuda")
    arch = arch_of(device)
    lines = [f"emulated {arch} (fp8_native={arch.fp8_native}) on {torch.cuda.get_device_name(0)}"]
    poison = -7777.0
    ok_all = True
    q_dtypes = (torch.float8_e4m3fn, torch.bfloat16, torch.float16)
    for qd in q_dtypes:
        for batch, next_n, heads, ctx in ((32, 1, 32, 8192), (32, 2, 64, 8192), (4, 2, 32, 3000)):
            q, cache, w, cl, bt, mml = indexer_paged_inputs(batch, next_n, heads, ctx, device)
            cl = (cl - torch.arange(batch, device=device, dtype=torch.int32) * 61).clamp_min(1)
            if qd != torch.float8_e4m3fn:
                q = q.to(torch.float32).mul(2.0**-4).to(qd)
            cfg = choose_paged_config(batch, next_n, heads, q.dtype, arch)
            out = torch.full((batch * next_n, mml), poison, device=device)
            paged_mqa_logits(q, cache, w, cl, bt, mml, out=out)
            rows = bi.sample_rows(batch * next_n)
            ref = paged_mqa_logits_reference(q, cache, w, cl, bt, mml, rows=rows)
            got = out[rows.to(device)]
            err = logits_row_error(got, ref)
            ok = err <= indexer_logits_tolerance(device) and bool(
                (got[~torch.isfinite(ref)] == poison).all()
            )
            ok_all &= ok
            lines.append(
                f"{'pass' if ok else 'FAIL'} sm{cc} paged B={batch} next_n={next_n} H={heads} "
                f"ctx={ctx} q={str(qd).replace('torch.', '')} {bi.label(cfg)} err {err:.1e}"
            )
            print(lines[-1], flush=True)
        for heads in (32, 64):
            args = list(indexer_prefill_inputs(512, 8192, heads, device))
            if qd != torch.float8_e4m3fn:
                args[0] = args[0].to(torch.float32).mul(2.0**-4).to(qd)
            cfg = choose_mqa_config(512, 8192, heads, args[0].dtype, arch)
            out = torch.full((512, 8192), poison, device=device)
            mqa_logits(*args, out=out)
            rows = bi.sample_rows(512)
            ref = mqa_logits_reference(*args, rows=rows)
            got = out[rows.to(device)]
            err = logits_row_error(got, ref)
            ok = err <= indexer_logits_tolerance(device) and bool(
                (got[~torch.isfinite(ref)] == poison).all()
            )
            ok_all &= ok
            lines.append(
                f"{'pass' if ok else 'FAIL'} sm{cc} prefill M=512 ctx=8192 H={heads} "
                f"q={str(qd).replace('torch.', '')} {bi.label(cfg)} err {err:.1e}"
            )
            print(lines[-1], flush=True)
    lines.append(f"PTX targets that ran: {sorted(targets)}")
    ok_all &= targets == {f"sm_{cc}"}
    print(lines[-1])
    if out_dir is not None:
        out_dir.mkdir(parents=True, exist_ok=True)
        (out_dir / f"emulate_sm{cc}.txt").write_text("\n".join(lines) + "\n")
    return 0 if ok_all else 1


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--cc", type=int, default=None, help="run this target only")
    ap.add_argument(
        "--out", metavar="DIR", type=Path, default=None, help="directory for emulate_sm<cc>.txt"
    )
    a = ap.parse_args()
    if a.cc is not None:
        return child(a.cc, a.out)
    rc = 0
    for cc in (80, 86, 89):
        cmd = [sys.executable, __file__, "--cc", str(cc)]
        cmd += [] if a.out is None else ["--out", str(a.out)]
        p = subprocess.run(cmd, timeout=300)
        print(f"sm{cc}: {'ok' if p.returncode == 0 else 'FAILED'} (rc {p.returncode})", flush=True)
        rc |= p.returncode
    return rc


if __name__ == "__main__":
    sys.exit(main())
