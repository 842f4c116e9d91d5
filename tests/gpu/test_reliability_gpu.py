"""GPU tier of the reliability suite (docs/contract.md "API", "Errors", "Tolerances"): CUDA graph reuse, a 10
000-call stress
run with memory accounting, and size limits (64-bit offsets, more than 65535 sequences x heads).

The device-neutral parts are parametrized on CUDA in the CPU tier: tests/test_guard_bands.py,
test_device_contracts.py (broken contracts), test_determinism.py, test_validation_catalogue.py.

- Graphs: each call is captured once after eager warm-up, then replayed 6 times with new values copied
  into the static buffers (tokens, indices with -1, cu_seqlens with empty rows, accepted counts), with
  other tensors allocated, NaN-filled and freed between replays. Every replay must equal an eager call
  on the same values bit for bit, and padding rows (index -1, NaN tokens) must never change valid rows:
  the valid rows equal an eager call on the valid rows alone, bit for bit (rows are independent and the
  kernels are deterministic, docs/contract.md "Tolerances").
- Stress: ``KDA_STRESS_CALLS`` (default 10 000) mixed calls; every 50th checked against the fp64
  reference (docs/contract.md "Tolerances", tests/conftest.py); allocated memory after the run equals the baseline
  and the peak stays within the warm-up peak (report in the test output and, when the directory exists,
  in ``$KDA_RESULTS_DIR`` or /tmp/kda_results/reliability_stress.json).
- Size limits: token tensors of more than 2^31 elements; an fp32 pool of more than 2^31 elements written
  by speculative decode and prefill; 66 000 and 70 000 sequences (x 2 heads) in one call equal to split
  calls bit for bit.

KDA_RELIABILITY_TEST_DEVICE=cpu runs the harness of the stress test on the CPU op (no graphs, no big
sizes): a check of the test code itself.
"""

from __future__ import annotations

import json
import os
import random
import time

import pytest
import torch
from _builders import STATS, StressState, raw_bytes, stress_call
from conftest import assert_close_rms, assert_output, capture_graph, lengths_to_cu, state_tol

import kda_ops
from kda_ops.reference import recurrent_kda_reference

DEV = os.environ.get("KDA_RELIABILITY_TEST_DEVICE", "cuda")
pytestmark = [pytest.mark.gpu] if DEV == "cuda" else []
cuda_only = pytest.mark.skipif(DEV != "cuda" or not torch.cuda.is_available(), reason="CUDA-specific")
R = kda_ops.recurrent_kda


@pytest.fixture(scope="module", autouse=True)
def _report_counts():
    yield
    keys = ("graph_replays_compared", "stress_calls", "stress_checked")
    if any(STATS[k] for k in keys):
        print("\n[reliability-gpu] " + ", ".join(f"{k}={STATS[k]}" for k in keys))


GATE = dict(use_gate_in_kernel=True, lower_bound=-5.0, beta_is_logit=True)


def _same(a: torch.Tensor, b: torch.Tensor, what: str) -> None:
    assert a.shape == b.shape and a.dtype == b.dtype, f"{what}: {a.shape} {a.dtype} vs {b.shape} {b.dtype}"
    assert torch.equal(raw_bytes(a), raw_bytes(b)), f"{what}: differs bitwise"


def _tokens(gen: torch.Generator, B: int, T: int, H: int, HV: int, K: int) -> dict[str, torch.Tensor]:
    def rnd(*shape):
        return torch.randn(*shape, generator=gen).to(torch.bfloat16).to(DEV)

    return dict(q=rnd(B, T, H, K), k=rnd(B, T, H, K), v=rnd(B, T, HV, K), g=rnd(B, T, HV, K), beta=rnd(B, T, HV))


def _params(gen: torch.Generator, HV: int, K: int) -> dict[str, torch.Tensor]:
    return dict(
        A_log=(torch.rand(HV, generator=gen) * 0.5).to(DEV), dt_bias=(torch.randn(HV, K, generator=gen) * 0.1).to(DEV)
    )


def _churn(i: int) -> None:
    """Allocate, NaN-fill and free other tensors between replays: a graph that wrongly kept a pointer to
    memory it does not own (an eager-planned buffer freed later, a temporary) would read NaN or
    scribble over these."""
    keep = []
    for j in range(5):
        t = torch.empty((j + 1) * (i + 1) * 65536 + 37 * j, device=DEV)
        t.fill_(float("nan"))
        keep.append(t)
    del keep[::2]
    big = torch.full((1 << 22,), float("nan"), device=DEV)
    del big
    torch.cuda.synchronize()


_capture = capture_graph  # (tests/conftest.py)


def _clone(d: dict) -> dict:
    return {n: (t.clone() if isinstance(t, torch.Tensor) else t) for n, t in d.items()}


REPLAYS = 6
# Eager comparison calls get their own workspace: re-planning the captured one for other shapes could
# free the buffer the graph replays into.
FRESH = kda_ops.RecurrentKDAPrefillWorkspace


# ---------------------------------------------------------------------------------------------------
# CUDA graphs


@cuda_only
@pytest.mark.parametrize("pool_dtype", [torch.bfloat16, torch.float32])
def test_graph_decode_replays(pool_dtype):
    """Fixed-layout decode captured once; 6 replays with new tokens, new slots (padding rows: slot -1 and
    NaN tokens) and new pool contents."""
    B, H, HV, K, n_pool = 8, 2, 4, 128, 20
    gen = torch.Generator().manual_seed(1)
    static = dict(**_tokens(gen, B, 1, H, HV, K), idx=torch.arange(B, dtype=torch.int32, device=DEV))
    params = _params(gen, HV, K)
    pool = (torch.randn(n_pool, HV, K, K, generator=gen) * 0.1).to(pool_dtype).to(DEV)
    out = torch.empty(B, 1, HV, K, dtype=torch.bfloat16, device=DEV)
    ws = kda_ops.RecurrentKDAPrefillWorkspace()

    def run(d, pool_, out_, ws_=ws):
        tok = {n: d[n] for n in ("q", "k", "v", "g", "beta")}
        return R(
            **tok, **params, **GATE, initial_state=pool_, ssm_state_indices=d["idx"], output=out_, prefill_workspace=ws_
        )

    graph = _capture(lambda: run(static, pool, out))
    rng = random.Random(2)
    for i in range(REPLAYS):
        new = _tokens(gen, B, 1, H, HV, K)
        slots = rng.sample(range(n_pool), B)
        pad = sorted(rng.sample(range(B), rng.randint(1, 3)))
        for r in pad:
            slots[r] = -1
            for n in new:
                new[n][r] = float("nan")
        new["idx"] = torch.tensor(slots, dtype=torch.int32, device=DEV)
        pool_i = (torch.randn(n_pool, HV, K, K, generator=gen) * 0.1).to(pool_dtype).to(DEV)
        for n, t in new.items():
            static[n].copy_(t)
        pool.copy_(pool_i)
        out.fill_(float("nan"))
        _churn(i)
        graph.replay()
        torch.cuda.synchronize()
        got_o, got_pool = out.clone(), pool.clone()

        e_pool, e_out = pool_i.clone(), torch.empty_like(out)
        run(_clone(new), e_pool, e_out, FRESH())
        _same(got_o, e_out, f"replay {i}: output vs eager")
        _same(got_pool, e_pool, f"replay {i}: pool vs eager")

        valid = [r for r in range(B) if r not in pad]
        v_pool = pool_i.clone()
        vd = {n: t[valid].contiguous() for n, t in new.items()}
        o_v, _ = run(vd, v_pool, torch.empty(len(valid), 1, HV, K, dtype=torch.bfloat16, device=DEV), FRESH())
        _same(got_o[valid], o_v, f"replay {i}: valid rows vs a call without the padding rows")
        _same(got_pool, v_pool, f"replay {i}: pool vs a call without the padding rows")
        assert torch.count_nonzero(got_o[pad].float()) == 0, "padding rows (slot -1) must have zero output"
        STATS["graph_replays_compared"] += 1


@cuda_only
def test_graph_spec_decode_replays():
    """Packed speculative decode (S=3) captured once; replays with new accepted counts (0..S+2, clamped),
    new slot rows with -1 tokens, a padding sequence (all slots -1, NaN tokens)."""
    S, N, H, HV, K, n_pool = 3, 6, 1, 2, 128, 40
    T = N * (1 + S)
    gen = torch.Generator().manual_seed(3)
    static = dict(
        **_tokens(gen, 1, T, H, HV, K),
        cu=(torch.arange(N + 1, dtype=torch.int64) * (1 + S)).to(DEV),
        idx=torch.arange(N * (1 + S), dtype=torch.int32, device=DEV).view(N, 1 + S),
        acc=torch.ones(N, dtype=torch.int32, device=DEV),
    )
    params = _params(gen, HV, K)
    pool = (torch.randn(n_pool, HV, K, K, generator=gen) * 0.1).to(DEV)
    out = torch.empty(1, T, HV, K, dtype=torch.bfloat16, device=DEV)
    ws = kda_ops.RecurrentKDAPrefillWorkspace()

    def run(d, pool_, out_, ws_=ws):
        tok = {n: d[n] for n in ("q", "k", "v", "g", "beta")}
        return R(
            **tok,
            **params,
            **GATE,
            initial_state=pool_,
            cu_seqlens=d["cu"],
            ssm_state_indices=d["idx"],
            num_spec_tokens=S,
            num_accepted_tokens=d["acc"],
            output=out_,
            prefill_workspace=ws_,
        )

    graph = _capture(lambda: run(static, pool, out))
    rng = random.Random(4)
    for i in range(REPLAYS):
        new = _tokens(gen, 1, T, H, HV, K)
        slots = rng.sample(range(n_pool), N * (1 + S))
        for j in rng.sample(range(N * (1 + S)), 3):
            slots[j] = -1  # inactive tokens (or a whole inactive sequence when it is the read slot)
        padded = rng.randrange(N)
        slots[padded * (1 + S) : (padded + 1) * (1 + S)] = [-1] * (1 + S)
        for n in new:
            new[n][:, padded * (1 + S) : (padded + 1) * (1 + S)] = float("nan")
        new["idx"] = torch.tensor(slots, dtype=torch.int32, device=DEV).view(N, 1 + S)
        new["acc"] = torch.tensor([rng.randint(0, S + 2) for _ in range(N)], dtype=torch.int32, device=DEV)
        new["cu"] = static["cu"].clone()
        pool_i = (torch.randn(n_pool, HV, K, K, generator=gen) * 0.1).to(DEV)
        for n, t in new.items():
            static[n].copy_(t)
        pool.copy_(pool_i)
        out.fill_(float("nan"))
        _churn(i)
        graph.replay()
        torch.cuda.synchronize()
        got_o, got_pool = out.clone(), pool.clone()

        e_pool, e_out = pool_i.clone(), torch.empty_like(out)
        run(_clone(new), e_pool, e_out, FRESH())
        _same(got_o, e_out, f"replay {i}: output vs eager")
        _same(got_pool, e_pool, f"replay {i}: pool vs eager")

        valid = [n for n in range(N) if n != padded]
        toks = [t for n in valid for t in range(n * (1 + S), (n + 1) * (1 + S))]
        vd = {n: new[n][:, toks].contiguous() for n in ("q", "k", "v", "g", "beta")}
        vd.update(
            cu=(torch.arange(N, dtype=torch.int64) * (1 + S)).to(DEV),
            idx=new["idx"][valid].contiguous(),
            acc=new["acc"][valid].contiguous(),
        )
        v_pool = pool_i.clone()
        o_v, _ = run(vd, v_pool, torch.empty(1, len(toks), HV, K, dtype=torch.bfloat16, device=DEV), FRESH())
        _same(got_o[:, toks], o_v, f"replay {i}: valid sequences vs a call without the padding sequence")
        _same(got_pool, v_pool, f"replay {i}: pool vs a call without the padding sequence")
        pad_toks = list(range(padded * (1 + S), (padded + 1) * (1 + S)))
        assert torch.count_nonzero(got_o[:, pad_toks].float()) == 0
        STATS["graph_replays_compared"] += 1


def _random_lengths(rng: random.Random, N: int, T: int, n_empty: int) -> list[int]:
    """N lengths summing to T with at least n_empty zero-length rows."""
    cuts = sorted(rng.randint(0, T) for _ in range(N - 1 - n_empty))
    nz = [b - a for a, b in zip([0, *cuts], [*cuts, T], strict=True)]
    lengths = nz + [0] * n_empty
    rng.shuffle(lengths)
    return lengths


@cuda_only
@pytest.mark.parametrize("ckpt", [0, 16])
def test_graph_packed_prefill_replays(ckpt):
    """Packed prefill with int64 cu_seqlens, a prefill_workspace, an output buffer (and checkpoint buffers)
    captured once; replays with new boundaries (empty rows included), new slots and a NaN padding sequence."""
    N, T, H, HV, K, n_pool = 6, 150, 1, 2, 128, 12
    gen = torch.Generator().manual_seed(5)
    rng = random.Random(6)
    lengths0 = _random_lengths(rng, N, T, 1)
    static = dict(
        **_tokens(gen, 1, T, H, HV, K),
        cu=lengths_to_cu(lengths0, device=DEV),
        idx=torch.arange(N, dtype=torch.int32, device=DEV),
    )
    params = _params(gen, HV, K)
    pool = (torch.randn(n_pool, HV, K, K, generator=gen) * 0.1).to(torch.bfloat16).to(DEV)
    out = torch.empty(1, T, HV, K, dtype=torch.bfloat16, device=DEV)
    ws = kda_ops.RecurrentKDAPrefillWorkspace()
    rows = T // 16 + N
    ck_kw = {}
    if ckpt:
        static["starts"] = torch.zeros(N + 1, dtype=torch.int64, device=DEV)
        ck_kw = dict(state_checkpoints=torch.empty(rows, HV, K, K, dtype=torch.bfloat16, device=DEV))

    def starts_of(lengths):
        return lengths_to_cu([(L + ckpt - 1) // ckpt for L in lengths], device=DEV)

    def run(d, pool_, out_, ck=None, ws_=ws, backend="auto"):
        tok = {n: d[n] for n in ("q", "k", "v", "g", "beta")}
        extra = {"backend": backend}
        if ckpt:
            extra.update(checkpoint_every_n_tokens=ckpt, checkpoint_cu_starts=d["starts"], state_checkpoints=ck)
        return R(
            **tok,
            **params,
            **GATE,
            initial_state=pool_,
            cu_seqlens=d["cu"],
            ssm_state_indices=d["idx"],
            output=out_,
            prefill_workspace=ws_,
            **extra,
        )

    routed = "chunked" if T >= 16 * N else "recurrent"  # what backend="auto" runs for this shape (K = 128)
    if ckpt:
        static["starts"].copy_(starts_of(lengths0))
    graph = _capture(lambda: run(static, pool, out, ck_kw.get("state_checkpoints")))
    for i in range(REPLAYS):
        lengths = _random_lengths(rng, N, T, 1 + i % 3)
        cu = [0]
        for L in lengths:
            cu.append(cu[-1] + L)
        padded = max(range(N), key=lambda n: lengths[n])  # a non-empty padding sequence
        new = _tokens(gen, 1, T, H, HV, K)
        for n in new:
            new[n][:, cu[padded] : cu[padded + 1]] = float("nan")
        slots = rng.sample(range(n_pool), N)
        slots[padded] = -1
        new.update(
            cu=torch.tensor(cu, dtype=torch.int64, device=DEV), idx=torch.tensor(slots, dtype=torch.int32, device=DEV)
        )
        if ckpt:
            new["starts"] = starts_of(lengths)
        pool_i = (torch.randn(n_pool, HV, K, K, generator=gen) * 0.1).to(torch.bfloat16).to(DEV)
        for n, t in new.items():
            static[n].copy_(t)
        pool.copy_(pool_i)
        out.fill_(float("nan"))
        if ckpt:
            ck_kw["state_checkpoints"].fill_(float("nan"))
        _churn(i)
        graph.replay()
        torch.cuda.synchronize()
        got_o, got_pool = out.clone(), pool.clone()
        got_ck = ck_kw["state_checkpoints"].clone() if ckpt else None

        e_pool, e_out = pool_i.clone(), torch.full_like(out, float("nan"))
        e_ck = torch.full_like(got_ck, float("nan")) if ckpt else None
        run(_clone(new), e_pool, e_out, e_ck, FRESH())
        _same(got_o, e_out, f"replay {i}: output vs eager")
        _same(got_pool, e_pool, f"replay {i}: pool vs eager")
        if ckpt:
            _same(got_ck, e_ck, f"replay {i}: checkpoints vs eager")

        valid = [n for n in range(N) if n != padded]
        toks = [t for n in valid for t in range(cu[n], cu[n + 1])]
        vl = [lengths[n] for n in valid]
        vd = {n: new[n][:, toks].contiguous() for n in ("q", "k", "v", "g", "beta")}
        vd.update(cu=lengths_to_cu(vl, device=DEV), idx=new["idx"][valid].contiguous())
        v_ck = None
        if ckpt:
            vd["starts"] = starts_of(vl)
            v_ck = torch.full((int(vd["starts"][-1]), HV, K, K), float("nan"), dtype=torch.bfloat16, device=DEV)
        v_pool = pool_i.clone()
        # Same kernel as the captured call: backend="auto" picks by the call's shape (T >= 16 N: chunked), and
        # dropping the padding sequence can move the remainder to the other kernel. This checks isolation.
        res_v = run(
            vd,
            v_pool,
            torch.empty(1, len(toks), HV, K, dtype=torch.bfloat16, device=DEV),
            v_ck,
            FRESH(),
            backend=routed,
        )
        _same(got_o[:, toks], res_v[0], f"replay {i}: valid sequences vs a call without the padding sequence")
        _same(got_pool, v_pool, f"replay {i}: pool vs a call without the padding sequence")
        if ckpt:
            s_all, s_val = new["starts"].tolist(), vd["starts"].tolist()
            for j, n in enumerate(valid):
                _same(got_ck[s_all[n] : s_all[n + 1]], v_ck[s_val[j] : s_val[j + 1]], f"replay {i}: checkpoints")
        assert torch.count_nonzero(got_o[:, cu[padded] : cu[padded + 1]].float()) == 0
        STATS["graph_replays_compared"] += 1


# Packed calls whose output the public API allocates (torch.empty, then the op zeroes only the tokens no
# sequence covers, from cu_seqlens on the device). (T, cu_seqlens values per replay), one fixed N per
# case; no two sequences overlap (the comparisons are bitwise). First and last values keep the contract.
ALLOCATED_CASES = {
    "prefill": (
        256,
        [
            [0, 100, 100, 200, 256],
            [10, 100, 150, 200, 230],  # cu[0] > 0 and cu[N] < T: tokens 0-9 and 230-255 belong to no sequence
            [200, 256, 0, 50, 120],  # non-monotone: covers [200, 256), [0, 50), [50, 120); [120, 200) is a gap
            [0, 64, 128, 192, 256],
        ],
    ),
    "decode": (
        8,
        [
            [0, 1, 2, 3, 4, 5, 6, 7, 8],
            [0, 1, 2, 3, 4, 5, 6, 6, 6],  # the last two sequences empty: tokens 6, 7 uncovered
            [3, 4, 5, 6, 7, 8, 0, 1, 2],  # non-monotone: token 2 uncovered
            [0, 1, 2, 3, 4, 5, 6, 7, 8],
        ],
    ),
}


def _covered(cu: list[int], T: int) -> torch.Tensor:
    """[T] bool (CPU): some sequence covers the token, by the clamp rule of kda::seq_range."""
    m = torch.zeros(T, dtype=torch.bool)
    for n in range(len(cu) - 1):
        a = min(max(cu[n], 0), T)
        m[a : min(max(cu[n + 1], a), T)] = True
    return m


def _dirty_allocator(nbytes: int) -> None:
    """Leave NaN bytes in the caching allocator's free blocks of this size, so that a torch.empty of it
    that is not fully written shows NaN instead of zeros left over from earlier tests."""
    junk = [torch.full((nbytes // 2,), float("nan"), dtype=torch.bfloat16, device=DEV) for _ in range(4)]
    torch.cuda.synchronize()
    del junk


@cuda_only
@pytest.mark.parametrize("backend", ["recurrent", "chunked"])
@pytest.mark.parametrize("case", sorted(ALLOCATED_CASES))
def test_allocated_packed_output_outside_every_sequence(case, backend):
    """Public API, packed, cu_seqlens on the device (its values are not checked on the host, so a broken
    contract reaches the kernels): with output=None the tokens no sequence covers read +0.0 and the
    others equal a call into a caller's buffer bit for bit; that caller's buffer keeps its uncovered tokens."""
    T, cus = ALLOCATED_CASES[case]
    if case == "decode" and backend == "chunked":
        pytest.skip("the chunked backend is a prefill path (sequences average >= 16 tokens under auto)")
    H, HV, K = 1, 2, 128
    gen = torch.Generator().manual_seed(21)
    tok, params = _tokens(gen, 1, T, H, HV, K), _params(gen, HV, K)
    for cu in cus:
        cov = _covered(cu, T)
        cu_t = torch.tensor(cu, dtype=torch.int64, device=DEV)
        _dirty_allocator(T * HV * K * 2)
        o, _ = R(**tok, **params, **GATE, cu_seqlens=cu_t, backend=backend)
        mine = torch.full((1, T, HV, K), float("nan"), dtype=torch.bfloat16, device=DEV)
        R(**tok, **params, **GATE, cu_seqlens=cu_t, output=mine, backend=backend)
        torch.cuda.synchronize()
        o, mine = o.cpu(), mine.cpu()
        assert torch.count_nonzero(raw_bytes(o[:, ~cov])) == 0, f"cu={cu}: uncovered tokens must read +0.0"
        assert torch.isnan(mine[:, ~cov].float()).all(), f"cu={cu}: a caller's output changed outside the sequences"
        assert torch.isfinite(o[:, cov].float()).all(), f"cu={cu}: a covered token was not written"
        _same(o[:, cov], mine[:, cov], f"cu={cu}: covered tokens, allocated vs caller's output")


@cuda_only
@pytest.mark.parametrize("case", sorted(ALLOCATED_CASES))
def test_graph_packed_allocated_output_replays(case):
    """A packed call with output=None captured in a CUDA graph (the output lives in the graph's pool; the
    zeroing of uncovered tokens is captured as a kernel that reads cu_seqlens on the device). Replays with
    new cu_seqlens values, the output NaN-filled before each: uncovered tokens read +0.0 every time (also
    after a replay that covered them) and the replay equals an eager call bit for bit."""
    T, cus = ALLOCATED_CASES[case]
    H, HV, K = 1, 2, 128
    gen = torch.Generator().manual_seed(22)
    static = dict(**_tokens(gen, 1, T, H, HV, K), cu=torch.tensor(cus[0], dtype=torch.int64, device=DEV))
    params = _params(gen, HV, K)
    ws = kda_ops.RecurrentKDAPrefillWorkspace()
    held: dict[str, torch.Tensor] = {}

    def run(d, ws_=ws):
        tok = {n: d[n] for n in ("q", "k", "v", "g", "beta")}
        return R(**tok, **params, **GATE, cu_seqlens=d["cu"], prefill_workspace=ws_)[0]

    graph = _capture(lambda: held.__setitem__("out", run(static)))  # the last call is the captured one
    out = held["out"]
    for i, cu in enumerate(cus[1:] + cus[:1]):
        cov = _covered(cu, T)
        static["cu"].copy_(torch.tensor(cu, dtype=torch.int64))
        out.fill_(float("nan"))
        _churn(i)
        graph.replay()
        torch.cuda.synchronize()
        got = out.cpu()
        assert torch.count_nonzero(raw_bytes(got[:, ~cov])) == 0, f"replay {i} cu={cu}: uncovered tokens not zero"
        assert torch.isfinite(got.float()).all(), f"replay {i} cu={cu}: a token was not written"
        _dirty_allocator(got.numel() * 2)
        _same(got, run(_clone(static), FRESH()).cpu(), f"replay {i} cu={cu}: output vs eager")
        STATS["graph_replays_compared"] += 1


@cuda_only
def test_graph_recurrent_kda_backward_replays():
    """recurrent_kda_backward with a workspace, eight out buffers and int32 cu_seqlens captured once;
    replays with new tokens, new upstream gradients and new boundaries equal eager calls bit for bit."""
    if not torch._C._dispatch_has_kernel_for_dispatch_key("kda::recurrent_kda_backward", "CUDA"):
        pytest.skip("CUDA training ops not built")
    N, T, H, HV, K = 4, 150, 1, 2, 128
    gen = torch.Generator().manual_seed(7)
    rng = random.Random(8)
    static = dict(
        **_tokens(gen, 1, T, H, HV, K),
        h0=(torch.randn(N, HV, K, K, generator=gen) * 0.1).to(DEV),
        do=torch.randn(1, T, HV, K, generator=gen).to(torch.bfloat16).to(DEV),
        dS=(torch.randn(N, HV, K, K, generator=gen) * 0.1).to(DEV),
        cu=lengths_to_cu(_random_lengths(rng, N, T, 1), device=DEV, dtype=torch.int32),
    )
    params = _params(gen, HV, K)
    shapes = [(1, T, H, K), (1, T, H, K), (1, T, HV, K), (1, T, HV, K), (1, T, HV), (HV,), (HV, K), (N, HV, K, K)]
    dts = [torch.bfloat16] * 5 + [torch.float32] * 3
    outs = [torch.empty(s, dtype=d, device=DEV) for s, d in zip(shapes, dts, strict=True)]
    ws = kda_ops.RecurrentKDABackwardWorkspace()

    def run(d, outs_, ws_=ws):
        tok = {n: d[n] for n in ("q", "k", "v", "g", "beta")}
        return kda_ops.recurrent_kda_backward(
            **tok,
            **params,
            initial_state=d["h0"],
            do=d["do"],
            dfinal_state=d["dS"],
            cu_seqlens=d["cu"],
            workspace=ws_,
            out=outs_,
        )

    try:
        run(static, outs)
    except NotImplementedError as e:
        pytest.skip(f"recurrent_kda_backward not implemented on CUDA: {e}")
    graph = _capture(lambda: run(static, outs))
    for i in range(REPLAYS):
        new = dict(
            **_tokens(gen, 1, T, H, HV, K),
            h0=(torch.randn(N, HV, K, K, generator=gen) * 0.1).to(DEV),
            do=torch.randn(1, T, HV, K, generator=gen).to(torch.bfloat16).to(DEV),
            dS=(torch.randn(N, HV, K, K, generator=gen) * 0.1).to(DEV),
            cu=lengths_to_cu(_random_lengths(rng, N, T, i % 2), device=DEV, dtype=torch.int32),
        )
        for n, t in new.items():
            static[n].copy_(t)
        for o in outs:
            o.fill_(float("nan"))
        _churn(i)
        graph.replay()
        torch.cuda.synchronize()
        got = [o.clone() for o in outs]
        eager = run(_clone(new), [torch.empty_like(o) for o in outs], kda_ops.RecurrentKDABackwardWorkspace())
        for j, (a, b) in enumerate(zip(got, eager, strict=True)):
            _same(a, b, f"replay {i}: gradient {j} vs eager")
            assert torch.isfinite(a.float()).all()
        STATS["graph_replays_compared"] += 1


# ---------------------------------------------------------------------------------------------------
# stress


def _results_dir() -> str | None:
    d = os.environ.get("KDA_RESULTS_DIR", "/tmp/kda_results")
    return d if os.path.isdir(d) else None


def test_stress_mixed_calls():
    """KDA_STRESS_CALLS (default 10 000) random decode / prefill / packed / speculative calls on persistent
    pools, every 50th against the fp64 reference; no error, no leak, a stable peak."""
    calls = int(os.environ.get("KDA_STRESS_CALLS", "10000"))
    on_cuda = DEV == "cuda"
    s = StressState(DEV, K_choices=(64, 128) if on_cuda else (4, 8), seed=2024)
    s.make_all_pools()
    prewarm = min(50, calls // 4)  # lazy one-time initialisations happen here, outside the accounting
    for _ in range(prewarm):
        stress_call(s, check=False)
    warm = max(1, min(1000, calls // 10))
    t0 = time.time()
    if on_cuda:
        torch.cuda.synchronize()
        base = torch.cuda.memory_allocated()
        torch.cuda.reset_peak_memory_stats()
    for i in range(warm):
        stress_call(s, check=i % 50 == 0)
    if on_cuda:
        torch.cuda.synchronize()
        after_warm = torch.cuda.memory_allocated()
        peak_warm = torch.cuda.max_memory_allocated()
        torch.cuda.reset_peak_memory_stats()
    for i in range(warm, calls - prewarm):
        stress_call(s, check=i % 50 == 0)
    if on_cuda:
        torch.cuda.synchronize()
    secs = time.time() - t0
    report = dict(calls=s.stats["calls"], checked=s.stats["checked"], tokens=s.stats["tokens"], seconds=round(secs, 1))
    report.update({k: v for k, v in s.stats.items() if k.startswith("mode_")})
    for p in s.pools.values():
        assert torch.isfinite(p.float()).all(), "a pool holds non-finite values after the stress run"
    report["max_abs_state"] = max(float(p.float().abs().max()) for p in s.pools.values())
    if on_cuda:
        end = torch.cuda.memory_allocated()
        peak_rest = torch.cuda.max_memory_allocated()
        report.update(
            allocated_baseline=base,
            allocated_after_warmup=after_warm,
            allocated_end=end,
            peak_warmup=peak_warm,
            peak_after_warmup=peak_rest,
        )
    print("\n[stress] " + json.dumps(report))
    d = _results_dir()
    if d:
        with open(os.path.join(d, "reliability_stress.json"), "w") as f:
            json.dump(report, f, indent=1)
    STATS["stress_calls"] += s.stats["calls"]
    STATS["stress_checked"] += s.stats["checked"]
    assert s.stats["calls"] == calls
    if on_cuda:
        assert after_warm == base, f"allocated memory grew during warm-up: {base} -> {after_warm} bytes"
        assert end == base, f"allocated memory leaked: {base} -> {end} bytes"
        transient = peak_warm - base
        assert peak_rest <= peak_warm + max(
            transient // 4, 32 << 20
        ), f"peak allocated grew after warm-up: {peak_warm} -> {peak_rest} bytes (baseline {base})"


# ---------------------------------------------------------------------------------------------------
# size limits


def _need_free(nbytes: int) -> None:
    if DEV != "cuda":
        pytest.skip("CUDA size test")
    free = torch.cuda.mem_get_info()[0]
    if free < nbytes:
        pytest.skip(f"needs {nbytes / 2**30:.1f} GiB of free GPU memory, {free / 2**30:.1f} GiB free")


def _ref_seq(tok: dict, params: dict, start: torch.Tensor, **kw):
    """fp64 reference of one sequence on the device (long loops are cheaper there)."""
    return recurrent_kda_reference(
        **tok, **params, initial_state=start, use_gate_in_kernel=True, lower_bound=-5.0, beta_is_logit=True, **kw
    )


def big_token_case(N: int, L: int, H: int, HV: int, K: int, check: list[int]) -> int:
    """Packed prefill of N sequences of L tokens (T = N*L) on a bf16 pool; the listed sequences are
    compared with the fp64 reference. Returns q.numel()."""
    T = N * L
    gen = torch.Generator(device=DEV).manual_seed(10)

    def rnd(*shape):
        return torch.randn(*shape, generator=gen, device=DEV, dtype=torch.bfloat16)

    tok = dict(q=rnd(1, T, H, K), k=rnd(1, T, H, K), v=rnd(1, T, HV, K), g=rnd(1, T, HV, K), beta=rnd(1, T, HV))
    params = dict(A_log=torch.rand(HV, device=DEV) * 0.5, dt_bias=torch.randn(HV, K, device=DEV) * 0.1)
    pool = (torch.randn(N, HV, K, K, generator=gen, device=DEV) * 0.1).to(torch.bfloat16)
    starts = {n: pool[n].clone() for n in check}
    cu = (torch.arange(N + 1, dtype=torch.int64) * L).to(DEV)
    o, _ = R(**tok, **params, **GATE, initial_state=pool, cu_seqlens=cu)
    for n in check:
        sl = slice(n * L, (n + 1) * L)
        r = _ref_seq({k_: t[:, sl] for k_, t in tok.items()}, params, starts[n][None])
        assert_output(o[:, sl], r.output, f"sequence {n} (first token at element {n * L * H * K} of q)")
        assert_close_rms(pool[n], r.final_state[0], state_tol(torch.bfloat16), f"slot {n}")
    return tok["q"].numel()


@cuda_only
def test_token_tensors_past_2_31_elements():
    """q, k, v, g and the output hold 2.16e9 elements each (T = 528384 tokens x 32 heads x 128): the first,
    a middle and the last sequence (whose tokens lie past element 2^31) match the reference."""
    N, L, H, HV, K = 516, 1024, 32, 32, 128
    T = N * L
    _need_free(int(5.3 * T * HV * K * 2) + (N * HV * K * K * 2))
    numel = big_token_case(N, L, H, HV, K, check=[0, N // 2, N - 1])
    assert numel > 2**31
    torch.cuda.empty_cache()


def big_pool_case(n_pool: int, HV: int, K: int) -> int:
    """An fp32 pool of n_pool slots: speculative decode and a prefill that read and write slots past
    element 2^31; every other slot stays zero."""
    gen = torch.Generator(device=DEV).manual_seed(11)
    pool = torch.zeros(n_pool, HV, K, K, device=DEV)
    H = HV // 4
    params = dict(A_log=torch.rand(HV, device=DEV) * 0.5, dt_bias=torch.randn(HV, K, device=DEV) * 0.1)
    # speculative decode, S = 2: rows of write slots; start slots clamp(accepted - 1, 0, 2)
    S = 2
    rows = [[n_pool - 1, n_pool - 2, n_pool - 3], [n_pool - 4, 2, n_pool - 5], [0, 1, n_pool - 6]]
    acc = [1, 3, 2]
    read = [r[min(max(a - 1, 0), S)] for r, a in zip(rows, acc, strict=True)]
    for s_ in read:
        pool[s_] = torch.randn(HV, K, K, generator=gen, device=DEV) * 0.1
    start = torch.stack([pool[s_].clone() for s_ in read])
    tok = {
        n: torch.randn(*sh, generator=gen, device=DEV, dtype=torch.bfloat16)
        for n, sh in dict(
            q=(3, 1 + S, H, K), k=(3, 1 + S, H, K), v=(3, 1 + S, HV, K), g=(3, 1 + S, HV, K), beta=(3, 1 + S, HV)
        ).items()
    }
    o, _ = R(
        **tok,
        **params,
        **GATE,
        initial_state=pool,
        num_spec_tokens=S,
        ssm_state_indices=torch.tensor(rows, dtype=torch.int32, device=DEV),
        num_accepted_tokens=torch.tensor(acc, dtype=torch.int32, device=DEV),
    )
    written = set()
    for n in range(3):
        r = _ref_seq({k_: t[n : n + 1] for k_, t in tok.items()}, params, start[n : n + 1], return_all_states=True)
        assert_output(o[n : n + 1], r.output, f"spec sequence {n}")
        for t in range(1 + S):
            assert_close_rms(pool[rows[n][t]], r.all_states[0][t], state_tol(torch.float32), f"slot {rows[n][t]}")
            written.add(rows[n][t])
    # prefill of 40 tokens from the last slot's state (as a read-only source) into the slot that starts at
    # element 2^31 (4096 x 524288)
    inner = HV * K * K
    past = min(2**31 // inner, n_pool - 8)
    tokp = {
        n: torch.randn(*sh, generator=gen, device=DEV, dtype=torch.bfloat16)
        for n, sh in dict(
            q=(1, 40, H, K), k=(1, 40, H, K), v=(1, 40, HV, K), g=(1, 40, HV, K), beta=(1, 40, HV)
        ).items()
    }
    src = pool[n_pool - 1].clone()
    o2, _ = R(
        **tokp,
        **params,
        **GATE,
        initial_state=pool,
        ssm_state_indices=torch.tensor([past], dtype=torch.int32, device=DEV),
        initial_state_source=src[None].contiguous(),
        initial_state_indices=torch.zeros(1, dtype=torch.int32, device=DEV),
    )
    r2 = _ref_seq(tokp, params, src[None])
    assert_output(o2, r2.output, "prefill into a slot past 2^31")
    assert_close_rms(pool[past], r2.final_state[0], state_tol(torch.float32), f"slot {past}")
    written.add(past)
    probe = [s_ for s_ in (3, past - 1, past + 1, n_pool - 7) if s_ not in written]
    for s_ in probe:
        assert torch.count_nonzero(pool[s_]) == 0, f"slot {s_} was written"
    return pool.numel()


@cuda_only
def test_fp32_pool_past_2_31_elements():
    n_pool, HV, K = 4104, 32, 128  # 4104 x 524288 = 2.15e9 fp32 elements (8.6 GB)
    _need_free(n_pool * HV * K * K * 4 + (1 << 31))
    assert big_pool_case(n_pool, HV, K) > 2**31
    torch.cuda.empty_cache()


def many_sequences_case(N: int, HV: int, K: int, packed: bool, pieces: int) -> None:
    """N sequences x HV heads in one call equals `pieces` calls on consecutive slices, bit for bit."""
    gen = torch.Generator(device=DEV).manual_seed(12)
    H = 1
    rng = random.Random(13)
    if packed:
        lengths = [rng.choice([0, 1, 2, 3]) for _ in range(N)]
        B, T = 1, sum(lengths)
        cu = lengths_to_cu(lengths, device=DEV)
    else:
        B, T, cu = N, 1, None
    tok = {
        n: torch.randn(*sh, generator=gen, device=DEV, dtype=torch.bfloat16)
        for n, sh in dict(q=(B, T, H, K), k=(B, T, H, K), v=(B, T, HV, K), g=(B, T, HV, K), beta=(B, T, HV)).items()
    }
    params = dict(A_log=torch.rand(HV, device=DEV) * 0.5, dt_bias=torch.randn(HV, K, device=DEV) * 0.1)
    pool0 = (torch.randn(N + 7, HV, K, K, generator=gen, device=DEV) * 0.1).to(torch.bfloat16)
    slots = torch.randperm(N + 7, device=DEV)[:N].to(torch.int32)
    pool1 = pool0.clone()
    o1, _ = R(**tok, **params, **GATE, initial_state=pool1, cu_seqlens=cu, ssm_state_indices=slots)
    pool2 = pool0.clone()
    o2 = torch.empty_like(o1)
    bounds = [round(N * j / pieces) for j in range(pieces + 1)]
    for a, b in zip(bounds[:-1], bounds[1:], strict=True):
        if packed:
            ta, tb = int(cu[a]), int(cu[b])
            part = {n: t[:, ta:tb] for n, t in tok.items()}
            cu_p = cu[a : b + 1] - cu[a]
            o_p, _ = R(**part, **params, **GATE, initial_state=pool2, cu_seqlens=cu_p, ssm_state_indices=slots[a:b])
            o2[:, ta:tb] = o_p
        else:
            part = {n: t[a:b] for n, t in tok.items()}
            o_p, _ = R(**part, **params, **GATE, initial_state=pool2, ssm_state_indices=slots[a:b])
            o2[a:b] = o_p
    _same(o1, o2, f"{N} sequences x {HV} heads: output of one call vs {pieces} calls")
    _same(pool1, pool2, f"{N} sequences x {HV} heads: pool of one call vs {pieces} calls")
    assert torch.isfinite(o1.float()).all()


@cuda_only
@pytest.mark.parametrize("packed,N", [(False, 66000), (True, 70000)])
def test_more_than_65535_sequences_times_heads(packed, N):
    HV, K = 2, 64
    _need_free(3 * (N + 7) * HV * K * K * 2 + (1 << 30))
    many_sequences_case(N, HV, K, packed, pieces=3)


if __name__ == "__main__":  # pragma: no cover
    raise SystemExit(pytest.main([os.path.abspath(__file__), "-q"]))
