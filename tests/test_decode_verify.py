"""recurrent_kda(disable_state_update=True): a speculative verify pass on the CPU op.

A verify pass computes the outputs of every token (decode, speculative decode with 1+S tokens, prefill) by
the same slot and activity rules as a committing call, and writes no slot of the state pool: neither the
final write of decode/prefill nor the per-token columns of speculative decode. final_state (only without a
pool) and state_checkpoints are caller buffers, not pool slots, and are written as usual.

Checked bit for bit against the committing call on a copy of the same pool (the outputs) and against the
pool's bytes before the call (nothing written), and against the fp64 reference for the outputs.
"""

from __future__ import annotations

import math

import pytest
import torch

import kda_ops  # noqa: F401  (loads torch.ops.kda)
from kda_ops.reference import make_inputs, recurrent_kda_reference, rel_rms

OPS = torch.ops.kda


def _op(
    inp,
    *,
    state,
    verify,
    spec=0,
    ssm=None,
    n_acc=None,
    cu=None,
    source=None,
    source_idx=None,
    final_state=None,
    ckpt=None,
    ckpt_starts=None,
    ckpt_every=0,
):
    q, k, v, g, beta = (inp[n] for n in ("q", "k", "v", "g", "beta"))
    out = torch.full_like(v, float("nan"))  # every element must be written
    OPS.recurrent_kda.default(
        q,
        k,
        v,
        g,
        beta,
        inp["A_log"],
        inp["dt_bias"],
        state,
        source,
        source_idx,
        cu,
        ssm,
        n_acc,
        None,
        out,
        final_state,
        ckpt,
        ckpt_starts,
        None,
        1.0 / math.sqrt(q.shape[-1]),
        2,
        -5.0,
        True,
        True,
        spec,
        ckpt_every,
        0,
        disable_state_update=verify,
    )
    return out


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous().view(torch.uint8) if t.dtype != torch.float64 else t.contiguous().view(torch.int64)


def assert_bits(a: torch.Tensor, b: torch.Tensor, what: str) -> None:
    assert a.dtype == b.dtype and a.shape == b.shape, what
    assert torch.equal(_bits(a), _bits(b)), f"{what}: not bit-identical"


def _both(inp, pool, **kw):
    """(verify output, commit output, pool after commit); asserts the verify pass left `pool` untouched."""
    before = pool.clone()
    o_verify = _op(inp, state=pool, verify=True, **kw)
    assert_bits(pool, before, "pool after a verify pass")
    committed = pool.clone()
    o_commit = _op(inp, state=committed, verify=False, **kw)
    assert_bits(o_verify, o_commit, "verify output vs committing output")
    return o_verify, o_commit, committed


@pytest.mark.parametrize("state_dtype", [torch.float32, torch.bfloat16])
def test_decode_writes_nothing(state_dtype):
    B, N_pool = 3, 6
    inp = make_inputs(
        B=B, T=1, H=2, HV=4, K=64, V=64, dtype=torch.bfloat16, state_dtype=state_dtype, seed=1, N_pool=N_pool
    )
    pool = inp["initial_state"]
    ssm = torch.tensor([4, -1, 1], dtype=torch.int32)  # sequence 1 is inactive (slot outside the pool)
    o, _, committed = _both(inp, pool, ssm=ssm)
    assert not torch.equal(committed[4], pool[4]), "the committing call does write (the test can fail)"
    assert o[1].abs().max() == 0, "inactive sequence: zero output"
    ref = recurrent_kda_reference(
        inp["q"],
        inp["k"],
        inp["v"],
        inp["g"],
        inp["beta"],
        A_log=inp["A_log"],
        dt_bias=inp["dt_bias"],
        initial_state=pool[torch.tensor([4, 0, 1])].double(),
        use_gate_in_kernel=True,
        lower_bound=-5.0,
        beta_is_logit=True,
    )
    for b in (0, 2):
        assert rel_rms(o[b], ref.output[b]) < 2e-2


@pytest.mark.parametrize("state_dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("packed", [False, True])
def test_spec_decode_writes_nothing(state_dtype, packed):
    S = 3
    N, N_pool = 3, 12
    if packed:
        cu = [0, 4, 8, 12]
        inp = make_inputs(
            T=12,
            H=1,
            HV=2,
            K=128,
            V=128,
            dtype=torch.bfloat16,
            state_dtype=state_dtype,
            seed=2,
            cu_seqlens=cu,
            N_pool=N_pool,
        )
        cu_t = inp["cu_seqlens"]
    else:
        inp = make_inputs(
            B=N, T=S + 1, H=1, HV=2, K=128, V=128, dtype=torch.bfloat16, state_dtype=state_dtype, seed=2, N_pool=N_pool
        )
        cu_t = None
    # row 2 has an inactive token (slot -1): zero output, the state is not advanced past it
    ssm = torch.tensor([[0, 1, 2, 3], [4, 5, 6, 7], [8, 9, -1, 11]], dtype=torch.int32)
    n_acc = torch.tensor([1, 3, 2], dtype=torch.int32)  # start states from columns 0, 2, 1
    o, _, committed = _both(inp, inp["initial_state"], spec=S, ssm=ssm, n_acc=n_acc, cu=cu_t)
    assert not torch.equal(committed, inp["initial_state"]), "the committing call does write"
    inactive = o[0, 2 * (S + 1) + 2] if packed else o[2, 2]
    assert inactive.abs().max() == 0, "inactive spec token: zero output"


def test_source_start_state_writes_nothing():
    # initial_state_source (read-only start states) with a pool to write to: the verify pass writes no slot
    inp = make_inputs(
        B=3, T=2, H=1, HV=2, K=64, V=64, dtype=torch.bfloat16, state_dtype=torch.float32, seed=3, N_pool=4
    )
    source = torch.randn(5, 2, 64, 64, generator=torch.Generator().manual_seed(7)) * 0.1
    src_idx = torch.tensor([3, 0, -1], dtype=torch.int32)  # the last sequence is inactive
    ssm = torch.tensor([1, 2, 0], dtype=torch.int32)
    o, _, committed = _both(inp, inp["initial_state"], source=source, source_idx=src_idx, ssm=ssm)
    assert not torch.equal(committed[1], inp["initial_state"][1])
    assert o[2].abs().max() == 0


@pytest.mark.parametrize("ck_dtype", [torch.float32, torch.bfloat16])
def test_prefill_checkpoints_still_written(ck_dtype):
    # Checkpoints are a caller buffer (not pool slots): a verify pass fills them exactly as a commit does.
    cu = [0, 5, 5, 14]  # a zero-length sequence in the middle
    inp = make_inputs(
        T=14, H=1, HV=2, K=64, V=64, dtype=torch.bfloat16, state_dtype=torch.float32, seed=4, cu_seqlens=cu, N_pool=3
    )
    every = 4
    starts = torch.tensor([0, 2, 2, 5], dtype=torch.int64)  # ceil(len / every) rows per sequence
    ck_v = torch.full((5, 2, 64, 64), 7.0, dtype=ck_dtype)
    ck_c = ck_v.clone()
    pool = inp["initial_state"]
    before = pool.clone()
    o_v = _op(inp, state=pool, verify=True, cu=inp["cu_seqlens"], ckpt=ck_v, ckpt_starts=starts, ckpt_every=every)
    assert_bits(pool, before, "pool after a verify prefill")
    committed = pool.clone()
    o_c = _op(inp, state=committed, verify=False, cu=inp["cu_seqlens"], ckpt=ck_c, ckpt_starts=starts, ckpt_every=every)
    assert_bits(o_v, o_c, "verify vs commit output")
    assert_bits(ck_v, ck_c, "verify vs commit checkpoints")
    assert not torch.equal(committed, before)
    assert not (ck_v == 7.0).all(), "checkpoints were written"


def test_no_pool_final_state_as_usual():
    # Without a pool there is no slot to skip: final_state (a caller buffer) is written as by a commit.
    inp = make_inputs(B=2, T=3, H=1, HV=2, K=64, V=64, dtype=torch.bfloat16, seed=5)
    fs_v = torch.full((2, 2, 64, 64), 3.0)
    fs_c = fs_v.clone()
    o_v = _op(inp, state=None, verify=True, final_state=fs_v)
    o_c = _op(inp, state=None, verify=False, final_state=fs_c)
    assert_bits(o_v, o_c, "output")
    assert_bits(fs_v, fs_c, "final_state")
    assert not (fs_v == 3.0).all()


def test_default_commits():
    # The argument defaults to False: existing positional callers keep committing.
    inp = make_inputs(B=1, T=1, H=1, HV=2, K=64, V=64, dtype=torch.bfloat16, seed=6)
    pool = inp["initial_state"]
    before = pool.clone()
    q, k, v, g, beta = (inp[n] for n in ("q", "k", "v", "g", "beta"))
    out = torch.empty_like(v)
    OPS.recurrent_kda.default(
        q,
        k,
        v,
        g,
        beta,
        inp["A_log"],
        inp["dt_bias"],
        pool,
        None,
        None,
        None,
        None,
        None,
        None,
        out,
        None,
        None,
        None,
        None,
        0.125,
        2,
        -5.0,
        True,
        True,
        0,
        0,
        0,
    )
    assert not torch.equal(pool, before)


def test_opcheck_verify():
    inp = make_inputs(B=2, T=4, H=1, HV=2, K=64, V=64, dtype=torch.bfloat16, seed=8, N_pool=8)
    q, k, v, g, beta = (inp[n] for n in ("q", "k", "v", "g", "beta"))
    ssm = torch.tensor([[0, 1, 2, 3], [4, 5, 6, 7]], dtype=torch.int32)
    args = (
        q,
        k,
        v,
        g,
        beta,
        inp["A_log"],
        inp["dt_bias"],
        inp["initial_state"],
        None,
        None,
        None,
        ssm,
        None,
        None,
        torch.empty_like(v),
        None,
        None,
        None,
        None,
        0.125,
        2,
        -5.0,
        True,
        True,
        3,
        0,
        0,
        False,
        True,
    )
    torch.library.opcheck(OPS.recurrent_kda.default, args)


# ---------------------------------------------------------------------------------------------------
# the public API


def _api(inp, pool, verify, **kw):
    return kda_ops.recurrent_kda(
        inp["q"],
        inp["k"],
        inp["v"],
        inp["g"],
        inp["beta"],
        A_log=inp["A_log"],
        dt_bias=inp["dt_bias"],
        initial_state=pool,
        use_gate_in_kernel=True,
        lower_bound=-5.0,
        beta_is_logit=True,
        disable_state_update=verify,
        **kw,
    )


@pytest.mark.parametrize("S", [0, 2])
def test_api_verify_then_commit(S):
    B = 3
    inp = make_inputs(B=B, T=1 + S, H=1, HV=2, K=64, V=64, dtype=torch.bfloat16, seed=9, N_pool=B * (1 + S) + 1)
    pool = inp["initial_state"]
    before = pool.clone()
    kw = {}
    if S:
        kw = dict(
            num_spec_tokens=S,
            num_accepted_tokens=torch.tensor([1, 3, 2], dtype=torch.int32),
            ssm_state_indices=torch.arange(B * (1 + S), dtype=torch.int32).reshape(B, 1 + S),
        )
    o_v, fs = _api(inp, pool, True, output_final_state=True, **kw)
    assert fs is pool
    assert_bits(pool, before, "pool after a verify call")
    o_c, _ = _api(inp, pool, False, **kw)
    assert_bits(o_v, o_c, "verify output vs commit output")
    assert not torch.equal(pool, before)


def test_api_verify_rejects_chunked_and_non_bool():
    inp = make_inputs(B=1, T=1, H=1, HV=2, K=64, V=64, dtype=torch.bfloat16, seed=10)
    pool = inp["initial_state"]
    before = pool.clone()
    with pytest.raises(ValueError, match="disable_state_update"):
        kda_ops.recurrent_kda(
            inp["q"],
            inp["k"],
            inp["v"],
            inp["g"],
            inp["beta"],
            A_log=inp["A_log"],
            dt_bias=inp["dt_bias"],
            initial_state=pool,
            use_gate_in_kernel=True,
            lower_bound=-5.0,
            backend="chunked",
            disable_state_update=True,
        )
    with pytest.raises(TypeError, match="disable_state_update"):
        _api(inp, pool, 1)
    assert_bits(pool, before, "nothing written on an error")


# ---------------------------------------------------------------------------------------------------
# the validation cache of decode-like calls (kda_ops/interface.py): a repeated key skips the checks, but the
# addresses and the Python types of the scalars are checked on every call


def _decode_args(seed=11):
    inp = make_inputs(B=2, T=1, H=1, HV=2, K=64, V=64, dtype=torch.bfloat16, seed=seed, N_pool=4)
    return inp, dict(
        A_log=inp["A_log"],
        dt_bias=inp["dt_bias"],
        use_gate_in_kernel=True,
        lower_bound=-5.0,
        beta_is_logit=True,
        ssm_state_indices=torch.tensor([3, 1], dtype=torch.int32),
    )


def test_cache_repeated_call_same_results():
    inp, kw = _decode_args()
    t = [inp[n] for n in ("q", "k", "v", "g", "beta")]
    pools = [inp["initial_state"].clone() for _ in range(3)]
    outs = [kda_ops.recurrent_kda(*t, initial_state=p, **kw)[0] for p in pools]  # the 2nd and 3rd are cached
    for o, p in zip(outs[1:], pools[1:], strict=True):
        assert_bits(o, outs[0], "cached call output")
        assert_bits(p, pools[0], "cached call pool")
    assert not torch.equal(pools[0], inp["initial_state"])


def test_cache_rechecks_overlap_and_scalar_types():
    inp, kw = _decode_args(12)
    t = [inp[n] for n in ("q", "k", "v", "g", "beta")]
    pool = inp["initial_state"]
    out = torch.empty_like(inp["v"])
    kda_ops.recurrent_kda(*t, initial_state=pool.clone(), output=out, **kw)
    kda_ops.recurrent_kda(*t, initial_state=pool.clone(), output=out, **kw)  # cached
    # same key (shape, strides, dtype, device), but the output now aliases v: refused, nothing written
    v_alias = inp["v"].clone()
    before = pool.clone()
    with pytest.raises(ValueError, match="overlap"):
        kda_ops.recurrent_kda(t[0], t[1], v_alias, t[3], t[4], initial_state=pool, output=v_alias, **kw)
    assert_bits(pool, before, "pool after a refused call")
    # an int where a bool belongs (1 == True, same hash) is still a TypeError after a cached bool call
    kw_int = dict(kw, beta_is_logit=1)
    with pytest.raises(TypeError, match="beta_is_logit"):
        kda_ops.recurrent_kda(*t, initial_state=pool, output=out, **kw_int)
    # a pool that aliases the output under a cached key
    with pytest.raises(ValueError, match="overlap"):
        pb, ob = pool.numel() * pool.element_size(), out.numel() * out.element_size()
        flat = torch.zeros(pb + ob, dtype=torch.uint8)
        p2 = flat[:pb].view(pool.dtype).view_as(pool)
        o2 = flat[pb - ob : pb].view(out.dtype).view_as(out)  # the pool's last bytes
        kda_ops.recurrent_kda(*t, initial_state=p2, output=o2, **kw)
    assert_bits(pool, before, "pool untouched")


def test_cache_keys_verify_flag():
    # the verify flag is part of the key: a committing call after verify calls still writes
    inp, kw = _decode_args(13)
    t = [inp[n] for n in ("q", "k", "v", "g", "beta")]
    pool = inp["initial_state"]
    before = pool.clone()
    for _ in range(2):
        kda_ops.recurrent_kda(*t, initial_state=pool, disable_state_update=True, **kw)
        assert_bits(pool, before, "verify")
    kda_ops.recurrent_kda(*t, initial_state=pool, **kw)
    assert not torch.equal(pool, before)
