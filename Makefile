# Set-up and checks. `make demo` and `make test` are the two commands a new user needs.
PYTHON ?= python3
VENV   ?= .venv
PY     := $(VENV)/bin/python
# torch is pinned in constraints.txt and the pin is passed to every pip step (-c): pip >= 26 would otherwise
# replace the CPU build with the newest CUDA build while installing the package.
#   make install                      CPU build (from pip's configured index/find-links; on a laptop add
#                                     TORCH_INDEX=https://download.pytorch.org/whl/cpu)
#   make install TORCH=cuda           CUDA build of the same version (PyPI's Linux wheel is the CUDA build;
#                                     or TORCH_INDEX=https://download.pytorch.org/whl/cu130)
TORCH ?= cpu
TORCH_INDEX ?=
PIP := $(PY) -m pip install --progress-bar on -c constraints.txt
TORCH_SOURCE := $(if $(TORCH_INDEX),--index-url $(TORCH_INDEX) --extra-index-url https://pypi.org/simple,)
# The lean install writes no bytecode up front (~290 MB for every module of every package): Python compiles
# what the commands import, the first time they import it.
LEAN := --no-compile

.PHONY: install install-dev demo test test-heavy lint unit bench docs clean

# The lean install `make demo` needs: torch, the package and what the README's commands use (extra `demo`).
$(VENV)/.installed: pyproject.toml Makefile constraints.txt
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	@echo "== [1/3] pip"; $(PY) -m pip install --upgrade pip
	@echo "== [2/3] torch ($(TORCH) build, pinned by constraints.txt)"
	$(PIP) $(LEAN) $(TORCH_SOURCE) torch
	@echo "== [3/3] leantrain and what the demo and the README's commands use"
	$(PIP) $(LEAN) -e ".[demo]"
	$(PY) scripts/check_torch.py --expect $(TORCH)
	touch $@

# `make test` adds the test tools, the peer implementations the tests compare against and the optional
# extras (Ray, S3, tracking, interactive report): extra `dev`.
$(VENV)/.installed-dev: $(VENV)/.installed
	@echo "== [1/2] test tools, peers and optional extras"
	$(PIP) -e ".[dev]"
	@echo "== [2/2] megatron-core (peer reader for tests, no deps)"
	$(PIP) --no-deps "megatron-core>=0.12"
	$(PY) scripts/check_torch.py --expect $(TORCH)
	touch $@

install: $(VENV)/.installed

install-dev: $(VENV)/.installed-dev

# Bytecode for what the demo's processes import, written once by one process. The lean install compiles nothing
# up front; and where PYTHONDONTWRITEBYTECODE=1 is set (many container images set it) Python never writes the
# bytecode it compiles, so every process of the demo (each torchrun agent and rank, each restart) compiled torch
# again: ~10 s of CPU each. The demo runs with bytecode writing on for the same reason (its own venv only).
DEMO_IMPORTS := leantrain.cli leantrain.demo leantrain.train.trainer leantrain.ckpt.manager leantrain.launch.command \
	leantrain.golive.drill leantrain.observe.report torch.distributed.run
$(VENV)/.demo-bytecode: $(VENV)/.installed
	@echo "== bytecode for the modules the demo imports (once)"
	env -u PYTHONDONTWRITEBYTECODE $(PY) -c "import importlib; [importlib.import_module(m) for m in '$(DEMO_IMPORTS)'.split()]"
	touch $@

demo: $(VENV)/.demo-bytecode
	env -u PYTHONDONTWRITEBYTECODE $(VENV)/bin/leantrain demo

lint: install-dev
	$(VENV)/bin/ruff check src tests bench scripts

# Progress as it runs, the slowest tests and the total at the end. Bytecode writing is on for the tests too
# (see the demo's note above): the tests start hundreds of processes (torchrun agents, ranks, CLI runs), and
# without bytecode each one compiles torch again (importing the trainer: 6.1 s of CPU without bytecode, 2.5 s
# with it). The test files are spread over one pytest-xdist worker per core, at most 4 (TEST_WORKERS: many of
# the tests start 2-4 ranks of their own; a file's tests stay on one worker, so module fixtures run once). On
# the project's 2-core machine, idle, 2026-12-03: 1,035 s as it was, 656 s with bytecode, 427 s with bytecode
# and 2 workers.
TEST_ENV := env -u PYTHONDONTWRITEBYTECODE OMP_NUM_THREADS=1
TEST_WORKERS ?= $(shell n=$$(nproc 2>/dev/null || echo 2); echo $$(( n < 4 ? n : 4 )))
unit: install-dev
	@start=$$(date +%s); $(TEST_ENV) $(PY) -m pytest -m "not heavy" -n $(TEST_WORKERS) --dist loadfile --durations=10; \
	code=$$?; \
	echo "== make test: pytest took $$(( $$(date +%s) - start )) s (exit $$code)"; exit $$code

test: lint unit

# The few tests that take minutes each (marked `heavy`): CI runs them after `make test`.
test-heavy: install-dev
	@start=$$(date +%s); $(TEST_ENV) $(PY) -m pytest -m heavy --durations=10; code=$$?; \
	echo "== make test-heavy: pytest took $$(( $$(date +%s) - start )) s (exit $$code)"; exit $$code

bench: install-dev
	@for script in bench/*.py; do echo "== $$script"; $(PY) $$script || exit 1; done

docs: install
	$(PY) -m leantrain.spec.docs > docs/spec.md

clean:
	rm -rf $(VENV) build dist .pytest_cache .ruff_cache demo-out
