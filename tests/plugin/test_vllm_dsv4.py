"""DeepSeek-V4's attention through the plugin, against the real vLLM 0.33 classes on CPU.

The plugin's layer (:class:`TritonDeepseekV4Attention`, a subclass of vLLM's
``DeepseekV4Attention``) is built by vLLM's own ``__init__`` from a tiny ``DeepseekV4Config`` for
the three layer kinds (sliding window only, C4A with an indexer, C128A); vLLM's own metadata
builders build one mixed step (two decode requests, one prefill chunk) over random paged caches
(plain rows, or DeepSeek-V4's 584-byte record written by vLLM's own Triton writer), and the
layer's ``forward_mqa`` runs under the Triton interpreter. Its output is checked against

- a float64 computation of DeepSeek-V4's attention from first principles (FlashMLA's documented
  semantics: one softmax over the window's rows and the compressed rows, plus the sink), with
  rows found from positions and block tables, not from vLLM's index metadata;
- ``sparse_mla_reference`` in float64 on the exact arguments vLLM's FlashMLA layer hands
  ``flash_mla_with_kvcache`` (recorded by running vLLM's ``_forward_decode`` with the FlashMLA
  entry point swapped for a recorder).

The routing (which capability / cache dtype / backend gets the plugin's layer) is tested as a
pure function and through the installed wrapper around vLLM's ``_select_dsv4_attn_cls``.
"""

from __future__ import annotations

import contextlib
import sys
from types import SimpleNamespace as NS

import pytest
import torch
from conftest import require_vllm

require_vllm()

from triton_mla_sparse.kv_format import alloc_fp8_ds_mla_v4  # noqa: E402
from triton_mla_sparse.reference import sparse_mla_reference  # noqa: E402
from triton_mla_sparse.vllm_plugin import deepseek_v4 as dsv4  # noqa: E402

from .cpu_vllm import free_port  # noqa: E402

WINDOW = 8
TOPK = 16  # index_topk
HEADS = 4
D = 512
SWA_PAGE = 64  # vLLM's sliding-window page (sparse_swa.py:84)
BLOCK = 256  # compressed-cache block in tokens (DeepSeek-V4 sparse backends: 256)
# (query_len, seq_len): two decodes, one prefill chunk of 5 after 525 cached tokens
REQUESTS = [(1, 300), (1, 700), (5, 530)]
LAYERS = {
    1: "sliding_attention",
    4: "compressed_sparse_attention",
    128: "heavily_compressed_attention",
}


# ---------------------------------------------------------------- routing (pure)


@pytest.mark.parametrize(
    ("cap", "cache", "backend", "env", "route", "fmt"),
    [
        ((8, 0), "auto", None, {}, True, "auto"),
        ((8, 6), "fp8", None, {}, True, "fp8_ds_mla_v4"),
        ((8, 9), "fp8_ds_mla", None, {}, True, "fp8_ds_mla_v4"),
        ((8, 9), "bfloat16", None, {}, True, "auto"),
        ((9, 0), "auto", None, {}, False, ""),  # vLLM's FlashMLA
        ((10, 0), "fp8", None, {}, False, ""),
        ((12, 0), "auto", None, {}, False, ""),  # vLLM's FlashInfer, fp8 cache
        ((12, 0), "fp8", None, {}, False, ""),
        ((12, 0), "bfloat16", None, {}, True, "auto"),  # no bf16-cache kernel in vLLM
        ((8, 0), "auto", "FLASHMLA_SPARSE_DSV4", {}, False, ""),  # explicit vLLM choice
        ((9, 0), "auto", "CUSTOM", {}, True, "auto"),  # --attention-backend TRITON_MLA_SPARSE
        ((9, 0), "fp8", None, {dsv4.ENV: "triton"}, True, "fp8_ds_mla_v4"),
        (None, "auto", None, {dsv4.ENV: "triton"}, True, "auto"),
        ((8, 0), "auto", None, {dsv4.ENV: "off"}, False, ""),
        ((8, 0), "auto", None, {dsv4.ENV: "sometimes"}, False, ""),
        ((8, 0), "fp8_e5m2", None, {}, False, ""),
        (None, "auto", None, {}, False, ""),
    ],
)
def test_plan(cap, cache, backend, env, route, fmt):
    plan = dsv4.dsv4_plan(cap, cache, backend, env)
    assert plan.route is route, plan.reason
    assert plan.kv_format == (fmt if route else "")
    assert plan.reason


def test_plan_names_the_other_blockers():
    """Below Hopper the plan says what else stops the model; SM89 lacks the fp8-type ones."""
    sm80 = dsv4.dsv4_plan((8, 0), "fp8", None, {}).blockers
    sm89 = dsv4.dsv4_plan((8, 9), "fp8", None, {}).blockers
    assert any("DeepGEMM" in b for b in sm89) and any("o_proj" in b for b in sm89)
    assert not any("SM89+" in b for b in sm89)
    assert set(sm89) < set(sm80) and any("compressor" in b for b in sm80)


# ---------------------------------------------------------------- a tiny DeepSeek-V4 on CPU


@contextlib.contextmanager
def dsv4_config(cache_dtype: str, max_tokens: int = 64, max_model_len: int = 1024):
    """A current VllmConfig on CPU with a one-rank gloo world and a tiny DeepSeek-V4 config."""
    from transformers import DeepseekV4Config
    from vllm.config import (
        CacheConfig,
        DeviceConfig,
        SchedulerConfig,
        VllmConfig,
        set_current_vllm_config,
    )
    from vllm.distributed import (
        destroy_distributed_environment,
        destroy_model_parallel,
        init_distributed_environment,
        initialize_model_parallel,
    )

    hf = DeepseekV4Config(
        num_hidden_layers=3,
        layer_types=[LAYERS[1], LAYERS[4], LAYERS[128]],
        hidden_size=256,
        num_attention_heads=HEADS,
        q_lora_rank=64,
        o_groups=2,
        o_lora_rank=32,
        index_n_heads=4,
        index_head_dim=128,
        index_topk=TOPK,
        sliding_window=WINDOW,
        n_routed_experts=4,
        num_experts_per_tok=2,
        vocab_size=128,
        max_position_embeddings=4096,
        moe_intermediate_size=64,
    )
    cfg = VllmConfig(
        device_config=DeviceConfig(device="cpu"),
        scheduler_config=SchedulerConfig(
            max_num_batched_tokens=max_tokens,
            max_num_seqs=8,
            max_model_len=max_model_len,
            is_encoder_decoder=False,
        ),
        cache_config=CacheConfig(block_size=BLOCK, cache_dtype=cache_dtype),
    )
    cfg.kernel_config.enable_jit_warmup = False
    # set by vLLM's config post-processing for DSA models (v1/attention/backends/mla/indexer.py:919)
    cfg.attention_config.sparse_mla_prefill_workspace_factor = 5
    with set_current_vllm_config(cfg):
        init_distributed_environment(
            world_size=1,
            rank=0,
            local_rank=0,
            distributed_init_method=f"tcp://127.0.0.1:{free_port()}",
            backend="gloo",
        )
        initialize_model_parallel(1, 1)
        model = NS(
            hf_config=hf, hf_text_config=hf, max_model_len=max_model_len, dtype=torch.float32
        )
        object.__setattr__(cfg, "model_config", model)
        try:
            yield cfg
        finally:
            destroy_model_parallel()
            destroy_distributed_environment()


def _dequant_v4(cache: torch.Tensor) -> torch.Tensor:
    """[pages * P, 512] float64 from a vLLM-laid-out 584-byte record cache, written here from
    the format's description (flash_mla_interface.py:130-132): per page, P data rows of 576
    bytes (448 e4m3 NoPE, 64 bf16 RoPE), then P scale rows of 8 bytes (7 UE8M0 exponents)."""
    pages, p, _ = cache.shape
    stride = cache.stride(0)
    raw = cache.as_strided((pages, stride), (stride, 1))
    data = raw[:, : p * 576].reshape(pages * p, 576)
    scale = raw[:, p * 576 : p * 576 + p * 8].reshape(pages * p, 8)[:, :7]
    nope = data[:, :448].contiguous().view(torch.float8_e4m3fn).double()
    nope = nope * torch.exp2(scale.double() - 127).repeat_interleave(64, dim=1)
    rope = data[:, 448:].contiguous().view(torch.bfloat16).double()
    return torch.cat([nope, rope], dim=1)


def _rows(cache: torch.Tensor, fmt: str) -> torch.Tensor:
    return _dequant_v4(cache) if fmt == "fp8_ds_mla_v4" else cache.reshape(-1, D).double()


def _cache(num_pages: int, page: int, fmt: str, g: torch.Generator) -> torch.Tensor:
    """A paged cache as vLLM allocates it, every slot written with a random row (the record by
    vLLM's own writer, quantize_and_insert_k_cache, cache_utils.py:168)."""
    rows = torch.randn(num_pages * page, D, generator=g)
    if fmt == "auto":
        return rows.view(num_pages, page, D)  # fp32 rows: the interpreter cannot do bf16 MMAs
    from vllm.models.deepseek_v4.common.ops.cache_utils import quantize_and_insert_k_cache

    cache = alloc_fp8_ds_mla_v4(num_pages, page, fill=0xFF)
    flat = cache.as_strided((num_pages, cache.stride(0)), (cache.stride(0), 1))
    slots = torch.arange(num_pages * page, dtype=torch.int64)
    quantize_and_insert_k_cache(rows.bfloat16(), flat, slots, block_size=page)
    return cache


def _common(block_table: torch.Tensor, slot_mapping: torch.Tensor, positions: torch.Tensor):
    from vllm.v1.attention.backend import CommonAttentionMetadata

    qlens = torch.tensor([q for q, _ in REQUESTS], dtype=torch.int32)
    seqs = torch.tensor([s for _, s in REQUESTS], dtype=torch.int32)
    qsl = torch.zeros(len(REQUESTS) + 1, dtype=torch.int32)
    qsl[1:] = torch.cumsum(qlens, 0)
    return CommonAttentionMetadata(
        query_start_loc=qsl,
        query_start_loc_cpu=qsl.clone(),
        seq_lens=seqs,
        num_reqs=len(REQUESTS),
        num_actual_tokens=int(qsl[-1]),
        max_query_len=int(qlens.max()),
        max_seq_len=int(seqs.max()),
        block_table_tensor=block_table,
        slot_mapping=slot_mapping,
        positions=positions,
        seq_lens_cpu_upper_bound=seqs.clone(),
    )


def _positions() -> tuple[torch.Tensor, torch.Tensor]:
    pos, req = [], []
    for r, (ql, sl) in enumerate(REQUESTS):
        pos += list(range(sl - ql, sl))
        req += [r] * ql
    return torch.tensor(pos, dtype=torch.int64), torch.tensor(req)


def _topk(positions: torch.Tensor, g: torch.Generator) -> torch.Tensor:
    """The C4A indexer's output: per token, min((pos + 1) // 4, topk) distinct request-local
    compressed positions first (random, unsorted), then -1."""
    out = torch.full((64, TOPK), -1, dtype=torch.int32)
    for t, p in enumerate(positions.tolist()):
        n = (p + 1) // 4
        k = min(n, TOPK)
        out[t, :k] = torch.randperm(n, generator=g)[:k].int()
    return out


def _oracle(q, positions, req, swa_rows, swa_bt, c_rows, c_bt, ratio, topk, sink, scale):
    """float64 DeepSeek-V4 attention from first principles: the window's rows and the compressed
    rows (C4A: the indexer's picks; C128A: all (pos + 1) // 128) in one softmax with the sink."""
    out = torch.zeros(q.shape, dtype=torch.float64)
    for t, (p, r) in enumerate(zip(positions.tolist(), req.tolist(), strict=True)):
        lo = max(0, p - WINDOW + 1)
        slots = [int(swa_bt[r, x // SWA_PAGE]) * SWA_PAGE + x % SWA_PAGE for x in range(lo, p + 1)]
        kv = [swa_rows[slots]]
        if ratio > 1:
            page = BLOCK // ratio
            n = (p + 1) // ratio
            local = range(n) if ratio == 128 else [x for x in topk[t].tolist() if x >= 0]
            c_slots = [int(c_bt[r, x // page]) * page + x % page for x in local]
            kv.append(c_rows[c_slots])
        k = torch.cat(kv)
        s = scale * q[t].double() @ k.T  # [H, N]
        m = torch.maximum(s.max(dim=1).values, sink.double())
        e = torch.exp(s - m[:, None])
        den = e.sum(dim=1) + torch.exp(sink.double() - m)
        out[t] = (e @ k) / den[:, None]
    return out


class _Recorder:
    """Stands in for flash_mla_with_kvcache and records its keyword arguments."""

    def __init__(self):
        self.calls = []

    def __call__(self, **kw):
        self.calls.append(kw)
        return kw["out"], None


def _build(cfg, fmt: str, ratio: int, g: torch.Generator):
    """The plugin's layer of ``ratio`` with caches, vLLM's metadata for REQUESTS, q and sink."""
    from vllm.v1.kv_cache_interface import MLAAttentionSpec

    from triton_mla_sparse.vllm_plugin.deepseek_v4_layer import (
        TritonDeepseekV4Attention,
        TritonDeepseekV4MetadataBuilder,
        TritonSparseSWAMetadataBuilder,
    )

    layer_id = {1: 0, 4: 1, 128: 2}[ratio]
    positions, req = _positions()
    topk_buf = _topk(positions, g)
    layer = TritonDeepseekV4Attention(
        cfg, prefix=f"model.layers.{layer_id}.attn", topk_indices_buffer=topk_buf
    )
    assert layer.compress_ratio == ratio and layer.padded_heads == HEADS
    assert layer.kv_format == fmt
    t = positions.shape[0]
    # sliding-window group: 64-token pages, random distinct blocks per request
    swa_bt = torch.randperm(40, generator=g)[:33].view(3, 11).int()
    swa_cache = _cache(40, SWA_PAGE, fmt, g)
    layer.swa_cache_layer.bind_kv_cache(swa_cache.unsqueeze(1))
    swa_slots = swa_bt[req, positions // SWA_PAGE].long() * SWA_PAGE + positions % SWA_PAGE
    swa_spec = layer.swa_cache_layer.get_kv_cache_spec(cfg)
    prefix = layer.prefix
    swa_b = TritonSparseSWAMetadataBuilder(
        swa_spec, [layer.swa_cache_layer.prefix], cfg, torch.device("cpu")
    )
    md = {layer.swa_cache_layer.prefix: swa_b.build(0, _common(swa_bt, swa_slots, positions))}
    c_rows = c_bt = None
    if ratio > 1:
        page = BLOCK // ratio
        c_bt = torch.randperm(12, generator=g)[:9].view(3, 3).int()
        c_cache = _cache(12, page, fmt, g)
        layer.bind_kv_cache(c_cache.unsqueeze(1))
        spec = layer.get_kv_cache_spec(cfg)
        assert isinstance(spec, MLAAttentionSpec) and spec.tokens_per_state == ratio
        c_slots = c_bt[req, positions // BLOCK].long() * BLOCK + positions % BLOCK
        c_b = TritonDeepseekV4MetadataBuilder(spec, [prefix], cfg, torch.device("cpu"))
        md[prefix] = c_b.build(0, _common(c_bt.clone(), c_slots, positions))
        c_rows = _rows(c_cache, fmt)
    q = torch.randn(t, HEADS, D, generator=g)
    with torch.no_grad():
        sink = torch.tensor([-torch.inf, 0.0, 2.0, -1.0])
        layer.attn_sink.copy_(sink)
    oracle = _oracle(
        q, positions, req, _rows(swa_cache, fmt), swa_bt, c_rows, c_bt, ratio, topk_buf,
        sink, layer.scale,
    )  # fmt: skip
    return layer, md, q, positions, oracle


@pytest.mark.parametrize("fmt", ["auto", "fp8_ds_mla_v4"])
@pytest.mark.parametrize("ratio", [1, 4, 128])
def test_forward_matches_deepseek_v4_attention(fmt, ratio):
    """One mixed step (2 decodes, a 5-token prefill chunk) through the real vLLM layer built as
    the plugin's subclass: decode and prefill rows match DeepSeek-V4 attention computed in
    float64 from positions and block tables, and the decode rows match sparse_mla_reference
    (float64) on exactly the arguments vLLM's FlashMLA layer passes flash_mla_with_kvcache."""
    from vllm.forward_context import set_forward_context
    from vllm.models.deepseek_v4.nvidia import flashmla as vflashmla

    g = torch.Generator().manual_seed(1000 + ratio)
    cache_dtype = "fp8" if fmt == "fp8_ds_mla_v4" else "auto"
    with dsv4_config(cache_dtype) as cfg:
        layer, md, q, positions, oracle = _build(cfg, fmt, ratio, g)
        out = torch.full_like(q, float("nan"))
        with set_forward_context(md, cfg):
            layer.forward_mqa(q, None, positions, out)
        assert torch.isfinite(out).all()
        tol = 2e-5 if fmt == "auto" else 1e-4  # the record's RoPE/NoPE are exact; fp32 MMAs
        torch.testing.assert_close(out.double(), oracle, atol=tol, rtol=tol)
        # a head with sink -inf is plain attention; sink +2 shrinks the output of head 2
        assert out[:, 2].abs().sum() < oracle[:, 2].abs().sum() * 1.0001

        # vLLM's own FlashMLA decode on the same metadata: its exact kernel arguments
        swa_md = md[layer.swa_cache_layer.prefix]
        nd = swa_md.num_decode_tokens
        assert nd == 2 and swa_md.num_prefill_tokens == 5
        for name in ("tile_sched_swaonly", "tile_sched_c4a", "tile_sched_c128a"):
            setattr(swa_md, name, object())
        rec = _Recorder()
        orig = vflashmla.flash_mla_with_kvcache
        vflashmla.flash_mla_with_kvcache = rec
        try:
            with set_forward_context(md, cfg):
                vflashmla.DeepseekV4FlashMLAAttention._forward_decode(
                    layer,
                    q=q[:nd],
                    kv_cache=layer.kv_cache if ratio > 1 else None,
                    swa_metadata=swa_md,
                    attn_metadata=md.get(layer.prefix),
                    swa_only=ratio == 1,
                    output=torch.empty_like(q[:nd]),
                )
        finally:
            vflashmla.flash_mla_with_kvcache = orig
        (kw,) = rec.calls
        assert kw["softmax_scale"] == layer.scale and kw["attn_sink"] is layer.attn_sink
        extra = {}
        if ratio > 1:
            extra = dict(
                extra_kv_cache=kw["extra_k_cache"].squeeze(-2),
                extra_indices=kw["extra_indices_in_kvcache"].reshape(nd, -1),
                extra_valid_counts=kw["extra_topk_length"],
            )
        else:
            assert kw["extra_k_cache"] is None
        ref = sparse_mla_reference(
            kw["q"].squeeze(1),
            kw["k_cache"].squeeze(-2),
            kw["indices"].reshape(nd, -1),
            kw["softmax_scale"],
            kv_lora_rank=D,
            valid_counts=kw["topk_length"],
            kv_format=fmt,
            attn_sink=kw["attn_sink"],
            compute_dtype=torch.float64,
            **extra,
        )
        torch.testing.assert_close(out[:nd].double(), ref.double(), atol=tol, rtol=tol)


def test_profile_run_zeroes_output():
    """Without metadata (vLLM's profile / warm-up run) the layer writes zeros and reads nothing."""
    from vllm.forward_context import set_forward_context

    g = torch.Generator().manual_seed(7)
    with dsv4_config("auto") as cfg:
        layer, md, q, positions, _ = _build(cfg, "auto", 1, g)
        out = torch.full_like(q, float("nan"))
        with set_forward_context(None, cfg):
            layer.forward_mqa(q, None, positions, out)
        assert (out == 0).all()


# ---------------------------------------------------------------- the installed selector


def test_selector_wrapper_routes_by_capability(monkeypatch):
    """The wrapper installed around vLLM's _select_dsv4_attn_cls returns the plugin's layer on
    SM80/86/89 and SM120 with a bf16 cache, and vLLM's own class on SM90/SM100/SM120-fp8."""
    from vllm.platforms import current_platform
    from vllm.platforms.interface import DeviceCapability

    monkeypatch.delenv(dsv4.ENV, raising=False)
    dsv4.uninstall()
    module_name = dsv4.MODEL_MODULE
    assert dsv4.install()
    import importlib

    model = importlib.import_module(module_name)
    assert dsv4.installed() and module_name in sys.modules
    from triton_mla_sparse.vllm_plugin.deepseek_v4_layer import TritonDeepseekV4Attention

    try:
        monkeypatch.setattr(current_platform, "is_cuda", lambda: True)
        for cap, cache, want in [
            ((8, 0), "auto", TritonDeepseekV4Attention),
            ((8, 9), "fp8", TritonDeepseekV4Attention),
            ((12, 0), "bfloat16", TritonDeepseekV4Attention),
            ((9, 0), "auto", model.DeepseekV4FlashMLAAttention),
            ((10, 0), "fp8", model.DeepseekV4FlashMLAAttention),
            ((12, 0), "fp8", model.DeepseekV4FlashInferSM120Attention),
        ]:
            monkeypatch.setattr(
                current_platform,
                "get_device_capability",
                lambda device_id=0, cap=cap: DeviceCapability(*cap),
            )
            cfg = NS(attention_config=NS(backend=None), cache_config=NS(cache_dtype=cache))
            assert model._select_dsv4_attn_cls(cfg) is want, (cap, cache)
        assert dsv4.install()  # re-entrant: still one wrapper
        assert getattr(model._select_dsv4_attn_cls, "__wrapped__", None) is dsv4._state["original"]
    finally:
        dsv4.uninstall()
    assert not dsv4.installed()
