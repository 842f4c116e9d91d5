"""Hopper chunked kernel (KDA_CHUNKED_KERNEL=sm90) vs the mma.sync kernel: ms per prefill call on the GPU machine
(K = V = 128, λ = -5 lower-bound gate, logit β, L2 norm, bf16 tokens and bf16 state pool, preallocated output;
median of 20 calls after 3 warm-up calls, CUDA events). Prints a markdown table and whether the Hopper kernel
ran (profiler) for each case; a case the Hopper kernel does not take is marked, not timed twice.

    python3 scripts/sm90_bench.py
"""

from __future__ import annotations

import os
import statistics
import sys

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

import torch  # noqa: E402

import kda_ops  # noqa: E402

K = 128


def case(H, lengths):
    T = sum(lengths)
    g = torch.Generator(device="cuda").manual_seed(0)

    def r(*s):
        return torch.randn(*s, device="cuda", generator=g).bfloat16()

    x = dict(q=r(1, T, H, K), k=r(1, T, H, K), v=r(1, T, H, K), g=r(1, T, H, K), beta=r(1, T, H),
             A_log=torch.rand(H, device="cuda") * 0.5 + 0.1, dt_bias=torch.randn(H, K, device="cuda") * 0.1)
    cu = torch.tensor([0] + [sum(lengths[: i + 1]) for i in range(len(lengths))], device="cuda")
    pool = (torch.randn(len(lengths), H, K, K, device="cuda") * 0.1).bfloat16()
    out = torch.empty_like(x["v"])
    return dict(**x, use_gate_in_kernel=True, lower_bound=-5.0, beta_is_logit=True, initial_state=pool, output=out,
                backend="chunked", cu_seqlens=cu if len(lengths) > 1 else None)


def ran_sm90(kw):
    from torch.profiler import ProfilerActivity, profile

    os.environ["KDA_CHUNKED_KERNEL"] = "sm90"
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        kda_ops.recurrent_kda(**kw)
        torch.cuda.synchronize()
    return any("kda_chunked_sm90" in e.name for e in prof.events())


def time_it(kw, kern, reps=20):
    os.environ["KDA_CHUNKED_KERNEL"] = kern
    for _ in range(3):
        kda_ops.recurrent_kda(**kw)
    torch.cuda.synchronize()
    ts = []
    for _ in range(reps):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        kda_ops.recurrent_kda(**kw)
        b.record()
        b.synchronize()
        ts.append(a.elapsed_time(b))
    return statistics.median(ts)


def main():
    rows = [("H=96 T=8192", 96, [8192]), ("H=64 T=8192", 64, [8192]), ("H=96 packed 8x1024", 96, [1024] * 8),
            ("H=32 T=8192", 32, [8192])]
    print(torch.cuda.get_device_name(), "torch", torch.__version__)
    print("| case | sm90 ms | mma ms | mma/sm90 | sm90 ran |")
    print("|---|---|---|---|---|")
    for name, H, lengths in rows:
        kw = case(H, lengths)
        ran = ran_sm90(kw)
        tm = time_it(kw, "mma")
        t90 = time_it(kw, "sm90") if ran else float("nan")
        print(f"| {name} | {t90:.3f} | {tm:.3f} | {tm / t90:.2f} | {ran} |", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
