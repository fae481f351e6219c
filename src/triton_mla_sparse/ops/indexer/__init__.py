from .heuristics import IndexerConfig
from .interface import mqa_logits, paged_mqa_logits

__all__ = ["IndexerConfig", "mqa_logits", "paged_mqa_logits"]
