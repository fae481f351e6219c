"""GPU check and timing of the index-q kernel (ops/index_q), the SM80/86 stand-in for vLLM's fused_q.

Checks first (bf16 and fp16 on the GPU, which the CPU interpreter cannot do): rotated MLA query,
rotated index query and weights against a float64 torch port, both rope styles; the e4m3
emulation against torch's e4m3 conversion, bit for bit, in fp32. Then timings from CUDA-graph
replays at DeepSeek-V3.2 (16 query heads per GPU at TP8, 64 index heads) and GLM-5 (8 / 32)
shapes, with the bytes moved and the ratio to the card's measured copy bandwidth. A table last.

    python benchmarks/perf/index_q_gpu.py [--out DIR]

Prints the checks and the table; with ``--out DIR`` also writes DIR/index_q_gpu.json. Exit
status 1 if a check fails, 2 without a GPU.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch

from triton_mla_sparse.ops.index_q import index_q_rope
from triton_mla_sparse.reference import rope_reference
from triton_mla_sparse.testing import measure_ceilings, time_graph


def inputs(T: int, H: int, Hi: int, dtype: torch.dtype, dev: torch.device, seed: int = 0):
    g = torch.Generator(device="cpu").manual_seed(seed)
    cs = (torch.rand(4096, 64, generator=g) * 2 - 1).to(dev)
    pos = torch.randint(0, 4096, (T,), generator=g).to(dev)
    q_pe = torch.randn(T, H, 192, generator=g).to(dtype).to(dev)[..., 128:]  # vLLM's split view
    iq = (torch.randn(T, Hi, 128, generator=g) * 3).to(dtype).to(dev)
    w = torch.randn(T, Hi, generator=g).to(dev)
    return pos, q_pe, cs, iq, w


def check(
    dev: torch.device, dtypes=((torch.bfloat16, 1.6e-2), (torch.float16, 2e-3))
) -> list[dict]:
    rows = []
    for dtype, tol in dtypes:
        for interleave in (False, True):
            pos, q_pe, cs, iq, w = inputs(37, 16, 64, dtype, dev)
            out_pe, out_iq, out_w = index_q_rope(
                pos, q_pe, cs, iq, cs, w, 0.0625, interleave=interleave
            )
            e_pe = (out_pe.double() - rope_reference(q_pe, cs, pos, True)).abs().max().item()
            want = rope_reference(iq, cs, pos, interleave)
            e_iq = ((out_iq.double() - want).abs() / want.abs().clamp_min(1)).max().item()
            e_w = (out_w.double() - w.double() * 0.0625).abs().max().item()
            ok = e_pe <= tol * 2 and e_iq <= tol * 2 and e_w == 0.0
            rows.append(
                dict(
                    check=f"{str(dtype)[6:]} {'interleaved' if interleave else 'neox'}",
                    max_err=max(e_pe, e_iq),
                    ok=ok,
                )
            )
    pos, q_pe, cs, iq, w = inputs(64, 16, 64, torch.float32, dev, seed=1)
    iq[0, 0, 64] = 448.0  # amax / 448 exactly a power of two
    _, plain, _ = index_q_rope(pos, q_pe, cs, iq, cs, w, 0.5)
    _, emu, w_emu = index_q_rope(pos, q_pe, cs, iq, cs, w, 0.5, emulate_fp8=True)
    amax = plain.abs().amax(-1, keepdim=True)
    scale = torch.exp2(torch.ceil(torch.log2(amax.clamp_min(1e-4) / 448.0)))
    want = (plain / scale).to(torch.float8_e4m3fn).float()
    ok = torch.equal(emu, want) and torch.equal(w_emu, w * 0.5 * scale.squeeze(-1))
    rows.append(
        dict(check="e4m3 emulation == torch e4m3 (fp32)", max_err=0.0 if ok else 1.0, ok=ok)
    )
    return rows


def timings(dev: torch.device, copy_gbps: float) -> list[dict]:
    rows = []
    for model, H, Hi in [("DeepSeek-V3.2 TP8", 16, 64), ("GLM-5 TP8", 8, 32)]:
        for T in (1, 8, 64, 512, 4096, 8192):
            pos, q_pe, cs, iq, w = inputs(T, H, Hi, torch.bfloat16, dev)
            out = torch.empty(T, H, 64, dtype=torch.bfloat16, device=dev)

            def fn(a=(pos, q_pe, cs, iq, w, out)):
                index_q_rope(a[0], a[1], a[2], a[3], a[2], a[4], 0.01, q_pe_out=a[5])

            fn()
            us = time_graph(fn)
            # read q_pe, index q, weights, positions, two cos/sin rows; write the same shapes
            moved = 2 * (T * H * 64 * 2 + T * Hi * 128 * 2 + T * Hi * 4) + T * 8 + 2 * T * 64 * 4
            floor_us = moved / (copy_gbps * 1e3)
            rows.append(
                dict(
                    model=model,
                    tokens=T,
                    us=round(us, 2),
                    bytes=moved,
                    floor_us=round(floor_us, 2),
                    x_floor=round(us / floor_us, 2),
                )
            )
    return rows


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument(
        "--out", metavar="DIR", type=Path, default=None, help="directory for index_q_gpu.json"
    )
    args = ap.parse_args()
    if not torch.cuda.is_available():
        print("no GPU: this script needs a CUDA GPU", file=sys.stderr)
        return 2
    dev = torch.device("cuda")
    checks = check(dev)
    ceil = measure_ceilings(dev)
    times = timings(dev, ceil.copy_gbps) if all(c["ok"] for c in checks) else []
    res = dict(
        gpu=torch.cuda.get_device_name(),
        torch=torch.__version__,
        copy_gbps=ceil.copy_gbps,
        checks=checks,
        timings=times,
    )
    if args.out is not None:
        args.out.mkdir(parents=True, exist_ok=True)
        (args.out / "index_q_gpu.json").write_text(json.dumps(res, indent=1))
    for c in checks:
        print(f"{'PASS' if c['ok'] else 'FAIL'}  {c['check']:40s} max err {c['max_err']:.2e}")
    print(f"\ncopy bandwidth {ceil.copy_gbps:.0f} GB/s (measured)")
    print(f"{'model':20s} {'tokens':>6s} {'µs':>8s} {'floor µs':>9s} {'x floor':>8s}")
    for t in times:
        print(
            f"{t['model']:20s} {t['tokens']:6d} {t['us']:8.2f} {t['floor_us']:9.2f} {t['x_floor']:8.2f}"
        )
    return 0 if all(c["ok"] for c in checks) else 1


if __name__ == "__main__":
    sys.exit(main())
