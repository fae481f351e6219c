"""Ahead-of-time compilation for every target the project claims, without a GPU.

For each ``heuristics.TARGETS`` architecture, the kernel configurations ``choose_config`` can pick
(enumerated over a grid of token counts, head counts, widths, dtypes and KV formats, then deduped)
are compiled with ``triton.compile`` for that target, through the real launcher's argument lists
(tests/aot_compile.py), and the shared memory each kernel needs must fit the target's opt-in
maximum (``Arch.smem_bytes``).

Cost: one compile takes 2-50 s on a CI core (fp32 tiles are the slowest), and the full set is
~90 forward kernels per target (3 head blocks x 7 dtype/format pairs x SPLIT on/off x rope 64/0,
more where the block size depends on the program count), too slow for CI. Measured with Triton
3.8 (sm90 and sm120 at block_h 64 over every dtype/format, SPLIT and rope; smaller head blocks on
five targets): shared memory does not depend on SPLIT (only the epilogue's destination changes), fp16 needs what bf16 needs, rope 64
needs more than NoPE, and a larger head block needs more. So by default each target compiles, for
each (dtype, format) the heuristics use, the largest head block they choose with SPLIT on and rope
64 (DeepSeek-V4's record: 0); plus the bf16 native-format tile with SPLIT off through the
block-table path and fp16 NoPE; plus each kernel family's largest bf16 split tile with an extra
index set and an attention sink (HAS_EXTRA, HAS_SINK: the latent family's extra set through its
own block table, fp8_ds_mla's flat, the V4 record's paged, as DeepSeek-V4's decode calls it)
(10 configurations a target, 80 in all, and the step-ahead tiles where chosen). ``TMS_COMPILE_ALL=1``
compiles the full set (well over an hour on 2 cores).

The compile runs in subprocesses with TRITON_INTERPRET removed: ``triton.jit`` chooses the
interpreter when the kernels module is imported, and this test process has it set on CPU.
"""

from __future__ import annotations

import itertools
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest
import torch
from conftest import toolchain_missing

from triton_mla_sparse.ops.sparse_mla.heuristics import (
    TARGETS,
    choose_config,
    fp16_mma_for,
    split_len_for,
)
from triton_mla_sparse.ops.sparse_mla.plan import FAMILY_OF

HERE = Path(__file__).resolve().parent
FULL = os.environ.get("TMS_COMPILE_ALL", "0") == "1"
DT_NAMES = {torch.float16: "fp16", torch.bfloat16: "bf16", torch.float32: "fp32"}
FORMATS_FOR = {
    "fp16": ("auto", "fp8", "fp8_ds_mla", "fp8_ds_mla_v4"),
    "bf16": ("auto", "fp8", "fp8_ds_mla", "fp8_ds_mla_v4"),
    "fp32": ("auto",),
}
V4 = "fp8_ds_mla_v4"  # DeepSeek-V4's record: one 512-wide row (rope 0), paged caches only


def arch_name(a) -> str:
    return f"{a.backend}:{a.cc}"


def chosen(arch) -> set[tuple]:
    """Every (block_h, block_n, num_warps, num_stages, dtype, format, split, stage_dequant,
    idx_ahead, fp16_mma) that choose_config picks for the Triton kernel (fp16_mma as the
    interface resolves it): where a Gluon kernel is the default, the configuration a call runs
    when it cannot take one (the interpreter, a cache not 16-byte aligned). The Gluon kernels'
    tiles are compiled by their own tests (tests/test_gluon_*.py)."""
    out = set()
    grid = itertools.product(
        [1, 2, 3, 4, 8, 16, 32, 64, 128, 256, 1024, 8192],
        [1, 2, 4, 8, 16, 20, 32, 48, 64, 96, 128],
        [1, 64, 100, 128, 512, 1152, 2048, 2176],
        DT_NAMES,
    )
    for t, h, w, dt in grid:
        for fmt in FORMATS_FOR[DT_NAMES[dt]]:
            c = choose_config(t, h, w, dt, fmt, arch, gluon=False)
            split = split_len_for(w, c.num_splits, c.block_n)[1] > 1
            out.add(
                (
                    c.block_h,
                    c.block_n,
                    c.num_warps,
                    c.num_stages,
                    DT_NAMES[dt],
                    fmt,
                    split,
                    c.stage_dequant,
                    c.idx_ahead,
                    fp16_mma_for(dt, fmt, arch, c.block_h),
                    c.fp16_fold,
                )
            )
    return out


def _job(
    arch,
    cfg,
    rope,
    *,
    has_counts=True,
    has_bt=False,
    store_lse=True,
    extra=None,
    sink=False,
) -> tuple[str, dict]:
    """One job; ``extra`` ("flat", "paged", "bt") adds a second index set (aot_compile.py's
    layouts; its counts follow ``has_counts``), ``sink`` an attention sink."""
    bh, bn, nw, ns, dt, fmt, split, stage, ahead, fp16_mma, fp16_fold = cfg
    job = dict(
        stage_dequant=stage,
        idx_ahead=ahead,
        fp16_mma=fp16_mma,
        fp16_fold=fp16_fold,
        arch=arch_name(arch),
        dtype=dt,
        fmt=fmt,
        block_h=bh,
        block_n=bn,
        num_warps=nw,
        num_stages=ns,
        split=split,
        rope=rope,
        has_counts=has_counts,
        has_bt=has_bt,
        store_lse=store_lse,
    )
    key = f"{job['arch']}-{dt}-{fmt}-h{bh}n{bn}w{nw}s{ns}-{'split' if split else 'single'}-r{rope}"
    if stage:
        key += "-staged"
    if ahead:
        key += "-ahead"
    if fmt != "auto" and not fp16_mma:
        key += "-qdtype-mma"
    if fp16_fold:
        key += "-fp16-fold"
    if has_bt:
        key += "-blocktable"
    if extra:
        job["extra"] = extra
        key += f"-extra{extra}"
    if sink:
        job["sink"] = True
        key += "-sink"
    return key, job


def make_jobs() -> dict[str, dict]:
    """Full mode: every chosen configuration x rope 64/0, serving flags (physical indices and
    valid counts, as vLLM calls it; LSE stored), and each again with an extra index set and a
    sink (fp8_ds_mla_v4: rope 0 only, without and with a paged extra set, as DeepSeek-V4's
    decode). Default mode, per target: for each (dtype, format) the largest head block the
    heuristics choose, SPLIT on, rope 64 (V4: 0); plus the bf16 native-format tile with SPLIT
    off through the block-table path (no counts, no LSE) and fp16 NoPE (rope 0); plus the
    largest tile that loads indices a step ahead, where chosen; plus, per kernel family, the
    bf16 largest split tile with an extra index set and a sink (latent: the extra set through
    its own block table; fp8_ds_mla: flat; V4: paged), counts on both sets."""
    jobs = {}
    for arch in TARGETS:
        cfgs = sorted(chosen(arch))
        if FULL:
            for cfg in cfgs:
                if cfg[5] == V4:
                    for extra in (None, "paged"):
                        k, j = _job(arch, cfg, 0, extra=extra, sink=True)
                        jobs[k] = j
                    continue
                for rope in (64, 0):
                    k, j = _job(arch, cfg, rope)
                    jobs[k] = j
                k, j = _job(arch, cfg, 64, extra="flat", sink=True)
                jobs[k] = j
            continue
        for dt, fmt in sorted({(c[4], c[5]) for c in cfgs}):
            if dt == "fp16":
                continue  # the same tiles as bf16 (identical shared memory, measured)
            biggest = max(c for c in cfgs if c[4:6] == (dt, fmt) and c[6])
            k, j = _job(arch, biggest, 0 if fmt == V4 else 64)
            jobs[k] = j
        for fmt, extra in (("auto", "bt"), ("fp8_ds_mla", "flat"), (V4, "paged")):
            biggest = max(c for c in cfgs if c[4:6] == ("bf16", fmt) and c[6])
            k, j = _job(arch, biggest, 0 if fmt == V4 else 64, extra=extra, sink=True)
            jobs[k] = j
        # the block-table path never loads indices ahead (choose_config(block_table=True))
        big = max(c for c in cfgs if c[4:6] == ("bf16", "auto") and not c[6] and not c[8])
        k, j = _job(arch, big, 64, has_counts=False, has_bt=True, store_lse=False)
        jobs[k] = j
        big = max(c for c in cfgs if c[4:6] == ("fp16", "auto") and c[6])
        k, j = _job(arch, big, 0)
        jobs[k] = j
        ahead = [c for c in cfgs if c[8]]
        if ahead:
            k, j = _job(arch, max(ahead), 64)
            jobs[k] = j
    return jobs


def indexer_chosen(arch) -> set[tuple]:
    """Every (op, q, rows, block_n, chunk, num_warps, num_stages, heads, next_n) the indexer
    heuristics pick (heads and next_n kept only where the tile depends on them)."""
    from triton_mla_sparse.ops.indexer.heuristics import (
        block_h_for,
        choose_mqa_config,
        choose_paged_config,
    )

    out = set()
    qd = {"e4m3": torch.uint8, "fp16": torch.float16, "bf16": torch.bfloat16, "fp32": torch.float32}
    for q, h in itertools.product(qd, [16, 32, 64, 128]):
        for b, n in itertools.product([1, 4, 16, 64, 128, 512], [1, 2, 3, 4]):
            c = choose_paged_config(b, n, h, qd[q], arch)
            out.add(
                (
                    "indexer_paged",
                    q,
                    c.rows,
                    c.block_n,
                    c.chunk,
                    c.num_warps,
                    c.num_stages,
                    block_h_for(h),
                    min(n, c.rows),
                )
            )
        for m in (64, 4096):
            c = choose_mqa_config(m, 32768, h, qd[q], arch)
            out.add(
                (
                    "indexer_mqa",
                    q,
                    c.rows,
                    c.block_n,
                    c.chunk,
                    c.num_warps,
                    c.num_stages,
                    block_h_for(h),
                    1,
                )
            )
    return out


def make_indexer_jobs() -> dict[str, dict]:
    """Full mode: every chosen indexer tile. Default, per target, (op, q dtype) and one row /
    several rows per program (the head sum's reshape): the tile with the largest accumulator
    (rows x heads x block_n, then stages); fp16 shares bf16's tiles."""
    jobs = {}
    for arch in TARGETS:
        cfgs = sorted(indexer_chosen(arch))
        if not FULL:
            size = lambda c: (c[2] * c[7] * c[3], c[6], c[4])  # noqa: E731
            groups = {(c[0], c[1], c[2] > 1) for c in cfgs if c[1] != "fp16"}
            cfgs = [
                max((c for c in cfgs if (c[0], c[1], c[2] > 1) == g), key=size)
                for g in sorted(groups)
            ]
        for op, q, rows, bn, chunk, nw, ns, bh, nn in cfgs:
            job = dict(
                op=op,
                arch=arch_name(arch),
                q=q,
                heads=bh,
                next_n=nn,
                ctx_2d=nn > 1,
                rows=rows,
                block_n=bn,
                chunk=chunk,
                num_warps=nw,
                num_stages=ns,
            )
            key = f"{job['arch']}-{op}-{q}-r{rows}h{bh}n{bn}c{chunk}w{nw}s{ns}-nn{nn}"
            jobs[key] = job
    return jobs


# TMS_COMPILE_ONLY=<substring>: compile only the jobs whose key contains it (e.g. "indexer")
ONLY = os.environ.get("TMS_COMPILE_ONLY", "")
JOBS = {k: v for k, v in {**make_jobs(), **make_indexer_jobs()}.items() if ONLY in k}
SMEM = {arch_name(a): a.smem_bytes for a in TARGETS}


@pytest.fixture(scope="module")
def compiled(tmp_path_factory) -> dict:
    """Compile every job, split over the CPU cores, in fresh processes without TRITON_INTERPRET."""
    tmp = tmp_path_factory.mktemp("aot")
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    src = str(HERE.parent / "src")
    env["PYTHONPATH"] = src + os.pathsep + env.get("PYTHONPATH", "")
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    workers = max(1, min(cores or 1, 8))
    keys = sorted(JOBS)
    procs = []
    for i in range(workers):
        part = {k: JOBS[k] for k in keys[i::workers]}
        if not part:
            continue
        jobs_path, res_path = tmp / f"jobs{i}.json", tmp / f"res{i}.json"
        jobs_path.write_text(json.dumps(part))
        cmd = [sys.executable, str(HERE / "aot_compile.py"), str(jobs_path), str(res_path)]
        log = open(tmp / f"log{i}.txt", "w")  # noqa: SIM115 (closed below)
        procs.append(
            (subprocess.Popen(cmd, env=env, stdout=log, stderr=subprocess.STDOUT), res_path, log)
        )
    results = {}
    for p, res_path, log in procs:
        rc = p.wait(timeout=3600)
        log.close()
        assert rc == 0, Path(log.name).read_text()[-4000:]
        results.update(json.loads(res_path.read_text()))
    (Path(tempfile.gettempdir()) / "tms_compile_results.json").write_text(
        json.dumps(results, indent=1)
    )
    return results


@pytest.mark.parametrize("key", sorted(JOBS))
def test_compiles_and_fits_shared_memory(compiled, key):
    missing = toolchain_missing(JOBS[key]["arch"])
    if missing:
        pytest.skip(missing)
    res = compiled[key]
    if "record" in res:
        pytest.fail(f"launcher/kernel signature mismatch: {res['record']}")
    op = JOBS[key].get("op")
    if op == "indexer_paged":
        kernels = ["paged_mqa_logits_kernel"]
    elif op == "indexer_mqa":
        kernels = ["mqa_logits_kernel"]
    else:
        family = FAMILY_OF[JOBS[key]["fmt"]]
        kernels = [f"sparse_mla_{family}_fwd_kernel"] + (
            ["sparse_mla_merge_kernel"] if JOBS[key]["split"] else []
        )
    limit = SMEM[JOBS[key]["arch"]]
    for name in kernels:
        r = res[name]
        if "error" in r:
            pytest.fail(f"{name} failed to compile for {JOBS[key]['arch']}: {r['error']}")
        assert r["shared"] <= limit, f"{name} needs {r['shared']} B shared memory > {limit} B"


@pytest.mark.skipif(bool(ONLY), reason="TMS_COMPILE_ONLY selects a subset")
def test_job_set_covers_every_target_and_format():
    """The default set still covers each target with every format and both SPLIT values."""
    for a in TARGETS:
        mine = [j for j in JOBS.values() if j["arch"] == arch_name(a) and "op" not in j]
        assert {j["fmt"] for j in mine} == {"auto", "fp8", "fp8_ds_mla", V4}
        # every kernel family also with a second index set (HAS_EXTRA) and a sink
        assert {FAMILY_OF[j["fmt"]] for j in mine if j.get("extra") and j.get("sink")} == set(
            FAMILY_OF.values()
        )
        assert all(j["rope"] == 0 for j in mine if j["fmt"] == V4)
        assert {j["split"] for j in mine} == {True, False}
        assert {j["dtype"] for j in mine} == {"fp16", "bf16", "fp32"}
        ind = [j for j in JOBS.values() if j["arch"] == arch_name(a) and "op" in j]
        assert {(j["op"], j["q"]) for j in ind} >= {
            (op, q) for op in ("indexer_paged", "indexer_mqa") for q in ("e4m3", "bf16", "fp32")
        }
