"""Executes a launch plan (plan.py): workspaces, strides, the forward kernel, the merge.

Decides nothing: every choice is in the plan. Imported lazily by the interface (it imports
Triton and the kernels; nothing is compiled or launched at import).
"""

from __future__ import annotations

import torch

from .kernels import (
    sparse_mla_ds_mla_fwd_kernel,
    sparse_mla_ds_mla_v4_fwd_kernel,
    sparse_mla_latent_fwd_kernel,
    sparse_mla_merge_kernel,
)
from .plan import (
    DS_MLA,
    DS_MLA_AMPERE_GLUON,
    DS_MLA_GLUON,
    DS_MLA_GLUON_ALT,
    DS_MLA_GLUON_WS,
    DS_MLA_V4,
    DS_MLA_V4_GLUON,
    DS_MLA_V4_GLUON_WS,
    GLUON_ASYNC_FAMILIES,
    LATENT,
    LATENT_AMPERE_GLUON,
    LATENT_GLUON,
    LATENT_GLUON_WS,
    LaunchPlan,
    gluon_gathers_aligned,
)

# the forward kernel of each family (looked up per call: tools swap entries for recorders)
FORWARD = {
    LATENT: sparse_mla_latent_fwd_kernel,
    DS_MLA: sparse_mla_ds_mla_fwd_kernel,
    DS_MLA_V4: sparse_mla_ds_mla_v4_fwd_kernel,
}
try:  # a Triton without Gluon's Hopper layer has no such kernel (plans asking for it fail)
    from .kernels.ds_mla_sm90_gluon import (
        sparse_mla_ds_mla_sm90_gluon_kernel,
        sparse_mla_ds_mla_sm90_gluon_ws_kernel,
    )
    from .kernels.ds_mla_v4_sm90_gluon import (
        sparse_mla_ds_mla_v4_sm90_gluon_kernel,
        sparse_mla_ds_mla_v4_sm90_gluon_ws_kernel,
    )

    FORWARD[DS_MLA_GLUON] = sparse_mla_ds_mla_sm90_gluon_kernel
    FORWARD[DS_MLA_GLUON_WS] = sparse_mla_ds_mla_sm90_gluon_ws_kernel
    from .kernels.ds_mla_sm90_gluon_alt import sparse_mla_ds_mla_sm90_gluon_alt_kernel

    FORWARD[DS_MLA_GLUON_ALT] = sparse_mla_ds_mla_sm90_gluon_alt_kernel
    FORWARD[DS_MLA_V4_GLUON_WS] = sparse_mla_ds_mla_v4_sm90_gluon_ws_kernel
    FORWARD[DS_MLA_V4_GLUON] = sparse_mla_ds_mla_v4_sm90_gluon_kernel
    from .kernels.ampere_gluon import (
        sparse_mla_ds_mla_ampere_gluon_kernel,
        sparse_mla_latent_ampere_gluon_kernel,
    )

    FORWARD[DS_MLA_AMPERE_GLUON] = sparse_mla_ds_mla_ampere_gluon_kernel
    FORWARD[LATENT_AMPERE_GLUON] = sparse_mla_latent_ampere_gluon_kernel
    from .kernels.latent_sm90_gluon import (
        sparse_mla_latent_sm90_gluon_kernel,
        sparse_mla_latent_sm90_gluon_ws_kernel,
    )

    FORWARD[LATENT_GLUON] = sparse_mla_latent_sm90_gluon_kernel
    FORWARD[LATENT_GLUON_WS] = sparse_mla_latent_sm90_gluon_ws_kernel
except ImportError:  # pragma: no cover - depends on the installed Triton
    pass


def launchable_kernels() -> tuple:
    """Every kernel a call can launch: each family's forward kernel (the Gluon ones where this
    Triton has them) and the split-K merge. A PTX-JIT emulation starts all of them afresh, so
    that none keeps a binary built for another target (testing/ptx_jit.py)."""
    return tuple(dict.fromkeys([*FORWARD.values(), sparse_mla_merge_kernel]))


def _cache_geometry(kv_cache: torch.Tensor) -> tuple[int, int, int, int, int]:
    """(num_rows, page_size, stride_block, stride_row, stride_col) of a flat or paged cache."""
    if kv_cache.dim() == 2:
        return kv_cache.shape[0], 1, kv_cache.stride(0), 0, kv_cache.stride(1)
    nb, page, _ = kv_cache.shape
    return nb * page, page, kv_cache.stride(0), kv_cache.stride(1), kv_cache.stride(2)


def _extra_args(
    plan: LaunchPlan,
    kv_cache: torch.Tensor | None,
    indices: torch.Tensor | None,
    counts: torch.Tensor | None,
    bt: torch.Tensor | None,
) -> list:
    """The forward kernels' extra-set arguments, in their order. All None without an extra set:
    Triton turns None arguments into constants, so such calls compile to the same code (the same
    parameter list) as a kernel without these arguments."""
    if plan.extra is None:
        assert kv_cache is None and indices is None, "an extra set passed to a plan without one"
        return [None] * _NUM_EXTRA_ARGS
    assert kv_cache is not None and indices is not None, "the plan's extra set was not passed"
    num_rows, page, s_kb, s_kr, s_kd = _cache_geometry(kv_cache)
    args = [
        kv_cache,
        indices,
        counts,
        bt,
        plan.extra.width,
        plan.extra.offset,
        num_rows,
        page,
        s_kb,
        s_kr,
        s_kd,
        *indices.stride(),
        bt.stride(0) if bt is not None else 0,
        bt.stride(1) if bt is not None else 0,
        counts.stride(0) if counts is not None else 0,
        plan.extra.bt_block_size,
        bt.shape[1] if bt is not None else 0,
    ]
    assert len(args) == _NUM_EXTRA_ARGS
    return args


_NUM_EXTRA_ARGS = 18


def launch_sparse_mla(
    plan: LaunchPlan,
    q_lat: torch.Tensor,
    q_rope: torch.Tensor | None,
    kv_cache: torch.Tensor,
    indices: torch.Tensor,
    valid_counts: torch.Tensor | None,
    block_table: torch.Tensor | None,
    req_ids: torch.Tensor | None,
    k_scale_ptr: torch.Tensor | None,
    k_scale_val: float,
    out: torch.Tensor,
    lse: torch.Tensor | None,
    softmax_scale: float,
    attn_sink: torch.Tensor | None = None,
    extra_kv_cache: torch.Tensor | None = None,
    extra_indices: torch.Tensor | None = None,
    extra_valid_counts: torch.Tensor | None = None,
    extra_block_table: torch.Tensor | None = None,
) -> None:
    T, H, _ = q_lat.shape
    W = indices.shape[1]
    num_rows, page, s_kb, s_kr, s_kd = _cache_geometry(kv_cache)
    if plan.family in GLUON_ASYNC_FAMILIES:
        # the Gluon kernels gather 16-byte vectors (cp.async) without checking alignment
        # (the V4 record's rows sit at slot * 576 bytes from their page's start, whatever the
        # tensor's row stride says: only its page stride counts)
        dims = 1 if plan.family == DS_MLA_V4_GLUON else -1
        for name, cache in (("kv_cache", kv_cache), ("extra_kv_cache", extra_kv_cache)):
            if cache is not None and not (
                gluon_gathers_aligned(
                    *(s * cache.element_size() for s in cache.stride()[:dims]), cache.data_ptr()
                )
                and (dims == 1 or cache.stride(-1) == 1)
            ):
                raise ValueError(
                    f"the cp.async Gluon kernels need a 16-byte aligned {name} with its "
                    f"strides {'(but the last, 1) ' if dims < 0 else '(the page stride) '}in "
                    f"multiples of 16 bytes; got {name} of shape "
                    f"{tuple(cache.shape)}, strides {tuple(cache.stride())}, address "
                    f"{cache.data_ptr():#x}"
                )
    dummy = indices  # any tensor, for pointers a variant never reads
    q_r = q_rope if q_rope is not None else q_lat
    if plan.workspace is not None:
        o_part = torch.empty(plan.workspace, dtype=torch.float32, device=out.device)
        lse_part = torch.empty(plan.workspace[:3], dtype=torch.float32, device=out.device)
    else:
        o_part = lse_part = dummy
    bt = block_table if block_table is not None else dummy
    sink = attn_sink if attn_sink is not None else dummy
    s_sink = attn_sink.stride(0) if attn_sink is not None else 0
    cfg = plan.config
    FORWARD[plan.family][plan.grid](
        q_lat,
        q_r,
        kv_cache,
        indices,
        valid_counts if valid_counts is not None else dummy,
        bt,
        req_ids if req_ids is not None else dummy,
        k_scale_ptr if k_scale_ptr is not None else dummy,
        out,
        lse if lse is not None else dummy,
        o_part,
        lse_part,
        sink,
        softmax_scale,
        k_scale_val,
        H,
        W,
        num_rows,
        page,
        plan.split_len,
        cfg.num_splits,
        plan.num_head_blocks,
        *q_lat.stride(),
        *q_r.stride(),
        s_kb,
        s_kr,
        s_kd,
        *indices.stride(),
        bt.stride(0) if block_table is not None else 0,
        bt.stride(1) if block_table is not None else 0,
        valid_counts.stride(0) if valid_counts is not None else 0,
        req_ids.stride(0) if req_ids is not None else 0,
        plan.bt_block_size,
        bt.shape[1] if block_table is not None else 0,
        *out.stride(),
        s_sink,
        *_extra_args(plan, extra_kv_cache, extra_indices, extra_valid_counts, extra_block_table),
        **plan.constexprs,
        num_warps=cfg.num_warps,
        num_stages=cfg.num_stages,
        **({"maxnreg": cfg.max_registers} if cfg.max_registers is not None else {}),
    )
    m = plan.merge
    if m is not None:
        sparse_mla_merge_kernel[m.grid](
            o_part,
            lse_part,
            out,
            lse if lse is not None else dummy,
            sink,
            H,
            cfg.num_splits,
            *out.stride(),
            s_sink,
            **m.constexprs,
            num_warps=m.num_warps,
            **({"launch_pdl": True} if m.pdl else {}),
        )
