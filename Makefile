# The README's commands. `make test` and `make demo` work on a fresh machine: they create .venv,
# install torch 2.14.1 + the pinned CUTLASS headers + test tools, build kda_ops._C, then run.
# On a machine that already has torch, use PY=python3 VENV= to skip the venv.
# KDA_CUDA_ARCHS=auto (setup.py) compiles the CUDA kernels for the GPU torch sees, and builds the CPU-only
# extension on a machine without one (saying how to ask for kernels: KDA_CUDA_ARCHS=90a, a list, or all).
# KDA_BUILD_EXPERIMENTS=1 compiles the experiment switches in (docs/env.md); `make wheel` refuses it.
SHELL := /bin/bash
VENV ?= .venv
PY ?= $(if $(VENV),$(VENV)/bin/python,python3)
KDA_CUDA_ARCHS ?= auto
MAX_JOBS ?= 2
export CUDA_HOME ?= /usr/local/cuda
export KDA_CUDA_ARCHS MAX_JOBS
TORCH_PIN ?= torch==2.14.1
BUILD_LOCK ?= /tmp/kda_ops_build.lock
# BUILD_BASE=build/wheel makes `make build` reuse the objects of `make wheel` (same sources and flags:
# ninja finds them up to date, so CI compiles every kernel once for both)
BUILD_BASE ?=

.PHONY: venv build test test-gpu demo bench device-check lint lint-tools format clean wheel wheel-smoke

$(VENV)/.ready:
	@echo "== creating $(VENV): $(TORCH_PIN), nvidia-cutlass==4.2.0.0 headers, fla-core==0.6.0, ninja, numpy, einops, pytest, hypothesis (a few minutes)"
	python3 -m venv $(VENV)
	$(VENV)/bin/pip install -q --upgrade pip setuptools wheel
	$(VENV)/bin/pip install -q $(TORCH_PIN) ninja numpy pytest hypothesis einops
	@# fla's KDA reference and entry points, for tests/test_fla*.py (its own deps: einops; triton comes with torch)
	$(VENV)/bin/pip install -q --no-deps fla-core==0.6.0
	$(VENV)/bin/pip install -q --no-deps nvidia-cutlass==4.2.0.0
	touch $@

venv: $(if $(VENV),$(VENV)/.ready,)

build: venv
	@echo "== building kda_ops._C (KDA_CUDA_ARCHS=$(KDA_CUDA_ARCHS), MAX_JOBS=$(MAX_JOBS))"
	@flock -n $(BUILD_LOCK) true || echo "== waiting for the build lock $(BUILD_LOCK): another checkout on this machine is building"
	flock $(BUILD_LOCK) env $(if $(BUILD_BASE),KDA_BUILD_BASE=$(BUILD_BASE)) $(PY) setup.py -q build_ext --inplace
ifneq ($(VENV),)
	@# make the checkout importable from anywhere with the venv's python (an in-place "develop" install)
	@$(PY) -c "import os, sysconfig; open(os.path.join(sysconfig.get_paths()['purelib'], 'kda_ops_checkout.pth'), 'w').write(os.getcwd() + '\n')"
endif

# A wheel with prebuilt kernels for every supported GPU (sm_90a, sm_100a, sm_103a, sm_120a) and the CPU
# path, requiring exactly the torch it was built against (docs/install.md). Built in its own build
# directory, so the in-place development build is left as it is.
WHEEL_ARCHS ?= all
wheel: venv
	@echo "== building dist/kda_ops-*.whl (KDA_CUDA_ARCHS=$(WHEEL_ARCHS), MAX_JOBS=$(MAX_JOBS))"
	@flock -n $(BUILD_LOCK) true || echo "== waiting for the build lock $(BUILD_LOCK): another checkout on this machine is building"
	rm -rf build/wheel/bdist*
	flock $(BUILD_LOCK) env KDA_WHEEL=1 KDA_BUILD_BASE=build/wheel KDA_CUDA_ARCHS=$(WHEEL_ARCHS) $(PY) setup.py -q \
	    bdist_wheel --bdist-dir build/wheel/bdist --dist-dir dist
	@# exactly one extension in the wheel: the one just built (never the in-place development copy)
	$(PY) -c "import glob, zipfile; w = sorted(glob.glob('dist/kda_ops-*.whl'))[-1]; so = [n for n in zipfile.ZipFile(w).namelist() if n.endswith('.so')]; assert len(so) == 1, so; print(w, so)"
	@ls -l dist/*.whl

# Installs dist/*.whl into a fresh venv (.venv-wheel) and runs scripts/wheel_smoke.py there, from outside
# the source tree. torch comes from $(VENV) through a path entry (no download, no second copy); with
# WHEEL_SMOKE_TORCH=pip pip installs the pinned torch into .venv-wheel instead (from its cache or the index).
WHEEL_SMOKE_TORCH ?= reuse
wheel-smoke:
	PY=$(PY) TORCH_MODE=$(WHEEL_SMOKE_TORCH) bash scripts/wheel_smoke.sh

test: build
	$(PY) -m pytest -q tests

test-gpu: build
	$(PY) -m pytest -q -m gpu tests

demo: build
	$(PY) -m kda_ops.demo

bench: build  # the three benchmarks, --quick, beside fla when importable (needs a GPU; tables in benchmarks/results)
	for b in decode prefill train; do $(PY) benchmarks/bench_$$b.py --quick || exit 1; done

# On a GPU machine: build for its GPU, the GPU tier (one pytest process per file), the benchmarks (--quick) and
# compute-sanitizer; logs and summary.json in $(DEVICE_OUT). DEVICE_STAGES picks stages (build tests bench sanitize).
DEVICE_OUT ?= device-results
DEVICE_STAGES ?= build tests bench sanitize
# its build on every core, unless MAX_JOBS is given (the default of 2 above is for small machines)
DEVICE_JOBS = $(if $(filter file,$(origin MAX_JOBS)),$(shell nproc),$(MAX_JOBS))
device-check: venv
	PY=$(PY) OUT=$(DEVICE_OUT) STAGES="$(DEVICE_STAGES)" MAX_JOBS=$(DEVICE_JOBS) bash scripts/device_check.sh

.PHONY: sanitize
sanitize: build  # compute-sanitizer memcheck/racecheck/synccheck/initcheck over every CUDA op (needs a GPU)
	PY=$(PY) bash scripts/sanitize.sh

# Formatting and static checks, pinned (CI runs them): clang-format over csrc, ruff format and ruff check over the
# Python, mypy over kda_ops. `make format` rewrites the tree the same way.
LINT_PINS ?= ruff==0.8.4 clang-format==19.1.5 mypy==1.13.0
PY_LINT_PATHS = kda_ops tests benchmarks scripts setup.py third_party
CLANG_FORMAT = $(PY) -c "import clang_format, sys; sys.argv[0] = 'clang-format'; sys.exit(clang_format.clang_format())"
CXX_SOURCES = $(shell git ls-files 'csrc/*.h' 'csrc/*.cuh' 'csrc/*.cpp' 'csrc/*.cu')

$(VENV)/.lint-ready: $(if $(VENV),$(VENV)/.ready,)
	$(PY) -m pip install -q $(LINT_PINS)
	$(if $(VENV),touch $@,)

lint-tools: $(if $(VENV),$(VENV)/.lint-ready,)

lint: lint-tools
	$(CLANG_FORMAT) --dry-run --Werror $(CXX_SOURCES)
	$(PY) -m ruff format --check $(PY_LINT_PATHS)
	$(PY) -m ruff check $(PY_LINT_PATHS)
	$(PY) -m mypy

format: lint-tools
	$(CLANG_FORMAT) -i $(CXX_SOURCES)
	$(PY) -m ruff format $(PY_LINT_PATHS)

clean:
	rm -rf build kda_ops/_C*.so
