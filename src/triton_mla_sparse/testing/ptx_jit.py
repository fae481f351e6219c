"""Run sm80 / sm86 / sm89 code paths on a newer NVIDIA GPU (an H200) through the driver's PTX JIT.

An sm_8x cubin does not load on an sm_90 device, but sm_8x PTX does: the driver JIT-compiles it
(PTX for a compute capability runs on every later NVIDIA GPU whose driver knows its PTX ISA
version). Used by ``triton-mla-sparse bench --arch`` and benchmarks/reliability/.
While emulation is enabled:

- Triton's CUDA driver reports ``GPUTarget("cuda", cc, 32)`` as the current target, so every
  kernel compiled from then on is lowered for ``sm_<cc>`` (mma.sync instead of wgmma, no
  griddepcontrol, and Triton's own fp8 support rules for that target);
- ``CUDABackend.make_cubin`` returns the PTX text itself (NUL-terminated) instead of running
  ptxas; the launcher's ``cuModuleLoadData`` accepts PTX and the driver JIT-compiles it;
- Triton's cache directory is a separate one (PTX stored as a "cubin" must never be found by a
  normal run, nor a real sm_8x cubin by this one);
- optionally, triton_mla_sparse's architecture lookup (``ops.target._cuda_arch``) reports the
  emulated target, so the heuristics choose that target's tiles and fp8 decode path (and its
  split counts: for the target's multiprocessor count, or with ``host_sms`` for this GPU's).

It proves the instruction streams and tiles of those targets on real hardware; timings under
emulation say nothing about an A100 or L40S (:func:`path_label` names them for what they are).
Shared memory is the host GPU's (227 KB on an H200), so a kernel that would not fit the emulated
part still runs: check :func:`describe`'s ``shared`` against the target's limit
(:attr:`Emulation.arch`'s ``smem_bytes``). By default the host's multiprocessors also hold as
many programs as its shared memory allows (two 97 KB programs on an H200, one on an L40S's
100 KB); with ``target_smem=True`` each kernel compiled while enabled launches with its
dynamic shared memory padded (:func:`padded_shared`) so that a host multiprocessor holds as
many of its programs as the target's would (its shared memory, threads and blocks per
multiprocessor: :data:`TARGET_SMEM_PER_SM`); a target's carveout alone would bound shared
memory only, and leave a larger L1 than the target's. Before relying on any of it, :func:`refusal` says whether this GPU can run the target's PTX at
all, and :func:`check_jit` loads one small kernel through the driver's JIT (an older driver
refuses a newer PTX ISA version).

Usage (enable before the first launch of any kernel that should be emulated, or pass the
kernels to reset)::

    from triton_mla_sparse.testing import ptx_jit
    with ptx_jit.emulate(80) as emu:
        ...  # launches compile for sm_80
    for rec in emu.compiled:  # one per kernel compiled while enabled
        print(rec)

Works with Triton 3.6 through 3.8 (the same hooks exist in both: ``CudaDriver.get_current_target``,
``CUDABackend.make_cubin(self, src, metadata, opt, capability)``, ``JITFunction.device_caches``,
and for ``target_smem`` ``CUDABackend.pack_metadata`` (the launch's warps, CTAs and shared
memory) and ``knobs.runtime.kernel_load_end_hook``).
Importing this module imports nothing from Triton and touches no GPU.
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
import re
import tempfile
from collections.abc import Iterable, Iterator
from typing import Any

# compute capabilities whose PTX an sm_90 device can JIT (sm100/sm120 PTX cannot run on sm_90)
EMULATED_CCS = (80, 86, 87, 89)
# a compute capability as one integer: major * CC_MAJOR + minor (8.9 -> 89), as Triton's targets
CC_MAJOR = 10
# elements of check_jit's probe kernel (one block)
_PROBE_N = 128
# What bounds the programs a multiprocessor of an emulated target holds, besides registers (64K
# 32-bit registers on every one of them and on the sm90 host alike), from the CUDA C++
# Programming Guide's compute capabilities table: shared memory per multiprocessor, bytes (8.0
# and 8.7 have 164 KB, 8.6 and 8.9 100 KB), resident threads and resident blocks per
# multiprocessor. enable(target_smem=True) emulates them (padded_shared).
TARGET_SMEM_PER_SM = {80: 164 * 1024, 86: 100 * 1024, 87: 164 * 1024, 89: 100 * 1024}
TARGET_THREADS_PER_SM = {80: 2048, 86: 1536, 87: 1536, 89: 1536}
TARGET_BLOCKS_PER_SM = {80: 32, 86: 16, 87: 16, 89: 24}
# shared memory the system reserves per resident block (8.x and 9.0: 1 KB), and the unit in
# which a block's shared memory is allocated
SMEM_RESERVED_PER_BLOCK = 1024
SMEM_ALLOC_UNIT = 128
# cuda.h's values (tests/test_cli.py reads them from the cuda.h Triton ships): CUfunction_attribute
# CU_FUNC_ATTRIBUTE_SHARED_SIZE_BYTES, CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES and
# CU_FUNC_ATTRIBUTE_PREFERRED_SHARED_MEMORY_CARVEOUT; CUshared_carveout
# CU_SHAREDMEM_CARVEOUT_MAX_SHARED; CUdevice_attribute
# CU_DEVICE_ATTRIBUTE_MAX_SHARED_MEMORY_PER_BLOCK_OPTIN and
# CU_DEVICE_ATTRIBUTE_MAX_SHARED_MEMORY_PER_MULTIPROCESSOR
_CU_FUNC_ATTRIBUTE_SHARED_SIZE_BYTES = 1
_CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES = 8
_CU_FUNC_ATTRIBUTE_PREFERRED_SHARED_MEMORY_CARVEOUT = 9
_CU_SHAREDMEM_CARVEOUT_MAX_SHARED = 100
_CU_DEVICE_ATTRIBUTE_MAX_SHARED_MEMORY_PER_BLOCK_OPTIN = 97
_CU_DEVICE_ATTRIBUTE_MAX_SHARED_MEMORY_PER_MULTIPROCESSOR = 81


class EmulationUnavailable(RuntimeError):
    """This machine cannot run a target's PTX (no NVIDIA GPU, an older GPU, the driver's JIT)."""


def path_label(cc: int, gpu: str, target_smem: bool = False, host_sms: int | None = None) -> str:
    """What timings under emulation are: ``"sm80 path by PTX JIT on NVIDIA H200"``, with
    ``target_smem`` followed by ``", 164 KB shared memory a multiprocessor"`` and with
    ``host_sms`` (the grids sized for the host's multiprocessors, not the target's) by
    ``", grids for 132 SMs"``."""
    label = f"sm{cc} path by PTX JIT on {gpu}"
    if target_smem:
        label += f", {TARGET_SMEM_PER_SM[cc] // 1024} KB shared memory a multiprocessor"
    if host_sms is not None:
        label += f", grids for {host_sms} SMs"
    return label


def refusal(cc: int, capability: tuple[int, int] | None, hip: bool) -> str | None:
    """Why ``cc``'s PTX cannot be run here, or None. ``capability``: the GPU's (major, minor),
    None without a GPU; ``hip``: a ROCm build (an AMD GPU). Checks what can be known without
    running anything; :func:`check_jit` then asks the driver."""
    if cc not in EMULATED_CCS:
        return f"sm{cc} is not an emulated target; the choices are " + ", ".join(
            f"sm{c}" for c in EMULATED_CCS
        )
    if hip:
        return (
            f"emulating sm{cc} needs an NVIDIA GPU: it runs PTX through the CUDA driver's JIT, "
            "and this is a ROCm (AMD) device"
        )
    if capability is None:
        return f"emulating sm{cc} needs an NVIDIA GPU (the driver JIT-compiles the PTX); none found"
    here = capability[0] * CC_MAJOR + capability[1]
    if here < cc:
        return (
            f"this GPU is sm{here}, older than sm{cc}: sm{cc} PTX does not run on it (PTX runs "
            "on its own target and later GPUs only)"
        )
    if here == cc:
        return (
            f"this GPU is sm{here}: sm{cc}'s path is its native one; run without the "
            "emulation to time it natively"
        )
    return None


_TARGET_RE = re.compile(r"^\s*\.target\s+(sm_\w+)", re.MULTILINE)


@dataclasses.dataclass
class Compiled:
    """One kernel as Triton built it: ``target`` is the PTX ``.target`` line's value."""

    name: str
    target: str | None
    mma: str  # "wgmma", "mma.sync" or "none"
    shared: int  # bytes of shared memory a launch needs
    is_ptx: bool  # the loadable binary is PTX text (emulated), not a cubin

    def line(self) -> str:
        kind = "ptx" if self.is_ptx else "cubin"
        return (
            f"{self.name}: .target {self.target} {self.mma} shared {self.shared / 1024:.1f} KB "
            f"({kind})"
        )


def _round_up(n: int, unit: int) -> int:
    return -(-n // unit) * unit


def target_blocks_per_sm(cc: int, shared: int, threads: int) -> int:
    """How many blocks of ``threads`` threads and ``shared`` bytes of shared memory one
    multiprocessor of compute capability ``cc`` holds, as far as shared memory, threads and its
    block limit bound it (0: the block does not fit)."""
    if cc not in TARGET_SMEM_PER_SM:
        raise ValueError(f"cc must be one of {sorted(TARGET_SMEM_PER_SM)}, got {cc!r}")
    if shared < 0 or threads <= 0:
        raise ValueError(
            f"need shared >= 0 and threads > 0, got shared={shared}, threads={threads}"
        )
    per_block = _round_up(shared + SMEM_RESERVED_PER_BLOCK, SMEM_ALLOC_UNIT)
    return min(
        TARGET_SMEM_PER_SM[cc] // per_block,
        TARGET_THREADS_PER_SM[cc] // threads,
        TARGET_BLOCKS_PER_SM[cc],
    )


def padded_shared(cc: int, shared: int, threads: int, host_smem_per_sm: int) -> int:
    """The dynamic shared memory to launch a kernel with on the host so that a host
    multiprocessor holds as many of its blocks as one of compute capability ``cc`` would: the
    kernel's own ``shared`` bytes, raised until no more than that many blocks fit into the
    host's ``host_smem_per_sm`` (an H200's 228 KB hold two 97 KB blocks, an L40S's 100 KB one:
    the block is launched with 227 KB there). Unchanged where the block does not fit the
    target at all (:meth:`Emulation.too_big` reports those)."""
    blocks = target_blocks_per_sm(cc, shared, threads)
    if blocks == 0:
        return shared
    room = host_smem_per_sm // blocks
    padded = room // SMEM_ALLOC_UNIT * SMEM_ALLOC_UNIT - SMEM_RESERVED_PER_BLOCK
    return max(shared, padded)


def _occupancy_hook() -> Any:
    """A Triton kernel-load hook that lets each loaded kernel launch with up to the host's whole
    shared memory per block (Triton's loader does so only for kernels of more than 48 KB), for
    the padded launches of :func:`padded_shared`, and asks for the largest shared-memory
    configuration, so that the padded blocks, not the driver's choice of configuration, bound
    the blocks a multiprocessor holds."""
    import ctypes

    cuda = ctypes.CDLL("libcuda.so.1")
    optin = _device_attribute(
        _CU_DEVICE_ATTRIBUTE_MAX_SHARED_MEMORY_PER_BLOCK_OPTIN, "shared memory per block"
    )

    def check(err: int, what: str) -> None:
        if err != 0:
            raise RuntimeError(f"{what}: CUDA driver error {err}")

    def hook(module, function, name, *_):
        handle, static = ctypes.c_void_p(function), ctypes.c_int()
        attr = _CU_FUNC_ATTRIBUTE_SHARED_SIZE_BYTES
        check(cuda.cuFuncGetAttribute(ctypes.byref(static), attr, handle), name)
        attr = _CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES
        check(cuda.cuFuncSetAttribute(handle, attr, optin - static.value), name)
        attr, most = (
            _CU_FUNC_ATTRIBUTE_PREFERRED_SHARED_MEMORY_CARVEOUT,
            _CU_SHAREDMEM_CARVEOUT_MAX_SHARED,
        )
        check(cuda.cuFuncSetAttribute(handle, attr, most), name)
        hook.functions.add(function)

    hook.functions = set()  # the CUfunction handles it configured (read by the tests)
    return hook


def _device_attribute(attr: int, what: str) -> int:
    """A CUdevice_attribute of the current CUDA context's device (through the driver API);
    :class:`EmulationUnavailable` naming ``what`` where the driver refuses."""
    import ctypes

    cuda = ctypes.CDLL("libcuda.so.1")
    device, value = ctypes.c_int(), ctypes.c_int()
    err = cuda.cuCtxGetDevice(ctypes.byref(device))
    if err == 0:
        err = cuda.cuDeviceGetAttribute(ctypes.byref(value), attr, device)
    if err != 0:
        raise EmulationUnavailable(f"reading the GPU's {what}: CUDA driver error {err}")
    return value.value


def host_smem_per_sm() -> int:
    """Shared memory per multiprocessor of the current CUDA device, bytes."""
    return _device_attribute(
        _CU_DEVICE_ATTRIBUTE_MAX_SHARED_MEMORY_PER_MULTIPROCESSOR, "shared memory"
    )


def _ptx_facts(ptx: str) -> tuple[str | None, str]:
    m = _TARGET_RE.search(ptx)
    if "wgmma." in ptx:
        mma = "wgmma"
    elif "mma.sync" in ptx:
        mma = "mma.sync"
    else:
        mma = "none"
    return (m.group(1) if m else None), mma


def describe(kernel: Any) -> Compiled:
    """Facts about a Triton ``CompiledKernel`` (from a launch, ``warmup`` or the JIT cache)."""
    asm = kernel.asm
    binary = asm.get("cubin", b"")
    ptx = asm.get("ptx", "")
    # a cubin is an ELF file; PTX is text with a .target line
    is_ptx = isinstance(binary, (bytes, bytearray)) and not binary.startswith(b"\x7fELF")
    is_ptx = is_ptx and b".target" in binary[:4096]
    if not ptx and is_ptx:
        ptx = bytes(binary).rstrip(b"\0").decode()
    target, mma = _ptx_facts(ptx or "")
    return Compiled(kernel.name, target, mma, int(kernel.metadata.shared), is_ptx)


def loaded(kernel: Any) -> list[Any]:
    """Every ``CompiledKernel`` a ``JITFunction`` holds in its in-memory cache (all devices)."""
    out = []
    for entry in getattr(kernel, "device_caches", {}).values():
        for ck in entry[0].values():
            out.append(ck.result() if hasattr(ck, "result") else ck)  # async compile: a future
    return out


@dataclasses.dataclass
class Emulation:
    """State of an enabled emulation; :meth:`disable` restores everything it patched.
    ``arch``: triton_mla_sparse's Arch of the target (its SM count, or the host's with
    ``host_sms``, and its shared memory)."""

    cc: int
    cache_dir: str
    compiled: list[Compiled] = dataclasses.field(default_factory=list)
    arch: Any = None
    target_smem: bool = False  # kernels launch as many blocks a multiprocessor as on the target
    host_sms: bool = False  # arch.num_sms is the host GPU's, not the target's
    # with target_smem: the CUfunction handles of the kernels loaded for padded launches
    occupancy_functions: set = dataclasses.field(default_factory=set)
    _undo: list = dataclasses.field(default_factory=list, repr=False)

    @property
    def grid_sms(self) -> int | None:
        """With ``host_sms``, the host's multiprocessor count the grids are sized for (what
        :func:`path_label` names); None where they are the target's."""
        return self.arch.num_sms if self.host_sms else None

    def too_big(self, since: int = 0) -> list[Compiled]:
        """The kernels compiled (from ``compiled[since]`` on) whose shared memory exceeds the
        target's: they run here, on the host GPU's larger shared memory, but would not launch
        on the emulated part."""
        limit = self.arch.smem_bytes
        return [c for c in self.compiled[since:] if c.shared > limit]

    def disable(self) -> None:
        global _ACTIVE
        while self._undo:
            self._undo.pop()()
        _ACTIVE = None


_ACTIVE: Emulation | None = None


def _patch(undo: list, obj: Any, name: str, value: Any) -> None:
    old = obj.__dict__.get(name, _MISSING) if hasattr(obj, "__dict__") else getattr(obj, name)
    setattr(obj, name, value)
    if old is _MISSING:
        undo.append(lambda: delattr(obj, name))
    else:
        undo.append(lambda: setattr(obj, name, old))


_MISSING = object()


def _set_env(undo: list, key: str, value: str) -> None:
    old = os.environ.get(key)
    os.environ[key] = value
    undo.append(lambda: os.environ.pop(key) if old is None else os.environ.__setitem__(key, old))


def _gpu_present() -> bool:
    try:
        import torch

        return torch.cuda.is_available() and torch.version.hip is None
    except ImportError:  # pragma: no cover
        return False


def _project_arch(cc: int):
    """triton_mla_sparse's target module and its Arch for ``cc`` (its TARGETS table: SM counts,
    shared memory)."""
    from ..ops import target

    for arch in target.TARGETS:
        if arch.backend == "cuda" and arch.cc == cc:
            return target, arch
    return target, target.Arch("cuda", cc)


def enable(
    cc: int,
    cache_dir: str | None = None,
    *,
    reset: Iterable[Any] = (),
    patch_project_arch: bool = True,
    target_smem: bool = False,
    host_sms: bool = False,
) -> Emulation:
    """Make Triton compile for ``sm_<cc>`` and load the PTX through the driver's JIT.

    Args:
        cc: compute capability to emulate (80, 86, 87 or 89 on an sm_90 device).
        cache_dir: Triton cache directory to use while enabled; default
            ``$TMPDIR/triton-ptx-jit-sm<cc>`` (kept between runs; keyed by Triton's own hashes).
        reset: JITFunctions whose in-memory caches are cleared (kernels launched before this
            call would otherwise keep their native binaries).
        patch_project_arch: make ``triton_mla_sparse``'s architecture lookup report ``cc``.
        target_smem: launch each kernel compiled while enabled with its dynamic shared memory
            padded (:func:`padded_shared`) so that a multiprocessor holds as many of its
            programs as one of the target (its shared memory, threads and blocks per
            multiprocessor) would (needs a GPU and a CUDA context: call it after the first
            CUDA operation).
        host_sms: the architecture the project's heuristics see (``patch_project_arch``) has
            this GPU's multiprocessor count instead of the target's (TARGETS: 108 for sm80,
            142 for sm89), so split counts fill this GPU as they fill a target of that many
            multiprocessors; without it the grids are the target's own, and a host with more
            (or fewer) multiprocessors runs them part-empty (or in extra waves). Needs a GPU.
    """
    global _ACTIVE
    if not isinstance(cc, int) or cc not in EMULATED_CCS:
        raise ValueError(
            f"cc must be one of {EMULATED_CCS} (PTX an sm_90 device can JIT), got {cc!r}"
        )
    if _ACTIVE is not None:
        raise RuntimeError(f"PTX JIT emulation of sm_{_ACTIVE.cc} is already enabled")
    from triton.backends.compiler import GPUTarget
    from triton.backends.nvidia import compiler as nv_compiler
    from triton.backends.nvidia import driver as nv_driver

    cache_dir = cache_dir or os.path.join(tempfile.gettempdir(), f"triton-ptx-jit-sm{cc}")
    os.makedirs(cache_dir, exist_ok=True)
    arch = _project_arch(cc)[1]
    if host_sms:
        import torch

        props = torch.cuda.get_device_properties(torch.cuda.current_device())
        arch = dataclasses.replace(arch, num_sms=props.multi_processor_count)
    emu = Emulation(cc, cache_dir, arch=arch, target_smem=target_smem, host_sms=host_sms)
    undo = emu._undo
    try:
        _set_env(undo, "TRITON_CACHE_DIR", cache_dir)
        try:  # Triton >= 3.4: knobs read the environment on each access unless set in code
            import triton.knobs as knobs

            if os.path.realpath(knobs.cache.dir) != os.path.realpath(cache_dir):
                raise RuntimeError(
                    f"triton.knobs.cache.dir is {knobs.cache.dir!r} (set in code?); "
                    f"PTX JIT emulation needs its own cache directory {cache_dir!r}"
                )
        except ImportError:  # pragma: no cover - older Triton reads the variable directly
            pass

        target = GPUTarget("cuda", cc, 32)
        _patch(undo, nv_driver.CudaDriver, "get_current_target", lambda self: target)

        def make_cubin(self, src, metadata, opt, capability):
            ptx_target, mma = _ptx_facts(src)
            emu.compiled.append(
                Compiled(
                    metadata.get("name", "?"), ptx_target, mma, int(metadata.get("shared", 0)), True
                )
            )
            return src.encode() + b"\0"

        _patch(undo, nv_compiler.CUDABackend, "make_cubin", make_cubin)
        if _gpu_present():  # the active driver must be the class just patched
            from triton.runtime import driver

            got = driver.active.get_current_target()
            if got != target:
                raise RuntimeError(f"Triton's active driver reports {got}, not {target}")
        if patch_project_arch:
            target_mod = _project_arch(cc)[0]
            _patch(undo, target_mod, "_cuda_arch", lambda index: emu.arch)
        if target_smem:
            import triton.knobs as knobs

            host = host_smem_per_sm()
            pack = nv_compiler.CUDABackend.pack_metadata

            def pack_metadata(self, metadata):
                # the launch's (num_warps, num_ctas, shared): shared padded to the target's
                # blocks per multiprocessor; the kernel itself and its metadata are unchanged
                num_warps, num_ctas, shared = pack(self, metadata)
                threads = num_warps * target.warp_size  # one CTA's
                return num_warps, num_ctas, padded_shared(cc, shared, threads, host)

            _patch(undo, nv_compiler.CUDABackend, "pack_metadata", pack_metadata)
            hook = _occupancy_hook()
            emu.occupancy_functions = hook.functions
            knobs.runtime.kernel_load_end_hook.add(hook)
            undo.append(lambda: knobs.runtime.kernel_load_end_hook.remove(hook))
        for kernel in reset:
            caches = getattr(kernel, "device_caches", None)  # none under TRITON_INTERPRET
            if caches is not None:
                caches.clear()
                undo.append(caches.clear)  # drop emulated binaries on disable
    except BaseException:
        while undo:
            undo.pop()()
        raise
    _ACTIVE = emu
    return emu


def check_jit(emu: Emulation, device: Any) -> None:
    """Load one small kernel, compiled now for the emulated target, through the driver's JIT on
    ``device`` and check its result; :class:`EmulationUnavailable` with the driver's error where
    the driver cannot (e.g. PTX of a newer ISA version than it knows)."""
    import torch

    from ._ptx_probe import probe_kernel

    # the probe keeps its binaries per device, not per target: an earlier emulation's (or the
    # native) build would be launched again, so every check compiles it afresh
    probe_kernel.device_caches.clear()
    x = torch.zeros(_PROBE_N, dtype=torch.float32, device=device)
    try:
        compiled = probe_kernel[(1,)](x, _PROBE_N, BLOCK=_PROBE_N)
        torch.cuda.synchronize(device)
    except Exception as e:
        raise EmulationUnavailable(
            f"the CUDA driver could not run sm{emu.cc} PTX on this GPU: "
            + " ".join(f"{type(e).__name__}: {e}".split())[:400]
        ) from e
    rec = describe(compiled)
    if not rec.is_ptx or rec.target != f"sm_{emu.cc}":
        raise EmulationUnavailable(
            f"the probe kernel loaded as {rec.line()}, not as sm_{emu.cc} PTX: the emulation's "
            "hooks do not reach this Triton build"
        )
    if not bool((x == 1.0).all()):
        raise EmulationUnavailable(f"sm{emu.cc} PTX ran on this GPU but computed a wrong result")


@contextlib.contextmanager
def emulate(cc: int, cache_dir: str | None = None, **kwargs: Any) -> Iterator[Emulation]:
    """Context-manager form of :func:`enable`."""
    emu = enable(cc, cache_dir, **kwargs)
    try:
        yield emu
    finally:
        emu.disable()
