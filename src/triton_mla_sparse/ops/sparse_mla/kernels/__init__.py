"""Sparse MLA forward kernels, one module per kernel family, and the split-K merge.

- latent.py: caches whose rows are plain vectors (kv_format "auto", "fp8" per-tensor e4m3);
- ds_mla.py: fp8_ds_mla rows (four scaled e4m3 chunks + bf16 rope);
- ds_mla_v4.py: fp8_ds_mla_v4 pages (DeepSeek-V4's record: seven scaled e4m3 chunks + bf16 rope,
  scales in rows of their own after the page's data rows);
- merge.py: the LSE merge of split partials;
- shared.py: the jit pieces the families share.

The plan (plan.py) names the family; launch.py looks it up in ``FORWARD`` (the Gluon kernels
beside these where the installed Triton has Gluon), and ``launch.launchable_kernels()`` lists
every kernel a call can launch.
"""

from .ds_mla import sparse_mla_ds_mla_fwd_kernel
from .ds_mla_v4 import sparse_mla_ds_mla_v4_fwd_kernel
from .latent import sparse_mla_latent_fwd_kernel
from .merge import sparse_mla_merge_kernel

__all__ = [
    "sparse_mla_ds_mla_fwd_kernel",
    "sparse_mla_ds_mla_v4_fwd_kernel",
    "sparse_mla_latent_fwd_kernel",
    "sparse_mla_merge_kernel",
]
