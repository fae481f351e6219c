"""Rows in q's dtype on sm90 in Gluon (kv_format "auto", KernelConfig.gluon="pipelined" and
"specialized"; kernels/latent_sm90_gluon.py).

Without a GPU: the plan refuses every call the kernels do not implement, and they compile for
sm90 ahead of time under the installed Triton, within sm90's shared memory (the warp-specialized
one also without spills, read from ptxas). On an H200 (sm90): every output against the float64
reference with poisoned outputs and NaN rows nothing points at, -1 runs, a token with no valid
index, valid counts, a sink, splits (empty ones among them), odd and even step counts, paged
caches, NoPE; the warp-specialized kernel only after one small call of it finished in a child
process under a watchdog (a fault in its mbarrier protocol hangs rather than fails).
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
from conftest import HAS_GPU, compile_ahead
from test_gluon_ampere import SCENARIO_ARGS, SCENARIOS, check_latent_rows

from triton_mla_sparse import KernelConfig
from triton_mla_sparse.ops.sparse_mla.heuristics import Arch
from triton_mla_sparse.ops.sparse_mla.plan import (
    LATENT_GLUON,
    LATENT_GLUON_WS,
    LATENT_GLUON_WS_WARPS,
    make_plan,
)

SM90 = Arch("cuda", 90, 132)
LATENT_PIPELINED = KernelConfig(64, 64, 8, 1, gluon="pipelined")
LATENT_SPECIALIZED = KernelConfig(64, 64, LATENT_GLUON_WS_WARPS, 1, gluon="specialized")
FORMS = {LATENT_GLUON: LATENT_PIPELINED, LATENT_GLUON_WS: LATENT_SPECIALIZED}
SM90_SMEM = 232448  # bytes of shared memory a block may use on sm90


def _plan(
    arch=SM90,
    config=LATENT_PIPELINED,
    dtype=torch.bfloat16,
    on_gpu=True,
    num_tokens=4,
    num_heads=64,
    **kw,
):
    return make_plan(
        num_tokens=num_tokens,
        num_heads=num_heads,
        latent=512,
        rope=64,
        width=2048,
        dtype=dtype,
        kv_format="auto",
        arch=arch,
        config=config,
        on_gpu=on_gpu,
        **kw,
    )


@pytest.mark.parametrize("family", FORMS)
def test_plan_names_the_family(family):
    assert _plan(config=FORMS[family]).family == family


@pytest.mark.parametrize("tokens", [64, 128])
@pytest.mark.parametrize("heads", [8, 16, 48, 64, 128])
def test_default_at_the_token_counts_timed(tokens, heads):
    """bf16 rows and q on sm90, 64-128 tokens, 8 heads or more: the warp-specialized kernel by
    default, in its 64-head tile (fewer heads padded), split as the timed calls were (two
    programs a token at 64 tokens of up to 64 heads, one elsewhere)."""
    plan = _plan(num_tokens=tokens, num_heads=heads, config=None)
    splits = 2 if tokens == 64 and heads <= 64 else 1
    c = plan.config
    assert plan.family == LATENT_GLUON_WS and c.gluon == "specialized"
    assert (c.block_h, c.block_n, c.num_warps, c.num_splits) == (
        64,
        64,
        LATENT_GLUON_WS_WARPS,
        splits,
    )


@pytest.mark.parametrize("tokens", [129, 1024, 4096])
@pytest.mark.parametrize("heads", [64, 96, 128])
def test_default_at_prefill_from_64_heads(tokens, heads):
    """bf16 rows and q on sm90 past 128 tokens (prefill), 64 heads or more: the warp-specialized
    kernel by default, one program per token and head block (timed 1.7-1.9x faster than the
    Triton tile at 1024 and 4096 tokens x 64 and 128 heads under Triton 3.6 and 3.8)."""
    plan = _plan(num_tokens=tokens, num_heads=heads, config=None)
    c = plan.config
    assert plan.family == LATENT_GLUON_WS and c.gluon == "specialized"
    assert (c.block_h, c.block_n, c.num_warps, c.num_splits) == (64, 64, LATENT_GLUON_WS_WARPS, 1)


@pytest.mark.parametrize(
    "why, kw",
    [
        ("16 tokens: not timed", dict(num_tokens=16)),
        ("prefill at 16 heads: timed at 64 and 128 only", dict(num_tokens=4096, num_heads=16)),
        ("prefill at 32 heads: timed at 64 and 128 only", dict(num_tokens=1024, num_heads=32)),
        ("4 heads: fewer than timed", dict(num_heads=4)),
        ("fp16 q", dict(dtype=torch.float16)),
        ("block table", dict(block_size=64)),
        ("extra set", dict(extra_width=128)),
        ("interpreter", dict(on_gpu=False)),
    ],
)
def test_not_the_default_elsewhere(why, kw):
    kw = dict(dict(num_tokens=64, num_heads=64), **kw)
    assert _plan(config=None, **kw).config.gluon is None, why


@pytest.mark.parametrize(
    "why, kw, word",
    [
        ("sm80", dict(arch=Arch("cuda", 80, 108)), "target"),
        ("fp16 q", dict(dtype=torch.float16), "dtype"),
        ("32-head tile", dict(config=dataclasses.replace(LATENT_PIPELINED, block_h=32)), "block_h"),
        ("block table", dict(block_size=64), "block_table"),
        ("extra set", dict(extra_width=128), "extra_set"),
        ("interpreter", dict(on_gpu=False), "on_gpu"),
    ],
)
def test_plan_refuses_what_it_does_not_run(why, kw, word):
    with pytest.raises(ValueError, match="gluon='pipelined'") as e:
        _plan(**kw)
    assert word in str(e.value), why


@pytest.mark.parametrize(
    "why, kw, word",
    [
        ("eight warps", dict(num_warps=8), "num_warps"),
        ("32-head tile", dict(block_h=32), "block_h"),
        ("32-row steps", dict(block_n=32), "block_n"),
        ("a register cap", dict(max_registers=168), "max_registers"),
    ],
)
def test_plan_refuses_other_specialized_tiles(why, kw, word):
    """The warp-specialized kernel is one 64 x 64 tile: a warpgroup a partition, four warps."""
    with pytest.raises(ValueError, match="gluon='specialized'") as e:
        _plan(config=dataclasses.replace(LATENT_SPECIALIZED, **kw))
    assert word in str(e.value), why


def _sm90_jobs(cfg: KernelConfig) -> dict:
    """tests/aot_compile.py jobs for ``cfg``'s kernel on sm90: a serving call (splits, counts,
    LSE, a sink), a plain one and one without rope."""
    base = dict(
        arch="cuda:90",
        dtype="bf16",
        fmt="auto",
        block_h=cfg.block_h,
        block_n=cfg.block_n,
        num_warps=cfg.num_warps,
        num_stages=cfg.num_stages,
        gluon=cfg.gluon,
        has_bt=False,
    )
    return {
        "serving": dict(base, split=True, rope=64, has_counts=True, store_lse=True, sink=True),
        "plain": dict(base, split=False, rope=64, has_counts=False, store_lse=False),
        "nope": dict(base, split=False, rope=0, has_counts=True, store_lse=True),
    }


def test_compiles_for_sm90(tmp_path):
    results = compile_ahead(_sm90_jobs(LATENT_PIPELINED), tmp_path)
    for key, res in results.items():
        kernel = res["sparse_mla_latent_sm90_gluon_kernel"]
        assert "error" not in kernel, (key, kernel)
        assert kernel["shared"] <= SM90_SMEM, (key, kernel)


def test_specialized_compiles_for_sm90_without_spills(tmp_path):
    """Both warpgroups' code fits the 255 registers eight warps leave a thread (the O half alone
    takes 128): ptxas reports no spill. Its descriptors must not be hoisted out of the walk."""
    codegen = str(Path(__file__).resolve().parents[1] / "benchmarks" / "codegen")
    if codegen not in sys.path:
        sys.path.insert(0, codegen)
    import sass_stats  # ptxas -v through Triton's own ptxas, as at run time

    asm = tmp_path / "asm"
    results = compile_ahead(_sm90_jobs(LATENT_SPECIALIZED), tmp_path, asm_dir=asm)
    for key, res in results.items():
        kernel = res["sparse_mla_latent_sm90_gluon_ws_kernel"]
        assert "error" not in kernel, (key, kernel)
        assert kernel["shared"] <= SM90_SMEM, (key, kernel)
        info, _ = sass_stats.assemble(asm / f"{key}.1.ptx")
        assert info["spill_stores"] == 0 and info["spill_loads"] == 0, (key, info)
        # the partitions' setmaxnreg.inc to 256 returns only if the launch already allocates
        # 256 a thread (ptxas's count rounded up to a multiple of 8); with fewer it would hang
        assert info["registers"] > 248, (key, info)


# seconds one small call of the warp-specialized kernel gets in a child process, its first
# compile included, before it counts as hung
WS_WATCHDOG_S = 240
_WS_SMOKE = textwrap.dedent(
    """
    import torch
    from triton_mla_sparse import KernelConfig, sparse_mla
    cache = torch.randn(4096, 576, device="cuda").bfloat16()
    idx = torch.randint(0, 4096, (3, 300), device="cuda", dtype=torch.int32)
    q = torch.randn(3, 64, 576, device="cuda").bfloat16()
    for splits in (1, 3):
        cfg = KernelConfig(64, 64, 4, 1, num_splits=splits, gluon="specialized")
        out = sparse_mla(q, cache, idx, 0.07, config=cfg)
    torch.cuda.synchronize()
    assert torch.isfinite(out).all()
    """
)


@pytest.fixture(scope="module")
def ws_kernel_finishes():
    """The warp-specialized kernel's warpgroups meet at mbarriers, so a fault in that protocol
    hangs the GPU instead of failing a comparison: one small call runs first in a child process
    under a watchdog, and a hang fails the tests that would launch the kernel in this one."""
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(p for p in sys.path if p))
    try:
        p = subprocess.run(
            [sys.executable, "-c", _WS_SMOKE],
            capture_output=True,
            text=True,
            timeout=WS_WATCHDOG_S,
            env=env,
        )
    except subprocess.TimeoutExpired:
        pytest.fail(f"the warp-specialized kernel did not finish a small call in {WS_WATCHDOG_S} s")
    assert p.returncode == 0, p.stderr[-3000:]


@pytest.mark.gpu
@pytest.mark.skipif(not HAS_GPU, reason="Gluon kernels run on a GPU only")
@pytest.mark.parametrize("tokens, heads", [(160, 64), (136, 128)])
def test_default_at_prefill_matches_the_reference(tokens, heads, request):
    """The heuristics' own choice past 128 tokens (the warp-specialized kernel, a grid of one
    program per token and head block) against the float64 reference."""
    if torch.cuda.get_device_capability() != (9, 0):
        pytest.skip("the wgmma kernels are sm90's")
    assert _plan(num_tokens=tokens, num_heads=heads, config=None).family == LATENT_GLUON_WS
    request.getfixturevalue("ws_kernel_finishes")
    check_latent_rows(None, tokens, heads, 512, 1, 64, False, torch.bfloat16)


@pytest.mark.gpu
@pytest.mark.skipif(not HAS_GPU, reason="Gluon kernels run on a GPU only")
@pytest.mark.parametrize(SCENARIO_ARGS, SCENARIOS)
@pytest.mark.parametrize("heads_x", [1, 2], ids=["h", "2h"])
@pytest.mark.parametrize("family", FORMS)
def test_matches_the_reference(
    tokens, heads, width, splits, page, rope, sink, heads_x, family, request
):
    if torch.cuda.get_device_capability() != (9, 0):
        pytest.skip("the wgmma kernels are sm90's")
    if family == LATENT_GLUON_WS:
        request.getfixturevalue("ws_kernel_finishes")
    cfg = dataclasses.replace(FORMS[family], num_splits=splits)
    check_latent_rows(cfg, tokens, heads * heads_x, width, page, rope, sink, torch.bfloat16)
