"""Differential fuzz of the indexer logits against the float64 reference on random calls.

Paged decode: random requests, next_n 1-4, any head count 1-128, context lengths 0-300 (both
context_lens forms), padded block stride, a scrambled block table with entries then broken (-1
or past the cache), max_model_len below and above the lengths. Prefill: random K rows and
per-row [ks, ke) windows, empty and reversed ones, windows past N, max_seqlen_k clamps. Both with
q as e4m3 (float8 or bytes), fp16 or fp32, and half the time an explicit IndexerConfig (rows,
steps, chunk, warps, stages, integer decode, fp16 MMAs). ``out`` is a view into a wider buffer
poisoned with -7777: written columns must match, unwritten ones and the columns past
``out`` must keep the poison.

``TMS_FUZZ_CASES`` / ``TMS_FUZZ_SEEDS`` scale it up (tests/test_fuzz.py).
"""

from __future__ import annotations

import os
import random

import pytest
import torch
from conftest import DEVICE
from test_indexer import (
    PAGE,
    POISON,
    Q_KINDS,
    TOL,
    D,
    fill_tokens,
    make_cache,
    make_q,
)

from triton_mla_sparse.indexer import IndexerConfig, mqa_logits, paged_mqa_logits
from triton_mla_sparse.kv_format import indexer_cache_blocks, quantize_indexer_k
from triton_mla_sparse.ops.indexer.heuristics import MAX_DOT_N, block_h_for
from triton_mla_sparse.reference import mqa_logits_reference, paged_mqa_logits_reference

CASES = int(os.environ.get("TMS_FUZZ_CASES", "6"))
SEEDS = int(os.environ.get("TMS_FUZZ_SEEDS", "4"))


def random_config(rng: random.Random, H: int) -> IndexerConfig | None:
    if rng.random() < 0.5:
        return None
    bh = block_h_for(H)
    rows = rng.choice([r for r in (1, 2, 4, 8) if r * bh <= MAX_DOT_N])
    block_n = rng.choice([16, 32, 64, 128])
    return IndexerConfig(
        rows,
        block_n,
        rng.choice([block_n, 2 * block_n, 256, 1000]),
        rng.choice([4, 8]),
        rng.choice([1, 2, 3]),
        fp8_native=rng.choice([None, False]),
        fp8_mma=rng.choice([None, False]),
    )


def abs_e4m3(x: torch.Tensor) -> torch.Tensor:
    """|x| of e4m3 values (float8 or their bytes): the sign bit cleared."""
    return (x.view(torch.uint8) & 0x7F).view(x.dtype)


def abs_q(q: torch.Tensor) -> torch.Tensor:
    return abs_e4m3(q) if q.dtype in (torch.uint8, torch.float8_e4m3fn) else q.abs()


def check_out(wide, width, ref, bound, what):
    """Written columns within TOL of the sum of absolute terms (the reference on |q|, |k|, |w|:
    what fp32 accumulation error scales with, also where the logit itself cancels to ~0);
    unwritten columns and the columns past ``out`` keep the poison."""
    out = wide[:, :width]
    fin = torch.isfinite(ref)
    assert torch.equal(fin, torch.isfinite(bound)), what
    assert torch.isfinite(out[fin]).all(), f"{what}: non-finite logits at written positions"
    err = ((out - ref).abs() / bound.clamp_min(1e-30)).masked_fill(~fin, 0).max().item()
    assert err <= TOL, f"{what}: error {err:.2e} of the absolute-term sum > {TOL}"
    assert (out[~fin] == POISON).all(), f"{what}: wrote an unwritten column"
    assert (wide[:, width:] == POISON).all(), f"{what}: wrote past out's columns"


@pytest.mark.parametrize("seed", range(SEEDS))
def test_random_paged_calls(seed):
    rng = random.Random(seed)
    gen = torch.Generator().manual_seed(seed)
    for i in range(CASES):
        B, next_n, H = rng.randint(1, 4), rng.randint(1, 4), rng.randint(1, 128)
        lens = [rng.choice([0, rng.randint(1, 300)]) for _ in range(B)]
        pages = [max(1, -(-n // PAGE)) for n in lens]
        max_blocks = max(pages) + rng.randint(0, 2)
        num_blocks = sum(pages) + rng.randint(0, 3)
        perm = torch.randperm(num_blocks, generator=gen).to(torch.int32)
        bt = torch.full((B, max_blocks), -1, dtype=torch.int32)
        used = 0
        for b, n in enumerate(pages):
            bt[b, :n] = perm[used : used + n]
            used += n
        bt = bt.to(DEVICE)
        cache = make_cache(num_blocks, rng.choice([0, 4, 64]))
        fill_tokens(cache, bt, lens, gen)
        for _ in range(rng.randint(0, 2)):  # break entries: skipped, never read
            b, j = rng.randrange(B), rng.randrange(max_blocks)
            bt[b, j] = rng.choice([-1, num_blocks, num_blocks + 7])
        q = make_q((B, next_n, H, D), rng.choice(Q_KINDS), gen)
        w = torch.randn(B * next_n, H, generator=gen).to(DEVICE)
        if rng.random() < 0.5:
            cl = torch.tensor(lens, dtype=torch.int32)[:, None] - next_n + 1 + torch.arange(next_n)
            cl = cl.clamp_min(0).to(torch.int32).to(DEVICE)
        else:
            cl = torch.tensor(lens, dtype=torch.int32, device=DEVICE)
        mml = rng.randint(1, max_blocks * PAGE + 40)
        cfg = random_config(rng, H)
        wide = torch.full((B * next_n, mml + 16), POISON, device=DEVICE)
        res = paged_mqa_logits(q, cache, w, cl, bt, mml, out=wide[:, :mml], config=cfg)
        assert res.data_ptr() == wide.data_ptr()
        ref = paged_mqa_logits_reference(q, cache, w, cl, bt, mml, compute_dtype=torch.float64)
        abs_cache = cache.clone()
        blocks = indexer_cache_blocks(abs_cache)
        blocks[:, : PAGE * D] &= 0x7F  # K values (the scales after them are positive)
        bound = paged_mqa_logits_reference(
            abs_q(q), abs_cache, w.abs(), cl, bt, mml, compute_dtype=torch.float64
        )
        what = f"paged case {i}: B{B} next_n{next_n} H{H} lens{lens} mml{mml} q {q.dtype} {cfg}"
        check_out(wide, mml, ref, bound, what)


@pytest.mark.parametrize("seed", range(SEEDS))
def test_random_prefill_calls(seed):
    rng = random.Random(1000 + seed)
    gen = torch.Generator().manual_seed(1000 + seed)
    for i in range(CASES):
        M, N, H = rng.randint(1, 12), rng.randint(1, 400), rng.randint(1, 128)
        k8, sc = quantize_indexer_k(torch.randn(N, D, generator=gen).to(DEVICE))
        ks = torch.tensor([rng.randint(-5, N) for _ in range(M)], dtype=torch.int32)
        ke = ks + torch.tensor([rng.randint(-3, N) for _ in range(M)], dtype=torch.int32)
        ks, ke = ks.clamp_min(0).to(DEVICE), ke.clamp_min(0).to(DEVICE)
        max_len = rng.randint(1, N + 10)
        q = make_q((M, H, D), rng.choice(Q_KINDS), gen)
        w = torch.randn(M, H, generator=gen).to(DEVICE)
        cfg = random_config(rng, H)
        wide = torch.full((M, max_len + 16), POISON, device=DEVICE)
        mqa_logits(q, k8, sc, w, ks, ke, max_len, out=wide[:, :max_len], config=cfg)
        ref = mqa_logits_reference(q, k8, sc, w, ks, ke, max_len, compute_dtype=torch.float64)
        bound = mqa_logits_reference(
            abs_q(q), abs_e4m3(k8), sc, w.abs(), ks, ke, max_len, compute_dtype=torch.float64
        )
        what = f"prefill case {i}: M{M} N{N} H{H} max_len{max_len} q {q.dtype} {cfg}"
        check_out(wide, max_len, ref, bound, what)
