"""The packed e4m3 decode's PTX (ops/e4m3.py, KernelConfig.e4m3_decode="packed"), run on CPU.

The inline PTX cannot run under Triton's interpreter, so its arithmetic is executed here by a
small evaluator of the four instructions it uses (prmt, and, shr, or on 32-bit registers) and
compared, for every byte in every lane, with the scalar integer decode and with torch's own
e4m3 -> float conversion. What only a GPU shows (the lane order Triton packs the bytes in) is
tests/test_sparse_mla.py::test_packed_e4m3_decode.
"""

from __future__ import annotations

import re

import pytest
import torch

from triton_mla_sparse.ops import e4m3

MASK32 = 0xFFFFFFFF
# the integer decode leaves the value times 2^(7 - 15): e4m3's exponent bias is 7, fp16's 15
INTEGER_DECODE_FACTOR = 2.0**-8


def prmt(a: int, b: int, sel: int) -> int:
    """PTX prmt.b32 (default mode): byte i of the result is byte sel[4i:4i+3] of {b, a}
    (a holds bytes 0-3), or that byte's sign replicated when bit 4i+3 of sel is set."""
    pool = (b << 32) | a
    out = 0
    for i in range(4):
        nib = (sel >> (4 * i)) & 0xF
        byte = (pool >> (8 * (nib & 0x7))) & 0xFF
        if nib & 0x8:
            byte = 0xFF if byte & 0x80 else 0
        out |= byte << (8 * i)
    return out


def run_ptx(text: str, inputs: dict[str, int]) -> dict[str, int]:
    """Execute the asm block's instructions on 32-bit registers; ``$n`` operands are Triton's."""
    regs = dict(inputs)

    def val(tok: str) -> int:
        tok = tok.strip()
        return regs[tok] if tok in regs else int(tok, 0)

    for line in text.splitlines():
        line = line.strip().rstrip(";")
        if not line or line in "{}" or line.startswith(".reg"):
            continue
        op, rest = line.split(None, 1)
        dst, *srcs = (x.strip() for x in rest.split(","))
        if op == "prmt.b32":
            regs[dst] = prmt(val(srcs[0]), val(srcs[1]), val(srcs[2]))
        elif op == "and.b32":
            regs[dst] = val(srcs[0]) & val(srcs[1])
        elif op == "or.b32":
            regs[dst] = val(srcs[0]) | val(srcs[1])
        elif op == "shr.b32":
            regs[dst] = (val(srcs[0]) & MASK32) >> val(srcs[1])
        else:
            raise AssertionError(f"instruction this evaluator does not know: {line!r}")
    return regs


def scalar_decode_bits(b: int) -> int:
    """The scalar integer decode of ops/e4m3._e4m3_to, as fp16 bits."""
    return ((b & 0x7F) << 7) | ((b & 0x80) << 8)


def packed_decode(four: list[int]) -> list[int]:
    """fp16 bit patterns of four bytes through the PTX: byte i = element i of the register;
    outputs $0 (elements 0, 1) and $1 (elements 2, 3), element 2k in the low half."""
    word = sum(b << (8 * i) for i, b in enumerate(four))
    regs = run_ptx(e4m3.E4M3X4_TO_F16X4_PTX.value, {"$2": word})
    lo, hi = regs["$0"], regs["$1"]
    return [lo & 0xFFFF, lo >> 16, hi & 0xFFFF, hi >> 16]


def test_the_evaluator_knows_every_instruction_of_the_ptx():
    ops = {
        line.split()[0]
        for line in e4m3.E4M3X4_TO_F16X4_PTX.value.splitlines()
        if line.strip() and line.strip() not in "{}" and not line.startswith(".reg")
    }
    assert ops == {"prmt.b32", "and.b32", "shr.b32", "or.b32"}
    # two outputs and one input, as the call in _e4m3_to declares ("=r,=r,r")
    assert set(re.findall(r"\$\d", e4m3.E4M3X4_TO_F16X4_PTX.value)) == {"$0", "$1", "$2"}


@pytest.mark.parametrize("lane", range(4))
def test_packed_equals_the_scalar_decode_for_every_byte_in_every_lane(lane):
    # the other lanes hold bytes that differ from the tested one (sign and all exponent bits
    # set), so that a byte leaking into its neighbour's lane changes the neighbour
    filler = [0xFF, 0x80, 0x7F, 0x01]
    for b in range(256):
        four = filler[:lane] + [b] + filler[lane + 1 :]
        got = packed_decode(four)
        assert got == [scalar_decode_bits(x) for x in four], (lane, hex(b))


def test_packed_decode_is_the_e4m3_value_times_the_integer_factor():
    codes = torch.arange(256, dtype=torch.int32)
    finite = (codes & 0x7F) != 0x7F  # e4m3fn's two NaN codes
    want = codes.to(torch.uint8).view(torch.float8_e4m3fn).float() * INTEGER_DECODE_FACTOR
    bits = [x for i in range(0, 256, 4) for x in packed_decode(list(range(i, i + 4)))]
    got = torch.tensor(bits, dtype=torch.int32).to(torch.int16).view(torch.float16).float()
    assert torch.equal(got[finite], want[finite])
    # -0.0 keeps its sign bit (the hardware decode gives -0.0 as well)
    assert packed_decode([0x80, 0, 0, 0])[0] == 0x8000
