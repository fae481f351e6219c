"""The ``triton-mla-sparse`` command and the measurement helpers behind ``bench``.

Without a GPU: ``verify`` runs its reduced cases through the interpreter, ``bench`` refuses bad
arguments and combinations (before looking for a GPU) and exits 2 with nothing to time; the
indexer bench's driver runs its checks on a reduced grid. With a GPU: ``verify`` on the full
workload (checks only) and a one-shape ``bench`` with its JSON and CSV.
"""

from __future__ import annotations

import csv
import dataclasses
import json
import re

import pytest
import torch
from conftest import HAS_GPU

from triton_mla_sparse import __version__
from triton_mla_sparse.bench import case_cost, check_rows, config_label, run_case
from triton_mla_sparse.cli import bench as bench_cli
from triton_mla_sparse.cli.main import build_parser, main
from triton_mla_sparse.ops.sparse_mla import heuristics
from triton_mla_sparse.ops.sparse_mla.heuristics import KernelConfig
from triton_mla_sparse.testing import rel_err, sparse_mla_tolerance
from triton_mla_sparse.workloads import Case, make_inputs


def test_verify_runs_and_passes(capsys):
    """verify prints each case as it finishes (with the tolerance it applies), then its table,
    and exits 0 when every case passes (reduced cases on CPU)."""
    assert main(["verify", "--no-time"]) == 0
    out = capsys.readouterr().out
    if not HAS_GPU:
        assert "No GPU found" in out
    lines = out.strip().splitlines()
    last = lines[-1]
    n = int(last.split()[0])
    assert last.endswith(" passed, 0 failed") and n >= 5
    assert "FAIL" not in out
    progress = [x for x in lines if x.startswith("[")]
    assert [x.split("]")[0] for x in progress] == [f"[{i}/{n}" for i in range(1, n + 1)]
    tol = sparse_mla_tolerance(torch.float16 if not HAS_GPU else torch.bfloat16).out_rtol
    tol = f"(tol {tol:.1e})"
    assert all(" pass, " in x and "rel err" in x for x in progress)
    assert any(tol in x for x in progress)
    assert any(x.startswith("pass: relative Frobenius error") for x in lines)
    # the table names the kernel configuration each case ran (the plan's, not a guess)
    header = next(x for x in lines if x.startswith("case "))
    assert " kernel " in header
    i = lines.index(header) + 2  # past the dashes
    rows = lines[i : i + n]
    assert all(re.search(r" h(16|32|64) n\d+ w\d+ s\d+ k\d+", x) for x in rows), rows
    assert any(x.startswith("kernel (as run)") for x in lines)


def test_version(capsys):
    with pytest.raises(SystemExit) as info:
        main(["--version"])
    assert info.value.code == 0
    assert capsys.readouterr().out.strip() == f"triton-mla-sparse {__version__}"


def test_help_shows_defaults_and_formats(capsys):
    with pytest.raises(SystemExit) as info:
        main(["bench", "--help"])
    assert info.value.code == 0
    out = " ".join(capsys.readouterr().out.split())  # argparse wraps lines
    assert "auto,fp8,fp8_ds_mla" in out
    assert "(default: auto,fp8_ds_mla)" in out and "(default: 1,4,16,64,128)" in out
    assert "plot extra" in out


@pytest.fixture
def no_gpu_work(monkeypatch):
    """bench must reject bad arguments before looking for a GPU."""
    import triton_mla_sparse.cli.bench as bench_cli

    def boom():
        raise AssertionError("bench looked for a GPU before validating its arguments")

    monkeypatch.setattr(bench_cli, "gpu_device", boom)


@pytest.mark.parametrize(
    "argv,words",
    [
        (["--formats", "bogus"], ["--formats", "bogus", "fp8_ds_mla"]),
        (["--formats", "auto,"], None),  # a trailing comma is fine: see below
        (["--formats", ","], ["--formats", "empty"]),
        (["--decode", "0"], ["--decode", "below 1"]),
        (["--heads", "8,x"], ["--heads", "'x'"]),
        (["--prefill-heads", "-4"], ["--prefill-heads"]),
    ],
    ids=["formats", "trailing-comma", "formats-empty", "decode-0", "heads-x", "prefill-neg"],
)
def test_bench_rejects_bad_arguments_without_a_gpu(no_gpu_work, capsys, argv, words):
    if words is None:  # valid: parsing gets through to the GPU lookup
        with pytest.raises(AssertionError, match="looked for a GPU"):
            main(["bench", *argv])
        return
    with pytest.raises(SystemExit) as info:
        main(["bench", *argv])
    assert info.value.code == 2
    err = capsys.readouterr().err
    for w in words:
        assert w in err, (w, err)


def test_bench_plot_needs_matplotlib(no_gpu_work, monkeypatch, capsys):
    """--plot without matplotlib: a usage error (exit 2) naming the plot extra, before any GPU."""
    import importlib.util

    real = importlib.util.find_spec
    monkeypatch.setattr(
        importlib.util,
        "find_spec",
        lambda name, *a: None if name == "matplotlib" else real(name, *a),
    )
    with pytest.raises(SystemExit) as info:
        main(["bench", "--plot", "x.png"])
    assert info.value.code == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err[0].startswith("usage: triton-mla-sparse bench")
    assert err[-1].startswith("triton-mla-sparse bench: error: ") and "[plot]" in err[-1]


@pytest.mark.parametrize(
    "argv,words",
    [
        (["--decode", "4"], ["--decode"]),
        (["--heads", "16"], ["--heads"]),
        (["--prefill-heads", "64"], ["--prefill-heads"]),
        (["--sink"], ["--sink"]),
        (["--reference"], ["--reference"]),
        (["--plot", "x.png"], ["--plot"]),
        (["--compare", "flashmla"], ["--compare"]),
        (["--decode", "4", "--sink", "--compare", "flashmla"], ["--decode, --sink, --compare"]),
    ],
    ids=["decode", "heads", "prefill-heads", "sink", "reference", "plot", "compare", "several"],
)
def test_bench_indexer_refuses_what_it_does_not_take(no_gpu_work, capsys, argv, words):
    """With --indexer an option it would ignore is a usage error naming it and what --indexer
    takes, before any GPU lookup (a default value given explicitly counts as given)."""
    with pytest.raises(SystemExit) as info:
        main(["bench", "--indexer", *argv])
    assert info.value.code == 2
    err = capsys.readouterr().err
    assert "not with --indexer" in err and "--formats" in err and "--csv" in err
    for w in words:
        assert w in err, (w, err)


def test_bench_full_needs_indexer(no_gpu_work, capsys):
    with pytest.raises(SystemExit) as info:
        main(["bench", "--full", "--decode", "4"])
    assert info.value.code == 2
    assert "--full widens the --indexer grid" in capsys.readouterr().err


@pytest.mark.parametrize(
    "argv",
    [
        ["--indexer"],
        ["--indexer", "--full", "--no-prefill", "--formats", "fp8", "--json", "j", "--csv", "c"],
        ["--decode", "1,4,16,64,128", "--sink", "--reference"],
    ],
    ids=["indexer", "indexer-all-it-takes", "sparse-mla"],
)
def test_bench_accepted_combinations_reach_the_gpu_lookup(no_gpu_work, argv):
    with pytest.raises(AssertionError, match="looked for a GPU"):
        main(["bench", *argv])


@pytest.mark.skipif(HAS_GPU, reason="the CPU path of bench")
@pytest.mark.parametrize("indexer", [False, True], ids=["sparse-mla", "indexer"])
def test_bench_without_gpu_fails_and_says_why(capsys, tmp_path, indexer):
    """Nothing to time: exit 2 and an error on stderr, so that a script notices; no files."""
    argv = ["bench", "--json", str(tmp_path / "b.json")] + (["--indexer"] if indexer else [])
    assert main(argv) == 2
    captured = capsys.readouterr()
    assert captured.out == ""
    err = captured.err.strip()
    assert err.startswith("triton-mla-sparse bench: error: no GPU found") and "verify" in err
    assert not (tmp_path / "b.json").exists()


@pytest.mark.skipif(HAS_GPU, reason="a GPU runs the real grid: benchmarks/perf/indexer_gpu.py")
def test_bench_indexer_driver_writes_what_it_ran(monkeypatch, tmp_path, capsys):
    """The --indexer driver on a reduced grid (CPU: checks only, no timing): the decode grid,
    --no-prefill honoured, the DSA layer for each --formats entry (per-tensor fp8 too), and the
    same results in the JSON and the CSV."""
    from triton_mla_sparse.cli import bench_indexer as cli_indexer

    monkeypatch.setattr(
        cli_indexer, "DEFAULT_DECODE", dict(rows=(2,), ctx=(200,), heads=(32,), next_n=(1,))
    )
    js, cs = tmp_path / "i.json", tmp_path / "i.csv"
    argv = ["bench", "--indexer", "--no-prefill", "--formats", "fp8", "--json", str(js)]
    args = build_parser().parse_args([*argv, "--csv", str(cs)])
    assert bench_cli.check_args(args) is None
    layer = dict(batch=2, ctx=256, topk=64, dtype=torch.float16)  # bf16 is wrong interpreted
    assert cli_indexer.run(args, torch.device("cpu"), layer=layer) == 0
    results = json.loads(js.read_text())["results"]
    assert [(r["kind"], r["decode"]) for r in results] == [
        ("decode", "native"),
        ("decode", "integer"),
    ] + [("layer", "fp8")] * 4
    assert all(r["passed"] and r["us"] is None for r in results)
    with open(cs) as f:
        rows = list(csv.DictReader(f))
    assert [r["case"] for r in rows] == [r["case"] for r in results]
    assert "FAIL" not in capsys.readouterr().out


@pytest.mark.skipif(not HAS_GPU, reason="times CUDA kernels")
def test_bench_one_shape_writes_json_and_csv(tmp_path):
    js, cs = tmp_path / "b.json", tmp_path / "b.csv"
    argv = ["bench", "--decode", "4", "--heads", "16", "--formats", "auto", "--no-prefill"]
    assert main([*argv, "--json", str(js), "--csv", str(cs)]) == 0
    data = json.loads(js.read_text())
    assert {"gpu", "torch", "triton", "copy_gbps", "matmul_tflops"} <= set(data["environment"])
    (res,) = data["results"]
    assert res["passed"] and res["us"] > 0 and res["ratio"] > 0
    with open(cs) as f:
        assert next(csv.DictReader(f))["case"] == res["case"]


def test_plan_label_says_what_runs():
    """bench labels a case with the plan's configuration as run: the split count used, the
    integer e4m3 decode, MMAs in q's dtype, a merge without dependent launch."""
    from triton_mla_sparse.bench import plan_label
    from triton_mla_sparse.ops.sparse_mla.heuristics import Arch
    from triton_mla_sparse.ops.sparse_mla.plan import make_plan

    def label(arch, fmt, t, h, on_gpu=True, **kw):
        return plan_label(
            make_plan(
                num_tokens=t,
                num_heads=h,
                latent=512,
                rope=64,
                width=2048,
                dtype=torch.bfloat16,
                kv_format=fmt,
                arch=arch,
                on_gpu=on_gpu,
                **kw,
            )
        )

    h200, a100 = Arch("cuda", 90, 132), Arch("cuda", 80, 108)
    assert label(h200, "fp8", 128, 64) == "h64 n64 w8 s3 k1 +qmma"
    assert label(h200, "auto", 128, 64) == "h64 n64 w4 s1 k1 +gluon:specialized"
    assert label(h200, "auto", 4096, 64) == "h64 n64 w4 s1 k1 +gluon:specialized"
    assert label(h200, "auto", 4096, 16) == "h16 n64 w4 s2 k1"
    assert label(a100, "fp8", 128, 16).endswith(" +int")
    assert "+int" not in label(a100, "auto", 128, 16)
    split = label(h200, "fp8_ds_mla", 1, 16)
    assert " k1 " not in split + " " and "+st" in split and "-pdl" not in split
    assert label(h200, "fp8_ds_mla", 1, 16, on_gpu=False).endswith(" -pdl")
    # the Gluon kernel where it runs, the Triton tile where it cannot
    pipelined = heuristics.triton_version() >= heuristics.PIPELINED_DS_MLA_TRITON
    form = "pipelined" if pipelined else "specialized"
    assert label(h200, "fp8_ds_mla", 128, 64) == f"h64 n64 w8 s1 k1 +st +f16fold +gluon:{form}"
    triton_tile = label(h200, "fp8_ds_mla", 128, 64, cache_aligned=False)
    assert triton_tile == "h64 n64 w8 s2 k1 +st +f16fold"
    # the split count as run: 2048 indices in 32-row steps cover at most 64 splits
    asked = KernelConfig(16, 32, 4, 2, num_splits=100)
    assert " k64 " in label(h200, "auto", 1, 16, config=asked) + " "


def test_the_legend_explains_every_mark_a_label_can_carry():
    """verify's and bench's legend (bench.LABEL_LEGEND) names every mark config_label and
    plan_label print: a configuration with every field set, the packed decodes, and the plan's
    own marks."""
    from triton_mla_sparse.bench import LABEL_LEGEND, PACKED_LABELS

    every = KernelConfig(
        16,
        32,
        4,
        1,
        2,
        idx_ahead=True,
        stage_dequant=True,
        pdl=False,
        fp16_fold=True,
        gluon="ampere",
        max_registers=168,
        q_rope_in_registers=True,
        split_qk=True,
        row_offsets_32=True,
    )
    marks = config_label(every).split()[5:] + [m.strip() for m in PACKED_LABELS.values()]
    marks += ["+int", "+qmma"]  # plan_label's (test_plan_label_says_what_runs)
    assert len(marks) == 13, marks
    for mark in marks:
        stem = re.sub(r"(?<=:)\w+$|\d+$", "", mark)  # +gluon:ampere -> +gluon:, +maxreg168
        assert stem in LABEL_LEGEND, (mark, stem)


def test_config_label():
    assert config_label(KernelConfig(16, 32, 4, 3, 2, idx_ahead=True)) == "h16 n32 w4 s3 k2 +ia"
    cfg = KernelConfig(64, 32, 8, 2, 1, stage_dequant=True, pdl=False)
    assert config_label(cfg) == "h64 n32 w8 s2 k1 +st -pdl"
    # the fold is a configuration field: sanitizer and tune logs name it as bench does
    folded = KernelConfig(64, 64, 8, 2, 1, stage_dequant=True, fp16_fold=True)
    assert config_label(folded) == "h64 n64 w8 s2 k1 +st +f16fold"
    capped = KernelConfig(16, 16, 4, 1, 2, gluon="ampere", max_registers=168)
    assert config_label(capped) == "h16 n16 w4 s1 k2 +gluon:ampere +maxreg168"
    gluon = dataclasses.replace(folded, num_stages=1, gluon="specialized")
    assert config_label(gluon) == "h64 n64 w8 s1 k1 +st +f16fold +gluon:specialized"
    o32 = KernelConfig(64, 32, 8, 2, 1, gluon="ampere", row_offsets_32=True)
    assert config_label(o32) == "h64 n32 w8 s2 k1 +gluon:ampere +o32"


def test_case_cost_is_the_documented_formula():
    """bytes = T*W*row_bytes + q + out, FLOPs = 2*H*T*W*(576 + 512) (docs/PERFORMANCE.md)."""
    small = dict(rows=4096, topk=256, dtype=torch.float16)
    for fmt, row in (("auto", 1152), ("fp8_ds_mla", 656)):
        case = Case("c", 3, 16, kv_format=fmt, **small)
        inp = make_inputs(case, torch.device("cpu"))
        nbytes, flops = case_cost(case, inp)
        assert nbytes == 3 * 256 * row + 3 * 16 * 576 * 2 + 3 * 16 * 512 * 2
        assert flops == 2 * 16 * 3 * 256 * (576 + 512)


def test_check_rows_samples_only_long_prefills():
    assert check_rows(Case("d", 128, 16)) is None
    rows = check_rows(Case("p", 4096, 16))
    assert rows is not None and rows[0] == 0 and rows[-1] == 4095 and len(set(rows.tolist())) == 256


def test_rel_err_rejects_non_finite():
    ref = torch.ones(4)
    assert rel_err(ref.clone(), ref) == 0.0
    bad = ref.clone()
    bad[1] = float("nan")
    assert rel_err(bad, ref) == float("inf")


def test_run_case_checks_before_timing():
    """run_case compares with the reference (here on CPU, untimed) and reports the configuration."""
    dev = torch.device("cuda" if HAS_GPU else "cpu")
    case = Case("c", 2, 8, rows=2048, topk=128, dtype=torch.float16, holes=True)
    res = run_case(case, dev, time_it=False)
    assert res.passed and res.err <= sparse_mla_tolerance(torch.float16).out_rtol
    assert res.us is None
    assert res.config.startswith("h16 ")


# --- bench --arch: another target's path by PTX JIT ---------------------------------------------


@pytest.mark.parametrize(
    "argv,words",
    [
        (["--arch", "sm75"], ["--arch", "sm75", "sm80"]),
        (["--arch", "80"], ["--arch", "sm80"]),
        (["--e4m3-decode", "vector"], ["--e4m3-decode", "packed-nomask"]),
        (["--indexer", "--arch", "sm80"], ["--arch", "not with --indexer"]),
        (["--indexer", "--e4m3-decode", "packed"], ["--e4m3-decode", "not with --indexer"]),
        (["--target-smem"], ["--target-smem", "needs --arch"]),
        (["--indexer", "--target-smem"], ["--target-smem", "not with --indexer"]),
        (["--host-sms"], ["--host-sms", "needs --arch"]),
        (["--indexer", "--host-sms"], ["--host-sms", "not with --indexer"]),
    ],
    ids=[
        "arch-sm75",
        "arch-bare-number",
        "decode-bogus",
        "indexer-arch",
        "indexer-decode",
        "target-smem-alone",
        "indexer-target-smem",
        "host-sms-alone",
        "indexer-host-sms",
    ],
)
def test_bench_arch_and_decode_arguments(no_gpu_work, capsys, argv, words):
    with pytest.raises(SystemExit) as info:
        main(["bench", *argv])
    assert info.value.code == 2
    err = capsys.readouterr().err
    for w in words:
        assert w in err, (w, err)


@pytest.mark.parametrize(
    "argv", [["--arch", "sm80"], ["--arch", "sm86", "--e4m3-decode", "packed,packed-nomask"]]
)
def test_bench_arch_arguments_reach_the_gpu_lookup(no_gpu_work, argv):
    with pytest.raises(AssertionError, match="looked for a GPU"):
        main(["bench", *argv])


@pytest.fixture
def fake_cuda(monkeypatch):
    """bench believes a CUDA GPU is here, of the capability the test sets (a CUDA build unless
    the test sets torch.version.hip); any timing is an error (the refusals come first)."""
    state = {"capability": (9, 0)}
    monkeypatch.setattr(bench_cli, "gpu_device", lambda: torch.device("cuda"))
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda *a: state["capability"])
    monkeypatch.setattr(torch.version, "hip", None, raising=False)

    def no_work(*a, **k):
        raise AssertionError("bench went on to measure after refusing")

    import triton_mla_sparse.testing as testing

    monkeypatch.setattr(testing, "measure_ceilings", no_work)
    return state


@pytest.mark.parametrize(
    "arch,capability,hip,words",
    [
        ("sm89", (8, 6), None, ["sm86, older than sm89"]),
        ("sm80", (7, 5), None, ["sm75, older than sm80"]),
        ("sm89", (8, 9), None, ["sm89's path is its native one", "without"]),
        ("sm80", (9, 4), "6.2", ["NVIDIA GPU", "ROCm (AMD)"]),
    ],
    ids=["older", "much-older", "native", "amd"],
)
def test_bench_arch_refuses_where_the_ptx_cannot_run(
    fake_cuda, monkeypatch, capsys, arch, capability, hip, words
):
    fake_cuda["capability"] = capability
    monkeypatch.setattr(torch.version, "hip", hip)
    assert main(["bench", "--arch", arch]) == 2
    captured = capsys.readouterr()
    assert captured.out == ""
    err = captured.err.strip()
    assert err.startswith(f"triton-mla-sparse bench: error: --arch {arch}: ")
    for w in words:
        assert w in err, (w, err)


@pytest.mark.parametrize(
    "flags",
    [[], ["--target-smem"], ["--host-sms"], ["--target-smem", "--host-sms"]],
    ids=["plain", "target-smem", "host-sms", "both"],
)
def test_bench_emulation_options_reach_the_emulation(fake_cuda, monkeypatch, flags):
    """--target-smem asks ptx_jit.enable for the target's shared memory per multiprocessor
    (without it the emulation keeps the host's), --host-sms for grids sized for this GPU's
    multiprocessor count (without it, the target's)."""
    from triton_mla_sparse.testing import ptx_jit

    asked = []

    class Stop(Exception):
        pass

    def fake_enable(cc, **kw):  # test double: records what bench asked for, runs nothing
        asked.append((cc, kw.get("target_smem"), kw.get("host_sms")))
        raise Stop

    monkeypatch.setattr(ptx_jit, "enable", fake_enable)
    monkeypatch.setattr(torch, "zeros", lambda *a, **k: None)  # no CUDA context here
    with pytest.raises(Stop):
        main(["bench", "--arch", "sm89", *flags])
    assert asked == [(89, "--target-smem" in flags, "--host-sms" in flags)]


def test_bench_arch_refuses_when_the_driver_cannot_jit(fake_cuda, monkeypatch, capsys):
    """Past the static checks, the driver's own refusal (its JIT of one small kernel) is the
    error, and the emulation is undone."""
    from triton_mla_sparse.testing import ptx_jit

    undone = []

    class FakeEmulation:  # test double: enable() without touching Triton
        cc = 80

        def disable(self):
            undone.append(True)

    monkeypatch.setattr(ptx_jit, "enable", lambda cc, **kw: FakeEmulation())

    def driver_says_no(emu, device):
        raise ptx_jit.EmulationUnavailable("CUDA_ERROR_UNSUPPORTED_PTX_VERSION (test double)")

    monkeypatch.setattr(ptx_jit, "check_jit", driver_says_no)
    assert main(["bench", "--arch", "sm80"]) == 2
    err = capsys.readouterr().err
    assert "--arch sm80: CUDA_ERROR_UNSUPPORTED_PTX_VERSION" in err
    assert undone == [True]


def test_ptx_jit_refusal_accepts_newer_nvidia_gpus():
    from triton_mla_sparse.testing import ptx_jit

    for cc in (80, 86, 89):
        for capability in ((9, 0), (10, 0), (12, 0)):
            assert ptx_jit.refusal(cc, capability, hip=False) is None
    assert "sm90 is not an emulated target" in ptx_jit.refusal(90, (10, 0), hip=False)
    assert "none found" in ptx_jit.refusal(80, None, hip=False)
    assert ptx_jit.path_label(80, "NVIDIA H200") == "sm80 path by PTX JIT on NVIDIA H200"
    assert ptx_jit.path_label(89, "NVIDIA H200", target_smem=True) == (
        "sm89 path by PTX JIT on NVIDIA H200, 100 KB shared memory a multiprocessor"
    )
    assert ptx_jit.path_label(80, "NVIDIA H100", host_sms=132) == (
        "sm80 path by PTX JIT on NVIDIA H100, grids for 132 SMs"
    )


def test_ptx_jit_driver_enums_are_cuda_h_values():
    """The CUDA driver enum values testing.ptx_jit passes through ctypes are cuda.h's (read from
    the header Triton ships): a wrong one reads or sets another attribute without any error."""
    from pathlib import Path

    import triton

    from triton_mla_sparse.testing import ptx_jit

    cuda_h = Path(triton.__file__).parent / "backends" / "nvidia" / "include" / "cuda.h"
    text = cuda_h.read_text()
    names = [n for n in vars(ptx_jit) if n.startswith("_CU_")]
    assert names
    for name in names:
        m = re.search(rf"\b{name[1:]}\s*=\s*(\d+)", text)
        assert m, name
        assert getattr(ptx_jit, name) == int(m.group(1)), name


def test_padded_shared_holds_the_targets_blocks_per_multiprocessor():
    """ptx_jit.padded_shared: launched with the padded shared memory, an H200 multiprocessor
    (228 KB, 2048 threads, 32 blocks) holds exactly as many blocks as the target's would, for
    every block size and shared-memory footprint that fits the target; the padding never
    shrinks a kernel's shared memory nor passes the host's 227 KB a block."""
    from triton_mla_sparse.testing import ptx_jit

    h200, optin = 228 * 1024, 227 * 1024
    unit, reserved = 128, 1024  # cuda_occupancy.h: allocation granularity, reserved per block

    def h200_blocks(shared: int, threads: int) -> int:
        per_block = -(-(shared + reserved) // unit) * unit
        return min(h200 // per_block, 2048 // threads, 32)

    for cc in ptx_jit.EMULATED_CCS:
        for threads in (32, 128, 256, 512, 1024):
            for shared in range(0, optin + 1, 512):
                blocks = ptx_jit.target_blocks_per_sm(cc, shared, threads)
                padded = ptx_jit.padded_shared(cc, shared, threads, h200)
                if blocks == 0:  # does not fit the target: left as it is (too_big reports it)
                    assert padded == shared
                    continue
                assert shared <= padded <= optin, (cc, threads, shared, padded)
                assert h200_blocks(padded, threads) == blocks, (cc, threads, shared, padded)
    # the sm89 path's 97 KB fp8_ds_mla tile: one block on an L40S, two on an unpadded H200
    assert ptx_jit.target_blocks_per_sm(89, 96768, 128) == 1
    assert h200_blocks(96768, 128) == 2
    assert h200_blocks(ptx_jit.padded_shared(89, 96768, 128, h200), 128) == 1
    # an A100 holds two 64 KB 4-warp blocks, an L40S one; 16 256-thread blocks of no shared
    # memory are the L40S's thread limit (1536: 6 blocks)
    assert ptx_jit.target_blocks_per_sm(80, 64 * 1024, 128) == 2
    assert ptx_jit.target_blocks_per_sm(89, 64 * 1024, 128) == 1
    assert ptx_jit.target_blocks_per_sm(89, 0, 256) == 6
    for bad in ((90, 0, 128), (89, -1, 128), (89, 0, 0)):
        with pytest.raises(ValueError):
            ptx_jit.target_blocks_per_sm(*bad)


@pytest.mark.skipif(
    not HAS_GPU or torch.version.hip is not None, reason="runs sm_8x PTX through the CUDA driver"
)
def test_target_smem_launches_the_targets_blocks_per_multiprocessor():
    """enable(target_smem=True): every kernel loaded while enabled may take the padded launch
    (the load hook saw it), the driver's occupancy for the padded launch is the target's
    blocks per multiprocessor (or fewer where this GPU's registers bound it already), the
    kernels pass the reference check, and disable() removes the hook and the padding."""
    import ctypes

    import triton.knobs as knobs
    from triton.backends.nvidia.compiler import CUDABackend

    from triton_mla_sparse.ops.sparse_mla import launch
    from triton_mla_sparse.testing import ptx_jit

    dev = torch.device("cuda")
    if ptx_jit.refusal(89, torch.cuda.get_device_capability(dev), hip=False) is not None:
        pytest.skip("this GPU does not run sm89 PTX")
    torch.zeros(1, device=dev)
    cuda = ctypes.CDLL("libcuda.so.1")

    def occupancy(kernel, threads: int, shared: int) -> int:
        blocks = ctypes.c_int()
        err = cuda.cuOccupancyMaxActiveBlocksPerMultiprocessor(
            ctypes.byref(blocks), ctypes.c_void_p(kernel.function), threads, ctypes.c_size_t(shared)
        )
        assert err == 0, err
        return blocks.value

    kernels = launch.launchable_kernels()
    hooks = list(knobs.runtime.kernel_load_end_hook.calls)
    pack = CUDABackend.__dict__["pack_metadata"]
    emu = ptx_jit.enable(89, reset=kernels, target_smem=True)
    try:
        ptx_jit.check_jit(emu, dev)
        case = Case("c", 2, 64, rows=2048, topk=128, kv_format="fp8_ds_mla", holes=True)
        assert run_case(case, dev, time_it=False).passed
        loaded = [k for kern in kernels for k in ptx_jit.loaded(kern)]
        built = [k for k in loaded if k.function is not None]  # launched, so loaded
        assert built
        assert {k.function for k in built} <= emu.occupancy_functions
        for k in built:
            num_warps, _, padded = k.packed_metadata
            threads = num_warps * 32
            want = ptx_jit.target_blocks_per_sm(89, k.metadata.shared, threads)
            assert padded >= k.metadata.shared
            assert occupancy(k, threads, padded) == min(
                want, occupancy(k, threads, k.metadata.shared)
            ), (k.name, k.metadata.shared, padded)
        # the sm89 path's 16-head fp8_ds_mla tile holds 76.5 KB: one block on an L40S's SM
        assert any(ptx_jit.target_blocks_per_sm(89, k.metadata.shared, 128) == 1 for k in built)
    finally:
        emu.disable()
    assert knobs.runtime.kernel_load_end_hook.calls == hooks
    assert CUDABackend.__dict__["pack_metadata"] is pack


@pytest.mark.skipif(
    not HAS_GPU or torch.version.hip is not None, reason="runs sm_8x PTX through the CUDA driver"
)
def test_emulated_targets_one_after_another_in_one_process():
    """bench --arch and benchmarks/perf/targets.py emulate several targets in one process: each
    emulation must build and run its own target's code (the probe and every sparse_mla kernel),
    not the binaries an earlier target left in the kernels' in-memory caches, and the kernels
    must pass the reference check under each."""
    from triton_mla_sparse.ops.sparse_mla import launch
    from triton_mla_sparse.ops.sparse_mla.heuristics import AMPERE_GLUON_CCS
    from triton_mla_sparse.testing import ptx_jit

    dev = torch.device("cuda")
    cap = torch.cuda.get_device_capability(dev)
    kernels = launch.launchable_kernels()
    ccs = [cc for cc in (80, 89, 86) if ptx_jit.refusal(cc, cap, hip=False) is None]
    if len(ccs) < 2:
        pytest.skip(f"this GPU (sm{cap[0]}{cap[1]}) runs fewer than two sm_8x targets by PTX JIT")
    case = Case("c", 2, 16, rows=2048, topk=128, kv_format="fp8_ds_mla", holes=True)
    for cc in ccs + ccs[:1]:  # and back to the first
        emu = ptx_jit.enable(cc, reset=kernels)
        try:
            ptx_jit.check_jit(emu, dev)
            res = run_case(case, dev, time_it=False)
            assert res.passed, (cc, res.err)
            built = [ptx_jit.describe(k) for kern in kernels for k in ptx_jit.loaded(kern)]
            assert built and all(b.is_ptx and b.target == f"sm_{cc}" for b in built), (cc, built)
            if cc in AMPERE_GLUON_CCS:  # the path's default there: the mma.sync kernel
                assert any("ampere_gluon" in b.name for b in built), (cc, built)
        finally:
            emu.disable()


@pytest.mark.skipif(
    not HAS_GPU or torch.version.hip is not None, reason="runs sm_8x PTX through the CUDA driver"
)
def test_host_sms_sizes_the_emulated_grids_for_this_gpu():
    """enable(host_sms=True): the heuristics see the target's compute capability with this
    GPU's multiprocessor count, and their split counts follow it (the sm80 path's fp8_ds_mla
    decode at 64 tokens x 16 heads: 3 splits for an A100's 108 SMs, 4 for an H100's 132);
    without it, the target's count; the kernels pass the reference check either way."""
    from triton_mla_sparse.ops.sparse_mla import launch
    from triton_mla_sparse.ops.sparse_mla.heuristics import choose_config, num_splits_for
    from triton_mla_sparse.ops.target import TARGETS, arch_of
    from triton_mla_sparse.testing import ptx_jit

    dev = torch.device("cuda")
    if ptx_jit.refusal(80, torch.cuda.get_device_capability(dev), hip=False) is not None:
        pytest.skip("this GPU does not run sm80 PTX")
    host = torch.cuda.get_device_properties(dev).multi_processor_count
    a100 = next(a for a in TARGETS if a.backend == "cuda" and a.cc == 80)
    kernels = launch.launchable_kernels()
    case = Case("c", 64, 16, rows=4096, topk=2048, kv_format="fp8_ds_mla", holes=True)
    for host_sms, sms in ((False, a100.num_sms), (True, host)):
        emu = ptx_jit.enable(80, reset=kernels, host_sms=host_sms)
        try:
            ptx_jit.check_jit(emu, dev)
            arch = arch_of(dev)
            assert (arch.cc, arch.num_sms, arch.smem_bytes) == (80, sms, a100.smem_bytes)
            assert emu.grid_sms == (host if host_sms else None)
            cfg = choose_config(64, 16, 2048, torch.bfloat16, "fp8_ds_mla", arch)
            assert cfg.num_splits == num_splits_for(64, 2048, cfg.block_n, sms, cfg.block_h)
            assert run_case(case, dev, time_it=False).passed
        finally:
            emu.disable()
    assert arch_of(dev).num_sms == host and arch_of(dev).cc != 80


def test_bench_arch_labels_every_row_and_the_json(monkeypatch, tmp_path, capsys):
    """The table, the JSON and the CSV of an emulated run name the path on every row, FlashMLA's
    column says native, and a kernel bigger than the target's shared memory fails its case.
    Test doubles stand in for the GPU work (the emulation, the ceilings, the checked and timed
    call): what is tested is the bookkeeping around them."""
    import triton_mla_sparse.bench as bench_mod
    import triton_mla_sparse.testing as testing
    from triton_mla_sparse.bench import Result
    from triton_mla_sparse.ops.target import TARGETS
    from triton_mla_sparse.testing import ptx_jit
    from triton_mla_sparse.testing.timing import Ceilings

    a100 = next(a for a in TARGETS if a.backend == "cuda" and a.cc == 80)
    emu = ptx_jit.Emulation(80, str(tmp_path), arch=a100)  # not enabled: nothing is patched
    monkeypatch.setattr(testing, "measure_ceilings", lambda d: Ceilings(1000.0, 100.0))
    monkeypatch.setattr(
        bench_cli, "environment", lambda: {"gpu": "GPU-X", "date": "d", "torch": "t", "triton": "t"}
    )
    monkeypatch.setattr(bench_cli, "environment_line", lambda env: "GPU-X (test double)")

    def fake_run_case(case, device, ceil, config=None, **kw):  # test double, fixed numbers
        big = case.heads == 64  # this case "compiles" a kernel past sm80's 163 KB
        emu.compiled.append(ptx_jit.Compiled("k", "sm_80", "mma.sync", 200_000 if big else 1, True))
        return Result(
            case.name,
            case.kv_format,
            "bfloat16",
            case.tokens,
            case.heads,
            2048,
            "h16 n32 w4 s2 k2",
            1e-3,
            True,
            us=10.0,
        )

    monkeypatch.setattr(bench_mod, "run_case", fake_run_case)
    js, cs = tmp_path / "b.json", tmp_path / "b.csv"
    args = build_parser().parse_args(
        [
            "bench",
            "--arch",
            "sm80",
            "--decode",
            "1",
            "--heads",
            "16,64",
            "--formats",
            "auto",
            "--no-prefill",
            "--json",
            str(js),
            "--csv",
            str(cs),
        ]
    )
    assert bench_cli._bench(args, torch.device("cpu"), emu) == 1  # the 64-head case fails
    out = capsys.readouterr().out
    table_rows = [x for x in out.splitlines() if x.startswith("sm80 by PTX JIT ")]
    assert len(table_rows) == 2 and "FAIL" in table_rows[1] and "FAIL" not in table_rows[0]
    assert "sm80 path by PTX JIT on GPU-X: not an sm80 GPU's times" in out
    assert "needs 195.3 KB of shared memory, sm80 has 163 KB" in out
    doc = json.loads(js.read_text())
    assert doc["environment"]["path"] == "sm80 path by PTX JIT on GPU-X"
    assert [r["path"] for r in doc["results"]] == ["sm80 path by PTX JIT on GPU-X"] * 2
    with open(cs) as f:
        assert {r["path"] for r in csv.DictReader(f)} == {"sm80 path by PTX JIT on GPU-X"}
