"""e4m3 in @triton.jit code, shared by the ops (sparse_mla, indexer, index_q, mla_cache): the decode
(hardware conversion where it exists, integer or packed inline-PTX decode where it does not) and
the fp8-free encode (round to the e4m3 grid, then the byte).

Only jit functions here: importing this module compiles nothing and touches no GPU.
"""

import triton
import triton.language as tl

# How e4m3 bytes are decoded without hardware fp8 (the E4M3_DECODE constexpr; sparse_mla's
# KernelConfig.e4m3_decode names them): one value per chain of integer operations, or four
# values per inline-PTX call. PACKED_NO_MASK also drops fp8_ds_mla's staging mask (its kernel).
E4M3_SCALAR = tl.constexpr(0)
E4M3_PACKED = tl.constexpr(1)
E4M3_PACKED_NO_MASK = tl.constexpr(2)

# 4 e4m3 bytes (one 32-bit register, byte i = element i) -> 2 registers of fp16 pairs, the same
# bit patterns as the scalar integer decode in _e4m3_to (value * 2^-8): prmt spreads the bytes
# into the high byte of each 16-bit lane (lane = b << 8); the sign stays at bit 15, the 7
# exponent and mantissa bits shift right by one into bits 13..7. Two instructions per value
# instead of ~8 (docs/perf-log/12-packed-e4m3-sass.txt). PTX, so NVIDIA only.
E4M3X4_TO_F16X4_PTX = tl.constexpr("""{
.reg .b32 lo, hi, t;
prmt.b32 lo, $2, 0, 0x1404;
prmt.b32 hi, $2, 0, 0x3424;
and.b32 t, lo, 0x7F007F00;
shr.b32 t, t, 1;
and.b32 lo, lo, 0x80008000;
or.b32 $0, lo, t;
and.b32 t, hi, 0x7F007F00;
shr.b32 t, t, 1;
and.b32 hi, hi, 0x80008000;
or.b32 $1, hi, t;
}""")
# values per inline-PTX call of E4M3X4_TO_F16X4_PTX (one 32-bit register of bytes)
E4M3_PACK = tl.constexpr(4)


@triton.jit
def _e4m3_to(b_u8, dtype: tl.constexpr, FP8_NATIVE: tl.constexpr, DECODE: tl.constexpr = 0):
    # e4m3 byte -> `dtype`. Without hardware fp8 (sm80/86, AMD) rebuild the fp16 bit pattern:
    # exponent/mantissa shift into place and the sign moves to bit 15; the bias changes from 7 to
    # 15, a factor 2^-8 that callers put back through their scale (k_scale or the ds_mla scales).
    # Exact for every finite e4m3. DECODE (E4M3_*; the default is E4M3_SCALAR, for callers with
    # no choice) picks the scalar or the packed form of the same bit patterns.
    if FP8_NATIVE:
        b_f = b_u8.to(tl.float8e4nv, bitcast=True)
        if dtype == tl.bfloat16:
            # through fp32 (exact): Triton 3.6 lowers e4m3 -> bf16 on sm89 with a
            # cvt.bf16.f16 that only sm90+ has (ptxas rejects it)
            return b_f.to(tl.float32).to(dtype)
        return b_f.to(dtype)
    elif DECODE != E4M3_SCALAR:
        b_h = tl.inline_asm_elementwise(
            E4M3X4_TO_F16X4_PTX,
            "=r,=r,r",
            [b_u8],
            dtype=tl.float16,
            is_pure=True,
            pack=E4M3_PACK,
        )
        return b_h.to(dtype)
    else:
        b16 = b_u8.to(tl.uint16)
        bits = ((b16 & 0x7F) << 7) | ((b16 & 0x80) << 8)
        return bits.to(tl.float16, bitcast=True).to(dtype)


# e4m3fn: smallest normal 2^-6, subnormal step 2^-9; 3 mantissa bits.
E4M3_MIN_NORMAL = tl.constexpr(0.015625)
E4M3_SUBNORMAL_STEP = tl.constexpr(0.001953125)
# fp32 rounding constant: adding 1.5 * 2^23 rounds |x| < 2^22 to an integer, ties to even.
RNE_MAGIC = tl.constexpr(12582912.0)


@triton.jit
def _round_e4m3(x):
    # x (fp32, |x| <= 448) -> nearest e4m3fn value, ties to even, as fp32. Normals: clear the
    # low 20 of fp32's 23 mantissa bits with round-to-nearest-even on the bit pattern (a carry
    # into the exponent is the correct rounding); subnormals: round to a multiple of 2^-9.
    # The sign is kept, also when a negative value rounds to zero (-0.0, as the hardware). It is
    # copied as a bit: Triton 3.6 lowers a float `-y` as `0 - y`, which turns -0.0 into +0.0.
    bits = x.to(tl.int32, bitcast=True)
    lsb = (bits >> 20) & 1
    normal = ((bits + 0x7FFFF + lsb) & -0x100000).to(tl.float32, bitcast=True)
    a = tl.abs(x)
    sub = ((a / E4M3_SUBNORMAL_STEP + RNE_MAGIC) - RNE_MAGIC) * E4M3_SUBNORMAL_STEP
    sign = (bits >> 31) << 31  # the sign bit alone
    sub = (sub.to(tl.int32, bitcast=True) | sign).to(tl.float32, bitcast=True)
    return tl.where(a < E4M3_MIN_NORMAL, sub, normal)


@triton.jit
def _e4m3_byte(v):
    # an fp32 value already on the e4m3fn grid (_round_e4m3, |v| <= 448) -> its e4m3fn byte
    # (uint8), from the fp32 bit pattern: normals keep the top 3 mantissa bits and rebias the
    # exponent (127 -> 7); subnormals (|v| < 2^-6) are k * 2^-9, byte k. The sign moves to bit 7.
    bits = v.to(tl.int32, bitcast=True)
    sign = (bits >> 24) & 0x80
    exp = (bits >> 23) & 0xFF
    normal = ((exp - 120) << 3) | ((bits >> 20) & 0x7)
    sub = (tl.abs(v) * 512.0).to(tl.int32)
    mag = tl.where(exp >= 121, normal, sub)
    return (sign | mag).to(tl.uint8)
