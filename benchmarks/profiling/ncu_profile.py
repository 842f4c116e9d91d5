"""Workloads for Nsight Compute: the hot kernels at the benchmark shapes (cases decode_bf16 | decode_fp32 |
decode<B>_<dtype> | prefill_<H>_<T> | train_<H>_<T>). Each case warms up first: skip those launches.

  ncu --kernel-name regex:kda_recurrent --launch-skip 3 --launch-count 1 --section SpeedOfLight \
      --section MemoryWorkloadAnalysis --section Occupancy python3 benchmarks/profiling/ncu_profile.py decode_bf16
  ncu --kernel-name regex:kda_chunked --launch-skip 2 --launch-count 1 --set full --import-source yes \
      -o /tmp/chunked python3 benchmarks/profiling/ncu_profile.py prefill_96_8192
  ncu -i /tmp/chunked.ncu-rep --page source --csv --print-source cuda,sass > chunked_source.csv
  (training: --kernel-name regex:kda_training_backward_chunked --launch-skip 1 ... train_32_2048)
"""

import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))  # repository root

import kda_ops  # noqa: E402

case = sys.argv[1] if len(sys.argv) > 1 else "decode_bf16"
dev, H, K = "cuda", 32, 128
gen = torch.Generator(device=dev).manual_seed(0)
if case.startswith("prefill"):  # prefill_<H>_<T>: one sequence, bf16 state, the prefill benchmark's settings
    _, Hp, Tp = case.split("_") if case.count("_") == 2 else ("prefill", "96", "8192")
    Hp, Tp = int(Hp), int(Tp)
    r = lambda *s: torch.randn(*s, device=dev, generator=gen, dtype=torch.bfloat16)  # noqa: E731
    q, k, v, g, beta = r(1, Tp, Hp, K), r(1, Tp, Hp, K), r(1, Tp, Hp, K), r(1, Tp, Hp, K), r(1, Tp, Hp)
    pool = torch.zeros(1, Hp, K, K, device=dev, dtype=torch.bfloat16)
    A_log, dt_bias = torch.rand(Hp, device=dev) * 0.5, torch.randn(Hp, K, device=dev) * 0.1
    for _ in range(4):
        kda_ops.recurrent_kda(
            q,
            k,
            v,
            g,
            beta,
            A_log=A_log,
            dt_bias=dt_bias,
            initial_state=pool,
            use_gate_in_kernel=True,
            lower_bound=-5.0,
            beta_is_logit=True,
            backend="chunked",
        )
elif case.startswith("train"):  # train_<H>_<T>: kda_ops.kda forward + backward, one sequence
    _, Hp, Tp = case.split("_") if case.count("_") == 2 else ("train", "32", "2048")
    Hp, Tp = int(Hp), int(Tp)
    r = lambda *s: torch.randn(*s, device=dev, generator=gen, dtype=torch.bfloat16).requires_grad_()  # noqa: E731
    q, k, v, g, beta = r(1, Tp, Hp, K), r(1, Tp, Hp, K), r(1, Tp, Hp, K), r(1, Tp, Hp, K), r(1, Tp, Hp)
    A_log = (torch.rand(Hp, device=dev) * 0.5).requires_grad_()
    dt_bias = (torch.randn(Hp, K, device=dev) * 0.1).requires_grad_()
    h0 = torch.zeros(1, Hp, K, K, device=dev, requires_grad=True)
    do = torch.randn(1, Tp, Hp, K, device=dev, generator=gen, dtype=torch.bfloat16)
    for _ in range(3):
        o, _ = kda_ops.kda(q, k, v, g, beta, A_log, dt_bias, h0, lower_bound=-5.0)
        o.backward(do)
elif case.startswith("decode"):  # decode_bf16 | decode_fp32 (B = 256), decode<B>_<dtype> (e.g. decode1_bf16)
    B = int(case[len("decode") :].split("_")[0] or 256)
    dt = torch.bfloat16 if case.endswith("bf16") else torch.float32
    r = lambda *s: torch.randn(*s, device=dev, generator=gen, dtype=torch.bfloat16)  # noqa: E731
    q, k, v, g, beta = r(B, 1, H, K), r(B, 1, H, K), r(B, 1, H, K), r(B, 1, H, K), r(B, 1, H)
    pool = torch.zeros(B, H, K, K, device=dev, dtype=dt)
    A_log, dt_bias = torch.zeros(H, device=dev), torch.zeros(H, K, device=dev)
    for _ in range(5):
        kda_ops.recurrent_kda(
            q,
            k,
            v,
            g,
            beta,
            A_log=A_log,
            dt_bias=dt_bias,
            initial_state=pool,
            use_gate_in_kernel=True,
            lower_bound=-5.0,
            beta_is_logit=True,
        )
torch.cuda.synchronize()
