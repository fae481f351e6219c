"""Bad inputs are rejected before any launch, naming the argument and showing what the caller
passed: TypeError for a wrong type or dtype, ValueError for wrong shapes, devices and values (the
exception type is pinned per case). Importing the package initialises no GPU and loads no kernel."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import numpy as np
import pytest
import torch
from conftest import DEVICE, HAS_GPU

import triton_mla_sparse.ops.sparse_mla.launch as launch_mod
from triton_mla_sparse import KernelConfig, sparse_mla

T, H, L, R, N, W = 3, 4, 512, 64, 64, 16


@pytest.fixture(autouse=True)
def no_launch(monkeypatch):
    """Any launch during these tests is a failure: validation must come first."""

    def boom(*args, **kwargs):
        raise AssertionError("sparse_mla launched a kernel on invalid input")

    monkeypatch.setattr(launch_mod, "launch_sparse_mla", boom)


def good(**over):
    """A valid fp16 call's arguments, with overrides."""
    dt = torch.float16
    kw = dict(
        q=torch.randn(T, H, L + R, dtype=dt, device=DEVICE),
        kv_cache=torch.randn(N, L + R, dtype=dt, device=DEVICE),
        indices=torch.zeros(T, W, dtype=torch.int32, device=DEVICE),
    )
    kw.update(over)
    return kw


def i32(*shape):
    return torch.zeros(*shape, dtype=torch.int32, device=DEVICE)


def u8(*shape):
    return torch.zeros(*shape, dtype=torch.uint8, device=DEVICE)


def f16(*shape):
    return torch.randn(*shape, device=DEVICE).half()


CASES = {
    # name: (overrides, exception, words that must appear in the message)
    "q-rank": (dict(q=f16(T, L + R)), ValueError, ["q"]),
    "q-int": (dict(q=torch.zeros(T, H, L + R, dtype=torch.int32, device=DEVICE)), TypeError, ["q"]),
    "q-float64": (
        dict(q=torch.zeros(T, H, L + R, dtype=torch.float64, device=DEVICE)),
        TypeError,
        ["q"],
    ),
    "q-narrow": (dict(q=f16(T, H, 256)), ValueError, ["q", "kv_lora_rank"]),
    "q-list": (dict(q=[1, 2]), TypeError, ["q"]),
    "q-tuple-3": (dict(q=(f16(T, H, L), f16(T, H, R), f16(T, H, R))), ValueError, ["q", "3"]),
    "q-tuple-not-tensors": (dict(q=(f16(T, H, L), 1.0)), TypeError, ["q_rope", "float"]),
    "q-tuple-heads": (dict(q=(f16(T, H, L), f16(T, H + 1, R))), ValueError, ["q_rope"]),
    "q-tuple-dtype": (dict(q=(f16(T, H, L), f16(T, H, R).float())), TypeError, ["q_rope"]),
    "q-tuple-latent": (dict(q=(f16(T, H, 256), f16(T, H, R))), ValueError, ["q_latent"]),
    "rope-width": (
        dict(q=f16(T, H, L + 48), kv_cache=f16(N, L + 48)),
        ValueError,
        ["rope", "q", "D=560", "(3, 4, 560)"],
    ),
    "rope-577": (
        dict(q=f16(T, H, L + 65), kv_cache=f16(N, L + 65)),
        ValueError,
        ["q", "577", "(3, 4, 577)"],
    ),
    "rope-width-tuple": (
        dict(q=(f16(T, H, L), f16(T, H, 48)), kv_cache=f16(N, L + 48)),
        ValueError,
        ["q_rope", "(3, 4, 48)"],
    ),
    # messages show q as passed ([T, H, 576]), not its latent slice [T, H, 512]
    "q-shown-as-passed": (dict(indices=i32(T + 1, W)), ValueError, ["(3, 4, 576)"]),
    "q-tuple-shown": (
        dict(q=(f16(T, H, L), f16(T, H, R)), indices=i32(T + 1, W)),
        ValueError,
        ["q_latent (3, 4, 512)", "q_rope (3, 4, 64)"],
    ),
    "kv-not-tensor": (dict(kv_cache=[[0.0] * (L + R)] * N), TypeError, ["kv_cache", "list"]),
    "kv-rows-2^31": (dict(kv_cache=f16(1, L + R).expand(2**31, L + R)), ValueError, ["kv_cache"]),
    "kv-rank": (dict(kv_cache=f16(2, 2, N, L + R)), ValueError, ["kv_cache"]),
    "kv-1d": (dict(kv_cache=f16(L + R)), ValueError, ["kv_cache"]),
    "kv-dtype-auto": (dict(kv_cache=f16(N, L + R).float()), TypeError, ["kv_cache", "auto"]),
    "kv-u8-auto": (dict(kv_cache=u8(N, L + R)), TypeError, ["kv_cache"]),
    "kv-width-auto": (dict(kv_cache=f16(N, L + R + 1)), ValueError, ["kv_cache", "576"]),
    "kv-width-nope": (
        dict(q=f16(T, H, L), kv_cache=f16(N, L + R)),
        ValueError,
        ["kv_cache", "512"],
    ),
    "kv-width-fp8": (dict(kv_cache=u8(N, 656), kv_format="fp8"), ValueError, ["kv_cache", "576"]),
    "kv-width-dsmla": (
        dict(kv_cache=u8(N, L + R), kv_format="fp8_ds_mla"),
        ValueError,
        ["kv_cache", "656"],
    ),
    "kv-paged-width-dsmla": (
        dict(kv_cache=u8(2, 64, 576), kv_format="fp8_ds_mla"),
        ValueError,
        ["kv_cache", "656"],
    ),
    "kv-dtype-fp8": (dict(kv_format="fp8"), TypeError, ["kv_format", "uint8"]),
    "kv-dtype-dsmla": (dict(kv_cache=f16(N, 328), kv_format="fp8_ds_mla"), TypeError, ["uint8"]),
    "kv-fp8-colstride": (
        dict(kv_cache=u8(L + R, N).t(), kv_format="fp8"),
        ValueError,
        ["unit stride"],
    ),
    "dsmla-misaligned-address": (
        dict(kv_cache=u8(N * 656 + 1)[1:].view(N, 656), kv_format="fp8_ds_mla"),
        ValueError,
        ["kv_cache", "4-byte boundary", "address"],
    ),
    "dsmla-row-stride-unaligned": (
        dict(kv_cache=u8(N * 659).as_strided((N, 656), (659, 1)), kv_format="fp8_ds_mla"),
        ValueError,
        ["kv_cache", "strides", "(659, 1)"],
    ),
    "v4-misaligned-address": (
        dict(
            q=f16(T, H, L),
            kv_cache=u8(4 * 2 * 584 + 1)[1:].view(4, 2, 584),
            kv_format="fp8_ds_mla_v4",
        ),
        ValueError,
        ["kv_cache", "2-byte boundary"],
    ),
    "dsmla-wrong-rank": (
        dict(q=f16(T, H, 256 + 64), kv_cache=u8(N, 656), kv_format="fp8_ds_mla", kv_lora_rank=256),
        ValueError,
        ["fp8_ds_mla", "512"],
    ),
    "kv-format-unknown": (dict(kv_format="fp8_e5m2"), ValueError, ["kv_format", "fp8_e5m2"]),
    "kv-format-not-str": (dict(kv_format=1), TypeError, ["kv_format"]),
    "kv-lora-rank": (dict(kv_lora_rank=500), ValueError, ["kv_lora_rank"]),
    "kv-lora-rank-str": (dict(kv_lora_rank="512"), TypeError, ["kv_lora_rank"]),
    "indices-int64": (
        dict(indices=torch.zeros(T, W, dtype=torch.int64, device=DEVICE)),
        TypeError,
        ["indices", "int32"],
    ),
    "indices-float": (dict(indices=f16(T, W)), TypeError, ["indices"]),
    "indices-list": (dict(indices=[[0] * W] * T), TypeError, ["indices"]),
    "indices-rank": (dict(indices=i32(T * W)), ValueError, ["indices"]),
    "indices-T": (dict(indices=i32(T + 1, W)), ValueError, ["indices", f"T={T}"]),
    "indices-W0": (dict(indices=i32(T, 0)), ValueError, ["indices"]),
    "counts-int64": (
        dict(valid_counts=torch.zeros(T, dtype=torch.int64, device=DEVICE)),
        TypeError,
        ["valid_counts", "int32"],
    ),
    "counts-T": (dict(valid_counts=i32(T + 2)), ValueError, ["valid_counts"]),
    "counts-rank": (dict(valid_counts=i32(T, 1)), ValueError, ["valid_counts"]),
    "bt-without-req": (dict(block_table=i32(2, 4), block_size=64), ValueError, ["req_ids"]),
    "bt-without-size": (dict(block_table=i32(2, 4), req_ids=i32(T)), ValueError, ["block_size"]),
    "req-without-bt": (dict(req_ids=i32(T), block_size=64), ValueError, ["block_table"]),
    "bt-int64": (
        dict(
            block_table=torch.zeros(2, 4, dtype=torch.int64, device=DEVICE),
            req_ids=i32(T),
            block_size=64,
        ),
        TypeError,
        ["block_table"],
    ),
    "bt-rank": (
        dict(block_table=i32(8), req_ids=i32(T), block_size=64),
        ValueError,
        ["block_table"],
    ),
    "req-T": (
        dict(block_table=i32(2, 4), req_ids=i32(T + 1), block_size=64),
        ValueError,
        ["req_ids"],
    ),
    "req-int64": (
        dict(
            block_table=i32(2, 4),
            req_ids=torch.zeros(T, dtype=torch.int64, device=DEVICE),
            block_size=64,
        ),
        TypeError,
        ["req_ids"],
    ),
    "block-size-0": (
        dict(block_table=i32(2, 4), req_ids=i32(T), block_size=0),
        ValueError,
        ["block_size"],
    ),
    "block-size-float": (
        dict(block_table=i32(2, 4), req_ids=i32(T), block_size=64.0),
        TypeError,
        ["block_size"],
    ),
    "bt-idx-ahead-config": (
        dict(
            block_table=i32(2, 4),
            req_ids=i32(T),
            block_size=64,
            config=KernelConfig(16, 32, 4, 3, idx_ahead=True),
        ),
        ValueError,
        ["idx_ahead", "block_table"],
    ),
    "ds-mla-bt-idx-ahead-config": (
        dict(
            kv_cache=u8(N, 656),
            kv_format="fp8_ds_mla",
            block_table=i32(2, 4),
            req_ids=i32(T),
            block_size=64,
            config=KernelConfig(16, 32, 4, 3, idx_ahead=True),
        ),
        ValueError,
        ["idx_ahead", "block_table", "fp8_ds_mla"],
    ),
    "stage-dequant-latent-config": (
        dict(config=KernelConfig(16, 32, 4, 2, stage_dequant=True)),
        ValueError,
        ["stage_dequant", "fp8_ds_mla", "'auto'"],
    ),
    "out-shape": (dict(out=f16(T, H, L + R)), ValueError, ["out", "(3, 4, 576)"]),
    "out-heads": (dict(out=f16(T, H + 1, L)), ValueError, ["out"]),
    "out-dtype": (dict(out=f16(T, H, L).float()), TypeError, ["out", "float32"]),
    "out-not-tensor": (dict(out=[0.0]), TypeError, ["out"]),
    "softmax-scale-tensor": (
        dict(softmax_scale=torch.tensor(0.1, device=DEVICE)),
        TypeError,
        ["softmax_scale", "tensor"],
    ),
    "softmax-scale-str": (dict(softmax_scale="0.1"), TypeError, ["softmax_scale", "str"]),
    "softmax-scale-bool": (dict(softmax_scale=True), TypeError, ["softmax_scale"]),
    "softmax-scale-nan": (dict(softmax_scale=float("nan")), ValueError, ["softmax_scale", "nan"]),
    "softmax-scale-inf": (dict(softmax_scale=float("inf")), ValueError, ["softmax_scale", "inf"]),
    "softmax-scale-np-inf": (dict(softmax_scale=np.float32("-inf")), ValueError, ["softmax_scale"]),
    "return-lse-str": (dict(return_lse="yes"), TypeError, ["return_lse"]),
    "config-not-config": (dict(config=(16, 32, 4, 2)), TypeError, ["config"]),
    "k-scale-auto": (dict(k_scale=0.5), ValueError, ["k_scale"]),
    "k-scale-dsmla": (
        dict(kv_cache=u8(N, 656), kv_format="fp8_ds_mla", k_scale=0.5),
        ValueError,
        ["k_scale"],
    ),
    "k-scale-2-elems": (
        dict(kv_cache=u8(N, L + R), kv_format="fp8", k_scale=torch.ones(2, device=DEVICE)),
        ValueError,
        ["k_scale"],
    ),
    "k-scale-fp16": (
        dict(
            kv_cache=u8(N, L + R),
            kv_format="fp8",
            k_scale=torch.ones(1, dtype=torch.float16, device=DEVICE),
        ),
        TypeError,
        ["k_scale", "float16"],
    ),
    "k-scale-str": (
        dict(kv_cache=u8(N, L + R), kv_format="fp8", k_scale="1"),
        TypeError,
        ["k_scale"],
    ),
    "k-scale-nan": (
        dict(kv_cache=u8(N, L + R), kv_format="fp8", k_scale=float("nan")),
        ValueError,
        ["k_scale"],
    ),
    "k-scale-negative": (
        dict(kv_cache=u8(N, L + R), kv_format="fp8", k_scale=-0.5),
        ValueError,
        ["k_scale", "positive", "-0.5"],
    ),
    "k-scale-zero": (
        dict(kv_cache=u8(N, L + R), kv_format="fp8", k_scale=0),
        ValueError,
        ["k_scale"],
    ),
    "q-list-of-tensors": (
        dict(q=[torch.zeros(T, H, L, device=DEVICE), torch.zeros(T, H, R, device=DEVICE)]),
        TypeError,
        ["q", "tuple", "list"],
    ),
    "sink-not-tensor": (dict(attn_sink=[0.0] * H), TypeError, ["attn_sink", "list"]),
    "sink-dtype": (
        dict(attn_sink=torch.zeros(H, dtype=torch.float16, device=DEVICE)),
        TypeError,
        ["attn_sink", "float16"],
    ),
    "sink-shape": (
        dict(attn_sink=torch.zeros(H + 1, device=DEVICE)),
        ValueError,
        ["attn_sink", f"[H={H}]", f"({H + 1},)"],
    ),
    "sink-2d": (dict(attn_sink=torch.zeros(1, H, device=DEVICE)), ValueError, ["attn_sink"]),
    # DeepSeek-V4's record
    "v4-q-width": (
        dict(kv_cache=u8(4, 2, 584), kv_format="fp8_ds_mla_v4"),
        ValueError,
        ["fp8_ds_mla_v4", "512", "(3, 4, 576)"],
    ),
    "v4-cache-width": (
        dict(q=f16(T, H, L), kv_cache=u8(4, 2, 656), kv_format="fp8_ds_mla_v4"),
        ValueError,
        ["kv_cache", "584", "(4, 2, 656)"],
    ),
    "v4-cache-flat": (
        dict(q=f16(T, H, L), kv_cache=u8(N, 584), kv_format="fp8_ds_mla_v4"),
        ValueError,
        ["kv_cache", "paged", f"({N}, 584)"],
    ),
    "v4-cache-dtype": (
        dict(q=f16(T, H, L), kv_cache=f16(4, 2, 584), kv_format="fp8_ds_mla_v4"),
        TypeError,
        ["uint8", "float16"],
    ),
    "v4-pages-overlap": (
        dict(
            q=f16(T, H, L),
            kv_cache=u8(4 * 584 * 2).as_strided((4, 2, 584), (584, 584, 1)),
            kv_format="fp8_ds_mla_v4",
        ),
        ValueError,
        ["kv_cache", "strides", "(584, 584, 1)", "1168"],
    ),
    "v4-page-stride-odd": (
        dict(
            q=f16(T, H, L),
            kv_cache=u8(4 * 1200).as_strided((4, 2, 584), (1169, 584, 1)),
            kv_format="fp8_ds_mla_v4",
        ),
        ValueError,
        ["kv_cache", "even", "1169"],
    ),
    "v4-extra-cache-rows": (
        dict(
            q=f16(T, H, L),
            kv_cache=u8(4, 2, 584),
            kv_format="fp8_ds_mla_v4",
            extra_kv_cache=u8(6000).as_strided((4, 2, 584), (1168, 600, 1)),
            extra_indices=i32(T, W),
        ),
        ValueError,
        ["extra_kv_cache", "(1168, 600, 1)"],
    ),
    # the extra index set
    "extra-cache-alone": (
        dict(extra_kv_cache=f16(N, L + R)),
        ValueError,
        ["extra_kv_cache", "extra_indices", "None", f"({N}, {L + R})"],
    ),
    "extra-indices-alone": (
        dict(extra_indices=i32(T, W)),
        ValueError,
        ["extra_kv_cache", "extra_indices", f"({T}, {W})"],
    ),
    "extra-counts-alone": (
        dict(extra_valid_counts=i32(T)),
        ValueError,
        ["extra_valid_counts", "extra_kv_cache"],
    ),
    "extra-cache-list": (
        dict(extra_kv_cache=[[0.0] * (L + R)] * N, extra_indices=i32(T, W)),
        TypeError,
        ["extra_kv_cache", "list"],
    ),
    "extra-cache-dtype": (
        dict(extra_kv_cache=f16(N, L + R).float(), extra_indices=i32(T, W)),
        TypeError,
        ["extra_kv_cache", "float32", "auto"],
    ),
    "extra-cache-width": (
        dict(extra_kv_cache=f16(N, L + R + 2), extra_indices=i32(T, W)),
        ValueError,
        ["extra_kv_cache", "576", f"({N}, {L + R + 2})"],
    ),
    "extra-cache-rank": (
        dict(extra_kv_cache=f16(2, 2, N, L + R), extra_indices=i32(T, W)),
        ValueError,
        ["extra_kv_cache"],
    ),
    "extra-cache-format": (
        dict(
            kv_cache=u8(N, 656),
            kv_format="fp8_ds_mla",
            extra_kv_cache=u8(N, L + R),
            extra_indices=i32(T, W),
        ),
        ValueError,
        ["extra_kv_cache", "656", "fp8_ds_mla"],
    ),
    "extra-cache-colstride": (
        dict(
            kv_cache=u8(N, L + R),
            kv_format="fp8",
            extra_kv_cache=u8(L + R, N).t(),
            extra_indices=i32(T, W),
        ),
        ValueError,
        ["extra_kv_cache", "unit stride"],
    ),
    "extra-cache-rows-2^31": (
        dict(extra_kv_cache=f16(1, L + R).expand(2**31, L + R), extra_indices=i32(T, W)),
        ValueError,
        ["extra_kv_cache", "2^31"],
    ),
    "extra-indices-int64": (
        dict(
            extra_kv_cache=f16(N, L + R),
            extra_indices=torch.zeros(T, W, dtype=torch.int64, device=DEVICE),
        ),
        TypeError,
        ["extra_indices", "int32", "int64"],
    ),
    "extra-indices-T": (
        dict(extra_kv_cache=f16(N, L + R), extra_indices=i32(T + 1, W)),
        ValueError,
        ["extra_indices", f"T={T}", f"({T + 1}, {W})"],
    ),
    "extra-indices-W0": (
        dict(extra_kv_cache=f16(N, L + R), extra_indices=i32(T, 0)),
        ValueError,
        ["extra_indices", f"({T}, 0)"],
    ),
    "extra-counts-T": (
        dict(extra_kv_cache=f16(N, L + R), extra_indices=i32(T, W), extra_valid_counts=i32(T + 1)),
        ValueError,
        ["extra_valid_counts", f"({T + 1},)"],
    ),
    "extra-counts-float": (
        dict(extra_kv_cache=f16(N, L + R), extra_indices=i32(T, W), extra_valid_counts=f16(T)),
        TypeError,
        ["extra_valid_counts"],
    ),
    "extra-bt-without-size": (
        dict(
            extra_kv_cache=f16(N, L + R),
            extra_indices=i32(T, W),
            extra_block_table=i32(2, 4),
            req_ids=i32(T),
        ),
        ValueError,
        ["extra_block_table", "extra_block_size"],
    ),
    "extra-bt-without-req": (
        dict(
            extra_kv_cache=f16(N, L + R),
            extra_indices=i32(T, W),
            extra_block_table=i32(2, 4),
            extra_block_size=16,
        ),
        ValueError,
        ["req_ids", "extra_block_table"],
    ),
    "extra-block-size-0": (
        dict(
            extra_kv_cache=f16(N, L + R),
            extra_indices=i32(T, W),
            extra_block_table=i32(2, 4),
            extra_block_size=0,
            req_ids=i32(T),
        ),
        ValueError,
        ["extra_block_size"],
    ),
    "extra-bt-rank": (
        dict(
            extra_kv_cache=f16(N, L + R),
            extra_indices=i32(T, W),
            extra_block_table=i32(8),
            extra_block_size=16,
            req_ids=i32(T),
        ),
        ValueError,
        ["extra_block_table"],
    ),
    "extra-req-T": (
        dict(
            extra_kv_cache=f16(N, L + R),
            extra_indices=i32(T, W),
            extra_block_table=i32(2, 4),
            extra_block_size=16,
            req_ids=i32(T + 1),
        ),
        ValueError,
        ["req_ids"],
    ),
}


@pytest.mark.parametrize("case", list(CASES))
def test_rejected_before_launch(case):
    over, exc, words = CASES[case]
    with pytest.raises((TypeError, ValueError)) as info:
        sparse_mla(**good(**over))
    assert type(info.value) is exc, f"{type(info.value).__name__}, not {exc.__name__}: {info.value}"
    msg = str(info.value)
    for w in words:
        assert w in msg, f"{w!r} not in {msg!r}"


def test_valid_call_reaches_launch():
    """The fixture really intercepts launches (so the cases above are not vacuous)."""
    with pytest.raises(AssertionError, match="launched a kernel"):
        sparse_mla(**good())


@pytest.mark.parametrize(
    "scale",
    [0.1, 1, np.float32(0.1), np.float64(0.1), np.int64(2), 0.0, -0.5],
    ids=["float", "int", "np-f32", "np-f64", "np-int", "zero", "negative"],
)
def test_softmax_scale_numbers_accepted(scale):
    """Any finite Python or NumPy real number passes validation (and reaches the launch)."""
    with pytest.raises(AssertionError, match="launched a kernel"):
        sparse_mla(**good(softmax_scale=scale))


def test_extra_set_accepted():
    """A paged extra cache of another page size, its counts and its own block table (request
    ids shared with the main set's table, or given for the extra table alone) pass validation."""
    xkw = dict(
        extra_kv_cache=f16(4, 16, L + R),
        extra_indices=i32(T, 7),
        extra_valid_counts=i32(2 * T)[::2],
        extra_block_table=i32(2, 3),
        extra_block_size=16,
        req_ids=i32(T),
    )
    with pytest.raises(AssertionError, match="launched a kernel"):
        sparse_mla(**good(**xkw))
    with pytest.raises(AssertionError, match="launched a kernel"):
        sparse_mla(**good(block_table=i32(2, 4), block_size=64, **xkw))


def test_v4_record_accepted():
    """vLLM's V4 allocation (padded page stride) and pages further apart pass validation."""
    from triton_mla_sparse.kv_format import alloc_fp8_ds_mla_v4

    v4 = dict(q=f16(T, H, L), kv_format="fp8_ds_mla_v4")
    with pytest.raises(AssertionError, match="launched a kernel"):
        sparse_mla(**good(kv_cache=alloc_fp8_ds_mla_v4(3, 64, device=DEVICE), **v4))
    spread = u8(3 * 4000).as_strided((3, 4, 584), (4000, 584, 1))
    with pytest.raises(AssertionError, match="launched a kernel"):
        sparse_mla(
            **good(
                kv_cache=spread,
                extra_kv_cache=alloc_fp8_ds_mla_v4(5, 2, device=DEVICE),
                extra_indices=i32(T, 9),
                **v4,
            )
        )


def test_attn_sink_any_stride_accepted():
    with pytest.raises(AssertionError, match="launched a kernel"):
        sparse_mla(**good(attn_sink=torch.zeros(2 * H, device=DEVICE)[::2]))


def test_k_scale_numpy_accepted():
    with pytest.raises(AssertionError, match="launched a kernel"):
        sparse_mla(**good(kv_cache=u8(N, L + R), kv_format="fp8", k_scale=np.float32(0.5)))


@pytest.mark.skipif(HAS_GPU, reason="the interpreter's refusal (CPU)")
def test_bf16_refused_under_interpreter():
    """Triton's interpreter computes bf16 wrongly (off by 1e9, silently): refused with TypeError
    saying to use fp16/fp32 on CPU."""
    assert os.environ.get("TRITON_INTERPRET") == "1"
    kw = good(
        q=torch.randn(T, H, L + R, dtype=torch.bfloat16),
        kv_cache=torch.randn(N, L + R, dtype=torch.bfloat16),
    )
    with pytest.raises(TypeError) as info:
        sparse_mla(**kw)
    for w in ("bf16", "TRITON_INTERPRET", "fp16 or fp32", "(3, 4, 576)"):
        assert w in str(info.value)
    for fmt in ("fp8", "fp8_ds_mla"):  # whatever the cache, a bf16 q is refused
        width = L + R if fmt == "fp8" else 656
        kw = good(q=torch.randn(T, H, L + R, dtype=torch.bfloat16), kv_cache=u8(N, width))
        with pytest.raises(TypeError, match="fp16 or fp32"):
            sparse_mla(**kw, kv_format=fmt)


@pytest.mark.skipif(not HAS_GPU, reason="needs a GPU to put tensors on two devices")
@pytest.mark.parametrize("arg", ["kv_cache", "indices", "valid_counts", "out", "k_scale"])
def test_devices_differ(arg):
    kw = good()
    cpu = {
        "kv_cache": kw["kv_cache"].cpu(),
        "indices": kw["indices"].cpu(),
        "valid_counts": torch.zeros(T, dtype=torch.int32),
        "out": torch.empty(T, H, L, dtype=torch.float16),
        "k_scale": torch.ones(1),
    }
    if arg == "k_scale":
        kw.update(kv_cache=u8(N, L + R), kv_format="fp8")
    kw[arg] = cpu[arg]
    with pytest.raises(ValueError) as info:  # a device is a value, not a type
        sparse_mla(**kw)
    assert arg in str(info.value)


def test_cpu_tensors_need_interpreter(monkeypatch):
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    kw = good(
        q=torch.randn(T, H, L + R).half(),
        kv_cache=torch.randn(N, L + R).half(),
        indices=torch.zeros(T, W, dtype=torch.int32),
    )
    with pytest.raises(ValueError, match="TRITON_INTERPRET"):
        sparse_mla(**kw)


def test_import_touches_no_gpu_and_no_kernels():
    code = textwrap.dedent(
        """
        import sys, torch
        import triton_mla_sparse
        from triton_mla_sparse import sparse_mla, KernelConfig, pack_fp8_ds_mla
        assert not torch.cuda.is_initialized(), "import initialised CUDA"
        for m in ("triton_mla_sparse.ops.sparse_mla.kernels", "triton_mla_sparse.ops.sparse_mla.launch"):
            assert m not in sys.modules, m + " imported at package import"
        print("ok")
        """
    )
    env = dict(os.environ)
    env.pop("TRITON_INTERPRET", None)
    src = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "src")
    env["PYTHONPATH"] = src + os.pathsep + env.get("PYTHONPATH", "")
    res = subprocess.run(
        [sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120
    )
    assert res.returncode == 0 and res.stdout.strip() == "ok", res.stderr[-2000:]


def test_interpreter_refused_by_name_where_it_cannot_run(monkeypatch):
    """Triton < 3.7's interpreter with NumPy >= 2.5 fails inside the kernel with a NumPy error;
    the call refuses first and says which packages to change."""
    from triton_mla_sparse.ops import host

    versions = {"triton": "3.6.0", "numpy": "2.5.2"}
    monkeypatch.setattr(host.metadata, "version", lambda dist: versions[dist])
    msg = host.interpreter_problem()
    assert msg and "Triton 3.6.0" in msg and "NumPy 2.5.2" in msg and "numpy<2.5" in msg
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    with pytest.raises(RuntimeError, match="interpreter cannot run under NumPy 2.5.2"):
        host.check_runs_here("sparse_mla", torch.device("cpu"), "")
    host.check_runs_here("sparse_mla", torch.device("meta"), "")  # not a CPU call: no check
    for ok in ({"triton": "3.7.0", "numpy": "2.5.2"}, {"triton": "3.6.0", "numpy": "2.4.6"}):
        versions.update(ok)
        assert host.interpreter_problem() is None


def test_plan_refuses_what_the_call_refuses_by_signature():
    """sparse_mla_plan binds its arguments against sparse_mla's own signature."""
    import inspect

    from triton_mla_sparse import sparse_mla, sparse_mla_plan

    q = torch.randn(2, 4, 576)
    kv = torch.randn(16, 576)
    idx = torch.zeros(2, 8, dtype=torch.int32)
    assert list(inspect.signature(sparse_mla_plan).parameters) == list(
        inspect.signature(sparse_mla).parameters
    )
    with pytest.raises(TypeError, match=r"sparse_mla_plan\(\) got an unexpected keyword argument"):
        sparse_mla_plan(q, kv, idx, no_such_argument=1)
    with pytest.raises(TypeError, match=r"sparse_mla_plan\(\) too many positional arguments"):
        sparse_mla_plan(q, kv, idx, None, 512)  # kv_lora_rank is keyword-only
    with pytest.raises(TypeError, match="sparse_mla_plan"):
        sparse_mla_plan(q, kv)  # indices missing
