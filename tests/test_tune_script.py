"""benchmarks/perf/tune.py's e4m3 sweep on CPU: on each path without hardware fp8 (and with the
integer decode forced on one with it), every configuration it times is a plan the kernels run."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import pytest

from triton_mla_sparse.ops.sparse_mla.plan import make_plan
from triton_mla_sparse.ops.target import TARGETS

SCRIPT = Path(__file__).resolve().parents[1] / "benchmarks" / "perf" / "tune.py"


@pytest.fixture(scope="module")
def tune():
    spec = importlib.util.spec_from_file_location("tms_tune_script", SCRIPT)
    mod = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = mod
    spec.loader.exec_module(mod)
    return mod


@pytest.mark.parametrize("cc", [80, 86, 90])
def test_e4m3_sweep_plans_on_the_path(tune, monkeypatch, cc):
    arch = next(a for a in TARGETS if a.backend == "cuda" and a.cc == cc)
    monkeypatch.setattr(tune, "arch_of", lambda device: arch)
    cases, configs = tune.SWEEPS["e4m3"]
    seen = set()
    for case in cases:
        cfgs = configs(case)
        forms = [c.e4m3_decode for c in cfgs]
        seen.update(forms)
        # packed-nomask only where the tiles are staged (sm80/sm90 fp8_ds_mla, never fp8)
        assert ("packed-nomask" in forms) == (cfgs[0].stage_dequant and case.kv_format != "fp8")
        for cfg in cfgs:
            plan = make_plan(
                num_tokens=case.tokens,
                num_heads=case.heads,
                latent=512,
                rope=64,
                width=case.topk,
                dtype=case.dtype,
                kv_format=case.kv_format,
                arch=arch,
                on_gpu=True,
                page_size=64,
                config=cfg,
            )
            assert plan.constexprs["FP8_NATIVE"] is False
    assert {"scalar", "packed"} <= seen


@pytest.mark.parametrize("cc", [80, 86, 89, 90, 100, 120])
def test_stage_sweep_plans_on_the_path(tune, monkeypatch, cc):
    """Both forms of every case are plans the kernels run, the path's own tiles otherwise."""
    arch = next(a for a in TARGETS if a.backend == "cuda" and a.cc == cc)
    monkeypatch.setattr(tune, "arch_of", lambda device: arch)
    cases, configs = tune.SWEEPS["stage"]
    for case in cases:
        staged, plain = configs(case)
        assert staged.stage_dequant and not plain.stage_dequant
        assert staged.block_h == plain.block_h and staged.num_splits == plain.num_splits
        for cfg in (staged, plain):
            plan = make_plan(
                num_tokens=case.tokens,
                num_heads=case.heads,
                latent=512,
                rope=64,
                width=case.topk,
                dtype=case.dtype,
                kv_format=case.kv_format,
                arch=arch,
                on_gpu=True,
                page_size=64,
                config=cfg,
            )
            assert plan.constexprs["STAGE"] is cfg.stage_dequant
