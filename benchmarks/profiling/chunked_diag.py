"""Which role bounds the mma.sync chunked kernel? Times recurrent_kda(backend="chunked") with
KDA_EXPERIMENT=chunked_diag masks (an experiments build: KDA_BUILD_EXPERIMENTS=1) that skip one role's math
(1 chain, 2 W solve, 4 G prep; results are garbage on purpose).

  python3 benchmarks/profiling/chunked_diag.py            # H=96 and H=32, T=8192, lower-bound gate, bf16 state

The switches are read once per process, so every value runs in its own child process.
"""

import functools
import os
import subprocess
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))  # repository root

import kda_ops  # noqa: E402


def time_ms(fn, rep=10):
    for _ in range(2):
        fn()
    torch.cuda.synchronize()
    ev = [torch.cuda.Event(enable_timing=True) for _ in range(2)]
    ev[0].record()
    for _ in range(rep):
        fn()
    ev[1].record()
    torch.cuda.synchronize()
    return ev[0].elapsed_time(ev[1]) / rep


def run_one(H, T):
    gen = torch.Generator(device="cuda").manual_seed(0)
    r = lambda *s: torch.randn(*s, device="cuda", generator=gen, dtype=torch.bfloat16)  # noqa: E731
    q, k, v, g, beta = r(1, T, H, 128), r(1, T, H, 128), r(1, T, H, 128), r(1, T, H, 128), r(1, T, H)
    pool = torch.zeros(1, H, 128, 128, device="cuda", dtype=torch.bfloat16)
    A_log, dtb = torch.rand(H, device="cuda") * 0.5, torch.randn(H, 128, device="cuda") * 0.1
    out = torch.empty_like(v)
    run = functools.partial(
        kda_ops.recurrent_kda,
        q,
        k,
        v,
        g,
        beta,
        A_log=A_log,
        dt_bias=dtb,
        initial_state=pool,
        output=out,
        use_gate_in_kernel=True,
        lower_bound=-5.0,
        beta_is_logit=True,
        backend="chunked",
    )
    return time_ms(run)


def main():
    if len(sys.argv) == 3:  # child: one (H, T) at the chunked_diag of its environment
        print(f"{run_one(int(sys.argv[1]), int(sys.argv[2])):.3f}", flush=True)
        return
    for H, T in ((96, 8192), (32, 8192)):
        row = []
        for diag in ("0", "1", "2", "4", "3", "5", "6", "7"):
            env = dict(os.environ, KDA_CHUNKED_KERNEL="mma", KDA_EXPERIMENT=f"chunked_diag={diag}")
            ms = (
                subprocess.run(
                    [sys.executable, __file__, str(H), str(T)], env=env, capture_output=True, text=True, check=True
                )
                .stdout.strip()
                .splitlines()[-1]
            )
            row.append(f"diag{diag}={ms}")
        print(f"H={H} T={T} ms: " + " ".join(row), flush=True)


if __name__ == "__main__":
    main()
