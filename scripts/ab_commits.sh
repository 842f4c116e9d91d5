#!/usr/bin/env bash
# A/B of kernel variants in one device call (the device copy of the tree has no .git): variant 0 is the tree
# as carried, variant i applies patch i on top of variant i-1 (git apply). Per variant: build for sm_90a, the
# training GPU tests with the per-case error report, the training benchmark without peers, and the kernel
# breakdown of one backward; logs under /tmp/ab_<i>/, archived into $OUT/ab.tar.gz after every variant (a
# call that runs out of time keeps what it finished). Plan one or two patches per 600 s call.
#   here (one patch per commit, code only; carry main's tree with this script and the .diff files untracked):
#     git diff 9f00b63~1 9f00b63 -- csrc tests > ab1.diff; git diff 5294dd0~1 5294dd0 -- csrc tests > ab2.diff
#   device: bash scripts/ab_commits.sh ab1.diff ab2.diff     (AB_ENV: see the end)
# AB_STAGES0: variant 0's stages, e.g. "build tests_gpu bench_train train_profile" (the whole GPU tier).
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-$PWD/device_out}
mkdir -p "$OUT"
rm -rf /tmp/ab_*  # a warm machine keeps /tmp: no reports of an earlier call mixed in
# A warm machine also keeps build/: make every source newer than its objects, so variant 0 rebuilds what
# was carried rather than reusing the previous call's patched objects.
find csrc -type f -exec touch {} +
archive() { tar -czf "$OUT/ab.tar.gz" -C /tmp $(cd /tmp && ls -d ab_* 2>/dev/null) 2>/dev/null; }
run_variant() {  # run_variant I LABEL [STAGES]
  local d=/tmp/ab_$1
  mkdir -p "$d"
  KDA_TRAIN_REPORT=$d/train_report.txt RESULTS=$d/results OUT=$d STAGE_TIMEOUT=240 \
    PYTEST_ARGS="tests/gpu/test_training_cuda.py -q" BENCH_ARGS="--no-peers" \
    STAGES="${3:-build tests_sel bench_train train_profile}" bash scripts/device_check.sh >"$d/all.log" 2>&1
  echo "=== variant $1: $2"
  cat "$d"/tests_*.log 2>/dev/null | grep -a -E "[0-9]+ (passed|failed)" | tail -2
  cat "$d"/tests_*.log 2>/dev/null | grep -a "FAILED" | head -5
  # report lines with any error above 5e-3 (pytest's short summary cuts the failure message)
  python3 - "$d/train_report.txt" <<'PY'
import re, sys
try:
    lines = open(sys.argv[1]).read().splitlines()
except OSError:
    lines = ["(no report)"]
for line in lines:
    vals = [float(v) for v in re.findall(r"=([0-9.eE+-]+)/", line)]
    if not vals or max(vals) > 5e-3:
        print("  report:", line[:400])
PY
  grep -a "^| H" "$d/bench.log" | tail -3
  grep -a -E "^ +[0-9.]+ us" "$d/train_profile.log" | head -8
  archive
}
run_variant 0 "as carried" "${AB_STAGES0:-build tests_sel bench_train train_profile}"
i=0
for patch in "$@"; do
  i=$((i + 1))
  # GIT_CEILING_DIRECTORIES: a git repository above this tree would make git apply skip every path
  GIT_CEILING_DIRECTORIES=$(dirname "$PWD") git apply -v "$patch" >/tmp/ab_apply_$i.log 2>&1 ||
    { echo "=== variant $i: $patch does not apply"; cat /tmp/ab_apply_$i.log; break; }
  run_variant "$i" "$patch"
done
# AB_ENV="NAME=value ...": one more pass of the last build with these variables (no rebuild), e.g.
# AB_ENV=KDA_TRAINING_DSTATE=bf16.
if [ -n "${AB_ENV:-}" ]; then
  env $AB_ENV bash -c "$(declare -f archive run_variant); OUT=$OUT; run_variant env \"$AB_ENV\" \"tests_sel bench_train train_profile\""
fi
archive
