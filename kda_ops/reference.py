"""Reference KDA: the token loop of docs/contract.md "Recurrence" written with plain torch ops (fp64 by default).

This is the gold every kernel is tested against. It is deliberately simple: one token at a time,
all value heads of a sequence at once, no chunking, no slots. Gradients come from torch autograd
through the same loop (docs/contract.md "Gradients" is what autograd computes here).

Shapes (one call, N sequences): q, k [B, T, H, K]; v [B, T, HV, V]; g [B, T, HV, K]; beta [B, T, HV];
A_log [HV]; dt_bias [HV, K]; per-sequence start states [N, HV, V, K] (value-first, S[v, k]).
Packed input: B == 1 and cu_seqlens [N+1].
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F

L2_EPS = 1e-6


def l2_normalize(x: torch.Tensor) -> torch.Tensor:
    """x * rsqrt(sum(x^2) + 1e-6) over the last dim (docs/contract.md "Recurrence")."""
    return x * torch.rsqrt((x * x).sum(-1, keepdim=True) + L2_EPS)


def gate_log_decay(
    g: torch.Tensor,
    A_log: torch.Tensor | None,
    dt_bias: torch.Tensor | None,
    use_gate_in_kernel: bool,
    lower_bound: float | None,
) -> torch.Tensor:
    """Per-channel log-decay a (docs/contract.md "Recurrence"). g: [..., HV, K]; A_log [HV]; dt_bias [HV, K] or None.

    precomputed: a = g; softplus: a = -exp(A_log) * softplus(g + dt_bias) (softplus(x) = x for x > 20);
    lower bound: a = λ * sigmoid(exp(A_log) * (g + dt_bias)).
    """
    if not use_gate_in_kernel:
        return g
    assert A_log is not None
    x = g if dt_bias is None else g + dt_bias
    A = torch.exp(A_log)[:, None]  # [HV, 1]
    if lower_bound is None:
        return -A * F.softplus(x, beta=1.0, threshold=20.0)
    return lower_bound * torch.sigmoid(A * x)


@dataclass
class ReferenceResult:
    output: torch.Tensor  # [B, T, HV, V]
    final_state: torch.Tensor  # [N, HV, V, K]
    checkpoints: list[torch.Tensor]  # per sequence: [ceil(L/n), HV, V, K] states before tokens 0, n, 2n, ...
    all_states: list[torch.Tensor] | None  # per sequence: [L, HV, V, K] state after each token


def seq_bounds(T: int, B: int, cu_seqlens: torch.Tensor | None) -> list[tuple[int, int, int]]:
    """(batch row, first token, length) of every sequence."""
    if cu_seqlens is None:
        return [(b, 0, T) for b in range(B)]
    cu = [int(x) for x in cu_seqlens.tolist()]
    return [(0, cu[i], cu[i + 1] - cu[i]) for i in range(len(cu) - 1)]


def recurrent_kda_reference(
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
    checkpoint_every_n_tokens: int = 0,
    return_all_states: bool = False,
    dtype: torch.dtype = torch.float64,
) -> ReferenceResult:
    """Token-serial KDA (docs/contract.md "Recurrence") in `dtype`. `initial_state` is per sequence [N, HV, V, K]
    (None = 0).

    A_log may be [H] and dt_bias [H, K] / [H*K] when HV != H (each value head uses its q/k head's).
    Differentiable in every floating input (use dtype=float64 for gradcheck-grade gradients).
    """
    B, T, H, K = q.shape
    HV, V = v.shape[2], v.shape[3]
    assert HV % H == 0
    group = HV // H
    if scale is None:
        scale = 1.0 / math.sqrt(K)
    dev = q.device
    qf, kf, vf, gf, bf = (t.to(dtype) for t in (q, k, v, g, beta))
    A = None if A_log is None else A_log.to(dtype)
    dtb = None if dt_bias is None else dt_bias.to(dtype)
    if A is not None and A.shape[0] != HV:
        A = A.repeat_interleave(group)  # per q/k head -> per value head
    if dtb is not None:
        dtb = dtb.reshape(-1, K)
        if dtb.shape[0] != HV:
            dtb = dtb.repeat_interleave(group, dim=0)
    seqs = seq_bounds(T, B, cu_seqlens)
    outs = torch.zeros(B, T, HV, V, dtype=dtype, device=dev)
    out_rows: dict[tuple[int, int], torch.Tensor] = {}
    finals, ckpts, alls = [], [], []
    for n, (b, bos, L) in enumerate(seqs):
        S = torch.zeros(HV, V, K, dtype=dtype, device=dev) if initial_state is None else initial_state[n].to(dtype)
        seq_ckpt, seq_all = [], []
        for t in range(L):
            if checkpoint_every_n_tokens and t % checkpoint_every_n_tokens == 0:
                seq_ckpt.append(S)
            qt = qf[b, bos + t].repeat_interleave(group, dim=0)  # [HV, K]
            kt = kf[b, bos + t].repeat_interleave(group, dim=0)  # [HV, K]
            if use_qk_l2norm_in_kernel:
                qt, kt = l2_normalize(qt), l2_normalize(kt)
            qt = qt * scale
            a = gate_log_decay(gf[b, bos + t], A, dtb, use_gate_in_kernel, lower_bound)  # [HV, K]
            bt = torch.sigmoid(bf[b, bos + t]) if beta_is_logit else bf[b, bos + t]  # [HV]
            S = S * torch.exp(a)[:, None, :]  # decay, [HV, V, K]
            p = torch.einsum("hvk,hk->hv", S, kt)  # prediction S k, [HV, V]
            r = bt[:, None] * (vf[b, bos + t] - p)  # delta, [HV, V]
            S = S + r[:, :, None] * kt[:, None, :]  # rank-1 update
            out_rows[(b, bos + t)] = torch.einsum("hvk,hk->hv", S, qt)  # [HV, V]
            if return_all_states:
                seq_all.append(S)
        finals.append(S)
        ckpts.append(torch.stack(seq_ckpt) if seq_ckpt else torch.zeros(0, HV, V, K, dtype=dtype, device=dev))
        if return_all_states:
            alls.append(torch.stack(seq_all) if seq_all else torch.zeros(0, HV, V, K, dtype=dtype, device=dev))
    if out_rows:
        # Rebuild the output without in-place writes so autograd flows to every token.
        rows = []
        for b in range(B):
            for t in range(T):
                rows.append(out_rows.get((b, t), torch.zeros(HV, V, dtype=dtype, device=dev)))
        outs = torch.stack(rows).reshape(B, T, HV, V)
    final = torch.stack(finals) if finals else torch.zeros(0, HV, V, K, dtype=dtype, device=dev)
    return ReferenceResult(outs, final, ckpts, alls if return_all_states else None)


def reference_training_grads(
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
):
    """fp64 autograd through the reference for the training contract (L2 norm, lower-bound gate,
    logit beta). Loss = <o, do> + <S_T, dS_T>. Returns (out, final_state, grads) with grads the
    eight tensors (dq, dk, dv, dg, dbeta, dA_log, ddt_bias, dinitial_state) in fp64."""
    leaves = [
        t.detach().to(torch.float64).requires_grad_(True) for t in (q, k, v, g, beta, A_log, dt_bias, initial_state)
    ]
    res = recurrent_kda_reference(
        *leaves[:5],
        A_log=leaves[5],
        dt_bias=leaves[6],
        scale=scale,
        initial_state=leaves[7],
        cu_seqlens=cu_seqlens,
        use_qk_l2norm_in_kernel=True,
        use_gate_in_kernel=True,
        lower_bound=lower_bound,
        beta_is_logit=True,
    )
    loss = (res.output * do.to(torch.float64)).sum()
    if dfinal_state is not None:
        loss = loss + (res.final_state * dfinal_state.to(torch.float64)).sum()
    grads = torch.autograd.grad(loss, leaves, allow_unused=True)
    grads = [torch.zeros_like(x) if gr is None else gr for gr, x in zip(grads, leaves, strict=True)]
    return res.output.detach(), res.final_state.detach(), grads


def rel_rms(actual: torch.Tensor, expected: torch.Tensor) -> float:
    """Relative RMS error ||a - e||_2 / max(||e||_2, tiny), in fp64 (the metric of docs/contract.md "Tolerances")."""
    a, e = actual.detach().double().cpu(), expected.detach().double().cpu()
    den = e.norm().item()
    return (a - e).norm().item() / max(den, 1e-30)


def make_inputs(
    B: int = 1,
    T: int = 16,
    H: int = 2,
    HV: int = 2,
    K: int = 128,
    V: int = 128,
    N_pool: int | None = None,
    dtype: torch.dtype = torch.bfloat16,
    state_dtype: torch.dtype = torch.float32,
    device: str = "cpu",
    seed: int = 0,
    cu_seqlens: list[int] | None = None,
) -> dict[str, torch.Tensor]:
    """Random test inputs of the documented shapes (token tensors ~N(0,1) in `dtype`)."""
    gen = torch.Generator().manual_seed(seed)
    if cu_seqlens is not None:
        B, T = 1, cu_seqlens[-1]
    N = len(cu_seqlens) - 1 if cu_seqlens is not None else B
    N_pool = N if N_pool is None else N_pool

    def rnd(*shape, s=1.0):
        return (torch.randn(*shape, generator=gen) * s).to(dtype).to(device)

    out = dict(
        q=rnd(B, T, H, K),
        k=rnd(B, T, H, K),
        v=rnd(B, T, HV, V),
        g=rnd(B, T, HV, K),
        beta=rnd(B, T, HV),
        A_log=(torch.rand(HV, generator=gen) * 0.5 + 0.1).to(device),
        dt_bias=(torch.randn(HV, K, generator=gen) * 0.1).to(device),
        initial_state=(torch.randn(N_pool, HV, V, K, generator=gen) * 0.1).to(state_dtype).to(device),
    )
    if cu_seqlens is not None:
        out["cu_seqlens"] = torch.tensor(cu_seqlens, dtype=torch.int64, device=device)
    return out
