"""The LSE merge: combines the fp32 partial outputs of the split-K forward pass into the output."""

import triton
import triton.language as tl


@triton.jit
def sparse_mla_merge_kernel(
    OPart,  # fp32 [T, S, H, L]
    LsePart,  # fp32 [T, S, H]
    Out,  # [T, H, L]
    Lse,  # fp32 [T, H]
    Sink,  # fp32 [H], any stride (HAS_SINK)
    H,
    num_splits,
    stride_ot,
    stride_oh,
    stride_od,
    stride_sink,
    L: tl.constexpr,
    S_PAD: tl.constexpr,
    BLOCK_L: tl.constexpr,
    STORE_LSE: tl.constexpr,
    PDL: tl.constexpr,
    HAS_SINK: tl.constexpr,
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
    if HAS_SINK:
        # the attention sink, once for all splits: one more denominator term e^(sink - max),
        # in the LSEs' natural-log units (measured from 0 when every split is empty)
        b_sink = tl.load(Sink + i_h * stride_sink).to(tl.float32)
        b_norm = b_den + tl.exp(b_sink - b_max_use)
        b_out = tl.sum(b_w[:, None] * b_o, 0) / tl.where(b_norm > 0.0, b_norm, 1.0)
    else:
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
