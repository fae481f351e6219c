"""write_mla_cache (ops/mla_cache) against torch's own e4m3 conversion, bit for bit: the fp8_ds_mla
layout (pow2 scales per 128 values as vLLM's Triton writer computes them, bf16 rope) and the
per-tensor fp8 layout (saturation at 448), padding slots, strided caches, validation."""

from __future__ import annotations

import pytest
import torch
from conftest import DEVICE, HAS_GPU

from triton_mla_sparse.kv_format import unpack_fp8_ds_mla
from triton_mla_sparse.ops.mla_cache import write_mla_cache


def _rows(T: int, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    kv = torch.randn(T, 512, generator=g) * torch.logspace(-6, 1, T)[:, None]  # tiny to large
    kv[0, :128] = 0.0  # an all-zero tile: scale floor 1e-4 -> 2^-13
    kv[1, 128:256] = torch.linspace(-448.0, 448.0, 128)  # amax / 448 exactly 1
    pe = torch.randn(T, 64, generator=g) * 3
    return kv, pe


def _ds_mla_torch(kv: torch.Tensor, pe: torch.Tensor) -> torch.Tensor:
    """vLLM's fused writer's rule in torch (its fp8 conversion is torch's, RNE)."""
    t = kv.view(-1, 4, 128)
    s = torch.exp2(
        torch.ceil(torch.log2((t.abs().amax(-1, keepdim=True) * (1.0 / 448.0)).clamp_min(1e-4)))
    )
    q = (t / s).to(torch.float8_e4m3fn).view(torch.uint8).reshape(-1, 512)
    out = torch.empty(kv.shape[0], 656, dtype=torch.uint8)
    out[:, :512] = q
    out[:, 512:528] = s.reshape(-1, 4).contiguous().view(torch.uint8)
    if HAS_GPU:
        out[:, 528:] = pe.to(torch.bfloat16).contiguous().view(torch.uint8)
    else:  # Triton's interpreter converts fp32 -> bf16 by truncation (the GPU rounds to nearest)
        trunc = (pe.contiguous().view(torch.int32) & -65536).view(torch.float32)
        out[:, 528:] = trunc.to(torch.bfloat16).contiguous().view(torch.uint8)
    return out


def _paged(width: int, nb: int = 3, bs: int = 16, extra: int = 8):
    raw = torch.full((nb, bs + extra, width), 0x5A, dtype=torch.uint8)  # block stride > bs rows
    return raw, raw[:, :bs]


def test_fp8_ds_mla_bytes_equal_torch():
    T = 12
    kv, pe = _rows(T)
    slots = torch.tensor([0, 17, 5, -1, 33, 47, 16, 2, 40, -1, 31, 9])
    raw, _ = _paged(656)
    raw = raw.to(DEVICE)  # the writer writes into a view of this buffer, on the kernel's device
    write_mla_cache(kv.to(DEVICE), pe.to(DEVICE), slots.to(DEVICE), raw[:, :16], "fp8_ds_mla")
    raw = raw.cpu()
    cache = raw[:, :16]
    want = _ds_mla_torch(kv, pe)
    keep = slots >= 0
    got = cache.reshape(-1, 656)[slots[keep]]
    assert torch.equal(got, want[keep])
    # untouched: padding rows, unused slots and the gap rows between blocks
    written = torch.zeros(cache.shape[0] * cache.shape[1], dtype=torch.bool)
    written[slots[keep]] = True
    assert (cache.reshape(-1, 656)[~written] == 0x5A).all() and (raw[:, 16:] == 0x5A).all()
    # and it decodes to the input within e4m3's resolution
    dec = unpack_fp8_ds_mla(got)
    assert (dec[:, :512] - kv[keep]).abs().max() <= (kv[keep].abs().amax() * 2**-4)


def test_fp8_per_tensor_bytes_equal_torch_with_saturation():
    T = 6
    kv, pe = _rows(T, seed=1)
    kv[2, :8] = torch.tensor([500.0, -900.0, 447.9, 449.0, 1e-9, -1e-9, -0.0, 0.0])
    scale = torch.tensor([0.5])
    slots = torch.arange(T) * 3
    raw, _ = _paged(576)
    raw = raw.to(DEVICE)
    cache = raw[:, :16]
    write_mla_cache(kv.to(DEVICE), pe.to(DEVICE), slots.to(DEVICE), cache, "fp8", scale.to(DEVICE))
    cache = cache.cpu()
    x = torch.cat([kv, pe], dim=-1) / 0.5
    want = x.clamp(-448, 448).to(torch.float8_e4m3fn).view(torch.uint8)
    assert torch.equal(cache.reshape(-1, 576)[slots], want)
    raw1 = _paged(576)[0].to(DEVICE)
    cache1 = raw1[:, :16]
    write_mla_cache(
        kv.to(DEVICE), pe.to(DEVICE), slots.to(DEVICE), cache1.view(torch.float8_e4m3fn), "fp8"
    )
    cache1 = cache1.cpu()
    want1 = torch.cat([kv, pe], -1).clamp(-448, 448).to(torch.float8_e4m3fn).view(torch.uint8)
    assert torch.equal(cache1.reshape(-1, 576)[slots], want1)


def test_validation_names_the_argument():
    kv, pe = _rows(2)
    _, cache = _paged(656)
    slots = torch.tensor([0, 1])
    with pytest.raises(ValueError, match="kv_format"):
        write_mla_cache(kv, pe, slots, cache, "auto")
    with pytest.raises(TypeError, match="kv_c must be a float32"):
        write_mla_cache(kv.half(), pe, slots, cache, "fp8_ds_mla")
    with pytest.raises(ValueError, match="k_pe must be"):
        write_mla_cache(kv, pe[:, :32], slots, cache, "fp8_ds_mla")
    with pytest.raises(ValueError, match="kv_cache must be"):
        write_mla_cache(kv, pe, slots, cache[..., :576], "fp8_ds_mla")
    with pytest.raises(TypeError, match="slot_mapping"):
        write_mla_cache(kv, pe, slots.float(), cache, "fp8_ds_mla")
    with pytest.raises(TypeError, match="kv_cache must be uint8"):
        write_mla_cache(kv, pe, slots, cache.float(), "fp8_ds_mla")
