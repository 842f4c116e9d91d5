#!/usr/bin/env bash
# The Hopper 64-token backward sweep (KDA_TRAINING_SWEEP=wgmma64) in one GPU-machine call, for checking a change
# to csrc/kda/backward/sm90/sweep64_sm90.cu: build for sm_90a, scripts/sweep64_smoke.py (both sweeps' eight
# errors per case), the kernel times of both sweeps (scripts/train_profile.py, H=96 and H=32, T=8192, on the same
# machine), the phase clocks (KDA_SWEEP64_PROFILE=1), then training GPU tests with the sweep forced, most telling
# first (extreme and banded unbounded gates: the wide blocks; determinism; golden; dβ; then the forced-sweep mode
# cases), each step under timeout, logs in $OUT. The whole takes ~5 min on a fresh machine (build ~60 s).
#
#   OUT=/tmp/out bash scripts/device_sweep64.sh
#   TESTS=0 bash scripts/device_sweep64.sh       # build, smoke, times and clocks only (~2.5 min)
#   VARIANT=2 bash scripts/device_sweep64.sh     # the smoke, clocks and gate tests on variant 2 (KDA_SWEEP64_VARIANT)
# The times cover both variants of the 64-token sweep and the 16-token sweep either way.
#
# Success: smoke.log lists every case with errors below 1e-2 and "finite" for both sweeps; tests_*.log end with
# "N passed" and no "failed".
set -uo pipefail
source "$(dirname "$0")/_device_env.sh"
kda_install_wheels
export PYTHONPATH=$PWD:${PYTHONPATH:-}
TESTS=${TESTS:-1}
export KDA_SWEEP64_VARIANT=${VARIANT:-1}

run() {  # run NAME TIMEOUT_S CMD...: CMD under timeout, its output in $OUT/NAME.log
  local name=$1 to=$2
  shift 2
  echo "== $name (timeout ${to}s)"
  timeout "$to" "$@" >"$OUT/$name.log" 2>&1
  local rc=$?
  [ $rc -ne 0 ] && echo "   rc=$rc"
  return $rc
}

run build 300 python3 setup.py -q build_ext --inplace || { tail -30 "$OUT/build.log"; exit 1; }
run smoke 120 python3 scripts/sweep64_smoke.py
grep -a "wgmma64\|sub16\|rror" "$OUT/smoke.log" | head -24
for s in wgmma64:1 wgmma64:2 sub16:1; do
  KDA_TRAINING_SWEEP=${s%:*} KDA_SWEEP64_VARIANT=${s#*:} run "times_${s/:/_v}" 90 python3 scripts/train_profile.py 96,32
  grep -a "##\|sweep\|backward_chunked" "$OUT/times_${s/:/_v}.log" | head -6
done
KDA_SWEEP64_PROFILE=1 KDA_TRAINING_SWEEP=wgmma64 run clocks 90 python3 scripts/train_profile.py 96
grep -a "profile:" "$OUT/clocks.log" | head -1
[ "$TESTS" = 1 ] || exit 0
PYTEST=(python3 -m pytest -q -rf -n 14 -p no:cacheprovider -o addopts= tests/gpu/test_training_cuda.py)
KDA_TRAINING_SWEEP=wgmma64 run tests_gates 240 "${PYTEST[@]}" -k "extreme or deterministic or golden or dbeta"
tail -3 "$OUT/tests_gates.log"
KDA_TRAINING_SWEEP=wgmma64 run tests_modes 300 "${PYTEST[@]}" -k "each_sweep and wgmma64"
tail -3 "$OUT/tests_modes.log"
