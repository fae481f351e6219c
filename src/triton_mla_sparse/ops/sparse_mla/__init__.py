from .heuristics import KernelConfig
from .interface import sparse_mla, sparse_mla_plan
from .plan import LaunchPlan

__all__ = ["KernelConfig", "LaunchPlan", "sparse_mla", "sparse_mla_plan"]
