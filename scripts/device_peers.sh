#!/usr/bin/env bash
# The prefill benchmark beside both peers in one process on the GPU machine: builds this extension and
# FlashKDA at the same time (8 jobs each), installs the carried wheels, then runs benchmarks/bench_prefill.py
# (ours on the kernels in KERNELS beside cuDNN Frontend and FlashKDA, eager and CUDA-graph replay). Logs and the
# tables into $OUT. Neither peer's code enters the repository: both travel in git-ignored folders.
#
# Prepare here (no registry on the GPU machine):
#   python3 -m pip download --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
#     --platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64 --platform manylinux_2_17_x86_64 \
#     -d .whl nvidia-cutlass==4.2.0.0 nvidia-cudnn-frontend==1.32.0 cuda-bindings==13.5.0 cuda-pathfinder==1.9.1
#   mkdir -p .peers/FlashKDA && git -C <a fetched MoonshotAI/FlashKDA git directory> archive HEAD | tar -x -C .peers/FlashKDA
# and carry .whl and .peers (about 30 MB together).
#
#   OUT=/tmp/out bash scripts/device_peers.sh
#   KERNELS=mma,sm90:2,sm90:3 BENCH_ARGS="--cases 0,1" bash scripts/device_peers.sh
#
# Success: bench_prefill.log ends with the table and "cudnn importable: True; flash_kda importable: True".
# FlashKDA's build log: flashkda_build.log (its cutlass/ folder is the nvidia-cutlass wheel's source tree).
set -uo pipefail
source "$(dirname "$0")/_device_env.sh"  # repository root, OUT, build env, .golden/, kda_install_wheels
kda_install_wheels
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH}
T0=$(date +%s)
FKDA=$PWD/.peers/FlashKDA
if [ -f "$FKDA/setup.py" ]; then
  CUTLASS_SRC=$(python3 -c "import cutlass_library, os; print(os.path.join(os.path.dirname(cutlass_library.__file__), 'source'))")
  (cd "$FKDA" && rm -rf cutlass && ln -s "$CUTLASS_SRC" cutlass &&
     FLASH_KDA_CUDA_ARCHS=90a MAX_JOBS=8 timeout 300 python3 setup.py build_ext --inplace >"$OUT/flashkda_build.log" 2>&1
   echo "rc=$?" >>"$OUT/flashkda_build.log") &
  export PYTHONPATH=$FKDA:$PYTHONPATH
else
  echo "== FlashKDA: no .peers/FlashKDA/setup.py carried; timed without it"
fi
MAX_JOBS=8 timeout 300 python3 setup.py -q build_ext --inplace >"$OUT/build.log" 2>&1
rc=$?
wait
echo "== builds done at $(( $(date +%s) - T0 )) s: ours rc=$rc; FlashKDA: $(tail -1 "$OUT/flashkda_build.log" 2>/dev/null)"
[ $rc != 0 ] && { tail -30 "$OUT/build.log"; exit $rc; }
# shellcheck disable=SC2086
timeout "${BENCH_TIMEOUT:-300}" python3 benchmarks/bench_prefill.py --out "$OUT" --kernels "${KERNELS:-mma,sm90:2,sm90:3s0}" \
  ${BENCH_ARGS:-} >"$OUT/bench_prefill.log" 2>&1
echo "== bench_prefill rc=$? at $(( $(date +%s) - T0 )) s"
grep -v "^kda_chunked_sm90: launch" "$OUT/bench_prefill.log" | tail -40
