"""Shared by the tests, ``verify``, ``bench`` and the GPU tools under benchmarks/: what passes
(:mod:`.tolerances`), how an output is compared with its reference (:mod:`.compare`) and how a
call is timed (:mod:`.timing`).

Importing it touches no GPU and imports no kernel.
"""

from .compare import (
    Comparison,
    assert_sparse_mla_close,
    compare_sparse_mla,
    logits_row_error,
    lse_error,
    rel_err,
)
from .timing import Ceilings, capture_graph, measure_ceilings, time_events, time_graph
from .tolerances import (
    INDEXER_LOGITS_TOLERANCE,
    SPARSE_MLA_TOLERANCE,
    Tolerance,
    indexer_logits_tolerance,
    reference_dtype,
    sparse_mla_tolerance,
)

__all__ = [
    "INDEXER_LOGITS_TOLERANCE",
    "SPARSE_MLA_TOLERANCE",
    "Ceilings",
    "Comparison",
    "Tolerance",
    "assert_sparse_mla_close",
    "capture_graph",
    "compare_sparse_mla",
    "indexer_logits_tolerance",
    "logits_row_error",
    "lse_error",
    "measure_ceilings",
    "reference_dtype",
    "rel_err",
    "sparse_mla_tolerance",
    "time_events",
    "time_graph",
]
