"""The compile targets the ops are built and tuned for: :class:`Arch`, :data:`TARGETS`,
:func:`arch_of`, and the shared-memory classes the launch heuristics choose tiles by.

Shared by every op's heuristics (sparse_mla, indexer). Pure Python: no Triton import, and no
GPU is touched until :func:`arch_of` is asked about a CUDA/ROCm device.
"""

from __future__ import annotations

import dataclasses
import functools

import torch

__all__ = ["SMEM_227KB_CLASS", "SMEM_LARGE_CLASS", "TARGETS", "Arch", "arch_of"]


@dataclasses.dataclass(frozen=True)
class Arch:
    """A compile target: ``backend`` "cuda"/"hip", ``cc`` (80, 90, ...) or a gfx name."""

    backend: str
    cc: int | str
    num_sms: int = 132
    warp_size: int = 32

    @property
    def fp8_native(self) -> bool:
        # Triton's e4m3 type lowers to hardware conversions on sm89+; sm80/86 and AMD (whose
        # native fp8 is the fnuz variant) decode the bytes with integer arithmetic instead.
        return self.backend == "cuda" and int(self.cc) >= 89

    @property
    def pdl(self) -> bool:
        # programmatic dependent launch (griddepcontrol): sm90+
        return self.backend == "cuda" and int(self.cc) >= 90

    @property
    def smem_bytes(self) -> int:
        if self.backend == "hip":
            return 64 * 1024
        return {80: 163 * 1024, 90: 227 * 1024, 100: 227 * 1024}.get(int(self.cc), 99 * 1024)


# Shared-memory classes (``Arch.smem_bytes``, the per-block limit) the heuristics pick tiles by.
# At least 160 KB: sm80 (163 KB), sm90 and sm100 (227 KB), whose tiles may hold two 64-row gather
# buffers or staged fp8 tiles; below it the 99 KB parts (sm86/89/120/121), which keep 32-row
# single-buffer tiles (tests/test_compile.py checks each target's tiles fit).
SMEM_LARGE_CLASS = 160 * 1024
# At least 224 KB: sm90 and sm100 (227 KB), the only parts that fit the 3-stage 64-row bf16
# tile of a 64-head block (221 KB) and 64-head fp32 tiles; sm80's 163 KB does not.
SMEM_227KB_CLASS = 224 * 1024


# Every compile target the project claims (tests/test_compile.py compiles all of them).
TARGETS = (
    Arch("cuda", 80, 108),
    Arch("cuda", 86, 84),
    Arch("cuda", 89, 142),
    Arch("cuda", 90, 132),
    Arch("cuda", 100, 148),
    Arch("cuda", 120, 188),
    # GB10 (DGX Spark): 48 SMs, the 99 KB shared memory of the sm120 parts
    Arch("cuda", 121, 48),
    Arch("hip", "gfx942", 304, 64),
)


@functools.cache
def _cuda_arch(index: int) -> Arch:
    props = torch.cuda.get_device_properties(index)
    if getattr(torch.version, "hip", None):
        gcn = getattr(props, "gcnArchName", "gfx942").split(":")[0]
        return Arch("hip", gcn, props.multi_processor_count, 64)
    return Arch("cuda", props.major * 10 + props.minor, props.multi_processor_count)


def arch_of(device: torch.device) -> Arch:
    """The architecture of a tensor's device; CPU tensors (Triton's interpreter) act as an H200."""
    if device.type == "cuda":
        return _cuda_arch(device.index if device.index is not None else torch.cuda.current_device())
    return Arch("cuda", 90, 132)
