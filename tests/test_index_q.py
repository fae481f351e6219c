"""index_q_rope (ops/index_q) against float64 torch: both rope styles, the e4m3 emulation (bit for
bit against torch's own e4m3 conversion), weights, validation."""

from __future__ import annotations

import pytest
import torch
from conftest import DEVICE, dtype_id

from triton_mla_sparse.ops.index_q import index_q_rope
from triton_mla_sparse.reference import rope_reference

DTYPES = [torch.float16, torch.float32] + ([torch.bfloat16] if DEVICE.type == "cuda" else [])


def rope_cache(positions: int, rot: int, seed: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    inv = 1.0 / (10000 ** (torch.arange(0, rot, 2, dtype=torch.float64) / rot))
    ang = torch.arange(positions, dtype=torch.float64)[:, None] * inv[None, :]
    ang = ang + torch.rand(ang.shape, generator=g, dtype=torch.float64)  # not just a table
    return torch.cat([ang.cos(), ang.sin()], dim=-1)


def e4m3_ref(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """vLLM's SM90 index-q quantisation (kernels.py:63-75) with torch's e4m3: (values, scale)."""
    x = x.float()
    amax = x.abs().amax(dim=-1, keepdim=True)
    scale = torch.exp2(torch.ceil(torch.log2(amax.clamp_min(1e-4) / 448.0)))
    return (x / scale).to(torch.float8_e4m3fn).float(), scale.squeeze(-1)


def _inputs(T, H, Hi, dtype, seed=0):
    g = torch.Generator().manual_seed(seed)
    pos = torch.randint(0, 50, (T,), generator=g)
    q_pe = torch.randn(T, H, 64, generator=g).to(dtype)
    iq = (torch.randn(T, Hi, 128, generator=g) * 3).to(dtype)
    w = torch.randn(T, Hi, generator=g)
    return pos, q_pe, iq, w


@pytest.mark.parametrize("dtype", DTYPES, ids=dtype_id)
@pytest.mark.parametrize("interleave", [False, True], ids=["neox", "interleaved"])
def test_rope_and_weights(dtype, interleave):
    T, H, Hi = 5, 3, 4
    pos, q_pe, iq, w = _inputs(T, H, Hi, dtype)
    cs_q, cs_i = rope_cache(50, 64, 1), rope_cache(50, 64, 2)
    q_pe_view = torch.randn(T, H, 192).to(dtype)[..., 128:]  # a strided view, as vLLM's split
    q_pe_view.copy_(q_pe)
    out_pe, out_iq, out_w = index_q_rope(
        pos.to(DEVICE),
        q_pe_view.to(DEVICE),
        cs_q.float().to(DEVICE),
        iq.to(DEVICE),
        cs_i.float().to(DEVICE),
        w.to(DEVICE),
        0.125,
        interleave=interleave,
    )
    tol = {torch.float16: 2e-3, torch.bfloat16: 1.6e-2, torch.float32: 1e-5}[dtype]
    # the MLA rope is interleaved
    want_pe = rope_reference(q_pe, cs_q.float().double(), pos, interleave=True)
    want_iq = rope_reference(iq, cs_i.float().double(), pos, interleave)
    assert out_pe.dtype == dtype and out_iq.dtype == dtype and out_w.dtype == torch.float32
    torch.testing.assert_close(out_pe.cpu().double(), want_pe, rtol=tol, atol=tol)
    torch.testing.assert_close(out_iq.cpu().double(), want_iq, rtol=tol, atol=tol * 3)
    torch.testing.assert_close(out_w.cpu(), w * 0.125, rtol=1e-6, atol=0)
    # the unrotated tail passes through untouched
    assert torch.equal(out_iq[..., 64:].cpu(), iq[..., 64:])


@pytest.mark.parametrize("interleave", [False, True], ids=["neox", "interleaved"])
def test_emulated_e4m3_matches_torch_bit_for_bit(interleave):
    """fp32 path: the rotated values are computed in fp32 like vLLM's kernel, then the e4m3 grid
    rounding must equal torch's float -> float8_e4m3fn conversion exactly (scale, values)."""
    T, H, Hi = 6, 1, 8
    pos, q_pe, iq, w = _inputs(T, H, Hi, torch.float32, seed=3)
    iq[0, 0] *= 1e-7  # amax below 1e-4: the floor of the scale rule
    iq[1, 1, 70:] = torch.linspace(-0.02, 0.02, 58)  # subnormal range after scaling
    iq[2, 2, 64:] = 0.0
    iq[2, 2, 64] = 448.0  # amax / 448 exactly a power of two (the scale stays 1)
    cs = rope_cache(50, 64, 4).float()
    _, out_iq, out_w = index_q_rope(
        pos.to(DEVICE),
        q_pe.to(DEVICE),
        cs.to(DEVICE),
        iq.to(DEVICE),
        cs.to(DEVICE),
        w.to(DEVICE),
        0.5,
        interleave=interleave,
        emulate_fp8=True,
    )
    # reference on the kernel's own fp32 rotation (the rounding, not the rope, is under test)
    _, rot_iq, _ = index_q_rope(
        pos.to(DEVICE),
        q_pe.to(DEVICE),
        cs.to(DEVICE),
        iq.to(DEVICE),
        cs.to(DEVICE),
        w.to(DEVICE),
        0.5,
        interleave=interleave,
    )
    vals, scale = e4m3_ref(rot_iq.cpu())
    assert torch.equal(out_iq.cpu(), vals)
    assert torch.equal(out_w.cpu(), (w * 0.5) * scale)
    # and the whole thing is close to the float64 pipeline
    want = rope_reference(iq, cs.double(), pos, interleave)
    got = out_iq.cpu().double() * scale.double()[..., None]
    assert (got - want).abs().max() <= 2**-4 * want.abs().amax()


def test_no_indexer_layer_and_zero_tokens():
    pos, q_pe, _, _ = _inputs(3, 2, 1, torch.float16)
    cs = rope_cache(50, 64).float()
    out_pe, iq, w = index_q_rope(pos.to(DEVICE), q_pe.to(DEVICE), cs.to(DEVICE))
    assert iq is None and w is None
    want = rope_reference(q_pe, cs.double(), pos, True)
    torch.testing.assert_close(out_pe.cpu().double(), want, rtol=2e-3, atol=2e-3)
    e = index_q_rope(pos[:0].to(DEVICE), q_pe[:0].to(DEVICE), cs.to(DEVICE))
    assert e[0].shape == (0, 2, 64)


def test_validation_names_the_argument():
    pos, q_pe, iq, w = _inputs(3, 2, 4, torch.float16)
    cs = rope_cache(50, 64).float()
    with pytest.raises(TypeError, match="positions"):
        index_q_rope(pos.float(), q_pe, cs)
    with pytest.raises(ValueError, match="q_pe_cos_sin_cache"):
        index_q_rope(pos, q_pe, cs[:, :32])
    with pytest.raises(ValueError, match="weights"):
        index_q_rope(pos, q_pe, cs, iq, cs, w[:, :2])
    with pytest.raises(TypeError, match="weights"):
        index_q_rope(pos, q_pe, cs, iq, cs, None)
    with pytest.raises(ValueError, match="index_q's head dim"):
        index_q_rope(pos, q_pe, cs, iq[..., :96], cs, w)
    with pytest.raises(TypeError, match="q_pe must be float16"):
        index_q_rope(pos, q_pe.to(torch.int8), cs)
