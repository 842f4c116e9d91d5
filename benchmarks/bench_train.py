"""Training forward+backward benchmark (docs/contract.md "Speed targets"): kda_ops.kda vs fla chunk_kda and
cuDNN Frontend's kimi_delta_attention.

H200, K=V=128 (``--head-dim 64``: K=V=64), bf16, lower-bound gate λ=-5, logit beta, L2 norm, fp32 initial
state. Reports the
forward and backward separately, and the bytes our training context holds per token-head. A single sequence
is passed without cu_seqlens to both (fla's fixed-length path, as a user calls it, is much faster than its
varlen one; ours then takes the sequence split where it pays: H=8 T=65536); packed cases pass cu_seqlens
(fla also its host copy). cuDNN Frontend (packed [T, H, K], cu_seqlens always) cannot fuse the lower-bound gate,
the L2 norm and the β sigmoid into its sm90 backward, so it is timed two ways: "cudnn" composes them in torch
(autograd through them) around its core, and "cudnn core" is the core alone on precomputed log-decays, normalised
q/k and β (leaves of their own). "bwd peak" is our backward's peak allocation above what the forward left, per
token-head, the gradients themselves included.

``--model``: instead, one training step of fla's own model (flash-linear-attention's ``KDAForCausalLM``: 2 layers,
hidden 1024, 8 heads of 128, vocabulary 32000, batch 4 x 2048 tokens, bf16, AdamW) on fla's Triton kernels and under
``kda_ops.fla.install()``, in the layer's default configuration (softplus gate) and with ``safe_gate=True,
lower_bound=-5``: ms per step (forward, backward, optimizer), median of 5 after 3 warm-up steps.
"""

from __future__ import annotations

import os
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from benchmarks.common import (  # noqa: E402
    bar_plot,
    chosen_cases,
    cuda_time_ms,
    fmt,
    import_cudnn_kda,
    import_fla_kda,
    parse_args,
    ratio,
    try_call,
    write_results,
)

CASES = [
    ("H=96 T=8192", 96, [8192]),
    ("H=32 T=8192", 32, [8192]),
    ("H=96 packed 6 (8192)", 96, [1300, 547, 2048, 963, 271, 3063]),
    ("H=8 T=65536", 8, [65536]),
]


def make(H: int, lens: list[int], K: int = 128, dev: str = "cuda"):
    T = sum(lens)
    gen = torch.Generator(device=dev).manual_seed(0)
    r = lambda *s: torch.randn(*s, device=dev, generator=gen, dtype=torch.bfloat16).requires_grad_()  # noqa: E731
    d = dict(q=r(1, T, H, K), k=r(1, T, H, K), v=r(1, T, H, K), g=r(1, T, H, K), beta=r(1, T, H))
    d["A_log"] = (torch.rand(H, device=dev, generator=gen) * 0.5).requires_grad_()
    d["dt_bias"] = (torch.randn(H * K, device=dev, generator=gen) * 0.1).requires_grad_()
    d["h0"] = torch.zeros(len(lens), H, K, K, device=dev, requires_grad=True)
    d["cu"] = torch.tensor([0] + torch.tensor(lens).cumsum(0).tolist(), device=dev, dtype=torch.int64)
    d["do"] = torch.randn(1, T, H, K, device=dev, generator=gen, dtype=torch.bfloat16)
    return d


def cudnn_calls(cudnn_kda, d: dict, H: int, lens: list[int], leaves: list) -> dict:  # type: ignore[no-untyped-def]
    """cuDNN Frontend's KDA forwards: "cudnn" (the lower-bound gate, the L2 norm and the beta sigmoid in torch,
    differentiated through, around its core; our leaves) and "cudnn core" (the core alone on precomputed inputs,
    leaves of their own). None entries without cuDNN Frontend."""
    if cudnn_kda is None:
        return {"cudnn": (None, None), "cudnn core": (None, None)}
    K = d["q"].shape[-1]
    cu32 = d["cu"].to(torch.int32)

    def prep(q, k, g, beta, A_log, dt_bias):  # type: ignore[no-untyped-def]
        glog = -5.0 * torch.sigmoid(A_log.exp().view(H, 1) * (g[0].float() + dt_bias.view(H, K)))
        l2 = lambda x: (x * torch.rsqrt(x.square().sum(-1, keepdim=True) + 1e-6)).to(q.dtype)  # noqa: E731  (as ours)
        qn, kn = l2(q[0].float()), l2(k[0].float())
        return qn, kn, glog, torch.sigmoid(beta[0].float())

    def core(qn, kn, v, glog, b, h0):  # type: ignore[no-untyped-def]
        o, _ = cudnn_kda(qn, kn, v, glog, b, cu32, initial_state=h0, output_final_state=True)
        return o

    def composed():  # type: ignore[no-untyped-def]
        qn, kn, glog, b = prep(d["q"], d["k"], d["g"], d["beta"], d["A_log"], d["dt_bias"])
        return core(qn, kn, d["v"][0], glog, b, d["h0"])

    with torch.no_grad():
        pre = prep(d["q"], d["k"], d["g"], d["beta"], d["A_log"], d["dt_bias"])
        pre = [t.detach().clone().requires_grad_() for t in pre]
    v0 = d["v"][0].detach().clone().requires_grad_()
    h0 = d["h0"].detach().clone().requires_grad_()
    core_leaves = [*pre, v0, h0]
    return {
        "cudnn": (composed, leaves),
        "cudnn core": (lambda: core(pre[0], pre[1], v0, pre[2], pre[3], h0), core_leaves),
    }


def backward_peak_bytes(fwd, do: torch.Tensor, leaves: list) -> float:  # type: ignore[no-untyped-def]
    """The peak allocation of one backward above what the forward left (the gradients included), bytes."""
    o = fwd()
    torch.cuda.synchronize()
    base = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    o.backward(do)
    torch.cuda.synchronize()
    peak = torch.cuda.max_memory_allocated() - base
    for x in leaves:
        x.grad = None
    return float(peak)


def main() -> None:
    def extra(ap):  # type: ignore[no-untyped-def]
        ap.add_argument(
            "--cases", default="", help="comma-separated case numbers to run (1-based; default: all, --quick: 1)"
        )
        ap.add_argument("--head-dim", type=int, default=128, choices=(64, 128), help="K = V (default 128)")
        ap.add_argument("--model", action="store_true", help="fla's KDAForCausalLM step, fla kernels vs install()")

    args = parse_args("train", extra)
    if args.model:
        model_steps(args.out)
        return
    import kda_ops

    fla = None if args.no_peers else import_fla_kda()
    cudnn_kda = None if args.no_peers else import_cudnn_kda()
    rows, records = [], []
    cases = chosen_cases(CASES, args.cases, CASES[:1] if args.quick else CASES, first=1)
    t_start = time.time()
    for i_case, (name, H, lens) in enumerate(cases):
        if args.head_dim != 128:
            name = f"{name} K={args.head_dim}"
        print(f"[bench_train {time.time() - t_start:6.0f} s] case {i_case + 1}/{len(cases)}: {name}", flush=True)
        d = make(H, lens, args.head_dim)
        cu = d["cu"] if len(lens) > 1 else None
        cu_cpu = None if cu is None else cu.cpu()
        leaves = [d[n] for n in ("q", "k", "v", "g", "beta", "A_log", "dt_bias", "h0")]

        def ours_fwd():
            o, _ = kda_ops.kda(
                d["q"],
                d["k"],
                d["v"],
                d["g"],
                d["beta"],
                d["A_log"],
                d["dt_bias"].view(H, -1),
                d["h0"],
                cu_seqlens=cu,
                lower_bound=-5.0,
            )
            return o

        def fla_fwd():
            o, _ = fla.chunk_kda(
                d["q"],
                d["k"],
                d["v"],
                d["g"],
                d["beta"],
                A_log=d["A_log"],
                dt_bias=d["dt_bias"],
                initial_state=d["h0"],
                output_final_state=True,
                use_qk_l2norm_in_kernel=True,
                use_gate_in_kernel=True,
                use_beta_sigmoid_in_kernel=True,
                safe_gate=True,
                lower_bound=-5.0,
                state_v_first=True,
                cu_seqlens=cu,
                cu_seqlens_cpu=cu_cpu,
            )
            return o

        calls = {"ours": (ours_fwd, leaves), "fla": (fla_fwd if fla is not None else None, leaves)}
        calls.update(cudnn_calls(cudnn_kda, d, H, lens, leaves))
        res = {}
        for label, (fwd, lv) in calls.items():
            if fwd is None:
                res[label] = (None, None)
                continue

            def fb(fwd=fwd, lv=lv):
                o = fwd()
                o.backward(d["do"].view(o.shape))
                for x in lv:
                    x.grad = None

            note = " (its first calls compile and autotune)" if label in ("fla", "cudnn") else ""
            print(f"[bench_train {time.time() - t_start:6.0f} s]   {label}{note}", flush=True)
            t_f, err = try_call(lambda fwd=fwd: cuda_time_ms(lambda: fwd().detach(), warmup=2, rep=5))
            t_fb, err2 = try_call(lambda fb=fb: cuda_time_ms(fb, warmup=2, rep=5))
            for e in (err, err2):
                if e:
                    print(f"[{label}] {name}: {e}")
            res[label] = (t_f, t_fb)
        of, ofb = res["ours"]
        ff, ffb = res["fla"]
        cf, cfb = res["cudnn"]
        kf, kfb = res["cudnn core"]
        ws = backward_peak_bytes(ours_fwd, d["do"], leaves) / (sum(lens) * H)
        bwd = lambda f, fb: None if f is None or fb is None else fb - f  # noqa: E731
        # Our context holds q, k, v, g, beta by reference; what it adds is the tapes (and the [N+1] row starts),
        # measured here from the tensors the training forward allocates.
        with torch.no_grad():
            _, _, tctx = kda_ops.recurrent_kda_training_forward(
                *(d[n] for n in ("q", "k", "v", "g", "beta", "A_log")),
                d["dt_bias"].view(H, -1),
                d["h0"],
                cu_seqlens=cu,
                cu_seqlens_cpu=cu_cpu,
                lower_bound=-5.0,
            )
        held = sum(t.numel() * t.element_size() for t in (tctx.tapes, tctx.tape_cu_starts))
        ctx_bytes = held / (sum(lens) * H)
        del tctx
        three = lambda f, fb: [fmt(f), fmt(bwd(f, fb)), fmt(fb)]  # noqa: E731  (fwd, bwd, fwd+bwd)
        rows.append(
            [name, *three(of, ofb), *three(ff, ffb), ratio(ffb, ofb), *three(cf, cfb), *three(kf, kfb)]
            + [f"{ctx_bytes:.0f}", f"{ws:.0f}"]
        )
        records.append(
            dict(
                case=name,
                ours_fwd_ms=of,
                ours_fwd_bwd_ms=ofb,
                fla_fwd_ms=ff,
                fla_fwd_bwd_ms=ffb,
                cudnn_fwd_ms=cf,
                cudnn_fwd_bwd_ms=cfb,
                cudnn_core_fwd_ms=kf,
                cudnn_core_fwd_bwd_ms=kfb,
                ctx_bytes_per_token_head=ctx_bytes,
                bwd_peak_bytes_per_token_head=ws,
            )
        )
        d, leaves = {}, []
        torch.cuda.empty_cache()
        # after every case: a run cut short keeps what it measured
        write_table(args.out, rows, records, head_dim=args.head_dim)
    write_table(args.out, rows, records, plot=True, head_dim=args.head_dim)


MODEL_CONFIGS = [
    ("default (softplus gate)", {}),
    ("safe_gate, lower_bound=-5", {"safe_gate": True, "lower_bound": -5.0}),
]


def model_steps(out: str) -> None:
    """``--model``: fla's KDAForCausalLM training step on fla's kernels and under kda_ops.fla.install()."""
    from fla import models as fla_models  # flash-linear-attention

    from kda_ops import fla as kf

    rows, records = [], []
    for name, cfg in MODEL_CONFIGS:
        config = fla_models.KDAConfig(
            hidden_size=1024, num_heads=8, head_dim=128, num_hidden_layers=2, vocab_size=32000, **cfg
        )
        times = {}
        for label in ("fla", "ours"):
            torch.manual_seed(0)
            model = fla_models.KDAForCausalLM(config).to(device="cuda", dtype=torch.bfloat16)
            opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
            data = torch.randint(0, 32000, (4, 2048), device="cuda", generator=torch.Generator("cuda").manual_seed(1))
            if label == "ours":
                kf.install()

            def step(model=model, opt=opt, data=data) -> None:
                model(input_ids=data, labels=data).loss.backward()
                opt.step()
                opt.zero_grad(set_to_none=True)

            print(f"  {name}: {label} (fla's first steps compile and autotune)", flush=True)
            times[label], err = try_call(lambda step=step: cuda_time_ms(step, warmup=3, rep=5))
            if err:
                print(f"[{label}] {name}: {err}")
            kf.uninstall()
            del model, opt
            torch.cuda.empty_cache()
        rows.append([name, fmt(times["ours"]), fmt(times["fla"]), ratio(times["fla"], times["ours"])])
        records.append(dict(case=name, ours_step_ms=times["ours"], fla_step_ms=times["fla"]))
    notes = [
        f"# fla's KDAForCausalLM training step, {torch.cuda.get_device_name()}",
        "2 layers, hidden 1024, 8 heads of 128, batch 4 x 2048, bf16, AdamW; ms per step, median of 5 after 3 warm-up"
        " steps; ours = kda_ops.fla.install(); ratio = fla / ours",
    ]
    write_results(out, "bench_train_model", ["config", "ours ms", "fla ms", "fla/ours"], rows, records, notes)


def write_table(out: str, rows: list[list[str]], records: list[dict], plot: bool = False, head_dim: int = 128) -> None:
    notes = [
        f"# training forward+backward, {torch.cuda.get_device_name()}",
        "ms, median of CUDA-event timings; bwd = (fwd+bwd) - fwd; ratio = fla / ours on fwd+bwd; cudnn: the gate,"
        " L2 norm and beta sigmoid in torch around cuDNN Frontend's core; cudnn core: the core alone",
        "context bytes per token-head: the tapes (and row starts) the training forward allocates, fp32"
        f" {head_dim}x{head_dim} per 64-token chunk but each sequence's first, rows B*(ceil(T/64) - 1) fixed or"
        " T//64 packed (an upper bound from shapes); the bf16"
        f" q+k+v+g of the call are {8 * head_dim} B",
        "bwd peak B/token-head: our backward's peak allocation above the forward's, per token-head, the gradients"
        " of the call included",
    ]
    stem = "bench_train" if head_dim == 128 else f"bench_train_k{head_dim}"
    write_results(
        out,
        stem,
        [
            "case",
            "ours fwd",
            "ours bwd",
            "ours fwd+bwd",
            "fla fwd",
            "fla bwd",
            "fla fwd+bwd",
            "fla/ours",
            "cudnn fwd",
            "cudnn bwd",
            "cudnn fwd+bwd",
            "cudnn core fwd",
            "cudnn core bwd",
            "cudnn core fwd+bwd",
            "ctx B/token-head",
            "bwd peak B/token-head",
        ],
        rows,
        records,
        notes,
    )
    if not plot:
        return
    series = {"ours": [r["ours_fwd_bwd_ms"] for r in records]}
    peers = (("fla", "fla_fwd_bwd_ms"), ("cudnn", "cudnn_fwd_bwd_ms"), ("cudnn core", "cudnn_core_fwd_bwd_ms"))
    for label, key in peers:
        vals = [r[key] for r in records]
        if any(x is not None for x in vals):  # an unmeasured series would read as 0 ms
            series[label] = vals
    bar_plot(
        out,
        stem,
        [r["case"] for r in records],
        series,
        "fwd+bwd ms (lower is better)",
    )


if __name__ == "__main__":
    main()
