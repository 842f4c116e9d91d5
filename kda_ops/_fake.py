"""Fake (meta) kernels of every ``torch.ops.kda`` op: shapes and dtypes only, never tensor values.

Used by torch.compile, FakeTensor and meta tensors. The ``torch._check`` calls mirror the C++ checks of
csrc/api/recurrent_params.h (the memory-safety guards of a direct op call); the full, labelled
validation is kda_ops/_validate.py, which runs before any op call of the public API.

Output rules (shared with the CPU and CUDA implementations):
- training forward: out [B, T, HV, V] in q's dtype; final_state [N, HV, V, K] in initial_state's
  dtype; tapes [rows, HV, V, K] fp32 (fp64 when q is fp64): the state before every 64-token chunk but
  each sequence's first (that one is initial_state), rows = B*(ceil(T/64) - 1) fixed (0 for T == 0),
  T//64 packed (an upper bound from shapes, spare rows zero); tape_cu_starts int64 [N+1]. All contiguous.
- backward ops: dq, dk, dv, dg, dbeta shaped like their inputs in q's dtype; dA_log / ddt_bias shaped
  like A_log / dt_bias in A_log's dtype (empty [0] when that parameter is None: no gate, or no dt_bias);
  dinitial_state [N, HV, V, K] in initial_state's dtype
  (recurrent_kda_backward) or the tapes' dtype (training backward, whose initial_state is optional).
  All contiguous.
"""

from __future__ import annotations

import torch

from kda_ops._validate import tape_rows


def _check_tokens(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor) -> None:
    torch._check(
        q.dim() == 4 and k.dim() == 4 and v.dim() == 4 and g.dim() == 4 and beta.dim() == 3,
        lambda: "q, k, v, g must be rank 4 and beta rank 3",
    )
    B, T, H, K = q.shape
    HV = v.shape[2]
    torch._check(HV % H == 0, lambda: f"HV % H must be 0, got HV={HV}, H={H}")
    torch._check(tuple(k.shape) == tuple(q.shape), lambda: f"k must have the shape of q {q.shape}, got {k.shape}")
    torch._check(v.shape[0] == B and v.shape[1] == T, lambda: f"v must be [B, T, HV, V], got {v.shape}")
    torch._check(tuple(g.shape) == (B, T, HV, K), lambda: f"g must be [B, T, HV, K], got {g.shape}")
    torch._check(tuple(beta.shape) == (B, T, HV), lambda: f"beta must be [B, T, HV], got {beta.shape}")
    dtypes = (k.dtype, v.dtype, g.dtype, beta.dtype)
    torch._check(
        all(d == q.dtype for d in dtypes), lambda: f"k, v, g, beta must share q's dtype {q.dtype}, got {dtypes}"
    )


def _num_seqs(q: torch.Tensor, cu_seqlens: torch.Tensor | None):
    if cu_seqlens is None:
        return q.shape[0]
    torch._check(q.shape[0] == 1, lambda: f"cu_seqlens needs B == 1, got B={q.shape[0]}")
    torch._check(
        cu_seqlens.dim() == 1 and cu_seqlens.shape[0] >= 2,
        lambda: f"cu_seqlens must be a [N+1] tensor with N >= 1, got {cu_seqlens.shape}",
    )
    torch._check(
        cu_seqlens.dtype in (torch.int32, torch.int64),
        lambda: f"cu_seqlens must be int32 or int64, got {cu_seqlens.dtype}",
    )
    return cu_seqlens.shape[0] - 1


def _acc_dtype(q: torch.Tensor) -> torch.dtype:
    return torch.float64 if q.dtype == torch.float64 else torch.float32


def _check_gate_params(A_log: torch.Tensor | None, dt_bias: torch.Tensor | None, HV, K) -> None:
    if A_log is not None:
        torch._check(A_log.dim() == 1 and A_log.shape[0] == HV, lambda: f"A_log must be [HV]=[{HV}], got {A_log.shape}")
    if dt_bias is not None:
        torch._check(dt_bias.numel() == HV * K, lambda: f"dt_bias must be [HV, K]=[{HV}, {K}], got {dt_bias.shape}")


@torch.library.register_fake("kda::recurrent_kda")
def _recurrent_kda_fake(
    q,
    k,
    v,
    g,
    beta,
    A_log,
    dt_bias,
    state,
    state_source,
    initial_state_indices,
    cu_seqlens,
    ssm_state_indices,
    num_accepted_tokens,
    seq_order,
    output,
    final_state,
    state_checkpoints,
    checkpoint_cu_starts,
    workspace,
    scale,
    gate_mode,
    lower_bound,
    use_qk_l2norm,
    beta_is_logit,
    num_spec_tokens,
    checkpoint_every_n_tokens,
    backend,
    zero_uncovered=False,
    disable_state_update=False,
):
    # zero_uncovered only chooses what is written into `output`, disable_state_update whether `state` is
    # written at all (no shape, dtype or aliasing effect: the schema still marks `state` mutable).
    _check_tokens(q, k, v, g, beta)
    B, T, H, K = q.shape
    HV, V = v.shape[2], v.shape[3]
    # (a 1-D empty output: a state-only call, as the C++ op accepts)
    torch._check(
        tuple(output.shape) == tuple(v.shape) or tuple(output.shape) == (0,),
        lambda: f"output must have the shape of v, got {output.shape}",
    )
    torch._check(output.dtype == q.dtype, lambda: f"output must be {q.dtype}, got {output.dtype}")
    torch._check(gate_mode in (0, 1, 2), lambda: f"gate_mode must be 0, 1 or 2, got {gate_mode}")
    torch._check(backend in (0, 1, 2), lambda: f"backend must be 0, 1 or 2, got {backend}")
    if gate_mode != 0:
        torch._check(A_log is not None, lambda: "A_log is required by the in-kernel gate")
        torch._check(A_log.numel() == HV and A_log.dtype == torch.float32, lambda: f"A_log must be fp32 [HV]={HV}")
        if dt_bias is not None:
            torch._check(
                dt_bias.numel() == HV * K and dt_bias.dtype == torch.float32,
                lambda: f"dt_bias must be fp32 [HV, K]=[{HV}, {K}]",
            )
    for s, name in ((state, "initial_state"), (state_source, "initial_state_source")):
        if s is not None:
            torch._check(
                s.dim() == 4 and tuple(s.shape[1:]) == (HV, V, K),
                lambda s=s, name=name: f"{name} must be [N_pool, HV, V, K], got {s.shape}",
            )
    N = _num_seqs(q, cu_seqlens)
    S = num_spec_tokens
    if ssm_state_indices is not None:
        torch._check(
            ssm_state_indices.dtype == torch.int32 and ssm_state_indices.numel() == N * (S + 1),
            lambda: "ssm_state_indices must be int32 with N*(1+S) elements",
        )
    if S > 0:
        torch._check(
            ssm_state_indices is not None and state is not None,
            lambda: "speculative decode needs initial_state and ssm_state_indices [N, 1+S]",
        )
    for t, name in (
        (num_accepted_tokens, "num_accepted_tokens"),
        (initial_state_indices, "initial_state_indices"),
        (seq_order, "seq_order"),
    ):
        if t is not None:
            torch._check(t.dtype == torch.int32 and t.numel() == N, lambda name=name: f"{name} must be int32 [N]")
    if state_source is not None:
        torch._check(
            initial_state_indices is not None, lambda: "initial_state_indices is required with initial_state_source"
        )
    if final_state is not None:
        torch._check(
            final_state.dtype == torch.float32 and final_state.numel() == N * HV * V * K,
            lambda: "final_state must be fp32 [N, HV, V, K]",
        )
    if checkpoint_every_n_tokens > 0:
        torch._check(
            state_checkpoints is not None and checkpoint_cu_starts is not None,
            lambda: "checkpointing needs state_checkpoints and checkpoint_cu_starts",
        )
        torch._check(
            state_checkpoints.dim() == 4 and tuple(state_checkpoints.shape[1:]) == (HV, V, K),
            lambda: "state_checkpoints must be [C, HV, V, K]",
        )
        torch._check(
            checkpoint_cu_starts.dtype == torch.int64 and checkpoint_cu_starts.numel() == N + 1,
            lambda: "checkpoint_cu_starts must be int64 [N+1]",
        )
    return None


def _check_state(s, name, N, HV, V, K):  # type: ignore[no-untyped-def]
    """A per-sequence state argument: [N, HV, V, K]."""
    torch._check(
        tuple(s.shape) == (N, HV, V, K),
        lambda: f"{name} must be [N, HV, V, K]=[{N}, {HV}, {V}, {K}], got {s.shape}",
    )


# fmt: off
@torch.library.register_fake("kda::recurrent_kda_decode")
def _recurrent_kda_decode_fake(q, k, v, g, beta, A_log, dt_bias, state, ssm_state_indices, num_accepted_tokens, output,
                               scale, lower_bound, decode_flags):
    f = decode_flags
    # the decode-shaped subset of recurrent_kda (registration.cpp): the same checks with its flags unpacked
    _recurrent_kda_fake(q, k, v, g, beta, A_log, dt_bias, state, None, None, None, ssm_state_indices,
                        num_accepted_tokens, None, output, None, None, None, None, scale, f & 3, lower_bound,
                        bool(f & 4), bool(f & 8), f >> 16, 0, (f >> 8) & 0xFF, False, bool(f & 16))
# fmt: on


def _training_dims(q, k, v, g, beta, A_log, dt_bias, cu_seqlens):
    """The token and gate checks of the three training ops -> (B, T, HV, K, V, N)."""
    _check_tokens(q, k, v, g, beta)
    B, T, H, K = q.shape
    HV, V = v.shape[2], v.shape[3]
    _check_gate_params(A_log, dt_bias, HV, K)
    return B, T, HV, K, V, _num_seqs(q, cu_seqlens)


def _check_do(do, B, T, HV, V):
    torch._check(tuple(do.shape) == (B, T, HV, V), lambda: f"do must be [B, T, HV, V], got {do.shape}")


@torch.library.register_fake("kda::kda_forward")
@torch.library.register_fake("kda::recurrent_kda_training_forward")
def _training_forward_fake(
    q,
    k,
    v,
    g,
    beta,
    A_log,
    dt_bias,
    initial_state,
    cu_seqlens,
    scale,
    lower_bound,
    gate_mode=2,
    use_qk_l2norm=True,
    beta_is_logit=True,
):
    B, T, HV, K, V, N = _training_dims(q, k, v, g, beta, A_log, dt_bias, cu_seqlens)
    _check_state(initial_state, "initial_state", N, HV, V, K)
    acc = _acc_dtype(q)
    rows = tape_rows(B, T, cu_seqlens is not None)
    out = q.new_empty((B, T, HV, V))
    final_state = q.new_empty((N, HV, V, K), dtype=initial_state.dtype)
    tapes = q.new_empty((rows, HV, V, K), dtype=acc)
    tape_cu_starts = q.new_empty((N + 1,), dtype=torch.int64)
    return out, final_state, tapes, tape_cu_starts


def _grads(q, k, v, g, beta, A_log, dt_bias, N, state_dtype):
    B, T, H, K = q.shape
    HV, V = v.shape[2], v.shape[3]
    # Token gradients in q's dtype; parameter gradients in the parameter dtype, shaped like their inputs, empty
    # ([0]) for an absent parameter.
    pdt = _acc_dtype(q)
    return (
        q.new_empty(tuple(q.shape)),
        q.new_empty(tuple(k.shape)),
        q.new_empty(tuple(v.shape)),
        q.new_empty(tuple(g.shape)),
        q.new_empty(tuple(beta.shape)),
        q.new_empty((0,) if A_log is None else tuple(A_log.shape), dtype=pdt if A_log is None else A_log.dtype),
        q.new_empty((0,) if dt_bias is None else tuple(dt_bias.shape), dtype=pdt if A_log is None else A_log.dtype),
        q.new_empty((N, HV, V, K), dtype=state_dtype),
    )


@torch.library.register_fake("kda::kda_backward")
@torch.library.register_fake("kda::recurrent_kda_training_backward")
def _training_backward_fake(
    q,
    k,
    v,
    g,
    beta,
    A_log,
    dt_bias,
    tapes,
    tape_cu_starts,
    initial_state,
    cu_seqlens,
    do,
    dfinal_state,
    scale,
    lower_bound,
    gate_mode=2,
    use_qk_l2norm=True,
    beta_is_logit=True,
):
    B, T, HV, K, V, N = _training_dims(q, k, v, g, beta, A_log, dt_bias, cu_seqlens)
    torch._check(
        tape_cu_starts.dim() == 1 and tape_cu_starts.shape[0] == N + 1,
        lambda: f"tape_cu_starts must be [N+1]=[{N + 1}], got {tape_cu_starts.shape}",
    )
    torch._check(
        tapes.dim() == 4 and tuple(tapes.shape[1:]) == (HV, V, K),
        lambda: f"tapes must be [rows, HV, V, K], got {tapes.shape}",
    )
    _check_do(do, B, T, HV, V)
    for name, s in (("initial_state", initial_state), ("dfinal_state", dfinal_state)):
        if s is not None:
            _check_state(s, name, N, HV, V, K)
    return _grads(q, k, v, g, beta, A_log, dt_bias, N, tapes.dtype)


@torch.library.register_fake("kda::recurrent_kda_backward")
def _backward_fake(
    q,
    k,
    v,
    g,
    beta,
    A_log,
    dt_bias,
    initial_state,
    cu_seqlens,
    do,
    dfinal_state,
    scale,
    lower_bound,
    gate_mode=2,
    use_qk_l2norm=True,
    beta_is_logit=True,
):
    B, T, HV, K, V, N = _training_dims(q, k, v, g, beta, A_log, dt_bias, cu_seqlens)
    _check_state(initial_state, "initial_state", N, HV, V, K)
    _check_do(do, B, T, HV, V)
    if dfinal_state is not None:
        _check_state(dfinal_state, "dfinal_state", N, HV, V, K)
    return _grads(q, k, v, g, beta, A_log, dt_bias, N, initial_state.dtype)


@torch.library.register_fake("kda::segment_state_scan")
def _segment_state_scan_fake(S, Q, P, first):
    # mutates S in place: nothing to allocate; the shape rules of the real op
    torch._check(S.dim() == 4, lambda: f"S must be [J, batch, V, K], got {S.shape}")
    torch._check(tuple(Q.shape) == tuple(S.shape), lambda: f"Q must have the shape of S, got {Q.shape}")
    J, Bt, _, K = S.shape
    torch._check(tuple(P.shape) == (J, Bt, K, K), lambda: f"P must be [J, batch, K, K], got {P.shape}")
    torch._check(S.dtype.is_floating_point, lambda: f"S must be a floating dtype, got {S.dtype}")
    torch._check(Q.dtype == S.dtype and P.dtype == S.dtype, lambda: "S, Q and P must share one dtype")
    torch._check(Q.device == S.device and P.device == S.device, lambda: "S, Q and P must be on one device")
    torch._check(S.is_contiguous() and Q.is_contiguous() and P.is_contiguous(), lambda: "S, Q and P must be contiguous")
    torch._check(first >= 1, lambda: f"first must be >= 1, got {first}")


@torch.library.register_fake("kda::segment_state_scan_packed")
def _segment_state_scan_packed_fake(S, Q, P, seg_first, seg_count, final=None):
    # mutates S in place: nothing to allocate; the shape rules of the real op
    _segment_state_scan_fake(S, Q, P, 1)
    torch._check(
        seg_first.dim() == 1 and tuple(seg_count.shape) == tuple(seg_first.shape),
        lambda: "seg_first and seg_count must be [N] of one length",
    )
    torch._check(
        seg_first.dtype == torch.int64 and seg_count.dtype == torch.int64,
        lambda: "seg_first and seg_count must be int64",
    )


@torch.library.register_fake("kda::segment_output_fixup")
def _segment_output_fixup_fake(out, A, S, seg_cu, rows, max_segment_tokens):
    # mutates out in place: nothing to allocate
    torch._check(
        S.dim() == 4 and out.dim() == 3 and A.dim() == 3, lambda: "S [slots, HV, V, K], out [T, HV, V], A [T, HV, K]"
    )
    torch._check(A.dtype == out.dtype, lambda: "A must have out's dtype")
