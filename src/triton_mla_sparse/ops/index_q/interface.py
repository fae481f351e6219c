"""Host wrapper for the index-query step: validate, allocate, launch. No GPU work at import."""

from __future__ import annotations

import torch

from ..host import describe as _shape
from ..host import is_pow2 as _is_pow2

_FLOAT_DTYPES = (torch.float16, torch.bfloat16, torch.float32)


def _check_float(name: str, x: object, ndim: int, device: torch.device) -> torch.Tensor:
    if not isinstance(x, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {_shape(x)}")
    if x.dtype not in _FLOAT_DTYPES:
        raise TypeError(f"{name} must be float16/bfloat16/float32, got {_shape(x)}")
    if x.dim() != ndim:
        raise ValueError(f"{name} must be {ndim}-D, got {_shape(x)}")
    if x.device != device:
        raise ValueError(f"{name} must be on {device} like q_pe, got {_shape(x)}")
    if x.shape[-1] > 1 and x.stride(-1) != 1:
        raise ValueError(f"{name} must have unit stride in its last dimension, got {x.stride()}")
    return x


def index_q_rope(
    positions: torch.Tensor,
    q_pe: torch.Tensor,
    q_pe_cos_sin_cache: torch.Tensor,
    index_q: torch.Tensor | None = None,
    index_q_cos_sin_cache: torch.Tensor | None = None,
    weights: torch.Tensor | None = None,
    weight_scale: float = 1.0,
    *,
    interleave: bool = False,
    emulate_fp8: bool = False,
    q_pe_out: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor | None]:
    """The DSA query step before the indexer and attention, in one launch, without fp8 types.

    Shapes (T tokens, H query heads, R = rope dims, Hi index heads, Di index head dim):

    - ``positions``: int32/int64 ``[T]``, rows of the cos/sin caches.
    - ``q_pe``: ``[T, H, R]`` fp16/bf16/fp32 (unit last stride), the MLA query's rope part.
      Rotated with interleaved pairs ``(2i, 2i+1)`` by ``q_pe_cos_sin_cache [P, R]``
      (cos in ``[0, R/2)``, sin in ``[R/2, R)``), as vLLM's MLA rope. R/2 a power of two.
    - ``index_q``: ``[T, Hi, Di]`` or None (a layer without an indexer). Its first
      ``index_q_cos_sin_cache.shape[1]`` dims are rotated, NeoX pairs ``(i, i + half)`` or, with
      ``interleave``, ``(2i, 2i+1)``; the rest pass through. Di a power of two.
    - ``weights``: ``[T, Hi]``, any float dtype; the output weights are float32
      ``weights * weight_scale`` (vLLM: ``softmax_scale * Hi**-0.5``).
    - ``emulate_fp8``: also reproduce vLLM's SM90 e4m3 quantisation of the index query (a
      power-of-two scale ``2^ceil(log2(max(amax, 1e-4) / 448))`` per (token, head); values
      rounded to the e4m3 grid, ties to even, stored unscaled; the scale folded into the weight).

    Returns ``(q_pe_rotated [T, H, R] in q_pe's dtype, index_q_rotated [T, Hi, Di] in index_q's
    dtype or None, weights_out float32 [T, Hi] or None)``. No host synchronisation; outputs are
    allocated from the shapes alone. ``q_pe_out`` (``[T, H, R]``, q_pe's dtype) is written when
    given.
    """
    if not isinstance(q_pe, torch.Tensor):
        raise TypeError(f"q_pe must be a torch.Tensor, got {_shape(q_pe)}")
    dev = q_pe.device
    _check_float("q_pe", q_pe, 3, dev)
    T, H, R = q_pe.shape
    if not isinstance(positions, torch.Tensor) or positions.dtype not in (torch.int32, torch.int64):
        raise TypeError(f"positions must be an int32/int64 tensor, got {_shape(positions)}")
    if positions.dim() != 1 or positions.shape[0] != T or positions.device != dev:
        raise ValueError(f"positions must be [T={T}] on {dev}, got {_shape(positions)}")
    _check_float("q_pe_cos_sin_cache", q_pe_cos_sin_cache, 2, dev)
    if q_pe_cos_sin_cache.shape[1] != R or not _is_pow2(R // 2) or R % 2:
        raise ValueError(
            f"q_pe_cos_sin_cache must be [P, R={R}] with R/2 a power of two; got q_pe "
            f"{_shape(q_pe)} and cache {_shape(q_pe_cos_sin_cache)}"
        )
    if q_pe_out is None:
        q_pe_out = torch.empty_like(q_pe)
    else:
        _check_float("q_pe_out", q_pe_out, 3, dev)
        if q_pe_out.shape != q_pe.shape or q_pe_out.dtype != q_pe.dtype:
            raise ValueError(f"q_pe_out must match q_pe {_shape(q_pe)}, got {_shape(q_pe_out)}")
    index_q_out = weights_out = None
    if index_q is not None:
        _check_float("index_q", index_q, 3, dev)
        if index_q.shape[0] != T:
            raise ValueError(f"index_q must be [T={T}, Hi, Di], got {_shape(index_q)}")
        Hi, Di = index_q.shape[1], index_q.shape[2]
        if not _is_pow2(Di):
            raise ValueError(f"index_q's head dim must be a power of two, got {_shape(index_q)}")
        _check_float("index_q_cos_sin_cache", index_q_cos_sin_cache, 2, dev)
        rot = index_q_cos_sin_cache.shape[1]
        if rot % 2 or not _is_pow2(rot // 2) or rot > Di:
            raise ValueError(
                f"index_q_cos_sin_cache must be [P, rot] with rot/2 a power of two and rot <= "
                f"Di={Di}; got {_shape(index_q_cos_sin_cache)}"
            )
        if not isinstance(weights, torch.Tensor) or not weights.dtype.is_floating_point:
            raise TypeError(f"weights must be a float tensor [T, Hi], got {_shape(weights)}")
        if tuple(weights.shape) != (T, Hi) or weights.device != dev:
            raise ValueError(f"weights must be [T={T}, Hi={Hi}] on {dev}, got {_shape(weights)}")
        index_q_out = torch.empty_like(index_q, memory_format=torch.contiguous_format)
        weights_out = torch.empty((T, Hi), dtype=torch.float32, device=dev)
    from .launch import launch_index_q_rope

    launch_index_q_rope(
        positions,
        q_pe,
        q_pe_cos_sin_cache,
        q_pe_out,
        index_q,
        index_q_cos_sin_cache,
        index_q_out,
        weights,
        weights_out,
        float(weight_scale),
        bool(interleave),
        bool(emulate_fp8),
    )
    return q_pe_out, index_q_out, weights_out
