"""The mma.sync kernels in Gluon (KernelConfig.gluon="ampere"; kernels/ampere_gluon.py):
fp8_ds_mla rows and rows in q's dtype (kv_format "auto").

Without a GPU: the plan refuses every call the kernel does not implement, and the kernel compiles
ahead of time for sm80, sm86, sm89 and sm90 under the installed Triton, inside each target's
shared memory and without spills in the tiles the Triton kernel runs there. On a GPU (sm80 or
newer: cp.async and mma.sync exist on all of them): every output against the float64 reference
with poisoned outputs and NaN rows nothing points at, -1 runs, a token with no valid index,
valid counts, a sink, splits, pages, NoPE, both e4m3 decodes (the hardware conversion and the
bit decode sm80 / sm86 run); on an sm90 GPU the sm80 and sm89 code too, by PTX JIT.
"""

from __future__ import annotations

import collections
import contextlib
import dataclasses
import re

import pytest
import torch
from conftest import DEVICE, HAS_GPU, compile_ahead
from test_gluon_ds_mla import _cache
from test_sparse_mla import assert_matches, poison_, poison_unused_rows_

from triton_mla_sparse import KernelConfig, sparse_mla
from triton_mla_sparse.kv_format import DS_MLA_ROW_BYTES
from triton_mla_sparse.ops.sparse_mla.heuristics import (
    AMPERE_GLUON_BLOCK_N,
    AMPERE_GLUON_DS_PREFILL_MIN_HEADS,
    AMPERE_GLUON_DS_RING,
    AMPERE_GLUON_NARROW_HEADS,
    AMPERE_GLUON_RING,
    AMPERE_GLUON_ROWS_WIDE_HEADS,
    AMPERE_GLUON_ROWS_WIDE_MIN_TOKENS,
    AMPERE_GLUON_SPLIT_QK_STEPS,
    AMPERE_PV_COLS_WARPS,
    ROWS_SPLIT_QK_STEPS,
    SHORT_DECODE_TOKENS,
    TARGETS,
    Arch,
    ampere_gluon_smem,
    num_splits_for,
    split_len_for,
)
from triton_mla_sparse.ops.sparse_mla.plan import (
    DS_MLA_AMPERE_GLUON,
    LATENT_AMPERE_GLUON,
    ROW_OFFSET_32_LIMIT,
    make_plan,
)
from triton_mla_sparse.reference import sparse_mla_reference

# num_stages: the ring's slots (two: the next step's gather in flight during the whole step)
AMPERE = KernelConfig(16, 32, 4, 2, stage_dequant=True, fp16_fold=True, gluon="ampere")
AMPERE_LATENT = KernelConfig(16, 32, 4, 2, gluon="ampere")  # kv_format "auto"
# the tiles the Triton kernel runs fp8_ds_mla in on sm80 / sm89 (heuristics.choose_config),
# and one between
TILES = [(16, 32, 4), (32, 32, 4), (64, 32, 8)]
# the same head tiles with twice the warps (two per 16 head rows in a 32-head tile, four in a
# 64-head one): a quarter to a half of each warp's registers and instructions per step; and
# 16 heads over 8 warps, in 32- and 64-row steps
WIDE_TILES = [(32, 32, 8), (64, 32, 16), (16, 32, 8), (16, 64, 8)]
# 32 heads in 16-row steps: fits the 99 KB parts with two slots, in both formats
N16_TILE = (32, 16, 4)
# fp8_ds_mla with one raw-row slot: the tiles it lets the 99 KB parts hold (32 heads) or lets
# two programs share an sm80 multiprocessor (16 heads), and the 64-head one
RING1_TILES = [(16, 32, 4), (16, 16, 4), (32, 32, 4), (64, 32, 8), *WIDE_TILES]
# fp8_ds_mla with QK^T split over the latent (KernelConfig.split_qk): 16 heads in four warps,
# the serving tile's 32-row steps and 16-row ones, with one and two raw-row slots
SPLIT_QK_TILES = [(16, 32, 4, 1), (16, 16, 4, 1), (16, 32, 4, 2)]
# rows in q's dtype with QK^T split over the latent: 16 heads in four warps, two slots of 32 or
# 16 rows
ROWS_SPLIT_QK_TILES = [(16, 32, 4), (16, 16, 4)]


SM80 = Arch("cuda", 80, 108)


def _plan(arch=SM80, config=AMPERE, dtype=torch.bfloat16, on_gpu=True, fmt="fp8_ds_mla", **kw):
    return make_plan(
        num_tokens=4,
        num_heads=64,
        latent=512,
        rope=64,
        width=2048,
        dtype=dtype,
        kv_format=fmt,
        arch=arch,
        config=config,
        on_gpu=on_gpu,
        **kw,
    )


def test_pv_over_columns_warps_agree():
    """The heuristics' shared-memory figure and the kernel take PV over O's columns from the
    same warp count (written out in both: the heuristics import no Triton)."""
    from triton_mla_sparse.ops.sparse_mla.kernels.ampere_gluon import PV_COLS_MIN_WARPS

    assert PV_COLS_MIN_WARPS == AMPERE_PV_COLS_WARPS


def test_plan_names_the_family_on_every_nvidia_target_from_sm80():
    for cc in (80, 86, 89, 90, 100, 120):
        assert _plan(Arch("cuda", cc, 100)).family == DS_MLA_AMPERE_GLUON
        for dtype in (torch.bfloat16, torch.float16):
            latent = _plan(Arch("cuda", cc, 100), AMPERE_LATENT, dtype, fmt="auto")
            assert latent.family == LATENT_AMPERE_GLUON
    # its own decode: the Triton kernels' e4m3 knob stays at its neutral value
    assert _plan().config.e4m3_decode == "scalar"


@pytest.mark.parametrize(
    "why, kw, word",
    [
        ("AMD", dict(arch=Arch("hip", "gfx942", 304, 64)), "target"),
        ("fp16 q", dict(dtype=torch.float16), "q torch.float16"),
        ("24-head tile", dict(config=dataclasses.replace(AMPERE, block_h=24)), "block_h=24"),
        ("no fold", dict(config=dataclasses.replace(AMPERE, fp16_fold=False)), "fp16_fold"),
        ("block table", dict(block_size=64), "block table"),
        ("extra set", dict(extra_width=128), "extra set"),
        ("interpreter", dict(on_gpu=False), "interpreter"),
        ("three slots", dict(config=dataclasses.replace(AMPERE, num_stages=3)), "num_stages=3"),
        (
            "rows in q's dtype, one slot",
            dict(fmt="auto", config=dataclasses.replace(AMPERE_LATENT, num_stages=1)),
            "num_stages=1",
        ),
        ("fp32 q", dict(fmt="auto", config=AMPERE_LATENT, dtype=torch.float32), "torch.float32"),
        ("block table", dict(fmt="auto", config=AMPERE_LATENT, block_size=64), "block table"),
    ],
)
def test_plan_refuses_what_it_does_not_run(why, kw, word):
    with pytest.raises(ValueError, match="gluon='ampere'") as e:
        _plan(**kw)
    assert word in str(e.value), why


# fp8_ds_mla's widest mma.sync tile (heads) in the target's shared memory: sm80's 163 KB holds
# 64 heads, sm89's 99 KB 32
WIDEST_DS_TILE = {80: 64, 89: 32}


def _cuda_target(cc):
    return next(a for a in TARGETS if a.backend == "cuda" and a.cc == cc)


def _default_plan(tokens, heads, arch, dtype=torch.bfloat16, fmt="fp8_ds_mla", **kw):
    return make_plan(
        num_tokens=tokens,
        num_heads=heads,
        latent=512,
        rope=64,
        width=2048,
        dtype=dtype,
        kv_format=fmt,
        arch=arch,
        on_gpu=True,
        **kw,
    )


@pytest.mark.parametrize("tokens", [1, 4, 15, 16, 64, 100, 128, 129, 1024, 4096])
@pytest.mark.parametrize(
    "cc, heads", [(80, 8), (80, 16), (80, 64), (80, 128), (89, 16), (89, 64), (89, 128)]
)
def test_default_on_the_paths_timed_faster(tokens, cc, heads):
    """fp8_ds_mla with bf16 q on sm80 and sm89, decode of 1-128 tokens, and prefill past it
    from 16 heads: the mma.sync kernel by default with one slot of raw rows, in the largest
    tile the call's heads and the target's shared memory hold (64 heads on sm80, 32 in sm89's
    99 KB), half of it below 16 tokens, 32-row steps, split as the heuristics split that tile;
    the plan takes it as it is. Prefill below 16 heads keeps the Triton kernel."""
    arch = _cuda_target(cc)
    plan = _default_plan(tokens, heads, arch)
    cfg = plan.config
    if tokens > 128 and heads < AMPERE_GLUON_DS_PREFILL_MIN_HEADS:
        assert cfg.gluon is None and plan.family != DS_MLA_AMPERE_GLUON
        return
    block_h = min(WIDEST_DS_TILE[cc], max(16, heads))
    if tokens < 16:
        block_h = max(16, block_h // 2)
    assert plan.family == DS_MLA_AMPERE_GLUON
    assert (cfg.gluon, cfg.block_h, cfg.block_n, cfg.num_warps, cfg.num_stages) == (
        "ampere",
        block_h,
        AMPERE_GLUON_BLOCK_N,
        8 if block_h == 64 else 4,
        1,
    )
    assert plan.constexprs["RING"] == 1
    programs = tokens * -(-heads // block_h)
    splits = num_splits_for(programs, 2048, cfg.block_n, arch.num_sms, block_h)
    per_split, num_splits = split_len_for(2048, splits, cfg.block_n)
    assert cfg.num_splits == num_splits
    long_walk = per_split // cfg.block_n >= AMPERE_GLUON_SPLIT_QK_STEPS
    assert plan.constexprs["SPLIT_QK"] == cfg.split_qk == (block_h == 16 and long_walk)
    assert ampere_gluon_smem(block_h, cfg.block_n, 1) <= arch.smem_bytes
    # the next wider tile would not fit, or the call has no more heads for it
    if block_h < 64 and tokens >= 16 and heads > block_h:
        assert ampere_gluon_smem(2 * block_h, cfg.block_n, 1) > arch.smem_bytes


@pytest.mark.parametrize(
    "cc, tokens", [(89, 1), (89, 16), (89, 64), (89, 128), (80, 1), (80, 4), (80, 16)]
)
@pytest.mark.parametrize("heads", [8, 16])
def test_rows_default_at_16_heads(cc, tokens, heads):
    """Rows in q's dtype (bf16) with 16 heads or fewer, on sm89 at 1-128 tokens and on sm80 up
    to SHORT_DECODE_TOKENS tokens: the mma.sync kernel, 16-head tile, two slots; QK^T split
    over the latent where a program walks at least ROWS_SPLIT_QK_STEPS steps (at 128 tokens,
    not at 64 or fewer). sm80 from 17 tokens on keeps the Triton kernel
    (test_not_the_default_elsewhere)."""
    arch = _cuda_target(cc)
    plan = _default_plan(tokens, heads, arch, fmt="auto")
    cfg = plan.config
    assert plan.family == LATENT_AMPERE_GLUON
    assert (cfg.gluon, cfg.block_h, cfg.block_n, cfg.num_stages) == ("ampere", 16, 32, 2)
    per_split = split_len_for(2048, cfg.num_splits, cfg.block_n)[0]
    long_walk = per_split // cfg.block_n >= ROWS_SPLIT_QK_STEPS
    assert plan.constexprs["SPLIT_QK"] == cfg.split_qk == long_walk
    if tokens == 128:
        assert cfg.split_qk
    if tokens <= 64:
        assert not cfg.split_qk


@pytest.mark.parametrize("tokens", [16, 64, 128, 129, 1024, 4096])
@pytest.mark.parametrize("heads", [64, 96, 128])
def test_rows_default_on_sm80_at_64_heads_and_more(tokens, heads):
    """Rows in q's dtype (bf16) on sm80 with 64 heads or more from 16 tokens, decode and
    prefill: the mma.sync kernel's 64-head tile, eight warps, 32-row steps, two slots, within
    sm80's shared memory; fewer tokens or heads, and sm89, keep the Triton kernel
    (test_not_the_default_elsewhere)."""
    arch = _cuda_target(80)
    plan = _default_plan(tokens, heads, arch, fmt="auto")
    cfg = plan.config
    assert plan.family == LATENT_AMPERE_GLUON
    assert (cfg.gluon, cfg.block_h, cfg.block_n, cfg.num_warps, cfg.num_stages) == (
        "ampere",
        AMPERE_GLUON_ROWS_WIDE_HEADS,
        AMPERE_GLUON_BLOCK_N,
        8,
        AMPERE_GLUON_RING,
    )
    smem = ampere_gluon_smem(cfg.block_h, cfg.block_n, cfg.num_stages, "auto", num_warps=8)
    assert smem <= arch.smem_bytes


@pytest.mark.parametrize("tokens", [1, 4, 15, 16, 64, 128])
@pytest.mark.parametrize("heads", [8, 16])
def test_default_on_sm90_at_16_heads(tokens, heads):
    """sm90 with bf16 q and 16 heads or fewer: the mma.sync kernel in its 16-head tile, four
    warps, 32-row steps, for fp8_ds_mla at 1-128 tokens (one slot of raw rows; QK^T split over
    the latent where a program walks at least AMPERE_GLUON_SPLIT_QK_STEPS steps: from 15
    tokens on) and for rows in q's dtype up to 16 tokens (two slots), split as the heuristics
    split that tile."""
    arch = _cuda_target(90)
    for fmt, family, ring in (
        ("fp8_ds_mla", DS_MLA_AMPERE_GLUON, AMPERE_GLUON_DS_RING),
        ("auto", LATENT_AMPERE_GLUON, AMPERE_GLUON_RING),
    ):
        plan = _default_plan(tokens, heads, arch, fmt=fmt)
        cfg = plan.config
        if fmt == "auto" and tokens > 16:
            assert cfg.gluon != "ampere", (fmt, tokens)
            continue
        assert plan.family == family, (fmt, tokens)
        assert (cfg.gluon, cfg.block_h, cfg.block_n, cfg.num_warps, cfg.num_stages) == (
            "ampere",
            16,
            AMPERE_GLUON_BLOCK_N,
            4,
            ring,
        ), fmt
        splits = num_splits_for(tokens, 2048, cfg.block_n, arch.num_sms, 16)
        per_split, num_splits = split_len_for(2048, splits, cfg.block_n)
        assert cfg.num_splits == num_splits
        split_qk = fmt == "fp8_ds_mla" and per_split // cfg.block_n >= AMPERE_GLUON_SPLIT_QK_STEPS
        assert cfg.split_qk == split_qk, (fmt, tokens)
        if fmt == "fp8_ds_mla":  # a step a program at 1-4 tokens, at least four from 15 on
            assert split_qk == (tokens >= 15), tokens


@pytest.mark.parametrize(
    "why, cc, tokens, heads, kw",
    [
        ("sm86 prefill: not timed", 86, 4096, 64, {}),
        ("sm90 prefill at 16 heads: not timed", 90, 4096, 16, {}),
        ("prefill at 8 heads: not timed", 80, 1024, 8, {}),
        ("rows in q's dtype at prefill, 48 heads: not timed", 80, 4096, 48, dict(fmt="auto")),
        ("rows in q's dtype at prefill on sm89", 89, 4096, 64, dict(fmt="auto")),
        ("rows in q's dtype at prefill, 16 heads", 89, 1024, 16, dict(fmt="auto")),
        ("prefill in fp16", 89, 4096, 64, dict(dtype=torch.float16)),
        ("sm90, 32 heads: not timed", 90, 128, 32, {}),
        ("sm90, 17 tokens of rows in q's dtype", 90, 17, 16, dict(fmt="auto")),
        ("sm90, 16 heads in fp16", 90, 64, 16, dict(dtype=torch.float16)),
        ("sm86: not timed", 86, 64, 64, {}),
        ("sm90, 64 heads: its own kernels", 90, 64, 64, {}),
        ("fp16 q", 80, 64, 64, dict(dtype=torch.float16)),
        ("rows in q's dtype on sm80, 16 heads, 64 tokens", 80, 64, 16, dict(fmt="auto")),
        ("rows in q's dtype on sm80, 8 heads, 17 tokens", 80, 17, 8, dict(fmt="auto")),
        ("rows in q's dtype on sm80, 16 heads, 128 tokens", 80, 128, 16, dict(fmt="auto")),
        ("rows in q's dtype on sm86, 16 heads: not timed", 86, 16, 16, dict(fmt="auto")),
        ("rows in q's dtype, 64 heads", 89, 64, 64, dict(fmt="auto")),
        ("rows in q's dtype on sm80, 48 heads: not timed", 80, 64, 48, dict(fmt="auto")),
        ("rows in q's dtype on sm80, 64 heads, 8 tokens: not timed", 80, 8, 64, dict(fmt="auto")),
        ("rows in q's dtype on sm86, 64 heads", 86, 64, 64, dict(fmt="auto")),
        ("block table", 80, 64, 64, dict(block_size=64)),
        ("extra set", 89, 64, 64, dict(extra_width=128)),
        ("cache not 16-byte aligned", 80, 64, 64, dict(cache_aligned=False)),
    ],
)
def test_not_the_default_elsewhere(why, cc, tokens, heads, kw):
    arch = _cuda_target(cc)
    assert _default_plan(tokens, heads, arch, **kw).config.gluon != "ampere", why


@pytest.mark.parametrize("ring", [1, 2])
def test_kernels_take_the_launchers_arguments(ring):
    """launch.py passes the Triton kernel's argument list and the plan's constexprs: each
    mma.sync kernel declares the same runtime parameters in the same order, and every constexpr
    (fp8_ds_mla's RING among them)."""
    from test_plan import kernel_params

    from triton_mla_sparse.ops.sparse_mla import launch

    ds = _plan(config=dataclasses.replace(AMPERE, num_stages=ring))
    assert ds.constexprs["RING"] == ring
    for plan, triton_family in (
        (ds, "ds_mla"),
        (_plan(config=AMPERE_LATENT, fmt="auto"), "latent"),
    ):
        runtime, const = kernel_params(launch.FORWARD[plan.family])
        assert runtime == kernel_params(launch.FORWARD[triton_family])[0]
        assert set(plan.constexprs) == const


def test_emulation_starts_every_launchable_kernel_afresh():
    """bench --arch and benchmarks/perf/targets.py reset launch.launchable_kernels() when they
    emulate a target: the mma.sync kernels (which the sm80 / sm89 paths run by default) among
    them, so that no path reuses a binary another path built."""
    from triton_mla_sparse.ops.sparse_mla import launch

    ks = launch.launchable_kernels()
    assert set(map(id, launch.FORWARD.values())) | {id(launch.sparse_mla_merge_kernel)} == set(
        map(id, ks)
    )
    assert launch.FORWARD[DS_MLA_AMPERE_GLUON] in ks and launch.FORWARD[LATENT_AMPERE_GLUON] in ks


@pytest.mark.parametrize("fmt", ["fp8", "fp8_ds_mla_v4"])
def test_no_ampere_kernel_for_the_other_formats(fmt):
    with pytest.raises(ValueError, match="gluon='ampere'"):
        _plan(fmt=fmt, config=AMPERE_LATENT)


@pytest.mark.parametrize("cc", [80, 86, 89, 90])
def test_compiles_for_sm80_to_sm90(cc, tmp_path):
    """Ahead of time, under the installed Triton, one target per case (they run side by side
    under xdist): every tile compiles, takes the shared memory heuristics.ampere_gluon_smem
    says, and fits the target where the paths rely on it. With two slots the 16-head tile fits
    every target and the 64-head one sm80 / sm90; on the 99 KB parts 32 heads fit in 16-row
    steps or, for fp8_ds_mla, with one raw-row slot of 32 rows."""
    limit = Arch("cuda", cc).smem_bytes
    # the serving call's arguments: split-K, RoPE 64, valid counts, LSE, a sink
    serving = dict(split=True, rope=64, has_counts=True, store_lse=True, sink=True)
    base = dict(
        arch=f"cuda:{cc}",
        dtype="bf16",
        fmt="fp8_ds_mla",
        num_stages=2,
        stage_dequant=True,
        fp16_mma=True,
        fp16_fold=True,
        gluon="ampere",
        has_bt=False,
    )
    jobs = {}
    for bh, bn, w in [*TILES, *WIDE_TILES, N16_TILE]:
        tile = dict(base, block_h=bh, block_n=bn, num_warps=w)
        jobs[f"{bh}-{bn}-{w}-serving"] = dict(tile, **serving)
        jobs[f"{bh}-{bn}-{w}-nope"] = dict(
            tile, split=False, rope=0, has_counts=False, store_lse=False
        )
        jobs[f"{bh}-{bn}-{w}-auto"] = dict(
            tile,
            fmt="auto",
            stage_dequant=False,
            fp16_mma=None,
            fp16_fold=False,
            **serving,
        )
    for bh, bn, w in RING1_TILES:
        tile = dict(base, block_h=bh, block_n=bn, num_warps=w)
        jobs[f"{bh}-{bn}-{w}-ring1"] = dict(tile, num_stages=1, **serving)
    # q's RoPE part in registers (KernelConfig.q_rope_in_registers), the 16-head one-slot tile
    qr = dict(base, block_h=16, block_n=32, num_warps=4, num_stages=1, q_rope_in_registers=True)
    jobs["16-32-4-ring1qr"] = dict(qr, **serving)
    # QK^T split over the latent (KernelConfig.split_qk)
    for bh, bn, w, ring in SPLIT_QK_TILES:
        tile = dict(base, block_h=bh, block_n=bn, num_warps=w, num_stages=ring, split_qk=True)
        jobs[f"{bh}-{bn}-{w}-ring{ring}split"] = dict(tile, **serving)
    for bh, bn, w in ROWS_SPLIT_QK_TILES:
        jobs[f"{bh}-{bn}-{w}-autosplit"] = dict(
            jobs["16-32-4-auto"], block_h=bh, block_n=bn, num_warps=w, split_qk=True
        )
    results = compile_ahead(jobs, tmp_path, tmp_path / "asm")
    assert set(results) == set(jobs)
    fits = set()
    for key, res in results.items():
        family = "latent" if "auto" in key else "ds_mla"
        kernel = res[f"sparse_mla_{family}_ampere_gluon_kernel"]
        assert "error" not in kernel, (key, kernel)
        bh, bn, warps = (int(x) for x in key.split("-")[:3])
        ring = 1 if "ring1" in key else 2
        split_qk = "split" in key
        fmt = "auto" if family == "latent" else "fp8_ds_mla"
        if key.endswith("nope"):
            continue
        # RoPE 64, as the estimate assumes (DeepSeek-V3.2's rows)
        qr = key.endswith("qr")
        smem = ampere_gluon_smem(bh, bn, ring, fmt, qr, split_qk, num_warps=warps)
        assert kernel["shared"] == smem, (key, kernel)
        if qr or split_qk:
            continue
        if kernel["shared"] <= limit:
            fits.add((fmt, bh, bn, ring))
    for fmt in ("auto", "fp8_ds_mla"):
        assert (fmt, 16, 32, 2) in fits
        if cc in (80, 90):
            assert (fmt, 64, 32, 2) in fits
        else:
            assert (fmt, 32, 16, 2) in fits and (fmt, 32, 32, 2) not in fits
    if cc not in (80, 90):
        assert ("fp8_ds_mla", 32, 32, 1) in fits


# fp8_ds_mla's sm90 16-head one-slot serving tile (the default's 32 rows) as a compile job
SM90_DS_16_HEADS = dict(
    arch="cuda:90",
    dtype="bf16",
    fmt="fp8_ds_mla",
    block_h=16,
    block_n=32,
    num_warps=4,
    num_stages=1,
    stage_dequant=True,
    fp16_mma=True,
    fp16_fold=True,
    gluon="ampere",
    has_bt=False,
    split=True,
    rope=64,
    has_counts=True,
    store_lse=True,
)

# kv_format "auto"'s sm90 16-head two-slot serving tile as a compile job (with a sink, as
# test_compiles_for_sm80_to_sm90's "16-32-4-auto" for sm90)
SM90_ROWS_16_HEADS = dict(
    arch="cuda:90",
    dtype="bf16",
    fmt="auto",
    block_h=16,
    block_n=32,
    num_warps=4,
    num_stages=2,
    gluon="ampere",
    has_bt=False,
    split=True,
    rope=64,
    has_counts=True,
    store_lse=True,
    sink=True,
)


def test_a_register_cap_reaches_ptxas(tmp_path):
    """KernelConfig.max_registers compiles into the kernel's PTX as ``.maxnreg`` (ptxas's cap),
    and only where given: fp8_ds_mla's one-slot 16-row tile for sm90, capped and not."""
    tile = dict(SM90_DS_16_HEADS, block_n=16)
    jobs = {"capped": dict(tile, max_registers=168), "uncapped": tile}
    results = compile_ahead(jobs, tmp_path, tmp_path / "asm")
    for key in jobs:
        assert "error" not in results[key]["sparse_mla_ds_mla_ampere_gluon_kernel"], results[key]
    # the split pass is the launcher's first kernel (.1), the merge its second
    capped = (tmp_path / "asm" / "capped.1.ptx").read_text()
    uncapped = (tmp_path / "asm" / "uncapped.1.ptx").read_text()
    assert ".maxnreg 168" in capped
    assert ".maxnreg" not in uncapped


def _mma_chains(ptx: str) -> list[int]:
    """Lengths of the kernel's mma.sync accumulator chains: Triton's inline mma ties each
    product's accumulator input to its output registers, so the products of one chain name the
    same accumulator registers."""
    acc = re.findall(r"mma\.sync\.aligned\.m16n8k16[^{]*\{([^}]*)\}", ptx)
    return sorted(collections.Counter(acc).values(), reverse=True)


@pytest.mark.parametrize("split_qk", [False, True], ids=["columns", "latent"])
def test_qk_runs_as_independent_chains(split_qk, tmp_path):
    """A 16-head four-warp fp8_ds_mla tile's QK^T is 32 mma.sync products a warp in four
    independent accumulator chains of eight, not one chain of 32, in the PTX compiled for sm90
    (the products of one chain name the same accumulator registers): a warp holding one
    8-column tile of S splits the latent into four chains (QK_MIN_CHAINS); with QK^T split over
    the latent (KernelConfig.split_qk) each warp multiplies its 128-column chunk (eight
    products) into each of S's four 8-column tiles."""
    job = dict(SM90_DS_16_HEADS, split_qk=split_qk)
    results = compile_ahead({"ds": job}, tmp_path, tmp_path / "asm")
    assert not any("error" in r for r in results["ds"].values()), results["ds"]
    chains = _mma_chains((tmp_path / "asm" / "ds.1.ptx").read_text())
    # QK^T's NoPE part: four chains of 8 (was one of 32); RoPE 4 products; PV 2 per tile
    assert chains[:4] == [8, 8, 8, 8] and chains[4] <= 4, chains
    assert sum(chains) == 32 + 4 + 2 * (512 // 8) // 4, chains


@pytest.mark.parametrize("split_qk", [False, True], ids=["columns", "latent"])
def test_rows_qk_chains(split_qk, tmp_path):
    """kv_format "auto"'s 16-head four-warp tile, PTX for sm90: over S's columns a warp's QK^T
    is one chain of 36 mma.sync products (32 NoPE, 4 RoPE); split over the latent
    (KernelConfig.split_qk) its 128-column chunk makes four independent chains of nine (eight
    NoPE, one RoPE), one per 8-column tile of S. PV: chains of two (32 rows)."""
    job = dict(SM90_ROWS_16_HEADS, split_qk=split_qk)
    results = compile_ahead({"rows": job}, tmp_path, tmp_path / "asm")
    assert not any("error" in r for r in results["rows"].values()), results["rows"]
    chains = _mma_chains((tmp_path / "asm" / "rows.1.ptx").read_text())
    qk = [9, 9, 9, 9] if split_qk else [36]
    assert chains[: len(qk)] == qk and chains[len(qk)] == 2, chains
    # PV: 512 columns / 8 / 4 warps tiles a warp (a warp's chunk when split), two products each
    assert sum(chains) == 36 + 2 * (512 // 8) // 4, chains


def test_two_one_slot_16_head_programs_share_an_sm80_multiprocessor():
    """With one raw-row slot two 16-head fp8_ds_mla programs fit an sm80 multiprocessor (164
    KB, 1 KB reserved per program); with two slots they do not."""
    assert (
        2 * (ampere_gluon_smem(16, 32, 1) + 1024)
        <= 164 * 1024
        < 2 * (ampere_gluon_smem(16, 32, 2) + 1024)
    )


def _problem(tokens, heads, width, page, rope, sink, g):
    rows = 48 * 64
    cache = _cache(rows, page, g).to(DEVICE)
    idx = torch.stack([torch.randperm(rows, generator=g)[:width] for _ in range(tokens)]).int()
    idx[0] = -1  # a token with nothing to attend to
    idx[1, 5:80] = -1  # a run of -1
    idx[1, 90] = rows + 7  # out of range
    idx = idx.to(DEVICE)
    counts = torch.tensor([width, width - 13] + [width // 2] * (tokens - 2), dtype=torch.int32)
    q = (torch.randn(tokens, heads, 512 + rope, generator=g) * 0.05).bfloat16().to(DEVICE)
    kw = dict(kv_format="fp8_ds_mla", valid_counts=counts.to(DEVICE))
    if sink:
        s = torch.randn(heads, generator=g) * 2.0
        s[0], s[1] = float("-inf"), float("inf")
        kw["attn_sink"] = s.to(DEVICE)
    return cache, idx, q, kw


def _run_and_check(cache, idx, q, kw, cfg):
    ref, ref_lse = sparse_mla_reference(
        q, cache, idx, 0.07, return_lse=True, compute_dtype=torch.float64, **kw
    )
    poison_unused_rows_(cache, idx, **kw)
    tokens, heads = q.shape[:2]
    out = poison_(torch.empty(tokens, heads, 512, dtype=torch.bfloat16, device=DEVICE))
    _, lse = sparse_mla(q, cache, idx, 0.07, return_lse=True, out=out, config=cfg, **kw)
    assert_matches(out, lse, ref, ref_lse, torch.bfloat16)
    assert (out[0] == 0).all() and torch.isneginf(lse[0]).all()


def _needs_sm80():
    if not HAS_GPU or torch.version.hip or torch.cuda.get_device_capability()[0] < 8:
        pytest.skip("cp.async and mma.sync: an NVIDIA GPU from sm80")


def _needs_ptx_jit(cc):
    """Skip unless this GPU runs sm_<cc>'s code through the driver's JIT (PTX of an older
    target on a newer NVIDIA GPU)."""
    _needs_sm80()
    from triton_mla_sparse.testing import ptx_jit

    why = ptx_jit.refusal(cc, torch.cuda.get_device_capability(), hip=False)
    if why is not None:
        pytest.skip(why)


@contextlib.contextmanager
def _mma_sync_by_ptx_jit(cc, tmp_path, family):
    """Inside: every kernel compiles for sm_<cc> and loads through the driver's JIT. On leaving
    without an error, each binary of ``family``'s kernel that was loaded is asserted to be that
    target's PTX with mma.sync."""
    from triton_mla_sparse.ops.sparse_mla import launch
    from triton_mla_sparse.testing import ptx_jit

    kernel = launch.FORWARD[family]
    emu = ptx_jit.enable(cc, str(tmp_path), reset=launch.launchable_kernels())
    try:
        ptx_jit.check_jit(emu, torch.device("cuda"))
        yield
        built = [ptx_jit.describe(k) for k in ptx_jit.loaded(kernel)]
        assert built and all(b.is_ptx and b.target == f"sm_{cc}" for b in built), built
        assert all(b.mma == "mma.sync" for b in built), built
    finally:
        emu.disable()


# (tokens, heads, width, splits, page, rope, sink): every page form, rope or none, a sink or
# none, one pass or split-K, each twice
SCENARIOS = [
    (3, 64, 300, 1, 1, 64, False),
    (5, 40, 1000, 3, 64, 64, True),
    (3, 64, 300, 1, 48, 0, True),
    (5, 40, 1000, 3, 1, 0, False),
    (5, 40, 1000, 3, 48, 64, False),
    (3, 64, 300, 1, 64, 0, True),
]
SCENARIO_ARGS = "tokens, heads, width, splits, page, rope, sink"


@pytest.mark.gpu
@pytest.mark.skipif(not HAS_GPU, reason="Gluon kernels run on a GPU only")
@pytest.mark.parametrize("tile", TILES, ids=lambda t: "x".join(map(str, t)))
@pytest.mark.parametrize(SCENARIO_ARGS, SCENARIOS)
@pytest.mark.parametrize("native", [True, False], ids=["cvt", "bits"])
def test_matches_the_reference(tile, tokens, heads, width, splits, page, rope, sink, native):
    _needs_sm80()
    if native and torch.cuda.get_device_capability() < (8, 9):
        pytest.skip("the e4m3 conversion instruction: sm89 and later")
    g = torch.Generator().manual_seed(tokens * 7 + page + rope + sink)
    bh, bn, w = tile
    cfg = dataclasses.replace(
        AMPERE, block_h=bh, block_n=bn, num_warps=w, num_splits=splits, fp8_native=native
    )
    cache, idx, q, kw = _problem(tokens, heads, width, page, rope, sink, g)
    if not _fits_this_gpu(bh, bn, 2):
        pytest.skip("this tile needs more than this GPU's shared memory")
    _run_and_check(cache, idx, q, kw, cfg)


def _fits_this_gpu(bh, bn, ring, fmt="fp8_ds_mla", split_qk=False):
    return ampere_gluon_smem(bh, bn, ring, fmt, split_qk=split_qk) <= (
        torch.cuda.get_device_properties(0).shared_memory_per_block_optin
    )


@pytest.mark.gpu
@pytest.mark.skipif(not HAS_GPU, reason="Gluon kernels run on a GPU only")
@pytest.mark.parametrize("tile", RING1_TILES, ids=lambda t: "x".join(map(str, t)))
@pytest.mark.parametrize(SCENARIO_ARGS, SCENARIOS[:3])  # split or not, pages, NoPE, sinks
def test_one_slot_ring_matches_the_reference(tile, tokens, heads, width, splits, page, rope, sink):
    """fp8_ds_mla with one raw-row slot (the next gather issued after each step's
    dequantization), in this GPU's e4m3 decode."""
    _needs_sm80()
    native = torch.cuda.get_device_capability() >= (8, 9)
    g = torch.Generator().manual_seed(tokens * 5 + page + rope + sink)
    bh, bn, w = tile
    if not _fits_this_gpu(bh, bn, 1):
        pytest.skip("this tile needs more than this GPU's shared memory")
    cfg = dataclasses.replace(
        AMPERE,
        block_h=bh,
        block_n=bn,
        num_warps=w,
        num_stages=1,
        num_splits=splits,
        fp8_native=native,
    )
    cache, idx, q, kw = _problem(tokens, heads, width, page, rope, sink, g)
    _run_and_check(cache, idx, q, kw, cfg)


@pytest.mark.gpu
@pytest.mark.skipif(not HAS_GPU, reason="Gluon kernels run on a GPU only")
@pytest.mark.parametrize(
    "tile, cap",
    [((16, 16, 4), 168), ((16, 16, 4), 128), ((16, 32, 8), 128), ((16, 32, 4), 168)],
    ids=["16x16x4-168", "16x16x4-128", "16x32x8-128", "16x32x4-168-qrreg"],
)
@pytest.mark.parametrize(SCENARIO_ARGS, SCENARIOS[:3])
def test_register_caps_match_the_reference(
    tile, cap, tokens, heads, width, splits, page, rope, sink
):
    """The one-slot fp8_ds_mla kernel under the register caps `tune.py --only ampere-regs`
    times (KernelConfig.max_registers; at 128 the 16-row tile spills), the 32-row tile with q's
    RoPE part in registers (KernelConfig.q_rope_in_registers), in this GPU's e4m3 decode; the
    RoPE-less scenario too."""
    _needs_sm80()
    native = torch.cuda.get_device_capability() >= (8, 9)
    g = torch.Generator().manual_seed(tokens * 11 + page + rope + sink + cap)
    bh, bn, w = tile
    if not _fits_this_gpu(bh, bn, 1):
        pytest.skip("this tile needs more than this GPU's shared memory")
    cfg = dataclasses.replace(
        AMPERE,
        block_h=bh,
        block_n=bn,
        num_warps=w,
        num_stages=1,
        num_splits=splits,
        fp8_native=native,
        max_registers=cap,
        q_rope_in_registers=bn == 32,  # the 32-row tile's three-programs form
    )
    cache, idx, q, kw = _problem(tokens, heads, width, page, rope, sink, g)
    _run_and_check(cache, idx, q, kw, cfg)


@pytest.mark.gpu
@pytest.mark.skipif(not HAS_GPU, reason="Gluon kernels run on a GPU only")
@pytest.mark.parametrize("tile", SPLIT_QK_TILES, ids=lambda t: "x".join(map(str, t)))
@pytest.mark.parametrize(SCENARIO_ARGS, SCENARIOS)
@pytest.mark.parametrize("native", [True, False], ids=["cvt", "bits"])
def test_split_qk_matches_the_reference(
    tile, tokens, heads, width, splits, page, rope, sink, native
):
    """fp8_ds_mla with QK^T split over the latent (KernelConfig.split_qk: q's chunks in the
    warps' registers, the partial S tiles summed through shared memory), one and two raw-row
    slots, every scenario, both e4m3 decodes."""
    _needs_sm80()
    if native and torch.cuda.get_device_capability() < (8, 9):
        pytest.skip("the e4m3 conversion instruction: sm89 and later")
    g = torch.Generator().manual_seed(tokens * 3 + page + rope + sink)
    bh, bn, w, ring = tile
    if not _fits_this_gpu(bh, bn, ring, split_qk=True):
        pytest.skip("this tile needs more than this GPU's shared memory")
    cfg = dataclasses.replace(
        AMPERE,
        block_h=bh,
        block_n=bn,
        num_warps=w,
        num_stages=ring,
        num_splits=splits,
        fp8_native=native,
        split_qk=True,
    )
    cache, idx, q, kw = _problem(tokens, heads, width, page, rope, sink, g)
    _run_and_check(cache, idx, q, kw, cfg)


@pytest.mark.gpu
@pytest.mark.skipif(not HAS_GPU, reason="Gluon kernels run on a GPU only")
@pytest.mark.parametrize("fmt", ["fp8_ds_mla", "auto"])
@pytest.mark.parametrize(SCENARIO_ARGS, SCENARIOS[:3])
def test_32_heads_in_16_row_steps_match_the_reference(
    fmt, tokens, heads, width, splits, page, rope, sink
):
    """The tile that brings 32 heads into 99 KB with two slots, in both formats."""
    _needs_sm80()
    bh, bn, w = N16_TILE
    if fmt == "auto":
        cfg = dataclasses.replace(
            AMPERE_LATENT, block_h=bh, block_n=bn, num_warps=w, num_splits=splits
        )
        check_latent_rows(cfg, tokens, heads, width, page, rope, sink, torch.bfloat16)
        return
    native = torch.cuda.get_device_capability() >= (8, 9)
    g = torch.Generator().manual_seed(tokens * 3 + page + rope + sink)
    cfg = dataclasses.replace(
        AMPERE, block_h=bh, block_n=bn, num_warps=w, num_splits=splits, fp8_native=native
    )
    cache, idx, q, kw = _problem(tokens, heads, width, page, rope, sink, g)
    _run_and_check(cache, idx, q, kw, cfg)


@pytest.mark.gpu
@pytest.mark.skipif(not HAS_GPU, reason="Gluon kernels run on a GPU only")
@pytest.mark.parametrize(
    "cc, tile",
    [
        (80, (16, 32, 4, 2)),
        (89, (16, 32, 4, 2)),
        (80, (16, 32, 4, 1)),
        (89, (32, 32, 4, 1)),
        (80, (64, 32, 16, 1)),
        (89, (32, 32, 8, 1)),
        (80, (16, 32, 4, 1, "split")),
        (89, (16, 32, 4, 1, "split")),
    ],
    ids=lambda x: "x".join(map(str, x)) if isinstance(x, tuple) else str(x),
)
def test_the_sm80_and_sm89_code_by_ptx_jit(cc, tile, tmp_path):
    """The code Triton builds for an A100 (the bit decode) and an L40S (the conversion
    instruction), loaded through the driver's JIT on this newer GPU, against the reference:
    the two-slot ring, and the one-slot ring in the tile it serves each (two 16-head programs
    per sm80 multiprocessor, 32 heads in an L40S's 99 KB), also with twice the warps, and the
    16-head tile with QK^T split over the latent (KernelConfig.split_qk)."""
    _needs_ptx_jit(cc)
    g = torch.Generator().manual_seed(cc)
    cache, idx, q, kw = _problem(5, 40, 1000, 64, 64, True, g)
    bh, bn, w, ring = tile[:4]
    split_qk = tile[4:] == ("split",)
    if not _fits_this_gpu(bh, bn, ring, split_qk=split_qk):
        pytest.skip("this tile needs more than this GPU's shared memory")
    cfg = dataclasses.replace(
        AMPERE,
        block_h=bh,
        block_n=bn,
        num_warps=w,
        num_stages=ring,
        num_splits=3,
        split_qk=split_qk,
    )
    with _mma_sync_by_ptx_jit(cc, tmp_path, DS_MLA_AMPERE_GLUON):
        _run_and_check(cache, idx, q, kw, cfg)


@pytest.mark.gpu
@pytest.mark.skipif(not HAS_GPU, reason="Gluon kernels run on a GPU only")
@pytest.mark.parametrize("heads", [16, 64])
@pytest.mark.parametrize("cc", [80, 89])
def test_default_at_prefill_by_ptx_jit(cc, heads, tmp_path):
    """fp8_ds_mla prefill on the sm80 / sm89 paths: the heuristics' own choice (no config
    given) for 300 tokens past the decode range is the mma.sync kernel in that target's tile
    (64 heads: the widest the target holds; 16 heads: the 16-head tile with QK^T split over the
    latent), and its output matches the reference (code for the target, loaded through the
    driver's JIT on this newer GPU)."""
    _needs_ptx_jit(cc)
    tokens, width = 300, 256
    arch = _cuda_target(cc)
    cfg = _default_plan(tokens, heads, arch).config
    block_h = min(heads, WIDEST_DS_TILE[cc])
    assert (cfg.gluon, cfg.block_h, cfg.num_stages) == ("ampere", block_h, AMPERE_GLUON_DS_RING)
    assert cfg.split_qk == (block_h == 16)
    if not _fits_this_gpu(cfg.block_h, cfg.block_n, cfg.num_stages, split_qk=cfg.split_qk):
        pytest.skip("this tile needs more than this GPU's shared memory")
    g = torch.Generator().manual_seed(cc + tokens)
    cache, idx, q, kw = _problem(tokens, heads, width, 64, 64, True, g)
    with _mma_sync_by_ptx_jit(cc, tmp_path, DS_MLA_AMPERE_GLUON):
        _run_and_check(cache, idx, q, kw, None)


@pytest.mark.gpu
@pytest.mark.skipif(not HAS_GPU, reason="Gluon kernels run on a GPU only")
@pytest.mark.parametrize("tile", TILES, ids=lambda t: "x".join(map(str, t)))
@pytest.mark.parametrize(SCENARIO_ARGS, SCENARIOS)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
def test_latent_rows_match_the_reference(
    tile, tokens, heads, width, splits, page, rope, sink, dtype
):
    """kv_format "auto": rows in q's dtype, read by the MMAs from the ring where they land."""
    _needs_sm80()
    bh, bn, w = tile
    if not _fits_this_gpu(bh, bn, 2, "auto"):
        pytest.skip("this tile needs more than this GPU's shared memory")
    cfg = dataclasses.replace(AMPERE_LATENT, block_h=bh, block_n=bn, num_warps=w, num_splits=splits)
    check_latent_rows(cfg, tokens, heads, width, page, rope, sink, dtype)


@pytest.mark.gpu
@pytest.mark.skipif(not HAS_GPU, reason="Gluon kernels run on a GPU only")
@pytest.mark.parametrize("tile", ROWS_SPLIT_QK_TILES, ids=lambda t: "x".join(map(str, t)))
@pytest.mark.parametrize(SCENARIO_ARGS, SCENARIOS)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
def test_latent_rows_split_qk_match_the_reference(
    tile, tokens, heads, width, splits, page, rope, sink, dtype
):
    """kv_format "auto" with QK^T split over the latent (KernelConfig.split_qk: q's chunks in
    the warps' registers, the ring chunk-major, the partial S tiles summed through shared
    memory), every scenario, both 16-bit dtypes."""
    _needs_sm80()
    bh, bn, w = tile
    if not _fits_this_gpu(bh, bn, 2, "auto", split_qk=True):
        pytest.skip("this tile needs more than this GPU's shared memory")
    cfg = dataclasses.replace(
        AMPERE_LATENT, block_h=bh, block_n=bn, num_warps=w, num_splits=splits, split_qk=True
    )
    check_latent_rows(cfg, tokens, heads, width, page, rope, sink, dtype)


@pytest.mark.gpu
@pytest.mark.skipif(not HAS_GPU, reason="Gluon kernels run on a GPU only")
@pytest.mark.parametrize("cc", [80, 89])
@pytest.mark.parametrize("split_qk", [False, True], ids=["columns", "latent"])
def test_latent_rows_sm80_and_sm89_code_by_ptx_jit(cc, split_qk, tmp_path):
    """kv_format "auto"'s 16-head tile as Triton builds it for an A100 and an L40S, split over
    the latent and not, loaded through the driver's JIT on this newer GPU, against the
    reference."""
    _needs_ptx_jit(cc)
    cfg = dataclasses.replace(AMPERE_LATENT, num_splits=3, split_qk=split_qk)
    with _mma_sync_by_ptx_jit(cc, tmp_path, LATENT_AMPERE_GLUON):
        check_latent_rows(cfg, 5, 40, 1000, 64, 64, True, torch.bfloat16)


@pytest.mark.gpu
@pytest.mark.skipif(not HAS_GPU, reason="Gluon kernels run on a GPU only")
@pytest.mark.parametrize(
    "tokens, heads",
    [
        (AMPERE_GLUON_ROWS_WIDE_MIN_TOKENS, 8),
        (AMPERE_GLUON_ROWS_WIDE_MIN_TOKENS, 16),
        (AMPERE_GLUON_ROWS_WIDE_MIN_TOKENS, 64),
        (AMPERE_GLUON_ROWS_WIDE_MIN_TOKENS, 96),
        (300, 64),  # prefill: past the decode range, one split
        (300, 96),
    ],
)
def test_latent_rows_sm80_default_by_ptx_jit(tokens, heads, tmp_path):
    """Rows in q's dtype on the sm80 path: the heuristics' own choice (no config given) is the
    mma.sync kernel's 16-head tile at 16 heads or fewer up to 16 tokens and its 64-head tile at
    64 heads or more from 16 tokens, decode and prefill, and its output matches the reference
    (8 heads: a half-empty tile; 96 heads: a padded second program per token; sm80's code
    through the driver's JIT)."""
    _needs_ptx_jit(80)
    assert AMPERE_GLUON_ROWS_WIDE_MIN_TOKENS <= SHORT_DECODE_TOKENS  # both tiles default there
    cfg = _default_plan(tokens, heads, _cuda_target(80), fmt="auto").config
    block_h = AMPERE_GLUON_NARROW_HEADS if heads <= 16 else AMPERE_GLUON_ROWS_WIDE_HEADS
    assert (cfg.gluon, cfg.block_h) == ("ampere", block_h)
    with _mma_sync_by_ptx_jit(80, tmp_path, LATENT_AMPERE_GLUON):
        check_latent_rows(None, tokens, heads, 1000, 64, 64, True, torch.bfloat16)


def check_latent_rows(cfg, tokens, heads, width, page, rope, sink, dtype, at_row=None):
    """One kv_format "auto" call in ``cfg`` against the float64 reference: -1 runs, an
    out-of-range index, a token with nothing to attend to, valid counts, optionally a sink with
    -inf and +inf entries; NaN in the rows nothing points at, a NaN-poisoned output.
    ``at_row``: the rows placed from that row on in a flat cache of ``at_row`` + their number
    rows (its other rows never read: poisoned), the indices moved with them."""
    g = torch.Generator().manual_seed(tokens * 11 + page + rope + sink)
    rows = 48 * 64
    flat = (torch.randn(rows, 512 + rope, generator=g) * 0.5).to(dtype)
    cache = (flat.view(rows // page, page, -1) if page > 1 else flat).to(DEVICE)
    idx = torch.stack([torch.randperm(rows, generator=g)[:width] for _ in range(tokens)]).int()
    idx[0] = -1
    idx[1, 5:80] = -1
    idx[1, 90] = rows + 7
    idx = idx.to(DEVICE)
    counts = torch.tensor([width, width - 13] + [width // 2] * (tokens - 2), dtype=torch.int32)
    q = (torch.randn(tokens, heads, 512 + rope, generator=g) * 0.05).to(dtype).to(DEVICE)
    kw = dict(valid_counts=counts.to(DEVICE))
    if sink:
        s = torch.randn(heads, generator=g) * 2.0
        s[0], s[1] = float("-inf"), float("inf")
        kw["attn_sink"] = s.to(DEVICE)
    if at_row is not None:
        cache, idx = _placed_at(cache.reshape(rows, -1), idx, at_row)
    ref, ref_lse = sparse_mla_reference(
        q, cache, idx, 0.07, return_lse=True, compute_dtype=torch.float64, **kw
    )
    poison_unused_rows_(cache, idx, **kw)
    out = poison_(torch.empty(tokens, heads, 512, dtype=dtype, device=DEVICE))
    _, lse = sparse_mla(q, cache, idx, 0.07, return_lse=True, out=out, config=cfg, **kw)
    assert_matches(out, lse, ref, ref_lse, dtype)
    assert (out[0] == 0).all() and torch.isneginf(lse[0]).all()


def _placed_at(rows: torch.Tensor, idx: torch.Tensor, at_row: int):
    """A flat cache of ``at_row + len(rows)`` rows holding ``rows`` from row ``at_row`` on, and
    ``idx`` moved with them (-1 stays -1; an index past ``rows`` stays past the new cache)."""
    big = torch.empty(at_row + rows.shape[0], rows.shape[1], dtype=rows.dtype, device=DEVICE)
    big[at_row:] = rows
    return big, torch.where(idx >= 0, idx + at_row, idx)


# (format, block_h, block_n, warps, ring slots, QK^T split over the latent): the mma.sync tiles
# the heuristics choose on the sm80 and sm89 paths, in which 32-bit row offsets are timed
OFFSETS_32_TILES = [
    ("fp8_ds_mla", 16, 32, 4, 2, False),
    ("fp8_ds_mla", 16, 32, 4, 1, True),
    ("fp8_ds_mla", 32, 32, 4, 1, False),
    ("fp8_ds_mla", 64, 32, 8, 1, False),
    ("auto", 16, 32, 4, 2, False),
    ("auto", 16, 32, 4, 2, True),
    ("auto", 64, 32, 8, 2, False),
]


def _offsets_32_config(tile, splits=1):
    fmt, bh, bn, w, ring, split_qk = tile
    base = AMPERE if fmt == "fp8_ds_mla" else AMPERE_LATENT
    cfg = dataclasses.replace(
        base,
        block_h=bh,
        block_n=bn,
        num_warps=w,
        num_stages=ring,
        num_splits=splits,
        split_qk=split_qk,
        row_offsets_32=True,
    )
    if not _fits_this_gpu(bh, bn, ring, fmt, split_qk=split_qk):
        pytest.skip("this tile needs more than this GPU's shared memory")
    return cfg


def _check_offsets_32(tile, cfg, tokens, heads, width, page, rope, sink, at_row=None):
    if tile[0] == "auto":
        check_latent_rows(cfg, tokens, heads, width, page, rope, sink, torch.bfloat16, at_row)
        return
    g = torch.Generator().manual_seed(tokens * 13 + page + rope + sink)
    cache, idx, q, kw = _problem(tokens, heads, width, page, rope, sink, g)
    if at_row is not None:
        cache, idx = _placed_at(cache.reshape(-1, cache.shape[-1]), idx, at_row)
    _run_and_check(cache, idx, q, kw, cfg)


@pytest.mark.gpu
@pytest.mark.skipif(not HAS_GPU, reason="Gluon kernels run on a GPU only")
@pytest.mark.parametrize("tile", OFFSETS_32_TILES, ids=lambda t: "x".join(map(str, t)))
@pytest.mark.parametrize(SCENARIO_ARGS, SCENARIOS[:3])  # split or not, pages, NoPE, sinks
def test_32_bit_row_offsets_match_the_reference(
    tile, tokens, heads, width, splits, page, rope, sink
):
    """KernelConfig.row_offsets_32 in each tile it is timed in, both formats, in this GPU's
    e4m3 decode."""
    _needs_sm80()
    _check_offsets_32(
        tile, _offsets_32_config(tile, splits), tokens, heads, width, page, rope, sink
    )


@pytest.mark.gpu
@pytest.mark.skipif(not HAS_GPU, reason="Gluon kernels run on a GPU only")
@pytest.mark.parametrize(
    "cc, tile",
    [
        (80, OFFSETS_32_TILES[3]),
        (89, OFFSETS_32_TILES[2]),
        (80, OFFSETS_32_TILES[1]),
        (80, OFFSETS_32_TILES[6]),
        (89, OFFSETS_32_TILES[4]),
        (89, OFFSETS_32_TILES[5]),
    ],
    ids=lambda x: "x".join(map(str, x)) if isinstance(x, tuple) else str(x),
)
def test_32_bit_row_offsets_by_ptx_jit(cc, tile, tmp_path):
    """32-bit row offsets in the code Triton builds for an A100 and an L40S (their tiles),
    loaded through the driver's JIT on this newer GPU, against the reference."""
    _needs_ptx_jit(cc)
    cfg = _offsets_32_config(tile, splits=3)
    family = DS_MLA_AMPERE_GLUON if tile[0] == "fp8_ds_mla" else LATENT_AMPERE_GLUON
    with _mma_sync_by_ptx_jit(cc, tmp_path, family):
        _check_offsets_32(tile, cfg, 5, 40, 1000, 64, 64, True)


@pytest.mark.gpu
@pytest.mark.skipif(not HAS_GPU, reason="Gluon kernels run on a GPU only")
@pytest.mark.parametrize("tile", [OFFSETS_32_TILES[3], OFFSETS_32_TILES[6]], ids=["ds", "rows"])
def test_32_bit_row_offsets_at_the_limit(tile):
    """A flat cache of as many whole rows as ROW_OFFSET_32_LIMIT elements hold, the rows read
    at its far end (the largest offsets the 32-bit arithmetic meets: 2.1 GB of fp8_ds_mla rows,
    4.3 GB of bf16 ones), against the reference; with one row more the plan refuses the
    config before any launch."""
    _needs_sm80()
    row = DS_MLA_ROW_BYTES if tile[0] == "fp8_ds_mla" else 576
    elem = 1 if tile[0] == "fp8_ds_mla" else 2
    total = ROW_OFFSET_32_LIMIT // row
    if torch.cuda.mem_get_info()[0] < 2.5 * total * row * elem:
        pytest.skip("not enough free GPU memory for a cache at the limit")
    cfg = _offsets_32_config(tile, splits=3)
    used = 48 * 64  # the rows the scenario's indices reach
    _check_offsets_32(tile, cfg, 5, 40, 1000, 1, 64, True, at_row=total - used)


@pytest.mark.parametrize("fmt", ["fp8_ds_mla", "auto"])
def test_32_bit_row_offsets_refused_for_a_larger_cache(fmt):
    """One row past ROW_OFFSET_32_LIMIT elements, sparse_mla refuses a config asking for 32-bit
    row offsets, naming the cache's span, before any launch (the cache is never written: on the
    CPU its pages are not even touched)."""
    row = DS_MLA_ROW_BYTES if fmt == "fp8_ds_mla" else 576
    # fp16 q and rows: the interpreter refuses bf16 before any config is looked at
    dtype = torch.uint8 if fmt == "fp8_ds_mla" else torch.float16
    big = torch.empty(ROW_OFFSET_32_LIMIT // row + 1, row, dtype=dtype, device=DEVICE)
    cfg = dataclasses.replace(AMPERE if fmt == "fp8_ds_mla" else AMPERE_LATENT, row_offsets_32=True)
    q = torch.zeros(2, 16, 576, dtype=torch.float16, device=DEVICE)
    idx = torch.zeros(2, 64, dtype=torch.int32, device=DEVICE)
    span = (big.shape[0] - 1) * row + row
    with pytest.raises(ValueError, match=f"row_offsets_32=True.*spans {span}"):
        sparse_mla(q, big, idx, 0.07, config=cfg, kv_format=fmt)
