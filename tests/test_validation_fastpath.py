"""The cheap common-path checks of ``recurrent_kda`` reject what the one-by-one checks reject (docs/contract.md
"Errors").

kda_ops/_validate.py tests several arguments at once on the common path (one ``is_contiguous()`` per
token tensor, spans of the overlap check taken from validated shapes instead of asking the tensor, one
pass for several written tensors). These cases sit at the edges of those shortcuts: empty tensors (which
count as contiguous whatever their strides), padded pools (whose span ends past N_pool * HV*V*K
elements), arguments passed through unchanged vs normalised copies, and every written tensor.
"""

from __future__ import annotations

import math

import pytest
import torch
from _builders import lower_bound_call
from conftest import assert_bit_identical, inputs, needs_cpu_op, snapshot

import kda_ops

K = V = 32


def _call(**over):
    """A valid call: B=2, T=1, H=1, HV=2, bf16 pool of 4 slots, lower-bound gate, caller output."""
    x = inputs(B=2, T=1, H=1, HV=2, K=K, V=V, N_pool=4, state_dtype=torch.bfloat16)
    kw = lower_bound_call(
        x,
        ssm_state_indices=torch.tensor([3, 1], dtype=torch.int32),
        output=torch.zeros(2, 1, 2, V, dtype=torch.bfloat16),
    )
    kw.update(over)
    return kw


def _rejects(kw: dict, exc: type[Exception], name: str) -> None:
    ts = [t for t in kw.values() if isinstance(t, torch.Tensor)]
    before = snapshot(*ts)
    with pytest.raises(exc) as ei:
        kda_ops.recurrent_kda(**kw)
    assert type(ei.value) is exc, f"{type(ei.value).__name__}: {ei.value}"
    assert name in str(ei.value), str(ei.value)
    assert_bit_identical(before, *ts)


def _bytes_of(t: torch.Tensor, dtype: torch.dtype, shape: tuple[int, ...], offset_bytes: int = 0) -> torch.Tensor:
    """A contiguous ``dtype`` view of ``shape`` on the memory of the contiguous ``t``, offset_bytes in."""
    raw = t.reshape(-1).view(torch.uint8)
    n = math.prod(shape) * torch.empty((), dtype=dtype).element_size()
    assert offset_bytes + n <= raw.numel()
    return raw[offset_bytes : offset_bytes + n].view(dtype).view(shape)


@needs_cpu_op("recurrent_kda")
def test_fastpath_accepts_the_valid_call():
    kw = _call()
    o, _ = kda_ops.recurrent_kda(**kw)
    assert o is kw["output"]


# --- empty tensors: "contiguous" whatever their strides, so the last-dim rule is checked one by one


@pytest.mark.parametrize("name", ["q", "k", "v", "g", "beta"])
def test_empty_token_tensor_with_strided_last_dim(name):
    x = inputs(B=2, T=0, H=1, HV=2, K=K, V=V, N_pool=4)
    kw = _call(
        **{n: x[n] for n in ("q", "k", "v", "g", "beta")},
        output=torch.zeros(2, 0, 2, V, dtype=torch.bfloat16),
    )
    t = kw[name]
    kw[name] = torch.zeros(*t.shape[:-1], 2 * t.shape[-1], dtype=t.dtype)[..., ::2]
    assert kw[name].is_contiguous() and kw[name].stride(-1) == 2
    _rejects(kw, ValueError, name)


def test_empty_output_with_strided_last_dim():
    x = inputs(B=2, T=0, H=1, HV=2, K=K, V=V, N_pool=4)
    out = torch.zeros(2, 0, 2, 2 * V, dtype=torch.bfloat16)[..., ::2]
    kw = _call(**{n: x[n] for n in ("q", "k", "v", "g", "beta")}, output=out)
    _rejects(kw, ValueError, "output")


# --- overlap: every written tensor against every read, spans from strides


def test_output_overlaps_the_tail_of_a_padded_pool():
    inner = 2 * V * K
    base = torch.zeros(4 * (inner + 16) + 2 * 2 * V, dtype=torch.bfloat16)
    pool = base.as_strided((4, 2, V, K), (inner + 16, V * K, K, 1))
    last = 3 * (inner + 16) + inner  # one past the last element of the last slot
    out = base[last - 8 : last - 8 + 2 * 2 * V].view(2, 1, 2, V)  # its first 8 elements are the pool's last
    _rejects(_call(initial_state=pool, output=out), ValueError, "output")


@needs_cpu_op("recurrent_kda")
def test_output_next_to_a_padded_pool_is_accepted():
    inner = 2 * V * K
    base = torch.zeros(4 * (inner + 16) + 2 * 2 * V, dtype=torch.bfloat16)
    pool = base.as_strided((4, 2, V, K), (inner + 16, V * K, K, 1))
    last = 3 * (inner + 16) + inner
    out = base[last : last + 2 * 2 * V].view(2, 1, 2, V)
    kda_ops.recurrent_kda(**_call(initial_state=pool, output=out))


@pytest.mark.parametrize("victim", ["A_log", "dt_bias", "ssm_state_indices"])
def test_output_overlaps_a_parameter_or_index(victim):
    # The victim is a view of the output's memory (same bytes, the victim's dtype and shape).
    out = torch.zeros(2, 1, 2, V, dtype=torch.bfloat16)
    kw = _call(output=out)
    t = kw[victim]
    kw[victim] = _bytes_of(out, t.dtype, tuple(t.shape))
    if victim == "ssm_state_indices":
        kw[victim].zero_()
    _rejects(kw, ValueError, "output")


@pytest.mark.parametrize("layout", ["strided", "per-qk-head", "flat"])
def test_output_overlaps_a_normalised_parameter(layout):
    # A_log / dt_bias that check_gate copies (non-contiguous, [H] expanded to [HV], flat [HV*K]): the
    # overlap check still looks at the caller's tensor.
    out = torch.zeros(2, 1, 2, V, dtype=torch.bfloat16)
    raw = _bytes_of(out, torch.float32, (2 * V,))  # the output's 256 bytes as fp32
    if layout == "strided":
        kw = _call(output=out, A_log=raw[:4:2])
    elif layout == "per-qk-head":
        kw = _call(output=out, A_log=raw[:1])  # H = 1, HV = 2: [H] is expanded
    else:
        kw = _call(output=out, dt_bias=raw[: 2 * K])
    _rejects(kw, ValueError, "output")


@pytest.mark.parametrize("victim", ["q", "k", "v", "g", "beta", "A_log", "ssm_state_indices"])
def test_pool_overlaps_a_read(victim):
    pool = torch.zeros(4, 2, V, K, dtype=torch.bfloat16)
    kw = _call(initial_state=pool, output=None)
    t = kw[victim]
    kw[victim] = _bytes_of(pool, t.dtype, tuple(t.shape), offset_bytes=3 * 2 * V * K * 2 + 64)
    if victim == "ssm_state_indices":
        kw[victim].zero_()
    _rejects(kw, ValueError, "initial_state")


def test_output_overlaps_pool_and_read_first_error_is_the_read():
    # output overlaps both v (a read) and the pool: the read comes first in the documented order.
    pool = torch.zeros(4, 2, V, K, dtype=torch.bfloat16)
    kw = _call(initial_state=pool)
    kw["v"] = _bytes_of(pool, torch.bfloat16, (2, 1, 2, V))
    kw["output"] = _bytes_of(pool, torch.bfloat16, (2, 1, 2, V), offset_bytes=8)
    with pytest.raises(ValueError, match="output must not overlap v"):
        kda_ops.recurrent_kda(**kw)


def test_checkpoints_overlap_a_read():
    x = inputs(B=1, T=32, H=1, HV=2, K=K, V=V, N_pool=2)
    ck = torch.zeros(2, 2, V, K)
    kw = dict(
        q=x["q"],
        k=x["k"],
        v=x["v"],
        g=x["g"],
        beta=x["beta"],
        initial_state=x["initial_state"],
        checkpoint_every_n_tokens=16,
        state_checkpoints=ck,
        checkpoint_cu_starts=_bytes_of(ck, torch.int64, (2,)).copy_(torch.tensor([0, 2])),
    )
    _rejects(kw, ValueError, "state_checkpoints")


@needs_cpu_op("recurrent_kda")
def test_empty_reads_never_overlap():
    # Zero-size tensors have no memory (as before the fast path): an empty v viewing the pool's bytes is
    # fine when T == 0.
    x = inputs(B=2, T=0, H=1, HV=2, K=K, V=V, N_pool=4)
    pool = torch.zeros(4, 2, V, K, dtype=torch.bfloat16)
    kw = _call(**{n: x[n] for n in ("q", "k", "g", "beta")}, initial_state=pool, output=None)
    kw["v"] = pool.reshape(-1)[:0].view(2, 0, 2, V)
    kda_ops.recurrent_kda(**kw)


def test_implicit_slots_need_a_pool_of_n_slots():
    """Without ssm_state_indices, sequence n uses slot n: a pool with fewer than N slots is a ValueError
    naming initial_state (not silently inactive sequences), and nothing is written."""
    import pytest
    import torch

    import kda_ops
    from kda_ops.reference import make_inputs

    x = make_inputs(T=8, H=1, HV=1, K=64, V=64, N_pool=1, cu_seqlens=[0, 5, 8])
    pool = x["initial_state"]
    before = pool.clone()
    with pytest.raises(ValueError, match="initial_state"):
        kda_ops.recurrent_kda(x["q"], x["k"], x["v"], x["g"], x["beta"], initial_state=pool, cu_seqlens=x["cu_seqlens"])
    assert torch.equal(pool, before)


# ---------------------------------------------------------------------------------------------------
# the C++ key of the validation cache (kda_ops._C.tensor_call_key): equal exactly when every property the
# full path validated is equal, None for what must take the full path


def test_tensor_call_key_properties():
    from kda_ops import _C

    key = _C.tensor_call_key
    a, w = torch.zeros(2, 3), torch.zeros(4)
    assert key(1, a, None, w) == key(1, torch.ones(2, 3), None, torch.ones(4))  # values and addresses do not count
    variants = [
        key(1, a.t(), None, w),  # strides
        key(1, a.view(3, 2), None, w),  # sizes
        key(1, a.double(), None, w),  # dtype
        key(1, torch.nn.Parameter(a), None, w),  # Python type
        key(1, a, a, w),  # an argument present instead of None
        key(1, None, a, w),  # ...in another position
        key(1, torch.empty(2, 3, device="meta"), None, w),  # device
    ]
    assert all(isinstance(x, bytes) for x in variants)
    assert len({key(1, a, None, w), *variants}) == len(variants) + 1


def test_tensor_call_key_declines():
    from torch._subclasses.fake_tensor import FakeTensorMode

    from kda_ops import _C

    key = _C.tensor_call_key
    buf = torch.zeros(16)
    assert key(1, buf[:8], buf[4:12]) is None  # the written tensor overlaps a read
    assert key(2, buf[:8], buf[7:12]) is None  # ...or the other written tensor
    assert key(1, buf[:8], buf[8:12]) is not None  # adjacent is fine
    assert key(1, buf[:4], buf[8:]) is not None and key(0, buf, buf) is not None  # reads may overlap each other
    assert key(1, buf[:0], buf) is not None  # an empty tensor has no memory
    assert key(1, buf, [1, 2]) is None and key(1, 3, buf) is None  # not a tensor
    with FakeTensorMode():
        fake = torch.empty(4)
    assert key(0, fake) is None  # tensor subclasses take the full path
    with pytest.raises(ValueError):
        key(2, buf)
    with pytest.raises(TypeError):
        key()


def test_cached_call_still_rejects_overlap():
    """After a call with this key was validated and cached, an overlapping output is still refused."""
    kw = _call()
    kda_ops.recurrent_kda(**kw)
    pool = kw["initial_state"]
    kw2 = dict(kw, output=pool.view(-1)[8 : 8 + 2 * 2 * V].view(2, 1, 2, V))
    _rejects(kw2, ValueError, "output")
