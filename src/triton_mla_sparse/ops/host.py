"""Host-side helpers shared by the ops' interfaces (validation messages, where a call can run).
No Triton import, no GPU."""

from __future__ import annotations

import os
from importlib import metadata

import torch

# Triton's interpreter before 3.7 turns a scalar into a Python int with int(array), which NumPy 2.5
# refuses for 1-element arrays ("only 0-dimensional arrays can be converted to Python scalars").
_INTERPRETER_FIXED_IN = (3, 7)
_NUMPY_STRICT_SINCE = (2, 5)


def _release(dist: str) -> tuple[int, int] | None:
    try:
        major, minor = metadata.version(dist).split(".")[:2]
        return int(major), int("".join(c for c in minor if c.isdigit()) or 0)
    except (metadata.PackageNotFoundError, ValueError):
        return None


# Triton reads this when a kernel module is first imported: "1" runs kernels on the CPU.
INTERPRET_ENV = "TRITON_INTERPRET"


def interpreter_on() -> bool:
    """Triton's CPU interpreter is on (it is chosen when a kernel module is first imported)."""
    return os.environ.get(INTERPRET_ENV) == "1"


def use_interpreter() -> None:
    """Run kernels under Triton's interpreter: must precede the first import of a kernel
    module (the package imports them lazily, at the first call)."""
    os.environ[INTERPRET_ENV] = "1"


def interpreter_problem() -> str | None:
    """Why Triton's interpreter cannot run the kernels with the installed packages, or None."""
    triton_v, numpy_v = _release("triton"), _release("numpy")
    if triton_v and numpy_v and triton_v < _INTERPRETER_FIXED_IN and numpy_v >= _NUMPY_STRICT_SINCE:
        return (
            f"Triton {metadata.version('triton')}'s interpreter cannot run under NumPy "
            f"{metadata.version('numpy')} (it converts 1-element arrays to int, an error since "
            "NumPy 2.5; Triton 3.7 fixed it): to run kernels on the CPU install 'numpy<2.5' or "
            "Triton >= 3.7"
        )
    return None


def check_runs_here(op: str, device: torch.device, on_cpu_instead: str) -> None:
    """Refuse CPU tensors unless Triton's interpreter is on and can run here."""
    if device.type != "cpu":
        return
    if not interpreter_on():
        raise ValueError(
            f"{op} runs on CUDA/ROCm tensors (CPU tensors only under TRITON_INTERPRET=1); "
            f"{on_cpu_instead}"
        )
    problem = interpreter_problem()
    if problem:
        raise RuntimeError(problem)


def describe(x: object) -> str:
    """An argument as the caller passed it, for error messages: shape, dtype and device."""
    if x is None:
        return "None"
    if not isinstance(x, torch.Tensor):
        return f"a {type(x).__name__}, not a tensor"
    return f"{tuple(x.shape)} {x.dtype} on {x.device}"


def is_pow2(n: int) -> bool:
    return n > 0 and (n & (n - 1)) == 0
