"""GPU reliability procedure for ``sparse_mla``; docs/RELIABILITY.md says how to run it.

Suites (``--suite``):

- ``sanitize`` (default): every distinct compiled variant of the kernels that the heuristics choose
  on this GPU (all formats; decode T 1..128 x H 1..128 at widths 2048/1152/100/1; prefill T 512 at
  H 16 and T 4096 at H 16/64/128; with and without valid_counts, block tables, return_lse; forced
  integer e4m3 decode; NoPE; paged caches with power-of-two and other page sizes; an attention
  sink; a second index set in the same softmax, flat or through its own block table; DeepSeek-V4's
  584-byte record, alone and with a second set, paged only), each run once
  with the smallest shape that selects it and adversarial index content, checked against the
  reference. Meant to run under compute-sanitizer (memcheck, racecheck, initcheck; driver:
  benchmarks/reliability/sanitize.sh) and without it.
- ``graph``: CUDA-graph capture and replay with q, indices, valid_counts, block table, request ids
  and the fp8 scale tensor overwritten in place between replays, each replay checked; before
  capture, the eager call under ``torch.cuda.set_sync_debug_mode("error")``.
- ``emulate --arch 80|86|89``: the sanitize suite's cases for that target's heuristics (sink, extra
  set and V4 record included; e.g. ``--only v4`` for DeepSeek-V4's), compiled by
  Triton for sm_80/86/89 and JIT-compiled from PTX by the driver (benchmarks/reliability/ptx_jit.py); prints
  each variant's PTX ``.target`` and shared memory (checked against the target's limit).

A variant is what Triton compiles: the forward kernel's constexprs and launch options (block
sizes, warps, stages, format, fp8 decode, staging, step-ahead indices, counts, block table and
page shifts, split, LSE, PDL) with its pointer dtypes, and the merge kernel's (split-count
padding, column block, LSE, PDL). They are recorded from the library's own launcher
(``launch.launch_sparse_mla`` with its kernels swapped for recorders), not re-derived here, and
every run checks that the launch it made is the variant it was selected for.

Every case: rows no valid index reaches are NaN (0xFF bytes for fp8) in the kernel's cache, and
for paged caches so is the memory between blocks; the reference runs on a clean copy. Outputs
are NaN-poisoned before the call. Checks: the package's one comparison
(``triton_mla_sparse.testing.compare_sparse_mla``, the tests' too): every output finite; relative
Frobenius error within the tolerance of q's dtype (testing/tolerances.py); LSE -inf exactly where
the reference has no valid index, else within its bound; empty tokens exactly zero.

Exit status: 0 all passed, 1 any failure, 2 bad arguments. A JSON log goes to ``--log PATH`` or,
with ``--out DIR``, to ``DIR/reliability-<suite>.json`` (neither: no log); the summary table is
printed last.

``--smoke`` runs the sanitize suite's logic on CPU under TRITON_INTERPRET=1 (tiny sizes, fp16/fp32
only): tests/test_reliability_script.py keeps it alive in CI.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import hashlib
import inspect
import json
import os
import subprocess
import sys
import tempfile
import time
import traceback
from collections.abc import Iterable
from typing import Any

HERE = os.path.dirname(os.path.abspath(__file__))

L = 512  # kv_lora_rank: latent width, V width, output width
ROPE = 64
I32_MAX = 2**31 - 1
I32_MIN = -(2**31)
PAGE = 64  # vLLM's block size (the indexer's)
ODD_PAGE = 48  # a page size that is not a power of two: general division in the kernel
DECOY_ROWS = 64  # rows only garbage (past valid_counts) points at: NaN in the kernel's cache
PREFILL_CHECKED = 64  # tokens of a long prefill checked against the reference
SMOKE_MAX_CASES = 8

# layouts of the cache (and whether indices go through a block table)
LAYOUTS = {
    "flat": dict(page=None, bs=None),  # [N, C] rows: vLLM's plugin path
    "bt": dict(page=PAGE, bs=PAGE),  # paged [nb, 64, C] + block table of 64-row blocks
    "paged": dict(page=PAGE, bs=None),  # paged [nb, 64, C], flat logical indices
    "bt48": dict(page=ODD_PAGE, bs=ODD_PAGE),  # page and block size 48: no shifts
}

DECODE_T = (1, 2, 4, 8, 16, 32, 64, 128)
DECODE_H = (1, 8, 16, 24, 32, 48, 64, 96, 128)
WIDTHS = (2048, 1152, 100, 1)
# prefill: a 512-token chunk (the smallest shape of the prefill-only tiles) and T 4096
PREFILL = ((512, 16, 2048),) + tuple((4096, h, 2048) for h in (16, 64, 128))
# the extra index set (a second cache in the same softmax): its own layouts, with a page size
# unlike the main cache's so that the two page shifts cannot stand in for each other
EXTRA_PAGE = 16
EXTRA_LAYOUTS = {
    "flat": dict(page=None, bs=None),  # [N2, C] rows
    "paged": dict(page=EXTRA_PAGE, bs=None),  # paged, flat logical indices (DeepSeek-V4's)
    "bt": dict(page=EXTRA_PAGE, bs=EXTRA_PAGE),  # paged + its own block table
}
# (main width, extra width): DeepSeek-V4's decode (a 128-token sliding window and a compressed
# top-k of 512), a long main set, widths that are not whole gather steps, one entry each
EXTRA_WIDTHS = ((128, 512), (2048, 512), (100, 37), (1, 1))
PREFILL_EXTRA_W = 512
V4_LAYOUTS = ("paged", "bt")  # the V4 record is paged only (a page's scale rows follow its data)
SMOKE_T, SMOKE_H, SMOKE_W = (1, 8), (1, 16, 24, 64), (1, 40, 100)
SMOKE_EXTRA_WIDTHS = ((40, 24), (1, 1))
GRAPH_T, GRAPH_H, GRAPH_W = (1, 4, 16, 64, 128), (8, 16, 64, 128), 2048
GRAPH_REPLAYS = 3


def _parse(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        description="sparse_mla reliability procedure: sanitizer, CUDA-graph and PTX-JIT suites",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    p.add_argument("--suite", choices=("sanitize", "graph", "emulate"), default="sanitize")
    p.add_argument("--arch", type=int, default=80, help="emulate: compute capability (80, 86, 89)")
    p.add_argument("--smoke", action="store_true", help="CPU, TRITON_INTERPRET=1, tiny fp16/fp32")
    p.add_argument(
        "--only",
        action="append",
        default=[],
        metavar="A,B",
        help="keep cases whose name or config contains A or B; repeat to AND",
    )
    p.add_argument("--max-cases", type=int, default=None, help="run the first N (coverage order)")
    p.add_argument(
        "--skip-cases",
        type=int,
        default=0,
        help="drop the first N (coverage order) before --max-cases: splits a pass into slices",
    )
    p.add_argument("--max-tokens", type=int, default=None, help="drop cases with more tokens")
    p.add_argument("--shard", default=None, metavar="K/N", help="run every N-th case from the K-th")
    p.add_argument("--jobs", type=int, default=1, help="run shards in N parallel processes")
    p.add_argument(
        "--all-shapes",
        action="store_true",
        help="every enumerated shape, not one per variant (use with --only)",
    )
    p.add_argument(
        "--compile-only",
        action="store_true",
        help="compile every selected variant (Triton warmup), launch nothing",
    )
    p.add_argument("--list", action="store_true", help="print the selected cases and exit")
    p.add_argument(
        "--split-qk",
        action="store_true",
        help="QK^T split over the latent (KernelConfig.split_qk) in every mma.sync tile that "
        "takes it, where the heuristics would not split: the split tiles on every shape",
    )
    p.add_argument(
        "--rows-ws",
        action="store_true",
        help="rows in bf16 (kv_format auto) in sm90's warp-specialized wgmma kernel "
        "(KernelConfig.gluon='specialized') in every case whose tile is its 64 x 64 one",
    )
    p.add_argument(
        "--ds-alt",
        action="store_true",
        help="fp8_ds_mla in sm90's alternating Gluon kernel (KernelConfig.gluon='alternating', "
        "two warpgroups on alternate 32-row steps) in every case the heuristics give a 64 x 64 "
        "Gluon tile",
    )
    p.add_argument(
        "--fp8-q",
        choices=("bf16", "fp16", "fp32"),
        default="bf16",
        help="q dtype for the fp8 formats",
    )
    p.add_argument(
        "--ref-device",
        choices=("auto", "cpu", "device"),
        default="auto",
        help="where the reference runs (auto: CPU for sanitize, the GPU otherwise)",
    )
    p.add_argument("--replays", type=int, default=GRAPH_REPLAYS, help="graph: replays per case")
    p.add_argument(
        "--keep-allocator-cache",
        action="store_true",
        help="sanitize: keep PyTorch's caching allocator (hides out-of-bounds reads "
        "inside its segments from memcheck)",
    )
    p.add_argument(
        "--out",
        default=None,
        metavar="DIR",
        help="directory for the JSON log (DIR/reliability-<suite>.json) and --jobs shard output",
    )
    p.add_argument("--log", default=None, help="JSON log path (overrides --out's)")
    p.add_argument(
        "--merge",
        nargs="+",
        default=None,
        metavar="LOG",
        help="print the combined summary of JSON logs (e.g. sanitizer shards) and exit",
    )
    p.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--threads", type=int, default=0, help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.smoke and args.suite != "sanitize":
        p.error("--smoke runs the sanitize suite's logic on CPU; graph and emulate need a GPU")
    if args.suite == "emulate" and args.arch not in (80, 86, 89):
        p.error(f"--arch must be 80, 86 or 89 for --suite emulate, got {args.arch}")
    if args.skip_cases < 0:
        p.error(f"--skip-cases must be >= 0, got {args.skip_cases}")
    if args.jobs < 1 or (args.max_cases is not None and args.max_cases < 0):
        p.error("--jobs must be >= 1 and --max-cases >= 0")
    if args.jobs > 1 and args.shard:
        p.error("--jobs makes its own shards; do not combine it with --shard")
    if args.shard:
        try:
            k, n = (int(x) for x in args.shard.split("/"))
            assert 0 <= k < n
        except (ValueError, AssertionError):
            p.error(f"--shard must be K/N with 0 <= K < N, got {args.shard!r}")
        args.shard = (k, n)
    if args.smoke and args.max_cases is None:
        args.max_cases = SMOKE_MAX_CASES
    return args


# ----------------------------------------------------------------------------------------------
# environment: set before torch allocates on the GPU and before the kernels module is imported


def _setup_env(args: argparse.Namespace) -> None:
    if args.list and not args.smoke:
        import torch as _torch

        args.cpu_list = not _torch.cuda.is_available()  # list what an H200 (sm90) would run
        if args.cpu_list:  # the dry runs use meta tensors: no interpreter (it refuses bf16)
            os.environ.pop("TRITON_INTERPRET", None)
    if args.smoke:
        os.environ["TRITON_INTERPRET"] = "1"
    elif args.suite == "sanitize" and not args.keep_allocator_cache and not args.compile_only:
        # each tensor its own cudaMalloc, so memcheck sees the true bounds of every buffer
        os.environ.setdefault("PYTORCH_NO_CUDA_MEMORY_CACHING", "1")


def _imports() -> None:
    """Import torch and the package into module globals (after _setup_env)."""
    global torch, sparse_mla, sparse_mla_reference, physical_rows, heuristics, launch_mod
    global choose_config, split_len_for, config_label, pack_fp8_ds_mla, quantize_fp8, KernelConfig
    global kv_format_mod, compare_sparse_mla, reference_dtype, sparse_mla_tolerance
    global splits_qk, SPLIT_QK_FORMATS, LATENT_GLUON_WS_WARPS, GLUON_LATENT
    global DS_MLA_GLUON_ALT_BLOCK_N, DS_MLA_GLUON_ALT_WARPS, resolved_e4m3_decode
    import torch

    from triton_mla_sparse import kv_format as kv_format_mod
    from triton_mla_sparse.bench import config_label
    from triton_mla_sparse.kv_format import pack_fp8_ds_mla, quantize_fp8
    from triton_mla_sparse.ops.sparse_mla import heuristics
    from triton_mla_sparse.ops.sparse_mla import launch as launch_mod
    from triton_mla_sparse.ops.sparse_mla.heuristics import (
        SPLIT_QK_FORMATS,
        KernelConfig,
        choose_config,
        split_len_for,
        splits_qk,
    )
    from triton_mla_sparse.ops.sparse_mla.interface import sparse_mla
    from triton_mla_sparse.ops.sparse_mla.plan import (
        DS_MLA_GLUON_ALT_BLOCK_N,
        DS_MLA_GLUON_ALT_WARPS,
        GLUON_LATENT,
        LATENT_GLUON_WS_WARPS,
        resolved_e4m3_decode,
    )
    from triton_mla_sparse.reference import physical_rows, sparse_mla_reference
    from triton_mla_sparse.testing import (
        compare_sparse_mla,
        reference_dtype,
        sparse_mla_tolerance,
    )

    global _CHOOSE_BT
    # newer heuristics take the block table into account (no step-ahead indices through one)
    _CHOOSE_BT = "block_table" in inspect.signature(choose_config).parameters


_CHOOSE_BT = False
_SPLIT_QK = False  # --split-qk
_ROWS_WS = False  # --rows-ws
_DS_ALT = False  # --ds-alt


# ----------------------------------------------------------------------------------------------
# what is run


@dataclasses.dataclass(frozen=True)
class Kind:
    """A cache format with q's dtype: ``scale`` "float"/"tensor" for fp8's k_scale; ``native``
    False forces the integer e4m3 decode (sm80's path) on a GPU that has the native one."""

    name: str
    dtype: Any
    kv_format: str
    scale: str | None = None
    native: bool | None = None
    rope: int = ROPE
    latent: int = L  # kv_lora_rank
    sink: bool = False  # a per-head attention sink (attn_sink)
    extra: str | None = None  # a second index set in the extra cache laid out as EXTRA_LAYOUTS

    @property
    def width(self) -> int:
        return self.latent + self.rope

    @property
    def v4(self) -> bool:
        return self.kv_format == "fp8_ds_mla_v4"


@dataclasses.dataclass(frozen=True)
class Case:
    kind: Kind
    T: int
    H: int
    W: int
    layout: str = "flat"
    counts: bool = False  # valid_counts (on both sets when there is an extra set)
    lse: bool = False
    XW: int = 0  # the extra set's width (0: none)

    @property
    def name(self) -> str:
        flags = self.layout + (" cnt" if self.counts else "") + (" lse" if self.lse else "")
        xw = f"+{self.XW}" if self.XW else ""
        return f"{self.kind.name} T{self.T} H{self.H} W{self.W}{xw} {flags}"

    def positions(self, cfg: KernelConfig) -> int:
        """Gather positions the splits divide: the main width, then (with an extra set) its
        width from the main width rounded up to whole gather steps (plan.ExtraPlan)."""
        if not self.XW:
            return self.W
        return -(-self.W // cfg.block_n) * cfg.block_n + self.XW

    @property
    def sampled(self) -> bool:
        return self.T > 2 * PREFILL_CHECKED

    def config(self, arch) -> KernelConfig:
        """The heuristic's configuration (with the forced e4m3 decode where the kind says)."""
        kw = {"block_table": True} if LAYOUTS[self.layout]["bs"] and _CHOOSE_BT else {}
        # with an extra set the heuristic sees both sets as one list (plan.make_plan)
        # a forced integer decode runs the Triton kernels (the Gluon ones convert in hardware),
        # and so does a latent other than the one the Gluon kernels are built for (as the plan
        # decides: every cache here is 16-byte aligned)
        cfg = choose_config(
            self.T,
            self.H,
            self.W + self.XW,
            self.kind.dtype,
            self.kind.kv_format,
            arch,
            extra_set=self.XW > 0,
            gluon=self.kind.native is not False and self.kind.latent == GLUON_LATENT,
            **kw,
        )
        if self.kind.native is False:
            cfg = dataclasses.replace(cfg, fp8_native=False)
        if _SPLIT_QK and self.forces_split(cfg):
            cfg = dataclasses.replace(cfg, split_qk=True)
        if _ROWS_WS and self.forces_rows_ws(cfg, arch):
            cfg = dataclasses.replace(
                cfg,
                gluon="specialized",
                num_warps=LATENT_GLUON_WS_WARPS,
                num_stages=1,
                idx_ahead=False,
            )
        if _DS_ALT and self.forces_ds_alt(cfg, arch):
            cfg = dataclasses.replace(
                cfg,
                gluon="alternating",
                block_n=DS_MLA_GLUON_ALT_BLOCK_N,
                num_warps=DS_MLA_GLUON_ALT_WARPS,
            )
        return cfg

    def forces_ds_alt(self, cfg: KernelConfig, arch) -> bool:
        """--ds-alt: fp8_ds_mla on sm90 where the heuristics chose a 64 x 64 Gluon tile (bf16
        q, no block table, no extra set: what the alternating kernel runs too)."""
        return (
            arch.backend == "cuda"
            and int(arch.cc) == 90
            and self.kind.kv_format == "fp8_ds_mla"
            and cfg.gluon in ("pipelined", "specialized")
            and (cfg.block_h, cfg.block_n) == (64, 64)
        )

    def forces_rows_ws(self, cfg: KernelConfig, arch) -> bool:
        """--rows-ws: bf16 rows on sm90 in the 64 x 64 tile, the warp-specialized wgmma
        kernel's, without a block table or an extra set (which it does not run)."""
        return (
            arch.backend == "cuda"
            and int(arch.cc) == 90
            and self.kind.kv_format == "auto"
            and self.kind.dtype == torch.bfloat16
            and self.kind.latent == GLUON_LATENT
            and (cfg.block_h, cfg.block_n) == (64, 64)
            and not LAYOUTS[self.layout]["bs"]
            and not self.XW
        )

    def forces_split(self, cfg: KernelConfig) -> bool:
        """--split-qk: the heuristics' tile takes the split but they did not choose it."""
        return (
            cfg.gluon == "ampere"
            and not cfg.split_qk
            and not cfg.q_rope_in_registers
            and self.kind.kv_format in SPLIT_QK_FORMATS
            and splits_qk(cfg.block_h, cfg.num_warps)
        )

    def override(self, arch) -> KernelConfig | None:
        """The ``config=`` argument: None (the interface chooses) unless the decode or the
        split (--split-qk) is forced."""
        if self.kind.native is False:
            return self.config(arch)
        cfg = self.config(arch)
        forced = (
            (_SPLIT_QK and cfg.split_qk)
            or (_ROWS_WS and cfg.gluon == "specialized")
            or (_DS_ALT and cfg.gluon == "alternating")
        )
        return cfg if forced else None


def make_kinds(args: argparse.Namespace, arch) -> list[Kind]:
    dt = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}
    names = ("fp16", "fp32") if args.smoke else ("bf16", "fp16", "fp32")
    q8n = "fp16" if args.smoke and args.fp8_q == "bf16" else args.fp8_q
    q8 = dt[q8n]
    kinds = [Kind(f"auto-{n}", dt[n], "auto") for n in names]
    kinds += [
        Kind(f"fp8-{q8n}", q8, "fp8", "float"),
        Kind(f"fp8ts-{q8n}", q8, "fp8", "tensor"),
        Kind(f"dsmla-{q8n}", q8, "fp8_ds_mla"),
    ]
    if arch.fp8_native and args.suite == "sanitize":
        kinds += [
            Kind(f"fp8int-{q8n}", q8, "fp8", "float", native=False),
            Kind(f"fp8tsint-{q8n}", q8, "fp8", "tensor", native=False),
            Kind(f"dsmlaint-{q8n}", q8, "fp8_ds_mla", native=False),
        ]
    kinds += [
        Kind(f"nope-{names[0]}", dt[names[0]], "auto", rope=0),
        Kind(f"dsmlanope-{q8n}", q8, "fp8_ds_mla", rope=0),
    ]
    if args.suite == "sanitize":
        # kv_lora_rank below the merge's 64-column minimum (the merge once stored past L there)
        kinds += [
            Kind(f"narrow-{names[0]}", dt[names[0]], "auto", rope=16, latent=32),
            Kind(f"narrowfp8-{q8n}", q8, "fp8", "float", rope=16, latent=32),
        ]
    if args.suite in ("sanitize", "emulate"):
        # the attention sink: read in the single-pass epilogue of each family and in the merge
        kinds += [
            Kind(f"sink-{names[0]}", dt[names[0]], "auto", sink=True),
            Kind(f"dsmlasink-{q8n}", q8, "fp8_ds_mla", sink=True),
        ]
        # the extra index set, flat and through its own block table (the main set in every
        # layout of flag_sets), counts on both sets with the case's counts
        kinds += [
            Kind(f"extra-{names[0]}", dt[names[0]], "auto", extra="flat"),
            Kind(f"extrabt-{names[0]}", dt[names[0]], "auto", extra="bt"),
            Kind(f"dsmlaextra-{q8n}", q8, "fp8_ds_mla", extra="flat"),
            Kind(f"dsmlaextrabt-{q8n}", q8, "fp8_ds_mla", extra="bt"),
        ]
        # DeepSeek-V4's record (q and value 512 wide, no separate rope) with its sink: the main
        # set alone, and main + a paged extra set (the sliding-window and compressed caches)
        v4 = dict(rope=0, latent=L, sink=True)
        kinds += [
            Kind(f"v4sink-{q8n}", q8, "fp8_ds_mla_v4", **v4),
            Kind(f"v4extra-{q8n}", q8, "fp8_ds_mla_v4", extra="paged", **v4),
        ]
    return kinds


def flag_sets(kind: Kind | None = None) -> list[tuple[str, bool, bool]]:
    """(layout, counts, lse): flat and block table crossed with counts and LSE; the other paged
    layouts once each (with counts and LSE). The V4 record has no flat layout: paged in its
    place."""
    first = V4_LAYOUTS if kind is not None and kind.v4 else ("flat", "bt")
    sets = [(lay, c, s) for lay in first for c in (False, True) for s in (False, True)]
    rest = [lay for lay in ("paged", "bt48") if lay not in first]
    return sets + [(lay, True, True) for lay in rest]


def candidate_cases(args: argparse.Namespace, kinds: list[Kind]) -> list[Case]:
    if args.suite == "graph":
        shapes = [(t, h, GRAPH_W) for t in GRAPH_T for h in GRAPH_H]
        graph_kinds = [k for k in kinds if k.native is None and k.rope == ROPE]
        return [
            Case(k, t, h, w, lay, True, True)
            for k in graph_kinds
            for (t, h, w) in shapes
            for lay in ("flat", "bt")
        ]
    if args.smoke:
        shapes = [(t, h, w) for t in SMOKE_T for h in SMOKE_H for w in SMOKE_W]
        extra_shapes = [
            (t, h, w, x) for t in SMOKE_T for h in SMOKE_H for w, x in SMOKE_EXTRA_WIDTHS
        ]
    else:
        shapes = [(t, h, w) for t in DECODE_T for h in DECODE_H for w in WIDTHS] + list(PREFILL)
        extra_shapes = [
            (t, h, w, x) for t in DECODE_T for h in DECODE_H for w, x in EXTRA_WIDTHS
        ] + [(t, h, w, PREFILL_EXTRA_W) for (t, h, w) in PREFILL]
    # narrow latent widths (no DSA model's) only need split and unsplit tiles of each head
    # block, flat and through a block table
    narrow = [(t, h, w) for (t, h, w) in shapes if t in (1, 128) and w in (1, 2048)]
    narrow_flags = [("flat", True, True), ("bt", True, True)]
    wide = lambda k: k.latent == L or args.smoke  # noqa: E731

    def kind_shapes(k: Kind) -> list[tuple[int, int, int, int]]:
        if k.extra:
            return extra_shapes
        return [(t, h, w, 0) for (t, h, w) in (shapes if wide(k) else narrow)]

    return [
        Case(k, t, h, w, *flags, XW=x)
        for k in kinds
        for (t, h, w, x) in kind_shapes(k)
        for flags in (flag_sets(k) if wide(k) else narrow_flags)
    ]


# ----------------------------------------------------------------------------------------------
# the launcher, tapped: every kernel launch is recorded (and launched, compiled or dropped)


class Tap:
    """Stands in for a JITFunction in launch.py: ``kernel[grid](*args, **kwargs)`` is recorded,
    then launched (``mode`` "launch"), compiled without launching ("warmup") or dropped
    ("record")."""

    def __init__(self, real: Any):
        self.real = real
        self.mode = "launch"
        self.calls: list[tuple[tuple, dict]] = []

    def __getitem__(self, grid):
        def call(*a, **kw):
            self.calls.append((a, kw))
            if self.mode == "launch":
                return self.real[grid](*a, **kw)
            if self.mode == "warmup":
                return self.real.warmup(*a, grid=grid, **kw)
            return None

        return call


_TAPS: dict[str, Tap] = {}  # one per forward family (launch.FORWARD), and "merge"


def install_taps() -> dict[str, Tap]:
    if not _TAPS:
        for family, kernel in list(launch_mod.FORWARD.items()):
            _TAPS[family] = launch_mod.FORWARD[family] = Tap(kernel)
        _TAPS["merge"] = Tap(launch_mod.sparse_mla_merge_kernel)
        launch_mod.sparse_mla_merge_kernel = _TAPS["merge"]
    return _TAPS


@contextlib.contextmanager
def tap_mode(mode: str):
    taps = install_taps()
    old = {name: t.mode for name, t in taps.items()}
    for t in taps.values():
        t.mode = mode
        t.calls.clear()
    try:
        yield taps
    finally:
        for name, t in taps.items():
            t.mode = old[name]


def _dt(x: Any) -> str:
    return str(x.dtype).replace("torch.", "") if hasattr(x, "dtype") else type(x).__name__


def variant_keys(taps: dict[str, Tap]) -> tuple[str, str | None]:
    """The compiled variants of one call: forward (family, q and cache dtypes, constexprs,
    launch options) and merge (output dtype, constexprs, launch options), or None without a
    merge."""
    fwd = [(name, a, kw) for name, t in taps.items() if name != "merge" for a, kw in t.calls]
    merge = taps["merge"]
    assert len(fwd) == 1 and len(merge.calls) <= 1, (len(fwd), len(merge.calls))
    family, a, kw = fwd[0]
    key = f"fwd {family} q={_dt(a[0])} kv={_dt(a[2])} " + " ".join(
        f"{k}={v}" for k, v in sorted(kw.items())
    )
    mkey = None
    if merge.calls:
        ma, mkw = merge.calls[0]
        mkey = f"merge out={_dt(ma[2])} " + " ".join(f"{k}={v}" for k, v in sorted(mkw.items()))
    return key, mkey


_ZEROS: dict[tuple, Any] = {}


def _zeros(shape: tuple, dtype, device) -> Any:
    # the dry runs reuse their tiny tensors (without the caching allocator, as under the
    # sanitizers, every allocation would be a cudaMalloc and every free a device sync)
    key = (shape, dtype, str(device))
    if key not in _ZEROS:
        _ZEROS[key] = torch.zeros(shape, dtype=dtype, device=device)
    return _ZEROS[key]


def _row_bytes(k: Kind) -> int:
    """The last dimension of the kind's cache."""
    fixed = {
        "fp8_ds_mla": kv_format_mod.DS_MLA_ROW_BYTES,
        "fp8_ds_mla_v4": kv_format_mod.DS_V4_TOKEN_BYTES,
    }
    return fixed.get(k.kv_format, k.width)


def dry_run(case: Case, device, arch) -> tuple[str, str | None]:
    """The variant keys of a case, from the launcher with recording kernels (nothing launches;
    inputs are expanded views of tiny tensors, since only shapes, dtypes and flags matter)."""
    k, T, H, W = case.kind, case.T, case.H, case.W
    lay = LAYOUTS[case.layout]
    c = _row_bytes(k)
    cdt = k.dtype if k.kv_format == "auto" else torch.uint8
    cache = _zeros((2, lay["page"], c) if lay["page"] else (8, c), cdt, device)
    q = _zeros((1, 1, k.width), k.dtype, device).expand(T, H, k.width)
    i32 = torch.int32
    kw: dict[str, Any] = dict(kv_format=k.kv_format, return_lse=case.lse, kv_lora_rank=k.latent)
    kw["out"] = _zeros((1, 1, k.latent), k.dtype, device).expand(T, H, k.latent)
    kw["config"] = case.override(arch)
    if case.counts:
        kw["valid_counts"] = _zeros((1,), i32, device).expand(T)
    if lay["bs"]:
        kw.update(block_table=_zeros((1, 4), i32, device), block_size=lay["bs"])
        kw["req_ids"] = _zeros((1,), i32, device).expand(T)
    if k.scale == "tensor":
        kw["k_scale"] = _zeros((1,), torch.float32, device)
    elif k.scale == "float":
        kw["k_scale"] = 1.0
    if k.sink:
        kw["attn_sink"] = _zeros((1,), torch.float32, device).expand(H)
    if case.XW:
        xlay = EXTRA_LAYOUTS[k.extra]
        xshape = (3, xlay["page"], c) if xlay["page"] else (9, c)  # unlike the main cache's
        kw["extra_kv_cache"] = _zeros(xshape, cdt, device)
        kw["extra_indices"] = _zeros((1, 1), i32, device).expand(T, case.XW)
        if case.counts:
            kw["extra_valid_counts"] = _zeros((1,), i32, device).expand(T)
        if xlay["bs"]:
            kw.update(extra_block_table=_zeros((1, 5), i32, device), extra_block_size=xlay["bs"])
            kw["req_ids"] = _zeros((1,), i32, device).expand(T)
    with tap_mode("record") as taps:
        sparse_mla(q, cache, _zeros((1, 1), i32, device).expand(T, W), 0.05, **kw)
        return variant_keys(taps)


# ----------------------------------------------------------------------------------------------
# selection: one case per distinct variant, smallest first, in an order that covers features


def _score(c: Case) -> tuple:
    # prefer room for adversarial content (8 tokens take every token pattern and most count
    # values; 64 index slots), then the cheapest shape
    w = c.W + c.XW
    return (-min(c.T, 8), -min(c.T * w, 64), c.T * c.H * w, c.T, c.H, w, c.name)


def _features(c: Case, cfg: KernelConfig, keys: tuple[str, str | None]) -> set:
    return {
        ("kind", c.kind.name),
        ("layout", c.layout),
        ("counts", c.counts),
        ("lse", c.lse),
        ("split", keys[1] is not None),
        ("merge", keys[1]),
        ("tile", (cfg.block_h, cfg.block_n, cfg.num_warps, cfg.num_stages)),
        ("ahead", cfg.idx_ahead),
        ("T1", c.T == 1),
        ("W", c.W),
        ("kind-tile", (c.kind.name, cfg.block_h, cfg.block_n)),
    }


def coverage_order(cases: list[Case], info: dict) -> list[Case]:
    """Greedy: each next case adds the most features not yet covered (ties: smallest), so a
    truncated run (--max-cases) still spreads over formats, layouts, flags and tiles."""
    left = sorted(cases, key=_score)
    feats = {c: _features(c, *info[c]) for c in left}
    seen: set = set()
    out = []
    while left:
        best = max(range(len(left)), key=lambda i: (len(feats[left[i]] - seen), -i))
        c = left.pop(best)
        seen |= feats[c]
        out.append(c)
    return out


def variant_group(case: Case, cfg: KernelConfig, arch, on_gpu: bool) -> tuple:
    """What a case's compiled variants depend on besides its kind and flags: the configuration,
    the split count and the integer e4m3 decode (which the plan picks by token count): cases
    with equal groups compile the same kernels, so one dry run names them all."""
    splits = split_len_for(case.positions(cfg), cfg.num_splits, cfg.block_n)[1]
    fp8_native = arch.fp8_native if cfg.fp8_native is None else cfg.fp8_native
    decode = resolved_e4m3_decode(
        cfg, case.T, case.kind.kv_format, arch, fp8_native=fp8_native, on_gpu=on_gpu
    )
    flags = (case.kind, case.layout, case.counts, case.lse)
    return (*flags, dataclasses.replace(cfg, num_splits=1), splits, decode)


def select(cases: list[Case], device, arch, all_shapes: bool) -> tuple[list[Case], dict]:
    """One case per distinct forward variant and per distinct merge variant (the smallest that
    selects it), or every case with ``all_shapes``. Returns (cases, {case: (cfg, keys)}); the
    run order comes from :func:`filter_cases`."""
    groups: dict[tuple, list[Case]] = {}
    cfgs = {}
    for c in cases:
        cfg = c.config(arch)
        cfgs[c] = cfg
        groups.setdefault(variant_group(c, cfg, arch, device.type == "cuda"), []).append(c)
    info = {}
    for members in groups.values():
        keys = dry_run(members[0], device, arch)
        for c in members:
            info[c] = (cfgs[c], keys)
    if all_shapes:
        return list(cases), info
    best: dict[str, Case] = {}
    for c in cases:
        k = info[c][1][0]
        if k not in best or _score(c) < _score(best[k]):
            best[k] = c
    chosen = set(best.values())
    merges = {info[c][1][1] for c in chosen}
    best_m: dict[str, Case] = {}
    for c in cases:
        m = info[c][1][1]
        if m is not None and m not in merges and (m not in best_m or _score(c) < _score(best_m[m])):
            best_m[m] = c
    chosen |= set(best_m.values())
    # long prefills run whatever their variants: T 4096 at every head count, as vLLM calls it
    # (flat rows, valid_counts, LSE), bf16 and fp8_ds_mla
    chosen |= {
        c
        for c in cases
        if c.sampled
        and c.layout == "flat"
        and c.counts
        and c.lse
        and c.kind.native is None
        and c.kind.rope == ROPE
        and c.kind.name.split("-")[0] in ("auto", "dsmla")
        and c.kind.dtype == torch.bfloat16
    }
    return sorted(chosen, key=_score), info


def filter_cases(cases: list[Case], info: dict, args: argparse.Namespace) -> list[Case]:
    def text(c: Case) -> str:
        return f"{c.name} {config_label(info[c][0])}"

    for alternatives in args.only:
        subs = [s for s in alternatives.split(",") if s]
        cases = [c for c in cases if any(s in text(c) for s in subs)]
    # the greedy order is quadratic: a long unfiltered --all-shapes list keeps the size order
    cases = coverage_order(cases, info) if len(cases) <= 3000 else sorted(cases, key=_score)
    if args.max_tokens is not None:
        cases = [c for c in cases if c.T <= args.max_tokens]  # noqa: SIM300
    if args.skip_cases:
        cases = cases[args.skip_cases :]
    if args.max_cases is not None:
        cases = cases[: args.max_cases]
    return cases


def shard_cases(cases: list[Case], args: argparse.Namespace) -> list[Case]:
    """The cases of ``--shard K/N``: every N-th from the K-th (all without ``--shard``)."""
    if not args.shard:
        return cases
    k, n = args.shard
    return cases[k::n]


# ----------------------------------------------------------------------------------------------
# inputs: adversarial indices, NaN-poisoned caches


@dataclasses.dataclass
class Geometry:
    """Sizes of one case's cache and index space (the same for every seed of the case)."""

    n_sel: int  # valid indices are drawn from positions [0, n_sel)
    num_rows: int  # N, rows of the cache (flat logical order)
    page: int | None
    bs: int | None
    reqs: int = 0
    blocks_per_req: int = 0
    max_blocks: int = 0

    @property
    def num_blocks(self) -> int:
        return self.num_rows // self.page if self.page else 0


def geometry(case: Case, extra: bool = False) -> Geometry:
    """The main set's cache and index space, or (``extra``) the extra set's."""
    lay = EXTRA_LAYOUTS[case.kind.extra] if extra else LAYOUTS[case.layout]
    n_sel = max(2 * (case.XW if extra else case.W), 128)
    if lay["bs"]:
        bs = lay["bs"]
        reqs = min(case.T, 3)
        bpr = -(-n_sel // bs)
        # per request: its blocks, one decoy block; plus one spare block nobody maps
        nb = reqs * (bpr + 1) + 1
        # table columns: the request's blocks, then decoy, past-the-cache, 2^31 / bs, INT_MAX
        return Geometry(bpr * bs, nb * lay["page"], lay["page"], bs, reqs, bpr, bpr + 4)
    n = n_sel + DECOY_ROWS
    if lay["page"]:
        n = -(-n // lay["page"]) * lay["page"]
    return Geometry(n_sel, n, lay["page"], None)


def _gen(case: Case, seed: int):
    h = hashlib.sha256(f"{case.name}/{seed}".encode()).digest()
    g = torch.Generator(device="cpu")
    g.manual_seed(int.from_bytes(h[:8], "little"))
    return g


# token patterns; the first tokens get them in this order, so T = 1 gets the mixed one
MIXED, HOLE, EMPTY, ALL_BAD, DUPS, CLEAN = range(6)
_FIRST = (MIXED, EMPTY, HOLE, ALL_BAD, DUPS, CLEAN)
_CYCLE = (MIXED, HOLE, CLEAN, DUPS, EMPTY, ALL_BAD)
# the extra set's patterns for the same tokens: token 1 has nothing in the main set and all of
# its extra set, token 2 the other way round, token 3 nothing valid in either (zeros, LSE -inf)
_FIRST_EXTRA = (MIXED, CLEAN, EMPTY, ALL_BAD, HOLE, DUPS)
_CYCLE_EXTRA_SHIFT = 3  # later tokens: _CYCLE shifted, so a set's empty token has the other's
# the count cycle, shifted likewise: where the main count is 0 or -1 (tokens 1, 5) the extra
# set's is W + 3 or 3W/4, and the reverse (tokens 3, 6): no token is emptied by both counts
_COUNTS_EXTRA_SHIFT = 2


def build_indices(case: Case, cfg: KernelConfig, geo: Geometry, g, extra: bool = False) -> dict:
    """CPU int32 indices [T, W] (and valid_counts, block table, request ids): per token one of
    the patterns above; the mixed one has a leading -1 run longer than a gather step, a trailing
    run, a whole split of -1 (when there are 3+ splits), N, N+k, INT_MIN, INT_MAX and -2
    sprinkled in, and duplicates. Garbage past valid_counts points at decoy rows (NaN).
    ``extra``: the extra set's [T, XW] (its splits are those of the gather positions it takes
    after the main set's, its patterns and counts shifted against the main set's)."""
    T = case.T
    W = case.XW if extra else case.W
    split_len, num_splits = split_len_for(case.positions(cfg), cfg.num_splits, cfg.block_n)
    # where this set's entries stand among the gather positions the splits divide
    start = case.positions(cfg) - case.XW if extra else 0

    def split_cols(k: int) -> slice:  # this set's columns in split k (may be empty)
        lo = min(max(k * split_len - start, 0), W)
        return slice(lo, min(max((k + 1) * split_len - start, 0), W))

    first, cycle_shift = (_FIRST_EXTRA, _CYCLE_EXTRA_SHIFT) if extra else (_FIRST, 0)
    count_shift = _COUNTS_EXTRA_SHIFT if extra else 0
    perm = torch.randperm(geo.n_sel, generator=g)[:W]
    shift = torch.randint(0, geo.n_sel, (T, 1), generator=g)
    idx = (perm[None, :] + shift) % geo.n_sel  # distinct within a token
    out: dict[str, Any] = {}
    if geo.bs:
        bs, bpr, reqs = geo.bs, geo.blocks_per_req, geo.reqs
        nb = geo.num_blocks
        table = torch.empty(reqs, geo.max_blocks, dtype=torch.int64)
        phys = torch.randperm(nb - 1, generator=g)  # block nb - 1 stays unmapped
        table[:, : bpr + 1] = phys[: reqs * (bpr + 1)].view(reqs, bpr + 1)
        if bpr >= 2:
            table[:, bpr // 2] = -1  # a hole in the table: its positions are skipped
        table[:, bpr + 1] = nb  # one past the cache
        table[:, bpr + 2] = 2**31 // bs  # block * bs would wrap int32
        table[:, bpr + 3] = I32_MAX
        out["block_table"] = table.to(torch.int32)
        out["req_ids"] = torch.randint(0, reqs, (T,), generator=g, dtype=torch.int32)
        out["block_size"] = bs
        past = geo.max_blocks * bs
        bad = [-1, -2, I32_MIN, I32_MAX, past, past + 17, (bpr + 1) * bs + 3, (bpr + 2) * bs + 5]
        bad += [(bpr + 3) * bs + 1]
        decoys = bpr * bs + torch.arange(bs)  # the decoy column: valid rows nobody selects
    else:
        n = geo.num_rows
        bad = [-1, -2, I32_MIN, I32_MAX, n, n + 17, 4 * n]
        decoys = geo.n_sel + torch.arange(geo.num_rows - geo.n_sel)
    bad_t = torch.tensor(bad, dtype=torch.int64)

    def cyc(n: int):  # n entries cycling through the invalid values
        return bad_t[torch.arange(n) % len(bad_t)]

    pattern = torch.tensor(
        [
            first[t] if t < len(first) else _CYCLE[(t - len(first) + cycle_shift) % len(_CYCLE)]
            for t in range(T)
        ]
    )
    for p in range(len(_FIRST)):
        sel = (pattern == p).nonzero()[:, 0]
        if not len(sel):
            continue
        rows = idx[sel]  # [tokens with this pattern, W], edited column-wise, written back
        if p == MIXED:
            lead = min(W // 4, cfg.block_n + 3)
            trail = W // 8
            dup = rows[:, lead : lead + 1].clone()
            cols = torch.arange(lead + 1, max(lead + 1, W - trail - 1), 7)
            rows[:, cols] = cyc(len(cols))
            cols = torch.arange(lead + 3, max(lead + 3, W - trail), 11)
            rows[:, cols] = dup
            if num_splits >= 3:
                rows[:, split_cols(1)] = -1  # a whole split (this set's part of it)
            rows[:, :lead] = -1
            if trail:
                rows[:, W - trail :] = -1
        elif p == HOLE:
            if num_splits >= 2 and split_cols(1).stop > split_cols(1).start:
                rows[:, split_cols(1)] = -1
            else:
                rows[:, W // 3 : W // 3 + max(1, W // 3)] = -1
            rows[:, -1] = bad_t[5]
        elif p == EMPTY:
            rows[:] = -1
        elif p == ALL_BAD:
            rows[:] = cyc(W)
        elif p == DUPS:
            rows[:] = rows[:, :1]
            rows[:, 1::5] = -1
        elif W >= 2:
            rows[:, -1] = I32_MAX
        idx[sel] = rows
    if case.counts:
        cut, cut2 = max(1, 3 * W // 4), max(1, W // 2)
        cycle = (cut, 0, W, W + 3, I32_MAX, -1, cut2)
        counts = torch.tensor(
            [cycle[(t + count_shift) % len(cycle)] for t in range(T)], dtype=torch.int64
        )
        for value in set(cycle):
            c = max(0, min(value, W))
            sel = (counts == value).nonzero()[:, 0]
            if c < W and len(sel):
                # garbage: decoy rows (NaN in the kernel's cache), every third one invalid
                tail = decoys[torch.arange(W - c) % len(decoys)]
                tail[::3] = cyc(len(tail[::3]))
                idx[sel, c:] = tail
        out["valid_counts"] = counts.to(torch.int32)
    out["indices"] = idx.to(torch.int32)
    return out


def build_cache(case: Case, geo: Geometry, g, extra: bool = False) -> dict:
    """CPU cache in the case's format, flat [N, C] or paged [nb, page, C] (clean), the float
    rows it holds, and the format's keyword arguments (``extra``: the extra set's cache, in the
    same format; no keyword arguments of its own)."""
    k = case.kind
    rows = torch.randn(geo.num_rows, k.width, generator=g)
    rows[::5] *= 3.0  # rows of larger logits: running-max jumps
    rows[1:3, 256:384] = 0.0  # an all-zero 128-group (fp8_ds_mla: scale 0 must decode to 0)
    fkw: dict[str, Any] = {"kv_format": k.kv_format}
    if k.v4:
        # vLLM's layout: pages of geo.page records at its padded page stride (paged already)
        cache = kv_format_mod.pack_fp8_ds_mla_v4(rows, geo.page)
    elif k.kv_format == "auto":
        cache = rows.to(k.dtype)
    elif k.kv_format == "fp8":
        if extra:  # the call's one k_scale serves both caches: no fp8 extra kinds
            raise ValueError(f"{k.name}: an extra set in per-tensor fp8 has no kind here")
        q8, scale = quantize_fp8(rows)
        cache = q8.view(torch.uint8)
        fkw["k_scale"] = scale if k.scale == "float" else torch.tensor([scale])
    else:
        full = rows if k.rope else torch.cat([rows, torch.zeros_like(rows[:, :ROPE])], dim=1)
        fmt = "fp32" if int(torch.randint(0, 2, (1,), generator=g)) else "pow2"
        cache = pack_fp8_ds_mla(full, fmt)
    if geo.page and not k.v4:
        cache = cache.view(geo.num_blocks, geo.page, cache.shape[-1])
    if k.sink and not extra:
        # around the logits' scale, one head -inf (no sink) and one +inf (zero output)
        sink = torch.randn(case.H, generator=g) * 2.0
        if case.H >= 3:
            sink[1], sink[2] = float("-inf"), float("inf")
        fkw["attn_sink"] = sink
    return {"cache": cache, "fmt": fkw}


def _fill(x):
    return 0xFF if x.dtype == torch.uint8 else float("nan")


def poisoned_cache(cache, geo: Geometry, ind: dict, layers: int = 3, kv_format: str = "auto"):
    """The kernel's copy: every row that no valid index reaches is NaN (0xFF); a paged cache
    sits as layer 1 of ``layers`` in one allocation whose other layers (the memory between its
    blocks) are NaN too. Returns (tensor to put on the device, the view to pass). A V4 record
    cache (``kv_format`` "fp8_ds_mla_v4") is poisoned by :func:`poisoned_v4_cache`."""
    rows, valid = physical_rows(
        ind["indices"],
        geo.num_rows,
        ind.get("valid_counts"),
        ind.get("block_table"),
        ind.get("req_ids"),
        ind.get("block_size"),
    )
    used = torch.zeros(geo.num_rows, dtype=torch.bool)
    used[rows[valid]] = True
    if kv_format == "fp8_ds_mla_v4":
        return poisoned_v4_cache(cache, geo, used, layers)
    kc = cache.clone()
    flat = kc.view(geo.num_rows, kc.shape[-1])
    flat[~used] = _fill(kc)
    if not geo.page:
        return kc, lambda t: t
    big = torch.full((geo.num_blocks, layers, geo.page, kc.shape[-1]), _fill(kc), dtype=kc.dtype)
    big[:, 1] = kc
    return big, lambda t: t[:, 1]


def poisoned_v4_cache(cache, geo: Geometry, used, layers: int = 3):
    """A V4 record cache (uint8 [nb, P, 584] pages) for the kernel: a page's P data rows (576
    bytes each, from the page's first byte) and then its P scale rows (8 bytes each) are not
    contiguous per slot, so the slots no valid index reaches (``used`` bool [nb * P], flat slot
    order) get 0xFF in both their data row (e4m3 NaN codes) and their scale row (2^128 = inf);
    every slot's pad byte (the kernel reads 7 scale bytes, never the 8th) is 0xFF too. The
    pages sit as layer 1 of ``layers`` pages of vLLM's padded stride each, the padding and the
    other layers 0xFF. Returns (tensor to put on the device, the view to pass)."""
    V4 = kv_format_mod
    nb, page = geo.num_blocks, geo.page
    page_bytes = page * V4.DS_V4_TOKEN_BYTES
    data_end = page * V4.DS_V4_DATA_BYTES
    pages = cache.as_strided((nb, page_bytes), (cache.stride(0), 1)).clone()
    free = ~used.view(nb, page)
    data = pages[:, :data_end].view(nb, page, V4.DS_V4_DATA_BYTES)
    scales = pages[:, data_end:].view(nb, page, V4.DS_V4_SCALE_BYTES)
    data[free] = 0xFF
    scales[free] = 0xFF
    scales[..., V4.DS_V4_NUM_SCALES :] = 0xFF
    stride = V4.ds_mla_v4_page_stride(page)
    big = torch.full((nb, layers, stride), 0xFF, dtype=torch.uint8)
    big[:, 1, :page_bytes] = pages
    shape = (page, V4.DS_V4_TOKEN_BYTES)
    return big, lambda t: t[:, 1, :page_bytes].unflatten(-1, shape)


def checked_rows(case: Case) -> Any:
    """Tokens compared with the reference: all, or for a long prefill the adversarial first
    tokens and an even spread."""
    if not case.sampled:
        return None
    head = torch.arange(12)
    spread = torch.linspace(12, case.T - 1, PREFILL_CHECKED - 12).round().long()
    return torch.unique(torch.cat([head, spread]))


def reference(
    case: Case, q, cache, ind: dict, fkw: dict, rows, device, extra: tuple | None = None
) -> tuple[Any, Any]:
    """sparse_mla_reference on the clean cache (testing.reference_dtype: float64 for fp32 q,
    float32 otherwise); ``extra``: (clean extra cache, its index dict) for a case with an extra
    set."""
    kw = {k: v for k, v in ind.items() if k in ("block_table", "block_size")}
    idx, counts, req = ind["indices"], ind.get("valid_counts"), ind.get("req_ids")
    xidx = xcounts = None
    if extra is not None:
        xcache, xind = extra
        xidx, xcounts = xind["indices"], xind.get("valid_counts")
        kw["extra_kv_cache"] = xcache
        if "block_table" in xind:
            kw["extra_block_table"] = xind["block_table"]
            kw["extra_block_size"] = xind["block_size"]
    if rows is not None:
        q, idx = q[rows], idx[rows]
        counts = counts[rows] if counts is not None else None
        req = req[rows] if req is not None else None
        xidx = xidx[rows] if xidx is not None else None
        xcounts = xcounts[rows] if xcounts is not None else None
    if counts is not None:
        kw["valid_counts"] = counts
    if req is not None:
        kw["req_ids"] = req
    if xidx is not None:
        kw["extra_indices"] = xidx
    if xcounts is not None:
        kw["extra_valid_counts"] = xcounts
    mv = lambda x: x.to(device) if hasattr(x, "to") else x  # noqa: E731
    kw = {k: mv(v) for k, v in kw.items()}
    fkw = {k: mv(v) for k, v in fkw.items()}
    cdt = reference_dtype(case.kind.dtype)
    out, lse = sparse_mla_reference(
        mv(q),
        mv(cache),
        mv(idx),
        case.kind.width**-0.5,
        kv_lora_rank=case.kind.latent,
        return_lse=True,
        compute_dtype=cdt,
        **fkw,
        **kw,
    )
    return out.cpu(), lse.cpu()


def check(case: Case, out, lse, ref_out, ref_lse, rows) -> tuple[list[str], float, float]:
    """Failures (empty if none), relative error / tolerance, LSE error / tolerance: the shared
    comparison (testing.compare_sparse_mla) of ``out`` (every token) and ``lse`` with the
    reference of the tokens ``rows`` (all when None), at the tolerance of the case's q dtype."""
    tol = sparse_mla_tolerance(case.kind.dtype)
    res = compare_sparse_mla(out, ref_out, lse=lse, ref_lse=ref_lse, rows=rows, tolerance=tol)
    return res.failures, res.err_ratio, res.lse_ratio or 0.0


# ----------------------------------------------------------------------------------------------
# running one case


@dataclasses.dataclass
class Inputs:
    q: Any
    ind: dict
    cache: Any  # clean, CPU
    fmt: dict
    geo: Geometry
    # the extra set: its clean CPU cache, index dict (indices, valid_counts, block table) and
    # geometry; None without one
    xcache: Any = None
    xind: dict | None = None
    xgeo: Geometry | None = None

    @property
    def extra(self) -> tuple | None:
        """(clean extra cache, its index dict) for :func:`reference`, or None."""
        return None if self.xind is None else (self.xcache, self.xind)


def make_case_inputs(case: Case, cfg: KernelConfig, seed: int = 0, cache_seed: int | None = None):
    geo = geometry(case)
    g = _gen(case, seed)
    cg = g if cache_seed is None else _gen(case, cache_seed)
    built = build_cache(case, geo, cg)
    q = torch.randn(case.T, case.H, case.kind.width, generator=g).to(case.kind.dtype)
    ind = build_indices(case, cfg, geo, g)
    inp = Inputs(q, ind, built["cache"], built["fmt"], geo)
    if case.XW:
        inp.xgeo = geometry(case, extra=True)
        inp.xcache = build_cache(case, inp.xgeo, cg, extra=True)["cache"]
        inp.xind = build_indices(case, cfg, inp.xgeo, g, extra=True)
        # one request id per token serves both block tables (both have min(T, 3) requests)
        req = ind.get("req_ids", inp.xind.get("req_ids"))
        if req is not None:
            ind["req_ids"] = inp.xind["req_ids"] = req
    return inp


def _extra_device_kwargs(inp: Inputs, device) -> dict:
    """The extra set's arguments on the device, its cache poisoned like the main one."""
    if inp.xind is None:
        return {}
    xkc, xview = poisoned_cache(inp.xcache, inp.xgeo, inp.xind, kv_format=inp.fmt["kv_format"])
    kw = {
        "extra_kv_cache": xview(xkc.to(device)),
        "extra_indices": inp.xind["indices"].to(device),
    }
    if "valid_counts" in inp.xind:
        kw["extra_valid_counts"] = inp.xind["valid_counts"].to(device)
    if "block_table" in inp.xind:
        kw["extra_block_table"] = inp.xind["block_table"].to(device)
        kw["extra_block_size"] = inp.xind["block_size"]
    return kw


def _device_kwargs(inp: Inputs, device) -> dict:
    kw = {}
    for k in ("valid_counts", "block_table", "req_ids"):
        if k in inp.ind:
            kw[k] = inp.ind[k].to(device)
    if "block_size" in inp.ind:
        kw["block_size"] = inp.ind["block_size"]
    for k, v in inp.fmt.items():
        kw[k] = v.to(device) if hasattr(v, "to") else v
    return kw


class Runner:
    def __init__(self, args: argparse.Namespace, device, arch, emu=None):
        self.args, self.device, self.arch, self.emu = args, device, arch, emu
        ref = args.ref_device
        if ref == "auto":
            ref = "cpu" if args.suite == "sanitize" else "device"
        self.ref_device = torch.device("cpu") if ref == "cpu" else device
        self.seen_binaries: set[int] = set()
        self.ptx: list[dict] = []

    def sync(self) -> None:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)

    def run(self, case: Case, info: tuple) -> dict:
        cfg, keys = info
        res = {
            "name": case.name,
            "kind": case.kind.name,
            "dtype": str(case.kind.dtype).replace("torch.", ""),
            "kv_format": case.kind.kv_format,
            "T": case.T,
            "H": case.H,
            "W": case.W,
            "layout": case.layout,
            "extra_width": case.XW,
            "counts": case.counts,
            "lse": case.lse,
            "config": config_label(cfg),
            "fwd_variant": keys[0],
            "merge_variant": keys[1],
            "fails": [],
        }
        t0 = time.perf_counter()
        try:
            if self.args.suite == "graph":
                res.update(self._graph(case, cfg, keys))
            else:
                res.update(self._eager(case, cfg, keys))
        except Exception as e:  # a case that raises is a failure, reported with its cause
            res["fails"].append(f"{type(e).__name__}: {e}"[:800])
            res["traceback"] = traceback.format_exc(limit=6)
        res["seconds"] = round(time.perf_counter() - t0, 3)
        res["status"] = "FAIL" if res["fails"] else ("compiled" if self.args.compile_only else "ok")
        return res

    def _call(self, case, inp_dev: dict, out, mode: str = "launch"):
        with tap_mode(mode) as taps:
            r = sparse_mla(
                inp_dev["q"],
                inp_dev["kv"],
                inp_dev["indices"],
                case.kind.width**-0.5,
                kv_lora_rank=case.kind.latent,
                out=out,
                return_lse=case.lse,
                config=case.override(self.arch),
                **inp_dev["kw"],
            )
            return r, variant_keys(taps)

    def _launched(self, keys, got) -> list[str]:
        if got != keys:
            return [f"launched variant {got} is not the selected {keys}"]
        return []

    def _eager(self, case: Case, cfg, keys) -> dict:
        dev = self.device
        inp = make_case_inputs(case, cfg)
        kc, view = poisoned_cache(inp.cache, inp.geo, inp.ind, kv_format=inp.fmt["kv_format"])
        d = {
            "q": inp.q.to(dev),
            "kv": view(kc.to(dev)),
            "indices": inp.ind["indices"].to(dev),
            "kw": _device_kwargs(inp, dev) | _extra_device_kwargs(inp, dev),
        }
        out = torch.full(
            (case.T, case.H, case.kind.latent), float("nan"), dtype=case.kind.dtype, device=dev
        )
        if self.args.compile_only:
            # under the interpreter nothing compiles: the launch is only recorded
            _, got = self._call(case, d, out, "record" if dev.type == "cpu" else "warmup")
            extra = {"fails": self._launched(keys, got)}
            if self.emu is not None:
                ptx = self._ptx_check()
                extra = {"ptx": ptx["ptx"], "fails": extra["fails"] + ptx["fails"]}
            return extra
        r, got = self._call(case, d, out)
        self.sync()
        fails = self._launched(keys, got)
        res_out, lse = r if case.lse else (r, None)
        if res_out is not out:
            fails.append("the result is not the given out tensor")
        rows = checked_rows(case)
        ref_out, ref_lse = reference(
            case, inp.q, inp.cache, inp.ind, inp.fmt, rows, self.ref_device, inp.extra
        )
        f, e, le = check(
            case, out.cpu(), None if lse is None else lse.cpu(), ref_out, ref_lse, rows
        )
        extra = {"err_ratio": e, "lse_ratio": le, "fails": fails + f}
        if self.emu is not None:
            ptx = self._ptx_check()
            extra["ptx"] = ptx["ptx"]
            extra["fails"] += ptx["fails"]
        return extra

    def _ptx_check(self) -> dict:
        import ptx_jit

        limit = self.arch.smem_bytes
        fails, lines = [], []
        for tap in _TAPS.values():
            for ck in ptx_jit.loaded(tap.real):
                if id(ck) in self.seen_binaries:
                    continue
                self.seen_binaries.add(id(ck))
                rec = ptx_jit.describe(ck)
                lines.append(rec.line())
                self.ptx.append(dataclasses.asdict(rec) | {"limit": limit})
                if rec.target != f"sm_{self.emu.cc}" or not rec.is_ptx:
                    fails.append(f"{rec.name}: loaded {rec.line()}, not sm_{self.emu.cc} PTX")
                if rec.shared > limit:
                    fails.append(
                        f"{rec.name}: needs {rec.shared} B of shared memory, sm{self.emu.cc} "
                        f"offers {limit}"
                    )
        return {"ptx": lines, "fails": fails}

    def _graph(self, case: Case, cfg, keys) -> dict:
        """Warm, eager call under sync debug mode "error", capture, then replays with new
        q / indices / counts / table / request ids / k_scale written in place, each checked."""
        dev = self.device
        if case.XW or case.kind.v4:  # make_kinds gives the graph suite neither
            raise ValueError(f"{case.name}: the graph suite replays no extra set or V4 record")
        inp = make_case_inputs(case, cfg, seed=1, cache_seed=0)
        kc, view = poisoned_cache(inp.cache, inp.geo, inp.ind)
        kc_dev = kc.to(dev)
        d = {
            "q": inp.q.to(dev),
            "kv": view(kc_dev),
            "indices": inp.ind["indices"].to(dev),
            "kw": _device_kwargs(inp, dev),
        }
        out = torch.full(
            (case.T, case.H, case.kind.latent), float("nan"), dtype=case.kind.dtype, device=dev
        )
        fails: list[str] = []
        log: list[str] = []
        worst = [0.0, 0.0]

        def verify(what: str, inp_now: Inputs, lse) -> None:
            ref_out, ref_lse = reference(
                case, inp_now.q, inp_now.cache, inp_now.ind, inp_now.fmt, None, self.ref_device
            )
            f, e, le = check(case, out.cpu(), lse.cpu(), ref_out, ref_lse, None)
            worst[0], worst[1] = max(worst[0], e), max(worst[1], le)
            fails.extend(f"{what}: {x}" for x in f)
            log.append(f"{what}: err/tol {e:.2f}")

        (o, lse), got = self._call(case, d, out)  # compiles
        fails += self._launched(keys, got)
        self.sync()
        verify("warm-up call", inp, lse)
        out.fill_(float("nan"))
        torch.cuda.set_sync_debug_mode("error")
        try:
            (o, lse), _ = self._call(case, d, out)
        except RuntimeError as e:
            fails.append(f"eager call synchronises with the host: {e}"[:600])
        finally:
            torch.cuda.set_sync_debug_mode(0)
        self.sync()
        verify("eager call, sync debug mode error", inp, lse)

        side = torch.cuda.Stream(dev)
        side.wait_stream(torch.cuda.current_stream(dev))
        with torch.cuda.stream(side):
            self._call(case, d, out)
        torch.cuda.current_stream(dev).wait_stream(side)
        self.sync()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            (o, lse_g), _ = self._call(case, d, out)
        base_scale = inp.fmt.get("k_scale")
        for r in range(1, self.args.replays + 1):
            new = make_case_inputs(case, cfg, seed=1 + r, cache_seed=0)
            if isinstance(base_scale, torch.Tensor):  # the tensor form may change between replays
                new.fmt["k_scale"] = base_scale * (1.0 + 0.25 * r)
                d["kw"]["k_scale"].copy_(new.fmt["k_scale"])
            d["q"].copy_(new.q)
            d["indices"].copy_(new.ind["indices"])
            for k in ("valid_counts", "block_table", "req_ids"):
                if k in new.ind:
                    d["kw"][k].copy_(new.ind[k])
            kc_new, _ = poisoned_cache(new.cache, new.geo, new.ind)
            kc_dev.copy_(kc_new)
            out.fill_(float("nan"))
            lse_g.fill_(float("nan"))
            graph.replay()
            self.sync()
            verify(f"replay {r}", new, lse_g)
        return {"err_ratio": worst[0], "lse_ratio": worst[1], "fails": fails, "log": log}


# ----------------------------------------------------------------------------------------------
# reporting


def _line(i: int, n: int, r: dict) -> str:
    err = r.get("err_ratio")
    e = f"err/tol {err:5.2f}" if err is not None else ""
    if r.get("lse") and r.get("lse_ratio") is not None and err is not None:
        e += f"  lse/tol {r['lse_ratio']:5.2f}"
    s = f"[{i:4d}/{n}] {r['status']:<8s} {r['seconds']:7.2f}s  {r['name']:<38s} {r['config']:<22s} {e}"
    for f in r["fails"][:4]:
        s += f"\n        ! {f}"
    for p in r.get("ptx", []):
        s += f"\n        ptx {p}"
    return s


def summary(results: list[dict], title: str) -> tuple[str, bool]:
    rows: dict[str, dict] = {}
    for r in results:
        row = rows.setdefault(r["kind"], {"n": 0, "ok": 0, "fail": 0, "worst": 0.0, "s": 0.0})
        row["n"] += 1
        row["fail" if r["status"] == "FAIL" else "ok"] += 1
        row["worst"] = max(row["worst"], r.get("err_ratio") or 0.0)
        row["s"] += r["seconds"]
    head = f"{'kind':<16s} {'cases':>6s} {'ok':>6s} {'fail':>6s} {'worst err/tol':>14s} {'seconds':>9s}"
    lines = [f"== {title}", head, "-" * len(head)]
    for kind, row in sorted(rows.items()):
        lines.append(
            f"{kind:<16s} {row['n']:6d} {row['ok']:6d} {row['fail']:6d} {row['worst']:14.2f} "
            f"{row['s']:9.1f}"
        )
    n = len(results)
    nfail = sum(r["status"] == "FAIL" for r in results)
    total = sum(r["seconds"] for r in results)
    lines.append("-" * len(head))
    lines.append(f"{'all':<16s} {n:6d} {n - nfail:6d} {nfail:6d} {'':14s} {total:9.1f}")
    ok = nfail == 0 and n > 0
    verdict = "PASS" if ok else ("FAIL" if n else "FAIL (no case ran)")
    lines.append(f"RESULT: {verdict}: {n} cases, {nfail} failed")
    return "\n".join(lines), ok


def _versions(device) -> dict:
    import triton

    env = {"torch": torch.__version__, "triton": triton.__version__, "device": str(device)}
    if device.type == "cuda":
        env["gpu"] = torch.cuda.get_device_name(device)
    return env


def _log_path(args: argparse.Namespace) -> str | None:
    if args.log:
        return args.log
    out = args.out
    if not out:
        return None
    name = "reliability-" + ("smoke" if args.smoke else args.suite)
    if args.suite == "emulate":
        name += f"-sm{args.arch}"
    if args.shard:
        name += f"-shard{args.shard[0]}of{args.shard[1]}"
    return os.path.join(out, name + ".json")


def _write_log(path: str | None, payload: dict) -> None:
    if not path:
        return
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    with open(path, "w") as f:
        json.dump(payload, f, indent=1, default=str)
    print(f"log: {path}", flush=True)


def merge_logs(paths: Iterable[str]) -> int:
    results, ptx, titles = [], [], []
    for p in paths:
        with open(p) as f:
            log = json.load(f)
        results += log["results"]
        ptx += log.get("ptx", [])
        titles.append(log.get("title", p))
    for i, r in enumerate(results, 1):
        if r["status"] == "FAIL":
            print(_line(i, len(results), r))
    text, ok = summary(results, f"{len(titles)} logs: " + "; ".join(sorted(set(titles))))
    print(text, flush=True)
    return 0 if ok else 1


# ----------------------------------------------------------------------------------------------
# parallel shards


def _run_jobs(args: argparse.Namespace, argv: list[str]) -> int:
    """Run the selection in ``args.jobs`` processes (shards), then print the combined results."""
    out_dir = args.out
    if out_dir:
        os.makedirs(out_dir, exist_ok=True)
    tmp = tempfile.mkdtemp(prefix=f"reliability-{args.suite}-jobs-", dir=out_dir)
    clean: list[str] = []
    skip = False
    for a in argv:
        if skip:
            skip = False
            continue
        if a == "--jobs" or a == "--log":
            skip = True
            continue
        if a.startswith("--jobs=") or a.startswith("--log="):
            continue
        clean.append(a)
    threads = max(1, (os.cpu_count() or 1) // args.jobs)
    t0 = time.perf_counter()
    results, ptx, ok = [], [], True
    with contextlib.ExitStack() as stack:
        procs = []
        for k in range(args.jobs):
            log = os.path.join(tmp, f"shard{k}.json")
            cmd = [sys.executable, os.path.abspath(__file__), *clean, "--shard", f"{k}/{args.jobs}"]
            cmd += ["--log", log, "--worker", "--threads", str(threads)]
            text = stack.enter_context(open(os.path.join(tmp, f"shard{k}.txt"), "w"))
            proc = subprocess.Popen(cmd, stdout=text, stderr=subprocess.STDOUT)
            procs.append((k, log, text.name, proc))
        for k, log, text_name, proc in procs:
            rc = proc.wait()
            print(
                f"shard {k}/{args.jobs}: exit {rc} after {time.perf_counter() - t0:.0f}s "
                f"(output {text_name})",
                flush=True,
            )
            if not os.path.exists(log):
                if rc == 0:  # a shard that no case fell in (fewer cases than jobs)
                    continue
                ok = False
                with open(text_name) as f:
                    print("".join(f.readlines()[-30:]))
                continue
            with open(log) as f:
                payload = json.load(f)
            results += payload["results"]
            ptx += payload.get("ptx", [])
            ok &= rc in (0, 1)  # 1: failures, reported in the results
    for i, r in enumerate(results, 1):
        print(_line(i, len(results), r))
    title = _title(args) + f", {args.jobs} processes"
    _print_ptx(ptx)
    text, passed = summary(results, title)
    _write_log(
        _log_path(args), {"title": title, "args": vars(args), "results": results, "ptx": ptx}
    )
    print(text, flush=True)
    return 0 if (ok and passed) else 1


def _title(args: argparse.Namespace) -> str:
    t = "smoke" if args.smoke else args.suite
    if args.suite == "emulate":
        t += f" sm{args.arch} (PTX JIT)"
    if args.compile_only:
        t += " compile-only"
    if args.split_qk:
        t += " split-qk"
    if args.rows_ws:
        t += " rows-ws"
    if args.ds_alt:
        t += " ds-alt"
    return t


def _print_ptx(ptx: list[dict]) -> None:
    if not ptx:
        return
    print(f"== {len(ptx)} emulated binaries (name, PTX .target, MMA, shared / target limit)")
    for p in ptx:
        print(
            f"  {p['name']:<26s} {p['target']}  {p['mma']:<8s} {p['shared'] / 1024:7.1f} KB / "
            f"{p['limit'] / 1024:.0f} KB  {'ptx' if p['is_ptx'] else 'CUBIN'}"
        )


# ----------------------------------------------------------------------------------------------


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    args = _parse(argv)
    if args.merge:
        return merge_logs(args.merge)
    _setup_env(args)
    _imports()
    global _SPLIT_QK, _ROWS_WS, _DS_ALT
    _SPLIT_QK = args.split_qk
    _ROWS_WS = args.rows_ws
    _DS_ALT = args.ds_alt
    for flag, on, what in (
        ("--split-qk", args.split_qk, "the mma.sync Gluon kernels"),
        ("--rows-ws", args.rows_ws, "sm90's warp-specialized Gluon kernel"),
        ("--ds-alt", args.ds_alt, "sm90's alternating Gluon kernel"),
    ):
        if on and (args.smoke or not torch.cuda.is_available()):
            # (before any worker starts; a CPU listing dry-runs on meta tensors, where they
            # do not)
            print(f"{flag} forces {what}, which runs on a GPU only", file=sys.stderr)
            return 2
    if args.threads:
        torch.set_num_threads(args.threads)
    if args.jobs > 1 and not args.list:
        return _run_jobs(args, argv)

    if args.smoke:
        device = torch.device("cpu")  # arch_of(cpu) is the H200's sm90
    elif getattr(args, "cpu_list", False):
        device = torch.device("meta")  # arch_of: sm90 too; the dry runs need no data
    else:
        if not torch.cuda.is_available():
            print("no CUDA device: run on the GPU, or use --smoke on CPU", file=sys.stderr)
            return 2
        device = torch.device("cuda", torch.cuda.current_device())
    emu = None
    if args.suite == "emulate":
        sys.path.insert(0, HERE)
        import ptx_jit

        install_taps()
        emu = ptx_jit.enable(args.arch, reset=[t.real for t in _TAPS.values()])
        print(f"PTX JIT emulation of sm_{args.arch}: Triton cache {emu.cache_dir}", flush=True)
    arch = heuristics.arch_of(device)
    if emu is not None and device.type != "cuda":  # --list without a GPU: the emulated target
        from triton_mla_sparse.ops import target
        from triton_mla_sparse.ops.sparse_mla import interface

        arch = target._cuda_arch(0)
        interface.arch_of = lambda _device: arch
    kinds = make_kinds(args, arch)
    t0 = time.perf_counter()
    cands = candidate_cases(args, kinds)
    if args.suite == "graph":
        cases, info = select(cands, device, arch, all_shapes=True)
    else:
        cases, info = select(cands, device, arch, args.all_shapes)
    n_all = len(cases)
    cases = filter_cases(cases, info, args)
    n_filtered = len(cases)
    cases = shard_cases(cases, args)
    title = _title(args)
    print(
        f"{title}: arch {arch.backend} {arch.cc} ({arch.num_sms} SMs), {len(cands)} candidate "
        f"shapes x flags, {n_all} selected, {len(cases)} to run "
        f"(enumerated in {time.perf_counter() - t0:.1f}s)",
        flush=True,
    )
    if args.list:
        for i, c in enumerate(cases, 1):
            cfg, keys = info[c]
            print(f"[{i:4d}] {c.name:<38s} {config_label(cfg):<22s} {keys[0]}")
            if keys[1]:
                print(f"       {'':<38s} {'':<22s} {keys[1]}")
        return 0
    if not cases and n_filtered:
        # fewer cases than shards (a sanitizer's few cases over many processes): nothing of this
        # shard's to fail, and the other shards run the selection
        print(f"{title}: no case falls in shard {args.shard[0]}/{args.shard[1]}", flush=True)
        return 0
    runner = Runner(args, device, arch, emu)
    results = []
    for i, c in enumerate(cases, 1):
        r = runner.run(c, info[c])
        results.append(r)
        print(_line(i, len(cases), r), flush=True)
        if any("illegal" in f or "CUDA error" in f for f in r["fails"]):
            print("a CUDA error poisons the context: stopping", flush=True)
            break
    if emu is not None:
        emu.disable()
    payload = {
        "title": title,
        "args": {k: v for k, v in vars(args).items()},
        "env": _versions(device),
        "arch": dataclasses.asdict(arch),
        "results": results,
        "ptx": runner.ptx,
    }
    _write_log(_log_path(args), payload)
    if not args.worker:
        _print_ptx(runner.ptx)
    text, ok = summary(results, title)
    print(text, flush=True)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
