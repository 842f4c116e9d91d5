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
    for name, a, e in zip(("dq", "dk", "dv", "dg", "dbeta", "dA_log", "ddt_bias", "dinit"), got, expected):
        assert a.shape == e.shape, name
        assert rel_rms(a, e) < TOL_EXACT, (name, rel_rms(a, e))
