"""FlashMLA called as vLLM 0.33's FLASHMLA_SPARSE backend calls it, on the bench's inputs.

The build measured is the one vLLM 0.33 ships: ``vllm/_flashmla_C.abi3.so`` and
``vllm/third_party/flashmla/flash_mla_interface.py`` (:data:`INTERFACE`), imported only by
:func:`load`. With vLLM installed, vLLM's own FlashMLA op module (:data:`VLLM_OP`) says first
whether FlashMLA's sparse kernels run here; without vLLM, the two files on ``PYTHONPATH`` (with
an empty ``vllm/__init__.py``) are imported directly. Nothing else from vLLM is used.

What vLLM 0.33 passes (vllm/v1/attention/backends/mla/flashmla_sparse.py), reproduced here:

bf16 cache, decode and prefill alike (``_forward_bf16_kv`` -> ``_bf16_flash_mla_kernel``)::

    out, max_logits, lse = flash_mla_sparse_fwd(
        q,            # bf16 [T, Hp, 576], Hp = H rounded up to a multiple of 64 (zeros in the
                      # padded heads here; vLLM leaves whatever its buffer held: dropped anyway)
        kv,           # bf16 [rows, 1, 576]: the paged cache as flat rows
        indices,      # int32 [T, 1, W]: per token the valid rows first, in order, then -1
        softmax_scale,
        topk_length=topk_length,  # int32 [T]: how many of a token's indices are valid
    )                 # out bf16 [T, Hp, 512]; vLLM keeps out[:, :H]

fp8_ds_mla cache, decode (and prefill below 32 heads; ``_fp8_flash_mla_kernel``)::

    out, lse = flash_mla_with_kvcache(
        q=q,                          # bf16 [B, S, Hp, 576], Hp = 64 if H <= 64 else 128,
                                      # zeros in the padded heads
        k_cache=k_cache,              # uint8 [blocks, 64, 1, 656]
        block_table=block_table,      # int32 [B, 1], unused with indices
        head_dim_v=512,
        cache_seqlens=cache_seqlens,  # int32 [B], unused with indices
        tile_scheduler_metadata=get_mla_metadata()[0],
        is_fp8_kvcache=True,
        indices=indices,              # int32 [B, S, W]: -1 in place of invalid entries
        softmax_scale=softmax_scale,
    )                                 # out bf16 [B, S, Hp, 512]; vLLM keeps the first H heads

DeepSeek-V4 decode (``fp8_ds_mla_v4``: vllm/models/deepseek_v4/nvidia/flashmla.py,
``DeepseekV4FlashMLAAttention._forward_decode``), both caches in the 584-byte record::

    out, _ = flash_mla_with_kvcache(
        q=q,                          # bf16 [T, 1, Hp, 512], Hp = 64 if H <= 64 else 128
        k_cache=swa_cache,            # uint8 [blocks, page, 1, 584]: the sliding-window cache,
                                      # its padded page stride kept (kv_cache.unsqueeze(-2))
        block_table=None,
        head_dim_v=512,
        tile_scheduler_metadata=...,  # one FlashMLASchedMeta, its first call plans
        cache_seqlens=None,
        is_fp8_kvcache=True,
        indices=swa_indices,          # int32 [T, 1, W]: slots, valid first, then -1
        topk_length=swa_lens,         # int32 [T]: the valid entries
        softmax_scale=scale,
        attn_sink=attn_sink,          # float32 [Hp]
        extra_k_cache=kv_cache,       # uint8 [blocks2, page2, 1, 584]: the compressed cache
        extra_indices_in_kvcache=topk_indices,  # int32 [T, 1, W2], slots
        extra_topk_length=topk_lens,  # int32 [T]
        out=output.unsqueeze(1),      # bf16 [T, 1, Hp, 512], written in place
    )

Below 32 heads vLLM runs all tokens, prefill ones included, as one sequence (``B = 1, S = T``,
its "mixed batch" mode); from 32 heads decode runs one token per request (``B = T, S = 1``) and
prefill runs sparse_fwd on a bf16 upconversion of the cache (not reproduced here).

Indices given here are flat rows of the paged cache (row ``i`` = block ``i // page``, slot
``i % page``), which is what vLLM's index conversion makes of request-local positions; an entry
that is -1, past ``valid_counts`` or outside the cache becomes -1, as that conversion makes it.

The first call of an fp8 decode computes FlashMLA's tile-scheduler metadata (as the first layer
of a vLLM step does) and later calls reuse it: call once before timing. The head padding is
done once, outside the timed call (vLLM's bf16 path writes q into a head-padded buffer anyway;
its fp8 path copies q into a zeroed padded tensor on every call, a small cost left out here).
"""

from __future__ import annotations

import dataclasses
import importlib
from collections.abc import Callable
from importlib import metadata
from types import ModuleType

import torch

from ..kv_format import DS_MLA_ROW_BYTES, DS_V4_WIDTH, ds_mla_v4_pages

INTERFACE = "vllm.third_party.flashmla.flash_mla_interface"
# What vLLM 0.33's FLASHMLA_SPARSE backend imports FlashMLA through: it re-exports INTERFACE's
# functions where FlashMLA's build runs on this GPU and says why not otherwise.
VLLM_OP = "vllm.v1.attention.ops.flashmla"
TESTED_VLLM = "0.33"

HEAD_DIM = 576  # 512 latent + 64 rope: the only width both FlashMLA calls take here
HEAD_DIM_V = 512
MAX_HEADS = 128
SPARSE_FWD_HEAD_MULTIPLE = 64  # vLLM's FlashMLASparseImpl.prefill_padding
FP8_DECODE_HEADS = (64, 128)  # the only h_q FlashMLA's sparse decode takes
FP8_MIXED_BATCH_BELOW_HEADS = 32  # vLLM's MIN_HEADS_FOR_BF16_PREFILL
DS_MLA_PAGE = 64  # rows per page FlashMLA's fp8 decode reads (vLLM's _fp8_kv_pages)


class PeerUnavailable(RuntimeError):
    """FlashMLA cannot be imported here; the message is one line for the user."""


def _one_line(e: BaseException) -> str:
    return " ".join(f"{type(e).__name__}: {e}".split())


def _vllm_version() -> str | None:
    """The installed vLLM distribution's version, or None (a folder named ``vllm`` on
    ``PYTHONPATH``, as the manual route makes, has no distribution metadata)."""
    try:
        return metadata.version("vllm")
    except metadata.PackageNotFoundError:
        return None


def load() -> ModuleType:
    """Import FlashMLA's interface (vLLM 0.33's build), or raise :class:`PeerUnavailable`.

    With vLLM installed (``pip install 'triton-mla-sparse[vllm]'``) nothing else is needed:
    vLLM's op module decides whether its FlashMLA runs here, and the interface comes from
    vLLM's package. Without vLLM, the interface and its ``.so`` are imported from
    ``PYTHONPATH``."""
    version = _vllm_version()
    if version is not None:
        try:
            ok, reason = importlib.import_module(VLLM_OP).is_flashmla_sparse_supported()
        except Exception as e:  # an incompatible vLLM: its module or function differs
            ok, reason = False, f"{VLLM_OP} did not answer ({_one_line(e)})"
        if not ok:
            other = (
                ""
                if version.startswith(TESTED_VLLM + ".")
                else (
                    f"; the comparison is written against vLLM {TESTED_VLLM} "
                    f"(pip install 'triton-mla-sparse[vllm]')"
                )
            )
            raise PeerUnavailable(
                f"--compare flashmla: vLLM {version} is installed and its FlashMLA does not run "
                f"here: {reason}{other}"
            )
    try:
        return importlib.import_module(INTERFACE)
    except Exception as e:  # ImportError, or OSError/undefined symbols from the .so
        if version is not None:
            how = f"vLLM {version} is installed and reports FlashMLA available"
        else:
            how = (
                f"install vLLM {TESTED_VLLM}, which ships it (pip install "
                "'triton-mla-sparse[vllm]'); without vLLM, put vLLM's "
                "vllm/_flashmla_C.abi3.so and vllm/third_party/flashmla/flash_mla_interface.py, "
                "with an empty vllm/__init__.py, on PYTHONPATH"
            )
        raise PeerUnavailable(
            f"--compare flashmla: cannot import {INTERFACE} ({_one_line(e)}); {how}"
        ) from e


def unsupported(
    kv_format: str, dtype: torch.dtype, width: int, heads: int, decode: bool
) -> str | None:
    """Why this case has no FlashMLA counterpart here, or None if it has one.

    An fp8_ds_mla prefill has one below 32 heads only: there vLLM's mixed batch runs the prefill
    tokens through the fp8 decode kernel as well; from 32 heads it upconverts the cache to bf16
    with its own CUDA op and calls sparse_fwd, which is not reproduced here.
    """
    if dtype != torch.bfloat16:
        return f"FlashMLA takes bf16 queries only, the case has {dtype}"
    if kv_format == "fp8_ds_mla_v4":
        if width != DS_V4_WIDTH:
            return f"the V4 record is {DS_V4_WIDTH} wide, the case has {width}"
        if decode:
            return None
        return "vLLM runs a DeepSeek-V4 prefill through sparse_fwd on a bf16 gather of both caches"
    if width != HEAD_DIM:
        return f"only the {HEAD_DIM}-wide (512 + 64 rope) layout is compared, the case has {width}"
    if kv_format == "auto":
        return None
    if kv_format == "fp8_ds_mla":
        if decode or heads < FP8_MIXED_BATCH_BELOW_HEADS:
            return None
        return "vLLM runs an fp8_ds_mla prefill from 32 heads on a bf16 upconversion of the cache"
    return f"FlashMLA has no kv_format {kv_format!r}"


def _check_heads(heads: int) -> None:
    if not 1 <= heads <= MAX_HEADS:
        raise ValueError(f"heads must be in [1, {MAX_HEADS}], got {heads}")


def sparse_fwd_heads(heads: int) -> int:
    """Heads ``flash_mla_sparse_fwd`` runs for ``heads`` query heads (vLLM pads to 64s)."""
    _check_heads(heads)
    m = SPARSE_FWD_HEAD_MULTIPLE
    return -(-heads // m) * m


def fp8_decode_heads(heads: int) -> int:
    """Heads FlashMLA's fp8 sparse decode runs for ``heads`` query heads (64 or 128)."""
    _check_heads(heads)
    return FP8_DECODE_HEADS[0] if heads <= FP8_DECODE_HEADS[0] else FP8_DECODE_HEADS[1]


def fp8_decode_layout(tokens: int, heads: int) -> tuple[int, int]:
    """``(batch, seq_len_q)`` vLLM gives the fp8 decode for ``tokens`` decode tokens."""
    _check_heads(heads)
    return (1, tokens) if heads < FP8_MIXED_BATCH_BELOW_HEADS else (tokens, 1)


def pad_heads(q: torch.Tensor, heads_padded: int) -> torch.Tensor:
    """Contiguous ``[T, heads_padded, D]`` copy of ``q [T, H, D]``, zeros in the added heads."""
    if q.dim() != 3 or q.shape[1] > heads_padded:
        raise ValueError(
            f"q must be [T, H, D] with H <= {heads_padded}, got shape {tuple(q.shape)}"
        )
    out = q.new_zeros(q.shape[0], heads_padded, q.shape[2])
    out[:, : q.shape[1]] = q
    return out


def _valid_entries(
    indices: torch.Tensor, num_rows: int, valid_counts: torch.Tensor | None
) -> torch.Tensor:
    if indices.dtype != torch.int32:
        raise TypeError(f"indices must be torch.int32, got {indices.dtype}")
    if indices.dim() != 2:
        raise ValueError(f"indices must be [T, W], got shape {tuple(indices.shape)}")
    valid = (indices >= 0) & (indices < num_rows)
    if valid_counts is not None:
        if valid_counts.shape != (indices.shape[0],):
            raise ValueError(
                f"valid_counts must be [T] = [{indices.shape[0]}], got shape "
                f"{tuple(valid_counts.shape)}"
            )
        pos = torch.arange(indices.shape[1], device=indices.device)
        valid &= pos[None, :] < valid_counts.to(indices.device).long()[:, None]
    return valid


def physical_indices(
    indices: torch.Tensor, num_rows: int, valid_counts: torch.Tensor | None = None
) -> torch.Tensor:
    """int32 ``[T, W]``: each valid entry where it stands, -1 elsewhere (vLLM's fp8 path)."""
    valid = _valid_entries(indices, num_rows, valid_counts)
    return torch.where(valid, indices, -1).to(torch.int32).contiguous()


def compacted_indices(
    indices: torch.Tensor, num_rows: int, valid_counts: torch.Tensor | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(indices int32 [T, W], topk_length int32 [T])``: per token its valid entries first, in
    their order, then -1, and how many are valid (vLLM's conversion with return_valid_counts)."""
    valid = _valid_entries(indices, num_rows, valid_counts)
    # A stable sort on "invalid" moves the valid entries to the front and keeps their order.
    order = torch.sort((~valid).to(torch.int8), dim=1, stable=True).indices
    packed = torch.where(valid, indices, -1).gather(1, order).to(torch.int32).contiguous()
    return packed, valid.sum(dim=1, dtype=torch.int32)


def sparse_fwd_kv(kv_cache: torch.Tensor) -> torch.Tensor:
    """The cache as ``flash_mla_sparse_fwd`` reads it: a view ``[rows, 1, 576]`` of
    ``[rows, 576]`` or of a paged ``[blocks, page, 576]`` whose blocks lie back to back."""
    d = kv_cache.shape[-1]
    ok = kv_cache.dim() in (2, 3) and d == HEAD_DIM and kv_cache.stride(-1) == 1
    ok = ok and (kv_cache.dim() == 2 or kv_cache.stride(1) == d)
    ok = ok and kv_cache.stride(0) == (d if kv_cache.dim() == 2 else kv_cache.shape[1] * d)
    if not ok:
        raise ValueError(
            f"kv_cache must be [rows, {HEAD_DIM}] or [blocks, page, {HEAD_DIM}] with contiguous "
            f"rows and blocks, got shape {tuple(kv_cache.shape)} strides {kv_cache.stride()}"
        )
    return kv_cache.view(-1, 1, d)


def ds_mla_pages(kv_cache: torch.Tensor) -> torch.Tensor:
    """An fp8_ds_mla cache as FlashMLA's fp8 decode reads it: uint8 ``[blocks, 64, 1, 656]``.

    A ``[blocks, 64, 656]`` cache is viewed as is (any block stride, contiguous rows in a block);
    ``[rows, 656]`` and ``[blocks, page, 656]`` with page a multiple of 64 must be contiguous.
    """
    if kv_cache.dtype != torch.uint8:
        raise TypeError(f"an fp8_ds_mla kv_cache must be torch.uint8, got {kv_cache.dtype}")
    shape, stride = tuple(kv_cache.shape), kv_cache.stride()
    b = DS_MLA_ROW_BYTES
    if kv_cache.dim() == 3 and shape[1:] == (DS_MLA_PAGE, b) and stride[1:] == (b, 1):
        return kv_cache.unsqueeze(-2)
    rows = kv_cache.shape[0] * (kv_cache.shape[1] if kv_cache.dim() == 3 else 1)
    contiguous = kv_cache.dim() in (2, 3) and shape[-1] == b and kv_cache.is_contiguous()
    if contiguous and rows % DS_MLA_PAGE == 0:
        return kv_cache.reshape(-1, DS_MLA_PAGE, 1, b)
    raise ValueError(
        f"kv_cache must be uint8 [blocks, {DS_MLA_PAGE}, {b}] with contiguous blocks, or "
        f"contiguous [rows, {b}] / [blocks, page, {b}] with a multiple of {DS_MLA_PAGE} rows; "
        f"got shape {shape} strides {stride}"
    )


def v4_pages(kv_cache: torch.Tensor) -> torch.Tensor:
    """A V4 record cache as FlashMLA's decode reads it: uint8 ``[blocks, page, 1, 584]``, a view
    that keeps the page stride (``kv_cache.unsqueeze(-2)``, as vLLM hands it over)."""
    return ds_mla_v4_pages(kv_cache).unsqueeze(-2)


def describe(t: torch.Tensor) -> str:
    """``shape dtype strides`` of a tensor handed to FlashMLA (for diagnostics)."""
    c = " contiguous" if t.is_contiguous() else ""
    return f"{tuple(t.shape)} {str(t.dtype).replace('torch.', '')} stride {t.stride()}{c}"


@dataclasses.dataclass
class PeerCall:
    """One FlashMLA call, prepared: ``run()`` makes it and returns the output ``[T, H, 512]``
    (a view of FlashMLA's head-padded output). ``args`` describes what is passed."""

    function: str
    label: str
    args: dict[str, str]
    run: Callable[[], torch.Tensor]


def prepare_call(
    fmla: ModuleType,
    q: torch.Tensor,
    kv_cache: torch.Tensor,
    indices: torch.Tensor,
    softmax_scale: float,
    kv_format: str,
    valid_counts: torch.Tensor | None = None,
    attn_sink: torch.Tensor | None = None,
    extra_kv_cache: torch.Tensor | None = None,
    extra_indices: torch.Tensor | None = None,
    extra_valid_counts: torch.Tensor | None = None,
) -> PeerCall:
    """The FlashMLA call vLLM 0.33 makes for these inputs (bf16 ``"auto"`` cache: sparse_fwd;
    ``"fp8_ds_mla"``: the fp8 sparse decode; ``"fp8_ds_mla_v4"``: DeepSeek-V4's decode, with
    the extra set as its compressed cache), with its inputs laid out and padded. All take
    ``attn_sink`` float32 ``[H]`` (padded heads get -inf: no effect; their rows are dropped).

    ``q`` bf16 ``[T, H, 576]`` (V4: ``[T, H, 512]``), ``H`` in 1..128; ``indices`` int32
    ``[T, W]`` flat cache rows; ``kv_cache`` as :func:`sparse_fwd_kv` / :func:`ds_mla_pages` /
    :func:`v4_pages` take it; ``fmla`` the module :func:`load` returns. The extra set
    (``extra_kv_cache``, ``extra_indices`` ``[T, W2]``, ``extra_valid_counts``) is V4's only.
    """
    v4 = kv_format == "fp8_ds_mla_v4"
    dim = DS_V4_WIDTH if v4 else HEAD_DIM
    if not isinstance(q, torch.Tensor):
        raise TypeError(f"q must be a tensor [T, H, {dim}], got {type(q).__name__}")
    if q.dtype != torch.bfloat16:
        raise TypeError(f"q must be torch.bfloat16 for FlashMLA, got {q.dtype}")
    if q.dim() != 3 or q.shape[2] != dim:
        raise ValueError(f"q must be [T, H, {dim}], got shape {tuple(q.shape)}")
    t, h = q.shape[0], q.shape[1]
    _check_heads(h)
    if indices.dim() != 2 or indices.shape[0] != t:
        raise ValueError(
            f"indices must be [T, W] with T = {t} (q {tuple(q.shape)}), got shape "
            f"{tuple(indices.shape)}"
        )
    extra = (extra_kv_cache, extra_indices, extra_valid_counts)
    if (extra_kv_cache is None) != (extra_indices is None):
        raise ValueError("extra_kv_cache and extra_indices go together")
    if extra_kv_cache is not None and not v4:
        raise ValueError(
            f"an extra index set is FlashMLA's DeepSeek-V4 decode's (kv_format='fp8_ds_mla_v4'), "
            f"not kv_format={kv_format!r}'s"
        )
    if v4:
        if extra_indices is not None and tuple(extra_indices.shape[:1]) != (t,):
            raise ValueError(
                f"extra_indices must be [T, W2] with T = {t}, got shape "
                f"{tuple(extra_indices.shape)}"
            )
        return _v4_decode_call(
            fmla, q, kv_cache, indices, softmax_scale, valid_counts, attn_sink, *extra
        )
    if kv_format == "auto":
        return _sparse_fwd_call(fmla, q, kv_cache, indices, softmax_scale, valid_counts, attn_sink)
    if kv_format == "fp8_ds_mla":
        return _fp8_decode_call(fmla, q, kv_cache, indices, softmax_scale, valid_counts, attn_sink)
    raise ValueError(
        f"kv_format must be 'auto', 'fp8_ds_mla' or 'fp8_ds_mla_v4' for FlashMLA, got {kv_format!r}"
    )


def _sink_kwargs(attn_sink: torch.Tensor | None, heads: int) -> dict:
    """FlashMLA's ``attn_sink`` for ``heads`` padded heads (none when there is no sink)."""
    if attn_sink is None:
        return {}
    pad = torch.full((heads,), float("-inf"), dtype=torch.float32, device=attn_sink.device)
    pad[: attn_sink.shape[0]] = attn_sink
    return {"attn_sink": pad}


def _sparse_fwd_call(fmla, q, kv_cache, indices, scale, valid_counts, attn_sink) -> PeerCall:
    if kv_cache.dtype != torch.bfloat16:
        raise TypeError(f"a bf16 ('auto') kv_cache must be torch.bfloat16, got {kv_cache.dtype}")
    t, h = q.shape[0], q.shape[1]
    hp = sparse_fwd_heads(h)
    kv = sparse_fwd_kv(kv_cache)
    idx, lengths = compacted_indices(indices, kv.shape[0], valid_counts)
    idx = idx.view(t, 1, -1)
    qp = pad_heads(q, hp)
    sink = _sink_kwargs(attn_sink, hp)

    def run() -> torch.Tensor:
        out, _max_logits, _lse = fmla.flash_mla_sparse_fwd(
            qp, kv, idx, scale, topk_length=lengths, **sink
        )
        return out[:, :h]

    args = {
        "q": describe(qp),
        "kv": describe(kv),
        "indices": describe(idx),
        "sm_scale": repr(scale),
        "topk_length": describe(lengths),
        **{k: describe(v) for k, v in sink.items()},
    }
    return PeerCall("flash_mla_sparse_fwd", f"sparse_fwd h{hp}", args, run)


def _fp8_decode_call(fmla, q, kv_cache, indices, scale, valid_counts, attn_sink) -> PeerCall:
    t, h = q.shape[0], q.shape[1]
    hp = fp8_decode_heads(h)
    b, s = fp8_decode_layout(t, h)
    k_cache = ds_mla_pages(kv_cache)
    rows = k_cache.shape[0] * DS_MLA_PAGE
    idx = physical_indices(indices, rows, valid_counts).view(b, s, -1)
    qp = pad_heads(q, hp).view(b, s, hp, HEAD_DIM)
    block_table = torch.zeros(b, 1, dtype=torch.int32, device=q.device)
    cache_seqlens = torch.full((b,), rows, dtype=torch.int32, device=q.device)
    sched_meta, _ = fmla.get_mla_metadata()
    sink = _sink_kwargs(attn_sink, hp)

    def run() -> torch.Tensor:
        out, _lse = fmla.flash_mla_with_kvcache(
            q=qp,
            k_cache=k_cache,
            block_table=block_table,
            head_dim_v=HEAD_DIM_V,
            cache_seqlens=cache_seqlens,
            tile_scheduler_metadata=sched_meta,
            is_fp8_kvcache=True,
            indices=idx,
            softmax_scale=scale,
            **sink,
        )
        return out[0, :, :h] if b == 1 else out[:, 0, :h]

    args = {
        "q": describe(qp),
        "k_cache": describe(k_cache),
        "block_table": describe(block_table),
        "cache_seqlens": describe(cache_seqlens),
        "head_dim_v": str(HEAD_DIM_V),
        "is_fp8_kvcache": "True",
        "indices": describe(idx),
        "softmax_scale": repr(scale),
        **{k: describe(v) for k, v in sink.items()},
    }
    return PeerCall("flash_mla_with_kvcache", f"kvcache fp8 h{hp} b{b}xs{s}", args, run)


def _v4_decode_call(
    fmla, q, kv_cache, indices, scale, valid_counts, attn_sink, xcache, xindices, xcounts
) -> PeerCall:
    if kv_cache.dtype != torch.uint8:
        raise TypeError(f"an fp8_ds_mla_v4 kv_cache must be torch.uint8, got {kv_cache.dtype}")
    t, h = q.shape[0], q.shape[1]
    hp = fp8_decode_heads(h)  # vLLM's get_padded_num_q_heads for V4: 64 or 128
    k_cache = v4_pages(kv_cache)
    # slots, valid first, and how many (as vLLM's SWA indices and topk lengths): [T, 1, W]
    idx, lengths = compacted_indices(indices, k_cache.shape[0] * k_cache.shape[1], valid_counts)
    idx = idx.view(t, 1, -1)
    qp = pad_heads(q, hp).view(t, 1, hp, DS_V4_WIDTH)
    out = torch.empty(t, 1, hp, HEAD_DIM_V, dtype=q.dtype, device=q.device)
    extra: dict[str, torch.Tensor] = {}
    if xcache is not None:
        if xcache.dtype != torch.uint8:
            raise TypeError(f"an fp8_ds_mla_v4 extra cache must be torch.uint8, got {xcache.dtype}")
        xk = v4_pages(xcache)
        xidx, xlengths = compacted_indices(xindices, xk.shape[0] * xk.shape[1], xcounts)
        extra = {
            "extra_k_cache": xk,
            "extra_indices_in_kvcache": xidx.view(t, 1, -1),
            "extra_topk_length": xlengths,
        }
    sched_meta, _ = fmla.get_mla_metadata()
    sink = _sink_kwargs(attn_sink, hp)

    def run() -> torch.Tensor:
        fmla.flash_mla_with_kvcache(
            q=qp,
            k_cache=k_cache,
            block_table=None,
            head_dim_v=HEAD_DIM_V,
            tile_scheduler_metadata=sched_meta,
            cache_seqlens=None,
            is_fp8_kvcache=True,
            indices=idx,
            topk_length=lengths,
            softmax_scale=scale,
            **sink,
            **extra,
            out=out,
        )
        return out[:, 0, :h]

    args = {
        "q": describe(qp),
        "k_cache": describe(k_cache),
        "block_table": "None",
        "cache_seqlens": "None",
        "head_dim_v": str(HEAD_DIM_V),
        "is_fp8_kvcache": "True",
        "indices": describe(idx),
        "topk_length": describe(lengths),
        "softmax_scale": repr(scale),
        **{k: describe(v) for k, v in {**sink, **extra}.items()},
        "out": describe(out),
    }
    label = f"kvcache v4 h{hp} b{t}xs1" + (" +extra" if extra else "")
    return PeerCall("flash_mla_with_kvcache", label, args, run)
