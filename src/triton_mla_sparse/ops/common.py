"""@triton.jit helpers shared by the ops (sparse_mla, indexer): e4m3 decode, cheap division.

Only jit functions here: importing this module compiles nothing and touches no GPU.
"""

import triton
import triton.language as tl


@triton.jit
def _e4m3_to(b_u8, dtype: tl.constexpr, FP8_NATIVE: tl.constexpr):
    # e4m3 byte -> `dtype`. Without hardware fp8 (sm80/86, AMD) rebuild the fp16 bit pattern:
    # exponent/mantissa shift into place and the sign moves to bit 15; the bias changes from 7 to
    # 15, a factor 2^-8 that callers put back through their scale (k_scale or the ds_mla scales).
    # Exact for every finite e4m3.
    if FP8_NATIVE:
        b_f = b_u8.to(tl.float8e4nv, bitcast=True)
        if dtype == tl.bfloat16:
            # through fp32 (exact): Triton 3.6 lowers e4m3 -> bf16 on sm89 with a
            # cvt.bf16.f16 that only sm90+ has (ptxas rejects it)
            return b_f.to(tl.float32).to(dtype)
        return b_f.to(dtype)
    else:
        b16 = b_u8.to(tl.uint16)
        bits = ((b16 & 0x7F) << 7) | ((b16 & 0x80) << 8)
        return bits.to(tl.float16, bitcast=True).to(dtype)


@triton.jit
def _div_pow2(x, d, SHIFT: tl.constexpr):
    # (x // d, x % d) for non-negative int32 x; a shift when d == 2^SHIFT (SHIFT >= 0), since a
    # general integer division costs tens of instructions per index in the hot loop.
    if SHIFT >= 0:
        return x >> SHIFT, x & ((1 << SHIFT) - 1)
    else:
        q = x // d
        return q, x - q * d
