"""kda_ops: Kimi Delta Attention kernels for PyTorch (see README.md)."""

from kda_ops import _C  # noqa: F401  (loads the torch.ops.kda schemas and kernels)

__version__ = "0.1.0"
