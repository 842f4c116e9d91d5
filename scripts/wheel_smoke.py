"""Smoke test of an installed kda_ops wheel on CPU: every public entry point once, checked against the
fp64 reference shipped in the wheel (kda_ops.reference). Run from outside the source tree by
scripts/wheel_smoke.sh; prints one line per entry point and "wheel smoke: OK" at the end.

Also checks what the wheel claims: it is imported from site-packages (not a checkout), its torch
requirement is the exact torch it runs with, and its extension holds CUDA kernels for every supported
architecture (kda_ops/_build_info.py, written at build time) besides the CPU kernels.
"""

from __future__ import annotations

import importlib.metadata as md
import os
import sys

import torch

import kda_ops
from kda_ops import _build_info
from kda_ops.reference import make_inputs, recurrent_kda_reference, reference_training_grads, rel_rms

EXPECTED_ARCHS = tuple(a for a in os.environ.get("KDA_WHEEL_ARCHS", "90a,100a,103a,120a").split(",") if a)
TOL = 1e-4  # fp32 tokens against the fp64 reference


def check(name: str, err: float, tol: float = TOL) -> None:
    if not err <= tol:
        raise SystemExit(f"wheel smoke: {name}: relative RMS error {err:.3g} > {tol}")
    print(f"  {name:<44} ok (rel. err {err:.1e})")


def main() -> None:
    here = os.path.dirname(os.path.abspath(kda_ops.__file__))
    print(f"kda_ops {kda_ops.__version__} from {here}")
    if not here.startswith(os.path.realpath(sys.prefix)) and not here.startswith(sys.prefix):
        raise SystemExit(f"wheel smoke: kda_ops was imported from {here}, not from this venv ({sys.prefix})")
    reqs = [r for r in (md.requires("kda_ops") or []) if "extra ==" not in r]
    torch_release = torch.__version__.split("+")[0]
    if f"torch=={torch_release}" not in reqs:
        raise SystemExit(f"wheel smoke: the wheel requires {reqs}, expected torch=={torch_release} (the torch it runs)")
    print(f"  requires {reqs}; built against torch {_build_info.TORCH_VERSION}, CUDA {_build_info.CUDA_VERSION}")
    if _build_info.CUDA_ARCHS != EXPECTED_ARCHS:
        raise SystemExit(f"wheel smoke: kernels for {_build_info.CUDA_ARCHS}, expected {EXPECTED_ARCHS}")
    if EXPECTED_ARCHS and not torch._C._dispatch_has_kernel_for_dispatch_key("kda::recurrent_kda", "CUDA"):
        raise SystemExit("wheel smoke: the extension registers no CUDA kernels")
    print(f"  CUDA kernels for {', '.join('sm_' + a for a in _build_info.CUDA_ARCHS) or 'none (CPU-only build)'}")

    f32 = torch.float32
    # recurrent_kda: prefill with checkpoints (packed), decode, speculative decode
    cu = [0, 20, 52]
    x = make_inputs(T=52, H=1, HV=2, K=32, V=32, dtype=f32, cu_seqlens=cu)
    pool = x["initial_state"].clone()
    o, fs, ck = kda_ops.recurrent_kda(
        x["q"], x["k"], x["v"], x["g"], x["beta"], x["A_log"], x["dt_bias"], initial_state=pool,
        output_final_state=True, use_gate_in_kernel=True, lower_bound=-5.0, cu_seqlens=x["cu_seqlens"],
        beta_is_logit=True, checkpoint_every_n_tokens=16,
    )  # fmt: skip
    ref = recurrent_kda_reference(
        x["q"], x["k"], x["v"], x["g"], x["beta"], x["A_log"], x["dt_bias"], initial_state=x["initial_state"],
        cu_seqlens=x["cu_seqlens"], use_gate_in_kernel=True, lower_bound=-5.0, beta_is_logit=True,
        checkpoint_every_n_tokens=16,
    )  # fmt: skip
    check("recurrent_kda prefill: output", rel_rms(o, ref.output))
    check("recurrent_kda prefill: pool", rel_rms(fs, ref.final_state))
    check("recurrent_kda prefill: checkpoints", rel_rms(ck, torch.cat(ref.checkpoints)))

    d = make_inputs(B=3, T=1, H=1, HV=2, K=32, V=32, N_pool=5, dtype=f32, seed=1)
    pool = d["initial_state"].clone()
    idx = torch.tensor([4, 0, 2], dtype=torch.int32)
    o, _ = kda_ops.recurrent_kda(d["q"], d["k"], d["v"], d["g"], d["beta"], initial_state=pool, ssm_state_indices=idx)
    h0 = d["initial_state"][idx.long()]
    ref = recurrent_kda_reference(d["q"], d["k"], d["v"], d["g"], d["beta"], initial_state=h0)
    check("recurrent_kda decode", max(rel_rms(o, ref.output), rel_rms(pool[idx.long()], ref.final_state)))

    S = 2
    s = make_inputs(B=2, T=1 + S, H=1, HV=2, K=32, V=32, N_pool=6, dtype=f32, seed=2)
    pool = s["initial_state"].clone()
    sidx = torch.tensor([[0, 1, 2], [3, 4, 5]], dtype=torch.int32)
    acc = torch.tensor([1, 2], dtype=torch.int32)
    o, _ = kda_ops.recurrent_kda(
        s["q"], s["k"], s["v"], s["g"], s["beta"], initial_state=pool, ssm_state_indices=sidx,
        num_spec_tokens=S, num_accepted_tokens=acc,
    )  # fmt: skip
    h0 = s["initial_state"][torch.tensor([0, 4])]
    ref = recurrent_kda_reference(s["q"], s["k"], s["v"], s["g"], s["beta"], initial_state=h0, return_all_states=True)
    got = torch.stack([pool[sidx[n].long()] for n in range(2)])
    check("recurrent_kda spec decode", max(rel_rms(o, ref.output), rel_rms(got, torch.stack(ref.all_states))))

    # training family
    t = make_inputs(T=40, H=1, HV=2, K=32, V=32, dtype=f32, seed=3, cu_seqlens=[0, 17, 40])
    args = (t["q"], t["k"], t["v"], t["g"], t["beta"], t["A_log"], t["dt_bias"], t["initial_state"])
    gen = torch.Generator().manual_seed(4)
    do = torch.randn(t["v"].shape, generator=gen)
    dS = torch.randn(t["initial_state"].shape, generator=gen)
    ro, rfs, rg = reference_training_grads(*args, do, dS, cu_seqlens=t["cu_seqlens"])
    o, fs, ctx = kda_ops.recurrent_kda_training_forward(*args, cu_seqlens=t["cu_seqlens"])
    check("recurrent_kda_training_forward", max(rel_rms(o, ro), rel_rms(fs, rfs)))
    grads = kda_ops.recurrent_kda_training_backward(ctx, do, dS)
    check("recurrent_kda_training_backward", max(rel_rms(a, b) for a, b in zip(grads, rg, strict=True)))
    grads = kda_ops.recurrent_kda_backward(
        *args, do, dS, cu_seqlens=t["cu_seqlens"], workspace=kda_ops.RecurrentKDABackwardWorkspace()
    )
    check("recurrent_kda_backward", max(rel_rms(a, b) for a, b in zip(grads, rg, strict=True)))
    leaves = [a.clone().requires_grad_() for a in args]
    o, fs = kda_ops.kda(*leaves, cu_seqlens=t["cu_seqlens"], output_final_state=True)
    ((o * do).sum() + (fs * dS).sum()).backward()
    check("kda (autograd)", max(rel_rms(a.grad, b) for a, b in zip(leaves, rg, strict=True)))

    # explicit value checks, workspaces
    kda_ops.validate_cu_seqlens(t["cu_seqlens"], 40)
    kda_ops.validate_state_indices(idx, 5)
    ws = kda_ops.RecurrentKDAPrefillWorkspace()
    o2, _ = kda_ops.recurrent_kda(d["q"], d["k"], d["v"], d["g"], d["beta"], prefill_workspace=ws)
    print(f"  {'validate_*, workspaces':<44} ok")

    # fla-shaped entry points (fla itself is not needed for these)
    from kda_ops import fla as kf

    h0_kv = t["initial_state"].transpose(-1, -2).contiguous()
    o, ht = kf.chunk_kda(
        *[a.clone().requires_grad_() for a in args[:5]], initial_state=h0_kv, output_final_state=True,
        use_qk_l2norm_in_kernel=True, use_gate_in_kernel=True, use_beta_sigmoid_in_kernel=True, safe_gate=True,
        lower_bound=-5.0, A_log=t["A_log"], dt_bias=t["dt_bias"].flatten(), cu_seqlens=t["cu_seqlens"],
    )  # fmt: skip
    check("kda_ops.fla.chunk_kda", max(rel_rms(o, ro), rel_rms(ht.transpose(-1, -2), rfs)))
    with torch.no_grad():
        o, ht = kf.fused_recurrent_kda(
            *args[:5], initial_state=h0_kv, output_final_state=True, use_qk_l2norm_in_kernel=True,
            use_gate_in_kernel=True, use_beta_sigmoid_in_kernel=True, lower_bound=-5.0, A_log=t["A_log"],
            dt_bias=t["dt_bias"].flatten(), cu_seqlens=t["cu_seqlens"],
        )  # fmt: skip
        pool_kv = h0_kv.clone()
        o2, _ = kf.fused_recurrent_kda_fwd(
            *args[:5], A_log=t["A_log"], dt_bias=t["dt_bias"].flatten(), initial_state=pool_kv,
            cu_seqlens=t["cu_seqlens"], ssm_state_indices=torch.tensor([1, 0], dtype=torch.int32),
            use_qk_l2norm_in_kernel=True, use_gate_in_kernel=True, use_beta_sigmoid_in_kernel=True, lower_bound=-5.0,
        )  # fmt: skip
    check("kda_ops.fla.fused_recurrent_kda", max(rel_rms(o, ro), rel_rms(ht.transpose(-1, -2), rfs)))
    assert torch.isfinite(o2).all() and not torch.equal(pool_kv, h0_kv)
    print(f"  {'kda_ops.fla.fused_recurrent_kda_fwd':<44} ok")
    print("wheel smoke: OK")


if __name__ == "__main__":
    if os.path.exists(os.path.join(os.getcwd(), "kda_ops", "__init__.py")):
        sys.exit("wheel smoke: run it from outside the source tree (a kda_ops/ directory is in the cwd)")
    main()
