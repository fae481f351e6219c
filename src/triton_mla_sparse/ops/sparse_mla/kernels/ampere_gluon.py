"""sparse_mla for sm80 / sm86 / sm89 in Gluon: the pipelined schedule with mma.sync.

The sm90 pipelined Gluon kernel's schedule (ds_mla_sm90_gluon.py), written with the operations
every NVIDIA GPU from sm80 has (Gluon's ``nvidia.ampere``: cp.async, ``mma.sync``), so that it is
the code path of A100, A10, L40S and RTX 4090 and runs, as it is, on newer GPUs too. The rows of
step i + 1 are gathered with cp.async into the other half of a two-slot ring while step i is
multiplied; QK^T and PV are mma.sync products from shared memory (ldmatrix), P from registers.
Any BLOCK_H and BLOCK_N multiple of 16 and any warp count: warps take 16 head rows each, the
rest split the columns; 16 heads in four warps may split the latent instead (warp c
multiplies its chunk of q, held in registers, with the K tile's chunk c; the partial S tiles
are summed through shared memory).

- fp8_ds_mla (sparse_mla_ds_mla_ampere_gluon_kernel): step i's bytes are dequantized once into
  an fp16 K tile in shared memory, relative to the step's largest scale (KernelConfig.fp16_fold's
  numerics), with the e4m3 conversion instruction on sm89 and later and ops/e4m3.py's packed
  decode on sm80 / sm86. RING (KernelConfig.num_stages) raw-row slots: two, the gather of step
  i + 1 in flight while step i is dequantized and multiplied; or one, the gather issued as soon
  as step i's bytes are dequantized (in flight while step i is multiplied), which saves a slot's
  shared memory (16.5 KB at 32 rows): a 32-head tile then fits the 99 KB parts, and two 16-head
  programs fit an sm80 multiprocessor. The RoPE values, which the MMAs read from the ring, keep
  two slots either way. With QK^T split over the latent (16 heads in four warps) there is no
  dequantization pass: each warp reads its 128-column chunk's e4m3 bytes straight into QK^T's
  operand, decodes them in registers, applies the rows' chunk scales to its partial S tile in
  fp32, and writes the decoded chunk times scale / reference into PV's fp16 tile, of which it
  reads only its own chunk.
- rows in q's dtype, kv_format "auto" (sparse_mla_latent_ampere_gluon_kernel): the MMAs read
  the ring's slot where the rows landed; with QK^T split over the latent (16 heads in four
  warps) the ring keeps each slot's rows chunk-major, one 128-column chunk per warp.

The runtime argument lists are the Triton kernels' (ds_mla.py, latent.py); what they do not
implement (block tables, an extra index set, e4m3 latent rows) is refused by the plan before any
launch.
"""

from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.ampere import async_copy, mma_v2

from ...e4m3 import E4M3_PACK, E4M3X4_TO_F16X4_PTX
from .ds_mla_sm90_gluon import (
    _ASYNC_LOAD,
    _BARRIER,
    LOG2E,
    NUM_CHUNKS,
    ROPE_OFFSET,
    ROW_BYTES,
    _gather,
    _gather_scales,
    _pow2_ref,
    _program_coords,
    _rows,
    _split_range,
    _store_result,
)

K_SLICE = gl.constexpr(64)  # latent columns per QK^T product
# mma.sync products into one accumulator form one dependent chain, each waiting for the last:
# the fp8_ds_mla kernel's QK^T keeps at least this many independent accumulators per warp (its
# 8-column tiles times the interleaved latent slices), so that a 16-head tile's warp, one
# 8-column tile wide, does not walk the 512-wide latent as a single chain of 32 products. The
# rows kernel keeps one chain: there the chains and the S exchange below timed no faster
# (docs/PERFORMANCE.md, log entry 46)
QK_MIN_CHAINS = gl.constexpr(4)
# the packed decode's fp16 values are e4m3's times 2^-8 (bias 7 against fp16's 15)
E4M3_BIAS_FIX = gl.constexpr(256.0)
# rows tiles whose warps split S's rows and columns run PV with the warps over O's columns
# from this many warps (the sm80 path's 64-head tile; heuristics.AMPERE_PV_COLS_WARPS, whose
# shared-memory figure the compile test checks against the compiler's)
PV_COLS_MIN_WARPS = gl.constexpr(8)


@gluon.jit
def _e4m3_to_f16(b_u8, NATIVE: gl.constexpr):
    # e4m3 bytes -> fp16 values, exactly: the hardware conversion where there is one (sm89+),
    # else ops/e4m3.py's packed inline-PTX decode (four bytes into two fp16 pairs, two
    # instructions a value; subnormals included, 0x7F / 0xFF read as +-480, not NaN), whose
    # values are e4m3's times 2^-8: the caller puts E4M3_BIAS_FIX back through its ratio
    if NATIVE:
        b_h = b_u8.to(gl.float8e4nv, bitcast=True).to(gl.float16)
    else:
        b_h = gl.inline_asm_elementwise(
            E4M3X4_TO_F16X4_PTX,
            "=r,=r,r",
            [b_u8],
            dtype=gl.float16,
            is_pure=True,
            pack=E4M3_PACK,
        )
    return b_h


@gluon.jit
def _sum_partial_s(s_parts, b_sp, MMA3: gl.constexpr):
    # the split tiles' QK^T: warp c's partial S tile (chunk c of the latent) through shared
    # memory, and their sum [BLOCK_H, BLOCK_N] in every warp (layout SliceLayout(0, MMA3))
    s_parts.store(b_sp)
    _BARRIER()
    b_s = gl.sum(s_parts.slice(0, 1, dim=0).load(MMA3), 0)
    for c in gl.static_range(1, NUM_CHUNKS):
        b_s = b_s + gl.sum(s_parts.slice(c, 1, dim=0).load(MMA3), 0)
    return b_s


@gluon.jit
def _pv_chunks(b_o3, b_p, v_s, A3_OP: gl.constexpr, B3_OP: gl.constexpr):
    # the split tiles' PV: warp c accumulates O's chunk c, P (which every warp holds whole, in
    # the MMA's 16-bit type) times chunk c of the rows, v_s [NUM_CHUNKS, BLOCK_N, width]
    b_p3 = gl.expand_dims(b_p, 0).broadcast_to([NUM_CHUNKS, b_p.shape[0], b_p.shape[1]])
    return mma_v2(gl.convert_layout(b_p3, A3_OP), v_s.load(B3_OP), b_o3)


@gluon.jit
def _q_chunks(
    Q,
    i_t,
    i_hb,
    H,
    stride_t,
    stride_h,
    stride_d,
    BLOCK_H: gl.constexpr,
    W: gl.constexpr,
    OP: gl.constexpr,
):
    # token i_t's heads [i_hb * BLOCK_H, + BLOCK_H) of q as [NUM_CHUNKS, BLOCK_H, W] (chunk c:
    # columns [c * W, (c + 1) * W)), loaded straight into the MMA operand layout OP: each thread
    # reads the values it multiplies, with no pass through shared memory before the walk
    o_c = gl.arange(0, NUM_CHUNKS, layout=gl.SliceLayout(1, gl.SliceLayout(2, OP)))
    o_h = i_hb * BLOCK_H + gl.arange(0, BLOCK_H, layout=gl.SliceLayout(0, gl.SliceLayout(2, OP)))
    o_j = gl.arange(0, W, layout=gl.SliceLayout(0, gl.SliceLayout(1, OP)))
    p_q = Q + i_t * stride_t + o_h.to(gl.int64)[None, :, None] * stride_h
    p_q = p_q + (o_c[:, None, None] * W + o_j[None, None, :]) * stride_d
    m_q = (o_c < NUM_CHUNKS)[:, None, None] & (o_h < H)[None, :, None] & (o_j < W)[None, None, :]
    return gl.load(p_q, mask=m_q, other=0.0)


@gluon.jit
def _qk_nope(
    q_s,
    k_s,
    BLOCK_H: gl.constexpr,
    BLOCK_N: gl.constexpr,
    L: gl.constexpr,
    CHAINS: gl.constexpr,
    MMA: gl.constexpr,
    A_OP: gl.constexpr,
    B_OP: gl.constexpr,
):
    # q [BLOCK_H, L] x k [BLOCK_N, L]^T from shared memory over K_SLICE-wide slices of the
    # latent, slice k into accumulator k % CHAINS, summed at the end
    gl.static_assert(CHAINS == 1 or CHAINS == 2 or CHAINS == 4, "1, 2 or 4 chains")
    gl.static_assert((L // K_SLICE) % CHAINS == 0, "whole slices per chain")
    b_s0 = gl.zeros([BLOCK_H, BLOCK_N], gl.float32, layout=MMA)
    b_s1 = gl.zeros([BLOCK_H, BLOCK_N], gl.float32, layout=MMA)
    b_s2 = gl.zeros([BLOCK_H, BLOCK_N], gl.float32, layout=MMA)
    b_s3 = gl.zeros([BLOCK_H, BLOCK_N], gl.float32, layout=MMA)
    for k in gl.static_range(L // K_SLICE):
        b_qa = q_s.slice(k * K_SLICE, K_SLICE, dim=1).load(A_OP)
        b_kb = k_s.slice(k * K_SLICE, K_SLICE, dim=1).permute((1, 0)).load(B_OP)
        if k % CHAINS == 0:
            b_s0 = mma_v2(b_qa, b_kb, b_s0)
        elif k % CHAINS == 1:
            b_s1 = mma_v2(b_qa, b_kb, b_s1)
        elif k % CHAINS == 2:
            b_s2 = mma_v2(b_qa, b_kb, b_s2)
        else:
            b_s3 = mma_v2(b_qa, b_kb, b_s3)
    b_s = b_s0
    if CHAINS > 1:
        b_s = b_s + b_s1
    if CHAINS > 2:
        b_s = b_s + (b_s2 + b_s3)
    return b_s


@gluon.jit
def _gather_chunks(
    slot, KV, o_row, m_n, COL0: gl.constexpr, CW: gl.constexpr, LAYOUT3: gl.constexpr
):
    # cp.async of columns [COL0, COL0 + NUM_CHUNKS * CW) of rows KV + o_row (in KV's elements;
    # m_n: the rows' validity, both in SliceLayout(0, SliceLayout(2, LAYOUT3))), read as the
    # slot's dtype, into the chunk-major slot [NUM_CHUNKS, BLOCK_N, CW] (LAYOUT3 of that rank):
    # chunk c holds columns [COL0 + c * CW, COL0 + (c + 1) * CW) of every row, the ones the split
    # QK^T's warp c multiplies
    o_c = gl.arange(0, NUM_CHUNKS, layout=gl.SliceLayout(1, gl.SliceLayout(2, LAYOUT3)))
    o_j = gl.arange(0, CW, layout=gl.SliceLayout(0, gl.SliceLayout(1, LAYOUT3)))
    p_row = (KV + o_row[None, :, None] + COL0).to(gl.pointer_type(slot.dtype))
    p_cols = p_row + (o_c[:, None, None] * CW + o_j[None, None, :])
    m_cols = (o_c < NUM_CHUNKS)[:, None, None] & m_n[None, :, None] & (o_j < CW)[None, None, :]
    _ASYNC_LOAD(slot, p_cols, mask=m_cols)


@gluon.jit
def _gather_ds(
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
    SPLIT_QK: gl.constexpr,
    OFFSET_32: gl.constexpr = False,
):
    # _gather's cp.async of one step's rows; with SPLIT_QK chunk-major: the NoPE bytes into
    # nope_slot [NUM_CHUNKS, BLOCK_N, L / NUM_CHUNKS] and the RoPE values into rope_slot
    # [NUM_CHUNKS, BLOCK_N, R / NUM_CHUNKS] (NOPE_LAYOUT / ROPE_LAYOUT of that rank), chunk c
    # holding columns [c * width, (c + 1) * width) of every row: QK^T's warp c multiplies them.
    # Returns the rows' validity.
    if SPLIT_QK:
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
            gl.SliceLayout(0, gl.SliceLayout(2, NOPE_LAYOUT)),
            OFFSET_32,
        )
        _gather_chunks(nope_slot, KV, o_row, m_n, 0, L // NUM_CHUNKS, NOPE_LAYOUT)
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
            o_row_r, m_r = _rows(
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
                gl.SliceLayout(0, gl.SliceLayout(2, ROPE_LAYOUT)),
                OFFSET_32,
            )
            _gather_chunks(rope_slot, KV, o_row_r, m_r, ROPE_OFFSET, R // NUM_CHUNKS, ROPE_LAYOUT)
    else:
        m_n = _gather(
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
            BLOCK_N,
            L,
            R,
            PAGE_SHIFT,
            NOPE_LAYOUT,
            SCALE_LAYOUT,
            ROPE_LAYOUT,
            OFFSET_32,
        )
    return m_n


@gluon.jit
def sparse_mla_ds_mla_ampere_gluon_kernel(
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
    ROW_OFFSETS_32: gl.constexpr,
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
    RING: gl.constexpr,
    QR_REGS: gl.constexpr,
    SPLIT_QK: gl.constexpr,
):

    gl.static_assert(L == 512, "fp8_ds_mla's 512 NoPE values")
    gl.static_assert(RING == 1 or RING == 2, "one or two raw-row slots")
    gl.static_assert(BLOCK_H % 16 == 0 and BLOCK_N % 16 == 0, "16-row MMA tiles")
    gl.static_assert(FOLD_FP16 and not E4M3_DECODE, "fp16 MMAs with folded scales")
    gl.static_assert(not HAS_BT and not HAS_EXTRA, "no block table, no extra set")
    gl.static_assert(R == 0 or R == 64, "DeepSeek-V3.2's 64 RoPE values, or none")

    # register layouts: mma.sync tiles, warps over the head rows first (16 each), the rest over
    # the columns; S [BLOCK_H, BLOCK_N] and O [BLOCK_H, L] in the same arrangement
    WARPS_M: gl.constexpr = gl.num_warps() if gl.num_warps() < BLOCK_H // 16 else BLOCK_H // 16
    WARPS_N: gl.constexpr = gl.num_warps() // WARPS_M
    # SPLIT_QK (KernelConfig.split_qk), 16 heads in four warps: QK^T split over the latent
    # instead of over S's columns: warp c multiplies latent chunk c (128 NoPE columns, 16 RoPE
    # ones) for all BLOCK_N rows, with its slice of q held in registers for the whole walk (the
    # other form re-reads all of q from shared memory each step: 64 of a 16-head step's ~200 KB
    # of shared-memory traffic); the four partial S tiles are summed through shared memory,
    # which leaves every warp the whole tile for the online softmax, and PV keeps the same
    # split: warp c accumulates O's chunk c. The raw bytes are QK^T's operand (shared traffic
    # a value: 1 B read for QK^T, 2 B written and 2 B read for PV, where a dequantization
    # pass reads 1 B, writes 2 B and QK^T and PV read 2 B each), and the K tile's writes move
    # ahead of the partial tiles' barrier: a CTA barrier a step fewer. It pays back its setup
    # over a walk of several steps only (heuristics.AMPERE_GLUON_SPLIT_QK_STEPS).
    gl.static_assert(
        not SPLIT_QK or (BLOCK_H == 16 and gl.num_warps() == NUM_CHUNKS and not QR_REGS),
        "QK^T split over the latent: 16 heads in one warp per latent chunk, all of q in registers",
    )
    KW: gl.constexpr = L // NUM_CHUNKS  # a chunk's NoPE columns
    RW: gl.constexpr = 64 // NUM_CHUNKS  # its RoPE columns (the ring holds 64 a row)
    # the latent slices' accumulators QK^T interleaves (1, 2 or 4): with the warp's 8-column
    # tiles of S, QK_MIN_CHAINS independent chains (written out here: Triton 3.6 does not take
    # a constexpr returned by a helper)
    N_TILES: gl.constexpr = BLOCK_N // (8 * WARPS_N) if BLOCK_N >= 8 * WARPS_N else 1
    QK_CHAINS: gl.constexpr = QK_MIN_CHAINS // N_TILES if N_TILES < QK_MIN_CHAINS else 1
    MMA: gl.constexpr = gl.NVMMADistributedLayout(
        version=[2, 0], warps_per_cta=[WARPS_M, WARPS_N], instr_shape=[16, 8]
    )
    A_OP: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=MMA, k_width=2)
    B_OP: gl.constexpr = gl.DotOperandLayout(operand_index=1, parent=MMA, k_width=2)
    # SPLIT_QK: [chunk, ...] tiles, one chunk a warp
    MMA3: gl.constexpr = gl.NVMMADistributedLayout(
        version=[2, 0], warps_per_cta=[gl.num_warps(), 1, 1], instr_shape=[1, 16, 8]
    )
    A3_OP: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=MMA3, k_width=2)
    B3_OP: gl.constexpr = gl.DotOperandLayout(operand_index=1, parent=MMA3, k_width=2)
    # SPLIT_QK's NoPE product straight from the raw bytes: each thread holds 16 consecutive
    # latent columns of a row (one 16-byte shared load, four packed decodes), q's operand
    # permuted alike (the k order within a product is the same on both sides)
    A3_RAW: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=MMA3, k_width=16)
    B3_RAW: gl.constexpr = gl.DotOperandLayout(operand_index=1, parent=MMA3, k_width=16)
    # the packed decode's values are e4m3's times 2^-8: the scales put the factor back
    DECODE_FIX: gl.constexpr = 1.0 if FP8_NATIVE else E4M3_BIAS_FIX
    # S after QK^T where all warps share 16 head rows (WARPS_M 1): exchanged once between the
    # warps that computed its columns, so that every warp holds whole rows (the layout repeats
    # over the head rows), runs the online softmax without cross-warp reductions and gives P to
    # PV from registers (4 of the step's 12 barriers fewer, docs/perf-log/44-s-rows-sass.txt).
    # Where warps also split the head rows the MMA layout stays (the exchange compiled to more
    # barriers there). SPLIT_QK: the sum of the partial tiles, in every warp.
    S_ROWS: gl.constexpr = (
        gl.SliceLayout(0, MMA3)
        if SPLIT_QK
        else (
            gl.NVMMADistributedLayout(
                version=[2, 0], warps_per_cta=[gl.num_warps(), 1], instr_shape=[16, 8]
            )
            if WARPS_M == 1
            else MMA
        )
    )
    # (SPLIT_QK: the warps over the rows, so that a thread addresses two rows for all four
    # chunks: a row's index load and offset once, not once per chunk)
    NOPE_LAYOUT: gl.constexpr = (
        gl.BlockedLayout([1, 1, 16], [1, 4, 8], [1, gl.num_warps(), 1], [2, 1, 0])
        if SPLIT_QK
        else gl.BlockedLayout([1, 16], [2, 16], [gl.num_warps(), 1], [1, 0])
    )
    SCALE_LAYOUT: gl.constexpr = gl.BlockedLayout([1, 1], [8, 4], [gl.num_warps(), 1], [1, 0])
    ROPE_LAYOUT: gl.constexpr = (
        gl.BlockedLayout([1, 1, 8], [1, 16, 2], [gl.num_warps(), 1, 1], [2, 1, 0])
        if SPLIT_QK
        else gl.BlockedLayout([1, 8], [4, 8], [gl.num_warps(), 1], [1, 0])
    )
    # the dequantized chunk [BLOCK_N, 128] (the unsplit tiles)
    DQ_LAYOUT: gl.constexpr = gl.BlockedLayout([1, 16], [4, 8], [gl.num_warps(), 1], [1, 0])
    SC_DQ_LAYOUT: gl.constexpr = gl.BlockedLayout([1, 4], [4, 8], [gl.num_warps(), 1], [1, 0])
    Q_LAYOUT: gl.constexpr = gl.BlockedLayout([1, 8], [2, 16], [gl.num_warps(), 1], [1, 0])
    # shared layouts: 16-bit MMA operands swizzled for ldmatrix, the raw bytes plain
    OP_SMEM: gl.constexpr = gl.SwizzledSharedLayout(vec=8, per_phase=1, max_phase=8, order=[1, 0])
    OP3_SMEM: gl.constexpr = gl.SwizzledSharedLayout(
        vec=8, per_phase=1, max_phase=8, order=[2, 1, 0]
    )
    # the partial S tiles in the MMA's fragments (a thread's two adjacent fp32 values, eight
    # rows a store): 8-column groups swizzled over four rows, so that a fragment store or load
    # spans all 32 banks (two wavefronts, not eight)
    SUM3_SMEM: gl.constexpr = gl.SwizzledSharedLayout(
        vec=8, per_phase=1, max_phase=4, order=[2, 1, 0]
    )
    RAW_SMEM: gl.constexpr = gl.SwizzledSharedLayout(vec=16, per_phase=1, max_phase=1, order=[1, 0])
    # SPLIT_QK's chunk-major raw rows (128 bytes a row): a warp's 16-byte loads of QK^T's
    # operand take two rows per eight lanes, 64 bytes of each; odd rows swap their halves so
    # that the two rows fall on different banks
    RAW3_SMEM: gl.constexpr = gl.SwizzledSharedLayout(
        vec=64, per_phase=1, max_phase=2, order=[2, 1, 0]
    )
    # tiles whose warps split S's columns as well as its rows: a row's max and sum and P's move
    # into PV's operand layout cross warps there
    COLS_SPLIT: gl.constexpr = (not SPLIT_QK) and WARPS_M > 1 and WARPS_N > 1
    # the step's largest scale: every warp loads all BLOCK_N rows' four scales (a row a lane)
    # and reduces them itself, instead of a reduction across the warps through shared memory
    # (a barrier a step)
    SC_MAX_LAYOUT: gl.constexpr = gl.BlockedLayout([1, 4], [32, 1], [1, gl.num_warps()], [1, 0])
    VALID_SMEM: gl.constexpr = gl.SwizzledSharedLayout(vec=1, per_phase=1, max_phase=1, order=[0])
    SCALE_SMEM: gl.constexpr = gl.SwizzledSharedLayout(
        vec=4, per_phase=1, max_phase=1, order=[1, 0]
    )

    i_hb, i_ts, i_s, i_t = _program_coords(num_hb, num_splits)

    # q: NoPE part in fp16 (the folded tile's MMA type), rope part as it is
    if SPLIT_QK:
        # each warp's chunk of q as its MMA operand in registers, for the whole walk
        b_qa3 = _q_chunks(
            Q_nope, i_t, i_hb, H, stride_qnt, stride_qnh, stride_qnd, BLOCK_H, KW, A3_RAW
        ).to(gl.float16)
        if R > 0:
            b_qra3 = _q_chunks(
                Q_rope, i_t, i_hb, H, stride_qrt, stride_qrh, stride_qrd, BLOCK_H, RW, A3_OP
            )
    else:
        o_hq = i_hb * BLOCK_H + gl.arange(0, BLOCK_H, layout=gl.SliceLayout(1, Q_LAYOUT))
        m_hq = o_hq < H
        o_lq = gl.arange(0, L, layout=gl.SliceLayout(0, Q_LAYOUT))
        p_q = Q_nope + i_t * stride_qnt + o_hq.to(gl.int64)[:, None] * stride_qnh
        b_q = gl.load(p_q + o_lq[None, :] * stride_qnd, mask=m_hq[:, None], other=0.0)
        q_s = gl.allocate_shared_memory(gl.float16, [BLOCK_H, L], OP_SMEM, b_q.to(gl.float16))
        if R > 0:
            o_rq = gl.arange(0, R, layout=gl.SliceLayout(0, Q_LAYOUT))
            p_qr = Q_rope + i_t * stride_qrt + o_hq.to(gl.int64)[:, None] * stride_qrh
            b_qr = gl.load(p_qr + o_rq[None, :] * stride_qrd, mask=m_hq[:, None], other=0.0)
            if QR_REGS:
                # the rope product's A operand held in registers for the whole walk (its shared
                # memory freed: KernelConfig.q_rope_in_registers)
                b_qra = gl.convert_layout(b_qr, A_OP)
            else:
                qr_s = gl.allocate_shared_memory(
                    Q_rope.dtype.element_ty, [BLOCK_H, R], OP_SMEM, b_qr
                )

    # the ring (RING slots of raw rows and scales, two of RoPE values: QK^T reads those from
    # the ring after the next step's gather is issued) and the dequantized K tile; SPLIT_QK
    # keeps the RoPE slots and the K tile chunk-major, and the partial S tiles
    scale_ring = gl.allocate_shared_memory(gl.float32, [RING, BLOCK_N, NUM_CHUNKS], SCALE_SMEM)
    if SPLIT_QK:
        nope_ring = gl.allocate_shared_memory(gl.uint8, [RING, NUM_CHUNKS, BLOCK_N, KW], RAW3_SMEM)
        rope_ring = gl.allocate_shared_memory(gl.bfloat16, [2, NUM_CHUNKS, BLOCK_N, RW], OP3_SMEM)
        k_s = gl.allocate_shared_memory(gl.float16, [NUM_CHUNKS, BLOCK_N, KW], OP3_SMEM)
        s_parts = gl.allocate_shared_memory(gl.float32, [NUM_CHUNKS, BLOCK_H, BLOCK_N], SUM3_SMEM)
    else:
        nope_ring = gl.allocate_shared_memory(gl.uint8, [RING, BLOCK_N, L], RAW_SMEM)
        rope_ring = gl.allocate_shared_memory(gl.bfloat16, [2, BLOCK_N, 64], OP_SMEM)
        k_s = gl.allocate_shared_memory(gl.float16, [BLOCK_N, L], OP_SMEM)
    # the rows' validity, a slot per RoPE slot: stored as each gather is issued and read in
    # S's column layout after the step's first barrier (a convert_layout through the scratch
    # would take barriers of its own)
    v_s = gl.allocate_shared_memory(gl.int8, [2, BLOCK_N], VALID_SMEM)
    if COLS_SPLIT:
        # P on its way into PV's operand layout: one barrier between its store and the
        # ldmatrix, where convert_layout through the scratch takes two (its store waits
        # behind the row max's exchange)
        p_s = gl.allocate_shared_memory(gl.float16, [BLOCK_H, BLOCK_N], OP_SMEM)

    w_lo, w_hi, n_steps = _split_range(
        Counts, i_t, i_s, W, split_len, stride_ct, BLOCK_N, HAS_COUNTS
    )
    qk_scale = sm_scale * LOG2E

    b_m = gl.full([BLOCK_H], float("-inf"), gl.float32, layout=gl.SliceLayout(1, S_ROWS))
    b_l = gl.zeros([BLOCK_H], gl.float32, layout=gl.SliceLayout(1, S_ROWS))
    if SPLIT_QK:
        b_o3 = gl.zeros([NUM_CHUNKS, BLOCK_H, KW], gl.float32, layout=MMA3)
    else:
        b_o = gl.zeros([BLOCK_H, L], gl.float32, layout=MMA)
    if COLS_SPLIT:
        # the row sums kept per key column and reduced once after the loop (a row's sum across
        # the column warps would take two barriers a step)
        b_lacc = gl.zeros([BLOCK_H, BLOCK_N], gl.float32, layout=S_ROWS)
    b_ref = 1.0

    m_next = _gather_ds(
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
        SPLIT_QK,
        ROW_OFFSETS_32,
    )
    async_copy.commit_group()
    v_s.index(0).store(m_next.to(gl.int8))
    for i_step in range(n_steps):
        slot = i_step % RING  # the raw rows' and scales' slot
        r_slot = i_step % 2  # the RoPE values'
        w0 = w_lo + i_step * BLOCK_N
        if RING == 2:
            # every thread is past its reads of the other slot (the previous step) before it
            # refills
            _BARRIER()
            m_next = _gather_ds(
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
                rope_ring.index(1 - r_slot),
                BLOCK_N,
                L,
                R,
                PAGE_SHIFT,
                NOPE_LAYOUT,
                SCALE_LAYOUT,
                ROPE_LAYOUT,
                SPLIT_QK,
                ROW_OFFSETS_32,
            )
            async_copy.commit_group()
            v_s.index(1 - r_slot).store(m_next.to(gl.int8))
            async_copy.wait_group(1)  # this step's rows are in
        else:
            async_copy.wait_group(0)  # this step's rows are in (the only gather in flight)
        # every thread's rows are in, and every thread is past the previous step's reads of the
        # K tile and of the RoPE slot the next gather refills (and, SPLIT_QK, of the partial
        # S tiles)
        _BARRIER()
        if R > 0:
            # the RoPE product first: its read of the ring's RoPE slot then precedes the barrier
            # after the dequantization, behind which the next gather refills the other slot (read
            # after it, the membar pass sees one buffer and puts a barrier between them)
            if SPLIT_QK:
                b_srp = gl.zeros([NUM_CHUNKS, BLOCK_H, BLOCK_N], gl.float32, layout=MMA3)
                b_krb = rope_ring.index(r_slot).permute((0, 2, 1)).load(B3_OP)
                b_srp = mma_v2(b_qra3, b_krb.to(b_qra3.dtype), b_srp)
            else:
                b_sr = gl.zeros([BLOCK_H, BLOCK_N], gl.float32, layout=MMA)
                if not QR_REGS:
                    b_qra = qr_s.load(A_OP)
                b_krb = rope_ring.index(r_slot).permute((1, 0)).load(B_OP)
                b_sr = mma_v2(b_qra, b_krb.to(b_qra.dtype), b_sr)
        m_s = v_s.index(r_slot).load(gl.SliceLayout(0, S_ROWS)) != 0

        # the step's scales: its largest is the reference the tile is dequantized against
        if SPLIT_QK:
            b_scm = scale_ring.index(slot).load(SC_MAX_LAYOUT)
            b_ref_new = _pow2_ref(gl.max(gl.max(b_scm, 1), 0))
            # warp c: chunk c's e4m3 bytes of all BLOCK_N rows as QK^T's operand, decoded in
            # registers (exact in fp16), its product with q's chunk c in units of e4m3, then
            # each row's chunk scale applied to the partial S tile in fp32; the same decoded
            # values, times scale / reference in fp16 (the fold's rounding), are chunk c of
            # PV's K tile, which only warp c reads
            b_kh = _e4m3_to_f16(nope_ring.index(slot).permute((0, 2, 1)).load(B3_RAW), FP8_NATIVE)
            sc_t = scale_ring.index(slot).permute((1, 0))  # [NUM_CHUNKS, BLOCK_N]
            b_sp = gl.zeros([NUM_CHUNKS, BLOCK_H, BLOCK_N], gl.float32, layout=MMA3)
            b_sp = mma_v2(b_qa3, b_kh, b_sp)
            b_sp = b_sp * gl.expand_dims(sc_t.load(gl.SliceLayout(1, MMA3)) * DECODE_FIX, 1)
            if R > 0:
                b_sp = b_sp + b_srp
            b_rel3 = sc_t.load(gl.SliceLayout(1, B3_RAW)) * (DECODE_FIX / b_ref_new)
            b_v = b_kh * gl.expand_dims(b_rel3.to(gl.float16), 1)
            k_s.store(gl.permute(b_v, (0, 2, 1)))
            # (its barrier: every warp is past its reads of the raw slot, and chunk c of the K
            # tile is written, before the next gather and PV)
            b_s = _sum_partial_s(s_parts, b_sp, MMA3)
        else:
            # e4m3 x (scale / reference) formed in fp16, two values per packed multiply: the
            # e4m3 values are exact in fp16, so with the ratio exact there too (power-of-two
            # scales) the product is the fp32 one's rounding bit for bit
            b_sc = scale_ring.index(slot).load(SC_DQ_LAYOUT)
            b_scm = scale_ring.index(slot).load(SC_MAX_LAYOUT)
            b_ref_new = _pow2_ref(gl.max(gl.max(b_scm, 1), 0))
            b_rel = b_sc * (DECODE_FIX / b_ref_new)
            o_g = gl.arange(0, NUM_CHUNKS, layout=gl.SliceLayout(0, SC_DQ_LAYOUT))
            for c in gl.static_range(NUM_CHUNKS):
                b_rel_c = gl.sum(gl.where((o_g == c)[None, :], b_rel, 0.0), 1)
                b_rel_c = gl.convert_layout(b_rel_c, gl.SliceLayout(1, DQ_LAYOUT))  # same rows
                b_k8 = nope_ring.index(slot).slice(c * KW, KW, dim=1).load(DQ_LAYOUT)
                b_h = _e4m3_to_f16(b_k8, FP8_NATIVE) * b_rel_c.to(gl.float16)[:, None]
                k_s.slice(c * KW, KW, dim=1).store(b_h)
            _BARRIER()
        if RING == 1:
            # the raw slot is read: the next step's rows stream in while this one is multiplied
            m_next = _gather_ds(
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
                nope_ring.index(0),
                scale_ring.index(0),
                rope_ring.index(1 - r_slot),
                BLOCK_N,
                L,
                R,
                PAGE_SHIFT,
                NOPE_LAYOUT,
                SCALE_LAYOUT,
                ROPE_LAYOUT,
                SPLIT_QK,
                ROW_OFFSETS_32,
            )
            async_copy.commit_group()
            v_s.index(1 - r_slot).store(m_next.to(gl.int8))

        if not SPLIT_QK:
            # QK^T: the NoPE product in fp16 (units of the reference) over 64-wide slices of
            # the latent, the rope product in its own accumulator
            b_sn = _qk_nope(q_s, k_s, BLOCK_H, BLOCK_N, L, QK_CHAINS, MMA, A_OP, B_OP)
            b_s = b_sn * b_ref_new
            if R > 0:
                b_s = b_s + b_sr
            b_s = gl.convert_layout(b_s, S_ROWS)

        # the online softmax step over the valid rows (their validity kept from the gather)
        b_s = gl.where(m_s[None, :], b_s * qk_scale, float("-inf"))
        b_m_new = gl.maximum(b_m, gl.max(b_s, 1))
        b_m_use = gl.where(b_m_new == float("-inf"), 0.0, b_m_new)
        b_alpha = gl.exp2(b_m - b_m_use)
        b_p = gl.exp2(b_s - b_m_use[:, None])
        if COLS_SPLIT:
            b_lacc = b_lacc * b_alpha[:, None] + b_p
        else:
            b_l = b_l * b_alpha + gl.sum(b_p, 1)
        b_m = b_m_new
        # the accumulator stays in units of the reference scale
        b_alpha = b_alpha * (b_ref / b_ref_new)
        b_ref = b_ref_new

        # PV: P from registers, V (the same K tile) from shared memory
        if SPLIT_QK:
            # warp c: O's chunk c, P (which every warp holds whole) times the K tile's chunk c
            b_o3 = b_o3 * gl.expand_dims(gl.expand_dims(b_alpha, 1), 0)
            b_o3 = _pv_chunks(b_o3, b_p.to(gl.float16), k_s, A3_OP, B3_OP)
        else:
            b_o = b_o * gl.convert_layout(b_alpha, gl.SliceLayout(1, MMA))[:, None]
            if COLS_SPLIT:
                p_s.store(b_p.to(gl.float16))
                _BARRIER()
                b_pa = p_s.load(A_OP)
            else:
                b_pa = gl.convert_layout(b_p.to(gl.float16), A_OP)
            b_vb = k_s.load(B_OP)
            b_o = mma_v2(b_pa, b_vb, b_o)
    async_copy.wait_group(0)
    if COLS_SPLIT:
        b_l = gl.sum(b_lacc, 1)
    if SPLIT_QK:
        # the chunks side by side: [BLOCK_H, L] in the other tiles' layout
        b_o = gl.convert_layout(gl.reshape(gl.permute(b_o3, (1, 0, 2)), [BLOCK_H, L]), MMA)

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
        S_ROWS,
        MMA,
    )


@gluon.jit
def _gather_latent(
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
    BLOCK_N: gl.constexpr,
    L: gl.constexpr,
    R: gl.constexpr,
    PAGE_SHIFT: gl.constexpr,
    NOPE_LAYOUT: gl.constexpr,
    ROPE_LAYOUT: gl.constexpr,
    CHUNK_MAJOR: gl.constexpr,
    OFFSET_32: gl.constexpr = False,
):
    # cp.async of rows [w0, w0 + BLOCK_N) of token i_t's list (L latent values, then R rope
    # values, in q's dtype) into one ring slot; masked rows are zero-filled. The rows' validity.
    # CHUNK_MAJOR: into chunk-major slots, nope_slot [NUM_CHUNKS, BLOCK_N, L / NUM_CHUNKS] and
    # rope_slot [NUM_CHUNKS, BLOCK_N, R / NUM_CHUNKS] (the layouts of that rank), chunk c holding
    # every row's columns of latent chunk c (the split QK^T's warp c multiplies them).
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
        gl.SliceLayout(0, gl.SliceLayout(2, NOPE_LAYOUT))
        if CHUNK_MAJOR
        else gl.SliceLayout(1, NOPE_LAYOUT),
        OFFSET_32,
    )
    if CHUNK_MAJOR:
        _gather_chunks(nope_slot, KV, o_row, m_n, 0, L // NUM_CHUNKS, NOPE_LAYOUT)
    else:
        o_c = gl.arange(0, L, layout=gl.SliceLayout(0, NOPE_LAYOUT))
        _ASYNC_LOAD(
            nope_slot, KV + o_row[:, None] + o_c[None, :], mask=m_n[:, None] & (o_c < L)[None, :]
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
            stride_kr,
            BLOCK_N,
            PAGE_SHIFT,
            gl.SliceLayout(0, gl.SliceLayout(2, ROPE_LAYOUT))
            if CHUNK_MAJOR
            else gl.SliceLayout(1, ROPE_LAYOUT),
            OFFSET_32,
        )
        if CHUNK_MAJOR:
            _gather_chunks(rope_slot, KV, o_row_r, m_n_r, L, R // NUM_CHUNKS, ROPE_LAYOUT)
        else:
            o_r = gl.arange(0, R, layout=gl.SliceLayout(0, ROPE_LAYOUT))
            p_rope = KV + o_row_r[:, None] + L + o_r[None, :]
            _ASYNC_LOAD(rope_slot, p_rope, mask=m_n_r[:, None] & (o_r < R)[None, :])
    return m_n


@gluon.jit
def sparse_mla_latent_ampere_gluon_kernel(
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
    ROW_OFFSETS_32: gl.constexpr,
    PDL: gl.constexpr,
    HAS_SINK: gl.constexpr,
    HAS_EXTRA: gl.constexpr,  # a second index set into a second cache, in the same softmax
    EXTRA_HAS_COUNTS: gl.constexpr,
    EXTRA_HAS_BT: gl.constexpr,
    EXTRA_BT_SHIFT: gl.constexpr,
    EXTRA_PAGE_SHIFT: gl.constexpr,
    SPLIT_QK: gl.constexpr,  # QK^T split over the latent, one chunk a warp (16 heads, 4 warps)
):
    gl.static_assert(L == 512 and (R == 64 or R == 0), "a 512-wide latent, 64 or no rope")
    gl.static_assert(BLOCK_H % 16 == 0 and BLOCK_N % 16 == 0, "16-row MMA tiles")
    gl.static_assert(not E4M3 and not HAS_BT and not HAS_EXTRA, "q's dtype rows, flat indices")
    # SPLIT_QK (KernelConfig.split_qk): as the fp8_ds_mla kernel's, warp c multiplies its chunk
    # of q, held in registers for the whole walk, with chunk c of every row (the ring keeps the
    # rows chunk-major), the four partial S tiles are summed through shared memory so that each
    # warp holds the whole tile for the online softmax, and warp c accumulates O's chunk c. The
    # other form re-reads all of q from shared memory each step (a 16-head step's q is as many
    # bytes as 16 of its rows).
    gl.static_assert(
        not SPLIT_QK or (BLOCK_H == 16 and gl.num_warps() == NUM_CHUNKS),
        "QK^T split over the latent: 16 heads in one warp per latent chunk",
    )
    KW: gl.constexpr = L // NUM_CHUNKS  # a chunk's latent columns
    RW: gl.constexpr = 64 // NUM_CHUNKS  # its RoPE columns (the ring holds 64 a row)

    WARPS_M: gl.constexpr = gl.num_warps() if gl.num_warps() < BLOCK_H // 16 else BLOCK_H // 16
    WARPS_N: gl.constexpr = gl.num_warps() // WARPS_M
    MMA: gl.constexpr = gl.NVMMADistributedLayout(
        version=[2, 0], warps_per_cta=[WARPS_M, WARPS_N], instr_shape=[16, 8]
    )
    A_OP: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=MMA, k_width=2)
    B_OP: gl.constexpr = gl.DotOperandLayout(operand_index=1, parent=MMA, k_width=2)
    # SPLIT_QK: [chunk, ...] tiles, one chunk a warp; S and the softmax's rows in every warp
    MMA3: gl.constexpr = gl.NVMMADistributedLayout(
        version=[2, 0], warps_per_cta=[gl.num_warps(), 1, 1], instr_shape=[1, 16, 8]
    )
    A3_OP: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=MMA3, k_width=2)
    B3_OP: gl.constexpr = gl.DotOperandLayout(operand_index=1, parent=MMA3, k_width=2)
    S_ROWS: gl.constexpr = gl.SliceLayout(0, MMA3) if SPLIT_QK else MMA
    # 8 values (16 bytes, one cp.async) a thread along a row
    NOPE_LAYOUT: gl.constexpr = gl.BlockedLayout([1, 8], [1, 32], [gl.num_warps(), 1], [1, 0])
    ROPE_LAYOUT: gl.constexpr = gl.BlockedLayout([1, 8], [4, 8], [gl.num_warps(), 1], [1, 0])
    # SPLIT_QK's chunk-major gathers (and q): a warp's lanes span the four chunks of one row
    # (128-byte pieces of it) and the warps split the rows, so that a thread computes as few
    # row addresses as in the other form
    NOPE3_LAYOUT: gl.constexpr = gl.BlockedLayout(
        [1, 1, 8], [NUM_CHUNKS, 1, 32 // NUM_CHUNKS], [1, gl.num_warps(), 1], [2, 1, 0]
    )
    ROPE3_LAYOUT: gl.constexpr = gl.BlockedLayout(
        [1, 1, 8], [NUM_CHUNKS, 4, 8 // NUM_CHUNKS], [1, gl.num_warps(), 1], [2, 1, 0]
    )
    # the gathers' layouts: chunk-major with SPLIT_QK
    GATHER_NOPE: gl.constexpr = NOPE3_LAYOUT if SPLIT_QK else NOPE_LAYOUT
    GATHER_ROPE: gl.constexpr = ROPE3_LAYOUT if SPLIT_QK else ROPE_LAYOUT
    Q_LAYOUT: gl.constexpr = gl.BlockedLayout([1, 8], [2, 16], [gl.num_warps(), 1], [1, 0])
    OP_SMEM: gl.constexpr = gl.SwizzledSharedLayout(vec=8, per_phase=1, max_phase=8, order=[1, 0])
    OP3_SMEM: gl.constexpr = gl.SwizzledSharedLayout(
        vec=8, per_phase=1, max_phase=8, order=[2, 1, 0]
    )
    # the partial S tiles in the MMA's fragments, 8-column groups swizzled over four rows (as
    # the fp8_ds_mla kernel's)
    SUM3_SMEM: gl.constexpr = gl.SwizzledSharedLayout(
        vec=8, per_phase=1, max_phase=4, order=[2, 1, 0]
    )

    # tiles whose warps split S's columns as well as its rows: a row's max and sum and P's move
    # into PV's operand layout cross warps there
    COLS_SPLIT: gl.constexpr = (not SPLIT_QK) and WARPS_M > 1 and WARPS_N > 1
    # PV there in eight warps: the warps over O's columns only (each warp all BLOCK_H rows), so
    # that each V value is read from shared memory by one warp instead of by each of the WARPS_M
    # head groups (a 64-head 32-row step: 32 KB of V reads instead of 128, P's 4 KB read by
    # every warp); the rows' rescale factors reach that layout through shared memory with P.
    # The four-warp 32-head tile keeps QK^T's layout: with this one it spills (Triton 3.8)
    PV_COLS: gl.constexpr = COLS_SPLIT and gl.num_warps() >= PV_COLS_MIN_WARPS
    MMA_PV: gl.constexpr = (
        gl.NVMMADistributedLayout(
            version=[2, 0], warps_per_cta=[1, gl.num_warps()], instr_shape=[16, 8]
        )
        if PV_COLS
        else MMA
    )
    A_PV: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=MMA_PV, k_width=2)
    B_PV: gl.constexpr = gl.DotOperandLayout(operand_index=1, parent=MMA_PV, k_width=2)
    VALID_SMEM: gl.constexpr = gl.SwizzledSharedLayout(vec=1, per_phase=1, max_phase=1, order=[0])

    i_hb, i_ts, i_s, i_t = _program_coords(num_hb, num_splits)
    dtype: gl.constexpr = Q_nope.dtype.element_ty

    if SPLIT_QK:
        # each warp's chunk of q (and of its RoPE part) as its MMA operand in registers
        b_qa3 = _q_chunks(
            Q_nope, i_t, i_hb, H, stride_qnt, stride_qnh, stride_qnd, BLOCK_H, KW, A3_OP
        )
        if R > 0:
            b_qra3 = _q_chunks(
                Q_rope, i_t, i_hb, H, stride_qrt, stride_qrh, stride_qrd, BLOCK_H, RW, A3_OP
            )
        # the ring: two slots of gathered rows, chunk-major, and the partial S tiles
        nope_ring = gl.allocate_shared_memory(dtype, [2, NUM_CHUNKS, BLOCK_N, KW], OP3_SMEM)
        rope_ring = gl.allocate_shared_memory(dtype, [2, NUM_CHUNKS, BLOCK_N, RW], OP3_SMEM)
        s_parts = gl.allocate_shared_memory(gl.float32, [NUM_CHUNKS, BLOCK_H, BLOCK_N], SUM3_SMEM)
    else:
        o_hq = i_hb * BLOCK_H + gl.arange(0, BLOCK_H, layout=gl.SliceLayout(1, Q_LAYOUT))
        m_hq = o_hq < H
        o_lq = gl.arange(0, L, layout=gl.SliceLayout(0, Q_LAYOUT))
        p_q = Q_nope + i_t * stride_qnt + o_hq.to(gl.int64)[:, None] * stride_qnh
        b_q = gl.load(p_q + o_lq[None, :] * stride_qnd, mask=m_hq[:, None], other=0.0)
        q_s = gl.allocate_shared_memory(dtype, [BLOCK_H, L], OP_SMEM, b_q)
        if R > 0:
            o_rq = gl.arange(0, R, layout=gl.SliceLayout(0, Q_LAYOUT))
            p_qr = Q_rope + i_t * stride_qrt + o_hq.to(gl.int64)[:, None] * stride_qrh
            b_qr = gl.load(p_qr + o_rq[None, :] * stride_qrd, mask=m_hq[:, None], other=0.0)
            qr_s = gl.allocate_shared_memory(dtype, [BLOCK_H, R], OP_SMEM, b_qr)
        # the ring: two slots of gathered rows, read by the MMAs where they land
        nope_ring = gl.allocate_shared_memory(dtype, [2, BLOCK_N, L], OP_SMEM)
        rope_ring = gl.allocate_shared_memory(dtype, [2, BLOCK_N, 64], OP_SMEM)
    # the rows' validity, a slot per ring slot: stored as each gather is issued and read in
    # S's column layout after the step's second barrier (a convert_layout through the scratch
    # would take barriers of its own)
    v_s = gl.allocate_shared_memory(gl.int8, [2, BLOCK_N], VALID_SMEM)
    if COLS_SPLIT:
        # P on its way into PV's operand layout: one barrier between its store and the
        # ldmatrix, where convert_layout through the scratch takes two
        p_s = gl.allocate_shared_memory(dtype, [BLOCK_H, BLOCK_N], OP_SMEM)
    if PV_COLS:
        # and the rows' rescale factors, behind the same barrier (the WARPS_N warps that share
        # a row hold the same value)
        alpha_s = gl.allocate_shared_memory(gl.float32, [BLOCK_H], VALID_SMEM)

    w_lo, w_hi, n_steps = _split_range(
        Counts, i_t, i_s, W, split_len, stride_ct, BLOCK_N, HAS_COUNTS
    )
    qk_scale = sm_scale * LOG2E
    b_m = gl.full([BLOCK_H], float("-inf"), gl.float32, layout=gl.SliceLayout(1, S_ROWS))
    b_l = gl.zeros([BLOCK_H], gl.float32, layout=gl.SliceLayout(1, S_ROWS))
    if SPLIT_QK:
        b_o3 = gl.zeros([NUM_CHUNKS, BLOCK_H, KW], gl.float32, layout=MMA3)
    else:
        b_o = gl.zeros([BLOCK_H, L], gl.float32, layout=MMA_PV)
    if COLS_SPLIT:
        # the row sums kept per key column and reduced once after the loop (a row's sum across
        # the column warps would take two barriers a step)
        b_lacc = gl.zeros([BLOCK_H, BLOCK_N], gl.float32, layout=S_ROWS)
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
        GATHER_NOPE,
        GATHER_ROPE,
        SPLIT_QK,
        ROW_OFFSETS_32,
    )
    async_copy.commit_group()
    v_s.index(0).store(m_next.to(gl.int8))
    for i_step in range(n_steps):
        slot = i_step % 2
        w0 = w_lo + i_step * BLOCK_N
        # every thread is past its reads of the other slot (the previous step) before it
        # refills (and, SPLIT_QK, past its reads of the partial S tiles)
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
            GATHER_NOPE,
            GATHER_ROPE,
            SPLIT_QK,
            ROW_OFFSETS_32,
        )
        async_copy.commit_group()
        v_s.index(1 - slot).store(m_next.to(gl.int8))
        async_copy.wait_group(1)  # this step's rows are in
        _BARRIER()

        k_slot = nope_ring.index(slot)
        if SPLIT_QK:
            # warp c: its chunk's product over all BLOCK_N rows, then the four partial tiles
            # summed through shared memory
            b_sp = gl.zeros([NUM_CHUNKS, BLOCK_H, BLOCK_N], gl.float32, layout=MMA3)
            b_sp = mma_v2(b_qa3, k_slot.permute((0, 2, 1)).load(B3_OP), b_sp)
            if R > 0:
                b_krb = rope_ring.index(slot).permute((0, 2, 1)).load(B3_OP)
                b_sp = mma_v2(b_qra3, b_krb, b_sp)
            b_s = _sum_partial_s(s_parts, b_sp, MMA3)
        else:
            # QK^T over 64-wide slices of the latent, then the rope
            b_s = gl.zeros([BLOCK_H, BLOCK_N], gl.float32, layout=MMA)
            for k in gl.static_range(L // K_SLICE):
                b_qa = q_s.slice(k * K_SLICE, K_SLICE, dim=1).load(A_OP)
                b_kb = k_slot.slice(k * K_SLICE, K_SLICE, dim=1).permute((1, 0)).load(B_OP)
                b_s = mma_v2(b_qa, b_kb, b_s)
            if R > 0:
                b_qra = qr_s.load(A_OP)
                b_krb = rope_ring.index(slot).permute((1, 0)).load(B_OP)
                b_s = mma_v2(b_qra, b_krb, b_s)

        m_s = v_s.index(slot).load(gl.SliceLayout(0, S_ROWS)) != 0
        b_s = gl.where(m_s[None, :], b_s * qk_scale, float("-inf"))
        b_m_new = gl.maximum(b_m, gl.max(b_s, 1))
        b_m_use = gl.where(b_m_new == float("-inf"), 0.0, b_m_new)
        b_alpha = gl.exp2(b_m - b_m_use)
        b_p = gl.exp2(b_s - b_m_use[:, None])
        if COLS_SPLIT:
            b_lacc = b_lacc * b_alpha[:, None] + b_p
        else:
            b_l = b_l * b_alpha + gl.sum(b_p, 1)
        b_m = b_m_new

        # PV: P from registers in q's dtype, V the slot's latent rows
        if SPLIT_QK:
            # warp c: O's chunk c, P (which every warp holds whole) times the rows' chunk c
            b_o3 = b_o3 * gl.expand_dims(gl.expand_dims(b_alpha, 1), 0)
            b_o3 = _pv_chunks(b_o3, b_p.to(dtype), k_slot, A3_OP, B3_OP)
        else:
            if not PV_COLS:
                b_o = b_o * b_alpha[:, None]
            if COLS_SPLIT:
                p_s.store(b_p.to(dtype))
                if PV_COLS:
                    alpha_s.store(b_alpha)
                _BARRIER()
                if PV_COLS:
                    b_o = b_o * alpha_s.load(gl.SliceLayout(1, MMA_PV))[:, None]
                b_pa = p_s.load(A_PV)
            else:
                b_pa = gl.convert_layout(b_p.to(dtype), A_PV)
            b_o = mma_v2(b_pa, k_slot.load(B_PV), b_o)
    async_copy.wait_group(0)
    if COLS_SPLIT:
        b_l = gl.sum(b_lacc, 1)
    if SPLIT_QK:
        # the chunks side by side: [BLOCK_H, L] in the other form's layout
        b_o = gl.convert_layout(gl.reshape(gl.permute(b_o3, (1, 0, 2)), [BLOCK_H, L]), MMA)

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
        S_ROWS,
        MMA_PV,
    )
