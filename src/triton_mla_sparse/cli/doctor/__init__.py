"""``triton-mla-sparse doctor``: what vLLM 0.33 does with a DSA model on this (or a given) GPU.

``doctor --model glm-5 --tp 8 --kv-cache-dtype bfloat16 [--capability 8.9]`` answers in its
first line: the backend vLLM 0.33 selects for that model and cache dtype, whether it is this
plugin, and the flag to pass if one is needed. The lines after it say why (vLLM's own code, run
by :mod:`.simulation`: :mod:`.report` words it), then the rest of the DSA path and the kernel path
(:mod:`.kernel`, which needs no vLLM). ``--all`` prints the first line for both models at TP8 and
TP1 with three cache dtypes. The models and the GPU facts vLLM does not encode are in
:mod:`.models`.
"""

from __future__ import annotations

import argparse
import contextlib
import io
import logging
import sys
from importlib import metadata

from .kernel import kernel_lines
from .models import (
    ALL_KV_CACHE_DTYPES,
    ALL_TP_SIZES,
    CAPABILITY_HELP,
    KV_CACHE_DTYPES,
    MODEL_HELP,
    MODELS,
    capability_text,
    parse_capability,
    parse_model,
    parse_tp,
)
from .report import details, first_line
from .simulation import PluginStatus, Simulation, import_cuda_platform, plugin_status

__all__ = ["DESCRIPTION", "add_doctor_args", "doctor_main", "run"]

DESCRIPTION = (
    "Answers in its first line which sparse MLA backend vLLM 0.33 selects for the model, tensor "
    "parallelism and --kv-cache-dtype on this GPU (or --capability), whether that is this "
    "plugin, and the flag to pass if one is needed; then why. Without vLLM it shows the kernel "
    "path the GPU runs."
)

INSTALL_VLLM = 'pip install vllm==0.33.0, or this project\'s ".[vllm]" extra'


def add_doctor_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--model",
        default="deepseek-v3.2",
        help=f"the model to serve: {MODEL_HELP}",
    )
    parser.add_argument(
        "--tp", default="8", metavar="N", help="--tensor-parallel-size you serve with"
    )
    parser.add_argument(
        "--kv-cache-dtype",
        default="auto",
        choices=KV_CACHE_DTYPES,
        help="--kv-cache-dtype you pass to vllm serve",
    )
    parser.add_argument(
        "--capability",
        default=argparse.SUPPRESS,  # "this machine's GPU", which the help says
        metavar="CC",
        help=f"ask about a GPU of this compute capability: {CAPABILITY_HELP} "
        "(default: this machine's GPU)",
    )
    parser.add_argument(
        "--all",
        action="store_true",
        help="one answer line for each of DeepSeek-V3.2 and GLM-5 at TP8 and TP1 with "
        "--kv-cache-dtype auto, bfloat16 and fp8_ds_mla",
    )


def doctor_main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="triton-mla-sparse doctor")
    add_doctor_args(parser)
    return run(parser.parse_args(argv))


def _error(text: str) -> int:
    print(f"triton-mla-sparse doctor: error: {text}", file=sys.stderr)
    return 2


def _gpu() -> tuple[str, tuple[int, int] | None, int | None]:
    """(description, capability, SM count) of this machine's GPU."""
    import torch

    if not torch.cuda.is_available():
        return "none", None, None
    props = torch.cuda.get_device_properties(torch.cuda.current_device())
    cap = (props.major, props.minor)
    return (
        f"{props.name} (compute capability {cap[0]}.{cap[1]})",
        cap,
        props.multi_processor_count,
    )


def _machine_lines(
    gpu: str,
    cap: tuple[int, int],
    simulated: bool,
    vllm_version: str,
    plugin: PluginStatus,
    stood_in: list[str],
) -> list[str]:
    """The last block: what this machine and its vLLM install are."""
    answering = f"; answering for {capability_text(cap)} (--capability)" if simulated else ""
    out = ["This machine:", f"  GPU: {gpu}{answering}", f"  vLLM: {vllm_version}"]
    out += [f"  plugin: {line}" for line in plugin.lines]
    if not plugin.active:
        auto = "off (vLLM does not load this plugin)"
    elif plugin.autoselect:
        auto = "on: last in vLLM's CUDA MLA priority list (chosen where nothing else is valid)"
    else:
        auto = f"off (TRITON_MLA_SPARSE_AUTOSELECT): only --attention-backend {plugin.flag}"
    out.append(f"  automatic selection: {auto}")
    if stood_in:
        out.append(
            "  stood in (cannot load here; selection never calls them): " + "; ".join(stood_in)
        )
    if simulated:
        out.append(
            "  a simulated GPU is only as good as this machine's answers: backends that probe the "
            "device or their CUDA extension are rejected here (marked 'may come first'); run the "
            "doctor on the serving node for its own answer"
        )
    return out


def run(args: argparse.Namespace) -> int:
    try:
        model = parse_model(args.model)
        tp = parse_tp(args.tp, model)
        given = getattr(args, "capability", None)
        cap = parse_capability(given) if given is not None else None
    except ValueError as e:
        return _error(str(e))
    gpu, gpu_cap, gpu_sms = _gpu()
    if cap is None:
        cap = gpu_cap
    simulated = cap != gpu_cap
    sms = None if simulated else gpu_sms
    heads = model.num_heads // tp

    def kernel(kv_cache_dtype: str = args.kv_cache_dtype) -> list[str]:
        if cap is None:
            return [f"no GPU here: pass --capability ({CAPABILITY_HELP}) for a GPU's kernel path"]
        return kernel_lines(cap, heads, kv_cache_dtype, sms)

    try:
        vllm_version = metadata.version("vllm")
    except metadata.PackageNotFoundError:
        print(f"vLLM: not installed ({INSTALL_VLLM}).")
        print()
        print(f"GPU: {gpu}")
        for line in kernel():
            print(line)
        return 0
    from triton_mla_sparse.vllm_plugin import vllm_version_supported

    supported, why = vllm_version_supported(vllm_version)
    if not supported:
        print(f"vLLM {vllm_version}: this plugin registers nothing there ({why}).")
        print()
        print(f"GPU: {gpu}")
        for line in kernel():
            print(line)
        return 0
    if cap is None:
        print(
            f"No GPU here: pass --capability ({CAPABILITY_HELP}) to ask what vLLM "
            f"{vllm_version} does on one."
        )
        return 0
    print(
        f"Running vLLM {vllm_version}'s selection at {capability_text(cap)} (several seconds)...",
        file=sys.stderr,
        flush=True,
    )
    # vLLM logs at INFO while importing and selecting; keep the report readable.
    logging.getLogger("vllm").setLevel(logging.ERROR)
    with contextlib.redirect_stderr(io.StringIO()):
        cuda_mod, stood_in = import_cuda_platform(gpu_cap is not None)
        plugin = plugin_status()
        sim = Simulation(
            cuda_mod, cap, have_gpu=gpu_cap is not None, plugin=plugin, simulated=simulated
        )
        indexer = sim.indexer() if args.all else sim.indexer(model=model)
        if args.all:
            cases = [
                sim.case(m, t, kv)
                for m in MODELS
                for t in ALL_TP_SIZES
                for kv in ALL_KV_CACHE_DTYPES
            ]
        else:
            cases = [sim.case(model, tp, args.kv_cache_dtype)]
            caches = sim.plugin_caches(model, tp)
    for case in cases:
        print(first_line(case, cap, plugin, indexer))
    print()
    if args.all:
        print(f"DSA path beyond attention at {capability_text(cap)}:")
        for line in indexer.lines:
            print("  " + line)
        for b in indexer.blockers:
            print(f"  still blocks serving here: {b}")
        print("(ask about one model, TP size and cache dtype for the reasons)")
    else:
        case = cases[0]
        # the kernel path of the cache this plugin would serve (where it can)
        kv = case.explicit.cache_dtype if case.explicit.ours else args.kv_cache_dtype
        for line in details(case, cap, plugin, indexer, caches, kernel(kv)):
            print(line)
    print()
    for line in _machine_lines(gpu, cap, simulated, vllm_version, plugin, stood_in):
        print(line)
    return 0


if __name__ == "__main__":
    sys.exit(doctor_main())
