"""Contracts the README promises that the kernel tests do not show on their own.

- ``sparse_mla`` and ``sparse_mla_reference`` take the same arguments.
- The reference is valid on any cache (NaN in every row no index selects).
- Block-table entries whose rows ``phys * block_size`` would wrap int32 are skipped, never wrapped.
- Non-unit strides of indices, valid_counts, req_ids and block tables.
- 64-bit addressing: a paged cache past 2^31 bytes (CPU where memory allows, and GPU), a split
  workspace past 2^31 elements (GPU).
- CUDA graphs (GPU): capture once, overwrite q, indices, valid_counts, block table, req ids, k_scale
  and the cache in place, replay, and every replay matches the reference; the eager call does no
  host synchronisation (``torch.cuda.set_sync_debug_mode("error")``).

GPU-marked tests run with ``python -m pytest -m gpu tests/test_contract.py`` on a CUDA machine.
"""

from __future__ import annotations

import dataclasses
import inspect

import pytest
import torch
from conftest import DEVICE, DTYPES, HAS_GPU, dtype_id, size
from test_sparse_mla import (
    FORMATS,
    I32_MAX,
    D,
    L,
    R,
    assert_matches,
    config_for,
    gen,
    make_cache,
    poison_,
    poison_unused_rows_,
    rand_indices,
    randn,
    reference,
    run_case,
)

from triton_mla_sparse import KernelConfig, pack_fp8_ds_mla, sparse_mla
from triton_mla_sparse.kv_format import dequantize_cache, quantize_fp8
from triton_mla_sparse.ops.sparse_mla.heuristics import arch_of, choose_config, split_len_for
from triton_mla_sparse.reference import sparse_mla_reference
from triton_mla_sparse.testing import capture_graph

gpu = pytest.mark.gpu
needs_gpu = pytest.mark.skipif(not HAS_GPU, reason="needs a CUDA device")
DTYPE_PARAMS = [pytest.param(dt, id=dtype_id(dt)) for dt in DTYPES]


# ----------------------------------------------------------------------------------------------
# the reference


def test_reference_has_the_kernels_signature():
    """Same parameters, kinds, defaults and annotations, in the same order; the reference's own
    keyword-only extras come last and are documented in its docstring."""
    extras = ("compute_dtype", "token_chunk")
    kern = inspect.signature(sparse_mla)
    ref = inspect.signature(sparse_mla_reference)
    ref_params = [p for name, p in ref.parameters.items() if name not in extras]
    assert list(ref.parameters)[-len(extras) :] == list(extras)
    assert ref_params == list(kern.parameters.values())
    assert ref.return_annotation == kern.return_annotation
    for name in extras:
        assert ref.parameters[name].kind is inspect.Parameter.KEYWORD_ONLY
        assert f"``{name}``" in sparse_mla_reference.__doc__


@pytest.mark.parametrize("fmt", ["auto", "fp8", "fp8_ds_mla"])
@pytest.mark.parametrize("with_table", [False, True], ids=["flat", "table"])
def test_reference_valid_on_any_cache(fmt, with_table):
    """A cache that is NaN (0xFF bytes for the fp8 layouts) in every row except the selected
    ones: the reference's output and LSE are finite and equal the result on a clean cache, with
    -1 holes, out-of-range indices, valid_counts, an empty token and (table) unmapped blocks."""
    g = gen(7)
    t, h, n, w, page = 4, 3, 288, 40, 16
    q = randn(t, h, D, g=g, dtype=torch.float32)
    clean, fkw = make_cache(randn(n, D, g=g), fmt, torch.float32)
    idx = rand_indices(t, w, n if not with_table else 8 * page, g)
    idx[0, :5] = -1
    idx[1, 3] = n + 11
    idx[2, -4:] = I32_MAX
    counts = torch.tensor([w, w - 6, w, 0], dtype=torch.int32, device=DEVICE)
    kw: dict = {"valid_counts": counts}
    if with_table:
        # block 0 unmapped: row 0, where the gather of invalid entries points, is NaN
        table = (torch.randperm(n // page - 1, generator=g)[:16] + 1).view(2, 8).to(torch.int32)
        table[0, 2] = -1
        table[1, 5] = n // page + 4
        req_ids = torch.tensor([0, 1, 1, 0], dtype=torch.int32, device=DEVICE)
        kw.update(block_table=table.to(DEVICE), req_ids=req_ids, block_size=page)
    want_o, want_l = sparse_mla_reference(q, clean, idx, return_lse=True, **fkw, **kw)
    dirty = clean.clone()
    poisoned = poison_unused_rows_(dirty, idx, **kw)
    assert poisoned > n // 2
    assert torch.isnan(dequantize_cache(dirty, fmt, fkw.get("k_scale"))[0]).any()
    got_o, got_l = sparse_mla_reference(q, dirty, idx, return_lse=True, **fkw, **kw)
    assert torch.isfinite(got_o).all()
    assert not torch.isnan(got_l).any() and torch.isneginf(got_l[3]).all()
    assert torch.equal(got_o, want_o) and torch.equal(got_l, want_l)


# ----------------------------------------------------------------------------------------------
# block tables near the int32 wrap, strides


# (block_size, table entries whose rows phys * block_size wrap int32): the wrapped products land
# at rows 0..127 (inside the cache) or at negative rows; without the kernel's bound on phys they
# would be read as those rows
WRAPPING = {
    64: [2**25, 2**26 + 1, 2**26 + 1, 2**25 + 2**24, 2**31 // 64 - 1, I32_MAX, 2**31 - 64],
    48: [89478486, 89478487, 2**31 // 48 + 1, I32_MAX, 2**31 // 48],
}


@pytest.mark.parametrize("dtype", [torch.float16] if not HAS_GPU else [torch.bfloat16])
@pytest.mark.parametrize("bs", sorted(WRAPPING), ids=lambda b: f"bs{b}")
@pytest.mark.parametrize("splits", [1, 2], ids=["single", "split2"])
def test_block_table_entries_near_int32_wrap(dtype, bs, splits):
    """Table entries near 2^31 / block_size and 2^32 / block_size (phys * block_size wraps to a
    negative row or to a small valid row, e.g. (2^26 + 1) * 64 = 2^32 + 64 -> 64) are skipped.
    The rows they would wrap to are NaN (no valid index reaches them)."""
    g = gen(bs)
    nb = 12  # table blocks of bs rows
    n = nb * bs
    for e in WRAPPING[bs]:
        assert e * bs >= 2**31 - bs and e < 2**31
    wrapped = [(e * bs) % 2**32 for e in WRAPPING[bs]]
    assert any(0 <= r < n for r in wrapped)  # at least one would alias a real row
    t, h, mb = 3, 4, 12
    table = torch.empty(2, mb, dtype=torch.int32)
    good_blocks = torch.randperm(nb - 4, generator=g)[:5] + 4  # rows >= 4 * bs: never aliased
    for r in range(2):
        ent = torch.tensor(WRAPPING[bs] + good_blocks.tolist(), dtype=torch.int32)[:mb]
        table[r, : len(ent)] = ent[torch.randperm(len(ent), generator=g)]
        table[r, len(ent) :] = -1
    idx = torch.stack([torch.randperm(mb * bs, generator=g)[:90] for _ in range(t)])
    kw = dict(
        block_table=table.to(DEVICE),
        req_ids=torch.tensor([0, 1, 0], dtype=torch.int32, device=DEVICE),
        block_size=bs,
    )
    idx = idx.to(torch.int32).to(DEVICE)
    q = randn(t, h, D, g=g, dtype=dtype)
    cache = randn(n, D, g=g, dtype=dtype)
    cfg = config_for(t, h, 90, dtype, "auto", None, splits, block_table=True)
    _, lse, _, ref_lse = run_case(q, cache, idx, dtype, {"kv_format": "auto"}, cfg, **kw)
    assert torch.isfinite(ref_lse).all()  # the good blocks keep every token non-empty


@pytest.mark.parametrize("dtype", DTYPE_PARAMS)
@pytest.mark.parametrize("fmt", [FORMATS[0], FORMATS[3]])
def test_strided_int_inputs(dtype, fmt):
    """indices, valid_counts, req_ids and block_table as non-contiguous views (every other
    element of a wider buffer whose other elements are garbage; transposed storage): the same
    result as contiguous copies, and the views are left untouched."""
    fmt, native = fmt
    g = gen(5)
    t, h, page, nb, w, mb = 4, 3, 16, 24, 60, 6
    n = nb * page
    q = randn(t, h, D, g=g, dtype=dtype)
    cache, fkw = make_cache(randn(n, D, g=g), fmt, dtype)
    idx = torch.stack([torch.randperm(mb * page, generator=g)[:w] for _ in range(t)])
    idx = idx.to(torch.int32)
    idx[1, :9] = -1
    counts = torch.tensor([w, 31, 0, 45], dtype=torch.int32)
    req = torch.tensor([2, 0, 1, 2], dtype=torch.int32)
    table = torch.randperm(nb, generator=g)[: 3 * mb].view(3, mb).to(torch.int32)
    table[2, 1] = -1

    def spread(x: torch.Tensor, garbage: int) -> torch.Tensor:
        """x as every other element of the last dimension of a buffer twice as wide."""
        buf = torch.full((*x.shape[:-1], 2 * x.shape[-1]), garbage, dtype=x.dtype)
        buf[..., ::2] = x
        return buf.to(DEVICE)[..., ::2]

    def transposed(x: torch.Tensor) -> torch.Tensor:
        return x.t().contiguous().to(DEVICE).t()

    cfg = config_for(t, h, w, dtype, fmt, native, 2, block_table=True)
    dense = dict(
        valid_counts=counts.to(DEVICE),
        block_table=table.to(DEVICE),
        req_ids=req.to(DEVICE),
        block_size=page,
    )
    ref_o, ref_l = reference(q, cache, idx.to(DEVICE), **fkw, **dense)
    variants = {
        "spread": dict(
            indices=spread(idx, 5),  # garbage 5: a valid position, wrong if read
            valid_counts=torch.stack([counts, counts + 17], 1).to(DEVICE)[:, 0],
            req_ids=torch.stack([req, 2 - req], 1).to(DEVICE)[:, 0],
            block_table=spread(table, 0),
        ),
        "transposed": dict(
            indices=transposed(idx),
            valid_counts=counts.to(DEVICE),
            req_ids=req.to(DEVICE),
            block_table=transposed(table),
        ),
    }
    for name, v in variants.items():
        for k in ("indices", "block_table"):
            assert not v[k].is_contiguous(), (name, k)
        before = {k: x.clone() for k, x in v.items()}
        out = poison_(torch.empty(t, h, L, dtype=dtype, device=DEVICE))
        idx_v = v.pop("indices")
        _, lse = sparse_mla(
            q, cache, idx_v, out=out, return_lse=True, config=cfg, block_size=page, **fkw, **v
        )
        assert_matches(out, lse, ref_o, ref_l, dtype)
        v["indices"] = idx_v
        for k, x in v.items():
            assert torch.equal(x, before[k]), (name, k)


# ----------------------------------------------------------------------------------------------
# 64-bit addressing


def _mem_available_gib() -> float:
    try:
        with open("/proc/meminfo") as f:
            info = dict(line.split(":", 1) for line in f)
        return int(info["MemAvailable"].split()[0]) / 2**20
    except (OSError, KeyError, ValueError):
        return 0.0


@pytest.mark.skipif(
    not HAS_GPU and _mem_available_gib() < 8, reason="needs ~2.2 GiB (twice on CPU) free memory"
)
@pytest.mark.parametrize("fmt", ["fp8", "fp8_ds_mla"])
def test_paged_cache_past_2_31_bytes(fmt):
    """A paged uint8 cache of more than 2^31 bytes (so 2^31 elements): rows at its end, whose
    element offsets need 64 bits, are read (one token and a few heads: cheap under the
    interpreter; the untouched pages are never allocated). Against the reference on the tail."""
    dtype = torch.float16 if not HAS_GPU else torch.bfloat16
    g = gen(11)
    row = 656 if fmt == "fp8_ds_mla" else D
    page = 64
    nb = -(-(2**31 + 2**20) // (page * row))
    n, tail = nb * page, 4 * page
    t, h, w = size(1, 4), 4, 64
    cache = torch.empty(nb, page, row, dtype=torch.uint8, device=DEVICE)
    rows = randn(tail, D, g=g)
    if fmt == "fp8_ds_mla":
        packed, fkw = pack_fp8_ds_mla(rows), {"kv_format": "fp8_ds_mla"}
    else:
        q8, ks = quantize_fp8(rows)
        packed, fkw = q8.view(torch.uint8), {"kv_format": "fp8", "k_scale": ks}
    flat = cache.view(n, row)
    flat[n - tail :] = packed
    flat[n - tail - 2 * page : n - tail] = 0xFF  # NaN just before the tail
    flat[: 2 * page] = 0xFF  # and at the start, where a wrapped offset would land
    assert (n - tail) * row > 2**31
    local = rand_indices(t, w, tail, g)
    q = randn(t, h, D, g=g, dtype=dtype)
    ref_o, ref_l = reference(q, packed, local, **fkw)
    out, lse = sparse_mla(q, cache, (local + (n - tail)).to(torch.int32), return_lse=True, **fkw)
    assert_matches(out, lse, ref_o, ref_l, dtype)


@gpu
@needs_gpu
def test_split_workspace_past_2_31_elements():
    """A split workspace [T, S, H, L] of more than 2^31 float32 elements (1100 tokens x 32 splits
    x 128 heads x 512 = 2.3e9, 9.2 GB): the tokens whose partials sit past 2^31 elements
    (t >= 1024) merge correctly, like the rest."""
    dtype = torch.bfloat16
    g = gen(13)
    t, h, w, n = 1100, 128, 2048, 16384
    base = choose_config(t, h, w, dtype, "auto", arch_of(DEVICE))
    cfg = dataclasses.replace(base, num_splits=32)
    split_len, splits = split_len_for(w, cfg.num_splits, cfg.block_n)
    assert splits == 32 and t * splits * h * L > 2**31
    q = randn(t, h, D, g=g, dtype=dtype)
    cache = randn(n, D, g=g, dtype=dtype)
    idx = torch.randint(0, n, (t, w), generator=g, dtype=torch.int32).to(DEVICE)
    idx[-3:, : w // 2] = -1
    out = poison_(torch.empty(t, h, L, dtype=dtype, device=DEVICE))
    _, lse = sparse_mla(q, cache, idx, out=out, return_lse=True, config=cfg)
    tail = slice(1000, t)  # partials of tokens >= 1024 start past 2^31 elements
    ref_o, ref_l = reference(q[tail], cache, idx[tail])
    assert_matches(out[tail], lse[tail], ref_o, ref_l, dtype)
    head = slice(0, 64)
    ref_o, ref_l = reference(q[head], cache, idx[head])
    assert_matches(out[head], lse[head], ref_o, ref_l, dtype)


# ----------------------------------------------------------------------------------------------
# CUDA graphs and host synchronisation (GPU)

GRAPH_TOKENS = [1, 4, 64]
GRAPH_HEADS = [8, 16, 64, 128]
GRAPH_FORMATS = ["auto", "fp8", "fp8_ds_mla"]


class _Workload:
    """Static input buffers of one captured decode shape, refilled in place between replays."""

    dtype = torch.bfloat16

    def __init__(self, t: int, h: int, fmt: str, table: bool, seed: int):
        self.t, self.h, self.fmt, self.table = t, h, fmt, table
        self.page, self.nb, self.w = 64, 128, 2048
        self.n = self.page * self.nb
        self.max_blocks = 48  # request-local positions < 48 * 64 = 3072
        v = self._values(seed)
        self.q, self.cache, self.idx, self.counts = v["q"], v["cache"], v["idx"], v["counts"]
        self.bt, self.req, self.k_scale = v.get("bt"), v.get("req"), v.get("k_scale")

    def _values(self, seed: int) -> dict:
        g = gen(seed)
        t, w = self.t, self.w
        out = {"q": randn(t, self.h, D, g=g, dtype=self.dtype)}
        rows = randn(self.n, D, g=g, scale=1.0 + seed % 3)
        if self.fmt == "auto":
            out["cache"] = rows.to(self.dtype).view(self.nb, self.page, D)
        elif self.fmt == "fp8":
            q8, ks = quantize_fp8(rows)
            out["cache"] = q8.view(torch.uint8).view(self.nb, self.page, D)
            out["k_scale"] = torch.tensor([ks], dtype=torch.float32, device=DEVICE)
        else:
            out["cache"] = pack_fp8_ds_mla(rows, "fp32").view(self.nb, self.page, 656)
        span = self.max_blocks * self.page if self.table else self.n
        idx = torch.stack([torch.randperm(span, generator=g)[:w] for _ in range(t)])
        idx = idx.to(torch.int32)
        idx[0, : 100 + seed % 200] = -1  # a leading run of -1
        if t > 1:
            idx[1, -7:] = I32_MAX
        counts = torch.randint(1, w + 1, (t,), generator=g, dtype=torch.int32)
        counts[0] = w
        if t > 2:
            counts[2] = 0  # an empty token
        out["idx"], out["counts"] = idx.to(DEVICE), counts.to(DEVICE)
        if self.table:
            reqs = 3
            perms = [torch.randperm(self.nb, generator=g)[: self.max_blocks] for _ in range(reqs)]
            bt = torch.stack(perms).to(torch.int32)
            bt[seed % reqs, seed % self.max_blocks] = -1
            out["bt"] = bt.to(DEVICE)
            out["req"] = torch.randint(0, reqs, (t,), generator=g, dtype=torch.int32).to(DEVICE)
        return out

    def refill(self, seed: int) -> None:
        """New values into the same buffers (what a server does between graph replays)."""
        v = self._values(seed)
        for name, buf in (("q", self.q), ("cache", self.cache), ("idx", self.idx)):
            buf.copy_(v[name])
        self.counts.copy_(v["counts"])
        for name in ("bt", "req", "k_scale"):
            if getattr(self, name) is not None:
                getattr(self, name).copy_(v[name])

    def kwargs(self) -> dict:
        kw = {"kv_format": self.fmt, "valid_counts": self.counts}
        if self.k_scale is not None:
            kw["k_scale"] = self.k_scale
        if self.table:
            kw.update(block_table=self.bt, req_ids=self.req, block_size=self.page)
        return kw

    def reference(self):
        kw = self.kwargs()
        if self.k_scale is not None:
            kw["k_scale"] = float(self.k_scale.item())  # the reference may sync
        return reference(self.q.clone(), self.cache.clone(), self.idx.clone(), **kw)


@gpu
@needs_gpu
@pytest.mark.parametrize("fmt", GRAPH_FORMATS)
@pytest.mark.parametrize("heads", GRAPH_HEADS)
@pytest.mark.parametrize("tokens", GRAPH_TOKENS)
@pytest.mark.parametrize("table", [False, True], ids=["counts", "table"])
def test_cuda_graph_replay_with_new_inputs(fmt, heads, tokens, table):
    """Warm, capture one call (valid_counts, a paged cache, a tensor k_scale for fp8; with a
    block table and request ids for "table"), then three times: overwrite q, the cache,
    indices, valid_counts, block table, req ids and k_scale in place, replay, and compare the
    static output and LSE with the reference on the new values."""
    wl = _Workload(tokens, heads, fmt, table, seed=1)
    out = poison_(torch.empty(tokens, heads, L, dtype=torch.bfloat16, device=DEVICE))

    def call():
        return sparse_mla(wl.q, wl.cache, wl.idx, out=out, return_lse=True, **wl.kwargs())[1]

    call()  # compile outside capture
    torch.cuda.synchronize()
    graph, lse = capture_graph(call)
    for seed in (2, 3, 4):
        wl.refill(seed)
        out.fill_(float("nan"))
        graph.replay()
        torch.cuda.synchronize()
        ref_o, ref_l = wl.reference()
        assert_matches(out, lse, ref_o, ref_l, torch.bfloat16)


@gpu
@needs_gpu
@pytest.mark.parametrize("fmt", GRAPH_FORMATS)
@pytest.mark.parametrize("table", [False, True], ids=["counts", "table"])
def test_eager_call_does_no_host_sync(fmt, table):
    """After warm-up, eager calls (decode and split-K shapes, counts, block table, tensor k_scale,
    with and without LSE and out=) run under torch.cuda.set_sync_debug_mode("error"): any
    synchronising torch op raises."""
    cases = [_Workload(t, h, fmt, table, seed=5) for t, h in ((1, 16), (64, 128))]
    outs = [torch.empty(w.t, w.h, L, dtype=torch.bfloat16, device=DEVICE) for w in cases]

    def calls():
        lses = [
            sparse_mla(w.q, w.cache, w.idx, out=o, return_lse=True, **w.kwargs())[1]
            for w, o in zip(cases, outs)
        ]
        fresh = [sparse_mla(w.q, w.cache, w.idx, **w.kwargs()) for w in cases]
        return lses, fresh

    calls()  # compile every variant first
    torch.cuda.synchronize()
    prev = torch.cuda.get_sync_debug_mode()
    torch.cuda.set_sync_debug_mode("error")
    try:
        lses, fresh = calls()
    finally:
        torch.cuda.set_sync_debug_mode(prev)
    torch.cuda.synchronize()
    for w, o, lse, f in zip(cases, outs, lses, fresh):
        ref_o, ref_l = w.reference()
        assert_matches(o, lse, ref_o, ref_l, torch.bfloat16)
        assert_matches(f, None, ref_o, None, torch.bfloat16)


def test_sync_debug_mode_would_catch_a_sync():
    """The sync test is not vacuous: a host read under the mode raises (GPU), and sparse_mla
    refuses the tensor softmax_scale that would need one (both)."""
    q = torch.zeros(1, 1, D, dtype=torch.float16, device=DEVICE)
    cache = torch.zeros(4, D, dtype=torch.float16, device=DEVICE)
    idx = torch.zeros(1, 1, dtype=torch.int32, device=DEVICE)
    with pytest.raises(TypeError, match="softmax_scale"):
        sparse_mla(q, cache, idx, torch.tensor(0.1, device=DEVICE))
    if not HAS_GPU:
        return
    prev = torch.cuda.get_sync_debug_mode()
    torch.cuda.set_sync_debug_mode("error")
    try:
        with pytest.raises(RuntimeError):
            torch.ones(1, device=DEVICE).item()
    finally:
        torch.cuda.set_sync_debug_mode(prev)


def test_config_label_is_what_runs():
    """KernelConfig as chosen for a block-table call is what the kernel runs (no silent drop of
    idx_ahead in the launcher any more)."""
    arch = arch_of(DEVICE)
    plain = choose_config(32, 16, 2048, torch.bfloat16, "auto", arch)
    assert plain.idx_ahead  # H200: 32 tokens x 16 heads loads indices ahead
    bt = choose_config(32, 16, 2048, torch.bfloat16, "auto", arch, block_table=True)
    assert not bt.idx_ahead and isinstance(bt, KernelConfig)


@gpu
@needs_gpu
@pytest.mark.parametrize("view", ["q", "out"])
def test_head_major_views_past_2_31_elements(view):
    """vLLM's layout: ql_nope comes out of a batched matmul over heads as a [H, T, L] tensor
    viewed [T, H, L], so its head stride is T * L. At 40000 tokens x 128 heads, heads >= 105 sit
    past 2^31 elements (h * T * L): their q (or out=) addresses need 64 bits. Checked on the last
    tokens against the reference. (Found with the CPU interpreter: a 3-head q with head stride
    2^30 + 1024 reads head 2 at a wrapped int32 offset and crashes; the kernel forms
    ``o_h * stride_qnh`` and ``o_h * stride_oh`` in int32.)"""
    dtype = torch.bfloat16
    g = gen(17)
    t, h, n, w = 40000, 128, 4096, 64
    assert (h - 1) * t * L > 2**31
    cache = randn(n, D, g=g, dtype=dtype)
    idx = torch.randint(0, n, (t, w), generator=g, dtype=torch.int32).to(DEVICE)
    dg = torch.Generator(device=DEVICE).manual_seed(17)  # 2.6e9 values: drawn on the GPU
    big = lambda *shape: torch.randn(*shape, generator=dg, device=DEVICE, dtype=dtype)  # noqa: E731
    q_rope = big(t, h, R)
    if view == "q":
        q_lat = big(h, t, L).transpose(0, 1)
        out = None
    else:
        q_lat = big(t, h, L)
        out = poison_(torch.empty(h, t, L, dtype=dtype, device=DEVICE)).transpose(0, 1)
    res, lse = sparse_mla((q_lat, q_rope), cache, idx, out=out, return_lse=True)
    tail = slice(t - 8, t)
    ref_o, ref_l = reference((q_lat[tail], q_rope[tail]), cache, idx[tail])
    assert_matches(res[tail], lse[tail], ref_o, ref_l, dtype)
