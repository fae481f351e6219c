"""tools/gpu_check.py's command lines, on any machine (the check itself needs a GPU)."""

from __future__ import annotations

import argparse
import os
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@pytest.fixture(scope="module")
def gpu_check():
    sys.path.insert(0, os.path.join(ROOT, "tools"))
    try:
        import gpu_check
    finally:
        sys.path.pop(0)
    return gpu_check


@pytest.mark.parametrize(
    "jobs, version, want",
    [
        (14, "3.8.0", ["-n", "14", "--dist", "worksteal"]),
        (14, "3.2", ["-n", "14", "--dist", "worksteal"]),
        (14, "3.1.0", ["-n", "14"]),  # before worksteal: xdist's default scheduling
        (14, None, []),  # no pytest-xdist: one process
        (14, False, []),
        (1, "3.8.0", []),
    ],
)
def test_xdist_args(gpu_check, jobs, version, want):
    assert gpu_check.xdist_args(jobs, version) == want


def test_quick_runs_the_suite_in_parallel_then_verify_then_compile(gpu_check, tmp_path):
    args = argparse.Namespace(jobs=14, out=str(tmp_path))
    steps = gpu_check.quick_steps(args, {"xdist": "3.8.0", "target": "cuda:90"})
    assert [s.name for s in steps] == ["pytest", "verify", "compile"]
    cmd = steps[0].cmd
    assert cmd[cmd.index("-n") + 1] == "14" and cmd[cmd.index("--dist") + 1] == "worksteal"
    assert f"not {gpu_check.CONFORMANCE_MARK}" in cmd
    assert steps[2].env == {"TMS_COMPILE_ONLY": "cuda:90-"}
