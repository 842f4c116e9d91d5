"""Both CUDA backward sweeps (KDA_TRAINING_SWEEP=wgmma64: the Hopper 64-token sweep; sub16: the 16-token one) on a
set of training cases, each of the eight gradients of recurrent_kda_backward as relative RMS against fp64 autograd
through the token loop (kda_ops/reference.py), and whether the two sweeps' results are finite. A debugging aid on a
Hopper GPU (the GPU tier holds the tolerances): `python3 benchmarks/profiling/sweep64_smoke.py [--quick]`."""

from __future__ import annotations

import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))  # repository root
import kda_ops  # noqa: E402
from benchmarks.profiling.training_cases import (  # noqa: E402
    EDGES,
    GRADS,
    PINNED_UNCOMPARED,
    make_case,
    reference_grads,
    softplus_band,
)
from kda_ops.reference import rel_rms  # noqa: E402

NAMES = ("q", "k", "v", "g", "beta", "A_log", "dt_bias", "initial_state")

# (label, mode, T or None, packed lengths or None, H, HV, K)
CASES = [
    ("lb-T1", ("lower_bound", True, True), 1, None, 1, 1, 128),
    ("lb-T17", ("lower_bound", True, True), 17, None, 2, 2, 128),
    ("lb-T64", ("lower_bound", True, True), 64, None, 2, 2, 128),
    ("lb-T65", ("lower_bound", True, True), 65, None, 2, 2, 128),
    ("lb-T300-gqa2", ("lower_bound", True, True), 300, None, 1, 2, 128),
    ("lb-packed", ("lower_bound", False, False), None, [37, 0, 130, 64], 2, 2, 128),
    ("softplus-T200", ("softplus", True, True), 200, None, 2, 2, 128),
    ("precomputed-T150-nol2", ("precomputed", False, False), 150, None, 2, 4, 128),
    ("lb-K64-T100", ("lower_bound", True, True), 100, None, 2, 2, 64),
    # edges: gates pinned at the bound (each 16-token block decays by e^{-80}; the gate's three gradients are ~1e-18
    # in fp64, so they are left out), and softplus gates of ~-600 beside ~-3e-9 in tokens 32-47 (wide blocks)
    ("lb-pinned-T130", ("lower_bound", True, True), 130, None, 1, 2, 128),
    ("softplus-band-T100", ("softplus", True, True), 100, None, 1, 2, 128),
]


def edit_case(label, x):
    """The edge cases' inputs (training_cases.py's pinned gates and its softplus band of wide blocks); the names
    of gradients not compared."""
    if label.startswith("lb-pinned"):
        EDGES["pinned"](x)
        return set(PINNED_UNCOMPARED)
    if label.startswith("softplus-band"):
        softplus_band(x, [(0, x["g"].shape[1])])
    return set()


def grads_of(x, kw, do, dS, sweep):
    os.environ["KDA_TRAINING_SWEEP"] = sweep
    c = {n: None if x[n] is None else x[n].cuda() for n in NAMES}
    cu = None if x["cu_seqlens"] is None else x["cu_seqlens"].cuda()
    g = kda_ops.recurrent_kda_backward(*(c[n] for n in NAMES), do.cuda(), dS.cuda(), cu_seqlens=cu, **kw)
    torch.cuda.synchronize()
    return list(g)


def main() -> None:
    quick = "--quick" in sys.argv
    for label, mode, T, lengths, H, HV, K in CASES[:4] if quick else CASES:
        cu = None
        if lengths is not None:
            cu = [0]
            for n in lengths:
                cu.append(cu[-1] + n)
        x, kw, do, dS = make_case(mode, T=T if cu is None else 1, cu=cu, H=H, HV=HV, K=K, seed=len(label))
        skip = edit_case(label, x)
        _, _, ref = reference_grads(x, kw, do, dS)
        for sweep in ("wgmma64", "sub16"):
            try:
                g = grads_of(x, kw, do, dS, sweep)
            except Exception as e:  # noqa: BLE001
                print(f"{label:24s} {sweep:8s} ERROR {e}")
                continue
            parts = []
            for name, a, r in zip(GRADS, g, ref, strict=True):
                if r is None or a.numel() == 0 or name in skip:
                    continue
                fin = bool(torch.isfinite(a.float()).all())
                parts.append(f"{name}={rel_rms(a.double().cpu(), r):.1e}{'' if fin else '(NaN)'}")
            print(f"{label:24s} {sweep:8s} " + " ".join(parts), flush=True)


if __name__ == "__main__":
    main()
