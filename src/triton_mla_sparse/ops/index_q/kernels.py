"""Triton kernel for the DSA pre-attention query step without fp8 types.

One program owns (token t, head h). Heads [0, NUM_Q_HEADS) rotate the MLA query's rope part
(interleaved pairs 2i, 2i+1, as vLLM's MLA rope); heads [NUM_Q_HEADS, NUM_Q_HEADS + NUM_IQ_HEADS)
rotate one index-query head (NeoX pairs i, i + half, or interleaved) and scale its weight.

EMULATE_FP8 reproduces vLLM's SM90 quantisation in fp32 (a power-of-two scale per (token, head),
values rounded to the e4m3 grid, stored unscaled in the output dtype, the scale folded into the
weight) with integer/float arithmetic only, so it compiles where Triton has no fp8 types.
"""

import triton
import triton.language as tl

from ..e4m3 import _round_e4m3

E4M3_MAX = tl.constexpr(448.0)


@triton.jit
def index_q_rope_kernel(
    Pos,
    Qpe,
    stride_qt,
    stride_qh,
    QpeCosSin,
    stride_qcs,
    QpeOut,
    stride_qot,
    stride_qoh,
    Iq,
    stride_it,
    stride_ih,
    IqCosSin,
    stride_ics,
    IqOut,
    stride_iot,
    stride_ioh,
    W,
    stride_wt,
    stride_wh,
    WOut,
    stride_wot,
    w_scale,
    NUM_Q_HEADS: tl.constexpr,
    QPE_HALF: tl.constexpr,
    NUM_IQ_HEADS: tl.constexpr,
    IQ_DIM: tl.constexpr,
    IQ_HALF: tl.constexpr,
    INTERLEAVE: tl.constexpr,
    EMULATE_FP8: tl.constexpr,
):
    i_t = tl.program_id(0).to(tl.int64)
    i_h = tl.program_id(1)
    i_pos = tl.load(Pos + i_t).to(tl.int64)
    if i_h < NUM_Q_HEADS:
        # MLA query rope: cos at [0, half), sin at [half, 2 half) of the cache row.
        o_r = tl.arange(0, QPE_HALF)
        b_cos = tl.load(QpeCosSin + i_pos * stride_qcs + o_r).to(tl.float32)
        b_sin = tl.load(QpeCosSin + i_pos * stride_qcs + QPE_HALF + o_r).to(tl.float32)
        p_q = Qpe + i_t * stride_qt + i_h * stride_qh
        b_x1 = tl.load(p_q + 2 * o_r).to(tl.float32)
        b_x2 = tl.load(p_q + 2 * o_r + 1).to(tl.float32)
        p_o = QpeOut + i_t * stride_qot + i_h * stride_qoh
        dt = QpeOut.dtype.element_ty
        tl.store(p_o + 2 * o_r, (b_x1 * b_cos - b_x2 * b_sin).to(dt))
        tl.store(p_o + 2 * o_r + 1, (b_x2 * b_cos + b_x1 * b_sin).to(dt))
    else:
        # (names differ from the branch above: Triton unifies variables across branches)
        i_ih = i_h - NUM_Q_HEADS
        o_d = tl.arange(0, IQ_DIM)
        m_rope = o_d < 2 * IQ_HALF
        if INTERLEAVE:
            o_cs = o_d // 2
            o_partner = tl.where(m_rope, o_d ^ 1, o_d)
            b_sign = tl.where(o_d % 2 == 0, -1.0, 1.0)
        else:
            o_cs = o_d % IQ_HALF
            o_partner = tl.where(m_rope, o_d ^ IQ_HALF, o_d)
            b_sign = tl.where(o_d < IQ_HALF, -1.0, 1.0)
        b_icos = tl.load(IqCosSin + i_pos * stride_ics + o_cs, mask=m_rope, other=1.0)
        b_isin = tl.load(IqCosSin + i_pos * stride_ics + IQ_HALF + o_cs, mask=m_rope, other=0.0)
        p_iq = Iq + i_t * stride_it + i_ih * stride_ih
        b_q = tl.load(p_iq + o_d).to(tl.float32)
        b_p = tl.load(p_iq + o_partner).to(tl.float32)
        b_r = b_q * b_icos.to(tl.float32) + b_sign * b_p * b_isin.to(tl.float32)
        b_q = tl.where(m_rope, b_r, b_q)
        b_w = tl.load(W + i_t * stride_wt + i_ih * stride_wh).to(tl.float32) * w_scale
        if EMULATE_FP8:
            # vLLM's ue8m0 rule (kernels.py _fp8_ue8m0_quantize): 2^ceil(log2(max(amax,1e-4)/448))
            b_amax = tl.max(tl.abs(b_q), axis=0)
            # div_rn as vLLM: fp32 `/` lowers to an approximate division on NVIDIA, which can
            # push amax / 448 over a power of two and double the scale
            b_s = tl.div_rn(tl.maximum(b_amax, 1e-4), E4M3_MAX)
            b_s = tl.math.exp2(tl.math.ceil(tl.math.log2(b_s)))
            b_q = _round_e4m3(tl.div_rn(b_q, b_s))
            b_w = b_w * b_s
        p_io = IqOut + i_t * stride_iot + i_ih * stride_ioh
        tl.store(p_io + o_d, b_q.to(IqOut.dtype.element_ty))
        tl.store(WOut + i_t * stride_wot + i_ih, b_w)
