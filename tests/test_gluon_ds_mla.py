"""fp8_ds_mla's sm90 kernels in Gluon (KernelConfig.gluon; kernels/ds_mla_sm90_gluon.py,
ds_mla_sm90_gluon_alt.py).

Without a GPU: the plan refuses every call the kernel does not implement, and the kernel compiles
for sm90 ahead of time under the installed Triton (tests/aot_compile.py, as tests/test_compile.py
does for the Triton kernels), within sm90's shared memory. On an H200 (sm90): every output
against the float64 reference with poisoned outputs and NaN rows nothing points at, -1 runs, a
token with no valid index, valid counts, a sink, splits, paged caches, NoPE.
"""

from __future__ import annotations

import dataclasses
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch
from conftest import DEVICE, HAS_GPU, compile_ahead
from test_sparse_mla import assert_matches, poison_, poison_unused_rows_

from triton_mla_sparse import KernelConfig, pack_fp8_ds_mla, sparse_mla, sparse_mla_plan
from triton_mla_sparse.ops.sparse_mla import heuristics
from triton_mla_sparse.ops.sparse_mla.heuristics import Arch, choose_config
from triton_mla_sparse.ops.sparse_mla.plan import (
    DS_MLA_GLUON,
    DS_MLA_GLUON_ALT,
    DS_MLA_GLUON_WS,
    DS_MLA_V4_GLUON,
    DS_MLA_V4_GLUON_WS,
    GLUON_FAMILY,
    make_plan,
)
from triton_mla_sparse.reference import sparse_mla_reference
from triton_mla_sparse.workloads import deepseek_v4_case, make_inputs

SM90 = Arch("cuda", 90, 132)
GLUON = KernelConfig(64, 64, 8, 1, stage_dequant=True, fp16_fold=True, gluon="pipelined")
# the sm90 forms of each record's Gluon kernel, and fp8_ds_mla's in the tile each runs
FORMS = tuple(f for fmt, f in sorted(GLUON_FAMILY) if fmt == "fp8_ds_mla" and f != "ampere")
FORM_CONFIG = {f: dataclasses.replace(GLUON, gluon=f) for f in FORMS}
FORM_CONFIG["alternating"] = dataclasses.replace(
    GLUON, block_n=32, num_warps=4, gluon="alternating"
)
# each form's kernel (kernels/ds_mla_sm90_gluon*.py)
FORM_KERNEL = {
    "pipelined": "sparse_mla_ds_mla_sm90_gluon_kernel",
    "specialized": "sparse_mla_ds_mla_sm90_gluon_ws_kernel",
    "alternating": "sparse_mla_ds_mla_sm90_gluon_alt_kernel",
}
V4_FORMS = tuple(f for fmt, f in sorted(GLUON_FAMILY) if fmt == "fp8_ds_mla_v4")
SM90_SMEM = 232448  # bytes of shared memory a block may use on sm90


def _plan(fmt="fp8_ds_mla", arch=SM90, config=GLUON, latent=512, on_gpu=True, **kw):
    if config is GLUON and fmt == "fp8_ds_mla_v4":
        config = V4_GLUON
    return make_plan(
        num_tokens=4,
        num_heads=64,
        latent=latent,
        rope=0 if fmt == "fp8_ds_mla_v4" else 64,
        width=2048,
        dtype=torch.bfloat16,
        kv_format=fmt,
        arch=arch,
        config=config,
        on_gpu=on_gpu,
        **kw,
    )


V4_GLUON = KernelConfig(64, 64, 8, 1, stage_dequant=True, gluon="specialized")


def test_plan_names_the_gluon_family():
    assert _plan().family == DS_MLA_GLUON
    assert _plan(config=dataclasses.replace(GLUON, gluon="specialized")).family == DS_MLA_GLUON_WS
    assert _plan(config=FORM_CONFIG["alternating"]).family == DS_MLA_GLUON_ALT
    v4 = _plan(fmt="fp8_ds_mla_v4", config=V4_GLUON, block_size=64, extra_width=512)
    assert v4.family == DS_MLA_V4_GLUON_WS  # both sets, through block tables too
    v4_pipelined = dataclasses.replace(V4_GLUON, gluon="pipelined")
    v4 = _plan(fmt="fp8_ds_mla_v4", config=v4_pipelined, block_size=64, extra_width=512)
    assert v4.family == DS_MLA_V4_GLUON


@pytest.mark.parametrize(
    "why, kw, word",
    [
        (
            "V4 record, unknown form",
            dict(fmt="fp8_ds_mla_v4", config=dataclasses.replace(V4_GLUON, gluon="tma")),
            "kv_format",
        ),
        (
            "V4 record, fp16 MMAs",
            dict(fmt="fp8_ds_mla_v4", config=dataclasses.replace(V4_GLUON, fp16_mma=True)),
            "fp16_mma",
        ),
        ("sm80", dict(arch=Arch("cuda", 80, 108)), "target"),
        ("32-row steps", dict(config=dataclasses.replace(GLUON, block_n=32)), "block_n"),
        (
            "alternating, 64-row steps",
            dict(config=dataclasses.replace(FORM_CONFIG["alternating"], block_n=64)),
            "block_n",
        ),
        (
            "alternating, eight warps",
            dict(config=dataclasses.replace(FORM_CONFIG["alternating"], num_warps=8)),
            "num_warps",
        ),
        (
            "alternating, register cap",
            dict(config=dataclasses.replace(FORM_CONFIG["alternating"], max_registers=128)),
            "max_registers",
        ),
        ("exact fp16", dict(config=dataclasses.replace(GLUON, fp16_fold=False)), "fp16_fold"),
        ("block table", dict(block_size=64), "block_table"),
        ("extra set", dict(extra_width=128), "extra_set"),
        ("interpreter", dict(on_gpu=False), "on_gpu"),
        ("unknown form", dict(config=dataclasses.replace(GLUON, gluon="tma")), "pipelined"),
    ],
)
def test_gluon_refuses_what_it_does_not_run(why, kw, word):
    with pytest.raises(ValueError, match="gluon=") as e:
        _plan(**kw)
    assert word in str(e.value), why


@pytest.mark.parametrize(
    "version, ds_mla_form", [((3, 8), "pipelined"), ((3, 9), "pipelined"), ((3, 6), "specialized")]
)
def test_heuristics_choose_it_where_timed(monkeypatch, version, ds_mla_form):
    """sm90 with bf16 q in fp8_ds_mla's folded 64 x 64 tile: the pipelined Gluon kernel under
    Triton 3.8 on, the warp-specialized one under 3.6 (each the faster there); never with fp16
    q, on other targets, at 16 heads (the mma.sync kernel's), where the caller says the call cannot run it
    (interpreter, unaligned cache), with a block table or an extra set. The V4 record's 64-head
    tiles (from 16 tokens): the warp-specialized kernel under either; its 16-head tiles keep
    the Triton kernel."""
    monkeypatch.setattr(heuristics, "triton_version", lambda: version)
    for t in (1, 15, 16, 128, 4096):
        for h in (64, 128):
            cfg = choose_config(t, h, 2048, torch.bfloat16, "fp8_ds_mla", SM90)
            form = "pipelined" if t < 16 else ds_mla_form  # 1 token: pipelined under either
            assert (cfg.gluon, cfg.num_stages, cfg.idx_ahead) == (form, 1, False), (t, h)
            assert (cfg.block_h, cfg.block_n, cfg.fp16_fold) == (64, 64, True)
    for kw in (dict(block_table=True), dict(extra_set=True), dict(gluon=False)):
        assert choose_config(128, 64, 2048, torch.bfloat16, "fp8_ds_mla", SM90, **kw).gluon is None
    assert choose_config(128, 64, 2048, torch.float16, "fp8_ds_mla", SM90).gluon is None
    # 16 heads or fewer: the mma.sync kernel's 16-head tile (tests/test_gluon_ampere.py)
    assert choose_config(128, 16, 2048, torch.bfloat16, "fp8_ds_mla", SM90).gluon == "ampere"
    for cc in (80, 89, 100, 120):  # sm80 / sm89: the mma.sync kernel (tests/test_gluon_ampere.py)
        arch = Arch("cuda", cc, 132)
        form = choose_config(128, 64, 2048, torch.bfloat16, "fp8_ds_mla", arch).gluon
        assert form == ("ampere" if cc in (80, 89) else None), cc
    assert choose_config(4, 64, 640, torch.bfloat16, "fp8_ds_mla_v4", SM90).gluon is None
    assert choose_config(128, 64, 640, torch.bfloat16, "fp8_ds_mla_v4", SM90).gluon == "specialized"
    # rows in q's dtype: their own kernel at 64-128 tokens and at prefill from 64 heads, the
    # Triton tile for prefill below (tests/test_gluon_latent.py)
    assert choose_config(4096, 64, 2048, torch.bfloat16, "auto", SM90).gluon == "specialized"
    assert choose_config(4096, 16, 2048, torch.bfloat16, "auto", SM90).gluon is None


def test_plan_keeps_the_triton_kernel_where_gluon_cannot_run():
    """The plan of a heuristic call that cannot run the Gluon kernel (interpreter, unaligned
    cache, block table, extra set) is the Triton kernel's, not a refusal."""
    for kw in (
        dict(on_gpu=False),
        dict(cache_aligned=False),
        dict(block_size=64),
        dict(extra_width=128),
    ):
        plan = _plan(config=None, **kw)
        assert plan.config.gluon is None and plan.family == "ds_mla", kw
    assert _plan(config=None).family == DS_MLA_GLUON  # 4 tokens: pipelined under every Triton


def test_gluon_kernel_compiles_for_sm90(tmp_path):
    base = dict(
        arch="cuda:90",
        dtype="bf16",
        fmt="fp8_ds_mla",
        block_h=64,
        block_n=64,
        num_warps=8,
        num_stages=1,
        stage_dequant=True,
        fp16_mma=True,
        fp16_fold=True,
    )
    jobs = {}
    for form in FORMS:
        cfg = FORM_CONFIG[form]
        b = dict(base, gluon=form, block_n=cfg.block_n, num_warps=cfg.num_warps)
        jobs[f"{form}-plain"] = dict(
            b, split=False, rope=64, has_counts=False, has_bt=False, store_lse=False
        )
        jobs[f"{form}-serving"] = dict(
            b, split=True, rope=64, has_counts=True, has_bt=False, store_lse=True, sink=True
        )
        jobs[f"{form}-nope"] = dict(
            b, split=False, rope=0, has_counts=True, has_bt=False, store_lse=True
        )
    v4 = dict(base, fmt="fp8_ds_mla_v4", fp16_mma=False, fp16_fold=False, gluon="specialized")
    v4.update(rope=0, has_counts=True, has_bt=False, store_lse=True, sink=True)
    for v4_form in ("specialized", "pipelined"):
        v4f = dict(v4, gluon=v4_form)
        jobs[f"v4-{v4_form}-extra-paged"] = dict(v4f, split=False, extra="paged")
        jobs[f"v4-{v4_form}-extra-bt-split"] = dict(v4f, split=True, extra="bt", has_bt=True)
        jobs[f"v4-{v4_form}-plain"] = dict(v4f, split=False, sink=False, has_counts=False)
    results = compile_ahead(jobs, tmp_path)
    for key, res in results.items():
        if key.startswith("v4"):
            form = "ws_kernel" if "specialized" in key else "kernel"
            name = f"sparse_mla_ds_mla_v4_sm90_gluon_{form}"
        else:
            name = FORM_KERNEL[key.split("-")[0]]
        kernel = res[name]
        assert "error" not in kernel, (key, kernel)
        assert kernel["shared"] <= SM90_SMEM, (key, kernel)


def test_alternating_kernel_fits_its_registers(tmp_path):
    """Both warpgroups of the alternating kernel fit the 255 registers eight warps leave a
    thread (the O half alone takes 128) without a spill, and the launch allocates 256: its
    partitions' setmaxnreg.inc to 256 returns only then (with fewer it would hang)."""
    codegen = str(Path(__file__).resolve().parents[1] / "benchmarks" / "codegen")
    if codegen not in sys.path:
        sys.path.insert(0, codegen)
    import sass_stats  # ptxas -v through Triton's own ptxas, as at run time

    cfg = FORM_CONFIG["alternating"]
    base = dict(
        arch="cuda:90",
        dtype="bf16",
        fmt="fp8_ds_mla",
        block_h=cfg.block_h,
        block_n=cfg.block_n,
        num_warps=cfg.num_warps,
        num_stages=1,
        stage_dequant=True,
        fp16_mma=True,
        fp16_fold=True,
        gluon="alternating",
        has_bt=False,
    )
    jobs = {
        "serving": dict(base, split=True, rope=64, has_counts=True, store_lse=True, sink=True),
        "nope": dict(base, split=False, rope=0, has_counts=True, store_lse=True),
    }
    asm = tmp_path / "asm"
    for key, res in compile_ahead(jobs, tmp_path, asm_dir=asm).items():
        assert "error" not in res[FORM_KERNEL["alternating"]], (key, res)
        info, _ = sass_stats.assemble(asm / f"{key}.1.ptx")
        assert info["spill_stores"] == 0 and info["spill_loads"] == 0, (key, info)
        assert info["registers"] > 248, (key, info)


# seconds one small call of the alternating kernel gets in a child process, its first compile
# included, before it counts as hung
ALT_WATCHDOG_S = 180
_ALT_SMOKE = textwrap.dedent(
    """
    import torch
    from triton_mla_sparse import KernelConfig, pack_fp8_ds_mla, sparse_mla
    cache = pack_fp8_ds_mla(torch.randn(4096, 576)).cuda()
    idx = torch.randint(0, 4096, (3, 300), device="cuda", dtype=torch.int32)
    q = torch.randn(3, 64, 576, device="cuda").bfloat16()
    for splits in (1, 3):
        cfg = KernelConfig(
            64, 32, 4, 1, num_splits=splits, stage_dequant=True, fp16_fold=True,
            gluon="alternating",
        )
        out = sparse_mla(q, cache, idx, 0.07, kv_format="fp8_ds_mla", config=cfg)
    torch.cuda.synchronize()
    assert torch.isfinite(out).all()
    """
)


@pytest.fixture(scope="module")
def alt_kernel_finishes():
    """The alternating kernel's warpgroups meet at mbarriers, so a fault in that protocol hangs
    the GPU instead of failing a comparison: one small call runs first in a child process under
    a watchdog, and a hang fails the tests that would launch the kernel in this one."""
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(p for p in sys.path if p))
    try:
        p = subprocess.run(
            [sys.executable, "-c", _ALT_SMOKE],
            capture_output=True,
            text=True,
            timeout=ALT_WATCHDOG_S,
            env=env,
        )
    except subprocess.TimeoutExpired:
        pytest.fail(f"the alternating kernel did not finish a small call in {ALT_WATCHDOG_S} s")
    assert p.returncode == 0, p.stderr[-3000:]


def _cache(rows: int, page: int, g: torch.Generator) -> torch.Tensor:
    """fp8_ds_mla rows with chunk scales over six decades, in pages of ``page`` rows."""
    r = torch.randn(rows, 576, generator=g)
    decades = (torch.rand(rows, 4, generator=g) * 2 - 1) * 3
    r[:, :512] *= (10.0**decades).repeat_interleave(128, dim=1)
    packed = pack_fp8_ds_mla(r)
    return packed.view(rows // page, page, -1) if page > 1 else packed


@pytest.mark.gpu
@pytest.mark.skipif(not HAS_GPU, reason="Gluon kernels run on a GPU only")
@pytest.mark.parametrize("form", FORMS)
@pytest.mark.parametrize("tokens, heads, width, splits", [(3, 64, 300, 1), (5, 128, 1000, 3)])
@pytest.mark.parametrize("page", [1, 64, 48])
@pytest.mark.parametrize("rope", [64, 0])
@pytest.mark.parametrize("sink", [False, True])
def test_gluon_matches_the_reference(form, tokens, heads, width, splits, page, rope, sink, request):
    if torch.cuda.get_device_capability() != (9, 0):
        pytest.skip("the Gluon kernel is sm90's")
    if form == "alternating":
        request.getfixturevalue("alt_kernel_finishes")
    g = torch.Generator().manual_seed(tokens * 7 + page + rope + sink)
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
    ref, ref_lse = sparse_mla_reference(
        q, cache, idx, 0.07, return_lse=True, compute_dtype=torch.float64, **kw
    )
    poison_unused_rows_(cache, idx, **kw)
    cfg = dataclasses.replace(FORM_CONFIG[form], num_splits=splits)
    out = poison_(torch.empty(tokens, heads, 512, dtype=torch.bfloat16, device=DEVICE))
    _, lse = sparse_mla(q, cache, idx, 0.07, return_lse=True, out=out, config=cfg, **kw)
    assert_matches(out, lse, ref, ref_lse, torch.bfloat16)
    assert (out[0] == 0).all() and torch.isneginf(lse[0]).all()


# rows of the walk-ordered cache below that share one magnitude: the alternating kernel's step
FALLING_STEP_ROWS = 32


@pytest.mark.gpu
@pytest.mark.skipif(not HAS_GPU, reason="Gluon kernels run on a GPU only")
@pytest.mark.parametrize("form", FORMS)
@pytest.mark.parametrize("splits", [1, 3])
def test_gluon_output_from_steps_far_below_the_first(form, splits, request):
    """Scales that halve every 32 rows along the walk (2^-31 at its end) and scores that rise
    along it steeply enough that the last steps carry the output: a kernel that puts a step's
    scale relative to an earlier, larger one into its fp16 P (rather than into the fp32
    accumulator) loses those steps to underflow."""
    if torch.cuda.get_device_capability() != (9, 0):
        pytest.skip("the Gluon kernel is sm90's")
    if form == "alternating":
        request.getfixturevalue("alt_kernel_finishes")
    g = torch.Generator().manual_seed(splits)
    tokens, heads, width = 2, 64, 1024
    steps = torch.arange(width) // FALLING_STEP_ROWS
    r = torch.randn(width, 576, generator=g)
    r[:, :512] *= torch.exp2(-steps.double()).float()[:, None]
    r[:, 512:] = (torch.arange(width) * (20.0 / width))[:, None]  # the rope: the scores' ramp
    cache = pack_fp8_ds_mla(r).to(DEVICE)
    idx = torch.arange(width, dtype=torch.int32).repeat(tokens, 1).to(DEVICE)
    q = torch.randn(tokens, heads, 576, generator=g) * 0.05
    q[..., 512:] = 1.0 + 0.1 * torch.randn(tokens, heads, 64, generator=g)
    q = q.bfloat16().to(DEVICE)
    ref, ref_lse = sparse_mla_reference(
        q, cache, idx, 0.07, return_lse=True, compute_dtype=torch.float64, kv_format="fp8_ds_mla"
    )
    # the last eight steps carry nearly all of the reference's output
    tail = sparse_mla_reference(
        q,
        cache,
        idx[:, -8 * FALLING_STEP_ROWS :],
        0.07,
        compute_dtype=torch.float64,
        kv_format="fp8_ds_mla",
    )
    assert ((tail - ref).norm() / ref.norm()).item() < 1e-2
    cfg = dataclasses.replace(FORM_CONFIG[form], num_splits=splits)
    out = poison_(torch.empty(tokens, heads, 512, dtype=torch.bfloat16, device=DEVICE))
    _, lse = sparse_mla(
        q, cache, idx, 0.07, return_lse=True, out=out, config=cfg, kv_format="fp8_ds_mla"
    )
    assert_matches(out, lse, ref, ref_lse, torch.bfloat16)


@pytest.mark.gpu
@pytest.mark.skipif(not HAS_GPU, reason="Gluon kernels run on a GPU only")
@pytest.mark.parametrize("aligned", [True, False])
def test_default_call_runs_gluon_only_on_an_aligned_cache(aligned):
    """Without a config the heuristics run the Gluon kernel on sm90 (64 heads, bf16 q); a cache
    8 bytes off 16-byte alignment (aligned for the scales' words, not for the Gluon kernels'
    16-byte gathers) gets the Triton kernel (same answer) instead of a refusal."""
    if torch.cuda.get_device_capability() != (9, 0):
        pytest.skip("the Gluon kernel is sm90's")
    g = torch.Generator().manual_seed(11)
    # 4 tokens: below 16 the heuristics choose the pipelined form under every Triton
    rows, tokens, heads, width = 64 * 64, 4, 64, 700
    packed = _cache(rows, 64, g)
    cache = packed.to(DEVICE) if aligned else _offset_on_device(packed)
    idx = torch.stack([torch.randperm(rows, generator=g)[:width] for _ in range(tokens)]).int()
    idx = idx.to(DEVICE)
    q = (torch.randn(tokens, heads, 576, generator=g) * 0.05).bfloat16().to(DEVICE)
    ref, ref_lse = sparse_mla_reference(
        q, cache, idx, 0.07, kv_format="fp8_ds_mla", return_lse=True, compute_dtype=torch.float64
    )
    args = (q, cache, idx, 0.07)
    plan = sparse_mla_plan(*args, kv_format="fp8_ds_mla", return_lse=True)
    assert plan.family == (DS_MLA_GLUON if aligned else "ds_mla"), aligned
    out, lse = sparse_mla(*args, kv_format="fp8_ds_mla", return_lse=True)
    assert_matches(out, lse, ref, ref_lse, torch.bfloat16)


def _offset_on_device(packed: torch.Tensor) -> torch.Tensor:
    """``packed``'s bytes on the GPU at an address 8 bytes past a 16-byte boundary."""
    buf = torch.zeros(packed.numel() + 8, dtype=torch.uint8, device=DEVICE)
    buf[8:] = packed.reshape(-1).to(DEVICE)
    view = buf[8:].view(packed.shape)
    assert view.data_ptr() % 16 == 8
    return view


def test_gluon_kernel_takes_the_launchers_arguments():
    """launch.py passes the Triton kernel's argument list and the plan's constexprs: the Gluon
    kernel declares the same runtime parameters in the same order, and every constexpr."""
    from test_plan import kernel_params

    from triton_mla_sparse.ops.sparse_mla import launch

    triton_runtime, _ = kernel_params(launch.FORWARD["ds_mla"])
    plans = [_plan(config=FORM_CONFIG[form]) for form in FORMS]
    plans.append(_plan(fmt="fp8_ds_mla_v4", config=V4_GLUON))
    plans.append(
        _plan(fmt="fp8_ds_mla_v4", config=dataclasses.replace(V4_GLUON, gluon="pipelined"))
    )
    for plan in plans:
        runtime, const = kernel_params(launch.FORWARD[plan.family])
        assert runtime == triton_runtime
        assert set(plan.constexprs) == const


@pytest.mark.gpu
@pytest.mark.skipif(not HAS_GPU, reason="Gluon kernels run on a GPU only")
@pytest.mark.parametrize("tokens, splits", [(3, 1), (40, 2)])
@pytest.mark.parametrize("holes", [False, True])
@pytest.mark.parametrize("form", V4_FORMS)
def test_gluon_v4_matches_the_reference(tokens, splits, holes, form):
    """DeepSeek-V4's decode (window + compressed set, sink, counts) on both Gluon kernels."""
    if torch.cuda.get_device_capability() != (9, 0):
        pytest.skip("the Gluon kernel is sm90's")
    case = deepseek_v4_case(tokens, 64, rows=8192, holes=holes)
    inp = make_inputs(case, torch.device(DEVICE), seed=tokens + holes)
    ref, ref_lse = sparse_mla_reference(
        inp.q,
        inp.kv_cache,
        inp.indices,
        inp.scale,
        return_lse=True,
        compute_dtype=torch.float64,
        **inp.kwargs,
    )
    cfg = dataclasses.replace(V4_GLUON, num_splits=splits, gluon=form)
    out = poison_(torch.empty(tokens, 64, 512, dtype=torch.bfloat16, device=DEVICE))
    _, lse = sparse_mla(
        inp.q,
        inp.kv_cache,
        inp.indices,
        inp.scale,
        return_lse=True,
        out=out,
        config=cfg,
        **inp.kwargs,
    )
    assert_matches(out, lse, ref, ref_lse, torch.bfloat16)
