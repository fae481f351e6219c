"""The fp8_ds_mla family: 656-byte rows of 512 e4m3 latent values in four 128-wide chunks, each
with its own fp32 scale, then 64 bf16 rope values (kv_format.py has the layout).

Same program layout as the latent family (latent.py), but the latent tile is four chunk tiles:
a chunk's scale multiplies its logits column-wise and is folded into P before its PV dot, so
the e4m3 -> MMA-type conversion stays a plain elementwise cast on the operand (fp16 MMAs, exact).

With bf16 or fp32 MMAs, or fp16 ones where the launch asks for it (FOLD_FP16), each chunk's
scale multiplies its tile instead (FOLD), in fp32, rounded once to the MMA type: QK^T is one
chain of dots and every PV dot takes P as it is (fewer instructions per step:
docs/perf-log/19-v4-mma-dtype-sass.txt). In bf16 that rounding is the dequantization FlashMLA
does (8 significant bits, a bf16 cache's precision); in fp32 it is one fp32 rounding. fp16's
range is too narrow for the products themselves, so FOLD_FP16 forms them relative to the step's
largest scale (within +-448, 11 significant bits), scales the NoPE logits back by it once and
keeps the accumulators in its units, as the unfolded form does; chunks over 2^14 times smaller
than the step's largest lose bits to fp16's subnormals, as P times such a chunk's scale does in
the unfolded form.
"""

import triton
import triton.language as tl

from ...e4m3 import E4M3_PACKED_NO_MASK, _e4m3_to
from .shared import (
    _extra_bounds,
    _first_idx,
    _head_offsets,
    _inv_denominator_with_sink,
    _load_q_rope,
    _out_rows,
    _program_coords,
    _row_offsets,
    _softmax_step,
    _split_bounds,
    _step_idx,
    _store_cols,
    _store_lse,
)


@triton.jit
def _ds_scale(KV, o_row, m_n, G: tl.constexpr, L: tl.constexpr, FP8_NATIVE: tl.constexpr):
    # chunk G's float32 scale per row [BLOCK_N] (0 where masked). The integer decode leaves a
    # factor 2^(7-15) in the values, put back through the scale.
    p_sc = (KV + o_row + L + 4 * G).to(tl.pointer_type(tl.float32))
    b_sc = tl.load(p_sc, mask=m_n, other=0.0)
    if not FP8_NATIVE:
        b_sc = b_sc * 256.0
    return b_sc


@triton.jit
def _ds_ref_scale(b_c0, b_c1, b_c2, b_c3):
    # a step's reference scale: its largest (1 where every row is masked)
    b_cmax = tl.maximum(
        tl.maximum(tl.max(b_c0, 0), tl.max(b_c1, 0)),
        tl.maximum(tl.max(b_c2, 0), tl.max(b_c3, 0)),
    )
    return tl.where(b_cmax > 0.0, b_cmax, 1.0)


@triton.jit
def _ds_chunk(
    STAGE: tl.constexpr,
    KV,
    o_row,
    m_n,
    G: tl.constexpr,
    C: tl.constexpr,
    L: tl.constexpr,
    dtype: tl.constexpr,
    FP8_NATIVE: tl.constexpr,
    E4M3_DECODE: tl.constexpr,
):
    # chunk G of BLOCK_N rows: (e4m3 latent [BLOCK_N, C] cast to `dtype`, unscaled; its float32
    # scale per row [BLOCK_N])
    o_c = tl.arange(0, C)
    b_k8 = tl.load(KV + o_row[:, None] + (G * C + o_c[None, :]), mask=m_n[:, None], other=0)
    b_sc = _ds_scale(KV, o_row, m_n, G, L, FP8_NATIVE)
    b_k = _e4m3_to(b_k8, dtype, FP8_NATIVE, E4M3_DECODE)
    if STAGE and not (E4M3_DECODE == E4M3_PACKED_NO_MASK and not FP8_NATIVE):
        # applying the row mask after the cast keeps Triton from hoisting the cast into each
        # dot's operand layout: the tile is converted once and staged through shared memory as
        # fp16, instead of being re-read byte by byte (transposed, bank-conflicted) for the PV
        # dot. The load's zero fill already decodes to 0.0, so the mask is only that barrier.
        # As a multiply by 1.0 / 0.0 it is one packed multiply per two values; a select cost
        # unpack, select and repack (16-head tile: 1367 -> 1154 SASS per step on sm90, 1508 ->
        # 1313 on sm80's packed decode). An identity inline asm is no barrier: Triton sinks the
        # cast through it. The packed decode's no-mask variant drops the barrier altogether.
        b_k = b_k * m_n[:, None].to(b_k.dtype)
    return b_k, b_sc


@triton.jit
def _ds_folded_chunk(
    KV,
    o_row,
    m_n,
    b_rel,
    G: tl.constexpr,
    C: tl.constexpr,
    dtype: tl.constexpr,
    FP8_NATIVE: tl.constexpr,
    E4M3_DECODE: tl.constexpr,
):
    # chunk G of BLOCK_N rows dequantized in `dtype` relative to the step's reference scale:
    # e4m3 x (scale / reference) per row (b_rel), one rounding; the masked ratio is also the
    # barrier that keeps the tile staged. In fp16 the product is formed there, two values per
    # packed multiply: e4m3 converts to fp16 exactly, so with the ratio exact in fp16 (power-of-
    # two scales) the result is the fp32 product's rounding bit for bit; with fp32 scales the
    # ratio's own fp16 rounding adds at most as much again
    o_c = tl.arange(0, C)
    b_k8 = tl.load(KV + o_row[:, None] + (G * C + o_c[None, :]), mask=m_n[:, None], other=0)
    if dtype == tl.float16:
        b_h = _e4m3_to(b_k8, tl.float16, FP8_NATIVE, E4M3_DECODE)
        return b_h * tl.where(m_n, b_rel, 0.0).to(tl.float16)[:, None]
    b_f = _e4m3_to(b_k8, tl.float32, FP8_NATIVE, E4M3_DECODE)
    return (b_f * tl.where(m_n, b_rel, 0.0)[:, None]).to(dtype)


@triton.jit
def _ds_rope(KV, o_row, m_n, dtype: tl.constexpr, L: tl.constexpr, R: tl.constexpr):
    # the bf16 rope values after the four fp32 scales -> [BLOCK_N, R] in `dtype`
    o_r = tl.arange(0, R)
    p_rope = (KV + o_row + L + 16).to(tl.pointer_type(tl.bfloat16))
    return tl.load(p_rope[:, None] + o_r[None, :], mask=m_n[:, None], other=0.0).to(dtype)


@triton.jit
def _ds_pv(b_pr, b_c, b_k, b_a, b_alpha, dtype: tl.constexpr, DOT_PRECISION: tl.constexpr):
    # one chunk's accumulator after a step: rescaled by alpha, plus (P * chunk scale) @ V chunk
    return tl.dot(
        (b_pr * b_c[None, :]).to(dtype), b_k, b_a * b_alpha[:, None], input_precision=DOT_PRECISION
    )


@triton.jit
def _ds_step(
    KV,
    o_row,
    m_n,
    b_q0,
    b_q1,
    b_q2,
    b_q3,
    b_qr,
    b_a0,
    b_a1,
    b_a2,
    b_a3,
    b_l,
    b_m,
    b_ref,
    qk_scale,
    STAGE: tl.constexpr,
    C: tl.constexpr,
    L: tl.constexpr,
    R: tl.constexpr,
    dtype: tl.constexpr,
    FP8_NATIVE: tl.constexpr,
    E4M3_DECODE: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
    FOLD: tl.constexpr,
    FOLD_FP16: tl.constexpr,
):
    # one gather step of the extra set, and of the main set in the folded form (the fp16 form's
    # main-loop step is written out in the kernel, as measured) -> the updated accumulators,
    # running sum, running max and reference scale
    if FOLD:
        b_c0 = _ds_scale(KV, o_row, m_n, 0, L, FP8_NATIVE)
        b_c1 = _ds_scale(KV, o_row, m_n, 1, L, FP8_NATIVE)
        b_c2 = _ds_scale(KV, o_row, m_n, 2, L, FP8_NATIVE)
        b_c3 = _ds_scale(KV, o_row, m_n, 3, L, FP8_NATIVE)
        if FOLD_FP16:
            # the step's largest scale first: the chunks are dequantized relative to it, the
            # NoPE logits (one accumulation chain) scaled back by it once, and the accumulators
            # kept in its units (b_ref, as in the unfolded form)
            b_ref_new = _ds_ref_scale(b_c0, b_c1, b_c2, b_c3)
            b_inv_ref = 1.0 / b_ref_new
        else:
            # bf16 and fp32 hold the products as they are (fp32's exponent range)
            b_ref_new = b_ref
            b_inv_ref = 1.0
        b_k0 = _ds_folded_chunk(
            KV, o_row, m_n, b_c0 * b_inv_ref, 0, C, dtype, FP8_NATIVE, E4M3_DECODE
        )
        b_k1 = _ds_folded_chunk(
            KV, o_row, m_n, b_c1 * b_inv_ref, 1, C, dtype, FP8_NATIVE, E4M3_DECODE
        )
        b_k2 = _ds_folded_chunk(
            KV, o_row, m_n, b_c2 * b_inv_ref, 2, C, dtype, FP8_NATIVE, E4M3_DECODE
        )
        b_k3 = _ds_folded_chunk(
            KV, o_row, m_n, b_c3 * b_inv_ref, 3, C, dtype, FP8_NATIVE, E4M3_DECODE
        )
        b_s = tl.dot(b_q0, tl.trans(b_k0), input_precision=DOT_PRECISION)
        b_s = tl.dot(b_q1, tl.trans(b_k1), b_s, input_precision=DOT_PRECISION)
        b_s = tl.dot(b_q2, tl.trans(b_k2), b_s, input_precision=DOT_PRECISION)
        b_s = tl.dot(b_q3, tl.trans(b_k3), b_s, input_precision=DOT_PRECISION)
        if FOLD_FP16:
            b_s = b_s * b_ref_new
        if R > 0:
            b_kr = _ds_rope(KV, o_row, m_n, b_qr.dtype, L, R)
            b_s = tl.dot(b_qr, tl.trans(b_kr), b_s, input_precision=DOT_PRECISION)
        b_p, b_alpha, b_l, b_m = _softmax_step(b_s, m_n, qk_scale, b_m, b_l)
        if FOLD_FP16:
            b_alpha = b_alpha * (b_ref / b_ref_new)
        b_pd = b_p.to(dtype)
        b_a0 = tl.dot(b_pd, b_k0, b_a0 * b_alpha[:, None], input_precision=DOT_PRECISION)
        b_a1 = tl.dot(b_pd, b_k1, b_a1 * b_alpha[:, None], input_precision=DOT_PRECISION)
        b_a2 = tl.dot(b_pd, b_k2, b_a2 * b_alpha[:, None], input_precision=DOT_PRECISION)
        b_a3 = tl.dot(b_pd, b_k3, b_a3 * b_alpha[:, None], input_precision=DOT_PRECISION)
        return b_a0, b_a1, b_a2, b_a3, b_l, b_m, b_ref_new
    b_k0, b_c0 = _ds_chunk(STAGE, KV, o_row, m_n, 0, C, L, dtype, FP8_NATIVE, E4M3_DECODE)
    b_k1, b_c1 = _ds_chunk(STAGE, KV, o_row, m_n, 1, C, L, dtype, FP8_NATIVE, E4M3_DECODE)
    b_k2, b_c2 = _ds_chunk(STAGE, KV, o_row, m_n, 2, C, L, dtype, FP8_NATIVE, E4M3_DECODE)
    b_k3, b_c3 = _ds_chunk(STAGE, KV, o_row, m_n, 3, C, L, dtype, FP8_NATIVE, E4M3_DECODE)
    b_s = tl.dot(b_q0, tl.trans(b_k0), input_precision=DOT_PRECISION) * b_c0[None, :]
    b_s += tl.dot(b_q1, tl.trans(b_k1), input_precision=DOT_PRECISION) * b_c1[None, :]
    b_s += tl.dot(b_q2, tl.trans(b_k2), input_precision=DOT_PRECISION) * b_c2[None, :]
    b_s += tl.dot(b_q3, tl.trans(b_k3), input_precision=DOT_PRECISION) * b_c3[None, :]
    if R > 0:
        b_kr = _ds_rope(KV, o_row, m_n, b_qr.dtype, L, R)
        b_s += tl.dot(b_qr, tl.trans(b_kr), input_precision=DOT_PRECISION)
    b_p, b_alpha, b_l, b_m = _softmax_step(b_s, m_n, qk_scale, b_m, b_l)
    b_ref_new = _ds_ref_scale(b_c0, b_c1, b_c2, b_c3)
    b_alpha = b_alpha * (b_ref / b_ref_new)
    b_pr = b_p / b_ref_new
    b_a0 = _ds_pv(b_pr, b_c0, b_k0, b_a0, b_alpha, dtype, DOT_PRECISION)
    b_a1 = _ds_pv(b_pr, b_c1, b_k1, b_a1, b_alpha, dtype, DOT_PRECISION)
    b_a2 = _ds_pv(b_pr, b_c2, b_k2, b_a2, b_alpha, dtype, DOT_PRECISION)
    b_a3 = _ds_pv(b_pr, b_c3, b_k3, b_a3, b_alpha, dtype, DOT_PRECISION)
    return b_a0, b_a1, b_a2, b_a3, b_l, b_m, b_ref_new


@triton.jit
def sparse_mla_ds_mla_fwd_kernel(
    Q_nope,  # [T, H, 512]
    Q_rope,  # [T, H, R], R = 64 or 0
    KV,  # uint8 656-byte rows, paged as in latent.py (unit column stride)
    Idx,  # int32 [T, W]
    Counts,  # int32 [T], any stride (HAS_COUNTS)
    BlockTable,  # int32 [num_reqs, max_blocks] (HAS_BT)
    ReqIds,  # int32 [T], any stride (HAS_BT)
    KScale,  # unused (the launch's common argument list)
    Out,  # [T, H, L] q dtype (not SPLIT)
    Lse,  # fp32 [T, H] (STORE_LSE)
    OPart,  # fp32 [T, S, H, L] (SPLIT)
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
    stride_qrt,
    stride_qrh,
    stride_qrd,
    stride_kb,
    stride_kr,
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
    stride_xkr,
    stride_xkd,  # unused (1)
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
    FOLD_FP16: tl.constexpr,  # fp16 MMAs with the scales folded into the tile (module doc)
    STAGE: tl.constexpr,  # convert each chunk once, staged through shared memory
    E4M3_DECODE: tl.constexpr,  # without hardware fp8: ops/e4m3.py's E4M3_* decode forms
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
    HAS_EXTRA: tl.constexpr,  # a second index set into a second cache, in the same softmax
    EXTRA_HAS_COUNTS: tl.constexpr,
    EXTRA_HAS_BT: tl.constexpr,
    EXTRA_BT_SHIFT: tl.constexpr,
    EXTRA_PAGE_SHIFT: tl.constexpr,
):
    if PDL:
        tl.extra.cuda.gdc_launch_dependents()  # as in latent.py
    i_hb, i_ts, i_s, i_t = _program_coords(num_hb, num_splits)
    if MMA_FP16:
        dtype = tl.float16
    else:
        dtype = Q_nope.dtype.element_ty
    LOG2E: tl.constexpr = 1.4426950408889634
    # MMAs with fp32's exponent range take the scales inside the tiles; fp16 ones where asked
    FOLD: tl.constexpr = dtype == tl.bfloat16 or dtype == tl.float32 or FOLD_FP16

    o_h, m_h, o_h64 = _head_offsets(i_hb, H, BLOCK_H)
    if R > 0:
        b_qr = _load_q_rope(Q_rope, i_t, o_h64, m_h, stride_qrt, stride_qrh, stride_qrd, R)
    qk_scale = sm_scale * LOG2E
    i_req, w_lo, w_hi = _split_bounds(
        Counts, ReqIds, i_t, i_s, W, split_len, stride_ct, stride_rq, HAS_COUNTS, HAS_BT
    )

    b_m = tl.full([BLOCK_H], float("-inf"), dtype=tl.float32)
    b_l = tl.zeros([BLOCK_H], dtype=tl.float32)
    C: tl.constexpr = L // 4
    o_c = tl.arange(0, C)
    p_q = Q_nope + i_t * stride_qnt + o_h64[:, None] * stride_qnh + o_c[None, :] * stride_qnd
    b_q0 = tl.load(p_q, mask=m_h[:, None], other=0.0).to(dtype)
    b_q1 = tl.load(p_q + C * stride_qnd, mask=m_h[:, None], other=0.0).to(dtype)
    b_q2 = tl.load(p_q + 2 * C * stride_qnd, mask=m_h[:, None], other=0.0).to(dtype)
    b_q3 = tl.load(p_q + 3 * C * stride_qnd, mask=m_h[:, None], other=0.0).to(dtype)
    b_a0 = tl.zeros([BLOCK_H, C], dtype=tl.float32)
    b_a1 = tl.zeros([BLOCK_H, C], dtype=tl.float32)
    b_a2 = tl.zeros([BLOCK_H, C], dtype=tl.float32)
    b_a3 = tl.zeros([BLOCK_H, C], dtype=tl.float32)
    # P is scaled by scale / b_ref (b_ref: the step's largest scale) so that it stays in [0, 1]
    # like an unscaled P; the accumulators are kept in units of the current b_ref.
    b_ref = 1.0
    b_qx = b_q0  # stands in for the rope part of q where there is none (R == 0: unread)
    if R > 0:
        b_qx = b_qr
    b_idx_nx = _first_idx(Idx, i_t, w_lo, w_hi, stride_it, stride_iw, BLOCK_N, IDX_AHEAD)
    for w0 in range(w_lo, w_hi, BLOCK_N):
        b_idx, b_idx_nx = _step_idx(
            Idx, i_t, w0, w_hi, stride_it, stride_iw, b_idx_nx, BLOCK_N, IDX_AHEAD
        )
        o_row, m_n = _row_offsets(
            b_idx,
            BlockTable,
            i_req,
            stride_btr,
            stride_btb,
            bt_block_size,
            bt_max_blocks,
            num_rows,
            page_size,
            stride_kb,
            stride_kr,
            HAS_BT,
            BT_SHIFT,
            PAGE_SHIFT,
        )
        if FOLD:
            # the folded step is short enough to share with the extra set (the fp16 form below
            # stays written out, as it was measured)
            b_a0, b_a1, b_a2, b_a3, b_l, b_m, b_ref = _ds_step(
                KV,
                o_row,
                m_n,
                b_q0,
                b_q1,
                b_q2,
                b_q3,
                b_qx,
                b_a0,
                b_a1,
                b_a2,
                b_a3,
                b_l,
                b_m,
                b_ref,
                qk_scale,
                STAGE,
                C,
                L,
                R,
                dtype,
                FP8_NATIVE,
                E4M3_DECODE,
                DOT_PRECISION,
                FOLD,
                FOLD_FP16,
            )
        else:
            b_k0, b_c0 = _ds_chunk(STAGE, KV, o_row, m_n, 0, C, L, dtype, FP8_NATIVE, E4M3_DECODE)
            b_k1, b_c1 = _ds_chunk(STAGE, KV, o_row, m_n, 1, C, L, dtype, FP8_NATIVE, E4M3_DECODE)
            b_k2, b_c2 = _ds_chunk(STAGE, KV, o_row, m_n, 2, C, L, dtype, FP8_NATIVE, E4M3_DECODE)
            b_k3, b_c3 = _ds_chunk(STAGE, KV, o_row, m_n, 3, C, L, dtype, FP8_NATIVE, E4M3_DECODE)
            # [BLOCK_H, BLOCK_N] logits
            b_s = tl.dot(b_q0, tl.trans(b_k0), input_precision=DOT_PRECISION) * b_c0[None, :]
            b_s += tl.dot(b_q1, tl.trans(b_k1), input_precision=DOT_PRECISION) * b_c1[None, :]
            b_s += tl.dot(b_q2, tl.trans(b_k2), input_precision=DOT_PRECISION) * b_c2[None, :]
            b_s += tl.dot(b_q3, tl.trans(b_k3), input_precision=DOT_PRECISION) * b_c3[None, :]
            if R > 0:
                b_kr = _ds_rope(KV, o_row, m_n, b_qr.dtype, L, R)
                b_s += tl.dot(b_qr, tl.trans(b_kr), input_precision=DOT_PRECISION)
            b_p, b_alpha, b_l, b_m = _softmax_step(b_s, m_n, qk_scale, b_m, b_l)
            b_ref_new = _ds_ref_scale(b_c0, b_c1, b_c2, b_c3)
            b_alpha = b_alpha * (b_ref / b_ref_new)
            b_ref = b_ref_new
            b_pr = b_p / b_ref
            b_a0 = _ds_pv(b_pr, b_c0, b_k0, b_a0, b_alpha, dtype, DOT_PRECISION)
            b_a1 = _ds_pv(b_pr, b_c1, b_k1, b_a1, b_alpha, dtype, DOT_PRECISION)
            b_a2 = _ds_pv(b_pr, b_c2, b_k2, b_a2, b_alpha, dtype, DOT_PRECISION)
            b_a3 = _ds_pv(b_pr, b_c3, b_k3, b_a3, b_alpha, dtype, DOT_PRECISION)
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
            o_row, m_n = _row_offsets(
                b_idx,
                ExtraBlockTable,
                i_xreq,
                stride_xbtr,
                stride_xbtb,
                extra_bt_block_size,
                extra_bt_max_blocks,
                extra_num_rows,
                extra_page_size,
                stride_xkb,
                stride_xkr,
                EXTRA_HAS_BT,
                EXTRA_BT_SHIFT,
                EXTRA_PAGE_SHIFT,
            )
            b_a0, b_a1, b_a2, b_a3, b_l, b_m, b_ref = _ds_step(
                ExtraKV,
                o_row,
                m_n,
                b_q0,
                b_q1,
                b_q2,
                b_q3,
                b_qx,
                b_a0,
                b_a1,
                b_a2,
                b_a3,
                b_l,
                b_m,
                b_ref,
                qk_scale,
                STAGE,
                C,
                L,
                R,
                dtype,
                FP8_NATIVE,
                E4M3_DECODE,
                DOT_PRECISION,
                FOLD,
                FOLD_FP16,
            )

    # normalise; an empty (t, split) gives zeros and LSE -inf
    b_nonempty = b_l > 0.0
    b_inv = 1.0 / tl.where(b_nonempty, b_l, 1.0)
    if HAS_SINK and not SPLIT:  # a split's partial leaves the sink to the merge
        b_inv = _inv_denominator_with_sink(Sink, stride_sink, o_h, m_h, b_l, b_m, LOG2E)
    b_inv = b_inv * b_ref
    b_lse = tl.where(
        b_nonempty, (b_m + tl.log2(tl.where(b_nonempty, b_l, 1.0))) / LOG2E, float("-inf")
    )
    p_o, s_o = _out_rows(
        OPart, Out, i_ts, i_t, H, o_h, o_h64, stride_ot, stride_oh, stride_od, L, SPLIT
    )
    _store_cols(p_o, s_o, b_a0 * b_inv[:, None], 0, C, m_h)
    _store_cols(p_o, s_o, b_a1 * b_inv[:, None], C, C, m_h)
    _store_cols(p_o, s_o, b_a2 * b_inv[:, None], 2 * C, C, m_h)
    _store_cols(p_o, s_o, b_a3 * b_inv[:, None], 3 * C, C, m_h)
    _store_lse(LsePart, Lse, i_ts, i_t, H, o_h, m_h, b_lse, SPLIT, STORE_LSE)
