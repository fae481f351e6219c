"""vLLM 0.33's own code, run for one question on a real or simulated GPU.

For a model, TP size and ``--kv-cache-dtype`` this runs, in the order ``vllm serve`` does:

1. the model's config hook (``MODELS_CONFIG_MAP[architecture].verify_and_update_config``), which
   can change the cache dtype before selection (DeepSeek-V3.2 turns ``bfloat16`` into ``auto``,
   GLM-5 turns ``auto`` into ``fp8_e4m3`` on SM10x), then
   ``VllmConfig._reject_mismatched_float_kv_cache``;
2. attention selection, ``vllm.v1.attention.selector.get_attn_backend`` as ``MLAAttention`` calls
   it, on a ``CudaPlatform`` whose device query answers the capability, with the plugin's
   priority wrapper installed exactly where ``register()`` would install it;
3. the cache format the chosen backend turns that dtype into
   (``_canonicalize_sparse_mla_kv_cache_dtype``);
4. the same with ``--attention-backend`` set to the name the plugin says selects it.

The DSA path beyond attention is the plugin's own plan (``indexer_install.indexer_plan``), the
same function ``register()`` acts on. Nothing here restates what vLLM or the plugin decide.

On a machine without libcuda, ``vllm.platforms.cuda`` cannot import its native extension
``vllm._C_stable_libtorch``; an empty module stands in for it (selection never calls into it).
Without a GPU one more stand-in is needed: ``cutlass_mla`` (a dense MLA backend on the SM100
list) allocates a CUDA workspace when imported.
"""

from __future__ import annotations

import ast
import contextlib
import os
import sys
import types
from collections.abc import Iterator
from dataclasses import dataclass, field
from importlib import metadata
from typing import Any

from .models import HEAD_SIZE, KV_CACHE_DTYPES, Model

NATIVE_EXT = "vllm._C_stable_libtorch"
CUTLASS_MLA = "vllm.v1.attention.backends.mla.cutlass_mla"
# Reasons that come from probing this machine rather than from the capability and config.
_PROBE_MARKERS = ("ImportError", "OSError", "on this device")


@dataclass
class Choice:
    """One run of vLLM's selection for a (model, TP, --kv-cache-dtype, --attention-backend)."""

    backend: str | None  # vLLM's backend name; None when vLLM fails
    ours: bool
    cache_dtype: str  # the dtype the layer ends up with (after hooks and canonicalisation)
    error: str = ""  # vLLM's error when backend is None
    # (backend name, reasons) for each sparse backend vLLM considered; [] reasons = valid
    candidates: list[tuple[str, list[str]]] = field(default_factory=list)
    # higher-priority backends rejected only by a probe of this machine (its device or CUDA
    # extensions), which a real GPU of the simulated capability may pass
    uncertain: list[str] = field(default_factory=list)
    # a model with a learnable sink (HY V4) whose layer found no sink-capable backend: it serves
    # with the sink dropped (not the trained model)
    sink_dropped: bool = False


@dataclass
class Case:
    model: Model
    tp: int
    kv_flag: str  # what the user passes as --kv-cache-dtype
    kv_after_hook: str  # after the model's config hook
    hook_note: str  # "" or what the hook did
    auto: Choice  # without --attention-backend
    explicit: Choice  # with --attention-backend <the plugin's flag>

    @property
    def heads(self) -> int:
        return self.model.num_heads // self.tp


@dataclass(frozen=True)
class PluginStatus:
    """The plugin as vLLM would load it in this environment."""

    active: bool  # vLLM loads it and it registered
    lines: tuple[str, ...]  # entry point, VLLM_PLUGINS, registration
    flag: str  # the --attention-backend value that selects it
    conflict: str  # "" or why TRITON_MLA_SPARSE does not select it
    autoselect: bool  # the priority wrapper would be installed on a CUDA machine


@dataclass(frozen=True)
class IndexerPart:
    """The lightning indexer at one capability, as the plugin plans it."""

    lines: tuple[str, ...]
    blockers: tuple[str, ...]  # what stops serving whatever attention does


def plugin_status() -> PluginStatus:
    """Entry point, VLLM_PLUGINS and the plugin's own registration (imports vLLM)."""
    import vllm.envs as envs

    from triton_mla_sparse import vllm_plugin

    eps = [
        e
        for e in metadata.entry_points(group="vllm.general_plugins")
        if e.name == "triton_mla_sparse"
    ]
    lines = [
        "entry point: "
        + (f"{eps[0].name} -> {eps[0].value}" if eps else "NOT FOUND (pip install the package)")
    ]
    active = bool(eps)
    allowed = envs.VLLM_PLUGINS
    if allowed is not None and "triton_mla_sparse" not in allowed:
        lines.append(f"VLLM_PLUGINS={','.join(allowed)} excludes triton_mla_sparse: vLLM skips it")
        active = False
    reg = vllm_plugin.registration()
    if reg.registered:
        lines.append(
            f"registered: yes (vLLM's CUSTOM attention backend slot, --attention-backend {reg.flag})"
        )
    else:
        lines.append(f"registered: no ({reg.reason})")
        active = False
    if reg.conflict:
        lines.append(f"WARNING: {reg.conflict}")
    return PluginStatus(
        active=active,
        lines=tuple(lines),
        flag=reg.flag,
        conflict=reg.conflict,
        autoselect=active and vllm_plugin.autoselect_enabled(),
    )


def import_cuda_platform(have_gpu: bool) -> tuple[types.ModuleType, list[str]]:
    """vllm.platforms.cuda, standing in only what cannot load on this machine."""
    stood_in: list[str] = []
    try:
        import vllm.platforms.cuda as cuda_mod
    except (ImportError, OSError):
        sys.modules[NATIVE_EXT] = types.ModuleType(NATIVE_EXT)
        stood_in.append(f"{NATIVE_EXT} (native extension; needs libcuda)")
        import vllm.platforms.cuda as cuda_mod
    if not have_gpu and CUTLASS_MLA not in sys.modules:
        sys.modules[CUTLASS_MLA] = cutlass_mla_stand_in()
        stood_in.append(f"{CUTLASS_MLA} (allocates CUDA memory at import)")
    return cuda_mod, stood_in


def cutlass_mla_stand_in() -> types.ModuleType:
    """A dense MLA backend that reports itself invalid (it can never serve a sparse model)."""
    from vllm.v1.attention.backend import AttentionBackend

    class CutlassMLABackend(AttentionBackend):
        @staticmethod
        def get_name() -> str:
            return "CUTLASS_MLA"

        @staticmethod
        def get_impl_cls():  # pragma: no cover - never built
            raise NotImplementedError

        @staticmethod
        def get_builder_cls():  # pragma: no cover - never built
            raise NotImplementedError

        @classmethod
        def validate_configuration(cls, *args, **kwargs) -> list[str]:
            return ["not importable without a GPU (stood in by the doctor)"]

    mod = types.ModuleType(CUTLASS_MLA)
    mod.CutlassMLABackend = CutlassMLABackend  # type: ignore[attr-defined]
    return mod


def simulated_platform(cuda_mod: types.ModuleType, cap: tuple[int, int]) -> type:
    """vLLM's CudaPlatform whose device query answers ``cap``; records what selection was asked."""
    from vllm.platforms.interface import DeviceCapability

    class SimulatedCudaPlatform(cuda_mod.CudaPlatform):  # type: ignore[name-defined]
        last_selection: tuple[Any, Any, Any] | None = None

        @classmethod
        def get_device_capability(cls, device_id: int = 0) -> DeviceCapability:
            return DeviceCapability(*cap)

        @classmethod
        def get_attn_backend_cls(cls, selected_backend, attn_selector_config, num_heads=None):
            cls.last_selection = (selected_backend, attn_selector_config, num_heads)
            return super().get_attn_backend_cls(
                selected_backend, attn_selector_config, num_heads=num_heads
            )

    return SimulatedCudaPlatform


@contextlib.contextmanager
def as_current_platform(platform: Any) -> Iterator[None]:
    """Make ``vllm.platforms.current_platform`` resolve to ``platform`` (lazy lookups only)."""
    import vllm.platforms as plats

    saved = plats._current_platform
    plats._current_platform = platform
    try:
        yield
    finally:
        plats._current_platform = saved


class ModelConfigStandIn:
    """The parts of vLLM's ModelConfig that selection reads (a real one needs the checkpoint)."""

    def __init__(self, model: Model, tp: int) -> None:
        import importlib

        import torch
        import transformers

        module, _, name = model.config_cls.rpartition(":")
        config_cls = getattr(importlib.import_module(module) if module else transformers, name)
        self.hf_config = config_cls(**dict(model.config))
        self.hf_config.architectures = [model.architecture]
        self.hf_text_config = self.hf_config
        self.architecture = model.architecture
        self.architectures = [model.architecture]
        self.dtype = torch.bfloat16
        self.rswa_window = None
        self.is_hybrid = False
        self._tp = tp

    def get_num_attention_heads(self, parallel_config: Any = None) -> int:
        return self.hf_text_config.num_attention_heads // self._tp


def short_error(error: str) -> str:
    """vLLM's selection error without the selector config it repeats."""
    if "Reason: [" in error:  # an explicitly selected backend that refused
        text = error.split("Reason: ", 1)[1]
        with contextlib.suppress(ValueError, SyntaxError):
            text = "; ".join(dict.fromkeys(ast.literal_eval(text)))
        who = error.split(" is not valid", 1)[0].removeprefix("Selected backend ")
        if who == "AttentionBackendEnum.CUSTOM":
            who = "TRITON_MLA_SPARSE (this plugin)"
        return f"{who} refuses: {text}"
    if "Reasons: " in error:
        head = error.split(" with ", 1)[0]
        return f"{head}: {error.split('Reasons: ', 1)[1].rstrip('.')}"
    return error


def probe_rejected(choice: Choice) -> list[str]:
    """Backends above the chosen one that only a probe of this machine rejected."""
    chosen = "CUSTOM" if choice.ours else choice.backend
    out = []
    for name, reasons in choice.candidates:
        if name == chosen:
            break
        if reasons and all(any(m in r for m in _PROBE_MARKERS) for r in reasons):
            out.append(name)
    return out


class Simulation:
    """vLLM's selection at one capability, with the plugin as vLLM would load it here."""

    def __init__(
        self,
        cuda_mod: types.ModuleType,
        cap: tuple[int, int],
        *,
        have_gpu: bool,
        plugin: PluginStatus,
        simulated: bool,
    ) -> None:
        from vllm.config import DeviceConfig, VllmConfig

        from triton_mla_sparse.vllm_plugin.selection import (
            install_priority_wrapper,
            uninstall_priority_wrapper,
        )

        self.cuda_mod, self.cap, self.plugin, self.simulated = cuda_mod, cap, plugin, simulated
        # As register() does on CUDA, and never where it would not.
        if plugin.autoselect:
            install_priority_wrapper(cuda_mod)
        else:
            uninstall_priority_wrapper(cuda_mod)
        self.platform = simulated_platform(cuda_mod, cap)
        self.vllm_config = (
            VllmConfig() if have_gpu else VllmConfig(device_config=DeviceConfig(device="cpu"))
        )
        self._preimported: set[int] = set()

    def case(self, model: Model, tp: int, kv_flag: str) -> Case:
        """What vLLM does with ``model`` at ``tp`` and ``--kv-cache-dtype kv_flag``."""
        heads = model.num_heads // tp
        self._preimport_backends(heads)
        if model.sink:  # HY V4's layer module binds the backend: import it under the real platform
            import vllm.models.hy_v4.nvidia.attention  # noqa: F401
        mc = ModelConfigStandIn(model, tp)
        kv, note, refused = self._apply_model_hook(model, mc, kv_flag)
        if refused:
            fail = Choice(None, False, kv, error=refused)
            return Case(model, tp, kv_flag, kv, note, fail, fail)
        auto = self._select(mc, heads, kv, explicit=False)
        if self.simulated:
            auto.uncertain = probe_rejected(auto)
        if self.plugin.active:
            explicit = self._select(mc, heads, kv, explicit=True)
        else:
            explicit = Choice(None, False, kv, error="this plugin is not loaded by vLLM")
        return Case(model, tp, kv_flag, kv, note, auto, explicit)

    def plugin_caches(self, model: Model, tp: int) -> tuple[list[str], dict[str, str]]:
        """Cache dtypes the plugin serves ``model`` with here, and why the others fail."""
        works: list[str] = []
        refused: dict[str, str] = {}
        if not self.plugin.active:
            return works, refused
        for kv in KV_CACHE_DTYPES:
            case = self.case(model, tp, kv)
            if case.explicit.backend is None:
                refused[kv] = case.explicit.error
            else:
                works.append(kv)
        return works, refused

    def indexer(self, env: dict[str, str] | None = None, model: Model | None = None) -> IndexerPart:
        """The lightning indexer here: the plugin's plan (vLLM's own path when it is not loaded);
        for ``model``, only the targets its code reaches (HY V4 never imports DeepSeek-V3.2's
        attention module, whose ``fused_q`` / ``fused_norm_rope`` it would not call)."""
        from triton_mla_sparse.vllm_plugin.indexer_install import ENV, indexer_plan
        from triton_mla_sparse.vllm_plugin.vllm_signatures import ATT, trigger_of

        env = dict(os.environ if env is None else env)
        if not self.plugin.active:
            env[ENV] = "off"  # vLLM's own path: what the plan says happens without the plugin
        plan = indexer_plan(self.cap, env)
        targets = plan.targets
        if model is not None and not model.dsv32_module:
            targets = tuple(t for t in targets if trigger_of(t) != ATT)
        if plan.install:
            lines: tuple[str, ...] = (
                f"indexer: this plugin's Triton path ({plan.reason})",
                "  replaces: " + ", ".join(targets),
            )
        else:
            lines = (f"indexer: vLLM's own ({plan.reason})",)
        if model is not None and not model.dsv32_module and model.path_note:
            lines += (f"{model.label}: {model.path_note}",)
        return IndexerPart(lines, tuple(plan.blockers))

    # -- vLLM's code ------------------------------------------------------------------------

    def _apply_model_hook(
        self, model: Model, model_config: Any, kv_flag: str
    ) -> tuple[str, str, str]:
        """vLLM's config hook for ``model``: (cache dtype after it, note, error or "")."""
        from vllm.config import CacheConfig, ParallelConfig, VllmConfig
        from vllm.model_executor.models.config import MODELS_CONFIG_MAP

        cfg = types.SimpleNamespace(
            model_config=model_config,
            cache_config=CacheConfig(cache_dtype=kv_flag),
            parallel_config=ParallelConfig(),
            speculative_config=None,
        )
        hook = MODELS_CONFIG_MAP.get(model.architecture)
        if hook is not None:  # HY V4 has none
            with as_current_platform(self.platform()):
                hook.verify_and_update_config(cfg)
        after = cfg.cache_config.cache_dtype
        note = ""
        if after != kv_flag:
            note = (
                f"vLLM's {hook.__name__}.verify_and_update_config turns --kv-cache-dtype "
                f"{kv_flag} into {after} for {model.label}"
            )
        try:
            VllmConfig._reject_mismatched_float_kv_cache(cfg)  # type: ignore[arg-type]
        except ValueError as e:
            return after, note, str(e)
        return after, note, ""

    def _preimport_backends(self, heads: int) -> None:
        # Backend modules import vllm.vllm_flash_attn, which refuses to load without its CUDA
        # extension once the current platform is CUDA: import them under the real platform first.
        if heads in self._preimported:
            return
        from vllm.platforms.interface import DeviceCapability

        for kv in KV_CACHE_DTYPES:
            for b in self.cuda_mod._get_backend_priorities(
                use_mla=True,
                device_capability=DeviceCapability(*self.cap),
                num_heads=heads,
                kv_cache_dtype=kv,
                head_size=HEAD_SIZE,
            ):
                with contextlib.suppress(Exception):
                    b.get_class()
        self._preimported.add(heads)

    def _select(self, model_config: Any, heads: int, kv: str, *, explicit: bool) -> Choice:
        """vLLM's get_attn_backend for an MLA sparse layer, then the cache format it uses."""
        import torch
        from vllm.config import AttentionConfig, set_current_vllm_config
        from vllm.model_executor.layers.attention.mla_attention import (
            _canonicalize_sparse_mla_kv_cache_dtype,
        )
        from vllm.v1.attention.backends.registry import AttentionBackendEnum
        from vllm.v1.attention.selector import _cached_get_attn_backend, get_attn_backend

        from triton_mla_sparse.vllm_plugin import BACKEND_CLASS_PATH

        sim, vcfg = self.platform, self.vllm_config
        vcfg.model_config = model_config
        vcfg.cache_config.cache_dtype = kv
        vcfg.attention_config = (
            AttentionConfig(backend=self.plugin.flag) if explicit else AttentionConfig()
        )
        _cached_get_attn_backend.cache_clear()  # keyed without the platform: stale across runs
        sim.last_selection = None
        with set_current_vllm_config(vcfg), as_current_platform(sim()):
            try:
                backend_cls = get_attn_backend(
                    HEAD_SIZE, torch.bfloat16, kv, use_mla=True, use_sparse=True, num_heads=heads
                )
                error = ""
            except ValueError as e:
                backend_cls, error = None, str(e)
            candidates: list[tuple[str, list[str]]] = []
            if not explicit and sim.last_selection is not None:
                _, selector_config, num_heads = sim.last_selection
                valid, invalid = sim.get_valid_backends(
                    sim.get_device_capability(), selector_config, num_heads=num_heads
                )
                everything = [(c.priority, c.backend, []) for c in valid]
                everything += [(p, b, r) for b, (p, r) in invalid.items()]
                for _, b, reasons in sorted(everything, key=lambda x: x[0]):
                    if "SPARSE" in b.name or b is AttentionBackendEnum.CUSTOM:
                        candidates.append((b.name, list(reasons)))
            sink_dropped = False
            if backend_cls is not None and getattr(
                model_config.hf_text_config, "learnable_sink", 0
            ):
                bound = self._bind_sink_backend(heads, kv)
                sink_dropped = bound is None
                backend_cls = bound or backend_cls
        if backend_cls is None:
            return Choice(None, False, kv, error=short_error(error), candidates=candidates)
        path = f"{backend_cls.__module__}.{backend_cls.__qualname__}"
        return Choice(
            backend_cls.get_name(),
            path == BACKEND_CLASS_PATH,
            _canonicalize_sparse_mla_kv_cache_dtype(backend_cls, kv),
            candidates=candidates,
            sink_dropped=sink_dropped,
        )

    def _bind_sink_backend(self, heads: int, kv: str) -> Any:
        """HY V4's own choice after the selector's (``HYV4MLAAttention._resolve_sink_backend``,
        vllm/models/hy_v4/nvidia/attention.py:560-641, run as is): the selected backend when it
        takes the sink, else its sink-capable FLASHMLA_SPARSE subclass where that validates,
        else None (the layer keeps the selector's backend and drops the sink)."""
        from vllm.models.hy_v4.nvidia import attention as hy_attn

        layer = types.SimpleNamespace(
            kv_lora_rank=HEAD_SIZE - 64, qk_rope_head_dim=64, is_sparse=True, num_local_heads=heads
        )
        import torch
        from vllm.v1.attention.selector import _cached_get_attn_backend

        saved = hy_attn.current_platform  # bound at import: the platform vLLM started on
        saved_dtype = torch.get_default_dtype()
        hy_attn.current_platform = self.platform()
        torch.set_default_dtype(torch.bfloat16)  # the checkpoint dtype, as under vLLM's loader
        _cached_get_attn_backend.cache_clear()
        try:
            return hy_attn.HYV4MLAAttention._resolve_sink_backend(layer, kv)
        finally:
            hy_attn.current_platform = saved
            torch.set_default_dtype(saved_dtype)
            _cached_get_attn_backend.cache_clear()
