#!/usr/bin/env bash
# Decode on the GPU machine: build for sm_90a with ptxas register reports, the GPU tests of the token-serial
# kernels under both kernels (KDA_DECODE_KERNEL=serial, the default, and ring, the warp-specialised
# kernel), the decode benchmark beside fla under both kernels, and the eager host overhead. Every step under
# `timeout`; logs and results in $OUT. Whole run: under 6 minutes on one H200 with MAX_JOBS=16.
#
#   run: carry [".whl", ".golden"]; command: bash scripts/device_decode.sh
#   .whl/ holds the peer wheels (fla), installed into /tmp/site; .golden/ copies of the golden files (shared/golden/*.pt; it
#   does not travel otherwise); KDA_GOLDEN_DIR overrides.
#   STAGES="build tests tests_ring bench overhead" (default) or a subset; BENCH_CASES overrides the cases.
#
# Success: build rc=0 with no spill in the ptxas lines; tests.log and tests_ring.log end in "passed" with
# no "failed"; bench_decode_serial.md / bench_decode_ring.md carry the TB/s of each case (targets: bf16 B=256/1024
# >= 3.6 TB/s, spec S=3 B=64 >= 3.0 TB/s, fp32 B=256 >= 3.7 TB/s, b1 <= 3 us per step).
set -uo pipefail
source "$(dirname "$0")/_device_env.sh"  # repository root, OUT, build env, .golden/, kda_install_wheels
FINAL_OUT=$OUT
OUT=$FINAL_OUT/work  # everything lands here; the key files are copied up at the end (few files come back)
mkdir -p "$OUT"
unset KDA_DECODE_KERNEL KDA_RECURRENT_ROWS_PER_LANE KDA_RECURRENT_BLOCKS_PER_SM KDA_RECURRENT_CARVEOUT \
  KDA_RECURRENT_L1_PREFETCH KDA_RECURRENT_WARPS_PER_BLOCK KDA_RECURRENT_DIAG
STAGES=${STAGES:-build tests tests_ring bench overhead}
CASES=${BENCH_CASES:-bf16:256,bf16:1024,fp32:256,spec-bf16:64,verify-bf16:64,b1}
kda_install_wheels
nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.max.sm --format=csv,noheader
rc=0
T_ALL=$(date +%s)
for s in $STAGES; do
  t0=$(date +%s)
  case $s in
    build)
      KDA_PTXAS_VERBOSE=1 timeout 300 python3 setup.py -q build_ext --inplace >"$OUT/build.log" 2>&1
      b=$?
      echo "== build rc=$b in $(( $(date +%s) - t0 )) s"
      # one line per decode instantiation: registers, stack, spills
      python3 - "$OUT/build.log" <<'PY' | tee "$OUT/ptxas_decode.txt"
import re, sys
txt = open(sys.argv[1], errors="replace").read()
pat = r"Compiling entry function '(_ZN3kda6decode\d+kda_recurrent_(ring_)?kernel\S*)' for '(sm_\w+)'.*?\n(.*?)\n.*?Used (\d+) registers"
for m in re.finditer(pat, txt, re.S):
    name = m.group(1)
    tile = re.search(r"RecurrentTileILi(\d+)E(\w+?)Li(\d+)E", name)
    frame = re.search(r"(\d+) bytes stack frame, (\d+) bytes spill stores, (\d+) bytes spill loads", m.group(0))
    kind = "ring" if m.group(2) else "serial"
    print("ptxas", m.group(3), kind, tile.groups() if tile else name[:60], "regs", m.group(5),
          "stack/spillST/spillLD", frame.groups() if frame else "?")
PY
      grep -E "error|Error" "$OUT/build.log" | grep -v "^ " | head -20
      [ $b != 0 ] && { tail -40 "$OUT/build.log"; exit $b; }
      ;;
    tests)
      # the whole file under the default (serial) kernel, including the cross-configuration comparison
      # (child processes under KDA_DECODE_KERNEL=ring and the schedule knobs)
      timeout 200 python3 -m pytest -q -p no:cacheprovider --durations=8 -rfE tests/gpu/test_recurrent_cuda.py 2>&1 \
        | tee "$OUT/tests.log" | tail -30
      r=${PIPESTATUS[0]}; [ $r != 0 ] && rc=$r
      echo "== tests in $(( $(date +%s) - t0 )) s"
      ;;
    tests_ring)
      # every other test through the ring kernel (bf16 tiles; fp32 tiles keep the serial kernel)
      KDA_DECODE_KERNEL=ring timeout 150 python3 -m pytest -q -p no:cacheprovider --durations=5 -rfE \
        -k "not configs_bit_identical and not long_decode" tests/gpu/test_recurrent_cuda.py 2>&1 \
        | tee "$OUT/tests_ring.log" | tail -30
      r=${PIPESTATUS[0]}; [ $r != 0 ] && rc=$r
      echo "== tests_ring in $(( $(date +%s) - t0 )) s"
      ;;
    bench)
      for kern in serial ring; do
        KDA_DECODE_KERNEL=$kern timeout $([ $kern = ring ] && echo 75 || echo 120) python3 benchmarks/bench_decode.py --out "$OUT" --cases "$CASES" \
          --tag "_$kern" $([ $kern = ring ] && echo --no-peers) ${BENCH_ARGS:-} 2>&1 \
          | tee "$OUT/bench_$kern.log" | grep -v "^\[" | tail -25
      done
      echo "== bench in $(( $(date +%s) - t0 )) s"
      ;;
    overhead)
      timeout 60 python3 benchmarks/bench_api_overhead.py --device cuda --number 3000 --repeat 5 2>&1 \
        | tee "$OUT/overhead.log" | tail -12
      echo "== overhead in $(( $(date +%s) - t0 )) s"
      ;;
  esac
done
echo "== total $(( $(date +%s) - T_ALL )) s"
# Back: the ptxas lines, both test logs, both benchmark tables, the overhead log; the rest in a tarball.
for f in ptxas_decode.txt tests.log tests_ring.log bench_decode_serial.md bench_decode_ring.md overhead.log; do
  [ -f "$OUT/$f" ] && cp "$OUT/$f" "$FINAL_OUT/"
done
tar -czf "$FINAL_OUT/results.tar.gz" -C "$OUT" . 2>/dev/null && rm -rf "$OUT"
exit $rc
