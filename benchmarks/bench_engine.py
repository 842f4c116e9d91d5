"""Prefill as serving engines call it: packed, ``cu_seqlens`` on the device only, replayed from a CUDA graph.

The per-GPU shapes of a 32-head model (K = V = 128) at tensor parallelism 1/2/4/8 — H ∈ {4, 8, 16, 32} — on one
long sequence, packed batches and a ragged mix; lower-bound gate λ = -5, logit beta, L2 norm, bf16 tokens, bf16
state pool, preallocated output (benchmarks/bench_prefill.py's data). Columns, ms per call (median graph replay):
- "ours": ``kda_ops.recurrent_kda`` with device ``cu_seqlens`` and no host mirror, ``KDA_SEQUENCE_SPLIT=auto``
  (the split planned on the device where the route takes it);
- "ours 1-pass": the same on the split's one-pass route (``kda_ops._split.ONE_PASS = True``; its fix-up kernel
  exists in a ``KDA_BUILD_EXPERIMENTS=1`` build only, elsewhere the column repeats the three passes);
- "ours forced": ``KDA_SEQUENCE_SPLIT=1`` (the split wherever a sequence is longer than the planned segment);
- "ours unsplit": the same with ``KDA_SEQUENCE_SPLIT=0``;
- "cudnn fp32": cuDNN Frontend's KDA with its native fp32 g / beta / state, the same device ``cu_seqlens``;
- "slow" rows set channel 0 of every head to a near-zero decay (dt_bias = -30): cuDNN's approximate split then
  walks back to the sequence start; ours is exact whatever the data.
Each graph is captured once (after two eager warm-up calls) and replayed.

    python benchmarks/bench_engine.py [--quick] [--cases 0,3] [--no-peers]
"""

from __future__ import annotations

import os
import sys
from typing import Any

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from benchmarks.bench_prefill import LOWER_BOUND, cudnn_call, graph_time_ms  # noqa: E402
from benchmarks.bench_prefill import make as make_prefill  # noqa: E402
from benchmarks.common import (  # noqa: E402
    add_cases_arg,
    chosen_cases,
    fmt,
    import_cudnn_kda,
    parse_args,
    ratio,
    try_call,
    write_results,
)

RAGGED = [5000, 300, 1200, 9000, 2500]
CASES = [
    ("H=4 T=16384", 4, [16384], False),
    ("H=4 T=131072", 4, [131072], False),
    ("H=8 T=16384", 8, [16384], False),
    ("H=8 packed 8x2048", 8, [2048] * 8, False),
    ("H=16 T=8192", 16, [8192], False),
    ("H=16 packed ragged", 16, RAGGED, False),
    ("H=32 T=4096", 32, [4096], False),
    ("H=32 packed 16x512", 32, [512] * 16, False),
    ("H=8 T=16384 slow", 8, [16384], True),
    ("H=4 T=4096", 4, [4096], False),
    ("H=8 T=131072", 8, [131072], False),
    ("H=16 T=16384", 16, [16384], False),
    ("H=32 T=16384", 32, [16384], False),
    ("H=32 T=131072", 32, [131072], False),
    ("H=16 packed 16x512", 16, [512] * 16, False),
]


def ours_device_call(kda_ops: Any, d: dict[str, Any]) -> Any:
    def run() -> Any:
        return kda_ops.recurrent_kda(
            d["q"], d["k"], d["v"], d["g"], d["beta"],
            A_log=d["A_log"], dt_bias=d["dt_bias"], initial_state=d["state"], cu_seqlens=d["cu"],
            use_gate_in_kernel=True, lower_bound=LOWER_BOUND, beta_is_logit=True, output=d["out"],
        )  # fmt: skip

    return run


def with_split(mode: str, fn: Any, one_pass: bool = False) -> Any:
    """fn with KDA_SEQUENCE_SPLIT=mode while it runs (re-read around the call, so a graph captures that route), on the
    split's one-pass route or its three passes."""
    from kda_ops import _routing, _split

    def run() -> Any:
        old = os.environ.get("KDA_SEQUENCE_SPLIT")
        os.environ["KDA_SEQUENCE_SPLIT"] = mode
        _routing.reload()
        _split.ONE_PASS = one_pass
        try:
            return fn()
        finally:
            _split.ONE_PASS = False
            if old is None:
                os.environ.pop("KDA_SEQUENCE_SPLIT", None)
            else:
                os.environ["KDA_SEQUENCE_SPLIT"] = old
            _routing.reload()

    return run


def main() -> None:
    args = parse_args("engine prefill", add_cases_arg)
    import kda_ops

    cudnn_kda = None if args.no_peers else import_cudnn_kda()
    rep = 5 if args.quick else 10
    rows, results = [], []
    for name, H, lens, slow in chosen_cases(CASES, args.cases, CASES[:9] if args.quick else None):
        d = make_prefill(H, lens)
        if slow:
            d["dt_bias"][:, 0] = -30.0
        rec: dict[str, Any] = {"case": name, "H": H, "lens": lens}
        ours = ours_device_call(kda_ops, d)
        variants = (("ours", "auto", False), ("ours 1-pass", "auto", True), ("ours forced", "1", False),
                    ("ours unsplit", "0", False))  # fmt: skip
        for key, mode, one in variants:
            fn = with_split(mode, ours, one)
            rec[key], rec[key + " error"] = try_call(lambda: graph_time_ms(fn, rep=rep))  # noqa: B023
        if cudnn_kda is not None:
            cud = cudnn_call(cudnn_kda, d, native=True)
            rec["cudnn fp32"], rec["cudnn error"] = try_call(lambda: graph_time_ms(cud, rep=rep))
        results.append(rec)
        rows.append([
            name, fmt(rec["ours"]), fmt(rec["ours 1-pass"]), fmt(rec["ours forced"]), fmt(rec["ours unsplit"]),
            fmt(rec.get("cudnn fp32")),
            ratio(rec.get("cudnn fp32"), rec["ours"]),
        ])  # fmt: skip
        print(" | ".join(str(c) for c in rows[-1]), flush=True)
        del d
        torch.cuda.empty_cache()
    header = ["case", "ours ms", "ours 1-pass ms", "ours forced ms", "ours unsplit ms", "cudnn fp32 ms", "cudnn / ours"]
    os.makedirs(args.out, exist_ok=True)
    write_results(args.out, "bench_engine", header, rows, results, [f"device: {torch.cuda.get_device_name()}"])


if __name__ == "__main__":
    main()
