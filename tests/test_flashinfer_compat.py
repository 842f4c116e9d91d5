"""Calls written for FlashInfer's ``recurrent_kda`` behave as FlashInfer defines them (CPU tier):

- devices compare by the index they resolve to (a workspace made with ``device="cuda"`` or ``"cpu:0"``);
- index tensors may be strided views (read by stride);
- speculative decode without ``ssm_state_indices`` uses ``arange(N*(1+S)).reshape(N, 1+S)``;
- ``ssm_state_indices`` without a pool allocates zero slots up to ``max(index) + 1``;
- a bf16 ``state_checkpoints`` buffer without a pool is written in bf16.

Every result is checked against the fp64 reference (kda_ops.reference) or a plain call that was already
supported. The CUDA-device cases are in tests/gpu/test_workspace_device.py.
"""

from __future__ import annotations

import pytest
import torch

import kda_ops
from kda_ops import _validate as V
from kda_ops.reference import make_inputs, recurrent_kda_reference, rel_rms

TOL = 1e-5  # fp32 tokens against the fp64 reference
TOK = ("q", "k", "v", "g", "beta")


def _tok(x):
    return [x[n] for n in TOK]


# ---------------------------------------------------------------------------------------------------
# devices


def test_same_device_resolves_the_current_cuda_index(monkeypatch) -> None:
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 1)
    cuda, cuda0, cuda1 = torch.device("cuda"), torch.device("cuda:0"), torch.device("cuda:1")
    assert V._same_device(cuda, cuda1) and V._same_device(cuda1, cuda)
    assert not V._same_device(cuda, cuda0) and not V._same_device(cuda0, cuda)
    assert V._same_device("cuda", "cuda") and V._same_device(cuda0, "cuda:0")
    assert not V._same_device(cuda0, cuda1)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    assert V._same_device("cuda", cuda0)
    assert V._same_device("cpu", "cpu:0") and V._same_device(torch.device("cpu", 0), "cpu")
    assert not V._same_device("cpu", "cuda:0") and not V._same_device("meta", "cpu")


@pytest.mark.parametrize("ws_cls", [kda_ops.RecurrentKDAPrefillWorkspace, kda_ops.RecurrentKDABackwardWorkspace])
def test_workspace_device_with_an_explicit_index(ws_cls) -> None:
    # "cpu:0" names the device CPU tensors are on; it must not be refused as another device
    ws = ws_cls(device="cpu:0")
    ws.plan(("key",), torch.device("cpu"), 0, "workspace")
    assert V._same_device(ws.device, "cpu")
    ws2 = ws_cls(device="cpu:0", nbytes=64)
    ws2.plan(("key",), torch.device("cpu"), 64, "workspace")
    with pytest.raises(RuntimeError, match="workspace must be on meta"):
        ws2.plan(("key",), torch.device("meta"), 64, "workspace")


def test_prefill_workspace_cpu0_in_a_call() -> None:
    x = make_inputs(T=20, H=1, HV=2, K=16, V=16, dtype=torch.float32)
    ws = kda_ops.RecurrentKDAPrefillWorkspace(device="cpu:0")
    o, _ = kda_ops.recurrent_kda(*_tok(x), prefill_workspace=ws)
    o_ref, _ = kda_ops.recurrent_kda(*_tok(x))
    assert torch.equal(o, o_ref)


# ---------------------------------------------------------------------------------------------------
# strided index tensors


def test_strided_initial_state_indices() -> None:
    x = make_inputs(B=3, T=5, H=1, HV=2, K=16, V=16, N_pool=6, dtype=torch.float32)
    source = x["initial_state"]
    big = torch.tensor([5, 0, 1, 0, 3, 0], dtype=torch.int32)
    idx = big[::2]  # [5, 1, 3], stride 2
    assert not idx.is_contiguous()
    o, fs = kda_ops.recurrent_kda(
        *_tok(x), output_final_state=True, initial_state_source=source, initial_state_indices=idx
    )
    ref = recurrent_kda_reference(*_tok(x), initial_state=source[idx.long()])
    assert rel_rms(o, ref.output) < TOL and rel_rms(fs, ref.final_state) < TOL
    assert torch.equal(big, torch.tensor([5, 0, 1, 0, 3, 0], dtype=torch.int32))


def test_strided_ssm_state_indices_and_accepted_counts() -> None:
    S = 1
    x = make_inputs(B=2, T=1 + S, H=1, HV=2, K=16, V=16, N_pool=6, dtype=torch.float32, seed=1)
    pool, pool2 = x["initial_state"].clone(), x["initial_state"].clone()
    slots = torch.tensor([[0, 1], [4, 5]], dtype=torch.int32)
    slots_t = slots.t().contiguous().t()  # same values, column-major
    acc = torch.tensor([2, 0, 1, 0], dtype=torch.int32)[::2]
    assert not slots_t.is_contiguous() and not acc.is_contiguous()
    o, _ = kda_ops.recurrent_kda(*_tok(x), initial_state=pool, ssm_state_indices=slots_t, num_spec_tokens=S,
                                 num_accepted_tokens=acc)  # fmt: skip
    o2, _ = kda_ops.recurrent_kda(*_tok(x), initial_state=pool2, ssm_state_indices=slots, num_spec_tokens=S,
                                  num_accepted_tokens=acc.contiguous())  # fmt: skip
    assert torch.equal(o, o2) and torch.equal(pool, pool2)


# ---------------------------------------------------------------------------------------------------
# speculative decode without ssm_state_indices; indices without a pool


@pytest.mark.parametrize("packed", [False, True])
def test_spec_decode_default_slots(packed) -> None:
    S, B = 2, 3
    x = make_inputs(B=B, T=1 + S, H=1, HV=2, K=16, V=16, N_pool=B * (1 + S), dtype=torch.float32, seed=2)
    cu = None
    toks = _tok(x)
    if packed:
        toks = [t.reshape(1, B * (1 + S), *t.shape[2:]) for t in toks]
        cu = torch.arange(B + 1, dtype=torch.int32) * (1 + S)
    acc = torch.tensor([1, 3, 2], dtype=torch.int32)
    pool, pool2 = x["initial_state"].clone(), x["initial_state"].clone()
    o, _ = kda_ops.recurrent_kda(*toks, initial_state=pool, num_spec_tokens=S, num_accepted_tokens=acc, cu_seqlens=cu)
    explicit = torch.arange(B * (1 + S), dtype=torch.int32).reshape(B, 1 + S)
    o2, _ = kda_ops.recurrent_kda(*toks, initial_state=pool2, num_spec_tokens=S, num_accepted_tokens=acc,
                                  ssm_state_indices=explicit, cu_seqlens=cu)  # fmt: skip
    assert torch.equal(o, o2) and torch.equal(pool, pool2)


def test_spec_decode_default_slots_need_the_pool_size() -> None:
    S = 2
    x = make_inputs(B=2, T=1 + S, H=1, HV=2, K=16, V=16, N_pool=5, dtype=torch.float32)
    with pytest.raises(ValueError, match="at least N\\*\\(1\\+S\\)=6 slots"):
        kda_ops.recurrent_kda(*_tok(x), initial_state=x["initial_state"], num_spec_tokens=S)


def test_ssm_state_indices_without_a_pool() -> None:
    # FlashInfer: zero slots up to max(index) + 1; the returned final state is that pool
    x = make_inputs(B=3, T=4, H=1, HV=2, K=16, V=16, dtype=torch.float32, seed=3)
    idx = torch.tensor([4, -1, 1], dtype=torch.int32)
    o, fs = kda_ops.recurrent_kda(*_tok(x), ssm_state_indices=idx, output_final_state=True)
    ref = recurrent_kda_reference(*_tok(x))
    assert fs.shape == (5, 2, 16, 16) and fs.dtype == torch.float32
    assert rel_rms(o[[0, 2]], ref.output[[0, 2]]) < TOL and torch.count_nonzero(o[1]) == 0
    assert rel_rms(fs[[4, 1]], ref.final_state[[0, 2]]) < TOL
    assert torch.count_nonzero(fs[[0, 2, 3]]) == 0


def test_spec_decode_without_pool_or_indices() -> None:
    S = 1
    x = make_inputs(B=2, T=1 + S, H=1, HV=2, K=16, V=16, dtype=torch.float32, seed=4)
    o, fs = kda_ops.recurrent_kda(*_tok(x), num_spec_tokens=S, output_final_state=True)
    ref = recurrent_kda_reference(*_tok(x), return_all_states=True)
    assert rel_rms(o, ref.output) < TOL
    assert fs.shape == (2 * (1 + S), 2, 16, 16)
    assert rel_rms(fs.view(2, 1 + S, *fs.shape[1:]), torch.stack(ref.all_states)) < TOL


def test_num_spec_tokens_zero_is_plain_decode() -> None:
    # deliberate: 0 means "no speculative decode" (docs/serving.md)
    x = make_inputs(B=2, T=1, H=1, HV=2, K=16, V=16, dtype=torch.float32)
    pool, pool2 = x["initial_state"].clone(), x["initial_state"].clone()
    o, _ = kda_ops.recurrent_kda(*_tok(x), initial_state=pool, num_spec_tokens=0)
    o2, _ = kda_ops.recurrent_kda(*_tok(x), initial_state=pool2)
    assert torch.equal(o, o2) and torch.equal(pool, pool2)


# ---------------------------------------------------------------------------------------------------
# bf16 checkpoint buffers without a pool


def test_bf16_checkpoints_without_a_pool() -> None:
    x = make_inputs(T=40, H=1, HV=2, K=16, V=16, dtype=torch.float32, seed=5)
    ck = torch.full((3, 2, 16, 16), 7.0, dtype=torch.bfloat16)
    o, fs, ck_ret = kda_ops.recurrent_kda(*_tok(x), output_final_state=True, checkpoint_every_n_tokens=16,
                                          state_checkpoints=ck)  # fmt: skip
    assert ck_ret is ck and ck.dtype == torch.bfloat16
    ref = recurrent_kda_reference(*_tok(x), checkpoint_every_n_tokens=16)
    assert rel_rms(ck.float(), torch.cat(ref.checkpoints)) < 1e-2  # bf16 rounding
    assert fs.dtype == torch.float32 and rel_rms(fs, ref.final_state) < TOL


def test_checkpoint_buffer_dtype_still_checked() -> None:
    x = make_inputs(T=16, H=1, HV=2, K=16, V=16, dtype=torch.float32)
    with pytest.raises(TypeError, match="state_checkpoints"):
        kda_ops.recurrent_kda(*_tok(x), checkpoint_every_n_tokens=16,
                              state_checkpoints=torch.zeros(1, 2, 16, 16, dtype=torch.float16))  # fmt: skip
    pool = x["initial_state"].to(torch.bfloat16)
    with pytest.raises(TypeError, match="state_checkpoints"):  # with a pool: the pool's dtype, as before
        kda_ops.recurrent_kda(*_tok(x), initial_state=pool, checkpoint_every_n_tokens=16,
                              state_checkpoints=torch.zeros(1, 2, 16, 16))  # fmt: skip


def test_repeated_calls_take_the_same_path() -> None:
    # recurrent_kda caches validated decode-like calls by argument properties; calls whose arguments are
    # normalised here (strided indices copied, default spec slots, a pool allocated) must never replay a
    # cached entry with the raw arguments
    x = make_inputs(B=3, T=1, H=1, HV=2, K=16, V=16, N_pool=6, dtype=torch.float32, seed=6)
    idx = torch.tensor([5, 0, 1, 0, 3, 0], dtype=torch.int32)[::2]
    ref = recurrent_kda_reference(*_tok(x), initial_state=x["initial_state"][idx.long()])
    for _ in range(3):
        pool = x["initial_state"].clone()
        o, _ = kda_ops.recurrent_kda(*_tok(x), initial_state=pool, ssm_state_indices=idx)
        assert rel_rms(o, ref.output) < TOL and rel_rms(pool[idx.long()], ref.final_state) < TOL
        o2, fs = kda_ops.recurrent_kda(*_tok(x), ssm_state_indices=idx.contiguous(), output_final_state=True)
        assert fs.shape[0] == 6 and rel_rms(o2, recurrent_kda_reference(*_tok(x)).output) < TOL
    S = 1
    s = make_inputs(B=2, T=1 + S, H=1, HV=2, K=16, V=16, N_pool=4, dtype=torch.float32, seed=7)
    outs = []
    for _ in range(3):
        pool = s["initial_state"].clone()
        o, _ = kda_ops.recurrent_kda(*_tok(s), initial_state=pool, num_spec_tokens=S)
        outs.append((o, pool))
    assert all(torch.equal(a[0], outs[0][0]) and torch.equal(a[1], outs[0][1]) for a in outs)
