"""The launch plan (ops/sparse_mla/plan.py): every decision of a call, made once, before launch.

Pure Python on shapes (no kernel runs here, except through the interface test, which records the
plan sparse_mla hands to the launcher instead of launching)."""

from __future__ import annotations

import dataclasses
import inspect
import itertools

import pytest
import torch
from conftest import DEVICE

import triton_mla_sparse.ops.sparse_mla.launch as launch_mod
from triton_mla_sparse import KernelConfig, sparse_mla
from triton_mla_sparse.ops.sparse_mla.heuristics import (
    SHORT_SPLIT_FILL,
    TARGETS,
    Arch,
    choose_config,
    fp16_mma_for,
    long_splits_pay,
    num_splits_for,
    split_len_for,
)
from triton_mla_sparse.ops.sparse_mla.plan import (
    AMPERE_FAMILIES,
    DS_MLA,
    FAMILY_OF,
    LATENT,
    ROW_OFFSET_32_LIMIT,
    cache_span,
    make_plan,
)

H200 = Arch("cuda", 90, 132)
A100 = Arch("cuda", 80, 108)
MI300 = Arch("hip", "gfx942", 304, 64)
FORMATS = ("auto", "fp8", "fp8_ds_mla")


def plan_for(t, h, w, dtype=torch.bfloat16, fmt="auto", arch=H200, **kw):
    kw.setdefault("on_gpu", True)
    return make_plan(
        num_tokens=t,
        num_heads=h,
        latent=512,
        rope=64,
        width=w,
        dtype=dtype,
        kv_format=fmt,
        arch=arch,
        **kw,
    )


def kernel_params(kernel) -> tuple[list[str], set[str]]:
    """(runtime parameter names in order, constexpr names) of a jit kernel, interpreted or not."""
    fn = getattr(kernel, "fn", kernel)
    runtime, const = [], set()
    for name, p in inspect.signature(fn).parameters.items():
        ann = p.annotation
        if "constexpr" in str(ann) or getattr(ann, "__name__", "") == "constexpr":
            const.add(name)
        else:
            runtime.append(name)
    return runtime, const


@pytest.mark.parametrize("fmt", FORMATS)
def test_plan_constexprs_are_the_family_kernels(fmt):
    """Each family's plan sets exactly its kernel's constexprs, and every family takes the same
    runtime arguments (launch passes one list to whichever family the plan names)."""
    # fp16 q: the Triton kernels (bf16 q at 16 heads runs the mma.sync Gluon kernels on sm90)
    plan = plan_for(2, 16, 2048, torch.float16, fmt=fmt, has_counts=True)
    runtime, const = kernel_params(launch_mod.FORWARD[plan.family])
    assert set(plan.constexprs) == const
    other = kernel_params(launch_mod.FORWARD[LATENT if plan.family == DS_MLA else DS_MLA])[0]
    assert runtime == other
    assert plan.family == FAMILY_OF[fmt]
    m_runtime, m_const = kernel_params(launch_mod.sparse_mla_merge_kernel)
    assert plan.merge is not None and set(plan.merge.constexprs) == m_const


def test_resolved_config_matches_the_heuristics():
    """Over a grid of shapes, formats, dtypes and targets: the plan runs what choose_config
    picks, with every None decided and the split count the one split_len_for covers W with."""
    grid = itertools.product([1, 4, 64, 128, 4096], [1, 16, 64, 128], [64, 2048], FORMATS)
    for (t, h, w, fmt), arch in itertools.product(grid, TARGETS):
        for dtype in (torch.float16, torch.bfloat16) + ((torch.float32,) if fmt == "auto" else ()):
            plan = plan_for(t, h, w, dtype, fmt, arch)
            want = choose_config(t, h, w, dtype, fmt, arch)
            cfg = plan.config
            assert (cfg.block_h, cfg.block_n, cfg.num_warps, cfg.num_stages) == (
                want.block_h,
                want.block_n,
                want.num_warps,
                want.num_stages,
            )
            assert (cfg.idx_ahead, cfg.stage_dequant) == (want.idx_ahead, want.stage_dequant)
            split_len, splits = split_len_for(w, want.num_splits, want.block_n)
            assert (plan.split_len, cfg.num_splits) == (split_len, splits)
            assert None not in (cfg.fp8_native, cfg.pdl, cfg.fp16_mma)
            assert cfg.fp8_native == arch.fp8_native
            assert cfg.fp16_mma == fp16_mma_for(dtype, fmt, arch, cfg.block_h)
            hb = -(-h // cfg.block_h)
            assert plan.num_head_blocks == hb and plan.grid == (t * splits * hb,)
            mma16 = plan.constexprs["MMA_FP16"]
            assert mma16 == (fmt != "auto" and dtype != torch.float32 and cfg.fp16_mma)


def test_split_workspace_and_merge_go_together():
    one = plan_for(4096, 64, 2048)
    assert one.num_splits == 1 and one.workspace is None and one.merge is None
    assert one.constexprs["SPLIT"] is False and one.config.pdl is False
    split = plan_for(1, 16, 2048)
    assert split.num_splits > 1 and split.constexprs["SPLIT"] is True
    assert split.workspace == (1, split.num_splits, 16, 512)
    m = split.merge
    assert m.grid[0] == 16 and m.grid[1] * m.constexprs["BLOCK_L"] >= 512
    assert (
        m.constexprs["S_PAD"] >= split.num_splits
        and m.constexprs["S_PAD"] & (m.constexprs["S_PAD"] - 1) == 0
    )


def test_merge_columns_divide_the_latent_width():
    """The merge stores BLOCK_L columns per program unmasked: BLOCK_L must divide L and never
    exceed it, for every latent width the interface admits and every split count."""
    for latent, splits in itertools.product([16, 32, 64, 128, 256, 512, 1024], range(2, 65)):
        cfg = KernelConfig(16, 16, 4, 2, num_splits=splits)
        plan = make_plan(
            num_tokens=1,
            num_heads=4,
            latent=latent,
            rope=0,
            width=16 * splits,
            dtype=torch.float16,
            kv_format="auto",
            arch=H200,
            on_gpu=True,
            config=cfg,
        )
        block_l = plan.merge.constexprs["BLOCK_L"]
        assert block_l <= latent and latent % block_l == 0, (latent, splits, block_l)
        assert plan.merge.grid[1] * block_l == latent


@pytest.mark.parametrize(
    "arch, on_gpu, override, want",
    [
        (H200, True, None, True),
        (H200, True, False, False),
        (H200, False, None, False),  # the interpreter: griddepcontrol has no meaning there
        (A100, True, None, False),  # sm80 has no programmatic dependent launch
        (MI300, True, None, False),
    ],
)
def test_pdl_only_links_a_split_pass_to_its_merge(arch, on_gpu, override, want):
    cfg = KernelConfig(16, 32, 4, 2, num_splits=4, pdl=override)
    plan = plan_for(1, 16, 2048, arch=arch, on_gpu=on_gpu, config=cfg)
    assert plan.config.pdl is want and plan.constexprs["PDL"] is want
    assert plan.merge.pdl is want and plan.merge.constexprs["PDL"] is want


def test_explicit_fields_win_over_the_architecture():
    cfg = KernelConfig(64, 64, 8, 3, fp8_native=False, fp16_mma=True)
    plan = plan_for(128, 64, 2048, fmt="fp8", config=cfg)
    assert plan.config.fp8_native is False and plan.constexprs["FP8_NATIVE"] is False
    assert plan.config.fp16_mma is True and plan.constexprs["MMA_FP16"] is True
    # the heuristic's own choice there is bf16 MMAs (the fp8 hazard's fix)
    assert plan_for(128, 64, 2048, fmt="fp8").constexprs["MMA_FP16"] is False


def test_block_table_and_format_flags():
    plan = plan_for(8, 16, 2048, fmt="fp8", block_size=48, page_size=64, k_scale_tensor=True)
    c = plan.constexprs
    assert c["HAS_BT"] and c["BT_SHIFT"] == -1 and c["PAGE_SHIFT"] == 6
    assert c["E4M3"] and c["K_SCALE_PTR"] and plan.bt_block_size == 48
    assert not plan.config.idx_ahead  # the block-table path keeps the in-step loop
    ds = plan_for(8, 16, 2048, fmt="fp8_ds_mla", block_size=64)
    assert ds.constexprs["BT_SHIFT"] == 6 and "E4M3" not in ds.constexprs


@pytest.mark.parametrize(
    "fmt, cfg, words",
    [
        ("auto", KernelConfig(16, 32, 4, 3, idx_ahead=True), ["idx_ahead", "block table: True"]),
        (
            "fp8_ds_mla",
            KernelConfig(16, 32, 4, 3, idx_ahead=True),
            ["idx_ahead", "block table: True"],
        ),
        ("fp8", KernelConfig(16, 32, 4, 2, stage_dequant=True), ["stage_dequant"]),
    ],
)
def test_plans_the_kernels_cannot_run_are_refused(fmt, cfg, words):
    bs = 64 if cfg.idx_ahead else None
    with pytest.raises(ValueError) as e:
        plan_for(4, 16, 2048, fmt=fmt, config=cfg, block_size=bs)
    for w in words:
        assert w in str(e.value)
    with pytest.raises(ValueError, match="num_tokens"):
        plan_for(0, 16, 2048)


@pytest.mark.parametrize("fmt", ["fp8_ds_mla", "fp8_ds_mla_v4"])
@pytest.mark.parametrize("ahead", [False, True])
def test_scaled_formats_load_indices_ahead_where_asked(fmt, ahead):
    """The scaled formats' kernels take KernelConfig.idx_ahead (both gather loops: the extra
    set's too, unless a block table maps it)."""
    cfg = KernelConfig(64, 32, 8, 3, stage_dequant=True, idx_ahead=ahead)
    rope = 0 if fmt == "fp8_ds_mla_v4" else 64
    plan = make_plan(
        num_tokens=4,
        num_heads=64,
        latent=512,
        rope=rope,
        width=2048,
        dtype=torch.bfloat16,
        kv_format=fmt,
        arch=H200,
        config=cfg,
        on_gpu=True,
    )
    assert plan.constexprs["IDX_AHEAD"] is ahead


@pytest.mark.parametrize("fmt", FORMATS)
def test_interface_launches_the_plan_make_plan_gives(monkeypatch, fmt):
    """sparse_mla hands the launcher the plan make_plan builds from the call's own facts."""
    got = []
    monkeypatch.setattr(launch_mod, "launch_sparse_mla", lambda plan, *a: got.append(plan))
    T, Hh, W = 3, 5, 40
    q = torch.randn(T, Hh, 576, device=DEVICE).half()
    if fmt == "fp8_ds_mla":
        cache = torch.zeros(4, 64, 656, dtype=torch.uint8, device=DEVICE)
    elif fmt == "fp8":
        cache = torch.zeros(4, 64, 576, dtype=torch.uint8, device=DEVICE)
    else:
        cache = torch.zeros(4, 64, 576, dtype=torch.float16, device=DEVICE)
    idx = torch.zeros(T, W, dtype=torch.int32, device=DEVICE)
    counts = torch.full((T,), W, dtype=torch.int32, device=DEVICE)
    sparse_mla(q, cache, idx, 0.1, valid_counts=counts, kv_format=fmt, return_lse=True)
    from triton_mla_sparse.ops.sparse_mla.heuristics import arch_of

    want = plan_for(
        T,
        Hh,
        W,
        torch.float16,
        fmt,
        arch_of(q.device),
        on_gpu=q.device.type == "cuda",
        page_size=64,
        has_counts=True,
        store_lse=True,
    )
    assert got == [want]


def test_sparse_mla_plan_is_what_sparse_mla_launches(monkeypatch):
    """The public query takes sparse_mla's arguments and returns the plan sparse_mla runs;
    it refuses what sparse_mla refuses, and T == 0 plans nothing."""
    from triton_mla_sparse import sparse_mla_plan

    assert inspect.signature(sparse_mla_plan).parameters == inspect.signature(sparse_mla).parameters
    got = []
    monkeypatch.setattr(launch_mod, "launch_sparse_mla", lambda plan, *a: got.append(plan))
    q = torch.randn(4, 16, 576, device=DEVICE).half()
    cache = torch.zeros(3, 64, 656, dtype=torch.uint8, device=DEVICE)
    idx = torch.zeros(4, 100, dtype=torch.int32, device=DEVICE)
    kw = dict(kv_format="fp8_ds_mla", return_lse=True)
    plan = sparse_mla_plan(q, cache, idx, 0.1, **kw)
    sparse_mla(q, cache, idx, 0.1, **kw)
    assert got == [plan] and plan.family == DS_MLA
    assert sparse_mla_plan(q[:0], cache, idx[:0], 0.1, **kw) is None
    with pytest.raises(ValueError, match="indices"):
        sparse_mla_plan(q, cache, idx[:3], 0.1, **kw)


# --- KernelConfig.e4m3_decode -----------------------------------------------------------------


def test_e4m3_decode_constexprs_are_the_kernels_constants():
    from triton_mla_sparse.ops import e4m3
    from triton_mla_sparse.ops.sparse_mla.heuristics import E4M3_DECODES
    from triton_mla_sparse.ops.sparse_mla.plan import E4M3_DECODE_CONSTEXPR

    assert {
        "scalar": e4m3.E4M3_SCALAR.value,
        "packed": e4m3.E4M3_PACKED.value,
        "packed-nomask": e4m3.E4M3_PACKED_NO_MASK.value,
    } == E4M3_DECODE_CONSTEXPR
    assert set(E4M3_DECODE_CONSTEXPR) == set(E4M3_DECODES)


@pytest.mark.parametrize("fmt", FORMATS)
def test_e4m3_decode_is_scalar_except_sm80_fp8_ds_mla(fmt):
    """Only sm80's fp8_ds_mla path was timed with the packed forms; every other target and
    format keeps the scalar decode, and so does sm80 under the interpreter and where it runs
    the mma.sync Gluon kernel (whose e4m3 decode is its own)."""
    for arch in TARGETS:
        for tokens, heads in ((1, 16), (128, 16), (128, 128)):
            plan = plan_for(tokens, heads, 2048, fmt=fmt, arch=arch)
            packed = (
                fmt == "fp8_ds_mla"
                and arch.backend == "cuda"
                and int(arch.cc) == 80
                and plan.config.gluon != "ampere"
            )
            assert (plan.config.e4m3_decode != "scalar") == packed, (arch, tokens, heads)
            if fmt != "auto":  # the bf16 latent kernel takes it too (it decodes nothing)
                assert (plan.constexprs["E4M3_DECODE"] != 0) == packed
            interpreted = plan_for(tokens, heads, 2048, fmt=fmt, arch=arch, on_gpu=False)
            assert interpreted.config.e4m3_decode == "scalar"


@pytest.mark.parametrize(
    "tokens, heads, want",
    [
        (1, 8, "packed-nomask"),  # the latency regime: unmasked at every head count
        (16, 16, "packed-nomask"),
        (17, 16, "packed"),
        (64, 16, "packed"),  # longer loops in 16-head tiles: the staging mask pays
        (128, 8, "packed"),
        (64, 64, "packed-nomask"),  # 64-head tiles: unmasked
        (128, 128, "packed-nomask"),
    ],
)
def test_sm80_fp8_ds_mla_takes_the_measured_packed_form(tokens, heads, want):
    # the Triton kernel's path: a cache the Gluon kernels' 16-byte gathers cannot read runs it
    # at every token count (the mma.sync Gluon kernel, the default at 64-128 tokens, decodes
    # e4m3 its own way)
    plan = plan_for(tokens, heads, 2048, fmt="fp8_ds_mla", arch=A100, cache_aligned=False)
    assert plan.config.stage_dequant and plan.config.e4m3_decode == want
    # a forced hardware decode needs none, and an explicit choice is kept
    native = KernelConfig(16, 32, 4, 2, stage_dequant=True, fp8_native=True)
    assert (
        plan_for(tokens, 16, 2048, fmt="fp8_ds_mla", arch=A100, config=native).config.e4m3_decode
        == "scalar"
    )
    scalar = KernelConfig(16, 32, 4, 2, stage_dequant=True, e4m3_decode="scalar")
    assert (
        plan_for(tokens, 16, 2048, fmt="fp8_ds_mla", arch=A100, config=scalar).config.e4m3_decode
        == "scalar"
    )


@pytest.mark.parametrize(
    "fmt, decode, stage, want",
    [
        ("fp8", "packed", False, 1),
        ("fp8_ds_mla", "packed", True, 1),
        ("fp8_ds_mla", "packed", False, 1),
        ("fp8_ds_mla", "packed-nomask", True, 2),
    ],
)
def test_e4m3_decode_reaches_the_kernel_on_the_integer_path(fmt, decode, stage, want):
    cfg = KernelConfig(16, 32, 4, 2, num_splits=2, stage_dequant=stage, e4m3_decode=decode)
    plan = plan_for(64, 16, 2048, fmt=fmt, arch=A100, config=cfg)
    assert plan.config.e4m3_decode == decode and plan.constexprs["E4M3_DECODE"] == want
    assert plan.constexprs["FP8_NATIVE"] is False
    # on sm90 it needs the integer decode forced
    forced = KernelConfig(16, 32, 4, 2, stage_dequant=stage, fp8_native=False, e4m3_decode=decode)
    assert plan_for(64, 16, 2048, fmt=fmt, config=forced).constexprs["E4M3_DECODE"] == want


@pytest.mark.parametrize(
    "fmt, cfg, arch, on_gpu, words",
    [
        ("fp8", KernelConfig(16, 32, 4, 2, e4m3_decode="vector"), A100, True, ["'vector'"]),
        ("auto", KernelConfig(16, 32, 4, 2, e4m3_decode="packed"), A100, True, ["'auto'"]),
        (
            "fp8_ds_mla_v4",
            KernelConfig(16, 32, 4, 1, e4m3_decode="packed"),
            A100,
            True,
            ["'fp8_ds_mla_v4'"],
        ),
        (
            "fp8_ds_mla",
            KernelConfig(16, 32, 4, 1, e4m3_decode="packed-nomask"),
            A100,
            True,
            ["stage_dequant", "'packed'"],
        ),
        (
            "fp8",
            KernelConfig(16, 32, 4, 2, e4m3_decode="packed"),
            A100,
            False,
            ["TRITON_INTERPRET"],
        ),
        ("fp8", KernelConfig(16, 32, 4, 1, e4m3_decode="packed"), MI300, True, ["hip", "gfx942"]),
        ("fp8", KernelConfig(16, 32, 4, 2, e4m3_decode="packed"), H200, True, ["fp8_native=False"]),
    ],
)
def test_e4m3_decodes_that_cannot_run_are_refused(fmt, cfg, arch, on_gpu, words):
    with pytest.raises(ValueError) as e:
        plan_for(4, 16, 2048, fmt=fmt, arch=arch, on_gpu=on_gpu, config=cfg)
    for w in words:
        assert w in str(e.value)
    # the scalar decode is valid everywhere, also under the interpreter and on AMD
    ok = dataclasses.replace(cfg, e4m3_decode="scalar")
    plan = plan_for(4, 16, 2048, fmt=fmt, arch=arch, on_gpu=on_gpu, config=ok)
    assert plan.config.e4m3_decode == "scalar"


# --- the V4 record's head blocks --------------------------------------------------------------


def test_v4_head_blocks_stay_where_the_compilers_do_not_spill():
    """fp8_ds_mla_v4's 64-head tile spills everywhere but sm90/sm100 (docs/perf-log/14-*), so
    its head block is capped: 32 heads on sm80, 16 on the 99 KB parts and on gfx942; the
    other formats keep their blocks."""
    want = {90: 64, 100: 64, 80: 32, 86: 16, 89: 16, 120: 16, 121: 16, "gfx942": 16}
    for arch in TARGETS:
        cfg = choose_config(128, 64, 640, torch.bfloat16, "fp8_ds_mla_v4", arch)
        assert cfg.block_h == want[arch.cc], (arch, cfg)
        assert (
            choose_config(128, 64, 2048, torch.bfloat16, "fp8_ds_mla", arch).block_h >= cfg.block_h
        )


@pytest.mark.parametrize(
    "cap, arch, on_gpu, words",
    [
        (0, H200, True, "from 32 to 255"),
        (256, H200, True, "from 32 to 255"),
        (True, H200, True, "from 32 to 255"),
        (168.0, H200, True, "from 32 to 255"),
        (168, H200, False, "interpreter"),
        (168, next(a for a in TARGETS if a.backend == "hip"), True, "hip target"),
    ],
)
def test_register_caps_that_cannot_apply_are_refused(cap, arch, on_gpu, words):
    """KernelConfig.max_registers is ptxas's cap: an int in its range, NVIDIA, compiled."""
    cfg = KernelConfig(16, 32, 4, 2, max_registers=cap)
    with pytest.raises(ValueError, match="max_registers") as e:
        plan_for(4, 16, 2048, arch=arch, config=cfg, on_gpu=on_gpu)
    assert words in str(e.value)


def test_a_register_cap_reaches_the_launch(monkeypatch):
    """The cap goes to the split pass's launch as Triton's ``maxnreg``; none without it."""
    launch = launch_mod
    seen = []

    class Kernel:
        def __getitem__(self, grid):
            return lambda *a, **kw: seen.append(kw)

    fake = Kernel()
    monkeypatch.setattr(launch, "FORWARD", {family: fake for family in launch.FORWARD})
    monkeypatch.setattr(launch, "sparse_mla_merge_kernel", fake)
    q = torch.zeros(2, 16, 576, dtype=torch.bfloat16)
    cache = torch.zeros(64, 576, dtype=torch.bfloat16)
    idx = torch.zeros(2, 64, dtype=torch.int32)
    out = torch.zeros(2, 16, 512, dtype=torch.bfloat16)
    for cap in (None, 168):
        seen.clear()
        cfg = KernelConfig(16, 32, 4, 2, num_splits=1, max_registers=cap)
        plan = plan_for(2, 16, 64, config=cfg)
        args = (cache, idx, None, None, None, None, 1.0, out, None, 0.1)
        launch.launch_sparse_mla(plan, q[..., :512], q[..., 512:], *args)
        assert seen[0].get("maxnreg") == cap and seen[0]["num_warps"] == 4


def test_q_rope_in_registers_is_the_mma_sync_ds_mla_kernels_alone():
    """KernelConfig.q_rope_in_registers reaches the mma.sync fp8_ds_mla kernel as QR_REGS and is
    refused for every other kernel."""
    ampere = KernelConfig(
        16, 32, 4, 1, stage_dequant=True, fp16_fold=True, gluon="ampere", q_rope_in_registers=True
    )
    plan = plan_for(4, 16, 2048, fmt="fp8_ds_mla", config=ampere)
    assert plan.constexprs["QR_REGS"] is True
    off = dataclasses.replace(ampere, q_rope_in_registers=False)
    assert plan_for(4, 16, 2048, fmt="fp8_ds_mla", config=off).constexprs["QR_REGS"] is False
    for fmt, cfg in (
        ("fp8_ds_mla", KernelConfig(16, 32, 4, 2, stage_dequant=True, q_rope_in_registers=True)),
        ("auto", KernelConfig(16, 32, 4, 2, gluon="ampere", q_rope_in_registers=True)),
    ):
        with pytest.raises(ValueError, match="q_rope_in_registers"):
            plan_for(4, 16, 2048, fmt=fmt, config=cfg)


def test_row_offsets_32_is_the_mma_sync_kernels_alone_and_needs_a_small_cache():
    """KernelConfig.row_offsets_32 reaches both mma.sync kernels as ROW_OFFSETS_32 when the cache
    spans at most ROW_OFFSET_32_LIMIT elements; asked for explicitly it is refused, naming the
    span, for a larger cache or one of unknown span, and for every other kernel."""
    ds = KernelConfig(
        16, 32, 4, 1, stage_dequant=True, fp16_fold=True, gluon="ampere", row_offsets_32=True
    )
    rows = KernelConfig(16, 32, 4, 2, gluon="ampere", row_offsets_32=True)
    for fmt, cfg in (("fp8_ds_mla", ds), ("auto", rows)):
        for span in (1, ROW_OFFSET_32_LIMIT):
            plan = plan_for(4, 16, 2048, fmt=fmt, config=cfg, cache_span=span)
            assert plan.constexprs["ROW_OFFSETS_32"] is True and plan.config.row_offsets_32
        off = dataclasses.replace(cfg, row_offsets_32=False)
        plan = plan_for(4, 16, 2048, fmt=fmt, config=off, cache_span=1)
        assert plan.constexprs["ROW_OFFSETS_32"] is False
        for span, word in (
            (ROW_OFFSET_32_LIMIT + 1, str(ROW_OFFSET_32_LIMIT + 1)),
            (None, "unknown"),
        ):
            with pytest.raises(ValueError, match=f"row_offsets_32=True.*{word}"):
                plan_for(4, 16, 2048, fmt=fmt, config=cfg, cache_span=span)
    for fmt, cfg in (
        ("fp8_ds_mla", dataclasses.replace(ds, gluon=None)),
        ("fp8_ds_mla", dataclasses.replace(ds, block_h=64, block_n=64, gluon="pipelined")),
        ("auto", dataclasses.replace(rows, gluon=None)),
    ):
        with pytest.raises(ValueError, match="row_offsets_32=True.*gluon='ampere'"):
            plan_for(4, 16, 2048, fmt=fmt, config=cfg, cache_span=1)
    # the Triton and sm90 kernels take no such argument
    for fmt in ("auto", "fp8", "fp8_ds_mla"):
        plan = plan_for(128, 128, 2048, fmt=fmt, cache_span=1)
        assert plan.family not in AMPERE_FAMILIES and "ROW_OFFSETS_32" not in plan.constexprs


@pytest.mark.parametrize(
    "fmt, cfg",
    [
        (
            "fp8_ds_mla",
            KernelConfig(16, 32, 4, 1, stage_dequant=True, fp16_fold=True, gluon="ampere"),
        ),
        ("auto", KernelConfig(16, 32, 4, 2, gluon="ampere")),
        (
            "fp8_ds_mla",
            KernelConfig(64, 64, 8, 1, stage_dequant=True, fp16_fold=True, gluon="pipelined"),
        ),
        ("auto", KernelConfig(64, 64, 8, 1, gluon="pipelined")),
    ],
    ids=["ds-ampere", "rows-ampere", "ds-sm90", "rows-sm90"],
)
def test_idx_ahead_is_refused_for_the_gluon_kernels(fmt, cfg):
    """The Gluon kernels schedule their index loads with their rings: a config asking them for
    indices a step ahead (which only the Triton kernels act on) is refused, naming the field,
    instead of silently running without it."""
    assert plan_for(4, 16, 2048, fmt=fmt, config=cfg).config.idx_ahead is False
    with pytest.raises(ValueError, match="idx_ahead=True.*gluon="):
        plan_for(4, 16, 2048, fmt=fmt, config=dataclasses.replace(cfg, idx_ahead=True))


def test_a_heuristic_row_offsets_32_drops_for_a_large_cache(monkeypatch):
    """Where the heuristics choose row_offsets_32, a cache too large for it (or of unknown span)
    gets the same tile with 64-bit offsets instead of an error."""
    import triton_mla_sparse.ops.sparse_mla.plan as plan_mod

    chosen = KernelConfig(16, 32, 4, 2, gluon="ampere", row_offsets_32=True)
    monkeypatch.setattr(plan_mod, "choose_config", lambda *a, **k: chosen)
    small = plan_for(4, 16, 2048, cache_span=ROW_OFFSET_32_LIMIT)
    assert small.config.row_offsets_32 and small.constexprs["ROW_OFFSETS_32"]
    for span in (ROW_OFFSET_32_LIMIT + 1, None):
        big = plan_for(4, 16, 2048, cache_span=span)
        assert not big.config.row_offsets_32 and big.constexprs["ROW_OFFSETS_32"] is False
        assert dataclasses.replace(big.config, row_offsets_32=True).block_h == chosen.block_h


@pytest.mark.parametrize(
    "make, span",
    [
        (lambda: torch.empty(10, 656, dtype=torch.uint8), 6560),
        (lambda: torch.empty(4, 64, 576), 4 * 64 * 576),
        # a paged view into a bigger allocation: from its first element to one past its last
        (lambda: torch.empty(4, 3, 64, 576)[:, 1], 3 * 3 * 64 * 576 + 64 * 576),
        (lambda: torch.empty(8, 600)[:, :576], 7 * 600 + 576),
        (lambda: torch.empty(0, 64, 576), 0),
    ],
    ids=["flat", "paged", "interleaved", "row-padded", "empty"],
)
def test_cache_span(make, span):
    assert cache_span(make()) == span


def test_split_qk_is_the_16_head_four_warp_mma_sync_tiles_alone():
    """KernelConfig.split_qk reaches the mma.sync kernels (fp8_ds_mla and rows in q's dtype) as
    SPLIT_QK in 16-head four-warp tiles, and is refused, naming what was asked, for every other
    tile, kernel and format, and beside q_rope_in_registers (the split holds all of q in
    registers)."""
    ampere = KernelConfig(
        16, 32, 4, 1, stage_dequant=True, fp16_fold=True, gluon="ampere", split_qk=True
    )
    rows = KernelConfig(16, 32, 4, 2, gluon="ampere", split_qk=True)
    for fmt, cfg in (("fp8_ds_mla", ampere), ("auto", rows)):
        assert plan_for(4, 16, 2048, fmt=fmt, config=cfg).constexprs["SPLIT_QK"] is True
        off = dataclasses.replace(cfg, split_qk=False)
        assert plan_for(4, 16, 2048, fmt=fmt, config=off).constexprs["SPLIT_QK"] is False
    for fmt, cfg, word in (
        ("fp8_ds_mla", dataclasses.replace(ampere, num_warps=8), "num_warps=8"),
        ("fp8_ds_mla", dataclasses.replace(ampere, block_h=32), "block_h=32"),
        ("fp8_ds_mla", dataclasses.replace(ampere, q_rope_in_registers=True), "q_rope_in_reg"),
        ("fp8_ds_mla", dataclasses.replace(ampere, gluon=None), "gluon=None"),
        ("auto", dataclasses.replace(rows, block_h=32), "block_h=32"),
        ("auto", dataclasses.replace(rows, gluon=None), "gluon=None"),
        ("fp8", dataclasses.replace(rows, gluon=None), "kv_format='fp8'"),
    ):
        with pytest.raises(ValueError, match="split_qk") as err:
            plan_for(4, 16, 2048, fmt=fmt, config=cfg)
        assert word in str(err.value), (word, err.value)


@pytest.mark.parametrize(
    "programs,sms,want",
    [
        (1, 132, 64),  # one program: one-step splits, 64 of them
        (2, 132, 64),  # 32 two-step splits would give 64 of 132 SMs a program: keep one-step
        (4, 132, 32),  # 32 two-step splits still give 128 of 132 SMs a program
        (4, 108, 32),  # an A100's grid is two-step already (54 splits round up to 64 rows)
        (4, 188, 64),  # 128 programs on 188 SMs: one-step splits stay
        (8, 132, 32),  # two-step splits from the rounding alone: unchanged
        (128, 132, 2),
    ],
)
def test_one_step_splits_halve_where_the_grid_stays_full(programs, sms, want):
    """num_splits_for: a one-step split count becomes half as many two-step splits where
    those still give at least SHORT_SPLIT_FILL of the SMs a program; counts as split_len_for
    runs them (top-k 2048 in 32-row steps, 16-head blocks)."""
    splits = num_splits_for(programs, 2048, 32, sms, 16)
    assert split_len_for(2048, splits, 32)[1] == want
    if want == 32 and programs * 64 <= 2 * sms:  # the rule, not the rounding, chose it
        assert programs * 32 >= SHORT_SPLIT_FILL * sms


@pytest.mark.parametrize(
    "programs,sms,long_splits,want",
    [
        (8, 132, True, 16),  # 16 four-step splits give 128 of 132 SMs a program
        (8, 132, False, 32),
        (8, 142, True, 16),  # 128 >= 0.9 x 142
        (8, 188, True, 32),  # 128 of 188 SMs: two-step splits stay
        (4, 132, True, 32),  # the one-step rule's two-step splits: halving again leaves 64
        (12, 132, True, 22),  # three-step splits (96 rows): unchanged
        (128, 132, True, 2),  # 32-step splits: unchanged
    ],
)
def test_two_step_splits_halve_where_long_splits_pay(programs, sms, long_splits, want):
    """num_splits_for(long_splits=True): two-step splits become half as many four-step ones
    where those still give SHORT_SPLIT_FILL of the SMs a program (top-k 2048 in 32-row
    steps, 16-head blocks; counts as split_len_for runs them)."""
    splits = num_splits_for(programs, 2048, 32, sms, 16, long_splits=long_splits)
    assert split_len_for(2048, splits, 32)[1] == want


def test_long_splits_by_format_and_heads_a_program_holds():
    """long_splits_pay: rows in q's dtype from 16 heads a program, fp8_ds_mla from 32, with q
    in 16 bits; formats and fp32 q, not timed, never; through choose_config, 8 tokens x 16
    heads of bf16 rows on 132 SMs run 16 four-step splits and fp8_ds_mla there keeps 32
    two-step ones."""
    bf16, fp16, fp32 = torch.bfloat16, torch.float16, torch.float32
    assert long_splits_pay(bf16, "auto", 16, 16) and long_splits_pay(fp16, "auto", 128, 32)
    assert not long_splits_pay(bf16, "auto", 8, 16)  # 8 heads in a 16-head tile
    assert not long_splits_pay(fp32, "auto", 16, 16)  # fp32 q: not timed
    assert long_splits_pay(bf16, "fp8_ds_mla", 64, 32)
    assert not long_splits_pay(bf16, "fp8_ds_mla", 16, 16)
    assert not long_splits_pay(bf16, "fp8", 128, 64)
    assert not long_splits_pay(bf16, "fp8_ds_mla_v4", 64, 64)
    for fmt, want in (("auto", 16), ("fp8_ds_mla", 32)):
        cfg = choose_config(8, 16, 2048, torch.bfloat16, fmt, H200)
        assert (cfg.block_h, split_len_for(2048, cfg.num_splits, cfg.block_n)[1]) == (16, want)
