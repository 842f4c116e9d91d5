"""Host overhead of the public ``kda_ops.recurrent_kda`` (the Python layer: validation, normalisation,
routing) for one eager decode call, measured on any machine (no GPU needed).

The call is the decode step of benchmarks/bench_decode.py: B = T = 1, H = HV = 32, K = V = 128, bf16 tokens,
bf16 state pool updated in place through ``ssm_state_indices``, lower-bound gate (λ = -5), logit beta,
L2 norm, caller ``output``, ``backend="recurrent"``. Tensors live on ``--device`` (default cpu).

Reported (µs per call, best of ``--repeat`` timeit runs of ``--number`` calls each):

- ``public API, op stubbed``: ``kda_ops.recurrent_kda`` with ``torch.ops.kda.recurrent_kda`` replaced by a
  no-op for the duration of the measurement: the pure Python-layer cost;
- ``raw op``: ``torch.ops.kda.recurrent_kda.default`` called directly with the normalised arguments;
- ``public API, end to end``: the real call (Python layer + op);
- ``Python overhead``: end to end minus raw op.

``--profile`` prints a cProfile of the stubbed public call (hot spots of the Python layer);
``--pkg-root DIR`` times the kda_ops package found in DIR instead (e.g. a copy of an older version);
``--no-e2e`` skips the raw-op and end-to-end timings (the CPU op takes ~1 ms for this shape).

    python3 benchmarks/bench_api_overhead.py [--number 20000] [--repeat 7] [--device cpu] [--profile]

The CPU numbers are a proxy for the host cost of a CUDA decode step: the CUDA path runs the same checks
plus a few of its own (a cached compute-capability check, the pool's 16-byte alignment).
"""

from __future__ import annotations

import argparse
import contextlib
import cProfile
import os
import pstats
import sys
import time
import timeit
import types

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

H = HV = 32
K = V = 128
LOWER_BOUND = -5.0


def make_inputs(device: str, slots: int = 4) -> dict:
    gen = torch.Generator().manual_seed(0)
    bf = torch.bfloat16

    def r(*s, dtype=bf):
        return torch.randn(*s, generator=gen).to(device=device, dtype=dtype)

    d = dict(q=r(1, 1, H, K), k=r(1, 1, H, K), v=r(1, 1, HV, V), g=r(1, 1, HV, K), beta=r(1, 1, HV))
    d["A_log"] = r(HV, dtype=torch.float32) * 0.1
    d["dt_bias"] = r(HV, K, dtype=torch.float32) * 0.1
    d["pool"] = (r(slots, HV, V, K, dtype=torch.float32) * 0.1).to(bf)
    d["out"] = torch.empty(1, 1, HV, V, dtype=bf, device=device)
    d["idx"] = torch.zeros(1, dtype=torch.int32, device=device)
    return d


def public_call(d: dict):
    """A zero-argument callable: the public call with its arguments bound once (no per-call dict lookups)."""
    import kda_ops

    fn = kda_ops.recurrent_kda
    args = (d["q"], d["k"], d["v"], d["g"], d["beta"])
    kw = dict(
        A_log=d["A_log"],
        dt_bias=d["dt_bias"],
        initial_state=d["pool"],
        ssm_state_indices=d["idx"],
        use_gate_in_kernel=True,
        lower_bound=LOWER_BOUND,
        beta_is_logit=True,
        use_qk_l2norm_in_kernel=True,
        output=d["out"],
        backend="recurrent",
    )
    return lambda: fn(*args, **kw)


def raw_call(d: dict):
    """A zero-argument callable: the raw op with the normalised arguments of the public call."""
    op = torch.ops.kda.recurrent_kda.default
    args = (
        d["q"],
        d["k"],
        d["v"],
        d["g"],
        d["beta"],
        d["A_log"],
        d["dt_bias"],
        d["pool"],
        None,
        None,
        None,
        d["idx"],
        None,
        None,
        d["out"],
        None,
        None,
        None,
        None,
        K**-0.5,
        2,
        LOWER_BOUND,
        True,
        True,
        0,
        0,
        2,
    )
    return lambda: op(*args)


def raw_decode_call(d: dict):
    """The short-schema decode op (kda::recurrent_kda_decode, what the cached public path calls) with the same
    arguments: mode = lower-bound gate (2) | L2 norm (4) | logit beta (8) | backend recurrent (2 << 8)."""
    op = torch.ops.kda.recurrent_kda_decode.default
    args = (
        d["q"],
        d["k"],
        d["v"],
        d["g"],
        d["beta"],
        d["A_log"],
        d["dt_bias"],
        d["pool"],
        d["idx"],
        None,
        d["out"],
        K**-0.5,
        LOWER_BOUND,
        2 | 4 | 8 | (2 << 8),
    )
    return lambda: op(*args)


@contextlib.contextmanager
def op_stubbed():
    """Replace the recurrent_kda ops (the full schema and the short decode one) by a no-op wherever the
    interface may look them up: the ``torch.ops.kda`` namespace entries and any module global of
    kda_ops.interface or kda_ops._decode_fast bound to an op overload (a handle cached at import)."""
    import importlib

    mods = []
    for name in ("kda_ops.interface", "kda_ops._decode_fast"):  # (an older copy may lack the second)
        try:
            mods.append(importlib.import_module(name))
        except ImportError:
            pass

    def noop(*args, **kwargs):
        return None

    ns = torch.ops.kda
    names = [n for n in ("recurrent_kda", "recurrent_kda_decode") if hasattr(ns, n)]
    packets = {n: getattr(ns, n) for n in names}  # resolves (and caches) the packets
    overloads = [p.default for p in packets.values()]
    cached = [(m, name, val) for m in mods for name, val in vars(m).items() if any(val is o for o in overloads)]
    for n in names:
        setattr(ns, n, types.SimpleNamespace(default=noop))
    for m, name, _ in cached:
        setattr(m, name, noop)
    try:
        yield
    finally:
        for n, p in packets.items():
            setattr(ns, n, p)
        for m, name, val in cached:
            setattr(m, name, val)


# Calls per timed run on CUDA: well below the launch queue's depth (~1000 pending kernels), so a launch never
# waits for the GPU and the loop times the host alone (3000 calls of a 10-15 us B=1 kernel fill the queue
# and then time the kernel instead).
CUDA_CALLS_PER_RUN = 400


def per_call_us(fn, number: int, repeat: int, sync=None) -> float:
    """Best per-call host time (us). With `sync` (CUDA): each run starts on an idle device and stops the clock
    before synchronising, so the kernels' own time is not counted."""
    for _ in range(200):
        fn()
    if sync is None:
        return min(timeit.repeat(fn, number=number, repeat=repeat)) / number * 1e6
    number = min(number, CUDA_CALLS_PER_RUN)
    best = float("inf")
    for _ in range(repeat):
        sync()
        t0 = time.perf_counter()
        for _ in range(number):
            fn()
        best = min(best, time.perf_counter() - t0)
    sync()
    return best / number * 1e6


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--number", type=int, default=20000)
    ap.add_argument("--repeat", type=int, default=7)
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--profile", action="store_true")
    ap.add_argument("--threads", type=int, default=1, help="torch intra-op threads (1: steadier CPU op timings)")
    ap.add_argument("--no-e2e", action="store_true", help="skip the (slow on CPU) end-to-end and raw-op timings")
    ap.add_argument(
        "--pkg-root", default=None, help="import kda_ops from this directory instead (to time another version)"
    )
    args = ap.parse_args()
    if args.pkg_root:
        sys.path.insert(0, os.path.abspath(args.pkg_root))

    import kda_ops

    torch.set_num_threads(args.threads)
    print(f"kda_ops from {os.path.dirname(kda_ops.__file__)}")
    d = make_inputs(args.device)
    sync = torch.cuda.synchronize if args.device.startswith("cuda") else (lambda: None)
    public, raw = public_call(d), raw_call(d)
    raw_dec = raw_decode_call(d) if hasattr(torch.ops.kda, "recurrent_kda_decode") else None

    with op_stubbed():
        stub_us = per_call_us(public, args.number, args.repeat)
        if args.profile:
            prof = cProfile.Profile()
            prof.enable()
            for _ in range(args.number):
                public()
            prof.disable()
            pstats.Stats(prof).sort_stats("tottime").print_stats(25)

    print(f"decode B=1 HV={HV} K=V={K} bf16 pool, lower-bound gate, logit beta, device={args.device}")
    print(f"  public API, op stubbed (Python layer only): {stub_us:8.2f} us/call")
    if args.no_e2e:
        return
    n_e2e = max(1, args.number // 10) if args.device == "cpu" else args.number
    cuda_sync = sync if args.device.startswith("cuda") else None
    raw_us = per_call_us(raw, n_e2e, args.repeat, cuda_sync)
    sync()
    dec_us = per_call_us(raw_dec, n_e2e, args.repeat, cuda_sync) if raw_dec is not None else None
    sync()
    e2e_us = per_call_us(public, n_e2e, args.repeat, cuda_sync)
    sync()
    print(f"  raw torch.ops.kda.recurrent_kda.default   : {raw_us:8.2f} us/call")
    if dec_us is not None:
        print(f"  raw torch.ops.kda.recurrent_kda_decode    : {dec_us:8.2f} us/call (the cached public path's op)")
    print(f"  public API, end to end                    : {e2e_us:8.2f} us/call")
    base = dec_us if dec_us is not None else raw_us
    print(f"  Python overhead (end to end - its raw op) : {e2e_us - base:8.2f} us/call")


if __name__ == "__main__":
    main()
