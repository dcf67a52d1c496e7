# Set-up and checks. `make demo` and `make test` are the two commands a new user needs.
PYTHON ?= python3
VENV   ?= .venv
PY     := $(VENV)/bin/python
# The CPU build of torch is pinned and installed first: an open range would pull a multi-GB CUDA build.
TORCH_PIN ?= torch==2.13.0

.PHONY: install demo test lint unit bench docs clean

$(VENV)/.installed: pyproject.toml Makefile
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip
	$(PY) -m pip install --quiet "$(TORCH_PIN)"
	$(PY) -m pip install --quiet -e ".[dev]"
	$(PY) -m pip install --quiet --no-deps "megatron-core>=0.12"
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
