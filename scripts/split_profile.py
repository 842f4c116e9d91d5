"""Where does the exact sequence split's time go? (device diagnostic, not a test)

One split prefill call (kda_ops/_split.py, forced on, the automatic plan) at H heads x T tokens (K = V = 128,
bf16 pool), profiled with torch.profiler: the wall time of the call (host, to the end of its last kernel),
the GPU time of every kernel (the three chunked passes, the scan's baddbmm, copies), and the idle GPU time
in between (host overhead between launches). Also the same call with KDA_SEQUENCE_SPLIT_STATE_ONLY's two
settings.

  python3 scripts/split_profile.py [8,4] [65536]
"""

import sys
import time

import torch
from torch.profiler import ProfilerActivity, profile

import kda_ops
from kda_ops import _split


def inputs(H: int, T: int) -> tuple:
    gen = torch.Generator(device="cuda").manual_seed(0)
    r = lambda *s: torch.randn(*s, device="cuda", generator=gen, dtype=torch.bfloat16)  # noqa: E731
    q, k, v, g, beta = r(1, T, H, 128), r(1, T, H, 128), r(1, T, H, 128), r(1, T, H, 128), r(1, T, H)
    A_log = torch.rand(H, device="cuda") * 0.5
    dtb = torch.randn(H, 128, device="cuda") * 0.1
    pool = torch.zeros(1, H, 128, 128, device="cuda", dtype=torch.bfloat16)
    out = torch.empty_like(v)
    return (q, k, v, g, beta), dict(
        A_log=A_log,
        dt_bias=dtb,
        initial_state=pool,
        output=out,
        use_gate_in_kernel=True,
        lower_bound=-5.0,
        beta_is_logit=True,
    )


def main() -> None:
    heads = [int(h) for h in (sys.argv[1] if len(sys.argv) > 1 else "8,4").split(",")]
    T = int(sys.argv[2]) if len(sys.argv) > 2 else 65536
    _split.MODE = "1"
    for H in heads:
        tok, kw = inputs(H, T)
        for so in (True, False):
            _split.STATE_ONLY = so
            for _ in range(3):
                kda_ops.recurrent_kda(*tok, **kw)
            torch.cuda.synchronize()
            walls = []
            for _ in range(5):
                t0 = time.perf_counter()
                kda_ops.recurrent_kda(*tok, **kw)
                torch.cuda.synchronize()
                walls.append((time.perf_counter() - t0) * 1e3)
            with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
                kda_ops.recurrent_kda(*tok, **kw)
                torch.cuda.synchronize()
            ev = [e for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA]
            ev.sort(key=lambda e: e.time_range.start)
            busy = sum(e.time_range.elapsed_us() for e in ev)
            span = (ev[-1].time_range.end - ev[0].time_range.start) if ev else 0
            print(
                f"\n## H={H} T={T} state_only={so}: wall {sorted(walls)[2]:.3f} ms (median of 5), "
                f"GPU span {span / 1e3:.3f} ms, kernels {busy / 1e3:.3f} ms, idle {(span - busy) / 1e3:.3f} ms, "
                f"{len(ev)} kernels"
            )
            agg: dict = {}
            for e in ev:
                a = agg.setdefault(e.name[:70], [0, 0.0])
                a[0] += 1
                a[1] += e.time_range.elapsed_us()
            for name, (n, us) in sorted(agg.items(), key=lambda x: -x[1][1])[:10]:
                print(f"  {us / 1e3:8.3f} ms  {n:4d}x  {name}")
            big = [e for e in ev if e.time_range.elapsed_us() > 50]
            for e in big:
                print(
                    f"  at {(e.time_range.start - ev[0].time_range.start) / 1e3:7.3f} ms: "
                    f"{e.time_range.elapsed_us() / 1e3:.3f} ms {e.name[:50]}"
                )


if __name__ == "__main__":
    main()
