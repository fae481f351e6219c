"""The latent-tile family: caches whose row is one plain [L + R] vector, in q's dtype
(kv_format "auto") or e4m3 with one per-tensor scale ("fp8").

One program owns (token t, split s, head block hb): it keeps BLOCK_H query heads in registers and
walks its slice of the token's top-k list BLOCK_N indices at a time, gathering each row once for
all of those heads. The gathered [BLOCK_N, L] latent tile is both K (with the rope part) and V.
"""

import triton
import triton.language as tl

from ...e4m3 import _e4m3_to
from .shared import (
    _extra_bounds,
    _first_idx,
    _head_offsets,
    _inv_denominator_with_sink,
    _load_idx,
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
def _load_latent(
    KV,
    o_row,
    m_n,
    stride_kd,
    dtype: tl.constexpr,
    L: tl.constexpr,
    E4M3: tl.constexpr,
    FP8_NATIVE: tl.constexpr,
    E4M3_DECODE: tl.constexpr,
):
    # the latent part of BLOCK_N gathered rows -> [BLOCK_N, L] in `dtype` (K and V at once)
    o_l = tl.arange(0, L)
    b_kn = tl.load(KV + o_row[:, None] + o_l[None, :] * stride_kd, mask=m_n[:, None], other=0)
    if E4M3:
        b_kn = _e4m3_to(b_kn, dtype, FP8_NATIVE, E4M3_DECODE)
    else:
        b_kn = b_kn.to(dtype)
    return b_kn


@triton.jit
def _load_rope(
    KV,
    o_row,
    m_n,
    stride_kd,
    dtype: tl.constexpr,
    L: tl.constexpr,
    R: tl.constexpr,
    E4M3: tl.constexpr,
    FP8_NATIVE: tl.constexpr,
    E4M3_DECODE: tl.constexpr,
):
    # the rope part of BLOCK_N gathered rows -> [BLOCK_N, R] in `dtype`. Written apart from
    # _load_latent, with L added after the broadcast: one helper over `col0 + arange` moved an
    # index computation and changed the step-ahead tiles' SASS (perf-log/10-asm-equivalence.txt)
    o_r = tl.arange(0, R)
    b_kr = tl.load(KV + o_row[:, None] + (L + o_r[None, :]) * stride_kd, mask=m_n[:, None], other=0)
    if E4M3:
        b_kr = _e4m3_to(b_kr, dtype, FP8_NATIVE, E4M3_DECODE)
    else:
        b_kr = b_kr.to(dtype)
    return b_kr


@triton.jit
def sparse_mla_latent_fwd_kernel(
    Q_nope,  # [T, H, L]
    Q_rope,  # [T, H, R]
    KV,  # paged rows: element (row r, col d) at (r // page)*stride_kb + (r % page)*stride_kr + d*stride_kd
    Idx,  # int32 [T, W]
    Counts,  # int32 [T], any stride (HAS_COUNTS)
    BlockTable,  # int32 [num_reqs, max_blocks] (HAS_BT)
    ReqIds,  # int32 [T], any stride (HAS_BT)
    KScale,  # fp32 [1] (K_SCALE_PTR)
    Out,  # [T, H, L] q dtype (not SPLIT)
    Lse,  # fp32 [T, H] (STORE_LSE)
    OPart,  # fp32 [T, S, H, L] (SPLIT)
    LsePart,  # fp32 [T, S, H] (SPLIT)
    Sink,  # fp32 [H], any stride (HAS_SINK)
    sm_scale,
    k_scale_val,
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
    stride_kd,
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
    ExtraKV,  # the extra set (HAS_EXTRA; all None without one): its cache, as KV
    ExtraIdx,  # int32 [T, extra_width]
    ExtraCounts,  # int32 [T], any stride (EXTRA_HAS_COUNTS)
    ExtraBlockTable,  # int32 [num_reqs, max_blocks] (EXTRA_HAS_BT; request ids from ReqIds)
    extra_width,
    extra_offset,  # position of the extra set's first entry in the split sequence
    extra_num_rows,
    extra_page_size,
    stride_xkb,
    stride_xkr,
    stride_xkd,
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
    E4M3: tl.constexpr,  # e4m3 bytes with a per-tensor scale (kv_format "fp8")
    FP8_NATIVE: tl.constexpr,
    E4M3_DECODE: tl.constexpr,  # without hardware fp8: ops/e4m3.py's E4M3_* decode forms
    MMA_FP16: tl.constexpr,
    HAS_COUNTS: tl.constexpr,
    HAS_BT: tl.constexpr,
    BT_SHIFT: tl.constexpr,
    PAGE_SHIFT: tl.constexpr,
    K_SCALE_PTR: tl.constexpr,
    SPLIT: tl.constexpr,
    STORE_LSE: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
    IDX_AHEAD: tl.constexpr,
    PDL: tl.constexpr,
    HAS_SINK: tl.constexpr,
    HAS_EXTRA: tl.constexpr,  # a second index set into a second cache, in the same softmax
    EXTRA_HAS_COUNTS: tl.constexpr,
    EXTRA_HAS_BT: tl.constexpr,
    EXTRA_BT_SHIFT: tl.constexpr,
    EXTRA_PAGE_SHIFT: tl.constexpr,
):
    if PDL:
        # the merge pass may launch now; its griddepcontrol.wait holds it until this grid is
        # complete and its stores are visible
        tl.extra.cuda.gdc_launch_dependents()
    i_hb, i_ts, i_s, i_t = _program_coords(num_hb, num_splits)
    # MMA operand type: q's dtype, or fp16 for an e4m3 cache (one conversion instruction per two
    # values, and e4m3 fits fp16 exactly) where the plan says so
    if MMA_FP16:
        dtype = tl.float16
    else:
        dtype = Q_nope.dtype.element_ty
    LOG2E: tl.constexpr = 1.4426950408889634

    o_h, m_h, o_h64 = _head_offsets(i_hb, H, BLOCK_H)
    o_l = tl.arange(0, L)
    if R > 0:
        b_qr = _load_q_rope(Q_rope, i_t, o_h64, m_h, stride_qrt, stride_qrh, stride_qrd, R)

    qk_scale = sm_scale * LOG2E
    if E4M3:
        if K_SCALE_PTR:
            k_scale = tl.load(KScale).to(tl.float32)
        else:
            k_scale = k_scale_val
        if not FP8_NATIVE:
            k_scale = k_scale * 256.0  # the integer decode's 2^-8 (common._e4m3_to)
        qk_scale = qk_scale * k_scale

    i_req, w_lo, w_hi = _split_bounds(
        Counts, ReqIds, i_t, i_s, W, split_len, stride_ct, stride_rq, HAS_COUNTS, HAS_BT
    )
    b_m = tl.full([BLOCK_H], float("-inf"), dtype=tl.float32)
    b_l = tl.zeros([BLOCK_H], dtype=tl.float32)
    p_qn = Q_nope + i_t * stride_qnt + o_h64[:, None] * stride_qnh + o_l[None, :] * stride_qnd
    b_qn = tl.load(p_qn, mask=m_h[:, None], other=0.0).to(dtype)  # [BLOCK_H, L]
    b_acc = tl.zeros([BLOCK_H, L], dtype=tl.float32)
    # With IDX_AHEAD each step's indices are loaded one step earlier, so the gather's addresses
    # never wait on a load of the same step: Triton's pipeliner then double-buffers the gather
    # (with num_stages >= 3) and the next rows stream in while this step is multiplied. Costs
    # registers: 64-head tiles spill with it.
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
        b_kn = _load_latent(KV, o_row, m_n, stride_kd, dtype, L, E4M3, FP8_NATIVE, E4M3_DECODE)
        b_s = tl.dot(b_qn, tl.trans(b_kn), input_precision=DOT_PRECISION)  # [BLOCK_H, BLOCK_N]
        if R > 0:
            b_kr = _load_rope(
                KV, o_row, m_n, stride_kd, b_qr.dtype, L, R, E4M3, FP8_NATIVE, E4M3_DECODE
            )
            b_s += tl.dot(b_qr, tl.trans(b_kr), input_precision=DOT_PRECISION)
        b_p, b_alpha, b_l, b_m = _softmax_step(b_s, m_n, qk_scale, b_m, b_l)
        b_acc = b_acc * b_alpha[:, None]
        b_acc = tl.dot(b_p.to(dtype), b_kn, b_acc, input_precision=DOT_PRECISION)
    if HAS_EXTRA:
        # the extra set's part of this split: the same step on the second cache, continuing the
        # running max, sum and accumulator, so both sets share one softmax
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
        for x0 in range(x_lo, x_hi, BLOCK_N):
            b_idx = _load_idx(ExtraIdx, i_t, x0, x_hi, stride_xit, stride_xiw, BLOCK_N)
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
            b_kn = _load_latent(
                ExtraKV, o_row, m_n, stride_xkd, dtype, L, E4M3, FP8_NATIVE, E4M3_DECODE
            )
            b_s = tl.dot(b_qn, tl.trans(b_kn), input_precision=DOT_PRECISION)
            if R > 0:
                b_kr = _load_rope(
                    ExtraKV,
                    o_row,
                    m_n,
                    stride_xkd,
                    b_qr.dtype,
                    L,
                    R,
                    E4M3,
                    FP8_NATIVE,
                    E4M3_DECODE,
                )
                b_s += tl.dot(b_qr, tl.trans(b_kr), input_precision=DOT_PRECISION)
            b_p, b_alpha, b_l, b_m = _softmax_step(b_s, m_n, qk_scale, b_m, b_l)
            b_acc = b_acc * b_alpha[:, None]
            b_acc = tl.dot(b_p.to(dtype), b_kn, b_acc, input_precision=DOT_PRECISION)

    # normalise; an empty (t, split) gives zeros and LSE -inf
    b_nonempty = b_l > 0.0
    b_inv = 1.0 / tl.where(b_nonempty, b_l, 1.0)
    if HAS_SINK and not SPLIT:  # a split's partial leaves the sink to the merge
        b_inv = _inv_denominator_with_sink(Sink, stride_sink, o_h, m_h, b_l, b_m, LOG2E)
    if E4M3:
        b_inv = b_inv * k_scale
    b_lse = tl.where(
        b_nonempty, (b_m + tl.log2(tl.where(b_nonempty, b_l, 1.0))) / LOG2E, float("-inf")
    )
    p_o, s_o = _out_rows(
        OPart, Out, i_ts, i_t, H, o_h, o_h64, stride_ot, stride_oh, stride_od, L, SPLIT
    )
    _store_cols(p_o, s_o, b_acc * b_inv[:, None], 0, L, m_h)
    _store_lse(LsePart, Lse, i_ts, i_t, H, o_h, m_h, b_lse, SPLIT, STORE_LSE)
