#!/usr/bin/env bash
# The Hopper chunked kernel on the GPU machine: build for sm_90a, the smoke (scripts/sm90_smoke.py: smallest
# cases first, per-case errors of both kernels against the fp64 reference, a diagnosis of the first failing
# case; a hang means a pipeline deadlock and stops it) of each design in VARIANTS (default "3 2": the newest
# first), compute-sanitizer memcheck of the first failing case, the tests of tests/gpu/test_chunked_sm90.py
# on each design whose smoke passed, and a timing table of those designs vs the mma.sync kernel
# (scripts/sm90_bench.py, with the profile tables). Logs into $OUT. Measured 2026-12-02: build ~50 s, each
# smoke ~60 s, tests ~40 s a design, the shared tests ~25 s, the bench ~60 s.
#
#   OUT=/tmp/out bash scripts/device_sm90.sh               # build smoke tests bench
#   VARIANTS=2 STAGES="smoke tests" bash scripts/device_sm90.sh
#
# Success: smoke_vN.log ends with "smoke: OK" (every case "OK ... ran=True"); tests_vN.log and tests_shared.log
# with "N passed" and no failures; bench.log has the table (ms per call, "sm90 ran" True) and one profile table
# per design ("kda_chunked_sm90 profile, variant V": cycles per chunk per segment of each role in CTA 0).
# On failure: the smoke log's "FAIL"/"ERROR" line and the diagnosis after it, the "kda_chunked_sm90:" lines
# (tensor-map encode results, grid, launch error), smoke_memcheck.log; "HUNG in:" names a deadlocked call.
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

VARIANTS=${VARIANTS:-3 2}
GOOD=""  # the designs whose smoke passed (all of VARIANTS when the smoke stage is skipped)
for s in $STAGES; do
  case $s in
    build)
      KDA_PTXAS_VERBOSE=1 run build 240 python3 setup.py -q build_ext --inplace || exit 1
      # ptxas of the instantiations (<profile, variant, backward>): the Function properties line names each
      grep -E "kda_chunked_sm90_kernel|C7517" -A2 "$OUT/build.log" | grep -E "Function properties|injected|spill|registers" \
        | sed 's/.*kda_chunked_sm90_kernelI/kernel</' | head -24 ;;
    smoke)
      for v in $VARIANTS; do
        rm -f "$OUT/smoke_first_fail"
        TAIL=30 KDA_SM90_VARIANT=$v SMOKE_FIRST_FAIL="$OUT/smoke_first_fail" run smoke_v$v 90 python3 scripts/sm90_smoke.py
        rc=$?
        if [ "$rc" = 0 ]; then
          GOOD="$GOOD $v"
        elif [ "$rc" = 124 ] || [ "$rc" = 137 ]; then
          echo "== smoke_v$v: HUNG in: $(grep -E 'calling (sm90|mma)' "$OUT/smoke_v$v.log" | tail -1)"
          nvidia-smi --query-gpu=utilization.gpu,memory.used --format=csv >"$OUT/smoke_hang_smi.log" 2>&1
        elif [ -s "$OUT/smoke_first_fail" ]; then
          KDA_SM90_VARIANT=$v run smoke_memcheck 90 "$SAN" --tool memcheck --print-limit 20 python3 scripts/sm90_smoke.py \
            --only "$(head -1 "$OUT/smoke_first_fail")"
        fi
      done
      echo "== smoke passed for variants:${GOOD:- none}" ;;
    tests)  # this path's own tests on each design, then the shared chunked and training tests re-run on it
      [ -z "$GOOD" ] && [[ " $STAGES " != *" smoke "* ]] && GOOD=$VARIANTS
      XD=$(python3 -c "import xdist" 2>/dev/null && echo "-n 8")
      # 8 workers on 16 cores: 2 threads each for the fp64 CPU references (torch's default, one per core,
      # oversubscribes the machine 8-fold)
      export OMP_NUM_THREADS=${OMP_NUM_THREADS:-2}
      # (--timeout names a hanging test; pytest-timeout is installed on the GPU machine)
      for v in $GOOD; do
        KDA_SM90_VARIANT=$v run tests_v$v 150 python3 -m pytest -q -rfE --timeout=100 --timeout-method=thread \
          --durations=10 --maxfail=5 -p no:cacheprovider $XD -k "hopper or backward_chain or auto" tests/gpu/test_chunked_sm90.py
      done
      run tests_shared 240 python3 -m pytest -q -rfE --timeout=150 --timeout-method=thread --durations=10 --maxfail=10 \
        -p no:cacheprovider $XD -k "not hopper and not backward_chain and not auto" tests/gpu/test_chunked_sm90.py ;;
    bench)
      [ -z "$GOOD" ] && [[ " $STAGES " != *" smoke "* ]] && GOOD=$VARIANTS
      if [ -z "$GOOD" ]; then echo "== bench: skipped (no design passed its smoke)"; continue; fi
      TAIL=60 SM90_BENCH_VARIANTS=$(echo $GOOD | tr ' ' ',') run bench 150 python3 scripts/sm90_bench.py ;;
    *) echo "unknown stage $s" ;;
  esac
done
