"""The chunked backward (kda_ops.reference_chunked_backward: chain over chunks + chunk-parallel gradients)
equals fp64 autograd through the token loop (kda_ops.reference.reference_training_grads), on CPU."""

from __future__ import annotations

import pytest
import torch

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
