"""The performance targets, timed on one GPU in one run: native path, sm80 / sm89 paths by PTX JIT.

    python benchmarks/perf/targets.py --out DIR [--max-seconds 540] [--paths native,sm80,...]
    python benchmarks/perf/targets.py --list          # what would run, and the targets (no GPU)

The grid: decode 1, 16, 64, 128 tokens x 8, 16, 64, 128 heads and prefill 4096 tokens x 64,
128 heads, top-k 2048, bf16 and fp8_ds_mla caches, and DeepSeek-V4's decode (``bench --model
deepseek-v4``'s shape: 584-byte record, 128-row window + compressed top-k 512, sink) at 1-128
tokens x 64 heads, for each path: ``native`` (this GPU's own
kernels), ``sm80`` and ``sm89`` (those targets' kernels and heuristics run through the driver's
PTX JIT: ``triton_mla_sparse.testing.ptx_jit``; their times are this GPU's, not an A100's or
L40S's, and every row says so), and ``sm80-scalar`` / ``sm80-packed`` / ``sm80-packed-nomask``
(the sm80 path with each KernelConfig.e4m3_decode form forced, fp8_ds_mla rows only; ``sm80``
itself takes the heuristics' choice). Every call is checked against
the PyTorch reference before it is timed (``triton_mla_sparse.bench.run_case``); FlashMLA (as
vLLM 0.33 calls it) runs natively beside each shape where it can; the floor is the bytes a call
must read at the copy bandwidth measured in this run (or its FLOPs at the matmul rate measured
in this run, where larger: docs/PERFORMANCE.md). Each row shows its ratio to the floor and to
FlashMLA and, where a target applies, the target and whether it is met.

Runs the rows that carry a target first (every path), then the rest, and stops starting new
runs when ``--max-seconds`` is near (first compiles take most of the time: a second run on the
same machine reuses Triton's cache), listing what it skipped. Writes DIR/targets.json and
DIR/targets.txt (everything printed); the table is printed last. Exit status: 0 when every run
passed its check, 1 when one failed, 2 when nothing can run here (no GPU, bad arguments).
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import io
import json
import sys
import time
from pathlib import Path

# --- the grid and the targets (data) ---------------------------------------------------------

DECODE_TOKENS = (1, 16, 64, 128)
DECODE_HEADS = (8, 16, 64, 128)
PREFILL_TOKENS, PREFILL_ROWS = 4096, 65536
PREFILL_HEADS = (64, 128)
TOPK = 2048
FORMATS = ("auto", "fp8_ds_mla")  # "auto": the bf16 cache
V4 = "fp8_ds_mla_v4"  # DeepSeek-V4's decode (workloads.deepseek_v4_case), decode rows only
V4_HEADS = (64,)  # its query heads per GPU in vLLM's FlashMLA decode
FLASHMLA = "flashmla"


@dataclasses.dataclass(frozen=True)
class KernelPath:
    """One way of running the kernels: ``cc`` None natively, else the target emulated by PTX
    JIT; ``e4m3_decode`` a KernelConfig.e4m3_decode form, its rows the e4m3 formats only."""

    name: str
    cc: int | None = None
    e4m3_decode: str | None = None

    @property
    def formats(self) -> tuple[str, ...]:
        # the forced decodes are fp8_ds_mla's (the V4 record has one decode per target)
        return ("fp8_ds_mla",) if self.e4m3_decode else (*FORMATS, V4)


PATHS = (
    KernelPath("native"),
    KernelPath("sm80", 80),
    KernelPath("sm89", 89),
    KernelPath("sm80-scalar", 80, "scalar"),
    KernelPath("sm80-packed", 80, "packed"),
    KernelPath("sm80-packed-nomask", 80, "packed-nomask"),
)
PATH_BY_NAME = {p.name: p for p in PATHS}
# the native path carries the sm90 targets only where this GPU is an sm90 part
SM90 = 90


@dataclasses.dataclass(frozen=True)
class Target:
    """``metric`` of the rows it covers compared with ``bound``: "x_floor" (µs / floor µs, at
    most), "x_flashmla" (µs / FlashMLA µs on the same inputs, at most) or "tflops" (at least)."""

    paths: tuple[str, ...]  # path names; "native" means the native path of an sm90 GPU
    kv_format: str
    kind: str  # "decode" or "prefill"
    tokens: tuple[int, ...]
    heads: tuple[int, ...]
    metric: str
    bound: float

    def covers(self, path: str, kv_format: str, kind: str, tokens: int, heads: int) -> bool:
        return (
            path in self.paths
            and kv_format == self.kv_format
            and kind == self.kind
            and tokens in self.tokens
            and heads in self.heads
        )

    def met(self, row: dict) -> bool | None:
        """Whether ``row`` meets it; None where the row has no value to judge (not timed, no
        FlashMLA beside it)."""
        if self.metric == "tflops":
            value = row.get("tflops")
            return None if value is None else value >= self.bound
        value = row.get("x_floor") if self.metric == "x_floor" else row.get("x_flashmla")
        return None if value is None else value <= self.bound

    def text(self) -> str:
        if self.metric == "tflops":
            return f">= {self.bound:g} TFLOP/s"
        return f"<= {self.bound:g}x {'floor' if self.metric == 'x_floor' else 'FlashMLA'}"


EMULATED = ("sm80", "sm89", "sm80-scalar", "sm80-packed", "sm80-packed-nomask")
FEW_HEADS, MANY_HEADS = (8, 16), (64, 128)
LONG_DECODE = (64, 128)
TARGETS = (
    # sm80 / sm89 paths (their packed variants count as the sm80 path)
    Target(EMULATED, "auto", "decode", LONG_DECODE, FEW_HEADS, "x_floor", 1.25),
    Target(EMULATED, "auto", "decode", LONG_DECODE, MANY_HEADS, "x_floor", 2.0),
    Target(EMULATED, "fp8_ds_mla", "decode", LONG_DECODE, FEW_HEADS, "x_floor", 1.6),
    Target(EMULATED, "fp8_ds_mla", "decode", LONG_DECODE, MANY_HEADS, "x_floor", 2.5),
    Target(EMULATED, "auto", "prefill", (PREFILL_TOKENS,), (64,), "tflops", 250.0),
    Target(EMULATED, "fp8_ds_mla", "prefill", (PREFILL_TOKENS,), (64,), "tflops", 150.0),
    # sm90 path against FlashMLA on the same GPU
    Target(("native",), "auto", "decode", DECODE_TOKENS, FEW_HEADS, "x_flashmla", 1.0),
    Target(("native",), "fp8_ds_mla", "decode", DECODE_TOKENS, FEW_HEADS, "x_flashmla", 0.9),
    Target(("native",), "auto", "decode", DECODE_TOKENS, MANY_HEADS, "x_flashmla", 1.25),
    Target(("native",), "fp8_ds_mla", "decode", DECODE_TOKENS, MANY_HEADS, "x_flashmla", 1.25),
    Target(("native",), "auto", "prefill", (PREFILL_TOKENS,), PREFILL_HEADS, "tflops", 400.0),
    # DeepSeek-V4 decode beside FlashMLA on the same caches
    Target(("native",), V4, "decode", DECODE_TOKENS, V4_HEADS, "x_flashmla", 1.5),
)

# Stop starting runs this many seconds before --max-seconds: room for one more run's first
# compile (tens of seconds for a new kernel variant) and for writing the table and the JSON.
RESERVE_S = 45.0
DEFAULT_MAX_SECONDS = 540.0  # a 10-minute call, with room for Python and CUDA start-up


@dataclasses.dataclass(frozen=True)
class Run:
    path: str
    kv_format: str
    kind: str
    tokens: int
    heads: int

    @property
    def shape(self) -> str:
        return f"{self.kind} {self.tokens} x {self.heads}"


def grid(path: KernelPath) -> list[Run]:
    runs = []
    for fmt in path.formats:
        if fmt == V4:
            runs += [Run(path.name, fmt, "decode", t, h) for h in V4_HEADS for t in DECODE_TOKENS]
            continue
        for h in DECODE_HEADS:
            for t in DECODE_TOKENS:
                runs.append(Run(path.name, fmt, "decode", t, h))
        for h in PREFILL_HEADS:
            runs.append(Run(path.name, fmt, "prefill", PREFILL_TOKENS, h))
    return runs


def targets_of(run: Run, native_cc: int | None) -> list[Target]:
    """The targets a run's row is judged by (the native path's only on an sm90 GPU)."""
    if run.path == "native" and native_cc != SM90:
        return []
    return [
        t for t in TARGETS if t.covers(run.path, run.kv_format, run.kind, run.tokens, run.heads)
    ]


def plan_runs(paths: list[str], native_cc: int | None) -> list[Run]:
    """Every run, the rows that carry a target first (path by path), then the others."""
    all_runs = [r for name in paths for r in grid(PATH_BY_NAME[name])]
    first = [r for r in all_runs if targets_of(r, native_cc)]
    return first + [r for r in all_runs if not targets_of(r, native_cc)]


# --- running ---------------------------------------------------------------------------------


@contextlib.contextmanager
def path_context(path: KernelPath, device, target_smem: bool = False, host_sms: bool = False):
    """Natively, nothing; for an emulated path the PTX-JIT emulation, checked on ``device``
    (``ptx_jit.EmulationUnavailable`` with the reason where it cannot run here); with
    ``target_smem`` every launch is padded to the target's programs per multiprocessor
    (ptx_jit.padded_shared); with ``host_sms`` the heuristics size grids for this GPU's
    multiprocessor count instead of the target's."""
    if path.cc is None:
        yield None
        return
    import torch

    from triton_mla_sparse.ops.sparse_mla import launch
    from triton_mla_sparse.testing import ptx_jit

    why = ptx_jit.refusal(
        path.cc, torch.cuda.get_device_capability(device), torch.version.hip is not None
    )
    if why is not None:
        raise ptx_jit.EmulationUnavailable(why)
    # every kernel a call can launch, the Gluon ones included: a binary another path built
    # (or the native one) is not reused
    if target_smem:
        torch.zeros(1, device=device)  # a CUDA context: the padding asks the driver
    emu = ptx_jit.enable(
        path.cc, reset=launch.launchable_kernels(), target_smem=target_smem, host_sms=host_sms
    )
    try:
        ptx_jit.check_jit(emu, device)
        yield emu
    finally:
        emu.disable()


def run_one(run: Run, device, ceilings, fmla, emu) -> tuple[dict, dict | None]:
    """(our row, FlashMLA's row or None) of one run: checked, then timed (bench.run_case)."""
    from triton_mla_sparse.bench import prepare, run_case, run_flashmla
    from triton_mla_sparse.ops.sparse_mla.heuristics import arch_of, choose_config
    from triton_mla_sparse.workloads import Case, deepseek_v4_case

    path = PATH_BY_NAME[run.path]
    size = {"rows": PREFILL_ROWS} if run.kind == "prefill" else {}  # decode: Case's own cache
    if run.kv_format == V4:
        case = deepseek_v4_case(run.tokens, run.heads, name=run.shape)
    else:
        case = Case(run.shape, run.tokens, run.heads, topk=TOPK, kv_format=run.kv_format, **size)
    cfg = None
    if path.e4m3_decode:
        default = choose_config(
            run.tokens, run.heads, TOPK, case.dtype, run.kv_format, arch_of(device)
        )
        cfg = dataclasses.replace(default, e4m3_decode=path.e4m3_decode)
    prepared = prepare(case, device)
    since = len(emu.compiled) if emu is not None else 0
    res = run_case(case, device, ceilings, config=cfg, prepared=prepared)
    row = dataclasses.asdict(res) | {"path": run.path, "kind": run.kind, "x_floor": res.ratio}
    if emu is not None:
        too_big = emu.too_big(since)
        if too_big:
            row["passed"] = False
            row["note"] = (
                f"needs {max(c.shared for c in too_big) / 1024:.1f} KB of shared memory, "
                f"sm{emu.cc} has {emu.arch.smem_bytes / 1024:.0f} KB"
            )
    peer = None
    if fmla is not None and emu is None:
        p = run_flashmla(case, device, prepared, res, fmla)
        peer = None if p is None else dataclasses.asdict(p)
    return row, peer


def execute(args, device, runner=run_one, log=print, clock=time.monotonic) -> dict:
    """Run the plan under the budget; the document targets.json holds."""
    import torch

    from triton_mla_sparse.testing import measure_ceilings, ptx_jit

    t0 = clock()

    def elapsed() -> float:
        return clock() - t0

    cap = torch.cuda.get_device_capability(device)
    native_cc = cap[0] * ptx_jit.CC_MAJOR + cap[1]
    gpu = torch.cuda.get_device_name(device)
    ceilings = measure_ceilings(device)
    log(
        f"{gpu} (sm{native_cc}): ceilings measured now: copy {ceilings.copy_gbps:.0f} GB/s, "
        f"bf16 matmul {ceilings.matmul_tflops:.0f} TFLOP/s"
    )
    fmla, fmla_note = None, None
    if not args.no_flashmla:
        from triton_mla_sparse.peers import flashmla

        try:
            fmla = flashmla.load()
        except flashmla.PeerUnavailable as e:
            fmla_note = f"FlashMLA not run: {e}"
            log(fmla_note)
    target_smem = getattr(args, "target_smem", False)
    host_sms = getattr(args, "host_sms", False)
    if target_smem:
        log("emulated paths with their target's shared memory per multiprocessor (--target-smem)")
    if host_sms:
        log("emulated paths' grids sized for this GPU's multiprocessors (--host-sms)")
    runs = plan_runs(args.paths, native_cc)
    rows, peers, skipped, refused = [], {}, [], {}
    grid_sms = None  # with --host-sms: the multiprocessor count the emulated grids are sized for
    i = 0
    while i < len(runs):
        path = PATH_BY_NAME[runs[i].path]
        group = []  # consecutive runs of one path share its emulation
        while i < len(runs) and runs[i].path == path.name:
            group.append(runs[i])
            i += 1
        if path.name in refused:
            skipped += [(r, refused[path.name]) for r in group]
            continue
        if elapsed() > args.max_seconds - RESERVE_S:
            skipped += [(r, "time budget") for r in group]
            continue
        try:
            with path_context(path, device, target_smem, host_sms) as emu:
                if emu is not None:
                    grid_sms = emu.grid_sms
                for run in group:
                    if elapsed() > args.max_seconds - RESERVE_S:
                        skipped.append((run, "time budget"))
                        continue
                    try:
                        row, peer = runner(run, device, ceilings, fmla, emu)
                    except Exception as e:  # a run that breaks is reported, not fatal
                        row = {"path": run.path, "passed": False, "error": f"{e!r}"[:300]}
                        row |= dataclasses.asdict(run)
                        peer = None
                    rows.append((run, row))
                    if peer is not None:
                        peers[(run.kv_format, run.kind, run.tokens, run.heads)] = peer
                    log(_progress(run, row, peer, elapsed()))
        except ptx_jit.EmulationUnavailable as e:
            refused[path.name] = f"{path.name} cannot run here: {e}"
            log(refused[path.name])
            # refused on entering the path, before any of its runs
            skipped += [(r, refused[path.name]) for r in group]
    table_rows = [judge(run, row, peers, native_cc, gpu) for run, row in rows]
    return {
        "environment": _environment(gpu, native_cc, ceilings)
        | {
            "target_smem": target_smem,
            "host_sms": host_sms,
            "grid_sms": grid_sms,
        },
        "rows": table_rows,
        "flashmla": list(peers.values()),
        "flashmla_note": fmla_note,
        "skipped": [dataclasses.asdict(r) | {"why": why} for r, why in skipped],
        "targets": [dataclasses.asdict(t) | {"text": t.text()} for t in TARGETS],
        "seconds": round(elapsed(), 1),
    }


def judge(run: Run, row: dict, peers: dict, native_cc: int | None, gpu: str) -> dict:
    """A table row: the run's result, FlashMLA's µs on the same shape (measured natively),
    ratios, the path's label and its targets with a check mark each."""
    peer = peers.get((run.kv_format, run.kind, run.tokens, run.heads))
    out = dict(row)
    cc = PATH_BY_NAME[run.path].cc
    out["label"] = f"sm{native_cc} (native)" if cc is None else f"sm{cc} by PTX JIT on {gpu}"
    out["flashmla_us"] = peer.get("us") if peer else None
    us = row.get("us")
    out["x_flashmla"] = us / out["flashmla_us"] if us and out["flashmla_us"] else None
    out["targets"] = []
    for t in targets_of(run, native_cc):
        met = t.met(out) if row.get("passed") else False
        out["targets"].append({"text": t.text(), "met": met})
    return out


def _progress(run: Run, row: dict, peer: dict | None, elapsed: float) -> str:
    status = "pass" if row.get("passed") else "FAIL"
    us = row.get("us")
    line = (
        f"[{elapsed:6.0f} s] {run.path:18s} {run.kv_format:10s} {run.shape:20s} {status} "
        f"{row.get('config', '')} {'-' if us is None else f'{us:.1f} us'}"
    )
    if row.get("error") or row.get("note"):
        line += f" ({row.get('error') or row.get('note')})"
    if peer is not None:
        line += f" | flashmla {peer.get('us') or peer.get('error') or 'FAIL'}"
    return line


def _environment(gpu: str, native_cc: int, ceilings) -> dict:
    import platform

    import torch
    import triton

    return {
        "gpu": gpu,
        "capability": native_cc,
        "torch": torch.__version__,
        "triton": triton.__version__,
        "python": platform.python_version(),
        "copy_gbps": round(ceilings.copy_gbps, 1),
        "matmul_tflops": round(ceilings.matmul_tflops, 1),
        "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
    }


MARK = {True: "✓", False: "✗", None: "?"}


def _num(x, spec: str) -> str:
    return "-" if x is None else format(x, spec)


def format_table(doc: dict) -> str:
    """The table printed last: one line per run, its targets and check marks."""
    from triton_mla_sparse.cli.common import table

    header = [
        "path",
        "kv",
        "shape",
        "config",
        "err",
        "µs",
        "floor µs",
        "x floor",
        "TFLOP/s",
        "FlashMLA µs",
        "x FlashMLA",
        "target",
    ]
    lines = []
    for r in doc["rows"]:
        err = r.get("err")
        check = "" if r.get("passed") else " FAIL"
        targets = " ".join(f"{t['text']} {MARK[t['met']]}" for t in r["targets"]) or "-"
        lines.append(
            [
                r["label"],
                r.get("kv_format", "-"),
                f"{r.get('kind')} {r.get('tokens')} x {r.get('heads')}",
                r.get("config", "-"),
                (_num(err, ".1e") + check).strip(),
                _num(r.get("us"), ".1f"),
                _num(r.get("floor_us"), ".1f"),
                _num(r.get("x_floor"), ".2f"),
                _num(r.get("tflops"), ".1f"),
                _num(r.get("flashmla_us"), ".1f"),
                _num(r.get("x_flashmla"), ".2f"),
                targets,
            ]
        )
    text = [table(lines, header)]
    judged = [t for r in doc["rows"] for t in r["targets"]]
    met = sum(t["met"] is True for t in judged)
    text.append(
        f"targets: {met} of {len(judged)} row checks met "
        f"({sum(t['met'] is None for t in judged)} without a value: no FlashMLA or not timed)"
    )
    env = doc["environment"]
    text.append(
        f"floor: bytes a call must read at the copy bandwidth measured in this run "
        f"({env['copy_gbps']:.0f} GB/s), or its FLOPs at the matmul rate measured in this run "
        f"({env['matmul_tflops']:.0f} TFLOP/s) where larger. Rows 'by PTX JIT' are those "
        f"targets' kernels on {env['gpu']}: not an A100's or L40S's times"
        + (
            f", their grids sized for its {env['grid_sms']} multiprocessors (--host-sms)."
            if env.get("grid_sms")
            else ", their grids for the target's multiprocessors (108 for sm80, 142 for sm89)."
        )
    )
    if doc["skipped"]:
        text.append(f"skipped {len(doc['skipped'])} runs:")
        for s in doc["skipped"]:
            text.append(
                f"  {s['path']} {s['kv_format']} {s['kind']} {s['tokens']} x {s['heads']}: "
                f"{s['why']}"
            )
    if doc.get("flashmla_note"):
        text.append(doc["flashmla_note"])
    return "\n".join(text)


# --- command line ----------------------------------------------------------------------------


def paths_arg(text: str) -> list[str]:
    names = [x.strip() for x in text.split(",") if x.strip()]
    bad = [n for n in names if n not in PATH_BY_NAME]
    if not names or bad:
        raise argparse.ArgumentTypeError(
            f"{text!r}: paths are comma-separated names from {', '.join(PATH_BY_NAME)}"
        )
    return list(dict.fromkeys(names))


def parse(argv: list[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", metavar="DIR", type=Path, help="where targets.json/.txt go")
    ap.add_argument(
        "--max-seconds",
        type=float,
        default=DEFAULT_MAX_SECONDS,
        help=f"stop starting runs {RESERVE_S:.0f} s before this (default {DEFAULT_MAX_SECONDS:g})",
    )
    ap.add_argument(
        "--paths",
        type=paths_arg,
        default=list(PATH_BY_NAME),
        help=f"which paths, comma-separated (default all: {','.join(PATH_BY_NAME)})",
    )
    ap.add_argument("--no-flashmla", action="store_true", help="do not run FlashMLA beside")
    ap.add_argument(
        "--target-smem",
        action="store_true",
        help="the emulated paths at their target's programs per multiprocessor (each launch's "
        "shared memory padded to the target's 164 KB (sm80) or 100 KB (sm89), threads and "
        "blocks: testing.ptx_jit.padded_shared)",
    )
    ap.add_argument(
        "--host-sms",
        action="store_true",
        help="the emulated paths' grids (split counts) sized for this GPU's multiprocessors, "
        "as the heuristics size them on a target GPU with as many, instead of for the target's "
        "(108 for sm80, 142 for sm89)",
    )
    ap.add_argument("--list", action="store_true", help="print the runs and targets; no GPU")
    args = ap.parse_args(argv)
    if not args.list and args.out is None:
        ap.error("--out DIR is required (the logs and JSON go there)")
    if args.max_seconds <= RESERVE_S:
        ap.error(f"--max-seconds must exceed the {RESERVE_S:.0f} s kept in reserve")
    return args


def list_plan(args) -> str:
    lines = []
    for run in plan_runs(args.paths, SM90):
        ts = ", ".join(t.text() for t in targets_of(run, SM90)) or "-"
        lines.append(f"{run.path:18s} {run.kv_format:10s} {run.shape:20s} {ts}")
    lines.append(f"{len(lines)} runs (the native path's targets apply on an sm90 GPU)")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    args = parse(argv)
    if args.list:
        print(list_plan(args))
        return 0
    import torch

    if not torch.cuda.is_available() or torch.version.hip is not None:
        print("targets.py: error: needs an NVIDIA GPU", file=sys.stderr)
        return 2
    args.out.mkdir(parents=True, exist_ok=True)
    log_text = io.StringIO()

    def log(line: str) -> None:
        print(line, flush=True)
        log_text.write(line + "\n")

    doc = execute(args, torch.device("cuda"), log=log)
    table_text = format_table(doc)
    log("")
    log(table_text)
    (args.out / "targets.json").write_text(json.dumps(doc, indent=1, default=str))
    (args.out / "targets.txt").write_text(log_text.getvalue())
    return 0 if all(r.get("passed") for r in doc["rows"]) else 1


if __name__ == "__main__":
    sys.exit(main())
