# gdngen developer targets. `make bench` and `make test` install into $(VENV) on first use.
PYTHON ?= python3
VENV ?= .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed

.PHONY: install postgres-server test test-all test-jax-latest bench tune lint clean

install: $(STAMP)

# Reinstalls only when the packaging files change (the stamp is newer otherwise).
$(STAMP): pyproject.toml setup.py
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install -e '.[jax,mlx,dev,postgres,tpu]'
	touch $@

# The PostgreSQL server tests/test_shared_study.py starts (initdb on a loopback port): Debian's
# postgresql package, installed with apt-get (as root, else through sudo) when no initdb is on
# PATH or under /usr/lib/postgresql/*/bin. Without apt-get it only says what is missing.
postgres-server:
	@if command -v initdb >/dev/null 2>&1 || ls /usr/lib/postgresql/*/bin/initdb >/dev/null 2>&1; \
	then :; elif command -v apt-get >/dev/null 2>&1; then \
	  sudo=$$( [ "$$(id -u)" = 0 ] || echo sudo ); \
	  $$sudo apt-get update && $$sudo env DEBIAN_FRONTEND=noninteractive \
	    apt-get install -y --no-install-recommends postgresql; \
	else echo "note: no PostgreSQL server (initdb) found; install one for the shared-study tests"; \
	fi

# `make test`: every backend x feature with at least one real case; `make test-all` adds the
# long sweeps marked slow (whole batteries in interpret mode / the Metal simulator). Test files
# run in TEST_WORKERS processes (pytest-xdist, a file per process at a time: module fixtures
# are built once).
TEST_WORKERS ?= 2
test: install postgres-server lint
	$(BIN)/python -m pytest -q -rs -m "not slow" -n $(TEST_WORKERS) --dist loadfile --durations=0 --durations-min=15

# `make test-all` also installs the NVIDIA compiler (the `cuda` extra, ~550 MB: jax's CUDA plugin
# and ptxas) for tests/test_real_compile_gpu.py; `make test` leaves it out (those tests skip).
CUDA_STAMP := $(VENV)/.installed-cuda

$(CUDA_STAMP): $(STAMP)
	$(BIN)/python -m pip install -e '.[cuda]'
	touch $@

test-all: install postgres-server $(CUDA_STAMP)
	$(BIN)/python -m pytest -q -rs -n $(TEST_WORKERS) --dist loadfile

# `make test-jax-latest`: the newest end of the supported jax range (docs/COMPILE.md, "Supported
# JAX") in its own venv: Python 3.12 (python3.12 on PATH, else the newest 3.12 under `pyenv
# root`; skipped with the reason when neither runs) with jax $(JAX_LATEST) and its libtpu.
# It runs the tests whose code differs between jax versions: the call conformance tests, the
# sharding tests, the real TPU compiler's tests and the mlx(-lm) tests.
JAX_LATEST ?= 0.12.*
LATEST_VENV ?= .venv-jax-latest
LATEST_BIN := $(LATEST_VENV)/bin
LATEST_STAMP := $(LATEST_VENV)/.installed
LATEST_TESTS ?= tests/calls/test_conformance.py tests/calls/test_sharding.py \
	tests/test_real_compile_tpu.py tests/test_mlx_lm_integration.py tests/test_mlx_lm_kda.py \
	tests/test_mlx_lm_speculative.py tests/test_jaxcompat.py \
	tests/test_maxtext_integration.py
find_python312 = { python3.12 -c '' >/dev/null 2>&1 && command -v python3.12; } || \
	{ root=$$(pyenv root 2>/dev/null) && \
	  ls -d "$$root"/versions/3.12*/bin/python3.12 2>/dev/null | sort -V | tail -n 1; }

$(LATEST_STAMP): pyproject.toml setup.py
	@py=$$($(find_python312)); \
	if [ -z "$$py" ]; then echo "make test-jax-latest: no Python 3.12 (python3.12 on PATH or under pyenv root)"; exit 3; fi; \
	test -x $(LATEST_BIN)/python || "$$py" -m venv $(LATEST_VENV)
	$(LATEST_BIN)/python -m pip install -e '.[jax,mlx,dev,tpu,maxtext]' 'jax[tpu]==$(JAX_LATEST)'
	touch $@

test-jax-latest:
	@if [ -z "$$($(find_python312))" ]; then \
	  echo "SKIPPED test-jax-latest: no Python 3.12 found (python3.12 on PATH does not run, and no versions/3.12*/bin/python3.12 under pyenv root); jax 0.11+ needs Python >= 3.12"; \
	else $(MAKE) --no-print-directory $(LATEST_STAMP) && \
	  $(LATEST_BIN)/python -m pytest -q -rs -m "not slow" -n $(TEST_WORKERS) --dist loadfile \
	    $(LATEST_TESTS); fi

bench: install
	$(BIN)/gdngen bench

# Autotune on the detected device with a modest budget (a few minutes on a 2-core CPU); results
# go to the user cache dir. Override, e.g.: make tune TUNE_ARGS='--model qwen3.5 --trials 12'.
TUNE_ARGS ?= --model qwen3-next --seq 512 --trials 4 --repeats 2
tune: install
	$(BIN)/gdngen tune $(TUNE_ARGS)

# ruff with the rule set in pyproject.toml; `make test` (so .ci/run) runs it first
lint: install
	$(BIN)/ruff check gdngen tests benchmarks

# Build and cache artefacts only; the virtualenv is kept (remove $(VENV) by hand to reinstall).
clean:
	rm -rf build dist .pytest_cache .ruff_cache *.egg-info
	find gdngen tests benchmarks -name __pycache__ -type d -prune -exec rm -rf {} +

# `make device-wheels`: the wheels benchmarks/device/nvidia.sh installs on a lent NVIDIA machine
# (Python 3.12, no network; jax, torch, triton, numpy, jinja2, click, rich, matplotlib, pyyaml,
# tqdm are in its image): gdngen's missing dependencies (optuna and its own, platformdirs) and
# fla-core 0.6 (fla's kernels; flash-linear-attention adds only its layers and models, which
# `import fla` would then load with transformers) for the comparison, each named (--no-deps),
# into $(DEVICE_WHEELS), which the run tool carries (docs/DEVICE.md). 6.5 MiB.
DEVICE_WHEELS ?= .device-wheels
DEVICE_PACKAGES ?= optuna==5.1.0 alembic==1.20.1 sqlalchemy==2.1.9 mako==1.4.3 \
	colorlog==6.12.0 platformdirs==4.14.9 fla-core==0.6.0
DEVICE_PIP ?= $(if $(wildcard $(BIN)/python),$(BIN)/python,$(PYTHON)) -m pip
device-wheels:
	$(DEVICE_PIP) download --no-deps --python-version 3.12 --implementation cp \
	  --only-binary=:all: --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 \
	  --platform manylinux2014_x86_64 --dest $(DEVICE_WHEELS) $(DEVICE_PACKAGES)
	@du -sh $(DEVICE_WHEELS)
