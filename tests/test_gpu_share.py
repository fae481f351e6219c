"""tests/gpu_share.py: the conformance grid's out-of-memory re-run and its locks (CPU)."""

from __future__ import annotations

import fcntl
import os
import warnings

import gpu_share
import pytest
import torch


@pytest.fixture(autouse=True)
def _own_lock_dir(tmp_path, monkeypatch):
    monkeypatch.setenv("TMS_GPU_LOCK_DIR", str(tmp_path))


def _try_lock(path, mode) -> bool:
    fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o666)
    try:
        fcntl.flock(fd, mode | fcntl.LOCK_NB)
        return True
    except BlockingIOError:
        return False
    finally:
        os.close(fd)


def test_runs_once_without_a_warning():
    calls = []
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert gpu_share.run_sharing_gpu(lambda: calls.append(1) or 7, "case") == 7
    assert calls == [1]


def test_out_of_memory_runs_again_alone():
    gate, lock = gpu_share._paths()
    seen = []

    def body():
        seen.append(_try_lock(gate, fcntl.LOCK_SH))  # False while a case runs alone
        if len(seen) == 1:
            raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 34.18 GiB.")
        return "second"

    with pytest.warns(gpu_share.GpuAloneWarning, match=r"case7: CUDA out of memory.*alone"):
        assert gpu_share.run_sharing_gpu(body, "case7") == "second"
    assert seen == [True, False]


def test_out_of_memory_alone_is_a_failure():
    def body():
        raise torch.OutOfMemoryError("CUDA out of memory.")

    with pytest.warns(gpu_share.GpuAloneWarning), pytest.raises(torch.OutOfMemoryError):
        gpu_share.run_sharing_gpu(body, "case")


def test_other_errors_are_not_run_again():
    calls = []

    def body():
        calls.append(1)
        raise AssertionError("out: 3 of 1024 elements past FlashMLA's rule")

    with pytest.raises(AssertionError, match="FlashMLA's rule"):
        gpu_share.run_sharing_gpu(body, "case")
    assert calls == [1]


def test_shared_holders_exclude_alone_not_each_other():
    gate, lock = gpu_share._paths()
    with gpu_share.shared():
        assert _try_lock(lock, fcntl.LOCK_SH)  # another worker's case runs beside this one
        assert not _try_lock(lock, fcntl.LOCK_EX)  # a case to run alone waits for this one
        assert _try_lock(gate, fcntl.LOCK_SH)  # the gate is open: nobody is waiting
    assert _try_lock(lock, fcntl.LOCK_EX)


def test_alone_closes_the_gate():
    gate, lock = gpu_share._paths()
    with gpu_share.alone():
        assert not _try_lock(gate, fcntl.LOCK_SH)  # new cases wait at the gate
        assert not _try_lock(lock, fcntl.LOCK_SH)
    assert _try_lock(gate, fcntl.LOCK_SH) and _try_lock(lock, fcntl.LOCK_SH)
