"""Public API of kda_ops (docs/contract.md "API"): argument normalisation, validation, routing to ``torch.ops.kda``.

Every function validates all of its arguments first (kda_ops/_validate.py) and only then calls an op,
so a rejected call leaves every tensor bit-identical (docs/contract.md "Errors").

The recurrence (docs/contract.md "Recurrence"), per sequence and value head hv (q/k head ``hv // (HV // H)``), all in
fp32:

    q_t, k_t = l2norm(q_t), l2norm(k_t)      x * rsqrt(sum(x^2) + 1e-6), when use_qk_l2norm_in_kernel
    q_t      = q_t * scale                    scale defaults to 1/sqrt(K)
    a_t      = g_t                            precomputed gate (log-decay, a K-vector)
             = -exp(A_log) * softplus(g_t + dt_bias)          softplus gate
             = λ * sigmoid(exp(A_log) * (g_t + dt_bias))      lower-bound gate, λ < 0
    β_t      = sigmoid(beta_t) if beta_is_logit else beta_t
    S        = S * exp(a_t)[None, :]          S is [V, K] (value-first)
    S        = S + β_t (v_t - S k_t) k_tᵀ
    o_t      = S q_t

Shapes (docs/contract.md "Notation"): q, k [B, T, H, K]; v [B, T, HV, V]; g [B, T, HV, K]; beta [B, T, HV];
o [B, T, HV, V]; A_log [HV]; dt_bias [HV, K]; states [N, HV, V, K] with K contiguous.
Packed input: B == 1 and cu_seqlens [N+1] (sequence n owns tokens cu[n]:cu[n+1]).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from kda_ops import _decode_fast, _routing, _split
from kda_ops import _validate as V
from kda_ops.workspace import (
    RecurrentKDABackwardWorkspace,
    RecurrentKDAPrefillWorkspace,
    RecurrentKDATrainingContext,
    prefill_workspace_bytes,
)

__all__ = [
    "recurrent_kda",
    "recurrent_kda_training_forward",
    "recurrent_kda_training_backward",
    "recurrent_kda_backward",
    "kda",
]

GRAD_NAMES = V.GRAD_NAMES

# The op handle, resolved once (torch.ops.kda.recurrent_kda.default is three attribute lookups, ~1 µs).
# kda_ops/__init__.py loads the op library (_C) before importing this module.
_recurrent_kda_op = torch.ops.kda.recurrent_kda.default
# What recurrent_kda writes and reads, in the order of the overlap checks (docs/contract.md "API", "Errors").
_NO_TOKEN_NBYTES = (None,) * 5
_WRITE_NAMES = ("output", "initial_state", "state_checkpoints")
_READ_NAMES = (
    "q",
    "k",
    "v",
    "g",
    "beta",
    "A_log",
    "dt_bias",
    "initial_state_source",
    "cu_seqlens",
    "ssm_state_indices",
    "num_accepted_tokens",
    "initial_state_indices",
    "seq_order",
    "checkpoint_cu_starts",
)


# ---------------------------------------------------------------------------------------------------
# recurrent_kda

# The eager decode fast path's validation cache (kda_ops/_decode_fast.py), its names bound here once: the hot path
# below reads them as module globals (no attribute lookup per call).
_Tensor = torch.Tensor
_tensor_call_key = _decode_fast.tensor_call_key
_FAST_CACHE = _decode_fast.CACHE
_remember = _decode_fast.remember
_recurrent_kda_cached = _decode_fast.run_cached


def recurrent_kda(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    A_log: torch.Tensor | None = None,
    dt_bias: torch.Tensor | None = None,
    scale: float | None = None,
    initial_state: torch.Tensor | None = None,
    output_final_state: bool = False,
    use_qk_l2norm_in_kernel: bool = True,
    use_gate_in_kernel: bool = False,
    lower_bound: float | None = None,
    cu_seqlens: torch.Tensor | None = None,
    ssm_state_indices: torch.Tensor | None = None,
    num_spec_tokens: int | None = None,
    num_accepted_tokens: torch.Tensor | None = None,
    output: torch.Tensor | None = None,
    initial_state_source: torch.Tensor | None = None,
    initial_state_indices: torch.Tensor | None = None,
    beta_is_logit: bool = False,
    seq_order: torch.Tensor | None = None,
    prefill_workspace: RecurrentKDAPrefillWorkspace | None = None,
    state_checkpoints: torch.Tensor | None = None,
    checkpoint_cu_starts: torch.Tensor | None = None,
    checkpoint_every_n_tokens: int = 0,
    *,
    backend: str = "auto",
    cu_seqlens_cpu: torch.Tensor | None = None,
    disable_state_update: bool = False,
) -> tuple[torch.Tensor, torch.Tensor | None] | tuple[torch.Tensor, torch.Tensor | None, torch.Tensor]:
    """KDA inference: decode (T=1), speculative decode (1+S tokens) and prefill (any T), fixed or packed,
    with an in-place state pool (docs/contract.md "API"; the signature of FlashInfer's ``recurrent_kda``).

    Computes the recurrence of docs/contract.md "Recurrence" token by token from each sequence's start state
    S [V, K] (per value head hv, q/k head hv // (HV // H)), all in fp32:

        q, k = l2norm(q), l2norm(k)     (x * rsqrt(sum x^2 + 1e-6), when use_qk_l2norm_in_kernel)
        q    = q * scale
        a    = g | -exp(A_log) softplus(g + dt_bias) | λ sigmoid(exp(A_log) (g + dt_bias))
               (log-decay per token in nats, a K-vector: precomputed / softplus / lower-bound gate)
        β    = sigmoid(beta) if beta_is_logit else beta
        S    = S diag(exp(a));  S = S + β (v - S k) kᵀ;  o = S q

    Args:
        q, k: [B, T, H, K]. v: [B, T, HV, V], HV % H == 0. g: [B, T, HV, K] (log-decay when
            ``use_gate_in_kernel=False``, else the raw gate input). beta: [B, T, HV] (β itself, or logits
            with ``beta_is_logit``). One dtype for all five: bf16 on CUDA; bf16, fp32 or fp64 on CPU.
            Last dim contiguous; other strides free. CUDA: K == V, 64 or 128 (128 only for
            ``backend="chunked"``); CPU: any K, V >= 1.
        A_log: fp32 [HV] (or [H] when HV != H: value head hv then uses entry hv // (HV // H)). Required by
            the in-kernel gate; must be None without it.
        dt_bias: fp32 [HV, K] or flat [HV*K] (or [H, K] / [H*K] when HV != H, expanded like A_log);
            optional with the in-kernel gate (None = 0), must be None without it.
        scale: q scale, a finite float > 0; None means 1/sqrt(K).
        initial_state: state pool [N_pool, HV, V, K], bf16 or fp32 (also fp64 on CPU), compact
            [HV, V, K] block per slot, slot stride HV*V*K or any larger multiple of 16 elements. Updated IN
            PLACE in its own dtype (fp32 math, rounded on write for bf16). None: start from zeros.
        output_final_state: with a pool, return the pool itself as ``final_state``; without one, return a
            new fp32 [N, HV, V, K] final state. False: ``final_state`` is None.
        use_qk_l2norm_in_kernel: L2-normalise q and k (eps 1e-6 inside the rsqrt) before scaling.
        use_gate_in_kernel: compute the log-decay from g, A_log, dt_bias (softplus gate, or lower-bound
            gate when ``lower_bound`` is given).
        lower_bound: λ < 0 (finite) of the lower-bound gate; None selects the softplus gate.
        cu_seqlens: int32/int64 [N+1] on the device of q, packed input (B == 1). Caller contract
            (checked here only when it is a CPU tensor): starts at 0, non-decreasing, ends at T.
            Zero-length sequences leave their slot bit-identical.
        ssm_state_indices: int32 [N] pool slot per sequence (default: slot n); in speculative decode
            int32 [N, 1+S]: the state after token t goes to slot [n, t]. A slot outside [0, N_pool) makes
            the sequence (spec decode: the token) inactive: zero output, no state read or write. Without
            ``initial_state`` (as FlashInfer): a pool of zeros with max(index) + 1 slots is allocated and
            returned as ``final_state`` (max read on the host: a sync on a GPU; not under torch.compile or
            graph capture). Any strides (index tensors are copied contiguous when strided).
        num_spec_tokens: S >= 1 for speculative decode (None or 0: off, deliberately: 0 is not an error).
            Every sequence has exactly 1+S tokens (fixed [B, 1+S, ...] or packed with T == N*(1+S)); no
            checkpoints. Without ``ssm_state_indices`` sequence n uses slots n*(1+S) ... n*(1+S)+S
            (FlashInfer's ``arange(N*(1+S)).reshape(N, 1+S)``), which a pool must hold; without a pool,
            N*(1+S) zero slots are allocated.
        num_accepted_tokens: int32 [N]: the start state is read from slot
            ``ssm_state_indices[n, clamp(num_accepted_tokens[n]-1, 0, S)]``. Spec decode only (None = 1).
        output: caller buffer of exactly v's shape and q's dtype, last dim contiguous, overlapping no input,
            the pool or the checkpoints; written in place and returned. Tokens of a packed call outside
            every sequence (a broken cu_seqlens contract) are left as they were. None: a new tensor, in
            which such tokens read as zero.
        initial_state_source: read-only pool [N0, HV, V, K] (bf16/fp32) the start states come from:
            ``initial_state_source[initial_state_indices[n]]`` (out of range: inactive). Results still go
            to the ``initial_state`` slots (or to the returned final state without a pool). Never written.
            Caller contract: the call does not write a slot it reads through this pool.
        initial_state_indices: int32 [N]; given exactly when ``initial_state_source`` is.
        beta_is_logit: β = sigmoid(beta).
        seq_order: int32 permutation [N] of the packed sequences, a scheduling hint (longest first);
            results never depend on it. Fixed layout: must be None. Computed on the device when omitted
            for packed CUDA prefill (no host sync).
        prefill_workspace: a :class:`kda_ops.RecurrentKDAPrefillWorkspace` (caller-owned scratch).
            Optional in eager mode; needed, planned by an eager call of the same shapes, for an
            allocation-free CUDA-graph-captured call.
        state_checkpoints: [C, HV, V, K] contiguous, in the pool's dtype (fp32 or bf16 without a pool; a
            bf16 buffer is filled through an fp32 copy, rounded on write): row
            ``checkpoint_cu_starts[i] + j`` receives the state of sequence i BEFORE its token j*n. Allocated
            (zero-filled) when None.
        checkpoint_cu_starts: int64 [N+1] with ``starts[i+1] - starts[i] = ceil(L_i / n)``. Computed when
            None: from shapes (fixed), on the host in eager mode (packed; a device sync when cu_seqlens is
            on a GPU), or on the device under torch.compile / graph capture (C is then the upper bound
            T//n + N). Give both buffers to avoid any host sync.
        checkpoint_every_n_tokens: n > 0, a multiple of 16, turns checkpointing on (0: off).
        backend: "auto", "chunked" (tensor-core chunked prefill) or "recurrent" (token-serial kernel). The
            CPU implementation is one token loop whatever the backend.
        cu_seqlens_cpu: optional host mirror (CPU int64 [N+1], values checked) of a packed call's
            ``cu_seqlens``: lets the exact sequence split (``KDA_SEQUENCE_SPLIT``, kda_ops/_split.py) plan
            segments without a device sync. Caller contract: equal to ``cu_seqlens``.
        disable_state_update: speculative verify (FlashInfer's name): the outputs of every token are
            computed by the same slot and activity rules (start slot, num_accepted_tokens, inactive
            sequences and tokens), but no slot of ``initial_state`` is written: neither the state after the
            last token nor the per-token columns of speculative decode. ``final_state`` is then the pool as
            it was (or, without a pool, the new fp32 final state, as usual); ``state_checkpoints`` (a
            separate buffer, not pool slots) are written as usual. Engines verify drafts with it and commit
            the accepted prefix afterwards. Runs the token-serial kernel (``backend="chunked"`` refuses it);
            CUDA-graph capturable.

    Returns:
        ``(output, final_state)``, or ``(output, final_state, state_checkpoints)`` when
        ``checkpoint_every_n_tokens > 0``. ``output`` [B, T, HV, V] in q's dtype.

    Raises:
        TypeError: a wrong dtype (fp16 anywhere; fp32/fp64 tokens on CUDA; index tensors not int32;
            ``checkpoint_cu_starts`` not int64; parameters not fp32; a wrong Python type).
        ValueError: a wrong rank, shape, stride or value (HV % H, K/V unsupported, scale <= 0 or not
            finite, lower_bound >= 0 or without the gate, A_log missing for the gate, cu_seqlens with
            B != 1 or < 2 entries, overlapping ``output``, an unknown backend, checkpoint interval not a
            multiple of 16) or an argument the chosen mode ignores (A_log/dt_bias without the gate,
            ssm_state_indices without a pool, num_accepted_tokens without num_spec_tokens, checkpoint
            buffers without checkpoint_every_n_tokens, checkpoints in speculative decode, seq_order with
            fixed layout, initial_state_source without initial_state_indices or the reverse).
        RuntimeError: tensors on different devices, an unsupported GPU, or a captured call that would
            allocate workspace (plan it with an eager call first).
    """
    # Hot path: an eager decode step's kernel takes a few µs, so the Python layer must stay in the same
    # range. Every check below is a cheap combined test on the common path; the one-by-one helpers run
    # only to raise the error that names the argument (benchmarks/bench_api_overhead.py times this).
    key: Any = None
    if (
        initial_state_source is None
        and initial_state_indices is None
        and seq_order is None
        and prefill_workspace is None
        and state_checkpoints is None
        and checkpoint_cu_starts is None
        and cu_seqlens_cpu is None
        and type(q) is _Tensor
        and (cu_seqlens is None or (type(cu_seqlens) is _Tensor and cu_seqlens.is_cuda))
        and not torch.compiler.is_compiling()
    ):
        scalars = (
            scale,
            output_final_state,
            use_qk_l2norm_in_kernel,
            use_gate_in_kernel,
            lower_bound,
            num_spec_tokens,
            beta_is_logit,
            checkpoint_every_n_tokens,
            backend,
            disable_state_update,
        )
        try:
            # reads, then the two writes (output, the pool); None: a non-tensor argument or overlapping memory
            tkey = _tensor_call_key(
                2, q, k, v, g, beta, A_log, dt_bias, cu_seqlens, ssm_state_indices, num_accepted_tokens, output,
                initial_state,
            )  # fmt: skip
            key = None if tkey is None else (tkey, scalars, tuple(map(type, scalars)))
            e = None if key is None else _FAST_CACHE.get(key)
        except TypeError:  # an unhashable scalar: the full path explains
            key = e = None
        if e is not None:
            res = _recurrent_kda_cached(
                e,
                q,
                k,
                v,
                g,
                beta,
                A_log,
                dt_bias,
                initial_state,
                cu_seqlens,
                ssm_state_indices,
                num_accepted_tokens,
                output,
                disable_state_update,
            )
            if res is not None:
                return res
            key = None  # an address re-check failed: the full path raises the error

    backend_code = V.check_verify(disable_state_update, V.check_backend(backend))
    d = V.check_tokens(q, k, v, g, beta, cu_seqlens, kv_rule=backend)
    V.check_flags(output_final_state, use_qk_l2norm_in_kernel, beta_is_logit)
    out_final, l2, logit = output_final_state, use_qk_l2norm_in_kernel, beta_is_logit
    gate_mode, lb, A_hv, dtb_hv = V.check_gate(use_gate_in_kernel, lower_bound, A_log, dt_bias, d)
    sc = V.check_scale(scale, d.K)
    pool = pool_nbytes = None
    if initial_state is not None:
        pool, pool_nbytes = V.check_pool_span(initial_state, "initial_state", d)
    S, ssm_idx, ssm_idx_numel, n_acc, new_slots = V.check_slots(
        num_spec_tokens, ssm_state_indices, num_accepted_tokens, pool, cu_seqlens, d
    )
    source, src_idx, source_nbytes = V.check_source(initial_state_source, initial_state_indices, d)
    order = V.check_seq_order(seq_order, d)
    out_nbytes = None  # its byte count when known to be contiguous and non-empty
    if output is not None:
        out, out_nbytes = V.check_output(output, d)
    n_ck, ck, ck_starts, ck_dtype = V.check_checkpoints(
        checkpoint_every_n_tokens, state_checkpoints, checkpoint_cu_starts, pool, S, d
    )
    cu_host = None if cu_seqlens_cpu is None else V.check_cu_seqlens_cpu(cu_seqlens_cpu, cu_seqlens, d)
    ws_obj = prefill_workspace
    if ws_obj is not None:
        V.check_instance(ws_obj, RecurrentKDAPrefillWorkspace, "prefill_workspace")

    # memory overlap of everything the op writes with everything it reads (all validated on d.device):
    # output against the reads, the pool and the checkpoints; the pool against the reads and the
    # checkpoints; the checkpoints against the reads
    if output is not None or pool is not None or ck is not None:
        V.check_writes_no_overlap(
            _WRITE_NAMES,
            (None if output is None else out, pool, ck),
            _READ_NAMES,
            (q, k, v, g, beta, A_log, dt_bias, source, cu_seqlens, ssm_idx, n_acc, src_idx, order, ck_starts),
            d,
            (out_nbytes, pool_nbytes, None),
            # byte counts of the reads known contiguous: A_log / dt_bias passed through check_gate unchanged
            # (then contiguous [HV] / [HV, K] fp32), the index tensors (contiguous, checked shapes)
            (_NO_TOKEN_NBYTES if d.token_nbytes is None else d.token_nbytes)
            + (
                None if A_hv is None or A_hv is not A_log else 4 * d.HV,
                None if dtb_hv is None or dtb_hv is not dt_bias else 4 * d.HV * d.K,
                source_nbytes,
                None,
                None if ssm_idx is None else 4 * ssm_idx_numel,
                None,
                None,
                None,
                None,
            ),
        )

    # Scratch bytes are a function of shapes only; the capture state is queried only where it matters
    # (checkpoint row counts, workspace allocation): a decode step never asks the CUDA runtime.
    nbytes = prefill_workspace_bytes(d.device, d.B, d.T, d.N, d.H, d.HV, d.K, d.V, backend_code)
    capturing = V.capturing(d.device) if d.on_cuda and (n_ck > 0 or nbytes > 0) else False
    # Exact checkpoint row counts need cu_seqlens values: not while tracing, capturing, or on meta tensors.
    if n_ck > 0:
        exact = not (torch.compiler.is_compiling() or capturing or d.dev_type == "meta" or type(q) is not torch.Tensor)
        if ck_starts is None:
            ck_starts, n_rows = V.checkpoint_starts(d, n_ck, cu_seqlens, exact)
        else:
            V.checkpoint_starts_values(ck_starts, n_ck, cu_seqlens, d)
            n_rows = V.checkpoint_rows(d, n_ck, ck_starts, exact)
        if ck is None:
            ck = torch.zeros((n_rows, d.HV, d.V, d.K), dtype=ck_dtype, device=d.device)
    ck_caller = None
    if ck is not None and ck.dtype != ck_dtype:
        # A bf16 buffer without a pool: the op writes fp32 checkpoints; round into the caller's buffer
        # after it (rows the op leaves alone round-trip exactly: bf16 -> fp32 -> bf16).
        ck_caller, ck = ck, ck.to(ck_dtype)

    # all checks done: allocate, plan the workspace, run
    ws = None
    if ws_obj is not None:
        key = (d.B, d.T, d.N, d.H, d.HV, d.K, d.V, d.packed, backend_code)
        ws = ws_obj.plan(key, d.device, nbytes, "prefill_workspace")
    elif nbytes > 0:
        V.check_capture_allocation(capturing)
        ws = torch.empty(nbytes, dtype=torch.uint8, device=d.device)

    if order is None and cu_seqlens is not None and d.on_cuda and S == 0 and d.N > 1 and d.T != d.N:
        # Longest first shrinks the last partial wave; a device argsort costs no host sync.
        lens = cu_seqlens[1:] - cu_seqlens[:-1]
        order = torch.argsort(lens, descending=True, stable=True).to(torch.int32)

    # Packed: tokens outside every sequence (a broken contract) read as zeros, not garbage. The op zeroes
    # just those (found on the device from cu_seqlens, no sync) instead of a fill of the whole output; a
    # caller's `output` keeps them as they were.
    zero_uncovered = output is None and d.packed
    if output is None:
        out = q.new_empty((d.B, d.T, d.HV, d.V))
    if new_slots:
        # Slot indices without a pool: a pool of zeros up to max(index) + 1 (FlashInfer's behaviour); it is
        # the returned final state.
        pool = torch.zeros((new_slots, d.HV, d.V, d.K), dtype=torch.float32, device=d.device)
    final = None
    if pool is None and out_final:
        final = torch.zeros((d.N, d.HV, d.V, d.K), dtype=torch.float32, device=d.device)

    # Long sequences on few heads: the exact segment split (kda_ops/_split.py; KDA_SEQUENCE_SPLIT, auto by default)
    split = (
        not _routing.split_off()
        and S == 0
        and not disable_state_update
        and _split.try_run(
            d,
            q,
            k,
            v,
            g,
            beta,
            A_hv,
            dtb_hv,
            pool,
            ssm_idx,
            cu_seqlens,
            cu_host,
            out,
            final,
            sc,
            gate_mode,
            lb,
            l2,
            logit,
            backend_code,
            n_ck,
            ck,
            source,
            src_idx,
            zero_uncovered,
        )  # fmt: skip
    )
    if not split:
        if (
            key is not None
            and n_ck == 0
            and ws is None
            and d.dev_type != "meta"
            and A_hv is A_log
            and dtb_hv is dt_bias
            and pool is initial_state
            and ssm_idx is ssm_state_indices
            and n_acc is num_accepted_tokens
            and (output is None or out is output)
            # a captured call may run unsplit where the same call eager splits (packed, or no eager plan yet):
            # caching it would send later eager calls of this key past the split
            and not (d.on_cuda and V.capturing(d.device))
        ):
            _remember(
                key,
                pool,
                d=d,
                gate_mode=gate_mode,
                lb=lb,
                sc=sc,
                l2=l2,
                logit=logit,
                S=S,
                backend_code=backend_code,
                zero_uncovered=zero_uncovered,
                need_order=order is not None,
                alloc_final=final is not None,
                out_final=out_final,
            )

        _recurrent_kda_op(
            q,
            k,
            v,
            g,
            beta,
            A_hv,
            dtb_hv,
            pool,
            source,
            src_idx,
            cu_seqlens,
            ssm_idx,
            n_acc,
            order,
            out,
            final,
            ck,
            ck_starts,
            ws,
            sc,
            gate_mode,
            lb,
            l2,
            logit,
            S,
            n_ck,
            backend_code,
            zero_uncovered,
            disable_state_update,
        )
    final_ret = (pool if pool is not None else final) if out_final else None
    if n_ck > 0:
        assert ck is not None
        if ck_caller is not None:
            ck_caller.copy_(ck)
            ck = ck_caller
        return out, final_ret, ck
    return out, final_ret


# ---------------------------------------------------------------------------------------------------
# training family


def recurrent_kda_training_forward(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    A_log: torch.Tensor | None,
    dt_bias: torch.Tensor | None,
    initial_state: torch.Tensor,
    cu_seqlens: torch.Tensor | None = None,
    scale: float | None = None,
    lower_bound: float | None = -5.0,
    out: torch.Tensor | None = None,
    final_state_out: torch.Tensor | None = None,
    context_out: RecurrentKDATrainingContext | None = None,
    *,
    cu_seqlens_cpu: torch.Tensor | None = None,
    use_gate_in_kernel: bool = True,
    use_qk_l2norm_in_kernel: bool = True,
    beta_is_logit: bool = True,
) -> tuple[torch.Tensor, torch.Tensor, RecurrentKDATrainingContext]:
    """Training forward of KDA with saved tapes (docs/contract.md "API"), in every mode of :func:`recurrent_kda`.

    Computes docs/contract.md "Recurrence" with the gate, β and L2-norm modes of :func:`recurrent_kda`, under
    the same keyword names. The defaults are the original training contract (kept for existing callers):
    the lower-bound gate ``a = λ sigmoid(exp(A_log) (g + dt_bias))`` with λ = -5, ``β = sigmoid(beta)``, L2
    norm on. ``lower_bound=None`` selects the softplus gate ``a = -exp(A_log) softplus(g + dt_bias)``;
    ``use_gate_in_kernel=False`` takes g as the log-decay itself (A_log and dt_bias None, ``lower_bound`` not
    read). It saves the state before every 64-token chunk of every sequence but its first
    (the tapes; the first is ``initial_state``, kept in the context by reference) so that
    :func:`recurrent_kda_training_backward` never reruns the whole forward.

    Args:
        q, k: [B, T, H, K]; v: [B, T, HV, V]; g: [B, T, HV, K] raw gate input (the log-decay with
            ``use_gate_in_kernel=False``); beta: [B, T, HV] logits (β itself with ``beta_is_logit=False``).
            bf16 with K == V == 128 on CUDA; bf16/fp32/fp64 and any K, V on CPU. Last dim contiguous.
        A_log: [HV] (None without the in-kernel gate); dt_bias: [HV, K] or flat [HV*K], or None (0; always
            None without the gate); initial_state: [N, HV, V, K] (not modified). fp32 (fp64 when the token
            tensors are fp64).
        cu_seqlens: int32/int64 [N+1] on the device of q (packed, B == 1; int32 is widened to int64).
            Zero-length sequences are allowed.
        scale: any finite float > 0; None means 1/sqrt(K).
        lower_bound: λ of the lower-bound gate, finite, in [-5, 0); None selects the softplus gate. Not read
            with ``use_gate_in_kernel=False``.
        out: optional [B, T, HV, V] buffer (q's dtype) the output is copied into and returned.
        final_state_out: optional [N, HV, V, K] buffer (state dtype) for the final state.
        context_out: a context from an earlier call with the same shapes, refilled and returned.
        cu_seqlens_cpu: the trusted host mirror (CPU int64 [N+1]) of ``cu_seqlens``, validated fully
            (starts at 0, non-decreasing, ends at T). Required for packed calls on CUDA; optional on CPU
            (then it must equal ``cu_seqlens``, whose values are checked directly); must be None for fixed
            input.
        use_gate_in_kernel: compute the log-decay from g, A_log, dt_bias (default True; False: g is it).
        use_qk_l2norm_in_kernel: L2-normalise q and k (eps 1e-6 inside the rsqrt) before scaling (default True).
        beta_is_logit: β = sigmoid(beta) (default True; False: beta is β).

    Returns:
        ``(out, final_state, ctx)``: out [B, T, HV, V] (q's dtype), final_state [N, HV, V, K] fp32 (fp64
        with fp64 tokens), ctx a :class:`kda_ops.RecurrentKDATrainingContext`.

    Raises:
        TypeError: wrong dtypes (tokens, parameters, cu_seqlens, cu_seqlens_cpu, buffers) or types.
        ValueError: wrong ranks/shapes, HV % H != 0, K/V unsupported, scale <= 0 or non-finite, λ outside
            [-5, 0), cu_seqlens with B != 1 or < 2 entries, cu_seqlens_cpu missing/extra/mismatched or
            invalid, a context_out of other shapes, buffers overlapping the inputs.
        RuntimeError: tensors on different devices (cu_seqlens_cpu not on CPU), an unsupported GPU.
    """
    d = V.check_tokens(q, k, v, g, beta, cu_seqlens, kv_rule="training")
    gm, A, dtb, h0, lb, l2, logit = V.check_training_modes(
        use_gate_in_kernel, lower_bound, A_log, dt_bias, initial_state, use_qk_l2norm_in_kernel, beta_is_logit, d
    )
    assert h0 is not None
    sc = V.check_scale(scale, d.K)
    cu64, host = V.check_training_cu(d, cu_seqlens, cu_seqlens_cpu, "required-on-cuda")
    reads = V.training_reads(q, k, v, g, beta, A, dtb, h0, cu_seqlens)
    out, final_state_out = V.check_forward_outs(out, final_state_out, reads, d)
    if context_out is not None:
        shapes = (*(tuple(t.shape) for t in (q, k, v, g, beta)), _shape_or_none(A), _shape_or_none(dtb))
        V.check_context_out(context_out, RecurrentKDATrainingContext, shapes, d)

    split = None  # the exact segment split (kda_ops/_split.py): the same four results, unsplit tape layout
    if not _routing.split_off() and _split.training_modes_covered(gm, l2, logit, dtb):
        split = _split.try_training_forward(d, q, k, v, g, beta, A, dtb, h0, cu_seqlens, host, sc, lb)
    o, fs, tapes, starts = (
        split[:4]
        if split
        else torch.ops.kda.recurrent_kda_training_forward.default(
            q, k, v, g, beta, A, dtb, h0, cu64, sc, lb, gm, l2, logit
        )
    )
    if out is not None:
        out.copy_(o)
        o = out
    if final_state_out is not None:
        final_state_out.copy_(fs)
        fs = final_state_out
    if context_out is not None:
        with torch.no_grad():
            context_out.tapes.copy_(tapes)
            context_out.tape_cu_starts.copy_(starts)
        ctx = context_out
        ctx.q, ctx.k, ctx.v, ctx.g, ctx.beta, ctx.A_log, ctx.dt_bias = q, k, v, g, beta, A, dtb
        ctx.initial_state = h0
        ctx.cu_seqlens, ctx.cu_seqlens_cpu, ctx.scale, ctx.lower_bound = cu64, host, sc, lb
        ctx.state_dtype = h0.dtype
        ctx.gate_mode, ctx.use_qk_l2norm, ctx.beta_is_logit = gm, l2, logit
    else:
        ctx = RecurrentKDATrainingContext(
            q=q,
            k=k,
            v=v,
            g=g,
            beta=beta,
            A_log=A,
            dt_bias=dtb,
            tapes=tapes,
            tape_cu_starts=starts,
            initial_state=h0,
            cu_seqlens=cu64,
            scale=sc,
            lower_bound=lb,
            cu_seqlens_cpu=host,
            state_dtype=h0.dtype,
            gate_mode=gm,
            use_qk_l2norm=l2,
            beta_is_logit=logit,
        )
    ctx.extra["initial_state_version"] = h0._version
    ctx.extra["segment_split"] = None if split is None else split[4]  # (the split backward's plan and maps)
    return o, fs, ctx


def recurrent_kda_training_backward(
    ctx: RecurrentKDATrainingContext,
    do: torch.Tensor,
    dfinal_state: torch.Tensor | None,
    out: Sequence[torch.Tensor] | None = None,
) -> tuple[torch.Tensor, ...]:
    """Training backward from the tapes of :func:`recurrent_kda_training_forward` (docs/contract.md "API", "Gradients").

    Loss convention: ``L = Σ_t <o_t, do_t> + <S_T, dfinal_state>``; the reverse sweep of docs/contract.md "Gradients"
    runs from the saved chunk-boundary states, chained through the forward's modes (kept in ``ctx``): the L2
    norm when on, the gate (lower-bound, softplus, or none for a precomputed g: dg = da) and the logit β
    when ``beta_is_logit``. GQA: dq and dk of the value heads of a group are summed into their q/k head.
    dA_log and ddt_bias are summed over all tokens and sequences, in a fixed order (deterministic).

    Args:
        ctx: the context returned by the forward (its saved tensors must be unmodified).
        do: [B, T, HV, V] in q's dtype.
        dfinal_state: [N, HV, V, K] in the state dtype, or None (zero).
        out: optional eight preallocated tensors (shapes/dtypes as returned) the gradients are copied into.

    Returns:
        ``(dq, dk, dv, dg, dbeta, dA_log, ddt_bias, dinitial_state)``: dq, dk [B, T, H, K], dv [B, T, HV, V],
        dg [B, T, HV, K], dbeta [B, T, HV] in q's dtype; dA_log [HV], ddt_bias [HV, K],
        dinitial_state [N, HV, V, K] in the state dtype (fp32; fp64 with fp64 tokens). dA_log is None when
        the forward had no A_log (``use_gate_in_kernel=False``), ddt_bias None when it had no dt_bias (then
        the matching ``out`` entries must be None too).

    Raises:
        TypeError: ctx of the wrong type, wrong dtypes. ValueError: wrong shapes, overlapping ``out``.
        RuntimeError: tensors on another device.
    """
    V.check_instance(ctx, RecurrentKDATrainingContext, "ctx")
    d = V.check_tokens(ctx.q, ctx.k, ctx.v, ctx.g, ctx.beta, ctx.cu_seqlens, kv_rule="training")
    V.check_unmodified(
        ctx.initial_state,
        ctx.extra.get("initial_state_version"),
        "ctx.initial_state",
        "the context keeps the forward's initial_state by reference: the tapes do not repeat the state before "
        "token 0; pass the forward a copy if the state buffer is reused, e.g. carried to the next segment",
    )
    dO, dS = V.check_do(do, dfinal_state, d)
    reads = [
        ("ctx.q", ctx.q),
        ("ctx.k", ctx.k),
        ("ctx.v", ctx.v),
        ("ctx.g", ctx.g),
        ("ctx.beta", ctx.beta),
        ("ctx.A_log", ctx.A_log),
        ("ctx.dt_bias", ctx.dt_bias),
        ("ctx.tapes", ctx.tapes),
        ("ctx.initial_state", ctx.initial_state),
        ("do", do),
        ("dfinal_state", dfinal_state),
    ]
    absent = _absent_grads(ctx.A_log, ctx.dt_bias)
    outs = V.check_grad_outs(out, d, reads, absent)
    if ctx.extra.get("segment_split") is not None:  # a split forward: the split backward (kda_ops/_split.py)
        return _into(_split.training_backward_from_context(ctx, dO, dS, ctx.extra["segment_split"]), outs)
    grads = torch.ops.kda.recurrent_kda_training_backward.default(
        ctx.q,
        ctx.k,
        ctx.v,
        ctx.g,
        ctx.beta,
        ctx.A_log,
        ctx.dt_bias,
        ctx.tapes,
        ctx.tape_cu_starts,
        ctx.initial_state,
        ctx.cu_seqlens,
        dO,
        dS,
        ctx.scale,
        ctx.lower_bound,
        ctx.gate_mode,
        ctx.use_qk_l2norm,
        ctx.beta_is_logit,
    )
    return _into(_drop_absent(grads, absent), outs)


def _into(grads: Sequence[torch.Tensor | None], outs: list[torch.Tensor | None] | None) -> tuple[Any, ...]:
    if outs is None:
        return tuple(grads)
    with torch.no_grad():
        for o, gr in zip(outs, grads, strict=True):
            if o is not None and gr is not None:
                o.copy_(gr)
    return tuple(outs)


def _shape_or_none(t: torch.Tensor | None) -> tuple[int, ...] | None:
    return None if t is None else tuple(t.shape)


def _absent_grads(A: torch.Tensor | None, dtb: torch.Tensor | None) -> tuple[int, ...]:
    """Indices of the gradients returned as None: dA_log (5) without A_log, ddt_bias (6) without dt_bias."""
    return ((5,) if A is None else ()) + ((6,) if dtb is None else ())


def _drop_absent(grads: Sequence[torch.Tensor], absent: tuple[int, ...]) -> tuple[torch.Tensor | None, ...]:
    """The ops return empty tensors for absent parameters; the Python API returns None."""
    return tuple(None if i in absent else gr for i, gr in enumerate(grads))


def recurrent_kda_backward(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    A_log: torch.Tensor | None,
    dt_bias: torch.Tensor | None,
    initial_state: torch.Tensor,
    do: torch.Tensor,
    dfinal_state: torch.Tensor | None,
    cu_seqlens: torch.Tensor | None = None,
    scale: float | None = None,
    lower_bound: float | None = -5.0,
    workspace: RecurrentKDABackwardWorkspace | None = None,
    out: Sequence[torch.Tensor | None] | None = None,
    *,
    use_gate_in_kernel: bool = True,
    use_qk_l2norm_in_kernel: bool = True,
    beta_is_logit: bool = True,
) -> tuple[torch.Tensor | None, ...]:
    """KDA backward from the raw inputs, no saved context (docs/contract.md "API", "Gradients"), in every mode
    of :func:`recurrent_kda_training_forward` (the same keywords and defaults), any T, any packing, GQA.

    Args:
        q, k, v, g, beta, A_log, dt_bias, initial_state, cu_seqlens, scale, lower_bound, use_gate_in_kernel,
            use_qk_l2norm_in_kernel, beta_is_logit: as in :func:`recurrent_kda_training_forward` (no host
            mirror: nothing here needs host values).
        do: [B, T, HV, V] in q's dtype; dfinal_state: [N, HV, V, K] state dtype, or None (zero).
        workspace: a :class:`kda_ops.RecurrentKDABackwardWorkspace`; with it and ``out`` the call is
            CUDA-graph capturable after an eager call of the same shapes (on CUDA: every gate mode, K = V in
            {64, 128}; ``KDA_TRAINING_SWEEP=host`` runs the CPU backward and raises under capture).
        out: optional eight preallocated tensors the gradients are copied into (and returned); None at the
            places of gradients returned as None.

    Returns:
        ``(dq, dk, dv, dg, dbeta, dA_log, ddt_bias, dinitial_state)`` as in
        :func:`recurrent_kda_training_backward` (dA_log None without A_log, ddt_bias None without dt_bias).

    Raises:
        TypeError, ValueError, RuntimeError: as :func:`recurrent_kda_training_forward`, plus ``do`` /
        ``dfinal_state`` / ``out`` of the wrong dtype or shape, a workspace of the wrong type or device.
    """
    d = V.check_tokens(q, k, v, g, beta, cu_seqlens, kv_rule="training")
    gm, A, dtb, h0, lb, l2, logit = V.check_training_modes(
        use_gate_in_kernel, lower_bound, A_log, dt_bias, initial_state, use_qk_l2norm_in_kernel, beta_is_logit, d
    )
    assert h0 is not None
    sc = V.check_scale(scale, d.K)
    dO, dS = V.check_do(do, dfinal_state, d)
    if workspace is not None:
        V.check_instance(workspace, RecurrentKDABackwardWorkspace, "workspace")
    reads = V.training_reads(q, k, v, g, beta, A, dtb, h0, cu_seqlens, ("do", do), ("dfinal_state", dfinal_state))
    absent = _absent_grads(A, dtb)
    outs = V.check_grad_outs(out, d, reads, absent)
    cu64, _ = V.check_training_cu(d, cu_seqlens, None, "none")
    if workspace is not None:
        key = (d.B, d.T, d.N, d.H, d.HV, d.K, d.V, d.packed)
        workspace.plan(key, d.device, 0, "workspace")
        if cu_seqlens is not None and cu_seqlens.dtype != torch.int64:
            # Keep the widened copy in the workspace so a captured call writes a buffer it owns.
            if workspace.cu_seqlens64 is None or workspace.cu_seqlens64.shape != cu_seqlens.shape:
                workspace.cu_seqlens64 = torch.empty(cu_seqlens.shape, dtype=torch.int64, device=d.device)
            workspace.cu_seqlens64.copy_(cu_seqlens)
            cu64 = workspace.cu_seqlens64
    grads = torch.ops.kda.recurrent_kda_backward.default(
        q, k, v, g, beta, A, dtb, h0, cu64, dO, dS, sc, lb, gm, l2, logit
    )
    return _into(_drop_absent(grads, absent), outs)


# ---------------------------------------------------------------------------------------------------
# autograd entry


def kda(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    A_log: torch.Tensor | None,
    dt_bias: torch.Tensor | None,
    initial_state: torch.Tensor | None = None,
    *,
    cu_seqlens: torch.Tensor | None = None,
    scale: float | None = None,
    lower_bound: float | None = -5.0,
    output_final_state: bool = False,
    use_gate_in_kernel: bool = True,
    use_qk_l2norm_in_kernel: bool = True,
    beta_is_logit: bool = True,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Differentiable KDA layer core (docs/contract.md "API"): docs/contract.md "Recurrence" in every mode of
    :func:`recurrent_kda_training_forward` (defaults: L2 norm on q and k, lower-bound gate
    ``a = λ sigmoid(exp(A_log)(g + dt_bias))`` with λ = -5, ``β = sigmoid(beta)``; ``lower_bound=None`` the
    softplus gate, ``use_gate_in_kernel=False`` a precomputed log-decay g), with autograd
    through ``torch.library.register_autograd`` on ``torch.ops.kda.kda_forward``, whose forward and backward route
    internally (the exact sequence split of long sequences, or one call of the training ops).

    Differentiable in all eight tensor inputs (A_log / dt_bias when given). Works in eager autograd, under
    ``torch.compile(fullgraph=True)`` (no host syncs, no data-dependent Python here) and DDP/FSDP (no
    global state).

    Args:
        q, k: [B, T, H, K]; v: [B, T, HV, V]; g: [B, T, HV, K]; beta: [B, T, HV] logits. bf16 with
            K == V == 128 on CUDA; bf16/fp32/fp64, any K and V on CPU (fp64 for gradcheck).
        A_log: [HV] or None (without the gate); dt_bias: [HV, K] or flat [HV*K], or None (0); fp32 (fp64 with
            fp64 tokens).
        initial_state: [N, HV, V, K] in that dtype, or None (zeros; then it has no gradient).
        cu_seqlens: int32/int64 [N+1] on the device of q (packed, B == 1). Values are a caller contract
            (checked only when on CPU in eager mode).
        scale: finite > 0; None means 1/sqrt(K). lower_bound: λ in [-5, 0), None: the softplus gate.
        output_final_state: also return the final state [N, HV, V, K].
        use_gate_in_kernel, use_qk_l2norm_in_kernel, beta_is_logit: as in
            :func:`recurrent_kda_training_forward`.

    Returns:
        ``(o, final_state)``: o [B, T, HV, V] in q's dtype; final_state (fp32, fp64 with fp64 tokens) or
        None.

    Raises:
        TypeError, ValueError, RuntimeError: as :func:`recurrent_kda_training_forward`.
    """
    d = V.check_tokens(q, k, v, g, beta, cu_seqlens, kv_rule="training")
    gm, A, dtb, h0, lb, l2, logit = V.check_training_modes(
        use_gate_in_kernel,
        lower_bound,
        A_log,
        dt_bias,
        initial_state,
        use_qk_l2norm_in_kernel,
        beta_is_logit,
        d,
        state_required=False,
    )
    sc = V.check_scale(scale, d.K)
    ofs = V.check_bool(output_final_state, "output_final_state")
    if h0 is None:  # zeros as a stride-0 view: autograd saves one element, not [N, HV, V, K]
        h0 = q.new_zeros((), dtype=V.param_dtype(d)).expand(d.N, d.HV, d.V, d.K)
    cu64, _ = V.check_training_cu(d, cu_seqlens, None, "none")
    # one op whatever the route (kda_ops/_autograd.py: its kernel and its backward's route through the spine)
    o, fs, _, _ = torch.ops.kda.kda_forward(q, k, v, g, beta, A, dtb, h0, cu64, sc, lb, gm, l2, logit)
    return o, (fs if ofs else None)
