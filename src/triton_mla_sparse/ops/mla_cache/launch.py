"""Grid and arguments for the MLA cache writer (imported lazily by the interface)."""

from __future__ import annotations

import torch

from .kernels import mla_cache_write_kernel

FORMAT_CODE = {"fp8": 1, "fp8_ds_mla": 2}
DS_MLA_TILE = 128  # latent values per fp8_ds_mla scale


def launch_write_mla_cache(
    kv_c: torch.Tensor,
    k_pe: torch.Tensor,
    slot_mapping: torch.Tensor,
    cache_u8: torch.Tensor,
    kv_format: str,
    k_scale: torch.Tensor | None,
) -> None:
    n = slot_mapping.shape[0]
    if n == 0:
        return
    mla_cache_write_kernel[(n,)](
        kv_c,
        kv_c.stride(0),
        k_pe,
        k_pe.stride(0),
        slot_mapping,
        cache_u8,
        cache_u8.view(torch.float32) if kv_format == "fp8_ds_mla" else cache_u8,
        cache_u8.view(torch.bfloat16) if kv_format == "fp8_ds_mla" else cache_u8,
        cache_u8.stride(0),
        cache_u8.stride(1),
        cache_u8.shape[1],
        k_scale if k_scale is not None else slot_mapping,  # never read without HAS_SCALE
        KV_DIM=kv_c.shape[1],
        ROPE=k_pe.shape[1],
        FORMAT=FORMAT_CODE[kv_format],
        TILE=DS_MLA_TILE,
        HAS_SCALE=k_scale is not None,
        num_warps=4,
    )
