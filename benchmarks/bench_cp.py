"""Context parallelism measured: kda_ops.distributed.context_parallel_kda over R ranks of one host.

One sequence of T tokens (K = V = 128, lower-bound gate λ = -5, logit β, L2 norm; bf16 tokens on CUDA,
fp32 on CPU) split into R contiguous, even token ranges, one rank per GPU (NCCL), or R CPU processes
(gloo, for a dry run of the harness). Per (H, R): the forward alone (the training forward under
torch.no_grad: the context-parallel path has no separate prefill op) and forward + backward per step,
each the median over repetitions of the slowest rank's time (every repetition starts at a barrier), and
the bytes each rank contributes to the collectives (counted at kda_ops.distributed's all_gather: the
per-rank maps forward, the start-state gradients backward). Speedup and efficiency are against R = 1
(the same call on one rank). Writes bench_cp.md / .json and a PNG of the step times; the modelled table
(benchmarks/bench_split.py, "context parallelism, modelled from one GPU") is its one-GPU estimate.

    python3 benchmarks/bench_cp.py                              # ranks 1,2,4,8 as GPUs allow, H 8,32, T 131072
    python3 benchmarks/bench_cp.py --tokens 1048576 --heads 8   # a 1M-token sequence
    python3 benchmarks/bench_cp.py --device cpu --ranks 1,2 --heads 1 --tokens 512 --rep 1   (gloo dry run)
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from benchmarks.common import bar_plot, write_results  # noqa: E402

K = 128
LOWER_BOUND = -5.0


def _inputs(rank: int, offs: list[int], H: int, dev: torch.device, dtype: torch.dtype) -> dict[str, Any]:
    """This rank's tokens (its own seed: values do not matter for timing) and the replicated parameters
    (one seed on every rank: they must agree)."""
    L = offs[rank + 1] - offs[rank]
    gen = torch.Generator().manual_seed(1000 + rank)

    def rnd(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=gen).to(dtype).to(dev)

    d = dict(q=rnd(1, L, H, K), k=rnd(1, L, H, K), v=rnd(1, L, H, K), g=rnd(1, L, H, K), beta=rnd(1, L, H))
    d["do"] = rnd(1, L, H, K)
    shared = torch.Generator().manual_seed(7)
    d["A_log"] = (torch.rand(H, generator=shared) * 0.5).to(dev)
    d["dt_bias"] = (torch.randn(H, K, generator=shared) * 0.1).to(dev)
    return d


def _worker(rank: int, world: int, init_file: str, out_file: str, cfg: dict[str, Any]) -> None:
    cuda = cfg["device"] == "cuda"
    if cuda:
        torch.cuda.set_device(rank)
        dev = torch.device("cuda", rank)
    else:
        torch.set_num_threads(1)
        dev = torch.device("cpu")
    dist.init_process_group("nccl" if cuda else "gloo", init_method=f"file://{init_file}", rank=rank, world_size=world)
    import kda_ops.distributed as kd

    sent = [0]
    gather = kd._all_gather

    def counting_gather(x: torch.Tensor, group: Any, comm: torch.device) -> list[torch.Tensor]:
        sent[0] += x.numel() * x.element_size()
        return gather(x, group, comm)

    kd._all_gather = counting_gather
    T, H = cfg["tokens"], cfg["H"]
    offs = [T * r // world for r in range(world + 1)]
    d = _inputs(rank, offs, H, dev, torch.bfloat16 if cuda else torch.float32)
    leaves = [d[n].requires_grad_(True) for n in ("q", "k", "v", "g", "beta")]

    def call() -> torch.Tensor:
        o, _ = kd.context_parallel_kda(
            *leaves, d["A_log"], d["dt_bias"], None, cu_seqlens=[0, T], token_offsets=offs, lower_bound=LOWER_BOUND
        )
        return o

    def fwd() -> None:
        with torch.no_grad():
            call()

    def step() -> None:
        call().backward(d["do"])
        for x in leaves:
            x.grad = None

    def sync() -> None:
        if cuda:
            torch.cuda.synchronize(dev)

    def slowest_ms(fn: Any) -> float:
        for _ in range(cfg["warmup"]):
            fn()
        times = []
        for _ in range(cfg["rep"]):
            sync()
            dist.barrier()
            t0 = time.perf_counter()
            fn()
            sync()
            t = torch.tensor([(time.perf_counter() - t0) * 1e3], dtype=torch.float64, device=dev)
            dist.all_reduce(t, op=dist.ReduceOp.MAX)
            times.append(float(t.item()))
        return statistics.median(times)

    rec: dict[str, Any] = {"R": world, "H": H, "T": T, "tokens_per_rank": offs[1] - offs[0]}
    rec["fwd_ms"] = slowest_ms(fwd)
    rec["step_ms"] = slowest_ms(step)
    sent[0] = 0
    fwd()
    rec["fwd_bytes"] = sent[0]
    sent[0] = 0
    step()
    rec["step_bytes"] = sent[0]
    sync()
    if rank == 0:
        with open(out_file, "w") as f:
            json.dump(rec, f)
    dist.barrier()
    dist.destroy_process_group()


def run_case(world: int, H: int, cfg: dict[str, Any]) -> dict[str, Any]:
    with tempfile.TemporaryDirectory() as tmp:
        out_file = os.path.join(tmp, "rank0.json")
        mp.spawn(_worker, args=(world, os.path.join(tmp, "init"), out_file, dict(cfg, H=H)), nprocs=world, join=True)
        with open(out_file) as f:
            return json.load(f)


def main(argv: list[str] | None = None) -> list[dict[str, Any]]:
    ap = argparse.ArgumentParser(description="kda_ops context-parallel benchmark")
    ap.add_argument("--out", default=os.path.join(os.path.dirname(__file__), "results"))
    ap.add_argument("--device", choices=("cuda", "cpu"), default="cuda")
    ap.add_argument("--ranks", default="1,2,4,8", help="rank counts (on CUDA: those that fit the visible GPUs)")
    ap.add_argument("--heads", default="8,32")
    ap.add_argument("--tokens", type=int, default=131072, help="tokens of the one sequence")
    ap.add_argument("--rep", type=int, default=5)
    ap.add_argument("--warmup", type=int, default=2)
    args = ap.parse_args(argv)
    if args.device == "cuda" and not torch.cuda.is_available():
        raise SystemExit("kda_ops cp benchmark: --device cuda needs a CUDA GPU (none visible); --device cpu runs gloo")
    os.makedirs(args.out, exist_ok=True)
    asked = [int(r) for r in args.ranks.split(",")]
    n_gpu = torch.cuda.device_count() if args.device == "cuda" else None
    ranks = [r for r in asked if n_gpu is None or r <= n_gpu]
    skipped = [r for r in asked if r not in ranks]
    cfg = dict(device=args.device, tokens=args.tokens, rep=args.rep, warmup=args.warmup)
    records = []
    for H in (int(h) for h in args.heads.split(",")):
        for R in ranks:
            print(f"[bench_cp] H={H} T={args.tokens} R={R}", flush=True)
            records.append(run_case(R, H, cfg))
    rows = []
    for rec in records:
        base = next((b for b in records if b["H"] == rec["H"] and b["R"] == 1), None)
        sp = None if base is None else base["step_ms"] / rec["step_ms"]
        rec["speedup"] = sp
        rows.append(
            [
                f"H={rec['H']}", str(rec["R"]), str(rec["tokens_per_rank"]), f"{rec['fwd_ms']:.3f}",
                f"{rec['step_ms']:.3f}", f"{rec['fwd_bytes'] / 2**10:.1f} / {rec['step_bytes'] / 2**10:.1f}",
                "n/a" if sp is None else f"{sp:.2f}x", "n/a" if sp is None else f"{100 * sp / rec['R']:.0f}%",
            ]
        )  # fmt: skip
    name = torch.cuda.get_device_name() if args.device == "cuda" else "CPU (gloo)"
    notes = [
        f"# context parallelism, measured: {name}, one sequence of T={args.tokens} tokens, K=V=128",
        "times: median over repetitions of the slowest rank (each repetition from a barrier); fwd = the training "
        "forward under no_grad; step = forward + backward",
        "KiB sent per rank: what the rank contributes to kda_ops.distributed's all_gathers (fwd / step)",
    ]
    if skipped:
        notes.append(f"not run: R = {', '.join(map(str, skipped))} (only {n_gpu} GPU(s) visible)")
    header = ["heads", "ranks", "tokens/rank", "fwd ms", "fwd+bwd ms", "KiB sent/rank fwd / step",
              "speedup vs 1 rank", "efficiency"]  # fmt: skip
    write_results(args.out, "bench_cp", header, rows, records, notes, device=name)
    labels = [f"H={r['H']} R={r['R']}" for r in records]
    bar_plot(args.out, "bench_cp", labels, {"fwd+bwd ms": [r["step_ms"] for r in records]}, "ms per step")
    return records


if __name__ == "__main__":
    main()
