"""The DeepGEMM-free DSA indexer path for vLLM 0.33 on SM80/86/89.

vLLM's DeepSeek-V3.2 / GLM-5 CUDA path computes the lightning indexer's logits with DeepGEMM
(``fp8_fp4_mqa_logits``, ``fp8_fp4_paged_mqa_logits``, ``get_paged_mqa_logits_metadata``), which
vLLM supports on SM90/SM100/SM120 only, and prepares the index query and key with Triton kernels
that use fp8 types (``fused_q``, ``fused_norm_rope``'s indexer-cache write, the fp8 ``pack_seq``
warm-up), which Triton compiles for SM89+ only. This module replaces exactly those module globals,
where vLLM's code looks them up at call time (the targets and their pinned vLLM 0.33.0 signatures:
:mod:`.vllm_signatures`), with the adapters of :mod:`.indexer_adapters`, each built around the
vLLM object it replaces:

- SM80/86 (no DeepGEMM, no Triton fp8): the logits and metadata targets, plus ``fused_q``,
  ``fused_norm_rope`` (its fp8 indexer-cache and fp8 MLA-cache stores split out) and an
  out-of-tree ``SparseAttnIndexer`` (bf16 ``pack_seq`` warm-up).
- SM89 (no DeepGEMM, Triton fp8 works): the logits and metadata targets only.
- SM90/100/120: nothing (vLLM's own DeepGEMM path), unless forced.

The metadata builder keeps calling ``has_deep_gemm()`` (True wherever the vendored DeepGEMM
imports); only ``get_paged_mqa_logits_metadata`` is replaced, by zeros of the builder's buffer
shape, so that vLLM's other DeepGEMM-keyed choices (decode flattening, native next_n, varlen)
stay exactly what they are on that device, forced runs on an H200 included.

``TRITON_MLA_SPARSE_INDEXER``: ``auto`` (default) as above; ``triton`` installs the whole SM80/86
set on any device (A/B runs of the SM80 path on an H200, CPU tests); ``off`` installs nothing.

Each target's ``inspect.signature`` is checked against vLLM 0.33.0's before anything is replaced;
one mismatch in a group logs an error and replaces nothing of that group. Installation is
idempotent. It runs in two groups, each when its module is first imported (or at once if it
already is), so processes that never build a DSA model import nothing more:

- when ``vllm.model_executor.layers.sparse_attn_indexer`` loads (it imports the metadata
  builder's module): the logits, the metadata schedule and the out-of-tree ``SparseAttnIndexer``.
  Every DSA model reaches these; HY V4 reaches nothing else (it imports ``SparseAttnIndexer``
  from there, its index query comes from vLLM's CUDA ``per_token_group_quant_fp8`` and its K
  from the CUDA ``indexer_k_quant_and_cache``). The hook runs before the importing statement
  returns, so a model module's ``from ... import SparseAttnIndexer`` already finds the slot set.
- when ``vllm.models.deepseek_v32.attention`` loads: DeepSeek-V3.2's / GLM-5's ``fused_q`` and
  ``fused_norm_rope`` (its globals).
"""

from __future__ import annotations

import importlib
import importlib.util
import logging
import os
import sys
import threading
from collections.abc import Callable, Mapping
from dataclasses import dataclass, replace
from typing import Any

from .import_hook import after_import
from .vllm_signatures import (
    FP8_FREE_TARGETS,
    INDEXER_OP,
    LOGITS_TARGETS,
    OOT,
    SAI,
    signature_error,
    trigger_of,
    vllm_version_supported,
)

HOOK_OWNER = "indexer"  # this module's import hooks (import_hook.after_import)

ENV = "TRITON_MLA_SPARSE_INDEXER"
MODES = ("auto", "triton", "off")

# What stops DSA serving below SM89 when this plugin's fp8-free path is NOT installed.
FP8_CACHE_BLOCKER = (
    "fp8 KV caches (--kv-cache-dtype fp8 / fp8_e4m3 / fp8_ds_mla): vLLM's MLA cache writer "
    "(fused_norm_rope) quantises with Triton fp8 types, which need SM89+; serve with "
    "--kv-cache-dtype auto (bf16 cache)"
)
MARK = "_triton_mla_sparse_indexer"

logger = logging.getLogger("vllm.triton_mla_sparse")

_lock = threading.RLock()
# target -> the object it replaced (for uninstall)
_originals: dict[str, Any] = {}


@dataclass(frozen=True)
class IndexerPlan:
    """What :func:`install` would do on a device: a pure description, for the doctor command."""

    install: bool
    targets: tuple[str, ...]
    reason: str
    blockers: tuple[str, ...]


def _deep_gemm_supported(cap: tuple[int, int]) -> bool:
    # CudaPlatform.support_deep_gemm (vllm/platforms/cuda.py:691-697): 9.0, 10.x, 12.x.
    return cap == (9, 0) or cap[0] in (10, 12)


def _stock_blockers(cap: tuple[int, int] | None) -> tuple[str, ...]:
    """What stops vLLM's own DSA path on ``cap`` (when this plugin installs nothing)."""
    if cap is None or cap < (8, 0) or _deep_gemm_supported(cap):
        return ()
    out = [f"vLLM's DSA indexer needs DeepGEMM, which vLLM does not run on SM{cap[0]}{cap[1]}"]
    if cap < (8, 9):
        out.append(
            "vLLM's fused_q, fused_norm_rope (indexer cache) and pack_seq warm-up need Triton "
            "fp8 types (SM89+)"
        )
        out.append(FP8_CACHE_BLOCKER)
    return tuple(out)


def _kernels_available() -> bool:
    try:
        return importlib.util.find_spec("triton_mla_sparse.indexer") is not None
    except (ImportError, ValueError):
        return False


def indexer_plan(
    capability: tuple[int, int] | None, env: Mapping[str, str] | None = None
) -> IndexerPlan:
    """What the plugin installs for a CUDA device of ``capability`` (None: no CUDA device).

    Pure: reads ``env`` (default ``os.environ``) and the installed packages' metadata, imports no
    vLLM module and touches no GPU.
    """
    env = os.environ if env is None else env
    raw = env.get(ENV, "auto")
    mode = raw.strip().lower() or "auto"
    cap_text = "no CUDA device" if capability is None else f"SM{capability[0]}{capability[1]}"
    if mode not in MODES:
        return IndexerPlan(False, (), f"{ENV}={raw!r} is not one of {', '.join(MODES)}", ())
    if mode == "off":
        return IndexerPlan(
            False, (), f"{ENV}=off: vLLM's own indexer path is used", _stock_blockers(capability)
        )

    ok, why = vllm_version_supported()
    if not ok:
        return IndexerPlan(False, (), why, ())
    every = LOGITS_TARGETS + FP8_FREE_TARGETS
    if mode == "triton":
        if capability is not None and capability[0] == 10:
            return IndexerPlan(
                False,
                (),
                f"{ENV}=triton ignored on {cap_text}: vLLM stores SM100 indexer-cache scales as "
                "MX (ue8m0) bytes and passes bf16 weights, which the Triton indexer does not read",
                (),
            )
        targets, reason = every, f"forced by {ENV}=triton on {cap_text}"
        blockers: tuple[str, ...] = ()
    elif capability is None:
        return IndexerPlan(False, (), "no CUDA device: vLLM's DSA CUDA path is not used", ())
    elif capability < (8, 0):
        return IndexerPlan(False, (), f"{cap_text} is below SM80, the backend's minimum", ())
    elif _deep_gemm_supported(capability):
        return IndexerPlan(
            False, (), f"vLLM runs DeepGEMM's indexer on {cap_text}: nothing replaced", ()
        )
    elif capability < (8, 9):
        targets = every
        reason = (
            f"vLLM has no DeepGEMM on {cap_text} and Triton has no fp8 types below SM89: "
            "Triton indexer logits, bf16 index query, indexer cache through vLLM's CUDA op, "
            "fp8 MLA caches through the plugin's integer-e4m3 writer"
        )
        blockers = ()
    else:
        targets = LOGITS_TARGETS
        reason = f"vLLM has no DeepGEMM on {cap_text}: Triton indexer logits on fp8 index queries"
        blockers = ()
    if not _kernels_available():
        return IndexerPlan(
            False,
            (),
            "the Triton indexer kernels (triton_mla_sparse.indexer) are not installed",
            _stock_blockers(capability),
        )
    return IndexerPlan(True, targets, reason, blockers)


def _split(target: str) -> tuple[str, str]:
    module, _, attr = target.rpartition(".")
    return module, attr


def _current(target: str) -> Any:
    module, attr = _split(target)
    if module == OOT:
        from vllm.model_executor.custom_op import op_registry_oot

        return op_registry_oot.get(attr)
    return getattr(sys.modules[module], attr)


def _wrapped(target: str, current: Any) -> Any:
    """What the adapter of ``target`` is built around: the object the target holds, or for the
    out-of-tree op slot (empty in vLLM) vLLM's own ``SparseAttnIndexer`` class."""
    if target.startswith(OOT + "."):
        return getattr(sys.modules[SAI], INDEXER_OP)
    return current


def _signature_error(target: str, current: Any) -> str | None:
    """None when ``current`` (the object ``target`` now holds) has vLLM 0.33.0's signature."""
    if target.startswith(OOT + ".") and current is not None:  # another plugin's out-of-tree op
        return f"{target} already holds {current!r}"
    wrapped = _wrapped(target, current)
    return signature_error(target, wrapped.__init__ if isinstance(wrapped, type) else wrapped)


def _set(target: str, value: Any) -> None:
    module, attr = _split(target)
    if module == OOT:
        from vllm.model_executor.custom_op import op_registry_oot

        if value is None:
            op_registry_oot.pop(attr, None)
        else:
            op_registry_oot[attr] = value
        return
    setattr(sys.modules[module], attr, value)


def original(target: str) -> Any:
    """The vLLM object ``target`` held before installation (:func:`uninstall` puts it back)."""
    return _originals[target]


def apply(plan: IndexerPlan) -> bool:
    """Replace ``plan.targets`` (their modules must be imported); True when all are in place.

    All or nothing: a signature mismatch anywhere logs an error and replaces nothing.
    """
    if not plan.install:
        return False
    with _lock:
        for module in {_split(t)[0] for t in plan.targets} - {OOT}:
            importlib.import_module(module)
        todo, errors = [], []
        for target in plan.targets:
            current = _current(target)
            if getattr(current, MARK, False):
                continue  # already ours
            err = _signature_error(target, current)
            if err:
                errors.append(err)
            todo.append((target, current))
        if errors:
            logger.error(
                "triton_mla_sparse: DSA indexer path NOT installed (vLLM's code differs from "
                "0.33.0's; replacing part of it would be unsafe): %s",
                "; ".join(errors),
            )
            return False
        from .indexer_adapters import build

        for target, current in todo:
            new = build(target, _wrapped(target, current))
            setattr(new, MARK, True)
            _originals[target] = current
            _set(target, new)
        return True


def uninstall() -> None:
    """Put back what :func:`apply` replaced (tests)."""
    with _lock:
        for target, old in list(_originals.items()):
            if getattr(_current(target), MARK, False):
                _set(target, old)
            del _originals[target]


def installed_targets() -> tuple[str, ...]:
    """The targets that currently hold this plugin's replacements."""
    out = []
    for target in LOGITS_TARGETS + FP8_FREE_TARGETS:
        module, _ = _split(target)
        if module != OOT and module not in sys.modules:
            continue
        try:
            if getattr(_current(target), MARK, False):
                out.append(target)
        except Exception:
            continue
    return tuple(out)


def _device_capability() -> tuple[int, int] | None:
    from vllm.platforms import current_platform

    if not current_platform.is_cuda():
        return None
    cap = current_platform.get_device_capability()
    return None if cap is None else (cap.major, cap.minor)


def _installer(plan: IndexerPlan) -> Callable[[], None]:
    """What the import hook runs for one group of ``plan``'s targets; never raises."""

    def run() -> None:
        try:
            if apply(plan):
                extra = f"; still unsupported: {'; '.join(plan.blockers)}" if plan.blockers else ""
                logger.info(
                    "triton_mla_sparse: DSA indexer: Triton path installed (%s): %s%s",
                    plan.reason,
                    ", ".join(plan.targets),
                    extra,
                )
        except Exception as e:  # a plugin must never take vLLM down
            logger.error(
                "triton_mla_sparse: DSA indexer install failed: %s: %s", type(e).__name__, e
            )

    return run


def install(capability: tuple[int, int] | None = None, *, detect: bool = True) -> IndexerPlan:
    """Plan for this process's device and install (now, or when the modules of
    :func:`~.vllm_signatures.trigger_of` load).

    Called from ``register()``; never raises. ``detect=False`` uses ``capability`` as given.
    """
    try:
        cap = _device_capability() if detect else capability
        plan = indexer_plan(cap)
    except Exception as e:
        logger.warning(
            "triton_mla_sparse: DSA indexer path not planned: %s: %s", type(e).__name__, e
        )
        return IndexerPlan(False, (), f"planning failed: {type(e).__name__}: {e}", ())
    if not plan.install:
        logger.info("triton_mla_sparse: DSA indexer: vLLM's own (%s)", plan.reason)
        return plan

    groups: dict[str, list[str]] = {}
    for target in plan.targets:
        groups.setdefault(trigger_of(target), []).append(target)
    with _lock:
        for module, targets in groups.items():
            after_import(module, _installer(replace(plan, targets=tuple(targets))), HOOK_OWNER)
    return plan
