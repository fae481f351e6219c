"""DeepSeek-V4's 584-byte paged record, kv_format "fp8_ds_mla_v4" (kv_format.py).

Without vLLM: the geometry, the scale rule for every positive bf16 amax against exact rational
arithmetic, round-trip bounds, values on the e4m3 x ue8m0 grid round-tripping bit-exactly, edge
cases with their expected bytes, byte offsets, which bytes a write touches, strided views, the
reference reading the format (the kernel's reading of it: tests/test_sparse_mla_v4.py).

With vLLM 0.33 installed: its own Triton writer (models/deepseek_v4/common/ops/cache_utils.py
``quantize_and_insert_k_cache``) and reader (``DequantizeAndGatherKCacheKernel``) run, under Triton's
interpreter on CPU, on caches laid out by vLLM's own allocation code, and must agree with ours
byte for byte (writer) and value for value (reader).
"""

from __future__ import annotations

import math
import os
import struct
import sys
from fractions import Fraction

import numpy as np
import pytest
import torch
from conftest import DEVICE, HAS_GPU, require_vllm

from triton_mla_sparse.kv_format import (
    DS_V4_DATA_BYTES,
    DS_V4_GROUP,
    DS_V4_MIN_AMAX,
    DS_V4_NOPE,
    DS_V4_NUM_SCALES,
    DS_V4_PAGE_ALIGN,
    DS_V4_SCALE_BYTES,
    DS_V4_TOKEN_BYTES,
    DS_V4_WIDTH,
    E4M3_MAX,
    KV_FORMATS,
    REFERENCE_KV_FORMATS,
    UE8M0_BIAS,
    alloc_fp8_ds_mla_v4,
    bytes_per_row,
    dequantize_cache,
    ds_mla_v4_page_stride,
    ds_mla_v4_pages,
    pack_fp8_ds_mla_v4,
    quantize_ds_mla_v4,
    unpack_fp8_ds_mla_v4,
    write_fp8_ds_mla_v4,
)
from triton_mla_sparse.ops.sparse_mla import sparse_mla_plan
from triton_mla_sparse.reference import sparse_mla_reference

if not HAS_GPU and "vllm" not in sys.modules:
    # as tests/plugin/conftest.py: vLLM's CPU platform and the real Triton (not vLLM's
    # placeholder), so vLLM's Triton kernels run under the interpreter tests/conftest.py enables
    os.environ["CUDA_VISIBLE_DEVICES"] = ""
    os.environ.setdefault("VLLM_TARGET_DEVICE", "cpu")

FP32_MIN_AMAX = float(torch.tensor(DS_V4_MIN_AMAX, dtype=torch.float32))  # the floor as fp32
FLOOR_EXPONENT = -22  # ceil(log2(fp32(1e-4) / 448))
BF16_MAX_BITS = 0x7F7F
POISON = 0xA5


def u16(x: torch.Tensor) -> torch.Tensor:
    """The bit patterns of a bf16 tensor as int32 in [0, 65536)."""
    return x.view(torch.int16).int() & 0xFFFF


def bf16_bits(values: list[float]) -> list[int]:
    return u16(torch.tensor(values).to(torch.bfloat16)).tolist()


def raw_bytes(cache: torch.Tensor) -> torch.Tensor:
    """Every byte of the buffer under a cache view (padding and other layers' pages too)."""
    st = cache.untyped_storage()
    return torch.tensor([], dtype=torch.uint8, device=cache.device).set_(st).clone()


def exact_exponent(amax: float) -> int:
    """The smallest e with 448 * 2^e >= max(amax, fp32(1e-4)), in exact rational arithmetic."""
    r = Fraction(max(amax, FP32_MIN_AMAX)) / Fraction(int(E4M3_MAX))
    e = math.floor(math.log2(r))
    while Fraction(2) ** e < r:
        e += 1
    while Fraction(2) ** (e - 1) >= r:
        e -= 1
    return e


def all_positive_bf16() -> torch.Tensor:
    """Every positive finite bf16 value (subnormals included), ascending, as float32."""
    bits = torch.arange(1, BF16_MAX_BITS + 1, dtype=torch.int32).to(torch.int16)
    return bits.view(torch.bfloat16).float()


def hard_rows(n: int, seed: int) -> torch.Tensor:
    """``[n, 512]`` bf16 values (as float32): NoPE groups spanning 10^-8 .. 10^8, with the first
    rows' groups replaced by the edge cases the rule has to get right."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, DS_V4_WIDTH, generator=g)
    mag = 10.0 ** (torch.rand(n, DS_V4_NUM_SCALES, generator=g) * 16 - 8)
    x[:, :DS_V4_NOPE] *= mag.repeat_interleave(DS_V4_GROUP, dim=1)
    x[:, DS_V4_NOPE:] *= 10.0 ** (torch.rand(n, 1, generator=g) * 6 - 3)

    def group(head: list[float], fill_scale: float) -> torch.Tensor:
        rest = torch.rand(DS_V4_GROUP - len(head), generator=g) * 2 - 1
        return torch.cat([torch.tensor(head), rest * fill_scale])

    b448 = 448.0
    edges = [
        torch.zeros(DS_V4_GROUP),  # all zero: the floor's exponent
        torch.tensor([0.0, -0.0] * (DS_V4_GROUP // 2)),  # signed zeros
        group([b448 * 2.0**-10], b448 * 2.0**-10),  # amax exactly on 448 * 2^k
        group([-b448 * 2.0**40], b448 * 2.0**40),
        group([1.7578125 * 2.0**8 * 2.0**5], 2.0**12),  # one bf16 step above 448 * 2^5
        group([1.7421875 * 2.0**8 * 2.0**5], 2.0**12),  # one bf16 step below
        group([5e-5, -3e-6], 1e-5),  # below the 1e-4 floor
        # e4m3 subnormals (scale 1): 2^-9, ties 2^-10 and 3*2^-10 (to even), 2^-7, 7*2^-9
        group([b448, 2.0**-9, 2.0**-10, 3 * 2.0**-10, -(2.0**-10), 2.0**-7, 7 * 2.0**-9], 0.0),
        # e4m3 normal ties (scale 1): 1.0625, 1.1875, 100, 17, -17 round to even
        group([b448, 1.0625, 1.1875, 100.0, 17.0, -17.0, 2.0**-6], 0.0),
        group([float(torch.tensor(3.3895e38).bfloat16())], 1e38),  # bf16's largest: exponent 120
    ]
    for k, e in enumerate(edges[: n * DS_V4_NUM_SCALES]):
        r, j = divmod(k, DS_V4_NUM_SCALES)
        x[r, j * DS_V4_GROUP : (j + 1) * DS_V4_GROUP] = e
    x[0, DS_V4_NOPE : DS_V4_NOPE + 4] = torch.tensor([-0.0, 1e-40, -3.0e38, 2.0**-133])
    return x.bfloat16().float()


# --- geometry -------------------------------------------------------------------------------


def test_geometry():
    assert (DS_V4_DATA_BYTES, DS_V4_SCALE_BYTES, DS_V4_TOKEN_BYTES) == (576, 8, 584)
    assert DS_V4_NUM_SCALES * DS_V4_GROUP == DS_V4_NOPE == 448 and DS_V4_WIDTH == 512
    # the strides the notes and vLLM's comments quote: SWA / C4A pages of 64, C128A pages of 2
    assert ds_mla_v4_page_stride(64) == 37_440 and ds_mla_v4_page_stride(2) == 1_728
    for p in range(1, 130):
        s = ds_mla_v4_page_stride(p)
        assert s % DS_V4_PAGE_ALIGN == 0 and p * 584 <= s < p * 584 + DS_V4_PAGE_ALIGN
    c = alloc_fp8_ds_mla_v4(3, 64, fill=7)
    assert c.shape == (3, 64, 584) and c.stride() == (37_440, 584, 1) and c.dtype == torch.uint8
    assert raw_bytes(c).numel() == 3 * 37_440 and bool((raw_bytes(c) == 7).all())
    assert bytes_per_row("fp8_ds_mla_v4", 512, torch.uint8) == 584
    for bad in (0, -1, 2.0, True):
        with pytest.raises(ValueError, match="page_size"):
            ds_mla_v4_page_stride(bad)


# --- the quantisation rule ------------------------------------------------------------------


def test_scale_byte_for_every_bf16_amax():
    """Each positive finite bf16 value as a group's amax: the scale byte is 127 + the exact
    ceil(log2(max(amax, 1e-4) / 448)), the amax's code is at most 448 and never NaN."""
    amax = all_positive_bf16()
    n_groups = amax.numel()
    n_rows = -(-n_groups // DS_V4_NUM_SCALES)
    groups = torch.zeros(n_rows * DS_V4_NUM_SCALES, DS_V4_GROUP)
    groups[:n_groups, 0] = amax
    groups[:n_groups, 1] = -amax * 0.5  # a smaller value of the other sign
    rows = torch.zeros(n_rows, DS_V4_WIDTH)
    rows[:, :DS_V4_NOPE] = groups.view(n_rows, DS_V4_NOPE)
    codes, scale_bytes, _ = quantize_ds_mla_v4(rows)
    got = scale_bytes.reshape(-1)[:n_groups].int() - UE8M0_BIAS
    want = torch.tensor([exact_exponent(a) for a in amax.tolist()], dtype=torch.int32)
    assert torch.equal(got, want)
    assert int(want.min()) == FLOOR_EXPONENT and int(want.max()) == 120
    first = codes.view(-1, DS_V4_GROUP)[:n_groups, 0]
    assert not bool(((first & 0x7F) == 0x7F).any())  # no NaN code: nothing saturates to NaN
    decoded = first.view(torch.float8_e4m3fn).float()
    assert bool((decoded <= E4M3_MAX).all())
    # from the floor up the amax lands in (224, 448] of its scale (in [224, 448] once rounded)
    above = amax >= FP32_MIN_AMAX
    assert bool((decoded[above] >= 224).all()) and bool((decoded[~above] < 448).all())


def test_zero_and_signed_zero_groups():
    rows = torch.zeros(2, DS_V4_WIDTH)
    rows[1, :DS_V4_NOPE] = -0.0
    rows[1, DS_V4_NOPE:] = -0.0
    codes, scale_bytes, rope = quantize_ds_mla_v4(rows)
    # an all-zero group takes the floor's exponent -22: byte 105, not 127
    assert bool((scale_bytes == UE8M0_BIAS + FLOOR_EXPONENT).all())
    assert bool((codes[0] == 0x00).all()) and bool((codes[1] == 0x80).all())
    back = unpack_fp8_ds_mla_v4(pack_fp8_ds_mla_v4(rows, 2))
    assert bool((back == 0).all())
    assert bool(torch.signbit(back[1]).all()) and not bool(torch.signbit(back[0]).any())
    assert bool((u16(rope[1]) == 0x8000).all())


@pytest.mark.parametrize("k", [-21, -1, 0, 1, 7, 100])
def test_power_of_two_boundary(k):
    """amax = 448 * 2^k takes scale 2^k and code 448; one bf16 step above takes 2^(k+1)."""
    step_up = 1.7578125 * 2.0 ** (8 + k)  # the bf16 value after 1.75 * 2^(8+k) = 448 * 2^k
    step_down = 1.7421875 * 2.0 ** (8 + k)
    rows = torch.zeros(1, DS_V4_WIDTH)
    rows[0, 0] = E4M3_MAX * 2.0**k
    rows[0, DS_V4_GROUP] = step_up
    rows[0, 2 * DS_V4_GROUP] = -step_down
    codes, scale_bytes, _ = quantize_ds_mla_v4(rows)
    assert scale_bytes[0, :3].tolist() == [127 + k, 128 + k, 127 + k]
    c = codes[0].view(DS_V4_NUM_SCALES, DS_V4_GROUP)[:3, 0].tolist()
    # 448 -> 0x7E; 450 * 2^k / 2^(k+1) = 225 -> 224 (0x76); -446 -> -448 (0xFE)
    assert c == [0x7E, 0x76, 0xFE]


def test_floor_below_1e4():
    rows = torch.zeros(1, DS_V4_WIDTH)
    rows[0, :3] = torch.tensor([5e-5, -3e-6, 1e-40])
    codes, scale_bytes, _ = quantize_ds_mla_v4(rows)
    assert scale_bytes[0, 0] == UE8M0_BIAS + FLOOR_EXPONENT
    # scale 2^-22: bf16(5e-5) = 210 * 2^-22 -> 208; bf16(-3e-6) = -12.5625 * 2^-22 -> -13;
    # 1e-40 (a bf16 subnormal) -> +0
    assert codes[0, :3].view(torch.float8_e4m3fn).float().tolist() == [208.0, -13.0, 0.0]


def test_e4m3_rounding_subnormals_and_ties():
    """Scale 1 (amax 448): e4m3 subnormals and ties round to nearest even."""
    vals = [448.0, 2.0**-9, 2.0**-10, 3 * 2.0**-10, -(2.0**-10), 2.0**-7, 7 * 2.0**-9, 2.0**-6]
    vals += [1.0625, 1.1875, 100.0, 17.0, -17.0, 240.0, 232.0]
    rows = torch.zeros(1, DS_V4_WIDTH)
    rows[0, : len(vals)] = torch.tensor(vals)
    codes, scale_bytes, _ = quantize_ds_mla_v4(rows)
    assert scale_bytes[0, 0] == UE8M0_BIAS
    want = [0x7E, 0x01, 0x00, 0x02, 0x80, 0x04, 0x07, 0x08]
    # 1.0625 -> 1.0 (0x38), 1.1875 -> 1.25 (0x3A), 100 -> 96 (0x6C), 17 -> 16 (0x58),
    # -17 -> -16 (0xD8), 240 (0x77), 232 -> 224 (0x76: 232 is the tie 224 | 240)
    want += [0x38, 0x3A, 0x6C, 0x58, 0xD8, 0x77, 0x76]
    assert codes[0, : len(vals)].tolist() == want


def test_bf16_rounding_of_inputs():
    """fp32 input is rounded to bf16 (nearest even) before anything else, rope and NoPE."""
    rope = [1 + 2.0**-8, 1 + 3 * 2.0**-8, 1 + 2.0**-8 + 2.0**-20, -(1 + 2.0**-8)]
    rows = torch.zeros(1, DS_V4_WIDTH)
    rows[0, DS_V4_NOPE : DS_V4_NOPE + 4] = torch.tensor(rope)
    # NoPE: 448 * (1 + 2^-12) is above 448 in fp32 but 448 in bf16: scale 2^0, not 2^1
    rows[0, 0] = E4M3_MAX * (1 + 2.0**-12)
    codes, scale_bytes, r = quantize_ds_mla_v4(rows)
    assert u16(r[0, :4]).tolist() == [
        0x3F80,
        0x3F82,
        0x3F81,
        0xBF80,
    ]
    assert scale_bytes[0, 0] == UE8M0_BIAS and codes[0, 0] == 0x7E
    # a float32 row packs to exactly the bytes of its bf16 rounding
    x = hard_rows(16, 3) * (1 + 2.0**-12)
    assert torch.equal(pack_fp8_ds_mla_v4(x, 4), pack_fp8_ds_mla_v4(x.bfloat16(), 4))


def test_largest_bf16_decodes_to_inf_like_vllm():
    """bf16's largest value needs scale 2^120 and code 256 (255 rounds up): 2^128 is inf in
    fp32, which is also what vLLM's reader computes (fp32 multiply)."""
    rows = torch.zeros(1, DS_V4_WIDTH)
    rows[0, 0] = torch.tensor(BF16_MAX_BITS, dtype=torch.int16).view(torch.bfloat16).float()
    codes, scale_bytes, _ = quantize_ds_mla_v4(rows)
    assert scale_bytes[0, 0] == UE8M0_BIAS + 120 and codes[0, 0] == 0x78  # 256
    assert unpack_fp8_ds_mla_v4(pack_fp8_ds_mla_v4(rows, 1))[0, 0] == float("inf")


def test_round_trip_within_e4m3_resolution():
    x = hard_rows(300, 1)
    back = unpack_fp8_ds_mla_v4(pack_fp8_ds_mla_v4(x, 64))[:300]
    assert torch.equal(back[:, DS_V4_NOPE:], x[:, DS_V4_NOPE:])  # rope: bf16 as given
    nope, got = x[:, :DS_V4_NOPE], back[:, :DS_V4_NOPE]
    _, scale_bytes, _ = quantize_ds_mla_v4(x)
    scale = torch.exp2(scale_bytes.double() - UE8M0_BIAS).float().repeat_interleave(64, dim=1)
    finite = torch.isfinite(got)
    assert int((~finite).sum()) == 1  # only the largest bf16 value (test above)
    # half an e4m3 ulp (2^-4 relative) for normals; half a subnormal step (2^-10 * scale)
    bound = torch.maximum(2.0**-4 * nope.abs(), 2.0**-10 * scale)
    err = (got - nope).abs()
    assert bool((err[finite] <= bound[finite]).all())
    # and the scale is no coarser than needed: amax / scale in (224, 448] from the floor up
    amax = nope.view(300, DS_V4_NUM_SCALES, DS_V4_GROUP).abs().amax(-1)
    s = scale.view(300, DS_V4_NUM_SCALES, DS_V4_GROUP)[..., 0]
    big = amax >= FP32_MIN_AMAX
    assert int(big.sum()) > 1000 and int((~big).sum()) > 100  # both sides of the floor seen
    assert bool((amax[big] / s[big] <= E4M3_MAX).all()) and bool((amax[big] / s[big] > 224).all())


def test_grid_values_round_trip_bit_exactly():
    """e4m3 codes times 2^e, with each group's largest |code| in [240, 448] (so its scale is
    exactly 2^e): pack stores those codes and exponents, unpack returns the values exactly."""
    g = torch.Generator().manual_seed(5)
    n = 64
    all_codes = torch.arange(256, dtype=torch.int32)
    finite = all_codes[(all_codes & 0x7F) != 0x7F]  # the two NaN codes left out
    codes = finite[torch.randint(0, finite.numel(), (n, DS_V4_NOPE), generator=g)]
    codes = codes.view(n, DS_V4_NUM_SCALES, DS_V4_GROUP)
    top = torch.randint(
        0x77, 0x7F, (n, DS_V4_NUM_SCALES), generator=g, dtype=torch.int32
    )  # 240 .. 448
    sign = torch.randint(0, 2, (n, DS_V4_NUM_SCALES), generator=g, dtype=torch.int32) * 0x80
    at = torch.randint(0, DS_V4_GROUP, (n, DS_V4_NUM_SCALES, 1), generator=g)
    codes.scatter_(2, at, (top | sign)[..., None])
    # smaller codes elsewhere so `top` is the amax: clear the magnitude above 0x76 elsewhere
    mag = codes & 0x7F
    keep = torch.zeros_like(codes, dtype=torch.bool).scatter_(2, at, True)
    codes = torch.where(keep | (mag <= 0x76), codes, codes & 0x80 | 0x76)
    e = torch.randint(-21, 111, (n, DS_V4_NUM_SCALES), generator=g)
    code_u8 = codes.to(torch.uint8).view(n, DS_V4_NOPE)
    values = code_u8.view(torch.float8_e4m3fn).float().view(n, DS_V4_NUM_SCALES, DS_V4_GROUP)
    values = values * torch.exp2(e.double()).float()[..., None]
    rows = torch.cat([values.view(n, DS_V4_NOPE), torch.randn(n, 64).bfloat16().float()], 1)
    assert torch.equal(rows.bfloat16().float(), rows)  # grid values are bf16 numbers
    q_codes, scale_bytes, _ = quantize_ds_mla_v4(rows)
    assert torch.equal(q_codes, code_u8)  # -0 codes (0x80) too
    assert torch.equal(scale_bytes.long(), e + UE8M0_BIAS)
    back = unpack_fp8_ds_mla_v4(pack_fp8_ds_mla_v4(rows, 8))[:n]
    assert torch.equal(back, rows) and torch.equal(torch.signbit(back), torch.signbit(rows))


def test_refuses_non_finite_and_bad_rows():
    rows = torch.zeros(2, DS_V4_WIDTH)
    for bad in (float("nan"), float("inf"), 3.4e38):  # 3.4e38 is finite in fp32, inf in bf16
        r = rows.clone()
        r[1, 5] = bad
        with pytest.raises(ValueError, match="finite"):
            pack_fp8_ds_mla_v4(r, 2)
    with pytest.raises(ValueError, match="512"):
        pack_fp8_ds_mla_v4(torch.zeros(2, 576), 2)
    with pytest.raises(TypeError, match="floating"):
        quantize_ds_mla_v4(torch.zeros(2, 512, dtype=torch.int32))
    with pytest.raises(ValueError, match="page_size"):
        pack_fp8_ds_mla_v4(rows, 0)


# --- the byte layout ------------------------------------------------------------------------


def test_byte_offsets():
    """Token i of a page: data row at i*576 (448 codes, 64 little-endian bf16), scale row at
    P*576 + i*8 (7 exponents, pad 0); padding after P*584 bytes; read here with struct."""
    p, n = 3, 7  # three pages, the last one part-filled
    x = hard_rows(n, 2)
    cache = pack_fp8_ds_mla_v4(x, p)
    stride = ds_mla_v4_page_stride(p)
    assert cache.shape == (3, p, 584) and cache.stride() == (stride, 584, 1)
    raw = bytes(raw_bytes(cache).tolist())
    codes, scale_bytes, _ = quantize_ds_mla_v4(x)
    rope_bits = bf16_bits(x[:, DS_V4_NOPE:].reshape(-1).tolist())
    for t in range(n):
        page, i = divmod(t, p)
        base = page * stride
        data = raw[base + i * 576 : base + (i + 1) * 576]
        assert list(data[:448]) == codes[t].tolist()
        assert list(struct.unpack("<64H", data[448:576])) == rope_bits[t * 64 : (t + 1) * 64]
        srow = raw[base + p * 576 + i * 8 : base + p * 576 + (i + 1) * 8]
        assert list(srow[:7]) == scale_bytes[t].tolist() and srow[7] == 0
    # unused slots of the last page and every page's padding are zero
    for page in range(3):
        base = page * stride
        assert set(raw[base + p * 584 : base + stride]) == {0}
    for t in range(n, 3 * p):
        page, i = divmod(t, p)
        assert set(raw[page * stride + i * 576 : page * stride + (i + 1) * 576]) == {0}


def test_write_touches_only_its_bytes():
    """A write into a poisoned cache changes the written tokens' data and scale rows and
    nothing else: other slots and the page padding keep their bytes."""
    p, pages = 4, 3
    x = hard_rows(6, 4)
    slots = torch.tensor([9, 0, -1, 6, 3, 11])
    cache = alloc_fp8_ds_mla_v4(pages, p, fill=POISON)
    write_fp8_ds_mla_v4(cache, slots, x)
    raw = raw_bytes(cache)
    stride = ds_mla_v4_page_stride(p)
    touched = torch.zeros_like(raw, dtype=torch.bool)
    expect = torch.full_like(raw, POISON)
    fresh = raw_bytes(pack_fp8_ds_mla_v4(x, 1))  # each row alone on a page: its own bytes
    one = ds_mla_v4_page_stride(1)
    for r, s in enumerate(slots.tolist()):
        if s < 0:
            continue
        page, i = divmod(s, p)
        d0, s0 = page * stride + i * 576, page * stride + p * 576 + i * 8
        touched[d0 : d0 + 576] = True
        touched[s0 : s0 + 8] = True
        expect[d0 : d0 + 576] = fresh[r * one : r * one + 576]
        expect[s0 : s0 + 8] = fresh[r * one + 576 : r * one + 584]
    assert torch.equal(raw, expect)
    assert int(touched.sum()) == 5 * 584 and bool((raw[~touched] == POISON).all())


def test_strided_and_4d_views():
    """A page stride larger than vLLM's padded one (layers sharing a page grid) and vLLM's
    unsqueezed [B, 1, P, 584] view read and write the same as the compact cache."""
    p, pages = 4, 3
    x = hard_rows(10, 6)
    compact = pack_fp8_ds_mla_v4(x, p)
    wide_stride = 2 * ds_mla_v4_page_stride(p) + 64
    buf = torch.full((pages * wide_stride,), POISON, dtype=torch.uint8)
    wide = buf.as_strided((pages, 1, p, 584), (wide_stride, 584, 584, 1), 64)
    write_fp8_ds_mla_v4(wide, torch.arange(10), x)
    assert torch.equal(unpack_fp8_ds_mla_v4(wide)[:10], unpack_fp8_ds_mla_v4(compact)[:10])
    assert ds_mla_v4_pages(wide).shape == (pages, p, 584)
    written = torch.zeros_like(buf, dtype=torch.bool)
    for page in range(pages):
        written[64 + page * wide_stride : 64 + page * wide_stride + p * 584] = True
    assert bool((buf[~written] == POISON).all())  # nothing outside the pages' records


def test_cache_checks():
    with pytest.raises(TypeError, match="uint8"):
        ds_mla_v4_pages(torch.zeros(2, 4, 584, dtype=torch.int8))
    with pytest.raises(ValueError, match="584"):
        ds_mla_v4_pages(torch.zeros(2, 4, 656, dtype=torch.uint8))
    with pytest.raises(ValueError, match="strides"):
        ds_mla_v4_pages(torch.zeros(2, 584, 4, dtype=torch.uint8).transpose(1, 2))
    with pytest.raises(ValueError, match="strides"):  # overlapping pages
        ds_mla_v4_pages(torch.zeros(4000, dtype=torch.uint8).as_strided((2, 4, 584), (584, 584, 1)))
    cache = alloc_fp8_ds_mla_v4(2, 4)
    rows = torch.zeros(2, DS_V4_WIDTH)
    with pytest.raises(ValueError, match="slots must be -1 or in"):
        write_fp8_ds_mla_v4(cache, torch.tensor([0, 8]), rows)
    with pytest.raises(ValueError, match="slots must be -1 or in"):
        write_fp8_ds_mla_v4(cache, torch.tensor([0, -2]), rows)
    with pytest.raises(ValueError, match="distinct"):
        write_fp8_ds_mla_v4(cache, torch.tensor([3, 3]), rows)
    with pytest.raises(ValueError, match="entries"):
        write_fp8_ds_mla_v4(cache, torch.tensor([3]), rows)


# --- the reference reads it ------------------------------------------


def test_dequantize_cache_and_reference_read_pages():
    p, pages = 4, 5
    x = hard_rows(pages * p, 7)
    x[:, :DS_V4_NOPE] = torch.randn(pages * p, DS_V4_NOPE)  # attention-sized values
    x[:, DS_V4_NOPE:] = torch.randn(pages * p, 64)
    cache = pack_fp8_ds_mla_v4(x, p)
    rows = dequantize_cache(cache, "fp8_ds_mla_v4")
    assert rows.shape == (pages, p, 512) and rows.dtype == torch.float32
    assert torch.equal(rows.view(-1, 512), unpack_fp8_ds_mla_v4(cache))
    g = torch.Generator().manual_seed(8)
    t, h, w = 6, 4, 7
    q = torch.randn(t, h, DS_V4_WIDTH, generator=g)
    # request-local positions through a block table, as vLLM's slot ids
    block_table = torch.tensor([[3, 0, 4], [1, 2, -1]], dtype=torch.int32)
    req_ids = torch.tensor([0, 0, 0, 1, 1, 1], dtype=torch.int32)
    idx = torch.randint(0, 2 * p, (t, w), generator=g, dtype=torch.int32)
    idx[0, 0] = -1
    sink = torch.randn(h, generator=g)
    kw = dict(
        kv_lora_rank=512,
        block_table=block_table,
        req_ids=req_ids,
        block_size=p,
        attn_sink=sink,
        return_lse=True,
    )
    out, lse = sparse_mla_reference(q, cache, idx, 0.05, kv_format="fp8_ds_mla_v4", **kw)
    want, want_lse = sparse_mla_reference(q, rows, idx, 0.05, kv_format="auto", **kw)
    assert out.shape == (t, h, 512)
    assert torch.equal(out, want) and torch.equal(lse, want_lse)
    # one index per token: the output is that slot's row (value = the whole 512-wide row)
    one = torch.tensor([[5], [0], [2 * p - 1]], dtype=torch.int32)
    got = sparse_mla_reference(q[:3], cache, one, 1.0, kv_lora_rank=512, kv_format="fp8_ds_mla_v4")
    flat = unpack_fp8_ds_mla_v4(cache)
    assert torch.equal(got, flat[one[:, 0].long()][:, None, :].expand(3, h, 512))


def test_kernel_reads_v4_record():
    """The kernel lists the format (tests/test_sparse_mla_v4.py checks what it computes)."""
    assert "fp8_ds_mla_v4" in KV_FORMATS and "fp8_ds_mla_v4" in REFERENCE_KV_FORMATS
    cache = pack_fp8_ds_mla_v4(torch.randn(8, DS_V4_WIDTH), 4).to(DEVICE)
    q = torch.randn(2, 4, DS_V4_WIDTH, device=DEVICE)
    indices = torch.zeros(2, 1, dtype=torch.int32, device=DEVICE)
    plan = sparse_mla_plan(q, cache, indices, kv_format="fp8_ds_mla_v4")
    assert plan.family == "ds_mla_v4"


# --- against vLLM 0.33's own writer and reader ----------------------------------------------


@pytest.fixture(scope="module")
def vllm_v4():
    """vLLM's DeepSeek-V4 cache ops module, and its KV cache view builder."""
    require_vllm()
    from vllm.triton_utils import HAS_TRITON

    if not HAS_TRITON:
        pytest.skip("vLLM was imported with its Triton placeholder (no GPU, env set too late)")
    from vllm.models.deepseek_v4.common.ops import cache_utils

    return cache_utils


@pytest.fixture
def ieee_e4m3_interpreter(monkeypatch):
    """Under TRITON_INTERPRET, make the interpreter's fp32 -> e4m3 cast round to nearest even.

    The interpreter's cast (triton/runtime/interpreter.py ``_convert_float``, Triton 3.8) rounds
    ties up and lets a mantissa carry fall into the exponent bits (100 -> 104, 17 -> 18,
    7.75 -> 4), unlike the GPU's ``cvt.rn.satfinite.e4m3x2.f32``; every other step of vLLM's
    kernels (amax, floor, log2, ceil, exp2, division, clamp, byte encoding, addressing) still
    runs in the interpreter. On a GPU nothing is replaced.
    """
    if HAS_GPU:
        return
    import triton.language as tl
    from triton.runtime import interpreter

    original = interpreter._convert_float

    def convert(data, src, dst, rounding_mode):
        if src == tl.float32 and dst == tl.float8e4nv:
            f32 = torch.from_numpy(np.ascontiguousarray(data, dtype=np.float32))
            return f32.to(torch.float8_e4m3fn).view(torch.uint8).numpy().reshape(data.shape)
        return original(data, src, dst, rounding_mode)

    monkeypatch.setattr(interpreter, "_convert_float", convert)


def vllm_cache_views(page_size: int, num_blocks: int, layout: str, fill: int):
    """Two layers' V4 caches built by vLLM's own spec and view code (attention.py:870-883,
    v1/kv_cache_interface.py create_kv_cache_views), squeezed as bind_kv_cache does; and the raw
    buffer under them."""
    from vllm.v1.kv_cache_interface import (
        KVCacheTensor,
        MLAAttentionSpec,
        create_kv_cache_views,
        get_kv_quant_mode,
    )
    from vllm.v1.kv_cache_layout import KVCacheLayout

    ratio = 4
    spec = MLAAttentionSpec(
        block_size=page_size * ratio,
        num_kv_heads=1,
        max_tp_shards=1,
        head_size=512,
        dtype=torch.uint8,
        tokens_per_state=ratio,
        cache_dtype_str="fp8_ds_mla",
        alignment=576,
        model_version="deepseek_v4",
        kv_quant_mode=get_kv_quant_mode("fp8_ds_mla"),
        state_content_bytes=584,
    )
    page = spec.page_size_bytes
    lay = KVCacheLayout[layout]
    if lay.is_layer_compact:
        layer_stride, block_stride = page * num_blocks, page
    else:
        layer_stride, block_stride = page, 2 * page
    tensor = KVCacheTensor(
        size=2 * page * num_blocks,
        layers=["a", "b"],
        layer_stride=layer_stride,
        block_stride=block_stride,
    )
    raw = torch.full((tensor.size,), fill, dtype=torch.uint8)
    views = create_kv_cache_views(raw.view(torch.int8), spec, num_blocks, lay, tensor)
    return page, [v.squeeze(1) for v in views], raw


@pytest.mark.vllm
@pytest.mark.parametrize("page_size", [2, 64])
def test_vllm_allocation_matches(vllm_v4, page_size):
    page, (a, b), _ = vllm_cache_views(page_size, 3, "LBHNC", 0)
    assert page == ds_mla_v4_page_stride(page_size)
    assert (
        a.shape == (3, page_size, 584) and a.stride() == (page, 584, 1) and a.dtype == torch.uint8
    )
    ours = alloc_fp8_ds_mla_v4(3, page_size)
    assert ours.shape == a.shape and ours.stride() == a.stride()
    _, (a, b), _ = vllm_cache_views(page_size, 3, "BLHNC", 0)
    assert a.stride() == (2 * page, 584, 1)  # a block holds both layers' pages
    assert ds_mla_v4_pages(a).shape == (3, page_size, 584)


@pytest.mark.vllm
@pytest.mark.parametrize(
    ("page_size", "layout", "slots"),
    [
        (2, "LBHNC", [3, 0, -1, 5, 1, 4, 2]),  # C128A-sized pages
        (64, "BLHNC", [70, 3, 128, -1, 64, 0, 191, 65, 130, 9, 100, 150]),  # SWA / C4A pages
    ],
)
def test_writer_bytes_match_vllm(vllm_v4, ieee_e4m3_interpreter, page_size, layout, slots):
    """vLLM's Triton writer and ours, into the same poisoned buffer: every byte equal (data
    rows, scale rows, pad bytes, untouched slots, page padding, the other layer's pages)."""
    slots_t = torch.tensor(slots)
    x = hard_rows(len(slots), 11 + page_size).bfloat16()
    _, (theirs, _), raw_theirs = vllm_cache_views(page_size, 3, layout, POISON)
    _, (ours, _), raw_ours = vllm_cache_views(page_size, 3, layout, POISON)
    vllm_v4.quantize_and_insert_k_cache(
        x, theirs.view(theirs.shape[0], -1), slots_t, block_size=page_size
    )
    write_fp8_ds_mla_v4(ours, slots_t, x)
    assert not bool((raw_theirs == POISON).all())  # vLLM's kernel did write
    diff = (raw_ours != raw_theirs).nonzero().flatten()
    assert diff.numel() == 0, f"{diff.numel()} bytes differ, first at {diff[:8].tolist()}"


@pytest.mark.vllm
def test_pack_matches_vllm_writer_on_fresh_cache(vllm_v4, ieee_e4m3_interpreter):
    """pack_fp8_ds_mla_v4 == vLLM's writer into vLLM's zero-filled allocation, slots 0..N-1."""
    p, n = 4, 10
    x = hard_rows(n, 12).bfloat16()
    _, (theirs, _), _ = vllm_cache_views(p, 3, "LBHNC", 0)
    vllm_v4.quantize_and_insert_k_cache(x, theirs.view(3, -1), torch.arange(n), block_size=p)
    ours = pack_fp8_ds_mla_v4(x, p)
    stride = ds_mla_v4_page_stride(p)
    assert torch.equal(raw_bytes(ours), raw_bytes(theirs)[: 3 * stride])


@pytest.mark.vllm
@pytest.mark.filterwarnings("ignore:overflow encountered in multiply:RuntimeWarning")  # the inf
def test_vllm_reader_decodes_our_bytes(vllm_v4):
    """vLLM's gather (its prefill reader, bf16 out) on our pack == our unpack, value for value,
    through a block table, for two requests, with gather_lens and an output offset."""
    p = 8
    x = hard_rows(4 * p, 13)  # with the largest-bf16 group: inf on both sides
    cache = pack_fp8_ds_mla_v4(x, p)
    flat = unpack_fp8_ds_mla_v4(cache)
    block_table = torch.tensor([[2, 0, 3], [1, 3, 0]], dtype=torch.int32)
    seq_lens = torch.tensor([20, 13], dtype=torch.int32)
    gather_lens = torch.tensor([20, 6], dtype=torch.int32)
    offset = 3
    out = torch.full((2, 24, 512), float("nan"), dtype=torch.bfloat16)
    vllm_v4._DEQUANTIZE_AND_GATHER_K_CACHE_KERNEL(
        out, cache, seq_lens, gather_lens, block_table, p, offset
    )
    for r in range(2):
        start = int(seq_lens[r] - gather_lens[r])
        pos = torch.arange(start, int(seq_lens[r]))
        slot = block_table[r, pos // p].long() * p + pos % p
        got = out[r, offset : offset + pos.numel()].float()
        assert torch.equal(got, flat[slot]), r
    assert bool(torch.isinf(flat).any())  # the inf edge case was part of it
