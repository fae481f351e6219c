"""The kernel reading DeepSeek-V4's 584-byte record in place (kv_format "fp8_ds_mla_v4").

The decode against kv_format's own dequantisation bit for bit, then attention against the
float64/float32 reference on caches laid out as vLLM 0.33 allocates them, as DeepSeek-V4 decode
calls it: a sliding-window cache (main set) and a compressed cache (extra set), both in the
record, with a sink. Every byte of a cache that no valid index reaches (other slots' data and
scale rows, the pages' padding) is 0xFF: NaN codes and an infinite scale, which the reference
ignores (it never selects them) and the kernel must never read.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch
from conftest import DEVICE, DTYPES, dtype_id
from test_sparse_mla import I32_MAX, SPLITS, assert_matches, gen, poison_, sinks

from triton_mla_sparse import KernelConfig, sparse_mla, sparse_mla_plan
from triton_mla_sparse.kv_format import (
    DS_V4_DATA_BYTES,
    DS_V4_GROUP,
    DS_V4_NOPE,
    DS_V4_NUM_SCALES,
    DS_V4_SCALE_BYTES,
    DS_V4_WIDTH,
    alloc_fp8_ds_mla_v4,
    ds_mla_v4_page_stride,
    pack_fp8_ds_mla_v4,
    unpack_fp8_ds_mla_v4,
    write_fp8_ds_mla_v4,
)
from triton_mla_sparse.ops.sparse_mla.heuristics import arch_of, choose_config
from triton_mla_sparse.reference import physical_rows, sparse_mla_reference

FMT = {"kv_format": "fp8_ds_mla_v4"}
NATIVE = [pytest.param(True, id="native"), pytest.param(False, id="intdecode")]
DTYPE_PARAMS = [pytest.param(dt, id=dtype_id(dt)) for dt in DTYPES]
POISON = 0xFF  # e4m3 NaN codes, scale byte 255 = 2^128 = inf


def v4_rows(n: int, g: torch.Generator, spread: float = 0.0) -> torch.Tensor:
    """[n, 512] float32: random rows, each NoPE group scaled by 10^u, u uniform in
    [-spread, spread] (scales 2^-22 .. 2^21 for spread 6)."""
    x = torch.randn(n, DS_V4_WIDTH, generator=g)
    if spread:
        mag = 10.0 ** ((torch.rand(n, DS_V4_NUM_SCALES, generator=g) * 2 - 1) * spread)
        x[:, :DS_V4_NOPE] *= mag.repeat_interleave(DS_V4_GROUP, dim=1)
    return x


def v4_cache(rows: torch.Tensor, page: int, used: torch.Tensor | None = None) -> torch.Tensor:
    """A vLLM-laid-out V4 cache (padded page stride) filled with 0xFF, then ``rows`` written at
    slot = row number, only where ``used`` (bool [n]) is set (all rows when None)."""
    n = rows.shape[0]
    cache = alloc_fp8_ds_mla_v4(-(-n // page), page, device=DEVICE, fill=POISON)
    slots = torch.arange(n, device=DEVICE)
    if used is not None:
        slots = torch.where(used.to(DEVICE), slots, -1)
    write_fp8_ds_mla_v4(cache, slots, rows.to(DEVICE))
    return cache


def used_slots(n: int, indices: torch.Tensor, **sel) -> torch.Tensor:
    """bool [n]: the slots some valid index reaches (physical_rows' rules)."""
    rows, valid = physical_rows(indices, n, **sel)
    used = torch.zeros(n, dtype=torch.bool, device=indices.device)
    used[rows[valid]] = True
    return used


@pytest.mark.parametrize("native", NATIVE)
@pytest.mark.parametrize("page", [1, 4, 32])
def test_decode_is_bit_exact(native, page):
    """One index per token, q = 0: each logit is 0 and the output is that slot's row, which must
    equal kv_format.unpack_fp8_ds_mla_v4 bit for bit (fp32 q: fp32 MMAs): NoPE groups over 12
    decades, all-zero groups (the floor's scale 2^-22), signed zeros, e4m3 subnormals and the
    largest codes; native and integer e4m3 decode. q = 0 keeps the logits finite whatever the
    row holds."""
    g = gen(401 + page)
    n = 32
    x = v4_rows(n, g, spread=6.0)
    x[0, :DS_V4_GROUP] = 0.0
    x[1, :DS_V4_GROUP] = torch.tensor([0.0, -0.0] * (DS_V4_GROUP // 2))
    x[2, :8] = torch.tensor([448.0, 2.0**-9, 2.0**-10, 3 * 2.0**-10, -448.0, 2.0**-7, 1.0625, 17.0])
    x[2, 8:DS_V4_GROUP] = 0.0
    x[3, DS_V4_NOPE:] = torch.tensor([-0.0, 1e-30, -3.0e4, 2.0**-100] * 16)
    cache = pack_fp8_ds_mla_v4(x.to(DEVICE), page)
    want = unpack_fp8_ds_mla_v4(cache)
    idx = torch.arange(n, dtype=torch.int32, device=DEVICE)[:, None]
    q = torch.zeros(n, 2, DS_V4_WIDTH, device=DEVICE)
    cfg = KernelConfig(16, 16, 4, 1, fp8_native=native)
    out = sparse_mla(q, cache, idx, config=cfg, **FMT)
    assert torch.equal(out, want[:, None, :].expand(n, 2, DS_V4_WIDTH))
    # the same through the extra set (the main set empty)
    none = torch.full((n, 1), -1, dtype=torch.int32, device=DEVICE)
    out = sparse_mla(q, cache, none, config=cfg, extra_kv_cache=cache, extra_indices=idx, **FMT)
    assert torch.equal(out, want[:, None, :].expand(n, 2, DS_V4_WIDTH))


def swa_and_compressed(t: int, g: torch.Generator):
    """DeepSeek-V4 decode in small: a sliding-window set (main, window 24, page 8) and a
    compressed set (extra, page 2), with valid entries first and -1 after (vLLM's lists), counts
    equal to the valid entries, a token with nothing (count 0, all -1) and adversarial rows:
    entries past the count that are in range, out-of-range entries, a -1 run inside the count."""
    swa_page, swa_pages, window = 8, 9, 24
    c_page, c_pages, topk = 2, 40, 30
    n_swa, n_c = swa_page * swa_pages, c_page * c_pages
    swa = torch.full((t, window), -1, dtype=torch.int32)
    comp = torch.full((t, topk), -1, dtype=torch.int32)
    swa_len = torch.zeros(t, dtype=torch.int32)
    comp_len = torch.zeros(t, dtype=torch.int32)
    for i in range(t):
        pos = int(torch.randint(3, n_swa, (1,), generator=g))
        k = min(window, pos + 1)
        swa[i, :k] = torch.arange(pos - k + 1, pos + 1, dtype=torch.int32)
        swa_len[i] = k
        m = int(torch.randint(0, topk + 1, (1,), generator=g))
        comp[i, :m] = torch.randperm(n_c, generator=g)[:m].to(torch.int32)
        comp_len[i] = m
    swa[0], swa_len[0], comp[0], comp_len[0] = -1, 0, -1, 0  # a padded token: nothing
    comp[1, comp_len[1] :] = torch.randint(0, n_c, (topk - int(comp_len[1]),), generator=g).int()
    swa[2, 3:9] = -1
    comp[2, :2] = torch.tensor([n_c, I32_MAX], dtype=torch.int32)
    sets = dict(
        main=(swa, swa_len, swa_page, n_swa),
        extra=(comp, comp_len, c_page, n_c),
    )
    return {k: (i.to(DEVICE), c.to(DEVICE), p, n) for k, (i, c, p, n) in sets.items()}


@pytest.mark.parametrize("dtype", DTYPE_PARAMS)
@pytest.mark.parametrize("native", NATIVE)
@pytest.mark.parametrize("splits", SPLITS)
def test_swa_plus_compressed_with_sink(dtype, native, splits):
    """Both caches in the V4 record, one softmax over both sets and a sink (random, -inf and
    +inf heads), against the reference; every byte no valid index reaches is 0xFF."""
    g = gen(411 + splits + native)
    t, h = 6, 5
    s = swa_and_compressed(t, g)
    (idx, cnt, page, n), (xidx, xcnt, xpage, xn) = s["main"], s["extra"]
    cache = v4_cache(v4_rows(n, g, 1.0), page, used_slots(n, idx, valid_counts=cnt))
    xcache = v4_cache(v4_rows(xn, g, 1.0), xpage, used_slots(xn, xidx, valid_counts=xcnt))
    q = (torch.randn(t, h, DS_V4_WIDTH, generator=g) * 0.5).to(dtype).to(DEVICE)
    kw = dict(
        valid_counts=cnt,
        extra_kv_cache=xcache,
        extra_indices=xidx,
        extra_valid_counts=xcnt,
        attn_sink=sinks(h, g),
        **FMT,
    )
    ref_out, ref_lse = sparse_mla_reference(
        q, cache, idx, return_lse=True, compute_dtype=torch.float64, **kw
    )
    cfg = choose_config(t, h, 54, dtype, "fp8_ds_mla_v4", arch_of(DEVICE))
    cfg = dataclasses.replace(cfg, fp8_native=native, num_splits=splits)
    out = poison_(torch.empty(t, h, DS_V4_WIDTH, dtype=dtype, device=DEVICE))
    _, lse = sparse_mla(q, cache, idx, return_lse=True, out=out, config=cfg, **kw)
    assert_matches(out, lse, ref_out, ref_lse, dtype)
    assert (out[0] == 0).all() and torch.isneginf(lse[0]).all()
    assert (out[:, 2] == 0).all()


@pytest.mark.parametrize("native", NATIVE)
@pytest.mark.parametrize("staged", [False, True], ids=["hoisted", "staged"])
def test_block_table_layers_and_staging(native, staged):
    """Request-local positions through a block table (-1 entry, an entry past the cache,
    positions past the table), on a cache whose pages lie further apart than vLLM's padded
    stride (another layer's pages in between, 0xFF); the staged and the hoisted chunk
    conversion; pages of one token as the extra cache."""
    g = gen(421 + staged)
    t, h, page, pages = 4, 3, 4, 10
    n = page * pages
    rows = v4_rows(n, g, 2.0)
    stride = ds_mla_v4_page_stride(page)
    big = torch.full((pages, 2, stride), POISON, dtype=torch.uint8, device=DEVICE)
    layer = big[:, 1]
    cache = layer.as_strided((pages, page, 584), (2 * stride, 584, 1))
    write_fp8_ds_mla_v4(cache, torch.arange(n, device=DEVICE), rows.to(DEVICE))
    table = torch.tensor([[3, -1, 7, 0], [9, 2, pages + 4, 5]], dtype=torch.int32, device=DEVICE)
    req = torch.tensor([0, 1, 1, 0], dtype=torch.int32, device=DEVICE)
    idx = torch.randint(-1, 4 * page + 3, (t, 12), generator=g, dtype=torch.int32).to(DEVICE)
    xn = 20
    xcache = pack_fp8_ds_mla_v4(v4_rows(xn, g, 2.0).to(DEVICE), 1)
    xidx = torch.randint(-2, xn + 2, (t, 9), generator=g, dtype=torch.int32).to(DEVICE)
    q = torch.randn(t, h, DS_V4_WIDTH, generator=g).half().to(DEVICE)
    kw = dict(
        block_table=table,
        req_ids=req,
        block_size=page,
        extra_kv_cache=xcache,
        extra_indices=xidx,
        **FMT,
    )
    ref_out, ref_lse = sparse_mla_reference(q, cache, idx, return_lse=True, **kw)
    for splits in (1, 2):
        cfg = KernelConfig(16, 16, 4, 1, num_splits=splits, fp8_native=native, stage_dequant=staged)
        out, lse = sparse_mla(q, cache, idx, return_lse=True, config=cfg, **kw)
        assert_matches(out, lse, ref_out, ref_lse, torch.float16)


def _check_folded_on_wide_scales(dtype, native, staged, splits, seed, spread, **folding):
    """One folded form (``folding``: the KernelConfig fields asking for it) on groups spread
    over 2 x ``spread`` decades (v4_rows), both caches, a sink, -1 runs; against the float64
    reference within q's tolerance, zeros where no index points. q is small enough that the
    logits stay at a few tens of nats, as attention's do: a split's fp32 LSE carries a rounding
    of |LSE| x 2^-24, which the merge turns into relative output error (up to ~1e-4 at |LSE| ~
    900; an H200 measured 1.7e-5 there, past fp32's 1e-5 check however exactly the rest of
    the kernel computes)."""
    g = gen(seed)
    t, h = 6, 5
    s = swa_and_compressed(t, g)
    (idx, cnt, page, n), (xidx, xcnt, xpage, xn) = s["main"], s["extra"]
    cache = v4_cache(v4_rows(n, g, spread), page, used_slots(n, idx, valid_counts=cnt))
    xcache = v4_cache(v4_rows(xn, g, spread), xpage, used_slots(xn, xidx, valid_counts=xcnt))
    q = (torch.randn(t, h, DS_V4_WIDTH, generator=g) * 3e-5).to(dtype).to(DEVICE)
    kw = dict(
        valid_counts=cnt,
        extra_kv_cache=xcache,
        extra_indices=xidx,
        extra_valid_counts=xcnt,
        attn_sink=sinks(h, g),
        **FMT,
    )
    ref_out, ref_lse = sparse_mla_reference(
        q, cache, idx, return_lse=True, compute_dtype=torch.float64, **kw
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
    out = poison_(torch.empty(t, h, DS_V4_WIDTH, dtype=dtype, device=DEVICE))
    _, lse = sparse_mla(q, cache, idx, return_lse=True, out=out, config=cfg, **kw)
    assert_matches(out, lse, ref_out, ref_lse, dtype)
    assert (out[0] == 0).all() and torch.isneginf(lse[0]).all()
    assert (out[:, 2] == 0).all()


WIDE_MMA_DTYPES = [pytest.param(dt, id=dtype_id(dt)) for dt in DTYPES if dt != torch.float16]
FP16_MMA_DTYPES = [pytest.param(dt, id=dtype_id(dt)) for dt in DTYPES if dt != torch.float32]


@pytest.mark.parametrize("dtype", WIDE_MMA_DTYPES)
@pytest.mark.parametrize("native", NATIVE)
@pytest.mark.parametrize("staged", [False, True], ids=["hoisted", "staged"])
@pytest.mark.parametrize("splits", [1, 2])
def test_mmas_in_q_dtype_on_wide_scales(dtype, native, staged, splits):
    """bf16 / fp32 q with MMAs in q's dtype rather than fp16 (the scales folded into the
    tile): groups over twelve decades (scales 2^-22 .. 2^21)."""
    _check_folded_on_wide_scales(
        dtype, native, staged, splits, 441 + 2 * splits + native, 6.0, fp16_mma=False
    )


@pytest.mark.parametrize("dtype", FP16_MMA_DTYPES)
@pytest.mark.parametrize("native", NATIVE)
@pytest.mark.parametrize("staged", [False, True], ids=["hoisted", "staged"])
@pytest.mark.parametrize("splits", [1, 2])
def test_fp16_fold_on_wide_scales(dtype, native, staged, splits):
    """fp16 MMAs with the scales folded relative to each step's largest (KernelConfig.fp16_fold;
    fp16 q everywhere, bf16 on a GPU): groups over twelve decades (eight with fp16 q, whose
    output holds up to 65504; a step's smallest groups still fall below fp16's normal range
    relative to its largest)."""
    spread = 4.0 if dtype == torch.float16 else 6.0
    _check_folded_on_wide_scales(
        dtype, native, staged, splits, 461 + 2 * splits + native, spread, fp16_fold=True
    )


def test_fp16_tolerance_holds_on_wide_scales():
    """Groups over ten decades in one gather step: the fp16 MMA path (P times scale over the
    step's largest scale) stays within fp16's tolerance of the float64 reference."""
    g = gen(431)
    t, h, n = 3, 4, 64
    cache = pack_fp8_ds_mla_v4(v4_rows(n, g, 5.0).to(DEVICE), 16)
    idx = torch.stack([torch.randperm(n, generator=g)[:40] for _ in range(t)]).int().to(DEVICE)
    q = (torch.randn(t, h, DS_V4_WIDTH, generator=g) * 1e-5).half().to(DEVICE)
    ref_out, ref_lse = sparse_mla_reference(
        q, cache, idx, return_lse=True, compute_dtype=torch.float64, **FMT
    )
    out, lse = sparse_mla(q, cache, idx, return_lse=True, **FMT)
    assert_matches(out, lse, ref_out, ref_lse, torch.float16)


def test_plan_family_and_record_geometry():
    """The plan names the V4 family, with fp8_ds_mla's tiles; the record's byte geometry in the
    kernel module equals kv_format's."""
    from triton_mla_sparse.ops.sparse_mla.kernels import ds_mla_v4

    assert ds_mla_v4.V4_DATA_BYTES.value == DS_V4_DATA_BYTES
    assert ds_mla_v4.V4_SCALE_BYTES.value == DS_V4_SCALE_BYTES
    assert ds_mla_v4.V4_GROUP.value == DS_V4_GROUP and ds_mla_v4.V4_NOPE.value == DS_V4_NOPE
    cache = pack_fp8_ds_mla_v4(torch.randn(8, DS_V4_WIDTH, device=DEVICE), 4)
    q = torch.randn(2, 16, DS_V4_WIDTH, device=DEVICE).half()
    plan = sparse_mla_plan(q, cache, torch.zeros(2, 5, dtype=torch.int32, device=DEVICE), **FMT)
    assert plan.family == "ds_mla_v4"
    ds = choose_config(2, 16, 5, torch.float16, "fp8_ds_mla", arch_of(DEVICE))
    got = plan.config
    assert (got.block_h, got.block_n, got.num_warps, got.num_stages, got.stage_dequant) == (
        ds.block_h,
        ds.block_n,
        ds.num_warps,
        ds.num_stages,
        ds.stage_dequant,
    )
