"""The routing spine's switches (docs/env.md): read once, checked at import, documented in one table.

The route functions themselves run where their kernels run (the split route here: tests/test_split.py; the CUDA
routes in the GPU tier, whose tests pin kernels through these switches)."""

from __future__ import annotations

import os
import re

import pytest
from conftest import route_env

from kda_ops import _routing

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _csrc_files():  # type: ignore[no-untyped-def]
    for base, _, names in os.walk(os.path.join(ROOT, "csrc")):
        for n in names:
            if n.endswith((".h", ".cuh", ".cpp", ".cu")):
                yield os.path.join(base, n)


def test_switches_are_read_in_one_place_and_documented():
    """Every getenv of the C++ layer is in csrc/kda/route/knobs.cpp, and every KDA_* name read there (through
    getenv or the pin reader) is documented in docs/env.md."""
    places = set()
    for path in _csrc_files():
        with open(path, encoding="utf-8") as f:
            if "getenv(" in f.read():
                places.add(os.path.relpath(path, ROOT))
    knobs_cpp = os.path.join("csrc", "kda", "route", "knobs.cpp")
    assert places == {knobs_cpp}, places
    with open(os.path.join(ROOT, knobs_cpp), encoding="utf-8") as f:
        src = f.read()
    names = set(re.findall(r'getenv\("(KDA_[A-Z0-9_]+)"', src)) | set(
        re.findall(r'read_pin\(k, "(KDA_[A-Z0-9_]+)"', src)
    )
    assert {"KDA_VERBOSE", "KDA_CHUNKED_KERNEL", "KDA_SEQUENCE_SPLIT"} <= names, names
    with open(os.path.join(ROOT, "docs", "env.md"), encoding="utf-8") as f:
        doc = f.read()
    undocumented = sorted(n for n in names if f"`{n}`" not in doc)
    assert not undocumented, undocumented
    assert len(names) <= 10, sorted(names)


def test_knobs_follow_the_environment(monkeypatch):  # type: ignore[no-untyped-def]
    route_env(monkeypatch, KDA_CHUNKED_KERNEL="MMA64", KDA_DECODE_KERNEL="serial", KDA_TRAINING_SWEEP="small",
              KDA_SEQUENCE_SPLIT="0", KDA_SEQUENCE_SPLIT_TOKENS="128", KDA_VERBOSE="1")  # fmt: skip
    k = _routing.knobs()
    assert (k["chunked"], k["decode"], k["sweep"], k["split"]) == ("mma64", "serial", "small", "0")
    assert k["split_tokens"] == 128 and k["verbose"] is True and k["error"] == ""
    assert _routing.split_off()
    route_env(monkeypatch, KDA_CHUNKED_KERNEL=None, KDA_SEQUENCE_SPLIT=None, KDA_VERBOSE=None)
    k = _routing.knobs()
    assert (k["chunked"], k["split"], k["verbose"]) == ("auto", "auto", False)
    assert not _routing.split_off()


@pytest.mark.parametrize(
    "name,value",
    [
        ("KDA_CHUNKED_KERNEL", "hopper"),
        ("KDA_DECODE_KERNEL", "fast"),
        ("KDA_TRAINING_SWEEP", "wgmma32"),
        ("KDA_SEQUENCE_SPLIT", "maybe"),
        ("KDA_SEQUENCE_SPLIT_TOKENS", "100"),
        ("KDA_SEQUENCE_SPLIT_TOKENS", "-64"),
        ("KDA_VERBOSE", "loud"),
    ],
)
def test_invalid_switch_names_itself(monkeypatch, name, value):  # type: ignore[no-untyped-def]
    with pytest.raises(ValueError, match=name):
        route_env(monkeypatch, **{name: value})
    assert _routing.knobs()["error"].startswith(name)


def test_experiment_switch_needs_an_experiments_build(monkeypatch):  # type: ignore[no-untyped-def]
    if _routing.knobs()["experiments_built"]:
        route_env(monkeypatch, KDA_EXPERIMENT="sm90_variant=2,rows_per_lane=8")
        with pytest.raises(ValueError, match="KDA_EXPERIMENT: unknown key"):
            route_env(monkeypatch, KDA_EXPERIMENT="warp_drive=1")
    else:
        with pytest.raises(ValueError, match="KDA_BUILD_EXPERIMENTS=1"):
            route_env(monkeypatch, KDA_EXPERIMENT="sm90_variant=2")


def test_import_fails_on_an_invalid_switch():
    """A fresh process with an invalid switch fails at import, naming it (no call ever runs with a typo'd pin)."""
    import subprocess
    import sys

    env = dict(os.environ, KDA_CHUNKED_KERNEL="sm9O")
    r = subprocess.run([sys.executable, "-c", "import kda_ops"], env=env, capture_output=True, text=True, cwd=ROOT)
    assert r.returncode != 0 and "KDA_CHUNKED_KERNEL must be" in r.stderr, r.stderr[-500:]


def test_verbose_names_the_route_of_a_cpu_call(monkeypatch, capfd):  # type: ignore[no-untyped-def]
    """KDA_VERBOSE=1: one route line per op call, on the CPU too (the token loop, whatever the backend)."""
    import torch

    import kda_ops
    from kda_ops.reference import make_inputs

    route_env(monkeypatch, KDA_VERBOSE="1")
    x = make_inputs(B=1, T=20, H=1, HV=2, K=16, V=16, dtype=torch.float32, seed=1)
    capfd.readouterr()
    kda_ops.recurrent_kda(x["q"], x["k"], x["v"], x["g"], x["beta"], A_log=x["A_log"], dt_bias=x["dt_bias"],
                          use_gate_in_kernel=True, lower_bound=-5.0, backend="chunked")  # fmt: skip
    err = capfd.readouterr().err
    assert err.count("kda route: forward kernel=cpu_token_loop | N=1 HV=2 T=20 B=1 K=16 cpu") == 1, err
    route_env(monkeypatch, KDA_VERBOSE="0")
    kda_ops.recurrent_kda(x["q"], x["k"], x["v"], x["g"], x["beta"], A_log=x["A_log"], dt_bias=x["dt_bias"],
                          use_gate_in_kernel=True, lower_bound=-5.0)  # fmt: skip
    assert "kda route" not in capfd.readouterr().err
