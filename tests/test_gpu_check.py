"""tools/gpu_check.py's command lines, on any machine (the check itself needs a GPU)."""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import time
import types

import pytest
import torch

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


def test_quick_runs_verify_and_compile_then_the_suite_in_parallel(gpu_check, tmp_path):
    args = argparse.Namespace(jobs=14, out=str(tmp_path))
    steps = gpu_check.quick_steps(args, {"xdist": "3.8.0", "target": "cuda:90"})
    assert [s.name for s in steps] == ["verify", "compile", "pytest"]
    cmd = steps[2].cmd
    assert cmd[cmd.index("-n") + 1] == "14" and cmd[cmd.index("--dist") + 1] == "worksteal"
    assert _marks(cmd) == "not conformance_grid and not fp32"
    assert f"--durations={gpu_check.QUICK_DURATIONS}" in cmd  # where the window goes
    assert steps[1].env == {"TMS_COMPILE_ONLY": "cuda:90-"}


def _marks(cmd: list[str]) -> str:
    """The marker expression of a pytest command line (its last ``-m``: the first is python's)."""
    return cmd[len(cmd) - cmd[::-1].index("-m")]


def test_the_fp32_part_runs_the_cases_quick_leaves_out(gpu_check, tmp_path):
    """quick's suite and full's suite-fp32 part split the suite (less the conformance grids) by
    the fp32 marker: one ``-m`` expression the other's complement."""
    args = argparse.Namespace(jobs=14, out=str(tmp_path))
    assert gpu_check.SUITE_FP32_PART in [name for name, _, _ in gpu_check._parts()]
    (step,) = gpu_check.part_steps(gpu_check.SUITE_FP32_PART, args)
    cmd = step.cmd
    assert _marks(cmd) == "fp32 and not conformance_grid"
    assert cmd[cmd.index("--junitxml") + 1] == str(tmp_path / "suite-fp32.xml")
    assert "tests" in cmd and "--ignore=tests/test_compile.py" in cmd


@pytest.mark.parametrize("dtype", [torch.float16, torch.float32], ids=["fp16", "fp32"])
def test_conftest_marks_the_fp32_cases(gpu_check, dtype, request):
    """tests/conftest.py sets the marker gpu_check's selections name, on fp32 cases only."""
    marked = request.node.get_closest_marker(gpu_check.FP32_MARK) is not None
    assert marked == (dtype is torch.float32)


_JUNIT = """<?xml version="1.0" encoding="utf-8"?><testsuites><testsuite name="pytest">
<testcase classname="tests.test_a" name="one" time="10.0"><properties>
<property name="triton_compile_s" value="6.5"/><property name="triton_compiles" value="3"/>
<property name="triton_compiled" value="kern_a:k1:4.00;kern_a:k2:2.00;kern_b:k1:0.50"/>
</properties></testcase>
<testcase classname="tests.test_a" name="two" time="2.0"><properties>
<property name="triton_compile_s" value="0.5"/><property name="triton_compiles" value="1"/>
<property name="triton_compiled" value="kern_a:k1:0.50"/>
</properties></testcase>
<testcase classname="tests.test_b" name="three" time="20.0"/>
</testsuite></testsuites>"""


def test_time_breakdown_sums_the_suites_compile_time(gpu_check, tmp_path, capsys):
    """The quick's summary: seconds over the workers, the part in Triton's compiles (the junit
    properties tests/conftest.py records; none for a test that compiled nothing), per file,
    largest first; nothing without the XML."""
    xml = tmp_path / "pytest.xml"
    assert gpu_check.time_breakdown(xml) is None
    xml.write_text(_JUNIT)
    t = gpu_check.time_breakdown(xml)
    assert (t["seconds"], t["compile_seconds"], t["compiles"]) == (32.0, 7.0, 4)
    assert list(t["files"]) == ["tests.test_b", "tests.test_a"]
    assert t["files"]["tests.test_a"] == {"seconds": 12.0, "compile_seconds": 7.0}
    # per kernel: its distinct specializations, each counted once at its slowest compile; the
    # second compile of kern_a's k1 (another worker's) apart
    assert (t["specializations"], t["compiled_again"], t["compiled_again_seconds"]) == (3, 1, 0.5)
    assert t["kernels"] == {
        "kern_a": {"specializations": 2, "compile_seconds": 6.0},
        "kern_b": {"specializations": 1, "compile_seconds": 0.5},
    }
    gpu_check.print_time_breakdown(t)
    out = capsys.readouterr().out
    assert "32 s, 7 s (22%) in 4 Triton compiles" in out
    assert "3 distinct kernel specializations; 1 compiles (0 s) of one another" in out


def test_compile_time_fixture_chains_tritons_hooks(_triton_compile_time):
    """tests/conftest.py's accounting: Triton's hooks around a compile add its seconds and
    count, and call the hooks that were set before (the fixture restores them afterwards)."""
    knobs = pytest.importorskip("triton").knobs.runtime
    assert knobs.jit_cache_hook(key="k") is None  # None: compile, do not skip
    time.sleep(0.02)
    knobs.jit_post_compile_hook(
        key="k",
        fn=types.SimpleNamespace(name="my_kernel"),
        compile={"signature": {"n": "i32", "Q": "*fp32", "K": "*bf16", "BLOCK": "constexpr"}},
    )
    assert _triton_compile_time["n"] == 1 and _triton_compile_time["s"] >= 0.02
    (compiled,) = _triton_compile_time["compiled"]
    name, key, seconds = compiled.split(":")
    # the kernel with its first pointer argument's type (fp32 variants apart)
    assert name == "my_kernel(*fp32)" and len(key) == 12 and float(seconds) >= 0.02


_INTERRUPTIBLE = """
import os, signal, subprocess, sys, time
child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(120)"])
open(sys.argv[1], "w").write(str(child.pid))
def summary(*_):
    print("3 passed, 1 failed (interrupted)", flush=True)
    if sys.argv[2] == "exit":
        sys.exit(2)
signal.signal(signal.SIGINT, summary)
while True:
    time.sleep(0.1)
"""


@pytest.mark.parametrize("on_sigint", ["exit", "hang"])
def test_a_step_past_its_limit_is_interrupted_then_killed_with_its_workers(
    gpu_check, tmp_path, monkeypatch, on_sigint
):
    """SIGINT first, so that pytest can print what ran; then the whole process group is
    killed (pytest-xdist's workers, here a child that would sleep for two minutes)."""
    monkeypatch.setattr(gpu_check, "INTERRUPT_GRACE_S", 1)
    script = tmp_path / "step.py"
    script.write_text(_INTERRUPTIBLE)
    pid_file = tmp_path / "child.pid"
    step = gpu_check.Step("slow", [sys.executable, str(script), str(pid_file), on_sigint])
    res = gpu_check.run_step(step, dict(os.environ), tmp_path, limit_s=2)
    assert res.rc == 124 and not res.ok
    log = (tmp_path / "slow.log").read_text()
    assert "3 passed, 1 failed (interrupted)" in log and "stopped after 2 s" in log
    _assert_gone(int(pid_file.read_text()))


def test_a_terminated_check_takes_its_running_step_with_it(gpu_check, tmp_path):
    """SIGTERM to gpu_check (a timeout around it) while a step runs: the step is detached into
    a process group of its own, so gpu_check must kill that group (here its child's two-minute sleep)
    before exiting with 128 + SIGTERM, instead of leaving GPU workers behind."""
    script = tmp_path / "step.py"
    script.write_text(_INTERRUPTIBLE)
    pid_file = tmp_path / "child.pid"
    step = gpu_check.Step("long", [sys.executable, str(script), str(pid_file), "hang"])
    previous = signal.signal(signal.SIGALRM, lambda *_: os.kill(os.getpid(), signal.SIGTERM))
    old_term = signal.signal(signal.SIGTERM, gpu_check._terminate)
    try:
        signal.alarm(3)
        with pytest.raises(SystemExit) as stop:
            gpu_check.run_step(step, dict(os.environ), tmp_path, limit_s=100)
    finally:
        signal.alarm(0)
        signal.signal(signal.SIGALRM, previous)
        signal.signal(signal.SIGTERM, old_term)
    assert stop.value.code == 128 + signal.SIGTERM
    _assert_gone(int(pid_file.read_text()))


def _assert_gone(child: int) -> None:
    for _ in range(50):  # the group's SIGKILL reaches the child at once; reaping may lag
        try:
            os.kill(child, 0)
        except ProcessLookupError:
            return
        if _zombie(child):
            return
        time.sleep(0.1)
    raise AssertionError(f"the step's child {child} outlived it")


def _zombie(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().split()[2] == "Z"
    except OSError:
        return True


def test_a_step_inside_its_limit_keeps_its_exit_status(gpu_check, tmp_path):
    step = gpu_check.Step("fast", [sys.executable, "-c", "print('1 passed'); raise SystemExit(3)"])
    res = gpu_check.run_step(step, dict(os.environ), tmp_path)
    assert res.rc == 3 and "1 passed" in (tmp_path / "fast.log").read_text()


def test_the_last_emulate_slice_runs_to_the_end(gpu_check, tmp_path):
    """The emulated suites' case lists are counted on CPU; on a GPU they can be longer, so no
    case may fall behind the last slice."""
    args = argparse.Namespace(jobs=16, out=str(tmp_path))
    for cc, n in gpu_check.EMULATE_CASES.items():
        names = [p for p, suite, _ in gpu_check._parts() if suite == f"emulate{cc}"]
        assert len(names) == -(-n // gpu_check.EMULATE_SLICE)
        for i, name in enumerate(names):
            (step,) = gpu_check.part_steps(name, args)
            assert step.cmd[step.cmd.index("--skip-cases") + 1] == str(i * gpu_check.EMULATE_SLICE)
            assert ("--max-cases" in step.cmd) == (i < len(names) - 1), (name, step.cmd)


def test_the_conformance_slices_cover_each_grid_case_once(gpu_check, tmp_path):
    """Every case of FlashMLA's grids falls in exactly one conformance part (the slices' -k
    expressions evaluated as pytest does: case-insensitive substrings of the test's id)."""
    from _pytest.mark.expression import Expression
    from test_flashmla_conformance import decode_grid, prefill_grid

    args = argparse.Namespace(jobs=14, out=str(tmp_path))
    slices = []
    for name, suite, _ in gpu_check._parts():
        if suite != "conformance":
            continue
        (step,) = gpu_check.part_steps(name, args)
        target = next(a for a in step.cmd if a.startswith(gpu_check.CONFORMANCE_GRID))
        expr = step.cmd[step.cmd.index("-k") + 1] if "-k" in step.cmd else None
        grid_at = step.cmd.index(target)
        assert step.cmd[grid_at + 1 : grid_at + 3] == ["-m", gpu_check.CONFORMANCE_MARK]
        slices.append((target.split("::")[1], expr))
    cases = [("test_decode_grid", c.id) for c in decode_grid()]
    cases += [("test_prefill_grid", c.id) for c in prefill_grid()]
    for test, case_id in cases:
        node = f"{test}[{case_id}]".lower()
        hits = [
            (t, e)
            for t, e in slices
            if t == test and (e is None or Expression.compile(e).evaluate(node.__contains__))
        ]
        assert len(hits) == 1, (case_id, hits)


def test_environment_probe_says_whether_flashmla_runs(gpu_check, tmp_path):
    """The probe's JSON line, on a stand-in GPU: every key, and FlashMLA's state (on a machine
    without FlashMLA's kernels, why not, as the conformance step prints it)."""
    fake_gpu = (
        "import types, torch; torch.cuda.get_device_properties = lambda i: types.SimpleNamespace("
        "name='Stand-in', major=9, minor=0, gcnArchName='')\n"
    )
    # the caller's path after the package's: FlashMLA may be importable only through it
    path = os.pathsep.join(
        p for p in [os.path.join(ROOT, "src"), os.environ.get("PYTHONPATH")] if p
    )
    env = dict(os.environ, PYTHONPATH=path, CUDA_VISIBLE_DEVICES="")
    out = subprocess.run(
        [sys.executable, "-c", fake_gpu + gpu_check.ENV_PROBE],
        env=env,
        capture_output=True,
        text=True,
        check=True,
    )
    info = json.loads(out.stdout.strip().splitlines()[-1])
    assert info["gpu"] == "Stand-in" and info["target"] == "cuda:90"
    assert {"torch", "triton", "cuda", "xdist", "flashmla"} <= info.keys()
    from triton_mla_sparse.peers import flashmla

    try:
        flashmla.load()
        want = "available"
    except flashmla.PeerUnavailable as e:
        want = "not available: " + str(e).splitlines()[0][:200]
    assert info["flashmla"] == want
