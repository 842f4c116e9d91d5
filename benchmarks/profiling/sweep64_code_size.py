"""Code size of the Hopper 64-token sweep per profile phase: compiles csrc/kda/backward/sm90/sweep64_sm90.cu to an
sm_90a cubin (the build's nvcc flags), disassembles it with line information and sums the instruction bytes between
the kernel's consecutive clock reads (the phases of KDA_EXPERIMENT=sweep64_profile=1, in code order), in all and
without the paths
the lower-bound, full-state, HV == H case never runs (the wide blocks, the checked state loads, the per-head GQA
stores). The phases are those of the kernel's profiling instantiation (the one with the clocks); ptxas's registers,
stack frame and spills are printed for both instantiations, and the local-memory instructions (LDL / STL: register
spills) of each phase's hot code for the profiling one. No GPU needed:

    .venv/bin/python benchmarks/profiling/sweep64_code_size.py [--source FILE]     (a Python with the CUTLASS headers)

Why: most of the kernel's code runs once per task, and with all SMs busy its phases slowed by ~200-370 cycles per KB
of that code (docs/performance.md), so this count is a cost to watch beside the clocks. The phase of an instruction is
where it sits, not where its time goes (a non-inlined function's body counts under "after the phases"); "hot" is an
estimate (the gate-mode instantiations of da count three times).
"""

from __future__ import annotations

import argparse
import glob
import os
import re
import shutil
import subprocess
import sys
import tempfile
from collections import Counter

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.join(ROOT, "third_party"))
from cutlass_include import find_cutlass_include  # noqa: E402

SOURCE = os.path.join(ROOT, "csrc", "kda", "backward", "sm90", "sweep64_sm90.cu")
PROFILING = "ILb1E"  # the mangled template argument of the kernel's profiling instantiation (kProfile = true)
# kProfNames of the kernel, after the clock read of prof.start
PHASES = [
    "setup",
    "load+wait",
    "gate",
    "norms",
    "L/Mqk+K+",
    "X start",
    "inverse diag",
    "inverse rest",
    "X wait+Kr",
    "dR",
    "R/dY/dbeta",
    "dA/dM/dQ/dK",
    "dKr",
    "pair terms",
    "dgam",
    "dbeta+l2",
    "da+partials",
]
# functions whose bodies are cold in the common case, and markers of cold call sites
COLD_FUNCTIONS = (
    "__device__ void wide_pair_matrices",
    "__device__ __forceinline__ void wide_log_decays",
    "__device__ __noinline__ void wide_diag_element",
    "__device__ __noinline__ float log_decay",
)
COLD_MARKERS = ("s0_at", "ds_at", "dq_head", "dk_head", "fill_a([](int, int)", "(wide path)")


def tool(name: str) -> str:
    cuda = os.environ.get("CUDA_HOME", "/usr/local/cuda")
    for cand in [os.path.join(cuda, "bin", name), shutil.which(name) or ""] + glob.glob(
        os.path.join(sys.prefix, "lib", "python3*", "site-packages", "triton", "backends", "nvidia", "bin", name)
    ):
        if cand and os.path.exists(cand):
            return cand
    raise SystemExit(f"{name} not found (CUDA_HOME/bin, PATH, or triton's bundled copy)")


def cold_lines(src: list[str]) -> tuple[list[tuple[int, int]], set[int]]:
    ranges = []
    for head in COLD_FUNCTIONS:
        i = next(k for k, line in enumerate(src) if line.startswith(head))
        j = next(k for k in range(i, len(src)) if src[k].startswith("}"))
        ranges.append((i + 1, j + 1))
    lines = {k for k, line in enumerate(src, 1) if any(m in line for m in COLD_MARKERS) and "const auto" not in line}
    return ranges, lines


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--source", default=SOURCE)
    ap.add_argument(
        "--lines",
        metavar="PHASE",
        help="also list the phase's hot code bytes per source line (the "
        "innermost line of this file an instruction comes from), largest first",
    )
    args = ap.parse_args()
    src = open(args.source, encoding="utf-8").read().splitlines()
    name = os.path.basename(args.source)
    with tempfile.TemporaryDirectory() as tmp:
        cubin = os.path.join(tmp, "sweep64.cubin")
        cmd = [
            tool("nvcc"),
            "-I",
            os.path.join(ROOT, "csrc"),
            "-I",
            find_cutlass_include(),
            "-O3",
            "--expt-relaxed-constexpr",
            "--expt-extended-lambda",
            "-lineinfo",
            "--use_fast_math",
            "-DNDEBUG",
            "-DKDA_EXPERIMENTS=1",  # (the profiling instantiation is an experiment)
            "-std=c++20",
            "-gencode",
            "arch=compute_90a,code=sm_90a",
            "-cubin",
            "-Xptxas",
            "-v",
            "-o",
            cubin,
            args.source,
        ]
        build = subprocess.run(cmd, capture_output=True, text=True)
        if build.returncode != 0:
            raise SystemExit(build.stderr[-4000:])
        log = build.stderr.splitlines()
        for at, line in enumerate(log):
            if "Compiling entry" in line and "sweep64_kernel" in line:
                which = "profiling" if PROFILING in line else "production"
                stats = "; ".join(x.split(":", 1)[-1].strip() for x in log[at + 1 : at + 4] if "bytes" in x)
                print(f"ptxas ({which}):", stats)
        sass = subprocess.run([tool("nvdisasm"), "-gi", cubin], capture_output=True, text=True, check=True).stdout
    ranges, marked = cold_lines(src)
    seg, group, in_group, fn = -1, [], False, ""
    total, hot, by_line, spills = Counter(), Counter(), Counter(), Counter()
    for line in sass.splitlines():
        m = re.match(r"\s*\.text\.(\S+):", line)
        if m:
            fn = m.group(1)
            continue
        if line.lstrip().startswith("//## File"):
            if not in_group:
                group, in_group = [], True
            group += [int(n) for f, n in re.findall(r'"([^"]+)", line (\d+)', line) if f.endswith(name)]
            continue
        if not re.match(r"\s*/\*[0-9a-f]{4,}\*/", line):
            continue
        in_group = False
        if "sweep64_kernel" not in fn or PROFILING not in fn:
            continue
        if "SR_CLOCKLO" in line:
            seg += 1
        key = PHASES[seg] if 0 <= seg < len(PHASES) else ("before the phases" if seg < 0 else "after the phases")
        total[key] += 16
        if not (any(a <= n <= b for n in group for a, b in ranges) or any(n in marked for n in group)):
            hot[key] += 16
            if re.search(r"\b(LDL|STL)\b", line):
                spills[key] += 1
            if key == args.lines and group:
                by_line[group[0]] += 16
    print(f"{'phase':20s} {'all (KB)':>9s} {'hot (KB)':>9s} {'hot LDL/STL':>12s}")
    for key in ["before the phases"] + PHASES + ["after the phases"]:
        if total[key]:
            print(f"{key:20s} {total[key] / 1024:9.1f} {hot[key] / 1024:9.1f} {spills[key]:12d}")
    all_kb, hot_kb = sum(total.values()) / 1024, sum(hot.values()) / 1024
    print(f"{'kernel':20s} {all_kb:9.1f} {hot_kb:9.1f} {sum(spills.values()):12d}")
    if args.lines:
        print(f"\n{args.lines}: hot bytes per source line")
        for n, b in by_line.most_common(25):
            print(f"{b:7d}  {n:5d}  {src[n - 1].strip()[:100]}")


if __name__ == "__main__":
    main()
