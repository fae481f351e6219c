"""Host wrapper for sparse MLA forward: validate, allocate, launch. No GPU work at import."""

from __future__ import annotations

import dataclasses
import inspect
import math
import numbers
from collections.abc import Mapping
from typing import Any

import torch

from ...kv_format import (
    DS_MLA_LATENT,
    DS_MLA_ROPE,
    DS_MLA_ROW_BYTES,
    DS_V4_TOKEN_BYTES,
    DS_V4_WIDTH,
    KV_FORMATS,
    REFERENCE_ONLY_KV_FORMATS,
)
from ..host import check_runs_here, interpreter_on
from ..host import describe as _shape
from ..host import is_pow2 as _is_pow2
from .heuristics import KernelConfig, arch_of
from .plan import LaunchPlan, cache_span, check_config, gluon_gathers_aligned, make_plan

_FLOAT_DTYPES = (torch.float16, torch.bfloat16, torch.float32)


def _real_number(name: str, x: object) -> float:
    """A finite Python or NumPy real number as a float. Tensors are refused: float() on a CUDA
    tensor is a host synchronisation, which this call promises not to do."""
    if isinstance(x, bool) or not isinstance(x, numbers.Real):
        if isinstance(x, torch.Tensor):
            what = f"a tensor {_shape(x)} (reading it would synchronise with the device)"
        else:
            what = f"a {type(x).__name__} ({x!r})"
        raise TypeError(f"{name} must be a Python or NumPy real number, got {what}")
    v = float(x)
    if not math.isfinite(v):
        raise ValueError(f"{name} must be finite, got {x!r}")
    return v


def _describe_q(q: object) -> str:
    """q as the caller passed it, for error messages."""
    if isinstance(q, (tuple, list)) and len(q) == 2:
        return f"(q_latent {_shape(q[0])}, q_rope {_shape(q[1])})"
    return _shape(q)


def _split_q(
    q: torch.Tensor | tuple[torch.Tensor, torch.Tensor], kv_lora_rank: int
) -> tuple[torch.Tensor, torch.Tensor | None]:
    if isinstance(q, list):
        raise TypeError(
            "q must be a tensor [T, H, D] or a tuple (q_latent [T, H, L], q_rope [T, H, R]), "
            f"got a list of {len(q)} elements"
        )
    if isinstance(q, tuple):
        if len(q) != 2:
            raise ValueError(
                "q as a tuple must be (q_latent [T, H, L], q_rope [T, H, R]), "
                f"got {len(q)} elements: {', '.join(_shape(x) for x in q)}"
            )
        if not all(isinstance(x, torch.Tensor) for x in q):
            raise TypeError(
                "q as a tuple must hold two tensors (q_latent [T, H, L], q_rope [T, H, R]), "
                f"got {_describe_q(q)}"
            )
        q_lat, q_rope = q
        if q_lat.dim() != 3 or q_rope.dim() != 3:
            raise ValueError(
                f"q_latent and q_rope must be 3-D [T, H, *], got {_shape(q_lat)} and {_shape(q_rope)}"
            )
        if q_lat.shape[:2] != q_rope.shape[:2]:
            raise ValueError(
                f"q_latent and q_rope disagree on [T, H]: {_shape(q_lat)} vs {_shape(q_rope)}"
            )
        if q_lat.dtype != q_rope.dtype or q_lat.device != q_rope.device:
            raise TypeError(
                f"q_latent and q_rope must share dtype and device: {_shape(q_lat)} vs {_shape(q_rope)}"
            )
        if q_lat.shape[-1] != kv_lora_rank:
            raise ValueError(
                f"q_latent must have last dimension kv_lora_rank={kv_lora_rank}, got {_shape(q_lat)}"
            )
        r = q_rope.shape[-1]
        if r and (not _is_pow2(r) or r < 16):
            raise ValueError(
                f"q_rope's last dimension (the rope width) must be 0 or a power of two >= 16, "
                f"got {_shape(q_rope)}"
            )
        return q_lat, (q_rope if r > 0 else None)
    if not isinstance(q, torch.Tensor):
        raise TypeError(f"q must be a tensor or a (q_latent, q_rope) tuple, got {type(q).__name__}")
    if q.dim() != 3:
        raise ValueError(f"q must be 3-D [T, H, D], got {_shape(q)}")
    if q.shape[-1] < kv_lora_rank:
        raise ValueError(
            f"q's last dimension must be >= kv_lora_rank={kv_lora_rank}, got {_shape(q)}"
        )
    r = q.shape[-1] - kv_lora_rank
    if r and (not _is_pow2(r) or r < 16):
        raise ValueError(
            f"q's last dimension D={q.shape[-1]} must be kv_lora_rank={kv_lora_rank} plus a rope "
            f"width of 0 or a power of two >= 16 (D - kv_lora_rank = {r}), got {_shape(q)}"
        )
    q_rope = q[..., kv_lora_rank:] if q.shape[-1] > kv_lora_rank else None
    return q[..., :kv_lora_rank], q_rope


def _check_int32(name: str, x: torch.Tensor | None, ndim: int, device: torch.device) -> None:
    if x is None:
        return
    if not isinstance(x, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(x).__name__}")
    if x.dtype != torch.int32:
        raise TypeError(f"{name} must be int32, got {_shape(x)}")
    if x.dim() != ndim:
        raise ValueError(f"{name} must be {ndim}-D, got {_shape(x)}")
    if x.device != device:
        raise ValueError(f"{name} must be on {device} like q, got {_shape(x)}")


def _resolve_format(kv_format: str, kv_cache: torch.Tensor, q_dtype: torch.dtype) -> str:
    if not isinstance(kv_format, str):
        raise TypeError(f"kv_format must be a str, one of {KV_FORMATS}, got {kv_format!r}")
    if kv_format in REFERENCE_ONLY_KV_FORMATS:
        # a layout kv_format.py packs and the reference reads, with no kernel path yet
        raise ValueError(
            f"kv_format={kv_format!r} is not read by the sparse_mla kernel yet (only by "
            "triton_mla_sparse.reference.sparse_mla_reference through kv_format.dequantize_cache); "
            f"the kernel reads kv_format one of {KV_FORMATS}"
        )
    if kv_format not in KV_FORMATS:
        raise ValueError(f"kv_format must be one of {KV_FORMATS}, got {kv_format!r}")
    _check_cache_dtype("kv_cache", kv_cache, kv_format, q_dtype)
    return kv_format


def _check_cache_dtype(name: str, cache: torch.Tensor, fmt: str, q_dtype: torch.dtype) -> None:
    if fmt == "auto":
        if cache.dtype != q_dtype:
            raise TypeError(
                f"kv_format='auto' needs {name} in q's dtype {q_dtype}, got {_shape(cache)}; "
                "pass kv_format='fp8' or 'fp8_ds_mla' for a quantized cache"
            )
    elif cache.dtype not in (torch.uint8, torch.float8_e4m3fn):
        raise TypeError(
            f"kv_format={fmt!r} needs a uint8 or float8_e4m3fn cache, got {_shape(cache)}"
        )


def _check_cache(
    name: str, cache: object, fmt: str, q_dtype: torch.dtype, width: int, device: torch.device
) -> None:
    """One cache (kv_cache or extra_kv_cache) against the call's format and q width L + R."""
    if not isinstance(cache, torch.Tensor):
        raise TypeError(f"{name} must be a tensor, got {_shape(cache)}")
    if cache.dim() not in (2, 3):
        raise ValueError(f"{name} must be [N, C] or [num_blocks, page, C], got {_shape(cache)}")
    if cache.device != device:
        raise ValueError(f"{name} must be on {device} like q, got {_shape(cache)}")
    _check_cache_dtype(name, cache, fmt, q_dtype)
    want = {"fp8_ds_mla": DS_MLA_ROW_BYTES, "fp8_ds_mla_v4": DS_V4_TOKEN_BYTES}.get(fmt, width)
    if cache.shape[-1] != want:
        raise ValueError(
            f"{name}'s last dimension must be {want} for kv_format={fmt!r} with q width {width}, "
            f"got {_shape(cache)}"
        )
    if fmt != "auto" and cache.stride(-1) != 1:
        raise ValueError(
            f"a {fmt} cache must have unit stride in its last dimension: {name} {_shape(cache)} "
            f"with strides {cache.stride()}"
        )
    num_rows = cache.shape[0] * (cache.shape[1] if cache.dim() == 3 else 1)
    if num_rows >= 2**31:
        raise ValueError(
            f"{name} holds {num_rows} rows ({_shape(cache)}); at most 2^31 - 1 are "
            "addressable by int32 indices"
        )
    if fmt == "fp8_ds_mla_v4":
        _check_v4_pages(name, cache)
    _check_record_alignment(name, cache, fmt)


# Byte alignment a scaled-record cache's address and row / page strides need: the kernels load
# fp8_ds_mla's fp32 scales (bytes 512-527 of each row) and the V4 record's bf16 RoPE values as
# whole words, which fault on a misaligned address.
RECORD_ALIGN = {"fp8_ds_mla": 4, "fp8_ds_mla_v4": 2}


def _check_record_alignment(name: str, cache: torch.Tensor, fmt: str) -> None:
    align = RECORD_ALIGN.get(fmt)
    if align is None:
        return
    offsets = (cache.data_ptr(), *cache.stride()[:-1])
    if any(x % align for x in offsets):
        raise ValueError(
            f"a {fmt} cache must start on a {align}-byte boundary with page and row strides in "
            f"multiples of {align} bytes (its scales / RoPE values are read as whole words): "
            f"{name} {_shape(cache)} with strides {cache.stride()} at address "
            f"{cache.data_ptr():#x}"
        )


def _check_v4_pages(name: str, cache: torch.Tensor) -> None:
    """A V4 record cache: uint8 [num_pages, P, 584] pages whose P * 584 bytes are contiguous
    (the kernel addresses data rows at slot * 576 and scale rows after them, from the page's
    first byte), as kv_format.ds_mla_v4_pages requires. Pages may be further apart (vLLM pads
    them to a multiple of 576 bytes, layers may share a page grid), never closer, and start on
    even bytes (the bf16 RoPE values)."""
    if cache.dim() != 3:
        raise ValueError(
            f"an fp8_ds_mla_v4 cache must be paged [num_pages, page, {DS_V4_TOKEN_BYTES}] (its "
            f"page's scale rows follow the page's data rows), got {name} {_shape(cache)}"
        )
    page = cache.shape[1]
    page_bytes = page * DS_V4_TOKEN_BYTES
    rows_ok = page == 1 or cache.stride(1) == DS_V4_TOKEN_BYTES
    pages_ok = cache.shape[0] <= 1 or cache.stride(0) >= page_bytes
    if not (rows_ok and pages_ok and cache.stride(0) % 2 == 0):
        raise ValueError(
            f"an fp8_ds_mla_v4 cache needs strides (S, {DS_V4_TOKEN_BYTES}, 1) with S even and "
            f">= page * {DS_V4_TOKEN_BYTES} = {page_bytes}: {name} {_shape(cache)} with strides "
            f"{cache.stride()}"
        )


@dataclasses.dataclass(frozen=True)
class _ExtraSet:
    """A validated extra index set (its cache viewed as uint8 where it was float8_e4m3fn)."""

    kv_cache: torch.Tensor
    indices: torch.Tensor
    valid_counts: torch.Tensor | None
    block_table: torch.Tensor | None


def _check_block_size(name: str, block_size: object) -> None:
    if isinstance(block_size, bool) or not isinstance(block_size, int):
        raise TypeError(f"{name} must be an int, got {block_size!r}")
    if block_size < 1:
        raise ValueError(f"{name} must be positive, got {block_size!r}")


def _check_extra(
    cache: torch.Tensor | None,
    indices: torch.Tensor | None,
    valid_counts: torch.Tensor | None,
    block_table: torch.Tensor | None,
    block_size: int | None,
    fmt: str,
    q_dtype: torch.dtype,
    width: int,
    T: int,
    device: torch.device,
    q_desc: str,
) -> _ExtraSet | None:
    """The extra index set's arguments (all None, or a cache and its indices at least)."""
    if cache is None and indices is None:
        rest = dict(
            extra_valid_counts=valid_counts,
            extra_block_table=block_table,
            extra_block_size=block_size,
        )
        given = [k for k, v in rest.items() if v is not None]
        if given:
            raise ValueError(
                f"{', '.join(given)} given without an extra set: pass extra_kv_cache and "
                "extra_indices too"
            )
        return None
    if (cache is None) != (indices is None):
        raise ValueError(
            "extra_kv_cache and extra_indices go together: got extra_kv_cache "
            f"{_shape(cache)}, extra_indices {_shape(indices)}"
        )
    _check_cache("extra_kv_cache", cache, fmt, q_dtype, width, device)
    _check_index_set("extra_", indices, valid_counts, T, device, q_desc)
    if (block_table is None) != (block_size is None):
        raise ValueError(
            "extra_block_table and extra_block_size go together: got extra_block_table "
            f"{_shape(block_table)}, extra_block_size {block_size!r}"
        )
    if block_table is not None:
        _check_int32("extra_block_table", block_table, 2, device)
        _check_block_size("extra_block_size", block_size)
    if cache.dtype == torch.float8_e4m3fn:
        cache = cache.view(torch.uint8)
    return _ExtraSet(cache, indices, valid_counts, block_table)


@dataclasses.dataclass(frozen=True)
class _Call:
    """A validated call: its plan (None when T == 0) and the launcher's arguments."""

    plan: LaunchPlan | None
    out_shape: tuple[int, int, int]
    dtype: torch.dtype
    device: torch.device
    q_lat: torch.Tensor
    q_rope: torch.Tensor | None
    kv_cache: torch.Tensor
    indices: torch.Tensor
    valid_counts: torch.Tensor | None
    block_table: torch.Tensor | None
    req_ids: torch.Tensor | None
    k_scale_ptr: torch.Tensor | None
    k_scale_val: float
    softmax_scale: float
    attn_sink: torch.Tensor | None
    extra: _ExtraSet | None


def _check_rank(kv_lora_rank: object) -> int:
    if isinstance(kv_lora_rank, bool) or not isinstance(kv_lora_rank, int):
        raise TypeError(f"kv_lora_rank must be an int, got {kv_lora_rank!r}")
    if not _is_pow2(kv_lora_rank) or kv_lora_rank < 16:
        raise ValueError(f"kv_lora_rank must be a power of two >= 16, got {kv_lora_rank!r}")
    return kv_lora_rank


def _check_q_dtype(q_lat: torch.Tensor, q_desc: str) -> None:
    if q_lat.dtype not in _FLOAT_DTYPES:
        raise TypeError(f"q must be fp16, bf16 or fp32, got {q_desc}")
    if q_lat.dtype == torch.bfloat16 and interpreter_on():
        raise TypeError(
            f"bf16 q under TRITON_INTERPRET=1 (got {q_desc}): Triton's CPU interpreter computes "
            "bf16 wrongly (errors of 1e9 seen), so it is refused there; use fp16 or fp32 on CPU"
        )
    if q_lat.shape[1] < 1:
        raise ValueError(f"q must have at least one head, got {q_desc}")


def _check_main_cache(
    kv_cache: object, kv_format: str, q_lat: torch.Tensor, R: int, kv_lora_rank: int, q_desc: str
) -> str:
    """kv_cache against q: its resolved format (kv_format with "auto" decided)."""
    L, device = q_lat.shape[2], q_lat.device
    if not isinstance(kv_cache, torch.Tensor):
        raise TypeError(f"kv_cache must be a tensor, got {_shape(kv_cache)}")
    if kv_cache.dim() not in (2, 3):
        raise ValueError(
            f"kv_cache must be [N, C] or [num_blocks, page, C], got {_shape(kv_cache)}"
        )
    if kv_cache.device != device:
        raise ValueError(f"kv_cache must be on {device} like q, got {_shape(kv_cache)}")
    fmt = _resolve_format(kv_format, kv_cache, q_lat.dtype)
    if fmt == "fp8_ds_mla" and (L != DS_MLA_LATENT or R not in (0, DS_MLA_ROPE)):
        raise ValueError(
            f"fp8_ds_mla holds 512 latent + 64 rope values; q has {L} + {R} (q {q_desc}, "
            f"kv_lora_rank={kv_lora_rank})"
        )
    if fmt == "fp8_ds_mla_v4" and (L != DS_V4_WIDTH or R != 0):
        raise ValueError(
            f"fp8_ds_mla_v4 holds one 512-wide row (448 NoPE + 64 RoPE values, q . k over all of "
            f"it, the value all of it): q must be [T, H, 512] with kv_lora_rank=512; got q "
            f"{q_desc} ({L} + {R}), kv_lora_rank={kv_lora_rank}"
        )
    _check_cache("kv_cache", kv_cache, fmt, q_lat.dtype, L + R, device)
    return fmt


def _check_index_set(
    prefix: str, indices: object, valid_counts: object, T: int, device: torch.device, q_desc: str
) -> None:
    """``{prefix}indices`` int32 [T, W >= 1] and ``{prefix}valid_counts`` int32 [T] or None."""
    _check_int32(f"{prefix}indices", indices, 2, device)
    if indices.shape[0] != T or indices.shape[1] < 1:
        raise ValueError(
            f"{prefix}indices must be [T={T}, W>=1], got {_shape(indices)} (q {q_desc})"
        )
    _check_int32(f"{prefix}valid_counts", valid_counts, 1, device)
    if valid_counts is not None and valid_counts.shape[0] != T:
        raise ValueError(
            f"{prefix}valid_counts must be [T={T}], got {_shape(valid_counts)} (q {q_desc})"
        )


def _check_paging(
    block_table: object,
    req_ids: object,
    block_size: object,
    extra_block_table: object,
    T: int,
    device: torch.device,
    q_desc: str,
) -> None:
    has_bt = block_table is not None
    # req_ids also serves an extra set's own block table (extra_block_table)
    needs_req = has_bt or extra_block_table is not None
    if has_bt != (block_size is not None) or needs_req != (req_ids is not None):
        raise ValueError(
            "block_table, req_ids and block_size go together (req_ids also with "
            f"extra_block_table): got block_table {_shape(block_table)}, req_ids "
            f"{_shape(req_ids)}, block_size {block_size!r}, extra_block_table "
            f"{_shape(extra_block_table)}"
        )
    if has_bt:
        _check_int32("block_table", block_table, 2, device)
        _check_block_size("block_size", block_size)
    if needs_req:
        _check_int32("req_ids", req_ids, 1, device)
        if req_ids.shape[0] != T:
            raise ValueError(f"req_ids must be [T={T}], got {_shape(req_ids)} (q {q_desc})")


def _check_out(out: object, q_lat: torch.Tensor, q_desc: str) -> None:
    if out is None:
        return
    T, H, L = q_lat.shape
    if not isinstance(out, torch.Tensor):
        raise TypeError(f"out must be a tensor, got {_shape(out)}")
    if out.dtype != q_lat.dtype:
        raise TypeError(f"out must have q's dtype {q_lat.dtype}, got {_shape(out)}")
    if tuple(out.shape) != (T, H, L):
        raise ValueError(f"out must be [{T}, {H}, {L}] (q {q_desc}), got {_shape(out)}")
    if out.device != q_lat.device:
        raise ValueError(f"out must be on {q_lat.device} like q, got {_shape(out)}")


def _check_k_scale(
    k_scale: object, fmt: str, device: torch.device
) -> tuple[torch.Tensor | None, float]:
    """(the device scale tensor or None, the host scale value) of a per-tensor fp8 cache."""
    if k_scale is None:
        return None, 1.0
    if fmt != "fp8":
        raise ValueError(f"k_scale applies to kv_format='fp8' only, got kv_format={fmt!r}")
    if isinstance(k_scale, torch.Tensor):
        if k_scale.dtype != torch.float32:
            raise TypeError(f"k_scale as a tensor must be float32, got {_shape(k_scale)}")
        if k_scale.numel() != 1 or k_scale.device != device:
            raise ValueError(
                f"k_scale must be one float32 value on {device}, got {_shape(k_scale)}"
            )
        return k_scale, 1.0
    value = _real_number("k_scale", k_scale)
    if value <= 0.0:
        raise ValueError(f"k_scale must be positive (a dequantization scale), got {k_scale!r}")
    return None, value


def _check_sink(attn_sink: object, H: int, device: torch.device, q_desc: str) -> None:
    if attn_sink is None:
        return
    if not isinstance(attn_sink, torch.Tensor):
        raise TypeError(f"attn_sink must be a float32 tensor [H] or None, got {_shape(attn_sink)}")
    if attn_sink.dtype != torch.float32:
        raise TypeError(f"attn_sink must be float32 [H={H}], got {_shape(attn_sink)}")
    if tuple(attn_sink.shape) != (H,):
        raise ValueError(f"attn_sink must be [H={H}] (q {q_desc}), got {_shape(attn_sink)}")
    if attn_sink.device != device:
        raise ValueError(f"attn_sink must be on {device} like q, got {_shape(attn_sink)}")


def _checked(a: Mapping[str, Any]) -> _Call:
    """Validate a sparse_mla call (everything its docstring promises to refuse) and plan it.
    ``a``: sparse_mla's arguments by name, as passed (defaults applied)."""
    kv_lora_rank = _check_rank(a["kv_lora_rank"])
    q_lat, q_rope = _split_q(a["q"], kv_lora_rank)
    q_desc = _describe_q(a["q"])  # messages show q as passed, not its latent slice
    _check_q_dtype(q_lat, q_desc)
    T, H, L = q_lat.shape
    R = 0 if q_rope is None else q_rope.shape[-1]
    device, dtype = q_lat.device, q_lat.dtype
    kv_cache = a["kv_cache"]
    fmt = _check_main_cache(kv_cache, a["kv_format"], q_lat, R, kv_lora_rank, q_desc)
    indices, valid_counts = a["indices"], a["valid_counts"]
    _check_index_set("", indices, valid_counts, T, device, q_desc)
    block_table, req_ids, block_size = a["block_table"], a["req_ids"], a["block_size"]
    _check_paging(block_table, req_ids, block_size, a["extra_block_table"], T, device, q_desc)
    has_bt = block_table is not None
    _check_out(a["out"], q_lat, q_desc)
    k_scale_ptr, k_scale_val = _check_k_scale(a["k_scale"], fmt, device)
    attn_sink = a["attn_sink"]
    _check_sink(attn_sink, H, device, q_desc)
    extra = _check_extra(
        a["extra_kv_cache"],
        a["extra_indices"],
        a["extra_valid_counts"],
        a["extra_block_table"],
        a["extra_block_size"],
        fmt,
        dtype,
        L + R,
        T,
        device,
        q_desc,
    )
    softmax_scale = a["softmax_scale"]
    if softmax_scale is None:
        softmax_scale = 1.0 / math.sqrt(L + R)
    else:
        softmax_scale = _real_number("softmax_scale", softmax_scale)
    return_lse, config = a["return_lse"], a["config"]
    if not isinstance(return_lse, bool):
        raise TypeError(f"return_lse must be a bool, got {return_lse!r}")
    if config is not None and not isinstance(config, KernelConfig):
        raise TypeError(f"config must be a KernelConfig or None, got {type(config).__name__}")
    if config is not None:
        check_config(config, fmt, has_bt)  # also for T == 0, where no plan is made
    check_runs_here("sparse_mla", device, "use triton_mla_sparse.reference.sparse_mla_reference")

    plan = None
    if T > 0:
        plan = make_plan(
            num_tokens=T,
            num_heads=H,
            latent=L,
            rope=R,
            width=indices.shape[1],
            dtype=dtype,
            kv_format=fmt,
            arch=arch_of(device),
            on_gpu=device.type == "cuda",
            page_size=_page_size(kv_cache),
            has_counts=valid_counts is not None,
            block_size=block_size if has_bt else None,
            k_scale_tensor=k_scale_ptr is not None,
            store_lse=return_lse,
            has_sink=attn_sink is not None,
            extra_width=extra.indices.shape[1] if extra is not None else None,
            extra_page_size=_page_size(extra.kv_cache) if extra is not None else 1,
            extra_has_counts=extra is not None and extra.valid_counts is not None,
            extra_block_size=a["extra_block_size"] if extra is not None else None,
            # only fp8_ds_mla's Gluon kernel gathers with unchecked 16-byte copies
            cache_aligned=fmt != "fp8_ds_mla"
            or gluon_gathers_aligned(*kv_cache.stride()[:-1], kv_cache.data_ptr()),
            cache_span=cache_span(kv_cache),
            config=config,
        )
    if kv_cache.dtype == torch.float8_e4m3fn:
        kv_cache = kv_cache.view(torch.uint8)
    return _Call(
        plan,
        (T, H, L),
        dtype,
        device,
        q_lat,
        q_rope,
        kv_cache,
        indices,
        valid_counts,
        block_table,
        req_ids,
        k_scale_ptr,
        k_scale_val,
        softmax_scale,
        attn_sink,
        extra,
    )


def _page_size(cache: torch.Tensor) -> int:
    return cache.shape[1] if cache.dim() == 3 else 1


def sparse_mla(
    q: torch.Tensor | tuple[torch.Tensor, torch.Tensor],
    kv_cache: torch.Tensor,
    indices: torch.Tensor,
    softmax_scale: float | None = None,
    *,
    kv_lora_rank: int = 512,
    valid_counts: torch.Tensor | None = None,
    block_table: torch.Tensor | None = None,
    req_ids: torch.Tensor | None = None,
    block_size: int | None = None,
    kv_format: str = "auto",
    k_scale: float | torch.Tensor | None = None,
    attn_sink: torch.Tensor | None = None,
    extra_kv_cache: torch.Tensor | None = None,
    extra_indices: torch.Tensor | None = None,
    extra_valid_counts: torch.Tensor | None = None,
    extra_block_table: torch.Tensor | None = None,
    extra_block_size: int | None = None,
    out: torch.Tensor | None = None,
    return_lse: bool = False,
    config: KernelConfig | None = None,
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """Sparse MLA attention forward: each query token attends to its own top-k cache rows.

    Args:
        q: ``[T, H, D]`` with ``D = kv_lora_rank + rope`` (576 for DeepSeek-V3.2/GLM-5, 512 for
            NoPE models), or a tuple ``(q_latent [T, H, kv_lora_rank], q_rope [T, H, rope])``
            used as is (no concatenation). fp16, bf16 or fp32 (bf16 not under
            ``TRITON_INTERPRET=1``: Triton's interpreter computes it wrongly); any strides; any
            head count ``H >= 1`` (heads beyond one tile run as further head blocks).
        kv_cache: one latent head per token. Rows ``[N, C]`` or paged ``[num_blocks, page, C]``,
            any strides (block stride may exceed ``page * C``). ``C`` is ``D`` for
            ``kv_format="auto"`` (q's dtype) and ``"fp8"`` (e4m3 as uint8/float8_e4m3fn),
            656 bytes for ``"fp8_ds_mla"`` (uint8; see :mod:`triton_mla_sparse.kv_format`),
            584 for ``"fp8_ds_mla_v4"`` (DeepSeek-V4's record: uint8 pages ``[num_pages, P,
            584]`` as vLLM 0.33 allocates them, strides ``(S, 584, 1)``, ``S >= P * 584`` and
            even; q ``[T, H, 512]``, ``kv_lora_rank=512``, the value the whole row).
        indices: int32 ``[T, W]``, any ``W >= 1``: rows of the cache in its logical flat order
            (paged: row ``i`` is block ``i // page``, slot ``i % page``). ``-1`` and any index
            outside ``[0, N)`` are skipped wherever they stand and never dereferenced.
            A duplicated index counts as often as it appears.
        softmax_scale: multiplies ``q . k``; a finite Python or NumPy number (not a tensor:
            reading one would synchronise with the device); default ``1 / sqrt(D)``.
        kv_lora_rank: latent width ``L`` (the V width and the output width).
        valid_counts: optional int32 ``[T]``: only ``indices[t, :valid_counts[t]]`` are read.
            Any stride (as ``req_ids``).
        block_table, req_ids, block_size: optional int32 ``[R, max_blocks]``, int32 ``[T]`` and
            an int. When given, indices are request-local positions ``pos`` mapped to cache row
            ``block_table[req_ids[t], pos // block_size] * block_size + pos % block_size``;
            positions past the table, with a negative table entry, or with an entry whose
            rows lie past the cache (never wrapped around int32) are skipped. Any strides.
            ``req_ids`` must lie in ``[0, R)``: not checked (that would read a device tensor on
            the host); an id outside it reads outside ``block_table``.
        kv_format: ``"auto"``, ``"fp8"``, ``"fp8_ds_mla"`` or ``"fp8_ds_mla_v4"``.
        k_scale: per-tensor dequantization scale for ``"fp8"`` (float or 0-d/1-element float32
            tensor on q's device, the latter for CUDA graphs); default 1.
        attn_sink: optional float32 ``[H]`` on q's device, any stride: a per-head attention
            sink (HY V4, DeepSeek-V4, gpt-oss style), one more term in each softmax
            denominator with no value row: ``out = sum_j e^{s_j} v_j / (sum_j e^{s_j} +
            e^{attn_sink[h]})`` with ``s_j = softmax_scale * q . k_j`` (natural-log units). It
            is read on the device (CUDA-graph safe). ``-inf`` has no effect, ``+inf`` gives a
            zero output; the returned LSE does not include it.
        extra_kv_cache, extra_indices: optional, together: a second cache and int32
            ``[T, W2]`` indices into it (any ``W2 >= 1``), attended in the same softmax as the
            main set (DeepSeek-V4 decode: a sliding-window cache and a compressed cache). The
            result is one softmax over the union of both sets' valid entries; the LSE covers the
            union. The extra cache is read in ``kv_format`` (and ``k_scale``) like
            ``kv_cache`` and has the same row width, with its own shape, page size and strides
            (flat ``[N2, C]`` or paged ``[num_blocks2, page2, C]``). Its indices follow the main
            set's rules: rows of the extra cache in its logical flat order, ``-1`` and anything
            outside ``[0, N2)`` skipped.
        extra_valid_counts: optional int32 ``[T]``, any stride: only
            ``extra_indices[t, :extra_valid_counts[t]]`` are read.
        extra_block_table, extra_block_size: optional, together: the extra set's own block table
            (int32 ``[R, max_blocks2]``) and block size, mapping its indices as ``block_table``
            maps the main set's; the request of token ``t`` is ``req_ids[t]`` (required then).
        out: optional ``[T, H, L]`` tensor in q's dtype to write into (any strides).
        return_lse: also return the natural-log log-sum-exp ``[T, H]`` (float32).
        config: optional :class:`KernelConfig` overriding the heuristic launch configuration
            (``idx_ahead=True`` cannot be combined with a block table or a Gluon kernel;
            ``row_offsets_32=True`` needs a cache spanning at most 2^31 elements); a config the
            call cannot run is refused with a ValueError before any launch.

    Returns:
        ``out [T, H, L]`` in q's dtype, and ``lse [T, H]`` with ``return_lse=True``. A token with
        no valid index (in either set) gets zeros and LSE ``-inf`` (with or without a sink).

    Raises:
        TypeError: an argument of the wrong type or dtype (a tensor's dtype, a non-tensor where a
            tensor is needed, a tensor or string ``softmax_scale``, bf16 under the interpreter).
        ValueError: wrong shapes, ranks, devices or values (non-finite scales, unknown
            ``kv_format``, mismatched ``T``). Raised before anything is launched or allocated;
            messages name the argument and show what the caller passed.
    """
    # the parameters by name: at this point locals() holds exactly them, as passed
    c = _checked(locals())
    T, H, _ = c.out_shape
    if out is None:
        out = torch.empty(c.out_shape, dtype=c.dtype, device=c.device)
    lse = torch.empty((T, H), dtype=torch.float32, device=c.device) if return_lse else None
    if c.plan is None:
        return (out, lse) if return_lse else out

    from .launch import launch_sparse_mla  # Triton import deferred: nothing compiles at import

    launch_sparse_mla(
        c.plan,
        c.q_lat,
        c.q_rope,
        c.kv_cache,
        c.indices,
        c.valid_counts,
        c.block_table,
        c.req_ids,
        c.k_scale_ptr,
        c.k_scale_val,
        out,
        lse,
        c.softmax_scale,
        c.attn_sink,
        *(
            (c.extra.kv_cache, c.extra.indices, c.extra.valid_counts, c.extra.block_table)
            if c.extra is not None
            else ()
        ),
    )
    return (out, lse) if return_lse else out


def sparse_mla_plan(*args: Any, **kwargs: Any) -> LaunchPlan | None:
    """The :class:`~triton_mla_sparse.ops.sparse_mla.plan.LaunchPlan` that
    :func:`sparse_mla` would run for these arguments: kernel family, the configuration as run
    (split count, fp8 decode, MMA operand type and dependent launch decided), grids and
    constexprs. Same arguments, same validation and the same exceptions as :func:`sparse_mla`;
    launches, allocates and compiles nothing. None when ``T == 0`` (nothing would launch).
    """
    try:
        bound = _SPARSE_MLA_SIGNATURE.bind(*args, **kwargs)
    except TypeError as e:  # as a call of sparse_mla with these arguments would fail
        raise TypeError(f"sparse_mla_plan() {e}") from None
    bound.apply_defaults()
    return _checked(bound.arguments).plan


# sparse_mla_plan takes sparse_mla's parameters: one signature, shown by help() for both
_SPARSE_MLA_SIGNATURE = inspect.signature(sparse_mla)
sparse_mla_plan.__signature__ = _SPARSE_MLA_SIGNATURE.replace(  # type: ignore[attr-defined]
    return_annotation="LaunchPlan | None"
)
