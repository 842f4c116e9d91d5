"""The training-mode cases of the tests (tests/test_training_modes.py, tests/test_reference_chunked_backward.py,
tests/gpu/test_training_cuda.py). The builders live in benchmarks/profiling/training_cases.py, where the profiling
tools share them without importing tests/ (no tools <-> tests cycle); this module re-exports them."""

from __future__ import annotations

import os
import sys

_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if _ROOT not in sys.path:  # the repository root (benchmarks/), also for child processes that put only tests/ first
    sys.path.insert(1, _ROOT)

from benchmarks.profiling.training_cases import (  # noqa: E402
    EDGES,
    GATES,
    GRADS,
    MODES,
    PINNED_UNCOMPARED,
    edge_collinear,
    edge_no_decay,
    edge_pinned,
    edge_small_qk,
    make_case,
    mode_id,
    reference_grads,
    softplus_band,
)

__all__ = [
    "EDGES",
    "GATES",
    "GRADS",
    "MODES",
    "PINNED_UNCOMPARED",
    "edge_collinear",
    "edge_no_decay",
    "edge_pinned",
    "edge_small_qk",
    "make_case",
    "mode_id",
    "reference_grads",
    "softplus_band",
]
