"""Guard bands: every tensor is carved out of a larger NaN-filled buffer (storage offsets, padded head and
slot strides); results must be bit-identical to the run on compact copies and no byte outside the
output/state regions may change. CPU tier, parametrized on CUDA (marked ``gpu``).
"""

from __future__ import annotations

import math
from typing import Any

import pytest
import torch
from _builders import (
    KDA,
    RB,
    STATS,
    TB,
    TF,
    Carved,
    R,
    _check_cuda_training,
    _cu,
    _dims,
    _plain,
    _rand,
    _skip_not_implemented,
    carve,
    counts_reporter,
    raw_bytes,
    training_guard_inputs,
)
from conftest import DEVICES

_report_counts = counts_reporter("guard bands")


def recurrent_guard_case(name: str, device: str, K: int, pool_dtype: torch.dtype, seed: int = 0):
    """(guarded kwargs, plain kwargs, carved buffers, names of the written tensors) of one recurrent_kda call."""
    gen = torch.Generator().manual_seed(seed)
    dt = torch.bfloat16  # the CUDA token dtype; the CPU path takes it too
    H, HV = 1, 2
    if name == "decode":
        B, T, cu, n_pool = 4, 1, None, 6
        extra = dict(ssm_state_indices=torch.tensor([5, 0, -1, 2], dtype=torch.int32))
        live_slots = [5, 0, 2]
        gate = dict(use_gate_in_kernel=True, lower_bound=-5.0)
        beta_is_logit = True
    elif name == "prefill_ckpt":
        lengths = [5, 0, 17, 1, 33, 16]
        B, T, cu, n_pool = 1, sum(lengths), lengths, 8
        extra = dict(
            ssm_state_indices=torch.tensor([3, 1, 0, -1, 6, 2], dtype=torch.int32), checkpoint_every_n_tokens=16
        )
        live_slots = [3, 1, 0, 6, 2]
        gate = dict(use_gate_in_kernel=True)
        beta_is_logit = False
    elif name == "spec":
        S, N = 2, 3
        lengths = [1 + S] * N
        B, T, cu, n_pool = 1, N * (1 + S), lengths, 10
        extra = dict(
            ssm_state_indices=torch.tensor([[0, 1, 2], [3, -1, 5], [6, 7, 8]], dtype=torch.int32),
            num_spec_tokens=S,
            num_accepted_tokens=torch.tensor([1, 3, 2], dtype=torch.int32),
        )
        live_slots = [0, 5, 7]  # the slots read (clamp(accepted - 1, 0, S)); written-only slots start as NaN
        gate = dict(use_gate_in_kernel=True, lower_bound=-2.0)
        beta_is_logit = True
    elif name == "source":
        B, T, cu, n_pool = 3, 4, None, 4
        extra = dict(ssm_state_indices=torch.tensor([1, 3, 0], dtype=torch.int32))
        live_slots = []  # start states come from the source pool: the pool slots are written only
        gate = dict(use_gate_in_kernel=False)
        beta_is_logit = False
    elif name == "no_pool":
        lengths = [3, 0, 4]
        B, T, cu, n_pool = 1, 7, lengths, 0
        extra = dict(output_final_state=True, use_qk_l2norm_in_kernel=False)
        live_slots = []
        gate = dict(use_gate_in_kernel=False)
        beta_is_logit = True
    else:
        raise AssertionError(name)
    V = K
    q = _rand(gen, (B, T, H, K), dt, device)
    k = _rand(gen, (B, T, H, K), dt, device, s=1.0 if extra.get("use_qk_l2norm_in_kernel", True) else 0.1)
    v = _rand(gen, (B, T, HV, V), dt, device)
    g_raw = _rand(gen, (B, T, HV, K), dt, device)
    g = g_raw if gate["use_gate_in_kernel"] else (-torch.nn.functional.softplus(g_raw.float())).to(dt)
    beta = (
        _rand(gen, (B, T, HV), dt, device) if beta_is_logit else torch.rand(B, T, HV, generator=gen).to(dt).to(device)
    )
    carved = [
        carve(q, "q", pads={2: 8}),
        carve(k, "k", pads={2: 8}, lead=32),
        carve(v, "v", pads={2: 8}),
        carve(g, "g", pads={2: 3 if name == "decode" else 8}),  # stride not a multiple of 8: a compact copy on CUDA
        carve(beta, "beta", pads={1: 3}),
    ]
    gk: dict[str, Any] = dict(gate)
    if gate["use_gate_in_kernel"]:
        carved.append(carve((torch.rand(HV, generator=gen) * 0.5).to(device), "A_log", lead=4))
        carved.append(carve((torch.randn(HV, K, generator=gen) * 0.1).to(device), "dt_bias"))
    out0 = torch.full((B, T, HV, V), 7.0, dtype=dt, device=device)  # pre-call contents of the output
    carved.append(carve(out0, "output", "out", pads={2: 8}))
    written = ["output"]
    if n_pool:
        pool = torch.full((n_pool, HV, V, K), math.nan, dtype=pool_dtype)
        for s_ in live_slots:
            pool[s_] = (torch.randn(HV, V, K, generator=gen) * 0.1).to(pool_dtype)
        slot = HV * V * K + 32
        carved.append(carve(pool.to(device), "initial_state", "out", pads={0: 32}, lead=slot, tail=slot))
        written.append("initial_state")
    if name == "source":
        src = (torch.randn(4, HV, V, K, generator=gen) * 0.1).to(pool_dtype).to(device)
        slot = HV * V * K + 16
        carved.append(carve(src, "initial_state_source", pads={0: 16}, lead=slot, tail=slot))
        extra["initial_state_indices"] = torch.tensor([2, 0, 7], dtype=torch.int32)  # 7: out of range, inactive
    if cu is not None:
        extra["cu_seqlens"] = _cu(cu)
    if extra.get("checkpoint_every_n_tokens"):
        n = extra["checkpoint_every_n_tokens"]
        starts = _cu([(L + n - 1) // n for L in cu])
        extra["checkpoint_cu_starts"] = starts
        ck = torch.full((int(starts[-1]), HV, V, K), math.nan, dtype=pool_dtype, device=device)
        carved.append(carve(ck, "state_checkpoints", "out", lead=64, tail=64))
        written.append("state_checkpoints")
    for n_, t in list(extra.items()):  # index tensors: contiguous, at an offset in a sentinel buffer
        if isinstance(t, torch.Tensor):
            carved.append(carve(t.to(device), n_, lead=8, tail=8))
            extra.pop(n_)
    guarded = {c.name: c.view for c in carved}
    guarded.update(extra)
    guarded["beta_is_logit"] = beta_is_logit
    guarded.update({n_: t for n_, t in gk.items() if not isinstance(t, torch.Tensor)})
    plain = {n_: (_plain(t) if isinstance(t, torch.Tensor) else t) for n_, t in guarded.items()}
    return guarded, plain, carved, written


def _assert_same(a: torch.Tensor | None, b: torch.Tensor | None, what: str) -> None:
    if a is None or b is None:
        assert a is None and b is None, what
        return
    assert a.shape == b.shape and a.dtype == b.dtype, what
    assert torch.equal(raw_bytes(a), raw_bytes(b)), f"{what}: differs bitwise from the run without guards"


RECURRENT_GUARD_CASES = ["decode", "prefill_ckpt", "spec", "source", "no_pool"]


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("case", RECURRENT_GUARD_CASES)
@pytest.mark.parametrize("pool_dtype", [torch.float32, torch.bfloat16])
def test_guard_bands_recurrent(device, case, pool_dtype):
    """recurrent_kda on views carved out of NaN buffers (offsets, padded head strides, a pool with a padded
    slot stride surrounded by NaN slots, NaN in every unused or write-only slot) equals the run on compact
    copies bit for bit, and writes nothing outside the output/state/checkpoint views."""
    for K in [_dims(device)] + ([64] if device == "cuda" else []):
        guarded, plain, carved, written = recurrent_guard_case(case, device, K, pool_dtype)
        res_g = R(**guarded)
        res_p = R(**plain)
        _assert_same(res_g[0], res_p[0], "output")
        assert res_g[0].data_ptr() == guarded["output"].data_ptr(), "output must be written in place"
        for n_ in written[1:]:
            _assert_same(guarded[n_], plain[n_], n_)
        if case == "no_pool":
            _assert_same(res_g[1], res_p[1], "final_state")
            assert torch.isfinite(res_g[1].float()).all()
        for c in carved:
            c.check()
        assert torch.isfinite(res_g[0].float()).all(), "NaN from a guard band reached the output"
        STATS["guard_runs"] += 1


def _grad_out_buffers(dims, device) -> list[Carved]:
    B, T, N, H, HV, K, V, dt = dims
    shapes = [(B, T, H, K), (B, T, H, K), (B, T, HV, V), (B, T, HV, K), (B, T, HV), (HV,), (HV, K), (N, HV, V, K)]
    dts = [dt] * 5 + [torch.float32] * 3
    names = ["dq", "dk", "dv", "dg", "dbeta", "dA_log", "ddt_bias", "dinitial_state"]
    return [
        carve(
            torch.full(s, 5.0, dtype=d, device=device),
            f"out.{n}",
            "out",
            pads=({len(s) - 2: 8} if len(s) >= 3 else None),
        )
        for s, d, n in zip(shapes, dts, names, strict=True)
    ]


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("packed", [False, True])
def test_guard_bands_training(device, packed):
    """Training forward (with out buffers), training backward, recurrent_kda_backward (with out buffers)
    and kda() autograd on carved inputs: bit-identical to compact copies, no write outside the views,
    gradients of kda() land only inside the views of the NaN buffers (zero outside)."""
    _check_cuda_training(device)
    K = _dims(device)
    carved, do, dfinal, dims = training_guard_inputs(device, K, packed)
    B, T, N, H, HV, _, V, dt = dims
    inp = {c.name: c.view for c in carved}
    plain = {n_: _plain(t) for n_, t in inp.items()}
    mirror = {"cu_seqlens_cpu": inp["cu_seqlens"].cpu()} if packed else {}

    out_c = carve(torch.full((B, T, HV, V), 5.0, dtype=dt, device=device), "out", "out", pads={2: 8})
    fs_c = carve(torch.full((N, HV, V, K), 5.0, device=device), "final_state_out", "out", lead=32, tail=32)
    o_g, fs_g, ctx_g = _skip_not_implemented(TF, **inp, out=out_c.view, final_state_out=fs_c.view, **mirror)
    o_p, fs_p, ctx_p = TF(**plain, **mirror)
    _assert_same(o_g, o_p, "training out")
    _assert_same(fs_g, fs_p, "training final_state")
    _assert_same(ctx_g.tapes, ctx_p.tapes, "tapes")

    outs_tb = _grad_out_buffers(dims, device)
    g_tb = TB(ctx_g, do.view, dfinal.view, out=[c.view for c in outs_tb])
    g_tb_p = TB(ctx_p, _plain(do.view), _plain(dfinal.view))
    for i, (a, b) in enumerate(zip(g_tb, g_tb_p, strict=True)):
        _assert_same(a, b, f"training backward grad {i}")

    outs_rb = _grad_out_buffers(dims, device)
    g_rb = RB(**inp, do=do.view, dfinal_state=dfinal.view, out=[c.view for c in outs_rb])
    g_rb_p = RB(**plain, do=_plain(do.view), dfinal_state=_plain(dfinal.view))
    for i, (a, b) in enumerate(zip(g_rb, g_rb_p, strict=True)):
        _assert_same(a, b, f"recurrent_kda_backward grad {i}")
        assert torch.isfinite(a.float()).all(), f"grad {i}: NaN from a guard band"

    for c in carved + [do, dfinal, out_c, fs_c] + outs_tb + outs_rb:
        c.check()

    # kda(): the leaves are the whole NaN buffers, the inputs views of them
    leaves = {}
    for c in carved:
        if c.name == "cu_seqlens":
            continue
        buf = c.buf.detach().clone()
        if buf.dtype.is_floating_point:
            buf.requires_grad_(True)
        leaves[c.name] = (buf, buf.as_strided(tuple(c.view.shape), c.view.stride(), c.view.storage_offset()), c)
    args = {n_: v_ for n_, (_, v_, _) in leaves.items()}
    cu_kw = {"cu_seqlens": inp["cu_seqlens"]} if packed else {}
    o1, f1 = KDA(**args, **cu_kw, output_final_state=True)
    ((o1.float() * plain_do(do)).sum() + (f1 * dfinal.view).sum()).backward()
    pl = {n_: plain[n_].clone().requires_grad_(True) for n_ in args}
    o2, f2 = KDA(**pl, **cu_kw, output_final_state=True)
    ((o2.float() * plain_do(do)).sum() + (f2 * dfinal.view).sum()).backward()
    _assert_same(o1, o2, "kda output")
    _assert_same(f1, f2, "kda final state")
    for n_, (buf, view, c) in leaves.items():
        grad = buf.grad
        assert grad is not None, n_
        inside = c.region().to(grad.device)
        assert torch.count_nonzero(grad[~inside]) == 0, f"kda: gradient of {n_} leaked outside its view"
        got = grad.as_strided(tuple(view.shape), view.stride(), view.storage_offset())
        _assert_same(got, pl[n_].grad, f"kda grad of {n_}")
    STATS["guard_runs"] += 1


def plain_do(do: Carved) -> torch.Tensor:
    return _plain(do.view).float()
