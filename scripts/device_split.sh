#!/usr/bin/env bash
# GPU check of the exact sequence split and of context parallelism: build for sm_90a, run the GPU split
# tests (tests/gpu/test_split_cuda.py) and the distributed tests (gloo, 2 and 4 processes; the CUDA case
# shares the one GPU between 4 processes), then benchmarks/bench_split.py. Logs and tables go to $OUT
# (6 files: gpu.txt, build.log, tests.log, bench.log, bench_split.md with every table and
# bench_split_json.tgz). The whole run stays within ~5 minutes on an H200 machine with 16 cores.
#
#   OUT=/some/dir bash scripts/device_split.sh
#   STAGES="tests bench" bash scripts/device_split.sh     # skip the build (an in-place build exists)
#
# Success: build.log ends with rc=0; tests.log's last line says "N passed" with no "failed";
# bench_split.md has "unsplit / split" > 1 on the few-head long cases (H=8, H=4 T=65536) and
# "split vs unsplit" (relative RMS of the outputs) below 5e-3 everywhere.
set -uo pipefail
source "$(dirname "$0")/_device_env.sh"  # repository root, OUT, build env, .golden/, kda_install_wheels
STAGES=${STAGES:-"build tests bench"}
RESULTS=${RESULTS:-/tmp/kda_split_results}  # tables of every benchmark; $OUT gets them as one .md + a .tgz
mkdir -p "$RESULTS"
nvidia-smi --query-gpu=name,driver_version,clocks.max.sm --format=csv,noheader >"$OUT/gpu.txt" 2>&1

stage() {  # stage NAME SECONDS CMD...: run under timeout, log to $OUT/NAME.log
  local name=$1 limit=$2; shift 2
  local t0
  t0=$(date +%s)
  echo "== $name: $*" | tee "$OUT/$name.log"
  timeout "$limit" "$@" 2>&1 | tee -a "$OUT/$name.log"
  local rc=${PIPESTATUS[0]}
  echo "== $name: rc=$rc in $(( $(date +%s) - t0 )) s" | tee -a "$OUT/$name.log"
  return "$rc"
}

for s in $STAGES; do
  case $s in
    build) stage build 200 python3 setup.py -q build_ext --inplace || exit 1 ;;
    tests) stage tests 170 python3 -m pytest -q -p no:cacheprovider tests/gpu/test_split_cuda.py \
             tests/test_split.py tests/test_distributed.py ;;
    bench) stage bench 200 python3 benchmarks/bench_split.py --out "$RESULTS" ${BENCH_ARGS:-}
           cat "$RESULTS"/bench_split*.md >"$OUT/bench_split.md" 2>/dev/null
           tar -czf "$OUT/bench_split_json.tgz" -C "$RESULTS" . 2>/dev/null ;;
    *) echo "unknown stage $s" ;;
  esac
done
ls -la "$OUT"
