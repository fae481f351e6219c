"""The MMA operand type of e4m3 caches (heuristics.fp16_mma_for) and its two kernel variants.

On sm90, per-tensor fp8 with bf16 q in 64-head tiles runs bf16 MMAs: the fp16 variant keeps q as
a register-sourced wgmma operand that ptxas serialises and spills, and it returned non-finite
partials under compute-sanitizer (docs/RELIABILITY.md, benchmarks/reliability/fp8_hazard.py).
"""

from __future__ import annotations

import dataclasses

import pytest
import torch
from conftest import HAS_GPU

from triton_mla_sparse import sparse_mla
from triton_mla_sparse.kv_format import quantize_fp8
from triton_mla_sparse.ops.sparse_mla.heuristics import TARGETS, Arch, choose_config, fp16_mma_for
from triton_mla_sparse.reference import sparse_mla_reference

SM90 = Arch("cuda", 90, 132)


@pytest.mark.parametrize("heads", [64, 128])
def test_sm90_bf16_fp8_wide_tiles_use_bf16_mma(heads):
    cfg = choose_config(4, heads, 2048, torch.bfloat16, "fp8", SM90)
    assert cfg.block_h == 64
    assert fp16_mma_for(torch.bfloat16, "fp8", SM90, cfg.block_h) is False


@pytest.mark.parametrize("arch", TARGETS, ids=lambda a: f"{a.backend}{a.cc}")
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("fmt", ["fp8", "fp8_ds_mla"])
@pytest.mark.parametrize("heads", [8, 16, 32, 64, 128])
def test_fp16_mma_elsewhere(arch, dtype, fmt, heads):
    cfg = choose_config(4, heads, 2048, dtype, fmt, arch)
    wide_sm90_fp8_bf16 = (
        arch == SM90 and fmt == "fp8" and dtype == torch.bfloat16 and cfg.block_h >= 64
    )
    assert fp16_mma_for(dtype, fmt, arch, cfg.block_h) is not wide_sm90_fp8_bf16


@pytest.mark.gpu
@pytest.mark.skipif(
    not HAS_GPU, reason="bf16 MMAs need a GPU (the interpreter computes bf16 wrongly)"
)
@pytest.mark.parametrize("fp16_mma", [True, False])
@pytest.mark.parametrize("tokens,heads", [(1, 64), (4, 128), (64, 64)])
def test_both_mma_variants_match_reference(fp16_mma, tokens, heads):
    g = torch.Generator().manual_seed(tokens * 1000 + heads)
    n, w = 4096, 2048
    q = torch.randn(tokens, heads, 576, generator=g).bfloat16().cuda()
    cache, scale = quantize_fp8(torch.randn(n, 576, generator=g).cuda())
    idx = torch.stack([torch.randperm(n, generator=g)[:w] for _ in range(tokens)]).int().cuda()
    kw = {"kv_format": "fp8", "k_scale": scale}
    cfg = choose_config(tokens, heads, w, torch.bfloat16, "fp8", Arch("cuda", 90, 132))
    cfg = dataclasses.replace(cfg, fp16_mma=fp16_mma)
    out = sparse_mla(q, cache, idx, 0.07, config=cfg, **kw)
    ref = sparse_mla_reference(q, cache, idx, 0.07, **kw)
    assert torch.isfinite(out).all()
    err = (out.float() - ref.float()).norm() / ref.float().norm()
    assert err < 1e-2
