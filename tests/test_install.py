"""`make install` keeps the pinned torch: every pip step gets constraints.txt, and the last step checks it."""

from __future__ import annotations

import re
import subprocess
import sys
from importlib import metadata
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def test_every_pip_install_step_gets_the_constraints_file() -> None:
    makefile = (REPO / "Makefile").read_text()
    installs = [line for line in makefile.splitlines() if "pip install" in line and "--upgrade pip" not in line]
    assert installs, "no pip install lines found"
    for line in installs:
        assert "-c constraints.txt" in line or "$(PIP)" in line, line
    assert "PIP := $(PY) -m pip install --progress-bar on -c constraints.txt" in makefile
    assert "--quiet" not in makefile  # the install shows progress
    assert "scripts/check_torch.py" in makefile


def test_installed_torch_is_the_pinned_build() -> None:
    pin = re.search(r"^torch==([\w.]+)", (REPO / "constraints.txt").read_text(), flags=re.M).group(1)
    assert metadata.version("torch").split("+")[0] == pin
    done = subprocess.run([sys.executable, str(REPO / "scripts" / "check_torch.py"), "--expect", "cpu"],
                          capture_output=True, text=True)
    assert done.returncode == 0, done.stderr


def test_torch_check_fails_on_another_version(tmp_path: Path) -> None:
    wrong = tmp_path / "constraints.txt"
    wrong.write_text("torch==1.0.0\n")
    done = subprocess.run([sys.executable, str(REPO / "scripts" / "check_torch.py"), "--constraints", str(wrong)],
                          capture_output=True, text=True)
    assert done.returncode == 1 and "constraints.txt pins 1.0.0" in done.stderr


def test_make_test_writes_bytecode_and_spreads_the_files_over_the_cores() -> None:
    """`make test` / `make test-heavy` run with bytecode writing on (the tests start hundreds of processes, each of
    which would compile torch again under PYTHONDONTWRITEBYTECODE=1), and `make test` over pytest-xdist workers by
    file (module fixtures once), which the test extra installs."""
    import tomllib

    makefile = (REPO / "Makefile").read_text()
    assert "TEST_ENV := env -u PYTHONDONTWRITEBYTECODE OMP_NUM_THREADS=1" in makefile
    assert '$(TEST_ENV) $(PY) -m pytest -m "not heavy" -n $(TEST_WORKERS) --dist loadfile' in makefile
    assert "$(TEST_ENV) $(PY) -m pytest -m heavy" in makefile
    extras = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]["optional-dependencies"]
    assert any(req.startswith("pytest-xdist") for req in extras["test"])


def test_the_demo_writes_the_bytecode_of_what_its_processes_import_once() -> None:
    """`make demo` compiles the modules its ranks import in one process first, with bytecode writing on even where
    PYTHONDONTWRITEBYTECODE=1 is set (else every torchrun agent and rank compiles torch again); each one exists."""
    import importlib.util

    makefile = (REPO / "Makefile").read_text()
    assert "demo: $(VENV)/.demo-bytecode" in makefile
    assert "$(VENV)/.demo-bytecode: $(VENV)/.installed" in makefile
    assert "env -u PYTHONDONTWRITEBYTECODE $(VENV)/bin/leantrain demo" in makefile
    modules = re.search(r"^DEMO_IMPORTS := (.*?)(?<!\\)$", makefile, flags=re.M | re.S).group(1)
    names = modules.replace("\\\n", " ").split()
    assert {"leantrain.train.trainer", "leantrain.ckpt.manager", "torch.distributed.run"} <= set(names)
    for name in names:
        assert importlib.util.find_spec(name) is not None, name
