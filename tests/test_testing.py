"""The shared pass/fail definition (triton_mla_sparse.testing): the tolerance table and the
comparison every test, verify, bench and the GPU tools use. CPU only, no kernel."""

from __future__ import annotations

import math

import pytest
import torch

from triton_mla_sparse.testing import (
    INDEXER_LOGITS_TOLERANCE,
    SPARSE_MLA_TOLERANCE,
    Tolerance,
    assert_sparse_mla_close,
    compare_sparse_mla,
    indexer_logits_tolerance,
    logits_row_error,
    lse_error,
    reference_dtype,
    rel_err,
    sparse_mla_tolerance,
)

F16 = torch.float16


def test_table_values():
    """The bounds are the tests' historical ones; a change here is a change of what passes."""
    assert dict(SPARSE_MLA_TOLERANCE) == {
        torch.float32: Tolerance(1e-5, 1e-5),
        torch.float16: Tolerance(2e-3, 1e-3),
        torch.bfloat16: Tolerance(1e-2, 1e-2),
    }
    assert dict(INDEXER_LOGITS_TOLERANCE) == {"gpu": 1e-3, "interpreter": 2e-5}
    assert indexer_logits_tolerance(torch.device("cpu")) == 2e-5
    assert indexer_logits_tolerance(torch.device("cuda", 0)) == 1e-3
    assert reference_dtype(torch.float32) == torch.float64
    assert reference_dtype(torch.bfloat16) == torch.float32
    with pytest.raises(ValueError, match="no sparse_mla tolerance"):
        sparse_mla_tolerance(torch.float64)


def _pair(seed: int = 0, t: int = 3, h: int = 4, width: int = 8):
    g = torch.Generator().manual_seed(seed)
    ref = torch.randn(t, h, width, generator=g, dtype=torch.float64)
    return ref.to(F16), ref


def test_rel_err():
    ref = torch.ones(4)
    assert rel_err(ref.clone(), ref) == 0.0
    assert rel_err(ref * 1.01, ref) == pytest.approx(0.01)
    bad = ref.clone()
    bad[1] = float("nan")
    assert rel_err(bad, ref) == float("inf")
    zero = torch.zeros(4)
    assert rel_err(zero, zero) == 0.0
    assert rel_err(zero + 1e-20, zero) == float("inf")  # an empty token must be exactly zero


def test_output_bound_is_the_dtype_bound():
    out, ref = _pair()
    assert compare_sparse_mla(out, ref).passed  # fp16 rounding alone: ~3e-4
    tol = SPARSE_MLA_TOLERANCE[F16].out_rtol
    over = (ref * (1 + 1.5 * tol)).to(F16)
    res = compare_sparse_mla(over, ref)
    assert not res.passed and res.err_ratio > 1 and "relative error" in res.failures[0]
    # the same output against a looser bound passes
    assert compare_sparse_mla(over, ref, tolerance=SPARSE_MLA_TOLERANCE[torch.bfloat16]).passed


def test_non_finite_output_fails_also_outside_the_checked_rows():
    out, ref = _pair()
    out[2, 0, 0] = float("nan")
    rows = torch.tensor([0, 1])
    res = compare_sparse_mla(out, ref[rows], rows=rows)
    assert res.err < 1e-3 and res.failures == ["1 non-finite outputs (of 96)"]


def test_lse_checks():
    out, ref = _pair()
    ref_lse = torch.randn(3, 4, dtype=torch.float64)
    ref_lse[1, 2] = float("-inf")
    out[1, 2] = 0
    ref[1, 2] = 0
    lse = ref_lse.float()
    assert compare_sparse_mla(out, ref, lse=lse, ref_lse=ref_lse).passed
    fails = lambda **kw: compare_sparse_mla(out, ref, **kw).failures  # noqa: E731
    assert fails(lse=lse + 2e-3, ref_lse=ref_lse) == ["LSE error 0.002 > 0.001"]
    moved = lse.clone()
    moved[1, 2], moved[0, 0] = 0.0, float("-inf")
    assert fails(lse=moved, ref_lse=ref_lse)[0].startswith("LSE -inf pattern differs")
    plus = lse.clone()
    plus[0, 0] = float("inf")
    assert fails(lse=plus, ref_lse=ref_lse) == ["LSE not finite where the reference's is"]
    nan = lse.clone()
    nan[0, 0] = float("nan")
    assert "1 NaN LSE values" in fails(lse=nan, ref_lse=ref_lse)
    # an empty token's output must be exactly zero, with or without the kernel's LSE
    nonzero = out.clone()
    nonzero[1, 2, 3] = 1e-4
    for kw in (dict(ref_lse=ref_lse), dict(lse=lse, ref_lse=ref_lse)):
        got = compare_sparse_mla(nonzero, ref, **kw).failures
        assert "1 empty (token, head) rows not exactly zero" in got, got


@pytest.mark.parametrize(
    "lse_ref,err,ok",
    [
        (16.0, 1.5e-5, True),  # the H200 graph suite's fp32 level at |LSE| 16: within 2e-5
        (16.0, 3.0e-5, False),
        (4.0, 1.5e-5, False),  # up to |LSE| 8 the absolute 1e-5 holds
        (-16.0, 1.9e-5, True),
    ],
)
def test_fp32_lse_bound_scales_with_lse(lse_ref, err, ok):
    out = torch.ones(1, 2, 8)
    ref_lse = torch.full((1, 2), lse_ref, dtype=torch.float64)
    res = compare_sparse_mla(out, out.double(), lse=ref_lse + err, ref_lse=ref_lse)
    assert res.passed == ok, res.failures
    # other dtypes' bounds are absolute at any |LSE|
    assert lse_error(ref_lse + 2e-2, ref_lse, torch.bfloat16) == pytest.approx(2e-2)


def test_assert_sparse_mla_close_names_every_failure():
    out, ref = _pair()
    out[0, 0, 0] = float("inf")
    with pytest.raises(AssertionError, match=r"1 non-finite outputs .*relative error inf.*case 7"):
        assert_sparse_mla_close(out, ref, what="case 7")


def test_logits_row_error():
    ref = torch.tensor([[1.0, -4.0, float("-inf")], [0.5, 0.25, 0.0]])
    out = ref.clone()
    out[0, 2] = -7777.0  # an unwritten column is not compared
    assert logits_row_error(out, ref) == 0.0
    out[1, 0] += 0.005  # relative to the row's largest |logit| (0.5)
    assert math.isclose(logits_row_error(out, ref), 0.01, rel_tol=1e-5)
    out[0, 1] = float("nan")
    assert logits_row_error(out, ref) == float("inf")
