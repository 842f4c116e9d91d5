#!/usr/bin/env bash
# The whole GPU tier in about 3 minutes on the GPU machine: build for sm_90a, then every file of tests/gpu
# and the GPU cases of the CPU-tier files, one pytest process per file, all at once on the one GPU (16
# cores). Each test has its own timeout, so a hang is named; failures are listed by name (-rfE). fla's
# Triton kernels (tests/gpu/test_fla_cuda.py, 4 xdist workers) compile and autotune for minutes in a
# fresh process: carry a Triton cache (below) and they take ~2 minutes.
#
#   OUT=/some/dir bash scripts/device_tier.sh
#   SKIP_BUILD=1 FILES="tests/gpu/test_recurrent_cuda.py" bash scripts/device_tier.sh
#   SANITIZE=1 bash scripts/device_tier.sh         # also memcheck + synccheck (scripts/sanitize.sh) alongside
#
# Triton cache: set TRITON_CACHE_OUT=1 once; the run leaves $OUT/triton_cache.tgz.part* (15 MB pieces). Put
# them in .triton_cache_parts/ (git-ignored) and carry that folder: they are unpacked before the tests.
# Carry .whl/ (nvidia-cutlass for the build, fla-core for the fla tests) and .golden/ (golden cases).
# Success: every "### <file>" line ends in "passed" with rc=0, and no FAILED/ERROR lines follow.
set -uo pipefail
source "$(dirname "$0")/_device_env.sh"  # repository root, OUT, build env, .golden/, kda_install_wheels
LOGS=${LOGS:-/tmp/kda_tier}
rm -rf "$LOGS"; mkdir -p "$LOGS"
LIMIT=${LIMIT:-300}  # seconds per file
T0=$(date +%s)
kda_install_wheels
export OMP_NUM_THREADS=${OMP_NUM_THREADS:-2} TRITON_CACHE_DIR=${TRITON_CACHE_DIR:-/tmp/kda_triton_cache}
mkdir -p "$TRITON_CACHE_DIR"
if compgen -G ".triton_cache_parts/*" >/dev/null; then
  cat .triton_cache_parts/* | tar -xzf - -C "$TRITON_CACHE_DIR" || echo "warning: the Triton cache did not unpack"
fi
if [ "${SKIP_BUILD:-0}" != 1 ]; then
  timeout 300 python3 setup.py -q build_ext --inplace >"$LOGS/build.log" 2>&1
  rc=$?
  echo "== build rc=$rc at $(( $(date +%s) - T0 )) s"
  [ $rc != 0 ] && { tail -30 "$LOGS/build.log"; exit $rc; }
fi
PYTEST=(python3 -m pytest -rfE -p no:cacheprovider --timeout=200 --durations=8 -o addopts=)
run_file() {  # run_file NAME ARGS...: one pytest process, its log and exit status in $LOGS/NAME.log
  local name=$1; shift
  (timeout "$LIMIT" "${PYTEST[@]}" "$@" >"$LOGS/$name.log" 2>&1; echo "rc=$?" >>"$LOGS/$name.log") &
}
for f in ${FILES:-tests/gpu/test_*.py}; do
  n=$(basename "$f" .py)
  if [ "$n" = test_fla_cuda ]; then run_file "$n" -n 4 "$f"; else run_file "$n" "$f"; fi
done
[ -z "${FILES:-}" ] && run_file cpu_tier_files_gpu_cases -m gpu tests/test_*.py
if [ "${SANITIZE:-0}" = 1 ]; then
  (SANITIZE_LOG_DIR=$LOGS/sanitize TOOLS="memcheck synccheck" SANITIZE_TIMEOUT=110 timeout 240 \
     bash scripts/sanitize.sh >"$LOGS/sanitize.txt" 2>&1; echo "rc=$?" >>"$LOGS/sanitize.txt") &
fi
wait
echo "== tests done at $(( $(date +%s) - T0 )) s"
status=0
for f in "$LOGS"/*.log; do
  [ "$(basename "$f")" = build.log ] && continue
  last=$(tail -1 "$f"); summary=$(grep -E '^=+ .*(passed|failed|error).* =+$' "$f" | tail -1)
  echo "### $(basename "$f" .log): $last | $summary"
  [ "$last" != rc=0 ] && status=1
done
grep -h "^FAILED\|^ERROR" "$LOGS"/*.log | cut -c1-300 | head -40
[ -f "$LOGS/sanitize.txt" ] && tail -6 "$LOGS/sanitize.txt"
if [ "${TRITON_CACHE_OUT:-0}" = 1 ]; then
  tar -czf - -C "$TRITON_CACHE_DIR" . | split -b 15m - "$OUT/triton_cache.tgz.part"
fi
tar -czf "$OUT/tier_logs.tgz" -C "$LOGS" .
exit $status
