"""The six golden files (../shared/golden, README there) through the PUBLIC API, on CPU and (marked
``gpu``) CUDA, plus kda_ops.reference against the same files (an outside check of the reference).

Tolerances: docs/contract.md "Tolerances": outputs relative RMS <= 5e-3 and max abs <= 2e-2; fp32 states <= 1e-3;
gradients <= 1e-2. Slots the call must not touch are compared bit-exactly against the inputs: a golden
slot equal to its input (an fp32 -> fp64 -> fp32 round trip is exact) marks an untouched slot.
"""

from __future__ import annotations

import pytest
import torch
from conftest import (
    DEVICES,
    TOL_GRAD,
    TOL_STATE_FP32,
    assert_close_rms,
    assert_output,
    load_golden,
    needs_cpu_op,
)

import kda_ops
from kda_ops.reference import recurrent_kda_reference, reference_training_grads

GRADS = ("dq", "dk", "dv", "dg", "dbeta", "dA_log", "ddt_bias", "dinitial_state")
TOKENS = ("q", "k", "v", "g", "beta")


def _to(d: dict, device: str) -> dict:
    return {n: (t.to(device) if isinstance(t, torch.Tensor) else t) for n, t in d.items()}


def _check_pool(pool_after: torch.Tensor, pool_before: torch.Tensor, expected: torch.Tensor) -> None:
    """Touched slots within the fp32 state tolerance, untouched slots bit-identical."""
    pool_after, pool_before = pool_after.cpu(), pool_before.cpu()
    touched = 0
    for s in range(expected.shape[0]):
        if torch.equal(expected[s], pool_before[s]):
            assert torch.equal(pool_after[s], pool_before[s]), f"slot {s} must be untouched"
        else:
            touched += 1
            assert_close_rms(pool_after[s], expected[s], TOL_STATE_FP32, f"slot {s}")
    assert touched > 0


RECURRENT_FILES = [
    "decode_gqa_lowerbound",
    "prefill_packed_softplus",
    "prefill_precomputed_gate_no_l2",
    "prefill_checkpoints",
    "spec_decode_accepted",
]


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("name", RECURRENT_FILES)
def test_golden_recurrent_kda(name, device):
    gold = load_golden(name)
    x = _to(gold["inputs"], device)
    exp = gold["expected"]
    pool_before = x.get("initial_state")
    if pool_before is not None:
        x["initial_state"] = pool_before.clone()
    res = kda_ops.recurrent_kda(**x, **gold["kwargs"])
    out, final = res[0], res[1]
    assert_output(out, exp["output"])
    if "state_pool_after" in exp:
        assert final is x["initial_state"]
        _check_pool(final, pool_before, exp["state_pool_after"])
    if "final_state" in exp:
        if pool_before is not None:
            assert final is x["initial_state"]
            _check_pool(final, pool_before, exp["final_state"])
        else:
            assert final.dtype == torch.float32
            assert_close_rms(final, exp["final_state"], TOL_STATE_FP32, "final_state")
    if "state_checkpoints" in exp:
        assert len(res) == 3
        assert res[2].shape == exp["state_checkpoints"].shape
        assert_close_rms(res[2], exp["state_checkpoints"], TOL_STATE_FP32, "state_checkpoints")


def _golden_training(device: str):
    gold = load_golden("training_grads_packed_gqa")
    x = _to(gold["inputs"], device)
    args = [x[n] for n in (*TOKENS, "A_log", "dt_bias", "initial_state")]
    return gold, x, args, gold["kwargs"]


def _check_grads(grads, exp) -> None:
    for name, gr in zip(GRADS, grads, strict=True):
        assert torch.isfinite(gr.float()).all(), name
        assert_close_rms(gr, exp[name], TOL_GRAD, name)


@needs_cpu_op("recurrent_kda_training_forward", "recurrent_kda_training_backward")
@pytest.mark.parametrize("device", DEVICES)
def test_golden_training_forward_backward(device):
    gold, x, args, kw = _golden_training(device)
    exp = gold["expected"]
    h0 = x["initial_state"].clone()
    out, fs, ctx = kda_ops.recurrent_kda_training_forward(
        *args, cu_seqlens=x["cu_seqlens"], cu_seqlens_cpu=gold["inputs"]["cu_seqlens"], **kw
    )
    assert torch.equal(x["initial_state"], h0), "initial_state must not be modified"
    assert_output(out, exp["output"])
    assert_close_rms(fs, exp["final_state"], TOL_STATE_FP32, "final_state")
    grads = kda_ops.recurrent_kda_training_backward(ctx, x["do"], x["dfinal_state"])
    _check_grads(grads, exp)


@needs_cpu_op("recurrent_kda_backward")
@pytest.mark.parametrize("device", DEVICES)
def test_golden_recurrent_kda_backward(device):
    gold, x, args, kw = _golden_training(device)
    grads = kda_ops.recurrent_kda_backward(*args, x["do"], x["dfinal_state"], cu_seqlens=x["cu_seqlens"], **kw)
    _check_grads(grads, gold["expected"])


@needs_cpu_op("recurrent_kda_training_forward", "recurrent_kda_training_backward")
@pytest.mark.parametrize("device", DEVICES)
def test_golden_kda_autograd(device):
    gold, x, args, kw = _golden_training(device)
    exp = gold["expected"]
    leaves = [t.detach().clone().requires_grad_() for t in args]
    o, fs = kda_ops.kda(*leaves, cu_seqlens=x["cu_seqlens"], output_final_state=True, **kw)
    assert_output(o, exp["output"])
    assert_close_rms(fs, exp["final_state"], TOL_STATE_FP32, "final_state")
    torch.autograd.backward([o, fs], [x["do"], x["dfinal_state"]])
    _check_grads([t.grad for t in leaves], exp)


# ---------------------------------------------------------------------------------------------------
# the reference against the same files


@pytest.mark.parametrize("name", RECURRENT_FILES)
def test_golden_reference(name):
    gold = load_golden(name)
    x, kw, exp = gold["inputs"], dict(gold["kwargs"]), gold["expected"]
    S = kw.pop("num_spec_tokens", 0)
    kw.pop("output_final_state", None)
    ck_every = kw.get("checkpoint_every_n_tokens", 0)
    pool = x.get("initial_state")
    tok = {n: x[n] for n in TOKENS}
    params = {n: x[n] for n in ("A_log", "dt_bias") if n in x}
    if S:
        # One sequence at a time from its accepted slot; the state after token t goes to idx[n, t].
        idx, acc, cu = x["ssm_state_indices"], x["num_accepted_tokens"], x["cu_seqlens"].tolist()
        pool_after = pool.double().clone()
        for n in range(idx.shape[0]):
            c = min(max(int(acc[n]) - 1, 0), S)
            st = pool[int(idx[n, c])].double()
            for t in range(1 + S):
                one = {m: v[:, cu[n] + t : cu[n] + t + 1] for m, v in tok.items()}
                r = recurrent_kda_reference(**one, **params, initial_state=st[None], **kw)
                assert_output(r.output[0, 0], exp["output"][0, cu[n] + t], f"token {cu[n] + t}")
                st = r.final_state[0]
                pool_after[int(idx[n, t])] = st
        _check_pool(pool_after.float(), pool, exp["state_pool_after"])
        return
    cu = x.get("cu_seqlens")
    N = tok["q"].shape[0] if cu is None else cu.numel() - 1
    slots = x["ssm_state_indices"].long() if "ssm_state_indices" in x else torch.arange(N)
    start = None if pool is None else pool[slots]
    r = recurrent_kda_reference(**tok, **params, initial_state=start, cu_seqlens=cu, **kw)
    assert_output(r.output, exp["output"])
    if pool is not None:
        after = pool.double().clone()
        lens = [1] * N if cu is None else (cu[1:] - cu[:-1]).tolist()
        for n, s in enumerate(slots.tolist()):
            if lens[n] > 0:
                after[s] = r.final_state[n]
        _check_pool(after.float(), pool, exp.get("state_pool_after", exp.get("final_state")))
    else:
        assert_close_rms(r.final_state, exp["final_state"], TOL_STATE_FP32, "final_state")
    if ck_every:
        assert_close_rms(torch.cat(r.checkpoints), exp["state_checkpoints"], TOL_STATE_FP32, "checkpoints")


def test_golden_reference_training():
    gold = load_golden("training_grads_packed_gqa")
    x, kw, exp = gold["inputs"], gold["kwargs"], gold["expected"]
    out, fs, grads = reference_training_grads(
        *[x[n] for n in (*TOKENS, "A_log", "dt_bias", "initial_state")],
        x["do"],
        x["dfinal_state"],
        cu_seqlens=x["cu_seqlens"],
        **kw,
    )
    assert_output(out, exp["output"])
    assert_close_rms(fs, exp["final_state"], TOL_STATE_FP32, "final_state")
    _check_grads(grads, exp)
