"""The README's commands, run as written, in order, on a scratch copy of the repository's examples and scripts
with `.venv` pointing at this interpreter's venv — the way a new user types them after `make demo`: every
command succeeds, or (validate, drill: checks) exits 1 saying what failed, and nothing is written outside
`demo-out/`."""

from __future__ import annotations

import os
import re
import shlex
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PREFIX = ".venv/bin/"
CHECKS = {"validate", "drill"}  # exit 1 is their verdict, not a crash
SKIPPED = {"demo"}  # `make demo` / test_cli.py run the whole demo; here it would redo every stage


def table_commands(readme: str) -> list[tuple[list[str], list[str]]]:
    """(prerequisite, command) per row of the command table: the row's first `.venv/bin/leantrain ...` code
    span, and a `(after `...`)` command the row names."""
    section = readme.split("## The chain, one example per command", 1)[1].split("\n## ", 1)[0]
    rows = []
    for line in section.splitlines():
        if not line.startswith("| `"):
            continue
        spans = [s.replace("\\|", "|") for s in re.findall(r"`([^`]+)`", line)]
        if spans[0] == "command":
            continue
        command = shlex.split(spans[0])
        after = re.search(r"\(after `([^`]+)`", line.replace("\\|", "|"))
        rows.append((shlex.split(after.group(1)) if after else [], command))
    return rows


def block_commands(readme: str) -> list[list[str]]:
    """The commands of the ```bash blocks after the table (the fine-tuning jobs), comments dropped."""
    section = readme.split("## The chain, one example per command", 1)[1].split("\n## The job spec", 1)[0]
    commands = []
    for block in re.findall(r"```bash\n(.*?)```", section, flags=re.S):
        for line in block.splitlines():
            words = shlex.split(line, comments=True)
            if words:
                commands.append(words)
    return commands


def every_command(readme: str) -> list[list[str]]:
    """Prerequisites and commands in README order (a prerequisite once)."""
    ordered: list[list[str]] = []
    for prerequisite, command in table_commands(readme):
        if prerequisite and prerequisite not in ordered:
            ordered.append(prerequisite)
        ordered.append(command)
    return ordered + [c for c in block_commands(readme) if c not in ordered]


def test_every_command_goes_through_the_venv_and_writes_under_demo_out() -> None:
    readme = (ROOT / "README.md").read_text(encoding="utf-8")
    commands = every_command(readme)
    names = [command[1] for _, command in table_commands(readme)]
    assert names[:4] == ["check", "plan", "prepare", "train"] and "validate" in names and "demo" in names
    assert any(c[:2] == [f"{PREFIX}python", "scripts/tiny_hf_jobs.py"] for c in commands)
    for words in commands:  # `leantrain` is not on PATH after `make demo`: every command names the venv
        assert words[0] in (f"{PREFIX}leantrain", f"{PREFIX}python"), words
        for flag in ("--json", "--out", "--plot", "--run-dir"):  # outputs go under demo-out/ (ignored by git)
            if flag in words:
                assert words[words.index(flag) + 1].startswith("demo-out/"), words
    assert "demo-out/" in (ROOT / ".gitignore").read_text().split()


def _files(folder: Path) -> set[str]:
    return {str(p.relative_to(folder)) for p in folder.rglob("*") if "__pycache__" not in p.parts}


@pytest.mark.heavy
@pytest.mark.slow
def test_readme_commands_run_as_written(tmp_path: Path) -> None:
    work = tmp_path / "repo"
    work.mkdir()
    for folder in ("examples", "scripts"):
        subprocess.run(["cp", "-r", str(ROOT / folder), str(work / folder)], check=True)
    (work / ".venv").symlink_to(Path(sys.prefix))  # `make demo`'s venv
    before = {folder: _files(work / folder) for folder in ("examples", "scripts")}
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    env["PATH"] = os.pathsep.join(p for p in env.get("PATH", "").split(os.pathsep)
                                  if not (Path(p) / "leantrain").exists())  # as after `make demo`: not on PATH
    for name in ("LEANTRAIN_REGISTRY", "LEANTRAIN_HOME", "VIRTUAL_ENV"):  # the default: a registry next to the runs
        env.pop(name, None)
    for words in every_command((ROOT / "README.md").read_text(encoding="utf-8")):
        if words[1] in SKIPPED:
            continue
        result = subprocess.run(words, cwd=work, env=env, capture_output=True, text=True, timeout=900)
        output = result.stdout + result.stderr
        shown = shlex.join(words)
        assert "Traceback" not in output, f"{shown}:\n{output[-3000:]}"
        allowed = {0, 1} if words[1] in CHECKS else {0}
        assert result.returncode in allowed, f"{shown} exited {result.returncode}:\n{output[-3000:]}"
        if result.returncode == 1:
            assert "failed:" in output, f"{shown} exited 1 without saying why:\n{output[-3000:]}"
        if words[1:] == ["runs", "demo-out"]:
            assert "run-200" in output and "finished" in output, output  # the project's registry lists it
    assert (work / "demo-out" / "run" / "report.html").is_file() and (work / "demo-out" / "rules.yml").is_file()
    assert sorted(p.name for p in work.iterdir()) == [".venv", "demo-out", "examples", "scripts"]
    assert {folder: _files(work / folder) for folder in before} == before  # the checkout is left as it was
