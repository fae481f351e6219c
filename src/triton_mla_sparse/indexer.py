"""The DSA lightning indexer's logits in Triton (vLLM 0.33 DeepGEMM semantics).

``paged_mqa_logits`` (decode, paged fp8 K cache) and ``mqa_logits`` (prefill, gathered fp8 K):
see :mod:`triton_mla_sparse.ops.indexer.interface` for shapes and semantics. Importing this
module touches no GPU and compiles nothing.
"""

from .ops.indexer import IndexerConfig, mqa_logits, paged_mqa_logits

__all__ = ["IndexerConfig", "mqa_logits", "paged_mqa_logits"]
