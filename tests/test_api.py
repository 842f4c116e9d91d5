"""Every mode of docs/contract.md "API" through the public API, against kda_ops.reference (CPU tier; the same tests run
on CUDA when a GPU is present, marked ``gpu``).

Tolerances (docs/contract.md "Tolerances"): outputs 5e-3 relative RMS and 2e-2 max abs; fp32 states 1e-3; bf16 states
1e-2;
gradients 1e-2 — all on the same bf16-rounded inputs, the reference in fp64.
"""

from __future__ import annotations

import pytest
import torch
from conftest import (
    DEVICES,
    TOL_GRAD,
    TOL_STATE_FP32,
    assert_bit_identical,
    assert_close_rms,
    assert_output,
    inputs,
    lengths_to_cu,
    needs_cpu_op,
    snapshot,
    state_tol,
)

import kda_ops
from kda_ops.reference import recurrent_kda_reference, reference_training_grads

K = V = 64
GATES = {
    "precomputed": dict(use_gate_in_kernel=False),
    "softplus": dict(use_gate_in_kernel=True, lower_bound=None),
    "lower_bound": dict(use_gate_in_kernel=True, lower_bound=-5.0),
}


def _dev(device: str) -> str:
    return device


def gate_kwargs(x: dict, gate: str) -> dict:
    kw = dict(GATES[gate])
    if kw["use_gate_in_kernel"]:
        kw.update(A_log=x["A_log"], dt_bias=x["dt_bias"])
    return kw


def tokens(x: dict, gate: str = "lower_bound", logit: bool = True) -> dict:
    """q, k, v, g, beta for a gate mode: the precomputed gate gets a log-decay g <= 0 (-softplus(g))."""
    g = x["g"]
    if gate == "precomputed":
        g = -torch.nn.functional.softplus(g.float()).to(g.dtype)
    return dict(q=x["q"], k=x["k"], v=x["v"], g=g, beta=x["beta"] if logit else x["beta_prob"])


def ref(tok: dict, gkw: dict, **kw):
    """fp64 reference on CPU copies."""
    cpu = {n: t.cpu() for n, t in tok.items()}
    g = {n: (t.cpu() if isinstance(t, torch.Tensor) else t) for n, t in gkw.items()}
    kw = {n: (t.cpu() if isinstance(t, torch.Tensor) else t) for n, t in kw.items()}
    return recurrent_kda_reference(**cpu, **g, **kw)


# ---------------------------------------------------------------------------------------------------
# fixed layout, every feature combination


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("gate", list(GATES))
@pytest.mark.parametrize("logit", [True, False])
@pytest.mark.parametrize("l2", [True, False])
def test_fixed_modes(device, gate, logit, l2):
    x = inputs(B=2, T=9, H=1, HV=2, K=K, V=V, device=device, seed=1)
    tok = tokens(x, gate, logit)
    if not l2:  # un-normalised keys: keep |k|^2 * β small so the delta rule stays contractive
        tok["q"], tok["k"] = (tok["q"].float() * 0.1).bfloat16(), (tok["k"].float() * 0.1).bfloat16()
    gkw = gate_kwargs(x, gate)
    o, fs = kda_ops.recurrent_kda(
        **tok, **gkw, use_qk_l2norm_in_kernel=l2, beta_is_logit=logit, output_final_state=True
    )
    r = ref(tok, gkw, use_qk_l2norm_in_kernel=l2, beta_is_logit=logit)
    assert o.shape == (2, 9, 2, V) and o.dtype == torch.bfloat16
    assert fs.shape == (2, 2, V, K) and fs.dtype == torch.float32
    assert_output(o, r.output)
    assert_close_rms(fs, r.final_state, TOL_STATE_FP32, "final_state")


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_cpu_fp32_fp64_tokens(dtype):
    x = inputs(B=1, T=7, H=2, HV=4, K=32, V=16, dtype=dtype, seed=2)
    tok = tokens(x)
    gkw = gate_kwargs(x, "lower_bound")
    o, fs = kda_ops.recurrent_kda(**tok, **gkw, beta_is_logit=True, output_final_state=True, scale=0.3)
    r = ref(tok, gkw, beta_is_logit=True, scale=0.3)
    assert o.dtype == dtype
    tol = 1e-5 if dtype == torch.float32 else 1e-12  # fp32 math vs fp64 reference; fp64 math end to end
    assert_close_rms(o, r.output, tol, "output")
    assert_close_rms(fs, r.final_state, 1e-5, "final_state")  # stored fp32 whatever the token dtype


def test_final_state_semantics():
    x = inputs(B=2, T=3, H=1, HV=2, K=K, V=V)
    tok = tokens(x)
    gkw = gate_kwargs(x, "lower_bound")
    o, fs = kda_ops.recurrent_kda(**tok, **gkw, beta_is_logit=True)
    assert fs is None
    pool = x["initial_state"].clone()
    o2, fs2 = kda_ops.recurrent_kda(**tok, **gkw, beta_is_logit=True, initial_state=pool)
    assert fs2 is None and not torch.equal(pool, x["initial_state"])  # still updated in place
    pool = x["initial_state"].clone()
    _, fs3 = kda_ops.recurrent_kda(**tok, **gkw, beta_is_logit=True, initial_state=pool, output_final_state=True)
    assert fs3 is pool


# ---------------------------------------------------------------------------------------------------
# packed, pools, slots


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("state_dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("cu_dtype", [torch.int64, torch.int32])
def test_packed_pool(device, state_dtype, cu_dtype):
    lens = [5, 0, 17, 1]
    x = inputs(
        H=2,
        HV=4,
        K=K,
        V=V,
        cu_seqlens=lengths_to_cu(lens).tolist(),
        N_pool=6,
        state_dtype=state_dtype,
        device=device,
        seed=3,
    )
    cu = x["cu_seqlens"].to(cu_dtype)
    slots = torch.tensor([4, 1, 0, 2], dtype=torch.int32, device=device)  # slots 3 and 5 untouched
    pool = x["initial_state"].clone()
    tok = tokens(x, "softplus", logit=False)
    gkw = gate_kwargs(x, "softplus")
    o, fs = kda_ops.recurrent_kda(
        **tok, **gkw, initial_state=pool, cu_seqlens=cu, ssm_state_indices=slots, output_final_state=True, scale=0.2
    )
    assert fs is pool
    start = x["initial_state"][slots.long()].float()
    r = ref(tok, gkw, initial_state=start, cu_seqlens=cu, scale=0.2)
    assert_output(o, r.output)
    for n, s in enumerate(slots.tolist()):
        if lens[n] == 0:
            assert torch.equal(pool[s], x["initial_state"][s]), "zero-length sequence changed its slot"
        else:
            assert_close_rms(pool[s].float(), r.final_state[n], state_tol(state_dtype), f"slot {s}")
    for s in (3, 5):
        assert torch.equal(pool[s], x["initial_state"][s])


@pytest.mark.parametrize("device", DEVICES)
def test_inactive_slots(device):
    x = inputs(B=4, T=1, H=1, HV=2, K=K, V=V, N_pool=5, device=device, seed=4)
    slots = torch.tensor([-1, 2, 5, 0], dtype=torch.int32, device=device)  # rows 0 and 2 inactive
    pool = x["initial_state"].clone()
    before = snapshot(pool[1], pool[3], pool[4])
    tok = tokens(x)
    gkw = gate_kwargs(x, "lower_bound")
    o, _ = kda_ops.recurrent_kda(**tok, **gkw, beta_is_logit=True, initial_state=pool, ssm_state_indices=slots)
    assert torch.count_nonzero(o[0]) == 0 and torch.count_nonzero(o[2]) == 0
    assert_bit_identical(before, pool[1], pool[3], pool[4])
    active = [1, 3]
    sub = {n: t[active] for n, t in tok.items()}
    r = ref(sub, gkw, beta_is_logit=True, initial_state=x["initial_state"][[2, 0]])
    assert_output(o[active], r.output)
    assert_close_rms(pool[[2, 0]], r.final_state, TOL_STATE_FP32, "active slots")


@pytest.mark.parametrize("device", DEVICES)
def test_padded_pool_stride(device):
    HV = 2
    inner = HV * V * K
    x = inputs(B=2, T=3, H=1, HV=HV, K=K, V=V, N_pool=3, device=device, seed=5)
    storage = torch.full((3, inner + 16), 7.0, device=device)
    pool = storage[:, :inner].view(3, HV, V, K)
    pool.copy_(x["initial_state"])
    tok = tokens(x)
    gkw = gate_kwargs(x, "lower_bound")
    o, _ = kda_ops.recurrent_kda(
        **tok,
        **gkw,
        beta_is_logit=True,
        initial_state=pool,
        ssm_state_indices=torch.tensor([2, 0], dtype=torch.int32, device=device),
    )
    assert torch.all(storage[:, inner:] == 7.0), "slot padding was written"
    r = ref(tok, gkw, beta_is_logit=True, initial_state=x["initial_state"][[2, 0]])
    assert_output(o, r.output)
    assert_close_rms(pool[[2, 0]], r.final_state, TOL_STATE_FP32, "pool")
    assert torch.equal(pool[1], x["initial_state"][1])


@pytest.mark.parametrize("device", DEVICES)
def test_state_source(device):
    x = inputs(B=3, T=4, H=1, HV=2, K=K, V=V, N_pool=5, device=device, seed=6)
    src = (torch.randn(3, 2, V, K, generator=torch.Generator().manual_seed(1)) * 0.1).to(device)
    src_before = snapshot(src)
    src_idx = torch.tensor([2, 0, 7], dtype=torch.int32, device=device)  # row 2: source index out of range
    slots = torch.tensor([1, 3, 4], dtype=torch.int32, device=device)
    pool = x["initial_state"].clone()
    tok = tokens(x)
    gkw = gate_kwargs(x, "lower_bound")
    o, fs = kda_ops.recurrent_kda(
        **tok,
        **gkw,
        beta_is_logit=True,
        initial_state=pool,
        ssm_state_indices=slots,
        initial_state_source=src,
        initial_state_indices=src_idx,
        output_final_state=True,
    )
    assert_bit_identical(src_before, src)
    sub = {n: t[:2] for n, t in tok.items()}
    r = ref(sub, gkw, beta_is_logit=True, initial_state=src[[2, 0]])
    assert_output(o[:2], r.output)
    assert_close_rms(pool[[1, 3]], r.final_state, TOL_STATE_FP32, "pool slots")
    assert torch.count_nonzero(o[2]) == 0
    for s in (0, 2, 4):  # untouched, untouched, inactive row's slot
        assert torch.equal(pool[s], x["initial_state"][s])
    # No pool: the final state comes back as a new fp32 tensor.
    o2, fs2 = kda_ops.recurrent_kda(
        **{n: t[:2] for n, t in tok.items()},
        **gkw,
        beta_is_logit=True,
        initial_state_source=src,
        initial_state_indices=src_idx[:2],
        output_final_state=True,
    )
    assert fs2.dtype == torch.float32 and fs2.shape == (2, 2, V, K)
    assert_close_rms(fs2, r.final_state, TOL_STATE_FP32, "final_state")


# ---------------------------------------------------------------------------------------------------
# speculative decode


def _spec_reference(tok, gkw, pool0, idx, acc, S):
    """Per sequence: start from slot idx[n, clamp(acc-1, 0, S)]; returns (outputs [N, 1+S, HV, V] as a list,
    {slot: state}). Tokens with a write slot outside the pool are skipped (zero output)."""
    n_pool = pool0.shape[0]
    outs, slots = [], {}
    for n in range(idx.shape[0]):
        c = 0 if acc is None else min(max(int(acc[n]) - 1, 0), S)
        start = int(idx[n, c])
        S0 = pool0[start].double() if 0 <= start < n_pool else None
        o_n = torch.zeros(1 + S, *tok["v"].shape[2:], dtype=torch.float64)
        if S0 is None:
            outs.append(o_n)
            continue
        for t in range(1 + S):
            w = int(idx[n, t])
            if not 0 <= w < n_pool:
                continue
            one = {name: tt[n : n + 1, t : t + 1].cpu() for name, tt in tok.items()}
            r = ref(one, gkw, beta_is_logit=True, initial_state=S0[None])
            S0 = r.final_state[0]
            o_n[t] = r.output[0, 0]
            slots[w] = S0
        outs.append(o_n)
    return outs, slots


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("packed", [False, True])
@pytest.mark.parametrize("accepted", [None, [2, 1]])
def test_spec_decode(device, packed, accepted):
    S, N = 2, 2
    x = inputs(B=N, T=1 + S, H=1, HV=2, K=K, V=V, N_pool=8, device=device, seed=7)
    tok = tokens(x)
    gkw = gate_kwargs(x, "lower_bound")
    idx = torch.tensor([[1, 2, 3], [5, 6, 7]], dtype=torch.int32, device=device)
    acc = None if accepted is None else torch.tensor(accepted, dtype=torch.int32, device=device)
    pool = x["initial_state"].clone()
    call_tok = tok
    extra = {}
    if packed:
        call_tok = {n: t.reshape(1, N * (1 + S), *t.shape[2:]) for n, t in tok.items()}
        extra["cu_seqlens"] = torch.tensor([0, 3, 6], dtype=torch.int32, device=device)
    o, fs = kda_ops.recurrent_kda(
        **call_tok,
        **gkw,
        beta_is_logit=True,
        initial_state=pool,
        ssm_state_indices=idx,
        num_spec_tokens=S,
        num_accepted_tokens=acc,
        output_final_state=True,
        **extra,
    )
    assert fs is pool
    outs, slots = _spec_reference(tok, gkw, x["initial_state"].cpu(), idx.cpu(), None if acc is None else acc.cpu(), S)
    assert_output(o.reshape(N, 1 + S, 2, V), torch.stack(outs))
    for s, st in slots.items():
        assert_close_rms(pool[s], st, TOL_STATE_FP32, f"slot {s}")
    for s in (0, 4):
        assert torch.equal(pool[s], x["initial_state"][s])


def test_spec_decode_inactive_token():
    S = 2
    x = inputs(B=1, T=1 + S, H=1, HV=2, K=K, V=V, N_pool=4, seed=8)
    tok = tokens(x)
    gkw = gate_kwargs(x, "lower_bound")
    idx = torch.tensor([[0, -1, 3]], dtype=torch.int32)
    pool = x["initial_state"].clone()
    o, _ = kda_ops.recurrent_kda(
        **tok, **gkw, beta_is_logit=True, initial_state=pool, ssm_state_indices=idx, num_spec_tokens=S
    )
    assert torch.count_nonzero(o[0, 1]) == 0
    outs, slots = _spec_reference(tok, gkw, x["initial_state"], idx, None, S)
    assert_output(o, outs[0][None])
    assert_close_rms(pool[3], slots[3], TOL_STATE_FP32, "slot 3")


# ---------------------------------------------------------------------------------------------------
# checkpoints


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("state_dtype", [torch.float32, torch.bfloat16])
def test_checkpoints_packed(device, state_dtype):
    lens = [65, 131]
    x = inputs(
        H=1, HV=2, K=K, V=V, cu_seqlens=lengths_to_cu(lens).tolist(), state_dtype=state_dtype, device=device, seed=9
    )
    tok = tokens(x)
    gkw = gate_kwargs(x, "lower_bound")
    pool = x["initial_state"].clone()
    o, fs, ck = kda_ops.recurrent_kda(
        **tok,
        **gkw,
        beta_is_logit=True,
        initial_state=pool,
        cu_seqlens=x["cu_seqlens"],
        output_final_state=True,
        checkpoint_every_n_tokens=64,
    )
    assert ck.shape == (5, 2, V, K) and ck.dtype == state_dtype
    r = ref(
        tok,
        gkw,
        beta_is_logit=True,
        initial_state=x["initial_state"].float(),
        cu_seqlens=x["cu_seqlens"],
        checkpoint_every_n_tokens=64,
    )
    assert_output(o, r.output)
    assert_close_rms(ck.float(), torch.cat(r.checkpoints), state_tol(state_dtype), "checkpoints")
    assert_close_rms(fs.float(), r.final_state, state_tol(state_dtype), "final_state")
    # Caller buffers: no host sync, the same rows.
    starts = torch.tensor([0, 2, 5], dtype=torch.int64, device=device)
    buf = torch.full((5, 2, V, K), -1.0, dtype=state_dtype, device=device)
    pool2 = x["initial_state"].clone()
    o2, _, ck2 = kda_ops.recurrent_kda(
        **tok,
        **gkw,
        beta_is_logit=True,
        initial_state=pool2,
        cu_seqlens=x["cu_seqlens"],
        checkpoint_every_n_tokens=64,
        state_checkpoints=buf,
        checkpoint_cu_starts=starts,
    )
    assert ck2 is buf
    assert torch.equal(ck2, ck) and torch.equal(o2, o) and torch.equal(pool2, pool)


def test_checkpoints_fixed_and_starts_only():
    x = inputs(B=2, T=40, H=1, HV=2, K=K, V=V, seed=10)
    tok = tokens(x)
    gkw = gate_kwargs(x, "lower_bound")
    o, fs, ck = kda_ops.recurrent_kda(
        **tok, **gkw, beta_is_logit=True, output_final_state=True, checkpoint_every_n_tokens=16
    )
    assert ck.shape == (6, 2, V, K) and ck.dtype == torch.float32  # 2 rows x ceil(40/16) = 3
    r = ref(tok, gkw, beta_is_logit=True, checkpoint_every_n_tokens=16)
    assert_close_rms(ck, torch.cat(r.checkpoints), TOL_STATE_FP32, "checkpoints")
    assert torch.count_nonzero(ck[0]) == 0 and torch.count_nonzero(ck[3]) == 0  # row 0: the zero start
    # Only the starts given (packed): rows allocated from starts[-1].
    lens = [20, 0, 33]
    y = inputs(H=1, HV=2, K=K, V=V, cu_seqlens=lengths_to_cu(lens).tolist(), seed=11)
    tk = tokens(y)
    gk = gate_kwargs(y, "lower_bound")
    *_, ck3 = kda_ops.recurrent_kda(
        **tk,
        **gk,
        beta_is_logit=True,
        cu_seqlens=y["cu_seqlens"],
        checkpoint_every_n_tokens=16,
        checkpoint_cu_starts=torch.tensor([0, 2, 2, 5]),
    )
    assert ck3.shape[0] == 5
    r3 = ref(tk, gk, beta_is_logit=True, cu_seqlens=y["cu_seqlens"], checkpoint_every_n_tokens=16)
    assert_close_rms(ck3, torch.cat(r3.checkpoints), TOL_STATE_FP32, "checkpoints")


# ---------------------------------------------------------------------------------------------------
# output buffer, seq_order, parameter expansion, workspace


@pytest.mark.parametrize("device", DEVICES)
def test_output_buffer(device):
    lens = [4, 7]
    x = inputs(H=1, HV=2, K=K, V=V, cu_seqlens=lengths_to_cu(lens).tolist(), device=device, seed=12)
    tok = tokens(x)
    gkw = gate_kwargs(x, "lower_bound")
    o_ref, _ = kda_ops.recurrent_kda(**tok, **gkw, beta_is_logit=True, cu_seqlens=x["cu_seqlens"])
    big = torch.full((1, 11, 2, 2 * V), 3.0, dtype=torch.bfloat16, device=device)
    out = big[..., :V]  # a strided view: last dim contiguous
    o, _ = kda_ops.recurrent_kda(**tok, **gkw, beta_is_logit=True, cu_seqlens=x["cu_seqlens"], output=out)
    assert o is out
    assert torch.equal(o, o_ref)
    assert torch.all(big[..., V:] == 3.0)


def test_seq_order_invariance():
    lens = [3, 9, 1, 6]
    x = inputs(H=1, HV=2, K=K, V=V, cu_seqlens=lengths_to_cu(lens).tolist(), N_pool=4, seed=13)
    tok = tokens(x)
    gkw = gate_kwargs(x, "lower_bound")
    results = []
    for order in (None, [1, 3, 0, 2], [3, 2, 1, 0]):
        pool = x["initial_state"].clone()
        so = None if order is None else torch.tensor(order, dtype=torch.int32)
        o, _ = kda_ops.recurrent_kda(
            **tok, **gkw, beta_is_logit=True, initial_state=pool, cu_seqlens=x["cu_seqlens"], seq_order=so
        )
        results.append((o, pool))
    for o, pool in results[1:]:
        assert torch.equal(o, results[0][0]) and torch.equal(pool, results[0][1])


@pytest.mark.parametrize("flat", [False, True])
def test_per_qk_head_gate_params(flat):
    x = inputs(B=2, T=5, H=2, HV=4, K=K, V=V, seed=14)
    tok = tokens(x)
    A_h = torch.rand(2) * 0.5
    dtb_h = torch.randn(2, K) * 0.1
    full = kda_ops.recurrent_kda(
        **tok,
        A_log=A_h.repeat_interleave(2),
        dt_bias=dtb_h.repeat_interleave(2, 0),
        use_gate_in_kernel=True,
        lower_bound=-4.0,
        beta_is_logit=True,
        output_final_state=True,
    )
    per_h = kda_ops.recurrent_kda(
        **tok,
        A_log=A_h,
        dt_bias=dtb_h.reshape(-1) if flat else dtb_h,
        use_gate_in_kernel=True,
        lower_bound=-4.0,
        beta_is_logit=True,
        output_final_state=True,
    )
    assert torch.equal(full[0], per_h[0]) and torch.equal(full[1], per_h[1])
    flat_hv = kda_ops.recurrent_kda(
        **tok,
        A_log=A_h.repeat_interleave(2),
        dt_bias=dtb_h.repeat_interleave(2, 0).reshape(-1),
        use_gate_in_kernel=True,
        lower_bound=-4.0,
        beta_is_logit=True,
        output_final_state=True,
    )
    assert torch.equal(full[0], flat_hv[0])


def test_prefill_workspace():
    x = inputs(H=1, HV=2, K=K, V=V, cu_seqlens=[0, 5, 9], seed=15)
    tok = tokens(x)
    gkw = gate_kwargs(x, "lower_bound")
    ws = kda_ops.RecurrentKDAPrefillWorkspace()
    o1, _ = kda_ops.recurrent_kda(**tok, **gkw, beta_is_logit=True, cu_seqlens=x["cu_seqlens"], prefill_workspace=ws)
    o2, _ = kda_ops.recurrent_kda(**tok, **gkw, beta_is_logit=True, cu_seqlens=x["cu_seqlens"])
    assert torch.equal(o1, o2)
    assert ws.planned is not None and ws.device == torch.device("cpu")


@pytest.mark.parametrize("backend", ["auto", "chunked", "recurrent"])
def test_backends_agree(backend):
    x = inputs(H=1, HV=2, K=K, V=V, cu_seqlens=[0, 5, 21], seed=16)
    tok = tokens(x)
    gkw = gate_kwargs(x, "lower_bound")
    o, fs = kda_ops.recurrent_kda(
        **tok, **gkw, beta_is_logit=True, cu_seqlens=x["cu_seqlens"], output_final_state=True, backend=backend
    )
    r = ref(tok, gkw, beta_is_logit=True, cu_seqlens=x["cu_seqlens"])
    assert_output(o, r.output)
    assert_close_rms(fs, r.final_state, TOL_STATE_FP32, "final_state")


# ---------------------------------------------------------------------------------------------------
# paths that compute the same thing agree (docs/contract.md "Tolerances")


def test_zero_tokens():
    x = inputs(B=2, T=0, H=1, HV=2, K=K, V=V, N_pool=3)
    tok = tokens(x)
    gkw = gate_kwargs(x, "lower_bound")
    pool = x["initial_state"].clone()
    o, fs = kda_ops.recurrent_kda(**tok, **gkw, beta_is_logit=True, initial_state=pool, output_final_state=True)
    assert o.shape == (2, 0, 2, V)
    assert torch.equal(pool, x["initial_state"])
    o, fs = kda_ops.recurrent_kda(**tok, **gkw, beta_is_logit=True, output_final_state=True)
    assert fs.shape == (2, 2, V, K) and torch.count_nonzero(fs) == 0


def test_decode_equals_one_token_prefill():
    x = inputs(B=3, T=1, H=1, HV=2, K=K, V=V, N_pool=3, seed=17)
    tok = tokens(x)
    gkw = gate_kwargs(x, "lower_bound")
    pool_a, pool_b = x["initial_state"].clone(), x["initial_state"].clone()
    o_a, _ = kda_ops.recurrent_kda(**tok, **gkw, beta_is_logit=True, initial_state=pool_a)
    packed = {n: t.reshape(1, 3, *t.shape[2:]) for n, t in tok.items()}
    o_b, _ = kda_ops.recurrent_kda(
        **packed, **gkw, beta_is_logit=True, initial_state=pool_b, cu_seqlens=torch.tensor([0, 1, 2, 3])
    )
    assert torch.equal(o_a.reshape(1, 3, 2, V), o_b) and torch.equal(pool_a, pool_b)


def test_split_prefill_equals_one_call():
    x = inputs(B=1, T=40, H=1, HV=2, K=K, V=V, N_pool=1, seed=18)
    tok = tokens(x)
    gkw = gate_kwargs(x, "lower_bound")
    pool_a, pool_b = x["initial_state"].clone(), x["initial_state"].clone()
    o_a, _ = kda_ops.recurrent_kda(**tok, **gkw, beta_is_logit=True, initial_state=pool_a)
    parts = []
    for a, b in ((0, 13), (13, 14), (14, 40)):
        o, _ = kda_ops.recurrent_kda(
            **{n: t[:, a:b] for n, t in tok.items()}, **gkw, beta_is_logit=True, initial_state=pool_b
        )
        parts.append(o)
    # fp32 pool: the carried state is stored exactly, so the split computes the same numbers.
    torch.testing.assert_close(torch.cat(parts, 1), o_a, rtol=0, atol=0)
    torch.testing.assert_close(pool_b, pool_a, rtol=1e-6, atol=1e-7)


def test_packed_equals_each_sequence_alone():
    lens = [7, 0, 12]
    x = inputs(H=1, HV=2, K=K, V=V, cu_seqlens=lengths_to_cu(lens).tolist(), N_pool=3, seed=19)
    tok = tokens(x)
    gkw = gate_kwargs(x, "lower_bound")
    pool = x["initial_state"].clone()
    o, _ = kda_ops.recurrent_kda(**tok, **gkw, beta_is_logit=True, initial_state=pool, cu_seqlens=x["cu_seqlens"])
    cu = x["cu_seqlens"].tolist()
    for n in range(3):
        if lens[n] == 0:
            continue
        p1 = x["initial_state"][n : n + 1].clone()
        o1, _ = kda_ops.recurrent_kda(
            **{k_: t[:, cu[n] : cu[n + 1]] for k_, t in tok.items()}, **gkw, beta_is_logit=True, initial_state=p1
        )
        assert torch.equal(o1, o[:, cu[n] : cu[n + 1]]) and torch.equal(p1[0], pool[n])


# ---------------------------------------------------------------------------------------------------
# training API


def _train_inputs(device="cpu", packed=True, seed=20, H=1, HV=2, dtype=torch.bfloat16):
    D = 128 if device == "cuda" else K  # the CUDA training kernels take K == V == 128 only
    if packed:
        x = inputs(H=H, HV=HV, K=D, V=D, cu_seqlens=[0, 17, 17, 40], device=device, seed=seed, dtype=dtype)
    else:
        x = inputs(B=2, T=19, H=H, HV=HV, K=D, V=D, device=device, seed=seed, dtype=dtype)
    N = 3 if packed else 2
    gen = torch.Generator().manual_seed(seed + 1)
    x["h0"] = (torch.randn(N, HV, D, D, generator=gen) * 0.1).to(device)
    x["do"] = torch.randn(x["v"].shape, generator=gen).to(dtype).to(device)
    x["dfinal"] = (torch.randn(N, HV, D, D, generator=gen) * 0.1).to(device)
    return x


def _targs(x):
    return (x["q"], x["k"], x["v"], x["g"], x["beta"], x["A_log"], x["dt_bias"], x["h0"])


@needs_cpu_op("recurrent_kda_training_forward", "recurrent_kda_training_backward")
@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("packed", [True, False])
def test_training_forward_backward(device, packed):
    x = _train_inputs(device, packed, H=2, HV=4)
    cu = x.get("cu_seqlens")
    kw = {} if cu is None else dict(cu_seqlens=cu, cu_seqlens_cpu=cu.cpu())
    h0_before = snapshot(x["h0"])
    out, fs, ctx = kda_ops.recurrent_kda_training_forward(*_targs(x), scale=0.1, lower_bound=-3.0, **kw)
    assert_bit_identical(h0_before, x["h0"])
    assert isinstance(ctx, kda_ops.RecurrentKDATrainingContext)
    grads = kda_ops.recurrent_kda_training_backward(ctx, x["do"], x["dfinal"])
    r_out, r_fs, r_grads = reference_training_grads(
        *[t.cpu() for t in _targs(x)],
        x["do"].cpu(),
        x["dfinal"].cpu(),
        cu_seqlens=None if cu is None else cu.cpu(),
        scale=0.1,
        lower_bound=-3.0,
    )
    assert_output(out, r_out)
    assert_close_rms(fs, r_fs, TOL_STATE_FP32, "final_state")
    names = ("dq", "dk", "dv", "dg", "dbeta", "dA_log", "ddt_bias", "dinitial_state")
    for name, gr, rg, inp in zip(names, grads, r_grads, _targs(x), strict=True):
        assert gr.shape == inp.shape, name
        assert_close_rms(gr, rg, TOL_GRAD, name)
    # The raw-input backward computes the same gradients.
    grads2 = kda_ops.recurrent_kda_backward(
        *_targs(x), x["do"], x["dfinal"], cu_seqlens=cu, scale=0.1, lower_bound=-3.0
    )
    for name, a, b in zip(names, grads, grads2, strict=True):
        assert_close_rms(b, a, 1e-5, name)


@needs_cpu_op("recurrent_kda_training_forward", "recurrent_kda_training_backward")
def test_training_buffers_and_context_reuse():
    x = _train_inputs()
    cu = x["cu_seqlens"]
    out0, fs0, ctx0 = kda_ops.recurrent_kda_training_forward(*_targs(x), cu_seqlens=cu)
    out = torch.empty_like(out0)
    fso = torch.empty_like(fs0)
    o, f, ctx = kda_ops.recurrent_kda_training_forward(
        *_targs(x), cu_seqlens=cu, cu_seqlens_cpu=cu.clone(), out=out, final_state_out=fso, context_out=ctx0
    )
    assert o is out and f is fso and ctx is ctx0
    assert torch.equal(o, out0) and torch.equal(f, fs0)
    g0 = kda_ops.recurrent_kda_training_backward(ctx, x["do"], None)
    bufs = [torch.empty_like(t) for t in g0]
    g1 = kda_ops.recurrent_kda_training_backward(ctx, x["do"], None, out=bufs)
    assert all(a is b for a, b in zip(g1, bufs, strict=True))
    assert all(torch.equal(a, b) for a, b in zip(g0, g1, strict=True))
    bufs2 = [torch.empty_like(t) for t in g0]
    ws = kda_ops.RecurrentKDABackwardWorkspace()
    g2 = kda_ops.recurrent_kda_backward(
        *_targs(x), x["do"], None, cu_seqlens=cu.to(torch.int32), workspace=ws, out=bufs2
    )
    assert all(a is b for a, b in zip(g2, bufs2, strict=True))
    for a, b in zip(g0, g2, strict=True):
        assert_close_rms(b, a, 1e-5)


@needs_cpu_op("recurrent_kda_training_forward", "recurrent_kda_training_backward")
@pytest.mark.parametrize("device", DEVICES)
def test_kda_autograd(device):
    x = _train_inputs(device, H=1, HV=2)
    leaves = [t.detach().clone().requires_grad_() for t in _targs(x)]
    o, fs = kda_ops.kda(*leaves, cu_seqlens=x["cu_seqlens"], lower_bound=-5.0, output_final_state=True)
    loss = (o.float() * x["do"].float()).sum() + (fs * x["dfinal"]).sum()
    loss.backward()
    r_out, r_fs, r_grads = reference_training_grads(
        *[t.cpu() for t in _targs(x)],
        x["do"].cpu(),
        x["dfinal"].cpu(),
        cu_seqlens=x["cu_seqlens"].cpu(),
        lower_bound=-5.0,
    )
    assert_output(o, r_out)
    assert_close_rms(fs, r_fs, TOL_STATE_FP32, "final_state")
    for leaf, rg in zip(leaves, r_grads, strict=True):
        assert leaf.grad is not None
        assert_close_rms(leaf.grad, rg, TOL_GRAD)
    # initial_state None: zeros; flat dt_bias is accepted and gets a flat gradient.
    dtb = x["dt_bias"].reshape(-1).clone().requires_grad_()
    o2, fs2 = kda_ops.kda(x["q"], x["k"], x["v"], x["g"], x["beta"], x["A_log"], dtb, cu_seqlens=x["cu_seqlens"])
    assert fs2 is None
    o2.float().sum().backward()
    assert dtb.grad is not None and dtb.grad.shape == dtb.shape


@needs_cpu_op("recurrent_kda_training_forward")
def test_training_matches_inference_op():
    """The training forward and recurrent_kda (lower-bound gate, logit beta, L2 norm) compute the same."""
    x = _train_inputs()
    out, fs, _ = kda_ops.recurrent_kda_training_forward(
        *_targs(x), cu_seqlens=x["cu_seqlens"], scale=0.2, lower_bound=-2.0
    )
    o2, fs2 = kda_ops.recurrent_kda(
        x["q"],
        x["k"],
        x["v"],
        x["g"],
        x["beta"],
        A_log=x["A_log"],
        dt_bias=x["dt_bias"],
        scale=0.2,
        initial_state_source=x["h0"],
        initial_state_indices=torch.arange(3, dtype=torch.int32),
        cu_seqlens=x["cu_seqlens"],
        use_gate_in_kernel=True,
        lower_bound=-2.0,
        beta_is_logit=True,
        output_final_state=True,
    )
    assert_close_rms(out, o2, 5e-3)
    assert_close_rms(fs, fs2, 1e-5)


def test_validate_helpers_accept_valid():
    cu = torch.tensor([0, 3, 3, 10], dtype=torch.int64)
    assert torch.equal(kda_ops.validate_cu_seqlens(cu, 10), cu)
    kda_ops.validate_state_indices(torch.tensor([[0, 1, 2], [3, 4, 5]], dtype=torch.int32), 6, allow_inactive=False)


# ---------------------------------------------------------------------------------------------------
# CUDA graph capture (docs/contract.md "API"): eager warm call, capture, replay with new values in the buffers


def _capture(fn):
    """Warm fn eagerly on a side stream (the torch recipe), then capture it; returns the graph."""
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        fn()
    torch.cuda.current_stream().wait_stream(s)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fn()
    return graph


def _refill(static: dict, fresh: dict) -> None:
    for n, t in static.items():
        t.copy_(fresh[n])


@pytest.mark.gpu
def test_cuda_graph_decode_and_spec():
    x = inputs(B=4, T=1, H=1, HV=2, K=K, V=V, N_pool=6, device="cuda", seed=30)
    static = {**tokens(x), "idx": torch.tensor([5, 0, -1, 2], dtype=torch.int32, device="cuda")}
    gkw = gate_kwargs(x, "lower_bound")
    pool = x["initial_state"].clone()
    out = torch.empty_like(x["v"])
    ws = kda_ops.RecurrentKDAPrefillWorkspace()

    def call(p=pool, o=out):
        t = {n: static[n] for n in ("q", "k", "v", "g", "beta")}
        return kda_ops.recurrent_kda(
            **t,
            **gkw,
            beta_is_logit=True,
            initial_state=p,
            ssm_state_indices=static["idx"],
            output=o,
            prefill_workspace=ws,
        )

    graph = _capture(call)
    y = inputs(B=4, T=1, H=1, HV=2, K=K, V=V, N_pool=6, device="cuda", seed=31)
    fresh = {**tokens(y), "idx": torch.tensor([1, 3, 4, 6], dtype=torch.int32, device="cuda")}
    _refill(static, fresh)
    pool.copy_(y["initial_state"])
    graph.replay()
    pool_e, out_e = y["initial_state"].clone(), torch.empty_like(out)
    call(pool_e, out_e)
    torch.cuda.synchronize()
    assert torch.equal(out, out_e) and torch.equal(pool, pool_e)


@pytest.mark.gpu
def test_cuda_graph_packed_prefill_checkpoints():
    lens = [20, 0, 45]
    x = inputs(H=1, HV=2, K=K, V=V, cu_seqlens=lengths_to_cu(lens).tolist(), N_pool=4, device="cuda", seed=32)
    static = {
        **tokens(x),
        "cu": x["cu_seqlens"].clone(),
        "idx": torch.tensor([3, 0, 1], dtype=torch.int32, device="cuda"),
    }
    gkw = gate_kwargs(x, "lower_bound")
    pool = x["initial_state"].clone()
    out = torch.empty_like(x["v"])
    ck = torch.zeros(6, 2, V, K, device="cuda")
    starts = torch.tensor([0, 2, 2, 5], dtype=torch.int64, device="cuda")
    ws = kda_ops.RecurrentKDAPrefillWorkspace()

    def call(p=pool, o=out, c=ck):
        t = {n: static[n] for n in ("q", "k", "v", "g", "beta")}
        return kda_ops.recurrent_kda(
            **t,
            **gkw,
            beta_is_logit=True,
            initial_state=p,
            cu_seqlens=static["cu"],
            ssm_state_indices=static["idx"],
            output=o,
            prefill_workspace=ws,
            state_checkpoints=c,
            checkpoint_cu_starts=starts,
            checkpoint_every_n_tokens=16,
        )

    graph = _capture(call)
    # New lengths in the same buffers: [33, 32, 0] (still 65 tokens; starts rewritten to match).
    y = inputs(H=1, HV=2, K=K, V=V, cu_seqlens=[0, 33, 65, 65], N_pool=4, device="cuda", seed=33)
    _refill(
        static, {**tokens(y), "cu": y["cu_seqlens"], "idx": torch.tensor([2, 1, 0], dtype=torch.int32, device="cuda")}
    )
    starts.copy_(torch.tensor([0, 3, 5, 5]))
    pool.copy_(y["initial_state"])
    ck.zero_()
    graph.replay()
    pool_e, out_e, ck_e = y["initial_state"].clone(), torch.empty_like(out), torch.zeros_like(ck)
    call(pool_e, out_e, ck_e)
    torch.cuda.synchronize()
    assert torch.equal(out, out_e) and torch.equal(pool, pool_e) and torch.equal(ck, ck_e)


@pytest.mark.gpu
def test_cuda_graph_unplanned_workspace_raises():
    x = inputs(B=2, T=1, H=1, HV=2, K=K, V=V, device="cuda", seed=34)
    y = inputs(B=3, T=1, H=1, HV=2, K=K, V=V, device="cuda", seed=35)
    ws = kda_ops.RecurrentKDAPrefillWorkspace()
    gkw = gate_kwargs(x, "lower_bound")
    kda_ops.recurrent_kda(**tokens(x), **gkw, beta_is_logit=True, prefill_workspace=ws)  # plans B=2
    torch.cuda.synchronize()
    out = torch.empty_like(y["v"])
    graph = torch.cuda.CUDAGraph()
    with pytest.raises(RuntimeError, match="prefill_workspace"):
        with torch.cuda.graph(graph):
            kda_ops.recurrent_kda(**tokens(y), **gkw, beta_is_logit=True, prefill_workspace=ws, output=out)


@pytest.mark.gpu
def test_cuda_graph_backward():
    x = _train_inputs("cuda")
    static = {n: x[n].clone() for n in ("q", "k", "v", "g", "beta", "A_log", "dt_bias", "h0", "do", "dfinal")}
    cu = x["cu_seqlens"]
    ws = kda_ops.RecurrentKDABackwardWorkspace()
    outs = [torch.empty_like(static[n]) for n in ("q", "k", "v", "g", "beta", "A_log", "dt_bias", "h0")]

    def call(o=outs):
        s = static
        return kda_ops.recurrent_kda_backward(
            s["q"],
            s["k"],
            s["v"],
            s["g"],
            s["beta"],
            s["A_log"],
            s["dt_bias"],
            s["h0"],
            s["do"],
            s["dfinal"],
            cu_seqlens=cu,
            workspace=ws,
            out=o,
        )

    graph = _capture(call)
    y = _train_inputs("cuda", seed=40)
    _refill(static, {n: y[n] for n in static})
    graph.replay()
    ref_outs = [torch.empty_like(t) for t in outs]
    call(ref_outs)
    torch.cuda.synchronize()
    for a, b in zip(outs, ref_outs, strict=True):
        assert torch.equal(a, b)


@needs_cpu_op("recurrent_kda_training_forward", "recurrent_kda_training_backward")
def test_kda_without_initial_state_saves_no_state_block():
    """kda() with initial_state=None: the backward needs the zero start state (the tapes do not repeat the
    state before token 0); autograd saves it as a stride-0 view (one element), not an [N, HV, V, K] block."""
    x = inputs(H=1, HV=2, T=40)  # < 64 tokens: no tape rows (a [1, 2, 64, 64] tape would match the shape)
    leaves = [x[n].clone().requires_grad_() for n in ("q", "k", "v", "g", "beta", "A_log", "dt_bias")]
    saved = []

    def pack(t):
        saved.append((tuple(t.shape), t.untyped_storage().nbytes()))
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        o, _ = kda_ops.kda(*leaves[:6], leaves[6].view(2, -1))
    state_shape = (1, 2, x["v"].shape[-1], x["q"].shape[-1])
    blocks = [nbytes for shape, nbytes in saved if shape == state_shape]
    assert blocks and max(blocks) <= 4, f"saved start state: {blocks} bytes"
    o.float().sum().backward()  # and the backward runs from it
    assert all(t.grad is not None and torch.isfinite(t.grad.float()).all() for t in leaves)
