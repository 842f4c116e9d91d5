"""Context parallelism for KDA over a torch.distributed process group: exact, no truncation.

A packed batch (B == 1, ``cu_seqlens`` over all ranks' tokens) is split into contiguous token ranges:
rank r holds tokens ``[t_r, t_{r+1})`` of q, k, v, g, beta. A sequence may start on one rank and end
several ranks later. Per value head the state map of a run of tokens is affine (state S [V, K],
value-first):

    S_end = S_start · P + Q,   P = Π_t diag(γ_t)(I - β_t k_t k_tᵀ)  [K, K],   Q = S_end from S_start = 0

(γ_t = exp(a_t), k_t normalised). Q is the end state of the run from a zero state; P is the end state
from the identity (rows e_i: a [K, K] state, so v = 0 of head dim K) with v = 0. The backward is its
transpose: with dS_end known, ``dS_start = dS_end · Pᵀ + G`` where G is the start-state gradient of the
run's backward with a zero end-state gradient.

Forward, on every rank r (all collectives in a fixed order, so results are deterministic):
  1. Sequences that start on r run first (their start states are known): if the last of them continues
     on r+1, its end state is this rank's carry-out, ``S_out = Q_r`` (P_r = 0). A rank lying inside one
     sequence computes that sequence's (P_r, Q_r) over all its tokens instead; a rank with no token is
     the identity map.
  2. One ``all_gather`` of the (P_r, Q_r) blocks (same size on every rank); each rank scans
     ``S_{j+1} = S_j P_j + Q_j`` over the ranks before it, in rank order, in the state dtype: the exact
     state entering rank r.
  3. The sequence that entered rank r from earlier ranks runs from that exact state.
Backward, mirrored: the sequence that entered r from earlier ranks is backpropagated first (with its
known end-state gradient, or zero when it continues past r: then G_r, and the map is P_rᵀ), one
``all_gather`` of the G_r blocks, a reverse scan ``dS_{j} = dS_{j+1} P_jᵀ + G_j`` over the later ranks
gives the exact end-state gradient of the sequence that leaves rank r, and the remaining local
backward runs from it. Nothing is exchanged when no sequence crosses a rank boundary.

Cost per rank, relative to the local single-process work: a rank that starts no sequence of its own
(it lies inside one) runs its tokens three times in the forward (P, Q, outputs) and twice in the
backward; other ranks run every token once each way. Exchanged: (HV·K·K + HV·V·K) state-dtype values
per rank in the forward, HV·V·K in the backward, times the group size (all_gather).

The computation is the default mode of :func:`kda_ops.kda` (the path with a backward): L2 norm on
q and k, the lower-bound gate ``a = λ sigmoid(exp(A_log)(g + dt_bias))`` with λ in [-5, 0), logit
beta ``β = sigmoid(beta)``, GQA (HV % H == 0). Token dtypes and head dims as that path: bf16 with
K == V in {64, 128} on CUDA; bf16/fp32/fp64 and any K, V on CPU.
"""

from __future__ import annotations

from bisect import bisect_left
from collections.abc import Sequence
from typing import Any

import torch
import torch.distributed as dist

from kda_ops import _state_map as SM
from kda_ops import _validate as V
from kda_ops.interface import recurrent_kda_training_backward, recurrent_kda_training_forward

__all__ = ["context_parallel_kda", "ContextParallelPlan"]


# ---------------------------------------------------------------------------------------------------
# host plan (identical on every rank: built from the global cu_seqlens and the gathered token counts)


class ContextParallelPlan:
    """Which sequences each rank holds, and how the rank maps the state that crosses it.

    Args:
        cu_seqlens: the global sequence boundaries (host ints, [N+1]).
        offsets: token offsets of the ranks, ``t_0 = 0 <= t_1 <= ... <= t_R = cu_seqlens[-1]``.
        rank: the rank this plan is read from.

    Attributes (for ``rank``):
        seq_in: the sequence that enters the rank from earlier ranks (cu[n] < t_r < cu[n+1]), or None.
        seq_out: the sequence that leaves for later ranks (cu[n] < t_{r+1} < cu[n+1]), or None.
        len_in: local tokens of ``seq_in`` (they come first).
        rest_ids: the sequences that start on the rank (and the zero-length ones it owns), in order.
        rest_cu: their local boundaries, relative to token ``len_in``.
        owner: owner[n] = the rank that returns sequence n's final state: the rank of its last token
            (zero-length sequences: the first rank r with t_{r+1} >= their position).
        kinds: per rank j, how its state map reads: "none" (no sequence leaves j), "pass" (no token,
            a sequence crosses: identity), "inner" (j lies inside one sequence: S_out = S_in P + Q),
            "restart" (the sequence leaving j starts on j: S_out = Q). The backward map of rank j is
            "none" when no sequence enters j and "restart" when the entering one ends on j.
    """

    def __init__(self, cu_seqlens: Sequence[int], offsets: Sequence[int], rank: int) -> None:
        cu = [int(c) for c in cu_seqlens]
        t = [int(x) for x in offsets]
        self.cu, self.offsets, self.rank = cu, t, rank
        self.N, self.R = len(cu) - 1, len(t) - 1

        def crossing(x: int) -> int | None:
            i = bisect_left(cu, x)  # first boundary >= x
            if i <= self.N and cu[i] == x:
                return None
            return i - 1

        self.cross = [crossing(x) for x in t]  # cross[j]: the sequence running through offset t_j
        self.owner = [bisect_left(t, cu[n + 1], 1) - 1 for n in range(self.N)]
        self.kinds_fwd: list[str] = []
        self.kinds_bwd: list[str] = []
        for j in range(self.R):
            a, b, empty = self.cross[j], self.cross[j + 1], t[j] == t[j + 1]
            inner = a is not None and a == b
            self.kinds_fwd.append("none" if b is None else ("pass" if empty else "inner") if inner else "restart")
            self.kinds_bwd.append("none" if a is None else ("pass" if empty else "inner") if inner else "restart")
        self.any_crossing = any(c is not None for c in self.cross)

        r = rank
        t0, t1 = t[r], t[r + 1]
        self.seq_in, self.seq_out = self.cross[r], self.cross[r + 1]
        self.inner = self.seq_in is not None and self.seq_in == self.seq_out
        self.len_in = 0 if self.seq_in is None else min(cu[self.seq_in + 1], t1) - t0
        ids = []
        for n in range(self.N):
            s, e = cu[n], cu[n + 1]
            if (s < e and t0 <= s < t1) or (s == e and self.owner[n] == r):
                ids.append(n)
        self.rest_ids = ids
        rc = [0]
        for n in ids:
            rc.append(rc[-1] + max(0, min(cu[n + 1], t1) - max(cu[n], t0)))
        self.rest_cu = rc
        assert self.len_in + rc[-1] == t1 - t0, (self.len_in, rc, t0, t1)


# ---------------------------------------------------------------------------------------------------
# collectives


def _comm_device(group: Any) -> torch.device:
    """NCCL moves CUDA tensors only (the current device); gloo takes CPU tensors (tensors on a GPU go
    through the host)."""
    if "nccl" in str(dist.get_backend(group)).lower():
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def _all_gather(x: torch.Tensor, group: Any, comm: torch.device) -> list[torch.Tensor]:
    """all_gather of a same-shaped tensor, returned on x's device, in rank order."""
    y = x.to(comm).contiguous()
    parts = [torch.empty_like(y) for _ in range(dist.get_world_size(group))]
    dist.all_gather(parts, y, group=group)
    return [p.to(x.device) for p in parts]


# ---------------------------------------------------------------------------------------------------
# local pieces


def _slice(xs: Sequence[torch.Tensor], a: int, b: int) -> list[torch.Tensor]:
    return [x[:, a:b] for x in xs]


def _zero_grads(tok: Sequence[torch.Tensor]) -> list[torch.Tensor]:
    return [torch.zeros_like(x) for x in tok]


def _segment_map(tok, A, dtb, kw, pdt, HV, K, Vd):  # type: ignore[no-untyped-def]
    """(P [HV, K, K], Q [HV, V, K]) of the whole token range (one run: kda_ops/_state_map.py); ``kw``: the training
    keywords (scale, lower_bound, the modes)."""
    dev = tok[0].device

    def forward(q, k, v, g, beta, start):  # type: ignore[no-untyped-def]
        return recurrent_kda_training_forward(q, k, v, g, beta, A, dtb, start, **kw)[1]

    Q = SM.offsets(forward, *tok, torch.zeros((1, HV, Vd, K), dtype=pdt, device=dev))
    P = SM.transitions(forward, *tok, 1, pdt)
    return P[0], Q[0]


def _packed_forward(tok, A, dtb, h0, cu_host, kw):  # type: ignore[no-untyped-def]
    """Training forward of a packed local range (B == 1). Returns (o, final [n, HV, V, K], ctx or None)."""
    q = tok[0]
    if q.shape[1] == 0:  # nothing to run: zero-length sequences keep their start state
        HV, Vd = tok[2].shape[2], tok[2].shape[3]
        return q.new_empty((1, 0, HV, Vd)), h0.clone(), None
    cu_cpu = torch.tensor(cu_host, dtype=torch.int64)
    cu_dev = cu_cpu.to(q.device)
    o, fs, ctx = recurrent_kda_training_forward(*tok, A, dtb, h0, cu_seqlens=cu_dev, cu_seqlens_cpu=cu_cpu, **kw)
    return o, fs, ctx


def _packed_backward(ctx, tok, do, dfinal, A, dtb):  # type: ignore[no-untyped-def]
    """Backward of a `_packed_forward` range: (5 token grads, dA_log, ddt_bias, dinitial_state)."""
    if ctx is None:
        zero = [None if t is None else torch.zeros_like(t) for t in (A, dtb)]
        return [*_zero_grads(tok), *zero, dfinal.clone()]
    return list(recurrent_kda_training_backward(ctx, do.contiguous(), dfinal.contiguous()))


# ---------------------------------------------------------------------------------------------------
# validation (local, before the first collective)


# ---------------------------------------------------------------------------------------------------
# autograd


class _ContextParallelKDA(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, g, beta, A, dtb, h0, plan, group, comm, kw, pdt):  # type: ignore[no-untyped-def]
        tok = (q, k, v, g, beta)
        HV, Vd, K = v.shape[2], v.shape[3], q.shape[3]
        N, dev = plan.N, q.device
        r = plan.rank
        li = plan.len_in

        # 1. sequences starting here (their start states are known), or the map of an inner rank
        rest_tok = _slice(tok, li, q.shape[1])
        if h0 is not None:
            h0_rest = h0[plan.rest_ids] if plan.rest_ids else h0.new_zeros((0, HV, Vd, K))
        else:
            h0_rest = torch.zeros((len(plan.rest_ids), HV, Vd, K), dtype=pdt, device=dev)
        o_rest = fs_rest = ctx_rest = None
        if plan.rest_ids:
            o_rest, fs_rest, ctx_rest = _packed_forward(rest_tok, A, dtb, h0_rest, plan.rest_cu, kw)
        P_r = torch.zeros((HV, K, K), dtype=pdt, device=dev)
        Q_r = torch.zeros((HV, Vd, K), dtype=pdt, device=dev)
        kind = plan.kinds_fwd[r]
        if kind == "inner":
            P_r, Q_r = _segment_map(tok, A, dtb, kw, pdt, HV, K, Vd)
        elif kind == "restart":
            Q_r = fs_rest[-1]

        # 2. exchange and scan, in rank order
        Ps: list[torch.Tensor] = []
        if plan.any_crossing:
            flat = torch.cat([P_r.reshape(-1), Q_r.reshape(-1)])
            parts = _all_gather(flat, group, comm)
            Ps = [p[: HV * K * K].view(HV, K, K) for p in parts]
            Qs = [p[HV * K * K :].view(HV, Vd, K) for p in parts]

        # 3. the sequence entering this rank, from its exact start state
        o_in = ctx_in = fs_in = S_in = None
        if plan.seq_in is not None:
            S = torch.zeros((HV, Vd, K), dtype=pdt, device=dev)
            for j in range(r):
                kj = plan.kinds_fwd[j]
                if kj == "inner":
                    S = SM.compose(S, Ps[j], Qs[j])
                elif kj == "restart":
                    S = Qs[j].clone()
                elif kj == "none":
                    S = torch.zeros_like(S)
            S_in = S.unsqueeze(0).contiguous()
            if li > 0:
                o_in, fs_in, ctx_in = _packed_forward(_slice(tok, 0, li), A, dtb, S_in, [0, li], kw)

        # assemble
        pieces = [x for x in (o_in, o_rest) if x is not None]
        o = torch.cat(pieces, 1) if len(pieces) > 1 else (pieces[0] if pieces else q.new_empty((1, 0, HV, Vd)))
        final = torch.zeros((N, HV, Vd, K), dtype=pdt, device=dev)
        if fs_in is not None and plan.owner[plan.seq_in] == r:
            final[plan.seq_in] = fs_in[0]
        for i, n in enumerate(plan.rest_ids):
            if plan.owner[n] == r:
                final[n] = fs_rest[i]

        ctx.plan, ctx.group, ctx.comm = plan, group, comm
        ctx.has_h0 = h0 is not None
        ctx.ctx_in, ctx.ctx_rest, ctx.S_in, ctx.Ps = ctx_in, ctx_rest, S_in, Ps
        ctx.shapes = (HV, Vd, K, pdt)
        ctx.save_for_backward(q, k, v, g, beta, A, dtb)
        return o, final

    @staticmethod
    def backward(ctx, do, dfinal):  # type: ignore[no-untyped-def]
        q, k, v, g, beta, A, dtb = ctx.saved_tensors
        tok = (q, k, v, g, beta)
        plan: ContextParallelPlan = ctx.plan
        HV, Vd, K, pdt = ctx.shapes
        r, li, dev = plan.rank, plan.len_in, q.device
        if do is None:
            do = torch.zeros(v.shape, dtype=q.dtype, device=dev)
        if dfinal is None:
            dfinal = torch.zeros((plan.N, HV, Vd, K), dtype=pdt, device=dev)

        # 1. the sequence entering this rank: its start-state gradient G_r (end-state gradient: the given
        #    one when it ends here, zero when it continues: then the map is dS_in = dS_out P_rᵀ + G_r)
        g_in = None
        G_r = torch.zeros((HV, Vd, K), dtype=pdt, device=dev)
        if plan.seq_in is not None and li > 0:
            if plan.inner:
                zero_end = torch.zeros((1, HV, Vd, K), dtype=pdt, device=dev)
                G_r = _packed_backward(ctx.ctx_in, _slice(tok, 0, li), do[:, :li], zero_end, A, dtb)[7][0]
            else:
                dS_end = dfinal[plan.seq_in : plan.seq_in + 1]
                g_in = _packed_backward(ctx.ctx_in, _slice(tok, 0, li), do[:, :li], dS_end, A, dtb)
                G_r = g_in[7][0]

        # 2. exchange and reverse scan over the later ranks
        dS_out = torch.zeros((HV, Vd, K), dtype=pdt, device=dev)
        if plan.any_crossing:
            Gs = _all_gather(G_r.reshape(-1), ctx.group, ctx.comm)
            if plan.seq_out is not None:
                for j in range(plan.R - 1, r, -1):
                    kj = plan.kinds_bwd[j]
                    Gj = Gs[j].view(HV, Vd, K)
                    if kj == "inner":
                        dS_out = SM.compose_grad(dS_out, ctx.Ps[j], Gj)
                    elif kj == "restart":
                        dS_out = Gj.clone()
                    elif kj == "none":
                        dS_out = torch.zeros_like(dS_out)

        # 3. the rest of the local backward, from the exact end-state gradient of the sequence leaving
        if plan.inner and li > 0:
            g_in = _packed_backward(ctx.ctx_in, _slice(tok, 0, li), do[:, :li], dS_out.unsqueeze(0), A, dtb)
        g_rest = None
        if plan.rest_ids:
            # every sequence of the rest ends here (its final-state gradient is given) but the one leaving
            d_rest = dfinal[plan.rest_ids].clone()
            if plan.seq_out is not None:
                d_rest[-1] = dS_out
            g_rest = _packed_backward(ctx.ctx_rest, _slice(tok, li, q.shape[1]), do[:, li:], d_rest, A, dtb)

        # assemble
        grads: list[torch.Tensor | None] = []
        for i, x in enumerate(tok):
            pieces = [gr[i] for gr in (g_in, g_rest) if gr is not None]
            if not pieces:
                grads.append(torch.zeros_like(x))
            else:
                grads.append(torch.cat(pieces, 1) if len(pieces) > 1 else pieces[0])
        dA = None if A is None else torch.zeros_like(A)
        ddtb = None if dtb is None else torch.zeros_like(dtb)
        for gr in (g_in, g_rest):  # fixed order: deterministic
            if gr is not None:
                dA = dA if gr[5] is None else dA + gr[5]
                ddtb = ddtb if gr[6] is None else ddtb + gr[6].view_as(dtb)
        dh0 = None
        if ctx.has_h0:
            dh0 = torch.zeros((plan.N, HV, Vd, K), dtype=pdt, device=dev)
            if g_rest is not None:
                dh0[plan.rest_ids] = g_rest[7]
        return (*grads, dA, ddtb, dh0, None, None, None, None, None)  # (plan, group, comm, kw, pdt)


# ---------------------------------------------------------------------------------------------------
# public entry


def context_parallel_kda(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    A_log: torch.Tensor | None,
    dt_bias: torch.Tensor | None,
    initial_state: torch.Tensor | None = None,
    *,
    cu_seqlens: torch.Tensor | Sequence[int],
    group: Any = None,
    scale: float | None = None,
    lower_bound: float | None = -5.0,
    output_final_state: bool = False,
    token_offsets: Sequence[int] | None = None,
    use_gate_in_kernel: bool = True,
    use_qk_l2norm_in_kernel: bool = True,
    beta_is_logit: bool = True,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Differentiable KDA over a packed batch split into contiguous token ranges over the ranks of
    ``group`` (context parallelism). Equals :func:`kda_ops.kda` on the whole batch in one process,
    within floating point: start states are exact (see the module docstring for the algebra).

    Every rank of the group calls this (and later runs the backward) with the same ``cu_seqlens``,
    ``scale``, ``lower_bound``, ``output_final_state`` and replicated ``A_log``, ``dt_bias``,
    ``initial_state``; rank r passes its own tokens ``[t_r, t_{r+1})``, in rank order.

    Args:
        q, k: [1, T_r, H, K]; v: [1, T_r, HV, V]; g: [1, T_r, HV, K] raw gate (the log-decay with
            ``use_gate_in_kernel=False``); beta: [1, T_r, HV] logits (β itself with ``beta_is_logit=False``).
            T_r >= 0 (a rank may hold no token). Dtypes and head dims of the training path: bf16 with
            K == V in {64, 128} on CUDA; bf16/fp32/fp64, any K, V on CPU.
        A_log: [HV] (None without the gate); dt_bias: [HV, K] or [HV*K], or None (0); fp32 (fp64 with fp64
            tokens).
        initial_state: [N, HV, V, K] in that dtype, the start state of every global sequence, or None
            (zeros, no gradient).
        cu_seqlens: the GLOBAL boundaries [N+1] (int tensor on any device, or a list of ints): starts at
            0, non-decreasing, ends at Σ_r T_r. Zero-length sequences are allowed. Host values plan the
            split (a device tensor is copied to the host: one sync).
        group: the process group (None: the default group). gloo (CPU tensors, or CUDA tensors staged
            through the host) or NCCL (CUDA tensors).
        scale: finite > 0; None means 1/sqrt(K). lower_bound: λ in [-5, 0), None: the softplus gate.
        use_gate_in_kernel, use_qk_l2norm_in_kernel, beta_is_logit: the modes of :func:`kda_ops.kda` (every
            one is supported).
        output_final_state: also return the final states.
        token_offsets: optional host ints [R+1], ``t_0 = 0 ... t_R``; checked against this rank's T_r.
            None: the token counts are gathered (one small all_gather).

    Returns:
        ``(o, final_state)``: o [1, T_r, HV, V] in q's dtype (this rank's tokens). final_state
        [N, HV, V, K] (state dtype) when ``output_final_state``, else None: row n holds sequence n's final
        state on the rank of its last token (zero-length sequences: the first rank r with
        t_{r+1} >= cu_seqlens[n]), zeros on the other ranks, so its sum over the ranks is the
        single-process final state (:class:`ContextParallelPlan` ``.owner`` says which rank).

    Gradients: q, k, v, g, beta of this rank's tokens are exact. A_log, dt_bias and initial_state are
    replicated: each rank returns its tokens' (its sequences') share, and the sum over the ranks is the
    single-process gradient (DDP/FSDP over the group, or an all_reduce, adds them; initial_state row n
    gets its gradient on the rank where sequence n starts). Every rank must run the backward (it holds a
    collective), even a rank with no token.

    Raises:
        TypeError, ValueError, RuntimeError: as :func:`kda_ops.kda` for this rank's tensors (named), plus
        cu_seqlens of the wrong type or values, T_r that do not add up to cu_seqlens[-1], token_offsets
        that disagree, ranks that disagree on cu_seqlens, a group of another backend than gloo/NCCL for
        the device. Local checks run before the first collective, and the first collective carries
        every rank's verdict: a rank whose input is rejected raises its error, the others raise
        RuntimeError naming that rank (no rank is left waiting).
    """
    if not dist.is_available() or not dist.is_initialized():
        raise RuntimeError("context_parallel_kda needs an initialised torch.distributed process group")
    R = dist.get_world_size(group)
    rank = dist.get_rank(group)
    comm = _comm_device(group)
    err: BaseException | None = None
    try:
        d, A, dtb, h0, sc, kw, pdt = V.check_context_parallel_local(
            q, k, v, g, beta, A_log, dt_bias, initial_state, scale, lower_bound, use_gate_in_kernel,
            use_qk_l2norm_in_kernel, beta_is_logit,
        )  # fmt: skip
        ofs = V.check_bool(output_final_state, "output_final_state")
        cu = V.check_context_parallel_cu(cu_seqlens, h0)
        if q.device.type != "cuda" and "nccl" in str(dist.get_backend(group)).lower():
            raise RuntimeError(f"q must be on a CUDA device with an NCCL process group, got {q.device}")
        T_r = int(q.shape[1])
        if token_offsets is not None:
            offs = [int(x) for x in token_offsets]
            if len(offs) != R + 1 or offs[0] != 0 or any(b < a for a, b in zip(offs, offs[1:], strict=False)):
                raise ValueError(f"token_offsets must be R+1={R + 1} non-decreasing ints from 0, got {offs}")
            if offs[rank + 1] - offs[rank] != T_r:
                raise ValueError(
                    f"token_offsets gives rank {rank} {offs[rank + 1] - offs[rank]} tokens, but q holds T={T_r}"
                )
        checksum = sum((i + 1) * c for i, c in enumerate(cu)) % (1 << 61)
        meta = torch.tensor([T_r, 1, len(cu), checksum], dtype=torch.int64)
    except BaseException as e:  # noqa: BLE001  (re-raised below, after the other ranks heard of it)
        err = e
        meta = torch.tensor([0, 0, 0, 0], dtype=torch.int64)
    gathered = torch.stack(_all_gather(meta, group, comm)).cpu()
    if err is not None:
        raise err
    bad = [j for j in range(R) if int(gathered[j, 1]) == 0]
    if bad:
        raise RuntimeError(f"context_parallel_kda: rank {bad[0]} rejected its input (see the error on that rank)")
    if any(int(gathered[j, 2]) != len(cu) or int(gathered[j, 3]) != checksum for j in range(R)):
        raise ValueError("cu_seqlens must be the same global boundaries on every rank, got different values")
    counts = [int(x) for x in gathered[:, 0]]
    offsets = [0]
    for c in counts:
        offsets.append(offsets[-1] + c)
    if token_offsets is not None and offs != offsets:
        raise ValueError(f"token_offsets must match the ranks' token counts {offsets}, got {offs}")
    if offsets[-1] != cu[-1]:
        raise ValueError(
            f"cu_seqlens must end at the total token count over the ranks, Σ T_r = {offsets[-1]} (per rank "
            f"{counts}), got {cu[-1]}"
        )
    plan = ContextParallelPlan(cu, offsets, rank)
    o, final = _ContextParallelKDA.apply(q, k, v, g, beta, A, dtb, h0, plan, group, comm, kw, pdt)
    return o, (final if ofs else None)
