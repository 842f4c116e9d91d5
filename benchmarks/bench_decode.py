"""Decode benchmark (targets: docs/contract.md, "Speed targets").

kda_ops.recurrent_kda (token-serial CUDA kernel, backend "recurrent") beside fla's fused_recurrent_kda, in
one process, on the same inputs: H = HV = 32, K = V = 128, lower-bound gate (λ = -5), logit beta, L2 norm,
bf16 tokens; a state pool in bf16 or fp32 updated in place through ssm_state_indices.

Same math, same layout: fla is called through fused_recurrent_kda_fwd with state_v_first=True (its
[N, HV, V, K] value-first layout, the layout of this project) and inplace_final_state=True (read and write
the pool slot given by ssm_state_indices), so neither side transposes anything.

Timing: each measurement is a CUDA graph of R >= 8 back-to-back decode steps, each step on its own set of
pool slots (R * B slots in all, at least 3x the 60 MB L2, so every step reads its state from HBM the way a
model's layers do); the graph is replayed with CUDA events around it, the median over replays / R is the
time per step. Effective bandwidth:

    TB/s = state bytes read + written / time = N * HV * V * K * bytes(state dtype) * (1 + W) / t

with W = 1 for decode (the state is read and written once) and W = 1 + S for a speculative step of 1 + S
tokens (one read, one write per token). Token tensors and the output (< 1% of the bytes) are not counted.

Case b1 (B = 1, target <= 3 us per step): the same measurement as every other case, a graph of R steps on
distinct slots (R = 180 at 1 MB of bf16 state per step), time per step; beside it, as an extra number, the
replay time of a graph holding ONE step (launch-bound: graph launch included, state L2-resident). Also
reported: the host cost of an eager call from Python (public API and the raw op, and
fla's), an output cross-check ours vs fla, and a speculative verify step (case verify-bf16:B,
disable_state_update: state bytes read only).

    KDA_DECODE_KERNEL=serial python3 benchmarks/bench_decode.py --cases bf16:256,bf16:1024,b1 --tag _serial
"""

from __future__ import annotations

import math
import os
import statistics
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from benchmarks.common import fmt, import_fla_kda, parse_args, ratio, try_call, write_results  # noqa: E402

H = HV = 32
K = V = 128
LOWER_BOUND = -5.0
L2_BYTES = 60 * 2**20
# The kernel switch (KDA_DECODE_KERNEL=ring|serial) and, in an experiments build, the launch knobs
# (KDA_EXPERIMENT) are read once per process (docs/env.md): compare configurations by running this script once
# per environment, with --tag to keep the result files apart. KERNEL names the configuration in the tables.
KERNEL = " ".join(
    [os.environ.get("KDA_DECODE_KERNEL", "auto")]
    + ([f"experiment={os.environ['KDA_EXPERIMENT']}"] if os.environ.get("KDA_EXPERIMENT") else [])
)
CASES = "bf16:1,bf16:8,bf16:64,bf16:256,bf16:1024,fp32:1,fp32:8,fp32:64,fp32:256,fp32:1024,spec-bf16:64,spec-fp32:64"


def make_inputs(B: int, T: int, state_dtype: torch.dtype, slots: int, seed: int = 0) -> dict:
    gen = torch.Generator(device="cuda").manual_seed(seed)
    r = lambda *s: torch.randn(*s, device="cuda", generator=gen, dtype=torch.bfloat16)  # noqa: E731
    d = dict(q=r(B, T, H, K), k=r(B, T, H, K), v=r(B, T, HV, V), g=r(B, T, HV, K), beta=r(B, T, HV))
    d["A_log"] = torch.rand(HV, device="cuda", generator=gen) * 0.5 + 0.1
    d["dt_bias"] = torch.randn(HV, K, device="cuda", generator=gen) * 0.1
    d["pool"] = (torch.randn(slots, HV, V, K, device="cuda", generator=gen) * 0.1).to(state_dtype)
    d["out"] = torch.empty(B, T, HV, V, device="cuda", dtype=torch.bfloat16)
    return d


def ours_step(d: dict, idx: torch.Tensor, S: int = 0, acc: torch.Tensor | None = None, verify: bool = False):
    import kda_ops

    return kda_ops.recurrent_kda(
        d["q"],
        d["k"],
        d["v"],
        d["g"],
        d["beta"],
        A_log=d["A_log"],
        dt_bias=d["dt_bias"],
        initial_state=d["pool"],
        ssm_state_indices=idx,
        use_gate_in_kernel=True,
        lower_bound=LOWER_BOUND,
        beta_is_logit=True,
        use_qk_l2norm_in_kernel=True,
        output=d["out"],
        num_spec_tokens=S or None,
        num_accepted_tokens=acc,
        backend="recurrent",
        disable_state_update=verify,
    )


def fla_step(fla_fwd, d: dict, idx: torch.Tensor, out: torch.Tensor, acc: torch.Tensor | None = None):
    return fla_fwd(
        q=d["q"],
        k=d["k"],
        v=d["v"],
        g=d["g"],
        beta=d["beta"],
        A_log=d["A_log"],
        dt_bias=d["dt_bias"],
        initial_state=d["pool"],
        scale=K**-0.5,
        output_final_state=False,
        inplace_final_state=True,
        state_v_first=True,
        ssm_state_indices=idx,
        num_accepted_tokens=acc,
        use_qk_l2norm_in_kernel=True,
        use_gate_in_kernel=True,
        use_beta_sigmoid_in_kernel=True,
        lower_bound=LOWER_BOUND,
        out=out,
    )


def graph_time_us(steps: list, replays: int = 20) -> float:
    """Median time of one step (us): a graph of all `steps` (callables), replayed `replays` times."""
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        for f in steps[:2]:
            f()  # warm-up: JIT, occupancy queries, smem opt-in
    torch.cuda.current_stream().wait_stream(s)
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        for f in steps:
            f()
    g.replay()
    torch.cuda.synchronize()
    times = []
    for _ in range(replays):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        g.replay()
        b.record()
        b.synchronize()
        times.append(a.elapsed_time(b) * 1e3 / len(steps))
    del g
    return statistics.median(times)


MIN_STEPS = 8  # steps per graph at least: the graph launch is amortised even where one step is > 3x L2


def rotation(B: int, per_seq_bytes: int, W: int) -> int:
    """Steps per graph, each on its own slot set: one graph touches >= 3x L2 of state, and >= MIN_STEPS steps."""
    return max(MIN_STEPS, min(256, math.ceil(3 * L2_BYTES / (B * per_seq_bytes * W))))


def main() -> None:
    def extra(ap):
        ap.add_argument(
            "--cases",
            default=CASES,
            help="comma list of bf16:B, fp32:B, spec-bf16:B, spec-fp32:B, "
            "verify-bf16:B (speculative verify S=3, disable_state_update) and b1 (graph of one step)",
        )
        ap.add_argument("--tag", default="", help="suffix of the result files (e.g. the kernel)")
        ap.add_argument("--no-eager", action="store_true", help="skip the eager host-cost timings")

    args = parse_args("decode", extra)
    import kda_ops  # noqa: F401

    fla = None if args.no_peers else import_fla_kda()
    fla_fwd = None
    if fla is not None:
        try:
            from fla.ops.kda.fused_recurrent import fused_recurrent_kda_fwd as fla_fwd  # type: ignore
        except Exception as e:  # noqa: BLE001
            print(f"[peers] fla fused_recurrent_kda_fwd not importable: {e}")
    cases = [c.strip() for c in args.cases.split(",") if c.strip()]
    rows, records = [], []
    plot: dict[str, dict[str, list]] = {}
    notes = [
        f"kernel: KDA_DECODE_KERNEL={KERNEL}",
        f"## decode T=1, H=HV={HV}, K=V={K}, lower-bound gate, logit beta, L2 norm ({torch.cuda.get_device_name()})",
        "TB/s = N*HV*V*K*bytes(state)*(reads + writes) / t (decode: 2; spec S: 2+S; verify: 1); time = CUDA-graph "
        "replay of R steps on distinct pool slots (>= 3x L2 and >= 8 steps; R = 180 at B = 1 bf16), median / R. "
        "ratio = fla time / our time (> 1: ours faster). "
        "fla: fused_recurrent_kda_fwd(state_v_first=True, inplace_final_state=True), the same layout and slots.",
    ]

    def measure(label: str, B: int, dt: torch.dtype, S: int = 0, verify: bool = False):
        per_seq = HV * V * K * torch.finfo(dt).bits // 8
        W = 1 if verify else (2 + S if S else 2)  # reads + writes per sequence, in states (verify: reads only)
        Rn = rotation(B, per_seq, (1 + S))
        d = make_inputs(B, 1 + S, dt, slots=Rn * B * (1 + S), seed=B)
        if S:
            idxs = [
                torch.arange(r * B * (1 + S), (r + 1) * B * (1 + S), device="cuda", dtype=torch.int32).reshape(B, 1 + S)
                for r in range(Rn)
            ]
            acc = (torch.arange(B, device="cuda", dtype=torch.int32) % (S + 1)) + 1
        else:
            idxs = [torch.arange(r * B, (r + 1) * B, device="cuda", dtype=torch.int32) for r in range(Rn)]
            acc = None
        nbytes = B * per_seq * W
        tb = lambda t: None if t is None else nbytes / (t * 1e-6) / 1e12  # noqa: E731
        t_ours, err = try_call(lambda: graph_time_us([lambda i=i: ours_step(d, i, S, acc, verify) for i in idxs]))
        if err:
            print(f"[ours] {label}: {err}")
        t_fla = None
        if fla_fwd is not None and not verify:
            out_fla = torch.empty_like(d["out"])
            t_fla, ferr = try_call(
                lambda: graph_time_us([lambda i=i: fla_step(fla_fwd, d, i, out_fla, acc) for i in idxs])
            )
            if ferr:
                print(f"[fla] {label}: {ferr}")
        # cross-check on one fresh slot set: our output vs fla's from identical pools
        xerr = None
        if fla_fwd is not None and not verify:
            pool0 = d["pool"].clone()
            ours_step(d, idxs[0], S, acc)
            o_ours, p_ours = d["out"].clone(), d["pool"].clone()
            d["pool"].copy_(pool0)
            out_fla = torch.empty_like(d["out"])
            fla_step(fla_fwd, d, idxs[0], out_fla, acc)
            xo = (o_ours.float() - out_fla.float()).norm() / out_fla.float().norm()
            xs = (p_ours.float() - d["pool"].float()).norm() / d["pool"].float().norm()
            xerr = (xo.item(), xs.item())
            d["pool"].copy_(pool0)
        rec = dict(
            case=label,
            B=B,
            S=S,
            state_dtype=str(dt).replace("torch.", ""),
            bytes=nbytes,
            R=Rn,
            kernel=KERNEL,
            ours_us=t_ours,
            fla_us=t_fla,
            ours_tbs=tb(t_ours),
            fla_tbs=tb(t_fla),
            xcheck_out_state_rel=xerr,
        )
        records.append(rec)
        rows.append(
            [
                label,
                fmt(t_ours, 1),
                fmt(tb(t_ours), 2),
                fmt(t_fla, 1),
                fmt(tb(t_fla), 2),
                ratio(t_fla, t_ours),
                "n/a" if xerr is None else f"{xerr[0]:.1e}/{xerr[1]:.1e}",
            ]
        )
        print(f"{label}: ours {fmt(t_ours, 1)} us ({fmt(tb(t_ours), 2)} TB/s), fla {fmt(t_fla, 1)} us", flush=True)
        d.clear()
        torch.cuda.empty_cache()
        return t_ours, t_fla, tb

    extra = []
    for case in cases:
        if case == "b1":
            # B = 1: per step in a graph of R steps on distinct slots (the definition of the targets, as every case),
            # and, as an extra column, the replay of a graph of ONE step (launch-bound, L2-resident state)
            for dt in (torch.bfloat16, torch.float32):
                name = "bf16" if dt == torch.bfloat16 else "fp32"
                measure(f"decode B=1 {name} state (per step, graph of many steps)", 1, dt)
                d = make_inputs(1, 1, dt, slots=1, seed=1)
                idx = torch.zeros(1, device="cuda", dtype=torch.int32)
                t1, _ = try_call(lambda d=d, idx=idx: graph_time_us([lambda: ours_step(d, idx)], replays=200))
                tf = None
                if fla_fwd is not None:
                    of = torch.empty_like(d["out"])
                    tf, _ = try_call(
                        lambda d=d, idx=idx, of=of: graph_time_us([lambda: fla_step(fla_fwd, d, idx, of)], replays=200)
                    )
                extra.append(
                    [f"B=1 {name}: graph of 1 step, per replay (launch-bound)", fmt(t1, 2), fmt(tf, 2), ratio(tf, t1)]
                )
                records.append(dict(case=f"graph1 B=1 {name}", kernel=KERNEL, ours_us=t1, fla_us=tf))
            # the floor of a graph step: one trivial kernel per step (a 1-element in-place add, no PDL), R = 180
            x = torch.zeros(1, device="cuda")
            tfl, _ = try_call(lambda x=x: graph_time_us([lambda: x.add_(1.0)] * 180))
            extra.append(["graph floor: one 1-element kernel per step (per step, graph of 180)", fmt(tfl, 2), "", ""])
            records.append(dict(case="graph floor per step", kernel=KERNEL, ours_us=tfl, fla_us=None))
            continue
        kind, _, bs = case.partition(":")
        B = int(bs)
        name = kind.split("-")[-1]
        dt = torch.bfloat16 if name == "bf16" else torch.float32
        if kind.startswith("spec"):
            measure(f"spec S=3 B={B} {name} state", B, dt, S=3)
        elif kind.startswith("verify"):
            measure(f"verify S=3 B={B} {name} state (no pool write)", B, dt, S=3, verify=True)
        else:
            t_ours, t_fla, tb = measure(f"decode B={B} {name} state", B, dt)
            plot.setdefault(name, {"B": [], "ours": [], "fla": []})
            plot[name]["B"].append(B)
            plot[name]["ours"].append(tb(t_ours))
            plot[name]["fla"].append(tb(t_fla))

    # eager host cost per call (Python validation + dispatch + launch), B = 1, bf16 state
    d = make_inputs(1, 1, torch.bfloat16, slots=1, seed=2) if not args.no_eager else None
    idx = torch.zeros(1, device="cuda", dtype=torch.int32)

    def host_us(fn, n=300, repeat=5):
        """Host time per call: the clock stops before the final synchronise and n stays well below the launch
        queue's depth, so a B=1 kernel slower than its launch is not what is timed."""
        for _ in range(20):
            fn()
        best = float("inf")
        for _ in range(repeat):
            torch.cuda.synchronize()
            t0 = time.perf_counter()
            for _ in range(n):
                fn()
            best = min(best, time.perf_counter() - t0)
        torch.cuda.synchronize()
        return best / n * 1e6

    def raw_op():
        torch.ops.kda.recurrent_kda.default(
            d["q"],
            d["k"],
            d["v"],
            d["g"],
            d["beta"],
            d["A_log"],
            d["dt_bias"],
            d["pool"],
            None,
            None,
            None,
            idx,
            None,
            None,
            d["out"],
            None,
            None,
            None,
            None,
            K**-0.5,
            2,
            LOWER_BOUND,
            True,
            True,
            0,
            0,
            2,
        )

    def raw_decode_op():  # the short-schema op the cached public path calls
        torch.ops.kda.recurrent_kda_decode.default(
            d["q"],
            d["k"],
            d["v"],
            d["g"],
            d["beta"],
            d["A_log"],
            d["dt_bias"],
            d["pool"],
            idx,
            None,
            d["out"],
            K**-0.5,
            LOWER_BOUND,
            2 | 4 | 8 | (2 << 8),
        )

    if d is not None:
        idx = torch.zeros(1, device="cuda", dtype=torch.int32)
        e_api = host_us(lambda: ours_step(d, idx))
        e_raw = host_us(raw_op)
        e_dec = host_us(raw_decode_op) if hasattr(torch.ops.kda, "recurrent_kda_decode") else None
        e_fla = None
        if fla_fwd is not None:
            of = torch.empty_like(d["out"])
            e_fla = host_us(lambda: fla_step(fla_fwd, d, idx, of))
        extra.append(
            [
                "B=1 bf16: eager call from Python (host-bound), public API",
                fmt(e_api, 1),
                fmt(e_fla, 1),
                ratio(e_fla, e_api),
            ]
        )
        extra.append(["B=1 bf16: eager call from Python, raw torch.ops.kda.recurrent_kda", fmt(e_raw, 1), "", ""])
        extra.append(
            ["B=1 bf16: eager call from Python, raw torch.ops.kda.recurrent_kda_decode", fmt(e_dec, 1), "", ""]
        )
        records.append(
            dict(
                case="eager B=1 bf16",
                kernel=KERNEL,
                ours_api_us=e_api,
                ours_raw_op_us=e_raw,
                ours_raw_decode_op_us=e_dec,
                fla_us=e_fla,
            )
        )

    header = ["case", "ours us/step", "ours TB/s", "fla us/step", "fla TB/s", "fla/ours", "xcheck out/state rel"]
    text_notes = notes
    stem = "bench_decode" + args.tag
    write_results(args.out, stem, header, rows, records, text_notes)
    md = ["| case | ours (us) | fla (us) | fla/ours |", "|---|---|---|---|"] + [
        "| " + " | ".join(r) + " |" for r in extra
    ]
    print("\n".join(["## latency and host overhead"] + md), flush=True)
    with open(os.path.join(args.out, stem + ".md"), "a") as f:
        f.write("\n## latency and host overhead\n" + "\n".join(md) + "\n")

    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt

        if not plot:
            raise RuntimeError("no decode cases")
        fig, ax = plt.subplots(figsize=(6.5, 4))
        for name, series in plot.items():
            ax.plot(series["B"], [v or 0 for v in series["ours"]], "o-", label=f"kda_ops {name} state")
            if any(v is not None for v in series["fla"]):
                ax.plot(series["B"], [v or 0 for v in series["fla"]], "s--", label=f"fla {name} state")
        ax.axhline(4.3, color="gray", lw=0.8, ls=":", label="device copy (4.3 TB/s)")
        ax.set_xscale("log", base=2)
        ax.set_xlabel("batch (sequences), H=HV=32, K=V=128")
        ax.set_ylabel("state TB/s (read + write)")
        ax.set_title("KDA decode, T=1")
        ax.legend(fontsize=8)
        fig.tight_layout()
        fig.savefig(os.path.join(args.out, stem + ".png"), dpi=120)
        plt.close(fig)
    except Exception as e:  # noqa: BLE001
        print(f"[plot] no PNG: {e}")


if __name__ == "__main__":
    main()
