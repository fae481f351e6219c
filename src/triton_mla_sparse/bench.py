"""Measurement: ceilings measured on the card, the floor of a shape, checked and timed calls.

floor = max(bytes / copy bandwidth, FLOPs / bf16 matmul rate), with
bytes = T*W*row_bytes + q + out (every listed index one row read) and FLOPs = 2*H*T*W*(576+512),
as docs/PERFORMANCE.md defines them; with an extra index set W counts both sets' entries
(DeepSeek-V4: 128 + 512 records of 584 bytes, q . k and P . V 512 wide each).
Decode is timed from CUDA-graph replays (as a server runs it), prefill with device events
(testing.timing); a case passes as testing.compare_sparse_mla says, before it is timed.
"""

from __future__ import annotations

import dataclasses

import torch

from .kv_format import bytes_per_row
from .ops.sparse_mla.heuristics import KernelConfig
from .ops.sparse_mla.plan import SCALED_FAMILIES, LaunchPlan
from .reference import sparse_mla_reference
from .testing import (
    Ceilings,
    compare_sparse_mla,
    reference_dtype,
    time_events,
    time_graph,
)
from .workloads import Case, Inputs, make_inputs


def listed(inp: Inputs) -> int:
    """Index entries per token: the main set's and, with one, the extra set's."""
    extra = inp.kwargs.get("extra_indices")
    return inp.indices.shape[1] + (extra.shape[1] if extra is not None else 0)


def case_cost(case: Case, inp: Inputs) -> tuple[float, float]:
    """(bytes, FLOPs) of one call, counting every listed index (both sets) as one row read."""
    t, h = case.tokens, case.heads
    w = listed(inp)
    row = bytes_per_row(case.kv_format, 512 + case.rope, case.dtype)
    esize = torch.empty((), dtype=case.dtype).element_size()
    nbytes = t * w * row + t * h * (512 + case.rope) * esize + t * h * 512 * esize
    flops = 2.0 * h * t * w * (512 + case.rope + 512)
    return nbytes, flops


@dataclasses.dataclass
class Result:
    case: str
    kv_format: str
    dtype: str
    tokens: int
    heads: int
    topk: int
    config: str
    err: float
    passed: bool
    us: float | None = None
    gbps: float | None = None
    tflops: float | None = None
    floor_us: float | None = None
    ratio: float | None = None
    bound: str | None = None
    ref_us: float | None = None


CHECK_TOKENS = 256


def config_label(cfg: KernelConfig) -> str:
    """``h16 n64 w4 s3 k2``: heads per program, rows per step, warps, stages, splits; then
    ``+ia`` indices one step ahead, ``+st`` staged fp8 dequantization, ``-pdl`` the merge
    launched without programmatic dependence, ``+f16fold`` fp16 MMAs with the scales folded
    into the tile (KernelConfig.fp16_fold), ``+gluon:<form>`` the Gluon kernel of that form
    (KernelConfig.gluon: the sm90 kernels, or "ampere", the mma.sync ones), ``+maxreg<N>`` a
    register cap (KernelConfig.max_registers), ``+qrreg`` q's RoPE part in registers
    (KernelConfig.q_rope_in_registers), ``+splitqk`` QK^T split over the latent
    (KernelConfig.split_qk), ``+o32`` 32-bit row offsets (KernelConfig.row_offsets_32)."""
    label = f"h{cfg.block_h} n{cfg.block_n} w{cfg.num_warps} s{cfg.num_stages} k{cfg.num_splits}"
    if cfg.idx_ahead:
        label += " +ia"
    if cfg.stage_dequant:
        label += " +st"
    if cfg.pdl is False:
        label += " -pdl"
    if cfg.fp16_fold:
        label += " +f16fold"
    if cfg.gluon:
        label += f" +gluon:{cfg.gluon}"
    if cfg.max_registers is not None:
        label += f" +maxreg{cfg.max_registers}"
    if cfg.q_rope_in_registers:
        label += " +qrreg"
    if cfg.split_qk:
        label += " +splitqk"
    if cfg.row_offsets_32:
        label += " +o32"
    return label


# plan_label's mark of a packed integer e4m3 decode (KernelConfig.e4m3_decode)
PACKED_LABELS = {"packed": " +pk", "packed-nomask": " +pknm"}


def plan_label(plan: LaunchPlan) -> str:
    """What a call runs: :func:`config_label` of the plan's configuration as run (``k`` the
    split count actually used), then for e4m3 caches ``+int`` where the bytes are decoded with
    integer arithmetic (sm80/86, AMD), ``+pk`` / ``+pknm`` where that decode is packed
    (KernelConfig.e4m3_decode "packed" / "packed-nomask"), ``+qmma`` where the MMAs take q's
    dtype instead of fp16 (heuristics.fp16_mma_for)."""
    # "-pdl" only where a merge runs without programmatic dependent launch
    pdl = None if plan.merge is None or plan.merge.pdl else False
    label = config_label(dataclasses.replace(plan.config, pdl=pdl))
    c = plan.constexprs
    if c.get("E4M3") or plan.family in SCALED_FAMILIES:
        if not c["FP8_NATIVE"]:
            label += " +int" + PACKED_LABELS.get(plan.config.e4m3_decode, "")
        if not c["MMA_FP16"]:
            label += " +qmma"
    return label


# What plan_label's marks mean, for the tables that print them (verify, bench)
LABEL_LEGEND = (
    "kernel (as run): heads per program h, rows per gather step n, warps w, stages s (the\n"
    "  mma.sync kernels: ring slots), top-k splits k; +ia indices a step ahead, +st staged\n"
    "  fp8_ds_mla tiles, -pdl merge without dependent launch, +f16fold fp16 MMAs with the scales\n"
    "  folded into the tile, +gluon:<form> a Gluon kernel (ampere: mma.sync), +maxreg<N> a\n"
    "  register cap, +qrreg q's RoPE part in registers, +splitqk QK^T split over the latent,\n"
    "  +o32 32-bit row offsets, +int integer e4m3 decode (+pk / +pknm packed), +qmma MMAs in\n"
    "  q's dtype"
)


def check_rows(case: Case) -> torch.Tensor | None:
    """Tokens checked against the reference: all of a decode, an evenly spread sample of a long
    prefill (tokens are computed independently; the float32 reference of 4096 x 128 heads would
    take a minute)."""
    if case.tokens <= 2 * CHECK_TOKENS:
        return None
    return torch.linspace(0, case.tokens - 1, CHECK_TOKENS).round().long()


def prepare(case: Case, device: torch.device, seed: int = 0) -> tuple[Inputs, torch.Tensor]:
    """Inputs of a case and the reference output for its checked tokens."""
    inp = make_inputs(case, device, seed)
    rows = check_rows(case)
    q, idx, kw = inp.q, inp.indices, dict(inp.kwargs)
    if rows is not None:
        rows = rows.to(device)
        q, idx = q[rows], idx[rows]
        for per_token in ("valid_counts", "extra_indices", "extra_valid_counts"):
            if per_token in kw:
                kw[per_token] = kw[per_token][rows]
    ref = sparse_mla_reference(
        q, inp.kv_cache, idx, inp.scale, compute_dtype=reference_dtype(case.dtype), **kw
    )
    return inp, ref


def run_case(
    case: Case,
    device: torch.device,
    ceilings: Ceilings | None = None,
    config: KernelConfig | None = None,
    time_it: bool = True,
    time_reference: bool = False,
    seed: int = 0,
    prepared: tuple[Inputs, torch.Tensor] | None = None,
) -> Result:
    """Check one case against the reference, then (if it passed) time it.

    ``prepared`` reuses (inputs, reference output) across configurations of one case.
    """
    from . import sparse_mla, sparse_mla_plan

    inp, ref = prepared or prepare(case, device, seed)
    kw = dict(inp.kwargs)
    # config None: the plan's own choice, as a caller of sparse_mla gets it
    out = torch.full((case.tokens, case.heads, 512), float("nan"), dtype=case.dtype, device=device)
    plan = sparse_mla_plan(
        inp.q, inp.kv_cache, inp.indices, inp.scale, out=out, config=config, **kw
    )
    sparse_mla(inp.q, inp.kv_cache, inp.indices, inp.scale, out=out, config=config, **kw)
    ref_fn = lambda: sparse_mla_reference(inp.q, inp.kv_cache, inp.indices, inp.scale, **kw)  # noqa: E731
    check = compare_sparse_mla(out, ref, rows=check_rows(case))
    res = Result(
        case.name,
        case.kv_format,
        str(case.dtype).replace("torch.", ""),
        case.tokens,
        case.heads,
        listed(inp),
        plan_label(plan),
        check.err,
        check.passed,
    )
    if not (time_it and res.passed and device.type == "cuda"):
        return res
    fn = lambda: sparse_mla(
        inp.q, inp.kv_cache, inp.indices, inp.scale, out=out, config=config, **kw
    )  # noqa: E731
    res.us = time_graph(fn) if case.decode else time_events(fn)
    nbytes, flops = case_cost(case, inp)
    res.gbps = nbytes / res.us / 1e3
    res.tflops = flops / res.us / 1e6
    if ceilings is not None:
        t_mem = nbytes / ceilings.copy_gbps / 1e3
        t_mma = flops / ceilings.matmul_tflops / 1e6
        res.floor_us = max(t_mem, t_mma)
        res.bound = "memory" if t_mem >= t_mma else "compute"
        res.ratio = res.us / res.floor_us
    if time_reference:
        res.ref_us = time_events(ref_fn, reps=3, warmup=1)
    return res


@dataclasses.dataclass
class PeerResult:
    """Another kernel on a case's inputs, checked against the same reference with the same
    tolerance, then (if it passed) timed the same way; ``ratio`` = our µs / its µs."""

    peer: str
    case: str
    kv_format: str
    dtype: str
    tokens: int
    heads: int
    call: str
    err: float | None
    passed: bool
    us: float | None = None
    ours_us: float | None = None
    ratio: float | None = None
    error: str | None = None


def run_flashmla(
    case: Case,
    device: torch.device,
    prepared: tuple[Inputs, torch.Tensor],
    ours: Result,
    fmla,
    time_it: bool = True,
) -> PeerResult | None:
    """FlashMLA (``fmla``: ``peers.flashmla.load()``) on the inputs ``ours`` was measured on, as
    vLLM 0.33 calls it; None where it has no counterpart. An exception or a failed check is
    reported in the result and never timed."""
    from .peers import flashmla

    inp, ref = prepared
    if flashmla.unsupported(case.kv_format, case.dtype, 512 + case.rope, case.heads, case.decode):
        return None
    res = PeerResult(
        "flashmla",
        case.name,
        case.kv_format,
        str(case.dtype).replace("torch.", ""),
        case.tokens,
        case.heads,
        call="-",
        err=None,
        passed=False,
        ours_us=ours.us,
    )
    try:
        call = flashmla.prepare_call(
            fmla,
            inp.q,
            inp.kv_cache,
            inp.indices,
            inp.scale,
            case.kv_format,
            valid_counts=inp.kwargs.get("valid_counts"),
            attn_sink=inp.kwargs.get("attn_sink"),
            extra_kv_cache=inp.kwargs.get("extra_kv_cache"),
            extra_indices=inp.kwargs.get("extra_indices"),
            extra_valid_counts=inp.kwargs.get("extra_valid_counts"),
        )
        res.call = call.label
        out = call.run()  # also computes the fp8 decode's scheduler metadata, untimed
        check = compare_sparse_mla(out, ref, rows=check_rows(case))
        res.err, res.passed = check.err, check.passed
        if time_it and res.passed and device.type == "cuda":
            res.us = time_graph(call.run) if case.decode else time_events(call.run)
            res.ratio = ours.us / res.us if ours.us else None
    except Exception as e:  # a peer that breaks is reported, not fatal to the bench
        res.passed = False
        res.error = " ".join(f"{type(e).__name__}: {e}".split())[:300]
    return res
