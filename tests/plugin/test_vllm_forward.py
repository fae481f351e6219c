"""The metadata builder and impl against the real vLLM 0.33 sparse MLA classes, on CPU.

vLLM's own builder turns a CommonAttentionMetadata (two decodes and one 130-token prefill) into
sparse MLA metadata; the impl's ``forward_mqa`` (vLLM's base method) converts the request-local
top-k buffer into physical rows with vLLM's Triton conversion kernel and calls our kernel. The
result must equal the float64 reference computed from the *logical* inputs (top-k positions, block
table, paged cache), so both the glue and vLLM's conversion are checked end to end.
"""

from __future__ import annotations

from types import SimpleNamespace as NS

import pytest
import torch
from conftest import require_vllm

require_vllm()
pytestmark = pytest.mark.vllm

from triton_mla_sparse.kv_format import pack_fp8_ds_mla, quantize_fp8  # noqa: E402
from triton_mla_sparse.reference import sparse_mla_reference  # noqa: E402

from .cpu_vllm import common_metadata, cpu_vllm_config, mla_sparse_impl  # noqa: E402

HEADS = 16
BLOCK = 64
WIDTH = 2176  # GLM-5.3-Flash's top-k buffer width: wider than index_topk (2048)
NUM_BLOCKS = 10
STRIDE_ROWS = 80  # rows between consecutive blocks > BLOCK: other layers' pages sit in between
MAX_TOKENS = 256
# (query_len, seq_len) per request: two decodes, then a prefill longer than the reorder
# threshold (128 for 16 heads) so vLLM classifies it as a prefill.
REQUESTS = [(1, 150), (1, 94), (130, 200)]
BLOCK_TABLE = [[5, 2, 7, 0], [9, 1, 0, 0], [3, 8, 4, 6]]


@pytest.fixture(scope="module")
def vllm_ctx():
    with cpu_vllm_config(
        heads=HEADS, block_size=BLOCK, max_tokens=MAX_TOKENS, max_model_len=4096, index_topk=2048
    ) as cfg:
        yield cfg


def _common_metadata(requests=REQUESTS, block_table=BLOCK_TABLE):
    return common_metadata(requests, block_table)


def _topk_buffer(gen: torch.Generator, requests=REQUESTS) -> tuple[torch.Tensor, torch.Tensor]:
    """The indexer's buffer: -1 everywhere, then causal request-local positions with -1 holes."""
    buf = torch.full((MAX_TOKENS, WIDTH), -1, dtype=torch.int32)
    req_ids = []
    t = 0
    for r, (qlen, seq) in enumerate(requests):
        for i in range(qlen):
            pos = seq - qlen + i  # this token's position; it may attend to 0..pos
            k = min(pos + 1, 48 if qlen == 1 else 6)  # keep the interpreter's work small
            chosen = torch.randperm(pos + 1, generator=gen)[:k].to(torch.int32)
            slots = torch.randperm(WIDTH, generator=gen)[:k]  # scattered: interior holes
            buf[t, slots] = chosen
            req_ids.append(r)
            t += 1
    return buf, torch.tensor(req_ids, dtype=torch.int32)


def _paged_cache(rows: torch.Tensor) -> torch.Tensor:
    """[NUM_BLOCKS, BLOCK, C] view whose block stride is STRIDE_ROWS rows, like vLLM's."""
    c = rows.shape[-1]
    raw = torch.full((NUM_BLOCKS, STRIDE_ROWS, c), 0, dtype=rows.dtype)
    raw[:, :BLOCK] = rows.view(NUM_BLOCKS, BLOCK, c)
    if rows.is_floating_point():
        raw[:, BLOCK:] = 1e4  # rows no index may reach: reading one would wreck the output
    view = raw[:, :BLOCK]
    assert view.stride(0) == STRIDE_ROWS * c
    return view


def test_builder_classifies_mixed_batch(vllm_ctx):
    from vllm.v1.kv_cache_interface import MLAAttentionSpec

    from triton_mla_sparse.vllm_plugin.backend import (
        TritonMLASparseBackend,
        TritonMLASparseMetadata,
    )

    spec = TritonMLASparseBackend.customize_spec(
        MLAAttentionSpec(block_size=BLOCK, num_kv_heads=1, head_size=576, dtype=torch.float16)
    )
    builder = TritonMLASparseBackend.get_builder_cls()(
        spec, ["layer.0"], vllm_ctx, torch.device("cpu")
    )
    assert builder.reorder_batch_threshold == 128
    md = builder.build(0, _common_metadata())
    assert isinstance(md, TritonMLASparseMetadata)
    assert (md.num_decodes, md.num_prefills, md.num_decode_tokens) == (2, 1, 2)
    assert md.block_size == BLOCK and md.topk_tokens == 2048
    assert md.req_id_per_token.tolist() == [0, 1] + [2] * 130


def _random_batch(seed: int) -> tuple[list[tuple[int, int]], list[list[int]]]:
    """A reordered batch as vLLM builds it (decodes, then a prefill on even seeds): 1-4
    requests, decodes of 1-4 query tokens (spec decode), a prefill past the reorder threshold,
    sequence lengths not multiples of the block, a scrambled block table over the cache's blocks
    (unused entries 0)."""
    rng = torch.Generator().manual_seed(1000 + seed)
    n = int(torch.randint(1, 5, (1,), generator=rng))
    n_pre = 1 - seed % 2  # odd seeds: a decode-only batch (decodes are captured in graphs)
    reqs = []
    for i in range(n):
        qlen = (
            int(torch.randint(129, 140, (1,), generator=rng))
            if i >= n - n_pre
            else int(torch.randint(1, 5, (1,), generator=rng))
        )
        seq = qlen + int(torch.randint(0, 256 - qlen, (1,), generator=rng))
        reqs.append((qlen, seq))
    perm = torch.randperm(NUM_BLOCKS, generator=rng).tolist()
    table, used = [], 0
    for _, seq in reqs:
        need = -(-seq // BLOCK)
        if used + need > NUM_BLOCKS:
            used = 0  # requests may share physical blocks: the reference reads the same rows
        table.append((perm[used : used + need] + [0] * 4)[:4])
        used += need
    return reqs, table


BATCHES = [("fixed", REQUESTS, BLOCK_TABLE)] + [(f"random{s}", *_random_batch(s)) for s in range(4)]


@pytest.mark.parametrize("kv_cache_dtype", ["auto", "fp8", "fp8_ds_mla"])
@pytest.mark.parametrize("batch", BATCHES, ids=[b[0] for b in BATCHES])
def test_forward_mqa_matches_reference(vllm_ctx, monkeypatch, kv_cache_dtype, batch):
    """vLLM's metadata and forward_mqa on a fixed mixed batch and on random reordered batches."""
    from vllm.v1.kv_cache_interface import MLAAttentionSpec

    from triton_mla_sparse.vllm_plugin import backend as backend_mod

    _, requests, block_table = batch
    gen = torch.Generator().manual_seed(0)
    buf, req_ids = _topk_buffer(gen, requests)
    cm = _common_metadata(requests, block_table)
    num_tokens = cm.num_actual_tokens
    spec = MLAAttentionSpec(block_size=BLOCK, num_kv_heads=1, head_size=576, dtype=torch.float16)
    builder = backend_mod.TritonMLASparseMetadataBuilder(
        spec, ["layer.0"], vllm_ctx, torch.device("cpu")
    )
    md = builder.build(0, cm)
    impl = mla_sparse_impl(HEADS, kv_cache_dtype, buf)

    rows = torch.randn(NUM_BLOCKS * BLOCK, 576, generator=gen)
    k_scale = None
    if kv_cache_dtype == "auto":
        kv = _paged_cache(rows.half())
        ref_cache, ref_format = kv.double(), "auto"
    elif kv_cache_dtype == "fp8":
        q8, k_scale = quantize_fp8(rows)
        # vLLM hands an fp8 cache over viewed as float8_e4m3fn (mla_attention.py:972-977)
        kv = _paged_cache(q8.view(torch.uint8)).view(torch.float8_e4m3fn)
        ref_cache, ref_format = kv, "fp8"
    else:
        kv = _paged_cache(pack_fp8_ds_mla(rows))
        ref_cache, ref_format = kv, "fp8_ds_mla"
    layer = NS(_k_scale=torch.tensor([k_scale if k_scale is not None else 1.0]))

    # q as vLLM's MLA layer builds it: latent from a bmm into a token-major buffer, rope a
    # strided slice of the projected query.
    ql_nope = torch.randn(num_tokens, HEADS, 512, generator=gen).half()
    q_pe = torch.randn(num_tokens, HEADS, 192, generator=gen).half()[..., 128:]
    calls = []
    real = backend_mod.sparse_mla
    monkeypatch.setattr(
        backend_mod, "sparse_mla", lambda *a, **k: calls.append((a, k)) or real(*a, **k)
    )
    impl.need_to_return_lse_for_decode = True  # as under DCP: vLLM asks for the LSE
    out, lse = impl.forward_mqa((ql_nope, q_pe), kv, md, layer)

    # vLLM's q tuple and converted indices reach the kernel untouched (no concat, no re-pass).
    ((args, kwargs),) = calls
    assert args[0][0] is ql_nope and args[0][1] is q_pe
    assert args[2].shape == (num_tokens, WIDTH) and kwargs["valid_counts"].shape == (num_tokens,)
    assert kwargs["kv_format"] == {"auto": "auto"}.get(kv_cache_dtype, kv_cache_dtype)
    assert out.shape == (num_tokens, HEADS, 512) and out.dtype == torch.float16
    assert lse is not None and lse.shape == (num_tokens, HEADS)

    ref, ref_lse = sparse_mla_reference(
        (ql_nope.double(), q_pe.double()),
        ref_cache,
        buf[:num_tokens],
        576**-0.5,
        block_table=torch.tensor(block_table, dtype=torch.int32),
        req_ids=req_ids,
        block_size=BLOCK,
        kv_format=ref_format,
        k_scale=k_scale,
        return_lse=True,
        compute_dtype=torch.float64,
    )
    # fp16 inputs are exact in both; the kernel rounds P and the output to fp16 (unit roundoff
    # 4.9e-4) and accumulates in fp32, so a correct result is within ~1e-3 in norm. A misread
    # row, a wrong scale or a lost index is O(1). Same inputs dequantized for the fp8 formats.
    err = (out.double() - ref).norm() / ref.norm()
    assert err < 2e-3, f"relative error {err:.3e}"
    per_token = (out.double() - ref).flatten(1).norm(dim=1) / ref.flatten(1).norm(dim=1)
    assert per_token.max() < 4e-3, per_token
    # LSE from fp32 softmax statistics of fp16 scores: absolute error well under 1e-2.
    assert (lse.double() - ref_lse.double()).abs().max() < 1e-2
