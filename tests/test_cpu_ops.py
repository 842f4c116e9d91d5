"""CPU implementation of the torch.ops.kda ops (csrc/cpu) vs the fp64 reference and the golden files.

The ops are called directly (torch.ops.kda.<op>.default) with the arguments the public API would
pass; only `import kda_ops` is relied on (it loads the extension).
"""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F
from conftest import load_golden

import kda_ops  # noqa: F401  (loads torch.ops.kda)
from kda_ops.reference import (
    make_inputs,
    recurrent_kda_reference,
    reference_training_grads,
    rel_rms,
)

OPS = torch.ops.kda
GATE_MODE = {"precomputed": 0, "softplus": 1, "lower_bound": 2}
TAPE_CHUNK = 64


# ----------------------------------------------------------------------------------------------
# helpers
# ----------------------------------------------------------------------------------------------


def _inputs(
    B=1,
    T=17,
    H=1,
    HV=2,
    K=128,
    V=128,
    dtype=torch.float32,
    state_dtype=torch.float32,
    seed=0,
    cu=None,
    N_pool=None,
    gate="lower_bound",
):
    inp = make_inputs(
        B=B, T=T, H=H, HV=HV, K=K, V=V, dtype=dtype, state_dtype=state_dtype, seed=seed, cu_seqlens=cu, N_pool=N_pool
    )
    if gate == "precomputed":
        # a precomputed gate is a log-decay: keep it negative so long sequences stay bounded
        inp["g"] = (F.logsigmoid(inp["g"].double()) * 0.5).to(dtype)
    return inp


def recurrent(
    inp,
    *,
    gate="lower_bound",
    lower_bound=-5.0,
    l2=True,
    logit=True,
    scale=None,
    state=None,
    source=None,
    source_idx=None,
    cu=None,
    ssm=None,
    n_acc=None,
    spec=0,
    final_state=None,
    ckpt=None,
    ckpt_starts=None,
    ckpt_every=0,
    out=None,
    A_log=None,
    dt_bias=None,
):
    """torch.ops.kda.recurrent_kda with the arguments the public API passes; returns the output."""
    q, k, v, g, beta = (inp[n] for n in ("q", "k", "v", "g", "beta"))
    if gate != "precomputed":
        A_log = inp["A_log"] if A_log is None else A_log
        dt_bias = inp["dt_bias"] if dt_bias is None else dt_bias
    if out is None:
        out = torch.full_like(v, float("nan"))  # every element must be written
    scale = 1.0 / math.sqrt(q.shape[-1]) if scale is None else scale
    OPS.recurrent_kda.default(
        q,
        k,
        v,
        g,
        beta,
        A_log,
        dt_bias,
        state,
        source,
        source_idx,
        cu,
        ssm,
        n_acc,
        None,
        out,
        final_state,
        ckpt,
        ckpt_starts,
        None,
        scale,
        GATE_MODE[gate],
        lower_bound if gate == "lower_bound" else 0.0,
        l2,
        logit,
        spec,
        ckpt_every,
        0,
    )
    return out


def reference(
    inp, init, *, gate="lower_bound", lower_bound=-5.0, l2=True, logit=True, scale=None, cu=None, ckpt_every=0
):
    return recurrent_kda_reference(
        inp["q"],
        inp["k"],
        inp["v"],
        inp["g"],
        inp["beta"],
        A_log=None if gate == "precomputed" else inp["A_log"],
        dt_bias=None if gate == "precomputed" else inp["dt_bias"],
        scale=scale,
        initial_state=init,
        cu_seqlens=cu,
        use_qk_l2norm_in_kernel=l2,
        use_gate_in_kernel=gate != "precomputed",
        lower_bound=lower_bound if gate == "lower_bound" else None,
        beta_is_logit=logit,
        checkpoint_every_n_tokens=ckpt_every,
    )


def seq_lengths(B, T, cu):
    return [T] * B if cu is None else [int(cu[i + 1] - cu[i]) for i in range(len(cu) - 1)]


def assert_bits(a, b, what):
    """Bit-identical (raw bytes: NaN payloads and -0.0 count)."""
    assert a.dtype == b.dtype and a.shape == b.shape, f"{what}: {a.dtype}{tuple(a.shape)} vs {b.dtype}{tuple(b.shape)}"
    same = bool(a.contiguous().view(torch.uint8).equal(b.contiguous().view(torch.uint8)))
    assert same, f"{what} bits differ"


# ----------------------------------------------------------------------------------------------
# recurrent_kda: semantics
# ----------------------------------------------------------------------------------------------


@pytest.mark.parametrize("gate", ["precomputed", "softplus", "lower_bound"])
@pytest.mark.parametrize("logit", [True, False])
@pytest.mark.parametrize("l2", [True, False])
def test_modes_fp32(gate, logit, l2):
    group = {"precomputed": 1, "softplus": 2, "lower_bound": 4}[gate]
    inp = _inputs(B=2, T=17, H=1, HV=group, gate=gate, seed=3)
    if not logit:
        inp["beta"] = torch.sigmoid(inp["beta"])
    if not l2:  # unnormalised keys: keep |k|^2 * beta < 2 so the delta rule stays stable
        inp["q"] = inp["q"] * 0.08
        inp["k"] = inp["k"] * 0.08
    pool = inp["initial_state"].clone()
    out = recurrent(inp, gate=gate, logit=logit, l2=l2, state=pool, scale=0.3)
    ref = reference(inp, inp["initial_state"], gate=gate, logit=logit, l2=l2, scale=0.3)
    # fp32 arithmetic over 17 tokens vs fp64: errors are a few fp32 ulps of the running state
    assert rel_rms(out, ref.output) < 1e-5
    assert rel_rms(pool, ref.final_state) < 1e-5


@pytest.mark.parametrize("group", [1, 2, 4])
@pytest.mark.parametrize("T", [0, 1, 17, 65, 130])
def test_fixed_lengths_gqa(group, T):
    inp = _inputs(B=2, T=T, H=2, HV=2 * group, K=64, V=64, dtype=torch.bfloat16, seed=T + group)
    pool = inp["initial_state"].clone()
    out = recurrent(inp, state=pool)
    ref = reference(inp, inp["initial_state"])
    if T == 0:
        assert out.numel() == 0
        assert_bits(pool, inp["initial_state"], "pool (T=0)")
        return
    # bf16 output: one rounding of ~2^-9 relative per element (bound 5e-3, docs/contract.md "Tolerances")
    assert rel_rms(out, ref.output) < 5e-3
    assert (out.double() - ref.output).abs().max() < 2e-2
    # fp32 state, fp32 arithmetic: far inside the 1e-3 limit
    assert rel_rms(pool, ref.final_state) < 1e-5


def test_packed_zero_length_and_final_state_without_pool():
    cu = [0, 0, 5, 22, 22, 87, 88]
    inp = _inputs(cu=cu, H=2, HV=4, dtype=torch.bfloat16, seed=5)
    cu_t = inp["cu_seqlens"]
    N = len(cu) - 1
    # with a pool (int32 cu_seqlens): zero-length rows keep their slot bit-identical
    pool = inp["initial_state"].clone()
    out = recurrent(inp, state=pool, cu=cu_t.to(torch.int32))
    ref = reference(inp, inp["initial_state"], cu=cu_t)
    assert rel_rms(out, ref.output) < 5e-3  # bf16 output rounding
    for n in range(N):
        if cu[n + 1] == cu[n]:
            assert_bits(pool[n], inp["initial_state"][n], f"slot {n} of a zero-length row")
        else:
            assert rel_rms(pool[n], ref.final_state[n]) < 1e-5  # fp32 state
    # without a pool: zeros in, fp32 final state out (zero-length rows: zeros)
    final = torch.full((N, 4, 128, 128), float("nan"))
    out2 = recurrent(inp, cu=cu_t, final_state=final)
    ref2 = reference(inp, None, cu=cu_t)
    assert rel_rms(out2, ref2.output) < 5e-3  # bf16 output rounding
    assert rel_rms(final, ref2.final_state) < 1e-5  # fp32 state
    assert final[0].abs().max() == 0 and final[3].abs().max() == 0


@pytest.mark.parametrize("state_dtype", [torch.float32, torch.bfloat16])
def test_pool_indices_and_inactive_slots(state_dtype):
    B, N_pool = 5, 6
    inp = _inputs(B=B, T=9, H=1, HV=2, dtype=torch.bfloat16, state_dtype=state_dtype, N_pool=N_pool, seed=7)
    idx = torch.tensor([4, -1, 0, 6, 2], dtype=torch.int32)  # -1 and 6 (= N_pool) are inactive
    pool0 = inp["initial_state"].clone()
    pool = pool0.clone()
    out = recurrent(inp, state=pool, ssm=idx)
    active = [0, 2, 4]
    init = torch.stack([pool0[max(int(i), 0) % N_pool] for i in idx])
    ref = reference(inp, init)
    for b in range(B):
        if b in active:
            assert rel_rms(out[b], ref.output[b]) < 5e-3  # bf16 output rounding
            tol = 1e-5 if state_dtype == torch.float32 else 1e-2  # bf16 state: one rounding on write-back
            assert rel_rms(pool[int(idx[b])], ref.final_state[b]) < tol
        else:
            assert out[b].abs().max() == 0, "inactive rows give zero output"
    for s in (1, 3, 5):
        assert_bits(pool[s], pool0[s], f"untouched slot {s}")


def test_bf16_state_rounded_only_on_write():
    # a bf16 pool is read once and written once per call: the result is round(fp32 loop), not a
    # loop that re-rounds every token
    inp = _inputs(B=1, T=40, H=1, HV=2, dtype=torch.bfloat16, state_dtype=torch.bfloat16, seed=8)
    pool = inp["initial_state"].clone()
    recurrent(inp, state=pool)
    pool32 = inp["initial_state"].float()
    recurrent(inp, state=pool32)
    assert_bits(pool, pool32.to(torch.bfloat16), "bf16 pool vs rounded fp32 pool")


def test_initial_state_source():
    B = 3
    inp = _inputs(B=B, T=6, H=1, HV=2, dtype=torch.bfloat16, N_pool=4, seed=9)
    source = (torch.randn(5, 2, 128, 128) * 0.1).to(torch.bfloat16)
    source0 = source.clone()
    src_idx = torch.tensor([3, 0, 7], dtype=torch.int32)  # 7 >= N0 = 5: inactive
    ssm = torch.tensor([1, 2, 0], dtype=torch.int32)
    pool0 = inp["initial_state"].clone()
    pool = pool0.clone()
    out = recurrent(inp, state=pool, source=source, source_idx=src_idx, ssm=ssm)
    ref = reference(inp, source[[3, 0, 0]])
    assert_bits(source, source0, "initial_state_source")
    for b in (0, 1):
        assert rel_rms(out[b], ref.output[b]) < 5e-3  # bf16 output rounding
        assert rel_rms(pool[int(ssm[b])], ref.final_state[b]) < 1e-5  # fp32 pool
    assert out[2].abs().max() == 0
    for s in (0, 3):
        assert_bits(pool[s], pool0[s], f"slot {s}")


@pytest.mark.parametrize("state_dtype", [torch.float32, torch.bfloat16])
def test_spec_decode_matches_single_token_decodes(state_dtype):
    N, S = 3, 3
    cu = torch.arange(0, N * (S + 1) + 1, S + 1, dtype=torch.int32)
    inp = _inputs(cu=cu.tolist(), H=1, HV=2, dtype=torch.bfloat16, state_dtype=state_dtype, N_pool=16, seed=11)
    ssm = torch.tensor([[0, 1, 2, 3], [4, 5, 6, 7], [8, 9, -1, 11]], dtype=torch.int32)
    n_acc = torch.tensor([2, 1, 4], dtype=torch.int32)  # start slots 1, 4, 11
    pool0 = inp["initial_state"].clone()
    pool = pool0.clone()
    out = recurrent(inp, state=pool, cu=cu, ssm=ssm, n_acc=n_acc, spec=S)

    # the same step as 1+S single-token decodes; each reads its start from the previous write slot
    dec_pool = pool0.clone()
    dec_out = torch.zeros_like(out)
    read = torch.tensor([1, 4, 11], dtype=torch.int32)
    cur = pool0.clone()  # read-only copy the next decode starts from
    for t in range(S + 1):
        tok = {n: inp[n][:, t :: S + 1].transpose(0, 1).contiguous() for n in ("q", "k", "v", "g", "beta")}
        tok.update(A_log=inp["A_log"], dt_bias=inp["dt_bias"])
        w = ssm[:, t].contiguous()
        active = w >= 0
        o = recurrent(tok, state=dec_pool, source=cur, source_idx=read, ssm=w)
        dec_out[0, t :: S + 1] = o[:, 0]
        read = torch.where(active, w, read).to(torch.int32)  # an inactive token does not advance
        cur = dec_pool.clone()
    if state_dtype == torch.float32:
        assert_bits(out, dec_out, "spec output vs single decodes")
        assert_bits(pool, dec_pool, "spec pool vs single decodes")
    else:
        # bf16 pool: the spec step keeps fp32 between tokens, the decodes re-read rounded states
        assert rel_rms(out, dec_out) < 5e-3 and rel_rms(pool, dec_pool) < 1e-2
    assert out[0, 2 * (S + 1) + 2].abs().max() == 0, "inactive spec token has zero output"
    for s in (10, 12, 13, 14, 15):
        assert_bits(pool[s], pool0[s], f"untouched slot {s}")
    # and vs the reference: sequence 0 starts at slot 1
    ref = reference(
        {k_: v_[:, : S + 1] if k_ in "q k v g beta".split() else v_ for k_, v_ in inp.items()}, pool0[1:2].float()
    )
    assert rel_rms(out[:, : S + 1], ref.output) < 5e-3  # bf16 output rounding


@pytest.mark.parametrize("ckpt_dtype", [torch.float32, torch.bfloat16])
def test_checkpoints(ckpt_dtype):
    cu = [0, 65, 196]
    inp = _inputs(cu=cu, H=1, HV=2, dtype=torch.bfloat16, seed=13)
    starts = torch.tensor([0, 2, 5], dtype=torch.int64)
    ckpt = torch.full((5, 2, 128, 128), 7.0, dtype=ckpt_dtype)
    pool = inp["initial_state"].clone()
    out = recurrent(inp, state=pool, cu=inp["cu_seqlens"], ckpt=ckpt, ckpt_starts=starts, ckpt_every=64)
    ref = reference(inp, inp["initial_state"], cu=inp["cu_seqlens"], ckpt_every=64)
    assert rel_rms(out, ref.output) < 5e-3  # bf16 output rounding
    want = torch.cat(ref.checkpoints)
    # checkpoint rows are exact copies of the running state: fp32 rows within fp32 loop error,
    # bf16 rows within one bf16 rounding (docs/contract.md "Tolerances": bf16 states <= 1e-2)
    assert rel_rms(ckpt, want) < (1e-5 if ckpt_dtype == torch.float32 else 1e-2)
    assert_bits(ckpt[0], inp["initial_state"][0].to(ckpt_dtype), "row 0 = initial state")
    # fewer rows than needed: rows past the end are skipped, never written out of bounds
    small = torch.full((3, 2, 128, 128), 7.0, dtype=ckpt_dtype)
    recurrent(
        inp, state=inp["initial_state"].clone(), cu=inp["cu_seqlens"], ckpt=small, ckpt_starts=starts, ckpt_every=64
    )
    assert_bits(small, ckpt[:3].clone(), "truncated checkpoint rows")


def test_fp64_matches_reference():
    cu = [0, 3, 3, 70]
    for gate in ("precomputed", "softplus", "lower_bound"):
        inp = _inputs(cu=cu, H=1, HV=2, K=64, V=64, dtype=torch.float64, state_dtype=torch.float64, seed=17, gate=gate)
        pool = inp["initial_state"].clone()
        out = recurrent(inp, gate=gate, lower_bound=-3.7, state=pool, cu=inp["cu_seqlens"], scale=0.21)
        ref = reference(inp, inp["initial_state"], gate=gate, lower_bound=-3.7, cu=inp["cu_seqlens"], scale=0.21)
        # same fp64 formulas, only the summation order differs: ~1e-15 relative
        assert rel_rms(out, ref.output) < 1e-10
        assert rel_rms(pool, ref.final_state) < 1e-10


def test_fp16_is_type_error_and_rejections_leave_state():
    inp = _inputs(B=1, T=3, dtype=torch.float16)
    pool = inp["initial_state"].clone()
    with pytest.raises(TypeError):
        recurrent(inp, state=pool)
    assert_bits(pool, inp["initial_state"], "pool after a rejected call")
    inp = _inputs(B=1, T=3, H=2, HV=3, dtype=torch.float32)
    with pytest.raises(ValueError):
        recurrent(inp, state=inp["initial_state"].clone())


def test_strided_token_views_and_padded_pool():
    # q/k/v as views of one fused projection, and a pool whose slot stride is padded
    B, T, H, HV, K = 2, 11, 1, 2, 64
    inp = _inputs(B=B, T=T, H=H, HV=HV, K=K, V=K, dtype=torch.float32, seed=19)
    fused = torch.cat([inp["q"], inp["k"], inp["v"]], dim=2)  # [B, T, 4, K]
    views = dict(inp, q=fused[:, :, 0:1], k=fused[:, :, 1:2], v=fused[:, :, 2:4])
    padded = torch.zeros(B, HV * K * K + 16)
    pool = padded[:, : HV * K * K].view(B, HV, K, K)
    pool.copy_(inp["initial_state"])
    out = recurrent(views, state=pool)
    ref = reference(inp, inp["initial_state"])
    assert rel_rms(out, ref.output) < 1e-5  # fp32 tokens and state
    assert rel_rms(pool, ref.final_state) < 1e-5
    assert padded[:, HV * K * K :].abs().max() == 0, "pool padding untouched"


def test_recurrent_deterministic():
    inp = _inputs(cu=[0, 50, 51, 120], H=2, HV=4, dtype=torch.bfloat16, seed=23)
    runs = []
    for threads in (1, torch.get_num_threads(), 1):
        old = torch.get_num_threads()
        torch.set_num_threads(threads)
        try:
            pool = inp["initial_state"].clone()
            runs.append((recurrent(inp, state=pool, cu=inp["cu_seqlens"]), pool))
        finally:
            torch.set_num_threads(old)
    for o, p in runs[1:]:
        assert_bits(o, runs[0][0], "output on rerun")
        assert_bits(p, runs[0][1], "pool on rerun")


# ----------------------------------------------------------------------------------------------
# training ops
# ----------------------------------------------------------------------------------------------


def _training_inputs(cu=None, B=1, T=0, H=1, HV=2, K=64, dtype=torch.bfloat16, seed=0):
    state_dtype = torch.float64 if dtype == torch.float64 else torch.float32
    inp = make_inputs(B=B, T=T, H=H, HV=HV, K=K, V=K, dtype=dtype, state_dtype=state_dtype, seed=seed, cu_seqlens=cu)
    if dtype == torch.float64:  # gradcheck-grade: parameters in fp64 too
        inp["A_log"], inp["dt_bias"] = inp["A_log"].double(), inp["dt_bias"].double()
    gen = torch.Generator().manual_seed(seed + 1)
    inp["do"] = torch.randn(inp["v"].shape, generator=gen).to(dtype)
    inp["dfinal"] = torch.randn(inp["initial_state"].shape, generator=gen).to(state_dtype)
    return inp


def training_forward(inp, scale, lb):
    return OPS.recurrent_kda_training_forward.default(
        inp["q"],
        inp["k"],
        inp["v"],
        inp["g"],
        inp["beta"],
        inp["A_log"],
        inp["dt_bias"],
        inp["initial_state"],
        inp.get("cu_seqlens"),
        scale,
        lb,
    )


def training_backward(inp, fwd, scale, lb, dfinal=True):
    return OPS.recurrent_kda_training_backward.default(
        inp["q"],
        inp["k"],
        inp["v"],
        inp["g"],
        inp["beta"],
        inp["A_log"],
        inp["dt_bias"],
        fwd[2],
        fwd[3],
        inp["initial_state"],
        inp.get("cu_seqlens"),
        inp["do"],
        inp["dfinal"] if dfinal else None,
        scale,
        lb,
    )


def reference_grads(inp, scale, lb, dfinal=True):
    return reference_training_grads(
        inp["q"],
        inp["k"],
        inp["v"],
        inp["g"],
        inp["beta"],
        inp["A_log"],
        inp["dt_bias"],
        inp["initial_state"],
        inp["do"],
        inp["dfinal"] if dfinal else None,
        cu_seqlens=inp.get("cu_seqlens"),
        scale=scale,
        lower_bound=lb,
    )


GRAD_NAMES = ("dq", "dk", "dv", "dg", "dbeta", "dA_log", "ddt_bias", "dinitial_state")


@pytest.mark.parametrize("layout", ["fixed", "packed"])
def test_training_forward_tapes(layout):
    if layout == "fixed":
        inp = _training_inputs(B=2, T=130, H=1, HV=2, seed=31)
        lens, rows = [130, 130], 2 * (3 - 1)  # no row for the state before token 0
    else:
        inp = _training_inputs(cu=[0, 64, 64, 65, 195], H=1, HV=2, seed=32)
        lens, rows = [64, 0, 1, 130], 195 // 64
    scale, lb = 0.15, -4.0
    out, final, tapes, starts = training_forward(inp, scale, lb)
    want_starts = [0]
    for L in lens:
        want_starts.append(want_starts[-1] + max(-(-L // TAPE_CHUNK) - 1, 0))
    assert starts.dtype == torch.int64 and starts.tolist() == want_starts
    assert tapes.shape == (rows, 2, 64, 64) and tapes.dtype == torch.float32
    assert final.dtype == inp["initial_state"].dtype and out.dtype == inp["v"].dtype
    ref = recurrent_kda_reference(
        inp["q"],
        inp["k"],
        inp["v"],
        inp["g"],
        inp["beta"],
        inp["A_log"],
        inp["dt_bias"],
        scale=scale,
        initial_state=inp["initial_state"],
        cu_seqlens=inp.get("cu_seqlens"),
        use_gate_in_kernel=True,
        lower_bound=lb,
        beta_is_logit=True,
        checkpoint_every_n_tokens=TAPE_CHUNK,
    )
    assert rel_rms(out, ref.output) < 5e-3  # bf16 output rounding
    assert rel_rms(final, ref.final_state) < 1e-5  # fp32 state, fp32 loop
    used = want_starts[-1]
    # fp32 tape rows = fp32 running state before tokens 64, 128, ... (token 0's is initial_state)
    assert rel_rms(tapes[:used], torch.cat([c[1:] for c in ref.checkpoints])) < 1e-5
    assert tapes[used:].abs().max() == 0 if used < rows else True, "unused tape rows are zero"


@pytest.mark.parametrize(
    "cu,B,T,H,HV",
    [
        (None, 2, 70, 1, 1),  # fixed, two chunks
        ([0, 17, 17, 147], 1, 0, 1, 2),  # packed, zero-length row, three chunks, GQA 2
        ([0, 5, 70], 1, 0, 1, 4),  # GQA 4
    ],
)
def test_training_grads_fp64(cu, B, T, H, HV):
    inp = _training_inputs(cu=cu, B=B, T=T, H=H, HV=HV, dtype=torch.float64, seed=41)
    scale, lb = 0.17, -3.3
    fwd = training_forward(inp, scale, lb)
    assert fwd[2].dtype == torch.float64  # fp64 tokens: fp64 tapes, so the recompute is exact
    grads = training_backward(inp, fwd, scale, lb)
    ref_out, ref_final, ref_grads = reference_grads(inp, scale, lb)
    # the same fp64 math in a different summation order: ~1e-15 relative
    assert rel_rms(fwd[0], ref_out) < 1e-10 and rel_rms(fwd[1], ref_final) < 1e-10
    for name, a, b in zip(GRAD_NAMES, grads, ref_grads, strict=True):
        assert a.dtype == torch.float64 and a.shape == b.shape, name
        assert rel_rms(a, b) < 1e-10, name


@pytest.mark.parametrize("dfinal", [True, False])
def test_training_grads_bf16(dfinal):
    K = 128 if dfinal else 64
    inp = _training_inputs(cu=[0, 30, 30, 100], H=2, HV=4, K=K, dtype=torch.bfloat16, seed=43)
    scale, lb = 1 / math.sqrt(K), -5.0
    fwd = training_forward(inp, scale, lb)
    grads = training_backward(inp, fwd, scale, lb, dfinal=dfinal)
    _, _, ref_grads = reference_grads(inp, scale, lb, dfinal=dfinal)
    dtypes = [torch.bfloat16] * 5 + [torch.float32] * 3
    for name, a, b, dt in zip(GRAD_NAMES, grads, ref_grads, dtypes, strict=True):
        assert a.dtype == dt and a.shape == b.shape, name
        assert torch.isfinite(a).all(), name
        # docs/contract.md "Tolerances": 1e-2 for every gradient; bf16-stored ones carry one ~2e-3 rounding, fp32
        # ones only
        # the fp32 loop error
        assert rel_rms(a, b) < (5e-3 if dt == torch.bfloat16 else 1e-4), name


def test_recurrent_kda_backward_equals_forward_plus_backward_and_is_deterministic():
    inp = _training_inputs(cu=[0, 3, 100], H=1, HV=2, dtype=torch.bfloat16, seed=47)
    scale, lb = 0.1, -2.0
    fwd = training_forward(inp, scale, lb)
    grads = training_backward(inp, fwd, scale, lb)
    old = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        direct = OPS.recurrent_kda_backward.default(
            inp["q"],
            inp["k"],
            inp["v"],
            inp["g"],
            inp["beta"],
            inp["A_log"],
            inp["dt_bias"],
            inp["initial_state"],
            inp["cu_seqlens"],
            inp["do"],
            inp["dfinal"],
            scale,
            lb,
        )
        fwd1 = training_forward(inp, scale, lb)
    finally:
        torch.set_num_threads(old)
    for name, a, b in zip(GRAD_NAMES, grads, direct, strict=True):
        assert_bits(a, b, name)
    for i in range(4):
        assert_bits(fwd[i], fwd1[i], f"forward result {i}")
    # bf16 initial state: dinitial_state comes back in its dtype
    inp16 = dict(inp, initial_state=inp["initial_state"].to(torch.bfloat16), dfinal=None)
    d16 = OPS.recurrent_kda_backward.default(
        inp16["q"],
        inp16["k"],
        inp16["v"],
        inp16["g"],
        inp16["beta"],
        inp16["A_log"],
        inp16["dt_bias"],
        inp16["initial_state"],
        inp16["cu_seqlens"],
        inp16["do"],
        None,
        scale,
        lb,
    )
    assert d16[7].dtype == torch.bfloat16


def test_training_empty_and_flat_dt_bias():
    # T = 0: no tape rows, no output, dinitial_state = dfinal_state
    inp = _training_inputs(B=2, T=0, H=1, HV=2, seed=59)
    fwd = training_forward(inp, 0.1, -5.0)
    assert fwd[2].shape[0] == 0 and fwd[3].tolist() == [0, 0, 0]
    assert_bits(fwd[1], inp["initial_state"], "final state of empty sequences")
    grads = training_backward(inp, fwd, 0.1, -5.0)
    assert_bits(grads[7], inp["dfinal"], "dinitial_state of empty sequences")
    assert grads[5].abs().max() == 0 and grads[6].abs().max() == 0
    # dt_bias given flat [HV*K]: ddt_bias comes back flat, same values
    inp = _training_inputs(B=1, T=20, H=1, HV=2, seed=61)
    g2 = training_backward(inp, training_forward(inp, 0.1, -5.0), 0.1, -5.0)
    flat = dict(inp, dt_bias=inp["dt_bias"].reshape(-1))
    g1 = training_backward(flat, training_forward(flat, 0.1, -5.0), 0.1, -5.0)
    assert g1[6].shape == (2 * 64,)
    assert_bits(g1[6], g2[6].reshape(-1), "flat ddt_bias")


def test_training_rejects_bad_tapes():
    inp = _training_inputs(cu=[0, 70, 80], H=1, HV=2, seed=53)
    fwd = training_forward(inp, 0.1, -5.0)
    bad = (fwd[0], fwd[1], fwd[2], torch.tensor([0, 1, 2]))  # sequence 1 (10 tokens) needs no row
    with pytest.raises(ValueError):
        training_backward(inp, bad, 0.1, -5.0)
    with pytest.raises(ValueError):
        training_forward(dict(inp, cu_seqlens=torch.tensor([0, 90, 80])), 0.1, -5.0)


# ----------------------------------------------------------------------------------------------
# golden files (docs/contract.md "Tolerances"), through the op arguments the public API passes
# ----------------------------------------------------------------------------------------------


GOLDEN_RECURRENT = [
    "decode_gqa_lowerbound.pt",
    "prefill_packed_softplus.pt",
    "prefill_precomputed_gate_no_l2.pt",
    "prefill_checkpoints.pt",
    "spec_decode_accepted.pt",
]


def _golden(name):
    return load_golden(name.removesuffix(".pt"))  # (tests/conftest.py: the same search, one skip message)


@pytest.mark.parametrize("name", GOLDEN_RECURRENT)
def test_golden_recurrent(name):
    gd = _golden(name)
    inp, kw, exp = gd["inputs"], gd["kwargs"], gd["expected"]
    q, v = inp["q"], inp["v"]
    HV, V, K = v.shape[2], v.shape[3], q.shape[3]
    gate = (
        "precomputed"
        if not kw.get("use_gate_in_kernel", False)
        else "softplus"
        if kw.get("lower_bound") is None
        else "lower_bound"
    )
    pool0 = inp.get("initial_state")
    pool = None if pool0 is None else pool0.clone()
    cu = inp.get("cu_seqlens")
    N = q.shape[0] if cu is None else cu.numel() - 1
    spec = kw.get("num_spec_tokens") or 0
    every = kw.get("checkpoint_every_n_tokens", 0)
    final = torch.empty(N, HV, V, K) if pool is None and kw.get("output_final_state") else None
    starts = inp.get("checkpoint_cu_starts") if every else None
    ckpt = None
    if every:
        ckpt = torch.empty(int(starts[-1]), HV, V, K, dtype=torch.float32 if pool is None else pool.dtype)
    ssm = inp.get("ssm_state_indices")
    out = recurrent(
        inp,
        gate=gate,
        lower_bound=kw.get("lower_bound") or 0.0,
        l2=kw.get("use_qk_l2norm_in_kernel", True),
        logit=kw.get("beta_is_logit", False),
        scale=kw.get("scale"),
        state=pool,
        cu=cu,
        ssm=ssm,
        n_acc=inp.get("num_accepted_tokens"),
        spec=spec,
        final_state=final,
        ckpt=ckpt,
        ckpt_starts=starts,
        ckpt_every=every,
    )
    # docs/contract.md "Tolerances": bf16-input outputs within rel RMS 5e-3 and max abs 2e-2 of the fp64 result
    assert rel_rms(out, exp["output"]) < 5e-3
    assert (out.double() - exp["output"].double()).abs().max() < 2e-2
    if "state_pool_after" in exp:
        assert rel_rms(pool, exp["state_pool_after"]) < 1e-3  # docs/contract.md "Tolerances": fp32 states
        written = set(ssm.flatten().tolist()) if ssm is not None else set(range(N))
        for s in range(pool.shape[0]):
            if s not in written:
                assert_bits(pool[s], pool0[s], f"untouched slot {s}")
    if "final_state" in exp:
        got = final
        if got is None:  # the API returns the pool slots of the sequences
            idx = ssm.long() if ssm is not None else torch.arange(N)
            got = pool[idx]
        assert rel_rms(got, exp["final_state"]) < 1e-3  # docs/contract.md "Tolerances": fp32 states
        if cu is not None:
            for n in range(N):
                if cu[n + 1] == cu[n] and pool is not None:
                    assert_bits(pool[n], pool0[n], f"zero-length row {n}")
    if "state_checkpoints" in exp:
        assert rel_rms(ckpt, exp["state_checkpoints"]) < 1e-3  # docs/contract.md "Tolerances": fp32 states


def test_golden_training():
    gd = _golden("training_grads_packed_gqa.pt")
    inp, kw, exp = gd["inputs"], gd["kwargs"], gd["expected"]
    scale, lb = kw["scale"], kw["lower_bound"]
    fwd = training_forward(inp, scale, lb)
    inp = dict(inp, dfinal=inp["dfinal_state"])
    grads = training_backward(inp, fwd, scale, lb)
    assert rel_rms(fwd[0], exp["output"]) < 5e-3  # docs/contract.md "Tolerances": bf16 outputs
    assert rel_rms(fwd[1], exp["final_state"]) < 1e-3  # docs/contract.md "Tolerances": fp32 states
    for name, a in zip(GRAD_NAMES, grads, strict=True):
        assert torch.isfinite(a).all(), name
        assert rel_rms(a, exp[name]) < 1e-2, name  # docs/contract.md "Tolerances": every gradient
    direct = OPS.recurrent_kda_backward.default(
        inp["q"],
        inp["k"],
        inp["v"],
        inp["g"],
        inp["beta"],
        inp["A_log"],
        inp["dt_bias"],
        inp["initial_state"],
        inp["cu_seqlens"],
        inp["do"],
        inp["dfinal_state"],
        scale,
        lb,
    )
    for name, a, b in zip(GRAD_NAMES, grads, direct, strict=True):
        assert_bits(a, b, name)
