"""GPU tier: the Hopper (sm_90a) chunked prefill kernel, selected with KDA_CHUNKED_KERNEL=sm90.

Every test of this module runs with the variable set, so ``backend="chunked"`` takes the Hopper kernel for
the cases it covers (prefill with TMA-aligned bf16 tokens, K = V = 128: pools, start-state sources,
checkpoints, the training forward's tapes, state-only calls) and the mma.sync kernel for the rest.
Checked here:
  * that the Hopper kernel really runs (its name in the profiler's kernel list; and for every covered call of
    every test here, its launch line on stderr) and that an uncovered case falls back;
  * the shared sweep and feature tests of tests/gpu/test_chunked_cuda.py, re-run on this path (fp64
    reference, tolerances of tests/conftest.py);
  * Hopper vs mma.sync over lengths, packed mixes with zero-length and 1-token rows, GQA, gate and β modes,
    L2 norm on/off, bf16/fp32 pools with inactive slots: both against the fp64 reference;
  * bit-identical reruns, and (in an experiments build) the same bits over the designs and the prep schedules
    (KDA_EXPERIMENT=sm90_variant=2|3,sm90_schedule=0..15).
Skipped unless the device is compute capability 9.0.
"""

from __future__ import annotations

import pytest
import test_chunked_cuda as base
import torch
from conftest import (
    GATES,
    TOL_STATE_FP32,
    assert_close_rms,
    assert_output,
    bits,
    check_pool,
    route_env,
    state_only_matches,
    state_tol,
)
from test_chunked_cuda import (  # noqa: F401  (collected again here, on the Hopper path)
    test_backends_agree,
    test_causality,
    test_checkpoints,
    test_cuda_graph_packed_prefill,
    test_deterministic,
    test_extreme_inputs_finite_and_accurate,
    test_final_state_without_pool,
    test_padded_slot_stride_and_strided_tokens,
    test_split_prefill_matches_one_call,
    test_state_source,
    test_sweep,
)
from test_training_cuda import (  # noqa: F401  (the training forward and the backward chain on the Hopper path)
    test_backward_chain_and_tape_rows,
    test_backward_chain_wide_grid,
    test_training_ops_vs_reference,
)

import kda_ops
from kda_ops import _routing

is_sm90 = torch.cuda.is_available() and torch.cuda.get_device_capability() == (9, 0)
pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(base.DEV != "cuda" or not is_sm90, reason="needs an sm_90 GPU"),
]
K, F32, BF16 = base.K, base.F32, base.BF16


def _tma_ok(z: torch.Tensor) -> bool:
    """A token tensor [B, T, heads, 128] the Hopper kernel's TMA maps take (chunked_sm90_supported)."""
    st = z.stride()
    return (
        z.dtype == torch.bfloat16
        and z.data_ptr() % 16 == 0
        and st[3] == 1
        and st[1] % 8 == 0
        and st[2] % 8 == 0
        and (z.shape[0] == 1 or st[0] % 8 == 0)
    )


def hopper_covers(kw) -> bool:
    """Whether a public call is one the Hopper kernel must run (mirror of chunked_sm90_supported)."""
    q = kw["q"]
    if kw.get("backend", "chunked") != "chunked" or q.device.type != "cuda" or q.shape[1] == 0:
        return False
    if q.shape[-1] != K or kw["v"].shape[-1] != K:
        return False
    if (kw.get("checkpoint_every_n_tokens") or 0) % 16 != 0:
        return False
    if kw.get("num_spec_tokens") or kw.get("num_accepted_tokens") is not None:
        return False
    return all(_tma_ok(kw[n]) for n in ("q", "k", "v", "g"))


LAUNCH_LINE = "kernel=chunked_sm90 "  # (the route line of KDA_VERBOSE=1, csrc/kda/route/route_cuda.cu)


@pytest.fixture(autouse=True)
def _hopper_kernel(monkeypatch, capfd):
    """Every test here runs with KDA_CHUNKED_KERNEL=sm90, and every call the Hopper kernel covers must launch
    it (the spine prints each call's route with KDA_VERBOSE=1): a silent fallback to the mma.sync kernel
    fails the test instead of passing on the other kernel."""
    route_env(monkeypatch, KDA_CHUNKED_KERNEL="sm90", KDA_VERBOSE="1")
    real_call = base.call

    def checked_call(t, g, backend="chunked", **kw):
        args = dict(t, **g, backend=backend, **kw)
        want = _routing.knobs()["chunked"] == "sm90" and hopper_covers(args)
        capfd.readouterr()
        res = real_call(t, g, backend=backend, **kw)
        err = capfd.readouterr().err
        launched = err.count(LAUNCH_LINE)
        if want:
            assert launched >= 1, f"the Hopper kernel did not run for a covered call (stderr: {err[-400:]!r})"
        return res

    monkeypatch.setattr(base, "call", checked_call)


def kernel_names(fn) -> list[str]:
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        fn()
        torch.cuda.synchronize()
    return [e.name for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA]


def test_hopper_kernel_runs_and_falls_back(monkeypatch):
    x = base.make(H=1, HV=2, lengths=[40, 3], seed=5)
    t, g = base.tok(x), base.gkw(x)
    names = kernel_names(lambda: base.call(t, g, cu_seqlens=x["cu_seqlens"]))
    assert any("kda_chunked_sm90" in n for n in names), names
    pool = x["initial_state"].clone()
    names = kernel_names(
        lambda: base.call(t, g, initial_state=pool, cu_seqlens=x["cu_seqlens"], checkpoint_every_n_tokens=16)
    )
    assert any("kda_chunked_sm90" in n for n in names), names
    # a grid that fills few SMs: KDA_CHUNKED_KERNEL=auto runs the Hopper kernel there too, mma the mma.sync kernel
    for kernel, hopper in (("auto", True), ("mma", False)):
        route_env(monkeypatch, KDA_CHUNKED_KERNEL=kernel)
        try:
            names = kernel_names(lambda: base.call(t, g, cu_seqlens=x["cu_seqlens"]))
        finally:
            route_env(monkeypatch, KDA_CHUNKED_KERNEL="sm90")
        assert any("kda_chunked_sm90" in n for n in names) == hopper, (kernel, names)
        assert any("kda_chunked_kernel" in n for n in names) != hopper, (kernel, names)


def test_auto_routes_by_grid(monkeypatch):
    """KDA_CHUNKED_KERNEL=auto: the forward on the Hopper kernel on any grid, N·HV > SMs / 2 or not (the mma.sync
    kernel would take two CTAs per head on the small one)."""
    route_env(monkeypatch, KDA_CHUNKED_KERNEL="auto")
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    for n, want in ((sms // 2 + 1, True), (2, True)):
        x = base.make(H=1, HV=1, lengths=[20] * n, seed=7)
        t, g = base.tok(x), base.gkw(x)
        names = kernel_names(lambda t=t, g=g, x=x: base.call(t, g, cu_seqlens=x["cu_seqlens"]))
        assert any("kda_chunked_sm90" in nm for nm in names) == want, (n, sorted(set(names)))


def _training_forward(x, kernel, monkeypatch):
    """(output, final state, tapes) of the training forward on `kernel`, and whether the Hopper kernel ran."""
    route_env(monkeypatch, KDA_CHUNKED_KERNEL=kernel)
    t, g = base.tok(x), base.gkw(x)
    cu = x.get("cu_seqlens")
    N = x["q"].shape[0] if cu is None else cu.numel() - 1
    gen = torch.Generator(device="cuda").manual_seed(3)
    h0 = torch.randn(N, x["v"].shape[2], K, K, device="cuda", generator=gen) * 0.1
    res = []

    def one():
        res.append(
            kda_ops.recurrent_kda_training_forward(
                t["q"],
                t["k"],
                t["v"],
                t["g"],
                t["beta"],
                g["A_log"],
                g["dt_bias"],
                h0,
                cu_seqlens=cu,
                cu_seqlens_cpu=None if cu is None else cu.cpu(),
                lower_bound=g["lower_bound"],
            )
        )

    ran = any("kda_chunked_sm90" in n for n in kernel_names(one))
    o, fs, ctx = res[0]
    return o, fs, ctx.tapes, ran


@pytest.mark.parametrize("lengths", [[300, 1, 130, 64, 65, 0], None], ids=["packed", "fixed"])
def test_hopper_training_forward_tapes(lengths, monkeypatch):
    """The training forward (tapes = checkpoints every 64 tokens after the first) on the Hopper kernel vs the
    mma.sync kernel: output, final state and tapes."""
    if lengths is None:
        x = base.make(B=2, T=200, H=2, HV=4, seed=91)
    else:
        x = base.make(H=2, HV=4, lengths=lengths, seed=91)
    o9, f9, tp9, ran9 = _training_forward(x, "sm90", monkeypatch)
    om, fm, tpm, ranm = _training_forward(x, "mma", monkeypatch)
    assert ran9 and not ranm
    assert tp9.shape == tpm.shape and tp9.shape[0] > 0
    assert_output(o9, om, "sm90 vs mma training output")
    assert_close_rms(f9, fm, TOL_STATE_FP32, "sm90 vs mma final state")
    assert_close_rms(tp9, tpm, TOL_STATE_FP32, "sm90 vs mma tapes")


def _training_case(seed):
    """A packed training case (mixed lengths, an empty row, GQA 2) on the GPU: the token arguments of the
    training ops, the forward's (initial_state, cu_seqlens, scale, λ) and the backward's trailing arguments."""
    import test_training_cuda as tr

    c = tr._cuda(tr._case_inputs(1, 0, 2, 4, [300, 0, 65, 1, 130], False, seed=seed, with_dfinal=True))
    sc = 1.0 / K**0.5
    args = (c["q"], c["k"], c["v"], c["g"], c["beta"], c["A_log"], c["dt_bias"])
    fwd_rest = (c["initial_state"], c["cu_seqlens"], sc, -5.0)
    bwd_rest = (c["initial_state"], c["cu_seqlens"], c["do"], c["dfinal_state"], sc, -5.0)
    return args, fwd_rest, bwd_rest


def test_hopper_backward_chain_runs(monkeypatch):
    """The training backward's chain (dS last chunk first) takes the Hopper kernel's backward mode, and the
    gradients equal those of the mma.sync chain within the training tolerance (the same math and operand
    precisions; tests/gpu/test_training_cuda.py's chain tests, re-run here, check them against fp64)."""
    import test_training_cuda as tr

    args, fwd_rest, rest = _training_case(seed=11)
    grads = {}
    for kernel in ("sm90", "mma"):
        route_env(monkeypatch, KDA_CHUNKED_KERNEL=kernel)
        fwd = torch.ops.kda.recurrent_kda_training_forward(*args, *fwd_rest)
        tapes, tcs = fwd[2], fwd[3]
        out = []

        def bwd(tapes=tapes, tcs=tcs, out=out):
            out.append(torch.ops.kda.recurrent_kda_training_backward(*args, tapes, tcs, *rest))

        ran = any("kda_chunked_sm90" in n for n in kernel_names(bwd))
        assert ran == (kernel == "sm90"), kernel
        grads[kernel] = out[0]
    for name, a, b in zip(tr.GRADS, grads["sm90"], grads["mma"], strict=True):
        assert_close_rms(a.float(), b.float(), tr.TOL_GRAD, f"sm90 vs mma {name}")


def test_hopper_state_only_call():
    """A state-only call (1-D empty output) on the Hopper kernel: pool and final states equal, bit for bit,
    those of the same call with an output."""
    names = kernel_names(lambda: state_only_matches("cuda", K=K, dtype=BF16, backend=1))
    assert any("kda_chunked_sm90" in n for n in names), sorted(set(names))


@pytest.mark.parametrize(
    "variant",
    [
        "3",
        pytest.param(
            "4",
            marks=pytest.mark.skipif(
                not _routing.knobs()["experiments_built"], reason="design 4: a KDA_BUILD_EXPERIMENTS=1 build"
            ),
        ),
    ],
)
@pytest.mark.parametrize(
    "gate_mode,span,beta_is_logit,l2,HV",
    [(2, "narrow", True, True, 2), (1, "narrow", False, True, 4), (0, "narrow", True, False, 2),
     (0, "wide", True, True, 2), (0, "wide", False, False, 4), (2, "narrow", True, True, 1)],
)  # fmt: skip
def test_hopper_state_only_instantiation(gate_mode, span, beta_is_logit, l2, HV, variant, capfd, monkeypatch):
    """The state-only instantiation (no q, Q⁺, Mqk or output product) of designs 3 and 4 in every gate and β mode,
    L2 on/off, GQA, and with in-chunk decay spans wide enough for the pairwise path: pool and final states equal,
    bit for bit, those of the same call with an output of the same design (which the other tests check against the
    fp64 reference), and the launch line names the state-only instantiation."""
    from _raw_ops import raw_recurrent

    if variant != "3":
        route_env(monkeypatch, KDA_CHUNKED_KERNEL="sm90", KDA_VERBOSE="1", KDA_EXPERIMENT=f"sm90_variant={variant}")

    gen = torch.Generator().manual_seed(11 + gate_mode)
    lens = (70, 0, 33, 129, 16, 1)
    T, H, N = sum(lens), 1 if HV == 1 else HV // 2, len(lens)

    def rnd(*shape: int, s: float = 1.0) -> torch.Tensor:
        return (torch.randn(*shape, generator=gen) * s).to(BF16).cuda()

    q, k, v = rnd(1, T, H, K), rnd(1, T, H, K), rnd(1, T, HV, K)
    beta = rnd(1, T, HV) if beta_is_logit else torch.rand(1, T, HV, generator=gen).to(BF16).cuda()
    if not l2:  # unnormalised keys of norm ~1, so that the plain recurrence stays bounded
        q, k = q / K**0.5, k / K**0.5
    if gate_mode == 0:
        scale = 0.2 if span == "narrow" else 12.0  # wide: |Γ| over 16 tokens past the factorised form's limit
        g = (-torch.nn.functional.softplus(torch.randn(1, T, HV, K, generator=gen)) * scale).to(BF16).cuda()
    else:
        g = rnd(1, T, HV, K)
    gate = {}
    if gate_mode != 0:
        A_log = (torch.rand(HV, generator=gen) * 2 - 3).cuda()
        gate = dict(A_log=A_log, dt_bias=(torch.randn(HV * K, generator=gen) * 0.1).cuda())
    cu = torch.tensor([0, *torch.tensor(lens).cumsum(0).tolist()], dtype=torch.int32, device="cuda")
    pool = (torch.randn(N + 2, HV, K, K, generator=gen) * 0.3).cuda()
    slots = torch.tensor([3, 0, -1, 1, 5, 4], dtype=torch.int32, device="cuda")
    kw = dict(cu_seqlens=cu, gate_mode=gate_mode, backend=1, use_qk_l2norm=l2, beta_is_logit=beta_is_logit, **gate)
    pa, pb = pool.clone(), pool.clone()
    raw_recurrent(q, k, v, g, beta, state=pa, ssm_state_indices=slots, output=torch.empty_like(v), **kw)
    capfd.readouterr()
    raw_recurrent(q, k, v, g, beta, state=pb, ssm_state_indices=slots, output=v.new_empty(0), **kw)
    torch.cuda.synchronize()
    err = capfd.readouterr().err
    assert f"kernel=chunked_sm90 variant={variant} state_only" in err, err[-400:]
    assert torch.equal(bits(pa), bits(pb))
    assert all(torch.equal(pb[i], pool[i]) for i in (2, 6, 7))  # slots no sequence writes
    fa = torch.zeros(N, HV, K, K, device="cuda")
    fb = torch.zeros(N, HV, K, K, device="cuda")
    raw_recurrent(q, k, v, g, beta, final_state=fa, output=torch.empty_like(v), **kw)
    raw_recurrent(q, k, v, g, beta, final_state=fb, output=v.new_empty(0), **kw)
    assert torch.equal(bits(fa), bits(fb)) and fa.isfinite().all() and fa.abs().sum() > 0


def _run(t, g, m, kernel, monkeypatch, **kw):
    route_env(monkeypatch, KDA_CHUNKED_KERNEL=kernel)
    return base.call(t, g, **m, **kw)


def _cases():
    cases = []
    for T in (1, 15, 16, 17, 64, 65, 1000, 4096):
        cases.append(
            pytest.param(
                dict(T=T, B=2 if T <= 1000 else 1, H=1, HV=2, gate="lower_bound", logit=True, l2=True, sd=F32),
                id=f"T{T}",
            )
        )
    i = 0
    for gate in GATES:
        for logit in (True, False):
            for l2 in (True, False):
                H, HV = [(1, 2), (2, 2), (1, 1)][i % 3]
                sd = (F32, BF16)[i % 2]
                cases.append(
                    pytest.param(
                        dict(
                            lengths=[0, 1, 300, 16, 0, 77, 1, 40, 1], H=H, HV=HV, gate=gate, logit=logit, l2=l2, sd=sd
                        ),
                        id=f"packed-{gate}-{'logit' if logit else 'plain'}-" f"{'l2' if l2 else 'nol2'}-H{H}HV{HV}",
                    )
                )
                i += 1
    return cases


def _case_call(c, seed):
    """The inputs of a _cases() case: (tokens, gate kwargs, mode kwargs, cu_seqlens, slot indices, the pool)."""
    if "lengths" in c:
        n = len(c["lengths"])
        x = base.make(H=c["H"], HV=c["HV"], state_dtype=c["sd"], N_pool=n + 1, lengths=c["lengths"], seed=seed)
        slots = list(range(n))
        slots[-2] = n + 1  # inactive (outside the pool)
    else:
        n = c["B"]
        x = base.make(B=n, T=c["T"], H=c["H"], HV=c["HV"], state_dtype=c["sd"], N_pool=n + 1, seed=seed + 1)
        slots = list(range(1, n + 1))
    t, g, m = base.tok(x, c["gate"], c["logit"], c["l2"]), base.gkw(x, c["gate"]), base.mode(c["logit"], c["l2"])
    idx = torch.tensor(slots, dtype=torch.int32, device="cuda")
    return x, t, g, m, x.get("cu_seqlens"), slots, idx


def _check_against_reference(c, x, t, g, m, cu, slots, idx, before, res, pair):
    """Every result of res ({name: (output, pool)}) against the fp64 reference, then res[pair[0]] beside
    res[pair[1]]; returns nothing, asserts."""
    n_pool = before.shape[0]
    active = [0 <= s < n_pool for s in slots]
    start = before[idx.long().clamp(0, n_pool - 1)]
    r = base.ref(t, g, start, cu_seqlens=cu, **m)
    lengths = base.seq_lengths(x)
    written = {s: r.final_state[k] for k, s in enumerate(slots) if active[k] and lengths[k] > 0}
    mask = base.token_mask(x, active)
    for name, (o, pool) in res.items():
        base.check_rows(o, r.output, mask)
        check_pool(pool, before, written, what=f"{name} pool")
    (oa, pa), (ob, pb) = res[pair[0]], res[pair[1]]
    assert_output(oa.cpu()[mask], ob.cpu()[mask], f"{pair[0]} vs {pair[1]} output")
    assert_close_rms(pa, pb, state_tol(c["sd"]), f"{pair[0]} vs {pair[1]} pool")


@pytest.mark.parametrize("c", _cases())
def test_hopper_vs_mma_vs_reference(c, monkeypatch):
    x, t, g, m, cu, slots, idx = _case_call(c, seed=77)
    before = x["initial_state"].clone()
    res = {}
    for kernel in ("sm90", "mma"):
        pool = before.clone()
        out = []

        def one(kernel=kernel, pool=pool, out=out):
            out.append(_run(t, g, m, kernel, monkeypatch, initial_state=pool, ssm_state_indices=idx, cu_seqlens=cu)[0])

        names = kernel_names(one)
        res[kernel] = (out[0], pool)
        ran = any("kda_chunked_sm90" in nm for nm in names)
        assert ran == (kernel == "sm90"), (kernel, sorted(set(names)))
    _check_against_reference(c, x, t, g, m, cu, slots, idx, before, res, ("sm90", "mma"))


def test_hopper_final_state_fp32_no_pool(monkeypatch):
    x = base.make(H=2, HV=4, lengths=[0, 100, 17, 1, 33], seed=81)
    t, g = base.tok(x, "softplus"), base.gkw(x, "softplus")
    o, fs = base.call(t, g, cu_seqlens=x["cu_seqlens"], output_final_state=True)
    r = base.ref(t, g, None, cu_seqlens=x["cu_seqlens"])
    assert_output(o, r.output)
    assert_close_rms(fs, r.final_state, TOL_STATE_FP32, "final_state")
    assert torch.count_nonzero(fs[0]) == 0


def test_hopper_deterministic():
    x = base.make(H=2, HV=4, state_dtype=BF16, lengths=[300, 3, 1, 130, 0, 64, 2048], seed=49)
    t, g = base.tok(x), base.gkw(x)
    runs = []
    for _ in range(3):
        pool = x["initial_state"].clone()
        o, _ = base.call(t, g, initial_state=pool, cu_seqlens=x["cu_seqlens"])
        runs.append((bits(o), bits(pool)))
    for later in runs[1:]:
        for a, b in zip(runs[0], later, strict=True):
            assert torch.equal(a, b), "identical calls differ"


@pytest.mark.skipif(not _routing.knobs()["experiments_built"], reason="needs a KDA_BUILD_EXPERIMENTS=1 build")
def test_hopper_schedules_same_bits(monkeypatch):
    """The schedule bits (the prep warpgroups' role rotation, the inverse's vector loads, the chain's per-warp
    output staging) and designs 2, 3 and 5 change the schedule only: the prefill's output and pool, and the backward
    chain's gradients, are the same bits in every setting (experiments: KDA_EXPERIMENT=sm90_variant,sm90_schedule)."""
    x = base.make(H=2, HV=4, state_dtype=BF16, lengths=[300, 3, 1, 130, 0, 64, 1030], seed=53)
    t, g = base.tok(x), base.gkw(x)
    args, fwd_rest, rest = _training_case(seed=13)
    results = {}
    runs = [(v, sc) for v in ("2", "3") for sc in ("0", "1", "2", "3", "4", "7", "8", "11", "15")]
    for variant, schedule in runs + [("5", "0"), ("5", "11")]:  # (design 5: the CTA pair, the same prep and rows)
        route_env(monkeypatch, KDA_EXPERIMENT=f"sm90_variant={variant},sm90_schedule={schedule}")
        pool = x["initial_state"].clone()
        o, _ = base.call(t, g, initial_state=pool, cu_seqlens=x["cu_seqlens"])
        fwd = torch.ops.kda.recurrent_kda_training_forward(*args, *fwd_rest)
        grads = torch.ops.kda.recurrent_kda_training_backward(*args, fwd[2], fwd[3], *rest)
        results[(variant, schedule)] = [bits(o), bits(pool), bits(fwd[2])] + [bits(gr) for gr in grads]
    first = results[("2", "0")]
    for key, res in results.items():
        for i, (a, b) in enumerate(zip(first, res, strict=True)):
            assert torch.equal(a, b), f"variant {key[0]} schedule {key[1]}: result {i} differs from v2 schedule 0"


@pytest.mark.skipif(not _routing.knobs()["experiments_built"], reason="needs a KDA_BUILD_EXPERIMENTS=1 build")
@pytest.mark.parametrize("variant", ["4", "5", "6", "7", "8"])
@pytest.mark.parametrize("c", _cases())
def test_experimental_variant_vs_reference(c, variant, monkeypatch):
    """The experimental designs against the fp64 reference and beside design 3: 4 (the WY inverse folded into the
    chain's operands: −W' = −INVb K⁺ and V' = INVb V made by prep), 5 (a cluster of two CTAs per head sharing prep,
    each with half the value rows), 6 (5 with 4's operands), 7 (5 with three prep warpgroups per CTA), 8 (5 with
    O_intra in an accumulator of its own), on the lengths, packed mixes, gate / β / L2 modes and pools of the
    Hopper-vs-mma cases: output and pool within the tolerances, the launch line naming the design. Designs 5 and 7 do
    design 3's operations per chunk and value row: the same bits."""
    x, t, g, m, cu, slots, idx = _case_call(c, seed=79)
    before = x["initial_state"].clone()
    res = {}
    for v in ("3", variant):
        route_env(monkeypatch, KDA_CHUNKED_KERNEL="sm90", KDA_VERBOSE="1", KDA_EXPERIMENT=f"sm90_variant={v}")
        pool = before.clone()
        # (the module's fixture checks each covered call's launch line)
        o = base.call(t, g, **m, initial_state=pool, ssm_state_indices=idx, cu_seqlens=cu)[0]
        res[f"variant {v}"] = (o, pool)
    _check_against_reference(c, x, t, g, m, cu, slots, idx, before, res, (f"variant {variant}", "variant 3"))
    if variant in ("5", "7"):
        for a, b in zip(res[f"variant {variant}"], res["variant 3"], strict=True):
            assert torch.equal(bits(a), bits(b)), f"design {variant} differs from design 3"


@pytest.mark.skipif(not _routing.knobs()["experiments_built"], reason="needs a KDA_BUILD_EXPERIMENTS=1 build")
@pytest.mark.parametrize("variant", ["4", "5", "6"])
def test_experimental_variant_long_and_checkpoints(variant, monkeypatch):
    """Designs 4-8 over long sequences (the rings' phases wrap many times) against the fp64 reference."""
    route_env(monkeypatch, KDA_CHUNKED_KERNEL="sm90", KDA_EXPERIMENT=f"sm90_variant={variant}")
    x = base.make(H=2, HV=4, state_dtype=F32, lengths=[2000, 77, 4096], seed=82)
    t, g = base.tok(x), base.gkw(x)
    pool = x["initial_state"].clone()
    o, _ = base.call(t, g, initial_state=pool, cu_seqlens=x["cu_seqlens"])
    r = base.ref(t, g, x["initial_state"], cu_seqlens=x["cu_seqlens"])
    assert_output(o, r.output)
    assert_close_rms(pool, r.final_state, TOL_STATE_FP32, f"variant {variant} pool")
