"""Prefill forward benchmark: kda_ops.recurrent_kda beside cuDNN Frontend and FlashKDA, in one process.

K = V = 128, lower-bound gate λ = -5, logit beta, L2 norm, bf16 token tensors, bf16 state pool,
preallocated output. Every call is timed eagerly and as a CUDA-graph replay (capture after warm-up).
Ours gets the host copy of cu_seqlens (`cu_seqlens_cpu`, as a serving engine has it) for packed cases, and
a one-sequence case as the fixed layout (no cu_seqlens, as a user calls it), so its calls take the exact
sequence split where `KDA_SEQUENCE_SPLIT=auto` splits (long sequences on few heads): eager calls of either
layout and graph replays of either (the split plans on the device under capture).

Peers, when importable (neither peer's code is part of this repository):
- cuDNN Frontend (`cudnn.linear_attention.kimi_delta_attention`, packed [T, H, K] tensors, `cu_seqlens`,
  `safe_gate=True`): timed with its native fp32 g / beta / state ("cudnn fp32") and with our bf16
  inputs and bf16 state ("cudnn bf16").
- FlashKDA (`flash_kda.fwd`): bf16 inputs, bf16 state.
- fla `chunk_kda` (`--fla`; its Triton autotune takes minutes per shape in a fresh process).

TFLOP/s counts the useful work of the 16-token chunked form: tokens * HV * 106e3 flops
(3 state GEMMs of 2*16*128^2 and 2 of 2*16^2*128 per 16-token chunk, plus the intra-chunk products and
the inverse), divided by our best time. It is a measure of work done, not of instructions issued.

    python benchmarks/bench_prefill.py [--quick] [--cases 0,4] [--no-graph] [--fla]
"""

from __future__ import annotations

import os
import sys
from collections.abc import Callable
from typing import Any

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from benchmarks.common import (  # noqa: E402
    add_cases_arg,
    bar_plot,
    chosen_cases,
    cuda_time_ms,
    fmt,
    import_cudnn_kda,
    import_fla_kda,
    import_flash_kda,
    parse_args,
    ratio,
    try_call,
    write_results,
)

FLOPS_PER_TOKEN_HEAD = 106e3
LOWER_BOUND = -5.0

CASES = [
    ("H=96 T=8192", 96, [8192]),
    ("H=96 packed 6 (8192)", 96, [1300, 547, 2048, 963, 271, 3063]),
    ("H=96 packed 8x1024", 96, [1024] * 8),
    ("H=64 T=8192", 64, [8192]),
    ("H=32 T=8192", 32, [8192]),
    ("H=8 T=65536", 8, [65536]),
    ("H=32 N=64 x 128", 32, [128] * 64),
]


def make(H: int, lens: list[int], dev: str = "cuda") -> dict[str, Any]:
    T = sum(lens)
    K = V = 128
    gen = torch.Generator(device=dev).manual_seed(0)
    r = lambda *s: torch.randn(*s, device=dev, generator=gen, dtype=torch.bfloat16)  # noqa: E731
    d: dict[str, Any] = dict(q=r(1, T, H, K), k=r(1, T, H, K), v=r(1, T, H, V), g=r(1, T, H, K), beta=r(1, T, H))
    d["A_log"] = torch.rand(H, device=dev, generator=gen) * 0.5
    d["dt_bias"] = torch.randn(H, K, device=dev, generator=gen) * 0.1
    d["cu_cpu"] = torch.tensor([0] + list(torch.tensor(lens).cumsum(0).tolist()), dtype=torch.int64)
    d["cu"] = d["cu_cpu"].to(dev)
    d["state"] = torch.zeros(len(lens), H, V, K, device=dev, dtype=torch.bfloat16)
    d["out"] = torch.empty_like(d["v"])
    return d


def graph_time_ms(fn: Callable[[], Any], rep: int = 10) -> float:
    """Median time of one replay of a CUDA graph holding one fn() call (captured after warm-up)."""
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        for _ in range(2):
            fn()
    torch.cuda.current_stream().wait_stream(s)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fn()
    return cuda_time_ms(graph.replay, warmup=2, rep=rep)


def ours_call(kda_ops: Any, d: dict[str, Any], backend: str) -> Callable[[], Any]:
    one = d["cu_cpu"].numel() == 2  # one sequence: the fixed layout [1, T]
    cu, cu_cpu = (None, None) if one else (d["cu"], d["cu_cpu"])

    def run() -> Any:
        return kda_ops.recurrent_kda(
            d["q"], d["k"], d["v"], d["g"], d["beta"],
            A_log=d["A_log"], dt_bias=d["dt_bias"], initial_state=d["state"], cu_seqlens=cu,
            cu_seqlens_cpu=cu_cpu, use_gate_in_kernel=True, lower_bound=LOWER_BOUND, beta_is_logit=True,
            output=d["out"],
            prefill_workspace=d.get("workspace"), backend=backend,
        )  # fmt: skip

    return run


def with_kernel(kernel: str, fn: Callable[[], Any]) -> Callable[[], Any]:
    """fn with the chunked kernel chosen per call: ``mma``, ``mma64``, ``mma128``, ``mma_small``, ``sm90``, ``auto``
    (KDA_CHUNKED_KERNEL), and in an experiments build ``sm90:V`` / ``auto:V`` (KDA_EXPERIMENT=sm90_variant=V),
    ``sm90:VsS`` (and sm90_schedule=S). The switches are re-read around each call (kda_ops._routing.reload), so
    a graph captures the kernel chosen while it is captured; the previous values are restored after each call."""
    from kda_ops import _routing

    name, _, spec = kernel.partition(":")
    variant, _, schedule = spec.partition("s")
    schedules = [str(i) for i in range(16)]
    if (variant and variant not in "123") or (schedule and schedule not in schedules) or len(variant) > 1:
        raise ValueError(f"--kernels: {kernel!r} is not mma, sm90:V, auto:V or sm90:VsS (V 1-3, S 0-15)")
    exp = ",".join(f"{k}={v}" for k, v in (("sm90_variant", variant), ("sm90_schedule", schedule)) if v)
    want = {"KDA_CHUNKED_KERNEL": name, "KDA_EXPERIMENT": exp or None}

    def put(values: dict[str, str | None]) -> None:
        for k, v in values.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v
        _routing.reload()

    def run() -> Any:
        old = {k: os.environ.get(k) for k in want}
        try:
            put(want)
            return fn()
        finally:
            put(old)

    return run


def cudnn_call(cudnn_kda: Any, d: dict[str, Any], native: bool) -> Callable[[], Any]:
    """cuDNN's KDA on the same data: packed [T, H, K]; fp32 g/beta/state when `native`, else ours (bf16)."""
    q, k, v = d["q"][0], d["k"][0], d["v"][0]
    g = d["g"][0].float() if native else d["g"][0]
    beta = d["beta"][0].float() if native else d["beta"][0]
    state = d["state"].float() if native else d["state"]
    cu = d["cu"].to(torch.int32)

    def run() -> Any:
        return cudnn_kda(
            q, k, v, g, beta, cu, initial_state=state, output_final_state=True,
            use_qk_l2norm_in_kernel=True, use_beta_sigmoid_in_kernel=True, safe_gate=True,
            gate_lower_bound=LOWER_BOUND, a_log=d["A_log"], dt_bias=d["dt_bias"],
        )  # fmt: skip

    return run


def flash_kda_call(fkda: Any, d: dict[str, Any]) -> Callable[[], Any]:
    final = torch.empty_like(d["state"])
    scale = d["q"].shape[-1] ** -0.5

    def run() -> Any:
        return fkda.fwd(
            d["q"], d["k"], d["v"], d["g"], d["beta"], scale, d["out"], d["A_log"], d["dt_bias"], LOWER_BOUND,
            initial_state=d["state"], final_state=final, cu_seqlens=d["cu"],
        )  # fmt: skip

    return run


def fla_call(fla: Any, d: dict[str, Any]) -> Callable[[], Any]:
    single = d["cu"].numel() == 2  # one sequence: fla's fixed-length path (much faster than its varlen path)
    state = d["state"].float()

    def run() -> Any:
        return fla.chunk_kda(
            d["q"], d["k"], d["v"], d["g"], d["beta"], A_log=d["A_log"], dt_bias=d["dt_bias"].flatten(),
            initial_state=state, output_final_state=True, use_qk_l2norm_in_kernel=True, use_gate_in_kernel=True,
            use_beta_sigmoid_in_kernel=True, safe_gate=True, lower_bound=LOWER_BOUND, state_v_first=True,
            cu_seqlens=None if single else d["cu"], cu_seqlens_cpu=None if single else d["cu"].cpu(),
        )  # fmt: skip

    return run


def main() -> None:
    def extra(ap: Any) -> None:
        add_cases_arg(ap)
        ap.add_argument("--no-graph", action="store_true", help="eager timings only")
        ap.add_argument("--fla", action="store_true", help="also time fla chunk_kda (slow autotune)")
        ap.add_argument("--backends", default="chunked,recurrent", help="our backends to time")
        ap.add_argument(
            "--kernels",
            default="",
            help="also time the chunked backend with these kernels, e.g. mma,sm90 (KDA_CHUNKED_KERNEL per call;"
            " sm90:2, sm90:3s0 in an experiments build: KDA_EXPERIMENT)",
        )

    args = parse_args("prefill", extra)
    import kda_ops

    cudnn_kda = None if args.no_peers else import_cudnn_kda()
    fkda = None if args.no_peers else import_flash_kda()
    fla = import_fla_kda() if args.fla and not args.no_peers else None
    cases = chosen_cases(CASES, args.cases, CASES[:3] if args.quick else CASES)
    backends = [b for b in args.backends.split(",") if b]
    modes = ["eager"] if args.no_graph else ["eager", "graph"]
    rows, records = [], []
    for name, H, lens in cases:
        d = make(H, lens)
        d["workspace"] = kda_ops.RecurrentKDAPrefillWorkspace(device=d["q"].device)
        T = sum(lens)
        calls: dict[str, Callable[[], Any]] = {f"ours {b}": ours_call(kda_ops, d, b) for b in backends}
        for kern in [x for x in args.kernels.split(",") if x]:
            calls[f"ours chunked[{kern}]"] = with_kernel(kern, ours_call(kda_ops, d, "chunked"))
        if cudnn_kda is not None:
            calls["cudnn fp32"] = cudnn_call(cudnn_kda, d, native=True)
            calls["cudnn bf16"] = cudnn_call(cudnn_kda, d, native=False)
        if fkda is not None:
            calls["flash_kda"] = flash_kda_call(fkda, d)
        if fla is not None:
            calls["fla"] = fla_call(fla, d)
        rec: dict[str, Any] = dict(case=name, H=H, lens=lens)
        for who, fn in calls.items():
            for mode in modes:
                timer = (
                    (lambda fn=fn: cuda_time_ms(fn, warmup=3, rep=10))
                    if mode == "eager"
                    else (lambda fn=fn: graph_time_ms(fn))
                )
                with torch.inference_mode():
                    t, err = try_call(timer)
                if err:
                    print(f"[{who} {mode}] {name}: {err}", flush=True)
                rec[f"{who} {mode}"] = t
        ours_best = min(  # (every column of ours: the backends and the --kernels choices)
            (v for key, v in rec.items() if v is not None and key.startswith("ours ") and key.endswith(tuple(modes))),
            default=None,
        )
        rec["tflops"] = None if ours_best is None else T * H * FLOPS_PER_TOKEN_HEAD / (ours_best * 1e-3) / 1e12
        peer_best = min(
            (v for key, v in rec.items() if v is not None and key.split(" ")[0] in ("cudnn", "flash_kda", "fla")),
            default=None,
        )
        records.append(rec)
        rows.append(
            [name]
            + [fmt(rec.get(f"{who} {m}")) for who in calls for m in modes]
            + [ratio(peer_best, ours_best), fmt(rec["tflops"], 1)]
        )
        print(f"[case] {name}: " + ", ".join(f"{key}={fmt(v)}" for key, v in rec.items() if key.endswith(tuple(modes))),
              flush=True)  # fmt: skip
        del d
        torch.cuda.empty_cache()
    header = ["case"] + [f"{who} {m} ms" for who in calls for m in modes] + ["best peer / ours", "TFLOP/s"]
    notes = [
        f"# prefill forward, {torch.cuda.get_device_name()}, torch {torch.__version__}",
        "K=V=128, lower-bound gate -5, logit beta, L2 norm, bf16 tokens, bf16 pool, preallocated output",
        "ms = median of 10 CUDA-event timings (eager) or of 10 graph replays (graph)",
        "best peer / ours > 1: ours is faster; TFLOP/s = tokens * H * 106e3 / our best time",
        f"cudnn importable: {cudnn_kda is not None}; flash_kda importable: {fkda is not None}; "
        f"fla timed: {fla is not None}; KDA_CHUNKED_KERNEL={os.environ.get('KDA_CHUNKED_KERNEL', '(default)')}",
    ]
    write_results(args.out, "bench_prefill", header, rows, records, notes)
    bar_plot(
        args.out,
        "bench_prefill",
        [r["case"] for r in records],
        {key: [r.get(key) for r in records] for key in [f"{who} {modes[-1]}" for who in calls]},
        "ms (lower is better)",
    )


if __name__ == "__main__":
    main()
