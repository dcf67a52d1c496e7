"""The README's command table, run in order on a scratch copy of the repository's examples and scripts, the
way a new user would: every command succeeds, or (validate, drill: checks) exits 1 saying what failed."""

from __future__ import annotations

import os
import re
import shlex
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
CHECKS = {"validate", "drill"}  # exit 1 is their verdict, not a crash
SKIPPED = {"demo"}  # `make demo` / test_cli.py run the whole demo; here it would redo every stage


def table_commands(readme: str) -> list[tuple[list[str], list[str]]]:
    """(prerequisite, command) per row of the command table: the row's first `leantrain ...` code span, and a
    `(after `...`)` command the row names."""
    section = readme.split("## The chain, one example per command", 1)[1].split("\n## ", 1)[0]
    rows = []
    for line in section.splitlines():
        if not line.startswith("| `leantrain "):
            continue
        spans = [s.replace("\\|", "|") for s in re.findall(r"`([^`]+)`", line)]
        command = shlex.split(spans[0])
        after = re.search(r"\(after `([^`]+)`", line.replace("\\|", "|"))
        rows.append((shlex.split(after.group(1)) if after else [], command))
    return rows


def test_table_parser_reads_every_row() -> None:
    rows = table_commands((ROOT / "README.md").read_text(encoding="utf-8"))
    names = [command[1] for _, command in rows]
    assert names[:4] == ["check", "plan", "prepare", "train"] and "validate" in names and "demo" in names
    assert any(pre[:2] == ["python", "scripts/tiny_hf_jobs.py"] for pre, _ in rows)


@pytest.mark.slow
def test_readme_command_table_runs_in_order(tmp_path: Path) -> None:
    work = tmp_path / "repo"
    for folder in ("examples", "scripts"):
        shutil.copytree(ROOT / folder, work / folder)
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    for name in ("LEANTRAIN_REGISTRY", "LEANTRAIN_HOME"):  # the default: a registry next to the run dirs
        env.pop(name, None)
    leantrain = [sys.executable, "-m", "leantrain.cli"]
    done: set[str] = set()
    for prerequisite, command in table_commands((ROOT / "README.md").read_text(encoding="utf-8")):
        if command[1] in SKIPPED:
            continue
        steps = [prerequisite] if prerequisite and " ".join(prerequisite) not in done else []
        for words in [*steps, command]:
            argv = [sys.executable, *words[1:]] if words[0] == "python" else [*leantrain, *words[1:]]
            result = subprocess.run(argv, cwd=work, env=env, capture_output=True, text=True, timeout=600)
            output = result.stdout + result.stderr
            assert "Traceback" not in output, f"{' '.join(words)}:\n{output[-3000:]}"
            allowed = {0, 1} if words[0] == "leantrain" and words[1] in CHECKS else {0}
            assert result.returncode in allowed, f"{' '.join(words)} exited {result.returncode}:\n{output[-3000:]}"
            if result.returncode == 1:
                assert "failed:" in output, f"{' '.join(words)} exited 1 without saying why:\n{output[-3000:]}"
            done.add(" ".join(words))
            if words[:2] == ["leantrain", "runs"] and len(words) == 3 and words[2] == "demo-out":
                assert "run-200" in output and "finished" in output, output  # the project's registry lists it
    assert (work / "demo-out" / "run" / "report.html").is_file() and (work / "rules.yml").is_file()
