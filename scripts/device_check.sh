#!/usr/bin/env bash
# The GPU check of a checkout, on any machine with a CUDA GPU (`make device-check`):
#
#   bash scripts/device_check.sh                  # build tests bench sanitize
#   bash scripts/device_check.sh build tests      # some stages, in this order (or STAGES="build tests")
#   FILES="tests/gpu/test_recurrent_cuda.py" bash scripts/device_check.sh tests
#
# Stages:
#   build     python setup.py build_ext --inplace; KDA_CUDA_ARCHS=auto (setup.py) compiles for the visible GPU.
#             A failed build stops the run.
#   tests     the GPU tier: one pytest process per file of tests/gpu, plus one for the GPU cases of the CPU-tier
#             files (-m gpu), PARALLEL processes at a time sharing the one GPU. Each test runs under TEST_TIMEOUT
#             seconds (pytest-timeout, when installed: a hang is named) and each file under FILE_TIMEOUT; the
#             failed tests are listed by name at the end and in the summary.
#   bench     benchmarks/bench_{decode,prefill,train}.py $BENCH_ARGS (default --quick), tables under $OUT/bench.
#   sanitize  scripts/sanitize.sh: compute-sanitizer memcheck, racecheck, synccheck, initcheck over every CUDA op.
#
# Output in ${OUT:-./device-results}: <stage>.log, tests/<file>.log, bench/, sanitize/, and summary.json
# ({"gpu", "stages": {stage: {"rc", "seconds"}}, "tests": {file: {"rc", "summary"}}, "failed": [test ids]}).
# Exit status 0 only when every stage run passed.
#
# Settings (environment): PY (python3), STAGES, FILES, PARALLEL (half the CPU cores), TEST_TIMEOUT (200),
# FILE_TIMEOUT (600), STAGE_TIMEOUT (3600, for build, bench and sanitize), BENCH_ARGS (--quick), MAX_JOBS (all
# cores), OMP_NUM_THREADS (2 per pytest process: the fp64 CPU references of parallel processes would otherwise
# oversubscribe the cores), TRITON_CACHE_DIR (default .triton_cache/ in the checkout, git-ignored: fla's Triton
# kernels compile and autotune for minutes in a fresh process, once per machine with a kept cache).
set -uo pipefail
cd "$(dirname "$0")/.."
PY=${PY:-python3}
OUT=${OUT:-$PWD/device-results}
OUT=$(mkdir -p "$OUT" && cd "$OUT" && pwd)
STAGES=${STAGES:-${*:-build tests bench sanitize}}
NPROC=$(nproc 2>/dev/null || echo 4)
PARALLEL=${PARALLEL:-$(( NPROC / 2 > 0 ? NPROC / 2 : 1 ))}
TEST_TIMEOUT=${TEST_TIMEOUT:-200}
FILE_TIMEOUT=${FILE_TIMEOUT:-600}
STAGE_TIMEOUT=${STAGE_TIMEOUT:-3600}
BENCH_ARGS=${BENCH_ARGS:---quick}
export PYTHONUNBUFFERED=1 CUDA_HOME=${CUDA_HOME:-/usr/local/cuda} MAX_JOBS=${MAX_JOBS:-$NPROC}
export OMP_NUM_THREADS=${OMP_NUM_THREADS:-2}
export TRITON_CACHE_DIR=${TRITON_CACHE_DIR:-$PWD/.triton_cache}
mkdir -p "$TRITON_CACHE_DIR"
RESULTS=$OUT/stages.tsv  # stage, rc, seconds: read by the summary
: >"$RESULTS"
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader >"$OUT/gpu.txt" 2>&1 ||
  echo "warning: nvidia-smi failed (no GPU visible?)"

stage() {  # stage NAME CMD...: run, log to $OUT/NAME.log (and here, but for the build), record rc and seconds.
  # A command under STAGE_TIMEOUT; a function of this script (tests, bench) keeps its own timeouts.
  local name=$1 t0 rc; shift
  t0=$(date +%s)
  echo "== $name: $*"
  local run=(timeout "$STAGE_TIMEOUT" "$@")
  declare -F "$1" >/dev/null && run=("$@")
  if [ "$name" = build ]; then
    "${run[@]}" >"$OUT/$name.log" 2>&1
    rc=$?
    [ $rc != 0 ] && tail -n 30 "$OUT/$name.log"
  else
    "${run[@]}" 2>&1 | tee "$OUT/$name.log"
    rc=${PIPESTATUS[0]}
  fi
  printf '%s\t%s\t%s\n' "$name" "$rc" "$(( $(date +%s) - t0 ))" >>"$RESULTS"
  echo "== $name: rc=$rc in $(( $(date +%s) - t0 )) s"
  return "$rc"
}

gpu_tier() {  # one pytest process per file, PARALLEL at a time; rc 1 when any file failed
  local logs=$OUT/tests pytest status=0 f n
  rm -rf "$logs"; mkdir -p "$logs"
  pytest=("$PY" -m pytest -q -rfE -p no:cacheprovider -o addopts= --durations=5)
  if "$PY" -c "import pytest_timeout" 2>/dev/null; then
    pytest+=(--timeout="$TEST_TIMEOUT" --timeout-method=thread)
  else
    echo "note: pytest-timeout not installed: no per-test timeout, only FILE_TIMEOUT=$FILE_TIMEOUT s per file"
  fi
  # shellcheck disable=SC2206
  [ -n "${PYTEST_ARGS:-}" ] && pytest+=($PYTEST_ARGS)
  run_file() {  # run_file NAME ARGS...: its log and exit status in $logs/NAME.log
    local name=$1; shift
    timeout "$FILE_TIMEOUT" "${pytest[@]}" "$@" >"$logs/$name.log" 2>&1
    echo "rc=$?" >>"$logs/$name.log"
  }
  for f in ${FILES:-tests/gpu/test_*.py}; do
    while [ "$(jobs -rp | wc -l)" -ge "$PARALLEL" ]; do wait -n; done
    n=$(basename "$f" .py)
    run_file "$n" "$f" &
  done
  if [ -z "${FILES:-}" ]; then
    while [ "$(jobs -rp | wc -l)" -ge "$PARALLEL" ]; do wait -n; done
    run_file cpu_tier_gpu_cases -m gpu tests/test_*.py &
  fi
  wait
  for f in "$logs"/*.log; do
    n=$(basename "$f" .log)
    last=$(tail -n 1 "$f")
    summary=$(grep -E '(passed|failed|error|skipped|no tests ran)' "$f" | grep -vE '^(FAILED|ERROR) ' | tail -n 1)
    echo "### $n: $last | $summary"
    # rc=5: no test collected (a file whose cases all need another GPU is fine)
    [ "$last" != rc=0 ] && [ "$last" != rc=5 ] && status=1
  done
  grep -h -E "^(FAILED|ERROR) " "$logs"/*.log | cut -c1-300 | head -n 60
  return $status
}

bench() {
  local b rc=0
  for b in decode prefill train; do
    # shellcheck disable=SC2086
    timeout "$STAGE_TIMEOUT" "$PY" "benchmarks/bench_$b.py" --out "$OUT/bench" $BENCH_ARGS || rc=1
  done
  return $rc
}

status=0
for s in $STAGES; do
  case $s in
    build)
      if command -v flock >/dev/null; then
        stage build flock "${BUILD_LOCK:-/tmp/kda_ops_build.lock}" "$PY" setup.py -q build_ext --inplace
      else
        stage build "$PY" setup.py -q build_ext --inplace
      fi || { status=1; echo "== build failed: the remaining stages are skipped"; break; } ;;
    tests) stage tests gpu_tier || status=1 ;;
    bench) stage bench bench || status=1 ;;
    sanitize) stage sanitize env PY="$PY" SANITIZE_LOG_DIR="$OUT/sanitize" bash scripts/sanitize.sh || status=1 ;;
    *) echo "unknown stage $s (build tests bench sanitize)"; printf '%s\t2\t0\n' "$s" >>"$RESULTS"; status=1 ;;
  esac
done

"$PY" - "$OUT" <<'PY'
import glob, json, os, re, sys

out = sys.argv[1]
res = {"gpu": open(os.path.join(out, "gpu.txt")).read().strip(), "stages": {}, "tests": {}, "failed": []}
for line in open(os.path.join(out, "stages.tsv")).read().splitlines():
    name, rc, secs = line.split("\t")
    res["stages"][name] = {"rc": int(rc), "seconds": int(secs)}
for log in sorted(glob.glob(os.path.join(out, "tests", "*.log"))):
    lines = open(log, errors="replace").read().splitlines()
    rc = int(lines[-1][3:]) if lines and lines[-1].startswith("rc=") else None
    counts = [ln.strip("= ") for ln in lines if re.search(r"\d+ (passed|failed|error|skipped)|no tests ran", ln)
              and not ln.startswith(("FAILED", "ERROR"))]
    res["tests"][os.path.basename(log)[:-4]] = {"rc": rc, "summary": counts[-1] if counts else None}
    res["failed"] += [ln.split(" - ")[0] for ln in lines if ln.startswith(("FAILED ", "ERROR "))]
json.dump(res, open(os.path.join(out, "summary.json"), "w"), indent=1)
print(json.dumps(res, indent=1))
PY
echo "== device check: $([ $status = 0 ] && echo OK || echo FAILED) (logs and summary.json in $OUT)"
exit $status
