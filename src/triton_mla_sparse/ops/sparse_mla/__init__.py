from .heuristics import KernelConfig
from .interface import sparse_mla

__all__ = ["KernelConfig", "sparse_mla"]
