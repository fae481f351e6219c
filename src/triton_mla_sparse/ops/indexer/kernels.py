"""Triton kernels of the DSA lightning indexer: paged decode logits and prefill logits.

``logit[r, s] = kscale[s] * sum_h w[r, h] * ReLU(q[r, h] . k[s])`` with fp32 accumulation.

One program owns ROWS logits rows that read the same K (decode: the next_n rows of one request;
prefill: consecutive query rows) and a chunk of K tokens. Per step it loads BLOCK_N K rows once
and computes the transposed product ``S^T = K [BLOCK_N, 128] @ Q^T [128, ROWS * BLOCK_H]`` (K
tokens along M, heads along N), so the ReLU-weighted head sum is a reduction along N of the
accumulator. Padding heads (H < BLOCK_H) and rows past the end carry weight 0 and q 0.

FP8_NATIVE: e4m3 via ``tl.float8e4nv`` (sm89+); otherwise the integer decode of ops/e4m3.py,
whose 2^-8 factor (per decoded operand) is folded into the weights. FP8_MMA: q and K stay e4m3
and the dot is e4m3 x e4m3 (q must be e4m3 and the decode native).
"""

import triton
import triton.language as tl

from ..e4m3 import _e4m3_to


@triton.jit
def _load_q(
    Q,
    W,
    o_q,
    o_w,
    i_row0,
    n_rows,
    H,
    stride_qr,
    stride_qh,
    stride_qd,
    stride_wr,
    stride_wh,
    D: tl.constexpr,
    ROWS: tl.constexpr,
    BLOCK_H: tl.constexpr,
    Q_FP8: tl.constexpr,
    FP8_NATIVE: tl.constexpr,
    FP8_MMA: tl.constexpr,
):
    # Q^T [D, ROWS * BLOCK_H] of rows i_row0 + c // BLOCK_H (head c % BLOCK_H) and their weights
    # [ROWS * BLOCK_H] in fp32, times the integer decode's 2^8 per decoded operand.
    o_c = tl.arange(0, ROWS * BLOCK_H)
    o_r = o_c // BLOCK_H  # BLOCK_H and PAGE are constexpr powers of two: shifts
    o_h = o_c % BLOCK_H
    m_c = (i_row0 + o_r < n_rows) & (o_h < H)
    o_d = tl.arange(0, D)
    p_q = Q + o_q + o_r[None, :].to(tl.int64) * stride_qr + o_h[None, :] * stride_qh
    b_q = tl.load(p_q + o_d[:, None] * stride_qd, mask=m_c[None, :], other=0)
    p_w = W + o_w + o_r.to(tl.int64) * stride_wr + o_h * stride_wh
    b_w = tl.load(p_w, mask=m_c, other=0).to(tl.float32)
    if not FP8_NATIVE:
        b_w = b_w * 256.0  # K's integer decode
    if Q_FP8:
        if FP8_MMA:
            b_q = b_q.to(tl.float8e4nv, bitcast=True)
        else:
            b_q = _e4m3_to(b_q, tl.float16, FP8_NATIVE)
            if not FP8_NATIVE:
                b_w = b_w * 256.0  # q's integer decode
    return b_q, b_w


@triton.jit
def _step_logits(
    b_k8,
    b_qt,
    b_w,
    b_sc,
    BLOCK_N: tl.constexpr,
    ROWS: tl.constexpr,
    BLOCK_H: tl.constexpr,
    FP8_NATIVE: tl.constexpr,
    FP8_MMA: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
):
    # [BLOCK_N, D] e4m3 bytes -> logits [BLOCK_N, ROWS] (fp32)
    if FP8_MMA:
        b_k = b_k8.to(tl.float8e4nv, bitcast=True)
    else:
        b_k = _e4m3_to(b_k8, b_qt.dtype, FP8_NATIVE)  # exact in fp16/bf16/fp32
    b_s = tl.dot(b_k, b_qt, input_precision=DOT_PRECISION, out_dtype=tl.float32)
    b_p = tl.maximum(b_s, 0.0) * b_w[None, :]
    if ROWS == 1:
        b_l = tl.sum(b_p, axis=1)[:, None]
    else:
        b_l = tl.sum(tl.reshape(b_p, (BLOCK_N, ROWS, BLOCK_H)), axis=2)
    return b_l * b_sc[:, None]


@triton.jit
def paged_mqa_logits_kernel(
    Q,  # [B, next_n, H, D] e4m3 bytes or fp16/bf16/fp32
    KV,  # uint8, block b at b * stride_kb: PAGE x D e4m3, then PAGE fp32 scales
    W,  # [B * next_n, H] float
    CtxLens,  # int32 [B] or [B, next_n] (CTX_2D)
    BlockTable,  # int32 [B, max_blocks]
    Out,  # fp32 [B * next_n, max_len]
    next_n,
    H,
    num_blocks,
    max_blocks,
    max_len,
    chunk,
    stride_qb,
    stride_qn,
    stride_qh,
    stride_qd,
    stride_kb,
    stride_wr,
    stride_wh,
    stride_cb,
    stride_cn,
    stride_btb,
    stride_btp,
    stride_or,
    stride_oc,
    D: tl.constexpr,
    PAGE: tl.constexpr,
    ROWS: tl.constexpr,
    BLOCK_H: tl.constexpr,
    BLOCK_N: tl.constexpr,
    CTX_2D: tl.constexpr,
    Q_FP8: tl.constexpr,
    FP8_NATIVE: tl.constexpr,
    FP8_MMA: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
    NUM_STAGES: tl.constexpr,
):
    i_b = tl.program_id(0)
    i_g = tl.program_id(1)
    i_c = tl.program_id(2)
    i_j0 = i_g * ROWS
    o_j = i_j0 + tl.arange(0, ROWS)
    m_j = o_j < next_n
    if CTX_2D:
        b_len = tl.load(CtxLens + i_b * stride_cb + o_j * stride_cn, mask=m_j, other=0)
    else:
        b_len = tl.load(CtxLens + i_b * stride_cb) - next_n + o_j + 1
    # a row covers [0, len): clamped so no store leaves the output row
    b_len = tl.where(m_j, tl.minimum(tl.maximum(b_len, 0), max_len), 0)
    # positions past the table are neither read nor written
    n_pos = tl.minimum(tl.max(b_len, axis=0), max_blocks * PAGE)
    p_lo = i_c * chunk
    if p_lo >= n_pos:
        return
    p_hi = tl.minimum(p_lo + chunk, n_pos)

    b_qt, b_w = _load_q(
        Q,
        W,
        i_b.to(tl.int64) * stride_qb + i_j0.to(tl.int64) * stride_qn,
        (i_b * next_n + i_j0).to(tl.int64) * stride_wr,
        i_j0,
        next_n,
        H,
        stride_qn,
        stride_qh,
        stride_qd,
        stride_wr,
        stride_wh,
        D,
        ROWS,
        BLOCK_H,
        Q_FP8,
        FP8_NATIVE,
        FP8_MMA,
    )
    o_d = tl.arange(0, D)
    p_bt = BlockTable + i_b.to(tl.int64) * stride_btb
    p_out = Out + (i_b * next_n + o_j).to(tl.int64) * stride_or
    for p0 in tl.range(p_lo, p_hi, BLOCK_N, num_stages=NUM_STAGES):
        o_p = p0 + tl.arange(0, BLOCK_N)
        m_p = o_p < p_hi
        o_blk = o_p // PAGE
        o_slot = o_p % PAGE
        b_phys = tl.load(p_bt + o_blk * stride_btp, mask=m_p, other=-1)
        m_k = m_p & (b_phys >= 0) & (b_phys < num_blocks)
        # invalid lanes read block 0, slot 0 (masked): no address outside the cache is formed
        o_row = tl.where(m_k, b_phys, 0).to(tl.int64) * stride_kb
        o_slot = tl.where(m_k, o_slot, 0)
        b_k8 = tl.load(
            KV + o_row[:, None] + (o_slot * D)[:, None] + o_d[None, :], mask=m_k[:, None], other=0
        )
        p_sc = (KV + o_row + PAGE * D + o_slot * 4).to(tl.pointer_type(tl.float32))
        b_sc = tl.load(p_sc, mask=m_k, other=0.0)
        b_l = _step_logits(
            b_k8,
            b_qt,
            b_w,
            b_sc,
            BLOCK_N,
            ROWS,
            BLOCK_H,
            FP8_NATIVE,
            FP8_MMA,
            DOT_PRECISION,
        )
        m_o = m_k[:, None] & (o_p[:, None] < b_len[None, :])
        tl.store(p_out[None, :] + (o_p.to(tl.int64) * stride_oc)[:, None], b_l, mask=m_o)


@triton.jit
def mqa_logits_kernel(
    Q,  # [M, H, D] e4m3 bytes or fp16/bf16/fp32
    K,  # uint8 [N, D] e4m3
    KScale,  # fp32 [N]
    W,  # [M, H] float
    SeqKs,  # int32 [M]
    SeqKe,  # int32 [M]
    Out,  # fp32 [M, max_len], compressed: column j of row m is K row ks[m] + j
    M,
    N,
    H,
    max_len,
    chunk,
    stride_qm,
    stride_qh,
    stride_qd,
    stride_kn,
    stride_kd,
    stride_ks,
    stride_wr,
    stride_wh,
    stride_om,
    stride_oc,
    D: tl.constexpr,
    ROWS: tl.constexpr,
    BLOCK_H: tl.constexpr,
    BLOCK_N: tl.constexpr,
    Q_FP8: tl.constexpr,
    FP8_NATIVE: tl.constexpr,
    FP8_MMA: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
    NUM_STAGES: tl.constexpr,
):
    # Programs split K by absolute row (chunk i_c), so rows of one block that start at different
    # ks (a request boundary) still share each K tile.
    i_m = tl.program_id(0)
    i_c = tl.program_id(1)
    i_m0 = i_m * ROWS
    o_m = i_m0 + tl.arange(0, ROWS)
    m_m = o_m < M
    b_ks = tl.load(SeqKs + o_m, mask=m_m, other=0)
    b_ke = tl.load(SeqKe + o_m, mask=m_m, other=0)
    b_len = tl.where(m_m, tl.minimum(tl.maximum(b_ke - b_ks, 0), max_len), 0)
    b_end = b_ks + b_len
    m_live = b_len > 0
    k_lo = tl.maximum(tl.min(tl.where(m_live, b_ks, N), axis=0), i_c * chunk)
    k_lo = tl.maximum(k_lo, 0)
    k_hi = tl.minimum(tl.max(tl.where(m_live, b_end, 0), axis=0), (i_c + 1) * chunk)
    k_hi = tl.minimum(k_hi, N)
    if k_lo >= k_hi:
        return

    b_qt, b_w = _load_q(
        Q,
        W,
        i_m0.to(tl.int64) * stride_qm,
        i_m0.to(tl.int64) * stride_wr,
        i_m0,
        M,
        H,
        stride_qm,
        stride_qh,
        stride_qd,
        stride_wr,
        stride_wh,
        D,
        ROWS,
        BLOCK_H,
        Q_FP8,
        FP8_NATIVE,
        FP8_MMA,
    )
    o_d = tl.arange(0, D)
    p_out = Out + o_m.to(tl.int64) * stride_om
    for k0 in tl.range(k_lo, k_hi, BLOCK_N, num_stages=NUM_STAGES):
        o_k = k0 + tl.arange(0, BLOCK_N)
        m_k = o_k < k_hi
        o_kc = tl.where(m_k, o_k, 0).to(tl.int64)
        b_k8 = tl.load(
            K + o_kc[:, None] * stride_kn + o_d[None, :] * stride_kd, mask=m_k[:, None], other=0
        )
        b_sc = tl.load(KScale + o_kc * stride_ks, mask=m_k, other=0.0)
        b_l = _step_logits(
            b_k8,
            b_qt,
            b_w,
            b_sc,
            BLOCK_N,
            ROWS,
            BLOCK_H,
            FP8_NATIVE,
            FP8_MMA,
            DOT_PRECISION,
        )
        o_col = o_k[:, None] - b_ks[None, :]
        m_o = m_k[:, None] & (o_k[:, None] >= b_ks[None, :]) & (o_k[:, None] < b_end[None, :])
        tl.store(p_out[None, :] + o_col.to(tl.int64) * stride_oc, b_l, mask=m_o)
