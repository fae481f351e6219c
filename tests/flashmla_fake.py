"""A CPU stand-in for FlashMLA's compiled ops, for testing the bench's FlashMLA glue without a GPU.

``FakeOps`` has the two ops vLLM 0.33's ``flash_mla_interface.py`` calls
(``sparse_prefill_fwd``, ``sparse_decode_fwd``), with the argument checks of FlashMLA's C++ API
(csrc/api/sparse_fwd.h, sparse_decode.h: dtypes, ranks, shapes, last-dim contiguity, h_q 64/128,
656-byte rows in contiguous 64-row blocks, int32 indices; DeepSeek-V4's 584-byte record in pages
with their own stride, 512-wide q, topk lengths, a sink and an extra cache), and computes
FlashMLA's semantics in float32: an index < 0 or past the cache is skipped, only the first
``topk_length`` are read, the extra set joins the same softmax, the sink adds e^sink to its
denominator.
``FakeInterface`` is the same thing behind the interface's Python signatures.
"""

from __future__ import annotations

import torch

from triton_mla_sparse.kv_format import unpack_fp8_ds_mla, unpack_fp8_ds_mla_v4

D_QK, D_V, ROW_BYTES = 576, 512, 656
V4_D_QK, V4_BYTES = 512, 584


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
        if k_cache.shape[-1] == V4_BYTES:
            return self._v4_decode(
                q,
                k_cache,
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
            )
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
        meta = self._meta(b, tile_scheduler_metadata, num_splits)
        self.calls.append(("sparse_decode_fwd", {"q": q, "k_cache": k_cache, "indices": indices}))
        rows = unpack_fp8_ds_mla(k_cache.view(torch.uint8).reshape(-1, ROW_BYTES))
        res = torch.empty(b, s_q, h_q, D_V, dtype=torch.bfloat16)
        for i in range(b):
            for j in range(s_q):
                o = _attend(q[i, j].float(), rows, indices[i, j], softmax_scale)
                res[i, j] = o.to(torch.bfloat16)
        lse = torch.zeros(b, h_q, s_q)
        return res, lse, meta[0], meta[1]

    def _meta(self, b, tile_scheduler_metadata, num_splits):
        if tile_scheduler_metadata is None:  # first call: computes the metadata
            assert num_splits is None
            meta = (torch.zeros(4, 8, dtype=torch.int32), torch.zeros(b + 1, dtype=torch.int32))
            self.issued.append(meta)
            return meta
        meta = (tile_scheduler_metadata, num_splits)  # later calls hand back the first's
        assert any(meta[0] is m and meta[1] is n for m, n in self.issued)
        return meta

    @staticmethod
    def _v4_rows(cache, indices, lengths, b, s_q):
        """(float32 rows [N, 512], per (i, j) the valid slots) of one V4 cache and its lists."""
        assert cache.dim() == 4 and cache.shape[2:] == (1, V4_BYTES), tuple(cache.shape)
        assert cache.dtype in (torch.uint8, torch.int8, torch.float8_e4m3fn)
        assert cache.stride(1) == V4_BYTES and cache.stride(-1) == 1, cache.stride()
        assert cache.stride(0) >= cache.shape[1] * V4_BYTES
        assert indices.dtype == torch.int32 and indices.dim() == 3
        assert indices.shape[:2] == (b, s_q) and indices.stride(-1) == 1
        if lengths is not None:
            assert lengths.dtype == torch.int32 and lengths.shape == (b,)
        rows = unpack_fp8_ds_mla_v4(cache.view(torch.uint8).squeeze(2))
        sel = {}
        for i in range(b):
            for j in range(s_q):
                idx = indices[i, j]
                if lengths is not None:
                    idx = idx[: int(lengths[i])]
                sel[i, j] = idx[(idx >= 0) & (idx < rows.shape[0])].long()
        return rows, sel

    def _v4_decode(
        self,
        q,
        k_cache,
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
        assert q.dim() == 4 and q.dtype == torch.bfloat16 and q.stride(-1) == 1
        b, s_q, h_q, d_qk = q.shape
        assert d_qk == V4_D_QK and d_v == D_V and h_q in (64, 128), tuple(q.shape)
        assert not enable_batch_invariant
        rows, sel = self._v4_rows(k_cache, indices, topk_length, b, s_q)
        if extra_kv is not None:
            xrows, xsel = self._v4_rows(extra_kv, extra_indices, extra_topk_length, b, s_q)
        else:
            assert extra_indices is None and extra_topk_length is None
        if attn_sink is not None:
            assert attn_sink.dtype == torch.float32 and attn_sink.shape == (h_q,)
        if out_ is not None:
            assert out_.shape == (b, s_q, h_q, D_V) and out_.dtype == torch.bfloat16
            assert out_.is_contiguous()
        meta = self._meta(b, tile_scheduler_metadata, num_splits)
        self.calls.append(("sparse_decode_fwd", {"q": q, "k_cache": k_cache, "indices": indices}))
        res = out_ if out_ is not None else torch.empty(b, s_q, h_q, D_V, dtype=torch.bfloat16)
        for i in range(b):
            for j in range(s_q):
                k = rows[sel[i, j]]
                if extra_kv is not None:
                    k = torch.cat([k, xrows[xsel[i, j]]])
                if not k.shape[0]:  # nothing to attend: zeros, sink or not
                    res[i, j] = 0
                    continue
                s = q[i, j].float() @ k.T * sm_scale  # [h_q, n]
                m = s.amax(dim=1, keepdim=True)
                e = torch.exp(s - m)
                den = e.sum(dim=1, keepdim=True)
                if attn_sink is not None:  # one more term, no value row (+inf: zeros)
                    den = den + torch.exp(attn_sink[:, None] - m)
                res[i, j] = ((e @ k[:, :D_V]) / den).to(torch.bfloat16)
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

    # the arguments the interface takes beyond those every sparse decode call passes
    OPTIONAL = {
        "topk_length",
        "attn_sink",
        "extra_k_cache",
        "extra_indices_in_kvcache",
        "extra_topk_length",
        "out",
    }

    def flash_mla_with_kvcache(self, **kw):
        base = {
            "q",
            "k_cache",
            "block_table",
            "head_dim_v",
            "cache_seqlens",
            "tile_scheduler_metadata",
            "is_fp8_kvcache",
            "indices",
            "softmax_scale",
        }
        assert base <= set(kw) <= base | self.OPTIONAL, sorted(kw)
        assert isinstance(kw["tile_scheduler_metadata"], FakeInterface.SchedMeta)
        assert kw["is_fp8_kvcache"] is True
        if kw["k_cache"].shape[-1] == V4_BYTES:  # DeepSeek-V4: no block table, no seqlens
            assert kw["block_table"] is None and kw["cache_seqlens"] is None
            meta = kw["tile_scheduler_metadata"]
            tsm, ns = getattr(meta, "state", (None, None))
            out, lse, tsm, ns = self.ops.sparse_decode_fwd(
                kw["q"],
                kw["k_cache"],
                kw["indices"],
                kw.get("topk_length"),
                kw.get("attn_sink"),
                tsm,
                ns,
                kw.get("extra_k_cache"),
                kw.get("extra_indices_in_kvcache"),
                kw.get("extra_topk_length"),
                kw["head_dim_v"],
                kw["softmax_scale"],
                kw.get("out"),
                False,
            )
            meta.state = (tsm, ns)
            return out, lse
        assert set(kw) == base, sorted(kw)
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
