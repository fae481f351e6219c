"""vLLM's own DSA indexer glue, ``sparse_attn_indexer``, run on CPU with the plugin installed.

Real: vLLM 0.33's ``sparse_attn_indexer`` (prefill chunks, decode reshape, top-k dispatch), its
``DeepseekV32IndexerMetadataBuilder`` building the metadata from a ``CommonAttentionMetadata``
(mixed prefill + decode batches, next_n 1 and 2), the workspace manager, the forward context,
and the plugin's adapters calling the Triton indexer kernels (Triton's interpreter).

Stood in, because they are native CUDA ops with no CPU build (each a torch port of the op's
documented semantics, defined below): ``ops.cp_gather_indexer_k_quant_cache`` (gather a
request's K rows and scales out of the paged indexer cache), ``ops.top_k_per_row_prefill`` and
``ops.top_k_per_row_decode`` (the per-row top-k; "auto" resolves to per_row off CUDA). The
indexer cache is written with ``kv_format.write_indexer_cache`` (the fused writer is covered in
test_vllm_indexer.py). The result, vLLM's top-k buffer, must equal a float64 pipeline's.
"""

from __future__ import annotations

from types import SimpleNamespace as NS

import pytest
import torch
from conftest import require_vllm

require_vllm()
pytestmark = pytest.mark.vllm

from triton_mla_sparse.kv_format import (  # noqa: E402
    indexer_cache_blocks,
    quantize_indexer_k,
    write_indexer_cache,
)
from triton_mla_sparse.vllm_plugin import indexer_install as inst  # noqa: E402

BLOCK = 64
H, D = 8, 128
TOPK = 48
MAX_TOKENS = 64
PREFIX = "model.layers.0.self_attn.indexer.k_cache"


# ------------------------------------------------------------ stand-ins for vLLM's CUDA ops


def cp_gather_indexer_k_quant_cache(kv_cache, dst_k, dst_scale, block_table, cu_seq_lens):
    """Request r's positions [0, cu[r+1] - cu[r]) -> rows cu[r].. of dst_k (e4m3 bytes) and
    dst_scale (the 4 fp32 scale bytes), block by block through block_table[r]."""
    flat = indexer_cache_blocks(kv_cache.view(torch.uint8))
    k_u8, s_u8 = dst_k.view(torch.uint8), dst_scale.view(torch.uint8)
    for r in range(block_table.shape[0]):
        lo, hi = int(cu_seq_lens[r]), int(cu_seq_lens[r + 1])
        pos = torch.arange(hi - lo)
        blk, off = block_table[r, pos // BLOCK].long(), pos % BLOCK
        cols = off[:, None] * D + torch.arange(D)[None]
        k_u8[lo:hi] = flat[blk[:, None], cols]
        scols = BLOCK * D + off[:, None] * 4 + torch.arange(4)[None]
        s_u8[lo:hi] = flat[blk[:, None], scols]


def _topk_rows(logits, starts, ends, out, k):
    for i in range(logits.shape[0]):
        s, e = int(starts[i]), int(ends[i])
        out[i] = -1
        n = min(k, max(e - s, 0))
        if n:
            out[i, :n] = logits[i, s:e].topk(n).indices.int() + s
    return out


def top_k_per_row_prefill(logits, row_starts, row_ends, out, num_rows, s0, s1, k):
    _topk_rows(logits[:num_rows], row_starts, row_ends, out[:num_rows], k)


def top_k_per_row_decode(logits, next_n, seq_lens, out, num_rows, s0, s1, k):
    # a row's length: seq_lens per row when (B, next_n) matches the rows, else derived
    if seq_lens.numel() == num_rows:
        ends = seq_lens.reshape(-1)
    else:
        j = torch.arange(num_rows) % next_n
        ends = (seq_lens.reshape(-1).repeat_interleave(next_n) - next_n + 1 + j).clamp(min=0)
    _topk_rows(logits[:num_rows], torch.zeros_like(ends), ends, out[:num_rows], k)


@pytest.fixture
def vllm_env(monkeypatch):
    from vllm import _custom_ops as ops
    from vllm.config import DeviceConfig, VllmConfig, set_current_vllm_config
    from vllm.v1.worker import workspace

    monkeypatch.setattr(ops, "cp_gather_indexer_k_quant_cache", cp_gather_indexer_k_quant_cache)
    monkeypatch.setattr(ops, "top_k_per_row_prefill", top_k_per_row_prefill)
    monkeypatch.setattr(ops, "top_k_per_row_decode", top_k_per_row_decode)
    inst.uninstall()
    assert inst.apply(inst.indexer_plan((8, 0), {}))  # simulated SM80: every target
    cfg = VllmConfig(device_config=DeviceConfig(device="cpu"))
    if workspace._manager is None:
        workspace.init_workspace_manager(torch.device("cpu"))
    with set_current_vllm_config(cfg):
        yield cfg
    inst.uninstall()


def _builder(next_n: int):
    from vllm.config import AttentionConfig
    from vllm.v1.attention.backends.mla.indexer import DeepseekV32IndexerMetadataBuilder
    from vllm.v1.kv_cache_interface import MLAAttentionSpec

    spec = MLAAttentionSpec(block_size=BLOCK, num_kv_heads=1, head_size=132, dtype=torch.uint8)
    spec_cfg = (
        None
        if next_n == 1
        else NS(num_speculative_tokens=next_n - 1, enable_adaptive_verification=False)
    )
    cfg = NS(
        model_config=NS(max_model_len=1024),
        scheduler_config=NS(max_num_batched_tokens=MAX_TOKENS, max_num_seqs=8),
        parallel_config=NS(
            decode_context_parallel_size=1,
            tensor_parallel_size=1,
            prefill_context_parallel_size=1,
            cp_kv_cache_interleave_size=1,
            pcp_shard_decode_requests=False,
        ),
        speculative_config=spec_cfg,
        num_speculative_tokens=next_n - 1,
        attention_config=AttentionConfig(sparse_mla_prefill_workspace_factor=5),
        cache_config=NS(block_size=BLOCK),
        compilation_config=NS(cudagraph_mode=None),
    )
    return DeepseekV32IndexerMetadataBuilder(
        spec, [PREFIX], cfg, torch.device("cpu"), block_table_width=8
    )


def _batch(requests, block_table):
    from vllm.v1.attention.backend import CommonAttentionMetadata

    qlens = torch.tensor([q for q, _ in requests], dtype=torch.int32)
    seq = torch.tensor([s for _, s in requests], dtype=torch.int32)
    qsl = torch.zeros(len(requests) + 1, dtype=torch.int32)
    qsl[1:] = qlens.cumsum(0)
    T = int(qsl[-1])
    bt = torch.tensor(block_table, dtype=torch.int32)
    slots = torch.zeros(T, dtype=torch.int64)  # the cache is written directly below
    return CommonAttentionMetadata(
        query_start_loc=qsl,
        query_start_loc_cpu=qsl.clone(),
        seq_lens=seq,
        num_reqs=len(requests),
        num_actual_tokens=T,
        max_query_len=int(qlens.max()),
        max_seq_len=int(seq.max()),
        block_table_tensor=bt,
        slot_mapping=slots,
        seq_lens_cpu_upper_bound=seq.clone(),
    )


def _reference_topk(q, w, k_full, requests):
    """float64: token t of request r at position p sees positions [0, p]; logits
    kscale * sum_h w * relu(q . k8); returns per token the (logits, top-k set)."""
    out, t = [], 0
    for r, (qlen, seq) in enumerate(requests):
        k8, ks = k_full[r]
        for j in range(qlen):
            p = seq - qlen + j
            s = torch.einsum("hd,sd->hs", q[t].double(), k8[: p + 1].double()).clamp_min(0)
            lg = (s * w[t].double()[:, None]).sum(0) * ks[: p + 1].double()
            out.append(lg)
            t += 1
    return out


@pytest.mark.parametrize(
    "next_n,requests",
    [
        (1, [(1, 150), (1, 40), (1, 97), (9, 130), (5, 5)]),  # 3 decodes, 2 prefills
        (2, [(2, 150), (2, 33), (7, 120)]),  # MTP: 2 decodes of 2 tokens, 1 prefill
    ],
    ids=["next_n1", "next_n2"],
)
def test_sparse_attn_indexer_topk_equals_float64(vllm_env, monkeypatch, next_n, requests):
    from vllm.forward_context import set_forward_context
    from vllm.model_executor.layers.sparse_attn_indexer import sparse_attn_indexer

    g = torch.Generator().manual_seed(next_n)
    block_table = [[3, 7, 1, 0, 0, 0, 0, 0], [5, 0, 0, 0, 0, 0, 0, 0], [2, 6, 0, 0, 0, 0, 0, 0]]
    block_table += [[8, 4, 0, 0, 0, 0, 0, 0], [9, 0, 0, 0, 0, 0, 0, 0]]
    block_table = block_table[: len(requests)]
    # indexer cache: 10 blocks, block stride larger than 64 * 132 (other layers' pages between)
    raw = torch.full((10, BLOCK * 132 + 128), 0xFF, dtype=torch.uint8)  # 0xFF bytes = e4m3 NaN
    kv_cache = raw[:, : BLOCK * 132].view(10, BLOCK, 132)
    k_full = []
    for r, (_, seq) in enumerate(requests):
        k = torch.randn(seq, D, generator=g) * (1 + r)
        k8, ks = quantize_indexer_k(k)
        pos = torch.arange(seq)
        slots = torch.tensor(block_table[r])[pos // BLOCK].long() * BLOCK + pos % BLOCK
        write_indexer_cache(kv_cache, slots, k8, ks)
        k_full.append((k8.float(), ks))
    T = sum(q for q, _ in requests)
    q = torch.randn(T, H, D, generator=g)  # the index query as this plugin's fused_q gives it
    w = torch.randn(T, H, generator=g) * (D**-0.5) * (H**-0.5)
    buf = torch.full((MAX_TOKENS, TOPK), -7, dtype=torch.int32)

    import vllm.model_executor.layers.sparse_attn_indexer as sai

    calls = []
    for name in ("fp8_fp4_mqa_logits", "fp8_fp4_paged_mqa_logits"):
        ours = getattr(sai, name)
        assert getattr(ours, inst.MARK, False)  # the plugin's adapter is what vLLM calls

        def counted(*a, _f=ours, _n=name, **kw):
            calls.append(_n)
            return _f(*a, **kw)

        monkeypatch.setattr(sai, name, counted)
    builder = _builder(next_n)
    md = builder.build(0, _batch(requests, block_table))
    assert md.num_prefills >= 1 and md.num_decodes >= 1
    with set_forward_context({PREFIX: md}, vllm_env):
        out = sparse_attn_indexer(
            torch.empty(T, 16),
            PREFIX,
            kv_cache,
            q,
            None,
            None,
            w,
            128,
            "ue8m0",
            TOPK,
            D,
            1024,
            4096,
            buf,
            skip_k_cache_insert=True,
            use_pcp=False,
            pcp_shard_decode_requests=False,
            dense_mha_metadata_layer_name="",
        )
    assert out is buf
    assert calls.count("fp8_fp4_paged_mqa_logits") == 1 and "fp8_fp4_mqa_logits" in calls
    assert tuple(md.decode.seq_lens.shape) == (md.num_decodes, next_n)
    ref = _reference_topk(q, w, k_full, requests)
    for t, lg in enumerate(ref):
        row = buf[t]
        n = min(TOPK, lg.numel())
        chosen = row[row >= 0]
        assert chosen.numel() == n and (row[n:] == -1).all(), (t, row)
        assert len(set(chosen.tolist())) == n and int(chosen.max()) < lg.numel()
        # the chosen positions are the float64 top-n (ties within fp32 rounding may swap)
        kth = lg.topk(n).values[-1]
        tol = 1e-5 * lg.abs().max()
        assert (lg[chosen.long()] >= kth - tol).all(), t
    assert (buf[T:] == -7).all()  # rows past the batch untouched
