"""GPU tier: the CUDA token-serial recurrent_kda kernel (csrc/kda/decode, backend "recurrent"/"auto")
against kda_ops.reference in fp64 on the same bf16-rounded inputs.

Tolerances (docs/contract.md, "Tolerances"; justified in tests/conftest.py): outputs 5e-3 relative RMS and
2e-2 max abs; fp32 states 1e-3, bf16 states 1e-2; fp32-state decode over 4096 steps 1e-4; a speculative step
against the same tokens as single-token decodes 1e-6 (fp32 state: the same fp32 arithmetic in the same order,
so in practice bit-identical). Untouched slots, padding and read-only sources are compared bit for bit.
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
    has_cpu_op,
    inputs,
    lengths_to_cu,
    load_golden,
    state_tol,
)

import kda_ops
from kda_ops import _routing
from kda_ops.reference import recurrent_kda_reference, rel_rms

# KDA_RECURRENT_TEST_DEVICE=cpu runs the device-neutral tests of this file on the CPU op: a check of the
# harness itself (reference calls, slot bookkeeping) that needs no GPU.
DEV = os.environ.get("KDA_RECURRENT_TEST_DEVICE", "cuda")
pytestmark = [pytest.mark.gpu] if DEV == "cuda" else []
cuda_only = pytest.mark.skipif(DEV != "cuda" or not torch.cuda.is_available(), reason="CUDA-specific")


# ---------------------------------------------------------------------------------------------------
# helpers


def make(B=2, T=1, H=1, HV=2, K=128, state_dtype=torch.float32, N_pool=None, lengths=None, seed=0):
    cu = None
    if lengths is not None:
        cu = lengths_to_cu(lengths).tolist()
    x = inputs(
        B=B, T=T, H=H, HV=HV, K=K, V=K, state_dtype=state_dtype, N_pool=N_pool, cu_seqlens=cu, device=DEV, seed=seed
    )
    return x


def tok(x, gate="lower_bound", logit=True, l2=True):
    g = x["g"]
    if gate == "precomputed":  # a log-decay <= 0
        g = -torch.nn.functional.softplus(g.float()).to(g.dtype)
    q, k = x["q"], x["k"]
    if not l2:  # un-normalised keys: keep |k|^2 * beta small so the delta rule stays contractive
        q, k = (q.float() * 0.1).bfloat16(), (k.float() * 0.1).bfloat16()
    return dict(q=q, k=k, v=x["v"], g=g, beta=x["beta"] if logit else x["beta_prob"])


gkw = gate_kwargs  # (tests/conftest.py)


def ref(t, g, initial_state=None, cu_seqlens=None, l2=True, logit=True, **kw):
    """fp64 reference; initial_state is per sequence [N, HV, V, K] (None = zeros). Short inputs run on CPU
    copies; long ones (>= 512 tokens) on the device, where the token loop's small ops are cheaper."""
    on_device = t["q"].shape[1] >= 512
    c = lambda z: (z if on_device else z.cpu()) if isinstance(z, torch.Tensor) else z  # noqa: E731
    return recurrent_kda_reference(
        **{n: c(z) for n, z in t.items()},
        **{n: c(z) for n, z in g.items()},
        initial_state=c(initial_state),
        cu_seqlens=c(cu_seqlens),
        use_qk_l2norm_in_kernel=l2,
        beta_is_logit=logit,
        **kw,
    )


def call(t, g, backend="recurrent", **kw):
    """The public API on CUDA; beta is a logit unless said otherwise (as in ref)."""
    kw.setdefault("beta_is_logit", True)
    return kda_ops.recurrent_kda(**t, **g, backend=backend, **kw)


# ---------------------------------------------------------------------------------------------------
# every feature combination, pool + GQA + permuted slots


@pytest.mark.parametrize("K", [64, 128])
@pytest.mark.parametrize("state_dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("gate", list(GATES))
@pytest.mark.parametrize("logit", [True, False])
@pytest.mark.parametrize("l2", [True, False])
def test_modes(K, state_dtype, gate, logit, l2):
    B, T = 3, 5
    seed = K + 10 * list(GATES).index(gate) + 2 * logit + l2
    x = make(B=B, T=T, H=2, HV=4, K=K, state_dtype=state_dtype, N_pool=B + 2, seed=seed)
    t, g = tok(x, gate, logit, l2), gkw(x, gate)
    pool = x["initial_state"]
    before = pool.clone()
    slots = torch.tensor([3, 0, 4], dtype=torch.int32, device=DEV)
    scale = 0.3 if not l2 else None
    o, fs = call(
        t,
        g,
        initial_state=pool,
        ssm_state_indices=slots,
        use_qk_l2norm_in_kernel=l2,
        beta_is_logit=logit,
        output_final_state=True,
        scale=scale,
    )
    assert fs is pool
    r = ref(t, g, before[slots.long()], l2=l2, logit=logit, scale=scale)
    assert_output(o, r.output)
    check_pool(pool, before, {int(s): r.final_state[i] for i, s in enumerate(slots.tolist())})


def _scenarios(K: int, state_dtype: torch.dtype):
    """(name, run, check): run() -> tuple of result tensors (compared bit for bit across configurations);
    check(res) compares one run with the fp64 reference. Every feature the warp-specialised kernel handles
    differently: pool reads (bulk copy) and writes (bulk store), inactive slots, GQA, zero-length sequences,
    checkpoints, speculative per-token writes, read-only sources of either dtype, no pool, all gate modes, a
    misaligned dt_bias (read from global memory), many items per warp, a verify pass (no pool write)."""
    other = torch.bfloat16 if state_dtype == torch.float32 else torch.float32
    sc = []

    # A. decode T=1, GQA, 300 sequences (many items per warp), two inactive slots
    B, HV = 300, 8
    xa = make(B=B, T=1, H=2, HV=HV, K=K, state_dtype=state_dtype, N_pool=B + 5, seed=31)
    ta, ga = tok(xa), gkw(xa)
    slots_a = (torch.randperm(B + 5, generator=torch.Generator().manual_seed(3))[:B]).to(torch.int32)
    slots_a[7], slots_a[100] = -1, B + 5  # inactive: negative, and == N_pool
    slots_a = slots_a.to(DEV)

    def run_a():
        pool = xa["initial_state"].clone()
        o, _ = call(ta, ga, initial_state=pool, ssm_state_indices=slots_a)
        return o, pool

    def check_a(res):
        o, pool = res
        act = [i for i in range(B) if i not in (7, 100)]
        r = ref({n: z[act] for n, z in ta.items()}, ga, xa["initial_state"][slots_a[act].long()])
        assert_output(o[act], r.output)
        assert torch.count_nonzero(o[[7, 100]]) == 0
        check_pool(pool, xa["initial_state"], {int(slots_a[i]): r.final_state[j] for j, i in enumerate(act)})

    sc.append(("decode", run_a, check_a))

    # B. packed mixed lengths (zero-length too), softplus gate, plain beta, checkpoints every 16
    lengths = [1, 17, 0, 65, 2, 0, 33]
    xb = make(H=2, HV=4, K=K, state_dtype=state_dtype, lengths=lengths, N_pool=len(lengths) + 1, seed=32)
    tb, gb = tok(xb, "softplus", logit=False), gkw(xb, "softplus")
    slots_b = torch.tensor([7, 1, 2, 3, 4, 5, 6], dtype=torch.int32, device=DEV)

    def run_b():
        pool = xb["initial_state"].clone()
        o, _, ck = call(
            tb,
            gb,
            initial_state=pool,
            cu_seqlens=xb["cu_seqlens"],
            ssm_state_indices=slots_b,
            beta_is_logit=False,
            checkpoint_every_n_tokens=16,
        )
        return o, pool, ck

    def check_b(res):
        o, pool, ck = res
        r = ref(
            tb,
            gb,
            xb["initial_state"][slots_b.long()],
            cu_seqlens=xb["cu_seqlens"],
            logit=False,
            checkpoint_every_n_tokens=16,
        )
        assert_output(o, r.output)
        check_pool(pool, xb["initial_state"], {int(slots_b[i]): r.final_state[i] for i, L in enumerate(lengths) if L})
        assert_close_rms(ck, torch.cat([c for c in r.checkpoints if c.shape[0] > 0]), state_tol(ck.dtype), "ckpt")

    sc.append(("packed+checkpoints", run_b, check_b))

    # C. speculative decode: per-token slots, accepted columns, one inactive token
    Bs, S = 5, 3
    xc = make(B=Bs, T=1 + S, H=1, HV=2, K=K, state_dtype=state_dtype, N_pool=Bs * (S + 1) + 3, seed=33)
    tc, gc = tok(xc), gkw(xc)
    idx_c = (torch.randperm(Bs * (S + 1), generator=torch.Generator().manual_seed(4)) + 2).reshape(Bs, S + 1)
    idx_c = idx_c.to(torch.int32).to(DEV)
    acc_c = torch.tensor([1, 2, 4, 0, 9], dtype=torch.int32, device=DEV)

    def run_c():
        pool = xc["initial_state"].clone()
        o, _ = call(tc, gc, initial_state=pool, ssm_state_indices=idx_c, num_spec_tokens=S, num_accepted_tokens=acc_c)
        return o, pool

    def check_c(res):
        o, pool = res
        cols = (acc_c.long() - 1).clamp(0, S)
        r = ref(tc, gc, xc["initial_state"][idx_c.long()[torch.arange(Bs, device=DEV), cols]], return_all_states=True)
        assert_output(o, r.output)
        check_pool(
            pool, xc["initial_state"], {int(idx_c[n, j]): r.all_states[n][j] for n in range(Bs) for j in range(S + 1)}
        )

    sc.append(("spec", run_c, check_c))

    # D. read-only source of the other dtype (one inactive index), results to the pool
    xd = make(B=3, T=4, H=1, HV=2, K=K, state_dtype=state_dtype, N_pool=5, seed=34)
    td, gd = tok(xd), gkw(xd)
    source = (torch.randn(6, 2, K, K, generator=torch.Generator().manual_seed(5)) * 0.1).to(DEV).to(other)
    src_idx = torch.tensor([5, 0, 6], dtype=torch.int32, device=DEV)
    slots_d = torch.tensor([1, 3, 0], dtype=torch.int32, device=DEV)

    def run_d():
        pool = xd["initial_state"].clone()
        o, _ = call(
            td,
            gd,
            initial_state=pool,
            ssm_state_indices=slots_d,
            initial_state_source=source,
            initial_state_indices=src_idx,
        )
        return o, pool

    def check_d(res):
        o, pool = res
        r = ref({n: z[:2] for n, z in td.items()}, gd, source[[5, 0]])
        assert_output(o[:2], r.output)
        assert torch.count_nonzero(o[2]) == 0
        check_pool(pool, xd["initial_state"], {1: r.final_state[0], 3: r.final_state[1]})

    sc.append(("source", run_d, check_d))

    # E. no pool (zeros start, fp32 final state), precomputed gate (no A_log, no dt_bias)
    xe = make(H=1, HV=2, K=K, lengths=[4, 0, 19], seed=35)
    te, ge = tok(xe, "precomputed"), gkw(xe, "precomputed")

    def run_e():
        o, fs = call(te, ge, cu_seqlens=xe["cu_seqlens"], output_final_state=True)
        return o, fs

    def check_e(res):
        o, fs = res
        r = ref(te, ge, None, cu_seqlens=xe["cu_seqlens"])
        assert_output(o, r.output)
        assert_close_rms(fs, r.final_state, TOL_STATE_FP32, "final_state")

    sc.append(("no pool", run_e, check_e))

    # F. dt_bias 4 bytes past a 16-byte boundary: not bulk-copyable, read from global memory (same bits)
    xf = make(B=6, T=2, H=1, HV=2, K=K, state_dtype=state_dtype, N_pool=6, seed=36)
    tf, gf = tok(xf), dict(gkw(xf))
    buf = torch.empty(gf["dt_bias"].numel() + 4, device=DEV)
    gf["dt_bias"] = buf[1 : 1 + gf["dt_bias"].numel()].view_as(gf["dt_bias"])
    gf["dt_bias"].copy_(gkw(xf)["dt_bias"])

    def run_f():
        pool = xf["initial_state"].clone()
        o, _ = call(tf, gf, initial_state=pool)
        return o, pool

    def check_f(res):
        o, pool = res
        r = ref(tf, gf, xf["initial_state"])
        assert_output(o, r.output)
        check_pool(pool, xf["initial_state"], {i: r.final_state[i] for i in range(6)})

    sc.append(("misaligned dt_bias", run_f, check_f))

    # G. many packed sequences of random lengths over 8 heads (each warp walks many items, wrapping its ring
    # and slot tables many times under one block per SM), checkpoints every 16
    lengths_g = [int(z) for z in torch.randint(0, 40, (48,), generator=torch.Generator().manual_seed(1))]
    xg = make(H=2, HV=8, K=K, state_dtype=state_dtype, lengths=lengths_g, seed=24)
    tg, gg = tok(xg), gkw(xg)

    def run_g():
        pool = xg["initial_state"].clone()
        o, _, ck = call(tg, gg, initial_state=pool, cu_seqlens=xg["cu_seqlens"], checkpoint_every_n_tokens=16)
        return o, pool, ck

    def check_g(res):
        o, pool, _ = res
        r = ref(tg, gg, xg["initial_state"], cu_seqlens=xg["cu_seqlens"])
        assert_output(o, r.output)
        check_pool(pool, xg["initial_state"], {i: r.final_state[i] for i, L in enumerate(lengths_g) if L > 0})

    sc.append(("many items", run_g, check_g))

    # H. speculative verify (disable_state_update): outputs of scenario C, the pool left bit-identical
    def run_h():
        pool = xc["initial_state"].clone()
        o, _ = call(
            tc,
            gc,
            initial_state=pool,
            ssm_state_indices=idx_c,
            num_spec_tokens=S,
            num_accepted_tokens=acc_c,
            disable_state_update=True,
        )
        return o, pool

    def check_h(res):
        o, pool = res
        assert torch.equal(bits(pool), bits(xc["initial_state"])), "a verify pass wrote the pool"
        assert torch.equal(bits(o), bits(run_c()[0])), "verify output differs from the committing call's"

    sc.append(("verify", run_h, check_h))
    return sc


@pytest.mark.parametrize("K", [64, 128])
@pytest.mark.parametrize("state_dtype", [torch.float32, torch.bfloat16])
def test_scenarios_reference(K, state_dtype):
    """The configuration-comparison scenarios below, under this process's kernel and knobs, against the fp64
    reference (the cross-configuration test then only compares bits)."""
    for _name, run, check in _scenarios(K, state_dtype):
        check(run())


# ---------------------------------------------------------------------------------------------------
# Launch configurations: the kernel switch (KDA_DECODE_KERNEL=ring|serial; unset: ring on bandwidth-bound grids of
# bf16 tiles and of fp32 tiles at K=128 on sm_90+) and, in an experiments build (KDA_BUILD_EXPERIMENTS=1), the
# ring kernel's other block shapes and issue orders and the schedule knobs (tile, blocks per SM, carveout, L1
# prefetch, warps per block, PDL) change only the schedule, so every configuration must give the same bits. The
# switches are read at import, so each configuration runs the scenarios in a child process and saves its
# results; this process compares them with its own. Running this whole file with KDA_DECODE_KERNEL=serial sends
# every other test through the serial kernel.

KNOB_NAMES = ("KDA_DECODE_KERNEL", "KDA_EXPERIMENT")
RING = {"KDA_DECODE_KERNEL": "ring"}
SERIAL = {"KDA_DECODE_KERNEL": "serial"}
CONFIGS = [SERIAL, RING]
if _routing.knobs()["experiments_built"]:
    CONFIGS += [
        dict(RING, KDA_EXPERIMENT="blocks_per_sm=1"),  # one block per SM: every ring wraps many times
        dict(RING, KDA_EXPERIMENT="rows_per_lane=4"),
        dict(RING, KDA_EXPERIMENT="rows_per_lane=8"),
        # the block shapes of the K=128 NR=8 tile (default 1; other tiles keep shape 0), one with one block per SM
        dict(RING, KDA_EXPERIMENT="rows_per_lane=8,ring_shape=0"),
        dict(RING, KDA_EXPERIMENT="pdl=0"),  # without programmatic dependent launch (the default uses it)
        dict(SERIAL, KDA_EXPERIMENT="pdl=0"),
        dict(RING, KDA_EXPERIMENT="rows_per_lane=8,ring_shape=2,ring_state_first=1"),
        dict(RING, KDA_EXPERIMENT="rows_per_lane=8,ring_shape=3,blocks_per_sm=1"),
        {"KDA_EXPERIMENT": "rows_per_lane=1"},
        {"KDA_EXPERIMENT": "rows_per_lane=2"},
        dict(SERIAL, KDA_EXPERIMENT="rows_per_lane=8,warps_per_block=1"),
        dict(SERIAL, KDA_EXPERIMENT="blocks_per_sm=1,rows_per_lane=4"),
        dict(SERIAL, KDA_EXPERIMENT="carveout=-1,l1_prefetch=1"),
        # fp32 pools at K=128 take the ring kernel's 4-rows tile on bandwidth-bound grids; without it they stay serial
        {"KDA_EXPERIMENT": "ring_fp32=0"},
        # dt_bias read from global memory by the math warps instead of bulk-copied into the stage
        dict(RING, KDA_EXPERIMENT="ring_dt_bias_global=1"),
        # the producer lanes each on its own (default: in step)
        dict(RING, KDA_EXPERIMENT="ring_producer_diverged=1"),
    ]


def _scenario_results() -> dict:
    """Every scenario's result tensors (on the CPU), keyed by K, state dtype and scenario name."""
    res = {}
    for K in (64, 128):
        for dt in (torch.float32, torch.bfloat16):
            for name, run, _ in _scenarios(K, dt):
                res[f"{K}/{dt}/{name}"] = [z.cpu() for z in run()]
    torch.cuda.synchronize()
    return res


def _spawn_child(env: dict, out: str):
    """A child process that saves _scenario_results() under `env` (the launch knobs of this process removed)."""
    import subprocess
    import sys

    here = os.path.dirname(os.path.abspath(__file__))
    code = (
        f"import sys; sys.path[:0] = [{os.path.dirname(here)!r}, {here!r}]; import torch; "
        f"import test_recurrent_cuda as m; torch.save(m._scenario_results(), {out!r})"
    )
    child_env = {k: v for k, v in os.environ.items() if k not in KNOB_NAMES}
    child_env.update(env)
    return subprocess.Popen(
        [sys.executable, "-c", code], env=child_env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True
    )


@cuda_only
def test_configs_bit_identical(tmp_path):
    """Every configuration of CONFIGS (child processes, run side by side) gives this process's bits."""
    procs = [(env, os.path.join(str(tmp_path), f"c{i}.pt")) for i, env in enumerate(CONFIGS)]
    procs = [(env, out, _spawn_child(env, out)) for env, out in procs]
    want = _scenario_results()
    bad = []
    for env, out, proc in procs:
        log, _ = proc.communicate(timeout=300)
        assert proc.returncode == 0, f"child under {env} failed:\n{log[-4000:]}"
        got = torch.load(out)
        assert got.keys() == want.keys()
        for key, ts in want.items():
            if not all(torch.equal(bits(a), bits(b)) for a, b in zip(got[key], ts, strict=True)):
                bad.append(f"{key} under {env}")
    assert not bad, "differs from this process's configuration: " + "; ".join(bad)


@cuda_only
@pytest.mark.parametrize("state_dtype", [torch.float32, torch.bfloat16])
def test_cuda_graph_b1(state_dtype):
    """B=1 decode (one item per warp: the latency path) captured in a CUDA graph: replays with new tokens and a
    new slot give the eager bits of the same kernel, within the reference tolerances."""
    x = make(B=1, T=1, H=32, HV=32, K=128, state_dtype=state_dtype, N_pool=4, seed=37)

    def decode(d):
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
            use_gate_in_kernel=True,
            lower_bound=-5.0,
            beta_is_logit=True,
            output=d["out"],
            backend="recurrent",
        )

    static = dict(
        q=x["q"],
        k=x["k"],
        v=x["v"],
        g=x["g"],
        beta=x["beta"],
        A_log=x["A_log"],
        dt_bias=x["dt_bias"],
        pool=x["initial_state"],
        idx=torch.zeros(1, dtype=torch.int32, device=DEV),
        out=torch.empty_like(x["v"]),
    )
    decode(static)  # eager warm-up (occupancy queries, smem opt-in) before capture
    graph = capture_graph(lambda: decode(static))
    for i in range(3):
        y = make(B=1, T=1, H=32, HV=32, K=128, state_dtype=state_dtype, N_pool=4, seed=300 + i)
        for n in ("q", "k", "v", "g", "beta"):
            static[n].copy_(y[n])
        static["idx"].fill_(i + 1)
        pool0 = static["pool"].clone()
        graph.replay()
        torch.cuda.synchronize()
        got_o, got_pool = static["out"].clone(), static["pool"].clone()
        eager = dict(static, pool=pool0.clone(), out=torch.empty_like(static["out"]))
        decode(eager)
        assert torch.equal(bits(got_o), bits(eager["out"])), "graph replay output differs from the eager call"
        assert torch.equal(bits(got_pool), bits(eager["pool"])), "graph replay state differs from the eager call"
        r = ref({n: y[n] for n in ("q", "k", "v", "g", "beta")}, gkw(x), pool0[i + 1 : i + 2])
        assert_output(got_o, r.output)
        check_pool(got_pool, pool0, {i + 1: r.final_state[0]})


@cuda_only
@pytest.mark.parametrize("S", [0, 3])
@pytest.mark.parametrize("state_dtype", [torch.float32, torch.bfloat16])
def test_cuda_graph_verify_then_commit(S, state_dtype):
    """Speculative verify in a graph: a captured disable_state_update=True call replays with new tokens and
    leaves the pool bit-identical, with the outputs of the committing call (also captured)."""
    B = 4
    x = make(B=B, T=1 + S, H=2, HV=4, K=128, state_dtype=state_dtype, N_pool=B * (S + 1) + 2, seed=41)
    idx = (torch.arange(B * (S + 1), dtype=torch.int32, device=DEV) + 1).reshape(B, S + 1)
    if S == 0:
        idx = idx[:, 0].contiguous()
    acc = torch.tensor([1, 2, 4, 3], dtype=torch.int32, device=DEV)[:B] if S else None
    pool = x["initial_state"]
    out_v, out_c = torch.empty_like(x["v"]), torch.empty_like(x["v"])
    t, g = tok(x), gkw(x)

    def step(out, verify, p):
        call(
            t,
            g,
            initial_state=p,
            ssm_state_indices=idx,
            num_spec_tokens=S or None,
            num_accepted_tokens=acc,
            output=out,
            disable_state_update=verify,
        )

    commit_pool = pool.clone()
    step(out_v, True, pool)
    step(out_c, False, commit_pool)
    gv = capture_graph(lambda: step(out_v, True, pool))
    gc_ = capture_graph(lambda: step(out_c, False, commit_pool))
    for i in range(2):
        y = make(B=B, T=1 + S, H=2, HV=4, K=128, state_dtype=state_dtype, N_pool=1, seed=400 + i)
        for n in ("q", "k", "v", "g", "beta"):
            t[n].copy_(tok(y)[n])
        before = pool.clone()
        commit_pool.copy_(pool)
        gv.replay()
        gc_.replay()
        torch.cuda.synchronize()
        assert torch.equal(bits(pool), bits(before)), "a verify replay wrote the pool"
        assert torch.equal(bits(out_v), bits(out_c)), "verify output differs from the committing call's"
        assert not torch.equal(bits(commit_pool), bits(before))


@pytest.mark.parametrize("T", [1, 2, 17, 65, 1000])
@pytest.mark.parametrize("state_dtype", [torch.float32, torch.bfloat16])
def test_lengths(T, state_dtype):
    B = 1 if T == 1000 else 3
    x = make(B=B, T=T, H=1, HV=2, K=128, state_dtype=state_dtype, seed=T)
    t, g = tok(x), gkw(x)
    pool = x["initial_state"]
    before = pool.clone()
    o, _ = call(t, g, initial_state=pool)
    r = ref(t, g, before)
    assert_output(o, r.output)
    check_pool(pool, before, {i: r.final_state[i] for i in range(B)})


def test_packed_mixed_lengths_and_zero_length():
    lengths = [1, 17, 0, 65, 2, 0, 33]
    x = make(H=2, HV=4, K=128, lengths=lengths, N_pool=len(lengths) + 1, seed=3)
    t, g = tok(x, "softplus", logit=False), gkw(x, "softplus")
    pool = x["initial_state"]
    before = pool.clone()
    slots = torch.tensor([7, 1, 2, 3, 4, 5, 6], dtype=torch.int32, device=DEV)
    for cu_dtype in (torch.int64, torch.int32):
        pool.copy_(before)
        o, _ = call(
            t,
            g,
            initial_state=pool,
            cu_seqlens=x["cu_seqlens"].to(cu_dtype),
            ssm_state_indices=slots,
            beta_is_logit=False,
        )
        r = ref(t, g, before[slots.long()], cu_seqlens=x["cu_seqlens"], logit=False)
        assert_output(o, r.output)
        written = {int(slots[i]): r.final_state[i] for i, L in enumerate(lengths) if L > 0}
        check_pool(pool, before, written)


# ---------------------------------------------------------------------------------------------------
# speculative decode


def _spec_inputs(B, S, state_dtype, N_pool, seed, packed):
    x = make(B=B, T=1 + S, H=1, HV=2, K=128, state_dtype=state_dtype, N_pool=N_pool, seed=seed)
    if packed:
        for n in ("q", "k", "v", "g", "beta", "beta_prob"):
            x[n] = x[n].reshape(1, B * (1 + S), *x[n].shape[2:])
        x["cu_seqlens"] = torch.arange(0, B * (1 + S) + 1, 1 + S, dtype=torch.int64, device=DEV)
    return x


@pytest.mark.parametrize("packed", [False, True])
@pytest.mark.parametrize("state_dtype", [torch.float32, torch.bfloat16])
def test_spec_decode(packed, state_dtype):
    B, S = 5, 3
    x = _spec_inputs(B, S, state_dtype, N_pool=B * (S + 1) + 3, seed=11, packed=packed)
    t, g = tok(x), gkw(x)
    pool = x["initial_state"]
    before = pool.clone()
    perm = torch.randperm(B * (S + 1), generator=torch.Generator().manual_seed(0)) + 2
    idx = perm.reshape(B, S + 1).to(torch.int32).to(DEV)
    accepted = torch.tensor([1, 2, 4, 0, 9], dtype=torch.int32, device=DEV)  # 0 and 9 clamp to columns 0 and S
    kw = dict(cu_seqlens=x.get("cu_seqlens"))
    o, _ = call(t, g, initial_state=pool, ssm_state_indices=idx, num_spec_tokens=S, num_accepted_tokens=accepted, **kw)
    cols = (accepted.long() - 1).clamp(0, S)
    start = before[idx.long()[torch.arange(B, device=DEV), cols]]
    r = ref(t, g, start, return_all_states=True, **kw)
    assert_output(o, r.output)
    written = {}
    for n in range(B):
        for j in range(S + 1):
            written[int(idx[n, j])] = r.all_states[n][j]
    check_pool(pool, before, written)


def test_spec_step_equals_single_token_decodes():
    """fp32 state: one step of 1+S tokens == 1+S single-token decodes (<= 1e-6 relative)."""
    B, S = 4, 3
    x = _spec_inputs(B, S, torch.float32, N_pool=B * (S + 1) + 1, seed=5, packed=False)
    t, g = tok(x), gkw(x)
    pool = x["initial_state"]
    before = pool.clone()
    idx = (torch.arange(B * (S + 1), dtype=torch.int32, device=DEV) + 1).reshape(B, S + 1)
    accepted = torch.tensor([1, 2, 3, 4], dtype=torch.int32, device=DEV)
    o_spec, _ = call(t, g, initial_state=pool, ssm_state_indices=idx, num_spec_tokens=S, num_accepted_tokens=accepted)
    # the same tokens one at a time, each decode reading and writing a fresh decode pool
    dec = torch.empty_like(before)
    cols = (accepted.long() - 1).clamp(0, S)
    dec[:B] = before[idx.long()[torch.arange(B, device=DEV), cols]]
    outs = []
    for j in range(S + 1):
        tj = {n: z[:, j : j + 1].contiguous() for n, z in t.items()}
        o_j, _ = call(tj, g, initial_state=dec[:B])
        outs.append(o_j)
        for n in range(B):
            got, want = pool[int(idx[n, j])], dec[n]
            assert rel_rms(got, want) <= 1e-6, f"state after token {j} of sequence {n}"
    o_dec = torch.cat(outs, 1)
    assert rel_rms(o_spec.float(), o_dec.float()) <= 1e-6


def test_spec_inactive_token_and_sequence():
    B, S = 3, 2
    x = _spec_inputs(B, S, torch.float32, N_pool=12, seed=9, packed=False)
    t, g = tok(x), gkw(x)
    pool = x["initial_state"]
    before = pool.clone()
    idx = torch.tensor([[1, -1, 2], [3, 4, 5], [100, 6, 7]], dtype=torch.int32, device=DEV)
    # seq 0: token 1 inactive (slot -1): zero output, state not advanced; seq 2: start slot 100 >= N_pool
    o, _ = call(t, g, initial_state=pool, ssm_state_indices=idx, num_spec_tokens=S)
    r0 = ref({n: z[0:1, [0, 2]] for n, z in t.items()}, g, before[1:2], return_all_states=True)
    r1 = ref({n: z[1:2] for n, z in t.items()}, g, before[3:4], return_all_states=True)
    assert_output(o[0, [0, 2]], r0.output[0])
    assert torch.count_nonzero(o[0, 1]) == 0 and torch.count_nonzero(o[2]) == 0
    assert_output(o[1], r1.output[0])
    written = {
        1: r0.all_states[0][0],
        2: r0.all_states[0][1],
        3: r1.all_states[0][0],
        4: r1.all_states[0][1],
        5: r1.all_states[0][2],
    }
    check_pool(pool, before, written)


# ---------------------------------------------------------------------------------------------------
# slots, sources, checkpoints, final state


def test_inactive_slots_untouched():
    x = make(B=4, T=3, H=1, HV=2, K=64, N_pool=4, seed=2)
    t, g = tok(x), gkw(x)
    pool = x["initial_state"]
    before = pool.clone()
    slots = torch.tensor([2, -1, 4, 0], dtype=torch.int32, device=DEV)  # -1 and 4 (== N_pool) are inactive
    o, _ = call(t, g, initial_state=pool, ssm_state_indices=slots)
    r = ref({n: z[[0, 3]] for n, z in t.items()}, g, before[[2, 0]])
    assert_output(o[[0, 3]], r.output)
    assert torch.count_nonzero(o[[1, 2]]) == 0
    check_pool(pool, before, {2: r.final_state[0], 0: r.final_state[1]})


@pytest.mark.parametrize("src_dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("pool_dtype", [torch.float32, torch.bfloat16])
def test_state_source(src_dtype, pool_dtype):
    x = make(B=3, T=4, H=1, HV=2, K=128, state_dtype=pool_dtype, N_pool=5, seed=4)
    t, g = tok(x), gkw(x)
    pool = x["initial_state"]
    before = pool.clone()
    source = (torch.randn(6, 2, 128, 128, device=DEV) * 0.1).to(src_dtype)
    src_before = bits(source)
    src_idx = torch.tensor([5, 0, 6], dtype=torch.int32, device=DEV)  # 6 >= N0: inactive
    slots = torch.tensor([1, 3, 0], dtype=torch.int32, device=DEV)
    o, _ = call(
        t, g, initial_state=pool, ssm_state_indices=slots, initial_state_source=source, initial_state_indices=src_idx
    )
    assert torch.equal(bits(source), src_before), "the source pool was written"
    r = ref({n: z[:2] for n, z in t.items()}, g, source[[5, 0]])
    assert_output(o[:2], r.output)
    assert torch.count_nonzero(o[2]) == 0
    check_pool(pool, before, {1: r.final_state[0], 3: r.final_state[1]})


def test_final_state_without_pool():
    lengths = [4, 0, 19]
    x = make(H=1, HV=2, K=128, lengths=lengths, seed=8)
    t, g = tok(x), gkw(x)
    o, fs = call(t, g, cu_seqlens=x["cu_seqlens"], output_final_state=True)
    r = ref(t, g, None, cu_seqlens=x["cu_seqlens"])
    assert fs.dtype == torch.float32
    assert_output(o, r.output)
    assert_close_rms(fs, r.final_state, TOL_STATE_FP32, "final_state")
    # with a read-only source and no pool: the final state starts from the source
    source = (torch.randn(3, 2, 128, 128, device=DEV) * 0.1).bfloat16()
    src_idx = torch.tensor([2, 0, 1], dtype=torch.int32, device=DEV)
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


@pytest.mark.parametrize("pool_dtype", [None, torch.float32, torch.bfloat16])
@pytest.mark.parametrize("every", [16, 64])
def test_checkpoints(pool_dtype, every):
    lengths = [65, 131, 0, 16, 1]
    x = make(H=1, HV=2, K=128, state_dtype=pool_dtype or torch.float32, lengths=lengths, seed=6)
    t, g = tok(x), gkw(x)
    pool = x["initial_state"] if pool_dtype is not None else None
    init = None if pool is None else pool.clone()
    res = call(
        t,
        g,
        initial_state=pool,
        cu_seqlens=x["cu_seqlens"],
        checkpoint_every_n_tokens=every,
        output_final_state=pool is None,
    )
    o, fs, ck = res
    r = ref(t, g, init, cu_seqlens=x["cu_seqlens"], checkpoint_every_n_tokens=every)
    assert_output(o, r.output)
    expected = torch.cat([c for c in r.checkpoints if c.shape[0] > 0])
    assert ck.shape[0] == expected.shape[0] == sum(math.ceil(L / every) for L in lengths)
    assert_close_rms(ck, expected, state_tol(ck.dtype), "checkpoints")


@pytest.mark.parametrize("ck_dtype", [torch.float32, torch.bfloat16])
def test_checkpoint_rows_past_buffer_are_skipped(ck_dtype):
    """Direct op call: a checkpoint buffer with fewer rows than the starts ask for is never overrun, and
    the checkpoint dtype may differ from the pool's."""
    lengths = [40, 70]
    every = 16
    x = make(H=1, HV=2, K=64, state_dtype=torch.bfloat16, lengths=lengths, seed=12)
    t, g = tok(x), gkw(x)
    starts = torch.tensor([0, 3, 8], dtype=torch.int64, device=DEV)  # ceil(40/16)=3, ceil(70/16)=5
    full = torch.full((9, 2, 64, 64), 7.0, dtype=ck_dtype, device=DEV)
    ck = full[:6]  # rows 6, 7 of sequence 1 must be skipped; row 8 is a sentinel
    pool = x["initial_state"]
    init = pool.clone()
    out = torch.empty_like(x["v"])
    torch.ops.kda.recurrent_kda.default(
        t["q"],
        t["k"],
        t["v"],
        t["g"],
        t["beta"],
        x["A_log"],
        x["dt_bias"],
        pool,
        None,
        None,
        x["cu_seqlens"],
        None,
        None,
        None,
        out,
        None,
        ck,
        starts,
        None,
        1 / 8,
        2,
        -5.0,
        True,
        True,
        0,
        every,
        2,
    )
    r = ref(t, g, init, cu_seqlens=x["cu_seqlens"], checkpoint_every_n_tokens=every, scale=1 / 8)
    exp = torch.cat(r.checkpoints)
    assert_close_rms(ck, exp[:6], state_tol(ck_dtype), "checkpoint rows")
    assert torch.all(full[6:] == 7.0), "rows at or past n_checkpoint_rows were written"
    assert_output(out, r.output)


def test_padded_slot_stride_and_strided_tokens():
    """A pool with a padded slot stride (padding untouched) and token tensors that are views of a fused
    projection (strided) or misaligned (copied by the op)."""
    B, T, H, HV, K = 2, 6, 2, 4, 128
    x = make(B=B, T=T, H=H, HV=HV, K=K, N_pool=3, seed=13)
    inner = HV * K * K
    buf = torch.randn(3, inner + 64, device=DEV)
    pool = buf[:, :inner].view(3, HV, K, K)
    pool.copy_(x["initial_state"])
    buf_before = buf.clone()
    fused = torch.cat([x["q"], x["k"]], dim=2)  # [B, T, 2H, K]: q, k are strided views
    q, k = fused[:, :, :H], fused[:, :, H:]
    mis = torch.empty(x["g"].numel() + 1, dtype=torch.bfloat16, device=DEV)[1:].view_as(x["g"])
    mis.copy_(x["g"])  # 2-byte aligned: the op reads a compact copy
    t = dict(q=q, k=k, v=x["v"], g=mis, beta=x["beta"])
    g = gkw(x)
    slots = torch.tensor([2, 0], dtype=torch.int32, device=DEV)
    o, _ = call(t, g, initial_state=pool, ssm_state_indices=slots)
    start = buf_before[[2, 0], :inner].view(2, HV, K, K)
    r = ref(dict(q=x["q"], k=x["k"], v=x["v"], g=x["g"], beta=x["beta"]), g, start)
    assert_output(o, r.output)
    assert_close_rms(pool[2], r.final_state[0], TOL_STATE_FP32, "slot 2")
    assert_close_rms(pool[0], r.final_state[1], TOL_STATE_FP32, "slot 0")
    assert torch.equal(bits(buf[:, inner:]), bits(buf_before[:, inner:])), "slot padding was written"
    assert torch.equal(bits(buf[1]), bits(buf_before[1]))


# ---------------------------------------------------------------------------------------------------
# determinism, graphs, long decode


def test_deterministic():
    lengths = [100, 3, 1, 57]
    x = make(H=2, HV=4, K=128, state_dtype=torch.bfloat16, lengths=lengths, seed=14)
    t, g = tok(x), gkw(x)
    runs = []
    for _ in range(3):
        pool = x["initial_state"].clone()
        o, _ = call(t, g, initial_state=pool, cu_seqlens=x["cu_seqlens"])
        runs.append((bits(o), bits(pool)))
    for r_ in runs[1:]:
        assert torch.equal(r_[0], runs[0][0]) and torch.equal(r_[1], runs[0][1])


def _graph_check(static: dict, fresh: list[dict], run):
    """Capture run(static) once, then for each dict of new values copy them into the static buffers,
    replay, and compare output and pool with an eager run on the same values."""
    graph = capture_graph(lambda: run(static))
    for vals in fresh:
        for n, v in vals.items():
            static[n].copy_(v)
        pool0 = static["pool"].clone()
        graph.replay()
        torch.cuda.synchronize()
        got_o, got_pool = static["out"].clone(), static["pool"].clone()
        eager = {n: (z.clone() if isinstance(z, torch.Tensor) else z) for n, z in static.items()}
        eager["pool"].copy_(pool0)
        run(eager)
        assert torch.equal(bits(got_o), bits(eager["out"])), "graph replay output differs from eager"
        assert torch.equal(bits(got_pool), bits(eager["pool"])), "graph replay state differs from eager"


@cuda_only
def test_cuda_graph_decode_and_spec():
    B, HV, K = 8, 4, 128
    x = make(B=B, T=1, H=2, HV=HV, K=K, state_dtype=torch.bfloat16, N_pool=2 * B, seed=15)

    def decode(d):
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
            use_gate_in_kernel=True,
            lower_bound=-5.0,
            beta_is_logit=True,
            output=d["out"],
            backend="recurrent",
        )

    static = dict(
        q=x["q"],
        k=x["k"],
        v=x["v"],
        g=x["g"],
        beta=x["beta"],
        A_log=x["A_log"],
        dt_bias=x["dt_bias"],
        pool=x["initial_state"],
        idx=torch.arange(B, dtype=torch.int32, device=DEV),
        out=torch.empty_like(x["v"]),
    )
    fresh = []
    for i in range(3):
        y = make(B=B, T=1, H=2, HV=HV, K=K, state_dtype=torch.bfloat16, N_pool=2 * B, seed=100 + i)
        perm = torch.randperm(2 * B, generator=torch.Generator().manual_seed(i))[:B].to(torch.int32).to(DEV)
        fresh.append(dict(q=y["q"], k=y["k"], v=y["v"], g=y["g"], beta=y["beta"], idx=perm))
    _graph_check(static, fresh, decode)

    S = 3
    xs = _spec_inputs(B, S, torch.float32, N_pool=B * (S + 1), seed=16, packed=True)

    def spec(d):
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
            num_spec_tokens=S,
            num_accepted_tokens=d["acc"],
            cu_seqlens=d["cu"],
            use_gate_in_kernel=True,
            lower_bound=-5.0,
            beta_is_logit=True,
            output=d["out"],
            backend="recurrent",
        )

    static = dict(
        q=xs["q"],
        k=xs["k"],
        v=xs["v"],
        g=xs["g"],
        beta=xs["beta"],
        A_log=xs["A_log"],
        dt_bias=xs["dt_bias"],
        pool=xs["initial_state"],
        cu=xs["cu_seqlens"],
        idx=torch.arange(B * (S + 1), dtype=torch.int32, device=DEV).reshape(B, S + 1),
        acc=torch.ones(B, dtype=torch.int32, device=DEV),
        out=torch.empty_like(xs["v"]),
    )
    fresh = []
    for i in range(3):
        y = _spec_inputs(B, S, torch.float32, N_pool=B * (S + 1), seed=200 + i, packed=True)
        perm = torch.randperm(B * (S + 1), generator=torch.Generator().manual_seed(i)).to(torch.int32).to(DEV)
        acc = torch.randint(1, S + 2, (B,), generator=torch.Generator().manual_seed(i)).to(torch.int32).to(DEV)
        fresh.append(dict(q=y["q"], k=y["k"], v=y["v"], g=y["g"], beta=y["beta"], idx=perm.reshape(B, S + 1), acc=acc))
    _graph_check(static, fresh, spec)


@cuda_only
def test_cuda_graph_packed_prefill_new_lengths():
    """Packed prefill with int64 cu_seqlens: new boundaries (same N, same total T) replay like eager."""
    lengths = [10, 30, 1, 23]
    x = make(H=1, HV=2, K=128, lengths=lengths, seed=17)

    def prefill(d):
        kda_ops.recurrent_kda(
            d["q"],
            d["k"],
            d["v"],
            d["g"],
            d["beta"],
            A_log=d["A_log"],
            dt_bias=d["dt_bias"],
            initial_state=d["pool"],
            cu_seqlens=d["cu"],
            use_gate_in_kernel=True,
            lower_bound=-5.0,
            beta_is_logit=True,
            output=d["out"],
            backend="recurrent",
            prefill_workspace=d["ws"],
        )

    static = dict(
        q=x["q"],
        k=x["k"],
        v=x["v"],
        g=x["g"],
        beta=x["beta"],
        A_log=x["A_log"],
        dt_bias=x["dt_bias"],
        pool=x["initial_state"],
        cu=x["cu_seqlens"],
        out=torch.zeros_like(x["v"]),
        ws=kda_ops.RecurrentKDAPrefillWorkspace(),
    )
    fresh = [dict(cu=lengths_to_cu(L, device=DEV)) for L in ([40, 1, 1, 22], [0, 64, 0, 0], [16, 16, 16, 16])]
    _graph_check(static, fresh, prefill)


@pytest.mark.parametrize("gate", ["lower_bound", "slow"])
def test_long_decode_fp32_4096(gate):
    """4096 single-token decode calls with an fp32 pool stay within 1e-4 relative of fp64."""
    steps, HV, K = 4096, 2, 128
    x = make(B=1, T=steps, H=1, HV=HV, K=K, state_dtype=torch.float32, seed=18)
    t = tok(x)
    if gate == "slow":  # slow per-channel decay (memory of hundreds of steps): rounding must not compound
        t["g"] = (-0.02 * torch.rand(1, steps, HV, K, device=DEV)).bfloat16()
        g = gkw(x, "precomputed")
    else:
        g = gkw(x)
    pool = x["initial_state"]
    start = pool.clone()
    for i in range(steps):
        call({n: z[:, i : i + 1] for n, z in t.items()}, g, initial_state=pool)
    r = ref(t, g, start)
    err = rel_rms(pool, r.final_state)
    assert err <= 1e-4, f"state after {steps} decode steps: relative error {err:.2e} > 1e-4"


# ---------------------------------------------------------------------------------------------------
# 64-bit offsets and big grids


def _decode_ref_batched(q, k, v, g, beta, A_log, dt_bias, S0, lower_bound=-5.0):
    """fp64 single-token decode for many sequences at once (lower-bound gate, logit beta, L2 norm)."""
    B, _, H, K = q.shape
    HV = v.shape[2]
    grp = HV // H
    qd = q[:, 0].double().repeat_interleave(grp, 1)
    kd = k[:, 0].double().repeat_interleave(grp, 1)
    qd = qd * torch.rsqrt((qd * qd).sum(-1, keepdim=True) + 1e-6) / math.sqrt(K)
    kd = kd * torch.rsqrt((kd * kd).sum(-1, keepdim=True) + 1e-6)
    a = lower_bound * torch.sigmoid(torch.exp(A_log.double())[:, None] * (g[:, 0].double() + dt_bias.double()))
    b = torch.sigmoid(beta[:, 0].double())
    S = S0.double() * torch.exp(a)[:, :, None, :]
    p = torch.einsum("nhvk,nhk->nhv", S, kd)
    r = b[..., None] * (v[:, 0].double() - p)
    S = S + r[..., None] * kd[:, :, None, :]
    o = torch.einsum("nhvk,nhk->nhv", S, qd)
    return o[:, None], S


def test_batched_decode_reference_matches_reference():
    x = make(B=3, T=1, H=2, HV=4, K=64, seed=19)
    t, g = tok(x), gkw(x)
    o, S = _decode_ref_batched(**t, A_log=x["A_log"], dt_bias=x["dt_bias"], S0=x["initial_state"])
    r = ref(t, g, x["initial_state"])
    assert rel_rms(o, r.output) < 1e-12 and rel_rms(S, r.final_state) < 1e-12


@cuda_only
def test_pool_past_2_31_elements():
    """bf16 pool of 4100 slots x [32, 128, 128] = 2.15e9 elements (4.3 GB): read and write the last slot."""
    n_pool, HV, H, K = 4100, 32, 8, 128
    free = torch.cuda.mem_get_info()[0]
    if free < 6 * 2**30:
        pytest.skip("needs ~6 GB of free GPU memory")
    pool = torch.zeros(n_pool, HV, K, K, dtype=torch.bfloat16, device=DEV)
    assert pool.numel() > 2**31
    x = make(B=2, T=1, H=H, HV=HV, K=K, state_dtype=torch.bfloat16, N_pool=2, seed=20)
    slots = torch.tensor([n_pool - 1, 2050], dtype=torch.int32, device=DEV)
    pool[n_pool - 1] = x["initial_state"][0]
    pool[2050] = x["initial_state"][1]
    t = tok(x)
    o, _ = call(t, gkw(x), initial_state=pool, ssm_state_indices=slots)
    eo, eS = _decode_ref_batched(**t, A_log=x["A_log"], dt_bias=x["dt_bias"], S0=x["initial_state"])
    assert_output(o, eo)
    assert_close_rms(pool[n_pool - 1], eS[0], state_tol(torch.bfloat16), "last slot")
    assert_close_rms(pool[2050], eS[1], state_tol(torch.bfloat16), "slot 2050")
    for s in (0, 2049, 2051, n_pool - 2):
        assert torch.count_nonzero(pool[s]) == 0, f"slot {s} was written"
    del pool
    torch.cuda.empty_cache()


@cuda_only
def test_many_sequences_times_heads_beyond_65535():
    N, H, HV, K = 2100, 16, 32, 64  # N * HV = 67200
    x = make(B=N, T=1, H=H, HV=HV, K=K, state_dtype=torch.bfloat16, seed=21)
    t = tok(x)
    pool = x["initial_state"]
    before = pool.clone()
    slots = torch.arange(N - 1, -1, -1, dtype=torch.int32, device=DEV)
    o, _ = call(t, gkw(x), initial_state=pool, ssm_state_indices=slots)
    eo, eS = _decode_ref_batched(**t, A_log=x["A_log"], dt_bias=x["dt_bias"], S0=before[slots.long()])
    assert_output(o, eo)
    assert_close_rms(pool[slots.long()], eS, state_tol(torch.bfloat16), "pool")


# ---------------------------------------------------------------------------------------------------
# outside checks: golden vectors, the CPU op, the chunked backend's status


GOLDEN_RECURRENT = [
    "decode_gqa_lowerbound",
    "prefill_packed_softplus",
    "prefill_precomputed_gate_no_l2",
    "prefill_checkpoints",
    "spec_decode_accepted",
]


@pytest.mark.parametrize("name", GOLDEN_RECURRENT)
def test_golden(name):
    gold = load_golden(name)
    inp = {n: z.to(DEV) if isinstance(z, torch.Tensor) else z for n, z in gold["inputs"].items()}
    pool_before = inp["initial_state"].clone() if "initial_state" in inp else None
    res = kda_ops.recurrent_kda(**inp, **gold["kwargs"], backend="recurrent")
    exp = gold["expected"]
    assert_output(res[0], exp["output"])
    if "state_pool_after" in exp:
        after = inp["initial_state"]
        changed = [
            i for i in range(after.shape[0]) if not torch.equal(exp["state_pool_after"][i], pool_before[i].cpu())
        ]
        for i in range(after.shape[0]):
            if i in changed:
                assert_close_rms(after[i], exp["state_pool_after"][i], state_tol(after.dtype), f"slot {i}")
            else:
                assert torch.equal(bits(after[i]), bits(pool_before[i])), f"slot {i} must be untouched"
    if "final_state" in exp:
        assert_close_rms(res[1], exp["final_state"], TOL_STATE_FP32, "final_state")
    if "state_checkpoints" in exp:
        assert_close_rms(res[2], exp["state_checkpoints"], state_tol(res[2].dtype), "checkpoints")


@cuda_only
@pytest.mark.skipif(not has_cpu_op("recurrent_kda"), reason="CPU recurrent_kda not built")
@pytest.mark.parametrize("state_dtype", [torch.float32, torch.bfloat16])
def test_cuda_matches_cpu_op(state_dtype):
    lengths = [1, 33, 0, 70, 4]
    x = make(H=2, HV=4, K=128, state_dtype=state_dtype, lengths=lengths, N_pool=6, seed=22)
    t, g = tok(x, "softplus"), gkw(x, "softplus")
    slots = torch.tensor([5, 0, 1, 2, 3], dtype=torch.int32, device=DEV)
    pool_gpu = x["initial_state"].clone()
    o_gpu, _ = call(
        t, g, initial_state=pool_gpu, cu_seqlens=x["cu_seqlens"], ssm_state_indices=slots, checkpoint_every_n_tokens=16
    )[:2]
    cpu = lambda z: z.cpu() if isinstance(z, torch.Tensor) else z  # noqa: E731
    pool_cpu = x["initial_state"].cpu().clone()
    o_cpu, _ = kda_ops.recurrent_kda(
        **{n: cpu(z) for n, z in t.items()},
        **{n: cpu(z) for n, z in g.items()},
        initial_state=pool_cpu,
        cu_seqlens=x["cu_seqlens"].cpu(),
        ssm_state_indices=slots.cpu(),
        checkpoint_every_n_tokens=16,
        beta_is_logit=True,
    )[:2]
    assert_output(o_gpu, o_cpu.float())
    assert_close_rms(pool_gpu, pool_cpu, state_tol(state_dtype), "pool vs CPU op")


@cuda_only
def test_chunked_backend_rejects_speculative_decode():
    # The chunked kernel is a prefill kernel: an explicit backend="chunked" with spec tokens is refused
    # (ValueError naming the reason) before anything is written; "auto" runs the token-serial kernel.
    x = make(B=1, T=3, H=1, HV=2, K=128, N_pool=6, seed=23)
    pool = x["initial_state"]
    before = pool.clone()
    idx = torch.arange(3, dtype=torch.int32, device=DEV).view(1, 3)
    with pytest.raises(ValueError, match="speculative"):
        call(tok(x), gkw(x), backend="chunked", initial_state=pool, ssm_state_indices=idx, num_spec_tokens=2)
    assert torch.equal(bits(pool), bits(before))


if __name__ == "__main__":  # pragma: no cover
    raise SystemExit(pytest.main([os.path.abspath(__file__), "-q"]))
