"""GPU tier: the CUDA chunked (tensor-core) prefill, ``recurrent_kda(..., backend="chunked")``,
against kda_ops.reference (the fp64 token loop of docs/contract.md "Recurrence") on the same bf16-rounded inputs.

The chunked path takes K = V = 128 only, so every case here uses it. Tolerances: docs/contract.md "Tolerances" (see
tests/conftest.py): outputs 5e-3 relative RMS and 2e-2 max abs; fp32 states 1e-3, bf16 states 1e-2.
Inactive rows are compared with exact zeros; untouched slots, padding and read-only sources bit for bit.
Two documented exceptions: near-collinear keys with β ≈ 1 are checked for finiteness plus the loose bound
measured for the chunked form in kda_ops/reference_chunked.py, and changing FUTURE gates inside a chunk
may move the prefix by rounding (a reference row inside a sub-chunk, "mid" diagonal blocks), so only
changes of q/k/v/beta, or of gates from a 64-token boundary on, must leave the prefix bit-identical.

KDA_CHUNKED_TEST_DEVICE=cpu runs the device-neutral tests on the CPU op (which ignores ``backend`` and
runs its token loop): a check of the harness itself that needs no GPU. The module then carries no gpu
marker, so leave out ``-m gpu``; and tests/conftest.py skips every item whose keywords contain "gpu",
which includes the name of this directory, so load the helpers without the conftest hooks:
    KDA_CHUNKED_TEST_DEVICE=cpu PYTHONPATH=tests python -m pytest tests/gpu/test_chunked_cuda.py --noconftest -q
Runtime on an H200 is dominated by the fp64 reference (a token loop): sizes are kept at HV <= 4, and
references of >= 512 tokens run on the device.
"""

from __future__ import annotations

import math
import os

import pytest
import torch
from conftest import (
    GATES,
    TOL_STATE_FP32,
    assert_close_rms,
    assert_output,
    bits,
    capture_graph,
    check_pool,
    gate_kwargs,
    inputs,
    lengths_to_cu,
    route_env,
    state_tol,
)

import kda_ops
from kda_ops.reference import recurrent_kda_reference, rel_rms

DEV = os.environ.get("KDA_CHUNKED_TEST_DEVICE", "cuda")
pytestmark = [pytest.mark.gpu] if DEV == "cuda" else []
cuda_only = pytest.mark.skipif(DEV != "cuda" or not torch.cuda.is_available(), reason="CUDA-specific")


@pytest.fixture(autouse=True)
def _mma_kernel(monkeypatch):  # type: ignore[no-untyped-def]
    """The tests of this file pin the portable mma.sync kernel (KDA_CHUNKED_KERNEL=mma); the default on sm_90a
    routes large grids to the Hopper kernel, and tests/gpu/test_chunked_sm90.py collects these tests again
    with that kernel forced."""
    route_env(monkeypatch, KDA_CHUNKED_KERNEL="mma")


K = 128  # the chunked path takes K = V = 128 only
F32, BF16 = torch.float32, torch.bfloat16
# decode rows, zero-length rows and long prefill rows in one packed call
PACKED_LENGTHS = [0, 1, 300, 16, 0, 77, 1, 40]
PACKED_N_POOL = 9
PACKED_SLOTS = [4, 6, 0, 9, 2, 7, 1, -5]  # 9 (== N_pool) and -5: inactive; 4, 2: zero-length rows


# ---------------------------------------------------------------------------------------------------
# helpers (the idea of tests/gpu/test_recurrent_cuda.py's, with K = V = 128 fixed)


def make(B=1, T=1, H=1, HV=2, state_dtype=F32, N_pool=None, lengths=None, seed=0):
    cu = None if lengths is None else lengths_to_cu(lengths).tolist()
    return inputs(
        B=B, T=T, H=H, HV=HV, K=K, V=K, state_dtype=state_dtype, N_pool=N_pool, cu_seqlens=cu, device=DEV, seed=seed
    )


def tok(x, gate="lower_bound", logit=True, l2=True):
    """Token tensors for a mode: precomputed gate = a log-decay <= 0; without L2 norm q, k are divided by
    sqrt(K) (|k|^2 ~ 1, so beta |k|^2 < 2 and the delta rule stays bounded)."""
    g = x["g"]
    if gate == "precomputed":
        g = -torch.nn.functional.softplus(g.float()).to(g.dtype)
    q, k = x["q"], x["k"]
    if not l2:
        q, k = ((z.float() / math.sqrt(K)).to(z.dtype) for z in (q, k))
    return dict(q=q, k=k, v=x["v"], g=g, beta=x["beta"] if logit else x["beta_prob"])


gkw = gate_kwargs  # (tests/conftest.py)


def mode(logit=True, l2=True):
    """Arguments shared by the kernel call and the reference (an explicit scale without L2 norm)."""
    return dict(beta_is_logit=logit, use_qk_l2norm_in_kernel=l2, scale=None if l2 else 0.5)


def ref(t, g, initial_state=None, cu_seqlens=None, **kw):
    """fp64 reference; initial_state per sequence [N, HV, V, K] (None = zeros); beta is a logit unless said
    otherwise. Inputs of >= 512 tokens run on the device (the token loop's small ops are cheaper there)."""
    kw.setdefault("beta_is_logit", True)
    on_device = t["q"].shape[1] >= 512
    c = lambda z: (z if on_device else z.cpu()) if isinstance(z, torch.Tensor) else z  # noqa: E731
    return recurrent_kda_reference(
        **{n: c(z) for n, z in t.items()},
        **{n: c(z) for n, z in g.items()},
        initial_state=c(initial_state),
        cu_seqlens=c(cu_seqlens),
        **kw,
    )


def call(t, g, backend="chunked", **kw):
    """The public API; beta is a logit unless said otherwise (as in ref)."""
    kw.setdefault("beta_is_logit", True)
    return kda_ops.recurrent_kda(**t, **g, backend=backend, **kw)


def seq_lengths(x) -> list[int]:
    if "cu_seqlens" in x:
        cu = x["cu_seqlens"].tolist()
        return [cu[i + 1] - cu[i] for i in range(len(cu) - 1)]
    return [x["q"].shape[1]] * x["q"].shape[0]


def token_mask(x, per_seq: list[bool]) -> torch.Tensor:
    """[B, T] bool (CPU): the tokens of the sequences flagged in per_seq."""
    B, T = x["q"].shape[:2]
    m = torch.zeros(B, T, dtype=torch.bool)
    if "cu_seqlens" in x:
        cu = x["cu_seqlens"].tolist()
        for n, on in enumerate(per_seq):
            m[0, cu[n] : cu[n + 1]] = on
    else:
        m[torch.tensor(per_seq, dtype=torch.bool)] = True
    return m


def check_rows(o, expected, mask):
    """Output of the masked tokens vs expected; every other token exactly zero (inactive rows)."""
    o, expected = o.cpu(), expected.cpu()
    assert torch.count_nonzero(o[~mask]) == 0, "inactive or absent tokens have non-zero output"
    if mask.any():
        assert_output(o[mask], expected[mask])


def select_tokens(t, ranges):
    """Packed token tensors of the given (start, stop) ranges, in order."""
    idx = torch.cat([torch.arange(a, b) for a, b in ranges]) if ranges else torch.zeros(0, dtype=torch.long)
    idx = idx.to(t["q"].device)
    return {n: z.index_select(1, idx) for n, z in t.items()}, idx


# ---------------------------------------------------------------------------------------------------
# the sweep: lengths (fixed layout) and every mode (packed mixes), pools of both dtypes with inactive slots


def _sweep_cases():
    cases = []
    for T in (0, 1, 15, 16, 17, 63, 64, 65, 1000, 4097):
        for sd in (F32, BF16):
            if T <= 65:  # B = 3, row 1 inactive (-1 with an fp32 pool, N_pool with a bf16 one)
                B, HV, n_pool, slots = 3, 2, 4, [3, -1 if sd == F32 else 4, 0]
            elif T == 1000:
                B, HV, n_pool, slots = 2, 2, 3, [2, 3 if sd == F32 else -1]
            else:
                B, HV, n_pool, slots = 1, 2, 2, [1]
            c = dict(
                B=B,
                T=T,
                H=1,
                HV=HV,
                N_pool=n_pool,
                slots=slots,
                state_dtype=sd,
                gate="lower_bound",
                logit=True,
                l2=True,
                seed=len(cases),
            )
            cases.append(pytest.param(c, id=f"T{T}-{'fp32' if sd == F32 else 'bf16'}"))
    i = 0
    for gate in GATES:
        for logit in (True, False):
            for l2 in (True, False):
                for sd in (F32, BF16):
                    H, HV = [(1, 2), (2, 4), (2, 2)][i % 3]
                    c = dict(
                        lengths=PACKED_LENGTHS,
                        H=H,
                        HV=HV,
                        N_pool=PACKED_N_POOL,
                        slots=PACKED_SLOTS,
                        state_dtype=sd,
                        gate=gate,
                        logit=logit,
                        l2=l2,
                        seed=len(cases),
                    )
                    tag = f"packed-{gate}-{'logit' if logit else 'plain'}-{'l2' if l2 else 'nol2'}"
                    cases.append(pytest.param(c, id=f"{tag}-{'fp32' if sd == F32 else 'bf16'}-H{H}HV{HV}"))
                    i += 1
    return cases


@pytest.mark.parametrize("case", _sweep_cases())
def test_sweep(case):
    c = case
    seed = 1000 + c["seed"]
    if "lengths" in c:
        x = make(
            H=c["H"], HV=c["HV"], state_dtype=c["state_dtype"], N_pool=c["N_pool"], lengths=c["lengths"], seed=seed
        )
    else:
        x = make(B=c["B"], T=c["T"], H=c["H"], HV=c["HV"], state_dtype=c["state_dtype"], N_pool=c["N_pool"], seed=seed)
    t, g, m = tok(x, c["gate"], c["logit"], c["l2"]), gkw(x, c["gate"]), mode(c["logit"], c["l2"])
    pool = x["initial_state"]
    before = pool.clone()
    n_pool = pool.shape[0]
    slots = torch.tensor(c["slots"], dtype=torch.int32, device=DEV)
    cu = x.get("cu_seqlens")
    o, fs = call(t, g, **m, initial_state=pool, ssm_state_indices=slots, cu_seqlens=cu, output_final_state=True)
    assert fs is pool
    assert o.shape == x["v"].shape and o.dtype == torch.bfloat16
    active = [0 <= s < n_pool for s in c["slots"]]
    start = before[slots.long().clamp(0, n_pool - 1)]  # inactive rows: any start, their results are ignored
    r = ref(t, g, start, cu_seqlens=cu, **m)
    check_rows(o, r.output, token_mask(x, active))
    lengths = seq_lengths(x)
    written = {s: r.final_state[n] for n, s in enumerate(c["slots"]) if active[n] and lengths[n] > 0}
    check_pool(pool, before, written)


# ---------------------------------------------------------------------------------------------------
# sources, final state, checkpoints


@pytest.mark.parametrize("pool_dtype,src_dtype", [(F32, BF16), (BF16, F32)])
def test_state_source(pool_dtype, src_dtype):
    """Start states from a read-only source (never written); results into the pool slots; a source index
    out of range makes the sequence inactive (zero output, its pool slot untouched)."""
    lengths = [70, 0, 130, 5]
    x = make(H=1, HV=2, state_dtype=pool_dtype, N_pool=5, lengths=lengths, seed=31)
    t, g = tok(x, "softplus"), gkw(x, "softplus")
    pool = x["initial_state"]
    before = pool.clone()
    source = (torch.randn(6, 2, K, K, generator=torch.Generator().manual_seed(32)) * 0.1).to(src_dtype).to(DEV)
    src_before = bits(source)
    src_idx = torch.tensor([3, 0, 1, 6], dtype=torch.int32, device=DEV)  # 6 >= N0: sequence 3 inactive
    slots = torch.tensor([1, 2, 0, 3], dtype=torch.int32, device=DEV)
    o, _ = call(
        t,
        g,
        initial_state=pool,
        ssm_state_indices=slots,
        cu_seqlens=x["cu_seqlens"],
        initial_state_source=source,
        initial_state_indices=src_idx,
    )
    assert torch.equal(bits(source), src_before), "the source pool was written"
    r = ref(t, g, source[src_idx.long().clamp(0, 5)], cu_seqlens=x["cu_seqlens"])
    check_rows(o, r.output, token_mask(x, [True, True, True, False]))
    check_pool(pool, before, {1: r.final_state[0], 0: r.final_state[2]})  # slot 2: zero length; 3: inactive


def test_final_state_without_pool():
    """initial_state=None: zero start, a new fp32 [N, HV, V, K] final state (zero-length rows: zeros)."""
    lengths = [0, 100, 17, 1]
    x = make(H=2, HV=4, lengths=lengths, seed=33)
    t, g = tok(x), gkw(x)
    o, fs = call(t, g, cu_seqlens=x["cu_seqlens"], output_final_state=True)
    assert fs.dtype == torch.float32 and fs.shape == (4, 4, K, K)
    assert torch.count_nonzero(fs[0]) == 0
    r = ref(t, g, None, cu_seqlens=x["cu_seqlens"])
    assert_output(o, r.output)
    assert_close_rms(fs, r.final_state, TOL_STATE_FP32, "final_state")
    # with a read-only source and no pool the final state starts from the source
    source = (torch.randn(3, 4, K, K, generator=torch.Generator().manual_seed(34)) * 0.1).bfloat16().to(DEV)
    src_idx = torch.tensor([2, 0, 1, 2], dtype=torch.int32, device=DEV)
    o, fs = call(
        t,
        g,
        cu_seqlens=x["cu_seqlens"],
        output_final_state=True,
        initial_state_source=source,
        initial_state_indices=src_idx,
    )
    r = ref(t, g, source[src_idx.long()], cu_seqlens=x["cu_seqlens"])
    assert_output(o, r.output)
    assert_close_rms(fs, r.final_state, TOL_STATE_FP32, "final_state from source")
    assert torch.equal(bits(fs[0]), bits(source[2].float())), "a zero-length row's final state is its start"


@pytest.mark.parametrize("pool_dtype", [None, F32, BF16])
@pytest.mark.parametrize("every", [16, 64])
def test_checkpoints(pool_dtype, every):
    """Rows = the state BEFORE tokens 0, n, 2n, ... of every sequence (ceil(L/n) each), in the pool's dtype
    (fp32 without a pool), vs the reference's checkpoints."""
    lengths = [65, 131, 0, 16, 1, 200]
    x = make(H=1, HV=2, state_dtype=pool_dtype or F32, lengths=lengths, seed=35 + every)
    t, g = tok(x), gkw(x)
    pool = x["initial_state"] if pool_dtype is not None else None
    init = None if pool is None else pool.clone()
    o, fs, ck = call(
        t, g, initial_state=pool, cu_seqlens=x["cu_seqlens"], checkpoint_every_n_tokens=every, output_final_state=True
    )
    r = ref(t, g, init, cu_seqlens=x["cu_seqlens"], checkpoint_every_n_tokens=every)
    assert ck.dtype == (pool_dtype or F32)
    expected = torch.cat([c for c in r.checkpoints if c.shape[0] > 0])
    assert ck.shape[0] == expected.shape[0] == sum(math.ceil(L / every) for L in lengths)
    assert_close_rms(ck, expected, state_tol(ck.dtype), "checkpoints")
    assert_output(o, r.output)
    if pool is None:
        assert_close_rms(fs, r.final_state, TOL_STATE_FP32, "final_state")
    else:
        check_pool(pool, init, {n: r.final_state[n] for n, L in enumerate(lengths) if L > 0})


# ---------------------------------------------------------------------------------------------------
# paths that compute the same thing


@pytest.mark.parametrize("state_dtype", [F32, BF16])
@pytest.mark.parametrize("split", [48, 37])
def test_split_prefill_matches_one_call(split, state_dtype):
    """Each sequence's tokens [0, split) in one call and the rest in a second (state carried in the pool)
    == one call == the reference; the second call has zero-length rows (slots left alone)."""
    lengths = [150, 40, 1]
    x = make(H=2, HV=4, state_dtype=state_dtype, lengths=lengths, seed=37 + split)
    t, g = tok(x), gkw(x)
    cu = x["cu_seqlens"].tolist()
    before = x["initial_state"].clone()
    pool_one = before.clone()
    o_one, _ = call(t, g, initial_state=pool_one, cu_seqlens=x["cu_seqlens"])
    pool = before.clone()
    o = torch.zeros_like(o_one)
    firsts = [min(L, split) for L in lengths]
    pieces = [
        [(cu[n], cu[n] + firsts[n]) for n in range(3)],
        [(cu[n] + firsts[n], cu[n + 1]) for n in range(3)],
    ]
    for ranges in pieces:
        tp, idx = select_tokens(t, ranges)
        cu_p = lengths_to_cu([b - a for a, b in ranges], device=DEV)
        o_p, _ = call(tp, g, initial_state=pool, cu_seqlens=cu_p)
        o.index_copy_(1, idx, o_p)
    r = ref(t, g, before, cu_seqlens=x["cu_seqlens"])
    assert_output(o, r.output, "split output vs reference")
    assert_output(o, o_one, "split output vs one call")
    tol = state_tol(state_dtype)
    assert_close_rms(pool, r.final_state, tol, "split state vs reference")
    assert_close_rms(pool, pool_one, tol, "split state vs one call")


@pytest.mark.parametrize("t_last", [0, 20, 63, 130])
def test_causality(t_last):
    """Changing tokens after t_last never changes outputs <= t_last, bit for bit: the kernel's in-chunk
    reference row is the chunk's first token, so row i's operands depend on tokens <= i only (new gates
    included; the lower-bound gate never leaves the GEMM mode, whose choice looks at the whole chunk)."""
    B, T = 2, 200
    x = make(B=B, T=T, H=1, HV=2, seed=41)
    y = make(B=B, T=T, H=1, HV=2, seed=42)
    t, g = tok(x), gkw(x)
    n = t_last + 1

    def run(tt):
        pool = x["initial_state"].clone()
        o, _ = call(tt, g, initial_state=pool)
        return o

    o = run(t)
    r = ref(t, g, x["initial_state"])
    assert_output(o, r.output)
    new = {k_: z.clone() for k_, z in t.items()}
    for name in ("q", "k", "v", "beta"):
        new[name][:, n:] = y[name][:, n:]
    o2 = run(new)
    assert torch.equal(bits(o2[:, :n]), bits(o[:, :n])), "future q/k/v/beta changed the prefix"
    assert not torch.equal(bits(o2[:, n:]), bits(o[:, n:]))
    new["g"][:, n:] = y["g"][:, n:]
    o3 = run(new)
    assert torch.equal(bits(o3[:, :n]), bits(o[:, :n])), "future gates changed the prefix"
    assert_output(o3, ref(new, g, x["initial_state"]).output, "changed input vs reference")


def _extreme(case):
    """Inputs at the edges of the range: (tokens, gate kwargs, output tol, state tol)."""
    x = make(B=1, T=130, H=1, HV=2, seed=43)
    gen = torch.Generator().manual_seed(44)
    if case == "lower_bound_g30":  # a ≈ λ = -5 on every token and channel
        t = tok(x)
        t["g"] = torch.full_like(t["g"], 30.0)
        return t, gkw(x), None, None
    if case == "softplus_g40_Alog2":  # a = -e^2 * softplus(40 + dt_bias) ≈ -300 per token
        t = tok(x, "softplus")
        t["g"] = torch.full_like(t["g"], 40.0)
        g = gkw(x, "softplus")
        g["A_log"] = torch.full_like(x["A_log"], 2.0)
        return t, g, None, None
    if case == "precomputed_0_to_-300":  # per-channel log-decays anywhere in (-300, 0]
        t = tok(x, "precomputed")
        t["g"] = (-300.0 * torch.rand(t["g"].shape, generator=gen)).to(t["g"].dtype).to(DEV)
        return t, gkw(x, "precomputed"), None, None
    if case == "tiny_q_huge_k":
        t = tok(x)
        t["q"] = (t["q"].float() * 1e-4).to(t["q"].dtype)
        t["k"] = (t["k"].float() * 1e4).to(t["k"].dtype)
        return t, gkw(x), None, None
    assert case == "near_collinear_keys"
    # one key repeated plus 1e-3 noise, β logit 8, almost no decay (a ≈ -5 sigmoid(-12 e^A_log) ~ -1e-5): the
    # state is a telescoping sum of cancelling deltas. Bounds: the all-bf16-operand chunked form measured
    # 1.5e-2 / 9.9e-3 here (tests/test_reference_chunked.py::test_near_collinear_keys_high_beta).
    t = tok(x)
    base = torch.randn(1, 1, 1, K, generator=gen)
    noise = torch.randn(t["k"].shape, generator=gen) * 1e-3
    t["k"] = (base + noise).to(t["k"].dtype).to(DEV)
    t["beta"] = torch.full_like(t["beta"], 8.0)
    t["g"] = torch.full_like(t["g"], -12.0)
    return t, gkw(x), 2.5e-2, 2e-2


@pytest.mark.parametrize(
    "case", ["lower_bound_g30", "softplus_g40_Alog2", "precomputed_0_to_-300", "tiny_q_huge_k", "near_collinear_keys"]
)
def test_extreme_inputs_finite_and_accurate(case):
    t, g, tol_out, tol_state = _extreme(case)
    pool = (torch.randn(1, 2, K, K, generator=torch.Generator().manual_seed(45)) * 0.1).to(DEV)
    start = pool.clone()
    o, _, ck = call(t, g, initial_state=pool, checkpoint_every_n_tokens=64)
    assert torch.isfinite(o.float()).all() and torch.isfinite(pool).all() and torch.isfinite(ck).all()
    r = ref(t, g, start, checkpoint_every_n_tokens=64)
    if tol_out is None:
        assert_output(o, r.output)
        assert_close_rms(pool, r.final_state, TOL_STATE_FP32, "final state")
        assert_close_rms(ck, r.checkpoints[0], TOL_STATE_FP32, "checkpoints")
    else:
        assert rel_rms(o, r.output) <= tol_out, f"output: {rel_rms(o, r.output):.2e} > {tol_out}"
        assert rel_rms(pool, r.final_state) <= tol_state, f"state: {rel_rms(pool, r.final_state):.2e}"


def test_backends_agree():
    """backend="chunked" vs backend="recurrent" on a medium packed call with checkpoints."""
    lengths = [200, 37, 1, 130]
    x = make(H=2, HV=4, state_dtype=BF16, lengths=lengths, seed=46)
    t, g = tok(x, "softplus"), gkw(x, "softplus")
    res = {}
    for backend in ("chunked", "recurrent"):
        pool = x["initial_state"].clone()
        o, _, ck = call(
            t, g, backend=backend, initial_state=pool, cu_seqlens=x["cu_seqlens"], checkpoint_every_n_tokens=64
        )
        res[backend] = (o, pool, ck)
    (oc, pc, cc), (orr, pr, cr) = res["chunked"], res["recurrent"]
    assert_output(oc, orr, "chunked vs recurrent output")
    assert_close_rms(pc, pr, state_tol(BF16), "chunked vs recurrent state")
    assert_close_rms(cc, cr, state_tol(BF16), "chunked vs recurrent checkpoints")


def test_padded_slot_stride_and_strided_tokens():
    """A pool with a padded slot stride (padding and other slots untouched) and q/k that are strided views
    of a fused projection, g misaligned (the op copies it)."""
    B, T, H, HV = 2, 100, 2, 4
    x = make(B=B, T=T, H=H, HV=HV, N_pool=3, seed=47)
    inner = HV * K * K
    buf = torch.randn(3, inner + 64, generator=torch.Generator().manual_seed(48)).to(DEV)
    pool = buf[:, :inner].view(3, HV, K, K)
    pool.copy_(x["initial_state"])
    buf_before = buf.clone()
    fused = torch.cat([x["q"], x["k"]], dim=2)  # [B, T, 2H, K]: q, k are strided views
    mis = torch.empty(x["g"].numel() + 1, dtype=torch.bfloat16, device=DEV)[1:].view_as(x["g"])
    mis.copy_(x["g"])
    t = dict(q=fused[:, :, :H], k=fused[:, :, H:], v=x["v"], g=mis, beta=x["beta"])
    g = gkw(x)
    slots = torch.tensor([2, 0], dtype=torch.int32, device=DEV)
    o, _ = call(t, g, initial_state=pool, ssm_state_indices=slots)
    start = buf_before[[2, 0], :inner].view(2, HV, K, K)
    r = ref(dict(q=x["q"], k=x["k"], v=x["v"], g=x["g"], beta=x["beta"]), g, start)
    assert_output(o, r.output)
    assert_close_rms(pool[2], r.final_state[0], TOL_STATE_FP32, "slot 2")
    assert_close_rms(pool[0], r.final_state[1], TOL_STATE_FP32, "slot 0")
    assert torch.equal(bits(buf[:, inner:]), bits(buf_before[:, inner:])), "slot padding was written"
    assert torch.equal(bits(buf[1]), bits(buf_before[1])), "slot 1 was written"


# ---------------------------------------------------------------------------------------------------
# determinism, scheduling, graphs


def test_deterministic():
    lengths = [300, 3, 1, 130, 0, 64]
    x = make(H=2, HV=4, state_dtype=BF16, lengths=lengths, seed=49)
    t, g = tok(x), gkw(x)
    runs = []
    for _ in range(2):
        pool = x["initial_state"].clone()
        o, _, ck = call(t, g, initial_state=pool, cu_seqlens=x["cu_seqlens"], checkpoint_every_n_tokens=16)
        runs.append((bits(o), bits(pool), bits(ck)))
    for a, b in zip(runs[0], runs[1], strict=True):
        assert torch.equal(a, b), "two identical calls differ"


_KNOB_CHILD = """
import sys, torch
sys.path.insert(0, "tests"); sys.path.insert(0, "tests/gpu")
import test_chunked_cuda as t
gate, path = sys.argv[1], sys.argv[2]
lengths = [300, 3, 1, 130, 0, 64]
x = t.make(H=2, HV=4, state_dtype=t.BF16, lengths=lengths, seed=52)
tk, g = t.tok(x, gate), t.gkw(x, gate)
pool = x["initial_state"].clone()
o, _, ck = t.call(tk, g, initial_state=pool, cu_seqlens=x["cu_seqlens"], checkpoint_every_n_tokens=16)
torch.cuda.synchronize()
torch.save({"o": o.cpu(), "pool": pool.cpu(), "ck": ck.cpu()}, path)
"""


@cuda_only
@pytest.mark.parametrize("gate", ["lower_bound", "softplus"])
def test_pipeline_and_split_do_not_change_bits(gate, tmp_path):
    """The mma.sync kernel's routes (KDA_CHUNKED_KERNEL=mma128 / mma64: value rows per CTA; mma_small: the shallow
    pipeline that GPUs with ~100 KB of shared memory per block get, sm_120) change how the work is spread, never
    the arithmetic: bit-identical outputs, pool and checkpoints. Each runs in its own child process (the
    switches are read at import)."""
    import subprocess
    import sys

    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    runs = {}
    for name, env in (
        ("vb128", {"KDA_CHUNKED_KERNEL": "mma128"}),
        ("vb64", {"KDA_CHUNKED_KERNEL": "mma64"}),
        ("small", {"KDA_CHUNKED_KERNEL": "mma_small"}),
    ):
        path = str(tmp_path / f"{name}.pt")
        child_env = {k_: v_ for k_, v_ in os.environ.items() if not k_.startswith("KDA_CHUNKED_")}
        child_env.update(env)
        r = subprocess.run(
            [sys.executable, "-c", _KNOB_CHILD, gate, path],
            capture_output=True,
            text=True,
            timeout=300,
            cwd=root,
            env=child_env,
        )
        assert r.returncode == 0, f"{name}: {r.stderr[-4000:]}"
        d = torch.load(path)
        runs[name] = (bits(d["o"]), bits(d["pool"]), bits(d["ck"]))
    lengths = [300, 3, 1, 130, 0, 64]
    x = make(H=2, HV=4, state_dtype=BF16, lengths=lengths, seed=52)
    t, g = tok(x, gate), gkw(x, gate)
    r = ref(t, g, x["initial_state"][: len(lengths)].float(), cu_seqlens=x["cu_seqlens"])
    assert_output(d["o"].to(DEV), r.output)
    for name in ("vb64", "small"):
        for a, b in zip(runs["vb128"], runs[name], strict=True):
            assert torch.equal(a, b), f"{name} differs from vb128"


def test_seq_order_does_not_change_bits():
    x = make(H=2, HV=4, N_pool=PACKED_N_POOL, lengths=PACKED_LENGTHS, seed=50)
    t, g = tok(x), gkw(x)
    slots = torch.tensor(PACKED_SLOTS, dtype=torch.int32, device=DEV)
    N = len(PACKED_LENGTHS)
    orders = [None, torch.arange(N - 1, -1, -1), torch.randperm(N, generator=torch.Generator().manual_seed(51))]
    runs = []
    for order in orders:
        pool = x["initial_state"].clone()
        so = None if order is None else order.to(torch.int32).to(DEV)
        o, _ = call(t, g, initial_state=pool, ssm_state_indices=slots, cu_seqlens=x["cu_seqlens"], seq_order=so)
        runs.append((o, pool))
    for o, pool in runs[1:]:
        assert torch.equal(bits(o), bits(runs[0][0])), "seq_order changed the output"
        assert torch.equal(bits(pool), bits(runs[0][1])), "seq_order changed the pool"
    n_pool = x["initial_state"].shape[0]
    r = ref(t, g, x["initial_state"][slots.long().clamp(0, n_pool - 1)], cu_seqlens=x["cu_seqlens"])
    check_rows(runs[0][0], r.output, token_mask(x, [0 <= s < n_pool for s in PACKED_SLOTS]))


def _ck_starts(lengths, every):
    return lengths_to_cu([math.ceil(L / every) for L in lengths], device=DEV)


@cuda_only
@pytest.mark.parametrize("with_checkpoints", [False, True])
def test_cuda_graph_packed_prefill(with_checkpoints):
    """Eager warm-up with a workspace, an output buffer and int64 cu_seqlens, then capture; replays with new
    boundaries (same N, T), new slots (one inactive) and new tokens give the bits of eager calls, and the
    last replay matches the reference."""
    lengths, every, n_pool = [10, 130, 1, 60], 16, 6
    N, T = len(lengths), sum(lengths)
    x = make(H=2, HV=4, state_dtype=BF16, N_pool=n_pool, lengths=lengths, seed=52)
    static = {n: x[n] for n in ("q", "k", "v", "g", "beta", "A_log", "dt_bias")}
    static.update(
        pool=x["initial_state"],
        cu=x["cu_seqlens"],
        idx=torch.tensor([5, 0, 1, 2], dtype=torch.int32, device=DEV),
        out=torch.zeros_like(x["v"]),
        ws=kda_ops.RecurrentKDAPrefillWorkspace(),
    )
    if with_checkpoints:
        static.update(ck=torch.zeros(T // every + N, 4, K, K, dtype=BF16, device=DEV), cks=_ck_starts(lengths, every))

    def run(d):
        kw = {}
        if with_checkpoints:
            kw = dict(state_checkpoints=d["ck"], checkpoint_cu_starts=d["cks"], checkpoint_every_n_tokens=every)
        kda_ops.recurrent_kda(
            d["q"],
            d["k"],
            d["v"],
            d["g"],
            d["beta"],
            A_log=d["A_log"],
            dt_bias=d["dt_bias"],
            initial_state=d["pool"],
            ssm_state_indices=d["idx"],
            cu_seqlens=d["cu"],
            use_gate_in_kernel=True,
            lower_bound=-5.0,
            beta_is_logit=True,
            output=d["out"],
            prefill_workspace=d["ws"],
            backend="chunked",
            **kw,
        )

    fresh = []
    for i, (L, idx) in enumerate(
        ([[201, 0, 0, 0], [5, 0, 1, 2]], [[64, 64, 64, 9], [3, -1, 0, 4]], [[1, 100, 0, 100], [2, 4, 5, 1]])
    ):
        y = make(H=2, HV=4, state_dtype=BF16, N_pool=n_pool, lengths=L, seed=60 + i)
        f = {n: y[n] for n in ("q", "k", "v", "g", "beta")} if i else {}
        f.update(cu=y["cu_seqlens"], idx=torch.tensor(idx, dtype=torch.int32, device=DEV))
        if with_checkpoints:
            f["cks"] = _ck_starts(L, every)
        fresh.append(f)

    outs = ("out", "pool", "ck") if with_checkpoints else ("out", "pool")
    graph = capture_graph(lambda: run(static))  # the eager call plans the workspace for these shapes
    for vals in fresh:
        for n, v in vals.items():
            static[n].copy_(v)
        pool0 = static["pool"].clone()
        static["out"].fill_(float("nan"))  # sentinels: each run must write every token itself
        if with_checkpoints:
            static["ck"].fill_(7.0)
        eager = {n: (z.clone() if isinstance(z, torch.Tensor) else z) for n, z in static.items()}
        graph.replay()
        torch.cuda.synchronize()
        run(eager)
        assert not torch.isnan(static["out"].float()).any(), "a replay left tokens unwritten (inactive: zeros)"
        for n in outs:
            assert torch.equal(bits(static[n]), bits(eager[n])), f"graph replay {n} differs from eager"
    # the last replay against the reference (all slots active)
    L, cu = [1, 100, 0, 100], static["cu"]
    t = {n: static[n] for n in ("q", "k", "v", "g", "beta")}
    r = ref(
        t,
        dict(A_log=static["A_log"], dt_bias=static["dt_bias"], use_gate_in_kernel=True, lower_bound=-5.0),
        pool0[static["idx"].long()],
        cu_seqlens=cu,
        checkpoint_every_n_tokens=every if with_checkpoints else 0,
    )
    assert_output(static["out"], r.output)
    check_pool(static["pool"], pool0, {int(s): r.final_state[n] for n, s in enumerate([2, 4, 5, 1]) if L[n] > 0})
    if with_checkpoints:
        exp = torch.cat([c for c in r.checkpoints if c.shape[0] > 0])
        assert_close_rms(static["ck"][: exp.shape[0]], exp, state_tol(BF16), "checkpoints")


if __name__ == "__main__":  # pragma: no cover
    raise SystemExit(pytest.main([os.path.abspath(__file__), "-q"]))
