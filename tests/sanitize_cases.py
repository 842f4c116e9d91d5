"""Every CUDA op and mode on tiny shapes, in one process, for compute-sanitizer (scripts/sanitize.sh).

Run under each tool as
    PYTORCH_NO_CUDA_MEMORY_CACHING=1 compute-sanitizer --tool memcheck --error-exitcode 1 \\
        python3 tests/sanitize_cases.py
With the caching allocator off every tensor is its own cudaMalloc, so memcheck sees an access past any
tensor and initcheck sees reads of memory nobody wrote. Views with padded strides are carved out of
UNINITIALIZED buffers (only the view is written): a kernel that reads padding or past a view shows up in
initcheck, one that writes there in the bit-identity checks below. After every case the results are
read back on the device (initcheck: every output element must have been written) and compared loosely
(finite; the tests hold the numerics).

Shapes: T and lengths not multiples of any tile (1, 15, 17, 33, 65, 70), zero-length sequences, T = 0,
GQA and odd head counts, speculative decode, checkpoints, read-only source pools, padded pools, strided
and misaligned token views, and broken device-value contracts (non-monotone / out-of-range cu_seqlens,
out-of-range and duplicate slots, extreme accepted counts, broken checkpoint starts and seq_order). The
training ops run when ``torch.ops.kda.recurrent_kda_training_forward`` works on CUDA (NotImplementedError:
skipped).

Prints one line per case and ends with ``SANITIZE_CASES run=<n> skipped=<n> failed=<n>``; exits 1 when a
case raised an unexpected exception.

    python3 tests/sanitize_cases.py --list
    python3 tests/sanitize_cases.py --only 'spec|broken'
    python3 tests/sanitize_cases.py --device cpu     # the harness itself, on the CPU ops
"""

from __future__ import annotations

import argparse
import re
import sys
import time
import traceback
from collections.abc import Callable

import torch
from _raw_ops import raw_recurrent, strided_copy

import kda_ops

DEV = "cuda"
BF16 = torch.bfloat16
I32_MAX, I32_MIN = 2**31 - 1, -(2**31)
CASES: list[tuple[str, Callable[[], None]]] = []


class Skip(Exception):
    """A case that does not apply on this build (reported as skipped)."""


def case(name: str):
    def deco(fn):
        CASES.append((name, fn))
        return fn

    return deco


def sync() -> None:
    if DEV == "cuda":
        torch.cuda.synchronize()


def consume(*ts: torch.Tensor | None) -> None:
    """Reads every element on the device (initcheck: all of it must have been written) and checks it."""
    for t in ts:
        if t is None or t.numel() == 0:
            continue
        ok = bool(torch.isfinite(t.float()).all())
        if not ok:
            raise AssertionError(f"non-finite values in a result of shape {tuple(t.shape)}")


def gen(seed: int) -> torch.Generator:
    return torch.Generator(device=DEV).manual_seed(seed)


def rnd(g: torch.Generator, *shape, dtype=BF16, s: float = 1.0) -> torch.Tensor:
    return (torch.randn(*shape, generator=g, device=DEV) * s).to(dtype)


def carve_uninit(src: torch.Tensor, pads: dict[int, int] | None = None, lead: int = 16, tail: int = 16) -> torch.Tensor:
    """`src` copied into a view of an UNINITIALIZED buffer: offset `lead`, stride of dim d padded by pads[d]
    elements (last dim contiguous). Only the view's elements are ever written."""
    return strided_copy(src, None, pads, lead, tail)[0]


def tokens(g, B, T, H, HV, K, *, gate="lower_bound", logit=True, l2=True) -> dict:
    q, k = rnd(g, B, T, H, K), rnd(g, B, T, H, K, s=1.0 if l2 else 0.1)
    v, graw = rnd(g, B, T, HV, K), rnd(g, B, T, HV, K)
    gg = graw if gate != "precomputed" else (-torch.nn.functional.softplus(graw.float())).to(BF16)
    beta = rnd(g, B, T, HV) if logit else torch.rand(B, T, HV, generator=g, device=DEV).to(BF16)
    return dict(q=q, k=k, v=v, g=gg, beta=beta)


def gate_kw(g, HV, K, gate) -> dict:
    if gate == "precomputed":
        return dict(use_gate_in_kernel=False)
    return dict(
        use_gate_in_kernel=True,
        A_log=torch.rand(HV, generator=g, device=DEV) * 0.5,
        dt_bias=torch.randn(HV, K, generator=g, device=DEV) * 0.1,
        lower_bound=-5.0 if gate == "lower_bound" else None,
    )


def cu_of(lengths, dtype=torch.int64) -> torch.Tensor:
    c = [0]
    for n in lengths:
        c.append(c[-1] + n)
    return torch.tensor(c, dtype=dtype, device=DEV)


def pool_of(g, n, HV, K, dtype) -> torch.Tensor:
    return rnd(g, n, HV, K, K, dtype=dtype, s=0.1)


R = kda_ops.recurrent_kda
HEAD_DIMS = (64, 128)
POOLS = (torch.bfloat16, torch.float32)


# ---------------------------------------------------------------------------------------------------
# recurrent_kda: every mode


def _register_recurrent() -> None:
    modes = [("precomputed", False, False), ("softplus", True, True), ("lower_bound", True, True)]
    for K in HEAD_DIMS:
        for pdt in POOLS:
            pn = "bf16" if pdt == BF16 else "fp32"
            for gate, logit, l2 in modes:

                @case(f"decode_fixed_K{K}_{pn}_{gate}_logit{int(logit)}_l2{int(l2)}")
                def _(K=K, pdt=pdt, gate=gate, logit=logit, l2=l2):
                    g = gen(1)
                    B, H, HV = 3, 1, 3  # an odd head count
                    t = tokens(g, B, 1, H, HV, K, gate=gate, logit=logit, l2=l2)
                    pool = pool_of(g, 4, HV, K, pdt)
                    idx = torch.tensor([2, -1, 0], dtype=torch.int32, device=DEV)
                    o, _ = R(
                        **t,
                        **gate_kw(g, HV, K, gate),
                        initial_state=pool,
                        ssm_state_indices=idx,
                        beta_is_logit=logit,
                        use_qk_l2norm_in_kernel=l2,
                    )
                    sync()
                    consume(o, pool)

            @case(f"prefill_fixed_gqa_T17_K{K}_{pn}")
            def _(K=K, pdt=pdt):
                g = gen(2)
                B, T, H, HV = 2, 17, 2, 6
                t = tokens(g, B, T, H, HV, K)
                pool = pool_of(g, 3, HV, K, pdt)
                o, _ = R(
                    **t,
                    **gate_kw(g, HV, K, "lower_bound"),
                    initial_state=pool,
                    beta_is_logit=True,
                    ssm_state_indices=torch.tensor([2, 0], dtype=torch.int32, device=DEV),
                )
                sync()
                consume(o, pool)

            for cu_dt in (torch.int32, torch.int64):
                cn = "i32" if cu_dt == torch.int32 else "i64"

                @case(f"prefill_packed_K{K}_{pn}_cu{cn}")
                def _(K=K, pdt=pdt, cu_dt=cu_dt):
                    g = gen(3)
                    lengths = [0, 1, 17, 0, 70, 33]
                    H, HV = 1, 2
                    t = tokens(g, 1, sum(lengths), H, HV, K, gate="softplus")
                    pool = pool_of(g, 8, HV, K, pdt)
                    idx = torch.tensor([5, 0, 1, 2, 100, 7], dtype=torch.int32, device=DEV)  # 100: inactive
                    o, fs = R(
                        **t,
                        **gate_kw(g, HV, K, "softplus"),
                        initial_state=pool,
                        cu_seqlens=cu_of(lengths, cu_dt),
                        ssm_state_indices=idx,
                        beta_is_logit=True,
                        output_final_state=True,
                    )
                    sync()
                    consume(o, pool)

            @case(f"prefill_packed_seq_order_output_K{K}_{pn}")
            def _(K=K, pdt=pdt):
                g = gen(4)
                lengths = [15, 0, 65, 2]
                H, HV = 2, 4
                t = tokens(g, 1, sum(lengths), H, HV, K)
                pool = pool_of(g, 4, HV, K, pdt)
                out = torch.empty(1, sum(lengths), HV, K, dtype=BF16, device=DEV)
                order = torch.tensor([2, 0, 3, 1], dtype=torch.int32, device=DEV)
                R(
                    **t,
                    **gate_kw(g, HV, K, "lower_bound"),
                    initial_state=pool,
                    cu_seqlens=cu_of(lengths),
                    seq_order=order,
                    output=out,
                    beta_is_logit=True,
                    prefill_workspace=kda_ops.RecurrentKDAPrefillWorkspace(),
                )
                sync()
                consume(out, pool)

            for every in (16, 32):

                @case(f"checkpoints_every{every}_K{K}_{pn}")
                def _(K=K, pdt=pdt, every=every):
                    g = gen(5)
                    lengths = [0, 15, 16, 17, 65]
                    H, HV = 1, 2
                    t = tokens(g, 1, sum(lengths), H, HV, K)
                    pool = pool_of(g, 5, HV, K, pdt)
                    o, _, ck = R(
                        **t,
                        **gate_kw(g, HV, K, "lower_bound"),
                        initial_state=pool,
                        cu_seqlens=cu_of(lengths),
                        beta_is_logit=True,
                        checkpoint_every_n_tokens=every,
                    )
                    sync()
                    consume(o, pool, ck)

            @case(f"checkpoints_fixed_given_buffers_K{K}_{pn}")
            def _(K=K, pdt=pdt):
                g = gen(6)
                B, T, H, HV = 2, 33, 1, 2
                t = tokens(g, B, T, H, HV, K)
                pool = pool_of(g, 2, HV, K, pdt)
                ck = torch.empty(2 * 3, HV, K, K, dtype=pdt, device=DEV)  # every row is written
                starts = torch.tensor([0, 3, 6], dtype=torch.int64, device=DEV)
                o, _, ck = R(
                    **t,
                    **gate_kw(g, HV, K, "lower_bound"),
                    initial_state=pool,
                    beta_is_logit=True,
                    checkpoint_every_n_tokens=16,
                    state_checkpoints=ck,
                    checkpoint_cu_starts=starts,
                )
                sync()
                consume(o, pool, ck)

            for packed in (False, True):

                @case(f"spec_decode_{'packed' if packed else 'fixed'}_K{K}_{pn}")
                def _(K=K, pdt=pdt, packed=packed):
                    g = gen(7)
                    S, N, H, HV = 3, 3, 1, 2
                    B, T = (1, N * (1 + S)) if packed else (N, 1 + S)
                    t = tokens(g, B, T, H, HV, K)
                    pool = pool_of(g, 13, HV, K, pdt)
                    idx = torch.tensor([[0, 1, 2, 3], [4, -1, 6, 7], [8, 9, 10, 11]], dtype=torch.int32, device=DEV)
                    acc = torch.tensor([0, 2, 5], dtype=torch.int32, device=DEV)  # clamped to [0, S]
                    extra = dict(cu_seqlens=torch.arange(N + 1, device=DEV) * (1 + S)) if packed else {}
                    o, _ = R(
                        **t,
                        **gate_kw(g, HV, K, "lower_bound"),
                        initial_state=pool,
                        ssm_state_indices=idx,
                        num_spec_tokens=S,
                        num_accepted_tokens=acc,
                        beta_is_logit=True,
                        **extra,
                    )
                    sync()
                    consume(o, pool)

            @case(f"state_source_K{K}_{pn}")
            def _(K=K, pdt=pdt):
                g = gen(8)
                B, T, H, HV = 3, 5, 1, 2
                t = tokens(g, B, T, H, HV, K, gate="precomputed", logit=False)
                pool = pool_of(g, 3, HV, K, pdt)
                src = pool_of(g, 4, HV, K, torch.float32 if pdt == BF16 else BF16)
                o, _ = R(
                    **t,
                    initial_state=pool,
                    initial_state_source=src,
                    initial_state_indices=torch.tensor([3, 9, 0], dtype=torch.int32, device=DEV),
                    ssm_state_indices=torch.tensor([0, 1, 2], dtype=torch.int32, device=DEV),
                )
                sync()
                consume(o, pool)

            @case(f"padded_pool_strided_views_K{K}_{pn}")
            def _(K=K, pdt=pdt):
                g = gen(9)
                B, T, H, HV, n_pool = 2, 6, 2, 4, 3
                t = tokens(g, B, T, H, HV, K)
                inner = HV * K * K
                pool = carve_uninit(pool_of(g, n_pool, HV, K, pdt), pads={0: 32}, lead=inner + 32, tail=inner + 32)
                tv = {n: carve_uninit(x, pads={2: 8} if x.dim() == 4 else {1: 3}) for n, x in t.items()}
                tv["g"] = carve_uninit(t["g"], pads={2: 3}, lead=1)  # misaligned, odd stride: the op copies it
                out = carve_uninit(torch.zeros(B, T, HV, K, dtype=BF16, device=DEV), pads={2: 8})
                R(
                    **tv,
                    **gate_kw(g, HV, K, "lower_bound"),
                    initial_state=pool,
                    output=out,
                    beta_is_logit=True,
                    ssm_state_indices=torch.tensor([2, 0], dtype=torch.int32, device=DEV),
                )
                sync()
                consume(out, pool)

        @case(f"no_pool_final_state_K{K}")
        def _(K=K):
            g = gen(10)
            lengths = [3, 0, 17]
            t = tokens(g, 1, 20, 1, 2, K, logit=False, l2=False, gate="precomputed")
            o, fs = R(**t, cu_seqlens=cu_of(lengths), output_final_state=True, use_qk_l2norm_in_kernel=False)
            sync()
            consume(o, fs)

        @case(f"empty_T0_K{K}")
        def _(K=K):
            g = gen(11)
            for B, lengths in ((2, None), (1, [0, 0])):
                t = tokens(g, B, 0, 1, 2, K)
                pool = pool_of(g, 2, 2, K, torch.float32)
                extra = dict(cu_seqlens=cu_of(lengths)) if lengths else {}
                o, fs = R(**t, **gate_kw(g, 2, K, "lower_bound"), initial_state=pool, beta_is_logit=True, **extra)
                o2, fs2 = R(**t, output_final_state=True, **extra)
                sync()
                consume(o, pool, fs2)

    @case("chunked_backend")
    def _():
        # The chunked tensor-core kernel: packed mix of empty, 1-token, partial and multi-chunk rows, an
        # inactive slot, checkpoints every 16 tokens, bf16 pool; then unbounded softplus decays (the exact
        # pairwise fallback) and a fixed-layout call with an fp32 final state.
        g = gen(12)
        lengths = [0, 1, 37, 16, 70]
        t = tokens(g, 1, sum(lengths), 1, 2, 128)
        pool = pool_of(g, 6, 2, 128, torch.bfloat16)
        slots = torch.tensor([0, 1, -1, 3, 4], dtype=torch.int32, device=DEV)
        o, _, ck = R(**t, **gate_kw(g, 2, 128, "lower_bound"), initial_state=pool, beta_is_logit=True,
                     cu_seqlens=cu_of(lengths), ssm_state_indices=slots, checkpoint_every_n_tokens=16,
                     backend="chunked")  # fmt: skip
        t2 = tokens(g, 2, 33, 1, 2, 128)
        t2["g"] = torch.full_like(t2["g"], 40.0)
        kw2 = gate_kw(g, 2, 128, "softplus")
        kw2["A_log"] = torch.full_like(kw2["A_log"], 2.0)
        o2, fs2 = R(**t2, **kw2, output_final_state=True, backend="chunked")
        sync()
        consume(o, pool, ck, o2, fs2)


# ---------------------------------------------------------------------------------------------------
# broken device-value contracts (the raw op: the public API's host checks bypassed)


raw = raw_recurrent


BROKEN = {
    "cu_non_monotone": dict(cu=[0, 9, 4, 13]),
    "cu_out_of_range": dict(cu=[-7, 5, 40, 13]),
    "cu_huge": dict(cu=[0, 2**40, -(2**40), 13]),
    "cu_not_covering": dict(cu=[2, 5, 9, 9]),
    "cu_int32_extremes": dict(cu=[I32_MIN, I32_MAX, 0, 13], cu_dtype=torch.int32),
    "slots_out_of_range": dict(slots=[6, I32_MAX, I32_MIN]),
    "slots_duplicate": dict(slots=[1, 1, 1]),
    "spec_accepted": dict(spec=2, accepted=[0, I32_MIN, I32_MAX]),
    "spec_slots": dict(spec=2, spec_slots=[[0, 7, 1], [I32_MIN, 2, 3], [4, I32_MAX, -1]]),
    "source_out_of_range": dict(source=[3, -3, I32_MAX]),
    "ckpt_starts": dict(ckpt=[0, -5, 2**40, 3]),
    "seq_order": dict(order=[0, 0, 5]),
    "seq_order_extremes": dict(order=[-1, I32_MAX, I32_MIN]),
}


def _register_broken() -> None:
    for name, o in BROKEN.items():
        for K in HEAD_DIMS:

            @case(f"broken_{name}_K{K}")
            def _(o=o, K=K):
                g = gen(13)
                H, HV, n_pool = 1, 2, 7
                S = o.get("spec", 0)
                packed = any(x in o for x in ("cu", "ckpt", "order"))
                B, T = (1, 13) if packed else (3, 1 + S if S else 3)
                t = {
                    n: carve_uninit(x, pads={2: 8} if x.dim() == 4 else {1: 3})
                    for n, x in tokens(g, B, T, H, HV, K).items()
                }
                inner = HV * K * K
                pool = carve_uninit(pool_of(g, n_pool + 3, HV, K, torch.float32), pads={0: 16}, lead=inner, tail=inner)
                out = carve_uninit(torch.zeros(B, T, HV, K, dtype=BF16, device=DEV), pads={2: 8})
                kw = dict(
                    A_log=torch.rand(HV, generator=g, device=DEV),
                    dt_bias=torch.zeros(HV, K, device=DEV),
                    state=pool,
                    output=out,
                )

                def i32(vals, dtype=torch.int32):
                    return torch.tensor(vals, dtype=dtype, device=DEV)

                if packed:
                    kw["cu_seqlens"] = i32(o.get("cu", [0, 4, 10, 13]), o.get("cu_dtype", torch.int64))
                if "cu" in o:
                    kw["zero_uncovered"] = True  # also run the zeroing kernel of uncovered tokens
                if "slots" in o:
                    kw["ssm_state_indices"] = i32(o["slots"])
                if S:
                    kw["num_spec_tokens"] = S
                    kw["ssm_state_indices"] = i32(o.get("spec_slots", [[0, 1, 2], [3, 4, 5], [6, 7, 8]]))
                    kw["num_accepted_tokens"] = i32(o.get("accepted", [1, 1, 1]))
                if "source" in o:
                    kw["state_source"] = pool_of(g, 4, HV, K, BF16)
                    kw["initial_state_indices"] = i32(o["source"])
                if "order" in o:
                    kw["seq_order"] = i32(o["order"])
                if "ckpt" in o:
                    kw["cu_seqlens"] = cu_of([20, 3, 40])
                    t = {n: carve_uninit(x) for n, x in tokens(g, 1, 63, H, HV, K).items()}
                    kw["output"] = out = torch.zeros(1, 63, HV, K, dtype=BF16, device=DEV)
                    kw["checkpoint_every_n_tokens"] = 16
                    kw["checkpoint_cu_starts"] = i32(o["ckpt"], torch.int64)
                    kw["state_checkpoints"] = ck = torch.zeros(5, HV, K, K, device=DEV)
                raw(t["q"], t["k"], t["v"], t["g"], t["beta"], **kw)
                sync()
                consume(out, pool)
                if "ckpt" in o:
                    consume(ck)


# ---------------------------------------------------------------------------------------------------
# training ops


def _training_available() -> bool:
    if DEV == "cpu":
        return True
    if not torch._C._dispatch_has_kernel_for_dispatch_key("kda::recurrent_kda_training_forward", "CUDA"):
        return False
    g = gen(20)
    x = tokens(g, 1, 3, 1, 1, 128)
    try:
        torch.ops.kda.recurrent_kda_training_forward(
            *x.values(),
            torch.zeros(1, device=DEV),
            torch.zeros(1, 128, device=DEV),
            torch.zeros(1, 1, 128, 128, device=DEV),
            None,
            0.1,
            -5.0,
        )
        sync()
    except NotImplementedError:
        return False
    return True


_TRAINING: list[bool] = []


def need_training() -> None:
    if not _TRAINING:
        _TRAINING.append(_training_available())
    if not _TRAINING[0]:
        raise Skip("torch.ops.kda.recurrent_kda_training_forward is not implemented on CUDA")


def train_inputs(seed: int, lengths=None, B=2, T=70, H=1, HV=2, K=128):
    g = gen(seed)
    if lengths is not None:
        B, T = 1, sum(lengths)
    N = len(lengths) if lengths is not None else B
    x = tokens(g, B, T, H, HV, K)
    x.update(
        A_log=torch.rand(HV, generator=g, device=DEV) * 0.5,
        dt_bias=torch.randn(HV, K, generator=g, device=DEV) * 0.1,
        initial_state=torch.randn(N, HV, K, K, generator=g, device=DEV) * 0.1,
    )
    d = dict(do=rnd(g, B, T, HV, K), dfinal_state=torch.randn(N, HV, K, K, generator=g, device=DEV) * 0.1)
    return x, d


def _register_training() -> None:
    K = 128
    for layout in ("fixed", "packed"):

        @case(f"training_forward_backward_{layout}")
        def _(layout=layout):
            need_training()
            lengths = [0, 5, 70, 1] if layout == "packed" else None
            x, d = train_inputs(30, lengths, K=K)
            extra = {}
            if lengths:
                extra = dict(cu_seqlens=cu_of(lengths), cu_seqlens_cpu=cu_of(lengths).cpu())
            o, fs, ctx = kda_ops.recurrent_kda_training_forward(**x, **extra)
            sync()
            consume(o, fs, ctx.tapes)
            grads = kda_ops.recurrent_kda_training_backward(ctx, d["do"], d["dfinal_state"])
            sync()
            consume(*grads)
            grads = kda_ops.recurrent_kda_training_backward(ctx, d["do"], None)
            sync()
            consume(*grads)

        @case(f"recurrent_kda_backward_{layout}_gqa")
        def _(layout=layout):
            need_training()
            lengths = [17, 0, 65] if layout == "packed" else None
            x, d = train_inputs(31, lengths, T=33, H=1, HV=3, K=K)
            extra = dict(cu_seqlens=cu_of(lengths, torch.int32)) if lengths else {}
            grads = kda_ops.recurrent_kda_backward(**x, **d, **extra, workspace=kda_ops.RecurrentKDABackwardWorkspace())
            sync()
            consume(*grads)

    @case("kda_autograd_packed")
    def _():
        need_training()
        lengths = [15, 0, 64, 2]
        x, d = train_inputs(32, lengths, K=K)
        leaves = {n: t.detach().clone().requires_grad_(True) for n, t in x.items()}
        o, fs = kda_ops.kda(**leaves, cu_seqlens=cu_of(lengths), output_final_state=True)
        ((o.float() * d["do"].float()).sum() + (fs * d["dfinal_state"]).sum()).backward()
        sync()
        consume(o, fs, *(leaves[n].grad for n in leaves))

    @case("training_strided_views")
    def _():
        need_training()
        x, d = train_inputs(33, None, B=2, T=19, K=K)
        for n in ("q", "k", "v", "g"):
            x[n] = carve_uninit(x[n], pads={2: 8})
        x["beta"] = carve_uninit(x["beta"], pads={1: 3})
        d["do"] = carve_uninit(d["do"], pads={2: 8})
        grads = kda_ops.recurrent_kda_backward(**x, **d)
        sync()
        consume(*grads)

    for name, cu in (("non_monotone", [0, 60, 4, 76]), ("negative", [-3, 5, 76, 76]), ("beyond_T", [0, 5, 116, 76])):

        @case(f"training_broken_cu_{name}")
        def _(cu=cu):
            need_training()
            if DEV == "cpu":
                raise Skip("the CPU training ops validate cu_seqlens on the host")
            x, d = train_inputs(34, [5, 0, 70, 1], K=K)
            x = {n: carve_uninit(t) for n, t in x.items()}
            h0 = x["initial_state"][:3].contiguous()
            args = (x["q"], x["k"], x["v"], x["g"], x["beta"], x["A_log"], x["dt_bias"], h0)
            cu_t = torch.tensor(cu, dtype=torch.int64, device=DEV)
            res = list(torch.ops.kda.recurrent_kda_training_forward.default(*args, cu_t, 0.25, -5.0))
            res += list(
                torch.ops.kda.recurrent_kda_backward.default(
                    *args, cu_t, d["do"], d["dfinal_state"][:3].contiguous(), 0.25, -5.0
                )
            )
            sync()
            consume(*(r for r in res if r.is_floating_point()))


# ---------------------------------------------------------------------------------------------------


def main() -> int:
    global DEV
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--only", default=None, help="regex: run only the cases whose name matches")
    ap.add_argument("--list", action="store_true")
    ap.add_argument("--device", default="cuda", choices=["cuda", "cpu"])
    ap.add_argument("--tool", default="", help="the sanitizer tool (printed only)")
    args = ap.parse_args()
    DEV = args.device
    if DEV == "cuda" and not torch.cuda.is_available():
        print("SANITIZE_CASES run=0 skipped=0 failed=1 (no CUDA device)")
        return 1
    _register_recurrent()
    _register_broken()
    _register_training()
    todo = [(n, f) for n, f in CASES if args.only is None or re.search(args.only, n)]
    if args.list:
        print("\n".join(n for n, _ in todo))
        return 0
    run = skipped = failed = 0
    t_all = time.time()
    for name, fn in todo:
        t0 = time.time()
        try:
            fn()
            run += 1
            status = "ok"
        except Skip as e:
            skipped += 1
            status = f"skipped: {e}"
        except Exception as e:  # noqa: BLE001 - reported and counted
            failed += 1
            status = f"FAILED: {type(e).__name__}: {str(e).splitlines()[0][:200] if str(e) else ''}"
            traceback.print_exc(limit=4)
        print(f"[{args.tool or 'case'}] {name}: {status} ({time.time() - t0:.2f}s)", flush=True)
    print(f"SANITIZE_CASES run={run} skipped={skipped} failed={failed} seconds={time.time() - t_all:.1f}", flush=True)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
