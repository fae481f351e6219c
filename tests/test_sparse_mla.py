"""Kernel vs reference for triton_mla_sparse.sparse_mla.

Every test compares the Triton kernel against ``sparse_mla_reference`` (float64 for fp32 inputs,
float32 otherwise) on seeded random inputs. The reference always runs on a clean cache; the kernel
then gets the same cache with every row that no valid index reaches overwritten with NaN (and, for
paged caches, the memory between blocks too), and its outputs are NaN-poisoned before the call.
Any read of a row it must skip, or any output element it fails to write, shows up as NaN.

Pass/fail is the package's one definition (triton_mla_sparse.testing: the tolerance table per
output dtype, with why each value is what it is, and the comparison), shared with verify, bench
and the reliability procedure.
"""

from __future__ import annotations

import dataclasses
import math

import pytest
import torch
from conftest import DEVICE, DTYPES, HAS_GPU, dtype_id, size

from triton_mla_sparse import KernelConfig, pack_fp8_ds_mla, sparse_mla
from triton_mla_sparse.kv_format import quantize_fp8
from triton_mla_sparse.ops.sparse_mla.heuristics import arch_of, choose_config, split_len_for
from triton_mla_sparse.reference import physical_rows, sparse_mla_reference
from triton_mla_sparse.testing import (
    assert_sparse_mla_close,
    lse_error,
    reference_dtype,
    sparse_mla_tolerance,
)

L, R = 512, 64
D = L + R
I32_MAX = 2**31 - 1

# (kv_format, fp8_native): the integer e4m3 decode (sm80's path) is forced with fp8_native=False.
FORMATS = [
    pytest.param(("auto", None), id="auto"),
    pytest.param(("fp8", True), id="fp8-native"),
    pytest.param(("fp8", False), id="fp8-intdecode"),
    pytest.param(("fp8_ds_mla", True), id="dsmla-native"),
    pytest.param(("fp8_ds_mla", False), id="dsmla-intdecode"),
]
FP8_FORMATS = FORMATS[1:]
DTYPE_PARAMS = [pytest.param(dt, id=dtype_id(dt)) for dt in DTYPES]
SPLITS = [pytest.param(1, id="single"), pytest.param(4, id="split4")]
# the two gather loops: each step's indices loaded in the step, or one step ahead
LOOPS = [pytest.param(False, id="idx-inline"), pytest.param(True, id="idx-ahead")]


# ----------------------------------------------------------------------------------------------
# helpers


def gen(seed: int) -> torch.Generator:
    g = torch.Generator(device="cpu")
    g.manual_seed(seed)
    return g


def randn(*shape, g, dtype=torch.float32, scale=1.0) -> torch.Tensor:
    return (torch.randn(*shape, generator=g) * scale).to(dtype=dtype, device=DEVICE)


def rand_indices(t: int, w: int, n: int, g: torch.Generator) -> torch.Tensor:
    """[t, w] int32: each token picks w distinct rows of n (a top-k list), random order."""
    assert w <= n
    rows = [torch.randperm(n, generator=g)[:w] for _ in range(t)]
    return torch.stack(rows).to(torch.int32).to(DEVICE)


def make_cache(rows: torch.Tensor, fmt: str, dtype: torch.dtype, scale_format: str = "pow2"):
    """Float rows [..., C] -> (cache in the format's storage, format kwargs for both calls)."""
    if fmt == "auto":
        return rows.to(dtype), {"kv_format": "auto"}
    if fmt == "fp8":
        q8, k_scale = quantize_fp8(rows)
        return q8.view(torch.uint8), {"kv_format": "fp8", "k_scale": k_scale}
    assert fmt == "fp8_ds_mla"
    if rows.shape[-1] == L:  # NoPE: the layout still carries 64 rope values (unused)
        rows = torch.cat([rows, torch.zeros_like(rows[..., :R])], dim=-1)
    return pack_fp8_ds_mla(rows, scale_format), {"kv_format": "fp8_ds_mla"}


def poison_(x: torch.Tensor) -> torch.Tensor:
    """Fill with NaN (float) or 0xFF (bytes: NaN in e4m3, in fp32 scales and in bf16 rope)."""
    if x.dtype in (torch.uint8, torch.float8_e4m3fn):
        x.view(torch.uint8).fill_(0xFF)
    else:
        x.fill_(float("nan"))
    return x


def poison_unused_rows_(cache: torch.Tensor, indices: torch.Tensor, **kw) -> int:
    """NaN every cache row (logical flat order) that no valid index reaches. Returns the count."""
    n = cache.shape[0] if cache.dim() == 2 else cache.shape[0] * cache.shape[1]
    keys = ("valid_counts", "block_table", "req_ids", "block_size")
    rows, valid = physical_rows(indices, n, **{k: kw.get(k) for k in keys})
    used = torch.zeros(n, dtype=torch.bool, device=cache.device)
    used[rows[valid]] = True
    unused = (~used).nonzero()[:, 0]
    fill = 0xFF if cache.dtype == torch.uint8 else float("nan")
    if cache.dim() == 2:
        cache[unused] = fill
    else:
        page = cache.shape[1]
        cache[unused // page, unused % page] = fill
    return int(unused.numel())


def interleaved_paged(cache: torch.Tensor, page: int, layers: int = 3, layer: int = 1):
    """[N, C] -> [N/page, page, C] view into a bigger allocation whose other "layers" sit between
    blocks (block stride = layers * page * C) and are NaN/0xFF."""
    nb = cache.shape[0] // page
    big = poison_(torch.empty(nb, layers, page, cache.shape[-1], dtype=cache.dtype, device=DEVICE))
    view = big[:, layer]
    view.copy_(cache.reshape(nb, page, -1))
    assert view.stride(0) > page * cache.shape[-1]
    return view, big


def config_for(
    t,
    h,
    w,
    dtype,
    fmt,
    native,
    splits=None,
    loop=None,
    block_table=False,
    extra_set=False,
    gluon=True,
) -> KernelConfig:
    """The heuristic's configuration, with fp8_native and (optionally) the split count and the
    gather loop (``LOOPS``: indices a step ahead, with two gather buffers) forced.
    ``block_table`` / ``extra_set``: the call has them (the heuristics choose by both);
    ``gluon`` False for a call no Gluon kernel runs (a kv_lora_rank other than 512, a cache
    not 16-byte aligned)."""
    # a forced integer decode or step-ahead loop runs the Triton kernels (the Gluon ones convert
    # e4m3 in hardware and have rings of their own)
    cfg = choose_config(
        t,
        h,
        w,
        dtype,
        fmt,
        arch_of(DEVICE),
        block_table=block_table,
        extra_set=extra_set,
        gluon=gluon and native is not False and not loop,
    )
    cfg = dataclasses.replace(cfg, fp8_native=native)
    if splits is not None:
        cfg = dataclasses.replace(cfg, num_splits=splits)
    if loop and fmt == "fp8_ds_mla":
        # that family has no step-ahead loop: it measured 40% slower (perf-log/06-sweep-ahead-
        # indices.json, 128 x 16: 226 vs 162 us) and sparse_mla refuses it (test_validation)
        pytest.skip("the fp8_ds_mla kernel family has no step-ahead index loop")
    if loop is not None:
        stages = 3 if loop else cfg.num_stages
        cfg = dataclasses.replace(cfg, idx_ahead=loop, num_stages=stages)
    return cfg


def reference(q, cache, indices, **kw):
    dtype = q[0].dtype if isinstance(q, tuple) else q.dtype
    return sparse_mla_reference(
        q, cache, indices, return_lse=True, compute_dtype=reference_dtype(dtype), **kw
    )


def assert_matches(out, lse, ref_out, ref_lse, dtype):
    """q's dtype out, then the shared comparison (testing.compare_sparse_mla): every output
    finite, relative Frobenius error within the dtype's bound; with an LSE: -inf exactly where
    the reference has no valid index, else within bound; empty tokens exactly zero."""
    assert out.dtype == dtype
    assert_sparse_mla_close(out, ref_out, lse=lse, ref_lse=ref_lse)


def run_case(q, cache, indices, dtype, fmt_kw, cfg, *, ref_cache=None, **kw):
    """Reference on the clean cache, then the kernel on the same cache with unused rows poisoned."""
    ref_out, ref_lse = reference(
        q, cache if ref_cache is None else ref_cache, indices, **fmt_kw, **kw
    )
    kernel_cache = cache.clone() if ref_cache is None else cache
    poison_unused_rows_(kernel_cache, indices, **kw)
    out = poison_(torch.empty(ref_out.shape, dtype=dtype, device=DEVICE))  # unwritten -> NaN
    res, lse = sparse_mla(
        q, kernel_cache, indices, return_lse=True, config=cfg, out=out, **fmt_kw, **kw
    )
    assert res is out
    assert_matches(out, lse, ref_out, ref_lse, dtype)
    return out, lse, ref_out, ref_lse


def skip_bad_combo(dtype):
    if dtype == torch.bfloat16 and not HAS_GPU:
        pytest.skip("Triton's interpreter computes bf16 wrongly")


# ----------------------------------------------------------------------------------------------
# shapes


@pytest.mark.parametrize("dtype", DTYPE_PARAMS)
@pytest.mark.parametrize("heads", [1, 3, 8, 16, 64, 128])
@pytest.mark.parametrize("width", [1, 100, size(260, 1152)] + ([2048] if HAS_GPU else []))
def test_heads_and_widths(dtype, heads, width):
    """Head counts 1..128 (one to two head blocks, partial blocks) and widths 1, 100 and a width
    that is not a multiple of the 64-row step, with the configuration the heuristics choose."""
    g = gen(1000 * heads + width)
    t, n = size(2, 48), size(600, 8192)
    q = randn(t, heads, D, g=g, dtype=dtype)
    cache = randn(n, D, g=g, dtype=dtype)
    idx = rand_indices(t, width, n, g)
    cfg = choose_config(t, heads, width, dtype, "auto", arch_of(DEVICE))
    run_case(q, cache, idx, dtype, {"kv_format": "auto"}, cfg)


@pytest.mark.parametrize("dtype", DTYPE_PARAMS)
@pytest.mark.parametrize("fmt", [FORMATS[0], FORMATS[3]])
@pytest.mark.parametrize("heads", [129, 136])
def test_more_than_128_heads(dtype, fmt, heads):
    """Any head count: past 128 the heads run as further head blocks (129 = two full 64-head
    blocks and one partial block of one head), split and single pass."""
    fmt, native = fmt
    g = gen(3 * heads)
    t, n, w = size(1, 8), size(200, 4096), size(70, 2048)
    q = randn(t, heads, D, g=g, dtype=dtype)
    cache, fkw = make_cache(randn(n, D, g=g), fmt, dtype)
    idx = rand_indices(t, w, n, g)
    for splits in (1, 2):
        cfg = config_for(t, heads, w, dtype, fmt, native, splits)
        assert -(-heads // cfg.block_h) >= 3
        run_case(q, cache, idx, dtype, fkw, cfg)


@pytest.mark.parametrize("dtype", DTYPE_PARAMS)
@pytest.mark.parametrize("fmt", FP8_FORMATS)
@pytest.mark.parametrize("heads", [1, 16, 128])
def test_quantized_heads(dtype, fmt, heads):
    """The fp8 formats at one, sixteen and 128 heads; reference on the dequantized cache."""
    fmt, native = fmt
    g = gen(7 * heads)
    t, n, w = size(2, 32), size(400, 8192), size(130, 2048)
    q = randn(t, heads, D, g=g, dtype=dtype)
    cache, fkw = make_cache(randn(n, D, g=g), fmt, dtype)
    idx = rand_indices(t, w, n, g)
    run_case(q, cache, idx, dtype, fkw, config_for(t, heads, w, dtype, fmt, native))


@pytest.mark.parametrize("dtype", DTYPE_PARAMS)
def test_small_rank(dtype):
    """kv_lora_rank other than 512 (128 latent + 32 rope), native and fp8 caches."""
    g = gen(5)
    t, h, n, w, lr, rr = 3, 5, 300, 90, 128, 32
    q = randn(t, h, lr + rr, g=g, dtype=dtype)
    rows = randn(n, lr + rr, g=g)
    idx = rand_indices(t, w, n, g)
    for fmt in ("auto", "fp8"):
        cache, fkw = make_cache(rows, fmt, dtype)
        cfg = config_for(t, h, w, dtype, fmt, None, gluon=False)  # kv_lora_rank 128
        run_case(q, cache, idx, dtype, fkw, cfg, kv_lora_rank=lr)


@pytest.mark.parametrize("dtype", DTYPE_PARAMS)
@pytest.mark.parametrize("lr", [16, 32, 64])
@pytest.mark.parametrize("fmt", ["auto", "fp8"])
def test_narrow_rank_split_writes_only_its_columns(dtype, lr, fmt):
    """kv_lora_rank below the merge's 64-column minimum, split: the merge writes the L output
    columns and nothing past them (it once stored 64 columns whatever L was: out of bounds for
    kv_lora_rank 16 and 32). out is a view into a poisoned wider buffer whose tail must stay
    untouched."""
    skip_bad_combo(dtype)
    g = gen(17 + lr)
    t, h, n, w, rr = 3, 5, 300, 90, 16
    q = randn(t, h, lr + rr, g=g, dtype=dtype)
    cache, fkw = make_cache(randn(n, lr + rr, g=g), fmt, dtype)
    idx = rand_indices(t, w, n, g)
    cfg = dataclasses.replace(config_for(t, h, w, dtype, fmt, None, gluon=False), num_splits=4)
    ref_out, ref_lse = reference(q, cache, idx, kv_lora_rank=lr, **fkw)
    wide = poison_(torch.empty(t, h, lr + 64, dtype=dtype, device=DEVICE))
    out = wide[..., :lr]
    _, lse = sparse_mla(q, cache, idx, return_lse=True, config=cfg, out=out, kv_lora_rank=lr, **fkw)
    assert_matches(out, lse, ref_out, ref_lse, dtype)
    assert torch.isnan(wide[..., lr:]).all(), "the merge wrote past the output's columns"


def test_zero_tokens():
    q = torch.randn(0, 4, D, device=DEVICE)
    out, lse = sparse_mla(
        q,
        torch.randn(10, D, device=DEVICE),
        torch.zeros(0, 8, dtype=torch.int32, device=DEVICE),
        return_lse=True,
    )
    assert out.shape == (0, 4, L) and lse.shape == (0, 4)


# ----------------------------------------------------------------------------------------------
# invalid entries: -1 holes, out-of-range indices, empty tokens


def holes_indices(w: int, n: int, front: int, g: torch.Generator) -> torch.Tensor:
    """Six tokens, one pattern each: front hole, middle hole, end hole, out-of-range (>= N and
    negative other than -1), no valid entry at all, and everything mixed."""
    idx = rand_indices(6, w, n, g).cpu()
    idx[0, :front] = -1
    idx[1, w // 4 : w // 4 + w // 2] = -1
    idx[2, w - w // 3 :] = -1
    bad = torch.tensor([n, n + 1, I32_MAX, -2, -(2**31), 10 * n], dtype=torch.int32)
    pos = torch.randperm(w, generator=g)[: w // 2]
    idx[3, pos] = bad[torch.randint(0, len(bad), (len(pos),), generator=g)]
    idx[4] = -1
    idx[4, ::3] = n + 5  # out of range too: still nothing valid
    idx[5, : front // 2] = -1
    idx[5, w // 2 : w // 2 + 7] = I32_MAX
    idx[5, -3:] = -1
    return idx.to(DEVICE)


@pytest.mark.parametrize("dtype", DTYPE_PARAMS)
@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("splits", SPLITS)
@pytest.mark.parametrize("loop", LOOPS)
def test_holes_and_out_of_range(dtype, fmt, splits, loop):
    """-1 runs at the front longer than one gather step and than one whole split, in the middle,
    at the end; indices >= N and < -1; a token with no valid index (zeros, LSE -inf)."""
    fmt, native = fmt
    g = gen(11 + splits)
    h, n, w = 3, size(500, 8192), size(200, 2048)
    cfg = config_for(6, h, w, dtype, fmt, native, splits, loop)
    split_len, num_splits = split_len_for(w, cfg.num_splits, cfg.block_n)
    front = int(w * 0.55)
    assert front > 64 and front > cfg.block_n and (num_splits == 1 or front > split_len)
    q = randn(6, h, D, g=g, dtype=dtype)
    cache, fkw = make_cache(randn(n, D, g=g), fmt, dtype)
    idx = holes_indices(w, n, front, g)
    out, lse, _, _ = run_case(q, cache, idx, dtype, fkw, cfg)
    assert torch.isneginf(lse[4]).all() and (out[4] == 0).all()
    assert torch.isfinite(lse[[0, 1, 2, 3, 5]]).all()


@pytest.mark.parametrize("dtype", DTYPE_PARAMS)
@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("splits", SPLITS)
@pytest.mark.parametrize("loop", LOOPS)
def test_valid_counts(dtype, fmt, splits, loop):
    """Only indices[t, :valid_counts[t]] count. Past the count: -1, huge and negative values and
    in-range rows that are NaN. Counts of 0, negative, exactly W, past W and huge."""
    fmt, native = fmt
    g = gen(23 + splits)
    t, h, n, w = 6, 3, size(500, 8192), size(200, 2048)
    q = randn(t, h, D, g=g, dtype=dtype)
    cache, fkw = make_cache(randn(n, D, g=g), fmt, dtype)
    idx = rand_indices(t, w, n, g).cpu()
    counts = torch.tensor([0, -7, w, I32_MAX, w // 3 + 5, 1], dtype=torch.int32)
    for i in range(t):
        c = max(0, min(int(counts[i]), w))
        tail = idx[i, c:]
        garbage = torch.tensor([-1, I32_MAX, -(2**31), n, 3 * n], dtype=torch.int32)
        tail[::2] = garbage[torch.randint(0, len(garbage), tail[::2].shape, generator=g)]
        # the other half of the tail keeps in-range rows; unused by anyone, they become NaN
    idx[4, 10] = -1  # a hole inside the counted part
    idx, counts = idx.to(DEVICE), counts.to(DEVICE)
    cfg = config_for(t, h, w, dtype, fmt, native, splits, loop)
    out, lse, _, _ = run_case(q, cache, idx, dtype, fkw, cfg, valid_counts=counts)
    assert torch.isneginf(lse[:2]).all() and (out[:2] == 0).all()


@pytest.mark.parametrize("dtype", DTYPE_PARAMS)
@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("splits", SPLITS)
def test_block_table(dtype, fmt, splits):
    """Request-local positions through block_table/req_ids/block_size, on a paged cache whose
    block stride exceeds page * C (other layers in between, NaN). Positions past the table,
    -1 table entries, table entries past the cache, several requests, valid_counts on top.
    One gather loop only: with a block table the kernel loads each step's indices in the step
    (test_block_table_never_loads_ahead)."""
    fmt, native = fmt
    g = gen(31 + splits)
    page, nb, reqs = 64, size(12, 160), 3
    t, h, w = 5, 3, size(200, 2048)
    max_blocks = size(6, 48)  # positions in [0, max_blocks * page) are inside the table
    rows = randn(nb * page, D, g=g)
    cache, fkw = make_cache(rows, fmt, dtype)
    paged, _big = interleaved_paged(cache, page)
    table = torch.stack([torch.randperm(nb, generator=g)[:max_blocks] for _ in range(reqs)])
    table = table.to(torch.int32)
    table[0, 1] = -1  # unmapped block
    table[1, 2] = nb + 3  # block past the cache
    table[2, -1] = -1
    req_ids = torch.tensor([0, 2, 1, 1, 0], dtype=torch.int32)
    span = max_blocks * page
    idx = torch.stack([torch.randperm(span, generator=g)[:w] for _ in range(t)]).to(torch.int32)
    idx[0, :5] = span + torch.arange(5, dtype=torch.int32)  # past the table
    idx[1, -4:] = I32_MAX
    idx[2, 7:70] = -1
    counts = torch.tensor([w, w - 9, w, w // 2, 0], dtype=torch.int32)
    bt_kw = dict(
        block_table=table.to(DEVICE),
        req_ids=req_ids.to(DEVICE),
        block_size=page,
        valid_counts=counts.to(DEVICE),
    )
    idx = idx.to(DEVICE)
    cfg = config_for(t, h, w, dtype, fmt, native, splits, block_table=True)
    assert not cfg.idx_ahead
    ref_cache = paged.clone()  # contiguous copy, no poison: what the reference sees
    q = randn(t, h, D, g=g, dtype=dtype)
    run_case(q, paged, idx, dtype, fkw, cfg, ref_cache=ref_cache, **bt_kw)


@pytest.mark.parametrize("dtype", DTYPE_PARAMS)
@pytest.mark.parametrize(
    "page,bs", [(64, 16), (48, 80), (1, 64)], ids=["p64b16", "p48b80", "p1b64"]
)
def test_block_table_block_size_differs_from_page(dtype, page, bs):
    """block_size (the table's) need not equal the cache's page: rows are in logical flat order.
    Pages and table blocks that are not powers of two take the general division path."""
    g = gen(37 + page)
    t, h, w, n = 3, 2, 90, 960
    q = randn(t, h, D, g=g, dtype=dtype)
    cache = randn(n // page, page, D, g=g, dtype=dtype)
    table = torch.randperm(n // bs, generator=g)[:8].view(2, 4).to(torch.int32).to(DEVICE)
    idx = torch.stack([torch.randperm(4 * bs + 20, generator=g)[:w] for _ in range(t)])
    idx = idx.to(torch.int32).to(DEVICE)
    kw = dict(block_table=table, req_ids=torch.tensor([1, 0, 1], dtype=torch.int32, device=DEVICE))
    cfg = config_for(t, h, w, dtype, "auto", None, block_table=True)
    run_case(q, cache, idx, dtype, {"kv_format": "auto"}, cfg, block_size=bs, **kw)


def test_block_table_never_loads_ahead():
    """choose_config(block_table=True) keeps every tile of the plain choice but never the
    step-ahead loop (which a block-table launch cannot run), over the decode and prefill shapes
    where the plain choice does load ahead; sparse_mla refuses a config asking for both."""
    arch = arch_of(DEVICE)
    ahead = 0
    for t in (1, 4, 16, 64, 128, 512):
        for h in (8, 16, 32, 64, 128):
            for w in (256, 2048):
                for fmt in ("auto", "fp8", "fp8_ds_mla"):
                    plain = choose_config(t, h, w, torch.float16, fmt, arch)
                    bt = choose_config(t, h, w, torch.float16, fmt, arch, block_table=True)
                    ahead += plain.idx_ahead
                    assert bt == dataclasses.replace(plain, idx_ahead=False)
    assert ahead > 0  # the plain heuristic does choose it somewhere (else this proves nothing)


@pytest.mark.parametrize("dtype", DTYPE_PARAMS)
@pytest.mark.parametrize("native", [True, False], ids=["native", "intdecode"])
@pytest.mark.parametrize("staged", [True, False], ids=["staged", "hoisted"])
def test_ds_mla_staging_variants(dtype, native, staged):
    """Both fp8_ds_mla forms (KernelConfig.stage_dequant: e4m3 tiles staged through shared memory
    as fp16, or converted in each dot's operand load) with holes, counts, a paged cache and
    arbitrary fp32 scales."""
    g = gen(39)
    t, h, nb, w = 3, 5, 8, 150
    cache, fkw = make_cache(randn(nb * 64, D, g=g), "fp8_ds_mla", dtype, "fp32")
    paged, _big = interleaved_paged(cache, 64)
    q = randn(t, h, D, g=g, dtype=dtype)
    idx = rand_indices(t, w, nb * 64, g)
    idx[0, :70] = -1
    counts = torch.tensor([w, 100, 0], dtype=torch.int32, device=DEVICE)
    cfg = config_for(t, h, w, dtype, "fp8_ds_mla", native, 2)
    cfg = dataclasses.replace(cfg, stage_dequant=staged)
    run_case(q, paged, idx, dtype, fkw, cfg, ref_cache=paged.clone(), valid_counts=counts)


NVIDIA_GPU = HAS_GPU and torch.version.hip is None


@pytest.mark.skipif(not NVIDIA_GPU, reason="the packed e4m3 decode is inline PTX: NVIDIA GPUs only")
@pytest.mark.parametrize("dtype", DTYPE_PARAMS)
@pytest.mark.parametrize(
    "fmt, decode, staged",
    [
        ("fp8", "packed", False),
        ("fp8_ds_mla", "packed", True),
        ("fp8_ds_mla", "packed", False),
        ("fp8_ds_mla", "packed-nomask", True),
    ],
)
def test_packed_e4m3_decode(dtype, fmt, decode, staged):
    """KernelConfig.e4m3_decode's packed forms (inline PTX, four e4m3 bytes a call) on this GPU
    with the integer decode forced: the lane order Triton packs the bytes in is only seen here
    (tests/test_e4m3_decode.py checks the PTX's arithmetic on CPU)."""
    g = gen(41)
    t, h, nb, w = 3, 16, 8, 150
    cache, fkw = make_cache(randn(nb * 64, D, g=g), fmt, dtype, "fp32")
    paged = cache.view(nb, 64, cache.shape[-1])
    q = randn(t, h, D, g=g, dtype=dtype)
    idx = rand_indices(t, w, nb * 64, g)
    idx[0, :70] = -1
    cfg = config_for(t, h, w, dtype, fmt, False, 2)
    cfg = dataclasses.replace(cfg, e4m3_decode=decode)
    if fmt == "fp8_ds_mla":
        cfg = dataclasses.replace(cfg, stage_dequant=staged)
    run_case(q, paged, idx, dtype, fkw, cfg)


# ----------------------------------------------------------------------------------------------
# cache layouts and strided q / out


@pytest.mark.parametrize("dtype", DTYPE_PARAMS)
@pytest.mark.parametrize("fmt", FORMATS)
def test_paged_interleaved_cache(dtype, fmt):
    """Paged [num_blocks, 64, C] slice of a bigger allocation (block stride > 64 * C), the memory
    between blocks NaN, global indices in logical flat order."""
    fmt, native = fmt
    g = gen(41)
    t, h, nb, w = 3, 16, size(10, 128), size(150, 2048)
    cache, fkw = make_cache(randn(nb * 64, D, g=g), fmt, dtype)
    paged, big = interleaved_paged(cache, 64)
    before = big[:, [0, 2]].clone()
    q = randn(t, h, D, g=g, dtype=dtype)
    idx = rand_indices(t, w, nb * 64, g)
    cfg = config_for(t, h, w, dtype, fmt, native)
    run_case(q, paged, idx, dtype, fkw, cfg, ref_cache=paged.clone())
    assert torch.equal(big[:, [0, 2]].view(torch.uint8), before.view(torch.uint8))  # read only


@pytest.mark.parametrize("dtype", DTYPE_PARAMS)
def test_strided_flat_cache(dtype):
    """kv_format="auto" accepts any strides: a row stride > C (NaN between rows) and a
    transposed (column-major) cache."""
    g = gen(43)
    t, h, n, w = 2, 4, 400, 120
    q = randn(t, h, D, g=g, dtype=dtype)
    clean = randn(n, D, g=g, dtype=dtype)
    idx = rand_indices(t, w, n, g)
    cfg = config_for(t, h, w, dtype, "auto", None, gluon=False)  # rows not 16-byte aligned
    wide = poison_(torch.empty(n, D + 200, dtype=dtype, device=DEVICE))
    wide[:, 100 : 100 + D] = clean
    run_case(q, wide[:, 100 : 100 + D], idx, dtype, {"kv_format": "auto"}, cfg, ref_cache=clean)
    col = torch.empty(D, n, dtype=dtype, device=DEVICE).t()
    col.copy_(clean)
    assert col.stride() == (1, n)
    run_case(q, col, idx, dtype, {"kv_format": "auto"}, cfg, ref_cache=clean)


@pytest.mark.parametrize("dtype", DTYPE_PARAMS)
@pytest.mark.parametrize("fmt", [FORMATS[0], FORMATS[3]])
def test_q_tuple_and_strided_views(dtype, fmt):
    """q as (q_latent, q_rope), both non-contiguous (transposed heads, strided last dim); the
    same values as one non-contiguous tensor; out= a view into a bigger NaN tensor with
    transposed heads. Elements outside the view stay untouched."""
    fmt, native = fmt
    g = gen(47)
    t, h, n, w = 3, 5, 400, 110
    q_full = randn(t, h, D, g=g, dtype=dtype)
    cache, fkw = make_cache(randn(n, D, g=g), fmt, dtype)
    idx = rand_indices(t, w, n, g)
    cfg = config_for(t, h, w, dtype, fmt, native)
    ref_out, ref_lse = reference(q_full, cache, idx, **fkw)
    # latent: heads-major storage viewed as [T, H, L]; rope: every other element of a wider buffer
    q_lat = torch.empty(h, t, L, dtype=dtype, device=DEVICE).transpose(0, 1)
    q_lat.copy_(q_full[..., :L])
    q_rope = torch.empty(t, h, 2 * R, dtype=dtype, device=DEVICE)[..., ::2]
    q_rope.copy_(q_full[..., L:])
    assert not q_lat.is_contiguous() and q_rope.stride(-1) == 2
    big = poison_(torch.empty(h + 3, t + 1, L + 40, dtype=dtype, device=DEVICE))
    out_view = big[1 : h + 1, :t, 17 : 17 + L].transpose(0, 1)
    res, lse = sparse_mla(
        (q_lat, q_rope), cache, idx, out=out_view, return_lse=True, config=cfg, **fkw
    )
    assert res.data_ptr() == out_view.data_ptr()
    assert_matches(out_view, lse, ref_out, ref_lse, dtype)
    outside = torch.ones(big.shape, dtype=torch.bool, device=DEVICE)
    outside[1 : h + 1, :t, 17 : 17 + L] = False
    assert torch.isnan(big[outside]).all(), "sparse_mla wrote outside the out= view"
    # one non-contiguous q tensor: a slice of a wider buffer, heads transposed
    q_nc = torch.empty(h, t, D + 8, dtype=dtype, device=DEVICE)[..., 4 : 4 + D].transpose(0, 1)
    q_nc.copy_(q_full)
    out2, lse2 = sparse_mla(q_nc, cache, idx, return_lse=True, config=cfg, **fkw)
    assert torch.equal(out2, out_view) and torch.equal(lse2, lse)


@pytest.mark.parametrize("dtype", DTYPE_PARAMS)
def test_out_in_place_contiguous(dtype):
    """out= a plain contiguous tensor poisoned with NaN: returned as is, fully written."""
    g = gen(53)
    t, h, n, w = 2, 16, 300, 70
    q = randn(t, h, D, g=g, dtype=dtype)
    cache = randn(n, D, g=g, dtype=dtype)
    idx = rand_indices(t, w, n, g)
    for splits in (1, 3):
        out = poison_(torch.empty(t, h, L, dtype=dtype, device=DEVICE))
        cfg = config_for(t, h, w, dtype, "auto", None, splits)
        res = sparse_mla(q, cache, idx, out=out, config=cfg)
        assert res is out
        ref_out, _ = reference(q, cache, idx)
        assert_matches(out, None, ref_out, None, dtype)


@pytest.mark.parametrize("dtype", DTYPE_PARAMS)
@pytest.mark.parametrize("fmt", FORMATS)
def test_nope(dtype, fmt):
    """NoPE models: q width 512, cache width 512 (656 bytes for fp8_ds_mla, rope unused); q as
    one tensor and as a tuple with an empty rope part."""
    fmt, native = fmt
    g = gen(59)
    t, h, n, w = 3, 8, size(400, 4096), size(120, 2048)
    q = randn(t, h, L, g=g, dtype=dtype)
    cache, fkw = make_cache(randn(n, L, g=g), fmt, dtype)
    idx = rand_indices(t, w, n, g)
    cfg = config_for(t, h, w, dtype, fmt, native)
    out, lse, ref_out, ref_lse = run_case(q, cache, idx, dtype, fkw, cfg)
    out2, lse2 = sparse_mla((q, q[..., :0]), cache, idx, return_lse=True, config=cfg, **fkw)
    assert torch.equal(out2, out) and torch.equal(lse2, lse)


# ----------------------------------------------------------------------------------------------
# LSE, split-K, determinism, duplicates


@pytest.mark.parametrize("dtype", DTYPE_PARAMS)
@pytest.mark.parametrize("splits", SPLITS)
def test_lse_is_natural_log_logsumexp(dtype, splits):
    """LSE against torch.logsumexp of float64 logits computed here (not through the reference),
    with an explicit softmax_scale."""
    g = gen(61)
    t, h, n, w = 3, 6, size(300, 4096), size(150, 2048)
    q = randn(t, h, D, g=g, dtype=dtype, scale=2.0)
    cache = randn(n, D, g=g, dtype=dtype)
    idx = rand_indices(t, w, n, g)
    idx[1, 40:] = -1
    scale = 0.083
    cfg = config_for(t, h, w, dtype, "auto", None, splits)
    _, lse = sparse_mla(q, cache, idx, scale, return_lse=True, config=cfg)
    expect = []
    for i in range(t):
        sel = idx[i][idx[i] >= 0].long()
        logits = torch.einsum("hd,wd->hw", q[i].double(), cache[sel].double()) * scale
        expect.append(torch.logsumexp(logits, dim=-1))
    expect = torch.stack(expect)
    assert lse.dtype == torch.float32 and lse.shape == (t, h)
    assert lse_error(lse, expect, dtype) <= sparse_mla_tolerance(dtype).lse_atol


@pytest.mark.parametrize("dtype", DTYPE_PARAMS)
@pytest.mark.parametrize("fmt", [FORMATS[0], FORMATS[1]])
@pytest.mark.parametrize("splits", SPLITS)
@pytest.mark.parametrize("loop", LOOPS)
def test_running_max_jumps(dtype, fmt, splits, loop):
    """Logits that climb along the top-k list in jumps of 5 and 7 (natural log) with jitter of
    up to 3 inside a step, over a range of hundreds: the online softmax's running max moves by
    large amounts many times (token 0 climbs), never after the first step (token 1 descends), or
    at random (token 2 is shuffled); against the reference."""
    fmt, native = fmt
    g = gen(97 + splits)
    t, h, w = 3, 16, size(320, 2048)
    n = w + 64
    v = torch.randn(D, generator=g)
    v = v / v.norm()
    steps = torch.arange(n) // 40
    ramp = steps * 6.0 + (steps % 2) * 1.0 + torch.rand(n, generator=g) * 3.0  # 5, 7, 5, ...
    ramp -= ramp.max()  # the largest logits near 0: the LSE stays O(1), testable in fp32
    rows = ramp[:, None] * v[None, :] + 0.02 * torch.randn(n, D, generator=g)
    cache, fkw = make_cache(rows.to(DEVICE), fmt, dtype)
    per_head = 1.0 + 0.02 * torch.arange(h)
    q = v[None, None, :] * per_head[None, :, None] + 0.01 * torch.randn(t, h, D, generator=g)
    q = q.to(dtype=dtype, device=DEVICE)
    order = torch.arange(w)
    idx = torch.stack([order, order.flip(0), order[torch.randperm(w, generator=g)]])
    idx = idx.to(torch.int32).to(DEVICE)
    cfg = config_for(t, h, w, dtype, fmt, native, splits, loop)
    run_case(q, cache, idx, dtype, fkw, cfg, softmax_scale=1.0)


def merge(o1, l1, o2, l2):
    """Combine two partial attentions over disjoint index sets with their natural-log LSEs."""
    m = torch.maximum(l1, l2)
    m = torch.where(torch.isfinite(m), m, torch.zeros_like(m))
    w1, w2 = torch.exp(l1 - m), torch.exp(l2 - m)
    den = w1 + w2
    out = (o1.double() * w1[..., None] + o2.double() * w2[..., None]) / den.clamp_min(1e-300)[
        ..., None
    ]
    return out, torch.logaddexp(l1, l2)


@pytest.mark.parametrize("dtype", DTYPE_PARAMS)
@pytest.mark.parametrize("fmt", [FORMATS[0], FORMATS[3]])
def test_split_then_merge_round_trip(dtype, fmt):
    """Two half-width calls merged through their LSEs equal one full-width call (the context-
    parallel contract; breaks if the LSE base is not e). One token has an empty first half."""
    fmt, native = fmt
    g = gen(67)
    t, h, n, w = 3, 4, size(400, 4096), size(200, 2048)
    q = randn(t, h, D, g=g, dtype=dtype, scale=2.0)
    cache, fkw = make_cache(randn(n, D, g=g), fmt, dtype)
    idx = rand_indices(t, w, n, g)
    idx[2, : w // 2] = -1
    cfg = config_for(t, h, w, dtype, fmt, native)
    full_o, full_l = sparse_mla(q, cache, idx, return_lse=True, config=cfg, **fkw)
    o1, l1 = sparse_mla(q, cache, idx[:, : w // 2].contiguous(), return_lse=True, config=cfg, **fkw)
    o2, l2 = sparse_mla(q, cache, idx[:, w // 2 :], return_lse=True, config=cfg, **fkw)
    assert torch.isneginf(l1[2]).all()
    mo, ml = merge(o1, l1.double(), o2, l2.double())
    assert_matches(full_o, full_l, mo, ml, dtype)


@pytest.mark.parametrize("fmt", [FORMATS[0], FORMATS[3], FORMATS[4]])
def test_split_k_matches_single_pass_fp32(fmt):
    """fp32: split-K (2, 3, 5, 8 splits) and single pass agree to 3e-5 relative, LSE to 1e-5."""
    fmt, native = fmt
    g = gen(71)
    t, h, n, w = 2, 16, size(500, 4096), size(300, 2048)
    q = randn(t, h, D, g=g, scale=2.0)
    cache, fkw = make_cache(randn(n, D, g=g), fmt, torch.float32)
    idx = rand_indices(t, w, n, g)
    idx[0, :100] = -1
    base = config_for(t, h, w, torch.float32, fmt, native, 1)
    o1, l1 = sparse_mla(q, cache, idx, return_lse=True, config=base, **fkw)
    for s in (2, 3, 5, 8):
        assert split_len_for(w, s, base.block_n)[1] > 1
        cfg = dataclasses.replace(base, num_splits=s)
        o2, l2 = sparse_mla(q, cache, idx, return_lse=True, config=cfg, **fkw)
        err = ((o2.double() - o1.double()).norm() / o1.double().norm()).item()
        assert err <= 3e-5, f"{s} splits vs single pass: {err:.3g}"
        assert (l2 - l1).abs().max() <= 1e-5


@pytest.mark.parametrize("dtype", DTYPE_PARAMS)
@pytest.mark.parametrize("fmt", [FORMATS[0], FORMATS[3]])
@pytest.mark.parametrize("splits", SPLITS)
def test_deterministic(dtype, fmt, splits):
    """The same inputs twice give the same bits (output and LSE), split or not."""
    fmt, native = fmt
    g = gen(73)
    t, h, n, w = 2, 16, size(400, 4096), size(200, 2048)
    q = randn(t, h, D, g=g, dtype=dtype)
    cache, fkw = make_cache(randn(n, D, g=g), fmt, dtype)
    idx = rand_indices(t, w, n, g)
    cfg = config_for(t, h, w, dtype, fmt, native, splits)
    a = sparse_mla(q, cache, idx, return_lse=True, config=cfg, **fkw)
    b = sparse_mla(q, cache, idx, return_lse=True, config=cfg, **fkw)
    assert torch.equal(a[0], b[0]) and torch.equal(a[1], b[1])


@pytest.mark.parametrize("dtype", DTYPE_PARAMS)
@pytest.mark.parametrize("fmt", [FORMATS[0], FORMATS[4]])
def test_duplicate_indices_count_twice(dtype, fmt):
    """A duplicated index counts as often as it appears: listing every index twice leaves the
    output unchanged and adds log 2 to the LSE; partial duplicates match the reference."""
    fmt, native = fmt
    g = gen(79)
    t, h, n, w = 2, 4, 300, 60
    q = randn(t, h, D, g=g, dtype=dtype, scale=2.0)
    cache, fkw = make_cache(randn(n, D, g=g), fmt, dtype)
    idx = rand_indices(t, w, n, g)
    cfg = config_for(t, h, 2 * w, dtype, fmt, native, 1)
    o1, l1 = sparse_mla(q, cache, idx, return_lse=True, config=cfg, **fkw)
    o2, l2 = sparse_mla(
        q, cache, torch.cat([idx, idx.flip(1)], 1), return_lse=True, config=cfg, **fkw
    )
    assert_matches(o2, l2, o1, l1 + math.log(2), dtype)
    dup = idx.clone()
    dup[:, 1::2] = dup[:, :1]  # row idx[t, 0] thirty-one times: it must dominate accordingly
    ref_o, ref_l = reference(q, cache, dup, **fkw)
    o3, l3 = sparse_mla(q, cache, dup, return_lse=True, config=cfg, **fkw)
    assert_matches(o3, l3, ref_o, ref_l, dtype)
    uniq_o, _ = reference(q, cache, dup[:, ::2].contiguous(), **fkw)
    assert (ref_o.double() - uniq_o.double()).norm() > 10 * sparse_mla_tolerance(
        dtype
    ).out_rtol * ref_o.double().norm()


# ----------------------------------------------------------------------------------------------
# fp8 specifics


@pytest.mark.parametrize("native", [True, False], ids=["native", "intdecode"])
@pytest.mark.parametrize("storage", [torch.uint8, torch.float8_e4m3fn], ids=["u8", "f8"])
def test_fp8_every_e4m3_code(native, storage):
    """Every finite e4m3 byte (normals, subnormals, both zeros, +-448) decodes exactly: fp32 q,
    a cache whose rows hold all 254 codes, against the reference at 1e-5."""
    g = gen(83)
    codes = torch.tensor([c for c in range(256) if c not in (0x7F, 0xFF)], dtype=torch.uint8)
    n, t, h, w = 64, 2, 3, 64
    perms = [codes[torch.randperm(len(codes), generator=g)] for _ in range(3 * n)]
    rows = torch.cat(perms).view(n, -1)[:, :D].contiguous()  # each row holds every code
    cache = rows.view(torch.float8_e4m3fn) if storage == torch.float8_e4m3fn else rows
    cache = cache.to(DEVICE)
    q = randn(t, h, D, g=g, scale=0.05)
    idx = rand_indices(t, w, n, g)
    cfg = config_for(t, h, w, torch.float32, "fp8", native, 1)
    run_case(q, cache, idx, torch.float32, {"kv_format": "fp8", "k_scale": 0.75}, cfg)


@pytest.mark.parametrize("dtype", DTYPE_PARAMS)
@pytest.mark.parametrize("native", [True, False], ids=["native", "intdecode"])
@pytest.mark.parametrize("scale_format", ["pow2", "fp32"])
def test_ds_mla_group_magnitudes(dtype, native, scale_format):
    """The four 128-value groups of one row differ 100x in magnitude (and so do rows): each
    group's scale is applied to its own values. Both writers' scale rules."""
    g = gen(89)
    t, h, n, w = 2, 4, 256, 100
    rows = torch.randn(n, D, generator=g)
    group_mag = torch.tensor([1.0, 100.0, 0.01, 10.0])
    rows[:, :L] *= group_mag.repeat_interleave(128)[None, :]
    rows *= torch.logspace(-1, 1, n)[torch.randperm(n, generator=g)][:, None]
    cache = pack_fp8_ds_mla(rows.to(DEVICE), scale_format)
    q = randn(t, h, D, g=g, dtype=dtype, scale=0.002)  # logits O(1)
    idx = rand_indices(t, w, n, g)
    cfg = config_for(t, h, w, dtype, "fp8_ds_mla", native)
    run_case(q, cache, idx, dtype, {"kv_format": "fp8_ds_mla"}, cfg)


@pytest.mark.parametrize("dtype", DTYPE_PARAMS)
@pytest.mark.parametrize("native", [True, False], ids=["native", "intdecode"])
@pytest.mark.parametrize("splits", SPLITS)
def test_ds_mla_zero_rows_zero_scales(dtype, native, splits):
    """All-zero rows packed with scale_format="fp32" carry scale 0: they decode to zeros (logit 0),
    never NaN. A token attending only to zero rows gets exactly zero output, LSE log(count)."""
    g = gen(97)
    t, h, n, w = 3, 4, 200, 80
    rows = torch.randn(n, D, generator=g)
    rows[: n // 2] = 0
    cache = pack_fp8_ds_mla(rows.to(DEVICE), "fp32")
    assert (cache[: n // 2, 512:528] == 0).all()  # zero scales really stored
    q = randn(t, h, D, g=g, dtype=dtype)
    idx = rand_indices(t, w, n, g)
    idx[0] = torch.randperm(n // 2, generator=g)[:w].to(torch.int32)  # zero rows only
    cfg = config_for(t, h, w, dtype, "fp8_ds_mla", native, splits)
    out, lse, _, _ = run_case(q, cache, idx, dtype, {"kv_format": "fp8_ds_mla"}, cfg)
    assert (out[0] == 0).all()
    assert (lse[0] - math.log(w)).abs().max() <= 1e-5


@pytest.mark.parametrize("dtype", DTYPE_PARAMS)
@pytest.mark.parametrize("native", [True, False], ids=["native", "intdecode"])
@pytest.mark.parametrize("kind", ["float", "tensor1", "tensor0d"])
def test_fp8_k_scale_kinds(dtype, native, kind):
    """k_scale as a Python float, a 1-element and a 0-d float32 tensor (CUDA-graph friendly):
    identical results, matching the reference; a different scale changes the result."""
    g = gen(101)
    t, h, n, w = 2, 4, 300, 90
    rows = randn(n, D, g=g, scale=3.0)
    q8, ks = quantize_fp8(rows)
    assert not math.isclose(ks, 1.0, rel_tol=0.1)
    k_scale = {
        "float": ks,
        "tensor1": torch.tensor([ks], dtype=torch.float32, device=DEVICE),
        "tensor0d": torch.tensor(ks, dtype=torch.float32, device=DEVICE),
    }[kind]
    q = randn(t, h, D, g=g, dtype=dtype, scale=0.3)
    idx = rand_indices(t, w, n, g)
    cfg = config_for(t, h, w, dtype, "fp8", native)
    ref_o, ref_l = reference(q, q8, idx, kv_format="fp8", k_scale=ks)
    out, lse = sparse_mla(q, q8, idx, return_lse=True, config=cfg, kv_format="fp8", k_scale=k_scale)
    assert_matches(out, lse, ref_o, ref_l, dtype)
    out1 = sparse_mla(q, q8, idx, config=cfg, kv_format="fp8", k_scale=1.0)
    assert (out1.double() - out.double()).norm() > 0.1 * out.double().norm()


# ----------------------------------------------------------------------------------------------
# 64-bit addressing (GPU only: needs a cache past 2^31 elements)


@pytest.mark.skipif(not HAS_GPU, reason="needs a >2^31-element cache on a GPU")
@pytest.mark.parametrize("fmt", ["auto", "fp8_ds_mla"])
def test_row_offsets_past_2_31(fmt):
    """Rows whose element offset exceeds 2^31 are read, not dropped or wrapped (32-bit offset
    bugs in earlier kernels). The reference runs on the tail slice with shifted indices."""
    dtype = torch.bfloat16
    g = gen(103)
    row_elems = D if fmt == "auto" else 656
    n = 2**31 // row_elems + 20000
    tail = 30000
    t, h, w = 4, 16, 512
    if fmt == "auto":
        cache = torch.empty(n, D, dtype=dtype, device=DEVICE)
        cache[-tail:] = randn(tail, D, g=g, dtype=dtype)
    else:
        cache = torch.empty(n, 656, dtype=torch.uint8, device=DEVICE)
        cache[-tail:] = pack_fp8_ds_mla(randn(tail, D, g=g))
    cache[:-tail].view(torch.uint8).fill_(0xFF)
    assert (n - tail // 2) * row_elems > 2**31
    local = rand_indices(t, w, tail, g)
    idx = (local + (n - tail)).to(torch.int32)
    q = randn(t, h, D, g=g, dtype=dtype)
    ref_o, ref_l = reference(q, cache[-tail:], local, kv_format=fmt)
    out, lse = sparse_mla(q, cache, idx, return_lse=True, kv_format=fmt)
    assert_matches(out, lse, ref_o, ref_l, dtype)


# ----------------------------------------------------------------------------------------------
# attention sink


def sinks(h: int, g: torch.Generator) -> torch.Tensor:
    """float32 [h]: random sinks around the logits' scale, and (h >= 3) -inf and +inf heads."""
    s = torch.randn(h, generator=g) * 2.0
    if h >= 3:
        s[1], s[2] = float("-inf"), float("inf")
    return s.to(DEVICE)


@pytest.mark.parametrize("dtype", DTYPE_PARAMS)
@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("splits", SPLITS)
@pytest.mark.parametrize("heads", [5, 64])
def test_attention_sink(dtype, fmt, splits, heads):
    """attn_sink adds e^{sink_h} to each head's denominator: random sinks, a -inf head (no
    effect) and a +inf head (zero output), tokens with holes and an empty token (zeros), single
    pass and split-K (the merge adds the sink once). The LSE does not include the sink."""
    fmt, native = fmt
    g = gen(71 + heads + splits)
    t, n, w = 5, size(300, 4096), size(150, 2048)
    q = randn(t, heads, D, g=g, dtype=dtype)
    cache, fkw = make_cache(randn(n, D, g=g), fmt, dtype)
    idx = holes_indices(w, n, 7, g)[:t]  # front, middle, end holes, out of range, none valid
    counts = torch.tensor([w, w, 0, w // 2, 1], dtype=torch.int32, device=DEVICE)
    sink = sinks(heads, g)
    cfg = config_for(t, heads, w, dtype, fmt, native, splits)
    kw = dict(valid_counts=counts, attn_sink=sink)
    out, lse, ref_out, ref_lse = run_case(q, cache, idx, dtype, fkw, cfg, **kw)
    assert (out[:, 2] == 0).all(), "a +inf sink takes all the weight"
    for empty in (2, 4):  # count 0; no valid index
        assert (out[empty] == 0).all() and torch.isneginf(lse[empty]).all()
    # the sink changes the output, not the LSE: the same call without it has the same LSE; and
    # a -inf sink is no sink
    plain, lse_plain = sparse_mla(
        q, cache, idx, return_lse=True, config=cfg, valid_counts=counts, **fkw
    )
    torch.testing.assert_close(lse, lse_plain, rtol=1e-6, atol=1e-6)
    tol = sparse_mla_tolerance(dtype).out_rtol
    torch.testing.assert_close(out[:, 1].float(), plain[:, 1].float(), rtol=tol, atol=tol)


def test_attention_sink_equals_an_extra_row():
    """A sink equals one more key whose logit is the sink and whose value row is zero: checked
    against the reference computed that way, independent of the sink code path."""
    dtype = torch.float32
    g = gen(5)
    t, h, n, w = 3, 4, 64, 16
    q = randn(t, h, D, g=g, dtype=dtype)
    rows = randn(n, D, g=g)
    idx = rand_indices(t, w, n, g)
    sink = torch.randn(h, generator=g).to(DEVICE)
    out = sparse_mla(q, rows, idx, 0.05, attn_sink=sink)
    # per head: an extra row k* with 0.05 * q . k* = sink_h needs its own key per head, so
    # compute the extended softmax directly in float64
    qd, kd = q.double(), rows.double()
    s = torch.einsum("thd,twd->thw", qd, kd[idx.long()]) * 0.05
    s = torch.cat([s, sink.double()[None, :, None].expand(t, h, 1)], dim=-1)
    p = torch.softmax(s, dim=-1)[..., :-1]
    want = torch.einsum("thw,twd->thd", p, kd[idx.long()][..., :L])
    torch.testing.assert_close(out.double(), want, rtol=1e-5, atol=1e-6)
