"""One GPU shared by many pytest workers: a case that runs out of memory beside the others is run
again alone.

FlashMLA's grids run in many pytest-xdist processes on one GPU, and their larger cases (a 7 GB
cache, 16384-wide top-k sets, 70000 prefill tokens) need up to tens of GB each while they run. How
much is free when a case allocates depends on which cases the other workers run at that moment,
so without coordination an out-of-memory error is a matter of scheduling, not of the case.

:func:`run_sharing_gpu` makes it deterministic: every case holds a shared lock on one file while
it runs; a case that raises ``torch.OutOfMemoryError`` drops everything it allocated, takes the
lock exclusively (new cases wait at a gate, so the running ones drain and nothing starves it), and
runs once more alone on the GPU, from the same seed. An out-of-memory error alone is a failure
like any other. The re-run is reported as a warning, so a log shows which cases needed it.
"""

from __future__ import annotations

import contextlib
import fcntl
import gc
import os
import tempfile
import warnings
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import TypeVar

import torch

T = TypeVar("T")


class GpuAloneWarning(UserWarning):
    """A case ran out of GPU memory beside other workers and was run again alone."""


def lock_dir() -> Path:
    """Where the lock files live: one pair per user and machine, shared by every worker (and by
    any other run of the suite on this machine, which shares the GPU too)."""
    return Path(os.environ.get("TMS_GPU_LOCK_DIR", tempfile.gettempdir()))


@contextlib.contextmanager
def _flock(path: Path, mode: int) -> Iterator[None]:
    fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o666)
    try:
        fcntl.flock(fd, mode)
        yield
    finally:
        os.close(fd)  # closing the descriptor releases its lock


def _paths() -> tuple[Path, Path]:
    d, uid = lock_dir(), os.getuid()
    return d / f"triton-mla-sparse-gpu-{uid}.gate", d / f"triton-mla-sparse-gpu-{uid}.lock"


@contextlib.contextmanager
def shared() -> Iterator[None]:
    """Run beside other holders of the shared lock (passing the gate first, so that a case
    waiting to run alone is not overtaken)."""
    gate, lock = _paths()
    fd = os.open(lock, os.O_RDWR | os.O_CREAT, 0o666)
    try:
        with _flock(gate, fcntl.LOCK_SH):
            fcntl.flock(fd, fcntl.LOCK_SH)
        yield
    finally:
        os.close(fd)


@contextlib.contextmanager
def alone() -> Iterator[None]:
    """Run with no other case on the GPU: close the gate, then wait for the running ones."""
    gate, lock = _paths()
    with _flock(gate, fcntl.LOCK_EX), _flock(lock, fcntl.LOCK_EX):
        yield


def _release_gpu_memory() -> None:
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


def run_sharing_gpu(body: Callable[[], T], what: str) -> T:
    """``body()`` beside the other workers; once more alone if it ran out of GPU memory."""
    with shared():
        try:
            return body()
        except torch.OutOfMemoryError as e:
            first = str(e).splitlines()[0] if str(e) else "CUDA out of memory"
    # Outside the except block: the failed attempt's frames, and the tensors they held, are gone.
    _release_gpu_memory()
    warnings.warn(f"{what}: {first}; run again alone on the GPU", GpuAloneWarning, stacklevel=2)
    with alone():
        return body()
