"""Automatic selection: put this backend last in vLLM's CUDA MLA priority list.

vLLM's ``CudaPlatform.get_valid_backends`` (vllm/platforms/cuda.py:376-417) walks the list that
the module global ``_get_backend_priorities`` (cuda.py:83, ``functools.cache``'d) returns and picks
the first backend whose ``validate_configuration`` passes. Appending ``CUSTOM`` at the end means
every native backend keeps its priority wherever it is valid, and this backend wins only where none
is (SM8x; SM12x with a bf16 cache or a top-k FlashInfer lacks). No vLLM file is edited: the module
global is replaced by a wrapper that returns a fresh list (the cached list object is shared).

One exception to "last": on SM12x, for a model with a learnable per-head attention sink (HY V4,
``hf_text_config.learnable_sink``), this backend goes just before ``FLASHINFER_MLA_SPARSE_SM120``,
which has no sink: vLLM's HY V4 would otherwise keep FlashInfer and serve with the sink dropped
("sink bias is disabled", models/hy_v4/nvidia/attention.py:595-641), which is not the trained
model. An explicit ``--attention-backend`` still wins over any priority list.

``vllm.platforms.cuda`` needs libcuda to import, so the wrapper is installed only when vLLM's
current platform is CUDA (then the module is already imported).
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

_MARK = "_triton_mla_sparse_wrapped"


def _wrap(original: Callable[..., list]) -> Callable[..., list]:
    from vllm.v1.attention.backends.registry import AttentionBackendEnum

    custom = AttentionBackendEnum.CUSTOM

    @functools.wraps(original)
    def priorities(*args: Any, **kwargs: Any) -> list:
        backends = list(original(*args, **kwargs))  # a copy: never mutate the cached list
        use_mla = kwargs["use_mla"] if "use_mla" in kwargs else (args[0] if args else False)
        # MLA lists only: this backend is MLA-only, and it validates itself (sparse, dtypes,
        # capability) like any other entry, so non-sparse MLA models never select it.
        if use_mla and custom not in backends:
            cap = kwargs.get("device_capability", args[1] if len(args) > 1 else None)
            sm120 = AttentionBackendEnum.FLASHINFER_MLA_SPARSE_SM120
            if cap is not None and cap.major == 12 and sm120 in backends and _model_has_sink():
                backends.insert(backends.index(sm120), custom)
            else:
                backends.append(custom)
        return backends

    setattr(priorities, _MARK, True)
    return priorities


def _model_has_sink() -> bool:
    """Whether the model being built has a learnable per-head attention sink (HY V4)."""
    from vllm.config import get_current_vllm_config_or_none

    cfg = get_current_vllm_config_or_none()
    model = getattr(cfg, "model_config", None)
    hf = getattr(model, "hf_text_config", None)
    return bool(getattr(hf, "learnable_sink", False))


def install_priority_wrapper(cuda_module: Any = None) -> bool:
    """Wrap ``vllm.platforms.cuda._get_backend_priorities``; True when installed (or already).

    Without ``cuda_module``, installs only when vLLM's current platform is CUDA. Tests pass the
    module (imported with the native extension stood in) to exercise the real selection code.
    """
    if cuda_module is None:
        from vllm.platforms import current_platform

        if not current_platform.is_cuda():
            return False
        import vllm.platforms.cuda as cuda_module
    original = cuda_module._get_backend_priorities
    if getattr(original, _MARK, False):
        return True
    cuda_module._get_backend_priorities = _wrap(original)
    return True


def uninstall_priority_wrapper(cuda_module: Any) -> None:
    """Restore vLLM's own priority function (tests)."""
    fn = cuda_module._get_backend_priorities
    if getattr(fn, _MARK, False):
        cuda_module._get_backend_priorities = fn.__wrapped__
