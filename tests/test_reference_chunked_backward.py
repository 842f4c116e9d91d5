"""The chunked backward (kda_ops.reference_chunked_backward: chain over chunks + chunk-parallel gradients)
equals fp64 autograd through the token loop (kda_ops.reference.reference_training_grads), on CPU."""

from __future__ import annotations

import pytest
import torch
from _training_cases import PINNED_UNCOMPARED, edge_collinear, edge_no_decay, edge_pinned, edge_small_qk

from kda_ops.reference import make_inputs, reference_training_grads, rel_rms
from kda_ops.reference_chunked_backward import chunked_training_grads

TOL_EXACT = 1e-10  # fp64 vs fp64 (measured ~1e-14)


@pytest.mark.parametrize(
    "H,HV,B,T,cu,chunk",
    [
        (1, 2, 2, 70, None, 64),  # fixed, a partial last chunk
        (1, 2, 1, 1, [0, 37, 37, 107], 16),  # packed with a zero-length row, 16-token chunks (the CUDA kernel's)
        (2, 4, 1, 1, [0, 5, 69, 199], 64),  # GQA 2, a 5-token sequence, a chunk boundary at 64
    ],
)
def test_chunked_backward_matches_autograd(H, HV, B, T, cu, chunk):
    x = make_inputs(B=B, T=T, H=H, HV=HV, K=32, V=32, cu_seqlens=cu, seed=2)
    N = x["initial_state"].shape[0]
    Bq, Tq = x["q"].shape[:2]
    gen = torch.Generator().manual_seed(3)
    do = torch.randn(Bq, Tq, HV, 32, generator=gen).bfloat16()
    dfin = torch.randn(N, HV, 32, 32, generator=gen) * 0.1
    args = (x["q"], x["k"], x["v"], x["g"], x["beta"], x["A_log"], x["dt_bias"], x["initial_state"], do, dfin)
    _, _, expected = reference_training_grads(*args, cu_seqlens=x.get("cu_seqlens"))
    got = chunked_training_grads(*args, cu_seqlens=x.get("cu_seqlens"), chunk_size=chunk)
    for name, a, e in zip(("dq", "dk", "dv", "dg", "dbeta", "dA_log", "ddt_bias", "dinit"), got, expected, strict=True):
        assert a.shape == e.shape, name
        assert rel_rms(a, e) < TOL_EXACT, (name, rel_rms(a, e))


def test_segment_affine_maps_compose_to_the_chain():
    """dS_start of a segment = dS_end 𝔄 + 𝔅 (segment_affine_map), and composing the segments' maps gives
    the chunk-by-chunk chain: the algebra the CUDA backward's segment split relies on (weak decay, so 𝔄
    does not vanish)."""
    from kda_ops.reference import l2_normalize
    from kda_ops.reference_chunked_backward import chain_step, chunk_recompute, segment_affine_map

    gen = torch.Generator().manual_seed(0)
    HV, K, c, nch = 2, 16, 16, 6

    def rnd(*s):
        return torch.randn(*s, generator=gen, dtype=torch.float64)

    q, k = l2_normalize(rnd(HV, c * nch, K)) * 0.25, l2_normalize(rnd(HV, c * nch, K))
    v, dO = rnd(HV, c * nch, K), rnd(HV, c * nch, K)
    a, beta = -0.05 * torch.sigmoid(rnd(HV, c * nch, K)), torch.sigmoid(rnd(HV, c * nch))
    S = rnd(HV, K, K) * 0.1
    fs, bs, ds = [], [], []
    for i in range(nch):
        sl = slice(i * c, (i + 1) * c)
        f = chunk_recompute(S, q[:, sl], k[:, sl], v[:, sl], a[:, sl], beta[:, sl])
        fs.append(f), bs.append(beta[:, sl]), ds.append(dO[:, sl])
        S = S * f["gC"][:, None, :] + f["R"].transpose(1, 2) @ f["Kr"]
    dfin = rnd(HV, K, K)
    chain = dfin
    for i in reversed(range(nch)):
        chain = chain_step(fs[i], bs[i], ds[i], chain)
    composed = dfin
    for s0, s1 in reversed([(0, 2), (2, 3), (3, 6)]):
        A_map, B_map = segment_affine_map(fs[s0:s1], bs[s0:s1], ds[s0:s1])
        composed = composed @ A_map + B_map
    assert (chain - dfin).abs().max() > 0.1  # the maps are not trivial
    assert rel_rms(composed, chain) < TOL_EXACT


BUDGET_CASES = [  # name, T, λ, input change, seed
    ("T=1", 1, -5.0, None, 9),
    ("T=65", 65, -5.0, None, 4),
    ("T=300", 300, -5.0, None, 4),
    ("λ=-1 T=1024", 1024, -1.0, None, 4),
    ("gate at the bound", 300, -5.0, edge_pinned, 4),
    ("no decay", 300, -5.0, edge_no_decay, 4),
    ("near-collinear keys", 300, -5.0, edge_collinear, 4),
    ("small-norm q/k", 65, -5.0, edge_small_qk, 4),
]


def test_operand_precision_budget():
    """The error budget of a 64-token tensor-core backward: the chunked backward with its products' operands
    rounded (bf16 for the products with the state and its gradient; then every product bf16) against fp64
    autograd through the token loop, K = V = 128, within the gradient tolerance of docs/contract.md (1e-2
    relative RMS) on every case, and the rounding really applied (errors well above fp32's). Run with -s
    for the table."""
    names = ("dq", "dk", "dv", "dg", "dbeta", "dA_log", "ddt_bias", "dinit")
    state = ("X", "dR_S", "dKr", "dKp", "dQp", "dS0", "S")
    configs = {"bf16 state products": dict(gemm_dtypes={n: torch.bfloat16 for n in state}),
               "all products bf16": dict(operand_dtype=torch.bfloat16),
               # the factorised 64-token form, its off-diagonal pair-term blocks ("P") exact: in bf16 they put
               # ddt_bias at 1.3e-2 (T=65), over the limit
               "all bf16 but P, blocked": dict(operand_dtype=torch.bfloat16, gemm_dtypes={"P": None},
                                               blocked=True)}  # fmt: skip
    worst = {c: 0.0 for c in configs}
    for case, T, lb, change, seed in BUDGET_CASES:
        x = make_inputs(B=1, T=T, H=1, HV=2, K=128, V=128, seed=seed)
        if change is not None:
            change(x)
        gen = torch.Generator().manual_seed(5)
        do = torch.randn(1, T, 2, 128, generator=gen).bfloat16()
        dfin = torch.randn(1, 2, 128, 128, generator=gen) * 0.1
        args = (x["q"], x["k"], x["v"], x["g"], x["beta"], x["A_log"], x["dt_bias"], x["initial_state"], do, dfin)
        _, _, ref = reference_training_grads(*args, lower_bound=lb)
        for cname, kw in configs.items():
            got = chunked_training_grads(*args, chunk_size=64, lower_bound=lb, **kw)
            errs = {}
            for name, a, e in zip(names, got, ref, strict=True):
                assert torch.isfinite(a).all(), (case, cname, name)
                if change is edge_pinned and name in PINNED_UNCOMPARED:
                    continue
                errs[name] = rel_rms(a.double(), e.double())
            print(f"{case:22s} {cname:20s} " + " ".join(f"{n} {v:.1e}" for n, v in errs.items()))
            for name, err in errs.items():
                assert err <= 1e-2, (case, cname, name, err)
            assert errs["dv"] > 1e-5, (case, cname, "no rounding applied?")
            worst[cname] = max(worst[cname], max(errs.values()))
    print("worst:", {c: f"{w:.1e}" for c, w in worst.items()})


def _chunk_case(c, kind, seed=0, HV=2, K=32):
    """One chunk's arguments of chunk_backward in fp64: q, k normalised, a log-decay of the kind."""
    from kda_ops.reference import l2_normalize

    gen = torch.Generator().manual_seed(seed)

    def rnd(*s):
        return torch.randn(*s, generator=gen, dtype=torch.float64)

    q, k = l2_normalize(rnd(HV, c, K)) * K**-0.5, l2_normalize(rnd(HV, c, K))
    v, dO = rnd(HV, c, K), rnd(HV, c, K)
    if kind == "lower bound":
        a = -5 * torch.sigmoid(rnd(HV, c, K))
    elif kind == "wide":  # -1e-3 decays with -1000 ones among them (softplus / precomputed gates allow both)
        a = -torch.rand(HV, c, K, generator=gen, dtype=torch.float64) * 1e-3
        a = torch.where(torch.rand(HV, c, K, generator=gen, dtype=torch.float64) < 0.1, torch.full_like(a, -1e3), a)
    else:
        a = torch.zeros(HV, c, K, dtype=torch.float64)
    beta = torch.sigmoid(rnd(HV, c))
    return [rnd(HV, K, K) * 0.3, rnd(HV, K, K) * 0.3, q, k, v, a, beta, dO]


@pytest.mark.parametrize("c", [1, 17, 40, 64])
@pytest.mark.parametrize("kind", ["lower bound", "wide", "no decay"])
def test_blocked_chunk_backward(c, kind):
    """chunk_backward_blocked (the factorised form of a 64-token sweep: within-block prefixes and suffixes, the
    decay of the blocks between) equals chunk_backward in fp64, and in fp32 stays within 1e-4 of it, also where
    -1000 decays sit among -1e-3 ones; there the chunk-wide prefixes of chunk_backward lose more in fp32 (the
    differences of large prefixes)."""
    from kda_ops.reference_chunked_backward import chunk_backward, chunk_backward_blocked

    args = _chunk_case(c, kind)
    ref = chunk_backward(*args)
    got = chunk_backward_blocked(*args)
    for n in ref:
        assert rel_rms(got[n], ref[n]) < TOL_EXACT, (n, rel_rms(got[n], ref[n]))
    a32 = [x.float() for x in args]
    b32, n32 = chunk_backward_blocked(*a32), chunk_backward(*a32)
    worst = max(rel_rms(b32[n], ref[n]) for n in ref)
    assert worst < 1e-4, worst
    if kind == "wide" and c == 64:
        assert worst < max(rel_rms(n32[n], ref[n]) for n in ref) / 3


def test_dbeta_at_one_token_needs_kr_dsT_near_fp32():
    """dβ of a one-token sequence is dY · (V - X) with dY = dR = Mqkᵀ dO + Kr dS_Cᵀ: a dot product that can cancel,
    so the rounding of the product with the chain gradient shows there in full. On the inputs of the GPU tier's
    T=1 training case: bf16 operands for dR_S = Kr dS_Cᵀ alone put dβ at ~2.2e-2, over the 1e-2 limit; tf32 (the
    CUDA sweep's today) at ~7.8e-3, inside it with little margin; with dR_S exact, every other product of the state
    in bf16 keeps it near 1.2e-3. So a 64-token sweep runs dR_S near fp32 (3xTF32, or split bf16 operands), whatever
    the budget cases above allow."""
    args = _one_token_case(8)
    ref = reference_training_grads(*args, lower_bound=-5.0)[2]

    def dbeta_err(gemm_dtypes):
        got = chunked_training_grads(*args, chunk_size=64, lower_bound=-5.0, gemm_dtypes=gemm_dtypes)
        return rel_rms(got[4].double(), ref[4].double())

    assert dbeta_err({"dR_S": torch.bfloat16}) > 1e-2
    assert 3e-3 < dbeta_err({"dR_S": "tf32"}) < 1e-2
    assert dbeta_err({n: torch.bfloat16 for n in ("X", "dKr", "dKp", "dQp", "dS0", "S")}) < 2e-3


def _one_token_case(seed):
    """The GPU tier's one-token training inputs (tests/gpu/test_training_cuda.py, _case_inputs) for `seed`."""
    K = 128
    x = make_inputs(B=1, T=1, H=1, HV=1, K=K, V=K, seed=seed)
    gen = torch.Generator().manual_seed(seed + 1000)
    do = torch.randn(1, 1, 1, K, generator=gen).to(torch.bfloat16)
    dfin = torch.randn(1, 1, K, K, generator=gen) * 0.1
    return (x["q"], x["k"], x["v"], x["g"], x["beta"], x["A_log"], x["dt_bias"], x["initial_state"], do, dfin)


def test_dbeta_one_token_with_the_sweeps_precisions():
    """The CUDA sweep's operand precisions emulated (tf32 for its tensor-core products, bf16 for the chain's): on a
    one-token sequence whose dβ cancels (seed 101: dβ ~1.9e-3 against terms ~1e-1) dβ is ~5e-2 off, over the 1e-2
    limit, and 3xTF32-like (exact) operands for the four products that feed dβ = dY · (V - X) (X = K⁺ S_0ᵀ,
    dR_S = Kr dS_Cᵀ, Mqkᵀ dO, INVᵀ dR) bring it to fp32's ~1e-5. The GPU tier's test_dbeta_one_token_cancelling
    holds the kernel to this case."""
    args = _one_token_case(101)
    ref = reference_training_grads(*args, lower_bound=-5.0)[2]
    sweep = {n: "tf32" for n in ("X", "dR_S", "dKr", "dKp", "dQp", "dR_mqk", "dY", "dA", "dM")}
    today = {**sweep, "dS0": torch.bfloat16, "S": torch.bfloat16}

    def dbeta_err(gemm_dtypes):
        got = chunked_training_grads(*args, chunk_size=64, lower_bound=-5.0, gemm_dtypes=gemm_dtypes)
        return rel_rms(got[4].double(), ref[4].double())

    assert dbeta_err(today) > 2e-2
    assert dbeta_err({**today, "X": None, "dR_S": None, "dR_mqk": None, "dY": None}) < 1e-4
