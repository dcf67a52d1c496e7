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
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

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


JOB_START_FILE = "job_start.json"  # RUN_DIR/job_start.json: {"job": TORCHELASTIC_RUN_ID, "time": unix s}


def record_job_start(run_dir: Path) -> None:
    """Rank 0, at its torchrun job's first start (attempt 0): when the job started. A restart goes on from the
    run's newest checkpoint only when this job committed one (`own_good_steps`): checkpoints the run dir held
    before are not the job's own, so a first start refused (`--resume none` into a run dir with checkpoints, an
    unreadable source) is refused again on restart instead of resuming them."""
    job = os.environ.get(JOB_ENV, "")
    if not job:
        return
    path = Path(run_dir) / JOB_START_FILE
    with contextlib.suppress(OSError):  # without it a restart counts every committed checkpoint as its own
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_suffix(f".{os.getpid()}.tmp")
        tmp.write_text(json.dumps({"job": job, "time": time.time()}) + "\n", encoding="utf-8")
        os.replace(tmp, path)


def _job_started(run_dir: Path) -> float | None:
    try:
        note = json.loads((Path(run_dir) / JOB_START_FILE).read_text(encoding="utf-8"))
        return float(note["time"]) if note.get("job") == os.environ.get(JOB_ENV, "") else None
    except (OSError, ValueError, KeyError, TypeError, AttributeError):
        return None


def _split_by_job(store: Any, run_dir: Path) -> tuple[list[int], list[int]] | None:
    """(committed, uncondemned checkpoints this torchrun job saved, those that predate it), by their manifests'
    creation time against the job's start (`record_job_start`); None when the start is unknown."""
    import leantrain.ckpt.integrity as integ

    since = _job_started(run_dir)
    if since is None:
        return None
    own: list[int] = []
    older: list[int] = []
    for entry in (e for e in integ.list_steps(store) if e.good_candidate):
        try:
            mine = float(integ.read_manifest(store, entry.name)["created"]) >= since
        except (integ.IntegrityError, OSError, ValueError, TypeError, KeyError):
            continue  # unreadable: neither to go on from nor to protect (loading would condemn it)
        (own if mine else older).append(entry.step)
    return own, older


def own_good_steps(store: Any, run_dir: Path) -> list[int]:
    """The good checkpoints this job saved (a restart goes on from them); every good one when its start is
    unknown (no note, or another job's)."""
    import leantrain.ckpt.integrity as integ

    split = _split_by_job(store, run_dir)
    return [e.step for e in integ.list_steps(store) if e.good_candidate] if split is None else split[0]


def steps_before_job(store: Any, run_dir: Path) -> list[int]:
    """The good checkpoints that predate this job: a restart refuses to overwrite them as its first start did
    (`--resume none`, another run's `--resume PATH`); none when the job's start is unknown."""
    split = _split_by_job(store, run_dir)
    return [] if split is None else split[1]
