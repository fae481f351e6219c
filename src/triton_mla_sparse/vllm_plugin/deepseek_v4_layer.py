"""The plugin's DeepSeek-V4 attention layer for vLLM 0.33: vLLM's layer, the kernel calls swapped.

:class:`TritonDeepseekV4Attention` is vLLM's ``DeepseekV4Attention``
(``vllm/models/deepseek_v4/attention.py:132``) with the platform part a subclass provides:
``forward_mqa`` runs :func:`triton_mla_sparse.sparse_mla` once for the decode tokens and once
for the prefill tokens, where vLLM's FlashMLA layer calls ``flash_mla_with_kvcache``
(``nvidia/flashmla.py:248-264``) and, per prefill chunk, ``dequantize_and_gather_k_cache`` +
``flash_mla_sparse_fwd`` (``:316-398``). Each call attends, in one softmax with the layer's
per-head sink:

- the main set: the sliding-window cache, through vLLM's slot ids ``decode_swa_indices`` /
  ``prefill_swa_indices`` and their lengths (``v1/attention/backends/mla/sparse_swa.py:652-731``);
- the extra set (C4A / C128A layers): the compressed cache. C4A reads the indexer's
  request-local top-k (``topk_indices_buffer``) through the compressed block table, as
  ``compute_global_topk_indices_and_lens`` maps it (``common/ops/cache_utils.py:550-641``);
  C128A decode reads vLLM's global slot ids and lengths, C128A prefill its local ids through the
  block table (``sparse_mla.py:302-448``). Prefill lengths are ``min((pos + 1) // ratio, topk)``,
  what ``combine_topk_swa_indices`` reads (``cache_utils.py:880-905``).

Both caches are read where vLLM put them: DeepSeek-V4's 584-byte paged record
(``kv_format="fp8_ds_mla_v4"``, for ``--kv-cache-dtype fp8*``) or plain rows ``[blocks, page,
512]`` (``kv_format="auto"``, the default). No gather workspace, no FlashMLA call, no FlashMLA
scheduler metadata (the SWA builder here skips ``get_mla_metadata``). Padded q heads: none (the
kernel takes any head count). The output projection is vLLM's (``deep_gemm_fp8_o_proj``).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, ClassVar, cast

import torch
from vllm.forward_context import get_forward_context
from vllm.models.deepseek_v4.attention import DeepseekV4Attention
from vllm.models.deepseek_v4.sparse_mla import (
    DeepseekV4FlashMLAMetadata,
    DeepseekV4SparseMLABackend,
    DeepseekV4SparseMLAMetadataBuilder,
)
from vllm.platforms.interface import DeviceCapability
from vllm.v1.attention.backend import AttentionCGSupport
from vllm.v1.attention.backends.mla.sparse_swa import (
    DeepseekSparseSWABackend,
    DeepseekSparseSWAMetadataBuilder,
)

from ..ops.sparse_mla.interface import sparse_mla
from .vllm_signatures import V4_RECORD_CACHE_DTYPES

if TYPE_CHECKING:
    from vllm.v1.attention.backends.mla.sparse_swa import DeepseekSparseSWAMetadata

# DeepSeek-V4's row: 448 NoPE + 64 RoPE values, q . k over all of it, the value all of it.
HEAD_DIM = 512
ROPE_DIM = 64


class TritonDeepseekV4MetadataBuilder(DeepseekV4SparseMLAMetadataBuilder):
    """vLLM's compressed-cache metadata (block table, C128A slot ids); attention runs in the
    layer's eager break (``attention.py:737``), so any batch shape may be captured."""

    _cudagraph_support: ClassVar[AttentionCGSupport] = AttentionCGSupport.ALWAYS


class TritonDeepseekV4Backend(DeepseekV4SparseMLABackend):
    """The compressed cache's backend: vLLM's DeepSeek-V4 sparse backend, any cache dtype the
    plugin reads, SM80 and up. Only named and asked for its builder (DeepSeek-V4 layers are
    built by the model, not through the selector)."""

    supported_kv_cache_dtypes: ClassVar[list[Any]] = [
        "auto",
        "bfloat16",
        "float16",
        "fp8",
        "fp8_e4m3",
        "fp8_ds_mla",
    ]

    @staticmethod
    def get_name() -> str:
        return "TRITON_MLA_SPARSE_DSV4"

    @staticmethod
    def get_builder_cls() -> type[TritonDeepseekV4MetadataBuilder]:
        return TritonDeepseekV4MetadataBuilder

    @classmethod
    def supports_compute_capability(cls, capability: DeviceCapability) -> bool:
        return capability.major >= 8


class TritonSparseSWAMetadataBuilder(DeepseekSparseSWAMetadataBuilder):
    """vLLM's sliding-window metadata (slot ids, lengths, prefill metadata) without FlashMLA's
    tile-scheduler objects, which only FlashMLA reads (``sparse_swa.py:910-944``)."""

    _cudagraph_support: ClassVar[AttentionCGSupport] = AttentionCGSupport.ALWAYS

    def build_tile_scheduler(self, num_decode_tokens: int) -> dict[str, Any]:
        out = super().build_tile_scheduler(0)  # every layer type present, all None
        return dict.fromkeys(out)


class TritonSparseSWABackend(DeepseekSparseSWABackend):
    """The sliding-window cache's backend (keeps vLLM's name: its warm-up keys on it)."""

    @staticmethod
    def get_builder_cls() -> type[TritonSparseSWAMetadataBuilder]:
        return TritonSparseSWAMetadataBuilder


def _kv_format(layer: DeepseekV4Attention) -> str:
    return "fp8_ds_mla_v4" if layer.kv_cache_dtype == "fp8_ds_mla" else "auto"


class TritonDeepseekV4Attention(DeepseekV4Attention):
    """DeepSeek-V4 sparse MLA attention on :func:`triton_mla_sparse.sparse_mla`."""

    backend_cls = TritonDeepseekV4Backend
    swa_backend_cls = TritonSparseSWABackend
    use_fp8_ds_mla_layout: ClassVar[bool] = False  # per instance: _uses_fp8_ds_mla_layout

    def __init__(self, vllm_config: Any, *args: Any, **kwargs: Any) -> None:
        # read by _uses_fp8_ds_mla_layout() inside DeepseekV4Attention.__init__ (attention.py:345)
        self._v4_record = str(vllm_config.cache_config.cache_dtype) in V4_RECORD_CACHE_DTYPES
        super().__init__(vllm_config, *args, **kwargs)
        if self.head_dim != HEAD_DIM or self.rope_head_dim != ROPE_DIM:
            raise ValueError(
                f"{type(self).__name__} serves DeepSeek-V4's {HEAD_DIM}-wide rows "
                f"({HEAD_DIM - ROPE_DIM} NoPE + {ROPE_DIM} RoPE); this config has head_dim="
                f"{self.head_dim}, qk_rope_head_dim={self.rope_head_dim}"
            )
        if self.compress_ratio not in (1, 4, 128):
            raise ValueError(
                f"{type(self).__name__}: compress_ratio={self.compress_ratio} (DeepSeek-V4 "
                "layers are 1 (sliding window only), 4 (C4A) or 128 (C128A))"
            )
        self.kv_format = _kv_format(self)
        self._einsum: tuple[tuple[int, int, int], bool] | None = None

    def _uses_fp8_ds_mla_layout(self) -> bool:
        return self._v4_record

    @classmethod
    def get_padded_num_q_heads(cls, num_heads: int) -> int:
        return num_heads  # the kernel takes any head count

    def _o_proj(self, o: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        # vLLM's own output projection, as its FlashMLA layer calls it (nvidia/flashmla.py:61-75)
        from vllm.models.deepseek_v4.nvidia.ops.o_proj import (
            compute_fp8_einsum_recipe,
            deep_gemm_fp8_o_proj,
        )

        if self._einsum is None:
            self._einsum = compute_fp8_einsum_recipe()
        recipe, tma_aligned = self._einsum
        return deep_gemm_fp8_o_proj(
            o,
            positions,
            self.rotary_emb.cos_sin_cache,
            self.wo_a,
            self.wo_b,
            n_groups=self.n_local_groups,
            heads_per_group=self.n_local_heads // self.n_local_groups,
            nope_dim=self.nope_head_dim,
            rope_dim=self.rope_head_dim,
            o_lora_rank=self.o_lora_rank,
            einsum_recipe=recipe,
            tma_aligned_scales=tma_aligned,
        )

    def forward_mqa(
        self,
        q: torch.Tensor,
        kv: torch.Tensor,
        positions: torch.Tensor,
        output: torch.Tensor,
    ) -> None:
        if not isinstance(output, torch.Tensor) or output.shape != q.shape:
            raise ValueError(
                f"{type(self).__name__}: output must be a tensor shaped like q {tuple(q.shape)}, "
                f"got {getattr(output, 'shape', type(output).__name__)}"
            )
        attn_metadata = get_forward_context().attn_metadata
        if attn_metadata is None:
            output.zero_()  # profile / warm-up run: no metadata, nothing to reserve
            return
        assert isinstance(attn_metadata, dict)
        swa_md = cast("DeepseekSparseSWAMetadata", attn_metadata[self.swa_cache_layer.prefix])
        c_md = cast("DeepseekV4FlashMLAMetadata | None", attn_metadata.get(self.prefix))
        nd = swa_md.num_decode_tokens
        n = nd + swa_md.num_prefill_tokens
        if swa_md.num_decodes > 0:
            self._attend(q, positions, output, swa_md, c_md, 0, nd, decode=True)
        if swa_md.num_prefills > 0:
            self._attend(q, positions, output, swa_md, c_md, nd, n, decode=False)

    def _attend(
        self,
        q: torch.Tensor,
        positions: torch.Tensor,
        output: torch.Tensor,
        swa_md: DeepseekSparseSWAMetadata,
        c_md: DeepseekV4FlashMLAMetadata | None,
        lo: int,
        hi: int,
        *,
        decode: bool,
    ) -> None:
        """One sparse_mla call over tokens [lo, hi) (the decode or the prefill tokens)."""
        if hi <= lo:
            return
        t = hi - lo
        swa_cache = self.swa_cache_layer.kv_cache
        if swa_cache.shape[1] != swa_md.block_size:
            raise ValueError(
                f"sliding-window cache {tuple(swa_cache.shape)} does not have the metadata's "
                f"{swa_md.block_size} slots per page"
            )
        if decode:
            swa_idx, swa_lens = swa_md.decode_swa_indices, swa_md.decode_swa_lens
        else:
            swa_idx, swa_lens = swa_md.prefill_swa_indices, swa_md.prefill_swa_lens
        assert swa_idx is not None and swa_lens is not None
        kw: dict[str, Any] = {}
        if self.compress_ratio > 1:
            assert c_md is not None and swa_md.is_valid_token is not None
            kw = self._extra_set(positions, swa_md, c_md, lo, hi, decode=decode)
        sparse_mla(
            q[lo:hi],
            swa_cache,
            swa_idx.reshape(t, -1),
            self.scale,
            kv_lora_rank=HEAD_DIM,
            valid_counts=swa_lens,
            kv_format=self.kv_format,
            attn_sink=self.attn_sink,
            out=output[lo:hi],
            **kw,
        )

    def _extra_set(
        self,
        positions: torch.Tensor,
        swa_md: DeepseekSparseSWAMetadata,
        c_md: DeepseekV4FlashMLAMetadata,
        lo: int,
        hi: int,
        *,
        decode: bool,
    ) -> dict[str, Any]:
        """The compressed cache as sparse_mla's extra set for tokens [lo, hi)."""
        ratio = self.compress_ratio
        cache = self.kv_cache
        page = c_md.block_size // ratio  # compressed states per block
        if cache.shape[1] != page:
            raise ValueError(
                f"compressed cache {tuple(cache.shape)} does not have the metadata's {page} "
                f"states per page (block {c_md.block_size} / ratio {ratio})"
            )
        assert swa_md.is_valid_token is not None and swa_md.token_to_req_indices is not None
        valid = swa_md.is_valid_token[lo:hi].to(torch.int32)
        kw: dict[str, Any] = {"extra_kv_cache": cache}
        if ratio == 128 and decode:
            # vLLM's global slot ids and lengths, as FlashMLA gets them (flashmla.py:205-207)
            idx = c_md.c128a_global_decode_topk_indices
            assert idx is not None and c_md.c128a_decode_topk_lens is not None
            kw.update(
                extra_indices=idx.reshape(hi - lo, -1),
                extra_valid_counts=c_md.c128a_decode_topk_lens,
            )
            return kw
        if ratio == 4:
            assert self.topk_indices_buffer is not None
            idx = self.topk_indices_buffer[lo:hi]
        else:
            idx = c_md.c128a_prefill_topk_indices
            assert idx is not None
        width = idx.shape[-1]
        if decode:
            # compute_global_topk_indices_and_lens: every entry >= 0, none for padded tokens
            counts = valid * width
        else:
            # combine_topk_swa_indices: the first min((pos + 1) // ratio, topk) entries
            pos = positions[lo:hi].to(torch.int32)
            counts = torch.clamp((pos + 1) // ratio, max=width) * valid
        kw.update(
            extra_indices=idx,
            extra_valid_counts=counts,
            extra_block_table=c_md.block_table,
            extra_block_size=page,
            req_ids=swa_md.token_to_req_indices[lo:hi],
        )
        return kw
