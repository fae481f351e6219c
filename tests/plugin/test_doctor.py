"""``triton-mla-sparse doctor`` against vLLM 0.33's own selection code, on CPU.

The expectations are computed here through vLLM's functions by a different route than the
doctor's (``CudaPlatform.get_attn_backend_cls`` with a hand-built selector config and the device
query monkeypatched, instead of ``get_attn_backend`` on a simulated platform), never copied from
a table: the model's config hook, the selection, and the cache format the chosen backend uses.
Each capability's first lines are compared with that expectation.
"""

from __future__ import annotations

import sys
import types
from pathlib import Path

import pytest
import torch
from conftest import require_vllm

require_vllm()
pytestmark = pytest.mark.vllm

from triton_mla_sparse.cli import doctor  # noqa: E402
from triton_mla_sparse.cli.doctor import models, report  # noqa: E402
from triton_mla_sparse.cli.doctor import simulation as sim_mod  # noqa: E402

CAPS = ((8, 0), (8, 6), (8, 9), (9, 0), (10, 0), (12, 0), (12, 1))
OURS = "triton_mla_sparse.vllm_plugin.backend.TritonMLASparseBackend"
MATRIX = [
    (m, tp, kv)
    for m in models.MODELS
    for tp in models.ALL_TP_SIZES
    for kv in models.ALL_KV_CACHE_DTYPES
]


@pytest.fixture(scope="module")
def cuda_mod():
    mp = pytest.MonkeyPatch()
    if sim_mod.NATIVE_EXT not in sys.modules:
        try:
            import vllm.platforms.cuda  # noqa: F401  (works as is where libcuda exists)
        except (ImportError, OSError):
            mp.setitem(sys.modules, sim_mod.NATIVE_EXT, types.ModuleType(sim_mod.NATIVE_EXT))
    if not torch.cuda.is_available() and sim_mod.CUTLASS_MLA not in sys.modules:
        mp.setitem(sys.modules, sim_mod.CUTLASS_MLA, sim_mod.cutlass_mla_stand_in())
    import vllm.platforms.cuda as mod

    import triton_mla_sparse.vllm_plugin as plugin
    from triton_mla_sparse.vllm_plugin.selection import uninstall_priority_wrapper

    assert plugin.register()
    try:
        yield mod
    finally:
        uninstall_priority_wrapper(mod)
        mp.undo()


def _simulation(cuda_mod, cap, plugin=None):
    plugin = plugin or sim_mod.plugin_status()
    return sim_mod.Simulation(
        cuda_mod, cap, have_gpu=torch.cuda.is_available(), plugin=plugin, simulated=True
    )


@pytest.fixture(scope="module")
def answers(cuda_mod):
    """cap -> (simulation, [(case, first line)]) for the --all matrix."""
    mp = pytest.MonkeyPatch()
    mp.delenv("TRITON_MLA_SPARSE_AUTOSELECT", raising=False)
    mp.delenv("TRITON_MLA_SPARSE_INDEXER", raising=False)
    out = {}
    try:
        for cap in CAPS:
            sim = _simulation(cuda_mod, cap)
            indexer = sim.indexer()
            cases = [sim.case(m, tp, kv) for m, tp, kv in MATRIX]
            out[cap] = (sim, [(c, report.first_line(c, cap, sim.plugin, indexer)) for c in cases])
        yield out
    finally:
        mp.undo()


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
    model_config = sim_mod.ModelConfigStandIn(model, tp)
    # 1. the model's hook (GLM-5's asks the current platform: CUDA, this capability)
    hooked = types.SimpleNamespace(
        model_config=model_config,
        cache_config=CacheConfig(cache_dtype=kv_flag),
        parallel_config=ParallelConfig(),
        speculative_config=None,
    )
    hook = MODELS_CONFIG_MAP.get(model.architecture)  # HY V4 has none
    if hook is not None:
        with monkeypatch.context() as m:
            m.setattr(plats, "_current_platform", platform())
            hook.verify_and_update_config(hooked)
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
    if model.sink:
        # HY V4's layer binds its backend itself after the selector's answer
        # (attention.py:560-641): its own code, on the platform at this capability
        cls = _hy_v4_bound(monkeypatch, platform, vcfg, kv, model.num_heads // tp, explicit) or cls
        path = f"{cls.__module__}.{cls.__qualname__}"
    # 3. the cache format the backend turns that dtype into
    return cls.get_name(), path == OURS, _canonicalize_sparse_mla_kv_cache_dtype(cls, kv)


def _hy_v4_bound(monkeypatch, platform, vcfg, kv, heads, explicit):
    """The backend HYV4MLAAttention._resolve_sink_backend binds (None: the sink is dropped)."""
    import vllm.platforms as plats
    from vllm.config import AttentionConfig, set_current_vllm_config
    from vllm.models.hy_v4.nvidia import attention as hy_attn
    from vllm.v1.attention.backends.registry import AttentionBackendEnum
    from vllm.v1.attention.selector import _cached_get_attn_backend

    layer = types.SimpleNamespace(
        kv_lora_rank=512, qk_rope_head_dim=64, is_sparse=True, num_local_heads=heads
    )
    vcfg.attention_config = AttentionConfig(
        backend=AttentionBackendEnum.CUSTOM if explicit else None
    )
    default_dtype = torch.get_default_dtype()
    _cached_get_attn_backend.cache_clear()
    with monkeypatch.context() as m:
        m.setattr(plats, "_current_platform", platform())
        m.setattr(hy_attn, "current_platform", platform())
        torch.set_default_dtype(torch.bfloat16)
        try:
            with set_current_vllm_config(vcfg):
                return hy_attn.HYV4MLAAttention._resolve_sink_backend(layer, kv)
        finally:
            torch.set_default_dtype(default_dtype)
            _cached_get_attn_backend.cache_clear()


@pytest.mark.parametrize("cap", CAPS, ids=lambda c: f"{c[0]}.{c[1]}")
def test_first_line_agrees_with_vllm_selection(cuda_mod, answers, monkeypatch, cap):
    """The backend each first line names is the one vLLM's selection returns there, and the
    flag it gives selects this plugin exactly where vLLM would serve it so."""
    _, cases = answers[cap]
    for case, line in cases:
        where = (case.model.label, case.tp, case.kv_flag, line)
        auto = _expected(cuda_mod, monkeypatch, cap, case.model, case.tp, case.kv_flag, False)
        explicit = _expected(cuda_mod, monkeypatch, cap, case.model, case.tp, case.kv_flag, True)
        assert (case.auto.backend, case.auto.ours, case.auto.cache_dtype) == auto, where
        assert (case.explicit.backend, case.explicit.ours, case.explicit.cache_dtype) == (
            explicit
        ), where
        named = report.selected_backend(line)
        assert named == ("CUSTOM" if auto[1] else auto[0]), where
        assert line.startswith(f"{case.model.label} TP{case.tp}, --kv-cache-dtype {case.kv_flag}, ")
        flag = "--attention-backend TRITON_MLA_SPARSE"
        if auto[1]:
            assert line.endswith("no flag needed") and flag not in line, where
        elif explicit[1]:
            assert flag in line, where
        # the doctor answers for the cache flag given: it never asks for another one
        assert "pass --kv-cache-dtype" not in line and "; pass --kv-cache" not in line


def test_sample_first_lines(answers):
    """What a user reads at each capability (one model each; the rest follow the same code)."""
    want = {
        (8, 0): "vLLM 0.33 selects TRITON_MLA_SPARSE (this plugin, bf16 cache); no flag needed",
        (8, 9): "vLLM 0.33 selects TRITON_MLA_SPARSE (this plugin, bf16 cache); no flag needed",
        (9, 0): "vLLM 0.33 selects FLASHMLA_SPARSE (vLLM's, bf16 cache",
        (12, 0): "vLLM 0.33 selects FLASHINFER_MLA_SPARSE_SM120 (vLLM's, fp8_ds_mla cache); this "
        "plugin only with --attention-backend TRITON_MLA_SPARSE (bf16 cache)",
        (12, 1): "pass --attention-backend TRITON_MLA_SPARSE (this plugin, bf16 cache): without it "
        "vLLM 0.33 selects FLASHINFER_MLA_SPARSE_SM120 (vLLM's, fp8_ds_mla cache), and its kernel "
        "livelocks on GB10",
    }
    for cap, text in want.items():
        line = next(
            x
            for c, x in answers[cap][1]
            if (c.model.label, c.tp, c.kv_flag) == ("GLM-5", 8, "auto")
        )
        assert line.startswith(f"GLM-5 TP8, --kv-cache-dtype auto, sm_{cap[0]}{cap[1]}: {text}"), (
            line
        )


def test_hy_v4_first_lines(answers, cuda_mod):
    """HY V4 binds a sink-capable backend itself: this plugin on SM80/86/89 and (ahead of
    FlashInfer, which has no sink) on SM12x; vLLM's sink-capable FLASHMLA_SPARSE subclass on
    SM90/100. Without automatic selection, SM120 keeps FlashInfer and the line says the sink is
    dropped."""
    ours = "vLLM 0.33 selects TRITON_MLA_SPARSE (this plugin, bf16 cache); no flag needed"
    want = {
        (8, 0): ours,
        (8, 6): ours,
        (8, 9): ours,
        (9, 0): "vLLM 0.33 selects FLASHMLA_SPARSE (vLLM's, bf16 cache",
        (10, 0): "vLLM 0.33 selects FLASHMLA_SPARSE (vLLM's, bf16 cache",
        (12, 0): ours,
        (12, 1): ours,
    }
    for cap, text in want.items():
        case, line = next(
            (c, x)
            for c, x in answers[cap][1]
            if (c.model.label, c.tp, c.kv_flag) == ("HY V4", 8, "auto")
        )
        assert line.startswith(f"HY V4 TP8, --kv-cache-dtype auto, sm_{cap[0]}{cap[1]}: {text}")
        assert not case.auto.sink_dropped and "sink dropped" not in line
        if cap >= (9, 0) and cap < (12, 0):
            assert "TRITON_MLA_SPARSE (bf16 cache)" in line  # the explicit flag still serves it
    plugin = sim_mod.PluginStatus(True, ("registered",), "TRITON_MLA_SPARSE", "", False)
    sim = _simulation(cuda_mod, (12, 0), plugin)
    case = sim.case(models.parse_model("hy-v4"), 8, "auto")
    line = report.first_line(case, (12, 0), plugin, sim.indexer())
    assert case.auto.sink_dropped and case.auto.backend == "FLASHINFER_MLA_SPARSE_SM120"
    assert "learnable sink dropped: not the trained model" in line
    assert "--attention-backend TRITON_MLA_SPARSE (bf16 cache)" in line
    assert case.explicit.ours and not case.explicit.sink_dropped


def test_hy_v4_dsa_path_is_its_own(cuda_mod, monkeypatch):
    """HY V4's DSA part lists only what its code reaches (not DeepSeek-V3.2's writers)."""
    monkeypatch.delenv("TRITON_MLA_SPARSE_INDEXER", raising=False)
    hy = models.parse_model("hy-v4")
    part = _simulation(cuda_mod, (8, 0)).indexer(model=hy)
    text = "\n".join(part.lines)
    assert "fp8_fp4_paged_mqa_logits" in text and "op_registry_oot.SparseAttnIndexer" in text
    assert "deepseek_v32" not in text and "concat_and_cache_mla" in text
    works, refused = _simulation(cuda_mod, (8, 0)).plugin_caches(hy, 8)
    assert {"auto", "bfloat16", "fp8", "fp8_ds_mla"} <= set(works)


def test_gb10_puts_the_consequence_and_the_flag_first(answers):
    for case, line in answers[(12, 1)][1]:
        if case.auto.backend == "FLASHINFER_MLA_SPARSE_SM120":
            head = f"{case.model.label} TP{case.tp}, --kv-cache-dtype {case.kv_flag}, sm_121: "
            assert line.startswith(head + "pass --attention-backend TRITON_MLA_SPARSE ("), line
            assert "livelocks" in line
    for _, line in answers[(12, 0)][1]:  # the same backend is fine on SM120
        assert "livelocks" not in line and not line.split(": ", 1)[1].startswith("pass ")


def test_deepseek_bfloat16_goes_through_vllm_rewrites(answers):
    # DeepSeek-V3.2's hook turns bfloat16 into auto before selection, so wherever a native
    # backend takes auto, an explicit bfloat16 does not get this plugin.
    for cap, (_, cases) in answers.items():
        by_key = {(c.model.label, c.tp, c.kv_flag): c for c, _ in cases}
        for (label, tp, kv), case in by_key.items():
            if label == "DeepSeek-V3.2" and kv == "bfloat16":
                assert case.kv_after_hook == "auto"
                assert "turns --kv-cache-dtype bfloat16 into auto" in case.hook_note
                twin = by_key[(label, tp, "auto")]
                assert (case.auto.backend, case.auto.cache_dtype) == (
                    twin.auto.backend,
                    twin.auto.cache_dtype,
                ), cap


def test_details_follow_the_first_line(answers):
    sim, cases = answers[(12, 0)]
    case = next(
        c for c, _ in cases if (c.model.label, c.tp, c.kv_flag) == ("DeepSeek-V3.2", 8, "bfloat16")
    )
    text = "\n".join(
        report.details(
            case, (12, 0), sim.plugin, sim.indexer(), sim.plugin_caches(case.model, 8), []
        )
    )
    assert "turns --kv-cache-dtype bfloat16 into auto for DeepSeek-V3.2" in text
    assert "automatic selection: FLASHINFER_MLA_SPARSE_SM120, kv cache fp8_ds_mla" in text
    assert "FLASHINFER_MLA_SPARSE_SM120 serves auto as fp8_ds_mla" in text
    assert "    FLASHINFER_MLA_SPARSE_SM120: valid, selected" in text
    assert "    TRITON_MLA_SPARSE (this plugin): valid, lower priority" in text
    assert "with --attention-backend TRITON_MLA_SPARSE: TRITON_MLA_SPARSE (this plugin)" in text
    # 61 layers x (656 + 132) B and x (1152 + 132) B: the arithmetic as printed
    assert "61 layers x (656 + 132 indexer) B = 48068 B" in text
    assert "61 layers x (1152 + 132 indexer) B = 78324 B" in text


def test_probe_rejections_are_flagged():
    choice = sim_mod.Choice(
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
    assert sim_mod.probe_rejected(choice) == ["FLASH_ATTN_MLA_SPARSE"]


def test_indexer_part_is_the_plugins_plan(cuda_mod, monkeypatch):
    from triton_mla_sparse.vllm_plugin.indexer_install import indexer_plan

    monkeypatch.delenv("TRITON_MLA_SPARSE_INDEXER", raising=False)
    for cap in CAPS:
        plan = indexer_plan(cap, {})
        part = _simulation(cuda_mod, cap).indexer()
        assert plan.reason in part.lines[0] and part.blockers == plan.blockers
        assert ("this plugin's Triton path" in part.lines[0]) == plan.install == (cap < (9, 0))
    # vLLM without the plugin (or with its indexer off): vLLM's own path and what stops it
    monkeypatch.setenv("TRITON_MLA_SPARSE_INDEXER", "off")
    part = _simulation(cuda_mod, (8, 0)).indexer()
    assert part.lines[0].startswith("indexer: vLLM's own (") and part.blockers
    assert any("DeepGEMM" in b for b in part.blockers)


def test_cache_refusals_say_why_without_guessing(cuda_mod, monkeypatch):
    """Below sm_80 the capability is the reason (no guess about TRITON_MLA_SPARSE_INDEXER);
    with the indexer path off on sm_80 the reason names the setting that was made."""
    monkeypatch.delenv("TRITON_MLA_SPARSE_INDEXER", raising=False)
    glm5 = models.parse_model("glm-5")
    works, refused = _simulation(cuda_mod, (7, 5)).plugin_caches(glm5, 8)
    assert works == [] and refused
    for why in refused.values():
        assert "TRITON_MLA_SPARSE_INDEXER" not in why
    assert "compute capability 7.5 not supported" in refused["auto"]
    works, refused = _simulation(cuda_mod, (8, 0)).plugin_caches(glm5, 8)
    assert {"auto", "bfloat16", "fp8", "fp8_e4m3", "fp8_ds_mla"} <= set(works)
    monkeypatch.setenv("TRITON_MLA_SPARSE_INDEXER", "off")
    works, refused = _simulation(cuda_mod, (8, 0)).plugin_caches(glm5, 8)
    assert set(refused) >= {"fp8", "fp8_e4m3", "fp8_ds_mla"}
    assert "TRITON_MLA_SPARSE_INDEXER=off" in refused["fp8_ds_mla"]


def test_vllm_own_member_of_that_name(cuda_mod, monkeypatch):
    """Should vLLM's enum gain TRITON_MLA_SPARSE, the doctor says so and gives the flag that
    still selects this plugin (CUSTOM)."""
    from vllm.v1.attention.backends import registry

    import triton_mla_sparse.vllm_plugin as plugin

    enum = registry.AttentionBackendEnum
    native = object.__new__(enum)
    native._name_, native._value_ = "TRITON_MLA_SPARSE", "vllm.somewhere.NativeBackend"
    monkeypatch.setitem(enum._member_map_, "TRITON_MLA_SPARSE", native)
    monkeypatch.setattr(plugin, "_state", {"done": False, "registered": False, "reason": ""})
    monkeypatch.setattr(registry, "_ATTN_OVERRIDES", {})
    status = sim_mod.plugin_status()
    assert status.active and status.flag == "CUSTOM"
    assert any(
        x.startswith("WARNING: vLLM's AttentionBackendEnum has its own") for x in status.lines
    )
    sim = _simulation(cuda_mod, (9, 0), status)
    case = sim.case(models.parse_model("glm-5"), 8, "auto")
    assert case.explicit.ours
    line = report.first_line(case, (9, 0), status, sim.indexer())
    assert line.endswith("this plugin only with --attention-backend CUSTOM (bf16 cache)"), line


# --- the whole command ---------------------------------------------------------------------


def test_doctor_command(cuda_mod, capsys, monkeypatch):
    monkeypatch.delenv("TRITON_MLA_SPARSE_AUTOSELECT", raising=False)
    argv = [
        "--capability",
        "sm_89",
        "--model",
        "glm-5",
        "--tp",
        "8",
        "--kv-cache-dtype",
        "bfloat16",
    ]
    assert doctor.doctor_main(argv) == 0
    captured = capsys.readouterr()
    lines = captured.out.splitlines()
    assert lines[0] == (
        "GLM-5 TP8, --kv-cache-dtype bfloat16, sm_89: vLLM 0.33 selects TRITON_MLA_SPARSE "
        "(this plugin, bf16 cache); no flag needed"
    )
    assert "Running vLLM" in captured.err  # progress goes to stderr, before the slow part
    out = captured.out
    assert "8 query heads per GPU" in out and "registered: yes" in out
    assert "automatic selection: on" in out
    assert "indexer: this plugin's Triton path" in out
    assert any(x.startswith("kernel on sm_89: ") for x in lines)
    assert "    TRITON_MLA_SPARSE (this plugin): valid, selected" in out


def test_doctor_all(cuda_mod, capsys, monkeypatch):
    monkeypatch.delenv("TRITON_MLA_SPARSE_AUTOSELECT", raising=False)
    assert doctor.doctor_main(["--capability", "9.0", "--all"]) == 0
    lines = capsys.readouterr().out.splitlines()
    first = lines[: lines.index("")]
    assert len(first) == len(MATRIX)
    assert all(report.selected_backend(x) == "FLASHMLA_SPARSE" for x in first)


def test_doctor_with_autoselect_off(cuda_mod, capsys, monkeypatch):
    from triton_mla_sparse.vllm_plugin.selection import install_priority_wrapper

    monkeypatch.setenv("TRITON_MLA_SPARSE_AUTOSELECT", "0")
    try:
        assert doctor.doctor_main(["--capability", "8.9", "--model", "glm-5"]) == 0
    finally:
        install_priority_wrapper(cuda_mod)
    out = capsys.readouterr().out
    assert out.splitlines()[0] == (
        "GLM-5 TP8, --kv-cache-dtype auto, sm_89: vLLM 0.33 finds no valid sparse MLA backend "
        "(serving fails); pass --attention-backend TRITON_MLA_SPARSE (bf16 cache)"
    )
    assert "automatic selection: off (TRITON_MLA_SPARSE_AUTOSELECT)" in out


def test_vllm_plugins_excluding_it(cuda_mod, monkeypatch):
    import vllm.envs as envs

    monkeypatch.setattr(envs, "VLLM_PLUGINS", ["other"], raising=False)
    monkeypatch.setenv("VLLM_PLUGINS", "other")
    status = sim_mod.plugin_status()
    assert not status.active and "excludes triton_mla_sparse" in status.lines[1]


def test_cited_vllm_lines():
    """Every vLLM file:line that docs/VLLM.md and the plugin cite says what they say (0.33.0)."""
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
    # the decode/prefill threshold the backend's builder takes (backend.py cites these)
    assert "{16: 128, 32: 128, 64: 256, 128: 256}" in lines(
        "v1/attention/backends/mla/flashattn_mla_sparse.py", 142, 142
    )
    flashmla = "v1/attention/backends/mla/flashmla_sparse.py"
    assert "family(100)" in lines(flashmla, 366, 366) and "{8: 128," in lines(flashmla, 367, 369)
    assert "{16: 128, 32: 128, 64: 256, 128: 256}" in lines(flashmla, 371, 371)
    assert "{8: 128," in lines("v1/attention/backends/mla/flashinfer_mla_sparse.py", 268, 270)
    so = next((root / "third_party" / "deep_gemm").glob("_C_extension*.so"))
    assert b"Unsupported architecture" in so.read_bytes()
