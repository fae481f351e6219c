"""``triton-mla-sparse doctor``: which sparse MLA backend vLLM would pick here, and why.

Runs vLLM's own selection code (``CudaPlatform.get_valid_backends``: its priority list, wrapped by
this plugin, and each backend's ``validate_configuration``) for the DeepSeek-V3.2 and GLM-5
attention shapes at this GPU's compute capability or a simulated one. On a machine without
libcuda, ``vllm.platforms.cuda`` cannot import its native extension ``vllm._C_stable_libtorch``;
the doctor then stands in an empty module for it (selection code never calls into it). One more
stand-in is needed without a GPU: ``cutlass_mla`` (a dense MLA backend on the SM100 list)
allocates a CUDA workspace when imported (vllm/v1/attention/backends/mla/cutlass_mla.py:99).
"""

from __future__ import annotations

import argparse
import contextlib
import io
import logging
import sys
import types
from importlib import metadata

# (label, heads per GPU): DeepSeek-V3.2 has 128 heads, GLM-5 64; TP8 leaves 16 and 8.
SHAPES = (
    ("DeepSeek-V3.2 TP8", 16),
    ("DeepSeek-V3.2 TP1", 128),
    ("GLM-5 TP8", 8),
    ("GLM-5 TP1", 64),
)
KV_CACHE_DTYPES = ("auto", "bfloat16", "fp8_ds_mla")
HEAD_SIZE = 576
BLOCK_SIZE = 64
_NATIVE_EXT = "vllm._C_stable_libtorch"
_CUTLASS_MLA = "vllm.v1.attention.backends.mla.cutlass_mla"


def add_doctor_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--capability",
        default=None,
        help="simulate a compute capability, e.g. 8.0, 8.9, 9.0, 10.0, 12.0",
    )


def _parse_capability(text: str) -> tuple[int, int]:
    major, _, minor = text.strip().partition(".")
    return int(major), int(minor or 0)


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


def _plugin_status() -> list[str]:
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

    allowed = envs.VLLM_PLUGINS
    if allowed is not None and "triton_mla_sparse" not in allowed:
        lines.append(f"VLLM_PLUGINS={','.join(allowed)} excludes triton_mla_sparse: vLLM skips it")
    ok = vllm_plugin.register()
    reason = vllm_plugin._state.get("reason", "")
    lines.append(f"registered: {'yes' if ok and vllm_plugin.is_registered() else 'no'} ({reason})")
    return lines


def _report(cuda_mod: types.ModuleType, cap: tuple[int, int], have_gpu: bool) -> list[str]:
    import torch
    from vllm.config import DeviceConfig, VllmConfig, set_current_vllm_config
    from vllm.platforms.interface import DeviceCapability
    from vllm.v1.attention.backends.registry import AttentionBackendEnum
    from vllm.v1.attention.selector import AttentionSelectorConfig

    from triton_mla_sparse.vllm_plugin import BACKEND_NAME
    from triton_mla_sparse.vllm_plugin.selection import install_priority_wrapper

    install_priority_wrapper(cuda_mod)

    def name(b: AttentionBackendEnum) -> str:
        return f"{BACKEND_NAME} (this plugin)" if b is AttentionBackendEnum.CUSTOM else b.name

    def sparse(b: AttentionBackendEnum) -> bool:
        return "SPARSE" in b.name or b is AttentionBackendEnum.CUSTOM

    out = [
        f"Selection at compute capability {cap[0]}.{cap[1]}: head size {HEAD_SIZE}, bf16 model, "
        f"block size {BLOCK_SIZE}, index_topk 2048"
    ]
    vcfg = VllmConfig() if have_gpu else VllmConfig(device_config=DeviceConfig(device="cpu"))
    with set_current_vllm_config(vcfg):
        for label, heads in SHAPES:
            for kv in KV_CACHE_DTYPES:
                sel = AttentionSelectorConfig(
                    head_size=HEAD_SIZE,
                    dtype=torch.bfloat16,
                    kv_cache_dtype=kv,
                    block_size=BLOCK_SIZE,
                    use_mla=True,
                    use_sparse=True,
                )
                valid, invalid = cuda_mod.CudaPlatform.get_valid_backends(
                    DeviceCapability(*cap), sel, num_heads=heads
                )
                chosen = min(valid, key=lambda c: c.priority).backend if valid else None
                head = f"{label} ({heads} heads), kv cache {kv}: "
                out.append(head + (name(chosen) if chosen else "NO VALID BACKEND (vLLM fails)"))
                for c in sorted(valid, key=lambda c: c.priority):
                    if c.backend is not chosen and sparse(c.backend):
                        out.append(f"    {name(c.backend)}: valid, lower priority")
                for b, (_, reasons) in sorted(invalid.items(), key=lambda kv_: kv_[1][0]):
                    if sparse(b):
                        out.append(f"    {name(b)}: rejected: {'; '.join(reasons)}")
    return out


def doctor_main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="triton-mla-sparse doctor")
    add_doctor_args(parser)
    args = parser.parse_args(argv)
    print("triton-mla-sparse doctor")
    try:
        vllm_version = metadata.version("vllm")
    except metadata.PackageNotFoundError:
        print(
            "vLLM: not installed. Install it (pip install vllm==0.33.0) to serve with this plugin."
        )
        return 0
    gpu, gpu_cap = _gpu()
    print(f"GPU: {gpu}")
    from triton_mla_sparse.vllm_plugin import vllm_version_supported

    supported, why = vllm_version_supported(vllm_version)
    print(f"vLLM: {vllm_version} ({'supported' if supported else why})")
    if not supported:
        return 0
    cap = _parse_capability(args.capability) if args.capability else gpu_cap
    if cap is None:
        print("No GPU: pass --capability 8.0 / 8.9 / 9.0 / 10.0 / 12.0 to simulate one.")
    # vLLM logs at INFO while importing and selecting; keep the report readable.
    logging.getLogger("vllm").setLevel(logging.WARNING)
    with contextlib.redirect_stderr(io.StringIO()):
        cuda_mod, stood_in = _import_cuda_platform(gpu_cap is not None)
        status = _plugin_status()
        report = _report(cuda_mod, cap, gpu_cap is not None) if cap else []
    print("plugin: " + "\n        ".join(status))
    if stood_in:
        print("stood in (no GPU here): " + "; ".join(stood_in))
    if report:
        print(
            "(vLLM's CudaPlatform.get_valid_backends, with the plugin's priority wrapper "
            "installed as register() does on CUDA)"
        )
    for line in report:
        print(line)
    return 0


if __name__ == "__main__":
    sys.exit(doctor_main())
