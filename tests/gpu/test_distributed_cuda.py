"""GPU tier: context parallelism (kda_ops.distributed) over NCCL, one process and one GPU per rank.

For every world size the visible GPUs allow (1, 2, 4, 8; one GPU runs the one-rank group, which still
takes the NCCL path of every collective), each rank runs its tokens of a packed bf16 batch (K = V = 128)
whose sequences cross the rank boundaries, and once more with rank 1 holding no token; the parent checks
the outputs and all eight gradients, concatenated or summed over the ranks, against ``kda_ops.kda`` on the
whole batch on one GPU, and each rank's rerun for the same bits. Skipped without CUDA.
"""

from __future__ import annotations

import os
import tempfile

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from conftest import TOL_OUT, TOL_STATE_FP32, assert_close_rms

import kda_ops

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA"),
]
H, HV, K = 1, 2, 128
CU = [0, 70, 71, 300, 333]  # a 1-token sequence, one that runs through every rank of 2 and 4
LOWER_BOUND = -0.2  # slow decays: the state crossing a boundary matters
TOL_GRAD = 1e-2
WORLDS = [w for w in (1, 2, 4, 8) if torch.cuda.is_available() and w <= torch.cuda.device_count()]


def _offsets(world: int, empty_rank: bool) -> list[int]:
    T = CU[-1]
    offs = [T * r // world for r in range(world + 1)]
    if empty_rank:
        offs[2] = offs[1]
    return offs


def _inputs(dev: torch.device) -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(5)
    T, N = CU[-1], len(CU) - 1

    def rnd(*shape: int, s: float = 1.0) -> torch.Tensor:
        return (torch.randn(*shape, generator=gen) * s).to(torch.bfloat16).to(dev)

    return dict(
        q=rnd(1, T, H, K), k=rnd(1, T, H, K), v=rnd(1, T, HV, K), g=rnd(1, T, HV, K), beta=rnd(1, T, HV),
        A_log=(torch.randn(HV, generator=gen) * 0.5).to(dev), dt_bias=(torch.randn(HV, K, generator=gen) * 0.5).to(dev),
        h0=(torch.randn(N, HV, K, K, generator=gen) * 0.3).to(dev), do=rnd(1, T, HV, K),
        dfinal=torch.randn(N, HV, K, K, generator=gen).to(dev),
    )  # fmt: skip


def _grads(fn, x, tokens: slice, cu) -> dict[str, torch.Tensor | None]:  # type: ignore[no-untyped-def]
    leaves = {n: x[n][:, tokens].clone().requires_grad_(True) for n in ("q", "k", "v", "g", "beta")}
    A = x["A_log"].clone().requires_grad_(True)
    dtb = x["dt_bias"].clone().requires_grad_(True)
    h0 = x["h0"].clone().requires_grad_(True)
    o, fs = fn(*leaves.values(), A, dtb, h0, cu_seqlens=cu, lower_bound=LOWER_BOUND, output_final_state=True)
    ((o.float() * x["do"][:, tokens].float()).sum() + (fs * x["dfinal"]).sum()).backward()
    res: dict[str, torch.Tensor | None] = {"o": o.detach(), "final": fs.detach()}
    for n, t in leaves.items():
        res["d" + n] = t.grad
    res["dA_log"], res["ddt_bias"], res["dh0"] = A.grad, dtb.grad, h0.grad
    return {k: None if v is None else v.cpu() for k, v in res.items()}


def _worker(rank: int, world: int, init_file: str, out_dir: str) -> None:
    torch.cuda.set_device(rank)
    dev = torch.device("cuda", rank)
    dist.init_process_group("nccl", init_method=f"file://{init_file}", rank=rank, world_size=world)
    import kda_ops.distributed as kd

    x = _inputs(dev)
    results = {}
    for empty in (False, True) if world >= 2 else (False,):
        offs = _offsets(world, empty)
        tokens = slice(offs[rank], offs[rank + 1])
        name = "empty_rank" if empty else "even"
        results[name] = _grads(kd.context_parallel_kda, x, tokens, CU)
        results[name + "_again"] = _grads(kd.context_parallel_kda, x, tokens, CU)
    torch.save(results, os.path.join(out_dir, f"rank{rank}.pt"))
    dist.barrier()
    dist.destroy_process_group()


@pytest.fixture(scope="module", params=WORLDS)
def world_results(request):  # type: ignore[no-untyped-def]
    world = request.param
    with tempfile.TemporaryDirectory() as tmp:
        mp.spawn(_worker, args=(world, os.path.join(tmp, "init"), tmp), nprocs=world, join=True)
        per_rank = [torch.load(os.path.join(tmp, f"rank{r}.pt"), weights_only=False) for r in range(world)]
    return world, per_rank


def test_nccl_matches_one_gpu(world_results):  # type: ignore[no-untyped-def]
    world, per_rank = world_results
    x = _inputs(torch.device("cuda", 0))
    ref = _grads(kda_ops.kda, x, slice(None), torch.tensor(CU, device="cuda"))
    for name in per_rank[0]:
        if name.endswith("_again"):
            continue
        parts = [p[name] for p in per_rank]
        for key in ("o", "dq", "dk", "dv", "dg", "dbeta"):
            got = torch.cat([p[key] for p in parts], 1)
            tol = TOL_OUT if key == "o" else TOL_GRAD
            assert_close_rms(got.float(), ref[key].float(), tol, f"world {world} {name} {key}")
        for key in ("final", "dA_log", "ddt_bias", "dh0"):
            got = sum(p[key].float() for p in parts)
            tol = TOL_STATE_FP32 if key == "final" else TOL_GRAD
            assert_close_rms(got, ref[key].float(), tol, f"world {world} {name} {key} (summed over the ranks)")


def test_nccl_deterministic(world_results):  # type: ignore[no-untyped-def]
    _, per_rank = world_results
    for p in per_rank:
        for name in [n for n in p if not n.endswith("_again")]:
            for key, t in p[name].items():
                if t is not None:
                    assert torch.equal(t, p[name + "_again"][key]), (name, key)
