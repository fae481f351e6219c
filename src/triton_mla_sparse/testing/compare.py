"""Comparison of a kernel's output with its reference, against :mod:`.tolerances`.

One definition per quantity, shared by the tests, ``verify``, ``bench`` and the GPU tools:
:func:`rel_err` (sparse_mla's output), :func:`lse_error` (its LSE), :func:`compare_sparse_mla`
(everything a sparse_mla result must satisfy, as a list of failures) and
:func:`logits_row_error` (the indexer logits).
"""

from __future__ import annotations

import dataclasses

import torch

from .tolerances import LSE_FP32_ABSOLUTE_UP_TO, Tolerance, sparse_mla_tolerance

__all__ = [
    "Comparison",
    "assert_sparse_mla_close",
    "compare_sparse_mla",
    "logits_row_error",
    "lse_error",
    "rel_err",
]


def rel_err(out: torch.Tensor, ref: torch.Tensor) -> float:
    """Relative Frobenius error ``||out - ref|| / ||ref||`` in float64 (on ``out``'s device);
    ``inf`` when ``out`` holds a non-finite value. A zero reference (every token empty) admits
    only an exactly zero output: 0.0 then, else ``inf``."""
    o, r = out.double(), ref.to(out.device).double()
    if not torch.isfinite(o).all():
        return float("inf")
    den = r.norm().item()
    num = (o - r).norm().item()
    if den == 0.0:
        return 0.0 if num == 0.0 else float("inf")
    return num / den


def lse_error(lse: torch.Tensor, ref_lse: torch.Tensor, dtype: torch.dtype) -> float:
    """Worst LSE error over the entries where the reference is finite (0.0 if none): absolute,
    and for fp32 divided by ``max(1, |ref| / LSE_FP32_ABSOLUTE_UP_TO)`` (tolerances.py says
    why)."""
    lse, ref = lse.double().cpu(), ref_lse.double().cpu()
    fin = torch.isfinite(ref)
    if not fin.any():
        return 0.0
    d = (lse[fin] - ref[fin]).abs()
    if dtype == torch.float32:
        d = d / ref[fin].abs().div(LSE_FP32_ABSOLUTE_UP_TO).clamp_min(1.0)
    return float(d.max())


@dataclasses.dataclass
class Comparison:
    """The outcome of :func:`compare_sparse_mla`: ``failures`` empty when it passed."""

    err: float  # rel_err of the output
    lse_err: float | None  # lse_error, None when no LSE was compared
    tolerance: Tolerance
    failures: list[str]

    @property
    def passed(self) -> bool:
        return not self.failures

    @property
    def err_ratio(self) -> float:
        """``err`` as a fraction of its bound (1.0 = at the limit)."""
        return self.err / self.tolerance.out_rtol

    @property
    def lse_ratio(self) -> float | None:
        return None if self.lse_err is None else self.lse_err / self.tolerance.lse_atol


def compare_sparse_mla(
    out: torch.Tensor,
    ref: torch.Tensor,
    *,
    lse: torch.Tensor | None = None,
    ref_lse: torch.Tensor | None = None,
    rows: torch.Tensor | None = None,
    tolerance: Tolerance | None = None,
) -> Comparison:
    """Everything a sparse_mla output (``[T, H, L]``, q's dtype) must satisfy against the
    reference's (any float dtype): every output finite, ``rel_err`` within the dtype's bound;
    with ``ref_lse``: exactly zero output where it is ``-inf`` (no valid index); with ``lse``
    too: no NaN LSE, ``-inf`` exactly where the reference's is (and finite everywhere else),
    ``lse_error`` within bound, exactly zero output where ``lse`` is ``-inf``.

    ``rows`` (token indices): the reference was computed for those tokens only, so ``out`` and
    ``lse`` are compared there; the finiteness of ``out`` is still checked on every token.
    ``tolerance`` defaults to :func:`sparse_mla_tolerance` of ``out``'s dtype.
    """
    tol = tolerance or sparse_mla_tolerance(out.dtype)
    failures = []
    bad = int((~torch.isfinite(out)).sum())
    if bad:
        failures.append(f"{bad} non-finite outputs (of {out.numel()})")
    o = out if rows is None else out[rows.to(out.device)]
    err = rel_err(o, ref)
    if not err <= tol.out_rtol:
        failures.append(f"relative error {err:.3g} > {tol.out_rtol:g}")
    lerr = None
    if ref_lse is not None:
        # [T, H]: small, compared on the CPU
        r = ref_lse.cpu()
        empty = torch.isneginf(r)
        # a token with no valid index attends to nothing: exactly zero output
        if empty.any() and not (o[empty.to(o.device)] == 0).all():
            failures.append(f"{int(empty.sum())} empty (token, head) rows not exactly zero")
    if lse is not None and ref_lse is not None:
        lse_all = lse.cpu()
        if torch.isnan(lse_all).any():
            failures.append(f"{int(torch.isnan(lse_all).sum())} NaN LSE values")
        lo = lse_all if rows is None else lse_all[rows.cpu()]
        if not torch.equal(torch.isneginf(lo), empty):
            failures.append("LSE -inf pattern differs from the reference's empty rows")
        elif not torch.equal(torch.isfinite(lo), torch.isfinite(r)):
            failures.append("LSE not finite where the reference's is")
        else:
            lerr = lse_error(lo, r, out.dtype)
            if not lerr <= tol.lse_atol:
                scaled = " (fp32: per |LSE|/8 above 8)" if out.dtype == torch.float32 else ""
                failures.append(f"LSE error {lerr:.3g} > {tol.lse_atol:g}{scaled}")
        neg = torch.isneginf(lse_all)
        if neg.any() and not (out[neg.to(out.device)] == 0).all():
            failures.append("rows with LSE -inf are not exactly zero")
    return Comparison(err, lerr, tol, failures)


def assert_sparse_mla_close(
    out: torch.Tensor,
    ref: torch.Tensor,
    *,
    lse: torch.Tensor | None = None,
    ref_lse: torch.Tensor | None = None,
    rows: torch.Tensor | None = None,
    tolerance: Tolerance | None = None,
    what: str = "",
) -> Comparison:
    """:func:`compare_sparse_mla`, raising ``AssertionError`` with every failure (and ``what``)."""
    res = compare_sparse_mla(out, ref, lse=lse, ref_lse=ref_lse, rows=rows, tolerance=tolerance)
    if res.failures:
        raise AssertionError("; ".join(res.failures) + (f"; {what}" if what else ""))
    return res


def logits_row_error(out: torch.Tensor, ref: torch.Tensor) -> float:
    """Indexer logits: max over rows of max ``|out - ref|`` / max ``|ref|`` of the row, on the
    columns the reference writes (finite); ``inf`` when ``out`` is not finite there."""
    fin = torch.isfinite(ref)
    if not torch.isfinite(out[fin]).all():
        return float("inf")
    scale = ref.masked_fill(~fin, 0).abs().amax(dim=1, keepdim=True).clamp_min(1e-30)
    return ((out - ref).abs() / scale).masked_fill(~fin, 0).max().item()
