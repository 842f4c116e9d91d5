"""torch.library.opcheck of every torch.ops.kda op on CPU (docs/contract.md "API"): schema (declared mutations),
fake kernel vs the real one (shapes, dtypes, strides), autograd registration, and AOT dispatch with
dynamic shapes. Small shapes keep it within seconds.
"""

from __future__ import annotations

import pytest
import torch
from conftest import inputs, needs_cpu_op

import kda_ops

K = V = 32
OPS = torch.ops.kda


def recurrent_args(mode: str):
    """Positional args of kda::recurrent_kda for one mode."""
    if mode == "pool_decode":
        x = inputs(B=3, T=1, H=1, HV=2, K=K, V=V, N_pool=4)
        cu, idx, acc, S, n_ck = None, torch.tensor([3, -1, 0], dtype=torch.int32), None, 0, 0
    elif mode == "packed_checkpoints":
        x = inputs(H=2, HV=4, K=K, V=V, cu_seqlens=[0, 20, 20, 37], N_pool=3)
        cu, idx, acc, S, n_ck = x["cu_seqlens"], None, None, 0, 16
    elif mode == "packed_zero_uncovered":
        # A broken, non-monotone cu_seqlens (no overlaps: the result stays deterministic) with zero_uncovered:
        # tokens 10..24 belong to no sequence and must come out zero, so every element is written.
        x = inputs(H=2, HV=4, K=K, V=V, cu_seqlens=[0, 20, 20, 37], N_pool=3)
        cu, idx, acc, S, n_ck = torch.tensor([25, 37, 0, 10], dtype=torch.int64), None, None, 0, 0
    elif mode == "spec_decode":
        x = inputs(B=2, T=3, H=1, HV=2, K=K, V=V, N_pool=6)
        cu, S, n_ck = None, 2, 0
        idx = torch.arange(6, dtype=torch.int32).view(2, 3)
        acc = torch.tensor([2, 1], dtype=torch.int32)
    else:
        raise AssertionError(mode)
    out = torch.empty_like(x["v"])
    ck = starts = None
    if n_ck:
        starts = torch.tensor([0, 2, 2, 4], dtype=torch.int64)
        ck = torch.zeros(4, x["v"].shape[2], V, K)
    return (
        x["q"],
        x["k"],
        x["v"],
        x["g"],
        x["beta"],
        x["A_log"],
        x["dt_bias"],
        x["initial_state"],
        None,
        None,
        cu,
        idx,
        acc,
        None,
        out,
        None,
        ck,
        starts,
        None,
        0.2,
        2,
        -5.0,
        True,
        True,
        S,
        n_ck,
        0,
        mode == "packed_zero_uncovered",
    )


@pytest.mark.parametrize("mode", ["pool_decode", "packed_checkpoints", "packed_zero_uncovered", "spec_decode"])
def test_opcheck_recurrent_kda(mode):
    torch.library.opcheck(OPS.recurrent_kda.default, recurrent_args(mode))


def decode_args(full: tuple, verify: bool = False) -> tuple:
    """kda::recurrent_kda_decode's arguments for a pool_decode / spec_decode call of recurrent_args."""
    q, k, v, g, beta, A, dtb, pool, _, _, _, idx, acc, _, out = full[:15]
    mode = 2 | 4 | 8 | (0 << 8) | (full[24] << 16) | (16 if verify else 0)  # lower bound, L2, logit, auto
    return q, k, v, g, beta, A, dtb, pool, idx, acc, out, full[19], full[21], mode


@pytest.mark.parametrize("mode", ["pool_decode", "spec_decode"])
@pytest.mark.parametrize("verify", [False, True])
def test_opcheck_recurrent_kda_decode(mode, verify):
    """The short-schema decode op: opcheck, and the same outputs and pool as recurrent_kda's full schema."""
    full = recurrent_args(mode)
    torch.library.opcheck(OPS.recurrent_kda_decode.default, decode_args(full, verify))
    a = [t.clone() if isinstance(t, torch.Tensor) else t for t in full]
    b = [t.clone() if isinstance(t, torch.Tensor) else t for t in full]
    OPS.recurrent_kda.default(*a, verify)  # a ends with zero_uncovered (False here)
    OPS.recurrent_kda_decode.default(*decode_args(tuple(b), verify))
    assert torch.equal(a[14], b[14]) and torch.equal(a[7], b[7])
    assert verify or not torch.equal(a[7], full[7])  # the pool was written (the comparison is not vacuous)


def test_opcheck_recurrent_kda_no_pool_final_state():
    x = inputs(B=2, T=5, H=1, HV=2, K=K, V=V)
    args = (
        x["q"],
        x["k"],
        x["v"],
        x["g"],
        x["beta"],
        None,
        None,
        None,
        None,
        None,
        None,
        None,
        None,
        None,
        torch.empty_like(x["v"]),
        torch.zeros(2, 2, V, K),
        None,
        None,
        None,
        0.2,
        0,
        0.0,
        False,
        False,
        0,
        0,
        2,
    )
    torch.library.opcheck(OPS.recurrent_kda.default, args)


def training_args(packed: bool, requires_grad: bool = False, dtype=torch.bfloat16):
    pdt = torch.float64 if dtype == torch.float64 else torch.float32
    if packed:
        x = inputs(H=1, HV=2, K=K, V=V, cu_seqlens=[0, 9, 9, 75], dtype=dtype)
        N = 3
    else:
        x = inputs(B=2, T=70, H=1, HV=2, K=K, V=V, dtype=dtype)
        N = 2
    h0 = torch.randn(N, 2, V, K, dtype=pdt) * 0.1
    ts = [x["q"], x["k"], x["v"], x["g"], x["beta"], x["A_log"].to(pdt), x["dt_bias"].to(pdt), h0]
    if requires_grad:
        ts = [t.detach().clone().requires_grad_() for t in ts]
    return (*ts, x.get("cu_seqlens"), 0.15, -4.0)


@needs_cpu_op("recurrent_kda_training_forward", "recurrent_kda_training_backward")
@pytest.mark.parametrize("packed", [False, True])
@pytest.mark.parametrize("requires_grad", [False, True])
def test_opcheck_training_forward(packed, requires_grad):
    torch.library.opcheck(OPS.recurrent_kda_training_forward.default, training_args(packed, requires_grad))


@needs_cpu_op("recurrent_kda_training_forward", "recurrent_kda_training_backward")
def test_opcheck_training_forward_fp64_grad():
    torch.library.opcheck(OPS.recurrent_kda_training_forward.default, training_args(True, True, dtype=torch.float64))


@needs_cpu_op("recurrent_kda_training_forward", "recurrent_kda_training_backward")
@pytest.mark.parametrize("packed", [False, True])
@pytest.mark.parametrize("with_dfinal", [False, True])
def test_opcheck_training_backward(packed, with_dfinal):
    args = training_args(packed)
    out, fs, tapes, starts = OPS.recurrent_kda_training_forward(*args)
    q, k, v, g, beta, A_log, dt_bias, h0, cu, scale, lb = args
    do = torch.randn_like(out)
    dfs = torch.randn_like(fs) if with_dfinal else None
    torch.library.opcheck(
        OPS.recurrent_kda_training_backward.default,
        (q, k, v, g, beta, A_log, dt_bias, tapes, starts, h0, cu, do, dfs, scale, lb),
    )


@needs_cpu_op("recurrent_kda_backward")
@pytest.mark.parametrize("packed", [False, True])
def test_opcheck_recurrent_kda_backward(packed):
    q, k, v, g, beta, A_log, dt_bias, h0, cu, scale, lb = training_args(packed)
    do = torch.randn(v.shape).to(v.dtype)
    dfs = torch.randn_like(h0)
    torch.library.opcheck(
        OPS.recurrent_kda_backward.default, (q, k, v, g, beta, A_log, dt_bias, h0, cu, do, dfs, scale, lb)
    )


def test_fake_shapes_training():
    """Fake kernels: tape rows are the shape-only upper bound; dtypes follow the token dtype."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    with FakeTensorMode():
        for packed, rows in ((False, 2 * (2 - 1)), (True, 75 // 64)):
            args = training_args(packed)
            out, fs, tapes, starts = OPS.recurrent_kda_training_forward(*args)
            assert tapes.shape[0] == rows and tapes.dtype == torch.float32
            assert starts.dtype == torch.int64 and starts.shape == (fs.shape[0] + 1,)
            assert out.dtype == torch.bfloat16 and fs.dtype == torch.float32
        args = training_args(True, dtype=torch.float64)
        out, fs, tapes, starts = OPS.recurrent_kda_training_forward(*args)
        assert tapes.dtype == torch.float64 and fs.dtype == torch.float64 and out.dtype == torch.float64
        q, k, v, g, beta, A_log, dt_bias, h0, cu, scale, lb = args
        grads = OPS.recurrent_kda_training_backward(
            q, k, v, g, beta, A_log, dt_bias, tapes, starts, h0, cu, torch.empty_like(out), None, scale, lb
        )
        for gr, inp in zip(grads, (q, k, v, g, beta, A_log, dt_bias, h0), strict=True):
            assert gr.shape == inp.shape and gr.dtype == inp.dtype


def test_public_api_on_meta_tensors():
    """Shape inference through the public API with meta tensors (the fake kernels, no values read)."""
    x = inputs(H=1, HV=2, K=16, V=16, cu_seqlens=[0, 3, 70], device="meta")
    o, f = kda_ops.kda(
        x["q"],
        x["k"],
        x["v"],
        x["g"],
        x["beta"],
        x["A_log"],
        x["dt_bias"],
        cu_seqlens=x["cu_seqlens"],
        output_final_state=True,
    )
    assert o.shape == (1, 70, 2, 16) and o.device.type == "meta" and f.shape == (2, 2, 16, 16)
    o, f, ck = kda_ops.recurrent_kda(
        x["q"],
        x["k"],
        x["v"],
        x["g"],
        x["beta"],
        x["A_log"],
        x["dt_bias"],
        use_gate_in_kernel=True,
        initial_state=x["initial_state"],
        cu_seqlens=x["cu_seqlens"],
        output_final_state=True,
        checkpoint_every_n_tokens=16,
    )
    assert f is x["initial_state"] and ck.shape == (70 // 16 + 2, 2, 16, 16)  # upper bound without values
