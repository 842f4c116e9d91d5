"""setup.py's build configuration, without building: KDA_CUDA_ARCHS (auto: the visible GPU's arch, else the CPU-only
extension with one line saying how to ask for kernels; all; none; explicit lists; anything else refused) and
KDA_BUILD_EXPERIMENTS (refused in a wheel build), and what _build_info.py records. CPU only: the CUDA device and the
toolkit lookup are monkeypatched."""

from __future__ import annotations

import importlib.util
import os
import re
import sys

import pytest
import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@pytest.fixture(scope="module")
def setup_mod():
    """setup.py as a module (not __main__: setup() does not run); the environment and sys.path it touches restored."""
    env, path = dict(os.environ), list(sys.path)
    try:
        spec = importlib.util.spec_from_file_location("kda_setup", os.path.join(ROOT, "setup.py"))
        mod = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(mod)
    finally:
        os.environ.clear()
        os.environ.update(env)
        sys.path[:] = path
    return mod


def _gpus(monkeypatch, *caps):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: bool(caps))
    monkeypatch.setattr(torch.cuda, "device_count", lambda: len(caps))
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda i=0: caps[i])


@pytest.fixture
def nvcc(setup_mod, monkeypatch):
    monkeypatch.setattr(setup_mod, "nvcc_path", lambda: "/opt/cuda/bin/nvcc")


def test_auto_without_gpu_is_cpu_only(setup_mod, nvcc, monkeypatch, capsys):
    """nvcc present, no device: no kernels (nobody here could run them), one line saying how to ask for them."""
    _gpus(monkeypatch)
    monkeypatch.delenv("KDA_CUDA_ARCHS", raising=False)
    assert setup_mod.resolve_archs() == []
    out = capsys.readouterr().out.strip().splitlines()
    assert len(out) == 1, out
    assert "CPU-only" in out[0] and "KDA_CUDA_ARCHS=90a" in out[0] and "KDA_CUDA_ARCHS=all" in out[0], out[0]
    assert setup_mod.resolve_archs("auto") == [] and setup_mod.resolve_archs("") == []


@pytest.mark.parametrize(
    "caps, want",
    [([(9, 0)], ["90a"]), ([(10, 0)], ["100a"]), ([(10, 3)], ["103a"]), ([(12, 0)], ["120a"]),
     ([(9, 0), (9, 0)], ["90a"]), ([(9, 0), (10, 0)], ["90a", "100a"]), ([(8, 0), (9, 0)], ["90a"])],
)  # fmt: skip
def test_auto_with_gpu_builds_its_arch(setup_mod, nvcc, monkeypatch, caps, want):
    _gpus(monkeypatch, *caps)
    monkeypatch.setenv("KDA_CUDA_ARCHS", "auto")
    assert setup_mod.resolve_archs() == want


def test_auto_unsupported_gpu_or_no_nvcc_is_cpu_only(setup_mod, monkeypatch, capsys):
    monkeypatch.setattr(setup_mod, "nvcc_path", lambda: "/opt/cuda/bin/nvcc")
    _gpus(monkeypatch, (8, 0))
    assert setup_mod.resolve_archs("auto") == []
    assert "sm_80" in capsys.readouterr().out
    monkeypatch.setattr(setup_mod, "nvcc_path", lambda: None)
    _gpus(monkeypatch, (9, 0))
    assert setup_mod.resolve_archs("auto") == []
    assert "nvcc" in capsys.readouterr().out


@pytest.mark.parametrize(
    "spec, want",
    [("all", ["90a", "100a", "103a", "120a"]), ("none", []), ("90a", ["90a"]), ("90a,100a", ["90a", "100a"]),
     (" 120A , 103a ", ["120a", "103a"])],
)  # fmt: skip
def test_explicit(setup_mod, monkeypatch, spec, want):
    _gpus(monkeypatch, (9, 0))  # a visible device changes nothing for an explicit spec
    monkeypatch.setenv("KDA_CUDA_ARCHS", spec)
    assert setup_mod.resolve_archs() == want


@pytest.mark.parametrize("spec", ["80", "sm_90a", "90", "90a,89a", ",", "cuda"])
def test_bad_arch_refused(setup_mod, spec):
    with pytest.raises(SystemExit, match="KDA_CUDA_ARCHS"):
        setup_mod.resolve_archs(spec)


def test_experiments_flag(setup_mod, monkeypatch):
    monkeypatch.delenv("KDA_WHEEL", raising=False)
    monkeypatch.delenv("KDA_BUILD_EXPERIMENTS", raising=False)
    assert setup_mod.experiments_enabled() is False
    for off in ("", "0"):
        monkeypatch.setenv("KDA_BUILD_EXPERIMENTS", off)
        assert setup_mod.experiments_enabled() is False
    monkeypatch.setenv("KDA_BUILD_EXPERIMENTS", "1")
    assert setup_mod.experiments_enabled() is True
    monkeypatch.setenv("KDA_WHEEL", "1")  # a wheel for distribution never carries the switches
    with pytest.raises(SystemExit, match="KDA_WHEEL"):
        setup_mod.experiments_enabled()
    monkeypatch.delenv("KDA_WHEEL")
    monkeypatch.setenv("KDA_BUILD_EXPERIMENTS", "yes")
    with pytest.raises(SystemExit, match="KDA_BUILD_EXPERIMENTS"):
        setup_mod.experiments_enabled()


def test_build_info_records_archs_and_experiments(setup_mod, monkeypatch, tmp_path):
    (tmp_path / "kda_ops").mkdir()
    monkeypatch.setattr(setup_mod, "ROOT", str(tmp_path))
    monkeypatch.delenv("KDA_WHEEL", raising=False)
    for archs, exp in ((["90a"], True), ([], False)):
        setup_mod.wheel_metadata(archs, exp)
        info: dict = {}
        exec((tmp_path / "kda_ops" / "_build_info.py").read_text(), info)
        assert info["CUDA_ARCHS"] == tuple(archs) and info["EXPERIMENTS"] is exp


def test_ci_and_wheel_ask_for_all_archs():
    """`make wheel` and CI name every arch explicitly (auto would build none on a machine without a GPU)."""
    make = open(os.path.join(ROOT, "Makefile")).read()
    assert re.search(r"^WHEEL_ARCHS \?= all$", make, re.M), "make wheel must default to KDA_CUDA_ARCHS=all"
    ci = open(os.path.join(ROOT, ".ci", "run")).read()
    assert "ARCHS=all" in ci and "WHEEL_ARCHS=$ARCHS" in ci and "KDA_CUDA_ARCHS=$ARCHS" in ci
