"""fp8_ds_mla packing: round trip, exact byte layout, both scale rules, errors; per-tensor fp8."""

from __future__ import annotations

import math
import struct

import pytest
import torch

from triton_mla_sparse import pack_fp8_ds_mla, unpack_fp8_ds_mla
from triton_mla_sparse.kv_format import (
    E4M3_MAX,
    bytes_per_row,
    dequantize_cache,
    ds_mla_scales,
    quantize_fp8,
)

E4M3_HALF_ULP = 2.0**-4  # 3 mantissa bits: round-to-nearest error <= 2^-4 |x| for normals
E4M3_MIN_NORMAL = 2.0**-6
E4M3_SUB_HALF_STEP = 2.0**-10  # subnormal step 2^-9


def rows_with_group_magnitudes(n: int, seed: int) -> torch.Tensor:
    """[n, 576] float32 rows: the four 128-groups and the rows span several decades."""
    g = torch.Generator().manual_seed(seed)
    rows = torch.randn(n, 576, generator=g)
    rows[:, :512] *= torch.tensor([1.0, 100.0, 0.01, 3.0]).repeat_interleave(128)
    rows *= torch.logspace(-3, 3, n)[torch.randperm(n, generator=g)][:, None]
    return rows


@pytest.mark.parametrize("scale_format", ["pow2", "fp32"])
def test_round_trip_error_bounded_by_e4m3(scale_format):
    rows = rows_with_group_magnitudes(200, 1)
    packed = pack_fp8_ds_mla(rows, scale_format)
    assert packed.shape == (200, 656) and packed.dtype == torch.uint8
    back = unpack_fp8_ds_mla(packed)
    assert back.shape == (200, 576) and back.dtype == torch.float32
    lat, back_lat = rows[:, :512].view(200, 4, 128), back[:, :512].view(200, 4, 128)
    scale = packed[:, 512:528].contiguous().view(torch.float32)[..., None]  # [200, 4, 1]
    amax = lat.abs().amax(-1, keepdim=True)
    assert (amax / scale <= E4M3_MAX * (1 + 1e-6)).all()  # nothing clipped
    # normals: half an ulp relative to the value; subnormals: half a subnormal step of the scale
    bound = torch.maximum(E4M3_HALF_ULP * lat.abs(), E4M3_SUB_HALF_STEP * scale) * (1 + 1e-5)
    err = (back_lat - lat).abs()
    assert (err <= bound).all(), f"worst ratio {(err / bound).max():.3f}"
    # relative to each group's amax the error is at most 2^-4 (and much less on average)
    assert (err.amax(-1, keepdim=True) <= E4M3_HALF_ULP * amax).all()
    assert (err.mean(-1, keepdim=True) <= 0.02 * amax).all()
    # rope: exactly bf16 rounding
    assert torch.equal(back[:, 512:], rows[:, 512:].to(torch.bfloat16).float())


@pytest.mark.parametrize("scale_format", ["pow2", "fp32"])
def test_byte_layout(scale_format):
    rows = rows_with_group_magnitudes(8, 2)
    packed = pack_fp8_ds_mla(rows, scale_format)
    amax = rows[:, :512].view(8, 4, 128).abs().amax(-1)
    for r in range(8):
        raw = bytes(packed[r].tolist())
        # bytes 512..528: four little-endian float32 scales
        scales = struct.unpack("<4f", raw[512:528])
        for j in range(4):
            a = float(amax[r, j])
            if scale_format == "fp32":
                expect = float(torch.tensor(a, dtype=torch.float32) / E4M3_MAX)
            else:
                expect = 2.0 ** math.ceil(math.log2(a / E4M3_MAX))
            assert scales[j] == expect, (r, j, scales[j], expect)
        # bytes 0..512: torch's own e4m3 conversion of value / scale
        sc = torch.tensor(scales).repeat_interleave(128)
        e4m3 = (rows[r, :512] / sc).to(torch.float8_e4m3fn).view(torch.uint8)
        assert raw[:512] == bytes(e4m3.tolist())
        # bytes 528..656: 64 little-endian bf16 values (the top 16 bits of float32)
        rope_bits = struct.unpack("<64H", raw[528:656])
        bf16 = rows[r, 512:].to(torch.bfloat16).float()
        expect_bits = [struct.unpack("<I", struct.pack("<f", float(v)))[0] >> 16 for v in bf16]
        assert list(rope_bits) == expect_bits


def test_pow2_rule():
    """scale = 2^ceil(log2(amax / 448)): a power of two with amax / scale in (224, 448]."""
    amax = torch.cat([torch.logspace(-6, 6, 400), torch.tensor([448.0, 896.0, 1.0, 3.5])])
    s = ds_mla_scales(amax, "pow2")
    expect = torch.tensor([2.0 ** math.ceil(math.log2(float(a) / 448.0)) for a in amax])
    assert torch.equal(s, expect.float())
    mant, _ = torch.frexp(s)
    assert (mant == 0.5).all()
    ratio = amax / s
    assert (ratio <= 448).all() and (ratio > 224).all()
    assert ds_mla_scales(torch.tensor([0.0]), "pow2").item() == 1.0


def test_fp32_rule():
    amax = torch.logspace(-6, 6, 400)
    s = ds_mla_scales(amax, "fp32")
    assert torch.equal(s, amax.float() / 448.0)
    assert ds_mla_scales(torch.tensor([0.0]), "fp32").item() == 0.0
    with pytest.raises(ValueError, match="scale_format"):
        ds_mla_scales(amax, "e8m0")


@pytest.mark.parametrize("scale_format", ["pow2", "fp32"])
def test_zero_rows_decode_to_zero(scale_format):
    rows = torch.randn(4, 576)
    rows[1] = 0
    rows[2, 128:256] = 0
    packed = pack_fp8_ds_mla(rows, scale_format)
    back = unpack_fp8_ds_mla(packed)
    assert torch.isfinite(back).all()
    assert (back[1] == 0).all() and (back[2, 128:256] == 0).all()
    if scale_format == "fp32":
        assert (packed[1, 512:528] == 0).all()


def test_leading_dims_preserved():
    rows = torch.randn(3, 64, 576, dtype=torch.float16)
    packed = pack_fp8_ds_mla(rows)
    assert packed.shape == (3, 64, 656)
    assert unpack_fp8_ds_mla(packed).shape == (3, 64, 576)
    assert torch.equal(packed.view(-1, 656), pack_fp8_ds_mla(rows.view(-1, 576)))


def test_pack_errors():
    with pytest.raises(ValueError, match="576"):
        pack_fp8_ds_mla(torch.randn(4, 512))
    with pytest.raises(TypeError, match="floating"):
        pack_fp8_ds_mla(torch.zeros(4, 576, dtype=torch.int32))
    with pytest.raises(ValueError, match="scale_format"):
        pack_fp8_ds_mla(torch.randn(4, 576), "fp16")
    with pytest.raises(TypeError, match="uint8"):
        unpack_fp8_ds_mla(torch.zeros(4, 656, dtype=torch.int8))
    with pytest.raises(ValueError, match="656"):
        unpack_fp8_ds_mla(torch.zeros(4, 576, dtype=torch.uint8))


def test_quantize_fp8_per_tensor():
    g = torch.Generator().manual_seed(3)
    rows = torch.randn(50, 576, generator=g) * 7
    q8, k_scale = quantize_fp8(rows)
    assert q8.dtype == torch.float8_e4m3fn
    assert k_scale == pytest.approx(float(rows.abs().max()) / 448.0, rel=1e-6)
    back = dequantize_cache(q8, "fp8", k_scale)
    bound = torch.maximum(E4M3_HALF_ULP * rows.abs(), torch.tensor(E4M3_SUB_HALF_STEP * k_scale))
    assert ((back - rows).abs() <= bound * (1 + 1e-5)).all()
    # the uint8 view and a tensor k_scale decode the same
    back_u8 = dequantize_cache(q8.view(torch.uint8), "fp8", torch.tensor([k_scale]))
    assert torch.equal(back, back_u8)
    assert quantize_fp8(torch.zeros(3, 4))[1] == 1.0


def test_bytes_per_row():
    assert bytes_per_row("fp8_ds_mla", 576, torch.uint8) == 656
    assert bytes_per_row("fp8", 576, torch.uint8) == 576
    assert bytes_per_row("auto", 576, torch.bfloat16) == 1152
    assert bytes_per_row("auto", 512, torch.float32) == 2048
