"""The affine state map of a run of tokens: the algebra under the exact sequence split (kda_ops/_split.py) and
context parallelism (kda_ops/distributed.py), written once.

Per value head the state after a run of tokens is affine in the state before it (S [V, K]):

    S_end = S_start · P + Q,   P = Π_t diag(exp(a_t)) (I - β_t k_t k_tᵀ)  [K, K],

with Q the end state of the run from a zero start state and P the end state from the identity ([K, K]
states) with v = 0 (head dim K). Composing runs in order: S_{j+1} = S_j · P_j + Q_j. The gradient runs the
other way: dS_start = dS_end · Pᵀ + G, with G the start-state gradient of the run from a zero end-state
gradient. The split composes the segments of one call in a batched scan (``torch.ops.kda.segment_state_scan``);
context parallelism composes one map per rank in rank order.

``forward(q, k, v, g, beta, start)`` below is any training forward of the runs (a packed call of several runs
or one run) that returns their end states for the given start states.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

Forward = Callable[..., torch.Tensor]


def identity_states(n: int, HV: int, K: int, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """[n, HV, K, K] identities: the start states of the transition pass."""
    return torch.eye(K, dtype=dtype, device=device).expand(n, HV, K, K).contiguous()


def transitions(forward: Forward, q, k, v, g, beta, n: int, dtype: torch.dtype) -> torch.Tensor:  # type: ignore[no-untyped-def]
    """P [n, HV, K, K] of each of the n runs: the end states from the identity with v = 0 (head dim K)."""
    HV, K = v.shape[2], q.shape[3]
    v0 = torch.zeros((*v.shape[:3], K), dtype=v.dtype, device=v.device)
    return forward(q, k, v0, g, beta, identity_states(n, HV, K, dtype, q.device))


def offsets(forward: Forward, q, k, v, g, beta, start: torch.Tensor) -> torch.Tensor:  # type: ignore[no-untyped-def]
    """Q [n, HV, V, K] of each run: the end states from ``start`` (zeros for a pure offset)."""
    return forward(q, k, v, g, beta, start)


def compose(S: torch.Tensor, P: torch.Tensor, Q: torch.Tensor) -> torch.Tensor:
    """The state after a run from the state before it: S · P + Q."""
    return torch.matmul(S, P) + Q


def compose_grad(dS_end: torch.Tensor, P: torch.Tensor, G: torch.Tensor) -> torch.Tensor:
    """The start-state gradient of a run from its end-state gradient: dS_end · Pᵀ + G."""
    return torch.matmul(dS_end, P.transpose(-1, -2)) + G


def scan(S: torch.Tensor, Q: torch.Tensor, P: torch.Tensor, first: int) -> None:
    """In place, over a [J, batch, ...] grid: S[j] = S[j-1] · P[j-1] + Q[j-1] for j = first .. J-1 (one launch on
    CUDA, a batched matmul per j on the CPU). The gradient scan passes the G grid as Q and Pᵀ as P."""
    torch.ops.kda.segment_state_scan(S, Q, P, first)
