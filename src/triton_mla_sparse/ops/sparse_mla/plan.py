"""The launch plan: every decision of one sparse_mla call, made before anything is allocated.

``make_plan`` turns a call's shapes, dtype, format and target into a :class:`LaunchPlan`: the
kernel family, the resolved :class:`KernelConfig` (every ``None`` field decided), the split
count, the grids and each kernel's constexprs. ``launch.launch_sparse_mla`` only executes a plan;
the interface only validates inputs and asks for one. Pure Python on shapes: no tensors, no GPU,
so a plan can be built and inspected anywhere (tests, bench, doctor).
"""

from __future__ import annotations

import dataclasses
from typing import Any

import torch

from ..target import Arch
from .heuristics import (
    E4M3_DECODE_DEFAULT,
    E4M3_DECODES,
    LATENT_GLUON_WS_WARPS,
    SCALED_CHUNK_FORMATS,
    SPLIT_QK_FORMATS,
    SPLIT_QK_WARPS,
    KernelConfig,
    choose_config,
    e4m3_decode_for,
    fp16_mma_for,
    split_len_for,
    splits_qk,
)

# Kernel families (kernels/): one per way a cache row is laid out.
LATENT = "latent"  # a plain [L + R] row: q's dtype ("auto") or per-tensor e4m3 ("fp8")
DS_MLA = "ds_mla"  # fp8_ds_mla: four scaled e4m3 chunks + bf16 rope
DS_MLA_V4 = "ds_mla_v4"  # fp8_ds_mla_v4: DeepSeek-V4's paged record, seven scaled chunks + rope
FAMILY_OF = {"auto": LATENT, "fp8": LATENT, "fp8_ds_mla": DS_MLA, "fp8_ds_mla_v4": DS_MLA_V4}
# fp8_ds_mla's sm90 kernels in Gluon (KernelConfig.gluon): DS_MLA's arguments and constexprs
DS_MLA_GLUON = "ds_mla_sm90_gluon"
DS_MLA_GLUON_WS = "ds_mla_sm90_gluon_ws"
# ... and its form with two warpgroups on alternate 32-row steps, each dequantizing its own
# (kernels/ds_mla_sm90_gluon_alt.py): KernelConfig.num_warps is its first warpgroup's, the
# second is its worker partition
DS_MLA_GLUON_ALT = "ds_mla_sm90_gluon_alt"
DS_MLA_GLUON_ALT_WARPS = 4
DS_MLA_GLUON_ALT_BLOCK_N = 32
# the V4 record's sm90 kernel in Gluon: DS_MLA_V4's arguments and constexprs
DS_MLA_V4_GLUON_WS = "ds_mla_v4_sm90_gluon_ws"
DS_MLA_V4_GLUON = "ds_mla_v4_sm90_gluon"
# the kernels for sm80 / sm86 / sm89 in Gluon (mma.sync; they run on later GPUs too):
# fp8_ds_mla's (DS_MLA's arguments and constexprs) and kv_format "auto"'s (LATENT's)
DS_MLA_AMPERE_GLUON = "ds_mla_ampere_gluon"
LATENT_AMPERE_GLUON = "latent_ampere_gluon"
AMPERE_FAMILIES = frozenset({DS_MLA_AMPERE_GLUON, LATENT_AMPERE_GLUON})
# kv_format "auto"'s sm90 kernels in Gluon (wgmma; LATENT's arguments and constexprs): the
# pipelined one, and the warp-specialized one (two warpgroups on alternate steps)
LATENT_GLUON = "latent_sm90_gluon"
LATENT_GLUON_WS = "latent_sm90_gluon_ws"
# the q / key width the Gluon kernels are written for (both records' 512-wide rows)
GLUON_LATENT = 512
# bytes the fp8_ds_mla Gluon kernels' 16-byte gathers need the cache's address and strides
# aligned to
GLUON_ALIGN = 16
GLUON_FAMILY = {
    ("fp8_ds_mla", "pipelined"): DS_MLA_GLUON,
    ("fp8_ds_mla", "specialized"): DS_MLA_GLUON_WS,
    ("fp8_ds_mla", "alternating"): DS_MLA_GLUON_ALT,
    ("fp8_ds_mla_v4", "specialized"): DS_MLA_V4_GLUON_WS,
    ("fp8_ds_mla_v4", "pipelined"): DS_MLA_V4_GLUON,
    ("fp8_ds_mla", "ampere"): DS_MLA_AMPERE_GLUON,
    ("auto", "ampere"): LATENT_AMPERE_GLUON,
    ("auto", "pipelined"): LATENT_GLUON,
    ("auto", "specialized"): LATENT_GLUON_WS,
}
# the Gluon kernels whose cp.async gathers need 16-byte aligned caches (GLUON_ALIGN)
GLUON_ASYNC_FAMILIES = frozenset(
    {
        DS_MLA_GLUON,
        DS_MLA_GLUON_WS,
        DS_MLA_GLUON_ALT,
        DS_MLA_V4_GLUON,
        DS_MLA_AMPERE_GLUON,
        LATENT_AMPERE_GLUON,
        LATENT_GLUON,
        LATENT_GLUON_WS,
    }
)
# the NVIDIA targets the mma.sync Gluon kernel compiles for (every one from sm80)
AMPERE_GLUON_MIN_CC = 80
# its tiles: head rows and key rows in multiples of the mma.sync tile's 16
AMPERE_GLUON_TILE = 16
# the mma.sync Gluon kernels' ring of gathered rows: KernelConfig.num_stages slots, one or two
# for fp8_ds_mla (its raw rows; kernels/ampere_gluon.py), two for rows in q's dtype
AMPERE_GLUON_RINGS = (1, 2)
# KernelConfig.row_offsets_32: every element of the cache lies less than this many elements
# from its start, so that any row's offset, and any column's within the row, is an int32
ROW_OFFSET_32_LIMIT = 2**31
# the families whose rows carry per-group scales (fp8_ds_mla, the V4 record), in either language
SCALED_FAMILIES = frozenset(
    {DS_MLA, DS_MLA_V4, *(f for (fmt, _), f in GLUON_FAMILY.items() if FAMILY_OF[fmt] != LATENT)}
)

# The merge holds all splits of BLOCK_L output columns in one [S_PAD, BLOCK_L] fp32 tile: about
# MERGE_TILE_ELEMENTS of them (32 a thread at its 4 warps), so the more splits the narrower the
# column block, and no program walks the splits serially (PERFORMANCE.md, log 2).
MERGE_TILE_ELEMENTS = 4096
# At least 64 columns a program: past 64 splits the tile grows instead of the column block
# shrinking (64 columns are 128 bytes of a bf16 output row, one cache line a store).
MERGE_MIN_BLOCK_L = 64
MERGE_NUM_WARPS = 4

# KernelConfig.e4m3_decode -> the kernels' E4M3_DECODE constexpr: ops/e4m3.py's E4M3_SCALAR,
# E4M3_PACKED, E4M3_PACKED_NO_MASK (written out: this module imports no Triton;
# tests/test_plan.py checks they agree)
E4M3_DECODE_CONSTEXPR = {"scalar": 0, "packed": 1, "packed-nomask": 2}
# The formats whose kernels take E4M3_DECODE (the V4 record's kernel decodes scalar only).
E4M3_DECODE_FORMATS = ("fp8", "fp8_ds_mla")


def _shift(n: int) -> int:
    """log2(n) for a power of two, else -1 (general division in the kernel)."""
    return n.bit_length() - 1 if n > 0 and n & (n - 1) == 0 else -1


@dataclasses.dataclass(frozen=True)
class MergePlan:
    """The LSE merge of the split partials: grid, constexprs and launch options."""

    grid: tuple[int, int]
    constexprs: dict[str, Any]
    num_warps: int
    pdl: bool


@dataclasses.dataclass(frozen=True)
class ExtraPlan:
    """Where the extra index set sits in the gather sequence the splits divide.

    The main set's ``width`` entries come first, the extra set's ``width`` entries start at
    ``offset`` (the main width rounded up to whole gather steps, so that no step mixes the two
    caches); the splits divide the ``offset + width`` positions like one top-k list.
    ``bt_block_size`` is the extra block table's block size (1 without one).
    """

    width: int
    offset: int
    bt_block_size: int


@dataclasses.dataclass(frozen=True)
class LaunchPlan:
    """One call's kernels, grids and constexprs (``launch.launch_sparse_mla`` runs it).

    ``config`` is the configuration as run: ``num_splits`` is the split count actually used
    (the request rounded to whole gather steps) and ``fp8_native``, ``pdl``, ``fp16_mma``,
    ``e4m3_decode`` are decided. ``workspace`` is the fp32 ``[T, S, H, L]`` partial-output shape (None unsplit).
    """

    family: str
    config: KernelConfig
    grid: tuple[int]
    split_len: int
    num_head_blocks: int
    bt_block_size: int
    constexprs: dict[str, Any]
    workspace: tuple[int, int, int, int] | None
    merge: MergePlan | None
    extra: ExtraPlan | None = None

    @property
    def num_splits(self) -> int:
        return self.config.num_splits


def offsets_fit_32(cache_span: int | None) -> bool:
    """Whether every offset into a cache spanning ``cache_span`` elements (None: not known) is an
    int32, as KernelConfig.row_offsets_32 computes them."""
    return cache_span is not None and cache_span <= ROW_OFFSET_32_LIMIT


def cache_span(cache: torch.Tensor) -> int:
    """The distance in elements from ``cache``'s first element to one past its last, whatever its
    strides (0 for an empty cache)."""
    if cache.numel() == 0:
        return 0
    return 1 + sum((n - 1) * st for n, st in zip(cache.shape, cache.stride()))


def gluon_gathers_aligned(*strides_and_address: int) -> bool:
    """Whether the fp8_ds_mla Gluon kernels' 16-byte gathers (cp.async, unchecked) can read a
    byte cache with these page / row strides and this address: all multiples of GLUON_ALIGN."""
    return all(x % GLUON_ALIGN == 0 for x in strides_and_address)


def _check_gluon(
    cfg: KernelConfig,
    kv_format: str,
    dtype: torch.dtype,
    arch,
    latent: int,
    has_bt: bool,
    has_extra: bool,
    on_gpu: bool,
) -> str:
    """The Gluon kernel's family for this call, or a ValueError naming what it does not run
    (kernels/ds_mla_sm90_gluon.py, ds_mla_v4_sm90_gluon.py, latent_sm90_gluon.py,
    ampere_gluon.py)."""
    family = GLUON_FAMILY.get((kv_format, cfg.gluon))
    if family is None:
        raise ValueError(
            f"config {cfg} asks for gluon={cfg.gluon!r} with kv_format={kv_format!r}; the Gluon "
            f"kernels are {sorted(GLUON_FAMILY)}"
        )
    v4 = kv_format == "fp8_ds_mla_v4"
    if family in AMPERE_FAMILIES:
        _check_ampere_gluon(cfg, kv_format, dtype, arch, latent, has_bt, has_extra, on_gpu)
        return family
    wanted = dict(
        target="cuda:90",
        dtype=torch.bfloat16,
        block_h=64,
        block_n=DS_MLA_GLUON_ALT_BLOCK_N if family == DS_MLA_GLUON_ALT else 64,
        num_warps={
            LATENT_GLUON_WS: LATENT_GLUON_WS_WARPS,
            DS_MLA_GLUON_ALT: DS_MLA_GLUON_ALT_WARPS,
        }.get(family, 8),
        fp8_native=True,
        latent=GLUON_LATENT,
        on_gpu=True,  # Triton's interpreter runs no Gluon kernel
    )
    got = dict(
        target=f"{arch.backend}:{arch.cc}",
        dtype=dtype,
        block_h=cfg.block_h,
        block_n=cfg.block_n,
        num_warps=cfg.num_warps,
        fp8_native=cfg.fp8_native,
        latent=latent,
        on_gpu=on_gpu,
    )
    if v4:  # the record's scales fold exactly into bf16 tiles; both sets, with block tables
        wanted["fp16_mma"], got["fp16_mma"] = False, cfg.fp16_mma
    else:  # fp8_ds_mla's tile with the fp16 fold; rows in q's dtype have nothing to fold
        fold = family not in (LATENT_GLUON, LATENT_GLUON_WS)
        if family in (LATENT_GLUON_WS, DS_MLA_GLUON_ALT):
            # their partitions ask for 256 registers a thread (kernels/latent_sm90_gluon.py,
            # WS_REGS; ds_mla_sm90_gluon_alt.py): under a cap, the first warpgroup's would
            # shrink and spill
            wanted["max_registers"], got["max_registers"] = None, cfg.max_registers
        wanted.update(fp16_fold=fold, block_table=False, extra_set=False)
        got.update(fp16_fold=cfg.fp16_fold, block_table=has_bt, extra_set=has_extra)
    bad = {k: v for k, v in got.items() if wanted[k] != v}
    if bad:
        raise ValueError(
            f"config {cfg} asks for a Gluon kernel (gluon={cfg.gluon!r}), which runs only "
            f"{wanted}; this call has {bad}"
        )
    return family


def _check_ampere_gluon(
    cfg: KernelConfig,
    kv_format: str,
    dtype,
    arch,
    latent: int,
    has_bt: bool,
    has_extra: bool,
    on_gpu: bool,
) -> None:
    """A ValueError naming what the mma.sync Gluon kernels (kernels/ampere_gluon.py) do not run,
    if this call asks for any of it."""
    bad = []
    if arch.backend != "cuda" or int(arch.cc) < AMPERE_GLUON_MIN_CC:
        bad.append(f"target {arch.backend}:{arch.cc} (it runs on cuda:{AMPERE_GLUON_MIN_CC} on)")
    ds_mla = kv_format == "fp8_ds_mla"
    if dtype != torch.bfloat16 and (ds_mla or dtype != torch.float16):
        bad.append(f"q {dtype} (it runs bf16 q{'' if ds_mla else ' or fp16'})")
    for name, rows in (("block_h", cfg.block_h), ("block_n", cfg.block_n)):
        if rows % AMPERE_GLUON_TILE:
            bad.append(f"{name}={rows} (multiples of {AMPERE_GLUON_TILE})")
    if ds_mla and not cfg.fp16_fold:
        bad.append("fp16_fold=False (it runs the fp16 fold)")
    rings = AMPERE_GLUON_RINGS if ds_mla else AMPERE_GLUON_RINGS[-1:]
    if cfg.num_stages not in rings:
        bad.append(
            f"num_stages={cfg.num_stages} (the ring's slots: {' or '.join(map(str, rings))})"
        )
    if has_bt or has_extra:
        bad.append("a block table or an extra set")
    if latent != GLUON_LATENT:
        bad.append(f"latent {latent} (it runs {GLUON_LATENT})")
    if not on_gpu:
        bad.append("Triton's interpreter")
    if bad:
        raise ValueError(
            f"config {cfg} asks for the mma.sync Gluon kernel (gluon='ampere'), which does not "
            f"run: {'; '.join(bad)}"
        )


def check_config(cfg: KernelConfig, kv_format: str, has_bt: bool) -> None:
    """Refuse a configuration asking for a variant the format's kernel family does not have."""
    if cfg.idx_ahead and has_bt:
        raise ValueError(
            f"config {cfg} asks for indices a step ahead (idx_ahead=True), which the kernel "
            "does not do with a block_table (the block-table lookup keeps the in-step loop; "
            "choose_config(..., block_table=True) never picks it): pass idx_ahead=False "
            f"(kv_format={kv_format!r}, block table: True)"
        )
    if cfg.stage_dequant and FAMILY_OF[kv_format] == LATENT:
        raise ValueError(
            f"config {cfg} asks for stage_dequant=True, which applies to "
            f"kv_format='fp8_ds_mla' and 'fp8_ds_mla_v4' only (got kv_format={kv_format!r})"
        )
    if cfg.fp16_fold and kv_format not in SCALED_CHUNK_FORMATS:
        raise ValueError(
            f"config {cfg} asks for fp16_fold=True, which applies to kv_format='fp8_ds_mla' "
            f"and 'fp8_ds_mla_v4' only (got kv_format={kv_format!r})"
        )
    if cfg.fp16_fold and cfg.fp16_mma is False:
        raise ValueError(
            f"config {cfg} asks for fp16_fold=True with fp16_mma=False: the fold in q's dtype "
            "is what fp16_mma=False already runs; pass one of the two"
        )
    if cfg.idx_ahead and cfg.gluon:
        raise ValueError(
            f"config {cfg} asks for indices a step ahead (idx_ahead=True) in a Gluon kernel "
            f"(gluon={cfg.gluon!r}), whose ring of gathered rows schedules each step's index "
            "loads itself; idx_ahead applies to the Triton kernels: pass idx_ahead=False "
            f"(kv_format={kv_format!r})"
        )
    if cfg.row_offsets_32 and cfg.gluon != "ampere":
        raise ValueError(
            f"config {cfg} asks for row_offsets_32=True, which applies to the mma.sync kernels "
            f"(gluon='ampere') only (got gluon={cfg.gluon!r}, kv_format={kv_format!r})"
        )
    if cfg.q_rope_in_registers and not (cfg.gluon == "ampere" and kv_format == "fp8_ds_mla"):
        raise ValueError(
            f"config {cfg} asks for q_rope_in_registers=True, which applies to the mma.sync "
            f"fp8_ds_mla kernel (gluon='ampere', kv_format='fp8_ds_mla') only (got "
            f"gluon={cfg.gluon!r}, kv_format={kv_format!r})"
        )
    if cfg.split_qk and not (
        cfg.gluon == "ampere"
        and kv_format in SPLIT_QK_FORMATS
        and splits_qk(cfg.block_h, cfg.num_warps)
        and not cfg.q_rope_in_registers
    ):
        raise ValueError(
            f"config {cfg} asks for split_qk=True, which applies to the mma.sync kernels "
            f"(gluon='ampere', kv_format in {SPLIT_QK_FORMATS}) in a tile of 16 heads in "
            f"{SPLIT_QK_WARPS} warps, without q_rope_in_registers (got gluon={cfg.gluon!r}, "
            f"kv_format={kv_format!r}, block_h={cfg.block_h}, num_warps={cfg.num_warps}, "
            f"q_rope_in_registers={cfg.q_rope_in_registers})"
        )
    decode = cfg.e4m3_decode
    if decode is not None and decode not in E4M3_DECODES:
        raise ValueError(
            f"config {cfg} asks for e4m3_decode={decode!r}: one of {', '.join(E4M3_DECODES)} "
            "or None (the architecture's choice)"
        )
    if decode not in (None, E4M3_DECODE_DEFAULT) and kv_format not in E4M3_DECODE_FORMATS:
        raise ValueError(
            f"config {cfg} asks for e4m3_decode={decode!r}, which applies to the e4m3 caches "
            f"of kv_format {' and '.join(map(repr, E4M3_DECODE_FORMATS))} only "
            f"(got kv_format={kv_format!r})"
        )
    if decode == "packed-nomask" and not cfg.stage_dequant:
        raise ValueError(
            f"config {cfg} asks for e4m3_decode='packed-nomask', which drops the staging mask "
            "of stage_dequant=True tiles; this config does not stage: pass 'packed'"
        )


# KernelConfig.max_registers: the range ptxas's register cap is meaningful in (a thread
# addresses at most 255 registers; below 32 nothing of these kernels fits without spilling)
MAX_REGISTERS_RANGE = (32, 255)


def check_max_registers(cfg: KernelConfig, arch: Arch, on_gpu: bool) -> None:
    """Refuse a register cap that cannot apply: ptxas's option (NVIDIA, compiled kernels)."""
    cap = cfg.max_registers
    if cap is None:
        return
    lo, hi = MAX_REGISTERS_RANGE
    if isinstance(cap, bool) or not isinstance(cap, int) or not lo <= cap <= hi:
        raise ValueError(
            f"config {cfg} asks for max_registers={cap!r}: an int from {lo} to {hi} registers "
            "per thread, or None (the compiler's choice)"
        )
    if not on_gpu or arch.backend != "cuda":
        where = "Triton's interpreter" if not on_gpu else f"{arch.backend} target {arch.cc}"
        raise ValueError(
            f"config {cfg} asks for max_registers={cap}, a cap for NVIDIA's ptxas, under "
            f"{where}: pass max_registers=None there"
        )


def check_e4m3_decode(cfg: KernelConfig, arch: Arch, on_gpu: bool) -> None:
    """Refuse a packed e4m3 decode where it cannot run: it is inline PTX (no interpreter, no
    AMD) and replaces the integer decode, which runs only without hardware fp8. ``cfg`` has
    ``fp8_native`` resolved."""
    decode = cfg.e4m3_decode
    if decode in (None, E4M3_DECODE_DEFAULT):
        return
    if not on_gpu:
        raise ValueError(
            f"config {cfg} asks for e4m3_decode={decode!r}, inline PTX that Triton's interpreter "
            "cannot run: only 'scalar' (or None) runs under TRITON_INTERPRET=1"
        )
    if arch.backend != "cuda":
        raise ValueError(
            f"config {cfg} asks for e4m3_decode={decode!r}, NVIDIA PTX, on {arch.backend} "
            f"target {arch.cc}: only 'scalar' (or None) runs there"
        )
    if cfg.fp8_native:
        raise ValueError(
            f"config {cfg} asks for e4m3_decode={decode!r}, a form of the integer e4m3 decode, "
            f"but sm{arch.cc} decodes e4m3 in hardware (fp8_native=True): pass fp8_native=False "
            "to run the integer decode here"
        )


def resolved_e4m3_decode(
    cfg: KernelConfig,
    num_tokens: int,
    kv_format: str,
    arch: Arch,
    *,
    fp8_native: bool,
    on_gpu: bool,
) -> str:
    """The integer e4m3 decode a call of ``num_tokens`` tokens runs in ``cfg``: the config's own,
    "scalar" in the Gluon kernels (they decode e4m3 their own way; the knob is the Triton
    kernels'), else heuristics.e4m3_decode_for's, which depends on the token count."""
    if cfg.e4m3_decode:
        return cfg.e4m3_decode
    if cfg.gluon:
        return "scalar"
    return e4m3_decode_for(
        num_tokens,
        cfg.block_h,
        kv_format,
        arch,
        stage_dequant=cfg.stage_dequant,
        fp8_native=fp8_native,
        on_gpu=on_gpu,
    )


def make_plan(
    *,
    num_tokens: int,
    num_heads: int,
    latent: int,
    rope: int,
    width: int,
    dtype: torch.dtype,
    kv_format: str,
    arch: Arch,
    on_gpu: bool,
    page_size: int = 1,
    has_counts: bool = False,
    block_size: int | None = None,
    k_scale_tensor: bool = False,
    store_lse: bool = False,
    has_sink: bool = False,
    extra_width: int | None = None,
    extra_page_size: int = 1,
    extra_has_counts: bool = False,
    extra_block_size: int | None = None,
    cache_aligned: bool = True,
    cache_span: int | None = None,
    config: KernelConfig | None = None,
) -> LaunchPlan:
    """The plan of one call with ``num_tokens`` >= 1 tokens of ``num_heads`` heads, q widths
    ``latent`` + ``rope``, top-k ``width``; ``block_size`` given when indices go through a block
    table; ``has_sink`` with an attention-sink tensor; ``on_gpu`` False under Triton's
    interpreter (no programmatic dependent launch). ``extra_width`` given when a second index set
    (into a second cache of ``extra_page_size`` rows per page, with ``extra_block_size`` when its
    indices go through a block table of their own) joins the same softmax. ``cache_aligned``
    False where the cache's address or page / row strides are not 16-byte multiples (the
    heuristics then keep the Triton kernels, whose loads need no alignment). ``cache_span``: the
    distance in elements from the cache's first element to one past its last (None: not known),
    which decides whether row offsets fit 32-bit arithmetic (KernelConfig.row_offsets_32)."""
    if num_tokens < 1:
        raise ValueError(f"a plan needs at least one token, got num_tokens={num_tokens}")
    family = FAMILY_OF[kv_format]
    has_bt = block_size is not None
    has_extra = extra_width is not None
    # the heuristic sees both sets as one list (it decides the split count from its length)
    total = width + (extra_width or 0)
    cfg = config or choose_config(
        num_tokens,
        num_heads,
        total,
        dtype,
        kv_format,
        arch,
        block_table=has_bt,
        extra_set=has_extra,
        gluon=on_gpu and cache_aligned and latent == GLUON_LATENT,
    )
    check_config(cfg, kv_format, has_bt)
    if cfg.row_offsets_32 and not offsets_fit_32(cache_span):
        if config is not None:
            raise ValueError(
                f"config {cfg} asks for row_offsets_32=True, which needs a cache spanning at "
                f"most {ROW_OFFSET_32_LIMIT} elements from its first; this one spans "
                f"{'an unknown number' if cache_span is None else cache_span}: pass "
                "row_offsets_32=False"
            )
        cfg = dataclasses.replace(cfg, row_offsets_32=False)
    if cfg.fp16_fold and dtype == torch.float32:
        raise ValueError(
            f"config {cfg} asks for fp16_fold=True with float32 q, whose MMAs are float32 (and "
            "fold the scales already): pass fp16_fold=False"
        )
    extra = None
    if has_extra:
        extra = ExtraPlan(
            width=extra_width,
            offset=-(-width // cfg.block_n) * cfg.block_n,
            bt_block_size=extra_block_size if extra_block_size is not None else 1,
        )
        total = extra.offset + extra_width
    split_len, num_splits = split_len_for(total, cfg.num_splits, cfg.block_n)
    split = num_splits > 1
    fp16_mma = cfg.fp16_mma
    if fp16_mma is None:
        # the fp16 fold is a form of the fp16 MMAs
        fp16_mma = cfg.fp16_fold or fp16_mma_for(dtype, kv_format, arch, cfg.block_h)
    fp8_native = arch.fp8_native if cfg.fp8_native is None else cfg.fp8_native
    # programmatic dependent launch only links the split pass to its merge; never under the
    # interpreter, where griddepcontrol has no meaning
    pdl = on_gpu and arch.pdl and cfg.pdl is not False and split
    cfg = dataclasses.replace(
        cfg,
        num_splits=num_splits,
        fp8_native=fp8_native,
        pdl=pdl,
        fp16_mma=fp16_mma,
        e4m3_decode=resolved_e4m3_decode(
            cfg, num_tokens, kv_format, arch, fp8_native=fp8_native, on_gpu=on_gpu
        ),
    )
    check_e4m3_decode(cfg, arch, on_gpu)
    check_max_registers(cfg, arch, on_gpu)
    if cfg.gluon:
        family = _check_gluon(cfg, kv_format, dtype, arch, latent, has_bt, has_extra, on_gpu)
    num_hb = -(-num_heads // cfg.block_h)
    bt_block_size = block_size if has_bt else 1
    common = dict(
        L=latent,
        R=rope,
        BLOCK_H=cfg.block_h,
        BLOCK_N=cfg.block_n,
        FP8_NATIVE=fp8_native,
        IDX_AHEAD=cfg.idx_ahead,
        MMA_FP16=kv_format != "auto" and dtype != torch.float32 and fp16_mma,
        HAS_COUNTS=has_counts,
        HAS_BT=has_bt,
        BT_SHIFT=_shift(bt_block_size),
        PAGE_SHIFT=_shift(page_size),
        SPLIT=split,
        STORE_LSE=store_lse,
        DOT_PRECISION="ieee" if dtype == torch.float32 else "tf32",
        PDL=pdl,
        HAS_SINK=has_sink,
        HAS_EXTRA=has_extra,
        EXTRA_HAS_COUNTS=has_extra and extra_has_counts,
        EXTRA_HAS_BT=has_extra and extra_block_size is not None,
        EXTRA_BT_SHIFT=_shift(extra.bt_block_size) if has_extra else -1,
        EXTRA_PAGE_SHIFT=_shift(extra_page_size) if has_extra else -1,
    )
    if family in (LATENT, LATENT_AMPERE_GLUON, LATENT_GLUON, LATENT_GLUON_WS):
        constexprs = dict(
            common,
            E4M3=kv_format == "fp8",
            E4M3_DECODE=E4M3_DECODE_CONSTEXPR[cfg.e4m3_decode],
            K_SCALE_PTR=k_scale_tensor,
        )
        if family == LATENT_AMPERE_GLUON:
            constexprs["SPLIT_QK"] = cfg.split_qk
            constexprs["ROW_OFFSETS_32"] = cfg.row_offsets_32
    else:
        constexprs = dict(common, STAGE=cfg.stage_dequant, FOLD_FP16=cfg.fp16_fold)
        if family in (DS_MLA, DS_MLA_GLUON, DS_MLA_GLUON_WS, DS_MLA_GLUON_ALT, DS_MLA_AMPERE_GLUON):
            constexprs["E4M3_DECODE"] = E4M3_DECODE_CONSTEXPR[cfg.e4m3_decode]
        if family == DS_MLA_AMPERE_GLUON:
            constexprs["RING"] = cfg.num_stages
            constexprs["QR_REGS"] = cfg.q_rope_in_registers
            constexprs["SPLIT_QK"] = cfg.split_qk
            constexprs["ROW_OFFSETS_32"] = cfg.row_offsets_32
    merge = None
    if split:
        s_pad = 1 << (num_splits - 1).bit_length()
        # output columns per merge program: the tile budget over S_PAD, at least the minimum,
        # never past the latent width (the merge stores unmasked: BLOCK_L must divide L;
        # PERFORMANCE.md, log 17)
        block_l = min(latent, max(MERGE_MIN_BLOCK_L, MERGE_TILE_ELEMENTS // s_pad))
        merge = MergePlan(
            grid=(num_tokens * num_heads, -(-latent // block_l)),
            constexprs=dict(
                L=latent,
                S_PAD=s_pad,
                BLOCK_L=block_l,
                STORE_LSE=store_lse,
                PDL=pdl,
                HAS_SINK=has_sink,
            ),
            num_warps=MERGE_NUM_WARPS,
            pdl=pdl,
        )
    return LaunchPlan(
        family=family,
        config=cfg,
        # one-dimensional: the warp-specialized bf16 kernel relies on program_id(1) being 0
        grid=(num_tokens * num_splits * num_hb,),
        split_len=split_len,
        num_head_blocks=num_hb,
        bt_block_size=bt_block_size,
        constexprs=constexprs,
        workspace=(num_tokens, num_splits, num_heads, latent) if split else None,
        merge=merge,
        extra=extra,
    )
