#!/usr/bin/env bash
# The CUDA training ops on the GPU machine: build for sm_90a, then tests/gpu/test_training_cuda.py (every mode of
# the training forward / backward against the fp64 reference and the CPU op, plus the existing training tests),
# each step under timeout. Logs into $OUT; the whole < 5 min after a warm build cache (the build is most of it).
#
#   OUT=/tmp/out bash scripts/device_train.sh            # build + tests
#   STAGES=tests bash scripts/device_train.sh            # tests only (after a build)
#
# Success: build.log ends without errors, tests.log ends with "N passed" (xfail/xpass allowed) and no
# "failed"; modes.log holds one line of relative-RMS / max-abs errors per mode case (KDA_TRAIN_REPORT).
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-$PWD/device_out}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 CUDA_HOME=${CUDA_HOME:-/usr/local/cuda}
export KDA_CUDA_ARCHS=${KDA_CUDA_ARCHS:-90a} MAX_JOBS=${MAX_JOBS:-16}
[ -d .golden ] && export KDA_GOLDEN_DIR=${KDA_GOLDEN_DIR:-$PWD/.golden}
STAGES=${STAGES:-build tests}
# No package registry there: the carried wheels in .whl/ (the pinned nvidia-cutlass headers), as device_check.sh
if compgen -G ".whl/*.whl" >/dev/null; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
    && export PYTHONPATH=/tmp/site:${PYTHONPATH:-}
fi

run() {  # run NAME TIMEOUT_S CMD...: CMD under timeout, its output in $OUT/NAME.log; returns its status
  local name=$1 to=$2
  shift 2
  echo "== $name (timeout ${to}s): $*"
  timeout "$to" "$@" >"$OUT/$name.log" 2>&1
  local rc=$?
  echo "== $name: rc=$rc"; tail -n 3 "$OUT/$name.log"
  return $rc
}

for stage in $STAGES; do
  case $stage in
    build)
      run build 300 python3 setup.py -q build_ext --inplace || exit 1 ;;
    tests)
      rm -f "$OUT/modes.log"
      KDA_TRAIN_REPORT="$OUT/modes.log" run tests 270 python3 -m pytest -q -rfE --maxfail=20 -p no:cacheprovider \
        tests/gpu/test_training_cuda.py ;;
    *) echo "unknown stage $stage"; exit 2 ;;
  esac
done
