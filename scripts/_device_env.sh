# Sourced by scripts/device_*.sh: the environment every run on the GPU machine starts from.
# Moves to the repository root; OUT (created, default ./device_out); CUDA_HOME; KDA_CUDA_ARCHS=90a and
# MAX_JOBS=16 unless set; KDA_GOLDEN_DIR from a carried .golden/ (the golden files do not travel
# otherwise). The machine has no package registry: kda_install_wheels installs the carried wheels of
# .whl/ into a target folder (default /tmp/site) with --no-index and puts it on PYTHONPATH.
cd "$(dirname "${BASH_SOURCE[0]}")/.."
OUT=${OUT:-$PWD/device_out}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 CUDA_HOME=${CUDA_HOME:-/usr/local/cuda}
export KDA_CUDA_ARCHS=${KDA_CUDA_ARCHS:-90a} MAX_JOBS=${MAX_JOBS:-16}
[ -d .golden ] && export KDA_GOLDEN_DIR=${KDA_GOLDEN_DIR:-$PWD/.golden}

kda_install_wheels() {  # kda_install_wheels [TARGET]: no-op without .whl/*.whl
  local target=${1:-/tmp/site}
  compgen -G ".whl/*.whl" >/dev/null || return 0
  timeout 120 python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
    --target "$target" .whl/*.whl && export PYTHONPATH=$target:${PYTHONPATH:-}
}
