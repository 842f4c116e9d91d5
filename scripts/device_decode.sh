#!/usr/bin/env bash
# Decode on the GPU machine: build for sm_90a with ptxas register reports, the GPU tests of the token-serial
# kernels under the default kernel (the warp-specialised ring kernel for bf16 pools; the test file's
# cross-configuration test runs the serial kernel and the ring shapes in child processes), the decode
# benchmark beside fla, A/B runs of the ring kernel's block shapes and of the B=1 tile, each in its own
# process (the launcher reads its knobs once), and the eager host overhead. Every step under `timeout`;
# logs and results in $OUT. After the build, tests + bench + overhead: about 4 minutes on one H200.
#
#   run: carry [".whl", ".golden"]; command: bash scripts/device_decode.sh
#   .whl/ holds the peer wheels (fla), installed into /tmp/site; .golden/ copies of the golden files (shared/golden/*.pt; it
#   does not travel otherwise); KDA_GOLDEN_DIR overrides.
#   STAGES="build tests bench overhead" (default) or a subset (also: tests_serial, the test file under
#   KDA_DECODE_KERNEL=serial); BENCH_CASES overrides the main cases.
#
# Success: build rc=0 with no spill in the ptxas lines (sm_90a serial K=128 NR=8: 168 registers; ring shapes
# 0-3: 168); tests.log ends in "passed" with no "failed"; bench_decode_ring.md carries the TB/s of each case
# beside fla (targets: bf16 B=256/1024 >= 3.6 TB/s, spec S=3 B=64 >= 3.0 TB/s, fp32 B=256 >= 3.7 TB/s, B=1
# <= 3 us per step in a graph of many steps); bench_variants.md one row per configuration (ring shapes,
# state-first issue order, the serial kernel, B=1 tiles): the fastest row names the next default.
set -uo pipefail
source "$(dirname "$0")/_device_env.sh"  # repository root, OUT, build env, .golden/, kda_install_wheels
FINAL_OUT=$OUT
OUT=$FINAL_OUT/work  # everything lands here; the key files are copied up at the end (few files come back)
mkdir -p "$OUT"
unset KDA_DECODE_KERNEL KDA_RECURRENT_ROWS_PER_LANE KDA_RECURRENT_BLOCKS_PER_SM KDA_RECURRENT_CARVEOUT \
  KDA_RECURRENT_L1_PREFETCH KDA_RECURRENT_WARPS_PER_BLOCK KDA_RECURRENT_DIAG KDA_DECODE_RING_VARIANT \
  KDA_DECODE_RING_STATE_FIRST KDA_DECODE_RING_FP32 KDA_DECODE_RING_DT_BIAS KDA_DECODE_RING_PRODUCER
STAGES=${STAGES:-build tests bench overhead}
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
    shape = re.search(r"RingShapeILi(\d+)E", name)
    kind = f"ring shape {shape.group(1)}" if m.group(2) and shape else "ring" if m.group(2) else "serial"
    print("ptxas", m.group(3), kind, tile.groups() if tile else name[:60], "regs", m.group(5),
          "stack/spillST/spillLD", frame.groups() if frame else "?")
PY
      grep -E "error|Error" "$OUT/build.log" | grep -v "^ " | head -20
      [ $b != 0 ] && { tail -40 "$OUT/build.log"; exit $b; }
      ;;
    tests)
      # the whole file under the default kernel (ring for bf16 pools), including the cross-configuration
      # comparison (child processes under KDA_DECODE_KERNEL=serial, the ring shapes and the schedule knobs)
      timeout 200 python3 -m pytest -q -p no:cacheprovider --durations=8 -rfE tests/gpu/test_recurrent_cuda.py 2>&1 \
        | tee "$OUT/tests.log" | tail -30
      r=${PIPESTATUS[0]}; [ $r != 0 ] && rc=$r
      echo "== tests in $(( $(date +%s) - t0 )) s"
      ;;
    tests_serial)
      KDA_DECODE_KERNEL=serial timeout 150 python3 -m pytest -q -p no:cacheprovider --durations=5 -rfE \
        -k "not configs_bit_identical and not long_decode" tests/gpu/test_recurrent_cuda.py 2>&1 \
        | tee "$OUT/tests_serial.log" | tail -30
      r=${PIPESTATUS[0]}; [ $r != 0 ] && rc=$r
      echo "== tests_serial in $(( $(date +%s) - t0 )) s"
      ;;
    bench)
      # main table: the default configuration beside fla
      timeout 120 python3 benchmarks/bench_decode.py --out "$OUT" --cases "$CASES" --tag _ring ${BENCH_ARGS:-} 2>&1 \
        | tee "$OUT/bench_ring.log" | grep -v "^\[" | tail -25
      # A/B: one process per configuration (knobs are read once per process), ~15-20 s each
      VCASES=bf16:256,bf16:1024,spec-bf16:64
      i=0
      while IFS='|' read -r envs cases; do
        i=$((i + 1))
        env $envs timeout 40 python3 benchmarks/bench_decode.py --out "$OUT" --cases "$cases" --tag "_v$i" --no-peers \
          --no-eager </dev/null 2>&1 | grep -E "us \(" | sed "s/^/[$envs] /"
      done <<EOF_V
KDA_DECODE_RING_VARIANT=1|$VCASES
KDA_DECODE_RING_VARIANT=2|$VCASES
KDA_DECODE_RING_VARIANT=3|$VCASES
KDA_DECODE_RING_STATE_FIRST=1|$VCASES
KDA_DECODE_KERNEL=serial|bf16:256,fp32:256,b1
KDA_DECODE_RING_FP32=0|fp32:256,fp32:1024
KDA_DECODE_RING_PRODUCER=diverged|$VCASES
KDA_RECURRENT_ROWS_PER_LANE=2|b1
KDA_RECURRENT_ROWS_PER_LANE=1|b1
EOF_V
      python3 - "$OUT" <<'PY' | tee "$OUT/bench_variants.md"
import glob, json, os, sys
rows = {}
for f in sorted(glob.glob(os.path.join(sys.argv[1], "bench_decode_*.json"))):
    for r in json.load(open(f))["records"]:
        if r.get("ours_us") is None or r["case"].startswith(("graph1", "eager")):
            continue
        rows.setdefault(r["kernel"], {})[r["case"]] = (r["ours_us"], r.get("ours_tbs"))
cases = sorted({c for v in rows.values() for c in v})
print("| configuration | " + " | ".join(cases) + " |")
print("|---" * (len(cases) + 1) + "|")
for k, v in rows.items():
    cell = lambda c: "" if c not in v else f"{v[c][0]:.1f} us" + ("" if v[c][1] is None else f" {v[c][1]:.2f}")
    print(f"| {k} | " + " | ".join(cell(c) for c in cases) + " |")
PY
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
# Back: the ptxas lines, the test logs, the main benchmark table and the A/B table, the overhead log; the rest in a tarball.
for f in ptxas_decode.txt tests.log tests_serial.log bench_decode_ring.md bench_variants.md overhead.log; do
  [ -f "$OUT/$f" ] && cp "$OUT/$f" "$FINAL_OUT/"
done
tar -czf "$FINAL_OUT/results.tar.gz" -C "$OUT" . 2>/dev/null && rm -rf "$OUT"
exit $rc
