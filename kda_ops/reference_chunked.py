r"""Chunked (WY / UT-transform) KDA reference: docs/contract.md "Chunked form" in plain torch, one step per kernel
stage.

This computes exactly what `kda_ops.reference.recurrent_kda_reference` (the token loop of docs/contract.md "Recurrence")
computes, but chunk by chunk, in the form a tensor-core prefill kernel uses. It is written for a
kernel engineer to mirror: every intermediate has the shape and the exponent range the kernel will
see, and `trace=` hands them all back so a kernel's own dumps can be compared stage by stage.

Notation (one sequence, one value head; the code runs all HV value heads of a sequence at once)
-----------------------------------------------------------------------------------------------
A chunk holds c <= C tokens (C = `chunk_size`; the last chunk of a sequence may be shorter) and is
split into sub-chunks of s = `sub_chunk` tokens (16: the M of mma.sync m16n8k16). Per token i of the
chunk: q_i (L2-normalised, times scale), k_i (L2-normalised) [K]; v_i [V]; log-decay a_i [K] (docs/contract.md
"Recurrence"
step 2); beta_i scalar. S_0 [V, K] is the state entering the chunk (value-first, S[v, k]).

  Γ      [c, K]  Γ_i = Σ_{j<=i} a_j                 cumulative log-decay (fp32 prefix sum in a kernel)
  g_C    [K]     e^{Γ_{c-1}}                         whole-chunk decay (<= 1)
  K⁺     [c, K]  k_i ⊙ e^{Γ_i}                       (<= |k_i|, exponent <= 0)
  Q⁺     [c, K]  q_i ⊙ e^{Γ_i}                       (<= |q_i|)
  Kr     [c, K]  k_i ⊙ e^{Γ_{c-1} - Γ_i}             (<= |k_i|)
  L      [c, c]  L_ij = Σ_k k_i k_j e^{Γ_i - Γ_j},  j < i  (strictly lower; 0 elsewhere)
  Mqk    [c, c]  Mqk_ij = Σ_k q_i k_j e^{Γ_i - Γ_j}, j <= i (lower incl. diagonal)
  A      [c, c]  I + diag(β) L                       (unit lower triangular)
  INV    [c, c]  A^{-1}                              (unit lower triangular; |entries| <= 1 when
                                                      |k| = 1 and β <= 1, near-collinear keys)
  X      [c, V]  K⁺ S_0ᵀ                             (prediction from the incoming state)
  Y      [c, V]  diag(β) (V - X)
  R      [c, V]  INV Y                               (the deltas r_i of docs/contract.md "Recurrence")
  O      [c, V]  Q⁺ S_0ᵀ + Mqk R                     (outputs)
  S_C    [V, K]  S_0 diag(g_C) + Rᵀ Kr               (state after the chunk)

Derivation: before its update token i sees S̄_i = S_0 diag(e^{Γ_i}) + Σ_{j<i} r_j (k_j ⊙ e^{Γ_i-Γ_j})ᵀ,
so r_i = β_i (v_i - S̄_i k_i) = β_i (v_i - X_i - Σ_{j<i} L_ij r_j), i.e. (I + diag(β) L) R = Y; the
output o_i = S_i q_i adds the j = i term, hence Mqk includes the diagonal. (The WY form of fla is the
same algebra regrouped: W = INV diag(β) K⁺, U = INV diag(β) V, R = U - W S_0ᵀ.)

Exponent ranges (why nothing overflows, for every gate mode)
-------------------------------------------------------------
Every decay is a_i <= 0 (softplus and lower-bound gates by construction; precomputed gates are
log-decays; a positive precomputed gate is still computed exactly, the bounds below then carry an
extra e^{Σ max(a, 0)} that the token loop has as well). Hence Γ is non-increasing in i and:

* K⁺, Q⁺ (exponent Γ_i <= 0), Kr (Γ_{c-1} - Γ_i <= 0) and g_C: every factor <= 1. These are relative to
  the chunk start, which is the only reason a 64-token chunk with an unbounded gate stays finite.
  Underflow to 0 is harmless: the true contribution is below the last ulp of the result.
* L and Mqk are never formed as (k ⊙ e^{Γ}) (k ⊙ e^{-Γ})ᵀ: e^{-Γ_j} reaches e^{64·|a|} and overflows
  fp32 once |Γ| > 88 (the naive form; the tests show it does). Instead, block (I, J) of s x s tokens:
  - off-diagonal (J < I): reference row r = first token of sub-chunk I. Row factor e^{Γ_i - Γ_r}
    (i >= r) <= 1, column factor e^{Γ_r - Γ_j} (j < r) <= 1. Both <= 1 for ANY gate magnitude, and
    the product is exactly e^{Γ_i - Γ_j}. One GEMM per block row: [s, K] x [K, I·s].
  - diagonal (J = I), `diag_mode`:
    * "mid": reference r = middle token of the sub-chunk (i0 + s_I//2). Row factor e^{Γ_i - Γ_r} <= 1
      for i >= r and <= e^{|λ|·s/2} for i < r; column factor e^{Γ_r - Γ_j} <= 1 for j <= r and
      <= e^{|λ|·(s/2 - 1)} for j > r. With the lower-bound gate (|a| < |λ| <= 5) and s = 16 every
      factor is <= e^{40} (fp32 and bf16 reach e^{88}). A GEMM [s, K] x [K, s], then masked.
    * "first": reference r = first token of the sub-chunk: row factors <= 1, column factors
      <= e^{|λ|·(s-1)} (e^{75} for λ = -5: still finite, less headroom). Lets the diagonal block share
      the row operand of the off-diagonal GEMM (one [s, K] x [K, i0 + s] GEMM per block row).
    * "pairwise": exact e^{Γ_i - Γ_j} per (i, j, channel) on CUDA cores (fla's token-parallel
      kernel), with the exponent of every masked pair (j > i, or j = i for L) replaced by -inf BEFORE
      exp, so it is never exponentiated: every computed factor is <= 1 whatever the gate. The
      softplus and precomputed gates are unbounded per token (g = 40, A_log = 2 gives a ≈ -300 per
      token: no reference row inside a 16-token sub-chunk works), so they need this.
    * "auto" (default): "mid" for the lower-bound gate when |λ|·s/2 <= 40, else "pairwise".
  In the GEMM modes the masked (upper) entries of a diagonal block are products of finite factors
  (<= e^{|λ|(s-1)}·|x||k|), zeroed right after the product; no pair exponent is ever taken for them.
* INV: |entries| stay O(1) (unit lower triangular, β in (0, 1], normalised keys); the solve is done in
  fp32 (fp64 here by default) by forward substitution, never by a Neumann product (unstable for near-collinear keys).

Order of operations per chunk (what a kernel should follow; ⊗ marks a tensor-core GEMM)
----------------------------------------------------------------------------------------
Token-parallel stage (no dependence on S, can run ahead of the chain):
  1. L2 norm, scale, gate → a [c, K]; Γ = prefix sum over tokens in fp32; g_C = e^{Γ_{c-1}}.
  2. Decayed operands K⁺, Q⁺, Kr (exponent <= 0).
  3. For each block row I: row operands k_I ⊙ e^{Γ_I - Γ_{I0}}, q_I ⊙ e^{Γ_I - Γ_{I0}}, column operand
     k_{<I0} ⊙ e^{Γ_{I0} - Γ_{<I0}}; ⊗ L[I, <I], Mqk[I, <I]; diagonal blocks per `diag_mode`; mask.
  4. Triangular inverse, fp32 (see `_unit_lower_inverse`):
     a. each diagonal block D_I = I + diag(β_I) L_II (s x s) by forward substitution, row by row:
        X_i = e_i - Σ_{m<i} (β_i L_im) X_m (s - 1 dependent steps of an s-vector update);
     b. off-diagonal blocks in order of increasing block row I, then decreasing J:
        INV_IJ = -D_I^{-1} Σ_{m=J}^{I-1} (diag(β_I) L_Im) INV_mJ  (exact, no approximation).
        For C = 64, s = 16: 6 blocks, 1+2+3 + 1+2 + 1 = 10 products M·INV plus 6 products D^{-1}·(sum):
        16 GEMMs of 16x16x16 (a sum is accumulated in fp32 before the D^{-1} product).
Serial stage (the chain over chunks, state in fp32):
  5. ⊗ X = K⁺ S_0ᵀ; Y = β ⊙ (V - X) (fp32); ⊗ R = INV Y.
  6. ⊗ O = Q⁺ S_0ᵀ + Mqk R (the Q⁺ S_0ᵀ product uses the same S_0 operand as step 5).
  7. S_C = S_0 ⊙ g_C (per column, fp32 FMA) ⊗+ Rᵀ Kr.
(A kernel may regroup 5-6 into the WY form or FlashInfer's Ainvb form; R, O and S_C are invariant.)

operand_dtype / gemm_dtypes (tensor-core emulation)
---------------------------------------------------
With `operand_dtype=torch.bfloat16`, every ⊗ operand is rounded to bf16 right before its product
(decayed q/k, the state S_0 before X and Q⁺S_0ᵀ, INV and Y before R, Mqk and R before O, R and Kr before
the state update), the product is accumulated in fp32 (products of bf16 values are exact in fp32, the
sums are fp32), and everything else (gate, Γ, exponentials, the pairwise diagonal blocks, the inverse,
the state carried between chunks) is fp32; `dtype` is then forced to fp32. That is what an mma.sync /
wgmma kernel with an fp32 register state does. `gemm_dtypes` overrides the operand precision per GEMM,
by name (GEMM_NAMES): "L" (the L and Mqk blocks, step 3), "X" (step 5, K⁺ S_0ᵀ), "R" (INV Y),
"O_inter" (Q⁺ S_0ᵀ), "O_intra" (Mqk R), "S" (Rᵀ Kr); values are a dtype, "tf32", or None (exact).

Folded WY operands (`folded_wy=True`)
------------------------------------
The same chunk with the inverse folded into the chain's operands (a forward kernel's prep makes them after
the inverse, so the chain never reads INV, V or Y):
  INVb   [c, c]  INV diag(β)
  W'     [c, K]  INVb K⁺          ⊗ (prep; stored as the chain's operand, as −W')
  V'     [c, V]  INVb V           ⊗ (prep; stored as the seed of the chain's accumulator)
  R      [c, V]  V' − W' S_0ᵀ     ⊗ (chain: Rᵀ = V'ᵀ + bf16(S_0) (−W')ᵀ, seeded accumulator)
  O, S_C as above (Mqk R, Rᵀ Kr).
R = INV diag(β) (V − K⁺ S_0ᵀ) either way: in exact arithmetic the two orders agree; only the rounding
points move (W' is rounded after the INV product instead of K⁺ and INV separately, and V' is stored).
The GEMM names are then FOLDED_GEMM_NAMES: "L", "O_inter", "O_intra", "S" as above; "INVb" (the INVb
operand of the two fold products), "KV" (their K⁺ and V operands), "W" (the stored W', left operand of the
chain product W' S_0ᵀ), "X" (its S_0 operand), "Vp" (the stored V'; an fp16 store saturates to ±65504
instead of overflowing). The planned kernel: operand_dtype=bf16 with fp16 for "Vp", "O_intra", "S" and
"INVb" fp16 or bf16 (an mma takes one operand type, so fp16 INVb needs fp16 K⁺/V operands, "KV"); W' as a
bf16 hi + lo pair is close to "W": None.
Precision measured against the fp64 token loop: docs/design.md "Folded WY operands: precision"
(benchmarks/profiling/folded_precision.py).

Measured budget (tests/test_reference_chunked.py; K = V = 128, T = 300, bf16 inputs ~N(0,1), vs the fp64
token loop; output rounded to bf16 as stored; worst over the three gate modes):
* all bf16: output rel RMS 3.3-4.3e-3 (limit 5e-3), fp32 state 2.6-2.9e-3 — ABOVE the 1e-3 limit. The
  state error comes from the chain GEMMs: R = INV Y and S += Rᵀ Kr each lose ~2^-9 relative.
* bf16 for L / X / O_inter, fp16 for R / O_intra / S (same tensor-core rate, 3 more mantissa bits):
  output 1.7-3.0e-3, fp32 state 3.2-4.0e-4, bf16-stored state 1.7e-3. fp16 is safe there because those
  operands are bounded (INV, Y and R ~ |v|, Mqk <= |q||k|, Kr <= |k|); it is NOT safe for L / X /
  O_inter (mid-reference factors reach e^40, the state is unbounded): fp16 L gives inf/NaN.
* adversarial near-collinear keys (β logit 8, no decay): all bf16 1.5e-2 output / 1e-2 state; the mix
  above 5.6e-3 / 2.1e-3 (the state is a telescoping sum of cancelling deltas). Finite either way.

Sequences, chunks, checkpoints
------------------------------
Fixed input: each batch row is a sequence; packed: `cu_seqlens` [N+1] (B == 1), zero-length rows allowed
(their output rows stay 0, final state = initial state, no checkpoint rows). Chunks start at every
multiple of C of the sequence AND at every multiple of `checkpoint_every_n_tokens` = n: a chunk never
straddles a checkpoint. When n is a multiple of C this is exactly the C-grid; otherwise some chunks are
shorter (e.g. C = 64, n = 48: chunks [0,48) [48,64) [64,96) [96,128) ...) — the chunked form is exact for
any chunk length, so this is a scheduling choice, and a kernel may instead require C | n. Checkpoint row
j is the state before token j·n (row 0 = initial state), ceil(L / n) rows per sequence, as in docs/contract.md "Slots
and checkpoints".
GQA: value head hv reads q/k head hv // (HV // H).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass

import torch

from kda_ops.reference import ReferenceResult, gate_log_decay, l2_normalize, seq_bounds

DiagMode = str  # "auto" | "mid" | "first" | "pairwise"
_MID_MAX_EXP = 40.0  # "auto" uses "mid" only while every factor is <= e^40


@dataclass
class ChunkTrace:
    """Intermediates of one chunk (all value heads): compare a kernel's dumps against these."""

    seq: int  # sequence index
    start: int  # first token of the chunk within its sequence
    gamma: torch.Tensor  # Γ [HV, c, K]
    L: torch.Tensor  # strictly lower L [HV, c, c] (β not applied)
    Mqk: torch.Tensor  # lower incl. diagonal [HV, c, c]
    INV: torch.Tensor  # (I + diag(β) L)^{-1} [HV, c, c]
    X: torch.Tensor  # K⁺ S_0ᵀ [HV, c, V] (folded_wy: W' S_0ᵀ)
    R: torch.Tensor  # deltas [HV, c, V]
    out: torch.Tensor  # outputs O [HV, c, V]
    S0: torch.Tensor  # state entering the chunk [HV, V, K]
    S_next: torch.Tensor  # state leaving the chunk [HV, V, K]
    W: torch.Tensor | None = None  # folded_wy only: W' = INV diag(β) K⁺ [HV, c, K] as stored
    Vp: torch.Tensor | None = None  # folded_wy only: V' = INV diag(β) V [HV, c, V] as stored


GEMM_NAMES = ("L", "X", "R", "O_inter", "O_intra", "S")  # the ⊗ products of a chunk (module docstring)
# folded_wy=True (module docstring, "Folded WY operands"): the fold products' INVb and K⁺/V operands, the stored
# W' and the S_0 operand of the chain's W' S_0ᵀ, the stored V'
FOLDED_GEMM_NAMES = ("L", "INVb", "KV", "W", "X", "Vp", "O_inter", "O_intra", "S")
OperandPrecision = torch.dtype | str | None  # a dtype (bf16, fp16), "tf32", or None / fp32 / fp64 (no rounding)


def _identity(x: torch.Tensor) -> torch.Tensor:
    return x


def _round_tf32(x: torch.Tensor) -> torch.Tensor:
    """Round to tf32 (10 explicit mantissa bits, nearest, ties away from zero) and back to x.dtype."""
    i = x.to(torch.float32).contiguous().view(torch.int32)
    i = (i + 0x1000) & ~0x1FFF
    return i.view(torch.float32).to(x.dtype)


def _make_round(prec: OperandPrecision, saturate: bool = False) -> Callable[[torch.Tensor], torch.Tensor]:
    """Rounds a GEMM operand to `prec` and back (the values become exactly representable in it). saturate:
    values beyond the dtype's finite range become its largest finite value (a saturating store) instead of ±inf."""
    if prec is None or prec in (torch.float32, torch.float64):
        return _identity
    if prec == "tf32":
        return _round_tf32
    if not isinstance(prec, torch.dtype):
        raise ValueError(f"operand precision must be a torch dtype, 'tf32' or None, got {prec!r}")
    dt = prec
    if saturate:
        big = torch.finfo(dt).max
        return lambda x: x.clamp(-big, big).to(dt).to(x.dtype)
    return lambda x: x.to(dt).to(x.dtype)


def resolve_gemm_precisions(
    operand_dtype: OperandPrecision,
    gemm_dtypes: dict[str, OperandPrecision] | None,
    names: tuple[str, ...] = GEMM_NAMES,
) -> dict[str, OperandPrecision]:
    """Operand precision of each GEMM of `names`: `operand_dtype` everywhere, overridden per name by
    `gemm_dtypes` (ValueError for a name not in `names`)."""
    out: dict[str, OperandPrecision] = {name: operand_dtype for name in names}
    for name, prec in (gemm_dtypes or {}).items():
        if name not in out:
            raise ValueError(f"gemm_dtypes: unknown GEMM {name!r}, expected one of {names}")
        out[name] = prec
    return out


def resolve_diag_mode(diag_mode: DiagMode, use_gate_in_kernel: bool, lower_bound: float | None, sub: int) -> str:
    """The diagonal-block scheme "auto" picks (see the module docstring)."""
    if diag_mode != "auto":
        if diag_mode not in ("mid", "first", "pairwise"):
            raise ValueError(f"diag_mode must be auto|mid|first|pairwise, got {diag_mode!r}")
        return diag_mode
    if use_gate_in_kernel and lower_bound is not None and abs(lower_bound) * (sub / 2) <= _MID_MAX_EXP:
        return "mid"
    return "pairwise"


def decayed_pair_matrix(
    x: torch.Tensor,
    k: torch.Tensor,
    gamma: torch.Tensor,
    sub: int,
    inclusive: bool,
    diag_mode: str,
    rnd: Callable[[torch.Tensor], torch.Tensor] = _identity,
) -> torch.Tensor:
    """M_ij = Σ_k x_i[k] k_j[k] e^{Γ_i[k] - Γ_j[k]} for j < i (j <= i if inclusive), 0 above.

    x, k, gamma: [HV, c, K] -> [HV, c, c]. Built block row by block row with relative exponents
    (module docstring): off-diagonal blocks with the first token of the later sub-chunk as reference
    (both factors <= 1), the diagonal block per `diag_mode` ("mid" | "first" | "pairwise").
    """
    HV, c, _ = x.shape
    M = x.new_zeros(HV, c, c)
    diag_off = 0 if inclusive else -1
    for i0 in range(0, c, sub):
        i1 = min(i0 + sub, c)
        si = i1 - i0
        g_blk = gamma[:, i0:i1]  # [HV, si, K]
        mask = torch.ones(si, si, dtype=torch.bool, device=x.device).tril(diag_off)  # [si, si]
        if i0 > 0:
            # Off-diagonal blocks of this block row, reference r = i0 (first token of sub-chunk I).
            g_ref = gamma[:, i0 : i0 + 1]  # [HV, 1, K]
            x_row = x[:, i0:i1] * torch.exp(g_blk - g_ref)  # [HV, si, K], factor <= 1
            k_col = k[:, :i0] * torch.exp(g_ref - gamma[:, :i0])  # [HV, i0, K], factor <= 1
            M[:, i0:i1, :i0] = rnd(x_row) @ rnd(k_col).transpose(1, 2)  # ⊗ [si, K] x [K, i0]
        x_blk, k_blk = x[:, i0:i1], k[:, i0:i1]
        if diag_mode == "pairwise":
            diff = g_blk[:, :, None, :] - g_blk[:, None, :, :]  # [HV, si, si, K], Γ_i - Γ_j
            # mask BEFORE exp: a non-causal pair's exponent is -inf, exp gives exactly 0
            e = torch.exp(torch.where(mask[None, :, :, None], diff, torch.full_like(diff, -math.inf)))
            blk = torch.einsum("hik,hjk,hijk->hij", x_blk, k_blk, e)  # CUDA-core fp32, not rounded
        else:
            r = i0 if diag_mode == "first" else i0 + si // 2
            g_ref = gamma[:, r : r + 1]  # [HV, 1, K]
            x_row = x_blk * torch.exp(g_blk - g_ref)  # [HV, si, K]
            k_col = k_blk * torch.exp(g_ref - g_blk)  # [HV, si, K]
            blk = rnd(x_row) @ rnd(k_col).transpose(1, 2)  # ⊗ [si, K] x [K, si]
            blk = torch.where(mask, blk, torch.zeros_like(blk))  # mask right after the product
        M[:, i0:i1, i0:i1] = blk
    return M


def _unit_lower_inverse(N: torch.Tensor, sub: int) -> torch.Tensor:
    """(I + N)^{-1} for strictly-lower N [HV, c, c], blockwise and exact (fp32/fp64 as N).

    Diagonal s x s blocks: forward substitution row by row. Off-diagonal blocks, block row I ascending,
    block column J descending: INV_IJ = -D_I^{-1} Σ_{m=J}^{I-1} N_Im INV_mJ (D_I = I + N_II).
    """
    HV, c, _ = N.shape
    INV = N.new_zeros(HV, c, c)
    starts = list(range(0, c, sub))
    bounds = [(i0, min(i0 + sub, c)) for i0 in starts]
    for i0, i1 in bounds:
        si = i1 - i0
        Nb = N[:, i0:i1, i0:i1]
        Xb = torch.eye(si, dtype=N.dtype, device=N.device).repeat(HV, 1, 1)  # [HV, si, si]
        for i in range(1, si):  # X_i = e_i - Σ_{m<i} N_im X_m
            Xb[:, i] = Xb[:, i] - torch.einsum("hm,hmj->hj", Nb[:, i, :i], Xb[:, :i])
        INV[:, i0:i1, i0:i1] = Xb
    for bi in range(1, len(bounds)):
        i0, i1 = bounds[bi]
        Dinv = INV[:, i0:i1, i0:i1]
        for bj in range(bi - 1, -1, -1):
            j0, j1 = bounds[bj]
            acc = N[:, i0:i1, j0:i0] @ INV[:, j0:i0, j0:j1]  # Σ_{m=J}^{I-1} N_Im INV_mJ, [si, sj]
            INV[:, i0:i1, j0:j1] = -(Dinv @ acc)
    return INV


def _chunk_prep(
    q: torch.Tensor,
    k: torch.Tensor,
    a: torch.Tensor,
    beta: torch.Tensor,
    sub: int,
    diag_mode: str,
    rL: Callable[[torch.Tensor], torch.Tensor],
) -> tuple[torch.Tensor, ...]:
    """Steps 1-4 of a chunk (the token-parallel stage, both orders): Γ, e^{Γ_C} exponent, K⁺, Q⁺, Kr, L, Mqk, INV."""
    gamma = torch.cumsum(a, dim=1)  # 1. Γ [HV, c, K]
    g_last = gamma[:, -1:]  # [HV, 1, K]
    Kp = k * torch.exp(gamma)  # 2. K⁺ [HV, c, K]
    Qp = q * torch.exp(gamma)  #    Q⁺ [HV, c, K]
    Kr = k * torch.exp(g_last - gamma)  # Kr [HV, c, K]
    L = decayed_pair_matrix(k, k, gamma, sub, False, diag_mode, rL)  # 3. [HV, c, c]
    Mqk = decayed_pair_matrix(q, k, gamma, sub, True, diag_mode, rL)  # [HV, c, c]
    INV = _unit_lower_inverse(beta[:, :, None] * L, sub)  # 4. [HV, c, c]
    return gamma, g_last, Kp, Qp, Kr, L, Mqk, INV


def chunk_forward(
    S0: torch.Tensor,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    a: torch.Tensor,
    beta: torch.Tensor,
    sub: int = 16,
    diag_mode: str = "pairwise",
    operand_dtype: OperandPrecision = None,
    gemm_dtypes: dict[str, OperandPrecision] | None = None,
    folded_wy: bool = False,
) -> tuple[torch.Tensor, torch.Tensor, dict[str, torch.Tensor]]:
    """One chunk, all value heads. S0 [HV, V, K]; q, k, a [HV, c, K] (q scaled and normalised, k normalised);
    v [HV, c, V]; beta [HV, c] (already sigmoid-ed if logits). Returns (O [HV, c, V], S_C [HV, V, K], parts).
    Operand rounding per GEMM as `resolve_gemm_precisions(operand_dtype, gemm_dtypes)`. folded_wy: the
    folded order (module docstring, "Folded WY operands"; names FOLDED_GEMM_NAMES; parts gain W and Vp).
    """
    if folded_wy:
        return _chunk_forward_folded(S0, q, k, v, a, beta, sub, diag_mode, operand_dtype, gemm_dtypes)
    prec = resolve_gemm_precisions(operand_dtype, gemm_dtypes)
    rL, rX, rR, rO1, rO2, rS = (_make_round(prec[name]) for name in GEMM_NAMES)
    gamma, g_last, Kp, Qp, Kr, L, Mqk, INV = _chunk_prep(q, k, a, beta, sub, diag_mode, rL)  # steps 1-4
    S0t = S0.transpose(1, 2)  # [HV, K, V]
    X = rX(Kp) @ rX(S0t)  # 5. ⊗ [c, K] x [K, V] -> [HV, c, V]
    Y = beta[:, :, None] * (v - X)  # [HV, c, V]
    R = rR(INV) @ rR(Y)  # ⊗ [c, c] x [c, V]
    Oc = rO1(Qp) @ rO1(S0t) + rO2(Mqk) @ rO2(R)  # 6. ⊗ O [HV, c, V]
    S_next = S0 * torch.exp(g_last) + rS(R).transpose(1, 2) @ rS(Kr)  # 7. ⊗ [V, c] x [c, K]
    return Oc, S_next, dict(gamma=gamma, L=L, Mqk=Mqk, INV=INV, X=X, R=R)


def _chunk_forward_folded(
    S0: torch.Tensor,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    a: torch.Tensor,
    beta: torch.Tensor,
    sub: int,
    diag_mode: str,
    operand_dtype: OperandPrecision,
    gemm_dtypes: dict[str, OperandPrecision] | None,
) -> tuple[torch.Tensor, torch.Tensor, dict[str, torch.Tensor]]:
    """`chunk_forward` in the folded order (module docstring, "Folded WY operands"): W' = INVb K⁺ and
    V' = INVb V made after the inverse, then R = V' − W' S_0ᵀ; steps 1-4 and 6-7 as in `chunk_forward`."""
    prec = resolve_gemm_precisions(operand_dtype, gemm_dtypes, FOLDED_GEMM_NAMES)
    rL, rI, rKV, rW, rX, rO1, rO2, rS = (
        _make_round(prec[name]) for name in ("L", "INVb", "KV", "W", "X", "O_inter", "O_intra", "S")
    )
    rVp = _make_round(prec["Vp"], saturate=True)
    gamma, g_last, Kp, Qp, Kr, L, Mqk, INV = _chunk_prep(q, k, a, beta, sub, diag_mode, rL)  # steps 1-4
    INVb = rI(INV * beta[:, None, :])  # INV diag(β), the fold products' left operand
    W = rW(INVb @ rKV(Kp))  # 4'. ⊗ W' [c, c] x [c, K], stored as the chain's operand
    Vp = rVp(INVb @ rKV(v))  #     ⊗ V' [c, c] x [c, V], stored (saturating) as the chain's seed
    S0t = S0.transpose(1, 2)  # [HV, K, V]
    X = W @ rX(S0t)  # 5. ⊗ W' S_0ᵀ [HV, c, V]
    R = Vp - X  # the seeded accumulator: Rᵀ = V'ᵀ + bf16(S_0) (−W')ᵀ
    Oc = rO1(Qp) @ rO1(S0t) + rO2(Mqk) @ rO2(R)  # 6. ⊗ O [HV, c, V]
    S_next = S0 * torch.exp(g_last) + rS(R).transpose(1, 2) @ rS(Kr)  # 7. ⊗ [V, c] x [c, K]
    return Oc, S_next, dict(gamma=gamma, L=L, Mqk=Mqk, INV=INV, X=X, R=R, W=W, Vp=Vp)


def chunk_starts(length: int, chunk_size: int, checkpoint_every_n_tokens: int) -> list[int]:
    """Chunk start offsets of a sequence: multiples of chunk_size and of the checkpoint interval."""
    starts = set(range(0, length, chunk_size))
    if checkpoint_every_n_tokens:
        starts |= set(range(0, length, checkpoint_every_n_tokens))
    return sorted(starts)


def chunked_kda_reference(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    A_log: torch.Tensor | None = None,
    dt_bias: torch.Tensor | None = None,
    scale: float | None = None,
    initial_state: torch.Tensor | None = None,
    cu_seqlens: torch.Tensor | None = None,
    use_qk_l2norm_in_kernel: bool = True,
    use_gate_in_kernel: bool = False,
    lower_bound: float | None = None,
    beta_is_logit: bool = False,
    chunk_size: int = 64,
    sub_chunk: int = 16,
    dtype: torch.dtype = torch.float64,
    operand_dtype: OperandPrecision = None,
    checkpoint_every_n_tokens: int = 0,
    *,
    diag_mode: DiagMode = "auto",
    gemm_dtypes: dict[str, OperandPrecision] | None = None,
    folded_wy: bool = False,
    trace: list[ChunkTrace] | None = None,
) -> ReferenceResult:
    """Chunked KDA (docs/contract.md "Chunked form"), same arguments and result as `recurrent_kda_reference`.

    Shapes: q, k [B, T, H, K]; v [B, T, HV, V]; g [B, T, HV, K]; beta [B, T, HV]; A_log [HV] (or [H]);
    dt_bias [HV, K] (or [H, K] / flat); initial_state per sequence [N, HV, V, K] (None = zeros).
    Returns ReferenceResult(output [B, T, HV, V], final_state [N, HV, V, K], checkpoints per sequence
    [ceil(L/n), HV, V, K], all_states=None), all in the compute dtype.

    chunk_size C and sub_chunk s: any positive s <= C (s = 16 in kernels). dtype: compute dtype
    (fp64 for the exact comparison; fp32 is what a kernel does). operand_dtype: tensor-core emulation
    (module docstring; forces fp32 compute); gemm_dtypes: per-GEMM override of it. diag_mode: "auto" |
    "mid" | "first" | "pairwise" for the diagonal blocks of L and Mqk. folded_wy: the folded order (W' = INV
    diag(β) K⁺ and V' = INV diag(β) V, then R = V' − W' S_0ᵀ; gemm_dtypes then takes FOLDED_GEMM_NAMES; module
    docstring, "Folded WY operands"). trace: if a list, one ChunkTrace
    per chunk is appended to it. See the module docstring for the formulas, exponent ranges and the order of operations.
    """
    if chunk_size <= 0 or sub_chunk <= 0 or sub_chunk > chunk_size:
        raise ValueError(f"need 0 < sub_chunk <= chunk_size, got {sub_chunk}, {chunk_size}")
    if checkpoint_every_n_tokens < 0:
        raise ValueError(f"checkpoint_every_n_tokens must be >= 0, got {checkpoint_every_n_tokens}")
    precisions = resolve_gemm_precisions(operand_dtype, gemm_dtypes, FOLDED_GEMM_NAMES if folded_wy else GEMM_NAMES)
    if any(_make_round(p) is not _identity for p in precisions.values()):
        dtype = torch.float32  # GEMMs accumulate in fp32, the rest of the kernel is fp32 too
    B, T, H, K = q.shape
    HV, V = v.shape[2], v.shape[3]
    if HV % H:
        raise ValueError(f"HV % H must be 0, got HV={HV}, H={H}")
    group = HV // H
    if scale is None:
        scale = 1.0 / math.sqrt(K)
    mode = resolve_diag_mode(diag_mode, use_gate_in_kernel, lower_bound, sub_chunk)
    dev = q.device

    # Token-parallel preparation for the whole call (step 1): GQA expansion, L2 norm, scale, gate, β.
    qf = q.to(dtype).repeat_interleave(group, dim=2)  # [B, T, HV, K]
    kf = k.to(dtype).repeat_interleave(group, dim=2)
    if use_qk_l2norm_in_kernel:
        qf, kf = l2_normalize(qf), l2_normalize(kf)
    qf = qf * scale
    vf = v.to(dtype)
    A = None if A_log is None else A_log.to(dtype)
    dtb = None if dt_bias is None else dt_bias.to(dtype)
    if A is not None and A.shape[0] != HV:
        A = A.repeat_interleave(group)
    if dtb is not None:
        dtb = dtb.reshape(-1, K)
        if dtb.shape[0] != HV:
            dtb = dtb.repeat_interleave(group, dim=0)
    af = gate_log_decay(g.to(dtype), A, dtb, use_gate_in_kernel, lower_bound)  # [B, T, HV, K]
    bf = torch.sigmoid(beta.to(dtype)) if beta_is_logit else beta.to(dtype)  # [B, T, HV]

    out = torch.zeros(B, T, HV, V, dtype=dtype, device=dev)
    finals, ckpts = [], []
    for n, (b, bos, length) in enumerate(seq_bounds(T, B, cu_seqlens)):
        S = torch.zeros(HV, V, K, dtype=dtype, device=dev) if initial_state is None else initial_state[n].to(dtype)
        seq_ckpt = []
        starts = chunk_starts(length, chunk_size, checkpoint_every_n_tokens)
        for ci, s0 in enumerate(starts):
            s1 = starts[ci + 1] if ci + 1 < len(starts) else length
            if checkpoint_every_n_tokens and s0 % checkpoint_every_n_tokens == 0:
                seq_ckpt.append(S)
            sl = slice(bos + s0, bos + s1)

            def heads_first(x: torch.Tensor, sl: slice = sl, b: int = b) -> torch.Tensor:
                return x[b, sl].transpose(0, 1)  # [c, HV, ...] -> [HV, c, ...]

            Oc, S_next, parts = chunk_forward(
                S,
                heads_first(qf),
                heads_first(kf),
                heads_first(vf),
                heads_first(af),
                heads_first(bf),
                sub=sub_chunk,
                diag_mode=mode,
                operand_dtype=operand_dtype,
                gemm_dtypes=gemm_dtypes,
                folded_wy=folded_wy,
            )
            out[b, sl] = Oc.transpose(0, 1)
            if trace is not None:
                trace.append(ChunkTrace(seq=n, start=s0, out=Oc, S0=S, S_next=S_next, **parts))
            S = S_next
        finals.append(S)
        ckpts.append(torch.stack(seq_ckpt) if seq_ckpt else torch.zeros(0, HV, V, K, dtype=dtype, device=dev))
    final = torch.stack(finals) if finals else torch.zeros(0, HV, V, K, dtype=dtype, device=dev)
    return ReferenceResult(out, final, ckpts, None)
