"""The MLA KV-cache writer for the fp8 formats without fp8 types (sm80/86)."""

from .interface import write_mla_cache

__all__ = ["write_mla_cache"]
