"""Cases of the training ops in every mode (gate x beta x L2 norm) and their fp64 autograd reference; the lower-bound
gate's edge inputs (EDGES); the softplus band of wide blocks (softplus_band). Plain input builders over
kda_ops.reference, shared by the tests (through tests/_training_cases.py: tests/test_training_modes.py,
tests/test_reference_chunked_backward.py, tests/gpu/test_training_cuda.py) and the tools beside this file
(sweep64_smoke.py, sweep64_digest.py). It imports nothing from tests/, so tools and tests share it without a cycle."""

from __future__ import annotations

import itertools

import torch

from kda_ops.reference import recurrent_kda_reference

GATES = ("precomputed", "softplus", "lower_bound")
MODES = list(itertools.product(GATES, (True, False), (True, False)))  # (gate, beta_is_logit, l2)
GRADS = ("dq", "dk", "dv", "dg", "dbeta", "dA_log", "ddt_bias", "dinitial_state")


def edge_pinned(x):  # sigmoid saturated: a = λ on every channel, a 16-token block decays by 16 |λ| (dg ~ 1e-18)
    x["g"] = (x["g"].float() + 30).bfloat16()


def edge_no_decay(x):  # a -> 0: the state never forgets, the chain's errors accumulate
    x["g"] = (x["g"].float() - 30).bfloat16()


def edge_collinear(x):  # near-collinear keys and β ≈ 1: a state of cancelling deltas
    x["k"] = (x["k"][:, :1].float() + 0.05 * x["k"].float()).bfloat16()
    x["beta"] = torch.full_like(x["beta"], 8.0)


def edge_small_qk(x):  # q, k of norm ~1e-3 before the L2 norm
    x["q"], x["k"] = (x["q"].float() * 1e-3).bfloat16(), (x["k"].float() * 1e-3).bfloat16()


# the lower-bound gate's edge inputs, each changing a dict of inputs (q, k, g, beta: [B, T, H(V), K]) in place; pinned,
# the gate's three gradients are ~1e-18 in fp64, below fp32's resolution of the sums that form them (not compared)
EDGES = {"pinned": edge_pinned, "no_decay": edge_no_decay, "small_qk": edge_small_qk, "collinear": edge_collinear}
PINNED_UNCOMPARED = ("dg", "dA_log", "ddt_bias")


def softplus_band(x, chunks):
    """Softplus gate inputs of 400 or -20 (30% / 70%, fixed seeds) in tokens [s + 32, s + 48) of the rows for each
    chunk (s, e) in chunks, clipped to e, in place: a 16-token block whose |γ| span is far past the narrow limit, so the
    Hopper 64-token sweep takes its wide (pairwise) path there. g: [B, T, HV, K]."""
    g = x["g"].clone()
    for s, e in chunks:
        lo, hi = min(s + 32, e), min(s + 48, e)
        if lo < hi:
            u = torch.rand(g[:, lo:hi].shape, generator=torch.Generator().manual_seed(7 + s))
            g[:, lo:hi] = torch.where(u < 0.3, torch.full_like(u, 400.0), torch.full_like(u, -20.0)).to(g.dtype)
    x["g"] = g


def mode_id(m) -> str:
    gate, logit, l2 = m
    return f"{gate}-{'logit' if logit else 'plain'}-{'l2' if l2 else 'nol2'}"


def make_case(mode, *, B=1, T=17, H=1, HV=2, K=16, cu=None, dtype=torch.bfloat16, init=True, dtb=True, seed=0, lb=-5.0):
    """Inputs in the ranges each mode is meant for: a precomputed g is a log-decay (<= 0), a plain β lies in
    (0, 1), and without the L2 norm q, k have norms near 1 (the delta rule is stable for β|k|^2 < 2)."""
    gate, logit, l2 = mode
    gen = torch.Generator().manual_seed(seed)
    if cu is not None:
        B, T = 1, cu[-1]
    N = B if cu is None else len(cu) - 1
    V = K

    def rnd(*s, scale=1.0):
        return torch.randn(*s, generator=gen, dtype=torch.float64) * scale

    qk_scale = 1.0 if l2 else K**-0.5
    x = dict(
        q=rnd(B, T, H, K, scale=qk_scale),
        k=rnd(B, T, H, K, scale=qk_scale),
        v=rnd(B, T, HV, V),
        beta=rnd(B, T, HV) if logit else torch.rand(B, T, HV, generator=gen, dtype=torch.float64) * 0.9 + 0.05,
    )
    if gate == "precomputed":
        x["g"] = -torch.rand(B, T, HV, K, generator=gen, dtype=torch.float64) * 0.5 - 0.01
        x["A_log"] = x["dt_bias"] = None
    else:
        x["g"] = rnd(B, T, HV, K)
        x["A_log"] = torch.rand(HV, generator=gen, dtype=torch.float64) * 0.5 + 0.1
        x["dt_bias"] = rnd(HV, K, scale=0.3) if dtb else None
    x["initial_state"] = rnd(N, HV, V, K, scale=0.3) if init else None
    pdt = torch.float64 if dtype == torch.float64 else torch.float32
    for name in ("q", "k", "v", "g", "beta"):
        x[name] = x[name].to(dtype)
    for name in ("A_log", "dt_bias", "initial_state"):
        if x[name] is not None:
            x[name] = x[name].to(pdt)
    x["cu_seqlens"] = None if cu is None else torch.tensor(cu, dtype=torch.int64)
    kw = dict(
        use_gate_in_kernel=gate != "precomputed",
        lower_bound=lb if gate == "lower_bound" else None,
        beta_is_logit=logit,
        use_qk_l2norm_in_kernel=l2,
    )
    do = torch.randn(B, T, HV, V, generator=gen, dtype=torch.float64).to(dtype)
    dS = torch.randn(N, HV, V, K, generator=gen, dtype=torch.float64).to(pdt)
    return x, kw, do, dS


def reference_grads(x, kw, do, dS):
    """fp64 autograd through the token loop: the eight gradients (None for an absent parameter)."""
    names = ("q", "k", "v", "g", "beta", "A_log", "dt_bias", "initial_state")
    leaves = {n: None if x[n] is None else x[n].detach().double().requires_grad_() for n in names}
    res = recurrent_kda_reference(
        leaves["q"],
        leaves["k"],
        leaves["v"],
        leaves["g"],
        leaves["beta"],
        A_log=leaves["A_log"],
        dt_bias=leaves["dt_bias"],
        initial_state=leaves["initial_state"],
        cu_seqlens=x["cu_seqlens"],
        **kw,
    )
    loss = (res.output * do.double()).sum() + (res.final_state * dS.double()).sum()
    present = [leaves[n] for n in names if leaves[n] is not None]
    got = iter(torch.autograd.grad(loss, present, allow_unused=True))
    out = []
    for n in names:
        if leaves[n] is None:
            out.append(None)
        else:
            gr = next(got)
            out.append(torch.zeros_like(leaves[n]) if gr is None else gr)
    return res.output, res.final_state, out
