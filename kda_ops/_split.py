"""Exact sequence split of ``recurrent_kda`` prefill: long sequences over many SMs, no truncation.

The chunked prefill runs each (sequence, value head) as one chain on one SM, so a few heads of a long
sequence leave most SMs idle. Per value head the state map of a run of tokens is affine (S [V, K]):

    S_end = S_start · P + Q,   P = Π_t diag(exp(a_t)) (I - β_t k_t k_tᵀ)  [K, K]

so a sequence cut into segments 0..P_n-1 has exact segment start states from a short scan:

    S_0 = the sequence's start state,  S_1 = Q_0 (segment 0 run from S_0),
    S_{j+1} = S_j · P_j + Q_j           (j >= 1; Q_j from a zero start, P_j from the identity with v = 0)

Three calls of the same op on the same token tensors, segments as separate packed sequences (the
tokens of a sequence's segments are contiguous, so only cu_seqlens changes; each segment has its own row in
the passes' state tensors, picked with ssm_state_indices, and segments a pass does not need are inactive there):
  1. Q: segments 0..P_n-2 of every split sequence, segment 0 from the real start state, others from 0;
  2. P: segments 1..P_n-2, from the identity ([K, K] states) with v = 0 (head dim K);
  3. outputs and final states of every segment from the exact start states (the scan in between:
     ``torch.ops.kda.segment_state_scan_packed``, in fp32, over all sequences and heads at once: one launch
     on CUDA, one matmul per segment on the CPU).
Passes 1 and 2 are state-only calls (``output`` a 1-D empty tensor: the chunked kernel skips the output
product).
Short sequences are single segments of pass 3. Work: about 3x the unsplit tokens, on N·HV·P_n chains
instead of N·HV, so the split pays when N·HV is small against the SM count and the sequences are long.

The plan (:class:`_SegmentPlan`: the passes' cu_seqlens, pool rows and the scan's layout) is a handful of index
tensors made by torch ops of fixed shapes from a cu_seqlens tensor, so it can be made on either side:
  - host-known lengths (fixed layout, ``cu_seqlens`` on the host or its host mirror ``cu_seqlens_cpu``) and not
    captured: made on the host and copied in one pinned buffer, kept in a small LRU cache
    (:func:`_cached_plan`, 16 plans, keyed on the lengths, the segment length, the checkpoint period, the device
    and the current CUDA stream; only ever read, no data of a call);
  - lengths only on the device (a packed call as engines make it), or any call under CUDA graph capture: made on
    the device from ``cu_seqlens`` (about a dozen small kernels, no host sync), so a graph replayed with new
    ``cu_seqlens`` values runs the plan of those values. The segment length then comes from the token count (the
    spine plans all tokens as one sequence; auto takes such calls while N·HV fills at most a quarter of the SMs), and
    the plan has T // Ls + N rows, the unused ones zero-length segments at the end. A sequence shorter than a
    segment runs whole in the output pass.

Scope (everything else takes the unsplit path, results identical up to floating point):
  - prefill without speculative decode; checkpoints every n tokens when the
    segments can be a multiple of n (the output pass writes them, each segment at its own rows);
  - not under torch.compile tracing or FakeTensor/meta;
  - fixed layout with B > 1 only when the token tensors view as one packed row.
Supported: every gate mode, β logits or not, L2 norm or not, GQA, a pool (bf16/fp32, any slot stride)
with or without ``ssm_state_indices`` (inactive slots: zero output, slot untouched), a read-only
``initial_state_source`` (read once, never written), ``output=``, the returned fp32 final state without a
pool. The pool is read once (before any write) and written once. Under capture the scratch (the segment states,
Q and P) comes from the graph's memory pool, as every op's outputs do.

Training (``torch.ops.kda.kda_forward`` / ``kda_backward``, the one op under :func:`kda_ops.kda` and its
autograd, kda_ops/_autograd.py; and :func:`kda_ops.recurrent_kda_training_forward`): the same three passes with the
training forward op (the output pass's per-segment tapes are returned in the unsplit layout), and a backward
of two training backward passes over the segments (:func:`backward_from_tapes`; the transitions recomputed
when the forward's are not at hand): G (zero end-state gradients), a reverse scan
``dS_end(j) = dS_end(j+1) P(j+1)ᵀ + G(j+1)``, then the gradients from the exact end-state gradients. Both
scans are one ``segment_state_scan`` each (fp32; fp64 states stay fp64) over a [maxP, M·HV] grid of the
split sequences' segments (:class:`_SegmentIndex`; the reverse one on each sequence's segments in reverse
order with Pᵀ), gathered from and scattered back to the segments' token order.

Route: whether a call splits and its segment length are decided by the routing spine
(``route_split`` in csrc/kda/route/route.cpp, asked through :func:`kda_ops._routing.split_segment_tokens`):
``KDA_SEQUENCE_SPLIT`` auto (default: CUDA calls whose cost model says the split pays), 0 (off), 1 (whenever
the scope allows and a sequence is longer than one segment, on any device); ``KDA_SEQUENCE_SPLIT_TOKENS`` forces
the segment length (docs/env.md). This module checks the scope and runs the plan.
"""

from __future__ import annotations

import math
import threading
from collections import OrderedDict
from typing import Any

import torch

from kda_ops import _routing
from kda_ops import _state_map as SM
from kda_ops import _validate as V

__all__ = ["try_run", "try_training_forward", "training_backward_from_context", "backward_from_tapes"]


SEGMENT_MULTIPLE = 64  # whole chunks of the chunked kernel per segment


def training_modes_covered(gate_mode: int, use_qk_l2norm: bool, beta_is_logit: bool, dt_bias: Any) -> bool:
    """The training modes the split covers: the default Kimi mode (lower-bound gate with dt_bias, L2 norm on q and
    k, logit β); the other modes run unsplit."""
    return gate_mode == V.GATE_LOWER_BOUND and use_qk_l2norm and beta_is_logit and dt_bias is not None


class _Plan:
    """Host plan of one training split call: its segments in token order (``cu``: their cu_seqlens), the segment
    count of each sequence and the split sequences (two or more segments: ``split_ids``, ``M`` of them, at most
    ``maxP`` segments each)."""

    def __init__(self, lens: list[int], Ls: int) -> None:
        self.lens, self.Ls = lens, Ls
        self.nseg = [max(1, -(-L // Ls)) for L in lens]  # zero-length: one empty segment
        self.split_ids = [n for n, p in enumerate(self.nseg) if p >= 2]
        self.M = len(self.split_ids)
        self.maxP = max((self.nseg[n] for n in self.split_ids), default=1)
        cu = [0]
        for L, P in zip(lens, self.nseg, strict=True):
            for j in range(P):
                cu.append(cu[-1] + (min(Ls, L - j * Ls) if P > 1 else L))
        self.cu = cu


class _SegmentPlan:
    """The prefill split's plan, as index tensors on the call's device (flat layout: one row per segment slot).

    Segments in token order, ``Ls`` tokens each (a sequence's last one shorter; a zero-length sequence one empty
    segment); ``slots`` rows, the first Σ nseg of them segments, the rest zero-length padding at the end of the
    tokens (a plan made on the device from device ``cu_seqlens`` only knows the bound T // Ls + N). Tensors:

      cu [slots + 1] int64        the segments' cu_seqlens (the passes' packed layout)
      q_rows, p_rows, o_rows      int32 [slots]: each pass's pool row of a segment (the segment's own slot), -1
                                  inactive: Q for segments 0 .. nseg-2, P for 1 .. nseg-2, outputs for all
      later_rows                  int32 [slots]: segments 1 .. nseg-1 (the one-pass route's P pass and fix-up)
      seq_of_seg [slots] int64    the sequence of each slot (padding: the last sequence; its o_row is -1)
      first, count [N] int64      each sequence's first segment and segment count (the packed scan's layout)
      final_rows [N] int64        each sequence's last segment
      ck_starts [slots + 1]       (checkpoints) each segment's first checkpoint row

    Built by :func:`_build_plan` from a cu_seqlens tensor with torch ops of fixed shapes (no host sync, so a
    captured graph replays the plan of its new cu_seqlens values), on the host (then copied, one buffer) when
    the lengths are known there. Only ever read: the op's cu_seqlens, ssm_state_indices and
    checkpoint_cu_starts are read-only arguments. Nothing of a call's data is kept."""

    NAMES = (
        "cu",
        "q_rows",
        "p_rows",
        "later_rows",
        "o_rows",
        "seq_of_seg",
        "first",
        "count",
        "final_rows",
        "ck_starts",
    )

    def __init__(self, Ls: int, slots: int, lens: list[int] | None, tensors: dict[str, torch.Tensor | None]) -> None:
        self.Ls, self.slots, self.lens = Ls, slots, lens
        self.cu: torch.Tensor
        self.q_rows: torch.Tensor
        self.p_rows: torch.Tensor
        self.later_rows: torch.Tensor
        self.o_rows: torch.Tensor
        self.seq_of_seg: torch.Tensor
        self.first: torch.Tensor
        self.count: torch.Tensor
        self.final_rows: torch.Tensor
        self.ck_starts: torch.Tensor | None
        for name in self.NAMES:
            setattr(self, name, tensors[name])
        # host lengths: whether any sequence has a middle segment (else no P pass and no scan step with P)
        self.needs_p = lens is None or any(-(-L // Ls) >= 3 for L in lens)

    @property
    def nseg(self) -> list[int]:
        """Each sequence's segment count (reads the device: for tests and diagnostics)."""
        return [int(c) for c in self.count.tolist()]

    @property
    def maxP(self) -> int:
        """The most segments of a sequence (reads the device: for tests and diagnostics)."""
        return max(self.nseg, default=1)


def _build_plan(cu: torch.Tensor, Ls: int, slots: int, n_ck: int) -> dict[str, torch.Tensor | None]:
    """The index tensors of :class:`_SegmentPlan` from ``cu`` (int64 [N + 1], any device), by torch ops of fixed
    shapes (capturable: no host sync, no data-dependent shape)."""
    dev, N = cu.device, cu.shape[0] - 1
    lens = cu[1:] - cu[:-1]
    nseg = torch.clamp(torch.div(lens + (Ls - 1), Ls, rounding_mode="floor"), min=1)
    ends = torch.cumsum(nseg, 0)
    first = ends - nseg
    s = torch.arange(slots, device=dev)
    seq = torch.searchsorted(ends, s, right=True)  # the sequence of each slot; N: padding
    real = seq < N
    sc = seq.clamp(max=N - 1)
    j = s - first.index_select(0, sc)  # the slot's segment index within its sequence
    cnt = nseg.index_select(0, sc)
    end = cu[N:]
    starts = torch.where(real, cu.index_select(0, sc) + j * Ls, end)
    s32 = s.to(torch.int32)
    neg = torch.full_like(s32, -1)
    t: dict[str, torch.Tensor | None] = {
        "cu": torch.cat([starts, end]),
        "q_rows": torch.where(real & (j <= cnt - 2), s32, neg),
        "p_rows": torch.where(real & (j >= 1) & (j <= cnt - 2), s32, neg),
        "later_rows": torch.where(real & (j >= 1), s32, neg),
        "o_rows": torch.where(real, s32, neg),
        "seq_of_seg": sc,
        "first": first,
        "count": nseg,
        "final_rows": ends - 1,
        "ck_starts": None,
    }
    if n_ck > 0:
        # segment j of sequence n writes the rows of its checkpoints: the sequence's first row + j Ls / n
        rows = torch.div(lens + (n_ck - 1), n_ck, rounding_mode="floor")
        seq_rows = torch.cat([torch.zeros(1, dtype=rows.dtype, device=dev), torch.cumsum(rows, 0)])
        ck = torch.where(real, seq_rows.index_select(0, sc) + j * (Ls // n_ck), seq_rows[N:])
        t["ck_starts"] = torch.cat([ck, seq_rows[N:]])
    return t


def _host_plan(lens: list[int], Ls: int, n_ck: int, device: torch.device) -> _SegmentPlan:
    """The plan of host-known lengths: built on the host, copied to the device in one buffer (pinned, queued on
    the stream: no host wait)."""
    cu = [0]
    for L in lens:
        cu.append(cu[-1] + L)
    slots = sum(max(1, -(-L // Ls)) for L in lens)
    t = _build_plan(torch.tensor(cu, dtype=torch.int64), Ls, slots, n_ck)
    if device.type == "cpu":
        return _SegmentPlan(Ls, slots, lens, t)
    names = [n for n in _SegmentPlan.NAMES if t[n] is not None]
    parts = [t[n].to(torch.int64) for n in names]  # type: ignore[union-attr]
    buf = torch.cat(parts).pin_memory().to(device, non_blocking=True)
    at, dev_t = 0, dict.fromkeys(_SegmentPlan.NAMES)
    for n, part in zip(names, parts, strict=True):
        view = buf[at : at + part.numel()]
        dev_t[n] = view.to(torch.int32) if t[n].dtype == torch.int32 else view  # type: ignore[union-attr]
        at += part.numel()
    return _SegmentPlan(Ls, slots, lens, dev_t)


def _device_plan(cu: torch.Tensor, tokens: int, Ls: int, n_ck: int) -> _SegmentPlan:
    """The plan of lengths that live on the device: built there (a dozen small kernels), with T // Ls + N slots.

    Unchecked values (a broken contract: docs/contract.md, Errors) are first made offsets in [0, T], non-decreasing
    (a running maximum), so the segments fit the slots and every index stays in range."""
    N = cu.shape[0] - 1
    slots = tokens // Ls + N
    cu = torch.cummax(cu.to(torch.int64).clamp(0, tokens), 0).values
    return _SegmentPlan(Ls, slots, None, _build_plan(cu, Ls, slots, n_ck))


# Plans of recent host-known split calls with their device index tensors, least recently used first. Keyed on the
# lengths, the segment length, the checkpoint period, the device and (CUDA) the current stream: an entry's tensors
# are copied to the device on the stream of its first call and used only on that stream (no cross-stream hazard
# when it is evicted and freed). Captured calls build their plan inside the graph instead (:func:`_device_plan`).
_PLAN_CACHE_SIZE = 16
_plan_cache: OrderedDict[tuple, _SegmentPlan] = OrderedDict()
_plan_cache_lock = threading.Lock()


def _cached_plan(lens: list[int], Ls: int, n_ck: int, device: torch.device) -> _SegmentPlan:
    """The plan of host-known lengths with its device index tensors, from the cache or new."""
    stream = torch.cuda.current_stream(device).stream_id if device.type == "cuda" else None
    key = (tuple(lens), Ls, n_ck, device, stream)
    with _plan_cache_lock:
        pl = _plan_cache.get(key)
        if pl is not None:
            _plan_cache.move_to_end(key)
            return pl
    pl = _host_plan(lens, Ls, n_ck, device)
    with _plan_cache_lock:
        _plan_cache[key] = pl
        while len(_plan_cache) > _PLAN_CACHE_SIZE:
            _plan_cache.popitem(last=False)
    return pl


def _host_lengths(d: V.Dims, cu_seqlens: torch.Tensor | None, cu_host: torch.Tensor | None) -> list[int] | None:
    if not d.packed:
        return [int(d.T)] * int(d.B)
    if cu_host is None and cu_seqlens is not None and V.host_values_available(cu_seqlens):
        cu_host = cu_seqlens
    if cu_host is None:
        return None  # lengths live on the device only: no sync here, no split
    c = [int(x) for x in cu_host.tolist()]
    return [c[i + 1] - c[i] for i in range(len(c) - 1)]


def _in_scope(d: V.Dims) -> bool:
    """Whether the split may take a call at all: the switch on, work to do, not meta / FakeTensor tracing (the
    tracing guard comes before any device query)."""
    if _routing.split_off() or d.N == 0 or d.B * d.T <= SEGMENT_MULTIPLE:
        return False
    return not (d.dev_type == "meta" or torch.compiler.is_compiling())


def _device_tensor(values: list[int], dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    if device.type == "cuda":  # pinned + non_blocking: a copy queued on the stream, no host wait
        return torch.tensor(values, dtype=dtype, pin_memory=True).to(device, non_blocking=True)
    return torch.tensor(values, dtype=dtype)


def _packed_view(x: torch.Tensor, B: int, T: int) -> torch.Tensor | None:
    if B == 1:
        return x
    try:
        return x.view(1, B * T, *x.shape[2:])
    except RuntimeError:
        return None


def try_run(
    d: V.Dims,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    A_hv: torch.Tensor | None,
    dtb_hv: torch.Tensor | None,
    pool: torch.Tensor | None,
    ssm_idx: torch.Tensor | None,
    cu_seqlens: torch.Tensor | None,
    cu_host: torch.Tensor | None,
    out: torch.Tensor,
    final: torch.Tensor | None,
    sc: float,
    gate_mode: int,
    lb: float,
    l2: bool,
    logit: bool,
    backend_code: int,
    n_ck: int = 0,
    ck: torch.Tensor | None = None,
    source: torch.Tensor | None = None,
    src_idx: torch.Tensor | None = None,
    zero_uncovered: bool = False,
) -> bool:
    """Runs a validated prefill call split into segments, writing ``out``, ``final`` (fp32 [N, HV, V, K]
    or None) and the pool exactly as the unsplit op would (``zero_uncovered``, an ``out`` the caller did not give:
    the tokens past ``cu_seqlens[-1]`` zeroed, as the unsplit op zeroes them). Returns False (nothing done) when
    the call is out of scope or the split would not pay; the caller then runs the unsplit op.

    The plan: from host lengths when the call has them (fixed layout, ``cu_seqlens`` on the host or its host
    mirror) and is not being captured (cached, :func:`_cached_plan`); else made on the device from ``cu_seqlens``
    (:func:`_device_plan`: a packed call as engines make it, eager or inside a CUDA graph that replays with new
    lengths), its segment length routed from the token count and the sequence count."""
    if type(q) is not torch.Tensor or not _in_scope(d):
        return False
    # checkpoints every n tokens: segments of a multiple of n tokens keep every checkpoint inside one
    # segment, at a row the segment's own checkpoint_cu_starts entry points to
    multiple = SEGMENT_MULTIPLE * n_ck // math.gcd(SEGMENT_MULTIPLE, n_ck) if n_ck > 0 else SEGMENT_MULTIPLE
    capturing = V.capturing(d.device)
    lens = _host_lengths(d, cu_seqlens, cu_host)
    views = [_packed_view(x, d.B, d.T) for x in (q, k, v, g, beta, out)]
    if any(x is None for x in views):
        return False
    if lens is not None:
        if max(lens) <= SEGMENT_MULTIPLE:
            return False
        Ls = _routing.split_segment_tokens(lens, d.HV, d.device, False, multiple)  # (the spine's split route)
    else:
        Ls = _routing.split_segment_tokens_device(d.B * d.T, d.N, d.HV, d.device, False, multiple)
    if Ls == 0:
        return False
    if lens is not None and not capturing:
        pl = _cached_plan(lens, Ls, n_ck, d.device)
    else:
        if cu_seqlens is None:  # fixed layout under capture: its cu_seqlens made inside the graph
            cu = torch.arange(d.B + 1, dtype=torch.int64, device=d.device) * d.T
        else:
            cu = cu_seqlens
        pl = _device_plan(cu, d.B * d.T, Ls, n_ck)
    q1, k1, v1, g1, b1, o1 = views
    _run(pl, d, q1, k1, v1, g1, b1, A_hv, dtb_hv, pool, ssm_idx, o1, final, sc, gate_mode, lb, l2, logit, backend_code,
         n_ck, ck, source, src_idx, zero_uncovered)  # fmt: skip
    return True


# The one-pass route (below), an experiment: off by default (it lost to the three passes in its first measurement,
# docs/performance.md); True runs it where it applies (tests run both routes on the CPU; on CUDA its fix-up kernel
# exists only in a KDA_BUILD_EXPERIMENTS=1 build).
ONE_PASS = False


def _one_pass_applies(d: V.Dims, out: torch.Tensor, n_ck: int) -> bool:
    """The one-pass route's scope: no checkpoints (they would need S_start P_c + Q_c inside segments), a contiguous
    output; on CUDA an experiments build and bf16 tokens with K and V multiples of 16 up to 128 (the fix-up
    kernel)."""
    if not ONE_PASS or n_ck > 0 or not out.is_contiguous():
        return False
    if d.dev_type != "cuda":
        return True
    shapes = d.dtype == torch.bfloat16 and d.K % 16 == 0 and d.V % 16 == 0 and d.K <= 128 and d.V <= 128
    return shapes and bool(_routing.knobs()["experiments_built"])


def _run(
    pl, d, q, k, v, g, beta, A, dtb, pool, ssm_idx, out, final, sc, gate_mode, lb, l2, logit, backend,
    n_ck=0, ck=None, source=None, src_idx=None, zero_uncovered=False,
):  # type: ignore[no-untyped-def]  # fmt: skip
    """Runs the plan: the three passes (module docstring), or the one-pass route where it is asked for and applies
    (:data:`ONE_PASS`, :func:`_one_pass_applies`).

    One pass (the "A-route"): segment j >= 1's outputs are O = O_local + A S_startᵀ, with O_local its outputs from
    a zero start and A its effective queries, the outputs of the transition pass (identity start, v = 0): the
    output of token t of that pass is P_t q_t-like, exactly what multiplies the start state. So
      1. Q pass with outputs: every segment from zero (segment 0 from the real start state: exact outputs), its
         outputs into ``out`` and its end state Q;
      2. P pass with outputs: segments 1 .. nseg-1 from the identity with v = 0, outputs A, end states P;
      3. the scan (start states, and each sequence's end state S_last P_last + Q_last);
      4. the fix-up, out += A S_startᵀ per later segment (``torch.ops.kda.segment_output_fixup``: tensor cores,
         the start state rounded to bf16 as the chunked kernels round theirs; out rounded twice).
    Two chunked passes instead of three."""
    op = torch.ops.kda.recurrent_kda.default
    dev, HV, K, Vd, N, R = d.device, d.HV, d.K, d.V, d.N, pl.slots
    f64 = d.dtype == torch.float64 or any(t is not None and t.dtype == torch.float64 for t in (pool, source))
    sdt = torch.float64 if f64 else torch.float32  # (fp64 only on the CPU path)
    one_pass = _one_pass_applies(d, out, n_ck)
    # passes 1 and 2 of the three-pass route need only end states: a 1-D empty output makes them state-only calls
    # (the chunked kernel skips the output product; the CPU loop and the token-serial kernels write a scratch
    # output)
    no_out = out.new_empty(0)

    # start states, read before anything is written (inactive sequences: zeros, never written back)
    # valid: active sequences (None: all); slot: each sequence's pool slot (clamped into the pool; None:
    # slot n); start0: the start states (None: all zero; a view of the pool when it is read in order)
    valid = slot = start0 = None
    if pool is not None and ssm_idx is not None:
        idx = ssm_idx.to(torch.int64)
        valid = (idx >= 0) & (idx < pool.shape[0])
        slot = torch.where(valid, idx, 0)
    if source is not None:  # start states from the read-only source (out of range: inactive)
        si = src_idx.to(torch.int64)
        ok = (si >= 0) & (si < source.shape[0])
        src_rows = source.index_select(0, torch.where(ok, si, 0))
        start0 = torch.where(ok.view(-1, 1, 1, 1), src_rows.to(sdt), 0.0)
        valid = ok if valid is None else valid & ok
    elif pool is not None and ssm_idx is None:
        start0 = pool[:N]
    elif pool is not None:
        start0 = torch.where(valid.view(-1, 1, 1, 1), pool.index_select(0, slot).to(sdt), 0.0)

    def active(rows: torch.Tensor) -> torch.Tensor:  # a pass's rows with inactive sequences' segments off
        return rows if valid is None else torch.where(valid.index_select(0, pl.seq_of_seg), rows, -1)

    # segment start states, one row per slot (the first segment's from the sequence's start state, the later ones
    # by the scan); Q: the offsets (end states from zero; the first segment from the start state); P: the
    # transitions (end states from the identity with v = 0)
    three = not one_pass
    states = (torch.zeros if start0 is None and three else torch.empty)((R, HV, Vd, K), dtype=sdt, device=dev)
    Qs = torch.zeros((R, HV, Vd, K), dtype=sdt, device=dev)
    if start0 is not None:
        start = start0.to(sdt)
        if three:
            states.index_copy_(0, pl.first, start)
        Qs.index_copy_(0, pl.first, start)
    q_rows, q_out = (active(pl.o_rows), out) if one_pass else (pl.q_rows, no_out)
    op(q, k, v, g, beta, A, dtb, Qs, None, None, pl.cu, q_rows, None, None, q_out, None, None, None, None, sc,
       gate_mode, lb, l2, logit, 0, 0, backend, one_pass and zero_uncovered)  # fmt: skip
    Aq = None
    if one_pass or pl.needs_p:
        Ps = SM.identity_states(R, HV, K, sdt, dev)
        v0 = torch.zeros((1, v.shape[1], HV, K), dtype=v.dtype, device=dev)
        if one_pass:
            Aq = torch.empty((1, v.shape[1], HV, K), dtype=out.dtype, device=dev)
        op(q, k, v0, g, beta, A, dtb, Ps, None, None, pl.cu, active(pl.later_rows) if one_pass else pl.p_rows, None,
           None, Aq if one_pass else no_out, None, None, None, None, sc, gate_mode, lb, l2, logit, 0, 0, backend,
           False)  # fmt: skip
    else:  # (host lengths, no middle segment: the scan reads no transition)
        Ps = torch.empty((R, HV, K, K), dtype=sdt, device=dev)
    # S[f + 1] = Q[f], S[f + j] = S[f + j - 1] P[f + j - 1] + Q[f + j - 1] (and the end states): one launch on CUDA
    if one_pass:
        fin = torch.empty((N, HV, Vd, K), dtype=sdt, device=dev)
        torch.ops.kda.segment_state_scan_packed(states, Qs, Ps, pl.first, pl.count, fin)
        T = out.shape[1]
        torch.ops.kda.segment_output_fixup(out.view(T, HV, Vd), Aq.view(T, HV, K), states, pl.cu,  # type: ignore[union-attr]
                                           active(pl.later_rows), pl.Ls)  # fmt: skip
    else:
        torch.ops.kda.segment_state_scan_packed(states, Qs, Ps, pl.first, pl.count)
        # pass 3: outputs and final states from the exact start states
        op(q, k, v, g, beta, A, dtb, states, None, None, pl.cu, active(pl.o_rows), None, None, out, None, ck,
           pl.ck_starts, None, sc, gate_mode, lb, l2, logit, 0, n_ck, backend, zero_uncovered)  # fmt: skip
        fin = states.index_select(0, pl.final_rows)

    if final is not None:  # (no pool) inactive sequences keep the zeros of the new final state
        final.copy_(fin if valid is None else torch.where(valid.view(-1, 1, 1, 1), fin, 0.0))
    if pool is not None:
        if valid is None:
            pool[:N].copy_(fin)
        else:
            # Every row writes its slot; an inactive row whose (clamped) slot is also written by an active
            # one writes that one's value, else the slot's own: identical values per slot, so the result
            # does not depend on the order of the writes.
            if slot is None:
                slot = torch.arange(N, device=dev)
            owner = torch.full((pool.shape[0],), -1, dtype=torch.int64, device=dev)
            ar = torch.arange(N, device=dev)
            owner.scatter_reduce_(0, slot, torch.where(valid, ar, -1), "amax")
            m = owner.index_select(0, slot)
            keep = pool.index_select(0, slot)
            vals = torch.where((m >= 0).view(-1, 1, 1, 1), fin.index_select(0, m.clamp_min(0)).to(pool.dtype), keep)
            pool.index_copy_(0, slot, vals)


# ---------------------------------------------------------------------------------------------------
# training: kda_ops.kda (forward and backward split the same way)


class _SegmentIndex:
    """Segments in token order and the grid of the training scans (host lists).

    The scans run over a [maxP, M·HV] grid of segments (``segment_state_scan``'s layout): segment j of
    split sequence m at row j, column m (grid position j·M + m); the cells past a sequence's last segment
    are padding (zeros, never read back)."""

    def __init__(self, pl: _Plan) -> None:
        self.first, self.last = [], []  # per sequence: its first and last segment (token order)
        s = 0
        for P in pl.nseg:
            self.first.append(s)
            self.last.append(s + P - 1)
            s += P
        self.nseg_total = s
        M = pl.M
        # the cells of the split sequences' segments, row-major (row 0 first: the first M entries), with
        # the segment of each cell in the forward scan (segment j at row j) and in the reverse scan (the
        # sequence's segments in reverse order: its last segment at row 0)
        self.grid_pos, self.fwd_seg, self.rev_seg = [], [], []
        for j in range(pl.maxP):
            for m, n in enumerate(pl.split_ids):
                if pl.nseg[n] > j:
                    self.grid_pos.append(j * M + m)
                    self.fwd_seg.append(self.first[n] + j)
                    self.rev_seg.append(self.last[n] - j)


def _scan_dtype(dt: torch.dtype) -> torch.dtype:
    """The scans accumulate in fp32 (fp64 states, CPU only, stay fp64)."""
    return torch.float64 if dt == torch.float64 else torch.float32


def _to_grid(x: torch.Tensor, pos: torch.Tensor, seg: torch.Tensor, mp: int, M: int, dt: torch.dtype,
             transpose: bool = False) -> torch.Tensor:  # fmt: skip
    """Segment rows ``x[seg]`` (transposed in the last two dims on request) at grid positions ``pos`` of a
    zero [mp, M·HV, ...] grid of dtype ``dt``."""
    rows = x.index_select(0, seg)
    if transpose:
        rows = rows.transpose(-1, -2)
    grid = torch.zeros((mp * M, *rows.shape[1:]), dtype=dt, device=x.device)
    grid.index_copy_(0, pos, rows.to(dt))
    return grid.view(mp, M * rows.shape[1], *rows.shape[2:])


def _train_fwd(q, k, v, g, beta, A, dtb, h0, cu, sc, lb):  # type: ignore[no-untyped-def]
    return torch.ops.kda.recurrent_kda_training_forward.default(q, k, v, g, beta, A, dtb, h0, cu, sc, lb)


def _transitions(toks, A, dtb, n, cu, sc, lb, pdt):  # type: ignore[no-untyped-def]
    """P [n, HV, K, K] of every segment (kda_ops/_state_map.py): the packed training forward from identities."""

    def end_states(q, k, v, g, beta, start):  # type: ignore[no-untyped-def]
        return _train_fwd(q, k, v, g, beta, A, dtb, start, cu, sc, lb)[1]

    return SM.transitions(end_states, *toks, n, pdt)


def _training_passes(q, k, v, g, beta, A, dtb, h0, pl, d, sc, lb):  # type: ignore[no-untyped-def]
    """The split training forward: (packed token views, o, final [N], segment tapes, their row starts,
    segment start states S, transitions P (None without split sequences), the segment index, cu)."""
    dev, HV, K, Vd, N = d.device, d.HV, d.K, d.V, d.N
    q1, k1, v1, g1, b1 = (_packed_view(x, d.B, d.T) for x in (q, k, v, g, beta))
    si = _SegmentIndex(pl)
    S_tot = si.nseg_total
    pdt = h0.dtype
    cu = _device_tensor(pl.cu, torch.int64, dev)
    first = _device_tensor(si.first, torch.int64, dev)
    h0c = h0.contiguous() if h0.stride(0) != 0 else torch.zeros((N, HV, Vd, K), dtype=pdt, device=dev)
    # Q pass: every segment, the first of each sequence from its real start state, the others from 0
    start_q = torch.zeros((S_tot, HV, Vd, K), dtype=pdt, device=dev)
    start_q.index_copy_(0, first, h0c)
    _, Qs, _, _ = _train_fwd(q1, k1, v1, g1, b1, A, dtb, start_q, cu, sc, lb)
    Ps = None
    if pl.M > 0:  # P pass (the backward needs the P of every segment but the first)
        Ps = _transitions((q1, k1, v1, g1, b1), A, dtb, S_tot, cu, sc, lb, pdt)
    S = start_q  # (read-only in the Q pass) the segment start states: the first from h0, the rest below
    if pl.M > 0:
        # scan over the grid of segments, all split sequences and heads at once: S_1 = Q_0, then
        # S_j = S_{j-1} P_{j-1} + Q_{j-1} (j >= 2) as one segment_state_scan
        M, mp, sdt = pl.M, pl.maxP, _scan_dtype(pdt)
        pos = _device_tensor(si.grid_pos, torch.int64, dev)
        seg = _device_tensor(si.fwd_seg, torch.int64, dev)
        Qg = _to_grid(Qs, pos, seg, mp, M, sdt)
        Sg = torch.empty_like(Qg)  # row 0 (the start states from h0) is never read: the scan starts at 2
        Sg[1] = Qg[0]
        if mp >= 3:
            assert Ps is not None
            SM.scan(Sg, Qg, _to_grid(Ps, pos, seg, mp, M, sdt), 2)
        # back to the segments: the cells of rows >= 1 (the entries after the first M)
        S.index_copy_(0, seg[M:], Sg.view(mp * M, HV, Vd, K).index_select(0, pos[M:]).to(pdt))
    # output pass from the exact start states (tapes per segment, for the backward)
    o, fs_seg, tapes, starts = _train_fwd(q1, k1, v1, g1, b1, A, dtb, S, cu, sc, lb)
    fs = fs_seg.index_select(0, _device_tensor(si.last, torch.int64, dev))
    return (q1, k1, v1, g1, b1), o, fs, tapes, starts, S, Ps, si, cu


def _backward_passes(toks, A, dtb, tapes, starts, S, cu, Ps, pl, si, d, do, dfs, sc, lb):  # type: ignore[no-untyped-def]
    """The split backward over the segments (packed views): the 8 gradients, dinitial_state per sequence."""
    q1, k1, v1, g1, b1 = toks
    dev, HV, K, Vd = d.device, d.HV, d.K, d.V
    do1 = do.reshape(v1.shape).contiguous()
    dS_end = torch.zeros((si.nseg_total, HV, Vd, K), dtype=S.dtype, device=dev)
    dS_end.index_copy_(0, _device_tensor(si.last, torch.int64, dev), dfs.contiguous())
    bwd = torch.ops.kda.recurrent_kda_training_backward.default
    if pl.M > 0:
        # G pass: every segment's start-state gradient with a zero end-state gradient
        zero = torch.zeros_like(dS_end)
        G = bwd(q1, k1, v1, g1, b1, A, dtb, tapes, starts, S, cu, do1, zero, sc, lb)[7]
        # reverse scan dS_end(j) = dS_end(j+1) P(j+1)ᵀ + G(j+1) as one segment_state_scan over the grid of
        # segments in reverse order (row r: segment P_m - 1 - r of split sequence m), from the final-state
        # gradients at row 0
        M, mp, sdt = pl.M, pl.maxP, _scan_dtype(S.dtype)
        pos = _device_tensor(si.grid_pos, torch.int64, dev)
        seg = _device_tensor(si.rev_seg, torch.int64, dev)
        Gg = _to_grid(G, pos, seg, mp, M, sdt)
        Dg = torch.empty_like(Gg)
        Dg[0] = dfs.index_select(0, _device_tensor(pl.split_ids, torch.int64, dev)).view(M * HV, Vd, K)
        SM.scan(Dg, Gg, _to_grid(Ps, pos, seg, mp, M, sdt, transpose=True), 1)
        dS_end.index_copy_(0, seg[M:], Dg.view(mp * M, HV, Vd, K).index_select(0, pos[M:]).to(dS_end.dtype))
    dq, dk, dv, dg, dbeta, dA, ddtb, dinit = bwd(q1, k1, v1, g1, b1, A, dtb, tapes, starts, S, cu, do1, dS_end, sc, lb)
    dh0 = dinit.index_select(0, _device_tensor(si.first, torch.int64, dev))
    return dq, dk, dv, dg, dbeta, dA, ddtb, dh0


def _plan_training(d, cu_seqlens, cu_host):  # type: ignore[no-untyped-def]
    if not _in_scope(d) or V.capturing(d.device):  # (first: its tracing guard precedes every device query)
        return None  # (the training passes copy fresh index tensors from host memory: not capturable)
    lens = _host_lengths(d, cu_seqlens, cu_host)
    if lens is None or max(lens) <= SEGMENT_MULTIPLE:
        return None
    Ls = _routing.split_segment_tokens(lens, d.HV, d.device, True)  # (the spine's split route)
    return _Plan(lens, Ls) if Ls > 0 else None


def try_training_forward(d, q, k, v, g, beta, A, dtb, h0, cu_seqlens, cu_host, sc, lb):  # type: ignore[no-untyped-def]
    """The split of :func:`kda_ops.recurrent_kda_training_forward`: ``(o, final_state, tapes,
    tape_cu_starts)`` exactly as the op returns them (the tapes in the unsplit layout, so the unsplit
    backward runs from them), or None (out of scope). Segments are whole 64-token chunks, so the state
    before a chunk is either a tape of its segment or, at a segment start, that segment's start state."""
    if type(q) is not torch.Tensor or any(_packed_view(x, d.B, d.T) is None for x in (q, k, v, g, beta)):
        return None
    pl = _plan_training(d, cu_seqlens, cu_host)
    if pl is None:
        return None
    _, o, fs, seg_tapes, _, S, Ps, si, _ = _training_passes(q, k, v, g, beta, A, dtb, h0, pl, d, sc, lb)
    C = V.TAPE_CHUNK
    per = pl.Ls // C  # chunks per segment
    seg_rows = [0]  # first tape row of each segment in the segment call (ceil(L/64) - 1 rows each)
    seg_len = [pl.cu[s + 1] - pl.cu[s] for s in range(si.nseg_total)]
    for L in seg_len:
        seg_rows.append(seg_rows[-1] + max(-(-L // C) - 1, 0))
    # Every unsplit tape row is a row of seg_tapes (in their order) or, at a segment start, that segment's start
    # state: two index_copy_ into the result, no intermediate copy of the tapes (they are the large tensor here).
    dst_seg, dst_start, start_seg = [], [], []
    starts = [0]
    for n, L in enumerate(pl.lens):
        for c in range(1, -(-L // C)):
            j, r = divmod(c, per)
            if r == 0:
                dst_start.append(starts[-1] + c - 1)
                start_seg.append(si.first[n] + j)
            else:
                dst_seg.append(starts[-1] + c - 1)
        starts.append(starts[-1] + max(-(-L // C) - 1, 0))
    assert len(dst_seg) == seg_rows[-1]  # (the segment call's rows, in order)
    rows = V.tape_rows(d.B, d.T, d.packed)
    tapes = torch.empty((rows, d.HV, d.V, d.K), dtype=h0.dtype, device=d.device)
    tapes[starts[-1] :].zero_()
    idx = _device_tensor(dst_seg + dst_start + start_seg, torch.int64, d.device)
    n_seg, n_start = len(dst_seg), len(dst_start)
    if n_seg:
        tapes.index_copy_(0, idx[:n_seg], seg_tapes[:n_seg].to(h0.dtype))
    if n_start:
        tapes.index_copy_(0, idx[n_seg : n_seg + n_start], S.index_select(0, idx[n_seg + n_start :]))
    tape_starts = _device_tensor(starts, torch.int64, d.device)
    # what the split backward needs beyond the tapes: the plan and the segments' transitions
    return o.view(v.shape), fs, tapes, tape_starts, (pl, Ps)


def training_backward_from_context(ctx, do, dfinal, saved):  # type: ignore[no-untyped-def]
    """The split backward of a context from a split :func:`try_training_forward` (``saved``: its plan and the
    segments' transitions). Returns the 8 gradients as the backward op does."""
    pl, Ps = saved
    d = V.check_tokens(ctx.q, ctx.k, ctx.v, ctx.g, ctx.beta, ctx.cu_seqlens, kv_rule="training")
    toks = (ctx.q, ctx.k, ctx.v, ctx.g, ctx.beta)
    return backward_from_tapes(
        d,
        *toks,
        ctx.A_log,
        ctx.dt_bias,
        ctx.tapes,
        ctx.initial_state,
        do,
        dfinal,
        ctx.scale,
        ctx.lower_bound,
        pl,
        Ps,
        ctx.state_dtype,
    )


def plan_training_backward(d, cu_seqlens):  # type: ignore[no-untyped-def]
    """The plan of a split backward from the unsplit-layout tapes (None: the unsplit backward op)."""
    return _plan_training(d, cu_seqlens, None)


def backward_from_tapes(d, q, k, v, g, beta, A, dtb, tapes_in, h0, do, dfinal, sc, lb, pl, Ps=None,
                        state_dtype=torch.float32):  # type: ignore[no-untyped-def]  # fmt: skip
    """The split backward from the tapes in the unsplit layout (the training forward op's, split or not: a
    segment start is a chunk boundary, so its start state is a tape row or the sequence's initial state) and
    the plan ``pl``: the segment tapes and start states are gathered from them, the segments' transitions
    recomputed when ``Ps`` is None (one packed forward from identities), then the two backward passes and the
    reverse scan. Returns the 8 gradients as the backward op does."""
    dev, HV, K, Vd, N = d.device, d.HV, d.K, d.V, d.N
    si = _SegmentIndex(pl)
    C = V.TAPE_CHUNK
    per = pl.Ls // C
    orig = [0]  # first unsplit tape row of each sequence
    for L in pl.lens:
        orig.append(orig[-1] + max(-(-L // C) - 1, 0))
    seg_src, seg_starts, start_src = [], [0], []  # rows of tapes_in (start_src: -1 - n = initial state n)
    for n, P in enumerate(pl.nseg):
        for j in range(P):
            s_ = si.first[n] + j
            L = pl.cu[s_ + 1] - pl.cu[s_]
            for r in range(1, -(-L // C)):
                seg_src.append(orig[n] + j * per + r - 1)
            seg_starts.append(len(seg_src))
            start_src.append(-1 - n if j == 0 else orig[n] + j * per - 1)
    rows = V.tape_rows(1, d.B * d.T, True)
    n_used = len(seg_src)
    tapes = torch.empty((rows, HV, Vd, K), dtype=tapes_in.dtype, device=dev)
    tapes[n_used:].zero_()
    if n_used:  # (gathered straight into the result: the tapes are the large tensor here)
        torch.index_select(tapes_in, 0, _device_tensor(seg_src, torch.int64, dev), out=tapes[:n_used])
    sdt = state_dtype if h0 is None else h0.dtype
    # segment start states: each sequence's initial state (zeros without one) or the tape row before the segment
    no_h0 = h0 is None or h0.stride(0) == 0  # (kda() passes zeros as a stride-0 view)
    S = (torch.zeros if no_h0 else torch.empty)((len(start_src), HV, Vd, K), dtype=sdt, device=dev)
    at_h0 = [(i, -1 - x) for i, x in enumerate(start_src) if x < 0]
    at_tape = [(i, x) for i, x in enumerate(start_src) if x >= 0]
    if not no_h0:
        pos, seq = _device_tensor([i for i, _ in at_h0] + [n for _, n in at_h0], torch.int64, dev).split(len(at_h0))
        S.index_copy_(0, pos, h0.reshape(N, HV, Vd, K).index_select(0, seq))
    if at_tape:
        pos, row = _device_tensor([i for i, _ in at_tape] + [r for _, r in at_tape], torch.int64, dev).split(
            len(at_tape)
        )
        S.index_copy_(0, pos, tapes_in.index_select(0, row).to(sdt))
    if no_h0:
        h0 = S  # (only its dtype is read below)
    toks = tuple(_packed_view(x, d.B, d.T) for x in (q, k, v, g, beta))
    cu = _device_tensor(pl.cu, torch.int64, dev)
    starts = _device_tensor(seg_starts, torch.int64, dev)
    if Ps is None and pl.M > 0:
        Ps = _transitions(toks, A, dtb, si.nseg_total, cu, sc, lb, h0.dtype)
    if dfinal is None:
        dfinal = torch.zeros((N, HV, Vd, K), dtype=h0.dtype, device=dev)
    do1 = torch.zeros(v.shape, dtype=v.dtype, device=dev) if do is None else do
    grads = _backward_passes(toks, A, dtb, tapes, starts, S, cu, Ps, pl, si, d, do1, dfinal, sc, lb)
    dq, dk, dv, dg, dbeta, dA, ddtb, dh0 = grads
    tg = [t.view(x.shape) for t, x in zip((dq, dk, dv, dg, dbeta), (q, k, v, g, beta), strict=True)]
    return (*tg, dA, ddtb, dh0)
