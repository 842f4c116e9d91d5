"""Autograd of the training forward ops, one mechanism (``torch.library.register_autograd``) for both
(docs/contract.md "API"):

- ``torch.ops.kda.kda_forward`` (under :func:`kda_ops.kda`): its kernel routes internally (the routing spine's
  split route, csrc/kda/route/route.h: the exact sequence split of kda_ops/_split.py, or one call of
  ``recurrent_kda_training_forward``), and its backward ``torch.ops.kda.kda_backward`` routes the same way on
  its own (the tapes are in the unsplit layout either way, so both routes start from them). torch.compile,
  FakeTensor and DDP/FSDP see this one op pair whatever the route.
- ``torch.ops.kda.recurrent_kda_training_forward`` (the raw op): its backward is one call of
  ``recurrent_kda_training_backward``.

Both return ``(out, final_state, tapes, tape_cu_starts)``; the tapes (the state before every 64-token chunk
but each sequence's first) and the initial state (by reference) are saved, and the backward is the reverse sweep
of docs/contract.md "Gradients" from the tapes. Gradients flow to all eight tensor inputs (A_log / dt_bias when
given: the ops return empty gradients for absent ones, and autograd gets None); the tapes and their row offsets
are not differentiable. The mode arguments (gate_mode, use_qk_l2norm, beta_is_logit) are kept on the ctx and
passed to the backward op. No global state: everything lives on the autograd ctx.
"""

from __future__ import annotations

import torch

from kda_ops import _routing, _split
from kda_ops import _validate as V


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


def _make_backward(backward_op):  # type: ignore[no-untyped-def]
    def backward(ctx, d_out, d_final_state, _d_tapes, _d_tape_cu_starts):  # type: ignore[no-untyped-def]
        q, k, v, g, beta, A_log, dt_bias, tapes, tape_cu_starts, initial_state, cu_seqlens = ctx.saved_tensors
        if d_out is None:  # grads are materialised by autograd; kept for safety with custom callers
            d_out = torch.zeros(v.shape, dtype=q.dtype, device=q.device)
        grads = backward_op(
            q, k, v, g, beta, A_log, dt_bias, tapes, tape_cu_starts, initial_state, cu_seqlens, d_out.contiguous(),
            None if d_final_state is None else d_final_state.contiguous(), ctx.scale, ctx.lower_bound, *ctx.modes,
        )  # fmt: skip
        dq, dk, dv, dg, dbeta, dA_log, ddt_bias, dinitial_state = grads
        dA_log = None if A_log is None else dA_log
        ddt_bias = None if dt_bias is None else ddt_bias
        return (dq, dk, dv, dg, dbeta, dA_log, ddt_bias, dinitial_state, None, None, None) + (None,) * ctx.n_mode_args

    return backward


def _kda_forward(q, k, v, g, beta, A_log, dt_bias, initial_state, cu_seqlens, scale, lower_bound,
                 gate_mode=2, use_qk_l2norm=True, beta_is_logit=True):  # type: ignore[no-untyped-def]  # fmt: skip
    """kda_forward's kernel: the split where the spine takes it (host-known lengths, eager, not captured), else
    one training forward. The same four results either way (the tapes in the unsplit layout)."""
    if not _routing.split_off() and _split.training_modes_covered(gate_mode, use_qk_l2norm, beta_is_logit, dt_bias):
        d = V.check_tokens(q, k, v, g, beta, cu_seqlens, kv_rule="training")
        res = _split.try_training_forward(
            d, q, k, v, g, beta, A_log, dt_bias, initial_state, cu_seqlens, None, scale, lower_bound
        )
        if res is not None:
            o, fs, tapes, starts, _ = res
            return o, fs, tapes, starts
    return torch.ops.kda.recurrent_kda_training_forward.default(
        q, k, v, g, beta, A_log, dt_bias, initial_state, cu_seqlens, scale, lower_bound,
        gate_mode, use_qk_l2norm, beta_is_logit,
    )  # fmt: skip


def _kda_backward(q, k, v, g, beta, A_log, dt_bias, tapes, tape_cu_starts, initial_state, cu_seqlens, do,
                  dfinal_state, scale, lower_bound, gate_mode=2, use_qk_l2norm=True, beta_is_logit=True):  # type: ignore[no-untyped-def]  # fmt: skip
    """kda_backward's kernel: the split backward where the spine takes it (the segments' transitions recomputed
    from the inputs), else one training backward from the tapes."""
    if not _routing.split_off() and _split.training_modes_covered(gate_mode, use_qk_l2norm, beta_is_logit, dt_bias):
        d = V.check_tokens(q, k, v, g, beta, cu_seqlens, kv_rule="training")
        pl = _split.plan_training_backward(d, cu_seqlens)
        if pl is not None:
            sdt = initial_state.dtype if initial_state is not None else V.param_dtype(d)
            return _split.backward_from_tapes(d, q, k, v, g, beta, A_log, dt_bias, tapes, initial_state, do,
                                              dfinal_state, scale, lower_bound, pl, None, sdt)  # fmt: skip
    return torch.ops.kda.recurrent_kda_training_backward.default(
        q, k, v, g, beta, A_log, dt_bias, tapes, tape_cu_starts, initial_state, cu_seqlens, do, dfinal_state,
        scale, lower_bound, gate_mode, use_qk_l2norm, beta_is_logit,
    )  # fmt: skip


torch.library.impl("kda::kda_forward", "CompositeExplicitAutograd")(_kda_forward)
torch.library.impl("kda::kda_backward", "CompositeExplicitAutograd")(_kda_backward)
torch.library.register_autograd(
    "kda::recurrent_kda_training_forward",
    _make_backward(torch.ops.kda.recurrent_kda_training_backward.default),
    setup_context=_setup_context,
)
torch.library.register_autograd(
    "kda::kda_forward", _make_backward(torch.ops.kda.kda_backward.default), setup_context=_setup_context
)
