"""Why two correct kernels disagree more with an fp8_ds_mla cache than with a bf16 cache.

CPU only, no Triton: the rounding steps of two sparse-MLA decode paths emulated in torch on the
same inputs, against float64 on the same cache bytes:

- FlashMLA as vLLM 0.33 runs it on SM90 for fp8_ds_mla (prefill: ``cp_gather_and_upconvert_fp8_kv_cache``
  into a bf16 workspace, then the bf16 kernel; decode: the same dequantization inside the kernel):
  every e4m3 value times its tile scale is rounded to bf16, the softmax weights P are rounded to
  bf16 for the PV product;
- this kernel's fp16-operand path: the e4m3 values are exact fp16 operands, the tile scale is
  applied in float32 to the logits and folded into P, and P is rounded to fp16 (relative to the
  step's largest scale; emulated with one step, an upper bound on that rounding).

With a bf16 cache both round the same things the same way, so their bf16 outputs coincide almost
everywhere; with fp8_ds_mla a large share of output elements differ by about one bf16 ulp, and a
model whose top-k selection and logits amplify small differences then disagrees at many more
positions (docs/VLLM.md, vLLM end to end). The "this kernel" row is checked against the kernel
itself on an H200 inside vLLM (tools/vllm_e2e.py's layer check measured 1.66e-3 on the engine's
own tensors, docs/perf-log/12-vllm-e2e-fp8-h200.txt).

    python benchmarks/reliability/fp8_ds_mla_rounding.py [--tokens 64] [--heads 16] [--topk 2048]

It also prints the LSE of the folded forms (kernels/ds_mla.py: the scales multiplied into the
tile, rounded once to bf16 or to fp16) beside the unfolded fp16 operands, for latents of growing
magnitude: the bf16 fold is what left the LSE outside the contract tests' 0.01 on an H200
(docs/perf-log/20-gpu-check-fold-trial-h200.txt).
"""

from __future__ import annotations

import argparse

import torch

LATENT, ROPE, TILE = 512, 64, 128  # DeepSeek-V3.2's fp8_ds_mla row: 4 tiles of 128 e4m3 values
E4M3_MAX = 448.0
SCALE_FLOOR = 1e-4  # vLLM's writer: amax clamped before / 448
SOFTMAX_SCALE = 192**-0.5  # DeepSeek-V3.2 (qk head dim 192)
F64 = torch.float64


def quantize(latent: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """[N, 512] float32 -> (e4m3 values as float32 [N, 4, 128], float32 tile scales [N, 4])."""
    tiles = latent.view(latent.shape[0], LATENT // TILE, TILE)
    scale = tiles.abs().amax(-1).clamp_min(SCALE_FLOOR) / E4M3_MAX
    return (tiles / scale[..., None]).to(torch.float8_e4m3fn).float(), scale


def softmax_pv(s: torch.Tensor, v: torch.Tensor, p_dtype: torch.dtype) -> torch.Tensor:
    """Online-softmax result of fp32 logits s [T, H, N] with P rounded to p_dtype for PV."""
    p = torch.exp(s - s.amax(-1, keepdim=True))
    return torch.einsum("thn,nd->thd", p.to(p_dtype).float(), v.float()) / p.sum(-1, keepdim=True)


def reference(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    s = torch.einsum("thd,nd->thn", q.to(F64), k.to(F64)) * SOFTMAX_SCALE
    return torch.einsum("thn,nd->thd", torch.softmax(s, -1), v.to(F64))


def bf16_kernel(q: torch.Tensor, k: torch.Tensor) -> torch.Tensor:
    """A bf16 kernel on bf16 K/V (V = the latent part): fp32 logits, bf16 P."""
    s = torch.einsum("thd,nd->thn", q.float(), k.float()) * SOFTMAX_SCALE
    return softmax_pv(s, k[:, :LATENT], torch.bfloat16)


def bf16_kernel_split(q: torch.Tensor, k: torch.Tensor, splits: int = 4) -> torch.Tensor:
    """The same bf16 kernel with its keys in ``splits`` parts merged through their LSEs (split-K:
    another order of the same float32 sums, as two real kernels differ)."""
    s = torch.einsum("thd,nd->thn", q.float(), k.float()) * SOFTMAX_SCALE
    outs, lses = [], []
    for part, kv in zip(s.chunk(splits, -1), k[:, :LATENT].chunk(splits, 0)):
        m = part.amax(-1, keepdim=True)
        p = torch.exp(part - m)
        l_ = p.sum(-1, keepdim=True)
        outs.append(torch.einsum("thn,nd->thd", p.bfloat16().float(), kv.float()) / l_)
        lses.append(m + torch.log(l_))
    lse = torch.logsumexp(torch.stack(lses), 0)
    return sum(o * torch.exp(ls - lse) for o, ls in zip(outs, lses))


def fp16_operand_kernel(
    q: torch.Tensor, e4m3: torch.Tensor, scale: torch.Tensor, rope: torch.Tensor
) -> torch.Tensor:
    """This kernel's fp8_ds_mla path with fp16 MMA operands (see the module docstring)."""
    t, h = q.shape[:2]
    qh = q.half().float()
    s = torch.einsum("thgd,ngd->thng", qh[..., :LATENT].view(t, h, -1, TILE), e4m3)
    s = (s * scale).sum(-1) + torch.einsum("thd,nd->thn", qh[..., LATENT:], rope.half().float())
    s = s * SOFTMAX_SCALE
    p = torch.exp(s - s.amax(-1, keepdim=True))
    b_ref = scale.amax()
    p_h = (p[..., None] * scale / b_ref).half().float()
    o = torch.einsum("thng,ngd->thgd", p_h, e4m3).reshape(t, h, LATENT) * b_ref
    return o / p.sum(-1, keepdim=True)


def lse_error(
    q: torch.Tensor, k_nope: torch.Tensor, rope: torch.Tensor, ref: torch.Tensor
) -> float:
    """Largest |LSE - float64 LSE| of q against keys whose NoPE part is k_nope (as rounded)."""
    k = torch.cat([k_nope.to(F64), rope.to(F64)], -1)
    lse = torch.logsumexp(torch.einsum("thd,nd->thn", q.to(F64), k) * SOFTMAX_SCALE, -1)
    return (lse - ref).abs().max().item()


def folded_lse_rows(q: torch.Tensor, latent: torch.Tensor, rope: torch.Tensor) -> list[str]:
    """The LSE of the folded forms (scales multiplied into the tile, one rounding of each
    dequantized value to the MMA type) against the unfolded fp16 operands, for latents of
    growing magnitude (logits grow with them; the contract tests' rows reach 3x a unit normal).
    fp16 is folded relative to the largest scale (emulated with one step holding every key,
    the widest range a step can have)."""
    rows = []
    for gain in (0.5, 1.0, 3.0):
        e4m3, scale = quantize(latent * gain)
        n = latent.shape[0]
        exact = (e4m3 * scale[..., None]).view(n, LATENT)
        ref = torch.logsumexp(
            torch.einsum("thd,nd->thn", q.to(F64), torch.cat([exact.to(F64), rope.to(F64)], -1))
            * SOFTMAX_SCALE,
            -1,
        )
        ref_scale = scale.amax()
        forms = {
            "fp16 operands, fp32 scales (unfolded)": exact,
            "folded, bf16": exact.bfloat16(),
            "folded, fp16 (relative to largest)": (
                (e4m3 * (scale / ref_scale)[..., None]).half().to(F64) * ref_scale.to(F64)
            ).view(n, LATENT),
        }
        for name, k_nope in forms.items():
            rows.append(f"latent x{gain:<4} {name:40} {lse_error(q, k_nope, rope, ref):.4f}")
    return rows


def compare(title: str, outs: dict[str, torch.Tensor], ref: torch.Tensor) -> list[str]:
    rows, b = [], {k: o.bfloat16() for k, o in outs.items()}
    for name, o in b.items():
        err = ((o.to(F64) - ref).norm() / ref.norm()).item()
        rows.append(f"{title:11} {name:40} {err:.2e}")
    (_, a), (_, c) = b.items()
    share = (a != c).float().mean().item()
    diff = ((a.to(F64) - c.to(F64)).norm() / ref.norm()).item()
    rows.append(f"{title:11} {'the two bf16 outputs differ in':40} {100 * share:.1f} % of elements")
    rows.append(f"{title:11} {'(relative difference)':40} {diff:.2e}")
    return rows


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--tokens", type=int, default=64)
    ap.add_argument("--heads", type=int, default=16)
    ap.add_argument("--topk", type=int, default=2048, help="keys each token attends to")
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args(argv)
    g = torch.Generator().manual_seed(args.seed)
    n = args.topk
    latent = torch.randn(n, LATENT, generator=g) * 0.5
    rope = (torch.randn(n, ROPE, generator=g) * 0.5).bfloat16()
    q = torch.randn(args.tokens, args.heads, LATENT + ROPE, generator=g).bfloat16()

    k16 = torch.cat([latent.bfloat16(), rope], -1)
    rows = compare(
        "bf16 cache",
        {
            "bf16 kernel (one pass)": bf16_kernel(q, k16),
            "bf16 kernel (4-way split-K)": bf16_kernel_split(q, k16),
        },
        reference(q, k16, k16[:, :LATENT]),
    )
    e4m3, scale = quantize(latent)
    exact = (e4m3 * scale[..., None]).view(n, LATENT)
    kx = torch.cat([exact, rope.float()], -1)
    upconverted = torch.cat([exact.bfloat16(), rope], -1)
    rows += compare(
        "fp8_ds_mla",
        {
            "FlashMLA's path (bf16 upconvert, bf16 P)": bf16_kernel(q, upconverted),
            "this kernel (fp16 e4m3, fp32 scale, fp16 P)": fp16_operand_kernel(
                q, e4m3, scale, rope
            ),
        },
        reference(q, kx, exact),
    )
    print(f"{'cache':11} {'path':40} relative error vs float64 (bf16 output)")
    print("\n".join(rows))
    print(f"\n{'fp8_ds_mla':11} {'path':40} largest LSE error vs float64 (nats)")
    print("\n".join(folded_lse_rows(q, latent / 0.5, rope)))


if __name__ == "__main__":
    main()
