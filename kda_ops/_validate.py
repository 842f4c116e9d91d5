"""Argument checks shared by every public entry point (SPEC §5): one place, one message style.

Every message reads ``"<arg> must be <expected>, got <actual>"``. Exception types:

- ``TypeError``: a dtype (or a Python type) is wrong;
- ``ValueError``: a shape, rank, value or combination of arguments is wrong;
- ``RuntimeError``: a device is wrong or unsupported, or the call is not allowed in the current
  CUDA-graph-capture state.

Validation runs before anything is written, so a rejected call leaves every tensor bit-identical.
Checks read shapes, dtypes and devices only; tensor VALUES are read only where they already live on
the host (CPU tensors in eager mode), so no check ever syncs with a GPU and every check traces under
``torch.compile`` (where value checks are skipped). Device-side values are caller contracts (SPEC §5):
``validate_cu_seqlens`` / ``validate_state_indices`` check them on request, with a host sync.
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass
from typing import Any

import torch

__all__ = ["validate_cu_seqlens", "validate_state_indices"]

BACKENDS = {"auto": 0, "chunked": 1, "recurrent": 2}
GATE_PRECOMPUTED, GATE_SOFTPLUS, GATE_LOWER_BOUND = 0, 1, 2
TAPE_CHUNK = 64  # kda::kTapeChunk (csrc/kda/params.h)
TRAINING_MIN_LOWER_BOUND = -5.0  # SPEC §3.2: λ ∈ [-5, 0)
CHECKPOINT_MULTIPLE = 16
CPU_TOKEN_DTYPES = (torch.bfloat16, torch.float32, torch.float64)

# ---------------------------------------------------------------------------------------------------
# message helpers


def _shape(t: torch.Tensor) -> str:
    return "[" + ", ".join(str(s) for s in t.shape) + "]"


def _dims(*xs: Any) -> str:
    return "[" + ", ".join(str(x) for x in xs) + "]"


def _type_name(x: Any) -> str:
    return "None" if x is None else type(x).__name__


def _tensor(x: Any, name: str) -> torch.Tensor:
    if not isinstance(x, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {_type_name(x)}")
    return x


def _opt_tensor(x: Any, name: str) -> torch.Tensor | None:
    return None if x is None else _tensor(x, name)


def _bool(x: Any, name: str) -> bool:
    if not isinstance(x, bool):
        raise TypeError(f"{name} must be a bool, got {_type_name(x)}")
    return x


def _int(x: Any, name: str) -> int:
    if isinstance(x, bool) or not isinstance(x, int):
        raise TypeError(f"{name} must be an int, got {_type_name(x)}")
    return x


def _real(x: Any, name: str) -> float:
    if isinstance(x, bool) or not isinstance(x, (int, float)):
        raise TypeError(f"{name} must be a float, got {_type_name(x)}")
    return float(x)


def _rank(t: torch.Tensor, name: str, rank: int, layout: str) -> None:
    if t.dim() != rank:
        raise ValueError(f"{name} must be rank {rank} {layout}, got shape {_shape(t)}")


def _exact_shape(t: torch.Tensor, name: str, expected: tuple[Any, ...], layout: str) -> None:
    if tuple(t.shape) != tuple(expected):
        raise ValueError(f"{name} must have shape {layout} = {_dims(*expected)}, got {_shape(t)}")


def _device(t: torch.Tensor, name: str, device: torch.device) -> None:
    if t.device != device:
        raise RuntimeError(f"{name} must be on {device} (the device of q), got {t.device}")


def _dtype(t: torch.Tensor, name: str, allowed: tuple[torch.dtype, ...], note: str = "") -> None:
    if t.dtype not in allowed:
        exp = " or ".join(str(d) for d in allowed)
        raise TypeError(f"{name} must be {exp}{note}, got {t.dtype}")


def _lastdim_contiguous(t: torch.Tensor, name: str) -> None:
    if t.dim() > 0 and t.shape[-1] > 1 and t.stride(-1) != 1:
        raise ValueError(f"{name} must have a contiguous last dim (stride 1), got strides {list(t.stride())}")


def _contiguous(t: torch.Tensor, name: str) -> None:
    if not t.is_contiguous():
        raise ValueError(f"{name} must be contiguous, got strides {list(t.stride())} for shape {_shape(t)}")


def host_values_available(t: torch.Tensor | None) -> bool:
    """True when ``t``'s values can be read without a device sync and outside tracing: a plain CPU
    tensor in eager mode (not a FakeTensor, not under torch.compile)."""
    if t is None or torch.compiler.is_compiling():
        return False
    return t.device.type == "cpu" and type(t) in (torch.Tensor, torch.nn.Parameter)


def capturing(device: torch.device) -> bool:
    """True while a CUDA graph is being captured on the current stream of ``device``."""
    if device.type != "cuda" or torch.compiler.is_compiling():
        return False
    return bool(torch.cuda.is_current_stream_capturing())


@functools.cache
def _cuda_kernels_built() -> bool:
    return bool(torch._C._dispatch_has_kernel_for_dispatch_key("kda::recurrent_kda", "CUDA"))


@functools.cache
def _capability(index: int) -> tuple[int, int]:
    return torch.cuda.get_device_capability(index)


def _check_cuda_device(device: torch.device) -> None:
    if torch.compiler.is_compiling():
        return
    if not _cuda_kernels_built():
        raise RuntimeError(
            f"q must be on CPU for this build of kda_ops (built without CUDA kernels: KDA_CUDA_ARCHS=none or "
            f"no toolkit), got {device}"
        )
    idx = device.index if device.index is not None else torch.cuda.current_device()
    major, minor = _capability(idx)
    if major < 9:
        raise RuntimeError(
            f"q must be on a GPU of compute capability >= 9.0 (sm_90a, sm_100a, sm_103a, sm_120a), got "
            f"{major}.{minor} on {device}"
        )


# ---------------------------------------------------------------------------------------------------
# token tensors


@dataclass(frozen=True)
class Dims:
    """Problem sizes of one call (SPEC §1). Packed: B == 1, N = len(cu_seqlens) - 1."""

    B: Any
    T: Any
    H: int
    HV: int
    K: int
    V: int
    N: Any
    packed: bool
    device: torch.device
    dtype: torch.dtype

    @property
    def on_cuda(self) -> bool:
        return self.device.type == "cuda"


def check_tokens(q: Any, k: Any, v: Any, g: Any, beta: Any, cu_seqlens: Any, *, kv_rule: str) -> Dims:
    """Types, ranks, devices, dtypes, shapes and strides of q, k, v, g, beta and cu_seqlens.

    kv_rule: which head dims the path takes on CUDA: "recurrent" (K == V in {64, 128}), "chunked" or
    "training" (K == V == 128), "auto" (either). CPU takes any K, V >= 1.
    """
    q = _tensor(q, "q")
    k, v, g, beta = (_tensor(x, n) for x, n in ((k, "k"), (v, "v"), (g, "g"), (beta, "beta")))
    device = q.device
    if device.type not in ("cpu", "cuda", "meta"):
        raise RuntimeError(f"q must be on a CPU or CUDA device, got {device}")
    for x, n in ((k, "k"), (v, "v"), (g, "g"), (beta, "beta")):
        _device(x, n, device)
    if device.type == "cuda":
        _check_cuda_device(device)

    _rank(q, "q", 4, "[B, T, H, K]")
    _rank(k, "k", 4, "[B, T, H, K]")
    _rank(v, "v", 4, "[B, T, HV, V]")
    _rank(g, "g", 4, "[B, T, HV, K]")
    _rank(beta, "beta", 3, "[B, T, HV]")

    if device.type == "cuda":
        if q.dtype != torch.bfloat16:
            note = (
                " (fp32/fp64 token tensors run on the CPU path only: move the tensors to CPU)"
                if q.dtype in (torch.float32, torch.float64)
                else " (fp16 is not supported)"
            )
            raise TypeError(f"q must be torch.bfloat16 on CUDA, got {q.dtype}{note}")
    else:
        _dtype(q, "q", CPU_TOKEN_DTYPES, " on CPU (fp16 is not supported)")
    for x, n in ((k, "k"), (v, "v"), (g, "g"), (beta, "beta")):
        if x.dtype != q.dtype:
            raise TypeError(f"{n} must be {q.dtype} (the dtype of q), got {x.dtype}")

    B, T, H, K = q.shape
    HV, V = v.shape[2], v.shape[3]
    _exact_shape(k, "k", (B, T, H, K), "[B, T, H, K]")
    if v.shape[0] != B or v.shape[1] != T:
        raise ValueError(f"v must have shape [B, T, HV, V] with B={B}, T={T}, got {_shape(v)}")
    _exact_shape(g, "g", (B, T, HV, K), "[B, T, HV, K]")
    _exact_shape(beta, "beta", (B, T, HV), "[B, T, HV]")
    if H < 1 or HV < 1 or K < 1 or V < 1:
        raise ValueError(f"q and v must have H, HV, K, V >= 1, got q {_shape(q)}, v {_shape(v)}")
    if HV % H != 0:
        raise ValueError(f"v must have a multiple of H={H} heads (HV % H == 0), got HV={HV}")
    if device.type == "cuda":
        allowed = {"recurrent": (64, 128), "auto": (64, 128), "chunked": (128,), "training": (128,)}[kv_rule]
        what = " or ".join(str(a) for a in allowed)
        if K not in allowed:
            raise ValueError(f"q.shape[-1] (K) must be {what} on CUDA ({kv_rule} path), got K={K}")
        if V != K:
            raise ValueError(f"v.shape[-1] (V) must equal K={K} on CUDA, got V={V}")
    for x, n in ((q, "q"), (k, "k"), (v, "v"), (g, "g"), (beta, "beta")):
        _lastdim_contiguous(x, n)

    packed = cu_seqlens is not None
    N: Any = B
    if packed:
        cu = _tensor(cu_seqlens, "cu_seqlens")
        _device(cu, "cu_seqlens", device)
        _dtype(cu, "cu_seqlens", (torch.int32, torch.int64))
        if B != 1:
            raise ValueError(f"cu_seqlens must come with B == 1 (packed input), got q with B={B}")
        _rank(cu, "cu_seqlens", 1, "[N+1]")
        if cu.shape[0] < 2:
            raise ValueError(f"cu_seqlens must have at least 2 entries ([N+1], N >= 1), got {_shape(cu)}")
        _contiguous(cu, "cu_seqlens")
        N = cu.shape[0] - 1
        if host_values_available(cu):
            _cu_values(cu, T, "cu_seqlens")
    return Dims(B, T, H, HV, K, V, N, packed, device, q.dtype)


def _cu_values(cu: torch.Tensor, total: Any, name: str) -> None:
    """Values of a host cu_seqlens: starts at 0, non-decreasing, ends at total."""
    c = cu.to(torch.int64)
    if int(c[0]) != 0:
        raise ValueError(f"{name} must start at 0, got {int(c[0])}")
    if c.numel() > 1 and bool((c[1:] < c[:-1]).any()):
        i = int(torch.nonzero(c[1:] < c[:-1])[0, 0])
        raise ValueError(
            f"{name} must be non-decreasing, got {name}[{i}]={int(c[i])} > {name}[{i + 1}]={int(c[i + 1])}"
        )
    if int(c[-1]) != int(total):
        raise ValueError(f"{name} must end at the total token count T={total}, got {int(c[-1])}")


def check_scale(scale: Any, K: int) -> float:
    """None -> 1/sqrt(K); otherwise a finite float > 0."""
    if scale is None:
        return 1.0 / math.sqrt(K)
    s = _real(scale, "scale")
    if not math.isfinite(s) or s <= 0.0:
        raise ValueError(f"scale must be a finite float > 0, got {scale}")
    return s


def check_backend(backend: Any) -> int:
    if not isinstance(backend, str) or backend not in BACKENDS:
        raise ValueError(f"backend must be one of 'auto', 'chunked', 'recurrent', got {backend!r}")
    return BACKENDS[backend]


# ---------------------------------------------------------------------------------------------------
# gate parameters


def check_gate(
    use_gate_in_kernel: Any, lower_bound: Any, A_log: Any, dt_bias: Any, d: Dims
) -> tuple[int, float, torch.Tensor | None, torch.Tensor | None]:
    """recurrent_kda gate arguments -> (gate_mode, lower_bound, A_log [HV], dt_bias [HV, K] or None).

    A_log [H] and dt_bias [H, K] / [H*K] (per q/k head, FlashInfer's decode signature) are expanded to
    per value head: value head hv uses q/k head hv // (HV // H). Flat dt_bias [HV*K] is viewed as [HV, K].
    """
    use_gate = _bool(use_gate_in_kernel, "use_gate_in_kernel")
    A = _opt_tensor(A_log, "A_log")
    dtb = _opt_tensor(dt_bias, "dt_bias")
    if not use_gate:
        if lower_bound is not None:
            raise ValueError(
                f"lower_bound must be None without the in-kernel gate (use_gate_in_kernel=False), got {lower_bound}"
            )
        if A is not None:
            raise ValueError(
                "A_log must be None without the in-kernel gate (use_gate_in_kernel=False: g is the log-decay), "
                f"got a tensor of shape {_shape(A)}"
            )
        if dtb is not None:
            raise ValueError(
                "dt_bias must be None without the in-kernel gate (use_gate_in_kernel=False: g is the log-decay), "
                f"got a tensor of shape {_shape(dtb)}"
            )
        return GATE_PRECOMPUTED, 0.0, None, None
    if A is None:
        raise ValueError("A_log must be a [HV] fp32 tensor with use_gate_in_kernel=True, got None")
    mode, lb = GATE_SOFTPLUS, 0.0
    if lower_bound is not None:
        lb = _real(lower_bound, "lower_bound")
        if not math.isfinite(lb) or lb >= 0.0:
            raise ValueError(f"lower_bound must be a finite float < 0, got {lower_bound}")
        mode = GATE_LOWER_BOUND
    group = d.HV // d.H
    _device(A, "A_log", d.device)
    _dtype(A, "A_log", (torch.float32,))
    if A.dim() != 1 or (A.shape[0] != d.HV and A.shape[0] != d.H):
        exp = f"[HV] = [{d.HV}]" + (f" or [H] = [{d.H}]" if d.H != d.HV else "")
        raise ValueError(f"A_log must have shape {exp}, got {_shape(A)}")
    if A.shape[0] != d.HV:
        A = A.repeat_interleave(group)
    A = A.contiguous()
    if dtb is not None:
        _device(dtb, "dt_bias", d.device)
        _dtype(dtb, "dt_bias", (torch.float32,))
        ok_hv = (dtb.dim() == 2 and tuple(dtb.shape) == (d.HV, d.K)) or (dtb.dim() == 1 and dtb.shape[0] == d.HV * d.K)
        ok_h = d.H != d.HV and (
            (dtb.dim() == 2 and tuple(dtb.shape) == (d.H, d.K)) or (dtb.dim() == 1 and dtb.shape[0] == d.H * d.K)
        )
        if not (ok_hv or ok_h):
            exp = f"[HV, K] = [{d.HV}, {d.K}] or [HV*K] = [{d.HV * d.K}]"
            if d.H != d.HV:
                exp += f" or [H, K] = [{d.H}, {d.K}] or [H*K] = [{d.H * d.K}]"
            raise ValueError(f"dt_bias must have shape {exp}, got {_shape(dtb)}")
        dtb = dtb.reshape(-1, d.K)
        if ok_h and not ok_hv:
            dtb = dtb.repeat_interleave(group, dim=0)
        dtb = dtb.contiguous()
    return mode, lb, A, dtb


def param_dtype(d: Dims) -> torch.dtype:
    """dtype of A_log, dt_bias and the states of the training ops: fp64 with fp64 tokens, else fp32."""
    return torch.float64 if d.dtype == torch.float64 else torch.float32


def check_training_params(
    A_log: Any, dt_bias: Any, initial_state: Any, lower_bound: Any, d: Dims, *, state_required: bool = True
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None, float]:
    """Training-family gate parameters and start state -> (A_log [HV], dt_bias [HV, K], initial_state, λ).

    A_log [HV], dt_bias [HV, K] or flat [HV*K], initial_state [N, HV, V, K]; all fp32 (fp64 when the
    token tensors are fp64, CPU only). λ must be finite and in [-5, 0).
    """
    pdt = param_dtype(d)
    note = " (the parameter dtype for " + str(d.dtype) + " tokens)"
    A = _tensor(A_log, "A_log")
    dtb = _tensor(dt_bias, "dt_bias")
    _device(A, "A_log", d.device)
    _device(dtb, "dt_bias", d.device)
    _dtype(A, "A_log", (pdt,), note)
    _dtype(dtb, "dt_bias", (pdt,), note)
    if A.dim() != 1 or A.shape[0] != d.HV:
        raise ValueError(f"A_log must have shape [HV] = [{d.HV}], got {_shape(A)}")
    if not ((dtb.dim() == 2 and tuple(dtb.shape) == (d.HV, d.K)) or (dtb.dim() == 1 and dtb.shape[0] == d.HV * d.K)):
        raise ValueError(
            f"dt_bias must have shape [HV, K] = [{d.HV}, {d.K}] or [HV*K] = [{d.HV * d.K}], got {_shape(dtb)}"
        )
    dtb = dtb.view(d.HV, d.K) if dtb.dim() == 1 else dtb
    h0 = _opt_tensor(initial_state, "initial_state")
    if h0 is None:
        if state_required:
            raise ValueError(f"initial_state must be a [N, HV, V, K] {pdt} tensor, got None")
    else:
        _device(h0, "initial_state", d.device)
        _dtype(h0, "initial_state", (pdt,), note)
        _exact_shape(h0, "initial_state", (d.N, d.HV, d.V, d.K), "[N, HV, V, K]")
    lb = _real(lower_bound, "lower_bound")
    if not math.isfinite(lb) or not (TRAINING_MIN_LOWER_BOUND <= lb < 0.0):
        raise ValueError(f"lower_bound must be a finite float in [-5, 0), got {lower_bound}")
    return A, dtb, h0, lb


# ---------------------------------------------------------------------------------------------------
# state pools and index tensors


def pool_dtypes(d: Dims) -> tuple[torch.dtype, ...]:
    """Pool (initial_state / initial_state_source) dtypes: bf16 or fp32; also fp64 on CPU."""
    return (torch.bfloat16, torch.float32) if d.on_cuda else (torch.bfloat16, torch.float32, torch.float64)


def check_pool(t: Any, name: str, d: Dims) -> torch.Tensor:
    """A state pool [N_pool, HV, V, K]: compact [HV, V, K] block per slot, slot stride a multiple of 16
    elements when padded (SPEC §3.1)."""
    s = _tensor(t, name)
    _device(s, name, d.device)
    _dtype(s, name, pool_dtypes(d), "" if d.on_cuda else " (or torch.float64 on CPU)")
    _rank(s, name, 4, "[N_pool, HV, V, K]")
    if tuple(s.shape[1:]) != (d.HV, d.V, d.K):
        raise ValueError(f"{name} must have shape [N_pool, HV, V, K] = [*, {d.HV}, {d.V}, {d.K}], got {_shape(s)}")
    inner = d.HV * d.V * d.K
    compact = s.stride(3) == 1 and s.stride(2) == d.K and s.stride(1) == d.V * d.K
    if s.shape[0] > 1 and compact:
        st = s.stride(0)
        compact = st == inner or (st > inner and st % 16 == 0)
    if not compact:
        raise ValueError(
            f"{name} must have a compact [HV, V, K] block per slot and a slot stride of HV*V*K={inner} or a larger "
            f"multiple of 16 elements, got strides {list(s.stride())}"
        )
    check_aligned(s, name, d)
    return s


def check_aligned(t: torch.Tensor, name: str, d: Dims) -> None:
    """CUDA kernels move states in 16-byte vectors: the base address must be 16-byte aligned."""
    if not d.on_cuda or torch.compiler.is_compiling() or type(t) not in (torch.Tensor, torch.nn.Parameter):
        return
    if t.numel() > 0 and t.data_ptr() % 16 != 0:
        raise ValueError(f"{name} must start at a 16-byte aligned address on CUDA, got {hex(t.data_ptr())}")


def check_index(t: Any, name: str, shape: tuple[Any, ...], layout: str, d: Dims) -> torch.Tensor:
    """An int32 contiguous index tensor of the given shape on the device of q."""
    x = _tensor(t, name)
    _device(x, name, d.device)
    _dtype(x, name, (torch.int32,))
    _rank(x, name, len(shape), layout)
    _exact_shape(x, name, shape, layout)
    _contiguous(x, name)
    return x


# ---------------------------------------------------------------------------------------------------
# overlap


def _span(t: torch.Tensor) -> tuple[int, int] | None:
    if t.numel() == 0:
        return None
    extent = sum((s - 1) * st for s, st in zip(t.shape, t.stride(), strict=True))
    lo = t.data_ptr()
    return lo, lo + (extent + 1) * t.element_size()


def check_no_overlap(name: str, t: torch.Tensor, others: list[tuple[str, torch.Tensor | None]]) -> None:
    """ValueError when the memory span of ``t`` intersects the span of any other tensor (same device).

    Spans are [first byte, last byte] of each view, so two interleaved views of one buffer count as
    overlapping: a conservative rule, in line with SPEC §3.1 ("must not overlap any input").
    Skipped while tracing (FakeTensors have no memory).
    """
    if torch.compiler.is_compiling() or type(t) not in (torch.Tensor, torch.nn.Parameter) or t.device.type == "meta":
        return
    a = _span(t)
    if a is None:
        return
    for oname, o in others:
        if o is None or o.device != t.device or type(o) not in (torch.Tensor, torch.nn.Parameter):
            continue
        b = _span(o)
        if b is not None and a[0] < b[1] and b[0] < a[1]:
            raise ValueError(f"{name} must not overlap {oname} in memory, got overlapping storage")


# ---------------------------------------------------------------------------------------------------
# explicit value checks (public helpers; they sync with the host)


def validate_cu_seqlens(cu_seqlens: torch.Tensor, total_tokens: int) -> torch.Tensor:
    """Checks the VALUES of ``cu_seqlens`` (copying it to the host: a device sync for GPU tensors).

    Args:
        cu_seqlens: int32 or int64 [N+1], any device.
        total_tokens: T, the token count of the packed call (``q.shape[1]``).

    Returns:
        The values as a CPU int64 tensor [N+1] (usable as ``cu_seqlens_cpu`` of the training forward).

    Raises:
        TypeError: not an int32/int64 tensor. ValueError: not rank 1 with >= 2 entries, not starting at 0,
        decreasing somewhere, or not ending at ``total_tokens``.

    The ops themselves never read out of bounds on a broken ``cu_seqlens`` (a decreasing pair counts as
    an empty sequence, values are clamped to [0, T]), but its results are then meaningless.
    """
    cu = _tensor(cu_seqlens, "cu_seqlens")
    _dtype(cu, "cu_seqlens", (torch.int32, torch.int64))
    _rank(cu, "cu_seqlens", 1, "[N+1]")
    if cu.shape[0] < 2:
        raise ValueError(f"cu_seqlens must have at least 2 entries ([N+1], N >= 1), got {_shape(cu)}")
    host = cu.detach().to("cpu", torch.int64)
    _cu_values(host, int(total_tokens), "cu_seqlens")
    return host


def validate_state_indices(
    indices: torch.Tensor, n_pool: int, *, allow_inactive: bool = True, allow_duplicates: bool = False
) -> None:
    """Checks the VALUES of a slot index tensor (``ssm_state_indices`` [N] / [N, 1+S] or
    ``initial_state_indices`` [N]); copies it to the host (a device sync for GPU tensors).

    For the ops, an index outside ``[0, n_pool)`` is LEGAL: it marks the sequence (or, in speculative
    decode, the token) inactive — zero output, no state read or write (SPEC §3.1). Pass
    ``allow_inactive=False`` to forbid such indices. Two active entries naming the same slot make two
    writers race for it, so duplicates among in-range entries are an error unless ``allow_duplicates``
    (use it for read-only ``initial_state_indices``).

    Raises:
        TypeError: not an int32/int64 tensor. ValueError: an out-of-range entry (with
        ``allow_inactive=False``) or a duplicated in-range entry (without ``allow_duplicates``).
    """
    x = _tensor(indices, "indices")
    _dtype(x, "indices", (torch.int32, torch.int64))
    n = _int(n_pool, "n_pool")
    host = x.detach().to("cpu", torch.int64).reshape(-1)
    active = (host >= 0) & (host < n)
    if not allow_inactive and not bool(active.all()):
        i = int(torch.nonzero(~active)[0, 0])
        raise ValueError(f"indices must be in [0, n_pool={n}), got {int(host[i])} at flat position {i}")
    if not allow_duplicates:
        vals = host[active]
        uniq, counts = torch.unique(vals, return_counts=True)
        if bool((counts > 1).any()):
            dup = int(uniq[counts > 1][0])
            raise ValueError(
                f"indices must name each active slot at most once, got slot {dup} {int(counts.max())} times"
            )


def check_permutation(seq_order: torch.Tensor, N: int) -> None:
    """Host check (CPU tensors, eager only) that seq_order is a permutation of 0..N-1."""
    if not host_values_available(seq_order):
        return
    s = torch.sort(seq_order.to(torch.int64)).values
    if not torch.equal(s, torch.arange(N, dtype=torch.int64)):
        raise ValueError(f"seq_order must be a permutation of 0..N-1 (N={N}), got {seq_order.tolist()}")
