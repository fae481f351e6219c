"""Rows in q's dtype (kv_format "auto") on sm90 in Gluon: the pipelined schedule with wgmma.

fp8_ds_mla's pipelined sm90 kernel (ds_mla_sm90_gluon.py) without the dequantization: the rows
of step i + 1 (512 latent values and 64 rope values, bf16 or fp16) are gathered with cp.async
into the other half of a two-slot ring while step i is multiplied, and the warpgroup MMAs read
the slot where the rows landed. 64 heads, 64-row steps, two warpgroups that split the step's
key columns for QK^T (P crosses to the other warpgroup through shared memory for PV) and the
output's columns for PV.

The runtime argument list is the Triton kernel's (latent.py); block tables, an extra index set
and e4m3 rows are refused by the plan before any launch.
"""

from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.ampere import async_copy
from triton.experimental.gluon.language.nvidia.hopper import (
    fence_async_shared,
    warpgroup_mma,
    warpgroup_mma_wait,
)

from .ampere_gluon import _gather_latent
from .ds_mla_sm90_gluon import (
    _BARRIER,
    LOG2E,
    _program_coords,
    _split_range,
    _store_result,
)


@gluon.jit
def sparse_mla_latent_sm90_gluon_kernel(
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
    L: gl.constexpr,
    R: gl.constexpr,
    BLOCK_H: gl.constexpr,
    BLOCK_N: gl.constexpr,
    E4M3: gl.constexpr,  # e4m3 bytes with a per-tensor scale (kv_format "fp8")
    FP8_NATIVE: gl.constexpr,
    E4M3_DECODE: gl.constexpr,  # without hardware fp8: ops/e4m3.py's E4M3_* decode forms
    MMA_FP16: gl.constexpr,
    HAS_COUNTS: gl.constexpr,
    HAS_BT: gl.constexpr,
    BT_SHIFT: gl.constexpr,
    PAGE_SHIFT: gl.constexpr,
    K_SCALE_PTR: gl.constexpr,
    SPLIT: gl.constexpr,
    STORE_LSE: gl.constexpr,
    DOT_PRECISION: gl.constexpr,
    IDX_AHEAD: gl.constexpr,
    PDL: gl.constexpr,
    HAS_SINK: gl.constexpr,
    HAS_EXTRA: gl.constexpr,  # a second index set into a second cache, in the same softmax
    EXTRA_HAS_COUNTS: gl.constexpr,
    EXTRA_HAS_BT: gl.constexpr,
    EXTRA_BT_SHIFT: gl.constexpr,
    EXTRA_PAGE_SHIFT: gl.constexpr,
):
    gl.static_assert(BLOCK_H == 64 and BLOCK_N == 64 and L == 512, "the 64 x 64 tile only")
    gl.static_assert(R == 64 or R == 0, "64 rope values or none")
    gl.static_assert(not E4M3 and not HAS_BT and not HAS_EXTRA, "q's dtype rows, flat indices")

    S_LAYOUT: gl.constexpr = gl.NVMMADistributedLayout(
        version=[3, 0], warps_per_cta=[4, 2], instr_shape=[16, 32, 16]
    )
    O_LAYOUT: gl.constexpr = gl.NVMMADistributedLayout(
        version=[3, 0], warps_per_cta=[4, 2], instr_shape=[16, 256, 16]
    )
    P_LAYOUT: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=O_LAYOUT, k_width=2)
    NOPE_LAYOUT: gl.constexpr = gl.BlockedLayout([1, 8], [1, 32], [8, 1], [1, 0])
    ROPE_LAYOUT: gl.constexpr = gl.BlockedLayout([1, 8], [8, 4], [8, 1], [1, 0])
    Q_LAYOUT: gl.constexpr = gl.BlockedLayout([1, 8], [2, 16], [8, 1], [1, 0])
    MMA_SMEM: gl.constexpr = gl.NVMMASharedLayout(
        swizzle_byte_width=128, element_bitwidth=16, rank=2
    )

    i_hb, i_ts, i_s, i_t = _program_coords(num_hb, num_splits)
    dtype: gl.constexpr = Q_nope.dtype.element_ty

    o_hq = i_hb * BLOCK_H + gl.arange(0, BLOCK_H, layout=gl.SliceLayout(1, Q_LAYOUT))
    m_hq = o_hq < H
    o_lq = gl.arange(0, L, layout=gl.SliceLayout(0, Q_LAYOUT))
    p_q = Q_nope + i_t * stride_qnt + o_hq.to(gl.int64)[:, None] * stride_qnh
    b_q = gl.load(p_q + o_lq[None, :] * stride_qnd, mask=m_hq[:, None], other=0.0)
    q_s = gl.allocate_shared_memory(dtype, [BLOCK_H, L], MMA_SMEM, b_q)
    if R > 0:
        o_rq = gl.arange(0, R, layout=gl.SliceLayout(0, Q_LAYOUT))
        p_qr = Q_rope + i_t * stride_qrt + o_hq.to(gl.int64)[:, None] * stride_qrh
        b_qr = gl.load(p_qr + o_rq[None, :] * stride_qrd, mask=m_hq[:, None], other=0.0)
        qr_s = gl.allocate_shared_memory(dtype, [BLOCK_H, R], MMA_SMEM, b_qr)

    # the ring: two slots of gathered rows, the MMAs' operands where they land
    nope_ring = gl.allocate_shared_memory(dtype, [2, BLOCK_N, L], MMA_SMEM)
    rope_ring = gl.allocate_shared_memory(dtype, [2, BLOCK_N, 64], MMA_SMEM)

    w_lo, w_hi, n_steps = _split_range(
        Counts, i_t, i_s, W, split_len, stride_ct, BLOCK_N, HAS_COUNTS
    )
    qk_scale = sm_scale * LOG2E
    b_m = gl.full([BLOCK_H], float("-inf"), gl.float32, layout=gl.SliceLayout(1, S_LAYOUT))
    b_l = gl.zeros([BLOCK_H], gl.float32, layout=gl.SliceLayout(1, S_LAYOUT))
    b_o = gl.zeros([BLOCK_H, L], gl.float32, layout=O_LAYOUT)

    m_next = _gather_latent(
        KV,
        Idx,
        i_t,
        w_lo,
        w_hi,
        stride_it,
        stride_iw,
        num_rows,
        page_size,
        stride_kb,
        stride_kr,
        nope_ring.index(0),
        rope_ring.index(0),
        BLOCK_N,
        L,
        R,
        PAGE_SHIFT,
        NOPE_LAYOUT,
        ROPE_LAYOUT,
        False,  # CHUNK_MAJOR: whole rows, as the wgmma reads them
    )
    async_copy.commit_group()
    for i_step in range(n_steps):
        slot = i_step % 2
        w0 = w_lo + i_step * BLOCK_N
        m_n = m_next
        # every thread is past its reads of the other slot (the previous step's MMAs, waited
        # for) before it refills
        _BARRIER()
        m_next = _gather_latent(
            KV,
            Idx,
            i_t,
            w0 + BLOCK_N,
            w_hi,
            stride_it,
            stride_iw,
            num_rows,
            page_size,
            stride_kb,
            stride_kr,
            nope_ring.index(1 - slot),
            rope_ring.index(1 - slot),
            BLOCK_N,
            L,
            R,
            PAGE_SHIFT,
            NOPE_LAYOUT,
            ROPE_LAYOUT,
            False,  # CHUNK_MAJOR: whole rows, as the wgmma reads them
        )
        async_copy.commit_group()
        async_copy.wait_group(1)  # this step's rows are in
        # cp.async wrote them through the generic proxy; the MMAs read through the async one
        fence_async_shared()
        _BARRIER()

        # QK^T: one chain (latent, then rope), one wait
        k_slot = nope_ring.index(slot)
        b_s = gl.zeros([BLOCK_H, BLOCK_N], gl.float32, layout=S_LAYOUT)
        b_s = warpgroup_mma(q_s, k_slot.permute((1, 0)), b_s, use_acc=False, is_async=True)
        if R > 0:
            b_s = warpgroup_mma(qr_s, rope_ring.index(slot).permute((1, 0)), b_s, is_async=True)
        m_s = gl.convert_layout(m_n, gl.SliceLayout(0, S_LAYOUT))
        b_s = warpgroup_mma_wait(num_outstanding=0, deps=(b_s,))

        # the online softmax step over the valid rows
        b_s = gl.where(m_s[None, :], b_s * qk_scale, float("-inf"))
        b_m_new = gl.maximum(b_m, gl.max(b_s, 1))
        b_m_use = gl.where(b_m_new == float("-inf"), 0.0, b_m_new)
        b_alpha = gl.exp2(b_m - b_m_use)
        b_p = gl.exp2(b_s - b_m_use[:, None])
        b_l = b_l * b_alpha + gl.sum(b_p, 1)
        b_m = b_m_new

        # PV: one chain into O, one wait (the slot is refilled only after it)
        b_o = b_o * gl.convert_layout(b_alpha, gl.SliceLayout(1, O_LAYOUT))[:, None]
        b_pd = gl.convert_layout(b_p.to(dtype), P_LAYOUT)
        b_o = warpgroup_mma(b_pd, k_slot, b_o, is_async=True)
        b_o = warpgroup_mma_wait(num_outstanding=0, deps=(b_o,))
    async_copy.wait_group(0)

    _store_result(
        b_o,
        b_m,
        b_l,
        1.0,
        Sink,
        Out,
        Lse,
        OPart,
        LsePart,
        i_t,
        i_ts,
        i_hb,
        H,
        stride_ot,
        stride_oh,
        stride_od,
        stride_sink,
        BLOCK_H,
        L,
        SPLIT,
        STORE_LSE,
        HAS_SINK,
        S_LAYOUT,
        O_LAYOUT,
    )
