"""Every validation error of docs/contract.md "Errors", through the public API (CPU tier).

Each case asserts the exception type (TypeError: dtype; ValueError: shape/value/combination;
RuntimeError: device/capture), that the message names the offending argument, and that every tensor
passed in is bit-identical afterwards (validation runs before any write).
"""

from __future__ import annotations

import math

import pytest
import torch
from _builders import _tensors, lower_bound_call, token_args
from conftest import HAS_CUDA, assert_bit_identical, inputs, needs_cpu_op, snapshot
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import kda_ops
from kda_ops.workspace import RecurrentKDATrainingContext

K = V = 64
FAST = settings(max_examples=12, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])


# ---------------------------------------------------------------------------------------------------
# helpers


def rejects(fn, args: tuple, kwargs: dict, exc: type[Exception], name: str) -> str:
    """Calls fn expecting `exc` whose message names `name`; checks no tensor changed. Returns the message."""
    ts = list(_tensors(args)) + list(_tensors(kwargs))
    before = snapshot(*ts)
    with pytest.raises(exc) as ei:
        fn(*args, **kwargs)
    msg = str(ei.value)
    assert type(ei.value) is exc, f"expected {exc.__name__}, got {type(ei.value).__name__}: {msg}"
    assert name in msg, f"message does not name {name!r}: {msg}"
    assert " must " in msg and "got" in msg, f"message not in the house style: {msg}"
    assert_bit_identical(before, *ts)
    return msg


def decode_call(**over):
    """A valid recurrent_kda call: B=2 rows of T=3, H=1, HV=2, fp32 pool of 4 slots, lower-bound gate."""
    x = inputs(B=2, T=3, H=1, HV=2, K=K, V=V, N_pool=4)
    kw = lower_bound_call(x, ssm_state_indices=torch.tensor([3, 1], dtype=torch.int32), output_final_state=True)
    kw.update(over)
    return kw


def packed_call(lengths=(3, 0, 5), **over):
    cu = [0]
    for n in lengths:
        cu.append(cu[-1] + n)
    x = inputs(H=1, HV=2, K=K, V=V, cu_seqlens=cu, N_pool=len(lengths) + 1)
    kw = lower_bound_call(x, cu_seqlens=x["cu_seqlens"])
    kw.update(over)
    return kw


def spec_call(S=2, **over):
    x = inputs(B=2, T=1 + S, H=1, HV=2, K=K, V=V, N_pool=8)
    kw = lower_bound_call(
        x,
        num_spec_tokens=S,
        ssm_state_indices=torch.arange(2 * (1 + S), dtype=torch.int32).view(2, 1 + S),
        num_accepted_tokens=torch.tensor([1, 2], dtype=torch.int32),
    )
    kw.update(over)
    return kw


def train_args(packed=False, dtype=torch.bfloat16, **over):
    if packed:
        x = inputs(
            H=1,
            HV=2,
            K=K,
            V=V,
            cu_seqlens=[0, 3, 7],
            dtype=dtype,
            state_dtype=torch.float64 if dtype == torch.float64 else torch.float32,
        )
    else:
        x = inputs(
            B=2,
            T=4,
            H=1,
            HV=2,
            K=K,
            V=V,
            dtype=dtype,
            state_dtype=torch.float64 if dtype == torch.float64 else torch.float32,
        )
    if dtype == torch.float64:
        x["A_log"], x["dt_bias"] = x["A_log"].double(), x["dt_bias"].double()
    kw = token_args(x)
    if packed:
        kw["cu_seqlens"] = x["cu_seqlens"]
    kw.update(over)
    return kw


def fake_ctx(**over):
    """A training context built by hand (no op call): fixed B=2, T=4, H=1, HV=2."""
    a = train_args()
    ctx = RecurrentKDATrainingContext(
        q=a["q"],
        k=a["k"],
        v=a["v"],
        g=a["g"],
        beta=a["beta"],
        A_log=a["A_log"],
        dt_bias=a["dt_bias"],
        tapes=torch.zeros(0, 2, V, K),  # T = 4: no tape rows (the state before token 0 is initial_state)
        tape_cu_starts=torch.tensor([0, 0, 0]),
        initial_state=torch.zeros(2, 2, V, K),
        cu_seqlens=None,
        scale=0.125,
        lower_bound=-5.0,
    )
    for key, val in over.items():
        setattr(ctx, key, val)
    return ctx


R = kda_ops.recurrent_kda


def with_(kw, **over):
    d = dict(kw)
    d.update(over)
    return d


# ---------------------------------------------------------------------------------------------------
# recurrent_kda: token tensors


def test_valid_calls_pass():
    """The base calls used below are valid (so each rejection is due to the one change made)."""
    for kw in (decode_call(), packed_call(), spec_call()):
        R(**kw)


@needs_cpu_op("recurrent_kda_training_forward")
def test_valid_training_call_passes():
    kda_ops.recurrent_kda_training_forward(**train_args())


def test_unknown_backend():
    rejects(R, (), decode_call(backend="fast"), ValueError, "backend")


@pytest.mark.parametrize(
    "name,shape",
    [("q", (2, 3, 64)), ("k", (2, 3, 1)), ("v", (2, 3, 2 * 64)), ("g", (2, 3, 2, 64, 1)), ("beta", (2, 3, 2, 1))],
)
def test_wrong_rank(name, shape):
    kw = decode_call()
    kw[name] = torch.zeros(shape, dtype=torch.bfloat16)
    rejects(R, (), kw, ValueError, name)


@pytest.mark.parametrize("name", ["k", "g", "beta"])
def test_wrong_shape(name):
    kw = decode_call()
    t = kw[name]
    kw[name] = torch.zeros((*t.shape[:-1], t.shape[-1] + 1), dtype=t.dtype)
    rejects(R, (), kw, ValueError, name)


def test_v_wrong_heads_blames_v():
    """HV is read from v: a v with one head too few must be reported against v, not against g or beta."""
    kw = decode_call()
    t = kw["v"]
    kw["v"] = torch.zeros((t.shape[0], t.shape[1], t.shape[2] - 1, t.shape[3]), dtype=t.dtype)
    with pytest.raises(ValueError, match=r"^v must have the HV="):
        R(**kw)


@pytest.mark.parametrize("dim", [1, 3], ids=["T", "K"])
def test_q_wrong_shape_blames_q(dim):
    """The shapes are read from q: a q with a wrong T or K (k, v, g agreeing) is reported against q, not k."""
    kw = decode_call()
    t = kw["q"]
    shape = list(t.shape)
    shape[dim] += 1
    kw["q"] = torch.zeros(shape, dtype=t.dtype)
    with pytest.raises(ValueError, match=r"^q must have shape"):
        R(**kw)


def test_v_wrong_batch():
    kw = decode_call()
    kw["v"] = torch.zeros(3, 3, 2, V, dtype=torch.bfloat16)
    rejects(R, (), kw, ValueError, "v")


@settings(max_examples=12, deadline=None)
@given(
    st.sampled_from(
        [
            ("k", 0),
            ("k", 1),
            ("k", 2),
            ("k", 3),
            ("g", 0),
            ("g", 1),
            ("g", 2),
            ("g", 3),
            ("beta", 0),
            ("beta", 1),
            ("beta", 2),
            ("v", 0),
            ("v", 1),
        ]
    )
)
def test_any_shape_perturbation_rejected(case):
    name, dim = case
    kw = decode_call()
    t = kw[name]
    shape = list(t.shape)
    shape[dim] += 1
    kw[name] = torch.zeros(shape, dtype=t.dtype)
    rejects(R, (), kw, ValueError, name)


def test_hv_not_multiple_of_h():
    x = inputs(B=1, T=2, H=2, HV=3, K=K, V=V)
    rejects(R, (x["q"], x["k"], x["v"], x["g"], x["beta"]), {}, ValueError, "HV")


def test_fp16_tokens():
    kw = decode_call()
    for n in ("q", "k", "v", "g", "beta"):
        kw[n] = kw[n].half()
    rejects(R, (), kw, TypeError, "q")


@settings(max_examples=10, deadline=None)
@given(st.sampled_from(["k", "v", "g", "beta"]), st.sampled_from([torch.float32, torch.float16, torch.float64]))
def test_token_dtype_mismatch(name, dtype):
    kw = decode_call()
    kw[name] = kw[name].to(dtype)
    rejects(R, (), kw, TypeError, name)


def test_integer_tokens():
    kw = decode_call()
    for n in ("q", "k", "v", "g", "beta"):
        kw[n] = kw[n].to(torch.int32)
    rejects(R, (), kw, TypeError, "q")


def test_lastdim_not_contiguous():
    kw = decode_call()
    kw["v"] = kw["v"].transpose(-1, -2).contiguous().transpose(-1, -2)
    rejects(R, (), kw, ValueError, "v")


def test_device_mismatch():
    kw = decode_call()
    kw["initial_state"] = kw["initial_state"].to("meta")
    rejects(R, (), kw, RuntimeError, "initial_state")
    kw = decode_call()
    kw["k"] = kw["k"].to("meta")
    rejects(R, (), kw, RuntimeError, "k")


def test_tensor_argument_of_wrong_type():
    rejects(R, (), decode_call(q=[1.0]), TypeError, "q")


# ---------------------------------------------------------------------------------------------------
# gate, scale


def test_lower_bound_without_gate():
    kw = decode_call(use_gate_in_kernel=False, A_log=None, dt_bias=None, lower_bound=-5.0)
    rejects(R, (), kw, ValueError, "lower_bound")


@settings(max_examples=8, deadline=None)
@given(st.sampled_from([0.0, 0.5, 3.0, math.inf, -math.inf, math.nan]))
def test_lower_bound_not_negative_finite(lb):
    rejects(R, (), decode_call(lower_bound=lb), ValueError, "lower_bound")


def test_a_log_missing_for_gate():
    rejects(R, (), decode_call(A_log=None), ValueError, "A_log")
    rejects(R, (), decode_call(A_log=None, lower_bound=None), ValueError, "A_log")


def test_gate_params_without_gate():
    kw = decode_call(use_gate_in_kernel=False, lower_bound=None, dt_bias=None)
    rejects(R, (), kw, ValueError, "A_log")
    kw = decode_call(use_gate_in_kernel=False, lower_bound=None, A_log=None)
    rejects(R, (), kw, ValueError, "dt_bias")


def test_a_log_wrong_dtype():
    kw = decode_call()
    kw["A_log"] = kw["A_log"].double()
    rejects(R, (), kw, TypeError, "A_log")
    kw = decode_call()
    kw["dt_bias"] = kw["dt_bias"].bfloat16()
    rejects(R, (), kw, TypeError, "dt_bias")


@pytest.mark.parametrize("shape", [(3,), (2, 1), (1,)])
def test_a_log_wrong_shape(shape):
    # HV == H * 2 here would accept [H]; decode_call has H=1, HV=2, so [1] is legal: use H == HV below.
    x = inputs(B=2, T=3, H=2, HV=2, K=K, V=V, N_pool=4)
    kw = decode_call(q=x["q"], k=x["k"], A_log=torch.zeros(shape))
    rejects(R, (), kw, ValueError, "A_log")


@pytest.mark.parametrize("shape", [(2, K + 1), (3 * K,), (2, K, 1), (K,)])
def test_dt_bias_wrong_shape(shape):
    x = inputs(B=2, T=3, H=2, HV=2, K=K, V=V, N_pool=4)
    kw = decode_call(q=x["q"], k=x["k"], dt_bias=torch.zeros(shape))
    rejects(R, (), kw, ValueError, "dt_bias")


@settings(max_examples=10, deadline=None)
@given(st.sampled_from([0.0, -1.0, -1e-9, math.inf, -math.inf, math.nan]))
def test_bad_scale(scale):
    rejects(R, (), decode_call(scale=scale), ValueError, "scale")


def test_scale_wrong_type():
    rejects(R, (), decode_call(scale="0.1"), TypeError, "scale")


def test_bool_flags_wrong_type():
    rejects(R, (), decode_call(output_final_state=1), TypeError, "output_final_state")
    rejects(R, (), decode_call(use_qk_l2norm_in_kernel=None), TypeError, "use_qk_l2norm_in_kernel")


# ---------------------------------------------------------------------------------------------------
# packing


def test_cu_seqlens_with_batch():
    kw = decode_call(cu_seqlens=torch.tensor([0, 3], dtype=torch.int64))
    rejects(R, (), kw, ValueError, "cu_seqlens")


@pytest.mark.parametrize("dtype", [torch.float32, torch.int16, torch.uint8])
def test_cu_seqlens_dtype(dtype):
    kw = packed_call()
    kw["cu_seqlens"] = kw["cu_seqlens"].to(dtype)
    rejects(R, (), kw, TypeError, "cu_seqlens")


def test_cu_seqlens_too_short():
    kw = packed_call()
    kw["cu_seqlens"] = torch.tensor([0], dtype=torch.int64)
    rejects(R, (), kw, ValueError, "cu_seqlens")
    kw["cu_seqlens"] = torch.zeros(2, 2, dtype=torch.int64)
    rejects(R, (), kw, ValueError, "cu_seqlens")


@pytest.mark.parametrize("cu", [[1, 3, 8, 8], [0, 3, 8, 7], [0, 5, 3, 8], [0, 3, 3, 9]])
def test_cu_seqlens_values_on_host(cu):
    kw = packed_call(cu_seqlens=torch.tensor(cu, dtype=torch.int64))
    rejects(R, (), kw, ValueError, "cu_seqlens")


def test_seq_order_fixed_layout():
    rejects(R, (), decode_call(seq_order=torch.tensor([1, 0], dtype=torch.int32)), ValueError, "seq_order")


def test_seq_order_not_permutation():
    kw = packed_call(seq_order=torch.tensor([0, 0, 2], dtype=torch.int32))
    rejects(R, (), kw, ValueError, "seq_order")
    kw = packed_call(seq_order=torch.tensor([0, 1], dtype=torch.int32))
    rejects(R, (), kw, ValueError, "seq_order")
    kw = packed_call(seq_order=torch.tensor([2, 1, 0], dtype=torch.int64))
    rejects(R, (), kw, TypeError, "seq_order")


# ---------------------------------------------------------------------------------------------------
# pool, slots, source


def test_pool_wrong_shape():
    kw = decode_call()
    kw["initial_state"] = torch.zeros(4, 2, V, K + 1)
    rejects(R, (), kw, ValueError, "initial_state")
    kw["initial_state"] = torch.zeros(2, V, K)
    rejects(R, (), kw, ValueError, "initial_state")


def test_pool_wrong_dtype():
    kw = decode_call()
    kw["initial_state"] = kw["initial_state"].half()
    rejects(R, (), kw, TypeError, "initial_state")


def test_pool_not_compact():
    kw = decode_call()
    base = torch.zeros(4, 2, V, K + 8)
    kw["initial_state"] = base[..., :K]  # padded rows: not a compact [HV, V, K] block
    rejects(R, (), kw, ValueError, "initial_state")
    base = torch.zeros(4, 2 * V * K + 8)  # padded slot stride, not a multiple of 16
    kw["initial_state"] = base[:, : 2 * V * K].view(4, 2, V, K)
    rejects(R, (), kw, ValueError, "initial_state")


def test_indices_without_pool():
    # accepted since FlashInfer's behaviour is defined (zero slots up to max + 1): the cases are in
    # tests/test_flashinfer_compat.py; a wrong index dtype is still named
    kw = decode_call(initial_state=None)
    kw["ssm_state_indices"] = kw["ssm_state_indices"].to(torch.int64)
    rejects(R, (), kw, TypeError, "ssm_state_indices")


@pytest.mark.parametrize(
    "idx",
    [
        torch.tensor([[3], [1]], dtype=torch.int32),
        torch.tensor([3], dtype=torch.int32),
        torch.tensor([3, 1, 0], dtype=torch.int32),
    ],
)
def test_indices_wrong_shape(idx):
    rejects(R, (), decode_call(ssm_state_indices=idx), ValueError, "ssm_state_indices")


def test_indices_wrong_dtype():
    rejects(R, (), decode_call(ssm_state_indices=torch.tensor([3, 1])), TypeError, "ssm_state_indices")


def test_source_without_indices_and_reverse():
    kw = decode_call()
    src = torch.zeros(3, 2, V, K)
    rejects(R, (), with_(kw, initial_state_source=src), ValueError, "initial_state_indices")
    rejects(
        R,
        (),
        with_(kw, initial_state_indices=torch.tensor([0, 1], dtype=torch.int32)),
        ValueError,
        "initial_state_source",
    )


def test_source_wrong_shape_and_indices_dtype():
    kw = decode_call(initial_state_indices=torch.tensor([0, 1], dtype=torch.int32))
    rejects(R, (), with_(kw, initial_state_source=torch.zeros(3, 2, V, 3)), ValueError, "initial_state_source")
    kw = decode_call(initial_state_source=torch.zeros(3, 2, V, K), initial_state_indices=torch.tensor([0, 1]))
    rejects(R, (), kw, TypeError, "initial_state_indices")


# ---------------------------------------------------------------------------------------------------
# speculative decode


def test_accepted_without_spec():
    kw = decode_call(num_accepted_tokens=torch.tensor([1, 1], dtype=torch.int32))
    rejects(R, (), kw, ValueError, "num_accepted_tokens")


def test_spec_default_slots_need_a_big_enough_pool():
    # without ssm_state_indices, sequence n uses slots n*(1+S) ... n*(1+S)+S (FlashInfer's default)
    kw = spec_call(ssm_state_indices=None)
    kw["initial_state"] = kw["initial_state"][:5]  # 2 sequences * (1+2) tokens need 6
    rejects(R, (), kw, ValueError, "initial_state")


def test_spec_indices_rank():
    rejects(
        R, (), spec_call(ssm_state_indices=torch.tensor([0, 1], dtype=torch.int32)), ValueError, "ssm_state_indices"
    )


def test_spec_wrong_token_count():
    x = inputs(B=2, T=4, H=1, HV=2, K=K, V=V)
    kw = spec_call(q=x["q"], k=x["k"], v=x["v"], g=x["g"], beta=x["beta"])
    rejects(R, (), kw, ValueError, "1+S")


def test_spec_packed_token_count_and_steps():
    x = inputs(H=1, HV=2, K=K, V=V, cu_seqlens=[0, 3, 7])
    base = spec_call(q=x["q"], k=x["k"], v=x["v"], g=x["g"], beta=x["beta"], cu_seqlens=x["cu_seqlens"])
    rejects(R, (), base, ValueError, "1+S")
    x = inputs(H=1, HV=2, K=K, V=V, cu_seqlens=[0, 2, 6])
    base = spec_call(q=x["q"], k=x["k"], v=x["v"], g=x["g"], beta=x["beta"], cu_seqlens=x["cu_seqlens"])
    rejects(R, (), base, ValueError, "cu_seqlens")


def test_spec_negative():
    rejects(R, (), decode_call(num_spec_tokens=-1), ValueError, "num_spec_tokens")


def test_spec_with_checkpoints():
    rejects(R, (), spec_call(checkpoint_every_n_tokens=16), ValueError, "checkpoint_every_n_tokens")


# ---------------------------------------------------------------------------------------------------
# checkpoints


@pytest.mark.parametrize("n", [8, 17, -16, 100])
def test_checkpoint_interval(n):
    rejects(R, (), packed_call(checkpoint_every_n_tokens=n), ValueError, "checkpoint_every_n_tokens")


def test_checkpoint_buffers_without_interval():
    rejects(R, (), packed_call(state_checkpoints=torch.zeros(3, 2, V, K)), ValueError, "state_checkpoints")
    rejects(R, (), packed_call(checkpoint_cu_starts=torch.tensor([0, 1, 1, 2])), ValueError, "checkpoint_cu_starts")


def test_checkpoint_buffer_dtype_shape():
    kw = packed_call(checkpoint_every_n_tokens=16)
    rejects(
        R,
        (),
        with_(kw, state_checkpoints=torch.zeros(2, 2, V, K, dtype=torch.bfloat16)),
        TypeError,
        "state_checkpoints",
    )
    rejects(R, (), with_(kw, state_checkpoints=torch.zeros(2, 2, V, K + 1)), ValueError, "state_checkpoints")
    rejects(
        R,
        (),
        with_(kw, checkpoint_cu_starts=torch.tensor([0, 1, 1, 2], dtype=torch.int32)),
        TypeError,
        "checkpoint_cu_starts",
    )
    rejects(R, (), with_(kw, checkpoint_cu_starts=torch.tensor([0, 1, 2])), ValueError, "checkpoint_cu_starts")


def test_checkpoint_starts_mismatch():
    kw = packed_call(checkpoint_every_n_tokens=16, checkpoint_cu_starts=torch.tensor([0, 1, 2, 3]))
    rejects(R, (), kw, ValueError, "checkpoint_cu_starts")


# ---------------------------------------------------------------------------------------------------
# output buffer, workspace


def test_output_wrong_shape_dtype():
    kw = decode_call()
    rejects(R, (), with_(kw, output=torch.zeros(2, 3, 2, V + 1, dtype=torch.bfloat16)), ValueError, "output")
    rejects(R, (), with_(kw, output=torch.zeros(2, 3, 2, V)), TypeError, "output")


def test_output_overlaps_input():
    kw = decode_call()
    rejects(R, (), with_(kw, output=kw["v"]), ValueError, "output")
    buf = torch.zeros(2, 3, 2, 2 * V, dtype=torch.bfloat16)
    v = buf[..., :V]
    rejects(R, (), with_(kw, v=v, output=buf[..., V:]), ValueError, "output")  # interleaved views of one buffer


def test_output_overlaps_state():
    kw = decode_call()
    pool = kw["initial_state"]
    alias = pool.view(torch.bfloat16).reshape(-1)[: 2 * 3 * 2 * V].view(2, 3, 2, V)
    rejects(R, (), with_(kw, output=alias), ValueError, "output")


def test_workspace_wrong_type():
    rejects(R, (), decode_call(prefill_workspace=torch.zeros(16)), TypeError, "prefill_workspace")


# ---------------------------------------------------------------------------------------------------
# training forward / backward, recurrent_kda_backward, kda


TF = kda_ops.recurrent_kda_training_forward


def test_training_cu_seqlens_cpu_for_fixed():
    rejects(TF, (), train_args(cu_seqlens_cpu=torch.tensor([0, 4])), ValueError, "cu_seqlens_cpu")


def test_training_cu_seqlens_cpu_mismatch_and_invalid():
    a = train_args(packed=True)
    rejects(TF, (), with_(a, cu_seqlens_cpu=torch.tensor([0, 4, 7])), ValueError, "cu_seqlens_cpu")
    rejects(TF, (), with_(a, cu_seqlens_cpu=torch.tensor([0, 3, 6])), ValueError, "cu_seqlens_cpu")
    rejects(TF, (), with_(a, cu_seqlens_cpu=torch.tensor([0, 3, 7], dtype=torch.int32)), TypeError, "cu_seqlens_cpu")
    rejects(TF, (), with_(a, cu_seqlens_cpu=torch.tensor([0, 7])), ValueError, "cu_seqlens_cpu")
    rejects(TF, (), with_(a, cu_seqlens_cpu=torch.tensor([0, 3, 7], device="meta")), RuntimeError, "cu_seqlens_cpu")


@settings(max_examples=8, deadline=None)
@given(st.sampled_from([-5.5, -100.0, 0.0, 0.1, math.nan, -math.inf]))
def test_training_lower_bound_range(lb):
    rejects(TF, (), train_args(lower_bound=lb), ValueError, "lower_bound")


@settings(max_examples=6, deadline=None)
@given(st.sampled_from([0.0, -0.5, math.nan, math.inf]))
def test_training_scale(scale):
    rejects(TF, (), train_args(scale=scale), ValueError, "scale")


def test_training_param_dtypes():
    a = train_args()
    rejects(TF, (), with_(a, A_log=a["A_log"].double()), TypeError, "A_log")
    rejects(TF, (), with_(a, dt_bias=a["dt_bias"].bfloat16()), TypeError, "dt_bias")
    rejects(TF, (), with_(a, initial_state=a["initial_state"].bfloat16()), TypeError, "initial_state")


def test_training_param_shapes():
    a = train_args()
    rejects(TF, (), with_(a, A_log=torch.zeros(1)), ValueError, "A_log")
    rejects(TF, (), with_(a, dt_bias=torch.zeros(2, K - 1)), ValueError, "dt_bias")
    rejects(TF, (), with_(a, initial_state=torch.zeros(3, 2, V, K)), ValueError, "initial_state")
    rejects(TF, (), with_(a, initial_state=None), ValueError, "initial_state")


def test_training_fp16():
    a = train_args()
    for n in ("q", "k", "v", "g", "beta"):
        a[n] = a[n].half()
    rejects(TF, (), a, TypeError, "q")


def test_training_out_buffers():
    a = train_args()
    rejects(TF, (), with_(a, out=torch.zeros(2, 4, 2, V)), TypeError, "out")
    rejects(TF, (), with_(a, out=torch.zeros(2, 4, 2, V + 1, dtype=torch.bfloat16)), ValueError, "out")
    rejects(TF, (), with_(a, final_state_out=torch.zeros(2, 2, V, K + 1)), ValueError, "final_state_out")
    rejects(TF, (), with_(a, out=a["v"]), ValueError, "out")
    rejects(TF, (), with_(a, context_out=object()), TypeError, "context_out")


def test_training_context_out_shapes():
    ctx = fake_ctx(tapes=torch.zeros(5, 2, V, K))
    rejects(TF, (), train_args(context_out=ctx), ValueError, "context_out")


TB = kda_ops.recurrent_kda_training_backward


@needs_cpu_op("recurrent_kda_training_forward", "recurrent_kda_training_backward")
def test_training_backward_initial_state_modified():
    """The context keeps initial_state by reference (the tapes do not repeat the state before token 0): an
    in-place change between forward and backward is reported, naming it, and nothing is written."""
    a = train_args()
    _, _, ctx = TF(**a)
    do = torch.zeros(2, 4, 2, V, dtype=torch.bfloat16)
    TB(ctx, do, None)  # unmodified: fine
    a["initial_state"].add_(1.0)
    rejects(TB, (ctx, do, None), {}, RuntimeError, "initial_state")


def test_training_backward_args():
    ctx = fake_ctx()
    do = torch.zeros(2, 4, 2, V, dtype=torch.bfloat16)
    rejects(TB, (object(), do, None), {}, TypeError, "ctx")
    rejects(TB, (ctx, do.float(), None), {}, TypeError, "do")
    rejects(TB, (ctx, do[:, :3], None), {}, ValueError, "do")
    rejects(TB, (ctx, do, torch.zeros(2, 2, V, K + 1)), {}, ValueError, "dfinal_state")
    rejects(TB, (ctx, do, torch.zeros(2, 2, V, K, dtype=torch.float64)), {}, TypeError, "dfinal_state")
    rejects(TB, (ctx, do, None), {"out": [torch.zeros(1)] * 7}, ValueError, "out")
    rejects(TB, (ctx, do, None), {"out": torch.zeros(8)}, TypeError, "out")
    outs = [
        torch.zeros(2, 4, 1, K, dtype=torch.bfloat16),
        torch.zeros(2, 4, 1, K, dtype=torch.bfloat16),
        torch.zeros(2, 4, 2, V, dtype=torch.bfloat16),
        torch.zeros(2, 4, 2, K, dtype=torch.bfloat16),
        torch.zeros(2, 4, 2, dtype=torch.bfloat16),
        torch.zeros(2),
        torch.zeros(2, K),
        torch.zeros(2, 2, V, K),
    ]
    bad = list(outs)
    bad[5] = torch.zeros(3)
    rejects(TB, (ctx, do, None), {"out": bad}, ValueError, "dA_log")
    bad = list(outs)
    bad[0] = bad[0].float()
    rejects(TB, (ctx, do, None), {"out": bad}, TypeError, "dq")


RB = kda_ops.recurrent_kda_backward


def test_recurrent_backward_args():
    a = train_args()
    do = torch.zeros(2, 4, 2, V, dtype=torch.bfloat16)
    rejects(RB, (), with_(a, do=do, dfinal_state=None, workspace=torch.zeros(4)), TypeError, "workspace")
    rejects(RB, (), with_(a, do=do[..., :-1], dfinal_state=None), ValueError, "do")
    rejects(RB, (), with_(a, do=do, dfinal_state=None, lower_bound=0.0), ValueError, "lower_bound")
    rejects(RB, (), with_(a, do=do, dfinal_state=None, cu_seqlens=torch.tensor([0, 4])), ValueError, "cu_seqlens")


def test_kda_args():
    a = train_args()
    rejects(kda_ops.kda, (), with_(a, initial_state=torch.zeros(1, 2, V, K)), ValueError, "initial_state")
    rejects(kda_ops.kda, (), with_(a, lower_bound=-6.0), ValueError, "lower_bound")
    rejects(kda_ops.kda, (), with_(a, output_final_state="yes"), TypeError, "output_final_state")
    b = train_args(packed=True)
    rejects(kda_ops.kda, (), with_(b, cu_seqlens=b["cu_seqlens"].float()), TypeError, "cu_seqlens")


# ---------------------------------------------------------------------------------------------------
# explicit value helpers


@pytest.mark.parametrize("cu,T", [([1, 4], 4), ([0, 5, 4], 4), ([0, 2, 3], 4), ([0], 0)])
def test_validate_cu_seqlens_rejects(cu, T):
    rejects(kda_ops.validate_cu_seqlens, (torch.tensor(cu), T), {}, ValueError, "cu_seqlens")


def test_validate_cu_seqlens_ok():
    host = kda_ops.validate_cu_seqlens(torch.tensor([0, 0, 3, 4], dtype=torch.int32), 4)
    assert host.dtype == torch.int64 and host.tolist() == [0, 0, 3, 4]
    rejects(kda_ops.validate_cu_seqlens, (torch.tensor([0.0, 4.0]), 4), {}, TypeError, "cu_seqlens")


def test_validate_state_indices():
    idx = torch.tensor([0, -1, 7, 2], dtype=torch.int32)
    kda_ops.validate_state_indices(idx, 4)  # out of range: inactive, legal
    rejects(kda_ops.validate_state_indices, (idx, 4), {"allow_inactive": False}, ValueError, "indices")
    dup = torch.tensor([[0, 1], [1, 5]], dtype=torch.int32)
    rejects(kda_ops.validate_state_indices, (dup, 4), {}, ValueError, "indices")
    kda_ops.validate_state_indices(dup, 4, allow_duplicates=True)
    kda_ops.validate_state_indices(torch.tensor([-1, -1, 9], dtype=torch.int32), 4)  # inactive duplicates are fine


# ---------------------------------------------------------------------------------------------------
# CUDA-only rules


@pytest.mark.gpu
@pytest.mark.skipif(not HAS_CUDA, reason="needs CUDA")
def test_cuda_token_dtype_and_head_dims():
    kw = {k: (v.cuda() if isinstance(v, torch.Tensor) else v) for k, v in decode_call().items()}
    fp32 = dict(kw)
    for n in ("q", "k", "v", "g", "beta"):
        fp32[n] = kw[n].float()
    msg = rejects(R, (), fp32, TypeError, "q")
    assert "CPU" in msg
    x = inputs(B=2, T=3, H=1, HV=2, K=32, V=32, N_pool=4, device="cuda")
    kw32 = dict(
        kw,
        q=x["q"],
        k=x["k"],
        v=x["v"],
        g=x["g"],
        beta=x["beta"],
        A_log=x["A_log"],
        dt_bias=x["dt_bias"],
        initial_state=x["initial_state"],
    )
    rejects(R, (), kw32, ValueError, "K")
    rejects(R, (), dict(kw, backend="chunked"), ValueError, "K")  # K=64 is decode-only


@pytest.mark.gpu
@pytest.mark.skipif(not HAS_CUDA, reason="needs CUDA")
def test_cuda_training_needs_cu_seqlens_cpu():
    x = inputs(H=1, HV=2, K=128, V=128, cu_seqlens=[0, 3, 7], device="cuda")
    a = dict(
        q=x["q"],
        k=x["k"],
        v=x["v"],
        g=x["g"],
        beta=x["beta"],
        A_log=x["A_log"],
        dt_bias=x["dt_bias"],
        initial_state=x["initial_state"][:2],
        cu_seqlens=x["cu_seqlens"],
    )
    rejects(TF, (), a, ValueError, "cu_seqlens_cpu")
