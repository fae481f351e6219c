"""Time this checkout's kernels against another source tree's, on one GPU, in one run.

    python benchmarks/perf/compare_trees.py BASE --out DIR [--rounds N] [-- BENCH_ARGS ...]

``BASE``: the other tree's ``src`` folder (the one holding its ``triton_mla_sparse`` package),
e.g. of a ``git worktree`` of the base revision. ``BENCH_ARGS`` go to ``triton-mla-sparse
bench`` unchanged (``--formats fp8_ds_mla --decode 64,128 --heads 16 --no-prefill``,
``--arch sm80``, ...). Each round runs the bench under the base tree, then under this
checkout, each in a process of its own (each checks every case against the reference before
timing it, as the bench always does); with several rounds a case's time is the smallest of its
rounds, so that one slow replay cannot decide. Writes DIR/base-<k>.json and DIR/this-<k>.json
(the bench's own JSON) and DIR/compare.json, and prints one table: µs under each tree, their
ratio, and the configuration each chose. Exit status 1 if a case failed its check under either
tree or is missing from one, 2 if a bench run could not run at all.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
THIS_SRC = ROOT / "src"
SIDES = ("base", "this")


def parse(argv: list[str] | None = None) -> argparse.Namespace:
    argv = list(sys.argv[1:] if argv is None else argv)
    bench_args: list[str] = []
    if "--" in argv:  # everything after the first "--" is the bench's
        cut = argv.index("--")
        argv, bench_args = argv[:cut], argv[cut + 1 :]
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("base", help="the other tree's src folder (holding triton_mla_sparse/)")
    p.add_argument("--out", required=True, help="directory for the JSON files")
    p.add_argument("--rounds", type=int, default=1, help="bench runs per tree, alternating")
    args = p.parse_args(argv)
    args.bench_args = bench_args
    if not (Path(args.base) / "triton_mla_sparse").is_dir():
        p.error(f"BASE {args.base!r} holds no triton_mla_sparse package (pass the tree's src)")
    if args.rounds < 1:
        p.error(f"--rounds must be at least 1, got {args.rounds}")
    for flag in ("--json", "--csv", "--plot"):
        if flag in bench_args:
            p.error(f"{flag} is this script's to set (DIR/<tree>-<round>.json); leave it out")
    return args


def key(row: dict) -> tuple:
    """One case of a bench JSON: its path (native or an emulated target), format, shape."""
    return (row.get("path"), row["kv_format"], row["dtype"], row["case"])


def merge_rounds(docs: list[dict]) -> dict[tuple, dict]:
    """Per case: its row with the smallest time over the rounds (a failed check in any round
    marks the case failed)."""
    best: dict[tuple, dict] = {}
    for doc in docs:
        for row in doc["results"]:
            k = key(row)
            old = best.get(k)
            passed = row["passed"] and (old is None or old["passed"])
            if old is None or (
                row["us"] is not None and (old["us"] is None or row["us"] < old["us"])
            ):
                best[k] = dict(row)
            best[k]["passed"] = passed
    return best


def compare(base: dict[tuple, dict], this: dict[tuple, dict]) -> list[dict]:
    """One row per case of either side: times, ratio (this / base), configurations."""
    rows = []
    for k in list(base) + [k for k in this if k not in base]:
        b, t = base.get(k), this.get(k)
        ratio = None
        if b and t and b["us"] and t["us"]:
            ratio = t["us"] / b["us"]
        rows.append(
            {
                "path": k[0],
                "kv_format": k[1],
                "dtype": k[2],
                "case": k[3],
                "base_us": b and b["us"],
                "this_us": t and t["us"],
                "ratio": ratio,
                "base_config": b and b["config"],
                "this_config": t and t["config"],
                "passed": bool(b and t and b["passed"] and t["passed"]),
            }
        )
    return rows


def render(rows: list[dict]) -> str:
    # This checkout's package, importable whether or not it is installed: the bench runs
    # get it through PYTHONPATH, this process through its own path.
    if str(THIS_SRC) not in sys.path:
        sys.path.insert(0, str(THIS_SRC))
    from triton_mla_sparse.cli.common import num, table

    header = ["path", "kv", "case", "base µs", "this µs", "this/base", "base config"]
    header += ["this config", "check"]
    body = [
        [
            r["path"] or "native",
            r["kv_format"],
            r["case"],
            num(r["base_us"], ".1f"),
            num(r["this_us"], ".1f"),
            num(r["ratio"], ".3f"),
            r["base_config"] or "-",
            r["this_config"] or "-",
            "ok" if r["passed"] else "FAILED or missing",
        ]
        for r in rows
    ]
    return table(body, header)


def run_bench(src: Path, bench_args: list[str], json_path: Path) -> int:
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([str(src)] + [p for p in [env.get("PYTHONPATH")] if p])
    cmd = [sys.executable, "-m", "triton_mla_sparse.cli.main", "bench", *bench_args]
    print(f"== {src}: {' '.join(cmd[1:])}", flush=True)
    return subprocess.run(cmd + ["--json", str(json_path)], env=env).returncode


def main(argv: list[str] | None = None) -> int:
    args = parse(argv)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    docs: dict[str, list[dict]] = {side: [] for side in SIDES}
    for k in range(args.rounds):
        for side, src in zip(SIDES, (Path(args.base).resolve(), THIS_SRC)):
            path = out / f"{side}-{k}.json"
            rc = run_bench(src, args.bench_args, path)
            if rc == 2 or not path.exists():
                print(f"compare_trees: the bench could not run under {src} (exit {rc})")
                return 2
            docs[side].append(json.loads(path.read_text()))
    rows = compare(merge_rounds(docs["base"]), merge_rounds(docs["this"]))
    env = docs["this"][0]["environment"]
    (out / "compare.json").write_text(
        json.dumps(
            {
                "base": str(args.base),
                "bench_args": args.bench_args,
                "environment": env,
                "rounds": args.rounds,
                "rows": rows,
            },
            indent=1,
        )
    )
    print(render(rows))
    return 0 if all(r["passed"] for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
