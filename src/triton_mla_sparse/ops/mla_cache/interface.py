"""Host wrapper for the MLA cache writer: validate, launch. No GPU work at import."""

from __future__ import annotations

import torch

from ...kv_format import DS_MLA_LATENT, DS_MLA_ROPE, DS_MLA_ROW_BYTES
from ..host import describe as _shape

FORMATS = ("fp8", "fp8_ds_mla")


def write_mla_cache(
    kv_c: torch.Tensor,
    k_pe: torch.Tensor,
    slot_mapping: torch.Tensor,
    kv_cache: torch.Tensor,
    kv_format: str,
    k_scale: torch.Tensor | None = None,
) -> None:
    """Write MLA cache rows in an fp8 format, as vLLM's fused writer does, without fp8 types.

    - ``kv_c``: float32 ``[T, 512]`` (unit last stride), the RMS-normed latent.
    - ``k_pe``: float32 ``[T, 64]`` (unit last stride), the rotated rope part (interleaved, as
      vLLM stores it).
    - ``slot_mapping``: int32/int64 ``[n]``, ``n <= T``, flat slots ``block * block_size +
      offset``; negative slots (padding) are skipped.
    - ``kv_cache``: ``[num_blocks, block_size, C]``, ``uint8`` or ``float8_e4m3fn``, any block and
      row strides (bytes, unit last stride). ``"fp8_ds_mla"``: ``C = 656`` uint8 (512 e4m3 latent
      with one power-of-two scale ``2^ceil(log2(max(amax / 448, 1e-4)))`` per 128 values, the 4
      float32 scales, 64 bf16 rope). ``"fp8"``: ``C = 576`` e4m3 values ``x / k_scale``
      saturated to +-448.
    - ``k_scale``: float32 1-element tensor for ``"fp8"`` (None: scale 1); unused for ds_mla.

    In place; no host synchronisation.
    """
    if kv_format not in FORMATS:
        raise ValueError(f"kv_format must be one of {FORMATS}, got {kv_format!r}")
    for name, x, width in (("kv_c", kv_c, DS_MLA_LATENT), ("k_pe", k_pe, DS_MLA_ROPE)):
        if not isinstance(x, torch.Tensor) or x.dtype != torch.float32:
            raise TypeError(f"{name} must be a float32 tensor, got {_shape(x)}")
        if x.dim() != 2 or x.shape[1] != width or x.stride(1) != 1:
            raise ValueError(f"{name} must be [T, {width}] with unit last stride, got {_shape(x)}")
    if kv_c.shape[0] != k_pe.shape[0] or k_pe.device != kv_c.device:
        raise ValueError(f"kv_c and k_pe disagree: {_shape(kv_c)} vs {_shape(k_pe)}")
    if not isinstance(slot_mapping, torch.Tensor) or slot_mapping.dtype not in (
        torch.int32,
        torch.int64,
    ):
        raise TypeError(f"slot_mapping must be an int32/int64 tensor, got {_shape(slot_mapping)}")
    if slot_mapping.dim() != 1 or slot_mapping.shape[0] > kv_c.shape[0]:
        raise ValueError(
            f"slot_mapping must be [n <= T={kv_c.shape[0]}], got {_shape(slot_mapping)}"
        )
    if not isinstance(kv_cache, torch.Tensor) or kv_cache.dtype not in (
        torch.uint8,
        torch.float8_e4m3fn,
    ):
        raise TypeError(f"kv_cache must be uint8 or float8_e4m3fn, got {_shape(kv_cache)}")
    width = DS_MLA_ROW_BYTES if kv_format == "fp8_ds_mla" else DS_MLA_LATENT + DS_MLA_ROPE
    if kv_cache.dim() != 3 or kv_cache.shape[2] != width or kv_cache.stride(2) != 1:
        raise ValueError(
            f"kv_cache must be [num_blocks, block_size, {width}] for {kv_format!r} with unit last "
            f"stride, got {_shape(kv_cache)} strides {kv_cache.stride() if isinstance(kv_cache, torch.Tensor) else ''}"
        )
    cache = kv_cache.view(torch.uint8)
    if kv_format == "fp8_ds_mla" and (cache.stride(0) % 4 or cache.stride(1) % 4):
        raise ValueError(
            f"fp8_ds_mla cache strides must be multiples of 4 bytes, got {cache.stride()}"
        )
    if k_scale is not None and (
        not isinstance(k_scale, torch.Tensor)
        or k_scale.numel() != 1
        or k_scale.dtype != torch.float32
    ):
        raise TypeError(f"k_scale must be a 1-element float32 tensor, got {_shape(k_scale)}")
    from .launch import launch_write_mla_cache

    launch_write_mla_cache(
        kv_c, k_pe, slot_mapping, cache, kv_format, k_scale if kv_format == "fp8" else None
    )
