"""GPU tier: workspaces made with ``device="cuda"`` (no index) serve tensors on the current CUDA device,
the way CUDA-graph recipes build them; a workspace holding memory on another device is still refused.
Results are compared with the same call without a workspace (bit for bit)."""

from __future__ import annotations

import pytest
import torch

import kda_ops
from kda_ops.reference import make_inputs

pytestmark = pytest.mark.gpu
if not torch.cuda.is_available():
    pytest.skip("needs a CUDA device", allow_module_level=True)

TOK = ("q", "k", "v", "g", "beta")


def _gate_kw(x):
    # the gate of Kimi Linear (lower bound, logit beta): N(0,1) gate inputs give finite outputs; as a
    # precomputed log-decay they would grow without bound
    return dict(use_gate_in_kernel=True, A_log=x["A_log"], dt_bias=x["dt_bias"], lower_bound=-5.0,
                beta_is_logit=True)  # fmt: skip


@pytest.mark.parametrize("nbytes", [0, 1 << 16])
def test_prefill_workspace_device_cuda(nbytes) -> None:
    x = make_inputs(T=300, H=2, HV=2, K=128, V=128, dtype=torch.bfloat16, device="cuda", cu_seqlens=[0, 100, 300])
    ws = kda_ops.RecurrentKDAPrefillWorkspace(device="cuda", nbytes=nbytes)
    kw = dict(cu_seqlens=x["cu_seqlens"], **_gate_kw(x))
    o, _ = kda_ops.recurrent_kda(*(x[n] for n in TOK), prefill_workspace=ws, **kw)
    o_ref, _ = kda_ops.recurrent_kda(*(x[n] for n in TOK), **kw)
    assert torch.equal(o, o_ref)


def test_prefill_workspace_device_cuda_graph_capture() -> None:
    # the docs/serving.md recipe: workspace on "cuda", planned eagerly, then captured and replayed
    x = make_inputs(T=256, H=2, HV=2, K=128, V=128, dtype=torch.bfloat16, device="cuda", cu_seqlens=[0, 56, 256])
    ws = kda_ops.RecurrentKDAPrefillWorkspace(device="cuda")
    out = torch.empty_like(x["v"])
    toks = [x[n].clone() for n in TOK]

    def step():
        kda_ops.recurrent_kda(*toks, cu_seqlens=x["cu_seqlens"], output=out, prefill_workspace=ws, **_gate_kw(x))

    step()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        step()
    for t in toks:
        t.copy_(torch.randn_like(t, dtype=torch.float32).to(t.dtype))
    graph.replay()
    torch.cuda.synchronize()
    o_ref, _ = kda_ops.recurrent_kda(*toks, cu_seqlens=x["cu_seqlens"], **_gate_kw(x))
    assert torch.isfinite(out).all()
    assert torch.equal(out, o_ref)


def test_backward_workspace_device_cuda() -> None:
    x = make_inputs(T=130, H=2, HV=2, K=128, V=128, dtype=torch.bfloat16, device="cuda", cu_seqlens=[0, 30, 130])
    cu32 = x["cu_seqlens"].to(torch.int32)
    args = [x[n] for n in TOK] + [x["A_log"], x["dt_bias"], x["initial_state"]]
    do = torch.randn_like(x["v"])
    ws = kda_ops.RecurrentKDABackwardWorkspace(device="cuda")
    g1 = kda_ops.recurrent_kda_backward(*args, do, None, cu_seqlens=cu32, workspace=ws)
    g2 = kda_ops.recurrent_kda_backward(*args, do, None, cu_seqlens=cu32)
    assert all(torch.equal(a, b) for a, b in zip(g1, g2, strict=True))


def test_workspace_on_another_device_is_refused() -> None:
    x = make_inputs(T=64, H=1, HV=1, K=128, V=128, dtype=torch.bfloat16, device="cuda")
    ws = kda_ops.RecurrentKDAPrefillWorkspace(device="cpu", nbytes=256)
    with pytest.raises(RuntimeError, match="prefill_workspace must be on cuda"):
        kda_ops.recurrent_kda(*(x[n] for n in TOK), prefill_workspace=ws)
