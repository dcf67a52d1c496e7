"""Which start of its torchrun job this is, agreed by every rank once per start, and why the job restarted.

torchrun counts restarts per agent (node) and only where workers failed (TORCHELASTIC_RESTART_COUNT): an agent
that restarts its workers because the rendezvous changed (a node joined or left, a membership change) keeps
its count. After a failure on one node the other nodes' ranks see a lower count, and after a membership change
alone every rank sees the count of the start before, 0 on a job that never failed: such a start would look
like a first one (first-start refusals, the user's `--resume` instead of the run's own newest checkpoint, no
`restart` event, the lease of its own job's earlier attempt not taken over).

So after the agreement each node's local rank 0 leaves a note in the node's temp dir (a folder per user), keyed
by the job (TORCHELASTIC_RUN_ID) and its agent (the workers' parent process: pid and start time, so a later
torchrun with a recycled pid is another agent): the attempt it agreed and the highest count. The next start of that
agent's workers reads it. The job's attempt is the highest count of any rank, or one more than the highest
noted attempt where that is higher, so one job's starts are numbered in order; it is a membership change when
some agent had noted a start and no rank's count has risen since. Without torchrun (no TORCHELASTIC_RUN_ID)
there are no notes: the attempt is the count, 0.
"""

from __future__ import annotations

import contextlib
import json
import os
import tempfile
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from leantrain.ckpt.fault import restart_attempt

JOB_ENV = "TORCHELASTIC_RUN_ID"
NOTES_DIR_NAME = "leantrain-agents"
NONE = -1  # no note: MAX-reduces below any real attempt or count


@dataclass(frozen=True)
class JobAttempt:
    """The agreed attempt of this start (0: the job's first) and whether a membership change caused it."""

    number: int = 0
    membership_change: bool = False


def notes_dir() -> Path:
    """Per user (another user's notes are neither read nor clobbered), in the node's temp dir."""
    return Path(tempfile.gettempdir()) / f"{NOTES_DIR_NAME}-{os.getuid()}"


def _process_start(pid: int) -> str:
    """The process's start time in clock ticks since boot (/proc/PID/stat field 22), '' where unreadable."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text(encoding="ascii")
    except OSError:
        return ""
    return stat.rsplit(")", 1)[-1].split()[19]  # the fields after the command name, which may hold spaces


def agent_note_path() -> Path | None:
    """This agent's note for this job, or None outside torchrun."""
    job = os.environ.get(JOB_ENV, "")
    if not job:
        return None
    agent = os.getppid()
    safe_job = "".join(c if c.isalnum() or c in "-_." else "_" for c in job)[:80]
    return notes_dir() / f"{safe_job}-{agent}-{_process_start(agent)}.json"


def read_agent_note() -> tuple[int, int]:
    """(attempt, highest count) this agent's workers agreed on at their last start; (NONE, NONE) if none."""
    path = agent_note_path()
    if path is None:
        return NONE, NONE
    try:
        note = json.loads(path.read_text(encoding="utf-8"))
        return int(note["attempt"]), int(note["count"])
    except (OSError, ValueError, KeyError, TypeError):  # no note, or one cut short: no earlier start known
        return NONE, NONE


def write_agent_note(attempt: JobAttempt, *, count: int) -> None:
    """Local rank 0 notes the agreed start for the agent's next one; notes of exited agents are removed."""
    path = agent_note_path()
    if path is None or int(os.environ.get("LOCAL_RANK", "0") or 0) != 0:
        return
    with contextlib.suppress(OSError):  # without a note a later membership change looks like a first start
        path.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
        for old in path.parent.glob("*.json"):
            pid = old.stem.rsplit("-", 2)[-2] if old.stem.count("-") >= 2 else ""
            if pid.isdigit() and old != path and not Path(f"/proc/{pid}").exists():
                old.unlink(missing_ok=True)
        tmp = path.with_suffix(f".{os.getpid()}.tmp")
        tmp.write_text(json.dumps({"attempt": attempt.number, "count": count}) + "\n", encoding="utf-8")
        os.replace(tmp, path)


def agree_job_attempt(all_max: Callable[[list[int]], list[int]] | None = None) -> JobAttempt:
    """This start's JobAttempt. `all_max`: the element-wise MAX of every rank's list, on every rank (all ranks
    call it together; None: one process)."""
    count = restart_attempt()
    noted_attempt, noted_count = read_agent_note()
    values = [count, noted_attempt, noted_count]
    highest_count, highest_noted, noted_highest_count = all_max(values) if all_max is not None else values
    membership = highest_noted != NONE and highest_count <= noted_highest_count
    attempt = JobAttempt(number=max(highest_count, highest_noted + 1 if highest_noted != NONE else 0),
                         membership_change=membership)
    write_agent_note(attempt, count=highest_count)
    return attempt
