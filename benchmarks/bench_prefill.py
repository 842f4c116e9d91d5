"""Prefill forward benchmark (SPEC §7, issue 4): kda_ops.recurrent_kda vs fla chunk_kda / flash_kda.

H200, K=V=128, lower-bound gate λ=-5, logit beta, L2 norm, bf16 inputs, bf16 state pool.
Ours: the "chunked" backend (the tensor-core kernel, the path of backend="auto" for prefill) and the
token-serial "recurrent" backend for comparison. TFLOP/s uses the chunked-form count of KERNEL_NOTES F0:
flops = tokens * HV * 106e3 (C=16 chain + prep; an estimate of useful work, not of instructions issued).
"""

from __future__ import annotations

import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from benchmarks.common import (  # noqa: E402
    bar_plot,
    cuda_time_ms,
    fmt,
    import_fla_kda,
    import_flash_kda,
    parse_args,
    ratio,
    try_call,
    write_results,
)

FLOPS_PER_TOKEN_HEAD = 106e3

CASES = [
    ("H=96 T=8192", 96, [8192]),
    ("H=96 packed 6 (8192)", 96, [1300, 547, 2048, 963, 271, 3063]),
    ("H=96 packed 8x1024", 96, [1024] * 8),
    ("H=64 T=8192", 64, [8192]),
    ("H=32 T=8192", 32, [8192]),
    ("H=8 T=65536", 8, [65536]),
    ("H=32 N=64 x 128", 32, [128] * 64),
]


def make(H: int, lens: list[int], dev: str = "cuda"):
    T = sum(lens)
    K = V = 128
    gen = torch.Generator(device=dev).manual_seed(0)
    r = lambda *s: torch.randn(*s, device=dev, generator=gen, dtype=torch.bfloat16)  # noqa: E731
    d = dict(q=r(1, T, H, K), k=r(1, T, H, K), v=r(1, T, H, V), g=r(1, T, H, K), beta=r(1, T, H))
    d["A_log"] = torch.rand(H, device=dev, generator=gen) * 0.5
    d["dt_bias"] = torch.randn(H, K, device=dev, generator=gen) * 0.1
    d["cu"] = torch.tensor([0] + list(torch.tensor(lens).cumsum(0).tolist()), device=dev, dtype=torch.int64)
    d["state"] = torch.zeros(len(lens), H, V, K, device=dev, dtype=torch.bfloat16)
    return d


def main() -> None:
    args = parse_args("prefill")
    import kda_ops

    fla = None if args.no_peers else import_fla_kda()
    fkda = None if args.no_peers else import_flash_kda()
    cases = CASES[:3] if args.quick else CASES
    rows, records = [], []
    for name, H, lens in cases:
        d = make(H, lens)
        T = sum(lens)
        ours = {}
        for backend in ("chunked", "recurrent"):

            def run(backend=backend):
                return kda_ops.recurrent_kda(
                    d["q"],
                    d["k"],
                    d["v"],
                    d["g"],
                    d["beta"],
                    A_log=d["A_log"],
                    dt_bias=d["dt_bias"],
                    initial_state=d["state"],
                    cu_seqlens=d["cu"],
                    use_gate_in_kernel=True,
                    lower_bound=-5.0,
                    beta_is_logit=True,
                    backend=backend,
                )

            ours[backend], err = try_call(lambda: cuda_time_ms(run, warmup=2, rep=5))
            if err:
                print(f"[ours/{backend}] {name}: {err}")
        t_fla = None
        if fla is not None:

            def run_fla():
                return fla.chunk_kda(
                    d["q"],
                    d["k"],
                    d["v"],
                    d["g"],
                    d["beta"],
                    A_log=d["A_log"],
                    dt_bias=d["dt_bias"].flatten(),
                    initial_state=d["state"].float(),
                    output_final_state=True,
                    use_qk_l2norm_in_kernel=True,
                    use_gate_in_kernel=True,
                    use_beta_sigmoid_in_kernel=True,
                    safe_gate=True,
                    lower_bound=-5.0,
                    state_v_first=True,
                    cu_seqlens=d["cu"],
                    cu_seqlens_cpu=d["cu"].cpu(),
                )

            with torch.inference_mode():
                t_fla, err = try_call(lambda: cuda_time_ms(run_fla, warmup=3, rep=10))
            if err:
                print(f"[fla] {name}: {err}")
        t_fk = None  # flash_kda: measured when importable (not shipped on the device image)
        best = ours["chunked"] if ours["chunked"] is not None else ours["recurrent"]
        tflops = None if best is None else T * H * FLOPS_PER_TOKEN_HEAD / (best * 1e-3) / 1e12
        rows.append(
            [
                name,
                fmt(ours["chunked"]),
                fmt(ours["recurrent"]),
                fmt(t_fla),
                fmt(t_fk),
                ratio(t_fla, best),
                fmt(tflops, 1),
            ]
        )
        records.append(
            dict(
                case=name,
                H=H,
                lens=lens,
                ours_chunked_ms=ours["chunked"],
                ours_recurrent_ms=ours["recurrent"],
                fla_ms=t_fla,
                flash_kda_ms=t_fk,
                tflops=tflops,
            )
        )
        d = {}
        torch.cuda.empty_cache()
    notes = [
        f"# prefill forward, {torch.cuda.get_device_name()}",
        "times in ms (median of CUDA-event timings); ratio = fla / ours (best of our backends)",
        "TFLOP/s = tokens * H * 106e3 / time (chunked-form useful work, KERNEL_NOTES F0)",
        f"flash_kda importable: {fkda is not None}",
    ]
    write_results(
        args.out,
        "bench_prefill",
        ["case", "ours chunked ms", "ours recurrent ms", "fla ms", "flash_kda ms", "fla/ours", "TFLOP/s"],
        rows,
        records,
        notes,
    )
    bar_plot(
        args.out,
        "bench_prefill",
        [r["case"] for r in records],
        {
            "ours chunked": [r["ours_chunked_ms"] for r in records],
            "ours recurrent": [r["ours_recurrent_ms"] for r in records],
            "fla": [r["fla_ms"] for r in records],
        },
        "ms (lower is better)",
    )


if __name__ == "__main__":
    main()
