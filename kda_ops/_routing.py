"""The Python face of the routing spine (csrc/kda/route/route.h, docs/env.md).

Which kernel runs is decided in C++, once per op family, from the call, the device and the launch knobs; the
knobs are the ``KDA_*`` environment switches, read once per process (at import) into a snapshot. Python asks
the spine through ``kda_ops._C`` instead of copying its rules: :func:`split_segment_tokens` is the split route.

:func:`reload` re-reads the environment (tests and benchmarks that change a switch in-process call it after
changing ``os.environ``); an invalid value raises ``ValueError`` naming the switch, and the previous snapshot
is replaced by one whose invalid fields keep their defaults.
"""

from __future__ import annotations

import os
from typing import Any

import torch

from kda_ops import _C  # type: ignore[attr-defined]

# A mirror of the split switch for the Python fast paths (no binding call when the split is off).
_split_off = False


def reload() -> dict[str, Any]:
    """Re-reads the ``KDA_*`` switches; returns them as read (:func:`knobs`). ValueError on an invalid value."""
    global _split_off
    from kda_ops import _decode_fast

    err = _C.reload_launch_knobs()
    _decode_fast.CACHE.clear()  # (its calls were routed under the old switches)
    k = knobs()
    _split_off = k["split"] == "0" or k["batch_invariant"]
    if err:
        raise ValueError(err)
    return k


def knobs() -> dict[str, Any]:
    """The switches as read: verbose, batch_invariant, decode, chunked, sweep, split (the pins' values as spelt in
    docs/env.md), split_tokens, experiments_built (a ``KDA_BUILD_EXPERIMENTS=1`` build), error."""
    return dict(_C.launch_knobs())


def split_off() -> bool:
    """``KDA_SEQUENCE_SPLIT=0`` or batch-invariant mode: the split never runs (checked before any planning)."""
    return _split_off


def set_batch_invariant(enabled: bool) -> None:
    """Turns batch-invariant mode on or off for this process (``KDA_BATCH_INVARIANT``, docs/env.md).

    On: every op routes a call without looking at the batch (sequence count, lengths, grid size) and the exact
    sequence split is off, so a sequence's outputs, state and gradients are bit-identical whatever else the call
    holds, in whatever order or pool slot (within one calling convention: fixed-layout decode, speculative decode,
    prefill or packed calls, training). The cost: prefill of long sequences on few heads runs unsplit, a packed
    call of short sequences runs the chunked kernel where the token-serial one would be faster, the mma.sync
    kernel and the backward chain keep their large-grid choices on small grids. (The token-serial kernels give
    the same bits for every tile and kernel, so decode keeps its fast routes.) Takes effect for the calls after it
    (not inside a captured graph, which keeps the routes it captured)."""
    if not isinstance(enabled, bool):
        raise TypeError(f"set_batch_invariant: enabled must be a bool, got {type(enabled).__name__}")
    os.environ["KDA_BATCH_INVARIANT"] = "1" if enabled else "0"
    reload()


def batch_invariant() -> bool:
    """Whether batch-invariant mode is on (:func:`set_batch_invariant`, ``KDA_BATCH_INVARIANT``)."""
    return bool(knobs()["batch_invariant"])


def split_segment_tokens(lens: list[int], HV: int, device: torch.device, training: bool, multiple: int = 64) -> int:
    """The split route of a call with host-known sequence lengths: its segment length, or 0 (no split)."""
    on_cuda = device.type == "cuda"
    index = (device.index if device.index is not None else torch.cuda.current_device()) if on_cuda else 0
    return int(_C.route_split(lens, HV, on_cuda, index, training, multiple))


def split_segment_tokens_device(
    tokens: int, n: int, HV: int, device: torch.device, training: bool, multiple: int = 64
) -> int:
    """The split route of a packed call whose ``n`` lengths live on the device only (``tokens`` token rows): its
    segment length, or 0 (the spine plans all the tokens as one sequence; auto only while ``n`` · HV chains fill at
    most a quarter of the SMs)."""
    on_cuda = device.type == "cuda"
    index = (device.index if device.index is not None else torch.cuda.current_device()) if on_cuda else 0
    return int(_C.route_split_device_lengths(tokens, n, HV, on_cuda, index, training, multiple))


def plan_segments(lens: list[int], HV: int, sms: int, multiple: int = 64) -> int:
    """The spine's segment plan: the shortest length (a multiple of ``multiple``) whose chains fit ``sms``."""
    return int(_C.plan_segments(lens, HV, sms, multiple))


def split_pays(lens: list[int], HV: int, sms: int, Ls: int, rows128_cost: float) -> bool:
    """The auto split's cost model (the unsplit critical path against the split's passes)."""
    return bool(_C.split_pays(lens, HV, sms, Ls, rows128_cost))


reload()
