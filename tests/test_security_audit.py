"""The audit log's hash chain detects an edited, deleted or reordered line; owner-only permissions."""

from __future__ import annotations

import json
import os
import threading
from pathlib import Path

import pytest

from leantrain.errors import UserInputError
from leantrain.security import (
    AuditLog,
    make_private_dir,
    permission_problems,
    restrict_tree,
    write_private_text,
)


def _log_with_events(path: Path) -> AuditLog:
    log = AuditLog(path)
    log.append("command", argv=["leantrain", "train", "spec.yaml"])
    log.append("checkpoint.save", step=100, path="checkpoints/step-00000100")
    log.append("checkpoint.load", step=100)
    log.append("checkpoint.delete", step=100, reason="retention")
    return log


def test_intact_chain_verifies(tmp_path: Path) -> None:
    log = _log_with_events(tmp_path / "audit.log")
    result = log.verify()
    assert result.ok and result.num_entries == 4 and result.last_hash == log.entries()[-1]["hash"]
    assert [e["seq"] for e in log.entries()] == [0, 1, 2, 3]
    assert (tmp_path / "audit.log").stat().st_mode & 0o077 == 0


def test_an_edited_line_is_detected_at_that_line(tmp_path: Path) -> None:
    log = _log_with_events(tmp_path / "audit.log")
    lines = log.path.read_text().splitlines()
    entry = json.loads(lines[1])
    entry["fields"]["step"] = 90  # still valid JSON, still has its old hash
    lines[1] = json.dumps(entry, sort_keys=True)
    log.path.write_text("\n".join(lines) + "\n")
    result = log.verify()
    assert not result.ok and result.bad_line == 2 and "edited" in result.reason


def test_a_deleted_or_reordered_line_breaks_the_chain(tmp_path: Path) -> None:
    log = _log_with_events(tmp_path / "audit.log")
    lines = log.path.read_text().splitlines()
    log.path.write_text("\n".join([lines[0], lines[2], lines[3]]) + "\n")
    deleted = log.verify()
    assert not deleted.ok and deleted.bad_line == 2 and "chain broken" in deleted.reason
    log.path.write_text("\n".join([lines[1], lines[0], *lines[2:]]) + "\n")
    assert log.verify().bad_line == 1


def test_concurrent_appenders_keep_one_chain(tmp_path: Path) -> None:
    path = tmp_path / "audit.log"

    def append_many(rank: int) -> None:
        log = AuditLog(path)
        for i in range(15):
            log.append("checkpoint.save", rank=rank, step=i)

    threads = [threading.Thread(target=append_many, args=(r,)) for r in range(3)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    result = AuditLog(path).verify()
    assert result.ok and result.num_entries == 45


def test_private_dirs_and_files_ignore_a_permissive_umask(tmp_path: Path) -> None:
    old = os.umask(0o022)
    try:
        run_dir = make_private_dir(tmp_path / "runs" / "r1")
        write_private_text(run_dir / "lineage.json", "{}")
        (run_dir / "checkpoints" / "step-1").mkdir(parents=True)
        (run_dir / "checkpoints" / "step-1" / "model.safetensors").write_bytes(b"x")
    finally:
        os.umask(old)
    assert run_dir.stat().st_mode & 0o777 == 0o700
    assert (run_dir / "lineage.json").stat().st_mode & 0o777 == 0o600
    problems = permission_problems(run_dir)
    assert len(problems) == 3 and all("group/others" in p for p in problems)  # checkpoint written with umask 022
    assert restrict_tree(run_dir) == 3
    assert permission_problems(run_dir) == []


def test_a_torn_last_line_is_cut_and_recorded_and_the_chain_stays_valid(tmp_path: Path) -> None:
    log = AuditLog(tmp_path / "audit.log")
    log.append("command", command="train")
    with open(log.path, "ab") as fh:  # a writer killed mid-line
        fh.write(b'{"seq": 1, "event": "checkpoint.sa')
    entry = log.append("checkpoint.save", step=10)
    events = [e["event"] for e in log.entries()]
    assert events == ["command", "audit.torn_tail", "checkpoint.save"]
    assert log.entries()[1]["fields"]["removed_bytes"] == len(b'{"seq": 1, "event": "checkpoint.sa')
    assert entry["seq"] == 2
    assert log.verify().ok


def test_an_edited_last_line_is_a_clear_error_not_a_traceback(tmp_path: Path) -> None:
    log = AuditLog(tmp_path / "audit.log")
    log.append("command", command="train")
    log.path.write_text(log.path.read_text().replace("{", "<", 1))
    with pytest.raises(UserInputError, match="audit.log: its last entry is not JSON"):
        log.append("command", command="report")


def test_a_private_write_that_fails_leaves_no_temp_file(tmp_path: Path) -> None:
    """Writing onto a folder failed at the rename and left `.NAME.tmp-PID` beside it (launch --emit --out DIR)."""
    import pytest

    folder = tmp_path / "job.sbatch"
    folder.mkdir()
    with pytest.raises(IsADirectoryError):
        write_private_text(folder, "#!/bin/bash\n")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["job.sbatch"] and not any(folder.iterdir())
