"""Precision of the folded WY operand order (kda_ops/reference_chunked.py, "Folded WY operands") against the fp64
token loop (kda_ops.reference), beside the current kernels' operand order. CPU only.

  python benchmarks/profiling/folded_precision.py            # golden, random and adversarial cases (~30 s, 2 cores)
  python benchmarks/profiling/folded_precision.py --quick    # the golden and T = 2048 cases only
  python benchmarks/profiling/folded_precision.py --markdown # the table as in docs/design.md

Every order runs the chunked reference with 16-token chunks (the kernels' C) and tensor-core operand rounding
(`operand_dtype=bf16` plus the per-GEMM overrides of ORDERS). Metrics (docs/contract.md "Tolerances"): output
rounded to bf16 as stored, relative RMS against the fp64 output; fp32 state: the worst relative RMS of the
final state and the checkpoints (where the case has them). Limits: output 5e-3, state 1e-3.
"""

from __future__ import annotations

import argparse
import os
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))  # repository root

from kda_ops.reference import make_inputs, recurrent_kda_reference, rel_rms  # noqa: E402
from kda_ops.reference_chunked import chunked_kda_reference  # noqa: E402

BF16, FP16 = torch.bfloat16, torch.float16
TOL_OUT, TOL_STATE = 5e-3, 1e-3

# name -> chunked_kda_reference keywords (operand_dtype=bf16 everywhere else)
ORDERS: dict[str, dict] = {
    # today's kernels: bf16 L / X / Q⁺S_0ᵀ, fp16 INVb and Y (R), Mqk and R (O_intra), R and Kr (S)
    "current": dict(gemm_dtypes={"R": FP16, "O_intra": FP16, "S": FP16}),
    # folded: W' = INVb K⁺ stored bf16, V' = INVb V stored fp16 (saturating), INVb fp16 x bf16 K⁺ / V
    "folded fp16 INVb": dict(folded_wy=True, gemm_dtypes={"INVb": FP16, "Vp": FP16, "O_intra": FP16, "S": FP16}),
    "folded bf16 INVb": dict(folded_wy=True, gemm_dtypes={"Vp": FP16, "O_intra": FP16, "S": FP16}),
    # what one mma type allows with fp16 INVb: K⁺ and V as fp16 operands of the fold products
    "folded fp16 INVb, K⁺/V": dict(
        folded_wy=True, gemm_dtypes={"INVb": FP16, "KV": FP16, "Vp": FP16, "O_intra": FP16, "S": FP16}
    ),
    # W' kept at ~fp32 (a bf16 hi + lo pair carries 16 bits): how much of the error is W's rounding
    "folded fp16 INVb, W' hi+lo": dict(
        folded_wy=True, gemm_dtypes={"INVb": FP16, "W": None, "Vp": FP16, "O_intra": FP16, "S": FP16}
    ),
}
TOKENS = ("q", "k", "v", "g", "beta")
LOWER_BOUND = dict(use_gate_in_kernel=True, lower_bound=-5.0, beta_is_logit=True)


def golden_dir() -> str:
    """$KDA_GOLDEN_DIR (the folder the tests read the golden files from), or "" (the golden rows are skipped)."""
    d = os.environ.get("KDA_GOLDEN_DIR")
    return d if d and os.path.isdir(d) else ""


def golden_cases() -> list[tuple[str, dict, dict]]:
    """(name, inputs, keywords) of the golden files that are prefill-shaped calls (the decode ones are T = 1)."""
    d = golden_dir()
    out = []
    for name, extra in (
        ("prefill_checkpoints", {}),
        ("prefill_packed_softplus", {}),
        ("prefill_precomputed_gate_no_l2", {}),
        ("training_grads_packed_gqa", dict(use_gate_in_kernel=True, beta_is_logit=True)),
    ):
        path = os.path.join(d, name + ".pt")
        if not d or not os.path.exists(path):
            print(f"golden file {name}.pt not found (set KDA_GOLDEN_DIR); skipped", file=sys.stderr)
            continue
        gold = torch.load(path)
        keep = TOKENS + ("A_log", "dt_bias", "initial_state", "cu_seqlens")
        inp = {n: t for n, t in gold["inputs"].items() if n in keep}
        kw = {n: x for n, x in gold["kwargs"].items() if n != "output_final_state"}
        label = f"golden {name}" + (" (forward)" if name.startswith("training") else "")
        out.append((label, inp, {**kw, **extra}))
    return out


def random_case(T: int, K: int, HV: int, seed: int) -> dict:
    """Tests' style: bf16 ~N(0, 1) tokens, lower-bound gate λ = -5 with dt_bias, L2 norm, logit β."""
    return make_inputs(T=T, H=HV, HV=HV, K=K, V=K, seed=seed)


def adversarial_case(T: int, K: int, HV: int, collinear: bool, gate: str, seed: int) -> dict:
    """β logit 8 (β ≈ 1); keys = one direction + 1e-3 noise if collinear; gates at the bound (a ≈ λ on every token:
    g = +12) or ≈ 0 (slow decay, a ≈ -5e-7: g = -12)."""
    inp = make_inputs(T=T, H=HV, HV=HV, K=K, V=K, seed=seed)
    if collinear:
        base = torch.randn(1, 1, 1, K, generator=torch.Generator().manual_seed(seed + 1))
        noise = torch.randn(inp["k"].shape, generator=torch.Generator().manual_seed(seed + 2)) * 1e-3
        inp["k"] = (base + noise).to(BF16)
    inp["beta"] = torch.full_like(inp["beta"], 8.0)
    inp["g"] = torch.full_like(inp["g"], 12.0 if gate == "bound" else -12.0)
    return inp


def cases(quick: bool) -> list[tuple[str, dict, dict]]:
    out = golden_cases()
    out.append(("random T=2048 K=128", random_case(2048, 128, 2, seed=1), LOWER_BOUND))
    out.append(("random T=2048 K=64", random_case(2048, 64, 2, seed=2), LOWER_BOUND))
    if quick:
        return out
    for gate in ("bound", "slow"):
        for collinear in (True, False) if gate == "bound" else (False, True):
            for K in (128, 64):
                what = "collinear" if collinear else "random keys"
                name = f"{what}, β≈1, {'a≈0' if gate == 'slow' else 'a≈λ'}, T=2048 K={K}"
                out.append((name, adversarial_case(2048, K, 2, collinear, gate, seed=10 + K), LOWER_BOUND))
    out.append(
        (
            "collinear, β≈1, a≈0, T=16384 K=128 (HV=1)",
            adversarial_case(16384, 128, 1, True, "slow", seed=7),
            LOWER_BOUND,
        )
    )
    return out


def measure(inp: dict, kw: dict) -> tuple[dict[str, tuple[float, float, float]], float]:
    """Per order: (output rel RMS, output max abs, state rel RMS); and the fp64 state's RMS."""
    common = dict(
        A_log=inp.get("A_log"),
        dt_bias=inp.get("dt_bias"),
        initial_state=inp.get("initial_state"),
        cu_seqlens=inp.get("cu_seqlens"),
        **kw,
    )
    args = [inp[n] for n in TOKENS]
    ref = recurrent_kda_reference(*args, **common)
    res = {}
    for name, order in ORDERS.items():
        got = chunked_kda_reference(*args, **common, chunk_size=16, sub_chunk=16, operand_dtype=BF16, **order)
        out16 = got.output.to(BF16)
        states = [(got.final_state, ref.final_state)]
        states += [(a, b) for a, b in zip(got.checkpoints, ref.checkpoints, strict=True) if b.numel()]
        finite = bool(torch.isfinite(got.output).all() and torch.isfinite(got.final_state).all())
        res[name] = (
            rel_rms(out16, ref.output) if finite else float("inf"),
            (out16.double() - ref.output).abs().max().item() if finite else float("inf"),
            max(rel_rms(a, b) for a, b in states) if finite else float("inf"),
        )
    return res, ref.final_state.double().pow(2).mean().sqrt().item()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="golden and T=2048 random cases only")
    ap.add_argument("--markdown", action="store_true", help="print the table as markdown")
    args = ap.parse_args()
    names = list(ORDERS)
    rows = []
    for case, inp, kw in cases(args.quick):
        t0 = time.time()
        res, s_rms = measure(inp, kw)
        rows.append((case, res))
        worst = "; ".join(f"{n}: {o:.2e} / {s:.2e}" for n, (o, _, s) in res.items())
        print(f"{case} ({time.time() - t0:.0f} s, state RMS {s_rms:.3g}): {worst}", file=sys.stderr, flush=True)
    if args.markdown:
        print("| case | " + " | ".join(names) + " |")
        print("|---|" + "---|" * len(names))
        for case, res in rows:
            cells = []
            for n in names:
                o, _, s = res[n]
                mark = " ✗" if o > TOL_OUT or s > TOL_STATE else ""
                cells.append(f"{o:.1e} / {s:.1e}{mark}")
            print(f"| {case} | " + " | ".join(cells) + " |")
    else:
        print(f"{'case':42s} {'order':28s} {'out rel RMS':>12s} {'out max abs':>12s} {'state rel RMS':>14s}")
        for case, res in rows:
            for n in names:
                o, a, s = res[n]
                flag = "  over" if o > TOL_OUT or s > TOL_STATE else ""
                print(f"{case:42s} {n:28s} {o:12.2e} {a:12.2e} {s:14.2e}{flag}")


if __name__ == "__main__":
    main()
