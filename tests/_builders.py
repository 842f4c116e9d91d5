"""Shared builders of the reliability tests (tests/test_validation_catalogue.py, test_guard_bands.py,
test_device_contracts.py, test_determinism.py, test_stress.py and tests/gpu/test_reliability_gpu.py):
random inputs, byte snapshots, the rejection check, a valid training-family call, tensors carved out of
sentinel-filled buffers, and the stress-call generator. Counts (inputs tried, errors checked) go to
``STATS`` and are printed at the end of each module (``pytest -s``).
"""

from __future__ import annotations

import collections
import math
import random
import re
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import pytest
import torch
from _raw_ops import strided_copy
from conftest import assert_close_rms, assert_output, state_tol
from hypothesis import HealthCheck
from hypothesis import strategies as st

import kda_ops
from kda_ops.reference import recurrent_kda_reference
from kda_ops.workspace import RecurrentKDATrainingContext

STATS: collections.Counter = collections.Counter()
HSET = dict(deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow])
R = kda_ops.recurrent_kda
TF = kda_ops.recurrent_kda_training_forward
TB = kda_ops.recurrent_kda_training_backward
RB = kda_ops.recurrent_kda_backward
KDA = kda_ops.kda


# ---------------------------------------------------------------------------------------------------
# inputs, byte snapshots, rejections


def _tensors(obj: Any):
    """Every tensor reachable from an argument (lists, dicts, training contexts)."""
    if isinstance(obj, torch.Tensor):
        yield obj
    elif isinstance(obj, list | tuple):
        for o in obj:
            yield from _tensors(o)
    elif isinstance(obj, dict):
        for o in obj.values():
            yield from _tensors(o)
    elif isinstance(obj, RecurrentKDATrainingContext):
        fields = ("q", "k", "v", "g", "beta", "A_log", "dt_bias", "tapes", "tape_cu_starts", "initial_state")
        for f in (*fields, "cu_seqlens"):
            t = getattr(obj, f)
            if t is not None:
                yield t


def token_args(x: dict, **extra: Any) -> dict:
    """The eight tensor arguments of an ``inputs(...)`` dict (q, k, v, g, beta, A_log, dt_bias,
    initial_state) as keyword arguments, ``extra`` added on top."""
    kw = {n: x[n] for n in ("q", "k", "v", "g", "beta", "A_log", "dt_bias", "initial_state")}
    kw.update(extra)
    return kw


def lower_bound_call(x: dict, **extra: Any) -> dict:
    """recurrent_kda keyword arguments from an ``inputs(...)`` dict: token_args with the lower-bound gate
    (lambda = -5) and logit beta; ``extra`` added on top."""
    return token_args(x, use_gate_in_kernel=True, lower_bound=-5.0, beta_is_logit=True, **extra)


def raw_bytes(t: torch.Tensor) -> torch.Tensor:
    """The bytes of a tensor's elements, on CPU (NaN-safe bitwise comparison). Unlike a ``contiguous()``
    based copy this also works for size-1 dims with odd strides."""
    c = torch.empty(tuple(t.shape), dtype=t.dtype)
    c.copy_(t.detach())
    return c.reshape(-1).view(torch.uint8) if c.dtype != torch.bool else c.reshape(-1).to(torch.uint8)


def _snap(objs: list) -> list[tuple[torch.Tensor, torch.Tensor | None]]:
    out = []
    for t in objs:
        out.append((t, None if t.device.type == "meta" else raw_bytes(t)))
    return out


def _unchanged(snap) -> None:
    for i, (t, b) in enumerate(snap):
        if b is not None:
            assert torch.equal(
                b, raw_bytes(t)
            ), f"tensor #{i} {tuple(t.shape)} {t.dtype} was modified by a rejected call"


def _names_in(msg: str, names: tuple[str, ...]) -> bool:
    """True when the message names one of ``names`` as a word (not inside another identifier)."""
    for n in names:
        if re.search(r"(?<![A-Za-z0-9_])" + re.escape(n) + r"(?![A-Za-z0-9_])", msg):
            return True
    return False


def expect_rejection(fn: Callable, kw: dict, exc: type[Exception], names: tuple[str, ...], args: tuple = ()) -> str:
    """Calls fn(*args, **kw): it must raise exactly `exc` naming one of `names`, leaving every tensor
    bit-identical. Returns the message."""
    snap = _snap(list(_tensors(args)) + list(_tensors(kw)))
    try:
        fn(*args, **kw)
    except Exception as e:  # noqa: BLE001 - the type is asserted below
        err = e
    else:
        raise AssertionError(f"expected {exc.__name__} naming {names}, the call succeeded")
    msg = str(err)
    assert type(err) is exc, f"expected {exc.__name__} naming {names}, got {type(err).__name__}: {msg}"
    assert _names_in(msg, names), f"message does not name any of {names}: {msg}"
    _unchanged(snap)
    STATS["errors_checked"] += 1
    return msg


class Pick:
    """Choices drawn through hypothesis (shrinkable, reproducible)."""

    def __init__(self, data):
        self.data = data

    def one(self, xs):
        xs = list(xs)
        return self.data.draw(st.sampled_from(xs))

    def int(self, lo: int, hi: int) -> int:
        return self.data.draw(st.integers(lo, hi))

    def coin(self, p_true: float = 0.5) -> bool:
        if p_true <= 0:
            return False
        if p_true >= 1:
            return True
        n = max(2, round(1 / min(p_true, 1 - p_true)))
        hit = self.data.draw(st.integers(0, n - 1)) == 0
        return hit if p_true <= 0.5 else not hit


def _randn(gen: torch.Generator, shape, dtype, device="cpu", s: float = 1.0) -> torch.Tensor:
    return (torch.randn(*shape, generator=gen) * s).to(dtype).to(device)


def _cu(lengths: list[int], dtype=torch.int64, device="cpu") -> torch.Tensor:
    c = [0]
    for n in lengths:
        c.append(c[-1] + n)
    return torch.tensor(c, dtype=dtype, device=device)


def _noncontig_last(t: torch.Tensor) -> torch.Tensor:
    """The same values with a last-dim stride of 2."""
    buf = torch.zeros(*t.shape[:-1], 2 * t.shape[-1], dtype=t.dtype, device=t.device)
    v = buf[..., ::2]
    v.copy_(t)
    return v


def _noncontig_1d(t: torch.Tensor) -> torch.Tensor:
    flat = torch.zeros(2 * t.numel(), dtype=t.dtype, device=t.device)
    v = flat[::2]
    v.copy_(t.reshape(-1))
    if t.dim() == 1:
        return v
    return v.as_strided(t.shape, [2 * s for s in t.contiguous().stride()])


def _bigger(t: torch.Tensor, dim: int, by: int = 1) -> torch.Tensor:
    shape = list(t.shape)
    shape[dim] += by
    return torch.zeros(shape, dtype=t.dtype, device=t.device)


def _wrong_dtype(t: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    if dtype == torch.bool:
        return t != 0
    return t.to(dtype)


FLOATS = (torch.bfloat16, torch.float16, torch.float32, torch.float64)


# ---------------------------------------------------------------------------------------------------
# a valid call of the training family (training forward / backward, recurrent_kda_backward, kda)


@dataclass
class TCfg:
    packed: bool
    B: int
    T: int
    lengths: list[int] | None
    H: int
    HV: int
    K: int
    V: int
    dtype: torch.dtype
    flat_dt_bias: bool
    cu_dtype: torch.dtype
    mirror: bool  # training forward: pass cu_seqlens_cpu
    out: bool  # output buffers
    dfinal: bool
    state: bool  # kda(): initial_state given
    seed: int

    @property
    def N(self) -> int:
        return len(self.lengths) if self.packed else self.B

    @property
    def pdt(self) -> torch.dtype:
        return torch.float64 if self.dtype == torch.float64 else torch.float32


def t_inputs(c: TCfg) -> dict:
    gen = torch.Generator().manual_seed(c.seed)
    B, T, H, HV, K, V, N = c.B, c.T, c.H, c.HV, c.K, c.V, c.N
    kw: dict[str, Any] = dict(
        q=_randn(gen, (B, T, H, K), c.dtype),
        k=_randn(gen, (B, T, H, K), c.dtype),
        v=_randn(gen, (B, T, HV, V), c.dtype),
        g=_randn(gen, (B, T, HV, K), c.dtype),
        beta=_randn(gen, (B, T, HV), c.dtype),
        A_log=(torch.rand(HV, generator=gen) * 0.5).to(c.pdt),
        dt_bias=(torch.randn(HV * K if c.flat_dt_bias else (HV, K), generator=gen) * 0.1).to(c.pdt),
        initial_state=(torch.randn(N, HV, V, K, generator=gen) * 0.1).to(c.pdt),
    )
    if c.packed:
        kw["cu_seqlens"] = _cu(c.lengths, c.cu_dtype)
    if c.seed % 3 == 0:
        kw["scale"] = 0.3
    kw["lower_bound"] = (-5.0, -1.0, -0.01)[c.seed % 3]
    return kw


# ---------------------------------------------------------------------------------------------------
# tensors carved out of sentinel-filled buffers (guard bands)


INT_SENTINEL = -123456789


@dataclass
class Carved:
    """A view carved out of a 1-D buffer whose other elements are a sentinel (NaN for floats)."""

    view: torch.Tensor
    buf: torch.Tensor
    role: str  # "in": the whole buffer must stay bit-identical; "out": everything outside the view
    name: str
    before: torch.Tensor = field(init=False)

    def __post_init__(self) -> None:
        self.before = raw_bytes(self.buf)

    def region(self) -> torch.Tensor:
        n = self.buf.numel()
        m = torch.zeros(n, dtype=torch.bool)
        if self.view.numel():
            idx = torch.arange(n).as_strided(tuple(self.view.shape), self.view.stride(), self.view.storage_offset())
            m[idx.reshape(-1)] = True
        return m

    def check(self) -> None:
        now = raw_bytes(self.buf)
        if self.role == "in":
            assert torch.equal(now, self.before), f"{self.name}: an input buffer was modified"
            return
        es = self.buf.element_size()
        keep = ~self.region()
        a, b = now.view(-1, es)[keep], self.before.view(-1, es)[keep]
        bad = (a != b).any(1).nonzero()
        assert bad.numel() == 0, f"{self.name}: {bad.numel()} guard elements outside the view were written"
        STATS["guard_elements_checked"] += int(keep.sum())


def carve(
    src: torch.Tensor, name: str, role: str = "in", pads: dict[int, int] | None = None, lead: int = 16, tail: int = 16
) -> Carved:
    """A copy of `src` as a view of a larger sentinel-filled buffer: storage offset `lead` elements, stride of
    dim d padded by pads[d] elements (the last dim stays contiguous), `tail` sentinel elements after it."""
    fill = math.nan if src.dtype.is_floating_point else INT_SENTINEL
    view, buf = strided_copy(src, fill, pads, lead, tail)
    return Carved(view, buf, role, name)


def _plain(t: torch.Tensor) -> torch.Tensor:
    """A compact copy with the same values (the run without guards)."""
    return t.detach().clone(memory_format=torch.contiguous_format)


def _rand(gen, shape, dtype, device, s=1.0):
    return (torch.randn(*shape, generator=gen) * s).to(dtype).to(device)


def _dims(device: str) -> int:
    """Head dim of the device tests: the CUDA kernels take 64/128 (training: 128); CPU stays small."""
    return 128 if device == "cuda" else 16


def _dims_decode(device: str) -> int:
    """Head dim of the recurrent-only tests: 64 exercises the CUDA decode kernel's second size."""
    return 64 if device == "cuda" else 8


def _check_cuda_training(device: str) -> None:
    if device != "cuda":
        return
    if not torch._C._dispatch_has_kernel_for_dispatch_key("kda::recurrent_kda_training_forward", "CUDA"):
        pytest.skip("CUDA training ops not built")


def _skip_not_implemented(fn: Callable, *a, **kw):
    try:
        return fn(*a, **kw)
    except NotImplementedError as e:
        pytest.skip(f"not implemented on this device yet: {e}")


def carve_tokens(gen, B, T, H, HV, K, V, dt, device) -> list[Carved]:
    """q, k, v, g, beta (drawn from `gen` in that order) carved with padded head strides; beta with a padded
    token stride."""
    return [
        carve(_rand(gen, (B, T, H, K), dt, device), "q", pads={2: 8}),
        carve(_rand(gen, (B, T, H, K), dt, device), "k", pads={2: 8}),
        carve(_rand(gen, (B, T, HV, V), dt, device), "v", pads={2: 8}),
        carve(_rand(gen, (B, T, HV, K), dt, device), "g", pads={2: 8}),
        carve(_rand(gen, (B, T, HV), dt, device), "beta", pads={1: 3}),
    ]


def training_guard_inputs(device: str, K: int, packed: bool, seed: int = 3):
    gen = torch.Generator().manual_seed(seed)
    dt = torch.bfloat16  # the CUDA token dtype; the CPU path takes it too
    H, HV, V = 1, 2, K
    if packed:
        lengths = [5, 0, 70, 1]
        B, T, N = 1, sum(lengths), len(lengths)
    else:
        lengths = None
        B, T, N = 2, 67, 2
    carved = [
        *carve_tokens(gen, B, T, H, HV, K, V, dt, device),
        carve((torch.rand(HV, generator=gen) * 0.5).to(device), "A_log", lead=4),
        carve((torch.randn(HV, K, generator=gen) * 0.1).to(device), "dt_bias"),
        carve((torch.randn(N, HV, V, K, generator=gen) * 0.1).to(device), "initial_state", lead=64, tail=64),
    ]
    if packed:
        carved.append(carve(_cu(lengths, device=device), "cu_seqlens", lead=8, tail=8))
    do = carve(_rand(gen, (B, T, HV, V), dt, device), "do", pads={2: 8})
    dfinal = carve((torch.randn(N, HV, V, K, generator=gen) * 0.1).to(device), "dfinal_state", lead=32, tail=32)
    return carved, do, dfinal, (B, T, N, H, HV, K, V, dt)


# ---------------------------------------------------------------------------------------------------
# stress: mixed decode / prefill / packed / speculative calls on persistent pools


STRESS_POOL_SLOTS = 24


@dataclass
class StressState:
    device: str
    K_choices: tuple
    seed: int = 0
    pools: dict = field(default_factory=dict)
    stats: collections.Counter = field(default_factory=collections.Counter)

    def __post_init__(self) -> None:
        self.rng = random.Random(self.seed)
        self.gen = torch.Generator().manual_seed(self.seed)

    def pool(self, HV: int, K: int, pdt: torch.dtype) -> torch.Tensor:
        key = (HV, K, pdt)
        if key not in self.pools:
            self.pools[key] = (
                (torch.randn(STRESS_POOL_SLOTS, HV, K, K, generator=self.gen) * 0.1).to(pdt).to(self.device)
            )
        return self.pools[key]

    def make_all_pools(self) -> None:
        """Every pool the calls may use, up front (so that a later phase allocates no long-lived memory)."""
        for HV in (1, 2, 4):
            for K in self.K_choices:
                for pdt in (torch.float32, torch.bfloat16):
                    self.pool(HV, K, pdt)


def _stress_slots(r: random.Random, n: int, n_pool: int, p_inactive: float) -> list[int]:
    slots = r.sample(range(n_pool), n)
    return [-1 if r.random() < p_inactive else s for s in slots]


def stress_call(s: StressState, check: bool) -> None:
    """One random recurrent_kda call on the persistent pools; with `check`, compared against the fp64
    reference from the pre-call pool (outputs, written slots, checkpoints) and every other slot bit for bit."""
    r, dev = s.rng, s.device
    mode = r.choice(["decode", "decode", "prefill", "packed", "spec"])
    H = r.choice([1, 2])
    HV = H * r.choice([1, 2])
    K = r.choice(s.K_choices)
    pdt = r.choice([torch.float32, torch.bfloat16])
    gate = r.choice(["precomputed", "softplus", "lower_bound"])
    logit = r.random() < 0.5
    pool = s.pool(HV, K, pdt)
    n_pool = pool.shape[0]
    S, lengths, ckpt = 0, None, 0
    if mode == "decode":
        B, T = r.randint(1, 8), 1
    elif mode == "prefill":
        B, T = r.randint(1, 3), r.randint(1, 40)
        ckpt = 16 if r.random() < 0.25 else 0
    elif mode == "packed":
        lengths = [r.choice([0, 1, 2, r.randint(1, 70)]) for _ in range(r.randint(1, 5))]
        B, T = 1, sum(lengths)
        ckpt = 16 if r.random() < 0.25 else 0
    else:
        S = r.randint(1, 3)
        N_ = r.randint(1, 5)
        if r.random() < 0.5:
            lengths = [1 + S] * N_
            B, T = 1, N_ * (1 + S)
        else:
            B, T = N_, 1 + S
    N = B if lengths is None else len(lengths)
    g_ = s.gen
    dt = torch.bfloat16 if dev == "cuda" or r.random() < 0.7 else torch.float32
    q = _rand(g_, (B, T, H, K), dt, dev)
    k = _rand(g_, (B, T, H, K), dt, dev)
    v = _rand(g_, (B, T, HV, K), dt, dev)
    g = _rand(g_, (B, T, HV, K), dt, dev)
    if gate == "precomputed":
        g = (-torch.nn.functional.softplus(g.float())).to(dt)
    beta = _rand(g_, (B, T, HV), dt, dev) if logit else torch.rand(B, T, HV, generator=g_).to(dt).to(dev)
    kw: dict[str, Any] = dict(q=q, k=k, v=v, g=g, beta=beta, beta_is_logit=logit, initial_state=pool)
    if gate != "precomputed":
        kw.update(
            use_gate_in_kernel=True,
            A_log=(torch.rand(HV, generator=g_) * 0.5).to(dev),
            dt_bias=(torch.randn(HV, K, generator=g_) * 0.1).to(dev),
            lower_bound=-5.0 if gate == "lower_bound" else None,
        )
    if lengths is not None:
        kw["cu_seqlens"] = _cu(lengths, r.choice([torch.int32, torch.int64]), dev)
    if S:
        slots = _stress_slots(r, N * (1 + S), n_pool, 0.1)
        kw["num_spec_tokens"] = S
        kw["ssm_state_indices"] = torch.tensor(slots, dtype=torch.int32, device=dev).view(N, 1 + S)
        acc = [r.randint(0, S + 2) for _ in range(N)]
        kw["num_accepted_tokens"] = torch.tensor(acc, dtype=torch.int32, device=dev)
    else:
        slots = _stress_slots(r, N, n_pool, 0.15)
        kw["ssm_state_indices"] = torch.tensor(slots, dtype=torch.int32, device=dev)
    if ckpt:
        kw["checkpoint_every_n_tokens"] = ckpt
    before = pool.detach().cpu().clone() if check else None
    res = R(**kw)
    o = res[0]
    s.stats["calls"] += 1
    s.stats[f"mode_{mode}"] += 1
    s.stats["tokens"] += B * T
    if not check:
        return
    assert torch.isfinite(o.float()).all(), "non-finite output"
    after = pool.detach().cpu()
    cpu = lambda t: t.cpu() if isinstance(t, torch.Tensor) else t  # noqa: E731
    ref_kw = dict(
        use_gate_in_kernel=gate != "precomputed",
        lower_bound=kw.get("lower_bound"),
        beta_is_logit=logit,
        A_log=cpu(kw.get("A_log")),
        dt_bias=cpu(kw.get("dt_bias")),
    )
    o_c = o.cpu()
    bounds = (
        [(b, 0, T) for b in range(B)]
        if lengths is None
        else [(0, int(c0), L) for c0, L in zip(_cu(lengths)[:-1], lengths, strict=True)]
    )
    written: set[int] = set()
    exp_out = torch.zeros(o_c.shape, dtype=torch.float64)
    for n, (b, bos, L) in enumerate(bounds):
        if S:
            row = slots[n * (1 + S) : (n + 1) * (1 + S)]
            c = min(max(acc[n] - 1, 0), S)
            if not 0 <= row[c] < n_pool:
                continue
            active = [t for t in range(L) if 0 <= row[t] < n_pool]
            start = before[row[c]]
        else:
            if not 0 <= slots[n] < n_pool or L == 0:
                continue
            active = list(range(L))
            start = before[slots[n]]
        if not active:
            continue
        tk = {nm: cpu(kw[nm])[b, [bos + t for t in active]].unsqueeze(0) for nm in ("q", "k", "v", "g", "beta")}
        ref = recurrent_kda_reference(
            **tk, **ref_kw, initial_state=start.unsqueeze(0), return_all_states=True, checkpoint_every_n_tokens=ckpt
        )
        for j, t in enumerate(active):
            exp_out[b, bos + t] = ref.output[0, j]
        if S:
            for j, t in enumerate(active):
                written.add(row[t])
                if t == active[-1] or row[t] not in row[t + 1 :]:
                    assert_close_rms(after[row[t]], ref.all_states[0][j], state_tol(pdt), f"spec slot {row[t]}")
        else:
            written.add(slots[n])
            assert_close_rms(after[slots[n]], ref.final_state[0], state_tol(pdt), f"slot {slots[n]}")
        if ckpt and not S:
            ck = res[2].cpu()
            per = [(L_ + ckpt - 1) // ckpt for _, _, L_ in bounds]
            first = sum(per[:n])
            assert_close_rms(ck[first : first + per[n]], ref.checkpoints[0], state_tol(pdt), "checkpoints")
    assert_output(o_c, exp_out, f"stress {mode} output")
    untouched = [i for i in range(n_pool) if i not in written]
    assert torch.equal(raw_bytes(after[untouched]), raw_bytes(before[untouched])), "a slot nobody writes changed"
    s.stats["checked"] += 1


def report_counts(tag: str) -> None:
    """Prints and clears the counts of one module (shown with ``pytest -s``)."""
    if STATS:
        print(f"\n[{tag}] " + ", ".join(f"{k}={v}" for k, v in sorted(STATS.items())))
        STATS.clear()


def counts_reporter(tag: str):
    """A module-scoped autouse fixture that reports the module's counts under `tag` when it ends
    (``_report_counts = counts_reporter("stress")`` at module level)."""

    @pytest.fixture(scope="module", autouse=True)
    def _report_counts():
        yield
        report_counts(tag)

    return _report_counts
