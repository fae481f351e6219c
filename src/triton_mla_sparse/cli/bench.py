"""``triton-mla-sparse bench``: check then time the kernel over DSA decode and prefill shapes."""

from __future__ import annotations

import argparse
import dataclasses
import importlib.util
import json
import sys

from ..kv_format import KV_FORMATS
from ..ops.sparse_mla.heuristics import E4M3_DECODES, e4m3_decode_for
from ..testing.ptx_jit import EMULATED_CCS
from .common import environment, environment_line, gpu_device, num, table, write_csv

DESCRIPTION = (
    "Check each shape against the PyTorch reference, then time it (decode from CUDA-graph "
    "replays, prefill with device events) beside the copy-bandwidth / matmul floor measured on "
    "this GPU. Needs a GPU; arguments are checked without one. Exit status 1 if a case fails, "
    "2 if it cannot run (bad arguments, no GPU, --compare peer not importable)."
)

# The shape options' defaults. They default to None in the parser, so that an option given
# with --indexer (whose grid is its own) is told apart from one left out and refused.
DEFAULT_DECODE_TOKENS = [1, 4, 16, 64, 128]
DEFAULT_DECODE_HEADS = [8, 16, 64, 128]
DEFAULT_PREFILL_HEADS = [16, 64, 128]
PREFILL_TOKENS, PREFILL_ROWS = 4096, 65536
# What --indexer takes; every other option is refused with it.
INDEXER_OPTIONS = "--formats (its DSA layer's caches), --no-prefill, --full, --json, --csv"
# --arch: the targets of the project's table (ops/target.py) whose PTX a newer GPU can JIT
ARCH_CHOICES = {f"sm{cc}": cc for cc in (80, 86, 89) if cc in EMULATED_CCS}
# the e4m3 caches --e4m3-decode varies (the formats whose kernels take it, plan.py)
E4M3_DECODE_BENCH_FORMATS = ("fp8", "fp8_ds_mla")


def _csv_text(values: list[int]) -> str:
    return ",".join(map(str, values))


def csv_of(kind, choices=None, minimum=None):
    """An argparse ``type``: a comma-separated list of ``kind`` values, each among ``choices`` or
    at least ``minimum``; a bad list is a usage error (exit 2) before anything runs."""

    def parse(text: str) -> list:
        items = [x.strip() for x in text.split(",") if x.strip()]
        if not items:
            raise argparse.ArgumentTypeError(f"empty list {text!r}")
        out = []
        for x in items:
            try:
                v = kind(x)
            except ValueError:
                raise argparse.ArgumentTypeError(f"{x!r} is not a {kind.__name__}") from None
            if choices is not None and v not in choices:
                raise argparse.ArgumentTypeError(f"{x!r} is not one of {', '.join(choices)}")
            if minimum is not None and v < minimum:
                raise argparse.ArgumentTypeError(f"{x!r} is below {minimum}")
            out.append(v)
        return out

    parse.__name__ = f"list of {kind.__name__}"  # argparse names the type in its errors
    return parse


MODELS = ("deepseek-v4",)
V4_HEADS = 64  # DeepSeek-V4's query heads per GPU in vLLM's FlashMLA decode (padded to 64)


def add_args(p: argparse.ArgumentParser) -> None:
    """bench's arguments; each is validated by its ``type`` (exit 2 on a bad value, no GPU
    needed). New options go here; checks across options go in ``check_args``."""
    # the DSA grid's formats (the V4 record is --model deepseek-v4's)
    bench_formats = tuple(f for f in KV_FORMATS if f != "fp8_ds_mla_v4")
    fmts = ",".join(bench_formats)
    p.add_argument(
        "--formats",
        default="auto,fp8_ds_mla",
        type=csv_of(str, choices=bench_formats),
        help=f"kv cache formats, comma separated, from {fmts}",
    )
    ints = csv_of(int, minimum=1)
    p.add_argument(
        "--decode",
        type=ints,
        help=f"decode token counts (default: {_csv_text(DEFAULT_DECODE_TOKENS)})",
    )
    p.add_argument(
        "--heads",
        type=ints,
        help=f"decode head counts (default: {_csv_text(DEFAULT_DECODE_HEADS)}; with --model "
        f"deepseek-v4: {V4_HEADS})",
    )
    p.add_argument(
        "--prefill-heads",
        type=ints,
        help=f"prefill head counts, T={PREFILL_TOKENS} "
        f"(default: {_csv_text(DEFAULT_PREFILL_HEADS)})",
    )
    p.add_argument("--no-prefill", action="store_true", help="skip the prefill shapes")
    p.add_argument(
        "--sink",
        action="store_true",
        help="give every case a per-head attention sink (HY V4 / DeepSeek-V4 style); "
        "with --compare flashmla FlashMLA gets the same sink",
    )
    p.add_argument(
        "--model",
        choices=MODELS,
        help="a model's own decode shape in place of the DSA grid. deepseek-v4: both caches in "
        "its 584-byte record (64-token pages), a 128-row sliding window and a compressed top-k "
        "of 512 in one softmax with its attention sink, q and output 512 wide, "
        f"{V4_HEADS} heads unless --heads is given, --decode tokens; with --compare flashmla "
        "FlashMLA reads the same cache tensors as vLLM 0.33 calls it for DeepSeek-V4 decode. "
        "--sink, --prefill-heads, --indexer and --plot are refused with it; --formats and "
        "--no-prefill do not apply",
    )
    p.add_argument("--reference", action="store_true", help="also time the PyTorch reference")
    p.add_argument("--json", metavar="PATH", help="write results and environment as JSON")
    p.add_argument("--csv", metavar="PATH", help="write results as CSV")
    p.add_argument(
        "--plot",
        metavar="PATH",
        help="write a PNG of µs against tokens per head count (needs the plot extra: matplotlib)",
    )
    p.add_argument(
        "--compare",
        choices=["flashmla"],
        help="also check and time FlashMLA on the same inputs, as vLLM 0.33 calls it, and print "
        "ours/FlashMLA; FlashMLA comes from the installed vLLM 0.33 (the vllm extra), else from "
        "its files on PYTHONPATH; a FlashMLA failure counts as a failed case; exit 2 if it "
        "cannot run here",
    )
    p.add_argument(
        "--arch",
        choices=sorted(ARCH_CHOICES),
        help="time another target's code path on this (newer NVIDIA) GPU: the kernels compiled "
        "for that target (its tiles, MMA instructions, e4m3 decode and SM count; kernels that "
        "would not fit its shared memory fail) and run through the driver's PTX JIT, each "
        "checked against the reference first; every row and the JSON say so, and the times "
        "are this GPU's, not an A100's or L40S's. --compare flashmla runs natively beside it. "
        "Exit 2 where this GPU cannot run the target's PTX",
    )
    p.add_argument(
        "--target-smem",
        action="store_true",
        help="with --arch: give every kernel the target's shared memory per multiprocessor "
        "(164 KB for sm80, 100 KB for sm86 / sm89; its threads and blocks too: each launch's "
        "shared memory is padded), so that as many programs share a multiprocessor as on the "
        "target; without it they share this GPU's (228 KB on an H200)",
    )
    p.add_argument(
        "--host-sms",
        action="store_true",
        help="with --arch: size the grids (split counts) for this GPU's multiprocessors, as the "
        "heuristics do on a target GPU with as many, instead of the target's own count (108 "
        "for sm80, 84 for sm86, 142 for sm89), which fills a GPU with more multiprocessors "
        "only in part",
    )
    p.add_argument(
        "--e4m3-decode",
        type=csv_of(str, choices=E4M3_DECODES),
        help="with e4m3 caches (fp8, fp8_ds_mla), one run per listed form of the integer e4m3 "
        f"decode (KernelConfig.e4m3_decode: {', '.join(E4M3_DECODES)}), beside the default "
        "path's choice; needs a path without hardware fp8 (sm80/86: --arch sm80 or sm86); "
        "packed-nomask runs only where the tiles are staged (sm80's fp8_ds_mla)",
    )
    p.add_argument(
        "--indexer",
        action="store_true",
        help="bench the DSA indexer logits instead (decode, prefill, one DSA decode layer per "
        f"--formats entry); takes {INDEXER_OPTIONS} and refuses the other options",
    )
    p.add_argument(
        "--full",
        action="store_true",
        help="with --indexer: the full decode and prefill grids (refused without --indexer)",
    )


def check_args(args: argparse.Namespace) -> str | None:
    """What is wrong with a combination of arguments (checked before any GPU work, reported as
    a usage error), or None."""
    if args.model:
        if args.indexer:
            return f"--model {args.model} benches attention; --indexer the indexer: pick one"
        if args.plot:
            return f"--plot draws the DSA grid's formats; --model {args.model} has none of them"
        given = [
            opt
            for opt, used in (
                ("--prefill-heads", args.prefill_heads is not None),
                ("--sink", args.sink),
            )
            if used
        ]
        if given:
            return (
                f"{', '.join(given)}: not with --model {args.model}, whose decode shape is its "
                "own (its sink included, no prefill)"
            )
    if args.indexer:
        given = [
            opt
            for opt, used in (
                ("--decode", args.decode is not None),
                ("--heads", args.heads is not None),
                ("--prefill-heads", args.prefill_heads is not None),
                ("--sink", args.sink),
                ("--reference", args.reference),
                ("--plot", args.plot is not None),
                ("--compare", args.compare is not None),
                ("--arch", args.arch is not None),
                ("--target-smem", args.target_smem),
                ("--host-sms", args.host_sms),
                ("--e4m3-decode", args.e4m3_decode is not None),
            )
            if used
        ]
        if given:
            return (
                f"{', '.join(given)}: not with --indexer, whose shapes are its own grid "
                f"(--full widens it); it takes {INDEXER_OPTIONS}"
            )
    elif args.full:
        return (
            "--full widens the --indexer grid and means nothing without --indexer; choose "
            "sparse_mla shapes with --decode, --heads and --prefill-heads"
        )
    if args.target_smem and args.arch is None:
        return "--target-smem gives an emulated target's shared memory: it needs --arch"
    if args.host_sms and args.arch is None:
        return "--host-sms sizes an emulated target's grids for this GPU: it needs --arch"
    if args.plot and importlib.util.find_spec("matplotlib") is None:
        return "--plot needs matplotlib: pip install 'triton-mla-sparse[plot]'"
    return None


def model_cases(args: argparse.Namespace) -> list:
    """The cases of ``--model``: its decode shape at each --decode token count and head count."""
    from ..workloads import deepseek_v4_case

    heads = args.heads or [V4_HEADS]
    return [deepseek_v4_case(t, h) for h in heads for t in args.decode or DEFAULT_DECODE_TOKENS]


def main(args: argparse.Namespace) -> int:
    """Run ``bench`` on arguments ``check_args`` accepted (cli/main.py checks them first)."""
    device = gpu_device()
    if device is None:
        print(
            "triton-mla-sparse bench: error: no GPU found: bench times CUDA/ROCm kernels and has "
            "nothing to run here; `triton-mla-sparse verify` runs the correctness checks on "
            "CPU through Triton's interpreter",
            file=sys.stderr,
        )
        return 2
    if args.indexer:
        from .bench_indexer import run

        return run(args, device)
    emu = None
    if args.arch is not None:
        emu = start_emulation(
            ARCH_CHOICES[args.arch], device, target_smem=args.target_smem, host_sms=args.host_sms
        )
        if emu is None:
            return 2
    try:
        return _bench(args, device, emu)
    finally:
        if emu is not None:
            emu.disable()


def start_emulation(cc: int, device, target_smem: bool = False, host_sms: bool = False):
    """The sm<cc> PTX-JIT emulation, enabled and checked on ``device``; None (after saying
    why on stderr) where this GPU cannot run that target's PTX. ``target_smem``: each launch
    is padded to the target's programs per multiprocessor (ptx_jit.padded_shared);
    ``host_sms``: the heuristics size grids for this GPU's multiprocessor count."""
    import torch

    from ..ops.sparse_mla import launch
    from ..testing import ptx_jit

    hip = getattr(torch.version, "hip", None) is not None
    why = ptx_jit.refusal(cc, torch.cuda.get_device_capability(device), hip)
    if why is None:
        if target_smem:
            torch.zeros(1, device=device)  # a CUDA context: the padding asks the driver
        # kernels launched before would keep their native binaries: start them afresh
        emu = ptx_jit.enable(
            cc, reset=launch.launchable_kernels(), target_smem=target_smem, host_sms=host_sms
        )
        try:
            ptx_jit.check_jit(emu, device)
            return emu
        except ptx_jit.EmulationUnavailable as e:
            emu.disable()
            why = str(e)
    print(f"triton-mla-sparse bench: error: --arch sm{cc}: {why}", file=sys.stderr)
    return None


def _decode_variants(case, default, decodes, arch) -> list:
    """(config, note) per run of ``case`` on ``arch``: the path's own choice (config None), then
    each other --e4m3-decode form on its chosen tiles, where one applies (note: why one is
    skipped)."""
    runs = [(None, None)]
    if not decodes or case.kv_format not in E4M3_DECODE_BENCH_FORMATS:
        return runs
    fp8_native = arch.fp8_native
    chosen = default.e4m3_decode or e4m3_decode_for(
        case.tokens,
        default.block_h,
        case.kv_format,
        arch,
        stage_dequant=default.stage_dequant,
        fp8_native=fp8_native,
        on_gpu=True,
    )
    for d in decodes:
        cfg = dataclasses.replace(default, e4m3_decode=d)
        if d == chosen:
            continue  # the default run is this one
        if d == "packed-nomask" and not default.stage_dequant:
            runs.append((None, f"{d}: skipped, this path does not stage {case.kv_format} tiles"))
        elif d != "scalar" and fp8_native:
            runs.append((None, f"{d}: skipped, this path decodes e4m3 in hardware"))
        else:
            runs.append((cfg, None))
    return runs


def _bench(args: argparse.Namespace, device, emu) -> int:
    """bench's sparse_mla run, natively (``emu`` None) or under a PTX-JIT emulation."""
    fmla = None
    if args.compare == "flashmla":
        from ..peers import flashmla

        try:
            fmla = flashmla.load()
        except flashmla.PeerUnavailable as e:
            print(e, file=sys.stderr)
            return 2
    from ..bench import LABEL_LEGEND, prepare, run_case, run_flashmla
    from ..ops.sparse_mla.heuristics import arch_of, choose_config
    from ..testing import measure_ceilings
    from ..workloads import PAGE, Case

    decode = args.decode or DEFAULT_DECODE_TOKENS
    heads = args.heads or DEFAULT_DECODE_HEADS
    prefill_heads = args.prefill_heads or DEFAULT_PREFILL_HEADS

    env = environment()
    ceil = measure_ceilings(device)
    env["copy_gbps"], env["matmul_tflops"] = round(ceil.copy_gbps, 1), round(ceil.matmul_tflops, 1)
    print(environment_line(env))
    path = "native"
    if emu is not None:
        from ..testing.ptx_jit import path_label

        path = path_label(emu.cc, env["gpu"], emu.target_smem, emu.grid_sms)
        env["path"], env["emulated_sms"] = path, emu.arch.num_sms
        print(
            f"timing the {path} (tiles and split counts for {emu.arch.num_sms} SMs): these are "
            f"this GPU's times, not an sm{emu.cc} GPU's; FlashMLA, if compared, runs natively"
        )
    arch = arch_of(device)
    if args.e4m3_decode and arch.fp8_native and set(args.e4m3_decode) != {"scalar"}:
        print(
            f"triton-mla-sparse bench: error: --e4m3-decode {','.join(args.e4m3_decode)}: the "
            f"sm{arch.cc} path decodes e4m3 in hardware; the integer decode's forms run on the "
            "sm80/86 paths (--arch sm80 or sm86 on a newer GPU)",
            file=sys.stderr,
        )
        return 2
    print(
        f"ceilings measured now: copy {ceil.copy_gbps:.0f} GB/s, bf16 matmul {ceil.matmul_tflops:.0f} TFLOP/s"
    )
    cases = []
    for fmt in args.formats:
        for h in heads:
            for t in decode:
                name = f"decode T={t} H={h}" + (" sink" if args.sink else "")
                cases.append(Case(name, t, h, kv_format=fmt, sink=args.sink))
        if not args.no_prefill:
            for h in prefill_heads:
                name = f"prefill T={PREFILL_TOKENS} H={h}" + (" sink" if args.sink else "")
                case = Case(
                    name, PREFILL_TOKENS, h, rows=PREFILL_ROWS, kv_format=fmt, sink=args.sink
                )
                cases.append(case)
    if args.model:
        cases = model_cases(args)  # the model's own shape in place of the DSA grid
    results, failed, peers, notes, shared = [], 0, {}, [], {}
    runs = []
    for case in cases:
        width = min(case.topk, -(-case.rows // PAGE) * PAGE)  # make_inputs' top-k width
        default = choose_config(case.tokens, case.heads, width, case.dtype, case.kv_format, arch)
        for cfg, note in _decode_variants(case, default, args.e4m3_decode, arch):
            if note is not None:
                notes.append(f"{case.kv_format} {case.name}: {note}")
            else:
                runs.append((case, cfg))
    prepared = None
    for i, (case, cfg) in enumerate(runs):
        first = i == 0 or runs[i - 1][0] is not case  # a case's first run (its default path)
        if first:
            prepared = prepare(case, device) if fmla is not None or args.e4m3_decode else None
        since = len(emu.compiled) if emu is not None else 0
        res = run_case(
            case, device, ceil, config=cfg, time_reference=args.reference, prepared=prepared
        )
        if emu is not None:
            # a kernel compiled for this run, or reused from one with the same variant, that
            # would not fit the emulated part's shared memory: it ran on this GPU's larger one
            key = (res.kv_format, res.config)
            shared[key] = max([shared.get(key, 0)] + [c.shared for c in emu.compiled[since:]])
            if shared[key] > emu.arch.smem_bytes:
                res.passed = False
                notes.append(
                    f"{res.kv_format} {res.case} {res.config}: needs {shared[key] / 1024:.1f} KB "
                    f"of shared memory, sm{emu.cc} has {emu.arch.smem_bytes / 1024:.0f} KB"
                )
        failed += not res.passed
        results.append(res)
        line = (
            f"  {res.kv_format:10s} {res.case:24s} err {res.err:.1e} "
            f"{'pass' if res.passed else 'FAIL'} {num(res.us, '.1f')} us"
        )
        if emu is not None:
            line = f"  [sm{emu.cc} by PTX JIT] {res.config:24s}" + line
        if fmla is not None and first:
            peer = run_flashmla(case, device, prepared, res, fmla)
            if peer is not None:
                peers[len(results) - 1] = peer
                failed += not peer.passed
                line += f" | flashmla {_peer_cell(peer)} us, ours/flashmla {num(peer.ratio, '.2f')}"
        print(line, flush=True)
    header = ([] if emu is None else ["path"]) + [
        "kv",
        "case",
        "config",
        "err",
        "us",
        "GB/s",
        "TFLOP/s",
        "floor us",
        "x floor",
        "bound",
    ]
    if args.reference:
        header.append("ref us")
    if fmla is not None:
        header += ["flashmla call", "flashmla us", "ours/flashmla"]
        if emu is not None:
            header[-2] = "flashmla us (native)"
    rows = []
    for i, r in enumerate(results):
        row = ([] if emu is None else [f"sm{emu.cc} by PTX JIT"]) + [
            r.kv_format,
            r.case,
            r.config,
            f"{r.err:.1e}" + ("" if r.passed else " FAIL"),
            num(r.us, ".1f"),
            num(r.gbps, ".0f"),
            num(r.tflops, ".1f"),
            num(r.floor_us, ".1f"),
            num(r.ratio, ".2f"),
            r.bound or "-",
        ]
        if args.reference:
            row.append(num(r.ref_us, ".0f"))
        if fmla is not None:
            p = peers.get(i)
            row += ["-", "-", "-"] if p is None else [p.call, _peer_cell(p), num(p.ratio, ".2f")]
        rows.append(row)
    print()
    if emu is not None:
        print(f"{path}: not an sm{emu.cc} GPU's times")
    print(table(rows, header))
    print(LABEL_LEGEND)
    for p in peers.values():
        if p.error:
            print(f"flashmla {p.kv_format} {p.case}: {p.error}")
    for n in notes:
        print(n)
    dicts = [{"path": path, **dataclasses.asdict(r)} for r in results]
    if args.json:
        doc = {"environment": env, "results": dicts}
        if fmla is not None:
            doc["environment"]["flashmla"] = getattr(fmla, "__file__", None)
            doc["peers"] = [dataclasses.asdict(p) for p in peers.values()]
        with open(args.json, "w") as f:
            json.dump(doc, f, indent=1)
    if args.csv:
        write_csv(args.csv, dicts)
    if args.plot:
        _plot(results, args.plot, env, list(peers.values()), None if emu is None else path)
    return 1 if failed else 0


def _peer_cell(p) -> str:
    """A peer's µs, or why it has none (failed check or error)."""
    if p.error:
        return "ERROR"
    if not p.passed:
        return f"FAIL {p.err:.1e}"
    return num(p.us, ".1f")


def _plot(results, path: str, env: dict, peers=(), label: str | None = None) -> None:
    """µs against decode tokens per head count and format; ``peers`` (FlashMLA) dashed beside,
    ``label`` (an emulated path) in the title and legend."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:  # checked before the run (check_args); a broken install lands here
        print("--plot needs matplotlib: pip install 'triton-mla-sparse[plot]'", file=sys.stderr)
        return
    fig, axes = plt.subplots(1, 2, figsize=(11, 4.2), sharey=True)
    for ax, fmt in zip(axes, ("auto", "fp8_ds_mla")):
        for h in sorted({r.heads for r in results}):
            pts = [
                (r.tokens, r.us)
                for r in results
                if r.kv_format == fmt
                and r.heads == h
                and r.us
                and r.case.startswith("decode")
                and " +pk" not in r.config  # the path's own decode; --e4m3-decode runs apart
            ]
            if pts:
                line = ax.plot(*zip(*sorted(pts)), marker="o", label=f"H={h}")[0]
                fpts = [
                    (p.tokens, p.us)
                    for p in peers
                    if p.kv_format == fmt and p.heads == h and p.us and p.case.startswith("decode")
                ]
                if fpts:
                    ax.plot(
                        *zip(*sorted(fpts)),
                        marker="x",
                        linestyle="--",
                        color=line.get_color(),
                        label=f"H={h} FlashMLA (native)",
                    )
        ax.set_xscale("log", base=2)
        ax.set_yscale("log")
        ax.set_xlabel("decode tokens (top-k 2048)")
        ax.set_title(f"kv {fmt}")
        ax.grid(True, alpha=0.3)
        ax.legend()
    axes[0].set_ylabel("µs per call (CUDA graph)")
    title = environment_line(env)
    if label:
        title = f"{label} (not that GPU's times) | {title}"
    fig.suptitle(title, fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
