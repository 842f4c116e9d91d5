"""Where does an end-to-end prefill call spend its time? (device diagnostic, not a test)

For recurrent_kda(backend="chunked") at H=96 T=8192 (and packed 6) prints: the benchmark's number (CUDA
events around one call, synchronised), the pipelined time per call (20 calls back to back), the host
time per call, and the CUDA kernels and host syncs of one call from torch.profiler.

  python3 benchmarks/profiling/api_profile.py
"""

import os
import sys
import time

import torch

import kda_ops

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))  # repository root
from benchmarks.common import cuda_time_ms  # noqa: E402


def case(H, lens):
    T = sum(lens)
    gen = torch.Generator(device="cuda").manual_seed(0)
    r = lambda *s: torch.randn(*s, device="cuda", generator=gen, dtype=torch.bfloat16)  # noqa: E731
    q, k, v, g, beta = r(1, T, H, 128), r(1, T, H, 128), r(1, T, H, 128), r(1, T, H, 128), r(1, T, H)
    cu = torch.tensor([0] + torch.tensor(lens).cumsum(0).tolist(), device="cuda", dtype=torch.int64)
    pool = torch.zeros(len(lens), H, 128, 128, device="cuda", dtype=torch.bfloat16)
    A_log, dtb = torch.rand(H, device="cuda") * 0.5, torch.randn(H, 128, device="cuda") * 0.1

    def run(output=None):
        return kda_ops.recurrent_kda(
            q,
            k,
            v,
            g,
            beta,
            A_log=A_log,
            dt_bias=dtb,
            initial_state=pool,
            cu_seqlens=cu,
            output=output,
            use_gate_in_kernel=True,
            lower_bound=-5.0,
            beta_is_logit=True,
            backend="chunked",
        )

    return run, torch.empty_like(v)


def main():
    for name, H, lens in (("H=96 T=8192", 96, [8192]), ("H=96 packed6", 96, [1300, 547, 2048, 963, 271, 3063])):
        run, out = case(H, lens)
        synced = cuda_time_ms(run, warmup=3, rep=10)  # the benchmarks' number: median of synchronised calls
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        for _ in range(20):
            run(out)
        b.record()
        b.synchronize()
        pipe = a.elapsed_time(b) / 20
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        for _ in range(20):
            run(out)
        host = (time.perf_counter() - t0) / 20 * 1e3
        torch.cuda.synchronize()
        print(f"{name}: synced-call median {synced:.3f} ms | pipelined {pipe:.3f} ms/call | host {host:.3f} ms/call")
        with torch.profiler.profile(
            activities=[torch.profiler.ProfilerActivity.CPU, torch.profiler.ProfilerActivity.CUDA]
        ) as prof:
            run()
            torch.cuda.synchronize()
        print(prof.key_averages().table(sort_by="self_cuda_time_total", row_limit=12, max_name_column_width=60))
        print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=12, max_name_column_width=60))


if __name__ == "__main__":
    main()
