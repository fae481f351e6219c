"""Adapters that stand in for vLLM 0.33's DeepGEMM and fp8-only indexer calls (glue only).

:func:`build` makes the replacement of one target (:mod:`.vllm_signatures`) from the vLLM
object it replaces, which :mod:`.indexer_install` hands over when it installs it: ``fused_q`` and
``fused_norm_rope`` delegate to vLLM's function for the parts that need no fp8 types, the
out-of-tree ``SparseAttnIndexer`` subclasses vLLM's class, and the logits and metadata functions
replace DeepGEMM's outright. Each keeps the signature and return convention of what it replaces.
Kernels: the Triton indexer logits (:mod:`triton_mla_sparse.indexer`, imported on first call),
:func:`index_q_rope` and :func:`write_mla_cache`.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from ..ops.index_q import index_q_rope
from ..ops.mla_cache import write_mla_cache
from .vllm_signatures import ATT, IDX, INDEXER_OP, OOT, SAI

# The index query handed to the indexer on SM80/86. False: bf16 (the model dtype), unquantised;
# the weights carry softmax_scale * H^-0.5 only. True would round it to SM90's e4m3 grid (scale
# folded into the weights). bf16 is chosen: it is closer to the exact indexer (the measured
# comparison is in tests/plugin/test_vllm_indexer.py::test_index_q_precision_choice and
# docs/VLLM.md), needs no quantisation pass, and the K side stays e4m3 as on SM90 (same cache).
INDEX_Q_EMULATE_FP8 = False
# Index-K quantisation: one power-of-two (ue8m0) scale per 128 values, as the fused writer.
INDEX_K_QUANT_BLOCK = 128
INDEX_K_SCALE_FMT = "ue8m0"
# vLLM MLA cache dtypes whose fused writer needs fp8 types -> this plugin's writer format
# e4m3 index queries the out-of-tree SparseAttnIndexer casts (exactly) to the model dtype
E4M3_DTYPES = (torch.float8_e4m3fn, torch.float8_e4m3fnuz)
FP8_MLA_FORMATS = {"fp8": "fp8", "fp8_e4m3": "fp8", "fp8_ds_mla": "fp8_ds_mla"}

_schedule: dict[tuple[torch.device, int], torch.Tensor] = {}


def _q_values(q: Any, fn: str) -> torch.Tensor:
    """vLLM's ``(values, scales)`` query tuple -> the values the Triton kernels take."""
    if not isinstance(q, tuple) or len(q) != 2:
        raise TypeError(f"{fn}: q must be vLLM's (values, scales) tuple, got {type(q).__name__}")
    values, scales = q
    if scales is not None:
        raise NotImplementedError(
            f"{fn}: MXFP4 index queries (q scales {tuple(scales.shape)}) are not supported by "
            "triton_mla_sparse's indexer (fp8/bf16 queries with the scale folded into weights)"
        )
    return values  # e4m3 (SM89, stock fused_q) or bf16 (SM80/86, this plugin's fused_q)


def fp8_fp4_mqa_logits(
    q: tuple[torch.Tensor, torch.Tensor | None],
    kv: tuple[torch.Tensor, torch.Tensor],
    weights: torch.Tensor,
    cu_seqlen_ks: torch.Tensor,
    cu_seqlen_ke: torch.Tensor,
    max_seqlen_k: int,
) -> torch.Tensor:
    """vLLM's prefill logits (utils/deep_gemm.py:638): compressed float32 [M, max_seqlen_k]."""
    from triton_mla_sparse.indexer import mqa_logits

    k, k_scale = kv
    return mqa_logits(
        _q_values(q, "fp8_fp4_mqa_logits"),
        k,
        k_scale,
        weights,
        cu_seqlen_ks,
        cu_seqlen_ke,
        max_seqlen_k,
    )


def fp8_fp4_paged_mqa_logits(
    q: tuple[torch.Tensor, torch.Tensor | None],
    kv_cache: torch.Tensor,
    weights: torch.Tensor,
    context_lens: torch.Tensor,
    block_tables: torch.Tensor,
    schedule_metadata: torch.Tensor,
    max_model_len: int,
    indices: torch.Tensor | None = None,
) -> torch.Tensor:
    """vLLM's decode logits (utils/deep_gemm.py:731): float32 [B * next_n, max_model_len].

    ``schedule_metadata`` (DeepGEMM's SM schedule) is not needed: the grid schedules the work.
    """
    from triton_mla_sparse.indexer import paged_mqa_logits

    if indices is not None:
        raise NotImplementedError(
            "fp8_fp4_paged_mqa_logits: the varlen form (indices, SM100 only) is not supported"
        )
    return paged_mqa_logits(
        _q_values(q, "fp8_fp4_paged_mqa_logits"),
        kv_cache,
        weights,
        context_lens,
        block_tables,
        max_model_len,
    )


def get_paged_mqa_logits_metadata(
    context_lens: torch.Tensor,
    block_size: int,
    num_sms: int,
    indices: torch.Tensor | None = None,
) -> torch.Tensor:
    """The builder's schedule buffer contents: zeros of the builder's shape, ``[num_sms + 1, 2]``
    int32, cached per device (the Triton kernels ignore them; vLLM copies them into its buffer
    and asserts the shape, v1/attention/backends/mla/indexer.py:1100, 1828-1836)."""
    key = (context_lens.device, int(num_sms))
    t = _schedule.get(key)
    if t is None:
        t = torch.zeros((num_sms + 1, 2), dtype=torch.int32, device=context_lens.device)
        _schedule[key] = t
    return t


def make_fused_q(stock: Callable[..., Any]) -> Callable[..., Any]:
    """The ``fused_q`` adapter around vLLM's ``stock`` one (which keeps the fp8 MQA query pack)."""

    def fused_q(
        positions: torch.Tensor,
        q_pe: torch.Tensor,
        q_pe_cos_sin_cache: torch.Tensor,
        index_q: torch.Tensor | None,
        index_q_cos_sin_cache: torch.Tensor | None,
        ql_nope: torch.Tensor,
        q_scale: torch.Tensor,
        index_weights: torch.Tensor | None,
        index_weights_softmax_scale: float,
        index_weights_head_scale: float,
        has_indexer: bool = True,
        index_rope_interleave: bool = False,
        quantize_mqa: bool = True,
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """vLLM's ``fused_q`` (models/deepseek_v32/common/kernels.py:1001) without fp8 types.

        Returns ``(index_q, index_weights_out, mqa_q)`` as vLLM's does, except that ``index_q`` is
        the rotated index query in its input dtype (bf16) with weights ``w * softmax_scale *
        head_scale`` (vLLM: e4m3 with the per-(token, head) scale folded into the weights).
        ``mqa_q`` is the rotated ``q_pe`` (the bf16 query path). The fp8 MQA query pack
        (``quantize_mqa``, FlashInfer's fp8 query) needs fp8 and goes to vLLM's kernel.
        """
        if quantize_mqa:
            return stock(
                positions,
                q_pe,
                q_pe_cos_sin_cache,
                index_q,
                index_q_cos_sin_cache,
                ql_nope,
                q_scale,
                index_weights,
                index_weights_softmax_scale,
                index_weights_head_scale,
                has_indexer,
                index_rope_interleave,
                quantize_mqa,
            )
        if not has_indexer:
            mqa_q, _, _ = index_q_rope(positions, q_pe, q_pe_cos_sin_cache)
            # as vLLM: small placeholders, never read on a layer without an indexer
            dummy_q = torch.empty((1, 1, 1), dtype=q_pe.dtype, device=q_pe.device)
            dummy_w = torch.empty((1, 1), dtype=torch.float32, device=q_pe.device)
            return dummy_q, dummy_w, mqa_q
        mqa_q, iq, w = index_q_rope(
            positions,
            q_pe,
            q_pe_cos_sin_cache,
            index_q,
            index_q_cos_sin_cache,
            index_weights,
            index_weights_softmax_scale * index_weights_head_scale,
            interleave=index_rope_interleave,
            emulate_fp8=INDEX_Q_EMULATE_FP8,
        )
        return iq, w, mqa_q  # type: ignore[return-value]

    return fused_q


def make_fused_norm_rope(stock: Callable[..., Any]) -> Callable[..., Any]:
    """The ``fused_norm_rope`` adapter around vLLM's ``stock`` one (run without its fp8 stores)."""

    def fused_norm_rope(
        positions: torch.Tensor,
        q_c: torch.Tensor,
        q_rms_norm_w: torch.Tensor,
        q_rms_eps: float,
        kv_c: torch.Tensor,
        kv_rms_norm_w: torch.Tensor,
        kv_rms_eps: float,
        k_pe: torch.Tensor,
        k_rope_cos_sin_cache: torch.Tensor,
        index_k: torch.Tensor | None,
        index_k_layer_norm_w: torch.Tensor | None,
        index_k_layer_norm_bias: torch.Tensor | None,
        index_k_layer_norm_eps: float,
        index_k_rope_cos_sin_cache: torch.Tensor | None,
        topk_indices_buffer: torch.Tensor,
        slot_mapping: torch.Tensor | None = None,
        indexer_slot_mapping: torch.Tensor | None = None,
        indexer_k_cache: torch.Tensor | None = None,
        indexer_cache_shuffled: bool = False,
        mla_kv_cache: torch.Tensor | None = None,
        mla_kv_cache_dtype: str = "auto",
        mla_k_scale: torch.Tensor | None = None,
        has_indexer: bool = True,
        index_rope_interleave: bool = False,
        q_c_out: torch.Tensor | None = None,
        kv_c_out: torch.Tensor | None = None,
        k_pe_out: torch.Tensor | None = None,
        index_k_out: torch.Tensor | None = None,
        skip_scale: bool = False,
    ) -> torch.Tensor:
        """vLLM's ``fused_norm_rope`` (kernels.py:520) with its fp8 cache writes split out.

        vLLM's kernel runs as is without the fp8 stores (what sm80/86 cannot compile) and hands out,
        in float32, the values its fused writers would quantise:

        - the normed, rotated index K: vLLM's CUDA op ``indexer_k_quant_and_cache`` (sm80 cubins,
          float32 input) writes the same 132-byte layout with the same rule, one ue8m0 scale
          ``2^ceil(log2(max(amax, 1e-4) / 448))`` per token, e4m3 values ``k / scale``;
        - with an fp8 MLA cache (``fp8``, ``fp8_e4m3``, ``fp8_ds_mla``), the normed latent and
          rotated rope: :func:`write_mla_cache` writes the row with the fused writer's rule and
          integer e4m3 encoding. bf16/fp16 MLA caches stay in vLLM's kernel.
        """
        args = dict(
            slot_mapping=slot_mapping,
            indexer_slot_mapping=indexer_slot_mapping,
            indexer_k_cache=indexer_k_cache,
            indexer_cache_shuffled=indexer_cache_shuffled,
            mla_kv_cache=mla_kv_cache,
            mla_kv_cache_dtype=mla_kv_cache_dtype,
            mla_k_scale=mla_k_scale,
            has_indexer=has_indexer,
            index_rope_interleave=index_rope_interleave,
            q_c_out=q_c_out,
            kv_c_out=kv_c_out,
            k_pe_out=k_pe_out,
            index_k_out=index_k_out,
            skip_scale=skip_scale,
        )
        head = (
            positions,
            q_c,
            q_rms_norm_w,
            q_rms_eps,
            kv_c,
            kv_rms_norm_w,
            kv_rms_eps,
            k_pe,
            k_rope_cos_sin_cache,
            index_k,
            index_k_layer_norm_w,
            index_k_layer_norm_bias,
            index_k_layer_norm_eps,
            index_k_rope_cos_sin_cache,
            topk_indices_buffer,
        )
        split_index = indexer_k_cache is not None and has_indexer and index_k is not None
        mla_format = FP8_MLA_FORMATS.get(mla_kv_cache_dtype) if mla_kv_cache is not None else None
        if not split_index and mla_format is None:
            return stock(*head, **args)
        if split_index:
            if indexer_cache_shuffled:
                raise NotImplementedError(
                    "fused_norm_rope: the shuffled indexer-cache layout (ROCm) is not written here"
                )
            if index_k.shape[-1] != INDEX_K_QUANT_BLOCK:
                raise ValueError(
                    f"fused_norm_rope: index_k must have {INDEX_K_QUANT_BLOCK} values per token "
                    f"(one scale each), got {tuple(index_k.shape)}"
                )
            k32 = torch.empty(index_k.shape, dtype=torch.float32, device=index_k.device)
            args.update(indexer_k_cache=None, index_k_out=k32)
        if mla_format is not None:
            # the normed latent and rotated rope in float32, the values vLLM's writer quantises
            kv32 = torch.empty(kv_c.shape, dtype=torch.float32, device=kv_c.device)
            pe32 = torch.empty(k_pe.shape, dtype=torch.float32, device=k_pe.device)
            args.update(mla_kv_cache=None, kv_c_out=kv32, k_pe_out=pe32)
        out = stock(*head, **args)
        if split_index:
            if index_k_out is not None:
                index_k_out.copy_(k32)
            slots = indexer_slot_mapping if indexer_slot_mapping is not None else slot_mapping
            if slots is not None:
                from vllm import _custom_ops as ops

                n = min(slots.shape[0], k32.shape[0])
                ops.indexer_k_quant_and_cache(
                    k32[:n], indexer_k_cache, slots[:n], INDEX_K_QUANT_BLOCK, INDEX_K_SCALE_FMT
                )
        if mla_format is not None:
            if kv_c_out is not None:
                kv_c_out.copy_(kv32)
            if k_pe_out is not None:
                k_pe_out.copy_(pe32)
            if slot_mapping is not None:
                n = min(slot_mapping.shape[0], kv32.shape[0])
                scale = None if skip_scale or mla_format != "fp8" else mla_k_scale
                if scale is not None:
                    scale = scale.reshape(1).float()
                write_mla_cache(kv32, pe32, slot_mapping[:n], mla_kv_cache, mla_format, scale)
        return out

    return fused_norm_rope


def make_sparse_attn_indexer(base: type) -> type:
    """An out-of-tree ``SparseAttnIndexer`` with no fp8-typed Triton kernel on its path (SM80/86).

    - Warm-up: vLLM's ``__init__`` registers ``pack_seq`` for the fp8 query dtype
      (sparse_attn_indexer.py:1066-1077), which Triton cannot compile below SM89, and a failed
      warm-up aborts start-up. The registrations made by vLLM's ``__init__`` are collected aside
      and replayed with the fp8 dtype swapped for the model dtype.
    - Forward: an e4m3 index query (HY V4's, from vLLM's CUDA ``per_token_group_quant_fp8``,
      models/hy_v4/nvidia/attention.py:259-266; its scale is already in the weights) is cast to
      the model dtype first. The cast is exact (every e4m3 value is an fp16/bf16/fp32 value), so the
      logits are unchanged, and the decode path's ``pack_seq`` (sparse_attn_indexer.py:834, taken
      for uneven decode lengths, e.g. speculative decoding) then packs the dtype that was warmed
      up instead of compiling an fp8 Triton kernel. DeepSeek-V3.2's query on this path is
      already in the model dtype (this plugin's ``fused_q``) and is passed through.

    Everything else is vLLM's class.
    """

    class TritonSparseAttnIndexer(base):  # type: ignore[misc, valid-type]
        def __init__(self, *args: Any, **kwargs: Any) -> None:
            from vllm.config import get_current_vllm_config
            from vllm.model_executor.warmup.jit_warmup import JitWarmupRegistry
            from vllm.platforms import current_platform
            from vllm.v1.attention.ops.common import _PACK_SEQ_TRITON_KERNEL

            aside = JitWarmupRegistry(None)
            with aside.activate():
                super().__init__(*args, **kwargs)
            fp8 = current_platform.fp8_dtype()
            model_config = get_current_vllm_config().model_config
            q_dtype = getattr(model_config, "dtype", torch.bfloat16)
            self.index_q_dtype = q_dtype
            for kernel, regs in getattr(aside, "_registrations", {}).items():
                for a, kw in regs:
                    if kernel is _PACK_SEQ_TRITON_KERNEL and kw.get("dtype") == fp8:
                        kw = {**kw, "dtype": q_dtype}
                    JitWarmupRegistry.register(kernel, *a, **kw)

        def forward_cuda(
            self,
            hidden_states: torch.Tensor,
            q_quant: torch.Tensor | tuple[torch.Tensor, torch.Tensor],
            k: torch.Tensor | None,
            weights: torch.Tensor,
        ) -> torch.Tensor:
            if isinstance(q_quant, torch.Tensor) and q_quant.dtype in E4M3_DTYPES:
                q_quant = q_quant.to(self.index_q_dtype)
            return super().forward_cuda(hidden_states, q_quant, k, weights)

    TritonSparseAttnIndexer.__qualname__ = TritonSparseAttnIndexer.__name__
    return TritonSparseAttnIndexer


# target attribute -> builder of its replacement from the object it replaces
_BUILDERS: dict[str, Callable[[Any], Any]] = {
    "fp8_fp4_mqa_logits": lambda original: fp8_fp4_mqa_logits,
    "fp8_fp4_paged_mqa_logits": lambda original: fp8_fp4_paged_mqa_logits,
    "get_paged_mqa_logits_metadata": lambda original: get_paged_mqa_logits_metadata,
    "fused_q": make_fused_q,
    "fused_norm_rope": make_fused_norm_rope,
    INDEXER_OP: make_sparse_attn_indexer,
}
# the modules whose globals hold the targets (for a readable error on an unknown target)
_MODULES = (SAI, IDX, ATT, OOT)


def build(target: str, original: Any) -> Any:
    """The replacement for ``target`` ("module.attribute"), built around ``original``: vLLM's
    function, or for the out-of-tree ``SparseAttnIndexer`` op vLLM's class (the base)."""
    module, _, attr = target.rpartition(".")
    if module not in _MODULES or attr not in _BUILDERS:
        raise KeyError(f"no adapter for {target}")
    return _BUILDERS[attr](original)
