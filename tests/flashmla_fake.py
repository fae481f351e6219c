"""A CPU stand-in for FlashMLA's compiled ops, for testing the bench's FlashMLA glue without a GPU.

``FakeOps`` has the two ops vLLM 0.33's ``flash_mla_interface.py`` calls
(``sparse_prefill_fwd``, ``sparse_decode_fwd``), with the argument checks of FlashMLA's C++ API
(csrc/api/sparse_fwd.h, sparse_decode.h: dtypes, ranks, shapes, last-dim contiguity, h_q 64/128,
656-byte rows in contiguous 64-row blocks, int32 indices), and computes FlashMLA's semantics
in float32: an index < 0 or past the cache is skipped, only the first ``topk_length`` are read.
``FakeInterface`` is the same thing behind the interface's Python signatures.
"""

from __future__ import annotations

import torch

from triton_mla_sparse.kv_format import unpack_fp8_ds_mla

D_QK, D_V, ROW_BYTES = 576, 512, 656


def _attend(q: torch.Tensor, rows: torch.Tensor, idx: torch.Tensor, scale: float) -> torch.Tensor:
    """q [H, D] float32, rows [N, D] float32, idx [W] int: softmax over the valid idx."""
    keep = idx[(idx >= 0) & (idx < rows.shape[0])].long()
    if keep.numel() == 0:
        return torch.zeros(q.shape[0], D_V)
    k = rows[keep]
    p = torch.softmax(q @ k.T * scale, dim=-1)
    return p @ k[:, :D_V]


class FakeOps:
    def __init__(self) -> None:
        self.calls: list[tuple[str, dict]] = []
        self.issued: list[tuple[torch.Tensor, torch.Tensor]] = []  # scheduler metadata handed out

    def sparse_prefill_fwd(self, q, kv, indices, sm_scale, d_v, attn_sink, topk_length, out_):
        assert q.dim() == 3 and kv.dim() == 3 and indices.dim() == 3
        s_q, h_q, d_qk = q.shape
        assert q.dtype == torch.bfloat16 and kv.dtype == torch.bfloat16
        assert indices.dtype == torch.int32
        assert d_qk == D_QK and d_v == D_V and h_q in (64, 128), (tuple(q.shape), d_v)
        assert kv.shape[1:] == (1, D_QK) and indices.shape[:2] == (s_q, 1)
        assert q.stride(-1) == 1 and kv.stride(-1) == 1 and indices.stride(-1) == 1
        assert attn_sink is None and out_ is None
        if topk_length is not None:
            assert topk_length.dtype == torch.int32 and topk_length.shape == (s_q,)
            assert topk_length.is_contiguous()
        self.calls.append(("sparse_prefill_fwd", {"q": q, "kv": kv, "indices": indices}))
        rows = kv[:, 0].float()
        res = torch.empty(s_q, h_q, D_V, dtype=torch.bfloat16)
        for t in range(s_q):
            idx = indices[t, 0]
            if topk_length is not None:
                idx = idx[: int(topk_length[t])]
            res[t] = _attend(q[t].float(), rows, idx, sm_scale).to(torch.bfloat16)
        lse = torch.zeros(s_q, h_q)
        return res, lse.clone(), lse

    def sparse_decode_fwd(
        self,
        q,
        kv,
        indices,
        topk_length,
        attn_sink,
        tile_scheduler_metadata,
        num_splits,
        extra_kv,
        extra_indices,
        extra_topk_length,
        d_v,
        sm_scale,
        out_,
        enable_batch_invariant,
    ):
        k_cache, head_dim_v, softmax_scale = kv, d_v, sm_scale
        assert q.dim() == 4 and k_cache.dim() == 4 and indices.dim() == 3
        b, s_q, h_q, d_qk = q.shape
        assert q.dtype == torch.bfloat16 and indices.dtype == torch.int32
        assert k_cache.dtype in (torch.uint8, torch.int8, torch.float8_e4m3fn)
        assert d_qk == D_QK and head_dim_v == D_V and h_q in (64, 128), tuple(q.shape)
        assert k_cache.shape[1:] == (64, 1, ROW_BYTES), tuple(k_cache.shape)
        assert k_cache.stride(1) == ROW_BYTES and k_cache.stride(-1) == 1
        assert indices.shape[:2] == (b, s_q) and indices.stride(-1) == 1
        assert q.stride(-1) == 1
        assert topk_length is None and attn_sink is None and extra_kv is None
        assert extra_indices is None and extra_topk_length is None and out_ is None
        assert not enable_batch_invariant
        if tile_scheduler_metadata is None:  # first call: computes the metadata
            assert num_splits is None
            meta = (torch.zeros(4, 8, dtype=torch.int32), torch.zeros(b + 1, dtype=torch.int32))
            self.issued.append(meta)
        else:  # later calls hand back what the first returned
            meta = (tile_scheduler_metadata, num_splits)
            assert any(meta[0] is m and meta[1] is n for m, n in self.issued)
        self.calls.append(("sparse_decode_fwd", {"q": q, "k_cache": k_cache, "indices": indices}))
        rows = unpack_fp8_ds_mla(k_cache.view(torch.uint8).reshape(-1, ROW_BYTES))
        res = torch.empty(b, s_q, h_q, D_V, dtype=torch.bfloat16)
        for i in range(b):
            for j in range(s_q):
                o = _attend(q[i, j].float(), rows, indices[i, j], softmax_scale)
                res[i, j] = o.to(torch.bfloat16)
        lse = torch.zeros(b, h_q, s_q)
        return res, lse, meta[0], meta[1]


class FakeInterface:
    """The three functions of flash_mla_interface the glue uses, over :class:`FakeOps`, with the
    interface's own checks of the scheduler metadata object."""

    class SchedMeta:
        pass

    def __init__(self) -> None:
        self.ops = FakeOps()

    def get_mla_metadata(self, *args, **kwargs):
        assert not args and not kwargs
        return FakeInterface.SchedMeta(), None

    def flash_mla_sparse_fwd(
        self, q, kv, indices, sm_scale, d_v=512, attn_sink=None, topk_length=None, out=None
    ):
        return self.ops.sparse_prefill_fwd(
            q, kv, indices, sm_scale, d_v, attn_sink, topk_length, out
        )

    def flash_mla_with_kvcache(self, **kw):
        assert set(kw) == {
            "q",
            "k_cache",
            "block_table",
            "head_dim_v",
            "cache_seqlens",
            "tile_scheduler_metadata",
            "is_fp8_kvcache",
            "indices",
            "softmax_scale",
        }, sorted(kw)
        assert isinstance(kw["tile_scheduler_metadata"], FakeInterface.SchedMeta)
        assert kw["is_fp8_kvcache"] is True
        b = kw["q"].shape[0]
        assert kw["block_table"].dtype == torch.int32 and kw["block_table"].shape[0] == b
        assert kw["cache_seqlens"].dtype == torch.int32 and kw["cache_seqlens"].shape == (b,)
        meta = kw["tile_scheduler_metadata"]
        tsm, ns = getattr(meta, "state", (None, None))
        out, lse, tsm, ns = self.ops.sparse_decode_fwd(
            kw["q"],
            kw["k_cache"],
            kw["indices"],
            None,
            None,
            tsm,
            ns,
            None,
            None,
            None,
            kw["head_dim_v"],
            kw["softmax_scale"],
            None,
            False,
        )
        meta.state = (tsm, ns)
        return out, lse
