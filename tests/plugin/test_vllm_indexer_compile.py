"""What vLLM 0.33's own DSA Triton kernels compile for, without a GPU (tests/aot_compile_glue.py).

The reason this plugin replaces ``fused_q`` and splits ``fused_norm_rope`` on sm80/86, checked
against the installed vLLM so that an upstream fix shows up here as a failure:

- ``fused_q`` fails to compile for sm80/86 (fp8 index-query type) and compiles for sm89;
- ``fused_norm_rope`` with the fp8 indexer-cache write or an fp8_ds_mla MLA cache fails for
  sm80/86, and compiles there exactly as the plugin calls it (``indexer_k_cache=None``, a float32
  ``index_k_out``; a bf16 MLA cache, or none with float32 ``kv_c_out``/``k_pe_out``).
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
from conftest import require_vllm

require_vllm()
pytestmark = pytest.mark.vllm

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from test_compile_index_q import run_compile_jobs  # noqa: E402

FP8_ERROR = "fp8e4nv not supported in this architecture"
JOBS = {
    "fused_q-80": dict(kind="vllm_fused_q", arch="cuda:80"),
    "fused_q-86": dict(kind="vllm_fused_q", arch="cuda:86"),
    "fused_q-89": dict(kind="vllm_fused_q", arch="cuda:89"),
    "norm_rope_cache-80": dict(kind="vllm_fused_norm_rope", arch="cuda:80", indexer_cache=True),
    "norm_rope_cache-86": dict(kind="vllm_fused_norm_rope", arch="cuda:86", indexer_cache=True),
    "norm_rope_split-80": dict(kind="vllm_fused_norm_rope", arch="cuda:80", indexer_cache=False),
    "norm_rope_split-86": dict(kind="vllm_fused_norm_rope", arch="cuda:86", indexer_cache=False),
    "norm_rope_ds_mla-80": dict(
        kind="vllm_fused_norm_rope", arch="cuda:80", indexer_cache=False, mla="fp8_ds_mla"
    ),
    "norm_rope_nocache-80": dict(
        kind="vllm_fused_norm_rope", arch="cuda:80", indexer_cache=False, mla="split"
    ),
    "norm_rope_nocache-86": dict(
        kind="vllm_fused_norm_rope", arch="cuda:86", indexer_cache=False, mla="split"
    ),
    "norm_rope_cache-89": dict(kind="vllm_fused_norm_rope", arch="cuda:89", indexer_cache=True),
}


@pytest.fixture(scope="module")
def compiled(tmp_path_factory) -> dict:
    env = {"CUDA_VISIBLE_DEVICES": "", "VLLM_TARGET_DEVICE": "cpu"}  # vLLM's real Triton
    return run_compile_jobs(JOBS, tmp_path_factory.mktemp("aot_vllm"), env)


@pytest.mark.parametrize(
    "key",
    ["fused_q-80", "fused_q-86", "norm_rope_cache-80", "norm_rope_cache-86", "norm_rope_ds_mla-80"],
)
def test_vllm_kernel_still_needs_fp8_types(compiled, key):
    r = compiled[key]
    assert "error" in r, (
        f"{key} now compiles: vLLM fixed it upstream, revisit the plugin's replacement"
    )
    assert FP8_ERROR in r["error"], r["error"]


@pytest.mark.parametrize(
    "key",
    [
        "fused_q-89",
        "norm_rope_cache-89",
        "norm_rope_split-80",
        "norm_rope_split-86",
        "norm_rope_nocache-80",
        "norm_rope_nocache-86",
    ],
)
def test_vllm_kernel_compiles(compiled, key):
    r = compiled[key]
    assert "error" not in r, r.get("trace", r.get("error"))
