"""The training ops in every mode of recurrent_kda (docs/contract.md "API", "Gradients"), CPU tier.

Modes: the gate (precomputed log-decay g with ``use_gate_in_kernel=False``, softplus with
``lower_bound=None``, lower bound), β logit or plain (``beta_is_logit``), the L2 norm on or off
(``use_qk_l2norm_in_kernel``). Every gradient of kda_ops.kda / recurrent_kda_backward /
recurrent_kda_training_backward against fp64 autograd through kda_ops/reference.py (relative RMS 1e-2),
fp64 gradcheck on tiny shapes, the packed batch against each sequence alone, and the None gradients of
absent parameters. Shapes stay small (T in {1, 17, 65}) to keep the file fast; the GPU tier runs the long T.
"""

from __future__ import annotations

import pytest
import torch
from _training_cases import GRADS, MODES, make_case, mode_id, reference_grads
from conftest import needs_cpu_op

import kda_ops
from kda_ops.reference import rel_rms

pytestmark = needs_cpu_op("recurrent_kda_training_forward", "recurrent_kda_training_backward", "recurrent_kda_backward")


def assert_grads_close(grads, ref, tol=1e-2, what=""):
    for name, a, e in zip(GRADS, grads, ref, strict=True):
        if e is None:
            assert a is None, f"{what}{name} must be None (no such parameter), got a tensor"
            continue
        assert a is not None, f"{what}{name} is None"
        assert a.shape == e.shape, f"{what}{name}: shape {tuple(a.shape)} != {tuple(e.shape)}"
        assert torch.isfinite(a.double()).all(), f"{what}{name} not finite"
        err = rel_rms(a, e)
        assert err <= tol, f"{what}{name}: rel RMS {err:.3e} > {tol}"


def kda_grads(x, kw, do, dS):
    """Gradients of <o, do> + <final_state, dS> through kda_ops.kda (autograd)."""
    names = ("q", "k", "v", "g", "beta", "A_log", "dt_bias", "initial_state")
    leaves = {n: None if x[n] is None else x[n].detach().clone().requires_grad_() for n in names}
    o, fs = kda_ops.kda(
        *(leaves[n] for n in names[:7]),
        leaves["initial_state"],
        cu_seqlens=x["cu_seqlens"],
        output_final_state=True,
        **kw,
    )
    (o.double() * do.double()).sum().add((fs.double() * dS.double()).sum()).backward()
    return o, fs, [None if leaves[n] is None else leaves[n].grad for n in names]


@pytest.mark.parametrize("mode", MODES, ids=mode_id)
@pytest.mark.parametrize("T", [1, 17, 65])
def test_kda_every_mode_matches_fp64_autograd(mode, T):
    """kda_ops.kda (forward op + registered autograd) in each mode: output, final state and the eight
    gradients against fp64 autograd through the token loop; GQA (HV = 2 H), bf16 tokens."""
    x, kw, do, dS = make_case(mode, T=T, H=1, HV=2, K=16, seed=T)
    o, fs, grads = kda_grads(x, kw, do, dS)
    ro, rfs, ref = reference_grads(x, kw, do, dS)
    assert rel_rms(o, ro) <= 1e-2 and rel_rms(fs, rfs) <= 1e-2
    assert_grads_close(grads, ref, what=f"{mode_id(mode)} T={T}: ")


@pytest.mark.parametrize("mode", MODES, ids=mode_id)
def test_backward_ops_every_mode_k64_packed(mode):
    """recurrent_kda_backward and the forward + training backward at K = V = 64, packed with a zero-length
    row, GQA 2, λ = -1 for the lower-bound gate: both equal fp64 autograd (and each other bit for bit)."""
    cu = [0, 17, 17, 30]
    x, kw, do, dS = make_case(mode, cu=cu, H=1, HV=2, K=64, seed=5, lb=-1.0)
    args = [x[n] for n in ("q", "k", "v", "g", "beta", "A_log", "dt_bias", "initial_state")]
    g1 = kda_ops.recurrent_kda_backward(*args, do, dS, cu_seqlens=x["cu_seqlens"], **kw)
    _, _, ctx = kda_ops.recurrent_kda_training_forward(*args, cu_seqlens=x["cu_seqlens"], **kw)
    g2 = kda_ops.recurrent_kda_training_backward(ctx, do, dS)
    _, _, ref = reference_grads(x, kw, do, dS)
    assert_grads_close(g1, ref, what=f"recurrent_kda_backward {mode_id(mode)}: ")
    for name, a, b in zip(GRADS, g1, g2, strict=True):
        assert (a is None) == (b is None), name
        if a is not None:
            assert torch.equal(a, b), f"{name}: recurrent_kda_backward != forward + training backward"


@pytest.mark.parametrize("mode", MODES, ids=mode_id)
def test_gradcheck_every_mode(mode):
    """fp64 gradcheck of kda_ops.kda over every present input: packed with a zero-length row, GQA 2."""
    cu = [0, 2, 2, 5]
    x, kw, _, _ = make_case(mode, cu=cu, H=1, HV=2, K=4, dtype=torch.float64, seed=11)
    names = ("q", "k", "v", "g", "beta", "A_log", "dt_bias", "initial_state")
    present = [n for n in names if x[n] is not None]
    leaves = [x[n].detach().clone().requires_grad_() for n in present]

    def f(*ts):
        d = dict(zip(present, ts, strict=True))
        return kda_ops.kda(
            *(d.get(n) for n in names[:7]),
            d.get("initial_state"),
            cu_seqlens=x["cu_seqlens"],
            output_final_state=True,
            **kw,
        )

    assert torch.autograd.gradcheck(f, leaves, eps=1e-6, atol=1e-6, rtol=1e-4)


@pytest.mark.parametrize(
    "mode", [("softplus", False, False), ("precomputed", True, True), ("lower_bound", False, True)], ids=mode_id
)
def test_packed_equals_each_sequence_alone(mode):
    """Per-sequence gradients of a packed batch (with a zero-length row, no initial state) equal each sequence
    run alone; the parameter gradients are the sums over the sequences."""
    cu = [0, 17, 17, 82]
    x, kw, do, dS = make_case(mode, cu=cu, H=1, HV=2, K=16, dtype=torch.float32, init=False, seed=3)
    names = ("q", "k", "v", "g", "beta", "A_log", "dt_bias")
    packed = kda_ops.recurrent_kda_backward(
        *(x[n] for n in names), torch.zeros(3, 2, 16, 16), do, dS, cu_seqlens=x["cu_seqlens"], **kw
    )
    sums = [None if x[n] is None else torch.zeros_like(x[n]) for n in ("A_log", "dt_bias")]
    for n in range(3):
        lo, hi = cu[n], cu[n + 1]
        tok = {m: x[m][:, lo:hi] for m in ("q", "k", "v", "g", "beta")}
        alone = kda_ops.recurrent_kda_backward(
            *(tok[m] for m in ("q", "k", "v", "g", "beta")),
            x["A_log"],
            x["dt_bias"],
            torch.zeros(1, 2, 16, 16),
            do[:, lo:hi],
            dS[n : n + 1],
            **kw,
        )
        for i in range(5):
            torch.testing.assert_close(packed[i][:, lo:hi], alone[i], rtol=1e-5, atol=1e-6)
        torch.testing.assert_close(packed[7][n : n + 1], alone[7], rtol=1e-5, atol=1e-6)
        for j in range(2):
            if sums[j] is not None:
                sums[j] += alone[5 + j]
    for j in range(2):
        if sums[j] is None:
            assert packed[5 + j] is None
        else:
            torch.testing.assert_close(packed[5 + j], sums[j], rtol=1e-4, atol=1e-6)


def test_absent_parameters_have_none_gradients():
    """dA_log and ddt_bias are None when the gate does not use them (precomputed gate), ddt_bias None for the
    softplus gate without dt_bias; out= takes None at those places and refuses a tensor there."""
    x, kw, do, dS = make_case(("precomputed", True, True), T=17, dtype=torch.float32)
    args = [x[n] for n in ("q", "k", "v", "g", "beta", "A_log", "dt_bias", "initial_state")]
    gr = kda_ops.recurrent_kda_backward(*args, do, dS, **kw)
    assert gr[5] is None and gr[6] is None and all(t is not None for i, t in enumerate(gr) if i not in (5, 6))
    outs = [None if t is None else torch.empty_like(t) for t in gr]
    got = kda_ops.recurrent_kda_backward(*args, do, dS, out=outs, **kw)
    assert got[5] is None and got[6] is None and all(torch.equal(a, b) for a, b in zip(got[:5], gr[:5], strict=True))
    bad = list(outs)
    bad[5] = torch.empty(2)
    with pytest.raises(ValueError, match="dA_log"):
        kda_ops.recurrent_kda_backward(*args, do, dS, out=bad, **kw)

    x, kw, do, dS = make_case(("softplus", True, True), T=17, dtype=torch.float32, dtb=False)
    args = [x[n] for n in ("q", "k", "v", "g", "beta", "A_log", "dt_bias", "initial_state")]
    _, _, ctx = kda_ops.recurrent_kda_training_forward(*args, **kw)
    gr = kda_ops.recurrent_kda_training_backward(ctx, do, dS)
    assert gr[5] is not None and gr[5].shape == (2,) and gr[6] is None
    _, _, ref = reference_grads(x, kw, do, dS)
    assert_grads_close(gr, ref)


def test_mode_argument_errors():
    """Bad mode arguments name the argument, before anything runs."""
    x, kw, do, dS = make_case(("softplus", True, True), T=3, dtype=torch.float32)
    args = [x[n] for n in ("q", "k", "v", "g", "beta", "A_log", "dt_bias", "initial_state")]
    with pytest.raises(ValueError, match="A_log must be None"):
        kda_ops.kda(*args, use_gate_in_kernel=False)
    with pytest.raises(ValueError, match="A_log must be a"):
        kda_ops.kda(*args[:5], None, None, args[7])
    with pytest.raises(TypeError, match="beta_is_logit"):
        kda_ops.kda(*args, beta_is_logit=1)
    with pytest.raises(TypeError, match="use_qk_l2norm_in_kernel"):
        kda_ops.recurrent_kda_backward(*args, do, dS, use_qk_l2norm_in_kernel=None)
    with pytest.raises(ValueError, match="lower_bound"):
        kda_ops.recurrent_kda_training_forward(*args, lower_bound=-6.0)
    # the raw op checks its gate arguments too
    with pytest.raises(ValueError, match="gate_mode"):
        torch.ops.kda.recurrent_kda_training_forward(*args, None, 0.25, -5.0, 3, True, True)
    with pytest.raises(ValueError, match="A_log and dt_bias must be None"):
        torch.ops.kda.recurrent_kda_training_forward(*args, None, 0.25, -5.0, 0, True, True)


def test_default_modes_unchanged():
    """The defaults are the original training contract: the op without the mode arguments equals the call
    with lower-bound gate, L2 norm and logit β spelled out, bit for bit."""
    x, kw, do, dS = make_case(("lower_bound", True, True), T=17, dtype=torch.float32)
    args = [x[n] for n in ("q", "k", "v", "g", "beta", "A_log", "dt_bias", "initial_state")]
    old = torch.ops.kda.recurrent_kda_backward(*args, None, do, dS, 0.25, -5.0)
    new = torch.ops.kda.recurrent_kda_backward(*args, None, do, dS, 0.25, -5.0, 2, True, True)
    for a, b in zip(old, new, strict=True):
        assert torch.equal(a, b)
    api = kda_ops.recurrent_kda_backward(*args, do, dS, scale=0.25)
    for a, b in zip(api, new, strict=True):
        assert torch.equal(a, b)


@pytest.mark.parametrize("mode", [("precomputed", False, False), ("softplus", True, False)], ids=mode_id)
def test_fake_and_opcheck_new_modes(mode):
    """The fake kernels and the autograd registration agree with the real op in the new modes (opcheck)."""
    x, kw, do, dS = make_case(mode, T=5, dtype=torch.float32, dtb=False)
    gm = 0 if mode[0] == "precomputed" else 1
    base = [x[n] for n in ("q", "k", "v", "g", "beta", "A_log", "dt_bias")]
    fwd = (*base, x["initial_state"], None, 0.25, 0.0, gm, mode[2], mode[1])
    torch.library.opcheck(torch.ops.kda.recurrent_kda_training_forward.default, fwd)
    bwd = (*base, x["initial_state"], None, do, dS, 0.25, 0.0, gm, mode[2], mode[1])
    torch.library.opcheck(torch.ops.kda.recurrent_kda_backward.default, bwd)
