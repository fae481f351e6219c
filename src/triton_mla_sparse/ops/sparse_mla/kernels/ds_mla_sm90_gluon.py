"""fp8_ds_mla decode on sm90 in Gluon: 64 heads, 64-row steps, two schedules written out.

The Triton kernel (ds_mla.py) leaves the schedule to Triton, which issues each step's gathers
after the step's last MMA and waits for each of its nine wgmmas before the next
(docs/perf-log/26-idx-ahead-sass.txt). Here the schedule is written out, in one partition of two
warpgroups:

- the rows of step i + 1 (e4m3 bytes, the four fp32 scales, the bf16 rope) are gathered with
  cp.async into the other half of a two-slot ring, issued once step i's QK^T is (so that the
  gather's index loads wait behind the MMAs), landing during step i's softmax and PV;
- step i's bytes are dequantized once into an fp16 K tile in shared memory, relative to the
  step's largest scale (KernelConfig.fp16_fold's numerics, the product formed in fp16: e4m3
  converts to fp16 exactly, the ratio scale / reference is rounded to fp16 once, and one packed
  multiply forms two values);
- QK^T is two asynchronous wgmma chains (the 512 NoPE columns in fp16, the 64 rope columns in
  bf16 straight from the ring) and one wait; PV one chain into the [64, 512] accumulator and
  one wait.

The warp-specialized form (KernelConfig.gluon="specialized") moves gather and dequantization
to a warpgroup of their own: it fills a two-slot ring of fp16 K tiles (and bf16 rope, and each
step's reference scale) under mbarriers, while the two MMA warpgroups run QK^T, the softmax and
PV on the other slot, so that dequantization overlaps the MMAs instead of preceding them.

The runtime argument list is the Triton kernel's (launch.py passes the same arguments); the
variants it does not implement (block tables, an extra index set, the integer e4m3 decode,
other tiles) are refused by plan.check_config before any launch.
"""

from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.ampere import async_copy, mbarrier
from triton.experimental.gluon.language.nvidia.hopper import (
    fence_async_shared,
    warpgroup_mma,
    warpgroup_mma_wait,
)

# cp.async into shared memory: async_load from Triton 3.8 on, async_copy_global_to_shared in 3.6
_ASYNC_LOAD = getattr(async_copy, "async_load", None) or async_copy.async_copy_global_to_shared
# the CTA barrier: barrier from Triton 3.8 on, thread_barrier in 3.6
_BARRIER = getattr(gl, "barrier", None) or gl.thread_barrier

ROW_BYTES = gl.constexpr(656)  # 512 e4m3, 4 fp32 scales, 64 bf16 rope values
SCALE_OFFSET = gl.constexpr(512)
ROPE_OFFSET = gl.constexpr(528)
LOG2E = gl.constexpr(1.4426950408889634)  # exp(x) = exp2(x * LOG2E)
NUM_CHUNKS = gl.constexpr(4)  # 128-wide NoPE chunks, one scale each
FP32_MANTISSA_MASK = gl.constexpr(0x7FFFFF)
FP32_EXPONENT_MASK = gl.constexpr(0x7F800000)


@gluon.jit
def _pow2_ref(b_cmax):
    # the step's reference scale: the smallest power of two >= its largest chunk scale (1 where
    # every row is masked). A power of two keeps the rope keys exact when divided by it (in the
    # warp-specialized form they then join the NoPE chain's accumulator) and every rescaling
    # of the accumulators exact; the NoPE tile is still e4m3 x (scale / reference), one fp16
    # rounding.
    b_bits = b_cmax.to(gl.int32, bitcast=True)
    b_pow2 = ((b_bits + FP32_MANTISSA_MASK) & FP32_EXPONENT_MASK).to(gl.float32, bitcast=True)
    return gl.where(b_cmax > 0.0, b_pow2, 1.0)


@gluon.jit
def _rows(
    Idx,
    i_t,
    w0,
    w_hi,
    stride_it,
    stride_iw,
    num_rows,
    page_size,
    stride_kb,
    stride_row,
    BLOCK_N: gl.constexpr,
    PAGE_SHIFT: gl.constexpr,
    ROW_LAYOUT: gl.constexpr,
    OFFSET_32: gl.constexpr = False,
):
    # offsets (in KV's elements) and validity of rows [w0, w0 + BLOCK_N) of token i_t's list,
    # in ROW_LAYOUT. Each tile that addresses the rows reads the (cached) indices in its own row
    # layout: that costs a few loads, where converting the offsets between layouts costs a round
    # trip through shared memory and two CTA barriers per tile. OFFSET_32
    # (KernelConfig.row_offsets_32): the offsets in 32-bit arithmetic, for a cache whose
    # elements all lie below 2^31 from KV (the plan checks it), one multiply-add a row instead
    # of a 64-bit multiply chain
    o_w = w0 + gl.arange(0, BLOCK_N, layout=ROW_LAYOUT)
    b_idx = gl.load(Idx + i_t * stride_it + o_w * stride_iw, mask=o_w < w_hi, other=-1)
    m_n = (b_idx >= 0) & (b_idx < num_rows)
    b_idx = gl.where(m_n, b_idx, 0)
    if PAGE_SHIFT >= 0:
        b_page = b_idx >> PAGE_SHIFT
        b_slot = b_idx & ((1 << PAGE_SHIFT) - 1)
    else:
        b_page = b_idx // page_size
        b_slot = b_idx - b_page * page_size
    if OFFSET_32:
        o_row = b_page * stride_kb + b_slot * stride_row
    else:
        o_row = b_page.to(gl.int64) * stride_kb + b_slot.to(gl.int64) * stride_row
    return o_row, m_n


@gluon.jit
def _gather_scales(
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
    scale_slot,
    BLOCK_N: gl.constexpr,
    PAGE_SHIFT: gl.constexpr,
    SCALE_LAYOUT: gl.constexpr,
    OFFSET_32: gl.constexpr = False,
):
    # cp.async of the four fp32 chunk scales of rows [w0, w0 + BLOCK_N) of token i_t's list into
    # scale_slot [BLOCK_N, NUM_CHUNKS] (masked rows zero-filled)
    o_row_s, m_n_s = _rows(
        Idx,
        i_t,
        w0,
        w_hi,
        stride_it,
        stride_iw,
        num_rows,
        page_size,
        stride_kb,
        ROW_BYTES,
        BLOCK_N,
        PAGE_SHIFT,
        gl.SliceLayout(1, SCALE_LAYOUT),
        OFFSET_32,
    )
    o_g = gl.arange(0, NUM_CHUNKS, layout=gl.SliceLayout(0, SCALE_LAYOUT))
    p_sc = (KV + o_row_s[:, None] + SCALE_OFFSET).to(gl.pointer_type(gl.float32)) + o_g[None, :]
    _ASYNC_LOAD(scale_slot, p_sc, mask=m_n_s[:, None] & (o_g < NUM_CHUNKS)[None, :])


@gluon.jit
def _gather(
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
    nope_slot,
    scale_slot,
    rope_slot,
    BLOCK_N: gl.constexpr,
    L: gl.constexpr,
    R: gl.constexpr,
    PAGE_SHIFT: gl.constexpr,
    NOPE_LAYOUT: gl.constexpr,
    SCALE_LAYOUT: gl.constexpr,
    ROPE_LAYOUT: gl.constexpr,
    OFFSET_32: gl.constexpr = False,
):
    # cp.async of rows [w0, w0 + BLOCK_N) of token i_t's list into one ring slot (masked rows and
    # positions past w_hi read nothing and are zero-filled); returns the rows' validity
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
        ROW_BYTES,
        BLOCK_N,
        PAGE_SHIFT,
        gl.SliceLayout(1, NOPE_LAYOUT),
        OFFSET_32,
    )
    o_c = gl.arange(0, L, layout=gl.SliceLayout(0, NOPE_LAYOUT))
    p_nope = KV + o_row[:, None] + o_c[None, :]
    _ASYNC_LOAD(nope_slot, p_nope, mask=m_n[:, None] & (o_c < L)[None, :])

    _gather_scales(
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
        scale_slot,
        BLOCK_N,
        PAGE_SHIFT,
        SCALE_LAYOUT,
        OFFSET_32,
    )

    if R > 0:
        o_row_r, m_n_r = _rows(
            Idx,
            i_t,
            w0,
            w_hi,
            stride_it,
            stride_iw,
            num_rows,
            page_size,
            stride_kb,
            ROW_BYTES,
            BLOCK_N,
            PAGE_SHIFT,
            gl.SliceLayout(1, ROPE_LAYOUT),
            OFFSET_32,
        )
        o_r = gl.arange(0, R, layout=gl.SliceLayout(0, ROPE_LAYOUT))
        p_rope = (KV + o_row_r[:, None] + ROPE_OFFSET).to(gl.pointer_type(gl.bfloat16)) + o_r[
            None, :
        ]
        _ASYNC_LOAD(rope_slot, p_rope, mask=m_n_r[:, None] & (o_r < R)[None, :])
    return m_n


@gluon.jit
def _row_sums_init(BLOCK_H: gl.constexpr, BLOCK_N: gl.constexpr, S_LAYOUT: gl.constexpr):
    # the softmax's row sums kept per warpgroup ([BLOCK_H, 2]: S's key columns as two halves,
    # one a warpgroup) and added once after the loop (_row_sums_total): summed within a
    # warpgroup, a step's sums need no exchange between the warpgroups (a CTA barrier)
    b_zero = gl.zeros([BLOCK_H, BLOCK_N], gl.float32, layout=S_LAYOUT)
    return gl.sum(gl.reshape(b_zero, [BLOCK_H, 2, BLOCK_N // 2]), 2)


@gluon.jit
def _row_sums_step(b_l2, b_alpha, b_p):
    # the online softmax's row-sum update, b_l = b_l * alpha + sum(P), per warpgroup half
    BLOCK_H: gl.constexpr = b_p.shape[0]
    BLOCK_N: gl.constexpr = b_p.shape[1]
    b_alpha2 = gl.convert_layout(b_alpha, gl.SliceLayout(1, b_l2.type.layout), assert_trivial=True)
    return b_l2 * b_alpha2[:, None] + gl.sum(gl.reshape(b_p, [BLOCK_H, 2, BLOCK_N // 2]), 2)


@gluon.jit
def _row_sums_total(b_l2, S_LAYOUT: gl.constexpr):
    return gl.convert_layout(gl.sum(b_l2, 1), gl.SliceLayout(1, S_LAYOUT))


@gluon.jit
def _step_scales(scale_slot, SC_DQ_LAYOUT: gl.constexpr, SC_MAX_LAYOUT: gl.constexpr = None):
    # a step's reference scale (its largest chunk scale rounded up to a power of two,
    # _pow2_ref) and every chunk scale relative to it; also the largest scale (0 where no row
    # has one). With SC_MAX_LAYOUT (every warp holding all rows' scales) the largest scale is
    # found within each warp, without an exchange between warps (the same value: max is exact)
    b_sc = scale_slot.load(SC_DQ_LAYOUT)
    if SC_MAX_LAYOUT is None:
        b_cmax = gl.max(gl.max(b_sc, 1), 0)
    else:
        b_cmax = gl.max(gl.max(scale_slot.load(SC_MAX_LAYOUT), 1), 0)
    b_ref = _pow2_ref(b_cmax)
    # (times the exact reciprocal of a power of two: the quotient, without a division each)
    return b_sc * (1.0 / b_ref), b_ref, b_cmax


@gluon.jit
def _dequant_chunks(raw_slot, b_rel, k_dst, DQ_LAYOUT: gl.constexpr, SC_DQ_LAYOUT: gl.constexpr):
    # a step's e4m3 rows (raw_slot) into k_dst in fp16, each 128-wide chunk times its scale
    # relative to the reference (b_rel, from _step_scales): the fp16 fold. SC_DQ_LAYOUT holds a
    # row's four scales on every thread that dequantizes that row in DQ_LAYOUT, so that
    # picking a chunk's scale needs no data movement between threads.
    o_g = gl.arange(0, NUM_CHUNKS, layout=gl.SliceLayout(0, SC_DQ_LAYOUT))
    for c in gl.static_range(NUM_CHUNKS):
        b_rel_c = gl.sum(gl.where((o_g == c)[None, :], b_rel, 0.0), 1)
        b_rel_c = gl.convert_layout(b_rel_c, gl.SliceLayout(1, DQ_LAYOUT))  # same rows
        b_k8 = raw_slot.slice(c * 128, 128, dim=1).load(DQ_LAYOUT)
        b_h = b_k8.to(gl.float8e4nv, bitcast=True).to(gl.float16)
        k_dst.slice(c * 128, 128, dim=1).store(b_h * b_rel_c.to(gl.float16)[:, None])


@gluon.jit
def _program_coords(num_hb, num_splits):
    # program -> (head block, token x split, split, token): the launcher's grid order
    i_p = gl.program_id(0)
    i_hb = i_p % num_hb
    i_ts = i_p // num_hb
    i_s = i_ts % num_splits
    i_t = (i_ts // num_splits).to(gl.int64)
    return i_hb, i_ts, i_s, i_t


@gluon.jit
def _split_range(
    Counts, i_t, i_s, W, split_len, stride_ct, BLOCK_N: gl.constexpr, HAS_COUNTS: gl.constexpr
):
    # split i_s's part [w_lo, w_hi) of token i_t's list (its valid count where given) and its
    # number of BLOCK_N-row steps
    w_end = W
    if HAS_COUNTS:
        w_end = gl.minimum(gl.load(Counts + i_t * stride_ct), W)
    w_lo = i_s * split_len
    w_hi = gl.minimum(w_lo + split_len, w_end)
    return w_lo, w_hi, gl.cdiv(gl.maximum(w_hi - w_lo, 0), BLOCK_N)


@gluon.jit
def _result_scale(
    b_m,
    b_l,
    b_scale,
    Sink,
    i_hb,
    H,
    stride_sink,
    BLOCK_H: gl.constexpr,
    SPLIT: gl.constexpr,
    HAS_SINK: gl.constexpr,
    S_LAYOUT: gl.constexpr,
):
    # a program's normalisation from its running max b_m (log2 units) and sum b_l: the factor its
    # accumulator (in units of b_scale) is multiplied by, and the LSE; an empty (t, split) gives
    # zeros and LSE -inf
    o_h = i_hb * BLOCK_H + gl.arange(0, BLOCK_H, layout=gl.SliceLayout(1, S_LAYOUT))
    m_h = o_h < H
    b_nonempty = b_l > 0.0
    b_inv = 1.0 / gl.where(b_nonempty, b_l, 1.0)
    if HAS_SINK and not SPLIT:  # a split's partial leaves the sink to the merge
        b_sink = gl.load(Sink + o_h * stride_sink, mask=m_h, other=float("-inf")).to(gl.float32)
        b_m_use = gl.where(b_m == float("-inf"), 0.0, b_m)
        b_den = b_l + gl.exp2(b_sink * LOG2E - b_m_use)
        b_inv = gl.where(b_den > 0.0, 1.0 / gl.where(b_den > 0.0, b_den, 1.0), 0.0)
    b_lse = gl.where(
        b_nonempty, (b_m + gl.log2(gl.where(b_nonempty, b_l, 1.0))) / LOG2E, float("-inf")
    )
    return b_inv * b_scale, b_lse


@gluon.jit
def _store_chunk(
    b_out,
    Out,
    OPart,
    i_t,
    i_ts,
    i_hb,
    H,
    stride_ot,
    stride_oh,
    stride_od,
    c: gl.constexpr,
    BLOCK_H: gl.constexpr,
    C: gl.constexpr,
    L: gl.constexpr,
    SPLIT: gl.constexpr,
    O_LAYOUT: gl.constexpr,
):
    # columns [c * C, (c + 1) * C) of the normalised output (or of the split's partial)
    o_ho = i_hb * BLOCK_H + gl.arange(0, BLOCK_H, layout=gl.SliceLayout(1, O_LAYOUT))
    m_ho = o_ho < H
    o_lo = c * C + gl.arange(0, C, layout=gl.SliceLayout(0, O_LAYOUT))
    if SPLIT:
        p_o = OPart + (i_ts.to(gl.int64) * H + o_ho)[:, None] * L + o_lo[None, :]
        gl.store(p_o, b_out, mask=m_ho[:, None])
    else:
        p_o = Out + i_t * stride_ot + o_ho.to(gl.int64)[:, None] * stride_oh
        gl.store(
            p_o + o_lo[None, :] * stride_od, b_out.to(Out.dtype.element_ty), mask=m_ho[:, None]
        )


@gluon.jit
def _store_lse(
    b_lse,
    Lse,
    LsePart,
    i_t,
    i_ts,
    i_hb,
    H,
    BLOCK_H: gl.constexpr,
    SPLIT: gl.constexpr,
    STORE_LSE: gl.constexpr,
    S_LAYOUT: gl.constexpr,
):
    # the LSE of the program's heads: the split's partial, or the output's where asked for
    o_h = i_hb * BLOCK_H + gl.arange(0, BLOCK_H, layout=gl.SliceLayout(1, S_LAYOUT))
    if SPLIT:
        gl.store(LsePart + i_ts.to(gl.int64) * H + o_h, b_lse, mask=o_h < H)
    elif STORE_LSE:
        gl.store(Lse + i_t * H + o_h, b_lse, mask=o_h < H)


@gluon.jit
def _store_result(
    b_o,
    b_m,
    b_l,
    b_scale,
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
    BLOCK_H: gl.constexpr,
    L: gl.constexpr,
    SPLIT: gl.constexpr,
    STORE_LSE: gl.constexpr,
    HAS_SINK: gl.constexpr,
    S_LAYOUT: gl.constexpr,
    O_LAYOUT: gl.constexpr,
):
    # the program's result from its running max b_m (log2 units), sum b_l and accumulator b_o
    # (in units of b_scale): the output (or the split's partial) and its LSE
    b_inv, b_lse = _result_scale(
        b_m, b_l, b_scale, Sink, i_hb, H, stride_sink, BLOCK_H, SPLIT, HAS_SINK, S_LAYOUT
    )
    b_out = b_o * gl.convert_layout(b_inv, gl.SliceLayout(1, O_LAYOUT))[:, None]
    _store_chunk(
        b_out,
        Out,
        OPart,
        i_t,
        i_ts,
        i_hb,
        H,
        stride_ot,
        stride_oh,
        stride_od,
        0,
        BLOCK_H,
        L,
        L,
        SPLIT,
        O_LAYOUT,
    )
    _store_lse(b_lse, Lse, LsePart, i_t, i_ts, i_hb, H, BLOCK_H, SPLIT, STORE_LSE, S_LAYOUT)


@gluon.jit
def sparse_mla_ds_mla_sm90_gluon_kernel(
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
    gl.static_assert(BLOCK_H == 64 and BLOCK_N == 64 and L == 512, "the 64 x 64 tile only")
    gl.static_assert(FOLD_FP16 and FP8_NATIVE, "fp16 MMAs with folded scales, native e4m3")
    gl.static_assert(not HAS_BT and not HAS_EXTRA, "no block table, no extra set")

    # register layouts (8 warps): S [64 heads, 64 keys] and O [64, 512] both split by columns
    # between the two warpgroups (each computes half the keys' logits: no QK^T twice; P crosses
    # to the other warpgroup through shared memory for the PV product)
    S_LAYOUT: gl.constexpr = gl.NVMMADistributedLayout(
        version=[3, 0], warps_per_cta=[4, 2], instr_shape=[16, 32, 16]
    )
    O_LAYOUT: gl.constexpr = gl.NVMMADistributedLayout(
        version=[3, 0], warps_per_cta=[4, 2], instr_shape=[16, 256, 16]
    )
    P_LAYOUT: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=O_LAYOUT, k_width=2)
    NOPE_LAYOUT: gl.constexpr = gl.BlockedLayout([1, 16], [2, 16], [8, 1], [1, 0])
    SCALE_LAYOUT: gl.constexpr = gl.BlockedLayout([1, 1], [8, 4], [8, 1], [1, 0])
    ROPE_LAYOUT: gl.constexpr = gl.BlockedLayout([1, 8], [4, 8], [8, 1], [1, 0])
    DQ_LAYOUT: gl.constexpr = gl.BlockedLayout([1, 16], [4, 8], [8, 1], [1, 0])
    # a row's four scales on every thread that dequantizes that row (DQ_LAYOUT's row mapping):
    # picking a chunk's scale needs no data movement between threads
    SC_DQ_LAYOUT: gl.constexpr = gl.BlockedLayout([1, 4], [4, 8], [8, 1], [1, 0])
    Q_LAYOUT: gl.constexpr = gl.BlockedLayout([1, 8], [2, 16], [8, 1], [1, 0])
    # every warp holds all 64 rows' four scales (two rows a lane, the eight warps replicating
    # the tile), so the step's largest scale needs no exchange between warps (a CTA barrier)
    SC_MAX_LAYOUT: gl.constexpr = gl.BlockedLayout([2, 4], [32, 1], [1, 8], [1, 0])
    # shared layouts: MMA operands swizzled for wgmma, the raw bytes plain
    MMA_SMEM: gl.constexpr = gl.NVMMASharedLayout(
        swizzle_byte_width=128, element_bitwidth=16, rank=2
    )
    RAW_SMEM: gl.constexpr = gl.SwizzledSharedLayout(vec=16, per_phase=1, max_phase=1, order=[1, 0])
    SCALE_SMEM: gl.constexpr = gl.SwizzledSharedLayout(
        vec=4, per_phase=1, max_phase=1, order=[1, 0]
    )

    i_hb, i_ts, i_s, i_t = _program_coords(num_hb, num_splits)

    # q: NoPE part in fp16 (the folded tile's MMA type), rope part as it is (bf16)
    o_hq = i_hb * BLOCK_H + gl.arange(0, BLOCK_H, layout=gl.SliceLayout(1, Q_LAYOUT))
    m_hq = o_hq < H
    o_lq = gl.arange(0, L, layout=gl.SliceLayout(0, Q_LAYOUT))
    p_q = Q_nope + i_t * stride_qnt + o_hq.to(gl.int64)[:, None] * stride_qnh
    b_q = gl.load(p_q + o_lq[None, :] * stride_qnd, mask=m_hq[:, None], other=0.0)
    q_s = gl.allocate_shared_memory(gl.float16, [BLOCK_H, L], MMA_SMEM, b_q.to(gl.float16))
    if R > 0:
        o_rq = gl.arange(0, R, layout=gl.SliceLayout(0, Q_LAYOUT))
        p_qr = Q_rope + i_t * stride_qrt + o_hq.to(gl.int64)[:, None] * stride_qrh
        b_qr = gl.load(p_qr + o_rq[None, :] * stride_qrd, mask=m_hq[:, None], other=0.0)
        qr_s = gl.allocate_shared_memory(gl.bfloat16, [BLOCK_H, R], MMA_SMEM, b_qr)

    # the ring (two slots) and the dequantized K tile
    nope_ring = gl.allocate_shared_memory(gl.uint8, [2, BLOCK_N, L], RAW_SMEM)
    scale_ring = gl.allocate_shared_memory(gl.float32, [2, BLOCK_N, NUM_CHUNKS], SCALE_SMEM)
    rope_ring = gl.allocate_shared_memory(gl.bfloat16, [2, BLOCK_N, 64], MMA_SMEM)
    k_s = gl.allocate_shared_memory(gl.float16, [BLOCK_N, L], MMA_SMEM)
    # P in fp16: each warpgroup writes its half of the key columns, both read all of them for
    # PV (one barrier; convert_layout's scratch took P across in two rounds, four barriers)
    p_s = gl.allocate_shared_memory(gl.float16, [BLOCK_H, BLOCK_N], MMA_SMEM)

    w_lo, w_hi, n_steps = _split_range(
        Counts, i_t, i_s, W, split_len, stride_ct, BLOCK_N, HAS_COUNTS
    )
    qk_scale = sm_scale * LOG2E

    b_m = gl.full([BLOCK_H], float("-inf"), gl.float32, layout=gl.SliceLayout(1, S_LAYOUT))
    b_l2 = _row_sums_init(BLOCK_H, BLOCK_N, S_LAYOUT)
    b_o = gl.zeros([BLOCK_H, L], gl.float32, layout=O_LAYOUT)
    b_ref = 1.0

    _gather(
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
        nope_ring.index(0),
        scale_ring.index(0),
        rope_ring.index(0),
        BLOCK_N,
        L,
        R,
        PAGE_SHIFT,
        NOPE_LAYOUT,
        SCALE_LAYOUT,
        ROPE_LAYOUT,
    )
    async_copy.commit_group()
    for i_step in range(n_steps):
        slot = i_step % 2
        w0 = w_lo + i_step * BLOCK_N
        # the validity of the step's rows, for the softmax: its index loads issued here, ahead
        # of the MMAs, rather than waited for behind them
        _, m_s = _rows(
            Idx,
            i_t,
            w0,
            w_hi,
            stride_it,
            stride_iw,
            num_rows,
            page_size,
            stride_kb,
            ROW_BYTES,
            BLOCK_N,
            PAGE_SHIFT,
            gl.SliceLayout(0, S_LAYOUT),
        )
        async_copy.wait_group(0)  # this step's rows are in
        _BARRIER()

        b_rel, b_ref_new, _ = _step_scales(scale_ring.index(slot), SC_DQ_LAYOUT, SC_MAX_LAYOUT)
        _dequant_chunks(nope_ring.index(slot), b_rel, k_s, DQ_LAYOUT, SC_DQ_LAYOUT)
        fence_async_shared()
        _BARRIER()

        # QK^T: the NoPE chain in fp16 (units of the reference), the rope in bf16, one wait
        b_sn = gl.zeros([BLOCK_H, BLOCK_N], gl.float32, layout=S_LAYOUT)
        b_sn = warpgroup_mma(q_s, k_s.permute((1, 0)), b_sn, use_acc=False, is_async=True)
        if R > 0:
            b_sr = gl.zeros([BLOCK_H, BLOCK_N], gl.float32, layout=S_LAYOUT)
            b_sr = warpgroup_mma(
                qr_s, rope_ring.index(slot).permute((1, 0)), b_sr, use_acc=False, is_async=True
            )
        # the next step's rows into the other slot while QK^T runs, so that the gather's index
        # loads and address arithmetic wait behind the MMAs instead of ahead of the
        # dequantization. The slot's last readers were step i - 1's dequantization and rope
        # MMAs, which every thread finished before the barrier above.
        _gather(
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
            nope_ring.index(1 - slot),
            scale_ring.index(1 - slot),
            rope_ring.index(1 - slot),
            BLOCK_N,
            L,
            R,
            PAGE_SHIFT,
            NOPE_LAYOUT,
            SCALE_LAYOUT,
            ROPE_LAYOUT,
        )
        async_copy.commit_group()
        if R > 0:
            b_sn, b_sr = warpgroup_mma_wait(num_outstanding=0, deps=(b_sn, b_sr))
            b_s = b_sn * b_ref_new + b_sr
        else:
            b_sn = warpgroup_mma_wait(num_outstanding=0, deps=(b_sn,))
            b_s = b_sn * b_ref_new

        # the online softmax step over the valid rows
        b_s = gl.where(m_s[None, :], b_s * qk_scale, float("-inf"))
        b_m_new = gl.maximum(b_m, gl.max(b_s, 1))
        b_m_use = gl.where(b_m_new == float("-inf"), 0.0, b_m_new)
        b_alpha = gl.exp2(b_m - b_m_use)
        b_p = gl.exp2(b_s - b_m_use[:, None])
        b_l2 = _row_sums_step(b_l2, b_alpha, b_p)
        b_m = b_m_new
        # the accumulator stays in units of the reference scale
        b_alpha = b_alpha * (b_ref / b_ref_new)
        b_ref = b_ref_new

        # PV: one chain into O, one wait (K is rewritten only after it). P crosses to the other
        # warpgroup through p_s; its next write comes after the next step's first barrier.
        b_alpha_o = gl.convert_layout(b_alpha, gl.SliceLayout(1, O_LAYOUT))
        b_o = b_o * b_alpha_o[:, None]
        p_s.store(b_p.to(gl.float16))
        _BARRIER()
        b_o = warpgroup_mma(p_s.load(P_LAYOUT), k_s, b_o, is_async=True)
        b_o = warpgroup_mma_wait(num_outstanding=0, deps=(b_o,))
    async_copy.wait_group(0)
    b_l = _row_sums_total(b_l2, S_LAYOUT)

    _store_result(
        b_o,
        b_m,
        b_l,
        b_ref,
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


# --- warp-specialized form: dequantizing warps feed a ring of fp16 K tiles to the MMA warps ---

# one warpgroup dequantizes; its register budget (setmaxnreg) leaves the MMA warps 192 each.
# Compiled for sm90 under Triton 3.8: 96 / 112 registers spill 112 / 84 bytes (the MMA warps'
# loop 2 / 4 local-memory operations per step, the dequantizing one's 31 / 12); untimed.
DEQUANT_WARPS = gl.constexpr(4)
DEQUANT_REGS = gl.constexpr(112)


@gluon.jit
def _ws_dequant(
    KV,
    Idx,
    i_t,
    w_lo,
    w_hi,
    n_steps,
    stride_it,
    stride_iw,
    num_rows,
    page_size,
    stride_kb,
    k_ring,
    kr_ring,
    ref_ring,
    ready,
    empty,
    BLOCK_N: gl.constexpr,
    L: gl.constexpr,
    R: gl.constexpr,
    PAGE_SHIFT: gl.constexpr,
):
    # the producer: per step, gather the rows (plain loads, all chunks first so their latencies
    # overlap), dequantize against the step's largest scale into the free ring slot, publish
    DQ: gl.constexpr = gl.BlockedLayout([1, 16], [4, 8], [DEQUANT_WARPS, 1], [1, 0])
    SC: gl.constexpr = gl.BlockedLayout([1, 1], [8, 4], [DEQUANT_WARPS, 1], [1, 0])
    RP: gl.constexpr = gl.BlockedLayout([1, 8], [4, 8], [DEQUANT_WARPS, 1], [1, 0])
    REF: gl.constexpr = gl.BlockedLayout([1], [32], [DEQUANT_WARPS], [0])
    for i_step in range(n_steps):
        slot = i_step % 2
        mbarrier.wait(empty.index(slot), ((i_step // 2) & 1) ^ 1)
        w0 = w_lo + i_step * BLOCK_N
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
            ROW_BYTES,
            BLOCK_N,
            PAGE_SHIFT,
            gl.SliceLayout(1, DQ),
        )
        o_c = gl.arange(0, 128, layout=gl.SliceLayout(0, DQ))
        p_k = KV + o_row[:, None] + o_c[None, :]
        m_k = m_n[:, None] & (o_c < 128)[None, :]
        b_k0 = gl.load(p_k, mask=m_k, other=0)
        b_k1 = gl.load(p_k + 128, mask=m_k, other=0)
        b_k2 = gl.load(p_k + 256, mask=m_k, other=0)
        b_k3 = gl.load(p_k + 384, mask=m_k, other=0)
        o_row_s, m_n_s = _rows(
            Idx,
            i_t,
            w0,
            w_hi,
            stride_it,
            stride_iw,
            num_rows,
            page_size,
            stride_kb,
            ROW_BYTES,
            BLOCK_N,
            PAGE_SHIFT,
            gl.SliceLayout(1, SC),
        )
        o_g = gl.arange(0, NUM_CHUNKS, layout=gl.SliceLayout(0, SC))
        p_sc = (KV + o_row_s[:, None] + SCALE_OFFSET).to(gl.pointer_type(gl.float32))
        b_sc = gl.load(p_sc + o_g[None, :], mask=m_n_s[:, None] & (o_g < 4)[None, :], other=0.0)
        if R > 0:
            o_row_r, m_n_r = _rows(
                Idx,
                i_t,
                w0,
                w_hi,
                stride_it,
                stride_iw,
                num_rows,
                page_size,
                stride_kb,
                ROW_BYTES,
                BLOCK_N,
                PAGE_SHIFT,
                gl.SliceLayout(1, RP),
            )
            o_r = gl.arange(0, R, layout=gl.SliceLayout(0, RP))
            p_r = (KV + o_row_r[:, None] + ROPE_OFFSET).to(gl.pointer_type(gl.bfloat16))
            b_kr = gl.load(p_r + o_r[None, :], mask=m_n_r[:, None] & (o_r < R)[None, :], other=0.0)
        b_ref = _pow2_ref(gl.max(gl.max(b_sc, 1), 0))
        if R > 0:
            # the rope keys in the NoPE tile's units (exact: a power of two), so that the rope
            # part of QK^T joins the NoPE chain's accumulator
            kr_ring.index(slot).store((b_kr.to(gl.float32) * (1.0 / b_ref)).to(gl.bfloat16))
        b_rel = b_sc / b_ref
        k_slot = k_ring.index(slot)
        for c in gl.static_range(NUM_CHUNKS):
            if c == 0:
                b_k8 = b_k0
            elif c == 1:
                b_k8 = b_k1
            elif c == 2:
                b_k8 = b_k2
            else:
                b_k8 = b_k3
            b_rel_c = gl.sum(gl.where((o_g == c)[None, :], b_rel, 0.0), 1)
            b_rel_c = gl.convert_layout(b_rel_c, gl.SliceLayout(1, DQ))
            b_h = b_k8.to(gl.float8e4nv, bitcast=True).to(gl.float16)
            k_slot.slice(c * 128, 128, dim=1).store(b_h * b_rel_c.to(gl.float16)[:, None])
        ref_ring.index(slot).store(gl.full([BLOCK_N], 0.0, gl.float32, layout=REF) + b_ref)
        fence_async_shared()
        _BARRIER()  # every dequantizing thread's stores are in before one of them publishes
        mbarrier.arrive(ready.index(slot))


@gluon.jit
def _ws_mma(
    Idx,
    Sink,
    Out,
    Lse,
    OPart,
    LsePart,
    q_s,
    qr_s,
    p_s,
    k_ring,
    kr_ring,
    ref_ring,
    ready,
    empty,
    i_t,
    i_ts,
    i_hb,
    w_lo,
    w_hi,
    n_steps,
    stride_it,
    stride_iw,
    num_rows,
    H,
    qk_scale,
    stride_ot,
    stride_oh,
    stride_od,
    stride_sink,
    BLOCK_H: gl.constexpr,
    BLOCK_N: gl.constexpr,
    L: gl.constexpr,
    R: gl.constexpr,
    SPLIT: gl.constexpr,
    STORE_LSE: gl.constexpr,
    HAS_SINK: gl.constexpr,
):
    # the consumer (the CTA's own warps): QK^T, the online softmax and PV per published slot
    # S and O split by columns between the two warpgroups (no QK^T twice)
    S_LAYOUT: gl.constexpr = gl.NVMMADistributedLayout(
        version=[3, 0], warps_per_cta=[4, 2], instr_shape=[16, 32, 16]
    )
    O_LAYOUT: gl.constexpr = gl.NVMMADistributedLayout(
        version=[3, 0], warps_per_cta=[4, 2], instr_shape=[16, 256, 16]
    )
    P_LAYOUT: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=O_LAYOUT, k_width=2)
    # every warp reads the whole reference vector (all its values are the step's reference),
    # so its maximum needs no exchange between warps
    REF: gl.constexpr = gl.BlockedLayout([BLOCK_N // 32], [32], [8], [0])
    b_m = gl.full([BLOCK_H], float("-inf"), gl.float32, layout=gl.SliceLayout(1, S_LAYOUT))
    b_l2 = _row_sums_init(BLOCK_H, BLOCK_N, S_LAYOUT)
    b_o = gl.zeros([BLOCK_H, L], gl.float32, layout=O_LAYOUT)
    b_ref = 1.0
    for i_step in range(n_steps):
        slot = i_step % 2
        w0 = w_lo + i_step * BLOCK_N
        o_w = w0 + gl.arange(0, BLOCK_N, layout=gl.SliceLayout(0, S_LAYOUT))
        b_idx = gl.load(Idx + i_t * stride_it + o_w * stride_iw, mask=o_w < w_hi, other=-1)
        m_n = (b_idx >= 0) & (b_idx < num_rows)
        mbarrier.wait(ready.index(slot), (i_step // 2) & 1)
        k_slot = k_ring.index(slot)
        b_ref_new = gl.max(ref_ring.index(slot).load(REF), 0)
        b_s = gl.zeros([BLOCK_H, BLOCK_N], gl.float32, layout=S_LAYOUT)
        b_s = warpgroup_mma(q_s, k_slot.permute((1, 0)), b_s, use_acc=False, is_async=True)
        if R > 0:  # the rope keys come in the NoPE tile's units: one chain, one accumulator
            b_s = warpgroup_mma(qr_s, kr_ring.index(slot).permute((1, 0)), b_s, is_async=True)
        b_s = warpgroup_mma_wait(num_outstanding=0, deps=(b_s,))
        b_s = b_s * b_ref_new
        b_s = gl.where(m_n[None, :], b_s * qk_scale, float("-inf"))
        b_m_new = gl.maximum(b_m, gl.max(b_s, 1))
        b_m_use = gl.where(b_m_new == float("-inf"), 0.0, b_m_new)
        b_alpha = gl.exp2(b_m - b_m_use)
        b_p = gl.exp2(b_s - b_m_use[:, None])
        b_l2 = _row_sums_step(b_l2, b_alpha, b_p)
        b_m = b_m_new
        b_alpha = b_alpha * (b_ref / b_ref_new)
        b_ref = b_ref_new
        b_alpha_o = gl.convert_layout(b_alpha, gl.SliceLayout(1, O_LAYOUT))
        b_o = b_o * b_alpha_o[:, None]
        # P crosses to the other warpgroup through p_s (one barrier; convert_layout's scratch
        # took it across in two rounds, four barriers); its next write comes after this step's
        # last barrier
        p_s.store(b_p.to(gl.float16))
        _BARRIER()
        b_o = warpgroup_mma(p_s.load(P_LAYOUT), k_slot, b_o, is_async=True)
        b_o = warpgroup_mma_wait(num_outstanding=0, deps=(b_o,))
        _BARRIER()  # both warpgroups are done with the slot (and P) before it is handed back
        mbarrier.arrive(empty.index(slot))
    b_l = _row_sums_total(b_l2, S_LAYOUT)

    _store_result(
        b_o,
        b_m,
        b_l,
        b_ref,
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
def sparse_mla_ds_mla_sm90_gluon_ws_kernel(
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
    gl.static_assert(BLOCK_H == 64 and BLOCK_N == 64 and L == 512, "the 64 x 64 tile only")
    gl.static_assert(FOLD_FP16 and FP8_NATIVE, "fp16 MMAs with folded scales, native e4m3")
    gl.static_assert(not HAS_BT and not HAS_EXTRA, "no block table, no extra set")
    Q_LAYOUT: gl.constexpr = gl.BlockedLayout([1, 8], [2, 16], [8, 1], [1, 0])
    MMA_SMEM: gl.constexpr = gl.NVMMASharedLayout(
        swizzle_byte_width=128, element_bitwidth=16, rank=2
    )
    REF_SMEM: gl.constexpr = gl.SwizzledSharedLayout(vec=1, per_phase=1, max_phase=1, order=[0])

    i_hb, i_ts, i_s, i_t = _program_coords(num_hb, num_splits)

    o_hq = i_hb * BLOCK_H + gl.arange(0, BLOCK_H, layout=gl.SliceLayout(1, Q_LAYOUT))
    m_hq = o_hq < H
    o_lq = gl.arange(0, L, layout=gl.SliceLayout(0, Q_LAYOUT))
    p_q = Q_nope + i_t * stride_qnt + o_hq.to(gl.int64)[:, None] * stride_qnh
    b_q = gl.load(p_q + o_lq[None, :] * stride_qnd, mask=m_hq[:, None], other=0.0)
    q_s = gl.allocate_shared_memory(gl.float16, [BLOCK_H, L], MMA_SMEM, b_q.to(gl.float16))
    o_rq = gl.arange(0, 64, layout=gl.SliceLayout(0, Q_LAYOUT))
    p_qr = Q_rope + i_t * stride_qrt + o_hq.to(gl.int64)[:, None] * stride_qrh
    b_qr = gl.load(
        p_qr + o_rq[None, :] * stride_qrd, mask=m_hq[:, None] & (o_rq < R)[None, :], other=0.0
    )
    qr_s = gl.allocate_shared_memory(gl.bfloat16, [BLOCK_H, 64], MMA_SMEM, b_qr)

    k_ring = gl.allocate_shared_memory(gl.float16, [2, BLOCK_N, L], MMA_SMEM)
    kr_ring = gl.allocate_shared_memory(gl.bfloat16, [2, BLOCK_N, 64], MMA_SMEM)
    ref_ring = gl.allocate_shared_memory(gl.float32, [2, BLOCK_N], REF_SMEM)
    # P in fp16 on its way from S's layout (each warpgroup half of the key columns) to PV's
    p_s = gl.allocate_shared_memory(gl.float16, [BLOCK_H, BLOCK_N], MMA_SMEM)
    ready = gl.allocate_shared_memory(gl.int64, [2, 1], mbarrier.MBarrierLayout())
    empty = gl.allocate_shared_memory(gl.int64, [2, 1], mbarrier.MBarrierLayout())
    for i in gl.static_range(2):
        mbarrier.init(ready.index(i), count=1)
        mbarrier.init(empty.index(i), count=1)
    fence_async_shared()

    w_lo, w_hi, n_steps = _split_range(
        Counts, i_t, i_s, W, split_len, stride_ct, BLOCK_N, HAS_COUNTS
    )
    qk_scale = sm_scale * LOG2E
    # (the partition list is written out: Gluon does not take it as a value)
    gl.warp_specialize(
        [
            (
                _ws_mma,
                (
                    Idx,
                    Sink,
                    Out,
                    Lse,
                    OPart,
                    LsePart,
                    q_s,
                    qr_s,
                    p_s,
                    k_ring,
                    kr_ring,
                    ref_ring,
                    ready,
                    empty,
                    i_t,
                    i_ts,
                    i_hb,
                    w_lo,
                    w_hi,
                    n_steps,
                    stride_it,
                    stride_iw,
                    num_rows,
                    H,
                    qk_scale,
                    stride_ot,
                    stride_oh,
                    stride_od,
                    stride_sink,
                    BLOCK_H,
                    BLOCK_N,
                    L,
                    R,
                    SPLIT,
                    STORE_LSE,
                    HAS_SINK,
                ),
            ),
            (
                _ws_dequant,
                (
                    KV,
                    Idx,
                    i_t,
                    w_lo,
                    w_hi,
                    n_steps,
                    stride_it,
                    stride_iw,
                    num_rows,
                    page_size,
                    stride_kb,
                    k_ring,
                    kr_ring,
                    ref_ring,
                    ready,
                    empty,
                    BLOCK_N,
                    L,
                    R,
                    PAGE_SHIFT,
                ),
            ),
        ],
        [DEQUANT_WARPS],
        [DEQUANT_REGS],
    )
