"""Grid and arguments for the index-query kernel (imported lazily by the interface)."""

from __future__ import annotations

import torch

from .kernels import index_q_rope_kernel


def launch_index_q_rope(
    positions: torch.Tensor,
    q_pe: torch.Tensor,
    q_pe_cos_sin: torch.Tensor,
    q_pe_out: torch.Tensor,
    index_q: torch.Tensor | None,
    index_q_cos_sin: torch.Tensor | None,
    index_q_out: torch.Tensor | None,
    weights: torch.Tensor | None,
    weights_out: torch.Tensor | None,
    w_scale: float,
    interleave: bool,
    emulate_fp8: bool,
) -> None:
    num_tokens, num_q_heads, rope = q_pe.shape
    if index_q is None:  # no indexer on this layer: the query-rope heads only
        num_iq, iq_dim, iq_half = 0, 1, 1
        index_q = index_q_out = q_pe_out  # never dereferenced (no index head program)
        index_q_cos_sin = q_pe_cos_sin
        weights = weights_out = q_pe_out
        s_w = (0, 0)
        s_wo = 0
    else:
        num_iq, iq_dim = index_q.shape[1], index_q.shape[2]
        iq_half = index_q_cos_sin.shape[1] // 2
        s_w = (weights.stride(0), weights.stride(1))
        s_wo = weights_out.stride(0)
    grid = (num_tokens, num_q_heads + num_iq)
    if num_tokens == 0:
        return
    index_q_rope_kernel[grid](
        positions,
        q_pe,
        q_pe.stride(0),
        q_pe.stride(1),
        q_pe_cos_sin,
        q_pe_cos_sin.stride(0),
        q_pe_out,
        q_pe_out.stride(0),
        q_pe_out.stride(1),
        index_q,
        index_q.stride(0),
        index_q.stride(1),
        index_q_cos_sin,
        index_q_cos_sin.stride(0),
        index_q_out,
        index_q_out.stride(0),
        index_q_out.stride(1),
        weights,
        s_w[0],
        s_w[1],
        weights_out,
        s_wo,
        w_scale,
        NUM_Q_HEADS=num_q_heads,
        QPE_HALF=rope // 2,
        NUM_IQ_HEADS=num_iq,
        IQ_DIM=iq_dim,
        IQ_HALF=iq_half,
        INTERLEAVE=interleave,
        EMULATE_FP8=emulate_fp8,
        num_warps=1,  # one 64-128-value head per program: occupancy-bound, as vLLM's fused_q
    )
