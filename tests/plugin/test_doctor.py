"""``triton-mla-sparse doctor`` against vLLM 0.33's own selection code, on CPU.

The expectations are computed here through vLLM's functions by a different route than the
doctor's (``CudaPlatform.get_attn_backend_cls`` with a hand-built selector config and the device
query monkeypatched, instead of ``get_attn_backend`` on a simulated platform), never copied from
a table: the model's config hook, the selection, and the cache format the chosen backend uses.
"""

from __future__ import annotations

import os
import subprocess
import sys
import types
from pathlib import Path

import pytest
import torch
from conftest import require_vllm

require_vllm()
pytestmark = pytest.mark.vllm

from triton_mla_sparse.cli import doctor  # noqa: E402

CAPS = ((8, 0), (8, 6), (8, 9), (9, 0), (10, 0), (12, 0), (12, 1))
NATIVE_EXT = "vllm._C_stable_libtorch"
CUTLASS_MLA = "vllm.v1.attention.backends.mla.cutlass_mla"
OURS = "triton_mla_sparse.vllm_plugin.backend.TritonMLASparseBackend"


@pytest.fixture(scope="module")
def cuda_mod():
    mp = pytest.MonkeyPatch()
    if NATIVE_EXT not in sys.modules:
        try:
            import vllm.platforms.cuda  # noqa: F401  (works as is where libcuda exists)
        except (ImportError, OSError):
            mp.setitem(sys.modules, NATIVE_EXT, types.ModuleType(NATIVE_EXT))
    if not torch.cuda.is_available() and CUTLASS_MLA not in sys.modules:
        mp.setitem(sys.modules, CUTLASS_MLA, doctor._cutlass_mla_stand_in())
    import vllm.platforms.cuda as mod

    import triton_mla_sparse.vllm_plugin as plugin
    from triton_mla_sparse.vllm_plugin.selection import uninstall_priority_wrapper

    assert plugin.register()
    try:
        yield mod
    finally:
        uninstall_priority_wrapper(mod)
        mp.undo()


@pytest.fixture(scope="module")
def reports(cuda_mod):
    mp = pytest.MonkeyPatch()
    mp.delenv("TRITON_MLA_SPARSE_AUTOSELECT", raising=False)
    try:
        yield {cap: doctor.diagnose(cuda_mod, cap, torch.cuda.is_available(), True) for cap in CAPS}
    finally:
        mp.undo()


# --- capability parsing --------------------------------------------------------------------


@pytest.mark.parametrize(
    "text,cap",
    [
        ("8.0", (8, 0)),
        ("80", (8, 0)),
        ("sm80", (8, 0)),
        ("sm_80", (8, 0)),
        ("SM_80", (8, 0)),
        (" 8.6 ", (8, 6)),
        ("89", (8, 9)),
        ("9.0", (9, 0)),
        ("sm_90", (9, 0)),
        ("10.0", (10, 0)),
        ("100", (10, 0)),
        ("12.0", (12, 0)),
        ("12.1", (12, 1)),
        ("121", (12, 1)),
        ("sm_121", (12, 1)),
        ("sm_90a", (9, 0)),
    ],
)
def test_parse_capability(text, cap):
    assert doctor.parse_capability(text) == cap


@pytest.mark.parametrize(
    "text",
    ["", "8", "8.", ".0", "sm", "sm_", "x86", "8.0.1", "1234", "8,0", "0.0", "sm_8x", "12.10"],
)
def test_parse_capability_refuses(text):
    with pytest.raises(ValueError, match="is not a compute capability"):
        doctor.parse_capability(text)


@pytest.mark.parametrize("text", ["bogus", "8.", "1234"])
def test_bad_capability_is_one_line_exit_2(text, capsys):
    from triton_mla_sparse.cli.main import main

    assert main(["doctor", "--capability", text]) == 2
    captured = capsys.readouterr()
    assert captured.out == ""
    assert captured.err.count("\n") == 1 and "Traceback" not in captured.err
    assert captured.err.startswith("triton-mla-sparse doctor: error: --capability")


def test_bad_capability_from_the_command_line():
    # The installed console script runs the same main(); python -m is its in-tree equivalent.
    src = Path(__file__).resolve().parents[2] / "src"
    proc = subprocess.run(
        [sys.executable, "-m", "triton_mla_sparse.cli.main", "doctor", "--capability", "sm_8x"],
        capture_output=True,
        text=True,
        env={**os.environ, "PYTHONPATH": str(src)},
        timeout=120,
    )
    assert proc.returncode == 2, proc.stderr
    assert proc.stderr.strip().count("\n") == 0 and "Traceback" not in proc.stderr
    assert "--capability 'sm_8x' is not a compute capability" in proc.stderr


# --- the expectation, through vLLM's own functions -----------------------------------------


def _expected(cuda_mod, monkeypatch, cap, model, tp, kv_flag, explicit):
    """(backend name or None, is ours, cache dtype) as vLLM 0.33 decides it."""
    import vllm.platforms as plats
    from vllm.config import (
        CacheConfig,
        DeviceConfig,
        ParallelConfig,
        VllmConfig,
        set_current_vllm_config,
    )
    from vllm.model_executor.layers.attention.mla_attention import (
        _canonicalize_sparse_mla_kv_cache_dtype,
    )
    from vllm.model_executor.models.config import MODELS_CONFIG_MAP
    from vllm.platforms.interface import DeviceCapability
    from vllm.utils.import_utils import resolve_obj_by_qualname
    from vllm.v1.attention.backends.registry import AttentionBackendEnum
    from vllm.v1.attention.selector import AttentionSelectorConfig

    from triton_mla_sparse.vllm_plugin.selection import install_priority_wrapper

    install_priority_wrapper(cuda_mod)
    platform = cuda_mod.CudaPlatform
    monkeypatch.setattr(
        platform,
        "get_device_capability",
        classmethod(lambda c, device_id=0: DeviceCapability(*cap)),
    )
    model_config = doctor._ModelConfigStandIn(model, tp)
    # 1. the model's hook (GLM-5's asks the current platform: CUDA, this capability)
    hooked = types.SimpleNamespace(
        model_config=model_config,
        cache_config=CacheConfig(cache_dtype=kv_flag),
        parallel_config=ParallelConfig(),
        speculative_config=None,
    )
    with monkeypatch.context() as m:
        m.setattr(plats, "_current_platform", platform())
        MODELS_CONFIG_MAP[model.architecture].verify_and_update_config(hooked)
    kv = hooked.cache_config.cache_dtype
    # 2. selection, as MLAAttention asks for it (no user block size: block_size None)
    selector = AttentionSelectorConfig(
        head_size=576,
        dtype=torch.bfloat16,
        kv_cache_dtype=kv,
        block_size=None,
        use_mla=True,
        use_sparse=True,
    )
    vcfg = VllmConfig(device_config=DeviceConfig(device="cpu"))
    vcfg.model_config = model_config
    with set_current_vllm_config(vcfg):
        try:
            path = platform.get_attn_backend_cls(
                AttentionBackendEnum.CUSTOM if explicit else None,
                selector,
                num_heads=model.num_heads // tp,
            )
        except ValueError:
            return None, False, kv
    cls = resolve_obj_by_qualname(path)
    # 3. the cache format the backend turns that dtype into
    return cls.get_name(), path == OURS, _canonicalize_sparse_mla_kv_cache_dtype(cls, kv)


@pytest.mark.parametrize("cap", CAPS, ids=lambda c: f"{c[0]}.{c[1]}")
def test_agrees_with_vllm_selection(cuda_mod, reports, monkeypatch, cap):
    report = reports[cap]
    assert len(report.cases) == len(doctor.MODELS) * len(doctor.TP_SIZES) * 3
    seen = set()
    for case in report.cases:
        model = next(m for m in doctor.MODELS if m.label == case.model)
        seen.add((case.model, case.kv_flag))
        for explicit, choice in ((False, case.auto), (True, case.explicit)):
            want = _expected(cuda_mod, monkeypatch, cap, model, case.tp, case.kv_flag, explicit)
            got = (choice.backend, choice.ours, choice.cache_dtype)
            assert got == want, (case.model, case.tp, case.kv_flag, explicit, choice.error)
    assert seen == {
        (m.label, kv) for m in doctor.MODELS for kv in ("auto", "bfloat16", "fp8_ds_mla")
    }


def test_deepseek_bfloat16_goes_through_vllm_rewrites(reports):
    # The bug this doctor fixes: DeepSeek-V3.2's hook turns bfloat16 into auto before selection,
    # so wherever a native backend takes auto, an explicit bfloat16 does not get this plugin.
    for cap, report in reports.items():
        for case in report.cases:
            if case.model == "DeepSeek-V3.2" and case.kv_flag == "bfloat16":
                assert case.kv_after_hook == "auto"
                assert "bfloat16 -> auto" in case.hook_note
                twin = next(
                    c
                    for c in report.cases
                    if (c.model, c.tp, c.kv_flag) == (case.model, case.tp, "auto")
                )
                assert (case.auto.backend, case.auto.cache_dtype) == (
                    twin.auto.backend,
                    twin.auto.cache_dtype,
                ), cap


# --- the text: summary first, the flag, no contradictions ----------------------------------


def _summary(lines):
    start = next(i for i, line in enumerate(lines) if line.startswith("Summary at"))
    end = lines.index("", start)
    return lines[start + 1 : end]


@pytest.mark.parametrize("cap", CAPS, ids=lambda c: f"{c[0]}.{c[1]}")
def test_summary_lines(reports, cap):
    report = reports[cap]
    lines = doctor.render(report)
    summary = _summary(lines)
    assert len(summary) == len(report.cases)
    for line, case in zip(summary, report.cases):
        assert line.startswith(f"  {case.model} TP{case.tp}, kv {case.kv_flag}: ")
        hooked = f"vLLM's {case.model} hook made the flag {case.kv_after_hook}"
        assert (hooked in line) == (case.kv_after_hook != case.kv_flag)
        kv_flag = "" if case.kv_flag == "auto" else f"--kv-cache-dtype {case.kv_flag}"
        if case.auto.ours:
            assert ": TRITON_MLA_SPARSE (this plugin), " in line
            assert (f"pass {kv_flag}" if kv_flag else "no flag needed") in line
            assert "--attention-backend" not in line
        elif case.auto.backend is not None:
            assert f": {case.auto.backend}, " in line
        else:
            assert "NO VALID BACKEND" in line
        if not case.auto.ours and case.explicit.ours:
            flags = " ".join(x for x in ("--attention-backend TRITON_MLA_SPARSE", kv_flag) if x)
            assert f"this plugin: pass {flags} (" in line
        if case.auto.backend is None and not case.explicit.ours:
            assert "vLLM fails" in line and "this plugin cannot serve it either: " in line
        else:
            assert ("serving blocked" in line) == bool(
                report.blockers or case.kv_flag in report.cache_blocked
            )
        assert line.count(doctor.cache_text(case.auto.cache_dtype)) >= (
            case.auto.backend is not None
        )
    text = "\n".join(lines)
    if report.blockers:
        assert "nothing else blocks serving here" not in text
    else:
        assert "still blocks serving" not in text
    # The details agree with the summary, case by case, and never call the chosen one
    # "lower priority".
    headers = [i for i, x in enumerate(lines) if x.startswith("  ") and " heads per GPU), " in x]
    assert len(headers) == len(report.cases)
    for case, i, j in zip(report.cases, headers, headers[1:] + [len(lines)]):
        block = "\n".join(lines[i:j])
        assert block.startswith(f"  {case.model} TP{case.tp} ({case.heads} heads per GPU)")
        name = "TRITON_MLA_SPARSE (this plugin)" if case.auto.ours else case.auto.backend
        if name is not None:
            assert f"    automatic: {name}, kv cache {case.auto.cache_dtype}" in block
            assert f"      {name}: valid, lower priority" not in block
            assert f"      {name}: rejected" not in block
        for other in case.auto.uncertain:
            assert f"      {other}: rejected: " in block
    for line, case in zip(summary, report.cases):
        assert ("may come first" in line) == bool(case.auto.uncertain)


def test_probe_rejections_are_flagged():
    choice = doctor.Choice(
        "FLASHMLA_SPARSE",
        False,
        "auto",
        candidates=[
            ("FLASH_ATTN_MLA_SPARSE", ["FlashAttention MLA not supported on this device"]),
            ("FLASHINFER_MLA_SPARSE_SM120", ["kv_cache_dtype not supported"]),
            ("FLASHMLA_SPARSE", []),
            ("FLASH_ATTN_MLA_SPARSE_FA4", ["ImportError: no extension"]),
        ],
    )
    assert doctor._probe_rejected(choice) == ["FLASH_ATTN_MLA_SPARSE"]


def test_indexer_part_from_vllm_code(reports):
    try:
        import triton_mla_sparse.vllm_plugin.indexer  # noqa: F401

        pytest.skip("this build has the indexer plan; its own tests cover it")
    except ImportError:
        pass
    for cap, report in reports.items():
        text = "\n".join(report.indexer + report.blockers)
        if cap[0] == 8:
            assert f"DeepGEMM has no sm{cap[0]}{cap[1]} kernels" in text
            assert "has_deep_gemm() is true (vLLM vendors DeepGEMM)" in text
            assert ("fused_q and fused_norm_rope" in text) == (cap < (8, 9))
            fp8_blocked = {"fp8", "fp8_e4m3", "fp8_ds_mla"} <= set(report.cache_blocked)
            assert fp8_blocked == (cap < (8, 9))
            assert {"auto", "bfloat16"} <= set(report.caches)
        else:
            assert report.blockers == [] and "support_deep_gemm() is true" in text


def test_indexer_part_from_the_plan(monkeypatch, cuda_mod):
    from dataclasses import dataclass

    @dataclass(frozen=True)
    class IndexerPlan:
        install: bool
        targets: tuple[str, ...]
        reason: str
        blockers: tuple[str, ...]

    calls = []

    def indexer_plan(capability, env=None):
        calls.append(capability)
        if capability[0] == 8:
            return IndexerPlan(True, ("a.fp8_fp4_mqa_logits",), "no DeepGEMM here", ("fp8 caches",))
        return IndexerPlan(False, (), "DeepGEMM here", ())

    fake = types.ModuleType("triton_mla_sparse.vllm_plugin.indexer")
    fake.indexer_plan = indexer_plan
    monkeypatch.setitem(sys.modules, fake.__name__, fake)
    lines, blockers, limits = doctor.indexer_lines(
        doctor.simulated_platform(cuda_mod, (8, 6)), (8, 6)
    )
    assert calls == [(8, 6)] and blockers == [] and limits == ["fp8 caches"]
    assert "this plugin's Triton fallback (no DeepGEMM here)" in lines[0]
    assert "a.fp8_fp4_mqa_logits" in lines[1]
    lines, blockers, limits = doctor.indexer_lines(
        doctor.simulated_platform(cuda_mod, (9, 0)), (9, 0)
    )
    assert blockers == [] and "vLLM's own DeepGEMM path (DeepGEMM here)" in lines[0]


def test_cited_vllm_lines():
    """Every file:line the doctor prints says what the doctor says it does (vLLM 0.33.0)."""
    import vllm

    root = Path(vllm.__file__).parent

    def lines(rel, a, b):
        return "\n".join((root / rel).read_text().splitlines()[a - 1 : b])

    assert "has_deep_gemm()" in lines("model_executor/layers/sparse_attn_indexer.py", 1060, 1064)
    assert "fp8_fp4_mqa_logits(" in lines("model_executor/layers/sparse_attn_indexer.py", 728, 728)
    assert "fp8_fp4_paged_mqa_logits(" in lines(
        "model_executor/layers/sparse_attn_indexer.py", 880, 880
    )
    block = lines("v1/attention/backends/mla/indexer.py", 1746, 1752)
    assert "has_deep_gemm()" in block and "get_paged_mqa_logits_metadata(" in block
    assert "def support_deep_gemm" in lines("platforms/cuda.py", 691, 697)
    kernels = "models/deepseek_v32/common/kernels.py"
    assert "tl.float8e4nv" in lines(kernels, 209, 209) and "tl.float8e4nv" in lines(
        kernels, 806, 806
    )
    assert "MLA_CACHE_DS_MLA" in lines(kernels, 355, 405) and "fp8_dtype" in lines(
        kernels, 355, 405
    )
    hook = lines("model_executor/models/config.py", 84, 86)
    assert '"bfloat16"' in hook and '"auto"' in hook
    assert "fp8_e4m3" in lines("model_executor/models/config.py", 95, 101)
    canon = lines("model_executor/layers/attention/mla_attention.py", 359, 376)
    assert "def _canonicalize_sparse_mla_kv_cache_dtype" in canon
    assert "FLASHINFER_MLA_SPARSE_SM120" in canon
    so = next((root / "third_party" / "deep_gemm").glob("_C_extension*.so"))
    assert b"Unsupported architecture" in so.read_bytes()


# --- the whole command ---------------------------------------------------------------------


def test_doctor_command(cuda_mod, capsys, monkeypatch):
    monkeypatch.delenv("TRITON_MLA_SPARSE_AUTOSELECT", raising=False)
    assert doctor.doctor_main(["--capability", "sm_89"]) == 0
    out = capsys.readouterr().out
    lines = out.splitlines()
    assert "vLLM: 0.33" in out and "registered: yes" in out
    assert "Importing vLLM's CUDA platform" in out  # said before the slow part
    assert "automatic selection: on" in out and "automatic selection off" not in out
    assert lines.index(next(x for x in lines if x.startswith("Summary at"))) < lines.index(
        next(x for x in lines if x.startswith("Details"))
    )
    summary = _summary(lines)
    assert len(summary) == 12
    assert all(": TRITON_MLA_SPARSE (this plugin), " in line for line in summary)


def test_doctor_with_autoselect_off(cuda_mod, capsys, monkeypatch):
    from triton_mla_sparse.vllm_plugin.selection import install_priority_wrapper

    monkeypatch.setenv("TRITON_MLA_SPARSE_AUTOSELECT", "0")
    try:
        assert doctor.doctor_main(["--capability", "8.9"]) == 0
    finally:
        install_priority_wrapper(cuda_mod)
    out = capsys.readouterr().out
    assert "automatic selection: off (TRITON_MLA_SPARSE_AUTOSELECT=0)" in out
    for line in _summary(out.splitlines()):
        assert "NO VALID BACKEND" in line
        assert "this plugin: pass --attention-backend TRITON_MLA_SPARSE" in line


def test_doctor_without_vllm(monkeypatch, capsys):
    from importlib import metadata

    def missing(name):
        raise metadata.PackageNotFoundError(name)

    monkeypatch.setattr(doctor.metadata, "version", missing)
    assert doctor.doctor_main([]) == 0
    assert "vLLM: not installed" in capsys.readouterr().out
