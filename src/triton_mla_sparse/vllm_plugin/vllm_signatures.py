"""The vLLM 0.33.0 names the DSA indexer path replaces, and their signatures, as data.

A target is ``"module.attribute"``: a module global that vLLM's DSA code looks up at call time
(so replacing the global reroutes the call), or, for ``op_registry_oot``, the out-of-tree custom
op slot that ``CustomOp.__new__`` consults. :mod:`.indexer_install` checks every target's
``inspect.signature`` against :data:`SIGNATURES` before it replaces anything, so a vLLM whose code
differs is left alone rather than half-patched. Update this table (and the adapters in
:mod:`.indexer_adapters`) together when moving to another vLLM release.
"""

from __future__ import annotations

import inspect
import re
from importlib import metadata
from typing import Any

VLLM_VERSION = "0.33.0"  # the release these signatures were read from

SAI = "vllm.model_executor.layers.sparse_attn_indexer"
IDX = "vllm.v1.attention.backends.mla.indexer"
ATT = "vllm.models.deepseek_v32.attention"
OOT = "vllm.model_executor.custom_op.op_registry_oot"
INDEXER_OP = "SparseAttnIndexer"

# DeepGEMM's indexer logits and its schedule: replaced wherever vLLM has no DeepGEMM (SM80/86/89).
LOGITS_TARGETS = (
    f"{SAI}.fp8_fp4_mqa_logits",
    f"{SAI}.fp8_fp4_paged_mqa_logits",
    f"{IDX}.get_paged_mqa_logits_metadata",
)
# vLLM's Triton code with fp8 types (SM89+ only): replaced on SM80/86.
FP8_FREE_TARGETS = (
    f"{ATT}.fused_q",
    f"{ATT}.fused_norm_rope",
    f"{OOT}.{INDEXER_OP}",  # an op_registry_oot entry: CustomOp.__new__ builds this class instead
)


def trigger_of(target: str) -> str:
    """The module whose first import installs ``target`` (indexer_install's import hook).

    ``SAI`` for what every DSA model reaches through ``sparse_attn_indexer`` (the logits, the
    metadata schedule, the out-of-tree ``SparseAttnIndexer``): DeepSeek-V3.2, GLM-5 and HY V4,
    which imports ``SparseAttnIndexer`` from there and never imports ``ATT``
    (models/hy_v4/nvidia/attention.py:42-44). ``ATT`` for DeepSeek-V3.2's own writers, globals of
    that module.
    """
    return ATT if target.rpartition(".")[0] == ATT else SAI


REQUIRED = inspect.Parameter.empty


def _required(*names: str) -> tuple[tuple[str, Any], ...]:
    return tuple((n, REQUIRED) for n in names)


# Each target's parameters (name, default) in order, all positional-or-keyword; for the
# out-of-tree op, vLLM's SparseAttnIndexer.__init__'s (the class the adapter subclasses).
SIGNATURES: dict[str, tuple[tuple[str, Any], ...]] = {
    f"{SAI}.fp8_fp4_mqa_logits": _required(
        "q", "kv", "weights", "cu_seqlen_ks", "cu_seqlen_ke", "max_seqlen_k"
    ),
    f"{SAI}.fp8_fp4_paged_mqa_logits": (
        *_required(
            "q",
            "kv_cache",
            "weights",
            "context_lens",
            "block_tables",
            "schedule_metadata",
            "max_model_len",
        ),
        ("indices", None),
    ),
    f"{IDX}.get_paged_mqa_logits_metadata": (
        *_required("context_lens", "block_size", "num_sms"),
        ("indices", None),
    ),
    f"{ATT}.fused_q": (
        *_required(
            "positions",
            "q_pe",
            "q_pe_cos_sin_cache",
            "index_q",
            "index_q_cos_sin_cache",
            "ql_nope",
            "q_scale",
            "index_weights",
            "index_weights_softmax_scale",
            "index_weights_head_scale",
        ),
        ("has_indexer", True),
        ("index_rope_interleave", False),
        ("quantize_mqa", True),
    ),
    f"{ATT}.fused_norm_rope": (
        *_required(
            "positions",
            "q_c",
            "q_rms_norm_w",
            "q_rms_eps",
            "kv_c",
            "kv_rms_norm_w",
            "kv_rms_eps",
            "k_pe",
            "k_rope_cos_sin_cache",
            "index_k",
            "index_k_layer_norm_w",
            "index_k_layer_norm_bias",
            "index_k_layer_norm_eps",
            "index_k_rope_cos_sin_cache",
            "topk_indices_buffer",
        ),
        ("slot_mapping", None),
        ("indexer_slot_mapping", None),
        ("indexer_k_cache", None),
        ("indexer_cache_shuffled", False),
        ("mla_kv_cache", None),
        ("mla_kv_cache_dtype", "auto"),
        ("mla_k_scale", None),
        ("has_indexer", True),
        ("index_rope_interleave", False),
        ("q_c_out", None),
        ("kv_c_out", None),
        ("k_pe_out", None),
        ("index_k_out", None),
        ("skip_scale", False),
    ),
    f"{OOT}.{INDEXER_OP}": (
        *_required(
            "self",
            "k_cache",
            "quant_block_size",
            "scale_fmt",
            "topk_tokens",
            "head_dim",
            "max_model_len",
            "max_total_seq_len",
            "topk_indices_buffer",
        ),
        ("skip_k_cache_insert", False),
        ("use_fp4_cache", False),
        ("compress_ratio", 1),
        ("candidate_blocks", None),
        ("candidate_block_size", 0),
        ("candidate_write", False),
    ),
}


def signature_error(target: str, obj: Any) -> str | None:
    """None when ``obj`` has the signature :data:`SIGNATURES` pins for ``target``, else why not."""
    try:
        params = list(inspect.signature(obj).parameters.values())
    except (TypeError, ValueError) as e:
        return f"{target}: no signature ({e})"
    got = tuple((p.name, p.default) for p in params)
    kinds_ok = all(p.kind is inspect.Parameter.POSITIONAL_OR_KEYWORD for p in params)
    if got != SIGNATURES[target] or not kinds_ok:
        return f"{target}{inspect.signature(obj)} differs from vLLM {VLLM_VERSION}'s"
    return None


# DeepSeek-V4's --kv-cache-dtype values that vLLM 0.33 lays out as the 584-byte record (its
# fp8_ds_mla layout, uint8 pages); every other value gets plain bf16 rows [blocks, page, 512]
# (vllm/models/deepseek_v4/attention.py:94-129). The plugin's layer reads either in place.
V4_RECORD_CACHE_DTYPES = ("fp8", "fp8_e4m3", "fp8_ds_mla")


# The vLLM releases whose sparse MLA backend API the plugin targets: [lower, upper)
SUPPORTED_VLLM = ((0, 33), (0, 34))  # [lower, upper)


def _parse_version(version: str) -> tuple[int, int, int]:
    nums = [int(x) for x in re.findall(r"\d+", version.split("+")[0])[:3]]
    return tuple(nums + [0] * (3 - len(nums)))  # type: ignore[return-value]


def vllm_version_supported(version: str | None = None) -> tuple[bool, str]:
    """Whether the installed (or given) vLLM version is one this plugin supports, and why not."""
    if version is None:
        try:
            version = metadata.version("vllm")
        except metadata.PackageNotFoundError:
            return False, "vllm is not installed"
    lo, hi = SUPPORTED_VLLM
    if not (lo <= _parse_version(version)[:2] < hi):
        return False, (
            f"vllm {version} is outside the supported range "
            f">={lo[0]}.{lo[1]},<{hi[0]}.{hi[1]} (its sparse MLA backend API differs)"
        )
    return True, ""
