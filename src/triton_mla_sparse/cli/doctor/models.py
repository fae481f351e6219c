"""What a user asks the doctor about: a model, a tensor-parallel size, a cache dtype, a GPU.

The models are the released checkpoints' attention geometry (their ``config.json``), which is all
vLLM's selection reads of them; the doctor takes the checkpoint as bf16 without a kv-cache
quantization scheme (one would change what ``auto`` resolves to). GPU facts that vLLM's code does
not encode (a kernel known to hang on one part) are in :data:`KNOWN_ISSUES`.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from triton_mla_sparse.vllm_plugin import KV_FORMAT_OF

HEAD_SIZE = 576  # kv_lora_rank 512 + qk_rope_head_dim 64, the MLA latent row
# What --kv-cache-dtype may say: the dtypes the backend serves (vLLM accepts more, e.g. fp8_e5m2,
# which neither this backend nor vLLM's sparse MLA backends on these models take).
KV_CACHE_DTYPES = tuple(KV_FORMAT_OF)
# The matrix `doctor --all` prints: both models at TP8 and TP1 with these cache dtypes.
ALL_TP_SIZES = (8, 1)
ALL_KV_CACHE_DTYPES = ("auto", "bfloat16", "fp8_ds_mla")

# "8.0" / "12.1", or the digits of an sm_XY(Z) target name, with an optional arch suffix (90a).
_CAPABILITY_RE = re.compile(r"(?:sm_?)?(?:(\d{1,2})\.(\d)|(\d{2,3}))[af]?", re.IGNORECASE)
CAPABILITY_HELP = "8.0, 80, sm80 or sm_80 (also 8.6, 8.9, 9.0, 10.0, 12.0, 12.1)"


@dataclass(frozen=True)
class Model:
    label: str
    names: tuple[str, ...]  # what --model accepts (lower case), the Hugging Face id first
    architecture: str  # the HF "architectures" entry vLLM keys its config hooks on
    config_cls: str  # transformers class name, or "module:Class" for a config vLLM ships
    config: tuple[tuple[str, int], ...]  # the checkpoint's attention geometry (config.json)
    layers: int  # num_hidden_layers: each holds one MLA cache row and one indexer row per token
    # A per-head learnable attention sink (HY V4): the model binds its attention backend itself
    # (a sink-capable one, else it drops the sink), after vLLM's selection.
    sink: bool = False
    # Whether the model runs DeepSeek-V3.2's attention module (its fused_q / fused_norm_rope,
    # which the plugin replaces on SM80/86), and, for one that does not, its own DSA path.
    dsv32_module: bool = True
    path_note: str = ""

    @property
    def num_heads(self) -> int:
        return dict(self.config)["num_attention_heads"]


MODELS = (
    Model(
        "DeepSeek-V3.2",
        ("deepseek-ai/deepseek-v3.2", "deepseek-v3.2", "deepseek-v32", "dsv32"),
        "DeepseekV32ForCausalLM",
        "DeepseekV32Config",
        (
            ("num_attention_heads", 128),
            ("kv_lora_rank", 512),
            ("qk_rope_head_dim", 64),
            ("qk_nope_head_dim", 128),
            ("v_head_dim", 128),
            ("index_topk", 2048),
            ("index_n_heads", 64),
            ("index_head_dim", 128),
        ),
        61,
    ),
    Model(
        "GLM-5",
        ("zai-org/glm-5", "glm-5", "glm5"),
        "GlmMoeDsaForCausalLM",
        "GlmMoeDsaConfig",
        (
            ("num_attention_heads", 64),
            ("kv_lora_rank", 512),
            ("qk_rope_head_dim", 64),
            ("qk_nope_head_dim", 192),
            ("v_head_dim", 256),
            ("index_topk", 2048),
            ("index_n_heads", 32),
            ("index_head_dim", 128),
        ),
        78,
    ),
    Model(
        "HY V4",
        ("hy-v4", "hyv4", "hy_v4", "hyv4forcausallm"),
        "HYV4ForCausalLM",
        # vLLM's own config class (transformers has none); its defaults are the checkpoint's
        # (vllm/transformers_utils/configs/hy_v4.py:90-131)
        "vllm.transformers_utils.configs.hy_v4:HYV4Config",
        (
            ("num_attention_heads", 32),
            ("kv_lora_rank", 512),
            ("qk_rope_head_dim", 64),
            ("qk_nope_head_dim", 192),
            ("v_head_dim", 256),
            ("index_topk", 2048),
            ("index_n_heads", 16),
            ("index_head_dim", 128),
            ("learnable_sink", True),
        ),
        34,
        sink=True,
        dsv32_module=False,
        path_note=(
            "index q: vLLM's CUDA per_token_group_quant_fp8 (e4m3; on SM80/86 the plugin's "
            "SparseAttnIndexer casts it exactly to the model dtype), index K: vLLM's CUDA "
            "indexer_k_quant_and_cache, MLA cache (bf16, fp8, fp8_ds_mla): vLLM's CUDA "
            "concat_and_cache_mla; all three have sm80/86/89 cubins"
        ),
    ),
)
MODEL_HELP = "deepseek-v3.2, glm-5 or hy-v4 (or their Hugging Face ids / architecture)"

# (capability, vLLM backend) -> what goes wrong when vLLM selects that backend on that GPU.
KNOWN_ISSUES: dict[tuple[tuple[int, int], str], str] = {
    ((12, 1), "FLASHINFER_MLA_SPARSE_SM120"): (
        "its kernel livelocks on GB10 / DGX Spark (sm_121; flashinfer#3700, vllm#49026)"
    ),
}


def parse_capability(text: str) -> tuple[int, int]:
    """``8.0``, ``80``, ``sm80``, ``sm_80``, ``12.1``, ``121`` -> (major, minor); else ValueError."""
    m = _CAPABILITY_RE.fullmatch(text.strip())
    if m is not None:
        major, minor, digits = m.groups()
        if digits is not None:  # "80" / "sm_121": the last digit is the minor version
            major, minor = digits[:-1], digits[-1]
        if int(major) >= 1:
            return int(major), int(minor)
    raise ValueError(f"--capability {text!r} is not a compute capability (e.g. {CAPABILITY_HELP})")


def parse_model(text: str) -> Model:
    """A model by any of its names (case-insensitive); else ValueError listing them."""
    key = text.strip().lower()
    for model in MODELS:
        if key in model.names:
            return model
    raise ValueError(f"--model {text!r} is not a model the doctor knows ({MODEL_HELP})")


def parse_tp(text: str, model: Model) -> int:
    """A tensor-parallel size that divides the model's query heads; else ValueError."""
    try:
        tp = int(text)
    except ValueError:
        tp = 0
    if tp < 1 or model.num_heads % tp:
        raise ValueError(
            f"--tp {text!r} must be a positive divisor of {model.label}'s "
            f"{model.num_heads} query heads"
        )
    return tp


def capability_text(cap: tuple[int, int]) -> str:
    return f"sm_{cap[0]}{cap[1]}"
