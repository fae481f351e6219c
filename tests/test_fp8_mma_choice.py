"""The MMA operand type of e4m3 caches (heuristics.fp16_mma_for) and its two kernel variants.

On sm90, per-tensor fp8 with bf16 q in 64-head tiles runs bf16 MMAs: the fp16 variant keeps q as
a register-sourced wgmma operand that ptxas serialises and spills, and it returned non-finite
partials under compute-sanitizer (docs/RELIABILITY.md, benchmarks/reliability/fp8_hazard.py).
"""

from __future__ import annotations

import dataclasses

import pytest
import torch
from conftest import DEVICE, DTYPES, HAS_GPU, dtype_id
from test_sparse_mla import assert_matches, poison_

from triton_mla_sparse import KernelConfig, pack_fp8_ds_mla, sparse_mla
from triton_mla_sparse.kv_format import quantize_fp8
from triton_mla_sparse.ops.sparse_mla.heuristics import (
    TARGETS,
    Arch,
    choose_config,
    folds_ds_mla_fp16,
    folds_v4_scales,
    fp16_mma_for,
)
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


@pytest.mark.parametrize("arch", TARGETS, ids=lambda a: f"{a.backend}{a.cc}")
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("tokens", [1, 8, 16, 128])
@pytest.mark.parametrize("heads", [16, 64, 128])
def test_v4_record_folds_its_scales_where_timed(arch, dtype, tokens, heads):
    """The V4 record runs bf16 MMAs with folded scales with bf16 q on sm80, sm89 and sm90;
    on sm90 in 16-head blocks below 16 tokens and, in 64-head tiles, the warp-specialized Gluon
    kernel (the Triton kernel's tile there: 64-row two-stage steps), elsewhere in fp8_ds_mla's
    tiles. Every other target and fp16 q keep fp16 MMAs."""
    fmt = "fp8_ds_mla_v4"
    cfg = choose_config(tokens, heads, 128 + 512, dtype, fmt, arch, block_table=True)
    folded = arch.backend == "cuda" and arch.cc in (80, 89, 90) and dtype == torch.bfloat16
    assert folds_v4_scales(dtype, fmt, arch) is folded
    assert fp16_mma_for(dtype, fmt, arch, cfg.block_h) is not folded
    assert not cfg.fp16_fold
    plain = choose_config(tokens, heads, 128 + 512, dtype, "fp8_ds_mla", arch, block_table=True)
    if arch != SM90 or dtype != torch.bfloat16:
        assert cfg.block_n == 32 and cfg.block_h <= plain.block_h
        return
    assert cfg.block_h == (16 if tokens < 16 else min(64, heads))
    if cfg.block_h == 64:
        # the warp-specialized Gluon kernel (its ring is its own pipeline: one stage)
        assert (cfg.block_n, cfg.num_stages, cfg.stage_dequant) == (64, 1, True)
        assert cfg.gluon == "specialized"
        triton_tile = choose_config(
            tokens, heads, 128 + 512, dtype, fmt, arch, block_table=True, gluon=False
        )
        assert (triton_tile.block_n, triton_tile.num_stages, triton_tile.gluon) == (64, 2, None)
    else:  # fp8_ds_mla's staged 32-row tiles
        assert (cfg.block_n, cfg.num_stages, cfg.stage_dequant) == (32, 2, True)


@pytest.mark.parametrize("arch", TARGETS, ids=lambda a: f"{a.backend}{a.cc}")
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32])
@pytest.mark.parametrize("tokens", [1, 16, 128, 4096])
@pytest.mark.parametrize("heads", [8, 16, 32, 48, 64, 128])
def test_fp8_ds_mla_folds_into_fp16_in_wide_sm90_tiles(arch, dtype, tokens, heads):
    """fp8_ds_mla's 64-head tiles on sm90 with bf16 q take fp16 MMAs with folded scales in
    64-row staged steps (two stages, or the Gluon kernel's ring), and so does the mma.sync
    Gluon kernel where it is chosen (sm80 / sm89, 32-row steps); every other call keeps exact
    fp16 operands."""
    cfg = choose_config(tokens, heads, 2048, dtype, "fp8_ds_mla", arch)
    if cfg.gluon == "ampere":
        assert dtype == torch.bfloat16 and (cfg.fp16_fold, cfg.stage_dequant, cfg.block_n) == (
            True,
            True,
            32,
        )
        return
    folded = arch == SM90 and dtype == torch.bfloat16 and cfg.block_h == 64
    assert folds_ds_mla_fp16(dtype, "fp8_ds_mla", arch) is (
        arch == SM90 and dtype == torch.bfloat16
    )
    assert cfg.fp16_fold is folded
    if folded:
        assert heads > 32
        assert (cfg.block_n, cfg.stage_dequant) == (64, True)
        assert cfg.num_stages == (1 if cfg.gluon else 2)
    if dtype != torch.float32:
        assert fp16_mma_for(dtype, "fp8_ds_mla", arch, cfg.block_h)


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


WIDE_MMA_DTYPES = [pytest.param(dt, id=dtype_id(dt)) for dt in DTYPES if dt != torch.float16]
FP16_MMA_DTYPES = [pytest.param(dt, id=dtype_id(dt)) for dt in DTYPES if dt != torch.float32]


def _check_folded_fp8_ds_mla(dtype, native, staged, splits, seed, **folding):
    """fp8_ds_mla in a folded form (``folding``: the KernelConfig fields that ask for it):
    chunks over six decades in both caches, a -1 run, a token with nothing in either set, a
    sink, an extra index set, split and not; against the float64 reference within q's
    tolerance, zeros where no index points."""
    g = torch.Generator().manual_seed(seed)
    t, h, n, w, xn, xw = 3, 4, 96, 40, 48, 24

    def rows(count):
        r = torch.randn(count, 576, generator=g)
        decades = (torch.rand(count, 4, generator=g) * 2 - 1) * 3
        r[:, :512] *= (10.0**decades).repeat_interleave(128, dim=1)
        return pack_fp8_ds_mla(r).to(DEVICE)

    cache, xcache = rows(n), rows(xn)
    idx = torch.stack([torch.randperm(n, generator=g)[:w] for _ in range(t)]).int()
    idx[0] = -1
    idx[1, 3:9] = -1
    xidx = torch.stack([torch.randperm(xn, generator=g)[:xw] for _ in range(t)]).int()
    xidx[0] = -1
    q = (torch.randn(t, h, 576, generator=g) * 0.01).to(dtype).to(DEVICE)
    kw = dict(
        kv_format="fp8_ds_mla",
        extra_kv_cache=xcache,
        extra_indices=xidx.to(DEVICE),
        attn_sink=(torch.randn(h, generator=g) * 2.0).to(DEVICE),
    )
    ref, ref_lse = sparse_mla_reference(
        q, cache, idx.to(DEVICE), return_lse=True, compute_dtype=torch.float64, **kw
    )
    cfg = KernelConfig(
        16,
        16,
        4,
        2 if staged else 1,
        num_splits=splits,
        fp8_native=native,
        stage_dequant=staged,
        **folding,
    )
    out = poison_(torch.empty(t, h, 512, dtype=dtype, device=DEVICE))
    _, lse = sparse_mla(q, cache, idx.to(DEVICE), return_lse=True, out=out, config=cfg, **kw)
    assert_matches(out, lse, ref, ref_lse, dtype)
    assert (out[0] == 0).all() and torch.isneginf(lse[0]).all()


@pytest.mark.parametrize("dtype", WIDE_MMA_DTYPES)
@pytest.mark.parametrize("native", [True, False], ids=["native", "intdecode"])
@pytest.mark.parametrize("staged", [False, True], ids=["hoisted", "staged"])
@pytest.mark.parametrize("splits", [1, 2])
def test_fp8_ds_mla_mmas_in_q_dtype(dtype, native, staged, splits):
    """fp8_ds_mla with MMAs in q's dtype (bf16 on a GPU, fp32 everywhere), where the kernel
    multiplies each chunk's scale into the tile."""
    _check_folded_fp8_ds_mla(
        dtype, native, staged, splits, 501 + 2 * splits + native, fp16_mma=False
    )


@pytest.mark.parametrize("dtype", FP16_MMA_DTYPES)
@pytest.mark.parametrize("native", [True, False], ids=["native", "intdecode"])
@pytest.mark.parametrize("staged", [False, True], ids=["hoisted", "staged"])
@pytest.mark.parametrize("splits", [1, 2])
def test_fp8_ds_mla_fp16_fold(dtype, native, staged, splits):
    """fp8_ds_mla with fp16 MMAs and the scales folded into the tile relative to each step's
    largest scale (KernelConfig.fp16_fold; fp16 q everywhere, bf16 on a GPU)."""
    _check_folded_fp8_ds_mla(
        dtype, native, staged, splits, 601 + 2 * splits + native, fp16_fold=True
    )


@pytest.mark.parametrize(
    "fmt,dtype,folding",
    [
        ("fp8", torch.float16, {}),
        ("auto", torch.float16, {}),
        ("fp8_ds_mla", torch.float16, {"fp16_mma": False}),
        ("fp8_ds_mla", torch.float32, {}),
    ],
    ids=["fp8", "auto", "qmma", "fp32"],
)
def test_fp16_fold_refused_where_it_does_not_apply(fmt, dtype, folding):
    """fp16_fold is the scaled formats', with fp16 MMAs: elsewhere a ValueError naming it,
    before any launch."""
    from triton_mla_sparse.ops.sparse_mla.heuristics import TARGETS as targets
    from triton_mla_sparse.ops.sparse_mla.plan import make_plan

    cfg = KernelConfig(16, 32, 4, 1, fp16_fold=True, **folding)
    with pytest.raises(ValueError, match="fp16_fold"):
        make_plan(
            num_tokens=2,
            num_heads=16,
            latent=512,
            rope=64 if fmt != "fp8_ds_mla_v4" else 0,
            width=64,
            dtype=dtype,
            kv_format=fmt,
            arch=targets[0],
            on_gpu=False,
            config=cfg,
        )
