"""Direct calls of torch.ops.kda.recurrent_kda with every schema argument defaulted, for tests that must
bypass the public API's host checks (how a CUDA caller's device values reach the kernel), and the padded
strided copies those tests feed it. Shared by tests/_builders.py, tests/test_device_contracts.py and
tests/sanitize_cases.py (which runs without pytest)."""

from __future__ import annotations

import math

import torch

import kda_ops  # noqa: F401  (registers torch.ops.kda)


def raw_recurrent(q, k, v, g, beta, **kw) -> None:
    """torch.ops.kda.recurrent_kda(q, k, v, g, beta, ...) with the schema's other arguments from `kw`
    (defaults: no pool, lower-bound gate λ=-5, logit beta, L2 norm, scale 1/sqrt(K), no checkpoints)."""
    a = dict(
        A_log=None, dt_bias=None, state=None, state_source=None, initial_state_indices=None, cu_seqlens=None,
        ssm_state_indices=None, num_accepted_tokens=None, seq_order=None, output=None, final_state=None,
        state_checkpoints=None, checkpoint_cu_starts=None, workspace=None, scale=1.0 / math.sqrt(q.shape[-1]),
        gate_mode=2, lower_bound=-5.0, use_qk_l2norm=True, beta_is_logit=True, num_spec_tokens=0,
        checkpoint_every_n_tokens=0, backend=0, zero_uncovered=False,
    )  # fmt: skip
    a.update(kw)
    torch.ops.kda.recurrent_kda.default(q, k, v, g, beta, **a)


def strided_copy(
    src: torch.Tensor, fill: float | int | None, pads: dict[int, int] | None, lead: int, tail: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """(view, buffer): `src` copied into a view of a larger 1-D buffer, at storage offset `lead`, the stride of
    dim d padded by pads[d] elements (negative d from the end; the last dim stays contiguous), `tail` elements
    after the view's span. The buffer is filled with `fill` first, or left uninitialized when `fill` is None."""
    shape = tuple(src.shape)
    nd = len(shape)
    pads = {(d % nd): p for d, p in (pads or {}).items()}
    st = [1] * nd
    for d in range(nd - 2, -1, -1):
        st[d] = st[d + 1] * max(shape[d + 1], 1) + pads.get(d, 0)
    span = 1 + sum((s - 1) * t for s, t in zip(shape, st, strict=True)) if all(s > 0 for s in shape) else 0
    n = lead + span + tail
    if fill is None:
        buf = torch.empty(n, dtype=src.dtype, device=src.device)
    else:
        buf = torch.full((n,), fill, dtype=src.dtype, device=src.device)
    view = buf.as_strided(shape, st, lead)
    view.copy_(src)
    return view, buf
