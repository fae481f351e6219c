"""TRITON_MLA_SPARSE: a vLLM 0.33 sparse MLA backend on the Triton ``sparse_mla`` kernel.

Glue only, built on vLLM's sparse MLA common classes
(vllm/model_executor/layers/attention/sparse_mla_attention.py): the common metadata builder, the
common impl's ``forward_mqa`` (which converts the indexer's request-local top-k into physical
flat-row indices with per-row valid counts), and its dense-MHA prefill. This module adds
validation, the CUDA-graph support level, and ``_forward_mqa_kernel``, which hands vLLM's indices
and counts to :func:`triton_mla_sparse.sparse_mla` unchanged.

Attention sinks (HY V4's per-head learnable sink): the backend advertises ``supports_sink``; the
impl takes the layer's ``sinks`` impl kwarg (as vLLM's MLAAttention forwards it, the same contract
as HY V4's sink-capable FLASHMLA_SPARSE subclass and ROCm's sparse MLA impl) and hands it to the
kernel as ``attn_sink``. With a sink, dense-MHA prefill is off: vLLM's MLA prefill backends take no
sink, so prefill tokens would silently lose it.

Imported by vLLM (through ``AttentionBackendEnum.CUSTOM``) only when a layer uses the backend.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, ClassVar

import torch
from vllm.config.cache import CacheDType
from vllm.model_executor.layers.attention.sparse_mla_attention import (
    SparseMLACommonImpl,
    SparseMLACommonMetadata,
    SparseMLACommonMetadataBuilder,
)
from vllm.platforms.interface import DeviceCapability
from vllm.v1.attention.backend import (
    AttentionBackend,
    AttentionCGSupport,
    AttentionLayer,
    MultipleOf,
)
from vllm.v1.attention.backends.mla.sparse_utils import align_blocks_to_rows, flat_kv_row_view
from vllm.v1.attention.ops.metadata import compute_token_to_req_indices
from vllm.v1.kv_cache_interface import AttentionSpec

from triton_mla_sparse import sparse_mla
from triton_mla_sparse.kv_format import INDEXER_BLOCK_SIZE

from . import BACKEND_NAME, KV_FORMAT_OF

# Caches whose writer (vLLM's fused_norm_rope) needs Triton fp8 types, i.e. SM89+, unless this
# plugin's fp8-free writer is installed (TRITON_MLA_SPARSE_INDEXER not off); the kernel itself
# reads them anywhere (integer e4m3 decode).
FP8_CACHE_DTYPES = ("fp8", "fp8_e4m3", "fp8_ds_mla")
FP8_WRITER_MIN_CAPABILITY = (8, 9)
HEAD_SIZES = (576, 512)  # 512 latent + 64 rope; 512 for NoPE models
MIN_CAPABILITY = (8, 0)


class TritonMLASparseBackend(AttentionBackend):
    supported_dtypes: ClassVar[list[torch.dtype]] = [torch.float16, torch.bfloat16]
    supported_kv_cache_dtypes: ClassVar[list[CacheDType]] = list(KV_FORMAT_OF)  # type: ignore[assignment]

    @staticmethod
    def get_supported_kernel_block_sizes(kv_cache_spec: Any = None) -> list[int | MultipleOf]:
        # The kernel reads flat rows at any page size; the DSA indexer's K cache shares the MLA
        # cache's blocks and its paged logits need pages of INDEXER_BLOCK_SIZE (64) tokens.
        return [MultipleOf(INDEXER_BLOCK_SIZE)]

    @classmethod
    def customize_spec(cls, spec: AttentionSpec) -> AttentionSpec:
        return align_blocks_to_rows(spec)

    @staticmethod
    def get_name() -> str:
        return BACKEND_NAME

    @staticmethod
    def get_builder_cls() -> type[TritonMLASparseMetadataBuilder]:
        return TritonMLASparseMetadataBuilder

    @staticmethod
    def get_impl_cls() -> type[TritonMLASparseImpl]:
        return TritonMLASparseImpl

    @classmethod
    def get_supported_head_sizes(cls) -> list[int]:
        return list(HEAD_SIZES)

    @classmethod
    def is_mla(cls) -> bool:
        return True

    @classmethod
    def is_sparse(cls) -> bool:
        return True

    @classmethod
    def supports_sink(cls) -> bool:
        # A per-head float32 sink (one more softmax denominator term, no value row): the kernel's
        # attn_sink, read on the device (CUDA-graph safe). Dense-MHA prefill is turned off for a
        # layer with a sink (TritonMLASparseImpl.__init__), so every token gets it.
        return True

    @classmethod
    def supports_compute_capability(cls, capability: DeviceCapability) -> bool:
        return (capability.major, capability.minor) >= MIN_CAPABILITY

    @classmethod
    def validate_configuration(cls, *args: Any, **kwargs: Any) -> list[str]:
        """vLLM's checks, with its terse reasons spelled out for a person reading the error."""
        reasons = super().validate_configuration(*args, **kwargs)
        cap = kwargs.get("device_capability")
        cap_text = f"{cap.major}.{cap.minor}" if cap is not None else "?"
        detail = {
            "head_size not supported": (
                f"head size {kwargs.get('head_size')} not supported "
                f"(needs {HEAD_SIZES[0]} = 512 latent + 64 rope, or {HEAD_SIZES[1]} for NoPE)"
            ),
            "dtype not supported": (
                f"model dtype {kwargs.get('dtype')} not supported (float16 or bfloat16)"
            ),
            "kv_cache_dtype not supported": (
                f"kv cache dtype {kwargs.get('kv_cache_dtype')!r} not supported "
                f"(one of {', '.join(KV_FORMAT_OF)})"
            ),
            # "block_size not supported" stays verbatim: vLLM compares it (cuda.py:489-494).
            "MLA not supported": "not an MLA model",
            "non-MLA not supported": "not an MLA model (this backend serves MLA only)",
            "sparse not supported": "sparse-only backend",
            "non-sparse not supported": (
                "model has no sparse (DSA / lightning indexer) attention; "
                "this backend serves sparse MLA only"
            ),
            "compute capability not supported": (
                f"compute capability {cap_text} not supported (needs "
                f"{MIN_CAPABILITY[0]}.{MIN_CAPABILITY[1]} or newer)"
            ),
        }
        return [detail.get(r, r) for r in reasons]

    @classmethod
    def supports_combination(
        cls,
        head_size: int,
        dtype: torch.dtype,
        kv_cache_dtype: CacheDType | None,
        block_size: int | None,
        use_mla: bool,
        has_sink: bool,
        use_sparse: bool,
        use_mm_prefix: bool,
        device_capability: DeviceCapability,
    ) -> str | None:
        cap = (device_capability.major, device_capability.minor)
        # Below MIN_CAPABILITY the capability check already refuses, with its own reason.
        if (
            kv_cache_dtype in FP8_CACHE_DTYPES
            and MIN_CAPABILITY <= cap < FP8_WRITER_MIN_CAPABILITY
            and (why_not := _fp8_free_writer_missing(cap))
        ):
            return (
                f"kv cache dtype {kv_cache_dtype!r} needs compute capability 8.9+ "
                f"(this is {cap[0]}.{cap[1]}): vLLM's MLA cache writer (fused_norm_rope) "
                "quantises with Triton fp8 types, which sm80/86 lack, and this plugin's fp8-free "
                f"writer is not installed ({why_not}); use --kv-cache-dtype auto"
            )
        if kv_cache_dtype == "fp8_ds_mla" and head_size not in HEAD_SIZES:
            return f"fp8_ds_mla rows hold 512 latent + 64 rope values, not head size {head_size}"
        from vllm.config import get_current_vllm_config_or_none

        vllm_config = get_current_vllm_config_or_none()
        if vllm_config is None or vllm_config.model_config is None:
            return None
        hf = vllm_config.model_config.hf_text_config
        if not hasattr(hf, "index_topk"):
            return "model has no index_topk (not a DSA sparse-attention model)"
        kv_lora_rank = getattr(hf, "kv_lora_rank", 512)
        if kv_lora_rank != 512:
            return f"kv_lora_rank {kv_lora_rank} not supported (512)"
        rope = getattr(hf, "qk_rope_head_dim", 64)
        if kv_lora_rank + rope != head_size:
            return f"kv_lora_rank {kv_lora_rank} + qk_rope_head_dim {rope} != head size {head_size}"
        if vllm_config.parallel_config.decode_context_parallel_size > 1:
            return "decode context parallelism (DCP) not supported yet"
        return None


def _check_sinks(sinks: torch.Tensor | None, num_heads: int) -> torch.Tensor | None:
    """The ``sinks`` impl kwarg, checked: a floating tensor of this rank's ``num_heads`` values
    (any shape holding exactly that many, e.g. ``[H]`` or ``[1, H, 1]``)."""
    if sinks is None:
        return None
    if not isinstance(sinks, torch.Tensor) or not sinks.is_floating_point():
        raise TypeError(
            f"{BACKEND_NAME}: attention sinks must be a floating tensor of {num_heads} per-head "
            f"values, got {type(sinks).__name__} {getattr(sinks, 'dtype', '')}"
        )
    if sinks.numel() != num_heads:
        raise ValueError(
            f"{BACKEND_NAME}: attention sinks must hold one value per local query head "
            f"({num_heads}), got shape {tuple(sinks.shape)}"
        )
    return sinks


def _fp8_free_writer_missing(cap: tuple[int, int]) -> str:
    """Why this plugin does not replace vLLM's fused cache writer on ``cap`` (the indexer plan's
    reason, e.g. TRITON_MLA_SPARSE_INDEXER=off), or "" when it does: its own fp8 writer
    (vllm_plugin/indexer_install.py) makes fp8 MLA caches writable below SM89."""
    from .indexer_install import indexer_plan
    from .vllm_signatures import ATT

    plan = indexer_plan(cap)
    return "" if f"{ATT}.fused_norm_rope" in plan.targets else plan.reason


@dataclass
class TritonMLASparseMetadata(SparseMLACommonMetadata):
    pass


class TritonMLASparseMetadataBuilder(SparseMLACommonMetadataBuilder[TritonMLASparseMetadata]):
    metadata_cls = TritonMLASparseMetadata
    # The kernel is capturable at any token count (no host sync, no data-dependent allocation, a
    # launch config that is a static function of the captured shape). Uniform batches (decode,
    # spec-decode verification) are captured whole. Mixed batches are not: the dense-MHA prefill
    # path and the MHA/MQA split are planned on the host per batch, which a graph would freeze.
    _cudagraph_support: ClassVar[AttentionCGSupport] = AttentionCGSupport.UNIFORM_BATCH

    def __init__(
        self,
        kv_cache_spec: AttentionSpec,
        layer_names: list[str],
        vllm_config: Any,
        device: torch.device,
    ) -> None:
        super().__init__(kv_cache_spec, layer_names, vllm_config, device)
        num_q_heads = self.model_config.get_num_attention_heads(vllm_config.parallel_config)
        # The longest per-request query run as a decode (the sparse MQA kernel; longer ones
        # are prefills, which may take the dense-MHA path). vLLM's sparse MLA builders grow it
        # with the head count and agree on 128 for 16 and 32 heads, 256 for 64
        # (v1/attention/backends/mla/flashattn_mla_sparse.py:142,
        # flashmla_sparse.py:371). FLASH_ATTN_MLA_SPARSE's table has no 8-head entry (its
        # default, 256, is meant for large head counts); the builders that serve 8 heads and list
        # them, FlashInfer's sparse MLA (flashinfer_mla_sparse.py:268-270) and FlashMLA sparse on
        # SM100 (flashmla_sparse.py:366-369), put 8 with 16 and 32 at 128. 128 heads keep the
        # SM90 value, 256, not the SM100 kernels' 1024 (a choice for their own kernels); other
        # head counts follow the nearest band.
        threshold = {8: 128, 16: 128, 32: 128, 64: 256, 128: 256}.get(
            num_q_heads, 128 if num_q_heads < 64 else 256
        )
        self._init_reorder_batch_threshold(threshold, supports_spec_as_decode=True)
        self.supports_draft_decode_metadata_update = self.dcp_world_size == 1

    def update_draft_decode_metadata(self, metadata: SparseMLACommonMetadata) -> None:
        num_tokens = metadata.num_decode_tokens
        if num_tokens == 0:
            return
        # As FLASH_ATTN_MLA_SPARSE: the per-token request map is the one builder-owned buffer.
        compute_token_to_req_indices(
            metadata.query_start_loc, metadata.req_id_per_token, num_tokens, num_tokens
        )


class TritonMLASparseImpl(SparseMLACommonImpl[TritonMLASparseMetadata]):
    # Convert top-k per layer except for uniform decode of multi-layer index groups, where the
    # group's shared conversion is reused (as FLASH_ATTN_MLA_SPARSE does).
    group_conversion_decode_only: ClassVar[bool] = True
    # The kernel returns a natural-log LSE with its output at no extra pass.
    can_return_lse_for_decode: bool = True
    lse_base_on_e: bool = True

    def __init__(
        self,
        num_heads: int,
        head_size: int,
        scale: float,
        num_kv_heads: int,
        alibi_slopes: list[float] | None,
        sliding_window: int | None,
        kv_cache_dtype: str,
        logits_soft_cap: float | None,
        attn_type: str,
        kv_sharing_target_layer_name: str | None,
        topk_indices_buffer: torch.Tensor | None = None,
        indexer: Any | None = None,
        **mla_args: Any,
    ) -> None:
        # vLLM's SparseMLACommonImpl takes named arguments only: take the sink out first.
        sinks: torch.Tensor | None = mla_args.pop("sinks", None)
        if any([alibi_slopes, sliding_window, logits_soft_cap]):
            raise NotImplementedError(
                f"{BACKEND_NAME} does not support alibi, sliding window or logits soft cap"
            )
        if kv_cache_dtype not in KV_FORMAT_OF:
            raise NotImplementedError(
                f"{BACKEND_NAME} does not read kv cache dtype {kv_cache_dtype!r} "
                f"(supported: {', '.join(KV_FORMAT_OF)})"
            )
        super().__init__(
            num_heads,
            head_size,
            scale,
            num_kv_heads,
            alibi_slopes,
            sliding_window,
            kv_cache_dtype,
            logits_soft_cap,
            attn_type,
            kv_sharing_target_layer_name,
            indexer=indexer,
            topk_indices_buffer=topk_indices_buffer,
            **mla_args,
        )
        assert self.topk_indices_buffer is not None, (
            "sparse MLA needs the indexer's top-k buffer (indexer or topk_indices_buffer)"
        )
        self.kv_format = KV_FORMAT_OF[kv_cache_dtype]
        # q reaches the kernel as the (latent, rope) tuple in the model dtype.
        self.supports_quant_query_input = False
        if self.kv_format == "fp8_ds_mla" and self.qk_rope_head_dim == 0:
            # A NoPE model on fp8_ds_mla keeps 656-byte rows; dense-MHA prefill would gather them
            # into a kv_lora_rank-wide workspace (as FLASHMLA_SPARSE notes), so prefill runs here.
            self.supports_dense_mha_prefill = False
        self.sinks = _check_sinks(sinks, num_heads)
        self._kernel_sink: torch.Tensor | None = None
        if sinks is not None:
            # vLLM's dense-MHA prefill backends (FlashAttention / FlashInfer / cuDNN varlen) take
            # no sink: with it, prefill tokens would be computed without the sink while decode
            # applies it (ROCm's sparse MLA impl does the same; HY V4 also sets
            # sparse_mla_force_mqa). Every token therefore takes the top-k MQA path, which for a
            # prefill no longer than index_topk sees the same keys as dense attention.
            self.supports_dense_mha_prefill = False

    def process_weights_after_loading(self, act_dtype: torch.dtype) -> None:
        super().process_weights_after_loading(act_dtype)
        if self.sinks is not None:
            self._kernel_sink = None  # the weights are loaded: convert (if needed) from them
            self._sink_for_kernel(self.sinks.device)

    def _sink_for_kernel(self, device: torch.device) -> torch.Tensor | None:
        """The kernel's ``attn_sink`` (float32 ``[H]`` on ``device``), or None without a sink.

        A float32 ``[H]`` sink already on the device (HY V4's ``learnable_sink_param``) is used
        as is, no copy: the kernel reads the parameter itself, so weights loaded or updated in
        place later are always seen. Any other form (bf16, another shape of H elements, another
        device) is converted once: after weight loading (``process_weights_after_loading``), or
        at the first forward if that hook did not run, and the converted copy is reused on every
        later call (no per-call conversion, no host sync). That copy does not follow later
        in-place updates of the original; ``process_weights_after_loading`` refreshes it.
        """
        sinks = self.sinks
        if sinks is None:
            return None
        if sinks.dtype == torch.float32 and sinks.dim() == 1 and sinks.device == device:
            return sinks
        cached = self._kernel_sink
        if cached is None or cached.device != device:
            cached = sinks.detach().reshape(-1).to(device=device, dtype=torch.float32)
            self._kernel_sink = cached
        return cached

    def _forward_mqa_kernel(
        self,
        q: torch.Tensor | tuple[torch.Tensor, torch.Tensor],
        kv_cache: torch.Tensor,
        topk_indices: torch.Tensor,
        valid_counts: torch.Tensor,
        *,
        layer: AttentionLayer,
        block_size: int,
        is_decode: bool,
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        # vLLM's physical indices address the flat row view (block * block_stride_rows + slot),
        # so the kernel gets that view, not the paged tensor (whose block stride may differ).
        rows = kv_cache if kv_cache.dim() == 2 else flat_kv_row_view(kv_cache, block_size)[0]
        k_scale = layer._k_scale if self.kv_format == "fp8" else None
        want_lse = self.need_to_return_lse_for_decode
        res = sparse_mla(
            q,  # the (ql_nope, q_pe) tuple as vLLM built it: no concatenation
            rows,
            topk_indices,
            self.scale,
            kv_lora_rank=self.kv_lora_rank,
            valid_counts=valid_counts,
            kv_format=self.kv_format,
            k_scale=k_scale,
            attn_sink=self._sink_for_kernel(rows.device),
            return_lse=want_lse,
        )
        if want_lse:
            out, lse = res
            return out, lse
        return res, None  # type: ignore[return-value]
