"""Launch configurations: a static function of (shape, dtype, format, architecture).

No autotuning at serving time: the choice depends only on what a CUDA graph captures (token count,
head count, top-k width), so a captured shape always replays the kernel it was warmed with.
Measured choices live in docs/PERFORMANCE.md; per-architecture tables keep each target inside its
shared-memory budget (checked by tests/test_compile.py).
"""

from __future__ import annotations

import dataclasses
import functools
import re

import torch

# The target model is shared with the other ops (ops/target.py); importing it from here keeps
# working for callers that always did (interface.py, tools).
from ..target import SMEM_227KB_CLASS, SMEM_LARGE_CLASS, TARGETS, Arch, arch_of

__all__ = [
    "TARGETS",
    "Arch",
    "E4M3_DECODES",
    "E4M3_DECODE_DEFAULT",
    "SCALED_CHUNK_FORMATS",
    "KernelConfig",
    "arch_of",
    "block_h_for",
    "choose_config",
    "e4m3_decode_for",
    "fp16_mma_for",
    "folds_ds_mla_fp16",
    "folds_v4_scales",
    "gluon_available",
    "ampere_gluon_config",
    "ampere_gluon_smem",
    "ampere_gluon_warps",
    "gluon_form_for",
    "long_splits_pay",
    "max_block_h",
    "num_splits_for",
    "split_len_for",
    "splits_qk",
    "tile_config",
]


@dataclasses.dataclass(frozen=True)
class KernelConfig:
    """How one call is launched. ``num_splits`` > 1 adds an LSE merge pass."""

    block_h: int
    block_n: int
    num_warps: int
    # Triton's software-pipelining depth; the sm90 Gluon kernels, whose rings are their own
    # pipeline, take 1; the mma.sync Gluon kernels (gluon="ampere") the slots of their ring of
    # gathered rows: two, or for fp8_ds_mla one (its next gather issued after the step's
    # dequantization, a slot's shared memory less)
    num_stages: int
    num_splits: int = 1
    # None: the architecture's choice; False forces the integer e4m3 decode (sm80's path).
    fp8_native: bool | None = None
    # fp8_ds_mla only: convert each e4m3 tile once and stage it through shared memory as fp16
    # (costs shared memory), instead of converting inside each dot's operand load.
    stage_dequant: bool = False
    # Load each step's indices one step ahead (lets Triton double-buffer the gather from
    # num_stages=3 on; costs registers). Every format; the scaled formats' extra set keeps the
    # in-step loop where it has a block table of its own. Not with a (main) block table: Triton
    # 3.6 fails to compile step-ahead indices feeding the table lookup
    # (RemoveLayoutConversions), so that path keeps the in-step loop; sparse_mla refuses a
    # config asking for both. The Triton kernels only: the Gluon kernels' rings schedule their
    # own index loads (the plan refuses it with gluon set).
    idx_ahead: bool = False
    # Launch the merge pass as a programmatic dependent of the split pass (sm90+), so its launch
    # overlaps the split pass instead of following it. None: the architecture's choice.
    pdl: bool | None = None
    # e4m3 caches: MMA operands in fp16 (e4m3 widens to fp16 in one instruction per two values)
    # or, False, in q's dtype (no conversion of q; fp8_ds_mla and the V4 record then multiply
    # their scales into the tile: exact for the V4 record's powers of two, one rounding to bf16
    # for fp8_ds_mla's fp32 scales). None: the architecture's choice (heuristics.fp16_mma_for).
    fp16_mma: bool | None = None
    # e4m3 caches without hardware fp8 (fp8_native False: sm80/86, or forced): "scalar" decodes
    # one value per chain of integer operations; "packed" four values per inline-PTX call
    # (NVIDIA only); "packed-nomask" also drops fp8_ds_mla's staging mask (the cast then feeds
    # the staged tile unmasked). None: the architecture's choice (e4m3_decode_for).
    e4m3_decode: str | None = None
    # fp8_ds_mla and the V4 record with fp16 MMAs: multiply the chunk scales into the tile
    # relative to the step's largest scale, as the bf16/fp32 MMAs do (kernels/ds_mla.py,
    # kernels/ds_mla_v4.py): for fp8_ds_mla one fp16 rounding of each dequantized value, for
    # the V4 record exact (powers of two), instead of exact operands and scaled logits and P.
    # The default for fp8_ds_mla in 64-head tiles on sm90 with bf16 q (folds_ds_mla_fp16).
    fp16_fold: bool = False
    # sm90, 64 x 64 tiles: a Gluon kernel, whose schedule is written out instead of left to
    # Triton's pipeliner. fp8_ds_mla with the fp16 fold (kernels/ds_mla_sm90_gluon.py):
    # "pipelined" gathers a step ahead in a two-slot cp.async ring, one wait per MMA chain;
    # "specialized" has four dequantizing warps fill a two-slot ring of fp16 K tiles that the
    # MMA warps consume; "alternating" (kernels/ds_mla_sm90_gluon_alt.py, its own 64 x 32 tile,
    # four warps: plan.DS_MLA_GLUON_ALT_WARPS) gives two warpgroups alternate steps, each
    # dequantizing its own; no block table, no extra set. The V4 record with bf16 MMAs
    # (kernels/ds_mla_v4_sm90_gluon.py): "pipelined" (one partition, cp.async ring) and
    # "specialized", both sets, block tables. Rows in bf16 (kv_format "auto";
    # kernels/latent_sm90_gluon.py): "pipelined", the MMAs reading the cp.async ring, and
    # "specialized" (four warps, plan.LATENT_GLUON_WS_WARPS: each of two warpgroups takes
    # alternate steps and half of O), no block table, no extra set. fp8_ds_mla and rows in q's
    # dtype on any NVIDIA
    # GPU from sm80 (kernels/ampere_gluon.py): "ampere", the pipelined schedule with mma.sync,
    # tiles in multiples of 16 rows. None: the Triton kernel. The default where timed faster
    # (gluon_form_for).
    gluon: str | None = None
    # NVIDIA: the most registers per thread ptxas may give the split pass's kernel (Triton's
    # `maxnreg`), so that more programs share a multiprocessor; None: the compiler's choice
    # (every default). For timing occupancy against the instructions and spills a cap costs.
    max_registers: int | None = None
    # The mma.sync fp8_ds_mla kernel (gluon="ampere"): q's RoPE part held as the rope MMA's
    # operand in registers for the whole walk instead of in shared memory (BLOCK_H x 64 x 2
    # bytes less, a few more registers), so that with max_registers its 16-head one-slot tile
    # fits three programs into an sm90 multiprocessor (not with split_qk, which holds all of q
    # in registers). For timing; False in every default.
    q_rope_in_registers: bool = False
    # The mma.sync kernels (gluon="ampere") in a 16-head four-warp tile: QK^T split over the
    # latent, one 128-column chunk a warp, with q in registers for the whole walk and the four
    # partial S tiles summed through shared memory (a fifth less shared-memory traffic a step,
    # q no longer in shared memory). fp8_ds_mla: the default where each program walks at least
    # AMPERE_GLUON_SPLIT_QK_STEPS steps (ampere_gluon_config), rows in q's dtype from
    # ROWS_SPLIT_QK_STEPS.
    split_qk: bool = False
    # The mma.sync kernels (gluon="ampere"): the gathered rows' offsets in 32-bit arithmetic,
    # for a cache whose elements all lie less than plan.ROW_OFFSET_32_LIMIT from its start (a
    # row's offset one multiply-add, not a 64-bit multiply chain, in every gather). The plan
    # refuses it for a larger cache.
    row_offsets_32: bool = False


# KernelConfig.e4m3_decode's values, and the form every path takes where no measurement chose
# another (e4m3_decode_for): the only one that runs everywhere (interpreter, AMD).
E4M3_DECODES = ("scalar", "packed", "packed-nomask")
E4M3_DECODE_DEFAULT = "scalar"
# Targets whose packed-decode choice was timed (their code by PTX JIT on an H200), and the token
# count up to which a call is in the latency regime (few short gather loops per program).
PACKED_DECODE_CCS = (80,)
SHORT_DECODE_TOKENS = 16
# A split of one step pays a program's fixed costs (its queries' load, its fp32 partial's store
# and the merge's read of it) for one step of rows. Where half as many two-step splits still
# give this share of the SMs a program, they are the faster grid. H100 (132 SMs; the sm80 and
# sm89 paths by PTX JIT with their grids sized for it), Triton 3.8, top-k 2048, 64 one-step
# splits against 32 two-step ones, µs: 4 tokens x 16 heads 11.0 / 9.5 bf16 and 11.6 / 10.8
# fp8_ds_mla on the sm80 path, 10.8 / 9.4 and 11.4 / 10.2 natively; 4 x 8 heads 9.0 / 8.4
# natively; 1 x 128 heads 16.3 / 13.4 bf16 on the sm89 path and 17.0 / 13.9 fp8_ds_mla on the
# sm80 path (docs/perf-log/76-host-sms-and-split-steps-h100.txt). Where half as many fill
# fewer SMs (1-2 tokens x 8-16 heads) the one-step splits stay faster.
SHORT_SPLIT_FILL = 0.9
# Two-step splits pay the same fixed costs over two steps; each split's fp32 partial output
# (heads x 512 x 4 bytes) is written and read back by the merge, so the more heads a program
# holds, the more halving the split count saves. Where half as many four-step splits still give
# SHORT_SPLIT_FILL of the SMs a program, they are the faster grid from this many heads a program
# (per kv_format, q in 16 bits; formats not listed and fp32 q were not timed and keep two-step
# splits). H100 (132 SMs; the sm80 and sm89 paths by PTX JIT with their grids sized for it),
# Triton 3.8, top-k 2048, 32 two-step splits against 16 four-step ones, µs: rows in bf16 at
# 16-32 heads a program 0.86-0.94x on every path (8 x 16 13.5 / 12.4 natively, 8 x 32 21.7 /
# 19.1; the sm89 path's 2 x 128 and 4 x 64 18.8 / 17.0 and 19.3 / 17.1; the sm80 path's 16 x 32,
# 16 splits against 8, 31.0 / 28.8) but 0.99-1.02x at 8 heads; fp8_ds_mla, whose steps cost
# more, at 32 heads 0.78-0.98x (8 x 32 natively 28.7 / 22.5, the sm80 path's 2 x 128 and 4 x 64
# 0.98x) and at 16 heads 0.98-1.04x (docs/perf-log/78-split-steps-h100.txt).
LONG_SPLIT_MIN_HEADS = {"auto": 16, "fp8_ds_mla": 32}

# The per-group-scaled e4m3 formats: one kernel structure (scaled chunks folded into the logits
# and into P), the same tiles.
SCALED_CHUNK_FORMATS = ("fp8_ds_mla", "fp8_ds_mla_v4")
# NVIDIA targets whose 64-head fp8_ds_mla_v4 tile compiles without large spills (max_block_h)
V4_H64_CCS = (90, 100)
# NVIDIA targets whose V4 record runs bf16 MMAs with folded scales under bf16 q
# (folds_v4_scales): where that form was timed faster (sm80 / sm89 as their PTX on an H200).
V4_FOLD_CCS = (80, 89, 90)


# The first Triton release whose code for the single-partition ("pipelined") fp8_ds_mla Gluon
# kernel was timed faster than its warp-specialized form (gluon_form_for).
PIPELINED_DS_MLA_TRITON = (3, 8)
# The token counts (inclusive) at which the sm90 Gluon kernels for rows in q's dtype were timed
# against the Triton kernel; they are the default only there (gluon_form_for, rows_ws_config).
GLUON_TIMED_TOKENS = (64, 128)
# the warps of a program of the warp-specialized rows kernel (KernelConfig.num_warps: its first
# warpgroup; the second is its worker partition), and its tile's heads and rows
LATENT_GLUON_WS_WARPS = 4
LATENT_GLUON_WS_TILE = 64
# the fewest heads it was timed at in its padded tile (fewer keep the heuristics' other choice)
LATENT_GLUON_WS_MIN_HEADS = 8
# past the decode range (prefill) it was timed at 64 and 128 heads only (1024 and 4096 tokens)
LATENT_GLUON_WS_PREFILL_MIN_HEADS = 64
# The mma.sync Gluon kernels (kernels/ampere_gluon.py): the targets whose code was timed faster
# than the Triton kernel's (sm80's and sm89's PTX on an H200), the rows of one step, the decode
# token counts (inclusive) they were timed at (1, 16, 64 and 128), and their rings: fp8_ds_mla
# with one slot of raw rows (the next step's gather issued once this step's rows are
# dequantized: faster than two slots in every tile timed, and it fits 32 heads into 99 KB),
# rows in q's dtype with two.
AMPERE_GLUON_CCS = (80, 89)
# sm90 (the H200 natively): the mma.sync kernel in its 16-head tile beat the Triton kernel and
# the wgmma Gluon kernels for calls of at most this many heads, fp8_ds_mla at 1-128 tokens and
# rows in q's dtype up to SHORT_DECODE_TOKENS tokens (ampere_gluon_config).
AMPERE_GLUON_NARROW_CCS = (90,)
AMPERE_GLUON_NARROW_HEADS = 16
AMPERE_GLUON_BLOCK_N = 32
AMPERE_GLUON_TOKENS = (1, 128)
AMPERE_GLUON_DS_RING = 1
AMPERE_GLUON_RING = 2
# fp8_ds_mla past the decode range (prefill): the targets where the same tiles were timed faster
# than the Triton kernel at 4096 tokens x 16, 32, 64 and 128 heads (1024 x 64 too), and the
# fewest heads timed there (the 16-head tile with QK^T split over the latent; fewer heads were
# not timed at prefill and keep the Triton kernel: ampere_gluon_config)
AMPERE_GLUON_DS_PREFILL_CCS = (80, 89)
AMPERE_GLUON_DS_PREFILL_MIN_HEADS = 16
# Rows in q's dtype at many heads: the targets whose code ran faster in the 64-head two-slot
# tile than in the Triton kernel (sm80's PTX on an H100; sm89's 32 x 16 tile was slower), in
# decode from the fewest tokens timed there (16) and in prefill (timed at 4096 tokens), and the
# fewest heads timed (64)
AMPERE_GLUON_ROWS_WIDE_CCS = (80,)
AMPERE_GLUON_ROWS_WIDE_HEADS = 64
AMPERE_GLUON_ROWS_WIDE_MIN_TOKENS = 16
# Rows in q's dtype at AMPERE_GLUON_NARROW_HEADS heads or fewer, in the 16-head two-slot tile:
# the targets whose code ran faster there than in the Triton kernel at every decode token count
# timed (sm89), and those where it did up to SHORT_DECODE_TOKENS tokens only (sm80's PTX on an
# H100: 0.87-0.95x the Triton kernel's time at 1-16 tokens, 1.02-1.03x at 64)
AMPERE_GLUON_ROWS_NARROW_CCS = (89,)
AMPERE_GLUON_ROWS_SHORT_CCS = (80,)
# fp8_ds_mla in the 16-head four-warp tile: the fewest steps a program walks for QK^T split over
# the latent (KernelConfig.split_qk) to be the default. Timed on the H200 against the unsplit
# tile, Triton 3.8, 16 heads (docs/perf-log/47-qk-split-h200.txt): 1.05x its time in walks of
# one step (1 and 4 tokens), 1.00x / 1.03x in walks of one and two (2 and 8 tokens), 0.97x in
# four (16 tokens), 0.96x in 16 (64 tokens), 0.95x in 32 (128 tokens); the same on the sm80
# and sm89 paths by PTX JIT (1.04-1.06x at one token, 0.94-0.97x from 16 tokens on).
AMPERE_GLUON_SPLIT_QK_STEPS = 4
# the mma.sync rows kernel's tiles whose warps split S's rows and columns run PV with the warps
# over O's columns from this many warps (kernels/ampere_gluon.py's PV_COLS_MIN_WARPS): each V
# value read by one warp instead of each head group; the rows' rescale factors then cross to
# PV's layout through shared memory. sm80 path's 64-head tile on an H100 by PTX JIT (PERFORMANCE.md
# log entry 74, decode 16-128 tokens and prefill 4096 x 64 / 128 heads): 0.96-0.98x the time
# under Triton 3.8, 0.80-0.89x under 3.6 (its spills gone). Four-warp tiles keep QK^T's layout
# for PV: the rows kernel's 32-head one spills with it (Triton 3.8), and the fp8_ds_mla
# kernel's, the sm89 path's default from 32 heads, ran 1.04-1.06x slower with it (entry 73).
AMPERE_PV_COLS_WARPS = 8
# Rows in q's dtype in the 16-head four-warp tile: the fewest steps a program walks for the split
# to be the default. Timed on the sm89 path by PTX JIT on the H200, Triton 3.8
# (docs/perf-log/51-ampere-sm89-h200.txt): 0.96x the unsplit tile's time in walks of 32 steps
# (128 tokens x 16 heads: 93.4 against 97.5 us), 1.01x in walks of 4 (16 tokens); walks of 8-16
# steps (32-64 tokens) not timed yet, so they keep the unsplit tile. sm90's rows tile (at most
# SHORT_DECODE_TOKENS tokens) walks fewer.
ROWS_SPLIT_QK_STEPS = 32
# the split's warps: one per 128-column chunk of the latent (fp8_ds_mla's scale groups)
SPLIT_QK_WARPS = 4
# the formats whose mma.sync kernel takes the split: fp8_ds_mla (the default from
# AMPERE_GLUON_SPLIT_QK_STEPS steps) and rows in q's dtype (from ROWS_SPLIT_QK_STEPS)
SPLIT_QK_FORMATS = ("fp8_ds_mla", "auto")


@functools.cache
def triton_version() -> tuple[int, int]:
    """(major, minor) of the Triton that compiles the kernels."""
    import triton

    found = re.match(r"(\d+)\.(\d+)", triton.__version__)
    if found is None:
        raise RuntimeError(f"cannot read Triton's version from {triton.__version__!r}")
    return int(found[1]), int(found[2])


@functools.cache
def gluon_available() -> bool:
    """Whether this Triton has the Gluon Hopper layer the sm90 Gluon kernels are written in
    (checked by importing them; nothing touches the GPU)."""
    try:
        from .kernels import ds_mla_sm90_gluon, ds_mla_v4_sm90_gluon  # noqa: F401
    except ImportError:
        return False
    return True


def max_block_h(dtype: torch.dtype, kv_format: str, arch: Arch) -> int:
    """The largest head block whose tiles fit the target's shared memory (tests/test_compile.py,
    Triton 3.8: e.g. a 64-head bf16 tile needs 115 KB where 99 KB parts offer 99)."""
    small_smem = arch.backend == "cuda" and arch.smem_bytes < SMEM_LARGE_CLASS
    if dtype == torch.float32:
        if small_smem:
            return 16
        return 64 if arch.smem_bytes >= SMEM_227KB_CLASS else 32
    if small_smem and kv_format not in SCALED_CHUNK_FORMATS:
        return 32
    if kv_format == "fp8_ds_mla_v4" and arch.backend == "hip":
        # gfx942 (Triton 3.8's AMDGCN): the 64-head tile spills 601 VGPRs (1,776 B of scratch),
        # the 32-head tile 169-190 (680 B); 16 heads compile without spills (393 of 512
        # registers). A static bound (docs/perf-log/14-v4-tiles-sass.txt), not timed.
        return 16
    if kv_format == "fp8_ds_mla_v4" and arch.backend == "cuda" and int(arch.cc) not in V4_H64_CCS:
        # Eight 64-wide accumulators and seven q chunks: at 64 heads ptxas spills 20-40 KB per
        # thread on sm80/86/89/120 (benchmarks/codegen/sass_stats.py, Triton 3.8; sm90 368 B,
        # sm100 56 B). 32-head tiles compile without spills on sm80 (staged), 16-head tiles on
        # the 99 KB parts (24-32 B). A static bound, not yet timed on a GPU.
        return 16 if small_smem else 32
    return 64


def block_h_for(num_heads: int, limit: int = 64) -> int:
    """Heads per program: all of a token's heads up to ``limit`` (MMA tiles need M >= 16)."""
    for block_h in (16, 32, 64):
        if num_heads <= block_h or block_h >= limit:
            return block_h
    return 64


def tile_config(
    block_h: int, dtype: torch.dtype, kv_format: str, arch: Arch, programs: int | None = None
) -> KernelConfig:
    """Block sizes, warps and pipeline depth for one head-block size on one architecture.

    ``programs`` (tokens x head blocks) lets latency-bound calls take shorter gather steps, so
    that their top-k spreads over more programs.
    """
    wide = dtype == torch.float32
    warps = 8 if block_h >= 64 else 4
    if arch.backend == "hip":
        return KernelConfig(block_h, 16 if wide else 32, warps, 1)
    big_smem = arch.smem_bytes >= SMEM_LARGE_CLASS
    if wide:
        return KernelConfig(block_h, 32 if big_smem else 16, warps, 1)
    if folds_v4_scales(dtype, kv_format, arch) and block_h >= 64:
        # H200, DeepSeek-V4 decode, 64 heads (Triton 3.8, PERFORMANCE.md log 26): folded 64-row
        # steps over two stages 52 / 83 us at 64 / 128 tokens against 67 / 111 in 32-row steps
        # (one stage 56 / 86).
        return KernelConfig(block_h, 64, warps, 2, stage_dequant=True)
    if folds_ds_mla_fp16(dtype, kv_format, arch) and block_h >= 64:
        # H200, fp8_ds_mla decode (Triton 3.8, PERFORMANCE.md log 29): fp16 MMAs with folded
        # scales in 64-row two-stage steps 211 / 416 us at 128 tokens x 64 / 128 heads against
        # 320 / 635 for exact fp16 operands in 32-row steps; 38.5 against 53.5 us at 16 x 64,
        # 15.6 against 17.3 at 1 x 128; prefill 4096 x 64 6.6 against 10.3 ms. Indices a step
        # ahead in 32-row steps (gathers in flight during compute) were 1.3x slower under 3.8
        # and 9-20% faster under 3.6, where this tile spills (log 30).
        return KernelConfig(block_h, 64, warps, 2, stage_dequant=True, fp16_fold=True)
    if kv_format in SCALED_CHUNK_FORMATS:
        # fp8_ds_mla_v4 otherwise takes fp8_ds_mla's tiles.
        # H200, 128 tokens x 16 heads: staged 32-row tiles 160 us, hoisted 174 us, 64-row tiles
        # 207-290 us. Staging needs ~105 KB of shared memory, so 99 KB parts keep the hoisted form.
        return KernelConfig(block_h, 32, warps, 2 if big_smem else 1, stage_dequant=big_smem)
    if not big_smem:
        # 99 KB parts (sm86/89/120): a 32-row bf16 tile is 36 KB; two stages fit with room.
        return KernelConfig(block_h, 32, warps, 2)
    if block_h >= 64:
        if arch.backend == "cuda" and int(arch.cc) >= 100 and kv_format == "auto":
            # sm100 lays this tile out with ~353 KB at 64 rows; 32 rows need 214 KB (compile test)
            return KernelConfig(block_h, 32, warps, 2)
        # H200: 64 rows x 3 stages (221 KB, two gather buffers) measured best for 64-head MMA
        # tiles; loading indices a step ahead makes these tiles spill (PERFORMANCE.md, log 5)
        return KernelConfig(block_h, 64, warps, 3 if arch.smem_bytes >= SMEM_227KB_CLASS else 2)
    small = programs is not None and programs < arch.num_sms // 16
    decode = programs is not None and programs <= 2 * arch.num_sms
    if decode and not small and kv_format == "auto" and arch.smem_bytes >= SMEM_227KB_CLASS:
        # H200, 128 tokens x 16 heads: 32-row steps with indices a step ahead and two gather
        # buffers (91 KB, two programs per SM) 92 us; one buffer of 64 rows 98-100 us. A
        # per-tensor fp8 cache measured the other way round (125 vs 110 us).
        return KernelConfig(block_h, 32, warps, 3, idx_ahead=True)
    return KernelConfig(block_h, 32 if small else 64, warps, 2)


def e4m3_decode_for(
    num_tokens: int,
    block_h: int,
    kv_format: str,
    arch: Arch,
    *,
    stage_dequant: bool,
    fp8_native: bool,
    on_gpu: bool,
) -> str:
    """The integer e4m3 decode's form for one call (KernelConfig.e4m3_decode left None).

    sm80's fp8_ds_mla path (timed as its PTX on an H200, Triton 3.8, PERFORMANCE.md log 20):
    the packed decode without the staging mask at <= 16 tokens and in 64-head tiles (8-17%
    faster than "scalar" at 1-16 tokens, 6% at 64 x 64, within 1% at 64-128 x 128), the masked
    packed decode in smaller head blocks from 64 tokens on (1.5-3% faster; the unmasked one
    is 2-4% slower there). "scalar" everywhere else: the interpreter and AMD cannot run the
    inline PTX, hardware fp8 needs no integer decode, and no other target or format was timed.
    """
    if (
        not on_gpu
        or fp8_native
        or arch.backend != "cuda"
        or int(arch.cc) not in PACKED_DECODE_CCS
        or kv_format != "fp8_ds_mla"
    ):
        return E4M3_DECODE_DEFAULT
    if stage_dequant and (block_h >= 64 or num_tokens <= SHORT_DECODE_TOKENS):
        return "packed-nomask"
    return "packed"


def num_splits_for(
    programs: int,
    width: int,
    block_n: int,
    num_sms: int,
    block_h: int = 16,
    *,
    long_splits: bool = False,
) -> int:
    """Split the top-k only while (tokens x head blocks) cannot fill the GPU.

    Memory-bound head blocks (<= 32 heads) aim at two programs per SM, MMA-bound 64-head blocks
    at one; rounding to the nearest count measured better than rounding up (H200: 128 tokens x
    16 heads, 2 splits 98 us, 3 splits 127 us). Splits of a single step become half as many
    two-step ones where those still give nearly every SM a program (SHORT_SPLIT_FILL); with
    ``long_splits`` (long_splits_pay), two-step splits become four-step ones on the same
    condition.
    """
    target = (2 if block_h <= 32 else 1) * num_sms
    steps = -(-width // block_n)
    splits = max(1, min(round(target / programs), steps))
    # splits of at most one step (two with long_splits) halve once; halving again would need
    # far more programs than a count that short implies, so one halving is all that can apply
    halves_up_to = (2 if long_splits else 1) * block_n
    per, count = split_len_for(width, splits, block_n)
    if per <= halves_up_to and count >= 2 and programs * (count // 2) >= SHORT_SPLIT_FILL * num_sms:
        splits = count // 2
    return splits


def long_splits_pay(dtype: torch.dtype, kv_format: str, num_heads: int, block_h: int) -> bool:
    """Whether two-step splits should become four-step ones (num_splits_for's
    ``long_splits``): q in 16 bits (the kernels timed; fp32 q runs other tiles) and a program
    holding min(num_heads, block_h) heads, at least LONG_SPLIT_MIN_HEADS[kv_format]."""
    least = LONG_SPLIT_MIN_HEADS.get(kv_format)
    return (
        dtype in (torch.bfloat16, torch.float16)
        and least is not None
        and min(num_heads, block_h) >= least
    )


def choose_config(
    num_tokens: int,
    num_heads: int,
    width: int,
    dtype: torch.dtype,
    kv_format: str,
    arch: Arch,
    *,
    block_table: bool = False,
    extra_set: bool = False,
    gluon: bool = True,
) -> KernelConfig:
    """The launch configuration of one call; ``block_table``: the call maps indices through a
    block table (then the gather loop loads each step's indices in the step, never ahead);
    ``extra_set``: a second index set joins the softmax (``width`` counts both); ``gluon``
    False where the call cannot run a Gluon kernel (the interpreter, a cache whose address or
    strides are not 16-byte multiples)."""
    limit = max_block_h(dtype, kv_format, arch)
    if (
        _wgmma(arch)
        and folds_v4_scales(dtype, kv_format, arch)
        and num_tokens < SHORT_DECODE_TOKENS
    ):
        # H200, DeepSeek-V4 decode, 1 token x 64 heads: 16-head blocks 8.1 us, 32-head 9.7,
        # 64-head 13.7 (more programs share the gather); at 16 tokens the 64-head tile in
        # 64-row steps is within 5% of the best (24.8 us against 23.6 for 32-head blocks).
        # sm80's code keeps 32-head blocks: 16-head ones were 15% faster at 1 token but 40%
        # slower at 16 (9.3 / 34.6 against 10.9 / 24.7 us), and nothing between was timed.
        limit = min(limit, 16)
    block_h = block_h_for(num_heads, limit)
    num_hb = -(-num_heads // block_h)
    programs = num_tokens * num_hb
    base = tile_config(block_h, dtype, kv_format, arch, programs)
    splits = num_splits_for(
        programs,
        width,
        base.block_n,
        arch.num_sms,
        block_h,
        long_splits=long_splits_pay(dtype, kv_format, num_heads, block_h),
    )
    cfg = dataclasses.replace(base, num_splits=splits)
    if block_table and cfg.idx_ahead:
        # the same tiles and stages with the in-step loop (what block-table calls have run)
        cfg = dataclasses.replace(cfg, idx_ahead=False)
    if gluon:
        # the Gluon kernels with tiles of their own, where they were timed faster
        call = dict(
            num_tokens=num_tokens,
            num_heads=num_heads,
            width=width,
            block_table=block_table,
            extra_set=extra_set,
        )
        for own_tile in (rows_ws_config, ampere_gluon_config):
            own = own_tile(dtype, kv_format, arch, **call)
            if own is not None and gluon_available():
                return own
    form = gluon_form_for(
        cfg,
        dtype,
        kv_format,
        arch,
        num_tokens=num_tokens,
        block_table=block_table,
        extra_set=extra_set,
    )
    if gluon and form is not None and gluon_available():
        # the Gluon kernels' rings are their own pipeline (one stage in the config's terms)
        cfg = dataclasses.replace(cfg, gluon=form, num_stages=1, idx_ahead=False)
    return cfg


def gluon_form_for(
    cfg: KernelConfig,
    dtype: torch.dtype,
    kv_format: str,
    arch: Arch,
    *,
    num_tokens: int,
    block_table: bool,
    extra_set: bool,
) -> str | None:
    """The Gluon kernel (KernelConfig.gluon) that runs a call the Triton kernel would run in
    ``cfg``, or None, on sm90 with bf16 q in a 64 x 64 tile of eight warps, where it was timed
    on the H200 faster than the Triton kernel (docs/perf-log/27-gluon-h200.txt and
    28-gluon-h200.txt, every row checked against float64 first):

    - fp8_ds_mla with the fp16 fold, no block table, no extra set: under Triton 3.8
      "pipelined", 181.6 against 210.4 us at 128 tokens x 64 heads, 356.5 / 413.8 at 128 x
      128, 98.7 / 118.4 at 64 x 64, 32.6 / 38.4 at 16 x 64, prefill 4096 x 64 5.7 / 6.5 ms
      (its warp-specialized form: 200.6 / 386.3 us at 128 tokens). Under Triton 3.6 the
      warp-specialized form is the faster one, 190.0 against 226.2 us (pipelined) and 286.5
      (Triton) at 128 x 64, 366.5 / 444.8 / 549.4 at 128 x 128, 110.1 / 128.1 / 156.3 at 64 x
      64, 39.2 / 39.4 / 50.4 at 16 x 64, 60.2 / 66.9 / 84.6 at 16 x 128, prefill 4096 x 64
      5.76 / 7.09 / 8.95 ms; below 16 tokens the pipelined form stays (1 token: 14.5 against
      15.4 us at 64 heads, 15.8 / 16.9 at 128; docs/perf-log/29-gluon-h200-t36.txt). Triton
      releases before 3.8 take that choice; 3.7 was not timed.
      With the gathers' rows addressed in each tile's layout and the e4m3 x ratio product in
      fp16 (docs/perf-log/33-gluon-defaults-h200.txt) the two forms are within 2% of each
      other under both Tritons (3.8: pipelined 156.2 against 159.0 us at 128 x 64, 304.7 /
      300.8 at 128 x 128, 86.7 / 87.5 at 64 x 64; 3.6: 170.9 / 170.6, 330.0 / 328.6, 97.4 /
      99.5; the Triton tile 206.7 / 285.5 at 128 x 64), so the choice above stands.
    - the V4 record (bf16 fold), both sets and block tables: "specialized", 63.1 against 82.9
      us at 128 tokens x 64 heads, 43.2 / 51.6 at 64, 18.9 / 24.2 at 16 under 3.8 (its
      pipelined kernel: 85.7 / 51.0 / 21.5); 67.1 / 85.3 at 128 under 3.6 (entry 31's code);
      with one layout for the record's tiles 56.9 against 71.0 (pipelined) and 82.9 (Triton)
      at 128 tokens under 3.8, 54.6 / 78.8 / 86.3 under 3.6.
      The V4 kernel's MMA warps deriving each row's validity themselves (no mask through
      shared memory): 52.4 / 37.5 / 17.8 us at 128 / 64 / 16 tokens under 3.8 against 56.3 /
      39.4 / 17.7 with the mask, 1.21x FlashMLA's 43.2 at 128 in the same run; 54.6 / 38.5 /
      18.1 under 3.6 (docs/perf-log/36-v4-ws-validity-h200.txt).
    - rows in q's dtype (kv_format "auto"), no block table or extra set, 64-128 tokens (the
      counts timed, GLUON_TIMED_TOKENS): "pipelined", under 3.8 127.2 against 167.2 us at 128
      tokens x 64 heads, 245.6 / 324.1 at 128 x 128, 74.5 / 99.5 at 64 x 64, 125.4 / 165.0 at
      64 x 128; under 3.6 132.1 / 176.1, 260.2 / 332.7, 74.9 / 105.5, 133.4 / 170.4.

    compute-sanitizer memcheck, racecheck and synccheck reported nothing on the fp8_ds_mla and
    V4 kernels under 3.8 (docs/perf-log/28-sanitize-h200.txt, the code before the per-tile
    row layouts); on the code since, memcheck nothing and racecheck only Triton's
    warp-specialize hand-off (docs/perf-log/35-gpu-check-h200.txt, 36-v4-ws-validity-h200.txt).
    racecheck's reports on that hand-off are the tool's:
    benchmarks/reliability/ws_racecheck_probe.py draws them from a minimal kernel whose
    flagged accesses sit on either side of a matched whole-block barrier (docs/RELIABILITY.md).
    """
    if not (
        _wgmma(arch)
        and dtype == torch.bfloat16
        and (cfg.block_h, cfg.block_n, cfg.num_warps) == (64, 64, 8)
    ):
        return None
    if kv_format == "fp8_ds_mla" and cfg.fp16_fold and not (block_table or extra_set):
        if triton_version() >= PIPELINED_DS_MLA_TRITON or num_tokens < SHORT_DECODE_TOKENS:
            return "pipelined"
        return "specialized"
    if kv_format == "fp8_ds_mla_v4" and folds_v4_scales(dtype, kv_format, arch):
        return "specialized"
    timed = GLUON_TIMED_TOKENS[0] <= num_tokens <= GLUON_TIMED_TOKENS[1]
    if kv_format == "auto" and timed and not (block_table or extra_set):
        return "pipelined"
    return None


def rows_ws_config(
    dtype: torch.dtype,
    kv_format: str,
    arch: Arch,
    *,
    num_tokens: int,
    num_heads: int,
    width: int,
    block_table: bool,
    extra_set: bool,
) -> KernelConfig | None:
    """The warp-specialized wgmma kernel for rows in q's dtype (KernelConfig(gluon=
    "specialized"), two warpgroups on alternate 64-row steps) where it was timed faster than the
    heuristics' other choice, else None: sm90, bf16 q and rows, no block table or extra set, at
    64-128 tokens 8 heads or more in its 64-head tile (fewer than 64 padded, as vLLM pads them
    for FlashMLA), past 128 tokens (prefill) 64 heads or more. Prefill on an H100
    (docs/perf-log/59-targets-and-prefill-h100.txt), against the Triton tile: 3047 / 5303 us
    at 4096 tokens x 64 heads, 5353 / 10042 at 4096 x 128, 848 / 1471 at 1024 x 64 under
    Triton 3.8; 2974 / 5452, 5245 / 10041, 841 / 1488 under 3.6. Decode under Triton 3.8 on
    the H200 (docs/perf-log/53-ws-rows-h200.txt, every row checked against float64 first),
    against the pipelined wgmma kernel at 64-128 heads: 179.7 / 245.1 us at 128 tokens x 128
    heads, 99.3 / 126.2 at 128 x 64, 91.4 / 126.5 at 64 x 128, 59.7 / 73.7 at 64 x 64; against
    the Triton tile at 8-16 heads: 87.1 / 94.2 at 128 x 16, 85.8 / 93.0 at 128 x 8, 50.0 / 53.1
    at 64 x 16, 47.9 / 51.0 at 64 x 8. Under Triton 3.6 on an H100
    (docs/perf-log/58-gpu-check-and-schedules-h100.txt): 174.0 / 259.2 at 128 x 128, 106.0 /
    137.5 at 128 x 64, 88.9 / 133.1 at 64 x 128, 69.5 / 81.1 at 64 x 64; 95.5 / 102.2 at 128 x
    16, 94.3 / 97.4 at 128 x 8, 57.8 / 59.2 at 64 x 16, 56.1 / 55.8 at 64 x 8 (level). One
    program per head block and token is the split count a multiprocessor's worth of the grid
    calls for (twice it was 3-11% slower at 8-16 heads)."""
    decode = GLUON_TIMED_TOKENS[0] <= num_tokens <= GLUON_TIMED_TOKENS[1]
    prefill = num_tokens > GLUON_TIMED_TOKENS[1] and num_heads >= LATENT_GLUON_WS_PREFILL_MIN_HEADS
    if not (
        _wgmma(arch)
        and dtype == torch.bfloat16
        and kv_format == "auto"
        and (decode or prefill)
        and num_heads >= LATENT_GLUON_WS_MIN_HEADS
        and not (block_table or extra_set)
    ):
        return None
    tile = LATENT_GLUON_WS_TILE
    programs = num_tokens * -(-num_heads // tile)
    splits = num_splits_for(programs, width, tile, arch.num_sms, tile)
    return KernelConfig(
        tile, tile, LATENT_GLUON_WS_WARPS, 1, num_splits=splits, gluon="specialized"
    )


def ampere_gluon_config(
    dtype: torch.dtype,
    kv_format: str,
    arch: Arch,
    *,
    num_tokens: int,
    num_heads: int,
    width: int,
    block_table: bool,
    extra_set: bool,
) -> KernelConfig | None:
    """The mma.sync Gluon kernel's configuration (KernelConfig.gluon="ampere") for a call, or
    None: bf16 q, no block table or extra set, decode of 1-128 tokens (AMPERE_GLUON_TOKENS), on
    the paths where it was timed faster than the Triton kernel (sm80 and sm89 by PTX JIT; sm90
    at 16 heads or fewer), fp8_ds_mla prefill from 16 heads on sm80 and sm89
    (AMPERE_GLUON_DS_PREFILL_CCS, AMPERE_GLUON_DS_PREFILL_MIN_HEADS), and rows in q's dtype at
    prefill from 64 heads on sm80 (AMPERE_GLUON_ROWS_WIDE_*).

    Timed on an H200 as sm80's and sm89's code by PTX JIT, Triton 3.8 (`tune.py --only ampere
    --arch sm80|sm89 --tokens 128,64,16,1`, docs/perf-log/35-ampere-ring-h200.txt; every row
    checked against float64 first), us, the chosen tile against the Triton kernel's default:

    - fp8_ds_mla, one slot of raw rows, the largest tile of 16 / 32 / 64 heads the call's heads
      and the target's shared memory hold (sm80: 64, sm89: 32 in 94.8 KB), half of it below 16
      tokens (split-K already fills the GPU there; the shorter programs won):
      sm80 128 x 16 125.7 against 164.2 (139.0 with two slots), 128 x 64 264.6 / 581.3,
      128 x 128 516.6 / 1129.6, 64 x 16 87.9 / 113.9, 64 x 64 147.7 / 295.6, 64 x 128 259.9 /
      569.7, 16 x 16 25.0 / 28.1, 16 x 64 51.2 / 96.3, 16 x 128 98.7 / 197.5, 1 x 16 8.3 /
      9.2, 1 x 64 (32 heads) 11.8 / 17.5, 1 x 128 (32 heads) 14.4 / 24.5; sm89 128 x 16
      120.8 / 177.1, 128 x 64 268.8 / 642.2 (455.3 in the 16-head tile with two slots, the
      previous default), 128 x 128 524.3 / 1244.3, 64 x 16 64.3 / 94.2, 64 x 64 142.4 /
      344.6, 64 x 128 266.1 / 624.8, 16 x 16 20.4 / 22.9, 16 x 64 44.0 / 97.8, 16 x 128 75.6 /
      176.2, 1 x 16 8.0 / 8.3, 1 x 64 (16 heads) 11.6 / 19.4, 1 x 128 (16 heads) 14.2 / 22.3.
    - rows in q's dtype on sm89 with 16 heads or fewer, two slots: 98.0 against 111.7 at 128
      tokens, 53.6 / 63.0 at 64, 18.4 / 20.9 at 16, 7.2 / 8.1 at 1. Elsewhere the rows' kernel
      was within 5% of the Triton kernel or slower at 64-128 tokens, so the Triton kernel stays,
      except:
    - rows in q's dtype on sm80 with 16 heads or fewer, the same tile, up to SHORT_DECODE_TOKENS
      tokens (PERFORMANCE.md log entry 68; on an H100, Triton 3.8, `compare_trees.py`, main
      against this choice, 8 / 16 heads): 6.3 / 7.1 against 7.2 / 8.2 at 1 token, 19.4 / 21.0
      against 20.5 / 22.9 at 16; at 64 tokens it ran 65.4 / 66.9 against 63.4 / 65.4 and at
      128 96.0 / 99.0 against 98.2 / 102.5, so from 17 tokens on the Triton kernel stays.
    - rows in q's dtype on sm80 at 64 heads or more and 16-128 decode tokens, the 64-head tile
      with two slots, since its step has 4 CTA barriers instead of 9 (PERFORMANCE.md entry 65;
      on an H100, Triton 3.8, `compare_trees.py`, main against this choice): 43.8 against
      51.7 at 16 x 64, 117.1 / 132.5 at 64 x 64, 203.8 / 236.9 at 128 x 64, 80.6 / 90.4 at
      16 x 128, 204.7 / 224.1 at 64 x 128, 403.2 / 437.8 at 128 x 128. On the sm89 path the
      same kernel in its 32 x 16 tile ran 1.03-1.24x the Triton kernel's time there.

    - fp8_ds_mla prefill, the same tiles (one slot; sm80 64 heads, sm89 32), 64 heads, on an
      H100 (`tune.py --only ampere --arch sm80|sm89 --tokens 4096,1024`,
      docs/perf-log/60-ampere-ds-prefill-h100.txt): sm80 4096 tokens 8394 against the Triton
      kernel's 17080 (two slots: 8199), 1024 tokens 2298 / 4678 (two slots: 2184); sm89 4096
      tokens 8407 / 18922, 1024 tokens 2278 / 5122; at 4096 x 128 heads (more programs of the
      same tiles; `compare_trees.py`, main against this choice) sm80 15942 / 33228, sm89 16069 /
      36441. At 16 and 32 heads (the 16-head tile with QK^T split over the latent, and the
      32-head tile; `compare_trees.py`, main against this choice, under Triton 3.8 / 3.6,
      docs/perf-log/61-ampere-ds-prefill-heads-h100.txt): 4096 x 16 sm80 3468 / 3660 against
      4797 / 5227, sm89 3114 / 3445 against 5222 / 5398; 4096 x 32 sm80 4554 / 4969 against
      8131 / 8437, sm89 4589 / 4805 against 8446 / 7693 (0.54-0.72x). Fewer heads were not timed
      at prefill and keep the Triton kernel. Two ring slots at prefill (sm80's 64-head tile fits
      them) ran 1.02-1.03x one slot's time under 3.8 and 1.09-1.16x under 3.6 at 4096 x 64 / 128,
      so prefill keeps the decode ring. The 64- and 128-head tiles were timed against the Triton
      kernel under Triton 3.8 only (checked against float64 under 3.6 too).
    - rows in q's dtype at prefill on sm80 from 64 heads, the decode tile (64 heads, two
      slots; PERFORMANCE.md log entry 70; on an H100, Triton 3.8, `compare_trees.py`, main
      against this choice): 6487 against the Triton kernel's 6967 at 4096 x 64, 12579 / 13445
      at 4096 x 128 (0.93x). It had been within 1% of the Triton kernel there before entry 65
      cut its step's barriers. On sm89 the Triton kernel was the fastest at prefill and stays.

    sm90 natively, Triton 3.8, the previous defaults' tree against this one in one run
    (`benchmarks/perf/compare_trees.py`, docs/perf-log/39-sm90-mma-sync-h200.txt), at 16 heads
    or fewer (AMPERE_GLUON_NARROW_HEADS) in the 16-head tile:

    - fp8_ds_mla, one slot, 1-128 tokens, 8 / 16 heads: 119.2 / 121.3 against the Triton
      kernel's 158.5 / 161.0 at 128 tokens, 62.8 / 64.9 against 83.8 / 86.5 at 64, 19.3 / 20.4
      against 24.8 / 27.3 at 16, 9.9 / 10.8 against 11.3 / 14.1 at 4, 7.6 / 8.3 against 8.2 /
      8.6 at 1 (under Triton 3.6 the same direction: 0.76-0.78x the Triton kernel's time at
      16-128 tokens, 0.92-0.93x at 1).
    - rows in q's dtype, two slots, up to SHORT_DECODE_TOKENS tokens: 17.1 / 18.6 against 18.3 /
      20.7 at 16 tokens, 8.9 / 10.9 against 9.5 / 11.1 at 4, 6.3 / 7.3 against 6.8 / 7.6 at 1
      (under 3.6 within 2% either way). At 64-128 tokens the Triton kernel stayed the fastest
      in `tune.py --only ampere` (52.9 / 94.2 us at 16 heads), and above 16 heads sm90's own
      kernels did.

    sm86 and sm120 (the sm80 and sm89 instruction sets with 99 KB), sm90's prefill and fp16 q
    were not timed and keep the Triton kernel. Under Triton 3.6 only fp8_ds_mla's two-slot
    kernel was timed on the sm80 / sm89 paths, faster than the Triton kernel at 64-128 tokens as
    under 3.8 (docs/perf-log/33-gluon-defaults-h200.txt).
    """
    if arch.backend != "cuda":
        return None
    cc = int(arch.cc)
    narrow = cc in AMPERE_GLUON_NARROW_CCS
    ds_mla = kv_format == "fp8_ds_mla"
    rows_wide = (
        kv_format == "auto"
        and cc in AMPERE_GLUON_ROWS_WIDE_CCS
        and num_heads >= AMPERE_GLUON_ROWS_WIDE_HEADS
        and num_tokens >= AMPERE_GLUON_ROWS_WIDE_MIN_TOKENS
    )
    timed_tokens = (
        AMPERE_GLUON_TOKENS[0] <= num_tokens <= AMPERE_GLUON_TOKENS[1]
        or rows_wide
        or (
            ds_mla
            and cc in AMPERE_GLUON_DS_PREFILL_CCS
            and num_tokens > AMPERE_GLUON_TOKENS[1]
            and num_heads >= AMPERE_GLUON_DS_PREFILL_MIN_HEADS
        )
    )
    if not (
        (cc in AMPERE_GLUON_CCS or narrow)
        and dtype == torch.bfloat16
        and timed_tokens
        and not (block_table or extra_set)
    ):
        return None
    if narrow:
        if num_heads > AMPERE_GLUON_NARROW_HEADS:
            return None
        if ds_mla:
            ring = AMPERE_GLUON_DS_RING
        elif kv_format == "auto" and num_tokens <= SHORT_DECODE_TOKENS:
            ring = AMPERE_GLUON_RING
        else:
            return None
        block_h = AMPERE_GLUON_NARROW_HEADS
    elif ds_mla:
        ring = AMPERE_GLUON_DS_RING
        block_h = 16
        for wider in (32, 64):
            if (
                block_h < num_heads
                and ampere_gluon_smem(wider, AMPERE_GLUON_BLOCK_N, ring, kv_format)
                <= arch.smem_bytes
            ):
                block_h = wider
        if num_tokens < SHORT_DECODE_TOKENS:
            block_h = max(16, block_h // 2)
    elif (
        kv_format == "auto"
        and num_heads <= AMPERE_GLUON_NARROW_HEADS
        and (
            cc in AMPERE_GLUON_ROWS_NARROW_CCS
            or (cc in AMPERE_GLUON_ROWS_SHORT_CCS and num_tokens <= SHORT_DECODE_TOKENS)
        )
    ):
        ring, block_h = AMPERE_GLUON_RING, AMPERE_GLUON_NARROW_HEADS
    elif rows_wide:
        ring, block_h = AMPERE_GLUON_RING, AMPERE_GLUON_ROWS_WIDE_HEADS
    else:
        return None
    programs = num_tokens * -(-num_heads // block_h)
    splits = num_splits_for(
        programs,
        width,
        AMPERE_GLUON_BLOCK_N,
        arch.num_sms,
        block_h,
        long_splits=long_splits_pay(dtype, kv_format, num_heads, block_h),
    )
    num_warps = ampere_gluon_warps(block_h)
    per_split = split_len_for(width, splits, AMPERE_GLUON_BLOCK_N)[0]
    return KernelConfig(
        block_h,
        AMPERE_GLUON_BLOCK_N,
        num_warps,
        ring,
        num_splits=splits,
        stage_dequant=ds_mla,
        fp16_fold=ds_mla,
        gluon="ampere",
        split_qk=splits_qk(block_h, num_warps)
        and per_split
        >= (AMPERE_GLUON_SPLIT_QK_STEPS if ds_mla else ROWS_SPLIT_QK_STEPS) * AMPERE_GLUON_BLOCK_N,
    )


def splits_qk(block_h: int, num_warps: int) -> bool:
    """Whether the mma.sync kernels can split QK^T over the latent in this tile
    (KernelConfig.split_qk): 16 heads in four warps, one a latent chunk."""
    return block_h == 16 and num_warps == SPLIT_QK_WARPS


def ampere_gluon_warps(block_h: int) -> int:
    """The warps of a mma.sync Gluon program of ``block_h`` heads (KernelConfig.num_warps)."""
    return 8 if block_h >= 64 else 4


def ampere_gluon_smem(
    block_h: int,
    block_n: int,
    ring: int,
    kv_format: str = "fp8_ds_mla",
    q_rope_in_registers: bool = False,
    split_qk: bool = False,
    num_warps: int | None = None,
) -> int:
    """Bytes of shared memory a mma.sync Gluon kernel (kernels/ampere_gluon.py) takes in a tile
    of ``block_h`` heads and ``block_n`` rows with ``ring`` slots of gathered rows
    (KernelConfig.num_stages) in ``num_warps`` warps (default: ampere_gluon_warps). Both
    formats keep two slots of the rows' validity. fp8_ds_mla: the raw rows with their four fp32
    scales per slot, two slots of RoPE values and the fp16 K tile; rows in q's dtype (kv_format
    "auto"): the rows the MMAs read where they land. Then either q (fp8_ds_mla's in fp16) with
    its RoPE part and a scratch (16-head tiles exchange S between the warps in fp32, wider ones
    whose warps do not split S's columns convert P's layout in 16 bits; tiles whose warps
    split S's columns hold P in a 16-bit tile of its own and exchange each row's max in fp32,
    and for rows in q's dtype in AMPERE_PV_COLS_WARPS warps pass the rows' rescale factors to
    PV in fp32)
    or, with ``split_qk`` (KernelConfig.split_qk: q in registers), the four partial S tiles in
    fp32. tests/test_gluon_ampere.py checks it against the compiler's figure under Triton 3.6
    and 3.8. ``q_rope_in_registers``: q's RoPE part is not in shared memory
    (KernelConfig.q_rope_in_registers)."""
    latent, rope, scale_bytes = 512, 64, 4 * 4
    q = block_h * (latent + (0 if q_rope_in_registers else rope)) * 2
    validity = 2 * block_n
    if kv_format == "auto":
        rows = ring * block_n * (latent + rope) * 2
    else:
        raw = ring * block_n * (latent + scale_bytes) + 2 * block_n * rope * 2
        rows = raw + block_n * latent * 2  # and the K tile
    if split_qk:
        return rows + SPLIT_QK_WARPS * block_h * block_n * 4 + validity
    # the kernel's MMA layout: warps over the 16-row head groups first, the rest over S's
    # columns
    warps = ampere_gluon_warps(block_h) if num_warps is None else num_warps
    warps_m = min(warps, block_h // 16)
    warps_n = warps // warps_m
    if warps_m > 1 and warps_n > 1:
        p_tile, row_max_scratch = block_h * block_n * 2, block_h * warps_n * 4
        # rows in eight warps: and the rows' rescale factors on their way into PV's layout
        # (its warps over O's columns)
        alpha = block_h * 4 if kv_format == "auto" and warps >= AMPERE_PV_COLS_WARPS else 0
        return q + rows + validity + p_tile + row_max_scratch + alpha
    scratch = block_h * block_n * (4 if block_h == 16 and kv_format != "auto" else 2)
    return q + rows + validity + scratch


def _wgmma(arch: Arch) -> bool:
    """sm90, whose MMAs are warpgroup MMAs (wgmma)."""
    return arch.backend == "cuda" and int(arch.cc) == 90


def folds_v4_scales(dtype: torch.dtype, kv_format: str, arch: Arch) -> bool:
    """Whether the V4 record runs bf16 MMAs with its scales folded into the tile (exact: a
    power of two times an e4m3 value is a bf16 value), so that QK^T is one chain of dots. With
    bf16 q on the targets where it was timed (DeepSeek-V4 decode at 64 heads): sm90 on the
    H200, 1.4-1.9x faster than fp16 MMAs in fp8_ds_mla's tiles at 1-128 tokens with the tiles
    choose_config gives it (PERFORMANCE.md log 26); sm80's and sm89's code by PTX JIT on the
    H200 (log 29), in their own tiles, 1.05-1.2x (sm80, 1-64 tokens) and 1.15-1.6x (sm89,
    1-128 tokens) faster than fp16 MMAs and than fp16 MMAs with folded scales. P then enters
    the PV MMAs in bf16 rather than fp16, as FlashMLA's does: the output's error against
    float64 goes from ~1e-3 to ~2e-3, a bf16 output's own rounding. sm86, sm100, sm120 and AMD
    were not timed and keep fp16 MMAs."""
    folding = arch.backend == "cuda" and int(arch.cc) in V4_FOLD_CCS
    return folding and kv_format == "fp8_ds_mla_v4" and dtype == torch.bfloat16


def folds_ds_mla_fp16(dtype: torch.dtype, kv_format: str, arch: Arch) -> bool:
    """Whether fp8_ds_mla in 64-head tiles runs fp16 MMAs with its scales folded into the tile
    relative to each step's largest (KernelConfig.fp16_fold) in 64-row two-stage steps: sm90
    with bf16 q, where it was timed 1.1-1.6x faster than exact fp16 operands (PERFORMANCE.md
    log 29). One fp16 rounding of each dequantized value: the output's error against float64
    ~9e-4 instead of ~7e-4 (the bf16 fold's ~2.8e-3 put the contract tests' LSE past 0.01)."""
    return _wgmma(arch) and kv_format == "fp8_ds_mla" and dtype == torch.bfloat16


def fp16_mma_for(dtype: torch.dtype, kv_format: str, arch: Arch, block_h: int) -> bool:
    """Whether an e4m3 cache runs its MMAs in fp16 rather than in q's dtype.

    Not for the V4 record where its scales fold (folds_v4_scales). fp8_ds_mla keeps fp16 MMAs:
    folding its fp32 scales rounds every dequantized value to bf16 (as FlashMLA does), which was
    faster on the H200 (128 tokens x 64 heads: 263 us, 195 in 64-row steps, against 322) but
    put the LSE 0.010-0.017 from float64 in 14 of the contract tests (8-128 heads), where the
    fp16 MMAs stay within their 0.01 (docs/perf-log/20-gpu-check-fold-trial-h200.txt); its
    64-head tiles on sm90 fold the scales into fp16 operands instead (folds_ds_mla_fp16).
    Otherwise fp16 everywhere except per-tensor fp8 with bf16 q in 64-head tiles on sm90: there
    the bf16 -> fp16 conversion makes Triton hold q as a register-sourced wgmma operand ([64,
    512] fp16 in registers), ptxas serialises the wgmmas and spills, and that variant returned
    non-finite partials for heads 16-63 under compute-sanitizer memcheck (docs/RELIABILITY.md).
    bf16 MMAs keep q in shared memory and measured faster there too (H200: 128 tokens x 64 /
    128 heads 266 -> 209 / 521 -> 407 us); 16-head tiles stay fp16 (bf16 MMAs 3-13% slower).
    """
    if folds_v4_scales(dtype, kv_format, arch):
        return False
    return not (_wgmma(arch) and kv_format == "fp8" and dtype == torch.bfloat16 and block_h >= 64)


def split_len_for(width: int, num_splits: int, block_n: int) -> tuple[int, int]:
    """Indices per split (a multiple of block_n) and the split count that covers ``width``."""
    per = -(-width // num_splits)
    per = -(-per // block_n) * block_n
    return per, -(-width // per)
