"""Host wrappers of the DSA lightning-indexer logits: validate, allocate, launch.

No GPU work at import; no host synchronisation and no data-dependent allocation in the call path
(vLLM captures these calls in CUDA graphs). Semantics are vLLM 0.33's DeepGEMM wrappers
``fp8_fp4_paged_mqa_logits`` / ``fp8_fp4_mqa_logits`` (``vllm/utils/deep_gemm.py``).
"""

from __future__ import annotations

import torch

from ...kv_format import INDEXER_BLOCK_SIZE, INDEXER_HEAD_DIM, INDEXER_ROW_BYTES
from ..host import check_runs_here
from ..host import describe as _shape
from .heuristics import (
    MAX_HEADS,
    IndexerConfig,
    arch_of,
    choose_mqa_config,
    choose_paged_config,
)

_E4M3_DTYPES = (torch.uint8, torch.float8_e4m3fn)
_Q_DTYPES = _E4M3_DTYPES + (torch.float16, torch.bfloat16, torch.float32)
_W_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


def _tensor(name: str, x: object) -> torch.Tensor:
    if not isinstance(x, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {_shape(x)}")
    return x


def _same_device(name: str, x: torch.Tensor, device: torch.device) -> None:
    if x.device != device:
        raise ValueError(f"{name} must be on {device} like q, got {_shape(x)}")


def _check_int32(name: str, x: object, ndims: tuple[int, ...], device: torch.device) -> None:
    x = _tensor(name, x)
    if x.dtype != torch.int32:
        raise TypeError(f"{name} must be int32, got {_shape(x)}")
    if x.dim() not in ndims:
        raise ValueError(f"{name} must be {' or '.join(f'{n}-D' for n in ndims)}, got {_shape(x)}")
    _same_device(name, x, device)


def _check_q(q: object, ndim: int, layout: str) -> torch.Tensor:
    q = _tensor("q", q)
    if q.dtype not in _Q_DTYPES:
        raise TypeError(
            f"q must be e4m3 (float8_e4m3fn or uint8 bytes) or fp16/bf16/fp32, got {_shape(q)}"
        )
    if q.dim() != ndim:
        raise ValueError(f"q must be {ndim}-D {layout}, got {_shape(q)}")
    if q.shape[-1] != INDEXER_HEAD_DIM:
        raise ValueError(f"q's head dim must be {INDEXER_HEAD_DIM}, got {_shape(q)}")
    H = q.shape[-2]
    if not 1 <= H <= MAX_HEADS:
        raise ValueError(f"q must have 1 to {MAX_HEADS} heads, got {_shape(q)}")
    check_runs_here(
        f"the indexer (q {_shape(q)})", q.device, "use triton_mla_sparse.reference on CPU"
    )
    return q


def _check_weights(weights: object, rows: int, H: int, device: torch.device) -> torch.Tensor:
    weights = _tensor("weights", weights)
    if weights.dtype not in _W_DTYPES:
        raise TypeError(f"weights must be float32 (or bf16/fp16), got {_shape(weights)}")
    if tuple(weights.shape) != (rows, H):
        raise ValueError(f"weights must be [{rows}, {H}], got {_shape(weights)}")
    _same_device("weights", weights, device)
    return weights


def _check_max_len(name: str, v: object) -> int:
    if isinstance(v, bool) or not isinstance(v, int):
        raise TypeError(f"{name} must be an int, got {type(v).__name__}")
    if v < 0:
        raise ValueError(f"{name} must be >= 0, got {v}")
    return v


def _output(out: object, rows: int, width: int, device: torch.device) -> torch.Tensor:
    if out is None:
        return torch.empty((rows, width), dtype=torch.float32, device=device)
    out = _tensor("out", out)
    if out.dtype != torch.float32 or tuple(out.shape) != (rows, width):
        raise ValueError(f"out must be float32 [{rows}, {width}], got {_shape(out)}")
    _same_device("out", out, device)
    return out


def _as_bytes(x: torch.Tensor) -> torch.Tensor:
    return x.view(torch.uint8) if x.dtype == torch.float8_e4m3fn else x


def _check_config(cfg: IndexerConfig, H: int) -> None:
    from .heuristics import MAX_DOT_N, block_h_for

    def pow2(n: object) -> bool:
        return isinstance(n, int) and n > 0 and n & (n - 1) == 0

    ok = (
        pow2(cfg.rows)
        and pow2(cfg.block_n)
        and cfg.block_n >= 16
        and isinstance(cfg.chunk, int)
        and cfg.chunk >= 1
        and cfg.rows * block_h_for(H) <= MAX_DOT_N
        and pow2(cfg.num_warps)
        and isinstance(cfg.num_stages, int)
        and cfg.num_stages >= 1
    )
    if not ok:
        raise ValueError(
            "config needs power-of-two rows, block_n >= 16 and num_warps, chunk >= 1, "
            f"num_stages >= 1 and rows * padded heads <= {MAX_DOT_N}; got {cfg} for H={H}"
        )


def _flags(q: torch.Tensor, cfg: IndexerConfig) -> tuple[bool, bool]:
    """(native e4m3 decode, e4m3 x e4m3 dots) for this call; a config that asks for what the
    target or q cannot do is refused before launch, never silently changed."""
    arch = arch_of(q.device)
    if cfg.fp8_native and not arch.fp8_native:
        raise ValueError(
            f"config.fp8_native=True needs hardware e4m3 conversion (CUDA sm89+); {arch.backend} "
            f"{arch.cc} decodes e4m3 with integer arithmetic (leave fp8_native None or False)"
        )
    native = arch.fp8_native if cfg.fp8_native is None else cfg.fp8_native
    q_fp8 = q.dtype in _E4M3_DTYPES
    if cfg.fp8_mma and not (q_fp8 and native):
        raise ValueError(
            "config.fp8_mma=True needs e4m3 q and the native e4m3 decode, got "
            f"q {_shape(q)} with fp8_native={native} (leave fp8_mma None or False)"
        )
    return native, cfg.fp8_mma is not False


def paged_mqa_logits(
    q: torch.Tensor,
    kv_cache: torch.Tensor,
    weights: torch.Tensor,
    context_lens: torch.Tensor,
    block_table: torch.Tensor,
    max_model_len: int,
    *,
    out: torch.Tensor | None = None,
    config: IndexerConfig | None = None,
) -> torch.Tensor:
    """Decode logits of the DSA lightning indexer over a paged fp8 K cache.

    ``logit[b * next_n + j, p] = scale[p] * sum_h weights[b * next_n + j, h] * ReLU(q[b, j, h] . k[p])``
    with fp32 accumulation, where ``k[p]`` / ``scale[p]`` are token ``p % 64`` of block
    ``block_table[b, p // 64]``.

    Args:
        q: ``[B, next_n, H, 128]``: e4m3 (``torch.float8_e4m3fn``, or its bytes as ``uint8``; vLLM
            folds q's scale into ``weights``) or fp16/bf16/fp32. Any strides. ``1 <= H <= 128``.
        kv_cache: ``uint8 [num_blocks, 64, 1, 132]`` or ``[num_blocks, 64 * 132]``, vLLM's CUDA
            indexer layout: per block 64 x 128 e4m3 values (token-major), then 64 float32 scales.
            Block stride ``stride(0)`` may exceed ``64 * 132`` (a multiple of 4); each block must
            be contiguous. Block size 64 only.
        weights: ``[B * next_n, H]`` float32 (bf16/fp16 accepted), any strides.
        context_lens: int32 ``[B]`` (row ``(b, j)`` covers positions
            ``[0, context_lens[b] - next_n + j + 1)``) or ``[B, next_n]`` (row ``(b, j)`` covers
            ``[0, context_lens[b, j])``). Lengths are clamped to ``[0, max_model_len]``.
        block_table: int32 ``[B, max_blocks]``, physical block of each 64-token logical block.
        max_model_len: width of the output (python int).
        out: optional preallocated float32 ``[B * next_n, max_model_len]`` (any strides).
        config: optional :class:`IndexerConfig` overriding the heuristic launch.

    Returns:
        float32 ``[B * next_n, max_model_len]``. Columns at or past a row's length are not written
        (as DeepGEMM: an ``out`` keeps its old values there). Positions past the block table or
        whose table entry lies outside ``[0, num_blocks)`` are neither read nor written.
        An e4m3 NaN byte (0x7F/0xFF, which vLLM's quantiser never writes) gives an unspecified
        value: NaN products under the native decode, +-480 under the integer decode (sm80/86, AMD).
    """
    q = _check_q(q, 4, "[B, next_n, H, 128]")
    B, next_n, H, _ = q.shape
    device = q.device
    max_model_len = _check_max_len("max_model_len", max_model_len)
    kv_cache = _tensor("kv_cache", kv_cache)
    if kv_cache.dtype not in _E4M3_DTYPES:
        raise TypeError(f"kv_cache must be uint8 (vLLM's indexer cache), got {_shape(kv_cache)}")
    _same_device("kv_cache", kv_cache, device)
    if kv_cache.dim() == 4:
        if kv_cache.shape[2] != 1 or kv_cache.shape[3] != INDEXER_ROW_BYTES:
            raise ValueError(
                f"kv_cache must be [num_blocks, block_size, 1, {INDEXER_ROW_BYTES}], got {_shape(kv_cache)}"
            )
        block_size = kv_cache.shape[1]
        inner = kv_cache.stride(3) == 1 and (
            block_size == 1 or kv_cache.stride(1) == INDEXER_ROW_BYTES
        )
    elif kv_cache.dim() == 2:
        if kv_cache.shape[1] % INDEXER_ROW_BYTES:
            raise ValueError(
                f"kv_cache [num_blocks, block_size * {INDEXER_ROW_BYTES}] needs a width that is a "
                f"multiple of {INDEXER_ROW_BYTES}, got {_shape(kv_cache)}"
            )
        block_size = kv_cache.shape[1] // INDEXER_ROW_BYTES
        inner = kv_cache.stride(1) == 1
    else:
        raise ValueError(
            f"kv_cache must be [num_blocks, 64, 1, {INDEXER_ROW_BYTES}] or "
            f"[num_blocks, 64 * {INDEXER_ROW_BYTES}], got {_shape(kv_cache)}"
        )
    if block_size != INDEXER_BLOCK_SIZE:
        raise ValueError(
            f"kv_cache block size must be {INDEXER_BLOCK_SIZE}, got {block_size} ({_shape(kv_cache)})"
        )
    if not inner or kv_cache.stride(0) % 4:
        raise ValueError(
            "kv_cache blocks must be contiguous with a block stride that is a multiple of 4 "
            f"(float32 scales), got {_shape(kv_cache)} with strides {tuple(kv_cache.stride())}"
        )
    weights = _check_weights(weights, B * next_n, H, device)
    _check_int32("context_lens", context_lens, (1, 2), device)
    if context_lens.shape[0] != B or (context_lens.dim() == 2 and context_lens.shape[1] != next_n):
        raise ValueError(
            f"context_lens must be [B={B}] or [B={B}, next_n={next_n}], got {_shape(context_lens)} "
            f"(q {_shape(q)})"
        )
    _check_int32("block_table", block_table, (2,), device)
    if block_table.shape[0] != B:
        raise ValueError(
            f"block_table must be [B={B}, max_blocks], got {_shape(block_table)} (q {_shape(q)})"
        )
    out = _output(out, B * next_n, max_model_len, device)
    if B == 0 or max_model_len == 0 or block_table.shape[1] == 0:
        return out

    # Triton import deferred: nothing compiles at import
    from .launch import launch_paged_mqa_logits

    cfg = config or choose_paged_config(B, next_n, H, q.dtype, arch_of(device))
    _check_config(cfg, H)
    native, mma = _flags(q, cfg)
    nb = kv_cache.shape[0]
    blocks = torch.as_strided(
        _as_bytes(kv_cache), (nb, block_size * INDEXER_ROW_BYTES), (kv_cache.stride(0), 1)
    )
    launch_paged_mqa_logits(
        _as_bytes(q), blocks, weights, context_lens, block_table, out, block_size, native, mma, cfg
    )
    return out


def mqa_logits(
    q: torch.Tensor,
    k: torch.Tensor,
    k_scale: torch.Tensor,
    weights: torch.Tensor,
    cu_seqlen_ks: torch.Tensor,
    cu_seqlen_ke: torch.Tensor,
    max_seqlen_k: int,
    *,
    out: torch.Tensor | None = None,
    config: IndexerConfig | None = None,
) -> torch.Tensor:
    """Prefill logits of the DSA lightning indexer over gathered fp8 K rows ("compressed").

    ``logit[m, j] = k_scale[s] * sum_h weights[m, h] * ReLU(q[m, h] . k[s])`` with
    ``s = cu_seqlen_ks[m] + j``, fp32 accumulation.

    Args:
        q: ``[M, H, 128]``: e4m3 (``float8_e4m3fn`` or ``uint8`` bytes) or fp16/bf16/fp32, any
            strides, ``1 <= H <= 128``.
        k: ``[N, 128]`` e4m3 (``float8_e4m3fn`` or ``uint8``), any strides.
        k_scale: float32 ``[N]`` (or ``[N, 1]``; or the ``uint8 [N, 4]`` bytes vLLM gathers).
        weights: ``[M, H]`` float32 (bf16/fp16 accepted), any strides.
        cu_seqlen_ks, cu_seqlen_ke: int32 ``[M]``: row ``m`` covers K rows ``[ks[m], ke[m])``.
        max_seqlen_k: width of the output (python int), an upper bound on ``ke - ks``.
        out: optional preallocated float32 ``[M, max_seqlen_k]`` (any strides).
        config: optional :class:`IndexerConfig` overriding the heuristic launch.

    Returns:
        float32 ``[M, max_seqlen_k]``: column ``j < min(ke - ks, max_seqlen_k)`` of row ``m`` is K
        row ``ks[m] + j``; later columns are not written (as DeepGEMM), nor are columns whose K row
        lies outside ``[0, N)`` (never read). e4m3 NaN bytes: as :func:`paged_mqa_logits`.
    """
    q = _check_q(q, 3, "[M, H, 128]")
    M, H, _ = q.shape
    device = q.device
    max_seqlen_k = _check_max_len("max_seqlen_k", max_seqlen_k)
    k = _tensor("k", k)
    if k.dtype not in _E4M3_DTYPES:
        raise TypeError(f"k must be e4m3 (float8_e4m3fn or uint8), got {_shape(k)}")
    if k.dim() != 2 or k.shape[1] != INDEXER_HEAD_DIM:
        raise ValueError(f"k must be [N, {INDEXER_HEAD_DIM}], got {_shape(k)}")
    _same_device("k", k, device)
    N = k.shape[0]
    k_scale = _tensor("k_scale", k_scale)
    if k_scale.dtype == torch.uint8 and k_scale.dim() == 2 and k_scale.shape[1] == 4:
        if k_scale.stride(1) != 1 or k_scale.stride(0) % 4:
            raise ValueError(f"k_scale bytes [N, 4] must be contiguous rows, got {_shape(k_scale)}")
        k_scale = k_scale.view(torch.float32)
    if k_scale.dtype != torch.float32:
        raise TypeError(
            f"k_scale must be float32 [N] (or uint8 [N, 4] bytes), got {_shape(k_scale)}"
        )
    if k_scale.dim() == 2 and k_scale.shape[1] == 1:
        k_scale = k_scale[:, 0]
    if k_scale.dim() != 1 or k_scale.shape[0] != N:
        raise ValueError(f"k_scale must be [N={N}] like k, got {_shape(k_scale)}")
    _same_device("k_scale", k_scale, device)
    weights = _check_weights(weights, M, H, device)
    for name, x in (("cu_seqlen_ks", cu_seqlen_ks), ("cu_seqlen_ke", cu_seqlen_ke)):
        _check_int32(name, x, (1,), device)
        if x.shape[0] != M:
            raise ValueError(f"{name} must be [M={M}] like q, got {_shape(x)}")
    out = _output(out, M, max_seqlen_k, device)
    if M == 0 or N == 0 or max_seqlen_k == 0:
        return out

    from .launch import launch_mqa_logits

    cfg = config or choose_mqa_config(M, N, H, q.dtype, arch_of(device))
    _check_config(cfg, H)
    native, mma = _flags(q, cfg)
    launch_mqa_logits(
        _as_bytes(q),
        _as_bytes(k),
        k_scale,
        weights,
        cu_seqlen_ks,
        cu_seqlen_ke,
        out,
        native,
        mma,
        cfg,
    )
    return out
