"""``triton-mla-sparse doctor``: what vLLM 0.33 does with DeepSeek-V3.2 and GLM-5 here, and why.

For each model (at TP8 and TP1) and each ``--kv-cache-dtype`` a user may pass, the doctor runs
vLLM's own code in the order ``vllm serve`` does, at this GPU's compute capability or a simulated
one, and reports the outcome, not a re-derivation of it:

1. the model's config hook (``MODELS_CONFIG_MAP[architecture].verify_and_update_config``,
   vllm/model_executor/models/config.py): DeepSeek-V3.2 rewrites ``bfloat16`` to ``auto``
   (``:84-86``), GLM-5 rewrites ``auto`` to ``fp8_e4m3`` on SM10x (``:95-101``); then
   ``VllmConfig._reject_mismatched_float_kv_cache``;
2. attention selection: ``vllm.v1.attention.selector.get_attn_backend`` (what ``MLAAttention``
   calls, with the model's head size, dtype and per-GPU head count) on a ``CudaPlatform`` whose
   device query answers the capability, with this plugin's priority wrapper installed as
   ``register()`` does on CUDA (unless ``TRITON_MLA_SPARSE_AUTOSELECT=0``);
3. the cache format the chosen backend turns that dtype into
   (``_canonicalize_sparse_mla_kv_cache_dtype``, vllm/model_executor/layers/attention/
   mla_attention.py:359-376: FLASHINFER_MLA_SPARSE_SM120 makes ``auto``/``fp8``/``fp8_e4m3``
   fp8_ds_mla);
4. the same with ``--attention-backend TRITON_MLA_SPARSE``, which gives the flag a user needs;
5. the rest of the DSA path at that capability: the lightning indexer (this plugin's
   ``vllm_plugin.indexer.indexer_plan`` where present, otherwise what vLLM's code does there).

The models are transformers' own ``DeepseekV32Config`` / ``GlmMoeDsaConfig`` with the released
checkpoints' attention geometry, bf16, without a kv-cache quantization scheme in the checkpoint
(one would change what ``auto`` resolves to: ``resolve_kv_cache_dtype_string``).

On a machine without libcuda, ``vllm.platforms.cuda`` cannot import its native extension
``vllm._C_stable_libtorch``; the doctor then stands in an empty module for it (selection never
calls into it). Without a GPU one more stand-in is needed: ``cutlass_mla`` (a dense MLA backend
on the SM100 list) allocates a CUDA workspace when imported (cutlass_mla.py:99).
"""

from __future__ import annotations

import argparse
import ast
import contextlib
import io
import logging
import os
import re
import sys
import types
from collections.abc import Iterator
from dataclasses import dataclass, field
from importlib import metadata
from typing import Any

HEAD_SIZE = 576  # kv_lora_rank 512 + qk_rope_head_dim 64, the MLA latent row
KV_CACHE_DTYPES = ("auto", "bfloat16", "fp8_ds_mla")
# Every cache dtype the backend names, for the "which caches work here" line.
ALL_KV_CACHE_DTYPES = ("auto", "bfloat16", "fp8", "fp8_e4m3", "fp8_ds_mla")
FP8_KV_CACHE_DTYPES = ("fp8", "fp8_e4m3", "fp8_ds_mla")
TP_SIZES = (8, 1)
_NATIVE_EXT = "vllm._C_stable_libtorch"
_CUTLASS_MLA = "vllm.v1.attention.backends.mla.cutlass_mla"
# "8.0" / "12.1", or the digits of an sm_XY(Z) target name, with an optional arch suffix (90a).
_CAPABILITY_RE = re.compile(r"(?:sm_?)?(?:(\d{1,2})\.(\d)|(\d{2,3}))[af]?", re.IGNORECASE)
CAPABILITY_HELP = "8.0, 80, sm80 or sm_80 (also 8.6, 8.9, 9.0, 10.0, 12.0, 12.1)"


@dataclass(frozen=True)
class Model:
    label: str
    architecture: str  # the HF "architectures" entry vLLM keys its config hooks on
    config_cls: str  # transformers class name
    config: tuple[tuple[str, int], ...]  # the checkpoint's attention geometry (config.json)

    @property
    def num_heads(self) -> int:
        return dict(self.config)["num_attention_heads"]


MODELS = (
    Model(
        "DeepSeek-V3.2",
        "DeepseekV32ForCausalLM",
        "DeepseekV32Config",
        (
            ("num_attention_heads", 128),
            ("kv_lora_rank", 512),
            ("qk_rope_head_dim", 64),
            ("qk_nope_head_dim", 128),
            ("v_head_dim", 128),
            ("index_topk", 2048),
            ("index_n_heads", 64),
            ("index_head_dim", 128),
        ),
    ),
    Model(
        "GLM-5",
        "GlmMoeDsaForCausalLM",
        "GlmMoeDsaConfig",
        (
            ("num_attention_heads", 64),
            ("kv_lora_rank", 512),
            ("qk_rope_head_dim", 64),
            ("qk_nope_head_dim", 192),
            ("v_head_dim", 256),
            ("index_topk", 2048),
            ("index_n_heads", 32),
            ("index_head_dim", 128),
        ),
    ),
)


def parse_capability(text: str) -> tuple[int, int]:
    """``8.0``, ``80``, ``sm80``, ``sm_80``, ``12.1``, ``121`` -> (major, minor); else ValueError."""
    m = _CAPABILITY_RE.fullmatch(text.strip())
    if m is not None:
        major, minor, digits = m.groups()
        if digits is not None:  # "80" / "sm_121": the last digit is the minor version
            major, minor = digits[:-1], digits[-1]
        if int(major) >= 1:
            return int(major), int(minor)
    raise ValueError(f"--capability {text!r} is not a compute capability (e.g. {CAPABILITY_HELP})")


def add_doctor_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--capability",
        default=None,
        metavar="CC",
        help=f"simulate a GPU of this compute capability: {CAPABILITY_HELP} "
        "(default: this machine's GPU)",
    )


# ---------------------------------------------------------------------------------------------
# The report, as data (tests compare it with vLLM's own functions) and as text.


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


@dataclass
class Case:
    model: str
    tp: int
    heads: int
    kv_flag: str  # what the user passes as --kv-cache-dtype
    kv_after_hook: str  # after the model's config hook
    hook_note: str  # "" or what the hook did
    auto: Choice  # without --attention-backend
    explicit: Choice  # with --attention-backend TRITON_MLA_SPARSE


@dataclass
class Report:
    capability: tuple[int, int]
    autoselect: bool
    plugin_active: bool
    cases: list[Case]
    indexer: list[str]  # lines
    blockers: list[str]  # what stops serving with any cache, whatever attention does
    limits: list[str]  # the indexer plan's blockers (conditions, e.g. fp8 caches), as it says
    caches: list[str]  # cache dtypes that work through this plugin here
    cache_blocked: dict[str, str]  # cache dtype -> why serving fails with it here
    notes: list[str] = field(default_factory=list)


def cache_text(dtype: str) -> str:
    return {
        "auto": "bf16 cache, the model dtype",
        "bfloat16": "bf16 cache",
        "float16": "fp16 cache",
        "fp8": "fp8 e4m3 cache, per-tensor scale",
        "fp8_e4m3": "fp8 e4m3 cache, per-tensor scale",
        "fp8_ds_mla": "fp8_ds_mla cache, 656-byte rows",
    }.get(dtype, f"{dtype} cache")


def _flags(kv_flag: str, explicit: bool) -> str:
    parts = ["--attention-backend TRITON_MLA_SPARSE"] if explicit else []
    if kv_flag != "auto":
        parts.append(f"--kv-cache-dtype {kv_flag}")
    return " ".join(parts)


def summary_line(case: Case, report: Report) -> str:
    return _summary_line(case, report) + (
        f"; vLLM's {case.model} hook made the flag {case.kv_after_hook}"
        if case.kv_after_hook != case.kv_flag
        else ""
    )


def _summary_line(case: Case, report: Report) -> str:
    head = f"{case.model} TP{case.tp}, kv {case.kv_flag}: "
    a, e = case.auto, case.explicit
    tail = ""
    if report.blockers:
        tail = "; serving blocked here (see below)"
    elif case.kv_flag in report.cache_blocked:
        tail = f"; serving blocked here: --kv-cache-dtype {case.kv_flag} (see below)"
    if a.ours:
        flags = _flags(case.kv_flag, explicit=False)
        how = f"pass {flags}" if flags else "no flag needed"
        return f"{head}TRITON_MLA_SPARSE (this plugin), {cache_text(a.cache_dtype)}; {how}{tail}"
    if a.backend is not None:
        out = f"{head}{a.backend}, {cache_text(a.cache_dtype)}"
        if a.uncertain:
            out += (
                f" (on a real GPU {' or '.join(a.uncertain)} may come first: rejected here by "
                "a probe of this machine)"
            )
    else:
        out = f"{head}NO VALID BACKEND (vLLM fails)"
    if e.ours:
        out += (
            f"; this plugin: pass {_flags(case.kv_flag, explicit=True)} "
            f"({cache_text(e.cache_dtype)}){tail}"
        )
    elif report.plugin_active:
        out += f"; this plugin cannot serve it either: {e.error}"
    return out


def render(report: Report) -> list[str]:
    cap = f"{report.capability[0]}.{report.capability[1]}"
    out = [
        f"Summary at compute capability {cap} (what `vllm serve` does; bf16 checkpoint, "
        "no kv-cache scheme in it):"
    ]
    out += ["  " + summary_line(c, report) for c in report.cases]
    out.append("")
    out.append(f"DSA path at {cap} beyond attention:")
    out += ["  " + line for line in report.indexer]
    if report.caches:
        out.append(
            "  cache dtypes this plugin's attention and vLLM's cache writer handle here: "
            + ", ".join(report.caches)
        )
    for kv, why in report.cache_blocked.items():
        out.append(f"  --kv-cache-dtype {kv} does not work here: {why}")
    for limit in report.limits:
        out.append(f"  indexer plan: {limit}")
    if report.blockers:
        out.append("  still blocks serving here, whatever the cache dtype:")
        out += [f"    - {b}" for b in report.blockers]
    else:
        out.append("  nothing else blocks serving here")
    out += ["  note: " + n for n in report.notes]
    out.append("")
    out.append(
        "Details (vLLM's config hook, get_attn_backend, _canonicalize_sparse_mla_kv_cache_dtype; "
        "sparse backends only):"
    )
    for c in report.cases:
        out.append(f"  {c.model} TP{c.tp} ({c.heads} heads per GPU), --kv-cache-dtype {c.kv_flag}:")
        if c.hook_note:
            out.append(f"    {c.hook_note}")
        for label, ch in (
            ("automatic", c.auto),
            ("--attention-backend TRITON_MLA_SPARSE", c.explicit),
        ):
            if ch.backend is None:
                out.append(f"    {label}: vLLM fails: {ch.error}")
                continue
            name = "TRITON_MLA_SPARSE (this plugin)" if ch.ours else ch.backend
            note = ""
            if ch.cache_dtype != c.kv_after_hook:
                note = f" ({ch.backend} turns {c.kv_after_hook} into {ch.cache_dtype})"
            out.append(f"    {label}: {name}, kv cache {ch.cache_dtype}{note}")
        for name, reasons in c.auto.candidates:
            shown = "TRITON_MLA_SPARSE (this plugin)" if name == "CUSTOM" else name
            if reasons:
                out.append(f"      {shown}: rejected: {'; '.join(dict.fromkeys(reasons))}")
            elif name != ("CUSTOM" if c.auto.ours else c.auto.backend):
                out.append(f"      {shown}: valid, lower priority")
    return out


# ---------------------------------------------------------------------------------------------
# Running vLLM's code.


def _gpu() -> tuple[str, tuple[int, int] | None]:
    import torch

    if not torch.cuda.is_available():
        return "none", None
    props = torch.cuda.get_device_properties(torch.cuda.current_device())
    return f"{props.name} (compute capability {props.major}.{props.minor})", (
        props.major,
        props.minor,
    )


def _import_cuda_platform(have_gpu: bool) -> tuple[types.ModuleType, list[str]]:
    """vllm.platforms.cuda, standing in only what cannot load on this machine."""
    stood_in: list[str] = []
    try:
        import vllm.platforms.cuda as cuda_mod
    except (ImportError, OSError):
        sys.modules[_NATIVE_EXT] = types.ModuleType(_NATIVE_EXT)
        stood_in.append(f"{_NATIVE_EXT} (native extension; needs libcuda)")
        import vllm.platforms.cuda as cuda_mod
    if not have_gpu and _CUTLASS_MLA not in sys.modules:
        sys.modules[_CUTLASS_MLA] = _cutlass_mla_stand_in()
        stood_in.append(f"{_CUTLASS_MLA} (allocates CUDA memory at import)")
    return cuda_mod, stood_in


def _cutlass_mla_stand_in() -> types.ModuleType:
    from vllm.v1.attention.backend import AttentionBackend

    class CutlassMLABackend(AttentionBackend):  # dense MLA: can never serve a sparse model
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

    mod = types.ModuleType(_CUTLASS_MLA)
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


class _ModelConfigStandIn:
    """The parts of vLLM's ModelConfig that selection reads (a real one needs the checkpoint)."""

    def __init__(self, model: Model, tp: int) -> None:
        import torch
        import transformers

        self.hf_config = getattr(transformers, model.config_cls)(**dict(model.config))
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


def apply_model_hook(
    model: Model, model_config: Any, kv_flag: str, platform: Any
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
    hook = MODELS_CONFIG_MAP[model.architecture]
    with as_current_platform(platform):
        hook.verify_and_update_config(cfg)
    after = cfg.cache_config.cache_dtype
    note = ""
    if after != kv_flag:
        note = f"vLLM's {hook.__name__}.verify_and_update_config: {kv_flag} -> {after}"
    try:
        VllmConfig._reject_mismatched_float_kv_cache(cfg)  # type: ignore[arg-type]
    except ValueError as e:
        return after, note, str(e)
    return after, note, ""


def _preimport_backends(cuda_mod: types.ModuleType, cap: tuple[int, int], heads: int) -> None:
    # Backend modules import vllm.vllm_flash_attn, which refuses to load without its CUDA
    # extension once the current platform is CUDA: import them under the real platform first.
    from vllm.platforms.interface import DeviceCapability

    for kv in ALL_KV_CACHE_DTYPES:
        for b in cuda_mod._get_backend_priorities(
            use_mla=True,
            device_capability=DeviceCapability(*cap),
            num_heads=heads,
            kv_cache_dtype=kv,
            head_size=HEAD_SIZE,
        ):
            with contextlib.suppress(Exception):
                b.get_class()


def select(
    sim: type, model_config: Any, heads: int, kv: str, explicit: bool, vllm_config: Any
) -> Choice:
    """vLLM's get_attn_backend for an MLA sparse layer, then the cache format the backend uses."""
    import torch
    from vllm.config import AttentionConfig, set_current_vllm_config
    from vllm.model_executor.layers.attention.mla_attention import (
        _canonicalize_sparse_mla_kv_cache_dtype,
    )
    from vllm.v1.attention.backends.registry import AttentionBackendEnum
    from vllm.v1.attention.selector import _cached_get_attn_backend, get_attn_backend

    from triton_mla_sparse.vllm_plugin import BACKEND_CLASS_PATH, BACKEND_NAME

    vllm_config.model_config = model_config
    vllm_config.cache_config.cache_dtype = kv
    vllm_config.attention_config = (
        AttentionConfig(backend=BACKEND_NAME) if explicit else AttentionConfig()
    )
    _cached_get_attn_backend.cache_clear()  # keyed without the platform: stale across runs
    sim.last_selection = None
    with set_current_vllm_config(vllm_config), as_current_platform(sim()):
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
    if backend_cls is None:
        return Choice(None, False, kv, error=_short_error(error), candidates=candidates)
    path = f"{backend_cls.__module__}.{backend_cls.__qualname__}"
    return Choice(
        backend_cls.get_name(),
        path == BACKEND_CLASS_PATH,
        _canonicalize_sparse_mla_kv_cache_dtype(backend_cls, kv),
        candidates=candidates,
    )


# Reasons that come from probing this machine rather than from the capability and config.
_PROBE_MARKERS = ("ImportError", "OSError", "on this device")


def _probe_rejected(choice: Choice) -> list[str]:
    """Backends above the chosen one that only a probe of this machine rejected."""
    chosen = "CUSTOM" if choice.ours else choice.backend
    out = []
    for name, reasons in choice.candidates:
        if name == chosen:
            break
        if reasons and all(any(m in r for m in _PROBE_MARKERS) for r in reasons):
            out.append(name)
    return out


def _short_error(error: str) -> str:
    # vLLM's messages repeat the whole selector config; keep the reasons.
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


def indexer_lines(sim: type, cap: tuple[int, int]) -> tuple[list[str], list[str], list[str]]:
    """(description, blockers, the plan's limits) of the lightning indexer at ``cap``."""
    tag = f"sm{cap[0]}{cap[1]}"
    deep_gemm = sim.support_deep_gemm()  # vLLM's own gate: 9.0, 10.x, 12.x
    try:
        from triton_mla_sparse.vllm_plugin.indexer import indexer_plan
    except ImportError:
        indexer_plan = None
    if indexer_plan is not None:
        plan = indexer_plan(cap, os.environ)
        if plan.install:
            lines = [f"indexer: this plugin's Triton fallback ({plan.reason})"]
            lines.append("  replaces: " + ", ".join(plan.targets))
            return lines, [], list(plan.blockers)
        lines = [f"indexer: vLLM's own DeepGEMM path ({plan.reason})"]
        if deep_gemm:
            return lines, [], list(plan.blockers)
        return (
            lines,
            [f"the lightning indexer: vLLM's DeepGEMM has no {tag} kernels ({plan.reason})"],
            list(plan.blockers),
        )
    # No indexer plan in this build: what vLLM 0.33's own code does.
    from vllm.utils.import_utils import has_deep_gemm

    if deep_gemm:
        return (
            [
                "indexer: vLLM's DeepGEMM kernels (CudaPlatform.support_deep_gemm() is true at "
                f"{cap[0]}.{cap[1]}: vllm/platforms/cuda.py:691-697)"
            ],
            [],
            [],
        )
    vendored = "true (vLLM vendors DeepGEMM)" if has_deep_gemm() else "false"
    lines = [
        f"indexer: vLLM's DeepGEMM path, which has no {tag} kernels. Nothing stops the model at "
        f"load: has_deep_gemm() is {vendored}, so SparseAttnIndexer's check "
        "(model_executor/layers/sparse_attn_indexer.py:1060-1064) passes, and the DSA path "
        "never asks CudaPlatform.support_deep_gemm() (false here: platforms/cuda.py:691-697). "
        "The first indexer call fails inside the vendored DeepGEMM extension "
        "(vllm/third_party/deep_gemm, 'Unsupported architecture'): the decode metadata "
        "builder's get_paged_mqa_logits_metadata (v1/attention/backends/mla/indexer.py:1746-1752)"
        " and the logits fp8_fp4_mqa_logits / fp8_fp4_paged_mqa_logits "
        "(model_executor/layers/sparse_attn_indexer.py:728, :880)"
    ]
    blockers = [f"the lightning indexer: vLLM's DeepGEMM has no {tag} kernels"]
    if cap < (8, 9):
        blockers.append(
            "vLLM's fused_q and fused_norm_rope Triton kernels (models/deepseek_v32/common/"
            "kernels.py:806, :209) quantise the index q/k with tl.float8e4nv, which Triton "
            f"compiles for sm89+ only: they fail to compile for {tag}"
        )
    return lines, blockers, []


FP8_WRITER_REASON = (
    "vLLM's MLA cache writer (fused_norm_rope, models/deepseek_v32/common/kernels.py:355-405) "
    "quantises with tl.float8e4nv, which Triton compiles for sm89+ only"
)


def diagnose(
    cuda_mod: types.ModuleType,
    cap: tuple[int, int],
    have_gpu: bool,
    plugin_active: bool,
    simulated: bool = True,
) -> Report:
    from vllm.config import DeviceConfig, VllmConfig

    from triton_mla_sparse.vllm_plugin import AUTOSELECT_ENV
    from triton_mla_sparse.vllm_plugin.selection import (
        install_priority_wrapper,
        uninstall_priority_wrapper,
    )

    autoselect = plugin_active and os.environ.get(AUTOSELECT_ENV, "1").strip().lower() not in (
        "0",
        "false",
        "no",
        "off",
    )
    # As register() does on CUDA; and never where it would not (a wrapper register() put there
    # on a GPU with autoselection off cannot exist).
    if autoselect:
        install_priority_wrapper(cuda_mod)
    else:
        uninstall_priority_wrapper(cuda_mod)
    sim = simulated_platform(cuda_mod, cap)
    vcfg = VllmConfig() if have_gpu else VllmConfig(device_config=DeviceConfig(device="cpu"))
    cases: list[Case] = []
    for model in MODELS:
        for tp in TP_SIZES:
            heads = model.num_heads // tp
            _preimport_backends(cuda_mod, cap, heads)
            mc = _ModelConfigStandIn(model, tp)
            for kv_flag in KV_CACHE_DTYPES:
                kv, note, refused = apply_model_hook(model, mc, kv_flag, sim())
                if refused:
                    fail = Choice(None, False, kv, error=refused)
                    cases.append(Case(model.label, tp, heads, kv_flag, kv, note, fail, fail))
                    continue
                auto = select(sim, mc, heads, kv, False, vcfg)
                if simulated:
                    auto.uncertain = _probe_rejected(auto)
                if plugin_active:
                    explicit = select(sim, mc, heads, kv, True, vcfg)
                else:
                    explicit = Choice(None, False, kv, error="this plugin is not loaded by vLLM")
                cases.append(Case(model.label, tp, heads, kv_flag, kv, note, auto, explicit))
    indexer, blockers, limits = indexer_lines(sim, cap)
    caches, cache_blocked = [], {}
    if plugin_active:
        mc = _ModelConfigStandIn(MODELS[0], TP_SIZES[0])
        for kv in ALL_KV_CACHE_DTYPES:
            ch = select(sim, mc, MODELS[0].num_heads // TP_SIZES[0], kv, True, vcfg)
            if ch.backend is None:
                cache_blocked[kv] = ch.error
            elif kv in FP8_KV_CACHE_DTYPES and cap < (8, 9) and not _backend_refuses_fp8():
                cache_blocked[kv] = FP8_WRITER_REASON
            else:
                caches.append(kv)
    notes = []
    if cap == (12, 1):
        notes.append(
            "GB10 (DGX Spark, sm_121): FlashInfer's SM120 sparse MLA kernel is reported to "
            "livelock there (flashinfer#3700, vllm#49026); --attention-backend "
            "TRITON_MLA_SPARSE avoids it"
        )
    return Report(
        cap,
        autoselect,
        plugin_active,
        cases,
        indexer,
        blockers,
        limits,
        caches,
        cache_blocked,
        notes,
    )


def _backend_refuses_fp8() -> bool:
    # Builds whose backend refuses fp8 caches below sm89 itself report it through selection.
    from triton_mla_sparse.vllm_plugin import backend

    return hasattr(backend, "FP8_CACHE_DTYPES")


def _plugin_status() -> tuple[bool, list[str]]:
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
    import vllm.envs as envs

    active = bool(eps)
    allowed = envs.VLLM_PLUGINS
    if allowed is not None and "triton_mla_sparse" not in allowed:
        lines.append(f"VLLM_PLUGINS={','.join(allowed)} excludes triton_mla_sparse: vLLM skips it")
        active = False
    ok = vllm_plugin.register() and vllm_plugin.is_registered()
    if ok:
        lines.append(
            f"registered: yes (vLLM's CUSTOM attention backend slot, alias "
            f"{vllm_plugin.BACKEND_NAME})"
        )
    else:
        lines.append(f"registered: no ({vllm_plugin._state.get('reason', '')})")
        active = False
    return active, lines


def doctor_main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="triton-mla-sparse doctor")
    add_doctor_args(parser)
    return run(parser.parse_args(argv))


def run(args: argparse.Namespace) -> int:
    cap: tuple[int, int] | None = None
    if args.capability is not None:
        try:
            cap = parse_capability(args.capability)
        except ValueError as e:
            print(f"triton-mla-sparse doctor: error: {e}", file=sys.stderr)
            return 2
    print("triton-mla-sparse doctor")
    try:
        vllm_version = metadata.version("vllm")
    except metadata.PackageNotFoundError:
        print(
            "vLLM: not installed. Install it (pip install vllm==0.33.0, or this project's "
            '".[vllm]" extra) to serve with this plugin.'
        )
        return 0
    gpu, gpu_cap = _gpu()
    print(f"GPU: {gpu}")
    from triton_mla_sparse.vllm_plugin import vllm_version_supported

    supported, why = vllm_version_supported(vllm_version)
    print(f"vLLM: {vllm_version} ({'supported' if supported else why})")
    if not supported:
        return 0
    if cap is None:
        cap = gpu_cap
    if cap is None:
        print(f"No GPU here: pass --capability ({CAPABILITY_HELP}) to simulate one.")
    elif cap != gpu_cap:
        print(f"Simulating compute capability {cap[0]}.{cap[1]} (--capability).")
    print("Importing vLLM's CUDA platform and attention backends (several seconds)...", flush=True)
    # vLLM logs at INFO while importing and selecting; keep the report readable.
    logging.getLogger("vllm").setLevel(logging.ERROR)
    with contextlib.redirect_stderr(io.StringIO()):
        cuda_mod, stood_in = _import_cuda_platform(gpu_cap is not None)
        active, status = _plugin_status()
    print("plugin: " + "\n        ".join(status))
    if stood_in:
        print("stood in (no GPU here): " + "; ".join(stood_in))
    if cap is None:
        return 0
    print(
        f"Running vLLM's selection for {len(MODELS) * len(TP_SIZES) * len(KV_CACHE_DTYPES)} cases...",
        flush=True,
    )
    with contextlib.redirect_stderr(io.StringIO()):
        report = diagnose(cuda_mod, cap, gpu_cap is not None, active, simulated=cap != gpu_cap)
    if not active:
        auto = "off (vLLM does not load this plugin)"
    elif report.autoselect:
        auto = "on: appended last to vLLM's CUDA MLA priority list (chosen where nothing else is valid)"
    else:
        auto = "off (TRITON_MLA_SPARSE_AUTOSELECT=0): only --attention-backend TRITON_MLA_SPARSE"
    print(f"automatic selection: {auto}")
    print()
    for line in render(report):
        print(line)
    return 0


if __name__ == "__main__":
    sys.exit(doctor_main())
