"""The FlashMLA glue of ``bench --compare flashmla`` against vLLM 0.33's own code, on CPU.

What FLASHMLA_SPARSE hands FlashMLA is built by vLLM's helpers (index conversion, cache views,
head padding rules); each is run here beside the glue's version on the same input. Then the
glue drives vLLM's real ``flash_mla_interface.py`` (its Python: argument routing, scheduler
metadata bookkeeping and assertions) with FlashMLA's compiled ops replaced by the CPU fake.
"""

from __future__ import annotations

import inspect
import sys
import types

import pytest
import torch
from conftest import require_vllm

require_vllm()
pytestmark = pytest.mark.vllm

from flashmla_fake import FakeOps  # noqa: E402

from triton_mla_sparse.kv_format import pack_fp8_ds_mla  # noqa: E402
from triton_mla_sparse.peers import flashmla  # noqa: E402
from triton_mla_sparse.reference import sparse_mla_reference  # noqa: E402

BLOCK = 64
NUM_BLOCKS = 6
ROWS = NUM_BLOCKS * BLOCK


def _indices(tokens: int, width: int, seed: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    idx = torch.randint(-2, ROWS + 100, (tokens, width), generator=g, dtype=torch.int32)
    idx[0, : width // 2] = -1  # a leading run of -1
    idx[1] = -1  # no valid entry
    idx[2, 5] = ROWS  # the first row past the cache
    return idx


@pytest.mark.parametrize("width", [256, 2048])
def test_index_layouts_match_vllm_conversion(width):
    """With an identity block table vLLM's conversion maps positions to the same flat rows, so its
    output is exactly the layout FlashMLA gets: compacted with counts on the bf16 path
    (return_valid_counts=True), in place on the fp8 path (False)."""
    from vllm.v1.attention.backends.mla.sparse_utils import (
        triton_convert_req_index_to_global_index as convert,
    )

    idx = _indices(4, width)
    req = torch.zeros(4, dtype=torch.int32)
    table = torch.arange(NUM_BLOCKS, dtype=torch.int32)[None]
    kw = dict(BLOCK_SIZE=BLOCK, NUM_TOPK_TOKENS=width)
    v_packed, v_counts = convert(req, table, idx, return_valid_counts=True, **kw)
    packed, counts = flashmla.compacted_indices(idx, ROWS)
    assert torch.equal(packed, v_packed) and torch.equal(counts, v_counts)
    assert torch.equal(flashmla.physical_indices(idx, ROWS), convert(req, table, idx, **kw))


def test_head_rules_match_vllm():
    from vllm.v1.attention.backends.mla import flashmla_sparse as fs

    assert flashmla.FP8_MIXED_BATCH_BELOW_HEADS == fs.MIN_HEADS_FOR_BF16_PREFILL
    for h in range(1, 129):
        assert flashmla.fp8_decode_heads(
            h
        ) == fs.FlashMLASparseImpl._compute_fp8_decode_padded_heads(h)
    # prefill_padding is set in __init__, which needs a whole vLLM config: read the assignment.
    init = inspect.getsource(fs.FlashMLASparseImpl.__init__)
    assert f"self.prefill_padding = {flashmla.SPARSE_FWD_HEAD_MULTIPLE}\n" in init
    assert "fp8_use_mixed_batch = (\n            self.num_heads < MIN_HEADS_FOR_BF16_PREFILL" in (
        inspect.getsource(fs.FlashMLASparseMetadataBuilder.__init__)
    )


def test_cache_views_match_vllm():
    from vllm.v1.attention.backends.mla.flashmla_sparse import _fp8_kv_pages
    from vllm.v1.attention.backends.mla.sparse_utils import flat_kv_row_view

    kv = torch.randn(NUM_BLOCKS, BLOCK, 576).to(torch.bfloat16)
    rows, _ = flat_kv_row_view(kv, BLOCK)
    theirs = rows.view(-1, 1, rows.shape[-1])  # _bf16_flash_mla_kernel
    ours = flashmla.sparse_fwd_kv(kv)
    assert (ours.shape, ours.stride(), ours.data_ptr()) == (
        theirs.shape,
        theirs.stride(),
        theirs.data_ptr(),
    )
    packed = pack_fp8_ds_mla(torch.randn(ROWS, 576), "fp32").view(NUM_BLOCKS, BLOCK, 656)
    pages, _ = _fp8_kv_pages(packed, BLOCK)
    theirs = pages.view(torch.uint8).unsqueeze(-2)  # _fp8_flash_mla_kernel's k_cache
    ours = flashmla.ds_mla_pages(packed)
    assert (ours.shape, ours.stride(), ours.data_ptr(), ours.dtype) == (
        theirs.shape,
        theirs.stride(),
        theirs.data_ptr(),
        theirs.dtype,
    )


@pytest.fixture
def interface(monkeypatch):
    """vLLM's flash_mla_interface.py, imported with a stub for the compiled module and its op
    namespace replaced by the fake (vLLM's op module, which load() asks first, answering that
    FlashMLA runs here: on a CPU machine it would say why not)."""
    monkeypatch.setitem(sys.modules, "vllm._flashmla_C", types.ModuleType("vllm._flashmla_C"))
    op = types.SimpleNamespace(is_flashmla_sparse_supported=lambda: (True, None))
    monkeypatch.setitem(sys.modules, flashmla.VLLM_OP, op)
    sys.modules.pop(flashmla.INTERFACE, None)
    try:
        mod = flashmla.load()
        assert mod.__file__.endswith("vllm/third_party/flashmla/flash_mla_interface.py")
        monkeypatch.setattr(mod, "flash_mla_cuda", FakeOps())
        yield mod
    finally:
        sys.modules.pop(flashmla.INTERFACE, None)  # later imports must see the real state


@pytest.mark.parametrize(
    "kv_format,heads,label",
    [
        ("auto", 16, "sparse_fwd h64"),
        ("fp8_ds_mla", 8, "kvcache fp8 h64 b1xs4"),
        ("fp8_ds_mla", 64, "kvcache fp8 h64 b4xs1"),
        ("fp8_ds_mla", 128, "kvcache fp8 h128 b4xs1"),
    ],
)
def test_glue_through_vllms_interface(interface, kv_format, heads, label):
    g = torch.Generator().manual_seed(3)
    q = torch.randn(4, heads, 576, generator=g).to(torch.bfloat16)
    base = torch.randn(ROWS, 576, generator=g)
    kv = pack_fp8_ds_mla(base, "fp32") if kv_format == "fp8_ds_mla" else base.to(torch.bfloat16)
    kv = kv.view(NUM_BLOCKS, BLOCK, kv.shape[-1])
    idx = _indices(4, 128, seed=1)
    call = flashmla.prepare_call(interface, q, kv, idx, 0.05, kv_format)
    assert call.label == label
    ref = sparse_mla_reference(q, kv, idx, 0.05, kv_format=kv_format)
    for _ in range(2):  # the second call goes through the interface's metadata-reuse checks
        out = call.run()
        assert out.shape == (4, heads, 512)
        err = (out.double() - ref.double()).norm() / ref.double().norm()
        assert err < 1e-2, err
    assert len(interface.flash_mla_cuda.calls) == 2
    if kv_format == "fp8_ds_mla":  # the interface recorded the shapes its metadata is valid for
        config = _sched_meta(call).config
        b, s = (1, 4) if heads < 32 else (4, 1)
        assert (config.b, config.s_q, config.h_q, config.topk) == (
            b,
            s,
            64 if heads <= 64 else 128,
            128,
        )
        assert config.is_fp8_kvcache and config.page_block_size == BLOCK


def _sched_meta(call):
    """The FlashMLASchedMeta a prepared fp8 call holds."""
    cells = [c.cell_contents for c in call.run.__closure__]
    (meta,) = [c for c in cells if type(c).__name__ == "FlashMLASchedMeta"]
    return meta


@pytest.mark.parametrize("op", ["sparse_decode_fwd", "sparse_prefill_fwd"])
def test_fake_ops_take_the_compiled_schema(op):
    """The fake's ops take the arguments (names, order) the schema registered by vLLM's _flashmla_C.abi3.so
    declares (read from the library's bytes: it cannot be loaded without a GPU driver)."""
    import os
    import re

    import vllm

    with open(os.path.join(os.path.dirname(vllm.__file__), "_flashmla_C.abi3.so"), "rb") as f:
        blob = f.read()
    (schema,) = set(re.findall(rb"\b" + op.encode() + rb"\(([^()]*(?:\([a-z]!?\)[^()]*)*)\)", blob))
    names = [a.split()[-1].split("=")[0] for a in schema.decode().split(", ")]
    params = list(inspect.signature(getattr(FakeOps, op)).parameters)[1:]
    assert params == names


def test_v4_head_rule_matches_vllm():
    """DeepSeek-V4's FlashMLA decode pads q to 64 or 128 heads (DeepseekV4FlashMLAAttention)."""
    from vllm.models.deepseek_v4.nvidia.flashmla import DeepseekV4FlashMLAAttention as V4

    for h in range(1, 129):
        assert flashmla.fp8_decode_heads(h) == V4.get_padded_num_q_heads(h)


def test_v4_glue_through_vllms_interface(interface):
    """The DeepSeek-V4 call through vLLM's real interface (its keyword names, its sparse-decode
    routing, its metadata bookkeeping with an extra cache), twice, against the reference."""
    from triton_mla_sparse.testing import assert_sparse_mla_close
    from triton_mla_sparse.workloads import deepseek_v4_case, make_inputs

    case = deepseek_v4_case(3, 16, rows=2 * BLOCK * NUM_BLOCKS, holes=True)
    inp = make_inputs(case, torch.device("cpu"))
    kw = {k: v for k, v in inp.kwargs.items() if k != "kv_format"}
    call = flashmla.prepare_call(
        interface, inp.q, inp.kv_cache, inp.indices, inp.scale, case.kv_format, **kw
    )
    assert call.label == "kvcache v4 h64 b3xs1 +extra"
    ref = sparse_mla_reference(
        inp.q, inp.kv_cache, inp.indices, inp.scale, kv_format=case.kv_format, **kw
    )
    for _ in range(2):
        assert_sparse_mla_close(call.run(), ref)
    config = _sched_meta(call).config
    assert (config.b, config.s_q, config.h_q, config.topk) == (3, 1, 64, 128)
    assert (config.extra_page_block_size, config.extra_topk) == (BLOCK, 512)
    assert config.is_fp8_kvcache and config.page_block_size == BLOCK
