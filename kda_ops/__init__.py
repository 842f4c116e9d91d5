"""kda_ops: Kimi Delta Attention kernels for PyTorch (see README.md).

Public API (docs/contract.md "API"):
- :func:`recurrent_kda`: inference decode, speculative decode and prefill with an in-place state pool.
- :func:`recurrent_kda_training_forward` / :func:`recurrent_kda_training_backward`: training with tapes.
- :func:`recurrent_kda_backward`: backward from the raw inputs.
- :func:`kda`: the differentiable layer core (autograd, torch.compile).
- :func:`validate_cu_seqlens`, :func:`validate_state_indices`: explicit (host-syncing) value checks.
- :func:`set_batch_invariant`, :func:`batch_invariant`: results per sequence independent of the batch.
- :class:`RecurrentKDAPrefillWorkspace`, :class:`RecurrentKDABackwardWorkspace`,
  :class:`RecurrentKDATrainingContext`.
"""

# isort: off
import torch  # noqa: F401  (libc10 and the torch op registry must be loaded before _C)
from kda_ops import _C  # type: ignore[attr-defined]  # noqa: F401  (the torch.ops.kda schemas and kernels)
from kda_ops import _autograd, _fake  # noqa: F401  (register_autograd / register_fake need the schemas)
from kda_ops import _routing  # noqa: F401  (the KDA_* switches, read once and checked here: docs/env.md)

# isort: on
from kda_ops import fla  # noqa: F401  (fla-shaped entry points; fla itself is imported only by fla.install())
from kda_ops._routing import batch_invariant, set_batch_invariant
from kda_ops._validate import validate_cu_seqlens, validate_state_indices
from kda_ops.interface import (
    kda,
    recurrent_kda,
    recurrent_kda_backward,
    recurrent_kda_training_backward,
    recurrent_kda_training_forward,
)
from kda_ops.workspace import (
    RecurrentKDABackwardWorkspace,
    RecurrentKDAPrefillWorkspace,
    RecurrentKDATrainingContext,
)

__version__ = "0.1.0"

__all__ = [
    "recurrent_kda",
    "recurrent_kda_training_forward",
    "recurrent_kda_training_backward",
    "recurrent_kda_backward",
    "kda",
    "validate_cu_seqlens",
    "validate_state_indices",
    "set_batch_invariant",
    "batch_invariant",
    "RecurrentKDAPrefillWorkspace",
    "RecurrentKDABackwardWorkspace",
    "RecurrentKDATrainingContext",
]
