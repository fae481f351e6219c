"""The project's GPU check: the test suite, ``verify`` and the reliability procedure on a GPU.

CI runs on CPU only (Triton's interpreter), so this is what guards the kernels on real hardware.
From the repository root of a checkout, on a machine with a CUDA GPU, PyTorch and Triton (the
package need not be installed: the checkout's ``src/`` is used)::

    python tools/gpu_check.py quick --out DIR            # a few minutes: must end with 0 failed
    python tools/gpu_check.py full --list                 # the parts of the full procedure
    python tools/gpu_check.py full --part K --out DIR     # one part (each fits in 10 minutes)
    python tools/gpu_check.py full --out DIR              # quick, then every part in turn
    python tools/gpu_check.py quick --triton /path/to/site --out DIR   # under another Triton

``quick``: ``triton-mla-sparse verify``, the ahead-of-time compile test for this GPU's own
target, and the pytest suite (bf16 included; tests/plugin runs where vLLM is importable and is
skipped otherwise) except FlashMLA's full conformance grids and the cases with a float32
parameter (marker ``fp32``: their kernels are Triton's slowest to compile), all inside one
10-minute window: the suite runs last with the time left, and if it is stopped there (SIGINT,
then SIGKILL for its process group) its log still ends with pytest's summary of what ran, and the
step fails; the log lists the suite's slowest tests, and the summary how much of the suite's time
went into Triton's compiles, per test file (where its share of the window goes). ``full`` adds,
one part each: the suite's fp32 cases (``suite-fp32``), compute-sanitizer (memcheck, initcheck,
racecheck) over every configuration the heuristics choose, CUDA-graph replay with new inputs, the
sm80/86/89 code paths compiled for their target and run here by PTX JIT, and FlashMLA's sparse
test grids at FlashMLA's sizes (tests/test_flashmla_conformance.py, marker ``conformance_grid``;
thousands of cases, in seven slices; FlashMLA's own call runs beside each case where vLLM's
FlashMLA build is importable, which the environment line reports)
(benchmarks/reliability/: reliability.py, sanitize.sh; docs/RELIABILITY.md says what each
checks).

``--triton PATH``: a folder that holds another Triton's ``triton/`` package (an unpacked wheel,
e.g. vLLM's pin), put first on the children's ``PYTHONPATH`` with its own compile cache.

Each step's log is written to ``DIR/<step>.log``, a JSON summary to ``DIR/summary.json``, and a
table is printed last. Exit status: 0 only if every step passed.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import importlib.metadata
import importlib.util
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import time
import xml.etree.ElementTree as ET
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
RELIABILITY = ROOT / "benchmarks" / "reliability" / "reliability.py"
SANITIZE = ROOT / "benchmarks" / "reliability" / "sanitize.sh"
STEP_LIMIT_S = 570  # every step, and so every part, ends inside a 10-minute window
# quick's steps share one window, counted from the start of this script (its pytest step, the
# longest, runs last with what is left): 15 s short of 10 minutes
QUICK_WINDOW_S = 585
# the slowest tests the quick's pytest step lists in its log (pytest --durations)
QUICK_DURATIONS = 30
# A step past its limit first gets SIGINT (pytest then prints the summary of what ran and
# pytest-xdist stops its workers), then, after this long, SIGKILL with its whole process group.
INTERRUPT_GRACE_S = 15

# The full procedure's slices: (tool, cases per part) over the sanitize suite's cases in coverage
# order (`reliability.py --suite sanitize --list` on sm90; tests/test_reliability_script.py keeps
# SANITIZE_CASES equal to it). Sized from measured rates on an H200 with 16 cores: compiles ~200 s
# on a fresh cache; memcheck ~2 cases/s, initcheck ~2.3/s, racecheck ~0.65/s on 16 shards.
# 1673 cases since bf16 rows run the warp-specialized wgmma kernel at prefill from 64 heads as
# well as at 64-128 tokens: four memcheck, four initcheck and seven racecheck parts of these sizes.
SANITIZE_SLICES = {"memcheck": 522, "initcheck": 522, "racecheck": 261}
SANITIZE_CASES = 1673
# FlashMLA's full sparse test grids: too many cases for quick; parts of full, in slices small
# enough that each ends with pytest's summary of its failures well inside the step's window
# (5491 cases: 246 DeepSeek-V3.2 decode, 3552 DeepSeek-V4 decode correctness in four slices by
# head count and tokens per request (1 or 3), 950 DeepSeek-V4 decode corner and performance
# cases, 743 prefill; on an H200 with 14 workers 62 s, 321 s for all 1776 64-head V4 cases,
# ~460 s for the 128-head ones on a fresh compile cache, ~5 cases/s for the corner part, 76 s)
CONFORMANCE_MARK = "conformance_grid"
CONFORMANCE_GRID = "tests/test_flashmla_conformance.py"
CONFORMANCE_SLICES = {
    "decode-v32": ["::test_decode_grid", "v32"],
    "decode-v4-h64-q1": ["::test_decode_grid", "v4 and corr and h64q1"],
    "decode-v4-h64-q3": ["::test_decode_grid", "v4 and corr and h64q3"],
    "decode-v4-h128-q1": ["::test_decode_grid", "v4 and corr and h128q1"],
    "decode-v4-h128-q3": ["::test_decode_grid", "v4 and corr and h128q3"],
    "decode-v4-corner": ["::test_decode_grid", "v4 and not corr"],
    "prefill": ["::test_prefill_grid", ""],
}
# The suite's cases with a float32 parameter (marker set in tests/conftest.py): their kernels are
# Triton's slowest specializations to compile (~10 s each; 40-50% of the suite's compile time on
# a fresh cache, ~410 cases), for a dtype no serving engine passes, so ``quick`` leaves them to
# the ``suite-fp32`` part of ``full``
FP32_MARK = "fp32"
SUITE_FP32_PART = "suite-fp32"
PYTEST = [sys.executable, "-m", "pytest", "-q", "-rfE", "-p", "no:cacheprovider"]
EMULATE_SLICE = 350
EMULATE_CASES = {80: 694, 86: 380, 89: 380}


@dataclasses.dataclass
class Step:
    name: str
    cmd: list[str]
    env: dict[str, str] = dataclasses.field(default_factory=dict)
    limit_s: int = STEP_LIMIT_S


@dataclasses.dataclass
class Result:
    name: str
    rc: int
    seconds: float
    counts: str
    log: str

    @property
    def ok(self) -> bool:
        return self.rc == 0


def _parts() -> list[tuple[str, str, int]]:
    """(part name, suite or tool, slice index) for every part of ``full``."""
    parts = []
    for tool, per in SANITIZE_SLICES.items():
        for k in range(-(-SANITIZE_CASES // per)):
            parts.append((f"{tool}-{k}", tool, k))
    parts.append((SUITE_FP32_PART, "suite", 0))
    parts.append(("graph", "graph", 0))
    for k, name in enumerate(CONFORMANCE_SLICES):
        parts.append((f"conformance-{name}", "conformance", k))
    for cc, n in EMULATE_CASES.items():
        for k in range(-(-n // EMULATE_SLICE)):
            parts.append((f"emulate{cc}-{k}", f"emulate{cc}", k))
    return parts


def _base_env(args: argparse.Namespace) -> dict[str, str]:
    env = dict(os.environ)
    paths = [str(ROOT / "src")]
    if args.triton:
        paths.insert(0, str(Path(args.triton).resolve()))
        env["TRITON_BACKENDS_IN_TREE"] = "1"
        env.setdefault("TRITON_CACHE_DIR", "/tmp/triton-cache-" + Path(args.triton).name)
    env["PYTHONPATH"] = os.pathsep.join(paths + [p for p in [env.get("PYTHONPATH")] if p])
    env["PYTHONUNBUFFERED"] = "1"
    env.pop("TRITON_INTERPRET", None)
    return env


# pytest-xdist's "worksteal" scheduling (3.2+): an idle worker takes tests queued on a busy one,
# so the suite's longest tests (30-55 s, mostly compiling) do not all finish on one worker
WORKSTEAL_XDIST = (3, 2)


def _xdist_version() -> str | None:
    try:
        return importlib.metadata.version("pytest-xdist")
    except importlib.metadata.PackageNotFoundError:
        return None


def xdist_args(jobs: int, version: str | None) -> list[str]:
    """pytest's arguments for ``jobs`` parallel processes with pytest-xdist ``version`` (None:
    not installed, then none)."""
    if jobs <= 1 or not version:
        return []
    release = tuple(int(x) for x in version.split(".")[:2] if x.isdigit())
    dist = ["--dist", "worksteal"] if release >= WORKSTEAL_XDIST else []
    return ["-n", str(jobs)] + dist


def quick_steps(args: argparse.Namespace, info: dict) -> list[Step]:
    target = info["target"]
    # the short steps first: if the suite outgrows the window, it is the one cut short (and its
    # summary still says what ran)
    return [
        Step("verify", [sys.executable, "-m", "triton_mla_sparse.cli.main", "verify"]),
        # the ahead-of-time compile test for this GPU's own target (its fixture spreads the
        # compiles over processes itself)
        Step("compile", PYTEST + ["tests/test_compile.py"], env={"TMS_COMPILE_ONLY": target + "-"}),
        suite_step(
            "pytest", f"not {CONFORMANCE_MARK} and not {FP32_MARK}", args, info.get("xdist")
        ),
    ]


def suite_step(name: str, marks: str, args: argparse.Namespace, xdist: str | None) -> Step:
    """The pytest suite (less the compile test, which has its own step) over the cases ``marks``
    selects, in parallel, its junit XML as ``DIR/<name>.xml``."""
    return Step(
        name,
        PYTEST
        + xdist_args(args.jobs, xdist)
        + ["tests", "--ignore=tests/test_compile.py", "-m", marks]
        # the slowest tests in the log: where the suite's share of the window goes
        + [f"--durations={QUICK_DURATIONS}"]
        + ["--junitxml", str(Path(args.out) / f"{name}.xml")],
    )


def part_steps(part: str, args: argparse.Namespace) -> list[Step]:
    names = {name: (suite, k) for name, suite, k in _parts()}
    if part not in names:
        raise SystemExit(f"unknown part {part!r}; `full --list` lists them")
    suite, k = names[part]
    out = Path(args.out)
    rel = [sys.executable, str(RELIABILITY)]
    if suite in SANITIZE_SLICES:
        per = SANITIZE_SLICES[suite]
        return sanitize_steps(suite, k * per, per, out / part, args)
    if suite == "suite":
        return [suite_step(part, f"{FP32_MARK} and not {CONFORMANCE_MARK}", args, _xdist_version())]
    if suite == "conformance":
        pytest = PYTEST + xdist_args(args.jobs, _xdist_version())
        test, expr = list(CONFORMANCE_SLICES.values())[k]
        grid = [CONFORMANCE_GRID + test, "-m", CONFORMANCE_MARK] + (["-k", expr] if expr else [])
        return [Step(part, pytest + grid + ["--junitxml", str(out / f"{part}.xml")])]
    if suite == "graph":
        return [
            Step(part, rel + ["--suite", "graph", "--jobs", "8", "--log", str(out / "graph.json")])
        ]
    cc = int(suite.removeprefix("emulate"))
    cmd = rel + ["--suite", "emulate", "--arch", str(cc), "--jobs", str(args.jobs)]
    cmd += ["--skip-cases", str(k * EMULATE_SLICE)]
    if (k + 1) * EMULATE_SLICE < EMULATE_CASES[cc]:
        # the last slice runs to the end: on a GPU the list can be longer than EMULATE_CASES
        # (counted on CPU, where sm80's fp8_ds_mla calls plan the interpreter's scalar e4m3
        # decode, one variant where the GPU's packed decode makes two)
        cmd += ["--max-cases", str(EMULATE_SLICE)]
    return [Step(part, cmd + ["--log", str(out / f"{part}.json")])]


def sanitize_steps(tool: str, skip: int, count: int, out: Path, args: argparse.Namespace):
    """One slice of the sanitize suite under ``tool``: benchmarks/reliability/sanitize.sh compiles
    the slice's variants without the sanitizer, then runs it in parallel sanitized shards."""
    sel = ["--skip-cases", str(skip), "--max-cases", str(count)]
    cmd = ["bash", str(SANITIZE), tool, str(args.jobs), "--out", str(out)] + sel
    return [Step(out.name, cmd, env={"PYTHON": sys.executable, "COMPILE_JOBS": str(args.jobs)})]


_PYTEST_COUNTS = re.compile(r"(\d+ (?:passed|failed|skipped|errors?|xfailed|xpassed|deselected))")


def _counts(log: str) -> str:
    """The last pytest summary (passed/failed/...) or reliability RESULT line of a log."""
    lines = log.splitlines()
    for line in reversed(lines):
        found = _PYTEST_COUNTS.findall(line)
        if found and (" in " in line or line.startswith("=")):
            return ", ".join(found)
        if line.startswith("RESULT"):
            return line.removeprefix("RESULT:").strip()[:60]
    return lines[-1][:60] if lines else ""


def _kill_group(proc: subprocess.Popen) -> None:
    with contextlib.suppress(ProcessLookupError):
        os.killpg(proc.pid, signal.SIGKILL)
    proc.wait()


def _terminate(signum: int, _frame: object) -> None:
    raise SystemExit(128 + signum)  # unwinds through run_step, which stops the running step


def run_step(
    step: Step, base_env: dict[str, str], out: Path, limit_s: float | None = None
) -> Result:
    """Run one step, its output in DIR/<name>.log, stopped after ``limit_s`` (default its
    own limit): SIGINT first, then SIGKILL for its whole process group (rc 124)."""
    log_path = out / f"{step.name}.log"
    env = {**base_env, **step.env}
    limit = step.limit_s if limit_s is None else limit_s
    t0 = time.perf_counter()
    print(f"== {step.name}: {' '.join(step.cmd)}", flush=True)
    with open(log_path, "w") as log:
        proc = subprocess.Popen(
            step.cmd,
            cwd=ROOT,
            env=env,
            stdout=log,
            stderr=subprocess.STDOUT,
            start_new_session=True,  # its own process group: its workers go with it
        )
        try:
            rc = proc.wait(timeout=limit)
        except subprocess.TimeoutExpired:
            rc = 124
            proc.send_signal(signal.SIGINT)
            with contextlib.suppress(subprocess.TimeoutExpired):
                proc.wait(timeout=INTERRUPT_GRACE_S)
            _kill_group(proc)
            log.flush()
            log.write(f"\n[gpu_check] stopped after {limit:.0f} s\n")
        except BaseException:
            # gpu_check itself interrupted (Ctrl-C, or SIGTERM from a timeout around it): the
            # step is detached into its own process group, so nothing else stops its GPU workers
            _kill_group(proc)
            raise
    text = log_path.read_text(errors="replace")
    r = Result(step.name, rc, time.perf_counter() - t0, _counts(text), str(log_path))
    print(f"   rc={r.rc} {r.seconds:.0f}s {r.counts}", flush=True)
    if not r.ok:  # the failures, so that the printed output alone says what broke
        for line in [ln for ln in text.splitlines() if ln.startswith(("FAILED", "ERROR"))][:30]:
            print("   " + line[:200], flush=True)
    return r


# The children's environment, printed as one JSON line. "flashmla" says whether the conformance
# grids can run FlashMLA's own call beside each case (vLLM's build on the path, a GPU it has
# kernels for); without it they check against the reference alone.
ENV_PROBE = """
import importlib.metadata, importlib.util, json, torch, triton
p = torch.cuda.get_device_properties(0)
hip = torch.version.hip is not None
try:
    from triton_mla_sparse.peers import flashmla
    flashmla.load()
    fm = "available"
except Exception as e:
    fm = "not available: " + (str(e).splitlines() or [type(e).__name__])[0][:200]
print(json.dumps(dict(gpu=p.name, capability=f"{p.major}.{p.minor}",
    target=("hip:" + p.gcnArchName.split(":")[0]) if hip else f"cuda:{p.major}{p.minor}",
    torch=torch.__version__, triton=triton.__version__, triton_path=triton.__file__,
    cuda=torch.version.cuda or torch.version.hip,
    xdist=(importlib.util.find_spec("xdist") is not None)
    and importlib.metadata.version("pytest-xdist"), flashmla=fm)))
"""


def environment(env: dict[str, str]) -> dict:
    """What the children see: GPU, compile target, torch / Triton, whether pytest-xdist and
    FlashMLA are there (one probe); exits when no GPU is visible."""
    out = subprocess.run([sys.executable, "-c", ENV_PROBE], env=env, capture_output=True, text=True)
    if out.returncode != 0:
        raise SystemExit("no GPU visible to PyTorch: the GPU check needs one\n" + out.stderr)
    info = json.loads(out.stdout.strip().splitlines()[-1])
    smi = shutil.which("nvidia-smi")
    if smi:
        q = "--query-gpu=driver_version,clocks.sm,clocks.mem"
        info["nvidia-smi"] = subprocess.run(
            [smi, q, "--format=csv,noheader"], capture_output=True, text=True
        ).stdout.strip()
    return info


# the test files and the kernels the quick's time breakdown lists
TIME_FILES = 12
TIME_KERNELS = 12


def time_breakdown(junit_xml: Path) -> dict | None:
    """Where a pytest run's time went, from its junit XML: seconds summed over the workers, the
    part of them in Triton's JIT compiles (tests/conftest.py records each test's), and the same
    per test file, largest first; and per kernel, its distinct specializations and their
    seconds, and the compiles of a specialization another worker had compiled too (a hit in
    the shared on-disk cache, or the same compile at the same time). None without the XML (a
    run cut short writes none)."""
    if not junit_xml.is_file():
        return None
    files: dict[str, list[float]] = {}
    specs: dict[tuple[str, str], list[float]] = {}  # (kernel, key): each compile's seconds
    for case in ET.parse(junit_xml).getroot().iter("testcase"):
        props = {p.get("name"): p.get("value") for p in case.iter("property")}
        row = files.setdefault(case.get("classname") or "?", [0.0, 0.0, 0])
        row[0] += float(case.get("time") or 0.0)
        row[1] += float(props.get("triton_compile_s") or 0.0)
        row[2] += int(props.get("triton_compiles") or 0)
        for item in filter(None, (props.get("triton_compiled") or "").split(";")):
            name, key, seconds = item.rsplit(":", 2)
            specs.setdefault((name, key), []).append(float(seconds))
    total = [sum(r[i] for r in files.values()) for i in range(3)]
    top = sorted(files.items(), key=lambda kv: -kv[1][0])[:TIME_FILES]
    kernels: dict[str, list[float]] = {}
    for (name, _), seconds in specs.items():
        row = kernels.setdefault(name, [0, 0.0])
        row[0] += 1
        row[1] += max(seconds)  # the compile; the others found it compiled or raced it
    again = [sorted(v)[:-1] for v in specs.values()]
    top_kernels = sorted(kernels.items(), key=lambda kv: -kv[1][1])[:TIME_KERNELS]
    return {
        "seconds": round(total[0], 1),
        "compile_seconds": round(total[1], 1),
        "compiles": total[2],
        "files": {
            k: {"seconds": round(v[0], 1), "compile_seconds": round(v[1], 1)} for k, v in top
        },
        "specializations": len(specs),
        "compiled_again": sum(len(a) for a in again),
        "compiled_again_seconds": round(sum(sum(a) for a in again), 1),
        "kernels": {
            k: {"specializations": v[0], "compile_seconds": round(v[1], 1)} for k, v in top_kernels
        },
    }


def print_time_breakdown(t: dict) -> None:
    share = t["compile_seconds"] / t["seconds"] if t["seconds"] else 0.0
    print(
        f"pytest time summed over workers: {t['seconds']:.0f} s, {t['compile_seconds']:.0f} s "
        f"({share:.0%}) in {t['compiles']} Triton compiles"
    )
    for name, f in t["files"].items():
        print(f"  {f['seconds']:7.0f} s  compiling {f['compile_seconds']:6.0f} s  {name}")
    if t.get("specializations"):
        print(
            f"{t['specializations']} distinct kernel specializations; {t['compiled_again']} "
            f"compiles ({t['compiled_again_seconds']:.0f} s) of one another worker had compiled"
        )
        for name, k in t["kernels"].items():
            print(
                f"  {k['compile_seconds']:7.0f} s  {k['specializations']:4d} specializations  "
                f"{name}"
            )


def main(argv: list[str] | None = None) -> int:
    started = time.monotonic()
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("mode", choices=("quick", "full"))
    p.add_argument("--out", default=None, help="directory for the logs (required unless --list)")
    p.add_argument("--part", default=None, help="full: run one part (see --list)")
    p.add_argument("--list", action="store_true", help="full: list the parts and exit")
    p.add_argument("--triton", default=None, help="folder holding another Triton's triton/")
    p.add_argument(
        "--jobs",
        type=int,
        default=max(1, min(16, (os.cpu_count() or 2) - 2)),
        help="parallel test processes and sanitizer shards",
    )
    args = p.parse_args(argv)
    signal.signal(signal.SIGTERM, _terminate)
    if args.list:
        for name, _, _ in _parts():
            print(name)
        return 0
    if not args.out:
        p.error("--out DIR is required")
    if args.part and args.mode != "full":
        p.error("--part belongs to full")
    if args.triton and not (Path(args.triton) / "triton" / "__init__.py").is_file():
        p.error(f"--triton {args.triton}: no triton/__init__.py there")
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    env = _base_env(args)
    info = environment(env)
    print("environment:", json.dumps(info), flush=True)
    steps: list[Step] = []
    if args.mode == "quick" or not args.part:
        steps += quick_steps(args, info)
    if args.mode == "full":
        for name in [args.part] if args.part else [n for n, _, _ in _parts()]:
            steps += part_steps(name, args)
    if any(st.name.startswith("conformance") for st in steps) and info["flashmla"] != "available":
        print(
            f"FlashMLA {info['flashmla']}: the conformance grids check against the float64 "
            "reference alone (FlashMLA's own call is compared where vLLM's build is on the path)",
            flush=True,
        )
    # quick's steps share one window; full's parts have one each
    deadline = started + QUICK_WINDOW_S if args.mode == "quick" else None
    results = []
    for step in steps:
        limit = step.limit_s
        if deadline is not None:
            limit = max(1.0, min(limit, deadline - time.monotonic() - INTERRUPT_GRACE_S))
        results.append(run_step(step, env, out, limit))
    summary = {"mode": args.mode, "part": args.part, "environment": info}
    summary["steps"] = [dataclasses.asdict(r) for r in results]
    times = time_breakdown(out / "pytest.xml") if args.mode == "quick" else None
    if times is not None:
        summary["pytest_time"] = times
    (out / "summary.json").write_text(json.dumps(summary, indent=1))
    print(
        f"\nGPU check ({args.mode}{' part ' + args.part if args.part else ''}): "
        f"{info.get('gpu')}, torch {info.get('torch')}, triton {info.get('triton')}"
    )
    if times is not None:
        print_time_breakdown(times)
    print(f"{'step':<20s} {'status':<6s} {'s':>5s}  counts")
    for r in results:
        print(f"{r.name:<20s} {'ok' if r.ok else f'rc={r.rc}':<6s} {r.seconds:5.0f}  {r.counts}")
    bad = [r.name for r in results if not r.ok]
    print("RESULT:", "PASS" if not bad else "FAIL: " + ", ".join(bad))
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
