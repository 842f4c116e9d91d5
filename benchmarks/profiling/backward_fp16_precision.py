"""Precision of a backward sweep whose every product takes single fp16 operands (power-of-two scales on the
unbounded ones) against today's bf16 hi + lo products and single bf16 ones: the chunked backward reference
(kda_ops/reference_chunked_backward.py, its 64-token factorised form, `operand_mode`) against fp64 autograd through
the token loop, each of the eight gradients as relative RMS (docs/contract.md: <= 1e-2). CPU only:
`python3 benchmarks/profiling/backward_fp16_precision.py [--cases a,b] [--schemes a,b] [--all-grads]`.
Prints one row per case: the worst gradient of each scheme and its name. The "tapes" schemes also store the tapes and
the chain's dS_C rows compactly between the kernels (`tape_storage`, `ds_storage`)."""

from __future__ import annotations

import argparse
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))  # repository root
from benchmarks.profiling.training_cases import (  # noqa: E402
    PINNED_UNCOMPARED,
    edge_collinear,
    edge_no_decay,
    edge_pinned,
    edge_small_qk,
    make_case,
)
from kda_ops.reference import make_inputs, reference_training_grads, rel_rms  # noqa: E402
from kda_ops.reference_chunked_backward import chunked_training_grads  # noqa: E402

GRADS = ("dq", "dk", "dv", "dg", "dbeta", "dA_log", "ddt_bias", "dh0")  # PINNED_UNCOMPARED spells them alike
# the recommended scheme: single fp16 operands, one power-of-two scale per unbounded operand and head, and bf16 hi + lo
# for the two products whose rounding shows in full in dβ = dY · (V - X) of a one-token sequence, where it cancels:
# dR_S = Kr dS_Cᵀ and dY = INVᵀ dR (with either alone dβ of "dβ T=1 seed 101" is 5.5e-3 / 1.7e-2, with both 7e-4)
HILO_PRODUCTS = ("dR_S", "dY")
RECOMMENDED = dict(operand_mode="fp16", scale_granularity="tensor", product_modes={n: "bf16x3" for n in HILO_PRODUCTS})
# and the tapes stored as fp16 under one power-of-two scale per head (half the bytes of fp32); the dS_C rows stay fp32:
# the same cancelling dβ takes their rounding in full through dR_S (fp16 dS_C: 3.3e-2 there, with any products)
RECOMMENDED_TAPES = dict(RECOMMENDED, tape_storage="fp16_head")

SCHEMES: dict[str, dict] = {
    "bf16x3": dict(operand_mode="bf16x3"),
    "bf16": dict(operand_mode="bf16"),
    "fp16 tensor": dict(operand_mode="fp16", scale_granularity="tensor"),
    "fp16 tile": dict(operand_mode="fp16", scale_granularity="tile"),
    "fp16 row": dict(operand_mode="fp16", scale_granularity="row"),
    "fp16 tensor + dR_S, dY x3": RECOMMENDED,
    # the recommended products with the tapes (tape_storage) and the chain's dS_C rows (ds_storage) stored compactly
    # between the kernels
    "recommended, tapes bf16": dict(RECOMMENDED, tape_storage="bf16"),
    "recommended, tapes fp16 per head": RECOMMENDED_TAPES,
    "recommended, tapes fp16 per 16 rows": dict(RECOMMENDED, tape_storage="fp16_rows16"),
    "recommended, tapes and dS fp16 per 16 rows": dict(
        RECOMMENDED, tape_storage="fp16_rows16", ds_storage="fp16_rows16"
    ),
    "bf16x3, tapes and dS fp16 per 16 rows": dict(
        operand_mode="bf16x3", tape_storage="fp16_rows16", ds_storage="fp16_rows16"
    ),
}


def _budget(T, lb, change, seed, K=128):
    """The budget cases of tests/test_reference_chunked_backward.py (B = 1, H = 1, HV = 2, K = V)."""

    def build():
        x = make_inputs(B=1, T=T, H=1, HV=2, K=K, V=K, seed=seed)
        if change is not None:
            change(x)
        gen = torch.Generator().manual_seed(5)
        do = torch.randn(1, T, 2, K, generator=gen).bfloat16()
        dfin = torch.randn(1, 2, K, K, generator=gen) * 0.1
        args = (x["q"], x["k"], x["v"], x["g"], x["beta"], x["A_log"], x["dt_bias"], x["initial_state"], do, dfin)
        return args, lb

    return build


def _heavy_state(x):  # a few initial-state entries 100x larger
    s = x["initial_state"].clone()
    gen = torch.Generator().manual_seed(11)
    idx = torch.randint(0, s[0, 0].numel(), (8,), generator=gen)
    for h in range(s.shape[1]):
        s[0, h].view(-1)[idx] *= 100.0
    x["initial_state"] = s


def _slow_decay(x):  # gates near 0: log-decays ~ -1e-3 .. -1e-2
    x["g"] = (x["g"].float() - 8).bfloat16()


def _beta8(x):  # β logit 8 (β ≈ 1) on random keys
    x["beta"] = torch.full_like(x["beta"], 8.0)


def _one_token(seed):
    """The GPU tier's one-token training inputs (as tests/test_reference_chunked_backward.py's _one_token_case)."""

    def build():
        K = 128
        x = make_inputs(B=1, T=1, H=1, HV=1, K=K, V=K, seed=seed)
        gen = torch.Generator().manual_seed(seed + 1000)
        do = torch.randn(1, 1, 1, K, generator=gen).to(torch.bfloat16)
        dfin = torch.randn(1, 1, K, K, generator=gen) * 0.1
        return (x["q"], x["k"], x["v"], x["g"], x["beta"], x["A_log"], x["dt_bias"], x["initial_state"], do, dfin), -5.0

    return build


def _softplus_k64_t17():
    """The GPU tier's softplus-logit-l2-K64-T17 case (zero initial state) whose dA_log single bf16 R / dY put over
    the limit in the 64-token sweep."""
    label = "softplus-logit-l2-K64-T17"
    x, _, do, dS = make_case(("softplus", True, True), T=17, H=2, HV=2, K=64, seed=len(label), lb=-1.0)
    x["initial_state"].zero_()
    return (x["q"], x["k"], x["v"], x["g"], x["beta"], x["A_log"], x["dt_bias"], x["initial_state"], do, dS), None


CASES = {
    "T=1": _budget(1, -5.0, None, 9),
    "T=65": _budget(65, -5.0, None, 4),
    "T=300": _budget(300, -5.0, None, 4),
    "λ=-1 T=1024": _budget(1024, -1.0, None, 4),
    "gate at the bound": _budget(300, -5.0, edge_pinned, 4),
    "no decay": _budget(300, -5.0, edge_no_decay, 4),
    "near-collinear keys": _budget(300, -5.0, edge_collinear, 4),
    "small-norm q/k": _budget(65, -5.0, edge_small_qk, 4),
    "heavy-tailed S0 T=65": _budget(65, -5.0, _heavy_state, 4),
    "heavy-tailed S0 T=300": _budget(300, -5.0, _heavy_state, 4),
    "slow decay T=300": _budget(300, -5.0, _slow_decay, 4),
    "β logit 8 T=300": _budget(300, -5.0, _beta8, 4),
    "dβ T=1 seed 8": _one_token(8),
    "dβ T=1 seed 101": _one_token(101),
    "softplus K=64 T=17": _softplus_k64_t17,
}


def case_errors(case: str, schemes: dict[str, dict]) -> dict[str, dict[str, float]]:
    """{scheme: {gradient: relative RMS against fp64 autograd}} of one case (the blocked 64-token form)."""
    build = CASES[case]
    args, lb = build()
    _, _, ref = reference_training_grads(*args, lower_bound=lb)
    skip = PINNED_UNCOMPARED if case == "gate at the bound" else ()
    out = {}
    for name, kw in schemes.items():
        got = chunked_training_grads(*args, chunk_size=64, lower_bound=lb, blocked=True, **kw)
        errs = {}
        for gname, a, e in zip(GRADS, got, ref, strict=True):
            if gname in skip:
                continue
            errs[gname] = rel_rms(a.double(), e.double()) if torch.isfinite(a).all() else float("inf")
        out[name] = errs
    return out


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--cases", default=",".join(CASES))
    ap.add_argument("--schemes", default=";".join(SCHEMES), help="names separated by ;")
    ap.add_argument("--all-grads", action="store_true")
    opt = ap.parse_args()
    cases = opt.cases.split(",")
    schemes = {s: SCHEMES[s] for s in opt.schemes.split(";")}
    print(f"| case | {' | '.join(schemes)} |")
    print("|---|" + "---|" * len(schemes))
    worst = {s: 0.0 for s in schemes}
    for case in cases:
        errs = case_errors(case, schemes)
        cells = []
        for s in schemes:
            g, v = max(errs[s].items(), key=lambda kv: kv[1])
            worst[s] = max(worst[s], v)
            cells.append(f"{'**' if v > 1e-2 else ''}{v:.1e} {g}{'**' if v > 1e-2 else ''}")
        print(f"| {case} | {' | '.join(cells)} |", flush=True)
        if opt.all_grads:
            for s in schemes:
                print(f"    {s:18s} " + " ".join(f"{g} {v:.1e}" for g, v in errs[s].items()), flush=True)
    print("| worst | " + " | ".join(f"{worst[s]:.1e}" for s in schemes) + " |")


if __name__ == "__main__":
    main()
