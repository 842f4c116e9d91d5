#!/usr/bin/env bash
# Installs the newest dist/kda_ops-*.whl into a fresh venv (.venv-wheel) and runs scripts/wheel_smoke.py
# with it, isolated (python -I) from a scratch directory: no source tree, no PYTHONPATH, no user site.
#
#   PY          the python whose torch the wheel was built against (default .venv/bin/python)
#   TORCH_MODE  reuse (default): torch is read from PY's site-packages through a path entry (a .pth line
#               in .venv-wheel: no download, no second 3 GB copy; that directory's own .pth files, such as
#               the checkout's kda_ops_checkout.pth, are NOT processed, so the checkout stays off the path)
#               pip: pip resolves the wheel's torch==X requirement into .venv-wheel itself (pip's cache or
#               the index), the way a user installs it
#   KDA_WHEEL_ARCHS  the CUDA architectures the wheel must contain (default 90a,100a,103a,120a; "" = CPU only)
set -euo pipefail
cd "$(dirname "$0")/.."
ROOT=$PWD
PY=${PY:-.venv/bin/python}
TORCH_MODE=${TORCH_MODE:-reuse}
WHEEL=$(ls -t dist/kda_ops-*.whl 2>/dev/null | head -1 || true)
[ -n "$WHEEL" ] || { echo "wheel smoke: no dist/kda_ops-*.whl (run make wheel)"; exit 1; }
echo "== wheel smoke: $WHEEL (torch: $TORCH_MODE)"
start=$(date +%s)
rm -rf .venv-wheel
"$PY" -m venv .venv-wheel
VP=$ROOT/.venv-wheel/bin/python
if [ "$TORCH_MODE" = reuse ]; then
    src=$("$PY" -c "import sysconfig; print(sysconfig.get_paths()['purelib'])")
    dst=$("$VP" -c "import sysconfig; print(sysconfig.get_paths()['purelib'])")
    echo "$src" > "$dst/build_venv_torch.pth"
    "$VP" -m pip install -q --no-deps --no-index "$WHEEL"
else
    "$VP" -m pip install -q "$WHEEL"
fi
scratch=$(mktemp -d)
(cd "$scratch" && env -u PYTHONPATH OMP_NUM_THREADS=${OMP_NUM_THREADS:-2} "$VP" -I "$ROOT/scripts/wheel_smoke.py")
rm -rf "$scratch"
echo "== wheel smoke: $(( $(date +%s) - start )) s"
