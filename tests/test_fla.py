"""kda_ops.fla against fla's own reference (fla.ops.kda.naive, fla-core 0.6.0) on CPU: forward of every
mode of chunk_kda / fused_recurrent_kda / fused_recurrent_kda_fwd, gradients of the training path,
the errors for what is not supported, and the routing of fla's own chunk_kda through fla.install().

fp32 on CPU; shapes over fla's usual axes (B, T, H, HV, D in {64, 128}) kept small for a 2-core CI.
"""

from __future__ import annotations

import inspect
import os
import re
import sys

import pytest
import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from test_fla_ref import close, fla_inputs, fla_reference  # noqa: E402

import kda_ops  # noqa: E402
from kda_ops import fla as kf  # noqa: E402

fla_chunk = pytest.importorskip("fla.ops.kda.chunk", reason="fla-core is not importable")
fla_rec = pytest.importorskip("fla.ops.kda.fused_recurrent", reason="fla-core is not importable")

TOL = 2e-5  # fp32 against fp32: both accumulate in fp32, only summation orders differ
GRAD_TOL = 1e-4


def _qkvgb(x: dict) -> tuple[torch.Tensor, ...]:
    """The five per-token inputs of a case, in call order."""
    return tuple(x[n] for n in ("q", "k", "v", "g", "beta"))


def _gate_kwargs(x: dict, gate: str, lower_bound: float | None) -> dict:
    if gate == "pre":
        return {}
    kw = dict(use_gate_in_kernel=True, A_log=x["A_log"], dt_bias=x["dt_bias"], use_beta_sigmoid_in_kernel=True)
    if gate == "lower_bound":
        kw["lower_bound"] = lower_bound
    return kw


def _ref(x: dict, gate: str, *, lower_bound=None, h0=True, l2=False, scale=None, cu=None, **kw):
    return fla_reference(
        *_qkvgb(x), scale=scale, h0=x.get("h0") if h0 else None,
        A_log=x.get("A_log"), dt_bias=x.get("dt_bias"), gate=gate, lower_bound=lower_bound, l2=l2,
        beta_sigmoid=gate != "pre", cu_seqlens=cu, **kw,
    )  # fmt: skip


def test_signatures_match_fla() -> None:
    # Same parameter names, order and defaults as fla 0.6 (the drop-in promise).
    for ours, theirs in (
        (kf.chunk_kda, fla_chunk.chunk_kda),
        (kf.fused_recurrent_kda, fla_rec.fused_recurrent_kda),
        (kf.fused_recurrent_kda_fwd, fla_rec.fused_recurrent_kda_fwd),
    ):
        a = [(p.name, p.default, p.kind) for p in inspect.signature(ours).parameters.values()]
        b = [(p.name, p.default, p.kind) for p in inspect.signature(inspect.unwrap(theirs)).parameters.values()]
        assert a == b, ours.__name__


# ---------------------------------------------------------------------------------------------------
# forward, no autograd (the inference path)

FWD_CASES = [
    # B, T, H, HV, D, gate, lower_bound, l2, scale, v_first, packed
    (2, 37, 2, 2, 64, "pre", None, False, None, False, None),
    (1, 50, 1, 2, 128, "softplus", None, True, None, False, None),
    (2, 20, 2, 4, 64, "lower_bound", -5.0, True, 0.3, True, None),
    (1, 100, 2, 4, 64, "softplus", None, True, None, True, [0, 15, 15, 64, 100]),
    (1, 70, 1, 1, 128, "lower_bound", -2.0, True, None, False, [0, 33, 70]),
]


@pytest.mark.parametrize("B,T,H,HV,D,gate,lb,l2,scale,v_first,cu", FWD_CASES)
@pytest.mark.parametrize("fn", ["chunk_kda", "fused_recurrent_kda"])
def test_forward_matches_fla_naive(B, T, H, HV, D, gate, lb, l2, scale, v_first, cu, fn) -> None:
    N = B if cu is None else len(cu) - 1
    x = fla_inputs(B, T, H, HV, D, gate=gate, N=N, seed=T + D)
    o_ref, h_ref = _ref(x, gate, lower_bound=lb, l2=l2, scale=scale, cu=cu)
    h0 = x["h0"].transpose(-1, -2).contiguous() if v_first else x["h0"].clone()
    h0_before = h0.clone()
    kw = _gate_kwargs(x, gate, lb)
    if gate == "lower_bound" and fn == "chunk_kda":
        kw["safe_gate"] = True
    cu_t = None if cu is None else torch.tensor(cu, dtype=torch.long)
    f = getattr(kf, fn)
    with torch.inference_mode():
        o, ht = f(*_qkvgb(x), scale=scale, initial_state=h0, output_final_state=True,
                  use_qk_l2norm_in_kernel=l2, state_v_first=v_first, cu_seqlens=cu_t, **kw)  # fmt: skip
    close(o, o_ref, TOL, "o")
    assert ht.dtype == torch.float32 and ht.is_contiguous()
    close(ht, h_ref.transpose(-1, -2) if v_first else h_ref, TOL, "final_state")
    assert torch.equal(h0, h0_before), "initial_state must not be modified"


def test_forward_without_state_and_neg_eigval() -> None:
    x = fla_inputs(2, 30, 1, 2, 64, gate="softplus", with_state=False)
    o_ref, h_ref = _ref(x, "softplus", h0=False, l2=True, allow_neg_eigval=True)
    kw = _gate_kwargs(x, "softplus", None)
    with torch.no_grad():
        o, ht = kf.chunk_kda(*_qkvgb(x), output_final_state=True,
                             use_qk_l2norm_in_kernel=True, allow_neg_eigval=True, **kw)  # fmt: skip
        o2, ht2 = kf.chunk_kda(*_qkvgb(x), use_qk_l2norm_in_kernel=True,
                               allow_neg_eigval=True, **kw)  # fmt: skip
    close(o, o_ref, TOL, "o")
    close(ht, h_ref, TOL, "final_state")
    assert ht2 is None and torch.equal(o2, o)


def test_lower_bound_gate_without_A_log() -> None:
    # fla: with lower_bound, A_log may be None -> lower_bound * sigmoid(g + dt_bias)
    x = fla_inputs(1, 24, 2, 2, 64, gate="lower_bound")
    x["A_log"] = None
    o_ref, h_ref = _ref(x, "lower_bound", lower_bound=-3.0, l2=True)
    with torch.no_grad():
        o, ht = kf.chunk_kda(*_qkvgb(x), initial_state=x["h0"], output_final_state=True,
                             use_qk_l2norm_in_kernel=True, use_gate_in_kernel=True, use_beta_sigmoid_in_kernel=True,
                             lower_bound=-3.0, dt_bias=x["dt_bias"])  # fmt: skip
    close(o, o_ref, TOL, "o")
    close(ht, h_ref, TOL, "final_state")


def test_naive_chunk_form_agrees() -> None:
    # fla's naive *chunk* form (T a multiple of 64) as the reference of chunk_kda
    x = fla_inputs(1, 128, 1, 2, 64, gate="pre")
    o_ref, h_ref = _ref(x, "pre", chunk=True)
    with torch.no_grad():
        o, ht = kf.chunk_kda(*_qkvgb(x), initial_state=x["h0"], output_final_state=True)
    close(o, o_ref, 1e-4, "o")
    close(ht, h_ref, 1e-4, "final_state")


@pytest.mark.parametrize("v_first", [False, True])
@pytest.mark.parametrize("packed", [False, True])
def test_return_intermediate_states(v_first, packed) -> None:
    # h[:, c] is the state before chunk c of each sequence (fla's vLLM prefix-cache output)
    T, D = 130, 64
    cu = [0, 70, 130] if packed else None
    x = fla_inputs(1 if packed else 2, T if packed else 65, 1, 2, D, gate="pre", N=2)
    h0 = x["h0"].transpose(-1, -2).contiguous() if v_first else x["h0"]
    cu_t = None if cu is None else torch.tensor(cu)
    with torch.inference_mode():
        o, ht, h = kf.chunk_kda(*_qkvgb(x), initial_state=h0, output_final_state=True,
                                return_intermediate_states=True, state_v_first=v_first, cu_seqlens=cu_t,
                                cu_seqlens_cpu=cu_t)  # fmt: skip
    seqs = [(0, 70), (70, 130)] if packed else [(0, 65), (0, 65)]
    want = []
    for n, (a, b) in enumerate(seqs):
        bi = 0 if packed else n
        for c in range(a, b, 64):
            if c == a:
                s = x["h0"][n : n + 1]
            else:
                sub = {kk: x[kk][bi : bi + 1, a:c] for kk in ("q", "k", "v", "g", "beta")}
                sub["h0"] = x["h0"][n : n + 1]
                s = _ref(sub, "pre")[1]
            want.append(s)
    want_t = torch.cat(want, 0).view(1 if packed else 2, -1, *want[0].shape[1:])
    assert h.dtype == x["q"].dtype
    assert h.shape == want_t.shape
    close(h, want_t.transpose(-1, -2) if v_first else want_t, TOL, "h")


# ---------------------------------------------------------------------------------------------------
# fused_recurrent_kda_fwd: vLLM / SGLang decode on a pool


def _pool_ref_decode(x, pool_kv, idx, n_acc, T_per, gate, lb):
    """Reference of one continuous-batching call on a [P, HV, K, V] pool: (o, new pool)."""
    pool = pool_kv.clone()
    N = idx.shape[0]
    outs = []
    for n in range(N):
        row = idx[n] if idx.dim() == 2 else idx[n : n + 1]
        start = row[(int(n_acc[n]) - 1) if n_acc is not None else 0]
        sl = slice(n * T_per, (n + 1) * T_per)
        if not (0 <= int(start) < pool.shape[0]):
            outs.append(torch.zeros_like(x["v"][:, sl]))
            continue
        sub = {kk: x[kk][:, sl] for kk in ("q", "k", "v", "g", "beta")}
        sub.update(A_log=x.get("A_log"), dt_bias=x.get("dt_bias"), h0=pool_kv[int(start)][None])
        o, _ = _ref(sub, gate, lower_bound=lb, l2=True)
        outs.append(o)
        for t in range(T_per):
            slot = int(row[t]) if idx.dim() == 2 else int(row[0])
            if idx.dim() == 1 and t != T_per - 1:
                continue
            if 0 <= slot < pool.shape[0]:
                pre = {kk: v[:, : t + 1] for kk, v in sub.items() if kk in ("q", "k", "v", "g", "beta")}
                pre.update(A_log=sub["A_log"], dt_bias=sub["dt_bias"], h0=sub["h0"])
                pool[slot] = _ref(pre, gate, lower_bound=lb, l2=True)[1][0]
    return torch.cat(outs, 1), pool


@pytest.mark.parametrize("v_first", [False, True])
@pytest.mark.parametrize("mode", ["decode", "spec"])
def test_fused_recurrent_kda_fwd_pool(v_first, mode) -> None:
    D, HV, P = 64, 2, 9
    N, S = 3, (2 if mode == "spec" else 0)
    T_per = 1 + S
    gate, lb = "lower_bound", -5.0
    x = fla_inputs(1, N * T_per, 1, HV, D, gate=gate, with_state=False, seed=3)
    pool_kv = torch.randn(P, HV, D, D, generator=torch.Generator().manual_seed(4)) * 0.2
    if mode == "spec":
        idx = torch.tensor([[4, 5, 6], [0, 1, 2], [-1, -1, -1]], dtype=torch.int32)
        n_acc = torch.tensor([2, 3, 1], dtype=torch.int32)
    else:
        idx = torch.tensor([7, -1, 2], dtype=torch.int32)  # -1: vLLM's padding slot (inactive)
        n_acc = None
    cu = torch.arange(N + 1, dtype=torch.int32) * T_per
    o_ref, pool_ref = _pool_ref_decode(x, pool_kv, idx, n_acc, T_per, gate, lb)
    pool = (pool_kv.transpose(-1, -2) if v_first else pool_kv).contiguous().clone()
    with torch.inference_mode():
        o, ret = kf.fused_recurrent_kda_fwd(
            *_qkvgb(x), A_log=x["A_log"], dt_bias=x["dt_bias"], initial_state=pool,
            state_v_first=v_first, cu_seqlens=cu, ssm_state_indices=idx, num_accepted_tokens=n_acc,
            use_qk_l2norm_in_kernel=True, use_gate_in_kernel=True, use_beta_sigmoid_in_kernel=True, lower_bound=lb,
        )  # fmt: skip
    assert ret is pool
    close(o, o_ref, TOL, "o")
    close(pool, pool_ref.transpose(-1, -2) if v_first else pool_ref, TOL, "pool")
    if mode == "decode":
        assert torch.count_nonzero(o[:, 1]) == 0
        untouched = [s for s in range(P) if s not in (7, 2)]
        want = pool_kv.transpose(-1, -2) if v_first else pool_kv
        assert torch.equal(pool[untouched], want[untouched].contiguous())


def test_fused_recurrent_kda_fwd_inplace_slot_n() -> None:
    # no ssm_state_indices: sequence n updates slot n in place, the pool is returned
    x = fla_inputs(2, 5, 1, 1, 64, gate="pre", with_state=True)
    pool = x["h0"].clone()
    o_ref, h_ref = _ref(x, "pre")
    with torch.no_grad():
        o, ret = kf.fused_recurrent_kda_fwd(*_qkvgb(x), initial_state=pool)
    assert ret is pool
    close(o, o_ref, TOL, "o")
    close(pool, h_ref, TOL, "pool")


# ---------------------------------------------------------------------------------------------------
# gradients: chunk_kda under autograd = the training path


GRAD_CASES = [
    # B, T, H, HV, D, scale, packed, with_state
    (2, 40, 1, 2, 64, None, None, True),
    (1, 90, 2, 2, 64, 0.25, [0, 20, 20, 90], True),
    (1, 33, 1, 1, 128, None, None, False),
]


@pytest.mark.parametrize("B,T,H,HV,D,scale,cu,with_state", GRAD_CASES)
def test_chunk_kda_gradients_match_fla_naive(B, T, H, HV, D, scale, cu, with_state) -> None:
    lb = -5.0
    N = B if cu is None else len(cu) - 1
    x = fla_inputs(B, T, H, HV, D, gate="lower_bound", N=N, with_state=with_state, seed=T)
    names = ["q", "k", "v", "g", "beta", "A_log", "dt_bias"] + (["h0"] if with_state else [])
    leaves_ref = {n: x[n].clone().requires_grad_() for n in names}
    leaves = {n: x[n].clone().requires_grad_() for n in names}
    gen = torch.Generator().manual_seed(9)
    do = torch.randn(x["v"].shape, generator=gen)
    dht = torch.randn(N, HV, D, D, generator=gen)

    o_ref, h_ref = _ref(leaves_ref, "lower_bound", lower_bound=lb, l2=True, scale=scale, cu=cu, h0=with_state)
    ((o_ref * do).sum() + (h_ref * dht).sum()).backward()
    cu_t = None if cu is None else torch.tensor(cu, dtype=torch.long)
    o, ht = kf.chunk_kda(
        leaves["q"], leaves["k"], leaves["v"], leaves["g"], leaves["beta"], scale=scale,
        initial_state=leaves.get("h0"), output_final_state=True, use_qk_l2norm_in_kernel=True,
        use_gate_in_kernel=True, use_beta_sigmoid_in_kernel=True, safe_gate=True, lower_bound=lb,
        cu_seqlens=cu_t, cu_seqlens_cpu=cu_t, A_log=leaves["A_log"], dt_bias=leaves["dt_bias"],
    )  # fmt: skip
    assert o.grad_fn is not None
    ((o * do).sum() + (ht * dht).sum()).backward()
    close(o.detach(), o_ref.detach(), TOL, "o")
    close(ht.detach(), h_ref.detach(), TOL, "final_state")
    for n in names:
        assert leaves[n].grad is not None, n
        assert leaves[n].grad.shape == x[n].shape, n
        close(leaves[n].grad, leaves_ref[n].grad, GRAD_TOL, f"d{n}")


# ---------------------------------------------------------------------------------------------------
# what is not supported: a NotImplementedError naming it


def _small(grad: bool = False) -> dict:
    x = fla_inputs(1, 8, 1, 1, 64, gate="lower_bound")
    if grad:
        x["q"].requires_grad_()
    return x


# every mode of fla's chunk_kda under autograd: gate, β (logit, plain, 2·sigmoid), L2, GVA, the state's layout
MODE_CASES = [
    # gate, lower_bound, beta_sigmoid, allow_neg_eigval, l2, H, HV, v_first, with dt_bias
    ("pre", None, False, False, False, 1, 2, False, True),
    ("pre", None, True, False, True, 2, 2, True, True),
    ("softplus", None, True, False, True, 1, 2, False, True),
    ("softplus", None, False, False, False, 1, 1, True, False),
    ("lower_bound", -3.0, True, True, True, 1, 2, False, True),
    ("lower_bound", -5.0, False, False, False, 2, 4, True, True),
    ("lower_bound", -1.0, True, False, False, 1, 2, False, False),
]


@pytest.mark.parametrize("gate,lb,beta_sigmoid,neg,l2,H,HV,v_first,with_dtb", MODE_CASES)
def test_chunk_kda_gradients_every_mode(gate, lb, beta_sigmoid, neg, l2, H, HV, v_first, with_dtb) -> None:
    """chunk_kda under autograd in each mode fla's KDA layer can ask for, against autograd through fla's naive
    functions: the output, the final state and the gradients of every input (q, k, v, g, beta, A_log, dt_bias,
    initial_state in the caller's layout), packed with an empty sequence."""
    cu = [0, 30, 30, 70]
    N, D, T = len(cu) - 1, 64, cu[-1]
    x = fla_inputs(1, T, H, HV, D, gate="lower_bound" if gate != "pre" else "pre", N=N, seed=17 + HV)
    if gate == "pre" and beta_sigmoid:  # logits for the in-kernel sigmoid
        x["beta"] = torch.randn(x["beta"].shape, generator=torch.Generator().manual_seed(3))
    if not l2:  # unnormalised keys of norm ~1, so that the plain recurrence stays bounded
        x["q"], x["k"] = x["q"] / D**0.5, x["k"] / D**0.5
    names = ["q", "k", "v", "g", "beta", "h0"] + (
        [] if gate == "pre" else ["A_log"] + (["dt_bias"] if with_dtb else [])
    )
    leaves_ref = {n: x[n].clone().requires_grad_() for n in names}
    leaves = {n: x[n].clone().requires_grad_() for n in names}
    gen = torch.Generator().manual_seed(9)
    do = torch.randn(x["v"].shape, generator=gen)
    dht = torch.randn(N, HV, D, D, generator=gen)

    ref_in = dict(leaves_ref)
    if gate != "pre" and not with_dtb:
        ref_in["dt_bias"] = torch.zeros_like(x["dt_bias"])
    o_ref, h_ref = fla_reference(
        *_qkvgb(ref_in), h0=ref_in["h0"], A_log=ref_in.get("A_log"), dt_bias=ref_in.get("dt_bias"), gate=gate,
        lower_bound=lb, l2=l2, beta_sigmoid=beta_sigmoid, allow_neg_eigval=neg, cu_seqlens=cu,
    )  # fmt: skip
    ((o_ref * do).sum() + (h_ref * dht).sum()).backward()
    cu_t = torch.tensor(cu, dtype=torch.long)
    h0 = leaves["h0"].transpose(-1, -2) if v_first else leaves["h0"]
    gate_kw = {} if gate == "pre" else dict(use_gate_in_kernel=True, A_log=leaves["A_log"], lower_bound=lb)
    if gate != "pre" and with_dtb:
        gate_kw["dt_bias"] = leaves["dt_bias"]
    o, ht = kf.chunk_kda(
        *_qkvgb(leaves), initial_state=h0, output_final_state=True, use_qk_l2norm_in_kernel=l2,
        use_beta_sigmoid_in_kernel=beta_sigmoid, allow_neg_eigval=neg, state_v_first=v_first, cu_seqlens=cu_t,
        cu_seqlens_cpu=cu_t, **gate_kw,
    )  # fmt: skip
    assert o.grad_fn is not None
    ht = ht.transpose(-1, -2) if v_first else ht
    ((o * do).sum() + (ht * dht).sum()).backward()
    close(o.detach(), o_ref.detach(), TOL, "o")
    close(ht.detach(), h_ref.detach(), TOL, "final_state")
    for n in names:
        assert leaves[n].grad is not None, n
        close(leaves[n].grad, leaves_ref[n].grad, GRAD_TOL, f"d{n}")


def test_training_lower_bound_below_the_safe_range() -> None:
    x = _small(grad=True)
    with pytest.raises(NotImplementedError, match="lower_bound"):
        kf.chunk_kda(*_qkvgb(x), use_gate_in_kernel=True, use_beta_sigmoid_in_kernel=True, lower_bound=-8.0,
                     A_log=x["A_log"], dt_bias=x["dt_bias"])  # fmt: skip


@pytest.mark.parametrize(
    "kw,name",
    [
        (dict(cp_context=object()), "cp_context"),
        (dict(some_new_flag=1), "some_new_flag"),
    ],
)
def test_chunk_kda_unsupported_arguments(kw, name) -> None:
    x = _small()
    with pytest.raises(NotImplementedError, match=name):
        kf.chunk_kda(*_qkvgb(x), **kw)


@pytest.mark.parametrize("grad", [False, True])
def test_chunk_kda_graph_mode_padded_cu_seqlens(grad) -> None:
    """fla's graph mode (use_graph, max_num_seqs): cu_seqlens padded with zero-length tail sequences gives the
    unpadded call's outputs and final states (the padded rows keep their start state), with and without
    autograd; a count that does not match max_num_seqs is named."""
    cu, pad = [0, 30, 30, 70], [70, 70]
    x = fla_inputs(1, 70, 1, 2, 64, gate="lower_bound", N=len(cu) - 1 + len(pad), seed=5)
    kw = dict(use_qk_l2norm_in_kernel=True, use_gate_in_kernel=True, use_beta_sigmoid_in_kernel=True,
              lower_bound=-5.0, A_log=x["A_log"], dt_bias=x["dt_bias"], output_final_state=True)  # fmt: skip
    toks = [t.clone().requires_grad_(grad) for t in _qkvgb(x)]
    n = len(cu) - 1
    o_ref, h_ref = kf.chunk_kda(*toks, initial_state=x["h0"][:n], cu_seqlens=torch.tensor(cu), **kw)
    cu_pad = torch.tensor(cu + pad)
    o, h = kf.chunk_kda(*toks, initial_state=x["h0"], cu_seqlens=cu_pad, use_graph=True, max_num_seqs=5, **kw)
    assert torch.equal(o, o_ref) and torch.equal(h[:n], h_ref)
    assert torch.equal(h[n:], x["h0"][n:])  # zero-length tail sequences: their start state
    if grad:
        o.sum().backward()
    with pytest.raises(ValueError, match="max_num_seqs"):
        kf.chunk_kda(*toks, initial_state=x["h0"], cu_seqlens=cu_pad, use_graph=True, max_num_seqs=6, **kw)


def test_recurrent_unsupported_arguments() -> None:
    x = _small()
    hw = x["beta"][..., None].expand(*x["v"].shape).contiguous()
    with pytest.raises(NotImplementedError, match="head-wise beta"):
        kf.fused_recurrent_kda(x["q"], x["k"], x["v"], x["g"], hw)
    with pytest.raises(NotImplementedError, match="inplace_final_state=False"):
        kf.fused_recurrent_kda_fwd(
            *_qkvgb(x),
            initial_state=x["h0"],
            inplace_final_state=False,
            ssm_state_indices=torch.zeros(1, dtype=torch.int32),
        )
    with pytest.raises(ValueError, match="initial_state"):
        kf.fused_recurrent_kda_fwd(*_qkvgb(x))


@pytest.mark.parametrize("v_first", [False, True])
@pytest.mark.parametrize("fn", ["chunk_kda", "chunk_kda_grad", "fused_recurrent_kda", "fused_recurrent_kda_fwd"])
def test_initial_state_shape_error_names_the_callers_layout(fn, v_first) -> None:
    # K != V, so the two layouts differ; the message names the layout the caller passed, with its sizes
    gen = torch.Generator().manual_seed(0)
    B, T, HV, K, V = 2, 4, 2, 8, 16
    q, k = torch.randn(B, T, HV, K, generator=gen), torch.randn(B, T, HV, K, generator=gen)
    v, g = torch.randn(B, T, HV, V, generator=gen), -torch.rand(B, T, HV, K, generator=gen)
    beta = torch.rand(B, T, HV, generator=gen)
    kw: dict = dict(state_v_first=v_first)
    if fn == "chunk_kda_grad":
        q.requires_grad_()
        kw.update(use_qk_l2norm_in_kernel=True, use_gate_in_kernel=True, use_beta_sigmoid_in_kernel=True,
                  lower_bound=-5.0, A_log=torch.zeros(HV))  # fmt: skip
    call = getattr(kf, fn.removesuffix("_grad"))
    theirs = (B, HV, V, K) if v_first else (B, HV, K, V)
    ours = (B, HV, K, V) if v_first else (B, HV, V, K)  # the other layout: wrong for this call
    want = "[N, HV, V, K] = [*, 2, 16, 8]" if v_first else "[N, HV, K, V] = [*, 2, 8, 16]"
    if fn == "chunk_kda_grad":
        want = want.replace("*", str(B))  # the training path takes one state per sequence
    for bad in (ours, (B, HV, K)):
        with pytest.raises(ValueError, match=re.escape(f"initial_state must have shape {want}")) as e:
            call(q, k, v, g, beta, initial_state=torch.zeros(bad), **kw)
        assert f"got {list(bad)}" in str(e.value)
    if fn == "chunk_kda_grad":
        with pytest.raises(ValueError, match=re.escape(f"got [{B + 1}, ")):
            call(q, k, v, g, beta, initial_state=torch.zeros(B + 1, *theirs[1:]), **kw)
    o = call(q, k, v, g, beta, initial_state=torch.zeros(theirs), **kw)[0]  # the caller's layout is taken
    assert o.shape == (B, T, HV, V)


def test_fla_argument_errors_mirrored() -> None:
    x = _small()
    with pytest.raises(ValueError, match="chunk_size"):
        kf.chunk_kda(*_qkvgb(x), chunk_size=128)
    with pytest.raises(ValueError, match="safe range"):
        kf.chunk_kda(*_qkvgb(x), use_gate_in_kernel=True, safe_gate=True,
                     lower_bound=-6.0, A_log=x["A_log"])  # fmt: skip
    with pytest.raises(ValueError, match="allow_neg_eigval"):
        kf.chunk_kda(*_qkvgb(x), allow_neg_eigval=True)
    with pytest.raises(TypeError, match="float32"):
        kf.chunk_kda(*_qkvgb(x), initial_state=x["h0"].double())
    h0_vk = x["h0"].transpose(-1, -2).contiguous()
    with pytest.warns(DeprecationWarning, match="transpose_state_layout"):
        o1, h1 = kf.fused_recurrent_kda(*_qkvgb(x), initial_state=h0_vk,
                                        output_final_state=True, transpose_state_layout=True)  # fmt: skip
    o2, h2 = kf.fused_recurrent_kda(*_qkvgb(x), initial_state=h0_vk,
                                    output_final_state=True, state_v_first=True)  # fmt: skip
    assert torch.equal(o1, o2) and torch.equal(h1, h2)


# ---------------------------------------------------------------------------------------------------
# fla's own chunk_kda routed to kda_ops


@pytest.fixture
def installed():
    kf.install()
    yield
    kf.uninstall()


def test_install_routes_fla_chunk_kda(installed, monkeypatch) -> None:
    import fla.ops.kda as fk

    x = fla_inputs(1, 40, 1, 2, 64, gate="lower_bound", seed=5)
    kw = _gate_kwargs(x, "lower_bound", -5.0)
    with torch.no_grad():
        o_fla, h_fla = fk.chunk_kda(
            *_qkvgb(x),
            initial_state=x["h0"],
            output_final_state=True,
            use_qk_l2norm_in_kernel=True,
            safe_gate=True,
            **kw,
        )
        o_rec, h_rec = fk.fused_recurrent_kda(
            *_qkvgb(x),
            initial_state=x["h0"],
            output_final_state=True,
            use_qk_l2norm_in_kernel=True,
            **kw,
        )
    o_ref, h_ref = _ref(x, "lower_bound", lower_bound=-5.0, l2=True)
    close(o_fla, o_ref, TOL, "o (fla.ops.kda.chunk_kda via kda_ops)")
    close(h_fla, h_ref, TOL, "final_state")
    close(o_rec, o_ref, TOL, "o (fla.ops.kda.fused_recurrent_kda via kda_ops)")
    close(h_rec, h_ref, TOL, "final_state (recurrent)")

    # autograd through fla's entry point lands on the training path too
    q = x["q"].clone().requires_grad_()
    o, _ = fk.chunk_kda(q, x["k"], x["v"], x["g"], x["beta"], use_qk_l2norm_in_kernel=True, safe_gate=True, **kw)
    o.sum().backward()
    assert q.grad is not None and torch.isfinite(q.grad).all()

    # FLA_KDA_OPS=0: fla's usual switch turns the backend off
    import fla.backends as fb

    reg = fb._function_registries[inspect.unwrap(fk.chunk_kda)]
    assert reg._backends["kda_ops"].is_enabled()
    monkeypatch.setenv("FLA_KDA_OPS", "0")
    assert not reg._backends["kda_ops"].is_enabled()
    assert not kf.installed()


def test_install_verifier_rejects_what_kda_ops_cannot_take(installed) -> None:
    import fla.backends as fb
    import fla.ops.kda as fk

    backend = fb._function_registries[inspect.unwrap(fk.chunk_kda)]._backends["kda_ops"]
    x = _small(grad=True)
    gate = dict(use_gate_in_kernel=True, use_beta_sigmoid_in_kernel=True, A_log=x["A_log"], dt_bias=x["dt_bias"])
    ok, why = backend.verify("chunk_kda", *_qkvgb(x), lower_bound=-8.0, **gate)
    assert not ok and "lower_bound" in why  # falls back to fla's kernels
    ok, why = backend.verify("chunk_kda", *_qkvgb(x), cp_context=object())
    assert not ok and "cp_context" in why
    ok, why = backend.verify("chunk_kda", *_qkvgb(x))  # fla's own default mode under autograd: taken
    assert ok, why
    ok, why = backend.verify("chunk_kda", x["q"].detach(), x["k"], x["v"], x["g"], x["beta"])
    assert ok, why


def test_uninstall_removes_backend() -> None:
    import fla.backends as fb
    import fla.ops.kda as fk

    kf.install()
    kf.install()  # idempotent
    kf.uninstall()
    reg = fb._function_registries[inspect.unwrap(fk.chunk_kda)]
    assert "kda_ops" not in reg._backends
    assert "kda_ops" not in fb._operation_registries["kda"]._backends
    assert kda_ops.fla is kf


def test_verifier_binds_calls_as_signature_bind() -> None:
    """The dispatcher verifier's argument binding (kda_ops.fla._bind, the signature read once) gives what
    inspect.Signature.bind + apply_defaults gives, for positional, keyword and extra-keyword calls of the three
    functions, and raises the same TypeError for a broken call."""
    x = fla_inputs(1, 32, 2, 2, 64, gate="softplus", dtype=torch.float32, device="cpu", seed=5)
    q, k, v, g, beta = (x[n] for n in ("q", "k", "v", "g", "beta"))
    gate = dict(use_gate_in_kernel=True, A_log=x["A_log"], dt_bias=x["dt_bias"], use_beta_sigmoid_in_kernel=True)
    calls = [
        (kf.chunk_kda, (q, k, v, g, beta), dict(gate)),
        (kf.chunk_kda, (q, k, v), dict(g=g, beta=beta, chunk_size=64, **gate)),
        (kf.chunk_kda, (q, k, v, g, beta, None, None, True), {}),
        (kf.fused_recurrent_kda_fwd, (q, k, v, g, beta), dict(gate)),
        (kf.fused_recurrent_kda, (q, k, v, g, beta), dict(scale=0.5)),
    ]
    for fn, args, kw in calls:
        b = inspect.signature(fn).bind(*args, **kw)
        b.apply_defaults()
        want = dict(b.arguments)
        want.update(want.pop("kwargs", {}))
        got = kf._bind(fn, args, kw)
        assert got.keys() == want.keys() and all(got[n] is want[n] for n in want), (fn.__name__, set(got) ^ set(want))
    for args, kw in (((q, k, v, g, beta), dict(q=q)), ((q, k), {})):
        with pytest.raises(TypeError):
            kf._bind(kf.chunk_kda, args, kw)
