"""Direct calls of torch.ops.kda.recurrent_kda with every schema argument defaulted, for tests that must
bypass the public API's host checks (how a CUDA caller's device values reach the kernel). Shared by
tests/test_device_contracts.py and tests/sanitize_cases.py."""

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
