"""Does compute-sanitizer racecheck flag Triton's own warp-specialize hand-off?

    compute-sanitizer --tool racecheck --racecheck-report all \
        python benchmarks/reliability/ws_racecheck_probe.py [--regs] [--default-warps 8] [--scratch]
    compute-sanitizer --tool racecheck --racecheck-report all \
        python benchmarks/reliability/ws_racecheck_probe.py --ring --regs --default-warps 8
    python benchmarks/reliability/ws_racecheck_probe.py --compile-only [--regs] [--scratch] [--ring]   # no GPU

The kernel is ``gl.warp_specialize``: the default partition doubles one vector, a worker
partition adds one to another, and both take a few scalar arguments, one of them loaded before
the split. As it is, all the shared memory it touches is Triton's lowering: the state byte each
worker warp reads to find its partition and the words that carry the captured arguments,
written by the default warps and read by the workers on the far side of a whole-block
``barrier.sync 1``. ``--default-warps 8 --scratch`` gives the default partition the shape of the
sparse_mla warp-specialized kernels' MMA warps (``KernelConfig.gluon="specialized"``): eight
warps that cross their vector between threads through a shared buffer of their own under a
barrier among themselves (``bar.sync 0, 256``).

Measured on an H200 (docs/perf-log/28-sanitize-h200.txt): no report as it is, under Triton 3.6
and 3.8; with ``--default-warps 8 --scratch`` 3-11 "potential RAW" reports, every one between
the default warps' store of the exit state and a worker's load of its state byte, which sit on
opposite sides of a matched whole-block barrier: racecheck's model of that barrier mix, the
same kind of report the sparse_mla kernels drew (docs/perf-log/27-sanitize-gluon-h200.txt), not
a race.

``--ring`` asks the other question the sparse_mla warp-specialized kernels raise: the worker
(the dequantizing warps' shape, four warps) writes a vector that changes every step into a
two-slot shared ring, from a layout that holds each element on four threads of one warp, then
``bar.sync`` among its warps and one thread's ``mbarrier.arrive`` on the slot's "ready"
barrier; the default warps wait on it, read the vector, ``bar.sync`` among themselves and one
thread arrives on "empty", which the worker waits on before it writes the slot again: the
hand-over of the DeepSeek-V4 kernel's mask ring before it was removed and of the fp8_ds_mla
kernel's per-step reference scale. The default warps add up what they read; the result is
checked, so a report with a correct result is about the tool's model of that ordering. On an
H200 (docs/perf-log/37-gpu-check-h200.txt) the outputs are correct and racecheck reports 1100
(Triton 3.6) / 1380 (3.8) potential RAW hazards between the worker's store and the default
warps' load: it flags this ordering on a correct kernel.

On a GPU the outputs are checked and the script exits 1 if one is wrong. ``--regs`` passes
``worker_num_regs`` (register reallocation, ``setmaxnreg``, as the sparse_mla kernels do;
Triton 3.6 requires it). ``--compile-only`` compiles for sm90 ahead of time and prints the
PTX's hand-off: its ``barrier.sync 1`` count, ``setmaxnreg`` count, shared stores and loads and
``bar.sync 0`` count.
"""

from __future__ import annotations

import argparse
import re
import sys

import torch
import triton
from triton.backends.compiler import GPUTarget
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.ampere import mbarrier

# elements per partition's vector, registers the worker asks for with --regs
BLOCK = 1024
WORKER_REGS = 48
# the ring mode: elements per slot (the sparse_mla kernels' rows per step) and steps per program
RING_N = 64
RING_STEPS = 8


# the CTA barrier: barrier from Triton 3.8 on, thread_barrier in 3.6
_BARRIER = getattr(gl, "barrier", None) or gl.thread_barrier


@gluon.jit
def _double(x_ptr, y_ptr, n, start, BLOCK: gl.constexpr, SCRATCH: gl.constexpr):
    layout: gl.constexpr = gl.BlockedLayout([4], [32], [gl.num_warps()], [0])
    o = start + gl.arange(0, BLOCK, layout=layout)
    v = gl.load(x_ptr + o, mask=o < n)
    if SCRATCH:
        # what the sparse_mla kernels' MMA warps do: a buffer of their own in shared memory
        # (which Triton may place over the hand-off words, dead by then), crossed between
        # threads (stored in one layout, read in another) under the partition's barrier
        # (bar.sync 0 over the default warps alone)
        other: gl.constexpr = gl.BlockedLayout([1], [32], [gl.num_warps()], [0])
        flat: gl.constexpr = gl.SwizzledSharedLayout(vec=1, per_phase=1, max_phase=1, order=[0])
        buf = gl.allocate_shared_memory(gl.float32, [BLOCK], flat)
        buf.store(v)
        _BARRIER()
        w = buf.load(other)
        _BARRIER()
        buf.store(w * 2.0)
        _BARRIER()
        v = buf.load(layout) * 0.5
    gl.store(y_ptr + o, v * 2.0, mask=o < n)


@gluon.jit
def _add_one(a_ptr, b_ptr, n, start, BLOCK: gl.constexpr):
    layout: gl.constexpr = gl.BlockedLayout([4], [32], [gl.num_warps()], [0])
    o = start + gl.arange(0, BLOCK, layout=layout)
    gl.store(b_ptr + o, gl.load(a_ptr + o, mask=o < n) + 1.0, mask=o < n)


@gluon.jit
def ws_probe_kernel(
    x_ptr,
    y_ptr,
    a_ptr,
    b_ptr,
    starts_ptr,
    n,
    BLOCK: gl.constexpr,
    WORKER_WARPS: gl.constexpr,
    WORKER_REGS: gl.constexpr,
    SCRATCH: gl.constexpr,
):
    # loaded before the split (Triton cannot recompute it in the worker): the worker receives it
    # through Triton's capture words
    start = gl.load(starts_ptr + gl.program_id(0))
    if WORKER_REGS > 0:
        gl.warp_specialize(
            [
                (_double, (x_ptr, y_ptr, n, start, BLOCK, SCRATCH)),
                (_add_one, (a_ptr, b_ptr, n, start, BLOCK)),
            ],
            [WORKER_WARPS],
            [WORKER_REGS],
        )
    else:
        gl.warp_specialize(
            [
                (_double, (x_ptr, y_ptr, n, start, BLOCK, SCRATCH)),
                (_add_one, (a_ptr, b_ptr, n, start, BLOCK)),
            ],
            [WORKER_WARPS],
        )


@gluon.jit
def _ring_consumer(out_ptr, ring, ready, empty, N: gl.constexpr, STEPS: gl.constexpr):
    # the default warps: wait for each slot, read it, hand it back; the sum is checked
    layout: gl.constexpr = gl.BlockedLayout([1], [32], [gl.num_warps()], [0])
    acc = gl.zeros([N], gl.float32, layout=layout)
    for i in range(STEPS):
        slot = i % 2
        mbarrier.wait(ready.index(slot), (i // 2) & 1)
        acc += ring.index(slot).load(layout)
        _BARRIER()  # every default thread has read the slot before one of them hands it back
        mbarrier.arrive(empty.index(slot))
    o = gl.arange(0, N, layout=layout)
    gl.store(out_ptr + gl.program_id(0) * N + o, acc)


@gluon.jit
def _ring_producer(ring, ready, empty, N: gl.constexpr, STEPS: gl.constexpr):
    # the worker: each element on four threads of one warp, as the V4 kernel's rows were
    tile: gl.constexpr = gl.BlockedLayout([1, 8], [8, 4], [gl.num_warps(), 1], [1, 0])
    rows: gl.constexpr = gl.SliceLayout(1, tile)
    o = gl.arange(0, N, layout=rows)
    for i in range(STEPS):
        slot = i % 2
        mbarrier.wait(empty.index(slot), ((i // 2) & 1) ^ 1)
        ring.index(slot).store((o * (i + 1) + gl.program_id(0)).to(gl.float32))
        _BARRIER()  # every worker thread's store is in before one of them publishes
        mbarrier.arrive(ready.index(slot))


@gluon.jit
def ws_ring_probe_kernel(
    out_ptr,
    N: gl.constexpr,
    STEPS: gl.constexpr,
    WORKER_WARPS: gl.constexpr,
    WORKER_REGS: gl.constexpr,
):
    flat: gl.constexpr = gl.SwizzledSharedLayout(vec=1, per_phase=1, max_phase=1, order=[0])
    ring = gl.allocate_shared_memory(gl.float32, [2, N], flat)
    ready = gl.allocate_shared_memory(gl.int64, [2, 1], mbarrier.MBarrierLayout())
    empty = gl.allocate_shared_memory(gl.int64, [2, 1], mbarrier.MBarrierLayout())
    for i in gl.static_range(2):
        mbarrier.init(ready.index(i), count=1)
        mbarrier.init(empty.index(i), count=1)
    if WORKER_REGS > 0:
        gl.warp_specialize(
            [
                (_ring_consumer, (out_ptr, ring, ready, empty, N, STEPS)),
                (_ring_producer, (ring, ready, empty, N, STEPS)),
            ],
            [WORKER_WARPS],
            [WORKER_REGS],
        )
    else:
        gl.warp_specialize(
            [
                (_ring_consumer, (out_ptr, ring, ready, empty, N, STEPS)),
                (_ring_producer, (ring, ready, empty, N, STEPS)),
            ],
            [WORKER_WARPS],
        )


def _ring_expected(programs: int) -> torch.Tensor:
    o = torch.arange(RING_N, dtype=torch.float64)
    steps = sum(range(1, RING_STEPS + 1))
    return torch.stack([o * steps + p * RING_STEPS for p in range(programs)]).float()


def compile_only(
    worker_warps: int, regs: int, default_warps: int, scratch: bool, ring: bool = False
) -> int:
    from triton.experimental.gluon._runtime import GluonASTSource

    if ring:
        sig = {"out_ptr": "*fp32"}
        consts = {"N": RING_N, "STEPS": RING_STEPS, "WORKER_WARPS": worker_warps}
        consts["WORKER_REGS"] = regs
        fn = ws_ring_probe_kernel
    else:
        sig = {"x_ptr": "*fp32", "y_ptr": "*fp32", "a_ptr": "*fp32", "b_ptr": "*fp32"}
        sig.update(starts_ptr="*i32", n="i32")
        consts = {"BLOCK": BLOCK, "WORKER_WARPS": worker_warps, "WORKER_REGS": regs}
        consts["SCRATCH"] = scratch
        fn = ws_probe_kernel
    for k in consts:
        sig[k] = "constexpr"
    src = GluonASTSource(fn=fn, signature=sig, constexprs=consts)
    compiled = triton.compile(
        src, target=GPUTarget("cuda", 90, 32), options={"num_warps": default_warps}
    )
    ptx = compiled.asm["ptx"]
    counts = {
        "barrier.sync 1": len(re.findall(r"barrier\.sync\s+1;", ptx)),
        "setmaxnreg": ptx.count("setmaxnreg"),
        "st.shared": ptx.count("st.shared"),
        "ld.shared": ptx.count("ld.shared"),
        "bar.sync 0": len(re.findall(r"bar(?:rier)?\.sync\s+0", ptx)),
        "mbarrier.arrive": ptx.count("mbarrier.arrive"),
    }
    print(
        f"Triton {triton.__version__}, sm90, default warps {default_warps}, worker warps "
        f"{worker_warps}, regs {regs}, scratch {scratch}, ring {ring}: {counts}"
    )
    return 0


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--regs", action="store_true", help="pass worker_num_regs (setmaxnreg)")
    ap.add_argument("--worker-warps", type=int, default=4)
    ap.add_argument(
        "--default-warps", type=int, default=4, help="the default partition's warps (sparse_mla: 8)"
    )
    ap.add_argument(
        "--scratch",
        action="store_true",
        help="the default partition crosses its vector between threads through a shared buffer "
        "of its own under its barrier, as the sparse_mla kernels' MMA warps do",
    )
    ap.add_argument(
        "--ring",
        action="store_true",
        help="the worker hands the default warps a changing vector through a two-slot ring "
        "under mbarriers, as the sparse_mla warp-specialized kernels hand over per-step data",
    )
    ap.add_argument("--compile-only", action="store_true", help="compile for sm90, print the PTX")
    args = ap.parse_args()
    regs = WORKER_REGS if args.regs else 0
    if args.compile_only:
        return compile_only(args.worker_warps, regs, args.default_warps, args.scratch, args.ring)
    if not torch.cuda.is_available() or torch.cuda.get_device_capability()[0] < 9:
        print("needs an sm90 or newer GPU (or --compile-only)")
        return 2
    if args.ring:
        programs = 4
        out = torch.full((programs, RING_N), float("nan"), device="cuda")
        ws_ring_probe_kernel[(programs,)](
            out, RING_N, RING_STEPS, args.worker_warps, regs, num_warps=args.default_warps
        )
        torch.cuda.synchronize()
        ok = torch.equal(out.cpu(), _ring_expected(programs))
        print(f"Triton {triton.__version__}: ring outputs {'correct' if ok else 'WRONG'}")
        return 0 if ok else 1
    n = 3 * BLOCK + 17
    x = torch.randn(n, device="cuda")
    a = torch.randn(n, device="cuda")
    y = torch.full_like(x, float("nan"))
    b = torch.full_like(a, float("nan"))
    grid = (triton.cdiv(n, BLOCK),)
    starts = torch.arange(grid[0], device="cuda", dtype=torch.int32) * BLOCK
    ws_probe_kernel[grid](
        x,
        y,
        a,
        b,
        starts,
        n,
        BLOCK,
        args.worker_warps,
        regs,
        args.scratch,
        num_warps=args.default_warps,
    )
    torch.cuda.synchronize()
    ok = torch.equal(y, x * 2.0) and torch.equal(b, a + 1.0)
    print(f"Triton {triton.__version__}: outputs {'correct' if ok else 'WRONG'}")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
