"""benchmarks/reliability/reliability.py and benchmarks/reliability/ptx_jit.py stay alive on CPU
(the GPU runs are in docs/RELIABILITY.md).

The script runs in subprocesses (``--smoke``: Triton's interpreter, tiny fp16/fp32 cases), once as
is and once with a sparse_mla that ignores its valid_counts or mangles its block table, which
must fail. Its adversarial inputs are checked in-process; the PTX emulation compiles a small
kernel ahead of time for sm_86 (no GPU needed).
"""

from __future__ import annotations

import dataclasses
import json
import os
import re
import subprocess
import sys

import pytest
import torch

from triton_mla_sparse.ops.host import interpreter_problem

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
BENCH = os.path.join(ROOT, "benchmarks", "reliability")
SCRIPT = os.path.join(BENCH, "reliability.py")


def _env(interpret: bool = True) -> dict:
    env = dict(os.environ)
    env["PYTHONPATH"] = os.path.join(ROOT, "src") + os.pathsep + env.get("PYTHONPATH", "")
    if interpret:
        env["TRITON_INTERPRET"] = "1"
    else:
        env.pop("TRITON_INTERPRET", None)
    env["CUDA_VISIBLE_DEVICES"] = ""  # what a CPU machine sees, also on a GPU runner
    return env


def _run(args: list[str], interpret: bool = True, timeout: int = 120):
    return subprocess.run(
        [sys.executable, *args],
        env=_env(interpret),
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=timeout,
    )


SMOKE_TIMEOUT_S = 300  # a smoke subprocess: enumeration plus a few interpreted cases

# The smoke run is Triton's interpreter by design (also on a GPU machine, where it is handed CPU
# tensors); an interpreter that cannot run with the installed NumPy is refused by name.
needs_interpreter = pytest.mark.skipif(
    interpreter_problem() is not None, reason=str(interpreter_problem())
)


@needs_interpreter
def test_smoke_passes(tmp_path):
    log = tmp_path / "smoke.json"
    p = _run([SCRIPT, "--smoke", "--max-cases", "6", "--log", str(log)], timeout=SMOKE_TIMEOUT_S)
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-3000:]
    assert "RESULT: PASS: 6 cases, 0 failed" in p.stdout
    assert p.stdout.rstrip().splitlines()[-1].startswith("RESULT: PASS")  # the table is last
    results = json.loads(log.read_text())["results"]
    assert len(results) == 6 and all(r["status"] == "ok" for r in results)
    assert all(0 <= r["err_ratio"] <= 1 for r in results)
    # the coverage order spreads a short run over formats and layouts
    assert len({r["kind"] for r in results}) >= 4
    assert {"flat", "bt"} <= {r["layout"] for r in results}
    # --merge (how the sanitizer shards are combined) reads the log back
    m = _run([SCRIPT, "--merge", str(log), str(log)])
    assert m.returncode == 0 and "RESULT: PASS: 12 cases, 0 failed" in m.stdout, m.stdout + m.stderr


@needs_interpreter  # selecting the cases dry-runs the interpreted kernel
def test_a_shard_without_cases_passes(tmp_path):
    """A sanitizer run of fewer cases than shards leaves some shards empty: they pass (exit 0,
    no log), not fail, so that sanitize.sh's status is the other shards' and the tool's."""
    log = tmp_path / "empty.json"
    p = _run([SCRIPT, "--smoke", "--max-cases", "2", "--shard", "5/8", "--log", str(log)])
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-3000:]
    assert "no case falls in shard 5/8" in p.stdout
    assert not log.exists()
    # a selection that is empty before sharding still fails
    p = _run([SCRIPT, "--smoke", "--only", "no-such-kind", "--shard", "0/2"])
    assert p.returncode == 1 and "FAIL (no case ran)" in p.stdout, p.stdout[-3000:]
    # --jobs over more processes than cases (sanitize.sh's compile step): the empty shards
    # leave the result to the others
    p = _run([SCRIPT, "--smoke", "--max-cases", "1", "--jobs", "3", "--out", str(tmp_path)])
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-3000:]
    assert "RESULT: PASS: 1 cases, 0 failed" in p.stdout


# A sparse_mla that drops valid_counts (reads garbage past the count: decoy rows, NaN) or turns
# -1 block-table entries into block 1 (reads rows no index selects), or does either to the
# extra set's.
_BROKEN = """
import os, sys
sys.path.insert(0, {bench!r})
import triton_mla_sparse.ops.sparse_mla.interface as itf
orig = itf.sparse_mla
def broken(*a, **k):
    if {mode!r} == "counts":
        k.pop("valid_counts", None)
    elif {mode!r} == "extra_counts":
        k.pop("extra_valid_counts", None)
    elif {mode!r} == "extra_block_table":
        if "extra_block_table" in k:  # (the selection's dry runs call it for every kind)
            k["extra_block_table"] = k["extra_block_table"].abs()
    elif "block_table" in k:
        k["block_table"] = k["block_table"].abs()
    return orig(*a, **k)
itf.sparse_mla = broken
import reliability
sys.exit(reliability.main({args!r}))
"""


@needs_interpreter
@pytest.mark.parametrize(
    "mode,only",
    [
        ("counts", "fp32"),
        ("block_table", "fp32"),
        ("counts", "v4sink"),  # decoy slots of the V4 record poisoned, data and scale rows
        ("extra_counts", "extrabt-fp16"),
        ("extra_block_table", "extrabt-fp16"),
        ("extra_counts", "v4extra"),
    ],
)
def test_smoke_catches_a_broken_kernel(mode, only):
    args = ["--smoke", "--only", "cnt", "--only", "bt", "--only", only, "--max-cases", "2"]
    code = _BROKEN.format(bench=BENCH, mode=mode, args=args)
    # the V4 record's 64-head tiles take tens of seconds under the interpreter
    p = _run(["-c", code], timeout=SMOKE_TIMEOUT_S)
    assert p.returncode == 1, p.stdout[-3000:] + p.stderr[-3000:]
    assert "RESULT: FAIL" in p.stdout
    assert "non-finite outputs" in p.stdout or "relative error" in p.stdout


def test_list_enumerates_the_sm90_variants():
    """Without a GPU, --list shows what an H200 (sm90) would run: every kind of variant."""
    p = _run([SCRIPT, "--list"], interpret=False)
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-3000:]
    lines = [x for x in p.stdout.splitlines() if x.startswith("[")]
    assert len(lines) > 100
    fwd = [x[x.index("fwd ") :] for x in lines]
    text = p.stdout
    for feature in (
        "FP8_NATIVE=False",
        "K_SCALE_PTR=True",
        "fwd ds_mla ",
        "fwd latent ",
        "E4M3=True",
        "STAGE=True",
        "IDX_AHEAD=True",
        "SPLIT=True",
        "HAS_BT=True",
        "BT_SHIFT=-1",
        "PAGE_SHIFT=6",
        "R=0",
        "q=bfloat16",
        "q=float32",
        "S_PAD=64",
        " T4096 ",
        " W1152 ",
        "HAS_SINK=True",
        "fwd ds_mla_v4 ",
        "HAS_EXTRA=True",
        "EXTRA_HAS_COUNTS=True",
        "EXTRA_HAS_BT=True",
        "EXTRA_PAGE_SHIFT=0",  # a flat extra cache
        "EXTRA_PAGE_SHIFT=4",  # pages of 16 rows, unlike the main cache's 64
        " W128+512 ",  # DeepSeek-V4's decode: a 128-wide window and a compressed top-k of 512
    ):
        assert feature in text, feature
    # the extra set split and unsplit, in each kernel family
    for family in ("latent", "ds_mla", "ds_mla_v4"):
        for split in (True, False):
            want = (f"fwd {family} ", "HAS_EXTRA=True", f"SPLIT={split}")
            assert any(all(w in x for w in want) for x in fwd), (family, split)
    # tools/gpu_check.py cuts this list into parts: its count must be the list's
    sys.path.insert(0, os.path.join(ROOT, "tools"))
    try:
        import gpu_check
    finally:
        sys.path.pop(0)
    assert len(lines) == gpu_check.SANITIZE_CASES, "update SANITIZE_CASES in tools/gpu_check.py"
    # one case per forward variant, except cases added for a merge variant of their own
    merges = sum(1 for x in p.stdout.splitlines() if x.lstrip().startswith("merge "))
    assert len(set(fwd)) <= len(lines) <= len(set(fwd)) + merges


def _reliability():
    if BENCH not in sys.path:
        sys.path.insert(0, BENCH)
    import reliability

    reliability._imports()
    return reliability


def test_forced_gluon_tiles_only_where_the_plan_runs_gluon(monkeypatch):
    """A case's configuration is the one the call gets: a latent the Gluon kernels are not built
    for runs the Triton kernels (the plan turns Gluon off), so --split-qk and --rows-ws force
    nothing there (forcing the split on it asked the plan for a kernel it refuses)."""
    rel = _reliability()
    arch = rel.heuristics.Arch("cuda", 90, 132)
    monkeypatch.setattr(rel, "_SPLIT_QK", True)
    monkeypatch.setattr(rel, "_ROWS_WS", True)
    wide = rel.Kind("w", torch.bfloat16, "auto")
    narrow = rel.Kind("n", torch.bfloat16, "auto", rope=16, latent=32)
    # (T, H, W): a 16-head mma.sync tile (the split forced) and the 64 x 64 wgmma tile (the
    # warp-specialized kernel forced), shapes of the sanitize suite's narrow-latent cases
    for shape, forced in (((1, 1, 2048), "ampere"), ((128, 48, 1), "specialized")):
        cfg = rel.Case(wide, *shape).config(arch)
        assert cfg.gluon == forced and (cfg.split_qk or forced != "ampere"), shape
        cfg = rel.Case(narrow, *shape).config(arch)
        assert cfg.gluon is None and not cfg.split_qk, shape


def test_variant_groups_follow_the_token_dependent_e4m3_decode():
    """The dry run of one case names the kernels of every case in its group, so cases whose
    plans differ must not share one: sm80's fp8_ds_mla Triton kernel (a block-table call)
    decodes e4m3 without the staging mask up to 16 tokens and with it above, in the same
    configuration; grouped by configuration alone, a 32-token case was checked against the
    8-token case's variant and failed as "not the selected" one."""
    rel = _reliability()
    arch = rel.heuristics.Arch("cuda", 80, 108)
    kind = rel.Kind("dsmla", torch.bfloat16, "fp8_ds_mla")
    short, long = (rel.Case(kind, t, 1, 100, "bt") for t in (8, 32))
    cfg_s, cfg_l = short.config(arch), long.config(arch)
    assert cfg_s.gluon is None and dataclasses.replace(cfg_s, num_splits=1) == (
        dataclasses.replace(cfg_l, num_splits=1)
    ), (cfg_s, cfg_l)
    group_s = rel.variant_group(short, cfg_s, arch, on_gpu=True)
    group_l = rel.variant_group(long, cfg_l, arch, on_gpu=True)
    # the same configuration and split count: only the decode tells them apart
    assert group_s[:-1] == group_l[:-1], (group_s, group_l)
    assert group_s[-1] == "packed-nomask" and group_l[-1] == "packed", (group_s, group_l)
    # the interpreter decodes one way at every token count
    assert rel.variant_group(short, cfg_s, arch, on_gpu=False)[-1] == "scalar"


@pytest.mark.parametrize("layout", ["flat", "bt", "bt48"])
def test_adversarial_inputs(layout):
    """The index content and poisoning each case gets, as docs/RELIABILITY.md describes them."""
    rel = _reliability()
    arch = rel.heuristics.Arch("cuda", 90, 132)
    kind = rel.Kind("auto-fp32", torch.float32, "auto")
    case = rel.Case(kind, 8, 3, 300, layout, True, True)
    cfg = case.config(arch)
    split_len, splits = rel.split_len_for(case.W, cfg.num_splits, cfg.block_n)
    assert splits >= 3
    inp = rel.make_case_inputs(case, cfg)
    idx, counts = inp.ind["indices"].long(), inp.ind["valid_counts"].long()
    geo = inp.geo
    # token 0: leading -1 run longer than a gather step, a whole split of -1, trailing run
    lead = (idx[0] != -1).nonzero()[0, 0]
    assert lead > cfg.block_n
    assert (idx[0, split_len : 2 * split_len] == -1).all()
    plain = rel.make_case_inputs(dataclasses.replace(case, counts=False), cfg)
    assert (plain.ind["indices"][0, -(case.W // 8) :] == -1).all()  # (counts put garbage there)
    assert (plain.ind["indices"] == -1).all(dim=1).any()  # a token with nothing but -1
    for value in (rel.I32_MIN, rel.I32_MAX, -2):
        assert (idx == value).any(), value
    if geo.bs:  # positions past the table, and into its -1 / past-the-cache / 2^31 entries
        table = inp.ind["block_table"].long()
        assert (idx >= geo.max_blocks * geo.bs).any()
        assert (table == -1).any() and (table == geo.num_blocks).any()
        assert (table == 2**31 // geo.bs).any()
        assert (table * geo.bs >= 2**31).any()
    else:
        assert (idx == geo.num_rows).any() and (idx > geo.num_rows).any()
    vals, reps = torch.unique(idx[0][idx[0] >= 0], return_counts=True)
    assert (reps > 1).any()  # duplicates
    assert {0, -1, case.W + 3, rel.I32_MAX} <= set(counts.tolist())
    # the kernel's cache: NaN everywhere no valid index reaches, including the decoy rows that
    # garbage past the counts points at and (paged) the memory between blocks
    kc, view = rel.poisoned_cache(inp.cache, geo, inp.ind)
    rows, valid = rel.physical_rows(
        inp.ind["indices"],
        geo.num_rows,
        inp.ind["valid_counts"],
        inp.ind.get("block_table"),
        inp.ind.get("req_ids"),
        inp.ind.get("block_size"),
    )
    flat = view(kc).reshape(geo.num_rows, -1)
    used = torch.zeros(geo.num_rows, dtype=torch.bool)
    used[rows[valid]] = True
    assert torch.isnan(flat[~used]).all() and not torch.isnan(flat[used]).any()
    c0 = int(counts[0])
    assert 0 < c0 < case.W
    rows_all, valid_all = rel.physical_rows(
        inp.ind["indices"],
        geo.num_rows,
        None,
        inp.ind.get("block_table"),
        inp.ind.get("req_ids"),
        inp.ind.get("block_size"),
    )
    garbage = rows_all[0, c0:][valid_all[0, c0:]]
    assert len(garbage) and not used[garbage].any()  # what lies past the count is NaN
    if geo.page:
        assert torch.isnan(kc[:, 0]).all() and torch.isnan(kc[:, 2]).all()


_PTX = """
import os, sys
sys.path.insert(0, {bench!r})
import triton, triton.language as tl
from triton.backends.compiler import GPUTarget
from triton.backends.nvidia.driver import CudaDriver
from triton_mla_sparse.ops import target
import ptx_jit

@triton.jit
def k(X, Y, N: tl.constexpr):
    o = tl.arange(0, N)
    a = tl.load(X + o[:, None] * N + o[None, :])
    tl.store(Y + o[:, None] * N + o[None, :], tl.dot(a, a))

def build(cc):
    src = triton.compiler.ASTSource(
        fn=k, signature={{"X": "*fp16", "Y": "*fp32", "N": "constexpr"}}, constexprs={{"N": 16}}
    )
    return triton.compile(src, target=GPUTarget("cuda", cc, 32))

real_target, real_arch = CudaDriver.get_current_target, target._cuda_arch
with ptx_jit.emulate(86, cache_dir={cache!r}) as emu:
    assert CudaDriver.get_current_target(None) == GPUTarget("cuda", 86, 32)
    assert target._cuda_arch(0).cc == 86 and not target._cuda_arch(0).fp8_native
    assert os.environ["TRITON_CACHE_DIR"] == {cache!r}
    c = build(86)
    binary = c.asm["cubin"]
    assert binary.endswith(b"\\0") and b".target sm_86" in binary, binary[:200]
    d = ptx_jit.describe(c)
    assert d.is_ptx and d.target == "sm_86" and d.mma == "mma.sync", d
    assert [r.target for r in emu.compiled] == ["sm_86"]
assert CudaDriver.get_current_target is real_target and target._cuda_arch is real_arch
assert os.environ.get("TRITON_CACHE_DIR") != {cache!r}
c = build(86)  # a normal build again: ptxas, an ELF cubin
assert c.asm["cubin"][:4] == b"\\x7fELF" and not ptx_jit.describe(c).is_ptx
print("ok")
"""


def test_ptx_jit_emulation(tmp_path):
    script = tmp_path / "ptx_check.py"  # @triton.jit needs its source in a file
    script.write_text(_PTX.format(bench=BENCH, cache=str(tmp_path / "cache")))
    p = _run([str(script)], interpret=False)
    assert p.returncode == 0 and p.stdout.strip() == "ok", p.stdout[-3000:] + p.stderr[-3000:]


@pytest.mark.parametrize(
    "lse_ref,err,ok",
    [
        (16.0, 1.5e-5, True),  # the H200 graph suite's fp32 level at |LSE| 16: within 2e-5
        (16.0, 3.0e-5, False),
        (4.0, 1.5e-5, False),  # below the tests' range the absolute 1e-5 holds
        (-16.0, 1.9e-5, True),
    ],
)
def test_fp32_lse_tolerance_scales_with_lse(lse_ref, err, ok):
    """fp32 LSE: 1e-5 up to |LSE| 8, in proportion above; other dtypes keep their atol."""
    reliability = _reliability()
    kind = reliability.Kind("auto-fp32", torch.float32, "auto")
    case = reliability.Case(kind, 1, 2, 4, lse=True)
    out = torch.ones(1, 2, 8)
    ref_lse = torch.full((1, 2), lse_ref)
    fails, _, _ = reliability.check(case, out, ref_lse + err, out.clone(), ref_lse, None)
    assert (not fails) == ok, fails
    bf16 = reliability.Case(
        reliability.Kind("auto-bf16", torch.bfloat16, "auto"), 1, 2, 4, lse=True
    )
    fails, _, _ = reliability.check(bf16, out, ref_lse + 2e-2, out.clone(), ref_lse, None)
    assert fails  # bf16's 1e-2 is absolute at any |LSE|


def test_log_goes_to_out_dir_only_when_asked(tmp_path):
    """No log by default; --out DIR names one per suite and shard; --log wins over --out."""
    rel = _reliability()
    assert rel._log_path(rel._parse(["--suite", "graph"])) is None
    path = rel._log_path(rel._parse(["--suite", "emulate", "--arch", "86", "--out", str(tmp_path)]))
    assert path == str(tmp_path / "reliability-emulate-sm86.json")
    path = rel._log_path(rel._parse(["--out", str(tmp_path), "--shard", "1/4"]))
    assert path == str(tmp_path / "reliability-sanitize-shard1of4.json")
    args = rel._parse(["--out", str(tmp_path), "--log", str(tmp_path / "x.json")])
    assert rel._log_path(args) == str(tmp_path / "x.json")


def _v4_case(rel, layout="bt"):
    kind = rel.Kind(
        "v4extra-fp16", torch.float16, "fp8_ds_mla_v4", rope=0, sink=True, extra="paged"
    )
    case = rel.Case(kind, 8, 3, 100, layout, True, True, XW=37)
    return case, case.config(rel.heuristics.Arch("cuda", 90, 132))


@pytest.mark.parametrize("layout", ["paged", "bt"])
def test_v4_record_poisoning(layout):
    """A V4 record cache's slots that no valid index reaches are 0xFF in their data row and in
    their scale row (a page holds its data rows, then its scale rows), every pad byte is 0xFF,
    and so are vLLM's page padding and the neighbouring layers; the slots indexed decode as in
    the clean cache. Main and extra set alike."""
    from triton_mla_sparse.kv_format import (
        DS_V4_DATA_BYTES,
        DS_V4_NOPE,
        DS_V4_NUM_SCALES,
        DS_V4_SCALE_BYTES,
        DS_V4_TOKEN_BYTES,
        ds_mla_v4_pages,
        unpack_fp8_ds_mla_v4,
    )

    rel = _reliability()
    case, cfg = _v4_case(rel, layout)
    inp = rel.make_case_inputs(case, cfg)
    sets = [(inp.cache, inp.geo, inp.ind), (inp.xcache, inp.xgeo, inp.xind)]
    for cache, geo, ind in sets:
        big, view = rel.poisoned_cache(cache, geo, ind, kv_format="fp8_ds_mla_v4")
        kc = ds_mla_v4_pages(view(big))  # the kernel's stride rules hold
        assert kc.stride(0) > geo.page * DS_V4_TOKEN_BYTES  # pages further apart than packed
        rows, valid = rel.physical_rows(
            ind["indices"],
            geo.num_rows,
            ind.get("valid_counts"),
            ind.get("block_table"),
            ind.get("req_ids"),
            ind.get("block_size"),
        )
        used = torch.zeros(geo.num_rows, dtype=torch.bool)
        used[rows[valid]] = True
        assert used.any() and (~used).any()
        clean, got = unpack_fp8_ds_mla_v4(cache), unpack_fp8_ds_mla_v4(kc)
        assert torch.equal(got[used], clean[used]) and torch.isfinite(clean).all()
        assert torch.isnan(got[~used][:, :DS_V4_NOPE]).all()
        page_bytes = geo.page * DS_V4_TOKEN_BYTES
        assert (big[:, 0] == 0xFF).all() and (big[:, 2] == 0xFF).all()
        assert (big[:, 1, page_bytes:] == 0xFF).all()  # vLLM's padding after each page
        pages = big[:, 1, :page_bytes]
        data = pages[:, : geo.page * DS_V4_DATA_BYTES].reshape(-1, DS_V4_DATA_BYTES)
        scales = pages[:, geo.page * DS_V4_DATA_BYTES :].reshape(-1, DS_V4_SCALE_BYTES)
        assert (data[~used] == 0xFF).all() and (scales[~used] == 0xFF).all()
        assert (scales[:, DS_V4_NUM_SCALES] == 0xFF).all()
        assert not (scales[used, :DS_V4_NUM_SCALES] == 0xFF).any()


def test_extra_set_inputs():
    """The extra set's adversarial content: its own geometry and page size, request ids shared
    with the main block table, patterns and counts shifted against the main set's (a token with
    nothing in one set and everything in the other, both ways, and one with nothing in either)."""
    rel = _reliability()
    case, cfg = _v4_case(rel, "bt")
    inp = rel.make_case_inputs(case, cfg)
    ind, xind = inp.ind, inp.xind
    assert inp.xgeo.page == rel.EXTRA_PAGE != inp.geo.page
    assert xind["indices"].shape == (case.T, case.XW)
    assert ind["req_ids"] is xind["req_ids"] and "block_table" not in xind  # "paged": no table

    def valid(i, geo):
        return rel.physical_rows(
            i["indices"],
            geo.num_rows,
            i.get("valid_counts"),
            i.get("block_table"),
            i.get("req_ids"),
            i.get("block_size"),
        )[1].sum(dim=1)

    n, xn = valid(ind, inp.geo), valid(xind, inp.xgeo)
    assert n[1] == 0 and xn[1] > 0
    assert n[2] > 0 and xn[2] == 0
    assert n[3] == 0 and xn[3] == 0
    assert (n + xn)[[0, 4, 5, 6, 7]].min() > 0
    # the extra set through its own block table: the call's request ids serve both tables
    kind = dataclasses.replace(case.kind, name="extrabt-fp16", kv_format="auto", extra="bt")
    kind = dataclasses.replace(kind, rope=64, sink=False)
    flat_main = rel.Case(kind, 8, 3, 100, "flat", True, True, XW=37)
    inp = rel.make_case_inputs(flat_main, flat_main.config(rel.heuristics.Arch("cuda", 90, 132)))
    assert "block_table" not in inp.ind and inp.ind["req_ids"] is inp.xind["req_ids"]
    assert inp.xind["block_size"] == rel.EXTRA_PAGE


def _probe_compile_only(*args: str) -> tuple[str, dict[str, int]]:
    """benchmarks/reliability/ws_racecheck_probe.py --compile-only ARGS (no GPU): its output and
    the PTX counts it prints."""
    probe = os.path.join(BENCH, "ws_racecheck_probe.py")
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    p = subprocess.run(
        [sys.executable, probe, "--compile-only", *args],
        capture_output=True,
        text=True,
        env=env,
        timeout=300,
    )
    assert p.returncode == 0, p.stderr[-2000:]
    counts = {k: int(v) for k, v in re.findall(r"'([a-z. 1]+)': (\d+)", p.stdout)}
    return p.stdout, counts


def test_ws_racecheck_probe_compiles_the_hand_off():
    """The warp-specialize racecheck probe compiles for sm90 without a GPU, and its PTX holds
    Triton's hand-off (whole-block barriers, the state and capture words in shared memory)."""
    out, counts = _probe_compile_only("--regs")
    assert counts["barrier.sync 1"] >= 2 and counts["setmaxnreg"] >= 2, out
    assert counts["st.shared"] >= 2 and counts["ld.shared"] >= 2, out


def test_ws_racecheck_probe_ring_compiles_the_hand_over():
    """The probe's ring mode compiles for sm90 without a GPU: the worker's stores and one
    arrive per step and slot, and the default warps' arrive back, for every step."""
    out, counts = _probe_compile_only("--regs", "--ring", "--default-warps", "8")
    assert "ring True" in out, out
    assert counts["mbarrier.arrive"] >= 2 and counts["st.shared"] >= 2, out


def test_ds_step_scale_probe_changes_the_reference_scale_between_steps():
    """benchmarks/reliability/ds_step_scale_probe.py's data gives consecutive 64-row steps
    different largest scales, read back from the packed cache's own scale words (what the
    warp-specialized kernel takes its per-step reference from), and its config plans to that
    kernel on sm90: a step's reference read from the wrong slot would change the result."""
    sys.path.insert(0, BENCH)
    try:
        import ds_step_scale_probe as probe
    finally:
        sys.path.remove(BENCH)
    from triton_mla_sparse.kv_format import DS_MLA_NUM_SCALES, DS_MLA_SCALE_OFFSET
    from triton_mla_sparse.ops.sparse_mla.plan import DS_MLA_GLUON_WS, make_plan
    from triton_mla_sparse.ops.target import Arch

    tokens, width = 4, 1024
    q, cache, idx, _ = probe.make_problem(tokens, 64, width)
    words = cache[:, DS_MLA_SCALE_OFFSET : DS_MLA_SCALE_OFFSET + 4 * DS_MLA_NUM_SCALES]
    scales = words.contiguous().view(torch.float32).amax(-1)  # [num_rows]
    assert (scales > 0).all()
    valid = idx >= 0
    per = torch.where(valid, scales[idx.clamp(min=0).long()], torch.zeros(()))
    step_ref = per.view(tokens, width // probe.STEP, probe.STEP).amax(-1)
    changed = step_ref[:, 1:] != step_ref[:, :-1]
    assert int(changed.sum()) * 2 >= changed.numel(), step_ref
    assert (~valid).any() and valid.float().mean() > 0.9
    plan = make_plan(
        num_tokens=tokens,
        num_heads=64,
        latent=512,
        rope=64,
        width=width,
        dtype=q.dtype,
        kv_format="fp8_ds_mla",
        arch=Arch("cuda", 90, 132),
        config=probe.WS_CONFIG,
        on_gpu=True,
    )
    assert plan.family == DS_MLA_GLUON_WS


def test_split_qk_forces_the_split_where_the_tile_takes_it(monkeypatch):
    """--split-qk: every case whose tile is the mma.sync kernel's 16-head four-warp tile, in a
    format that splits, runs with QK^T split over the latent (passed as config=), whatever its
    walk length; every other case keeps the heuristics' configuration and config=None."""
    rel = _reliability()
    arch = rel.heuristics.Arch("cuda", 90, 132)
    fp8 = rel.Kind("dsmla-bf16", torch.bfloat16, "fp8_ds_mla")
    rows = rel.Kind("auto-bf16", torch.bfloat16, "auto")
    one_step = rel.Case(fp8, 1, 16, 32, "flat", True, True)  # one step a program: no split
    rows_short = rel.Case(rows, 4, 16, 100, "flat", True, True)
    wide = rel.Case(rows, 4, 64, 100, "flat", True, True)  # sm90's own kernel at 64 heads
    for case in (one_step, rows_short):
        assert case.config(arch).gluon == "ampere" and not case.config(arch).split_qk
        assert case.override(arch) is None
    monkeypatch.setattr(rel, "_SPLIT_QK", True)
    for case in (one_step, rows_short):
        cfg = case.config(arch)
        assert cfg.split_qk and (cfg.block_h, cfg.num_warps) == (16, 4)
        assert case.override(arch) == cfg
    assert not wide.config(arch).split_qk and wide.override(arch) is None


def test_rows_ws_forces_the_specialized_kernel_where_its_tile_runs(monkeypatch):
    """--rows-ws: every bf16-rows case on sm90 whose tile is the 64 x 64 one, flat or paged
    without a block table, runs the warp-specialized wgmma kernel (passed as config=); a block
    table, fp16 rows or a narrower tile keep the heuristics' configuration and config=None."""
    rel = _reliability()
    arch = rel.heuristics.Arch("cuda", 90, 132)
    rows = rel.Kind("auto-bf16", torch.bfloat16, "auto")
    rows16 = rel.Kind("auto-fp16", torch.float16, "auto")
    # (at 64-128 tokens, and past 128 from 64 heads, the heuristics choose that kernel themselves)
    taken = [
        rel.Case(rows, t, 64, 2048, layout, True, True)
        for t in (4, 16)
        for layout in ("flat", "paged")
    ]
    kept = [
        rel.Case(rows, 16, 64, 2048, "bt", True, True),
        rel.Case(rows16, 128, 64, 2048, "flat", True, True),
        rel.Case(rows, 16, 16, 2048, "flat", True, True),
    ]
    for case in taken + kept:
        assert case.config(arch).gluon != "specialized" and case.override(arch) is None
    monkeypatch.setattr(rel, "_ROWS_WS", True)
    for case in taken:
        cfg = case.config(arch)
        assert (cfg.gluon, cfg.num_warps, cfg.block_h, cfg.block_n) == ("specialized", 4, 64, 64)
        assert case.override(arch) == cfg
    for case in kept:
        assert case.config(arch).gluon != "specialized" and case.override(arch) is None


def test_ds_alt_forces_the_alternating_kernel_where_a_gluon_tile_runs(monkeypatch):
    """--ds-alt: every fp8_ds_mla case on sm90 the heuristics give a 64 x 64 Gluon tile (bf16 q,
    flat or paged without a block table) runs the alternating kernel in its 64 x 32 tile
    (passed as config=); a block table, fp16 q or 16 heads keep the heuristics' configuration
    and config=None."""
    rel = _reliability()
    arch = rel.heuristics.Arch("cuda", 90, 132)
    ds = rel.Kind("dsmla-bf16", torch.bfloat16, "fp8_ds_mla")
    ds16 = rel.Kind("dsmla-fp16", torch.float16, "fp8_ds_mla")
    taken = [
        rel.Case(ds, t, h, 2048, layout, True, True)
        for t, h in ((4, 64), (128, 128))
        for layout in ("flat", "paged")
    ]
    kept = [
        rel.Case(ds, 128, 64, 2048, "bt", True, True),
        rel.Case(ds16, 128, 64, 2048, "flat", True, True),
        rel.Case(ds, 128, 16, 2048, "flat", True, True),
    ]
    for case in taken + kept:
        assert case.config(arch).gluon != "alternating" and case.override(arch) is None
    monkeypatch.setattr(rel, "_DS_ALT", True)
    for case in taken:
        cfg = case.config(arch)
        assert (cfg.gluon, cfg.num_warps, cfg.block_h, cfg.block_n) == ("alternating", 4, 64, 32)
        assert case.override(arch) == cfg
    for case in kept:
        assert case.config(arch).gluon != "alternating" and case.override(arch) is None


SANITIZER_REPORT = """\
========= COMPUTE-SANITIZER
========= Program hit CUDA_ERROR_INVALID_VALUE (error 1) due to "invalid argument" on CUDA API call to cuFuncSetAttribute.
=========     Saved host backtrace up to driver entry point at error
========= Error: Potential RAW hazard detected at __shared__ 0x36820 in block (1,0,0) :
=========     Write Thread (255,0,0) at ws_kernel+0x7350 in latent_sm90_gluon.py:520
=========     Read Thread (256,0,0) at ws_kernel+0x100 in latent_sm90_gluon.py:498
=========     Current Value : 0
========= Error: Potential RAW hazard detected at __shared__ 0x36822 in block (1,0,0) :
=========     Write Thread (254,0,0) at ws_kernel+0x7350 in latent_sm90_gluon.py:520
=========     Read Thread (300,0,0) at ws_kernel+0x100 in latent_sm90_gluon.py:498
=========     Current Value : 0
========= Error: Race reported between Write access at ws_kernel+0x7350 in latent_sm90_gluon.py:530
=========     and Read access at ws_kernel+0x200 in latent_sm90_gluon.py:660 [96 hazards]
========= Warning: Potential WAR hazard detected at __shared__ 0x10 in block (0,0,0) :
=========     Read Thread (3,0,0) at ws_kernel+0x40
=========     Write Thread (130,0,0) at ws_kernel+0x90
========= Invalid __global__ read of size 4 bytes
=========     at other_kernel+0x1b0 in latent.py:120
=========     by thread (0,0,0) in block (0,0,0)
========= Uninitialized __global__ memory read of size 2 bytes
=========     at ws_kernel+0x300 in latent_sm90_gluon.py:700
========= RACECHECK SUMMARY: 4 hazards displayed (7205 errors, 1 warnings)
========= ERROR SUMMARY: 3 errors
========= ERROR SUMMARY: 1 error was not printed. Use --print-limit option to adjust
"""


def test_findings_groups_a_report_by_source_line(tmp_path):
    """findings.py (which sanitize.sh runs over its shards' reports) names each finding's kind and
    source lines with its count: racecheck's hazard (error and warning) and analysis forms, a
    memcheck and an initcheck error, the loader's API error apart, a site without line
    information by its kernel offset; the summaries' totals beside them, the line after a full
    report not counted twice."""
    if BENCH not in sys.path:
        sys.path.insert(0, BENCH)
    import findings

    found, sums = findings.findings(SANITIZER_REPORT)
    assert found == {
        "racecheck RAW: write ws_kernel latent_sm90_gluon.py:520 / "
        "read ws_kernel latent_sm90_gluon.py:498": 2,
        "racecheck race: write ws_kernel latent_sm90_gluon.py:530 / "
        "read ws_kernel latent_sm90_gluon.py:660": 96,
        "racecheck WAR: read ws_kernel+0x40 / write ws_kernel+0x90": 1,
        "Invalid __global__ read of size 4 bytes at other_kernel latent.py:120": 1,
        "Uninitialized __global__ memory read of size 2 bytes at ws_kernel latent_sm90_gluon.py:700": 1,
        "API error: cuFuncSetAttribute CUDA_ERROR_INVALID_VALUE": 1,
    }
    assert sums == {"racecheck": 7205, "error": 3}
    (tmp_path / "a.sanitizer.txt").write_text(SANITIZER_REPORT)
    (tmp_path / "b.sanitizer.txt").write_text("========= ERROR SUMMARY: 0 errors\n")
    p = subprocess.run(
        [sys.executable, os.path.join(BENCH, "findings.py"), *sorted(map(str, tmp_path.iterdir()))],
        capture_output=True,
        text=True,
        check=True,
    )
    assert "findings in 2 report(s)" in p.stdout
    assert re.search(r"^\s+96\s+1\s+racecheck race: write ws_kernel", p.stdout, re.M), p.stdout
