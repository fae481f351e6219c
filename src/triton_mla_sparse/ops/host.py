"""Host-side helpers shared by the ops' interfaces (validation messages). No Triton, no GPU."""

from __future__ import annotations

import torch


def describe(x: object) -> str:
    """An argument as the caller passed it, for error messages: shape, dtype and device."""
    if x is None:
        return "None"
    if not isinstance(x, torch.Tensor):
        return f"a {type(x).__name__}, not a tensor"
    return f"{tuple(x.shape)} {x.dtype} on {x.device}"


def is_pow2(n: int) -> bool:
    return n > 0 and (n & (n - 1)) == 0
