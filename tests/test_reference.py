"""The reference's own contract: its result does not depend on how it chunks tokens, and it decodes
only what the entries reach (rows, or the V4 record's pages), whatever the rest of the cache holds.
"""

from __future__ import annotations

import pytest
import torch

from triton_mla_sparse import reference
from triton_mla_sparse.kv_format import pack_fp8_ds_mla, pack_fp8_ds_mla_v4
from triton_mla_sparse.reference import sparse_mla_reference

T, H, W = 7, 3, 5


def _case(fmt: str, g: torch.Generator):
    """(q, cache, indices, kwargs) with -1 entries, counts and an extra set on a second cache."""
    if fmt == "fp8_ds_mla_v4":
        d, page = 512, 4
        rows = torch.randn(40, d, generator=g) / 4
        cache, extra = pack_fp8_ds_mla_v4(rows, page), pack_fp8_ds_mla_v4(rows[:24] * 2, page)
        n, n_extra = 40, 24
    else:
        d = 576
        rows = torch.randn(10, 4, d, generator=g) / 4
        if fmt == "fp8_ds_mla":
            cache, extra = pack_fp8_ds_mla(rows), pack_fp8_ds_mla(rows[:6] * 2)
        else:
            cache, extra = rows.half(), (rows[:6] * 2).half()
        n, n_extra = 40, 24
    q = torch.randn(T, H, d, generator=g).half()
    idx = torch.randint(-1, n, (T, W), generator=g, dtype=torch.int32)
    kw = dict(
        kv_format=fmt,
        valid_counts=torch.randint(0, W + 1, (T,), generator=g, dtype=torch.int32),
        attn_sink=torch.randn(H, generator=g),
        extra_kv_cache=extra,
        extra_indices=torch.randint(-1, n_extra, (T, 3), generator=g, dtype=torch.int32),
        return_lse=True,
        compute_dtype=torch.float64,
    )
    return q, cache, idx, kw


@pytest.mark.parametrize("fmt", ["auto", "fp8_ds_mla", "fp8_ds_mla_v4"])
def test_token_chunks_do_not_change_the_result(fmt):
    q, cache, idx, kw = _case(fmt, torch.Generator().manual_seed(5))
    want, want_lse = sparse_mla_reference(q, cache, idx, 0.3, **kw)
    assert want_lse.isfinite().any() and want.abs().sum() > 0
    for chunk in (1, 3, T):
        out, lse = sparse_mla_reference(q, cache, idx, 0.3, token_chunk=chunk, **kw)
        assert torch.equal(out, want) and torch.equal(lse, want_lse), chunk


@pytest.mark.parametrize("fmt", ["fp8_ds_mla", "fp8_ds_mla_v4"])
def test_only_what_the_entries_reach_is_decoded(fmt, monkeypatch):
    """One token reaching two rows of a large cache: at most those rows (V4: their pages) are
    decoded, and bytes everywhere else (0xFF: NaN codes, an inf scale) never reach the result."""
    g = torch.Generator().manual_seed(2)
    real = reference.dequantize_cache
    if fmt == "fp8_ds_mla_v4":
        d, page = 512, 8
        cache = pack_fp8_ds_mla_v4(torch.randn(page * 64, d, generator=g) / 4, page)
        reached, per_call = [3 * page + 1, 3 * page + 6], page
        rows = real(cache, fmt).reshape(-1, d)[reached]
        cache[:3] = 0xFF  # every other page: NaN codes and an inf scale
        cache[4:] = 0xFF
    else:
        d = 576
        cache = torch.full((512, 656), 0xFF, dtype=torch.uint8)
        reached, per_call = [100, 300], 1
        cache[reached] = pack_fp8_ds_mla(torch.randn(2, d, generator=g) / 4)
        rows = real(cache[reached], fmt)
    decoded: list[int] = []

    def counting(c, *a, **k):
        res = real(c, *a, **k)
        decoded.append(res.numel() // d)
        return res

    monkeypatch.setattr(reference, "dequantize_cache", counting)
    q = torch.randn(1, 2, d, generator=g).double()
    idx = torch.tensor([reached + [-1]], dtype=torch.int32)
    out, lse = sparse_mla_reference(
        q, cache, idx, 0.1, kv_format=fmt, return_lse=True, compute_dtype=torch.float64
    )
    assert sum(decoded) <= 3 * per_call  # the two reached rows and row 0 of the -1 entry
    s = torch.einsum("hd,wd->hw", q[0], rows.double()) * 0.1
    p = torch.softmax(s, dim=-1)
    torch.testing.assert_close(out[0], p @ rows.double()[:, :512], rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(lse[0].double(), torch.logsumexp(s, -1), rtol=1e-6, atol=1e-6)
