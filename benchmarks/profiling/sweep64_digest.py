"""Digest of the Hopper 64-token sweep's eight gradients (recurrent_kda_backward with KDA_TRAINING_SWEEP=wgmma64) on
four cases of many tasks per CTA: packed with zero-length rows and GQA (lower-bound gate), softplus T=4096 with GQA,
precomputed gate packed, and softplus packed with a band of wide blocks in every chunk; per case a hash of each
gradient's bytes, the relative RMS against the 16-token sweep, and which elements differ from the previous run's
gradients on this machine (saved under $TMPDIR, default /tmp). For an A/B of variants that should keep the arithmetic,
run it after each variant's build: "bit-identical" after each.

    python3 benchmarks/profiling/sweep64_digest.py          (needs a Hopper GPU; ~10 s)
"""

from __future__ import annotations

import hashlib
import os
import sys
import tempfile

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))  # repository root
import kda_ops  # noqa: E402
from benchmarks.profiling.training_cases import make_case, softplus_band  # noqa: E402
from kda_ops.reference import rel_rms  # noqa: E402

NAMES = ("q", "k", "v", "g", "beta", "A_log", "dt_bias", "initial_state")
# (label, mode, sequence lengths, H, HV)
CASES = [
    ("lb-packed7", ("lower_bound", True, True), [1300, 0, 547, 2048, 963, 271, 3063], 4, 8),
    ("softplus-T4096", ("softplus", True, True), [4096], 4, 8),
    ("precomp-packed", ("precomputed", False, False), [700, 0, 0, 1500, 65], 8, 8),
    ("softplus-band", ("softplus", True, True), [1000, 0, 700], 4, 8),
]
# the "-band" cases: training_cases.py's softplus band in every 64-token chunk of the packed rows, so that many
# tasks have a wide block (the pairwise pair terms)


def grads(x, kw, do, dS, cu, sweep):
    os.environ["KDA_TRAINING_SWEEP"] = sweep
    c = {n: None if x[n] is None else x[n].cuda() for n in NAMES}
    g = kda_ops.recurrent_kda_backward(*(c[n] for n in NAMES), do.cuda(), dS.cuda(), cu_seqlens=cu, **kw)
    torch.cuda.synchronize()
    return g


def main() -> None:
    for label, mode, lengths, H, HV in CASES:
        cu = [0]
        for n in lengths:
            cu.append(cu[-1] + n)
        x, kw, do, dS = make_case(mode, T=1, cu=cu, H=H, HV=HV, K=128, seed=3)
        if label.endswith("-band"):
            softplus_band(x, [(c0, e) for s, e in zip(cu[:-1], cu[1:], strict=True) for c0 in range(s, e, 64)])
        cut = torch.tensor(cu, device="cuda", dtype=torch.int32)
        a = grads(x, kw, do, dS, cut, "wgmma64")
        b = grads(x, kw, do, dS, cut, "sub16")
        whole, per, errs = hashlib.sha1(), [], []
        cur = {}
        for n, u, w in zip(NAMES, a, b, strict=True):
            if u is None:
                continue
            by = u.detach().contiguous().view(torch.uint8).cpu().numpy().tobytes()
            whole.update(by)
            per.append(f"{n}:{hashlib.sha1(by).hexdigest()[:6]}")
            errs.append(f"{n}={rel_rms(u.double().cpu(), w.double().cpu()):.1e}")
            cur[n] = u.detach().cpu()
        print(f"{label:16s} digest {whole.hexdigest()[:16]} [{' '.join(per)}]  vs sub16: {' '.join(errs)}", flush=True)
        prev = os.path.join(tempfile.gettempdir(), f"sweep64_digest_{label}.pt")
        if os.path.exists(prev):
            old = torch.load(prev)
            diffs = []
            for n, u in cur.items():
                d = (u.double() - old[n].double()).abs()
                nz = (d > 0) | (u.isnan() != old[n].isnan())
                if nz.any():
                    fin = d[~d.isnan()]
                    big = float(fin.max()) if fin.numel() else float("nan")
                    diffs.append(f"{n}: {int(nz.sum())} differ, max {big:.2e}, first at {nz.nonzero()[0].tolist()}")
            print(f"{label:16s} vs the previous run: " + ("; ".join(diffs) if diffs else "bit-identical"), flush=True)
        torch.save(cur, prev)


if __name__ == "__main__":
    main()
