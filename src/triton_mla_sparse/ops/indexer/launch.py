"""Grid and argument plumbing for the indexer logits kernels (imported lazily by the interface)."""

from __future__ import annotations

import torch

from ...kv_format import INDEXER_HEAD_DIM
from .heuristics import IndexerConfig, block_h_for
from .kernels import mqa_logits_kernel, paged_mqa_logits_kernel

_Q_FP8_DTYPES = (torch.uint8, torch.float8_e4m3fn)


def _dot_flags(q: torch.Tensor, fp8_native: bool, fp8_mma: bool) -> dict:
    q_fp8 = q.dtype in _Q_FP8_DTYPES
    return dict(
        Q_FP8=q_fp8,
        FP8_NATIVE=fp8_native,
        FP8_MMA=q_fp8 and fp8_native and fp8_mma,
        # fp32 q: exact products of the (exactly decoded) e4m3 K; otherwise fp16/bf16/fp8 MMA
        DOT_PRECISION="ieee" if q.dtype == torch.float32 else "tf32",
    )


def launch_paged_mqa_logits(
    q: torch.Tensor,
    kv_blocks: torch.Tensor,
    weights: torch.Tensor,
    context_lens: torch.Tensor,
    block_table: torch.Tensor,
    out: torch.Tensor,
    page: int,
    fp8_native: bool,
    fp8_mma: bool,
    cfg: IndexerConfig,
) -> None:
    """``q`` [B, next_n, H, D] (uint8 for e4m3), ``kv_blocks`` uint8 [num_blocks, page * 132]."""
    B, next_n, H, D = q.shape
    max_len = out.shape[1]
    ctx_2d = context_lens.dim() == 2
    grid = (B, -(-next_n // cfg.rows), -(-max_len // cfg.chunk))
    paged_mqa_logits_kernel[grid](
        q,
        kv_blocks,
        weights,
        context_lens,
        block_table,
        out,
        next_n,
        H,
        kv_blocks.shape[0],
        block_table.shape[1],
        max_len,
        cfg.chunk,
        *q.stride(),
        kv_blocks.stride(0),
        *weights.stride(),
        context_lens.stride(0),
        context_lens.stride(1) if ctx_2d else 0,
        *block_table.stride(),
        *out.stride(),
        D=INDEXER_HEAD_DIM,
        PAGE=page,
        ROWS=cfg.rows,
        BLOCK_H=block_h_for(H),
        BLOCK_N=cfg.block_n,
        CTX_2D=ctx_2d,
        NUM_STAGES=cfg.num_stages,
        num_warps=cfg.num_warps,
        **_dot_flags(q, fp8_native, fp8_mma),
    )


def launch_mqa_logits(
    q: torch.Tensor,
    k: torch.Tensor,
    k_scale: torch.Tensor,
    weights: torch.Tensor,
    cu_seqlen_ks: torch.Tensor,
    cu_seqlen_ke: torch.Tensor,
    out: torch.Tensor,
    fp8_native: bool,
    fp8_mma: bool,
    cfg: IndexerConfig,
) -> None:
    """``q`` [M, H, D] (uint8 for e4m3), ``k`` uint8 [N, D], ``k_scale`` float32 [N]."""
    M, H, D = q.shape
    N = k.shape[0]
    grid = (-(-M // cfg.rows), -(-N // cfg.chunk))
    mqa_logits_kernel[grid](
        q,
        k,
        k_scale,
        weights,
        cu_seqlen_ks,
        cu_seqlen_ke,
        out,
        M,
        N,
        H,
        out.shape[1],
        cfg.chunk,
        *q.stride(),
        *k.stride(),
        k_scale.stride(0),
        *weights.stride(),
        *out.stride(),
        D=INDEXER_HEAD_DIM,
        ROWS=cfg.rows,
        BLOCK_H=block_h_for(H),
        BLOCK_N=cfg.block_n,
        NUM_STAGES=cfg.num_stages,
        num_warps=cfg.num_warps,
        **_dot_flags(q, fp8_native, fp8_mma),
    )
