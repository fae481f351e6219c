"""benchmarks/perf/tune.py's e4m3 sweep on CPU: on each path without hardware fp8 (and with the
integer decode forced on one with it), every configuration it times is a plan the kernels run."""

from __future__ import annotations

import dataclasses
import json

import pytest
from conftest import load_script

from triton_mla_sparse.ops.sparse_mla.heuristics import (
    ampere_gluon_smem,
    choose_config,
    num_splits_for,
    split_len_for,
)
from triton_mla_sparse.ops.sparse_mla.plan import make_plan
from triton_mla_sparse.ops.target import TARGETS


def plan_of(case, cfg, arch, rope=64, **kw):
    """The launch plan of one swept configuration of ``case`` on ``arch`` (on a GPU); ``kw``:
    make_plan's other arguments (a sink, an extra set)."""
    return make_plan(
        num_tokens=case.tokens,
        num_heads=case.heads,
        latent=512,
        rope=rope,
        width=case.topk,
        dtype=case.dtype,
        kv_format=case.kv_format,
        arch=arch,
        on_gpu=True,
        page_size=64,
        config=cfg,
        **kw,
    )


@pytest.fixture(scope="module")
def tune():
    return load_script("benchmarks/perf/tune.py", "tms_tune_script")


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
            plan = plan_of(case, cfg, arch)
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
            plan = plan_of(case, cfg, arch)
            assert plan.constexprs["STAGE"] is cfg.stage_dequant


@pytest.mark.parametrize("cc", [80, 86, 89, 90, 100, 120])
def test_v4_sweep_plans_on_the_path(tune, monkeypatch, cc):
    """Every DeepSeek-V4 tile swept is a plan the kernels run on that path: head blocks within
    the path's limit, the heuristic's own tile among them, both staging forms where it stages,
    both MMA forms and the fp16 fold in every head block."""
    from triton_mla_sparse.ops.sparse_mla.heuristics import choose_config, max_block_h

    arch = next(a for a in TARGETS if a.backend == "cuda" and a.cc == cc)
    monkeypatch.setattr(tune, "arch_of", lambda device: arch)
    cases, configs = tune.SWEEPS["v4"]
    assert {c.kv_format for c in cases} == {"fp8_ds_mla_v4"}
    for case in cases:
        width = case.topk + case.extra_topk
        default = choose_config(case.tokens, case.heads, width, case.dtype, case.kv_format, arch)
        cfgs = configs(case)
        assert len(set(cfgs)) == len(cfgs)
        assert {c.fp16_mma for c in cfgs} == {True, False}
        blocks = {c.block_h for c in cfgs}
        assert {c.block_h for c in cfgs if c.fp16_fold} == blocks
        assert max(blocks) <= max_block_h(case.dtype, case.kv_format, arch) and 16 in blocks
        assert any(c.block_h == default.block_h and c.num_warps == default.num_warps for c in cfgs)
        assert any(c.stage_dequant for c in cfgs) == default.stage_dequant
        if default.stage_dequant:
            assert any(not c.stage_dequant for c in cfgs)
        for cfg in cfgs:
            plan = plan_of(
                case,
                cfg,
                arch,
                rope=0,
                has_counts=True,
                has_sink=True,
                extra_width=case.extra_topk,
                extra_page_size=64,
                extra_has_counts=True,
            )
            assert plan.constexprs["STAGE"] is cfg.stage_dequant
            assert plan.constexprs["MMA_FP16"] is cfg.fp16_mma
            assert plan.constexprs["FOLD_FP16"] is cfg.fp16_fold


def test_ds_mma_sweep_plans_on_sm90(tune, monkeypatch):
    """fp8_ds_mla's MMA-dtype sweep on sm90: the folded form (MMAs in q's dtype) staged or not,
    in 16-, 32- and 64-row steps; the fp16 form and the fp16 fold in 64-row steps with one and
    two stages, the fp16 fold in 32-row steps too, and in 32-head one-stage tiles."""
    arch = next(a for a in TARGETS if a.backend == "cuda" and a.cc == 90)
    monkeypatch.setattr(tune, "arch_of", lambda device: arch)
    cases, configs = tune.SWEEPS["ds-mma"]
    for case in cases:
        cfgs = configs(case)
        assert len(set(cfgs)) == len(cfgs)
        forms = {(False, False), (True, False), (True, True)}  # (fp16_mma, fp16_fold)
        for form in forms:
            long = {(c.block_n, c.num_stages) for c in cfgs if (c.fp16_mma, c.fp16_fold) == form}
            assert {(64, 1), (64, 2)} <= long
        assert all(c.block_n == 64 for c in cfgs if c.fp16_mma and not c.fp16_fold)
        assert any(c.fp16_fold and c.block_n == 32 for c in cfgs)
        pairs = [c for c in cfgs if c.block_h == 32]
        assert len(pairs) == (2 if case.heads > 32 else 0)
        assert all(c.fp16_fold and (c.block_n, c.num_stages) == (32, 1) for c in pairs)
        for cfg in cfgs:
            plan = plan_of(case, cfg, arch)
            assert plan.constexprs["STAGE"] is cfg.stage_dequant
            assert plan.constexprs["MMA_FP16"] is cfg.fp16_mma
            assert plan.constexprs["FOLD_FP16"] is cfg.fp16_fold


@pytest.mark.parametrize("max_seconds", [None, 1.0])
def test_max_seconds_stops_starting_configurations(
    tune, monkeypatch, tmp_path, capsys, max_seconds
):
    """With --max-seconds inside its reserve nothing starts, the count of what did not run is
    printed and tune.json holds no rows; without it every configuration of the case runs (the
    timing itself replaced, so this runs without a GPU)."""
    import argparse
    import dataclasses

    @dataclasses.dataclass
    class Ceilings:
        copy_gbps: float = 1.0
        matmul_tflops: float = 1.0

    @dataclasses.dataclass
    class Row:
        case: str
        kv_format: str
        config: str
        us: float = 1.0
        ratio: float = 1.0

    arch = next(a for a in TARGETS if a.backend == "cuda" and a.cc == 90)
    monkeypatch.setattr(tune, "arch_of", lambda device: arch)
    monkeypatch.setattr(tune, "measure_ceilings", lambda dev: Ceilings())
    monkeypatch.setattr(tune, "prepare", lambda case, dev: None)
    monkeypatch.setattr(
        tune,
        "run_case",
        lambda case, dev, ceil, config, prepared: Row(case.name, case.kv_format, str(config)),
    )
    args = argparse.Namespace(out=tmp_path, only="v4", tokens={128}, max_seconds=max_seconds)
    tune.sweep(args, None, "native")
    rows = json.loads((tmp_path / "tune.json").read_text())["rows"] if max_seconds is None else []
    (case,) = [c for c in tune.SWEEPS["v4"][0] if c.tokens == 128]
    expected = 1 + len(tune.SWEEPS["v4"][1](case))
    out = capsys.readouterr().out
    if max_seconds is None:
        assert len(rows) == expected and "not run" not in out
    else:
        assert not (tmp_path / "tune.json").exists()
        assert f"{expected} configurations not run" in out


def test_gluon_sweep_plans_on_sm90(tune, monkeypatch):
    """On sm90 every case times the Triton tile and each Gluon kernel of its format in the same
    tile and split count (fp8_ds_mla's alternating kernel in its own tile, at that split count
    and twice it), all plans the kernels run (the V4 record: rope 0, its extra set);
    bf16 rows at 8-16 heads the Triton tile the heuristics choose without Gluon and the
    warp-specialized kernel's padded 64-head tile."""
    from triton_mla_sparse.ops.sparse_mla.plan import GLUON_FAMILY

    arch = next(a for a in TARGETS if a.backend == "cuda" and a.cc == 90)
    monkeypatch.setattr(tune, "arch_of", lambda device: arch)
    cases, configs = tune.SWEEPS["gluon"]
    cases = cases + tune.SWEEPS["gluon-bf16"][0]
    assert tune.SWEEPS["gluon-bf16"][1] is configs
    for case in cases:
        cfgs = configs(case)
        if case.kv_format == "auto" and case.heads <= 16:
            # the heuristics' choice, then the warp-specialized kernel's padded 64-head tile at
            # one and two programs per SM
            ws = cfgs[1:]
            assert cfgs[0].gluon is None and {c.gluon for c in ws} == {"specialized"}
            assert {(c.block_h, c.block_n) for c in ws} == {(64, 64)}
            assert [c.num_splits for c in ws] == [ws[0].num_splits, 2 * ws[0].num_splits]
            for cfg in cfgs:
                assert plan_of(case, cfg, arch, rope=64).config.gluon == cfg.gluon
            continue
        assert cfgs[0].gluon is None and {c.gluon for c in cfgs[1:]} == {
            form for fmt, form in GLUON_FAMILY if fmt == case.kv_format and form != "ampere"
        }
        # fp8_ds_mla's alternating kernel in its own 64 x 32 tile, at the split count and twice
        alt = [c for c in cfgs if c.gluon == "alternating"]
        same = [c for c in cfgs if c.gluon != "alternating"]
        assert len({(c.block_h, c.block_n, c.num_splits) for c in same}) == 1
        assert {(c.block_h, c.block_n) for c in alt} <= {(64, 32)}
        splits = cfgs[0].num_splits
        assert [c.num_splits for c in alt] == ([splits, 2 * splits] if alt else [])
        v4 = case.kv_format == "fp8_ds_mla_v4"
        kw = dict(extra_width=case.extra_topk) if v4 and case.extra_topk else {}
        for cfg in cfgs:
            plan = plan_of(case, cfg, arch, rope=0 if v4 else 64, **kw)
            assert plan.config.gluon == cfg.gluon


@pytest.mark.parametrize("cc", [80, 89, 90])
def test_ampere_sweep_plans_on_the_path(tune, monkeypatch, cc):
    """Each case times the path's Triton tile, then the mma.sync Gluon kernel in the tiles that
    path's shared memory holds (on the 99 KB parts 16 heads, and 32 with fp8_ds_mla's one-slot
    ring), fp8_ds_mla's 16-head four-warp tiles with QK^T split over the latent and without,
    all plans the kernels run."""
    from triton_mla_sparse.ops.sparse_mla.plan import AMPERE_FAMILIES

    arch = next(a for a in TARGETS if a.backend == "cuda" and a.cc == cc)
    monkeypatch.setattr(tune, "arch_of", lambda device: arch)
    cases, configs = tune.SWEEPS["ampere"]
    for case in cases:
        cfgs = configs(case)
        assert cfgs[0].gluon is None and all(c.gluon == "ampere" for c in cfgs[1:])
        heads = {c.block_h for c in cfgs[1:]}
        if case.heads <= 16:
            assert heads == {16}, (cc, case)
        elif cc == 89:  # 99 KB: 32 heads in 16-row steps or one slot of 32, 64 not at all
            assert heads == {16, 32}, (cc, case)
            assert all(c.block_n == 16 or c.num_stages == 1 for c in cfgs[1:] if c.block_h == 32)
        else:
            assert heads == {16, 32, 64}, (cc, case)
        for c in cfgs[1:]:
            smem = ampere_gluon_smem(
                c.block_h,
                c.block_n,
                c.num_stages,
                case.kv_format,
                split_qk=c.split_qk,
                num_warps=c.num_warps,
            )
            assert smem <= arch.smem_bytes
        # both formats' 16-head four-warp tiles, split over the latent and not
        split = [c for c in cfgs if c.split_qk]
        assert split and all((c.block_h, c.num_warps) == (16, 4) for c in split), case
        assert all(dataclasses.replace(c, split_qk=False) in cfgs for c in split), case
        assert len(set(cfgs)) == len(cfgs), case  # each configuration timed once
        for cfg in cfgs:
            plan = plan_of(case, cfg, arch)
            assert (plan.family in AMPERE_FAMILIES) == (cfg.gluon == "ampere")
            if plan.family in AMPERE_FAMILIES:
                assert plan.constexprs["SPLIT_QK"] == cfg.split_qk


@pytest.mark.parametrize("cc", [80, 89])
def test_wide_tile_sweep_plans_on_the_sm80_and_sm89_paths(tune, monkeypatch, cc):
    """Each 64-128-head case times the path's default first, then the mma.sync kernel's 32- and
    64-head tiles that fit the path's shared memory (fp8_ds_mla with one raw-row slot, rows in
    q's dtype with two), the eight-warp 32-head tile also under a 128-register cap, each a plan
    that runs."""
    from triton_mla_sparse.ops.sparse_mla.plan import AMPERE_FAMILIES

    arch = next(a for a in TARGETS if a.backend == "cuda" and a.cc == cc)
    monkeypatch.setattr(tune, "arch_of", lambda device: arch)
    cases, configs = tune.SWEEPS["ampere-wide"]
    assert {c.heads for c in cases} == {64, 128} and {c.tokens for c in cases} == {64, 128}
    for case in cases:
        cfgs = configs(case)
        assert cfgs[0] == choose_config(
            case.tokens, case.heads, case.topk, case.dtype, case.kv_format, arch
        )
        rest = cfgs[1:]
        assert len(set(cfgs)) == len(cfgs)
        ring = 1 if case.kv_format == "fp8_ds_mla" else 2
        for c in rest:
            assert c.gluon == "ampere" and c.num_stages == ring and c.block_h in (32, 64)
            smem = ampere_gluon_smem(
                c.block_h, c.block_n, ring, case.kv_format, num_warps=c.num_warps
            )
            assert smem <= arch.smem_bytes
            assert c.max_registers in (None, 128)
            assert c.max_registers is None or (c.block_h, c.num_warps) == (32, 8)
        if case.kv_format == "fp8_ds_mla":  # 32 heads in one slot fit both paths
            capped = [c for c in rest if c.max_registers == 128]
            assert capped and (32, 8) in {(c.block_h, c.num_warps) for c in rest}
        if cc == 89:  # 99 KB: no 64-head tile
            assert all(c.block_h == 32 for c in rest)
        for cfg in cfgs:
            plan = plan_of(case, cfg, arch)
            assert (plan.family in AMPERE_FAMILIES) == (cfg.gluon == "ampere")
            assert plan.config.max_registers == cfg.max_registers


def test_register_cap_sweep_plans_on_sm90(tune, monkeypatch):
    """Each case times sm90's default first, then the mma.sync kernel's 16-head tiles, uncapped
    and under the caps that raise their programs per multiprocessor, each a plan that runs."""
    from triton_mla_sparse.ops.sparse_mla.plan import AMPERE_FAMILIES

    arch = next(a for a in TARGETS if a.backend == "cuda" and a.cc == 90)
    monkeypatch.setattr(tune, "arch_of", lambda device: arch)
    cases, configs = tune.SWEEPS["ampere-regs"]
    for case in cases:
        cfgs = configs(case)
        assert cfgs[0] == choose_config(
            case.tokens, case.heads, case.topk, case.dtype, case.kv_format, arch
        )
        rest = cfgs[1:]
        assert rest and all(c.gluon == "ampere" and c.block_h == 16 for c in rest)
        assert {c.max_registers for c in rest} == {None, 168, 128}
        qr = [c for c in rest if c.q_rope_in_registers]
        if case.kv_format == "fp8_ds_mla":  # the 32-row tile, three programs per multiprocessor
            assert qr and all((c.block_n, c.max_registers) == (32, 168) for c in qr)
            # the heuristics' split count, one and a half times it (a grid with a third
            # program per multiprocessor) and twice it
            k = min(c.num_splits for c in qr)
            assert sorted(c.num_splits for c in qr) == sorted({k, (3 * k + 1) // 2, 2 * k})
            assert 3 * (ampere_gluon_smem(16, 32, 1, q_rope_in_registers=True) + 1024) <= (
                228 * 1024
            )
        else:
            assert not qr
        split = [c for c in rest if c.split_qk]
        if case.kv_format == "fp8_ds_mla":  # the split 32-row tile at 168: three programs too
            assert split and {(c.block_n, c.max_registers) for c in split} <= {
                (32, 168),
                (32, None),
            }
            capped = [c for c in split if c.max_registers == 168]
            k = num_splits_for(case.tokens, case.topk, 32, arch.num_sms, 16)
            assert sorted(c.num_splits for c in capped) == sorted({k, (3 * k + 1) // 2, 2 * k})
            # uncapped at the same counts (the one the default runs is the default itself)
            uncapped = {c.num_splits for c in split if c.max_registers is None}
            assert uncapped | ({k} if cfgs[0].split_qk else set()) == {c.num_splits for c in capped}
            assert 3 * (ampere_gluon_smem(16, 32, 1, split_qk=True) + 1024) <= 228 * 1024
        else:
            assert not split
        assert len(set(rest)) == len(rest) and cfgs[0] not in rest
        for cfg in cfgs:
            plan = plan_of(case, cfg, arch)
            assert (plan.family in AMPERE_FAMILIES) == (cfg.gluon == "ampere")
            assert plan.config.max_registers == cfg.max_registers


@pytest.mark.parametrize(
    "flag,sweep", [("--target-smem", "ampere-wide"), ("--host-sms", "ds-split")]
)
def test_emulation_options_need_a_path(tune, monkeypatch, capsys, tmp_path, flag, sweep):
    """--target-smem (the emulated target's shared memory per multiprocessor) and --host-sms
    (its grids sized for this GPU): without --arch there is no target, and the script says so
    before touching a GPU."""
    monkeypatch.setattr("sys.argv", ["tune.py", "--only", sweep, flag, "--out", str(tmp_path)])
    with pytest.raises(SystemExit) as exc:
        tune.main()
    assert exc.value.code == 2
    assert f"{flag} applies to a target's path: give --arch too" in capsys.readouterr().err


@pytest.mark.parametrize("flag", ["--target-smem", "--host-sms"])
def test_profile_cases_emulation_options_need_a_path(monkeypatch, capsys, flag):
    """profile_cases.py's --target-smem and --host-sms, like tune.py's, are refused without
    --arch, before any GPU work."""
    prof = load_script("benchmarks/perf/profile_cases.py", "tms_profile_cases_script")
    monkeypatch.setattr("sys.argv", ["profile_cases.py", flag])
    with pytest.raises(SystemExit) as exc:
        prof.main()
    assert exc.value.code == 2
    assert f"{flag} applies to a target's path: give --arch too" in capsys.readouterr().err


@pytest.mark.parametrize("cc", [80, 89, 90])
def test_splits_sweep_varies_the_split_count_alone(tune, monkeypatch, cc):
    """The splits sweep: the path's default first, then the same tile at other split counts
    (as the launch runs them, none twice), every one a plan the kernels run."""
    arch = dataclasses.replace(
        next(a for a in TARGETS if a.backend == "cuda" and a.cc == cc), num_sms=132
    )
    monkeypatch.setattr(tune, "arch_of", lambda device: arch)
    cases, configs = tune.SWEEPS["splits"]
    assert {(c.tokens, c.heads) for c in cases} >= {(1, 8), (4, 16), (32, 128)}
    for case in cases:
        cfgs = configs(case)
        default = choose_config(
            case.tokens, case.heads, case.topk, case.dtype, case.kv_format, arch
        )
        assert cfgs[0] == default
        counts = [split_len_for(case.topk, c.num_splits, c.block_n)[1] for c in cfgs]
        assert len(set(counts)) == len(counts) and len(cfgs) >= 2
        for cfg in cfgs[1:]:
            assert dataclasses.replace(cfg, num_splits=default.num_splits) == default
            plan_of(case, cfg, arch)


@pytest.mark.parametrize("cc", [80, 89])
def test_offsets_32_sweep_alternates_on_the_mma_sync_defaults(tune, monkeypatch, cc):
    """Where the path's default is an mma.sync kernel, the offsets32 sweep times the same tile
    with the row offsets' width flipped, then the default and the variant again (after the
    sweep's own default row), each a plan the kernels run with ROW_OFFSETS_32 as asked; where the
    default is a Triton kernel it times nothing more."""
    from triton_mla_sparse.ops.sparse_mla.plan import AMPERE_FAMILIES

    arch = next(a for a in TARGETS if a.backend == "cuda" and a.cc == cc)
    monkeypatch.setattr(tune, "arch_of", lambda device: arch)
    cases, configs = tune.SWEEPS["offsets32"]
    timed = 0
    for case in cases:
        default = choose_config(
            case.tokens, case.heads, case.topk, case.dtype, case.kv_format, arch
        )
        cfgs = configs(case)
        if default.gluon != "ampere":
            assert cfgs == [], case
            continue
        timed += 1
        other = dataclasses.replace(default, row_offsets_32=not default.row_offsets_32)
        assert cfgs == [other, default, other], case
        for cfg in (default, other):
            plan = plan_of(case, cfg, arch, cache_span=case.rows * 656)
            assert plan.family in AMPERE_FAMILIES
            assert plan.constexprs["ROW_OFFSETS_32"] == cfg.row_offsets_32
    assert timed >= 6, cc  # both formats at 16 heads, fp8_ds_mla at 64-128 on either path
