#!/usr/bin/env bash
# GPU machine: kda_ops.fla beside fla's Triton kernels, the device="cuda" workspace cases, and the
# fla / FlashInfer-compatibility / docs tests, with logs under $OUT. About 6 minutes when the
# extension is already built (ninja then has nothing to do); the first build takes ~3-4 of them.
#
#   bash scripts/device_fla.sh                 # all stages
#   STAGES="build gpu" bash scripts/device_fla.sh   # a subset (wheels build gpu cpu), e.g. two calls
#                                                   # when the build and the tests together near 10 min
#
# Needs in .whl/ (the machine has no package registry): fla_core-0.6.0-py3-none-any.whl and
# einops-0.8.2-py3-none-any.whl (triton comes with torch). A carried .triton_cache/ (or
# .triton_cache_parts/ from scripts/device_check.sh) saves fla's Triton compile + autotune.
# Success: $OUT/summary.txt ends with "device_fla: OK" (every stage rc=0).
set -uo pipefail
source "$(dirname "$0")/_device_env.sh"  # repository root, OUT, build env, .golden/, kda_install_wheels
PY=${PY:-python3}
export TRITON_CACHE_DIR=${TRITON_CACHE_DIR:-$PWD/.triton_cache}
mkdir -p "$TRITON_CACHE_DIR"
if compgen -G ".triton_cache_parts/triton_cache.tgz.part*" >/dev/null && [ -z "$(ls -A "$TRITON_CACHE_DIR")" ]; then
  cat .triton_cache_parts/triton_cache.tgz.part* | tar -xzf - -C "$TRITON_CACHE_DIR" 2>/dev/null || true
fi
SUMMARY=$OUT/summary.txt
: > "$SUMMARY"
fail=0
STAGES=${STAGES:-wheels build gpu cpu}
want() { [[ " $STAGES " == *" $1 "* ]]; }
stage() {  # stage NAME TIMEOUT CMD...
  local name=$1 t=$2; shift 2
  local s=$(date +%s)
  timeout "$t" "$@" > "$OUT/$name.log" 2>&1
  local rc=$?
  echo "$name rc=$rc $(( $(date +%s) - s ))s: $(tail -1 "$OUT/$name.log")" | tee -a "$SUMMARY"
  [ $rc = 0 ] || fail=1
}

if compgen -G ".whl/*.whl" >/dev/null && want wheels; then
  stage wheels 90 "$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
    --target /tmp/site_fla .whl/*.whl
fi
[ -d /tmp/site_fla ] && export PYTHONPATH=/tmp/site_fla:${PYTHONPATH:-}
stage fla_version 60 "$PY" -c "import fla, einops; print('fla-core', fla.__version__, 'einops', einops.__version__); assert fla.__version__ == '0.6.0', fla.__version__"
want build && stage build 330 make build VENV= PY="$PY"
# GPU tier: fla beside kda_ops on CUDA, device="cuda" workspaces
want gpu && stage gpu_tests 300 "$PY" -m pytest -q -m gpu tests/gpu/test_fla_cuda.py tests/gpu/test_workspace_device.py -p no:cacheprovider
# the CPU-tier files of this work, run here too (docs snippets with their CUDA blocks and inductor)
want cpu && KDA_DOCS_INDUCTOR=1 stage cpu_tests 240 "$PY" -m pytest -q tests/test_fla.py tests/test_fla_ref.py \
  tests/test_flashinfer_compat.py tests/test_docs_snippets.py -p no:cacheprovider
[ $fail = 0 ] && echo "device_fla: OK" | tee -a "$SUMMARY" || echo "device_fla: FAILED (see $OUT/*.log)" | tee -a "$SUMMARY"
exit $fail
