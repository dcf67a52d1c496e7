"""The run-dir lease: one writer per run dir.

Two jobs writing one run dir double every metrics record and delete each other's checkpoints, so the writer
takes `RUN_DIR/run.lock` first: a JSON file (host, pid, start time, command, job id, a random token) created
with O_EXCL, its modification time refreshed every LEASE_HEARTBEAT_S by a daemon thread, and removed on exit.
A second `train` or `launch` finds it and exits 2 naming the holder.

Who takes it: `leantrain launch` on one node (its torchrun workers inherit it through LEASE_ENV, so a restart
of its workers never competes with it); otherwise rank 0 of the training job (`leantrain train`, alone or
under torchrun/Slurm/Kubernetes). Other ranks never touch it.

When a lease is stale, and taken over (the rule): its holder ran on this host and its pid is gone (or is this
very process and its heartbeat thread has ended: a lease an earlier call left behind), or its heartbeat is
older than LEASE_STALE_S (a holder on another host that died, was SIGKILLed or lost the file system), or it
belongs to the same torchrun job (TORCHELASTIC_RUN_ID) and this is a restart of that job's workers (the job's
restart attempt > 0: the highest TORCHELASTIC_RESTART_COUNT of any rank, which train/command.py agrees on before
it takes the lease, since torchrun counts a restart only on the node whose workers failed and a rank 0 that moved
to another node would otherwise see 0 and wait LEASE_STALE_S for its own job's old lease). A lock file that is
not readable JSON is judged by its age alone. Takeover renames the stale file aside and creates a new one with
O_EXCL, so of two contenders only one wins.
"""

from __future__ import annotations

import contextlib
import json
import os
import socket
import threading
import time
import uuid
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from leantrain.errors import UserInputError

LEASE_FILE = "run.lock"
LEASE_ENV = "LEANTRAIN_RUN_LEASE"  # "<run dir>\n<token>": a launcher's lease its workers run under
LEASE_HEARTBEAT_S = 15.0
LEASE_STALE_S = 120.0  # eight missed heartbeats
JOB_ENV = "TORCHELASTIC_RUN_ID"
RESTART_ENV = "TORCHELASTIC_RESTART_COUNT"


def lease_path(run_dir: Path) -> Path:
    return Path(run_dir) / LEASE_FILE


def read_lease(run_dir: Path) -> dict[str, Any] | None:
    """The lock file's record with its heartbeat age (`heartbeat_age_s`); None when there is none."""
    path = lease_path(run_dir)
    try:
        age_s = max(0.0, time.time() - path.stat().st_mtime)
        text = path.read_text(encoding="utf-8")
    except FileNotFoundError:
        return None
    except OSError as err:
        return {"unreadable": f"{type(err).__name__}: {err}", "heartbeat_age_s": 0.0}
    try:
        record = json.loads(text)
        if not isinstance(record, dict):
            raise ValueError
    except ValueError:
        record = {"unreadable": "not a JSON object"}
    record["heartbeat_age_s"] = age_s
    return record


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # another user's live process
        return True
    return True


def stale_reason(record: dict[str, Any], *, stale_s: float = LEASE_STALE_S, attempt: int | None = None) -> str | None:
    """Why the lease `record` may be taken over (the module's rule), or None while its holder is alive.
    `attempt`: the job's agreed restart attempt (None: this process's own TORCHELASTIC_RESTART_COUNT)."""
    age_s = float(record.get("heartbeat_age_s", 0.0))
    if age_s > stale_s:
        return f"its heartbeat is {age_s:.0f} s old (stale after {stale_s:.0f} s)"
    if "unreadable" in record:
        return None
    pid = record.get("pid")
    if record.get("host") == socket.gethostname() and isinstance(pid, int):
        if pid == os.getpid():
            held_here = any(t.name == _thread_name(record.get("token")) for t in threading.enumerate())
            return None if held_here else "this process took it in an earlier call that did not release it"
        if not _pid_alive(pid):
            return f"its process {pid} on this host has exited"
    job = os.environ.get(JOB_ENV)
    if attempt is None:
        attempt = int(os.environ.get(RESTART_ENV, "0") or 0)
    if job and record.get("job") == job and attempt > 0:
        return f"it is this torchrun job's ({job}) earlier attempt"
    return None


def describe_holder(record: dict[str, Any]) -> str:
    if "unreadable" in record:
        return f"an unreadable lock file ({record['unreadable']}; heartbeat {record['heartbeat_age_s']:.0f} s ago)"
    return (f"`leantrain {record.get('command', '?')}` on host {record.get('host', '?')} pid {record.get('pid', '?')} "
            f"since {record.get('start_time', '?')} (heartbeat {record['heartbeat_age_s']:.0f} s ago)")


@dataclass
class RunLease:
    """A held lease: `release()` stops the heartbeat and removes the file if it is still this lease's."""

    run_dir: Path
    token: str
    owned: bool = True  # False: a launcher holds it and this process runs under it
    took_over: str | None = None  # the stale holder this lease replaced, for the caller to report
    _stop: threading.Event = field(default_factory=threading.Event, repr=False)
    _thread: threading.Thread | None = field(default=None, repr=False)

    def start_heartbeat(self, interval_s: float = LEASE_HEARTBEAT_S) -> None:
        def beat() -> None:
            while not self._stop.wait(interval_s):
                with contextlib.suppress(OSError):  # a lost file system shows as a stale heartbeat elsewhere
                    os.utime(lease_path(self.run_dir))

        self._thread = threading.Thread(target=beat, name=_thread_name(self.token), daemon=True)
        self._thread.start()

    def release(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=5)
        if not self.owned:
            return
        record = read_lease(self.run_dir) or {}
        if record.get("token") == self.token:
            with contextlib.suppress(FileNotFoundError):
                lease_path(self.run_dir).unlink()


def _thread_name(token: object) -> str:
    """The heartbeat thread's name: a lease of this very process is held while its thread runs."""
    return f"leantrain-run-lease-{token}"


def _create(path: Path, record: dict[str, Any], *, owner_only: bool) -> bool:
    try:
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600 if owner_only else 0o644)
    except FileExistsError:
        return False
    with os.fdopen(fd, "w", encoding="utf-8") as fh:
        fh.write(json.dumps(record) + "\n")
        fh.flush()
        os.fsync(fh.fileno())
    return True


def _take_over(path: Path, seen: dict[str, Any]) -> bool:
    """Move the stale file aside if it is still the one judged stale; False when another process was faster."""
    aside = path.with_name(f".{path.name}.stale-{uuid.uuid4().hex[:8]}")
    try:
        os.rename(path, aside)
    except FileNotFoundError:
        return True  # released meanwhile: try to create
    moved = read_lease_file(aside)
    if moved.get("token") != seen.get("token") or moved.get("unreadable") != seen.get("unreadable"):
        with contextlib.suppress(OSError):
            os.link(aside, path)  # a fresh lease someone else just took: put it back (never over a third one)
        aside.unlink(missing_ok=True)
        return False
    aside.unlink(missing_ok=True)
    return True


def read_lease_file(path: Path) -> dict[str, Any]:
    try:
        record = json.loads(path.read_text(encoding="utf-8"))
        return record if isinstance(record, dict) else {"unreadable": "not a JSON object"}
    except (OSError, ValueError):
        return {"unreadable": "not a JSON object"}


def acquire_lease(run_dir: Path, *, command: str, owner_only: bool = True,
                  stale_s: float = LEASE_STALE_S, heartbeat_s: float = LEASE_HEARTBEAT_S,
                  attempt: int | None = None) -> RunLease:
    """Take the run dir's lease (creating the run dir), or raise UserInputError (exit 2) naming the holder.
    `attempt`: the job's agreed restart attempt (see the module's rule; None: this process's own count)."""
    from leantrain.security import make_private_dir

    run_dir = Path(run_dir)
    inherited = os.environ.get(LEASE_ENV, "")
    inherited_dir, _, inherited_token = inherited.partition("\n")
    if inherited_token and Path(inherited_dir).resolve() == run_dir.resolve():
        held = read_lease(run_dir) or {}
        if held.get("token") == inherited_token:
            return RunLease(run_dir=run_dir, token=inherited_token, owned=False)
    try:
        make_private_dir(run_dir, owner_only=owner_only)
    except OSError as err:
        raise UserInputError(f"run dir {run_dir}: cannot create it ({err.strerror or err})") from None
    token = uuid.uuid4().hex
    record = {"host": socket.gethostname(), "pid": os.getpid(), "start_time": time.strftime("%Y-%m-%dT%H:%M:%SZ",
              time.gmtime()), "started_unix": time.time(), "command": command, "job": os.environ.get(JOB_ENV),
              "token": token}
    path = lease_path(run_dir)
    took_over = None
    for _ in range(3):
        try:
            if _create(path, record, owner_only=owner_only):
                lease = RunLease(run_dir=run_dir, token=token, took_over=took_over)
                lease.start_heartbeat(heartbeat_s)
                return lease
        except OSError as err:
            raise UserInputError(f"run dir {run_dir}: cannot write its lock file {path} "
                                 f"({err.strerror or err})") from None
        held = read_lease(run_dir)
        if held is None:
            continue
        reason = stale_reason(held, stale_s=stale_s, attempt=attempt)
        if reason is None:
            raise UserInputError(
                f"run dir {run_dir} is in use by {describe_holder(held)} ({path}); wait for it to end or choose "
                f"another --run-dir. The lock is taken over only when stale: its holder's process on the same "
                f"host has exited, or its heartbeat is older than {stale_s:.0f} s")
        if _take_over(path, held):
            took_over = f"{describe_holder(held)}: {reason}"
    raise UserInputError(f"run dir {run_dir}: another process keeps taking its lock file {path}; try again")


@contextlib.contextmanager
def run_lease(run_dir: Path, *, command: str, owner_only: bool = True) -> Iterator[RunLease]:
    """`with run_lease(...)`: held for the block, released after it (also on an exception)."""
    lease = acquire_lease(run_dir, command=command, owner_only=owner_only)
    try:
        yield lease
    finally:
        lease.release()


def inherit_env(lease: RunLease) -> dict[str, str]:
    """The environment entry that lets a launcher's workers run under its lease."""
    return {LEASE_ENV: f"{lease.run_dir}\n{lease.token}"}
