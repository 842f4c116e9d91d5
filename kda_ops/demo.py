"""`python -m kda_ops.demo` (`make demo`): one Kimi-Linear-shaped KDA layer end to end.

HV = H = 32 heads, K = V = 128, lower-bound gate (λ = -5), logit beta, L2 norm, bf16 tokens:
  1. packed prefill of a request mix into a bf16 state pool (with checkpoints),
  2. decode steps from the pool, then speculative decode (S = 3) with accepted-token counts,
  3. one training step (kda_ops.kda forward + backward).
Each result is checked against the fp64 reference (kda_ops.reference) on a sample, with the tolerances of
docs/contract.md "Tolerances", and a table of timings is printed. Sizes are reduced on CPU and full on a GPU.
"""

from __future__ import annotations

import argparse
import time
from typing import Any

import torch

import kda_ops
from kda_ops.reference import recurrent_kda_reference, reference_training_grads, rel_rms

HV = H = 32
K = V = 128
LB = -5.0


def _sync(dev: str) -> None:
    if dev == "cuda":
        torch.cuda.synchronize()


def _timed(dev: str, fn):
    _sync(dev)
    t = time.perf_counter()
    out = fn()
    _sync(dev)
    return out, (time.perf_counter() - t) * 1e3


def _tokens(T: int, dev: str, gen: torch.Generator, heads: int = H):
    r = lambda *s: torch.randn(*s, generator=gen).to(torch.bfloat16).to(dev)  # noqa: E731
    return dict(q=r(1, T, heads, K), k=r(1, T, heads, K), v=r(1, T, heads, V), g=r(1, T, heads, K), beta=r(1, T, heads))


def _check(name: str, err: float, tol: float, rows: list) -> bool:
    ok = err <= tol
    rows.append((name, f"{err:.2e}", f"{tol:.0e}", "ok" if ok else "FAIL"))
    return ok


def run(dev: str, full: bool) -> bool:
    gen = torch.Generator().manual_seed(0)
    A_log = (torch.rand(HV, generator=gen) * 0.5 + 0.1).to(dev)
    dt_bias = (torch.randn(HV, K, generator=gen) * 0.1).to(dev)
    gate: dict[str, Any] = dict(
        A_log=A_log, dt_bias=dt_bias, use_gate_in_kernel=True, lower_bound=LB, beta_is_logit=True
    )
    ref_gate: dict[str, Any] = dict(
        A_log=A_log.cpu(), dt_bias=dt_bias.cpu(), use_gate_in_kernel=True, lower_bound=LB, beta_is_logit=True
    )
    lens = [1300, 547, 2048, 963, 271, 3063] if full else [130, 47, 1, 0, 64]
    n_decode = 256 if full else 8
    timings: list[tuple[str, float, int]] = []
    checks: list[tuple[str, str, str, str]] = []
    ok = True

    # 1. packed prefill into a bf16 pool; pool slots are not the sequence order (a serving engine's pool).
    N = len(lens)
    n_pool = max(N, n_decode) + 4
    pool = torch.zeros(n_pool, HV, V, K, dtype=torch.bfloat16, device=dev)
    slots = torch.randperm(n_pool, generator=gen)[:N].to(torch.int32).to(dev)
    cu = torch.tensor([0] + torch.tensor(lens).cumsum(0).tolist(), dtype=torch.int64, device=dev)
    x = _tokens(sum(lens), dev, gen)
    (o, _, ckpt), ms = _timed(
        dev,
        lambda: kda_ops.recurrent_kda(
            **x, **gate, initial_state=pool, cu_seqlens=cu, ssm_state_indices=slots, checkpoint_every_n_tokens=64
        ),
    )
    timings.append((f"prefill packed {lens} (recurrent backend)", ms, sum(lens)))
    # Reference on a sample: the second sequence, from a zero state.
    i = 1
    a, b = int(cu[i]), int(cu[i + 1])
    sl = {n: t[:, a:b].cpu() for n, t in x.items()}
    ref = recurrent_kda_reference(**sl, **ref_gate)
    ok &= _check("prefill output (rel RMS)", rel_rms(o[:, a:b], ref.output), 5e-3, checks)
    ok &= _check("prefill bf16 state (rel RMS)", rel_rms(pool[int(slots[i])].float(), ref.final_state[0]), 1e-2, checks)

    # 2. decode: every slot of the pool advances one token (fixed layout [B, 1, ...]).
    B = n_decode
    dslots = torch.arange(B, dtype=torch.int32, device=dev)
    xs = {n: t.reshape(B, 1, *t.shape[2:]) for n, t in _tokens(B, dev, gen).items()}
    before = pool[:B].float().cpu()
    (o1, _), ms = _timed(dev, lambda: kda_ops.recurrent_kda(**xs, **gate, initial_state=pool, ssm_state_indices=dslots))
    timings.append((f"decode T=1, B={B}, bf16 pool", ms, B))
    j = 3
    ref = recurrent_kda_reference(
        **{n: t[j : j + 1].cpu() for n, t in xs.items()}, **ref_gate, initial_state=before[j : j + 1]
    )
    ok &= _check("decode output (rel RMS)", rel_rms(o1[j : j + 1], ref.output), 5e-3, checks)

    # Speculative decode, S = 3: 4 tokens per sequence, per-token state slots, accepted counts.
    S = 3
    Bs = max(2, B // 4)
    spec_pool = torch.randn(Bs * (S + 1), HV, V, K, generator=gen).mul(0.1).to(dev)  # fp32 pool
    idx = torch.arange(Bs * (S + 1), dtype=torch.int32, device=dev).view(Bs, S + 1)
    acc = torch.randint(1, S + 2, (Bs,), generator=gen, dtype=torch.int32).to(dev)
    xs = {n: t.reshape(Bs, S + 1, *t.shape[2:]) for n, t in _tokens(Bs * (S + 1), dev, gen).items()}
    start = spec_pool[int(idx[0, acc[0] - 1])].clone().cpu()
    (o2, _), ms = _timed(
        dev,
        lambda: kda_ops.recurrent_kda(
            **xs, **gate, initial_state=spec_pool, ssm_state_indices=idx, num_spec_tokens=S, num_accepted_tokens=acc
        ),
    )
    timings.append((f"spec decode S={S}, B={Bs}, fp32 pool", ms, Bs * (S + 1)))
    ref = recurrent_kda_reference(**{n: t[:1].cpu() for n, t in xs.items()}, **ref_gate, initial_state=start[None])
    ok &= _check("spec decode output (rel RMS)", rel_rms(o2[:1], ref.output), 5e-3, checks)
    ok &= _check(
        "spec decode last state (rel RMS)", rel_rms(spec_pool[int(idx[0, S])], ref.final_state[0]), 1e-3, checks
    )

    # 3. one training step through autograd (the CPU op on a laptop, the CUDA kernels on a GPU).
    tdev = dev
    try:
        torch.ops.kda.recurrent_kda_training_forward.default  # noqa: B018
        tl = [256, 100] if full else [40, 17]
        Ht = 8 if not full else H
        xt = _tokens(sum(tl), tdev, gen, heads=Ht)
        leaves = [
            *(xt[n] for n in ("q", "k", "v", "g", "beta")),
            A_log[:Ht].clone(),
            dt_bias[:Ht].clone(),
            torch.zeros(len(tl), Ht, V, K, device=tdev),
        ]
        leaves = [t.detach().requires_grad_() for t in leaves]
        cut = torch.tensor([0] + torch.tensor(tl).cumsum(0).tolist(), dtype=torch.int64, device=tdev)
        do = torch.randn(1, sum(tl), Ht, V, generator=gen).to(torch.bfloat16).to(tdev)

        def step():
            o, _ = kda_ops.kda(*leaves, cu_seqlens=cut, lower_bound=LB)
            (o.float() * do.float()).sum().backward()
            return o

        _, ms = _timed(tdev, step)
        timings.append((f"training fwd+bwd {tl} H={Ht}", ms, sum(tl)))
        q_, k_, v_, g_, b_, A_, dtb_, h0_ = (t.detach().cpu() for t in leaves)
        _, _, g_ref = reference_training_grads(
            q_, k_, v_, g_, b_, A_, dtb_, h0_, do.cpu(), None, cu_seqlens=cut.cpu(), lower_bound=LB
        )
        for name, lf, gr in zip(("dq", "dk", "dv", "dg", "dbeta", "dA_log", "ddt_bias"), leaves, g_ref, strict=False):
            ok &= _check(f"training {name} (rel RMS)", rel_rms(lf.grad, gr), 1e-2, checks)
    except (NotImplementedError, RuntimeError) as e:
        timings.append((f"training step: not available on {tdev}: {str(e).splitlines()[0][:80]}", float("nan"), 0))

    print(
        f"\nkda_ops demo on {dev} ({torch.cuda.get_device_name() if dev == 'cuda' else 'CPU'}), "
        f"HV={HV}, K=V={K}, λ={LB}"
    )
    print("\n| step | ms | tokens |\n|---|---|---|")
    for name, ms, n in timings:
        print(f"| {name} | {ms:.2f} | {n} |")
    print("\n| check vs fp64 reference | error | tolerance | |\n|---|---|---|---|")
    for row in checks:
        print("| " + " | ".join(row) + " |")
    print("\nall checks passed" if ok else "\nSOME CHECKS FAILED")
    return ok


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--full", action="store_true", help="full sizes (default on GPU)")
    args = ap.parse_args()
    ok = run(args.device, args.full or args.device == "cuda")
    raise SystemExit(0 if ok else 1)


if __name__ == "__main__":
    main()
