"""Ahead-of-time compile worker for tests/test_compile.py (run as a script, never imported by pytest).

Runs without a GPU and without TRITON_INTERPRET (the jit decorator picks the interpreter when the
kernels module is imported, so this must be a fresh process). For each job it calls the real
launcher, ``launch.launch_sparse_mla`` with the plan ``plan.make_plan`` makes, on small CPU tensors with the kernels swapped for recorders,
so the argument lists, constexprs and launch options are exactly the ones a GPU launch would use.
Each recorded call is then specialised the way Triton's runtime does it (pointer dtypes, 16-byte
alignment, integers equal to 1 folded into constants) and compiled with ``triton.compile`` for the
job's target.

Usage: ``python aot_compile.py JOBS.json RESULTS.json``. A job is a dict with keys ``arch``
(``"cuda:90"`` / ``"hip:gfx942"``), ``dtype``, ``fmt``, ``block_h``, ``block_n``, ``num_warps``,
``num_stages``, ``split``, ``rope``, ``has_counts``, ``has_bt``, ``store_lse`` and optionally
``stage_dequant``, ``idx_ahead``, ``fp16_mma``, ``e4m3_decode``, ``fp16_fold``, ``gluon``,
``max_registers``, ``q_rope_in_registers``, ``split_qk``, ``sink`` (an attention sink) and ``extra`` (a
second index set in the same softmax: ``"flat"`` rows, ``"paged"`` pages of another size, or
``"bt"`` through its own block table; with counts when ``has_counts``); fmt ``fp8_ds_mla_v4``
takes rope 0 (the V4 record is one 512-wide row in paged 584-byte records); an indexer job has ``op`` ``"indexer_paged"`` /
``"indexer_mqa"``, ``arch``, ``q`` (``e4m3``/``fp16``/``bf16``/``fp32``), ``heads``, ``next_n``,
``ctx_2d``, the ``IndexerConfig`` fields and optionally ``fp8_native`` / ``fp8_mma`` (default:
the target's decode, e4m3 MMAs). A result holds,
per kernel, ``shared`` bytes (or ``error`` text) and compile seconds.
"""

from __future__ import annotations

import inspect
import json
import os
import sys
import time
import traceback

assert os.environ.get("TRITON_INTERPRET", "0") in ("", "0"), "run with TRITON_INTERPRET unset"

import torch  # noqa: E402
import triton  # noqa: E402
from triton.backends.compiler import BaseBackend, GPUTarget  # noqa: E402

try:  # Triton >= 3.5: the runtime's own specialisation
    from triton._C.libtriton import native_specialize_impl as _native  # noqa: E402
except ImportError:  # pragma: no cover - older Triton (3.6, as on the H200)
    _native = None

from triton_mla_sparse.kv_format import DS_MLA_ROW_BYTES, DS_V4_TOKEN_BYTES  # noqa: E402
from triton_mla_sparse.ops.sparse_mla import kernels, launch  # noqa: E402
from triton_mla_sparse.ops.sparse_mla.heuristics import Arch, KernelConfig  # noqa: E402
from triton_mla_sparse.ops.sparse_mla.plan import cache_span, make_plan  # noqa: E402

DTYPES = {"fp16": torch.float16, "bf16": torch.bfloat16, "fp32": torch.float32}


class _Recorder:
    """Stands in for a JITFunction: ``kernel[grid](*args, **kwargs)`` records the call."""

    def __init__(self, fn):
        self.fn = fn
        self.calls = []

    def __getitem__(self, grid):
        def call(*args, **kwargs):
            self.calls.append((self.fn, args, kwargs))

        return call


def _target(arch: str) -> GPUTarget:
    backend, cc = arch.split(":")
    if backend == "hip":
        return GPUTarget("hip", cc, 64)
    return GPUTarget("cuda", int(cc), 32)


Q_DTYPES = {"e4m3": torch.uint8, **DTYPES}


def _record_indexer(job: dict) -> list:
    """Run the indexer launcher on CPU tensors shaped like a vLLM call; return the recorded call."""
    from triton_mla_sparse.ops.indexer import kernels as ikernels
    from triton_mla_sparse.ops.indexer import launch as ilaunch
    from triton_mla_sparse.ops.indexer.heuristics import IndexerConfig

    backend, cc = job["arch"].split(":")
    arch = Arch(backend, int(cc) if backend == "cuda" else cc)
    cfg = IndexerConfig(
        job["rows"], job["block_n"], job["chunk"], job["num_warps"], job["num_stages"]
    )
    qdt, H = Q_DTYPES[job["q"]], job["heads"]
    if job["op"] == "indexer_paged":
        B, next_n = 4, job["next_n"]
        rec = _Recorder(ikernels.paged_mqa_logits_kernel)
        ilaunch.paged_mqa_logits_kernel = rec
        cl_shape = (B, next_n) if job["ctx_2d"] else (B,)
        ilaunch.launch_paged_mqa_logits(
            torch.zeros(B, next_n, H, 128, dtype=qdt),
            torch.zeros(16, 64 * 132, dtype=torch.uint8),
            torch.zeros(B * next_n, H),
            torch.zeros(cl_shape, dtype=torch.int32),
            torch.zeros(B, 32, dtype=torch.int32),
            torch.zeros(B * next_n, 2048),
            64,
            job.get("fp8_native", arch.fp8_native),
            job.get("fp8_mma", True),
            cfg,
        )
    else:
        M, N = 64, 4096
        rec = _Recorder(ikernels.mqa_logits_kernel)
        ilaunch.mqa_logits_kernel = rec
        ilaunch.launch_mqa_logits(
            torch.zeros(M, H, 128, dtype=qdt),
            torch.zeros(N, 128, dtype=torch.uint8),
            torch.zeros(N),
            torch.zeros(M, H),
            torch.zeros(M, dtype=torch.int32),
            torch.zeros(M, dtype=torch.int32),
            torch.zeros(M, N),
            job.get("fp8_native", arch.fp8_native),
            job.get("fp8_mma", True),
            cfg,
        )
    assert len(rec.calls) == 1
    return rec.calls


# the extra set's geometry: DeepSeek-V4's compressed top-k width, and a page size unlike the
# main cache's 64 (its own PAGE_SHIFT); through a table, blocks of another size again
EXTRA_WIDTH = 512
EXTRA_PAGE = 16
EXTRA_BLOCK = 32


def _cache(fmt: str, dtype: torch.dtype, width: int, page: int, pages: int = 32) -> torch.Tensor:
    """A zero cache of ``pages`` pages of ``page`` rows in the format's row layout."""
    if fmt == "fp8_ds_mla":
        return torch.zeros(pages, page, DS_MLA_ROW_BYTES, dtype=torch.uint8)
    if fmt == "fp8_ds_mla_v4":
        return torch.zeros(pages, page, DS_V4_TOKEN_BYTES, dtype=torch.uint8)
    if fmt == "fp8":
        return torch.zeros(pages, page, width, dtype=torch.uint8)
    return torch.zeros(pages, page, width, dtype=dtype)


def _extra_set(job: dict, fmt: str, dtype: torch.dtype, width: int, T: int) -> dict:
    """The job's extra index set (cache, indices, counts, block table), or {} without one."""
    layout = job.get("extra")
    if not layout:
        return {}
    if layout == "flat":
        if fmt == "fp8_ds_mla_v4":
            raise ValueError("a V4 record cache is paged only: extra 'paged' or 'bt'")
        cache = _cache(fmt, dtype, width, 1, 32 * 64)[:, 0]
    else:
        cache = _cache(fmt, dtype, width, EXTRA_PAGE)
    return dict(
        cache=cache,
        indices=torch.zeros(T, EXTRA_WIDTH, dtype=torch.int32),
        counts=torch.zeros(T, dtype=torch.int32) if job["has_counts"] else None,
        bt=torch.zeros(16, 32, dtype=torch.int32) if layout == "bt" else None,
    )


def _record(job: dict) -> list:
    """Run the launcher on CPU tensors shaped like a serving call; return the recorded calls."""
    dtype = DTYPES[job["dtype"]]
    fmt = job["fmt"]
    T, H, L, R, W = 4, 128, 512, job["rope"], 2048
    q = torch.zeros(T, H, L + R, dtype=dtype)
    q_lat, q_rope = q[..., :L], (q[..., L:] if R else None)
    cache = _cache(fmt, dtype, L + R, 64)
    indices = torch.zeros(T, W, dtype=torch.int32)
    counts = torch.zeros(T, dtype=torch.int32) if job["has_counts"] else None
    bt = torch.zeros(16, 32, dtype=torch.int32) if job["has_bt"] else None
    xset = _extra_set(job, fmt, dtype, L + R, T)
    req = torch.zeros(T, dtype=torch.int32) if job["has_bt"] or xset.get("bt") is not None else None
    sink = torch.zeros(H, dtype=torch.float32) if job.get("sink") else None
    out = torch.zeros(T, H, L, dtype=dtype)
    lse = torch.zeros(T, H, dtype=torch.float32) if job["store_lse"] else None
    flags = {}
    for flag in ("stage_dequant", "idx_ahead", "row_offsets_32"):
        if job.get(flag):
            flags[flag] = True
    if "fp16_mma" in job:
        flags["fp16_mma"] = job["fp16_mma"]
    if job.get("e4m3_decode"):
        flags["e4m3_decode"] = job["e4m3_decode"]
    if job.get("fp16_fold"):
        flags["fp16_fold"] = True
    if job.get("gluon"):
        flags["gluon"] = job["gluon"]
    if job.get("max_registers"):
        flags["max_registers"] = job["max_registers"]
    if job.get("q_rope_in_registers"):
        flags["q_rope_in_registers"] = True
    if job.get("split_qk"):
        flags["split_qk"] = True
    cfg = KernelConfig(
        job["block_h"],
        job["block_n"],
        job["num_warps"],
        job["num_stages"],
        num_splits=4 if job["split"] else 1,
        **flags,
    )
    backend, cc = job["arch"].split(":")
    arch = Arch(backend, int(cc) if backend == "cuda" else cc)  # the runtime's own flags
    plan = make_plan(
        num_tokens=T,
        num_heads=H,
        latent=L,
        rope=R,
        width=W,
        dtype=dtype,
        kv_format=fmt,
        arch=arch,
        on_gpu=True,  # programmatic dependent launch where the runtime uses it
        page_size=cache.shape[1],
        has_counts=counts is not None,
        block_size=64 if bt is not None else None,
        store_lse=lse is not None,
        has_sink=sink is not None,
        extra_width=xset["indices"].shape[1] if xset else None,
        extra_page_size=xset["cache"].shape[1] if xset and xset["cache"].dim() == 3 else 1,
        extra_has_counts=bool(xset) and xset["counts"] is not None,
        extra_block_size=EXTRA_BLOCK if xset.get("bt") is not None else None,
        cache_span=cache_span(cache),
        config=cfg,
    )
    fwd = _Recorder(launch.FORWARD[plan.family])
    merge = _Recorder(kernels.sparse_mla_merge_kernel)
    launch.FORWARD[plan.family], launch.sparse_mla_merge_kernel = fwd, merge
    extra_args = (xset["cache"], xset["indices"], xset["counts"], xset["bt"]) if xset else ()
    launch.launch_sparse_mla(
        plan,
        q_lat,
        q_rope,
        cache,
        indices,
        counts,
        bt,
        req,
        None,
        1.0,
        out,
        lse,
        0.04,
        sink,
        *extra_args,
    )
    launch.FORWARD[plan.family], launch.sparse_mla_merge_kernel = fwd.fn, merge.fn
    assert len(fwd.calls) == 1 and len(merge.calls) == (1 if job["split"] else 0)
    return fwd.calls + merge.calls


_PTR_NAMES = {
    torch.float16: "fp16",
    torch.bfloat16: "bf16",
    torch.float32: "fp32",
    torch.uint8: "u8",
    torch.int32: "i32",
}


def _specialize(value):
    """(type string, specialisation) like Triton's runtime: "D" marks 16-divisible values."""
    if _native is not None:
        return _native(BaseBackend, value, False, True, True)
    if isinstance(value, torch.Tensor):
        return "*" + _PTR_NAMES[value.dtype], "D" if value.data_ptr() % 16 == 0 else ""
    if isinstance(value, bool):
        return "u1", None
    if isinstance(value, int):
        if value == 1:
            return "constexpr", 1
        kind = "i32" if -(2**31) <= value < 2**31 else "i64"
        return kind, "D" if value % 16 == 0 else ""
    if isinstance(value, float):
        return "fp32", None
    raise TypeError(f"cannot specialise {type(value).__name__}")


def _source(fn, args, kwargs):
    """(ASTSource, options) for one recorded call, specialised as Triton's runtime would."""
    launch_options = ("num_warps", "num_stages", "launch_pdl", "maxnreg")
    options = {k: kwargs.pop(k) for k in launch_options if k in kwargs}
    bound = inspect.signature(fn.fn).bind(*args, **kwargs)
    signature, constexprs, attrs = {}, {}, {}
    for i, p in enumerate(fn.params):
        value = bound.arguments[p.name]
        if p.is_constexpr:
            signature[p.name], constexprs[p.name] = "constexpr", value
            continue
        kind, spec = _specialize(value)
        signature[p.name] = kind
        if kind == "constexpr":  # an int equal to 1
            constexprs[p.name] = spec
        elif isinstance(spec, str) and "D" in spec:
            attrs[(i,)] = [["tt.divisibility", 16]]
    source = triton.compiler.ASTSource
    if type(fn).__name__.startswith("Gluon"):  # a @gluon.jit kernel
        from triton.experimental.gluon._runtime import GluonASTSource as source
    return source(fn=fn, signature=signature, constexprs=constexprs, attrs=attrs), options


def _dump_asm(job: dict, compiled, nth: int) -> None:
    """With TMS_ASM_DIR set, write the kernel's PTX (or AMDGCN) as DIR/<job key>.<nth>.<ext>
    (nth: the launcher's 1st, 2nd... kernel), for benchmarks/codegen/asm_equivalence.py."""
    out = os.environ.get("TMS_ASM_DIR")
    if not out:
        return
    ext = "amdgcn" if "amdgcn" in compiled.asm else "ptx"
    with open(os.path.join(out, f"{job['key']}.{nth}.{ext}"), "w") as f:
        f.write(compiled.asm[ext])


def run_job(job: dict) -> dict:
    res = {}
    try:
        calls = _record_indexer(job) if job.get("op", "").startswith("indexer") else _record(job)
    except Exception:  # a launcher/kernel mismatch is a result, not a crash
        return {"record": {"error": traceback.format_exc(limit=3)}}
    for fn, args, kwargs in calls:
        t0 = time.perf_counter()
        try:
            src, options = _source(fn, args, dict(kwargs))
            compiled = triton.compile(src, target=_target(job["arch"]), options=options)
            res[fn.__name__] = {"shared": int(compiled.metadata.shared)}
            _dump_asm(job, compiled, len(res))
        except Exception as e:  # keep going: report every failing configuration
            msg = f"{type(e).__name__}: {e}"
            res[fn.__name__] = {"error": msg[-2000:]}
        res[fn.__name__]["seconds"] = round(time.perf_counter() - t0, 2)
    return res


def main() -> None:
    jobs_path, results_path = sys.argv[1], sys.argv[2]
    with open(jobs_path) as f:
        jobs = json.load(f)
    results = {key: run_job({**job, "key": key}) for key, job in jobs.items()}
    with open(results_path, "w") as f:
        json.dump(results, f, indent=1)


if __name__ == "__main__":
    main()
