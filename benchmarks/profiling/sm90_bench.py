"""Hopper chunked kernel (KDA_CHUNKED_KERNEL=sm90) vs the mma.sync kernel: ms per prefill call on a Hopper GPU
(K = V = 128, λ = -5 lower-bound gate, logit β, L2 norm, bf16 tokens and bf16 state pool, preallocated output;
median of 20 calls after 3 warm-up calls, CUDA events). Prints a markdown table (the variants of the Hopper
kernel, KDA_EXPERIMENT=sm90_variant=1..7 as SM90_BENCH_VARIANTS lists them, default 2,3, each optionally with a
schedule, e.g. 3s0 = variant 3 with sm90_schedule=0; the largest output/state difference of the last listed variant
from the first; SM90_BENCH_ROWS: a comma list of row indices) and whether the Hopper kernel ran (profiler) for each
case, then the profile instantiation's per-segment cycle table (sm90_profile=1) of CTA 0 at H=96 T=8192 for each
variant but 5-7 (on stderr). Needs an experiments build (KDA_BUILD_EXPERIMENTS=1); the
switches are re-read in-process (kda_ops._routing.reload).

    python3 benchmarks/profiling/sm90_bench.py
"""

from __future__ import annotations

import os
import statistics
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))  # repository root

import torch  # noqa: E402

import kda_ops  # noqa: E402

K = 128


def case(H, lengths):
    T = sum(lengths)
    g = torch.Generator(device="cuda").manual_seed(0)

    def r(*s):
        return torch.randn(*s, device="cuda", generator=g).bfloat16()

    x = dict(
        q=r(1, T, H, K),
        k=r(1, T, H, K),
        v=r(1, T, H, K),
        g=r(1, T, H, K),
        beta=r(1, T, H),
        A_log=torch.rand(H, device="cuda") * 0.5 + 0.1,
        dt_bias=torch.randn(H, K, device="cuda") * 0.1,
    )
    cu = torch.tensor([0] + [sum(lengths[: i + 1]) for i in range(len(lengths))], device="cuda")
    pool = (torch.randn(len(lengths), H, K, K, device="cuda") * 0.1).bfloat16()
    out = torch.empty_like(x["v"])
    return dict(
        **x,
        use_gate_in_kernel=True,
        lower_bound=-5.0,
        beta_is_logit=True,
        initial_state=pool,
        output=out,
        backend="chunked",
        cu_seqlens=cu if len(lengths) > 1 else None,
    )


def ran_sm90(kw):
    from torch.profiler import ProfilerActivity, profile

    os.environ["KDA_CHUNKED_KERNEL"] = "sm90"
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        kda_ops.recurrent_kda(**kw)
        torch.cuda.synchronize()
    return any("kda_chunked_sm90" in e.name for e in prof.events())


def set_kernel(kern, profile=False):
    """'mma', or 'sm90:V' / 'sm90:VsS' (the Hopper kernel's variant V with schedule S; without one, the default
    schedule), as KDA_CHUNKED_KERNEL and KDA_EXPERIMENT, re-read at once."""
    from kda_ops import _routing

    os.environ["KDA_CHUNKED_KERNEL"] = kern.split(":")[0]
    exp = []
    if ":" in kern:
        v, _, sched = kern.split(":")[1].partition("s")
        exp.append(f"sm90_variant={v}")
        if sched:
            exp.append(f"sm90_schedule={sched}")
    if profile:
        exp.append("sm90_profile=1")
    os.environ["KDA_EXPERIMENT"] = ",".join(exp)
    _routing.reload()


def call(kw):
    # the pool is updated in place: every call starts from the same bf16 state values anyway (timing only)
    return kda_ops.recurrent_kda(**kw)


def time_it(kw, kern, reps=20):
    set_kernel(kern)
    for _ in range(3):
        call(kw)
    torch.cuda.synchronize()
    ts = []
    for _ in range(reps):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        call(kw)
        b.record()
        b.synchronize()
        ts.append(a.elapsed_time(b))
    return statistics.median(ts)


def output_of(kw, kern):
    set_kernel(kern)
    pool0 = kw["initial_state"].clone()
    kw2 = dict(kw, initial_state=pool0, output=torch.empty_like(kw["output"]))
    call(kw2)
    torch.cuda.synchronize()
    return kw2["output"].float(), pool0.float()


def main():
    rows = [
        ("H=96 T=8192", 96, [8192]),
        ("H=64 T=8192", 64, [8192]),
        ("H=96 packed 8x1024", 96, [1024] * 8),
        ("H=96 packed [1300,547,2048,963,271,3063]", 96, [1300, 547, 2048, 963, 271, 3063]),
        ("H=32 T=8192", 32, [8192]),
        ("H=32 T=4096", 32, [4096]),
        ("H=16 T=8192", 16, [8192]),
        ("H=8 packed 8x2048", 8, [2048] * 8),
    ]
    os.environ["KDA_SEQUENCE_SPLIT"] = "0"  # (the kernel alone: no sequence split on the small grids)
    if os.environ.get("SM90_BENCH_ROWS"):  # a comma list of row indices
        rows = [rows[int(i)] for i in os.environ["SM90_BENCH_ROWS"].split(",")]
    variants = [v.strip() for v in os.environ.get("SM90_BENCH_VARIANTS", "2,3").split(",")]  # (a hung one left out)
    print(torch.cuda.get_device_name(), "torch", torch.__version__)
    cols = " | ".join(f"sm90 v{v} ms" for v in variants)
    va, vb = variants[0], variants[-1]
    print(f"| case | {cols} | mma ms | max|v{vb}-v{va}| out, state | sm90 ran |")
    print("|---|" + "---|" * len(variants) + "---|---|---|")
    for name, H, lengths in rows:
        kw = case(H, lengths)
        ran = ran_sm90(kw)
        tm = time_it(kw, "mma")
        t90 = [time_it(kw, f"sm90:{v}") if ran else float("nan") for v in variants]
        diff = "-"
        if ran and len(variants) >= 2:
            o0, s0 = output_of(kw, f"sm90:{va}")
            o1, s1 = output_of(kw, f"sm90:{vb}")
            diff = f"{(o1 - o0).abs().max().item():.1e}, {(s1 - s0).abs().max().item():.1e}"
        cols = " | ".join(f"{t:.3f}" for t in t90)
        print(f"| {name} | {cols} | {tm:.3f} | {diff} | {ran} |", flush=True)
    # segment clocks of CTA 0 (sm90_profile=1: the profile instantiation prints its table on stderr)
    kw = case(96, [8192])
    for v in variants:
        if v.startswith("5"):  # (design 5 has no profile instantiation)
            continue
        set_kernel(f"sm90:{v}")
        call(kw)  # warm
        torch.cuda.synchronize()
        set_kernel(f"sm90:{v}", profile=True)
        sys.stderr.flush()
        print(f"profile H=96 T=8192 variant {v}:", flush=True)
        call(kw)
        torch.cuda.synchronize()
        sys.stderr.flush()
    set_kernel("auto")
    return 0


if __name__ == "__main__":
    sys.exit(main())
