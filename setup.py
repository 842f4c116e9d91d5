"""Build of the ``kda_ops._C`` extension.

Environment:
  KDA_CUDA_ARCHS  auto (default: the visible GPU, else 90a, else CPU only without a CUDA toolkit)
                  | all (90a,100a,103a,120a) | none (CPU only)
                  | a comma list such as ``90a,100a``
  MAX_JOBS        parallel compile jobs (ninja)
  NVCC_THREADS    ``--threads`` for nvcc (default 1)
  KDA_PTXAS_VERBOSE=1  adds ``--ptxas-options=-v``
  CUTLASS_HOME    a CUTLASS checkout, instead of the pinned nvidia-cutlass wheel's headers
  KDA_WHEEL=1     a wheel for distribution (``make wheel``): torch pinned to the build's torch
  KDA_BUILD_BASE  the build directory (objects under <base>/temp.*), instead of build/
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


def resolve_archs() -> list[str]:
    spec = os.environ.get("KDA_CUDA_ARCHS", "auto").strip().lower()
    if spec == "none":
        return []
    if spec == "all":
        return list(SUPPORTED_ARCHS)
    if spec == "auto":
        from torch.utils.cpp_extension import CUDA_HOME

        if CUDA_HOME is None or not os.path.exists(os.path.join(CUDA_HOME, "bin", "nvcc")):
            print("kda_ops: no CUDA toolkit found, KDA_CUDA_ARCHS=auto builds the CPU-only extension", flush=True)
            return []
        if torch.cuda.is_available():
            major, minor = torch.cuda.get_device_capability()
            arch = f"{major}{minor}a"
            return [arch if arch in SUPPORTED_ARCHS else "90a"]
        return ["90a"]
    archs = [a.strip() for a in spec.split(",") if a.strip()]
    bad = [a for a in archs if a not in SUPPORTED_ARCHS]
    if bad:
        raise SystemExit(
            f"KDA_CUDA_ARCHS: unsupported arch {bad}; expected auto, all, none or a list of {SUPPORTED_ARCHS}"
        )
    return archs


def wheel_metadata(archs: list[str]) -> list[str]:
    """install_requires, and kda_ops/_build_info.py (what this build contains, read by the wheel's smoke test).

    The extension links against libtorch's C++ ABI, which changes between torch releases: a wheel
    (KDA_WHEEL=1) pins the torch it was built against; a source build only needs a floor.
    """
    torch_release = torch.__version__.split("+")[0]
    with open(os.path.join(ROOT, "kda_ops", "_build_info.py"), "w") as f:
        f.write(
            "# Written by setup.py at build time (not in git).\n"
            f"CUDA_ARCHS = {tuple(archs)!r}\nTORCH_VERSION = {torch.__version__!r}\n"
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
    archs = resolve_archs()
    cxx_flags = ["-O3"]
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
        from torch.utils.cpp_extension import CUDA_HOME

        if CUDA_HOME is None or not os.path.exists(os.path.join(CUDA_HOME, "bin", "nvcc")):
            raise SystemExit(
                "KDA_CUDA_ARCHS asks for CUDA kernels but no CUDA toolkit (nvcc) was found: install the CUDA "
                "toolkit and set CUDA_HOME, or build the CPU-only extension with KDA_CUDA_ARCHS=none."
            )
        try:
            include_dirs.append(find_cutlass_include())
        except RuntimeError as e:
            raise SystemExit(str(e)) from None
        cu_sources = sorted(glob.glob("csrc/kda/**/*.cu", recursive=True)) + sorted(
            glob.glob("csrc/instantiations/*.cu")
        )
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
        print("kda_ops: building the CPU-only extension (KDA_CUDA_ARCHS=none)", flush=True)
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
        install_requires=wheel_metadata(archs),
        ext_modules=[ext],
        cmdclass={"build_ext": BuildExtension.with_options(use_ninja=True)},
    )


main()
