"""@triton.jit pieces every sparse MLA forward family uses: the program's coordinates, its slice of
the top-k list, the row gather's addresses, the online softmax step and the output rows.

Each family (latent.py, ds_mla.py) is one kernel that strings these together around its own
gather and MMAs; all of them share one runtime argument list (launch.py passes the same
arguments to whichever family the plan names).
"""

import triton
import triton.language as tl


@triton.jit
def _div_pow2(x, d, SHIFT: tl.constexpr):
    # (x // d, x % d) for non-negative int32 x; a shift when d == 2^SHIFT (SHIFT >= 0), since a
    # general integer division costs tens of instructions per index in the hot loop.
    if SHIFT >= 0:
        return x >> SHIFT, x & ((1 << SHIFT) - 1)
    else:
        q = x // d
        return q, x - q * d


@triton.jit
def _program_coords(num_hb, num_splits):
    # program -> (head block, (t, split) pair, split, t); head blocks of one token run side by
    # side so that a row gathered for one block is still in L2 for the next.
    i_p = tl.program_id(0)
    i_hb = i_p % num_hb
    i_ts = i_p // num_hb
    i_s = i_ts % num_splits
    i_t = (i_ts // num_splits).to(tl.int64)
    return i_hb, i_ts, i_s, i_t


@triton.jit
def _head_offsets(i_hb, H, BLOCK_H: tl.constexpr):
    # the block's heads, their mask, and the heads in 64 bits: a head-major q or out (vLLM's
    # ql_nope is a [H, T, L] matmul result viewed [T, H, L]) has head stride T * L, and
    # h * T * L passes 2^31 at ~30K tokens
    o_h = i_hb * BLOCK_H + tl.arange(0, BLOCK_H)
    m_h = o_h < H
    return o_h, m_h, o_h.to(tl.int64)


@triton.jit
def _load_q_rope(Q_rope, i_t, o_h64, m_h, stride_qrt, stride_qrh, stride_qrd, R: tl.constexpr):
    # [BLOCK_H, R] in q's dtype: the rope dot needs no conversion (ds_mla stores rope as bf16)
    o_r = tl.arange(0, R)
    p_qr = Q_rope + i_t * stride_qrt + o_h64[:, None] * stride_qrh + o_r[None, :] * stride_qrd
    return tl.load(p_qr, mask=m_h[:, None], other=0.0)


@triton.jit
def _split_bounds(
    Counts,
    ReqIds,
    i_t,
    i_s,
    W,
    split_len,
    stride_ct,
    stride_rq,
    HAS_COUNTS: tl.constexpr,
    HAS_BT: tl.constexpr,
):
    # (request of token t, [w_lo, w_hi) of its top-k list that split i_s walks)
    w_end = W
    if HAS_COUNTS:
        w_end = tl.minimum(tl.load(Counts + i_t * stride_ct), W)
    i_req = 0
    if HAS_BT:
        i_req = tl.load(ReqIds + i_t * stride_rq).to(tl.int64)
    w_lo = i_s * split_len
    w_hi = tl.minimum(w_lo + split_len, w_end)
    return i_req, w_lo, w_hi


@triton.jit
def _load_idx(Idx, i_t, w0, w_hi, stride_it, stride_iw, BLOCK_N: tl.constexpr):
    # the [BLOCK_N] top-k entries of gather step w0; -1 past the end of the split
    o_w = w0 + tl.arange(0, BLOCK_N)
    return tl.load(Idx + i_t * stride_it + o_w * stride_iw, mask=o_w < w_hi, other=-1)


@triton.jit
def _first_idx(
    Idx, i_t, w_lo, w_hi, stride_it, stride_iw, BLOCK_N: tl.constexpr, AHEAD: tl.constexpr
):
    # what a gather loop carries into its first step: that step's indices when they are loaded
    # a step ahead (AHEAD), else a placeholder the loop never reads
    if AHEAD:
        return _load_idx(Idx, i_t, w_lo, w_hi, stride_it, stride_iw, BLOCK_N)
    else:
        return tl.full([BLOCK_N], -1, tl.int32)


@triton.jit
def _step_idx(
    Idx, i_t, w0, w_hi, stride_it, stride_iw, b_idx_nx, BLOCK_N: tl.constexpr, AHEAD: tl.constexpr
):
    # (gather step w0's indices, what the loop carries into the next step): with AHEAD the
    # indices loaded one step earlier, and the next step's loaded now, so that the gather's
    # addresses never wait on a load of the same step; else loaded in the step
    if AHEAD:
        return b_idx_nx, _load_idx(Idx, i_t, w0 + BLOCK_N, w_hi, stride_it, stride_iw, BLOCK_N)
    else:
        return _load_idx(Idx, i_t, w0, w_hi, stride_it, stride_iw, BLOCK_N), b_idx_nx


@triton.jit
def _row_page_slot(
    b_idx,
    BlockTable,
    i_req,
    stride_btr,
    stride_btb,
    bt_block_size,
    bt_max_blocks,
    num_rows,
    page_size,
    HAS_BT: tl.constexpr,
    BT_SHIFT: tl.constexpr,
    PAGE_SHIFT: tl.constexpr,
):
    # [BLOCK_N] indices -> (page, slot in the page, validity mask), int32.
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
    return b_page, b_slot, m_n


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
    # [BLOCK_N] indices -> (int64 element offsets of each row, validity mask)
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
    o_row = b_page.to(tl.int64) * stride_kb + b_slot.to(tl.int64) * stride_kr
    return o_row, m_n


@triton.jit
def _softmax_step(b_s, m_n, qk_scale, b_m, b_l):
    # one step of the online softmax over raw logits [BLOCK_H, BLOCK_N] (log2 domain after
    # qk_scale) -> (P, the factor old accumulators take, new running sum, new running max).
    # Callers unpack in this order: Triton orders a loop's carried values by first assignment,
    # and sum-before-max is the order the kernels were measured (and sanitized) with.
    b_s = tl.where(m_n[None, :], b_s * qk_scale, float("-inf"))
    b_m_new = tl.maximum(b_m, tl.max(b_s, 1))
    # rows with nothing valid yet keep m = -inf; subtract 0 there so no -inf - -inf appears
    b_m_use = tl.where(b_m_new == float("-inf"), 0.0, b_m_new)
    b_alpha = tl.exp2(b_m - b_m_use)
    b_p = tl.exp2(b_s - b_m_use[:, None])
    b_l = b_l * b_alpha + tl.sum(b_p, 1)
    return b_p, b_alpha, b_l, b_m_new


@triton.jit
def _out_rows(
    OPart, Out, i_ts, i_t, H, o_h, o_h64, stride_ot, stride_oh, stride_od, L, SPLIT: tl.constexpr
):
    # [BLOCK_H] row pointers and the column stride of the destination: the fp32 split workspace
    # [T, S, H, L], or the final output in its dtype
    if SPLIT:
        p_o = OPart + (i_ts.to(tl.int64) * H + o_h) * L
        s_o = 1
    else:
        p_o = Out + i_t * stride_ot + o_h64 * stride_oh
        s_o = stride_od
    return p_o, s_o


@triton.jit
def _store_cols(p_o, s_o, b_out, col0, COLS: tl.constexpr, m_h):
    # columns [col0, col0 + COLS) of a normalised [BLOCK_H, COLS] output block
    o_c = col0 + tl.arange(0, COLS)
    tl.store(p_o[:, None] + o_c[None, :] * s_o, b_out.to(p_o.dtype.element_ty), mask=m_h[:, None])


@triton.jit
def _store_lse(
    LsePart, Lse, i_ts, i_t, H, o_h, m_h, b_lse, SPLIT: tl.constexpr, STORE_LSE: tl.constexpr
):
    # the split's LSE into the workspace, or the final LSE when asked for
    if SPLIT:
        tl.store(LsePart + i_ts.to(tl.int64) * H + o_h, b_lse, mask=m_h)
    elif STORE_LSE:
        tl.store(Lse + i_t * H + o_h, b_lse, mask=m_h)


@triton.jit
def _inv_denominator_with_sink(Sink, stride_sink, o_h, m_h, b_l, b_m, LOG2E: tl.constexpr):
    # 1 / (l + e^(sink_h - m)) per head row: the attention sink is one more softmax term with no
    # value row (natural-log units; l and m in the kernel's log2 units). An empty row keeps
    # m = -inf: measure the sink from 0 there, as the running sum does, so that a finite sink
    # gives zeros and a -inf sink no -inf - -inf. 0 where the denominator is 0 or inf (a +inf
    # sink: zero output).
    b_sink = tl.load(Sink + o_h * stride_sink, mask=m_h, other=float("-inf")).to(tl.float32)
    b_m_use = tl.where(b_m == float("-inf"), 0.0, b_m)
    b_den = b_l + tl.exp2(b_sink * LOG2E - b_m_use)
    return tl.where(b_den > 0.0, 1.0 / tl.where(b_den > 0.0, b_den, 1.0), 0.0)


@triton.jit
def _extra_bounds(
    ExtraCounts,
    ReqIds,
    i_t,
    i_s,
    split_len,
    extra_width,
    extra_offset,
    stride_xct,
    stride_rq,
    EXTRA_HAS_COUNTS: tl.constexpr,
    EXTRA_HAS_BT: tl.constexpr,
):
    # The extra index set continues the main one in a single sequence of gather steps: main
    # entry w at position w, extra entry j at extra_offset + j, where extra_offset is the main
    # width rounded up to whole steps (no step mixes the two sets). Split i_s walks positions
    # [i_s * split_len, (i_s + 1) * split_len) of that sequence; this returns (request of token
    # t, [x_lo, x_hi) of the extra list inside it), an empty range when the split holds none.
    x_end = extra_width
    if EXTRA_HAS_COUNTS:
        x_end = tl.minimum(tl.load(ExtraCounts + i_t * stride_xct), extra_width)
    i_req = 0
    if EXTRA_HAS_BT:
        i_req = tl.load(ReqIds + i_t * stride_rq).to(tl.int64)
    s_lo = i_s * split_len
    x_lo = tl.maximum(s_lo - extra_offset, 0)
    x_hi = tl.minimum(s_lo + split_len - extra_offset, x_end)
    return i_req, x_lo, x_hi
