"""Autograd of the functional training forward op (docs/contract.md "API").

``torch.ops.kda.recurrent_kda_training_forward`` returns ``(out, final_state, tapes, tape_cu_starts)``;
the tapes (the state before every 64-token chunk but each sequence's first) and the initial state (by
reference) are saved, and the backward is one call of
``torch.ops.kda.recurrent_kda_training_backward`` (the reverse sweep of docs/contract.md "Gradients" from the tapes).
Gradients flow to all eight tensor inputs (A_log / dt_bias when given: the op returns empty gradients for
absent ones, and autograd gets None); the tapes and their row offsets are not differentiable. The mode
arguments (gate_mode, use_qk_l2norm, beta_is_logit) are kept on the ctx and passed to the backward op.
Registered through ``torch.library.register_autograd``, so it composes with torch.compile, FakeTensor
and DDP/FSDP (no global state; everything lives on the autograd ctx).
"""

from __future__ import annotations

import torch


def _setup_context(ctx, inputs, output):  # type: ignore[no-untyped-def]
    q, k, v, g, beta, A_log, dt_bias, initial_state, cu_seqlens, scale, lower_bound, *modes = inputs
    _out, _final_state, tapes, tape_cu_starts = output
    ctx.save_for_backward(q, k, v, g, beta, A_log, dt_bias, tapes, tape_cu_starts, initial_state, cu_seqlens)
    ctx.scale = scale
    ctx.lower_bound = lower_bound
    # (gate_mode, use_qk_l2norm, beta_is_logit); a call that leaves them out gets the schema defaults
    ctx.modes = tuple(modes) + (2, True, True)[len(modes) :]
    ctx.n_mode_args = len(modes)
    ctx.mark_non_differentiable(tapes, tape_cu_starts)


def _backward(ctx, d_out, d_final_state, _d_tapes, _d_tape_cu_starts):  # type: ignore[no-untyped-def]
    q, k, v, g, beta, A_log, dt_bias, tapes, tape_cu_starts, initial_state, cu_seqlens = ctx.saved_tensors
    if d_out is None:  # grads are materialised by autograd; kept for safety with custom callers
        d_out = torch.zeros(v.shape, dtype=q.dtype, device=q.device)
    grads = torch.ops.kda.recurrent_kda_training_backward.default(
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
        d_out.contiguous(),
        None if d_final_state is None else d_final_state.contiguous(),
        ctx.scale,
        ctx.lower_bound,
        *ctx.modes,
    )
    dq, dk, dv, dg, dbeta, dA_log, ddt_bias, dinitial_state = grads
    dA_log = None if A_log is None else dA_log
    ddt_bias = None if dt_bias is None else ddt_bias
    return (dq, dk, dv, dg, dbeta, dA_log, ddt_bias, dinitial_state, None, None, None) + (None,) * ctx.n_mode_args


torch.library.register_autograd("kda::recurrent_kda_training_forward", _backward, setup_context=_setup_context)
