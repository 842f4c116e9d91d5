#!/usr/bin/env bash
# The one command for the GPU machine: build for sm_90a with 16 jobs, run the test
# suite (GPU tier + CPU tier), run the benchmarks, and leave logs + a JSON summary under $OUT.
#
#   bash scripts/device_check.sh            # everything
#   bash scripts/device_check.sh --quick    # build + GPU tests only
#   STAGES="build tests bench_decode" bash scripts/device_check.sh
#
# The machine has no package registry: wheels in .whl/ (nvidia-cutlass, fla-core,
# flash-linear-attention; see docs/development.md, "Peers on the GPU machine") are installed with --no-index first.
set -uo pipefail
source "$(dirname "$0")/_device_env.sh"  # repository root, OUT, build env, .golden/, kda_install_wheels
STAGE_TIMEOUT=${STAGE_TIMEOUT:-420}  # seconds per stage; the device allows 600 per command
QUICK=0
[ "${1:-}" = "--quick" ] && QUICK=1
STAGES=${STAGES:-$([ $QUICK = 1 ] && echo "build tests_gpu" || echo "build tests demo sanitize ncu ncu_chunked bench_decode bench_prefill bench_train")}
# Benchmark tables/plots go to $RESULTS and come back as one archive ($OUT returns at most 8 files).
export RESULTS=${RESULTS:-/tmp/kda_results}
mkdir -p "$RESULTS"
SUMMARY="$OUT/summary.json"
declare -A SECS RC

kda_install_wheels
# Triton's compile + autotune cache (fla's chunk_kda kernels compile and autotune for minutes in a fresh
# process). TRITON_CACHE_OUT=1 returns it compressed, split into parts under the GPU machine's 16 MiB file
# limit ($OUT/triton_cache.tgz.part00, part01, ...: ~29 MB after fla's first training case).
# Next time put those parts in .triton_cache_parts/ (git-ignored) and carry it: they are unpacked into
# $TRITON_CACHE_DIR before the stages. A carried .triton_cache/ (unpacked) is used in place too.
export TRITON_CACHE_DIR=${TRITON_CACHE_DIR:-$PWD/.triton_cache}
mkdir -p "$TRITON_CACHE_DIR"
if compgen -G ".triton_cache_parts/triton_cache.tgz.part*" >/dev/null; then
  cat .triton_cache_parts/triton_cache.tgz.part* | tar -xzf - -C "$TRITON_CACHE_DIR" ||
    echo "warning: .triton_cache_parts did not unpack; Triton starts from an empty cache"
fi
nvidia-smi --query-gpu=name,driver_version,clocks.max.sm --format=csv,noheader >"$OUT/gpu.txt" 2>&1

# ncu_source REGEX SKIP NAME CASE: profile one launch of the kernels matching REGEX in scripts/ncu_profile.py
# CASE (after SKIP launches), print the details page and write the source-level CSV to $RESULTS/NAME_source.csv.
ncu_source() {
  ncu --kernel-name "regex:$1" --launch-skip "$2" --launch-count 1 \
      --section SpeedOfLight --section Occupancy --section LaunchStats --section WarpStateStats \
      --section SchedulerStats --section SourceCounters --section InstructionStats --import-source yes \
      -f -o "/tmp/$3" python3 scripts/ncu_profile.py "$4" >/dev/null &&
    ncu -i "/tmp/$3.ncu-rep" --page details &&
    ncu -i "/tmp/$3.ncu-rep" --page source --csv --print-source cuda,sass >"$RESULTS/$3_source.csv"
}
export -f ncu_source  # stage runs its command under timeout, in a child bash

stage() {  # stage NAME CMD...: run, time, log to $OUT/NAME.log
  local name=$1; shift
  local t0=$(date +%s)
  echo "== $name: $*"
  timeout "$STAGE_TIMEOUT" "$@" 2>&1 | tee "$OUT/$name.log"
  RC[$name]=${PIPESTATUS[0]}
  SECS[$name]=$(( $(date +%s) - t0 ))
  echo "== $name: rc=${RC[$name]} in ${SECS[$name]} s"
}

for s in $STAGES; do
  case $s in
    build) stage build python3 setup.py -q build_ext --inplace ;;
    tests) stage tests python3 -m pytest -q -p no:cacheprovider tests ;;
    tests_gpu) stage tests_gpu python3 -m pytest -q -p no:cacheprovider -m gpu tests ;;
    tests_sel) stage tests_sel python3 -m pytest -q -p no:cacheprovider ${PYTEST_ARGS:-tests/gpu} ;;
    chunked_debug) stage chunked_debug python3 scripts/chunked_debug.py ;;
    sanitize) stage sanitize bash scripts/sanitize.sh ;;  # compute-sanitizer, 4 tools (full run only)
    bench_*) stage "$s" python3 "benchmarks/$s.py" --out "$RESULTS" ${BENCH_ARGS:-} ;;
    demo) stage demo python3 -m kda_ops.demo ;;
    api_profile) stage api_profile python3 scripts/api_profile.py ;;  # where an end-to-end prefill call spends time
    train_profile) stage train_profile python3 scripts/train_profile.py ;;  # kernels of one training backward
    racecheck_probe) stage racecheck_probe bash -c 'nvcc -arch=sm_90a -o /tmp/racecheck_probe scripts/racecheck_probe.cu &&
           /tmp/racecheck_probe && compute-sanitizer --tool racecheck /tmp/racecheck_probe' ;;
    ncu_chunked) stage ncu_chunked bash -c 'ncu_source "$@"' _ kda_chunked 2 ncu_chunked "${NCU_CASE:-prefill_96_8192}" ;;
    ncu_train) stage ncu_train bash -c 'ncu_source "$@"' _ kda_training_backward_chunked 1 ncu_train \
                 "${NCU_TRAIN_CASE:-train_32_2048}" ;;
    ncu) stage ncu ncu --kernel-name regex:kda_recurrent --launch-skip 3 --launch-count 1 \
           --section SpeedOfLight --section MemoryWorkloadAnalysis --section Occupancy --section LaunchStats \
           --section WarpStateStats --section SchedulerStats python3 scripts/ncu_profile.py decode_bf16 ;;
    *) echo "unknown stage $s"; RC[$s]=2; SECS[$s]=0 ;;
  esac
  [ "$s" = build ] && [ "${RC[build]}" != 0 ] && break
done

# The GPU machine returns at most 8 files from $OUT: every stage log also goes into the archive.
mkdir -p "$RESULTS/logs" && cp "$OUT"/*.log "$RESULTS/logs/" 2>/dev/null
tar -czf "$OUT/results.tar.gz" -C "$RESULTS" . 2>/dev/null
if [ "${TRITON_CACHE_OUT:-0}" = 1 ]; then
  tar -czf - -C "$TRITON_CACHE_DIR" . 2>/dev/null | split -b 15M -d - "$OUT/triton_cache.tgz.part"
fi
# One log for all benchmarks keeps the returned file count low.
for s in $STAGES; do case $s in bench_*) [ -f "$OUT/$s.log" ] && { echo "== $s"; cat "$OUT/$s.log"; rm "$OUT/$s.log"; };; esac; done >"$OUT/bench.log"
python3 - "$SUMMARY" "$STAGES" <<PY
import json, re, sys, os
out, stages = sys.argv[1], sys.argv[2].split()
res = {"gpu": open(os.path.join(os.path.dirname(out), "gpu.txt")).read().strip()}
secs = {$(for s in "${!SECS[@]}"; do printf '"%s": %s, ' "$s" "${SECS[$s]}"; done)}
rcs = {$(for s in "${!RC[@]}"; do printf '"%s": %s, ' "$s" "${RC[$s]}"; done)}
for s in stages:
    entry = {"seconds": secs.get(s), "rc": rcs.get(s)}
    log = os.path.join(os.path.dirname(out), s + ".log")
    if s.startswith("tests") and os.path.exists(log):
        tail = [l for l in open(log).read().splitlines() if re.search(r"\d+ (passed|failed|error)", l)]
        entry["pytest"] = tail[-1] if tail else None
    res[s] = entry
json.dump(res, open(out, "w"), indent=1)
print(json.dumps(res, indent=1))
PY
exit $(( ${RC[build]:-0} ))
