"""What a kernel's main loop executes, without a GPU: registers, spills and the SASS of each loop.

Evidence for where a measured gap comes from (docs/INDEXER.md, docs/PERFORMANCE.md): the
kernels are compiled for a target exactly as the runtime would (tests/aot_compile.py, via
``benchmarks/codegen/asm_equivalence.py dump``), assembled by Triton's own ptxas, disassembled
by its cuobjdump; each loop (a backward branch and the code it jumps over) is summarised by
instruction class. Static counts: one pass of the loop body, per warp. No GPU needed.

    python benchmarks/codegen/sass_stats.py indexer JOBS.json   # the indexer decode variants below
    python benchmarks/codegen/asm_equivalence.py dump JOBS.json DIR
    python benchmarks/codegen/sass_stats.py report DIR [--json PATH]
"""

from __future__ import annotations

import argparse
import collections
import json
import re
from pathlib import Path

from asm_equivalence import ptxas_sass  # this script's folder is on sys.path when it runs

# opcode (before the first '.') -> class
CLASSES = {
    "mma": ("HGMMA", "QGMMA", "HMMA", "IMMA", "WARPGROUP"),
    "convert": ("F2FP", "F2F", "I2F", "F2I", "I2FP", "PRMT", "HADD2", "HMUL2", "HFMA2"),
    "int": ("LOP3", "SHF", "IADD3", "IMAD", "LEA", "ISETP", "SEL", "IMNMX", "VIADD", "IABS"),
    "fp32": ("FMNMX", "FMUL", "FADD", "FFMA", "FSETP", "FSEL", "MUFU", "FMNMX3"),
    "global": ("LDG", "STG", "LDGSTS", "LDGDEPBAR", "UTMALDG"),
    "shared": ("LDS", "STS", "LDSM", "STSM"),
    "local": ("LDL", "STL"),
    "shuffle": ("SHFL",),
    "sync": ("BAR", "DEPBAR", "WARPSYNC", "SYNCS", "ARRIVES", "MEMBAR"),
}
_CLASS_OF = {op: c for c, ops in CLASSES.items() for op in ops}
_INSN = re.compile(r"/\*([0-9a-f]{4,})\*/\s+(?:@!?U?P\w+\s+)?([A-Z][A-Z0-9_]*)[^;]*;")


def assemble(ptx: Path) -> tuple[dict, list[tuple[int, str, str]]]:
    """ptxas -v facts (registers, spill bytes) and the SASS as (address, opcode, text)."""
    got = ptxas_sass(ptx)
    if got is None:
        raise RuntimeError(f"neither of Triton's ptxas builds assembles {ptx}")
    target, report, sass = got
    info = {"target": target}
    m = re.search(r"Used (\d+) registers", report)
    info["registers"] = int(m.group(1)) if m else None
    m = re.search(r"(\d+) bytes spill stores, (\d+) bytes spill loads", report)
    info["spill_stores"], info["spill_loads"] = (int(m.group(1)), int(m.group(2))) if m else (0, 0)
    insns = []
    for line in sass.splitlines():
        m = _INSN.search(line)
        if m:
            insns.append((int(m.group(1), 16), m.group(2), line.strip()))
    return info, insns


def loops(insns: list[tuple[int, str, str]]) -> list[tuple[int, int]]:
    """(first, last) instruction indices of each loop: a branch to an earlier address."""
    addr_index = {a: i for i, (a, _, _) in enumerate(insns)}
    out = []
    for i, (a, op, text) in enumerate(insns):
        if op != "BRA":
            continue
        m = re.search(r"0x([0-9a-f]+)\s*\)?\s*;", text)
        if not m:
            continue
        target = int(m.group(1), 16)
        if target < a and target in addr_index:
            out.append((addr_index[target], i))
    return out


def summarize(insns, lo: int, hi: int) -> dict:
    counts = collections.Counter(_CLASS_OF.get(op, "other") for _, op, _ in insns[lo : hi + 1])
    ops = collections.Counter(op for _, op, _ in insns[lo : hi + 1])
    return {
        "instructions": hi - lo + 1,
        "classes": dict(counts.most_common()),
        "top": dict(ops.most_common(12)),
    }


def cmd_report(args: argparse.Namespace) -> None:
    rows = {}
    for ptx in sorted(Path(args.dir).glob("*.1.ptx")):
        info, insns = assemble(ptx)
        body = [summarize(insns, lo, hi) for lo, hi in loops(insns)]
        main = max(body, key=lambda b: b["instructions"]) if body else None
        rows[ptx.name[: -len(".1.ptx")]] = {**info, "loops": len(body), "main_loop": main}
    keys = ["mma", "convert", "int", "fp32", "global", "shared", "local", "shuffle", "sync"]
    print(
        f"{'kernel':58} {'regs':>4} {'spill':>5} {'loop':>5} " + " ".join(f"{k:>7}" for k in keys)
    )
    for name, r in rows.items():
        m = r["main_loop"] or {"instructions": 0, "classes": {}}
        cells = " ".join(f"{m['classes'].get(k, 0):>7}" for k in keys)
        spill = r["spill_stores"] + r["spill_loads"]
        print(f"{name:58} {r['registers']:>4} {spill:>5} {m['instructions']:>5} {cells}")
    if args.json:
        Path(args.json).write_text(json.dumps(rows, indent=1))


def cmd_indexer(args: argparse.Namespace) -> None:
    """The paged decode logits variants the indexer's open targets are about, on sm90: e4m3 q
    natively (e4m3 MMAs), with the hardware decode feeding fp16 MMAs (the like-for-like baseline
    of sm80's path) and through the integer decode (fp16 MMAs, sm80's path), H 32 and 64, next_n
    1 and 2, each with the tile choose_paged_config picks for 128 requests."""
    import torch

    from triton_mla_sparse.ops.indexer.heuristics import Arch, block_h_for, choose_paged_config

    arch = Arch("cuda", 90, 132)
    jobs = {}
    for heads, next_n in ((32, 1), (32, 2), (64, 1), (64, 2)):
        c = choose_paged_config(128, next_n, heads, torch.uint8, arch)
        for decode, extra in (
            ("native", {}),
            ("native-fp16mma", {"fp8_mma": False}),  # hardware decode, sm80's MMA type
            ("integer", {"fp8_native": False, "fp8_mma": False}),
        ):
            key = (
                f"paged-H{heads}-nn{next_n}-{decode}-r{c.rows}n{c.block_n}c{c.chunk}s{c.num_stages}"
            )
            jobs[key] = dict(
                op="indexer_paged",
                arch="cuda:90",
                q="e4m3",
                heads=block_h_for(heads),
                next_n=next_n,
                ctx_2d=next_n > 1,
                rows=c.rows,
                block_n=c.block_n,
                chunk=c.chunk,
                num_warps=c.num_warps,
                num_stages=c.num_stages,
                **extra,
            )
    Path(args.out).write_text(json.dumps(jobs, indent=1))
    print(f"{len(jobs)} jobs -> {args.out}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    sub = ap.add_subparsers(dest="cmd", required=True)
    p = sub.add_parser("indexer")
    p.add_argument("out")
    p.set_defaults(fn=cmd_indexer)
    p = sub.add_parser("report")
    p.add_argument("dir")
    p.add_argument("--json")
    p.set_defaults(fn=cmd_report)
    args = ap.parse_args()
    args.fn(args)


if __name__ == "__main__":
    main()
