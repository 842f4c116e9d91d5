"""Where does the exact sequence split's time go? (device diagnostic, not a test)

One split prefill call (kda_ops/_split.py, forced on, the automatic plan) at H heads x T tokens, the call
and inputs of benchmarks/bench_split.py (K = V = 128, bf16 pool), profiled with torch.profiler: the wall
time of an unprofiled call (host, to the end of its last kernel), the host time to enqueue one call (no
synchronize inside it: the split's Python plan and its op calls), the GPU time of every kernel of a
profiled one (the three chunked passes, the scan, copies) and the idle GPU time in between (host overhead
between launches), and the median of 20 CUDA-graph replays of the call (benchmarks/bench_prefill.py's
graph_time_ms; fixed layout: the split runs inside the graph). Two settings: the one-pass route and the three
passes (kda_ops._split.ONE_PASS; on CUDA the one-pass route runs only in a KDA_BUILD_EXPERIMENTS=1 build, elsewhere
both settings time the three passes), and in an experiments build each again with the three-pass route's end-state
passes on the Hopper kernel's instantiation with an output (KDA_EXPERIMENT=sm90_state_only=0).

  python3 benchmarks/profiling/split_profile.py [8,4] [65536]
"""

import os
import sys
import time

import torch
from torch.profiler import ProfilerActivity, profile

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))  # repository root
import kda_ops  # noqa: E402
from benchmarks.bench_prefill import graph_time_ms  # noqa: E402
from benchmarks.bench_split import make, ours  # noqa: E402  (the benchmark's inputs and call)
from kda_ops import _routing, _split  # noqa: E402


def main() -> None:
    heads = [int(h) for h in (sys.argv[1] if len(sys.argv) > 1 else "8,4").split(",")]
    T = int(sys.argv[2]) if len(sys.argv) > 2 else 65536
    os.environ["KDA_SEQUENCE_SPLIT"] = "1"
    _routing.reload()
    insts = ("1", "0") if _routing.knobs()["experiments_built"] else ("1",)
    for H in heads:
        call = ours(kda_ops, make(H, [T], False), fixed=True)  # (one sequence without cu_seqlens: split in graphs too)
        for inst, one_pass in [(i, o) for o in (True, False) for i in insts]:
            os.environ["KDA_EXPERIMENT"] = f"sm90_state_only={inst}" if _routing.knobs()["experiments_built"] else ""
            _routing.reload()
            _split.ONE_PASS = one_pass
            for _ in range(3):
                call()
            torch.cuda.synchronize()
            walls = []
            for _ in range(5):
                t0 = time.perf_counter()
                call()
                torch.cuda.synchronize()
                walls.append((time.perf_counter() - t0) * 1e3)
            enq = []  # host time to enqueue one call (no synchronize inside: the Python plan and the op calls)
            for _ in range(5):
                torch.cuda.synchronize()
                t0 = time.perf_counter()
                call()
                enq.append((time.perf_counter() - t0) * 1e3)
            torch.cuda.synchronize()
            graph_ms = graph_time_ms(call, rep=20)
            with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
                call()
                torch.cuda.synchronize()
            ev = [e for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA]
            ev.sort(key=lambda e: e.time_range.start)
            busy = sum(e.time_range.elapsed_us() for e in ev)
            span = (ev[-1].time_range.end - ev[0].time_range.start) if ev else 0
            print(
                f"\n## H={H} T={T} {'one pass' if one_pass else 'three passes'} sm90_state_only={inst}: "
                f"graph {graph_ms:.3f} ms, "
                f"wall {sorted(walls)[2]:.3f} ms (median of 5), "
                f"host enqueue {sorted(enq)[2]:.3f} ms (median of 5), "
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
            for e in ev:
                print(
                    f"  at {(e.time_range.start - ev[0].time_range.start) / 1e3:7.3f} ms: "
                    f"{e.time_range.elapsed_us() / 1e3:.4f} ms {e.name[:60]}"
                )


if __name__ == "__main__":
    main()
