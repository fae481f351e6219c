"""Ahead-of-time compile worker for the index-q kernel and vLLM's own DSA Triton kernels (run as a
script by tests/test_compile_index_q.py and tests/plugin/test_vllm_indexer_compile.py).

Same mechanism as tests/aot_compile.py (whose recorder, specialisation and targets it reuses):
each launcher runs on small CPU tensors with its kernel swapped for a recorder, and the recorded
call is compiled with ``triton.compile`` for the job's target, without a GPU and without
TRITON_INTERPRET. Jobs (JSON dicts):

- ``{"kind": "index_q", "arch", "dtype", "interleave", "emulate_fp8"}``: ops/index_q.
- ``{"kind": "vllm_fused_q", "arch"}``: vLLM's ``fused_q`` (bf16 MQA query, fp8 index query).
- ``{"kind": "vllm_fused_norm_rope", "arch", "indexer_cache", "mla"}``: vLLM's ``fused_norm_rope``
  with or without the fp8 indexer-cache write, and a bf16 / fp8_ds_mla MLA cache or none
  (``"split"``: float32 latent and rope out, as this plugin calls it).
- ``{"kind": "mla_cache", "arch", "fmt"}``: ops/mla_cache (``fp8`` / ``fp8_ds_mla``).

Usage: ``python aot_compile_glue.py JOBS.json RESULTS.json``; a result is ``{"shared": bytes}`` or
``{"error": text}`` per job.
"""

from __future__ import annotations

import json
import sys
import traceback
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import torch  # noqa: E402
import triton  # noqa: E402
from aot_compile import _Recorder, _source, _target  # noqa: E402

DTYPES = {"fp16": torch.float16, "bf16": torch.bfloat16, "fp32": torch.float32}


def _record_index_q(job: dict) -> list:
    from triton_mla_sparse.ops.index_q import interface, launch

    dt = DTYPES[job["dtype"]]
    rec = _Recorder(launch.index_q_rope_kernel)
    launch.index_q_rope_kernel = rec
    T, H, Hi = 4, 16, 64
    interface.index_q_rope(
        torch.zeros(T, dtype=torch.int64),
        torch.zeros(T, H, 192, dtype=dt)[..., 128:],  # q_pe as vLLM's split view
        torch.zeros(64, 64),
        torch.zeros(T, Hi, 128, dtype=dt),
        torch.zeros(64, 64),
        torch.zeros(T, Hi),
        0.01,
        interleave=job["interleave"],
        emulate_fp8=job["emulate_fp8"],
    )
    return rec.calls


def _record_vllm_fused_q(job: dict) -> list:
    import vllm.models.deepseek_v32.common.kernels as vk

    rec = _Recorder(vk._fused_q_kernel)
    vk._fused_q_kernel = rec
    T, H, Hi, bf = 4, 16, 64, torch.bfloat16
    vk.fused_q(
        torch.zeros(T, dtype=torch.int64),
        torch.zeros(T, H, 64, dtype=bf),
        torch.zeros(64, 64),
        torch.zeros(T, Hi, 128, dtype=bf),
        torch.zeros(64, 64),
        torch.zeros(T, H, 512, dtype=bf),
        torch.ones(1),
        torch.zeros(T, Hi),
        0.1,
        0.1,
        quantize_mqa=False,
    )
    return rec.calls


def _record_vllm_fused_norm_rope(job: dict) -> list:
    import vllm.models.deepseek_v32.common.kernels as vk

    rec = _Recorder(vk._fused_norm_rope_kernel)
    vk._fused_norm_rope_kernel = rec
    T, bf = 4, torch.bfloat16
    vk.fused_norm_rope(
        torch.zeros(T, dtype=torch.int64),
        torch.zeros(T, 1536, dtype=bf),
        torch.ones(1536, dtype=bf),
        1e-6,
        torch.zeros(T, 512, dtype=bf),
        torch.ones(512, dtype=bf),
        1e-6,
        torch.zeros(T, 64, dtype=bf),
        torch.zeros(64, 64),
        torch.zeros(T, 128, dtype=bf),
        torch.ones(128),
        torch.zeros(128),
        1e-6,
        torch.zeros(64, 64),
        torch.zeros(T, 2048, dtype=torch.int32),
        slot_mapping=torch.zeros(T, dtype=torch.int64),
        indexer_k_cache=(
            torch.zeros(8, 64, 132, dtype=torch.uint8) if job["indexer_cache"] else None
        ),
        index_k_out=None if job["indexer_cache"] else torch.zeros(T, 128),
        **MLA_ARGS[job.get("mla", "bf16")](T),
    )
    return rec.calls


# The MLA cache as vLLM passes it, or as the plugin does (no cache: float32 latent and rope out).
MLA_ARGS = {
    "bf16": lambda T: dict(
        mla_kv_cache=torch.zeros(8, 64, 576, dtype=torch.bfloat16), mla_kv_cache_dtype="auto"
    ),
    "fp8_ds_mla": lambda T: dict(
        mla_kv_cache=torch.zeros(8, 64, 656, dtype=torch.uint8), mla_kv_cache_dtype="fp8_ds_mla"
    ),
    "split": lambda T: dict(
        mla_kv_cache=None, kv_c_out=torch.zeros(T, 512), k_pe_out=torch.zeros(T, 64)
    ),
}


def _record_mla_cache(job: dict) -> list:
    from triton_mla_sparse.ops.mla_cache import interface, launch

    rec = _Recorder(launch.mla_cache_write_kernel)
    launch.mla_cache_write_kernel = rec
    T, fmt = 4, job["fmt"]
    width = 656 if fmt == "fp8_ds_mla" else 576
    interface.write_mla_cache(
        torch.zeros(T, 512),
        torch.zeros(T, 64),
        torch.zeros(T, dtype=torch.int64),
        torch.zeros(8, 64, width, dtype=torch.uint8),
        fmt,
        torch.ones(1) if fmt == "fp8" else None,
    )
    return rec.calls


RECORDERS = {
    "index_q": _record_index_q,
    "vllm_fused_q": _record_vllm_fused_q,
    "vllm_fused_norm_rope": _record_vllm_fused_norm_rope,
    "mla_cache": _record_mla_cache,
}


def _kernel_slots() -> list[tuple[object, str]]:
    from triton_mla_sparse.ops.index_q import launch
    from triton_mla_sparse.ops.mla_cache import launch as mla_launch

    slots = [(launch, "index_q_rope_kernel"), (mla_launch, "mla_cache_write_kernel")]
    if any(j["kind"].startswith("vllm") for j in JOBS.values()):
        import vllm.models.deepseek_v32.common.kernels as vk

        slots += [(vk, "_fused_q_kernel"), (vk, "_fused_norm_rope_kernel")]
    return slots


def run_job(job: dict) -> dict:
    saved = [(m, n, getattr(m, n)) for m, n in _kernel_slots()]
    try:
        calls = RECORDERS[job["kind"]](job)
        assert len(calls) == 1, f"{len(calls)} launches recorded"
        fn, args, kwargs = calls[0]
        src, options = _source(fn, args, dict(kwargs))
        compiled = triton.compile(src, target=_target(job["arch"]), options=options)
        return {"shared": int(compiled.metadata.shared)}
    except Exception as e:  # a failure is a result (some are expected: fp8 below sm89)
        return {
            "error": f"{type(e).__name__}: {e}"[-3000:],
            "trace": traceback.format_exc()[-2000:],
        }
    finally:
        for m, n, k in saved:  # the real kernels back for the next job
            setattr(m, n, k)


JOBS: dict[str, dict] = {}


def main() -> None:
    JOBS.update(json.loads(Path(sys.argv[1]).read_text()))
    Path(sys.argv[2]).write_text(json.dumps({k: run_job(j) for k, j in JOBS.items()}, indent=1))


if __name__ == "__main__":
    main()
