"""A small DSA layer end to end on CPU: the plugin's fused_q -> vLLM's sparse_attn_indexer (the
plugin's Triton logits, vLLM's top-k dispatch) -> request-local top-k buffer -> the plugin's
backend ``forward_mqa`` (vLLM's index conversion, the Triton sparse MLA kernel), against a dense
float64 pipeline (rope, exact indexer logits over the same e4m3 K cache, top-k, softmax attention
over the chosen latent rows).

Stood in (native CUDA ops, no CPU build; torch ports in test_vllm_indexer_glue.py):
``ops.cp_gather_indexer_k_quant_cache``, ``ops.top_k_per_row_prefill``/``_decode``. The two caches
are written directly (their writers are tested in test_vllm_indexer.py).
"""

from __future__ import annotations

from types import SimpleNamespace as NS

import pytest
import torch
from conftest import require_vllm

require_vllm()
pytestmark = pytest.mark.vllm

from triton_mla_sparse.kv_format import quantize_indexer_k, write_indexer_cache  # noqa: E402
from triton_mla_sparse.reference import rope_reference  # noqa: E402
from triton_mla_sparse.vllm_plugin import indexer_install as inst  # noqa: E402
from triton_mla_sparse.workloads import DSV32_SOFTMAX_SCALE  # noqa: E402

from .cpu_vllm import common_metadata, cpu_vllm_config, mla_sparse_impl  # noqa: E402
from .test_vllm_indexer_glue import (  # noqa: E402
    cp_gather_indexer_k_quant_cache,
    top_k_per_row_decode,
    top_k_per_row_prefill,
)

HEADS, IH, ID = 16, 8, 128  # attention heads per rank; index heads, index head dim
BLOCK, NUM_BLOCKS = 64, 12
TOPK = 128  # vLLM's top-k -> physical conversion needs a width that is a multiple of 128
MAX_TOKENS = 64
SCALE = DSV32_SOFTMAX_SCALE
PREFIX = "layer.0.indexer.k_cache"
# (query_len, seq_len): two decodes and a 5-token extend (a prefill for the indexer, whose
# decode threshold is next_n = 1; the MLA builder counts it as a decode: both as in vLLM)
REQUESTS = [(1, 150), (1, 200), (5, 170)]
BLOCK_TABLE = [[5, 2, 7, 0], [9, 1, 3, 11], [4, 8, 6, 0]]


@pytest.fixture(scope="module")
def vllm_ctx():
    with cpu_vllm_config(
        heads=HEADS,
        block_size=BLOCK,
        max_tokens=MAX_TOKENS,
        max_model_len=1024,
        index_topk=TOPK,
        workspace=True,
    ) as cfg:
        yield cfg


def _common():
    return common_metadata(REQUESTS, BLOCK_TABLE)


def _indexer_builder(cfg):
    from vllm.config import AttentionConfig
    from vllm.v1.attention.backends.mla.indexer import DeepseekV32IndexerMetadataBuilder
    from vllm.v1.kv_cache_interface import MLAAttentionSpec

    spec = MLAAttentionSpec(block_size=BLOCK, num_kv_heads=1, head_size=132, dtype=torch.uint8)
    icfg = NS(
        model_config=NS(max_model_len=1024),
        scheduler_config=cfg.scheduler_config,
        parallel_config=cfg.parallel_config,
        speculative_config=None,
        num_speculative_tokens=0,
        attention_config=AttentionConfig(sparse_mla_prefill_workspace_factor=5),
        cache_config=cfg.cache_config,
        compilation_config=cfg.compilation_config,
    )
    return DeepseekV32IndexerMetadataBuilder(
        spec, [PREFIX], icfg, torch.device("cpu"), block_table_width=len(BLOCK_TABLE[0])
    )


@pytest.mark.parametrize("interleave", [False, True], ids=["neox", "interleaved"])
def test_dsa_layer_matches_dense_float64(vllm_ctx, monkeypatch, interleave):
    from vllm import _custom_ops as ops
    from vllm.forward_context import set_forward_context
    from vllm.model_executor.layers.sparse_attn_indexer import sparse_attn_indexer
    from vllm.models.deepseek_v32 import attention as att
    from vllm.v1.kv_cache_interface import MLAAttentionSpec

    from triton_mla_sparse.vllm_plugin import backend as backend_mod

    monkeypatch.setattr(ops, "cp_gather_indexer_k_quant_cache", cp_gather_indexer_k_quant_cache)
    monkeypatch.setattr(ops, "top_k_per_row_prefill", top_k_per_row_prefill)
    monkeypatch.setattr(ops, "top_k_per_row_decode", top_k_per_row_decode)
    inst.uninstall()
    assert inst.apply(inst.indexer_plan((8, 0), {}))  # simulated SM80
    try:
        g = torch.Generator().manual_seed(int(interleave))
        # caches: per request, every context position's MLA row (fp16) and index K (e4m3)
        mla_raw = torch.full((NUM_BLOCKS, BLOCK + 16, 576), 1e4, dtype=torch.float16)
        mla = mla_raw[:, :BLOCK]  # block stride > BLOCK rows; the 1e4 rows must never be read
        icache = torch.full((NUM_BLOCKS, BLOCK * 132 + 64), 0xFF, dtype=torch.uint8)
        icache = icache[:, : BLOCK * 132].view(NUM_BLOCKS, BLOCK, 132)
        rows, kidx = [], []
        for r, (_, seq) in enumerate(REQUESTS):
            pos = torch.arange(seq)
            blk = torch.tensor(BLOCK_TABLE[r])[pos // BLOCK].long()
            row = torch.randn(seq, 576, generator=g).half()
            mla[blk, pos % BLOCK] = row
            k8, ks = quantize_indexer_k(torch.randn(seq, ID, generator=g))
            write_indexer_cache(icache, blk * BLOCK + pos % BLOCK, k8, ks)
            rows.append(row.double())
            kidx.append((k8.double(), ks.double()))
        # this step's tokens
        positions = torch.cat([torch.arange(s - q, s) for q, s in REQUESTS])
        T = positions.numel()
        cs = torch.rand(256, 64, generator=g) * 2 - 1
        q_pe = torch.randn(T, HEADS, 192, generator=g).half()[..., 128:]
        ql_nope = torch.randn(T, HEADS, 512, generator=g).half()
        index_q = torch.randn(T, IH, ID, generator=g).half()
        index_w = torch.randn(T, IH, generator=g)

        iq, iw, mqa_q_pe = att.fused_q(  # the plugin's, looked up where vLLM looks it up
            positions,
            q_pe,
            cs,
            index_q,
            cs,
            ql_nope,
            torch.ones(1),
            index_w,
            ID**-0.5,
            IH**-0.5,
            has_indexer=True,
            index_rope_interleave=interleave,
            quantize_mqa=False,
        )
        buf = torch.full((MAX_TOKENS, TOPK), -1, dtype=torch.int32)
        imd = _indexer_builder(vllm_ctx).build(0, _common())
        assert imd.num_prefills == 1 and imd.num_decodes == 2
        with set_forward_context({PREFIX: imd}, vllm_ctx):
            sparse_attn_indexer(
                torch.empty(T, 16),
                PREFIX,
                icache,
                iq,
                None,
                None,
                iw,
                128,
                "ue8m0",
                TOPK,
                ID,
                1024,
                4096,
                buf,
                skip_k_cache_insert=True,
                use_pcp=False,
                pcp_shard_decode_requests=False,
                dense_mha_metadata_layer_name="",
            )

        spec = MLAAttentionSpec(
            block_size=BLOCK, num_kv_heads=1, head_size=576, dtype=torch.float16
        )
        md = backend_mod.TritonMLASparseMetadataBuilder(
            spec, ["layer.0"], vllm_ctx, torch.device("cpu")
        ).build(0, _common())
        impl = mla_sparse_impl(HEADS, "auto", buf, SCALE)
        out, _ = impl.forward_mqa((ql_nope, mqa_q_pe), mla, md, NS(_k_scale=torch.ones(1)))
    finally:
        inst.uninstall()

    # dense float64 pipeline
    iq64 = rope_reference(index_q, cs, positions, interleave)
    w64 = index_w.double() * ID**-0.5 * IH**-0.5
    qpe64 = rope_reference(q_pe, cs, positions, True)
    t = 0
    for r, (qlen, seq) in enumerate(REQUESTS):
        k8, ks = kidx[r]
        for j in range(qlen):
            p = seq - qlen + j
            lg = torch.einsum("hd,sd->hs", iq64[t], k8[: p + 1]).clamp_min(0) * w64[t][:, None]
            lg = lg.sum(0) * ks[: p + 1]
            want = set(lg.topk(min(TOPK, p + 1)).indices.tolist())
            got = buf[t][buf[t] >= 0]
            assert set(got.tolist()) == want and got.numel() == len(want), t
            sel = torch.tensor(sorted(want))
            kv = rows[r][sel]
            q = torch.cat([ql_nope[t].double(), qpe64[t]], dim=-1)
            p_attn = torch.softmax(SCALE * q @ kv.T, dim=-1)
            ref = p_attn @ kv[:, :512]
            err = (out[t].double() - ref).norm() / ref.norm()
            assert err < 3e-3, (t, err)
            t += 1
