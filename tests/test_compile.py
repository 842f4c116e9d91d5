"""torch.compile(fullgraph=True) of a decode step, a prefill and a training step (docs/contract.md "API").

fullgraph=True turns any graph break into an error, so passing means zero graph breaks. Results are
compared with eager calls on the same inputs. The default backend (inductor) runs for the decode and
training steps; the other cases use aot_eager (the same dynamo trace, fake kernels, functionalization
and autograd, without C++ codegen, which costs tens of seconds per graph on a 2-core CI machine).
"""

from __future__ import annotations

import pytest
import torch
from conftest import force_split, inputs, needs_cpu_op

import kda_ops

K = V = 32
GATE = dict(use_gate_in_kernel=True, lower_bound=-5.0, beta_is_logit=True)


@pytest.fixture(autouse=True)
def _fresh_dynamo():
    torch._dynamo.reset()
    yield
    torch._dynamo.reset()


def _compile(fn, backend):
    return torch.compile(fn, fullgraph=True, backend=backend)


@pytest.mark.parametrize(
    "backend,device",
    [("aot_eager", "cpu"), ("inductor", "cpu"), pytest.param("inductor", "cuda", marks=pytest.mark.gpu)],
)
def test_compile_decode_step(backend, device):
    D = 64 if device == "cuda" else K  # CUDA decode takes K == V in {64, 128}
    x = inputs(B=3, T=1, H=1, HV=2, K=D, V=D, N_pool=5, device=device)
    slots = torch.tensor([4, 0, 2], dtype=torch.int32, device=device)

    def step(q, k, v, g, beta, A_log, dt_bias, pool, slots):
        o, fs = kda_ops.recurrent_kda(
            q,
            k,
            v,
            g,
            beta,
            A_log=A_log,
            dt_bias=dt_bias,
            initial_state=pool,
            ssm_state_indices=slots,
            output_final_state=True,
            **GATE,
        )
        return o, fs

    args = [x[n] for n in ("q", "k", "v", "g", "beta", "A_log", "dt_bias")]
    pool_e, pool_c = x["initial_state"].clone(), x["initial_state"].clone()
    o_e, _ = step(*args, pool_e, slots)
    o_c, fs_c = _compile(step, backend)(*args, pool_c, slots)
    assert torch.equal(o_c, o_e)
    assert torch.equal(pool_c, pool_e), "the in-place pool update must survive functionalization"
    assert torch.equal(fs_c, pool_e)
    # A second decode step reuses the compiled graph and keeps agreeing.
    compiled = _compile(step, backend)
    o_c2, _ = compiled(*args, pool_c, slots)
    o_e2, _ = step(*args, pool_e, slots)
    assert torch.equal(o_c2, o_e2) and torch.equal(pool_c, pool_e)


@pytest.mark.parametrize("backend", ["aot_eager"])
def test_compile_prefill_packed(backend):
    x = inputs(H=2, HV=4, K=K, V=V, cu_seqlens=[0, 11, 11, 30], N_pool=3)

    def prefill(q, k, v, g, beta, A_log, dt_bias, pool, cu):
        # Per-q/k-head parameters are expanded inside the graph.
        return kda_ops.recurrent_kda(
            q, k, v, g, beta, A_log=A_log, dt_bias=dt_bias, initial_state=pool, cu_seqlens=cu, scale=0.3, **GATE
        )[0]

    args = [x[n] for n in ("q", "k", "v", "g", "beta")] + [x["A_log"][:2], x["dt_bias"][:2]]
    pool_e, pool_c = x["initial_state"].clone(), x["initial_state"].clone()
    o_e = prefill(*args, pool_e, x["cu_seqlens"])
    o_c = _compile(prefill, backend)(*args, pool_c, x["cu_seqlens"])
    assert torch.equal(o_c, o_e) and torch.equal(pool_c, pool_e)


def test_compile_prefill_checkpoints_fixed():
    """Fixed-layout checkpoints are sized from shapes: no host sync, no graph break."""
    x = inputs(B=2, T=40, H=1, HV=2, K=K, V=V)

    def prefill(q, k, v, g, beta, A_log, dt_bias):
        return kda_ops.recurrent_kda(
            q,
            k,
            v,
            g,
            beta,
            A_log=A_log,
            dt_bias=dt_bias,
            output_final_state=True,
            checkpoint_every_n_tokens=16,
            **GATE,
        )

    args = [x[n] for n in ("q", "k", "v", "g", "beta", "A_log", "dt_bias")]
    e = prefill(*args)
    c = _compile(prefill, "aot_eager")(*args)
    for a, b in zip(c, e, strict=True):
        assert torch.equal(a, b)


def test_compile_prefill_checkpoints_packed_buffers():
    """Packed checkpoints with caller buffers (the no-sync path) and an output buffer."""
    x = inputs(H=1, HV=2, K=K, V=V, cu_seqlens=[0, 20, 53])
    starts = torch.tensor([0, 2, 5], dtype=torch.int64)

    def prefill(q, k, v, g, beta, A_log, dt_bias, cu, ck, starts, out):
        return kda_ops.recurrent_kda(
            q,
            k,
            v,
            g,
            beta,
            A_log=A_log,
            dt_bias=dt_bias,
            cu_seqlens=cu,
            output=out,
            state_checkpoints=ck,
            checkpoint_cu_starts=starts,
            checkpoint_every_n_tokens=16,
            **GATE,
        )

    args = [x[n] for n in ("q", "k", "v", "g", "beta", "A_log", "dt_bias", "cu_seqlens")]
    ck_e, ck_c = torch.zeros(5, 2, V, K), torch.zeros(5, 2, V, K)
    out_e, out_c = torch.empty_like(x["v"]), torch.empty_like(x["v"])
    prefill(*args, ck_e, starts, out_e)
    _compile(prefill, "aot_eager")(*args, ck_c, starts, out_c)
    assert torch.equal(out_c, out_e) and torch.equal(ck_c, ck_e)


def _train_leaves(dtype=torch.bfloat16):
    x = inputs(H=1, HV=2, K=K, V=V, cu_seqlens=[0, 17, 17, 40], dtype=dtype)
    h0 = torch.randn(3, 2, V, K, generator=torch.Generator().manual_seed(3)) * 0.1
    ts = [x["q"], x["k"], x["v"], x["g"], x["beta"], x["A_log"], x["dt_bias"], h0]
    do = torch.randn(x["v"].shape, generator=torch.Generator().manual_seed(4)).to(dtype)
    return ts, x["cu_seqlens"], do


@needs_cpu_op("recurrent_kda_training_forward", "recurrent_kda_training_backward")
@pytest.mark.parametrize("backend", ["aot_eager", "inductor"])
def test_compile_training_step(backend):
    ts, cu, do = _train_leaves()

    def loss_fn(q, k, v, g, beta, A_log, dt_bias, h0, cu, do):
        o, fs = kda_ops.kda(
            q, k, v, g, beta, A_log, dt_bias, h0, cu_seqlens=cu, lower_bound=-4.0, output_final_state=True
        )
        return (o.float() * do.float()).sum() + fs.square().sum()

    # The usual compiled training step: forward + loss in one fullgraph graph; loss.backward() then runs
    # the AOT-compiled backward graph (which calls kda::recurrent_kda_training_backward).
    leaves_e = [t.detach().clone().requires_grad_() for t in ts]
    leaves_c = [t.detach().clone().requires_grad_() for t in ts]
    loss_e = loss_fn(*leaves_e, cu, do)
    loss_e.backward()
    loss_c = _compile(loss_fn, backend)(*leaves_c, cu, do)
    loss_c.backward()
    torch.testing.assert_close(loss_c, loss_e, rtol=1e-6, atol=0)
    for a, b in zip(leaves_c, leaves_e, strict=True):
        assert a.grad is not None
        torch.testing.assert_close(a.grad, b.grad, rtol=1e-5, atol=1e-6)


@needs_cpu_op("recurrent_kda_training_forward", "recurrent_kda_training_backward")
def test_compile_training_forward_only_and_zero_state():
    """kda() with initial_state=None inside the graph (zeros created in-graph), forward compiled, backward
    through the compiled autograd graph."""
    ts, cu, do = _train_leaves()

    def fwd(q, k, v, g, beta, A_log, dt_bias, cu):
        return kda_ops.kda(q, k, v, g, beta, A_log, dt_bias, cu_seqlens=cu)[0]

    leaves_e = [t.detach().clone().requires_grad_() for t in ts[:7]]
    leaves_c = [t.detach().clone().requires_grad_() for t in ts[:7]]
    o_e = fwd(*leaves_e, cu)
    o_c = _compile(fwd, "aot_eager")(*leaves_c, cu)
    assert torch.equal(o_c, o_e)
    o_e.backward(do)
    o_c.backward(do)
    for a, b in zip(leaves_c, leaves_e, strict=True):
        torch.testing.assert_close(a.grad, b.grad, rtol=1e-5, atol=1e-6)


def _raise_under_tracing(name, real):  # type: ignore[no-untyped-def]
    def query(*a, **kw):  # type: ignore[no-untyped-def]
        if torch.compiler.is_compiling():
            raise AssertionError(f"{name} asked while tracing: the split's tracing guard must come first")
        return real(*a, **kw)

    return query


def _count_split_forwards(monkeypatch) -> list:  # type: ignore[no-untyped-def]
    """A list that grows by one per run of the training split's forward passes (kda_ops/_split.py)."""
    from kda_ops import _split

    runs: list = []
    passes = _split._training_passes

    def counting(*a, **kw):  # type: ignore[no-untyped-def]
        runs.append(1)
        return passes(*a, **kw)

    monkeypatch.setattr(_split, "_training_passes", counting)
    return runs


def _kda_grads_eager_and_compiled(ts, do, backend, between=None):  # type: ignore[no-untyped-def]
    """The gradients of one kda() training step (loss: <o, do> + |final state|²) on copies of the leaves ``ts``,
    eager then compiled with fullgraph=True (``between`` runs in between)."""

    def loss_fn(q, k, v, g, beta, A_log, dt_bias, h0, do):  # type: ignore[no-untyped-def]
        o, fs = kda_ops.kda(q, k, v, g, beta, A_log, dt_bias, h0, output_final_state=True)
        return (o.float() * do.float()).sum() + fs.square().sum()

    leaves_e = [t.detach().clone().requires_grad_() for t in ts]
    leaves_c = [t.detach().clone().requires_grad_() for t in ts]
    loss_fn(*leaves_e, do).backward()
    if between is not None:
        between()
    _compile(loss_fn, backend)(*leaves_c, do).backward()
    return [a.grad for a in leaves_e], [a.grad for a in leaves_c]


@needs_cpu_op("recurrent_kda_training_forward", "recurrent_kda_training_backward")
@pytest.mark.parametrize("split", ["auto", "forced"])
def test_compile_training_step_asks_no_device_while_tracing(split, monkeypatch):
    """torch.compile(fullgraph=True) of a kda() training step where the split could run (forced on, 64-token
    segments, or auto): no CUDA capture or device query may come before the split's tracing guard. On CPU
    those queries short-circuit on the device type, so the calls are traced as if on CUDA (Dims.on_cuda set
    while tracing) and every CUDA query raises when asked during tracing, as dynamo's would on a GPU. The
    compiled graph holds the one op of kda() (torch.ops.kda.kda_forward), which routes when it runs: forced,
    the split runs in the eager step and again in the compiled one."""
    from kda_ops import _validate

    for name in ("is_current_stream_capturing", "current_stream", "get_device_properties", "get_device_capability"):
        monkeypatch.setattr(torch.cuda, name, _raise_under_tracing(name, getattr(torch.cuda, name)))
    init = _validate.Dims.__init__

    def traced_as_cuda(self, *a, **kw):  # type: ignore[no-untyped-def]
        init(self, *a, **kw)
        if torch.compiler.is_compiling():
            self.on_cuda = True

    monkeypatch.setattr(_validate.Dims, "__init__", traced_as_cuda)
    if split == "forced":
        force_split(monkeypatch, 64)
    runs = _count_split_forwards(monkeypatch)
    h0 = torch.randn(1, 2, V, K, generator=torch.Generator().manual_seed(3)) * 0.1
    x = inputs(B=1, T=200, H=1, HV=2, K=K, V=V, dtype=torch.bfloat16)
    ts = [x["q"], x["k"], x["v"], x["g"], x["beta"], x["A_log"], x["dt_bias"], h0]
    do = torch.randn(x["v"].shape, generator=torch.Generator().manual_seed(5)).to(torch.bfloat16)
    eager, compiled = _kda_grads_eager_and_compiled(ts, do, "aot_eager")
    for a, b in zip(compiled, eager, strict=True):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)
    assert len(runs) == (2 if split == "forced" else 0)


@pytest.mark.gpu
@pytest.mark.parametrize("shape", ["default", "split-eligible"])
def test_compile_training_step_cuda(shape, monkeypatch):
    """torch.compile(fullgraph=True) of a kda() training step on CUDA (inductor), gradients against eager:
    a 128-token call at H=4, and a call the exact split takes (one 4096-token sequence at HV=2, split forced
    into 1024-token segments): the compiled graph holds kda()'s one op, which takes the split when it runs, as
    the eager call does. Tolerance: the training tolerance of docs/contract.md (1e-2 relative RMS per
    gradient)."""
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA device")
    H, T = (4, 128) if shape == "default" else (2, 4096)
    if shape == "split-eligible":
        force_split(monkeypatch, 1024)
    runs = _count_split_forwards(monkeypatch)
    x = inputs(B=1, T=T, H=H, HV=H, K=128, V=128, dtype=torch.bfloat16, device="cuda")
    h0 = torch.randn(1, H, 128, 128, device="cuda") * 0.1
    ts = [x["q"], x["k"], x["v"], x["g"], x["beta"], x["A_log"], x["dt_bias"], h0]
    do = torch.randn(x["v"].shape, device="cuda").to(torch.bfloat16)
    eager_runs: list = []
    eager, compiled = _kda_grads_eager_and_compiled(ts, do, "inductor", between=lambda: eager_runs.append(len(runs)))
    want = 1 if shape == "split-eligible" else 0
    assert eager_runs == [want] and len(runs) == 2 * want, "the split must run where eligible, eager and compiled"
    for i, (a, b) in enumerate(zip(compiled, eager, strict=True)):
        assert a is not None and torch.isfinite(a).all()
        err = ((a.double() - b.double()).norm() / b.double().norm().clamp_min(1e-30)).item()
        assert err <= 1e-2, f"gradient {i}: compiled vs eager relative RMS {err:.3e}"
