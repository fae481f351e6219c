"""DeepSeek-V4's sparse attention through ``sparse_mla`` where vLLM 0.33 has no kernel.

vLLM builds DeepSeek-V4's attention layers without its backend selector: the CUDA model module
calls ``_select_dsv4_attn_cls(vllm_config)`` (``vllm/models/deepseek_v4/nvidia/model.py:537-568``)
for every decoder layer (MTP and DSpark draft layers included), which returns the FlashMLA layer
on every capability but SM12x and FlashInfer's on SM12x. FlashMLA ships SM90/SM100 code only;
FlashInfer's SM120 layer serves fp8 caches only. So registering an attention backend does not
route DeepSeek-V4, and SM80/86/89 (any cache) and SM120 with a bf16 cache have no kernel.

This module wraps that module global (looked up at call time) with a function that returns
:class:`~.deepseek_v4_layer.TritonDeepseekV4Attention` where :func:`dsv4_plan` says so, and
vLLM's own choice everywhere else. It imports nothing from vLLM at import time; :func:`install`
hooks the import of the model module (or wraps at once when it is already imported), so
processes that never build DeepSeek-V4 import nothing more.

``TRITON_MLA_SPARSE_DSV4``: ``auto`` (default) routes SM80/86/89 (bf16 or fp8 cache) and SM12x
with ``--kv-cache-dtype bfloat16``; ``triton`` routes every device (A/B runs on an H200, CPU
tests); ``off`` leaves vLLM's choice alone. ``--attention-backend TRITON_MLA_SPARSE`` (the
plugin's ``CUSTOM`` slot) also routes, on any device; an explicit vLLM DeepSeek-V4 backend is
never overridden.
"""

from __future__ import annotations

import functools
import importlib.util
import inspect
import logging
import os
import sys
import threading
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

from .import_hook import after_import
from .import_hook import remove as remove_hooks
from .vllm_signatures import V4_RECORD_CACHE_DTYPES

HOOK_OWNER = "deepseek_v4"  # this module's import hooks (import_hook.after_import)

ENV = "TRITON_MLA_SPARSE_DSV4"
MODES = ("auto", "triton", "off")
MODEL_MODULE = "vllm.models.deepseek_v4.nvidia.model"
SELECTOR = "_select_dsv4_attn_cls"
LAYER_CLASS_PATH = "triton_mla_sparse.vllm_plugin.deepseek_v4_layer.TritonDeepseekV4Attention"
MARK = "_triton_mla_sparse_dsv4"

# --kv-cache-dtype -> how the caches are laid out (vllm_signatures: vLLM's rule)
BF16_CACHE_DTYPES = ("auto", "bfloat16", "float16")
# vLLM's own DeepSeek-V4 choices (_select_dsv4_attn_cls): an explicit one is left to vLLM.
VLLM_DSV4_BACKENDS = (
    "FLASHMLA_SPARSE",
    "FLASHMLA_SPARSE_DSV4",
    "FLASHINFER_MLA_SPARSE",
    "FLASHINFER_MLA_SPARSE_SM120",
    "FLASHINFER_MLA_SPARSE_DSV4",
)
_OFF = ("0", "false", "no", "off")

logger = logging.getLogger("vllm.triton_mla_sparse")

_lock = threading.RLock()
_state: dict[str, Any] = {"original": None, "logged": set()}


@dataclass(frozen=True)
class DSV4Plan:
    """Whether the plugin serves a DeepSeek-V4 layer, with which cache layout, and why."""

    route: bool
    reason: str
    kv_format: str = ""  # "fp8_ds_mla_v4" or "auto" (bf16 rows) when routed
    blockers: tuple[str, ...] = ()  # what else is known to stop this device (routed or not)


def _mode(env: Mapping[str, str]) -> str:
    raw = env.get(ENV, "auto").strip().lower() or "auto"
    if raw in _OFF:
        return "off"
    return raw


def _device_blockers(cap: tuple[int, int] | None, kv_format: str) -> tuple[str, ...]:
    """Known non-attention blockers of vLLM 0.33's DeepSeek-V4 path on ``cap`` (docs/VLLM.md)."""
    if cap is None or cap[0] != 8:
        return ()
    out = [
        "first-layer mHC needs DeepGEMM tf32_hc_prenorm_gemm (no SM8x build)",
        "the C4 indexer's logits need DeepGEMM (no SM8x build)",
        "o_proj: block-fp8 wo_a is repacked for Marlin, then read as a bf16 bmm operand",
    ]
    if cap < (8, 9):
        out.append("fp8 (e4m3) index-q quant and indexer-K writer need SM89+")
        if kv_format == "fp8_ds_mla_v4":
            out.append("the fp8_ds_mla compressor (CuTe DSL, e4m3 cvt) needs SM89+")
    return tuple(out)


def dsv4_plan(
    capability: tuple[int, int] | None,
    cache_dtype: str,
    backend: str | None = None,
    env: Mapping[str, str] | None = None,
) -> DSV4Plan:
    """What the plugin does for a DeepSeek-V4 layer on a device of ``capability`` (None: no
    CUDA device), with ``--kv-cache-dtype cache_dtype`` and ``--attention-backend backend``
    (its enum name, None when not given). Pure: reads ``env`` (default ``os.environ``) only.
    """
    env = os.environ if env is None else env
    mode = _mode(env)
    cap_text = "no CUDA device" if capability is None else f"SM{capability[0]}{capability[1]}"
    if mode not in MODES:
        return DSV4Plan(False, f"{ENV}={env.get(ENV)!r} is not one of {', '.join(MODES)}")
    if mode == "off":
        return DSV4Plan(False, f"{ENV}=off: vLLM's own DeepSeek-V4 attention")
    if cache_dtype in V4_RECORD_CACHE_DTYPES:
        kv_format = "fp8_ds_mla_v4"
    elif cache_dtype in BF16_CACHE_DTYPES:
        kv_format = "auto"
    else:
        return DSV4Plan(
            False,
            f"--kv-cache-dtype {cache_dtype} is not served by the plugin's DeepSeek-V4 layer "
            f"(it reads {', '.join(BF16_CACHE_DTYPES + V4_RECORD_CACHE_DTYPES)})",
        )
    layout = "V4 584-byte record" if kv_format == "fp8_ds_mla_v4" else "bf16 rows"
    blockers = _device_blockers(capability, kv_format)
    if backend in VLLM_DSV4_BACKENDS:
        return DSV4Plan(False, f"--attention-backend {backend} selects vLLM's own layer")
    if backend == "CUSTOM":
        return DSV4Plan(
            True, f"--attention-backend selects the plugin on {cap_text} ({layout})", kv_format
        )
    if mode == "triton":
        return DSV4Plan(True, f"forced by {ENV}=triton on {cap_text} ({layout})", kv_format)
    if capability is None:
        return DSV4Plan(False, "no CUDA device: vLLM's CUDA DeepSeek-V4 layers are not built")
    if capability[0] == 8:
        return DSV4Plan(
            True,
            f"vLLM 0.33 has no DeepSeek-V4 attention kernel on {cap_text} (FlashMLA: SM90/SM100 "
            f"code only): Triton sparse_mla on {layout}",
            kv_format,
            blockers,
        )
    if capability[0] == 12:
        if kv_format == "auto" and cache_dtype != "auto":
            return DSV4Plan(
                True,
                f"vLLM 0.33's {cap_text} DeepSeek-V4 layer (FlashInfer) serves fp8 caches only: "
                "Triton sparse_mla on bf16 rows",
                kv_format,
            )
        return DSV4Plan(
            False,
            f"vLLM serves {cap_text} through FlashInfer (fp8 cache); pass --kv-cache-dtype "
            "bfloat16 for the plugin's bf16-cache layer",
        )
    return DSV4Plan(False, f"vLLM has its own DeepSeek-V4 attention on {cap_text}")


def _capability() -> tuple[int, int] | None:
    from vllm.platforms import current_platform

    if not current_platform.is_cuda():
        return None
    cap = current_platform.get_device_capability()
    return None if cap is None else (cap.major, cap.minor)


def _backend_name(vllm_config: Any) -> str | None:
    backend = getattr(getattr(vllm_config, "attention_config", None), "backend", None)
    return None if backend is None else getattr(backend, "name", str(backend))


def layer_class() -> type:
    """The plugin's DeepSeek-V4 layer class (imports vLLM's DeepSeek-V4 modules)."""
    from .deepseek_v4_layer import TritonDeepseekV4Attention

    return TritonDeepseekV4Attention


def _log_once(level: int, msg: str) -> None:
    with _lock:
        if msg in _state["logged"]:
            return
        _state["logged"].add(msg)
    logger.log(level, "triton_mla_sparse: DeepSeek-V4: %s", msg)


def _wrap(original: Callable[[Any], type]) -> Callable[[Any], type]:
    @functools.wraps(original)
    def select(vllm_config: Any) -> type:
        plan = dsv4_plan(
            _capability(), str(vllm_config.cache_config.cache_dtype), _backend_name(vllm_config)
        )
        if not plan.route:
            return original(vllm_config)
        cls = layer_class()
        extra = f"; still unsupported here: {'; '.join(plan.blockers)}" if plan.blockers else ""
        _log_once(logging.INFO, f"attention layers are {cls.__name__} ({plan.reason}){extra}")
        return cls

    setattr(select, MARK, True)
    return select


def _signature_ok(fn: Any) -> str | None:
    try:
        params = list(inspect.signature(fn).parameters)
    except (TypeError, ValueError) as e:
        return f"{MODEL_MODULE}.{SELECTOR} has no readable signature: {e}"
    if params != ["vllm_config"]:
        return f"{MODEL_MODULE}.{SELECTOR} takes {params}, vLLM 0.33.0's takes ['vllm_config']"
    return None


def apply() -> bool:
    """Wrap the selector (its module must be importable); True when the wrapper is in place."""
    with _lock:
        module = importlib.import_module(MODEL_MODULE)
        current = getattr(module, SELECTOR, None)
        if current is None:
            logger.error("triton_mla_sparse: DeepSeek-V4 route NOT installed: no %s", SELECTOR)
            return False
        if getattr(current, MARK, False):
            return True
        err = _signature_ok(current)
        if err:
            logger.error("triton_mla_sparse: DeepSeek-V4 route NOT installed: %s", err)
            return False
        _state["original"] = current
        setattr(module, SELECTOR, _wrap(current))
        return True


def uninstall() -> None:
    """Put vLLM's selector back (tests)."""
    with _lock:
        module = sys.modules.get(MODEL_MODULE)
        if module is not None and getattr(getattr(module, SELECTOR, None), MARK, False):
            setattr(module, SELECTOR, _state["original"])
        _state["original"] = None
        _state["logged"].clear()
        remove_hooks(HOOK_OWNER)


def installed() -> bool:
    """Whether vLLM's DeepSeek-V4 selector currently holds the plugin's wrapper."""
    module = sys.modules.get(MODEL_MODULE)
    return module is not None and bool(getattr(getattr(module, SELECTOR, None), MARK, False))


def install(env: Mapping[str, str] | None = None) -> bool:
    """Wrap vLLM's DeepSeek-V4 selector now, or when its module is first imported.

    Called from ``register()``; cheap (no vLLM import), re-entrant, never raises. The wrapper
    decides per layer build (it needs the engine's cache dtype); returns False when
    ``TRITON_MLA_SPARSE_DSV4=off``.
    """
    env = os.environ if env is None else env
    if _mode(env) == "off":
        logger.info("triton_mla_sparse: DeepSeek-V4: %s=off: vLLM's own attention", ENV)
        return False

    def run() -> None:
        try:
            apply()
        except Exception as e:  # a plugin must never take vLLM down
            logger.error(
                "triton_mla_sparse: DeepSeek-V4 route install failed: %s: %s", type(e).__name__, e
            )

    with _lock:
        after_import(MODEL_MODULE, run, HOOK_OWNER)
    return True
