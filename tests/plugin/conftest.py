"""Environment for the vLLM plugin tests; must run before anything imports vllm.

Without a GPU: ``CUDA_VISIBLE_DEVICES=""`` makes vLLM keep the real Triton instead of its
placeholder (vllm/triton_utils/importing.py:52-78), so vLLM's own Triton kernels (the top-k index
conversion) run under Triton's interpreter like ours (tests/conftest.py sets TRITON_INTERPRET=1);
``VLLM_TARGET_DEVICE=cpu`` gives vLLM the CPU platform (no pinned memory, no CUDA queries).
"""

from __future__ import annotations

import os
import sys

import torch

HAS_GPU = torch.cuda.is_available()
if not HAS_GPU:
    if "vllm" in sys.modules:  # too late to steer vLLM's import-time choices
        raise RuntimeError("tests/plugin/conftest.py must run before vllm is imported")
    os.environ["CUDA_VISIBLE_DEVICES"] = ""
    os.environ.setdefault("VLLM_TARGET_DEVICE", "cpu")
    os.environ.setdefault("TRITON_INTERPRET", "1")
