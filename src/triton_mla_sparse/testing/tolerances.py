"""What "passes" means: the one tolerance table of the kernels against their references.

Used by the tests, ``triton-mla-sparse verify`` and ``bench``, and the GPU tools under
benchmarks/ (reliability, tuning, smoke runs); nothing else defines a pass.

sparse_mla is judged on two numbers (:func:`.compare.compare_sparse_mla`):

- the output's relative Frobenius error, ``||out - ref|| / ||ref||``;
- the natural-log LSE's absolute error (fp32: scaled by ``max(1, |LSE| / 8)``, see below).

The tolerance depends on the output dtype only, not on the cache format: the reference
dequantizes the very bytes the kernel reads (fp8 scales included), so quantization error is not
part of the comparison, and what an e4m3 cache changes in the kernel (MMA operands in fp16 or in
q's dtype, both exact for e4m3 values) stays within the dtype's rounding budget. tests/
test_sparse_mla.py runs every format at these values, the reliability procedure every compiled
variant on an H200 (docs/RELIABILITY.md).

The reference runs in float64 for fp32 q and in float32 otherwise (:func:`reference_dtype`):
a float32 reference of an fp32 kernel would have errors of the same size as the kernel's.
"""

from __future__ import annotations

import dataclasses

import torch

__all__ = [
    "INDEXER_LOGITS_TOLERANCE",
    "LSE_FP32_ABSOLUTE_UP_TO",
    "SPARSE_MLA_TOLERANCE",
    "Tolerance",
    "indexer_logits_tolerance",
    "reference_dtype",
    "sparse_mla_tolerance",
]


@dataclasses.dataclass(frozen=True)
class Tolerance:
    """``out_rtol``: bound on the output's relative Frobenius error; ``lse_atol``: bound on the
    LSE's absolute error (fp32: per ``max(1, |LSE| / LSE_FP32_ABSOLUTE_UP_TO)``)."""

    out_rtol: float
    lse_atol: float


SPARSE_MLA_TOLERANCE: dict[torch.dtype, Tolerance] = {
    # fp32 q and output: the kernel runs fp32 dots at "ieee" precision and keeps P in fp32, so
    # only the summation order differs from the float64 reference (measured on the H200 graph
    # suite up to 0.7e-5 on the output at top-k 2048 x 128 heads).
    torch.float32: Tolerance(out_rtol=1e-5, lse_atol=1e-5),
    # fp16: P is rounded to fp16 for the PV dot and the output to fp16, each ~2^-11 relative
    # (~3e-4 on the norm); e4m3 caches decoded to fp16 MMA operands add as much again. The LSE
    # comes from fp32 softmax statistics of scores whose q . k has fp16 operands.
    torch.float16: Tolerance(out_rtol=2e-3, lse_atol=1e-3),
    # bf16: the same argument with bf16's 2^-8 (the H200 bench's worst case is 1.9e-3).
    torch.bfloat16: Tolerance(out_rtol=1e-2, lse_atol=1e-2),
}

# fp32 rounds the LSE's log-domain max and sum in proportion to their size: 1e-5 absolute holds
# up to |LSE| 8 (every test's range) and the bound grows with |LSE| above it (the reliability
# procedure's caches hold rows three times the usual magnitude; H200: 1.5e-5 at |LSE| 16). The
# other dtypes' bounds are far above fp32's rounding at any |LSE| and stay absolute.
LSE_FP32_ABSOLUTE_UP_TO = 8.0

# DSA indexer logits (e4m3 or fp16/bf16/fp32 q against the e4m3 K cache, fp32 logits): max over
# rows of max |out - ref| / max |ref| of the row. Under Triton's interpreter every product is
# exact in fp32 (e4m3 x e4m3/fp16/fp32) and only the fp32 sums round; GPU tensor cores may
# accumulate e4m3 products with fewer bits (Hopper's fp8 MMA), so the GPU bound is wider
# (H200, bench --indexer under Triton 3.8: worst 6.0e-4).
INDEXER_LOGITS_TOLERANCE = {"gpu": 1e-3, "interpreter": 2e-5}


def sparse_mla_tolerance(dtype: torch.dtype) -> Tolerance:
    """The tolerance of a sparse_mla output of ``dtype`` (q's dtype), any cache format."""
    try:
        return SPARSE_MLA_TOLERANCE[dtype]
    except KeyError:
        raise ValueError(
            f"no sparse_mla tolerance for {dtype}: sparse_mla outputs fp16, bf16 or fp32"
        ) from None


def reference_dtype(dtype: torch.dtype) -> torch.dtype:
    """``compute_dtype`` of the reference a kernel output of ``dtype`` is compared with."""
    return torch.float64 if dtype == torch.float32 else torch.float32


def indexer_logits_tolerance(device: torch.device) -> float:
    """The indexer logits' bound for a call on ``device`` (CPU: Triton's interpreter)."""
    return INDEXER_LOGITS_TOLERANCE["interpreter" if device.type == "cpu" else "gpu"]
