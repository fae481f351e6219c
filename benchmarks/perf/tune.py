"""Sweep launch configurations for key shapes on the GPU: check each against the reference, time it.

    python benchmarks/perf/tune.py [--only mem,mma,small,ds,occ,ds-mma,e4m3,stage,v4,gluon,gluon-bf16,ampere,ampere-regs,ampere-wide,
        ds-split,splits,ahead,offsets32] [--out DIR]
        [--arch sm80|sm86|sm89 [--target-smem]] [--tokens 64,128] [--max-seconds S]

Prints one line per configuration and the best per case; writes every row, with the ceilings
measured in the same run, to DIR/tune.json (DIR defaults to ./out/tune). Evidence for the
choices in ops/sparse_mla/heuristics.py (see docs/PERFORMANCE.md). ``--arch``: the sweeps on
that target's path by PTX JIT (its default tiles, as ``triton-mla-sparse bench --arch``; the
times are this GPU's, and every row of tune.json says so).
"""

from __future__ import annotations

import argparse
import dataclasses
import itertools
import json
import time
import traceback
from pathlib import Path

import torch

from triton_mla_sparse.bench import prepare, run_case
from triton_mla_sparse.cli.bench import ARCH_CHOICES
from triton_mla_sparse.ops.sparse_mla.heuristics import (
    E4M3_DECODES,
    KernelConfig,
    ampere_gluon_smem,
    arch_of,
    choose_config,
    long_splits_pay,
    max_block_h,
    num_splits_for,
    split_len_for,
    splits_qk,
)
from triton_mla_sparse.ops.sparse_mla.plan import (
    DS_MLA_GLUON_ALT_BLOCK_N,
    DS_MLA_GLUON_ALT_WARPS,
    LATENT_GLUON_WS_WARPS,
)
from triton_mla_sparse.testing import measure_ceilings
from triton_mla_sparse.workloads import Case, deepseek_v4_case


def triton_config(c: Case, width: int, arch) -> KernelConfig:
    """The Triton kernel's configuration for case ``c`` (``width`` indices per token), where the
    heuristics would run a Gluon kernel (KernelConfig.gluon): the tile the sweeps vary from."""
    return choose_config(c.tokens, c.heads, width, c.dtype, c.kv_format, arch, gluon=False)


def e4m3_forms(c: Case) -> list[KernelConfig]:
    """The path's own tiles with the integer e4m3 decode in each KernelConfig.e4m3_decode form
    (forced where the path decodes in hardware; packed-nomask only where the tiles stage)."""
    base = triton_config(c, c.topk, arch_of(torch.device("cuda")))
    return [
        dataclasses.replace(base, fp8_native=False, e4m3_decode=d)
        for d in E4M3_DECODES
        if d != "packed-nomask" or base.stage_dequant
    ]


def staged_or_not(c: Case) -> list[KernelConfig]:
    """The path's own tiles with the e4m3 tile staged through shared memory and without (sm80's
    packed decode gained 8-17% from un-staging at <= 16 tokens and in 64-head tiles:
    PERFORMANCE.md log 20)."""
    base = triton_config(c, c.topk, arch_of(torch.device("cuda")))
    return [dataclasses.replace(base, stage_dequant=stage) for stage in (True, False)]


def exact_fp16_steps(cfg: KernelConfig, c: Case, width: int, arch) -> KernelConfig:
    """fp8_ds_mla's 32-row staged tile with exact fp16 operands in place of the fold in 64-row
    steps that heuristics.folds_ds_mla_fp16 gives 64-head tiles on sm90: the form the sweeps
    below vary from (``width`` indices per token of case ``c``)."""
    if not cfg.fp16_fold:
        return cfg
    programs = c.tokens * -(-c.heads // cfg.block_h)
    splits = num_splits_for(programs, width, 32, arch.num_sms, cfg.block_h)
    return dataclasses.replace(cfg, block_n=32, fp16_fold=False, num_splits=splits)


def v4_tiles(c: Case) -> list[KernelConfig]:
    """DeepSeek-V4's record (fp8_ds_mla_v4) in the 32-row steps it shares with fp8_ds_mla, in
    every head block the path compiles (its max_block_h), 4 or 8 warps, the split count the
    heuristic would give that block, staged or not, with fp16 MMAs (scaled chunks) and with
    MMAs in q's dtype (the folded form), and with fp16 MMAs and folded scales
    (KernelConfig.fp16_fold: 6-21% fewer instructions per pass than the other forms on sm80,
    sm89 and sm90, perf-log 22); the 64-head folded tiles also in 64-row steps (the bf16 fold
    with one and two stages, the fp16 fold with two). The heuristic's own tile is the sweep's
    first row (tune's default)."""
    arch = arch_of(torch.device("cuda"))
    width = c.topk + c.extra_topk
    # fp8_ds_mla's tile for the same call: the record's 32-row steps, stages and staging
    shared = exact_fp16_steps(
        choose_config(c.tokens, c.heads, width, c.dtype, "fp8_ds_mla", arch, block_table=True),
        c,
        width,
        arch,
    )
    limit = max_block_h(c.dtype, c.kv_format, arch)
    out = []
    for block_h, warps in ((64, 8), (32, 4), (32, 8), (16, 4)):
        if block_h > limit or block_h > max(16, c.heads):
            continue
        programs = c.tokens * -(-c.heads // block_h)
        splits = num_splits_for(programs, width, shared.block_n, arch.num_sms, block_h)
        tile = dataclasses.replace(shared, block_h=block_h, num_warps=warps, num_splits=splits)
        for stage in (True, False) if shared.stage_dequant else (False,):
            for fp16_mma in (True, False):
                out.append(dataclasses.replace(tile, stage_dequant=stage, fp16_mma=fp16_mma))
        fp16_folded = dataclasses.replace(tile, fp16_mma=True, fp16_fold=True)
        out.append(fp16_folded)
        if block_h == 64 and shared.stage_dequant:
            long_steps = num_splits_for(programs, width, 64, arch.num_sms, block_h)
            long = dict(block_n=64, num_splits=long_steps)
            for stages in (1, 2):
                out.append(dataclasses.replace(tile, num_stages=stages, fp16_mma=False, **long))
            out.append(dataclasses.replace(fp16_folded, num_stages=2, **long))
    return out


def ds_mma_tiles(c: Case) -> list[KernelConfig]:
    """fp8_ds_mla's own tile with MMAs in q's dtype (the folded form): staged or not, 32- and
    16-row steps, and staged 64-row steps with one and two stages; the fp16 form (its default)
    and the fp16 MMAs with folded scales (KernelConfig.fp16_fold) in the same 64-row steps, the
    latter in the default's 32-row steps too (64 heads on sm90, instructions per pass: fp16
    1186 / 1973 in 32- / 64-row steps with 208 / 1288 B of spills, fp16 folded 1023 / 1514
    with 0 / 8 B: perf-log 21); and the fp16 fold in 32-head blocks, two programs per SM."""
    arch = arch_of(torch.device("cuda"))
    base = triton_config(c, c.topk, arch)
    base = exact_fp16_steps(base, c, c.topk, arch)
    folded = dataclasses.replace(base, fp16_mma=False)
    steps = [
        dataclasses.replace(folded, stage_dequant=stage, block_n=bn)
        for stage in (True, False)
        for bn in (32, 16)
    ]
    fp16 = dataclasses.replace(base, fp16_mma=True)
    fp16_folded = dataclasses.replace(fp16, fp16_fold=True)
    # 32-head blocks in one-stage 32-row steps (100 KB of shared memory on sm90): two programs
    # per SM, so that one's dequantization can overlap the other's MMAs and gather, at the
    # price of dequantizing every row once per head block
    programs = c.tokens * -(-c.heads // 32)
    pairs = [
        dataclasses.replace(
            fp16_folded,
            block_h=32,
            block_n=32,
            num_warps=warps,
            num_stages=1,
            stage_dequant=True,
            num_splits=num_splits_for(programs, c.topk, 32, arch.num_sms, 32),
        )
        for warps in (4, 8)
        if c.heads > 32
    ]
    return (
        steps
        + [dataclasses.replace(fp16_folded, stage_dequant=True)]
        + [
            dataclasses.replace(tile, stage_dequant=True, block_n=64, num_stages=stages)
            for tile in (folded, fp16, fp16_folded)
            for stages in (1, 2)
        ]
        + pairs
    )


def ahead_tiles(c: Case) -> list[KernelConfig]:
    """The scaled formats' folded 64-head tiles with each step's indices loaded a step ahead
    (KernelConfig.idx_ahead), so that Triton's pipeliner keeps the next gathers in flight while
    a step computes, in 32-row steps with two and three gather buffers (3 / 4 stages), beside
    the in-step 64-row two-stage tile (whose next gather is issued after the step's MMAs and
    waited for at the next step's start)."""
    arch = arch_of(torch.device("cuda"))
    width = c.topk + c.extra_topk
    base = triton_config(c, width, arch)
    if base.block_h < 64:
        return []
    programs = c.tokens * -(-c.heads // base.block_h)
    out = []
    for block_n, stages, ahead in ((32, 3, True), (32, 4, True), (64, 2, False)):
        splits = num_splits_for(programs, width, block_n, arch.num_sms, base.block_h)
        out.append(
            dataclasses.replace(
                base, block_n=block_n, num_stages=stages, idx_ahead=ahead, num_splits=splits
            )
        )
    return out


def gluon_tiles(c: Case) -> list[KernelConfig]:
    """The Triton kernel's 64 x 64 tile beside the sm90 kernels in Gluon (KernelConfig.gluon)
    in the same tile and split count: fp8_ds_mla "pipelined" (gathers a step ahead in a
    two-slot ring, one wait per MMA chain), "specialized" (dequantizing warps feeding the MMA
    warps a ring of fp16 tiles), and "alternating" in its 64 x 32 tile (two warpgroups on
    alternate steps, each dequantizing its own) at that split count and twice it; DeepSeek-V4's record in both forms (a ring of raw bytes
    dequantized in the MMA warps, or a ring of bf16 tiles from a dequantizing warpgroup; both
    index sets); rows in q's dtype (kv_format "auto") in the wgmma kernel reading its ring, and
    in the warp-specialized one (two warpgroups on alternate steps, each gathering its own rows
    and multiplying half of O's columns). The default (the heuristics' choice) is one of them
    where it runs Gluon."""
    arch = arch_of(torch.device("cuda"))
    width = c.topk + c.extra_topk
    base = triton_config(c, width, arch)
    if c.kv_format == "auto" and c.heads <= 16 and int(arch.cc) == 90:
        # 8-16 heads: the Triton tile (the heuristics' choice where Gluon cannot run) beside
        # the warp-specialized kernel in its 64-head tile, the heads padded to 64 as vLLM pads
        # them for FlashMLA (memory-bound: the padded MMAs cost less than the rows' bytes), at
        # one and two programs per SM
        default = choose_config(c.tokens, c.heads, width, c.dtype, c.kv_format, arch, gluon=False)
        splits = num_splits_for(c.tokens, width, 64, arch.num_sms, 64)
        ws = KernelConfig(64, 64, LATENT_GLUON_WS_WARPS, 1, gluon="specialized")
        return [default] + [
            dataclasses.replace(ws, num_splits=s) for s in sorted({splits, 2 * splits})
        ]
    if not (base.block_h == 64 and base.block_n == 64):
        return []
    if c.kv_format == "fp8_ds_mla_v4":  # the record's warp-specialized kernel (bf16 fold)
        return [base] + [
            dataclasses.replace(base, gluon=form, num_stages=1, idx_ahead=False)
            for form in ("pipelined", "specialized")
        ]
    if c.kv_format == "auto":  # rows in q's dtype: the wgmma kernels reading their rings
        return [
            base,
            dataclasses.replace(base, gluon="pipelined", num_stages=1, idx_ahead=False),
            dataclasses.replace(
                base,
                gluon="specialized",
                num_warps=LATENT_GLUON_WS_WARPS,
                num_stages=1,
                idx_ahead=False,
            ),
        ]
    if not base.fp16_fold:
        return []
    # and the alternating kernel in its own 64 x 32 tile, at the tile's split count and twice it
    alt = dataclasses.replace(
        base,
        block_n=DS_MLA_GLUON_ALT_BLOCK_N,
        num_warps=DS_MLA_GLUON_ALT_WARPS,
        num_stages=1,
        idx_ahead=False,
        gluon="alternating",
    )
    return (
        [base]
        + [
            dataclasses.replace(base, gluon=form, num_stages=1, idx_ahead=False)
            for form in ("pipelined", "specialized")
        ]
        + [
            dataclasses.replace(alt, num_splits=s)
            for s in sorted({base.num_splits, 2 * base.num_splits})
        ]
    )


# the mma.sync Gluon kernels (KernelConfig.gluon="ampere"): their tiles (heads, rows, warps)
# with two ring slots (KernelConfig.num_stages), the 16-row step bringing 32 heads into the 99
# KB parts; and fp8_ds_mla's with one slot of raw rows, which fits a 32-head tile into 99 KB
# and two 16-head programs into an sm80 multiprocessor (two 16-row ones into 99 KB); the 32-
# and 64-head tiles also with twice the warps (two / four per 16 head rows: half the registers
# and instructions per warp, twice the warps per scheduler in a program); for calls of at most
# 16 heads, 16-head tiles of 8 warps (the columns split eight ways), in 32- and 64-row steps
AMPERE_WIDE_TILES = ((32, 32, 8), (64, 32, 16))
AMPERE_WIDE16_TILES = ((16, 32, 8), (16, 64, 8))
AMPERE_TILES = ((16, 32, 4), (32, 32, 4), (64, 32, 8), (32, 16, 4), *AMPERE_WIDE_TILES)
AMPERE_RING1_TILES = ((16, 32, 4), (16, 16, 4), (32, 32, 4), (64, 32, 8), *AMPERE_WIDE_TILES)


def ampere_config(c: Case, arch, block_h, block_n, warps, ring, **extra) -> KernelConfig:
    """The mma.sync Gluon kernel in one tile and ring (KernelConfig.num_stages) for this path,
    at the split count the heuristics give that tile; ``extra``: other KernelConfig fields."""
    ds_mla = c.kv_format == "fp8_ds_mla"  # its tile dequantized with the fp16 fold
    programs = c.tokens * -(-c.heads // block_h)
    splits = num_splits_for(
        programs,
        c.topk,
        block_n,
        arch.num_sms,
        block_h,
        long_splits=long_splits_pay(c.dtype, c.kv_format, c.heads, block_h),
    )
    return KernelConfig(
        block_h,
        block_n,
        warps,
        ring,
        num_splits=splits,
        stage_dequant=ds_mla,
        fp16_fold=ds_mla,
        gluon="ampere",
        **extra,
    )


def ampere_tiles(c: Case) -> list[KernelConfig]:
    """The path's Triton tile beside the mma.sync Gluon kernel in each tile and ring that fits
    this path's shared memory (heuristics.ampere_gluon_smem; more than 16 heads only where the
    call has more), each at the split count the heuristics give that tile; the 16-head
    four-warp tiles also with QK^T split over the latent (KernelConfig.split_qk), in both
    formats."""
    arch = arch_of(torch.device("cuda"))
    base = triton_config(c, c.topk, arch)
    wide16 = AMPERE_WIDE16_TILES if c.heads <= 16 else ()
    tiles = [(*t, 2) for t in (*AMPERE_TILES, *wide16)]
    if c.kv_format == "fp8_ds_mla":
        tiles += [(*t, 1) for t in (*AMPERE_RING1_TILES, *wide16)]
    out = [base]
    for block_h, block_n, warps, ring in tiles:
        if block_h > 16 and c.heads <= 16:
            continue
        if (
            ampere_gluon_smem(block_h, block_n, ring, c.kv_format, num_warps=warps)
            > arch.smem_bytes
        ):
            continue
        cfg = ampere_config(c, arch, block_h, block_n, warps, ring)
        out.append(cfg)
        if splits_qk(block_h, warps):
            out.append(dataclasses.replace(cfg, split_qk=True))
    return out


# The mma.sync kernels' 16-head tiles (calls of at most 16 heads) under register caps
# (KernelConfig.max_registers) that let more programs share an sm90 multiprocessor, compiled
# for sm90 in docs/perf-log/40-ampere-regs-sass.txt: fp8_ds_mla's 4-warp 16-row tile holds
# 204 registers uncapped (two programs per multiprocessor), capped at 168 three (no spill), at
# 128 four (40 bytes of spills); the 8-warp 32-row tile 164 (one program), capped at 128 two (no
# spill); the 4-warp 32-row default is bound to two by its 75.5 KB of shared memory, so a cap
# changes nothing there (timed uncapped, as the reference). Each at the heuristics' split
# count, at one and a half times it and at twice it: at 128 x 16 the default split makes 256
# programs, about two per multiprocessor, so a third or fourth program per multiprocessor only
# runs if the grid has that many (docs/perf-log/41-ampere-regs-h200.txt timed the first and
# the last only). fp8_ds_mla with one slot, rows in q's dtype with two.
AMPERE_REG_TILES = (((16, 32, 4), ()), ((16, 16, 4), (168, 128)), ((16, 32, 8), (128,)))
# fp8_ds_mla's 32-row default with q's RoPE part in registers (KernelConfig.q_rope_in_registers):
# 73.5 KB, so at 168 registers (no spill) three programs per sm90 multiprocessor
AMPERE_QR_REG_TILES = (((16, 32, 4), 168),)
# fp8_ds_mla's 32-row tile with QK^T split over the latent (KernelConfig.split_qk; the default
# from four steps a program): 64.5 KB, so registers alone keep it at two programs per sm90
# multiprocessor: compiled for sm90 (docs/perf-log/52-split-regs-sass.txt) it holds 234
# uncapped, 168 capped (three programs) with no spill under Triton 3.8 and 8 bytes under 3.6 (a
# loop pass 824 -> 886 instructions a warp); 128 spills 600 bytes. Uncapped too, at the same
# split counts, so that a gain at the larger counts is told apart from the cap's
AMPERE_SPLIT_REG_TILES = (((16, 32, 4), (None, 168)),)


def ampere_reg_tiles(c: Case) -> list[KernelConfig]:
    """The path's default, then the mma.sync kernel's 16-head tiles uncapped and under the
    register caps that raise their programs per multiprocessor (fp8_ds_mla's 32-row tile with
    q's RoPE part in registers and with QK^T split over the latent too)."""
    arch = arch_of(torch.device("cuda"))
    default = choose_config(c.tokens, c.heads, c.topk, c.dtype, c.kv_format, arch)
    ds_mla = c.kv_format == "fp8_ds_mla"
    ring = 1 if ds_mla else 2
    # (tile, register cap, q's RoPE part in registers, QK^T split over the latent)
    variants = [(t, cap, False, False) for t, caps in AMPERE_REG_TILES for cap in (None, *caps)]
    variants += [(t, cap, True, False) for t, cap in AMPERE_QR_REG_TILES if ds_mla]
    variants += [
        (t, cap, False, True) for t, caps in AMPERE_SPLIT_REG_TILES if ds_mla for cap in caps
    ]
    out = [default]
    for (block_h, block_n, warps), cap, qr, split in variants:
        smem = ampere_gluon_smem(
            block_h, block_n, ring, c.kv_format, qr, split_qk=split, num_warps=warps
        )
        if smem > arch.smem_bytes:
            continue
        splits = num_splits_for(c.tokens, c.topk, block_n, arch.num_sms, block_h)
        for k in sorted({splits, (3 * splits + 1) // 2, 2 * splits}):
            cfg = KernelConfig(
                block_h,
                block_n,
                warps,
                ring,
                num_splits=k,
                stage_dequant=ds_mla,
                fp16_fold=ds_mla,
                gluon="ampere",
                max_registers=cap,
                q_rope_in_registers=qr,
                split_qk=split,
            )
            if cfg != default:
                out.append(cfg)
    return out


def ds_split_tiles(c: Case) -> list[KernelConfig]:
    """fp8_ds_mla's 16-head four-warp tile with QK^T split over the latent (KernelConfig.split_qk)
    and without, at every walk length: the path's default, then the tile split and unsplit at the
    split count the heuristics give it, at one more (a grid sized for another GPU's
    multiprocessor count fills this one's differently: sm80's 3 splits at 64 tokens make 192
    two-per-multiprocessor programs, 73% of an H100's 264 places) and at twice that (shorter
    walks), and split with two ring slots where they fit the path's shared memory (the gather
    of step i + 1 issued a step earlier). Whether the split pays below
    heuristics.AMPERE_GLUON_SPLIT_QK_STEPS steps a program, and whether a second slot hides the
    gather where a program runs alone on a multiprocessor (sm80 with --target-smem)."""
    arch = arch_of(torch.device("cuda"))
    default = choose_config(c.tokens, c.heads, c.topk, c.dtype, c.kv_format, arch)
    out = [default]
    for split in (True, False):
        for ring in (1, 2) if split else (1,):
            if ampere_gluon_smem(16, 32, ring, c.kv_format, split_qk=split) > arch.smem_bytes:
                continue
            cfg = ampere_config(c, arch, 16, 32, 4, ring, split_qk=split)
            k = cfg.num_splits
            for variant in at_split_counts(cfg, c.topk, (k, k + 1, 2 * k)):
                if variant not in out:
                    out.append(variant)
    return out


def at_split_counts(cfg: KernelConfig, width: int, counts) -> list[KernelConfig]:
    """``cfg`` at each of ``counts`` as the launch runs it (split_len_for: a count past the
    walk's steps covers it in fewer), each run count once, in the order given."""
    runs = dict.fromkeys(split_len_for(width, max(1, n), cfg.block_n)[1] for n in counts)
    return [dataclasses.replace(cfg, num_splits=k) for k in runs]


def split_count_variants(c: Case) -> list[KernelConfig]:
    """The path's default, then its tile at half, a quarter and twice its split count (the
    counts the launch runs, deduplicated): where one-step splits (heuristics.SHORT_SPLIT_FILL)
    or two programs a multiprocessor stop paying at short decode."""
    arch = arch_of(torch.device("cuda"))
    default = choose_config(c.tokens, c.heads, c.topk, c.dtype, c.kv_format, arch)
    k = default.num_splits
    # the first is the default's own count as run: the default itself stands for it
    return [default, *at_split_counts(default, c.topk, (k, k // 2, k // 4, 2 * k))[1:]]


# The mma.sync kernels' 32- and 64-head tiles for calls of 64-128 heads, in four and eight
# warps per 32 heads; the eight-warp 32-head tile also capped at 128 registers, where ptxas
# otherwise gives it 252 and a 256-thread program the whole register file (log entry 48: one
# program per multiprocessor where the four-warp tile runs two on an H200). Run it with --arch
# and --target-smem: on the target's shared memory a 97 KB program runs alone on a 100 KB
# multiprocessor (sm86 / sm89), so there the eight-warp tiles double the warps per
# multiprocessor instead of halving the programs.
AMPERE_WIDE_SWEEP_TILES = (
    ((32, 32, 4), ()),
    ((32, 32, 8), (128,)),
    ((64, 32, 8), ()),
    ((64, 32, 16), ()),
)


def ampere_wide_tiles(c: Case) -> list[KernelConfig]:
    """The path's default, then the mma.sync kernel's 32- and 64-head tiles that fit its shared
    memory, in four and eight warps per 32 heads, uncapped and under the caps above, each at
    the split count the heuristics give that tile."""
    arch = arch_of(torch.device("cuda"))
    default = choose_config(c.tokens, c.heads, c.topk, c.dtype, c.kv_format, arch)
    ring = 1 if c.kv_format == "fp8_ds_mla" else 2
    out = [default]
    for (block_h, block_n, warps), caps in AMPERE_WIDE_SWEEP_TILES:
        if (
            ampere_gluon_smem(block_h, block_n, ring, c.kv_format, num_warps=warps)
            > arch.smem_bytes
        ):
            continue
        for cap in (None, *caps):
            cfg = ampere_config(c, arch, block_h, block_n, warps, ring, max_registers=cap)
            if cfg != default:
                out.append(cfg)
    return out


def offsets_32_variants(c: Case) -> list[KernelConfig]:
    """Where the path's default is an mma.sync kernel: that tile with 32-bit row offsets
    (KernelConfig.row_offsets_32), then the default again and the variant again, so that each
    is timed twice in alternation (the sweep's first row is the default) and a drift between
    them shows as a spread rather than as a difference."""
    arch = arch_of(torch.device("cuda"))
    default = choose_config(c.tokens, c.heads, c.topk, c.dtype, c.kv_format, arch)
    if default.gluon != "ampere":
        return []
    other = dataclasses.replace(default, row_offsets_32=not default.row_offsets_32)
    return [other, default, other]


def grid(block_h, block_n, warps, stages, splits, **extra):
    combos = itertools.product(block_h, block_n, warps, stages, splits)
    return [KernelConfig(*c, **extra) for c in combos]


def ds(*args, **kw):
    return grid(*args, stage_dequant=True, **kw)


def ia(*args, **kw):
    return grid(*args, idx_ahead=True, **kw)


# name -> (cases, configs for a case). With idx_ahead, num_stages = gather buffers + 1.
SWEEPS = {
    "mem": (
        [
            Case("decode T=128 H=16", 128, 16),
            Case("decode T=64 H=8", 64, 8),
            Case("decode T=16 H=16", 16, 16),
            Case("decode T=256 H=16", 256, 16),
            Case("prefill T=512 H=16", 512, 16),
            Case("decode T=128 H=16", 128, 16, kv_format="fp8"),
        ],
        lambda c: (
            grid([16], [64], [4], [2], [max(1, 256 // c.tokens)])
            + ia([16], [32], [4], [3], sorted({max(1, 256 // c.tokens), max(1, 512 // c.tokens)}))
            + ia([16], [64], [8], [3], [max(1, 128 // c.tokens)])
        ),
    ),
    "occ": (
        [
            Case("decode T=128 H=16", 128, 16),
            Case("decode T=64 H=8", 64, 8),
            Case("decode T=16 H=16", 16, 16),
            Case("decode T=128 H=16", 128, 16, kv_format="fp8"),
        ],
        lambda c: (
            ia([16], [16], [4], [3, 4], sorted({max(1, k * 128 // c.tokens) for k in (2, 3, 4)}))
            + grid([16], [16], [4], [2], [max(1, 256 // c.tokens), max(1, 512 // c.tokens)])
        ),
    ),
    "mma": (
        [
            Case("decode T=128 H=128", 128, 128),
            Case("decode T=128 H=64", 128, 64),
            Case("prefill T=4096 H=64", 4096, 64, rows=65536),
        ],
        lambda c: grid([64], [32], [8], [3, 4], [1]) + grid([64], [64], [4], [3], [1]),
    ),
    "small": (
        [
            Case("decode T=1 H=16", 1, 16),
            Case("decode T=4 H=16", 4, 16),
            Case("decode T=1 H=128", 1, 128),
            Case("decode T=16 H=64", 16, 64),
            Case("decode T=16 H=128", 16, 128),
        ],
        lambda c: (
            grid([16], [32], [4], [2], [32, 64]) + grid([16], [32], [4], [2], [64], pdl=False)
            if c.heads <= 16
            else grid([64], [64], [8], [3], [4, 8, 16] if c.tokens > 1 else [16, 32])
            + grid([64], [32], [8], [3], [8, 16] if c.tokens > 1 else [32, 64])
        ),
    ),
    "ds": (
        [
            Case("decode T=128 H=16", 128, 16, kv_format="fp8_ds_mla"),
            Case("decode T=16 H=16", 16, 16, kv_format="fp8_ds_mla"),
            Case("decode T=128 H=64", 128, 64, kv_format="fp8_ds_mla"),
        ],
        lambda c: (
            ds([16], [16], [4], [2], [2 * max(1, 128 // c.tokens)])
            + ds([16], [32], [8], [2], [2 * max(1, 128 // c.tokens)])
            if c.heads <= 16
            else ds([64], [16], [8], [2, 3], [1]) + ds([64], [32], [4], [2], [1])
        ),
    ),
    # fp8_ds_mla 64-head tiles: fp16 MMAs hold the four q chunks as register wgmma operands and
    # spill (208 B, Triton 3.6 ptxas); bf16 MMAs keep them in shared memory (no spills) and
    # fold the scales into the tile (PERFORMANCE.md log 25), also in 64-row steps (725
    # instructions per 32 rows against 1004, 190 KB of shared memory with two stages)
    "ds-mma": (
        [
            Case("decode T=128 H=64", 128, 64, kv_format="fp8_ds_mla"),
            Case("decode T=128 H=128", 128, 128, kv_format="fp8_ds_mla"),
            Case("decode T=16 H=64", 16, 64, kv_format="fp8_ds_mla"),
            Case("decode T=1 H=128", 1, 128, kv_format="fp8_ds_mla"),
            Case("prefill T=4096 H=64", 4096, 64, rows=65536, kv_format="fp8_ds_mla"),
        ],
        ds_mma_tiles,
    ),
    # the integer e4m3 decode (sm80/86's path) scalar against packed (inline PTX, four values a
    # call; docs/perf-log/12-packed-e4m3-sass.txt): per-tensor fp8 and fp8_ds_mla
    "e4m3": (
        [
            Case("decode T=128 H=16", 128, 16, kv_format="fp8_ds_mla"),
            Case("decode T=64 H=8", 64, 8, kv_format="fp8_ds_mla"),
            Case("decode T=128 H=64", 128, 64, kv_format="fp8_ds_mla"),
            Case("prefill T=4096 H=64", 4096, 64, rows=65536, kv_format="fp8_ds_mla"),
            Case("decode T=128 H=16", 128, 16, kv_format="fp8"),
        ],
        e4m3_forms,
    ),
    # fp8_ds_mla tiles staged or not, where few gather steps per program may not amortise the
    # staged tile's store and re-reads (every target's path; --arch for the emulated ones)
    "stage": (
        [
            Case(f"decode T={t} H={h}", t, h, kv_format="fp8_ds_mla")
            for t in (1, 4, 16, 64)
            for h in (16, 64, 128)
        ],
        staged_or_not,
    ),
    # DeepSeek-V4 decode as `bench --model deepseek-v4` runs it (584-byte record, window 128 +
    # compressed top-k 512, sink, 64 heads): head blocks, warps, staging, MMA dtype
    "v4": ([deepseek_v4_case(t, 64) for t in (1, 16, 64, 128)], v4_tiles),
    # fp8_ds_mla's Gluon kernel for sm90 beside the Triton kernel's default tile
    "gluon": (
        [
            Case(f"decode T={t} H={h}", t, h, kv_format="fp8_ds_mla")
            for t in (128, 64, 16, 1)
            for h in (64, 128)
        ]
        + [Case("prefill T=4096 H=64", 4096, 64, rows=65536, kv_format="fp8_ds_mla")]
        + [deepseek_v4_case(t, 64) for t in (128, 64, 16)],
        gluon_tiles,
    ),
    # bf16 rows on sm90: the Triton tile against the wgmma Gluon kernels, decode and prefill
    # (1024-4096 tokens at 64-128 heads); at 8-16 heads the heuristics' choice against the
    # warp-specialized one in its padded 64-head tile
    "gluon-bf16": (
        [Case(f"bf16 decode T={t} H={h}", t, h) for t in (128, 64, 16) for h in (64, 128)]
        + [
            Case(f"bf16 prefill T={t} H={h}", t, h, rows=65536)
            for t, h in ((4096, 64), (4096, 128), (1024, 64))
        ]
        + [Case(f"bf16 decode T={t} H={h}", t, h) for t in (128, 64) for h in (16, 8)],
        gluon_tiles,
    ),
    # fp8_ds_mla and bf16 rows on the sm80 / sm89 paths (--arch) or this GPU: the Triton tile
    # against the mma.sync Gluon kernels, decode and prefill (--tokens 4096; fp8_ds_mla also
    # at 1024 tokens, between the decode counts and 4096)
    "ampere": (
        [
            Case(f"decode T={t} H={h}", t, h, kv_format=fmt)
            for fmt in ("fp8_ds_mla", "auto")
            for t in (128, 64, 16, 1)
            for h in (16, 64, 128)
        ]
        + [
            Case("prefill T=4096 H=64", 4096, 64, rows=65536, kv_format=fmt)
            for fmt in ("fp8_ds_mla", "auto")
        ]
        + [Case("prefill T=1024 H=64", 1024, 64, rows=65536, kv_format="fp8_ds_mla")],
        ampere_tiles,
    ),
    # fp8_ds_mla and bf16 rows at 16 heads: the mma.sync kernels' 16-head tiles under register
    # caps (more programs per multiprocessor), on this GPU or a path (--arch)
    "ampere-regs": (
        [
            Case(f"decode T={t} H=16", t, 16, kv_format=fmt)
            for fmt in ("fp8_ds_mla", "auto")
            for t in (128, 64, 16, 1)
        ],
        ampere_reg_tiles,
    ),
    # fp8_ds_mla and bf16 rows at 64-128 heads: the mma.sync kernels' 32- and 64-head tiles in
    # four and eight warps per 32 heads, on a path (--arch, with --target-smem)
    "ampere-wide": (
        [
            Case(f"decode T={t} H={h}", t, h, kv_format=fmt)
            for fmt in ("fp8_ds_mla", "auto")
            for t in (128, 64)
            for h in (128, 64)
        ],
        ampere_wide_tiles,
    ),
    # fp8_ds_mla at 8/16 heads: the 16-head tile with QK^T split over the latent or not, one
    # ring slot or two, at every walk length (--arch, with --target-smem for the target's
    # programs per multiprocessor)
    "ds-split": (
        [
            Case(f"decode T={t} H={h}", t, h, kv_format="fp8_ds_mla")
            for t in (1, 4, 16, 64, 128)
            for h in (16, 8)
            if h == 16 or t == 64
        ],
        ds_split_tiles,
    ),
    # both formats at 1-32 tokens: the split count against half, a quarter and twice as many
    # (native, or a path with --arch, its grids for this GPU with --host-sms)
    "splits": (
        [
            Case(f"decode T={t} H={h}", t, h, kv_format=fmt)
            for fmt in ("fp8_ds_mla", "auto")
            for t in (1, 2, 4, 8, 16, 32)
            for h in (8, 16, 32, 64, 128)
        ],
        split_count_variants,
    ),
    # both formats on the mma.sync kernels' paths (--arch, with --host-sms for this GPU's
    # grids): row offsets in 32-bit arithmetic or 64-bit, at the decode shapes of the targets
    "offsets32": (
        [
            Case(f"decode T={t} H={h}", t, h, kv_format=fmt)
            for fmt in ("fp8_ds_mla", "auto")
            for t in (128, 64)
            for h in (16, 64, 128)
        ],
        offsets_32_variants,
    ),
    # fp8_ds_mla and DeepSeek-V4 in 64-head folded tiles: indices a step ahead or not
    "ahead": (
        [
            Case(f"decode T={t} H={h}", t, h, kv_format="fp8_ds_mla")
            for t in (128, 64, 16)
            for h in (64, 128)
        ]
        + [Case("decode T=1 H=128", 1, 128, kv_format="fp8_ds_mla")]
        + [deepseek_v4_case(t, 64) for t in (128, 64, 16)],
        ahead_tiles,
    ),
}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument(
        "--out", metavar="DIR", type=Path, default=Path("out/tune"), help="directory for tune.json"
    )
    ap.add_argument("--only", default=",".join(SWEEPS), help="sweeps to run, comma-separated")
    ap.add_argument(
        "--arch",
        choices=sorted(ARCH_CHOICES),
        help="run the sweeps on that target's path by PTX JIT (this GPU's times)",
    )
    ap.add_argument(
        "--target-smem",
        action="store_true",
        help="with --arch: each launch padded so that as many programs share a multiprocessor "
        "as on the target (testing.ptx_jit.padded_shared)",
    )
    ap.add_argument(
        "--host-sms",
        action="store_true",
        help="with --arch: the heuristics' grids (split counts) sized for this GPU's "
        "multiprocessors instead of the target's (testing.ptx_jit.enable's host_sms)",
    )
    ap.add_argument(
        "--max-seconds",
        type=float,
        help="start no configuration after this many seconds minus a reserve for one more "
        "compile, so that the best-per-case table of what ran is still printed",
    )
    ap.add_argument(
        "--tokens",
        type=lambda s: {int(t) for t in s.split(",")},
        help="only the cases with these token counts, comma-separated (e.g. 64,128)",
    )
    args = ap.parse_args()
    if args.target_smem and args.arch is None:
        ap.error("--target-smem applies to a target's path: give --arch too")
    if args.host_sms and args.arch is None:
        ap.error("--host-sms applies to a target's path: give --arch too")
    args.out.mkdir(parents=True, exist_ok=True)
    dev = torch.device("cuda")
    path = "native"
    if args.arch is not None:
        from triton_mla_sparse.cli.bench import start_emulation
        from triton_mla_sparse.testing.ptx_jit import path_label

        emu = start_emulation(
            ARCH_CHOICES[args.arch], dev, target_smem=args.target_smem, host_sms=args.host_sms
        )
        if emu is None:  # it says why
            raise SystemExit(2)
        path = path_label(emu.cc, torch.cuda.get_device_name(dev), emu.target_smem, emu.grid_sms)
        print(f"sweeping the {path}: this GPU's times, not an {args.arch} GPU's", flush=True)
    sweep(args, dev, path)


def selected(cases: list[Case], tokens: set[int] | None) -> list[Case]:
    """The cases of a sweep whose token count is in ``tokens`` (all of them for None)."""
    return [c for c in cases if tokens is None or c.tokens in tokens]


# --max-seconds keeps this much back: one more configuration's first compile and its timing
RESERVE_S = 30.0


def sweep(args, dev, path: str) -> None:
    started = time.monotonic()
    skipped = 0

    def out_of_time() -> bool:
        return bool(args.max_seconds) and time.monotonic() - started > args.max_seconds - RESERVE_S

    log = args.out / "tune.json"
    ceil = measure_ceilings(dev)
    print(
        f"ceilings: copy {ceil.copy_gbps:.0f} GB/s, matmul {ceil.matmul_tflops:.0f} TFLOP/s",
        flush=True,
    )
    rows = []
    for name in args.only.split(","):
        cases, configs = SWEEPS[name]
        for case in selected(cases, args.tokens):
            # None: the configuration sparse_mla chooses for the call (its plan)
            cfgs = [None, *configs(case)]
            if out_of_time():
                skipped += len(cfgs)
                continue
            prepared = prepare(case, dev)
            for cfg in cfgs:
                if out_of_time():
                    skipped += 1
                    continue
                try:
                    r = run_case(case, dev, ceil, config=cfg, prepared=prepared)
                    d = dataclasses.asdict(r)
                except Exception as e:  # out of shared memory, register spills that fail, ...
                    d = {
                        "case": case.name,
                        "kv_format": case.kv_format,
                        "config": str(cfg),
                        "error": repr(e)[:300],
                    }
                    traceback.print_exc(limit=1)
                d["sweep"], d["default"], d["path"] = name, cfg is None, path
                rows.append(d)
                with open(log, "w") as f:
                    json.dump({"ceilings": dataclasses.asdict(ceil), "rows": rows}, f, indent=1)
                print(
                    f"{name:13s} {case.kv_format:10s} {case.name:22s} {d.get('config')} "
                    f"err {d.get('err', float('nan')):.1e} us {d.get('us')} ratio {d.get('ratio')}",
                    flush=True,
                )
    if skipped:
        print(f"\n--max-seconds {args.max_seconds:.0f}: {skipped} configurations not run")
    print("\nbest per case:")
    for name in args.only.split(","):
        for case in selected(SWEEPS[name][0], args.tokens):
            cand = [
                r
                for r in rows
                if r["sweep"] == name
                and r["case"] == case.name
                and r["kv_format"] == case.kv_format
                and r.get("us")
            ]
            if not cand:
                continue
            best = min(cand, key=lambda r: r["us"])
            dflt = next((r for r in cand if r["default"]), None)
            print(
                f"  {case.kv_format:10s} {case.name:22s} best {best['us']:8.1f} us {best['config']:28s} "
                f"(x{best['ratio']:.2f} floor) default {dflt['us'] if dflt else float('nan'):8.1f} us"
            )


if __name__ == "__main__":
    main()
