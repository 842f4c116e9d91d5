"""Shared builders and assertions for the kda_ops tests.

Tiers: the CPU tier runs everywhere (CI: 2 cores, minutes); tests marked ``gpu`` need CUDA and are
skipped without it. Shapes stay small (H <= 2, HV <= 4, K = V <= 128, T <= 70) so the fp64 reference
loop stays cheap.
"""

from __future__ import annotations

import os
from collections.abc import Iterable

import pytest
import torch

import kda_ops  # noqa: F401  (registers the ops)
from kda_ops.reference import make_inputs, rel_rms

HAS_CUDA = torch.cuda.is_available()
_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _inductor_cache_for_these_ops() -> None:
    """Points torch.compile's on-disk cache at a directory keyed by the schemas of the kda ops, unless
    TORCHINDUCTOR_CACHE_DIR is set. Inductor's FX-graph cache does not key on a custom op's schema: a cache
    written by a checkout with another signature (e.g. when `initial_state` was added to the training backward)
    replays the old call and fails test_compile."""
    if os.environ.get("TORCHINDUCTOR_CACHE_DIR"):
        return
    import hashlib
    import tempfile

    schemas = "\n".join(sorted(str(x) for x in torch._C._jit_get_all_schemas() if x.name.startswith("kda::")))
    key = hashlib.sha256(schemas.encode()).hexdigest()[:16]
    os.environ["TORCHINDUCTOR_CACHE_DIR"] = os.path.join(tempfile.gettempdir(), f"kda_ops_inductor_{key}")


_inductor_cache_for_these_ops()


GOLDEN_SEARCH = [
    d
    for d in (
        os.environ.get("KDA_GOLDEN_DIR"),
        os.path.join(_ROOT, "shared", "golden"),
        os.path.normpath(os.path.join(_ROOT, "..", "shared", "golden")),
    )
    if d
]


def _golden_dir() -> str:
    """$KDA_GOLDEN_DIR, else shared/golden in the repository root, else ../shared/golden beside it."""
    for d in GOLDEN_SEARCH:
        if os.path.isdir(d):
            return d
    return GOLDEN_SEARCH[-1]


GOLDEN_DIR = _golden_dir()

# docs/contract.md "Tolerances" (relative RMS unless named otherwise). Outputs are bf16-stored results of fp32
# math against an fp64 reference on the same bf16 inputs: bf16 rounding alone is ~2e-3 relative RMS.
TOL_OUT = 5e-3
TOL_OUT_MAXABS = 2e-2
TOL_STATE_FP32 = 1e-3
TOL_STATE_BF16 = 1e-2
TOL_GRAD = 1e-2


def pytest_collection_modifyitems(config, items):  # noqa: ARG001
    skip = pytest.mark.skip(reason="needs a CUDA device")
    for item in items:
        # The marker, not item.keywords: keywords also hold the folder name (tests/gpu), which would skip the
        # CPU-harness runs of the GPU files (KDA_*_TEST_DEVICE=cpu) that carry no gpu marker.
        if item.get_closest_marker("gpu") is not None and not HAS_CUDA:
            item.add_marker(skip)


def has_cpu_op(name: str) -> bool:
    return bool(torch._C._dispatch_has_kernel_for_dispatch_key(f"kda::{name}", "CPU"))


def needs_cpu_op(*names: str):
    """Skip marker while a CPU implementation has not landed yet."""
    missing = [n for n in names if not has_cpu_op(n)]
    return pytest.mark.skipif(bool(missing), reason=f"CPU implementation of {missing} not built")


DEVICES = ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)]


def inputs(
    B: int = 1,
    T: int = 8,
    H: int = 1,
    HV: int = 2,
    K: int = 64,
    V: int = 64,
    *,
    dtype: torch.dtype = torch.bfloat16,
    state_dtype: torch.dtype = torch.float32,
    N_pool: int | None = None,
    cu_seqlens: list[int] | None = None,
    device: str = "cpu",
    seed: int = 0,
) -> dict[str, torch.Tensor]:
    """Random inputs of the documented shapes (kda_ops.reference.make_inputs), plus beta in (0, 1) as
    ``beta_prob`` for the plain-beta mode."""
    x = make_inputs(
        B=B,
        T=T,
        H=H,
        HV=HV,
        K=K,
        V=V,
        N_pool=N_pool,
        dtype=dtype,
        state_dtype=state_dtype,
        device=device,
        seed=seed,
        cu_seqlens=cu_seqlens,
    )
    x["beta_prob"] = torch.sigmoid(x["beta"].float()).to(dtype)
    return x


def lengths_to_cu(lengths: Iterable[int], device: str = "cpu", dtype: torch.dtype = torch.int64) -> torch.Tensor:
    cu = [0]
    for n in lengths:
        cu.append(cu[-1] + int(n))
    return torch.tensor(cu, dtype=dtype, device=device)


def bits(t: torch.Tensor) -> torch.Tensor:
    """The raw bytes of a tensor (NaN-safe bitwise comparison)."""
    return t.detach().contiguous().cpu().reshape(-1).view(torch.uint8).clone()


def snapshot(*tensors: torch.Tensor | None) -> list[torch.Tensor | None]:
    return [None if t is None or t.device.type == "meta" else bits(t) for t in tensors]


def assert_bit_identical(before: list[torch.Tensor | None], *tensors: torch.Tensor | None) -> None:
    for i, (b, t) in enumerate(zip(before, tensors, strict=True)):
        if b is None:
            continue
        assert t is not None and torch.equal(b, bits(t)), f"tensor #{i} was modified"


def assert_close_rms(actual: torch.Tensor, expected: torch.Tensor, tol: float, what: str = "") -> None:
    assert torch.isfinite(actual.detach().float()).all(), f"{what}: non-finite values"
    err = rel_rms(actual, expected)
    assert err <= tol, f"{what}: relative RMS error {err:.3e} > {tol:.0e}"


def assert_output(actual: torch.Tensor, expected: torch.Tensor, what: str = "output") -> None:
    assert_close_rms(actual, expected, TOL_OUT, what)
    diff = actual.detach().double().cpu() - expected.detach().double().cpu()
    maxabs = diff.abs().max().item() if diff.numel() else 0.0
    assert maxabs <= TOL_OUT_MAXABS, f"{what}: max abs error {maxabs:.3e} > {TOL_OUT_MAXABS:.0e}"


def state_tol(dtype: torch.dtype) -> float:
    return TOL_STATE_BF16 if dtype == torch.bfloat16 else TOL_STATE_FP32


def load_golden(name: str) -> dict:
    path = os.path.join(GOLDEN_DIR, name + ".pt")
    if not os.path.exists(path):
        where = (
            f"in {GOLDEN_DIR} (the first existing folder of {GOLDEN_SEARCH})"
            if os.path.isdir(GOLDEN_DIR)
            else f"(none of {GOLDEN_SEARCH} exists)"
        )
        pytest.skip(
            f"golden file {name}.pt not found {where}; set KDA_GOLDEN_DIR to the folder that holds the golden files"
        )
    return torch.load(path)


@pytest.fixture(autouse=True)
def _deterministic_seed():
    torch.manual_seed(0)
    yield


def check_pool(pool_after, pool_before, slots_written: dict[int, torch.Tensor], what="pool"):
    """Written slots match the expected states; every other slot is bit-identical to before."""
    tol = state_tol(pool_after.dtype)
    for s, expected in slots_written.items():
        assert_close_rms(pool_after[s], expected, tol, f"{what} slot {s}")
    others = [i for i in range(pool_after.shape[0]) if i not in slots_written]
    if others:
        idx = torch.tensor(others, device=pool_after.device)
        assert torch.equal(
            bits(pool_after.index_select(0, idx)), bits(pool_before.index_select(0, idx))
        ), f"{what}: untouched slots were modified"


def capture_graph(fn):
    """CUDA graph of fn(): an eager call (plans workspaces, occupancy queries, smem opt-in), a warm-up on a
    side stream (the torch recipe), then one capture."""
    fn()
    torch.cuda.synchronize()
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        fn()
    torch.cuda.current_stream().wait_stream(s)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fn()
    torch.cuda.synchronize()
    return graph


# The three gate modes as recurrent_kda keyword arguments (docs/contract.md "Recurrence"), shared by the GPU test files.
GATES = {
    "precomputed": dict(use_gate_in_kernel=False),
    "softplus": dict(use_gate_in_kernel=True, lower_bound=None),
    "lower_bound": dict(use_gate_in_kernel=True, lower_bound=-5.0),
}


# The KDA_* switches are read once per process into the routing spine's knobs (docs/env.md). A test that changes one
# re-reads them (route_env); after every such test the environment comes back (monkeypatch) and the knobs are
# re-read once more (pytest_runtest_teardown below), so no switch leaks into the next test.
_knobs_changed = [False]


def route_env(monkeypatch, **env) -> None:  # type: ignore[no-untyped-def]
    """Sets (a value) or unsets (None) KDA_* switches for one test and re-reads the launch knobs."""
    from kda_ops import _routing

    for name, value in env.items():
        if value is None:
            monkeypatch.delenv(name, raising=False)
        else:
            monkeypatch.setenv(name, str(value))
    _knobs_changed[0] = True
    _routing.reload()


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_teardown(item, nextitem):  # type: ignore[no-untyped-def]  # noqa: ARG001
    yield  # (after the test's fixtures, monkeypatch's undo included)
    if _knobs_changed[0]:
        from kda_ops import _routing

        _knobs_changed[0] = False
        _routing.reload()


def force_split(monkeypatch, segment_tokens: int) -> list:  # type: ignore[no-untyped-def]
    """Forces the exact sequence split (KDA_SEQUENCE_SPLIT=1) with segments of ``segment_tokens`` tokens (0: the
    planned length) for one test; returns the list the plan of every prefill split run is appended to (so a test
    can assert that the split ran)."""
    from kda_ops import _split

    calls: list = []
    run = _split._run

    def counting(pl, *a, **kw):  # type: ignore[no-untyped-def]
        calls.append(pl)
        return run(pl, *a, **kw)

    route_env(monkeypatch, KDA_SEQUENCE_SPLIT="1", KDA_SEQUENCE_SPLIT_TOKENS=segment_tokens)
    monkeypatch.setattr(_split, "_run", counting)
    return calls


def split_then_unsplit(monkeypatch, fn) -> list:  # type: ignore[no-untyped-def]
    """[fn() with the sequence split forced on, fn() with it off] (KDA_SEQUENCE_SPLIT 1, then 0)."""
    res = []
    for mode in ("1", "0"):
        route_env(monkeypatch, KDA_SEQUENCE_SPLIT=mode)
        res.append(fn())
    return res


def recurrent_call(x: dict, kw: dict, **extra):  # type: ignore[no-untyped-def]
    """kda_ops.recurrent_kda on the per-token inputs of `x` with the keywords `kw`, `extra` on top."""
    return kda_ops.recurrent_kda(x["q"], x["k"], x["v"], x["g"], x["beta"], **{**kw, **extra})


def recurrent_reference(x: dict, kw: dict, h0, **over):  # type: ignore[no-untyped-def]
    """The fp64 reference of ``recurrent_call(x, kw, initial_state=h0)``: the gate, cu_seqlens and beta form
    taken from `kw`; `over` sets other reference keywords (e.g. use_qk_l2norm_in_kernel)."""
    from kda_ops.reference import recurrent_kda_reference

    args = dict(
        A_log=kw.get("A_log"), dt_bias=kw.get("dt_bias"), initial_state=h0, cu_seqlens=kw.get("cu_seqlens"),
        use_gate_in_kernel=kw.get("use_gate_in_kernel", False), lower_bound=kw.get("lower_bound"),
        beta_is_logit=kw.get("beta_is_logit", False),
    )  # fmt: skip
    args.update(over)
    return recurrent_kda_reference(x["q"], x["k"], x["v"], x["g"], x["beta"], **args)


def gate_kwargs(x: dict, gate: str = "lower_bound") -> dict:
    """GATES[gate] plus the gate parameters of the inputs `x` (A_log, dt_bias) when the gate is in-kernel."""
    kw = dict(GATES[gate])
    if kw["use_gate_in_kernel"]:
        kw.update(A_log=x["A_log"], dt_bias=x["dt_bias"])
    return kw


# ---------------------------------------------------------------------------------------------------
# state-only calls of the op (a 1-D empty output): the sequence split's end-state passes


def state_only_case(device, K=16, dtype=torch.float32, HV=2, lens=(70, 0, 33, 129), seed=7):  # type: ignore[no-untyped-def]
    """Packed inputs (a zero-length sequence among them), precomputed gate, a pool and slots with one inactive
    sequence, for the state-only checks (tests/test_split.py, tests/gpu/test_split_cuda.py)."""
    gen = torch.Generator().manual_seed(seed)
    T = sum(lens)

    def rnd(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=gen).to(dtype).to(device)

    x = dict(q=rnd(1, T, 1, K), k=rnd(1, T, 1, K), v=rnd(1, T, HV, K), beta=rnd(1, T, HV))
    x["g"] = (-torch.nn.functional.softplus(torch.randn(1, T, HV, K, generator=gen)) * 0.2).to(dtype).to(device)
    cu = torch.tensor([0, *torch.tensor(lens).cumsum(0).tolist()], dtype=torch.int32, device=device)
    pool = (torch.randn(len(lens) + 2, HV, K, K, generator=gen) * 0.3).to(device)
    slots = torch.tensor([3, 0, -1, 1], dtype=torch.int32, device=device)  # one inactive sequence
    return x, cu, pool, slots


def state_only_matches(device, K=16, dtype=torch.float32, backend=0, HV=2):  # type: ignore[no-untyped-def]
    """The pool and the final states of a state-only call equal (bit for bit) those of the same call with an
    output, on the pool and the no-pool path, for the given backend."""
    from _raw_ops import raw_recurrent

    x, cu, pool, slots = state_only_case(device, K, dtype, HV)
    tok = (x["q"], x["k"], x["v"], x["g"], x["beta"])
    kw = dict(cu_seqlens=cu, gate_mode=0, backend=backend, use_qk_l2norm=True, beta_is_logit=True)
    pa, pb = pool.clone(), pool.clone()
    raw_recurrent(*tok, state=pa, ssm_state_indices=slots, output=torch.empty_like(x["v"]), **kw)
    raw_recurrent(*tok, state=pb, ssm_state_indices=slots, output=x["v"].new_empty(0), **kw)
    assert torch.equal(pa, pb)
    assert torch.equal(pb[2], pool[2]) and torch.equal(pb[4], pool[4])  # slots no sequence writes
    N, Vd = len(cu) - 1, x["v"].shape[-1]
    fa = torch.zeros(N, HV, Vd, K, device=device)
    fb = torch.zeros(N, HV, Vd, K, device=device)
    raw_recurrent(*tok, final_state=fa, output=torch.empty_like(x["v"]), **kw)
    raw_recurrent(*tok, final_state=fb, output=x["v"].new_empty(0), **kw)
    assert torch.equal(fa, fb) and fa.abs().sum() > 0


def scan_case(J, Bt, Vd, Kd, device, seed=0):  # type: ignore[no-untyped-def]
    """Random S, Q [J, Bt, Vd, Kd] and P [J, Bt, Kd, Kd] (fp32) for torch.ops.kda.segment_state_scan."""
    gen = torch.Generator().manual_seed(seed)
    S = (torch.randn(J, Bt, Vd, Kd, generator=gen) * 0.5).to(device)
    Q = (torch.randn(J, Bt, Vd, Kd, generator=gen) * 0.5).to(device)
    P = (torch.randn(J, Bt, Kd, Kd, generator=gen) / Kd**0.5).to(device)
    return S, Q, P


def packed_scan_case(counts, HV, Vd, Kd, device, seed=0):  # type: ignore[no-untyped-def]
    """Random S, Q [slots, HV, Vd, Kd], P [slots, HV, Kd, Kd] and the packed layout (seg_first, seg_count int64)
    of sequences with ``counts`` segments, then two unused slots, for torch.ops.kda.segment_state_scan_packed."""
    slots = sum(counts) + 2
    S, Q, P = scan_case(slots, HV, Vd, Kd, "cpu", seed)
    count = torch.tensor(counts, dtype=torch.int64)
    first = torch.cumsum(count, 0) - count
    return S.to(device), Q.to(device), P.to(device), first.to(device), count.to(device)


def packed_scan_reference(S, Q, P, first, count):  # type: ignore[no-untyped-def]
    """fp64 loop: per sequence S[f + 1] = Q[f], S[f + j] = S[f + j - 1] P[f + j - 1] + Q[f + j - 1]."""
    R = S.double().clone()
    for f, c in zip(first.tolist(), count.tolist(), strict=True):
        for j in range(f + 1, f + c):
            R[j] = Q[j - 1].double() if j == f + 1 else R[j - 1] @ P[j - 1].double() + Q[j - 1].double()
    return R


def scan_reference(S, Q, P, first):  # type: ignore[no-untyped-def]
    """fp64 loop: S[j] = S[j-1] P[j-1] + Q[j-1] for j >= first."""
    R = S.double().clone()
    for j in range(first, S.shape[0]):
        R[j] = R[j - 1] @ P[j - 1].double() + Q[j - 1].double()
    return R
