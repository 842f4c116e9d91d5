"""Which role bounds the chunked kernel? Times recurrent_kda(backend="chunked") with KDA_CHUNKED_DIAG
switches that skip one role's math (1 chain, 2 W solve, 4 G prep; results are garbage on purpose).

  python3 scripts/chunked_diag.py            # H=96 and H=32, T=8192, lower-bound gate, bf16 state
"""

import functools
import os

import torch

import kda_ops


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


def main():
    gen = torch.Generator(device="cuda").manual_seed(0)
    for H, T in ((96, 8192), (32, 8192)):
        r = lambda *s: torch.randn(*s, device="cuda", generator=gen, dtype=torch.bfloat16)  # noqa: E731
        q, k, v, g, beta = r(1, T, H, 128), r(1, T, H, 128), r(1, T, H, 128), r(1, T, H, 128), r(1, T, H)
        pool = torch.zeros(1, H, 128, 128, device="cuda", dtype=torch.bfloat16)
        A_log, dtb = torch.rand(H, device="cuda") * 0.5, torch.randn(H, 128, device="cuda") * 0.1
        out = torch.empty_like(v)

        run = functools.partial(kda_ops.recurrent_kda, q, k, v, g, beta, A_log=A_log, dt_bias=dtb,
                                initial_state=pool, output=out, use_gate_in_kernel=True, lower_bound=-5.0,
                                beta_is_logit=True, backend="chunked")

        row = []
        for diag in ("0", "1", "2", "4", "3", "5", "6", "7"):
            os.environ["KDA_CHUNKED_DIAG"] = diag
            row.append(f"diag{diag}={time_ms(run):.3f}")
        os.environ["KDA_CHUNKED_DIAG"] = "0"
        print(f"H={H} T={T} ms: " + " ".join(row), flush=True)


if __name__ == "__main__":
    main()
