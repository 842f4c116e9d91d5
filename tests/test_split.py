"""The exact sequence split of recurrent_kda prefill (kda_ops/_split.py) on the CPU ops.

The split is forced (``KDA_SEQUENCE_SPLIT=1``, 64-token segments) and compared with the unsplit call of
the same inputs (fp32 tokens: the split only reassociates fp32 products, so tightly) and with the fp64
reference loop (the contract's tolerances), in every gate mode, with a slow-decay channel, one long
sequence among short ones, pools with inactive slots, GQA and V != K.
"""

from __future__ import annotations

import itertools
import math

import pytest
import torch
from conftest import (
    force_split,
    packed_scan_case,
    packed_scan_reference,
    recurrent_call,
    recurrent_reference,
    route_env,
    scan_case,
    scan_reference,
    split_then_unsplit,
    state_only_case,
    state_only_matches,
)

import kda_ops
from kda_ops import _routing, _split, _validate
from kda_ops.reference import rel_rms

K, V = 16, 16


@pytest.fixture(params=["one_pass", "three_pass"])
def split_on(monkeypatch, request):  # type: ignore[no-untyped-def]
    """Forces the split with 64-token segments, on either route (the one-pass route where it applies, or the
    three passes), and counts the split runs."""
    monkeypatch.setattr(_split, "ONE_PASS", request.param == "one_pass")
    return force_split(monkeypatch, 64)


def _inputs(lens, B=1, H=1, HV=2, Vd=V, gate="lower_bound", slow=False, dtype=torch.float32, seed=0):  # type: ignore[no-untyped-def]
    gen = torch.Generator().manual_seed(seed)
    packed = lens is not None
    T = sum(lens) if packed else 200
    Bt = 1 if packed else B

    def rnd(*shape: int, s: float = 1.0) -> torch.Tensor:
        return (torch.randn(*shape, generator=gen) * s).to(dtype)

    x = dict(q=rnd(Bt, T, H, K), k=rnd(Bt, T, H, K), v=rnd(Bt, T, HV, Vd), beta=rnd(Bt, T, HV))
    kw: dict = {}
    if gate == "precomputed":
        g = -torch.nn.functional.softplus(torch.randn(Bt, T, HV, K, generator=gen)) * 0.3
        if slow:
            g[..., 0] = -1e-4  # one channel that barely decays: the state of that channel spans segments
        x["g"] = g.to(dtype)
    else:
        x["g"] = rnd(Bt, T, HV, K)
        A = torch.rand(HV, generator=gen) * 0.5 + 0.1
        dtb = torch.randn(HV, K, generator=gen) * 0.1
        if slow:
            dtb[:, 0] = -30.0  # channel 0 barely decays: sigmoid(exp(A)(g - 30)) ~ 0, softplus(g - 30) ~ 0
        kw.update(A_log=A, dt_bias=dtb, use_gate_in_kernel=True)
        if gate == "lower_bound":
            kw["lower_bound"] = -5.0
    if packed:
        cu = [0]
        for L in lens:
            cu.append(cu[-1] + L)
        kw["cu_seqlens"] = torch.tensor(cu, dtype=torch.int64)
    return x, kw


_call = recurrent_call


def _reference(x, kw, h0, beta_is_logit, l2):  # type: ignore[no-untyped-def]
    return recurrent_reference(x, kw, h0, beta_is_logit=beta_is_logit, use_qk_l2norm_in_kernel=l2)


LONG_AMONG_SHORT = [5, 300, 17, 0, 64, 130, 1]


@pytest.mark.parametrize("gate", ["precomputed", "softplus", "lower_bound"])
@pytest.mark.parametrize("slow", [False, True])
def test_split_matches_unsplit_every_gate(split_on, monkeypatch, gate, slow):  # type: ignore[no-untyped-def]
    x, kw = _inputs(LONG_AMONG_SHORT, gate=gate, slow=slow, seed=1)
    beta_is_logit = gate != "precomputed"
    if not beta_is_logit:
        x["beta"] = torch.sigmoid(x["beta"])
    N = len(LONG_AMONG_SHORT)
    h0 = torch.randn(N, 2, V, K, generator=torch.Generator().manual_seed(5)) * 0.3
    pool_s = h0.clone()
    o_s, _ = _call(x, kw, initial_state=pool_s, output_final_state=True, beta_is_logit=beta_is_logit)
    assert len(split_on) == 1 and split_on[0].maxP == 5  # 300 tokens: 5 segments of 64
    route_env(monkeypatch, KDA_SEQUENCE_SPLIT="0")
    pool_u = h0.clone()
    o_u, _ = _call(x, kw, initial_state=pool_u, output_final_state=True, beta_is_logit=beta_is_logit)
    assert len(split_on) == 1
    assert rel_rms(o_s, o_u) <= 1e-5, rel_rms(o_s, o_u)
    assert rel_rms(pool_s, pool_u) <= 1e-5, rel_rms(pool_s, pool_u)
    r = _reference(x, kw, h0, beta_is_logit, True)
    assert rel_rms(o_s, r.output) <= 5e-3
    assert rel_rms(pool_s, r.final_state) <= 1e-3


def test_split_fixed_layout_no_pool_gqa_v_ne_k(split_on, monkeypatch):  # type: ignore[no-untyped-def]
    """Fixed layout B=3 (viewed as one packed row), GQA (H=1, HV=4), V != K, no pool, no l2 norm."""
    x, kw = _inputs(None, B=3, H=1, HV=4, Vd=8, gate="lower_bound", slow=True, seed=2)
    o_s, f_s = _call(x, kw, output_final_state=True, beta_is_logit=True, use_qk_l2norm_in_kernel=False)
    assert len(split_on) == 1 and split_on[0].nseg == [4, 4, 4]
    route_env(monkeypatch, KDA_SEQUENCE_SPLIT="0")
    o_u, f_u = _call(x, kw, output_final_state=True, beta_is_logit=True, use_qk_l2norm_in_kernel=False)
    assert f_s.dtype == torch.float32 and f_s.shape == f_u.shape
    assert rel_rms(o_s, o_u) <= 1e-5 and rel_rms(f_s, f_u) <= 1e-5
    r = _reference(x, kw, None, True, False)
    assert rel_rms(o_s, r.output) <= 5e-3 and rel_rms(f_s, r.final_state) <= 1e-3


@pytest.mark.parametrize("state_dtype", [torch.float32, torch.bfloat16])
def test_split_pool_slots_inactive_and_output_buffer(split_on, monkeypatch, state_dtype):  # type: ignore[no-untyped-def]
    """ssm_state_indices with inactive sequences (-1, past the pool), a strided pool, a caller output."""
    lens = [200, 3, 150, 70]
    x, kw = _inputs(lens, gate="softplus", seed=3)
    big = torch.randn(6, 2 * V * K + 16, generator=torch.Generator().manual_seed(7)).to(state_dtype)
    slots = torch.tensor([4, -1, 0, 9], dtype=torch.int32)  # sequences 1 and 3 inactive
    res = []
    for mode in ("1", "0"):
        route_env(monkeypatch, KDA_SEQUENCE_SPLIT=mode)
        store = big.clone()
        pool = store[:, : 2 * V * K].view(6, 2, V, K)  # slot stride 2*V*K + 16: padding after each slot
        out = torch.full((1, sum(lens), 2, V), 7.0)
        o, fs = _call(x, kw, initial_state=pool, ssm_state_indices=slots, output=out, output_final_state=True)
        assert o is out and fs is pool
        res.append((out, store))
    assert len(split_on) == 1
    (o_s, st_s), (o_u, st_u) = res
    assert rel_rms(o_s, o_u) <= 1e-5
    assert torch.equal(o_s[0, 200:203], torch.zeros_like(o_s[0, 200:203]))  # inactive: zero output
    assert torch.equal(o_s[0, 353:], torch.zeros_like(o_s[0, 353:]))
    tol = 1e-5 if state_dtype == torch.float32 else 1e-2
    assert rel_rms(st_s, st_u) <= tol
    for s in (1, 2, 3, 5):  # slots no active sequence writes: bit-identical
        assert torch.equal(st_s[s], big[s])
    assert torch.equal(st_s[:, 2 * V * K :], big[:, 2 * V * K :])  # the padding of each slot is never written


def test_split_deterministic(split_on):  # type: ignore[no-untyped-def]
    x, kw = _inputs([260, 40, 190], gate="lower_bound", slow=True, seed=4)
    a = _call(x, kw, output_final_state=True, beta_is_logit=True)
    b = _call(x, kw, output_final_state=True, beta_is_logit=True)
    assert len(split_on) == 2
    assert torch.equal(a[0], b[0]) and torch.equal(a[1], b[1])


@pytest.mark.parametrize("with_pool", [True, False])
def test_split_plan_cache(split_on, monkeypatch, with_pool):  # type: ignore[no-untyped-def]
    """The plan cache: a second call with the same plan and other data is served from the cache and
    matches the unsplit call (no data kept between calls); the cached index tensors are never written;
    other lengths or another segment length make a new plan; the cache is bounded (least recently used
    out)."""
    monkeypatch.setattr(_split, "_plan_cache", type(_split._plan_cache)())
    monkeypatch.setattr(_split, "_PLAN_CACHE_SIZE", 3)
    gen = torch.Generator().manual_seed(21)

    def run(lens, seed):  # type: ignore[no-untyped-def]
        x, kw = _inputs(lens, gate="lower_bound", slow=True, seed=seed)
        N = len(lens)
        base = torch.randn(N + 2, 2, V, K, generator=gen) * 0.3
        slots = torch.tensor([N + 1, -1] + list(range(N - 2)), dtype=torch.int32)  # sequence 1 inactive
        res = []
        for mode in ("1", "0"):
            route_env(monkeypatch, KDA_SEQUENCE_SPLIT=mode)
            extra = dict(initial_state=base.clone(), ssm_state_indices=slots) if with_pool else {}
            o, fs = _call(x, kw, output_final_state=True, **extra)
            res.append((o, fs.clone()))
        (o_s, f_s), (o_u, f_u) = res
        assert rel_rms(o_s, o_u) <= 1e-5 and rel_rms(f_s, f_u) <= 1e-5
        return o_s

    lens = [260, 40, 190, 5]
    o1 = run(lens, seed=22)
    assert len(split_on) == 1
    pl = split_on[0]
    ix = pl
    saved = {n: t.clone() for n, t in vars(ix).items() if isinstance(t, torch.Tensor)}
    assert len(saved) >= 8
    o2 = run(lens, seed=23)  # same plan, other data
    assert len(split_on) == 2 and split_on[1] is pl and len(_split._plan_cache) == 1
    assert not torch.equal(o1, o2)
    for n, t in saved.items():
        assert torch.equal(getattr(ix, n), t), n
    run([260, 40, 191, 5], seed=24)  # other lengths: a new plan
    assert split_on[2] is not pl and split_on[2].lens == [260, 40, 191, 5] and len(_split._plan_cache) == 2
    route_env(monkeypatch, KDA_SEQUENCE_SPLIT_TOKENS=128)
    run(lens, seed=25)  # the same lengths in 128-token segments: a new plan
    assert split_on[3] is not pl and split_on[3].Ls == 128 and len(_split._plan_cache) == 3
    route_env(monkeypatch, KDA_SEQUENCE_SPLIT_TOKENS=64)
    run(lens, seed=26)  # the first plan again (now the most recent)
    assert split_on[4] is pl
    run([300, 40, 190, 5], seed=27)  # a fourth plan evicts the least recently used: [260, 40, 191, 5]
    assert len(_split._plan_cache) == 3
    assert [k[0] for k in _split._plan_cache] == [(260, 40, 190, 5), (260, 40, 190, 5), (300, 40, 190, 5)]


def test_split_falls_back(split_on):  # type: ignore[no-untyped-def]
    """Checkpoints at a period the segments are not a multiple of (48 vs 64-token segments) take the
    unsplit path; short sequences are not split."""
    x, kw = _inputs([300, 20], gate="lower_bound", seed=6)
    _call(x, kw, checkpoint_every_n_tokens=48)
    y, kw2 = _inputs([60, 20], gate="lower_bound", seed=6)
    _call(y, kw2)
    assert split_on == []


def _route(lens, HV=2, on_cuda=True, training=False, multiple=64):  # type: ignore[no-untyped-def]
    """The spine's split route as for device 0 (a CPU build, or no visible GPU: planned as a 132-SM GPU)."""
    return kda_ops._C.route_split(lens, HV, on_cuda, 0, training, multiple)


def test_split_route_auto(monkeypatch):  # type: ignore[no-untyped-def]
    """auto (csrc/kda/route/route.cpp): splits a long sequence on few heads of a CUDA call, not sequences below the
    token floor (8192; training 16384), not wide calls the cost model declines, never on the host."""
    route_env(monkeypatch, KDA_SEQUENCE_SPLIT="auto", KDA_SEQUENCE_SPLIT_TOKENS=None)
    assert _route([65536], HV=8) == 4096
    assert _route([65536], HV=8, on_cuda=False) == 0
    assert _route([8191], HV=2) == 0
    assert _route([8192], HV=64) == 0
    assert _route([12000], HV=4, training=True) == 0
    assert _route([65536], HV=8, training=True) == 4096
    assert _route([65536], HV=8, multiple=192) % 192 == 0
    route_env(monkeypatch, KDA_SEQUENCE_SPLIT_TOKENS=64)  # a forced length, still under the token floor
    assert _route([65536], HV=8) == 64
    assert _route([8191], HV=2) == 0


def test_split_route_device_lengths(monkeypatch):  # type: ignore[no-untyped-def]
    """Lengths only on the device: planned as one sequence of all the tokens; auto only while the call's N·HV chains
    fill at most a quarter of the SMs (132 here), and not below the token floor."""
    route_env(monkeypatch, KDA_SEQUENCE_SPLIT="auto", KDA_SEQUENCE_SPLIT_TOKENS=None)
    dev = kda_ops._C.route_split_device_lengths
    assert dev(65536, 1, 8, True, 0, False, 64) == _route([65536], HV=8) == 4096
    assert dev(16384, 4, 8, True, 0, False, 64) == 1024  # 4 x 4096 packed: 32 chains, four segments each
    assert dev(16384, 5, 8, True, 0, False, 64) == 0  # 40 chains: more than a quarter of the SMs
    assert dev(4096, 1, 4, True, 0, False, 64) == 0  # below the token floor
    assert dev(65536, 1, 8, False, 0, False, 64) == 0  # auto never splits host calls
    route_env(monkeypatch, KDA_SEQUENCE_SPLIT="1")
    assert dev(16384, 9, 8, False, 0, False, 64) == 1024  # forced: any sequence count, any device
    assert dev(300, 5, 2, False, 0, False, 320) == 0  # one segment holds every token


def test_split_route_forced_and_off(monkeypatch):  # type: ignore[no-untyped-def]
    """1: whenever a sequence is longer than one segment, on any device; 0: never."""
    route_env(monkeypatch, KDA_SEQUENCE_SPLIT="1", KDA_SEQUENCE_SPLIT_TOKENS=64)
    assert _route([300], on_cuda=False) == 64
    assert _route([64, 3], on_cuda=False) == 0  # no sequence longer than one segment
    assert _route([300], on_cuda=False, multiple=48) == 0  # 64 is not a multiple of the checkpoint period
    route_env(monkeypatch, KDA_SEQUENCE_SPLIT_TOKENS=None)
    assert _route([65536], HV=8, on_cuda=False) == 4096  # the planned length
    route_env(monkeypatch, KDA_SEQUENCE_SPLIT="0")
    assert _route([65536], HV=8) == 0
    calls = []
    monkeypatch.setattr(_split, "_run", lambda pl, *a: calls.append(pl))
    x, kw = _inputs([300], gate="lower_bound", seed=8)
    _call(x, kw)
    assert calls == []


def test_auto_mode_on_the_host_never_splits(monkeypatch):  # type: ignore[no-untyped-def]
    """auto on CPU tensors: the passes would run one after another, so the split only adds work."""
    route_env(monkeypatch, KDA_SEQUENCE_SPLIT="auto", KDA_SEQUENCE_SPLIT_TOKENS=64)
    calls = []
    monkeypatch.setattr(_split, "_run", lambda pl, *a: calls.append(pl))
    x, kw = _inputs([300], gate="lower_bound", seed=8)
    _call(x, kw)
    assert calls == []
    route_env(monkeypatch, KDA_SEQUENCE_SPLIT="1")
    _call(x, kw)
    assert len(calls) == 1


def test_plan_segments():
    # one sequence, 8 value heads, 132 SMs: 16 segments of 4096 tokens (128 chains)
    assert _routing.plan_segments([65536], 8, 132) == 4096
    # chains never exceed the SMs when segments can be long enough
    for lens, HV in (([65536], 4), ([8192], 32), ([2048] * 8, 16), ([5000, 70, 3, 20000], 2)):
        Ls = _routing.plan_segments(lens, HV, 132)
        assert Ls % 64 == 0
        chains = sum(math.ceil(L / Ls) for L in lens) * HV
        assert chains <= 132 or Ls >= max(lens)
    pl = _split._host_plan([130, 0, 64, 200], 64, 0, torch.device("cpu"))
    assert pl.nseg == [3, 1, 1, 4] and pl.slots == 9
    assert pl.cu.tolist() == [0, 64, 128, 130, 130, 194, 258, 322, 386, 394]
    # one row per segment slot; Q for segments 0 .. nseg-2, P for 1 .. nseg-2, outputs for all
    assert pl.o_rows.tolist() == list(range(9))
    assert pl.q_rows.tolist() == [0, 1, -1, -1, -1, 5, 6, 7, -1]
    assert pl.p_rows.tolist() == [-1, 1, -1, -1, -1, -1, 6, 7, -1]
    assert pl.first.tolist() == [0, 3, 4, 5] and pl.final_rows.tolist() == [2, 3, 4, 8]
    assert pl.seq_of_seg.tolist() == [0, 0, 0, 1, 2, 3, 3, 3, 3]
    # the device form of the same lengths (T = 394 token rows): the same segments, then zero-length padding
    dp = _split._device_plan(torch.tensor([0, 130, 130, 194, 394]), 394, 64, 0)
    pad = dp.slots - 9
    assert dp.slots == 394 // 64 + 4 and pad > 0
    assert dp.cu.tolist() == pl.cu.tolist()[:-1] + [394] * (pad + 1)
    assert dp.o_rows.tolist() == list(range(9)) + [-1] * pad
    assert dp.q_rows.tolist() == pl.q_rows.tolist() + [-1] * pad
    assert dp.p_rows.tolist() == pl.p_rows.tolist() + [-1] * pad
    assert dp.first.tolist() == pl.first.tolist() and dp.count.tolist() == pl.count.tolist()
    # checkpoints every 32 tokens: each segment's first checkpoint row
    ck = _split._host_plan([130, 0, 64, 200], 64, 32, torch.device("cpu")).ck_starts
    assert ck is not None and ck.tolist() == [0, 2, 4, 5, 5, 7, 9, 11, 13, 14]


def test_device_plan_matches_host_plan(split_on, monkeypatch):  # type: ignore[no-untyped-def]
    """A plan made from the cu_seqlens tensor alone (as for lengths that live on the device: T // Ls + N rows,
    zero-length padding) gives the host plan's bits, with a pool, inactive slots and checkpoints."""
    lens = LONG_AMONG_SHORT
    x, kw = _inputs(lens, gate="lower_bound", slow=True, seed=41)
    N = len(lens)
    base = torch.randn(N + 2, 2, V, K, generator=torch.Generator().manual_seed(42)) * 0.3
    slots = torch.tensor([N + 1, -1] + list(range(N - 2)), dtype=torch.int32)
    res = []
    for device_plan in (False, True):
        if device_plan:
            host = _split._host_plan
            monkeypatch.setattr(_split, "_cached_plan", lambda ls, Ls, n_ck, dev: _split._device_plan(
                torch.tensor([0, *itertools.accumulate(ls)]), sum(ls), Ls, n_ck))  # fmt: skip
            assert host is _split._host_plan
        pool = base.clone()
        o, _, ck = _call(x, kw, initial_state=pool, ssm_state_indices=slots, output_final_state=True,
                         checkpoint_every_n_tokens=64)  # fmt: skip
        res.append((o, pool, ck))
    assert len(split_on) == 2 and split_on[1].slots > split_on[0].slots
    for a, b in zip(res[0], res[1], strict=True):
        assert torch.equal(a, b)


@pytest.mark.parametrize("caller_output", [False, True])
def test_split_device_lengths_uncovered_tail(split_on, monkeypatch, caller_output):  # type: ignore[no-untyped-def]
    """Lengths only on the device (the device plan) and token rows past cu_seqlens[-1] (a broken contract): the
    split leaves those rows as the unsplit call does, zeros in an output it allocates, a caller's values in
    ``output``."""
    lens, tail = [5, 300, 17, 0, 130], 70
    x, kw = _inputs(lens, gate="lower_bound", seed=43)
    x = {n: torch.cat([t, torch.randn(1, tail, *t.shape[2:], generator=torch.Generator().manual_seed(44))], 1)
         for n, t in x.items()}  # fmt: skip
    cu, host = kw["cu_seqlens"], _validate.host_values_available
    monkeypatch.setattr(_validate, "host_values_available", lambda t: t is not cu and host(t))
    T = sum(lens) + tail
    if not caller_output:  # the output the op allocates, as uninitialised as torch.empty may leave it
        run = _split._run
        monkeypatch.setattr(_split, "_run", lambda pl, *a, **kw: (a[10].fill_(math.nan), run(pl, *a, **kw))[1])
    res = []
    for mode in ("1", "0"):
        route_env(monkeypatch, KDA_SEQUENCE_SPLIT=mode)
        extra = {"output": torch.full((1, T, 2, V), 7.0)} if caller_output else {}
        o, fs = _call(x, kw, initial_state=torch.ones(len(lens), 2, V, K) * 0.1, output_final_state=True, **extra)
        res.append((o, fs))
    assert len(split_on) == 1 and split_on[0].lens is None
    (o_s, f_s), (o_u, f_u) = res
    assert torch.equal(o_s[0, sum(lens) :], torch.full_like(o_s[0, sum(lens) :], 7.0 if caller_output else 0.0))
    assert torch.equal(o_s[0, sum(lens) :], o_u[0, sum(lens) :])
    assert rel_rms(o_s, o_u) <= 1e-5 and rel_rms(f_s, f_u) <= 1e-5


@pytest.mark.parametrize("cu_values", [[0, 100, 5000], [0, 64, 1000, 2000], [0, 200, 100, 300]])
def test_split_device_lengths_broken_cu_seqlens(split_on, monkeypatch, cu_values):  # type: ignore[no-untyped-def]
    """Lengths only on the device that break the contract (past T, decreasing): the device plan stays within its
    slots (offsets clamped to [0, T], a running maximum), never indexes out of range; offsets past T give the
    unsplit call's results (its clamp rule)."""
    x, kw = _inputs([300], gate="lower_bound", seed=45)
    cu = kw["cu_seqlens"] = torch.tensor(cu_values)
    host = _validate.host_values_available
    monkeypatch.setattr(_validate, "host_values_available", lambda t: t is not cu and host(t))
    N = len(cu_values) - 1
    res = []
    for mode in ("1", "0"):
        route_env(monkeypatch, KDA_SEQUENCE_SPLIT=mode)
        res.append(_call(x, kw, initial_state=torch.ones(N, 2, V, K) * 0.1, output_final_state=True))
    assert len(split_on) == 1 and split_on[0].lens is None
    (o_s, f_s), (o_u, f_u) = res
    assert torch.isfinite(o_s).all() and torch.isfinite(f_s).all()
    if cu_values == sorted(cu_values):
        assert rel_rms(o_s, o_u) <= 1e-5 and rel_rms(f_s, f_u) <= 1e-5


def test_cu_seqlens_cpu_checked():
    x, kw = _inputs([100, 30], gate="lower_bound", seed=9)
    with pytest.raises(ValueError, match="cu_seqlens_cpu must equal cu_seqlens"):
        _call(x, kw, cu_seqlens_cpu=torch.tensor([0, 90, 130]))
    with pytest.raises(TypeError, match="cu_seqlens_cpu"):
        _call(x, kw, cu_seqlens_cpu=torch.tensor([0, 100, 130], dtype=torch.int32))
    with pytest.raises(ValueError, match="cu_seqlens_cpu must end"):
        _call(x, kw, cu_seqlens_cpu=torch.tensor([0, 100, 129]))


@pytest.mark.parametrize("hopper", [False, True])
def test_auto_rule_on_the_benchmark_shapes(hopper):
    """The auto cost model (132 SMs): few heads of a long sequence split, wide or short batches do not. With one
    cost per chain on every grid (the Hopper kernel's, rows128_cost = 1) 32 heads of 8K tokens split too (4
    segments: 3 passes of 2K tokens against 8K), 64 heads do not (2 segments: 2 passes of 4K)."""
    cost = 1.0 if hopper else 1.5  # (the mma.sync kernel's 128-row cost against 64 rows, route.cpp)
    for lens, HV, expect in (
        ([65536], 8, True),
        ([65536], 4, True),
        ([8192], 32, hopper),
        ([8192], 64, False),
        ([8192], 96, False),
        ([2048] * 8, 16, False),
        ([128] * 64, 32, False),
        ([300, 40000, 17], 2, True),
    ):
        Ls = _routing.plan_segments(lens, HV, 132)
        assert _routing.split_pays(lens, HV, 132, Ls, cost) == expect, (lens, HV, Ls)


# ---------------------------------------------------------------------------------------------------
# training (kda_ops.kda): forward and every gradient, split vs unsplit


def _training_case(lens, B=1, T=200, HV=2, dtype=torch.float32, seed=0):  # type: ignore[no-untyped-def]
    x, kw = _inputs(lens, B=B, HV=HV, gate="lower_bound", slow=True, dtype=dtype, seed=seed)
    pdt = torch.float64 if dtype == torch.float64 else torch.float32
    N = len(lens) if lens is not None else B
    gen = torch.Generator().manual_seed(seed + 50)
    extra = dict(
        A_log=kw["A_log"].to(pdt),
        dt_bias=kw["dt_bias"].to(pdt),
        h0=(torch.randn(N, HV, V, K, generator=gen) * 0.3).to(pdt),
        do=torch.randn(x["v"].shape, generator=gen).to(dtype),
        dfinal=torch.randn(N, HV, V, K, generator=gen).to(pdt),
    )
    return x, kw.get("cu_seqlens"), extra


def _training_run(x, cu, e):  # type: ignore[no-untyped-def]
    leaves = {n: x[n].clone().requires_grad_(True) for n in ("q", "k", "v", "g", "beta")}
    A = e["A_log"].clone().requires_grad_(True)
    dtb = e["dt_bias"].clone().requires_grad_(True)
    h0 = e["h0"].clone().requires_grad_(True)
    o, fs = kda_ops.kda(*leaves.values(), A, dtb, h0, cu_seqlens=cu, lower_bound=-5.0, output_final_state=True)
    ((o * e["do"]).sum() + (fs * e["dfinal"]).sum()).backward()
    res = {"o": o.detach(), "fs": fs.detach(), "dA": A.grad, "ddtb": dtb.grad, "dh0": h0.grad}
    res.update({"d" + n: t.grad for n, t in leaves.items()})
    return res


def _matches_unsplit_training(got, x, cu, e, dtype, monkeypatch):  # type: ignore[no-untyped-def]
    """The split training run's results `got` against the same run with the split off."""
    route_env(monkeypatch, KDA_SEQUENCE_SPLIT="0")
    ref = _training_run(x, cu, e)
    tol = 1e-10 if dtype == torch.float64 else 2e-5
    for key in ref:
        assert got[key].shape == ref[key].shape, key
        assert rel_rms(got[key], ref[key]) <= tol, (key, rel_rms(got[key], ref[key]))


@pytest.mark.parametrize(
    "lens,B,dtype",
    [(LONG_AMONG_SHORT, 1, torch.float32), (None, 2, torch.float32), ([130, 257, 3], 1, torch.float64)],
)
def test_training_split_matches_unsplit(split_on, monkeypatch, lens, B, dtype):  # type: ignore[no-untyped-def]
    x, cu, e = _training_case(lens, B=B, dtype=dtype, seed=11)
    got = _training_run(x, cu, e)
    assert len(split_on) == 0  # the prefill counter: the training split has its own path
    _matches_unsplit_training(got, x, cu, e, dtype, monkeypatch)


def test_training_split_runs(split_on, monkeypatch):  # type: ignore[no-untyped-def]
    """kda() takes the split in its forward (torch.ops.kda.kda_forward) and, on its own route, in its backward
    (kda_backward, from the unsplit-layout tapes)."""
    calls, back = [], []
    passes, from_tapes = _split._training_passes, _split.backward_from_tapes
    monkeypatch.setattr(_split, "_training_passes", lambda *a: (calls.append(a[8]), passes(*a))[1])
    monkeypatch.setattr(_split, "backward_from_tapes", lambda *a: (back.append(a[14]), from_tapes(*a))[1])
    x, cu, e = _training_case([300, 20], seed=12)
    _training_run(x, cu, e)
    assert len(calls) == 1 and calls[0].nseg == [5, 1]
    assert len(back) == 1 and back[0].nseg == [5, 1]


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_training_split_scans_one_op_each(split_on, monkeypatch, dtype):  # type: ignore[no-untyped-def]
    """The training split's forward scan and reverse scan are one segment_state_scan each, over the grid
    of all split sequences (rows: segment indices, columns: sequences x heads), with sequences of 11, 4
    and 8 segments among unsplit short ones; forward and gradients match the unsplit call."""
    scans = []
    real = torch.ops.kda.segment_state_scan

    def counting(S, Q, P, first):  # type: ignore[no-untyped-def]
        scans.append((tuple(S.shape), tuple(P.shape), S.dtype, first))
        return real(S, Q, P, first)

    monkeypatch.setattr(torch.ops.kda, "segment_state_scan", counting)
    x, cu, e = _training_case([700, 64, 200, 1, 450, 0], dtype=dtype, seed=19)
    got = _training_run(x, cu, e)
    assert scans == [((11, 3 * 2, V, K), (11, 3 * 2, K, K), dtype, 2), ((11, 3 * 2, V, K), (11, 3 * 2, K, K), dtype, 1)]
    _matches_unsplit_training(got, x, cu, e, dtype, monkeypatch)


@pytest.mark.parametrize("n_ck,tokens", [(32, 64), (64, 64), (48, 0)])
def test_split_checkpoints(split_on, monkeypatch, n_ck, tokens):  # type: ignore[no-untyped-def]
    """Checkpoints every n tokens from the output pass: each segment writes its own rows (n = 48 with the
    automatic plan: segments of a multiple of lcm(64, 48) = 192 tokens)."""
    route_env(monkeypatch, KDA_SEQUENCE_SPLIT_TOKENS=tokens)
    x, kw = _inputs([5, 300, 17, 0, 450], gate="softplus", slow=True, seed=13)
    h0 = torch.randn(5, 2, V, K, generator=torch.Generator().manual_seed(14)) * 0.3
    res = split_then_unsplit(
        monkeypatch,
        lambda: _call(x, kw, initial_state=h0.clone(), output_final_state=True, checkpoint_every_n_tokens=n_ck),
    )
    assert len(split_on) == 1
    (o_s, f_s, ck_s), (o_u, f_u, ck_u) = res
    assert ck_s.shape == ck_u.shape
    for a, b in ((o_s, o_u), (f_s, f_u), (ck_s, ck_u)):
        assert rel_rms(a, b) <= 1e-5, rel_rms(a, b)


@pytest.mark.parametrize("with_pool", [True, False])
def test_split_initial_state_source(split_on, monkeypatch, with_pool):  # type: ignore[no-untyped-def]
    """Start states from a read-only source (an out-of-range index: inactive), results to the pool slots
    or to the returned final state; the source is never written."""
    lens = [260, 30, 200]
    x, kw = _inputs(lens, gate="lower_bound", slow=True, seed=15)
    gen = torch.Generator().manual_seed(16)
    source = torch.randn(4, 2, V, K, generator=gen) * 0.3
    src_idx = torch.tensor([2, 0, 7], dtype=torch.int32)  # sequence 2 inactive (7 >= 4)
    base = torch.randn(3, 2, V, K, generator=gen)
    res = []
    for mode in ("1", "0"):
        route_env(monkeypatch, KDA_SEQUENCE_SPLIT=mode)
        src = source.clone()
        pool = base.clone() if with_pool else None
        o, fs = _call(x, kw, initial_state=pool, initial_state_source=src, initial_state_indices=src_idx,
                      output_final_state=True)  # fmt: skip
        assert torch.equal(src, source)
        res.append((o, fs.clone()))
    assert len(split_on) == 1
    (o_s, f_s), (o_u, f_u) = res
    assert rel_rms(o_s, o_u) <= 1e-5 and rel_rms(f_s, f_u) <= 1e-5
    assert torch.equal(o_s[0, 290:], torch.zeros_like(o_s[0, 290:]))
    assert torch.equal(f_s[2], base[2] if with_pool else torch.zeros_like(f_s[2]))


@pytest.mark.parametrize("lens,B", [([5, 300, 17, 0, 130, 64], 1), (None, 2)])
def test_training_context_split(split_on, monkeypatch, lens, B):  # type: ignore[no-untyped-def]
    """recurrent_kda_training_forward split: outputs, final states and the tapes in the unsplit layout (so
    the unsplit backward runs from them), then recurrent_kda_training_backward from that context."""
    x, cu, e = _training_case(lens, B=B, seed=17)
    host = None if cu is None else cu.clone()
    runs = []
    passes = _split._training_passes
    monkeypatch.setattr(_split, "_training_passes", lambda *a: (runs.append(a[8]), passes(*a))[1])
    res = []
    for mode in ("1", "0"):
        route_env(monkeypatch, KDA_SEQUENCE_SPLIT=mode)
        o, fs, ctx = kda_ops.recurrent_kda_training_forward(
            x["q"], x["k"], x["v"], x["g"], x["beta"], e["A_log"], e["dt_bias"], e["h0"], cu_seqlens=cu,
            lower_bound=-5.0, cu_seqlens_cpu=host,
        )  # fmt: skip
        grads = kda_ops.recurrent_kda_training_backward(ctx, e["do"], e["dfinal"])
        res.append((o, fs, ctx.tapes, ctx.tape_cu_starts, grads))
    assert len(runs) == 1 and runs[0].maxP >= 4
    (o_s, f_s, t_s, st_s, g_s), (o_u, f_u, t_u, st_u, g_u) = res
    assert torch.equal(st_s, st_u) and t_s.shape == t_u.shape
    for a, b in ((o_s, o_u), (f_s, f_u), (t_s, t_u), *zip(g_s, g_u, strict=True)):
        assert rel_rms(a, b) <= 2e-5, rel_rms(a, b)


def test_split_bf16_checkpoints_without_pool(split_on, monkeypatch):  # type: ignore[no-untyped-def]
    """A caller's bf16 state_checkpoints buffer without a pool (the op writes fp32 checkpoints, rounded into
    the caller's buffer afterwards): the split writes and returns the caller's buffer, as the unsplit call."""
    x, kw = _inputs([300, 20], gate="lower_bound", slow=True, seed=17)
    route_env(monkeypatch, KDA_SEQUENCE_SPLIT="0")
    _, _, ck0 = _call(x, kw, checkpoint_every_n_tokens=64)
    res = []
    for mode in ("1", "0"):
        route_env(monkeypatch, KDA_SEQUENCE_SPLIT=mode)
        buf = torch.zeros(ck0.shape, dtype=torch.bfloat16)
        _, _, ck = _call(x, kw, checkpoint_every_n_tokens=64, state_checkpoints=buf)
        assert ck is buf
        res.append(buf)
    assert len(split_on) == 1
    assert res[0].abs().sum() > 0
    assert rel_rms(res[0].float(), ck0) <= 1e-2 and rel_rms(res[0].float(), res[1].float()) <= 1e-2


# ---------------------------------------------------------------------------------------------------
# state-only calls (a 1-D empty output): the split's end-state passes


def test_state_only_call_cpu():
    state_only_matches("cpu")  # (conftest; the GPU tier runs it on CUDA per backend)


def test_state_only_output_shape_checked():
    """Only a 1-D empty output means state-only; another empty or wrong shape is rejected, pool untouched."""
    from _raw_ops import raw_recurrent

    x, cu, pool, slots = state_only_case("cpu")
    tok = (x["q"], x["k"], x["v"], x["g"], x["beta"])
    for bad in (x["v"].new_empty(0, 1), x["v"].new_empty(1, 0, 2, K), torch.empty_like(x["v"][:, 1:])):
        p = pool.clone()
        with pytest.raises(ValueError, match="output must have the shape of v"):
            raw_recurrent(*tok, state=p, ssm_state_indices=slots, cu_seqlens=cu, gate_mode=0, output=bad)
        assert torch.equal(p, pool)


# ---------------------------------------------------------------------------------------------------
# the scan of segment start states (torch.ops.kda.segment_state_scan)


@pytest.mark.parametrize("J,Bt,Vd,Kd,first", [(6, 3, 5, 4, 2), (1, 2, 3, 3, 2), (4, 1, 16, 16, 1), (9, 2, 7, 11, 3)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_segment_state_scan_cpu(J, Bt, Vd, Kd, first, dtype):  # type: ignore[no-untyped-def]
    S, Q, P = (x.to(dtype) for x in scan_case(J, Bt, Vd, Kd, "cpu"))
    want = scan_reference(S, Q, P, first)
    S0 = S.clone()
    torch.ops.kda.segment_state_scan(S, Q, P, first)
    assert torch.equal(S[:first], S0[:first])  # inputs untouched
    tol = 1e-5 if dtype == torch.float32 else 1e-12
    assert rel_rms(S, want.to(dtype)) < tol


def test_segment_state_scan_errors():
    S, Q, P = scan_case(4, 2, 3, 5, "cpu")
    for args, msg in [
        ((S, Q[:, :1], P, 2), "Q must have the shape of S"),
        ((S, Q, P[..., :4], 2), "P must be"),
        ((S, Q, P, 0), "first must be >= 1"),
        ((S, Q.double(), P, 2), "share one dtype"),
        ((S.transpose(2, 3), Q.transpose(2, 3), P, 2), "P must be"),
    ]:
        before = S.clone()
        with pytest.raises((ValueError, TypeError), match=msg):
            torch.ops.kda.segment_state_scan(*args)
        assert torch.equal(S, before)


def test_segment_state_scan_contiguity():
    S, Q, P = scan_case(4, 2, 5, 5, "cpu")  # V == K: a transposed S keeps the shape
    for args, name in [((S.transpose(2, 3), Q, P, 2), "S"), ((S, Q.transpose(2, 3), P, 2), "Q"),
                       ((S, Q, P.transpose(2, 3), 2), "P")]:  # fmt: skip
        before = args[0].clone()
        with pytest.raises(ValueError, match=f"{name} must be contiguous"):
            torch.ops.kda.segment_state_scan(*args)
        assert torch.equal(args[0], before)


def test_segment_state_scan_opcheck():
    S, Q, P = scan_case(5, 2, 4, 4, "cpu")
    torch.library.opcheck(torch.ops.kda.segment_state_scan.default, (S, Q, P, 2))


@pytest.mark.parametrize(
    "counts,HV,Vd,Kd", [([3, 1, 5, 2], 2, 5, 4), ([1, 1], 3, 3, 3), ([6], 1, 16, 16), ([0, 4], 2, 7, 11)]
)
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_segment_state_scan_packed_cpu(counts, HV, Vd, Kd, dtype):  # type: ignore[no-untyped-def]
    """The packed scan: per sequence, S of its second segment = Q of its first, then the recurrence; the first
    segments' states and the unused slots untouched (NaN transitions of first segments are never read)."""
    S, Q, P, first, count = packed_scan_case(counts, HV, Vd, Kd, "cpu")
    S, Q, P = S.to(dtype), Q.to(dtype), P.to(dtype)
    P.index_fill_(0, first, float("nan"))
    want = packed_scan_reference(S, Q, P, first, count)
    S0 = S.clone()
    torch.ops.kda.segment_state_scan_packed(S, Q, P, first, count)
    assert torch.equal(S[first], S0[first]) and torch.equal(S[-2:], S0[-2:])
    tol = 1e-5 if dtype == torch.float32 else 1e-12
    assert rel_rms(S, want.to(dtype)) < tol


def test_segment_state_scan_packed_errors_and_opcheck():
    S, Q, P, first, count = packed_scan_case([2, 3], 2, 4, 4, "cpu")
    for args, msg in [
        ((S, Q, P, first.int(), count), "int64"),
        ((S, Q, P, first, count[:1]), "one length"),
        ((S, Q[:, :1], P, first, count), "Q must have the shape of S"),
    ]:
        before = S.clone()
        with pytest.raises((ValueError, TypeError), match=msg):
            torch.ops.kda.segment_state_scan_packed(*args)
        assert torch.equal(S, before)
    torch.library.opcheck(torch.ops.kda.segment_state_scan_packed.default, (S, Q, P, first, count))
