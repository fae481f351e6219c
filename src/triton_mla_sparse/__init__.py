"""triton-mla-sparse: portable sparse MLA attention for DSA models, in Triton.

Importing this package touches no GPU and compiles nothing; kernels compile on first call.
"""

from .kv_format import pack_fp8_ds_mla, unpack_fp8_ds_mla
from .ops.sparse_mla import KernelConfig, LaunchPlan, sparse_mla, sparse_mla_plan

__version__ = "0.1.0"

__all__ = [
    "KernelConfig",
    "LaunchPlan",
    "pack_fp8_ds_mla",
    "sparse_mla",
    "sparse_mla_plan",
    "unpack_fp8_ds_mla",
    "__version__",
]
