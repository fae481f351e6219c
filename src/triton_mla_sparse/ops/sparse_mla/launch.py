"""Grid and argument plumbing for the sparse MLA kernels (imported lazily by the interface)."""

from __future__ import annotations

import torch

from .heuristics import KernelConfig, split_len_for
from .kernels import sparse_mla_fwd_kernel, sparse_mla_merge_kernel


def _shift(n: int) -> int:
    """log2(n) for a power of two, else -1 (general division in the kernel)."""
    return n.bit_length() - 1 if n > 0 and n & (n - 1) == 0 else -1


def _cache_geometry(kv_cache: torch.Tensor) -> tuple[int, int, int, int, int]:
    """(num_rows, page_size, stride_block, stride_row, stride_col) of a flat or paged cache."""
    if kv_cache.dim() == 2:
        return kv_cache.shape[0], 1, kv_cache.stride(0), 0, kv_cache.stride(1)
    nb, page, _ = kv_cache.shape
    return nb * page, page, kv_cache.stride(0), kv_cache.stride(1), kv_cache.stride(2)


def launch_sparse_mla(
    q_lat: torch.Tensor,
    q_rope: torch.Tensor | None,
    kv_cache: torch.Tensor,
    indices: torch.Tensor,
    valid_counts: torch.Tensor | None,
    block_table: torch.Tensor | None,
    req_ids: torch.Tensor | None,
    bt_block_size: int,
    k_scale_ptr: torch.Tensor | None,
    k_scale_val: float,
    out: torch.Tensor,
    lse: torch.Tensor | None,
    softmax_scale: float,
    kv_format: int,
    fp8_native: bool,
    pdl: bool,
    cfg: KernelConfig,
) -> None:
    if cfg.idx_ahead and block_table is not None:
        # KernelConfig.idx_ahead: no step-ahead loop through a block table (the interface
        # refuses such a config; the heuristics never choose it)
        raise ValueError(f"{cfg} has idx_ahead=True, which a block-table launch cannot run")
    T, H, L = q_lat.shape
    R = 0 if q_rope is None else q_rope.shape[-1]
    W = indices.shape[1]
    num_rows, page, s_kb, s_kr, s_kd = _cache_geometry(kv_cache)
    split_len, num_splits = split_len_for(W, cfg.num_splits, cfg.block_n)
    num_hb = -(-H // cfg.block_h)
    split = num_splits > 1
    pdl = pdl and split
    dummy = indices
    q_r = q_rope if q_rope is not None else q_lat
    if split:
        o_part = torch.empty((T, num_splits, H, L), dtype=torch.float32, device=out.device)
        lse_part = torch.empty((T, num_splits, H), dtype=torch.float32, device=out.device)
    else:
        o_part = lse_part = dummy
    bt = block_table if block_table is not None else dummy
    grid = (T * num_splits * num_hb,)
    sparse_mla_fwd_kernel[grid](
        q_lat,
        q_r,
        kv_cache,
        indices,
        valid_counts if valid_counts is not None else dummy,
        bt,
        req_ids if req_ids is not None else dummy,
        k_scale_ptr if k_scale_ptr is not None else dummy,
        out,
        lse if lse is not None else dummy,
        o_part,
        lse_part,
        softmax_scale,
        k_scale_val,
        H,
        W,
        num_rows,
        page,
        split_len,
        num_splits,
        num_hb,
        *q_lat.stride(),
        *q_r.stride(),
        s_kb,
        s_kr,
        s_kd,
        *indices.stride(),
        bt.stride(0) if block_table is not None else 0,
        bt.stride(1) if block_table is not None else 0,
        valid_counts.stride(0) if valid_counts is not None else 0,
        req_ids.stride(0) if req_ids is not None else 0,
        bt_block_size,
        bt.shape[1] if block_table is not None else 0,
        *out.stride(),
        L=L,
        R=R,
        BLOCK_H=cfg.block_h,
        BLOCK_N=cfg.block_n,
        KV_FORMAT=kv_format,
        FP8_NATIVE=fp8_native,
        MMA_FP16=kv_format != 0 and q_lat.dtype != torch.float32 and cfg.fp16_mma is not False,
        DS_STAGE=cfg.stage_dequant,
        HAS_COUNTS=valid_counts is not None,
        HAS_BT=block_table is not None,
        BT_SHIFT=_shift(bt_block_size),
        PAGE_SHIFT=_shift(page),
        K_SCALE_PTR=k_scale_ptr is not None,
        SPLIT=split,
        STORE_LSE=lse is not None,
        DOT_PRECISION="ieee" if q_lat.dtype == torch.float32 else "tf32",
        IDX_AHEAD=cfg.idx_ahead,
        PDL=pdl,
        num_warps=cfg.num_warps,
        num_stages=cfg.num_stages,
    )
    if split:
        s_pad = 1 << (num_splits - 1).bit_length()
        block_l = max(64, min(L, 4096 // s_pad))
        sparse_mla_merge_kernel[(T * H, -(-L // block_l))](
            o_part,
            lse_part,
            out,
            lse if lse is not None else dummy,
            H,
            num_splits,
            *out.stride(),
            L=L,
            S_PAD=s_pad,
            BLOCK_L=block_l,
            STORE_LSE=lse is not None,
            PDL=pdl,
            num_warps=4,
            **({"launch_pdl": True} if pdl else {}),
        )
