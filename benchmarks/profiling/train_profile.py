"""Where does the CUDA training backward spend its time? (device diagnostic, not a test)

For recurrent_kda_training_backward at the benchmark shapes (H=96 and H=32, T=8192) prints the CUDA kernels of
one call from torch.profiler (name, calls, total µs), so the backward chain, the chunk-parallel sweep and the finishing
kernels can be told apart.

  python3 benchmarks/profiling/train_profile.py [96,32]     (comma-separated head counts)
"""

import os
import sys

import torch
from torch.profiler import ProfilerActivity, profile

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))  # repository root

import kda_ops  # noqa: E402, F401  (registers torch.ops.kda)


def inputs(H, T):
    gen = torch.Generator(device="cuda").manual_seed(0)
    r = lambda *s: torch.randn(*s, device="cuda", generator=gen, dtype=torch.bfloat16)  # noqa: E731
    q, k, v, g, beta, do = (
        r(1, T, H, 128),
        r(1, T, H, 128),
        r(1, T, H, 128),
        r(1, T, H, 128),
        r(1, T, H),
        r(1, T, H, 128),
    )
    A_log = torch.rand(H, device="cuda") * 0.5
    dtb = torch.randn(H, 128, device="cuda") * 0.1
    init = torch.zeros(1, H, 128, 128, device="cuda")
    return (q, k, v, g, beta, A_log, dtb), init, do


def main():
    heads = [int(h) for h in (sys.argv[1] if len(sys.argv) > 1 else "96,32").split(",")]
    for H in heads:
        T = 8192
        args, init, do = inputs(H, T)
        sc, lam = 128**-0.5, -5.0
        _, _, tapes, tcs = torch.ops.kda.recurrent_kda_training_forward(*args, init, None, sc, lam)
        bwd_args = (*args, tapes, tcs, init, None, do, None, sc, lam)
        for _ in range(2):
            torch.ops.kda.recurrent_kda_training_backward(*bwd_args)
        torch.cuda.synchronize()
        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            torch.ops.kda.recurrent_kda_training_backward(*bwd_args)
            torch.cuda.synchronize()
        print(f"## training backward H={H} T={T}: CUDA kernels of one call")
        rows = {}
        for e in prof.events():
            if e.device_type == torch.autograd.DeviceType.CUDA:
                n, t = rows.get(e.name, (0, 0.0))
                rows[e.name] = (n + 1, t + e.device_time)
        for name, (n, t) in sorted(rows.items(), key=lambda x: -x[1][1]):
            print(f"{t:10.1f} us  x{n:<3d} {name[:110]}")


if __name__ == "__main__":
    main()
