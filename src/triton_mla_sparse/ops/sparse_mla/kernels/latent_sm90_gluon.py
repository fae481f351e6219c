"""Rows in q's dtype (kv_format "auto") on sm90 in Gluon: two schedules with wgmma, 64 heads,
64-row steps.

The pipelined kernel (KernelConfig.gluon="pipelined") is fp8_ds_mla's pipelined sm90 kernel
(ds_mla_sm90_gluon.py) without the dequantization: the rows of step i + 1 (512 latent values and
64 rope values, bf16 or fp16) are gathered with cp.async into the other half of a two-slot ring
while step i is multiplied, and the warpgroup MMAs read the slot where the rows landed. Its two
warpgroups work in lockstep: they split the step's key columns for QK^T (P crosses to the other
warpgroup through shared memory for PV, the row maxima and sums through CTA reductions) and the
output's columns for PV, and each step waits for its QK^T, then its softmax, then its PV.

The warp-specialized kernel (gluon="specialized") gives each warpgroup a partition of its own and
alternate steps: warpgroup w gathers, multiplies (QK^T over the whole latent, m64n64 wgmma) and
normalises steps 2j + w in ring slot w, and accumulates half of O's columns from both steps of a
pair, its own P from registers and the other's through shared memory. The two meet at mbarriers
(the running max handed from one to the other, P published, a slot's half released) instead of
CTA barriers, so one warpgroup's softmax and gathers run while the other's MMAs do: the schedule
of FlashMLA's sm90 sparse prefill kernel, without its producer warpgroup (each warpgroup issues
its own cp.async, leaving it the 255 registers eight warps allow: its O half is 128 of them).

The runtime argument list is the Triton kernel's (latent.py); block tables, an extra index set
and e4m3 rows are refused by the plan before any launch.
"""

from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.ampere import async_copy, mbarrier
from triton.experimental.gluon.language.nvidia.hopper import (
    fence_async_shared,
    warpgroup_mma,
    warpgroup_mma_wait,
)

from .ampere_gluon import _gather_latent
from .ds_mla_sm90_gluon import (
    _ASYNC_LOAD,
    _BARRIER,
    LOG2E,
    _program_coords,
    _result_scale,
    _rows,
    _split_range,
    _store_chunk,
    _store_lse,
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
        b_pb = b_p.to(dtype)
        b_pd = gl.convert_layout(b_pb, P_LAYOUT)
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


# --- warp-specialized form: two warpgroups on alternate steps, each gathering its own rows ---

# the columns of the latent each warpgroup accumulates of O (and the half of a slot it multiplies
# by its P): warpgroup 0 the first, warpgroup 1 the second
HALF_L = gl.constexpr(256)
WS_WARPS = gl.constexpr(4)  # each partition is one warpgroup
# registers a thread of warpgroup 1 (the worker partition) may hold: as many as warpgroup 0's. With
# it Triton has every partition grow to 256 (setmaxnreg.inc), which returns at once only because
# ptxas allocates the whole kernel 255 (rounded up to 256): were it to allocate fewer, the
# requests would wait forever for registers no partition frees. tests/test_gluon_latent.py reads
# the allocation. (Triton 3.6 requires a figure; the same call serves 3.8.)
WS_REGS = gl.constexpr(256)


@gluon.jit
def _ws_gather_half(
    KV,
    Idx,
    i_t,
    w0,
    w_hi,
    stride_it,
    stride_iw,
    num_rows,
    page_size,
    stride_kb,
    stride_kr,
    nope_slot,
    rope_slot,
    HALF: gl.constexpr,
    BLOCK_N: gl.constexpr,
    L: gl.constexpr,
    R: gl.constexpr,
    PAGE_SHIFT: gl.constexpr,
):
    # cp.async of one half of rows [w0, w0 + BLOCK_N) of token i_t's list into a slot: HALF 0 the
    # latent columns [0, HALF_L), HALF 1 the columns [HALF_L, L) and the R rope values; masked
    # rows zero-filled. One commit group. A warp covers 4 rows x 128 bytes (the warpgroup 16
    # rows), so that each thread holds four rows' offsets (the columns are immediates of its
    # copies) and the rope tile shares them.
    ROW_LAYOUT: gl.constexpr = gl.BlockedLayout([1, 8], [4, 8], [WS_WARPS, 1], [1, 0])
    o_row, m_n = _rows(
        Idx,
        i_t,
        w0,
        w_hi,
        stride_it,
        stride_iw,
        num_rows,
        page_size,
        stride_kb,
        stride_kr,
        BLOCK_N,
        PAGE_SHIFT,
        gl.SliceLayout(1, ROW_LAYOUT),
    )
    o_c = HALF * HALF_L + gl.arange(0, HALF_L, layout=gl.SliceLayout(0, ROW_LAYOUT))
    _ASYNC_LOAD(
        nope_slot.slice(HALF * HALF_L, HALF_L, dim=1),
        KV + o_row[:, None] + o_c[None, :],
        mask=m_n[:, None] & (o_c < L)[None, :],
    )
    if HALF == 1 and R > 0:
        o_r = gl.arange(0, R, layout=gl.SliceLayout(0, ROW_LAYOUT))
        _ASYNC_LOAD(
            rope_slot,
            KV + o_row[:, None] + L + o_r[None, :],
            mask=m_n[:, None] & (o_r < R)[None, :],
        )
    async_copy.commit_group()


@gluon.jit
def _ws_qk_half(
    q_s, qr_s, k_slot, kr_slot, b_s, HALF: gl.constexpr, R: gl.constexpr, FIRST: gl.constexpr
):
    # QK^T over one half of the slot (HALF 1 with the rope columns), issued asynchronously
    b_s = warpgroup_mma(
        q_s.slice(HALF * HALF_L, HALF_L, dim=1),
        k_slot.slice(HALF * HALF_L, HALF_L, dim=1).permute((1, 0)),
        b_s,
        use_acc=not FIRST,
        is_async=True,
    )
    if HALF == 1 and R > 0:
        b_s = warpgroup_mma(qr_s, kr_slot.permute((1, 0)), b_s, is_async=True)
    return b_s


@gluon.jit
def _ws_warpgroup(
    KV,
    Idx,
    Sink,
    Out,
    Lse,
    OPart,
    LsePart,
    q_s,
    qr_s,
    nope_ring,
    rope_ring,
    p1_s,
    m_s,
    l_s,
    bars,
    i_t,
    i_ts,
    i_hb,
    w_lo,
    w_hi,
    n_steps,
    H,
    qk_scale,
    stride_it,
    stride_iw,
    num_rows,
    page_size,
    stride_kb,
    stride_kr,
    stride_ot,
    stride_oh,
    stride_od,
    stride_sink,
    WG: gl.constexpr,
    BLOCK_H: gl.constexpr,
    BLOCK_N: gl.constexpr,
    L: gl.constexpr,
    R: gl.constexpr,
    PAGE_SHIFT: gl.constexpr,
    SPLIT: gl.constexpr,
    STORE_LSE: gl.constexpr,
    HAS_SINK: gl.constexpr,
):
    # One warpgroup's walk. Warpgroup WG takes steps 2j + WG into ring slot WG: it gathers their
    # rows itself (cp.async, its own commit groups), computes their QK^T over the whole latent and
    # their softmax, and accumulates O's columns [WG * HALF_L, (WG + 1) * HALF_L) from both
    # warpgroups' steps: its own P from registers, the other's through shared memory (P of slot
    # 0 in slot 0's rope tile, which its QK^T no longer needs; P of slot 1 in p1_s). The softmax
    # runs in turn: warpgroup 0 folds step 2j into the running max it read back after step
    # 2j - 1, warpgroup 1 folds step 2j + 1 into warpgroup 0's, and warpgroup 0 then rescales
    # its P and O to that max, so both accumulate in one basis. A slot's half is refilled once
    # every MMA reading it is done: the half its own warpgroup alone reads after its own PV, the
    # half the other warpgroup's PV reads once that warpgroup says so.
    S_LAYOUT: gl.constexpr = gl.NVMMADistributedLayout(
        version=[3, 0], warps_per_cta=[WS_WARPS, 1], instr_shape=[16, 64, 16]
    )
    O_LAYOUT: gl.constexpr = gl.NVMMADistributedLayout(
        version=[3, 0], warps_per_cta=[WS_WARPS, 1], instr_shape=[16, 256, 16]
    )
    P_LAYOUT: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=O_LAYOUT, k_width=2)
    ROW: gl.constexpr = gl.SliceLayout(1, S_LAYOUT)
    ROW_O: gl.constexpr = gl.SliceLayout(1, O_LAYOUT)
    dtype: gl.constexpr = nope_ring.dtype
    OTHER: gl.constexpr = 1 - WG
    # the half of a slot this warpgroup's PV reads (also gathered first: it frees first)
    OWN: gl.constexpr = WG
    # cross-warpgroup barriers (bars): max published, P published, the other's half free, sums
    M_READY: gl.constexpr = 0
    P_READY: gl.constexpr = 2
    HALF_FREE: gl.constexpr = 4
    L_READY: gl.constexpr = 6

    n_pairs = gl.cdiv(n_steps, 2)

    b_m = gl.full([BLOCK_H], float("-inf"), gl.float32, layout=ROW)
    b_l = gl.zeros([BLOCK_H], gl.float32, layout=ROW)
    b_o = gl.zeros([BLOCK_H, HALF_L], gl.float32, layout=O_LAYOUT)

    # the first step's rows: the half this warpgroup frees itself first
    w0 = w_lo + WG * BLOCK_N
    for h in gl.static_range(2):
        _ws_gather_half(
            KV,
            Idx,
            i_t,
            w0,
            w_hi,
            stride_it,
            stride_iw,
            num_rows,
            page_size,
            stride_kb,
            stride_kr,
            nope_ring.index(WG),
            rope_ring.index(WG),
            (OWN + h) % 2,
            BLOCK_N,
            L,
            R,
            PAGE_SHIFT,
        )
    for j in range(n_pairs):
        ph = j & 1
        # The shared-memory views, indexed by a zero the compiler cannot see is one (the grid has
        # one dimension): with constant views it hoists every wgmma's 64-bit descriptors out of
        # the walk (some 90 of them per warpgroup, past the register file); this way they are
        # formed from one base inside it, as in the pipelined kernel whose slot alternates.
        i_z = j * gl.program_id(1)
        q_v = q_s.index(i_z)
        qr_v = qr_s.index(i_z)
        k_own = nope_ring.index(WG + i_z)
        kr_own = rope_ring.index(WG + i_z)
        k_other = nope_ring.index(OTHER + i_z)
        if WG == 0:
            p_own_s = kr_own  # P of slot 0 goes where slot 0's rope keys were
            p_other_s = p1_s.index(i_z)
        else:
            p_own_s = p1_s.index(i_z)
            p_other_s = rope_ring.index(i_z)
        w0 = w_lo + (2 * j + WG) * BLOCK_N
        # (the step's position folded into one scalar pointer: with the position added per
        # element, the compiler keeps a 64-bit pointer per column live across the walk)
        o_n = gl.arange(0, BLOCK_N, layout=gl.SliceLayout(0, S_LAYOUT))
        p_idx = Idx + i_t * stride_it + w0.to(gl.int64) * stride_iw
        b_idx = gl.load(p_idx + o_n * stride_iw, mask=o_n < w_hi - w0, other=-1)
        m_n = (b_idx >= 0) & (b_idx < num_rows)

        # QK^T, half by half as the halves land (every thread's copies, then the async proxy)
        b_s = gl.zeros([BLOCK_H, BLOCK_N], gl.float32, layout=S_LAYOUT)
        async_copy.wait_group(1)
        fence_async_shared()
        _BARRIER()
        b_s = _ws_qk_half(q_v, qr_v, k_own, kr_own, b_s, OWN, R, True)
        async_copy.wait_group(0)
        fence_async_shared()
        _BARRIER()
        b_s = _ws_qk_half(q_v, qr_v, k_own, kr_own, b_s, OTHER, R, False)
        b_s = warpgroup_mma_wait(num_outstanding=0, deps=(b_s,))
        b_s = gl.where(m_n[None, :], b_s * qk_scale, float("-inf"))

        # the running max: warpgroup 1 starts from warpgroup 0's for this pair
        if WG == 1:
            mbarrier.wait(bars.index(M_READY + 0), ph)
            b_m_in = m_s.load(ROW)
        else:
            b_m_in = b_m
        b_m_new = gl.maximum(b_m_in, gl.max(b_s, 1))
        b_m_use = gl.where(b_m_new == float("-inf"), 0.0, b_m_new)
        b_alpha = gl.exp2(b_m - b_m_use)
        b_p = gl.exp2(b_s - b_m_use[:, None])
        b_l = b_l * b_alpha + gl.sum(b_p, 1)
        b_o = b_o * gl.convert_layout(b_alpha, ROW_O)[:, None]
        b_m = b_m_new
        _BARRIER()  # every thread has read the max it starts from before it is overwritten
        m_s.store(b_m_new)
        _BARRIER()
        mbarrier.arrive(bars.index(M_READY + WG))

        # PV of this warpgroup's own step, P from registers
        b_pb = b_p.to(dtype)
        b_pd = gl.convert_layout(b_pb, P_LAYOUT)
        b_o = warpgroup_mma(b_pd, k_own.slice(WG * HALF_L, HALF_L, dim=1), b_o, is_async=True)
        if WG == 0:
            # warpgroup 1's max for the pair, which this step's P and O move to
            mbarrier.wait(bars.index(M_READY + 1), ph)
            b_m1 = m_s.load(ROW)
            b_scale = gl.exp2(b_m - gl.where(b_m1 == float("-inf"), 0.0, b_m1))
            b_o, b_pd = warpgroup_mma_wait(num_outstanding=0, deps=(b_o, b_pd))
            b_p = b_p * b_scale[:, None]
            b_l = b_l * b_scale
            b_o = b_o * gl.convert_layout(b_scale, ROW_O)[:, None]
            b_m = b_m1
            b_pb = b_p.to(dtype)
        p_own_s.store(b_pb)
        fence_async_shared()
        _BARRIER()
        mbarrier.arrive(bars.index(P_READY + WG))
        if WG == 0:
            # this warpgroup alone read slot 0's first half (its QK^T, its PV): refill it
            if j + 1 < n_pairs:
                _ws_gather_half(
                    KV,
                    Idx,
                    i_t,
                    w0 + 2 * BLOCK_N,
                    w_hi,
                    stride_it,
                    stride_iw,
                    num_rows,
                    page_size,
                    stride_kb,
                    stride_kr,
                    k_own,
                    kr_own,
                    OWN,
                    BLOCK_N,
                    L,
                    R,
                    PAGE_SHIFT,
                )

        # PV of the other warpgroup's step, its P from shared memory
        mbarrier.wait(bars.index(P_READY + OTHER), ph)
        b_o = warpgroup_mma(
            p_other_s, k_other.slice(WG * HALF_L, HALF_L, dim=1), b_o, is_async=True
        )
        if WG == 1:
            # the own PV (the older group) is done: slot 1's second half is this warpgroup's
            b_pd = warpgroup_mma_wait(num_outstanding=1, deps=(b_pd,))
            _BARRIER()
            if j + 1 < n_pairs:
                _ws_gather_half(
                    KV,
                    Idx,
                    i_t,
                    w0 + 2 * BLOCK_N,
                    w_hi,
                    stride_it,
                    stride_iw,
                    num_rows,
                    page_size,
                    stride_kb,
                    stride_kr,
                    k_own,
                    kr_own,
                    OWN,
                    BLOCK_N,
                    L,
                    R,
                    PAGE_SHIFT,
                )
        b_o = warpgroup_mma_wait(num_outstanding=0, deps=(b_o,))
        _BARRIER()
        # the other slot's half this warpgroup read (and, for warpgroup 1, slot 0's P) is free
        mbarrier.arrive(bars.index(HALF_FREE + OTHER))
        # ... and once the other warpgroup's PV is done with this slot's other half, refill it
        if j + 1 < n_pairs:
            mbarrier.wait(bars.index(HALF_FREE + WG), ph)
            _ws_gather_half(
                KV,
                Idx,
                i_t,
                w0 + 2 * BLOCK_N,
                w_hi,
                stride_it,
                stride_iw,
                num_rows,
                page_size,
                stride_kb,
                stride_kr,
                k_own,
                kr_own,
                OTHER,
                BLOCK_N,
                L,
                R,
                PAGE_SHIFT,
            )
    async_copy.wait_group(0)

    # the sums: each warpgroup's covers its own steps, both in the final max's basis
    l_s.index(WG).store(b_l)
    _BARRIER()
    mbarrier.arrive(bars.index(L_READY))
    mbarrier.wait(bars.index(L_READY), 0)
    b_l = b_l + l_s.index(OTHER).load(ROW)
    b_inv, b_lse = _result_scale(
        b_m, b_l, 1.0, Sink, i_hb, H, stride_sink, BLOCK_H, SPLIT, HAS_SINK, S_LAYOUT
    )
    _store_chunk(
        b_o * gl.convert_layout(b_inv, ROW_O)[:, None],
        Out,
        OPart,
        i_t,
        i_ts,
        i_hb,
        H,
        stride_ot,
        stride_oh,
        stride_od,
        WG,
        BLOCK_H,
        HALF_L,
        L,
        SPLIT,
        O_LAYOUT,
    )
    if WG == 0:
        _store_lse(b_lse, Lse, LsePart, i_t, i_ts, i_hb, H, BLOCK_H, SPLIT, STORE_LSE, S_LAYOUT)


@gluon.jit
def sparse_mla_latent_sm90_gluon_ws_kernel(
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
    Q_LAYOUT: gl.constexpr = gl.BlockedLayout([1, 8], [4, 8], [WS_WARPS, 1], [1, 0])
    MMA_SMEM: gl.constexpr = gl.NVMMASharedLayout(
        swizzle_byte_width=128, element_bitwidth=16, rank=2
    )
    ROW_SMEM: gl.constexpr = gl.SwizzledSharedLayout(vec=1, per_phase=1, max_phase=1, order=[0])

    i_hb, i_ts, i_s, i_t = _program_coords(num_hb, num_splits)
    dtype: gl.constexpr = Q_nope.dtype.element_ty

    o_hq = i_hb * BLOCK_H + gl.arange(0, BLOCK_H, layout=gl.SliceLayout(1, Q_LAYOUT))
    m_hq = o_hq < H
    o_lq = gl.arange(0, L, layout=gl.SliceLayout(0, Q_LAYOUT))
    p_q = Q_nope + i_t * stride_qnt + o_hq.to(gl.int64)[:, None] * stride_qnh
    b_q = gl.load(p_q + o_lq[None, :] * stride_qnd, mask=m_hq[:, None], other=0.0)
    q_s = gl.allocate_shared_memory(dtype, [1, BLOCK_H, L], MMA_SMEM)
    q_s.index(0).store(b_q)
    o_rq = gl.arange(0, 64, layout=gl.SliceLayout(0, Q_LAYOUT))
    p_qr = Q_rope + i_t * stride_qrt + o_hq.to(gl.int64)[:, None] * stride_qrh
    b_qr = gl.load(
        p_qr + o_rq[None, :] * stride_qrd, mask=m_hq[:, None] & (o_rq < R)[None, :], other=0.0
    )
    qr_s = gl.allocate_shared_memory(dtype, [1, BLOCK_H, 64], MMA_SMEM)
    qr_s.index(0).store(b_qr)

    # slot s holds the rows of steps 2j + s; P of slot 1's step crosses in p1_s (slot 0's in
    # slot 0's rope tile)
    nope_ring = gl.allocate_shared_memory(dtype, [2, BLOCK_N, L], MMA_SMEM)
    rope_ring = gl.allocate_shared_memory(dtype, [2, BLOCK_N, 64], MMA_SMEM)
    p1_s = gl.allocate_shared_memory(dtype, [1, BLOCK_H, BLOCK_N], MMA_SMEM)
    m_s = gl.allocate_shared_memory(gl.float32, [BLOCK_H], ROW_SMEM)
    l_s = gl.allocate_shared_memory(gl.float32, [2, BLOCK_H], ROW_SMEM)
    # _ws_warpgroup's barriers: two max, two P, two half-free (one arrival each), the sums (two)
    bars = gl.allocate_shared_memory(gl.int64, [7, 1], mbarrier.MBarrierLayout())
    for i in gl.static_range(6):
        mbarrier.init(bars.index(i), count=1)
    mbarrier.init(bars.index(6), count=2)
    fence_async_shared()

    w_lo, w_hi, n_steps = _split_range(
        Counts, i_t, i_s, W, split_len, stride_ct, BLOCK_N, HAS_COUNTS
    )
    qk_scale = sm_scale * LOG2E
    # (the partition list is written out: Gluon does not take it as a value)
    gl.warp_specialize(
        [
            (
                _ws_warpgroup,
                (
                    KV,
                    Idx,
                    Sink,
                    Out,
                    Lse,
                    OPart,
                    LsePart,
                    q_s,
                    qr_s,
                    nope_ring,
                    rope_ring,
                    p1_s,
                    m_s,
                    l_s,
                    bars,
                    i_t,
                    i_ts,
                    i_hb,
                    w_lo,
                    w_hi,
                    n_steps,
                    H,
                    qk_scale,
                    stride_it,
                    stride_iw,
                    num_rows,
                    page_size,
                    stride_kb,
                    stride_kr,
                    stride_ot,
                    stride_oh,
                    stride_od,
                    stride_sink,
                    0,
                    BLOCK_H,
                    BLOCK_N,
                    L,
                    R,
                    PAGE_SHIFT,
                    SPLIT,
                    STORE_LSE,
                    HAS_SINK,
                ),
            ),
            (
                _ws_warpgroup,
                (
                    KV,
                    Idx,
                    Sink,
                    Out,
                    Lse,
                    OPart,
                    LsePart,
                    q_s,
                    qr_s,
                    nope_ring,
                    rope_ring,
                    p1_s,
                    m_s,
                    l_s,
                    bars,
                    i_t,
                    i_ts,
                    i_hb,
                    w_lo,
                    w_hi,
                    n_steps,
                    H,
                    qk_scale,
                    stride_it,
                    stride_iw,
                    num_rows,
                    page_size,
                    stride_kb,
                    stride_kr,
                    stride_ot,
                    stride_oh,
                    stride_od,
                    stride_sink,
                    1,
                    BLOCK_H,
                    BLOCK_N,
                    L,
                    R,
                    PAGE_SHIFT,
                    SPLIT,
                    STORE_LSE,
                    HAS_SINK,
                ),
            ),
        ],
        [WS_WARPS],
        [WS_REGS],
    )
