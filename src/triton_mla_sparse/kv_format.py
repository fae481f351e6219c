"""KV cache formats: what a cache row holds and how the fp8 layouts are packed.

Formats (one latent "head" per token):

- ``"auto"``: the cache has q's dtype (fp16/bf16/fp32), ``D = kv_lora_rank + rope`` values per row.
- ``"fp8"``: ``D`` e4m3 values per row with one per-tensor scale ``k_scale``
  (``value = e4m3 * k_scale``); stored as ``torch.float8_e4m3fn`` or ``torch.uint8``.
- ``"fp8_ds_mla"``: 656 bytes per row (vLLM's / FlashMLA's layout), ``torch.uint8``:
  bytes ``[0, 512)`` 512 e4m3 latent values, ``[512, 528)`` four float32 scales (scale ``j``
  multiplies latent values ``128j .. 128j+127``), ``[528, 656)`` 64 bf16 rope values.
"""

from __future__ import annotations

import torch

KV_FORMATS = ("auto", "fp8", "fp8_ds_mla")

DS_MLA_LATENT = 512
DS_MLA_ROPE = 64
DS_MLA_GROUP = 128  # latent values per scale
DS_MLA_NUM_SCALES = DS_MLA_LATENT // DS_MLA_GROUP
DS_MLA_SCALE_OFFSET = DS_MLA_LATENT  # bytes
DS_MLA_ROPE_OFFSET = DS_MLA_SCALE_OFFSET + 4 * DS_MLA_NUM_SCALES  # 528 bytes
DS_MLA_ROW_BYTES = DS_MLA_ROPE_OFFSET + 2 * DS_MLA_ROPE  # 656 bytes

E4M3_MAX = 448.0


def ds_mla_scales(amax: torch.Tensor, scale_format: str) -> torch.Tensor:
    """Per-group scales from per-group absolute maxima (float32), as vLLM's writers compute them.

    ``"pow2"``: ``2^ceil(log2(amax / 448))`` (vLLM's Triton writer); ``"fp32"``: ``amax / 448``
    (vLLM's CUDA writer). An all-zero group gets scale 0 under ``"fp32"`` (the kernel must decode
    it to zeros, not NaN) and scale 1 under ``"pow2"``.
    """
    amax = amax.float()
    if scale_format == "fp32":
        return amax / E4M3_MAX
    if scale_format == "pow2":
        ratio = amax / E4M3_MAX
        safe = torch.where(ratio > 0, ratio, torch.ones_like(ratio))
        return torch.exp2(torch.ceil(torch.log2(safe)))
    raise ValueError(f"scale_format must be 'pow2' or 'fp32', got {scale_format!r}")


def pack_fp8_ds_mla(rows: torch.Tensor, scale_format: str = "pow2") -> torch.Tensor:
    """Pack rows ``[..., 576]`` (any floating dtype) into the fp8_ds_mla layout ``uint8 [..., 656]``.

    The first 512 values are quantized to e4m3 with one scale per 128 values; the last 64 are
    stored as bf16. Byte-compatible with the layout FlashMLA and vLLM read.
    """
    if not rows.is_floating_point():
        raise TypeError(f"rows must be floating point, got {rows.dtype}")
    width = DS_MLA_LATENT + DS_MLA_ROPE
    if rows.shape[-1] != width:
        raise ValueError(f"rows must have last dimension {width}, got shape {tuple(rows.shape)}")
    lead = rows.shape[:-1]
    flat = rows.reshape(-1, width)
    latent = flat[:, :DS_MLA_LATENT].float().view(-1, DS_MLA_NUM_SCALES, DS_MLA_GROUP)
    scale = ds_mla_scales(latent.abs().amax(dim=-1), scale_format)  # [n, 4]
    safe = torch.where(scale > 0, scale, torch.ones_like(scale))
    q8 = (latent / safe[..., None]).clamp(-E4M3_MAX, E4M3_MAX).to(torch.float8_e4m3fn)
    out = torch.empty(flat.shape[0], DS_MLA_ROW_BYTES, dtype=torch.uint8, device=rows.device)
    out[:, :DS_MLA_LATENT] = q8.reshape(-1, DS_MLA_LATENT).view(torch.uint8)
    out[:, DS_MLA_SCALE_OFFSET:DS_MLA_ROPE_OFFSET] = scale.contiguous().view(torch.uint8)
    rope = flat[:, DS_MLA_LATENT:].to(torch.bfloat16).contiguous()
    out[:, DS_MLA_ROPE_OFFSET:] = rope.view(torch.uint8)
    return out.reshape(*lead, DS_MLA_ROW_BYTES)


def unpack_fp8_ds_mla(packed: torch.Tensor) -> torch.Tensor:
    """Decode ``uint8 [..., 656]`` fp8_ds_mla rows into float32 ``[..., 576]``."""
    if packed.dtype != torch.uint8:
        raise TypeError(f"packed must be torch.uint8, got {packed.dtype}")
    if packed.shape[-1] != DS_MLA_ROW_BYTES:
        raise ValueError(
            f"packed must have last dimension {DS_MLA_ROW_BYTES}, got shape {tuple(packed.shape)}"
        )
    lead = packed.shape[:-1]
    flat = packed.reshape(-1, DS_MLA_ROW_BYTES).contiguous()
    latent = flat[:, :DS_MLA_LATENT].view(torch.float8_e4m3fn).float()
    scale = flat[:, DS_MLA_SCALE_OFFSET:DS_MLA_ROPE_OFFSET].contiguous().view(torch.float32)
    latent = latent.view(-1, DS_MLA_NUM_SCALES, DS_MLA_GROUP) * scale[..., None]
    rope = flat[:, DS_MLA_ROPE_OFFSET:].contiguous().view(torch.bfloat16).float()
    out = torch.cat([latent.reshape(-1, DS_MLA_LATENT), rope], dim=-1)
    return out.reshape(*lead, DS_MLA_LATENT + DS_MLA_ROPE)


def quantize_fp8(rows: torch.Tensor, k_scale: float | None = None) -> tuple[torch.Tensor, float]:
    """Quantize rows to e4m3 with one per-tensor scale; returns ``(float8_e4m3fn rows, k_scale)``."""
    if k_scale is None:
        amax = float(rows.detach().abs().max()) if rows.numel() else 0.0
        k_scale = amax / E4M3_MAX if amax > 0 else 1.0
    q8 = (rows.float() / k_scale).clamp(-E4M3_MAX, E4M3_MAX).to(torch.float8_e4m3fn)
    return q8, float(k_scale)


def dequantize_cache(
    kv_cache: torch.Tensor, kv_format: str, k_scale: float | torch.Tensor | None = None
) -> torch.Tensor:
    """Decode a cache of any format to float32 with the same leading shape (used by the reference)."""
    if kv_format == "auto":
        return kv_cache.float()
    if kv_format == "fp8":
        u8 = kv_cache.view(torch.uint8) if kv_cache.dtype != torch.uint8 else kv_cache
        scale = 1.0 if k_scale is None else k_scale
        scale = float(scale) if not isinstance(scale, torch.Tensor) else scale.float().cpu().item()
        return u8.view(torch.float8_e4m3fn).float() * scale
    if kv_format == "fp8_ds_mla":
        return unpack_fp8_ds_mla(kv_cache)
    raise ValueError(f"kv_format must be one of {KV_FORMATS}, got {kv_format!r}")


def bytes_per_row(kv_format: str, width: int, dtype: torch.dtype) -> int:
    """Bytes one cache row occupies in the given format (for bandwidth accounting)."""
    if kv_format == "fp8_ds_mla":
        return DS_MLA_ROW_BYTES
    if kv_format == "fp8":
        return width
    return width * torch.empty((), dtype=dtype).element_size()


__all__ = [
    "KV_FORMATS",
    "DS_MLA_ROW_BYTES",
    "bytes_per_row",
    "dequantize_cache",
    "ds_mla_scales",
    "pack_fp8_ds_mla",
    "quantize_fp8",
    "unpack_fp8_ds_mla",
]


# The DSA lightning indexer's K cache (vLLM's CUDA layout, non-shuffled): per block of
# INDEXER_BLOCK_SIZE tokens, block_size x INDEXER_HEAD_DIM e4m3 values (token-major), then
# block_size float32 scales. Value (block, off, d) at block*stride0 + off*128 + d; scale at
# block*stride0 + block_size*128 + off*4. stride0 may exceed block_size * 132.
INDEXER_HEAD_DIM = 128
INDEXER_BLOCK_SIZE = 64
INDEXER_SCALE_BYTES = 4
INDEXER_ROW_BYTES = INDEXER_HEAD_DIM + INDEXER_SCALE_BYTES  # 132
INDEXER_MIN_AMAX = 1e-4  # vLLM's floor on a token's amax before taking its scale


def quantize_indexer_k(k: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-token e4m3 quantisation as vLLM's indexer writer does it.

    ``k [..., 128]`` (any float dtype) -> ``(float8_e4m3fn [..., 128], float32 scales [...])`` with
    ``scale = 2^ceil(log2(max(amax, 1e-4) / 448))`` and ``value = e4m3 * scale``.
    """
    amax = k.float().abs().amax(dim=-1).clamp_min(INDEXER_MIN_AMAX)
    scale = torch.exp2(torch.ceil(torch.log2(amax / E4M3_MAX)))
    q8 = (k.float() / scale[..., None]).clamp(-E4M3_MAX, E4M3_MAX).to(torch.float8_e4m3fn)
    return q8, scale


def indexer_cache_blocks(kv_cache: torch.Tensor) -> torch.Tensor:
    """``uint8 [num_blocks, block_size * 132]`` view of an indexer cache given as
    ``[num_blocks, block_size, 1, 132]`` or ``[num_blocks, block_size * 132]`` (block stride kept)."""
    nb = kv_cache.shape[0]
    width = kv_cache[0].numel()
    return torch.as_strided(kv_cache, (nb, width), (kv_cache.stride(0), 1))


def unpack_indexer_cache(
    kv_cache: torch.Tensor, block_size: int = INDEXER_BLOCK_SIZE
) -> tuple[torch.Tensor, torch.Tensor]:
    """Decode an indexer cache -> ``(values float32 [num_blocks, block_size, 128],
    scales float32 [num_blocks, block_size])``; values are the raw e4m3 numbers (unscaled)."""
    flat = indexer_cache_blocks(kv_cache.view(torch.uint8))
    nb = flat.shape[0]
    vals = flat[:, : block_size * INDEXER_HEAD_DIM].reshape(nb, block_size, INDEXER_HEAD_DIM)
    vals = vals.contiguous().view(torch.float8_e4m3fn).float()
    scales = flat[:, block_size * INDEXER_HEAD_DIM : block_size * INDEXER_ROW_BYTES]
    return vals, scales.contiguous().view(torch.float32).reshape(nb, block_size)


def write_indexer_cache(
    kv_cache: torch.Tensor, slots: torch.Tensor, k8: torch.Tensor, scales: torch.Tensor
) -> None:
    """Write tokens into an indexer cache: ``slots`` int ``[n]`` flat slot ids
    (``block * block_size + offset``), ``k8`` e4m3 ``[n, 128]``, ``scales`` float32 ``[n]``."""
    flat = indexer_cache_blocks(kv_cache.view(torch.uint8))
    block_size = flat.shape[1] // INDEXER_ROW_BYTES
    blk, off = slots.long() // block_size, slots.long() % block_size
    d = torch.arange(INDEXER_HEAD_DIM, device=flat.device)
    flat[blk[:, None], off[:, None] * INDEXER_HEAD_DIM + d[None, :]] = k8.view(torch.uint8)
    s = torch.arange(INDEXER_SCALE_BYTES, device=flat.device)
    col = block_size * INDEXER_HEAD_DIM + off[:, None] * INDEXER_SCALE_BYTES + s[None, :]
    flat[blk[:, None], col] = scales.float().contiguous().view(torch.uint8).view(-1, 4)


__all__ += [
    "INDEXER_BLOCK_SIZE",
    "INDEXER_HEAD_DIM",
    "INDEXER_ROW_BYTES",
    "indexer_cache_blocks",
    "quantize_indexer_k",
    "unpack_indexer_cache",
    "write_indexer_cache",
]
