"""Quick error table of the chunked CUDA prefill against the fp64 token loop (device diagnostics).

One line per case: output rel RMS / max abs, final-state rel RMS, and whether results are finite: localises a
kernel bug before the full GPU tier runs.

  python3 benchmarks/profiling/chunked_debug.py
"""

from __future__ import annotations

import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))  # repository root

import kda_ops  # noqa: E402
from kda_ops.reference import recurrent_kda_reference, rel_rms  # noqa: E402


def case(
    name,
    T=16,
    B=1,
    H=1,
    HV=1,
    gate="lower_bound",
    h0=False,
    l2=True,
    logit=True,
    lens=None,
    seed=0,
    pool_dtype=torch.float32,
    backend="chunked",
):
    gen = torch.Generator().manual_seed(seed)
    K = 128
    if lens is not None:
        B, T = 1, sum(lens)
    r = lambda *s: torch.randn(*s, generator=gen)  # noqa: E731
    q, k, v = r(B, T, H, K), r(B, T, H, K), r(B, T, HV, K)
    if not l2:
        q, k = q / K**0.5, k / K**0.5
    g = r(B, T, HV, K)
    if gate == "precomputed":
        g = -torch.nn.functional.softplus(g)
    beta = r(B, T, HV) if logit else torch.rand(B, T, HV)
    N = B if lens is None else len(lens)
    kw = dict(use_qk_l2norm_in_kernel=l2, beta_is_logit=logit)
    if gate != "precomputed":
        kw.update(
            use_gate_in_kernel=True,
            A_log=torch.rand(HV) * 0.5,
            dt_bias=r(HV, K) * 0.1,
            lower_bound=-5.0 if gate == "lower_bound" else None,
        )
    cu = None if lens is None else torch.tensor([0] + torch.tensor(lens).cumsum(0).tolist())
    pool = (r(N, HV, K, K) * 0.1) if h0 else torch.zeros(N, HV, K, K)
    pool = pool.to(pool_dtype).float()
    tok = [x.to(torch.bfloat16) for x in (q, k, v, g, beta)]
    ref = recurrent_kda_reference(
        *[x.double() for x in tok],
        initial_state=pool.double(),
        cu_seqlens=cu,
        **{a: (b.double() if torch.is_tensor(b) else b) for a, b in kw.items()},
    )
    dev = [x.cuda() for x in tok]
    pool_d = pool.to(pool_dtype).cuda()
    o, s = kda_ops.recurrent_kda(
        *dev,
        initial_state=pool_d,
        output_final_state=True,
        cu_seqlens=None if cu is None else cu.cuda(),
        backend=backend,
        **{a: (b.cuda() if torch.is_tensor(b) else b) for a, b in kw.items()},
    )
    torch.cuda.synchronize()
    o, s = o.double().cpu(), s.double().cpu()
    ro, rs = ref.output, ref.final_state
    fin = bool(torch.isfinite(o).all() and torch.isfinite(s).all())
    eo, ma, es = rel_rms(o, ro), (o - ro).abs().max().item(), rel_rms(s, rs)
    ok = fin and eo <= 5e-3 and ma <= 2e-2 and es <= (1e-3 if pool_dtype == torch.float32 else 1e-2)
    print(f"{'ok  ' if ok else 'FAIL'} {name:38s} out {eo:.2e} max {ma:.2e} state {es:.2e} finite {fin}", flush=True)
    return ok


def main() -> int:
    cases = [
        ("T=1 lower", dict(T=1)),
        ("T=16 lower zero-state", dict(T=16)),
        ("T=16 lower h0", dict(T=16, h0=True)),
        ("T=17 lower h0", dict(T=17, h0=True)),
        ("T=64 softplus h0", dict(T=64, gate="softplus", h0=True)),
        ("T=64 precomputed h0", dict(T=64, gate="precomputed", h0=True)),
        ("T=300 lower h0 HV=2", dict(T=300, HV=2, h0=True)),
        ("T=300 GQA H=1 HV=2 plain beta no l2", dict(T=300, HV=2, logit=False, l2=False, h0=True)),
        ("packed [0,1,300,16,0,77,1]", dict(lens=[0, 1, 300, 16, 0, 77, 1], HV=2, h0=True)),
        ("T=1000 bf16 pool", dict(T=1000, h0=True, pool_dtype=torch.bfloat16)),
        ("T=4097 lower h0", dict(T=4097, h0=True)),
        ("T=300 many heads (VB=64 grid)", dict(T=300, H=4, HV=8, h0=True)),
    ]
    bad = 0
    for name, kw in cases:
        try:
            bad += not case(name, **kw)
        except Exception as e:  # noqa: BLE001
            print(f"ERR  {name}: {type(e).__name__}: {str(e)[:300]}", flush=True)
            bad += 1
    print(f"chunked_debug: {len(cases) - bad}/{len(cases)} ok")
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
