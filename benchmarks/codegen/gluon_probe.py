"""Which targets a warp-specialized gather pipeline in Gluon compiles for, under the installed Triton.

    python benchmarks/codegen/gluon_probe.py [--targets 80,86,89,90,100,120]

No GPU needed: each (target, form) is compiled ahead of time in its own process (an LLVM
selection failure aborts the process) and one line per pair is printed: the Triton version, the
target, the form, then "ok" with the shared memory and whether the PTX holds cp.async, mbarrier
and mma.sync, or the compiler's last error line.

The kernel is the skeleton of a producer/consumer decode step: one producer warp gathers the
rows an index list names into a ring of shared-memory tiles with cp.async and signals each tile
on an mbarrier; the consumer warps wait on it, run mma_v2 against a query block and hand the
slot back. Forms: ``regs`` passes ``worker_num_regs`` to ``gl.warp_specialize`` (register
reallocation, ``setmaxnreg``), ``noregs`` omits it (Triton 3.8 and later accept that; 3.6
requires the argument). Nothing here is launched or checked for results: it answers only whether the design
compiles on a target, which decides where such a kernel could serve.
"""

from __future__ import annotations

import argparse
import subprocess
import sys

import triton
from triton.backends.compiler import GPUTarget
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.ampere import async_copy, mbarrier, mma_v2

# query heads, gathered rows per tile, row width (fp16), tiles in flight
HEADS = 16
ROWS = 32
WIDTH = 64
STAGES = 2
PRODUCER_WARPS = 1
PRODUCER_REGS = 48  # a gather-only warp needs few registers
CONSUMER_WARPS = 4
FORMS = ("regs", "noregs")
# cp.async into shared memory: async_load from Triton 3.8 on (3.9 removed the older name),
# async_copy_global_to_shared in 3.6
ASYNC_LOAD = getattr(async_copy, "async_load", None) or async_copy.async_copy_global_to_shared


@gluon.jit
def _producer(
    kv_ptr,
    idx_ptr,
    ring,
    ready,
    empty,
    n_steps,
    ROWS: gl.constexpr,
    WIDTH: gl.constexpr,
    STAGES: gl.constexpr,
):
    layout: gl.constexpr = gl.BlockedLayout([1, 8], [4, 8], [1, 1], [1, 0])
    o_row = gl.arange(0, ROWS, layout=gl.SliceLayout(1, layout))
    o_col = gl.max_contiguous(
        gl.multiple_of(gl.arange(0, WIDTH, layout=gl.SliceLayout(0, layout)), 8), 8
    )
    for i_step in range(n_steps):
        slot = i_step % STAGES
        mbarrier.wait(empty.index(slot), ((i_step // STAGES) & 1) ^ 1)
        i_kv = gl.load(idx_ptr + i_step * ROWS + o_row)
        p_kv = kv_ptr + i_kv[:, None].to(gl.int64) * WIDTH + o_col[None, :]
        ASYNC_LOAD(ring.index(slot), p_kv)
        async_copy.mbarrier_arrive(ready.index(slot))


@gluon.jit
def _consumer(
    q_ptr,
    out_ptr,
    ring,
    ready,
    empty,
    n_steps,
    HEADS: gl.constexpr,
    ROWS: gl.constexpr,
    WIDTH: gl.constexpr,
    STAGES: gl.constexpr,
    WARPS: gl.constexpr,
):
    mma: gl.constexpr = gl.NVMMADistributedLayout(
        version=[2, 0], warps_per_cta=[WARPS, 1], instr_shape=[16, 8]
    )
    a_layout: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=mma, k_width=2)
    b_layout: gl.constexpr = gl.DotOperandLayout(operand_index=1, parent=mma, k_width=2)
    io: gl.constexpr = gl.BlockedLayout([1, 4], [4, 8], [WARPS, 1], [1, 0])
    o_h = gl.arange(0, HEADS, layout=gl.SliceLayout(1, io))
    o_d = gl.arange(0, WIDTH, layout=gl.SliceLayout(0, io))
    b_q = gl.convert_layout(gl.load(q_ptr + o_h[:, None] * WIDTH + o_d[None, :]), a_layout)
    b_acc = gl.zeros([HEADS, ROWS], gl.float32, mma)
    for i_step in range(n_steps):
        slot = i_step % STAGES
        mbarrier.wait(ready.index(slot), (i_step // STAGES) & 1)
        b_k = ring.index(slot).permute([1, 0]).load(b_layout)
        b_acc = mma_v2(b_q, b_k, b_acc)
        mbarrier.arrive(empty.index(slot))
    o_r = gl.arange(0, ROWS, layout=gl.SliceLayout(0, io))
    gl.store(out_ptr + o_h[:, None] * ROWS + o_r[None, :], gl.convert_layout(b_acc, io))


@gluon.jit
def probe_kernel(
    q_ptr,
    kv_ptr,
    idx_ptr,
    out_ptr,
    n_steps,
    HEADS: gl.constexpr,
    ROWS: gl.constexpr,
    WIDTH: gl.constexpr,
    STAGES: gl.constexpr,
    WARPS: gl.constexpr,
    PRODUCER_WARPS: gl.constexpr,
    PRODUCER_REGS: gl.constexpr,
):
    swizzled: gl.constexpr = gl.SwizzledSharedLayout(vec=8, per_phase=1, max_phase=8, order=[1, 0])
    ring = gl.allocate_shared_memory(gl.float16, [STAGES, ROWS, WIDTH], swizzled)
    ready = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    empty = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    for slot in gl.static_range(STAGES):
        mbarrier.init(ready.index(slot), count=1)
        mbarrier.init(empty.index(slot), count=1)
    # (the partition list must be written out in each call: Gluon does not take it as a value)
    if PRODUCER_REGS > 0:
        gl.warp_specialize(
            [
                (
                    _consumer,
                    (
                        q_ptr,
                        out_ptr,
                        ring,
                        ready,
                        empty,
                        n_steps,
                        HEADS,
                        ROWS,
                        WIDTH,
                        STAGES,
                        WARPS,
                    ),
                ),
                (_producer, (kv_ptr, idx_ptr, ring, ready, empty, n_steps, ROWS, WIDTH, STAGES)),
            ],
            [PRODUCER_WARPS],
            [PRODUCER_REGS],
        )
    else:
        gl.warp_specialize(
            [
                (
                    _consumer,
                    (
                        q_ptr,
                        out_ptr,
                        ring,
                        ready,
                        empty,
                        n_steps,
                        HEADS,
                        ROWS,
                        WIDTH,
                        STAGES,
                        WARPS,
                    ),
                ),
                (_producer, (kv_ptr, idx_ptr, ring, ready, empty, n_steps, ROWS, WIDTH, STAGES)),
            ],
            [PRODUCER_WARPS],
        )


def compile_one(cc: int, form: str) -> str:
    """One (target, form) compiled for cuda:cc: "ok ..." or "FAIL <the compiler's last line>"."""
    from triton.experimental.gluon._runtime import GluonASTSource

    params = ("HEADS", "ROWS", "WIDTH", "STAGES", "WARPS", "PRODUCER_WARPS", "PRODUCER_REGS")
    signature = {
        "q_ptr": "*fp16",
        "kv_ptr": "*fp16",
        "idx_ptr": "*i32",
        "out_ptr": "*fp32",
        "n_steps": "i32",
    }
    signature.update({p: "constexpr" for p in params})
    regs = PRODUCER_REGS if form == "regs" else 0
    values = (HEADS, ROWS, WIDTH, STAGES, CONSUMER_WARPS, PRODUCER_WARPS, regs)
    aligned = {(i,): [["tt.divisibility", 16]] for i in range(4)}  # the four pointers
    source = GluonASTSource(probe_kernel, signature, dict(zip(params, values)), aligned)
    try:
        kernel = triton.compile(
            source, target=GPUTarget("cuda", cc, 32), options={"num_warps": CONSUMER_WARPS}
        )
    except Exception as e:  # the frontend's or a pass's error
        lines = str(e).strip().splitlines() or [repr(e)]
        return "FAIL " + lines[-1][:200]
    ptx = kernel.asm["ptx"]
    has = " ".join(f"{op}={op in ptx}" for op in ("cp.async", "mbarrier", "mma.sync", "setmaxnreg"))
    return f"ok shared={kernel.metadata.shared} B {has}"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument(
        "--targets", default="80,86,89,90,100,120", help="compute capabilities, comma-separated"
    )
    ap.add_argument("--one", nargs=2, metavar=("CC", "FORM"), help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.one:
        print(compile_one(int(args.one[0]), args.one[1]), flush=True)
        return
    for cc in (int(t) for t in args.targets.split(",")):
        for form in FORMS:
            run = subprocess.run(
                [sys.executable, __file__, "--one", str(cc), form], capture_output=True, text=True
            )
            lines = [ln for ln in (run.stdout + run.stderr).splitlines() if ln.strip()]
            result = next((ln for ln in lines if ln.startswith(("ok", "FAIL"))), None)
            if result is None:  # the process died (an LLVM selection error aborts it)
                result = (
                    "FAIL "
                    + next((ln for ln in lines if "ERROR" in ln), f"exit {run.returncode}")[:200]
                )
            print(f"triton {triton.__version__}  sm{cc}  {form:7s}  {result}", flush=True)


if __name__ == "__main__":
    main()
