"""Index-query preparation for the DSA lightning indexer without fp8 types (sm80/86)."""

from .interface import index_q_rope

__all__ = ["index_q_rope"]
