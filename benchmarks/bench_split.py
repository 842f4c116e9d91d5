"""Exact sequence split (kda_ops/_split.py) beside the unsplit prefill, cuDNN Frontend and FlashKDA, in
one process; plus a modelled context-parallel scaling table (kda_ops.distributed) for 2-8 ranks.

Prefill: K = V = 128, lower-bound gate λ = -5, logit beta, L2 norm, bf16 tokens, bf16 state pool,
preallocated output (the data of benchmarks/bench_prefill.py). Columns:
- "unsplit": ``KDA_SEQUENCE_SPLIT=0``, eager and as a CUDA-graph replay;
- "split auto-plan": the split forced on (``1``) with the segment length from the shapes, eager;
- "split graph": the same as a CUDA-graph replay, for one-sequence cases called in the fixed layout (packed
  captures split too, planned on the device: benchmarks/bench_engine.py);
- "split best Ls": the fastest of a sweep of segment lengths (the length is printed);
- "one pass": the unsplit op on the plan's segments as independent sequences (zero starts): the cost
  of one of the split's three passes, for the profile of the split;
- cuDNN Frontend (fp32 g/β/state, its native inputs, and our bf16 inputs) and FlashKDA when importable.
"slow" cases set one channel per head to a near-zero decay (dt_bias = -30 on channel 0): cuDNN's
approximate split then replays serially; ours is exact whatever the data, so its time does not move.

Context parallelism (no multi-GPU run here): per-rank training forward/backward times measured on this
GPU at T/R tokens, combined with the algorithm's pass counts (an inner rank runs its tokens 3x forward,
2x backward; see kda_ops/distributed.py) and the exchanged bytes over an assumed link:
    step(R) = 3 t_fwd(T/R) + 2 t_bwd(T/R) + 2 (latency + R * bytes_per_rank / bandwidth)
(R = 2: 2 t_fwd + 2 t_bwd: no rank lies inside the sequence).

    python benchmarks/bench_split.py [--quick] [--cases 0,2] [--no-cp] [--link-gbps 150]
"""

from __future__ import annotations

import os
import sys
from collections.abc import Callable
from typing import Any

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from benchmarks.bench_prefill import LOWER_BOUND, cudnn_call, flash_kda_call, graph_time_ms  # noqa: E402
from benchmarks.bench_prefill import make as make_prefill  # noqa: E402
from benchmarks.common import (  # noqa: E402
    add_cases_arg,
    chosen_cases,
    cuda_time_ms,
    fmt,
    import_cudnn_kda,
    import_flash_kda,
    parse_args,
    ratio,
    try_call,
    write_results,
)

CASES = [
    ("H=8 T=65536", 8, [65536], False),
    ("H=4 T=65536", 4, [65536], False),
    ("H=32 T=8192", 32, [8192], False),
    ("H=16 packed 8x2048", 16, [2048] * 8, False),
    ("H=8 T=65536 slow channel", 8, [65536], True),
    ("H=16 T=8192", 16, [8192], False),
    ("H=64 T=8192", 64, [8192], False),
]
SWEEP = [512, 1024, 2048, 4096, 8192]


def make(H: int, lens: list[int], slow: bool) -> dict[str, Any]:
    d = make_prefill(H, lens)
    if slow:
        d["dt_bias"][:, 0] = -30.0  # sigmoid(exp(A)(g - 30)) ~ 0: that channel barely decays
    d["cu_cpu"] = d["cu"].cpu()
    return d


def ours(kda_ops: Any, d: dict[str, Any], cu: torch.Tensor | None = None, cu_cpu: torch.Tensor | None = None,
         fixed: bool = False):  # type: ignore[no-untyped-def]  # fmt: skip
    cu = d["cu"] if cu is None else cu
    cu_cpu = d["cu_cpu"] if cu_cpu is None else cu_cpu
    state = d["state"] if cu is d["cu"] else torch.zeros(cu.numel() - 1, *d["state"].shape[1:], dtype=d["state"].dtype,
                                                         device=d["state"].device)  # fmt: skip

    def run() -> Any:
        return kda_ops.recurrent_kda(
            d["q"], d["k"], d["v"], d["g"], d["beta"],
            A_log=d["A_log"], dt_bias=d["dt_bias"], initial_state=state, cu_seqlens=None if fixed else cu,
            use_gate_in_kernel=True, lower_bound=LOWER_BOUND, beta_is_logit=True, output=d["out"],
            cu_seqlens_cpu=None if fixed else cu_cpu,
        )  # fmt: skip

    return run


def with_split(mode: str, tokens: int, fn: Callable[[], Any]) -> Callable[[], Any]:
    """fn with KDA_SEQUENCE_SPLIT=mode and KDA_SEQUENCE_SPLIT_TOKENS=tokens (the switches re-read around each call:
    a few microseconds of host time, hidden behind the millisecond-scale calls timed here)."""
    import os

    from kda_ops import _routing

    names = ("KDA_SEQUENCE_SPLIT", "KDA_SEQUENCE_SPLIT_TOKENS")

    def run() -> Any:
        old = [os.environ.get(n) for n in names]
        os.environ.update(zip(names, (mode, str(tokens)), strict=True))
        _routing.reload()
        try:
            return fn()
        finally:
            for n, v in zip(names, old, strict=True):
                if v is None:
                    os.environ.pop(n, None)
                else:
                    os.environ[n] = v
            _routing.reload()

    return run


def prefill_table(args: Any, kda_ops: Any) -> None:
    from kda_ops import _routing, _split

    cudnn_kda = None if args.no_peers else import_cudnn_kda()
    fkda = None if args.no_peers else import_flash_kda()
    cases = chosen_cases(CASES, args.cases)
    if args.quick:
        cases = cases[:3]
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    rows, records = [], []
    for name, H, lens, slow in cases:
        d = make(H, lens, slow)
        rec: dict[str, Any] = dict(case=name, H=H, lens=lens, slow=slow)
        base = ours(kda_ops, d)
        with torch.inference_mode():
            rec["unsplit eager"], err = try_call(lambda: cuda_time_ms(with_split("0", 0, base)))
            rec["unsplit graph"], err2 = try_call(lambda: graph_time_ms(with_split("0", 0, base)))
            for e in (err, err2):
                if e:
                    print(f"[unsplit] {name}: {e}", flush=True)
            ls_auto = _routing.plan_segments(lens, H, sms)
            rec["auto Ls"] = ls_auto
            rec["auto splits"] = with_split("auto", 0, lambda: _routing.split_segment_tokens(
                lens, H, d["q"].device, training=False) > 0)()  # fmt: skip
            rec["split auto-plan"], err = try_call(lambda: cuda_time_ms(with_split("1", 0, base)))
            if err:
                print(f"[split] {name}: {err}", flush=True)
            rec["split graph"] = None
            if len(lens) == 1:  # the fixed layout, which splits under capture
                fixed = ours(kda_ops, d, fixed=True)
                rec["split graph"], err = try_call(lambda: graph_time_ms(with_split("1", 0, fixed)))
                if err:
                    print(f"[split graph] {name}: {err}", flush=True)
            best = None
            for Ls in [x for x in SWEEP if x < max(lens)] + ([ls_auto] if ls_auto not in SWEEP else []):
                t, err = try_call(lambda Ls=Ls: cuda_time_ms(with_split("1", Ls, base)))
                rec[f"split Ls={Ls}"] = t
                if err:
                    print(f"[split Ls={Ls}] {name}: {err}", flush=True)
                if t is not None and (best is None or t < best[0]):
                    best = (t, Ls)
            rec["split best"], rec["best Ls"] = (None, None) if best is None else best
            # one pass: the segments of the automatic plan as independent sequences
            pl = _split._Plan(lens, ls_auto)
            cu_seg = torch.tensor(pl.cu, dtype=torch.int64)
            one = ours(kda_ops, d, cu_seg.to(d["q"].device), cu_seg)
            rec["one pass"], err = try_call(lambda: cuda_time_ms(with_split("0", 0, one)))
            if err:
                print(f"[one pass] {name}: {err}", flush=True)
            peers = {}
            if cudnn_kda is not None:
                peers["cudnn fp32"] = cudnn_call(cudnn_kda, d, native=True)
                peers["cudnn bf16"] = cudnn_call(cudnn_kda, d, native=False)
            if fkda is not None:
                peers["flash_kda"] = flash_kda_call(fkda, d)
            for who, fn in peers.items():  # eager, then a graph replay (as ours: bench_prefill's graph_time_ms)
                with torch.inference_mode():
                    rec[who], err = try_call(lambda fn=fn: cuda_time_ms(fn))
                    rec[who + " graph"], err2 = try_call(lambda fn=fn: graph_time_ms(fn))
                for e in (err, err2):
                    if e:
                        print(f"[{who}] {name}: {e}", flush=True)

            # exactness: split vs unsplit on these inputs, from the same start state
            def exactness() -> float:
                from kda_ops.reference import rel_rms

                d["state"].zero_()
                o_u = with_split("0", 0, base)()[0].clone()
                d["state"].zero_()
                o_s = with_split("1", rec["best Ls"] or 0, base)()[0].clone()
                return rel_rms(o_s, o_u)

            rec["split vs unsplit rel rms"], err = try_call(exactness)
            if err:
                print(f"[exactness] {name}: {err}", flush=True)
        unsplit_best = min((x for x in (rec["unsplit eager"], rec["unsplit graph"]) if x is not None), default=None)
        records.append(rec)
        rows.append(
            [
                f"{name} ({'auto: split' if rec['auto splits'] else 'auto: unsplit'})",
                fmt(rec["unsplit eager"]),
                fmt(rec["unsplit graph"]),
                f"{fmt(rec['split auto-plan'])} (Ls={ls_auto})",
                fmt(rec["split graph"]) if len(lens) == 1 else "n/a (packed)",
                f"{fmt(rec['split best'])} (Ls={rec['best Ls']})",
                ratio(unsplit_best, rec["split best"]),
                fmt(rec["one pass"]),
                f"{fmt(rec.get('cudnn fp32'))} / {fmt(rec.get('cudnn fp32 graph'))}",
                f"{fmt(rec.get('cudnn bf16'))} / {fmt(rec.get('cudnn bf16 graph'))}",
                f"{fmt(rec.get('flash_kda'))} / {fmt(rec.get('flash_kda graph'))}",
                "n/a" if rec["split vs unsplit rel rms"] is None else f"{rec['split vs unsplit rel rms']:.1e}",
            ]
        )
        print(f"[case] {name}: {rec}", flush=True)
        d.clear()  # frees the tensors before the next case
        torch.cuda.empty_cache()
    header = [
        "case", "unsplit eager ms", "unsplit graph ms", "split auto-plan ms", "split graph ms",
        "split best ms",
        "unsplit / split", "one pass ms", "cudnn fp32 ms (eager / graph)", "cudnn bf16 ms (eager / graph)",
        "flash_kda ms (eager / graph)", "split vs unsplit",
    ]  # fmt: skip
    notes = [
        f"# exact sequence split, {torch.cuda.get_device_name()} ({sms} SMs), torch {torch.__version__}",
        "K=V=128, lower-bound gate -5, logit beta, L2 norm, bf16 tokens, bf16 pool, preallocated output",
        "ms = median of 10 CUDA-event timings; split timings are eager but 'split graph' (fixed layout, a replay);"
        " the peers eager / in a graph replay",
        "unsplit / split > 1: the split is faster; one pass = the plan's segments as independent sequences",
        "passes with outputs = the auto-plan split whose Q and P passes write outputs (not state-only calls)",
        f"cudnn importable: {cudnn_kda is not None}; flash_kda importable: {fkda is not None}",
    ]
    write_results(args.out, "bench_split", header, rows, records, notes)


def cp_table(args: Any, kda_ops: Any) -> None:
    """Modelled context-parallel training step of one H=8 T=65536 sequence over R ranks."""
    H, T, K = 8, 65536 if not args.quick else 16384, 128
    gbps, lat_us = args.link_gbps, args.link_latency_us
    times: dict[int, tuple[float | None, float | None]] = {}
    for R in (1, 2, 4, 8):
        L = T // R
        d = make_prefill(H, [L])
        A, dtb = d["A_log"], d["dt_bias"]
        h0 = torch.zeros(1, H, K, K, device=d["q"].device)
        do = torch.randn_like(d["v"])

        def fwd() -> Any:
            return kda_ops.recurrent_kda_training_forward(d["q"], d["k"], d["v"], d["g"], d["beta"], A, dtb, h0)

        tf, err = try_call(lambda: cuda_time_ms(fwd))
        if err:
            print(f"[cp fwd R={R}] {err}", flush=True)
        tb = None
        if tf is not None:
            _, _, ctx = fwd()
            tb, err = try_call(lambda: cuda_time_ms(lambda: kda_ops.recurrent_kda_training_backward(ctx, do, None)))
            if err:
                print(f"[cp bwd R={R}] {err}", flush=True)
        times[R] = (tf, tb)
        d.clear()  # frees the tensors before the next case
        torch.cuda.empty_cache()
    t1f, t1b = times[1]
    base = None if t1f is None or t1b is None else t1f + t1b
    fwd_bytes = H * (K * K + K * K) * 4  # P [HV, K, K] + Q [HV, V, K], fp32
    bwd_bytes = H * K * K * 4  # G [HV, V, K]
    rows, records = [], []
    for R in (2, 4, 8):
        tf, tb = times[R]
        comm_ms = 2 * lat_us * 1e-3 + R * (fwd_bytes + bwd_bytes) / (gbps * 1e9) * 1e3
        step = None
        if tf is not None and tb is not None:
            step = (3 if R >= 3 else 2) * tf + 2 * tb + comm_ms
        sp = None if step is None or base is None else base / step
        records.append(
            dict(R=R, tokens_per_rank=T // R, fwd_ms=tf, bwd_ms=tb, comm_ms=comm_ms, step_ms=step, speedup=sp)
        )
        rows.append(
            [
                str(R), str(T // R), fmt(tf), fmt(tb), f"{fwd_bytes / 2**20:.2f} / {bwd_bytes / 2**20:.2f}",
                fmt(comm_ms, 4), fmt(step), "n/a" if sp is None else f"{sp:.2f}x",
                "n/a" if sp is None else f"{100 * sp / R:.0f}%",
            ]
        )  # fmt: skip
    header = [
        "ranks", "tokens/rank", "fwd ms (T/R)", "bwd ms (T/R)", "MiB sent/rank fwd / bwd", "comm ms (model)",
        "step ms (model)", "speedup vs 1 GPU", "efficiency",
    ]  # fmt: skip
    notes = [
        f"# context parallelism, modelled from one GPU ({torch.cuda.get_device_name()}): training fwd+bwd, H={H}, "
        f"one sequence of T={T}, K=V=128",
        f"1 GPU, whole sequence: fwd {fmt(t1f)} ms + bwd {fmt(t1b)} ms",
        "step = (3 if R >= 3 else 2) * fwd(T/R) + 2 * bwd(T/R) + comm; comm = 2 latencies + R * bytes / bandwidth "
        f"(all_gather; assumed {gbps} GB/s, {lat_us} us per collective)",
        "the inner ranks' extra passes (P and Q forward, zero-gradient backward) set the critical path",
    ]
    write_results(args.out, "bench_split_cp", header, rows, records, notes)


def training_table(args: Any, kda_ops: Any) -> None:
    """kda_ops.kda forward + backward, split vs unsplit (eager autograd), one sequence, K = V = 128."""
    from kda_ops import _routing

    rows, records = [], []
    for name, H, T in (
        ("train H=8 T=65536", 8, 65536),
        ("train H=4 T=65536", 4, 65536),
        ("train H=32 T=8192", 32, 8192),
    ):
        if args.quick and T > 16384:
            T = 16384
        d = make_prefill(H, [T])
        leaves = [d[n].clone().requires_grad_(True) for n in ("q", "k", "v", "g", "beta")]
        A = d["A_log"].clone().requires_grad_(True)
        dtb = d["dt_bias"].clone().requires_grad_(True)
        do = torch.randn_like(d["v"])

        def step() -> Any:
            o, _ = kda_ops.kda(*leaves, A, dtb, None, lower_bound=LOWER_BOUND)
            o.backward(do)

        rec: dict[str, Any] = dict(case=name, H=H, T=T)
        for label, mode, tokens in (("unsplit", "0", 0), ("split auto-plan", "1", 0)):
            rec[label], err = try_call(lambda mode=mode, tokens=tokens: cuda_time_ms(with_split(mode, tokens, step)))
            if err:
                print(f"[{label}] {name}: {err}", flush=True)
        rec["auto Ls"] = _routing.plan_segments([T], H, torch.cuda.get_device_properties(0).multi_processor_count)
        records.append(rec)
        rows.append([name, fmt(rec["unsplit"]), f"{fmt(rec['split auto-plan'])} (Ls={rec['auto Ls']})",
                     ratio(rec["unsplit"], rec["split auto-plan"])])  # fmt: skip
        print(f"[case] {name}: {rec}", flush=True)
        d.clear()
        torch.cuda.empty_cache()
    header = ["case", "unsplit fwd+bwd ms", "split fwd+bwd ms", "unsplit / split"]
    notes = [
        f"# training forward + backward (kda_ops.kda, eager autograd), {torch.cuda.get_device_name()}",
        "K=V=128, lower-bound gate -5, logit beta, L2 norm, bf16 tokens, no initial state",
        "split: 3 forward passes (Q, P, outputs with tapes) + 2 backward passes (G, gradients) over segments",
    ]
    write_results(args.out, "bench_split_train", header, rows, records, notes)


def main() -> None:
    def extra(ap: Any) -> None:
        add_cases_arg(ap)
        ap.add_argument("--no-cp", action="store_true", help="skip the context-parallel table")
        ap.add_argument("--no-prefill", action="store_true", help="skip the prefill table")
        ap.add_argument("--no-train", action="store_true", help="skip the training split table")
        ap.add_argument("--link-gbps", type=float, default=150.0, help="assumed all_gather bandwidth per GPU")
        ap.add_argument("--link-latency-us", type=float, default=20.0, help="assumed latency per collective")

    args = parse_args("split", extra)
    import kda_ops

    if not args.no_prefill:
        prefill_table(args, kda_ops)
    if not args.no_train:
        training_table(args, kda_ops)
    if not args.no_cp:
        cp_table(args, kda_ops)


if __name__ == "__main__":
    main()
