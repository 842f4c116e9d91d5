#!/usr/bin/env bash
# The Hopper chunked prefill kernel on the GPU machine: build for sm_90a, the smoke (scripts/sm90_smoke.py:
# smallest cases first, per-case errors of both kernels against the fp64 reference, a diagnosis of the first
# failing case; a hang means a pipeline deadlock and stops it), compute-sanitizer memcheck of the first failing
# case alone, the tests of tests/gpu/test_chunked_sm90.py, and a timing table Hopper vs mma.sync kernel
# (scripts/sm90_bench.py, both kernel variants and the profile tables). Logs into $OUT. Build + smoke + tests
# take up to ~9 minutes (the device's limit per command is 10): run the bench in a call of its own.
#
#   OUT=/tmp/out bash scripts/device_sm90.sh          # build smoke tests bench
#   STAGES="smoke tests" bash scripts/device_sm90.sh  # a subset (after a build)
#
# Success: smoke.log (the default variant 2) and smoke_v2.log (KDA_SM90_VARIANT=2, first: a hang there skips the rest of v2) end with "smoke: OK" (every
# case "OK ... ran=True"), tests.log, tests_v1.log (KDA_SM90_VARIANT=1) and tests_shared.log with "N passed" and no failures,
# bench.log has the table (sm90 v1 / v2 vs mma ms per call, "sm90 ran" True) and the two profile tables
# ("kda_chunked_sm90 profile, variant V": cycles per chunk per segment of each role in CTA 0).
# On failure: smoke.log's "FAIL"/"ERROR" line and the diagnosis block after it, the "kda_chunked_sm90:" lines
# (tensor-map encode results, grid, launch error), smoke_memcheck.log.
set -uo pipefail
source "$(dirname "$0")/_device_env.sh"  # repository root, OUT, build env, .golden/, kda_install_wheels
STAGES=${STAGES:-build smoke tests bench}
# the carried wheels in .whl/ (the pinned nvidia-cutlass headers)
kda_install_wheels
# the in-place extension of this checkout first (the scripts also put the repository root on sys.path)
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH}
SAN=${CUDA_HOME}/bin/compute-sanitizer
command -v compute-sanitizer >/dev/null && SAN=compute-sanitizer

run() {  # run NAME TIMEOUT CMD...
  local name=$1 to=$2; shift 2
  local t0=$(date +%s)
  echo "== $name: $*"
  timeout "$to" "$@" >"$OUT/$name.log" 2>&1
  local rc=$?
  tail -n "${TAIL:-40}" "$OUT/$name.log"
  echo "== $name: rc=$rc in $(( $(date +%s) - t0 )) s"
  return $rc
}

for s in $STAGES; do
  case $s in
    build)
      KDA_PTXAS_VERBOSE=1 run build 240 python3 setup.py -q build_ext --inplace || exit 1
      # ptxas of the four instantiations (<profile, variant>): the Function properties line names each
      grep -E "kda_chunked_sm90_kernel|C7517" -A2 "$OUT/build.log" | grep -E "Function properties|injected|spill|registers" \
        | sed 's/.*kda_chunked_sm90_kernelI/kernel</' | head -16 ;;
    smoke)
      # the two-prep-warpgroup design (KDA_SM90_VARIANT=2, the default) alone first, then the default run
      TAIL=30 KDA_SM90_VARIANT=2 run smoke_v2 60 python3 scripts/sm90_smoke.py
      V2_RC=$?
      if [ "$V2_RC" = 124 ] || [ "$V2_RC" = 137 ]; then  # a hung variant 2: the rest on variant 1
        echo "== smoke_v2: HUNG in: $(grep -E 'calling (sm90|mma)' "$OUT/smoke_v2.log" | tail -1)"
        export KDA_SM90_VARIANT=1 SM90_BENCH_VARIANTS=1 SKIP_V1=1  # the rest on variant 1 only
      fi
      rm -f "$OUT/smoke_first_fail"
      TAIL=100 SMOKE_FIRST_FAIL="$OUT/smoke_first_fail" run smoke 90 python3 scripts/sm90_smoke.py
      SMOKE_RC=$?
      if [ "$SMOKE_RC" = 124 ] || [ "$SMOKE_RC" = 137 ]; then
        echo "== smoke: HUNG in: $(grep -E 'calling (sm90|mma)' "$OUT/smoke.log" | tail -1)"
        nvidia-smi --query-gpu=utilization.gpu,memory.used --format=csv >"$OUT/smoke_hang_smi.log" 2>&1
      elif [ "$SMOKE_RC" != 0 ] && [ -s "$OUT/smoke_first_fail" ]; then
        FAIL_CASE=$(head -1 "$OUT/smoke_first_fail")
        run smoke_memcheck 90 "$SAN" --tool memcheck --print-limit 20 python3 scripts/sm90_smoke.py --only "$FAIL_CASE"
      fi ;;
    tests|bench) if [ "${SMOKE_RC:-0}" = 124 ] || [ "${SMOKE_RC:-0}" = 137 ]; then
        echo "== $s: skipped (the smoke call hung)"; continue; fi ;;&
    tests)  # this path's own tests first (both variants), then the shared chunked and training tests re-run on it
      XD=$(python3 -c "import xdist" 2>/dev/null && echo "-n 8")
      # 8 workers on 16 cores: 2 threads each for the fp64 CPU references (torch's default, one per core,
      # oversubscribes the machine 8-fold)
      export OMP_NUM_THREADS=${OMP_NUM_THREADS:-2}
      # (--timeout names a hanging test; pytest-timeout is installed on the GPU machine)
      run tests 150 python3 -m pytest -q -rfE --timeout=100 --durations=10 --maxfail=5 -p no:cacheprovider $XD -k hopper \
        tests/gpu/test_chunked_sm90.py
      [ "${SKIP_V1:-0}" = 1 ] || KDA_SM90_VARIANT=1 run tests_v1 200 python3 -m pytest -q -rfE --timeout=100 \
        --durations=10 --maxfail=10 -p no:cacheprovider $XD -k "hopper or backward_chain or training or auto" \
        tests/gpu/test_chunked_sm90.py
      run tests_shared 240 python3 -m pytest -q -rfE --timeout=150 --durations=10 --maxfail=10 -p no:cacheprovider \
        $XD -k "not hopper" tests/gpu/test_chunked_sm90.py ;;
    bench) TAIL=60 run bench 90 python3 scripts/sm90_bench.py ;;
    *) echo "unknown stage $s" ;;
  esac
done
