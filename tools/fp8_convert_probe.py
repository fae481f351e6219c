"""Which e4m3 -> fp16/bf16/fp32 conversions does this Triton build get right on this GPU?

Every e4m3 code is converted by Triton's own cast (``tl.float8e4nv``), directly and through fp16,
once elementwise and once as the A operand of a ``tl.dot`` (where the compiler may place the
conversion in the dot-operand layout), and compared with torch's conversion bit for bit (NaN codes
compare as NaN elementwise and are left out of the dot). Prints one line per variant and exits
non-zero if any variant is wrong. Needs an sm89+ GPU (hardware e4m3).

    python tools/fp8_convert_probe.py
"""

from __future__ import annotations

import sys

import torch
import triton
import triton.language as tl

D = 128  # the reduction width of the indexer's dot
N = 64  # K rows per tile
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


def main() -> int:
    if not torch.cuda.is_available() or torch.cuda.get_device_capability() < (8, 9):
        print("needs an sm89+ GPU")
        return 2
    dev = torch.device("cuda")
    codes = torch.arange(256, dtype=torch.int32).to(torch.uint8)
    want = codes.view(torch.float8_e4m3fn).float()
    finite_codes = codes[torch.isfinite(want)]
    # tile [N, D]: the first COLS columns cycle through every finite code, the rest zeros
    tile = torch.zeros(N, D, dtype=torch.uint8)
    tile[:, :COLS] = finite_codes.repeat(N * COLS // finite_codes.numel() + 1)[: N * COLS].view(
        N, COLS
    )
    tile_want = tile[:, :COLS].view(torch.float8_e4m3fn).float()
    q = torch.zeros(D, COLS)
    q[torch.arange(COLS), torch.arange(COLS)] = 1.0
    print(f"torch {torch.__version__}, triton {triton.__version__}, {torch.cuda.get_device_name()}")
    bad = 0
    for name, dtype in (("fp16", tl.float16), ("bf16", tl.bfloat16), ("fp32", tl.float32)):
        for via in (False, True):
            if via and name == "fp16":
                continue
            label = f"e4m3 -> {'fp16 -> ' if via else ''}{name}"
            out = torch.empty(256, device=dev)
            _elementwise[(1,)](codes.to(dev), out, DTYPE=dtype, VIA_FP16=via)
            got = out.cpu()
            ok_e = torch.equal(got.nan_to_num(1234.5), want.nan_to_num(1234.5))
            n_e = int((got.nan_to_num(1234.5) != want.nan_to_num(1234.5)).sum())
            for prec in ("ieee", "tf32") if name == "fp32" else ("tf32",):
                s = torch.empty(N, COLS, device=dev)
                _as_dot_operand[(1,)](
                    tile.to(dev),
                    q.to(dev),
                    s,
                    DTYPE=dtype,
                    VIA_FP16=via,
                    PRECISION=prec,
                    N=N,
                    D=D,
                    COLS=COLS,
                )
                got_d = s.cpu()
                n_d = int((got_d != tile_want).sum())
                sample = got_d.flatten()[:4].tolist()
                bad += (n_e > 0) + (n_d > 0)
                print(
                    f"{label:<22s} elementwise {'ok' if ok_e else f'{n_e}/256 wrong'}; "
                    f"as dot operand ({prec}) "
                    f"{'ok' if n_d == 0 else f'{n_d}/{N * COLS} wrong, first {sample}'}"
                )
    print("RESULT:", "PASS" if bad == 0 else f"FAIL ({bad} variants wrong)")
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
