"""Validation and automatic selection through vLLM 0.33's own selection code, on CPU.

``vllm.platforms.cuda`` imports the native extension ``vllm._C_stable_libtorch`` (needs libcuda);
only that module is stood in, so vLLM's real priority lists and every backend's real
``validate_configuration`` run. At 10.x one more stand-in is needed: the priority list walks the
dense ``CUTLASS_MLA`` backend first, whose module allocates a 128 MB CUDA workspace at import
(vllm/v1/attention/backends/mla/cutlass_mla.py:99) and raises "Found no NVIDIA driver"
(a RuntimeError, which get_valid_backends does not catch). It is replaced by a dense MLA stub
that reports itself invalid: a dense backend can never serve a sparse model either way.
"""

from __future__ import annotations

import sys
import types

import pytest
import torch
from conftest import require_vllm

require_vllm()
pytestmark = pytest.mark.vllm

import triton_mla_sparse.vllm_plugin as plugin  # noqa: E402

CUTLASS_MLA = "vllm.v1.attention.backends.mla.cutlass_mla"
NATIVE_EXT = "vllm._C_stable_libtorch"
# (heads per GPU) DeepSeek-V3.2 at TP8/TP1 (16/128), GLM-5 at TP8/TP1 (8/64).
HEADS = (8, 16, 64, 128)


@pytest.fixture(scope="module")
def cuda_platform():
    mp = pytest.MonkeyPatch()
    if NATIVE_EXT not in sys.modules:
        try:
            import vllm.platforms.cuda  # noqa: F401  (works as is where libcuda exists)
        except (ImportError, OSError):
            mp.setitem(sys.modules, NATIVE_EXT, types.ModuleType(NATIVE_EXT))
    import vllm.platforms.cuda as cuda_mod

    if not torch.cuda.is_available() and CUTLASS_MLA not in sys.modules:
        from vllm.v1.attention.backend import AttentionBackend

        class CutlassMLABackend(AttentionBackend):
            get_name = staticmethod(lambda: "CUTLASS_MLA")
            get_impl_cls = get_builder_cls = staticmethod(lambda: None)

            @classmethod
            def validate_configuration(cls, *args, **kwargs):
                return ["stood in: allocates CUDA memory at import"]

        stub = types.ModuleType(CUTLASS_MLA)
        stub.CutlassMLABackend = CutlassMLABackend
        mp.setitem(sys.modules, CUTLASS_MLA, stub)

    from triton_mla_sparse.vllm_plugin.selection import (
        install_priority_wrapper,
        uninstall_priority_wrapper,
    )

    assert plugin.register()
    assert install_priority_wrapper(cuda_mod)
    try:
        yield cuda_mod
    finally:
        uninstall_priority_wrapper(cuda_mod)
        mp.undo()


@pytest.fixture
def cpu_vllm_config():
    from vllm.config import DeviceConfig, VllmConfig, set_current_vllm_config

    with set_current_vllm_config(VllmConfig(device_config=DeviceConfig(device="cpu"))):
        yield


def _selector(kv_cache_dtype="bfloat16", head_size=576, block_size=64, **kw):
    from vllm.v1.attention.selector import AttentionSelectorConfig

    return AttentionSelectorConfig(
        head_size=head_size,
        dtype=kw.pop("dtype", torch.bfloat16),
        kv_cache_dtype=kv_cache_dtype,
        block_size=block_size,
        use_mla=True,
        use_sparse=kw.pop("use_sparse", True),
        **kw,
    )


def _validate(cap=(8, 9), **kw):
    from vllm.platforms.interface import DeviceCapability

    from triton_mla_sparse.vllm_plugin.backend import TritonMLASparseBackend

    return TritonMLASparseBackend.validate_configuration(
        device_capability=DeviceCapability(*cap), **_selector(**kw)._asdict()
    )


def _select(cuda_mod, monkeypatch, cap, heads, kv_cache_dtype, selected=None) -> str:
    """vLLM's full choice (get_attn_backend_cls), with only the device query stood in."""
    from vllm.platforms.interface import DeviceCapability

    monkeypatch.setattr(
        cuda_mod.CudaPlatform,
        "get_device_capability",
        classmethod(lambda c, d=0: DeviceCapability(*cap)),
    )
    return cuda_mod.CudaPlatform.get_attn_backend_cls(
        selected, _selector(kv_cache_dtype), num_heads=heads
    )


OURS = "triton_mla_sparse.vllm_plugin.backend.TritonMLASparseBackend"


@pytest.mark.parametrize("kv", ["auto", "bfloat16", "fp8_ds_mla"])
@pytest.mark.parametrize("cap", [(8, 0), (8, 9), (9, 0), (10, 0), (12, 0)])
def test_accepts_deepseek_v32_and_glm5(kv, cap, cpu_vllm_config):
    assert _validate(cap, kv_cache_dtype=kv) == []
    assert _validate(cap, kv_cache_dtype=kv, dtype=torch.float16) == []
    assert _validate(cap, kv_cache_dtype=kv, block_size=128) == []


def test_accepts_nope_and_fp8(cpu_vllm_config):
    assert _validate(head_size=512, kv_cache_dtype="bfloat16") == []
    assert _validate(kv_cache_dtype="fp8") == []
    assert _validate(kv_cache_dtype="fp8_e4m3") == []


def test_rejects_with_readable_reasons(monkeypatch, cpu_vllm_config):
    from types import SimpleNamespace as NS

    cases = {
        "head size 128 not supported": dict(head_size=128),
        "model dtype torch.float32 not supported": dict(dtype=torch.float32),
        "kv cache dtype 'fp8_e5m2' not supported": dict(kv_cache_dtype="fp8_e5m2"),
        "block_size not supported": dict(block_size=16),
        "compute capability 7.5 not supported (needs 8.0 or newer)": dict(cap=(7, 5)),
        "model has no sparse (DSA / lightning indexer) attention": dict(use_sparse=False),
    }
    for want, kw in cases.items():
        reasons = _validate(**kw)
        assert any(want in r for r in reasons), (want, reasons)

    def config(hf, dcp=1):
        return NS(
            model_config=NS(hf_text_config=hf),
            parallel_config=NS(decode_context_parallel_size=dcp),
        )

    glm5 = NS(index_topk=2048, kv_lora_rank=512, qk_rope_head_dim=64)
    model_cases = [
        (config(NS(kv_lora_rank=512, qk_rope_head_dim=64)), "has no index_topk"),
        (config(NS(index_topk=2048, kv_lora_rank=256, qk_rope_head_dim=64)), "kv_lora_rank 256"),
        (config(glm5, dcp=2), "(DCP) not supported"),
        (config(glm5), None),
    ]
    for cfg, want in model_cases:
        monkeypatch.setattr("vllm.config.get_current_vllm_config_or_none", lambda c=cfg: c)
        reasons = _validate()
        assert (reasons == []) if want is None else any(want in r for r in reasons), reasons


@pytest.mark.parametrize("heads", HEADS)
@pytest.mark.parametrize(
    "cap,kv",
    [
        ((8, 0), "auto"),
        ((8, 0), "fp8_ds_mla"),
        ((8, 6), "auto"),
        ((8, 9), "bfloat16"),
        ((8, 9), "fp8_ds_mla"),
        ((12, 0), "bfloat16"),
    ],
)
def test_chosen_where_no_native_backend_is_valid(
    cuda_platform, monkeypatch, cpu_vllm_config, cap, kv, heads
):
    assert _select(cuda_platform, monkeypatch, cap, heads, kv) == OURS


@pytest.mark.parametrize("heads", HEADS)
@pytest.mark.parametrize(
    "cap,kv",
    [
        ((9, 0), "bfloat16"),
        ((9, 0), "fp8_ds_mla"),
        ((10, 0), "bfloat16"),
        ((10, 0), "fp8_ds_mla"),
        ((12, 0), "auto"),
        ((12, 0), "fp8_ds_mla"),
    ],
)
def test_native_backends_keep_priority(cuda_platform, monkeypatch, cpu_vllm_config, cap, kv, heads):
    from vllm.platforms.interface import DeviceCapability
    from vllm.v1.attention.backends.registry import AttentionBackendEnum as E

    chosen = _select(cuda_platform, monkeypatch, cap, heads, kv)
    assert chosen != OURS and "SPARSE" in chosen.upper()
    # Still valid, and last: reachable if the native ones fail validation on a given machine.
    valid, _ = cuda_platform.CudaPlatform.get_valid_backends(
        DeviceCapability(*cap), _selector(kv), num_heads=heads
    )
    assert valid[-1].backend is E.CUSTOM and len(valid) >= 2


@pytest.mark.parametrize("kv", ["fp8", "fp8_e4m3", "fp8_ds_mla"])
@pytest.mark.parametrize("cap", [(8, 0), (8, 6)])
def test_fp8_caches_refused_below_sm89_without_the_writer(
    cuda_platform, monkeypatch, cpu_vllm_config, cap, kv
):
    """vLLM's MLA cache writer (fused_norm_rope) quantises with Triton fp8 types (sm89+). With
    the plugin's fp8-free writer planned (default) fp8 caches are accepted on sm80/86; with
    TRITON_MLA_SPARSE_INDEXER=off the backend refuses them with that reason instead of failing
    at the first write."""
    from vllm.v1.attention.backends.registry import AttentionBackendEnum as E

    assert _validate(cap, kv_cache_dtype=kv) == []
    monkeypatch.setenv("TRITON_MLA_SPARSE_INDEXER", "off")
    assert any("fused_norm_rope" in r for r in _validate(cap, kv_cache_dtype=kv))
    with pytest.raises(ValueError, match=r"needs compute capability 8\.9\+"):
        _select(cuda_platform, monkeypatch, cap, 16, kv, selected=E.CUSTOM)
    assert _validate((8, 9), kv_cache_dtype=kv) == []


def test_explicit_choice_and_its_errors(cuda_platform, monkeypatch, cpu_vllm_config):
    from vllm.v1.attention.backends.registry import AttentionBackendEnum as E

    assert _select(cuda_platform, monkeypatch, (9, 0), 16, "bfloat16", selected=E.CUSTOM) == OURS
    with pytest.raises(ValueError, match=r"compute capability 7\.5 not supported"):
        _select(cuda_platform, monkeypatch, (7, 5), 16, "bfloat16", selected=E.CUSTOM)


def test_wrapper_copies_the_cached_list(cuda_platform):
    from vllm.platforms.interface import DeviceCapability
    from vllm.v1.attention.backends.registry import AttentionBackendEnum as E

    wrapped = cuda_platform._get_backend_priorities
    kw = dict(use_mla=True, device_capability=DeviceCapability(8, 9), num_heads=16)
    first = wrapped(**kw)
    assert first[-1] is E.CUSTOM and wrapped(**kw)[-1] is E.CUSTOM and first.count(E.CUSTOM) == 1
    assert E.CUSTOM not in wrapped.__wrapped__(**kw)  # vLLM's cached list untouched
    assert E.CUSTOM not in wrapped(use_mla=False, device_capability=DeviceCapability(8, 9))
