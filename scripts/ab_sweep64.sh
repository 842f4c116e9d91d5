#!/usr/bin/env bash
# A/B of Hopper 64-token sweep variants (KDA_TRAINING_SWEEP=wgmma64) in one GPU-machine call, lighter than
# scripts/ab_commits.sh (no test tier): variant 0 is the tree as carried, variant i applies patch i on top of
# variant i - 1 (git apply, cumulative). Per variant: an incremental build for sm_90a, scripts/sweep64_smoke.py
# (--quick unless SMOKE=full; SMOKE=0 skips it), the sweep kernel's time at H=96 and H=32 (T=8192,
# scripts/train_profile.py), and the phase clocks with the full grid and with 8 CTAs (KDA_SWEEP64_PROFILE_GRID=8: what
# the other SMs' traffic costs each phase). The 16-token sweep is timed once, after variant 0, as the machine's
# baseline. A summary in $OUT/ab_sweep64.md; every log in $OUT. ~1.5 min per variant on a warm machine (the first
# build ~60 s more).
#   here: git diff main~1 main -- csrc > p1.diff   (one patch per change; csrc and scripts only)
#   device: bash scripts/ab_sweep64.sh p1.diff p2.diff
# EXTRA="cmd" runs cmd after each variant's measurements (EXTRA_TIMEOUT seconds, default 120; the last EXTRA_LINES
# lines of its output, default 8, printed).
set -uo pipefail
cd "$(dirname "$0")/.."
source scripts/_device_env.sh
kda_install_wheels
export PYTHONPATH=$PWD:${PYTHONPATH:-}
OUT=${OUT:-$PWD/device_out}
mkdir -p "$OUT"
SMOKE=${SMOKE:-quick}
summary=$OUT/ab_sweep64.md
echo "| variant | H=96 (us) | H=32 (us) | smoke | phase clocks, full grid / 8 CTAs (k cycles per task) |" >"$summary"
echo "|---|---|---|---|---|" >>"$summary"

kernel_us() {  # the sweep kernel's lines of a train_profile log: "H96 H32"
  grep -a "sweep64_kernel" "$1" | awk '{printf "%s ", $1}'
}
clocks() {  # clocks LOG: the profile line without its prefix
  grep -a "profile:" "$1" | head -1 | sed 's/.*cycles per task: //'
}
variant() {  # variant I LABEL
  local i=$1 label=$2
  if ! python3 setup.py -q build_ext --inplace >"$OUT/build_$i.log" 2>&1; then
    echo "=== variant $i ($label): build failed"
    tail -20 "$OUT/build_$i.log"
    echo "| $i $label | build failed | | | |" >>"$summary"
    return 1
  fi
  local smoke="-"
  if [ "$SMOKE" != 0 ]; then
    local flag=--quick
    [ "$SMOKE" = full ] && flag=
    timeout 150 python3 scripts/sweep64_smoke.py $flag >"$OUT/smoke_$i.log" 2>&1
    # the largest relative error of the wgmma64 lines; NOT OK above 1e-2, on a non-finite result or an exception
    smoke=$(python3 - "$OUT/smoke_$i.log" <<'PY'
import re, sys
lines = [ln for ln in open(sys.argv[1], errors="replace").read().splitlines() if " wgmma64 " in ln]
vals = [float(v) for ln in lines for v in re.findall(r"=([0-9.eE+-]+|nan|inf)", ln)]
bad = not vals or any(v != v or v > 1e-2 for v in vals) or any("ERROR" in ln or "(NaN)" in ln for ln in lines)
print(("max %.1e" % max(vals) if vals else "no wgmma64 lines") + (" NOT OK" if bad else ""))
PY
)
  fi
  KDA_TRAINING_SWEEP=wgmma64 timeout 90 python3 scripts/train_profile.py 96,32 >"$OUT/times_$i.log" 2>&1
  KDA_SWEEP64_PROFILE=1 KDA_TRAINING_SWEEP=wgmma64 timeout 60 python3 scripts/train_profile.py 96 \
    >"$OUT/clocks_$i.log" 2>&1
  KDA_SWEEP64_PROFILE=1 KDA_SWEEP64_PROFILE_GRID=8 KDA_TRAINING_SWEEP=wgmma64 timeout 60 \
    python3 scripts/train_profile.py 96 >"$OUT/clocks8_$i.log" 2>&1
  if [ -n "${EXTRA:-}" ]; then  # a command of the caller's per variant (its output in extra_I.log and here)
    timeout "${EXTRA_TIMEOUT:-120}" bash -c "$EXTRA" >"$OUT/extra_$i.log" 2>&1
    sed 's/^/  extra: /' "$OUT/extra_$i.log" | tail -"${EXTRA_LINES:-8}"
  fi
  local t
  t=$(kernel_us "$OUT/times_$i.log")
  echo "=== variant $i ($label): $t us; smoke $smoke"
  echo "  full grid: $(clocks "$OUT/clocks_$i.log")"
  echo "  8 CTAs:    $(clocks "$OUT/clocks8_$i.log")"
  read -r h96 h32 <<<"$t"
  echo "| $i $label | ${h96:-?} | ${h32:-?} | $smoke | $(clocks "$OUT/clocks_$i.log") / $(clocks "$OUT/clocks8_$i.log") |" \
    >>"$summary"
}

variant 0 "as carried"
KDA_TRAINING_SWEEP=sub16 timeout 90 python3 scripts/train_profile.py 96,32 >"$OUT/times_sub16.log" 2>&1
echo "=== the 16-token sweep on this machine: $(grep -a "training_backward_chunked_kernel" "$OUT/times_sub16.log" | awk '{printf "%s ", $1}')us"
i=0
for patch in "$@"; do
  i=$((i + 1))
  # GIT_CEILING_DIRECTORIES: a git repository above this tree would make git apply skip every path
  if ! GIT_CEILING_DIRECTORIES=$(dirname "$PWD") git apply "$patch" >"$OUT/apply_$i.log" 2>&1; then
    echo "=== variant $i: $patch does not apply"
    cat "$OUT/apply_$i.log"
    break
  fi
  variant "$i" "$(basename "$patch")"
done
