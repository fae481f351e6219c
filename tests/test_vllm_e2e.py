"""tools/vllm_e2e.py on CPU: everything but the engine.

The tiny configs against vLLM 0.33's own config parsing (``ModelConfig``) and each case's
``LLM`` arguments against ``EngineArgs.create_engine_config``; ``SamplingParams`` and the output
extraction against vLLM's classes; the dummy-weight hook through vLLM's ``DummyModelLoader``; the
comparison and tolerance logic on synthetic logprobs; the table; case selection; the stand-in
dist-info. The GPU run itself is ``python tools/vllm_e2e.py --out DIR`` (docs/VLLM.md).
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
import subprocess
import sys
from importlib import metadata
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "tools" / "vllm_e2e.py"
sys.path.insert(0, str(ROOT / "tools"))

import vllm_e2e as e2e  # noqa: E402

try:
    from conftest import require_vllm
except ImportError:  # a tests/conftest.py without it

    def require_vllm() -> None:
        try:
            metadata.version("vllm")
        except metadata.PackageNotFoundError:
            pytest.skip("vllm is not installed (CI installs vllm==0.33.0)")


if not torch.cuda.is_available() and "vllm" not in sys.modules:
    # as tests/plugin/conftest.py: vLLM's CPU platform, real Triton (this module may import
    # vLLM first when run alone)
    os.environ["CUDA_VISIBLE_DEVICES"] = ""
    os.environ.setdefault("VLLM_TARGET_DEVICE", "cpu")

# Every hf_config field vLLM 0.33's DSA model code reads (models/deepseek_v32/attention.py,
# nvidia/model.py, model_executor/models/deepseek_v2.py DeepseekV2MoE / ForCausalLM).
READ_BY_VLLM = (
    "hidden_size",
    "vocab_size",
    "num_hidden_layers",
    "num_attention_heads",
    "q_lora_rank",
    "kv_lora_rank",
    "qk_nope_head_dim",
    "qk_rope_head_dim",
    "v_head_dim",
    "rope_parameters",
    "rms_norm_eps",
    "index_topk",
    "index_n_heads",
    "index_head_dim",
    "first_k_dense_replace",
    "n_routed_experts",
    "n_shared_experts",
    "num_experts_per_tok",
    "moe_intermediate_size",
    "intermediate_size",
    "hidden_act",
    "norm_topk_prob",
    "topk_method",
    "scoring_func",
    "n_group",
    "topk_group",
    "routed_scaling_factor",
)


# ---------------------------------------------------------------------------------------------
# The config writer


@pytest.mark.parametrize("family", ["deepseek_v32", "glm5"])
def test_tiny_config_has_the_real_attention_geometry(tmp_path, family):
    cfg = e2e.write_tiny_config(tmp_path, family, 16, 3)
    assert json.loads((tmp_path / "config.json").read_text()) == cfg
    nope, v, idx = (128, 128, 64) if family == "deepseek_v32" else (192, 256, 32)
    assert cfg["kv_lora_rank"] + cfg["qk_rope_head_dim"] == 576
    assert (cfg["qk_nope_head_dim"], cfg["v_head_dim"], cfg["index_n_heads"]) == (nope, v, idx)
    assert (cfg["index_head_dim"], cfg["index_topk"]) == (128, 2048)
    assert cfg["num_attention_heads"] == 16 and cfg["num_hidden_layers"] == 3
    assert cfg["first_k_dense_replace"] == 1 and cfg["n_routed_experts"] == 8
    assert cfg["num_experts_per_tok"] == 2 and cfg["vocab_size"] == 4096
    assert cfg["torch_dtype"] == "bfloat16"
    assert cfg["max_position_embeddings"] >= 4096


def test_tiny_config_rejects_bad_arguments(tmp_path):
    with pytest.raises(ValueError, match="family"):
        e2e.write_tiny_config(tmp_path, "deepseek_v4", 16, 2)
    with pytest.raises(ValueError, match="num_layers"):
        e2e.write_tiny_config(tmp_path, "glm5", 16, 1)


@pytest.mark.parametrize("family", ["deepseek_v32", "glm5"])
def test_vllm_parses_the_tiny_config(tmp_path, family):
    require_vllm()
    from vllm.config import ModelConfig

    cfg = e2e.write_tiny_config(tmp_path, family, 16, 2)
    mc = ModelConfig(
        model=str(tmp_path),
        skip_tokenizer_init=True,
        trust_remote_code=False,
        max_model_len=4096,
        dtype="auto",
        seed=0,
    )
    assert mc.architectures == [e2e.FAMILIES[family].architecture]
    assert mc.dtype == torch.bfloat16
    assert mc.use_mla and mc.get_head_size() == 576
    hf = mc.hf_text_config
    assert hf.model_type == e2e.FAMILIES[family].model_type
    missing = [f for f in READ_BY_VLLM if not hasattr(hf, f)]
    assert not missing, f"vLLM reads {missing}"
    for key in ("index_topk", "index_n_heads", "qk_nope_head_dim", "v_head_dim", "q_lora_rank"):
        assert getattr(hf, key) == cfg[key]
    rope = hf.rope_parameters
    if family == "deepseek_v32":
        assert rope["rope_type"] == "yarn" and rope["factor"] == 40
        # no attention_factor: vLLM's DSA attention takes the deepseek_yarn branch (mscale^2)
        assert rope.get("attention_factor") is None
    else:
        assert rope["rope_type"] == "default"
        assert hf.indexer_rope_interleave is True


# ---------------------------------------------------------------------------------------------
# The arguments each case gives vLLM


def _spec(tmp_path, family, name, settings=None):
    settings = settings or e2e.Settings()
    cfg = e2e.write_tiny_config(tmp_path, family, e2e.FAMILIES[family].tp8_heads, 2)
    prompts = e2e.make_prompts(
        settings.prompt_lengths, settings.vocab_size, settings.seed, settings.shared_prefix
    )
    case = e2e.CASE_BY_NAME[name]
    heads = e2e.FAMILIES[family].tp8_heads
    return e2e._case_spec(family, heads, case, settings, tmp_path, prompts, cfg, None)


@pytest.mark.parametrize(
    "family, name, cache",
    [
        ("deepseek_v32", "plugin-fp8-reuse", "fp8_ds_mla"),
        ("deepseek_v32", "flashmla-bf16-mqa", "auto"),  # the V3.2 hook: bfloat16 -> auto
        ("glm5", "plugin-bf16-eager", "bfloat16"),
    ],
)
def test_engine_config_accepts_each_case(tmp_path, family, name, cache):
    require_vllm()
    from vllm.config import AttentionConfig
    from vllm.engine.arg_utils import EngineArgs
    from vllm.v1.attention.backends.registry import AttentionBackendEnum

    import triton_mla_sparse.vllm_plugin as plugin

    assert plugin.register()  # the alias TRITON_MLA_SPARSE -> CUSTOM, as in a case process
    spec = _spec(tmp_path, family, name)
    kw = e2e.llm_kwargs(spec)
    kw["attention_config"] = AttentionConfig(**kw["attention_config"])  # what LLM() does
    vc = EngineArgs(**kw).create_engine_config()
    case = e2e.CASE_BY_NAME[name]
    want = (
        AttentionBackendEnum.CUSTOM
        if case.backend == e2e.PLUGIN
        else AttentionBackendEnum[e2e.FLASHMLA]
    )
    assert vc.attention_config.backend == want
    assert vc.attention_config.sparse_mla_force_mqa == case.force_mqa
    assert vc.cache_config.cache_dtype == cache
    assert vc.model_config.enforce_eager == (not case.graphs)
    assert vc.load_config.load_format == "dummy"
    s = spec["settings"]
    if case.workload == "reuse":
        blocks = vc.cache_config.num_gpu_blocks_override
        assert blocks == e2e.reuse_pool_blocks(s["prompt_lengths"], s["max_tokens"], 4096)
        # one pass of the workload fits; three passes cannot all get fresh blocks
        assert blocks * e2e.BLOCK_SIZE < 2 * sum(n + s["max_tokens"] for n in s["prompt_lengths"])
    else:
        assert vc.cache_config.num_gpu_blocks_override is None


def test_sampling_params_and_prefix_cache_reads():
    require_vllm()
    from vllm import SamplingParams

    s = dataclasses.asdict(e2e.Settings())
    with_plp = SamplingParams(**e2e.sampling_kwargs(s, prompt_logprobs=True))
    without = SamplingParams(**e2e.sampling_kwargs(s, prompt_logprobs=False))
    assert with_plp.temperature == 0.0 and with_plp.logprobs == 5 and with_plp.ignore_eos
    # the prefix case's second pass must drop prompt logprobs, or vLLM skips the cache read
    assert with_plp.skip_reading_prefix_cache is True
    assert without.skip_reading_prefix_cache is False


def test_extract_reads_vllm_request_outputs():
    require_vllm()
    from vllm.logprobs import Logprob
    from vllm.outputs import CompletionOutput, RequestOutput
    from vllm.v1.metrics.stats import RequestStateStats

    prompt = [5, 6, 7]
    plps = [None, {6: Logprob(-1.5, 2), 9: Logprob(-0.5, 1)}, {7: Logprob(-2.0, 3)}]
    cont = [{11: Logprob(-0.1, 1), 12: Logprob(-2.3, 2)}, {13: Logprob(-0.2, 1)}]
    stats = RequestStateStats(num_generation_tokens=2, first_token_ts=10.0, last_token_ts=10.05)
    out = RequestOutput(
        request_id="0",
        prompt=None,
        prompt_token_ids=prompt,
        prompt_logprobs=plps,
        outputs=[CompletionOutput(0, "", [11, 13], None, cont)],
        finished=True,
        metrics=stats,
        num_cached_tokens=64,
    )
    (req,) = e2e._extract([out], [prompt])
    assert req["prompt_lps"] == [None, -1.5, -2.0]  # the prompt token's own logprob
    assert req["tokens"] == [11, 13]
    assert req["cont"][0] == [[11, -0.1], [12, -2.3]]
    assert req["num_cached_tokens"] == 64
    assert req["tpot_ms"] == pytest.approx(50.0)


def test_weight_hook_through_vllms_dummy_loader(tmp_path, monkeypatch):
    require_vllm()
    from vllm.config import VllmConfig, set_current_vllm_config
    from vllm.config.load import LoadConfig
    from vllm.model_executor.layers.layernorm import RMSNorm
    from vllm.model_executor.model_loader.dummy_loader import DummyModelLoader

    monkeypatch.setattr(DummyModelLoader, "load_weights", DummyModelLoader.load_weights)
    weights = tmp_path / "w.jsonl"
    monkeypatch.setenv(e2e.ENV_GAIN, "1.0")
    monkeypatch.setenv(e2e.ENV_SEED, "3")
    monkeypatch.setenv(e2e.ENV_WEIGHTS_FILE, str(weights))
    assert e2e.install_weight_hook() and e2e.install_weight_hook()  # idempotent
    with set_current_vllm_config(VllmConfig()):
        model = torch.nn.Module()
        model.proj = torch.nn.Linear(64, 32, bias=False, dtype=torch.bfloat16)
        model.norm = RMSNorm(32)
    DummyModelLoader(LoadConfig(load_format="dummy")).load_weights(model, None)
    w = model.proj.weight.float()
    assert w.abs().max() <= math.sqrt(3 / 64) + 1e-3 and w.abs().max() > 0.1  # not +-1e-3
    assert torch.equal(model.norm.weight, torch.ones(32))  # vLLM's dummy_weight_value kept
    (info,) = [json.loads(x) for x in weights.read_text().splitlines()]
    assert info["rescaled"] == 1 and info["sha256"] == e2e.weights_fingerprint(model)


def test_rescale_is_deterministic_and_keeps_vectors():
    def model():
        m = torch.nn.Module()
        m.a = torch.nn.Linear(48, 16, bias=True)
        m.b = torch.nn.Linear(48, 16, bias=False)  # same shape, other name: other values
        m.k_scale = torch.nn.Parameter(torch.ones(2, 2))
        with torch.no_grad():
            m.a.bias.zero_()
        return m

    m1, m2, m3 = model(), model(), model()
    for m, seed in ((m1, 1), (m2, 1), (m3, 2)):
        info = e2e.rescale_dummy_weights(m, 2.0, seed)
        assert info["rescaled"] == 2
    assert e2e.weights_fingerprint(m1) == e2e.weights_fingerprint(m2)
    assert e2e.weights_fingerprint(m1) != e2e.weights_fingerprint(m3)
    assert not torch.equal(m1.a.weight, m1.b.weight)
    assert torch.equal(m1.a.bias, torch.zeros(16)) and torch.equal(m1.k_scale, torch.ones(2, 2))
    assert m1.a.weight.abs().max() <= 2.0 * math.sqrt(3 / 48)


# ---------------------------------------------------------------------------------------------
# Comparison and tolerance on synthetic outputs


def _req(prompt_lps, tokens, margins=None, lp=-1.0):
    """A request as a case process records it; ``margins``: the top-1 margin per step."""
    margins = margins or [1.0] * len(tokens)
    cont = [[[t, lp], [t + 1, lp - m]] for t, m in zip(tokens, margins)]
    return {"prompt_lps": [None, *prompt_lps], "tokens": list(tokens), "cont": cont}


def test_identical_outputs_pass_bit_equal():
    ref = [_req([-1.0] * 100, [3, 4, 5])]
    agr = e2e.compare_requests(ref, json.loads(json.dumps(ref)), e2e.TOL)
    assert agr.bitwise and agr.prompt_n == 100 and agr.tok_agree == 3
    assert e2e.judge(agr, e2e.TOL, e2e.OUTLIER_FRACTION) == []


def test_small_noise_passes_and_a_systematic_shift_fails():
    ref = [_req([-1.0] * 200, [3, 4, 5])]
    noisy = [_req([-1.0 + 0.01 * (-1) ** i for i in range(200)], [3, 4, 5], lp=-1.01)]
    agr = e2e.compare_requests(ref, noisy, e2e.TOL)
    assert not agr.bitwise and agr.prompt_max == pytest.approx(0.01)
    assert e2e.judge(agr, e2e.TOL, e2e.OUTLIER_FRACTION) == []
    shifted = [_req([-1.2] * 200, [3, 4, 5], lp=-1.2)]
    reasons = e2e.judge(e2e.compare_requests(ref, shifted, e2e.TOL), e2e.TOL, 0.02)
    assert any("prompt logprobs" in r for r in reasons)
    assert any("continuation" in r for r in reasons)


def test_outlier_budget():
    ref = [_req([-1.0] * 200, [3])]
    few = [_req([-1.0] * 196 + [-3.0] * 4, [3])]  # 4 of 200 = 2 %: discrete flips
    many = [_req([-1.0] * 190 + [-3.0] * 10, [3])]  # 5 %: a class of positions
    assert e2e.judge(e2e.compare_requests(ref, few, e2e.TOL), e2e.TOL, 0.02) == []
    assert e2e.judge(e2e.compare_requests(ref, many, e2e.TOL), e2e.TOL, 0.02)


def test_non_finite_and_length_mismatch_always_fail():
    ref = [_req([-1.0] * 200, [3, 4])]
    nan = [_req([-1.0] * 199 + [math.nan], [3, 4])]
    reasons = e2e.judge(e2e.compare_requests(ref, nan, e2e.TOL), e2e.TOL, 0.02)
    assert any("non-finite" in r for r in reasons)
    short = [_req([-1.0] * 200, [3])]
    reasons = e2e.judge(e2e.compare_requests(ref, short, e2e.TOL), e2e.TOL, 0.02)
    assert any("length" in r for r in reasons)


def test_greedy_divergence_is_judged_by_the_reference_margin():
    # divergence at step 1 where the reference's top-1 margin is tiny: a tie, not an error;
    # the steps after it run on another context and are not compared
    ref = [_req([], [3, 4, 5, 6], margins=[1.0, 0.01, 1.0, 1.0])]
    tie = [_req([], [3, 9, 9, 9])]
    agr = e2e.compare_requests(ref, tie, e2e.TOL)
    assert (agr.tok_compared, agr.tok_agree, agr.tok_ties, agr.tok_hard) == (2, 1, 1, 0)
    assert agr.tok_unchecked == 2
    assert e2e.judge(agr, e2e.TOL, 0.02) == []
    # the same divergence where the reference was sure (margin 1.0 > tol): counts against it
    sure = [_req([], [3, 4, 5, 6])]
    agr = e2e.compare_requests(sure, tie, e2e.TOL)
    assert agr.tok_hard == 1
    assert e2e.judge(agr, e2e.TOL, 0.02)


def test_merge_agreements_sums_counts_and_keeps_maxima():
    a = e2e.Agreement(prompt_n=10, prompt_over=1, prompt_max=0.2, tok_compared=3)
    b = e2e.Agreement(prompt_n=5, prompt_max=0.1, tok_compared=2, bitwise=False)
    m = e2e.merge_agreements([a, b])
    assert (m.prompt_n, m.prompt_over, m.prompt_max, m.tok_compared) == (15, 1, 0.2, 5)
    assert m.bitwise is False


# ---------------------------------------------------------------------------------------------
# Cases, evaluation and the table


def test_quick_selection_closes_over_references():
    sel = e2e.select_cases(["deepseek_v32"], None, True, [])
    names = [c.name for _, _, c in sel]
    assert "plugin-bf16-sm80path" in names and "flashmla-bf16-tidx" in names
    assert all(h == 16 for _, h, _ in sel)
    assert "plugin-bf16-reuse" not in names
    # on a known GPU only the reference that runs there is added
    h200 = {c.name for _, _, c in e2e.select_cases(["glm5"], None, True, [], (9, 0))}
    a100 = {c.name for _, _, c in e2e.select_cases(["glm5"], None, True, [], (8, 0))}
    assert "plugin-fp8-eager" not in h200 and "plugin-fp8-eager" in a100
    assert len(h200) == 7
    one = e2e.select_cases(["glm5"], [64], False, ["glm5-h64/plugin-bf16-prefix"])
    assert {c.name for _, _, c in one} == {
        "plugin-bf16-prefix",
        "flashmla-bf16",
        "plugin-bf16-eager",
        "plugin-bf16",
    }


def test_skip_reasons_per_gpu():
    c = e2e.CASE_BY_NAME
    assert e2e.skip_reason(c["flashmla-bf16"], (8, 0))
    assert e2e.skip_reason(c["flashmla-bf16"], (9, 0)) is None
    assert e2e.skip_reason(c["plugin-bf16-sm80path"], (10, 0))
    assert e2e.skip_reason(c["plugin-bf16-sm80path"], (9, 0)) is None
    assert e2e.skip_reason(c["plugin-fp8"], None) is None


def _result(req, sha="w", plan=()):
    return {
        "status": "ok",
        "info": {"weights": {"sha256": sha}, "indexer_plan": list(plan)},
        "runs": {"main": {"requests": [req], "tpot_ms": 1.5}},
    }


def test_evaluate_rows_statuses_and_exit_decision():
    settings = e2e.Settings()
    sel = e2e.select_cases(["deepseek_v32"], None, False, ["plugin-bf16"])
    ids = {c.name: e2e.case_id(f, h, c.name) for f, h, c in sel}
    good = _req([-1.0] * 100, [3, 4])
    results = {ids[n]: _result(good) for n in ids}
    rows, recs, ok = e2e.evaluate(sel, results, {}, settings)
    assert ok
    statuses = {r["case"]: r["status"] for r in rows}
    assert statuses[ids["flashmla-bf16"]] == "REF"
    assert statuses[ids["plugin-bf16"]].startswith("PASS")
    # different weights: the comparison is meaningless and fails
    results[ids["plugin-bf16"]] = _result(good, sha="other")
    rows, recs, ok = e2e.evaluate(sel, results, {}, settings)
    assert not ok and any("different weights" in r["status"] for r in rows)
    # a failed case is an error row; its dependants report the failed reference
    results[ids["plugin-bf16"]] = {"status": "error", "error": "RuntimeError: boom"}
    rows, _, ok = e2e.evaluate(sel, results, {}, settings)
    assert not ok and any(r["status"].startswith("ERROR: RuntimeError") for r in rows)
    # no FlashMLA here: the plugin's graphs-off run is the reference
    skips = {ids["flashmla-bf16"]: "FLASHMLA_SPARSE needs SM90/SM100"}
    results = {ids[n]: _result(good) for n in ids}
    rows, _, ok = e2e.evaluate(sel, results, skips, settings)
    assert ok and any(r["vs"] == "plugin-bf16-eager" for r in rows)
    # the reverse comparison (graphs vs plugin-bf16) is not repeated; the case keeps a row
    (eager,) = [r for r in rows if r["case"] == ids["plugin-bf16-eager"]]
    assert eager["status"] == "REF" and eager["ms/tok"] == "1.50"
    table = e2e.format_table(rows)
    assert "SKIP: FLASHMLA_SPARSE needs SM90/SM100" in table
    assert table.splitlines()[0].split()[:5] == ["case", "backend", "cache", "graphs", "vs"]


def test_indexer_paths_that_differ_make_a_comparison_informational():
    settings = e2e.Settings()
    sel = e2e.select_cases(["deepseek_v32"], None, False, ["plugin-bf16"])
    ids = {c.name: e2e.case_id(f, h, c.name) for f, h, c in sel}
    ref, bad = _req([-1.0] * 100, [3]), _req([-2.0] * 100, [3])
    results = {ids[n]: _result(ref) for n in ids}
    results[ids["plugin-bf16"]] = _result(bad, plan=["some.target"])
    rows, _, ok = e2e.evaluate(sel, results, {}, settings)
    assert ok  # not gating
    assert any(r["status"].startswith("WARN") and "informational" in r["status"] for r in rows)


def test_table_row_formatting():
    agr = e2e.Agreement(prompt_n=7390, prompt_over=3, prompt_max=0.01234, cont_n=84)
    agr.cont_max, agr.tok_compared, agr.tok_agree, agr.tok_ties = 0.02, 84, 83, 1
    row = e2e.table_row(
        "x/plugin-bf16", e2e.PLUGIN, "bfloat16", True, "flashmla-bf16", agr, 2.345, "PASS"
    )
    assert row["backend"] == "plugin" and row["cache"] == "bf16" and row["graphs"] == "on"
    assert row["prompt max|dlp| (>tol/n)"] == "0.0123 (3/7390)"
    assert row["tokens agree"] == "83/84 t1" and row["ms/tok"] == "2.35"


# ---------------------------------------------------------------------------------------------
# The parent's plumbing


def test_stand_in_dist_infos_are_found_by_importlib_metadata(tmp_path):
    written = e2e.write_dist_infos(tmp_path, plugin=True, hooks=True, vllm_version="0.33.0")
    assert len(written) == 3
    code = (
        "import importlib.metadata as m, json; "
        "print(json.dumps([{e.name: e.value for e in m.entry_points(group='vllm.general_plugins')},"
        " m.version('vllm-e2e-hooks')]))"
    )
    env = {**os.environ, "PYTHONPATH": str(tmp_path)}
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True)
    eps, version = json.loads(out.stdout)
    assert eps[e2e.PLUGIN_EP_NAME] == e2e.PLUGIN_EP_VALUE
    assert eps[e2e.HOOK_EP_NAME] == e2e.HOOK_EP_VALUE
    assert version == "0.0"


def test_vllm_version_read_from_source(tmp_path):
    (tmp_path / "_version.py").write_text("__version__ = version = '0.33.0'\n")
    assert e2e._vllm_version_from_source([str(tmp_path)]) == "0.33.0"
    assert e2e._vllm_version_from_source([str(tmp_path / "nowhere")]) is None


def test_prompts_and_reuse_pool():
    s = e2e.Settings()
    p = e2e.make_prompts(s.prompt_lengths, s.vocab_size, s.seed, s.shared_prefix)
    assert [len(x) for x in p] == list(s.prompt_lengths)
    assert p == e2e.make_prompts(s.prompt_lengths, s.vocab_size, s.seed, s.shared_prefix)
    dst, src, n = s.shared_prefix
    assert p[dst][:n] == p[src][:n] and p[dst][n:] != p[src][n : len(p[dst])]
    assert max(s.prompt_lengths) > 2048  # past index_topk: the sparse selection drops tokens
    assert all(2 <= t < s.vocab_size for x in p for t in x)
    assert e2e.reuse_pool_blocks([64], 1, 4096) == 66  # max_model_len rules


def test_cli_list_and_no_gpu():
    out = subprocess.run(
        [sys.executable, str(SCRIPT), "--list", "--capability", "8.6"],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert out.returncode == 0, out.stderr
    assert "deepseek_v32-h16/plugin-bf16 " in out.stdout and "glm5-h8/plugin-fp8 " in out.stdout
    assert "[skip: FLASHMLA_SPARSE needs SM90/SM100]" in out.stdout
    bad = subprocess.run([sys.executable, str(SCRIPT)], capture_output=True, text=True)
    assert bad.returncode == 2 and "--out" in bad.stderr


def test_without_a_gpu_it_says_so_and_exits_2(tmp_path, monkeypatch, capsys):
    monkeypatch.setattr(e2e, "detect_gpu", lambda env: None)  # what torch reports on CPU
    assert e2e.main(["--out", str(tmp_path), "--quick"]) == 2
    assert "no CUDA GPU" in capsys.readouterr().err


def test_a_failing_case_process_reports_its_first_exception(tmp_path):
    # the real child entry point, made to fail before vLLM is imported (through --shim)
    shim = tmp_path / "shim.py"
    shim.write_text("raise RuntimeError('shim says no')\n")
    spec = {"id": "deepseek_v32-h16/plugin-bf16", "hash": "h", "indexer": "auto", "shim": str(shim)}
    spec["settings"] = {"weight_gain": 1.0, "seed": 0}
    args = e2e.parse_args(["--out", str(tmp_path)])
    res = e2e.run_child(spec, e2e.base_env(args), tmp_path, timeout=60)
    assert res["status"] == "error" and res["error"] == "RuntimeError: shim says no"
    assert "shim.py" in res["traceback_tail"]
    assert Path(res["log"]).read_text().count("shim says no") >= 1


def test_main_end_to_end_with_stand_in_case_processes(tmp_path, monkeypatch, capsys):
    calls = []

    def fake_run_child(spec, env, out, timeout):
        calls.append(spec["id"])
        assert env["VLLM_ENABLE_V1_MULTIPROCESSING"] == "0"
        assert str(ROOT / "src") in env["PYTHONPATH"].split(os.pathsep)
        req = _req([-1.0] * 50, [3, 4])
        res = {**_result(req), "case": spec["id"], "spec_hash": spec["hash"], "seconds": 1.0}
        (out / "cases").mkdir(exist_ok=True)
        (out / "cases" / (spec["id"].replace("/", "__") + ".json")).write_text(json.dumps(res))
        return res

    monkeypatch.setattr(e2e, "detect_gpu", lambda env: ("Fake H200", (9, 0)))
    probe = {"eps": {}, "vllm_dist": "0.33.0", "vllm_dir": ["x"], "tms": "y"}
    monkeypatch.setattr(e2e, "probe_env", lambda env: probe)
    monkeypatch.setattr(e2e, "run_child", fake_run_child)
    argv = ["--out", str(tmp_path), "--quick", "--family", "deepseek_v32"]
    assert e2e.main(argv) == 0
    assert len(calls) == 7
    summary = json.loads((tmp_path / "results.json").read_text())
    assert summary["ok"] and len(summary["cases"]) == 7
    assert any("triton_mla_sparse" in d for d in summary["stand_in_dist_infos"])  # no entry point
    assert json.loads((tmp_path / "models" / "deepseek_v32-h16-l2" / "config.json").read_text())
    assert "PASS" in capsys.readouterr().out
    # --resume: nothing runs again
    monkeypatch.setattr(e2e, "run_child", lambda *a: pytest.fail("ran a finished case"))
    assert e2e.main([*argv, "--resume"]) == 0


def test_time_budget_leaves_cases_for_resume(tmp_path, monkeypatch, capsys):
    calls = []

    def slow_child(spec, env, out, timeout):
        calls.append(spec["id"])
        res = {**_result(_req([-1.0] * 50, [3])), "spec_hash": spec["hash"], "seconds": 100.0}
        (out / "cases").mkdir(exist_ok=True)
        (out / "cases" / (spec["id"].replace("/", "__") + ".json")).write_text(json.dumps(res))
        return res

    monkeypatch.setattr(e2e, "detect_gpu", lambda env: ("Fake H200", (9, 0)))
    probe = {"eps": {"triton_mla_sparse": "x"}, "vllm_dist": "0.33.0", "vllm_dir": ["x"]}
    monkeypatch.setattr(e2e, "probe_env", lambda env: {**probe, "tms": "y"})
    monkeypatch.setattr(e2e, "run_child", slow_child)
    argv = ["--out", str(tmp_path), "--quick", "--family", "glm5"]
    # one case fits in 90 s; it took 100 s, so the next would not: the rest wait
    assert e2e.main([*argv, "--time-budget", "90"]) == 3
    assert len(calls) == 1 and "PENDING" in capsys.readouterr().out
    assert e2e.main([*argv, "--resume"]) == 0 and len(calls) == 7


# ---------------------------------------------------------------------------------------------
# The layer check (kernel vs float64 reference) and the split at the top-k


def _layer_inputs(fmt="auto", t=80, h=4, w=32, n=200, seed=0):
    """A kernel call's inputs as vLLM passes them: the (ql_nope, q_pe) tuple in bf16, a 2-D flat
    row cache, physical rows with the valid ones first (then -1) and per-token valid counts."""
    from triton_mla_sparse.kv_format import pack_fp8_ds_mla

    g = torch.Generator().manual_seed(seed)
    q = torch.randn(t, h, 576, generator=g).to(torch.bfloat16)
    vals = torch.randn(n, 576, generator=g)
    rows = pack_fp8_ds_mla(vals) if fmt == "fp8_ds_mla" else vals.to(torch.bfloat16)
    counts = torch.randint(0, w + 1, (t,), generator=g)
    counts[:3] = 0  # tokens with nothing to attend to
    idx = torch.full((t, w), -1, dtype=torch.int32)
    for i in range(t):
        idx[i, : counts[i]] = torch.randperm(n, generator=g)[: counts[i]].int()
    return (q[..., :512], q[..., 512:]), rows, idx, counts.int()


def _ref(q, rows, idx, counts, fmt, dtype=torch.float64):
    from triton_mla_sparse.reference import sparse_mla_reference

    qq = (q[0].to(dtype), q[1].to(dtype))
    return sparse_mla_reference(
        qq, rows, idx, 0.1, valid_counts=counts, kv_format=fmt, return_lse=True, compute_dtype=dtype
    )


@pytest.mark.parametrize("fmt", ["auto", "fp8_ds_mla"])
def test_layer_check_compare_exact_and_perturbed(fmt):
    q, rows, idx, counts = _layer_inputs(fmt)
    ref, ref_lse = _ref(q, rows, idx, counts, fmt)
    kw = dict(scale=0.1, kv_lora_rank=512, kv_format=fmt, is_decode=True)
    # the float64 reference itself as the kernel's output: error 0 (the check gathers only the
    # rows the sampled tokens select, which must not change the result)
    rec = e2e.layer_check_compare(q, rows, idx, counts, ref, ref_lse, **kw)
    assert rec["ok"] and rec["rel_err"] < 1e-12 and rec["max_abs_err"] < 1e-12
    assert rec["lse_err"] < 1e-5 and rec["nonfinite"] == 0
    assert rec["T"] == 80 and rec["H"] == 4 and rec["topk"] == 32 and rec["kv_format"] == fmt
    assert rec["is_decode"] and rec["empty_tokens"] >= 3 and rec["empty_max_abs"] == 0.0
    assert rec["tokens_with_valid"] > 64 and rec["tokens_checked"] == 64  # sampled
    # rounded to the model dtype: within bf16's tolerance
    rec = e2e.layer_check_compare(q, rows, idx, counts, ref.to(torch.bfloat16), None, **kw)
    assert rec["ok"] and 1e-5 < rec["rel_err"] < 5e-3 and rec["lse_err"] is None
    assert rec["rtol"] == 1e-2 and rec["out_dtype"] == "torch.bfloat16"
    # 3 % noise on every sampled and unsampled token: over the tolerance
    g = torch.Generator().manual_seed(1)
    bad = (ref + 0.03 * ref.std() * torch.randn(ref.shape, generator=g, dtype=ref.dtype)).to(
        torch.bfloat16
    )
    rec = e2e.layer_check_compare(q, rows, idx, counts, bad, None, **kw)
    assert not rec["ok"] and 2e-2 < rec["rel_err"] < 5e-2
    assert "relative error" in rec["reasons"][0]
    # a wrong LSE, and a non-finite output
    rec = e2e.layer_check_compare(q, rows, idx, counts, ref, ref_lse + 0.1, **kw)
    assert not rec["ok"] and abs(rec["lse_err"] - 0.1) < 1e-6
    nan = ref.clone()
    nan[5, 0, 0] = float("nan")
    rec = e2e.layer_check_compare(q, rows, idx, counts, nan, None, **kw)
    assert not rec["ok"] and rec["nonfinite"] == 1


def test_layer_check_wrapper_records_the_first_calls():
    q, rows, idx, counts = _layer_inputs(t=10)

    class FakeImpl:
        scale, kv_lora_rank, kv_format = 0.1, 512, "auto"

        def _forward_mqa_kernel(
            self, q, kv_cache, topk_indices, valid_counts, *, layer, block_size, is_decode
        ):
            out, _ = _ref(q, kv_cache, topk_indices, valid_counts, "auto", torch.float32)
            return out.to(torch.bfloat16), None

    sink: list = []
    state = e2e.install_layer_check(FakeImpl, 2, sink)
    impl, layer = FakeImpl(), type("L", (), {"layer_name": "model.layers.0.attn"})()
    call = dict(layer=layer, block_size=64, is_decode=False)
    impl._forward_mqa_kernel(q, rows, idx, counts, **call)  # not armed: engine start-up
    state["armed"] = True
    for _ in range(3):
        out, lse = impl._forward_mqa_kernel(q, rows, idx, counts, **call)
    assert out.shape == (10, 4, 512) and lse is None
    assert state["skipped_unarmed"] == 1 and state["errors"] == []
    assert len(sink) == 2 and all(r["ok"] for r in sink)
    assert sink[0]["layer"] == "model.layers.0.attn" and not sink[0]["is_decode"]
    cell, reasons = e2e.layer_check_summary({"enabled": True, "calls": sink})
    assert cell.endswith("PASS") and reasons == []


def test_layer_check_failure_fails_the_case():
    settings = e2e.Settings()
    sel = e2e.select_cases(["deepseek_v32"], None, False, ["plugin-bf16"])
    ids = {c.name: e2e.case_id(f, h, c.name) for f, h, c in sel}
    good = _req([-1.0] * 100, [3, 4])
    results = {ids[n]: _result(good) for n in ids}
    calls = [{"ok": True, "rel_err": 3e-3, "reasons": []}]
    results[ids["plugin-bf16"]]["info"]["layer_check"] = {"enabled": True, "calls": calls}
    rows, recs, ok = e2e.evaluate(sel, results, {}, settings)
    (row,) = [r for r in rows if r["case"] == ids["plugin-bf16"]]
    assert ok and row["kernel vs fp64"] == "3.00e-03 PASS" and row["status"].startswith("PASS")
    assert {r["kernel vs fp64"] for r in rows if r["case"] != ids["plugin-bf16"]} == {"-"}
    calls.append({"ok": False, "rel_err": 0.2, "reasons": ["relative error 0.2 > 0.01"]})
    rows, recs, ok = e2e.evaluate(sel, results, {}, settings)
    (row,) = [r for r in rows if r["case"] == ids["plugin-bf16"]]
    assert not ok and row["kernel vs fp64"] == "2.00e-01 FAIL"
    assert row["status"].startswith("FAIL: layer check: 1/2 kernel calls off")
    assert any(r["kind"] == "layer_check" and r["status"] == "fail" for r in recs)
    # enabled, but no call reached the wrapper: fails too
    results[ids["plugin-bf16"]]["info"]["layer_check"] = {"enabled": True, "calls": []}
    assert not e2e.evaluate(sel, results, {}, settings)[2]
    assert e2e.layer_check_summary({"enabled": False, "calls": []}) == ("-", [])


def test_over_tolerance_counts_split_at_the_top_k():
    n = 3000
    ref_lps = [-1.0] * (n - 1)
    got_lps = list(ref_lps)
    for i in (5, 100, 2048):  # sequence index i: context of i tokens fits in the top-k 2048
        got_lps[i - 1] -= 0.2
    for i in (2049, 2500, 2999):
        got_lps[i - 1] -= 0.2
    ref = [_req(ref_lps, [3, 4]), _req([-1.0] * 9, [3])]
    got = [_req(got_lps, [3, 4], lp=-1.3), _req([-1.0] * 9, [3], lp=-1.3)]
    agr = e2e.compare_requests(ref, got, e2e.TOL)
    assert agr.prompt_over == 6 and agr.prompt_n == n - 1 + 9
    assert agr.prompt_over_below_topk == 3 and agr.prompt_over_from_topk == 3
    assert agr.prompt_n_below_topk == 2048 + 9
    # continuation: the long request's tokens come past the top-k, the short one's below
    assert agr.cont_over == 3 and agr.cont_over_from_topk == 2 and agr.cont_over_below_topk == 1
    assert agr.cont_n_below_topk == 1
    merged = e2e.merge_agreements([agr, agr])
    assert merged.prompt_over_from_topk == 6 and merged.cont_over_below_topk == 2
    row = e2e.table_row("c", e2e.PLUGIN, "fp8_ds_mla", True, "flashmla-fp8", agr)
    assert row[">tol <|>= top-k"] == "4|5" and row["kernel vs fp64"] == "-"
