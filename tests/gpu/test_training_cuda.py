"""CUDA training ops: recurrent_kda_training_forward / _backward and recurrent_kda_backward
against the fp64 reference (kda_ops.reference.reference_training_grads), the golden file, the CPU ops,
and themselves (determinism, CUDA graph capture).

Tolerances: docs/contract.md "Tolerances", on the same bf16-rounded inputs: output relative RMS <= 5e-3 and max abs
<= 2e-2
(bf16 storage alone costs ~2e-3), fp32 final state and tapes <= 1e-3 (fp32 math vs fp64), the eight
gradients <= 1e-2 each (five of them are stored in bf16, ~2e-3 from rounding alone) and finite.

Set KDA_TRAIN_REPORT=<file> to append one line of errors per case (relative RMS and max abs error of
every tensor): the numbers behind a pass, for the device logs.
"""

from __future__ import annotations

import math
import os

import pytest
import torch

import kda_ops  # noqa: F401  (registers the ops)
from kda_ops.reference import make_inputs, recurrent_kda_reference, reference_training_grads, rel_rms

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]

TOL_OUT, TOL_OUT_MAXABS, TOL_STATE, TOL_GRAD = 5e-3, 2e-2, 1e-3, 1e-2
GRADS = ("dq", "dk", "dv", "dg", "dbeta", "dA_log", "ddt_bias", "dinitial_state")
K = 128


def _report(line: str) -> None:
    path = os.environ.get("KDA_TRAIN_REPORT")
    if path:
        with open(path, "a") as f:
            f.write(line + "\n")


def _maxabs(a: torch.Tensor, e: torch.Tensor) -> float:
    d = a.detach().double().cpu() - e.detach().double().cpu()
    return d.abs().max().item() if d.numel() else 0.0


def _errors(names, actual, expected) -> dict[str, tuple[float, float]]:
    return {n: (rel_rms(a, e), _maxabs(a, e)) for n, a, e in zip(names, actual, expected, strict=True)}


def _fmt(errs: dict[str, tuple[float, float]]) -> str:
    return " ".join(f"{n}={r:.2e}/{m:.1e}" for n, (r, m) in errs.items())


def _case_inputs(B, T, H, HV, lengths, zero_init, seed, with_dfinal):
    cu = None
    if lengths is not None:
        cu = [0]
        for n in lengths:
            cu.append(cu[-1] + n)
    x = make_inputs(B=B, T=T, H=H, HV=HV, K=K, V=K, cu_seqlens=cu, seed=seed)
    if zero_init:
        x["initial_state"].zero_()
    B, T = x["q"].shape[:2]
    N = x["initial_state"].shape[0]
    gen = torch.Generator().manual_seed(seed + 1000)
    x["do"] = torch.randn(B, T, HV, K, generator=gen).to(torch.bfloat16)
    x["dfinal_state"] = (torch.randn(N, HV, K, K, generator=gen) * 0.1) if with_dfinal else None
    return x


def _cuda(x: dict) -> dict:
    return {k: (None if v is None else v.cuda()) for k, v in x.items()}


def _raw_backward(c, cu, sc, lam):
    """torch.ops.kda.recurrent_kda_backward (from the raw inputs) on the tensors of _cuda / _case_inputs."""
    names = ("q", "k", "v", "g", "beta", "A_log", "dt_bias", "initial_state")
    return torch.ops.kda.recurrent_kda_backward(*(c[n] for n in names), cu, c["do"], c["dfinal_state"], sc, lam)


def _expected_tapes(x, scale, lam):
    res = recurrent_kda_reference(
        x["q"],
        x["k"],
        x["v"],
        x["g"],
        x["beta"],
        A_log=x["A_log"],
        dt_bias=x["dt_bias"],
        scale=scale,
        initial_state=x["initial_state"],
        cu_seqlens=x.get("cu_seqlens"),
        use_gate_in_kernel=True,
        lower_bound=lam,
        beta_is_logit=True,
        checkpoint_every_n_tokens=64,
    )
    # the tapes skip the state before token 0 (initial_state, an input of the backward)
    ckpts = [c[1:] for c in res.checkpoints]
    starts = [0]
    for c in ckpts:
        starts.append(starts[-1] + c.shape[0])
    return ckpts, starts


# (name, B, T, H, HV, packed lengths or None, zero initial state, λ, scale or None, dfinal given)
CASES = [
    ("fixed_T1", 1, 1, 1, 1, None, False, -5.0, None, True),
    ("fixed_T17_H4", 2, 17, 4, 4, None, True, -1.0, None, False),
    ("fixed_T64_gqa2", 1, 64, 1, 2, None, False, -5.0, None, True),
    ("fixed_T65_gqa4", 2, 65, 1, 4, None, False, -1.0, 0.3, True),
    ("fixed_T200_H4", 1, 200, 4, 4, None, False, -5.0, None, True),
    ("fixed_T200_gqa4", 1, 200, 1, 4, None, True, -1.0, None, True),
    ("packed_17_0_65_1", 1, 0, 1, 2, [17, 0, 65, 1], False, -5.0, None, True),
    ("packed_0_200_0_gqa2", 1, 0, 4, 8, [0, 200, 0], True, -1.0, None, False),
    ("packed_64_64_3_0_17_gqa4", 1, 0, 2, 8, [64, 64, 3, 0, 17], False, -5.0, 0.05, True),
    ("packed_1_1_1", 1, 0, 4, 4, [1, 1, 1], False, -1.0, None, True),
    ("packed_all_empty", 1, 0, 1, 2, [0, 0], False, -5.0, None, True),
]


def _reference(x, **kw):
    """reference_training_grads on the inputs of _case_inputs (fp64 autograd through the token loop)."""
    names = ("q", "k", "v", "g", "beta", "A_log", "dt_bias", "initial_state", "do", "dfinal_state")
    return reference_training_grads(*(x[n] for n in names), **kw)


@pytest.mark.parametrize("case", CASES, ids=[c[0] for c in CASES])
def test_training_ops_vs_reference(case):
    name, B, T, H, HV, lengths, zero_init, lam, scale, with_dfinal = case
    x = _case_inputs(B, T, H, HV, lengths, zero_init, seed=len(name), with_dfinal=with_dfinal)
    sc = scale if scale is not None else 1.0 / math.sqrt(K)
    out_ref, fs_ref, g_ref = _reference(
        x,
        cu_seqlens=x.get("cu_seqlens"),
        scale=sc,
        lower_bound=lam,
    )
    ckpts, starts = _expected_tapes(x, sc, lam)
    c = _cuda(x)
    cu = c.get("cu_seqlens")
    args = (c["q"], c["k"], c["v"], c["g"], c["beta"], c["A_log"], c["dt_bias"])

    out, fs, tapes, tcs = torch.ops.kda.recurrent_kda_training_forward(*args, c["initial_state"], cu, sc, lam)
    torch.cuda.synchronize()
    errs = _errors(("out", "final_state"), (out, fs), (out_ref, fs_ref))
    # Tapes: rows of each sequence vs the reference's checkpoints; spare rows exactly zero.
    assert tcs.dtype == torch.int64 and tcs.cpu().tolist() == starts, f"tape_cu_starts {tcs.cpu().tolist()} != {starts}"
    tapes_c = tapes.cpu()
    used = torch.zeros(tapes_c.shape[0], dtype=torch.bool)
    exp_rows = []
    for n, ck in enumerate(ckpts):
        used[starts[n] : starts[n] + ck.shape[0]] = True
        exp_rows.append(ck)
    if exp_rows and sum(e.shape[0] for e in exp_rows):
        errs["tapes"] = (rel_rms(tapes_c[used], torch.cat(exp_rows)), _maxabs(tapes_c[used], torch.cat(exp_rows)))
    spare_zero = bool((tapes_c[~used] == 0).all())

    grads = torch.ops.kda.recurrent_kda_training_backward(
        *args, tapes, tcs, c["initial_state"], cu, c["do"], c["dfinal_state"], sc, lam
    )
    torch.cuda.synchronize()
    errs.update(_errors(GRADS, grads, g_ref))
    _report(f"{name}: {_fmt(errs)}")

    assert out.dtype == torch.bfloat16 and fs.dtype == torch.float32 and tapes.dtype == torch.float32
    assert spare_zero, "unused tape rows must be zero"
    for n_, t in zip(("out", "final_state", *GRADS), (out, fs, *grads), strict=True):
        assert torch.isfinite(t.float()).all(), f"{n_}: non-finite values ({_fmt(errs)})"
    for n_, ref, t in zip(GRADS, g_ref, grads, strict=True):
        assert tuple(t.shape) == tuple(ref.shape), f"{n_}: shape {tuple(t.shape)} != {tuple(ref.shape)}"
    assert [t.dtype for t in grads] == [torch.bfloat16] * 5 + [torch.float32] * 3
    bad = [
        n_
        for n_, (r, _) in errs.items()
        if r > {"out": TOL_OUT}.get(n_, TOL_STATE if n_ in ("final_state", "tapes") else TOL_GRAD)
    ]
    assert not bad, f"{name}: over tolerance {bad}: {_fmt(errs)}"
    assert errs["out"][1] <= TOL_OUT_MAXABS, f"{name}: output max abs error: {_fmt(errs)}"

    # Determinism (bit-identical rerun) and recurrent_kda_backward == forward + training backward.
    grads2 = torch.ops.kda.recurrent_kda_training_backward(
        *args, tapes, tcs, c["initial_state"], cu, c["do"], c["dfinal_state"], sc, lam
    )
    for n_, a, b in zip(GRADS, grads, grads2, strict=True):
        assert torch.equal(a, b), f"{n_}: rerun of the training backward is not bit-identical"
    out2, fs2, tapes2, _ = torch.ops.kda.recurrent_kda_training_forward(*args, c["initial_state"], cu, sc, lam)
    assert torch.equal(out, out2) and torch.equal(fs, fs2) and torch.equal(tapes, tapes2), "forward rerun differs"
    grads3 = torch.ops.kda.recurrent_kda_backward(*args, c["initial_state"], cu, c["do"], c["dfinal_state"], sc, lam)
    for n_, a, b in zip(GRADS, grads, grads3, strict=True):
        assert torch.equal(a, b), f"{n_}: recurrent_kda_backward differs from forward + training backward"


def test_dbeta_one_token_cancelling():
    """A one-token, one-head case whose dβ cancels (inputs of seed 101, the worst of 300 in the emulation of the
    sweep's precisions): dβ against fp64 autograd within the gradient tolerance. The products feeding dβ = dY · (V - X)
    (X, Kr dS_Cᵀ, Mqkᵀ dO, INVᵀ dR) must run near fp32 for it: tf32 alone gives ~5e-2 here."""
    x = _case_inputs(1, 1, 1, 1, None, False, seed=101, with_dfinal=True)
    sc = 1.0 / math.sqrt(K)
    g_ref = _reference(x, cu_seqlens=None, scale=sc, lower_bound=-5.0)[2]
    grads = _raw_backward(_cuda(x), None, sc, -5.0)
    assert torch.isfinite(grads[4].float()).all()
    assert rel_rms(grads[4], g_ref[4]) <= TOL_GRAD, f"dbeta rel RMS {rel_rms(grads[4], g_ref[4]):.2e}"


def test_dfinal_none_is_zero_and_int32_cu_seqlens():
    x = _case_inputs(1, 0, 2, 4, [33, 0, 70], False, seed=7, with_dfinal=False)
    c = _cuda(x)
    args = (c["q"], c["k"], c["v"], c["g"], c["beta"], c["A_log"], c["dt_bias"])
    cu64 = c["cu_seqlens"]
    cu32 = cu64.to(torch.int32)
    sc, lam = 0.125, -3.0
    o64, f64, t64, s64 = torch.ops.kda.recurrent_kda_training_forward(*args, c["initial_state"], cu64, sc, lam)
    o32, f32, t32, s32 = torch.ops.kda.recurrent_kda_training_forward(*args, c["initial_state"], cu32, sc, lam)
    assert torch.equal(o64, o32) and torch.equal(f64, f32) and torch.equal(t64, t32) and torch.equal(s64, s32)
    zeros = torch.zeros_like(c["initial_state"])
    g_none = torch.ops.kda.recurrent_kda_training_backward(
        *args, t64, s64, c["initial_state"], cu64, c["do"], None, sc, lam
    )
    g_zero = torch.ops.kda.recurrent_kda_training_backward(
        *args, t64, s64, c["initial_state"], cu32, c["do"], zeros, sc, lam
    )
    for n_, a, b in zip(GRADS, g_none, g_zero, strict=True):
        assert torch.equal(a, b), f"{n_}: dfinal_state=None differs from zeros"
    # initial_state=None in the training backward (the state before token 0 of every sequence) equals zeros
    g_h0_none = torch.ops.kda.recurrent_kda_training_backward(*args, t64, s64, None, cu64, c["do"], None, sc, lam)
    g_h0_zero = torch.ops.kda.recurrent_kda_training_backward(*args, t64, s64, zeros, cu64, c["do"], None, sc, lam)
    for n_, a, b in zip(GRADS, g_h0_none, g_h0_zero, strict=True):
        assert torch.equal(a, b), f"{n_}: initial_state=None differs from zeros"
    # A flat [HV*K] dt_bias gives a flat ddt_bias with the same values.
    flat = (*args[:6], c["dt_bias"].reshape(-1))
    g_flat = torch.ops.kda.recurrent_kda_training_backward(
        *flat, t64, s64, c["initial_state"], cu64, c["do"], None, sc, lam
    )
    assert g_flat[6].shape == (c["dt_bias"].numel(),) and torch.equal(g_flat[6], g_none[6].reshape(-1))


def test_strided_views():
    """q/k as slices of a fused projection and a transposed-layout beta (last dim contiguous)."""
    B, T, H, HV = 1, 70, 2, 4
    x = _case_inputs(B, T, H, HV, None, False, seed=11, with_dfinal=True)
    sc, lam = 1.0 / math.sqrt(K), -5.0
    _, _, g_ref = _reference(
        x,
        scale=sc,
        lower_bound=lam,
    )
    c = _cuda(x)
    qk = torch.cat([c["q"], c["k"]], dim=2)  # [B, T, 2H, K]
    q, k = qk[:, :, :H], qk[:, :, H:]
    beta = c["beta"].transpose(1, 2).contiguous().transpose(1, 2)  # [B, T, HV] with token stride 1
    args = (q, k, c["v"], c["g"], beta, c["A_log"], c["dt_bias"])
    _, _, tapes, tcs = torch.ops.kda.recurrent_kda_training_forward(*args, c["initial_state"], None, sc, lam)
    grads = torch.ops.kda.recurrent_kda_training_backward(
        *args, tapes, tcs, c["initial_state"], None, c["do"], c["dfinal_state"], sc, lam
    )
    errs = _errors(GRADS, grads, g_ref)
    _report(f"strided_views: {_fmt(errs)}")
    assert all(r <= TOL_GRAD for r, _ in errs.values()), _fmt(errs)


def _golden_path() -> str | None:
    here = os.path.dirname(os.path.abspath(__file__))
    for d in (
        os.environ.get("KDA_GOLDEN_DIR"),
        os.path.join(here, "..", "..", "shared", "golden"),
        os.path.join(here, "..", "..", "..", "shared", "golden"),
    ):
        if d and os.path.exists(os.path.join(d, "training_grads_packed_gqa.pt")):
            return os.path.join(d, "training_grads_packed_gqa.pt")
    return None


def test_golden_training_grads_packed_gqa():
    path = _golden_path()
    if path is None:
        pytest.skip("golden file training_grads_packed_gqa.pt not found (set KDA_GOLDEN_DIR)")
    gold = torch.load(path)
    x = {k: (v.cuda() if isinstance(v, torch.Tensor) else v) for k, v in gold["inputs"].items()}
    sc, lam = float(gold["kwargs"]["scale"]), float(gold["kwargs"]["lower_bound"])
    exp = gold["expected"]
    args = (x["q"], x["k"], x["v"], x["g"], x["beta"], x["A_log"], x["dt_bias"])
    out, fs, tapes, tcs = torch.ops.kda.recurrent_kda_training_forward(
        *args, x["initial_state"], x["cu_seqlens"], sc, lam
    )
    grads = torch.ops.kda.recurrent_kda_training_backward(
        *args, tapes, tcs, x["initial_state"], x["cu_seqlens"], x["do"], x["dfinal_state"], sc, lam
    )
    errs = _errors(("out", "final_state"), (out, fs), (exp["output"], exp["final_state"]))
    errs.update(_errors(GRADS, grads, [exp[n] for n in GRADS]))
    _report(f"golden_ops: {_fmt(errs)}")
    assert errs["out"][0] <= TOL_OUT and errs["final_state"][0] <= TOL_STATE, _fmt(errs)
    assert all(errs[n][0] <= TOL_GRAD for n in GRADS), _fmt(errs)

    # The same through the public API.
    cu_cpu = gold["inputs"]["cu_seqlens"].to(torch.int64)
    o2, fs2, ctx = kda_ops.recurrent_kda_training_forward(
        *args, x["initial_state"], cu_seqlens=x["cu_seqlens"], scale=sc, lower_bound=lam, cu_seqlens_cpu=cu_cpu
    )
    g2 = kda_ops.recurrent_kda_training_backward(ctx, x["do"], x["dfinal_state"])
    errs2 = _errors(GRADS, g2, [exp[n] for n in GRADS])
    _report(f"golden_api: {_fmt(errs2)}")
    assert rel_rms(o2, exp["output"]) <= TOL_OUT and all(r <= TOL_GRAD for r, _ in errs2.values()), _fmt(errs2)
    g3 = kda_ops.recurrent_kda_backward(
        *args, x["initial_state"], x["do"], x["dfinal_state"], cu_seqlens=x["cu_seqlens"], scale=sc, lower_bound=lam
    )
    errs3 = _errors(GRADS, g3, [exp[n] for n in GRADS])
    assert all(r <= TOL_GRAD for r, _ in errs3.values()), _fmt(errs3)


def test_kda_autograd_cuda():
    lengths = [40, 0, 90]
    x = _case_inputs(1, 0, 2, 4, lengths, False, seed=3, with_dfinal=True)
    sc, lam = 1.0 / math.sqrt(K), -5.0
    _, _, g_ref = _reference(
        x,
        cu_seqlens=x["cu_seqlens"],
        scale=sc,
        lower_bound=lam,
    )
    c = _cuda(x)
    leaves = [
        c[n].clone().requires_grad_(True) for n in ("q", "k", "v", "g", "beta", "A_log", "dt_bias", "initial_state")
    ]
    o, fs = kda_ops.kda(*leaves[:7], leaves[7], cu_seqlens=c["cu_seqlens"], output_final_state=True)
    loss = (o.float() * c["do"].float()).sum() + (fs * c["dfinal_state"]).sum()
    grads = torch.autograd.grad(loss, leaves)
    errs = _errors(GRADS, grads, g_ref)
    _report(f"kda_autograd: {_fmt(errs)}")
    assert all(r <= TOL_GRAD for r, _ in errs.values()), _fmt(errs)


def test_cuda_matches_cpu_op():
    if not torch._C._dispatch_has_kernel_for_dispatch_key("kda::recurrent_kda_training_backward", "CPU"):
        pytest.skip("CPU training ops not built")
    x = _case_inputs(1, 0, 2, 4, [70, 0, 5], False, seed=5, with_dfinal=True)
    sc, lam = 0.2, -2.0
    args_cpu = (x["q"], x["k"], x["v"], x["g"], x["beta"], x["A_log"], x["dt_bias"])
    o_c, f_c, t_c, s_c = torch.ops.kda.recurrent_kda_training_forward(
        *args_cpu, x["initial_state"], x["cu_seqlens"], sc, lam
    )
    g_c = torch.ops.kda.recurrent_kda_training_backward(
        *args_cpu, t_c, s_c, x["initial_state"], x["cu_seqlens"], x["do"], x["dfinal_state"], sc, lam
    )
    c = _cuda(x)
    args = (c["q"], c["k"], c["v"], c["g"], c["beta"], c["A_log"], c["dt_bias"])
    o, f, t, s = torch.ops.kda.recurrent_kda_training_forward(*args, c["initial_state"], c["cu_seqlens"], sc, lam)
    g = torch.ops.kda.recurrent_kda_training_backward(
        *args, t, s, c["initial_state"], c["cu_seqlens"], c["do"], c["dfinal_state"], sc, lam
    )
    assert torch.equal(s.cpu(), s_c) and t.shape == t_c.shape
    errs = _errors(("out", "final_state", "tapes"), (o, f, t), (o_c, f_c, t_c))
    errs.update(_errors(GRADS, g, g_c))
    _report(f"cuda_vs_cpu: {_fmt(errs)}")
    assert errs["out"][0] <= TOL_OUT and errs["final_state"][0] <= TOL_STATE and errs["tapes"][0] <= TOL_STATE, _fmt(
        errs
    )
    assert all(errs[n][0] <= TOL_GRAD for n in GRADS), _fmt(errs)


def test_backward_host_route(monkeypatch):
    """KDA_TRAINING_SWEEP=host takes the route of GPUs without the sweep's shared memory (sm_120): the
    CPU op on host copies of the CUDA forward's tapes, so the gradients equal the CPU op's on those tapes bit
    for bit, and the kernels' within tolerance."""
    if not torch._C._dispatch_has_kernel_for_dispatch_key("kda::recurrent_kda_training_backward", "CPU"):
        pytest.skip("CPU training ops not built")
    x = _case_inputs(1, 0, 2, 4, [70, 0, 5], False, seed=7, with_dfinal=True)
    sc, lam = 0.2, -2.0
    c = _cuda(x)
    args = (c["q"], c["k"], c["v"], c["g"], c["beta"], c["A_log"], c["dt_bias"])
    _, _, t, s_ = torch.ops.kda.recurrent_kda_training_forward(*args, c["initial_state"], c["cu_seqlens"], sc, lam)
    tail = (c["initial_state"], c["cu_seqlens"], c["do"], c["dfinal_state"], sc, lam)
    g_kernels = torch.ops.kda.recurrent_kda_training_backward(*args, t, s_, *tail)
    route_env(monkeypatch, KDA_TRAINING_SWEEP="host")
    g_host = torch.ops.kda.recurrent_kda_training_backward(*args, t, s_, *tail)
    args_cpu = (x["q"], x["k"], x["v"], x["g"], x["beta"], x["A_log"], x["dt_bias"])
    g_c = torch.ops.kda.recurrent_kda_training_backward(
        *args_cpu, t.cpu(), s_.cpu(), x["initial_state"], x["cu_seqlens"], x["do"], x["dfinal_state"], sc, lam
    )
    for n_, a, b in zip(GRADS, g_host, g_c, strict=True):
        assert a.device.type == "cuda" and torch.equal(a.cpu(), b), f"{n_}: the host route differs from the CPU op"
    errs = _errors(GRADS, g_kernels, g_host)
    _report(f"host_route_vs_kernels: {_fmt(errs)}")
    assert all(errs[n][0] <= TOL_GRAD for n in GRADS), _fmt(errs)


def test_backward_host_route_refuses_capture(monkeypatch):
    """On the host route the op refuses CUDA-graph capture with a clear error before it enqueues anything (a
    host copy cannot be captured), through the public backward as well."""
    x = _case_inputs(1, 0, 1, 2, [30, 0, 70], False, seed=9, with_dfinal=True)
    c = _cuda(x)
    pub = (c["q"], c["k"], c["v"], c["g"], c["beta"], c["A_log"], c["dt_bias"], c["initial_state"], c["do"])
    route_env(monkeypatch, KDA_TRAINING_SWEEP="host")
    kda_ops.recurrent_kda_backward(*pub, c["dfinal_state"], cu_seqlens=c["cu_seqlens"], scale=0.1, lower_bound=-4.0)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with pytest.raises(RuntimeError, match="KDA_TRAINING_SWEEP=host"):
        with torch.cuda.graph(graph):
            kda_ops.recurrent_kda_backward(
                *pub, c["dfinal_state"], cu_seqlens=c["cu_seqlens"], scale=0.1, lower_bound=-4.0
            )


def test_cuda_graph_capture_backward():
    lengths = [30, 0, 70]
    x = _case_inputs(1, 0, 1, 2, lengths, False, seed=9, with_dfinal=True)
    y = _case_inputs(1, 0, 1, 2, lengths, False, seed=19, with_dfinal=True)
    sc, lam = 0.1, -4.0
    c = _cuda(x)
    names = ("q", "k", "v", "g", "beta", "A_log", "dt_bias", "initial_state")

    def call():
        return _raw_backward(c, c["cu_seqlens"], sc, lam)

    call()  # eager warm-up
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        captured = call()
    for n in (*names, "do", "dfinal_state"):
        c[n].copy_(y[n].cuda())
    graph.replay()
    torch.cuda.synchronize()
    eager = call()
    for n_, a, b in zip(GRADS, captured, eager, strict=True):
        assert torch.equal(a, b), f"{n_}: graph replay differs from the eager call"


def test_rejects_unsupported_public_api():
    x = make_inputs(B=1, T=4, H=1, HV=1, K=32, V=32, device="cuda")  # (K = V in {64, 128} on CUDA)
    args = (x["q"], x["k"], x["v"], x["g"], x["beta"], x["A_log"], x["dt_bias"], x["initial_state"])
    with pytest.raises(ValueError):
        kda_ops.recurrent_kda_training_forward(*args)
    x = make_inputs(B=1, T=4, H=1, HV=1, device="cuda")
    half = [x[n].half() for n in ("q", "k", "v", "g", "beta")]
    with pytest.raises(TypeError):
        kda_ops.recurrent_kda_training_forward(*half, x["A_log"], x["dt_bias"], x["initial_state"])
    with pytest.raises(ValueError):
        kda_ops.recurrent_kda_training_forward(
            x["q"], x["k"], x["v"], x["g"], x["beta"], x["A_log"], x["dt_bias"], x["initial_state"], lower_bound=-6.0
        )


_DIRECT_OP_REJECTIONS = """
import torch, kda_ops
from kda_ops.reference import make_inputs
f = torch.ops.kda.recurrent_kda_training_forward
N = ("q", "k", "v", "g", "beta", "A_log", "dt_bias", "initial_state")
x = make_inputs(B=1, T=4, H=1, HV=1, K=32, V=32, device="cuda")
y = make_inputs(B=1, T=4, H=1, HV=1, device="cuda")
a64, a = [x[n] for n in N], [y[n] for n in N]
half = [t.half() for t in a[:5]] + a[5:]
for label, args, exc in (("K32", a64 + [None, 0.1, -5.0], ValueError), ("lambda", a + [None, 0.1, -6.0], ValueError),
                         ("fp16", half + [None, 0.1, -5.0], TypeError)):
    try:
        f(*args)
        print(label, "NO_ERROR", flush=True)
    except exc as e:
        print(label, "RAISED", type(e).__name__, str(e).splitlines()[0][:120], flush=True)
"""


def test_rejects_unsupported_direct_op():
    """Direct torch.ops calls (no Python validation) must raise, not crash. Run in a subprocess, so a crash
    fails this test alone: an extension that links libstdc++ statically and exports its unique symbols
    (the GPU machine's compiler did) shares locale facet ids with torch's libstdc++, and formatting a
    number in a C++ error message then crashed; setup.py links with --exclude-libs,ALL against that."""
    import subprocess
    import sys

    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    r = subprocess.run(
        [sys.executable, "-X", "faulthandler", "-c", _DIRECT_OP_REJECTIONS],
        capture_output=True,
        text=True,
        timeout=300,
        cwd=root,
    )
    report = f"rc={r.returncode}\nstdout:\n{r.stdout}\nstderr (tail):\n{r.stderr[-4000:]}"
    _report("direct_op_rejections: " + " | ".join(r.stdout.strip().splitlines()) + f" rc={r.returncode}")
    assert r.returncode == 0, report
    assert r.stdout.count("RAISED") == 3, report


def test_backward_chain_wide_grid():
    """N * HV > SMs / 2 runs the backward chain with 128 value rows per CTA (the other tests use 64):
    fixed layout, 20 sequences of 130 tokens, GQA 2, against the fp64 reference."""
    x = _case_inputs(20, 130, 2, 4, None, False, seed=5, with_dfinal=True)
    sc = 1.0 / math.sqrt(K)
    _, _, g_ref = _reference(x, cu_seqlens=None, scale=sc, lower_bound=-1.0)
    c = _cuda(x)
    got = _raw_backward(c, None, sc, -1.0)
    errs = _errors(GRADS, got, g_ref)
    _report(f"chain_wide_grid: {_fmt(errs)}")
    bad = [n_ for n_, (r, _) in errs.items() if r > TOL_GRAD]
    assert not bad, f"over tolerance {bad}: {_fmt(errs)}"


@pytest.mark.parametrize("lam", [-5.0, -1.0, -0.02], ids=["lam-5", "lam-1", "lam-0.02"])
def test_backward_chain_and_tape_rows(lam):
    """The chunked backward's two stages: the backward chain (dS at the end of every 16-token chunk, last
    chunk first) and the (tape row, value head) tasks that map each row back to its sequence. Packed rows with
    empty sequences before, between and after, lengths that end mid-chunk and exactly on a tape boundary,
    against the fp64 reference; reruns bit-identical."""
    x = _case_inputs(1, 0, 2, 4, [0, 300, 0, 0, 128, 65, 1, 0], False, seed=11, with_dfinal=True)
    sc = 1.0 / math.sqrt(K)
    _, _, g_ref = _reference(x, cu_seqlens=x["cu_seqlens"], scale=sc, lower_bound=lam)
    c = _cuda(x)
    args = (c["q"], c["k"], c["v"], c["g"], c["beta"], c["A_log"], c["dt_bias"])
    _, _, tapes, tcs = torch.ops.kda.recurrent_kda_training_forward(*args, c["initial_state"], c["cu_seqlens"], sc, lam)
    got = torch.ops.kda.recurrent_kda_training_backward(
        *args, tapes, tcs, c["initial_state"], c["cu_seqlens"], c["do"], c["dfinal_state"], sc, lam
    )
    again = torch.ops.kda.recurrent_kda_training_backward(
        *args, tapes, tcs, c["initial_state"], c["cu_seqlens"], c["do"], c["dfinal_state"], sc, lam
    )
    torch.cuda.synchronize()
    errs = _errors(GRADS, got, g_ref)
    _report(f"chain_and_tape_rows lam={lam}: {_fmt(errs)}")
    bad = [n_ for n_, (r, _) in errs.items() if r > TOL_GRAD]
    assert not bad, f"over tolerance {bad}: {_fmt(errs)}"
    for n_, a, b in zip(GRADS, got, again, strict=True):
        assert torch.equal(a, b), f"{n_} rerun is not bit-identical"


def _with_uncovered_tail(x, pad, seed):
    """Appends `pad` random tokens after the last packed sequence (cu_seqlens unchanged): tokens no sequence
    covers."""
    gen = torch.Generator().manual_seed(seed)
    for n in ("q", "k", "v", "g", "do", "beta"):
        extra = torch.randn(1, pad, *x[n].shape[2:], generator=gen).to(x[n].dtype)
        x[n] = torch.cat([x[n], extra], 1)
    return x


def test_fused_qk_uncovered_tokens():
    """HV == H (the sweep does the L2-norm backward itself and writes dq/dk): packed rows with an empty
    sequence and 7 tokens after the last sequence that no sequence covers; gradients against the fp64
    reference, and exactly zero on the uncovered tokens."""
    x = _case_inputs(1, 0, 4, 4, [40, 0, 21], False, seed=13, with_dfinal=True)
    pad = 7
    x = _with_uncovered_tail(x, pad, seed=99)
    sc, lam = 1.0 / math.sqrt(K), -1.0
    _, _, g_ref = _reference(x, cu_seqlens=x["cu_seqlens"], scale=sc, lower_bound=lam)
    c = _cuda(x)
    got = _raw_backward(c, c["cu_seqlens"], sc, lam)
    errs = _errors(GRADS, got, g_ref)
    _report(f"fused_qk_uncovered: {_fmt(errs)}")
    bad = [n_ for n_, (r, _) in errs.items() if r > TOL_GRAD]
    assert not bad, f"over tolerance {bad}: {_fmt(errs)}"
    for n_, t in zip(GRADS[:5], got[:5], strict=True):
        assert (t[:, -pad:] == 0).all(), f"{n_}: uncovered tokens are not zero"


def _poison_allocator(specs, copies=3):
    """Fills cached CUDA memory with NaN: `copies` tensors of every (shape, dtype) in specs, freed again, so
    the next allocations of those sizes likely get NaN-filled blocks from torch's caching allocator.
    Returns the poisoned [start, end) byte ranges."""
    held = [torch.full(shape, float("nan"), dtype=dt, device="cuda") for shape, dt in specs for _ in range(copies)]
    torch.cuda.synchronize()
    return [(t.data_ptr(), t.data_ptr() + t.numel() * t.element_size()) for t in held]


def _in_ranges(t, ranges):
    a, b = t.data_ptr(), t.data_ptr() + t.numel() * t.element_size()
    return any(lo <= a and b <= hi for lo, hi in ranges)


# (id, B, T, lengths, pad): packed through the chunked forward; packed through the token-serial forward
# (sequences average < 16 tokens); fixed layout (every token covered, every tape row used)
STALE_CASES = [
    ("packed_chunked", 1, 0, [70, 0, 40], 20),
    ("packed_serial_fwd", 1, 0, [70] + [1] * 10, 60),
    ("fixed_B2_T65", 2, 65, None, 0),
]


@pytest.mark.parametrize("case", STALE_CASES, ids=[c[0] for c in STALE_CASES])
@pytest.mark.parametrize("group", [1, 2], ids=["HV=H", "GQA2"])
def test_stale_memory_outside_sequences(case, group):
    """The training ops allocate their outputs without a zero-fill: the tape rows past the sequences' and the
    gradients of packed tokens after the last sequence are written as zeros by the kernels, every other row
    by the forward or the sweep. The caching allocator is first filled with NaN blocks of the outputs'
    sizes: the uncovered rows must still be exactly zero and the covered tokens match the fp64 reference.
    Skips (rather than pass vacuously) if no checked output landed in poisoned memory."""
    name, B, T, lengths, pad = case
    H, HV = 2, 2 * group
    x = _case_inputs(B, T, H, HV, lengths, False, seed=5, with_dfinal=True)
    if pad:
        x = _with_uncovered_tail(x, pad, seed=17)
    B, T = x["q"].shape[:2]
    cu = x.get("cu_seqlens")
    sc, lam = 1.0 / math.sqrt(K), -1.0
    _, _, g_ref = _reference(x, cu_seqlens=cu, scale=sc, lower_bound=lam)
    c = _cuda(x)
    cu = c.get("cu_seqlens")
    args = (c["q"], c["k"], c["v"], c["g"], c["beta"], c["A_log"], c["dt_bias"])
    bf, f32 = torch.bfloat16, torch.float32
    rows = T // 64 if cu is not None else B * (-(-T // 64) - 1)
    specs = [((rows, HV, K, K), f32), ((B, T, H, K), bf), ((B, T, HV, K), bf), ((B, T, HV), bf)]
    specs.append(((2 * B * T * HV * K,), f32))  # the GQA workspace of per-value-head dq/dk
    poisoned = _poison_allocator(specs)
    _, _, tapes, tcs = torch.ops.kda.recurrent_kda_training_forward(*args, c["initial_state"], cu, sc, lam)
    used = int(tcs[-1])
    assert tapes.shape[0] == rows and used == (1 if cu is not None else rows)
    assert (tapes[used:] == 0).all(), "tape rows past the sequences are not zero"
    hits = int(_in_ranges(tapes, poisoned))
    poisoned = _poison_allocator(specs)
    got = torch.ops.kda.recurrent_kda_training_backward(
        *args, tapes, tcs, c["initial_state"], cu, c["do"], c["dfinal_state"], sc, lam
    )
    hits += sum(_in_ranges(t, poisoned) for t in got[:5])
    for n_, t in zip(GRADS[:5], got[:5], strict=True):
        assert (t[:, T - pad :] == 0).all(), f"{n_}: uncovered tokens are not zero"
    errs = _errors(GRADS, got, g_ref)
    _report(f"stale_memory_{name}_group{group} (outputs in poisoned memory: {hits}/6): {_fmt(errs)}")
    bad = [n_ for n_, (r, _) in errs.items() if not r <= TOL_GRAD]
    assert not bad, f"over tolerance {bad}: {_fmt(errs)}"
    if hits == 0:
        pytest.skip("no output landed in the NaN-poisoned blocks: the check above proved nothing")


@pytest.mark.parametrize("group", [1, 2], ids=["HV=H", "GQA2"])
def test_uncovered_tokens_hold_inf(group):
    """Packed tokens that no sequence covers, holding inf in q and k: their gradients are exactly zero
    (HV == H: the sweep never reads them; GQA: the finishing kernel writes zero outside covered_tokens), and
    the covered tokens match the fp64 reference of the same call with finite values there."""
    x = _case_inputs(1, 0, 2, 2 * group, [33, 0, 18], False, seed=21, with_dfinal=True)
    pad = 5
    x = _with_uncovered_tail(x, pad, seed=7)
    sc, lam = 1.0 / math.sqrt(K), -1.0
    _, _, g_ref = _reference(x, cu_seqlens=x["cu_seqlens"], scale=sc, lower_bound=lam)
    c = _cuda(x)
    for n in ("q", "k"):
        c[n][:, -pad:] = float("inf")
    got = _raw_backward(c, c["cu_seqlens"], sc, lam)
    for n_, t in zip(GRADS[:5], got[:5], strict=True):
        assert (t[:, -pad:] == 0).all(), f"{n_}: uncovered tokens are not zero"
    errs = _errors(GRADS, got, g_ref)
    _report(f"uncovered_inf_group{group}: {_fmt(errs)}")
    bad = [n_ for n_, (r, _) in errs.items() if not r <= TOL_GRAD]
    assert not bad, f"over tolerance {bad}: {_fmt(errs)}"


# ---------------------------------------------------------------------------------------------------
# every mode of recurrent_kda: gate (precomputed / softplus / lower bound) x beta (logit / plain) x L2 norm
# (on / off), K = V in {64, 128}. The CUDA forward runs every mode on the kernels; so does the backward (the
# softplus and precomputed gates with the sweep's pairwise exponents; K = 64 on copies zero-padded to 128
# channels, csrc/api/training_cuda.cpp). _check_backward_route checks that it stays on the kernels: the host
# route (the CPU op on host copies) would refuse CUDA-graph capture.

from _training_cases import EDGES, MODES, PINNED_UNCOMPARED, make_case, mode_id, reference_grads  # noqa: E402
from conftest import lengths_to_cu, route_env  # noqa: E402

_NAMES = ("q", "k", "v", "g", "beta", "A_log", "dt_bias", "initial_state")


def _to_cuda(x: dict) -> dict:
    return {n: (t.cuda() if isinstance(t, torch.Tensor) else t) for n, t in x.items()}


def _check_mode_grads(label, grads, ref):
    errs = {}
    for n, a, e in zip(GRADS, grads, ref, strict=True):
        if e is None:
            assert a is None, f"{label}: {n} must be None"
            continue
        assert a is not None and a.is_cuda and tuple(a.shape) == tuple(e.shape), f"{label}: {n} shape/device"
        assert torch.isfinite(a.float()).all(), f"{label}: {n} not finite"
        errs[n] = (rel_rms(a, e), _maxabs(a, e))
    _report(f"modes {label}: {_fmt(errs)}")
    bad = {n: r for n, (r, _) in errs.items() if r > TOL_GRAD}
    assert not bad, f"{label}: gradients above {TOL_GRAD}: {bad}"


def _op_modes(kw) -> tuple[int, float, bool, bool]:
    """The Python keywords of make_case -> the ops' (gate_mode, lower_bound, use_qk_l2norm, beta_is_logit)."""
    gm = 0 if not kw["use_gate_in_kernel"] else (1 if kw["lower_bound"] is None else 2)
    return gm, kw["lower_bound"] if gm == 2 else 0.0, kw["use_qk_l2norm_in_kernel"], kw["beta_is_logit"]


def _raw_mode_backward(c, kw, do, dS):
    """torch.ops.kda.recurrent_kda_backward in the mode of make_case's keywords, on its (CUDA) tensors."""
    gm, lb, l2, logit = _op_modes(kw)
    h0 = c["initial_state"]
    if h0 is None:
        N = c["cu_seqlens"].numel() - 1 if c["cu_seqlens"] is not None else c["q"].shape[0]
        HV, V = c["v"].shape[2], c["v"].shape[3]
        h0 = torch.zeros(N, HV, V, c["k"].shape[3], device=c["q"].device)
    args = [c[n] for n in _NAMES[:7]]
    sc = c["q"].shape[-1] ** -0.5
    return torch.ops.kda.recurrent_kda_backward(*args, h0, c["cu_seqlens"], do, dS, sc, lb, gm, l2, logit)


def _check_backward_route(label, c, kw, do, dS, kernels: bool):
    """The backward runs on the CUDA kernels (kernels=True): it can be captured in a CUDA graph, and the replay
    equals the eager call bit for bit; else (the host route) it refuses capture."""
    call = lambda: _raw_mode_backward(c, kw, do, dS)  # noqa: E731
    eager = call()  # (also the warm-up of the capture)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    if not kernels:
        with pytest.raises(RuntimeError, match="cannot be captured"):
            with torch.cuda.graph(graph):
                call()
        return
    with torch.cuda.graph(graph):
        captured = call()
    graph.replay()
    torch.cuda.synchronize()
    for n_, a, b in zip(GRADS, captured, eager, strict=True):
        assert torch.equal(a, b), f"{label}: {n_}: graph replay differs from the eager call"


# (label, mode, K, T or lengths, H, HV, λ, initial state "random" / "zero" / None)
_MODE_CASES = []
for _i, _m in enumerate(MODES):
    _MODE_CASES.append((f"{mode_id(_m)}-K128-T65", _m, 128, 65, 1, 2, -5.0, "random"))
    _MODE_CASES.append((f"{mode_id(_m)}-K64-T17", _m, 64, 17, 2, 2, -1.0, "zero"))
    _MODE_CASES.append((f"{mode_id(_m)}-K128-packed", _m, 128, [0, 64, 0, 1, 130], 1, 4, -1.0, None))
_LONG = ((("softplus", True, True), 1024), (("precomputed", False, False), 4097), (("lower_bound", False, True), 1024))
for _m, _T in _LONG:
    _MODE_CASES.append((f"{mode_id(_m)}-K128-T{_T}", _m, 128, _T, 1, 1, -5.0, "random"))
_MODE_CASES.append(("lower_bound-logit-l2-K64-T1", ("lower_bound", True, True), 64, 1, 1, 4, -5.0, "random"))
_MODE_CASES.append(("softplus-plain-nol2-K64-T64", ("softplus", False, False), 64, 64, 1, 2, -5.0, None))
# K = 64 over several tape chunks with an initial state: the sweep reads the 64 x 64 tapes and initial state
_MODE_CASES.append(("lower_bound-logit-l2-K64-T200", ("lower_bound", True, True), 64, 200, 2, 2, -5.0, "random"))
_MODE_CASES.append(("softplus-logit-l2-K64-packed", ("softplus", True, True), 64, [70, 0, 129], 1, 2, -1.0, "random"))


def _mode_case_inputs(case):
    """make_case's inputs of a _MODE_CASES row (T a length or a list of packed lengths; "zero": a zero initial
    state, None: none)."""
    label, mode, Kd, T, H, HV, lam, init = case
    cu = None
    if isinstance(T, list):
        cu = [0]
        for n in T:
            cu.append(cu[-1] + n)
    x, kw, do, dS = make_case(
        mode, T=T if cu is None else 1, cu=cu, H=H, HV=HV, K=Kd, init=init is not None, seed=len(label), lb=lam
    )
    if init == "zero":
        x["initial_state"].zero_()
    return x, kw, do, dS


@pytest.mark.parametrize("case", _MODE_CASES, ids=[c[0] for c in _MODE_CASES])
def test_training_every_mode_vs_reference(case):
    """kda_ops.kda on CUDA (forward with tapes + the backward) in each mode: output, final state and the eight
    gradients against fp64 autograd through the token loop; recurrent_kda_backward gives the same gradients."""
    label = case[0]
    x, kw, do, dS = _mode_case_inputs(case)
    ro, rfs, ref = reference_grads(x, kw, do, dS)
    c = _to_cuda(x)
    leaves = {n: None if c[n] is None else c[n].detach().clone().requires_grad_() for n in _NAMES}
    o, fs = kda_ops.kda(*(leaves[n] for n in _NAMES), cu_seqlens=c["cu_seqlens"], output_final_state=True, **kw)
    assert rel_rms(o, ro) <= TOL_OUT, f"{label}: output rel RMS {rel_rms(o, ro):.2e}"
    assert rel_rms(fs, rfs) <= TOL_STATE, f"{label}: final state rel RMS {rel_rms(fs, rfs):.2e}"
    (o.float() * do.cuda().float()).sum().add((fs * dS.cuda()).sum()).backward()
    grads = [None if leaves[n] is None else leaves[n].grad for n in _NAMES]
    if x["initial_state"] is None:
        ref = ref[:7] + [None]
        grads = grads[:7] + [None]
    _check_mode_grads(label + " kda", grads, ref)
    if x["initial_state"] is not None:
        args = [c[n] for n in _NAMES]
        g2 = kda_ops.recurrent_kda_backward(*args, do.cuda(), dS.cuda(), cu_seqlens=c["cu_seqlens"], **kw)
        _check_mode_grads(label + " recurrent_kda_backward", list(g2), ref)
    # the route: the CUDA kernels in every mode, K = V = 64 included (a silent fall-back to the host route
    # would refuse the capture)
    _check_backward_route(label, c, kw, do.cuda(), dS.cuda(), kernels=True)


@pytest.mark.parametrize("mode", [("lower_bound", True, True), ("softplus", True, False)], ids=mode_id)
def test_k64_strided_inputs_same_bits(mode):
    """K = V = 64 training from views (channels 0-63 of 128-channel rows, tokens of q and k every other row of a
    longer tensor, an offset base): the zero-padding copies read any vector-readable layout, so the output, final
    state and the eight gradients equal those of compact copies bit for bit."""
    x, kw, do, dS = make_case(mode, T=150, H=2, HV=2, K=64, seed=41, lb=-1.0)
    c = _to_cuda(x)

    def view_of(t, tokens_apart):  # t [B, T, H, 64] as channels 8-71 of a wider, longer tensor (strides % 8 == 0)
        B, T, H, K = t.shape
        big = torch.randn(B, T * tokens_apart, H, 2 * K, device=t.device, dtype=t.dtype)
        v = big[:, ::tokens_apart, :, 8 : 8 + K]
        v.copy_(t)
        return v

    strided = dict(c)
    for n, apart in (("q", 2), ("k", 2), ("v", 1), ("g", 1)):
        strided[n] = view_of(c[n], apart)
        assert not strided[n].is_contiguous() and torch.equal(strided[n], c[n])

    def run(t):
        leaves = {n: None if t[n] is None else t[n].detach().requires_grad_() for n in _NAMES}
        o, fs = kda_ops.kda(*(leaves[n] for n in _NAMES), cu_seqlens=None, output_final_state=True, **kw)
        (o.float() * do.cuda().float()).sum().add((fs * dS.cuda()).sum()).backward()
        return [o, fs] + [leaves[n].grad for n in _NAMES if leaves[n] is not None]

    for i, (a, b) in enumerate(zip(run(strided), run(c), strict=True)):
        assert torch.equal(a, b), f"result {i}: strided inputs differ from compact ones"


_SWEEP_CASES = [c for c in _MODE_CASES if c[0].endswith(("-K128-T65", "-K128-packed", "-K64-T17"))]
_SWEEP_CASES += [c for c in _MODE_CASES if c[0].endswith(("-T1024", "-T4097", "-K64-T1", "-K64-T200"))]


def _force_sweep(monkeypatch, sweep):
    """Skips where the sweep cannot run; sets the switch that forces it: wgmma64 (the Hopper 64-token sweep),
    sub16 (the 16-token sweep)."""
    if sweep == "wgmma64" and torch.cuda.get_device_capability() != (9, 0):
        pytest.skip("the 64-token sweep is the Hopper (sm_90a) kernel")
    if sweep == "sub16" and torch.cuda.get_device_properties(0).shared_memory_per_block_optin < 228032:
        pytest.skip("this GPU runs the small sweep by itself")
    route_env(monkeypatch, KDA_TRAINING_SWEEP=sweep)


# what KDA_VERBOSE=1 prints for the sweep the spine chose (csrc/kda/route/route_cuda.cu)
def _sweep_line(sweep: str) -> str:
    return f"kda route: training_backward sweep={sweep} "


@pytest.mark.parametrize("sweep", ["wgmma64", "sub16"])
@pytest.mark.parametrize("case", _SWEEP_CASES, ids=[c[0] for c in _SWEEP_CASES])
def test_each_sweep_every_mode(case, sweep, monkeypatch, capfd):
    """Each chunk-parallel sweep of the CUDA backward, forced by KDA_TRAINING_SWEEP (the verbose line names the one
    that ran): wgmma64, the Hopper 64-token sweep (sm_90a only), and sub16, the 16-token sweep of the other GPUs, in
    every mode: the eight gradients of recurrent_kda_backward against fp64 autograd, and two calls give the same
    bits."""
    _force_sweep(monkeypatch, sweep)
    route_env(monkeypatch, KDA_VERBOSE="1")
    label = case[0]
    x, kw, do, dS = _mode_case_inputs(case)
    ref = reference_grads(x, kw, do, dS)[2]
    c = _to_cuda(x)
    g = _raw_mode_backward(c, kw, do.cuda(), dS.cuda())
    g2 = _raw_mode_backward(c, kw, do.cuda(), dS.cuda())
    torch.cuda.synchronize()
    err = capfd.readouterr().err
    assert _sweep_line(sweep) in err, err[-500:]
    for n_, a, b in zip(GRADS, g, g2, strict=True):
        assert torch.equal(a, b), f"{label} {sweep}: {n_} differs between two runs"
    grads = [None if e is None else a for a, e in zip(g, ref, strict=True)]
    _check_mode_grads(f"{sweep} {label}", grads, ref)


@pytest.mark.parametrize("sweep", ["wgmma64", "sub16"])
@pytest.mark.parametrize("edge", list(EDGES))
def test_each_sweep_lower_bound_edges(edge, sweep, monkeypatch, capfd):
    """The lower-bound gate's edge inputs on each sweep (forced as in test_each_sweep_every_mode), T=130 (three
    tape chunks), λ = -5: gates pinned at the bound (every 16-token block decays by e^{-80}: the factorised
    exponents' widest case), no decay, small-norm q/k, near-collinear keys with β ≈ 1. The eight gradients of
    recurrent_kda_backward are finite and within 1e-2 of fp64 autograd through the token loop; pinned, the gate's
    three gradients are ~1e-18 in fp64 (below fp32's resolution of the sums that form them), so they are only held
    finite and below 1e-4."""
    _force_sweep(monkeypatch, sweep)
    route_env(monkeypatch, KDA_VERBOSE="1")
    x, kw, do, dS = make_case(("lower_bound", True, True), T=130, H=1, HV=2, K=128, seed=7, lb=-5.0)
    EDGES[edge](x)
    ref = reference_grads(x, kw, do, dS)[2]
    g = _raw_mode_backward(_to_cuda(x), kw, do.cuda(), dS.cuda())
    torch.cuda.synchronize()
    err = capfd.readouterr().err
    assert _sweep_line(sweep) in err, err[-500:]
    label = f"{sweep} lower-bound {edge}"
    if edge == "pinned":
        for n_ in PINNED_UNCOMPARED:
            i = GRADS.index(n_)
            assert torch.isfinite(g[i].float()).all(), f"{label}: {n_} not finite"
            assert g[i].float().abs().max() < 1e-4, f"{label}: {n_} max {g[i].float().abs().max():.2e}"
        g = [None if n_ in PINNED_UNCOMPARED else a for n_, a in zip(GRADS, g, strict=True)]
        ref = [None if n_ in PINNED_UNCOMPARED else e for n_, e in zip(GRADS, ref, strict=True)]
    _check_mode_grads(label, list(g), ref)


@pytest.mark.parametrize(
    "mode", [("lower_bound", True, True), ("softplus", True, True), ("precomputed", True, False)], ids=mode_id
)
def test_automatic_sweep(mode, monkeypatch, capfd):
    """With KDA_TRAINING_SWEEP unset the backward picks its sweep itself (the verbose line names it): on sm_90a the
    64-token sweep for the lower-bound and softplus gates (log-decays <= 0 by construction) and the 16-token one for a
    precomputed g (whose log-decays may be positive); elsewhere the 16-token sweep. The gradients match fp64
    autograd either way."""
    _default_sweep_or_skip(monkeypatch)
    route_env(monkeypatch, KDA_VERBOSE="1")
    x, kw, do, dS = make_case(mode, T=130, H=2, HV=2, K=128, seed=3, lb=-5.0)
    ref = reference_grads(x, kw, do, dS)[2]
    g = _raw_mode_backward(_to_cuda(x), kw, do.cuda(), dS.cuda())
    torch.cuda.synchronize()
    hopper = torch.cuda.get_device_capability() == (9, 0)
    want = "wgmma64" if hopper and mode[0] != "precomputed" else "sub16"
    err = capfd.readouterr().err
    assert _sweep_line(want) in err, err[-500:]
    _check_mode_grads(f"automatic {mode[0]}", [None if e is None else a for a, e in zip(g, ref, strict=True)], ref)


def _default_sweep_or_skip(monkeypatch):
    """Skips on GPUs that run the small sweep by themselves; clears the switches that pick a sweep."""
    if torch.cuda.get_device_properties(0).shared_memory_per_block_optin < 228032:
        pytest.skip("this GPU runs the small sweep by itself (no default sweep to compare with)")
    route_env(monkeypatch, KDA_TRAINING_SWEEP=None)


_SMALL_MODES = [("lower_bound", True, True), ("softplus", False, True), ("precomputed", True, False)]


@pytest.mark.parametrize("mode", _SMALL_MODES, ids=mode_id)
@pytest.mark.parametrize("Kd", [128, 64])
def test_small_sweep_same_bits(mode, Kd, monkeypatch, capfd):
    """KDA_TRAINING_SWEEP=small runs the sweep of GPUs with ~99 KiB of shared memory per block (sm_120: S and
    dS in a global scratch, the tiles alone in shared memory) on this GPU: the same arithmetic as the default
    sweep, so the same bits; packed with a zero-length sequence and one past 64 tokens, GQA 2. The verbose line
    shows which sweep ran."""
    _default_sweep_or_skip(monkeypatch)
    x, kw, do, dS = make_case(mode, cu=[0, 150, 150, 167], H=1, HV=2, K=Kd, seed=23, lb=-1.0)
    c = _to_cuda(x)
    route_env(monkeypatch, KDA_VERBOSE="1")
    route_env(monkeypatch, KDA_TRAINING_SWEEP="sub16")  # (the 16-token sweep the small one shares its bits with)
    g_default = _raw_mode_backward(c, kw, do.cuda(), dS.cuda())
    torch.cuda.synchronize()
    assert _sweep_line("sub16") in capfd.readouterr().err
    route_env(monkeypatch, KDA_TRAINING_SWEEP="small")
    g_small = _raw_mode_backward(c, kw, do.cuda(), dS.cuda())
    torch.cuda.synchronize()
    assert _sweep_line("small") in capfd.readouterr().err
    for n_, a, b in zip(GRADS, g_small, g_default, strict=True):
        assert torch.equal(a, b), f"{n_}: the small sweep differs from the default one"
    ref = reference_grads(x, kw, do, dS)[2]
    grads = [None if e is None else a for a, e in zip(g_small, ref, strict=True)]  # (absent: empty tensors)
    _check_mode_grads(f"small sweep {mode_id(mode)} K{Kd}", grads, ref)


def test_small_sweep_reuses_its_scratch(monkeypatch):
    """More sweep tasks than SMs: each CTA of the persistent small sweep runs several tasks through its one
    global scratch; bit-equal to the default sweep (the sequence split off: one plain call)."""

    _default_sweep_or_skip(monkeypatch)
    route_env(monkeypatch, KDA_SEQUENCE_SPLIT="0")
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    T = 64 * (sms // 2 + 7)  # tasks = (T / 64) * HV > SMs with HV = 2
    x, kw, do, dS = make_case(("softplus", True, True), T=T, H=1, HV=2, K=128, seed=31)
    c = _to_cuda(x)
    route_env(monkeypatch, KDA_TRAINING_SWEEP="sub16")
    g_default = _raw_mode_backward(c, kw, do.cuda(), dS.cuda())
    route_env(monkeypatch, KDA_TRAINING_SWEEP="small")
    g_small = _raw_mode_backward(c, kw, do.cuda(), dS.cuda())
    for n_, a, b in zip(GRADS, g_small, g_default, strict=True):
        assert torch.equal(a, b), f"{n_}: the small sweep differs from the default one"


_SMALL_GPU_CHILD = r"""
import sys, torch
sys.path.insert(0, "tests")
from _training_cases import make_case, reference_grads
import kda_ops
mode = (sys.argv[1], sys.argv[2] == "logit", sys.argv[3] == "l2")
Kd = int(sys.argv[4])
x, kw, do, dS = make_case(mode, cu=[0, 150, 150, 230], H=2, HV=4, K=Kd, seed=29, lb=-5.0)
names = ("q", "k", "v", "g", "beta", "A_log", "dt_bias", "initial_state")
leaves = {n: None if x[n] is None else x[n].cuda().requires_grad_() for n in names}
o, fs = kda_ops.kda(*(leaves[n] for n in names), cu_seqlens=x["cu_seqlens"].cuda(), output_final_state=True, **kw)
(o.float() * do.cuda().float()).sum().add((fs * dS.cuda()).sum()).backward()
torch.save({"grads": [None if leaves[n] is None else leaves[n].grad.cpu() for n in names]}, sys.argv[5])
"""


@pytest.mark.parametrize("mode", _SMALL_MODES[:2], ids=mode_id)
def test_training_as_on_a_small_shared_memory_gpu(mode, tmp_path):
    """The whole training path a GPU with ~99 KiB of shared memory per block takes (sm_120), run on this one:
    KDA_CHUNKED_KERNEL=mma_small (the mma.sync kernel's shallow pipeline for the forward and the backward chain,
    in a child process: the switches are read at import) and KDA_TRAINING_SWEEP=small; the gradients of kda_ops.kda
    against fp64 autograd, K = V = 128 and 64."""
    import subprocess
    import sys

    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    env = {k_: v_ for k_, v_ in os.environ.items() if not k_.startswith(("KDA_CHUNKED_", "KDA_TRAINING_"))}
    env.update(KDA_CHUNKED_KERNEL="mma_small", KDA_TRAINING_SWEEP="small", KDA_VERBOSE="1")
    gate, logit, l2 = mode
    for Kd in (128, 64):
        path = str(tmp_path / f"g{Kd}.pt")
        argv = [gate, "logit" if logit else "plain", "l2" if l2 else "nol2", str(Kd), path]
        r = subprocess.run(
            [sys.executable, "-c", _SMALL_GPU_CHILD, *argv],
            capture_output=True,
            text=True,
            timeout=300,
            cwd=root,
            env=env,
        )
        assert r.returncode == 0, r.stderr[-4000:]
        assert _sweep_line("small") in r.stderr and _sweep_line("sub16") not in r.stderr
        assert "kernel=chunked_mma value_rows=64 pipeline=small" in r.stderr and "chunked_sm90" not in r.stderr
        x, kw, do, dS = make_case(mode, cu=[0, 150, 150, 230], H=2, HV=4, K=Kd, seed=29, lb=-5.0)
        grads = [None if t is None else t.cuda() for t in torch.load(path)["grads"]]
        _check_mode_grads(f"small gpu {mode_id(mode)} K{Kd}", grads, reference_grads(x, kw, do, dS)[2])


@pytest.mark.parametrize("mode", MODES, ids=mode_id)
def test_training_forward_every_mode_matches_cpu(mode):
    """The CUDA forward with tapes (the chunked kernel's checkpoints) against the CPU op in each mode: output,
    final state and the tapes, packed with a zero-length row, GQA 2."""
    cu = [0, 130, 130, 200]
    x, kw, _, _ = make_case(mode, cu=cu, H=1, HV=2, K=128, seed=1)
    args = [x[n] for n in _NAMES]
    o_c, fs_c, ctx_c = kda_ops.recurrent_kda_training_forward(*args, cu_seqlens=x["cu_seqlens"], **kw)
    c = _to_cuda(x)
    o_g, fs_g, ctx_g = kda_ops.recurrent_kda_training_forward(
        *(c[n] for n in _NAMES), cu_seqlens=c["cu_seqlens"], cu_seqlens_cpu=x["cu_seqlens"], **kw
    )
    assert rel_rms(o_g, o_c) <= TOL_OUT and rel_rms(fs_g, fs_c) <= TOL_STATE
    assert rel_rms(ctx_g.tapes, ctx_c.tapes) <= TOL_STATE
    assert torch.equal(ctx_g.tape_cu_starts.cpu(), ctx_c.tape_cu_starts)


# ---------------------------------------------------------------------------------------------------
# unbounded gates on the CUDA backward: the softplus and precomputed log-decays have no bound per token, so in a
# sub-chunk that decays by more than e^{-40} the sweep forms every decay factor as a pairwise e^{Γ_i - Γ_j},
# i >= j (csrc/kda/backward/sweep.cu, kUnbounded; the others take the factorised form of the lower-bound gate).
# Extreme gates, a = -1000 beside a = -1e-3 within one 16-token sub-chunk, would overflow e^{-Γ} (inf·0 = NaN
# in a factorised product).


def _extreme_case(gate, logit, l2, T, cu, H, HV, dtb, seed, band=False):
    """make_case inputs with extreme log-decays. precomputed: g per (token, channel) from {-1000, -30, -1e-3}
    (mostly -1e-3), and two whole tokens at -1000; softplus: g ~ 4 N(0, 1), dt_bias ~ 4 N(0, 1) (or None),
    A_log = log 50 on head 0 (a from ~-1e-6 to ~-1500) and log 2 on the others. band: make_case's moderate
    gates (sub-chunk decays mostly within e^{-40}) everywhere but tokens [32, 48) (the third 16-token sub-chunk
    of the first 64-token chunk), which get extreme ones (precomputed as above; softplus g from {400, -20}:
    a ≈ -600 beside ≈ -3e-9): the sweep switches between its factorised (narrow) and pairwise (wide)
    sub-chunks."""
    mode = (gate, logit, l2)
    x, kw, do, dS = make_case(mode, T=T, cu=cu, H=H, HV=HV, K=128, dtb=dtb, seed=seed)
    if band:
        g = x["g"].clone()
        if gate == "softplus":
            u = torch.rand(g[:, 32:48].shape, generator=torch.Generator().manual_seed(seed + 202))
            g[:, 32:48] = torch.where(u < 0.3, torch.full_like(u, 400.0), torch.full_like(u, -20.0)).to(g.dtype)
        else:
            g[:, 32:48] = _extreme_case(gate, logit, l2, T, cu, H, HV, dtb, seed)[0]["g"][:, 32:48]
        x["g"] = g
        return x, kw, do, dS
    gen = torch.Generator().manual_seed(seed + 101)
    B, Tt = x["q"].shape[:2]
    if gate == "precomputed":
        u = torch.rand(B, Tt, HV, 128, generator=gen)
        g = torch.full_like(u, -1e-3)
        g = torch.where(u < 0.25, torch.full_like(u, -1000.0), g)
        g = torch.where((u >= 0.25) & (u < 0.35), torch.full_like(u, -30.0), g)
        g[:, 5] = -1000.0  # whole tokens: every channel's span is wide in their sub-chunks
        g[:, min(21, Tt - 1)] = -1000.0
        x["g"] = g.to(torch.bfloat16)
    else:
        x["g"] = (torch.randn(B, Tt, HV, 128, generator=gen) * 4).to(torch.bfloat16)
        x["A_log"] = torch.tensor([math.log(50.0)] + [math.log(2.0)] * (HV - 1), dtype=torch.float32)
        if dtb:
            x["dt_bias"] = (torch.randn(HV, 128, generator=gen) * 4).float()
    return x, kw, do, dS


# (label, gate, beta_is_logit, l2, T or None, packed lengths or None, H, HV, dt_bias given, band)
_EXTREME_CASES = [
    ("precomputed-logit-l2-T80", "precomputed", True, True, 80, None, 1, 2, False, False),
    ("precomputed-plain-nol2-packed-gqa2", "precomputed", False, False, None, [37, 0, 113], 1, 2, False, False),
    ("softplus-logit-l2-T80", "softplus", True, True, 80, None, 1, 2, True, False),
    ("softplus-plain-l2-packed-gqa2", "softplus", False, True, None, [37, 0, 113], 1, 2, True, False),
    ("softplus-nodtb-logit-nol2-T150-H2", "softplus", True, False, 150, None, 2, 2, False, False),
    ("precomputed-band-logit-l2-T100", "precomputed", True, True, 100, None, 1, 2, False, True),
    ("softplus-band-logit-l2-T100-gqa2", "softplus", True, True, 100, None, 1, 2, True, True),
]


@pytest.mark.parametrize("case", _EXTREME_CASES, ids=[c[0] for c in _EXTREME_CASES])
def test_training_extreme_gates_vs_reference(case):
    """Softplus gates with a ≈ -50..-1500 on some tokens and precomputed gates mixing -1000 and -1e-3 within a
    sub-chunk (everywhere, or in one sub-chunk between moderate ones: band): the CUDA backward's eight gradients
    are finite and within 1e-2 relative RMS of fp64 autograd through the token loop (kda_ops/reference.py),
    through kda and recurrent_kda_backward, on the kernels."""
    label, gate, logit, l2, T, lengths, H, HV, dtb, band = case
    cu = None if lengths is None else lengths_to_cu(lengths).tolist()
    Tm = T if cu is None else 1
    x, kw, do, dS = _extreme_case(gate, logit, l2, Tm, cu, H, HV, dtb, seed=len(label), band=band)
    a = x["g"].double() if gate == "precomputed" else None
    if a is None:
        xx = x["g"].double() + (0.0 if x["dt_bias"] is None else x["dt_bias"].double())
        a = -torch.exp(x["A_log"].double())[:, None] * torch.nn.functional.softplus(xx, threshold=20.0)
    assert a.min() < -500 and a.max() > -0.01, f"{label}: the gates are not extreme ({a.min():.3g}, {a.max():.3g})"
    ro, rfs, ref = reference_grads(x, kw, do, dS)
    c = _to_cuda(x)
    leaves = {n: None if c[n] is None else c[n].detach().clone().requires_grad_() for n in _NAMES}
    o, fs = kda_ops.kda(*(leaves[n] for n in _NAMES), cu_seqlens=c["cu_seqlens"], output_final_state=True, **kw)
    assert torch.isfinite(o.float()).all() and torch.isfinite(fs).all(), f"{label}: forward not finite"
    assert rel_rms(o, ro) <= TOL_OUT, f"{label}: output rel RMS {rel_rms(o, ro):.2e}"
    assert rel_rms(fs, rfs) <= TOL_STATE, f"{label}: final state rel RMS {rel_rms(fs, rfs):.2e}"
    (o.float() * do.cuda().float()).sum().add((fs * dS.cuda()).sum()).backward()
    grads = [None if leaves[n] is None else leaves[n].grad for n in _NAMES]
    _check_mode_grads(label + " kda", grads, ref)
    args = [c[n] for n in _NAMES]
    g2 = kda_ops.recurrent_kda_backward(*args, do.cuda(), dS.cuda(), cu_seqlens=c["cu_seqlens"], **kw)
    _check_mode_grads(label + " recurrent_kda_backward", list(g2), ref)
    _check_backward_route(label, c, kw, do.cuda(), dS.cuda(), kernels=True)


# (label, extreme gates (True, "band" or False), mode, T or None, packed lengths or None, H, HV)
_DETERMINISM_CASES = [
    ("precomputed-extreme-packed-gqa2", True, ("precomputed", True, True), None, [70, 0, 130], 1, 2),
    ("precomputed-T200-H2", False, ("precomputed", False, False), 200, None, 2, 2),
    ("softplus-extreme-T200-gqa2", True, ("softplus", True, True), 200, None, 1, 2),
    ("softplus-packed-H2", False, ("softplus", True, False), None, [70, 0, 130], 2, 2),
    ("softplus-band-T200-gqa2", "band", ("softplus", True, True), 200, None, 1, 2),
]


@pytest.mark.parametrize("case", _DETERMINISM_CASES, ids=[c[0] for c in _DETERMINISM_CASES])
def test_backward_unbounded_gates_deterministic(case):
    """The CUDA backward of the softplus and precomputed gates (no atomics; fixed-order sums, the parameter
    partials one row per task): two runs give the same bits, every gradient, and they are finite."""
    label, extreme, mode, T, lengths, H, HV = case
    cu = None if lengths is None else lengths_to_cu(lengths).tolist()
    Tm = T if cu is None else 1
    if extreme:
        x, kw, do, dS = _extreme_case(*mode, Tm, cu, H, HV, True, seed=len(label), band=extreme == "band")
    else:
        x, kw, do, dS = make_case(mode, T=Tm, cu=cu, H=H, HV=HV, K=128, seed=len(label))
    c = _to_cuda(x)
    first = _raw_mode_backward(c, kw, do.cuda(), dS.cuda())
    second = _raw_mode_backward(c, kw, do.cuda(), dS.cuda())
    for n_, a, b in zip(GRADS, first, second, strict=True):
        assert torch.isfinite(a.float()).all(), f"{label}: {n_} not finite"
        assert torch.equal(a, b), f"{label}: {n_} differs between two runs"


@pytest.mark.skipif(
    not torch.cuda.is_available() or torch.cuda.get_device_capability() != (9, 0), reason="the Hopper kernel: sm_90"
)
@pytest.mark.parametrize("kernel", ["sm90", "mma"])
@pytest.mark.parametrize("gate", ["precomputed", "softplus"])
def test_backward_chain_kernels_extreme_gates(gate, kernel, monkeypatch):
    """The backward chain (and the forward) on either chunked kernel, forced by KDA_CHUNKED_KERNEL (the automatic
    choice takes the Hopper kernel only when the heads fill the SMs), with extreme unbounded gates, GQA 2: the
    eight gradients of recurrent_kda_backward within 1e-2 of fp64 autograd, finite."""
    route_env(monkeypatch, KDA_CHUNKED_KERNEL=kernel)
    label = f"{gate}-{kernel}-chain"
    x, kw, do, dS = _extreme_case(gate, True, True, 90, None, 2, 4, True, seed=31)
    _, _, ref = reference_grads(x, kw, do, dS)
    c = _to_cuda(x)
    grads = list(_raw_mode_backward(c, kw, do.cuda(), dS.cuda()))
    for i, r in enumerate(ref):
        if r is None:
            assert grads[i].numel() == 0, f"{label}: {GRADS[i]} of an absent parameter must be empty"
            grads[i] = None
    _check_mode_grads(label, grads, ref)
