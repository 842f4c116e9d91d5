"""Direct torch.ops.kda calls on CPU with a zero head or channel count (H, HV, K or V = 0): the C++ entry
points raise a c10 error (ValueError) that names the argument, instead of dividing by zero (HV % H, HV / H)
and ending the process. B = 0 and T = 0 stay legal (nothing to compute).

The calls run in one child process: a division by zero is SIGFPE, which would end the test run itself, and a
direct training-op call that raises beneath the Python autograd kernel has ended in SIGSEGV on torch 2.11.
The child prints one line per case: ``name|ok`` or ``name|<exception type>|<message>``.
"""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

_CHILD = r"""
import torch
import kda_ops  # noqa: F401  (registers torch.ops.kda)
OPS = torch.ops.kda
BF = torch.bfloat16


def tok(B, T, heads, dim):
    return torch.randn(B, T, heads, dim).to(BF)


def recurrent(B=1, T=4, H=1, HV=2, K=8, V=8):
    q, k = tok(B, T, H, K), tok(B, T, H, K)
    v, g = tok(B, T, HV, V), tok(B, T, HV, K)
    beta = torch.randn(B, T, HV).to(BF)
    out = torch.zeros(B, T, HV, V, dtype=BF)
    A_log, dtb = torch.zeros(HV), torch.zeros(HV, K)
    OPS.recurrent_kda.default(
        q, k, v, g, beta, A_log=A_log, dt_bias=dtb, state=None, state_source=None, initial_state_indices=None,
        cu_seqlens=None, ssm_state_indices=None, num_accepted_tokens=None, seq_order=None, output=out,
        final_state=None, state_checkpoints=None, checkpoint_cu_starts=None, workspace=None, scale=0.5,
        gate_mode=2, lower_bound=-5.0, use_qk_l2norm=True, beta_is_logit=True, num_spec_tokens=0,
        checkpoint_every_n_tokens=0, backend=0, zero_uncovered=False,
    )


def training_args(B=1, T=4, H=1, HV=2, K=8, V=8):
    q, k = tok(B, T, H, K).float(), tok(B, T, H, K).float()
    v, g = tok(B, T, HV, V).float(), tok(B, T, HV, K).float()
    beta = torch.randn(B, T, HV)
    return q, k, v, g, beta, torch.zeros(HV), torch.zeros(HV, K), torch.zeros(B, HV, V, K)


def training_forward(**d):
    OPS.recurrent_kda_training_forward.default(*training_args(**d), None, 0.5, -1.0)


def backward(**d):
    a = training_args(**d)
    do = torch.zeros_like(a[2])
    OPS.recurrent_kda_backward.default(*a, None, do, None, 0.5, -1.0)


def training_backward(**d):
    q, k, v, g, beta, A, dtb, h0 = training_args(**d)
    HV, V, K = v.shape[2], v.shape[3], q.shape[3]
    tapes = torch.zeros(0, HV, V, K)
    starts = torch.zeros(q.shape[0] + 1, dtype=torch.int64)
    OPS.recurrent_kda_training_backward.default(q, k, v, g, beta, A, dtb, tapes, starts, h0, None,
                                                torch.zeros_like(v), None, 0.5, -1.0)


CASES = {
    "recurrent_H0": (recurrent, dict(H=0)),
    "recurrent_K0": (recurrent, dict(K=0)),
    "recurrent_HV0": (recurrent, dict(HV=0)),
    "recurrent_V0": (recurrent, dict(V=0)),
    "recurrent_B0": (recurrent, dict(B=0)),
    "recurrent_T0": (recurrent, dict(T=0)),
    "training_forward_H0": (training_forward, dict(H=0)),
    "training_forward_K0": (training_forward, dict(K=0)),
    "training_forward_HV0": (training_forward, dict(HV=0)),
    "training_forward_V0": (training_forward, dict(V=0)),
    "training_forward_T0": (training_forward, dict(T=0)),
    "training_backward_H0": (training_backward, dict(H=0)),
    "training_backward_HV0": (training_backward, dict(HV=0)),
    "backward_H0": (backward, dict(H=0)),
    "backward_V0": (backward, dict(V=0)),
}
for name, (fn, d) in CASES.items():
    try:
        fn(**d)
        print(f"{name}|ok", flush=True)
    except Exception as e:  # noqa: BLE001  (reported to the parent)
        msg = str(e).splitlines()[0] if str(e) else ""
        print(f"{name}|{type(e).__name__}|{msg}", flush=True)
print("DONE", flush=True)
"""

# case -> None (must succeed) or (exception type, substring of the message naming the argument)
EXPECTED = {
    "recurrent_H0": ("ValueError", "q must be [B, T, H, K] with H >= 1 and K >= 1"),
    "recurrent_K0": ("ValueError", "q must be [B, T, H, K] with H >= 1 and K >= 1"),
    "recurrent_HV0": ("ValueError", "v must be [B, T, HV, V] with HV >= 1 and V >= 1"),
    "recurrent_V0": ("ValueError", "v must be [B, T, HV, V] with HV >= 1 and V >= 1"),
    "recurrent_B0": None,
    "recurrent_T0": None,
    "training_forward_H0": ("ValueError", "recurrent_kda_training_forward: q must be [B, T, H, K] with H >= 1"),
    "training_forward_K0": ("ValueError", "recurrent_kda_training_forward: q must be [B, T, H, K] with H >= 1"),
    "training_forward_HV0": ("ValueError", "recurrent_kda_training_forward: v must be [B, T, HV, V] with HV >= 1"),
    "training_forward_V0": ("ValueError", "recurrent_kda_training_forward: v must be [B, T, HV, V] with HV >= 1"),
    "training_forward_T0": None,
    "training_backward_H0": ("ValueError", "recurrent_kda_training_backward: q must be [B, T, H, K] with H >= 1"),
    "training_backward_HV0": ("ValueError", "recurrent_kda_training_backward: v must be [B, T, HV, V] with HV >= 1"),
    "backward_H0": ("ValueError", "q must be [B, T, H, K] with H >= 1"),
    "backward_V0": ("ValueError", "v must be [B, T, HV, V] with HV >= 1"),
}


@pytest.fixture(scope="module")
def results() -> dict[str, list[str]]:
    r = subprocess.run(
        [sys.executable, "-c", _CHILD],
        capture_output=True,
        text=True,
        timeout=300,
        cwd=ROOT,
        env=dict(os.environ, OMP_NUM_THREADS="1"),
    )
    lines = [line for line in r.stdout.splitlines() if "|" in line]
    got = {line.split("|", 1)[0]: line.split("|")[1:] for line in lines}
    assert "DONE" in r.stdout, (
        f"the child process ended early (rc {r.returncode}: a signal is a division by zero or a crash) after "
        f"{list(got)}; stderr:\n{r.stderr[-3000:]}"
    )
    return got


@pytest.mark.parametrize("case", sorted(EXPECTED))
def test_zero_dimension(results, case):
    got = results[case]
    want = EXPECTED[case]
    if want is None:
        assert got == ["ok"], f"{case}: a zero batch or token count must be accepted, got {got}"
        return
    assert got[0] == want[0], f"{case}: expected {want[0]}, got {got}"
    assert want[1] in got[1], f"{case}: the message must name the argument ({want[1]!r}), got {got[1]!r}"
