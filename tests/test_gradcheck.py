"""fp64 torch.autograd.gradcheck of kda_ops.kda over all eight inputs (docs/contract.md "API", "Gradients"), CPU.

The CPU implementation takes fp64 token tensors (fp64 math end to end) and any K, V, so finite
differences are meaningful; shapes are tiny (T <= 5, K = V = 8) to keep each check around a second.
Both outputs are checked: L = <o, do> + <final_state, dS>.
"""

from __future__ import annotations

import pytest
import torch
from conftest import needs_cpu_op

import kda_ops

K = V = 8
pytestmark = needs_cpu_op("recurrent_kda_training_forward", "recurrent_kda_training_backward")


def leaves(B, T, H, HV, N, seed):
    gen = torch.Generator().manual_seed(seed)

    def r(*s, scale=1.0):
        return (torch.randn(*s, generator=gen, dtype=torch.float64) * scale).requires_grad_()

    return [
        r(B, T, H, K),
        r(B, T, H, K),
        r(B, T, HV, V),
        r(B, T, HV, K),
        r(B, T, HV),
        (torch.rand(HV, generator=gen, dtype=torch.float64) * 0.5 + 0.1).requires_grad_(),
        r(HV, K, scale=0.3),
        r(N, HV, V, K, scale=0.3),
    ]


def _fn(cu, scale, lb):
    def f(*xs):
        o, fs = kda_ops.kda(*xs, cu_seqlens=cu, scale=scale, lower_bound=lb, output_final_state=True)
        return o, fs

    return f


@pytest.mark.parametrize("T", [1, 5])
def test_gradcheck_fixed(T):
    xs = leaves(B=2, T=T, H=1, HV=1, N=2, seed=T)
    assert torch.autograd.gradcheck(_fn(None, None, -5.0), xs, eps=1e-6, atol=1e-6, rtol=1e-4)


def test_gradcheck_packed_gqa():
    """Packed with a zero-length sequence, GQA (HV = 2 H: dq/dk summed over the group), free scale and λ."""
    cu = torch.tensor([0, 2, 2, 5], dtype=torch.int64)
    xs = leaves(B=1, T=5, H=1, HV=2, N=3, seed=7)
    assert torch.autograd.gradcheck(_fn(cu, 0.4, -2.5), xs, eps=1e-6, atol=1e-6, rtol=1e-4)


def test_gradcheck_recurrent_kda_backward_matches_autograd():
    """recurrent_kda_backward (no context) equals the autograd gradients bit for bit in fp64."""
    cu = torch.tensor([0, 3, 5], dtype=torch.int64)
    xs = leaves(B=1, T=5, H=1, HV=2, N=2, seed=9)
    o, fs = kda_ops.kda(*xs, cu_seqlens=cu, output_final_state=True)
    do, dS = torch.randn_like(o), torch.randn_like(fs)
    auto = torch.autograd.grad((o, fs), xs, (do, dS))
    manual = kda_ops.recurrent_kda_backward(*[x.detach() for x in xs], do, dS, cu_seqlens=cu)
    for a, m in zip(auto, manual, strict=True):
        torch.testing.assert_close(m, a, rtol=1e-10, atol=1e-12)
