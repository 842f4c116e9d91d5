"""One kda() training step (forward, then forward + backward) timed on one GPU, for an A/B of two checkouts.

    KDA_SEQUENCE_SPLIT=auto python benchmarks/profiling/kda_split_step.py <checkout> <H> <T>

Imports kda_ops from <checkout> (built in place), K = V = 128, bf16, the default mode (lower-bound gate λ = -5,
L2 norm, logit β), one sequence of T tokens, no initial state; prints the median of 10 CUDA-event timings after
3 warm-ups, in ms. Run it once per checkout and per KDA_SEQUENCE_SPLIT value (the switch is read at import).
"""

from __future__ import annotations

import os
import sys

import torch


def main() -> None:
    root, H, T = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
    # this checkout's timing helper (benchmarks/common.py), then the measured checkout's kda_ops
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
    from benchmarks.common import cuda_time_ms

    sys.path.insert(0, root)
    import kda_ops
    from kda_ops.reference import make_inputs

    x = make_inputs(B=1, T=T, H=H, HV=H, K=128, V=128, dtype=torch.bfloat16, device="cuda", seed=0)
    leaves = [x[n].detach().clone().requires_grad_() for n in ("q", "k", "v", "g", "beta")]
    A = x["A_log"].detach().clone().requires_grad_()
    dtb = x["dt_bias"].detach().clone().requires_grad_()
    do = torch.randn_like(x["v"])

    def fwd() -> torch.Tensor:
        return kda_ops.kda(*leaves, A, dtb, None, lower_bound=-5.0)[0]

    def step() -> None:
        fwd().backward(do)

    with torch.no_grad():
        f = cuda_time_ms(fwd)
    s = cuda_time_ms(step)
    split = os.environ.get("KDA_SEQUENCE_SPLIT", "auto")
    print(f"{root} split={split} H={H} T={T}: fwd {f:.3f} ms, fwd+bwd {s:.3f} ms", flush=True)


if __name__ == "__main__":
    main()
