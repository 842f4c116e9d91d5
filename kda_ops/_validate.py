"""Argument checks shared by every public entry point (docs/contract.md "Errors"): one place, one message style.

Every message reads ``"<arg> must be <expected>, got <actual>"``. Exception types:

- ``TypeError``: a dtype (or a Python type) is wrong;
- ``ValueError``: a shape, rank, value or combination of arguments is wrong;
- ``RuntimeError``: a device is wrong or unsupported, or the call is not allowed in the current
  CUDA-graph-capture state.

Validation runs before anything is written, so a rejected call leaves every tensor bit-identical.
Checks read shapes, dtypes and devices only; tensor VALUES are read only where they already live on
the host (CPU tensors in eager mode), so no check ever syncs with a GPU and every check traces under
``torch.compile`` (where value checks are skipped). Device-side values are caller contracts
(docs/contract.md "Errors"): ``validate_cu_seqlens`` / ``validate_state_indices`` check them on request,
with a host sync.

interface.py normalises, calls these checks and routes; it raises nothing itself. The checks are pure
functions of the arguments' Python types, shapes, dtypes, devices and strides (a cache keyed by those
can skip them), except for the few that read values or addresses, kept apart: the host-value checks
(``_cu_values``, ``_spec_cu_values``, ``check_permutation``, ``checkpoint_starts_values``, the host
mirror in ``check_training_cu``), the 16-byte alignment of CUDA pools (``data_ptr``), the memory-overlap
checks (``check_writes_no_overlap``, ``check_no_overlap``), ``check_unmodified`` (version counters) and
the CUDA-capture state (``capturing``). Shape rules live here too: ``checkpoint_starts`` /
``checkpoint_rows`` (checkpoint rows) and ``tape_rows`` (training tape rows, also used by _fake.py).
"""

from __future__ import annotations

import functools
import math
from collections.abc import Sequence
from typing import Any

import torch

__all__ = ["validate_cu_seqlens", "validate_state_indices"]

BACKENDS = {"auto": 0, "chunked": 1, "recurrent": 2}
GATE_PRECOMPUTED, GATE_SOFTPLUS, GATE_LOWER_BOUND = 0, 1, 2
TAPE_CHUNK = 64  # kda::kTapeChunk (csrc/kda/params.h)
TRAINING_MIN_LOWER_BOUND = -5.0  # docs/contract.md "API": λ ∈ [-5, 0)
CHECKPOINT_MULTIPLE = 16
CPU_TOKEN_DTYPES = (torch.bfloat16, torch.float32, torch.float64)
POOL_DTYPES_CUDA = (torch.bfloat16, torch.float32)
POOL_DTYPES_CPU = (torch.bfloat16, torch.float32, torch.float64)
# Tensor types whose memory is real (data_ptr, host values): not FakeTensor or other subclasses.
_Tensor, _Parameter = torch.Tensor, torch.nn.Parameter
_PLAIN = (_Tensor, _Parameter)
_ITEMSIZE = {torch.bfloat16: 2, torch.float32: 4, torch.float64: 8}  # the token dtypes

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
    if isinstance(x, bool) or not isinstance(x, int | float):
        raise TypeError(f"{name} must be a float, got {_type_name(x)}")
    return float(x)


def _rank(t: torch.Tensor, name: str, rank: int, layout: str) -> None:
    if t.dim() != rank:
        raise ValueError(f"{name} must be rank {rank} {layout}, got shape {_shape(t)}")


def _exact_shape(t: torch.Tensor, name: str, expected: tuple[Any, ...], layout: str) -> None:
    if tuple(t.shape) != tuple(expected):
        raise ValueError(f"{name} must have shape {layout} = {_dims(*expected)}, got {_shape(t)}")


def _resolved_index(dev: torch.device) -> int:
    # "cuda" means the current CUDA device (where torch allocates it); CPU-like devices have one index.
    if dev.index is not None:
        return dev.index
    return torch.cuda.current_device() if dev.type == "cuda" else 0


def _same_device(a: torch.device | str, b: torch.device | str) -> bool:
    """Whether two device specs name the same device: ``"cuda"`` resolves to the current CUDA device's
    index (so it equals ``"cuda:0"`` when device 0 is current), ``"cpu"`` equals ``"cpu:0"``."""
    a, b = torch.device(a), torch.device(b)
    if a == b:
        return True
    return a.type == b.type and _resolved_index(a) == _resolved_index(b)


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
    return t.is_cpu and type(t) in _PLAIN


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


# CUDA devices that passed _check_cuda_device (a build and a compute capability never change in a process).
_CUDA_DEVICES_OK: set[torch.device] = set()


def _check_cuda_device(device: torch.device) -> None:
    if torch.compiler.is_compiling() or device in _CUDA_DEVICES_OK:
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
    if device.index is not None:
        _CUDA_DEVICES_OK.add(device)


# ---------------------------------------------------------------------------------------------------
# token tensors


class Dims:
    """Problem sizes of one call (docs/contract.md "Notation"). Packed: B == 1, N = len(cu_seqlens) - 1.

    A plain slotted class (not a frozen dataclass): it is built on every call of the public API, and a
    frozen dataclass's ``__init__`` costs several µs of ``object.__setattr__``. Treat it as read-only.
    """

    __slots__ = ("B", "T", "H", "HV", "K", "V", "N", "packed", "device", "dtype", "dev_type", "on_cuda", "token_nbytes")

    def __init__(
        self,
        B: Any,
        T: Any,
        H: int,
        HV: int,
        K: int,
        V: int,
        N: Any,
        packed: bool,
        device: torch.device,
        dtype: torch.dtype,
        dev_type: str | None = None,
        token_nbytes: tuple[Any, ...] | None = None,
    ) -> None:
        self.B, self.T, self.H, self.HV, self.K, self.V, self.N = B, T, H, HV, K, V, N
        self.packed, self.device, self.dtype = packed, device, dtype
        self.dev_type = device.type if dev_type is None else dev_type  # device.type costs ~1 µs: once
        self.on_cuda = self.dev_type == "cuda"
        # Bytes of q, k, v, g, beta when all five are contiguous and non-empty (then each one's memory is
        # [data_ptr, data_ptr + nbytes)), else None: spares the overlap check five tensor queries.
        self.token_nbytes = token_nbytes

    def __repr__(self) -> str:
        fields = ", ".join(f"{n}={getattr(self, n)!r}" for n in self.__slots__[:10])
        return f"Dims({fields})"


_KV_ALLOWED = {"recurrent": (64, 128), "auto": (64, 128), "chunked": (128,), "training": (64, 128)}
_TOKEN_NAMES = ("q", "k", "v", "g", "beta")


def check_tokens(q: Any, k: Any, v: Any, g: Any, beta: Any, cu_seqlens: Any, *, kv_rule: str) -> Dims:
    """Types, ranks, devices, dtypes, shapes and strides of q, k, v, g, beta and cu_seqlens.

    kv_rule: which head dims the path takes on CUDA: "recurrent" or "training" (K == V in {64, 128}),
    "chunked" (K == V == 128), "auto" (either). CPU takes any K, V >= 1.

    Hot path of every call: each group of checks is one cheap combined test; only when it fails are the
    checks of the group redone one tensor at a time, in the fixed order q, k, v, g, beta, to raise the
    error that names the argument.
    """
    Tensor = _Tensor
    if not (
        isinstance(q, Tensor)
        and isinstance(k, Tensor)
        and isinstance(v, Tensor)
        and isinstance(g, Tensor)
        and isinstance(beta, Tensor)
    ):
        for x, n in zip((q, k, v, g, beta), _TOKEN_NAMES, strict=True):
            _tensor(x, n)
    device = q.device
    # (is_cuda / is_cpu / is_meta: a fraction of the cost of device.type, which builds a string)
    if q.is_cuda:
        dev_type = "cuda"
    elif q.is_cpu:
        dev_type = "cpu"
    elif q.is_meta:
        dev_type = "meta"
    else:
        raise RuntimeError(f"q must be on a CPU or CUDA device, got {device}")
    if not (k.device == device and v.device == device and g.device == device and beta.device == device):
        for x, n in ((k, "k"), (v, "v"), (g, "g"), (beta, "beta")):
            _device(x, n, device)
    on_cuda = dev_type == "cuda"
    if on_cuda:
        _check_cuda_device(device)

    qs, ks, vs, gs, bs = q.shape, k.shape, v.shape, g.shape, beta.shape
    if not (len(qs) == 4 and len(ks) == 4 and len(vs) == 4 and len(gs) == 4 and len(bs) == 3):
        _rank(q, "q", 4, "[B, T, H, K]")
        _rank(k, "k", 4, "[B, T, H, K]")
        _rank(v, "v", 4, "[B, T, HV, V]")
        _rank(g, "g", 4, "[B, T, HV, K]")
        _rank(beta, "beta", 3, "[B, T, HV]")

    dtype = q.dtype
    fp16_note = " (fp16 is not supported)" if dtype == torch.float16 else ""
    if on_cuda:
        if dtype != torch.bfloat16:
            note = (
                " (fp32/fp64 token tensors run on the CPU path only: move the tensors to CPU)"
                if dtype in (torch.float32, torch.float64)
                else fp16_note
            )
            raise TypeError(f"q must be torch.bfloat16 on CUDA, got {dtype}{note}")
    elif dtype not in CPU_TOKEN_DTYPES:
        _dtype(q, "q", CPU_TOKEN_DTYPES, " on CPU" + fp16_note)
    if not (k.dtype == dtype and v.dtype == dtype and g.dtype == dtype and beta.dtype == dtype):
        for x, n in ((k, "k"), (v, "v"), (g, "g"), (beta, "beta")):
            if x.dtype != dtype:
                raise TypeError(f"{n} must be {dtype} (the dtype of q), got {x.dtype}")

    B, T, H, K = qs
    HV, V = vs[2], vs[3]
    if not (ks == qs and vs[0] == B and vs[1] == T and gs == (B, T, HV, K) and bs == (B, T, HV)):
        if (
            len(ks) == 4
            and len(gs) == 4
            and ks[:2] == vs[:2] == gs[:2]
            and ks[3] == gs[3]
            and (ks[:2] != qs[:2] or ks[3] != qs[3])
        ):
            # k, v and g agree on B, T (and k, g on K): the odd one out is q (the shapes are read from q)
            raise ValueError(f"q must have shape [B, T, H, K] with B, T, K of k, v and g {list(ks)}, got {_shape(q)}")
        _exact_shape(k, "k", (B, T, H, K), "[B, T, H, K]")
        if vs[0] != B or vs[1] != T:
            raise ValueError(f"v must have shape [B, T, HV, V] with B={B}, T={T}, got {_shape(v)}")
        if len(gs) == 4 and len(bs) == 3 and gs[2] == bs[2] != HV and tuple(gs[:2]) == (B, T):
            # g and beta agree on the value heads: the odd one out is v (HV is read from v)
            raise ValueError(f"v must have the HV={gs[2]} value heads of g and beta ([B, T, HV, V]), got {_shape(v)}")
        _exact_shape(g, "g", (B, T, HV, K), "[B, T, HV, K]")
        _exact_shape(beta, "beta", (B, T, HV), "[B, T, HV]")
    if H < 1 or HV < 1 or K < 1 or V < 1:
        raise ValueError(f"q and v must have H, HV, K, V >= 1, got q {_shape(q)}, v {_shape(v)}")
    if HV % H != 0:
        raise ValueError(f"v must have a multiple of H={H} heads (HV % H == 0), got HV={HV}")
    if on_cuda:
        allowed = _KV_ALLOWED[kv_rule]
        if K not in allowed:
            what = " or ".join(str(a) for a in allowed)
            raise ValueError(f"q.shape[-1] (K) must be {what} on CUDA ({kv_rule} path), got K={K}")
        if V != K:
            raise ValueError(f"v.shape[-1] (V) must equal K={K} on CUDA, got V={V}")
    # A non-empty contiguous tensor has a contiguous last dim: one cheap test per tensor on the common path.
    # (An empty tensor counts as contiguous whatever its strides: B*T == 0 takes the per-tensor test.)
    if B * T == 0 or not (
        q.is_contiguous() and k.is_contiguous() and v.is_contiguous() and g.is_contiguous() and beta.is_contiguous()
    ):
        for x, n in zip((q, k, v, g, beta), _TOKEN_NAMES, strict=True):
            _lastdim_contiguous(x, n)
        token_nbytes = None
    else:
        bt = B * T * _ITEMSIZE[dtype]
        token_nbytes = (bt * H * K, bt * H * K, bt * HV * V, bt * HV * K, bt * HV)

    N: Any = B
    packed = cu_seqlens is not None
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
    return Dims(B, T, H, HV, K, V, N, packed, device, dtype, dev_type, token_nbytes)


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


def check_verify(disable_state_update: Any, backend_code: int) -> int:
    """disable_state_update (a bool) -> the backend code the call runs with. A verify pass writes no pool slot,
    a mode only the token-serial kernel has: 'auto' resolves to it, 'chunked' refuses the flag."""
    if disable_state_update is False:
        return backend_code
    _bool(disable_state_update, "disable_state_update")
    if backend_code == BACKENDS["chunked"]:
        raise ValueError("disable_state_update=True needs backend 'auto' or 'recurrent', got 'chunked'")
    return BACKENDS["recurrent"]


# ---------------------------------------------------------------------------------------------------
# gate parameters


def _check_no_gate_params(A: torch.Tensor | None, dtb: torch.Tensor | None) -> None:
    """Without the in-kernel gate, g is the log-decay itself: A_log and dt_bias must be left out."""
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


def check_gate(
    use_gate_in_kernel: Any, lower_bound: Any, A_log: Any, dt_bias: Any, d: Dims
) -> tuple[int, float, torch.Tensor | None, torch.Tensor | None]:
    """recurrent_kda gate arguments -> (gate_mode, lower_bound, A_log [HV], dt_bias [HV, K] or None).

    A_log [H] and dt_bias [H, K] / [H*K] (per q/k head, FlashInfer's decode signature) are expanded to
    per value head: value head hv uses q/k head hv // (HV // H). Flat dt_bias [HV*K] is viewed as [HV, K].
    A_log [HV] and dt_bias [HV, K] that are already contiguous are passed through as they are (no new
    tensor on the common path).
    """
    use_gate = use_gate_in_kernel
    if not isinstance(use_gate, bool):
        _bool(use_gate, "use_gate_in_kernel")
    A, dtb = A_log, dt_bias
    if not ((A is None or isinstance(A, torch.Tensor)) and (dtb is None or isinstance(dtb, torch.Tensor))):
        _opt_tensor(A, "A_log")
        _opt_tensor(dtb, "dt_bias")
    if not use_gate:
        if lower_bound is not None:
            raise ValueError(
                f"lower_bound must be None without the in-kernel gate (use_gate_in_kernel=False), got {lower_bound}"
            )
        _check_no_gate_params(A, dtb)
        return GATE_PRECOMPUTED, 0.0, None, None
    if A is None:
        raise ValueError("A_log must be a [HV] fp32 tensor with use_gate_in_kernel=True, got None")
    mode, lb = GATE_SOFTPLUS, 0.0
    if lower_bound is not None:
        lb = float(lower_bound) if type(lower_bound) is float else _real(lower_bound, "lower_bound")
        if not math.isfinite(lb) or lb >= 0.0:
            raise ValueError(f"lower_bound must be a finite float < 0, got {lower_bound}")
        mode = GATE_LOWER_BOUND
    H, HV, K = d.H, d.HV, d.K
    group = HV // H
    device = d.device
    if A.device != device:
        _device(A, "A_log", device)
    if A.dtype != torch.float32:
        _dtype(A, "A_log", (torch.float32,))
    a_shape = A.shape
    if len(a_shape) != 1 or (a_shape[0] != HV and a_shape[0] != H):
        exp = f"[HV] = [{HV}]" + (f" or [H] = [{H}]" if H != HV else "")
        raise ValueError(f"A_log must have shape {exp}, got {_shape(A)}")
    if a_shape[0] != HV:
        A = A.repeat_interleave(group)
    A = A.contiguous()
    if dtb is not None:
        if dtb.device != device:
            _device(dtb, "dt_bias", device)
        if dtb.dtype != torch.float32:
            _dtype(dtb, "dt_bias", (torch.float32,))
        d_shape = dtb.shape
        nd = len(d_shape)
        ok_hv = (nd == 2 and d_shape == (HV, K)) or (nd == 1 and d_shape[0] == HV * K)
        if ok_hv:
            if nd != 2:
                dtb = dtb.reshape(-1, K)
        else:
            ok_h = H != HV and ((nd == 2 and d_shape == (H, K)) or (nd == 1 and d_shape[0] == H * K))
            if not ok_h:
                exp = f"[HV, K] = [{HV}, {K}] or [HV*K] = [{HV * K}]"
                if H != HV:
                    exp += f" or [H, K] = [{H}, {K}] or [H*K] = [{H * K}]"
                raise ValueError(f"dt_bias must have shape {exp}, got {_shape(dtb)}")
            dtb = dtb.reshape(-1, K).repeat_interleave(group, dim=0)
        dtb = dtb.contiguous()
    return mode, lb, A, dtb


def param_dtype(d: Dims) -> torch.dtype:
    """dtype of A_log, dt_bias and the states of the training ops: fp64 with fp64 tokens, else fp32."""
    return torch.float64 if d.dtype == torch.float64 else torch.float32


def _param_note(d: Dims) -> str:
    return " (the parameter dtype for " + str(d.dtype) + " tokens)"


def _training_A_log(A: torch.Tensor, d: Dims) -> None:
    """A given A_log of the training family: [HV] in the parameter dtype, on the tokens' device."""
    _device(A, "A_log", d.device)
    _dtype(A, "A_log", (param_dtype(d),), _param_note(d))
    if A.dim() != 1 or A.shape[0] != d.HV:
        raise ValueError(f"A_log must have shape [HV] = [{d.HV}], got {_shape(A)}")


def _training_dt_bias(dtb: torch.Tensor, d: Dims) -> torch.Tensor:
    """A given dt_bias of the training family: [HV, K] or flat [HV*K] in the parameter dtype -> [HV, K]."""
    _device(dtb, "dt_bias", d.device)
    _dtype(dtb, "dt_bias", (param_dtype(d),), _param_note(d))
    if not ((dtb.dim() == 2 and tuple(dtb.shape) == (d.HV, d.K)) or (dtb.dim() == 1 and dtb.shape[0] == d.HV * d.K)):
        raise ValueError(
            f"dt_bias must have shape [HV, K] = [{d.HV}, {d.K}] or [HV*K] = [{d.HV * d.K}], got {_shape(dtb)}"
        )
    return dtb.view(d.HV, d.K) if dtb.dim() == 1 else dtb


def _training_state(initial_state: Any, d: Dims, state_required: bool) -> torch.Tensor | None:
    """initial_state of the training family: [N, HV, V, K] in the parameter dtype, or None when not required."""
    pdt = param_dtype(d)
    h0 = _opt_tensor(initial_state, "initial_state")
    if h0 is None:
        if state_required:
            raise ValueError(f"initial_state must be a [N, HV, V, K] {pdt} tensor, got None")
    else:
        _device(h0, "initial_state", d.device)
        _dtype(h0, "initial_state", (pdt,), _param_note(d))
        _exact_shape(h0, "initial_state", (d.N, d.HV, d.V, d.K), "[N, HV, V, K]")
    return h0


def check_training_params(
    A_log: Any, dt_bias: Any, initial_state: Any, lower_bound: Any, d: Dims, *, state_required: bool = True
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None, float]:
    """Training-family gate parameters and start state -> (A_log [HV], dt_bias [HV, K], initial_state, λ).

    A_log [HV], dt_bias [HV, K] or flat [HV*K], initial_state [N, HV, V, K]; all fp32 (fp64 when the
    token tensors are fp64, CPU only). λ must be finite and in [-5, 0).
    """
    A = _tensor(A_log, "A_log")
    dtb = _tensor(dt_bias, "dt_bias")
    _training_A_log(A, d)
    dtb = _training_dt_bias(dtb, d)
    h0 = _training_state(initial_state, d, state_required)
    lb = _real(lower_bound, "lower_bound")
    if not math.isfinite(lb) or not (TRAINING_MIN_LOWER_BOUND <= lb < 0.0):
        raise ValueError(f"lower_bound must be a finite float in [-5, 0), got {lower_bound}")
    return A, dtb, h0, lb


def check_training_modes(
    use_gate_in_kernel: Any,
    lower_bound: Any,
    A_log: Any,
    dt_bias: Any,
    initial_state: Any,
    use_qk_l2norm_in_kernel: Any,
    beta_is_logit: Any,
    d: Dims,
    *,
    state_required: bool = True,
) -> tuple[int, torch.Tensor | None, torch.Tensor | None, torch.Tensor | None, float, bool, bool]:
    """The training family in every mode of recurrent_kda -> (gate_mode, A_log [HV] or None, dt_bias [HV, K]
    or None, initial_state, λ, use_qk_l2norm, beta_is_logit).

    ``use_gate_in_kernel=False``: g is the log-decay (precomputed gate); A_log and dt_bias must be None and
    ``lower_bound`` is not read (the training functions default it to -5.0). With the gate: A_log [HV]
    required, dt_bias [HV, K] / [HV*K] or None (0); ``lower_bound`` None selects the softplus gate, a float
    the lower-bound gate with λ in [-5, 0). Parameters in the parameter dtype (fp32; fp64 with fp64 tokens).
    """
    use_gate = _bool(use_gate_in_kernel, "use_gate_in_kernel")
    l2 = _bool(use_qk_l2norm_in_kernel, "use_qk_l2norm_in_kernel")
    logit = _bool(beta_is_logit, "beta_is_logit")
    A = _opt_tensor(A_log, "A_log")
    dtb = _opt_tensor(dt_bias, "dt_bias")
    lb = 0.0
    if not use_gate:
        _check_no_gate_params(A, dtb)
        mode = GATE_PRECOMPUTED
    else:
        if A is None:
            raise ValueError(f"A_log must be a [HV] {param_dtype(d)} tensor with use_gate_in_kernel=True, got None")
        _training_A_log(A, d)
        if dtb is not None:
            dtb = _training_dt_bias(dtb, d)
        if lower_bound is None:
            mode = GATE_SOFTPLUS
        else:
            mode = GATE_LOWER_BOUND
            lb = _real(lower_bound, "lower_bound")
            if not math.isfinite(lb) or not (TRAINING_MIN_LOWER_BOUND <= lb < 0.0):
                raise ValueError(
                    f"lower_bound must be a finite float in [-5, 0) or None (softplus gate), got {lower_bound}"
                )
    h0 = _training_state(initial_state, d, state_required)
    return mode, A, dtb, h0, lb, l2, logit


# ---------------------------------------------------------------------------------------------------
# state pools and index tensors


def pool_dtypes(d: Dims) -> tuple[torch.dtype, ...]:
    """Pool (initial_state / initial_state_source) dtypes: bf16 or fp32; also fp64 on CPU."""
    return POOL_DTYPES_CUDA if d.on_cuda else POOL_DTYPES_CPU


def check_unmodified(t: torch.Tensor | None, saved_version: int | None, name: str, why: str) -> None:
    """RuntimeError if `t` was modified in place since its version counter read `saved_version`."""
    if t is not None and saved_version is not None and t._version != saved_version:
        raise RuntimeError(
            f"{name} must be unmodified between the forward and the backward ({why}), got version "
            f"{t._version}, saved at version {saved_version} (modified in place)"
        )


def check_pool(t: Any, name: str, d: Dims) -> torch.Tensor:
    """A state pool [N_pool, HV, V, K]: compact [HV, V, K] block per slot, slot stride a multiple of 16
    elements when padded (docs/contract.md "API")."""
    return check_pool_span(t, name, d)[0]


def check_pool_span(t: Any, name: str, d: Dims) -> tuple[torch.Tensor, int]:
    """check_pool, and the byte length of the pool's memory span: ((N_pool-1) * slot stride + HV*V*K)
    elements (0 when empty), so that the overlap check needs only its data_ptr."""
    s = _tensor(t, name)
    if s.device != d.device:
        _device(s, name, d.device)
    on_cuda = d.on_cuda
    dtype = s.dtype
    if dtype not in (POOL_DTYPES_CUDA if on_cuda else POOL_DTYPES_CPU):
        _dtype(s, name, pool_dtypes(d))
    shape = s.shape
    if len(shape) != 4:
        _rank(s, name, 4, "[N_pool, HV, V, K]")
    HV, V, K = d.HV, d.V, d.K
    if shape[1] != HV or shape[2] != V or shape[3] != K:
        raise ValueError(f"{name} must have shape [N_pool, HV, V, K] = [*, {HV}, {V}, {K}], got {_shape(s)}")
    inner = HV * V * K
    st = s.stride()
    compact = st[3] == 1 and st[2] == K and st[1] == V * K
    n_pool = shape[0]
    if n_pool > 1 and compact:
        st0 = st[0]
        compact = st0 == inner or (st0 > inner and st0 % 16 == 0)
    if not compact:
        raise ValueError(
            f"{name} must have a compact [HV, V, K] block per slot and a slot stride of HV*V*K={inner} or a larger "
            f"multiple of 16 elements, got strides {list(st)}"
        )
    if on_cuda and n_pool > 0:  # check_aligned, inlined (n_pool > 0: the pool is not empty)
        tp = type(s)
        if (tp is _Tensor or tp is _Parameter) and not torch.compiler.is_compiling() and s.data_ptr() % 16 != 0:
            raise ValueError(f"{name} must start at a 16-byte aligned address on CUDA, got {hex(s.data_ptr())}")
    # The extent of the strides (as _span computes it), in bytes.
    span = ((n_pool - 1) * st[0] + inner) * _ITEMSIZE[dtype] if n_pool > 0 else 0
    return s, span


def check_aligned(t: torch.Tensor, name: str, d: Dims) -> None:
    """CUDA kernels move states in 16-byte vectors: the base address must be 16-byte aligned."""
    if not d.on_cuda or torch.compiler.is_compiling() or type(t) not in _PLAIN:
        return
    if t.numel() > 0 and t.data_ptr() % 16 != 0:
        raise ValueError(f"{name} must start at a 16-byte aligned address on CUDA, got {hex(t.data_ptr())}")


def check_index(t: Any, name: str, shape: tuple[Any, ...], layout: str, d: Dims) -> torch.Tensor:
    """An int32 index tensor of the given shape on the device of q, returned contiguous.

    A strided view (``idx[::2]``, a column of a 2-D tensor) is accepted and copied into a contiguous
    tensor here: index tensors are tiny (N or N*(1+S) int32), the copy is one small kernel, and the ops
    read plain arrays. Under CUDA graph capture the copy is captured with the call (it reads the view's
    current values at every replay into a buffer of the graph's pool, so the op sees a stable pointer);
    contiguous inputs pass through untouched.
    """
    if (
        isinstance(t, torch.Tensor)
        and t.dtype == torch.int32
        and t.device == d.device
        and t.shape == shape
        and t.is_contiguous()
    ):
        return t
    # Something is wrong (or strided): redo the checks one by one, in order, for the error that names it.
    x = _tensor(t, name)
    _device(x, name, d.device)
    _dtype(x, name, (torch.int32,))
    _rank(x, name, len(shape), layout)
    _exact_shape(x, name, shape, layout)
    return x.contiguous()


# ---------------------------------------------------------------------------------------------------
# overlap


def _span(t: torch.Tensor) -> tuple[int, int] | None:
    if t.numel() == 0:
        return None
    extent = sum((s - 1) * st for s, st in zip(t.shape, t.stride(), strict=True))
    lo = t.data_ptr()
    return lo, lo + (extent + 1) * t.element_size()


def _plain_spans(
    names: tuple[str, ...], tensors: tuple[torch.Tensor | None, ...], nbytes: tuple[Any, ...] | None = None
) -> list[tuple[str, int, int]]:
    """(name, first byte, one past the last byte) of each non-empty plain tensor of ``tensors`` (None, a
    FakeTensor or another subclass has no memory to compare and is left out). ``nbytes[i]``, when given
    and not None, is the byte count of ``tensors[i]`` known to be contiguous; otherwise contiguous
    tensors span data_ptr + nbytes and others the extent of their strides (_span)."""
    res = []
    for n, o, nb in zip(names, tensors, nbytes or _NONES, strict=False):
        if o is None:
            continue
        tp = type(o)
        if tp is not _Tensor and tp is not _Parameter:
            continue
        if nb is None:
            if not o.is_contiguous():
                sp = _span(o)
                if sp is not None:
                    res.append((n, sp[0], sp[1]))
                continue
            nb = o.nbytes
        if nb:
            lo = o.data_ptr()
            res.append((n, lo, lo + nb))
    return res


def check_no_overlap(name: str, t: torch.Tensor, others: list[tuple[str, torch.Tensor | None]]) -> None:
    """ValueError when the memory span of ``t`` intersects the span of any other tensor (same device).

    Spans are [first byte, last byte] of each view, so two interleaved views of one buffer count as
    overlapping: a conservative rule, in line with docs/contract.md "API" ("must not overlap any input").
    Skipped while tracing (FakeTensors have no memory).
    """
    if torch.compiler.is_compiling() or type(t) not in _PLAIN or t.is_meta:
        return
    a = _span(t)
    if a is None:
        return
    for oname, o in others:
        if o is None or o.device != t.device or type(o) not in _PLAIN:
            continue
        b = _span(o)
        if b is not None and a[0] < b[1] and b[0] < a[1]:
            raise ValueError(f"{name} must not overlap {oname} in memory, got overlapping storage")


_NONES = (None,) * 16
_NO_SPAN = ("", 0, 0)  # a span that intersects nothing (lo < 0 never holds)


def check_writes_no_overlap(
    write_names: tuple[str, ...],
    writes: tuple[torch.Tensor | None, ...],
    read_names: tuple[str, ...],
    reads: tuple[torch.Tensor | None, ...],
    d: Dims,
    write_nbytes: tuple[Any, ...] | None = None,
    read_nbytes: tuple[Any, ...] | None = None,
) -> None:
    """``check_no_overlap`` for up to 3 written tensors at once, each span computed once.

    Every tensor given must already be validated to be on ``d.device`` (so no per-pair device test).
    Written tensor i is checked against every read, then against the written tensors after it, and the
    first intersection raises ``ValueError("<write> must not overlap <other> ...")``, exactly as calling
    ``check_no_overlap(write_i, reads + writes[i+1:])`` for i = 0, 1, ... would. Skipped while tracing
    and on the meta device (no memory). ``write_nbytes`` / ``read_nbytes`` (aligned with ``writes`` /
    ``reads``, entries may be None): the byte count of a tensor known to be contiguous (its memory is
    then [data_ptr, data_ptr + nbytes)), sparing two tensor queries.
    """
    if d.dev_type == "meta" or torch.compiler.is_compiling():
        return
    ws = _plain_spans(write_names, writes, write_nbytes)
    if not ws:
        return
    nw = len(ws)
    _, a0, b0 = ws[0]
    _, a1, b1 = ws[1] if nw > 1 else _NO_SPAN
    _, a2, b2 = ws[2] if nw > 2 else _NO_SPAN
    # One pass over the reads: each span against every write (unrolled). Only when something intersects
    # does the ordered search below run, for the error check_no_overlap would raise first.
    hit = False
    for o, nb in zip(reads, read_nbytes or _NONES, strict=False):
        if o is None:
            continue
        tp = type(o)
        if tp is not _Tensor and tp is not _Parameter:
            continue
        if nb is None:
            if not o.is_contiguous():
                sp = _span(o)
                if sp is not None:
                    lo, hi = sp
                    if (lo < b0 and a0 < hi) or (lo < b1 and a1 < hi) or (lo < b2 and a2 < hi):
                        hit = True
                        break
                continue
            nb = o.nbytes
        if nb:
            lo = o.data_ptr()
            hi = lo + nb
            if (lo < b0 and a0 < hi) or (lo < b1 and a1 < hi) or (lo < b2 and a2 < hi):
                hit = True
                break
    if not hit:  # only the writes among themselves can intersect: pairs (0, 1), (0, 2), (1, 2)
        if nw == 1 or not ((a0 < b1 and a1 < b0) or (a0 < b2 and a2 < b0) or (a1 < b2 and a2 < b1)):
            return
    rs = _plain_spans(read_names, reads) if hit else []
    for i, (name, lo, hi) in enumerate(ws):
        for others in (rs, ws[i + 1 :]):
            for oname, blo, bhi in others:
                if lo < bhi and blo < hi:
                    raise ValueError(f"{name} must not overlap {oname} in memory, got overlapping storage")


# ---------------------------------------------------------------------------------------------------
# recurrent_kda: flags, slots, source pool, scheduling hint, output, checkpoints
#
# Each check_* below is a function of the argument types, shapes, dtypes and devices only (plus the
# already-validated Dims); the few reads of VALUES (host cu_seqlens, seq_order, checkpoint starts) are
# the separate *_values helpers, called only where those values live on the host.


def check_flags(output_final_state: Any, use_qk_l2norm_in_kernel: Any, beta_is_logit: Any) -> None:
    """The three bool flags of recurrent_kda (one combined test on the common path)."""
    if not (
        isinstance(output_final_state, bool)
        and isinstance(use_qk_l2norm_in_kernel, bool)
        and isinstance(beta_is_logit, bool)
    ):
        _bool(output_final_state, "output_final_state")
        _bool(use_qk_l2norm_in_kernel, "use_qk_l2norm_in_kernel")
        _bool(beta_is_logit, "beta_is_logit")


def _spec_cu_values(cu_seqlens: torch.Tensor, S: int, d: Dims) -> None:
    """Host cu_seqlens of a packed speculative-decode call: steps of exactly 1+S tokens."""
    exp = torch.arange(d.N + 1, dtype=torch.int64) * (1 + S)
    if not torch.equal(cu_seqlens.to(torch.int64), exp):
        raise ValueError(f"cu_seqlens must step by 1+S={1 + S} in speculative decode, got {cu_seqlens.tolist()}")


def check_slots(
    num_spec_tokens: Any,
    ssm_state_indices: Any,
    num_accepted_tokens: Any,
    pool: torch.Tensor | None,
    cu_seqlens: torch.Tensor | None,
    d: Dims,
) -> tuple[int, torch.Tensor | None, int, torch.Tensor | None, int]:
    """Speculative decode and slot arguments -> (S, ssm_state_indices, its numel, num_accepted_tokens,
    slots to allocate).

    Slot rules (docs/contract.md, "Slots and checkpoints"): speculative decode (S >= 1) needs exactly 1+S
    tokens per sequence and an int32 [N, 1+S] ``ssm_state_indices``; without one, sequence n uses slots
    ``n*(1+S) ... n*(1+S)+S`` (FlashInfer's ``arange(N*(1+S)).reshape(N, 1+S)``), which a given pool
    must hold. Otherwise ``ssm_state_indices`` is int32 [N], ``num_accepted_tokens`` must be None, and
    implicit slots (sequence n -> slot n) need at least N slots. Slot indices without a pool (given, or
    the speculative default) mean a pool of zeros up to ``max(index) + 1`` slots (as FlashInfer does):
    the last value returned is that count (0: nothing to allocate). For given indices it is read on the
    host (a device sync on a GPU), so that case cannot be traced or captured.
    """
    S = 0 if num_spec_tokens is None else _int(num_spec_tokens, "num_spec_tokens")
    ssm_idx_numel = 0
    alloc = 0
    if S < 0:
        raise ValueError(f"num_spec_tokens must be >= 1 (or None/0 for no speculative decode), got {S}")
    if S > 0:
        if d.packed:
            if d.T != d.N * (1 + S):
                raise ValueError(
                    f"q must hold exactly 1+S={1 + S} tokens per sequence in speculative decode (T == N*(1+S) = "
                    f"{d.N * (1 + S)}), got T={d.T}"
                )
            if cu_seqlens is not None and host_values_available(cu_seqlens):
                _spec_cu_values(cu_seqlens, S, d)
        elif d.T != 1 + S:
            raise ValueError(f"q must have T == 1+S = {1 + S} tokens per row in speculative decode, got T={d.T}")
        ssm_idx_numel = d.N * (1 + S)
        if ssm_state_indices is None:
            if pool is not None and pool.shape[0] < ssm_idx_numel:
                raise ValueError(
                    f"initial_state must have at least N*(1+S)={ssm_idx_numel} slots in speculative decode without "
                    f"ssm_state_indices (sequence n uses slots n*(1+S) ... n*(1+S)+S), got N_pool={pool.shape[0]}; "
                    f"pass ssm_state_indices to map sequences to slots"
                )
            ssm_idx = torch.arange(ssm_idx_numel, dtype=torch.int32, device=d.device).view(d.N, 1 + S)
            alloc = ssm_idx_numel if pool is None else 0
        else:
            ssm_idx = check_index(ssm_state_indices, "ssm_state_indices", (d.N, 1 + S), "[N, 1+S]", d)
            alloc = _slots_without_pool(ssm_idx) if pool is None else 0
    else:
        if num_accepted_tokens is not None:
            raise ValueError(
                "num_accepted_tokens must be None without speculative decode (num_spec_tokens), got a tensor"
            )
        ssm_idx = None
        if ssm_state_indices is not None:
            ssm_idx = check_index(ssm_state_indices, "ssm_state_indices", (d.N,), "[N]", d)
            ssm_idx_numel = d.N
            alloc = _slots_without_pool(ssm_idx) if pool is None else 0
        elif pool is not None and pool.shape[0] < d.N:
            # Implicit slots (sequence n -> slot n) past the pool would silently make those sequences
            # inactive: with implicit slots that is a sizing mistake, not a request.
            raise ValueError(
                f"initial_state must have at least N={d.N} slots when ssm_state_indices is None (sequence n uses "
                f"slot n), got N_pool={pool.shape[0]}; pass ssm_state_indices to map sequences to slots"
            )
    n_acc = None
    if num_accepted_tokens is not None:
        n_acc = check_index(num_accepted_tokens, "num_accepted_tokens", (d.N,), "[N]", d)
    return S, ssm_idx, ssm_idx_numel, n_acc, alloc


def _slots_without_pool(idx: torch.Tensor) -> int:
    """max(index) + 1 (at least 1): the zero pool that ``ssm_state_indices`` without ``initial_state`` means."""
    if torch.compiler.is_compiling() or idx.device.type == "meta" or capturing(idx.device):
        raise ValueError(
            "ssm_state_indices without a state pool (initial_state=None) sizes a pool of zeros from max(index) + 1, "
            "a host read that cannot run under torch.compile or CUDA graph capture; pass initial_state"
        )
    if idx.numel() == 0:
        return 1
    return max(int(idx.max()) + 1, 1)


def check_source(
    initial_state_source: Any, initial_state_indices: Any, d: Dims
) -> tuple[torch.Tensor | None, torch.Tensor | None, int | None]:
    """The read-only source pool and its indices, given together -> (source, indices, source span bytes)."""
    if (initial_state_source is None) != (initial_state_indices is None):
        given, missing = (
            ("initial_state_source", "initial_state_indices")
            if initial_state_indices is None
            else ("initial_state_indices", "initial_state_source")
        )
        raise ValueError(f"{missing} must be given together with {given}, got None")
    if initial_state_source is None:
        return None, None, None
    source, source_nbytes = check_pool_span(initial_state_source, "initial_state_source", d)
    src_idx = check_index(initial_state_indices, "initial_state_indices", (d.N,), "[N]", d)
    return source, src_idx, source_nbytes


def check_seq_order(seq_order: Any, d: Dims) -> torch.Tensor | None:
    """The scheduling hint: packed input only, an int32 [N] permutation (values checked on the host)."""
    if seq_order is None:
        return None
    if not d.packed:
        raise ValueError("seq_order must be None for fixed-length input (no cu_seqlens), got a tensor")
    order = check_index(seq_order, "seq_order", (d.N,), "[N]", d)
    check_permutation(order, d.N)
    return order


def check_output(output: Any, d: Dims) -> tuple[torch.Tensor, int | None]:
    """recurrent_kda's caller ``output`` -> (output, its byte count when known contiguous and non-empty)."""
    out = output if isinstance(output, torch.Tensor) else _tensor(output, "output")
    if out.device != d.device:
        _device(out, "output", d.device)
    if out.dtype != d.dtype:
        raise TypeError(f"output must be {d.dtype} (the dtype of q), got {out.dtype}")
    if out.shape != (d.B, d.T, d.HV, d.V):
        _exact_shape(out, "output", (d.B, d.T, d.HV, d.V), "[B, T, HV, V]")
    out_nbytes = None
    if d.B * d.T == 0 or not out.is_contiguous():  # (an empty tensor is "contiguous" whatever its strides)
        _lastdim_contiguous(out, "output")
    elif d.token_nbytes is not None:
        out_nbytes = d.token_nbytes[2]  # v's: same shape and dtype
    return out, out_nbytes


def check_checkpoints(
    checkpoint_every_n_tokens: Any,
    state_checkpoints: Any,
    checkpoint_cu_starts: Any,
    pool: torch.Tensor | None,
    S: int,
    d: Dims,
) -> tuple[int, torch.Tensor | None, torch.Tensor | None, torch.dtype]:
    """Checkpoint arguments -> (n, state_checkpoints, checkpoint_cu_starts, checkpoint dtype).

    n = 0 (off) or a positive multiple of 16; not in speculative decode; the buffers only with n > 0:
    state_checkpoints [C, HV, V, K] contiguous in the state dtype (the pool's, fp32 without one),
    checkpoint_cu_starts int64 [N+1] contiguous (values: :func:`checkpoint_starts_values`).
    """
    n_ck = checkpoint_every_n_tokens
    if type(n_ck) is not int:
        n_ck = _int(n_ck, "checkpoint_every_n_tokens")
    ck_dtype = torch.float32 if pool is None else pool.dtype
    ck = ck_starts = None
    if n_ck < 0 or n_ck % CHECKPOINT_MULTIPLE != 0:
        raise ValueError(f"checkpoint_every_n_tokens must be 0 or a positive multiple of 16, got {n_ck}")
    if n_ck == 0:
        if state_checkpoints is not None or checkpoint_cu_starts is not None:
            for t, name in ((state_checkpoints, "state_checkpoints"), (checkpoint_cu_starts, "checkpoint_cu_starts")):
                if t is not None:
                    raise ValueError(f"{name} must be None without checkpoint_every_n_tokens > 0, got a tensor")
        return n_ck, None, None, ck_dtype
    if S > 0:
        raise ValueError(f"checkpoint_every_n_tokens must be 0 in speculative decode (num_spec_tokens={S}), got {n_ck}")
    if state_checkpoints is not None:
        ck = _tensor(state_checkpoints, "state_checkpoints")
        _device(ck, "state_checkpoints", d.device)
        # Without a pool a bf16 buffer is accepted too (FlashInfer writes it in bf16): the caller converts.
        if ck.dtype != ck_dtype and not (pool is None and ck.dtype == torch.bfloat16):
            raise TypeError(
                f"state_checkpoints must be {ck_dtype} (the state dtype: the pool's; fp32 or bf16 without one), "
                f"got {ck.dtype}"
            )
        _rank(ck, "state_checkpoints", 4, "[C, HV, V, K]")
        if tuple(ck.shape[1:]) != (d.HV, d.V, d.K):
            raise ValueError(
                f"state_checkpoints must have shape [C, HV, V, K] = [*, {d.HV}, {d.V}, {d.K}], got {_shape(ck)}"
            )
        _contiguous(ck, "state_checkpoints")
        check_aligned(ck, "state_checkpoints", d)
    if checkpoint_cu_starts is not None:
        ck_starts = _tensor(checkpoint_cu_starts, "checkpoint_cu_starts")
        _device(ck_starts, "checkpoint_cu_starts", d.device)
        _dtype(ck_starts, "checkpoint_cu_starts", (torch.int64,))
        _exact_shape(ck_starts, "checkpoint_cu_starts", (d.N + 1,), "[N+1]")
        _contiguous(ck_starts, "checkpoint_cu_starts")
    return n_ck, ck, ck_starts, ck_dtype


def checkpoint_starts(d: Dims, n: int, cu_seqlens: torch.Tensor | None, exact: bool) -> tuple[torch.Tensor, Any]:
    """(checkpoint_cu_starts int64 [N+1] on the device of q, C rows).

    Row counts are ceil(L_i / n) per sequence (docs/contract.md, "Slots and checkpoints"). Fixed layout:
    pure shape math. Packed and ``exact``: lengths read on the host (a device sync when cu_seqlens is on a
    GPU), C exact. Packed and not ``exact`` (torch.compile, CUDA graph capture): starts by a device
    cumsum, C = T//n + N, an upper bound from shapes (spare rows are never written).
    """
    if cu_seqlens is None:
        per = (d.T + n - 1) // n
        starts = torch.arange(d.B + 1, dtype=torch.int64, device=d.device) * per
        return starts, d.B * per
    if exact:
        cu = cu_seqlens.to("cpu", torch.int64)
        lens = (cu[1:] - cu[:-1]).clamp_min(0)
        starts = torch.zeros(d.N + 1, dtype=torch.int64)
        starts[1:] = torch.cumsum((lens + n - 1) // n, 0)
        return starts.to(d.device), int(starts[-1])
    cu = cu_seqlens.to(torch.int64)
    lens = (cu[1:] - cu[:-1]).clamp_min(0)
    starts = torch.cat([cu.new_zeros(1), torch.cumsum((lens + n - 1) // n, 0)])
    return starts, d.T // n + d.N


def checkpoint_rows(d: Dims, n: int, ck_starts: torch.Tensor, exact: bool) -> Any:
    """Rows C of the checkpoints for given starts: fixed B*ceil(T/n); packed the last start when it can be
    read (``exact``), else the shape bound T//n + N."""
    if not d.packed:
        return d.B * ((d.T + n - 1) // n)
    if exact:
        return int(ck_starts[-1])
    return d.T // n + d.N


def checkpoint_starts_values(ck_starts: torch.Tensor, n: int, cu_seqlens: torch.Tensor | None, d: Dims) -> None:
    """Host values of a caller's checkpoint_cu_starts: the cumsum of ceil(L_i / n) (when both it and
    cu_seqlens can be read without a sync)."""
    if host_values_available(ck_starts) and (not d.packed or host_values_available(cu_seqlens)):
        expected, _ = checkpoint_starts(d, n, cu_seqlens, True)
        if not torch.equal(expected.cpu(), ck_starts):
            raise ValueError(
                f"checkpoint_cu_starts must be the cumsum of ceil(L_i / {n}) = {expected.tolist()}, "
                f"got {ck_starts.tolist()}"
            )


def check_instance(x: Any, cls: type, name: str) -> None:
    """``x`` is a kda_ops object of class ``cls`` (a workspace or a training context)."""
    if not isinstance(x, cls):
        raise TypeError(f"{name} must be a kda_ops.{cls.__name__}, got {_type_name(x)}")


def check_capture_allocation(capturing: bool) -> None:
    """A captured recurrent_kda call must not allocate its scratch: the workspace must be planned."""
    if capturing:
        raise RuntimeError(
            "prefill_workspace must be given (planned by an eager call of the same shapes) under CUDA graph "
            "capture, got None"
        )


# ---------------------------------------------------------------------------------------------------
# training family: host mirror, output buffers, context, gradients

GRAD_NAMES = ("dq", "dk", "dv", "dg", "dbeta", "dA_log", "ddt_bias", "dinitial_state")


def tape_rows(B: Any, T: Any, packed: bool) -> Any:
    """Rows of the training tapes, an upper bound from shapes (no row for the state before token 0: fixed
    B*(ceil(T/64) - 1), packed T//64; docs/design.md "Tapes")."""
    if packed:
        return T // TAPE_CHUNK
    return B * max((T + TAPE_CHUNK - 1) // TAPE_CHUNK - 1, 0)


def check_cu_seqlens_cpu(cu_seqlens_cpu: Any, cu_seqlens: torch.Tensor | None, d: Dims) -> torch.Tensor | None:
    """The host mirror of a packed call's cu_seqlens (CPU int64 [N+1], values checked, and equal to
    cu_seqlens when that is on the host too); None passes."""
    if cu_seqlens_cpu is None:
        return None
    if not d.packed:
        raise ValueError("cu_seqlens_cpu must be None for fixed-length input (no cu_seqlens), got a tensor")
    host = _tensor(cu_seqlens_cpu, "cu_seqlens_cpu")
    if host.device.type != "cpu":
        raise RuntimeError(f"cu_seqlens_cpu must be on cpu, got {host.device}")
    _dtype(host, "cu_seqlens_cpu", (torch.int64,))
    _exact_shape(host, "cu_seqlens_cpu", (d.N + 1,), "[N+1]")
    _cu_values(host, d.T, "cu_seqlens_cpu")
    if (
        cu_seqlens is not None
        and host_values_available(cu_seqlens)
        and not torch.equal(cu_seqlens.to(torch.int64), host)
    ):
        raise ValueError(f"cu_seqlens_cpu must equal cu_seqlens {cu_seqlens.tolist()}, got {host.tolist()}")
    return host


def check_training_cu(
    d: Dims, cu_seqlens: torch.Tensor | None, cu_seqlens_cpu: Any, mirror: str
) -> tuple[torch.Tensor | None, torch.Tensor | None]:
    """cu_seqlens as int64 on the device of q, and the validated host mirror.

    mirror: "required-on-cuda" (training forward: packed CUDA calls need ``cu_seqlens_cpu``; CPU calls may
    give it, and then it must equal ``cu_seqlens``) or "none" (no mirror argument).
    """
    if cu_seqlens is None:
        if cu_seqlens_cpu is not None:
            raise ValueError("cu_seqlens_cpu must be None for fixed-length input (no cu_seqlens), got a tensor")
        return None, None
    cu64 = cu_seqlens if cu_seqlens.dtype == torch.int64 else cu_seqlens.to(torch.int64)
    if mirror == "none":
        return cu64, None
    host = None
    if cu_seqlens_cpu is None:
        if d.on_cuda:
            raise ValueError(
                "cu_seqlens_cpu must be a CPU int64 copy of cu_seqlens for packed input on CUDA (used for host-side "
                "planning without a sync), got None"
            )
    else:
        host = _tensor(cu_seqlens_cpu, "cu_seqlens_cpu")
        if host.device.type != "cpu":
            raise RuntimeError(f"cu_seqlens_cpu must be on cpu, got {host.device}")
        _dtype(host, "cu_seqlens_cpu", (torch.int64,))
        _exact_shape(host, "cu_seqlens_cpu", (d.N + 1,), "[N+1]")
        if host_values_available(host):
            _cu_values(host, d.T, "cu_seqlens_cpu")
            if host_values_available(cu_seqlens) and not torch.equal(cu64, host):
                raise ValueError(f"cu_seqlens_cpu must equal cu_seqlens {cu_seqlens.tolist()}, got {host.tolist()}")
    return cu64, host


def check_out_tensor(
    t: Any, name: str, shape: tuple[Any, ...], layout: str, dtype: torch.dtype, d: Dims
) -> torch.Tensor:
    """A caller buffer of exactly ``shape`` and ``dtype`` on the device of q."""
    x = _tensor(t, name)
    _device(x, name, d.device)
    if x.dtype != dtype:
        raise TypeError(f"{name} must be {dtype}, got {x.dtype}")
    _exact_shape(x, name, shape, layout)
    return x


def training_reads(q, k, v, g, beta, A, dtb, h0, cu_seqlens, *extra: tuple[str, Any]) -> list[tuple[str, Any]]:
    """(name, tensor) of everything a training call reads, for the output-overlap checks."""
    reads = [("q", q), ("k", k), ("v", v), ("g", g), ("beta", beta), ("A_log", A), ("dt_bias", dtb)]
    return reads + [("initial_state", h0), *extra, ("cu_seqlens", cu_seqlens)]


def check_forward_outs(
    out: Any, final_state_out: Any, reads: list[tuple[str, Any]], d: Dims
) -> tuple[torch.Tensor | None, torch.Tensor | None]:
    """The training forward's ``out`` [B, T, HV, V] and ``final_state_out`` [N, HV, V, K] buffers: types
    and shapes of both first, so that the overlap test only ever sees checked tensors."""
    pdt = param_dtype(d)
    if out is not None:
        out = check_out_tensor(out, "out", (d.B, d.T, d.HV, d.V), "[B, T, HV, V]", d.dtype, d)
    if final_state_out is not None:
        final_state_out = check_out_tensor(
            final_state_out, "final_state_out", (d.N, d.HV, d.V, d.K), "[N, HV, V, K]", pdt, d
        )
    if out is not None:
        check_no_overlap("out", out, reads + [("final_state_out", final_state_out)])
    if final_state_out is not None:
        check_no_overlap("final_state_out", final_state_out, reads)
    return out, final_state_out


def check_context_out(context_out: Any, cls: type, shapes: tuple[tuple[Any, ...] | None, ...], d: Dims) -> None:
    """A training context to refill: of class ``cls``, holding tensors of ``shapes`` (q, k, v, g, beta,
    A_log, dt_bias, the tapes [tape_rows, HV, V, K], the tape starts [N+1]) and tapes of the state dtype
    on the device of q."""
    check_instance(context_out, cls, "context_out")
    expected = (*shapes, (tape_rows(d.B, d.T, d.packed), d.HV, d.V, d.K), (d.N + 1,))
    if context_out.shapes() != expected:
        raise ValueError(f"context_out must hold tensors of shapes {expected}, got {context_out.shapes()}")
    pdt = param_dtype(d)
    if context_out.tapes.device != d.device or context_out.tapes.dtype != pdt:
        raise ValueError(
            f"context_out must hold {pdt} tapes on {d.device}, got {context_out.tapes.dtype} on "
            f"{context_out.tapes.device}"
        )


def _grad_specs(d: Dims) -> list[tuple[str, tuple[Any, ...], str, torch.dtype]]:
    pdt = param_dtype(d)
    return [
        ("dq", (d.B, d.T, d.H, d.K), "[B, T, H, K]", d.dtype),
        ("dk", (d.B, d.T, d.H, d.K), "[B, T, H, K]", d.dtype),
        ("dv", (d.B, d.T, d.HV, d.V), "[B, T, HV, V]", d.dtype),
        ("dg", (d.B, d.T, d.HV, d.K), "[B, T, HV, K]", d.dtype),
        ("dbeta", (d.B, d.T, d.HV), "[B, T, HV]", d.dtype),
        ("dA_log", (d.HV,), "[HV]", pdt),
        ("ddt_bias", (d.HV, d.K), "[HV, K]", pdt),
        ("dinitial_state", (d.N, d.HV, d.V, d.K), "[N, HV, V, K]", pdt),
    ]


def check_grad_outs(
    out: Any, d: Dims, reads: list[tuple[str, torch.Tensor | None]], absent: tuple[int, ...] = ()
) -> list[torch.Tensor | None] | None:
    """Eight caller gradient buffers (shapes and dtypes as returned), overlapping nothing read or each other.

    ``absent``: indices of gradients the call returns as None (dA_log without A_log, ddt_bias without
    dt_bias); their entries must be None."""
    if out is None:
        return None
    if not isinstance(out, Sequence) or isinstance(out, torch.Tensor):
        raise TypeError(f"out must be a sequence of 8 tensors ({', '.join(GRAD_NAMES)}), got {_type_name(out)}")
    if len(out) != 8:
        raise ValueError(f"out must hold 8 tensors ({', '.join(GRAD_NAMES)}), got {len(out)}")
    res: list[torch.Tensor | None] = []
    for i, (t, (name, shape, layout, dtype)) in enumerate(zip(out, _grad_specs(d), strict=True)):
        if i in absent:
            if t is not None:
                raise ValueError(
                    f"out[{i}] ({name}) must be None: this gate mode has no {name[1:]} parameter, so no {name}"
                )
            res.append(None)
        else:
            res.append(check_out_tensor(t, f"out[{i}] ({name})", shape, layout, dtype, d))
    for i, t in enumerate(res):
        if t is None:
            continue
        others: list[tuple[str, torch.Tensor | None]] = [(f"out[{j}]", o) for j, o in enumerate(res) if j != i]
        check_no_overlap(f"out[{i}] ({GRAD_NAMES[i]})", t, reads + others)
    return res


def check_do(do: Any, dfinal_state: Any, d: Dims) -> tuple[torch.Tensor, torch.Tensor | None]:
    """``do`` [B, T, HV, V] in q's dtype and ``dfinal_state`` [N, HV, V, K] in the state dtype (or None),
    returned contiguous."""
    dO = _tensor(do, "do")
    _device(dO, "do", d.device)
    if dO.dtype != d.dtype:
        raise TypeError(f"do must be {d.dtype} (the dtype of q), got {dO.dtype}")
    _exact_shape(dO, "do", (d.B, d.T, d.HV, d.V), "[B, T, HV, V]")
    dS = _opt_tensor(dfinal_state, "dfinal_state")
    if dS is not None:
        _device(dS, "dfinal_state", d.device)
        pdt = param_dtype(d)
        if dS.dtype != pdt:
            raise TypeError(f"dfinal_state must be {pdt} (the state dtype), got {dS.dtype}")
        _exact_shape(dS, "dfinal_state", (d.N, d.HV, d.V, d.K), "[N, HV, V, K]")
    return dO.contiguous(), None if dS is None else dS.contiguous()


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
    decode, the token) inactive — zero output, no state read or write (docs/contract.md "Slots and checkpoints"). Pass
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


# ---------------------------------------------------------------------------------------------------
# context parallelism (kda_ops/distributed.py)


def check_context_parallel_local(
    q, k, v, g, beta, A_log, dt_bias, initial_state, scale, lower_bound, use_gate_in_kernel=True,
    use_qk_l2norm_in_kernel=True, beta_is_logit=True,
):  # type: ignore[no-untyped-def]  # fmt: skip
    """The local checks of context_parallel_kda (before the first collective): a packed batch [1, T_local, ...] in
    every training mode of :func:`kda_ops.kda` (check_training_modes), initial_state [N, HV, V, K] of the state
    dtype (N: the global sequences, checked with cu_seqlens). Returns (dims, A_log or None, dt_bias or None,
    initial_state, scale, the training keywords (scale, lower_bound and the modes), state dtype)."""
    d = check_tokens(q, k, v, g, beta, None, kv_rule="training")
    if d.B != 1:
        raise ValueError(f"q must have B == 1 (a packed batch: [1, T_local, H, K]), got B={d.B}")
    gm, A, dtb, _, lb, l2, logit = check_training_modes(
        use_gate_in_kernel, lower_bound, A_log, dt_bias, None, use_qk_l2norm_in_kernel, beta_is_logit, d,
        state_required=False,
    )  # fmt: skip
    sc = check_scale(scale, d.K)
    pdt = param_dtype(d)
    h0 = _opt_tensor(initial_state, "initial_state")
    if h0 is not None:
        _device(h0, "initial_state", d.device)
        _dtype(h0, "initial_state", (pdt,), f" (the state dtype for {d.dtype} tokens)")
        _rank(h0, "initial_state", 4, "[N, HV, V, K]")
        if tuple(h0.shape[1:]) != (d.HV, d.V, d.K):
            raise ValueError(
                f"initial_state must have shape [N, HV, V, K] = [N, {d.HV}, {d.V}, {d.K}], got {_shape(h0)}"
            )
    kw = dict(
        scale=sc, lower_bound=lb if gm == GATE_LOWER_BOUND else None, use_gate_in_kernel=gm != GATE_PRECOMPUTED,
        use_qk_l2norm_in_kernel=l2, beta_is_logit=logit,
    )  # fmt: skip
    return d, A, dtb, h0, sc, kw, pdt


def check_context_parallel_cu(cu_seqlens: Any, h0: torch.Tensor | None = None) -> list[int]:
    """context_parallel_kda's global cu_seqlens as host ints (a tensor is read back: a sync on a GPU), checked;
    and initial_state's rows against them."""
    if isinstance(cu_seqlens, torch.Tensor):
        if cu_seqlens.dtype not in (torch.int32, torch.int64):
            raise TypeError(f"cu_seqlens must be int32 or int64, got {cu_seqlens.dtype}")
        _rank(cu_seqlens, "cu_seqlens", 1, "[N+1]")
        cu = [int(x) for x in cu_seqlens.cpu().tolist()]  # host values plan the split (a sync on a GPU)
    elif isinstance(cu_seqlens, list | tuple) and all(isinstance(x, int) for x in cu_seqlens):
        cu = list(cu_seqlens)
    else:
        raise TypeError(
            f"cu_seqlens must be an int tensor or a list of ints [N+1] (global over all ranks), got "
            f"{_type_name(cu_seqlens)}"
        )
    if len(cu) < 2:
        raise ValueError(f"cu_seqlens must have at least 2 entries ([N+1], N >= 1), got {len(cu)}")
    if cu[0] != 0:
        raise ValueError(f"cu_seqlens must start at 0, got {cu[0]}")
    for i in range(len(cu) - 1):
        if cu[i + 1] < cu[i]:
            raise ValueError(
                f"cu_seqlens must be non-decreasing, got cu_seqlens[{i}]={cu[i]} > cu_seqlens[{i + 1}]={cu[i + 1]}"
            )
    if h0 is not None and h0.shape[0] != len(cu) - 1:
        raise ValueError(
            f"initial_state must have N={len(cu) - 1} rows (one per global sequence of cu_seqlens), got {_shape(h0)}"
        )
    return cu


def check_bool(x: Any, name: str) -> bool:
    """A Python or numpy bool argument, as a bool (TypeError otherwise)."""
    return _bool(x, name)
