"""Build of the ``kda_ops._C`` extension.

Environment:
  KDA_CUDA_ARCHS  which CUDA kernels to compile:
                  auto (default): the arch of each CUDA device torch sees (sm_90 -> 90a, ...) when that arch
                    is supported and nvcc is found; with no device (or an unsupported one, or no nvcc) the
                    CPU-only extension, with one line saying so: compiling kernels nobody here can run
                    takes minutes per arch. Ask for them with KDA_CUDA_ARCHS=90a (a list) or all.
                  all: 90a,100a,103a,120a (what `make wheel` and CI build)
                  none: the CPU-only extension
                  a comma list such as ``90a,100a``
  KDA_BUILD_EXPERIMENTS=1  compiles the experiment switches in (``-DKDA_EXPERIMENTS=1`` for the C++ and nvcc
                  compiles; kda_ops._build_info.EXPERIMENTS is True); a variant is then picked at run time with
                  KDA_EXPERIMENT (docs/env.md). Off by default; a wheel (KDA_WHEEL=1) refuses it.
  MAX_JOBS        parallel compile jobs (ninja)
  NVCC_THREADS    ``--threads`` for nvcc (default 1)
  KDA_PTXAS_VERBOSE=1  adds ``--ptxas-options=-v``
  CUTLASS_HOME    a CUTLASS checkout, instead of the pinned nvidia-cutlass wheel's headers
  KDA_WHEEL=1     a wheel for distribution (``make wheel``): torch pinned to the build's torch
  KDA_BUILD_BASE  the build directory (objects under <base>/temp.*), instead of build/

Build info: kda_ops/_build_info.py (not in git) records CUDA_ARCHS, EXPERIMENTS, TORCH_VERSION, CUDA_VERSION.
resolve_archs() and experiments_enabled() are importable without building (tests/test_build_config.py):
setup() runs only when this file runs as a script (or through setuptools' build backend, which runs it so).
"""

from __future__ import annotations

import glob
import os
import sys

from setuptools import setup

ROOT = os.path.dirname(os.path.abspath(__file__))
SUPPORTED_ARCHS = ("90a", "100a", "103a", "120a")

# nvcc on PATH may be a wrapper in /usr/local/bin; torch would then guess CUDA_HOME=/usr/local and
# fail to link cudart. Point at the real toolkit when it is where we expect it.
if "CUDA_HOME" not in os.environ and os.path.isdir("/usr/local/cuda/include"):
    os.environ["CUDA_HOME"] = "/usr/local/cuda"

import torch  # noqa: E402
from torch.utils.cpp_extension import BuildExtension, CppExtension, CUDAExtension  # noqa: E402

sys.path.insert(0, os.path.join(ROOT, "third_party"))
from cutlass_include import find_cutlass_include  # noqa: E402


def nvcc_path() -> str | None:
    """nvcc of the CUDA toolkit torch's extension builder will use (CUDA_HOME), or None without one."""
    from torch.utils.cpp_extension import CUDA_HOME

    if CUDA_HOME is None:
        return None
    nvcc = os.path.join(CUDA_HOME, "bin", "nvcc")
    return nvcc if os.path.exists(nvcc) else None


def visible_archs() -> list[str]:
    """The arch of each CUDA device torch sees ("90a" for compute capability 9.0), in device order, no repeats."""
    if not torch.cuda.is_available():
        return []
    archs: list[str] = []
    for i in range(torch.cuda.device_count()):
        major, minor = torch.cuda.get_device_capability(i)
        arch = f"{major}{minor}a"
        if arch not in archs:
            archs.append(arch)
    return archs


_ASK = "ask for CUDA kernels with KDA_CUDA_ARCHS=90a (or a list such as 90a,100a) or KDA_CUDA_ARCHS=all"


def resolve_archs(spec: str | None = None) -> list[str]:
    """The CUDA archs to compile for, from ``spec`` (default: $KDA_CUDA_ARCHS, else auto); [] = CPU only."""
    if spec is None:
        spec = os.environ.get("KDA_CUDA_ARCHS", "auto")
    spec = spec.strip().lower() or "auto"
    if spec == "none":
        print("kda_ops: KDA_CUDA_ARCHS=none: building the CPU-only extension", flush=True)
        return []
    if spec == "all":
        return list(SUPPORTED_ARCHS)
    if spec == "auto":
        seen = visible_archs()
        if not seen:
            print(f"kda_ops: no CUDA device visible, building the CPU-only extension; {_ASK}", flush=True)
            return []
        archs = [a for a in seen if a in SUPPORTED_ARCHS]
        if not archs:
            print(
                f"kda_ops: the visible CUDA device is sm_{seen[0][:-1]}, which the kernels do not support "
                f"({', '.join(SUPPORTED_ARCHS)}): building the CPU-only extension; {_ASK}",
                flush=True,
            )
            return []
        if nvcc_path() is None:
            print(
                f"kda_ops: no CUDA toolkit (nvcc) found for the visible sm_{archs[0][:-1]} device, building the "
                "CPU-only extension; install the CUDA toolkit and set CUDA_HOME to compile the kernels",
                flush=True,
            )
            return []
        return archs
    archs = [a.strip() for a in spec.split(",") if a.strip()]
    bad = [a for a in archs if a not in SUPPORTED_ARCHS]
    if bad or not archs:
        raise SystemExit(
            f"KDA_CUDA_ARCHS={spec!r}: unsupported arch {bad}; expected auto, all, none or a comma list of "
            f"{', '.join(SUPPORTED_ARCHS)}"
        )
    return archs


def experiments_enabled() -> bool:
    """KDA_BUILD_EXPERIMENTS: 1 compiles the experiment switches in; unset, empty or 0 leaves them out."""
    flag = os.environ.get("KDA_BUILD_EXPERIMENTS", "").strip()
    if flag not in ("", "0", "1"):
        raise SystemExit(f"KDA_BUILD_EXPERIMENTS={flag!r}: expected 1 (experiments compiled in) or 0 / unset")
    if flag == "1" and os.environ.get("KDA_WHEEL") == "1":
        raise SystemExit(
            "KDA_BUILD_EXPERIMENTS=1 with KDA_WHEEL=1: a distributed wheel never carries the experiment switches; "
            "unset KDA_BUILD_EXPERIMENTS for `make wheel`, or build in place (`make build`) to experiment"
        )
    return flag == "1"


def wheel_metadata(archs: list[str], experiments: bool) -> list[str]:
    """install_requires, and kda_ops/_build_info.py (what this build contains, read by the wheel's smoke test).

    The extension links against libtorch's C++ ABI, which changes between torch releases: a wheel
    (KDA_WHEEL=1) pins the torch it was built against; a source build only needs a floor.
    """
    torch_release = torch.__version__.split("+")[0]
    with open(os.path.join(ROOT, "kda_ops", "_build_info.py"), "w") as f:
        f.write(
            "# Written by setup.py at build time (not in git).\n"
            f"CUDA_ARCHS = {tuple(archs)!r}\nEXPERIMENTS = {experiments!r}\nTORCH_VERSION = {torch.__version__!r}\n"
            f"CUDA_VERSION = {torch.version.cuda if archs else None!r}\n"
        )
    if os.environ.get("KDA_WHEEL") == "1":
        return [f"torch=={torch_release}"]
    return ["torch>=2.11"]


def link_flags() -> list[str]:
    """Linker flags of the extension.

    On Linux, the symbols of any static archive linked in stay local (``--exclude-libs,ALL``): a toolchain that
    links libstdc++ statically (one whose g++ has no shared libstdc++) would otherwise export its copy's
    STB_GNU_UNIQUE data (the locale facet ids), which the dynamic linker merges with the libstdc++.so that
    torch loaded; two runtimes then share facet indices, and formatting a number in an error message
    crashes. With dynamic libstdc++ (the usual case) no archive is linked and the flag changes nothing.
    """
    return ["-Wl,--exclude-libs,ALL"] if sys.platform.startswith("linux") else []


def main() -> None:
    experiments = experiments_enabled()  # first: a wheel build with experiments stops before anything else
    archs = resolve_archs()
    cxx_flags = ["-O3"]
    if experiments:
        cxx_flags.append("-DKDA_EXPERIMENTS=1")
        print("kda_ops: KDA_BUILD_EXPERIMENTS=1: the experiment switches are compiled in (KDA_EXPERIMENT)", flush=True)
    # The torch-facing layer (csrc/api: schemas, argument checks, tensor -> params, one file per op family and
    # backend) and the CPU kernels (csrc/cpu); the CUDA kernels (csrc/kda) follow when archs are asked for.
    cpp_sources = (
        sorted(glob.glob("csrc/api/registration.cpp"))
        + sorted(glob.glob("csrc/api/python_module.cpp"))
        + sorted(glob.glob("csrc/api/*_cpu.cpp"))
        + sorted(glob.glob("csrc/cpu/*.cpp"))
        + sorted(glob.glob("csrc/kda/route/*.cpp"))  # the routing spine's host part (knobs, the split route)
    )
    include_dirs = [os.path.join(ROOT, "csrc")]
    if archs:
        if nvcc_path() is None:
            raise SystemExit(
                "KDA_CUDA_ARCHS asks for CUDA kernels but no CUDA toolkit (nvcc) was found: install the CUDA "
                "toolkit and set CUDA_HOME, or build the CPU-only extension with KDA_CUDA_ARCHS=none."
            )
        try:
            include_dirs.append(find_cutlass_include())
        except RuntimeError as e:
            raise SystemExit(str(e)) from None
        # every kernel, launcher and instantiation lives under csrc/kda (instantiations beside their kernels)
        cu_sources = sorted(glob.glob("csrc/kda/**/*.cu", recursive=True))
        sources = cpp_sources + sorted(glob.glob("csrc/api/*_cuda.cpp")) + cu_sources
        nvcc_flags = [
            "-O3",
            "--expt-relaxed-constexpr",
            "--expt-extended-lambda",
            "-lineinfo",
            "--use_fast_math",
            f"--threads={os.environ.get('NVCC_THREADS', '1')}",
            "-DNDEBUG",
        ]
        if experiments:
            nvcc_flags.append("-DKDA_EXPERIMENTS=1")
        if os.environ.get("KDA_PTXAS_VERBOSE") == "1":
            nvcc_flags.append("--ptxas-options=-v")
        for a in archs:
            nvcc_flags += ["-gencode", f"arch=compute_{a},code=sm_{a}"]
        print(f"kda_ops: building CUDA kernels for {archs}", flush=True)
        ext = CUDAExtension(
            "kda_ops._C",
            sources,
            include_dirs=include_dirs,
            extra_compile_args={"cxx": cxx_flags + ["-DKDA_WITH_CUDA"], "nvcc": nvcc_flags},
            extra_link_args=link_flags(),
        )
    else:
        ext = CppExtension(
            "kda_ops._C",
            cpp_sources,
            include_dirs=include_dirs,
            extra_compile_args={"cxx": cxx_flags},
            extra_link_args=link_flags(),
        )
    # The build directory as an option, not as a `build` command on the command line: that command would
    # run on its own before bdist_wheel's, and the second build_ext run sees the compile flags torch's
    # BuildExtension appended in the first (changed commands: ninja recompiles everything).
    build_base = os.environ.get("KDA_BUILD_BASE")
    setup(
        options={"build": {"build_base": build_base}} if build_base else {},
        install_requires=wheel_metadata(archs, experiments),
        ext_modules=[ext],
        cmdclass={"build_ext": BuildExtension.with_options(use_ninja=True)},
    )


if __name__ == "__main__":  # also under setuptools' build backend (pip install, python -m build)
    main()
