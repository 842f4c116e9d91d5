"""fla-shaped entry points backed by kda_ops: ``chunk_kda``, ``fused_recurrent_kda``, ``fused_recurrent_kda_fwd``.

The three functions take the arguments of ``fla.ops.kda`` (flash-linear-attention 0.6) with the same
positions, names, defaults, shapes and return values, so code written for fla runs unchanged after
``from kda_ops.fla import chunk_kda``. :func:`install` goes one step further: it registers kda_ops as a
backend of fla's own dispatcher, so an unmodified fla model (``fla.ops.kda.chunk_kda``, and the decode
path through ``fused_recurrent_kda_fwd``) runs on kda_ops. docs/fla.md has the table of every argument.

Routing:

- ``chunk_kda`` with autograd (grad mode on and any tensor input requiring grad) runs
  :func:`kda_ops.kda`, the training path with its backward, in every mode of fla's: the precomputed,
  softplus and lower-bound gates (λ in [-5, 0)), logit or plain beta (``allow_neg_eigval``: β = 2·sigmoid in
  torch), L2 norm on or off, GVA, packed, a differentiable initial state.
- Everything else (no autograd, ``fused_recurrent_kda``, ``fused_recurrent_kda_fwd``) runs
  :func:`kda_ops.recurrent_kda`, which implements every gate mode, L2 on or off, beta or logits.

State layout: fla's default state is ``[N, HV, K, V]`` (key-major); kda_ops keeps ``[N, HV, V, K]``
(what fla calls ``state_v_first=True``). With ``state_v_first=True`` states are passed through without
a copy; with the default layout the state is transposed into a contiguous copy on the way in and the
result transposed back into a contiguous tensor on the way out (two copies of the state per call; a
pool updated in place by ``fused_recurrent_kda_fwd`` has its touched slots gathered and scattered back).
"""

from __future__ import annotations

import functools
import inspect
import os
import warnings
from typing import Any

import torch

from kda_ops.interface import kda, recurrent_kda

__all__ = ["chunk_kda", "fused_recurrent_kda", "fused_recurrent_kda_fwd", "install", "uninstall"]

FLA_VERSION = "0.6.0"  # the fla release whose signatures these functions follow (tests pin it)
# The training path's gate range (kda_ops.kda): λ in [-5, 0).
_TRAINING_MIN_LOWER_BOUND = -5.0


def _rk(*args: Any, **kwargs: Any) -> Any:
    # recurrent_kda returns 2 or 3 values by mode; the callers here know which.
    return recurrent_kda(*args, **kwargs)


def _needs_grad(*tensors: Any) -> bool:
    if not torch.is_grad_enabled():
        return False
    return any(isinstance(t, torch.Tensor) and t.requires_grad for t in tensors)


def _pop_deprecated_layout(kwargs: dict[str, Any], state_v_first: bool) -> bool:
    # fla 0.6 still accepts the old name of state_v_first.
    if "transpose_state_layout" in kwargs:
        if state_v_first:
            raise ValueError("Cannot pass both `state_v_first` and the deprecated `transpose_state_layout`.")
        warnings.warn(
            "`transpose_state_layout` is deprecated and renamed to `state_v_first`.", DeprecationWarning, stacklevel=3
        )
        return bool(kwargs.pop("transpose_state_layout"))
    return state_v_first


def _reject_unknown(kwargs: dict[str, Any], fn: str, known: tuple[str, ...] = ()) -> None:
    unknown = sorted(k for k in kwargs if k not in known)
    if unknown:
        raise NotImplementedError(f"kda_ops.fla.{fn}: argument(s) {unknown} are not supported by kda_ops")


def _check_packed(q: torch.Tensor, initial_state: torch.Tensor | None, cu_seqlens: torch.Tensor | None) -> None:
    # fla's own checks, with its messages.
    if cu_seqlens is not None:
        if q.shape[0] != 1:
            raise ValueError(
                f"The batch size is expected to be 1 rather than {q.shape[0]} when using `cu_seqlens`."
                f"Please flatten variable-length inputs before processing.",
            )
        if initial_state is not None and initial_state.shape[0] != len(cu_seqlens) - 1:
            raise ValueError(
                f"The number of initial states is expected to be equal to the number of input sequences, "
                f"i.e., {len(cu_seqlens) - 1} rather than {initial_state.shape[0]}.",
            )


def _check_state_layout(
    initial_state: torch.Tensor | None, q: torch.Tensor, v: torch.Tensor, v_first: bool, n: int | None = None
) -> None:
    """initial_state in the caller's layout: [N, HV, K, V] (fla's default) or [N, HV, V, K] (state_v_first).

    Checked here because kda_ops' own checks run later on the transposed copy and would name kda_ops'
    layout. ``n`` None: any number of states (a pool); else exactly n. Ill-shaped q / v are left to the
    later checks, which name them.
    """
    if initial_state is None or not isinstance(initial_state, torch.Tensor) or q.dim() != 4 or v.dim() != 4:
        return
    HV, K, V = v.shape[2], q.shape[-1], v.shape[-1]
    layout, dims = ("[N, HV, V, K]", (HV, V, K)) if v_first else ("[N, HV, K, V]", (HV, K, V))
    shape = tuple(initial_state.shape)
    if len(shape) != 4 or shape[1:] != dims or (n is not None and shape[0] != n):
        lead = "*" if n is None else str(n)
        which = "state_v_first=True" if v_first else "fla's layout; [N, HV, V, K] with state_v_first=True"
        raise ValueError(
            f"initial_state must have shape {layout} = [{lead}, {dims[0]}, {dims[1]}, {dims[2]}] ({which}), "
            f"got {list(shape)}"
        )


def _beta_args(beta: torch.Tensor, use_sigmoid: bool, allow_neg_eigval: bool) -> tuple[torch.Tensor, bool]:
    """(beta, beta_is_logit) for recurrent_kda and kda. 2*sigmoid (allow_neg_eigval) is computed here in fp32
    and rounded to beta's dtype (differentiable: under autograd its gradient flows through torch's sigmoid):
    kda_ops has no in-kernel [0, 2) beta."""
    if allow_neg_eigval:
        if not use_sigmoid:
            raise ValueError("`allow_neg_eigval=True` requires `use_beta_sigmoid_in_kernel=True`.")
        return (2.0 * torch.sigmoid(beta.float())).to(beta.dtype), False
    return beta, bool(use_sigmoid)


def _gate_args(
    use_gate_in_kernel: bool,
    A_log: torch.Tensor | None,
    dt_bias: torch.Tensor | None,
    lower_bound: float | None,
    HV: int,
    device: torch.device,
) -> tuple[torch.Tensor | None, torch.Tensor | None, float | None]:
    """fla's gate arguments -> recurrent_kda's (A_log, dt_bias, lower_bound).

    fla's lower-bound gate without A_log is ``λ sigmoid(g + dt_bias)``: the same as A_log = 0.
    Precomputed gates (use_gate_in_kernel=False) ignore A_log, dt_bias and lower_bound, as fla does.
    """
    if not use_gate_in_kernel:
        return None, None, None
    if A_log is None:
        if lower_bound is None:
            raise ValueError("`A_log` must be provided when `use_gate_in_kernel=True` and `lower_bound` is not set.")
        A_log = torch.zeros(HV, dtype=torch.float32, device=device)
    elif A_log.dtype != torch.float32:
        A_log = A_log.float()
    if dt_bias is not None and dt_bias.dtype != torch.float32:
        dt_bias = dt_bias.float()
    return A_log, dt_bias, (None if lower_bound is None else float(lower_bound))


def _to_ours(state: torch.Tensor, v_first: bool) -> torch.Tensor:
    """An fla state [N, HV, K, V] (or [N, HV, V, K] when v_first) as our [N, HV, V, K] fp32 copy."""
    if v_first:
        return state.to(torch.float32, copy=True).contiguous()
    return state.transpose(-1, -2).to(torch.float32).contiguous()


def _to_fla(state: torch.Tensor | None, v_first: bool) -> torch.Tensor | None:
    if state is None or v_first:
        return state
    return state.transpose(-1, -2).contiguous()


def _index_i32(t: torch.Tensor | None) -> torch.Tensor | None:
    # vLLM passes int32 indices; int64 ones are narrowed (tiny tensors).
    if t is None or t.dtype == torch.int32:
        return t
    return t.to(torch.int32)


# ---------------------------------------------------------------------------------------------------
# chunk_kda


def _chunk_plan(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    scale: float | None,
    initial_state: torch.Tensor | None,
    output_final_state: bool,
    use_qk_l2norm_in_kernel: bool,
    use_gate_in_kernel: bool,
    use_beta_sigmoid_in_kernel: bool,
    allow_neg_eigval: bool,
    safe_gate: bool,
    lower_bound: float | None,
    disable_recompute: bool,
    return_intermediate_states: bool,
    state_v_first: bool,
    cu_seqlens: torch.Tensor | None,
    cu_seqlens_cpu: torch.Tensor | None,
    cp_context: Any,
    use_graph: bool,
    max_num_seqs: int | None,
    kwargs: dict[str, Any],
) -> dict[str, Any]:
    """fla's argument checks plus ours; returns the normalised call. Raises before anything runs."""
    kwargs = dict(kwargs)
    state_v_first = _pop_deprecated_layout(kwargs, state_v_first)
    A_log, dt_bias = kwargs.pop("A_log", None), kwargs.pop("dt_bias", None)
    chunk_size = kwargs.pop("chunk_size", 64)
    _reject_unknown(kwargs, "chunk_kda")
    if cp_context is not None:
        raise NotImplementedError("kda_ops.fla.chunk_kda: cp_context (context parallelism) is not supported")
    if use_graph and cu_seqlens is not None:
        # fla's graph mode: cu_seqlens padded with zero-length tail sequences to a static count. Our kernels take
        # device cu_seqlens with no host sync or planning, so the padded call is the ordinary one (capturable; the
        # tokens no sequence covers read as zeros).
        n = cu_seqlens.shape[0] - 1
        if max_num_seqs is not None and n != max_num_seqs:
            raise ValueError(
                f"cu_seqlens must be padded with zero-length tail sequences to exactly max_num_seqs + 1 entries, "
                f"got {n} sequences with max_num_seqs={max_num_seqs}"
            )
    _check_packed(q, initial_state, cu_seqlens)
    if initial_state is not None and initial_state.dtype != torch.float32:
        raise TypeError(f"initial_state must be in float32, got {initial_state.dtype}")
    if use_gate_in_kernel and A_log is None and lower_bound is None:
        raise ValueError("`A_log` must be provided when `use_gate_in_kernel=True` and `lower_bound` is not set.")
    if chunk_size not in (32, 64):
        raise ValueError(f"`chunk_size` must be either 32 or 64 for KDA, got {chunk_size}.")
    if safe_gate and use_gate_in_kernel:
        if lower_bound is None:
            raise ValueError("`lower_bound` must be specified when `safe_gate=True` and `use_gate_in_kernel=True`.")
        if not (-5 <= lower_bound < 0):
            raise ValueError(f"`lower_bound` must be in the safe range [-5, 0), got {lower_bound}.")
    if allow_neg_eigval and not use_beta_sigmoid_in_kernel:
        raise ValueError("`allow_neg_eigval=True` requires `use_beta_sigmoid_in_kernel=True`.")
    if not use_gate_in_kernel:
        # fla ignores these without the in-kernel gate (g is the log-decay).
        A_log = dt_bias = None
        lower_bound = None

    grad = _needs_grad(q, k, v, g, beta, A_log, dt_bias, initial_state)
    if return_intermediate_states:
        if grad:
            raise ValueError("return_intermediate_states is only allowed in inference mode (it bypasses autograd)")
        if disable_recompute:
            raise ValueError("return_intermediate_states must be used with disable_recompute=False")
    if grad and lower_bound is not None and not (_TRAINING_MIN_LOWER_BOUND <= lower_bound < 0):
        # (the training path runs every mode of fla's; its lower-bound gate keeps e^{-Γ} in range for λ >= -5)
        raise NotImplementedError(
            f"kda_ops.fla.chunk_kda with autograd needs lower_bound in [-5, 0) (or None: the softplus gate), "
            f"got {lower_bound}"
        )
    # The training path takes one state per sequence; the inference path reads a pool of any size.
    n_seqs = (q.shape[0] if cu_seqlens is None else len(cu_seqlens) - 1) if grad else None
    _check_state_layout(initial_state, q, v, state_v_first, n_seqs)
    return {
        "grad": grad,
        "A_log": A_log,
        "dt_bias": dt_bias,
        "state_v_first": state_v_first,
        "chunk_size": chunk_size,
        "lower_bound": lower_bound,
    }


def chunk_kda(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    scale: float | None = None,
    initial_state: torch.Tensor | None = None,
    output_final_state: bool = False,
    use_qk_l2norm_in_kernel: bool = False,
    use_gate_in_kernel: bool = False,
    use_beta_sigmoid_in_kernel: bool = False,
    allow_neg_eigval: bool = False,
    safe_gate: bool = False,
    lower_bound: float | None = None,
    disable_recompute: bool = False,
    return_intermediate_states: bool = False,
    state_v_first: bool = False,
    cu_seqlens: torch.LongTensor | None = None,
    cu_seqlens_cpu: torch.LongTensor | None = None,
    cp_context: Any = None,
    use_graph: bool = False,
    max_num_seqs: int | None = None,
    **kwargs: Any,
) -> tuple[torch.Tensor, torch.Tensor | None] | tuple[torch.Tensor, torch.Tensor | None, torch.Tensor]:
    """fla's ``chunk_kda`` (0.6) on kda_ops: the chunked KDA forward, differentiable on the training path.

    Routing: with autograd (grad mode on and an input requiring grad) :func:`kda_ops.kda`; otherwise
    :func:`kda_ops.recurrent_kda`; both in every mode. docs/fla.md maps every argument.

    Args:
        q, k: [B, T, H, K] query and key; bf16 on CUDA, any float dtype on CPU.
        v: [B, T, HV, V] values, q's dtype; HV a multiple of H (GQA).
        g: [B, T, HV, K] log-decay, or the raw gate with ``use_gate_in_kernel``; q's dtype.
        beta: [B, T, HV] write strength, or logits with ``use_beta_sigmoid_in_kernel``; q's dtype.
        scale: query scale; None: 1/sqrt(K).
        initial_state: fp32 [N, HV, K, V] start state ([N, HV, V, K] with ``state_v_first``); never written.
            N = B (fixed length) or the number of sequences of ``cu_seqlens``.
        output_final_state: also return the final state.
        use_qk_l2norm_in_kernel: L2-normalise q and k (x·rsqrt(Σx² + 1e-6)).
        use_gate_in_kernel: g is the raw gate; ``A_log`` fp32 [HV] and ``dt_bias`` fp32 [HV*K] (keywords)
            give the softplus gate, with ``lower_bound`` the lower-bound gate (``A_log`` None: A_log = 0).
        use_beta_sigmoid_in_kernel: beta holds logits (sigmoid applied in the kernel).
        allow_neg_eigval: β = 2·sigmoid(beta) (needs ``use_beta_sigmoid_in_kernel``; under autograd its gradient
            flows through torch's sigmoid).
        safe_gate: fla's lower_bound checks (required, in [-5, 0)); the result is unchanged.
        lower_bound: λ of the lower-bound gate, or None.
        disable_recompute: a memory hint of fla's, accepted and ignored.
        return_intermediate_states: also return the state before every chunk (inference only).
        state_v_first: the layout of ``initial_state``, the final state and ``h`` (old name
            ``transpose_state_layout``, with a DeprecationWarning).
        cu_seqlens: int32/int64 [N+1] packed sequence starts (then B must be 1).
        cu_seqlens_cpu: the host copy of ``cu_seqlens``; sizes ``h`` without a device sync.
        cp_context: not supported (must be None).
        use_graph, max_num_seqs: fla's graph mode (``cu_seqlens`` padded with zero-length tail sequences to
            ``max_num_seqs + 1`` entries; None: its length): the padded call is the ordinary one, since the
            kernels read device ``cu_seqlens`` without a host sync; tokens no sequence covers read as zeros.
        **kwargs: ``A_log``, ``dt_bias``, ``chunk_size`` (32 or 64: the chunk of ``h``).

    Returns:
        ``(o, final_state)``: o [B, T, HV, V] in q's dtype; final_state [N, HV, K, V] ([N, HV, V, K] with
        ``state_v_first``), fp32 (fp64 on the training path with fp64 tokens), or None without
        ``output_final_state``. With
        ``return_intermediate_states`` ``(o, final_state, h)``: h holds the state before every chunk,
        [B, NT, HV, K, V] (fixed length) or [1, NT_total, HV, K, V] (packed), in q's dtype.

    Raises:
        NotImplementedError: ``cp_context``, an unknown keyword, or under
            autograd a lower-bound gate with λ below -5; the argument is named.
        TypeError: ``initial_state`` not fp32 (fla's check).
        ValueError: fla's argument errors (``cu_seqlens`` with B != 1, the number of initial states,
            ``chunk_size``, ``safe_gate`` / ``lower_bound``, ``allow_neg_eigval`` without sigmoid, a missing
            ``A_log``), ``initial_state`` of the wrong shape (named in the caller's layout), then kda_ops'
            validation of :func:`kda_ops.recurrent_kda` / :func:`kda_ops.kda`.
    """
    p = _chunk_plan(
        q, k, v, g, beta, scale, initial_state, output_final_state, use_qk_l2norm_in_kernel, use_gate_in_kernel,
        use_beta_sigmoid_in_kernel, allow_neg_eigval, safe_gate, lower_bound, disable_recompute,
        return_intermediate_states, state_v_first, cu_seqlens, cu_seqlens_cpu, cp_context, use_graph,
        max_num_seqs, kwargs,
    )  # fmt: skip
    v_first = p["state_v_first"]
    HV = v.shape[2]
    A_log, dt_bias, lb = _gate_args(use_gate_in_kernel, p["A_log"], p["dt_bias"], p["lower_bound"], HV, q.device)

    beta_k, logit = _beta_args(beta, use_beta_sigmoid_in_kernel, allow_neg_eigval)
    if p["grad"]:
        # every mode of fla's chunk_kda on kda_ops.kda: the three gates, logit or plain (or 2·sigmoid) beta, L2 on
        # or off, GVA, packed, a differentiable initial state in either layout
        h0 = None
        if initial_state is not None:
            h0 = initial_state if v_first else initial_state.transpose(-1, -2)
            h0 = h0.contiguous()
        # kda_ops.kda wants parameters and state in the training dtype (fp64 with fp64 tokens, CPU gradcheck)
        pdt = torch.float64 if q.dtype == torch.float64 else torch.float32
        A_log = None if A_log is None else A_log.to(pdt)
        dt_bias = None if dt_bias is None else dt_bias.to(pdt)
        h0 = None if h0 is None else h0.to(pdt)
        o, fs = kda(
            q, k, v, g, beta_k, A_log, dt_bias, h0,
            cu_seqlens=cu_seqlens, scale=scale, lower_bound=lb, output_final_state=bool(output_final_state),
            use_gate_in_kernel=use_gate_in_kernel, use_qk_l2norm_in_kernel=use_qk_l2norm_in_kernel,
            beta_is_logit=logit,
        )  # fmt: skip
        return o, _to_fla(fs, v_first)

    # fla never writes initial_state. Ours updates a pool in place, so: state_v_first (our layout) reads
    # the caller's tensor as a read-only source pool, no copy; fla's layout runs on a transposed copy,
    # which then is the final state.
    pool = src_kw = None
    if initial_state is not None:
        if v_first:
            N = q.shape[0] if cu_seqlens is None else cu_seqlens.shape[0] - 1
            ids = torch.arange(N, dtype=torch.int32, device=q.device)
            src_kw = dict(initial_state_source=initial_state, initial_state_indices=ids)
        else:
            pool = _to_ours(initial_state, v_first)
    ck_kwargs: dict[str, Any] = dict(src_kw or {})
    n = p["chunk_size"]
    if return_intermediate_states:
        ck_kwargs["checkpoint_every_n_tokens"] = n
        if cu_seqlens is not None and cu_seqlens_cpu is not None:
            # Row counts from the host mirror: no device sync for the checkpoint layout.
            cu = cu_seqlens_cpu.to(torch.int64)
            lens = (cu[1:] - cu[:-1]).clamp_min(0)
            starts = torch.zeros(cu.numel(), dtype=torch.int64)
            starts[1:] = torch.cumsum((lens + n - 1) // n, 0)
            rows = int(starts[-1])
            ck_dtype = torch.float32 if pool is None else pool.dtype
            ck_kwargs["checkpoint_cu_starts"] = starts.to(q.device)
            ck_kwargs["state_checkpoints"] = torch.zeros(
                (rows, HV, v.shape[-1], q.shape[-1]), dtype=ck_dtype, device=q.device
            )
    with torch.no_grad():
        res = _rk(
            q, k, v, g, beta_k, A_log, dt_bias, scale, pool, bool(output_final_state) or pool is not None,
            use_qk_l2norm_in_kernel, use_gate_in_kernel, lb, cu_seqlens,
            beta_is_logit=logit, **ck_kwargs,
        )  # fmt: skip
    o, fs = res[0], res[1]
    fs = _to_fla(fs, v_first) if output_final_state else None
    if not return_intermediate_states:
        return o, fs
    ck = res[2]  # [C, HV, V, K], sequence-major then chunk
    B = q.shape[0]
    h = ck.view(B, -1, *ck.shape[1:]) if cu_seqlens is None else ck.unsqueeze(0)
    h = (h if v_first else h.transpose(-1, -2)).to(q.dtype).contiguous()
    return o, fs, h


# ---------------------------------------------------------------------------------------------------
# fused_recurrent_kda_fwd / fused_recurrent_kda


def _recurrent_plan(
    q: torch.Tensor,
    v: torch.Tensor,
    beta: torch.Tensor,
    initial_state: torch.Tensor | None,
    output_final_state: bool,
    inplace_final_state: bool,
    cu_seqlens: torch.Tensor | None,
    ssm_state_indices: torch.Tensor | None,
    num_accepted_tokens: torch.Tensor | None,
    use_beta_sigmoid_in_kernel: bool,
    allow_neg_eigval: bool,
    state_v_first: bool,
    kwargs: dict[str, Any],
    fn: str,
) -> int:
    """Checks shared by the two recurrent entry points; returns S (speculative tokens, 0 = none)."""
    _reject_unknown(kwargs, fn)
    if allow_neg_eigval and not use_beta_sigmoid_in_kernel:
        raise ValueError("`allow_neg_eigval=True` requires `use_beta_sigmoid_in_kernel=True`.")
    if beta.dim() == v.dim():
        raise NotImplementedError(f"kda_ops.fla.{fn}: head-wise beta [B, T, HV, V] is not supported (beta [B, T, HV])")
    if inplace_final_state and initial_state is None:
        raise ValueError("inplace_final_state=True needs initial_state (the state pool updated in place)")
    _check_state_layout(initial_state, q, v, state_v_first)
    S = 0
    if ssm_state_indices is not None:
        if not inplace_final_state:
            raise NotImplementedError(
                f"kda_ops.fla.{fn}: ssm_state_indices with inplace_final_state=False is not supported (the pool is "
                f"updated in place)"
            )
        if ssm_state_indices.dim() == 2:
            S = ssm_state_indices.shape[1] - 1
            N = q.shape[0] if cu_seqlens is None else cu_seqlens.shape[0] - 1
            T = q.shape[1]
            per = T if cu_seqlens is None else None
            if S > 0 and ((per is not None and per != 1 + S) or (per is None and T != N * (1 + S))):
                raise NotImplementedError(
                    f"kda_ops.fla.{fn}: with ssm_state_indices [N, {1 + S}] every sequence must have exactly "
                    f"{1 + S} tokens (speculative decode), got T={T} for N={N} sequences"
                )
    return S


def fused_recurrent_kda_fwd(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    A_log: torch.Tensor | None = None,
    dt_bias: torch.Tensor | None = None,
    initial_state: torch.Tensor | None = None,
    scale: float | None = None,
    output_final_state: bool = False,
    inplace_final_state: bool = True,
    state_v_first: bool = False,
    cu_seqlens: torch.LongTensor | None = None,
    ssm_state_indices: torch.Tensor | None = None,
    num_accepted_tokens: torch.Tensor | None = None,
    use_qk_l2norm_in_kernel: bool = False,
    use_gate_in_kernel: bool = False,
    use_beta_sigmoid_in_kernel: bool = False,
    allow_neg_eigval: bool = False,
    lower_bound: float | None = None,
    out: torch.Tensor | None = None,
    **kwargs: Any,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """fla's ``fused_recurrent_kda_fwd`` (0.6) on kda_ops: the token-serial forward vLLM and SGLang call
    for decode, with a state pool, ``ssm_state_indices`` and ``num_accepted_tokens`` (spec decode).
    Runs :func:`kda_ops.recurrent_kda` without autograd.

    Args:
        q, k: [B, T, H, K]; v: [B, T, HV, V]; g: [B, T, HV, K]; beta: [B, T, HV] (a head-wise beta
            [B, T, HV, V] is not supported). One float dtype; bf16 on CUDA.
        A_log, dt_bias: fp32 [HV] and [HV*K] gate parameters of ``use_gate_in_kernel``, or None.
        initial_state: the state pool [N_pool, HV, K, V] ([N_pool, HV, V, K] with ``state_v_first``),
            fp32 or bf16 (also fp64 on CPU); updated in place with ``inplace_final_state``, else read only
            (start states, then also any float dtype in fla's layout).
        scale: query scale; None: 1/sqrt(K).
        output_final_state: with ``inplace_final_state=False``, return a new final state.
        inplace_final_state: True: ``initial_state`` is the pool, updated in place. Without
            ``ssm_state_indices`` sequence n uses slot n.
        state_v_first: the layout of ``initial_state`` and of the returned state.
        cu_seqlens: int32/int64 [N+1] packed sequence starts (B must be 1).
        ssm_state_indices: int32/int64 [N]: sequence n reads and writes slot ``ssm_state_indices[n]``;
            [N, 1+S] (speculative decode, every sequence exactly 1+S tokens): the state after token t goes
            to slot ``[n, t]``. Needs ``inplace_final_state``.
        num_accepted_tokens: int32/int64 [N]: with [N, 1+S] indices the start state is read from slot
            ``[n, num_accepted_tokens[n] - 1]`` (slot ``[n, 0]`` without it).
        use_qk_l2norm_in_kernel, use_gate_in_kernel, use_beta_sigmoid_in_kernel, allow_neg_eigval,
            lower_bound: as for :func:`chunk_kda`.
        out: optional output buffer [B, T, HV, V] of q's dtype.
        **kwargs: ``transpose_state_layout`` (the deprecated name of ``state_v_first``); nothing else.

    Returns:
        ``(o, state)``: o [B, T, HV, V] in q's dtype. With ``inplace_final_state``, state is
        ``initial_state`` itself (updated); otherwise a new fp32 final state in the caller's layout when
        ``output_final_state``, else None.

    Raises:
        NotImplementedError: a head-wise beta, ``ssm_state_indices`` with ``inplace_final_state=False``,
            [N, 1+S] indices with other than 1+S tokens per sequence, an unknown keyword.
        ValueError: ``inplace_final_state`` without ``initial_state``, ``allow_neg_eigval`` without sigmoid,
            ``initial_state`` of the wrong shape (named in the caller's layout), then kda_ops' validation of
            :func:`kda_ops.recurrent_kda`.

    Differences from fla (both deliberate, docs/fla.md): a slot index outside the pool (vLLM's padding
    slot -1) makes the sequence inactive (zero output, no state read or write) instead of reading out of
    bounds; ``num_accepted_tokens`` without ``ssm_state_indices`` is ignored, as in fla.
    """
    state_v_first = _pop_deprecated_layout(kwargs, state_v_first)
    S = _recurrent_plan(
        q, v, beta, initial_state, output_final_state, inplace_final_state, cu_seqlens, ssm_state_indices,
        num_accepted_tokens, use_beta_sigmoid_in_kernel, allow_neg_eigval, state_v_first, kwargs,
        "fused_recurrent_kda_fwd",
    )  # fmt: skip
    HV = v.shape[2]
    A, dtb, lb = _gate_args(use_gate_in_kernel, A_log, dt_bias, lower_bound, HV, q.device)
    beta_k, logit = _beta_args(beta, use_beta_sigmoid_in_kernel, allow_neg_eigval)
    common: dict[str, Any] = dict(
        use_qk_l2norm_in_kernel=use_qk_l2norm_in_kernel,
        use_gate_in_kernel=use_gate_in_kernel,
        lower_bound=lb,
        cu_seqlens=cu_seqlens,
        beta_is_logit=logit,
        output=out,
    )
    idx = _index_i32(ssm_state_indices)
    n_acc = _index_i32(num_accepted_tokens) if (S > 0 and idx is not None) else None
    spec: dict[str, Any] = dict(num_spec_tokens=S, num_accepted_tokens=n_acc) if S > 0 else {}
    if idx is not None and idx.dim() == 2 and S == 0:
        idx = idx[:, 0].contiguous()  # [N, 1]: one token per sequence, plain decode

    with torch.no_grad():
        if not inplace_final_state:
            src = None
            if initial_state is not None:
                src = _to_ours(initial_state, state_v_first) if not state_v_first else initial_state
            N = q.shape[0] if cu_seqlens is None else cu_seqlens.shape[0] - 1
            if src is not None:
                ids = torch.arange(N, dtype=torch.int32, device=q.device)
                o, fs = _rk(
                    q, k, v, g, beta_k, A, dtb, scale, None, bool(output_final_state),
                    initial_state_source=src, initial_state_indices=ids, **common,
                )  # fmt: skip
            else:
                o, fs = _rk(q, k, v, g, beta_k, A, dtb, scale, None, bool(output_final_state), **common)
            return o, _to_fla(fs, state_v_first)

        assert initial_state is not None
        if state_v_first:
            o, _ = _rk(q, k, v, g, beta_k, A, dtb, scale, initial_state, False, ssm_state_indices=idx, **spec, **common)
            return o, initial_state
        # fla's [N_pool, HV, K, V] pool: gather the slots this call touches into our layout, run, scatter back.
        n_pool = initial_state.shape[0]
        if idx is None:
            N = q.shape[0] if cu_seqlens is None else cu_seqlens.shape[0] - 1
            slots = torch.arange(min(N, n_pool), device=q.device)
            local = None
        else:
            flat = idx.reshape(-1).to(torch.int64)
            valid = (flat >= 0) & (flat < n_pool)
            slots = flat[valid]  # a host sync: drops padding slots before the gather
            pos = torch.full_like(flat, -1)
            pos[valid] = torch.arange(slots.numel(), device=q.device)
            local = pos.to(torch.int32).view(idx.shape)
        work = initial_state.index_select(0, slots).transpose(-1, -2).contiguous()
        o, _ = _rk(q, k, v, g, beta_k, A, dtb, scale, work, False, ssm_state_indices=local, **spec, **common)
        initial_state.index_copy_(0, slots, work.transpose(-1, -2).to(initial_state.dtype))
        return o, initial_state


def fused_recurrent_kda(
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
    use_qk_l2norm_in_kernel: bool = False,
    use_gate_in_kernel: bool = False,
    use_beta_sigmoid_in_kernel: bool = False,
    allow_neg_eigval: bool = False,
    lower_bound: float | None = None,
    state_v_first: bool = False,
    cu_seqlens: torch.LongTensor | None = None,
    **kwargs: Any,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """fla's ``fused_recurrent_kda`` (0.6) on kda_ops: forward only (fla's has no backward either), through
    :func:`fused_recurrent_kda_fwd` with ``inplace_final_state=False``.

    Args:
        q, k: [B, T, H, K]; v: [B, T, HV, V]; g: [B, T, HV, K]; beta: [B, T, HV] (a head-wise beta
            [B, T, HV, V] is not supported). One float dtype; bf16 on CUDA.
        A_log, dt_bias: fp32 [HV] and [HV*K] gate parameters of ``use_gate_in_kernel``, or None.
        scale: query scale; None: 1/sqrt(K).
        initial_state: start states [N, HV, K, V] ([N, HV, V, K] with ``state_v_first``); read, never
            written. Any float dtype in fla's layout (copied to fp32); fp32 or bf16 (also fp64 on CPU)
            with ``state_v_first``.
        output_final_state: also return the final state.
        use_qk_l2norm_in_kernel, use_gate_in_kernel, use_beta_sigmoid_in_kernel, allow_neg_eigval,
            lower_bound: as for :func:`chunk_kda`.
        state_v_first: the layout of ``initial_state`` and of the final state.
        cu_seqlens: int32/int64 [N+1] packed sequence starts (B must be 1).
        **kwargs: ``transpose_state_layout`` (the deprecated name of ``state_v_first``); nothing else.

    Returns:
        ``(o, final_state)``: o [B, T, HV, V] in q's dtype; final_state a new fp32 tensor in the layout of
        ``initial_state``, or None without ``output_final_state``.

    Raises:
        NotImplementedError: a head-wise beta, an unknown keyword.
        ValueError: fla's packed-input errors (B != 1, the number of initial states), ``allow_neg_eigval``
            without sigmoid, ``initial_state`` of the wrong shape (named in the caller's layout), then kda_ops'
            validation of :func:`kda_ops.recurrent_kda`.
    """
    state_v_first = _pop_deprecated_layout(kwargs, state_v_first)
    _check_packed(q, initial_state, cu_seqlens)
    return fused_recurrent_kda_fwd(
        q=q, k=k, v=v, g=g, beta=beta, A_log=A_log, dt_bias=dt_bias, scale=scale, initial_state=initial_state,
        inplace_final_state=False, output_final_state=output_final_state,
        use_qk_l2norm_in_kernel=use_qk_l2norm_in_kernel, use_gate_in_kernel=use_gate_in_kernel,
        use_beta_sigmoid_in_kernel=use_beta_sigmoid_in_kernel, allow_neg_eigval=allow_neg_eigval,
        lower_bound=lower_bound, cu_seqlens=cu_seqlens, state_v_first=state_v_first, **kwargs,
    )  # fmt: skip


# ---------------------------------------------------------------------------------------------------
# routing fla's own entry points to kda_ops

ENV_VAR = "FLA_KDA_OPS"  # "0" turns the installed backend off (fla's usual per-backend switch)
_installed: list[Any] = []


def _backend_class() -> type:
    from fla.backends import BaseBackend

    class KdaOpsBackend(BaseBackend):
        """kda_ops as a backend of fla's dispatcher for ``chunk_kda`` and ``fused_recurrent_kda_fwd``.

        A call kda_ops cannot take (its verifier raises) falls through to fla's next backend or to fla's
        Triton kernels, so installing never turns a working call into an error.
        """

        backend_type = "kda_ops"
        package_name = "kda_ops"
        env_var = ENV_VAR
        default_enable = True
        priority = 1  # ahead of fla's other KDA backends (flash_kda is 3)

        def chunk_kda_verifier(self, *args: Any, **kw: Any) -> tuple[bool, str | None]:
            return _verify(chunk_kda, _chunk_kda_probe, args, kw)

        def chunk_kda(self, *args: Any, **kw: Any) -> Any:
            return chunk_kda(*args, **kw)

        def fused_recurrent_kda_fwd_verifier(self, *args: Any, **kw: Any) -> tuple[bool, str | None]:
            return _verify(fused_recurrent_kda_fwd, _recurrent_probe, args, kw)

        def fused_recurrent_kda_fwd(self, *args: Any, **kw: Any) -> Any:
            return fused_recurrent_kda_fwd(*args, **kw)

    return KdaOpsBackend


@functools.cache
def _params(fn: Any) -> tuple[inspect.Signature, tuple[str, ...], frozenset[str], dict[str, Any]]:
    """fn's signature, its positional parameter names, every named parameter, the defaults (once per function)."""
    sig = inspect.signature(fn)
    ps = sig.parameters.values()
    pos = tuple(p.name for p in ps if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD))
    named = frozenset(p.name for p in ps if p.kind not in (p.VAR_POSITIONAL, p.VAR_KEYWORD))
    defaults = {p.name: p.default for p in ps if p.default is not p.empty}
    return sig, pos, named, defaults


def _bind(fn: Any, args: tuple[Any, ...], kw: dict[str, Any]) -> dict[str, Any]:
    """The arguments of a call of fn by name (defaults applied, extra keywords flattened in), as
    inspect.Signature.bind + apply_defaults would give them, without their ~50 µs per call on every dispatched
    fla call; an irregular call (too many positionals, a name given twice, a missing argument) goes through
    Signature.bind, which raises fla's usual TypeError."""
    sig, pos, named, defaults = _params(fn)
    if len(args) <= len(pos) and not any(n in kw for n in pos[: len(args)]):
        out = dict(defaults)
        out.update(zip(pos[: len(args)], args, strict=True))
        extra = {k: x for k, x in kw.items() if k not in named}
        out.update((k, x) for k, x in kw.items() if k in named)
        if all(n in out for n in named):
            out.pop("kwargs", None)
            out.update(extra)
            return out
    b = sig.bind(*args, **kw)
    b.apply_defaults()
    res = dict(b.arguments)
    res.update(res.pop("kwargs", {}))
    return res


def _device_ok(q: torch.Tensor) -> str | None:
    if q.device.type == "cuda":
        if not torch._C._dispatch_has_kernel_for_dispatch_key("kda::recurrent_kda", "CUDA"):
            return "kda_ops was built without CUDA kernels"
        if q.dtype != torch.bfloat16:
            return f"kda_ops' CUDA kernels take bf16 tokens, got {q.dtype}"
        if q.shape[-1] not in (64, 128):
            return f"kda_ops' CUDA kernels take K in (64, 128), got {q.shape[-1]}"
    return None


def _chunk_kda_probe(a: dict[str, Any]) -> str | None:
    kw = {k: a[k] for k in a if k not in _CHUNK_POSITIONAL}
    p = _chunk_plan(*(a[k] for k in _CHUNK_POSITIONAL), kw)  # type: ignore[arg-type, call-arg]
    q, v = a["q"], a["v"]
    # (the training path takes K == V in {64, 128} on CUDA, the chunked prefill K == V == 128)
    dims = (64, 128) if p["grad"] else (128,)
    if q.device.type == "cuda" and (q.shape[-1] not in dims or v.shape[-1] != q.shape[-1]):
        path = "training" if p["grad"] else "chunked"
        return f"kda_ops' CUDA {path} path takes K == V in {dims}, got K={q.shape[-1]}, V={v.shape[-1]}"
    return _device_ok(q)


def _recurrent_probe(a: dict[str, Any]) -> str | None:
    known = set(_RECURRENT_ARGS)
    _recurrent_plan(
        a["q"], a["v"], a["beta"], a["initial_state"], a["output_final_state"], a["inplace_final_state"],
        a["cu_seqlens"], a["ssm_state_indices"], a["num_accepted_tokens"], a["use_beta_sigmoid_in_kernel"],
        a["allow_neg_eigval"], bool(a["state_v_first"] or a.get("transpose_state_layout")),
        {k: x for k, x in a.items() if k not in known and k != "transpose_state_layout"}, "fused_recurrent_kda_fwd",
    )  # fmt: skip
    if a["q"].shape[-1] != a["v"].shape[-1] and a["q"].device.type == "cuda":
        return "kda_ops' CUDA kernels take K == V"
    return _device_ok(a["q"])


_CHUNK_POSITIONAL = (
    "q", "k", "v", "g", "beta", "scale", "initial_state", "output_final_state", "use_qk_l2norm_in_kernel",
    "use_gate_in_kernel", "use_beta_sigmoid_in_kernel", "allow_neg_eigval", "safe_gate", "lower_bound",
    "disable_recompute", "return_intermediate_states", "state_v_first", "cu_seqlens", "cu_seqlens_cpu",
    "cp_context", "use_graph", "max_num_seqs",
)  # fmt: skip
_RECURRENT_ARGS = (
    "q", "k", "v", "g", "beta", "A_log", "dt_bias", "initial_state", "scale", "output_final_state",
    "inplace_final_state", "state_v_first", "cu_seqlens", "ssm_state_indices", "num_accepted_tokens",
    "use_qk_l2norm_in_kernel", "use_gate_in_kernel", "use_beta_sigmoid_in_kernel", "allow_neg_eigval",
    "lower_bound", "out",
)  # fmt: skip


def _verify(fn: Any, probe: Any, args: tuple[Any, ...], kw: dict[str, Any]) -> tuple[bool, str | None]:
    try:
        why = probe(_bind(fn, args, kw))
    except (NotImplementedError, ValueError, TypeError) as e:
        return False, str(e)
    return (why is None), why


def install() -> None:
    """Register kda_ops as a backend of fla's dispatcher (``fla.ops.kda.chunk_kda`` and the
    ``fused_recurrent_kda_fwd`` that fla's ``fused_recurrent_kda``, vLLM and SGLang call).

    Idempotent; takes no arguments and returns None. Needs fla-core 0.6 importable. Calls kda_ops cannot
    take (see each function's NotImplementedError cases, and on CUDA: bf16 tokens, K == V in (64, 128);
    chunk_kda K == V == 128) fall back to fla's own kernels. ``FLA_KDA_OPS=0`` in the environment turns the
    backend off; :func:`uninstall` removes it.

    Raises:
        ImportError: fla-core is not importable.
        RuntimeError: fla's backend dispatch is disabled (``FLA_DISABLE_BACKEND_DISPATCH=1``, fla's switch
            that bypasses every backend), so nothing could be routed.
    """
    if _installed:
        return
    import fla.backends as fb
    import fla.ops.kda  # noqa: F401  (loads fla's KDA backends and creates the registries)
    from fla.ops.kda.chunk import chunk_kda as fla_chunk_kda

    if getattr(fb, "_DISPATCH_DISABLED", False):
        raise RuntimeError("fla's backend dispatch is disabled (FLA_DISABLE_BACKEND_DISPATCH=1); kda_ops cannot route")
    cls = _backend_class()
    fb.register(fla_chunk_kda)(cls)
    fb.register("kda")(cls)
    _installed.append(cls)


def uninstall() -> None:
    """Remove the backend :func:`install` registered (fla's kernels take every call again).

    Takes no arguments and returns None; a no-op when nothing is installed. Raises ImportError only if
    fla-core stopped being importable after :func:`install`.
    """
    if not _installed:
        return
    import inspect

    import fla.backends as fb
    from fla.ops.kda.chunk import chunk_kda as fla_chunk_kda

    for reg in (fb._function_registries.get(inspect.unwrap(fla_chunk_kda)), fb._operation_registries.get("kda")):
        if reg is not None:
            reg._backends.pop("kda_ops", None)
    _installed.clear()


def installed() -> bool:
    """True when :func:`install` has registered the backend (and ``FLA_KDA_OPS`` is not "0")."""
    return bool(_installed) and os.environ.get(ENV_VAR, "1") != "0"
