"""benchmarks/perf/compare_trees.py on CPU: arguments, rounds merged per case, the comparison."""

from __future__ import annotations

import pytest
from conftest import ROOT, load_script


@pytest.fixture(scope="module")
def ct():
    return load_script("benchmarks/perf/compare_trees.py", "tms_compare_trees")


def row(case, us, passed=True, config="h16 n32 w4 s2 k2 +st", path="native"):
    return {
        "path": path,
        "kv_format": "fp8_ds_mla",
        "dtype": "bfloat16",
        "case": case,
        "us": us,
        "passed": passed,
        "config": config,
    }


def test_arguments(ct, tmp_path, capsys):
    args = ct.parse([str(ROOT / "src"), "--out", str(tmp_path), "--", "--decode", "64"])
    assert args.bench_args == ["--decode", "64"] and args.rounds == 1
    for argv, words in (
        ([str(tmp_path), "--out", "d"], ["no triton_mla_sparse package"]),
        ([str(ROOT / "src"), "--out", "d", "--rounds", "0"], ["--rounds"]),
        ([str(ROOT / "src"), "--out", "d", "--", "--json", "x"], ["--json"]),
    ):
        with pytest.raises(SystemExit):
            ct.parse(argv)
        err = capsys.readouterr().err
        assert all(w in err for w in words), err


def test_rounds_keep_the_fastest_and_any_failure(ct):
    docs = [
        {"results": [row("decode 64 x 16", 90.0), row("decode 1 x 16", 9.0)]},
        {"results": [row("decode 64 x 16", 86.0), row("decode 1 x 16", 8.0, passed=False)]},
    ]
    best = ct.merge_rounds(docs)
    assert best[("native", "fp8_ds_mla", "bfloat16", "decode 64 x 16")]["us"] == 86.0
    one = best[("native", "fp8_ds_mla", "bfloat16", "decode 1 x 16")]
    assert one["us"] == 8.0 and not one["passed"]


def test_comparison_ratios_and_missing_cases(ct):
    base = ct.merge_rounds([{"results": [row("a", 100.0), row("b", 10.0)]}])
    this = ct.merge_rounds(
        [{"results": [row("a", 85.0, config="h16 n32 w4 s2 k2"), row("c", 5.0)]}]
    )
    rows = {r["case"]: r for r in ct.compare(base, this)}
    assert rows["a"]["ratio"] == pytest.approx(0.85) and rows["a"]["passed"]
    assert rows["a"]["this_config"] == "h16 n32 w4 s2 k2"
    assert rows["b"]["this_us"] is None and not rows["b"]["passed"]  # missing under this tree
    assert rows["c"]["base_us"] is None and not rows["c"]["passed"]
    text = ct.render(list(rows.values()))
    assert "0.850" in text and text.count("FAILED or missing") == 2
