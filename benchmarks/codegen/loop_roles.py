"""What each SASS instruction of the mma.sync Gluon kernels' top-k loop does, without a GPU.

The main loop (one top-k step) of kernels/ampere_gluon.py, for the tiles the heuristics choose
at the far-target decode shapes (top-k 2048, 64 and 128 tokens, bf16 q, rope 64, valid counts,
LSE): sm80 bf16 rows and fp8_ds_mla at 64 heads, sm89 fp8_ds_mla at 64 heads (its 32-head
tile) and bf16 rows at 16 heads (the only Gluon rows tile there). Each case prints the
instructions of one loop step by role (gather, MMA, shared loads, fp8 decode, softmax, O
rescale, barriers, ...) with their share, ptxas's registers and spill bytes, the LDGSTS / LDG
counts and, for each index load, how many instructions issue before its value is first used.
Static counts of one pass of the body per warp: no stalls, no issue rates.

Method. The kernels are compiled for the target as the runtime would (tests/aot_compile.py,
the compile test's worker, into a fresh Triton cache under --out so that no cached kernel of
another source tree lends its line info), the PTX assembled by Triton's own ptxas twice (with
and without -lineinfo: the opcode streams are checked to be identical) and the -lineinfo cubin
disassembled by nvdisasm -gi, which gives each instruction its source line with the whole
inlining chain. The loop is the body of the largest backward branch. Roles come from the
source: an instruction is gather if any frame of its chain is a gather helper (_rows,
_gather*), or its kernel-level statement is the gather call (the ring-slot arguments),
commit_group / wait_group, the validity store or ``w0 = w_lo + ...``; the other roles by
opcode and statement (see ``line_role``). A data-flow cross-check follows: the backward slice,
over the cyclic body, from the gather's memory operations (index LDG, LDGSTS, (LDG)DEPBAR, the
validity STS.U8); an instruction in it is gather-exclusive if none of its values reaches a
non-gather instruction, else shared (loop counter, slot index). The final role: gather by line
and in the slice (or itself a gather memory operation), else "smem address / MMA glue"
(ldmatrix swizzle XORs ptxas schedules amid the gather); not gather by line but
gather-exclusive by flow: gather. Uncertainty: ptxas tags rematerialized or hoisted values
with the line it likes (shared addresses carry the loop's own line, so they count as glue);
the register data flow is approximate (operand widths from opcode suffixes, predicates kept
conservatively), which is why both attributions print: they agree within a few instructions
(within 1.5% of the step under Triton 3.6 and 3.8). Instructions ptxas leaves without a source
line (line 0; under Triton 3.6, e.g., the split-qk partial-S sums) count as "other" unless the
flow makes them gather: a large "other" means line info was lost, not work unaccounted for.

    python benchmarks/codegen/loop_roles.py --out DIR [--arch 80,89] [--triton PATH] [--dump S]
        [--set FLAG ...]
    python benchmarks/codegen/loop_roles.py report DIR [--dump S]

The first compiles (DIR/asm, DIR/triton-cache, DIR/jobs.json) and prints the tables (also in
DIR/report.txt); ``--triton PATH``: a folder holding another Triton, put first on PYTHONPATH
for the whole run (heuristics, compile, ptxas). ``--set FLAG``: a boolean KernelConfig field (e.g. row_offsets_32) set on every tile, to count
a variant against the default. ``report`` reads the ``*.1.ptx`` of an existing
dump (DIR/asm or DIR, e.g. ``asm_equivalence.py dump``'s of another tree) whose kernel is an
mma.sync Gluon one; the source lines are read from the paths the PTX names. ``--dump S``
also prints the annotated loop body of the cases whose name contains S.
"""

from __future__ import annotations

import argparse
import ast
import collections
import functools
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

from asm_equivalence import _nvidia_tool, ptxas_sass  # this script's folder is on sys.path

ROOT = Path(__file__).resolve().parents[2]
# a source file of the kernels (any tree: the paths come from the PTX's line info)
KERNELS = "/triton_mla_sparse/ops/sparse_mla/kernels/"

# (format, heads) per target: the shapes whose tiles are measured (heads pick the tile)
SHAPES = {80: (("auto", 64), ("fp8_ds_mla", 64)), 89: (("fp8_ds_mla", 64), ("auto", 16))}
TOKENS = (64, 128)
# the serving call around them (as tests/aot_compile.py compiles it: bf16 q, rope 64, paged
# cache of 64-row pages, valid counts, LSE stored for the merge)
SERVING = dict(
    latent=512,
    rope=64,
    width=2048,
    on_gpu=True,
    page_size=64,
    has_counts=True,
    store_lse=True,
)
TILE = ("block_h", "block_n", "num_warps", "num_stages")
# the KernelConfig fields tests/aot_compile.py takes as job keys besides the tile
FLAGS = (
    "stage_dequant",
    "idx_ahead",
    "fp16_mma",
    "e4m3_decode",
    "fp16_fold",
    "gluon",
    "max_registers",
    "q_rope_in_registers",
    "split_qk",
    "row_offsets_32",
)


# ---------------------------------------------------------------- jobs and compile
def make_jobs(ccs: list[int], flags: tuple[str, ...] = ()) -> dict[str, dict]:
    """aot_compile.py jobs for the Gluon tiles ``make_plan`` picks at the SHAPES: one per
    distinct tile, named by the token counts that pick it (the split flag: the first's), with
    the boolean KernelConfig fields ``flags`` set on each (a variant's counts)."""
    import torch

    from triton_mla_sparse.ops.sparse_mla.heuristics import TARGETS
    from triton_mla_sparse.ops.sparse_mla.plan import make_plan

    named = {}  # job (less its split flag) -> (name, token counts picking it, job)
    for cc in ccs:
        arch = next(a for a in TARGETS if a.backend == "cuda" and a.cc == cc)
        for fmt, heads in SHAPES[cc]:
            for tokens in TOKENS:
                c = make_plan(
                    num_tokens=tokens,
                    num_heads=heads,
                    kv_format=fmt,
                    arch=arch,
                    dtype=torch.bfloat16,
                    **SERVING,
                ).config
                if c.gluon != "ampere":  # the heuristics moved this shape off the kernel
                    print(f"sm{cc} {fmt} {heads} heads {tokens} tokens: not ampere_gluon, skipped")
                    continue
                job = {f: getattr(c, f) for f in TILE + FLAGS if getattr(c, f) not in (None, False)}
                job.update(dict.fromkeys(flags, True))
                job.update(arch=f"cuda:{cc}", dtype="bf16", fmt=fmt, rope=64, has_bt=False)
                job.update(has_counts=True, store_lse=True)
                tile = f"h{c.block_h}n{c.block_n}w{c.num_warps}s{c.num_stages}"
                name = f"sm{cc}-{'bf16' if fmt == 'auto' else fmt}-H{heads}-{tile}"
                name += "-splitqk" if c.split_qk else ""
                name += "".join(f"-{f}" for f in flags)
                entry = named.setdefault(
                    (heads, json.dumps(job, sort_keys=True)),
                    (name, [], dict(job, split=c.num_splits > 1)),
                )
                entry[1].append(tokens)
    return {f"{n}-T{'+'.join(map(str, t))}": job for n, t, job in named.values()}


def compile_jobs(jobs: dict[str, dict], out: Path) -> Path:
    """Compile with this tree's tests/aot_compile.py and src/ (a fresh process: the jit picks
    the interpreter at import) into a fresh cache; returns the folder of the PTX dumps."""
    asm, cache = out / "asm", out / "triton-cache"
    for d in (asm, cache):
        shutil.rmtree(d, ignore_errors=True)
        d.mkdir(parents=True)
    (out / "jobs.json").write_text(json.dumps(jobs, indent=1))
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    path = [str(ROOT / "src"), env.get("PYTHONPATH", "")]
    env.update(
        PYTHONPATH=os.pathsep.join(filter(None, path)),
        TRITON_CACHE_DIR=str(cache),
        TMS_ASM_DIR=str(asm),
    )
    worker = [sys.executable, str(ROOT / "tests" / "aot_compile.py")]
    subprocess.run(
        [*worker, str(out / "jobs.json"), str(out / "results.json")], env=env, check=True
    )
    results = json.loads((out / "results.json").read_text())
    errors = [
        f"{k} {n}: {r['error']}"
        for k, res in results.items()
        for n, r in res.items()
        if "error" in r
    ]
    if errors:
        sys.exit("compile errors:\n" + "\n".join(errors))
    return asm


# ---------------------------------------------------------------- source lines
@functools.cache
def _source(path: str) -> tuple[list[str], list[tuple], list[tuple]]:
    """(lines, function spans (start, end, name), simple-statement spans (start, end))."""
    text = Path(path).read_text()
    funcs, stmts = [], []
    for node in ast.walk(ast.parse(text)):
        if isinstance(node, ast.FunctionDef):
            funcs.append((node.lineno, node.end_lineno, node.name))
        compound = (ast.FunctionDef, ast.If, ast.For, ast.While, ast.With)
        if isinstance(node, ast.stmt) and not isinstance(node, compound):
            stmts.append((node.lineno, node.end_lineno))
    return text.splitlines(), funcs, stmts


def src_func(path: str, line: int) -> str:
    """The innermost function holding the line."""
    best = max((f for f in _source(path)[1] if f[0] <= line <= f[1]), default=None)
    return best[2] if best else "?"


def src_stmt(path: str, line: int) -> str:
    """The innermost simple statement holding the line, joined (the line itself for compound
    headers such as ``for i_step in range(...)``)."""
    lines, _, stmts = _source(path)
    inside = [s for s in stmts if s[0] <= line <= s[1]]
    if not inside:
        return lines[line - 1].strip()
    a, b = min(inside, key=lambda s: s[1] - s[0])
    return " ".join(x.strip() for x in lines[a - 1 : b])


def is_kernel_src(path: str) -> bool:
    return KERNELS in path.replace(os.sep, "/")


# ---------------------------------------------------------------- assemble, disassemble, parse
INSN = re.compile(r"^\s+/\*([0-9a-f]{4,})\*/\s+(.*?)\s*;")
FILE = re.compile(r'//## File "([^"]+)", line (\d+)')
LABEL_REF = re.compile(r"0x[0-9a-f]+|`\(\.L_x_\d+\)")


def assemble(ptx: Path, work: Path) -> tuple[dict, str]:
    """ptxas -v facts and nvdisasm -gi text of the -lineinfo cubin (checked to be the same
    code as without -lineinfo: line info must not change what is measured)."""
    got = ptxas_sass(ptx)  # the ptxas -v report and SASS as at run time
    if got is None:
        raise RuntimeError(f"neither of Triton's ptxas builds assembles {ptx}")
    target, rep, sass = got
    li = work / "li.cubin"
    run = functools.partial(subprocess.run, capture_output=True, text=True, check=True)
    run([_nvidia_tool("ptxas"), "-lineinfo", f"-arch={target}", str(ptx), "-o", str(li)])
    dis = run([_nvidia_tool("nvdisasm"), "-c", "-gi", str(li)]).stdout
    norm = [LABEL_REF.sub("L", m.group(2)) for m in map(INSN.match, sass.splitlines()) if m]
    assert [LABEL_REF.sub("L", t) for _, t, _ in parse(dis)] == norm, "-lineinfo changed code"

    def num(pattern: str) -> tuple[int, ...]:
        m = re.search(pattern, rep)
        return tuple(map(int, m.groups())) if m else (0,)

    info = dict(target=target, regs=num(r"Used (\d+) registers")[0])
    info["spill"] = num(r"(\d+) bytes spill stores, (\d+) bytes spill loads")
    info["stack"] = num(r"(\d+) bytes stack frame")[0]
    return info, dis


def parse(dis: str) -> list[tuple[int, str, list[tuple[str, int]]]]:
    """[(address, text, chain)]: chain [(path, line)], innermost frame first."""
    out, chain, fresh = [], [], True
    for line in dis.splitlines():
        if m := FILE.search(line):
            if fresh:  # the first //## line after an instruction starts a new chain
                chain, fresh = [], False
            chain.append((m.group(1), int(m.group(2))))
        elif m := INSN.match(line):
            out.append((int(m.group(1), 16), m.group(2), list(chain)))
            fresh = True
    return out


def opcode(text: str) -> str:
    t = text.split()
    return t[1] if t[0].startswith("@") else t[0]


def find_loop(dis: str, insns: list) -> tuple[int, int]:
    """(first, last) index of the largest backward branch's body (nvdisasm's labels resolved
    to the address of the instruction after them)."""
    label_addr, pending = {}, []
    for line in dis.splitlines():
        if m := re.match(r"^(\.L_x_\d+):", line):
            pending.append(m.group(1))
        elif m := INSN.match(line):
            label_addr.update((lab, int(m.group(1), 16)) for lab in pending)
            pending = []
    index = {a: i for i, (a, _, _) in enumerate(insns)}
    best = (0, -1)
    for i, (a, text, _) in enumerate(insns):
        m = re.search(r"`\((\.L_x_\d+)\)", text)
        if opcode(text).startswith("BRA") and m and label_addr.get(m.group(1), a + 1) < a:
            lo = index[label_addr[m.group(1)]]
            if i - lo > best[1] - best[0]:
                best = (lo, i)
    return best


# ---------------------------------------------------------------- roles by source line
GATHER_FUNCS = {
    "_rows",
    "_gather",
    "_gather_scales",
    "_gather_chunks",
    "_gather_ds",
    "_gather_latent",
}
DECODE_FUNCS = {"_e4m3_to_f16", "_pow2_ref"}
# kernel statements by role (names of kernels/ampere_gluon.py)
DECODE_STMT = re.compile(
    r"b_sc\b|b_scm|b_rel|b_k8|b_h = |k_s\.slice.*store|b_kh|sc_t|b_v = |b_rel3|k_s\.store|b_ref_new = "
)
SOFTMAX_STMT = re.compile(
    r"m_s|b_m_new|b_m_use|b_alpha|b_p = |b_lacc|b_l = |b_m = |b_ref = |qk_scale|b_o = b_o \*"
    r"|b_o3 = b_o3 \*|b_s = b_sn|b_s = b_s \+ b_sr|alpha_s"
)
RESCALE_STMT = re.compile(r"b_o = b_o \*|b_o3 = b_o3 \*|alpha_s")


def frames(chain: list) -> list[tuple[int, str]]:
    """(line, function) per frame; Triton's own library frames as ``triton:<file>``."""
    return [
        (ln, src_func(p, ln) if is_kernel_src(p) else "triton:" + Path(p).name) for p, ln in chain
    ]


def kernel_stmt(chain: list) -> tuple[str, int]:
    """The kernel-level (outermost sparse_mla_* frame) statement and its line."""
    for p, ln in reversed(chain):
        if is_kernel_src(p) and src_func(p, ln).startswith("sparse_mla_"):
            return src_stmt(p, ln), ln
    return "", 0


def line_role(text: str, chain: list) -> str:
    op = opcode(text)
    fr = frames(chain)
    funcs = {f for _, f in fr}
    stmt, _ = kernel_stmt(chain)
    if op == "NOP":
        return "other:nop"
    if funcs & GATHER_FUNCS or re.search(r"\b_gather\w*\(", stmt):
        return "gather"
    if "commit_group" in stmt or "wait_group" in stmt:
        return "gather"
    if "store(m_next" in stmt or re.match(r"w0 = w_lo", stmt):
        return "gather"
    if op.startswith("HMMA"):
        return "mma"
    if op.startswith("BAR"):
        return "barrier"
    if op.startswith(("LDSM", "LDS")):
        return "validity read (LDS)" if "v_s.index" in stmt else "smem load"
    if funcs & DECODE_FUNCS or DECODE_STMT.search(stmt):
        return "fp8 decode/dequant" + (" (STS K tile)" if op.startswith("STS") else "")
    if op.startswith("STS"):
        return "smem store (P/S exchange)"
    inner = fr[0][1] if fr else "?"
    if SOFTMAX_STMT.search(stmt) or (
        inner.startswith("triton:") and op.startswith(("FMNMX", "SHFL", "FADD", "FSEL"))
    ):
        return "softmax"
    if any(s in stmt for s in ("convert_layout", "_sum_partial_s", "b_pa", "p_s.store")):
        return "layout/P convert"
    if "for i_step" in stmt and op.startswith(("LOP3", "LEA", "IMAD", "IADD3", "MOV", "SHF")):
        # per-thread shared-memory (ldmatrix swizzle) offsets that ptxas rematerializes in the
        # loop under register pressure; ptxas tags them with the loop's line
        return "smem address / MMA glue"
    if (
        "for i_step" in stmt
        or re.match(r"(r_)?slot = i_step", stmt)
        or op == "BRA"
        or op.startswith(("UISETP", "CALL"))
    ):
        return "loop control"
    if any(s in stmt for s in ("_qk_nope", "mma_v2", "_pv_chunks", "load(")):
        return "smem address / MMA glue"
    return "other"


# ---------------------------------------------------------------- data flow (cross-check)
REG = re.compile(r"\b(U?R\d+|U?P\d)(\.64)?\b")
NO_DEST = {"ST", "STS", "STG", "STL", "LDGSTS", "BAR", "BRA", "EXIT", "DEPBAR", "LDGDEPBAR"}
NO_DEST |= {"RED", "CALL", "NOP", "WARPSYNC", "BSSY", "BSYNC", "MEMBAR", "RET", "ATOMS"}
TWO_PRED_DEST = ("ISETP", "FSETP", "UISETP", "PSETP", "HSETP2", "DSETP", "PLOP3", "UPLOP3")


def _regs(tok: str, width: int) -> set[str]:
    """A register operand and the ``width`` - 1 registers after it (64/128-bit operands)."""
    m = re.match(r"(U?R)(\d+)", tok)
    return {f"{m.group(1)}{int(m.group(2)) + k}" for k in range(width)} if m else {tok}


def defs_uses(text: str) -> tuple[set[str], set[str], bool]:
    """(registers written, registers read, predicated): approximate SASS operand semantics,
    widths from the opcode's suffixes."""
    t, guard = text, set()
    if t.startswith("@"):
        g, t = t.split(None, 1)
        if "PT" not in g:
            guard = {g.lstrip("@!")}
    parts = t.split(None, 1)
    op = parts[0]
    ops = [x.strip() for x in parts[1].split(",")] if len(parts) > 1 else []
    base = op.split(".")[0]
    d, u = set(), set(guard)
    n_dest = 0
    if base not in NO_DEST and ops:
        if base in TWO_PRED_DEST:
            n_dest = 2
        elif (base in ("SHFL", "VOTE") and ops[0] == "PT") or re.match(r"U?P\d", ops[0]):
            n_dest = 2 if base in ("SHFL", "LOP3", "ULOP3") else 1
        else:
            n_dest = 1  # then carry-outs right after the destination
            while n_dest < len(ops) and re.fullmatch(r"U?P\d", ops[n_dest]) and ".X" not in op:
                n_dest += 1
    dwidth = 1
    if base == "HMMA":
        f32 = ".F32" in op.split("16816")[-1][:4] or op.endswith(".F32") or ".F32." in op
        dwidth = 4 if f32 else 2
    elif ".WIDE" in op or ".64" in op:
        dwidth = 2
    elif ".128" in op or (base == "LDSM" and op.endswith(".4")):
        dwidth = 4
    elif base == "LDSM" and op.endswith(".2"):
        dwidth = 2
    for k, o in enumerate(ops):
        for name, w64 in REG.findall(o):
            if k < n_dest and not o.startswith("["):
                d |= _regs(name, dwidth if name.startswith(("R", "UR")) else 1)
                continue
            w = 2 if w64 else 1
            stored = base in ("STS", "STG", "ST") and not o.startswith("[")  # the value stored
            if base == "HMMA":  # A (4 registers), B (2), C (as D)
                w = {n_dest: 4, n_dest + 1: 2, n_dest + 2: dwidth}.get(k, 1)
            elif stored and ".128" in op:
                w = 4
            elif (stored and ".64" in op) or (".WIDE" in op and k == len(ops) - 1):
                w = 2
            u |= _regs(name, w)
    if base in ("P2R", "R2P") and len(ops) >= 3:
        m = re.search(r"0x([0-9a-f]+)", ops[-1])
        mask = int(m.group(1), 16) if m else 0x7F
        ps = {f"P{k}" for k in range(7) if mask >> k & 1}
        if base == "P2R":
            u |= ps
        else:
            d = ps
    d = {x for x in d if x not in ("PT", "RZ", "URZ")}
    return d, u, bool(guard)


def backward_slice(du: list, seeds: set[int]) -> set[int]:
    """Indices whose values (transitively, around the cyclic body) reach a seed instruction."""
    marked, needed = set(seeds), set()
    for _ in range(8):  # passes around the loop; converges in two or three
        before = (len(marked), frozenset(needed))
        for i in range(len(du) - 1, -1, -1):
            d, u, guarded = du[i]
            if i in marked or d & needed:
                marked.add(i)
                if not guarded:  # a predicated write may not happen: the older value lives
                    needed -= d
                needed |= u
        if (len(marked), frozenset(needed)) == before:
            break
    return marked


def flow_roles(body: list, du: list) -> list[str]:
    """Per instruction: "gather" (only feeds the gather), "shared" or "non-gather"."""
    sinks = {
        i
        for i, (_, t, ch) in enumerate(body)
        if opcode(t).startswith(("LDG.", "LDGSTS", "LDGDEPBAR", "DEPBAR"))
        or (opcode(t).startswith("STS") and "store(m_next" in kernel_stmt(ch)[0])
    }
    gather = backward_slice(du, sinks)
    other = backward_slice(du, set(range(len(body))) - gather)
    return [
        "non-gather" if i not in gather else "shared" if i in other else "gather"
        for i in range(len(body))
    ]


# ---------------------------------------------------------------- report
ORDER = [
    "gather",
    "mma",
    "smem load",
    "validity read (LDS)",
    "fp8 decode/dequant",
    "fp8 decode/dequant (STS K tile)",
    "softmax",
    "O rescale",
    "barrier",
    "layout/P convert",
    "smem store (P/S exchange)",
    "smem address / MMA glue",
    "loop control",
    "other",
    "other:nop",
]
GATHER_OPS = ("LDG.", "LDGSTS", "LDGDEPBAR", "DEPBAR", "STS.U8")


def final_role(text: str, chain: list, line: str, flow: str) -> str:
    if line == "gather":
        if (
            flow != "non-gather"
            or opcode(text).startswith(GATHER_OPS)
            or text.startswith("@!PT LDS")
        ):
            return "gather"
        return "smem address / MMA glue"  # e.g. ldmatrix swizzle XORs scheduled amid the gather
    if flow == "gather":
        return "gather"
    if line == "softmax" and RESCALE_STMT.search(kernel_stmt(chain)[0]):
        return "O rescale"
    return line


def gather_part(text: str, chain: list) -> str:
    """Which part of the gather an instruction serves (by its innermost statement)."""
    p, ln = chain[0] if chain else ("", 0)
    st = src_stmt(p, ln) if is_kernel_src(p) else ""
    kst, op = kernel_stmt(chain)[0], opcode(text)
    if op.startswith(("LDGDEPBAR", "DEPBAR")) or "commit_group" in kst or "wait_group" in kst:
        return "commit/wait"
    if "store(m_next" in kst:
        return "validity byte store (SEL+STS.U8)"
    if re.match(r"o_w =|b_idx = gl.load", st):
        return "index load (LDG + its address, bound)"
    if re.match(r"m_n =|b_idx = gl.where", st):
        return "validity (-1 / num_rows) compare+select"
    if re.match(r"b_page|b_slot|o_row =", st):
        return "page/slot -> int64 row offset"
    if op.startswith("LDGSTS") or text.startswith("@!PT LDS"):
        return "LDGSTS (+@!PT LDS pads)"
    return "pointer add / smem dst / predicate (cp.async operands)"


def analyze(ptx: Path, work: Path, dump: bool = False) -> list[str]:
    """The report lines of one kernel (and its annotated loop body first, with ``dump``)."""
    info, dis = assemble(ptx, work)
    insns = parse(dis)
    lo, hi = find_loop(dis, insns)
    body = insns[lo : hi + 1]
    du = [defs_uses(t) for _, t, _ in body]
    lines_ = [line_role(t, ch) for _, t, ch in body]
    flow = flow_roles(body, du)
    roles = [final_role(t, ch, c, f) for (_, t, ch), c, f in zip(body, lines_, flow)]
    ops = [opcode(t) for _, t, _ in body]
    n, out = len(body), []
    if dump:
        for (a, t, ch), c, f in zip(body, roles, flow):
            st, ln = kernel_stmt(ch)
            fr = "/".join(f"{fn}:{line}" for line, fn in frames(ch)[:-1])
            out.append(f"{a:05x} {c[:22]:22} {f[:10]:10} {t[:60]:60} | {ln} {fr[:50]} | {st[:70]}")

    def count(*prefixes: str) -> int:
        return sum(o.startswith(prefixes) for o in ops)

    lds = sum(o.startswith("LDS") and not t.startswith("@!PT") for o, (_, t, _) in zip(ops, body))
    out.append(
        f"=== {ptx.name[: -len('.1.ptx')]} ({info['target']}): {info['regs']} regs, "
        f"spill st/ld {info['spill'][0]}/{info['spill'][-1]} B, stack {info['stack']} B; "
        f"loop {body[0][0]:#x}-{body[-1][0]:#x}: {n} instructions a step, HMMA {count('HMMA')}, "
        f"LDSM/LDS {lds}, LDGSTS {count('LDGSTS')}, LDG {count('LDG.')}, BAR {count('BAR')}"
    )
    by_op = collections.defaultdict(collections.Counter)
    for c, o in zip(roles, ops):
        by_op[c][o.split(".")[0]] += 1
    tally = collections.Counter(roles)
    for c in ORDER + sorted(set(tally) - set(ORDER)):
        if k := tally[c]:
            top = ", ".join(f"{o} {v}" for o, v in by_op[c].most_common(9))
            out.append(f"  {c:38} {k:4} {100 * k / n:5.1f}%   [{top}]")
    parts = collections.Counter(
        gather_part(t, ch) for (_, t, ch), c in zip(body, roles) if c == "gather"
    )
    out.append("  gather split: " + "; ".join(f"{k} {v}" for k, v in parts.most_common()))
    # how far each index load issues ahead of its first use (the latency it can hide)
    use = []
    for i in (i for i, o in enumerate(ops) if o.startswith("LDG.")):
        j = next((j for j in range(i + 1, n) if du[j][1] & du[i][0]), None)
        if j is not None:
            between = ops[i:j]
            bars = sum(o.startswith(("BAR", "DEPBAR")) for o in between)
            use.append(f"{j - i}/{bars}/{sum(o.startswith('HMMA') for o in between)}")
    head = "  index LDG -> first use (instructions, BAR/DEPBAR between, HMMA between): "
    out.append(head + ", ".join(use))
    g_line = lines_.count("gather")
    g_flow, g_shared = flow.count("gather"), flow.count("gather") + flow.count("shared")
    out.append(
        f"  gather by source line only: {g_line} ({100 * g_line / n:.1f}%); by data flow only: "
        f"exclusive {g_flow} ({100 * g_flow / n:.1f}%), +shared {g_shared} ({100 * g_shared / n:.1f}%)"
    )
    return out


def report(folder: Path, dump: str = "") -> list[str]:
    """Report every mma.sync Gluon kernel's ``*.1.ptx`` in ``folder`` (or its ``asm/``)."""
    if (folder / "asm").is_dir():
        folder = folder / "asm"
    ptxs = [
        p
        for p in sorted(folder.glob("*.1.ptx"))
        if re.search(r"\.entry\s+\w*ampere_gluon", p.read_text())
    ]
    if not ptxs:
        sys.exit(f"no mma.sync Gluon kernel (*.1.ptx) in {folder}")
    import triton

    out = [f"Triton {triton.__version__} ({Path(triton.__file__).parent}): ptxas, nvdisasm"]
    print(out[0], flush=True)
    with tempfile.TemporaryDirectory() as work:
        for ptx in ptxs:
            lines = analyze(ptx, Path(work), bool(dump) and dump in ptx.name)
            print("\n".join(lines), flush=True)
            out += lines
    return out


def main() -> None:
    if sys.argv[1:2] == ["report"]:
        ap = argparse.ArgumentParser(prog="loop_roles.py report", description="report a dump")
        ap.add_argument("dir", type=Path)
        ap.add_argument("--dump", default="", help="annotated loop body of cases matching this")
        args = ap.parse_args(sys.argv[2:])
        report(args.dir, args.dump)
        return
    ap = argparse.ArgumentParser(
        description=__doc__.split("\n")[0], epilog="loop_roles.py report DIR: an existing dump"
    )
    ap.add_argument("--out", type=Path, required=True, help="folder for the compile and report")
    ap.add_argument("--arch", default="80,89", help=f"targets, of {sorted(SHAPES)}")
    ap.add_argument("--triton", default="", help="a folder holding another Triton, put first")
    ap.add_argument("--dump", default="", help="annotated loop body of cases matching this")
    ap.add_argument(
        "--set",
        action="append",
        default=[],
        choices=[f for f in FLAGS if f not in ("e4m3_decode", "gluon", "max_registers")],
        help="a boolean KernelConfig field to set on every tile (repeatable): a variant's counts",
    )
    args = ap.parse_args()
    if args.triton:  # run everything (heuristics, compile, ptxas) under that Triton
        env = dict(os.environ)
        env["PYTHONPATH"] = os.pathsep.join(filter(None, [args.triton, env.get("PYTHONPATH")]))
        argv = [sys.executable, __file__, "--out", str(args.out), "--arch", args.arch]
        argv += ["--dump", args.dump] * bool(args.dump) + [
            a for f in args.set for a in ("--set", f)
        ]
        os.execve(sys.executable, argv, env)
    sys.path.insert(0, str(ROOT / "src"))  # this tree's heuristics, as its src/ is compiled
    args.out.mkdir(parents=True, exist_ok=True)
    jobs = make_jobs([int(a) for a in args.arch.split(",")], tuple(args.set))
    print(f"{len(jobs)} tiles: compiling into {args.out}", flush=True)
    lines = report(compile_jobs(jobs, args.out), args.dump)
    (args.out / "report.txt").write_text("\n".join(lines) + "\n")


if __name__ == "__main__":
    main()
