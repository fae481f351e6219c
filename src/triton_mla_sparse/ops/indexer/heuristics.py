"""Launch configurations of the indexer logits kernels: a static function of (shape, arch).

No autotuning: the choice depends only on what a CUDA graph captures (rows, next_n, heads, the
output width, q's dtype), never on the context lengths, so a captured shape replays the kernel it
was warmed with. These are first choices from the design (memory floor, MMA shape, shared memory);
benchmarks/perf/indexer_gpu.py measures them and ``IndexerConfig`` overrides them for sweeps.
"""

from __future__ import annotations

import dataclasses

import torch

from ..target import SMEM_LARGE_CLASS, TARGETS, Arch, arch_of

__all__ = [
    "TARGETS",
    "Arch",
    "IndexerConfig",
    "arch_of",
    "block_h_for",
    "choose_mqa_config",
    "choose_paged_config",
]

MAX_HEADS = 128
# MMA tiles need N >= 16 and the head-reduction is along N: ROWS * BLOCK_H columns per dot.
MIN_BLOCK_H = 16
MAX_DOT_N = 256


@dataclasses.dataclass(frozen=True)
class IndexerConfig:
    """How one logits call is launched.

    ``rows``: logits rows per program (decode: rows of one request, so K is read once for all its
    next_n rows; prefill: consecutive query rows); ``block_n``: K tokens per step; ``chunk``: K
    tokens per program (a multiple of ``block_n``); ``fp8_native`` None = the architecture's
    choice, False forces the integer e4m3 decode (sm80's path); ``fp8_mma`` None = e4m3 x e4m3
    dots when q is e4m3 and the decode is native, False decodes K (and q) to fp16 first.
    """

    rows: int
    block_n: int
    chunk: int
    num_warps: int
    num_stages: int
    fp8_native: bool | None = None
    fp8_mma: bool | None = None


def block_h_for(num_heads: int) -> int:
    """Heads padded to a power of two >= 16 (padding heads get weight 0, never stored)."""
    return max(MIN_BLOCK_H, 1 << (num_heads - 1).bit_length())


def _pow2_floor(n: int) -> int:
    return 1 << (max(1, n).bit_length() - 1)


def _small_smem(arch: Arch) -> bool:
    return arch.backend == "hip" or arch.smem_bytes < SMEM_LARGE_CLASS


def choose_paged_config(
    batch: int, next_n: int, num_heads: int, q_dtype: torch.dtype, arch: Arch
) -> IndexerConfig:
    """Decode logits: one program per (request, group of its rows, chunk of context).

    All next_n rows of a request share a program while ``rows * BLOCK_H <= 128`` (one dot of N =
    next_n * H against each K tile). The chunk is sized from the number of row groups alone
    (the context length is data): about 4 programs per SM over a 32K context, at least two
    steps and at most 2048 tokens per program. Accumulators stay at <= 64 x 128 or 128 x 64
    fp32 (64 registers a thread at 4 warps).
    """
    bh = block_h_for(num_heads)
    rows = min(max(1, 128 // bh), 1 << (next_n - 1).bit_length())  # next_n 3 -> 4 (one masked)
    groups = batch * -(-next_n // rows)
    wide = q_dtype == torch.float32
    block_n = 32 if wide else 64
    if not wide and not _small_smem(arch) and rows * bh <= 64:
        block_n = 128  # <= 64 columns (H <= 32, or next_n 2 x 32): half the steps per token
    per_32k = max(1, 4 * arch.num_sms // groups)  # programs wanted per request over 32K tokens
    chunk = max(2 * block_n, min(2048, _pow2_floor(32768 // per_32k)))
    chunk = max(chunk, block_n)
    stages = 2 if (wide or _small_smem(arch)) else 3
    return IndexerConfig(rows, block_n, chunk, 4, stages)


def choose_mqa_config(
    num_rows: int, num_k: int, num_heads: int, q_dtype: torch.dtype, arch: Arch
) -> IndexerConfig:
    """Prefill logits: one program per (``rows`` query rows, chunk of K rows), K read once per
    row block. ``rows * BLOCK_H`` = 128 (H=64: 2 rows, H=32: 4 rows) balances K reuse against
    the accumulator's registers."""
    bh = block_h_for(num_heads)
    wide = q_dtype == torch.float32
    rows = max(1, (64 if wide else 128) // bh)
    block_n = 32 if wide else 64
    chunk = 4096 if num_rows >= 1024 else 1024
    warps = 8 if rows * bh * block_n >= 128 * 64 else 4
    stages = 2 if (wide or _small_smem(arch)) else 3
    return IndexerConfig(rows, block_n, chunk, warps, stages)
