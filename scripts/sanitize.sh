#!/usr/bin/env bash
# compute-sanitizer over every CUDA op and mode on tiny shapes (tests/sanitize_cases.py), one python process
# per tool: memcheck, racecheck, synccheck, initcheck. The caching allocator is off
# (PYTORCH_NO_CUDA_MEMORY_CACHING=1) so that every tensor is its own allocation: an access past a tensor is
# out of bounds for memcheck and a read of memory nobody wrote is visible to initcheck.
#
#   bash scripts/sanitize.sh                       # all four tools (make sanitize)
#   TOOLS="memcheck initcheck" bash scripts/sanitize.sh
#   CASES='spec|broken' bash scripts/sanitize.sh   # only the cases whose name matches the regex
#   SANITIZE_EXTRA="--kernel-name kns=kda_" bash scripts/sanitize.sh   # extra compute-sanitizer options
#   SANITIZE_DEVICE=cpu COMPUTE_SANITIZER=<stub> bash scripts/sanitize.sh    # check this script without a GPU
#
# Prints one summary line per tool (exit code, sanitizer reports, cases run/skipped/failed, seconds) and
# the first reports of any tool that found some; full logs go to $SANITIZE_LOG_DIR (default /tmp/kda_sanitize;
# scripts/device_check.sh passes its $OUT/sanitize). Exit 0 only when every tool ran clean: zero reports and no
# failed case.
set -uo pipefail
cd "$(dirname "$0")/.."
PY=${PY:-python3}
TOOLS=${TOOLS:-memcheck racecheck synccheck initcheck}
CASES=${CASES:-}
DEVICE=${SANITIZE_DEVICE:-cuda}
# Seconds per tool (raise it on a slower GPU). Cases print as they finish, so a timeout still shows how far a
# tool got.
TIMEOUT=${SANITIZE_TIMEOUT:-95}
SANITIZE_LOG_DIR=${SANITIZE_LOG_DIR:-/tmp/kda_sanitize}
mkdir -p "$SANITIZE_LOG_DIR"
export PYTORCH_NO_CUDA_MEMORY_CACHING=1 PYTHONUNBUFFERED=1
# tests/sanitize_cases.py runs as a script: the repository root must be importable (kda_ops).
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
export CUDA_HOME=${CUDA_HOME:-/usr/local/cuda}

CS=${COMPUTE_SANITIZER:-}
if [ -z "$CS" ]; then
  for c in "$(command -v compute-sanitizer 2>/dev/null)" "$CUDA_HOME/bin/compute-sanitizer" \
           "$CUDA_HOME/compute-sanitizer/compute-sanitizer" /usr/local/cuda/bin/compute-sanitizer; do
    if [ -n "$c" ] && [ -x "$c" ]; then CS=$c; break; fi
  done
fi
if [ -z "$CS" ]; then
  echo "sanitize: compute-sanitizer not found (set COMPUTE_SANITIZER=/path/to/compute-sanitizer)"
  exit 2
fi
echo "== sanitize: $("$CS" --version 2>/dev/null | tail -1) ($CS); tools: $TOOLS; logs: $SANITIZE_LOG_DIR"
if [ "$DEVICE" = cuda ]; then
  "$PY" -c "import kda_ops, torch; assert torch.cuda.is_available(), 'no CUDA device'" \
    || { echo "sanitize: kda_ops or the CUDA device is not usable"; exit 2; }
fi

# initcheck reports allocations nobody used only with --track-unused-memory; turn that off explicitly where
# the option exists (its spelling changed between releases; probe it on a process without kernels).
INIT_OPTS=()
if "$CS" --tool initcheck --track-unused-memory no /bin/true >/dev/null 2>&1; then
  INIT_OPTS=(--track-unused-memory no)
fi
# racecheck and synccheck look at shared memory and barriers: only our kernels (kda_*) are under test, and
# skipping torch's own kernels keeps those two tools fast. memcheck and initcheck watch every kernel (torch
# reading an output our kernel left unwritten is exactly what initcheck is for).
KDA_ONLY=()
if "$CS" --tool racecheck --kernel-name kns=kda_ /bin/true >/dev/null 2>&1; then
  KDA_ONLY=(--kernel-name kns=kda_)
fi
EXTRA=()
[ -n "${SANITIZE_EXTRA:-}" ] && read -r -a EXTRA <<<"$SANITIZE_EXTRA"
CASE_ARGS=(--device "$DEVICE")
[ -n "$CASES" ] && CASE_ARGS+=(--only "$CASES")

status=0
summary=()
for tool in $TOOLS; do
  log="$SANITIZE_LOG_DIR/$tool.log"
  opts=(--tool "$tool" --error-exitcode 1)
  [ "$tool" = initcheck ] && opts+=("${INIT_OPTS[@]}")
  case $tool in racecheck|synccheck) opts+=("${KDA_ONLY[@]}") ;; esac
  opts+=("${EXTRA[@]}")
  echo "== $tool: $CS ${opts[*]} $PY tests/sanitize_cases.py ${CASE_ARGS[*]}"
  t0=$(date +%s)
  timeout "$TIMEOUT" "$CS" "${opts[@]}" "$PY" tests/sanitize_cases.py --tool "$tool" "${CASE_ARGS[@]}" >"$log" 2>&1
  rc=$?
  secs=$(( $(date +%s) - t0 ))
  # "ERROR SUMMARY: N errors" (memcheck/initcheck/synccheck and racecheck); racecheck also prints
  # "RACECHECK SUMMARY: N hazards displayed (E errors, W warnings)".
  errs=$(grep -oE "ERROR SUMMARY: [0-9]+ error" "$log" | tail -1 | grep -oE "[0-9]+")
  hazards=$(grep -oE "RACECHECK SUMMARY: [0-9]+ hazard" "$log" | tail -1 | grep -oE "[0-9]+")
  cases=$(grep -oE "SANITIZE_CASES run=[0-9]+ skipped=[0-9]+ failed=[0-9]+" "$log" | tail -1)
  run=$(sed -nE 's/.*run=([0-9]+).*/\1/p' <<<"$cases")
  skipped=$(sed -nE 's/.*skipped=([0-9]+).*/\1/p' <<<"$cases")
  failed=$(sed -nE 's/.*failed=([0-9]+).*/\1/p' <<<"$cases")
  # racecheck of compute-sanitizer 2025.3 prints only its RACECHECK SUMMARY: take its error count.
  if [ -z "$errs" ] && [ -n "$hazards" ]; then
    errs=$(grep -oE "RACECHECK SUMMARY: .*\(([0-9]+) error" "$log" | tail -1 | grep -oE "\([0-9]+" | tr -d '(')
  fi
  reports=${errs:-?}
  [ -n "$hazards" ] && reports="$reports (hazards $hazards)"
  line=$(printf "%-10s rc=%-3s reports=%-18s cases run=%s skipped=%s failed=%s  %ss" \
         "$tool" "$rc" "$reports" "${run:-?}" "${skipped:-?}" "${failed:-?}" "$secs")
  summary+=("$line")
  echo "$line"
  if [ "$rc" != 0 ] || [ "${errs:-1}" != 0 ] || [ "${failed:-1}" != 0 ] || { [ -n "$hazards" ] && [ "$hazards" != 0 ]; }; then
    status=1
    [ "$rc" = 124 ] && echo "   $tool: timed out after ${TIMEOUT}s"
    echo "---- $tool: first reports / failures (full log: $log)"
    grep -nE "^========= (Invalid|Uninitialized|Race|Barrier|Error|Program hit|Unused|Warning|ERROR|[A-Z][a-z]+ (access|read|write))|FAILED|Traceback|Error:" "$log" | head -40
    grep -nE "^\[$tool\] " "$log" | grep -v ": ok " | head -20
    tail -5 "$log"
    echo "----"
  fi
done

echo "== sanitize summary (0 reports and 0 failed cases expected)"
printf '%s\n' "${summary[@]}"
[ $status = 0 ] && echo "== sanitize: clean" || echo "== sanitize: FAILED"
exit $status
