"""The extra index set: a second cache with its own indices in the same softmax.

Kernel against the float64/float32 reference (``sparse_mla_reference`` with the same extra
arguments), in the style of test_sparse_mla.py: rows no valid index of a set reaches are NaN in
that set's cache for the kernel, outputs are NaN-poisoned before the call. Independent of the
reference: the result equals one call over a single cache holding both sets' rows with the two
lists concatenated, and does not depend on which set is called main and which extra.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch
from conftest import DEVICE, size
from test_sparse_mla import (
    DTYPE_PARAMS,
    FORMATS,
    I32_MAX,
    SPLITS,
    D,
    assert_matches,
    config_for,
    gen,
    interleaved_paged,
    make_cache,
    poison_,
    poison_unused_rows_,
    rand_indices,
    randn,
    reference,
    sinks,
)

from triton_mla_sparse import KernelConfig, sparse_mla, sparse_mla_plan
from triton_mla_sparse.ops.sparse_mla.heuristics import split_len_for
from triton_mla_sparse.testing import sparse_mla_tolerance


def run_extra(q, cache, idx, xcache, xidx, dtype, fkw, cfg, *, kw=None, xkw=None, ref=None):
    """Reference on clean caches, then the kernel with each cache's unused rows poisoned.
    ``kw``: the main set's keywords (valid_counts, block table, sink); ``xkw``: the extra set's,
    named without the ``extra_`` prefix. ``ref``: clean copies (cache, xcache) when the caches
    passed are views into poisoned allocations."""
    kw, xkw = dict(kw or {}), dict(xkw or {})
    extra = {f"extra_{k}": v for k, v in xkw.items()}
    rc, rx = ref if ref is not None else (cache, xcache)
    ref_out, ref_lse = reference(
        q, rc, idx, extra_kv_cache=rx, extra_indices=xidx, **fkw, **kw, **extra
    )
    kc, kx = (cache, xcache) if ref is not None else (cache.clone(), xcache.clone())
    main_sel = {k: kw.get(k) for k in ("valid_counts", "block_table", "req_ids", "block_size")}
    poison_unused_rows_(kc, idx, **main_sel)
    extra_sel = dict(
        valid_counts=xkw.get("valid_counts"),
        block_table=xkw.get("block_table"),
        req_ids=kw.get("req_ids"),
        block_size=xkw.get("block_size"),
    )
    poison_unused_rows_(kx, xidx, **extra_sel)
    out = poison_(torch.empty(ref_out.shape, dtype=dtype, device=DEVICE))
    res, lse = sparse_mla(
        q,
        kc,
        idx,
        return_lse=True,
        config=cfg,
        out=out,
        extra_kv_cache=kx,
        extra_indices=xidx,
        **fkw,
        **kw,
        **extra,
    )
    assert res is out
    assert_matches(out, lse, ref_out, ref_lse, dtype)
    return out, lse


def six_patterns(w: int, n: int, xw: int, xn: int, g: torch.Generator):
    """Main and extra indices for six tokens: (0) both full; (1) main all -1, extra full; (2)
    main full, extra all -1; (3) both all -1 or out of range (nothing valid: zeros, LSE -inf);
    (4) -1 runs longer than a gather step in both, out-of-range entries (>= N, < -1, 2^31 - 1)
    in both; (5) main empty by its count, extra partly counted."""
    idx = rand_indices(6, w, n, g).cpu()
    xidx = rand_indices(6, xw, xn, g).cpu()
    idx[1] = -1
    xidx[2] = -1
    idx[3] = -1
    idx[3, ::3] = n + 5
    xidx[3] = -1
    xidx[3, 1::4] = -2
    idx[4, 2 : 2 + w // 2] = -1
    idx[4, -2:] = torch.tensor([n, I32_MAX], dtype=torch.int32)
    xidx[4, xw // 3 : xw // 3 + xw // 2] = -1
    xidx[4, :2] = torch.tensor([xn, -(2**31)], dtype=torch.int32)
    return idx.to(DEVICE), xidx.to(DEVICE)


@pytest.mark.parametrize("dtype", DTYPE_PARAMS)
@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("splits", SPLITS)
def test_extra_set_matches_reference(dtype, fmt, splits):
    """Both sets in one softmax, with an attention sink (random, -inf and +inf heads): flat main
    cache, paged extra cache of another page size whose block stride exceeds page * C, counts
    on both sets (0, past W, partial), every hole and out-of-range pattern on either side."""
    fmt, native = fmt
    g = gen(301 + splits)
    t, h = 6, 5
    n, w = size(160, 4096), size(70, 2048)
    xpage, xnb, xw = 4, size(24, 256), size(50, 512)
    xn = xpage * xnb
    q = randn(t, h, D, g=g, dtype=dtype)
    cache, fkw = make_cache(randn(n, D, g=g), fmt, dtype)
    xflat, _ = make_cache(randn(xn, D, g=g), fmt, dtype)
    xcache, _big = interleaved_paged(xflat, xpage)
    idx, xidx = six_patterns(w, n, xw, xn, g)
    counts = torch.tensor([w, w, w + 9, w, w, 0], dtype=torch.int32, device=DEVICE)
    xcounts = torch.tensor([xw, I32_MAX, 0, xw, xw - 5, xw // 2], dtype=torch.int32)
    cfg = config_for(t, h, w + xw, dtype, fmt, native, splits, extra_set=True)
    kw = dict(valid_counts=counts, attn_sink=sinks(h, g))
    xkw = dict(valid_counts=xcounts.to(DEVICE))
    out, lse = run_extra(
        q, cache, idx, xcache, xidx, dtype, fkw, cfg, kw=kw, xkw=xkw, ref=(cache, xcache.clone())
    )
    for empty in (3,):
        assert (out[empty] == 0).all() and torch.isneginf(lse[empty]).all()
    assert torch.isfinite(lse[[0, 1, 2, 4, 5]]).all()
    assert (out[:, 2] == 0).all(), "a +inf sink takes all the weight"


@pytest.mark.parametrize("fmt", FORMATS)
def test_extra_equals_one_concatenated_list(fmt):
    """Independent of the reference: the extra set is the same as one cache holding the main
    rows then the extra rows, indexed by the main list followed by the extra list (shifted past
    the main rows), and swapping which set is main and which extra changes nothing. fp32, split
    and unsplit; -1 entries and counts on both sides."""
    fmt, native = fmt
    dtype = torch.float32
    g = gen(311)
    t, h, n, xn, w, xw = 5, 3, 90, 70, 37, 29
    q = randn(t, h, D, g=g, dtype=dtype)
    # quantized together (fp8: one per-tensor scale serves both caches), then split in two
    both, fkw = make_cache(randn(n + xn, D, g=g), fmt, dtype)
    cache, xcache = both[:n], both[n:]
    idx = rand_indices(t, w, n, g)
    xidx = rand_indices(t, xw, xn, g)
    idx[1, 5:20] = -1
    xidx[0, 3:9] = -1
    idx[4], xidx[4] = -1, -1  # nothing valid in either set
    counts = torch.tensor([w, w - 3, 0, 11, w], dtype=torch.int32, device=DEVICE)
    xcounts = torch.tensor([xw, 4, xw, 0, xw], dtype=torch.int32, device=DEVICE)
    # the concatenated list: main entries past the count become -1, extra ones shift by n
    pos, xpos = torch.arange(w, device=DEVICE), torch.arange(xw, device=DEVICE)
    cat_main = torch.where(pos[None, :] < counts[:, None], idx, -1)
    xshift = torch.where(xidx >= 0, xidx + n, xidx)
    cat_extra = torch.where(xpos[None, :] < xcounts[:, None], xshift, -1)
    cat = torch.cat([cat_main, cat_extra], dim=1).to(torch.int32)
    for splits in (1, 3):
        cfg = dataclasses.replace(
            config_for(t, h, w + xw, dtype, fmt, native, extra_set=True), num_splits=splits
        )
        got, lse = sparse_mla(
            q,
            cache,
            idx,
            return_lse=True,
            config=cfg,
            valid_counts=counts,
            extra_kv_cache=xcache,
            extra_indices=xidx,
            extra_valid_counts=xcounts,
            **fkw,
        )
        swapped, lse_sw = sparse_mla(
            q,
            xcache,
            xidx,
            return_lse=True,
            config=cfg,
            valid_counts=xcounts,
            extra_kv_cache=cache,
            extra_indices=idx,
            extra_valid_counts=counts,
            **fkw,
        )
        one, lse_one = sparse_mla(q, both, cat, return_lse=True, config=cfg, **fkw)
        for o, o_lse in ((swapped, lse_sw), (one, lse_one)):
            torch.testing.assert_close(got, o, rtol=1e-5, atol=1e-6)
            torch.testing.assert_close(lse, o_lse, rtol=1e-5, atol=1e-5)
        assert (got[2] != 0).any() and (got[3] != 0).any()
        assert (got[4] == 0).all() and torch.isneginf(lse[4]).all()


@pytest.mark.parametrize("fmt", [FORMATS[0], FORMATS[3]])
@pytest.mark.parametrize("block_n", [16, 32])
def test_splits_across_the_boundary(fmt, block_n):
    """Main widths that are not whole gather steps (the extra set starts at the next step) and
    every split count from 1 to past the number of steps: each split may hold main entries,
    extra entries or both, and all agree with the single pass (fp32: 1e-5)."""
    fmt, native = fmt
    dtype = torch.float32
    g = gen(321 + block_n)
    t, h, n, xn, w, xw = 3, 4, 80, 60, 37, 21
    q = randn(t, h, D, g=g, dtype=dtype)
    cache, fkw = make_cache(randn(n, D, g=g), fmt, dtype)
    xcache, _ = make_cache(randn(xn, D, g=g), fmt, dtype)
    idx, xidx = rand_indices(t, w, n, g), rand_indices(t, xw, xn, g)
    xidx[1, :] = -1
    idx[2, :] = -1
    kw = dict(extra_kv_cache=xcache, extra_indices=xidx, **fkw)
    base = KernelConfig(16, block_n, 4, 1, fp8_native=native)
    ref_out, ref_lse = reference(q, cache, idx, **kw)
    steps = -(-w // block_n) + -(-xw // block_n)
    single, single_lse = sparse_mla(q, cache, idx, return_lse=True, config=base, **kw)
    assert_matches(single, single_lse, ref_out, ref_lse, dtype)
    for splits in range(2, steps + 2):
        cfg = dataclasses.replace(base, num_splits=splits)
        plan = sparse_mla_plan(q, cache, idx, config=cfg, **kw)
        assert plan.extra.offset == -(-w // block_n) * block_n
        assert (plan.split_len, plan.num_splits) == split_len_for(
            plan.extra.offset + xw, splits, block_n
        )
        out, lse = sparse_mla(q, cache, idx, return_lse=True, config=cfg, **kw)
        torch.testing.assert_close(out, single, rtol=1e-5, atol=1e-6)
        torch.testing.assert_close(lse, single_lse, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("dtype", DTYPE_PARAMS)
@pytest.mark.parametrize("fmt", [FORMATS[0], FORMATS[2], FORMATS[4]])
@pytest.mark.parametrize("main_table", [False, True], ids=["main-flat", "main-table"])
def test_extra_block_table(dtype, fmt, main_table):
    """The extra set through its own block table and block size (request ids shared with the
    main set), with -1 and past-the-cache table entries and positions past the table; the main
    set flat or through another table. Split and unsplit."""
    fmt, native = fmt
    g = gen(331 + main_table)
    t, h, reqs = 4, 3, 2
    n, w = 128, 30
    xpage, xnb, xbs, xw = 16, 12, 8, 40
    q = randn(t, h, D, g=g, dtype=dtype)
    cache, fkw = make_cache(randn(n, D, g=g), fmt, dtype)
    xcache, _ = make_cache(randn(xnb * xpage, D, g=g), fmt, dtype)
    xcache = xcache.view(xnb, xpage, -1)
    xmax = 6  # table blocks per request: positions < 6 * 8 are inside the table
    xtable = torch.stack([torch.randperm(xnb * xpage // xbs, generator=g)[:xmax] for _ in range(2)])
    xtable = xtable.to(torch.int32)
    xtable[0, 2] = -1
    xtable[1, 4] = xnb * xpage // xbs + 7  # past the cache
    req_ids = torch.tensor([1, 0, 0, 1], dtype=torch.int32, device=DEVICE)
    xidx = torch.stack([torch.randperm(xmax * xbs + 6, generator=g)[:xw] for _ in range(t)])
    xidx = xidx.to(torch.int32).to(DEVICE)
    kw: dict = dict(req_ids=req_ids)
    if main_table:
        bs = 16
        table = torch.stack([torch.randperm(n // bs, generator=g)[:4] for _ in range(reqs)])
        kw.update(block_table=table.to(torch.int32).to(DEVICE), block_size=bs)
        idx = torch.stack([torch.randperm(4 * bs + 3, generator=g)[:w] for _ in range(t)])
        idx = idx.to(torch.int32).to(DEVICE)
    else:
        idx = rand_indices(t, w, n, g)
    xkw = dict(block_table=xtable.to(DEVICE), block_size=xbs)
    for splits in (1, 3):
        cfg = config_for(t, h, w + xw, dtype, fmt, native, splits, block_table=True, extra_set=True)
        run_extra(q, cache, idx, xcache, xidx, dtype, fkw, cfg, kw=kw, xkw=xkw)


@pytest.mark.parametrize("fmt", [FORMATS[0], FORMATS[3]])
@pytest.mark.parametrize("splits", SPLITS)
def test_sink_extremes_with_extra(fmt, splits):
    """Sinks of -inf, +inf, far above and far below every logit, 1e30 (its exponential
    overflows: zero output, as +inf) and 0, over both sets; an empty token keeps zeros and LSE
    -inf whatever the sink; the LSE never includes the sink."""
    fmt, native = fmt
    dtype = torch.float32
    g = gen(341 + splits)
    t, h, n, xn, w, xw = 3, 6, 60, 40, 24, 20
    q = randn(t, h, D, g=g, dtype=dtype)
    cache, fkw = make_cache(randn(n, D, g=g), fmt, dtype)
    xcache, _ = make_cache(randn(xn, D, g=g), fmt, dtype)
    idx, xidx = rand_indices(t, w, n, g), rand_indices(t, xw, xn, g)
    idx[2], xidx[2] = -1, -1
    sink = torch.tensor([float("-inf"), float("inf"), 60.0, -60.0, 1e30, 0.0], device=DEVICE)
    cfg = config_for(t, h, w + xw, dtype, fmt, native, splits, extra_set=True)
    out, lse = run_extra(q, cache, idx, xcache, xidx, dtype, fkw, cfg, kw=dict(attn_sink=sink))
    assert (out[:, 1] == 0).all() and (out[:, 4] == 0).all()
    assert (out[2] == 0).all() and torch.isneginf(lse[2]).all()
    plain, plain_lse = sparse_mla(
        q, cache, idx, return_lse=True, config=cfg, extra_kv_cache=xcache, extra_indices=xidx, **fkw
    )
    torch.testing.assert_close(lse, plain_lse, rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(
        out[:, 0], plain[:, 0], rtol=sparse_mla_tolerance(dtype).out_rtol, atol=1e-6
    )


def test_plan_without_extra_is_unchanged():
    """Without an extra set the plan is the plan of before: HAS_EXTRA False, no ExtraPlan, the
    split length over the main width alone; with one, the split sequence covers both."""
    q = torch.randn(2, 4, D, device=DEVICE)
    cache = torch.randn(50, D, device=DEVICE)
    idx = torch.zeros(2, 40, dtype=torch.int32, device=DEVICE)
    cfg = KernelConfig(16, 16, 4, 1, num_splits=2)
    plain = sparse_mla_plan(q, cache, idx, config=cfg)
    assert plain.extra is None and plain.constexprs["HAS_EXTRA"] is False
    assert (plain.split_len, plain.num_splits) == (32, 2)
    xcache = torch.randn(3, 8, D, device=DEVICE)
    xidx = torch.zeros(2, 30, dtype=torch.int32, device=DEVICE)
    xcounts = torch.zeros(2, dtype=torch.int32, device=DEVICE)
    plan = sparse_mla_plan(
        q,
        cache,
        idx,
        config=cfg,
        extra_kv_cache=xcache,
        extra_indices=xidx,
        extra_valid_counts=xcounts,
    )
    assert plan.extra.offset == 48 and plan.extra.width == 30
    assert (plan.split_len, plan.num_splits) == (48, 2)  # 78 positions in two splits of 3 steps
    c = plan.constexprs
    assert c["HAS_EXTRA"] and c["EXTRA_HAS_COUNTS"] and not c["EXTRA_HAS_BT"]
    assert c["EXTRA_PAGE_SHIFT"] == 3
    assert {k: v for k, v in c.items() if not k.startswith(("HAS_EXTRA", "EXTRA_"))} == {
        k: v for k, v in plain.constexprs.items() if not k.startswith(("HAS_EXTRA", "EXTRA_"))
    }
