"""The run registry: a small SQLite index of runs and their checkpoints, and the `leantrain runs` command.

The run dir's lineage.json files are the source of truth; the registry indexes them so `leantrain runs` can
list every run on a machine or shared file system without walking folders. Rank 0 calls `register_run` when
training starts (after `write_lineage`), `register_checkpoint` after each commit, and `set_run_status` at the
end. The database is per project, not per user: `run.registry`, else $LEANTRAIN_REGISTRY, else
$LEANTRAIN_HOME/runs.db, else `runs.db` next to the run dirs (the run dir's parent: runs/run → runs/runs.db;
owner-only). `leantrain runs DIR` lists DIR/runs.db (`leantrain runs` alone: ./runs/runs.db, the default
run.dir's parent); `leantrain runs RUN_DIR` shows one run. `leantrain runs` only reads: it never creates or
changes a registry. A path that is a directory, a file that is not SQLite or another program's database is
refused (exit 2) and left as it is; one another process keeps locked past LOCK_TIMEOUT_S is `RegistryBusy` (exit 1).
"""

from __future__ import annotations

import contextlib
import json
import os
import sqlite3
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from rich import box
from rich.console import Console
from rich.table import Table

from leantrain.errors import LeantrainError, UserInputError, check_output_file
from leantrain.provenance.lineage import LINEAGE_FILE_NAME, read_lineage, sha256_file
from leantrain.security import AuditLog, make_private_dir

SCHEMA = """
CREATE TABLE IF NOT EXISTS runs (
    run_id TEXT PRIMARY KEY,
    name TEXT,
    run_dir TEXT NOT NULL,
    created_at REAL NOT NULL,
    updated_at REAL NOT NULL,
    status TEXT NOT NULL,
    attempt INTEGER NOT NULL,
    spec_sha256 TEXT,
    git_commit TEXT,
    git_dirty INTEGER,
    data_manifest_sha256 TEXT,
    packages_sha256 TEXT,
    image_digest TEXT,
    hostname TEXT
);
CREATE TABLE IF NOT EXISTS checkpoints (
    run_id TEXT NOT NULL REFERENCES runs(run_id),
    step INTEGER NOT NULL,
    path TEXT NOT NULL,
    saved_at REAL NOT NULL,
    lineage_sha256 TEXT,
    attempt INTEGER,
    spec_sha256 TEXT,
    git_commit TEXT,
    git_dirty INTEGER,
    data_manifest_sha256 TEXT,
    packages_sha256 TEXT,
    PRIMARY KEY (run_id, step)
);
"""


REGISTRY_NAME = "runs.db"
DEFAULT_RUNS_ROOT = Path("runs")  # the parent of the spec's default run.dir (runs/run)
LOCK_TIMEOUT_S = 30.0  # how long a connection waits for another process's lock on the registry


class RegistryBusy(LeantrainError):
    """The registry stayed locked by another process past LOCK_TIMEOUT_S: try again (exit 1, not an input error)."""

    exit_code = 1


def default_registry_path(configured: Path | None = None, *, run_dir: Path | str | None = None) -> Path:
    """Where the registry is: configured, $LEANTRAIN_REGISTRY, $LEANTRAIN_HOME/runs.db, or next to the run dir."""
    if configured is not None:
        return Path(configured).expanduser()
    if env := os.environ.get("LEANTRAIN_REGISTRY"):
        return Path(env).expanduser()
    if home := os.environ.get("LEANTRAIN_HOME"):
        return Path(home).expanduser() / REGISTRY_NAME
    root = Path(run_dir).expanduser().resolve().parent if run_dir is not None else DEFAULT_RUNS_ROOT
    return root / REGISTRY_NAME


def _registry_field(configured: Path | None) -> str:
    """What set the registry's path, for an error message."""
    if configured is not None:
        return "run.registry"
    if os.environ.get("LEANTRAIN_REGISTRY"):
        return "$LEANTRAIN_REGISTRY"
    if os.environ.get("LEANTRAIN_HOME"):
        return "$LEANTRAIN_HOME"
    return "run registry"


def _open(db_path: Path, *, read_only: bool, where: str) -> sqlite3.Connection:
    """A connection to the registry file; `read_only` never changes the file (not even its schema)."""
    try:
        if read_only:
            return sqlite3.connect(db_path.resolve().as_uri() + "?mode=ro", uri=True, timeout=LOCK_TIMEOUT_S)
        return sqlite3.connect(db_path, timeout=LOCK_TIMEOUT_S)
    except sqlite3.OperationalError as err:
        raise UserInputError(f"{where}: cannot open it as a SQLite database ({err})") from None


def _holds_registry(conn: sqlite3.Connection, *, where: str, read_only: bool) -> bool:
    """True when the database has the registry's tables, False when it has no table at all (a new registry);
    anything else (not SQLite, another program's database) is refused, and the file is left as it is."""
    valid = f"give the run registry's file ({REGISTRY_NAME})" + ("" if read_only else
                                                                  ", or a path that does not exist yet for a new one")
    try:
        tables = {row[0] for row in conn.execute("SELECT name FROM sqlite_master WHERE type = 'table'")}
    except sqlite3.DatabaseError as err:
        code = getattr(err, "sqlite_errorcode", 0) & 0xFF
        if code == sqlite3.SQLITE_READONLY:  # a hot journal: the caller recovers it on a read-write connection
            raise
        if code in (sqlite3.SQLITE_NOTADB, sqlite3.SQLITE_CORRUPT):
            raise UserInputError(f"{where}: not a SQLite database ({err}); {valid}") from None
        raise _registry_error(err, where=where) from None
    if not tables:
        return False
    if {"runs", "checkpoints"} <= tables:
        return True
    raise UserInputError(f"{where}: a SQLite database that holds no leantrain run registry (its tables: "
                         f"{', '.join(sorted(tables))}); it was left unchanged: {valid}")


def _registry_error(err: sqlite3.Error, *, where: str) -> LeantrainError:
    """A SQLite error of the registry as what it means: locked past the timeout (try again), read-only, or
    unreadable; each names the registry file and what set it."""
    code = getattr(err, "sqlite_errorcode", 0) & 0xFF
    if code in (sqlite3.SQLITE_BUSY, sqlite3.SQLITE_LOCKED):
        return RegistryBusy(f"{where}: locked by another process for {LOCK_TIMEOUT_S:.0f} s (a run registering or "
                            "`leantrain runs` reading it; on a network file system a dead host can leave a lock): "
                            "try again, or point it at a file on a local disk")
    if code == sqlite3.SQLITE_READONLY or isinstance(err, sqlite3.OperationalError) and "readonly" in str(err):
        return UserInputError(f"{where}: cannot be written ({err}): give a registry this user can write")
    return UserInputError(f"{where}: cannot be read ({err})")


@contextlib.contextmanager
def connect(
    path: Path | None = None, *, run_dir: Path | str | None = None, read_only: bool = False, field: str | None = None
) -> Iterator[sqlite3.Connection]:
    """Open the registry; commits on success. Writable (training): created owner-only when absent, its tables
    added to an empty database. `read_only` (`leantrain runs`): an existing file, never changed. A directory, a
    file that is not SQLite or another program's database is refused naming the path and `field` (what set it)."""
    db_path = default_registry_path(path, run_dir=run_dir)
    field = field or _registry_field(path)
    where = f"{field} {db_path}"
    if db_path.is_dir():
        raise UserInputError(f"{where}: is a directory; expected the run registry's SQLite file, e.g. "
                             f"{db_path / REGISTRY_NAME}")
    if not read_only:
        check_output_file(db_path, field)  # a path under a file
        if not db_path.parent.exists():
            make_private_dir(db_path.parent)
    created = not db_path.exists()
    conn = _open(db_path, read_only=read_only, where=where)
    try:
        if created:
            os.chmod(db_path, 0o600)
        conn.row_factory = sqlite3.Row
        try:
            holds = _holds_registry(conn, where=where, read_only=read_only)
        except sqlite3.OperationalError:
            # A writer killed mid-transaction left a hot journal, which SQLite rolls back on the next read-write
            # connection only (a read-only one fails, every start and every `runs` would): its own recovery, to
            # the last committed content, and nothing else is written. (Read-write already: a real error.)
            if not read_only:
                raise UserInputError(f"{where}: cannot be read (a journal that SQLite cannot roll back)") from None
            conn.close()
            conn = _open(db_path, read_only=False, where=where)
            conn.row_factory = sqlite3.Row
            holds = _holds_registry(conn, where=where, read_only=read_only)
        if not holds:
            # An empty database: a new registry gets its tables in one transaction (a run starting beside this
            # one never sees one table without the other); read-only, empty in-memory ones stand in.
            conn.executescript(SCHEMA.replace("CREATE TABLE", "CREATE TEMP TABLE") if read_only
                               else f"BEGIN IMMEDIATE;{SCHEMA}COMMIT;")
        yield conn
        conn.commit()
    except sqlite3.OperationalError as err:  # the caller's statements or the commit: locked, read-only
        raise _registry_error(err, where=where) from None
    finally:
        conn.close()


def _summary(lineage: dict[str, Any]) -> dict[str, Any]:
    git = lineage.get("code", {}).get("git") or {}
    return {
        "spec_sha256": lineage.get("spec", {}).get("sha256"),
        "git_commit": git.get("commit"),
        "git_dirty": None if not git else int(bool(git.get("dirty"))),
        "data_manifest_sha256": lineage.get("data", {}).get("manifest_sha256"),
        "packages_sha256": lineage.get("software", {}).get("packages", {}).get("sha256"),
    }


def check_registry(path: Path | None = None, *, run_dir: Path | str | None = None) -> None:
    """Refuse, before a run writes anything, a registry it could not record itself in (a directory, a path under a
    file, a file that is not SQLite, another program's database); reads only, creates nothing."""
    db_path = default_registry_path(path, run_dir=run_dir)
    if db_path.exists():  # connect's own checks: a directory, not SQLite, another program's database
        with connect(path, run_dir=run_dir, read_only=True):
            pass
    else:
        check_output_file(db_path, _registry_field(path))


def register_run(lineage: dict[str, Any], *, registry: Path | None = None, status: str = "running") -> str:
    """Insert or update a run from its lineage (as `write_lineage` returns it); returns the run_id."""
    now = time.time()
    row = {
        "run_id": lineage["run_id"],
        "name": lineage.get("run", {}).get("name"),
        "run_dir": lineage.get("run", {}).get("dir"),
        "created_at": lineage.get("created_at", now),
        "updated_at": now,
        "status": status,
        "attempt": lineage.get("attempt", 0),
        "image_digest": lineage.get("container", {}).get("image_digest"),
        "hostname": lineage.get("hardware", {}).get("hostname"),
        **_summary(lineage),
    }
    with connect(registry, run_dir=row["run_dir"]) as conn:
        existing = conn.execute("SELECT created_at FROM runs WHERE run_id = ?", (row["run_id"],)).fetchone()
        if existing:
            row["created_at"] = existing["created_at"]
        columns = ", ".join(row)
        conn.execute(f"INSERT OR REPLACE INTO runs ({columns}) VALUES ({', '.join('?' * len(row))})",
                     tuple(row.values()))
    return str(row["run_id"])


def register_checkpoint(
    checkpoint_dir: Path, *, registry: Path | None = None, lineage: dict[str, Any] | None = None
) -> int:
    """Index a committed checkpoint from its lineage.json (as `write_checkpoint_lineage` or the checkpoint
    manager wrote it). `lineage`: its content, for a checkpoint whose stored file is encrypted (the checkpoint
    manager passes what it wrote); `lineage_sha256` is always the hash of the file as stored."""
    if lineage is None:
        lineage = read_lineage(checkpoint_dir)
    if lineage is None or "checkpoint" not in lineage or not (Path(checkpoint_dir) / LINEAGE_FILE_NAME).is_file():
        raise UserInputError(f"{Path(checkpoint_dir) / LINEAGE_FILE_NAME} is missing or is not a checkpoint lineage")
    step = int(lineage["checkpoint"]["step"])
    row = {
        "run_id": lineage["run_id"],
        "step": step,
        "path": str(Path(checkpoint_dir).resolve()),
        "saved_at": lineage["checkpoint"].get("saved_at", time.time()),
        "lineage_sha256": sha256_file(Path(checkpoint_dir) / LINEAGE_FILE_NAME),
        "attempt": lineage.get("attempt", 0),
        **_summary(lineage),
    }
    run_dir = lineage.get("run", {}).get("dir") or Path(checkpoint_dir).resolve().parent.parent
    with connect(registry, run_dir=run_dir) as conn:
        conn.execute(f"INSERT OR REPLACE INTO checkpoints ({', '.join(row)}) VALUES ({', '.join('?' * len(row))})",
                     tuple(row.values()))
    return step


def set_run_status(
    run_id: str, status: str, *, registry: Path | None = None, run_dir: Path | str | None = None
) -> None:
    """Mark a run finished / failed / preempted."""
    with connect(registry, run_dir=run_dir) as conn:
        conn.execute("UPDATE runs SET status = ?, updated_at = ? WHERE run_id = ?", (status, time.time(), run_id))


def list_runs(*, registry: Path | None = None, field: str | None = None) -> list[dict[str, Any]]:
    """Every registered run, newest first, with its checkpoint count and latest step. Reads only: a registry
    that does not exist lists nothing and is not created (`field`: what named the registry, for errors)."""
    if not default_registry_path(registry).exists():
        return []
    with connect(registry, read_only=True, field=field) as conn:
        rows = conn.execute(
            "SELECT r.*, COUNT(c.step) AS num_checkpoints, MAX(c.step) AS latest_step FROM runs r "
            "LEFT JOIN checkpoints c ON c.run_id = r.run_id GROUP BY r.run_id ORDER BY r.created_at DESC"
        ).fetchall()
    return [dict(r) for r in rows]


def _registered_lineage(path: Path, registry: Path | None, field: str | None) -> dict[str, Any]:
    """A checkpoint's registry row shaped like its lineage (for an encrypted lineage.json); {} when absent."""
    db_path = default_registry_path(registry, run_dir=path.parent.parent.parent)  # RUN/checkpoints/step-N/file
    if not db_path.exists():
        return {}
    with connect(db_path, read_only=True, field=field or _registry_field(registry)) as conn:
        row = conn.execute("SELECT * FROM checkpoints WHERE path = ?", (str(path.parent.resolve()),)).fetchone()
    if row is None:
        return {}
    return {"attempt": row["attempt"], "checkpoint": {"step": row["step"], "saved_at": row["saved_at"]},
            "code": {"git": {"commit": row["git_commit"], "dirty": row["git_dirty"]}} if row["git_commit"] else {},
            "spec": {"sha256": row["spec_sha256"]}, "data": {"manifest_sha256": row["data_manifest_sha256"]},
            "software": {"packages": {"sha256": row["packages_sha256"]}}}


def checkpoint_lineages(
    run_dir: Path, *, registry: Path | None = None, field: str | None = None
) -> list[dict[str, Any]]:
    """What produced each checkpoint of a run, read from the checkpoints' own lineage.json files (from the
    registry when a file is encrypted; `field`: what named it, for errors). Only published `step-N` folders."""
    rows = []
    for path in sorted((Path(run_dir) / "checkpoints").glob("step-" + "[0-9]" * 8 + "/" + LINEAGE_FILE_NAME)):
        try:
            lineage = json.loads(path.read_text(encoding="utf-8"))
        except (UnicodeDecodeError, json.JSONDecodeError):  # encrypted with the checkpoint
            lineage = _registered_lineage(path, registry, field)
            lineage.setdefault("checkpoint", {}).setdefault("step", int(path.parent.name.removeprefix("step-")))
        rows.append({
            "step": lineage.get("checkpoint", {}).get("step"),
            "path": str(path.parent),
            "attempt": lineage.get("attempt"),
            "saved_at": lineage.get("checkpoint", {}).get("saved_at"),
            "image_digest": lineage.get("container", {}).get("image_digest"),
            "torch": lineage.get("software", {}).get("torch"),
            **_summary(lineage),
        })
    return sorted(rows, key=lambda r: r["step"] if r["step"] is not None else -1)


def _short(value: Any, n: int = 8) -> str:
    return "-" if value is None else str(value)[:n]


def _when(ts: float | None) -> str:
    return "-" if ts is None else time.strftime("%m-%d %H:%M", time.localtime(ts))


def _git_cell(commit: str | None, dirty: int | None, *, short: bool = False) -> str:
    if commit is None:
        return "-"
    return _short(commit, 7) + ("*" if dirty else "") if short else _short(commit, 8) + ("+dirty" if dirty else "")


def _show_runs(console: Console, registry: Path | None, *, field: str) -> None:
    db_path = default_registry_path(registry)
    if not db_path.exists():
        console.print(f"no runs registered yet ({db_path} does not exist)")
        return
    runs = list_runs(registry=db_path, field=field)
    # Fits 80 columns: a short id, the dir relative to the registry's folder, attempts beside the status.
    table = Table(title=f"runs in {db_path} (* uncommitted changes, ×N attempts)", title_justify="left",
                  box=box.SIMPLE_HEAD, pad_edge=False)
    for column, wrap in (("run", False), ("status", False), ("created", False), ("step", False), ("ckpts", False),
                         ("git", False), ("dir", True)):
        table.add_column(column, no_wrap=not wrap, overflow="fold")
    for r in runs:
        label = f"{r['name']} {_short(r['run_id'], 6)}" if r["name"] else _short(r["run_id"], 12)
        tries = f" ×{r['attempt'] + 1}" if r["attempt"] else ""
        table.add_row(label, r["status"] + tries, _when(r["created_at"]), _short(r["latest_step"]),
                      str(r["num_checkpoints"]), _git_cell(r["git_commit"], r["git_dirty"], short=True),
                      _relative(r["run_dir"], db_path.parent))
    console.print(table)


def _relative(run_dir: str | None, root: Path) -> str:
    if not run_dir:
        return "-"
    try:
        return str(Path(run_dir).resolve().relative_to(root.resolve()))
    except ValueError:
        return run_dir


def _show_run(console: Console, run_dir: Path, *, registry: Path | None, field: str) -> None:
    lineage = read_lineage(run_dir)
    if lineage is None:
        raise UserInputError(f"{run_dir} has no {LINEAGE_FILE_NAME}: not a run dir written by train/launch")
    summary = _summary(lineage)
    console.print(
        f"run {lineage['run_id']} ({lineage.get('run', {}).get('name') or 'unnamed'}), attempt "
        f"{lineage.get('attempt', 0) + 1}: git {_git_cell(summary['git_commit'], summary['git_dirty'])}, "
        f"spec {_short(summary['spec_sha256'])}, data {_short(summary['data_manifest_sha256'])}, "
        f"torch {lineage.get('software', {}).get('torch')}, "
        f"image {lineage.get('container', {}).get('image_digest') or '-'}"
    )
    audit = AuditLog(Path(run_dir) / "audit.log").verify()
    state = "intact" if audit.ok else f"BROKEN at line {audit.bad_line}: {audit.reason}"
    console.print(f"audit.log: {audit.num_entries} entries, chain {state}")
    table = Table(title="checkpoints and what produced them")
    for column in ("step", "saved", "try", "git", "spec", "data", "packages", "torch", "image"):
        table.add_column(column, overflow="fold")
    for row in checkpoint_lineages(run_dir, registry=registry, field=field):
        table.add_row(str(row["step"]), _when(row["saved_at"]), str((row["attempt"] or 0) + 1),
                      _git_cell(row["git_commit"], row["git_dirty"]), _short(row["spec_sha256"]),
                      _short(row["data_manifest_sha256"]), _short(row["packages_sha256"]), row["torch"] or "-",
                      _short(row["image_digest"], 15))
    console.print(table)


def run(*, console: Console, run_dir: Path | None, registry: Path | None) -> None:
    """`leantrain runs [DIR]`: list the runs registered in DIR/runs.db (a folder of run dirs; default ./runs),
    or, for a run dir, show its checkpoints and their lineage."""
    if run_dir is not None and not Path(run_dir).is_dir():
        raise UserInputError(f"run dir {run_dir} does not exist")
    field = "--registry" if registry is not None else _registry_field(None)
    if run_dir is None:
        _show_runs(console, registry, field=field)
    elif registry is None and read_lineage(Path(run_dir)) is None and (Path(run_dir) / REGISTRY_NAME).is_file():
        _show_runs(console, Path(run_dir) / REGISTRY_NAME, field="run registry")
    else:
        _show_run(console, Path(run_dir), registry=registry, field=field)
