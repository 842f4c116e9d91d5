"""fla's own KDA reference (``fla.ops.kda.naive``, fla-core 0.6.0) as the independent check of
kda_ops.fla: builders of fla-shaped inputs and a reference that composes fla's naive functions.

Used by tests/test_fla.py (CPU) and tests/gpu/test_fla_cuda.py. The reference runs fla's
``naive_recurrent_kda`` (or ``naive_chunk_kda`` when every sequence is a multiple of 64 tokens) per
sequence, after fla's naive gate functions, an L2 norm with fla's eps and the beta sigmoid, so every
mode of the fla API is checked against fla's own code, not against kda_ops' reference.
"""

from __future__ import annotations

import pytest
import torch

fla_naive = pytest.importorskip(
    "fla.ops.kda.naive", reason="fla-core (==0.6.0, the test extra) is not importable: the fla comparison is skipped"
)
fla_gate = pytest.importorskip("fla.ops.kda.gate", reason="fla-core's gate module is not importable")


def fla_inputs(
    B: int,
    T: int,
    H: int,
    HV: int,
    D: int,
    *,
    gate: str,
    dtype: torch.dtype = torch.float32,
    device: str = "cpu",
    with_state: bool = True,
    N: int | None = None,
    seed: int = 0,
) -> dict[str, torch.Tensor]:
    """Inputs as fla's tests draw them. gate: "pre" (g = logsigmoid, beta post-sigmoid, k normalised),
    "softplus" / "lower_bound" (raw g, A_log, flat dt_bias [HV*D], beta logits)."""
    gen = torch.Generator().manual_seed(seed)

    def r(*s: int, scale: float = 1.0) -> torch.Tensor:
        return (torch.randn(*s, generator=gen) * scale).to(device)

    q, k, v = r(B, T, H, D), r(B, T, H, D), r(B, T, HV, D)
    out: dict[str, torch.Tensor] = {}
    if gate == "pre":
        k = torch.nn.functional.normalize(k, p=2, dim=-1)
        g = torch.nn.functional.logsigmoid(r(B, T, HV, D)) * 0.5
        beta = torch.rand(B, T, HV, generator=gen).to(device)
    else:
        g = r(B, T, HV, D)
        beta = r(B, T, HV)
        out["A_log"] = (torch.rand(HV, generator=gen) * 0.5).log().to(device)
        out["dt_bias"] = r(HV * D, scale=0.5)
    out.update(q=q.to(dtype), k=k.to(dtype), v=v.to(dtype), g=g.to(dtype), beta=beta.to(dtype))
    if with_state:
        out["h0"] = r(N if N is not None else B, HV, D, D, scale=0.2)  # fla layout [N, HV, K, V], fp32
    return out


def fla_reference(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    *,
    scale: float | None = None,
    h0: torch.Tensor | None = None,
    A_log: torch.Tensor | None = None,
    dt_bias: torch.Tensor | None = None,
    gate: str = "pre",
    lower_bound: float | None = None,
    l2: bool = False,
    beta_sigmoid: bool = False,
    allow_neg_eigval: bool = False,
    cu_seqlens: list[int] | None = None,
    chunk: bool = False,
) -> tuple[torch.Tensor, torch.Tensor]:
    """(o [B, T, HV, V] in q's dtype, final state [N, HV, K, V] fp32) from fla's naive functions;
    differentiable (autograd through fla's torch code)."""
    if l2:
        q = q.float() * torch.rsqrt((q.float() ** 2).sum(-1, keepdim=True) + 1e-6)
        k = k.float() * torch.rsqrt((k.float() ** 2).sum(-1, keepdim=True) + 1e-6)
    if gate == "softplus":
        g = fla_gate.naive_kda_gate(g, A_log, dt_bias)
    elif gate == "lower_bound":
        g = fla_gate.naive_kda_lowerbound_gate(g, A_log, dt_bias, lower_bound=lower_bound)
    if beta_sigmoid:
        beta = torch.sigmoid(beta.float()) * (2.0 if allow_neg_eigval else 1.0)
    B, T = q.shape[:2]
    HV, Dv = v.shape[2], v.shape[3]
    fn = fla_naive.naive_chunk_kda if chunk else fla_naive.naive_recurrent_kda
    if cu_seqlens is None:
        o, ht = fn(q.float(), k.float(), v.float(), g.float(), beta.float(), scale=scale, initial_state=h0,
                   output_final_state=True)  # fmt: skip
        return o.to(v.dtype), ht
    outs, states = [], []
    for n in range(len(cu_seqlens) - 1):
        a, b = cu_seqlens[n], cu_seqlens[n + 1]
        hn = None if h0 is None else h0[n : n + 1]
        if b == a:
            outs.append(v.new_zeros(1, 0, HV, Dv, dtype=torch.float32))
            states.append(hn if hn is not None else q.new_zeros(1, HV, q.shape[-1], Dv, dtype=torch.float32))
            continue
        sl = slice(a, b)
        o, ht = fn(q[:, sl].float(), k[:, sl].float(), v[:, sl].float(), g[:, sl].float(), beta[:, sl].float(),
                   scale=scale, initial_state=hn, output_final_state=True)  # fmt: skip
        outs.append(o)
        states.append(ht)
    return torch.cat(outs, 1).to(v.dtype), torch.cat(states, 0)


def close(a: torch.Tensor, b: torch.Tensor, tol: float, name: str) -> None:
    """Relative RMS error of a against b below tol (with a floor for all-zero b)."""
    a, b = a.double(), b.double()
    assert a.shape == b.shape, f"{name}: shape {tuple(a.shape)} != {tuple(b.shape)}"
    err = (a - b).pow(2).mean().sqrt().item()
    ref = max(b.pow(2).mean().sqrt().item(), 1e-6)
    assert err <= tol * ref, f"{name}: relative RMS error {err / ref:.3g} > {tol}"


def test_reference_chunk_matches_recurrent() -> None:
    # The two naive forms of fla agree: the reference itself is consistent where both apply.
    x = fla_inputs(1, 64, 1, 2, 64, gate="pre")
    o1, h1 = fla_reference(x["q"], x["k"], x["v"], x["g"], x["beta"], h0=x["h0"])
    o2, h2 = fla_reference(x["q"], x["k"], x["v"], x["g"], x["beta"], h0=x["h0"], chunk=True)
    close(o2, o1, 1e-4, "o")
    close(h2, h1, 1e-4, "final_state")
