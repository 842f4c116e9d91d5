"""Determinism (docs/contract.md, "Tolerances"): every op 10 times (on CPU alternating 1 and 2 threads),
bit-identical. CPU tier, parametrized on CUDA (marked ``gpu``).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest
import torch
from _builders import (
    KDA,
    RB,
    STATS,
    TB,
    TF,
    R,
    _check_cuda_training,
    _cu,
    _dims,
    _plain,
    _rand,
    _skip_not_implemented,
    counts_reporter,
    raw_bytes,
    training_guard_inputs,
)
from conftest import DEVICES

_report_counts = counts_reporter("determinism")


def _det_runs(device: str, fn: Callable, n: int = 10) -> list[list[torch.Tensor]]:
    runs = []
    old = torch.get_num_threads()
    try:
        for i in range(n):
            if device == "cpu":
                torch.set_num_threads(1 if i % 2 == 0 else max(2, old))
            res = [r.detach() for r in fn() if isinstance(r, torch.Tensor)]
            runs.append([raw_bytes(r) for r in res])
    finally:
        torch.set_num_threads(old)
    for i, r in enumerate(runs[1:], 1):
        assert len(r) == len(runs[0])
        for j, (a, b) in enumerate(zip(r, runs[0], strict=True)):
            assert torch.equal(a, b), f"run {i}: result {j} differs bitwise from run 0"
    STATS["determinism_runs"] += n
    return runs


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("mode", ["prefill_ckpt", "decode", "spec"])
def test_determinism_recurrent(device, mode):
    K = _dims(device)
    gen = torch.Generator().manual_seed(21)
    H, HV = 1, 2
    dt = torch.bfloat16
    if mode == "prefill_ckpt":
        lengths = [1, 37, 0, 70, 16]
        B, T = 1, sum(lengths)
        extra: dict[str, Any] = dict(
            cu_seqlens=_cu(lengths, device=device),
            checkpoint_every_n_tokens=16,
            ssm_state_indices=torch.tensor([4, 0, 2, 1, 3], dtype=torch.int32, device=device),
        )
        pdt = torch.bfloat16
    elif mode == "decode":
        B, T = 8, 1
        extra = dict(ssm_state_indices=torch.tensor([7, 6, -1, 4, 3, 2, 1, 0], dtype=torch.int32, device=device))
        pdt = torch.float32
    else:
        S, B = 3, 4
        T = 1 + S
        extra = dict(
            num_spec_tokens=S,
            ssm_state_indices=torch.arange(16, dtype=torch.int32, device=device).view(4, 4),
            num_accepted_tokens=torch.tensor([1, 4, 2, 3], dtype=torch.int32, device=device),
        )
        pdt = torch.float32
    x = dict(
        q=_rand(gen, (B, T, H, K), dt, device),
        k=_rand(gen, (B, T, H, K), dt, device),
        v=_rand(gen, (B, T, HV, K), dt, device),
        g=_rand(gen, (B, T, HV, K), dt, device),
        beta=_rand(gen, (B, T, HV), dt, device),
    )
    pool0 = (torch.randn(16, HV, K, K, generator=gen) * 0.1).to(pdt).to(device)
    gate = dict(
        use_gate_in_kernel=True,
        A_log=(torch.rand(HV, generator=gen) * 0.5).to(device),
        dt_bias=(torch.randn(HV, K, generator=gen) * 0.1).to(device),
        lower_bound=-5.0,
        beta_is_logit=True,
    )

    def once():
        pool = pool0.clone()
        res = R(**x, **gate, **extra, initial_state=pool)
        return [res[0], pool] + ([res[2]] if len(res) == 3 else [])

    _det_runs(device, once)


@pytest.mark.parametrize("device", DEVICES)
def test_determinism_training_family(device):
    """Training forward (out, final state, tapes), training backward, recurrent_kda_backward and kda()
    autograd (output, final state, all eight gradients): 10 runs each, bit-identical."""
    _check_cuda_training(device)
    K = _dims(device)
    carved, do, dfinal, _ = training_guard_inputs(device, K, packed=True, seed=9)
    inp = {c.name: _plain(c.view) for c in carved}
    do_, df_ = _plain(do.view), _plain(dfinal.view)
    mirror = {"cu_seqlens_cpu": inp["cu_seqlens"].cpu()}
    _det_runs(device, lambda: _skip_not_implemented(TF, **inp, **mirror)[:2] + (TF(**inp, **mirror)[2].tapes,))
    _, _, ctx = TF(**inp, **mirror)
    _det_runs(device, lambda: TB(ctx, do_, df_))
    _det_runs(device, lambda: RB(**inp, do=do_, dfinal_state=df_))

    def autograd_once():
        leaves = {n_: t.clone().requires_grad_(True) for n_, t in inp.items() if t.is_floating_point()}
        o, f = KDA(**leaves, cu_seqlens=inp["cu_seqlens"], output_final_state=True)
        ((o.float() * do_.float()).sum() + (f * df_).sum()).backward()
        return [o, f] + [leaves[n_].grad for n_ in sorted(leaves)]

    _det_runs(device, autograd_once)
