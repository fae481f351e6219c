"""HY V4's per-head attention sink through the plugin, against the real vLLM 0.33 code, on CPU.

(a) Selection: HY V4's own probe and sink resolution (``HYV4MLAAttention`` in
vllm/models/hy_v4/nvidia/attention.py: the sparse-backend probe, ``_resolve_sink_backend``) run
unchanged with vLLM's CUDA platform stood in at a given compute capability; they must bind
TRITON_MLA_SPARSE with the sink on SM80/86/89 (automatic selection) and on SM120 (explicit
``--attention-backend TRITON_MLA_SPARSE``).
(b) Forward: the impl built with ``sinks`` as vLLM's MLAAttention passes it, run through vLLM's
metadata builder and ``forward_mqa``, equals the float64 reference with ``attn_sink`` (including a
-inf and a +inf head), in fp16 and fp32, for the parameter as HY V4 creates it (float32 [H]) and
for a bf16 sink (converted once).
(c) Without sinks nothing changes (same output as before, dense-MHA prefill still offered).
"""

from __future__ import annotations

from types import SimpleNamespace as NS

import pytest
import torch
from conftest import require_vllm

require_vllm()
pytestmark = pytest.mark.vllm

from triton_mla_sparse.reference import sparse_mla_reference  # noqa: E402

from .cpu_vllm import common_metadata, cpu_vllm_config, mla_sparse_impl  # noqa: E402
from .test_vllm_forward import BLOCK, NUM_BLOCKS, _paged_cache, _topk_buffer  # noqa: E402
from .test_vllm_selection import OURS, _validate  # noqa: E402
from .test_vllm_selection import cuda_platform as cuda_platform  # noqa: E402, F401

HEADS = 16  # HY V4 at TP8 (128 heads / 8); the sink is per local head
# HY V4's attention geometry (vllm/transformers_utils/configs/hy_v4.py:110-118).
HY_V4 = dict(
    index_topk=2048,
    kv_lora_rank=512,
    qk_nope_head_dim=192,
    qk_rope_head_dim=64,
    v_head_dim=256,
    q_lora_rank=1536,
    learnable_sink=True,
)
SCALE = (192 + 64) ** -0.5  # HY V4's qk_head_dim ** -0.5 = 1/16
REQUESTS = [(1, 150), (2, 94), (130, 200)]  # a decode, a spec-decode verify, a prefill
BLOCK_TABLE = [[5, 2, 7, 0], [9, 1, 0, 0], [3, 8, 4, 6]]


def _hy_v4_config(attention_backend=None, **hf):
    from vllm.config import AttentionConfig, DeviceConfig, VllmConfig

    cfg = VllmConfig(
        device_config=DeviceConfig(device="cpu"),
        attention_config=AttentionConfig(backend=attention_backend),
    )
    model = NS(hf_text_config=NS(**{**HY_V4, **hf}), max_model_len=4096, rswa_window=None)
    object.__setattr__(cfg, "model_config", model)
    return cfg


# ---------------------------------------------------------------------------------------------
# (a) selection


@pytest.mark.parametrize("cap", [(8, 0), (8, 6), (8, 9), (12, 0)])
def test_validates_hy_v4_with_sink(monkeypatch, cap):
    cfg = _hy_v4_config()
    monkeypatch.setattr("vllm.config.get_current_vllm_config_or_none", lambda: cfg)
    assert _validate(cap, kv_cache_dtype="auto", has_sink=True) == []
    assert _validate(cap, kv_cache_dtype="bfloat16", has_sink=True, dtype=torch.float16) == []
    assert _validate(cap, kv_cache_dtype="fp8_ds_mla", has_sink=True) == []


def _hy_v4_backends(cuda_mod, monkeypatch, cap, kv, attention_backend=None, **hf):
    """What HY V4's layer constructor decides, with vLLM's CUDA platform at ``cap``: the class its
    sparse-backend probe gets (attention.py:346-362, raises when none) and the class
    ``_resolve_sink_backend`` binds with the sink (None: the sink is dropped)."""
    import vllm.platforms
    from vllm.config import set_current_vllm_config
    from vllm.models.hy_v4.nvidia import attention as hy_attn
    from vllm.platforms.interface import DeviceCapability
    from vllm.v1.attention import selector

    platform = cuda_mod.CudaPlatform()
    monkeypatch.setattr(
        cuda_mod.CudaPlatform,
        "get_device_capability",
        classmethod(lambda c, d=0: DeviceCapability(*cap)),
    )
    monkeypatch.setattr(vllm.platforms, "_current_platform", platform)
    monkeypatch.setattr(hy_attn, "current_platform", platform)
    layer = NS(kv_lora_rank=512, qk_rope_head_dim=64, is_sparse=True, num_local_heads=HEADS)
    default_dtype = torch.get_default_dtype()
    torch.set_default_dtype(torch.bfloat16)  # as under vLLM's model loader (bf16 checkpoint)
    selector._cached_get_attn_backend.cache_clear()
    try:
        with set_current_vllm_config(_hy_v4_config(attention_backend, **hf)):
            probe = hy_attn.get_attn_backend(  # the probe, verbatim (attention.py:350-358)
                head_size=layer.kv_lora_rank + layer.qk_rope_head_dim,
                dtype=torch.get_default_dtype(),
                kv_cache_dtype=kv,
                use_mla=True,
                has_sink=False,
                use_sparse=True,
                num_heads=layer.num_local_heads,
            )
            bound = hy_attn.HYV4MLAAttention._resolve_sink_backend(layer, kv)
    finally:
        torch.set_default_dtype(default_dtype)
        selector._cached_get_attn_backend.cache_clear()
    return probe, bound


def _qualname(cls) -> str | None:
    return None if cls is None else f"{cls.__module__}.{cls.__qualname__}"


@pytest.mark.parametrize("kv", ["auto", "bfloat16", "fp8_ds_mla"])
@pytest.mark.parametrize("cap", [(8, 0), (8, 6), (8, 9)])
def test_hy_v4_binds_sink_backend_on_sm8x(cuda_platform, monkeypatch, cap, kv):  # noqa: F811
    probe, bound = _hy_v4_backends(cuda_platform, monkeypatch, cap, kv)
    assert _qualname(probe) == OURS and _qualname(bound) == OURS
    assert bound.supports_sink()


@pytest.mark.parametrize("kv", ["auto", "bfloat16", "fp8_ds_mla"])
def test_hy_v4_sm120_explicit_choice_keeps_sink(cuda_platform, monkeypatch, kv):  # noqa: F811
    from vllm.v1.attention.backends.registry import AttentionBackendEnum as E

    probe, bound = _hy_v4_backends(cuda_platform, monkeypatch, (12, 0), kv, E["TRITON_MLA_SPARSE"])
    assert _qualname(probe) == OURS and _qualname(bound) == OURS


@pytest.mark.parametrize("kv", ["auto", "bfloat16", "fp8_ds_mla"])
def test_hy_v4_sm120_automatic_choice_keeps_sink(cuda_platform, monkeypatch, kv):  # noqa: F811
    """vLLM alone keeps FLASHINFER_MLA_SPARSE_SM120 (no sink) and drops the sink; the plugin's
    priority wrapper puts TRITON_MLA_SPARSE ahead of it for a model with a learnable sink."""
    probe, bound = _hy_v4_backends(cuda_platform, monkeypatch, (12, 0), kv)
    assert _qualname(probe) == OURS and _qualname(bound) == OURS


def test_sm120_without_sink_keeps_flashinfer(cuda_platform, monkeypatch):  # noqa: F811
    probe, _ = _hy_v4_backends(cuda_platform, monkeypatch, (12, 0), "auto", learnable_sink=False)
    assert probe.get_name() == "FLASHINFER_MLA_SPARSE_SM120"


# ---------------------------------------------------------------------------------------------
# (b), (c) forward


@pytest.fixture(scope="module")
def vllm_ctx():
    with cpu_vllm_config(
        heads=HEADS, block_size=BLOCK, max_tokens=256, max_model_len=4096, index_topk=2048
    ) as cfg:
        yield cfg


def _impl(buf: torch.Tensor, **sink_kw):
    """The impl as HY V4's MLAAttention constructs it (attention.py:488-525 -> mla_attention.py
    :575-596): HY V4's head dims and scale, ``sinks`` among the impl kwargs when enabled."""
    return mla_sparse_impl(
        HEADS, "auto", buf, SCALE, qk_nope_head_dim=192, v_head_dim=256, **sink_kw
    )


def _sink_values(gen: torch.Generator) -> torch.Tensor:
    sink = torch.randn(HEADS, generator=gen) * 2.0
    sink[3] = float("-inf")  # no effect
    sink[7] = float("inf")  # all mass on the sink: zero output
    return sink


def _run(vllm_ctx, monkeypatch, impl, buf, req_ids, dtype, gen):
    """vLLM's builder and forward_mqa on REQUESTS; returns (out, lse, kernel kwargs, ref args)."""
    from vllm.v1.kv_cache_interface import MLAAttentionSpec

    from triton_mla_sparse.vllm_plugin import backend as backend_mod

    cm = common_metadata(REQUESTS, BLOCK_TABLE)
    n = cm.num_actual_tokens
    spec = MLAAttentionSpec(block_size=BLOCK, num_kv_heads=1, head_size=576, dtype=dtype)
    builder = backend_mod.TritonMLASparseMetadataBuilder(
        spec, ["layer.0"], vllm_ctx, torch.device("cpu")
    )
    md = builder.build(0, cm)
    assert (md.num_decodes, md.num_prefills) == (2, 1)
    rows = torch.randn(NUM_BLOCKS * BLOCK, 576, generator=gen).to(dtype)
    kv = _paged_cache(rows)
    ql_nope = torch.randn(n, HEADS, 512, generator=gen).to(dtype)
    q_pe = torch.randn(n, HEADS, 256, generator=gen).to(dtype)[..., 192:]
    calls = []
    real = backend_mod.sparse_mla
    monkeypatch.setattr(backend_mod, "sparse_mla", lambda *a, **k: calls.append(k) or real(*a, **k))
    impl.need_to_return_lse_for_decode = True
    out, lse = impl.forward_mqa((ql_nope, q_pe), kv, md, NS(_k_scale=torch.tensor([1.0])))
    (kwargs,) = calls
    ref_args = dict(
        q=(ql_nope.double(), q_pe.double()),
        kv=kv.double(),
        indices=buf[:n],
        req_ids=req_ids,
    )
    return out, lse, kwargs, ref_args


def _reference(ref_args, attn_sink):
    return sparse_mla_reference(
        ref_args["q"],
        ref_args["kv"],
        ref_args["indices"],
        SCALE,
        block_table=torch.tensor(BLOCK_TABLE, dtype=torch.int32),
        req_ids=ref_args["req_ids"],
        block_size=BLOCK,
        attn_sink=attn_sink,
        return_lse=True,
        compute_dtype=torch.float64,
    )


def _check(out, lse, ref, ref_lse, dtype):
    assert out.dtype == dtype and out.shape == ref.shape
    err = (out.double() - ref).norm() / ref.norm()
    assert err < 2e-3, f"relative error {err:.3e}"
    assert (lse.double() - ref_lse).abs().max() < 1e-2


@pytest.mark.parametrize("sink_dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("dtype", [torch.float16, torch.float32])
def test_forward_with_sink_matches_reference(vllm_ctx, monkeypatch, dtype, sink_dtype):
    gen = torch.Generator().manual_seed(1)
    buf, req_ids = _topk_buffer(gen, REQUESTS)
    # As HY V4 holds it: make_attention_sink's Parameter (fp32 [H] when the sink is enabled);
    # bf16 stands for a checkpoint-dtype sink, which the impl converts once.
    param = torch.nn.Parameter(_sink_values(gen).to(sink_dtype), requires_grad=False)
    impl = _impl(buf, sinks=param)
    assert impl.supports_dense_mha_prefill is False  # prefill backends take no sink
    out, lse, kwargs, ref_args = _run(vllm_ctx, monkeypatch, impl, buf, req_ids, dtype, gen)

    sink = kwargs["attn_sink"]
    assert sink.dtype == torch.float32 and sink.shape == (HEADS,)
    if sink_dtype == torch.float32:
        assert sink is param  # the parameter itself: in-place weight updates are seen
    else:
        assert impl._sink_for_kernel(torch.device("cpu")) is sink  # converted once, reused
    ref, ref_lse = _reference(ref_args, param.detach().float())
    _check(out, lse, ref, ref_lse, dtype)
    assert out[:, 7].abs().max() == 0  # the +inf head
    # The sink changes the result (a sink-dropping path would not pass the check above).
    no_sink, _ = _reference(ref_args, None)
    assert (no_sink - ref).norm() / ref.norm() > 0.05

    # Weights loaded after construction (vLLM's order): the kernel sees the loaded values.
    with torch.no_grad():
        param.copy_((_sink_values(gen) - 1.0).to(sink_dtype))
    impl.process_weights_after_loading(dtype)
    assert torch.equal(impl._sink_for_kernel(torch.device("cpu")), param.detach().float())


def test_forward_without_sink_unchanged(vllm_ctx, monkeypatch):
    gen = torch.Generator().manual_seed(2)
    buf, req_ids = _topk_buffer(gen, REQUESTS)
    impl = _impl(buf)
    assert impl.sinks is None and impl.supports_dense_mha_prefill is True
    out, lse, kwargs, ref_args = _run(vllm_ctx, monkeypatch, impl, buf, req_ids, torch.float16, gen)
    assert kwargs["attn_sink"] is None
    ref, ref_lse = _reference(ref_args, None)
    _check(out, lse, ref, ref_lse, torch.float16)
    # The DeepSeek-V3.2-shaped impl of the other tests (no sinks kwarg) is unchanged too.
    assert mla_sparse_impl(HEADS, "auto", buf).supports_dense_mha_prefill is True


def test_sink_shape_and_type_checked(vllm_ctx):
    buf = torch.full((256, 2176), -1, dtype=torch.int32)
    with pytest.raises(ValueError, match="one value per local query head"):
        _impl(buf, sinks=torch.zeros(HEADS + 1))
    with pytest.raises(TypeError, match="floating tensor"):
        _impl(buf, sinks=torch.zeros(HEADS, dtype=torch.int32))
    # [1, H, 1] (ROCm's reshape) holds H values: accepted, flattened once for the kernel.
    impl = _impl(buf, sinks=torch.zeros(1, HEADS, 1))
    assert impl._sink_for_kernel(torch.device("cpu")).shape == (HEADS,)
