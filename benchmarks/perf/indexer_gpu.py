"""The DSA indexer logits on a GPU in one run: tests, correctness at serving shapes, then the bench.

From the repository root, with the package installed (no vLLM needed):

    python benchmarks/perf/indexer_gpu.py [--full] [--skip-tests] [--out DIR]

Writes under DIR (default ./out/indexer_gpu): env.txt, pytest_indexer.txt (tests/test_indexer.py
run by pytest), checks.txt, bench.txt, indexer_bench.json; prints the bench table last. Exit
status non-zero when anything failed. Default total: ~4-5 minutes on an H200 (tests ~1 min,
checks ~30 s, bench ~2-3 min).
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import io
import subprocess
import sys
import time
from pathlib import Path

import torch

from triton_mla_sparse import bench_indexer as bi
from triton_mla_sparse.cli.main import main as cli_main
from triton_mla_sparse.indexer import mqa_logits, paged_mqa_logits
from triton_mla_sparse.ops.host import interpreter_on, use_interpreter
from triton_mla_sparse.ops.indexer.heuristics import (
    arch_of,
    choose_mqa_config,
    choose_paged_config,
)
from triton_mla_sparse.reference import (
    mqa_logits_reference,
    paged_mqa_logits_reference,
)
from triton_mla_sparse.testing import indexer_logits_tolerance, logits_row_error
from triton_mla_sparse.workloads import indexer_paged_inputs, indexer_prefill_inputs

ROOT = Path(__file__).resolve().parents[2]  # the checkout whose tests/test_indexer.py runs


def run_tests(out: Path) -> bool:
    cmd = [sys.executable, "-m", "pytest", "-q", "-x", "-p", "no:cacheprovider"]
    cmd += [str(ROOT / "tests" / "test_indexer.py")]
    try:
        p = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=240)
        text, ok = p.stdout + p.stderr, p.returncode == 0
    except subprocess.TimeoutExpired as e:
        text, ok = f"TIMEOUT after 240 s\n{e.stdout or ''}", False
    (out / "pytest_indexer.txt").write_text(text)
    print("pytest tests/test_indexer.py:", text.strip().splitlines()[-1] if text.strip() else "?")
    return ok


def checks(device: torch.device, small: bool = False) -> list[str]:
    """Serving shapes in every q dtype (bf16 works here, not under the interpreter), both e4m3
    decodes, both context_lens forms; sampled rows against the float32 reference."""
    lines = []
    arch = arch_of(device)
    q_dtypes = (torch.float8_e4m3fn, torch.bfloat16, torch.float16, torch.float32)
    for (batch, next_n, heads, ctx), qd, native, ctx_2d in [
        ((64, 2, 64, 32768), qd, native, ctx_2d)
        for qd in q_dtypes
        for native in (True, False)
        for ctx_2d in (False, True)
    ] + [
        ((128, 1, 32, 8192), torch.bfloat16, True, False),
        ((1, 1, 32, 131072), torch.float8_e4m3fn, True, False),
    ]:
        if small:  # a CPU dry run of this script under the interpreter
            batch, ctx = min(batch, 3), 300
            if qd == torch.bfloat16:
                continue
        q, cache, w, cl, bt, mml = indexer_paged_inputs(batch, next_n, heads, ctx, device)
        # vary the lengths (not multiples of 64, one short row) and the q dtype
        cl = (cl - torch.arange(batch, device=device, dtype=torch.int32) * 37).clamp_min(1)
        q = q.to(torch.float32).mul(2.0**-4).to(qd) if qd != torch.float8_e4m3fn else q
        if ctx_2d:
            cl = (cl[:, None] - next_n + 1 + torch.arange(next_n, device=device)).to(torch.int32)
        cfg = choose_paged_config(batch, next_n, heads, q.dtype, arch)
        if not native:
            cfg = dataclasses.replace(cfg, fp8_native=False)
        out = torch.full((batch * next_n, mml), -7777.0, device=device)
        paged_mqa_logits(q, cache, w, cl, bt, mml, out=out, config=cfg)
        rows = bi.sample_rows(batch * next_n)
        ref = paged_mqa_logits_reference(q, cache, w, cl, bt, mml, rows=rows)
        got = out[rows.to(device)]
        err = logits_row_error(got, ref)
        untouched = bool((got[~torch.isfinite(ref)] == -7777.0).all())
        ok = err <= indexer_logits_tolerance(device) and untouched
        lines.append(
            f"{'pass' if ok else 'FAIL'} paged B={batch} next_n={next_n} H={heads} ctx={ctx} "
            f"q={str(qd).replace('torch.', '')} {'native' if native else 'integer'} "
            f"ctx{'2d' if ctx_2d else '1d'} {bi.label(cfg)} err {err:.1e} tail-untouched {untouched}"
        )
        print(lines[-1], flush=True)
    for heads, qd, native in [
        (h, qd, native) for h in (32, 64) for qd in q_dtypes for native in (True, False)
    ]:
        if small and qd == torch.bfloat16:
            continue
        M, N = (64, 300) if small else (4096, 32768)
        args = list(indexer_prefill_inputs(M, N, heads, device))
        if qd != torch.float8_e4m3fn:
            args[0] = args[0].to(torch.float32).mul(2.0**-4).to(qd)
        cfg = choose_mqa_config(M, N, heads, args[0].dtype, arch)
        if not native:
            cfg = dataclasses.replace(cfg, fp8_native=False)
        out = torch.full((M, N), -7777.0, device=device)
        mqa_logits(*args, out=out, config=cfg)
        rows = bi.sample_rows(M)
        ref = mqa_logits_reference(*args, rows=rows)
        got = out[rows.to(device)]
        err = logits_row_error(got, ref)
        untouched = bool((got[~torch.isfinite(ref)] == -7777.0).all())
        ok = err <= indexer_logits_tolerance(device) and untouched
        lines.append(
            f"{'pass' if ok else 'FAIL'} prefill M={M} ctx={N} H={heads} "
            f"q={str(qd).replace('torch.', '')} {'native' if native else 'integer'} {bi.label(cfg)} "
            f"err {err:.1e} tail-untouched {untouched}"
        )
        print(lines[-1], flush=True)
    return lines


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument(
        "--out", metavar="DIR", type=Path, default=Path("out/indexer_gpu"), help="log directory"
    )
    ap.add_argument("--full", action="store_true")
    ap.add_argument("--skip-tests", action="store_true")
    ap.add_argument("--small", action="store_true", help="CPU dry run under Triton's interpreter")
    a = ap.parse_args()
    if a.small:  # must precede the first `import triton` (its jit picks the interpreter then)
        if "triton" in sys.modules and not interpreter_on():
            raise SystemExit("run --small with TRITON_INTERPRET=1 set")
        use_interpreter()
    out = a.out
    out.mkdir(parents=True, exist_ok=True)
    import triton

    if a.small:
        device = torch.device("cpu")
        (out / "env.txt").write_text(f"CPU dry run | triton {triton.__version__}\n")
    else:
        device = torch.device("cuda")
        p = torch.cuda.get_device_properties(0)
        (out / "env.txt").write_text(
            f"{p.name} sm{p.major}{p.minor} {p.multi_processor_count} SMs | torch "
            f"{torch.__version__} | triton {triton.__version__}\n"
        )
    t0 = time.time()
    ok = True if a.skip_tests else run_tests(out)
    print(f"[{time.time() - t0:.0f} s] tests done", flush=True)
    lines = checks(device, a.small)
    (out / "checks.txt").write_text("\n".join(lines) + "\n")
    ok &= all(line.startswith("pass") for line in lines)
    print(
        f"[{time.time() - t0:.0f} s] checks done; tests+checks {'ok' if ok else 'FAILED'}",
        flush=True,
    )
    buf = io.StringIO()
    argv = ["bench", "--indexer", "--json", str(out / "indexer_bench.json")]
    argv += ["--full"] if a.full else []

    class Tee(io.TextIOBase):
        def write(self, s):
            sys.__stdout__.write(s)
            buf.write(s)
            return len(s)

    rc = 0
    if not a.small:
        with contextlib.redirect_stdout(Tee()):
            rc = cli_main(argv)
    (out / "bench.txt").write_text(buf.getvalue() + f"[{time.time() - t0:.0f} s total]\n")
    return 0 if ok and rc == 0 else 1


if __name__ == "__main__":
    sys.exit(main())
