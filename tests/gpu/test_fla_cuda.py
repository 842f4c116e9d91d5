"""GPU tier: kda_ops.fla on CUDA against fla's own reference (fla.ops.kda.naive, fp32, on the same
bf16-rounded inputs) and beside fla's Triton kernels (fla-core 0.6.0): chunk_kda forward and gradients,
fused_recurrent_kda, fused_recurrent_kda_fwd decode / speculative decode on a pool, and fla's own
chunk_kda routed to kda_ops by kda_ops.fla.install().

Tolerances (relative RMS): outputs 5e-3 and states 1e-3 against the fp32 naive reference (outputs are
bf16), gradients 1e-2; against fla's Triton kernels, which round differently (bf16 intermediates), 1e-2
for outputs and states and 5e-2 for gradients: the naive comparison is the check, fla's kernels the
neighbour.
Skipped without CUDA or without fla-core. Run: python -m pytest -q -m gpu tests/gpu/test_fla_cuda.py

KDA_FLA_TEST_DEVICE=cpu runs the file on CPU as a check of the harness itself: fla's Triton kernels do not
run there, so fla's entry points are routed to kda_ops (install()) and the "vs fla Triton" comparisons
compare kda_ops with itself; the naive comparisons stay real. tests/conftest.py skips items under
tests/gpu, so load it without the conftest hooks:
    KDA_FLA_TEST_DEVICE=cpu PYTHONPATH=tests python -m pytest tests/gpu/test_fla_cuda.py --noconftest -q
"""

from __future__ import annotations

import os
import sys

import pytest
import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from test_fla_ref import close, fla_inputs, fla_reference  # noqa: E402

from kda_ops import fla as kf  # noqa: E402

DEV = os.environ.get("KDA_FLA_TEST_DEVICE", "cuda")
if DEV == "cuda":
    pytestmark = pytest.mark.gpu
fla_kda = pytest.importorskip("fla.ops.kda", reason="fla-core is not importable")
fla_rec = pytest.importorskip("fla.ops.kda.fused_recurrent", reason="fla-core is not importable")
if DEV == "cuda" and not torch.cuda.is_available():
    pytest.skip("needs a CUDA device", allow_module_level=True)

BF = torch.bfloat16
TOL_OUT, TOL_STATE, TOL_GRAD, TOL_FLA, TOL_FLA_GRAD = 5e-3, 1e-3, 1e-2, 1e-2, 5e-2
TOKENS = ("q", "k", "v", "g", "beta")


@pytest.fixture(autouse=True)
def _not_installed():
    # fla's own entry points must run fla's kernels here unless a test installs kda_ops (on CPU, the
    # harness check, they can only run on kda_ops)
    kf.uninstall()
    if DEV == "cpu":
        kf.install()
    yield
    kf.uninstall()


def _inputs(B, T, H, HV, D, gate, N=None, seed=0):
    x = fla_inputs(B, T, H, HV, D, gate=gate, dtype=BF, device=DEV, N=N, seed=seed)
    return x


def _ref(x, gate, lb=None, cu=None, **kw):
    return fla_reference(
        *(x[n] for n in TOKENS), h0=x.get("h0"), A_log=x.get("A_log"), dt_bias=x.get("dt_bias"), gate=gate,
        lower_bound=lb, l2=True, beta_sigmoid=gate != "pre", cu_seqlens=cu, **kw,
    )  # fmt: skip


def _gate_kw(x, gate, lb):
    if gate == "pre":
        return {}
    kw = dict(use_gate_in_kernel=True, A_log=x["A_log"], dt_bias=x["dt_bias"], use_beta_sigmoid_in_kernel=True)
    if lb is not None:
        kw.update(lower_bound=lb, safe_gate=True)
    return kw


# Few distinct shapes/modes: each is a fresh Triton compile + autotune of fla's kernels (seconds each).
CASES = [
    # B, T, H, HV, D, gate, lower_bound, packed, state_v_first
    (2, 200, 2, 2, 128, "lower_bound", -5.0, None, False),
    (1, 300, 2, 4, 128, "softplus", None, [0, 64, 64, 171, 300], True),
    (2, 100, 1, 2, 64, "pre", None, None, False),
]


@pytest.mark.parametrize("B,T,H,HV,D,gate,lb,cu,v_first", CASES)
def test_chunk_kda_forward(B, T, H, HV, D, gate, lb, cu, v_first) -> None:
    N = B if cu is None else len(cu) - 1
    x = _inputs(B, T, H, HV, D, gate, N=N, seed=T)
    o_ref, h_ref = _ref(x, gate, lb, cu)
    cu_t = None if cu is None else torch.tensor(cu, device=DEV)
    h0 = x["h0"].transpose(-1, -2).contiguous() if v_first else x["h0"]
    kw = dict(initial_state=h0, output_final_state=True, use_qk_l2norm_in_kernel=True, state_v_first=v_first,
              cu_seqlens=cu_t, **_gate_kw(x, gate, lb))  # fmt: skip
    with torch.inference_mode():
        o, ht = kf.chunk_kda(*(x[n] for n in TOKENS), **kw)
        o_fla, ht_fla = fla_kda.chunk_kda(*(x[n] for n in TOKENS), **kw)
    href = h_ref.transpose(-1, -2) if v_first else h_ref
    close(o, o_ref, TOL_OUT, "o vs naive")
    close(ht, href, TOL_STATE, "final_state vs naive")
    close(o, o_fla, TOL_FLA, "o vs fla Triton")
    close(ht, ht_fla, TOL_FLA, "final_state vs fla Triton")


@pytest.mark.parametrize("cu", [[0, 100, 100, 250]])
def test_chunk_kda_gradients(cu) -> None:
    B, T, H, HV, D, lb = (2, 130, 2, 4, 128, -5.0) if cu is None else (1, 250, 1, 2, 128, -5.0)
    N = B if cu is None else len(cu) - 1
    x = _inputs(B, T, H, HV, D, "lower_bound", N=N, seed=7)
    names = list(TOKENS) + ["A_log", "dt_bias", "h0"]
    gen = torch.Generator().manual_seed(1)
    do = torch.randn(x["v"].shape, generator=gen).to(DEV, BF)
    dht = torch.randn(N, HV, D, D, generator=gen).to(DEV)
    cu_t = None if cu is None else torch.tensor(cu, device=DEV)

    def run(fn, leaves):
        o, ht = fn(*(leaves[n] for n in TOKENS), initial_state=leaves["h0"], output_final_state=True,
                   use_qk_l2norm_in_kernel=True, use_gate_in_kernel=True, use_beta_sigmoid_in_kernel=True,
                   safe_gate=True, lower_bound=lb, A_log=leaves["A_log"], dt_bias=leaves["dt_bias"], cu_seqlens=cu_t,
                   cu_seqlens_cpu=None if cu_t is None else cu_t.cpu())  # fmt: skip
        ((o.float() * do.float()).sum() + (ht * dht).sum()).backward()
        return o.detach(), ht.detach(), {n: leaves[n].grad for n in names}

    ref_leaves = {n: x[n].detach().float().clone().requires_grad_() for n in names}
    o_ref, h_ref = _ref({**ref_leaves}, "lower_bound", lb, cu)
    ((o_ref * do.float()).sum() + (h_ref * dht).sum()).backward()
    o, ht, g = run(kf.chunk_kda, {n: x[n].detach().clone().requires_grad_() for n in names})
    o_f, ht_f, g_f = run(fla_kda.chunk_kda, {n: x[n].detach().clone().requires_grad_() for n in names})
    close(o, o_ref.detach(), TOL_OUT, "o vs naive")
    close(ht, h_ref.detach(), TOL_STATE, "final_state vs naive")
    for n in names:
        close(g[n], ref_leaves[n].grad, TOL_GRAD, f"d{n} vs naive")
        close(g[n], g_f[n], TOL_FLA_GRAD, f"d{n} vs fla Triton")


@pytest.mark.parametrize("D", [64, 128])
def test_fused_recurrent_kda(D) -> None:
    x = _inputs(2, 40, 2, 4, D, "lower_bound", seed=D)
    kw = dict(initial_state=x["h0"], output_final_state=True, use_qk_l2norm_in_kernel=True,
              **_gate_kw(x, "lower_bound", -5.0))  # fmt: skip
    kw.pop("safe_gate")
    o, ht = kf.fused_recurrent_kda(*(x[n] for n in TOKENS), **kw)
    o_f, ht_f = fla_kda.fused_recurrent_kda(*(x[n] for n in TOKENS), **kw)
    o_ref, h_ref = _ref(x, "lower_bound", -5.0)
    close(o, o_ref, TOL_OUT, "o vs naive")
    close(ht, h_ref, TOL_STATE, "final_state vs naive")
    close(o, o_f, TOL_FLA, "o vs fla Triton")
    close(ht, ht_f, TOL_FLA, "final_state vs fla Triton")


@pytest.mark.parametrize(
    "v_first,spec,pool_dtype",
    [(False, False, torch.float32), (True, False, BF), (False, True, BF), (True, True, torch.float32)],
)
def test_fused_recurrent_kda_fwd_pool(v_first, spec, pool_dtype) -> None:
    # vLLM's decode and speculative decode calls, beside fla's Triton kernel (valid slots only: fla's
    # kernel has no inactive-slot rule)
    D, HV, P, N = 128, 4, 24, 5
    S = 3 if spec else 0
    x = _inputs(1, N * (1 + S), 2, HV, D, "lower_bound", seed=11)
    gen = torch.Generator().manual_seed(2)
    shape = (P, HV, D, D)
    pool0 = (torch.randn(shape, generator=gen) * 0.2).to(DEV, pool_dtype)
    if v_first:
        pool0 = pool0.transpose(-1, -2).contiguous()
    perm = torch.randperm(P, generator=gen)[: N * (1 + S)].to(torch.int32)
    idx = (perm.view(N, 1 + S) if spec else perm).to(DEV)
    n_acc = torch.tensor([1, 2, 4, 3, 1][:N], dtype=torch.int32, device=DEV) if spec else None
    cu = (torch.arange(N + 1, dtype=torch.int32) * (1 + S)).to(DEV)
    kw = dict(A_log=x["A_log"], dt_bias=x["dt_bias"], state_v_first=v_first, cu_seqlens=cu, ssm_state_indices=idx,
              num_accepted_tokens=n_acc, use_qk_l2norm_in_kernel=True, use_gate_in_kernel=True,
              use_beta_sigmoid_in_kernel=True, lower_bound=-5.0)  # fmt: skip
    p_ours, p_fla = pool0.clone(), pool0.clone()
    o, r = kf.fused_recurrent_kda_fwd(*(x[n] for n in TOKENS), initial_state=p_ours, **kw)
    o_f, _ = fla_rec.fused_recurrent_kda_fwd(*(x[n] for n in TOKENS), initial_state=p_fla, **kw)
    assert r is p_ours
    close(o, o_f, TOL_FLA, "o vs fla Triton")
    close(p_ours.float(), p_fla.float(), TOL_FLA if pool_dtype == BF else 2e-3, "pool vs fla Triton")
    untouched = sorted(set(range(P)) - set(perm.tolist()))
    assert torch.equal(p_ours[untouched], pool0[untouched])


def test_install_routes_fla_on_cuda() -> None:
    x = _inputs(1, 256, 2, 2, 128, "lower_bound", seed=3)
    kw = dict(initial_state=x["h0"], output_final_state=True, use_qk_l2norm_in_kernel=True,
              **_gate_kw(x, "lower_bound", -5.0))  # fmt: skip
    with torch.inference_mode():
        o_ours, h_ours = kf.chunk_kda(*(x[n] for n in TOKENS), **kw)
        o_fla, _ = fla_kda.chunk_kda(*(x[n] for n in TOKENS), **kw)
        kf.uninstall()
        kf.install()
        o_routed, h_routed = fla_kda.chunk_kda(*(x[n] for n in TOKENS), **kw)
    assert torch.equal(o_routed, o_ours) and torch.equal(h_routed, h_ours)
    close(o_routed, o_fla, TOL_FLA, "routed o vs fla Triton")
    # a call kda_ops cannot take (fp32 tokens on CUDA) falls through to fla's kernels
    xf = {n: x[n].float() for n in TOKENS}
    with torch.inference_mode():
        o32, _ = fla_kda.chunk_kda(*(xf[n] for n in TOKENS), **kw)
    assert o32.dtype == torch.float32 and torch.isfinite(o32).all()


def test_chunk_kda_graph_mode_replays_new_cu_seqlens() -> None:
    """fla's graph mode on kda_ops: chunk_kda(use_graph=True, max_num_seqs=M) captured once in a CUDA graph on
    static buffers, then replayed after new cu_seqlens values (zero-length tail padding) and new tokens are
    copied in: each replay equals an eager call on the same data."""
    if DEV != "cuda":
        pytest.skip("CUDA graphs")
    from conftest import capture_graph

    M, T = 4, 256
    x = _inputs(1, T, 1, 2, 128, "lower_bound", N=M, seed=41)
    kw = dict(use_qk_l2norm_in_kernel=True, use_gate_in_kernel=True, use_beta_sigmoid_in_kernel=True,
              lower_bound=-5.0, A_log=x["A_log"], dt_bias=x["dt_bias"], output_final_state=True,
              use_graph=True, max_num_seqs=M)  # fmt: skip
    static = {n: x[n].clone() for n in TOKENS}
    h0 = x["h0"].clone()
    cu = torch.tensor([0, 100, 256, 256, 256], dtype=torch.int64, device=DEV)
    out: dict = {}

    def step() -> None:
        with torch.no_grad():
            out["o"], out["h"] = kf.chunk_kda(*(static[n] for n in TOKENS), initial_state=h0, cu_seqlens=cu, **kw)

    graph = capture_graph(step)
    for seed, lens in ((42, [256, 0, 0, 0]), (43, [64, 64, 100, 28]), (44, [1, 200, 0, 55])):
        y = _inputs(1, T, 1, 2, 128, "lower_bound", N=M, seed=seed)
        for n in TOKENS:
            static[n].copy_(y[n])
        cu.copy_(torch.tensor([0, *torch.tensor(lens).cumsum(0).tolist()], dtype=torch.int64))
        graph.replay()
        with torch.no_grad():
            o_e, h_e = kf.chunk_kda(*(y[n] for n in TOKENS), initial_state=h0, cu_seqlens=cu.clone(), **kw)
        torch.cuda.synchronize()
        assert torch.equal(out["o"], o_e) and torch.equal(out["h"], h_e), lens


def test_verifier_no_host_sync_or_allocation() -> None:
    """The backend's verifiers decide from shapes, dtypes and flags: no host sync (torch's sync debug mode set to
    raise) and no device allocation, for calls kda_ops takes and calls it declines (lower_bound = -10 under autograd,
    fp32 tokens), packed with device cu_seqlens."""
    if DEV != "cuda":
        pytest.skip("host syncs and device allocations are CUDA's")
    backend = kf._backend_class()()
    x = _inputs(1, 256, 2, 2, 128, "lower_bound", N=3, seed=5)
    cu = torch.tensor([0, 100, 200, 256], dtype=torch.int64, device=DEV)
    leaf = {n: x[n].detach().clone().requires_grad_(True) for n in TOKENS}
    calls = [
        ((*(x[n] for n in TOKENS),), dict(cu_seqlens=cu, **_gate_kw(x, "lower_bound", -5.0)), True),
        ((*(leaf[n] for n in TOKENS),), dict(cu_seqlens=cu, **_gate_kw(x, "lower_bound", -5.0)), True),
        (
            (*(leaf[n] for n in TOKENS),),
            dict(cu_seqlens=cu, **{**_gate_kw(x, "lower_bound", None), "lower_bound": -10.0}),
            False,
        ),
        ((*(x[n].float() for n in TOKENS),), dict(cu_seqlens=cu, **_gate_kw(x, "lower_bound", -5.0)), False),
    ]
    torch.cuda.synchronize()
    before = torch.cuda.memory_stats().get("allocation.all.allocated", 0)
    torch.cuda.set_sync_debug_mode("error")
    try:
        verdicts = [backend.chunk_kda_verifier(*a, **kw)[0] for a, kw, _ in calls]
    finally:
        torch.cuda.set_sync_debug_mode("default")
    assert torch.cuda.memory_stats().get("allocation.all.allocated", 0) == before
    assert verdicts == [want for _, _, want in calls], verdicts
