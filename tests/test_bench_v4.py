"""``bench --model deepseek-v4`` and the DeepSeek-V4 workload, without a GPU.

The arguments (checked before any GPU work), the inputs (one V4 record cache per set, the
sliding window and the compressed top-k as vLLM 0.33 makes them), the cost the floor is taken
from, a tiny interpreter run of the reference check (and that it fails a kernel that drops the
extra set), and the FlashMLA call on the same cache tensors through ``flashmla_fake``.
"""

from __future__ import annotations

import pytest
import torch
from conftest import DEVICE
from flashmla_fake import FakeInterface

import triton_mla_sparse
from triton_mla_sparse.bench import Result, case_cost, prepare, run_case, run_flashmla
from triton_mla_sparse.cli import bench as bench_cli
from triton_mla_sparse.cli.main import build_parser, main
from triton_mla_sparse.kv_format import DS_V4_TOKEN_BYTES, ds_mla_v4_page_stride
from triton_mla_sparse.peers import flashmla
from triton_mla_sparse.testing import sparse_mla_tolerance
from triton_mla_sparse.workloads import PAGE, deepseek_v4_case, make_inputs

CPU = torch.device("cpu")
# DeepSeek-V4's widths on a small cache (the interpreter's cost is in heads and widths)
SMALL = dict(rows=2048)
BF16_TOL = sparse_mla_tolerance(torch.bfloat16).out_rtol  # FlashMLA's rows: bf16 only


def _args(*argv):
    return build_parser().parse_args(["bench", *argv])


def test_model_cases_default_to_64_heads_and_the_decode_tokens():
    cases = bench_cli.model_cases(_args("--model", "deepseek-v4"))
    assert [(c.tokens, c.heads) for c in cases] == [(t, 64) for t in (1, 4, 16, 64, 128)]
    c = cases[0]
    assert (c.kv_format, c.rope, c.topk, c.extra_topk) == ("fp8_ds_mla_v4", 0, 128, 512)
    assert c.window and c.sink and c.counts and c.dtype == torch.bfloat16
    cases = bench_cli.model_cases(_args("--model", "deepseek-v4", "--heads", "16,128"))
    assert [c.heads for c in cases] == [16] * 5 + [128] * 5
    # a typed list equal to the default is a choice, not the default
    cases = bench_cli.model_cases(_args("--model", "deepseek-v4", "--heads", "8,16,64,128"))
    assert sorted({c.heads for c in cases}) == [8, 16, 64, 128]
    cases = bench_cli.model_cases(_args("--model", "deepseek-v4", "--decode", "2"))
    assert [(c.tokens, c.heads) for c in cases] == [(2, 64)]


@pytest.fixture
def no_gpu_work(monkeypatch):
    def boom():
        raise AssertionError("bench looked for a GPU before validating its arguments")

    monkeypatch.setattr(bench_cli, "gpu_device", boom)


@pytest.mark.parametrize(
    "argv,words",
    [
        (["--model", "deepseek-v3"], ["--model", "invalid choice", "deepseek-v4"]),
        (["--model", "deepseek-v4", "--indexer"], ["--indexer", "pick one"]),
        (["--model", "deepseek-v4", "--plot", "x.png"], ["--plot", "deepseek-v4"]),
        (["--model", "deepseek-v4", "--sink"], ["--sink", "not with --model deepseek-v4"]),
        (
            ["--model", "deepseek-v4", "--prefill-heads", "64", "--sink"],
            ["--prefill-heads, --sink", "not with --model deepseek-v4"],
        ),
        (["--model", "deepseek-v4", "--full"], ["--full widens the --indexer grid"]),
    ],
)
def test_bad_model_arguments_exit_2_without_a_gpu(no_gpu_work, capsys, argv, words):
    try:
        rc = main(["bench", *argv])
    except SystemExit as e:  # argparse's own refusal
        rc = e.code
    assert rc == 2
    err = capsys.readouterr().err
    for w in words:
        assert w in err, (w, err)


def test_v4_inputs_are_vllms():
    """One V4 record cache per set in vLLM's page layout, the window as the main set (valid
    first, its length as the count, a first token whose window has not filled), the compressed
    top-k as the extra set (distinct rows, its valid entries as the count); the floor's bytes
    count both sets' records."""
    case = deepseek_v4_case(4, 16, holes=True, **SMALL)
    inp = make_inputs(case, CPU)
    kv, kw = inp.kv_cache, inp.kwargs
    for cache in (kv, kw["extra_kv_cache"]):
        assert cache.dtype == torch.uint8 and cache.shape == (SMALL["rows"] // PAGE, PAGE, 584)
        assert cache.stride() == (ds_mla_v4_page_stride(PAGE), DS_V4_TOKEN_BYTES, 1)
    assert inp.q.shape == (4, 16, 512) and kw["attn_sink"].shape == (16,)
    idx, counts = inp.indices, kw["valid_counts"]
    assert idx.shape == (4, 128) and torch.equal(counts, (idx >= 0).sum(1).int())
    assert counts[0] == 128 // 3 + 1 and (counts[1:] == 128).all()  # a short first window
    for t in range(4):
        n = int(counts[t])
        run = idx[t, :n]
        assert torch.equal(run, torch.arange(int(run[0]), int(run[0]) + n, dtype=torch.int32))
        assert (idx[t, n:] == -1).all()
    xidx, xcounts = kw["extra_indices"], kw["extra_valid_counts"]
    assert xidx.shape == (4, 512) and torch.equal(xcounts, (xidx >= 0).sum(1).int())
    for t in range(4):
        v = xidx[t][xidx[t] >= 0]
        assert v.unique().numel() == v.numel() and (v < SMALL["rows"]).all()
    nbytes, flops = case_cost(case, inp)
    assert nbytes == 4 * (128 + 512) * 584 + 4 * 16 * 512 * 2 * 2
    assert flops == 2.0 * 16 * 4 * (128 + 512) * (512 + 512)


def test_tiny_run_checks_against_the_reference(monkeypatch):
    """fp16, 2 tokens, on the GPU where there is one (else the interpreter): the reference check
    passes, and fails a kernel that leaves out the extra set (so the check is of both sets)."""
    case = deepseek_v4_case(2, 16, dtype=torch.float16, holes=True, **SMALL)
    res = run_case(case, DEVICE, time_it=False)
    assert res.passed and res.err <= sparse_mla_tolerance(torch.float16).out_rtol
    assert res.topk == 128 + 512 and res.us is None
    assert res.config.startswith("h16 ")
    real = triton_mla_sparse.sparse_mla

    def without_extra(*a, **kw):
        for k in ("extra_kv_cache", "extra_indices", "extra_valid_counts"):
            kw.pop(k, None)
        return real(*a, **kw)

    monkeypatch.setattr(triton_mla_sparse, "sparse_mla", without_extra)
    res = run_case(case, DEVICE, time_it=False)
    assert not res.passed and res.err > 1e-1


class _NoExtra(FakeInterface):
    """FlashMLA without its extra set (a peer that must fail the check)."""

    def flash_mla_with_kvcache(self, **kw):
        for k in ("extra_k_cache", "extra_indices_in_kvcache", "extra_topk_length"):
            kw.pop(k)
        return super().flash_mla_with_kvcache(**kw)


@pytest.mark.parametrize("heads,hp", [(16, 64), (64, 64), (100, 128)])
def test_flashmla_v4_call_on_the_same_cache(heads, hp):
    """FlashMLA as vLLM 0.33 calls it for DeepSeek-V4 decode: q padded to 64 / 128 heads
    (zeros), the sink padded with -inf, no block table, the very cache tensors the kernel reads
    (views of the same storage, vLLM's page stride), both sets' slots valid first with their
    lengths, out written in place; checked against the same reference before any timing."""
    case = deepseek_v4_case(3, heads, holes=True, **SMALL)
    prepared = prepare(case, CPU)
    inp = prepared[0]
    ours = Result(case.name, case.kv_format, "bfloat16", 3, heads, 640, "-", 0.0, True, us=10.0)
    fake = FakeInterface()
    res = run_flashmla(case, CPU, prepared, ours, fake)
    assert res.error is None, res.error
    assert res.passed and res.err <= BF16_TOL and res.call == f"kvcache v4 h{hp} b3xs1 +extra"
    assert res.us is None and res.ratio is None  # CPU: never timed
    ((_, passed),) = fake.ops.calls
    assert passed["k_cache"].data_ptr() == inp.kv_cache.data_ptr()
    assert passed["k_cache"].stride(0) == ds_mla_v4_page_stride(PAGE)
    assert passed["q"].shape == (3, 1, hp, 512) and not passed["q"][:, :, heads:].any()
    call = flashmla.prepare_call(
        fake,
        inp.q,
        inp.kv_cache,
        inp.indices,
        inp.scale,
        case.kv_format,
        valid_counts=inp.kwargs["valid_counts"],
        attn_sink=inp.kwargs["attn_sink"],
        extra_kv_cache=inp.kwargs["extra_kv_cache"],
        extra_indices=inp.kwargs["extra_indices"],
        extra_valid_counts=inp.kwargs["extra_valid_counts"],
    )
    assert call.args["block_table"] == "None" and "extra_k_cache" in call.args
    assert f"({hp},)" in call.args["attn_sink"]
    res = run_flashmla(case, CPU, prepared, ours, _NoExtra())
    assert not res.passed and res.err > BF16_TOL and res.us is None


def test_flashmla_v4_unsupported_and_refused():
    bf16, u = torch.bfloat16, flashmla.unsupported
    assert u("fp8_ds_mla_v4", bf16, 512, 64, decode=True) is None
    assert "prefill" in u("fp8_ds_mla_v4", bf16, 512, 64, decode=False)
    assert "bf16" in u("fp8_ds_mla_v4", torch.float16, 512, 64, decode=True)
    case = deepseek_v4_case(2, 16, **SMALL)
    inp = make_inputs(case, CPU)
    fake = FakeInterface()
    with pytest.raises(ValueError, match=r"q must be \[T, H, 512\]"):
        flashmla.prepare_call(
            fake, inp.q[..., :256], inp.kv_cache, inp.indices, 0.1, case.kv_format
        )
    with pytest.raises(ValueError, match="extra index set is FlashMLA's DeepSeek-V4"):
        q = torch.zeros(2, 16, 576, dtype=torch.bfloat16)
        flashmla.prepare_call(
            fake,
            q,
            torch.zeros(4, 64, 576, dtype=torch.bfloat16),
            inp.indices,
            0.1,
            "auto",
            extra_kv_cache=inp.kwargs["extra_kv_cache"],
            extra_indices=inp.kwargs["extra_indices"],
        )
    with pytest.raises(ValueError, match="go together"):
        flashmla.prepare_call(
            fake,
            inp.q,
            inp.kv_cache,
            inp.indices,
            0.1,
            case.kv_format,
            extra_kv_cache=inp.kwargs["extra_kv_cache"],
        )
    assert not fake.ops.calls
