"""The folded WY operand order of the chunked reference (kda_ops/reference_chunked.py, "Folded WY operands"):
exact in fp64, within docs/contract.md "Tolerances" with the planned kernel's operand roundings (fp16 INVb),
and the default order untouched. Numbers at larger sizes: docs/design.md "Folded WY operands: precision".
"""

from __future__ import annotations

import pytest
import torch
from test_reference_chunked import ARGS, GATES, RECOMMENDED, _assert_equal, _both, _inputs

from kda_ops.reference import rel_rms
from kda_ops.reference_chunked import (
    FOLDED_GEMM_NAMES,
    ChunkTrace,
    _make_round,
    chunked_kda_reference,
)

BF16, FP16 = torch.bfloat16, torch.float16
# the planned kernel (operand_dtype=bf16 besides): INVb fp16 (K⁺ / V converted from bf16), W' bf16, V' fp16,
# R / Mqk / Kr fp16 as today
FOLDED_FP16_INVB = {"INVb": FP16, "Vp": FP16, "O_intra": FP16, "S": FP16}
FOLDED_BF16_INVB = {"Vp": FP16, "O_intra": FP16, "S": FP16}


@pytest.mark.parametrize("gate", list(GATES))
@pytest.mark.parametrize("chunk_size", [16, 64])
def test_folded_exact_fp64(gate, chunk_size):
    """Packed with an empty row, GQA, checkpoints that cut chunks: the folded order is the same algebra."""
    inp = _inputs(gate, H=1, HV=2, seed=3, cu_seqlens=[0, 37, 37, 130])
    ref, got = _both(
        inp,
        beta_is_logit=True,
        checkpoint_every_n_tokens=48,
        chunked_chunk_size=chunk_size,
        chunked_folded_wy=True,
        **GATES[gate],
    )
    _assert_equal(ref, got, ckpt=True)


def test_folded_false_is_the_default():
    """folded_wy=False is the default order bit for bit (with and without operand rounding)."""
    inp = _inputs("lower_bound", T=70, H=1, HV=2, seed=5)
    args = [inp[a] for a in ARGS]
    kw = dict(initial_state=inp["initial_state"], beta_is_logit=True, chunk_size=16, **GATES["lower_bound"])
    for prec in (dict(), dict(operand_dtype=BF16, gemm_dtypes=RECOMMENDED)):
        a = chunked_kda_reference(*args, inp["A_log"], inp["dt_bias"], **kw, **prec)
        b = chunked_kda_reference(*args, inp["A_log"], inp["dt_bias"], **kw, **prec, folded_wy=False)
        assert torch.equal(a.output, b.output) and torch.equal(a.final_state, b.final_state)


def test_folded_trace():
    """The trace carries W' and V' (folded only), and R = V' − W' S_0ᵀ."""
    inp = _inputs("softplus", T=40, H=1, HV=2, seed=6)
    args = [inp[a] for a in ARGS]
    kw = dict(initial_state=inp["initial_state"], beta_is_logit=True, chunk_size=16, **GATES["softplus"])
    plain: list[ChunkTrace] = []
    chunked_kda_reference(*args, inp["A_log"], inp["dt_bias"], **kw, trace=plain)
    assert all(t.W is None and t.Vp is None for t in plain)
    folded: list[ChunkTrace] = []
    chunked_kda_reference(*args, inp["A_log"], inp["dt_bias"], **kw, folded_wy=True, trace=folded)
    assert len(folded) == 3
    for t, p in zip(folded, plain, strict=True):
        assert t.W is not None and t.Vp is not None
        torch.testing.assert_close(t.R, t.Vp - t.W @ t.S0.transpose(1, 2), rtol=0, atol=1e-12)
        torch.testing.assert_close(t.R, p.R, rtol=0, atol=1e-10)


@pytest.mark.parametrize("gate", list(GATES))
def test_folded_operand_budget(gate):
    """fp16 INVb: every tolerance of docs/contract.md "Tolerances" (as today's order: measured at T = 300 output
    1.7-2.8e-3, state 3.7-4.1e-4; today 1.7-2.8e-3 / 3.6-3.7e-4). bf16 INVb misses the fp32-state limit
    (1.4-1.7e-3): the V' = INVb V product then loses ~2^-9 relative, as R = INV Y with bf16 operands does."""
    inp = _inputs(gate, T=300, H=1, HV=2, seed=21)
    errs = {}
    for name, gemm_dtypes in (("fp16", FOLDED_FP16_INVB), ("bf16", FOLDED_BF16_INVB)):
        ref, got = _both(
            inp,
            beta_is_logit=True,
            checkpoint_every_n_tokens=128,
            chunked_chunk_size=16,
            chunked_operand_dtype=BF16,
            chunked_gemm_dtypes=gemm_dtypes,
            chunked_folded_wy=True,
            **GATES[gate],
        )
        out16 = got.output.to(BF16)  # the kernel stores bf16 outputs
        states = [(got.final_state, ref.final_state)] + list(zip(got.checkpoints, ref.checkpoints, strict=True))
        errs[name] = (
            rel_rms(out16, ref.output),
            (out16.double() - ref.output).abs().max().item(),
            max(rel_rms(a, b) for a, b in states),
        )
    out, out_abs, state = errs["fp16"]
    assert out <= 4e-3 and out_abs <= 2e-2, errs
    assert state <= 7e-4, errs  # limit 1e-3
    assert errs["bf16"][2] > 1e-3, errs  # documents why INVb stays fp16


def test_folded_near_collinear_keys_high_beta():
    """The adversarial case of test_reference_chunked.py (one key + 1e-3 noise, β logit 8, almost no decay):
    finite, and no worse than today's order (at C = 16 both measured 4.0e-3 output (fp32), 2.2e-3 state)."""
    inp = _inputs("lower_bound", T=130, H=1, HV=2, seed=4)
    base = torch.randn(1, 1, 1, 128, generator=torch.Generator().manual_seed(1))
    noise = torch.randn(inp["k"].shape, generator=torch.Generator().manual_seed(2)) * 1e-3
    inp["k"] = (base + noise).to(inp["k"].dtype)
    inp["beta"] = torch.full_like(inp["beta"], 8.0)
    inp["g"] = torch.full_like(inp["g"], -12.0)
    errs = {}
    for name, extra in (
        ("today", dict(gemm_dtypes=RECOMMENDED)),
        ("folded", dict(gemm_dtypes=FOLDED_FP16_INVB, folded_wy=True)),
    ):
        ref, got = _both(
            inp,
            beta_is_logit=True,
            chunked_chunk_size=16,
            chunked_operand_dtype=BF16,
            **{f"chunked_{k}": x for k, x in extra.items()},
            **GATES["lower_bound"],
        )
        assert torch.isfinite(got.output).all() and torch.isfinite(got.final_state).all()
        errs[name] = (rel_rms(got.output, ref.output), rel_rms(got.final_state, ref.final_state))
    assert errs["folded"][0] <= 1e-2 and errs["folded"][1] <= 4e-3, errs
    assert errs["folded"][0] <= 1.25 * errs["today"][0] and errs["folded"][1] <= 1.25 * errs["today"][1], errs


def test_folded_names_and_saturation():
    inp = _inputs("softplus", T=4, H=1, HV=1, seed=0)
    args = [inp[a] for a in ARGS]
    assert set(FOLDED_FP16_INVB) <= set(FOLDED_GEMM_NAMES)
    with pytest.raises(ValueError):  # "R" (INV Y) is not a product of the folded order
        chunked_kda_reference(*args, folded_wy=True, gemm_dtypes={"R": FP16})
    with pytest.raises(ValueError):  # and "INVb" not one of the default order
        chunked_kda_reference(*args, gemm_dtypes={"INVb": FP16})
    x = torch.tensor([1e6, -7e4, 65504.0, 1.0, -0.5], dtype=torch.float32)
    assert _make_round(FP16, saturate=True)(x).tolist() == [65504.0, -65504.0, 65504.0, 1.0, -0.5]
    assert torch.isinf(_make_round(FP16)(x)[:2]).all()
