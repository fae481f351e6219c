"""Test setup: without a GPU, kernels run under Triton's interpreter on CPU tensors.

TRITON_INTERPRET must be set before the kernel module is imported; the package imports it lazily,
so setting it here, before any test runs, is enough.
"""

from __future__ import annotations

import hashlib
import importlib.util
import json
import os
import subprocess
import sys
import time
from importlib import metadata
from pathlib import Path

import pytest
import torch

HAS_GPU = torch.cuda.is_available()
if not HAS_GPU:
    os.environ.setdefault("TRITON_INTERPRET", "1")

DEVICE = torch.device("cuda") if HAS_GPU else torch.device("cpu")
# The interpreter computes bf16 wrongly (a bf16 tl.dot returns garbage): bf16 runs on the GPU only.
DTYPES = [torch.float16, torch.float32] + ([torch.bfloat16] if HAS_GPU else [])


ROOT = Path(__file__).resolve().parents[1]


FP32_MARK = "fp32"


def pytest_collection_modifyitems(items):
    """Mark ``fp32`` every case with a float32 parameter (an fp32 query or output): on a GPU its
    kernels are Triton's slowest specializations to compile, about ten seconds each, 40-50% of
    the suite's compile time, for a dtype no serving engine passes; the GPU check's ``quick``
    leaves them to the ``suite-fp32`` part of ``full`` (tools/gpu_check.py)."""
    for item in items:
        spec = getattr(item, "callspec", None)
        if spec is not None and any(v is torch.float32 for v in spec.params.values()):
            item.add_marker(FP32_MARK)


@pytest.fixture(autouse=True)
def _triton_compile_time(record_property):
    """The seconds a test spends in Triton's JIT compiles (a hit in the on-disk cache included)
    and how many it runs, as the junit XML properties ``triton_compile_s`` and
    ``triton_compiles``, and each compile as ``triton_compiled`` (``kernel:key:seconds``, ";"
    between compiles; key: a hash of Triton's specialization key, the same in every worker);
    tools/gpu_check.py sums them, to show how much of the GPU check's time is compiling rather
    than running and which kernels' specializations it goes to (the interpreter compiles
    nothing: zero on CPU). Triton's hooks around each compile, chained to any already set;
    yields the running totals and the compiles."""
    spent = {"s": 0.0, "n": 0, "t0": None, "compiled": []}
    knobs = _triton_runtime_knobs()
    if knobs is None:
        yield spent
        return
    before, after = knobs.jit_cache_hook, knobs.jit_post_compile_hook

    def on_compile(**kw):
        spent["t0"] = time.perf_counter()
        return before(**kw) if before else None

    def on_compiled(**kw):
        if spent["t0"] is not None:
            seconds = time.perf_counter() - spent["t0"]
            spent["s"] += seconds
            spent["n"] += 1
            spent["t0"] = None
            spent["compiled"].append(f"{_kernel_name(kw)}:{_key_hash(kw)}:{seconds:.2f}")
        return after(**kw) if after else None

    knobs.jit_cache_hook, knobs.jit_post_compile_hook = on_compile, on_compiled
    try:
        yield spent
    finally:
        knobs.jit_cache_hook, knobs.jit_post_compile_hook = before, after
        record_property("triton_compile_s", round(spent["s"], 3))
        record_property("triton_compiles", spent["n"])
        if spent["compiled"]:
            record_property("triton_compiled", ";".join(spent["compiled"]))


def _kernel_name(hook_kwargs: dict) -> str:
    """The compiled function's name from the arguments Triton passes its compile hooks, with
    its first pointer argument's type (q's dtype in this package's kernels: an fp32 variant
    apart from a bf16 one), e.g. ``sparse_mla_kernel(*bf16)``."""
    fn = hook_kwargs.get("fn")
    name = str(getattr(fn, "name", None) or "?")
    signature = (hook_kwargs.get("compile") or {}).get("signature") or {}
    first = next((t for t in signature.values() if isinstance(t, str) and t[:1] == "*"), None)
    if first:
        name += f"({first})"
    return name.replace(":", "_").replace(";", "_")


def _key_hash(hook_kwargs: dict) -> str:
    """A short hash of the compile's specialization key (its text is the same in every
    process for the same kernel, arguments' types and constexprs and options)."""
    return hashlib.sha1(repr(hook_kwargs.get("key")).encode()).hexdigest()[:12]


def _triton_runtime_knobs():
    """triton.knobs.runtime where it has the JIT compile hooks (Triton 3.4 on), else None."""
    try:
        from triton import knobs
    except ImportError:
        return None
    runtime = getattr(knobs, "runtime", None)
    return runtime if hasattr(runtime, "jit_post_compile_hook") else None


def compile_ahead(jobs: dict, workdir: Path, asm_dir: Path | None = None) -> dict:
    """Compile ``jobs`` (tests/aot_compile.py's job dicts by key) ahead of time in a fresh
    process under the installed Triton, without the interpreter; return its results by key.
    ``asm_dir``: where it writes each kernel's PTX (TMS_ASM_DIR)."""
    import triton_mla_sparse

    here = Path(__file__).resolve().parent
    (workdir / "jobs.json").write_text(json.dumps(jobs))
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    # the package this process imported, not this checkout's src: a test run against another
    # source tree (PYTHONPATH=OTHER/src) must compile that tree's kernels, which its own
    # figures (the shared-memory formulas, the heuristics) describe
    package_root = Path(triton_mla_sparse.__file__).resolve().parents[1]
    env["PYTHONPATH"] = os.pathsep.join([str(package_root), env.get("PYTHONPATH", "")])
    if asm_dir is not None:
        asm_dir.mkdir(exist_ok=True)
        env["TMS_ASM_DIR"] = str(asm_dir)
    subprocess.run(
        [sys.executable, str(here / "aot_compile.py"), "jobs.json", "out.json"],
        cwd=workdir,
        env=env,
        check=True,
        timeout=900,
    )
    return json.loads((workdir / "out.json").read_text())


def load_script(relpath: str, name: str):
    """A script of this repository (e.g. ``benchmarks/perf/tune.py``) imported by path as module
    ``name``, registered in ``sys.modules`` (its dataclasses look their module up while it runs)."""
    spec = importlib.util.spec_from_file_location(name, ROOT / relpath)
    mod = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = mod
    spec.loader.exec_module(mod)
    return mod


@pytest.fixture
def device() -> torch.device:
    return DEVICE


def size(cpu, gpu):
    """A problem size: small under the CPU interpreter (~0.3-1 s a call), realistic on a GPU."""
    return gpu if HAS_GPU else cpu


def dtype_id(dtype: torch.dtype) -> str:
    return {torch.float16: "fp16", torch.bfloat16: "bf16", torch.float32: "fp32"}[dtype]


def require_vllm() -> None:
    """Skip (the calling test, or the module at import) unless the vllm distribution is installed.

    An import alone is not proof: any folder named ``vllm`` on sys.path imports as an empty
    namespace package."""
    try:
        metadata.version("vllm")
    except metadata.PackageNotFoundError:
        pytest.skip("vllm is not installed (CI installs vllm==0.33.0)", allow_module_level=True)


def toolchain_missing(arch: str) -> str | None:
    """Why the installed Triton cannot compile for ``arch`` ("cuda:90", "hip:gfx942"), or None.

    A Triton unpacked without its AMD backend or without ``ptxas-blackwell`` (sm100+) cannot
    build for those targets; the compile tests skip them there, naming what is missing."""
    from triton.backends import backends

    kind, _, cc = arch.partition(":")
    name = "nvidia" if kind == "cuda" else "amd"
    if name not in backends:
        return f"this Triton build has no {name} backend (triton/backends/{name})"
    if kind == "cuda":
        from triton.backends.nvidia.compiler import get_ptxas

        try:
            get_ptxas(int(cc)).path  # noqa: B018 (resolving the path is the check)
        except Exception as e:  # the tool's lookup raises when the binary is absent
            return f"this Triton build has no ptxas for sm_{cc} ({type(e).__name__}: {e})"
    return None
