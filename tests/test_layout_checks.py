"""The host-side CuTe layout checks of tests/layout/ (shared-memory layout facts the Hopper kernels rely on) compile and
pass: tests/layout/sm90_layout_check.cu (the Hopper chunked kernel's swizzled operand tiles) and
tests/layout/sweep64_layout_check.cu (the Hopper 64-token backward sweep's fragment layouts and their 32-bit register
pairs, its transposed tile reads, the token tile's swizzle period and 16-byte pieces, and one bf16 [v][k] state
buffer as both wgmma B operands). Host code only: no GPU needed; skipped without nvcc or the CUTLASS headers. Every
.cu file of tests/layout/ is one case."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
LAYOUT = os.path.join(ROOT, "tests", "layout")
CHECKS = sorted(f[: -len(".cu")] for f in os.listdir(LAYOUT) if f.endswith(".cu"))


def _nvcc() -> str | None:
    cuda_home = os.environ.get("CUDA_HOME", "/usr/local/cuda")
    cand = os.path.join(cuda_home, "bin", "nvcc")
    return cand if os.path.exists(cand) else shutil.which("nvcc")


def _cutlass_include() -> str | None:
    sys.path.insert(0, os.path.join(ROOT, "third_party"))
    try:
        from cutlass_include import find_cutlass_include

        return find_cutlass_include()
    except Exception:  # noqa: BLE001  (not installed: the test skips)
        return None
    finally:
        sys.path.pop(0)


def test_layout_checks_found():
    assert {"sm90_layout_check", "sweep64_layout_check"} <= set(CHECKS), CHECKS


@pytest.mark.parametrize("name", CHECKS)
def test_layout_check(name, tmp_path):
    nvcc, inc = _nvcc(), _cutlass_include()
    if nvcc is None or inc is None:
        pytest.skip("needs nvcc and the CUTLASS headers")
    exe = str(tmp_path / name)
    src = os.path.join(LAYOUT, f"{name}.cu")
    build = subprocess.run(
        [nvcc, "-std=c++17", "--expt-relaxed-constexpr", f"-I{ROOT}/csrc", f"-I{inc}", src, "-o", exe],
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert build.returncode == 0, build.stderr[-4000:]
    run = subprocess.run([exe], capture_output=True, text=True, timeout=60)
    assert run.returncode == 0, run.stdout + run.stderr
    assert " 0 mismatches" in run.stdout or "OK" in run.stdout, run.stdout
