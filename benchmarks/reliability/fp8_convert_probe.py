"""Which e4m3 -> fp16/bf16/fp32 conversions does this Triton build get right on this GPU?

Every e4m3 code is converted by Triton's own cast (``tl.float8e4nv``), directly and through fp16,
once elementwise and once as the A operand of a ``tl.dot`` (where the compiler may place the
conversion in the dot-operand layout), and compared with torch's conversion bit for bit (NaN codes
compare as NaN elementwise and are left out of the dot). Prints one line per variant and exits
non-zero if any variant is wrong. Last, the indexer's prefill kernel with float32 q and the native
decode over every finite code. Needs an sm89+ GPU (hardware e4m3).

    python benchmarks/reliability/fp8_convert_probe.py

On an H200 (torch 2.11.0+cu130, Triton 3.6.0) every variant is exact. It was written to find the
cause of an indexer test that read zeros for every code with the native decode: the test's K rows
held the NaN codes 0x7F/0xFF, and one NaN in a row makes all of that row's dot products NaN, which
ReLU (the hardware max) returns as 0. The integer decode and the interpreter read those codes as
+-480, so only the hardware decode showed it; the kernel was right.
"""

from __future__ import annotations

import sys

import torch
import triton
import triton.language as tl

D = 128  # the reduction width of the indexer's dot
TILE_ROWS = (16, 64)  # K rows per tile (the indexer's block_n)
COLS = 16  # identity columns: out[n, j] = k[n, j]


@triton.jit
def _convert(b_u8, DTYPE: tl.constexpr, VIA_FP16: tl.constexpr):
    b_f = b_u8.to(tl.float8e4nv, bitcast=True)
    if VIA_FP16:
        return b_f.to(tl.float16).to(DTYPE)
    return b_f.to(DTYPE)


@triton.jit
def _elementwise(B, Out, DTYPE: tl.constexpr, VIA_FP16: tl.constexpr):
    o = tl.arange(0, 256)
    tl.store(Out + o, _convert(tl.load(B + o), DTYPE, VIA_FP16).to(tl.float32))


@triton.jit
def _as_dot_operand(
    B,
    Q,
    Out,
    DTYPE: tl.constexpr,
    VIA_FP16: tl.constexpr,
    PRECISION: tl.constexpr,
    N: tl.constexpr,
    D: tl.constexpr,
    COLS: tl.constexpr,
):
    o_n = tl.arange(0, N)
    o_d = tl.arange(0, D)
    o_j = tl.arange(0, COLS)
    b_k = _convert(tl.load(B + o_n[:, None] * D + o_d[None, :]), DTYPE, VIA_FP16)
    b_q = tl.load(Q + o_d[:, None] * COLS + o_j[None, :]).to(DTYPE)
    b_s = tl.dot(b_k, b_q, input_precision=PRECISION, out_dtype=tl.float32)
    tl.store(Out + o_n[:, None] * COLS + o_j[None, :], b_s)


def indexer_native_fp32(dev: torch.device) -> int:
    """The indexer's prefill kernel launched with float32 q and the native decode over every
    finite code (the NaN codes 0x7F/0xFF replaced by 0): how many of the 512 values come back
    wrong (0 = the combination works with this Triton)."""
    from triton_mla_sparse.ops.indexer.heuristics import IndexerConfig
    from triton_mla_sparse.ops.indexer.launch import launch_mqa_logits

    codes = torch.arange(256, dtype=torch.int32).to(torch.uint8).view(2, 128)
    codes[:, 127] = 0  # NaN codes: one NaN poisons every dot product of its row
    codes = codes.to(dev)
    H = 16
    q = torch.zeros(256, H, D, device=dev)
    d = torch.arange(128, device=dev)
    q[d, 0, d], q[128 + d, 0, d] = 1.0, -1.0
    w = torch.zeros(256, H, device=dev)
    w[:, 0] = 1.0
    ks = torch.zeros(256, dtype=torch.int32, device=dev)
    ke = torch.full((256,), 2, dtype=torch.int32, device=dev)
    out = torch.full((256, 2), -7.0, device=dev)
    cfg = IndexerConfig(rows=8, block_n=16, chunk=16, num_warps=4, num_stages=1)
    launch_mqa_logits(q, codes, torch.ones(2, device=dev), w, ks, ke, out, True, False, cfg)
    val = codes.view(torch.float8_e4m3fn).float()
    want = torch.cat([val.T.relu(), (-val.T).relu()])
    return int((out != want).sum())


def main() -> int:
    if not torch.cuda.is_available() or torch.cuda.get_device_capability() < (8, 9):
        print("needs an sm89+ GPU")
        return 2
    dev = torch.device("cuda")
    codes = torch.arange(256, dtype=torch.int32).to(torch.uint8)
    want = codes.view(torch.float8_e4m3fn).float()
    finite_codes = codes[torch.isfinite(want)]
    # tiles [rows, D]: the first COLS columns cycle through every finite code, the rest zeros
    q = torch.zeros(D, COLS)
    q[torch.arange(COLS), torch.arange(COLS)] = 1.0
    print(f"torch {torch.__version__}, triton {triton.__version__}, {torch.cuda.get_device_name()}")
    bad = 0
    for n_rows in TILE_ROWS:
        tile = torch.zeros(n_rows, D, dtype=torch.uint8)
        cyc = finite_codes.repeat(n_rows * COLS // finite_codes.numel() + 1)[: n_rows * COLS]
        tile[:, :COLS] = cyc.view(n_rows, COLS)
        tile_want = tile[:, :COLS].view(torch.float8_e4m3fn).float()
        for name, dtype in (("fp16", tl.float16), ("bf16", tl.bfloat16), ("fp32", tl.float32)):
            for via in (False, True):
                if via and name == "fp16":
                    continue
                label = f"e4m3 -> {'fp16 -> ' if via else ''}{name}"
                out = torch.empty(256, device=dev)
                _elementwise[(1,)](codes.to(dev), out, DTYPE=dtype, VIA_FP16=via)
                got = out.cpu()
                n_e = int((got.nan_to_num(1234.5) != want.nan_to_num(1234.5)).sum())
                for prec in ("ieee", "tf32") if name == "fp32" else ("tf32",):
                    s = torch.empty(n_rows, COLS, device=dev)
                    _as_dot_operand[(1,)](
                        tile.to(dev),
                        q.to(dev),
                        s,
                        DTYPE=dtype,
                        VIA_FP16=via,
                        PRECISION=prec,
                        N=n_rows,
                        D=D,
                        COLS=COLS,
                        num_warps=4,
                    )
                    got_d = s.cpu()
                    n_d = int((got_d != tile_want).sum())
                    bad += (n_e > 0) + (n_d > 0)
                    print(
                        f"{label:<22s} elementwise {'ok' if n_e == 0 else f'{n_e}/256 wrong'}; "
                        f"{n_rows}-row dot operand ({prec}) "
                        f"{'ok' if n_d == 0 else f'{n_d}/{n_rows * COLS} wrong, first {got_d.flatten()[:4].tolist()}'}"
                    )
    n_ix = indexer_native_fp32(dev)
    print(f"indexer prefill kernel, float32 q, native decode: {n_ix}/512 values wrong")
    bad += n_ix > 0
    print("RESULT:", "PASS" if bad == 0 else f"FAIL ({bad} variants wrong)")
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
