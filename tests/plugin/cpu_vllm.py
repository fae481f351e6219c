"""vLLM 0.33 on CPU for the plugin tests: a config, a one-rank gloo process group, metadata.

Shared by tests that build vLLM's own metadata builders and run its forward paths on CPU
(test_vllm_forward.py, test_vllm_indexer_e2e.py). vLLM must already be importable on CPU
(tests/plugin/conftest.py sets the environment first).
"""

from __future__ import annotations

import contextlib
import socket
from collections.abc import Iterator
from types import SimpleNamespace as NS

import torch


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@contextlib.contextmanager
def cpu_vllm_config(
    *,
    heads: int,
    block_size: int,
    max_tokens: int,
    max_model_len: int,
    index_topk: int,
    workspace: bool = False,
) -> Iterator[object]:
    """A VllmConfig on CPU, current, with a one-rank gloo world and a stand-in model config.

    A ModelConfig needs a Hugging Face checkpoint; vLLM's builders read only the fields given
    here (DeepSeek-V3.2 geometry, ``heads`` per rank). No dense-MHA prefill backend: every token
    takes the sparse MQA path. ``workspace`` also initialises vLLM's workspace manager (the
    indexer's prefill path allocates through it).
    """
    from vllm.config import (
        CacheConfig,
        DeviceConfig,
        SchedulerConfig,
        VllmConfig,
        set_current_vllm_config,
    )
    from vllm.distributed import (
        destroy_distributed_environment,
        destroy_model_parallel,
        init_distributed_environment,
        initialize_model_parallel,
    )

    cfg = VllmConfig(
        device_config=DeviceConfig(device="cpu"),
        scheduler_config=SchedulerConfig(
            max_num_batched_tokens=max_tokens,
            max_num_seqs=8,
            max_model_len=max_model_len,
            is_encoder_decoder=False,
        ),
        cache_config=CacheConfig(block_size=block_size, cache_dtype="auto"),
    )
    hf = NS(
        index_topk=index_topk,
        kv_lora_rank=512,
        qk_nope_head_dim=128,
        qk_rope_head_dim=64,
        v_head_dim=128,
        q_lora_rank=1536,
    )
    model = NS(
        hf_text_config=hf,
        max_model_len=max_model_len,
        dtype=torch.float16,
        model_arch_config=NS(total_num_attention_heads=128),
        get_num_attention_heads=lambda parallel_config: heads,
    )
    cfg.compilation_config.static_forward_context["layer.0"] = NS(prefill_backend=None)
    if workspace:
        from vllm.v1.worker import workspace as ws

        if ws._manager is None:
            ws.init_workspace_manager(torch.device("cpu"))
    with set_current_vllm_config(cfg):
        init_distributed_environment(
            world_size=1,
            rank=0,
            local_rank=0,
            distributed_init_method=f"tcp://127.0.0.1:{free_port()}",
            backend="gloo",
        )
        initialize_model_parallel(1, 1)
        # After the process groups: their setup reads ModelConfig fields the stand-in lacks.
        object.__setattr__(cfg, "model_config", model)
        try:
            yield cfg
        finally:
            destroy_model_parallel()
            destroy_distributed_environment()


def common_metadata(requests: list[tuple[int, int]], block_table: list[list[int]]):
    """vLLM's CommonAttentionMetadata for requests given as (query_len, seq_len)."""
    from vllm.v1.attention.backend import CommonAttentionMetadata

    qlens = torch.tensor([q for q, _ in requests], dtype=torch.int32)
    seqs = torch.tensor([s for _, s in requests], dtype=torch.int32)
    qsl = torch.zeros(len(requests) + 1, dtype=torch.int32)
    qsl[1:] = torch.cumsum(qlens, 0)
    n = int(qsl[-1])
    return CommonAttentionMetadata(
        query_start_loc=qsl,
        query_start_loc_cpu=qsl.clone(),
        seq_lens=seqs,
        num_reqs=len(requests),
        num_actual_tokens=n,
        max_query_len=int(qlens.max()),
        max_seq_len=int(seqs.max()),
        block_table_tensor=torch.tensor(block_table, dtype=torch.int32),
        slot_mapping=torch.zeros(n, dtype=torch.int64),
        seq_lens_cpu_upper_bound=seqs.clone(),
    )


def mla_sparse_impl(
    heads: int,
    kv_cache_dtype: str,
    topk_buffer,
    scale: float = 576**-0.5,
    *,
    qk_nope_head_dim: int = 128,
    v_head_dim: int = 128,
    **impl_kw,
):
    """The plugin's impl as vLLM's MLA layer constructs it for a DeepSeek-V3.2-shaped model (other
    head dims, e.g. HY V4's 192 / 256, and extra impl kwargs such as ``sinks`` when given)."""
    from triton_mla_sparse.vllm_plugin.backend import TritonMLASparseImpl

    return TritonMLASparseImpl(
        num_heads=heads,
        head_size=576,
        scale=scale,
        num_kv_heads=1,
        alibi_slopes=None,
        sliding_window=None,
        kv_cache_dtype=kv_cache_dtype,
        logits_soft_cap=None,
        attn_type="decoder",
        kv_sharing_target_layer_name=None,
        q_lora_rank=1536,
        kv_lora_rank=512,
        qk_nope_head_dim=qk_nope_head_dim,
        qk_rope_head_dim=64,
        qk_head_dim=qk_nope_head_dim + 64,
        v_head_dim=v_head_dim,
        kv_b_proj=None,
        indexer=None,
        topk_indices_buffer=topk_buffer,
        **impl_kw,
    )
