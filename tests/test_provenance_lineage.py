"""lineage.json per run and per checkpoint, the SQLite run registry, and `leantrain runs`."""

from __future__ import annotations

import hashlib
import json
import re
import subprocess
from pathlib import Path

import pytest
import torch

from leantrain import cli
from leantrain.cli import main
from leantrain.provenance.lineage import read_lineage, spec_sha256, write_checkpoint_lineage, write_lineage
from leantrain.provenance.registry import list_runs, register_checkpoint, register_run, set_run_status
from leantrain.security import AuditLog
from leantrain.spec import load_spec

REPO = Path(__file__).resolve().parents[1]
TINY = REPO / "examples" / "tiny-cpu.yaml"
DIGEST = "sha256:" + "ab" * 32


@pytest.fixture
def data_dir(tmp_path: Path) -> Path:
    root = tmp_path / "data"
    root.mkdir()
    (root / "tokenizer.json").write_text('{"model": "bpe"}')
    manifest = {"tokenizer": {"path": "tokenizer.json", "sha256": "feed" * 16}, "shards": [{"path": "a.bin"}]}
    (root / "manifest.json").write_text(json.dumps(manifest))
    return root


def test_run_lineage_records_code_spec_data_versions_hardware_and_image(
    tmp_path: Path, data_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("LEANTRAIN_IMAGE", f"registry.example/leantrain/train@{DIGEST}")
    spec = load_spec(TINY)
    lineage = write_lineage(tmp_path / "run", spec, data_dir=data_dir, spec_path=TINY)
    assert read_lineage(tmp_path / "run") == lineage
    head = subprocess.run(["git", "-C", str(REPO), "rev-parse", "HEAD"], capture_output=True, text=True)
    if head.returncode == 0:
        assert lineage["code"]["git"]["commit"] == head.stdout.strip()
        assert isinstance(lineage["code"]["git"]["dirty"], bool)
    assert lineage["spec"]["sha256"] == spec_sha256(spec)
    assert spec_sha256(load_spec(TINY, overrides=["training.lr=1e-3"])) != spec_sha256(spec)
    manifest_sha = hashlib.sha256((data_dir / "manifest.json").read_bytes()).hexdigest()
    assert lineage["data"]["manifest_sha256"] == manifest_sha
    assert lineage["data"]["tokenizer_sha256"] == "feed" * 16
    assert lineage["software"]["torch"] == torch.__version__
    assert lineage["software"]["packages"]["num_packages"] > 10
    assert len(lineage["software"]["packages"]["sha256"]) == 64
    assert lineage["hardware"]["num_cpus"] and lineage["hardware"]["spec_accelerator"] == "cpu"
    assert lineage["container"]["image_digest"] == DIGEST
    assert (tmp_path / "run" / "lineage.json").stat().st_mode & 0o077 == 0


def test_resumed_run_keeps_its_id_and_lists_earlier_attempts(tmp_path: Path, data_dir: Path) -> None:
    spec = load_spec(TINY)
    first = write_lineage(tmp_path, spec, data_dir=data_dir)
    second = write_lineage(tmp_path, spec, data_dir=data_dir)
    assert second["run_id"] == first["run_id"] and second["attempt"] == 1
    assert second["previous_attempts"][0]["spec_sha256"] == first["spec"]["sha256"]



@pytest.mark.parametrize("text", ["{", "[1, 2]", '{"attempt": 3}', "\udcff"])
def test_a_garbled_lineage_is_refused_naming_it_and_kept(tmp_path: Path, data_dir: Path, text: str) -> None:
    """A run dir's lineage.json that is not a run's record stops the start with one line naming the file; the
    file (the only record of earlier attempts) is left as it was, not replaced by a fresh run id."""
    from leantrain.errors import UserInputError

    path = tmp_path / "lineage.json"
    path.write_bytes(text.encode("utf-8", "surrogateescape"))
    with pytest.raises(UserInputError, match="lineage.json: not a"):
        write_lineage(tmp_path, load_spec(TINY), data_dir=data_dir)
    assert path.read_bytes() == text.encode("utf-8", "surrogateescape")

def test_registry_and_runs_command_show_what_produced_each_checkpoint(
    tmp_path: Path, data_dir: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(cli.console, "width", 220)  # a wide terminal: table cells are not wrapped
    registry = tmp_path / "reg" / "runs.db"
    run_dir = tmp_path / "run"
    spec = load_spec(TINY, overrides=["run.name=tiny-lineage"])
    lineage = write_lineage(run_dir, spec, data_dir=data_dir)
    run_id = register_run(lineage, registry=registry)
    AuditLog(run_dir / "audit.log").append("command", argv=["leantrain", "train"])
    for step in (20, 40):
        ckpt = run_dir / "checkpoints" / f"step-{step:08d}"
        ckpt.mkdir(parents=True)
        ckpt_lineage = write_checkpoint_lineage(ckpt, run_dir=run_dir, step=step)
        assert ckpt_lineage["checkpoint"]["step"] == step and ckpt_lineage["run_id"] == run_id
        register_checkpoint(ckpt, registry=registry)
    set_run_status(run_id, "finished", registry=registry)
    (row,) = list_runs(registry=registry)
    assert (row["name"], row["status"]) == ("tiny-lineage", "finished")
    assert (row["num_checkpoints"], row["latest_step"]) == (2, 40)
    assert registry.stat().st_mode & 0o077 == 0 and registry.parent.stat().st_mode & 0o077 == 0

    assert main(["runs", "--registry", str(registry)]) == 0
    listing = capsys.readouterr().out
    assert run_id[:6] in listing and "tiny-lineage" in listing and "finished" in listing
    assert main(["runs", str(run_dir)]) == 0
    shown = capsys.readouterr().out
    assert "audit.log: 1 entries, chain intact" in shown
    assert all(f" {step} " in shown for step in (20, 40)) and lineage["spec"]["sha256"][:8] in shown
    assert main(["runs", str(tmp_path / "missing")]) == 2


def test_registry_is_per_project_and_readable_at_80_columns(
    tmp_path: Path, data_dir: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    from leantrain.provenance.registry import default_registry_path

    monkeypatch.delenv("LEANTRAIN_REGISTRY")
    monkeypatch.delenv("LEANTRAIN_HOME", raising=False)
    monkeypatch.setattr(cli.console, "width", 80)
    run_ids = {}
    for project in ("alpha", "beta"):  # two projects' run dirs: each registry lists its own runs only
        run_dir = tmp_path / project / "runs" / "first-try"
        spec = load_spec(TINY, overrides=[f"run.name={project}-run"])
        run_ids[project] = register_run(write_lineage(run_dir, spec, data_dir=data_dir))
        set_run_status(run_ids[project], "finished", run_dir=run_dir)
        assert default_registry_path(run_dir=run_dir) == (tmp_path / project / "runs" / "runs.db").resolve()
    (alpha,) = list_runs(registry=tmp_path / "alpha" / "runs" / "runs.db")
    assert (alpha["run_id"], alpha["status"]) == (run_ids["alpha"], "finished")
    monkeypatch.chdir(tmp_path / "beta")  # `leantrain runs` reads ./runs/runs.db
    assert main(["runs"]) == 0
    listing = capsys.readouterr().out
    assert "beta-run" in listing and "alpha-run" not in listing and "first-try" in listing
    assert max(len(line) for line in listing.splitlines()) <= 80
    assert "beta-run" in next(line for line in listing.splitlines() if "finished" in line)  # not folded away
    assert main(["runs", str(tmp_path / "alpha" / "runs")]) == 0  # a folder of run dirs: its registry
    assert "alpha-run" in capsys.readouterr().out
    monkeypatch.setenv("LEANTRAIN_HOME", str(tmp_path / "home"))
    assert default_registry_path(run_dir=tmp_path / "x" / "run") == tmp_path / "home" / "runs.db"


def test_empty_registry_is_not_an_error(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["runs", "--registry", str(tmp_path / "none.db")]) == 0
    assert "no runs registered yet" in capsys.readouterr().out


def _foreign_database(path: Path) -> bytes:
    """Another program's SQLite file (a table of its own, one row): its bytes."""
    import sqlite3

    conn = sqlite3.connect(path)
    conn.execute("CREATE TABLE notes (body TEXT)")
    conn.execute("INSERT INTO notes VALUES ('keep me')")
    conn.commit()
    conn.close()
    return path.read_bytes()


@pytest.mark.parametrize("kind", ["folder", "not sqlite"])
def test_a_registry_that_is_a_folder_or_not_sqlite_is_exit_2_naming_it(
    tmp_path: Path, data_dir: Path, kind: str, capsys: pytest.CaptureFixture[str]
) -> None:
    """`runs --registry` and a job's run.registry: a folder, or a file that is not SQLite, is one line naming the
    path and what was expected, not a sqlite3 traceback; the file is left as it was."""
    from leantrain.errors import UserInputError

    registry = tmp_path / "runs.db"
    if kind == "folder":
        registry.mkdir()
    else:
        registry.write_text("name,step\nalpha,10\n")
    assert main(["runs", "--registry", str(registry)]) == 2
    err = capsys.readouterr().err
    assert f"--registry {registry}" in err and "Traceback" not in err
    assert ("is a directory" if kind == "folder" else "not a SQLite database") in err
    lineage = write_lineage(tmp_path / "run", load_spec(TINY), data_dir=data_dir)
    with pytest.raises(UserInputError, match=re.escape(f"run.registry {registry}: ") + ".*the run registry's"):
        register_run(lineage, registry=registry)
    assert registry.is_dir() if kind == "folder" else registry.read_text() == "name,step\nalpha,10\n"


def test_another_programs_database_is_refused_and_left_byte_identical(
    tmp_path: Path, data_dir: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """A SQLite file without the registry's tables is not written into: not by the read-only `leantrain runs`
    (which created its tables in it), nor by a run that names it as run.registry."""
    from leantrain.errors import UserInputError

    other = tmp_path / "other.db"
    before = _foreign_database(other)
    assert main(["runs", "--registry", str(other)]) == 2
    err = capsys.readouterr().err
    assert f"--registry {other}" in err and "holds no leantrain run registry" in err and "notes" in err
    assert other.read_bytes() == before
    lineage = write_lineage(tmp_path / "run", load_spec(TINY), data_dir=data_dir)
    with pytest.raises(UserInputError, match="holds no leantrain run registry"):
        register_run(lineage, registry=other)
    assert other.read_bytes() == before


def test_runs_only_reads_and_a_run_creates_its_registry(
    tmp_path: Path, data_dir: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """`leantrain runs` never creates or changes a registry (a missing one is reported, an empty file is listed
    as is); training creates one at a new path, or fills an empty file."""
    missing, empty = tmp_path / "none" / "runs.db", tmp_path / "empty.db"
    empty.touch()
    assert main(["runs", "--registry", str(missing)]) == 0
    assert "no runs registered yet" in capsys.readouterr().out and not missing.parent.exists()
    assert list_runs(registry=missing) == [] and not missing.parent.exists()
    assert main(["runs", "--registry", str(empty)]) == 0
    assert empty.read_bytes() == b""
    lineage = write_lineage(tmp_path / "run", load_spec(TINY), data_dir=data_dir)
    for registry in (missing, empty):
        register_run(lineage, registry=registry)
        assert [row["run_id"] for row in list_runs(registry=registry)] == [lineage["run_id"]]


@pytest.mark.parametrize("text", ['{"format": "leantrain-data", "shards": [{"pa', "[1, 2]", '{"tokenizer": "x"}'])
def test_lineage_hashes_a_manifest_it_cannot_parse(tmp_path: Path, data_dir: Path, text: str) -> None:
    """A truncated or foreign manifest.json is still identified by its hash (the trainer refuses it, naming it,
    when it opens the data); the lineage is written, not a traceback."""
    (data_dir / "manifest.json").write_text(text)
    lineage = write_lineage(tmp_path / "run", load_spec(TINY), data_dir=data_dir)
    assert lineage["data"]["manifest_sha256"] == hashlib.sha256(text.encode()).hexdigest()
    assert lineage["data"]["tokenizer_sha256"] == hashlib.sha256(b'{"model": "bpe"}').hexdigest()
    assert lineage["data"]["num_shards"] is None


def test_a_registry_a_run_cannot_use_is_refused_before_the_run_dir_is_written(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """train wrote spec.yaml, plan.json and lineage.json (attempt 0) before the registry refused, and under
    `launch` every restart of every rank failed on it; now train's rank 0 and the launcher check it first."""
    from leantrain.errors import UserInputError
    from leantrain.train.run_setup import prepare_run

    registry = tmp_path / "runs.db"
    registry.mkdir()
    spec = load_spec(TINY, overrides=[f"run.registry={registry}"])
    with pytest.raises(UserInputError, match=re.escape(f"run.registry {registry}: is a directory")):
        prepare_run(spec, run_dir=tmp_path / "run", rank=0, console=None)
    assert not (tmp_path / "run").exists()
    assert main(["launch", str(TINY), "--nproc", "2", "--set", f"run.registry={registry}",
                 "--run-dir", str(tmp_path / "run")]) == 2
    assert "is a directory" in capsys.readouterr().err
    assert not (tmp_path / "run").exists()


def test_a_registry_left_mid_write_is_recovered_not_a_traceback(tmp_path: Path) -> None:
    """A writer killed mid-transaction leaves a hot journal that only a read-write connection rolls back: the
    read-only checks (every train start, `leantrain runs`) raised 'attempt to write a readonly database' and no
    run could start until someone opened the file read-write by hand."""
    import os
    import sys

    from leantrain.provenance.registry import check_registry, connect, list_runs

    registry = tmp_path / "runs.db"
    with connect(registry) as conn:
        conn.execute("INSERT INTO runs (run_id, run_dir, created_at, updated_at, status, attempt) "
                     "VALUES ('a', 'x', 1, 1, 'running', 0)")
    writer = (f"import os, sqlite3\nc = sqlite3.connect({str(registry)!r})\nc.execute('PRAGMA cache_size=1')\n"
              "c.execute('BEGIN')\nfor i in range(20000):\n    c.execute(\"INSERT INTO runs (run_id, run_dir, "
              "created_at, updated_at, status, attempt) VALUES (?, ?, 1, 1, 'running', 0)\", (str(i), 'y' * 200))\n"
              "os.kill(os.getpid(), 9)\n")
    subprocess.run([sys.executable, "-c", writer], check=False)
    assert (tmp_path / "runs.db-journal").exists()  # the killed writer's hot journal
    check_registry(registry)
    assert [r["run_id"] for r in list_runs(registry=registry)] == ["a"]  # the last committed content
    assert not (tmp_path / "runs.db-journal").exists() and os.path.getsize(registry) > 0


@pytest.mark.parametrize("lock", ["IMMEDIATE", "EXCLUSIVE"])
def test_a_registry_locked_by_another_process_is_said_so_exit_1_not_a_traceback(
    tmp_path: Path, data_dir: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str], lock: str
) -> None:
    """Another process holding the registry's lock past the timeout (a run registering on a slow shared file
    system, a lock a dead host left) made a starting run's registration a sqlite3 traceback (a write lock) and
    `runs` say "cannot be read" (exit 2, an input error). Both now say it is locked, to try again: exit 1."""
    import sqlite3

    from leantrain.provenance import registry as reg

    db = tmp_path / "reg" / "runs.db"
    lineage = write_lineage(tmp_path / "run", load_spec(TINY), data_dir=data_dir)
    run_id = register_run(lineage, registry=db)
    monkeypatch.setattr(reg, "LOCK_TIMEOUT_S", 0.1)
    holder = sqlite3.connect(db, isolation_level=None)
    holder.execute(f"BEGIN {lock}")
    try:
        for call in (lambda: register_run(lineage, registry=db), lambda: set_run_status(run_id, "x", registry=db)):
            with pytest.raises(reg.RegistryBusy, match=re.escape(f"run.registry {db}: locked by another process")):
                call()
        if lock == "EXCLUSIVE":  # a write lock still lets readers in
            assert main(["runs", "--registry", str(db)]) == 1
            err = capsys.readouterr().err
            assert f"--registry {db}: locked by another process" in err and "Traceback" not in err
    finally:
        holder.execute("ROLLBACK")
        holder.close()
    set_run_status(run_id, "finished", registry=db)
    assert [r["status"] for r in list_runs(registry=db)] == ["finished"]
