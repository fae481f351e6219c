"""Smoke test of the FlashMLA calls `triton-mla-sparse bench --compare flashmla` makes (GPU only).

For each FlashMLA function, in each layout the bench uses, one small case built by the same
code as the bench (peers/flashmla.py on workloads.make_inputs): it prints what is handed to
FlashMLA (shapes, dtypes, strides) before the call, runs it eagerly and checks it against the
float32 reference (the bench's tolerance), then checks a CUDA-graph capture and replay of it,
then times it as the bench does. A case that raises prints its exception and the run goes on
(after an illegal memory access the CUDA context is lost: rerun with --only to isolate one).

    python benchmarks/perf/flashmla_smoke.py [--out DIR] [--only NAME ...]

FlashMLA is the build vLLM 0.33 ships (``peers/flashmla.py``): importable with vLLM 0.33
installed (``pip install -e ".[vllm]"``), or, without vLLM, from a folder on ``PYTHONPATH`` that
holds vLLM 0.33's ``vllm/_flashmla_C.abi3.so`` and
``vllm/third_party/flashmla/flash_mla_interface.py`` with an empty ``vllm/__init__.py``. Exit
status: 0 all passed, 1 a case failed, 2 FlashMLA cannot be imported or there is no GPU. With
``--out DIR`` the results go to DIR/flashmla_smoke.json as well.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import traceback

import torch

from triton_mla_sparse.bench import check_rows, prepare
from triton_mla_sparse.peers import flashmla
from triton_mla_sparse.testing import (
    capture_graph,
    compare_sparse_mla,
    sparse_mla_tolerance,
    time_events,
    time_graph,
)
from triton_mla_sparse.workloads import Case

ROWS, TOPK = 16384, 2048
# name -> case; each FlashMLA function in each layout the bench hands it, then -1 handling.
CASES = {
    "sparse_fwd-h16": Case("sparse_fwd decode T=4 H=16 (pad 64)", 4, 16, TOPK, ROWS),
    "sparse_fwd-h128": Case("sparse_fwd decode T=4 H=128", 4, 128, TOPK, ROWS),
    "sparse_fwd-prefill-h64": Case("sparse_fwd prefill T=600 H=64", 600, 64, TOPK, ROWS),
    "sparse_fwd-h16-holes": Case(
        "sparse_fwd T=4 H=16, -1 and past-cache", 4, 16, TOPK, ROWS, holes=True
    ),
    "kvcache-h16": Case("kvcache fp8 T=4 H=16 (1 x 4)", 4, 16, TOPK, ROWS, kv_format="fp8_ds_mla"),
    "kvcache-h64": Case("kvcache fp8 T=4 H=64 (4 x 1)", 4, 64, TOPK, ROWS, kv_format="fp8_ds_mla"),
    "kvcache-h128": Case(
        "kvcache fp8 T=4 H=128 (4 x 1)", 4, 128, TOPK, ROWS, kv_format="fp8_ds_mla"
    ),
    "kvcache-prefill-h16": Case(
        "kvcache fp8 prefill T=600 H=16 (1 x 600)", 600, 16, TOPK, ROWS, kv_format="fp8_ds_mla"
    ),
    "kvcache-h16-holes": Case(
        "kvcache fp8 T=4 H=16, -1 and past-cache",
        4,
        16,
        TOPK,
        ROWS,
        kv_format="fp8_ds_mla",
        holes=True,
    ),
}


def _graph_output(run) -> torch.Tensor:
    """The output of ``run`` captured in a CUDA graph and replayed once (warmed on a side stream)."""
    graph, out = capture_graph(run)
    graph.replay()
    torch.cuda.synchronize()
    return out


def run_one(name: str, case: Case, fmla, device: torch.device) -> dict:
    rec: dict = {"name": name, "case": case.name, "kv_format": case.kv_format, "passed": False}
    print(f"\n== {name}: {case.name}, {case.kv_format}, top-k {case.topk} over {case.rows} rows")
    try:
        inp, ref = prepare(case, device)
        kw = inp.kwargs
        call = flashmla.prepare_call(
            fmla,
            inp.q,
            inp.kv_cache,
            inp.indices,
            inp.scale,
            case.kv_format,
            kw.get("valid_counts"),
        )
        rec.update(function=call.function, label=call.label, args=call.args)
        print(f"   {call.function} ({call.label}), our inputs q {flashmla.describe(inp.q)}")
        print(
            f"   cache {flashmla.describe(inp.kv_cache)}, indices {flashmla.describe(inp.indices)}"
        )
        for k, v in call.args.items():
            print(f"     {k:15s} {v}", flush=True)
        rows = check_rows(case)
        out = call.run()
        torch.cuda.synchronize()
        print(f"   returned {flashmla.describe(out)}", flush=True)
        eager = compare_sparse_mla(out, ref, rows=rows)
        rec["err"] = eager.err
        tol = sparse_mla_tolerance(case.dtype).out_rtol
        print(f"   eager: rel err {rec['err']:.2e} (tolerance {tol:.1e})", flush=True)
        graph = compare_sparse_mla(_graph_output(call.run), ref, rows=rows)
        rec["graph_err"] = graph.err
        print(f"   CUDA graph replay: rel err {rec['graph_err']:.2e}", flush=True)
        rec["passed"] = eager.passed and graph.passed
        if rec["passed"]:
            rec["us"] = time_graph(call.run) if case.decode else time_events(call.run)
            print(f"   {rec['us']:.1f} us ({'CUDA-graph' if case.decode else 'event'} median)")
    except Exception as e:
        rec["error"] = f"{type(e).__name__}: {e}"
        traceback.print_exc()
        sys.stderr.flush()
    print(f"   -> {'pass' if rec['passed'] else 'FAIL'}", flush=True)
    return rec


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", metavar="DIR", default=None, help="directory for flashmla_smoke.json")
    ap.add_argument("--only", nargs="*", choices=sorted(CASES), help="run these cases only")
    args = ap.parse_args()
    try:
        fmla = flashmla.load()
    except flashmla.PeerUnavailable as e:
        print(e)
        return 2
    if not torch.cuda.is_available():
        print("no GPU: FlashMLA runs on SM90/SM100 only")
        return 2
    import triton

    p = torch.cuda.get_device_properties(0)
    so = os.path.join(
        os.path.dirname(os.path.dirname(os.path.dirname(fmla.__file__))), "_flashmla_C.abi3.so"
    )
    env = {
        "gpu": p.name,
        "capability": f"{p.major}.{p.minor}",
        "torch": torch.__version__,
        "cuda": torch.version.cuda,
        "triton": triton.__version__,
        "interface": fmla.__file__,
        "so": so,
        "so_bytes": os.path.getsize(so) if os.path.exists(so) else None,
    }
    for k, v in env.items():
        print(f"{k:10s} {v}")
    device = torch.device("cuda")
    recs = [run_one(n, CASES[n], fmla, device) for n in (args.only or CASES)]
    if args.out:
        os.makedirs(args.out, exist_ok=True)
        with open(os.path.join(args.out, "flashmla_smoke.json"), "w") as f:
            json.dump({"environment": env, "cases": recs}, f, indent=1)
    print(
        "\ncase                     call                       err      graph err  us      result"
    )
    for r in recs:
        err = f"{r['err']:.1e}" if "err" in r else "-"
        gerr = f"{r['graph_err']:.1e}" if "graph_err" in r else "-"
        us = f"{r['us']:.1f}" if "us" in r else "-"
        res = "pass" if r["passed"] else ("ERROR" if "error" in r else "FAIL")
        print(f"{r['name']:24s} {r.get('label', '-'):26s} {err:8s} {gerr:10s} {us:7s} {res}")
    return 0 if all(r["passed"] for r in recs) else 1


if __name__ == "__main__":
    sys.exit(main())
