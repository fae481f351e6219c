"""The DSA lightning-indexer logits kernels against the float64 reference and vLLM's own.

Without a GPU these run under Triton's interpreter (tests/conftest.py) in fp16/fp32/e4m3 q; on a
GPU bf16 q joins and sizes grow. Memory no valid position points at holds e4m3 NaN bytes (0x7F,
also a NaN float32 scale), so reading it where it must not be read shows up in the result.
"""

from __future__ import annotations

import pytest
import torch
from conftest import DEVICE, HAS_GPU, require_vllm, size

from triton_mla_sparse.indexer import IndexerConfig, mqa_logits, paged_mqa_logits
from triton_mla_sparse.kv_format import (
    INDEXER_BLOCK_SIZE,
    INDEXER_HEAD_DIM,
    INDEXER_ROW_BYTES,
    quantize_indexer_k,
    write_indexer_cache,
)
from triton_mla_sparse.reference import (
    indexer_row_lengths,
    mqa_logits_reference,
    paged_mqa_logits_reference,
)
from triton_mla_sparse.testing import indexer_logits_tolerance, logits_row_error

D, PAGE = INDEXER_HEAD_DIM, INDEXER_BLOCK_SIZE
NAN_BYTE = 0x7F  # e4m3 NaN; four of them are a NaN float32
# Max error relative to the row's largest |logit|: the shared bound (testing/tolerances.py says
# why the interpreter's is tighter than a GPU's)
TOL = indexer_logits_tolerance(DEVICE)
# what a preallocated `out` holds before the call: not NaN, which garbage reads also produce
POISON = -7777.0
Q_KINDS = ["fp16", "fp32", "e4m3", "e4m3_bytes"] + (["bf16"] if HAS_GPU else [])


def make_q(shape: tuple[int, ...], kind: str, gen: torch.Generator) -> torch.Tensor:
    x = torch.randn(shape, generator=gen).to(DEVICE)
    if kind in ("e4m3", "e4m3_bytes"):
        x8 = (x * 64).clamp(-448, 448).to(torch.float8_e4m3fn)  # use the whole e4m3 range
        return x8.view(torch.uint8) if kind == "e4m3_bytes" else x8
    return x.to({"fp16": torch.float16, "fp32": torch.float32, "bf16": torch.bfloat16}[kind])


def make_cache(num_blocks: int, pad: int = 0) -> torch.Tensor:
    """``uint8 [num_blocks, 64, 1, 132]`` (block stride ``64 * 132 + pad``), all NaN bytes."""
    stride = PAGE * INDEXER_ROW_BYTES + pad
    store = torch.full((num_blocks * stride,), NAN_BYTE, dtype=torch.uint8, device=DEVICE)
    return torch.as_strided(
        store, (num_blocks, PAGE, 1, INDEXER_ROW_BYTES), (stride, INDEXER_ROW_BYTES, 1, 1)
    )


def fill_tokens(cache, block_table, lens_per_req, gen):
    """Write random K for positions ``[0, len)`` of each request through its block table."""
    for b, n in enumerate(lens_per_req):
        if n <= 0:
            continue
        p = torch.arange(n, device=DEVICE)
        slots = block_table[b, p // PAGE].long() * PAGE + p % PAGE
        k = torch.randn(n, D, generator=gen).to(DEVICE) * (
            1 + 3 * torch.rand(n, 1, generator=gen).to(DEVICE)
        )
        k8, sc = quantize_indexer_k(k)
        write_indexer_cache(cache, slots, k8, sc)


def assert_close(out, ref, what=""):
    """Values within TOL of each row's scale at the positions the reference writes
    (testing.logits_row_error: inf where a written logit is not finite)."""
    err = logits_row_error(out, ref)
    assert err <= TOL, f"{what}: max relative error {err:.2e} > {TOL}"


def paged_case(B, next_n, H, lens, kind, ctx_2d, pad=0, max_model_len=None, seed=0, extra_blocks=3):
    """Scrambled block table over a padded cache; returns the call's arguments."""
    gen = torch.Generator().manual_seed(seed)
    lens = list(lens)
    pages = [max(1, -(-n // PAGE)) for n in lens]
    max_blocks = max(pages)
    num_blocks = sum(pages) + extra_blocks
    perm = torch.randperm(num_blocks, generator=gen).to(torch.int32)
    block_table = torch.full((B, max_blocks), -1, dtype=torch.int32)
    used = 0
    for b, n in enumerate(pages):
        block_table[b, :n] = perm[used : used + n]
        used += n
    block_table = block_table.to(DEVICE)
    cache = make_cache(num_blocks, pad)
    fill_tokens(cache, block_table, lens, gen)
    q = make_q((B, next_n, H, D), kind, gen)
    weights = torch.randn(B * next_n, H, generator=gen).to(DEVICE)
    if ctx_2d:
        # row (b, j) sees L_b - next_n + j + 1 tokens, as vLLM's native MTP metadata says
        cl = torch.tensor(lens, dtype=torch.int32)[:, None] - next_n + 1 + torch.arange(next_n)
        cl = cl.clamp_min(0).to(torch.int32)
    else:
        cl = torch.tensor(lens, dtype=torch.int32)
    mml = max_model_len or max_blocks * PAGE + 37
    return q, cache, weights, cl.to(DEVICE), block_table, mml


def run_paged(args, config=None):
    q, cache, w, cl, bt, mml = args
    out = torch.full((q.shape[0] * q.shape[1], mml), POISON, device=DEVICE)
    res = paged_mqa_logits(q, cache, w, cl, bt, mml, out=out, config=config)
    assert res is out
    ref = paged_mqa_logits_reference(q, cache, w, cl, bt, mml, compute_dtype=torch.float64)
    assert_close(out, ref, "paged")
    # columns the kernel must not write kept their NaN poison
    assert (out[~torch.isfinite(ref)] == POISON).all(), "paged: wrote an unwritten column"
    return out, ref


# --- paged decode logits ------------------------------------------------------------------------


@pytest.mark.parametrize("kind", Q_KINDS)
@pytest.mark.parametrize("next_n", [1, 2])
@pytest.mark.parametrize("ctx_2d", [False, True], ids=["ctx1d", "ctx2d"])
def test_paged_logits(kind, next_n, ctx_2d):
    # lengths off the 64 grid, one below next_n (a zero-length row at next_n = 2), padded stride
    lens = size([130, 1, 64, 200], [4000, 1, 64, 8191, 33, 2049])
    args = paged_case(len(lens), next_n, 32, lens, kind, ctx_2d, pad=64)
    _, ref = run_paged(args)
    lens_rows = indexer_row_lengths(args[3], next_n, args[5])
    assert (torch.isfinite(ref).sum(1).cpu() == lens_rows.cpu()).all()
    if next_n == 2:
        assert lens_rows.min() == 0  # the zero-length row is exercised


@pytest.mark.parametrize("heads", [64, 20, 128])
def test_paged_heads(heads):
    """DeepSeek-V3.2's 64 heads, a head count padded to 32, and the widest tile."""
    lens = size([70, 129], [5000, 129])
    run_paged(paged_case(2, 2, heads, lens, "e4m3", True))


@pytest.mark.parametrize("kind", ["fp16", "e4m3"])
def test_paged_integer_decode(kind):
    """sm80/86 and AMD's path: integer e4m3 decode, fp16 MMA, 2^-8 factors folded back."""
    lens = size([150, 64], [3000, 64])
    args = paged_case(2, 2, 32, lens, kind, False)
    base = choose(args)
    run_paged(args, IndexerConfig(base.rows, base.block_n, base.chunk, 4, 1, fp8_native=False))


def choose(args):
    from triton_mla_sparse.ops.indexer.heuristics import arch_of, choose_paged_config

    q = args[0]
    return choose_paged_config(q.shape[0], q.shape[1], q.shape[2], q.dtype, arch_of(DEVICE))


@pytest.mark.parametrize(
    "cfg",
    [
        IndexerConfig(rows=1, block_n=32, chunk=64, num_warps=4, num_stages=1),
        IndexerConfig(rows=2, block_n=128, chunk=128, num_warps=4, num_stages=2),
        IndexerConfig(rows=2, block_n=64, chunk=192, num_warps=4, num_stages=2, fp8_mma=False),
    ],
    ids=["rows1-n32-chunk64", "rows2-n128", "rows2-chunk192-nofp8mma"],
)
def test_paged_configs(cfg):
    """Several programs per row (chunks not a multiple of the page), one row per program."""
    lens = size([300, 65, 0], [4000, 65, 0])
    run_paged(paged_case(3, 2, 32, lens, "e4m3", True), cfg)


def test_paged_three_rows_and_bad_table():
    """next_n = 3 (a masked row in the program), table entries -1 and past num_blocks, lengths
    past max_model_len: none of those positions is read or written."""
    gen = torch.Generator().manual_seed(5)
    args = list(paged_case(2, 3, 32, [200, 150], "fp16", False, seed=5))
    bt = args[4].clone()
    bt[0, 1] = -1
    bt[1, 0] = args[1].shape[0] + 7
    args[4] = bt
    args[5] = 180  # shorter than request 0
    out, ref = run_paged(tuple(args))
    assert not torch.isfinite(ref[:3, 64:128]).any() and not torch.isfinite(ref[3:, :64]).any()
    assert torch.isfinite(ref[0, :64]).all()
    del gen


def test_paged_flat_cache_layout():
    """``[num_blocks, 64 * 132]`` form and a [B, 1] context_lens (vLLM's plain decode)."""
    q, cache, w, cl, bt, mml = paged_case(2, 1, 32, [100, 250], "e4m3", False, pad=128)
    flat = torch.as_strided(cache, (cache.shape[0], PAGE * INDEXER_ROW_BYTES), (cache.stride(0), 1))
    out = paged_mqa_logits(q, flat, w, cl[:, None], bt, mml)
    ref = paged_mqa_logits_reference(q, cache, w, cl, bt, mml, compute_dtype=torch.float64)
    fin = torch.isfinite(ref)
    assert_close(torch.where(fin, out, ref), ref, "flat")


@pytest.mark.vllm
def test_paged_matches_vllm_torch_reference():
    """vLLM's DeepGEMM-derived torch reference (its next_n == 1 branch reads this layout)."""
    require_vllm()
    from vllm.v1.attention.ops.rocm_aiter_mla_sparse import fp8_paged_mqa_logits_torch

    q, cache, w, cl, bt, mml = paged_case(3, 1, 32, [77, 200, 64], "e4m3", False)
    out = paged_mqa_logits(q, cache, w, cl, bt, mml)
    ref = fp8_paged_mqa_logits_torch(q, cache, w, cl, bt, mml)
    assert_close(torch.where(torch.isfinite(ref), out, ref), ref, "vllm paged")


# --- prefill logits ------------------------------------------------------------------------------


def prefill_case(kind, H=32, seed=0, n=None):
    """Three requests in one chunk (causal rows), a row with ke <= ks, ks/ke clamped by
    max_seqlen_k, K rows of NaN bytes between requests that no row covers."""
    gen = torch.Generator().manual_seed(seed)
    reqs = size(
        [(0, 70, 5), (75, 140, 4), (140, 141, 1)],
        [(0, 3000, 300), (3010, 9000, 200), (9000, 9001, 1)],
    )
    N = n or reqs[-1][1] + 9
    k = torch.randn(N, D, generator=gen).to(DEVICE) * (
        1 + torch.rand(N, 1, generator=gen).to(DEVICE)
    )
    k8, sc = quantize_indexer_k(k)
    k8 = k8.view(torch.uint8).clone()
    sc = sc.clone()
    ks_l, ke_l = [], []
    for start, end, rows in reqs:
        for i in range(rows):
            ks_l.append(start)
            ke_l.append(end - rows + i + 1)
    covered = torch.zeros(N, dtype=torch.bool)
    for start, end, _ in reqs:
        covered[start:end] = True
    k8[~covered.to(DEVICE)] = NAN_BYTE
    sc[~covered.to(DEVICE)] = float("nan")
    ks_l.append(50)
    ke_l.append(40)  # empty row
    M = len(ks_l)
    q = make_q((M, H, D), kind, gen)
    w = torch.randn(M, H, generator=gen).to(DEVICE)
    ks = torch.tensor(ks_l, dtype=torch.int32, device=DEVICE)
    ke = torch.tensor(ke_l, dtype=torch.int32, device=DEVICE)
    max_len = max(e - s for s, e in zip(ks_l, ke_l)) + 3
    return q, k8.view(torch.float8_e4m3fn), sc, w, ks, ke, max_len


def run_prefill(args, config=None):
    q, k, sc, w, ks, ke, max_len = args
    out = torch.full((q.shape[0], max_len), POISON, device=DEVICE)
    assert mqa_logits(q, k, sc, w, ks, ke, max_len, out=out, config=config) is out
    ref = mqa_logits_reference(q, k, sc, w, ks, ke, max_len, compute_dtype=torch.float64)
    assert_close(out, ref, "prefill")
    assert (out[~torch.isfinite(ref)] == POISON).all(), "prefill: wrote an unwritten column"
    lens = (ke - ks).clamp(0, max_len).cpu()
    assert (torch.isfinite(ref).sum(1).cpu() == lens).all()
    return out, ref


@pytest.mark.parametrize("kind", Q_KINDS)
def test_prefill_logits(kind):
    run_prefill(prefill_case(kind))


@pytest.mark.parametrize(
    "cfg",
    [
        IndexerConfig(rows=4, block_n=32, chunk=64, num_warps=4, num_stages=1),
        IndexerConfig(rows=1, block_n=64, chunk=128, num_warps=4, num_stages=2, fp8_native=False),
        IndexerConfig(rows=8, block_n=16, chunk=32, num_warps=4, num_stages=1, fp8_mma=False),
    ],
    ids=["rows4-chunk64", "rows1-int-decode", "rows8-n16"],
)
def test_prefill_configs(cfg):
    """Row blocks straddling request boundaries, K chunks smaller than a request."""
    run_prefill(prefill_case("e4m3", seed=1), cfg)


def test_prefill_heads_64_and_max_seqlen_clamp():
    q, k, sc, w, ks, ke, max_len = prefill_case("fp16", H=64, seed=2)
    run_prefill((q, k, sc, w, ks, ke, max_len - 20))  # rows longer than the output are cut


def test_prefill_scale_forms():
    """k_scale as vLLM gathers it (uint8 [N, 4] bytes) and as [N, 1] float32."""
    q, k, sc, w, ks, ke, max_len = prefill_case("e4m3", seed=3)
    ref = mqa_logits(q, k, sc, w, ks, ke, max_len)
    fin = torch.isfinite(mqa_logits_reference(q, k, sc, w, ks, ke, max_len))
    for form in (sc.view(torch.uint8).view(-1, 4), sc[:, None]):
        got = mqa_logits(q, k, form, w, ks, ke, max_len)
        assert torch.equal(got[fin], ref[fin])


@pytest.mark.vllm
def test_prefill_matches_vllm_torch_reference():
    require_vllm()
    from vllm.v1.attention.ops.rocm_aiter_mla_sparse import fp8_mqa_logits_torch

    q, k, sc, w, ks, ke, max_len = prefill_case("e4m3", seed=4)
    N = k.shape[0]
    k_ok = k.view(torch.uint8).clone()
    k_ok[k_ok == NAN_BYTE] = 0  # vLLM's reference reads every K row
    sc_ok = torch.nan_to_num(sc, nan=1.0)
    k_ok = k_ok.view(torch.float8_e4m3fn)
    out = mqa_logits(q, k_ok, sc_ok, w, ks, ke, N)
    full = fp8_mqa_logits_torch(q, (k_ok, sc_ok), w, ks, ke)  # [M, N], absolute K columns
    # compress as DeepGEMM does: column j of row m is K row ks[m] + j
    col = ks.long()[:, None] + torch.arange(N, device=DEVICE)[None, :]
    ref = torch.gather(full, 1, col.clamp_max(N - 1)).masked_fill(col >= N, float("-inf"))
    # vLLM's reference rounds q and k to bf16 (exact for e4m3) but multiplies in bf16 (einsum
    # output): its products carry bf16 rounding, so compare at bf16's resolution.
    fin = torch.isfinite(ref)
    scale = ref.masked_fill(~fin, 0).abs().amax(1, keepdim=True)
    err = ((out - ref).abs() / scale).masked_fill(~fin, 0).max().item()
    assert err <= 2e-2, err
    assert torch.isfinite(out[fin]).all()


# --- e4m3 decode over every code -------------------------------------------------------------


# Every combination the API accepts: q kind x e4m3 decode x fp8 MMA (fp8 MMA needs e4m3 q and the
# native decode).
_CODE_Q = ["fp32", "fp16", "e4m3", "e4m3_bytes"] + (["bf16"] if HAS_GPU else [])
_CODE_COMBOS = [
    pytest.param(kind, native, mma, id=f"{kind}-{'native' if native else 'integer'}-mma_{mma}")
    for kind in _CODE_Q
    for native in (True, False)
    for mma in (None, False, True)
    if not (kind == "fp32" and native) and not (mma and not (kind.startswith("e4m3") and native))
]


def _code_q(kind: str, H: int) -> torch.Tensor:
    """q [256, H, D]: row (sign, d) is +-1 in dim d of head 0, zero elsewhere, of `kind`."""
    q = torch.zeros(256, H, D, device=DEVICE)
    d = torch.arange(128, device=DEVICE)
    q[d, 0, d] = 1.0
    q[128 + d, 0, d] = -1.0
    if kind.startswith("e4m3"):
        q8 = q.to(torch.float8_e4m3fn)  # +-1 and 0 are exact in e4m3
        return q8.view(torch.uint8) if kind == "e4m3_bytes" else q8
    return q.to({"fp16": torch.float16, "fp32": torch.float32, "bf16": torch.bfloat16}[kind])


@pytest.mark.parametrize("kind, native, mma", _CODE_COMBOS)
def test_all_e4m3_codes(kind, native, mma):
    """K row 0 holds codes 0..127 and row 1 codes 128..255; query row (d, sign) reads
    ReLU(+-k[:, d]) through one head, so each code's value comes back exactly, for every q kind,
    decode and MMA operand type the API accepts, through the prefill and the paged kernel.

    The NaN codes 0x7F/0xFF are replaced by 0x00 here: a NaN in a K row makes every dot product
    of that row NaN (NaN * 0 = NaN), which ReLU (the hardware max) turns into 0 for every code of
    the row. The integer decode reads them as +-480 instead (the fp16 pattern they map to), and so
    does the interpreter's native decode. Real caches never hold them (writers saturate)."""
    codes = torch.arange(256, dtype=torch.int32).to(torch.uint8).view(2, 128)
    codes[:, 127] = 0  # the NaN codes 0x7F, 0xFF
    codes = codes.to(DEVICE)
    sc = torch.ones(2, device=DEVICE)
    H = 16
    q = _code_q(kind, H)
    w = torch.zeros(256, H, device=DEVICE)
    w[:, 0] = 1.0
    ks = torch.zeros(256, dtype=torch.int32, device=DEVICE)
    ke = torch.full((256,), 2, dtype=torch.int32, device=DEVICE)
    cfg = IndexerConfig(
        rows=8, block_n=16, chunk=16, num_warps=4, num_stages=1, fp8_native=native, fp8_mma=mma
    )
    out = torch.full((256, 2), POISON, device=DEVICE)
    mqa_logits(q, codes, sc, w, ks, ke, 2, out=out, config=cfg)  # (d, sign) x code row
    val = codes.view(torch.float8_e4m3fn).float()  # [2, 128] true values
    want = torch.cat([val.T.relu(), (-val.T).relu()])  # [256, 2]
    assert torch.equal(out, want), (out - want).abs().max()
    # and through the paged decode kernel, the same codes in one block of the indexer layout
    cache = make_cache(1)
    slots = torch.arange(2, device=DEVICE)
    write_indexer_cache(cache, slots, codes.view(torch.float8_e4m3fn), sc)
    qp = q.view(256, 1, H, D)
    lens = torch.full((256,), 2, dtype=torch.int32, device=DEVICE)
    table = torch.zeros(256, 1, dtype=torch.int32, device=DEVICE)
    pcfg = IndexerConfig(
        rows=1, block_n=16, chunk=16, num_warps=4, num_stages=1, fp8_native=native, fp8_mma=mma
    )
    pout = torch.full((256, 2), POISON, device=DEVICE)
    paged_mqa_logits(qp, cache, w, lens, table, 2, out=pout, config=pcfg)
    assert torch.equal(pout, want), (pout - want).abs().max()


@pytest.mark.parametrize(
    "kind, cfg, match",
    [
        ("fp16", dict(fp8_mma=True), "fp8_mma=True needs e4m3 q"),
        ("fp32", dict(fp8_mma=True), "fp8_mma=True needs e4m3 q"),
        ("e4m3", dict(fp8_native=False, fp8_mma=True), "fp8_mma=True needs e4m3 q"),
    ],
)
def test_decode_config_refused_before_launch(kind, cfg, match):
    """A decode or MMA choice the call cannot honour is refused with a named error."""
    gen = torch.Generator().manual_seed(0)
    args = list(prefill_case("e4m3"))
    args[0] = make_q(tuple(args[0].shape), kind, gen)
    with pytest.raises(ValueError, match=match):
        mqa_logits(*args, config=IndexerConfig(1, 64, 128, 4, 2, **cfg))


def test_native_decode_refused_without_hardware_e4m3(monkeypatch):
    """fp8_native=True on a target without hardware e4m3 (sm80/86, AMD) is refused, not compiled."""
    from triton_mla_sparse.ops.indexer import interface
    from triton_mla_sparse.ops.sparse_mla.heuristics import Arch

    sm80 = Arch("cuda", 80, num_sms=108)
    monkeypatch.setattr(interface, "arch_of", lambda _device: sm80)
    args = list(prefill_case("e4m3"))
    with pytest.raises(ValueError, match="fp8_native=True needs hardware e4m3"):
        mqa_logits(*args, config=IndexerConfig(1, 64, 128, 4, 2, fp8_native=True))


# --- validation --------------------------------------------------------------------------------


def _paged_args():
    return list(paged_case(2, 1, 32, [70, 10], "e4m3", False))


@pytest.mark.parametrize(
    "mutate, exc, match",
    [
        (lambda a: a.__setitem__(0, a[0].to(torch.int32)), TypeError, "q must be e4m3"),
        (lambda a: a.__setitem__(0, a[0][..., :64]), ValueError, "head dim"),
        (lambda a: a.__setitem__(0, a[0][0]), ValueError, "q must be 4-D"),
        (lambda a: a.__setitem__(1, a[1].view(torch.int8)), TypeError, "kv_cache must be uint8"),
        (
            lambda a: a.__setitem__(
                1, torch.zeros(4, 32, 1, 132, dtype=torch.uint8, device=DEVICE)
            ),
            ValueError,
            "block size must be 64",
        ),
        (
            lambda a: a.__setitem__(
                1, torch.zeros(4, 64, 1, 128, dtype=torch.uint8, device=DEVICE)
            ),
            ValueError,
            "kv_cache must be",
        ),
        (
            lambda a: a.__setitem__(
                1, torch.zeros(4, 64, 2, 132, dtype=torch.uint8, device=DEVICE)[:, :, :1]
            ),
            ValueError,
            "contiguous",
        ),
        (lambda a: a.__setitem__(2, a[2].double()), TypeError, "weights must be float32"),
        (lambda a: a.__setitem__(2, a[2][:1]), ValueError, "weights must be"),
        (lambda a: a.__setitem__(3, a[3].long()), TypeError, "context_lens must be int32"),
        (lambda a: a.__setitem__(3, a[3][:1]), ValueError, "context_lens must be"),
        (lambda a: a.__setitem__(4, a[4][0]), ValueError, "block_table must be 2-D"),
        (lambda a: a.__setitem__(4, a[4].long()), TypeError, "block_table must be int32"),
        (lambda a: a.__setitem__(5, 100.0), TypeError, "max_model_len must be an int"),
        (lambda a: a.__setitem__(5, -1), ValueError, "max_model_len must be >= 0"),
    ],
)
def test_paged_validation(mutate, exc, match):
    args = _paged_args()
    mutate(args)
    with pytest.raises(exc, match=match):
        paged_mqa_logits(*args)


def test_paged_validation_out_and_device():
    args = _paged_args()
    with pytest.raises(ValueError, match="out must be float32"):
        paged_mqa_logits(*args, out=torch.empty(2, args[5], dtype=torch.float16, device=DEVICE))
    with pytest.raises(ValueError, match="out must be float32"):
        paged_mqa_logits(*args, out=torch.empty(3, args[5], device=DEVICE))
    if HAS_GPU:
        args[3] = args[3].cpu()
        with pytest.raises(ValueError, match="context_lens must be on"):
            paged_mqa_logits(*args)


def _prefill_args():
    return list(prefill_case("e4m3"))


@pytest.mark.parametrize(
    "mutate, exc, match",
    [
        (
            lambda a: a.__setitem__(0, a[0].view(torch.uint8).to(torch.int16)),
            TypeError,
            "q must be e4m3",
        ),
        (lambda a: a.__setitem__(0, a[0][:, :, :32]), ValueError, "head dim"),
        (lambda a: a.__setitem__(1, a[1].view(torch.uint8).float()), TypeError, "k must be e4m3"),
        (lambda a: a.__setitem__(1, a[1][:, :64]), ValueError, r"k must be \[N, 128\]"),
        (lambda a: a.__setitem__(2, a[2].double()), TypeError, "k_scale must be float32"),
        (lambda a: a.__setitem__(2, a[2][:-1]), ValueError, "k_scale must be"),
        (lambda a: a.__setitem__(3, a[3][:, :1]), ValueError, "weights must be"),
        (lambda a: a.__setitem__(4, a[4].long()), TypeError, "cu_seqlen_ks must be int32"),
        (lambda a: a.__setitem__(5, a[5][:-1]), ValueError, "cu_seqlen_ke must be"),
        (lambda a: a.__setitem__(6, None), TypeError, "max_seqlen_k must be an int"),
    ],
)
def test_prefill_validation(mutate, exc, match):
    args = _prefill_args()
    mutate(args)
    with pytest.raises(exc, match=match):
        mqa_logits(*args)


def test_bad_config():
    args = _paged_args()
    with pytest.raises(ValueError, match="power-of-two rows"):
        paged_mqa_logits(*args, config=IndexerConfig(3, 64, 128, 4, 2))
    with pytest.raises(ValueError, match="power-of-two rows"):
        paged_mqa_logits(*args, config=IndexerConfig(16, 64, 128, 4, 2))  # 16 x 32 heads > 256


def test_too_many_heads():
    gen = torch.Generator().manual_seed(0)
    q = make_q((4, 256, D), "e4m3", gen)
    with pytest.raises(ValueError, match="1 to 128 heads"):
        mqa_logits(
            q,
            q[:, 0],
            torch.ones(4),
            torch.ones(4, 256),
            *[torch.zeros(4, dtype=torch.int32)] * 2,
            4,
        )


# --- the bench's check path (timing needs a GPU) ---------------------------------------------


def test_bench_check_paths():
    """bench --indexer builds its inputs and checks them against the reference before timing."""
    from triton_mla_sparse import bench_indexer as bi

    for native in (True, False):
        r = bi.bench_decode(3, 2, 32, 200, native, DEVICE, None)
        assert r.passed and r.err < TOL, r
        r = bi.bench_prefill(300, 32, native, DEVICE, None)
        assert r.passed and r.err < TOL, r
    if not HAS_GPU:  # sparse_mla in fp16 under the interpreter (bf16 is wrong there)
        for fmt in ("auto", "fp8_ds_mla"):
            res = bi.bench_layer(fmt, DEVICE, None, batch=2, ctx=256, topk=64, dtype=torch.float16)
            assert [r.passed for r in res] == [True] * 4, res


def test_import_touches_no_gpu_and_no_kernels():
    import os
    import subprocess
    import sys
    import textwrap

    code = textwrap.dedent(
        """
        import sys, torch
        from triton_mla_sparse.indexer import paged_mqa_logits, mqa_logits, IndexerConfig
        assert not torch.cuda.is_initialized(), "import initialised CUDA"
        for m in ("triton_mla_sparse.ops.indexer.kernels", "triton_mla_sparse.ops.indexer.launch",
                  "triton_mla_sparse.ops.common"):
            assert m not in sys.modules, m + " imported at import"
        print("ok")
        """
    )
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    src = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "src")
    env["PYTHONPATH"] = src + os.pathsep + env.get("PYTHONPATH", "")
    res = subprocess.run(
        [sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120
    )
    assert res.returncode == 0 and res.stdout.strip() == "ok", res.stderr[-2000:]


@pytest.mark.gpu
@pytest.mark.skipif(not HAS_GPU, reason="CUDA graphs need a GPU")
def test_cuda_graph_capture_and_replay():
    """Both calls capture (no host sync, no data-dependent allocation) and replay with new
    context lengths / new ks-ke written into the captured tensors."""
    q, cache, w, cl, bt, mml = paged_case(4, 2, 64, [3000, 100, 4096, 64], "e4m3", True)
    out = torch.full((8, mml), POISON, device=DEVICE)
    paged_mqa_logits(q, cache, w, cl, bt, mml, out=out)  # compile outside capture
    pargs = list(prefill_case("e4m3"))
    pout = torch.full((pargs[0].shape[0], pargs[-1]), POISON, device=DEVICE)
    mqa_logits(*pargs, out=pout)
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        paged_mqa_logits(q, cache, w, cl, bt, mml, out=out)
        mqa_logits(*pargs, out=pout)
    cl.copy_((cl - 50).clamp_min(0))
    pargs[5].copy_(torch.maximum(pargs[5] - 3, pargs[4]))
    out.fill_(POISON)
    pout.fill_(POISON)
    g.replay()
    torch.cuda.synchronize()
    ref = paged_mqa_logits_reference(q, cache, w, cl, bt, mml, compute_dtype=torch.float64)
    assert_close(out, ref, "graph paged")
    assert (out[~torch.isfinite(ref)] == POISON).all()
    pref = mqa_logits_reference(*pargs, compute_dtype=torch.float64)
    assert_close(pout, pref, "graph prefill")
    assert (pout[~torch.isfinite(pref)] == POISON).all()


def test_indexer_cache_helpers_round_trip():
    """quantize_indexer_k: power-of-two scale per token (vLLM's writer), amax maps to <= 448;
    write_indexer_cache / unpack_indexer_cache round trip through a padded block stride."""
    from triton_mla_sparse.kv_format import unpack_indexer_cache

    gen = torch.Generator().manual_seed(9)
    k = torch.randn(100, D, generator=gen) * torch.rand(100, 1, generator=gen) * 10
    k[3] = 0.0  # amax floor 1e-4
    k8, sc = quantize_indexer_k(k)
    assert torch.equal(sc, torch.exp2(torch.log2(sc).round()))
    assert (k8.float().abs().amax(1) <= 448).all()
    assert (k8.float().abs().amax(1)[k.abs().amax(1) > 0] >= 224).all()  # the tightest scale
    # round to nearest: half an ulp (3 mantissa bits), or half the subnormal step 2^-9
    bound = torch.maximum(k.abs() * 2**-4, sc[:, None] * 2**-10)
    assert ((k8.float() * sc[:, None] - k).abs() <= bound).all()
    cache = make_cache(3, pad=16).cpu()
    slots = torch.randperm(3 * PAGE, generator=gen)[:100]
    write_indexer_cache(cache, slots, k8, sc)
    vals, scales = unpack_indexer_cache(cache)
    assert torch.equal(vals.reshape(-1, D)[slots], k8.float())
    assert torch.equal(scales.reshape(-1)[slots], sc)
