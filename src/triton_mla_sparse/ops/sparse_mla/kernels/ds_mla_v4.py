"""The fp8_ds_mla_v4 family: DeepSeek-V4's 584-byte paged record, read in place (kv_format.py has
the layout). Per page of P tokens: P data rows of 576 bytes (448 e4m3 NoPE values, then 64 bf16
RoPE values) at ``slot * 576``, then P scale rows of 8 bytes (7 ue8m0 exponents, one per 64 NoPE
values, and a pad byte) at ``P * 576 + slot * 8``. q and k are 512 wide (no separate rope part)
and the value is the whole dequantized row.

The ds_mla approach (ds_mla.py) with 64-wide groups: each NoPE group is one chunk whose scale
multiplies its logits column-wise and is folded into P before its PV dot, so the e4m3 -> MMA-type
conversion stays an elementwise cast. The bf16 RoPE chunk is both K and V (unlike V3.2's 656-byte
rows, whose rope is K only); it has no scale, so its accumulator stays in plain units while the
NoPE accumulators are kept in units of the step's largest scale.

With bf16 or fp32 MMAs the scales fold into the tile instead (FOLD): a ue8m0 scale is a power of
two, so an e4m3 value times its scale is exact in either type (both have fp32's exponent range);
each chunk is dequantized once, QK^T is one chain of dots over the whole row and every PV dot
takes P as it is. fp16 MMAs keep the scales outside the tile: fp16's range is too narrow for the
products (past 65504, or below its subnormals). Where the launch asks for it (FOLD_FP16), fp16
MMAs fold them relative to the step's largest scale instead: each chunk's ratio to it is a power
of two of at most 1 (times the integer decode's 2^8), so one fp16 multiply per two values
dequantizes the tile exactly (chunks over 2^14 times smaller than the step's largest lose bits
to fp16's subnormals, as P times such a chunk's scale does in the unfolded form); the NoPE logits
are scaled back by the reference once and the NoPE accumulators kept in its units.
"""

import triton
import triton.language as tl

from ...e4m3 import _e4m3_to
from .shared import (
    _extra_bounds,
    _first_idx,
    _head_offsets,
    _inv_denominator_with_sink,
    _out_rows,
    _program_coords,
    _row_page_slot,
    _softmax_step,
    _split_bounds,
    _step_idx,
    _store_cols,
    _store_lse,
)

# the record's geometry (kv_format.DS_V4_*)
V4_GROUP = tl.constexpr(64)  # NoPE values per scale: one chunk
V4_NOPE = tl.constexpr(448)  # e4m3 NoPE values (7 chunks)
V4_ROPE = tl.constexpr(64)  # bf16 RoPE values after them
V4_DATA_BYTES = tl.constexpr(576)  # one data row
V4_SCALE_BYTES = tl.constexpr(8)  # one scale row
# ue8m0 byte b is 2^(b - 127): b is exactly the fp32 exponent field of that power of two
FP32_MANTISSA_BITS = tl.constexpr(23)
# the integer e4m3 decode (common._e4m3_to) yields values 2^-8 too small
INT_DECODE_FACTOR = tl.constexpr(256.0)


@triton.jit
def _v4_rows(b_page, b_slot, stride_kb, page_size):
    # (int64 byte offsets of each token's data row, of its scale row) in its page
    o_page = b_page.to(tl.int64) * stride_kb
    o_data = o_page + b_slot.to(tl.int64) * V4_DATA_BYTES
    o_scale = o_page + (page_size * V4_DATA_BYTES + b_slot * V4_SCALE_BYTES).to(tl.int64)
    return o_data, o_scale


@triton.jit
def _v4_scale(KV, o_scale, m_n, G: tl.constexpr):
    # chunk G's scale 2^(byte - 127) per row [BLOCK_N], float32 from its bits (0 where masked)
    b_e = tl.load(KV + o_scale + G, mask=m_n, other=0)
    return (b_e.to(tl.int32) << FP32_MANTISSA_BITS).to(tl.float32, bitcast=True)


@triton.jit
def _v4_ref_scale(b_c0, b_c1, b_c2, b_c3, b_c4, b_c5, b_c6):
    # a step's reference scale: its largest (1 where every row is masked)
    b_cmax = tl.maximum(
        tl.maximum(tl.maximum(tl.max(b_c0, 0), tl.max(b_c1, 0)), tl.max(b_c2, 0)),
        tl.maximum(
            tl.maximum(tl.max(b_c3, 0), tl.max(b_c4, 0)),
            tl.maximum(tl.max(b_c5, 0), tl.max(b_c6, 0)),
        ),
    )
    return tl.where(b_cmax > 0.0, b_cmax, 1.0)


@triton.jit
def _v4_chunk(
    STAGE: tl.constexpr,
    KV,
    o_data,
    o_scale,
    m_n,
    G: tl.constexpr,
    dtype: tl.constexpr,
    FP8_NATIVE: tl.constexpr,
    FOLD: tl.constexpr,
):
    # NoPE chunk G of BLOCK_N rows: (e4m3 values [BLOCK_N, 64] cast to `dtype`, unscaled; their
    # scale 2^(byte - 127) per row [BLOCK_N], float32, built from its bits: exact, 2^128 for the
    # byte 255 is inf, and the byte 0 gives 0 rather than 2^-127 (writers never store bytes below
    # 105: their amax floor 1e-4 gives exponent -22))
    o_c = tl.arange(0, V4_GROUP)
    b_k8 = tl.load(KV + o_data[:, None] + (G * V4_GROUP + o_c[None, :]), mask=m_n[:, None], other=0)
    b_sc = _v4_scale(KV, o_scale, m_n, G)
    if FOLD:
        # the tile comes out dequantized (callers ignore the scale): the product is formed in
        # fp32 and converted to bf16, both exact (4 significant bits times a power of two); the
        # masked scale is also the row mask that keeps the tile staged. The integer decode's
        # 2^-8 rides on the scale (2^(byte - 119): finite below the byte 247, past any
        # writer's range).
        b_f = _e4m3_to(b_k8, tl.float32, FP8_NATIVE)
        if not FP8_NATIVE:
            b_sc = b_sc * INT_DECODE_FACTOR
        b_k = (b_f * tl.where(m_n, b_sc, 0.0)[:, None]).to(dtype)
    else:
        b_k = _e4m3_to(b_k8, dtype, FP8_NATIVE)
        if STAGE:
            b_k = b_k * m_n[:, None].to(b_k.dtype)  # as ds_mla._ds_chunk: convert once, staged
    return b_k, b_sc


@triton.jit
def _v4_fp16_folded_chunk(KV, o_data, m_n, b_rel, G: tl.constexpr, FP8_NATIVE: tl.constexpr):
    # NoPE chunk G of BLOCK_N rows as fp16, times its ratio to the step's reference scale
    # (b_rel, fp16 powers of two, 0 where masked): exact, and the barrier that keeps it staged
    o_c = tl.arange(0, V4_GROUP)
    b_k8 = tl.load(KV + o_data[:, None] + (G * V4_GROUP + o_c[None, :]), mask=m_n[:, None], other=0)
    return _e4m3_to(b_k8, tl.float16, FP8_NATIVE) * b_rel[:, None]


@triton.jit
def _v4_rope(KV, o_data, m_n, dtype: tl.constexpr):
    # the bf16 RoPE values after the NoPE bytes -> [BLOCK_N, 64] in `dtype`
    o_r = tl.arange(0, V4_ROPE)
    p_rope = (KV + o_data + V4_NOPE).to(tl.pointer_type(tl.bfloat16))
    return tl.load(p_rope[:, None] + o_r[None, :], mask=m_n[:, None], other=0.0).to(dtype)


@triton.jit
def _v4_pv(b_pr, b_c, b_k, b_a, b_alpha, dtype: tl.constexpr, DOT_PRECISION: tl.constexpr):
    # one NoPE chunk's accumulator after a step: rescaled by alpha, plus (P * scale) @ V chunk
    return tl.dot(
        (b_pr * b_c[None, :]).to(dtype), b_k, b_a * b_alpha[:, None], input_precision=DOT_PRECISION
    )


@triton.jit
def _v4_step(
    KV,
    o_data,
    o_scale,
    m_n,
    b_q0,
    b_q1,
    b_q2,
    b_q3,
    b_q4,
    b_q5,
    b_q6,
    b_qr,
    b_a0,
    b_a1,
    b_a2,
    b_a3,
    b_a4,
    b_a5,
    b_a6,
    b_ar,
    b_l,
    b_m,
    b_ref,
    qk_scale,
    STAGE: tl.constexpr,
    dtype: tl.constexpr,
    FP8_NATIVE: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
    FOLD: tl.constexpr,
    FOLD_FP16: tl.constexpr,
):
    # one gather step: logits of BLOCK_N rows, the online softmax, the eight PV dots
    if FOLD_FP16:
        # each chunk times its ratio to the step's reference scale (with the integer decode's
        # 2^8), as fp16 powers of two
        b_c0 = _v4_scale(KV, o_scale, m_n, 0)
        b_c1 = _v4_scale(KV, o_scale, m_n, 1)
        b_c2 = _v4_scale(KV, o_scale, m_n, 2)
        b_c3 = _v4_scale(KV, o_scale, m_n, 3)
        b_c4 = _v4_scale(KV, o_scale, m_n, 4)
        b_c5 = _v4_scale(KV, o_scale, m_n, 5)
        b_c6 = _v4_scale(KV, o_scale, m_n, 6)
        b_ref_new = _v4_ref_scale(b_c0, b_c1, b_c2, b_c3, b_c4, b_c5, b_c6)
        b_inv_ref = 1.0 / b_ref_new
        if not FP8_NATIVE:
            b_inv_ref = b_inv_ref * INT_DECODE_FACTOR
        b_k0 = _v4_fp16_folded_chunk(
            KV, o_data, m_n, (b_c0 * b_inv_ref).to(tl.float16), 0, FP8_NATIVE
        )
        b_k1 = _v4_fp16_folded_chunk(
            KV, o_data, m_n, (b_c1 * b_inv_ref).to(tl.float16), 1, FP8_NATIVE
        )
        b_k2 = _v4_fp16_folded_chunk(
            KV, o_data, m_n, (b_c2 * b_inv_ref).to(tl.float16), 2, FP8_NATIVE
        )
        b_k3 = _v4_fp16_folded_chunk(
            KV, o_data, m_n, (b_c3 * b_inv_ref).to(tl.float16), 3, FP8_NATIVE
        )
        b_k4 = _v4_fp16_folded_chunk(
            KV, o_data, m_n, (b_c4 * b_inv_ref).to(tl.float16), 4, FP8_NATIVE
        )
        b_k5 = _v4_fp16_folded_chunk(
            KV, o_data, m_n, (b_c5 * b_inv_ref).to(tl.float16), 5, FP8_NATIVE
        )
        b_k6 = _v4_fp16_folded_chunk(
            KV, o_data, m_n, (b_c6 * b_inv_ref).to(tl.float16), 6, FP8_NATIVE
        )
    else:
        b_k0, b_c0 = _v4_chunk(STAGE, KV, o_data, o_scale, m_n, 0, dtype, FP8_NATIVE, FOLD)
        b_k1, b_c1 = _v4_chunk(STAGE, KV, o_data, o_scale, m_n, 1, dtype, FP8_NATIVE, FOLD)
        b_k2, b_c2 = _v4_chunk(STAGE, KV, o_data, o_scale, m_n, 2, dtype, FP8_NATIVE, FOLD)
        b_k3, b_c3 = _v4_chunk(STAGE, KV, o_data, o_scale, m_n, 3, dtype, FP8_NATIVE, FOLD)
        b_k4, b_c4 = _v4_chunk(STAGE, KV, o_data, o_scale, m_n, 4, dtype, FP8_NATIVE, FOLD)
        b_k5, b_c5 = _v4_chunk(STAGE, KV, o_data, o_scale, m_n, 5, dtype, FP8_NATIVE, FOLD)
        b_k6, b_c6 = _v4_chunk(STAGE, KV, o_data, o_scale, m_n, 6, dtype, FP8_NATIVE, FOLD)
    if FOLD or FOLD_FP16:
        # dequantized tiles: one accumulation chain for the logits, P as it is for every chunk
        b_kr = _v4_rope(KV, o_data, m_n, b_qr.dtype)
        b_s = tl.dot(b_q0, tl.trans(b_k0), input_precision=DOT_PRECISION)
        b_s = tl.dot(b_q1, tl.trans(b_k1), b_s, input_precision=DOT_PRECISION)
        b_s = tl.dot(b_q2, tl.trans(b_k2), b_s, input_precision=DOT_PRECISION)
        b_s = tl.dot(b_q3, tl.trans(b_k3), b_s, input_precision=DOT_PRECISION)
        b_s = tl.dot(b_q4, tl.trans(b_k4), b_s, input_precision=DOT_PRECISION)
        b_s = tl.dot(b_q5, tl.trans(b_k5), b_s, input_precision=DOT_PRECISION)
        b_s = tl.dot(b_q6, tl.trans(b_k6), b_s, input_precision=DOT_PRECISION)
        if FOLD_FP16:
            b_s = b_s * b_ref_new  # the NoPE logits back in plain units
        else:
            b_ref_new = b_ref
        b_s = tl.dot(b_qr, tl.trans(b_kr), b_s, input_precision=DOT_PRECISION)
        b_p, b_alpha, b_l, b_m = _softmax_step(b_s, m_n, qk_scale, b_m, b_l)
        # the RoPE accumulator in plain units, the NoPE ones in units of the reference
        b_ar = tl.dot(
            b_p.to(b_qr.dtype), b_kr, b_ar * b_alpha[:, None], input_precision=DOT_PRECISION
        )
        if FOLD_FP16:
            b_alpha = b_alpha * (b_ref / b_ref_new)
        b_pd = b_p.to(dtype)
        b_a0 = tl.dot(b_pd, b_k0, b_a0 * b_alpha[:, None], input_precision=DOT_PRECISION)
        b_a1 = tl.dot(b_pd, b_k1, b_a1 * b_alpha[:, None], input_precision=DOT_PRECISION)
        b_a2 = tl.dot(b_pd, b_k2, b_a2 * b_alpha[:, None], input_precision=DOT_PRECISION)
        b_a3 = tl.dot(b_pd, b_k3, b_a3 * b_alpha[:, None], input_precision=DOT_PRECISION)
        b_a4 = tl.dot(b_pd, b_k4, b_a4 * b_alpha[:, None], input_precision=DOT_PRECISION)
        b_a5 = tl.dot(b_pd, b_k5, b_a5 * b_alpha[:, None], input_precision=DOT_PRECISION)
        b_a6 = tl.dot(b_pd, b_k6, b_a6 * b_alpha[:, None], input_precision=DOT_PRECISION)
        return b_a0, b_a1, b_a2, b_a3, b_a4, b_a5, b_a6, b_ar, b_l, b_m, b_ref_new
    b_s = tl.dot(b_q0, tl.trans(b_k0), input_precision=DOT_PRECISION) * b_c0[None, :]
    b_s += tl.dot(b_q1, tl.trans(b_k1), input_precision=DOT_PRECISION) * b_c1[None, :]
    b_s += tl.dot(b_q2, tl.trans(b_k2), input_precision=DOT_PRECISION) * b_c2[None, :]
    b_s += tl.dot(b_q3, tl.trans(b_k3), input_precision=DOT_PRECISION) * b_c3[None, :]
    b_s += tl.dot(b_q4, tl.trans(b_k4), input_precision=DOT_PRECISION) * b_c4[None, :]
    b_s += tl.dot(b_q5, tl.trans(b_k5), input_precision=DOT_PRECISION) * b_c5[None, :]
    b_s += tl.dot(b_q6, tl.trans(b_k6), input_precision=DOT_PRECISION) * b_c6[None, :]
    if not FP8_NATIVE:
        # on the NoPE logits rather than on the scales: 2^8 times a scale of 2^120 would be inf
        b_s = b_s * INT_DECODE_FACTOR
    b_kr = _v4_rope(KV, o_data, m_n, b_qr.dtype)
    b_s += tl.dot(b_qr, tl.trans(b_kr), input_precision=DOT_PRECISION)
    b_p, b_alpha, b_l, b_m = _softmax_step(b_s, m_n, qk_scale, b_m, b_l)
    b_ref_new = _v4_ref_scale(b_c0, b_c1, b_c2, b_c3, b_c4, b_c5, b_c6)
    # the RoPE accumulator (scale 1) in plain units, the NoPE ones in units of b_ref
    b_ar = tl.dot(b_p.to(b_qr.dtype), b_kr, b_ar * b_alpha[:, None], input_precision=DOT_PRECISION)
    b_alpha = b_alpha * (b_ref / b_ref_new)
    b_pr = b_p / b_ref_new
    b_a0 = _v4_pv(b_pr, b_c0, b_k0, b_a0, b_alpha, dtype, DOT_PRECISION)
    b_a1 = _v4_pv(b_pr, b_c1, b_k1, b_a1, b_alpha, dtype, DOT_PRECISION)
    b_a2 = _v4_pv(b_pr, b_c2, b_k2, b_a2, b_alpha, dtype, DOT_PRECISION)
    b_a3 = _v4_pv(b_pr, b_c3, b_k3, b_a3, b_alpha, dtype, DOT_PRECISION)
    b_a4 = _v4_pv(b_pr, b_c4, b_k4, b_a4, b_alpha, dtype, DOT_PRECISION)
    b_a5 = _v4_pv(b_pr, b_c5, b_k5, b_a5, b_alpha, dtype, DOT_PRECISION)
    b_a6 = _v4_pv(b_pr, b_c6, b_k6, b_a6, b_alpha, dtype, DOT_PRECISION)
    return b_a0, b_a1, b_a2, b_a3, b_a4, b_a5, b_a6, b_ar, b_l, b_m, b_ref_new


@triton.jit
def sparse_mla_ds_mla_v4_fwd_kernel(
    Q_nope,  # [T, H, 512]: NoPE 448 then RoPE 64, one q (R == 0)
    Q_rope,  # unused (the launch's common argument list)
    KV,  # uint8 pages: page b at b * stride_kb, its data rows then its scale rows
    Idx,  # int32 [T, W]
    Counts,  # int32 [T], any stride (HAS_COUNTS)
    BlockTable,  # int32 [num_reqs, max_blocks] (HAS_BT)
    ReqIds,  # int32 [T], any stride (HAS_BT, EXTRA_HAS_BT)
    KScale,  # unused
    Out,  # [T, H, 512] q dtype (not SPLIT)
    Lse,  # fp32 [T, H] (STORE_LSE)
    OPart,  # fp32 [T, S, H, 512] (SPLIT)
    LsePart,  # fp32 [T, S, H] (SPLIT)
    Sink,  # fp32 [H], any stride (HAS_SINK)
    sm_scale,
    k_scale_val,  # unused
    H,
    W,
    num_rows,
    page_size,
    split_len,
    num_splits,
    num_hb,
    stride_qnt,
    stride_qnh,
    stride_qnd,
    stride_qrt,  # unused
    stride_qrh,  # unused
    stride_qrd,  # unused
    stride_kb,
    stride_kr,  # unused: data rows are 576 bytes apart whatever the tensor's row stride (584)
    stride_kd,  # unused (1)
    stride_it,
    stride_iw,
    stride_btr,
    stride_btb,
    stride_ct,
    stride_rq,
    bt_block_size,
    bt_max_blocks,
    stride_ot,
    stride_oh,
    stride_od,
    stride_sink,
    ExtraKV,  # the extra set (HAS_EXTRA; all None without one), as in latent.py
    ExtraIdx,
    ExtraCounts,
    ExtraBlockTable,
    extra_width,
    extra_offset,
    extra_num_rows,
    extra_page_size,
    stride_xkb,
    stride_xkr,  # unused
    stride_xkd,  # unused
    stride_xit,
    stride_xiw,
    stride_xbtr,
    stride_xbtb,
    stride_xct,
    extra_bt_block_size,
    extra_bt_max_blocks,
    L: tl.constexpr,
    R: tl.constexpr,
    BLOCK_H: tl.constexpr,
    BLOCK_N: tl.constexpr,
    FP8_NATIVE: tl.constexpr,
    MMA_FP16: tl.constexpr,
    FOLD_FP16: tl.constexpr,  # fp16 MMAs with the scales folded (module docstring)
    STAGE: tl.constexpr,
    IDX_AHEAD: tl.constexpr,  # each step's indices loaded one step earlier (latent.py)
    HAS_COUNTS: tl.constexpr,
    HAS_BT: tl.constexpr,
    BT_SHIFT: tl.constexpr,
    PAGE_SHIFT: tl.constexpr,
    SPLIT: tl.constexpr,
    STORE_LSE: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
    PDL: tl.constexpr,
    HAS_SINK: tl.constexpr,
    HAS_EXTRA: tl.constexpr,
    EXTRA_HAS_COUNTS: tl.constexpr,
    EXTRA_HAS_BT: tl.constexpr,
    EXTRA_BT_SHIFT: tl.constexpr,
    EXTRA_PAGE_SHIFT: tl.constexpr,
):
    tl.static_assert(L == V4_NOPE + V4_ROPE and R == 0, "the V4 record is one 512-wide row")
    if PDL:
        tl.extra.cuda.gdc_launch_dependents()  # as in latent.py
    i_hb, i_ts, i_s, i_t = _program_coords(num_hb, num_splits)
    if MMA_FP16:
        dtype = tl.float16
    else:
        dtype = Q_nope.dtype.element_ty
    LOG2E: tl.constexpr = 1.4426950408889634
    # MMAs with fp32's exponent range take the scales inside the tiles (module docstring)
    FOLD: tl.constexpr = dtype == tl.bfloat16 or dtype == tl.float32

    o_h, m_h, o_h64 = _head_offsets(i_hb, H, BLOCK_H)
    o_c = tl.arange(0, V4_GROUP)
    p_q = Q_nope + i_t * stride_qnt + o_h64[:, None] * stride_qnh + o_c[None, :] * stride_qnd
    m_q = m_h[:, None]
    b_q0 = tl.load(p_q, mask=m_q, other=0.0).to(dtype)
    b_q1 = tl.load(p_q + V4_GROUP * stride_qnd, mask=m_q, other=0.0).to(dtype)
    b_q2 = tl.load(p_q + 2 * V4_GROUP * stride_qnd, mask=m_q, other=0.0).to(dtype)
    b_q3 = tl.load(p_q + 3 * V4_GROUP * stride_qnd, mask=m_q, other=0.0).to(dtype)
    b_q4 = tl.load(p_q + 4 * V4_GROUP * stride_qnd, mask=m_q, other=0.0).to(dtype)
    b_q5 = tl.load(p_q + 5 * V4_GROUP * stride_qnd, mask=m_q, other=0.0).to(dtype)
    b_q6 = tl.load(p_q + 6 * V4_GROUP * stride_qnd, mask=m_q, other=0.0).to(dtype)
    # the RoPE part stays in q's dtype, as the bf16 RoPE keys are converted to it
    b_qr = tl.load(p_q + V4_NOPE * stride_qnd, mask=m_q, other=0.0)
    qk_scale = sm_scale * LOG2E

    b_m = tl.full([BLOCK_H], float("-inf"), dtype=tl.float32)
    b_l = tl.zeros([BLOCK_H], dtype=tl.float32)
    b_a0 = tl.zeros([BLOCK_H, V4_GROUP], dtype=tl.float32)
    b_a1 = tl.zeros([BLOCK_H, V4_GROUP], dtype=tl.float32)
    b_a2 = tl.zeros([BLOCK_H, V4_GROUP], dtype=tl.float32)
    b_a3 = tl.zeros([BLOCK_H, V4_GROUP], dtype=tl.float32)
    b_a4 = tl.zeros([BLOCK_H, V4_GROUP], dtype=tl.float32)
    b_a5 = tl.zeros([BLOCK_H, V4_GROUP], dtype=tl.float32)
    b_a6 = tl.zeros([BLOCK_H, V4_GROUP], dtype=tl.float32)
    b_ar = tl.zeros([BLOCK_H, V4_ROPE], dtype=tl.float32)
    b_ref = 1.0  # the NoPE accumulators' unit (ds_mla.py)
    i_req, w_lo, w_hi = _split_bounds(
        Counts, ReqIds, i_t, i_s, W, split_len, stride_ct, stride_rq, HAS_COUNTS, HAS_BT
    )
    b_idx_nx = _first_idx(Idx, i_t, w_lo, w_hi, stride_it, stride_iw, BLOCK_N, IDX_AHEAD)
    for w0 in range(w_lo, w_hi, BLOCK_N):
        b_idx, b_idx_nx = _step_idx(
            Idx, i_t, w0, w_hi, stride_it, stride_iw, b_idx_nx, BLOCK_N, IDX_AHEAD
        )
        b_page, b_slot, m_n = _row_page_slot(
            b_idx,
            BlockTable,
            i_req,
            stride_btr,
            stride_btb,
            bt_block_size,
            bt_max_blocks,
            num_rows,
            page_size,
            HAS_BT,
            BT_SHIFT,
            PAGE_SHIFT,
        )
        o_data, o_scale = _v4_rows(b_page, b_slot, stride_kb, page_size)
        b_a0, b_a1, b_a2, b_a3, b_a4, b_a5, b_a6, b_ar, b_l, b_m, b_ref = _v4_step(
            KV,
            o_data,
            o_scale,
            m_n,
            b_q0,
            b_q1,
            b_q2,
            b_q3,
            b_q4,
            b_q5,
            b_q6,
            b_qr,
            b_a0,
            b_a1,
            b_a2,
            b_a3,
            b_a4,
            b_a5,
            b_a6,
            b_ar,
            b_l,
            b_m,
            b_ref,
            qk_scale,
            STAGE,
            dtype,
            FP8_NATIVE,
            DOT_PRECISION,
            FOLD,
            FOLD_FP16,
        )
    if HAS_EXTRA:
        # the extra set's part of this split, continuing the same softmax (latent.py)
        i_xreq, x_lo, x_hi = _extra_bounds(
            ExtraCounts,
            ReqIds,
            i_t,
            i_s,
            split_len,
            extra_width,
            extra_offset,
            stride_xct,
            stride_rq,
            EXTRA_HAS_COUNTS,
            EXTRA_HAS_BT,
        )
        # a block table keeps the in-step loop (KernelConfig.idx_ahead)
        X_AHEAD: tl.constexpr = IDX_AHEAD and not EXTRA_HAS_BT
        b_idx_nx = _first_idx(ExtraIdx, i_t, x_lo, x_hi, stride_xit, stride_xiw, BLOCK_N, X_AHEAD)
        for x0 in range(x_lo, x_hi, BLOCK_N):
            b_idx, b_idx_nx = _step_idx(
                ExtraIdx, i_t, x0, x_hi, stride_xit, stride_xiw, b_idx_nx, BLOCK_N, X_AHEAD
            )
            b_page, b_slot, m_n = _row_page_slot(
                b_idx,
                ExtraBlockTable,
                i_xreq,
                stride_xbtr,
                stride_xbtb,
                extra_bt_block_size,
                extra_bt_max_blocks,
                extra_num_rows,
                extra_page_size,
                EXTRA_HAS_BT,
                EXTRA_BT_SHIFT,
                EXTRA_PAGE_SHIFT,
            )
            o_data, o_scale = _v4_rows(b_page, b_slot, stride_xkb, extra_page_size)
            b_a0, b_a1, b_a2, b_a3, b_a4, b_a5, b_a6, b_ar, b_l, b_m, b_ref = _v4_step(
                ExtraKV,
                o_data,
                o_scale,
                m_n,
                b_q0,
                b_q1,
                b_q2,
                b_q3,
                b_q4,
                b_q5,
                b_q6,
                b_qr,
                b_a0,
                b_a1,
                b_a2,
                b_a3,
                b_a4,
                b_a5,
                b_a6,
                b_ar,
                b_l,
                b_m,
                b_ref,
                qk_scale,
                STAGE,
                dtype,
                FP8_NATIVE,
                DOT_PRECISION,
                FOLD,
                FOLD_FP16,
            )

    # normalise; an empty (t, split) gives zeros and LSE -inf
    b_nonempty = b_l > 0.0
    b_inv = 1.0 / tl.where(b_nonempty, b_l, 1.0)
    if HAS_SINK and not SPLIT:  # a split's partial leaves the sink to the merge
        b_inv = _inv_denominator_with_sink(Sink, stride_sink, o_h, m_h, b_l, b_m, LOG2E)
    b_lse = tl.where(
        b_nonempty, (b_m + tl.log2(tl.where(b_nonempty, b_l, 1.0))) / LOG2E, float("-inf")
    )
    b_inv_nope = b_inv * b_ref
    if not FP8_NATIVE and not (FOLD or FOLD_FP16):  # (folded tiles took it)
        b_inv_nope = b_inv_nope * INT_DECODE_FACTOR
    b_inv_nope = b_inv_nope[:, None]
    p_o, s_o = _out_rows(
        OPart, Out, i_ts, i_t, H, o_h, o_h64, stride_ot, stride_oh, stride_od, L, SPLIT
    )
    _store_cols(p_o, s_o, b_a0 * b_inv_nope, 0, V4_GROUP, m_h)
    _store_cols(p_o, s_o, b_a1 * b_inv_nope, V4_GROUP, V4_GROUP, m_h)
    _store_cols(p_o, s_o, b_a2 * b_inv_nope, 2 * V4_GROUP, V4_GROUP, m_h)
    _store_cols(p_o, s_o, b_a3 * b_inv_nope, 3 * V4_GROUP, V4_GROUP, m_h)
    _store_cols(p_o, s_o, b_a4 * b_inv_nope, 4 * V4_GROUP, V4_GROUP, m_h)
    _store_cols(p_o, s_o, b_a5 * b_inv_nope, 5 * V4_GROUP, V4_GROUP, m_h)
    _store_cols(p_o, s_o, b_a6 * b_inv_nope, 6 * V4_GROUP, V4_GROUP, m_h)
    _store_cols(p_o, s_o, b_ar * b_inv[:, None], V4_NOPE, V4_ROPE, m_h)
    _store_lse(LsePart, Lse, i_ts, i_t, H, o_h, m_h, b_lse, SPLIT, STORE_LSE)
