"""The fp8-free e4m3 codec of ops/e4m3.py against torch's float -> float8_e4m3fn conversion,
exhaustively where it matters: every finite e4m3 value, every midpoint between neighbours (ties
round to even), one fp32 ulp either side of each midpoint, the subnormal range, signed zeros.

_round_e4m3 + _e4m3_byte are the encoder of the SM80/86 fp8 cache writer (ops/mla_cache) and of
the emulated index q (ops/index_q); _e4m3_to (integer decode) is the decoder of every SM80/86
kernel. All three must agree with the hardware conversion bit for bit.
"""

from __future__ import annotations

import pytest
import torch
import triton
import triton.language as tl
from conftest import DEVICE, HAS_GPU

from triton_mla_sparse.ops.e4m3 import _e4m3_byte, _e4m3_to, _round_e4m3


@triton.jit
def _encode_kernel(X, Out, n, BLOCK: tl.constexpr):
    o = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    m = o < n
    x = tl.load(X + o, mask=m, other=0.0)
    tl.store(Out + o, _e4m3_byte(_round_e4m3(x)), mask=m)


@triton.jit
def _decode_kernel(
    B, Out, BLOCK: tl.constexpr, DTYPE: tl.constexpr = tl.float32, NATIVE: tl.constexpr = False
):
    o = tl.arange(0, BLOCK)
    tl.store(Out + o, _e4m3_to(tl.load(B + o), DTYPE, NATIVE).to(tl.float32))


def finite_values() -> torch.Tensor:
    """The 254 finite e4m3 values (both zeros included), ascending by code within each sign."""
    codes = torch.arange(256, dtype=torch.int32).to(torch.uint8)
    v = codes.view(torch.float8_e4m3fn).float()
    return v[torch.isfinite(v)]


def probe_values() -> torch.Tensor:
    """Every finite value, the midpoints of neighbouring non-negative values (and their
    negatives), each midpoint one fp32 ulp down and up, and a sweep of the subnormal range."""
    pos = torch.unique(finite_values().abs())  # 0, 2^-9, ..., 448
    mid = (pos[:-1].double() + pos[1:].double()) / 2
    mid32 = mid.float()
    assert torch.equal(mid32.double(), mid), "midpoints are exact in fp32"
    below = torch.nextafter(mid32, torch.zeros_like(mid32))
    above = torch.nextafter(mid32, torch.full_like(mid32, 1e9))
    sub = torch.linspace(0, 2**-6, 1001)
    mags = torch.cat([pos, mid32, below, above, sub])
    return torch.cat([mags, -mags, torch.tensor([0.0, -0.0])])


def test_encode_equals_torch_bit_for_bit():
    x = probe_values()
    assert x.abs().max() <= 448.0
    out = torch.empty(x.shape, dtype=torch.uint8, device=DEVICE)
    block = 1024
    _encode_kernel[(triton.cdiv(x.numel(), block),)](x.to(DEVICE), out, x.numel(), BLOCK=block)
    want = x.to(torch.float8_e4m3fn).view(torch.uint8)
    bad = (out.cpu() != want).nonzero()[:, 0]
    assert bad.numel() == 0, [
        (float(x[i]), int(out.cpu()[i]), int(want[i])) for i in bad[:8].tolist()
    ]


def test_integer_decode_equals_torch_for_every_finite_code():
    codes = torch.arange(256, dtype=torch.int32).to(torch.uint8)
    out = torch.empty(256, dtype=torch.float32, device=DEVICE)
    _decode_kernel[(1,)](codes.to(DEVICE), out, BLOCK=256)
    # the integer decode leaves the factor 2^-8 (bias 7 -> 15) that its callers' scales put back
    got = out.cpu() * 256.0
    want = codes.view(torch.float8_e4m3fn).float()
    fin = torch.isfinite(want)
    assert torch.equal(got[fin], want[fin])
    assert torch.equal(torch.signbit(got[fin]), torch.signbit(want[fin]))  # -0.0 stays -0.0


NATIVE_DTYPES = [("fp16", tl.float16), ("fp32", tl.float32)] + (
    [("bf16", tl.bfloat16)] if HAS_GPU else []
)


@pytest.mark.parametrize("dtype", [d for _, d in NATIVE_DTYPES], ids=[n for n, _ in NATIVE_DTYPES])
def test_native_decode_equals_torch_for_every_code(dtype):
    """The hardware decode (sm89+; the interpreter's emulation on CPU) into each MMA operand type:
    every finite code exact; NaN codes NaN on the GPU (the interpreter reads them as +-480)."""
    if HAS_GPU and torch.cuda.get_device_capability() < (8, 9):
        pytest.skip("hardware e4m3 conversion needs sm89+")
    codes = torch.arange(256, dtype=torch.int32).to(torch.uint8)
    out = torch.empty(256, dtype=torch.float32, device=DEVICE)
    _decode_kernel[(1,)](codes.to(DEVICE), out, BLOCK=256, DTYPE=dtype, NATIVE=True)
    want = codes.view(torch.float8_e4m3fn).float()
    fin = torch.isfinite(want)
    got = out.cpu()
    assert torch.equal(got[fin], want[fin])
    assert torch.equal(torch.signbit(got[fin]), torch.signbit(want[fin]))
    if HAS_GPU:
        assert torch.isnan(got[~fin]).all()
