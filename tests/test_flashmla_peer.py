"""``bench --compare flashmla`` and the FlashMLA glue (peers/flashmla.py), without FlashMLA.

FlashMLA runs on SM90/SM100 only; here its ops are replaced by ``flashmla_fake`` (its C++ argument
checks, its semantics in float32), so what is tested is what the glue hands it: head padding,
index layouts, cache views, un-padding, and that bench checks a peer before timing it.
tests/plugin/test_flashmla_vllm.py compares the same layouts with vLLM's own helpers.
"""

from __future__ import annotations

import json
import sys

import pytest
import torch
from conftest import load_script
from flashmla_fake import FakeInterface

from triton_mla_sparse.bench import Result, prepare, run_flashmla
from triton_mla_sparse.cli.main import main
from triton_mla_sparse.kv_format import pack_fp8_ds_mla
from triton_mla_sparse.peers import flashmla
from triton_mla_sparse.reference import sparse_mla_reference
from triton_mla_sparse.testing import sparse_mla_tolerance
from triton_mla_sparse.workloads import Case

CPU = torch.device("cpu")
BF16_TOL = sparse_mla_tolerance(torch.bfloat16).out_rtol  # FlashMLA's rows: bf16 only


def test_compare_flashmla_without_flashmla_exits_2(monkeypatch, capsys):
    """No vLLM and no FlashMLA files: exit 2, one line on stderr naming both routes."""
    import triton_mla_sparse.cli.bench as bench_cli

    monkeypatch.setattr(bench_cli, "gpu_device", lambda: CPU)  # as if on a GPU machine
    monkeypatch.setattr(flashmla, "_vllm_version", lambda: None)
    monkeypatch.setitem(sys.modules, flashmla.INTERFACE, None)  # import raises ImportError
    assert main(["bench", "--compare", "flashmla", "--decode", "1", "--no-prefill"]) == 2
    captured = capsys.readouterr()
    err = captured.err
    assert captured.out == "" and err.count("\n") == 1
    assert err.startswith("--compare flashmla: cannot import ") and flashmla.INTERFACE in err
    assert "pip install 'triton-mla-sparse[vllm]'" in err and "PYTHONPATH" in err


def test_load_through_installed_vllm(monkeypatch):
    """With vLLM installed, its own FlashMLA op module decides: its reason when FlashMLA cannot
    run here (nothing about PYTHONPATH), the interface module when it can."""
    import types

    verdict = (False, "FlashMLA Sparse is only supported on Hopper and Blackwell DC devices.")
    op = types.SimpleNamespace(is_flashmla_sparse_supported=lambda: verdict)
    monkeypatch.setitem(sys.modules, flashmla.VLLM_OP, op)
    monkeypatch.setattr(flashmla, "_vllm_version", lambda: "0.33.0")
    with pytest.raises(flashmla.PeerUnavailable) as info:
        flashmla.load()
    msg = str(info.value)
    assert msg.startswith("--compare flashmla: vLLM 0.33.0 is installed") and verdict[1] in msg
    assert "PYTHONPATH" not in msg and "written against" not in msg
    monkeypatch.setattr(flashmla, "_vllm_version", lambda: "0.34.1")
    with pytest.raises(flashmla.PeerUnavailable, match="written against vLLM 0.33"):
        flashmla.load()
    verdict = (True, None)
    interface = types.ModuleType(flashmla.INTERFACE)
    monkeypatch.setitem(sys.modules, flashmla.INTERFACE, interface)
    assert flashmla.load() is interface


def test_compare_rejects_unknown_peer(capsys):
    with pytest.raises(SystemExit) as e:
        main(["bench", "--compare", "flashinfer"])
    assert e.value.code == 2 and "invalid choice" in capsys.readouterr().err


def test_head_padding_matches_vllm_rules():
    for h in range(1, 129):
        assert flashmla.sparse_fwd_heads(h) == (64 if h <= 64 else 128)
        assert flashmla.fp8_decode_heads(h) == (64 if h <= 64 else 128)
        assert flashmla.fp8_decode_layout(7, h) == ((1, 7) if h < 32 else (7, 1))
    for bad in (0, 129):
        with pytest.raises(ValueError, match="heads"):
            flashmla.sparse_fwd_heads(bad)
        with pytest.raises(ValueError, match="heads"):
            flashmla.fp8_decode_heads(bad)


def test_pad_heads_copies_and_zero_fills():
    q = torch.randn(3, 5, 576).to(torch.bfloat16)[:, :, :]
    qs = q.transpose(0, 1).contiguous().transpose(0, 1)  # non-contiguous input
    p = flashmla.pad_heads(qs, 64)
    assert p.shape == (3, 64, 576) and p.dtype == torch.bfloat16 and p.is_contiguous()
    assert torch.equal(p[:, :5], q) and not p[:, 5:].any()
    with pytest.raises(ValueError, match=r"q must be \[T, H, D\] with H <= 4"):
        flashmla.pad_heads(q, 4)


def _loop_layouts(indices, num_rows, counts):
    """Per-token Python reference of both index layouts vLLM hands FlashMLA."""
    phys, packed, lengths = [], [], []
    for t, row in enumerate(indices.tolist()):
        n = len(row) if counts is None else int(counts[t])
        ok = [0 <= x < num_rows and j < n for j, x in enumerate(row)]
        phys.append([x if k else -1 for x, k in zip(row, ok)])
        kept = [x for x, k in zip(row, ok) if k]
        packed.append(kept + [-1] * (len(row) - len(kept)))
        lengths.append(len(kept))
    return torch.tensor(phys), torch.tensor(packed), torch.tensor(lengths)


@pytest.mark.parametrize("with_counts", [False, True])
def test_index_layouts(with_counts):
    g = torch.Generator().manual_seed(1)
    rows = 640
    idx = torch.randint(-3, rows + 40, (6, 96), generator=g, dtype=torch.int32)
    idx[0, :50] = -1  # a leading run of -1
    idx[1] = -1  # an empty token
    idx[2, 7] = rows  # just past the cache
    counts = torch.tensor([96, 96, 96, 0, 13, 95], dtype=torch.int32) if with_counts else None
    phys_ref, packed_ref, len_ref = _loop_layouts(idx, rows, counts)
    phys = flashmla.physical_indices(idx, rows, counts)
    assert phys.dtype == torch.int32 and phys.is_contiguous() and torch.equal(phys.long(), phys_ref)
    packed, lengths = flashmla.compacted_indices(idx, rows, counts)
    assert packed.dtype == torch.int32 and lengths.dtype == torch.int32 and packed.is_contiguous()
    assert torch.equal(packed.long(), packed_ref) and torch.equal(lengths.long(), len_ref)


def test_index_layouts_reject_bad_input():
    with pytest.raises(TypeError, match="indices must be torch.int32, got torch.int64"):
        flashmla.physical_indices(torch.zeros(2, 4, dtype=torch.long), 10)
    with pytest.raises(ValueError, match=r"indices must be \[T, W\], got shape \(8,\)"):
        flashmla.compacted_indices(torch.zeros(8, dtype=torch.int32), 10)
    with pytest.raises(ValueError, match=r"valid_counts must be \[T\] = \[2\], got shape \(3,\)"):
        flashmla.compacted_indices(torch.zeros(2, 4, dtype=torch.int32), 10, torch.zeros(3))


def test_cache_views():
    kv = torch.randn(4, 64, 576).to(torch.bfloat16)
    v = flashmla.sparse_fwd_kv(kv)
    assert v.shape == (256, 1, 576) and v.data_ptr() == kv.data_ptr() and v.stride(0) == 576
    assert torch.equal(v[70, 0], kv[1, 6])
    with pytest.raises(ValueError, match=r"got shape \(4, 32, 576\)"):
        flashmla.sparse_fwd_kv(kv[:, ::2])
    packed = pack_fp8_ds_mla(torch.randn(8 * 64, 576), "fp32")
    pages = flashmla.ds_mla_pages(packed.view(8, 64, 656))
    assert pages.shape == (8, 64, 1, 656) and pages.stride()[1:] == (656, 656, 1)
    assert pages.data_ptr() == packed.data_ptr()
    assert torch.equal(flashmla.ds_mla_pages(packed), pages)  # flat rows
    assert flashmla.ds_mla_pages(packed.view(4, 128, 656)).shape == (8, 64, 1, 656)
    # blocks of 64 rows with a gap between them (another layer's pages) are read in place
    spaced = torch.zeros(8, 80, 656, dtype=torch.uint8)[:, :64]
    assert flashmla.ds_mla_pages(spaced).stride(0) == 80 * 656
    with pytest.raises(ValueError, match=r"got shape \(100, 656\)"):
        flashmla.ds_mla_pages(packed[:100])
    with pytest.raises(TypeError, match="must be torch.uint8"):
        flashmla.ds_mla_pages(packed.view(torch.float8_e4m3fn))


def _inputs(t, h, kv_format, rows=512, w=128, holes=True, seed=0):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(t, h, 576, generator=g).to(torch.bfloat16)
    base = torch.randn(rows, 576, generator=g)
    kv = pack_fp8_ds_mla(base, "fp32") if kv_format == "fp8_ds_mla" else base.to(torch.bfloat16)
    kv = kv.view(rows // 64, 64, kv.shape[-1])
    idx = torch.stack([torch.randperm(rows, generator=g)[:w] for _ in range(t)]).int()
    if holes:
        idx[0, :40] = -1
        idx[-1, 3] = rows + 5
    return q, kv, idx


@pytest.mark.parametrize(
    "kv_format,heads,function,label",
    [
        ("auto", 16, "flash_mla_sparse_fwd", "sparse_fwd h64"),
        ("auto", 100, "flash_mla_sparse_fwd", "sparse_fwd h128"),
        ("fp8_ds_mla", 8, "flash_mla_with_kvcache", "kvcache fp8 h64 b1xs3"),
        ("fp8_ds_mla", 48, "flash_mla_with_kvcache", "kvcache fp8 h64 b3xs1"),
        ("fp8_ds_mla", 128, "flash_mla_with_kvcache", "kvcache fp8 h128 b3xs1"),
    ],
)
def test_prepare_call_against_reference(kv_format, heads, function, label):
    """What reaches FlashMLA's ops passes its checks, and the un-padded output is the reference's
    (the padded heads hold q = 0: slicing the wrong heads would not match)."""
    q, kv, idx = _inputs(3, heads, kv_format)
    counts = torch.tensor([128, 90, 128], dtype=torch.int32)
    fake = FakeInterface()
    call = flashmla.prepare_call(fake, q, kv, idx, 0.07, kv_format, valid_counts=counts)
    assert (call.function, call.label) == (function, label)
    out = call.run()
    assert out.shape == (3, heads, 512) and out.dtype == torch.bfloat16
    ref = sparse_mla_reference(q, kv, idx, 0.07, kv_format=kv_format, valid_counts=counts)
    err = (out.double() - ref.double()).norm() / ref.double().norm()
    assert err < 1e-2, err
    assert torch.equal(call.run(), out)  # a second call reuses the scheduler metadata
    op, passed = fake.ops.calls[0]
    hp = 64 if heads <= 64 else 128
    assert passed["q"].shape[-2:] == (hp, 576) and not passed["q"][..., heads:, :].any()
    assert set(call.args) >= {"q", "indices"} and "bfloat16" in call.args["q"]


def test_prepare_call_rejects_bad_input():
    q, kv, idx = _inputs(2, 8, "auto")
    fake = FakeInterface()
    with pytest.raises(TypeError, match="q must be torch.bfloat16 for FlashMLA, got torch.float16"):
        flashmla.prepare_call(fake, q.half(), kv, idx, 0.1, "auto")
    with pytest.raises(ValueError, match=r"q must be \[T, H, 576\], got shape \(2, 8, 512\)"):
        flashmla.prepare_call(fake, q[..., :512], kv, idx, 0.1, "auto")
    with pytest.raises(ValueError, match=r"indices must be \[T, W\] with T = 2"):
        flashmla.prepare_call(fake, q, kv, idx[:1], 0.1, "auto")
    with pytest.raises(
        ValueError, match="kv_format must be 'auto', 'fp8_ds_mla' or 'fp8_ds_mla_v4'"
    ):
        flashmla.prepare_call(fake, q, kv, idx, 0.1, "fp8")
    with pytest.raises(TypeError, match="a bf16 .* kv_cache must be torch.bfloat16"):
        flashmla.prepare_call(fake, q, kv.half(), idx, 0.1, "auto")
    assert not fake.ops.calls


def test_unsupported_cases():
    bf16, u = torch.bfloat16, flashmla.unsupported
    assert u("auto", bf16, 576, 16, decode=True) is None
    assert u("auto", bf16, 576, 128, decode=False) is None
    assert u("fp8_ds_mla", bf16, 576, 128, decode=True) is None
    assert u("fp8_ds_mla", bf16, 576, 31, decode=False) is None  # vLLM's mixed batch
    assert "upconversion" in u("fp8_ds_mla", bf16, 576, 32, decode=False)
    assert "bf16" in u("auto", torch.float16, 576, 16, decode=True)
    assert "576" in u("auto", bf16, 512, 16, decode=True)
    assert "fp8" in u("fp8", bf16, 576, 16, decode=True)


SMALL = dict(topk=128, rows=1024)


@pytest.mark.parametrize(
    "kv_format,tokens,call",
    [
        ("auto", 3, "sparse_fwd h64"),
        ("fp8_ds_mla", 3, "kvcache fp8 h64 b1xs3"),
        ("fp8_ds_mla", 600, "kvcache fp8 h64 b1xs600"),  # a prefill, checked on a sample
    ],
)
def test_run_flashmla_checks_the_peer(kv_format, tokens, call):
    """The bench's peer row: checked against the same reference and tolerance as our row."""
    case = Case("c", tokens, 16, kv_format=kv_format, holes=True, **SMALL)
    prepared = prepare(case, CPU)
    ours = Result(case.name, kv_format, "bfloat16", tokens, 16, 128, "-", 0.0, True, us=10.0)
    res = run_flashmla(case, CPU, prepared, ours, FakeInterface())
    assert res.passed and res.error is None and res.err <= BF16_TOL and res.call == call
    assert res.us is None and res.ratio is None and res.ours_us == 10.0  # CPU: never timed


def test_run_flashmla_reports_wrong_or_broken_peers():
    case = Case("decode", 2, 8, holes=True, **SMALL)
    prepared = prepare(case, CPU)
    ours = Result(case.name, "auto", "bfloat16", 2, 8, 128, "-", 0.0, True, us=10.0)

    class Wrong(FakeInterface):
        def flash_mla_sparse_fwd(self, q, kv, indices, sm_scale, **kw):
            out, m, lse = super().flash_mla_sparse_fwd(q, kv, indices, sm_scale, **kw)
            return out.flip(1), m, lse  # heads swapped

    class Broken(FakeInterface):
        def flash_mla_sparse_fwd(self, *a, **kw):
            raise RuntimeError("CUDA error: an illegal memory access\nwas encountered")

    res = run_flashmla(case, CPU, prepared, ours, Wrong())
    assert not res.passed and res.err > BF16_TOL and res.us is None and res.error is None
    res = run_flashmla(case, CPU, prepared, ours, Broken())
    assert not res.passed and res.us is None
    assert res.error == "RuntimeError: CUDA error: an illegal memory access was encountered"
    for skipped in (
        Case("fp16", 2, 8, dtype=torch.float16, **SMALL),
        Case("prefill", 600, 32, kv_format="fp8_ds_mla", **SMALL),
        Case("fp8", 2, 8, kv_format="fp8", **SMALL),
    ):
        assert run_flashmla(skipped, CPU, (None, None), ours, Broken()) is None


def _smoke_module():
    return load_script("benchmarks/perf/flashmla_smoke.py", "flashmla_smoke")


def test_smoke_script_without_flashmla_exits_2(monkeypatch, capsys):
    smoke = _smoke_module()
    monkeypatch.setattr(flashmla, "_vllm_version", lambda: None)
    monkeypatch.setitem(sys.modules, flashmla.INTERFACE, None)
    monkeypatch.setattr(sys, "argv", ["flashmla_smoke.py"])
    assert smoke.main() == 2
    assert capsys.readouterr().out.startswith("--compare flashmla: cannot import ")


@pytest.mark.skipif(torch.cuda.is_available(), reason="the CPU dry run of the smoke script")
@pytest.mark.parametrize("name", ["sparse_fwd-h16-holes", "kvcache-h16", "kvcache-h128"])
def test_smoke_cases_on_cpu_with_fake(monkeypatch, name):
    """The smoke script's case logic on CPU: the fake in place of FlashMLA, no graph, no timing."""
    smoke = _smoke_module()
    monkeypatch.setattr(torch.cuda, "synchronize", lambda: None)
    monkeypatch.setattr(smoke, "_graph_output", lambda run: run())
    monkeypatch.setattr(smoke, "time_graph", lambda run: 1.0)
    rec = smoke.run_one(name, smoke.CASES[name], FakeInterface(), CPU)
    assert rec["passed"] and "error" not in rec and rec["err"] <= BF16_TOL and rec["us"] == 1.0


@pytest.mark.skipif(not torch.cuda.is_available(), reason="FlashMLA runs on SM90/SM100")
def test_bench_compare_flashmla_one_shape(tmp_path):
    """On a GPU with FlashMLA importable (vLLM 0.33 installed, or its FlashMLA files on
    PYTHONPATH: peers/flashmla.py): both formats' peer rows are checked, timed and in the JSON."""
    try:
        flashmla.load()
    except flashmla.PeerUnavailable as e:
        pytest.skip(str(e))
    js = tmp_path / "b.json"
    argv = ["bench", "--decode", "4", "--heads", "16", "--no-prefill", "--compare", "flashmla"]
    assert main([*argv, "--json", str(js)]) == 0
    data = json.loads(js.read_text())
    assert data["environment"]["flashmla"].endswith("flash_mla_interface.py")
    peers = data["peers"]
    assert [p["kv_format"] for p in peers] == ["auto", "fp8_ds_mla"]
    for p in peers:
        assert p["passed"] and p["error"] is None and p["us"] > 0 and p["ratio"] > 0
