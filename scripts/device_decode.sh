#!/usr/bin/env bash
# Decode on the GPU machine: build for sm_90a with ptxas register reports, the GPU tests
# of the token-serial kernel (tests/gpu/test_recurrent_cuda.py, then the API tests' GPU tier), and the decode
# benchmark beside fla. Logs and results land in $OUT (at most 8 files come back).
#
#   run: carry [".whl", ".golden"]; command: bash scripts/device_decode.sh
#   .golden/ holds copies of ../shared/golden/*.pt (it does not travel otherwise); KDA_GOLDEN_DIR overrides.
#   STAGES="build tests bench" (default) or a subset; BENCH_ARGS are passed to benchmarks/bench_decode.py.
#   Stage tests_bulk reruns tests/gpu/test_recurrent_cuda.py (less the 4096-step decodes) with
#   KDA_RECURRENT_BULK=2 (every test through the bulk-copy kernel where it applies; BULK_MODE overrides the
#   mode), tests_single with KDA_RECURRENT_SINGLE=2 (the one-item-per-warp kernel); both log to tests_knobs.log.
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-$PWD/device_out}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 CUDA_HOME=${CUDA_HOME:-/usr/local/cuda} KDA_CUDA_ARCHS=${KDA_CUDA_ARCHS:-90a}
export MAX_JOBS=${MAX_JOBS:-16} KDA_GOLDEN_DIR=${KDA_GOLDEN_DIR:-$PWD/.golden}
STAGES=${STAGES:-build tests bench}
if compgen -G ".whl/*.whl" >/dev/null; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/site .whl/*.whl \
    && export PYTHONPATH=/tmp/site:${PYTHONPATH:-}
fi
nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.max.sm --format=csv,noheader
rc=0
for s in $STAGES; do
  t0=$(date +%s)
  case $s in
    build)
      KDA_PTXAS_VERBOSE=1 timeout 420 python3 setup.py -q build_ext --inplace >"$OUT/build.log" 2>&1
      b=$?
      echo "== build rc=$b in $(( $(date +%s) - t0 )) s"
      # one line per recurrent instantiation: registers, stack, spills
      python3 - "$OUT/build.log" <<'PY'
import re, sys
txt = open(sys.argv[1], errors="replace").read()
for m in re.finditer(r"Compiling entry function '(_ZN3kda6decode\d+kda_recurrent_(bulk_|single_)?kernel\S*)'.*?\n(.*?)\n.*?Used (\d+) registers", txt, re.S):
    name = m.group(1)
    tile = re.search(r"RecurrentTileILi(\d+)E(\w+?)Li(\d+)E", name)
    frame = re.search(r"(\d+) bytes stack frame, (\d+) bytes spill stores, (\d+) bytes spill loads", m.group(0))
    kind = (m.group(2) or "ring_").rstrip("_")
    print("ptxas", kind, tile.groups() if tile else name[:60], "regs", m.group(4), "stack/spillST/spillLD", frame.groups() if frame else "?")
PY
      grep -E "error|Error" "$OUT/build.log" | grep -v "^ " | head -20
      [ $b != 0 ] && { tail -40 "$OUT/build.log"; exit $b; }
      ;;
    tests)
      timeout 330 python3 -m pytest -q -p no:cacheprovider --durations=8 -rfE tests/gpu/test_recurrent_cuda.py 2>&1 \
        | tee "$OUT/tests.log" | tail -45
      r=${PIPESTATUS[0]}; [ $r != 0 ] && rc=$r
      timeout 120 python3 -m pytest -q -p no:cacheprovider -m gpu -rfE tests/test_api.py 2>&1 | tee "$OUT/tests_api.log" | tail -12
      echo "== tests in $(( $(date +%s) - t0 )) s"
      ;;
    tests_bulk)
      KDA_RECURRENT_BULK=${BULK_MODE:-2} timeout 300 python3 -m pytest -q -p no:cacheprovider --durations=5 -rfE \
        -k "not long_decode" tests/gpu/test_recurrent_cuda.py 2>&1 | sed 's/^/[bulk] /' | tee -a "$OUT/tests_knobs.log" | tail -25
      r=${PIPESTATUS[0]}; [ $r != 0 ] && rc=$r
      echo "== tests_bulk in $(( $(date +%s) - t0 )) s"
      ;;
    tests_single)
      KDA_RECURRENT_SINGLE=2 timeout 300 python3 -m pytest -q -p no:cacheprovider --durations=5 -rfE \
        -k "not long_decode" tests/gpu/test_recurrent_cuda.py 2>&1 | sed 's/^/[single] /' | tee -a "$OUT/tests_knobs.log" | tail -25
      r=${PIPESTATUS[0]}; [ $r != 0 ] && rc=$r
      echo "== tests_single in $(( $(date +%s) - t0 )) s"
      ;;
    bench)
      timeout 300 python3 benchmarks/bench_decode.py --out "$OUT" ${BENCH_ARGS:-} 2>&1 | tee "$OUT/bench.log" | grep -v "^\[" | tail -60
      echo "== bench in $(( $(date +%s) - t0 )) s"
      ;;
  esac
done
exit $rc
