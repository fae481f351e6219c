"""Conformance with FlashMLA's own sparse tests: the same cases, the same tolerances.

FlashMLA (github.com/deepseek-ai/FlashMLA) checks its sparse kernels with two scripts; their case
grids are ported here as data, each case mapped onto one ``sparse_mla`` call:

- decode, ``tests/test_flash_mla_sparse_decoding.py`` at :data:`FLASHMLA_COMMIT`
  (``gen_testcase``, inputs from ``tests/lib.py`` ``generate_testcase_for_decode``): fp8 caches,
  DeepSeek-V3.2 (q . k over 576, 656-byte rows, ``kv_format="fp8_ds_mla"``) or DeepSeek-V4
  (q . k over 512, the 584-byte paged record, ``"fp8_ds_mla_v4"``), paged with odd page sizes,
  with the sink, per-request top-k lengths, and V4's extra cache with its own page size and
  lengths. FlashMLA's physical indices (``block * page + slot``) are passed as flat indices of
  the paged cache; every other case passes the request-local positions through
  ``block_table``/``req_ids`` (and ``extra_block_table``) instead, the same attention.
- prefill, ``tests/test_flash_mla_sparse_prefill.py`` at :data:`FLASHMLA_COMMIT`
  (``__main__``, inputs from ``tests/lib.py`` ``generate_testcase``): a bf16 cache of 576 or 512
  values per row (``kv_format="auto"``), invalid indices anywhere in ``[-2^31, 2^31)``, sink,
  ``topk_length``; plus what ``tests/test-sparse-prefill.py`` at :data:`FLASHMLA_V41_PREFILL`
  added (rows of K amplified up to 256 times, top-k 640), with that version's tolerances.

Each case compares the output and LSE with ``sparse_mla_reference`` in float64 by FlashMLA's
rule for that case (:func:`flashmla_allclose`, its constants below with where they come from),
and by this package's own table (``triton_mla_sparse.testing``). FlashMLA's conventions are
applied, not assumed: its reference LSE is ``+inf`` where a (token, head) attends to nothing
(this API: ``-inf``), its decode output is compared after rounding the reference to the output
dtype, its prefill output in float32. As in FlashMLA's decode, every cache row no valid entry
reaches is poisoned (NaN, 0xFF bytes), in prefill too (FlashMLA does not; this API never reads
past a count).

On a GPU the whole grid runs at FlashMLA's sizes in bf16 (marked ``gpu``; thousands of cases);
with FlashMLA importable (vLLM's build, ``peers/flashmla.py``) each case also runs FlashMLA's
own call, whose output must pass the same rule against the same reference, and ours must agree
with it within the bf16 table (without it, or where its build refuses the call, the case stands
on the reference check and a warning says so). The grid's processes share one GPU: a case that
runs out of memory beside them is run again alone (tests/gpu_share.py). Without a GPU (Triton's
interpreter) a few representative cases, each shrunk (:func:`shrink_decode`,
:func:`shrink_prefill`), run in fp16.

What FlashMLA's API or tests have that this API cannot express is :data:`NOT_EXPRESSIBLE`, each
entry with a test that it is still true.
"""

from __future__ import annotations

import dataclasses
import inspect
import math
import random
import warnings

import pytest
import torch
from conftest import DEVICE, HAS_GPU
from gpu_share import run_sharing_gpu

from triton_mla_sparse import sparse_mla
from triton_mla_sparse.kv_format import (
    KV_FORMATS,
    alloc_fp8_ds_mla_v4,
    pack_fp8_ds_mla,
    write_fp8_ds_mla_v4,
)
from triton_mla_sparse.reference import physical_rows, sparse_mla_reference
from triton_mla_sparse.testing import compare_sparse_mla

# The FlashMLA versions read. FLASHMLA_COMMIT is main's newest commit (2026-04-29) with the
# V3.2/V4 grids; the two later commits are the newest stored versions of the renamed scripts,
# whose decode grid is DeepSeek-V4.1 only (NOT_EXPRESSIBLE) and whose prefill grid adds cases.
FLASHMLA_COMMIT = "9241ae3ef9bac614dd25e45e507e089f888280e0"
FLASHMLA_V41_DECODE = "a123d0b0191e0da7aa1e044f8644e0989cc63220"  # tests/test-sparse-decode.py
FLASHMLA_V41_PREFILL = "9a7d253aba9afe75ebbcda14d2ffe020951663b4"  # tests/test-sparse-prefill.py

V32_D, V4_D, DV = 576, 512, 512
CPU_DTYPE = torch.float16  # the interpreter refuses bf16
DTYPE = torch.bfloat16 if HAS_GPU else CPU_DTYPE


# ----------------------------------------------------------------------------------------------
# FlashMLA's tolerance rule


@dataclasses.dataclass(frozen=True)
class Rule:
    """Arguments of FlashMLA's ``tests/kernelkit/compare.py`` ``check_is_allclose``."""

    abs_tol: float
    rel_tol: float
    cos_diff_tol: float = 1e-7  # check_is_allclose's default (the LSE checks pass none)
    cos_dtype: torch.dtype = torch.float64  # dtype_for_cos_diff_calc (later versions)


# tests/test_flash_mla_sparse_decoding.py, test_flash_mla (FLASHMLA_COMMIT; unchanged in
# tests/test-sparse-decode.py at FLASHMLA_V41_DECODE): out bf16 vs the reference rounded to bf16.
DECODE_OUT = Rule(abs_tol=1e-3, rel_tol=2.01 / 128, cos_diff_tol=5e-6)
DECODE_LSE = Rule(abs_tol=1e-6, rel_tol=8.01 / 65536)
# tests/test_flash_mla_sparse_prefill.py, run_test (FLASHMLA_COMMIT): out.float() vs the float32
# reference, not rounded.
PREFILL_OUT = Rule(abs_tol=8e-4, rel_tol=3.01 / 128, cos_diff_tol=7e-6)
PREFILL_LSE = Rule(abs_tol=1e-6, rel_tol=2.01 / 65536)
# tests/test-sparse-prefill.py, run_test (FLASHMLA_V41_PREFILL): out_criteria / lse_criteria for
# the cases that version added; with amplified K rows ("k_amplifier_portion" > 0) the output is
# judged by its cosine alone (abs/rel 1.0) and the LSE gets 1e-5 / 4.01/65536.
PREFILL_OUT_V41 = Rule(8e-4, 3.01 / 128, cos_diff_tol=1e-5, cos_dtype=torch.float32)
PREFILL_OUT_AMPLIFIED = Rule(1.0, 1.0, cos_diff_tol=1e-5, cos_dtype=torch.float32)
PREFILL_LSE_AMPLIFIED = Rule(abs_tol=1e-5, rel_tol=4.01 / 65536)


def flashmla_allclose(name: str, ans: torch.Tensor, ref: torch.Tensor, rule: Rule) -> list[str]:
    """FlashMLA's check (kernelkit/compare.py check_is_allclose), as failures (empty: passed).

    Both tensors (same shape and dtype) are compared in float32: +inf, -inf and NaN must stand at
    the same places in both (then count as 0); every element must have ``|a - r| < abs_tol`` or
    ``|a - r| / (|r| + 1e-6) < rel_tol`` (FlashMLA's masked form of the same condition); and the
    cosine difference ``1 - 2 a.r / (a.a + r.r)`` (0 when ``r.r < 1e-12``), computed in
    ``rule.cos_dtype``, must not exceed ``cos_diff_tol`` in magnitude.
    """
    assert ans.shape == ref.shape, f"{name}: shape {tuple(ans.shape)} vs {tuple(ref.shape)}"
    assert ans.dtype == ref.dtype, f"{name}: dtype {ans.dtype} vs {ref.dtype}"
    a, r = ans.float().clone(), ref.float().to(ans.device).clone()
    failures = []
    for special in (float("inf"), float("-inf"), float("nan")):
        am = torch.isnan(a) if math.isnan(special) else a == special
        rm = torch.isnan(r) if math.isnan(special) else r == special
        if not torch.equal(am, rm):
            failures.append(
                f"{name}: {special} at {int(am.sum())} places, the reference at {int(rm.sum())}"
            )
        a[am], r[rm] = 0.0, 0.0
    if failures:
        return failures
    ac, rc = a.to(rule.cos_dtype), r.to(rule.cos_dtype)
    rr = (rc * rc).sum().item()
    cos = 0.0 if rr < 1e-12 else 1 - 2 * (ac * rc).sum().item() / (rr + (ac * ac).sum().item())
    diff = (a - r).abs()
    rel = diff / (r.abs() + 1e-6)
    bad = ~((diff < rule.abs_tol) | (rel < rule.rel_tol))
    if bad.any():
        i = int(torch.argmax(torch.where(bad, diff, torch.zeros_like(diff))))
        failures.append(
            f"{name}: {int(bad.sum())} of {bad.numel()} elements outside abs {rule.abs_tol:g} / "
            f"rel {rule.rel_tol:.4g} (worst {a.reshape(-1)[i].item():.6g} vs "
            f"{r.reshape(-1)[i].item():.6g}); cos diff {cos:.3g}"
        )
    elif abs(cos) > rule.cos_diff_tol:
        failures.append(f"{name}: cos diff {cos:.3g} > {rule.cos_diff_tol:g}")
    return failures


def flashmla_lse(lse: torch.Tensor) -> torch.Tensor:
    """This API's LSE in FlashMLA's convention: +inf, not -inf, where nothing is attended."""
    return torch.where(torch.isneginf(lse), torch.full_like(lse, float("inf")), lse)


def test_rule_is_flashmlas():
    """The rule passes an element within abs_tol or within rel_tol, fails one outside both,
    fails misplaced inf/NaN, and fails a uniform drift that every element passes but the
    cosine does not (FlashMLA's decode output rule)."""
    ref = torch.tensor([0.0, 100.0, 0.5, float("inf"), float("-inf"), float("nan")])
    assert flashmla_allclose("x", ref.clone(), ref, DECODE_OUT) == []
    ok = ref.clone()
    ok[0], ok[1] = 9e-4, 101.5  # abs 9e-4 < 1e-3; rel 0.015 < 2.01/128
    elementwise = dataclasses.replace(DECODE_OUT, cos_diff_tol=1.0)
    assert flashmla_allclose("x", ok, ref, elementwise) == []
    bad = ref.clone()
    bad[2] = 0.5 + 0.0081  # abs 8.1e-3 and rel 0.0162: outside both
    assert "1 of 6 elements" in flashmla_allclose("x", bad, ref, elementwise)[0]
    for i, v in ((3, 1.0), (4, float("inf")), (5, 0.0)):
        moved = ref.clone()
        moved[i] = v
        assert "places" in flashmla_allclose("x", moved, ref, elementwise)[0]
    drift = torch.linspace(1, 2, 64)
    assert flashmla_allclose("x", drift * 1.01, drift, DECODE_OUT)[0].startswith("x: cos diff")
    assert flashmla_allclose("x", drift * 1.001, drift, DECODE_OUT) == []
    tiny = torch.full((4,), 1e-7)
    assert flashmla_allclose("x", tiny * 5, tiny, DECODE_OUT) == []  # |r|^2 < 1e-12: no cosine


# ----------------------------------------------------------------------------------------------
# What cannot be expressed

NOT_EXPRESSIBLE = {
    "max_logits": (
        "flash_mla_sparse_fwd returns (out, max_logits, lse) and FlashMLA's prefill test checks "
        "max_logits (abs 1e-6, rel 2.01/65536); sparse_mla returns out and the LSE only, so "
        "max_logits is not compared"
    ),
    "v41_fp8_cache": (
        f"tests/test-sparse-decode.py at {FLASHMLA_V41_DECODE[:7]} runs every decode case on "
        "DeepSeek-V4.1's 528-byte record (512 e4m3 values, RoPE quantized too, 16 ue8m0 scales "
        "of 32 values, interleaved per token); no kv_format reads it"
    ),
    "v41_fp4_extra_cache": (
        "the same script's extra cache in 288-byte fp4 rows (e2m1 pairs, e4m3 scales per 16): "
        "no kv_format reads e2m1, and the extra cache must share kv_cache's kv_format"
    ),
    "kv_heads": (
        "FlashMLA's prefill takes kv [s_kv, h_kv, d] and indices [s_q, h_kv, topk]; sparse_mla "
        "has one latent head per row (a 3-D cache is paged). FlashMLA's tests use h_kv = 1 only, "
        "which is what is ported"
    ),
}


def test_not_expressible_max_logits():
    """No argument asks for max logits, and the LSE call returns exactly (out, lse)."""
    params = inspect.signature(sparse_mla).parameters
    assert not [p for p in params if "logit" in p or p.startswith("max") or "_max" in p]
    q = torch.randn(2, 2, V4_D, device=DEVICE).to(CPU_DTYPE)
    cache = torch.randn(8, V4_D, device=DEVICE).to(CPU_DTYPE)
    idx = torch.tensor([[0, 3], [5, -1]], dtype=torch.int32, device=DEVICE)
    res = sparse_mla(q, cache, idx, 0.5, return_lse=True)
    assert isinstance(res, tuple) and len(res) == 2


@pytest.mark.parametrize("row_bytes", [528, 288])
def test_not_expressible_v41_records(row_bytes):
    """No kv_format takes V4.1's 528-byte or fp4 288-byte rows: every format refuses them."""
    assert set(KV_FORMATS) == {"auto", "fp8", "fp8_ds_mla", "fp8_ds_mla_v4"}
    q = torch.randn(2, 4, V4_D, device=DEVICE).to(CPU_DTYPE)
    cache = torch.zeros(2, 4, row_bytes, dtype=torch.uint8, device=DEVICE)
    idx = torch.zeros(2, 3, dtype=torch.int32, device=DEVICE)
    for fmt in KV_FORMATS:
        kw = {"k_scale": 1.0} if fmt == "fp8" else {}
        with pytest.raises((ValueError, TypeError)):
            sparse_mla(q, cache, idx, 0.5, kv_format=fmt, **kw)


def test_not_expressible_kv_heads():
    """A 3-D cache is pages: [s_kv, 2, d] reads as s_kv pages of 2 rows, not two kv heads."""
    g = torch.Generator().manual_seed(3)
    q = torch.randn(1, 2, V4_D, generator=g).to(CPU_DTYPE).to(DEVICE)
    kv = torch.randn(4, 2, V4_D, generator=g).to(CPU_DTYPE).to(DEVICE)
    idx = torch.tensor([[3]], dtype=torch.int32, device=DEVICE)  # row 3 = page 1, slot 1
    out = sparse_mla(q, kv, idx, 0.5)
    assert torch.equal(out[0, 0], kv[1, 1]) and torch.equal(out[0, 1], kv[1, 1])


# ----------------------------------------------------------------------------------------------
# The grids, as data


@dataclasses.dataclass(frozen=True)
class DecodeCase:
    """A ``RawTestParamForDecode`` of FlashMLA's decode grid (h_kv = 1, d_v = 512)."""

    seed: int
    group: str  # "correctness", "corner", "performance"
    b: int
    h_q: int
    s_q: int
    s_k: int
    is_varlen: bool
    topk: int
    d_qk: int = V32_D
    block_size: int = 64
    extra_s_k: int | None = None
    extra_topk: int | None = None
    extra_block_size: int | None = None
    have_topk_length: bool = False
    have_extra_topk_length: bool = False
    attn_sink: bool = True
    all_invalid: bool = False
    zero_seqlen: bool = False

    @property
    def kv_format(self) -> str:
        return "fp8_ds_mla" if self.d_qk == V32_D else "fp8_ds_mla_v4"

    @property
    def id(self) -> str:
        s = f"{self.group[:4]}{self.seed}-{'v32' if self.d_qk == V32_D else 'v4'}"
        s += f"-b{self.b}h{self.h_q}q{self.s_q}-k{self.s_k}/{self.topk}p{self.block_size}"
        if self.extra_topk is not None:
            s += f"+x{self.extra_s_k}/{self.extra_topk}p{self.extra_block_size}"
        flags = "V" * self.is_varlen + "L" * self.have_topk_length
        flags += "E" * self.have_extra_topk_length + "S" * self.attn_sink
        flags += "I" * self.all_invalid + "Z" * self.zero_seqlen
        return s + (f"-{flags}" if flags else "")


MAIN_SHAPES = [(512, 64, 2), (512, 64, 64), (512, 64, 69), (1024, 576, 2), (1024, 576, 61)]
MAIN_SHAPES += [(2046, 2048, 2), (2046, 2048, 64), (2046, 2048, 576)]
CORNER_SHAPES = [(512, 64, 61), (650, 576, 53)]


def decode_grid() -> list[DecodeCase]:
    """tests/test_flash_mla_sparse_decoding.py gen_testcase at FLASHMLA_COMMIT, in its order
    (correctness, corner, performance); ``seed`` is the position, as FlashMLA's counter."""
    raw: list[dict] = []
    corner: list[dict] = []
    for d_qk in (V32_D, V4_D):
        for extra in [False, True] if d_qk == V4_D else [False]:
            for extra_len in [False, True] if extra else [False]:
                for topk_len in [False, True] if d_qk == V4_D else [False]:
                    for h_q in (64, 128):
                        common = dict(d_qk=d_qk, h_q=h_q, have_topk_length=topk_len)
                        common["have_extra_topk_length"] = extra_len
                        # With b=74 and no lengths, FlashMLA also runs equal lengths (no split)
                        both = not topk_len and not extra_len
                        for shapes, bs_list, sq_list, corner_flags in (
                            (MAIN_SHAPES, (4, 74, 321), (1, 3), None),
                            (CORNER_SHAPES, (4, 74, 321), (3,), True),
                        ):
                            xs = shapes if extra else [(None, None, None)]
                            for s_k, topk, page in shapes:
                                for xs_k, xtopk, xpage in xs:
                                    for b in bs_list:
                                        for s_q in sq_list:
                                            for varlen in (
                                                [True, False] if b == 74 and both else [True]
                                            ):
                                                c = dict(
                                                    common,
                                                    b=b,
                                                    s_q=s_q,
                                                    s_k=s_k,
                                                    is_varlen=varlen,
                                                    topk=topk,
                                                    block_size=page,
                                                    extra_s_k=xs_k,
                                                    extra_topk=xtopk,
                                                    extra_block_size=xpage,
                                                )
                                                if corner_flags is None:
                                                    raw.append(dict(c, group="correctness"))
                                                    continue
                                                for inv in (True, False):
                                                    for zero in (True, False):
                                                        for sink in (True, False):
                                                            if inv or zero or sink:
                                                                corner.append(
                                                                    dict(
                                                                        c,
                                                                        group="corner",
                                                                        all_invalid=inv,
                                                                        zero_seqlen=zero,
                                                                        attn_sink=sink,
                                                                    )
                                                                )
    perf: list[dict] = []
    v32 = dict(h_q=128, s_q=2, s_k=32768, is_varlen=True, topk=2048, d_qk=V32_D)
    model1 = dict(s_q=2, s_k=16384, is_varlen=True, topk=128, d_qk=V4_D, extra_s_k=16384)
    model1 |= dict(block_size=256, extra_block_size=64)
    configs = [
        (v32, (2, 64, 74, 128)),
        (dict(model1, h_q=64, extra_topk=512), (2, 64, 74, 128, 148, 256)),
        (dict(model1, h_q=128, extra_topk=1024), (2, 64, 74, 128, 148, 256)),
    ]
    for h_q in (64, 128):
        e = dict(model1, h_q=h_q, extra_topk=1024, extra_block_size=2)
        configs.append((dict(e, have_extra_topk_length=True), (2, 64, 74, 128, 148, 256)))
    for base, bszs in configs:
        perf += [dict(base, b=b, group="performance") for b in bszs]
    for h_q in (64, 128):
        for d_qk in (V4_D, V32_D):
            perf.append(
                dict(b=148, h_q=h_q, s_q=2, s_k=32768, is_varlen=True, topk=16384, d_qk=d_qk)
                | dict(group="performance")
            )
    cases = raw + corner + perf
    return [DecodeCase(seed=i, **c) for i, c in enumerate(cases)]


@dataclasses.dataclass(frozen=True)
class PrefillCase:
    """A prefill ``TestParam`` (h_kv = 1, d_v = 512); ``source`` names the script version."""

    seed: int
    group: str
    s_q: int
    s_kv: int
    topk: int
    h_q: int
    d_qk: int
    attn_sink: bool = False
    have_topk_length: bool = False
    all_invalid: bool = False
    check: bool = True  # FlashMLA's check_correctness (False: only sampled rows here)
    amplified: bool = False  # k_amplifier_portion 0.02, k_amplifier_ratio 2^8
    source: str = FLASHMLA_COMMIT

    @property
    def rules(self) -> tuple[Rule, Rule]:
        if self.amplified:
            return PREFILL_OUT_AMPLIFIED, PREFILL_LSE_AMPLIFIED
        if self.source == FLASHMLA_V41_PREFILL:
            return PREFILL_OUT_V41, PREFILL_LSE
        return PREFILL_OUT, PREFILL_LSE

    @property
    def id(self) -> str:
        s = f"{self.group[:4]}{self.seed}-d{self.d_qk}h{self.h_q}-q{self.s_q}-k{self.s_kv}/{self.topk}"
        flags = "S" * self.attn_sink + "L" * self.have_topk_length + "I" * self.all_invalid
        flags += "A" * self.amplified + "N" * (not self.check)
        return s + (f"-{flags}" if flags else "")


REGULAR = [(128, 128), (256, 256), (512, 512)]
IRREGULAR = [(592, 128), (1840, 256), (1592, 384), (1521, 512)]
OOB = [(95, 128), (153, 256), (114, 384)]


def prefill_grid() -> list[PrefillCase]:
    """tests/test_flash_mla_sparse_prefill.py's __main__ at FLASHMLA_COMMIT, in order, then the
    cases tests/test-sparse-prefill.py at FLASHMLA_V41_PREFILL added (amplified K rows, top-k
    640). FlashMLA's own loop over ``have_sink_lse`` does not change the case; it is kept (each
    copy another seed), as FlashMLA runs it."""
    c: list[dict] = []
    for d in (512, 576):
        for h in (128, 64):
            for s_kv, topk in REGULAR + IRREGULAR + OOB:
                for s_q in (1, 62, 213):
                    c.append(
                        dict(group="correctness", s_q=s_q, s_kv=s_kv, topk=topk, h_q=h, d_qk=d)
                    )
    for d in (512, 576):
        for h in (128, 64):
            for s_kv, topk in IRREGULAR + OOB:
                for s_q in (62, 213):
                    for _have_sink_lse in (False, True):
                        for sink in (False, True):
                            for tl in (False, True):
                                c.append(
                                    dict(group="features", s_q=s_q, s_kv=s_kv, topk=topk, h_q=h)
                                    | dict(d_qk=d, attn_sink=sink, have_topk_length=tl)
                                )
    feat = dict(attn_sink=True, have_topk_length=True)
    for d in (512, 576):
        for h in (128, 64):
            for s_q, s_kv, topk in [(1, 128, 128), (1, 256, 256), (1234, 4321, 4096)] + [
                (4096, 2048, 2048)
            ]:
                c.append(dict(group="corner", s_q=s_q, s_kv=s_kv, topk=topk, h_q=h, d_qk=d) | feat)
                c[-1]["all_invalid"] = True
    for d in (512, 576):
        for h in (128, 64):
            for s_kv, topk in [(32, 2048), (64, 8192)]:
                for s_q in (1, 1024):
                    c.append(
                        dict(group="corner", s_q=s_q, s_kv=s_kv, topk=topk, h_q=h, d_qk=d) | feat
                    )
    for d in (512, 576):
        for h in (128, 64):
            c.append(dict(group="corner", s_q=70000, s_kv=256, topk=256, h_q=h, d_qk=d) | feat)
            c[-1]["check"] = False
    for d, h, topk, s_kvs in [
        (576, 128, 2048, [8192, 32768, 65536, 98304, 131072]),
        (512, 64, 512, [8192, 32768, 49152, 65536]),
        (512, 128, 1024, [8192, 32768, 49152, 65536]),
    ]:
        for s_kv in s_kvs:
            c.append(
                dict(group="performance", s_q=4096, s_kv=s_kv, topk=topk, h_q=h, d_qk=d)
                | dict(attn_sink=True)
            )
    # FLASHMLA_V41_PREFILL's additions (d_qk 512 only there)
    new = dict(source=FLASHMLA_V41_PREFILL, d_qk=512)
    for h in (128, 64):
        for s_kv, topk in IRREGULAR + OOB:
            for s_q in (62, 213):
                for sink in (False, True):
                    for tl in (False, True):
                        c.append(dict(group="features", s_q=s_q, s_kv=s_kv, topk=topk, h_q=h) | new)
                        c[-1] |= dict(attn_sink=sink, have_topk_length=tl, amplified=True)
    for h in (128, 64):
        for s_q, s_kv, topk in [(1, 128, 128), (1, 256, 256), (1234, 4321, 4096)] + [
            (4096, 2048, 2048)
        ]:
            c.append(dict(group="corner", s_q=s_q, s_kv=s_kv, topk=topk, h_q=h) | new | feat)
            c[-1] |= dict(all_invalid=True, amplified=True)
    for h in (64, 128):
        for s_kv in (4096, 8192, 32768):
            c.append(
                dict(group="performance", s_q=4096, s_kv=s_kv, topk=640, h_q=h, attn_sink=True)
                | new
            )
    return [PrefillCase(seed=i, **x) for i, x in enumerate(c)]


def test_grids_are_flashmlas():
    """The grids hold FlashMLA's case counts, counted independently from its loops: decode 3680
    correctness, 1036 corner and 32 performance cases; prefill 617 (FLASHMLA_COMMIT) + 126."""
    dec = decode_grid()
    count = {g: sum(c.group == g for c in dec) for g in ("correctness", "corner", "performance")}
    # correctness per head count: 8 shapes (64 with an extra set) x (b=4: 2, b=74: 2 or 4,
    # b=321: 2 s_q values); corner: 2 shapes (4) x (1 + 2 or 1 + 1) batches x 7 flag sets
    v32 = 8 * 8
    v4 = 8 * 8 + 8 * 6 + 64 * 8 + 3 * 64 * 6
    assert count["correctness"] == 2 * (v32 + v4)
    corner_v32 = 2 * 4 * 7
    corner_v4 = 2 * 4 * 7 + 2 * 3 * 7 + 4 * 4 * 7 + 3 * 4 * 3 * 7
    assert count["corner"] == 2 * (corner_v32 + corner_v4)
    assert count["performance"] == 4 + 4 * 6 + 4
    assert len({c.id for c in dec}) == len(dec)
    assert {c.block_size for c in dec} == {2, 53, 61, 64, 69, 256, 576}
    v4_cases = [c for c in dec if c.d_qk == V4_D]
    assert all(c.extra_topk is None for c in dec if c.d_qk == V32_D)
    assert {c.extra_block_size for c in v4_cases} == {None, 2, 53, 61, 64, 69, 576}
    pre = prefill_grid()
    main = [c for c in pre if c.source == FLASHMLA_COMMIT]
    assert len(main) == 120 + 2 * 2 * 7 * 2 * 2 * 2 * 2 + 16 + 16 + 4 + 13
    assert len(pre) - len(main) == 2 * 7 * 2 * 2 * 2 + 8 + 6
    assert sum(not c.check for c in pre) == 4 and len({c.id for c in pre}) == len(pre)


# ----------------------------------------------------------------------------------------------
# Inputs, as FlashMLA's tests/lib.py generates them (own code, same distributions)


def gen(seed: int) -> torch.Generator:
    g = torch.Generator(device=DEVICE)
    g.manual_seed(seed)
    return g


def non_contiguous(x: torch.Tensor) -> torch.Tensor:
    """A copy of ``x`` inside a bigger allocation (kernelkit's non_contiguousify: +1 on every
    dimension, +128 on the last)."""
    big = torch.empty(
        [n + (128 if i == x.dim() - 1 else 1) for i, n in enumerate(x.shape)],
        dtype=x.dtype,
        device=x.device,
    )
    view = big[tuple(slice(0, n) for n in x.shape)]
    view.copy_(x)
    return view


def distinct_picks(
    ranges: torch.Tensor, k: int, fillers: list[int], g: torch.Generator
) -> torch.Tensor:
    """int32 [R, k]: row r holds min(k, ranges[r]) distinct values of [0, ranges[r]) in random
    order, the rest random choices of ``fillers`` (lib.py's _randperm_batch)."""
    r = ranges.shape[0]
    m = max(int(ranges.max()) if r else 0, k)
    score = torch.rand(r, m, generator=g, device=DEVICE)
    score[torch.arange(m, device=DEVICE)[None, :] >= ranges[:, None]] = float("-inf")
    res = score.topk(k, dim=1).indices
    fill = torch.tensor(fillers, dtype=torch.int64, device=DEVICE)
    pick = fill[torch.randint(0, len(fillers), res.shape, generator=g, device=DEVICE)]
    return torch.where(res >= ranges[:, None], pick, res).to(torch.int32)


def sink_for(h: int, g: torch.Generator) -> torch.Tensor:
    """float32 [h]: N(0, 1), +inf where another N(0, 1) > 0.5, -inf where it is < -0.5."""
    s = torch.randn(h, generator=g, device=DEVICE)
    m = torch.randn(h, generator=g, device=DEVICE)
    s[m > 0.5] = float("inf")
    s[m < -0.5] = float("-inf")
    return s


@dataclasses.dataclass
class IndexSet:
    """One decode index set (kv_scope): its cache, FlashMLA's physical indices [T, W], the
    request-local positions and block table that give the same rows, and per-token counts."""

    cache: torch.Tensor  # [num_blocks, page, bytes] uint8
    physical: torch.Tensor
    positions: torch.Tensor
    block_table: torch.Tensor
    page: int
    counts: torch.Tensor | None  # [T] (FlashMLA's topk_length [b], repeated s_q times)
    lengths: torch.Tensor | None  # [b], FlashMLA's form


def decode_set(c: DecodeCase, s_k, page, topk, have_len, rnd, g) -> IndexSet:
    """generate_one_k_scope: lengths (varlen: max(N(s_k, s_k/2), s_q); some 0), a shuffled block
    table, distinct positions below each length padded with -1 (all -1 when all_invalid),
    optional lengths, then the cache with only the rows a counted entry reaches written."""
    b, t = c.b, c.b * c.s_q
    seqlens = torch.full((b,), s_k, dtype=torch.int64)
    if c.is_varlen:
        for i in range(b):
            seqlens[i] = int(max(rnd.normalvariate(s_k, s_k / 2), c.s_q))
    if c.zero_seqlen:
        seqlens[torch.tensor([rnd.random() < 0.5 for _ in range(b)])] = 0
    align = 4 * page
    per_req = max(-(-int(seqlens.max()) // align), 1) * align // page
    table = torch.randperm(b * per_req, generator=g, device=DEVICE).view(b, per_req).int()
    if c.all_invalid:
        pos = torch.full((t, topk), -1, dtype=torch.int32, device=DEVICE)
    else:
        ranges = seqlens.to(DEVICE).repeat_interleave(c.s_q)
        pos = distinct_picks(ranges, topk, [-1], g)
    req = torch.arange(b, device=DEVICE).repeat_interleave(c.s_q)
    blk = table.long()[req[:, None], pos.clamp_min(0).long() // page]
    phys = torch.where(pos >= 0, blk * page + pos.long() % page, -1).int()
    lengths = counts = None
    if have_len:
        lengths = torch.randint(0, topk + 1, (b,), generator=g, device=DEVICE).int()
        counts = lengths.repeat_interleave(c.s_q)
    n = b * per_req * page
    rows, valid = physical_rows(phys, n, counts)
    used = torch.unique(rows[valid])
    data = (torch.randn(used.numel(), c.d_qk, generator=g, device=DEVICE) / 10).clamp(-1, 1)
    data = data.to(torch.bfloat16)  # FlashMLA's cache values are bf16 before quantization
    if c.d_qk == V32_D:
        # V32_FP8Sparse: pow2 scales as fp32; blocks one row apart (quant.py's [:, :page] view)
        big = torch.full((b * per_req, page + 1, 656), 0xFF, dtype=torch.uint8, device=DEVICE)
        cache = big[:, :page]
        packed = pack_fp8_ds_mla(data, "pow2")
        cache[used // page, used % page] = packed
    else:
        cache = alloc_fp8_ds_mla_v4(b * per_req, page, device=DEVICE, fill=0xFF)
        write_fp8_ds_mla_v4(cache, used, data)
    return IndexSet(cache, phys, pos, table, page, counts, lengths)


@dataclasses.dataclass
class Problem:
    """One case as this API's call (``args``, ``kwargs``) and FlashMLA's conventions."""

    q: torch.Tensor
    args: tuple
    kwargs: dict
    rules: tuple[Rule, Rule]
    round_ref: bool  # decode: the reference rounded to the output dtype before the rule
    sample: torch.Tensor | None = None  # tokens the reference covers (None: all)
    peer: dict | None = None  # FlashMLA's inputs for its own call


def decode_problem(c: DecodeCase, dtype: torch.dtype) -> Problem:
    """generate_testcase_for_decode: q ~ N(0, 1) clamped to [-1, 1], the sink, the main set and
    (V4) the extra set, scale d_qk^-0.55. Odd seeds go through the block tables."""
    rnd, g = random.Random(c.seed), gen(c.seed)
    t = c.b * c.s_q
    q = torch.randn(t, c.h_q, c.d_qk, generator=g, device=DEVICE).clamp(-1, 1).to(dtype)
    q = non_contiguous(q)
    sink = sink_for(c.h_q, g) if c.attn_sink else None
    main = decode_set(c, c.s_k, c.block_size, c.topk, c.have_topk_length, rnd, g)
    extra = None
    if c.extra_topk is not None:
        extra = decode_set(
            c, c.extra_s_k, c.extra_block_size, c.extra_topk, c.have_extra_topk_length, rnd, g
        )
    kw: dict = dict(kv_format=c.kv_format, attn_sink=sink, valid_counts=main.counts)
    via_table = c.seed % 2 == 1
    req = torch.arange(c.b, dtype=torch.int32, device=DEVICE).repeat_interleave(c.s_q)
    if via_table:
        kw |= dict(block_table=non_contiguous(main.block_table), req_ids=req)
        kw["block_size"] = main.page
    idx = non_contiguous(main.positions if via_table else main.physical)
    if extra is not None:
        kw |= dict(extra_kv_cache=extra.cache, extra_valid_counts=extra.counts)
        kw["extra_indices"] = non_contiguous(extra.positions if via_table else extra.physical)
        if via_table:
            kw |= dict(extra_block_table=extra.block_table, extra_block_size=extra.page)
            kw["req_ids"] = req
    peer = dict(
        q=q.reshape(c.b, c.s_q, c.h_q, c.d_qk),
        k_cache=main.cache.unsqueeze(2).view(torch.float8_e4m3fn),
        indices=main.physical.view(c.b, c.s_q, -1),
        topk_length=main.lengths,
        attn_sink=sink,
        softmax_scale=c.d_qk**-0.55,
    )
    if extra is not None:
        peer |= dict(
            extra_k_cache=extra.cache.unsqueeze(2).view(torch.float8_e4m3fn),
            extra_indices_in_kvcache=extra.physical.view(c.b, c.s_q, -1),
            extra_topk_length=extra.lengths,
        )
    args = (q, main.cache, idx, c.d_qk**-0.55)
    return Problem(q, args, kw, (DECODE_OUT, DECODE_LSE), True, peer=peer)


def prefill_problem(c: PrefillCase, dtype: torch.dtype) -> Problem:
    """generate_testcase: q and kv ~ N(0, 1)/10 plus one uniform offset each in [-0.05, 0.05),
    clamped to [-10, 10]; distinct indices below s_kv, padded (top-k > s_kv) with invalid values
    from -2^31 to 2^31 - 1; all_invalid: tokens with N(0, 1) < -2 get one invalid value
    throughout; lengths uniform in [0, max(topk + 1, 64)) capped at topk; amplified: 2% of the
    rows (drawn with repetition) times U(1, 256); scale 0.5."""
    rnd, g = random.Random(c.seed), gen(c.seed)
    q = torch.randn(c.s_q, c.h_q, c.d_qk, generator=g, device=DEVICE) / 10
    q = (q + (rnd.random() - 0.5) / 10).to(torch.bfloat16).clamp(-10, 10)
    kv = torch.randn(c.s_kv, c.d_qk, generator=g, device=DEVICE) / 10
    kv = (kv + (rnd.random() - 0.5) / 10).to(torch.bfloat16).clamp(-10, 10)
    invalid = [-(2**31), -123456, -1, c.s_kv, 114514, 1919810, 2147480000, 2**31 - 1]
    ranges = torch.full((c.s_q,), c.s_kv, dtype=torch.int64, device=DEVICE)
    idx = distinct_picks(ranges, c.topk, invalid, g)
    if c.all_invalid:
        empty = torch.randn(c.s_q, generator=g, device=DEVICE) < -2
        idx[empty] = rnd.choice(invalid)
    sink = sink_for(c.h_q, g) if c.attn_sink else None
    counts = None
    if c.have_topk_length:
        hi = max(c.topk + 1, 64)
        counts = torch.randint(0, hi, (c.s_q,), generator=g, device=DEVICE).clamp_max(c.topk)
        counts = counts.int()
    if c.amplified:
        sel = torch.randint(0, c.s_kv, (int(c.s_kv * 0.02),), generator=g, device=DEVICE)
        coef = torch.rand(sel.numel(), generator=g, device=DEVICE) * (2**8 - 1) + 1
        kv[sel] *= coef[:, None].to(kv.dtype)
    q, kv = non_contiguous(q.to(dtype)), non_contiguous(kv.to(dtype))
    idx = non_contiguous(idx)
    clean = kv
    kv = non_contiguous(kv)  # the kernel's copy: rows no counted entry reaches are NaN
    rows, valid = physical_rows(idx, c.s_kv, counts)
    unused = torch.ones(c.s_kv, dtype=torch.bool, device=DEVICE)
    unused[rows[valid]] = False
    kv[unused] = float("nan")
    sample = None
    if not c.check:  # FlashMLA only runs it: here 256 tokens of it are compared
        sample = torch.randperm(c.s_q, generator=g, device=DEVICE)[:256].sort().values
    peer = dict(q=q, kv=clean.unsqueeze(1), indices=idx.unsqueeze(1), sm_scale=0.5, attn_sink=sink)
    peer["topk_length"] = counts
    kw = dict(kv_format="auto", attn_sink=sink, valid_counts=counts)
    return Problem(q, (q, kv, idx, 0.5), kw, c.rules, False, sample=sample, peer=peer)


# ----------------------------------------------------------------------------------------------
# Running a case


def reference_for(p: Problem) -> tuple[torch.Tensor, torch.Tensor]:
    """sparse_mla_reference in float64 on the same arguments (on the sampled tokens only); q is
    passed as float64 (the same values), so that the output is not rounded to q's dtype."""
    args, kw = list(p.args), dict(p.kwargs)
    if p.sample is not None:  # sampled before the float64 copy: 70000 tokens x 128 heads is 34 GiB
        s = p.sample
        args[0], args[2] = args[0][s], args[2][s]
        for k in ("valid_counts", "extra_indices", "extra_valid_counts", "req_ids"):
            if kw.get(k) is not None:
                kw[k] = kw[k][s]
    args[0] = args[0].double()
    return sparse_mla_reference(*args, **kw, return_lse=True, compute_dtype=torch.float64)


def judge(out, lse, ref, ref_lse, p: Problem) -> list[str]:
    """FlashMLA's rule for the case, then this package's table, as failures."""
    out_rule, lse_rule = p.rules
    o, ls = (out, lse) if p.sample is None else (out[p.sample], lse[p.sample])
    r = ref.to(o.dtype) if p.round_ref else ref.float()
    a = o if p.round_ref else o.float()
    fails = flashmla_allclose("out", a, r, out_rule)
    fails += flashmla_allclose("lse", flashmla_lse(ls), flashmla_lse(ref_lse), lse_rule)
    own = compare_sparse_mla(out, ref, lse=lse, ref_lse=ref_lse, rows=p.sample)
    return fails + [f"table: {f}" for f in own.failures]


def run_ours(p: Problem) -> tuple[torch.Tensor, torch.Tensor]:
    t, h = p.q.shape[:2]
    out = torch.full((t, h, DV), float("nan"), dtype=p.q.dtype, device=DEVICE)
    res, lse = sparse_mla(*p.args, **p.kwargs, out=out, return_lse=True)
    assert res is out
    return out, lse


def check_case(p: Problem, what: str) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    out, lse = run_ours(p)
    ref, ref_lse = reference_for(p)
    fails = judge(out, lse, ref, ref_lse, p)
    assert not fails, f"{what}: " + "; ".join(fails)
    return out, lse, ref, ref_lse


# ----------------------------------------------------------------------------------------------
# Without a GPU: a few cases of each grid, shrunk


def shrink_decode(c: DecodeCase) -> DecodeCase:
    """The case at 1/16 of its lengths and top-k widths (ratios kept: top-k past the lengths
    stays past them), at most 2 requests (3 for 321), 2 or 4 heads; page sizes unchanged."""

    def k(x):
        return None if x is None else max(2, x // 16)

    return dataclasses.replace(
        c,
        b=min(c.b, 3 if c.b == 321 else 2),
        h_q=2 if c.h_q == 64 else 4,
        s_k=k(c.s_k),
        topk=k(c.topk),
        extra_s_k=k(c.extra_s_k),
        extra_topk=k(c.extra_topk),
    )


def shrink_prefill(c: PrefillCase) -> PrefillCase:
    """1/16 of s_kv and top-k, at most 4 query tokens, 2 or 4 heads."""
    return dataclasses.replace(
        c,
        s_q=min(c.s_q, 4),
        s_kv=max(2, c.s_kv // 16),
        topk=max(2, c.topk // 16),
        h_q=2 if c.h_q == 64 else 4,
        check=True,
    )


def _first(grid, **want):
    for c in grid:
        if all(getattr(c, k) == v for k, v in want.items()):
            return c
    raise LookupError(want)


def cpu_decode_cases() -> list[DecodeCase]:
    """V3.2 and V4, every page size kind (2, 61, 69, 576), extra set with and without lengths,
    equal lengths, an empty request, all -1, sink off, a production configuration."""
    g = decode_grid()
    picks = [
        _first(g, d_qk=576, h_q=128, s_k=1024, block_size=61, b=4, s_q=3),
        _first(g, d_qk=576, h_q=64, s_k=512, block_size=69, b=74, s_q=1, is_varlen=False),
        _first(g, d_qk=512, extra_topk=None, have_topk_length=True, s_k=2046, block_size=576),
        _first(g, d_qk=512, extra_s_k=1024, extra_block_size=61, s_k=512, block_size=2, b=4),
        _first(
            g,
            d_qk=512,
            have_topk_length=True,
            have_extra_topk_length=True,
            s_k=2046,
            block_size=64,
            extra_s_k=512,
            extra_block_size=69,
            b=4,
            s_q=3,
        ),
        _first(g, group="corner", d_qk=576, s_k=650, all_invalid=True, zero_seqlen=True, b=4),
        _first(
            g,
            group="corner",
            d_qk=512,
            s_k=512,
            extra_s_k=650,
            all_invalid=False,
            zero_seqlen=True,
            attn_sink=False,
            have_extra_topk_length=True,
        ),
        _first(g, group="performance", d_qk=512, extra_block_size=2, h_q=128, b=2),
    ]
    return [shrink_decode(c) for c in picks]


def cpu_prefill_cases() -> list[PrefillCase]:
    g = prefill_grid()
    picks = [
        _first(g, group="correctness", d_qk=576, h_q=128, s_kv=95, s_q=62),
        _first(g, group="correctness", d_qk=512, h_q=64, s_kv=1592, s_q=1),
        _first(g, group="features", d_qk=576, s_kv=153, attn_sink=True, have_topk_length=True),
        _first(g, group="features", amplified=True, s_kv=1840, attn_sink=True),
        _first(g, group="corner", d_qk=576, s_kv=128, all_invalid=True),
        _first(g, group="corner", d_qk=512, s_kv=32, s_q=1024),
    ]
    return [shrink_prefill(c) for c in picks]


@pytest.mark.parametrize("case", [pytest.param(c, id=c.id) for c in cpu_decode_cases()])
def test_decode_shrunk(case):
    check_case(decode_problem(case, DTYPE), case.id)


@pytest.mark.parametrize("case", [pytest.param(c, id=c.id) for c in cpu_prefill_cases()])
def test_prefill_shrunk(case):
    check_case(prefill_problem(case, DTYPE), case.id)


def flashmla_semantics(p: Problem, d_qk: int, decode: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """What FlashMLA computes from its own inputs (``p.peer``), by tests/ref.py's definitions
    (ref_sparse_attn_decode / ref_sparse_attn_fwd) in float64: physical indices, -1 (decode) or
    anything outside [0, s_kv) (prefill) skipped, lengths per request (decode) or per token,
    the sink scaling the output by 1 / (1 + e^(sink - lse)), LSE +inf where nothing is
    attended. Returns (out [T, H, 512], lse [T, H]) in this API's layout. Independent of
    ``sparse_mla_reference``'s index handling: it checks the mapping of each case."""
    from triton_mla_sparse.kv_format import dequantize_cache

    pe = p.peer
    fmt = "fp8_ds_mla" if d_qk == V32_D else "fp8_ds_mla_v4"

    def gather(cache, idx, lengths):  # idx [T, W] -> (rows [T, W, d], skipped [T, W])
        if decode:
            u8 = cache.view(torch.uint8).squeeze(2)
            rows = dequantize_cache(u8, fmt).reshape(-1, d_qk).double()
            skip = idx == -1
        else:
            rows = cache[:, 0].double()
            skip = (idx < 0) | (idx >= rows.shape[0])
        if lengths is not None:
            per_token = lengths.repeat_interleave(idx.shape[0] // lengths.shape[0])
            skip |= torch.arange(idx.shape[1], device=idx.device)[None, :] >= per_token[:, None]
        g = rows[torch.where(skip, 0, idx).long()]
        return torch.where(skip[..., None], 0.0, g), skip

    q = pe["q"].reshape(-1, pe["q"].shape[-2], d_qk).double()
    if decode:
        t = q.shape[0]
        k, skip = gather(pe["k_cache"], pe["indices"].reshape(t, -1), pe["topk_length"])
        if "extra_k_cache" in pe:
            xi = pe["extra_indices_in_kvcache"].reshape(t, -1)
            xk, xskip = gather(pe["extra_k_cache"], xi, pe["extra_topk_length"])
            k, skip = torch.cat([k, xk], 1), torch.cat([skip, xskip], 1)
        scale = pe["softmax_scale"]
    else:
        k, skip = gather(pe["kv"], pe["indices"][:, 0], pe["topk_length"])
        scale = pe["sm_scale"]
    s = torch.einsum("thd,twd->thw", q, k) * scale
    s = s.masked_fill(skip[:, None, :], float("-inf"))
    lse = torch.logsumexp(s, dim=-1)
    w = torch.exp(s - torch.where(torch.isinf(lse), 0.0, lse)[..., None])
    out = torch.einsum("thw,twd->thd", w, k[..., :DV])
    if pe["attn_sink"] is not None:
        out = out / (1 + torch.exp(pe["attn_sink"].double()[None, :] - lse))[..., None]
    lonely = torch.isneginf(lse)
    out[lonely] = 0.0
    return out, lse.masked_fill(lonely, float("inf"))


def _check_semantics(p: Problem, d_qk: int, decode: bool) -> None:
    fm_out, fm_lse = flashmla_semantics(p, d_qk, decode)
    ref, ref_lse = reference_for(dataclasses.replace(p, sample=None))
    torch.testing.assert_close(fm_out, ref.double(), rtol=1e-9, atol=1e-12)
    torch.testing.assert_close(fm_lse, flashmla_lse(ref_lse).double(), rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("case", [pytest.param(c, id=c.id) for c in cpu_decode_cases()])
def test_decode_mapping_is_flashmlas_problem(case):
    """FlashMLA's own inputs for the case, computed by its definitions, give the reference's
    result on this API's inputs: the translation (physical indices or block tables, lengths per
    request, the paged records) states the same problem."""
    p = decode_problem(case, DTYPE)
    _check_semantics(p, case.d_qk, decode=True)
    # and the kernel's input is poisoned outside what the entries reach: 0xFF bytes there
    assert (p.args[1].view(torch.uint8) == 0xFF).any()


@pytest.mark.parametrize("case", [pytest.param(c, id=c.id) for c in cpu_prefill_cases()])
def test_prefill_mapping_is_flashmlas_problem(case):
    p = prefill_problem(case, DTYPE)
    _check_semantics(p, case.d_qk, decode=False)


# ----------------------------------------------------------------------------------------------
# On a GPU: the whole grids at FlashMLA's sizes (bf16), and FlashMLA itself where it runs


@pytest.fixture(autouse=True)
def _return_gpu_memory():
    """After each case, hand the memory its tensors held back to the GPU: the grid runs in many
    processes on one GPU, and FlashMLA's larger cases (a 7 GB cache, a 16384-wide top-k) would
    otherwise stay reserved by one process's caching allocator while the others run out."""
    yield
    if HAS_GPU:
        torch.cuda.empty_cache()


def _flashmla():
    """vLLM's FlashMLA interface module, or the reason it cannot run here (a string)."""
    from triton_mla_sparse.peers import flashmla

    try:
        return flashmla.load()
    except flashmla.PeerUnavailable as e:
        return str(e)


class FlashMLANotCompared(UserWarning):
    """The case passed against the reference; FlashMLA's own call did not run beside it."""


_told_unavailable = False


def check_against_flashmla(p: Problem, out, lse, ref, ref_lse, decode: bool, what: str) -> None:
    """FlashMLA's own call on the case: its output must pass its own rule against the float64
    reference (the case is the same problem), and ours must agree with it within the bf16
    table. Called after the case passed against the reference, which is the conformance bar:
    where FlashMLA does not run (not importable, a GPU it has no kernels for, a call its build
    refuses) the case stands on that check, and a warning says FlashMLA was not compared (once
    per process when it cannot be imported at all)."""
    global _told_unavailable
    fm = _flashmla()
    if isinstance(fm, str):
        if not _told_unavailable:
            _told_unavailable = True
            warnings.warn(f"FlashMLA not compared: {fm}", FlashMLANotCompared, stacklevel=2)
        return
    pe = dict(p.peer)
    try:
        if decode:
            meta, _ = fm.get_mla_metadata()
            q = pe.pop("q").contiguous()
            fm_out, fm_lse = fm.flash_mla_with_kvcache(
                q, pe.pop("k_cache"), None, None, DV, meta, None, is_fp8_kvcache=True, **pe
            )
            t = q.shape[0] * q.shape[1]
            fm_out = fm_out.reshape(t, q.shape[2], DV)
            fm_lse = fm_lse.transpose(1, 2).reshape(t, q.shape[2])
        else:
            fm_out, _max_logits, fm_lse = fm.flash_mla_sparse_fwd(d_v=DV, **pe)
    except torch.OutOfMemoryError:
        raise  # a matter of the GPU's other tenants: run_sharing_gpu runs the case again alone
    except (RuntimeError, AssertionError, TypeError) as e:
        msg = f"{what}: FlashMLA refuses the call ({type(e).__name__}: {e})"
        warnings.warn(msg, FlashMLANotCompared, stacklevel=2)
        return
    if p.sample is not None:
        fm_out, fm_lse = fm_out[p.sample], fm_lse[p.sample]
        out, lse = out[p.sample], lse[p.sample]
    out_rule, lse_rule = p.rules
    r = ref.to(fm_out.dtype) if p.round_ref else ref.float()
    a = fm_out if p.round_ref else fm_out.float()
    fails = flashmla_allclose("FlashMLA out", a, r, out_rule)
    fails += flashmla_allclose("FlashMLA lse", fm_lse.float(), flashmla_lse(ref_lse), lse_rule)
    fm_lse_ours = torch.where(torch.isposinf(fm_lse), float("-inf"), fm_lse.float())
    own = compare_sparse_mla(out, fm_out, lse=lse, ref_lse=fm_lse_ours)
    fails += [f"ours vs FlashMLA: {f}" for f in own.failures]
    assert not fails, f"{what}: " + "; ".join(fails)


@pytest.mark.gpu
@pytest.mark.conformance_grid
@pytest.mark.skipif(not HAS_GPU, reason="FlashMLA's sizes need a GPU (bf16)")
@pytest.mark.parametrize(
    "case", [pytest.param(c, id=c.id) for c in decode_grid()] if HAS_GPU else []
)
def test_decode_grid(case):
    def body():
        p = decode_problem(case, torch.bfloat16)
        out, lse, ref, ref_lse = check_case(p, case.id)
        check_against_flashmla(p, out, lse, ref, ref_lse, True, case.id)

    run_sharing_gpu(body, case.id)


@pytest.mark.gpu
@pytest.mark.conformance_grid
@pytest.mark.skipif(not HAS_GPU, reason="FlashMLA's sizes need a GPU (bf16)")
@pytest.mark.parametrize(
    "case", [pytest.param(c, id=c.id) for c in prefill_grid()] if HAS_GPU else []
)
def test_prefill_grid(case):
    def body():
        p = prefill_problem(case, torch.bfloat16)
        out, lse, ref, ref_lse = check_case(p, case.id)
        check_against_flashmla(p, out, lse, ref, ref_lse, False, case.id)

    run_sharing_gpu(body, case.id)
