# The README's commands. `make test` and `make demo` work on a fresh machine: they create .venv,
# install torch 2.14.1 + the pinned CUTLASS headers + test tools, build kda_ops._C, then run.
# On a machine that already has torch (the GPU machine), use PY=python3 VENV= to skip the venv.
SHELL := /bin/bash
VENV ?= .venv
PY ?= $(if $(VENV),$(VENV)/bin/python,python3)
KDA_CUDA_ARCHS ?= auto
MAX_JOBS ?= 2
export CUDA_HOME ?= /usr/local/cuda
export KDA_CUDA_ARCHS MAX_JOBS
TORCH_PIN ?= torch==2.14.1
BUILD_LOCK ?= /tmp/kda_ops_build.lock

.PHONY: venv build test test-gpu demo bench device-check lint clean

$(VENV)/.ready:
	@echo "== creating $(VENV): $(TORCH_PIN), nvidia-cutlass==4.2.0.0 headers, ninja, pytest, hypothesis (a few minutes)"
	python3 -m venv $(VENV)
	$(VENV)/bin/pip install -q --upgrade pip setuptools wheel
	$(VENV)/bin/pip install -q $(TORCH_PIN) ninja numpy pytest hypothesis
	$(VENV)/bin/pip install -q --no-deps nvidia-cutlass==4.2.0.0
	touch $@

venv: $(if $(VENV),$(VENV)/.ready,)

build: venv
	@echo "== building kda_ops._C (KDA_CUDA_ARCHS=$(KDA_CUDA_ARCHS), MAX_JOBS=$(MAX_JOBS))"
	@flock -n $(BUILD_LOCK) true || echo "== waiting for the build lock $(BUILD_LOCK): another checkout on this machine is building"
	flock $(BUILD_LOCK) $(PY) setup.py -q build_ext --inplace
ifneq ($(VENV),)
	@# make the checkout importable from anywhere with the venv's python (an in-place "develop" install)
	@$(PY) -c "import os, sysconfig; open(os.path.join(sysconfig.get_paths()['purelib'], 'kda_ops_checkout.pth'), 'w').write(os.getcwd() + '\n')"
endif

test: build
	$(PY) -m pytest -q tests

test-gpu: build
	$(PY) -m pytest -q -m gpu tests

demo: build
	$(PY) -m kda_ops.demo

bench: build  # the three benchmarks, --quick, beside fla when importable (GPU machine; tables in benchmarks/results)
	for b in decode prefill train; do $(PY) benchmarks/bench_$$b.py --quick || exit 1; done

device-check:
	bash scripts/device_check.sh

.PHONY: sanitize
sanitize: build  # compute-sanitizer memcheck/racecheck/synccheck/initcheck over every CUDA op (GPU machine)
	PY=$(PY) bash scripts/sanitize.sh

lint:
	$(PY) -m ruff check kda_ops tests benchmarks
	$(PY) -m mypy

clean:
	rm -rf build kda_ops/_C*.so
