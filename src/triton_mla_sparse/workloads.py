"""Synthetic DSA workloads shared by ``verify``, ``bench`` and the tuning scripts.

A workload is a cache of latent rows (paged, 64-row blocks), per-token top-k lists of distinct
random rows, and queries. Shapes follow DeepSeek-V3.2 / GLM-5: 512 latent + 64 rope.
"""

from __future__ import annotations

import dataclasses

import torch

from .kv_format import pack_fp8_ds_mla, quantize_fp8

PAGE = 64


@dataclasses.dataclass(frozen=True)
class Case:
    name: str
    tokens: int
    heads: int
    topk: int = 2048
    rows: int = 131072
    kv_format: str = "auto"
    dtype: torch.dtype = torch.bfloat16
    rope: int = 64
    holes: bool = False  # -1 padding: a leading run on token 0, tail padding elsewhere
    counts: bool = False  # pass valid_counts (garbage past the count)
    sink: bool = False  # a per-head attention sink (HY V4, DeepSeek-V4)

    @property
    def decode(self) -> bool:
        return self.tokens <= 128


@dataclasses.dataclass
class Inputs:
    q: torch.Tensor
    kv_cache: torch.Tensor
    indices: torch.Tensor
    kwargs: dict
    scale: float


def distinct_topk(tokens: int, rows: int, topk: int, device: torch.device, gen: torch.Generator):
    """[tokens, topk] int32: per token, topk distinct rows drawn uniformly from [0, rows)."""
    out = torch.empty(tokens, topk, dtype=torch.int32, device=device)
    chunk = max(1, (1 << 24) // rows)
    for t0 in range(0, tokens, chunk):
        n = min(chunk, tokens - t0)
        keys = torch.rand(n, rows, device=device, generator=gen)
        out[t0 : t0 + n] = keys.topk(topk, dim=1).indices.to(torch.int32)
    return out


def make_inputs(case: Case, device: torch.device, seed: int = 0) -> Inputs:
    gen = torch.Generator(device=device).manual_seed(seed)
    width = 512 + case.rope
    rows = -(-case.rows // PAGE) * PAGE
    q = torch.randn(case.tokens, case.heads, width, device=device, generator=gen).to(case.dtype)
    base = torch.randn(rows, width, device=device, generator=gen)
    kwargs: dict = {"kv_format": case.kv_format}
    if case.kv_format == "fp8_ds_mla":
        full = base if case.rope else torch.cat([base, torch.zeros_like(base[:, :64])], dim=1)
        kv = pack_fp8_ds_mla(full, "fp32")
    elif case.kv_format == "fp8":
        kv, k_scale = quantize_fp8(base)
        kwargs["k_scale"] = k_scale
    else:
        kv = base.to(case.dtype)
    kv = kv.view(rows // PAGE, PAGE, kv.shape[-1])
    idx = distinct_topk(case.tokens, rows, min(case.topk, rows), device, gen)
    if case.holes:
        idx[0, : min(case.topk, 300)] = -1  # a leading run longer than several gather steps
        idx[1:, -37:] = -1
        idx[-1, 5] = rows + 7  # past the cache: skipped
    if case.counts:
        counts = torch.randint(
            0, case.topk + 1, (case.tokens,), device=device, generator=gen, dtype=torch.int32
        )
        counts[0] = case.topk
        kwargs["valid_counts"] = counts
    if case.sink:
        # around the logits' own scale (|s| of a few units), so that it moves the output
        kwargs["attn_sink"] = torch.randn(case.heads, device=device, generator=gen) * 2.0
    return Inputs(q, kv, idx, kwargs, scale=width**-0.5)


def verify_cases(on_gpu: bool) -> list[Case]:
    """The embedded default workload of ``triton-mla-sparse verify``."""
    if on_gpu:
        return [
            Case("GLM-5 decode, 8 heads", 64, 8, holes=True),
            Case("DeepSeek-V3.2 decode, 16 heads", 128, 16, holes=True, counts=True),
            Case("DeepSeek-V3.2 decode, 128 heads", 32, 128, holes=True),
            Case("prefill chunk, 64 heads", 1024, 64, rows=65536, holes=True),
            Case("GLM-5 decode, fp8_ds_mla", 64, 8, kv_format="fp8_ds_mla", holes=True),
            Case("DSV3.2 decode, fp8_ds_mla", 64, 128, kv_format="fp8_ds_mla", holes=True),
            Case("decode, fp8 per-tensor", 64, 16, kv_format="fp8", holes=True),
            Case("NoPE decode, 16 heads", 32, 16, rope=0, holes=True),
            Case("decode with attention sink, 16 heads", 64, 16, holes=True, sink=True),
        ]
    small = dict(topk=400, rows=4096, dtype=torch.float16)
    return [
        Case("GLM-5 decode, 8 heads (reduced)", 2, 8, holes=True, **small),
        Case("DeepSeek-V3.2 decode, 16 heads (reduced)", 3, 16, holes=True, counts=True, **small),
        Case("prefill chunk, 64 heads (reduced)", 4, 64, holes=True, **small),
        Case("fp8_ds_mla decode (reduced)", 2, 16, kv_format="fp8_ds_mla", holes=True, **small),
        Case("fp8 per-tensor decode (reduced)", 2, 8, kv_format="fp8", holes=True, **small),
        Case("decode with attention sink (reduced)", 2, 16, holes=True, sink=True, **small),
    ]
