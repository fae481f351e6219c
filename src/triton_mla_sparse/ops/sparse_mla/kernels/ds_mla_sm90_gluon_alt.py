"""fp8_ds_mla decode on sm90 in Gluon: two warpgroups on alternate 32-row steps, each
dequantizing its own (KernelConfig.gluon="alternating").

The rows-in-bf16 warp-specialized kernel's schedule (latent_sm90_gluon.py) with the
dequantization inside it. Warpgroup w takes steps 2j + w. For its step it

- gathers the rows' e4m3 bytes, four scales and bf16 rope with cp.async one step ahead, into a
  raw slot of its own (and one of two rope slots);
- dequantizes the bytes once into an fp16 K tile of its own, relative to the step's reference
  scale (the smallest power of two >= its largest chunk scale: KernelConfig.fp16_fold's
  numerics, one fp16 rounding per value), and then refills the raw slot with its next step;
- computes QK^T over the whole latent (the NoPE part in fp16, the rope part in bf16 into a
  second accumulator) and the step's softmax;
- accumulates half of O's columns from both warpgroups' steps: its own P from registers, the
  other's through shared memory.

Every row is dequantized once, by one warpgroup, for both. The aim is one warpgroup's
dequantization, gathers and softmax running while the other's MMAs do. Measured, it is only
0.95-0.99x the pipelined kernel's time at 64-128 tokens (docs/PERFORMANCE.md, log entry 58):
each warpgroup's own chain (gather wait, dequantization, QK^T, softmax, two PVs) bounds it, so
it is opt-in.

Each warpgroup keeps its own running max, sum and fp8 basis for its half of O. It publishes
its step's P unscaled, with the row maxima and reference scale it was formed against, and moves
the other warpgroup's P, read back from shared memory, into its own max and basis before its
PV; the sums and maxima are combined once, at the end. Nothing of the other warpgroup's is
waited for before a warpgroup's own P is out, so the two can drift apart (a first form handed
the running max from warpgroup 0 to 1 and back every pair, which kept them in step:
docs/PERFORMANCE.md, log entries 54 and 57). O counts in units of a basis: a warpgroup's own
step's reference, then the larger of it and the other step's. The other warpgroup's P is scaled
by its reference / basis (a power of two, at most one: a ratio of neighbouring steps'
references) before its fp16 rounding, the own P not at all, and O is moved between bases
exactly (fp32, a power of two). The warpgroups meet at mbarriers: P published, a K tile (with the P and
maxima beside it) released, the sums.

Shared memory (64 heads, 32-row steps): q in fp16 64 KB and its rope 8 KB; per warpgroup a raw
slot (16.5 KB), two rope slots (8 KB), an fp16 K tile (32 KB) and P (4 KB): 194 KB.

The runtime argument list is the Triton kernel's (launch.py passes the same arguments); block
tables, an extra index set, the integer e4m3 decode and other tiles are refused by
plan.check_config before any launch.
"""

from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.ampere import async_copy, mbarrier
from triton.experimental.gluon.language.nvidia.hopper import (
    fence_async_shared,
    warpgroup_mma,
    warpgroup_mma_wait,
)

from .ds_mla_sm90_gluon import (
    _BARRIER,
    LOG2E,
    NUM_CHUNKS,
    _dequant_chunks,
    _gather,
    _program_coords,
    _result_scale,
    _split_range,
    _step_scales,
    _store_chunk,
    _store_lse,
)

ALT_WARPS = gl.constexpr(4)  # each partition is one warpgroup
# the columns of O each warpgroup accumulates (and of a K tile its PV reads): warpgroup w the w-th
HALF_L = gl.constexpr(256)
# registers a thread of either partition may hold; as in latent_sm90_gluon.WS_REGS, ptxas
# allocates the whole kernel 255 (the O half is 128 of them), so setmaxnreg returns at once
ALT_REGS = gl.constexpr(256)
ROPE = gl.constexpr(64)  # the record's bf16 rope values
# the cross-warpgroup mbarriers (one arrival each but the sums'): a warpgroup's P and maxima
# published (one per warpgroup), its K tile free (one per warpgroup), the sums and maxima
P_READY = gl.constexpr(0)
K_FREE = gl.constexpr(2)
L_READY = gl.constexpr(4)
NUM_BARS = gl.constexpr(5)


@gluon.jit
def _alt_gather(
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
    raw_slot,
    scale_slot,
    rope_slot,
    BLOCK_N: gl.constexpr,
    L: gl.constexpr,
    R: gl.constexpr,
    PAGE_SHIFT: gl.constexpr,
):
    # one warpgroup's cp.async of a step's rows (one commit group): a warp covers 2 rows x 256
    # bytes of e4m3, 8 rows of scales, 4 rows of rope
    _gather(
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
        raw_slot,
        scale_slot,
        rope_slot,
        BLOCK_N,
        L,
        R,
        PAGE_SHIFT,
        gl.BlockedLayout([1, 16], [2, 16], [ALT_WARPS, 1], [1, 0]),
        gl.BlockedLayout([1, 1], [8, 4], [ALT_WARPS, 1], [1, 0]),
        gl.BlockedLayout([1, 8], [4, 8], [ALT_WARPS, 1], [1, 0]),
    )
    async_copy.commit_group()


@gluon.jit
def _alt_warpgroup(
    KV,
    Idx,
    Sink,
    Out,
    Lse,
    OPart,
    LsePart,
    q_s,
    qr_s,
    raw_ring,
    scale_ring,
    rope_ring,
    k_ring,
    p_ring,
    x_s,
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
    # One warpgroup's walk over steps 2j + WG (module docstring). Per pair j it folds its own
    # step into its own running max and fp8 basis, publishes that step's P unscaled with the max
    # and reference it was formed against, and moves the other warpgroup's P, read back from
    # shared memory, into its own max and basis before multiplying it. Nothing passes from one
    # warpgroup to the other before its own P is out, so they may drift apart. A K tile (and
    # the P and row maxima beside it) is rewritten only once the other warpgroup has read it.
    S_LAYOUT: gl.constexpr = gl.NVMMADistributedLayout(
        version=[3, 0], warps_per_cta=[ALT_WARPS, 1], instr_shape=[16, 32, 16]
    )
    O_LAYOUT: gl.constexpr = gl.NVMMADistributedLayout(
        version=[3, 0], warps_per_cta=[ALT_WARPS, 1], instr_shape=[16, 256, 16]
    )
    P_LAYOUT: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=O_LAYOUT, k_width=2)
    ROW: gl.constexpr = gl.SliceLayout(1, S_LAYOUT)
    ROW_O: gl.constexpr = gl.SliceLayout(1, O_LAYOUT)
    DQ_LAYOUT: gl.constexpr = gl.BlockedLayout([1, 16], [4, 8], [ALT_WARPS, 1], [1, 0])
    # a row's four scales on every thread that dequantizes that row (DQ_LAYOUT's row mapping)
    SC_DQ_LAYOUT: gl.constexpr = gl.BlockedLayout([1, 4], [4, 8], [ALT_WARPS, 1], [1, 0])
    OTHER: gl.constexpr = 1 - WG

    n_pairs = gl.cdiv(n_steps, 2)

    b_m = gl.full([BLOCK_H], float("-inf"), gl.float32, layout=ROW)
    b_l = gl.zeros([BLOCK_H], gl.float32, layout=ROW)  # this warpgroup's own steps
    b_o = gl.zeros([BLOCK_H, HALF_L], gl.float32, layout=O_LAYOUT)
    # O's unit: the true accumulator is b_o * b_base; 0 until a step has a reference (O is zero
    # until then, and stays zero where no step has one: every key is zero)
    b_base = 0.0

    _alt_gather(
        KV,
        Idx,
        i_t,
        w_lo + WG * BLOCK_N,
        w_hi,
        stride_it,
        stride_iw,
        num_rows,
        page_size,
        stride_kb,
        raw_ring.index(WG),
        scale_ring.index(WG),
        rope_ring.index(2 * WG),
        BLOCK_N,
        L,
        R,
        PAGE_SHIFT,
    )
    for j in range(n_pairs):
        ph = j & 1
        # views indexed by a zero the compiler cannot see is one (the grid has one dimension):
        # with constant views it hoists every wgmma's descriptors out of the walk
        # (latent_sm90_gluon._ws_warpgroup)
        i_z = j * gl.program_id(1)
        q_v = q_s.index(i_z)
        qr_v = qr_s.index(i_z)
        raw = raw_ring.index(WG + i_z)
        k_own = k_ring.index(WG + i_z)
        k_other = k_ring.index(OTHER + i_z)
        p_own_s = p_ring.index(WG + i_z)
        p_other_s = p_ring.index(OTHER + i_z)
        kr_v = rope_ring.index(2 * WG + ph + i_z)
        w0 = w_lo + (2 * j + WG) * BLOCK_N
        o_n = gl.arange(0, BLOCK_N, layout=gl.SliceLayout(0, S_LAYOUT))
        p_idx = Idx + i_t * stride_it + w0.to(gl.int64) * stride_iw
        b_idx = gl.load(p_idx + o_n * stride_iw, mask=o_n < w_hi - w0, other=-1)
        m_n = (b_idx >= 0) & (b_idx < num_rows)

        # the step's rows are in (every thread's copies); its reference scale (0 where no row
        # has a scale: the step's keys are all zero and add nothing to O)
        async_copy.wait_group(0)
        _BARRIER()
        b_rel, b_ref, b_cmax = _step_scales(scale_ring.index(WG + i_z), SC_DQ_LAYOUT)
        b_ref_eff = gl.where(b_cmax > 0.0, b_ref, 0.0)

        # the K tile, P and published maxima are free once the other warpgroup has read them
        if j > 0:
            mbarrier.wait(bars.index(K_FREE + WG), ph ^ 1)
        _dequant_chunks(raw, b_rel, k_own, DQ_LAYOUT, SC_DQ_LAYOUT)
        fence_async_shared()
        _BARRIER()  # the tile is in and the raw slot read by every thread
        # QK^T: the NoPE chain in fp16 (units of the reference), the rope in bf16, one wait
        b_sn = gl.zeros([BLOCK_H, BLOCK_N], gl.float32, layout=S_LAYOUT)
        b_sn = warpgroup_mma(q_v, k_own.permute((1, 0)), b_sn, use_acc=False, is_async=True)
        if R > 0:
            b_sr = gl.zeros([BLOCK_H, BLOCK_N], gl.float32, layout=S_LAYOUT)
            b_sr = warpgroup_mma(qr_v, kr_v.permute((1, 0)), b_sr, use_acc=False, is_async=True)
        # the next step's rows into the raw slot (and the other rope slot) while QK^T runs
        if j + 1 < n_pairs:
            _alt_gather(
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
                raw,
                scale_ring.index(WG + i_z),
                rope_ring.index(2 * WG + 1 - ph + i_z),
                BLOCK_N,
                L,
                R,
                PAGE_SHIFT,
            )
        if R > 0:
            b_sn, b_sr = warpgroup_mma_wait(num_outstanding=0, deps=(b_sn, b_sr))
            b_s = b_sn * b_ref + b_sr
        else:
            b_sn = warpgroup_mma_wait(num_outstanding=0, deps=(b_sn,))
            b_s = b_sn * b_ref
        b_s = gl.where(m_n[None, :], b_s * qk_scale, float("-inf"))

        # the own step, into this warpgroup's max; O moves to the step's reference as its basis
        # (exact in fp32), so that the own P needs no scaling and only the other warpgroup's P,
        # from the neighbouring step, is scaled before its fp16 rounding
        b_m_new = gl.maximum(b_m, gl.max(b_s, 1))
        b_m_use = gl.where(b_m_new == float("-inf"), 0.0, b_m_new)
        b_alpha = gl.exp2(b_m - b_m_use)
        b_p = gl.exp2(b_s - b_m_use[:, None])
        b_l = b_l * b_alpha + gl.sum(b_p, 1)  # (l counts P itself, before the basis)
        b_m = b_m_new
        b_base_new = gl.where(b_ref_eff > 0.0, b_ref_eff, b_base)
        b_base_use = gl.where(b_base_new > 0.0, b_base_new, 1.0)
        b_o = b_o * gl.convert_layout(b_alpha * (b_base / b_base_use), ROW_O)[:, None]
        b_base = b_base_new
        # published unscaled, with the max (-inf where nothing is valid yet: P is zero there)
        # and the reference it was formed against
        p_own_s.store(b_p.to(gl.float16))
        x_s.index(2 * WG).store(b_m)
        x_s.index(2 * WG + 1).store(gl.full([BLOCK_H], 0.0, gl.float32, layout=ROW) + b_ref_eff)
        fence_async_shared()
        _BARRIER()
        mbarrier.arrive(bars.index(P_READY + WG))
        # PV of the own step, P from registers (r / basis: 1, or 0 for a step without a
        # reference, whose keys are zero)
        b_pd = gl.convert_layout((b_p * (b_ref_eff / b_base_use)).to(gl.float16), P_LAYOUT)
        b_o = warpgroup_mma(b_pd, k_own.slice(WG * HALF_L, HALF_L, dim=1), b_o, is_async=True)

        # the other warpgroup's step: its P moved into this warpgroup's max and into the basis,
        # the larger of the two steps' references (r / basis <= 1, a power of two, applied
        # before the fp16 rounding: the ratio of two neighbouring steps' references)
        mbarrier.wait(bars.index(P_READY + OTHER), ph)
        b_mo = x_s.index(2 * OTHER).load(ROW)
        b_refo = gl.max(x_s.index(2 * OTHER + 1).load(ROW), 0)
        b_po = p_other_s.load(S_LAYOUT).to(gl.float32)
        b_m_new = gl.maximum(b_m, b_mo)
        b_m_use = gl.where(b_m_new == float("-inf"), 0.0, b_m_new)
        b_alpha = gl.exp2(b_m - b_m_use)
        b_l = b_l * b_alpha
        b_m = b_m_new
        b_base_new = gl.maximum(b_base, b_refo)
        b_base_use = gl.where(b_base_new > 0.0, b_base_new, 1.0)
        b_po = b_po * (gl.exp2(b_mo - b_m_use) * (b_refo / b_base_use))[:, None]
        b_pdo = gl.convert_layout(b_po.to(gl.float16), P_LAYOUT)
        b_o, b_pd = warpgroup_mma_wait(num_outstanding=0, deps=(b_o, b_pd))
        b_o = b_o * gl.convert_layout(b_alpha * (b_base / b_base_use), ROW_O)[:, None]
        b_base = b_base_new
        b_o = warpgroup_mma(b_pdo, k_other.slice(WG * HALF_L, HALF_L, dim=1), b_o, is_async=True)
        b_o = warpgroup_mma_wait(num_outstanding=0, deps=(b_o,))
        _BARRIER()
        # the other warpgroup's K tile, P and maxima are free
        mbarrier.arrive(bars.index(K_FREE + OTHER))
    async_copy.wait_group(0)

    # the sums (each over its own steps, in its own max) and the maxima, combined once
    l_s.index(WG).store(b_l)
    l_s.index(2 + WG).store(b_m)
    _BARRIER()
    mbarrier.arrive(bars.index(L_READY))
    mbarrier.wait(bars.index(L_READY), 0)
    b_lo = l_s.index(OTHER).load(ROW)
    b_mo = l_s.index(2 + OTHER).load(ROW)
    b_mt = gl.maximum(b_m, b_mo)
    b_mt_use = gl.where(b_mt == float("-inf"), 0.0, b_mt)
    b_own = gl.exp2(b_m - b_mt_use)
    b_lt = b_l * b_own + b_lo * gl.exp2(b_mo - b_mt_use)
    b_inv, b_lse = _result_scale(
        b_mt, b_lt, 1.0, Sink, i_hb, H, stride_sink, BLOCK_H, SPLIT, HAS_SINK, S_LAYOUT
    )
    b_inv = b_inv * b_own * b_base
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
def sparse_mla_ds_mla_sm90_gluon_alt_kernel(
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
    E4M3_DECODE: gl.constexpr,
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
    gl.static_assert(BLOCK_H == 64 and BLOCK_N == 32 and L == 512, "the 64 x 32 tile only")
    gl.static_assert(R == ROPE or R == 0, "the record's 64 rope values, or none (NoPE)")
    gl.static_assert(FOLD_FP16 and FP8_NATIVE, "fp16 MMAs with folded scales, native e4m3")
    gl.static_assert(not HAS_BT and not HAS_EXTRA, "no block table, no extra set")
    Q_LAYOUT: gl.constexpr = gl.BlockedLayout([1, 8], [4, 8], [ALT_WARPS, 1], [1, 0])
    MMA_SMEM: gl.constexpr = gl.NVMMASharedLayout(
        swizzle_byte_width=128, element_bitwidth=16, rank=2
    )
    # P [64 heads, 32 keys] in fp16: 64-byte rows
    P_SMEM: gl.constexpr = gl.NVMMASharedLayout(swizzle_byte_width=64, element_bitwidth=16, rank=2)
    RAW_SMEM: gl.constexpr = gl.SwizzledSharedLayout(vec=16, per_phase=1, max_phase=1, order=[1, 0])
    SCALE_SMEM: gl.constexpr = gl.SwizzledSharedLayout(
        vec=4, per_phase=1, max_phase=1, order=[1, 0]
    )
    ROW_SMEM: gl.constexpr = gl.SwizzledSharedLayout(vec=1, per_phase=1, max_phase=1, order=[0])

    i_hb, i_ts, i_s, i_t = _program_coords(num_hb, num_splits)

    # q: NoPE part in fp16 (the folded tile's MMA type), rope part as it is (bf16)
    o_hq = i_hb * BLOCK_H + gl.arange(0, BLOCK_H, layout=gl.SliceLayout(1, Q_LAYOUT))
    m_hq = o_hq < H
    o_lq = gl.arange(0, L, layout=gl.SliceLayout(0, Q_LAYOUT))
    p_q = Q_nope + i_t * stride_qnt + o_hq.to(gl.int64)[:, None] * stride_qnh
    b_q = gl.load(p_q + o_lq[None, :] * stride_qnd, mask=m_hq[:, None], other=0.0)
    q_s = gl.allocate_shared_memory(gl.float16, [1, BLOCK_H, L], MMA_SMEM)
    q_s.index(0).store(b_q.to(gl.float16))
    # (allocated without rope too, zero: the partitions take the same arguments either way)
    o_rq = gl.arange(0, ROPE, layout=gl.SliceLayout(0, Q_LAYOUT))
    p_qr = Q_rope + i_t * stride_qrt + o_hq.to(gl.int64)[:, None] * stride_qrh
    b_qr = gl.load(
        p_qr + o_rq[None, :] * stride_qrd, mask=m_hq[:, None] & (o_rq < R)[None, :], other=0.0
    )
    qr_s = gl.allocate_shared_memory(gl.bfloat16, [1, BLOCK_H, ROPE], MMA_SMEM)
    qr_s.index(0).store(b_qr)

    # per warpgroup w: raw slot w, rope slots 2w and 2w + 1 (alternate pairs), K tile w, P w
    raw_ring = gl.allocate_shared_memory(gl.uint8, [2, BLOCK_N, L], RAW_SMEM)
    scale_ring = gl.allocate_shared_memory(gl.float32, [2, BLOCK_N, NUM_CHUNKS], SCALE_SMEM)
    rope_ring = gl.allocate_shared_memory(gl.bfloat16, [4, BLOCK_N, ROPE], MMA_SMEM)
    k_ring = gl.allocate_shared_memory(gl.float16, [2, BLOCK_N, L], MMA_SMEM)
    p_ring = gl.allocate_shared_memory(gl.float16, [2, BLOCK_H, BLOCK_N], P_SMEM)
    # per warpgroup w: the row maxima (row 2w) and reference (row 2w + 1) its published P was
    # formed against; at the end its sums (row w) and maxima (row 2 + w)
    x_s = gl.allocate_shared_memory(gl.float32, [4, BLOCK_H], ROW_SMEM)
    l_s = gl.allocate_shared_memory(gl.float32, [4, BLOCK_H], ROW_SMEM)
    bars = gl.allocate_shared_memory(gl.int64, [NUM_BARS, 1], mbarrier.MBarrierLayout())
    for i in gl.static_range(L_READY):
        mbarrier.init(bars.index(i), count=1)
    mbarrier.init(bars.index(L_READY), count=2)  # both warpgroups arrive
    fence_async_shared()

    w_lo, w_hi, n_steps = _split_range(
        Counts, i_t, i_s, W, split_len, stride_ct, BLOCK_N, HAS_COUNTS
    )
    qk_scale = sm_scale * LOG2E
    # (the partition list is written out: Gluon does not take it as a value)
    gl.warp_specialize(
        [
            (
                _alt_warpgroup,
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
                    raw_ring,
                    scale_ring,
                    rope_ring,
                    k_ring,
                    p_ring,
                    x_s,
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
                _alt_warpgroup,
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
                    raw_ring,
                    scale_ring,
                    rope_ring,
                    k_ring,
                    p_ring,
                    x_s,
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
        [ALT_WARPS],
        [ALT_REGS],
    )
