"""benchmarks/perf/targets.py on CPU: its plan (grid, paths, order, targets per row), its
arguments, and the bookkeeping of a run (budget, refused paths, ratios, check marks, the table
and the JSON) with test doubles standing in for everything a GPU does."""

from __future__ import annotations

import contextlib
import json

import pytest
import torch
from conftest import load_script


@pytest.fixture(scope="module")
def targets():
    return load_script("benchmarks/perf/targets.py", "tms_targets_script")


def test_the_grid_is_the_target_grid(targets):
    runs = targets.plan_runs(list(targets.PATH_BY_NAME), native_cc=90)
    assert len(runs) == len(set(runs))
    # 4 token counts x 4 head counts decode + 2 prefills, per format: 2 formats on three paths,
    # fp8_ds_mla alone on the three forced e4m3 decodes; DeepSeek-V4's 4 decodes x 64 heads on
    # the three paths
    per_format = 4 * 4 + 2
    assert len(runs) == per_format * (2 * 3 + 3) + 4 * 3
    v4 = [r for r in runs if r.kv_format == "fp8_ds_mla_v4"]
    assert {(r.path, r.kind, r.heads) for r in v4} == {
        (p, "decode", 64) for p in ("native", "sm80", "sm89")
    }
    assert sorted(r.tokens for r in v4 if r.path == "native") == [1, 16, 64, 128]
    shapes = {(r.kind, r.tokens, r.heads) for r in runs}
    assert shapes == {("decode", t, h) for t in (1, 16, 64, 128) for h in (8, 16, 64, 128)} | {
        ("prefill", 4096, 64),
        ("prefill", 4096, 128),
    }
    forced = {"sm80-scalar", "sm80-packed", "sm80-packed-nomask"}
    assert {r.kv_format for r in runs if r.path in forced} == {"fp8_ds_mla"}


def test_rows_with_targets_run_first(targets):
    runs = targets.plan_runs(["native", "sm80"], native_cc=90)
    flags = [bool(targets.targets_of(r, 90)) for r in runs]
    assert flags == sorted(flags, reverse=True) and any(flags) and not all(flags)


def test_targets_per_row(targets):
    Run = targets.Run

    def texts(run, cc=90):
        return [t.text() for t in targets.targets_of(run, cc)]

    assert texts(Run("sm80", "auto", "decode", 128, 16)) == ["<= 1.25x floor"]
    assert texts(Run("sm89", "auto", "decode", 64, 128)) == ["<= 2x floor"]
    assert texts(Run("sm80-packed", "fp8_ds_mla", "decode", 64, 8)) == ["<= 1.6x floor"]
    assert texts(Run("sm89", "fp8_ds_mla", "decode", 128, 64)) == ["<= 2.5x floor"]
    assert texts(Run("sm80", "auto", "decode", 16, 16)) == []  # 64-128 tokens only
    assert texts(Run("sm80", "auto", "prefill", 4096, 64)) == [">= 250 TFLOP/s"]
    assert texts(Run("sm89", "fp8_ds_mla", "prefill", 4096, 64)) == [">= 150 TFLOP/s"]
    assert texts(Run("sm80", "auto", "prefill", 4096, 128)) == []
    assert texts(Run("native", "auto", "decode", 1, 8)) == ["<= 1x FlashMLA"]
    assert texts(Run("native", "fp8_ds_mla", "decode", 16, 16)) == ["<= 0.9x FlashMLA"]
    assert texts(Run("native", "fp8_ds_mla", "decode", 128, 128)) == ["<= 1.25x FlashMLA"]
    assert texts(Run("native", "auto", "prefill", 4096, 128)) == [">= 400 TFLOP/s"]
    assert texts(Run("native", "fp8_ds_mla", "prefill", 4096, 64)) == []
    assert texts(Run("native", "fp8_ds_mla_v4", "decode", 128, 64)) == ["<= 1.5x FlashMLA"]
    assert texts(Run("sm80", "fp8_ds_mla_v4", "decode", 128, 64)) == []
    # the sm90 targets are the native path's only on an sm90 GPU
    assert texts(Run("native", "auto", "decode", 1, 8), cc=100) == []


def test_target_verdicts(targets):
    floor = targets.Target(("sm80",), "auto", "decode", (64,), (8,), "x_floor", 1.25)
    assert floor.met({"x_floor": 1.25}) is True and floor.met({"x_floor": 1.3}) is False
    assert floor.met({"x_floor": None}) is None
    rate = targets.Target(("sm80",), "auto", "prefill", (4096,), (64,), "tflops", 250.0)
    assert rate.met({"tflops": 251.0}) is True and rate.met({"tflops": 249.0}) is False
    peer = targets.Target(("native",), "auto", "decode", (1,), (8,), "x_flashmla", 1.0)
    assert peer.met({"x_flashmla": None}) is None and peer.met({"x_flashmla": 0.9}) is True


@pytest.mark.parametrize(
    "argv,words",
    [
        ([], ["--out DIR is required"]),
        (["--out", "d", "--paths", "sm75"], ["sm75", "sm80-packed-nomask"]),
        (["--out", "d", "--max-seconds", "30"], ["--max-seconds", "reserve"]),
    ],
)
def test_arguments(targets, capsys, argv, words):
    with pytest.raises(SystemExit) as info:
        targets.parse(argv)
    assert info.value.code == 2
    err = capsys.readouterr().err
    for w in words:
        assert w in err


def test_list_needs_no_gpu(targets, capsys):
    assert targets.main(["--list", "--paths", "sm80-packed"]) == 0
    out = capsys.readouterr().out.strip().splitlines()
    assert out[-1].startswith("18 runs")
    assert all(x.startswith("sm80-packed ") for x in out[:-1])


def test_a_run_end_to_end_with_test_doubles(targets, monkeypatch, tmp_path):
    """execute -> judge -> format_table with fake timings (test doubles, never in the script):
    FlashMLA's native µs beside the emulated rows of the same shape, ratios and check marks,
    a refused path listed as skipped, the budget honoured, the table last in the log."""
    import triton_mla_sparse.testing as testing
    from triton_mla_sparse.testing import ptx_jit
    from triton_mla_sparse.testing.timing import Ceilings

    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda *a: (9, 0))
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda *a: "GPU-X")
    monkeypatch.setattr(testing, "measure_ceilings", lambda d: Ceilings(4000.0, 700.0))

    asked = set()

    class FakeEmulation:  # test double: what execute reads of an emulation
        grid_sms = 132  # as ptx_jit.Emulation's with host_sms on a 132-SM GPU

    @contextlib.contextmanager
    def fake_path_context(path, device, target_smem=False, host_sms=False):  # no emulation
        asked.add((target_smem, host_sms))
        if path.name == "sm89":
            raise ptx_jit.EmulationUnavailable("driver too old (test double)")
        yield None if path.cc is None else FakeEmulation()

    def fake_runner(run, device, ceilings, fmla, emu):  # test double: fixed fake numbers
        us = 100.0 if run.path == "native" else 150.0
        row = {
            "path": run.path,
            "kv_format": run.kv_format,
            "kind": run.kind,
            "tokens": run.tokens,
            "heads": run.heads,
            "config": "h16 n32 w4 s2 k2",
            "err": 1e-3,
            "passed": True,
            "us": us,
            "floor_us": 100.0,
            "x_floor": us / 100.0,
            "tflops": 300.0,
        }
        peer = {"us": 125.0} if run.path == "native" else None
        return row, peer

    monkeypatch.setattr(targets, "path_context", fake_path_context)
    ticks = iter(range(10**6))  # test double: a clock that advances 1 s each time it is read
    args = targets.parse(
        ["--out", str(tmp_path), "--paths", "native,sm80,sm89", "--target-smem", "--host-sms"]
    )
    # two reads a run: the rows with targets (56 runs natively and on sm80) fit, not all others
    args.max_seconds = targets.RESERVE_S + 130
    doc = targets.execute(
        args, torch.device("cpu"), fake_runner, lambda s: None, lambda: float(next(ticks))
    )
    ran = {(r["path"], r["kind"], r["tokens"], r["heads"], r["kv_format"]) for r in doc["rows"]}
    why = {s["why"] for s in doc["skipped"]}
    assert any("sm89 cannot run here: driver too old" in w for w in why)
    assert "time budget" in why
    assert len(ran) + len(doc["skipped"]) == (36 + 4) * 3
    native = [r for r in doc["rows"] if r["path"] == "native"]
    sm80 = [r for r in doc["rows"] if r["path"] == "sm80"]
    assert native and sm80
    assert all(r["label"] == "sm90 (native)" for r in native)
    assert all(r["label"] == "sm80 by PTX JIT on GPU-X" for r in sm80)
    # FlashMLA measured natively stands beside the emulated rows of the same shape
    assert all(r["x_flashmla"] == pytest.approx(0.8) for r in native)
    row = next(r for r in sm80 if (r["kind"], r["tokens"], r["heads"]) == ("decode", 128, 16))
    assert row["x_flashmla"] == pytest.approx(1.2)
    assert row["targets"] == [{"text": "<= 1.25x floor", "met": False}]  # 1.5x the floor
    prefill = next(r for r in native if (r["kind"], r["kv_format"]) == ("prefill", "auto"))
    assert prefill["targets"] == [{"text": ">= 400 TFLOP/s", "met": False}]
    fast = next(r for r in native if (r["kind"], r["tokens"], r["heads"]) == ("decode", 1, 8))
    assert all(t["met"] is True for t in fast["targets"])  # 0.8x FlashMLA
    text = targets.format_table(doc)
    assert "<= 1.25x floor ✗" in text and "<= 1x FlashMLA ✓" in text
    assert "sm89 cannot run here" in text and "not an A100's or L40S's times" in text
    assert "grids sized for its 132 multiprocessors (--host-sms)" in text
    json.dumps(doc, default=str)  # what main writes
    # --target-smem and --host-sms reached every path's emulation and the document
    assert asked == {(True, True)} and doc["environment"]["target_smem"] is True
    assert doc["environment"]["host_sms"] is True and doc["environment"]["grid_sms"] == 132
