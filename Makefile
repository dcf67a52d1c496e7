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

.PHONY: install demo test lint unit bench docs clean

$(VENV)/.installed: pyproject.toml Makefile constraints.txt
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	@echo "== [1/4] pip"; $(PY) -m pip install --upgrade pip
	@echo "== [2/4] torch ($(TORCH) build, pinned by constraints.txt)"
	$(PIP) $(TORCH_SOURCE) torch
	@echo "== [3/4] leantrain and its dev/test extras"
	$(PIP) -e ".[dev]"
	@echo "== [4/4] megatron-core (peer reader for tests, no deps)"
	$(PIP) --no-deps "megatron-core>=0.12"
	$(PY) scripts/check_torch.py --expect $(TORCH)
	touch $@

install: $(VENV)/.installed

demo: install
	$(VENV)/bin/leantrain demo

lint: install
	$(VENV)/bin/ruff check src tests bench

unit: install
	OMP_NUM_THREADS=1 $(PY) -m pytest -q

test: lint unit

bench: install
	@for script in bench/*.py; do echo "== $$script"; $(PY) $$script || exit 1; done

docs: install
	$(PY) -m leantrain.spec.docs > docs/spec.md

clean:
	rm -rf $(VENV) build dist .pytest_cache .ruff_cache demo-out
