"""GPU tier: fla's own KDA model (flash-linear-attention 0.6.0, ``fla.models.KDAForCausalLM`` built of
``fla.layers.KimiDeltaAttention``) end to end on kda_ops through ``kda_ops.fla.install()``, beside the same steps on
fla's Triton kernels.

For the layer's default configuration (the softplus gate) and ``safe_gate=True, lower_bound=-5``:
  * three AdamW steps from the same initial weights on the same tokens, once on fla's kernels and once under
    ``install()``: the losses agree within 2e-2 relative and the first step's parameter gradients within 1e-2
    relative RMS over the whole model (5e-2 per parameter tensor: the small gate parameters A_log and dt_bias sum
    many terms);
  * the installed step runs kda_ops' training ops (``kda::`` in the profiler) and none of fla's KDA Triton kernels;
  * greedy ``generate()`` with the recurrent cache (prefill, then one-token decode steps) runs through kda_ops
    and picks the tokens fla's kernels pick (a near-tie may flip one late token: at least 7 of 8, the first equal);
  * a layer call kda_ops declines (lower_bound = -10 under autograd) runs as fast installed as not.
Skipped without CUDA, fla-core or flash-linear-attention (``fla.models``) and transformers.
Run: python -m pytest -q -m gpu tests/gpu/test_fla_model_cuda.py
(fla's Triton kernels compile and autotune on first use: minutes in a fresh process; TRITON_CACHE_DIR keeps them.)
"""

from __future__ import annotations

import copy
import re

import pytest
import torch

from kda_ops import fla as kf

pytestmark = pytest.mark.gpu
if not torch.cuda.is_available():
    pytest.skip("needs a CUDA device", allow_module_level=True)
pytest.importorskip("transformers", reason="transformers is not importable")
fla_models = pytest.importorskip("fla.models", reason="flash-linear-attention (fla.models) is not importable")

# fla's KDA Triton kernels (fla/ops/kda, the gated delta rule kernels it calls): none of them may run installed.
FLA_KDA_KERNEL = re.compile(
    r"^(chunk_kda_|recompute_w_u_fwd|kda_gate_|chunk_gated_delta_rule_|prepare_wy_repr_bwd|fused_recurrent_kda_)"
)
CONFIGS = [
    pytest.param({}, id="default-softplus"),
    pytest.param({"safe_gate": True, "lower_bound": -5.0}, id="safe-gate-lb5"),
]


@pytest.fixture(autouse=True)
def _uninstalled():
    kf.uninstall()
    yield
    kf.uninstall()


def _model(cfg: dict) -> torch.nn.Module:
    config = fla_models.KDAConfig(
        hidden_size=512, num_heads=4, head_dim=128, num_hidden_layers=2, vocab_size=1024, **cfg
    )
    torch.manual_seed(0)
    return fla_models.KDAForCausalLM(config).to(device="cuda", dtype=torch.bfloat16)


def _data(seed: int = 1) -> torch.Tensor:
    g = torch.Generator(device="cuda").manual_seed(seed)
    return torch.randint(0, 1024, (2, 512), device="cuda", generator=g)


def _steps(model: torch.nn.Module, data: torch.Tensor, n: int = 3):
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    losses, grads = [], {}
    for i in range(n):
        out = model(input_ids=data, labels=data)
        out.loss.backward()
        if i == 0:
            grads = {k: p.grad.float().clone() for k, p in model.named_parameters() if p.grad is not None}
        opt.step()
        opt.zero_grad(set_to_none=True)
        losses.append(out.loss.item())
    torch.cuda.synchronize()
    return losses, grads


def _rel_rms(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a - b).pow(2).mean().sqrt() / b.pow(2).mean().sqrt().clamp_min(1e-30)).item()


def _profile(fn) -> tuple[list[str], list[str]]:
    """(CPU op names, CUDA kernel names) of one call of fn."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        fn()
        torch.cuda.synchronize()
    ev = prof.events()
    cuda = [e.name for e in ev if e.device_type == torch.autograd.DeviceType.CUDA]
    cpu = [e.name for e in ev if e.device_type == torch.autograd.DeviceType.CPU]
    return cpu, cuda


@pytest.mark.parametrize("cfg", CONFIGS)
def test_model_training_steps_installed_vs_fla(cfg) -> None:
    base = _model(cfg)
    data = _data()
    ours = copy.deepcopy(base)
    loss_fla, grad_fla = _steps(base, data)
    kf.install()
    loss_ours, grad_ours = _steps(ours, data)
    for i, (a, b) in enumerate(zip(loss_ours, loss_fla, strict=True)):
        assert abs(a - b) <= 2e-2 * abs(b), f"step {i}: loss {a} (kda_ops) vs {b} (fla)"
    assert grad_ours.keys() == grad_fla.keys()
    whole = _rel_rms(
        torch.cat([grad_ours[k].flatten() for k in grad_fla]), torch.cat([g.flatten() for g in grad_fla.values()])
    )
    per = {k: _rel_rms(grad_ours[k], grad_fla[k]) for k in grad_fla}
    worst = sorted(per.items(), key=lambda kv: -kv[1])[:5]
    assert whole <= 1e-2, f"gradients rel RMS {whole:.2e} over the model; worst tensors {worst}"
    assert all(v <= 5e-2 for v in per.values()), f"per-tensor gradients: worst {worst}"

    def step() -> None:
        out = ours(input_ids=data, labels=data)
        out.loss.backward()
        ours.zero_grad(set_to_none=True)

    cpu, cuda = _profile(step)
    assert any(n.startswith("kda::") for n in cpu), sorted({n for n in cpu if "kda" in n})
    fla_ran = sorted({n for n in cuda if FLA_KDA_KERNEL.match(n)})
    assert not fla_ran, f"fla's KDA kernels ran under install(): {fla_ran}"


@pytest.mark.parametrize("cfg", CONFIGS)
def test_model_generate_installed_vs_fla(cfg) -> None:
    model = _model(cfg).eval()
    prompt = _data(seed=2)[:1, :100]
    kw = dict(max_new_tokens=8, do_sample=False, use_cache=True)
    with torch.no_grad():
        ref = model.generate(input_ids=prompt, **kw)[0, 100:]
        kf.install()
        got = model.generate(input_ids=prompt, **kw)[0, 100:]
        cpu, cuda = _profile(lambda: model.generate(input_ids=prompt, **kw))
    same = (got == ref).sum().item()
    assert got[0] == ref[0] and same >= 7, f"kda_ops {got.tolist()} vs fla {ref.tolist()}"
    assert any(n.startswith("kda::recurrent_kda") for n in cpu), sorted({n for n in cpu if "kda" in n})
    fla_ran = sorted({n for n in cuda if FLA_KDA_KERNEL.match(n)})
    assert not fla_ran, f"fla's KDA kernels ran under install(): {fla_ran}"


def test_declined_layer_costs_nothing_installed() -> None:
    """A call install() declines (fla's layer with lower_bound = -10 under autograd: kda_ops' training path takes
    λ in [-5, 0)) runs fla's kernels at fla's speed: the layer's forward + backward, timed interleaved with and without
    the backend (medians of 15), differ by less than 10% + 0.2 ms (the verifier binds and checks in microseconds)."""
    import statistics

    from fla.layers import KimiDeltaAttention

    torch.manual_seed(0)
    attn = KimiDeltaAttention(hidden_size=512, num_heads=4, head_dim=128, lower_bound=-10.0).to("cuda", torch.bfloat16)
    x = torch.randn(2, 1024, 512, device="cuda", dtype=torch.bfloat16, requires_grad=True)

    def step() -> float:
        torch.cuda.synchronize()
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        o = attn(x)[0]
        o.float().sum().backward()
        b.record()
        b.synchronize()
        return a.elapsed_time(b)

    for _ in range(3):  # fla's autotune and warm-up, both ways
        step()
        kf.install()
        step()
        kf.uninstall()
    plain, installed = [], []
    for _ in range(15):
        plain.append(step())
        kf.install()
        installed.append(step())
        kf.uninstall()
    p, i = statistics.median(plain), statistics.median(installed)
    assert i <= 1.1 * p + 0.2, f"installed {i:.3f} ms vs {p:.3f} ms without the backend"
