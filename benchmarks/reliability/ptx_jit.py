"""The sm80 / sm86 / sm89 PTX-JIT emulation lives in the package: ``triton_mla_sparse.testing.
ptx_jit`` (``triton-mla-sparse bench --arch`` uses it). This file keeps ``import ptx_jit`` working
for the scripts here that put this folder on ``sys.path`` (reliability.py): it is the package
module itself, so that there is one module object and one emulation state."""

import sys

from triton_mla_sparse.testing import ptx_jit as _ptx_jit

sys.modules[__name__] = _ptx_jit
