"""Batch-invariant mode (``kda_ops.set_batch_invariant``, ``KDA_BATCH_INVARIANT=1``): one sequence's results are
bit-identical whatever else the call holds — alone or packed among other sequences (short, long, empty), at any
position, from any pool slot — for prefill, decode and training. CPU tier, parametrized on CUDA (marked ``gpu``),
where the mode pins the routes that otherwise look at the batch (the split, the chunked/token-serial choice, the
token-serial tile, the backward chain's kernel).
"""

from __future__ import annotations

import pytest
import torch
from conftest import DEVICES, lengths_to_cu, route_env

import kda_ops
from kda_ops import _split

K = 128
HV = 2
TARGET = 300  # the sequence followed through every batch


def _tokens(lens: list[int], device: str, seed: int, dtype: torch.dtype) -> dict:
    gen = torch.Generator().manual_seed(seed)
    T = sum(lens)

    def r(*s: int) -> torch.Tensor:
        return torch.randn(*s, generator=gen).to(dtype).to(device)

    return dict(q=r(1, T, HV, K), k=r(1, T, HV, K), v=r(1, T, HV, K), g=r(1, T, HV, K), beta=r(1, T, HV))


def _gate(device: str) -> dict:
    gen = torch.Generator().manual_seed(99)
    return dict(
        A_log=(torch.rand(HV, generator=gen) * 0.5).to(device),
        dt_bias=(torch.randn(HV, K, generator=gen) * 0.1).to(device),
    )


def _batch(others: list[int], at: int, device: str, dtype: torch.dtype) -> tuple[dict, list[int]]:
    """The target sequence (the same values every time) at position ``at`` among ``others``."""
    lens = others[:at] + [TARGET] + others[at:]
    x = _tokens(lens, device, seed=len(lens) * 7 + at, dtype=dtype)
    mine = _tokens([TARGET], device, seed=1234, dtype=dtype)
    s = sum(lens[:at])
    for name, t in mine.items():
        x[name][:, s : s + TARGET] = t
    return x, lens


BATCHES = [([], 0), ([50, 1000, 0, 7], 2), ([4096, 3], 0), ([17] * 9, 9)]


def _prefill_target(device: str, others: list[int], at: int, slot: int, dtype=torch.bfloat16):  # type: ignore[no-untyped-def]
    x, lens = _batch(others, at, device, dtype)
    N = len(lens)
    h0 = (torch.randn(1, HV, K, K, generator=torch.Generator().manual_seed(5)) * 0.2).to(device)
    pool = torch.zeros(N + 10, HV, K, K, device=device)
    slots = [n + 10 for n in range(N)]  # (the others' slots: away from the target's)
    slots[at] = slot
    pool[slot] = h0[0]
    cu = lengths_to_cu(lens, device)
    out = kda_ops.recurrent_kda(
        **x, **_gate(device), initial_state=pool, cu_seqlens=cu,
        ssm_state_indices=torch.tensor(slots, dtype=torch.int32, device=device),
        use_gate_in_kernel=True, lower_bound=-5.0, beta_is_logit=True,
    )[0]  # fmt: skip
    s = sum(lens[:at])
    return out[:, s : s + TARGET].clone(), pool[slot].clone()


@pytest.fixture
def invariant(monkeypatch):  # type: ignore[no-untyped-def]
    route_env(monkeypatch, KDA_BATCH_INVARIANT=1)


@pytest.mark.parametrize("device", DEVICES)
def test_prefill_invariant(invariant, device):  # type: ignore[no-untyped-def]
    """Packed prefill: the target's outputs and final state bit for bit, alone or among others, any slot."""
    ref = _prefill_target(device, [], 0, slot=0)
    for (others, at), slot in zip(BATCHES[1:], (3, 7, 2), strict=True):
        got = _prefill_target(device, others, at, slot)
        assert torch.equal(got[0], ref[0]), f"outputs differ among {others} at {at}"
        assert torch.equal(got[1], ref[1]), f"final states differ among {others} at {at}"


@pytest.mark.parametrize("device", DEVICES)
def test_invariant_turns_the_split_off(monkeypatch, device):  # type: ignore[no-untyped-def]
    """The split would run (forced on, 64-token segments) but batch-invariant mode keeps the call whole."""
    route_env(monkeypatch, KDA_SEQUENCE_SPLIT="1", KDA_SEQUENCE_SPLIT_TOKENS=64)
    calls: list = []
    run = _split._run
    monkeypatch.setattr(_split, "_run", lambda pl, *a, **kw: (calls.append(pl), run(pl, *a, **kw)))
    _prefill_target(device, [50], 1, slot=2)
    assert len(calls) == 1
    route_env(monkeypatch, KDA_BATCH_INVARIANT=1)
    assert kda_ops._C.route_split([TARGET], HV, device == "cuda", 0, False, 64) == 0
    _prefill_target(device, [50], 1, slot=2)
    assert len(calls) == 1


@pytest.mark.parametrize("device", DEVICES)
def test_decode_invariant(invariant, device):  # type: ignore[no-untyped-def]
    """Fixed-layout decode (T = 1): the target row's output and state, batch 1 against batch 37 from another
    slot, several steps (bf16 pool)."""
    gen = torch.Generator().manual_seed(11)
    h0 = (torch.randn(HV, K, K, generator=gen) * 0.2).to(torch.bfloat16).to(device)
    steps = [_tokens([1], device, seed=100 + i, dtype=torch.bfloat16) for i in range(3)]
    results = []
    for B, row, slot in ((1, 0, 0), (37, 5, 20), (64, 63, 3)):
        pool = (torch.randn(70, HV, K, K, generator=gen) * 0.2).to(torch.bfloat16).to(device)
        pool[slot] = h0
        slots = torch.randperm(70, generator=gen)[:B]
        slots = torch.where(slots == slot, slots[row], slots)
        slots[row] = slot
        outs = []
        for st in steps:
            x = _tokens([B], device, seed=B, dtype=torch.bfloat16)
            x = {n: t.view(B, 1, *t.shape[2:]).clone() for n, t in x.items()}
            for n, t in st.items():
                x[n][row] = t[0]
            o = kda_ops.recurrent_kda(
                **x, **_gate(device), initial_state=pool, ssm_state_indices=slots.to(torch.int32).to(device),
                use_gate_in_kernel=True, lower_bound=-5.0, beta_is_logit=True,
            )[0]  # fmt: skip
            outs.append(o[row].clone())
        results.append((torch.stack(outs), pool[slot].clone()))
    for got in results[1:]:
        assert torch.equal(got[0], results[0][0]) and torch.equal(got[1], results[0][1])


@pytest.mark.parametrize("device", DEVICES)
def test_training_invariant(invariant, device):  # type: ignore[no-untyped-def]
    """kda() forward and backward: the target's outputs and its tokens' gradients (q, k, v, g, β) and its start
    state's gradient, alone or packed among others."""
    dtype = torch.bfloat16 if device == "cuda" else torch.float32
    ref = None
    for others, at in BATCHES[:3]:
        x, lens = _batch(others, at, device, dtype)
        leaves = {n: t.clone().requires_grad_(True) for n, t in x.items()}
        N = len(lens)
        h0 = torch.zeros(N, HV, K, K, device=device)
        h0[at] = (torch.randn(HV, K, K, generator=torch.Generator().manual_seed(5)) * 0.2).to(device)
        h0.requires_grad_(True)
        gate = _gate(device)
        cu = lengths_to_cu(lens, device)
        o, fs = kda_ops.kda(*leaves.values(), gate["A_log"], gate["dt_bias"], h0, cu_seqlens=cu, lower_bound=-5.0,
                            output_final_state=True)  # fmt: skip
        w = torch.randn(o.shape, generator=torch.Generator().manual_seed(N)).to(device)
        w[:, sum(lens[:at]) : sum(lens[:at]) + TARGET] = torch.randn(
            1, TARGET, HV, K, generator=torch.Generator().manual_seed(3)
        ).to(device)
        ((o.float() * w).sum() + fs.sum()).backward()
        s = sum(lens[:at])
        res = [o[:, s : s + TARGET], fs[at]] + [t.grad[:, s : s + TARGET] for t in leaves.values()] + [h0.grad[at]]
        res = [r.detach().clone() for r in res]
        if ref is None:
            ref = res
            continue
        for name, a, b in zip(["o", "final", "dq", "dk", "dv", "dg", "dbeta", "dh0"], res, ref, strict=True):
            assert torch.equal(a, b), f"{name} differs among {others} at {at}"


def test_set_batch_invariant(monkeypatch):  # type: ignore[no-untyped-def]
    route_env(monkeypatch, KDA_BATCH_INVARIANT=None)
    assert not kda_ops.batch_invariant()
    kda_ops.set_batch_invariant(True)
    assert kda_ops.batch_invariant() and kda_ops._routing.split_off()
    kda_ops.set_batch_invariant(False)
    assert not kda_ops.batch_invariant() and not kda_ops._routing.split_off()
    with pytest.raises(TypeError, match="enabled must be a bool"):
        kda_ops.set_batch_invariant(1)  # type: ignore[arg-type]
    monkeypatch.setenv("KDA_BATCH_INVARIANT", "maybe")
    with pytest.raises(ValueError, match="KDA_BATCH_INVARIANT must be 0 or 1"):
        kda_ops._routing.reload()
    monkeypatch.delenv("KDA_BATCH_INVARIANT")
    kda_ops._routing.reload()
