"""The chunked backward reference with single fp16 products under power-of-two scales (operand_mode="fp16" of
kda_ops.reference_chunked_backward.chunked_training_grads) against fp64 autograd through the token loop: the scheme
benchmarks/profiling/backward_fp16_precision.py recommends stays within docs/contract.md's 1e-2 on a few of its
cases, and the default modes are unchanged, on CPU."""

from __future__ import annotations

import pytest
import torch
from _training_cases import PINNED_UNCOMPARED  # noqa: F401  (puts the repository root on sys.path)

from benchmarks.profiling.backward_fp16_precision import CASES, RECOMMENDED, RECOMMENDED_TAPES, case_errors
from kda_ops.reference import make_inputs, reference_training_grads, rel_rms
from kda_ops.reference_chunked_backward import chunked_training_grads, round_fp16_scaled, round_state_storage


def _small_args(T=70, K=32):
    x = make_inputs(B=1, T=T, H=1, HV=2, K=K, V=K, seed=2)
    gen = torch.Generator().manual_seed(3)
    do = torch.randn(1, T, 2, K, generator=gen).bfloat16()
    dfin = torch.randn(1, 2, K, K, generator=gen) * 0.1
    return (x["q"], x["k"], x["v"], x["g"], x["beta"], x["A_log"], x["dt_bias"], x["initial_state"], do, dfin)


def test_default_modes_unchanged():
    """Without operand_mode: fp64 equals autograd, and operand_dtype=bf16 gives the bits of operand_mode="bf16"
    (the same roundings by the two routes)."""
    args = _small_args()
    ref = reference_training_grads(*args)[2]
    for a, e in zip(chunked_training_grads(*args, blocked=True), ref, strict=True):
        assert rel_rms(a, e) < 1e-10
    for blocked in (False, True):
        old = chunked_training_grads(*args, operand_dtype=torch.bfloat16, blocked=blocked)
        new = chunked_training_grads(*args, operand_mode="bf16", blocked=blocked)
        assert all(torch.equal(a, b) for a, b in zip(old, new, strict=True))


def test_softplus_gate_matches_autograd():
    """lower_bound=None: the softplus gate, fp64, against autograd."""
    args = _small_args()
    ref = reference_training_grads(*args, lower_bound=None)[2]
    got = chunked_training_grads(*args, lower_bound=None, blocked=True)
    for a, e in zip(got, ref, strict=True):
        assert rel_rms(a, e) < 1e-10


@pytest.mark.parametrize("granularity", ["tensor", "tile", "row"])
def test_round_fp16_scaled(granularity):
    """A power-of-two scale: the group's largest magnitude lands in [2^14, 2^15) before the fp16 rounding, so the
    result does not depend on the operand's magnitude, and every entry within 2^-28 of its group's largest keeps
    fp16's relative precision."""
    x = torch.randn(2, 128, 96, dtype=torch.float64, generator=torch.Generator().manual_seed(0))
    r = round_fp16_scaled(x, granularity, "A")
    assert torch.equal(round_fp16_scaled(x * 2.0**-60, granularity, "A"), r * 2.0**-60)
    assert torch.equal(
        round_fp16_scaled(x * 2.0**40, granularity, "B"), round_fp16_scaled(x, granularity, "B") * 2.0**40
    )
    assert ((r - x).abs() <= x.abs() * 2.0**-11).all()
    normal = x.abs() >= 2.0**-14  # in fp16's normal range: plain fp16 rounding
    assert torch.equal(r[normal], x.to(torch.float16).to(torch.float64)[normal])
    assert torch.equal(round_fp16_scaled(torch.zeros(1, 3, 3), granularity), torch.zeros(1, 3, 3))


def test_fine_groups_keep_small_rows():
    """A row 2^-40 below the rest: per-row scales keep its precision, one scale per tensor flushes it."""
    x = torch.randn(1, 4, 8, dtype=torch.float64, generator=torch.Generator().manual_seed(1))
    x[:, 0] *= 2.0**-40
    assert rel_rms(round_fp16_scaled(x, "row", "A")[:, 0], x[:, 0]) < 2.0**-11
    assert rel_rms(round_fp16_scaled(x, "tensor", "A")[:, 0], x[:, 0]) > 1e-2


@pytest.mark.parametrize("case", ["T=65", "heavy-tailed S0 T=65", "dβ T=1 seed 101", "softplus K=64 T=17"])
def test_recommended_scheme_within_tolerance(case):
    """Single fp16 products, one scale per operand, bf16 hi + lo for dR_S and dY: every gradient <= 1e-2 (measured
    <= 2e-3 here), and the rounding applied (dq above fp32's ~1e-6)."""
    errs = case_errors(case, {"rec": RECOMMENDED})["rec"]
    assert max(errs.values()) <= 1e-2, errs
    assert errs["dq"] > 3e-5, errs


def test_single_fp16_fails_the_cancelling_one_token_case():
    """Without hi + lo anywhere, dβ of the cancelling one-token case is ~5e-2 whatever the scale granularity: why
    dR_S and dY keep ~16-bit operands."""
    errs = case_errors("dβ T=1 seed 101", {"fp16": dict(operand_mode="fp16", scale_granularity="row")})["fp16"]
    assert errs["dbeta"] > 2e-2, errs
    assert "dβ T=1 seed 101" in CASES


@pytest.mark.parametrize("case", ["T=65", "dβ T=1 seed 101"])
def test_fp16_tapes_cost_nothing(case):
    """Tapes stored as fp16 under one power-of-two scale per head (half the bytes of fp32) on top of the recommended
    products: every gradient <= 1e-2, within 10% of the same scheme with fp32 tapes; storing the chain's dS_C rows
    in fp16 as well breaks the cancelling one-token dβ (it reaches dR_S = Kr dS_Cᵀ in full): why dS_C stays fp32."""
    errs = case_errors(case, {"fp32": RECOMMENDED, "tapes": RECOMMENDED_TAPES})
    assert max(errs["tapes"].values()) <= 1e-2, errs["tapes"]
    assert max(errs["tapes"].values()) <= 1.1 * max(errs["fp32"].values()), errs
    if case == "dβ T=1 seed 101":
        both = dict(RECOMMENDED_TAPES, ds_storage="fp16_rows16")
        assert case_errors(case, {"both": both})["both"]["dbeta"] > 2e-2


def test_round_state_storage():
    """The stored forms: fp32 as is; bf16 and fp16 within their unit roundoff; an fp16 group's scale makes the result
    independent of the state's magnitude; a bad name raises."""
    x = torch.randn(2, 32, 16, dtype=torch.float64, generator=torch.Generator().manual_seed(2))
    assert torch.equal(round_state_storage(x, "fp32"), x)
    assert ((round_state_storage(x, "bf16") - x).abs() <= x.abs() * 2.0**-8).all()
    for s in ("fp16_head", "fp16_rows16"):
        r = round_state_storage(x, s)
        assert ((r - x).abs() <= x.abs() * 2.0**-11 + 2.0**-24 * x.abs().max()).all()
        assert torch.equal(round_state_storage(x * 2.0**50, s), r * 2.0**50)
    with pytest.raises(ValueError, match="tape_storage"):
        round_state_storage(x, "fp8")
