"""fp8_ds_mla's warp-specialized sm90 kernel with a reference scale that changes every step.

    compute-sanitizer --tool racecheck --racecheck-report all \
        python benchmarks/reliability/ds_step_scale_probe.py [--tokens 8] [--heads 64]
    python benchmarks/reliability/ds_step_scale_probe.py --dry-run   # the data's facts, no GPU

The warp-specialized kernel (``KernelConfig.gluon="specialized"``, the sm90 default for
fp8_ds_mla under Triton 3.6) dequantizes each step's rows relative to the step's largest
power-of-two scale and hands that reference scale to the MMA warps through a two-slot shared
ring (stores, a barrier among the dequantizing warps, one thread's ``mbarrier.arrive``). Random
normal rows give every step the same reference scale (the sanitizer suite's data), so a slot
read one step late would still hold the right value and neither the result check nor a
sanitizer run over that data can tell. Here every row's magnitude is a power of two set by its
64-row block, and each token's indices walk the rows in order from an offset of its own, so
consecutive steps have different reference scales (the script asserts it before the launch),
with a few -1 entries so that some steps are partly empty.

The output and LSE are checked against the float64 reference; the exit status is 1 if they
differ, so a racecheck report over a run that exits 0 is about the tool's model of the
hand-over, not a wrong value.
"""

from __future__ import annotations

import argparse
import sys

import torch

from triton_mla_sparse import sparse_mla
from triton_mla_sparse.kv_format import pack_fp8_ds_mla
from triton_mla_sparse.ops.sparse_mla.heuristics import KernelConfig
from triton_mla_sparse.reference import sparse_mla_reference
from triton_mla_sparse.testing.compare import compare_sparse_mla

LATENT, ROPE = 512, 64
# the warp-specialized form's tile: 64 heads x 64 rows per step, one gather slot (its own
# two-slot fp16 ring), stage-dequantized into the fp16 fold
WS_CONFIG = KernelConfig(64, 64, 8, 1, stage_dequant=True, fp16_fold=True, gluon="specialized")
STEP = WS_CONFIG.block_n
# row magnitudes 2^e for e in this range, one exponent per STEP-row block of the cache
MAG_EXPONENTS = (-3, 2, -1, 4, 0, -2, 3, 1)


def make_problem(tokens: int, heads: int, width: int, seed: int = 0):
    """(q, cache, indices, per-step reference exponents per token) on the CPU."""
    g = torch.Generator().manual_seed(seed)
    num_rows = width + tokens * STEP + STEP
    blocks = torch.arange(num_rows) // STEP
    exps = torch.tensor(MAG_EXPONENTS)[blocks % len(MAG_EXPONENTS)]
    rows = torch.randn(num_rows, LATENT + ROPE, generator=g) * torch.exp2(exps.float())[:, None]
    cache = pack_fp8_ds_mla(rows, "pow2")
    # token t reads rows t*STEP + 0.5*STEP ... in order: every step straddles two blocks
    start = torch.arange(tokens) * STEP + STEP // 2
    idx = start[:, None] + torch.arange(width)[None, :]
    holes = torch.rand(tokens, width, generator=g) < 0.05
    idx = torch.where(holes, torch.full_like(idx, -1), idx).to(torch.int32)
    q = torch.randn(tokens, heads, LATENT + ROPE, generator=g).to(torch.bfloat16)
    # each step's largest row exponent (the kernel's reference scale follows it)
    safe = idx.clamp(min=0).long()
    e = torch.where(idx >= 0, exps[safe], torch.full_like(safe, -100))
    step_max = e.view(tokens, width // STEP, STEP).amax(-1)
    return q, cache, idx, step_max


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--tokens", type=int, default=8)
    p.add_argument("--heads", type=int, default=64)
    p.add_argument("--width", type=int, default=2048, help="indices per token (top-k)")
    p.add_argument("--dry-run", action="store_true", help="build the data, check it, no launch")
    args = p.parse_args(argv)
    if args.width % STEP:
        p.error(f"--width must be a multiple of {STEP}, got {args.width}")
    q, cache, idx, step_max = make_problem(args.tokens, args.heads, args.width)
    changes = int((step_max[:, 1:] != step_max[:, :-1]).sum())
    steps = step_max[:, 1:].numel()
    print(
        f"{args.tokens} tokens x {args.width // STEP} steps: the reference scale changes at "
        f"{changes} of {steps} step boundaries"
    )
    if changes * 2 < steps:
        print("FAIL: the data does not change the reference scale between most steps")
        return 1
    if args.dry_run:
        return 0
    if not torch.cuda.is_available():
        print("no GPU: nothing launched (--dry-run checks the data alone)")
        return 1
    dev = torch.device("cuda")
    scale = (LATENT + ROPE) ** -0.5
    q_d, cache_d, idx_d = q.to(dev), cache.to(dev), idx.to(dev)
    out, lse = sparse_mla(
        q_d, cache_d, idx_d, scale, kv_format="fp8_ds_mla", return_lse=True, config=WS_CONFIG
    )
    torch.cuda.synchronize()
    ref, ref_lse = sparse_mla_reference(
        q, cache, idx, scale, kv_format="fp8_ds_mla", return_lse=True, compute_dtype=torch.float64
    )
    res = compare_sparse_mla(out.cpu(), ref, lse=lse.cpu(), ref_lse=ref_lse)
    print(
        f"warp-specialized fp8_ds_mla, {args.tokens} tokens x {args.heads} heads: "
        f"rel err {res.err:.3g} (bound {res.tolerance.out_rtol:g}), LSE err {res.lse_err:.3g}"
    )
    if res.failures:
        print("FAIL: " + "; ".join(res.failures))
        return 1
    print("PASS")
    return 0


if __name__ == "__main__":
    sys.exit(main())
