r"""Chunked KDA backward (docs/contract.md "Gradients" in the WY form of "Chunked form"): plain torch, one step per
kernel stage.

The gradient that `kda_ops.reference.reference_training_grads` gets from autograd through the token loop,
computed chunk by chunk the way a chunk-parallel tensor-core backward does. It mirrors the forward of
`kda_ops.reference_chunked` (same notation; read its docstring first) and exists to pin down the algebra
and the order of operations before the CUDA kernels are written.

Per chunk (one sequence, all value heads; q normalised and scaled, k normalised, a = log-decay, β = σ(logit)):

  forward (recomputed from S_0, the chunk's tape row):
    Γ = cumsum(a), g_C = e^{Γ_{c-1}}, K⁺ = k e^{Γ}, Q⁺ = q e^{Γ}, Kr = k e^{Γ_{c-1} - Γ}
    L, Mqk (pair matrices), INV = (I + diag(β) L)^{-1}
    X = K⁺ S_0ᵀ, Y = β (V - X), R = INV Y            (O = Q⁺ S_0ᵀ + Mqk R, S_C = S_0 g_C + Rᵀ Kr)
  backward, given dO [c, V] and dS_C [V, K] (the gradient of the state leaving the chunk):
    dR   = Mqkᵀ dO + Kr dS_Cᵀ                        [c, V]
    dY   = INVᵀ dR                                   [c, V]   (a backward substitution)
    dA   = -dY Rᵀ (strictly lower)                   [c, c]   → dL = diag(β) dA, dβ += rowsum(dA ⊙ L)
    dX   = -β dY,  dv = β dY,  dβ += rowsum(dY ⊙ (V - X))
    dMqk = dO Rᵀ (lower incl. diagonal),  dKr = R dS_C
    dK⁺  = dX S_0,  dQ⁺ = dO S_0                     [c, K]
    dS_0 = dS_C g_C + dOᵀ Q⁺ + dXᵀ K⁺                [V, K]   ← the only serial dependence (the "chain")
    pair terms: for W ∈ {dL (k, k), dMqk (q, k)} with the row operand x and column operand y,
      row_i = Σ_j W_ij y_j e^{Γ_i - Γ_j},  col_j = Σ_i W_ij x_i e^{Γ_i - Γ_j}
    dq = dQ⁺ e^{Γ} + row(dMqk);  dk = dK⁺ e^{Γ} + dKr e^{Γ_{c-1}-Γ} + row(dL) + col(dL) + col(dMqk)
    dΓ = q ⊙ dq + k ⊙ (dK⁺ e^{Γ} + row(dL)) - k ⊙ (dKr e^{Γ_{c-1}-Γ} + col(dL) + col(dMqk))
         and at the last token + Σ_i Kr_i ⊙ dKr_i + g_C ⊙ colsum(dS_C ⊙ S_0)
    da   = reverse cumsum of dΓ over the chunk's tokens.

Chunk-parallel schedule (what the CUDA backward does, with 16-token chunks: the chain is the chunked
kernel run in reverse, step 3 one CTA task per 64-token tape chunk walking its four 16-token chunks):
  1. tapes: S_0 of every chunk (the training forward writes them, every 64 tokens);
  2. chain: dS_C of every chunk, last chunk first (dS_C of the last chunk = dfinal_state), with
     `chain_step` — it needs only dO, Mqk, INV, Kr, Q⁺, K⁺ and g_C of the chunk, not the other gradients;
  3. every chunk independently: `chunk_backward` from (S_0, dS_C);
  4. per token: gate chain rule (a = λ σ(z), z = A (g + dt_bias)), β logit, L2-norm backward, GQA sum.

Exponents: the pair terms are computed here with the exact pairwise factor e^{Γ_i - Γ_j} (masked before
exp, so every factor is <= 1); a kernel uses the relative-reference blocks of `decayed_pair_matrix`.

Tensor-core emulation (`operand_dtype` / `gemm_dtypes` of `chunked_training_grads`, as in
kda_ops/reference_chunked.py): the operands of each named product are rounded right before it and the
product is summed in fp32 (then `dtype` is fp32); the rest (gate, Γ, exponentials, L, Mqk, the inverse, the
pair terms, β and the per-token steps) stays fp32. Names (BWD_GEMM_NAMES): the recompute's "L" (the
off-diagonal 16-token blocks of L and Mqk, factors with the block-start reference; the diagonal blocks stay
exact pairwise sums), "X" (K⁺ S_0ᵀ),
"R" (INV Y), "S" (Rᵀ Kr, the tape update); the chain's and the chunk's "dR_mqk" (Mqkᵀ dO), "dR_S" (Kr dS_Cᵀ),
"dY" (INVᵀ dR), "dA" (dY Rᵀ), "dM" (dO Rᵀ), "dKr" (R dS_C), "dKp" (dX S_0), "dQp" (dO S_0), "dS0" (dOᵀ Q⁺ and
dXᵀ K⁺). The products with the state or its gradient (X, dR_S, dKr, dKp, dQp, dS0, S) are the ones a
64-token wgmma sweep runs as large GEMMs; dA and dM feed dβ and dΓ.

Measured budget (tests/test_reference_chunked_backward.py, `test_operand_precision_budget`, 2026-12-03;
K = V = 128, 64-token chunks, bf16 inputs, vs fp64 autograd through the token loop, relative RMS of each of
the eight gradients; cases T = 1, 65, 300, λ = -1 at T = 1024, gates at the bound, no decay, near-collinear
keys with β ≈ 1, small-norm q and k): fp32 throughout ~1e-7-2e-5; bf16 operands for the products with the
state and its gradient (X, dR_S, dKr, dKp, dQp, dS0, S) worst 4.5e-3 (dA_log, near-collinear keys), most
1e-3-3e-3; every named product in bf16 (dA, dM and L / Mqk's off-diagonal blocks too) worst 4.4e-3, dβ at
most 3.8e-3 (T = 1: 1.1e-3). The factorised form of a 64-token sweep (`chunk_backward_blocked`, 2026-12-04) with
every product bf16 but its off-diagonal pair-term blocks ("P") worst 4.3e-3; "P" in bf16 too puts ddt_bias at
1.3e-2 (T = 65), over the limit, so those blocks stay fp32. The contract's gradient tolerance is 1e-2. Not
emulated: L and Mqk's diagonal blocks, the inverse and the pair terms (fp32 here; the CUDA sweep runs them in
3xTF32). With the gate at the bound the true dg is ~1e-18, below fp32: fp32 itself returns
0 there, so that case compares the other gradients only. These cases do not bound every input: on the GPU tier's
T=1 case (`test_dbeta_at_one_token_needs_kr_dsT_near_fp32`) dβ = dY · (V - X) cancels, and bf16 operands for
dR_S = Kr dS_Cᵀ alone give 2.2e-2, tf32 ones 7.8e-3.

Single fp16 products (`operand_mode` / `scale_granularity` / `product_modes` of `chunked_training_grads`; the
default None keeps the emulation above, bit for bit): each named product in one operand mode, "exact", "bf16" (one
bf16 rounding), "bf16x3" (bf16 hi + lo operands, three products hi·hi + hi·lo + lo·hi: the 64-token sweep's today) or
"fp16": operands bounded by 1 by construction (K⁺, Q⁺, Kr, the factor rows of L / Mqk / the pair terms, Mqk;
BWD_BOUNDED) rounded to fp16 directly, the others (S_0, dS_C, dO, Y, R, dR, dY, dX, INV, dA, dMqk) as
(x 2^-e).to(fp16) 2^e with a power-of-two e per group that puts the group's largest magnitude in [2^14, 2^15): one
group per operand and head ("tensor"), per 64 x 64 tile ("tile"), or per row of an A / column of a B operand
("row"). A power-of-two scale commutes with the rounding in fp16's normal range, so the groups differ only for entries
more than 2^28 below their group's largest. Measured (benchmarks/profiling/backward_fp16_precision.py, docs/design.md
"Backward: fp16 scaled single products (precision)"): fp16 everywhere worst 4.1e-3 on every case but a cancelling
one-token dβ (5.5e-2, any granularity); bf16 hi + lo for dR_S and dY only brings that to 7.4e-4.
"""

from __future__ import annotations

import math

import torch

from kda_ops.reference import l2_normalize, seq_bounds
from kda_ops.reference_chunked import (
    OperandPrecision,
    _make_round,
    _unit_lower_inverse,
    decayed_pair_matrix,
    resolve_gemm_precisions,
)

TAPE_CHUNK = 64
BWD_GEMM_NAMES = ("L", "X", "R", "S", "dR_mqk", "dR_S", "dY", "dA", "dM", "dKr", "dKp", "dQp", "dS0", "P")


class _Gemms:
    """The named products of the backward with their operand rounding (module docstring); exact when empty."""

    def __init__(self, operand_dtype: OperandPrecision = None, gemm_dtypes: dict[str, OperandPrecision] | None = None):
        precs = resolve_gemm_precisions(operand_dtype, gemm_dtypes, BWD_GEMM_NAMES)
        self.round = {name: _make_round(prec) for name, prec in precs.items()}

    def __call__(self, name: str, a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
        r = self.round[name]
        return r(a) @ r(b)


_EXACT = _Gemms()

# Operand modes of `operand_mode` / `product_modes` (module docstring, "Single fp16 products"): "exact" (fp32),
# "bf16" (one bf16 rounding), "bf16x3" (bf16 hi + lo, three products), "fp16" (one fp16 rounding, power-of-two
# scales on the unbounded operands).
OperandMode = str
OPERAND_MODES = ("exact", "bf16", "bf16x3", "fp16")
SCALE_GRANULARITIES = ("tensor", "tile", "row")
SCALE_TILE = 64
FP16_TARGET_EXP = 14  # an unbounded operand's scale maps its largest magnitude into [2^14, 2^15)
# Per product: whether its (A, B) operands are bounded by 1 in magnitude by construction (|q|, |k| <= 1 after the L2
# norm and every decay factor <= 1): K⁺, Q⁺, Kr, the L / Mqk / pair-term factor rows and Mqk itself. The others (S_0,
# dS_C, dO, Y, R, dR, dY, dX, INV, dA, dMqk) get a power-of-two scale in "fp16".
BWD_BOUNDED = {
    "L": (True, True),
    "X": (True, False),
    "R": (False, False),
    "S": (False, True),
    "dR_mqk": (True, False),
    "dR_S": (True, False),
    "dY": (False, False),
    "dA": (False, False),
    "dM": (False, False),
    "dKr": (False, False),
    "dKp": (False, False),
    "dQp": (False, False),
    "dS0": (False, True),
    "P": (False, True),
}


def _split_bf16(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """x = hi + lo + O(2^-16 |x|) with hi, lo bf16 values (in x.dtype)."""
    hi = x.to(torch.bfloat16).to(x.dtype)
    return hi, (x - hi).to(torch.bfloat16).to(x.dtype)


def _scale_exponents(x: torch.Tensor, granularity: str, side: str) -> torch.Tensor:
    """The power-of-two exponent e (x ≈ m 2^e, max |m| in [2^14, 2^15)) of each entry's scale group of a GEMM operand
    x [HV, m, n]: one per head ("tensor"), per 64 x 64 tile ("tile"), or per row of an A operand / column of a B
    operand (side "A" / "B": the index not contracted, "row"). An all-zero group gets e = 0."""
    ax = x.abs()
    if granularity == "tensor":
        amax = ax.amax((1, 2), keepdim=True)
    elif granularity == "row":
        amax = ax.amax(2 if side == "A" else 1, keepdim=True)
    elif granularity == "tile":
        amax = torch.empty_like(ax)
        for i0 in range(0, x.shape[1], SCALE_TILE):
            for j0 in range(0, x.shape[2], SCALE_TILE):
                t = ax[:, i0 : i0 + SCALE_TILE, j0 : j0 + SCALE_TILE]
                amax[:, i0 : i0 + SCALE_TILE, j0 : j0 + SCALE_TILE] = t.amax((1, 2), keepdim=True)
    else:
        raise ValueError(f"scale_granularity must be one of {SCALE_GRANULARITIES}, got {granularity!r}")
    _, ex = torch.frexp(amax)  # amax = f 2^ex, f in [0.5, 1): floor(log2 amax) = ex - 1
    return torch.where(amax > 0, ex - 1 - FP16_TARGET_EXP, torch.zeros_like(ex))


def round_fp16_scaled(x: torch.Tensor, granularity: str = "tile", side: str = "A") -> torch.Tensor:
    """x rounded to fp16 under a power-of-two scale per group (`_scale_exponents`) and scaled back:
    (x 2^-e).to(fp16) 2^e, in x.dtype."""
    e = _scale_exponents(x, granularity, side)
    return torch.ldexp(torch.ldexp(x, -e).to(torch.float16).to(x.dtype), e)


# How the tapes (S_0 of every 64-token chunk) and the chain's dS_C rows are stored between the kernels
# (`tape_storage` / `ds_storage` of `chunked_training_grads`): "fp32" (today), "bf16", "fp16_head" (fp16 under one
# power-of-two scale per head's [V, K] state) or "fp16_rows16" (one per block of 16 value rows: a scale per 4 KB).
TAPE_STORAGES = ("fp32", "bf16", "fp16_head", "fp16_rows16")


def round_state_storage(x: torch.Tensor, storage: str) -> torch.Tensor:
    """A state [HV, V, K] as a tape row / dS_C row of `storage` (TAPE_STORAGES) would hold it, back in x.dtype. The
    fp16 forms scale each group's largest magnitude into [2^14, 2^15) by a power of two (`round_fp16_scaled`)."""
    if storage == "fp32":
        return x
    if storage == "bf16":
        return x.to(torch.bfloat16).to(x.dtype)
    if storage not in TAPE_STORAGES:
        raise ValueError(f"tape_storage must be one of {TAPE_STORAGES}, got {storage!r}")
    HV, V, K = x.shape
    rows = 16 if storage == "fp16_rows16" and V % 16 == 0 else V
    # one scale group per [rows, K] block: the rows of an A operand of shape [HV, V / rows, rows K]
    return round_fp16_scaled(x.reshape(HV, V // rows, rows * K), "row", "A").reshape(x.shape)


class _ModeGemms(_Gemms):
    """`_Gemms` by operand mode per product (OPERAND_MODES): "fp16" rounds the bounded operands (BWD_BOUNDED) to fp16
    directly and the others under a power-of-two scale of `granularity` (`round_fp16_scaled`)."""

    def __init__(self, operand_mode: OperandMode, granularity: str, product_modes: dict[str, OperandMode] | None):
        modes = {name: operand_mode for name in BWD_GEMM_NAMES}
        for name, mode in (product_modes or {}).items():
            if name not in modes:
                raise ValueError(f"product_modes: unknown product {name!r}, expected one of {BWD_GEMM_NAMES}")
            modes[name] = mode
        for mode in modes.values():
            if mode not in OPERAND_MODES:
                raise ValueError(f"operand mode must be one of {OPERAND_MODES}, got {mode!r}")
        if granularity not in SCALE_GRANULARITIES:
            raise ValueError(f"scale_granularity must be one of {SCALE_GRANULARITIES}, got {granularity!r}")
        self.modes, self.granularity = modes, granularity
        # the recompute's L / Mqk off-diagonal blocks take one rounding for both (bounded) operands; bf16x3 there is
        # hi + lo as one ~16-bit value (its dropped lo·lo term is below that rounding)
        one = {
            "exact": _identity_round,
            "bf16": lambda t: t.to(torch.bfloat16).to(t.dtype),
            "bf16x3": _hilo_value,
            "fp16": lambda t: t.to(torch.float16).to(t.dtype),
        }
        self.round = {"L": one[modes["L"]]}

    def _fp16(self, name: str, x: torch.Tensor, side: str) -> torch.Tensor:
        if BWD_BOUNDED[name][0 if side == "A" else 1]:
            return x.to(torch.float16).to(x.dtype)
        return round_fp16_scaled(x, self.granularity, side)

    def __call__(self, name: str, a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
        mode = self.modes[name]
        if mode == "exact":
            return a @ b
        if mode == "bf16":
            return a.to(torch.bfloat16).to(a.dtype) @ b.to(torch.bfloat16).to(b.dtype)
        if mode == "bf16x3":
            (ah, al), (bh, bl) = _split_bf16(a), _split_bf16(b)
            return ah @ bh + (ah @ bl + al @ bh)
        return self._fp16(name, a, "A") @ self._fp16(name, b, "B")


def _identity_round(x: torch.Tensor) -> torch.Tensor:
    return x


def _hilo_value(x: torch.Tensor) -> torch.Tensor:
    hi, lo = _split_bf16(x)
    return hi + lo


def _pair_factors(gamma: torch.Tensor, inclusive: bool) -> torch.Tensor:
    """e^{Γ_i - Γ_j} [HV, c, c, K] for j < i (j <= i if inclusive), exactly 0 elsewhere (masked before exp)."""
    c = gamma.shape[1]
    mask = torch.ones(c, c, dtype=torch.bool, device=gamma.device).tril(0 if inclusive else -1)
    diff = gamma[:, :, None, :] - gamma[:, None, :, :]
    return torch.exp(torch.where(mask[None, :, :, None], diff, torch.full_like(diff, -math.inf)))


def _pair_apply(W: torch.Tensor, x: torch.Tensor, y: torch.Tensor, E: torch.Tensor):
    """row_i = Σ_j W_ij y_j e^{Γ_i-Γ_j}, col_j = Σ_i W_ij x_i e^{Γ_i-Γ_j}; W [HV, c, c], x, y [HV, c, K]."""
    row = torch.einsum("hij,hjk,hijk->hik", W, y, E)
    col = torch.einsum("hij,hik,hijk->hjk", W, x, E)
    return row, col


def chunk_recompute(S0, q, k, v, a, beta, sub: int = 16, mm: _Gemms = _EXACT) -> dict[str, torch.Tensor]:
    """The forward quantities of one chunk that the backward needs (shapes as chunk_forward)."""
    gamma = torch.cumsum(a, dim=1)
    g_last = gamma[:, -1:]
    eg = torch.exp(gamma)
    Kp, Qp, Kr = k * eg, q * eg, k * torch.exp(g_last - gamma)
    L = decayed_pair_matrix(k, k, gamma, sub, False, "pairwise", mm.round["L"])
    Mqk = decayed_pair_matrix(q, k, gamma, sub, True, "pairwise", mm.round["L"])
    INV = _unit_lower_inverse(beta[:, :, None] * L, sub)
    X = mm("X", Kp, S0.transpose(1, 2))
    Y = beta[:, :, None] * (v - X)
    R = mm("R", INV, Y)
    return dict(
        gamma=gamma, eg=eg, gC=torch.exp(g_last[:, 0]), Kp=Kp, Qp=Qp, Kr=Kr, L=L, Mqk=Mqk, INV=INV, X=X, Y=Y, R=R
    )


def chain_step(
    f: dict[str, torch.Tensor], beta: torch.Tensor, dO: torch.Tensor, dS_C: torch.Tensor, mm: _Gemms = _EXACT
) -> torch.Tensor:
    """dS_0 from dS_C [HV, V, K] and dO [HV, c, V]: the serial step of the backward (no other gradient)."""
    dR = mm("dR_mqk", f["Mqk"].transpose(1, 2), dO) + mm("dR_S", f["Kr"], dS_C.transpose(1, 2))
    dX = -beta[:, :, None] * mm("dY", f["INV"].transpose(1, 2), dR)
    return dS_C * f["gC"][:, None, :] + mm("dS0", dO.transpose(1, 2), f["Qp"]) + mm("dS0", dX.transpose(1, 2), f["Kp"])


def chunk_backward(S0, dS_C, q, k, v, a, beta, dO, sub: int = 16, mm: _Gemms = _EXACT):
    """Gradients of one chunk w.r.t. its inputs, given S_0 (forward) and dS_C (backward chain).

    S0, dS_C [HV, V, K]; q, k, a [HV, c, K]; v, dO [HV, c, V]; beta [HV, c] (σ applied).
    Returns dict(dq, dk, dv, da, dbeta, dS0): dq w.r.t. the scaled normalised q, dk w.r.t. normalised k.
    """
    f = chunk_recompute(S0, q, k, v, a, beta, sub, mm)
    f["er"] = torch.exp(f["gamma"][:, -1:] - f["gamma"])  # e^{Γ_last - Γ}

    def pair_terms(W, x, inclusive):
        return _pair_apply(W, x, k, _pair_factors(f["gamma"], inclusive))

    return _grads_of_chunk(S0, dS_C, q, k, v, beta, dO, f, pair_terms, mm)


def _grads_of_chunk(S0, dS_C, q, k, v, beta, dO, f, pair_terms, mm: _Gemms):
    """The backward of one chunk from its recomputed forward quantities f (L, Mqk, INV, X, R, Kp, Qp, Kr, gC, eg =
    e^{Γ}, er = e^{Γ_last - Γ}) and pair_terms(W, x, inclusive) -> (row_i = Σ_j W_ij k_j e^{Γ_i-Γ_j},
    col_j = Σ_i W_ij x_i e^{Γ_i-Γ_j}); shared by chunk_backward and chunk_backward_blocked, which differ only in how
    they form those."""
    bt = beta[:, :, None]
    dR = mm("dR_mqk", f["Mqk"].transpose(1, 2), dO) + mm("dR_S", f["Kr"], dS_C.transpose(1, 2))
    dY = mm("dY", f["INV"].transpose(1, 2), dR)
    dA = torch.tril(-mm("dA", dY, f["R"].transpose(1, 2)), -1)
    dL = bt * dA
    dbeta = (dA * f["L"]).sum(-1) + (dY * (v - f["X"])).sum(-1)
    dv = bt * dY
    dX = -bt * dY
    dM = torch.tril(mm("dM", dO, f["R"].transpose(1, 2)))
    dKr = mm("dKr", f["R"], dS_C)
    dKp = mm("dKp", dX, S0)
    dQp = mm("dQp", dO, S0)
    dS0 = dS_C * f["gC"][:, None, :] + mm("dS0", dO.transpose(1, 2), f["Qp"]) + mm("dS0", dX.transpose(1, 2), f["Kp"])
    rowL, colL = pair_terms(dL, k, False)
    rowM, colM = pair_terms(dM, q, True)
    eg, er = f["eg"], f["er"]
    dq = dQp * eg + rowM
    dk_row = dKp * eg + rowL  # k appears with +Γ_i
    dk_col = dKr * er + colL + colM  # k appears with -Γ_j
    dk = dk_row + dk_col
    dgamma = q * dq + k * dk_row - k * dk_col
    dgamma[:, -1] += (f["Kr"] * dKr).sum(1) + f["gC"] * (dS_C * S0).sum(1)
    da = torch.flip(torch.cumsum(torch.flip(dgamma, [1]), 1), [1])
    return dict(dq=dq, dk=dk, dv=dv, da=da, dbeta=dbeta, dS0=dS0)


def _block_factors(a: torch.Tensor, sub: int):
    """The within-block gate quantities of a chunk, a [HV, c, K] log-decays, blocks of `sub` tokens: the inclusive
    prefix γ_i = Σ_{r_I <= u <= i} a_u (block I from token r_I), the exclusive suffix σ_j = Σ_{j < u <= e_J} a_u
    (e_J the block's last token; summed from the end, no cancellation), the block totals T_b and the blocks'
    token slices. Every factor the 64-token sweep forms is e^{-(a sum of these)} of one sign: <= 1."""
    c = a.shape[1]
    bounds = [(i0, min(i0 + sub, c)) for i0 in range(0, c, sub)]
    gam = torch.cat([torch.cumsum(a[:, i0:i1], 1) for i0, i1 in bounds], 1)
    suf = torch.cat(
        [torch.flip(torch.cumsum(torch.flip(a[:, i0:i1], [1]), 1), [1]) - a[:, i0:i1] for i0, i1 in bounds], 1
    )
    tot = torch.stack([a[:, i0:i1].sum(1) for i0, i1 in bounds], 1)  # [HV, nb, K]
    return gam, suf, tot, bounds


def chunk_backward_blocked(S0, dS_C, q, k, v, a, beta, dO, sub: int = 16, mm: _Gemms = _EXACT):
    """`chunk_backward` in the factorised form a 64-token sweep kernel uses, for every gate (arguments and result as
    chunk_backward; the algebra is the same, so in fp64 the two agree to rounding).

    No exponent is a difference of chunk-wide prefixes: with the within-block quantities of `_block_factors`
    (γ, σ, T_b; P_I = Σ_{b<I} T_b the decay before block I, Q_J = Σ_{b>J} T_b the decay after block J),
      K⁺ = k e^{γ + P},  Q⁺ = q e^{γ + P},  Kr = k e^{σ + Q},  g_C = e^{Σ_b T_b};
      e^{Γ_i - Γ_j} = e^{γ_i} · D_IJ · e^{σ_j} for i in block I > J ∋ j, D_IJ = e^{Σ_{J<b<I} T_b}
    (each factor <= 1: the products with the later block's prefix, the decay of the blocks between and the earlier
    block's suffix), so L, Mqk and the three pair terms have off-diagonal blocks
      L_IJ = (k_I e^{γ_I}) diag(D_IJ) (k_J e^{σ_J})ᵀ,  row_I += e^{γ_I} ⊙ D_IJ ⊙ (W_IJ (y_J e^{σ_J})),
      col_J += e^{σ_J} ⊙ D_IJ ⊙ (W_IJᵀ (x_I e^{γ_I})),
    and the diagonal blocks the exact pairwise factors e^{γ_i - γ_j} of one block (the kernel's CUDA-core form; its
    lower-bound gate may take the mid-token reference there instead). The products with the state and the 64 x 64
    matrices are those of chunk_backward, by name (mm); the off-diagonal pair-term blocks are named "P".
    """
    HV, c, K = k.shape
    gam, suf, tot, bounds = _block_factors(a, sub)
    zero = torch.zeros_like(tot[:, :1])
    pre = torch.cat([zero, torch.cumsum(tot, 1)[:, :-1]], 1)  # P_I [HV, nb, K]
    post = torch.cat([torch.flip(torch.cumsum(torch.flip(tot, [1]), 1), [1])[:, 1:], zero], 1)  # Q_J
    blk = torch.cat([torch.full((i1 - i0,), bi, dtype=torch.long) for bi, (i0, i1) in enumerate(bounds)])
    eg = torch.exp(gam + pre[:, blk])  # e^{Γ}
    er = torch.exp(suf + post[:, blk])  # e^{Γ_last - Γ}
    gC = torch.exp(tot.sum(1))
    Kp, Qp, Kr = k * eg, q * eg, k * er
    e_in, e_out = torch.exp(gam), torch.exp(suf)  # within-block row and column factors

    def D(bi, bj):  # e^{Σ_{J<b<I} T_b} [HV, 1, K]
        return torch.exp(tot[:, bj + 1 : bi].sum(1, keepdim=True))

    def diag_pairs(i0, i1, inclusive):  # e^{γ_i - γ_j} within one block, masked before exp
        g_blk = gam[:, i0:i1]
        m = torch.ones(i1 - i0, i1 - i0, dtype=torch.bool).tril(0 if inclusive else -1)
        diff = g_blk[:, :, None, :] - g_blk[:, None, :, :]
        return torch.exp(torch.where(m[None, :, :, None], diff, torch.full_like(diff, -math.inf)))

    def pair_matrix(x, inclusive):  # Σ_c x_i k_j e^{Γ_i - Γ_j}, blockwise
        M = x.new_zeros(HV, c, c)
        for bi, (i0, i1) in enumerate(bounds):
            E = diag_pairs(i0, i1, inclusive)
            M[:, i0:i1, i0:i1] = torch.einsum("hik,hjk,hijk->hij", x[:, i0:i1], k[:, i0:i1], E)
            for bj, (j0, j1) in enumerate(bounds[:bi]):
                xr = x[:, i0:i1] * e_in[:, i0:i1] * D(bi, bj)
                M[:, i0:i1, j0:j1] = mm("L", xr, (k[:, j0:j1] * e_out[:, j0:j1]).transpose(1, 2))
        return M

    L, Mqk = pair_matrix(k, False), pair_matrix(q, True)
    INV = _unit_lower_inverse(beta[:, :, None] * L, sub)
    X = mm("X", Kp, S0.transpose(1, 2))
    R = mm("R", INV, beta[:, :, None] * (v - X))
    f = dict(L=L, Mqk=Mqk, INV=INV, X=X, R=R, Kp=Kp, Qp=Qp, Kr=Kr, gC=gC, eg=eg, er=er)

    def pair_terms(W, x, inclusive):  # row_i = Σ_j W_ij k_j e^{Γ_i-Γ_j}, col_j = Σ_i W_ij x_i e^{Γ_i-Γ_j}
        row, col = torch.zeros_like(k), torch.zeros_like(k)
        for bi, (i0, i1) in enumerate(bounds):
            E = diag_pairs(i0, i1, inclusive)
            Wd = W[:, i0:i1, i0:i1]
            row[:, i0:i1] += torch.einsum("hij,hjk,hijk->hik", Wd, k[:, i0:i1], E)
            col[:, i0:i1] += torch.einsum("hij,hik,hijk->hjk", Wd, x[:, i0:i1], E)
            for bj, (j0, j1) in enumerate(bounds[:bi]):
                Wo, d = W[:, i0:i1, j0:j1], D(bi, bj)
                row[:, i0:i1] += e_in[:, i0:i1] * d * mm("P", Wo, k[:, j0:j1] * e_out[:, j0:j1])
                col[:, j0:j1] += e_out[:, j0:j1] * d * mm("P", Wo.transpose(1, 2), x[:, i0:i1] * e_in[:, i0:i1])
        return row, col

    return _grads_of_chunk(S0, dS_C, q, k, v, beta, dO, f, pair_terms, mm)


def chunked_training_grads(
    q,
    k,
    v,
    g,
    beta,
    A_log,
    dt_bias,
    initial_state,
    do,
    dfinal_state,
    cu_seqlens=None,
    scale=None,
    lower_bound=-5.0,
    chunk_size: int = TAPE_CHUNK,
    sub: int = 16,
    dtype=torch.float64,
    operand_dtype: OperandPrecision = None,
    gemm_dtypes: dict[str, OperandPrecision] | None = None,
    blocked: bool = False,
    operand_mode: OperandMode | None = None,
    scale_granularity: str = "tile",
    product_modes: dict[str, OperandMode] | None = None,
    tape_storage: str = "fp32",
    ds_storage: str = "fp32",
):
    """The eight training gradients (in the order of docs/contract.md "API") by the chunk-parallel schedule of the
    module docstring.

    Same arguments and gradient order as `reference_training_grads` (L2 norm on, logit β, the lower-bound gate;
    lower_bound=None: the softplus gate a = -exp(A_log) softplus(g + dt_bias)).
    operand_dtype / gemm_dtypes: tensor-core emulation of the named products (module docstring; fp32 compute).
    operand_mode ("exact" | "bf16" | "bf16x3" | "fp16"), scale_granularity ("tensor" | "tile" | "row") and
    product_modes (per-name overrides of operand_mode): the operand modes of the module docstring's "Single fp16
    products" instead of operand_dtype / gemm_dtypes (fp32 compute; None: those).
    blocked: the per-chunk gradients by `chunk_backward_blocked` (the factorised form of a 64-token sweep kernel)
    instead of `chunk_backward`.
    tape_storage / ds_storage: how the tapes (read by the chain and the sweep) / the chain's dS_C rows (read by the
    sweep) are stored between the kernels (TAPE_STORAGES, `round_state_storage`); the forward and the chain carry
    their own states in full precision either way.
    Returns [dq, dk, dv, dg, dbeta, dA_log, ddt_bias, dinitial_state] in `dtype`.
    """
    mm = _Gemms(operand_dtype, gemm_dtypes)
    if operand_dtype is not None or any(p is not None for p in (gemm_dtypes or {}).values()):
        dtype = torch.float32
    if operand_mode is not None:
        if operand_dtype is not None or gemm_dtypes:
            raise ValueError("operand_mode excludes operand_dtype / gemm_dtypes")
        mm = _ModeGemms(operand_mode, scale_granularity, product_modes)
        dtype = torch.float32
    B, T, H, K = q.shape
    HV = v.shape[2]
    group = HV // H
    scale = 1.0 / math.sqrt(K) if scale is None else scale
    qr = q.to(dtype).repeat_interleave(group, dim=2)
    kr = k.to(dtype).repeat_interleave(group, dim=2)
    qn, kn = l2_normalize(qr), l2_normalize(kr)
    qs = qn * scale
    vf, dof = v.to(dtype), do.to(dtype)
    A = torch.exp(A_log.to(dtype))
    xg = g.to(dtype) + dt_bias.to(dtype).reshape(HV, K)  # [B, T, HV, K]
    if lower_bound is None:  # softplus gate (softplus(x) = x for x > 20)
        sp = torch.where(xg > 20, xg, torch.nn.functional.softplus(xg))
        af = -A[:, None] * sp
    else:
        z = A[:, None] * xg
        sz = torch.sigmoid(z)
        af = lower_bound * sz
    bl = torch.sigmoid(beta.to(dtype))

    dqs, dkn, dv, da, dbeta = (torch.zeros_like(x) for x in (qs, kn, vf, af, bl))
    dinit = torch.zeros(initial_state.shape, dtype=dtype)
    for n, (b, bos, length) in enumerate(seq_bounds(T, B, cu_seqlens)):
        starts = list(range(0, length, chunk_size))

        def part(x, s0, s1, b=b, bos=bos):
            return x[b, bos + s0 : bos + s1].transpose(0, 1)  # [HV, c, ...]

        # 1. tapes: the state entering every chunk (the training forward's checkpoints)
        S = initial_state[n].to(dtype)
        tapes = []
        for s0 in starts:
            s1 = min(s0 + chunk_size, length)
            tapes.append(round_state_storage(S, tape_storage))
            f = chunk_recompute(
                S, part(qs, s0, s1), part(kn, s0, s1), part(vf, s0, s1), part(af, s0, s1), part(bl, s0, s1), sub, mm
            )
            S = S * f["gC"][:, None, :] + mm("S", f["R"].transpose(1, 2), f["Kr"])
        # 2. chain: dS_C of every chunk, last first
        dS = torch.zeros_like(S) if dfinal_state is None else dfinal_state[n].to(dtype)
        dS_end: list[torch.Tensor | None] = [None] * len(starts)
        for ci in range(len(starts) - 1, -1, -1):
            s0, s1 = starts[ci], min(starts[ci] + chunk_size, length)
            dS_end[ci] = round_state_storage(dS, ds_storage)
            f = chunk_recompute(
                tapes[ci], part(qs, s0, s1), part(kn, s0, s1), part(vf, s0, s1), part(af, s0, s1), part(bl, s0, s1),
                sub, mm,
            )  # fmt: skip
            dS = chain_step(f, part(bl, s0, s1), part(dof, s0, s1), dS, mm)
        dinit[n] = dS
        # 3. every chunk independently
        for ci, s0 in enumerate(starts):
            s1 = min(s0 + chunk_size, length)
            r = (chunk_backward_blocked if blocked else chunk_backward)(
                tapes[ci],
                dS_end[ci],
                part(qs, s0, s1),
                part(kn, s0, s1),
                part(vf, s0, s1),
                part(af, s0, s1),
                part(bl, s0, s1),
                part(dof, s0, s1),
                sub,
                mm,
            )
            sl = slice(bos + s0, bos + s1)
            dqs[b, sl], dkn[b, sl], dv[b, sl] = (r[x].transpose(0, 1) for x in ("dq", "dk", "dv"))
            da[b, sl], dbeta[b, sl] = r["da"].transpose(0, 1), r["dbeta"].transpose(0, 1)
    # 4. per token: gate, β, L2 norm, GQA
    if lower_bound is None:
        dg = -A[:, None] * da * torch.where(xg > 20, torch.ones_like(xg), torch.sigmoid(xg))
        dA_log = (da * af).sum((0, 1, 3))
    else:
        dz = da * lower_bound * sz * (1 - sz)
        dg = A[:, None] * dz
        dA_log = (dz * z).sum((0, 1, 3))
    ddt = dg.sum((0, 1))
    dbeta_logit = dbeta * bl * (1 - bl)

    def l2_back(x, dxn):  # x raw (GQA-expanded), dxn = dL/d(normalised x)
        rho = torch.rsqrt((x * x).sum(-1, keepdim=True) + 1e-6)
        return rho * dxn - rho**3 * (x * dxn).sum(-1, keepdim=True) * x

    dq = l2_back(qr, dqs * scale).reshape(B, T, H, group, K).sum(3)
    dk = l2_back(kr, dkn).reshape(B, T, H, group, K).sum(3)
    return [dq, dk, dv, dg, dbeta_logit, dA_log.reshape(A_log.shape), ddt.reshape(dt_bias.shape), dinit]


def segment_affine_map(fs: list[dict[str, torch.Tensor]], betas: list[torch.Tensor], dOs: list[torch.Tensor]):
    """The chain over consecutive chunks as one affine map, dS_start = dS_end 𝔄 + 𝔅 ([HV, K, K], [HV, V, K]).

    fs, betas, dOs: the chunks' `chunk_recompute` dicts, β and dO in time order. Built last chunk first:
    𝔄 <- 𝔄 A_c (the homogeneous chain step: dO = 0), 𝔅 <- 𝔅 A_c + B_c (`chain_step`), from 𝔄 = I, 𝔅 = 0.
    Lets independent workers reverse disjoint segments of one sequence: each segment's dS_end is the
    composition of the later segments' maps applied to dfinal_state (a CUDA segment split tried earlier; the
    CUDA backward now runs the chain itself first, see docs/design.md, and this stays as tested algebra).
    """
    HV, _, K = fs[0]["Kp"].shape
    dtype = fs[0]["Kp"].dtype
    A_map = torch.eye(K, dtype=dtype).repeat(HV, 1, 1)
    B_map = torch.zeros(HV, dOs[0].shape[-1], K, dtype=dtype)
    for f, b, dO in zip(reversed(fs), reversed(betas), reversed(dOs), strict=True):
        A_map = chain_step(f, b, dO.new_zeros(HV, dO.shape[1], K), A_map)  # homogeneous step: no dO
        B_map = chain_step(f, b, dO, B_map)
    return A_map, B_map
