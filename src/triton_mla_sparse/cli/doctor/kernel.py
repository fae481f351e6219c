"""Which kernel path a GPU runs: asked of the library's launch plan, no vLLM needed.

The plan (``ops.sparse_mla.plan.make_plan``) is what ``sparse_mla`` launches: the tiles for the
target's shared memory, the e4m3 decode (hardware conversion on sm_89+, integer arithmetic on
sm_80/86) and the split count. It is pure Python on shapes, so it answers for a simulated GPU too.
"""

from __future__ import annotations

import dataclasses

import torch

from triton_mla_sparse.ops.sparse_mla.heuristics import TARGETS, Arch
from triton_mla_sparse.ops.sparse_mla.plan import SCALED_FAMILIES, LaunchPlan, make_plan
from triton_mla_sparse.vllm_plugin import KV_FORMAT_OF

MIN_CAPABILITY = (8, 0)
TOPK = 2048  # index_topk of DeepSeek-V3.2 and GLM-5
# (label, tokens): a single decode token, a decode batch, a prefill chunk
SHAPES = (("decode 1 token", 1), ("decode 128 tokens", 128), ("prefill 4096 tokens", 4096))


ROWS = {"auto": "bf16 rows", "fp8": "e4m3 rows", "fp8_ds_mla": "fp8_ds_mla rows"}


def _n(count: int, word: str) -> str:
    return f"{count} {word}{'s' if count != 1 else ''}"


def ring_words(c) -> str:
    """How a Gluon kernel pipelines (KernelConfig.gluon): the sm90 ones through their own
    two-slot ring, the mma.sync ones through a ring of KernelConfig.num_stages slots."""
    slots = c.num_stages if c.gluon == "ampere" else 2
    return f"Gluon {c.gluon} kernel, {_n(slots, 'ring slot')}"


def arch_for(cap: tuple[int, int], num_sms: int | None = None) -> tuple[Arch, str]:
    """The compile target of ``cap`` (with this GPU's SM count when known) and a note."""
    cc = cap[0] * 10 + cap[1]
    known = next((a for a in TARGETS if a.backend == "cuda" and a.cc == cc), None)
    if known is None:
        arch, note = (
            Arch("cuda", cc, num_sms or 132),
            f"sm_{cc} is not a target the project compiles",
        )
        return arch, note + " (tiles as for an unknown part: 99 KB shared memory)"
    if num_sms is not None and num_sms != known.num_sms:
        return dataclasses.replace(known, num_sms=num_sms), ""
    return known, ""


def mma_words(plan: LaunchPlan) -> str:
    """How an e4m3 cache reaches the tensor cores in ``plan``, in words ("" for bf16 rows)."""
    c = plan.constexprs
    scaled = plan.family in SCALED_FAMILIES
    if not (c.get("E4M3") or scaled):
        return ""
    if c["MMA_FP16"]:
        words = "fp16 MMAs" + (", scales folded into the tile" if c.get("FOLD_FP16") else "")
    else:
        words = "bf16 MMAs" + (", scales folded into the tile" if scaled else "")
    if c.get("STAGE"):
        words += ", tiles dequantized once through shared memory"
    if not c["FP8_NATIVE"] and plan.config.e4m3_decode in ("packed", "packed-nomask"):
        words += ", packed integer decode"
    return "; " + words


def kernel_lines(
    cap: tuple[int, int], heads: int, kv_cache_dtype: str, num_sms: int | None = None
) -> list[str]:
    """What ``sparse_mla`` launches on ``cap`` for ``heads`` query heads per GPU, bf16 q."""
    tag = f"sm_{cap[0]}{cap[1]}"
    if cap < MIN_CAPABILITY:
        return [f"kernel: not for {tag} (needs sm_80 or newer)"]
    arch, note = arch_for(cap, num_sms)
    kv_format = KV_FORMAT_OF.get(kv_cache_dtype)
    if kv_format is None:
        return [f"kernel: does not read a {kv_cache_dtype} cache"]
    decode = (
        "hardware e4m3 conversion"
        if arch.fp8_native
        else "integer e4m3 decode (no fp8 types below sm_89)"
    )
    sms = f"{arch.num_sms} SMs" if num_sms is not None else f"{arch.num_sms} SMs assumed"
    lines = [
        f"kernel on {tag}: {arch.smem_bytes // 1024} KB shared memory per block, {sms}; "
        f"fp8 caches: {decode}"
    ]
    if note:
        lines.append(f"  note: {note}")
    for label, tokens in SHAPES:
        plan = make_plan(
            num_tokens=tokens,
            num_heads=heads,
            latent=512,
            rope=64,
            width=TOPK,
            dtype=torch.bfloat16,
            kv_format=kv_format,
            arch=arch,
            on_gpu=True,
        )
        c = plan.config
        stages = ring_words(c) if c.gluon else _n(c.num_stages, "stage")
        lines.append(
            f"  {label} x {heads} heads, {ROWS[kv_format]}, top-k {TOPK}: {plan.family} kernel, "
            f"{c.block_h} heads x {c.block_n} rows per step, {c.num_warps} warps, "
            f"{stages}, {_n(c.num_splits, 'split')}{mma_words(plan)}"
        )
    return lines
