"""Does a refactor change the generated code? Compile a job set at two source trees, diff the PTX.

A kernel refactor that leaves every PTX (AMDGCN on AMD) unchanged, up to kernel names and debug
line info, changes nothing a GPU could observe: every result measured on the GPU (sanitizers,
correctness, timings) carries over. That is what this checks, without a GPU, through the same
ahead-of-time path as tests/test_compile.py (tests/aot_compile.py records the real launcher's
calls and compiles them with ``triton.compile``).

    python benchmarks/codegen/asm_equivalence.py jobs JOBS.json [--full cuda:90,cuda:80]
    python benchmarks/codegen/asm_equivalence.py dump JOBS.json DIR [--tree PATH] [--workers 2]
        [--triton DIR]
    python benchmarks/codegen/asm_equivalence.py diff DIR_A DIR_B

``jobs``: the compile test's default job set (this checkout's tests/test_compile.py, loaded by
file path), plus every configuration the heuristics choose for the ``--full`` targets (rope 64,
serving flags; the V4 record rope 0). ``dump``: compile it with the source tree at PATH (default: this checkout; for
the old side of a comparison, a ``git worktree`` of the old revision): the compile workers run
that tree's ``tests/aot_compile.py`` with its ``src`` on their PYTHONPATH (after ``--triton``,
a folder holding another Triton, if given), and write one file per kernel into DIR. ``diff``:
compare two dumps file by file: identical PTX (up to names and line info), else identical SASS
(both assembled by Triton's own ptxas, disassembled by its cuobjdump: PTX can differ in the
order of independent instructions and hence register numbers, when helper inlining moves where
an index expression is materialized), else different; exit 1 on any difference.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def _compile_test():
    """tests/test_compile.py of this checkout, whose job set (make_jobs) the compile test runs."""
    import importlib.util

    path = ROOT / "tests" / "test_compile.py"
    if str(path.parent) not in sys.path:  # it imports its folder's conftest, as under pytest
        sys.path.insert(0, str(path.parent))
    spec = importlib.util.spec_from_file_location("tms_compile_test", path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def cmd_jobs(args: argparse.Namespace) -> None:
    from triton_mla_sparse.ops.sparse_mla.heuristics import TARGETS

    tc = _compile_test()

    jobs = dict(tc.make_jobs())
    full = set(filter(None, args.full.split(",")))
    for arch in TARGETS:
        if tc.arch_name(arch) in full:
            for cfg in sorted(tc.chosen(arch)):
                # rope 64 as the DSA models serve it; the V4 record has none (one 512-wide row)
                key, job = tc._job(arch, cfg, 0 if cfg[5] == tc.V4 else 64)
                jobs[key] = job
    Path(args.out).write_text(json.dumps(jobs, indent=1))
    print(f"{len(jobs)} jobs -> {args.out}")


def cmd_dump(args: argparse.Namespace) -> None:
    tree = Path(args.tree).resolve()
    out = Path(args.dir).resolve()
    out.mkdir(parents=True, exist_ok=True)
    jobs = json.loads(Path(args.jobs).read_text())
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [args.triton, str(tree / "src")]))
    env["TMS_ASM_DIR"] = str(out)
    keys = sorted(jobs)
    procs = []
    for i in range(args.workers):
        part = {k: jobs[k] for k in keys[i :: args.workers]}
        jp, rp = out / f"_jobs{i}.json", out / f"_results{i}.json"
        jp.write_text(json.dumps(part))
        worker = str(tree / "tests" / "aot_compile.py")
        procs.append(subprocess.Popen([sys.executable, worker, str(jp), str(rp)], env=env))
    if any(p.wait() for p in procs):
        sys.exit("a compile worker failed")
    errors = {}
    for i in range(args.workers):
        for key, res in json.loads((out / f"_results{i}.json").read_text()).items():
            for name, r in res.items():
                if "error" in r:
                    errors[f"{key} {name}"] = r["error"][-300:]
    print(f"{len(jobs)} jobs compiled into {out}; {len(errors)} errors")
    for k, e in errors.items():
        print(f"  {k}: {e}")


# labels only the line info refers to (one per inlined helper's scope): PTX, AMDGCN
_DEBUG_LABEL = re.compile(r"^(\$L__tmp|\.Ltmp)\d+:$")
_ENTRY = re.compile(r"^\s*(?:\.visible\s+)?\.entry\s+(\w+)|^\s*\.globl\s+(\w+)", re.M)


def normalize(text: str, amdgcn: bool = False) -> str:
    """The code without what a rename or a moved source line changes: kernel names, .loc/.file
    lines and the labels only they use, DWARF sections, comments and alignment padding.
    AMDGCN: everything from the first DWARF section on (line tables, then the metadata note
    whose register counts the kernel descriptor, kept, states too) is dropped."""
    names = {a or b for a, b in _ENTRY.findall(text)}
    lines = []
    in_debug = False
    for line in text.splitlines():
        if amdgcn:
            line = line.split(";", 1)[0]  # AMDGCN comments; PTX ends statements with ';'
        s = " ".join(line.split())
        if s.startswith(".section") and ".debug" in s:
            if amdgcn:
                break
            in_debug = True
        if in_debug:
            if s == "}":
                in_debug = False
            continue
        if s.startswith((".loc", ".file", "//")) or not s or _DEBUG_LABEL.match(s):
            continue
        lines.append(s)
    body = "\n".join(lines)
    for i, n in enumerate(sorted(names, key=len, reverse=True)):
        body = body.replace(n, f"KERNEL{i}")
    return body


def _nvidia_tool(name: str) -> str:
    import triton

    return str(Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / name)


def ptxas_sass(ptx: Path) -> tuple[str, str, str] | None:
    """(target, ptxas -v report, cuobjdump SASS) of a PTX file, assembled by Triton's own ptxas
    as at run time; None where neither of Triton's ptxas builds takes the target."""
    target = re.search(r"^\.target\s+(\w+)", ptx.read_text(), re.M).group(1)
    with tempfile.TemporaryDirectory() as tmp:
        cubin = os.path.join(tmp, "k.cubin")
        for ptxas in ("ptxas", "ptxas-blackwell"):
            cmd = [_nvidia_tool(ptxas), "-v", f"-arch={target}", str(ptx), "-o", cubin]
            p = subprocess.run(cmd, capture_output=True, text=True)
            if p.returncode == 0:
                break
        else:
            return None
        text = subprocess.run(
            [_nvidia_tool("cuobjdump"), "-sass", cubin], capture_output=True, text=True
        ).stdout
    return target, p.stderr, text


def sass(ptx: Path) -> str | None:
    """The SASS of a PTX file (ptxas_sass), kernel names normalized."""
    got = ptxas_sass(ptx)
    if got is None:
        return None
    text = got[2]
    names = set(re.findall(r"Function : (\w+)", text))
    body = "\n".join(x for x in text.splitlines() if "Function :" not in x)
    for i, n in enumerate(sorted(names, key=len, reverse=True)):
        body = body.replace(n, f"KERNEL{i}")
    return body


def cmd_diff(args: argparse.Namespace) -> None:
    a, b = Path(args.a), Path(args.b)
    fa = {p.name for p in a.iterdir() if not p.name.startswith("_")}
    fb = {p.name for p in b.iterdir() if not p.name.startswith("_")}
    only = sorted(fa ^ fb)
    same, same_sass, diff = [], [], []
    for name in sorted(fa & fb):
        amd = name.endswith(".amdgcn")
        ta, tb = (normalize((d / name).read_text(), amd) for d in (a, b))
        if ta == tb:
            same.append(name)
        elif name.endswith(".ptx") and (sa := sass(a / name)) is not None and sa == sass(b / name):
            same_sass.append(name)
        else:
            diff.append(name)
    print(
        f"{len(same)} identical, {len(same_sass)} with another PTX but identical SASS, "
        f"{len(diff)} different, {len(only)} in one dump only"
    )
    for n in same_sass:
        print(f"  same SASS: {n}")
    for n in diff:
        print(f"  differs: {n}")
    for n in only:
        print(f"  only in {'A' if n in fa else 'B'}: {n}")
    sys.exit(1 if diff or only else 0)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    sub = ap.add_subparsers(dest="cmd", required=True)
    p = sub.add_parser("jobs")
    p.add_argument("out")
    p.add_argument("--full", default="cuda:90,cuda:80", help="targets compiled in full")
    p.set_defaults(fn=cmd_jobs)
    p = sub.add_parser("dump")
    p.add_argument("jobs")
    p.add_argument("dir")
    p.add_argument("--tree", default=str(ROOT), help="source tree to compile (default: this one)")
    p.add_argument("--workers", type=int, default=2)
    p.add_argument("--triton", default="", help="a folder holding another Triton, put first")
    p.set_defaults(fn=cmd_dump)
    p = sub.add_parser("diff")
    p.add_argument("a")
    p.add_argument("b")
    p.set_defaults(fn=cmd_diff)
    args = ap.parse_args()
    args.fn(args)


if __name__ == "__main__":
    main()
