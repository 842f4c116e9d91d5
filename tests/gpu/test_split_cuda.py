"""GPU tier: the exact sequence split of recurrent_kda prefill (kda_ops/_split.py) on the CUDA chunked
kernel, against the unsplit call and kda_ops.reference (fp64 token loop), K = V = 128, bf16 tokens.

The split is forced (``KDA_SEQUENCE_SPLIT=1``) with a fixed segment length or the automatic plan. Every gate
mode, a slow-decay channel (the start state then matters across every segment), one long sequence among
short and zero-length ones, pools with inactive slots, a caller output, determinism. Tolerances are the
contract's (tests/conftest.py): outputs 5e-3 relative RMS, fp32 states 1e-3, bf16 states 1e-2.

KDA_SPLIT_TEST_DEVICE=cpu runs the same checks on the CPU op (a check of the harness without a GPU):
    KDA_SPLIT_TEST_DEVICE=cpu PYTHONPATH=tests python -m pytest tests/gpu/test_split_cuda.py --noconftest -q
"""

from __future__ import annotations

import os

import pytest
import torch
from conftest import (
    TOL_OUT,
    TOL_STATE_BF16,
    TOL_STATE_FP32,
    assert_close_rms,
    force_split,
    lengths_to_cu,
    packed_scan_case,
    packed_scan_reference,
    recurrent_call,
    recurrent_reference,
    route_env,
    scan_case,
    scan_reference,
    split_then_unsplit,
    state_only_matches,
)

import kda_ops
from kda_ops import _split

DEV = os.environ.get("KDA_SPLIT_TEST_DEVICE", "cuda")
pytestmark = [pytest.mark.gpu] if DEV == "cuda" else []
cuda_only = pytest.mark.skipif(DEV != "cuda" or not torch.cuda.is_available(), reason="CUDA-specific")
K = 128


@pytest.fixture(params=["one_pass", "three_pass"])
def split_on(monkeypatch, request):  # type: ignore[no-untyped-def]
    """Forces the split with 512-token segments, on either route (the one-pass route where it applies, or the
    three passes), and counts the split runs."""
    if request.param == "one_pass" and DEV == "cuda" and not kda_ops._routing.knobs()["experiments_built"]:
        pytest.skip("the one-pass split's fix-up kernel is an experiment (KDA_BUILD_EXPERIMENTS=1)")
    monkeypatch.setattr(_split, "ONE_PASS", request.param == "one_pass")
    return force_split(monkeypatch, 512)


def make(lens, HV=2, H=1, gate="lower_bound", slow=False, seed=0, B=1, T=None, Kd=K):  # type: ignore[no-untyped-def]
    gen = torch.Generator().manual_seed(seed)
    packed = lens is not None
    T = sum(lens) if packed else T
    Bt = 1 if packed else B

    def rnd(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=gen).to(torch.bfloat16).to(DEV)

    x = dict(q=rnd(Bt, T, H, Kd), k=rnd(Bt, T, H, Kd), v=rnd(Bt, T, HV, Kd), beta=rnd(Bt, T, HV))
    kw: dict = {}
    if gate == "precomputed":
        g = -torch.nn.functional.softplus(torch.randn(Bt, T, HV, Kd, generator=gen)) * 0.3
        if slow:
            g[..., :2] = -1e-4
        x["g"] = g.to(torch.bfloat16).to(DEV)
        x["beta"] = torch.sigmoid(x["beta"].float()).to(torch.bfloat16)
    else:
        x["g"] = rnd(Bt, T, HV, Kd)
        dtb = torch.randn(HV, Kd, generator=gen) * 0.1
        if slow:
            dtb[:, :2] = -30.0  # channels 0 and 1 barely decay
        kw.update(
            A_log=(torch.rand(HV, generator=gen) * 0.5 + 0.1).to(DEV),
            dt_bias=dtb.to(DEV),
            use_gate_in_kernel=True,
            beta_is_logit=True,
        )
        if gate == "lower_bound":
            kw["lower_bound"] = -5.0
    if packed:
        cu = lengths_to_cu(lens)
        kw["cu_seqlens"] = cu.to(DEV)
        kw["cu_seqlens_cpu"] = cu
    return x, kw


call = recurrent_call
reference = recurrent_reference


LONG_AMONG_SHORT = [300, 4096, 17, 0, 1000, 1, 64]


@pytest.mark.parametrize("gate", ["precomputed", "softplus", "lower_bound"])
@pytest.mark.parametrize("slow", [False, True])
def test_split_vs_unsplit_and_reference(split_on, monkeypatch, gate, slow):  # type: ignore[no-untyped-def]
    x, kw = make(LONG_AMONG_SHORT, gate=gate, slow=slow, seed=1)
    N = len(LONG_AMONG_SHORT)
    h0 = (torch.randn(N, 2, K, K, generator=torch.Generator().manual_seed(3)) * 0.3).to(DEV)
    pool_s = h0.clone()
    o_s, _ = call(x, kw, initial_state=pool_s, output_final_state=True)
    assert len(split_on) == 1 and split_on[0].nseg[1] == 8 and split_on[0].nseg[4] == 2
    route_env(monkeypatch, KDA_SEQUENCE_SPLIT="0")
    pool_u = h0.clone()
    o_u, _ = call(x, kw, initial_state=pool_u, output_final_state=True)
    assert_close_rms(o_s, o_u, TOL_OUT, "split vs unsplit output")
    assert_close_rms(pool_s, pool_u, TOL_STATE_FP32, "split vs unsplit final state")
    r = reference(x, kw, h0)
    assert_close_rms(o_s, r.output, TOL_OUT, "split output vs reference")
    assert_close_rms(pool_s, r.final_state, TOL_STATE_FP32, "split final state vs reference")


def test_split_automatic_plan_fixed_layout(monkeypatch):  # type: ignore[no-untyped-def]
    """MODE=1 with the segment length from the shapes: one 8192-token sequence, HV=2, no pool."""
    route_env(monkeypatch, KDA_SEQUENCE_SPLIT="1")
    route_env(monkeypatch, KDA_SEQUENCE_SPLIT_TOKENS=0)
    x, kw = make(None, T=8192, gate="lower_bound", slow=True, seed=2)
    o_s, f_s = call(x, kw, output_final_state=True)
    route_env(monkeypatch, KDA_SEQUENCE_SPLIT="0")
    o_u, f_u = call(x, kw, output_final_state=True)
    assert_close_rms(o_s, o_u, TOL_OUT, "output")
    assert_close_rms(f_s, f_u, TOL_STATE_FP32, "final state")
    r = reference(x, kw, None)
    assert_close_rms(f_s, r.final_state, TOL_STATE_FP32, "final state vs reference")


def test_split_bf16_pool_inactive_slots_output_buffer(split_on, monkeypatch):  # type: ignore[no-untyped-def]
    lens = [2000, 3, 1500, 700]
    x, kw = make(lens, gate="softplus", seed=4)
    base = (torch.randn(6, 2, K, K, generator=torch.Generator().manual_seed(5)) * 0.3).to(torch.bfloat16).to(DEV)
    slots = torch.tensor([4, -1, 0, 9], dtype=torch.int32, device=DEV)
    res = []
    for mode in ("1", "0"):
        route_env(monkeypatch, KDA_SEQUENCE_SPLIT=mode)
        pool = base.clone()
        out = torch.full((1, sum(lens), 2, K), 7.0, dtype=torch.bfloat16, device=DEV)
        o, fs = call(x, kw, initial_state=pool, ssm_state_indices=slots, output=out, output_final_state=True)
        assert o is out and fs is pool
        res.append((out, pool))
    assert len(split_on) == 1
    (o_s, p_s), (o_u, p_u) = res
    assert_close_rms(o_s, o_u, TOL_OUT, "output")
    assert torch.equal(o_s[0, 2000:2003], torch.zeros_like(o_s[0, 2000:2003]))
    assert torch.equal(o_s[0, 3503:], torch.zeros_like(o_s[0, 3503:]))
    assert_close_rms(p_s, p_u, TOL_STATE_BF16, "pool")
    for s in (1, 2, 3, 5):
        assert torch.equal(p_s[s], base[s])


def test_split_deterministic(split_on):  # type: ignore[no-untyped-def]
    x, kw = make(LONG_AMONG_SHORT, gate="lower_bound", slow=True, seed=6)
    a = call(x, kw, output_final_state=True)
    b = call(x, kw, output_final_state=True)
    assert len(split_on) == 2
    assert torch.equal(a[0], b[0]) and torch.equal(a[1], b[1])


@cuda_only  # (auto never splits host calls)
def test_auto_splits_long_few_heads(monkeypatch):  # type: ignore[no-untyped-def]
    """auto: a 32768-token sequence on 2 value heads is split (and agrees with the unsplit call); 64
    value heads of 2048 tokens are not."""
    route_env(monkeypatch, KDA_SEQUENCE_SPLIT="auto")
    route_env(monkeypatch, KDA_SEQUENCE_SPLIT_TOKENS=0)
    calls = []
    run = _split._run
    monkeypatch.setattr(_split, "_run", lambda pl, *a: (calls.append(pl), run(pl, *a)))
    x, kw = make(None, T=32768, gate="lower_bound", slow=True, seed=7)
    o_s, f_s = call(x, kw, output_final_state=True)
    assert len(calls) == 1
    route_env(monkeypatch, KDA_SEQUENCE_SPLIT="0")
    o_u, f_u = call(x, kw, output_final_state=True)
    assert_close_rms(o_s, o_u, TOL_OUT, "output")
    assert_close_rms(f_s, f_u, TOL_STATE_FP32, "final state")
    route_env(monkeypatch, KDA_SEQUENCE_SPLIT="auto")
    y, kw2 = make(None, T=2048, HV=64, H=64, gate="lower_bound", seed=8)
    call(y, kw2)
    assert len(calls) == 1


def _capture(fn):  # type: ignore[no-untyped-def]
    """fn() captured into a CUDA graph on a side stream (the usual warm-up is the caller's eager call)."""
    graph = torch.cuda.CUDAGraph()
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s), torch.cuda.graph(graph, stream=s):
        fn()
    torch.cuda.current_stream().wait_stream(s)
    return graph


def _device_lengths(kw: dict) -> dict:
    """The call as engines make it: cu_seqlens on the device only (no host mirror)."""
    return {k: v for k, v in kw.items() if k != "cu_seqlens_cpu"}


@cuda_only
@pytest.mark.parametrize("auto", [False, True])
def test_packed_split_with_device_lengths(split_on, monkeypatch, auto):  # type: ignore[no-untyped-def]
    """cu_seqlens only on the device: the split plans on the device (T // Ls + N rows) and agrees with the unsplit
    call and the reference; auto (the spine's plan for even lengths) splits a long sequence on two heads too."""
    if auto:
        route_env(monkeypatch, KDA_SEQUENCE_SPLIT="auto", KDA_SEQUENCE_SPLIT_TOKENS=None)
    lens = [9000, 300, 0, 5000] if auto else LONG_AMONG_SHORT
    x, kw = make(lens, gate="lower_bound", slow=True, seed=51)
    kw = _device_lengths(kw)
    N = len(lens)
    h0 = (torch.randn(N, 2, K, K, generator=torch.Generator().manual_seed(52)) * 0.3).to(DEV)
    pool_s = h0.clone()
    o_s, _ = call(x, kw, initial_state=pool_s, output_final_state=True)
    assert len(split_on) == 1 and split_on[0].lens is None
    route_env(monkeypatch, KDA_SEQUENCE_SPLIT="0")
    pool_u = h0.clone()
    o_u, _ = call(x, kw, initial_state=pool_u, output_final_state=True)
    assert_close_rms(o_s, o_u, TOL_OUT, "split vs unsplit output")
    assert_close_rms(pool_s, pool_u, TOL_STATE_FP32, "split vs unsplit final state")
    r = reference(x, kw, h0)
    assert_close_rms(o_s, r.output, TOL_OUT, "split output vs reference")
    assert_close_rms(pool_s, r.final_state, TOL_STATE_FP32, "split final state vs reference")


@cuda_only
def test_packed_split_under_graph_capture_new_lengths(split_on):  # type: ignore[no-untyped-def]
    """A packed call captured (cold: no eager call first) splits inside the graph with its plan made on the
    device; replays with new cu_seqlens values (other lengths, an empty sequence, a pool) follow them and agree
    with the reference."""
    T, N = 6000, 3
    x, kw = make([4000, 1500, 500], gate="lower_bound", slow=True, seed=53)
    kw = _device_lengths(kw)
    cu = kw["cu_seqlens"]
    out = torch.zeros((1, T, 2, K), dtype=torch.bfloat16, device=DEV)
    pool = torch.zeros(N, 2, K, K, device=DEV)
    graph = _capture(lambda: call(x, dict(kw, output=out, initial_state=pool)))
    assert len(split_on) == 1 and split_on[0].lens is None
    gen = torch.Generator().manual_seed(54)
    for seed, lens in ((55, [100, 5000, 900]), (56, [6000, 0, 0]), (57, [2500, 0, 3500])):
        _fill_(x, seed)
        cu.copy_(lengths_to_cu(lens).to(DEV))
        h0 = (torch.randn(N, 2, K, K, generator=gen) * 0.3).to(DEV)
        pool.copy_(h0)
        graph.replay()
        torch.cuda.synchronize()
        r = reference(x, dict(kw, cu_seqlens=lengths_to_cu(lens).to(DEV)), h0)
        assert_close_rms(out, r.output, TOL_OUT, f"replayed split output vs reference, lengths {lens}")
        assert_close_rms(pool, r.final_state, TOL_STATE_FP32, f"replayed split final state, lengths {lens}")
    assert len(split_on) == 1


def _fill_(x: dict, seed: int) -> None:
    """New random values in the same input buffers (a graph replays on what they hold)."""
    y, _ = make(None, T=x["q"].shape[1], B=x["q"].shape[0], HV=x["v"].shape[2], gate="lower_bound", seed=seed)
    for name in x:
        x[name].copy_(y[name])


@cuda_only
@pytest.mark.parametrize("pool", [False, True])
def test_fixed_split_under_graph_capture(split_on, pool):  # type: ignore[no-untyped-def]
    """A fixed-layout call splits inside the graph (after an eager warm-up of the same shapes); replays on new
    inputs (and new start states in the pool) give the eager split's bits and agree with the reference."""
    B, T, HV = 2, 1536, 2
    x, kw = make(None, B=B, T=T, HV=HV, gate="lower_bound", seed=21)
    out = torch.empty((B, T, HV, K), dtype=torch.bfloat16, device=DEV)
    gen = torch.Generator().manual_seed(22)
    h = torch.zeros(B, HV, K, K, device=DEV) if pool else None

    def run():  # type: ignore[no-untyped-def]
        args = dict(kw, output=out, output_final_state=True)
        if h is not None:
            args["initial_state"] = h
        return call(x, args)

    run()  # eager warm-up (split)
    assert len(split_on) == 1
    captured: list = []
    graph = _capture(lambda: captured.append(run()))
    assert len(split_on) == 2, "the captured call did not split"
    for seed in (31, 32):
        _fill_(x, seed)
        h0 = (torch.randn(B, HV, K, K, generator=gen) * 0.1).to(DEV) if pool else None
        if h is not None:
            h.copy_(h0)
        graph.replay()
        torch.cuda.synchronize()
        got_out = out.clone()
        got_fs = (h if h is not None else captured[0][1]).clone()
        if h is not None:
            h.copy_(h0)
        _, fs_eager = run()
        torch.cuda.synchronize()
        assert len(split_on) == 3 + (seed - 31)
        assert torch.equal(got_out, out), "captured split vs eager split: outputs differ"
        assert torch.equal(got_fs, fs_eager), "captured split vs eager split: final states differ"
        r = reference(x, kw, h0)
        assert_close_rms(got_out, r.output, TOL_OUT, "captured split output vs reference")
        assert_close_rms(got_fs, r.final_state, TOL_STATE_FP32, "captured split final state vs reference")


@cuda_only
def test_cold_capture_splits(split_on, monkeypatch):  # type: ignore[no-untyped-def]
    """Captured with no eager call of those shapes before: the plan is made inside the graph, and right."""
    monkeypatch.setattr(_split, "_plan_cache", type(_split._plan_cache)())
    x, kw = make(None, B=1, T=2048, HV=2, gate="lower_bound", seed=23)
    out = torch.zeros((1, 2048, 2, K), dtype=torch.bfloat16, device=DEV)
    graph = _capture(lambda: call(x, kw, output=out))
    assert len(split_on) == 1 and len(_split._plan_cache) == 0
    graph.replay()
    torch.cuda.synchronize()
    assert_close_rms(out, reference(x, kw, None).output, TOL_OUT, "cold capture (split) vs reference")


@cuda_only
def test_capture_does_not_cache_past_the_split(split_on):  # type: ignore[no-untyped-def]
    """Capture leaves the eager path as it was: eager calls of the same shapes after a capture still split
    and give the first eager call's bits (fixed layout, which the validation cache serves)."""
    x, kw = make(None, B=1, T=4096, gate="lower_bound", seed=19)
    out = torch.empty((1, 4096, 2, K), dtype=torch.bfloat16, device=DEV)
    call(x, kw, output=out)
    first = out.clone()
    assert len(split_on) == 1
    _capture(lambda: call(x, kw, output=out))
    n = len(split_on)
    for _ in range(2):
        call(x, kw, output=out)
    torch.cuda.synchronize()
    assert len(split_on) == n + 2
    assert torch.equal(out, first)


def _kda_run(x, kw, h0, do, dfinal):  # type: ignore[no-untyped-def]
    leaves = {n: x[n].clone().requires_grad_(True) for n in ("q", "k", "v", "g", "beta")}
    A = kw["A_log"].clone().requires_grad_(True)
    dtb = kw["dt_bias"].clone().requires_grad_(True)
    h = h0.clone().requires_grad_(True)
    o, fs = kda_ops.kda(*leaves.values(), A, dtb, h, lower_bound=-5.0, output_final_state=True)
    ((o.float() * do.float()).sum() + (fs * dfinal).sum()).backward()
    res = {"o": o.detach(), "fs": fs.detach(), "dA_log": A.grad, "ddt_bias": dtb.grad, "dh0": h.grad}
    res.update({"d" + n: t.grad for n, t in leaves.items()})
    return res


@pytest.mark.parametrize("Kd", [128, 64])
def test_training_split_vs_unsplit(split_on, monkeypatch, Kd):  # type: ignore[no-untyped-def]
    """kda_ops.kda (training forward + backward) split into 512-token segments, fixed layout B=2; K = V = 64 runs
    the 128-channel kernels on zero-padded copies in every pass."""
    x, kw = make(None, B=2, T=2048, gate="lower_bound", slow=True, seed=10, Kd=Kd)
    gen = torch.Generator().manual_seed(11)
    h0 = (torch.randn(2, 2, Kd, Kd, generator=gen) * 0.3).to(DEV)
    do = torch.randn(x["v"].shape, generator=gen).to(torch.bfloat16).to(DEV)
    dfinal = torch.randn(2, 2, Kd, Kd, generator=gen).to(DEV)
    got = _kda_run(x, kw, h0, do, dfinal)
    again = _kda_run(x, kw, h0, do, dfinal)
    route_env(monkeypatch, KDA_SEQUENCE_SPLIT="0")
    ref = _kda_run(x, kw, h0, do, dfinal)
    for key in ref:
        tol = TOL_OUT if key == "o" else (TOL_STATE_FP32 if key == "fs" else 1e-2)
        assert_close_rms(got[key], ref[key], tol, key)
        assert torch.equal(got[key], again[key]), key  # deterministic


@pytest.mark.parametrize("n_ck", [64, 256])
def test_split_checkpoints_across_segments(split_on, monkeypatch, n_ck):  # type: ignore[no-untyped-def]
    """Checkpoints every n tokens written by the output pass, each segment at its own rows."""
    x, kw = make(LONG_AMONG_SHORT, gate="lower_bound", slow=True, seed=12)
    N = len(LONG_AMONG_SHORT)
    h0 = (torch.randn(N, 2, K, K, generator=torch.Generator().manual_seed(13)) * 0.3).to(DEV)
    res = split_then_unsplit(
        monkeypatch,
        lambda: call(x, kw, initial_state=h0.clone(), output_final_state=True, checkpoint_every_n_tokens=n_ck),
    )
    assert len(split_on) == 1
    (o_s, f_s, ck_s), (o_u, f_u, ck_u) = res
    assert_close_rms(o_s, o_u, TOL_OUT, "output")
    assert_close_rms(f_s, f_u, TOL_STATE_FP32, "final state")
    assert_close_rms(ck_s, ck_u, TOL_STATE_FP32, "checkpoints")


def test_split_initial_state_source(split_on, monkeypatch):  # type: ignore[no-untyped-def]
    lens = [3000, 30, 2000]
    x, kw = make(lens, gate="lower_bound", slow=True, seed=14)
    gen = torch.Generator().manual_seed(15)
    source = (torch.randn(4, 2, K, K, generator=gen) * 0.3).to(DEV)
    src_idx = torch.tensor([2, 0, 7], dtype=torch.int32, device=DEV)  # sequence 2 inactive
    res = []
    for mode in ("1", "0"):
        route_env(monkeypatch, KDA_SEQUENCE_SPLIT=mode)
        src = source.clone()
        o, fs = call(x, kw, initial_state_source=src, initial_state_indices=src_idx, output_final_state=True)
        assert torch.equal(src, source)
        res.append((o, fs))
    assert len(split_on) == 1
    (o_s, f_s), (o_u, f_u) = res
    assert_close_rms(o_s, o_u, TOL_OUT, "output")
    assert_close_rms(f_s, f_u, TOL_STATE_FP32, "final state")
    assert torch.equal(o_s[0, 3030:], torch.zeros_like(o_s[0, 3030:]))
    assert torch.equal(f_s[2], torch.zeros_like(f_s[2]))


def test_training_context_split(split_on, monkeypatch):  # type: ignore[no-untyped-def]
    """recurrent_kda_training_forward split (packed, cu_seqlens_cpu): tapes in the unsplit layout, and the
    unsplit backward from them."""
    lens = [300, 2048, 0, 1000]
    x, kw = make(lens, gate="lower_bound", slow=True, seed=16)
    gen = torch.Generator().manual_seed(17)
    h0 = (torch.randn(4, 2, K, K, generator=gen) * 0.3).to(DEV)
    do = torch.randn(x["v"].shape, generator=gen).to(torch.bfloat16).to(DEV)
    dfinal = torch.randn(4, 2, K, K, generator=gen).to(DEV)
    res = []
    for mode in ("1", "0"):
        route_env(monkeypatch, KDA_SEQUENCE_SPLIT=mode)
        o, fs, ctx = kda_ops.recurrent_kda_training_forward(
            x["q"], x["k"], x["v"], x["g"], x["beta"], kw["A_log"], kw["dt_bias"], h0, cu_seqlens=kw["cu_seqlens"],
            lower_bound=-5.0, cu_seqlens_cpu=kw["cu_seqlens_cpu"],
        )  # fmt: skip
        grads = kda_ops.recurrent_kda_training_backward(ctx, do, dfinal)
        res.append((o, fs, ctx.tapes, ctx.tape_cu_starts, grads))
    (o_s, f_s, t_s, st_s, g_s), (o_u, f_u, t_u, st_u, g_u) = res
    assert torch.equal(st_s, st_u)
    assert_close_rms(o_s, o_u, TOL_OUT, "output")
    assert_close_rms(f_s, f_u, TOL_STATE_FP32, "final state")
    assert_close_rms(t_s, t_u, TOL_STATE_FP32, "tapes")
    for name, a, b in zip(kda_ops.interface.GRAD_NAMES, g_s, g_u, strict=True):
        assert_close_rms(a, b, 1e-2, name)


@cuda_only
@pytest.mark.parametrize("backend", [0, 1, 2])
@pytest.mark.parametrize("HV", [2, 80])
def test_state_only_call_cuda(backend, HV):  # type: ignore[no-untyped-def]
    """A state-only call (1-D empty output): the chunked kernel's state-only variant (VB=64 at HV=2, VB=128 at
    HV=80) and the token-serial kernels' scratch output give the pool and final states of the call with an
    output, bit for bit; inactive and unwritten slots untouched."""
    state_only_matches("cuda", K=K, dtype=torch.bfloat16, backend=backend, HV=HV)


@cuda_only
@pytest.mark.parametrize("J,Bt,Vd,Kd,first", [(33, 4, 128, 128, 2), (17, 8, 64, 64, 2), (5, 3, 20, 128, 1)])
def test_segment_state_scan_cuda(J, Bt, Vd, Kd, first):  # type: ignore[no-untyped-def]
    """The one-launch CUDA scan against the fp64 loop (fp32 sums in another order: 1e-5), deterministic."""
    from kda_ops.reference import rel_rms

    S, Q, P = scan_case(J, Bt, Vd, Kd, "cuda", seed=J)
    want = scan_reference(S.cpu(), Q.cpu(), P.cpu(), first)
    S0 = S.clone()
    torch.ops.kda.segment_state_scan(S, Q, P, first)
    assert torch.equal(S[:first], S0[:first])
    assert rel_rms(S.cpu(), want.float()) < 1e-5
    S2 = S0.clone()
    torch.ops.kda.segment_state_scan(S2, Q, P, first)
    assert torch.equal(S, S2)


@cuda_only
@pytest.mark.parametrize("counts,HV,Vd,Kd", [([33, 1, 5, 0, 2], 4, 128, 128), ([1, 17], 8, 64, 64), ([4], 3, 20, 128)])
def test_segment_state_scan_packed_cuda(counts, HV, Vd, Kd):  # type: ignore[no-untyped-def]
    """The packed scan's kernel against the fp64 loop (1e-5), deterministic; first segments and unused slots
    untouched, NaN transitions of first segments never read."""
    from kda_ops.reference import rel_rms

    S, Q, P, first, count = packed_scan_case(counts, HV, Vd, Kd, "cuda", seed=len(counts))
    P.index_fill_(0, first, float("nan"))
    want = packed_scan_reference(S.cpu(), Q.cpu(), P.cpu(), first.cpu(), count.cpu())
    S0 = S.clone()
    torch.ops.kda.segment_state_scan_packed(S, Q, P, first, count)
    assert torch.equal(S[first], S0[first]) and torch.equal(S[-2:], S0[-2:])
    assert rel_rms(S.cpu(), want.float()) < 1e-5
    S2 = S0.clone()
    torch.ops.kda.segment_state_scan_packed(S2, Q, P, first, count)
    assert torch.equal(S, S2)
