"""The eager decode fast path of :func:`kda_ops.recurrent_kda` (kda_ops/interface.py): a validation cache of
decode-like calls, so that an eager decode step whose arguments were validated before skips the checks and goes
straight to the op (an eager decode step's kernel takes a few µs; the Python layer must stay in that range:
benchmarks/bench_api_overhead.py times it)."""

from __future__ import annotations

from typing import Any

import torch

import kda_ops._C

# The op handles, resolved once (torch.ops.kda.recurrent_kda.default is three attribute lookups, ~1 µs). The
# decode-shaped subset has a 14-argument schema (registration.cpp): converting each schema argument from Python
# costs ~0.4 us (29 arguments: ~12 us per call).
_recurrent_kda_op = torch.ops.kda.recurrent_kda.default
_recurrent_kda_decode_op = torch.ops.kda.recurrent_kda_decode.default

# Validation cache of decode-like calls. Every check of recurrent_kda is a function of the arguments' types,
# shapes, strides, dtypes and devices and of the scalar arguments, except for a few reads of values: host
# cu_seqlens, seq_order and checkpoint starts (such calls are never cached), and the addresses (overlap of
# the writes with the reads, 16-byte alignment of the pool), which are re-checked on every call. So a call
# whose key (those properties, the scalars and their Python types) was validated before skips the checks
# and goes straight to the op. The tensor part of the key and the overlap re-check are one C++ call
# (_C.tensor_call_key, csrc/api/python_module.cpp: ~10 µs of Python attribute reads per decode step
# before; benchmarks/bench_api_overhead.py). A call that fails a re-check takes the full path, which raises.
tensor_call_key = kda_ops._C.tensor_call_key  # type: ignore[attr-defined]
CACHE: dict = {}
CACHE_SIZE = 64  # distinct shapes kept (a serving engine has a few batch sizes per layer type)


class _FastEntry:
    """What the full path decided for one key (read-only)."""

    __slots__ = (
        "d",
        "gate_mode",
        "lb",
        "sc",
        "l2",
        "logit",
        "S",
        "backend_code",
        "zero_uncovered",
        "need_order",
        "alloc_final",
        "out_final",
        "pool_align",
        "decode_mode",
    )

    def __init__(self, **kw):
        for n, v in kw.items():
            setattr(self, n, v)


def remember(key, pool, **decided: Any) -> None:
    """Store what the full path decided for `key` (a validated call of the decode-like family): the
    `decided` fields of _FastEntry (d, gate_mode, lb, sc, l2, logit, S, backend_code, zero_uncovered,
    need_order, alloc_final, out_final). Only calls of plain tensors (real memory: data_ptr) have a key:
    tensor_call_key returns None for any other tensor type."""
    d = decided["d"]
    e = _FastEntry(
        **decided,
        pool_align=d.on_cuda and pool is not None and pool.numel() > 0,
        # recurrent_kda_decode's packed mode (registration.cpp) when the call fits its subset, else None
        decode_mode=_decode_mode(**decided),
    )
    if len(CACHE) >= CACHE_SIZE:
        CACHE.pop(next(iter(CACHE)))  # oldest first
    CACHE[key] = e


def _decode_mode(
    *, gate_mode, l2, logit, backend_code, S, need_order, alloc_final, zero_uncovered, **_: Any
) -> int | None:
    """recurrent_kda_decode's packed mode (registration.cpp) when the call fits its subset, else None."""
    if need_order or alloc_final or zero_uncovered:
        return None
    return int(gate_mode) | (4 if l2 else 0) | (8 if logit else 0) | (int(backend_code) << 8) | (int(S) << 16)


def run_cached(e, q, k, v, g, beta, A_log, dt_bias, pool, cu_seqlens, ssm_idx, n_acc, output, disable_state_update):
    """recurrent_kda for a key validated before: re-check the addresses, allocate, run. None when a
    re-check fails (the caller then takes the full path, which raises the error). The key's C++ call has
    checked the overlap of the writes with every argument."""
    d = e.d
    if e.pool_align and pool.data_ptr() % 16 != 0:
        return None
    if e.decode_mode is not None and cu_seqlens is None:
        out = q.new_empty((d.B, d.T, d.HV, d.V)) if output is None else output
        _recurrent_kda_decode_op(
            q,
            k,
            v,
            g,
            beta,
            A_log,
            dt_bias,
            pool,
            ssm_idx,
            n_acc,
            out,
            e.sc,
            e.lb,
            e.decode_mode | (16 if disable_state_update else 0),
        )
        return out, (pool if e.out_final else None)
    order = None
    if e.need_order:
        lens = cu_seqlens[1:] - cu_seqlens[:-1]
        order = torch.argsort(lens, descending=True, stable=True).to(torch.int32)
    out = q.new_empty((d.B, d.T, d.HV, d.V)) if output is None else output
    final = torch.zeros((d.N, d.HV, d.V, d.K), dtype=torch.float32, device=d.device) if e.alloc_final else None
    _recurrent_kda_op(
        q,
        k,
        v,
        g,
        beta,
        A_log,
        dt_bias,
        pool,
        None,
        None,
        cu_seqlens,
        ssm_idx,
        n_acc,
        order,
        out,
        final,
        None,
        None,
        None,
        e.sc,
        e.gate_mode,
        e.lb,
        e.l2,
        e.logit,
        e.S,
        0,
        e.backend_code,
        e.zero_uncovered,
        disable_state_update,
    )
    return out, ((pool if pool is not None else final) if e.out_final else None)
