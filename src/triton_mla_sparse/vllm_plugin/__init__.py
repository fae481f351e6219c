"""vLLM plugin: the TRITON_MLA_SPARSE sparse MLA attention backend (vLLM 0.33).

vLLM calls :func:`register` through the ``vllm.general_plugins`` entry point in every process
(API server, engine core, each worker) before models are built. Importing this package imports
nothing from vLLM or Triton and touches no GPU; :func:`register` imports only vLLM's backend
registry (and, on CUDA, its platform module to wrap the priority list).

What it registers:

- the backend class in vLLM's ``AttentionBackendEnum.CUSTOM`` slot. A brand-new enum member
  (``AttentionBackendEnum.register("TRITON_MLA_SPARSE", ...)``) is not used: enum members pickle
  by value, and a spawned worker unpickles the engine config before any plugin runs, so a new
  member's value is unknown there and unpickling fails. ``CUSTOM`` exists in every process.
- the name ``TRITON_MLA_SPARSE`` as an alias of that same ``CUSTOM`` member, so
  ``--attention-backend TRITON_MLA_SPARSE`` parses to ``CUSTOM`` and pickles as ``CUSTOM``.
  Should vLLM's own enum ever gain a ``TRITON_MLA_SPARSE`` member, that name selects vLLM's
  backend, not this one: registration says so (log and :func:`registration`) and the flag to
  pass becomes ``--attention-backend CUSTOM``.
- on CUDA, a wrapper around vLLM's MLA priority list that appends ``CUSTOM`` last, so this
  backend is chosen automatically only where no native sparse MLA backend is valid.
  Set ``TRITON_MLA_SPARSE_AUTOSELECT=0`` to turn that off (explicit selection still works).
- where vLLM has no DeepGEMM (SM80/86/89), the Triton DSA indexer path (:mod:`.indexer_install`;
  ``TRITON_MLA_SPARSE_INDEXER=auto|triton|off``).
- DeepSeek-V4's attention layers where vLLM 0.33 has no kernel (SM80/86/89; SM12x with a bf16
  cache) (:mod:`.deepseek_v4`; ``TRITON_MLA_SPARSE_DSV4=auto|triton|off``).
"""

from __future__ import annotations

import logging
import os
import threading
from collections.abc import Mapping
from dataclasses import dataclass

from .vllm_signatures import SUPPORTED_VLLM, vllm_version_supported

BACKEND_NAME = "TRITON_MLA_SPARSE"
BACKEND_CLASS_PATH = "triton_mla_sparse.vllm_plugin.backend.TritonMLASparseBackend"
# vLLM's backend and selection internals this plugin builds on change between minor releases.
AUTOSELECT_ENV = "TRITON_MLA_SPARSE_AUTOSELECT"
# vLLM kv-cache dtype -> the kernel's kv_format: the cache dtypes the backend serves. Here, not in
# backend.py, so that tools without vLLM (doctor) read the same table.
KV_FORMAT_OF: dict[str, str] = {
    "auto": "auto",
    "float16": "auto",
    "bfloat16": "auto",
    "fp8": "fp8",  # e4m3, one per-tensor scale (layer._k_scale)
    "fp8_e4m3": "fp8",
    "fp8_ds_mla": "fp8_ds_mla",  # 656-byte rows with 4 fp32 group scales
}
_OFF = ("0", "false", "no", "off")

# A child of vLLM's logger, so the line appears with vLLM's formatting and level.
logger = logging.getLogger("vllm.triton_mla_sparse")

_lock = threading.Lock()
_state: dict[str, object] = {"done": False, "registered": False, "reason": "", "conflict": ""}

__all__ = [
    "AUTOSELECT_ENV",
    "BACKEND_CLASS_PATH",
    "BACKEND_NAME",
    "KV_FORMAT_OF",
    "SUPPORTED_VLLM",
    "Registration",
    "autoselect_enabled",
    "is_registered",
    "register",
    "registration",
    "vllm_version_supported",
]


@dataclass(frozen=True)
class Registration:
    """What :func:`register` did in this process, for tools that report it (``doctor``)."""

    registered: bool
    reason: str  # the line register() logged
    # The --attention-backend value that selects this backend: BACKEND_NAME, or "CUSTOM" where
    # vLLM's own enum has a member of that name (then ``conflict`` says so).
    flag: str
    conflict: str  # "" or why --attention-backend TRITON_MLA_SPARSE does not select this plugin


def autoselect_enabled(env: Mapping[str, str] | None = None) -> bool:
    """Whether ``TRITON_MLA_SPARSE_AUTOSELECT`` (in ``env``, default ``os.environ``) leaves
    automatic selection on: anything but 0/false/no/off, unset included."""
    env = os.environ if env is None else env
    return env.get(AUTOSELECT_ENV, "1").strip().lower() not in _OFF


def is_registered() -> bool:
    """Whether ``AttentionBackendEnum.CUSTOM`` currently resolves to this plugin's backend."""
    try:
        from vllm.v1.attention.backends.registry import _ATTN_OVERRIDES, AttentionBackendEnum
    except Exception:
        return False
    return _ATTN_OVERRIDES.get(AttentionBackendEnum.CUSTOM) == BACKEND_CLASS_PATH


def _add_name_alias(enum_cls: type) -> str:
    """Make ``BACKEND_NAME`` a second name of ``CUSTOM``; "" or why the name is vLLM's own.

    An alias, not a new member: AttentionBackendEnum["TRITON_MLA_SPARSE"] returns CUSTOM, which
    pickles as CUSTOM and so reaches spawned workers intact. Where vLLM's enum already has a
    member of that name (its own backend), the alias would silently do nothing and the flag would
    select vLLM's backend: the member is left alone and the returned text says so.
    """
    member_map = enum_cls._member_map_  # type: ignore[attr-defined]
    current = member_map.get(BACKEND_NAME)
    if current is None:
        member_map[BACKEND_NAME] = enum_cls.CUSTOM  # type: ignore[attr-defined]
        return ""
    if current is enum_cls.CUSTOM:  # type: ignore[attr-defined]
        return ""
    return (
        f"vLLM's AttentionBackendEnum has its own {BACKEND_NAME} member ({current.value}): "
        f"--attention-backend {BACKEND_NAME} selects vLLM's backend, not this plugin; "
        "select this plugin with --attention-backend CUSTOM"
    )


def register() -> bool:
    """Register the backend with vLLM. Cheap, idempotent, never raises; returns success.

    Safe to call any number of times and from any vLLM process; logs one line per process.
    """
    with _lock:
        if _state["done"]:
            return bool(_state["registered"])
        try:
            ok, why = _register()
        except Exception as e:  # a plugin must never take vLLM down
            ok, why = False, f"registration failed: {type(e).__name__}: {e}"
        _state.update(done=True, registered=ok, reason=why)
        if ok:
            logger.info("triton_mla_sparse: %s", why)
            if _state.get("conflict"):
                logger.warning("triton_mla_sparse: %s", _state["conflict"])
            # The DeepGEMM-free DSA indexer where vLLM has none (SM80/86/89); never raises,
            # imports nothing until vLLM's DSA model module loads.
            try:
                from .indexer_install import install

                install()
            except Exception as e:
                logger.warning("triton_mla_sparse: DSA indexer path skipped: %s", e)
            # DeepSeek-V4's attention layers where vLLM has no kernel; imports nothing until
            # vLLM's DeepSeek-V4 CUDA model module loads.
            try:
                from .deepseek_v4 import install as install_dsv4

                install_dsv4()
            except Exception as e:
                logger.warning("triton_mla_sparse: DeepSeek-V4 route skipped: %s", e)
        else:
            logger.warning("triton_mla_sparse: registered nothing: %s", why)
        return ok


def _register() -> tuple[bool, str]:
    ok, why = vllm_version_supported()
    if not ok:
        return False, why
    from vllm.v1.attention.backends.registry import (
        _ATTN_OVERRIDES,
        AttentionBackendEnum,
        register_backend,
    )

    custom = AttentionBackendEnum.CUSTOM
    current = _ATTN_OVERRIDES.get(custom)
    if current not in (None, BACKEND_CLASS_PATH):
        return False, (
            f"AttentionBackendEnum.CUSTOM already holds {current} (another plugin); "
            "not overriding it"
        )
    if current is None:
        register_backend(custom, BACKEND_CLASS_PATH)
    conflict = _add_name_alias(AttentionBackendEnum)
    _state["conflict"] = conflict

    auto = "off (no CUDA platform)"
    if not autoselect_enabled():
        auto = f"off ({AUTOSELECT_ENV}=0)"
    else:
        from .selection import install_priority_wrapper

        if install_priority_wrapper():
            auto = "on where no native sparse MLA backend is valid"
    alias = "no alias: the name is vLLM's own" if conflict else f"alias {BACKEND_NAME}"
    return True, (
        f"registered {BACKEND_CLASS_PATH} as attention backend CUSTOM "
        f"({alias}); automatic selection {auto}"
    )


def registration() -> Registration:
    """Register (if not yet done in this process) and say what happened; never raises."""
    register()
    conflict = str(_state.get("conflict", ""))
    return Registration(
        registered=bool(_state["registered"]) and is_registered(),
        reason=str(_state["reason"]),
        flag="CUSTOM" if conflict else BACKEND_NAME,
        conflict=conflict,
    )
