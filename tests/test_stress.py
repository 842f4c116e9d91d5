"""Stress: ~200 mixed decode / prefill / spec calls on a persistent CPU pool, a sample checked against the
fp64 reference (the 10 000-call GPU run, CUDA graphs and size limits: tests/gpu/test_reliability_gpu.py).
"""

from __future__ import annotations

import torch
from _builders import (
    STATS,
    StressState,
    counts_reporter,
    stress_call,
)

_report_counts = counts_reporter("stress")


def test_stress_cpu():
    """~200 mixed calls of tiny shapes on persistent CPU pools; every 4th checked against the reference."""
    s = StressState("cpu", K_choices=(4, 8, 16), seed=7)
    for i in range(200):
        stress_call(s, check=i % 4 == 0)
    for p_ in s.pools.values():
        assert torch.isfinite(p_.float()).all()
    STATS["stress_calls"] += s.stats["calls"]
    STATS["stress_checked"] += s.stats["checked"]
    assert s.stats["checked"] == 50 and all(s.stats[f"mode_{m}"] > 0 for m in ("decode", "prefill", "packed", "spec"))
