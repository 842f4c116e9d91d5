"""Context parallelism (kda_ops.distributed) on gloo: 2 and 4 CPU processes against one process.

Each world size is one spawn of R processes that run every case of that size and save their results;
the parent checks them against ``kda_ops.kda`` on the whole packed batch: the outputs and token
gradients concatenated over the ranks, the final states and the replicated inputs' gradients (A_log,
dt_bias, initial_state) summed over the ranks. Shapes are tiny (K=8, V=6: V != K also checks that the
transition P is carried as a [K, K] state) so the whole file stays well under a minute on 2 cores.
"""

from __future__ import annotations

import os
import tempfile

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

import kda_ops
from kda_ops.reference import rel_rms

H, HV, K, V = 1, 2, 8, 6

# name, world size, global cu_seqlens, token offsets of the ranks, dtype, with initial_state
CASES = [
    ("cross2", 2, [0, 5, 30, 37], [0, 18, 37], torch.float32, True),
    ("nocross2", 2, [0, 10, 20], [0, 10, 20], torch.float32, True),
    ("empty_rank2", 2, [0, 7, 19], [0, 19, 19], torch.float32, False),
    ("fp64_2", 2, [0, 3, 29], [0, 11, 29], torch.float64, True),
    # sequence 1 runs through all four ranks ([3, 40) covers 10..31 entirely)
    ("span4", 4, [0, 3, 40, 41, 50], [0, 10, 20, 31, 50], torch.float32, True),
    # rank 1 holds no token while sequence 1 runs through it (an identity map in the scan)
    ("empty_inside4", 4, [0, 3, 40, 41, 50], [0, 10, 10, 31, 50], torch.float32, True),
    # empty ranks on a sequence boundary, zero-length sequences (first, middle, last)
    ("zero_len4", 4, [0, 0, 12, 12, 30, 30], [0, 12, 12, 12, 30], torch.float32, True),
    ("fp64_4", 4, [0, 21, 22, 45], [0, 6, 14, 30, 45], torch.float64, False),
]


def _inputs(cu: list[int], dtype: torch.dtype, with_h0: bool, seed: int):  # type: ignore[no-untyped-def]
    gen = torch.Generator().manual_seed(seed)
    T, N = cu[-1], len(cu) - 1
    pdt = torch.float64 if dtype == torch.float64 else torch.float32

    def rnd(*shape: int, s: float = 1.0) -> torch.Tensor:
        return (torch.randn(*shape, generator=gen, dtype=torch.float64) * s).to(dtype)

    x = dict(
        q=rnd(1, T, H, K),
        k=rnd(1, T, H, K),
        v=rnd(1, T, HV, V),
        g=rnd(1, T, HV, K),
        beta=rnd(1, T, HV),
        A_log=(torch.randn(HV, generator=gen, dtype=torch.float64) * 0.5).to(pdt),
        dt_bias=(torch.randn(HV, K, generator=gen, dtype=torch.float64) * 0.5).to(pdt),
        h0=(torch.randn(N, HV, V, K, generator=gen, dtype=torch.float64) * 0.5).to(pdt) if with_h0 else None,
        do=rnd(1, T, HV, V),
        dfinal=torch.randn(N, HV, V, K, generator=gen, dtype=torch.float64).to(pdt),
    )
    return x


# the other training modes of kda(): name, world size, cu_seqlens, offsets, the mode keywords (and "no_dt_bias")
MODE_CASES = [
    ("softplus2", 2, [0, 5, 30, 37], [0, 18, 37], dict(lower_bound=None)),
    ("pre_plain_nol2_2", 2, [0, 5, 30, 37], [0, 18, 37],
     dict(use_gate_in_kernel=False, beta_is_logit=False, use_qk_l2norm_in_kernel=False)),
    ("lb_no_dt_bias4", 4, [0, 3, 40, 41, 50], [0, 10, 20, 31, 50], dict(lower_bound=-2.0, no_dt_bias=True)),
]  # fmt: skip


def _mode_inputs(cu: list[int], modes: dict, seed: int):  # type: ignore[no-untyped-def]
    """_inputs in a mode's terms: a log-decay g <= 0 without the gate, β in (0, 1) for plain β, q and k of norm ~1
    without the L2 norm (a bounded recurrence)."""
    x = _inputs(cu, torch.float32, True, seed)
    if modes.get("use_gate_in_kernel", True) is False:
        x["g"] = -torch.nn.functional.softplus(x["g"]) * 0.5
    if modes.get("beta_is_logit", True) is False:
        x["beta"] = torch.sigmoid(x["beta"])
    if modes.get("use_qk_l2norm_in_kernel", True) is False:
        x["q"], x["k"] = x["q"] / K**0.5, x["k"] / K**0.5
    return x


def _grads(fn, x, cu, tokens: slice, lower_bound: float, modes: dict | None = None):  # type: ignore[no-untyped-def]
    """Outputs and gradients of `fn` (context_parallel_kda or kda) on the `tokens` of x, under the loss of x's
    do / dfinal; `modes`: kda()'s mode keywords (lower_bound among them), "no_dt_bias" for dt_bias None."""
    modes = dict(modes or {})
    no_dtb = modes.pop("no_dt_bias", False)
    lower_bound = modes.pop("lower_bound", lower_bound)
    gate = modes.get("use_gate_in_kernel", True)
    leaves = {n: x[n][:, tokens].clone().requires_grad_(True) for n in ("q", "k", "v", "g", "beta")}
    A = x["A_log"].clone().requires_grad_(True) if gate else None
    dtb = x["dt_bias"].clone().requires_grad_(True) if gate and not no_dtb else None
    h0 = None if x["h0"] is None else x["h0"].clone().requires_grad_(True)
    o, fs = fn(
        *leaves.values(), A, dtb, h0, cu_seqlens=torch.tensor(cu), lower_bound=lower_bound, output_final_state=True,
        **modes,
    )  # fmt: skip
    ((o * x["do"][:, tokens]).sum() + (fs * x["dfinal"]).sum()).backward()
    res = {"o": o.detach(), "final": fs.detach()}
    for n, t in leaves.items():
        res["d" + n] = t.grad
    res["dA_log"] = None if A is None else A.grad
    res["ddt_bias"] = None if dtb is None else dtb.grad
    res["dh0"] = None if h0 is None else h0.grad
    return res


def _run_local(x, cu, offsets, rank, lower_bound=-0.2):  # type: ignore[no-untyped-def]
    tokens = slice(offsets[rank], offsets[rank + 1])
    return _grads(kda_ops.distributed.context_parallel_kda, x, cu, tokens, lower_bound)


def _worker(rank: int, world: int, init_file: str, out_dir: str) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world)
    import kda_ops.distributed  # noqa: F401

    results: dict[str, object] = {}
    for i, (name, R, cu, offsets, dtype, with_h0) in enumerate(CASES):
        if R != world:
            continue
        x = _inputs(cu, dtype, with_h0, seed=100 + i)
        results[name] = _run_local(x, cu, offsets, rank)
        if name in ("cross2", "span4"):  # rerun: bit-identical
            results[name + "_again"] = _run_local(x, cu, offsets, rank)
    for i, (name, R, cu, offsets, modes) in enumerate(MODE_CASES):
        if R == world:
            x = _mode_inputs(cu, modes, seed=300 + i)
            results[name] = _grads(
                kda_ops.distributed.context_parallel_kda, x, cu, slice(offsets[rank], offsets[rank + 1]), -0.2, modes
            )

    # bad input on one rank: that rank raises its own error, the others a RuntimeError naming it
    cu, offsets = [0, 5, 30, 37], [0, 18, 37] if world == 2 else [0, 9, 18, 30, 37]
    x = _inputs(cu, torch.float32, True, seed=1)
    a, b = offsets[rank], offsets[rank + 1]
    tok = [x[n][:, a:b] for n in ("q", "k", "v", "g", "beta")]
    if rank == 1:
        tok[2] = tok[2].double()
    try:
        kda_ops.distributed.context_parallel_kda(*tok, x["A_log"], x["dt_bias"], x["h0"], cu_seqlens=cu)
        results["bad"] = None
    except Exception as e:  # noqa: BLE001
        results["bad"] = (type(e).__name__, str(e))
    # token counts that do not add up to cu_seqlens[-1]: every rank raises the same ValueError
    tok = [x[n][:, a : max(a, b - 1)] for n in ("q", "k", "v", "g", "beta")]
    try:
        kda_ops.distributed.context_parallel_kda(*tok, x["A_log"], x["dt_bias"], x["h0"], cu_seqlens=cu)
        results["short"] = None
    except Exception as e:  # noqa: BLE001
        results["short"] = (type(e).__name__, str(e))
    torch.save(results, os.path.join(out_dir, f"rank{rank}.pt"))
    dist.barrier()
    dist.destroy_process_group()


@pytest.fixture(scope="module", params=[2, 4])
def world_results(request):  # type: ignore[no-untyped-def]
    world = request.param
    with tempfile.TemporaryDirectory() as tmp:
        init_file = os.path.join(tmp, "init")
        mp.spawn(_worker, args=(world, init_file, tmp), nprocs=world, join=True)
        per_rank = [torch.load(os.path.join(tmp, f"rank{r}.pt"), weights_only=False) for r in range(world)]
    return world, per_rank


def _reference(x, cu, lower_bound=-0.2):  # type: ignore[no-untyped-def]
    return _grads(kda_ops.kda, x, cu, slice(None), lower_bound)


def test_matches_one_process(world_results):  # type: ignore[no-untyped-def]
    world, per_rank = world_results
    n_checked = 0
    for i, (name, R, cu, _offsets, dtype, with_h0) in enumerate(CASES):
        if R != world:
            continue
        x = _inputs(cu, dtype, with_h0, seed=100 + i)
        ref = _reference(x, cu)
        parts = [p[name] for p in per_rank]
        tol = 1e-12 if dtype == torch.float64 else 2e-6
        for key in ("o", "dq", "dk", "dv", "dg", "dbeta"):
            got = torch.cat([p[key] for p in parts], 1)
            assert got.shape == ref[key].shape, (name, key)
            assert rel_rms(got, ref[key]) <= tol, (name, key, rel_rms(got, ref[key]))
        for key in ("final", "dA_log", "ddt_bias", "dh0"):
            if ref[key] is None:
                assert all(p[key] is None for p in parts), (name, key)
                continue
            got = parts[0][key].clone()
            for p in parts[1:]:
                got += p[key]
            assert rel_rms(got, ref[key]) <= tol, (name, key, rel_rms(got, ref[key]))
        # each final state lives on exactly one rank
        nonzero = torch.stack([p["final"].flatten(1).abs().sum(1) > 0 for p in parts]).sum(0)
        lens = torch.tensor(cu[1:]) - torch.tensor(cu[:-1])
        assert bool((nonzero <= 1).all()), name
        assert bool((nonzero[lens > 0] == 1).all()), name
        n_checked += 1
    assert n_checked >= 4


def test_every_mode_matches_one_process(world_results):  # type: ignore[no-untyped-def]
    """context_parallel_kda in kda()'s other modes (softplus gate; precomputed gate with plain β and no L2 norm;
    the lower-bound gate without dt_bias) equals kda() in one process, gradients included (absent parameters
    get none)."""
    world, per_rank = world_results
    for i, (name, R, cu, _offsets, modes) in enumerate(MODE_CASES):
        if R != world:
            continue
        x = _mode_inputs(cu, modes, seed=300 + i)
        ref = _grads(kda_ops.kda, x, cu, slice(None), -0.2, modes)
        parts = [p[name] for p in per_rank]
        for key in ("o", "dq", "dk", "dv", "dg", "dbeta"):
            got = torch.cat([p[key] for p in parts], 1)
            assert rel_rms(got, ref[key]) <= 2e-6, (name, key, rel_rms(got, ref[key]))
        for key in ("final", "dA_log", "ddt_bias", "dh0"):
            if ref[key] is None:
                assert all(p[key] is None for p in parts), (name, key)
                continue
            got = sum(p[key] for p in parts[1:]) + parts[0][key]
            assert rel_rms(got, ref[key]) <= 2e-6, (name, key, rel_rms(got, ref[key]))


def test_deterministic(world_results):  # type: ignore[no-untyped-def]
    world, per_rank = world_results
    name = "cross2" if world == 2 else "span4"
    for p in per_rank:
        for key, t in p[name].items():
            if t is not None:
                assert torch.equal(t, p[name + "_again"][key]), (name, key)


def test_bad_input_raises_on_every_rank(world_results):  # type: ignore[no-untyped-def]
    world, per_rank = world_results
    bad = [p["bad"] for p in per_rank]
    assert bad[1] is not None and bad[1][0] == "TypeError" and "v must be" in bad[1][1], bad[1]
    for r in range(world):
        if r != 1:
            assert bad[r] is not None and bad[r][0] == "RuntimeError" and "rank 1" in bad[r][1], bad[r]
    for p in per_rank:
        assert p["short"] is not None and p["short"][0] == "ValueError" and "cu_seqlens must end" in p["short"][1]


def test_plan_owners_and_kinds():
    """The host plan: who returns which final state, and how each rank maps the crossing state."""
    from kda_ops.distributed import ContextParallelPlan

    cu, offs = [0, 3, 40, 41, 50], [0, 10, 10, 31, 50]
    p = ContextParallelPlan(cu, offs, 2)
    assert p.owner == [0, 3, 3, 3]
    assert p.kinds_fwd == ["restart", "pass", "inner", "none"]
    assert p.kinds_bwd == ["none", "pass", "inner", "restart"]
    assert (p.seq_in, p.seq_out, p.len_in, p.rest_ids, p.rest_cu) == (1, 1, 21, [], [0])
    p = ContextParallelPlan(cu, offs, 3)
    assert (p.seq_in, p.seq_out, p.len_in, p.rest_ids, p.rest_cu) == (1, None, 9, [2, 3], [0, 1, 10])
    # a zero-length sequence at an empty rank's offset belongs to the first rank that reaches it
    p = ContextParallelPlan([0, 0, 12, 12, 30, 30], [0, 12, 12, 12, 30], 0)
    assert p.owner == [0, 0, 0, 3, 3]
    assert not p.any_crossing


# ---------------------------------------------------------------------------------------------------
# GPU tier: the CUDA training path under context parallelism (4 gloo processes sharing one GPU; the
# exchanged blocks go through the host). bf16 tokens, K = V = 128: the contract's tolerances.

CUDA_CASE = ([0, 40, 700, 750], [0, 200, 400, 600, 750])  # sequence 1 runs through all 4 ranks


def _cuda_inputs():  # type: ignore[no-untyped-def]
    cu = CUDA_CASE[0]
    gen = torch.Generator().manual_seed(21)
    T, N, Kc, HVc = cu[-1], len(cu) - 1, 128, 2

    def rnd(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=gen).to(torch.bfloat16).cuda()

    dtb = torch.randn(HVc, Kc, generator=gen) * 0.1
    dtb[:, :4] = -30.0  # slow channels: the start state matters across ranks
    return dict(
        q=rnd(1, T, 1, Kc), k=rnd(1, T, 1, Kc), v=rnd(1, T, HVc, Kc), g=rnd(1, T, HVc, Kc), beta=rnd(1, T, HVc),
        A_log=(torch.rand(HVc, generator=gen) * 0.5 + 0.1).cuda(), dt_bias=dtb.cuda(),
        h0=(torch.randn(N, HVc, Kc, Kc, generator=gen) * 0.3).cuda(), do=rnd(1, T, HVc, Kc),
        dfinal=torch.randn(N, HVc, Kc, Kc, generator=gen).cuda(),
    )  # fmt: skip


def _worker_cuda(rank: int, world: int, init_file: str, out_dir: str, backend: str, offsets: list[int]) -> None:
    torch.set_num_threads(1)
    torch.cuda.set_device(0)
    dist.init_process_group(backend, init_method=f"file://{init_file}", rank=rank, world_size=world)
    import kda_ops.distributed  # noqa: F401

    x = _cuda_inputs()
    res = _run_local(x, CUDA_CASE[0], offsets, rank, lower_bound=-5.0)
    torch.save({k: (None if v is None else v.cpu()) for k, v in res.items()}, os.path.join(out_dir, f"rank{rank}.pt"))
    dist.barrier()
    dist.destroy_process_group()


def _spawn_cuda(backend: str, offsets: list[int]) -> list[dict]:
    world = len(offsets) - 1
    with tempfile.TemporaryDirectory() as tmp:
        mp.spawn(_worker_cuda, args=(world, os.path.join(tmp, "init"), tmp, backend, offsets), nprocs=world, join=True)
        return [torch.load(os.path.join(tmp, f"rank{r}.pt"), weights_only=False) for r in range(world)]


@pytest.mark.gpu
def test_cuda_matches_one_process():
    """4 gloo ranks sharing the GPU (CUDA tensors) against the single-process call."""
    _check_against_one_process(_spawn_cuda("gloo", CUDA_CASE[1]))


@pytest.mark.gpu
def test_nccl_one_rank_matches_one_process():
    """NCCL with one rank (what a one-GPU machine allows): the collectives run on NCCL, the whole batch on
    rank 0."""
    if not dist.is_nccl_available():
        pytest.skip("torch built without NCCL")
    _check_against_one_process(_spawn_cuda("nccl", [0, CUDA_CASE[0][-1]]))


def _check_against_one_process(parts: list[dict]) -> None:
    x = _cuda_inputs()
    leaves = {n: x[n].clone().requires_grad_(True) for n in ("q", "k", "v", "g", "beta")}
    A = x["A_log"].clone().requires_grad_(True)
    dtb = x["dt_bias"].clone().requires_grad_(True)
    h0 = x["h0"].clone().requires_grad_(True)
    o, fs = kda_ops.kda(
        *leaves.values(), A, dtb, h0, cu_seqlens=torch.tensor(CUDA_CASE[0]).cuda(), lower_bound=-5.0,
        output_final_state=True,
    )  # fmt: skip
    ((o.float() * x["do"].float()).sum() + (fs * x["dfinal"]).sum()).backward()
    ref = {"o": o, "final": fs, "dA_log": A.grad, "ddt_bias": dtb.grad, "dh0": h0.grad}
    ref.update({"d" + n: t.grad for n, t in leaves.items()})
    for key, tol in (("o", 5e-3), ("dq", 1e-2), ("dk", 1e-2), ("dv", 1e-2), ("dg", 1e-2), ("dbeta", 1e-2)):
        got = torch.cat([p[key] for p in parts], 1)
        assert rel_rms(got, ref[key]) <= tol, (key, rel_rms(got, ref[key]))
    for key, tol in (("final", 1e-3), ("dA_log", 1e-2), ("ddt_bias", 1e-2), ("dh0", 1e-2)):
        got = sum(p[key].double() for p in parts)
        assert rel_rms(got, ref[key]) <= tol, (key, rel_rms(got, ref[key]))


def test_cp_benchmark_harness_on_gloo(tmp_path):  # type: ignore[no-untyped-def]
    """benchmarks/bench_cp.py's harness (the multi-GPU scaling benchmark) on 1 and 2 gloo processes: it writes
    its table, and the bytes a rank sends are the module's formula: (HV·K·K + HV·V·K) fp32 values forward,
    HV·V·K more in the backward, beside the 4 int64 of every call's check (all a single rank sends)."""
    import json

    from benchmarks import bench_cp

    recs = bench_cp.main(["--device", "cpu", "--ranks", "1,2", "--heads", "1", "--tokens", "96", "--rep", "1",
                          "--warmup", "0", "--out", str(tmp_path)])  # fmt: skip
    by_r = {r["R"]: r for r in recs}
    Kc = bench_cp.K
    meta = 4 * 8
    assert by_r[1]["fwd_bytes"] == meta and by_r[1]["step_bytes"] == meta
    assert by_r[2]["fwd_bytes"] == meta + (Kc * Kc + Kc * Kc) * 4
    assert by_r[2]["step_bytes"] == meta + (Kc * Kc + Kc * Kc) * 4 + Kc * Kc * 4
    assert all(r["fwd_ms"] > 0 and r["step_ms"] >= r["fwd_ms"] * 0.5 for r in recs)
    saved = json.loads((tmp_path / "bench_cp.json").read_text())
    assert [r["R"] for r in saved["records"]] == [1, 2]
    assert "| H=1 | 2 | 48 |" in (tmp_path / "bench_cp.md").read_text()
