"""Ahead-of-time compilation of the index-q kernel (ops/index_q) and the fp8 MLA cache writer
(ops/mla_cache) for every target the project claims (heuristics.TARGETS: cuda 80/86/89/90/100/120, hip gfx942), without a GPU, through the
launcher's real argument lists (tests/aot_compile_glue.py, the mechanism of tests/test_compile.py).
Both must compile where Triton has no fp8 types (sm80/86, and AMD's OCP e4m3), e4m3 emulation
included, and fit each target's shared memory."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from conftest import toolchain_missing

from triton_mla_sparse.ops.sparse_mla.heuristics import TARGETS

HERE = Path(__file__).resolve().parent


def arch_name(a) -> str:
    return f"{a.backend}:{a.cc}"


def run_compile_jobs(jobs: dict, tmp: Path, extra_env: dict | None = None) -> dict:
    """Compile ``jobs`` in one fresh process without TRITON_INTERPRET (see aot_compile_glue.py)."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["PYTHONPATH"] = str(HERE.parent / "src") + os.pathsep + env.get("PYTHONPATH", "")
    env.update(extra_env or {})
    jp, rp = tmp / "jobs.json", tmp / "res.json"
    jp.write_text(json.dumps(jobs))
    cmd = [sys.executable, str(HERE / "aot_compile_glue.py"), str(jp), str(rp)]
    r = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=1800)
    assert r.returncode == 0, r.stderr[-4000:]
    return json.loads(rp.read_text())


JOBS = {
    f"{arch_name(a)}-{dt}-{'emulated' if em else 'plain'}-{'inter' if il else 'neox'}": dict(
        kind="index_q", arch=arch_name(a), dtype=dt, interleave=il, emulate_fp8=em
    )
    for a in TARGETS
    for dt, em, il in [("bf16", True, False), ("bf16", False, True), ("fp16", True, True)]
}
JOBS.update(
    {
        f"{arch_name(a)}-mla_cache-{fmt}": dict(kind="mla_cache", arch=arch_name(a), fmt=fmt)
        for a in TARGETS
        for fmt in ("fp8", "fp8_ds_mla")
    }
)
SMEM = {arch_name(a): a.smem_bytes for a in TARGETS}


@pytest.fixture(scope="module")
def compiled(tmp_path_factory) -> dict:
    return run_compile_jobs(JOBS, tmp_path_factory.mktemp("aot_index_q"))


@pytest.mark.parametrize("key", sorted(JOBS))
def test_compiles_everywhere(compiled, key):
    missing = toolchain_missing(JOBS[key]["arch"])
    if missing:
        pytest.skip(missing)
    r = compiled[key]
    assert "error" not in r, r.get("trace", r.get("error"))
    assert r["shared"] <= SMEM[JOBS[key]["arch"]]
