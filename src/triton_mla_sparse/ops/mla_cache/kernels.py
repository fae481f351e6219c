"""Triton kernel writing MLA cache rows in the fp8 formats with integer e4m3 encoding.

One program owns one token: it reads the normed latent ``[KV_DIM]`` and rotated rope ``[ROPE]``
(float32) and, unless its slot is negative, writes its cache row at ``block * stride_block +
offset * stride_row`` (bytes). The arithmetic is vLLM's fused writer's (fused_norm_rope,
models/deepseek_v32/common/kernels.py:355-405), with the fp8 conversion done on the e4m3 grid in
fp32 and the byte built from the bit pattern, so it compiles where Triton has no fp8 types.

FORMAT 1 = "fp8": KV_DIM + ROPE e4m3 bytes, ``value / k_scale`` saturated to +-448 (k_scale 1
when HAS_SCALE is false). FORMAT 2 = "fp8_ds_mla": 512 e4m3 bytes with one power-of-two scale per
TILE values, ``2^ceil(log2(max(amax / 448, 1e-4)))``, the four float32 scales, then the rope as
bf16 (656 bytes).
"""

import triton
import triton.language as tl

from ..e4m3 import _e4m3_byte, _round_e4m3

E4M3_MAX = tl.constexpr(448.0)


@triton.jit
def mla_cache_write_kernel(
    KvC,
    stride_kt,
    Kpe,
    stride_pt,
    Slots,
    Cache,
    Cache32,
    Cache16,
    stride_cb,
    stride_cr,
    block_size,
    KScale,
    KV_DIM: tl.constexpr,
    ROPE: tl.constexpr,
    FORMAT: tl.constexpr,
    TILE: tl.constexpr,
    HAS_SCALE: tl.constexpr,
):
    i_t = tl.program_id(0).to(tl.int64)
    i_slot = tl.load(Slots + i_t).to(tl.int64)
    if i_slot >= 0:
        o_row = (i_slot // block_size) * stride_cb + (i_slot % block_size) * stride_cr
        o_d = tl.arange(0, KV_DIM)
        o_r = tl.arange(0, ROPE)
        b_kv = tl.load(KvC + i_t * stride_kt + o_d).to(tl.float32)
        b_pe = tl.load(Kpe + i_t * stride_pt + o_r).to(tl.float32)
        if FORMAT == 2:
            NUM_TILES: tl.constexpr = KV_DIM // TILE
            b_kv2 = tl.reshape(b_kv, (NUM_TILES, TILE))
            b_amax = tl.max(tl.abs(b_kv2), axis=1, keep_dims=True)
            b_s = tl.maximum(b_amax * (1.0 / E4M3_MAX), 1e-4)
            b_s = tl.math.exp2(tl.math.ceil(tl.math.log2(b_s)))
            b_q = _e4m3_byte(_round_e4m3(b_kv2 / b_s))
            tl.store(Cache + o_row + o_d, tl.reshape(b_q, (KV_DIM,)))
            o_s = tl.arange(0, NUM_TILES)
            tl.store(Cache32 + o_row // 4 + KV_DIM // 4 + o_s, tl.reshape(b_s, (NUM_TILES,)))
            tl.store(Cache16 + o_row // 2 + KV_DIM // 2 + 2 * NUM_TILES + o_r, b_pe.to(tl.bfloat16))
        else:
            b_scale = 1.0
            if HAS_SCALE:
                b_scale = tl.load(KScale).to(tl.float32)
            b_kq = tl.minimum(tl.maximum(b_kv / b_scale, -E4M3_MAX), E4M3_MAX)
            b_pq = tl.minimum(tl.maximum(b_pe / b_scale, -E4M3_MAX), E4M3_MAX)
            tl.store(Cache + o_row + o_d, _e4m3_byte(_round_e4m3(b_kq)))
            tl.store(Cache + o_row + KV_DIM + o_r, _e4m3_byte(_round_e4m3(b_pq)))
