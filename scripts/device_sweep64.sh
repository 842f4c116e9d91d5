#!/usr/bin/env bash
# The Hopper 64-token backward sweep (KDA_TRAINING_SWEEP=wgmma64) checked on the GPU machine after a change to
# csrc/kda/backward/sm90/sweep64_sm90.cu: build for sm_90a; scripts/sweep64_smoke.py (the 64-token and the
# 16-token sweep's eight errors per case); the kernel times of both sweeps on the same machine
# (scripts/train_profile.py, H=96 and H=32, T=8192); the phase clocks (KDA_SWEEP64_PROFILE=1); then training GPU
# tests with the sweep forced, most telling first: extreme and banded unbounded gates (the wide blocks),
# determinism, golden, dβ, the lower-bound edges (gates pinned at the bound, ...), then the forced-sweep mode cases.
# Each step under timeout; logs in $OUT. The whole takes ~6-7 min on a fresh machine (build ~60 s).
#
#   OUT=/tmp/out bash scripts/device_sweep64.sh
#   TESTS=0 bash scripts/device_sweep64.sh       # build, smoke, times and clocks only (~3 min)
#   STEPS="build gates edges" bash scripts/device_sweep64.sh   # some steps only (the build first on a fresh machine)
# Steps: build smoke times clocks contention gates edges modes (contention: the phase clocks with 8 CTAs, beside the
# full grid's). Their timeouts add up to more than one 10-minute call; on a
# warm machine the build is incremental, so a second call can run the tests the first did not reach.
#
# Success: the smoke lists every case with errors below 1e-2 and "finite" for both sweeps; tests_*.log end with
# "N passed" and no "failed". The exit status is 1 when a step failed.
set -uo pipefail
source "$(dirname "$0")/_device_env.sh"
kda_install_wheels
export PYTHONPATH=$PWD:${PYTHONPATH:-}
TESTS=${TESTS:-1}
STEPS=${STEPS:-build smoke times clocks contention gates edges modes}
[ "$TESTS" = 1 ] || STEPS=${STEPS//gates/}
[ "$TESTS" = 1 ] || STEPS=${STEPS//edges/}
[ "$TESTS" = 1 ] || STEPS=${STEPS//modes/}
want() { [[ " $STEPS " == *" $1 "* ]]; }
status=0

run() {  # run NAME TIMEOUT_S CMD...: CMD under timeout, its output in $OUT/NAME.log
  local name=$1 to=$2
  shift 2
  echo "== $name (timeout ${to}s)"
  timeout "$to" "$@" >"$OUT/$name.log" 2>&1
  local rc=$?
  [ $rc -ne 0 ] && echo "   rc=$rc" && status=1
  return $rc
}

if want build; then
  run build 300 python3 setup.py -q build_ext --inplace || { tail -30 "$OUT/build.log"; exit 1; }
fi
if want smoke; then
  run smoke 150 python3 scripts/sweep64_smoke.py
  grep -a "wgmma64\|sub16\|rror" "$OUT/smoke.log" | head -30
fi
if want times; then
  for s in wgmma64 sub16; do
    KDA_TRAINING_SWEEP=$s run "times_$s" 90 python3 scripts/train_profile.py 96,32
    grep -a "##\|sweep\|backward_chunked" "$OUT/times_$s.log" | head -6
  done
fi
if want clocks; then
  KDA_SWEEP64_PROFILE=1 KDA_TRAINING_SWEEP=wgmma64 run clocks 90 python3 scripts/train_profile.py 96
  grep -a "profile:" "$OUT/clocks.log" | head -1
fi
if want contention; then  # the same profile on 8 CTAs: what the full grid's traffic costs each phase
  KDA_SWEEP64_PROFILE=1 KDA_SWEEP64_PROFILE_GRID=8 KDA_TRAINING_SWEEP=wgmma64 run clocks8 90 \
    python3 scripts/train_profile.py 96
  grep -a "profile:" "$OUT/clocks8.log" | head -1
fi
# one CPU thread per xdist worker: the fp64 references run on the CPU, and 14 workers of torch's default 16 threads each
# oversubscribe the 16 cores (the mode selection did not finish in 360 s that way; with one thread: 41 cases in 81 s)
PYTEST=(env OMP_NUM_THREADS=1 python3 -m pytest -q -rf -n 14 -p no:cacheprovider -o addopts= --durations=10
  tests/gpu/test_training_cuda.py)
if want gates; then
  KDA_TRAINING_SWEEP=wgmma64 run tests_gates 240 "${PYTEST[@]}" -k "extreme or deterministic or golden or dbeta"
  tail -3 "$OUT/tests_gates.log"
fi
if want edges; then
  run tests_edges 200 "${PYTEST[@]}" -k "lower_bound_edges and wgmma64"
  tail -3 "$OUT/tests_edges.log"
fi
if want modes; then
  run tests_modes 360 "${PYTEST[@]}" -k "each_sweep_every_mode and wgmma64"
  tail -3 "$OUT/tests_modes.log"
fi
exit $status
