"""Differential fuzz: sparse_mla against the float64 reference on random calls.

Each case draws a format, q dtype, latent and rope widths, token / head / top-k counts, a flat or
paged cache (any page size), raw indices over [-3, N + 3) or request-local positions through a
random block table (with -1 entries, any block size), optional valid_counts, a tensor or float
k_scale, q as one tensor or a (latent, rope) tuple, an attention sink, an extra index set into a
second cache (its own page size, counts, block table), and half the time an explicit KernelConfig
(block sizes, warps, stages, split count, fp8 decode, MMA type, step-ahead or staged loops where
the family has them). out is a view into a NaN-poisoned wider buffer: every output element must
be written and nothing past it. It found the merge writing past narrow outputs (PERFORMANCE.md
log 17).

``TMS_FUZZ_CASES`` (default 12 per seed in CI) and ``TMS_FUZZ_SEEDS`` (default 4) scale it up:
``TMS_FUZZ_CASES=100 TMS_FUZZ_SEEDS=20 pytest tests/test_fuzz.py``.
"""

from __future__ import annotations

import os
import random

import pytest
import torch
from conftest import DEVICE, HAS_GPU

from triton_mla_sparse import KernelConfig, pack_fp8_ds_mla, sparse_mla, sparse_mla_plan
from triton_mla_sparse.kv_format import quantize_fp8
from triton_mla_sparse.reference import sparse_mla_reference
from triton_mla_sparse.testing import assert_sparse_mla_close

CASES = int(os.environ.get("TMS_FUZZ_CASES", "12"))
SEEDS = int(os.environ.get("TMS_FUZZ_SEEDS", "4"))


def draw(rng: random.Random, g: torch.Generator) -> dict:
    """One random call: sparse_mla's arguments, for both the kernel and the reference."""
    fmt = rng.choice(["auto", "fp8", "fp8_ds_mla"])
    dtypes = [torch.float16, torch.float32] + ([torch.bfloat16] if HAS_GPU else [])
    dt = rng.choice(dtypes if fmt == "auto" else dtypes[:1] + dtypes[2:])
    if fmt == "fp8_ds_mla":
        lat, rope = 512, rng.choice([0, 64])
    else:
        lat, rope = rng.choice([16, 32, 64, 128]), rng.choice([0, 16, 32])
    T, H, W = rng.randint(1, 4), rng.randint(1, 40), rng.randint(1, 200)
    kw: dict = {"kv_format": fmt, "kv_lora_rank": lat}
    scale = rng.choice([0.25, 0.5, 1.0])  # fp8: one per-tensor scale for both caches
    if fmt == "fp8":
        kw["k_scale"] = torch.tensor([scale]) if rng.random() < 0.5 else scale

    def new_cache():
        page, nb = rng.choice([1, 16, 48, 64]), rng.randint(1, 8)
        n = nb * page
        rows = torch.randn(n, lat + rope, generator=g)
        if fmt == "fp8_ds_mla":
            full = rows if rope else torch.cat([rows, torch.zeros(n, 64)], dim=1)
            cache = pack_fp8_ds_mla(full, rng.choice(["pow2", "fp32"]))
        elif fmt == "fp8":
            cache = quantize_fp8(rows, k_scale=scale)[0].view(torch.uint8)
        else:
            cache = rows.to(dt)
        return (cache.view(nb, page, -1) if page > 1 else cache), n

    cache, n = new_cache()
    q = torch.randn(T, H, lat + rope, generator=g).to(dt)
    if rng.random() < 0.3:
        bs = rng.choice([16, 48, 64])
        reqs = rng.randint(1, 3)
        max_blocks = rng.randint(1, 6)
        kw["block_table"] = torch.randint(-1, max(1, n // bs) + 1, (reqs, max_blocks), generator=g)
        kw["req_ids"] = torch.randint(0, reqs, (T,), generator=g)
        kw["block_size"] = bs
        idx = torch.randint(-2, max_blocks * bs + 3, (T, W), generator=g)
    else:
        idx = torch.randint(-3, n + 3, (T, W), generator=g)
    if rng.random() < 0.3:
        kw["valid_counts"] = torch.randint(0, W + 2, (T,), generator=g)
    if rng.random() < 0.3:  # an extra index set into a second cache of its own page size
        kw["extra_kv_cache"], xn = new_cache()
        xw = rng.randint(1, 150)
        if "block_table" in kw and rng.random() < 0.5:
            xbs, xmax = rng.choice([8, 16, 64]), rng.randint(1, 5)
            xtable = torch.randint(
                -1, max(1, xn // xbs) + 1, (kw["block_table"].shape[0], xmax), generator=g
            )
            kw["extra_block_table"], kw["extra_block_size"] = xtable, xbs
            kw["extra_indices"] = torch.randint(-2, xmax * xbs + 3, (T, xw), generator=g)
        else:
            kw["extra_indices"] = torch.randint(-3, xn + 3, (T, xw), generator=g)
        if rng.random() < 0.5:
            kw["extra_valid_counts"] = torch.randint(-1, xw + 2, (T,), generator=g)
    cfg = None
    if rng.random() < 0.5:
        ahead = "block_table" not in kw and rng.random() < 0.3
        cfg = KernelConfig(
            rng.choice([16, 32, 64]),
            rng.choice([16, 32, 64]),
            rng.choice([4, 8]),
            rng.choice([1, 2, 3]),
            num_splits=rng.randint(1, 9),
            fp8_native=rng.choice([None, False]),
            idx_ahead=ahead,
            stage_dequant=fmt == "fp8_ds_mla" and rng.random() < 0.5,
            fp16_mma=rng.choice([None, True, False]),
        )
    kw["config"] = cfg
    tuple_q = rope > 0 and rng.random() < 0.3
    if rng.random() < 0.3:  # an attention sink, now and then -inf or +inf for one head
        sink = torch.randn(H, generator=g) * 3
        sink[rng.randrange(H)] = rng.choice([float("-inf"), float("inf"), 0.0])
        kw["attn_sink"] = sink
    return dict(q=q, cache=cache, idx=idx, kw=kw, tuple_q=tuple_q, dt=dt, lat=lat)


def to_device(x):
    if isinstance(x, torch.Tensor):
        return x.to(
            DEVICE,
            dtype=torch.int32 if not x.is_floating_point() and x.dtype != torch.uint8 else x.dtype,
        )
    return x


@pytest.mark.parametrize("seed", range(SEEDS))
def test_random_calls_match_the_reference(seed):
    rng = random.Random(seed)
    g = torch.Generator().manual_seed(seed)
    for i in range(CASES):
        c = draw(rng, g)
        kw = {k: to_device(v) for k, v in c["kw"].items()}
        q, cache, idx = to_device(c["q"]), to_device(c["cache"]), to_device(c["idx"])
        lat, dt = c["lat"], c["dt"]
        qa = (q[..., :lat], q[..., lat:]) if c["tuple_q"] else q
        T, H = q.shape[:2]
        wide = torch.full((T, H, lat + 32), float("nan"), dtype=dt, device=DEVICE)
        out = wide[..., :lat]
        what = f"case {i}: {sparse_mla_plan(qa, cache, idx, 0.07, return_lse=True, **kw)}"
        _, lse = sparse_mla(qa, cache, idx, 0.07, return_lse=True, out=out, **kw)
        ref_kw = {k: v for k, v in kw.items() if k != "config"}
        ref, ref_lse = sparse_mla_reference(
            qa, cache, idx, 0.07, return_lse=True, compute_dtype=torch.float64, **ref_kw
        )
        assert out.dtype == dt, what
        assert torch.isnan(wide[..., lat:]).all(), f"wrote past out's columns; {what}"
        assert_sparse_mla_close(out, ref, lse=lse, ref_lse=ref_lse, what=what)
