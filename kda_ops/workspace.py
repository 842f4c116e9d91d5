"""Caller-owned objects of the public API: scratch workspaces and the training context.

- :class:`RecurrentKDAPrefillWorkspace`: scratch for ``recurrent_kda`` (the ``workspace`` argument of
  ``torch.ops.kda.recurrent_kda``). Optional in eager mode; it is what makes a CUDA-graph-captured call
  allocation-free: the eager warm-up call plans (sizes) it for the shapes of the call, and a captured
  call with the same shapes finds it ready (docs/contract.md "API").
- :class:`RecurrentKDABackwardWorkspace`: the same role for ``recurrent_kda_backward`` (docs/contract.md "API").
- :class:`RecurrentKDATrainingContext`: what ``recurrent_kda_training_forward`` saves for
  ``recurrent_kda_training_backward`` (docs/contract.md "API"): the inputs, the tapes and the packing.

No global state lives here (DDP/FSDP safe): every buffer belongs to an object the caller holds.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch

from kda_ops._validate import _same_device

__all__ = [
    "RecurrentKDAPrefillWorkspace",
    "RecurrentKDABackwardWorkspace",
    "RecurrentKDATrainingContext",
    "prefill_workspace_bytes",
]

# Alignment of the scratch buffer and of every region carved from it (bytes). 256 B covers TMA (128 B)
# and the cudaMalloc alignment guarantee, so a region may hold any dtype.
_ALIGN = 256


def _round_up(x: int, m: int) -> int:
    return (x + m - 1) // m * m


def prefill_workspace_bytes(
    device: torch.device, B: int, T: int, N: int, H: int, HV: int, K: int, V: int, backend: int
) -> int:
    """Bytes of scratch ``recurrent_kda`` needs for one call of these shapes (an upper bound from
    shapes only, never from tensor values, so it can be sized before CUDA graph capture).

    The CPU token loop and the CUDA token-serial kernels need none. The CUDA chunked prefill sizes its
    per-chunk factors here when it lands (docs/contract.md "API"; csrc/kda/chunked/).
    """
    del B, T, N, H, HV, K, V, backend
    if device.type != "cuda":
        return 0
    return 0


class _Scratch:
    """A growable, 256-byte-aligned uint8 buffer plus the shape key of the last planned call."""

    def __init__(self, device: torch.device | str | None = None, nbytes: int = 0) -> None:
        self.device: torch.device | None = None if device is None else torch.device(device)
        self.buffer: torch.Tensor | None = None
        self.planned: tuple[Any, ...] | None = None
        if nbytes > 0:
            if self.device is None:
                raise ValueError(f"device must be given with nbytes > 0, got nbytes={nbytes}")
            self.buffer = torch.empty(_round_up(nbytes, _ALIGN), dtype=torch.uint8, device=self.device)

    @property
    def nbytes(self) -> int:
        """Bytes currently held (0 before the first plan)."""
        return 0 if self.buffer is None else int(self.buffer.numel())

    def _capturing(self) -> bool:
        return (
            self.device is not None
            and self.device.type == "cuda"
            and not torch.compiler.is_compiling()
            and torch.cuda.is_current_stream_capturing()
        )

    def plan(self, key: tuple[Any, ...], device: torch.device, nbytes: int, what: str) -> torch.Tensor | None:
        """Makes the buffer hold at least ``nbytes`` on ``device`` for the call described by ``key``.

        Eager: grows the buffer when needed and remembers ``key``. Under CUDA graph capture nothing may
        be allocated: a call whose shapes were not planned eagerly, or that needs more bytes than held,
        raises RuntimeError. Returns the buffer (None when no scratch is needed and none is held).
        """
        dev = torch.device(device)
        if self.device != dev:
            # Compare by the index a device spec resolves to: a workspace made with device="cuda" serves
            # tensors on cuda:0 when device 0 was current (a held buffer says where it really is).
            held = self.buffer.device if self.buffer is not None else self.device
            if held is not None and not _same_device(held, dev):
                raise RuntimeError(f"{what} must be on {device} (the device of q), got a workspace on {self.device}")
            self.device = dev
        if self._capturing():
            if self.planned != key or self.nbytes < nbytes:
                raise RuntimeError(
                    f"{what} must have been planned by an eager call with the same shapes before CUDA graph "
                    f"capture, got shapes {key} (planned: {self.planned}, {self.nbytes} bytes held, "
                    f"{nbytes} needed)"
                )
            return self.buffer
        if self.nbytes < nbytes:
            self.buffer = torch.empty(_round_up(nbytes, _ALIGN), dtype=torch.uint8, device=self.device)
        self.planned = key
        return self.buffer


class RecurrentKDAPrefillWorkspace(_Scratch):
    """Caller-owned scratch of :func:`kda_ops.recurrent_kda`.

    Args:
        device: where the buffer lives (taken from the first call when None).
        nbytes: bytes to allocate up front (0: sized by the first call).

    One workspace serves one call at a time (one stream). It grows in eager calls; under CUDA graph
    capture it must already have been planned by an eager call with the same shapes, else the call
    raises RuntimeError (no allocation happens inside a capture). ``planned`` is the shape key of the
    last planned call: ``(B, T, N, H, HV, K, V, packed, backend)``.
    """


class RecurrentKDABackwardWorkspace(_Scratch):
    """Caller-owned scratch of :func:`kda_ops.recurrent_kda_backward`.

    Args:
        device: where the buffer lives (taken from the first call when None; ``"cuda"`` without an
            index means the current CUDA device).
        nbytes: bytes to allocate up front (0: sized by the first call).

    Holds the int64 copy of ``cu_seqlens`` when the caller's is int32, so that a captured call writes
    a buffer it owns. The ``kda::recurrent_kda_backward`` schema takes no workspace tensor: the op
    allocates its outputs and scratch itself (inside a capture that memory comes from the graph's
    private pool). Planned by an eager call with the same shapes, like
    :class:`RecurrentKDAPrefillWorkspace`.
    """

    def __init__(self, device: torch.device | str | None = None, nbytes: int = 0) -> None:
        super().__init__(device, nbytes)
        self.cu_seqlens64: torch.Tensor | None = None


@dataclass
class RecurrentKDATrainingContext:
    """What :func:`kda_ops.recurrent_kda_training_forward` saves for the backward (docs/contract.md "API").

    Fields:
        q, k: [B, T, H, K] token dtype (bf16 on CUDA).
        v: [B, T, HV, V]; g: [B, T, HV, K] raw gate input; beta: [B, T, HV] logits.
        A_log: [HV] or None (precomputed gate); dt_bias: [HV, K] or None (0) (fp32; fp64 with fp64 tokens on
            CPU).
        tapes: [rows, HV, V, K] fp32 (fp64 with fp64 tokens): the state before every 64-token chunk of
            every sequence but its first; rows = B*(ceil(T/64) - 1) fixed, T//64 packed (an upper bound,
            spare rows 0). At most 64·V·K·4 B / 64 tokens = the bf16 q+k+v+g bytes per token-head.
        tape_cu_starts: int64 [N+1]: first tape row of each sequence (ceil(L/64) - 1 rows each, at least 0).
        initial_state: [N, HV, V, K], the forward's initial state (by reference; the state before token 0,
            which the tapes do not repeat), or None for zeros. Modifying it in place before the backward is
            an error the backward reports (its version counter is kept in ``extra``).
        cu_seqlens: int64 [N+1] on the device of q, or None (fixed layout).
        cu_seqlens_cpu: the validated host mirror of cu_seqlens (packed calls), or None.
        scale: the q scale actually used (> 0). lower_bound: λ in [-5, 0) (0.0 when the gate has no bound).
        state_dtype: dtype of initial_state (and of final_state, dinitial_state).
        gate_mode: 0 precomputed log-decay, 1 softplus gate, 2 lower-bound gate (the default).
        use_qk_l2norm: q and k L2-normalised in the op (default True). beta_is_logit: β = sigmoid(beta)
            (default True).
    """

    q: torch.Tensor
    k: torch.Tensor
    v: torch.Tensor
    g: torch.Tensor
    beta: torch.Tensor
    A_log: torch.Tensor | None
    dt_bias: torch.Tensor | None
    tapes: torch.Tensor
    tape_cu_starts: torch.Tensor
    initial_state: torch.Tensor | None
    cu_seqlens: torch.Tensor | None
    scale: float
    lower_bound: float
    cu_seqlens_cpu: torch.Tensor | None = None
    state_dtype: torch.dtype = torch.float32
    gate_mode: int = 2
    use_qk_l2norm: bool = True
    beta_is_logit: bool = True
    extra: dict[str, Any] = field(default_factory=dict)

    @property
    def num_sequences(self) -> int:
        """N: sequences of the saved call."""
        return int(self.tape_cu_starts.numel()) - 1

    def shapes(self) -> tuple[tuple[int, ...] | None, ...]:
        """Shapes of every saved tensor, in field order, None for an absent A_log / dt_bias (used to check a
        reused ``context_out``)."""
        ts = (self.q, self.k, self.v, self.g, self.beta, self.A_log, self.dt_bias, self.tapes, self.tape_cu_starts)
        return tuple(None if t is None else tuple(t.shape) for t in ts)
