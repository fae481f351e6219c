"""KV cache formats: what a cache row holds and how the fp8 layouts are packed.

Formats (one latent "head" per token):

- ``"auto"``: the cache has q's dtype (fp16/bf16/fp32), ``D = kv_lora_rank + rope`` values per row.
- ``"fp8"``: ``D`` e4m3 values per row with one per-tensor scale ``k_scale``
  (``value = e4m3 * k_scale``); stored as ``torch.float8_e4m3fn`` or ``torch.uint8``.
- ``"fp8_ds_mla"``: 656 bytes per row (vLLM's / FlashMLA's layout), ``torch.uint8``:
  bytes ``[0, 512)`` 512 e4m3 latent values, ``[512, 528)`` four float32 scales (scale ``j``
  multiplies latent values ``128j .. 128j+127``), ``[528, 656)`` 64 bf16 rope values.
- ``"fp8_ds_mla_v4"``: DeepSeek-V4's 584-byte paged record, ``torch.uint8``
  ``[num_pages, page_size, 584]``; a page holds all its 576-byte data rows, then all its 8-byte
  scale rows (layout and quantisation rule: the section "DeepSeek-V4" below). Read in place by
  the ``sparse_mla`` kernel (q and k 512 wide, the value the whole row) and by
  :func:`dequantize_cache` for the reference (:data:`KV_FORMATS` lists what the kernel reads,
  :data:`REFERENCE_KV_FORMATS` what the reference reads).
"""

from __future__ import annotations

import torch

# The formats the sparse_mla kernel reads (ops/sparse_mla/interface.py validates against this).
KV_FORMATS = ("auto", "fp8", "fp8_ds_mla", "fp8_ds_mla_v4")
# Formats only dequantize_cache (and so the reference) reads, with no kernel path: none now.
REFERENCE_ONLY_KV_FORMATS: tuple[str, ...] = ()
REFERENCE_KV_FORMATS = KV_FORMATS + REFERENCE_ONLY_KV_FORMATS

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
    """Decode a cache of any format to float32 with the same leading shape (used by the reference).

    ``"fp8_ds_mla_v4"``: uint8 ``[num_pages, P, 584]`` (or ``[num_pages, 1, P, 584]``) -> float32
    ``[num_pages, P, 512]``, so that flat row ``page * P + slot`` is that slot's 512 values.
    """
    if kv_format == "auto":
        return kv_cache.float()
    if kv_format == "fp8":
        u8 = kv_cache.view(torch.uint8) if kv_cache.dtype != torch.uint8 else kv_cache
        scale = 1.0 if k_scale is None else k_scale
        scale = float(scale) if not isinstance(scale, torch.Tensor) else scale.float().cpu().item()
        return u8.view(torch.float8_e4m3fn).float() * scale
    if kv_format == "fp8_ds_mla":
        return unpack_fp8_ds_mla(kv_cache)
    if kv_format == "fp8_ds_mla_v4":
        pages = ds_mla_v4_pages(kv_cache)  # validates; [num_pages, page_size, 584]
        return unpack_fp8_ds_mla_v4(pages).view(pages.shape[0], pages.shape[1], DS_V4_WIDTH)
    raise ValueError(f"kv_format must be one of {REFERENCE_KV_FORMATS}, got {kv_format!r}")


def bytes_per_row(kv_format: str, width: int, dtype: torch.dtype) -> int:
    """Bytes one cache row occupies in the given format (for bandwidth accounting)."""
    if kv_format == "fp8_ds_mla":
        return DS_MLA_ROW_BYTES
    if kv_format == "fp8_ds_mla_v4":
        return DS_V4_TOKEN_BYTES  # the page's alignment padding is not counted
    if kv_format == "fp8":
        return width
    return width * torch.empty((), dtype=dtype).element_size()


__all__ = [
    "KV_FORMATS",
    "REFERENCE_KV_FORMATS",
    "REFERENCE_ONLY_KV_FORMATS",
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


# --- DeepSeek-V4: the 584-byte paged record, kv_format "fp8_ds_mla_v4" ------------------------
#
# Name: vLLM 0.33 calls this cache "fp8_ds_mla" too, the string of V3.2's 656-byte rows
# (models/deepseek_v4/attention.py:94-123 writes "fp8_ds_mla" back onto the cache config), and
# FlashMLA tells the two apart by the bytes per token, 656 or 584
# (third_party/flashmla/flash_mla_interface.py:119-132). Here a format name is one byte layout,
# so V4's record is the V3.2 name plus FlashMLA's model tag ("For DeepSeek V4 ...": V4).
#
# Layout (flash_mla_interface.py:130-132; vLLM's writer models/deepseek_v4/common/ops/
# cache_utils.py:44-165, its reader DequantizeAndGatherKCacheKernel :233-366; the cache spec
# attention.py:860-883; the page padding v1/kv_cache_interface.py:719-725): a page of P tokens holds
# P data rows of 576 bytes (token i at byte i*576: 448 e4m3 NoPE values, then 64 bf16 RoPE values),
# then P scale rows of 8 bytes (token i at P*576 + i*8: 7 ue8m0 exponents, scale = 2^(byte - 127),
# one per 64 NoPE values, then a pad byte, written 0). The page's P*584 bytes are padded to a
# multiple of 576 bytes (attention.py:877 "alignment=576"). vLLM's tensor is uint8 [num_pages, P,
# 584] (the [B, 1, N, C] allocation squeezed, attention.py:853-855) with stride(0) the padded page
# size, or more when layers share a page grid: 584 only tags the format, token i does not start at
# i*584. A slot id (an index value, a slot_mapping entry) is page * P + i.
#
# Quantisation, byte-exact with vLLM's Triton writer (cache_utils.py:115-165, the cache writer of
# its XPU port, xpu/xpu_qnorm_rope_kv_fp8_insert.py:153-163) and with the compressor's Triton
# writer (common/ops/fused_compress_quant_cache.py:280-310, 503-525, which differs only in
# multiplying by fp32(1/448) and by 2^-e, giving the same bytes for every bf16 amax). The CUDA
# writers (_C's fused_deepseek_v4_qnorm_rope_kv_rope_quant_insert, the CuTe DSL compressor) ship
# as binaries; the Triton writer says it matches the CUDA one (cache_utils.py:122-125).
#   1. the values are bf16: the Triton writer asserts bf16 K (cache_utils.py:192), the compressor
#      rounds its fp32 result to bf16 before quantising (fused_compress_quant_cache.py:282);
#   2. per group of 64 NoPE values: amax = max |x| (fp32), floored at fp32(1e-4) (:125);
#   3. e = ceil(log2(amax / 448)) with the division in fp32 (:129-132); scale = 2^e;
#   4. code = e4m3(clamp(x / scale, -448, 448)), rounded to nearest even (:135-143);
#   5. scale byte = clamp(e + 127, 0, 255) (:150-152); the pad byte is 0 (:154-155);
#   6. rope: the 64 bf16 values stored as they are (:158-165); fp32 input rounds to nearest even
#      (as the compressor's fp32 -> bf16 store does, fused_compress_quant_cache.py:339).
# For bf16 input e lies in [-22, 120] (the floor, bf16's largest value), so the byte clamp never
# acts and the clamp to +-448 never changes a value; amax / 448 rounded to fp32 is a power of two
# only when it is one exactly, so the ceil is taken on exact values (tests check every bf16 amax).
# An all-zero group gets scale byte 105 (the floor's exponent, -22), not 127.
DS_V4_NOPE = 448  # e4m3 values per token
DS_V4_ROPE = 64  # bf16 values per token
DS_V4_WIDTH = DS_V4_NOPE + DS_V4_ROPE  # 512: q/k width and value width (the whole row)
DS_V4_GROUP = 64  # NoPE values per ue8m0 scale
DS_V4_NUM_SCALES = DS_V4_NOPE // DS_V4_GROUP  # 7
DS_V4_DATA_BYTES = DS_V4_NOPE + 2 * DS_V4_ROPE  # 576: one data row
DS_V4_SCALE_BYTES = DS_V4_NUM_SCALES + 1  # 8: one scale row, 7 exponents and a pad byte
DS_V4_TOKEN_BYTES = DS_V4_DATA_BYTES + DS_V4_SCALE_BYTES  # 584
DS_V4_PAGE_ALIGN = DS_V4_DATA_BYTES  # page strides are multiples of 576 bytes
DS_V4_MIN_AMAX = 1e-4  # the writer's floor on a group's amax (applied in fp32)
DS_V4_PAD_BYTE = 0
UE8M0_BIAS = 127  # ue8m0 byte b means 2^(b - 127)
_FP32_MANTISSA_BITS = 23


def ds_mla_v4_page_stride(page_size: int) -> int:
    """Bytes from one page to the next in vLLM's allocation: ``page_size * 584`` rounded up to a
    multiple of 576 (37,440 for 64 tokens, 1,728 for 2)."""
    if isinstance(page_size, bool) or not isinstance(page_size, int) or page_size < 1:
        raise ValueError(f"page_size must be a positive int, got {page_size!r}")
    unpadded = page_size * DS_V4_TOKEN_BYTES
    return -(-unpadded // DS_V4_PAGE_ALIGN) * DS_V4_PAGE_ALIGN


def alloc_fp8_ds_mla_v4(
    num_pages: int,
    page_size: int,
    *,
    device: torch.device | str | None = None,
    fill: int = 0,
) -> torch.Tensor:
    """A V4 cache laid out as vLLM 0.33 allocates it, every byte ``fill``.

    Returns uint8 ``[num_pages, page_size, 584]`` with strides ``(page_stride, 584, 1)``
    (:func:`ds_mla_v4_page_stride`), a view of a ``num_pages * page_stride`` byte buffer that
    includes each page's padding. vLLM zero-fills its buffer (v1/worker/utils.py:596), hence the
    default ``fill=0``; tests pass other values to see which bytes a writer touches.
    """
    if isinstance(num_pages, bool) or not isinstance(num_pages, int) or num_pages < 0:
        raise ValueError(f"num_pages must be a non-negative int, got {num_pages!r}")
    stride = ds_mla_v4_page_stride(page_size)
    raw = torch.full((num_pages * stride,), fill, dtype=torch.uint8, device=device)
    return raw.as_strided((num_pages, page_size, DS_V4_TOKEN_BYTES), (stride, DS_V4_TOKEN_BYTES, 1))


def ds_mla_v4_pages(kv_cache: torch.Tensor) -> torch.Tensor:
    """Check a V4 cache and return it as uint8 ``[num_pages, page_size, 584]`` (a view).

    Takes ``[num_pages, page_size, 584]`` or vLLM's unsqueezed ``[num_pages, 1, page_size, 584]``.
    A page's ``page_size * 584`` bytes must be contiguous (strides ``(S, 584, 1)``) and pages must
    not overlap (``S >= page_size * 584``); ``S`` need not be vLLM's padded stride.
    """
    if not isinstance(kv_cache, torch.Tensor):
        raise TypeError(f"kv_cache must be a tensor, got {type(kv_cache).__name__}")
    if kv_cache.dtype != torch.uint8:
        raise TypeError(f"an fp8_ds_mla_v4 cache must be torch.uint8, got {kv_cache.dtype}")
    if kv_cache.dim() == 4 and kv_cache.shape[1] == 1:
        kv_cache = kv_cache.squeeze(1)
    if kv_cache.dim() != 3 or kv_cache.shape[-1] != DS_V4_TOKEN_BYTES:
        raise ValueError(
            f"an fp8_ds_mla_v4 cache must be [num_pages, page_size, {DS_V4_TOKEN_BYTES}] (or "
            f"[num_pages, 1, page_size, {DS_V4_TOKEN_BYTES}]), got {tuple(kv_cache.shape)}"
        )
    num_pages, page_size, _ = kv_cache.shape
    if page_size < 1:
        raise ValueError(
            f"an fp8_ds_mla_v4 cache needs page_size >= 1, got {tuple(kv_cache.shape)}"
        )
    page_bytes = page_size * DS_V4_TOKEN_BYTES
    contiguous_page = kv_cache.stride(2) == 1 and (
        page_size == 1 or kv_cache.stride(1) == DS_V4_TOKEN_BYTES
    )
    if not contiguous_page or (num_pages > 1 and kv_cache.stride(0) < page_bytes):
        raise ValueError(
            f"an fp8_ds_mla_v4 cache needs strides (S >= {page_bytes}, {DS_V4_TOKEN_BYTES}, 1): a "
            f"page's data and scale rows are addressed from its first byte; got shape "
            f"{tuple(kv_cache.shape)} with strides {kv_cache.stride()}"
        )
    return kv_cache


def _page_bytes(pages: torch.Tensor) -> torch.Tensor:
    """``[num_pages, page_size * 584]`` view of checked pages (what vLLM's kernels address)."""
    num_pages, page_size, _ = pages.shape
    stride0 = pages.stride(0) if num_pages > 1 else page_size * DS_V4_TOKEN_BYTES
    return pages.as_strided((num_pages, page_size * DS_V4_TOKEN_BYTES), (stride0, 1))


def quantize_ds_mla_v4(rows: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Quantise rows ``[N, 512]`` (any float dtype, 448 NoPE + 64 RoPE) by vLLM's V4 rule.

    Returns ``(codes uint8 [N, 448], scale bytes uint8 [N, 7], rope bfloat16 [N, 64])``: the
    e4m3 bytes, the ue8m0 exponents and the rope values as the record stores them. The rule
    (steps 1-6 in the comment that opens this file's DeepSeek-V4 section) rounds the input to bf16
    first, as vLLM's writers quantise bf16 values. Raises ``ValueError`` on a value that is not
    finite in bf16 (vLLM's writers would store a NaN/inf scale or NaN codes for it).
    """
    if not isinstance(rows, torch.Tensor) or not rows.is_floating_point():
        got = rows.dtype if isinstance(rows, torch.Tensor) else type(rows).__name__
        raise TypeError(f"rows must be a floating-point tensor, got {got}")
    if rows.dim() != 2 or rows.shape[1] != DS_V4_WIDTH:
        raise ValueError(
            f"rows must be [N, {DS_V4_WIDTH}] ({DS_V4_NOPE} NoPE + {DS_V4_ROPE} RoPE values), got "
            f"{tuple(rows.shape)}"
        )
    x = rows.to(torch.bfloat16)
    if not bool(torch.isfinite(x).all()):
        raise ValueError("rows must be finite once rounded to bf16 (vLLM's writers store bf16)")
    n = x.shape[0]
    nope = x[:, :DS_V4_NOPE].float().view(n, DS_V4_NUM_SCALES, DS_V4_GROUP)
    amax = nope.abs().amax(dim=-1).clamp_min(DS_V4_MIN_AMAX)  # the floor as an fp32 constant
    ratio = amax / E4M3_MAX  # fp32, as the writer's raw_scale
    # ceil(log2(ratio)) without a log: ratio = m * 2^k with m in [0.5, 1), so the ceil is k,
    # or k - 1 when m == 0.5 (ratio a power of two). Exact, unlike a libm log2 near 2^k.
    mant, k = torch.frexp(ratio)
    e = torch.where(mant == 0.5, k - 1, k).to(torch.int32)
    # 2^e built from its bits (e in [-22, 120] for finite bf16 input, a normal fp32), so the
    # division below is exact, as x / 2^e is on the GPU
    scale = ((e + UE8M0_BIAS) << _FP32_MANTISSA_BITS).view(torch.float32)
    q = (nope / scale[..., None]).clamp(-E4M3_MAX, E4M3_MAX).to(torch.float8_e4m3fn)
    codes = q.view(torch.uint8).reshape(n, DS_V4_NOPE)
    scale_bytes = (e + UE8M0_BIAS).clamp(0, 255).to(torch.uint8)
    return codes, scale_bytes, x[:, DS_V4_NOPE:].contiguous()


def write_fp8_ds_mla_v4(kv_cache: torch.Tensor, slots: torch.Tensor, rows: torch.Tensor) -> None:
    """Quantise ``rows`` and write them into a V4 cache at ``slots``, in place, as vLLM's writer.

    Args:
        kv_cache: uint8 ``[num_pages, page_size, 584]`` or ``[num_pages, 1, page_size, 584]``
            (:func:`ds_mla_v4_pages`), on rows' device.
        slots: integer ``[N]`` slot ids ``page * page_size + i``; ``-1`` skips the row (vLLM's
            padded tokens). Other slots must be distinct and inside the cache.
        rows: ``[N, 512]`` any float dtype, 448 NoPE then 64 RoPE values.

    Each written token gets its 576-byte data row and its 8-byte scale row (pad byte 0); nothing
    else changes: other tokens' bytes and the page padding keep what they held, as with vLLM's
    writer (cache_utils.py:44-165), which stores exactly those bytes.
    """
    pages = ds_mla_v4_pages(kv_cache)
    codes, scale_bytes, rope = quantize_ds_mla_v4(rows)
    if not isinstance(slots, torch.Tensor) or slots.dim() != 1 or slots.is_floating_point():
        raise TypeError(f"slots must be an integer tensor [N], got {slots!r}")
    if slots.shape[0] != rows.shape[0]:
        raise ValueError(f"slots has {slots.shape[0]} entries for {rows.shape[0]} rows")
    if pages.device != rows.device or slots.device != rows.device:
        raise ValueError(
            f"kv_cache ({pages.device}), slots ({slots.device}) and rows ({rows.device}) must be "
            "on one device"
        )
    num_pages, page_size, _ = pages.shape
    slots = slots.long()
    keep = slots != -1
    slot = slots[keep]
    if slot.numel():
        lo, hi = int(slot.min()), int(slot.max())
        if lo < 0 or hi >= num_pages * page_size:
            raise ValueError(
                f"slots must be -1 or in [0, {num_pages * page_size}), got values in [{lo}, {hi}]"
            )
        if slot.unique().numel() != slot.numel():
            raise ValueError("slots must be distinct (two rows written to one slot)")
    page, i = slot // page_size, slot % page_size
    flat = _page_bytes(pages)
    data = torch.cat(
        [codes[keep], rope[keep].view(torch.uint8).view(-1, 2 * DS_V4_ROPE)], dim=1
    )  # [n, 576]
    cols = i[:, None] * DS_V4_DATA_BYTES + torch.arange(DS_V4_DATA_BYTES, device=flat.device)
    flat[page[:, None], cols] = data
    pad = torch.full((data.shape[0], 1), DS_V4_PAD_BYTE, dtype=torch.uint8, device=flat.device)
    scale_row = torch.cat([scale_bytes[keep], pad], dim=1)  # [n, 8]
    cols = (
        page_size * DS_V4_DATA_BYTES
        + i[:, None] * DS_V4_SCALE_BYTES
        + torch.arange(DS_V4_SCALE_BYTES, device=flat.device)
    )
    flat[page[:, None], cols] = scale_row


def pack_fp8_ds_mla_v4(rows: torch.Tensor, page_size: int) -> torch.Tensor:
    """Pack rows ``[N, 512]`` (any float dtype) into a new V4 cache, row ``n`` at slot ``n``.

    Returns uint8 ``[ceil(N / page_size), page_size, 584]`` with vLLM's strides
    ``(page_stride, 584, 1)`` (:func:`alloc_fp8_ds_mla_v4`). Bytes no row writes (the last page's
    unused slots, every page's padding) are 0, as in vLLM's zero-filled cache after writing slots
    ``0 .. N-1``.
    """
    ds_mla_v4_page_stride(page_size)  # checks page_size
    if not isinstance(rows, torch.Tensor) or rows.dim() != 2:
        raise ValueError(f"rows must be a 2-D tensor [N, {DS_V4_WIDTH}], got {rows!r}")
    num_pages = -(-rows.shape[0] // page_size)
    cache = alloc_fp8_ds_mla_v4(num_pages, page_size, device=rows.device)
    slots = torch.arange(rows.shape[0], device=rows.device)
    write_fp8_ds_mla_v4(cache, slots, rows)
    return cache


def unpack_fp8_ds_mla_v4(kv_cache: torch.Tensor) -> torch.Tensor:
    """Decode every slot of a V4 cache: uint8 ``[num_pages, page_size, 584]`` (or
    ``[num_pages, 1, page_size, 584]``) -> float32 ``[num_pages * page_size, 512]``, row = slot id.

    NoPE value = e4m3 code * 2^(scale byte - 127), as vLLM's reader computes it in fp32
    (cache_utils.py:333-352; a byte of 255 gives inf, the e4m3 NaN codes 0x7F/0xFF give NaN);
    RoPE = the stored bf16 values. vLLM's reader then rounds to bf16, which changes nothing for
    bytes its writers produce (an e4m3 code times 2^-22 .. 2^120 is a bf16 number).
    """
    pages = ds_mla_v4_pages(kv_cache)
    num_pages, page_size, _ = pages.shape
    flat = _page_bytes(pages)
    data_end = page_size * DS_V4_DATA_BYTES
    data = flat[:, :data_end].reshape(-1, DS_V4_DATA_BYTES)  # [slots, 576]
    scale_rows = flat[:, data_end:].reshape(-1, DS_V4_SCALE_BYTES)  # [slots, 8]
    codes = data[:, :DS_V4_NOPE].contiguous().view(torch.float8_e4m3fn).float()
    exps = scale_rows[:, :DS_V4_NUM_SCALES].double() - UE8M0_BIAS
    scale = torch.exp2(exps).float()  # exact powers of two; 2^128 -> inf as in fp32 on the GPU
    nope = codes.view(-1, DS_V4_NUM_SCALES, DS_V4_GROUP) * scale[..., None]
    rope = data[:, DS_V4_NOPE:].contiguous().view(torch.bfloat16).float()
    return torch.cat([nope.reshape(-1, DS_V4_NOPE), rope], dim=1)


__all__ += [
    "DS_V4_TOKEN_BYTES",
    "DS_V4_WIDTH",
    "alloc_fp8_ds_mla_v4",
    "ds_mla_v4_page_stride",
    "ds_mla_v4_pages",
    "pack_fp8_ds_mla_v4",
    "quantize_ds_mla_v4",
    "unpack_fp8_ds_mla_v4",
    "write_fp8_ds_mla_v4",
]
