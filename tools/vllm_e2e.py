"""End-to-end check of the TRITON_MLA_SPARSE backend inside vLLM 0.33's offline ``LLM``.

On a machine with a CUDA GPU, vLLM 0.33 and this checkout (the package need not be installed:
the checkout's ``src/`` goes first on the children's ``PYTHONPATH``)::

    python tools/vllm_e2e.py --out DIR                      # every case, both model families
    python tools/vllm_e2e.py --quick --out DIR              # fewer cases, shorter continuations
    python tools/vllm_e2e.py --list [--capability 9.0]      # the cases, and which would run here
    python tools/vllm_e2e.py --cases 'plugin-fp8*' --family glm5 --out DIR
    python tools/vllm_e2e.py --vllm SITE --triton SITE --out DIR --resume   # vLLM / Triton 3.8
                                                            # from unpacked wheels; skip cases
                                                            # already done in DIR
    python tools/vllm_e2e.py --out DIR --resume --time-budget 540   # in slices (exit 3 until
                                                            # every case has run)

What it runs. A tiny random-weight DeepSeek-V3.2 (``deepseek_v32``) and GLM-5 (``glm_moe_dsa``)
with the real attention geometry (kv_lora_rank 512, rope 64, nope 128 / 192, v 128 / 256, the
lightning indexer's 64 / 32 heads x 128 and index_topk 2048), few layers, small experts and a
4096-token vocabulary (:func:`write_tiny_config`), loaded with ``load_format="dummy"``. Each case
is one fresh subprocess (engine teardown between cases is unreliable) that builds ``LLM`` with
the case's attention backend, KV-cache dtype, CUDA graphs on or off, DSA indexer path and
workload, and records prompt logprobs, greedy continuations with their top logprobs, and timing.

What it compares. Per-token logprobs of the prompts (``prompt_logprobs``) and of the greedy
continuation against a reference case: vLLM's own FLASHMLA_SPARSE (SM90/SM100) on the same GPU
with the same indexer path and cache dtype (fp8_ds_mla against fp8_ds_mla), otherwise the
plugin's own graphs-off run; also CUDA graphs on against off for the same backend, and the
prefix-cache and block-reuse runs against the plain run. Greedy tokens are compared up to the
first divergence; a divergence counts against the case only where the reference's top-1 margin
exceeds the tolerance (``TOL``; below it the two kernels legitimately break a near-tie apart).
Why ``TOL`` and ``OUTLIER_FRACTION`` have their values: see their comments. Positions over the
tolerance are also counted apart below and past ``index_topk`` (``INDEX_TOPK``).

The layer check (plugin cases; ``--no-layer-check`` turns it off). End-to-end logprobs cannot
tell a wrong kernel from one that rounds differently, so the case process wraps the plugin impl's
``_forward_mqa_kernel`` and, for the first ``--layer-check-calls`` calls of the workload (after
the engine's start-up; calls during CUDA-graph capture are skipped and replayed graphs never reach
Python), recomputes the call with ``sparse_mla_reference`` in float64 on the GPU on the same
inputs (at most 64 sampled tokens with a valid index; only the cache rows they select). Each
call's errors go to ``info.layer_check``; a relative Frobenius error or an LSE error over the
package's tolerance for the output dtype (``triton_mla_sparse.testing``; bf16: 1e-2 each) or a
non-finite output fails the case (column "kernel vs fp64"). ``--layer-check-reference`` checks
vLLM's own backend the same way (FLASHMLA_SPARSE's ``forward_mqa``, on the physical rows vLLM
converts its top-k into), so that when the two disagree end to end the column says which one is
off the float64 reference.

The dummy weights are vLLM's dummy loader's, redrawn per tensor as U(-a, a) with
a = gain * sqrt(3 / fan_in) from a seed and the tensor's name (:func:`rescale_dummy_weights`).
vLLM's own fill (+-1e-3, the same values for every tensor of a shape, norm weights 1) would leave
attention scores near 0 (uniform attention: a kernel that mis-weights keys would not show) and
logits with a std of ~0.02 (greedy tokens decided by noise); estimated from the fan-ins, not
measured. Every run records a SHA-256 of the weights right after loading; a comparison between
runs whose weights differ fails.

Output: one row per case and comparison in a table printed last, ``DIR/results.json`` (every
summary), ``DIR/cases/<case>.json`` (a case's raw outputs), ``DIR/logs/<case>.log``,
``DIR/models/`` (the configs) and ``DIR/site/`` (the stand-in dist-infos, if any). Exit
status 0 only if every gating comparison passed and no case failed; 1 otherwise; 2 without a
CUDA GPU; 3 if ``--time-budget`` left cases for a later ``--resume``.
The time per output token is the mean decode time between a request's first and last token
(vLLM's request stats) in a run after an identical warm-up run; with a handful of requests
it says whether a path is grossly slow, not how fast it serves.

Environment for GPU machines whose Python lacks vLLM's pins (torch 2.14, Triton 3.8): ``--vllm``
and ``--triton`` put folders first on the children's ``PYTHONPATH``; ``--shim FILE`` runs a
Python file in each case process before vLLM is imported (not in processes vLLM itself spawns
with ``--multiproc``). vLLM loads plugins through entry
points, which a package only on ``PYTHONPATH`` lacks: the script then writes a stand-in
``*.dist-info`` (``--register-entry-point`` forces it) and also calls ``register()`` itself.
The engine runs in-process (``VLLM_ENABLE_V1_MULTIPROCESSING=0``) unless ``--multiproc``.
"""

from __future__ import annotations

import argparse
import dataclasses
import fnmatch
import hashlib
import json
import math
import os
import random
import re
import shutil
import subprocess
import sys
import time
import traceback
import zlib
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Any, NoReturn

ROOT = Path(__file__).resolve().parents[1]
TOOLS = Path(__file__).resolve().parent

PLUGIN = "TRITON_MLA_SPARSE"
FLASHMLA = "FLASHMLA_SPARSE"
PLUGIN_IMPL = "TritonMLASparseImpl"
FLASHMLA_IMPL = "FlashMLASparseImpl"
BLOCK_SIZE = 64  # what every CUDA sparse MLA backend and the DSA indexer cache use
INDEX_TOPK = 2048  # the tiny models' index_topk, as in both real checkpoints

# Logprob tolerance in nats between two attention kernels reading the same cache bytes with the
# same indexer. The model is bf16 end to end: both kernels accumulate in fp32 but round their
# softmax weights and outputs to 16-bit floats (bf16: 8-bit mantissa, one ulp = 2^-8 = 0.4 %
# relative) in different places, so attention outputs differ by about one ulp in a share of
# elements; through o_proj, the MLP/MoE and the final norm that moves logits of std ~1 (the
# weight gain makes them so) by a few 1e-3 typically and ~1e-2 at the tail over thousands of
# positions. These are estimates from that arithmetic, not measurements (no GPU run yet); the
# table and the JSON report the measured spread, and flashmla-bf16-eager vs flashmla-bf16 shows
# vLLM's own. 0.05 leaves 5-10x headroom over the estimate and is still far below what a wrong
# softmax scale, a dropped or duplicated KV row, a misread fp8 scale or stale KV moves: O(0.1-1)
# per affected token, since with these weights each query's attention scores have a std of ~2
# (estimated) and concentrate on a few tens of keys. The same bound serves graphs on vs off and
# the prefix-cache / block-reuse runs, which should be much closer (often bit-equal; the JSON
# says whether they were).
TOL = 0.05
# Share of compared positions allowed beyond TOL. Discrete choices flip under last-bit input
# differences for a few tokens and then move that token's logprob by O(0.1-1): the MoE router's
# top-2 of 8 experts, the indexer's top-2048 boundary (its fp8 index q/k rounding amplifies
# tiny differences), greedy near-ties. Each is rare per token (estimated ~0.1-1 % for this
# model, not measured); an attention bug moves a whole class of positions instead (every
# decode step, every position past the top-k, a whole request), i.e. far more than 2 %.
# Non-finite logprobs always fail.
OUTLIER_FRACTION = 0.02

# Environment the children read (set by the parent).
ENV_GAIN = "VLLM_E2E_WEIGHT_GAIN"
ENV_SEED = "VLLM_E2E_WEIGHT_SEED"
ENV_WEIGHTS_FILE = "VLLM_E2E_WEIGHTS_FILE"
INDEXER_ENV = "TRITON_MLA_SPARSE_INDEXER"  # triton_mla_sparse.vllm_plugin.indexer_install.ENV
HOOK_MARK = "_vllm_e2e_weight_hook"
PLUGIN_GROUP = "vllm.general_plugins"
PLUGIN_EP_NAME = "triton_mla_sparse"
PLUGIN_EP_VALUE = "triton_mla_sparse.vllm_plugin:register"
HOOK_EP_NAME = "vllm_e2e_weights"
HOOK_EP_VALUE = "vllm_e2e:vllm_general_plugin"


# ---------------------------------------------------------------------------------------------
# The tiny models


@dataclasses.dataclass(frozen=True)
class Family:
    """The attention geometry and the fields of a real checkpoint's config.json."""

    label: str
    architecture: str  # the registry key vLLM resolves (model_executor/models/registry.py)
    model_type: str
    tp8_heads: int  # heads per GPU at TP8: the default --heads
    q_lora_rank: int
    qk_nope_head_dim: int
    v_head_dim: int
    index_n_heads: int
    max_position_embeddings: int
    rms_norm_eps: float
    rope: dict[str, Any]  # merged into the config (rope_scaling / rope_theta keys)
    extra: dict[str, Any]


FAMILIES: dict[str, Family] = {
    # DeepSeek-V3.2: vLLM parses model_type deepseek_v32 with transformers' DeepseekV3Config
    # (transformers_utils/config.py _CONFIG_REGISTRY) and builds models/deepseek_v32 on CUDA.
    # YaRN as in the checkpoint: the attention then applies mscale^2 to the softmax scale
    # (models/deepseek_v32/attention.py:154-165), which a backend must take as given.
    "deepseek_v32": Family(
        label="DeepSeek-V3.2",
        architecture="DeepseekV32ForCausalLM",
        model_type="deepseek_v32",
        tp8_heads=16,
        q_lora_rank=1536,
        qk_nope_head_dim=128,
        v_head_dim=128,
        index_n_heads=64,
        max_position_embeddings=163840,
        rms_norm_eps=1e-6,
        rope={
            "rope_theta": 10000,
            "rope_scaling": {
                "type": "yarn",
                "factor": 40,
                "original_max_position_embeddings": 4096,
                "beta_fast": 32,
                "beta_slow": 1,
                "mscale": 1.0,
                "mscale_all_dim": 1.0,
            },
        },
        extra={},
    ),
    # GLM-5 (glm_moe_dsa, transformers' GlmMoeDsaConfig): the same DSA code in vLLM
    # (models/deepseek_v32/__init__.py), 192 nope / 256 v, 32 index heads, plain RoPE, and the
    # indexer's RoPE interleaved (indexer_rope_interleave, read at attention.py:244, :283).
    "glm5": Family(
        label="GLM-5",
        architecture="GlmMoeDsaForCausalLM",
        model_type="glm_moe_dsa",
        tp8_heads=8,
        q_lora_rank=2048,
        qk_nope_head_dim=192,
        v_head_dim=256,
        index_n_heads=32,
        max_position_embeddings=202752,
        rms_norm_eps=1e-5,
        rope={"rope_theta": 1000000.0},
        extra={"indexer_rope_interleave": True},
    ),
}


def write_tiny_config(
    path: str | os.PathLike[str],
    family: str,
    num_heads: int,
    num_layers: int,
    *,
    hidden_size: int = 2048,
    vocab_size: int = 4096,
    n_routed_experts: int = 8,
    experts_per_token: int = 2,
    moe_intermediate_size: int = 256,
) -> dict[str, Any]:
    """Write ``path/config.json`` for a tiny random-weight DSA model; return the dict written.

    The attention and indexer dimensions are the real model's (``family``: ``deepseek_v32`` or
    ``glm5``); what is small: ``num_heads`` (per GPU: the config is served at TP1), the hidden
    size, the layers (layer 0 dense, the rest MoE: ``first_k_dense_replace`` 1), the experts and
    the vocabulary. No tokenizer, no weights: vLLM runs it with ``load_format="dummy"`` and
    ``skip_tokenizer_init=True``.
    """
    if family not in FAMILIES:
        raise ValueError(f"family {family!r} is not one of {', '.join(FAMILIES)}")
    if num_layers < 2:
        raise ValueError("num_layers must be >= 2 (layer 0 dense, at least one MoE layer)")
    f = FAMILIES[family]
    cfg: dict[str, Any] = {
        "architectures": [f.architecture],
        "model_type": f.model_type,
        "torch_dtype": "bfloat16",
        "vocab_size": vocab_size,
        "hidden_size": hidden_size,
        "intermediate_size": hidden_size,  # the dense layer's MLP
        "num_hidden_layers": num_layers,
        "num_attention_heads": num_heads,
        "num_key_value_heads": num_heads,
        # MLA: the real attention geometry (head size 576 = 512 latent + 64 rope).
        "kv_lora_rank": 512,
        "q_lora_rank": f.q_lora_rank,
        "qk_rope_head_dim": 64,
        "qk_nope_head_dim": f.qk_nope_head_dim,
        "v_head_dim": f.v_head_dim,
        # The lightning indexer (DSA), as in the checkpoint.
        "index_n_heads": f.index_n_heads,
        "index_head_dim": 128,
        "index_topk": INDEX_TOPK,
        # MoE: one dense layer, then MoE layers with small experts. n_group = topk_group = 1
        # (GLM-5's values) keeps the router valid for 8 experts (grouped top-k needs more
        # experts than groups: fused_moe/router/grouped_topk_router.py:298-305).
        "first_k_dense_replace": 1,
        "moe_layer_freq": 1,
        "n_routed_experts": n_routed_experts,
        "num_experts_per_tok": experts_per_token,
        "n_shared_experts": 1,
        "moe_intermediate_size": moe_intermediate_size,
        "n_group": 1,
        "topk_group": 1,
        "topk_method": "noaux_tc",
        "scoring_func": "sigmoid",
        "norm_topk_prob": True,
        "routed_scaling_factor": 2.5,
        "hidden_act": "silu",
        "rms_norm_eps": f.rms_norm_eps,
        "max_position_embeddings": f.max_position_embeddings,
        "tie_word_embeddings": False,
        "attention_bias": False,
        "bos_token_id": 0,
        "eos_token_id": 1,
        "num_nextn_predict_layers": 0,  # no MTP layer: no speculative path in this check
        **json.loads(json.dumps(f.rope)),
        **f.extra,
    }
    out = Path(path)
    out.mkdir(parents=True, exist_ok=True)
    (out / "config.json").write_text(json.dumps(cfg, indent=2, sort_keys=True) + "\n")
    return cfg


# ---------------------------------------------------------------------------------------------
# Cases


@dataclasses.dataclass(frozen=True)
class Cmp:
    """One comparison of a case: the first applicable reference in ``refs``, and its kind.

    kind: ``kernel`` (two attention kernels), ``graphs`` (graphs on vs off, same backend),
    ``same`` (same backend and mode, another workload: prefix cache, block reuse) gate the exit
    status; ``info`` is reported only."""

    refs: tuple[str, ...]
    kind: str


@dataclasses.dataclass(frozen=True)
class Case:
    name: str
    backend: str
    kv_cache_dtype: str  # what is passed; DeepSeek-V3.2's hook turns bfloat16 into auto (bf16)
    graphs: bool
    indexer: str  # TRITON_MLA_SPARSE_INDEXER in the case's process
    workload: str = "mixed"  # mixed | prefix | reuse
    force_mqa: bool = False  # attention_config.sparse_mla_force_mqa: every prefill via MQA
    # plugin cases: "q" runs the kernel's MMAs in q's dtype where the heuristics choose fp16
    # operands for an e4m3 cache (bf16 rounding of P and of the values): the same kernel with
    # one rounding changed, to see how far a legitimate rounding difference moves the workload
    mma_operands: str = "auto"
    compare: tuple[Cmp, ...] = ()
    quick: bool = False
    note: str = ""


def _k(*refs: str) -> Cmp:
    return Cmp(refs, "kernel")


CASES: tuple[Case, ...] = (
    # References: vLLM's own sparse backend with vLLM's own indexer path.
    Case("flashmla-bf16", FLASHMLA, "bfloat16", True, "off", quick=True, note="reference"),
    Case("flashmla-fp8", FLASHMLA, "fp8_ds_mla", True, "off", quick=True, note="reference"),
    Case(
        "flashmla-bf16-eager",
        FLASHMLA,
        "bfloat16",
        False,
        "off",
        compare=(Cmp(("flashmla-bf16",), "info"),),
        note="vLLM's own graphs-on/off spread, for scale",
    ),
    # The plugin (indexer auto: vLLM's own DeepGEMM indexer on SM90/SM100/SM120).
    Case(
        "plugin-bf16",
        PLUGIN,
        "bfloat16",
        True,
        "auto",
        compare=(_k("flashmla-bf16", "plugin-bf16-eager"),),
        quick=True,
    ),
    Case(
        "plugin-bf16-eager",
        PLUGIN,
        "bfloat16",
        False,
        "auto",
        compare=(Cmp(("plugin-bf16",), "graphs"),),
        quick=True,
    ),
    Case(
        "plugin-fp8",
        PLUGIN,
        "fp8_ds_mla",
        True,
        "auto",
        compare=(_k("flashmla-fp8", "plugin-fp8-eager"),),
        quick=True,
    ),
    Case(
        "plugin-fp8-eager",
        PLUGIN,
        "fp8_ds_mla",
        False,
        "auto",
        compare=(Cmp(("plugin-fp8",), "graphs"),),
    ),
    Case(
        "plugin-fp8-qops",
        PLUGIN,
        "fp8_ds_mla",
        True,
        "auto",
        mma_operands="q",
        compare=(Cmp(("plugin-fp8",), "info"), Cmp(("flashmla-fp8",), "info")),
        note="the plugin against itself with bf16 MMA operands: a rounding change for scale",
    ),
    # The SM80/86 path forced on this GPU (TRITON_MLA_SPARSE_INDEXER=triton): Triton indexer
    # logits, bf16 index q (plugin's fused_q), vLLM's fused_norm_rope without fp8 stores and the
    # plugin's integer-e4m3 MLA cache writer. FlashMLA with the same forced path isolates the
    # attention kernel; against the plain reference it shows what the indexer path changes.
    Case(
        "flashmla-bf16-tidx",
        FLASHMLA,
        "bfloat16",
        True,
        "triton",
        compare=(Cmp(("flashmla-bf16",), "info"),),
        note="what the forced indexer path changes",
    ),
    Case(
        "plugin-bf16-sm80path",
        PLUGIN,
        "bfloat16",
        True,
        "triton",
        compare=(_k("flashmla-bf16-tidx", "plugin-bf16-eager"),),
        quick=True,
    ),
    Case(
        "flashmla-fp8-tidx",
        FLASHMLA,
        "fp8_ds_mla",
        True,
        "triton",
        compare=(Cmp(("flashmla-fp8",), "info"),),
        note="what the forced indexer path and cache writer change",
    ),
    Case(
        "plugin-fp8-sm80path",
        PLUGIN,
        "fp8_ds_mla",
        True,
        "triton",
        compare=(_k("flashmla-fp8-tidx", "plugin-fp8-eager"),),
    ),
    # Every prefill through the sparse MQA kernel (otherwise a prefill step whose contexts fit in
    # the top-k runs vLLM's dense MHA prefill, which is not this backend's kernel).
    Case(
        "flashmla-bf16-mqa",
        FLASHMLA,
        "bfloat16",
        True,
        "off",
        force_mqa=True,
        compare=(Cmp(("flashmla-bf16",), "info"),),
    ),
    Case(
        "plugin-bf16-mqa",
        PLUGIN,
        "bfloat16",
        True,
        "auto",
        force_mqa=True,
        compare=(_k("flashmla-bf16-mqa", "plugin-bf16-eager"),),
    ),
    # Prefix caching: the workload twice; the second time without prompt logprobs (which make
    # vLLM skip reading the cache: sampling_params.py:625-632), so it reads cached blocks.
    Case(
        "plugin-bf16-prefix",
        PLUGIN,
        "bfloat16",
        True,
        "auto",
        workload="prefix",
        compare=(_k("flashmla-bf16", "plugin-bf16-eager"), Cmp(("plugin-bf16",), "same")),
    ),
    # Block reuse: a KV pool just large enough for one pass of the workload, three passes in
    # one engine, so later passes run on blocks that held other requests' rows.
    Case(
        "plugin-bf16-reuse",
        PLUGIN,
        "bfloat16",
        True,
        "auto",
        workload="reuse",
        compare=(_k("flashmla-bf16", "plugin-bf16-eager"), Cmp(("plugin-bf16",), "same")),
    ),
    Case(
        "plugin-fp8-reuse",
        PLUGIN,
        "fp8_ds_mla",
        True,
        "auto",
        workload="reuse",
        compare=(_k("flashmla-fp8", "plugin-fp8-eager"), Cmp(("plugin-fp8",), "same")),
    ),
)
CASE_BY_NAME = {c.name: c for c in CASES}


@dataclasses.dataclass(frozen=True)
class Settings:
    """Everything besides the case that shapes a run (part of each case's hash)."""

    num_layers: int = 2
    hidden_size: int = 2048
    vocab_size: int = 4096
    max_model_len: int = 4096
    max_tokens: int = 24
    # Short prompts first: with a 1024-token step budget and first-come scheduling the first
    # step prefills the three short prompts and the first 757 tokens of the 3000-token one, the
    # next steps decode them beside that prompt's chunks (prefill and decode in one step), and
    # so on. 3000 and 2860 exceed index_topk 2048, so the indexer drops ~1/3 of their context at
    # the end; 257 and 64 sit on 64-row block edges; 1 has nothing to attend to but itself.
    prompt_lengths: tuple[int, ...] = (9, 1, 257, 3000, 64, 2860, 1200)
    # prompt 5 (2860 tokens) starts with the first 2560 tokens (40 blocks) of prompt 3
    shared_prefix: tuple[int, int, int] = (5, 3, 2560)
    max_num_batched_tokens: int = 1024
    max_num_seqs: int = 16  # also bounds the CUDA-graph capture sizes (startup time)
    gpu_memory_utilization: float = 0.3
    logprobs: int = 5  # top-5 per continuation step: the reference's top-1 margin needs 2
    weight_gain: float = 1.0
    seed: int = 0
    reuse_rounds: int = 3
    tol: float = TOL
    outlier_fraction: float = OUTLIER_FRACTION


def case_id(family: str, heads: int, name: str) -> str:
    return f"{family}-h{heads}/{name}"


def skip_reason(case: Case, capability: tuple[int, int] | None) -> str | None:
    """Why ``case`` cannot run on a GPU of ``capability`` (None: unknown, nothing skipped)."""
    if capability is None:
        return None
    if case.backend == FLASHMLA and capability[0] not in (9, 10):
        return "FLASHMLA_SPARSE needs SM90/SM100"  # flashmla_sparse.py:203-204
    if case.indexer == "triton" and capability[0] == 10:
        return f"{INDEXER_ENV}=triton is ignored on SM100 (vllm_plugin/indexer_install.py)"
    if capability < (8, 0):
        return "the plugin needs SM80 or newer"
    return None


def make_prompts(
    lengths: Sequence[int],
    vocab_size: int,
    seed: int,
    shared_prefix: tuple[int, int, int] | None = None,
) -> list[list[int]]:
    """Random token ids in [2, vocab) (0 and 1 are bos/eos), reproducible from ``seed``;
    ``shared_prefix`` = (dst, src, n): prompt dst starts with prompt src's first n tokens."""
    rng = random.Random(seed)
    prompts = [[rng.randrange(2, vocab_size) for _ in range(n)] for n in lengths]
    if shared_prefix is not None:
        dst, src, n = shared_prefix
        if n > min(lengths[dst], lengths[src]):
            raise ValueError(f"shared prefix {n} longer than prompt {dst} or {src}")
        prompts[dst][:n] = prompts[src][:n]
    return prompts


def reuse_pool_blocks(lengths: Iterable[int], max_tokens: int, max_model_len: int) -> int:
    """A KV pool for one pass of the workload plus a little slack, so passes 2.. reuse blocks.

    vLLM checks that ``max_model_len`` fits in the pool less its null block
    (v1/core/kv_cache_planning.py:1535-1552)."""
    need = sum(-(-(n + max_tokens) // BLOCK_SIZE) for n in lengths)
    return max(need + 4, -(-max_model_len // BLOCK_SIZE) + 2)


def llm_kwargs(spec: dict[str, Any]) -> dict[str, Any]:
    """The ``vllm.LLM(...)`` arguments of a case spec (as written by the parent)."""
    s = spec["settings"]
    attention: dict[str, Any] = {"backend": spec["backend"]}
    if spec["force_mqa"]:
        attention["sparse_mla_force_mqa"] = True
    kw: dict[str, Any] = {
        "model": spec["model_dir"],
        "load_format": "dummy",
        "seed": s["seed"],
        "skip_tokenizer_init": True,
        "trust_remote_code": False,
        "generation_config": "vllm",  # no generation_config.json lookup
        "dtype": "bfloat16",
        "tensor_parallel_size": 1,
        "max_model_len": s["max_model_len"],
        "max_num_batched_tokens": s["max_num_batched_tokens"],
        "max_num_seqs": s["max_num_seqs"],
        "enable_chunked_prefill": True,
        "gpu_memory_utilization": s["gpu_memory_utilization"],
        "attention_config": attention,
        "kv_cache_dtype": spec["kv_cache_dtype"],
        "enforce_eager": not spec["graphs"],
        "enable_prefix_caching": spec["workload"] == "prefix",
        "disable_log_stats": False,  # request stats: decode timestamps, preemptions
    }
    if spec["workload"] == "reuse":
        kw["num_gpu_blocks_override"] = reuse_pool_blocks(
            s["prompt_lengths"], s["max_tokens"], s["max_model_len"]
        )
    return kw


def sampling_kwargs(settings: dict[str, Any], prompt_logprobs: bool) -> dict[str, Any]:
    """``SamplingParams`` arguments: greedy, every continuation token (ignore_eos), no text."""
    kw: dict[str, Any] = {
        "temperature": 0.0,
        "max_tokens": settings["max_tokens"],
        "ignore_eos": True,
        "logprobs": settings["logprobs"],
        "detokenize": False,
    }
    if prompt_logprobs:
        kw["prompt_logprobs"] = 1  # the prompt token's own logprob (and the top-1)
    return kw


# ---------------------------------------------------------------------------------------------
# Dummy weights (runs inside vLLM's process: in-process engine, or a plugin hook in workers)


def rescale_dummy_weights(model: Any, gain: float, seed: int) -> dict[str, Any]:
    """Redraw every float parameter of 2+ dims as U(-a, a), a = gain * sqrt(3 / fan_in).

    fan_in is the last dimension (vLLM stores linear weights [out, in], expert weights
    [experts, out, in], embeddings [vocab, hidden]), so every projection keeps unit-variance
    activations unit-variance: attention scores get a std of ~2 and logits ~gain (estimated
    from the fan-ins). The generator
    is seeded from ``seed`` and the parameter's name, so layers differ and every backend gets the
    same weights on the same device. Left alone: parameters vLLM pins to a value
    (``dummy_weight_value``: norm weights 1, biases 0), vectors (router bias, norms) and scales.
    """
    import torch

    done = 0
    for name, p in model.named_parameters():
        if (
            p.dim() < 2
            or not p.is_floating_point()
            or p.device.type == "meta"
            or getattr(p, "dummy_weight_value", None) is not None
            or "scale" in name
        ):
            continue
        bound = gain * math.sqrt(3.0 / p.shape[-1])
        gen = torch.Generator(device=p.device)
        gen.manual_seed((seed * 1_000_003 + zlib.crc32(name.encode())) % (2**63))
        with torch.no_grad():
            if torch.finfo(p.dtype).bits < 16:  # uniform_ lacks 8-bit floats
                tmp = torch.empty(p.shape, dtype=torch.float32, device=p.device)
                tmp.uniform_(-bound, bound, generator=gen)
                p.copy_(tmp)
            else:
                p.uniform_(-bound, bound, generator=gen)
        done += 1
    return {"gain": gain, "seed": seed, "rescaled": done}


def weights_fingerprint(model: Any) -> str:
    """SHA-256 over every parameter's name, shape, dtype and bytes (in name order)."""
    import torch

    h = hashlib.sha256()
    for name, p in sorted(model.named_parameters(), key=lambda kv: kv[0]):
        h.update(f"{name}:{tuple(p.shape)}:{p.dtype};".encode())
        if p.device.type == "meta":
            continue
        t = p.detach().reshape(-1).cpu()  # 1-D: a 0-d tensor cannot change its dtype view
        h.update(t.view(torch.uint8).numpy().tobytes() if t.numel() else b"")
    return h.hexdigest()


def install_weight_hook() -> bool:
    """Wrap vLLM's dummy loader so loaded weights are rescaled and fingerprinted.

    Active when ``VLLM_E2E_WEIGHT_GAIN`` is set (only this script's children). The wrapped
    ``DummyModelLoader.load_weights`` runs before vLLM's ``process_weights_after_loading``
    (model_loader/base_loader.py:88-109), so MLA's absorbed W_UK / W_UV come from the
    rescaled ``kv_b_proj``. Idempotent; returns whether the hook is in place.
    """
    gain = os.environ.get(ENV_GAIN)
    if not gain:
        return False
    from vllm.model_executor.model_loader.dummy_loader import DummyModelLoader

    if getattr(DummyModelLoader.load_weights, HOOK_MARK, False):
        return True
    original = DummyModelLoader.load_weights
    seed = int(os.environ.get(ENV_SEED, "0"))

    def load_weights(self: Any, model: Any, model_config: Any) -> None:
        original(self, model, model_config)
        info = rescale_dummy_weights(model, float(gain), seed)
        info["sha256"] = weights_fingerprint(model)
        info["pid"] = os.getpid()
        path = os.environ.get(ENV_WEIGHTS_FILE)
        if path:
            with open(path, "a") as f:
                f.write(json.dumps(info) + "\n")

    setattr(load_weights, HOOK_MARK, True)
    DummyModelLoader.load_weights = load_weights  # type: ignore[method-assign]
    return True


def vllm_general_plugin() -> None:
    """``vllm.general_plugins`` entry point of the stand-in dist-info: the weight hook in every
    vLLM process of a case (spawned workers too, with --multiproc). Never raises."""
    try:
        install_weight_hook()
    except Exception as e:  # a plugin must not take vLLM down
        print(f"vllm_e2e: weight hook not installed: {type(e).__name__}: {e}", file=sys.stderr)


# ---------------------------------------------------------------------------------------------
# A case's process


def _attention_summary(model: Any) -> dict[str, Any]:
    """Which attention implementations the built model uses (run through LLM.apply_model)."""
    found: dict[str, int] = {}
    dtypes: set[str] = set()
    for _, m in model.named_modules():
        impl = getattr(m, "impl", None)
        if impl is None or not hasattr(m, "kv_cache_dtype"):
            continue
        backend = getattr(m, "attn_backend", None)
        bname = backend.get_name() if backend is not None and hasattr(backend, "get_name") else "?"
        key = f"{type(m).__name__}:{type(impl).__name__}:{bname}"
        found[key] = found.get(key, 0) + 1
        dtypes.add(str(m.kv_cache_dtype))
    return {"layers": found, "kv_cache_dtypes": sorted(dtypes)}


def _lp(entry: Any) -> float:
    return float(entry.logprob)


def _extract(outputs: Sequence[Any], prompts: Sequence[Sequence[int]]) -> list[dict[str, Any]]:
    reqs = []
    for out, prompt in zip(outputs, prompts):
        comp = out.outputs[0]
        plps = None
        if out.prompt_logprobs is not None:
            plps = [None]
            for i, d in enumerate(list(out.prompt_logprobs)[1:], start=1):
                plps.append(_lp(d[prompt[i]]) if d is not None and prompt[i] in d else None)
        cont = []
        for d in list(comp.logprobs or []):
            pairs = sorted(((int(t), _lp(v)) for t, v in d.items()), key=lambda kv: -kv[1])
            cont.append([list(kv) for kv in pairs])
        m = getattr(out, "metrics", None)
        tpot = None
        n_gen = getattr(m, "num_generation_tokens", 0) or 0
        if m is not None and n_gen > 1 and m.last_token_ts > m.first_token_ts:
            tpot = 1000.0 * (m.last_token_ts - m.first_token_ts) / (n_gen - 1)
        reqs.append(
            {
                "prompt_len": len(prompt),
                "prompt_lps": plps,
                "tokens": [int(t) for t in comp.token_ids],
                "cont": cont,
                "num_cached_tokens": getattr(out, "num_cached_tokens", None),
                "preemptions": getattr(m, "num_preemptions", None),
                "corrupted": getattr(m, "is_corrupted", None),
                "tpot_ms": tpot,
            }
        )
    return reqs


def _run(llm: Any, prompts: list[list[int]], params: Any) -> dict[str, Any]:
    inputs = [{"prompt_token_ids": p} for p in prompts]
    t0 = time.perf_counter()
    outs = llm.generate(inputs, params, use_tqdm=False)
    wall = time.perf_counter() - t0
    reqs = _extract(outs, prompts)
    tpots = [r["tpot_ms"] for r in reqs if r["tpot_ms"] is not None]
    n_out = sum(len(r["tokens"]) for r in reqs)
    return {
        "requests": reqs,
        "wall_s": wall,
        "output_tokens": n_out,
        "tpot_ms": sum(tpots) / len(tpots) if tpots else None,
        "wall_ms_per_token": 1000.0 * wall / n_out if n_out else None,
    }


def _load_shim(path: str) -> None:
    import runpy

    runpy.run_path(path, run_name="vllm_e2e_shim")


def _run_case(spec: dict[str, Any], result: dict[str, Any]) -> None:
    info: dict[str, Any] = result.setdefault("info", {})
    if spec.get("shim"):
        _load_shim(spec["shim"])  # before vLLM (or torch through it) is imported
    import triton_mla_sparse.vllm_plugin as plugin

    # vLLM would call this through the entry point; a package only on PYTHONPATH may have none.
    reg = plugin.registration()
    registered = reg.registered
    info["plugin_registered"] = registered
    info["plugin_reason"] = reg.reason
    if spec["backend"] == PLUGIN and not registered:
        raise RuntimeError(f"the plugin registered nothing: {info['plugin_reason']}")
    info["weight_hook"] = install_weight_hook()

    import torch
    import vllm
    from vllm import LLM, SamplingParams

    info["versions"] = {
        "vllm": getattr(vllm, "__version__", "?"),
        "torch": torch.__version__,
        "triton": _module_version("triton"),
        "transformers": _module_version("transformers"),
        "python": sys.version.split()[0],
    }
    props = torch.cuda.get_device_properties(0)
    info["device"] = {"name": props.name, "capability": [props.major, props.minor]}

    # The layer check: the plugin kernel's first calls of the workload (not the engine's
    # profiling and capture runs) against the float64 reference on the same tensors.
    lc_calls = int(spec.get("layer_check_calls") or 0)
    lc_state = None
    if lc_calls > 0:
        lc: dict[str, Any] = {"enabled": True, "max_calls": lc_calls, "calls": []}
        info["layer_check"] = lc
        if os.environ.get("VLLM_ENABLE_V1_MULTIPROCESSING") == "0":
            lc["max_tokens_per_call"] = LAYER_CHECK_TOKENS
            lc["compute_dtype"] = "float64 (on the GPU; the cache dequantized in float32)"
            if spec["backend"] == PLUGIN:
                from triton_mla_sparse.vllm_plugin.backend import TritonMLASparseImpl

                lc_state = install_layer_check(TritonMLASparseImpl, lc_calls, lc["calls"])
            else:
                from vllm.v1.attention.backends.mla.flashmla_sparse import FlashMLASparseImpl

                lc_state = install_reference_layer_check(FlashMLASparseImpl, lc_calls, lc["calls"])
        else:
            lc.update(enabled=False, note="the engine runs in another process (--multiproc)")

    if spec.get("mma_operands", "auto") != "auto":
        if spec["mma_operands"] != "q" or spec["backend"] != PLUGIN:
            raise ValueError(f"mma_operands={spec['mma_operands']!r} on {spec['backend']}")
        if os.environ.get("VLLM_ENABLE_V1_MULTIPROCESSING") != "0":
            raise RuntimeError("mma_operands needs the engine in this process (no --multiproc)")
        from triton_mla_sparse.ops.sparse_mla import plan as sparse_mla_plan_module

        # the plan asks this function once per call; False keeps q's dtype for the MMAs
        sparse_mla_plan_module.fp16_mma_for = lambda *args, **kwargs: False
        info["mma_operands"] = "q's dtype (fp16 operands off)"

    kwargs = llm_kwargs(spec)
    info["llm_kwargs"] = {k: v for k, v in kwargs.items() if k != "model"}
    t0 = time.perf_counter()
    llm = LLM(**kwargs)
    info["init_s"] = time.perf_counter() - t0
    if lc_state is not None:
        lc_state["armed"] = True

    # What vLLM actually built, so that a silently different backend or path cannot pass.
    import vllm_e2e  # this file, by module name: picklable for --multiproc workers

    info["attention"] = llm.apply_model(vllm_e2e._attention_summary)[0]
    from triton_mla_sparse.vllm_plugin.indexer_install import indexer_plan, installed_targets

    plan = indexer_plan((props.major, props.minor))
    info["indexer_plan"] = sorted(plan.targets) if plan.install else []
    info["indexer_reason"] = plan.reason
    if os.environ.get("VLLM_ENABLE_V1_MULTIPROCESSING") == "0":
        # the engine is in this process, so what the plugin installed is visible here
        info["indexer_targets"] = sorted(installed_targets())
        if info["indexer_targets"] != info["indexer_plan"]:
            raise RuntimeError(
                f"{INDEXER_ENV}={spec['indexer']}: planned {info['indexer_plan']}, "
                f"installed {info['indexer_targets']}"
            )
    try:
        cc = llm.llm_engine.vllm_config.compilation_config
        info["cudagraph_mode"] = str(cc.cudagraph_mode)
    except Exception as e:  # informational
        info["cudagraph_mode"] = f"unknown ({type(e).__name__})"
    # vLLM turns this on for eager-code models such as the DSA one (config/vllm.py)
    info["breakable_cudagraph"] = os.environ.get("VLLM_USE_BREAKABLE_CUDAGRAPH")
    wanted = PLUGIN_IMPL if spec["backend"] == PLUGIN else FLASHMLA_IMPL
    impls = {k.split(":")[1] for k in info["attention"]["layers"]}
    if impls != {wanted}:
        raise RuntimeError(f"{spec['backend']} requested, but the layers use {sorted(impls)}")

    s = spec["settings"]
    prompts = spec["prompts"]
    with_plp = SamplingParams(**sampling_kwargs(s, prompt_logprobs=True))
    _run(llm, prompts, with_plp)  # warm-up: compiles and captures what the measured run needs
    runs = {"main": _run(llm, prompts, with_plp)}
    if spec["workload"] == "prefix":
        runs["cached"] = _run(llm, prompts, SamplingParams(**sampling_kwargs(s, False)))
        cached = sum(r["num_cached_tokens"] or 0 for r in runs["cached"]["requests"])
        info["prefix_cached_tokens"] = cached
        if cached == 0:
            raise RuntimeError("prefix caching on, but the second pass read no cached tokens")
    elif spec["workload"] == "reuse":
        for k in range(2, s["reuse_rounds"] + 1):
            runs[f"round{k}"] = _run(llm, prompts, with_plp)
    result["runs"] = runs
    if lc_state is not None:
        info["layer_check"].update(
            {k: v for k, v in lc_state.items() if k != "armed"},
            ok=bool(info["layer_check"]["calls"])
            and all(r.get("ok") for r in info["layer_check"]["calls"]),
        )
    info["preemptions"] = sum(
        r["preemptions"] or 0 for run in runs.values() for r in run["requests"]
    )
    weights_file = os.environ.get(ENV_WEIGHTS_FILE)
    if weights_file and os.path.exists(weights_file):
        lines = [json.loads(x) for x in Path(weights_file).read_text().splitlines() if x]
        info["weights"] = lines[-1] if lines else None
    else:
        info["weights"] = None
    result["status"] = "ok"


def _module_version(name: str) -> str:
    try:
        mod = __import__(name)
        return str(getattr(mod, "__version__", "?"))
    except Exception:
        return "absent"


def child_main(spec_path: str, out_path: str) -> NoReturn:
    """Run one case (in a fresh process); write its result JSON to ``out_path``."""
    spec = json.loads(Path(spec_path).read_text())
    result: dict[str, Any] = {"case": spec["id"], "spec_hash": spec["hash"], "status": "error"}
    try:
        _run_case(spec, result)
    except BaseException as e:  # report the first failure instead of dying with it
        result["status"] = "error"
        result["error"] = f"{type(e).__name__}: {e}"[:4000]
        tb = traceback.format_exc().splitlines()
        result["traceback_tail"] = "\n".join(tb[-40:])
        traceback.print_exc()
    tmp = out_path + ".tmp"
    with open(tmp, "w") as f:
        json.dump(result, f)
    os.replace(tmp, out_path)
    sys.stdout.flush()
    sys.stderr.flush()
    # Skip interpreter teardown: vLLM's engine shutdown at exit is what hangs between cases.
    os._exit(0 if result["status"] == "ok" else 1)


# ---------------------------------------------------------------------------------------------
# Layer check: the plugin kernel against the float64 reference on the engine's own tensors

LAYER_CHECK_CALLS = 8  # kernel calls checked per case (--layer-check-calls)
LAYER_CHECK_TOKENS = 64  # tokens of a call the reference recomputes (sampled evenly)
# Pass/fail: the package's tolerance table (triton_mla_sparse.testing.sparse_mla_tolerance), keyed
# by the output dtype (the model dtype: bf16 here), the tests' too. fp8 caches use the same bound:
# the reference reads the same bytes.


def layer_check_compare(
    q: Any,
    rows: Any,
    topk_indices: Any,
    valid_counts: Any,
    out: Any,
    lse: Any = None,
    *,
    scale: float,
    kv_lora_rank: int,
    kv_format: str,
    k_scale: Any = None,
    is_decode: bool = False,
    max_tokens: int = LAYER_CHECK_TOKENS,
    compute_dtype: Any = None,
) -> dict[str, Any]:
    """One kernel call's output ``out`` (and ``lse``) against ``sparse_mla_reference`` on the same
    inputs, as ``_forward_mqa_kernel`` passes them to ``sparse_mla``: ``q`` the (ql_nope, q_pe)
    tuple (or one tensor), ``rows`` the 2-D flat row view of the cache, ``topk_indices`` physical
    flat rows with ``valid_counts``. The reference runs in ``compute_dtype`` (float64 default) on
    at most ``max_tokens`` tokens that have a valid index (evenly spaced; the kernel computes each
    token independently), on only the cache rows they select (the whole cache as floats would
    not fit). Returns a JSON-able record; ``ok`` against the package's tolerance table
    (``testing.SPARSE_MLA_TOLERANCE``) for the output dtype."""
    import torch

    from triton_mla_sparse.reference import physical_rows, sparse_mla_reference
    from triton_mla_sparse.testing import SPARSE_MLA_TOLERANCE, lse_error

    cd = torch.float64 if compute_dtype is None else compute_dtype
    if isinstance(q, tuple):
        q_nope, q_pe = q
    else:
        q_nope, q_pe = q[..., :kv_lora_rank], q[..., kv_lora_rank:]
    t, h = q_nope.shape[0], q_nope.shape[1]
    width = topk_indices.shape[-1]
    dtype = str(out.dtype)
    rec: dict[str, Any] = {
        "is_decode": bool(is_decode),
        "T": int(t),
        "H": int(h),
        "topk": int(width),
        "kv_format": kv_format,
        "out_dtype": dtype,
        "compute_dtype": str(cd),
        "nonfinite": int((~torch.isfinite(out)).sum().item()),
    }
    _, valid = physical_rows(topk_indices, rows.shape[0], valid_counts)
    has = valid.any(dim=1)
    cand = torch.nonzero(has).flatten()
    rec["tokens_with_valid"] = int(cand.numel())
    empty = ~has
    rec["empty_tokens"] = int(empty.sum().item())
    rec["empty_max_abs"] = float(out[empty].abs().max().item()) if rec["empty_tokens"] else 0.0
    if cand.numel() > max_tokens:
        pick = torch.linspace(0, cand.numel() - 1, max_tokens, device=cand.device).round().long()
        cand = cand[pick]
    rec["tokens_checked"] = int(cand.numel())
    if cand.numel() == 0:
        rec.update(rel_err=0.0, max_abs_err=0.0, lse_err=None)
    else:
        idx = topk_indices[cand]
        vc = valid_counts[cand] if valid_counts is not None else None
        ridx, ok = physical_rows(idx, rows.shape[0], vc)
        used, inv = torch.unique(ridx[ok], return_inverse=True)
        local = torch.full_like(ridx, -1)
        local[ok] = inv
        qs = (q_nope[cand].to(cd), q_pe[cand].to(cd))
        ref, ref_lse = sparse_mla_reference(
            qs,  # in compute_dtype, so that the result is not rounded to the model dtype
            rows[used],
            local,
            scale,
            kv_lora_rank=kv_lora_rank,
            valid_counts=vc,
            kv_format=kv_format,
            k_scale=k_scale,
            return_lse=True,
            compute_dtype=cd,
            token_chunk=16,
        )
        o = out[cand].to(cd)
        diff = o - ref
        rec["rel_err"] = float((diff.norm() / ref.norm().clamp_min(1e-30)).item())
        rec["max_abs_err"] = float(diff.abs().max().item())
        rec["ref_max_abs"] = float(ref.abs().max().item())
        rec["lse_err"] = None
        if lse is not None:
            rec["lse_err"] = lse_error(lse[cand], ref_lse, out.dtype)
    # a float64 output (a reference standing in for the kernel) is held to fp32's bound
    tol = SPARSE_MLA_TOLERANCE.get(out.dtype, SPARSE_MLA_TOLERANCE[torch.float32])
    rtol, latol = tol.out_rtol, tol.lse_atol
    reasons = []
    if rec["nonfinite"]:
        reasons.append(f"{rec['nonfinite']} non-finite outputs")
    if not rec["rel_err"] <= rtol:  # NaN fails too
        reasons.append(f"relative error {rec['rel_err']:.3g} > {rtol:g}")
    if rec["lse_err"] is not None and not rec["lse_err"] <= latol:
        reasons.append(f"LSE error {rec['lse_err']:.3g} > {latol:g}")
    rec["rtol"] = rtol
    rec["ok"] = not reasons
    rec["reasons"] = reasons
    return rec


def install_layer_check(impl_cls: Any, calls: int, sink: list[dict[str, Any]]) -> dict[str, Any]:
    """Wrap ``impl_cls._forward_mqa_kernel``: after each real call, while ``state["armed"]`` and
    fewer than ``calls`` records are in ``sink``, append :func:`layer_check_compare`'s record of
    it. Calls during CUDA-graph capture are counted, not checked (the reference syncs); replayed
    graphs do not reach Python, so what is checked is the eagerly run steps (mixed prefill and
    decode batches). Returns the state (``armed``, ``skipped_unarmed``, ``skipped_capture``,
    ``errors``)."""
    import torch

    state: dict[str, Any] = {
        "armed": False,
        "skipped_unarmed": 0,
        "skipped_capture": 0,
        "errors": [],
    }
    real = impl_cls._forward_mqa_kernel

    def wrapped(self, q, kv_cache, topk_indices, valid_counts, *, layer, block_size, is_decode):
        res = real(
            self,
            q,
            kv_cache,
            topk_indices,
            valid_counts,
            layer=layer,
            block_size=block_size,
            is_decode=is_decode,
        )
        if len(sink) >= calls:
            return res
        if not state["armed"]:
            state["skipped_unarmed"] += 1
            return res
        if torch.cuda.is_available() and torch.cuda.is_current_stream_capturing():
            state["skipped_capture"] += 1
            return res
        try:
            if kv_cache.dim() == 2:
                rows = kv_cache
            else:  # vLLM's paged cache: its own flat row view, as the kernel indexes it
                from vllm.v1.attention.backends.mla.sparse_utils import flat_kv_row_view

                rows = flat_kv_row_view(kv_cache, block_size)[0]
            out, lse = res
            rec = layer_check_compare(
                q,
                rows,
                topk_indices,
                valid_counts,
                out,
                lse,
                scale=self.scale,
                kv_lora_rank=self.kv_lora_rank,
                kv_format=self.kv_format,
                k_scale=layer._k_scale if self.kv_format == "fp8" else None,
                is_decode=is_decode,
            )
            rec["layer"] = str(getattr(layer, "layer_name", ""))
            sink.append(rec)
        except Exception as e:  # recorded: the case's layer check then fails
            state["errors"].append(f"{type(e).__name__}: {e}"[:500])
            sink.append({"ok": False, "reasons": [f"reference failed: {type(e).__name__}: {e}"]})
        return res

    wrapped.__wrapped__ = real  # type: ignore[attr-defined]
    impl_cls._forward_mqa_kernel = wrapped
    return state


def install_reference_layer_check(
    impl_cls: Any, calls: int, sink: list[dict[str, Any]]
) -> dict[str, Any]:
    """:func:`install_layer_check` for vLLM's own sparse backend (``--layer-check-reference``):
    wraps ``impl_cls.forward_mqa`` (FLASHMLA_SPARSE's whole top-k path: the bf16 kernel, and for
    an fp8_ds_mla cache the fp8 decode kernel or the bf16-upconverted prefill) and checks its
    output against the same float64 reference, on the physical rows vLLM's common sparse MLA
    ``forward_mqa`` converts the request-local top-k into (``triton_convert_req_index_to_global_index``,
    the conversion the plugin's kernel receives). Without DCP or HiSparse only, as these cases
    run. Both backends then carry a "kernel vs fp64" figure measured the same way."""
    import torch

    state: dict[str, Any] = {
        "armed": False,
        "skipped_unarmed": 0,
        "skipped_capture": 0,
        "errors": [],
    }
    real = impl_cls.forward_mqa

    def wrapped(self, q, kv_cache, attn_metadata, layer):
        res = real(self, q, kv_cache, attn_metadata, layer)
        if len(sink) >= calls:
            return res
        if not state["armed"]:
            state["skipped_unarmed"] += 1
            return res
        if torch.cuda.is_available() and torch.cuda.is_current_stream_capturing():
            state["skipped_capture"] += 1
            return res
        try:
            from vllm.v1.attention.backends.mla.sparse_utils import (
                flat_kv_row_view,
                triton_convert_req_index_to_global_index,
            )

            t = q[0].shape[0] if isinstance(q, tuple) else q.shape[0]
            h = q[0].shape[1] if isinstance(q, tuple) else q.shape[1]
            topk = self.topk_indices_buffer[:t]
            block_size = attn_metadata.block_size
            rows, stride_rows = flat_kv_row_view(kv_cache, block_size)
            phys, counts = triton_convert_req_index_to_global_index(
                attn_metadata.req_id_per_token[:t],
                attn_metadata.block_table,
                topk,
                BLOCK_SIZE=block_size,
                BLOCK_STRIDE_ROWS=stride_rows,
                NUM_TOPK_TOKENS=topk.shape[1],
                return_valid_counts=True,
            )
            out, lse = res
            fmt = "fp8_ds_mla" if self.kv_cache_dtype == "fp8_ds_mla" else "auto"
            rec = layer_check_compare(
                q,
                rows,
                phys,
                counts,
                out[:, :h],  # heads padded for the kernel are not the model's
                None,  # returned for decode rows only, under DCP: not compared
                scale=self.scale,
                kv_lora_rank=self.kv_lora_rank,
                kv_format=fmt,
                is_decode=attn_metadata.num_decode_tokens >= t,
            )
            rec["layer"] = str(getattr(layer, "layer_name", ""))
            sink.append(rec)
        except Exception as e:  # recorded: the case's layer check then fails
            state["errors"].append(f"{type(e).__name__}: {e}"[:500])
            sink.append({"ok": False, "reasons": [f"reference failed: {type(e).__name__}: {e}"]})
        return res

    wrapped.__wrapped__ = real  # type: ignore[attr-defined]
    impl_cls.forward_mqa = wrapped
    return state


def layer_check_summary(lc: dict[str, Any] | None) -> tuple[str, list[str]]:
    """The table cell ("kernel vs fp64") and failure reasons of a case's ``info.layer_check``."""
    if not lc or not lc.get("enabled"):
        return "-", []
    recs = lc.get("calls") or []
    reasons: list[str] = []
    if not recs:
        reasons.append("layer check recorded no kernel call")
    bad = [r for r in recs if not r.get("ok")]
    if bad:
        reasons.append(f"{len(bad)}/{len(recs)} kernel calls off: " + "; ".join(bad[0]["reasons"]))
    errs = [r["rel_err"] for r in recs if r.get("rel_err") is not None]
    worst = max(errs, key=lambda e: math.inf if math.isnan(e) else e) if errs else None
    cell = "-" if worst is None else f"{worst:.2e}"
    cell += " FAIL" if reasons else " PASS"
    return cell, reasons


# ---------------------------------------------------------------------------------------------
# Comparison


@dataclasses.dataclass
class Agreement:
    """How one case's outputs agree with a reference's, over every run of the case."""

    prompt_n: int = 0
    prompt_over: int = 0
    prompt_max: float = 0.0
    prompt_p99: float = 0.0
    prompt_mean: float = 0.0
    cont_n: int = 0  # continuation logprobs compared
    cont_over: int = 0
    cont_max: float = 0.0
    nonfinite: int = 0
    tok_compared: int = 0  # continuation positions up to and including a first divergence
    tok_agree: int = 0
    tok_ties: int = 0  # divergences where the reference's top-1 margin <= tol
    tok_hard: int = 0  # divergences where it is larger: count against the case
    tok_unchecked: int = 0  # positions after a divergence (other context: not comparable)
    length_mismatch: int = 0
    bitwise: bool = True  # every compared logprob and token identical
    # Positions over tol split at the top-k: a logprob of sequence token i comes from the query
    # at i - 1, whose context (i tokens) the indexer keeps whole while i <= index_topk ("below");
    # past that the top-k selection amplifies small differences ("from": at/after the top-k).
    prompt_n_below_topk: int = 0
    prompt_over_below_topk: int = 0
    prompt_over_from_topk: int = 0
    cont_n_below_topk: int = 0
    cont_over_below_topk: int = 0
    cont_over_from_topk: int = 0


def _delta(a: float | None, b: float | None) -> float | None:
    if a is None or b is None:
        return None
    if not (math.isfinite(a) and math.isfinite(b)):
        return math.inf
    return abs(a - b)


def _margin(top: Sequence[Sequence[float]]) -> float:
    lps = sorted((kv[1] for kv in top), reverse=True)
    if len(lps) < 2:
        return math.inf
    return lps[0] - lps[1]


def compare_requests(
    ref: Sequence[dict[str, Any]],
    got: Sequence[dict[str, Any]],
    tol: float,
    topk: int = INDEX_TOPK,
) -> Agreement:
    """Compare per-request outputs (as the case process records them) with a reference's."""
    agr = Agreement()
    pd: list[float] = []
    cd: list[float] = []
    p_below: list[bool] = []  # per entry of pd / cd: the query's context fits in the top-k
    c_below: list[bool] = []
    if len(ref) != len(got):
        agr.length_mismatch += abs(len(ref) - len(got))
    for r, g in zip(ref, got):
        if r["prompt_lps"] is not None and g["prompt_lps"] is not None:
            if len(r["prompt_lps"]) != len(g["prompt_lps"]):
                agr.length_mismatch += 1
            for i, (a, b) in enumerate(zip(r["prompt_lps"], g["prompt_lps"])):
                d = _delta(a, b)
                if d is not None:
                    pd.append(d)
                    p_below.append(i <= topk)
                    agr.bitwise &= a == b
        plen = r.get("prompt_len")
        if plen is None:
            plen = len(r["prompt_lps"] or [])
        if len(r["tokens"]) != len(g["tokens"]):
            agr.length_mismatch += 1
        for j, (rt, gt) in enumerate(zip(r["tokens"], g["tokens"])):
            rtop, gtop = dict(map(tuple, r["cont"][j])), dict(map(tuple, g["cont"][j]))
            agr.tok_compared += 1
            if rt == gt:
                agr.tok_agree += 1
                d = _delta(rtop.get(rt), gtop.get(gt))
                if d is not None:
                    cd.append(d)
                    c_below.append(plen + j <= topk)
                    agr.bitwise &= rtop.get(rt) == gtop.get(gt)
                continue
            agr.bitwise = False
            if _margin(r["cont"][j]) > tol:
                agr.tok_hard += 1
            else:
                agr.tok_ties += 1
                d = _delta(rtop.get(rt), gtop.get(rt))
                if d is not None:
                    cd.append(d)
                    c_below.append(plen + j <= topk)
            agr.tok_unchecked += len(r["tokens"]) - j - 1
            break
    agr.nonfinite = sum(1 for d in pd + cd if not math.isfinite(d))
    if pd:
        s = sorted(pd)
        agr.prompt_n, agr.prompt_max = len(s), s[-1]
        agr.prompt_p99 = s[min(len(s) - 1, int(0.99 * len(s)))]
        agr.prompt_mean = sum(x for x in s if math.isfinite(x)) / len(s)
        agr.prompt_over = sum(1 for x in s if x > tol)
    if cd:
        agr.cont_n, agr.cont_max = len(cd), max(cd)
        agr.cont_over = sum(1 for x in cd if x > tol)
    agr.prompt_n_below_topk = sum(p_below)
    agr.prompt_over_below_topk = sum(1 for x, b in zip(pd, p_below) if b and x > tol)
    agr.prompt_over_from_topk = sum(1 for x, b in zip(pd, p_below) if not b and x > tol)
    agr.cont_n_below_topk = sum(c_below)
    agr.cont_over_below_topk = sum(1 for x, b in zip(cd, c_below) if b and x > tol)
    agr.cont_over_from_topk = sum(1 for x, b in zip(cd, c_below) if not b and x > tol)
    return agr


def merge_agreements(parts: Sequence[Agreement]) -> Agreement:
    """Sum counts and take maxima (p99 and mean: the largest of the parts)."""
    out = Agreement()
    for a in parts:
        for f in dataclasses.fields(Agreement):
            v, w = getattr(out, f.name), getattr(a, f.name)
            if f.name == "bitwise":
                setattr(out, f.name, v and w)
            elif f.name.endswith(("_max", "_p99", "_mean")):
                setattr(out, f.name, max(v, w))
            else:
                setattr(out, f.name, v + w)
    return out


def judge(agr: Agreement, tol: float, outlier_fraction: float) -> list[str]:
    """Reasons the agreement fails (empty: it passes)."""
    reasons = []
    if agr.nonfinite:
        reasons.append(f"{agr.nonfinite} non-finite logprobs")
    if agr.length_mismatch:
        reasons.append(f"{agr.length_mismatch} length mismatches")
    if agr.prompt_n == 0 and agr.tok_compared == 0:
        reasons.append("nothing compared")
    allowed = int(outlier_fraction * agr.prompt_n)
    if agr.prompt_over > allowed:
        reasons.append(
            f"{agr.prompt_over}/{agr.prompt_n} prompt logprobs off by > {tol} "
            f"(max {agr.prompt_max:.3g}; {allowed} allowed)"
        )
    cont_bad = agr.cont_over + agr.tok_hard
    allowed = int(outlier_fraction * agr.tok_compared)
    if cont_bad > allowed:
        reasons.append(
            f"{agr.cont_over} continuation logprobs off by > {tol} and {agr.tok_hard} greedy "
            f"tokens differing where the reference's margin > {tol}, of {agr.tok_compared} "
            f"({allowed} allowed)"
        )
    return reasons


def compare_case_runs(
    ref_result: dict[str, Any], result: dict[str, Any], tol: float
) -> tuple[Agreement, dict[str, Agreement]]:
    """Every run of ``result`` against the reference's main run."""
    ref_reqs = ref_result["runs"]["main"]["requests"]
    per = {
        name: compare_requests(ref_reqs, run["requests"], tol)
        for name, run in result["runs"].items()
    }
    return merge_agreements(list(per.values())), per


# ---------------------------------------------------------------------------------------------
# The table


def _fmt_delta(n: int, mx: float, over: int) -> str:
    if n == 0:
        return "-"
    return f"{mx:.4f} ({over}/{n})"


def table_row(
    case: str,
    backend: str,
    cache: str,
    graphs: bool | None,
    vs: str = "",
    agr: Agreement | None = None,
    ms_per_token: float | None = None,
    status: str = "",
    layer: str = "-",
) -> dict[str, str]:
    """One row of the final table as strings (``agr`` None: no comparison; ``layer``: the
    case's layer-check cell, :func:`layer_check_summary`)."""
    return {
        "case": case,
        "backend": {PLUGIN: "plugin", FLASHMLA: "FlashMLA"}.get(backend, backend),
        "cache": {"bfloat16": "bf16"}.get(cache, cache),
        "graphs": "-" if graphs is None else ("on" if graphs else "off"),
        "vs": vs or "-",
        "prompt max|dlp| (>tol/n)": "-"
        if agr is None
        else _fmt_delta(agr.prompt_n, agr.prompt_max, agr.prompt_over),
        "cont max|dlp| (>tol/n)": "-"
        if agr is None
        else _fmt_delta(agr.cont_n, agr.cont_max, agr.cont_over),
        "tokens agree": "-"
        if agr is None
        else f"{agr.tok_agree}/{agr.tok_compared}"
        + (f" t{agr.tok_ties}" if agr.tok_ties else "")
        + (f" x{agr.tok_hard}" if agr.tok_hard else ""),
        ">tol <|>= top-k": "-"
        if agr is None
        else f"{agr.prompt_over_below_topk + agr.cont_over_below_topk}|"
        f"{agr.prompt_over_from_topk + agr.cont_over_from_topk}",
        "kernel vs fp64": layer,
        "ms/tok": "-" if ms_per_token is None else f"{ms_per_token:.2f}",
        "status": status,
    }


def format_table(rows: Sequence[dict[str, str]]) -> str:
    """Rows (``table_row``) as aligned text with a header and a legend."""
    if not rows:
        return "(no cases)"
    cols = list(rows[0])
    width = {c: max(len(c), *(len(r[c]) for r in rows)) for c in cols}
    line = "  ".join(c.ljust(width[c]) for c in cols)
    out = [line, "  ".join("-" * width[c] for c in cols)]
    out += ["  ".join(r[c].ljust(width[c]) for c in cols).rstrip() for r in rows]
    out.append(
        "dlp: |logprob difference| vs the reference (nats); tokens: greedy tokens equal / "
        "compared up to a first divergence, tN: N near-ties, xN: N real differences; "
        f">tol <|>= top-k: positions over tol whose context fits in the top-k ({INDEX_TOPK}) | "
        "exceeds it (prompt + continuation); kernel vs fp64: the plugin kernel's worst relative "
        "error against the float64 reference on the engine's tensors (layer check); ms/tok: "
        "mean decode time per output token (vLLM request stats; without them, wall time / "
        "output tokens)"
    )
    return "\n".join(out)


# ---------------------------------------------------------------------------------------------
# The parent


def detect_gpu(env: dict[str, str]) -> tuple[str, tuple[int, int]] | None:
    """(name, capability) of GPU 0 as the children's PyTorch sees it, or None."""
    probe = (
        "import torch; p = torch.cuda.get_device_properties(0); "
        "print(p.name, '|', p.major, ' ', p.minor, sep='')"
    )
    out = subprocess.run(
        [sys.executable, "-c", probe], env=env, capture_output=True, text=True, timeout=300
    )
    if out.returncode != 0 or "|" not in out.stdout:
        return None
    name, cc = out.stdout.strip().splitlines()[-1].split("|")
    major, minor = cc.split()
    return name, (int(major), int(minor))


_PROBE = """
import importlib.metadata as m, importlib.util as u, json
eps = {e.name: e.value for e in m.entry_points(group=%r)}
try:
    v = m.version("vllm")
except m.PackageNotFoundError:
    v = None
s = u.find_spec("vllm")
t = u.find_spec("triton_mla_sparse")
print(json.dumps({"eps": eps, "vllm_dist": v,
                  "vllm_dir": list(s.submodule_search_locations or []) if s else None,
                  "tms": t.origin if t else None}))
"""


def probe_env(env: dict[str, str]) -> dict[str, Any]:
    """What the children will see: plugin entry points, vLLM's metadata, the packages."""
    out = subprocess.run(
        [sys.executable, "-c", _PROBE % PLUGIN_GROUP],
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    if out.returncode != 0:
        raise SystemExit(f"cannot probe the children's Python:\n{out.stderr}")
    return json.loads(out.stdout.strip().splitlines()[-1])


def _vllm_version_from_source(vllm_dirs: Sequence[str]) -> str | None:
    for d in vllm_dirs:
        f = Path(d) / "_version.py"
        if f.exists():
            m = re.search(
                r"""__version__\s*=\s*(?:version\s*=\s*)?['"]([^'"]+)['"]""", f.read_text()
            )
            if m:
                return m.group(1)
    return None


def write_dist_infos(
    dest: Path, *, plugin: bool, hooks: bool, vllm_version: str | None
) -> list[str]:
    """Stand-in ``*.dist-info`` folders under ``dest`` (a folder to put on PYTHONPATH).

    ``plugin``: this package's ``vllm.general_plugins`` entry point (vLLM finds plugins only
    through entry points: plugins/__init__.py:36-75); ``hooks``: this script's weight hook as a
    second general plugin (so spawned workers rescale the dummy weights too);
    ``vllm_version``: a ``vllm`` METADATA, for a vLLM on PYTHONPATH without its dist-info (vLLM's
    CUDA platform detection reads it: platforms/__init__.py:18-30, and so does the plugin's
    version gate). Returns the folders written.
    """
    written = []

    def dist(name: str, version: str, entry_points: str | None) -> None:
        d = dest / f"{name.replace('-', '_')}-{version}.dist-info"
        d.mkdir(parents=True, exist_ok=True)
        (d / "METADATA").write_text(
            f"Metadata-Version: 2.1\nName: {name}\nVersion: {version}\n"
            "Summary: stand-in written by tools/vllm_e2e.py\n"
        )
        if entry_points:
            (d / "entry_points.txt").write_text(entry_points)
        written.append(str(d))

    if plugin:
        m = re.search(r'^version\s*=\s*"([^"]+)"', (ROOT / "pyproject.toml").read_text(), re.M)
        dist(
            "triton-mla-sparse",
            m.group(1) if m else "0.0",
            f"[{PLUGIN_GROUP}]\n{PLUGIN_EP_NAME} = {PLUGIN_EP_VALUE}\n",
        )
    if hooks:
        dist("vllm-e2e-hooks", "0.0", f"[{PLUGIN_GROUP}]\n{HOOK_EP_NAME} = {HOOK_EP_VALUE}\n")
    if vllm_version:
        dist("vllm", vllm_version, None)
    return written


def base_env(args: argparse.Namespace) -> dict[str, str]:
    env = dict(os.environ)
    paths = []
    if args.triton:
        paths.append(str(Path(args.triton).resolve()))
        env["TRITON_BACKENDS_IN_TREE"] = "1"  # the copy's backends, not the installed Triton's
        env.setdefault("TRITON_CACHE_DIR", "/tmp/triton-cache-" + Path(args.triton).name)
    if args.vllm:
        paths.append(str(Path(args.vllm).resolve()))
    paths += [str(ROOT / "src"), str(TOOLS)]  # this checkout; tools/ for `import vllm_e2e`
    env["PYTHONPATH"] = os.pathsep.join(paths + [p for p in [env.get("PYTHONPATH")] if p])
    env["PYTHONUNBUFFERED"] = "1"
    env.pop("TRITON_INTERPRET", None)
    if not args.multiproc:
        # The engine core and its one worker in this process (v1/engine/llm_engine.py:186-190,
        # UniProcExecutor at TP1): no spawned processes that need plugins or the shim again.
        env["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
    else:
        env["VLLM_ALLOW_INSECURE_SERIALIZATION"] = "1"  # LLM.apply_model ships a function
    return env


def _case_spec(
    family: str,
    heads: int,
    case: Case,
    settings: Settings,
    model_dir: Path,
    prompts: list[list[int]],
    model_cfg: dict[str, Any],
    shim: str | None,
    layer_check_calls: int = LAYER_CHECK_CALLS,
    layer_check_reference: bool = False,
) -> dict[str, Any]:
    spec: dict[str, Any] = {
        "id": case_id(family, heads, case.name),
        "family": family,
        "heads": heads,
        "name": case.name,
        "backend": case.backend,
        "kv_cache_dtype": case.kv_cache_dtype,
        "graphs": case.graphs,
        "indexer": case.indexer,
        "workload": case.workload,
        "force_mqa": case.force_mqa,
        **({"mma_operands": case.mma_operands} if case.mma_operands != "auto" else {}),
        # tolerances only judge results: changing them must not invalidate --resume
        "settings": {
            k: v
            for k, v in dataclasses.asdict(settings).items()
            if k not in ("tol", "outlier_fraction")
        },
        "model_config": model_cfg,
        "prompts": prompts,
        "shim": shim,
    }
    # FlashMLA cases keep their hash unless --layer-check-reference asks to check them too
    if layer_check_calls > 0 and (case.backend == PLUGIN or layer_check_reference):
        spec["layer_check_calls"] = layer_check_calls
    spec["hash"] = hashlib.sha256(json.dumps(spec, sort_keys=True).encode()).hexdigest()[:16]
    spec["model_dir"] = str(model_dir)
    return spec


def run_child(spec: dict[str, Any], env: dict[str, str], out: Path, timeout: int) -> dict[str, Any]:
    """Run one case in a fresh process; its result, or an error result with the log's tail."""
    safe = spec["id"].replace("/", "__")
    case_dir, log_dir = out / "cases", out / "logs"
    case_dir.mkdir(parents=True, exist_ok=True)
    log_dir.mkdir(parents=True, exist_ok=True)
    spec_path = case_dir / f"{safe}.spec.json"
    res_path = case_dir / f"{safe}.json"
    log_path = log_dir / f"{safe}.log"
    weights = case_dir / f"{safe}.weights.jsonl"
    spec_path.write_text(json.dumps(spec))
    for p in (res_path, weights):
        p.unlink(missing_ok=True)
    cenv = {
        **env,
        INDEXER_ENV: spec["indexer"],
        ENV_GAIN: repr(spec["settings"]["weight_gain"]),
        ENV_SEED: str(spec["settings"]["seed"]),
        ENV_WEIGHTS_FILE: str(weights),
    }
    code = "import sys, vllm_e2e; vllm_e2e.child_main(sys.argv[1], sys.argv[2])"
    cmd = [sys.executable, "-c", code, str(spec_path), str(res_path)]
    t0 = time.perf_counter()
    with open(log_path, "w") as log:
        log.write(f"# {spec['id']}\n# {' '.join(cmd)}\n")
        log.flush()
        try:
            rc = subprocess.run(
                cmd, cwd=ROOT, env=cenv, stdout=log, stderr=subprocess.STDOUT, timeout=timeout
            ).returncode
        except subprocess.TimeoutExpired:
            rc = 124
            log.write(f"\n[vllm_e2e] stopped after {timeout} s\n")
    seconds = time.perf_counter() - t0
    if res_path.exists():
        result = json.loads(res_path.read_text())
    else:
        tail = log_path.read_text(errors="replace").splitlines()[-30:]
        result = {
            "case": spec["id"],
            "spec_hash": spec["hash"],
            "status": "error",
            "error": f"case process exited with {rc} without a result"
            + (" (timeout)" if rc == 124 else ""),
            "traceback_tail": "\n".join(tail),
        }
    result["seconds"] = seconds
    result["log"] = str(log_path)
    return result


def select_cases(
    families: Sequence[str],
    heads: Sequence[int] | None,
    quick: bool,
    patterns: Sequence[str],
    capability: tuple[int, int] | None = None,
) -> list[tuple[str, int, Case]]:
    """(family, heads, case) to run, in CASES order: the quick set (or all), narrowed by the
    patterns, plus the reference each chosen comparison uses on a GPU of ``capability``: its
    first candidate that runs there (every candidate when the GPU is unknown)."""
    every = [
        (fam, h, c) for fam in families for h in (heads or [FAMILIES[fam].tp8_heads]) for c in CASES
    ]
    chosen = {
        (f, h, c.name)
        for f, h, c in every
        if (c.quick or not quick)
        and (
            not patterns
            or any(
                fnmatch.fnmatch(case_id(f, h, c.name), p) or fnmatch.fnmatch(c.name, p)
                for p in patterns
            )
        )
    }
    todo = list(chosen)
    while todo:
        f, h, name = todo.pop()
        for cmp in CASE_BY_NAME[name].compare:
            runnable = [r for r in cmp.refs if skip_reason(CASE_BY_NAME[r], capability) is None]
            for ref in runnable[:1] if capability is not None else cmp.refs:
                if (f, h, ref) not in chosen:
                    chosen.add((f, h, ref))
                    todo.append((f, h, ref))
    return [(f, h, c) for f, h, c in every if (f, h, c.name) in chosen]


PENDING = "PENDING: not run yet (--time-budget); run again with --resume"


def _ms_per_token(result: dict[str, Any]) -> float | None:
    main = result.get("runs", {}).get("main", {})
    return main.get("tpot_ms") or main.get("wall_ms_per_token")


def _short(text: str, n: int = 70) -> str:
    text = " ".join(text.split())
    return text if len(text) <= n else text[: n - 3] + "..."


def evaluate(
    selected: Sequence[tuple[str, int, Case]],
    results: dict[str, dict[str, Any]],
    skips: dict[str, str],
    settings: Settings,
) -> tuple[list[dict[str, str]], list[dict[str, Any]], bool]:
    """Table rows, comparison records and whether everything gating passed."""
    rows: list[dict[str, str]] = []
    records: list[dict[str, Any]] = []
    ok_all = True
    done_pairs: set[frozenset[str]] = set()
    for fam, heads, case in selected:
        cid = case_id(fam, heads, case.name)
        base = (cid, case.backend, case.kv_cache_dtype, case.graphs)
        if cid in skips:
            rows.append(table_row(*base, status=f"SKIP: {skips[cid]}"))
            continue
        res = results[cid]
        ms = _ms_per_token(res) if res.get("status") == "ok" else None
        if res.get("status") == "pending":
            rows.append(table_row(*base, status=PENDING))
            continue
        if res.get("status") != "ok":
            ok_all = False
            rows.append(table_row(*base, status="ERROR: " + _short(res.get("error", "?"))))
            records.append({"case": cid, "status": "error", "error": res.get("error")})
            continue
        n_rows = len(rows)
        lc_cell, lc_reasons = layer_check_summary(res.get("info", {}).get("layer_check"))
        if lc_reasons:  # the kernel is off on the engine's own tensors: the case fails
            ok_all = False
            records.append(
                {"case": cid, "kind": "layer_check", "status": "fail", "reasons": lc_reasons}
            )
        lc_status = ("FAIL: layer check: " + "; ".join(lc_reasons) + "; ") if lc_reasons else ""
        for cmp in case.compare:
            ref_name = next((r for r in cmp.refs if case_id(fam, heads, r) not in skips), None)
            if ref_name is None:
                rows.append(
                    table_row(
                        *base,
                        ms_per_token=ms,
                        layer=lc_cell,
                        status=lc_status + "SKIP: no reference here",
                    )
                )
                continue
            rid = case_id(fam, heads, ref_name)
            pair = frozenset((cid, rid))
            if pair in done_pairs:  # already compared the other way round (a fallback)
                continue
            done_pairs.add(pair)
            rec: dict[str, Any] = {"case": cid, "reference": rid, "kind": cmp.kind}
            ref = results.get(rid)
            gating = cmp.kind != "info"
            notes = []
            if ref is not None and ref.get("status") == "pending":
                rows.append(
                    table_row(
                        *base,
                        vs=ref_name,
                        ms_per_token=ms,
                        layer=lc_cell,
                        status=lc_status + PENDING,
                    )
                )
                continue
            if ref is None or ref.get("status") != "ok":
                status = f"ERROR: reference {ref_name} failed"
                rec.update(status="error", reasons=[status])
                ok_all &= not gating
                rows.append(
                    table_row(
                        *base,
                        vs=ref_name,
                        ms_per_token=ms,
                        layer=lc_cell,
                        status=lc_status + status,
                    )
                )
                records.append(rec)
                continue
            agr, per_run = compare_case_runs(ref, res, settings.tol)
            reasons = judge(agr, settings.tol, settings.outlier_fraction)
            w1 = (res["info"].get("weights") or {}).get("sha256")
            w2 = (ref["info"].get("weights") or {}).get("sha256")
            if w1 and w2 and w1 != w2:
                reasons.insert(0, "the two runs loaded different weights")
            elif not (w1 and w2):
                notes.append("weights not fingerprinted")
            t1, t2 = res["info"].get("indexer_plan"), ref["info"].get("indexer_plan")
            if gating and t1 != t2:
                gating = False
                notes.append("indexer paths differ: informational")
            if reasons and gating:
                code, status = "fail", "FAIL: " + "; ".join(reasons)
                ok_all = False
            elif reasons:
                code, status = "warn", "WARN: " + "; ".join(reasons)
            else:
                code = "pass" if gating else "info"
                status = code.upper() + (" (bit-equal)" if agr.bitwise else "")
            if notes:
                status += " [" + "; ".join(notes) + "]"
            rec.update(
                status=code,
                gating=gating,
                reasons=reasons,
                notes=notes,
                agreement=dataclasses.asdict(agr),
                per_run={k: dataclasses.asdict(v) for k, v in per_run.items()},
            )
            records.append(rec)
            rows.append(
                table_row(
                    *base,
                    vs=ref_name,
                    agr=agr,
                    ms_per_token=ms,
                    layer=lc_cell,
                    status=lc_status + status,
                )
            )
        if len(rows) == n_rows:  # a reference, or its comparisons were made from the other side
            rows.append(table_row(*base, ms_per_token=ms, layer=lc_cell, status=lc_status + "REF"))
    return rows, records, ok_all


def list_cases(
    selected: Sequence[tuple[str, int, Case]], capability: tuple[int, int] | None
) -> str:
    lines = []
    cap = "unknown GPU" if capability is None else f"SM{capability[0]}{capability[1]}"
    lines.append(f"{len(selected)} cases ({cap}):")
    for fam, heads, case in selected:
        why = skip_reason(case, capability)
        refs = "; ".join(f"{c.kind} vs {' | '.join(c.refs)}" for c in case.compare) or "reference"
        extra = [case.workload] if case.workload != "mixed" else []
        extra += ["force-mqa"] if case.force_mqa else []
        extra += [f"mma-{case.mma_operands}"] if case.mma_operands != "auto" else []
        lines.append(
            f"  {case_id(fam, heads, case.name):42s} {case.backend:17s} "
            f"{case.kv_cache_dtype:10s} graphs {'on ' if case.graphs else 'off'} "
            f"indexer {case.indexer:6s} {' '.join(extra):8s} {refs}"
            + (f"  [skip: {why}]" if why else "")
        )
    return "\n".join(lines)


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        description="End-to-end check of the TRITON_MLA_SPARSE backend in vLLM 0.33 "
        "(tiny random-weight DeepSeek-V3.2 / GLM-5) against vLLM's FLASHMLA_SPARSE.",
        formatter_class=argparse.RawDescriptionHelpFormatter,
        epilog=__doc__.split("\n\n", 2)[1] if __doc__ else None,
    )
    p.add_argument("--out", help="folder for results.json, cases/ and logs/")
    p.add_argument("--family", default="both", choices=["deepseek_v32", "glm5", "both"])
    p.add_argument(
        "--heads",
        default=None,
        help="attention heads per GPU, comma-separated (default: the TP8 value, "
        "16 for DeepSeek-V3.2 and 8 for GLM-5; e.g. 16,64,128)",
    )
    p.add_argument(
        "--cases",
        default="",
        help="comma-separated glob patterns on case names or ids "
        "(e.g. 'plugin-fp8*,glm5-h8/plugin-bf16'); the references they need are added",
    )
    p.add_argument("--quick", action="store_true", help="fewer cases, 12-token continuations")
    p.add_argument("--list", action="store_true", help="list the cases and exit")
    p.add_argument(
        "--capability",
        default=None,
        help="for --list: mark the cases a GPU of this capability skips (e.g. 9.0)",
    )
    p.add_argument(
        "--indexer",
        default="case",
        choices=["case", "auto", "off", "triton"],
        help=f"{INDEXER_ENV} for every case (default: each case's own; 'triton' runs every case "
        "on the plugin's DeepGEMM-free indexer, e.g. where DeepGEMM cannot run)",
    )
    p.add_argument("--layers", type=int, default=Settings.num_layers)
    p.add_argument("--max-tokens", type=int, default=None, help="continuation length")
    p.add_argument("--weight-gain", type=float, default=Settings.weight_gain)
    p.add_argument("--tol", type=float, default=TOL, help="logprob tolerance (nats)")
    p.add_argument("--outlier-frac", type=float, default=OUTLIER_FRACTION)
    p.add_argument("--gpu-mem", type=float, default=Settings.gpu_memory_utilization)
    p.add_argument("--case-timeout", type=int, default=900, help="seconds per case")
    p.add_argument("--resume", action="store_true", help="reuse finished cases found in --out")
    p.add_argument(
        "--time-budget",
        type=int,
        default=None,
        metavar="S",
        help="start no case that would likely end after S seconds (the longest case so far, "
        "at least 60 s); the rest are PENDING and the exit status 3: run again with --resume",
    )
    p.add_argument("--shim", default=None, help="Python file run in each case before vLLM")
    p.add_argument("--vllm", default=None, help="folder holding vllm/ (first on PYTHONPATH)")
    p.add_argument("--triton", default=None, help="folder holding triton/ (first on PYTHONPATH)")
    p.add_argument(
        "--register-entry-point",
        action="store_true",
        help="always write the plugin's stand-in dist-info (default: when the children's "
        "Python has no vllm.general_plugins entry point named triton_mla_sparse)",
    )
    p.add_argument(
        "--no-layer-check",
        action="store_true",
        help="do not check the plugin kernel's calls against the float64 reference",
    )
    p.add_argument(
        "--layer-check-calls",
        type=int,
        default=LAYER_CHECK_CALLS,
        metavar="N",
        help="plugin cases: check the kernel's first N calls of the workload against "
        f"sparse_mla_reference in float64 (at most {LAYER_CHECK_TOKENS} tokens each; "
        f"default {LAYER_CHECK_CALLS})",
    )
    p.add_argument(
        "--layer-check-reference",
        action="store_true",
        help="check vLLM's own backend (FLASHMLA_SPARSE's forward_mqa) against the float64 "
        "reference the same way, to tell which of two disagreeing runs is off",
    )
    p.add_argument(
        "--multiproc", action="store_true", help="keep vLLM's engine-core process (default: off)"
    )
    args = p.parse_args(argv)
    if not args.list and not args.out:
        p.error("--out DIR is required (except with --list)")
    return args


def _parse_capability(text: str) -> tuple[int, int]:
    m = re.fullmatch(r"(?:sm_?)?(\d+)\.(\d)|(?:sm_?)?(\d)(\d)", text.strip(), re.I)
    if not m:
        raise SystemExit(f"--capability {text!r}: expected e.g. 9.0 or 90")
    a, b, c, d = m.groups()
    return (int(a), int(b)) if a else (int(c), int(d))


def main(argv: Sequence[str] | None = None) -> int:
    t_start = time.perf_counter()
    args = parse_args(argv)
    families = list(FAMILIES) if args.family == "both" else [args.family]
    heads = [int(h) for h in args.heads.split(",")] if args.heads else None
    patterns = [p for p in args.cases.split(",") if p]
    env = base_env(args)

    def select(cap: tuple[int, int] | None) -> list[tuple[str, int, Case]]:
        sel = select_cases(families, heads, args.quick, patterns, cap)
        if args.indexer == "case":
            return sel
        return [(f, h, dataclasses.replace(c, indexer=args.indexer)) for f, h, c in sel]

    if args.list:
        cap = _parse_capability(args.capability) if args.capability else None
        print(list_cases(select(cap), cap))
        return 0

    gpu = detect_gpu(env)
    if gpu is None:
        print("vllm_e2e: no CUDA GPU visible to PyTorch: this check needs one", file=sys.stderr)
        return 2
    gpu_name, capability = gpu
    selected = select(capability)
    settings = Settings(
        num_layers=args.layers,
        max_tokens=args.max_tokens or (12 if args.quick else Settings.max_tokens),
        gpu_memory_utilization=args.gpu_mem,
        weight_gain=args.weight_gain,
        tol=args.tol,
        outlier_fraction=args.outlier_frac,
    )
    out = Path(args.out).resolve()
    out.mkdir(parents=True, exist_ok=True)

    # Plugins in the children: entry points first (what vLLM uses), stand-ins where missing.
    probe = probe_env(env)
    if probe["tms"] is None:
        print("vllm_e2e: triton_mla_sparse is not importable from the children", file=sys.stderr)
        return 2
    if probe["vllm_dir"] is None:
        print("vllm_e2e: vllm is not importable (use --vllm SITE?)", file=sys.stderr)
        return 2
    need_plugin_ep = args.register_entry_point or PLUGIN_EP_NAME not in probe["eps"]
    vllm_stand_in = None
    if probe["vllm_dist"] is None:
        vllm_stand_in = _vllm_version_from_source(probe["vllm_dir"])
        if vllm_stand_in is None:
            print("vllm_e2e: vllm has no dist-info and no readable _version.py", file=sys.stderr)
    site = out / "site"  # on the children's PYTHONPATH: stand-in dist-infos only
    shutil.rmtree(site, ignore_errors=True)
    stand_ins = write_dist_infos(
        site, plugin=need_plugin_ep, hooks=True, vllm_version=vllm_stand_in
    )
    env["PYTHONPATH"] = env["PYTHONPATH"] + os.pathsep + str(site)
    if env.get("VLLM_PLUGINS"):  # an allow-list: ours must be on it
        names = env["VLLM_PLUGINS"].split(",") + [PLUGIN_EP_NAME, HOOK_EP_NAME]
        env["VLLM_PLUGINS"] = ",".join(dict.fromkeys(names))
    print(f"vllm_e2e: {gpu_name} (SM{capability[0]}{capability[1]}); stand-ins: {stand_ins}")

    prompts = make_prompts(
        settings.prompt_lengths, settings.vocab_size, settings.seed, settings.shared_prefix
    )
    results: dict[str, dict[str, Any]] = {}
    skips: dict[str, str] = {}
    specs: dict[str, dict[str, Any]] = {}
    for fam, h, case in selected:
        cid = case_id(fam, h, case.name)
        why = skip_reason(case, capability)
        if why:
            skips[cid] = why
            continue
        model_dir = out / "models" / f"{fam}-h{h}-l{settings.num_layers}"
        cfg = write_tiny_config(
            model_dir,
            fam,
            h,
            settings.num_layers,
            hidden_size=settings.hidden_size,
            vocab_size=settings.vocab_size,
        )
        specs[cid] = _case_spec(
            fam,
            h,
            case,
            settings,
            model_dir,
            prompts,
            cfg,
            args.shim,
            0 if args.no_layer_check else args.layer_check_calls,
            args.layer_check_reference,
        )

    todo = list(specs)
    longest = 0.0
    for k, cid in enumerate(todo, start=1):
        spec = specs[cid]
        prev = out / "cases" / (cid.replace("/", "__") + ".json")
        if args.resume and prev.exists():
            old = json.loads(prev.read_text())
            if old.get("status") == "ok" and old.get("spec_hash") == spec["hash"]:
                results[cid] = old
                print(f"[{k}/{len(todo)}] {cid}: reused", flush=True)
                continue
        timeout = args.case_timeout
        if args.time_budget:
            left = args.time_budget - (time.perf_counter() - t_start)
            if left < max(longest, 60.0):  # the next case would likely not finish in time
                results[cid] = {"case": cid, "status": "pending"}
                continue
            timeout = int(min(timeout, left))
        print(f"[{k}/{len(todo)}] {cid} ...", end=" ", flush=True)
        res = run_child(spec, env, out, timeout)
        results[cid] = res
        longest = max(longest, res["seconds"])
        print(f"{res['status']} ({res['seconds']:.0f} s)", flush=True)
    pending = [cid for cid, r in results.items() if r.get("status") == "pending"]

    rows, records, ok = evaluate(selected, results, skips, settings)
    table = format_table(rows)
    summary = {
        "gpu": {"name": gpu_name, "capability": list(capability)},
        "settings": dataclasses.asdict(settings),
        "stand_in_dist_infos": stand_ins,
        "ok": ok,
        "cases": {
            cid: {
                "status": "skipped" if cid in skips else results[cid].get("status"),
                "skip_reason": skips.get(cid),
                "error": results.get(cid, {}).get("error"),
                "traceback_tail": results.get(cid, {}).get("traceback_tail"),
                "info": results.get(cid, {}).get("info"),
                "seconds": results.get(cid, {}).get("seconds"),
                "timing": {
                    name: {k: v for k, v in run.items() if k != "requests"}
                    for name, run in results.get(cid, {}).get("runs", {}).items()
                },
            }
            for cid in [case_id(f, h, c.name) for f, h, c in selected]
        },
        "comparisons": records,
        "table": table,
    }
    (out / "results.json").write_text(json.dumps(summary, indent=1, default=str))
    print()
    print(table)
    if not ok:
        print(f"\nFAIL: {out / 'results.json'}")
        return 1
    if pending:
        print(f"\nINCOMPLETE ({len(pending)} cases not run): {out / 'results.json'}")
        return 3
    print(f"\nPASS: {out / 'results.json'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
