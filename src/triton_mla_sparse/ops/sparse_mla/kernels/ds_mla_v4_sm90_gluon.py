"""DeepSeek-V4's 584-byte record on sm90 in Gluon: 64 heads, 64-row steps, two schedules.

The Triton kernel (ds_mla_v4.py) folds the ue8m0 scales into bf16 tiles (exact: powers of two)
and runs eight 64-wide QK^T dots and eight PV dots per step, each waited for before the next,
with the dequantization in front of them. Both forms here build one [64, 512] bf16 tile per
step (448 dequantized NoPE values, then the 64 RoPE values: key and value alike) and run one
QK^T chain, the online softmax and one PV chain on it; the steps are the main set's, then the
extra set's (the sliding window and the compressed cache of DeepSeek-V4's decode, through their
own block tables where given).

- "specialized" (sparse_mla_ds_mla_v4_sm90_gluon_ws_kernel): one warpgroup gathers and
  dequantizes into a two-slot ring of tiles with the rows' validity; the two MMA warpgroups
  consume it under mbarriers.
- "pipelined" (sparse_mla_ds_mla_v4_sm90_gluon_kernel): one partition; step i + 1's NoPE bytes
  and RoPE values are gathered with cp.async into a two-slot ring (its scale bytes into
  registers) while step i is dequantized and multiplied.

The runtime argument list is the Triton kernel's (launch.py passes the same arguments); the
variants they do not implement (other tiles, fp16 MMAs, the integer e4m3 decode) are refused
by plan._check_gluon before any launch, and the pipelined form's unchecked 16-byte copies need
16-byte aligned caches (launch.py).
"""

from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.ampere import async_copy, mbarrier
from triton.experimental.gluon.language.nvidia.hopper import (
    fence_async_shared,
    warpgroup_mma,
    warpgroup_mma_wait,
)

from .ds_mla_sm90_gluon import LOG2E, _program_coords, _split_range, _store_result

# the CTA (or partition) barrier: barrier from Triton 3.8 on, thread_barrier in 3.6
_BARRIER = getattr(gl, "barrier", None) or gl.thread_barrier
# cp.async into shared memory: async_load from Triton 3.8 on, async_copy_global_to_shared in 3.6
_ASYNC_LOAD = getattr(async_copy, "async_load", None) or async_copy.async_copy_global_to_shared

V4_GROUP = gl.constexpr(64)  # NoPE values per ue8m0 scale
V4_NOPE = gl.constexpr(448)
V4_ROPE = gl.constexpr(64)
V4_DATA_BYTES = gl.constexpr(576)
V4_SCALE_BYTES = gl.constexpr(8)
FP32_MANTISSA_BITS = gl.constexpr(23)
DEQUANT_WARPS = gl.constexpr(4)
DEQUANT_REGS = gl.constexpr(112)


@gluon.jit
def _v4_row_offsets(
    Idx,
    BlockTable,
    i_t,
    i_req,
    w0,
    w_hi,
    stride_it,
    stride_iw,
    stride_btr,
    stride_btb,
    bt_block_size,
    bt_max_blocks,
    num_rows,
    page_size,
    stride_kb,
    BLOCK_N: gl.constexpr,
    HAS_BT: gl.constexpr,
    BT_SHIFT: gl.constexpr,
    PAGE_SHIFT: gl.constexpr,
    ROWS: gl.constexpr,
):
    # rows [w0, w0 + BLOCK_N) of token i_t's list (through its block table where given): each
    # row's data-row and scale-row byte offsets and whether it is valid, in layout ROWS
    o_w = w0 + gl.arange(0, BLOCK_N, layout=ROWS)
    b_idx = gl.load(Idx + i_t * stride_it + o_w * stride_iw, mask=o_w < w_hi, other=-1)
    m_n = b_idx >= 0
    if HAS_BT:
        b_pos = gl.where(m_n, b_idx, 0)
        if BT_SHIFT >= 0:
            b_blk = b_pos >> BT_SHIFT
            b_in = b_pos & ((1 << BT_SHIFT) - 1)
        else:
            b_blk = b_pos // bt_block_size
            b_in = b_pos - b_blk * bt_block_size
        m_n = m_n & (b_blk < bt_max_blocks)
        b_phys = gl.load(
            BlockTable + i_req * stride_btr + gl.where(m_n, b_blk, 0) * stride_btb,
            mask=m_n,
            other=-1,
        )
        m_n = m_n & (b_phys >= 0) & (b_phys <= num_rows // bt_block_size)
        b_idx = gl.where(m_n, b_phys, 0) * bt_block_size + b_in
    m_n = m_n & (b_idx < num_rows)
    b_row = gl.where(m_n, b_idx, 0)
    if PAGE_SHIFT >= 0:
        b_page = b_row >> PAGE_SHIFT
        b_slot = b_row & ((1 << PAGE_SHIFT) - 1)
    else:
        b_page = b_row // page_size
        b_slot = b_row - b_page * page_size
    o_page = b_page.to(gl.int64) * stride_kb
    o_data = o_page + b_slot.to(gl.int64) * V4_DATA_BYTES
    o_scale = o_page + (page_size * V4_DATA_BYTES + b_slot * V4_SCALE_BYTES).to(gl.int64)
    return o_data, o_scale, m_n


@gluon.jit
def _v4_step_rows(
    KV,
    Idx,
    BlockTable,
    i_t,
    i_req,
    w0,
    w_hi,
    stride_it,
    stride_iw,
    stride_btr,
    stride_btb,
    bt_block_size,
    bt_max_blocks,
    num_rows,
    page_size,
    stride_kb,
    k_slot,
    BLOCK_N: gl.constexpr,
    HAS_BT: gl.constexpr,
    BT_SHIFT: gl.constexpr,
    PAGE_SHIFT: gl.constexpr,
):
    # one step of one index list: gather, dequantize (exact: e4m3 x 2^e in bf16), write the tile
    # into the ring slot (the consumer derives each row's validity from the same lists itself)
    # every tile of the step in one layout, so that the rows' offsets, validity and scales are
    # where each dequantizing thread needs them without moving between threads (a conversion
    # is a round trip through shared memory and two barriers): the NoPE groups and the RoPE
    # values 8 a thread, and each row's eight scale bytes on each of the four threads that
    # dequantize that row
    DQ: gl.constexpr = gl.BlockedLayout([1, 8], [8, 4], [DEQUANT_WARPS, 1], [1, 0])
    SC: gl.constexpr = DQ
    RP: gl.constexpr = DQ
    ROWS: gl.constexpr = gl.SliceLayout(1, DQ)
    o_data, o_scale, m_n = _v4_row_offsets(
        Idx,
        BlockTable,
        i_t,
        i_req,
        w0,
        w_hi,
        stride_it,
        stride_iw,
        stride_btr,
        stride_btb,
        bt_block_size,
        bt_max_blocks,
        num_rows,
        page_size,
        stride_kb,
        BLOCK_N,
        HAS_BT,
        BT_SHIFT,
        PAGE_SHIFT,
        ROWS,
    )

    # the seven scales of each row, 2^(byte - 127) from their bits (0 where masked)
    o_sc = o_scale
    m_sc = m_n
    o_g = gl.arange(0, 8, layout=gl.SliceLayout(0, SC))
    m_g = o_g < V4_NOPE // V4_GROUP
    b_e = gl.load(KV + o_sc[:, None] + o_g[None, :], mask=m_sc[:, None] & m_g[None, :], other=0)
    b_sc = (b_e.to(gl.int32) << FP32_MANTISSA_BITS).to(gl.float32, bitcast=True)
    # the NoPE groups (loads first, so that their latencies overlap), then the RoPE values
    o_d = o_data
    m_d = m_n
    o_c = gl.arange(0, V4_GROUP, layout=gl.SliceLayout(0, DQ))
    p_k = KV + o_d[:, None] + o_c[None, :]
    m_k = m_d[:, None] & (o_c < V4_GROUP)[None, :]
    b_k0 = gl.load(p_k, mask=m_k, other=0)
    b_k1 = gl.load(p_k + V4_GROUP, mask=m_k, other=0)
    b_k2 = gl.load(p_k + 2 * V4_GROUP, mask=m_k, other=0)
    b_k3 = gl.load(p_k + 3 * V4_GROUP, mask=m_k, other=0)
    b_k4 = gl.load(p_k + 4 * V4_GROUP, mask=m_k, other=0)
    b_k5 = gl.load(p_k + 5 * V4_GROUP, mask=m_k, other=0)
    b_k6 = gl.load(p_k + 6 * V4_GROUP, mask=m_k, other=0)
    o_r = o_data
    m_r = m_n
    o_rc = gl.arange(0, V4_ROPE, layout=gl.SliceLayout(0, RP))
    p_r = (KV + o_r[:, None] + V4_NOPE).to(gl.pointer_type(gl.bfloat16)) + o_rc[None, :]
    b_kr = gl.load(p_r, mask=m_r[:, None] & (o_rc < V4_ROPE)[None, :], other=0.0)
    k_slot.slice(V4_NOPE, V4_ROPE, dim=1).store(b_kr)
    for c in gl.static_range(V4_NOPE // V4_GROUP):
        if c == 0:
            b_k8 = b_k0
        elif c == 1:
            b_k8 = b_k1
        elif c == 2:
            b_k8 = b_k2
        elif c == 3:
            b_k8 = b_k3
        elif c == 4:
            b_k8 = b_k4
        elif c == 5:
            b_k8 = b_k5
        else:
            b_k8 = b_k6
        b_sc_c = gl.sum(gl.where((o_g == c)[None, :], b_sc, 0.0), 1)
        b_sc_c = gl.convert_layout(b_sc_c, gl.SliceLayout(1, DQ))
        b_f = b_k8.to(gl.float8e4nv, bitcast=True).to(gl.float32)
        k_slot.slice(c * V4_GROUP, V4_GROUP, dim=1).store((b_f * b_sc_c[:, None]).to(gl.bfloat16))


@gluon.jit
def _v4_dequant(
    KV,
    Idx,
    BlockTable,
    ExtraKV,
    ExtraIdx,
    ExtraBlockTable,
    i_t,
    i_req,
    i_xreq,
    w_lo,
    w_hi,
    x_lo,
    x_hi,
    n_main,
    n_steps,
    stride_it,
    stride_iw,
    stride_btr,
    stride_btb,
    bt_block_size,
    bt_max_blocks,
    num_rows,
    page_size,
    stride_kb,
    stride_xit,
    stride_xiw,
    stride_xbtr,
    stride_xbtb,
    extra_bt_block_size,
    extra_bt_max_blocks,
    extra_num_rows,
    extra_page_size,
    stride_xkb,
    k_ring,
    ready,
    empty,
    BLOCK_N: gl.constexpr,
    HAS_BT: gl.constexpr,
    BT_SHIFT: gl.constexpr,
    PAGE_SHIFT: gl.constexpr,
    HAS_EXTRA: gl.constexpr,
    EXTRA_HAS_BT: gl.constexpr,
    EXTRA_BT_SHIFT: gl.constexpr,
    EXTRA_PAGE_SHIFT: gl.constexpr,
):
    # the producer: the main set's steps, then the extra set's, into the ring
    for i_step in range(n_steps):
        slot = i_step % 2
        mbarrier.wait(empty.index(slot), ((i_step // 2) & 1) ^ 1)
        if i_step < n_main:
            _v4_step_rows(
                KV,
                Idx,
                BlockTable,
                i_t,
                i_req,
                w_lo + i_step * BLOCK_N,
                w_hi,
                stride_it,
                stride_iw,
                stride_btr,
                stride_btb,
                bt_block_size,
                bt_max_blocks,
                num_rows,
                page_size,
                stride_kb,
                k_ring.index(slot),
                BLOCK_N,
                HAS_BT,
                BT_SHIFT,
                PAGE_SHIFT,
            )
        else:
            if HAS_EXTRA:
                _v4_step_rows(
                    ExtraKV,
                    ExtraIdx,
                    ExtraBlockTable,
                    i_t,
                    i_xreq,
                    x_lo + (i_step - n_main) * BLOCK_N,
                    x_hi,
                    stride_xit,
                    stride_xiw,
                    stride_xbtr,
                    stride_xbtb,
                    extra_bt_block_size,
                    extra_bt_max_blocks,
                    extra_num_rows,
                    extra_page_size,
                    stride_xkb,
                    k_ring.index(slot),
                    BLOCK_N,
                    EXTRA_HAS_BT,
                    EXTRA_BT_SHIFT,
                    EXTRA_PAGE_SHIFT,
                )
        fence_async_shared()
        _BARRIER()  # every dequantizing thread's stores are in before one of them publishes
        mbarrier.arrive(ready.index(slot))


@gluon.jit
def _v4_step_valid(
    i_step,
    i_t,
    Idx,
    BlockTable,
    ExtraIdx,
    ExtraBlockTable,
    i_req,
    i_xreq,
    w_lo,
    w_hi,
    x_lo,
    x_hi,
    n_main,
    stride_it,
    stride_iw,
    stride_btr,
    stride_btb,
    bt_block_size,
    bt_max_blocks,
    num_rows,
    page_size,
    stride_kb,
    stride_xit,
    stride_xiw,
    stride_xbtr,
    stride_xbtb,
    extra_bt_block_size,
    extra_bt_max_blocks,
    extra_num_rows,
    extra_page_size,
    stride_xkb,
    BLOCK_N: gl.constexpr,
    HAS_BT: gl.constexpr,
    BT_SHIFT: gl.constexpr,
    PAGE_SHIFT: gl.constexpr,
    HAS_EXTRA: gl.constexpr,
    EXTRA_HAS_BT: gl.constexpr,
    EXTRA_BT_SHIFT: gl.constexpr,
    EXTRA_PAGE_SHIFT: gl.constexpr,
    ROWS: gl.constexpr,
):
    # whether each row of step i_step (the main list's steps, then the extra list's) is valid, in
    # layout ROWS: the same rule the producer gathers by (_v4_row_offsets), computed by the
    # consumer from the lists themselves so that no validity passes between the partitions
    if HAS_EXTRA:
        if i_step < n_main:
            _, _, m_n = _v4_row_offsets(
                Idx,
                BlockTable,
                i_t,
                i_req,
                w_lo + i_step * BLOCK_N,
                w_hi,
                stride_it,
                stride_iw,
                stride_btr,
                stride_btb,
                bt_block_size,
                bt_max_blocks,
                num_rows,
                page_size,
                stride_kb,
                BLOCK_N,
                HAS_BT,
                BT_SHIFT,
                PAGE_SHIFT,
                ROWS,
            )
        else:
            _, _, m_n = _v4_row_offsets(
                ExtraIdx,
                ExtraBlockTable,
                i_t,
                i_xreq,
                x_lo + (i_step - n_main) * BLOCK_N,
                x_hi,
                stride_xit,
                stride_xiw,
                stride_xbtr,
                stride_xbtb,
                extra_bt_block_size,
                extra_bt_max_blocks,
                extra_num_rows,
                extra_page_size,
                stride_xkb,
                BLOCK_N,
                EXTRA_HAS_BT,
                EXTRA_BT_SHIFT,
                EXTRA_PAGE_SHIFT,
                ROWS,
            )
    else:
        _, _, m_n = _v4_row_offsets(
            Idx,
            BlockTable,
            i_t,
            i_req,
            w_lo + i_step * BLOCK_N,
            w_hi,
            stride_it,
            stride_iw,
            stride_btr,
            stride_btb,
            bt_block_size,
            bt_max_blocks,
            num_rows,
            page_size,
            stride_kb,
            BLOCK_N,
            HAS_BT,
            BT_SHIFT,
            PAGE_SHIFT,
            ROWS,
        )
    return m_n


@gluon.jit
def _v4_mma(
    Sink,
    Out,
    Lse,
    OPart,
    LsePart,
    q_s,
    k_ring,
    ready,
    empty,
    i_t,
    i_ts,
    i_hb,
    n_steps,
    H,
    qk_scale,
    stride_ot,
    stride_oh,
    stride_od,
    stride_sink,
    Idx,
    BlockTable,
    ExtraIdx,
    ExtraBlockTable,
    i_req,
    i_xreq,
    w_lo,
    w_hi,
    x_lo,
    x_hi,
    n_main,
    stride_it,
    stride_iw,
    stride_btr,
    stride_btb,
    bt_block_size,
    bt_max_blocks,
    num_rows,
    page_size,
    stride_kb,
    stride_xit,
    stride_xiw,
    stride_xbtr,
    stride_xbtb,
    extra_bt_block_size,
    extra_bt_max_blocks,
    extra_num_rows,
    extra_page_size,
    stride_xkb,
    BLOCK_H: gl.constexpr,
    BLOCK_N: gl.constexpr,
    L: gl.constexpr,
    SPLIT: gl.constexpr,
    STORE_LSE: gl.constexpr,
    HAS_SINK: gl.constexpr,
    HAS_BT: gl.constexpr,
    BT_SHIFT: gl.constexpr,
    PAGE_SHIFT: gl.constexpr,
    HAS_EXTRA: gl.constexpr,
    EXTRA_HAS_BT: gl.constexpr,
    EXTRA_BT_SHIFT: gl.constexpr,
    EXTRA_PAGE_SHIFT: gl.constexpr,
):
    # the consumer (the CTA's own warps): one QK^T chain, the online softmax, one PV chain
    # S and O split by columns between the two warpgroups (no QK^T twice)
    S_LAYOUT: gl.constexpr = gl.NVMMADistributedLayout(
        version=[3, 0], warps_per_cta=[4, 2], instr_shape=[16, 32, 16]
    )
    O_LAYOUT: gl.constexpr = gl.NVMMADistributedLayout(
        version=[3, 0], warps_per_cta=[4, 2], instr_shape=[16, 256, 16]
    )
    P_LAYOUT: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=O_LAYOUT, k_width=2)
    b_m = gl.full([BLOCK_H], float("-inf"), gl.float32, layout=gl.SliceLayout(1, S_LAYOUT))
    b_l = gl.zeros([BLOCK_H], gl.float32, layout=gl.SliceLayout(1, S_LAYOUT))
    b_o = gl.zeros([BLOCK_H, L], gl.float32, layout=O_LAYOUT)
    for i_step in range(n_steps):
        slot = i_step % 2
        # the rows' validity first: its loads are in flight while the slot is awaited
        m_n = _v4_step_valid(
            i_step,
            i_t,
            Idx,
            BlockTable,
            ExtraIdx,
            ExtraBlockTable,
            i_req,
            i_xreq,
            w_lo,
            w_hi,
            x_lo,
            x_hi,
            n_main,
            stride_it,
            stride_iw,
            stride_btr,
            stride_btb,
            bt_block_size,
            bt_max_blocks,
            num_rows,
            page_size,
            stride_kb,
            stride_xit,
            stride_xiw,
            stride_xbtr,
            stride_xbtb,
            extra_bt_block_size,
            extra_bt_max_blocks,
            extra_num_rows,
            extra_page_size,
            stride_xkb,
            BLOCK_N,
            HAS_BT,
            BT_SHIFT,
            PAGE_SHIFT,
            HAS_EXTRA,
            EXTRA_HAS_BT,
            EXTRA_BT_SHIFT,
            EXTRA_PAGE_SHIFT,
            gl.SliceLayout(0, S_LAYOUT),
        )
        mbarrier.wait(ready.index(slot), (i_step // 2) & 1)
        k_slot = k_ring.index(slot)
        b_s = gl.zeros([BLOCK_H, BLOCK_N], gl.float32, layout=S_LAYOUT)
        b_s = warpgroup_mma(q_s, k_slot.permute((1, 0)), b_s, use_acc=False, is_async=True)
        b_s = warpgroup_mma_wait(num_outstanding=0, deps=(b_s,))
        b_s = gl.where(m_n[None, :], b_s * qk_scale, float("-inf"))
        b_m_new = gl.maximum(b_m, gl.max(b_s, 1))
        b_m_use = gl.where(b_m_new == float("-inf"), 0.0, b_m_new)
        b_alpha = gl.exp2(b_m - b_m_use)
        b_p = gl.exp2(b_s - b_m_use[:, None])
        b_l = b_l * b_alpha + gl.sum(b_p, 1)
        b_m = b_m_new
        b_o = b_o * gl.convert_layout(b_alpha, gl.SliceLayout(1, O_LAYOUT))[:, None]
        b_pd = gl.convert_layout(b_p.to(gl.bfloat16), P_LAYOUT)
        b_o = warpgroup_mma(b_pd, k_slot, b_o, is_async=True)
        b_o = warpgroup_mma_wait(num_outstanding=0, deps=(b_o,))
        _BARRIER()  # both warpgroups are done with the slot before it is handed back
        mbarrier.arrive(empty.index(slot))

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


@gluon.jit
def sparse_mla_ds_mla_v4_sm90_gluon_ws_kernel(
    Q_nope,
    Q_rope,
    KV,
    Idx,
    Counts,
    BlockTable,
    ReqIds,
    KScale,
    Out,
    Lse,
    OPart,
    LsePart,
    Sink,
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
    ExtraKV,
    ExtraIdx,
    ExtraCounts,
    ExtraBlockTable,
    extra_width,
    extra_offset,
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
    FP8_NATIVE: gl.constexpr,
    MMA_FP16: gl.constexpr,
    FOLD_FP16: gl.constexpr,
    STAGE: gl.constexpr,
    IDX_AHEAD: gl.constexpr,
    HAS_COUNTS: gl.constexpr,
    HAS_BT: gl.constexpr,
    BT_SHIFT: gl.constexpr,
    PAGE_SHIFT: gl.constexpr,
    SPLIT: gl.constexpr,
    STORE_LSE: gl.constexpr,
    DOT_PRECISION: gl.constexpr,
    PDL: gl.constexpr,
    HAS_SINK: gl.constexpr,
    HAS_EXTRA: gl.constexpr,
    EXTRA_HAS_COUNTS: gl.constexpr,
    EXTRA_HAS_BT: gl.constexpr,
    EXTRA_BT_SHIFT: gl.constexpr,
    EXTRA_PAGE_SHIFT: gl.constexpr,
):
    gl.static_assert(BLOCK_H == 64 and BLOCK_N == 64 and L == 512 and R == 0, "64 x 64 tiles")
    gl.static_assert(FP8_NATIVE and not MMA_FP16, "bf16 MMAs, native e4m3")
    Q_LAYOUT: gl.constexpr = gl.BlockedLayout([1, 8], [2, 16], [8, 1], [1, 0])
    MMA_SMEM: gl.constexpr = gl.NVMMASharedLayout(
        swizzle_byte_width=128, element_bitwidth=16, rank=2
    )

    i_hb, i_ts, i_s, i_t = _program_coords(num_hb, num_splits)

    o_hq = i_hb * BLOCK_H + gl.arange(0, BLOCK_H, layout=gl.SliceLayout(1, Q_LAYOUT))
    m_hq = o_hq < H
    o_lq = gl.arange(0, L, layout=gl.SliceLayout(0, Q_LAYOUT))
    p_q = Q_nope + i_t * stride_qnt + o_hq.to(gl.int64)[:, None] * stride_qnh
    b_q = gl.load(p_q + o_lq[None, :] * stride_qnd, mask=m_hq[:, None], other=0.0)
    q_s = gl.allocate_shared_memory(gl.bfloat16, [BLOCK_H, L], MMA_SMEM, b_q.to(gl.bfloat16))
    k_ring = gl.allocate_shared_memory(gl.bfloat16, [2, BLOCK_N, L], MMA_SMEM)
    ready = gl.allocate_shared_memory(gl.int64, [2, 1], mbarrier.MBarrierLayout())
    empty = gl.allocate_shared_memory(gl.int64, [2, 1], mbarrier.MBarrierLayout())
    for i in gl.static_range(2):
        mbarrier.init(ready.index(i), count=1)
        mbarrier.init(empty.index(i), count=1)
    fence_async_shared()

    # this split's part of the main list, then of the extra list (shared.py's _split_bounds and
    # _extra_bounds: one sequence of steps, the extra list starting at extra_offset)
    w_lo, w_hi, n_main = _split_range(
        Counts, i_t, i_s, W, split_len, stride_ct, BLOCK_N, HAS_COUNTS
    )
    i_req = 0
    if HAS_BT:
        i_req = gl.load(ReqIds + i_t * stride_rq).to(gl.int64)
    n_steps = n_main
    x_lo = 0
    x_hi = 0
    i_xreq = 0
    if HAS_EXTRA:
        x_end = extra_width
        if EXTRA_HAS_COUNTS:
            x_end = gl.minimum(gl.load(ExtraCounts + i_t * stride_xct), extra_width)
        if EXTRA_HAS_BT:
            i_xreq = gl.load(ReqIds + i_t * stride_rq).to(gl.int64)
        s_lo = i_s * split_len
        x_lo = gl.maximum(s_lo - extra_offset, 0)
        x_hi = gl.minimum(s_lo + split_len - extra_offset, x_end)
        n_steps = n_main + gl.cdiv(gl.maximum(x_hi - x_lo, 0), BLOCK_N)
    qk_scale = sm_scale * LOG2E
    # (the partition list is written out: Gluon does not take it as a value)
    gl.warp_specialize(
        [
            (
                _v4_mma,
                (
                    Sink,
                    Out,
                    Lse,
                    OPart,
                    LsePart,
                    q_s,
                    k_ring,
                    ready,
                    empty,
                    i_t,
                    i_ts,
                    i_hb,
                    n_steps,
                    H,
                    qk_scale,
                    stride_ot,
                    stride_oh,
                    stride_od,
                    stride_sink,
                    Idx,
                    BlockTable,
                    ExtraIdx,
                    ExtraBlockTable,
                    i_req,
                    i_xreq,
                    w_lo,
                    w_hi,
                    x_lo,
                    x_hi,
                    n_main,
                    stride_it,
                    stride_iw,
                    stride_btr,
                    stride_btb,
                    bt_block_size,
                    bt_max_blocks,
                    num_rows,
                    page_size,
                    stride_kb,
                    stride_xit,
                    stride_xiw,
                    stride_xbtr,
                    stride_xbtb,
                    extra_bt_block_size,
                    extra_bt_max_blocks,
                    extra_num_rows,
                    extra_page_size,
                    stride_xkb,
                    BLOCK_H,
                    BLOCK_N,
                    L,
                    SPLIT,
                    STORE_LSE,
                    HAS_SINK,
                    HAS_BT,
                    BT_SHIFT,
                    PAGE_SHIFT,
                    HAS_EXTRA,
                    EXTRA_HAS_BT,
                    EXTRA_BT_SHIFT,
                    EXTRA_PAGE_SHIFT,
                ),
            ),
            (
                _v4_dequant,
                (
                    KV,
                    Idx,
                    BlockTable,
                    ExtraKV,
                    ExtraIdx,
                    ExtraBlockTable,
                    i_t,
                    i_req,
                    i_xreq,
                    w_lo,
                    w_hi,
                    x_lo,
                    x_hi,
                    n_main,
                    n_steps,
                    stride_it,
                    stride_iw,
                    stride_btr,
                    stride_btb,
                    bt_block_size,
                    bt_max_blocks,
                    num_rows,
                    page_size,
                    stride_kb,
                    stride_xit,
                    stride_xiw,
                    stride_xbtr,
                    stride_xbtb,
                    extra_bt_block_size,
                    extra_bt_max_blocks,
                    extra_num_rows,
                    extra_page_size,
                    stride_xkb,
                    k_ring,
                    ready,
                    empty,
                    BLOCK_N,
                    HAS_BT,
                    BT_SHIFT,
                    PAGE_SHIFT,
                    HAS_EXTRA,
                    EXTRA_HAS_BT,
                    EXTRA_BT_SHIFT,
                    EXTRA_PAGE_SHIFT,
                ),
            ),
        ],
        [DEQUANT_WARPS],
        [DEQUANT_REGS],
    )


# --- pipelined form: one partition, the next step's bytes in flight while this one computes ---

# the e4m3 bytes of a row land in a 512-wide ring row (the 448 NoPE bytes; the rest zero-filled)
V4_NOPE_PAD = gl.constexpr(512)
V4_GROUPS = gl.constexpr(7)


@gluon.jit
def _v4_gather_async(
    KV,
    Idx,
    BlockTable,
    i_t,
    i_req,
    w0,
    w_hi,
    stride_it,
    stride_iw,
    stride_btr,
    stride_btb,
    bt_block_size,
    bt_max_blocks,
    num_rows,
    page_size,
    stride_kb,
    nope_slot,
    rope_slot,
    BLOCK_N: gl.constexpr,
    HAS_BT: gl.constexpr,
    BT_SHIFT: gl.constexpr,
    PAGE_SHIFT: gl.constexpr,
    NOPE_LAYOUT: gl.constexpr,
    ROPE_LAYOUT: gl.constexpr,
    SC_LAYOUT: gl.constexpr,
):
    # one step of one list: cp.async of the NoPE bytes and RoPE values into a ring slot (masked
    # rows read nothing and are zero-filled); returns each row's validity and its seven scale
    # bytes, loaded into registers (the caller keeps them for the step that uses them)
    o_data, o_scale, m_n = _v4_row_offsets(
        Idx,
        BlockTable,
        i_t,
        i_req,
        w0,
        w_hi,
        stride_it,
        stride_iw,
        stride_btr,
        stride_btb,
        bt_block_size,
        bt_max_blocks,
        num_rows,
        page_size,
        stride_kb,
        BLOCK_N,
        HAS_BT,
        BT_SHIFT,
        PAGE_SHIFT,
        gl.SliceLayout(1, NOPE_LAYOUT),
    )
    o_c = gl.arange(0, V4_NOPE_PAD, layout=gl.SliceLayout(0, NOPE_LAYOUT))
    p_nope = KV + o_data[:, None] + o_c[None, :]
    _ASYNC_LOAD(nope_slot, p_nope, mask=m_n[:, None] & (o_c < V4_NOPE)[None, :])
    # the RoPE values' and the scales' tiles address the rows in their own layouts (the
    # indices and block table read again, cached: cheaper than moving offsets between
    # threads through shared memory)
    o_r, _, m_r = _v4_row_offsets(
        Idx,
        BlockTable,
        i_t,
        i_req,
        w0,
        w_hi,
        stride_it,
        stride_iw,
        stride_btr,
        stride_btb,
        bt_block_size,
        bt_max_blocks,
        num_rows,
        page_size,
        stride_kb,
        BLOCK_N,
        HAS_BT,
        BT_SHIFT,
        PAGE_SHIFT,
        gl.SliceLayout(1, ROPE_LAYOUT),
    )
    o_rc = gl.arange(0, V4_ROPE, layout=gl.SliceLayout(0, ROPE_LAYOUT))
    p_rope = (KV + o_r[:, None] + V4_NOPE).to(gl.pointer_type(gl.bfloat16)) + o_rc[None, :]
    _ASYNC_LOAD(rope_slot, p_rope, mask=m_r[:, None] & (o_rc < V4_ROPE)[None, :])
    _, o_sc, m_sc = _v4_row_offsets(
        Idx,
        BlockTable,
        i_t,
        i_req,
        w0,
        w_hi,
        stride_it,
        stride_iw,
        stride_btr,
        stride_btb,
        bt_block_size,
        bt_max_blocks,
        num_rows,
        page_size,
        stride_kb,
        BLOCK_N,
        HAS_BT,
        BT_SHIFT,
        PAGE_SHIFT,
        gl.SliceLayout(1, SC_LAYOUT),
    )
    o_g = gl.arange(0, 8, layout=gl.SliceLayout(0, SC_LAYOUT))
    m_g = o_g < V4_GROUPS
    b_e = gl.load(KV + o_sc[:, None] + o_g[None, :], mask=m_sc[:, None] & m_g[None, :], other=0)
    return m_n, b_e


@gluon.jit
def _v4_gather_step(
    KV,
    Idx,
    BlockTable,
    ExtraKV,
    ExtraIdx,
    ExtraBlockTable,
    j,
    n_main,
    i_t,
    i_req,
    i_xreq,
    w_lo,
    w_hi,
    x_lo,
    x_hi,
    stride_it,
    stride_iw,
    stride_btr,
    stride_btb,
    bt_block_size,
    bt_max_blocks,
    num_rows,
    page_size,
    stride_kb,
    stride_xit,
    stride_xiw,
    stride_xbtr,
    stride_xbtb,
    extra_bt_block_size,
    extra_bt_max_blocks,
    extra_num_rows,
    extra_page_size,
    stride_xkb,
    nope_slot,
    rope_slot,
    BLOCK_N: gl.constexpr,
    HAS_BT: gl.constexpr,
    BT_SHIFT: gl.constexpr,
    PAGE_SHIFT: gl.constexpr,
    HAS_EXTRA: gl.constexpr,
    EXTRA_HAS_BT: gl.constexpr,
    EXTRA_BT_SHIFT: gl.constexpr,
    EXTRA_PAGE_SHIFT: gl.constexpr,
    NOPE_LAYOUT: gl.constexpr,
    ROPE_LAYOUT: gl.constexpr,
    SC_LAYOUT: gl.constexpr,
):
    # step j of the call's one sequence: the main list's steps, then the extra list's (past the
    # last step every row is masked: nothing is read)
    if HAS_EXTRA:
        if j < n_main:
            m_n, b_e = _v4_gather_async(
                KV,
                Idx,
                BlockTable,
                i_t,
                i_req,
                w_lo + j * BLOCK_N,
                w_hi,
                stride_it,
                stride_iw,
                stride_btr,
                stride_btb,
                bt_block_size,
                bt_max_blocks,
                num_rows,
                page_size,
                stride_kb,
                nope_slot,
                rope_slot,
                BLOCK_N,
                HAS_BT,
                BT_SHIFT,
                PAGE_SHIFT,
                NOPE_LAYOUT,
                ROPE_LAYOUT,
                SC_LAYOUT,
            )
        else:
            m_n, b_e = _v4_gather_async(
                ExtraKV,
                ExtraIdx,
                ExtraBlockTable,
                i_t,
                i_xreq,
                x_lo + (j - n_main) * BLOCK_N,
                x_hi,
                stride_xit,
                stride_xiw,
                stride_xbtr,
                stride_xbtb,
                extra_bt_block_size,
                extra_bt_max_blocks,
                extra_num_rows,
                extra_page_size,
                stride_xkb,
                nope_slot,
                rope_slot,
                BLOCK_N,
                EXTRA_HAS_BT,
                EXTRA_BT_SHIFT,
                EXTRA_PAGE_SHIFT,
                NOPE_LAYOUT,
                ROPE_LAYOUT,
                SC_LAYOUT,
            )
    else:
        m_n, b_e = _v4_gather_async(
            KV,
            Idx,
            BlockTable,
            i_t,
            i_req,
            w_lo + j * BLOCK_N,
            w_hi,
            stride_it,
            stride_iw,
            stride_btr,
            stride_btb,
            bt_block_size,
            bt_max_blocks,
            num_rows,
            page_size,
            stride_kb,
            nope_slot,
            rope_slot,
            BLOCK_N,
            HAS_BT,
            BT_SHIFT,
            PAGE_SHIFT,
            NOPE_LAYOUT,
            ROPE_LAYOUT,
            SC_LAYOUT,
        )
    return m_n, b_e


@gluon.jit
def sparse_mla_ds_mla_v4_sm90_gluon_kernel(
    Q_nope,
    Q_rope,
    KV,
    Idx,
    Counts,
    BlockTable,
    ReqIds,
    KScale,
    Out,
    Lse,
    OPart,
    LsePart,
    Sink,
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
    ExtraKV,
    ExtraIdx,
    ExtraCounts,
    ExtraBlockTable,
    extra_width,
    extra_offset,
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
    FP8_NATIVE: gl.constexpr,
    MMA_FP16: gl.constexpr,
    FOLD_FP16: gl.constexpr,
    STAGE: gl.constexpr,
    IDX_AHEAD: gl.constexpr,
    HAS_COUNTS: gl.constexpr,
    HAS_BT: gl.constexpr,
    BT_SHIFT: gl.constexpr,
    PAGE_SHIFT: gl.constexpr,
    SPLIT: gl.constexpr,
    STORE_LSE: gl.constexpr,
    DOT_PRECISION: gl.constexpr,
    PDL: gl.constexpr,
    HAS_SINK: gl.constexpr,
    HAS_EXTRA: gl.constexpr,
    EXTRA_HAS_COUNTS: gl.constexpr,
    EXTRA_HAS_BT: gl.constexpr,
    EXTRA_BT_SHIFT: gl.constexpr,
    EXTRA_PAGE_SHIFT: gl.constexpr,
):
    gl.static_assert(BLOCK_H == 64 and BLOCK_N == 64 and L == 512 and R == 0, "64 x 64 tiles")
    gl.static_assert(FP8_NATIVE and not MMA_FP16, "bf16 MMAs, native e4m3")
    Q_LAYOUT: gl.constexpr = gl.BlockedLayout([1, 8], [2, 16], [8, 1], [1, 0])
    MMA_SMEM: gl.constexpr = gl.NVMMASharedLayout(
        swizzle_byte_width=128, element_bitwidth=16, rank=2
    )
    RAW_SMEM: gl.constexpr = gl.SwizzledSharedLayout(vec=16, per_phase=1, max_phase=1, order=[1, 0])
    # S [64 heads, 64 keys] and O [64, 512] split by columns between the two warpgroups (each
    # computes half the keys' logits; P crosses through shared memory for the PV product)
    S_LAYOUT: gl.constexpr = gl.NVMMADistributedLayout(
        version=[3, 0], warps_per_cta=[4, 2], instr_shape=[16, 32, 16]
    )
    O_LAYOUT: gl.constexpr = gl.NVMMADistributedLayout(
        version=[3, 0], warps_per_cta=[4, 2], instr_shape=[16, 256, 16]
    )
    P_LAYOUT: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=O_LAYOUT, k_width=2)
    NOPE_LAYOUT: gl.constexpr = gl.BlockedLayout([1, 16], [2, 16], [8, 1], [1, 0])
    ROPE_LAYOUT: gl.constexpr = gl.BlockedLayout([1, 8], [8, 4], [8, 1], [1, 0])
    # a row's scale bytes on the threads that dequantize that row (DQ_LAYOUT's row mapping):
    # picking a group's scale needs no layout conversion
    SC_LAYOUT: gl.constexpr = gl.BlockedLayout([1, 8], [16, 2], [8, 1], [1, 0])
    DQ_LAYOUT: gl.constexpr = gl.BlockedLayout([1, 16], [16, 2], [8, 1], [1, 0])

    i_hb, i_ts, i_s, i_t = _program_coords(num_hb, num_splits)

    o_hq = i_hb * BLOCK_H + gl.arange(0, BLOCK_H, layout=gl.SliceLayout(1, Q_LAYOUT))
    m_hq = o_hq < H
    o_lq = gl.arange(0, L, layout=gl.SliceLayout(0, Q_LAYOUT))
    p_q = Q_nope + i_t * stride_qnt + o_hq.to(gl.int64)[:, None] * stride_qnh
    b_q = gl.load(p_q + o_lq[None, :] * stride_qnd, mask=m_hq[:, None], other=0.0)
    q_s = gl.allocate_shared_memory(gl.bfloat16, [BLOCK_H, L], MMA_SMEM, b_q.to(gl.bfloat16))
    # the ring of raw bytes (two slots) and the dequantized [64, 512] bf16 tile (key and value)
    nope_ring = gl.allocate_shared_memory(gl.uint8, [2, BLOCK_N, V4_NOPE_PAD], RAW_SMEM)
    rope_ring = gl.allocate_shared_memory(gl.bfloat16, [2, BLOCK_N, V4_ROPE], MMA_SMEM)
    k_s = gl.allocate_shared_memory(gl.bfloat16, [BLOCK_N, L], MMA_SMEM)

    # this split's part of the main list, then of the extra list (shared.py's _split_bounds and
    # _extra_bounds: one sequence of steps, the extra list starting at extra_offset)
    w_lo, w_hi, n_main = _split_range(
        Counts, i_t, i_s, W, split_len, stride_ct, BLOCK_N, HAS_COUNTS
    )
    i_req = 0
    if HAS_BT:
        i_req = gl.load(ReqIds + i_t * stride_rq).to(gl.int64)
    n_steps = n_main
    x_lo = 0
    x_hi = 0
    i_xreq = 0
    if HAS_EXTRA:
        x_end = extra_width
        if EXTRA_HAS_COUNTS:
            x_end = gl.minimum(gl.load(ExtraCounts + i_t * stride_xct), extra_width)
        if EXTRA_HAS_BT:
            i_xreq = gl.load(ReqIds + i_t * stride_rq).to(gl.int64)
        s_lo = i_s * split_len
        x_lo = gl.maximum(s_lo - extra_offset, 0)
        x_hi = gl.minimum(s_lo + split_len - extra_offset, x_end)
        n_steps = n_main + gl.cdiv(gl.maximum(x_hi - x_lo, 0), BLOCK_N)
    qk_scale = sm_scale * LOG2E

    b_m = gl.full([BLOCK_H], float("-inf"), gl.float32, layout=gl.SliceLayout(1, S_LAYOUT))
    b_l = gl.zeros([BLOCK_H], gl.float32, layout=gl.SliceLayout(1, S_LAYOUT))
    b_o = gl.zeros([BLOCK_H, L], gl.float32, layout=O_LAYOUT)
    o_g = gl.arange(0, 8, layout=gl.SliceLayout(0, SC_LAYOUT))
    m_next, b_e_next = _v4_gather_step(
        KV,
        Idx,
        BlockTable,
        ExtraKV,
        ExtraIdx,
        ExtraBlockTable,
        0,
        n_main,
        i_t,
        i_req,
        i_xreq,
        w_lo,
        w_hi,
        x_lo,
        x_hi,
        stride_it,
        stride_iw,
        stride_btr,
        stride_btb,
        bt_block_size,
        bt_max_blocks,
        num_rows,
        page_size,
        stride_kb,
        stride_xit,
        stride_xiw,
        stride_xbtr,
        stride_xbtb,
        extra_bt_block_size,
        extra_bt_max_blocks,
        extra_num_rows,
        extra_page_size,
        stride_xkb,
        nope_ring.index(0),
        rope_ring.index(0),
        BLOCK_N,
        HAS_BT,
        BT_SHIFT,
        PAGE_SHIFT,
        HAS_EXTRA,
        EXTRA_HAS_BT,
        EXTRA_BT_SHIFT,
        EXTRA_PAGE_SHIFT,
        NOPE_LAYOUT,
        ROPE_LAYOUT,
        SC_LAYOUT,
    )
    async_copy.commit_group()
    for i_step in range(n_steps):
        slot = i_step % 2
        m_n = m_next
        b_e = b_e_next
        # every thread is past its reads of the other slot (the previous step) before it refills
        _BARRIER()
        m_next, b_e_next = _v4_gather_step(
            KV,
            Idx,
            BlockTable,
            ExtraKV,
            ExtraIdx,
            ExtraBlockTable,
            i_step + 1,
            n_main,
            i_t,
            i_req,
            i_xreq,
            w_lo,
            w_hi,
            x_lo,
            x_hi,
            stride_it,
            stride_iw,
            stride_btr,
            stride_btb,
            bt_block_size,
            bt_max_blocks,
            num_rows,
            page_size,
            stride_kb,
            stride_xit,
            stride_xiw,
            stride_xbtr,
            stride_xbtb,
            extra_bt_block_size,
            extra_bt_max_blocks,
            extra_num_rows,
            extra_page_size,
            stride_xkb,
            nope_ring.index(1 - slot),
            rope_ring.index(1 - slot),
            BLOCK_N,
            HAS_BT,
            BT_SHIFT,
            PAGE_SHIFT,
            HAS_EXTRA,
            EXTRA_HAS_BT,
            EXTRA_BT_SHIFT,
            EXTRA_PAGE_SHIFT,
            NOPE_LAYOUT,
            ROPE_LAYOUT,
            SC_LAYOUT,
        )
        async_copy.commit_group()
        async_copy.wait_group(1)  # this step's bytes are in
        _BARRIER()

        # dequantize (exact: e4m3 x 2^(e - 127) is a bf16 value), then the RoPE values
        b_sc = (b_e.to(gl.int32) << FP32_MANTISSA_BITS).to(gl.float32, bitcast=True)
        for c in gl.static_range(V4_GROUPS):
            b_sc_c = gl.sum(gl.where((o_g == c)[None, :], b_sc, 0.0), 1)
            b_sc_c = gl.convert_layout(b_sc_c, gl.SliceLayout(1, DQ_LAYOUT))
            b_k8 = nope_ring.index(slot).slice(c * V4_GROUP, V4_GROUP, dim=1).load(DQ_LAYOUT)
            b_f = b_k8.to(gl.float8e4nv, bitcast=True).to(gl.float32)
            k_s.slice(c * V4_GROUP, V4_GROUP, dim=1).store((b_f * b_sc_c[:, None]).to(gl.bfloat16))
        b_kr = rope_ring.index(slot).load(ROPE_LAYOUT)
        k_s.slice(V4_NOPE, V4_ROPE, dim=1).store(b_kr)
        fence_async_shared()
        _BARRIER()

        # QK^T: one chain, one wait; the online softmax over the valid rows
        b_s = gl.zeros([BLOCK_H, BLOCK_N], gl.float32, layout=S_LAYOUT)
        b_s = warpgroup_mma(q_s, k_s.permute((1, 0)), b_s, use_acc=False, is_async=True)
        m_s = gl.convert_layout(m_n, gl.SliceLayout(0, S_LAYOUT))
        b_s = warpgroup_mma_wait(num_outstanding=0, deps=(b_s,))
        b_s = gl.where(m_s[None, :], b_s * qk_scale, float("-inf"))
        b_m_new = gl.maximum(b_m, gl.max(b_s, 1))
        b_m_use = gl.where(b_m_new == float("-inf"), 0.0, b_m_new)
        b_alpha = gl.exp2(b_m - b_m_use)
        b_p = gl.exp2(b_s - b_m_use[:, None])
        b_l = b_l * b_alpha + gl.sum(b_p, 1)
        b_m = b_m_new
        # PV: one chain into O, one wait (the tile is rewritten only after it)
        b_o = b_o * gl.convert_layout(b_alpha, gl.SliceLayout(1, O_LAYOUT))[:, None]
        b_pd = gl.convert_layout(b_p.to(gl.bfloat16), P_LAYOUT)
        b_o = warpgroup_mma(b_pd, k_s, b_o, is_async=True)
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
