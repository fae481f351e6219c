"""Triton kernels for sparse MLA forward: a split-K attention pass and an LSE merge.

One program owns (token t, split s, head block hb): it keeps BLOCK_H query heads in registers and
walks its slice of the token's top-k list BLOCK_N indices at a time, gathering each KV row once
for all of those heads. The latent part of the row is both K (with the rope part) and V.

KV_FORMAT: 0 = cache in q's dtype, 1 = e4m3 with a per-tensor scale (folded into the softmax
scale and the output), 2 = fp8_ds_mla (656-byte rows: 512 e4m3, 4 fp32 scales, 64 bf16 rope).
"""

import triton
import triton.language as tl

from ..common import _div_pow2, _e4m3_to


@triton.jit
def _load_idx(Idx, i_t, w0, w_hi, stride_it, stride_iw, BLOCK_N: tl.constexpr):
    # the [BLOCK_N] top-k entries of gather step w0; -1 past the end of the split
    o_w = w0 + tl.arange(0, BLOCK_N)
    return tl.load(Idx + i_t * stride_it + o_w * stride_iw, mask=o_w < w_hi, other=-1)


@triton.jit
def _row_offsets(
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
    HAS_BT: tl.constexpr,
    BT_SHIFT: tl.constexpr,
    PAGE_SHIFT: tl.constexpr,
):
    # [BLOCK_N] indices -> (int64 element offsets of each row, validity mask).
    # Invalid entries are clamped to row 0 before any address is formed.
    m_n = b_idx >= 0
    if HAS_BT:
        b_pos = tl.where(m_n, b_idx, 0)
        b_blk, b_slot = _div_pow2(b_pos, bt_block_size, BT_SHIFT)
        m_n = m_n & (b_blk < bt_max_blocks)
        b_phys = tl.load(
            BlockTable + i_req * stride_btr + tl.where(m_n, b_blk, 0) * stride_btb,
            mask=m_n,
            other=-1,
        )
        # bound the block id first: phys * block_size must not wrap around int32
        m_n = m_n & (b_phys >= 0) & (b_phys <= num_rows // bt_block_size)
        b_idx = tl.where(m_n, b_phys, 0) * bt_block_size + b_slot
    m_n = m_n & (b_idx < num_rows)
    b_row = tl.where(m_n, b_idx, 0)  # int32: rows < 2^31, checked on the host
    b_page, b_slot = _div_pow2(b_row, page_size, PAGE_SHIFT)
    o_row = b_page.to(tl.int64) * stride_kb + b_slot.to(tl.int64) * stride_kr
    return o_row, m_n


@triton.jit
def _load_latent(
    KV,
    o_row,
    m_n,
    stride_kd,
    dtype: tl.constexpr,
    L: tl.constexpr,
    KV_FORMAT: tl.constexpr,
    FP8_NATIVE: tl.constexpr,
):
    # Gather the latent part of BLOCK_N rows -> [BLOCK_N, L] in `dtype` (K and V at once).
    o_l = tl.arange(0, L)
    b_kn = tl.load(KV + o_row[:, None] + o_l[None, :] * stride_kd, mask=m_n[:, None], other=0)
    if KV_FORMAT == 1:
        b_kn = _e4m3_to(b_kn, dtype, FP8_NATIVE)
    else:
        b_kn = b_kn.to(dtype)
    return b_kn


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
):
    # fp8_ds_mla chunk G of BLOCK_N rows: (e4m3 latent [BLOCK_N, C] cast to `dtype`, unscaled;
    # its float32 scale per row [BLOCK_N]). The integer decode leaves a factor 2^(7-15), put back
    # through the scale.
    o_c = tl.arange(0, C)
    b_k8 = tl.load(KV + o_row[:, None] + (G * C + o_c[None, :]), mask=m_n[:, None], other=0)
    p_sc = (KV + o_row + L + 4 * G).to(tl.pointer_type(tl.float32))
    b_sc = tl.load(p_sc, mask=m_n, other=0.0)
    if not FP8_NATIVE:
        b_sc = b_sc * 256.0
    b_k = _e4m3_to(b_k8, dtype, FP8_NATIVE)
    if STAGE:
        # masking after the cast keeps Triton from hoisting the cast into each dot's operand
        # layout: the tile is converted once and staged through shared memory as fp16, instead
        # of being re-read byte by byte (transposed, bank-conflicted) for the PV dot
        b_k = tl.where(m_n[:, None], b_k, 0.0)
    return b_k, b_sc


@triton.jit
def _load_rope(
    KV,
    o_row,
    m_n,
    stride_kd,
    dtype: tl.constexpr,
    L: tl.constexpr,
    R: tl.constexpr,
    KV_FORMAT: tl.constexpr,
    FP8_NATIVE: tl.constexpr,
):
    # Gather the rope part of BLOCK_N rows -> [BLOCK_N, R] in `dtype`.
    o_r = tl.arange(0, R)
    if KV_FORMAT == 2:
        p_rope = (KV + o_row + L + 16).to(tl.pointer_type(tl.bfloat16))  # after 4 fp32 scales
        b_kr = tl.load(p_rope[:, None] + o_r[None, :], mask=m_n[:, None], other=0.0).to(dtype)
    else:
        p_rope = KV + o_row[:, None] + (L + o_r[None, :]) * stride_kd
        b_kr = tl.load(p_rope, mask=m_n[:, None], other=0)
        if KV_FORMAT == 1:
            b_kr = _e4m3_to(b_kr, dtype, FP8_NATIVE)
        else:
            b_kr = b_kr.to(dtype)
    return b_kr


@triton.jit
def sparse_mla_fwd_kernel(
    Q_nope,  # [T, H, L]
    Q_rope,  # [T, H, R]
    KV,  # paged rows: element (row r, col d) at (r // page)*stride_kb + (r % page)*stride_kr + d*stride_kd
    Idx,  # int32 [T, W]
    Counts,  # int32 [T] (HAS_COUNTS)
    BlockTable,  # int32 [num_reqs, max_blocks] (HAS_BT)
    ReqIds,  # int32 [T] (HAS_BT)
    KScale,  # fp32 [1] (K_SCALE_PTR)
    Out,  # [T, H, L] q dtype (NUM_SPLITS == 1)
    Lse,  # fp32 [T, H] (STORE_LSE)
    OPart,  # fp32 [T, S, H, L] (SPLIT)
    LsePart,  # fp32 [T, S, H] (SPLIT)
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
    bt_block_size,
    bt_max_blocks,
    stride_ot,
    stride_oh,
    stride_od,
    L: tl.constexpr,
    R: tl.constexpr,
    BLOCK_H: tl.constexpr,
    BLOCK_N: tl.constexpr,
    KV_FORMAT: tl.constexpr,
    FP8_NATIVE: tl.constexpr,
    MMA_FP16: tl.constexpr,
    DS_STAGE: tl.constexpr,
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
):
    if PDL:
        # the merge pass may launch now; its griddepcontrol.wait holds it until this grid is
        # complete and its stores are visible
        tl.extra.cuda.gdc_launch_dependents()
    # program -> (t, split, head block); head blocks of one token run side by side so that a
    # row gathered for one block is still in L2 for the next.
    i_p = tl.program_id(0)
    i_hb = i_p % num_hb
    i_ts = i_p // num_hb
    i_s = i_ts % num_splits
    i_t = (i_ts // num_splits).to(tl.int64)
    # MMA operand type: q's dtype for a native cache; fp16 for an e4m3 cache (one conversion
    # instruction per two values, and e4m3 fits fp16 exactly), fp32 stays fp32.
    if MMA_FP16:
        dtype = tl.float16
    else:
        dtype = Q_nope.dtype.element_ty
    LOG2E: tl.constexpr = 1.4426950408889634

    o_h = i_hb * BLOCK_H + tl.arange(0, BLOCK_H)
    m_h = o_h < H
    o_l = tl.arange(0, L)

    if R > 0:
        o_r = tl.arange(0, R)
        p_qr = Q_rope + i_t * stride_qrt + o_h[:, None] * stride_qrh + o_r[None, :] * stride_qrd
        # the rope dot stays in q's dtype: ds_mla stores rope as bf16, nothing to convert
        b_qr = tl.load(p_qr, mask=m_h[:, None], other=0.0)  # [BLOCK_H, R]

    qk_scale = sm_scale * LOG2E
    if KV_FORMAT == 1:
        if K_SCALE_PTR:
            k_scale = tl.load(KScale).to(tl.float32)
        else:
            k_scale = k_scale_val
        if not FP8_NATIVE:
            k_scale = k_scale * 256.0
        qk_scale = qk_scale * k_scale

    w_end = W
    if HAS_COUNTS:
        w_end = tl.minimum(tl.load(Counts + i_t), W)
    i_req = 0
    if HAS_BT:
        i_req = tl.load(ReqIds + i_t).to(tl.int64)
    w_lo = i_s * split_len
    w_hi = tl.minimum(w_lo + split_len, w_end)

    b_m = tl.full([BLOCK_H], float("-inf"), dtype=tl.float32)
    b_l = tl.zeros([BLOCK_H], dtype=tl.float32)
    if KV_FORMAT == 2:
        # fp8_ds_mla: four 128-wide chunks, each with its own per-row scale. The scale multiplies
        # the chunk's logits column-wise and is folded into P before the chunk's PV dot, so the
        # e4m3 -> bf16 conversion stays a plain elementwise cast on the operand.
        C: tl.constexpr = L // 4
        o_c = tl.arange(0, C)
        p_q = Q_nope + i_t * stride_qnt + o_h[:, None] * stride_qnh + o_c[None, :] * stride_qnd
        b_q0 = tl.load(p_q, mask=m_h[:, None], other=0.0).to(dtype)
        b_q1 = tl.load(p_q + C * stride_qnd, mask=m_h[:, None], other=0.0).to(dtype)
        b_q2 = tl.load(p_q + 2 * C * stride_qnd, mask=m_h[:, None], other=0.0).to(dtype)
        b_q3 = tl.load(p_q + 3 * C * stride_qnd, mask=m_h[:, None], other=0.0).to(dtype)
        b_a0 = tl.zeros([BLOCK_H, C], dtype=tl.float32)
        b_a1 = tl.zeros([BLOCK_H, C], dtype=tl.float32)
        b_a2 = tl.zeros([BLOCK_H, C], dtype=tl.float32)
        b_a3 = tl.zeros([BLOCK_H, C], dtype=tl.float32)
        # P is scaled by scale / b_ref (b_ref: the tile's largest scale) so that it stays in
        # [0, 1] like an unscaled P; the accumulators are kept in units of the current b_ref.
        b_ref = 1.0
    else:
        p_qn = Q_nope + i_t * stride_qnt + o_h[:, None] * stride_qnh + o_l[None, :] * stride_qnd
        b_qn = tl.load(p_qn, mask=m_h[:, None], other=0.0).to(dtype)  # [BLOCK_H, L]
        b_acc = tl.zeros([BLOCK_H, L], dtype=tl.float32)
    if IDX_AHEAD:
        # Each step's indices are loaded one step earlier, so the gather's addresses never wait
        # on a load of the same step: Triton's pipeliner then double-buffers the gather (with
        # num_stages >= 3) and the next rows stream in while this step is multiplied. Costs
        # registers: 64-head tiles spill with it.
        b_idx_nx = _load_idx(Idx, i_t, w_lo, w_hi, stride_it, stride_iw, BLOCK_N)
    for w0 in range(w_lo, w_hi, BLOCK_N):
        if IDX_AHEAD:
            b_idx = b_idx_nx
            b_idx_nx = _load_idx(Idx, i_t, w0 + BLOCK_N, w_hi, stride_it, stride_iw, BLOCK_N)
        else:
            b_idx = _load_idx(Idx, i_t, w0, w_hi, stride_it, stride_iw, BLOCK_N)
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
        if KV_FORMAT == 2:
            b_k0, b_c0 = _ds_chunk(DS_STAGE, KV, o_row, m_n, 0, C, L, dtype, FP8_NATIVE)
            b_k1, b_c1 = _ds_chunk(DS_STAGE, KV, o_row, m_n, 1, C, L, dtype, FP8_NATIVE)
            b_k2, b_c2 = _ds_chunk(DS_STAGE, KV, o_row, m_n, 2, C, L, dtype, FP8_NATIVE)
            b_k3, b_c3 = _ds_chunk(DS_STAGE, KV, o_row, m_n, 3, C, L, dtype, FP8_NATIVE)
            # [BLOCK_H, BLOCK_N] logits
            b_s = tl.dot(b_q0, tl.trans(b_k0), input_precision=DOT_PRECISION) * b_c0[None, :]
            b_s += tl.dot(b_q1, tl.trans(b_k1), input_precision=DOT_PRECISION) * b_c1[None, :]
            b_s += tl.dot(b_q2, tl.trans(b_k2), input_precision=DOT_PRECISION) * b_c2[None, :]
            b_s += tl.dot(b_q3, tl.trans(b_k3), input_precision=DOT_PRECISION) * b_c3[None, :]
        else:
            b_kn = _load_latent(KV, o_row, m_n, stride_kd, dtype, L, KV_FORMAT, FP8_NATIVE)
            b_s = tl.dot(b_qn, tl.trans(b_kn), input_precision=DOT_PRECISION)
        if R > 0:
            b_kr = _load_rope(KV, o_row, m_n, stride_kd, b_qr.dtype, L, R, KV_FORMAT, FP8_NATIVE)
            b_s += tl.dot(b_qr, tl.trans(b_kr), input_precision=DOT_PRECISION)
        b_s = tl.where(m_n[None, :], b_s * qk_scale, float("-inf"))  # log2 domain
        b_m_new = tl.maximum(b_m, tl.max(b_s, 1))
        # rows with nothing valid yet keep m = -inf; subtract 0 there so no -inf - -inf appears
        b_m_use = tl.where(b_m_new == float("-inf"), 0.0, b_m_new)
        b_alpha = tl.exp2(b_m - b_m_use)
        b_p = tl.exp2(b_s - b_m_use[:, None])
        b_l = b_l * b_alpha + tl.sum(b_p, 1)
        b_m = b_m_new
        if KV_FORMAT == 2:
            b_cmax = tl.maximum(
                tl.maximum(tl.max(b_c0, 0), tl.max(b_c1, 0)),
                tl.maximum(tl.max(b_c2, 0), tl.max(b_c3, 0)),
            )
            b_ref_new = tl.where(b_cmax > 0.0, b_cmax, 1.0)
            b_alpha = b_alpha * (b_ref / b_ref_new)
            b_ref = b_ref_new
            b_pr = b_p / b_ref
            b_a0 = tl.dot(
                (b_pr * b_c0[None, :]).to(dtype),
                b_k0,
                b_a0 * b_alpha[:, None],
                input_precision=DOT_PRECISION,
            )
            b_a1 = tl.dot(
                (b_pr * b_c1[None, :]).to(dtype),
                b_k1,
                b_a1 * b_alpha[:, None],
                input_precision=DOT_PRECISION,
            )
            b_a2 = tl.dot(
                (b_pr * b_c2[None, :]).to(dtype),
                b_k2,
                b_a2 * b_alpha[:, None],
                input_precision=DOT_PRECISION,
            )
            b_a3 = tl.dot(
                (b_pr * b_c3[None, :]).to(dtype),
                b_k3,
                b_a3 * b_alpha[:, None],
                input_precision=DOT_PRECISION,
            )
        else:
            b_acc = b_acc * b_alpha[:, None]
            b_acc = tl.dot(b_p.to(dtype), b_kn, b_acc, input_precision=DOT_PRECISION)

    # normalise; an empty (t, split) gives zeros and LSE -inf
    b_nonempty = b_l > 0.0
    b_inv = 1.0 / tl.where(b_nonempty, b_l, 1.0)
    if KV_FORMAT == 1:
        b_inv = b_inv * k_scale
    if KV_FORMAT == 2:
        b_inv = b_inv * b_ref
    b_lse = tl.where(
        b_nonempty, (b_m + tl.log2(tl.where(b_nonempty, b_l, 1.0))) / LOG2E, float("-inf")
    )
    i_ts64 = i_ts.to(tl.int64)
    # [BLOCK_H] row pointers and the column stride of the destination: the fp32 split workspace
    # [T, S, H, L], or the final output in its dtype
    if SPLIT:
        p_o = OPart + (i_ts64 * H + o_h) * L
        s_o = 1
    else:
        p_o = Out + i_t * stride_ot + o_h * stride_oh
        s_o = stride_od
    if KV_FORMAT == 2:
        _store_cols(p_o, s_o, b_a0 * b_inv[:, None], 0, C, m_h)
        _store_cols(p_o, s_o, b_a1 * b_inv[:, None], C, C, m_h)
        _store_cols(p_o, s_o, b_a2 * b_inv[:, None], 2 * C, C, m_h)
        _store_cols(p_o, s_o, b_a3 * b_inv[:, None], 3 * C, C, m_h)
    else:
        _store_cols(p_o, s_o, b_acc * b_inv[:, None], 0, L, m_h)
    if SPLIT:
        tl.store(LsePart + i_ts64 * H + o_h, b_lse, mask=m_h)
    elif STORE_LSE:
        tl.store(Lse + i_t * H + o_h, b_lse, mask=m_h)


@triton.jit
def _store_cols(p_o, s_o, b_out, col0, COLS: tl.constexpr, m_h):
    # columns [col0, col0 + COLS) of a normalised [BLOCK_H, COLS] output block
    o_c = col0 + tl.arange(0, COLS)
    tl.store(p_o[:, None] + o_c[None, :] * s_o, b_out.to(p_o.dtype.element_ty), mask=m_h[:, None])


@triton.jit
def sparse_mla_merge_kernel(
    OPart,  # fp32 [T, S, H, L]
    LsePart,  # fp32 [T, S, H]
    Out,  # [T, H, L]
    Lse,  # fp32 [T, H]
    H,
    num_splits,
    stride_ot,
    stride_oh,
    stride_od,
    L: tl.constexpr,
    S_PAD: tl.constexpr,
    BLOCK_L: tl.constexpr,
    STORE_LSE: tl.constexpr,
    PDL: tl.constexpr,
):
    if PDL:
        tl.extra.cuda.gdc_wait()  # launched early (programmatic dependent): wait for the split pass
    # One program per (token, head, BLOCK_L output columns): all splits in one [S_PAD, BLOCK_L]
    # tile, so no program walks the splits serially.
    i_th = tl.program_id(0).to(tl.int64)
    i_l = tl.program_id(1)
    i_t = i_th // H
    i_h = i_th % H
    o_s = tl.arange(0, S_PAD)
    m_s = o_s < num_splits
    o_l = i_l * BLOCK_L + tl.arange(0, BLOCK_L)
    o_row = (i_t * num_splits + o_s) * H + i_h  # [S_PAD] rows of LsePart / OPart
    b_lse = tl.load(LsePart + o_row, mask=m_s, other=float("-inf"))
    b_max = tl.max(b_lse, 0)
    b_max_use = tl.where(b_max == float("-inf"), 0.0, b_max)
    b_w = tl.exp(b_lse - b_max_use)  # empty splits (LSE -inf) weigh 0
    b_den = tl.sum(b_w, 0)
    b_o = tl.load(OPart + o_row[:, None] * L + o_l[None, :], mask=m_s[:, None], other=0.0)
    b_out = tl.sum(b_w[:, None] * b_o, 0) / tl.where(b_den > 0.0, b_den, 1.0)
    tl.store(
        Out + i_t * stride_ot + i_h * stride_oh + o_l * stride_od, b_out.to(Out.dtype.element_ty)
    )
    if STORE_LSE:
        if i_l == 0:
            b_lse_out = tl.where(
                b_den > 0.0, b_max_use + tl.log(tl.where(b_den > 0.0, b_den, 1.0)), float("-inf")
            )
            tl.store(Lse + i_t * H + i_h, b_lse_out)
